#!/usr/bin/env python3
"""The stock Python Pulsar client as the fault-schedule runner's (meridian-chaos) load.

Every command prints one JSON object per line and flushes; "t" is the wall-clock time.
Messages carry properties p (the producer's name) and s (its sequence number); the payload
is "P#S". Each command keeps going through broker failures (the client reconnects itself)
until the file named by --stop exists.

  produce URL TOPIC --name P --stop F [--pause-ms M] [--batch] [--send-timeout-ms T]
      sends P#0, P#1, ... (sequence id = S) one every M ms; prints {"acked": S, "id": ID,
      "l": MS} (MS from the send to its receipt) or {"failed": S, "result": R} for each, {"create_failed": R} while the producer cannot
      be made, and {"done": N} once every send has an answer after F appeared
  consume URL TOPIC SUB --type exclusive|shared|failover|key_shared --name C --stop F
          [--idle-ms I]
      a durable consumer from the earliest message; prints {"p": P, "s": S, "id": ID,
      "r": REDELIVERY} per message, then acknowledges it ({"ack_failed": ID, "result": R}
      when that fails); ends once F exists and nothing came for I ms: {"done": n}
  read URL TOPIC
      a reader from the earliest message to the last: {"p": P, "s": S, "id": ID} each, then
      {"done": n}; any failure exits non-zero (the runner reads again)

ID is "ledger:entry" (":batch_index" for a message of a batch), "-1:-1" when a receipt names
no position.
"""
import argparse
import json
import os
import sys
import threading
import time

import pulsar

LOG = pulsar.FileLogger(pulsar.LoggerLevel.Warn, "/dev/stderr")
LOCK = threading.Lock()


def out(obj):
    obj["t"] = time.time()
    line = json.dumps(obj) + "\n"
    with LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


def client(url):
    return pulsar.Client(url, operation_timeout_seconds=10, connection_timeout_ms=5000, logger=LOG)


def msg_id(mid):
    i = mid.batch_index()
    if i < 0:
        return "%d:%d" % (mid.ledger_id(), mid.entry_id())
    return "%d:%d:%d" % (mid.ledger_id(), mid.entry_id(), i)


def produce(a):
    c = client(a.url)
    kw = dict(producer_name=a.name, send_timeout_millis=a.send_timeout_ms,
              block_if_queue_full=True, max_pending_messages=1000)
    if a.batch:
        kw.update(batching_enabled=True, batching_max_messages=20, batching_max_publish_delay_ms=5)
    else:
        kw.update(batching_enabled=False)
    p = None
    while p is None and not os.path.exists(a.stop):
        try:
            p = c.create_producer(a.topic, **kw)
        except pulsar.PulsarException as e:
            out({"create_failed": str(e)})
            time.sleep(0.5)
    if p is None:
        out({"done": 0})
        c.close()
        return
    answered = [0]
    s = 0
    while not os.path.exists(a.stop):
        def done(res, mid, s=s, at=time.time()):
            if res == pulsar.Result.Ok:
                out({"acked": s, "id": msg_id(mid), "l": (time.time() - at) * 1000.0})
            else:
                out({"failed": s, "result": str(res)})
            with LOCK:
                answered[0] += 1
        props = {"p": a.name, "s": str(s)}
        p.send_async(("%s#%d" % (a.name, s)).encode(), done, properties=props, sequence_id=s,
                     partition_key="k%d" % (s % 8))
        s += 1
        time.sleep(a.pause_ms / 1000.0)
    # Every send gets its answer (a receipt, or a failure at the send timeout at the latest).
    try:
        p.flush()
    except pulsar.PulsarException as e:
        out({"flush_failed": str(e)})
    while answered[0] < s:
        time.sleep(0.05)
    out({"done": s})
    c.close()


def consume(a):
    c = client(a.url)
    types = {
        "exclusive": pulsar.ConsumerType.Exclusive,
        "shared": pulsar.ConsumerType.Shared,
        "failover": pulsar.ConsumerType.Failover,
        "key_shared": pulsar.ConsumerType.KeyShared,
    }
    cons = None
    while cons is None:
        try:
            cons = c.subscribe(a.topic, a.sub, consumer_type=types[a.type], consumer_name=a.name,
                               initial_position=pulsar.InitialPosition.Earliest,
                               replicate_subscription_state_enabled=a.replicated)
        except pulsar.PulsarException as e:
            out({"subscribe_failed": str(e)})
            time.sleep(0.5)
    out({"subscribed": a.sub})
    n = 0
    last = time.time()
    while True:
        try:
            m = cons.receive(timeout_millis=200)
        except pulsar.Timeout:
            if os.path.exists(a.stop) and time.time() - last > a.idle_ms / 1000.0:
                break
            continue
        last = time.time()
        props = m.properties()
        mid = msg_id(m.message_id())
        out({"p": props.get("p", ""), "s": int(props.get("s", "-1")), "id": mid,
             "r": m.redelivery_count()})
        n += 1
        try:
            cons.acknowledge(m)
        except pulsar.PulsarException as e:
            out({"ack_failed": mid, "result": str(e)})
    out({"done": n})
    c.close()


def read(a):
    c = client(a.url)
    r = c.create_reader(a.topic, pulsar.MessageId.earliest)
    n = 0
    while r.has_message_available():
        m = r.read_next(timeout_millis=10000)
        props = m.properties()
        out({"p": props.get("p", ""), "s": int(props.get("s", "-1")), "id": msg_id(m.message_id())})
        n += 1
    out({"done": n})
    c.close()


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("produce")
    p.add_argument("url")
    p.add_argument("topic")
    p.add_argument("--name", required=True)
    p.add_argument("--stop", required=True)
    p.add_argument("--pause-ms", type=float, default=5)
    p.add_argument("--batch", action="store_true")
    p.add_argument("--send-timeout-ms", type=int, default=30000)
    p.set_defaults(fn=produce)
    p = sub.add_parser("consume")
    p.add_argument("url")
    p.add_argument("topic")
    p.add_argument("sub")
    p.add_argument("--type", default="exclusive")
    p.add_argument("--name", required=True)
    p.add_argument("--stop", required=True)
    p.add_argument("--idle-ms", type=int, default=1000)
    p.add_argument("--replicated", action="store_true")
    p.set_defaults(fn=consume)
    p = sub.add_parser("read")
    p.add_argument("url")
    p.add_argument("topic")
    p.set_defaults(fn=read)
    a = ap.parse_args()
    a.fn(a)


if __name__ == "__main__":
    main()
