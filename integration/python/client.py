#!/usr/bin/env python3
"""Drives the stock Python Pulsar client (pulsar-client) for Meridian's process-level tests.

Every command prints one JSON object per line and flushes, so the Rust test reading its
stdout sees progress as it happens (and sees what was acknowledged before a kill -9).

  produce URL TOPIC --count N [--batch] [--start I] [--sync] [--name P] [--seq] [--key-mod K]
          [--routing round-robin|single] [--replication-clusters A,B] [--disable-replication]
      payload "msg-I", property i=I; prints {"acked": I} for each receipt, then {"done": N};
      --seq sends I as the sequence id, --key-mod K gives partition key "kI%K"; prints
      {"last_sequence_id": S} first (what the broker said for the producer name), or
      {"create_failed": REASON} if the producer cannot be created
  consume URL TOPIC SUB --count N [--type exclusive|shared|failover] [--ack individual|cumulative|none]
          [--name NAME] [--initial earliest|latest] [--timeout-ms T] [--close-after K]
      prints {"i": I, "id": "...", "redelivery": R} per message
  read URL TOPIC [--from earliest|latest|ID_HEX] [--count N]
      a reader; prints {"i": I, "id": HEX} per message, then {"done": n}
  keyed-produce URL TOPIC (--messages JSON | --count N --keys K [--size S]) [--batch]
          [--flush-every M]
      keyed messages for compaction: JSON is a list of [KEY, VALUE] (KEY null: no partition
      key; VALUE "": an empty payload, a tombstone) and "flush" entries (with --batch a batch
      holds what lies between two flushes); --count N makes [kN%K, vN padded to S bytes];
      prints {"n": N, "key": K, "value": V, "id": "L:E" or "L:E:I"} per message in send
      order once all are acknowledged, then {"done": N}
  compacted-read URL TOPIC [--sub SUB --type exclusive|failover|shared|key_shared
          [--ack none|individual|cumulative] [--batch-index-ack] [--name NAME]]
          [--from earliest|latest|L:E[:I]] [--plain] [--count N] [--first-ms T] [--idle-ms T]
          [--extra-ms T] [--check-available]
      a reader (no --sub) or a durable consumer from the earliest message, with read_compacted
      (unless --plain); prints {"subscribed": ...} or {"subscribe_failed": REASON}, then
      {"key": K or null, "value": V, "id": "L:E[:I]", "redelivery": R} per message until N
      were received or none came for T ms (--first-ms for the first); with --count and
      --extra-ms, one more receive shows a message beyond N (not acknowledged); then
      {"done": n}. --check-available (reader) prints {"has_message_available": B} first
"""
import argparse
import datetime
import json
import sys
import time

import pulsar

# The C++ client logs to stdout by default; stdout carries our JSON lines, so its log goes to
# stderr. (A Python logging.Logger here makes the client abort at interpreter exit.)
LOG = pulsar.FileLogger(pulsar.LoggerLevel.Info, "/dev/stderr")


def out(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def client(url):
    # A token from the environment authenticates (the broker checks it when authentication is on).
    import os
    token = os.environ.get("MERIDIAN_TEST_TOKEN")
    auth = pulsar.AuthenticationToken(token) if token else None
    # TLS (pulsar+ssl:// URLs): the CA to trust and, for mutual TLS, a client certificate.
    kw = {}
    ca = os.environ.get("MERIDIAN_TEST_TLS_CA")
    if ca:
        kw = dict(tls_trust_certs_file_path=ca, tls_allow_insecure_connection=False,
                  tls_validate_hostname=True)
    cert, key = os.environ.get("MERIDIAN_TEST_TLS_CERT"), os.environ.get("MERIDIAN_TEST_TLS_KEY")
    if cert and key:
        auth = pulsar.AuthenticationTLS(cert, key)
    timeout = int(os.environ.get("MERIDIAN_TEST_OP_TIMEOUT_S", "30"))
    return pulsar.Client(url, authentication=auth, operation_timeout_seconds=timeout,
                         connection_timeout_ms=10000, logger=LOG, **kw)


def produce(a):
    c = client(a.url)
    kwargs = {}
    if a.batch:
        kwargs = dict(batching_enabled=True, batching_max_messages=100, batching_max_publish_delay_ms=2)
    else:
        kwargs = dict(batching_enabled=False)
    if a.name:
        kwargs["producer_name"] = a.name
    if a.batch and a.key_mod:
        kwargs["batching_type"] = pulsar.BatchingType.KeyBased
    if a.routing == "single":
        kwargs["message_routing_mode"] = pulsar.PartitionsRoutingMode.UseSinglePartition
    try:
        p = c.create_producer(a.topic, block_if_queue_full=True, max_pending_messages=2000, **kwargs)
    except pulsar.PulsarException as e:
        out({"create_failed": str(e)})
        c.close()
        return
    out({"last_sequence_id": p.last_sequence_id()})
    for i in range(a.start, a.start + a.count):
        payload = ("msg-%d" % i).encode()
        kw = {"properties": {"i": str(i)}}
        if a.seq:
            kw["sequence_id"] = i
        if a.key_mod:
            kw["partition_key"] = "k%d" % (i % a.key_mod)
        if a.replication_clusters:
            kw["replication_clusters"] = a.replication_clusters.split(",")
        if a.disable_replication:
            kw["disable_replication"] = True
        if a.delay_ms and i % a.delay_mod == 0:
            kw["deliver_after"] = datetime.timedelta(milliseconds=a.delay_ms)
            # The client computes the same from its clock when it sends.
            out({"delayed": i, "not_before": time.time() + a.delay_ms / 1000.0})
        if a.sync:
            p.send(payload, **kw)
            out({"acked": i})
        else:
            def done(res, msg_id, i=i):
                if res == pulsar.Result.Ok:
                    out({"acked": i})
                else:
                    out({"failed": i, "result": str(res)})
            p.send_async(payload, done, **kw)
        if a.pause_every and (i + 1) % a.pause_every == 0:
            time.sleep(a.pause_ms / 1000.0)
    p.flush()
    out({"done": a.count, "last_sequence_id": p.last_sequence_id()})
    c.close()


def consume(a):
    c = client(a.url)
    types = {
        "exclusive": pulsar.ConsumerType.Exclusive,
        "shared": pulsar.ConsumerType.Shared,
        "failover": pulsar.ConsumerType.Failover,
    }
    kwargs = {}
    if a.name:
        kwargs["consumer_name"] = a.name
    initial = pulsar.InitialPosition.Earliest if a.initial == "earliest" else pulsar.InitialPosition.Latest
    cons = c.subscribe(a.topic, a.sub, consumer_type=types[a.type], initial_position=initial, **kwargs)
    out({"subscribed": a.sub})
    n = 0
    while n < a.count:
        try:
            m = cons.receive(timeout_millis=a.timeout_ms)
        except pulsar.Timeout:
            break
        i = int(m.properties()["i"])
        assert m.data() == ("msg-%d" % i).encode(), m.data()
        out({"i": i, "id": m.message_id().serialize().hex(), "redelivery": m.redelivery_count(),
             "topic": m.topic_name(), "key": m.partition_key(), "t": time.time()})
        n += 1
        if a.close_after and n >= a.close_after:
            out({"closing": n})
            cons.close()
            c.close()
            return
        if a.ack == "individual":
            cons.acknowledge(m)
        elif a.ack == "cumulative":
            cons.acknowledge_cumulative(m)
    out({"done": n})
    cons.close()
    c.close()


def read(a):
    c = client(a.url)
    if a.start == "earliest":
        start = pulsar.MessageId.earliest
    elif a.start == "latest":
        start = pulsar.MessageId.latest
    else:
        start = pulsar.MessageId.deserialize(bytes.fromhex(a.start))
    r = c.create_reader(a.topic, start, start_message_id_inclusive=a.inclusive)
    n = 0
    while n < a.count and r.has_message_available():
        m = r.read_next(timeout_millis=10000)
        out({"i": int(m.properties()["i"]), "id": m.message_id().serialize().hex()})
        n += 1
    out({"done": n})
    r.close()
    c.close()


def scenario(a):
    """Scripted checks of behaviours that need several steps in one client; prints
    {"ok": name} or raises (non-zero exit)."""
    c = client(a.url)
    t = a.topic
    p = c.create_producer(t, batching_enabled=False)
    ids = []
    for i in range(20):
        ids.append(p.send(("msg-%d" % i).encode(), properties={"i": str(i)}))
        if i % 4 == 3:
            time.sleep(0.003)
    num = lambda m: int(m.properties()["i"])

    if a.name == "nack":
        cons = c.subscribe(t, "nack", consumer_type=pulsar.ConsumerType.Shared,
                           initial_position=pulsar.InitialPosition.Earliest,
                           negative_ack_redelivery_delay_ms=100)
        first = [cons.receive(10000) for _ in range(20)]
        assert [num(m) for m in first] == list(range(20)), [num(m) for m in first]
        assert all(m.redelivery_count() == 0 for m in first)
        for m in first[:5]:
            cons.negative_acknowledge(m)
        for m in first[5:]:
            cons.acknowledge(m)
        again = sorted((num(m), m.redelivery_count()) for m in (cons.receive(10000) for _ in range(5)))
        assert again == [(i, 1) for i in range(5)], again
        try:
            cons.receive(500)
            raise AssertionError("more than the negatively acknowledged messages came back")
        except pulsar.Timeout:
            pass
    elif a.name == "seek":
        cons = c.subscribe(t, "seek", consumer_type=pulsar.ConsumerType.Exclusive,
                           initial_position=pulsar.InitialPosition.Earliest)
        got = [cons.receive(10000) for _ in range(20)]
        for m in got:
            cons.acknowledge(m)
        # The first message from 10 on whose publish time (ms) differs from its predecessor's:
        # seeking to that time must deliver exactly it first.
        k = next(i for i in range(10, 20) if got[i].publish_timestamp() > got[i - 1].publish_timestamp())
        publish_time_of_k = got[k].publish_timestamp()
        cons.seek(ids[5])
        m = cons.receive(10000)
        first = num(m)
        assert first in (5, 6), first
        rest = [first] + [num(cons.receive(10000)) for _ in range(19 - first)]
        assert rest == list(range(first, 20)), rest
        cons.seek(publish_time_of_k)
        m = cons.receive(10000)
        assert num(m) == k, (num(m), k)
        out({"seek_first": first, "seek_time_first": k})
    elif a.name == "seek-shared":
        # Two consumers on two connections; a seek by one closes both, and both come back.
        c2 = client(a.url)
        kw = dict(consumer_type=pulsar.ConsumerType.Shared,
                  initial_position=pulsar.InitialPosition.Earliest)
        x = c.subscribe(t, "sseek", consumer_name="x", **kw)
        y = c2.subscribe(t, "sseek", consumer_name="y", **kw)

        def drain(n):
            seen = []
            while len(seen) < n:
                for cons in (x, y):
                    try:
                        m = cons.receive(200)
                    except pulsar.Timeout:
                        continue
                    seen.append(num(m))
                    cons.acknowledge(m)
            return sorted(seen)

        deadline = time.time() + 20
        first = drain(20)
        assert first == list(range(20)), first
        x.seek(pulsar.MessageId.earliest)
        again = drain(20)
        assert again == list(range(20)), again
        assert time.time() < deadline
        c2.close()
    elif a.name == "unsubscribe":
        cons = c.subscribe(t, "uns", initial_position=pulsar.InitialPosition.Earliest)
        for _ in range(3):
            cons.acknowledge(cons.receive(10000))
        cons.unsubscribe()
        again = c.subscribe(t, "uns", initial_position=pulsar.InitialPosition.Earliest)
        m = again.receive(10000)
        assert num(m) == 0, "a deleted subscription starts afresh, got %d" % num(m)
    elif a.name == "regex":
        # A pattern subscription lists the namespace's topics (GET_TOPICS_OF_NAMESPACE).
        import re
        q = c.create_producer(t + "-other", batching_enabled=False)
        for i in range(20, 30):
            q.send(("msg-%d" % i).encode(), properties={"i": str(i)})
        cons = c.subscribe(re.compile("persistent://public/default/" + re.escape(t) + ".*"), "rx",
                           initial_position=pulsar.InitialPosition.Earliest)
        got = sorted(num(cons.receive(10000)) for _ in range(30))
        assert got == list(range(30)), got
    elif a.name == "access-modes":
        access_modes(a, c, t)
    else:
        raise SystemExit("unknown scenario " + a.name)
    out({"ok": a.name})
    c.close()


def access_modes(a, c, t):
    """Producer access modes on topic t + "-am" (the 20 messages on t are not used)."""
    import threading
    t = t + "-am"
    mode = pulsar.ProducerAccessMode

    def refused(kind, **kw):
        try:
            c.create_producer(t, **kw).close()
        except kind:
            return
        raise AssertionError("expected %s for %r" % (kind.__name__, kw))

    shared = c.create_producer(t)
    refused(pulsar.ProducerBusy, access_mode=mode.Exclusive)
    shared.close()
    x = c.create_producer(t, access_mode=mode.Exclusive)
    x.send(b"msg-0", properties={"i": "0"})
    refused(pulsar.ProducerBusy)
    refused(pulsar.ProducerFenced, access_mode=mode.Exclusive)

    # WaitForExclusive: created only once x leaves.
    c2 = client(a.url)
    got = {}

    def wait_for_it():
        got["p"] = c2.create_producer(t, access_mode=mode.WaitForExclusive, send_timeout_millis=3000)

    th = threading.Thread(target=wait_for_it)
    th.start()
    time.sleep(1.0)
    assert "p" not in got, "WaitForExclusive producer was created while x held the topic"
    x.send(b"msg-1", properties={"i": "1"})
    x.close()
    th.join(20)
    assert "p" in got, "WaitForExclusive producer not created after x closed"
    w = got["p"]
    w.send(b"msg-2", properties={"i": "2"})

    # ExclusiveWithFencing takes over; w is fenced and its sends fail.
    c3 = client(a.url)
    f = c3.create_producer(t, access_mode=mode.ExclusiveWithFencing)
    f.send(b"msg-3", properties={"i": "3"})
    try:
        w.send(b"fenced", properties={"i": "99"})
        raise AssertionError("a fenced producer's send succeeded")
    except pulsar.PulsarException as e:
        out({"fenced_send": str(e)})
    cons = c.subscribe(t, "am", initial_position=pulsar.InitialPosition.Earliest)
    seen = []
    while True:
        try:
            m = cons.receive(1000)
        except pulsar.Timeout:
            break
        seen.append(m.data().decode())
        cons.acknowledge(m)
    assert seen == ["msg-%d" % i for i in range(4)], seen
    f.close()
    c3.close()
    c2.close()


def timed_sends(a):
    """Sends --count messages one at a time (a pause between them) and prints how long each
    took to be acknowledged: {"acked": i, "took": seconds}, or {"failed": i, "error": ...}."""
    c = client(a.url)
    p = c.create_producer(a.topic, batching_enabled=False, send_timeout_millis=a.send_timeout_ms)
    out({"created": True})
    for i in range(a.count):
        t0 = time.time()
        try:
            p.send(("msg-%d" % i).encode().ljust(a.size, b"x"), properties={"i": str(i)})
            out({"acked": i, "took": time.time() - t0})
        except pulsar.PulsarException as e:
            out({"failed": i, "error": str(e), "took": time.time() - t0})
        time.sleep(a.pause_ms / 1000.0)
    c.close()


def start_at(a):
    """Waits for --at (seconds since the epoch), so that clients started apart measure the
    same window."""
    if a.at:
        time.sleep(max(0.0, a.at - time.time()))


def rate_produce(a):
    """Sends as fast as the client lets it for --seconds; prints the acknowledged rate over the
    window after the first second: {"rate": messages per second, "acked": n}."""
    import threading
    c = client(a.url)
    kw = dict(send_timeout_millis=60000, block_if_queue_full=True, max_pending_messages=500)
    if a.batch:
        kw.update(batching_enabled=True, batching_max_messages=10, batching_max_publish_delay_ms=5)
    else:
        kw.update(batching_enabled=False)
    p = c.create_producer(a.topic, **kw)
    acks = []
    lock = threading.Lock()
    start_at(a)

    def done(res, _msg_id):
        if res == pulsar.Result.Ok:
            with lock:
                acks.append(time.time())

    t0 = time.time()
    payload = b"x" * a.size
    while time.time() - t0 < a.seconds:
        p.send_async(payload, done)
    with lock:
        inside = [t for t in acks if t0 + 1 <= t <= t0 + a.seconds]
    out({"rate": len(inside) / (a.seconds - 1), "acked": len(acks), "start": t0})
    # Unsent messages are dropped with the client: the test has what it measured.
    c.close()


def rate_consume(a):
    """Receives for --seconds on an existing backlog; prints the rate over the window after the
    first second: {"rate": messages per second, "received": n}."""
    c = client(a.url)
    cons = c.subscribe(a.topic, a.sub, consumer_type=pulsar.ConsumerType.Shared,
                       initial_position=pulsar.InitialPosition.Earliest)
    start_at(a)
    t0 = time.time()
    times = []
    while time.time() - t0 < a.seconds:
        try:
            m = cons.receive(200)
        except pulsar.Timeout:
            continue
        times.append(time.time())
        cons.acknowledge(m)
    inside = [t for t in times if t0 + 1 <= t <= t0 + a.seconds]
    out({"rate": len(inside) / (a.seconds - 1), "received": len(times), "start": t0})
    c.close()


def batch_ack(a):
    """Batch-index acks across a restart. Phase 1: one batch of 10, the even ones acked.
    Phase 2 (after the restart): what comes back, acked; then nothing more."""
    c = client(a.url)
    kw = dict(consumer_type=pulsar.ConsumerType.Shared, batch_index_ack_enabled=True,
              initial_position=pulsar.InitialPosition.Earliest)

    def drain(cons):
        got = []
        while True:
            try:
                m = cons.receive(2000)
            except pulsar.Timeout:
                return got
            got.append((int(m.properties()["i"]), m))

    if a.phase == 1:
        p = c.create_producer(a.topic, batching_enabled=True, batching_max_messages=10,
                              batching_max_publish_delay_ms=1000)
        for i in range(10):
            p.send_async(("msg-%d" % i).encode(), None, properties={"i": str(i)})
        p.flush()
        cons = c.subscribe(a.topic, "bia", **kw)
        got = drain(cons)
        out({"first": [i for i, _ in got], "entries": len({m.message_id().entry_id() for _, m in got})})
        for i, m in got:
            if i % 2 == 0:
                cons.acknowledge(m)
        cons.close()
    else:
        cons = c.subscribe(a.topic, "bia", **kw)
        got = drain(cons)
        out({"again": [i for i, _ in got]})
        for _, m in got:
            cons.acknowledge(m)
        cons.close()
        cons = c.subscribe(a.topic, "bia", **kw)
        out({"after_all_acked": [i for i, _ in drain(cons)]})
    c.close()


def repl_sub(a):
    """A replicated subscription (Exclusive, batch-index acks). `ack`: receive `count`
    messages, acknowledge messages 0..cumulative-1 cumulatively, then `individual` more of
    the rest one by one in a shuffled order (most inside batches: batch-index acks), and
    print what was acknowledged. `drain`: print what the subscription delivers until it is
    idle for `idle_ms`, acknowledging nothing. `live`: acknowledge each message as it comes,
    until `count` or idle for `idle_ms`."""
    import random
    c = client(a.url)
    cons = c.subscribe(a.topic, a.sub, consumer_type=pulsar.ConsumerType.Exclusive,
                       initial_position=pulsar.InitialPosition.Earliest,
                       batch_index_ack_enabled=True,
                       replicate_subscription_state_enabled=True)
    out({"subscribed": a.sub})
    got = {}
    while True:
        if a.mode in ("ack", "live") and len(got) >= a.count:
            break
        try:
            m = cons.receive(timeout_millis=a.idle_ms)
        except pulsar.Timeout:
            break
        i = int(m.properties()["i"])
        if a.mode == "drain":
            out({"i": i})
        if a.mode == "live":
            cons.acknowledge(m)
        got[i] = m
    if a.mode == "live":
        out({"done": len(got)})
    elif a.mode == "ack":
        acked = list(range(a.cumulative))
        if a.cumulative:
            cons.acknowledge_cumulative(got[a.cumulative - 1])
        rest = sorted(i for i in got if i >= a.cumulative)
        rng = random.Random(a.seed)
        pick = rng.sample(rest, a.individual)
        for i in pick:
            cons.acknowledge(got[i])
        acked += pick
        out({"received": len(got), "acked": sorted(acked)})
    else:
        out({"done": len(got)})
    cons.close()
    c.close()


def ks_consume(a):
    """A Key_Shared consumer: prints {"i", "key", "t", "r", "c"} per message (t: wall clock,
    taken before the ack), acks each (unless --close-after K: the K-th is left unacked and the
    consumer closes), and stops after --idle-ms without a message."""
    c = client(a.url)
    kw = {}
    if a.sticky:
        ranges = [tuple(int(x) for x in r.split("-")) for r in a.sticky.split(",")]
        kw["key_shared_policy"] = pulsar.ConsumerKeySharedPolicy(
            pulsar.KeySharedMode.Sticky, a.ooo, ranges)
    elif a.ooo:
        kw["key_shared_policy"] = pulsar.ConsumerKeySharedPolicy(
            pulsar.KeySharedMode.AutoSplit, True)
    try:
        cons = c.subscribe(a.topic, a.sub, consumer_type=pulsar.ConsumerType.KeyShared,
                           consumer_name=a.name, receiver_queue_size=a.queue,
                           initial_position=pulsar.InitialPosition.Earliest, **kw)
    except pulsar.PulsarException as e:
        out({"subscribe_failed": str(e)})
        c.close()
        return
    out({"subscribed": a.name})
    n = 0
    while True:
        try:
            m = cons.receive(timeout_millis=a.idle_ms)
        except pulsar.Timeout:
            break
        i = int(m.properties()["i"])
        out({"i": i, "key": m.partition_key(), "t": time.time(), "r": m.redelivery_count(), "c": a.name})
        n += 1
        if a.close_after and n >= a.close_after:
            break
        if a.delay_ms:
            time.sleep(a.delay_ms / 1000.0)
        cons.acknowledge(m)
    out({"done": n})
    cons.close()
    c.close()


def multi_produce(a):
    """One message to each of --topics topics PREFIX-0..N-1 (a producer each, closed after
    its receipt); prints {"topic": i, "id": ...} per message and {"done": N}."""
    c = client(a.url)
    for i in range(a.topics):
        p = c.create_producer("%s-%d" % (a.prefix, i), batching_enabled=False)
        mid = p.send(("m-%d-%d" % (a.round, i)).encode())
        out({"topic": i, "id": msg_id_str(mid)})
        p.close()
    out({"done": a.topics})
    c.close()


def payload_of(i, size):
    """A deterministic, compressible but not constant payload of `size` bytes."""
    head = ("msg-%d|" % i).encode()
    body = bytes((i * 31 + k // 7) % 251 for k in range(max(0, size - len(head))))
    return head + body


def semantics(a):
    """One-process checks of messaging semantics; prints {"ok": name} or raises."""
    c = client(a.url)
    t = a.topic
    num = lambda m: int(m.properties()["i"])
    if a.name == "compression":
        # Every codec, batched and not: the consumer gets each payload intact.
        for kind in ("NONE", "LZ4", "ZLib", "ZSTD", "SNAPPY"):
            for batched in (False, True):
                topic = "%s-%s-%s" % (t, kind.lower(), "b" if batched else "u")
                cons = c.subscribe(topic, "s", initial_position=pulsar.InitialPosition.Earliest)
                p = c.create_producer(topic, compression_type=getattr(pulsar.CompressionType, kind),
                                      batching_enabled=batched, batching_max_messages=50)
                for i in range(200):
                    p.send_async(payload_of(i, 2000), None, properties={"i": str(i)})
                p.flush()
                for i in range(200):
                    m = cons.receive(10000)
                    assert num(m) == i and m.data() == payload_of(i, 2000), (kind, batched, i)
                    cons.acknowledge(m)
                p.close()
                cons.close()
                out({"codec": kind, "batched": batched})
    elif a.name == "chunking":
        # The broker's limit is small in this test (broker.message_bytes_max); a larger
        # message fails without chunking and arrives whole with it.
        limit = a.limit
        cons = c.subscribe(t, "s", initial_position=pulsar.InitialPosition.Earliest)
        p = c.create_producer(t, batching_enabled=False)
        try:
            p.send(payload_of(0, limit * 3), properties={"i": "0"})
            raise AssertionError("an oversized unchunked message was accepted")
        except pulsar.PulsarException as e:
            out({"too_big": str(e)})
        pc = c.create_producer(t, batching_enabled=False, chunking_enabled=True)
        sizes = [limit * 3 + 17, 100, limit * 5]
        for i, size in enumerate(sizes):
            pc.send(payload_of(i, size), properties={"i": str(i)})
        for i, size in enumerate(sizes):
            m = cons.receive(10000)
            assert num(m) == i and m.data() == payload_of(i, size), (i, len(m.data()))
            cons.acknowledge(m)
        out({"chunked": sizes})
    elif a.name == "client-dlq":
        # The Python client's own dead-letter topic relies on the broker's redelivery counts.
        p = c.create_producer(t, batching_enabled=False)
        for i in range(5):
            p.send(("msg-%d" % i).encode(), properties={"i": str(i)})
        dlq_topic = t + "-dlq"
        dlq = c.subscribe(dlq_topic, "dlq-sub", initial_position=pulsar.InitialPosition.Earliest)
        cons = c.subscribe(t, "s", consumer_type=pulsar.ConsumerType.Shared,
                           initial_position=pulsar.InitialPosition.Earliest,
                           negative_ack_redelivery_delay_ms=100,
                           dead_letter_policy=pulsar.ConsumerDeadLetterPolicy(2, dlq_topic, "dlq-sub"))
        counts = {}
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                m = cons.receive(1000)
            except pulsar.Timeout:
                if len(counts) == 5 and all(v >= 3 for k, v in counts.items() if k == 3):
                    break
                continue
            i = num(m)
            counts[i] = counts.get(i, 0) + 1
            if i == 3:
                assert m.redelivery_count() == counts[i] - 1, (m.redelivery_count(), counts[i])
                cons.negative_acknowledge(m)
            else:
                cons.acknowledge(m)
        assert counts.get(3) == 3, counts
        m = dlq.receive(10000)
        assert num(m) == 3, num(m)
        out({"dead_lettered": 3, "deliveries": counts[3]})
    elif a.name == "broker-dlq":
        # The namespace public/dlq has dead_letter_max_redeliveries = 2 (set by the test): the
        # broker moves message 3 after its third delivery; no client-side policy here.
        t = "persistent://public/dlq/" + t
        p = c.create_producer(t, batching_enabled=False)
        for i in range(5):
            p.send(("msg-%d" % i).encode(), properties={"i": str(i)})
        cons = c.subscribe(t, "s", consumer_type=pulsar.ConsumerType.Shared,
                           initial_position=pulsar.InitialPosition.Earliest,
                           negative_ack_redelivery_delay_ms=100)
        counts = {}
        while True:
            try:
                m = cons.receive(3000)
            except pulsar.Timeout:
                break
            i = num(m)
            counts[i] = counts.get(i, 0) + 1
            if i == 3:
                cons.negative_acknowledge(m)
            else:
                cons.acknowledge(m)
        assert counts == {0: 1, 1: 1, 2: 1, 3: 3, 4: 1}, counts
        dlq = c.subscribe(t + "-s-DLQ", "s", consumer_type=pulsar.ConsumerType.Shared)
        m = dlq.receive(10000)
        assert num(m) == 3 and m.data() == b"msg-3", num(m)
        assert m.properties()["REAL_TOPIC"] == t, m.properties()
        assert "ORIGIN_MESSAGE_ID" in m.properties(), m.properties()
        dlq.acknowledge(m)
        out({"broker_dead_lettered": 3, "deliveries": counts[3]})
    elif a.name == "schema":
        # JSON schemas evolve under the default FULL strategy: an optional field with a default
        # may be added; a required field without one may not; another schema type may not.
        from pulsar.schema import Record, String, Integer, Double, JsonSchema, StringSchema

        class User(Record):
            name = String()
            age = Integer()

        class UserV2(Record):
            name = String()
            age = Integer()
            email = String(required_default=True)

        class UserBad(Record):
            name = String()
            age = Integer()
            score = Double(required=True)

        p1 = c.create_producer(t, schema=JsonSchema(User))
        p1.send(User(name="ann", age=31))
        # A consumer's schema that can read the topic's is accepted without being added.
        cons = c.subscribe(t, "s", schema=JsonSchema(UserV2),
                           initial_position=pulsar.InitialPosition.Earliest)
        p2 = c.create_producer(t, schema=JsonSchema(UserV2))
        p2.send(UserV2(name="bob", age=42, email="bob@example.com"))
        for kind, kw in (("required field", dict(schema=JsonSchema(UserBad))),
                         ("other type", dict(schema=StringSchema()))):
            try:
                c.create_producer(t, **kw)
                raise AssertionError("an incompatible schema was accepted: " + kind)
            except pulsar.PulsarException as e:
                assert "IncompatibleSchema" in str(e), str(e)
                out({"refused": kind})
        plain = c.create_producer(t)  # no schema: let in, as Pulsar does by default
        got = [cons.receive(10000) for _ in range(2)]
        vals = [(m.value().name, m.value().age, m.value().email) for m in got]
        assert vals == [("ann", 31, None), ("bob", 42, "bob@example.com")], vals
        raw = [m.schema_version() for m in got]  # the 8 version bytes, as a str here
        versions = [int.from_bytes(v.encode("latin-1") if isinstance(v, str) else v, "big")
                    for v in raw]
        assert versions == [0, 1], versions
        plain.close()
        out({"schema_versions": versions})
    elif a.name == "ack-timeout":
        # Unacknowledged messages come back by themselves after the client's ack timeout (the
        # C++ client's minimum is 10 s), with their redelivery count.
        p = c.create_producer(t, batching_enabled=False)
        for i in range(4):
            p.send(("msg-%d" % i).encode(), properties={"i": str(i)})
        cons = c.subscribe(t, "s", consumer_type=pulsar.ConsumerType.Shared,
                           initial_position=pulsar.InitialPosition.Earliest,
                           unacked_messages_timeout_ms=10000)
        first = [cons.receive(10000) for _ in range(4)]
        for m in first[:2]:
            cons.acknowledge(m)
        again = sorted((num(m), m.redelivery_count()) for m in (cons.receive(20000) for _ in range(2)))
        assert again == [(2, 1), (3, 1)], again
        out({"redelivered_after_timeout": [i for i, _ in again]})
    elif a.name == "reader-seek":
        p = c.create_producer(t, batching_enabled=False)
        ids = [p.send(("msg-%d" % i).encode(), properties={"i": str(i)}) for i in range(30)]
        r = c.create_reader(t, pulsar.MessageId.earliest)
        got = [num(r.read_next(10000)) for _ in range(30)]
        assert got == list(range(30)), got
        assert not r.has_message_available()
        r.seek(ids[10])
        m = r.read_next(10000)
        assert num(m) in (10, 11), num(m)
        first = num(m)
        rest = [first] + [num(r.read_next(10000)) for _ in range(29 - first)]
        assert rest == list(range(first, 30)), rest
        r.seek(pulsar.MessageId.earliest)
        assert num(r.read_next(10000)) == 0
        out({"reader_seek_first": first})
    else:
        raise SystemExit("unknown check " + a.name)
    out({"ok": a.name})
    c.close()


def msg_id_str(mid):
    """ledger:entry, or ledger:entry:batch_index for a message of a batch."""
    i = mid.batch_index()
    if i < 0:
        return "%d:%d" % (mid.ledger_id(), mid.entry_id())
    return "%d:%d:%d" % (mid.ledger_id(), mid.entry_id(), i)


def msg_id_parse(s):
    """earliest, latest, or ledger:entry[:batch_index], as a message id to start from."""
    if s == "earliest":
        return pulsar.MessageId.earliest
    if s == "latest":
        return pulsar.MessageId.latest
    parts = [int(x) for x in s.split(":")]
    batch = parts[2] if len(parts) > 2 else -1
    return pulsar.MessageId(-1, parts[0], parts[1], batch)._msg_id


def keyed_produce(a):
    """Keyed messages (and tombstones: empty payloads) for compaction tests; see the module
    docstring. Exits non-zero if a send fails."""
    c = client(a.url)
    kw = dict(block_if_queue_full=True, max_pending_messages=2000)
    if a.batch:
        # A batch is sent at a "flush" entry (or every --flush-every messages), not by time.
        kw.update(batching_enabled=True, batching_max_messages=1000,
                  batching_max_allowed_size_in_bytes=4 << 20, batching_max_publish_delay_ms=60000)
    else:
        kw.update(batching_enabled=False)
    p = c.create_producer(a.topic, **kw)
    if a.messages is not None:
        items = json.loads(a.messages)
    else:
        items = []
        for n in range(a.count):
            items.append(["k%d" % (n % a.keys), ("v%d" % n).ljust(a.size, "x")])
            if a.flush_every and (n + 1) % a.flush_every == 0:
                items.append("flush")
    sent = []  # [key, value, id]: the id is set by the receipt
    failed = []

    def done(res, msg_id, rec):
        if res == pulsar.Result.Ok:
            rec[2] = msg_id_str(msg_id)
        else:
            failed.append("%s: %s" % (rec[0], res))

    for item in items:
        if item == "flush":
            p.flush()
            continue
        key, value = item
        rec = [key, value, None]
        sent.append(rec)
        skw = {} if key is None else {"partition_key": key}
        p.send_async(value.encode(), lambda res, mid, rec=rec: done(res, mid, rec), **skw)
    p.flush()
    deadline = time.time() + 30
    while not failed and any(r[2] is None for r in sent) and time.time() < deadline:
        time.sleep(0.01)
    if failed or any(r[2] is None for r in sent):
        out({"failed": failed, "unanswered": sum(1 for r in sent if r[2] is None)})
        c.close()
        raise SystemExit("keyed-produce: sends failed or unanswered")
    for n, (key, value, mid) in enumerate(sent):
        out({"n": n, "key": key, "value": value, "id": mid})
    out({"done": len(sent)})
    c.close()


def compacted_read(a):
    """A reader or a durable consumer with read_compacted (or without, --plain); see the
    module docstring."""
    c = client(a.url)
    compacted = not a.plain
    types = {
        "exclusive": pulsar.ConsumerType.Exclusive,
        "failover": pulsar.ConsumerType.Failover,
        "shared": pulsar.ConsumerType.Shared,
        "key_shared": pulsar.ConsumerType.KeyShared,
    }
    try:
        if a.sub:
            kw = {"consumer_name": a.name} if a.name else {}
            r = c.subscribe(a.topic, a.sub, consumer_type=types[a.type], is_read_compacted=compacted,
                            initial_position=pulsar.InitialPosition.Earliest,
                            batch_index_ack_enabled=a.batch_index_ack, **kw)
            receive = r.receive
        else:
            r = c.create_reader(a.topic, msg_id_parse(a.start), is_read_compacted=compacted)
            receive = r.read_next
    except pulsar.PulsarException as e:
        out({"subscribe_failed": "%s: %s" % (type(e).__name__, e)})
        c.close()
        return
    out({"subscribed": a.sub or "reader"})
    if a.check_available and not a.sub:
        out({"checking_available": True})
        out({"has_message_available": r.has_message_available()})

    def show(m, extra=False):
        line = {"key": m.partition_key() or None, "value": m.data().decode("utf-8", "replace"),
                "id": msg_id_str(m.message_id()), "redelivery": m.redelivery_count()}
        if extra:
            line["extra"] = True
        out(line)

    n = 0
    timeout = a.first_ms
    while a.count is None or n < a.count:
        try:
            m = receive(timeout)
        except pulsar.Timeout:
            break
        timeout = a.idle_ms
        show(m)
        n += 1
        if a.sub and a.ack == "individual":
            r.acknowledge(m)
        elif a.sub and a.ack == "cumulative":
            r.acknowledge_cumulative(m)
    if a.count is not None and n >= a.count and a.extra_ms > 0:
        try:
            show(receive(a.extra_ms), extra=True)
            n += 1
        except pulsar.Timeout:
            pass
    out({"done": n})
    r.close()
    c.close()


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("produce")
    p.add_argument("url")
    p.add_argument("topic")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--batch", action="store_true")
    p.add_argument("--sync", action="store_true")
    p.add_argument("--name")
    p.add_argument("--seq", action="store_true")
    p.add_argument("--key-mod", type=int, default=0)
    p.add_argument("--routing", default="round-robin")
    p.add_argument("--pause-every", type=int, default=0)
    p.add_argument("--delay-ms", type=int, default=0)
    p.add_argument("--delay-mod", type=int, default=1)
    p.add_argument("--pause-ms", type=int, default=0)
    p.add_argument("--replication-clusters", default="")
    p.add_argument("--disable-replication", action="store_true")
    p.set_defaults(fn=produce)
    p = sub.add_parser("multi-produce")
    p.add_argument("url")
    p.add_argument("prefix")
    p.add_argument("--topics", type=int, required=True)
    p.add_argument("--round", type=int, default=0)
    p.set_defaults(fn=multi_produce)
    p = sub.add_parser("consume")
    p.add_argument("url")
    p.add_argument("topic")
    p.add_argument("sub")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--type", default="exclusive")
    p.add_argument("--ack", default="individual")
    p.add_argument("--name")
    p.add_argument("--initial", default="earliest")
    p.add_argument("--timeout-ms", type=int, default=10000)
    p.add_argument("--close-after", type=int, default=0)
    p.set_defaults(fn=consume)
    p = sub.add_parser("read")
    p.add_argument("url")
    p.add_argument("topic")
    p.add_argument("--from", dest="start", default="earliest")
    p.add_argument("--count", type=int, default=1 << 62)
    p.add_argument("--inclusive", action="store_true")
    p.set_defaults(fn=read)
    p = sub.add_parser("repl-sub")
    p.add_argument("mode", choices=["ack", "drain", "live"])
    p.add_argument("url")
    p.add_argument("topic")
    p.add_argument("sub")
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--cumulative", type=int, default=0)
    p.add_argument("--individual", type=int, default=0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--idle-ms", type=int, default=5000)
    p.set_defaults(fn=repl_sub)
    p = sub.add_parser("ks-consume")
    p.add_argument("url")
    p.add_argument("topic")
    p.add_argument("sub")
    p.add_argument("--name", required=True)
    p.add_argument("--sticky", default="")
    p.add_argument("--ooo", action="store_true")
    p.add_argument("--close-after", type=int, default=0)
    p.add_argument("--idle-ms", type=int, default=4000)
    p.add_argument("--delay-ms", type=int, default=0)
    p.add_argument("--queue", type=int, default=100)
    p.set_defaults(fn=ks_consume)
    p = sub.add_parser("semantics")
    p.add_argument("url")
    p.add_argument("topic")
    p.add_argument("name")
    p.add_argument("--limit", type=int, default=0)
    p.set_defaults(fn=semantics)
    p = sub.add_parser("timed-sends")
    p.add_argument("url")
    p.add_argument("topic")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--pause-ms", type=int, default=50)
    p.add_argument("--send-timeout-ms", type=int, default=30000)
    p.add_argument("--size", type=int, default=0)
    p.set_defaults(fn=timed_sends)
    p = sub.add_parser("rate-produce")
    p.add_argument("url")
    p.add_argument("topic")
    p.add_argument("--seconds", type=float, default=6)
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--batch", action="store_true")
    p.add_argument("--at", type=float, default=0)
    p.set_defaults(fn=rate_produce)
    p = sub.add_parser("rate-consume")
    p.add_argument("url")
    p.add_argument("topic")
    p.add_argument("sub")
    p.add_argument("--seconds", type=float, default=6)
    p.add_argument("--at", type=float, default=0)
    p.set_defaults(fn=rate_consume)
    p = sub.add_parser("batch-ack")
    p.add_argument("url")
    p.add_argument("topic")
    p.add_argument("--phase", type=int, required=True)
    p.set_defaults(fn=batch_ack)
    p = sub.add_parser("scenario")
    p.add_argument("url")
    p.add_argument("topic")
    p.add_argument("name")
    p.set_defaults(fn=scenario)
    p = sub.add_parser("keyed-produce")
    p.add_argument("url")
    p.add_argument("topic")
    p.add_argument("--messages")
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--keys", type=int, default=1)
    p.add_argument("--size", type=int, default=0)
    p.add_argument("--batch", action="store_true")
    p.add_argument("--flush-every", type=int, default=0)
    p.set_defaults(fn=keyed_produce)
    p = sub.add_parser("compacted-read")
    p.add_argument("url")
    p.add_argument("topic")
    p.add_argument("--sub")
    p.add_argument("--type", default="exclusive",
                   choices=["exclusive", "failover", "shared", "key_shared"])
    p.add_argument("--ack", default="individual", choices=["none", "individual", "cumulative"])
    p.add_argument("--batch-index-ack", action="store_true")
    p.add_argument("--name")
    p.add_argument("--from", dest="start", default="earliest")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--count", type=int)
    p.add_argument("--first-ms", type=int, default=10000)
    p.add_argument("--idle-ms", type=int, default=10000)
    p.add_argument("--extra-ms", type=int, default=0)
    p.add_argument("--check-available", action="store_true")
    p.set_defaults(fn=compacted_read)
    a = ap.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
