//! Messaging semantics with stock clients against a real `meridian standalone`: partitioned
//! topics, deduplication, and (as they land) the rest of what Pulsar applications rely on.
//! Each test asserts exact delivery: which messages, in what order, how many times.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use meridian_integration::{assert_seq, step, PyClient, StandaloneProc};
use serde_json::Value;

const T: Duration = Duration::from_secs(120);

fn start_with(dir: &tempfile::TempDir, env: &[(&str, &str)]) -> StandaloneProc {
    let mut s = StandaloneProc::new(dir.path());
    for (k, v) in env {
        s.env(k, v);
    }
    s.start().expect("standalone starts");
    s
}

/// Runs the Python driver to completion and returns its lines.
fn py(dir: &tempfile::TempDir, name: &str, args: &[&str]) -> Vec<Value> {
    PyClient::run(dir.path(), name, args)
        .finish(T)
        .unwrap_or_else(|e| panic!("{name}: {e:#}"))
}

fn ints(lines: &[Value], field: &str) -> Vec<u64> {
    lines
        .iter()
        .filter_map(|v| v.get(field).and_then(Value::as_u64))
        .collect()
}

fn first_i64(lines: &[Value], field: &str) -> Option<i64> {
    lines
        .iter()
        .find_map(|v| v.get(field).and_then(Value::as_i64))
}

/// Received messages grouped by the partition (topic) they came from, in arrival order.
fn by_topic(lines: &[Value]) -> BTreeMap<String, Vec<u64>> {
    let mut m: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for v in lines {
        if let (Some(i), Some(t)) = (v["i"].as_u64(), v["topic"].as_str()) {
            m.entry(t.to_string()).or_default().push(i);
        }
    }
    m
}

fn assert_each_once(got: &[u64], want: std::ops::Range<u64>) {
    let mut sorted = got.to_vec();
    sorted.sort_unstable();
    assert_seq(&sorted, want);
}

fn assert_ascending(what: &str, v: &[u64]) {
    assert!(
        v.windows(2).all(|w| w[0] < w[1]),
        "{what}: out of order: {:?}",
        &v[..v.len().min(20)]
    );
}

/// Asserts that the messages came from exactly partitions 0..n of `base`, each partition's in
/// order; returns them by partition.
fn assert_partitions(lines: &[Value], base: &str, n: u32) -> BTreeMap<String, Vec<u64>> {
    let per = by_topic(lines);
    let want: BTreeSet<String> = (0..n)
        .map(|i| format!("persistent://public/default/{base}-partition-{i}"))
        .collect();
    assert_eq!(per.keys().cloned().collect::<BTreeSet<_>>(), want);
    for (t, v) in &per {
        assert_ascending(t, v);
    }
    per
}

#[test]
fn partitioned_topics_with_the_python_client_round_robin_by_key_single_partition_and_growth() {
    let dir = tempfile::tempdir().unwrap();
    let s = start_with(
        &dir,
        &[
            (
                "MERIDIAN_BROKER_ALLOW_AUTO_TOPIC_CREATION_TYPE",
                "partitioned",
            ),
            ("MERIDIAN_BROKER_DEFAULT_NUM_PARTITIONS", "4"),
        ],
    );
    let url = s.url.as_str();

    step("round robin: 400 unbatched messages spread over the 4 auto-created partitions");
    let p = py(&dir, "p-rr", &["produce", url, "parts", "--count", "400"]);
    assert_eq!(ints(&p, "acked").len(), 400);
    let c = py(
        &dir,
        "c-rr",
        &["consume", url, "parts", "s", "--count", "400"],
    );
    assert_each_once(&ints(&c, "i"), 0..400);
    for (t, v) in &assert_partitions(&c, "parts", 4) {
        assert_eq!(
            v.len(),
            100,
            "{t} got {} of 400 round-robin messages",
            v.len()
        );
    }

    step("keyed, batched: each key stays on one partition, in order");
    let p = py(
        &dir,
        "p-key",
        &[
            "produce",
            url,
            "keyed",
            "--count",
            "300",
            "--batch",
            "--key-mod",
            "10",
        ],
    );
    assert_eq!(ints(&p, "acked").len(), 300);
    let c = py(
        &dir,
        "c-key",
        &["consume", url, "keyed", "s", "--count", "300"],
    );
    assert_each_once(&ints(&c, "i"), 0..300);
    let mut key_topics: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut key_order: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for v in &c {
        if let (Some(i), Some(t), Some(k)) =
            (v["i"].as_u64(), v["topic"].as_str(), v["key"].as_str())
        {
            assert_eq!(k, format!("k{}", i % 10), "message {i} lost its key");
            key_topics.entry(k.into()).or_default().insert(t.into());
            key_order.entry(k.into()).or_default().push(i);
        }
    }
    assert_eq!(key_topics.len(), 10);
    for (k, ts) in &key_topics {
        assert_eq!(ts.len(), 1, "key {k} went to several partitions: {ts:?}");
    }
    for (k, v) in &key_order {
        assert_ascending(k, v);
    }

    step("single-partition routing: everything on one partition");
    py(
        &dir,
        "p-one",
        &[
            "produce",
            url,
            "single",
            "--count",
            "100",
            "--routing",
            "single",
        ],
    );
    let c = py(
        &dir,
        "c-one",
        &["consume", url, "single", "s", "--count", "100"],
    );
    assert_seq(&ints(&c, "i"), 0..100);
    assert_eq!(by_topic(&c).len(), 1);

    step("a partition index beyond the count is refused");
    let p = py(
        &dir,
        "p-beyond",
        &["produce", url, "parts-partition-4", "--count", "1"],
    );
    let failed = p
        .iter()
        .find_map(|v| v["create_failed"].as_str())
        .expect("a producer on partition 4 of 4 must fail");
    assert!(failed.contains("TopicNotFound"), "{failed}");

    step("the partitioned topic grows to 6: new clients use the 6, the old data stays");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let meta = s.metadata_client().unwrap();
        let key = "/admin/partitioned-topics/public/default/persistent/parts";
        let cur = meta.get(key).await.unwrap().expect("record of parts");
        assert_eq!(
            serde_json::from_slice::<Value>(&cur.value).unwrap()["partitions"],
            4
        );
        meta.put(key, br#"{"partitions":6}"#.to_vec())
            .await
            .unwrap();
    });
    let p = py(
        &dir,
        "p-grown",
        &["produce", url, "parts", "--count", "600", "--start", "400"],
    );
    assert_eq!(ints(&p, "acked").len(), 600);
    let c = py(
        &dir,
        "c-grown",
        &["consume", url, "parts", "s", "--count", "600"],
    );
    assert_each_once(&ints(&c, "i"), 400..1000);
    assert_partitions(&c, "parts", 6);
    let log = s.log_text();
    assert!(
        log.contains("partitioned topic auto-created"),
        "auto-creation logged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_topic_with_the_rust_client_every_message_once_per_partition_in_order() {
    use futures::StreamExt;
    let dir = tempfile::tempdir().unwrap();
    let s = tokio::task::block_in_place(|| {
        start_with(
            &dir,
            &[
                (
                    "MERIDIAN_BROKER_ALLOW_AUTO_TOPIC_CREATION_TYPE",
                    "partitioned",
                ),
                ("MERIDIAN_BROKER_DEFAULT_NUM_PARTITIONS", "3"),
            ],
        )
    });
    let client = pulsar::Pulsar::builder(s.url.clone(), pulsar::TokioExecutor)
        .build()
        .await
        .expect("rust client");
    let topic = "persistent://public/default/rust-parts";
    let mut consumer: pulsar::Consumer<Vec<u8>, _> = client
        .consumer()
        .with_topic(topic)
        .with_subscription("s")
        .with_subscription_type(pulsar::SubType::Exclusive)
        .with_options(pulsar::ConsumerOptions {
            initial_position: pulsar::consumer::InitialPosition::Earliest,
            ..Default::default()
        })
        .build()
        .await
        .expect("consumer on all partitions");
    let mut producer = client
        .producer()
        .with_topic(topic)
        .with_options(pulsar::ProducerOptions {
            block_queue_if_full: true,
            ..Default::default()
        })
        .build()
        .await
        .expect("partitioned producer");
    step("300 messages, a third with keys, over 3 partitions");
    let mut receipts = Vec::new();
    for i in 0..300u64 {
        let mut m = pulsar::producer::Message {
            payload: format!("msg-{i}").into_bytes(),
            properties: [("i".to_string(), i.to_string())].into(),
            ..Default::default()
        };
        if i % 3 == 0 {
            m.partition_key = Some(format!("k{}", i % 7));
        }
        receipts.push(producer.send_non_blocking(m).await.expect("send"));
    }
    for r in receipts {
        r.await.expect("receipt");
    }
    let mut got: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut all = Vec::new();
    while all.len() < 300 {
        let msg = tokio::time::timeout(T, consumer.next())
            .await
            .expect("messages arrive")
            .expect("stream open")
            .expect("message");
        let i: u64 = msg.metadata().properties[0].value.parse().unwrap();
        assert_eq!(msg.payload.data, format!("msg-{i}").into_bytes());
        got.entry(msg.topic.clone()).or_default().push(i);
        all.push(i);
        consumer.ack(&msg).await.expect("ack");
    }
    assert_each_once(&all, 0..300);
    assert_eq!(got.len(), 3, "partitions used: {:?}", got.keys());
    for (t, v) in &got {
        assert_ascending(t, v);
    }
    drop(s);
}

#[test]
fn deduplication_drops_resent_messages_across_kill9_restarts_and_per_namespace() {
    let dir = tempfile::tempdir().unwrap();
    // Snapshots every 3 entries: recovery reads a snapshot and replays the entries after it.
    let env = [
        ("MERIDIAN_BROKER_DEDUPLICATION_ENABLED", "true"),
        ("MERIDIAN_BROKER_DEDUPLICATION_SNAPSHOT_ENTRIES", "3"),
    ];
    let mut s = start_with(&dir, &env);
    let url = s.url.clone();
    let produce = |name: &str, topic: &str, extra: &[&str]| {
        let mut args = vec!["produce", url.as_str(), topic, "--sync"];
        args.extend_from_slice(extra);
        py(&dir, name, &args)
    };

    step("producer dd sends 0..10, then resends 5..15: 5..10 are duplicates");
    let p = produce("dd1", "dd", &["--name", "dd", "--seq", "--count", "10"]);
    assert_eq!(first_i64(&p, "last_sequence_id"), Some(-1));
    assert_seq(&ints(&p, "acked"), 0..10);
    let p = produce(
        "dd2",
        "dd",
        &["--name", "dd", "--seq", "--count", "10", "--start", "5"],
    );
    assert_eq!(first_i64(&p, "last_sequence_id"), Some(9));
    assert_seq(&ints(&p, "acked"), 5..15);

    step("batched producer db sends 0..100 (ids from the client)");
    let p = produce("db1", "db", &["--name", "db", "--batch", "--count", "100"]);
    assert_eq!(ints(&p, "acked").len(), 100);

    step("kill -9 and restart: the state comes back from snapshot + replay");
    s.kill9().unwrap();
    s.start().unwrap();
    let url = s.url.clone();
    let produce = |name: &str, topic: &str, extra: &[&str]| {
        let mut args = vec!["produce", url.as_str(), topic, "--sync"];
        args.extend_from_slice(extra);
        py(&dir, name, &args)
    };
    let p = produce(
        "dd3",
        "dd",
        &["--name", "dd", "--seq", "--count", "10", "--start", "10"],
    );
    assert_eq!(first_i64(&p, "last_sequence_id"), Some(14));
    let p = produce(
        "db2",
        "db",
        &["--name", "db", "--batch", "--count", "50", "--start", "100"],
    );
    assert_eq!(
        first_i64(&p, "last_sequence_id"),
        Some(99),
        "a batch's highest id is rebuilt from its items"
    );
    assert_eq!(
        p.iter()
            .find_map(|v| v["done"].as_u64().and(v["last_sequence_id"].as_i64())),
        Some(149)
    );

    step("consumers see every message exactly once, in order");
    let c = py(
        &dir,
        "c-dd",
        &[
            "consume",
            url.as_str(),
            "dd",
            "s",
            "--count",
            "40",
            "--timeout-ms",
            "2000",
        ],
    );
    assert_seq(&ints(&c, "i"), 0..20);
    let c = py(
        &dir,
        "c-db",
        &[
            "consume",
            url.as_str(),
            "db",
            "s",
            "--count",
            "200",
            "--timeout-ms",
            "2000",
        ],
    );
    assert_seq(&ints(&c, "i"), 0..150);

    step("a namespace whose policy turns deduplication off stores resends again");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let meta = s.metadata_client().unwrap();
        meta.put(
            "/admin/namespaces/public/nodedup",
            br#"{"deduplication_enabled":false}"#.to_vec(),
        )
        .await
        .unwrap();
    });
    let t = "public/nodedup/plain";
    let p = produce("nd1", t, &["--name", "nd", "--seq", "--count", "5"]);
    assert_eq!(first_i64(&p, "last_sequence_id"), Some(-1));
    let p = produce("nd2", t, &["--name", "nd", "--seq", "--count", "5"]);
    assert_eq!(first_i64(&p, "last_sequence_id"), Some(-1));
    let c = py(
        &dir,
        "c-nd",
        &[
            "consume",
            url.as_str(),
            t,
            "s",
            "--count",
            "20",
            "--timeout-ms",
            "2000",
        ],
    );
    let got = ints(&c, "i");
    assert_eq!(got, vec![0, 1, 2, 3, 4, 0, 1, 2, 3, 4]);
}

#[test]
fn producer_access_modes_shared_exclusive_wait_for_exclusive_and_fencing_with_the_python_client() {
    let dir = tempfile::tempdir().unwrap();
    let s = start_with(&dir, &[]);
    // The scenario asserts each refusal, the wait, the fencing and the exact messages stored.
    let lines = py(&dir, "am", &["scenario", &s.url, "am", "access-modes"]);
    assert!(lines.iter().any(|v| v["ok"] == "access-modes"), "{lines:?}");
    assert!(lines.iter().any(|v| v.get("fenced_send").is_some()));
}

#[test]
fn batch_index_acks_with_the_python_client_survive_a_kill9_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = start_with(&dir, &[]);
    step("one batch of 10; messages 0, 2, 4, 6, 8 acknowledged by index");
    let lines = py(&dir, "bia1", &["batch-ack", &s.url, "bia", "--phase", "1"]);
    let first = lines
        .iter()
        .find(|v| v.get("first").is_some())
        .expect("phase 1");
    assert_eq!(
        first["first"],
        serde_json::json!((0..10).collect::<Vec<_>>())
    );
    assert_eq!(first["entries"], 1, "the 10 messages are one stored entry");
    // The subscription persists acknowledgements within broker.cursor_persist_interval_ms.
    std::thread::sleep(Duration::from_millis(1000));
    step("kill -9 and restart: only the odd ones come back");
    s.kill9().unwrap();
    s.start().unwrap();
    let lines = py(&dir, "bia2", &["batch-ack", &s.url, "bia", "--phase", "2"]);
    let again = lines.iter().find_map(|v| v.get("again")).expect("phase 2");
    assert_eq!(again, &serde_json::json!([1, 3, 5, 7, 9]));
    let after = lines.iter().find_map(|v| v.get("after_all_acked")).unwrap();
    assert_eq!(
        after,
        &serde_json::json!([]),
        "once every index is acked, nothing returns"
    );
}

/// One delivery seen by a Key_Shared consumer.
#[derive(Debug, Clone)]
struct Delivery {
    i: u64,
    key: String,
    t: f64,
    redelivery: u64,
    consumer: String,
}

fn deliveries(lines: &[Value]) -> Vec<Delivery> {
    lines
        .iter()
        .filter_map(|v| {
            Some(Delivery {
                i: v["i"].as_u64()?,
                key: v["key"].as_str()?.to_string(),
                t: v["t"].as_f64()?,
                redelivery: v["r"].as_u64()?,
                consumer: v["c"].as_str()?.to_string(),
            })
        })
        .collect()
}

/// Every message delivered, first deliveries unique, and per key the messages in the order
/// the consumers saw them (by wall clock, taken before each ack) never go backwards.
fn assert_key_order(all: &[Delivery], n: u64, keys: u64) {
    let firsts: Vec<u64> = all
        .iter()
        .filter(|d| d.redelivery == 0)
        .map(|d| d.i)
        .collect();
    let mut seen: Vec<u64> = all.iter().map(|d| d.i).collect();
    seen.sort_unstable();
    seen.dedup();
    assert_seq(&seen, 0..n);
    let mut f = firsts.clone();
    f.sort_unstable();
    f.dedup();
    assert_eq!(
        f.len(),
        firsts.len(),
        "a message was delivered twice without a redelivery count"
    );
    let mut per_key: BTreeMap<&str, Vec<&Delivery>> = BTreeMap::new();
    for d in all {
        assert_eq!(
            d.key,
            format!("k{}", d.i % keys),
            "message {} lost its key",
            d.i
        );
        per_key.entry(&d.key).or_default().push(d);
    }
    for (k, mut ds) in per_key {
        ds.sort_by(|a, b| a.t.total_cmp(&b.t));
        for w in ds.windows(2) {
            assert!(
                w[0].i <= w[1].i,
                "key {k}: message {} ({} at {:.6}) went out after {} ({} at {:.6})",
                w[1].i,
                w[1].consumer,
                w[1].t,
                w[0].i,
                w[0].consumer,
                w[0].t
            );
        }
    }
}

#[test]
fn key_shared_keeps_each_keys_order_while_consumers_join_and_leave() {
    key_shared_churn(false);
}

#[test]
fn key_shared_keeps_each_keys_order_across_a_kill9_restart_during_churn() {
    key_shared_churn(true);
}

/// Consumers a and b, then c joins while messages flow and b leaves with messages
/// unacknowledged; with `crash`, the standalone is also killed (-9) and restarted in the middle
/// (the clients reconnect to the same port). Every message is delivered, and per key the first
/// deliveries go out in order.
fn key_shared_churn(crash: bool) {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.keep_ports();
    s.start().expect("standalone starts");
    let url = s.url.clone();
    let ks = |name: &str, extra: &[&str]| {
        let mut args = vec![
            "ks-consume",
            url.as_str(),
            "ks",
            "s",
            "--name",
            name,
            "--idle-ms",
            "8000",
        ];
        args.extend_from_slice(extra);
        PyClient::run(dir.path(), name, &args)
    };
    step("consumers a (slow) and b (leaves after 300 messages, one unacknowledged) subscribe");
    let mut a = ks("a", &["--delay-ms", "1"]);
    let mut b = ks("b", &["--close-after", "300"]);
    for c in [&a, &b] {
        c.wait_for("subscription", T, |l| {
            l.iter().any(|v| v.get("subscribed").is_some())
        })
        .unwrap();
    }
    step("2,000 messages over 50 keys; consumer c joins part-way; then 1,000 more");
    let mut p1 = PyClient::run(
        dir.path(),
        "p1",
        &[
            "produce",
            &url,
            "ks",
            "--count",
            "2000",
            "--key-mod",
            "50",
            "--pause-every",
            "100",
            "--pause-ms",
            "40",
        ],
    );
    p1.wait_for("500 receipts", T, |l| {
        l.iter().filter(|v| v.get("acked").is_some()).count() >= 500
    })
    .unwrap();
    let mut c = ks("c", &[]);
    p1.finish(T).unwrap();
    if crash {
        step("kill -9 and restart on the same port while the consumers work");
        s.kill9().unwrap();
        s.start().unwrap();
    }
    py(
        &dir,
        "p2",
        &[
            "produce",
            &url,
            "ks",
            "--count",
            "1000",
            "--start",
            "2000",
            "--key-mod",
            "50",
            "--batch",
        ],
    );
    let mut all = Vec::new();
    for (name, client) in [("a", &mut a), ("b", &mut b), ("c", &mut c)] {
        let lines = client.finish(T).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let d = deliveries(&lines);
        eprintln!("consumer {name}: {} deliveries", d.len());
        all.extend(d);
    }
    assert_eq!(all.iter().filter(|d| d.consumer == "b").count(), 300);
    assert!(
        all.iter().any(|d| d.consumer == "c"),
        "the consumer that joined got no keys"
    );
    if crash {
        // Redelivery counts live in the broker's memory: after a crash what comes again has
        // count 0. So the check is on first deliveries only.
        assert_first_deliveries_in_key_order(&all, 3000, 50);
    } else {
        assert!(
            all.iter().any(|d| d.redelivery > 0),
            "b left with messages unacknowledged: they must be redelivered"
        );
        assert_key_order(&all, 3000, 50);
    }
}

/// Every message delivered; per key, the first delivery of each message in order.
fn assert_first_deliveries_in_key_order(all: &[Delivery], n: u64, keys: u64) {
    let mut seen: Vec<u64> = all.iter().map(|d| d.i).collect();
    seen.sort_unstable();
    seen.dedup();
    assert_seq(&seen, 0..n);
    let mut sorted: Vec<&Delivery> = all.iter().collect();
    sorted.sort_by(|a, b| a.t.total_cmp(&b.t));
    let mut first = std::collections::HashSet::new();
    let mut last_of_key: BTreeMap<String, (u64, String, f64)> = BTreeMap::new();
    for d in sorted {
        assert_eq!(d.key, format!("k{}", d.i % keys));
        if !first.insert(d.i) {
            continue;
        }
        if let Some((prev, who, t)) = last_of_key.get(&d.key) {
            assert!(
                *prev < d.i,
                "key {}: message {} ({} at {:.6}) first went out after {} ({} at {:.6})",
                d.key,
                d.i,
                d.consumer,
                d.t,
                prev,
                who,
                t
            );
        }
        last_of_key.insert(d.key.clone(), (d.i, d.consumer.clone(), d.t));
    }
}

#[test]
fn key_shared_sticky_ranges_split_the_keys_and_overlaps_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = start_with(&dir, &[]);
    let url = s.url.as_str();
    let ks = |name: &str, ranges: &str| {
        PyClient::run(
            dir.path(),
            name,
            &[
                "ks-consume",
                url,
                "sticky",
                "s",
                "--name",
                name,
                "--sticky",
                ranges,
                "--idle-ms",
                "3000",
            ],
        )
    };
    let mut lo = ks("lo", "0-32767");
    let mut hi = ks("hi", "32768-65535");
    for c in [&lo, &hi] {
        c.wait_for("subscription", T, |l| {
            l.iter().any(|v| v.get("subscribed").is_some())
        })
        .unwrap();
    }
    step("a third consumer overlapping [30000, 40000] is refused");
    let over = py(
        &dir,
        "over",
        &[
            "ks-consume",
            url,
            "sticky",
            "s",
            "--name",
            "over",
            "--sticky",
            "30000-40000",
        ],
    );
    let why = over
        .iter()
        .find_map(|v| v["subscribe_failed"].as_str())
        .expect("overlapping ranges refused");
    assert!(why.contains("ConsumerAssignError"), "{why}");
    step("500 messages over 40 keys: each key to the consumer whose range holds its hash");
    py(
        &dir,
        "p",
        &[
            "produce",
            url,
            "sticky",
            "--count",
            "500",
            "--key-mod",
            "40",
        ],
    );
    let mut all = deliveries(&lo.finish(T).unwrap());
    all.extend(deliveries(&hi.finish(T).unwrap()));
    assert_key_order(&all, 500, 40);
    let mut owner: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for d in &all {
        owner
            .entry(d.key.clone())
            .or_default()
            .insert(d.consumer.clone());
    }
    for (k, cs) in &owner {
        let want = if meridian_broker::broker::key_shared::key_hash(k.as_bytes()) <= 32767 {
            "lo"
        } else {
            "hi"
        };
        assert_eq!(cs, &BTreeSet::from([want.to_string()]), "key {k}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_shared_with_the_rust_client_gives_each_key_to_one_consumer_in_order() {
    use futures::StreamExt;
    let dir = tempfile::tempdir().unwrap();
    let s = tokio::task::block_in_place(|| start_with(&dir, &[]));
    let client = pulsar::Pulsar::builder(s.url.clone(), pulsar::TokioExecutor)
        .build()
        .await
        .expect("rust client");
    let topic = "rust-ks";
    let mut consumers = Vec::new();
    for name in ["x", "y"] {
        let c: pulsar::Consumer<Vec<u8>, _> = client
            .consumer()
            .with_topic(topic)
            .with_subscription("s")
            .with_consumer_name(name)
            .with_subscription_type(pulsar::SubType::KeyShared)
            .with_options(pulsar::ConsumerOptions {
                initial_position: pulsar::consumer::InitialPosition::Earliest,
                ..Default::default()
            })
            .build()
            .await
            .expect("key_shared consumer");
        consumers.push((name, c));
    }
    let mut producer = client
        .producer()
        .with_topic(topic)
        .with_options(pulsar::ProducerOptions {
            block_queue_if_full: true,
            ..Default::default()
        })
        .build()
        .await
        .expect("producer");
    step("400 messages over 20 keys to two Key_Shared consumers");
    let mut receipts = Vec::new();
    for i in 0..400u64 {
        let m = pulsar::producer::Message {
            payload: format!("msg-{i}").into_bytes(),
            properties: [("i".to_string(), i.to_string())].into(),
            partition_key: Some(format!("k{}", i % 20)),
            ..Default::default()
        };
        receipts.push(producer.send_non_blocking(m).await.expect("send"));
    }
    for r in receipts {
        r.await.expect("receipt");
    }
    let mut per_consumer: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    let mut total = 0;
    while total < 400 {
        for (name, c) in consumers.iter_mut() {
            if let Ok(Some(Ok(msg))) =
                tokio::time::timeout(Duration::from_millis(100), c.next()).await
            {
                let i: u64 = msg.metadata().properties[0].value.parse().unwrap();
                assert_eq!(msg.key().as_deref(), Some(format!("k{}", i % 20).as_str()));
                c.ack(&msg).await.expect("ack");
                per_consumer.entry(name).or_default().push(i);
                total += 1;
            }
        }
    }
    let mut all: Vec<u64> = per_consumer.values().flatten().copied().collect();
    all.sort_unstable();
    assert_seq(&all, 0..400);
    assert_eq!(per_consumer.len(), 2, "both consumers got keys");
    let mut key_owner: BTreeMap<u64, &str> = BTreeMap::new();
    for (name, got) in &per_consumer {
        for i in got {
            let prev = key_owner.insert(i % 20, name);
            assert!(
                prev.is_none_or(|p| p == *name),
                "key k{} went to both",
                i % 20
            );
        }
        for k in 0..20 {
            let mine: Vec<u64> = got.iter().copied().filter(|i| i % 20 == k).collect();
            assert_ascending(&format!("{name} k{k}"), &mine);
        }
    }
    drop(s);
}

#[test]
fn delayed_delivery_on_a_shared_subscription_is_never_early_and_survives_kill9() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = start_with(&dir, &[]);
    let consume = |name: &str, url: &str, count: &str| {
        PyClient::run(
            dir.path(),
            name,
            &[
                "consume",
                url,
                "delayed",
                "d",
                "--type",
                "shared",
                "--count",
                count,
                "--timeout-ms",
                "15000",
            ],
        )
    };
    let not_before = |lines: &[Value]| -> BTreeMap<u64, f64> {
        lines
            .iter()
            .filter_map(|v| Some((v["delayed"].as_u64()?, v["not_before"].as_f64()?)))
            .collect()
    };
    step("20 messages, the even ones delayed by 3 s");
    let mut c = consume("c1", &s.url, "20");
    c.wait_for("subscription", T, |l| {
        l.iter().any(|v| v.get("subscribed").is_some())
    })
    .unwrap();
    let sent_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let p = py(
        &dir,
        "p1",
        &[
            "produce",
            &s.url,
            "delayed",
            "--count",
            "20",
            "--delay-ms",
            "3000",
            "--delay-mod",
            "2",
        ],
    );
    let due = not_before(&p);
    assert_eq!(due.len(), 10);
    let got = c.finish(T).unwrap();
    let recv: Vec<(u64, f64)> = got
        .iter()
        .filter_map(|v| Some((v["i"].as_u64()?, v["t"].as_f64()?)))
        .collect();
    assert_each_once(&recv.iter().map(|r| r.0).collect::<Vec<_>>(), 0..20);
    for (i, t) in &recv {
        match due.get(i) {
            Some(nb) => assert!(t >= nb, "message {i} came {:.3} s early", nb - t),
            None => assert!(
                t - sent_at < 2.5,
                "undelayed message {i} took {:.3} s",
                t - sent_at
            ),
        }
    }
    let order: Vec<u64> = recv.iter().map(|r| r.0).collect();
    assert!(
        order[..10].iter().all(|i| i % 2 == 1),
        "the undelayed ones come first: {order:?}"
    );

    step("10 more, all delayed by 5 s; kill -9 while they wait in the delay index");
    let mut waiting = consume("c2", &s.url, "10");
    waiting
        .wait_for("subscription", T, |l| {
            l.iter().any(|v| v.get("subscribed").is_some())
        })
        .unwrap();
    let p = py(
        &dir,
        "p2",
        &[
            "produce",
            &s.url,
            "delayed",
            "--count",
            "10",
            "--start",
            "20",
            "--delay-ms",
            "5000",
        ],
    );
    let due = not_before(&p);
    std::thread::sleep(Duration::from_millis(1000));
    s.kill9().unwrap();
    waiting.kill9();
    assert!(
        !waiting.lines().iter().any(|v| v.get("i").is_some()),
        "nothing delivered before its time"
    );
    s.start().unwrap();
    let got = consume("c3", &s.url, "10").finish(T).unwrap();
    let recv: Vec<(u64, f64)> = got
        .iter()
        .filter_map(|v| Some((v["i"].as_u64()?, v["t"].as_f64()?)))
        .collect();
    assert_each_once(&recv.iter().map(|r| r.0).collect::<Vec<_>>(), 20..30);
    for (i, t) in &recv {
        let nb = due[i];
        assert!(
            *t >= nb,
            "message {i} came {:.3} s early after the restart",
            nb - t
        );
    }
}

/// Runs a one-process check of client.py's `semantics` command and returns its lines.
fn check(dir: &tempfile::TempDir, s: &StandaloneProc, name: &str, extra: &[&str]) -> Vec<Value> {
    let mut args = vec!["semantics", s.url.as_str(), name, name];
    args.extend_from_slice(extra);
    let lines = py(dir, name, &args);
    assert!(lines.iter().any(|v| v["ok"] == name), "{name}: {lines:?}");
    lines
}

#[test]
fn compression_of_every_codec_passes_through_and_chunked_messages_arrive_whole() {
    let dir = tempfile::tempdir().unwrap();
    // A 100 KiB limit, so that chunks are many and quick.
    let s = start_with(&dir, &[("MERIDIAN_BROKER_MESSAGE_BYTES_MAX", "102400")]);
    let lines = check(&dir, &s, "compression", &[]);
    assert_eq!(
        lines.iter().filter(|v| v.get("codec").is_some()).count(),
        10
    );
    let lines = check(&dir, &s, "chunking", &["--limit", "102400"]);
    let too_big = lines.iter().find_map(|v| v["too_big"].as_str()).unwrap();
    assert!(
        too_big.contains("MessageTooBig") || too_big.contains("too big"),
        "{too_big}"
    );
}

#[test]
fn client_dead_letter_topics_reader_seek_and_ack_timeouts_work_with_the_python_client() {
    let dir = tempfile::tempdir().unwrap();
    let s = start_with(&dir, &[]);
    let lines = check(&dir, &s, "client-dlq", &[]);
    assert!(lines.iter().any(|v| v["dead_lettered"] == 3));
    check(&dir, &s, "reader-seek", &[]);
    let lines = check(&dir, &s, "ack-timeout", &[]);
    assert!(lines
        .iter()
        .any(|v| v["redelivered_after_timeout"] == serde_json::json!([2, 3])));
}

#[test]
fn broker_side_dead_letter_policy_moves_a_message_after_n_redeliveries() {
    let dir = tempfile::tempdir().unwrap();
    let s = start_with(&dir, &[]);
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        s.metadata_client()
            .unwrap()
            .put(
                "/admin/namespaces/public/dlq",
                br#"{"dead_letter_max_redeliveries":2}"#.to_vec(),
            )
            .await
            .unwrap();
    });
    let lines = check(&dir, &s, "broker-dlq", &[]);
    assert!(lines.iter().any(|v| v["broker_dead_lettered"] == 3));
    assert!(s.log_text().contains("entries dead-lettered"));
}

#[test]
fn schemas_register_evolve_under_full_and_are_served_by_version() {
    use meridian_integration::raw::{cmd, Raw};
    use meridian_protocol::pb::{self, base_command::Type, ServerError};
    let dir = tempfile::tempdir().unwrap();
    let s = start_with(&dir, &[]);
    step("Python: JSON schema v1, then v2 with a defaulted field; incompatible ones refused");
    let lines = check(&dir, &s, "schema", &[]);
    assert_eq!(
        lines.iter().filter(|v| v.get("refused").is_some()).count(),
        2
    );

    step("GET_SCHEMA by version and latest; GET_OR_CREATE_SCHEMA; a topic without schema");
    let mut r = Raw::connected(&s.url);
    let get = |r: &mut Raw, topic: &str, version: Option<u64>| {
        r.send(&cmd(Type::GetSchema, |c| {
            c.get_schema = Some(pb::CommandGetSchema {
                request_id: 7,
                topic: topic.into(),
                schema_version: version.map(|v| v.to_be_bytes().to_vec()),
            })
        }));
        r.expect()
            .command
            .get_schema_response
            .expect("GET_SCHEMA_RESPONSE")
    };
    let latest = get(&mut r, "schema", None);
    assert_eq!(latest.schema_version, Some(1u64.to_be_bytes().to_vec()));
    let schema = latest.schema.expect("the latest schema");
    assert_eq!(schema.r#type, 2, "JSON");
    assert!(String::from_utf8_lossy(&schema.schema_data).contains("email"));
    let v0 = get(&mut r, "schema", Some(0)).schema.expect("version 0");
    assert!(!String::from_utf8_lossy(&v0.schema_data).contains("email"));
    let none = get(&mut r, "no-schema-here", None);
    assert_eq!(none.error_code, Some(ServerError::TopicNotFound as i32));
    assert!(get(&mut r, "schema", Some(9)).schema.is_none());
    let get_or_create = |r: &mut Raw, schema: pb::Schema| {
        r.send(&cmd(Type::GetOrCreateSchema, |c| {
            c.get_or_create_schema = Some(pb::CommandGetOrCreateSchema {
                request_id: 8,
                topic: "schema".into(),
                schema,
            })
        }));
        r.expect()
            .command
            .get_or_create_schema_response
            .expect("GET_OR_CREATE_SCHEMA_RESPONSE")
    };
    let again = get_or_create(&mut r, v0.clone());
    assert_eq!(again.schema_version, Some(0u64.to_be_bytes().to_vec()));
    let bad = get_or_create(
        &mut r,
        pb::Schema {
            schema_data:
                br#"{"type":"record","name":"U","fields":[{"name":"name","type":"long"}]}"#.to_vec(),
            ..v0
        },
    );
    assert_eq!(bad.error_code, Some(ServerError::IncompatibleSchema as i32));
    assert!(bad.error_message.unwrap_or_default().contains("name"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_topics_refuse_producers_and_tell_consumers_that_handle_it() {
    use futures::StreamExt;
    let dir = tempfile::tempdir().unwrap();
    let mut s = tokio::task::block_in_place(|| start_with(&dir, &[]));
    let url = s.url.clone();
    tokio::task::block_in_place(|| {
        py(&dir, "p1", &["produce", &url, "term", "--count", "10"]);
    });
    let client = pulsar::Pulsar::builder(url.clone(), pulsar::TokioExecutor)
        .build()
        .await
        .expect("rust client");
    let mut consumer: pulsar::Consumer<Vec<u8>, _> = client
        .consumer()
        .with_topic("term")
        .with_subscription("rs")
        .with_options(pulsar::ConsumerOptions {
            initial_position: pulsar::consumer::InitialPosition::Earliest,
            ..Default::default()
        })
        .build()
        .await
        .expect("consumer");
    for _ in 0..10 {
        let m = tokio::time::timeout(T, consumer.next())
            .await
            .expect("a message")
            .expect("stream open")
            .expect("message");
        consumer.ack(&m).await.expect("ack");
    }
    step("terminate through the admin API");
    let admin = s.admin_url.clone();
    let (code, out, err) = tokio::task::block_in_place(|| {
        meridian_integration::run_admin(&["--admin-url", &admin, "topics", "terminate", "term"])
    })
    .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("terminated term; last message "), "{out}");
    step("the Rust consumer, fully caught up, is told (its stream ends)");
    let end = tokio::time::timeout(T, consumer.next())
        .await
        .expect("the stream ends");
    assert!(
        end.is_none(),
        "a message after the end: {:?}",
        end.map(|r| r.is_ok())
    );
    step("producers are refused; the Python consumer (no handler) still reads everything");
    tokio::task::block_in_place(|| {
        let p = py(&dir, "p2", &["produce", &url, "term", "--count", "1"]);
        let why = p
            .iter()
            .find_map(|v| v["create_failed"].as_str())
            .expect("refused");
        assert!(why.contains("TopicTerminated"), "{why}");
        let c = py(&dir, "c", &["consume", &url, "term", "py", "--count", "10"]);
        assert_seq(&ints(&c, "i"), 0..10);
        step("after a restart the topic is still terminated");
        s.stop().unwrap();
        s.start().unwrap();
        let p = py(&dir, "p3", &["produce", &s.url, "term", "--count", "1"]);
        assert!(p.iter().any(|v| v["create_failed"]
            .as_str()
            .is_some_and(|w| w.contains("TopicTerminated"))));
        let (code, out, _) = meridian_integration::run_admin(&[
            "--admin-url",
            &s.admin_url,
            "--output",
            "json",
            "topics",
            "stats",
            "term",
        ])
        .unwrap();
        assert_eq!(code, 0);
        assert!(out.contains("\"terminated\": true"), "{out}");
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_client_schemas_evolve_and_delayed_messages_wait_on_key_shared() {
    use futures::StreamExt;
    let dir = tempfile::tempdir().unwrap();
    let s = tokio::task::block_in_place(|| start_with(&dir, &[]));
    let client = pulsar::Pulsar::builder(s.url.clone(), pulsar::TokioExecutor)
        .build()
        .await
        .expect("rust client");
    let avro = |def: &str| pulsar::proto::Schema {
        name: "user".into(),
        schema_data: def.as_bytes().to_vec(),
        r#type: pulsar::proto::schema::Type::Avro as i32,
        properties: Vec::new(),
    };
    let producer_with = |schema| {
        client
            .producer()
            .with_topic("rust-schema")
            .with_options(pulsar::ProducerOptions {
                schema: Some(schema),
                ..Default::default()
            })
            .build()
    };
    step("Avro v1, then v2 with a defaulted field; a required new field is refused");
    let v1 = r#"{"type":"record","name":"U","fields":[{"name":"id","type":"long"}]}"#;
    let v2 = r#"{"type":"record","name":"U","fields":[{"name":"id","type":"long"},{"name":"tag","type":"string","default":""}]}"#;
    let bad = r#"{"type":"record","name":"U","fields":[{"name":"id","type":"long"},{"name":"n","type":"int"}]}"#;
    let mut p1 = producer_with(avro(v1)).await.expect("v1 registers");
    p1.send_non_blocking(b"one".to_vec())
        .await
        .unwrap()
        .await
        .expect("sent with v1");
    let mut p2 = producer_with(avro(v2)).await.expect("v2 is compatible");
    p2.send_non_blocking(b"two".to_vec())
        .await
        .unwrap()
        .await
        .expect("sent with v2");
    let refused = tokio::time::timeout(Duration::from_secs(30), producer_with(avro(bad)))
        .await
        .expect("the client gives up on IncompatibleSchema");
    let err = format!("{:?}", refused.err().expect("refused"));
    assert!(err.contains("IncompatibleSchema"), "{err}");
    let mut consumer: pulsar::Consumer<Vec<u8>, _> = client
        .consumer()
        .with_topic("rust-schema")
        .with_subscription("s")
        .with_options(pulsar::ConsumerOptions {
            initial_position: pulsar::consumer::InitialPosition::Earliest,
            ..Default::default()
        })
        .build()
        .await
        .expect("consumer");
    let mut versions = Vec::new();
    for _ in 0..2 {
        let m = tokio::time::timeout(T, consumer.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        versions.push(m.payload.metadata.schema_version.clone());
        consumer.ack(&m).await.unwrap();
    }
    assert_eq!(
        versions,
        vec![
            Some(0u64.to_be_bytes().to_vec()),
            Some(1u64.to_be_bytes().to_vec())
        ]
    );

    step("Key_Shared: messages delayed by 2 s come after the others, never before their time");
    let mut ks: pulsar::Consumer<Vec<u8>, _> = client
        .consumer()
        .with_topic("rust-delayed")
        .with_subscription("ks")
        .with_subscription_type(pulsar::SubType::KeyShared)
        .build()
        .await
        .expect("key_shared consumer");
    let mut producer = client
        .producer()
        .with_topic("rust-delayed")
        .build()
        .await
        .expect("producer");
    let now_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    };
    let mut due = BTreeMap::new();
    for i in 0..20u64 {
        let mut m = pulsar::producer::Message {
            payload: format!("msg-{i}").into_bytes(),
            properties: [("i".to_string(), i.to_string())].into(),
            partition_key: Some(format!("k{}", i % 3)),
            ..Default::default()
        };
        if i % 2 == 0 {
            let at = now_ms() + 2000;
            m.deliver_at_time = Some(at);
            due.insert(i, at);
        }
        producer
            .send_non_blocking(m)
            .await
            .unwrap()
            .await
            .expect("sent");
    }
    let mut order = Vec::new();
    while order.len() < 20 {
        let m = tokio::time::timeout(T, ks.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let i: u64 = m.metadata().properties[0].value.parse().unwrap();
        if let Some(at) = due.get(&i) {
            assert!(
                now_ms() >= *at,
                "message {i} came {} ms early",
                at - now_ms()
            );
        }
        ks.ack(&m).await.unwrap();
        order.push(i);
    }
    assert!(
        order[..10].iter().all(|i| i % 2 == 1),
        "undelayed first: {order:?}"
    );
    assert_each_once(&order, 0..20);
    drop(s);
}

#[test]
fn failover_on_a_partitioned_topic_gives_each_partition_its_own_active_consumer() {
    let dir = tempfile::tempdir().unwrap();
    let s = start_with(
        &dir,
        &[
            (
                "MERIDIAN_BROKER_ALLOW_AUTO_TOPIC_CREATION_TYPE",
                "partitioned",
            ),
            ("MERIDIAN_BROKER_DEFAULT_NUM_PARTITIONS", "4"),
        ],
    );
    let url = s.url.as_str();
    step("two Failover consumers c-a and c-b subscribe before anything is sent");
    let mut consumers: Vec<PyClient> = ["c-a", "c-b"]
        .iter()
        .map(|name| {
            PyClient::run(
                dir.path(),
                name,
                &[
                    "consume",
                    url,
                    "fo-parts",
                    "fo",
                    "--count",
                    "400",
                    "--type",
                    "failover",
                    "--name",
                    name,
                    "--timeout-ms",
                    "5000",
                ],
            )
        })
        .collect();
    for c in &consumers {
        c.wait_for("subscribed", T, |l| {
            l.iter().any(|v| v.get("subscribed").is_some())
        })
        .unwrap();
    }
    std::thread::sleep(Duration::from_secs(1));
    step("400 round-robin messages: partitions 0 and 2 go to c-a, 1 and 3 to c-b");
    let p = py(
        &dir,
        "p-fo",
        &["produce", url, "fo-parts", "--count", "400"],
    );
    assert_eq!(ints(&p, "acked").len(), 400);
    let mut all = Vec::new();
    for (c, want) in consumers.iter_mut().zip([[0, 2], [1, 3]]) {
        let lines = c.finish(T).unwrap();
        let topics: BTreeSet<String> = by_topic(&lines).keys().cloned().collect();
        let expected: BTreeSet<String> = want
            .iter()
            .map(|i| format!("persistent://public/default/fo-parts-partition-{i}"))
            .collect();
        assert_eq!(topics, expected, "partitions of one consumer");
        all.extend(ints(&lines, "i"));
    }
    assert_each_once(&all, 0..400);
}
