//! Stock Pulsar clients against a real `meridian standalone` process: the Python
//! `pulsar-client` (through integration/python/client.py) and the Rust `pulsar` crate.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use meridian_integration::{
    assert_acked_consumed_in_order, assert_seq, http_get, step, PyClient, StandaloneProc,
};

const T: Duration = Duration::from_secs(120);

fn start(dir: &tempfile::TempDir) -> StandaloneProc {
    let mut s = StandaloneProc::new(dir.path());
    s.start().expect("standalone starts");
    s
}

fn py(dir: &tempfile::TempDir, name: &str, args: &[&str]) -> PyClient {
    PyClient::run(dir.path(), name, args)
}

#[test]
fn python_client_10k_batched_and_unbatched_in_order_then_sigterm_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = start(&dir);
    step("a consumer subscribes first (exclusive, earliest), then 10,000 unbatched and 10,000 batched messages");
    let mut consumer = py(
        &dir,
        "consumer",
        &["consume", &s.url, "orders", "s1", "--count", "20000"],
    );
    consumer
        .wait_for("subscription", T, |l| {
            l.iter().any(|v| v.get("subscribed").is_some())
        })
        .unwrap();
    let mut p1 = py(
        &dir,
        "p1",
        &["produce", &s.url, "orders", "--count", "10000"],
    );
    let lines = p1.finish(T).unwrap();
    assert_eq!(
        lines.iter().filter(|v| v.get("acked").is_some()).count(),
        10_000
    );
    let mut p2 = py(
        &dir,
        "p2",
        &[
            "produce", &s.url, "orders", "--count", "10000", "--start", "10000", "--batch",
        ],
    );
    let lines = p2.finish(T).unwrap();
    assert_eq!(
        lines.iter().filter(|v| v.get("acked").is_some()).count(),
        10_000
    );
    consumer.finish(T).unwrap();
    // client.py checks each payload matches its `i` property; here: every one, in order.
    assert_seq(&consumer.ints("i"), 0..20_000);

    step("/metrics and /health answer");
    let health = http_get(&s.http, "/health");
    assert!(
        health.starts_with("HTTP/1.0 200") || health.starts_with("HTTP/1.1 200"),
        "{health}"
    );
    assert!(health.contains("\"status\":\"ok\""), "{health}");
    let metrics = http_get(&s.http, "/metrics");
    for name in [
        "meridian_publish_messages_total",
        "meridian_dispatch_messages_total",
        "meridian_publish_latency_seconds",
        "meridian_storage_write_latency_seconds",
        "meridian_connections",
        // Where a publish's time goes in the standalone's bookie (`meridian perf --stats-http`).
        "meridian_bookie_add_seconds_count",
        "meridian_bookie_add_reserve_seconds_count",
        "meridian_journal_queue_seconds_count",
        "meridian_journal_write_seconds_count",
        "meridian_journal_sync_wait_seconds_count",
        "meridian_journal_sync_seconds_count",
        "meridian_journal_completion_seconds_count",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }

    step("/stats: per-topic and per-subscription figures");
    let stats = http_get(&s.http, "/stats?topic=orders");
    let body = &stats[stats.find("\r\n\r\n").unwrap() + 4..];
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    let t = &v[0];
    assert_eq!(t["topic"], "persistent://public/default/orders");
    assert_eq!(t["msgs_in_total"], 20_000);
    assert_eq!(t["msgs_out_total"], 20_000);
    assert!(t["storage_bytes"].as_u64().unwrap() > 20_000 * 9);
    assert!(t.get("msg_rate_in").is_some() && t.get("bytes_rate_out").is_some());
    let sub = &t["subscriptions"][0];
    assert_eq!(sub["name"], "s1");
    assert_eq!(sub["sub_type"], "Exclusive");
    assert_eq!(sub["backlog_entries"], 0, "{sub}");
    assert_eq!(sub["msgs_out_total"], 20_000);

    step("SIGTERM: the process stops cleanly with exit code 0");
    assert_eq!(s.stop().unwrap(), 0, "{}", s.log_text());
}

#[test]
fn failover_second_consumer_takes_over_when_the_active_one_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(&dir);
    // "a" sorts before "b": a is active.
    let mut a = py(
        &dir,
        "a",
        &[
            "consume", &s.url, "fo", "sub", "--count", "1000", "--type", "failover", "--name", "a",
        ],
    );
    a.wait_for("a subscribed", T, |l| !l.is_empty()).unwrap();
    let mut b = py(
        &dir,
        "b",
        &[
            "consume",
            &s.url,
            "fo",
            "sub",
            "--count",
            "1000",
            "--type",
            "failover",
            "--name",
            "b",
            "--timeout-ms",
            "5000",
        ],
    );
    b.wait_for("b subscribed", T, |l| !l.is_empty()).unwrap();
    step("produce 1,000 messages, kill -9 the active consumer after it has seen 200");
    let mut p = py(
        &dir,
        "p",
        &["produce", &s.url, "fo", "--count", "1000", "--sync"],
    );
    a.wait_for("200 messages at a", T, |l| {
        l.iter().filter(|v| v.get("i").is_some()).count() >= 200
    })
    .unwrap();
    a.kill9();
    p.finish(T).unwrap();
    b.finish(T).unwrap();
    let got_a: BTreeSet<u64> = a.ints("i").into_iter().collect();
    let got_b: BTreeSet<u64> = b.ints("i").into_iter().collect();
    assert!(!got_a.is_empty() && !got_b.is_empty());
    let all: BTreeSet<u64> = got_a.union(&got_b).copied().collect();
    let missing: Vec<u64> = (0..1000).filter(|i| !all.contains(i)).collect();
    assert!(
        missing.is_empty(),
        "lost in the takeover: {} such as {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    // b receives in order from the first message a had not acknowledged.
    let b_seq = b.ints("i");
    assert!(b_seq.windows(2).all(|w| w[0] < w[1]), "b out of order");
}

#[test]
fn shared_three_consumers_get_everything_and_a_closed_consumers_messages_are_redelivered() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(&dir);
    let args = |n: &str| -> Vec<String> {
        [
            "consume",
            &s.url,
            "sh",
            "work",
            "--count",
            "3000",
            "--type",
            "shared",
            "--name",
            n,
            "--timeout-ms",
            "5000",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let c1 = args("c1");
    let c2 = args("c2");
    let mut c3 = args("c3");
    c3.extend(["--close-after", "50", "--ack", "none"].map(String::from));
    let mut consumers: Vec<PyClient> = [("c1", c1), ("c2", c2), ("c3", c3)]
        .iter()
        .map(|(n, a)| {
            let a: Vec<&str> = a.iter().map(String::as_str).collect();
            py(&dir, n, &a)
        })
        .collect();
    for c in &consumers {
        c.wait_for("subscribed", T, |l| !l.is_empty()).unwrap();
    }
    step("3,000 messages to three shared consumers; c3 closes after 50 without acknowledging");
    py(&dir, "p", &["produce", &s.url, "sh", "--count", "3000"])
        .finish(T)
        .unwrap();
    let mut acked = BTreeSet::new();
    for (i, c) in consumers.iter_mut().enumerate() {
        c.finish(T).unwrap();
        if i < 2 {
            acked.extend(c.ints("i"));
        }
    }
    let c3_got = consumers[2].ints("i");
    assert!(c3_got.len() >= 50, "c3 received {}", c3_got.len());
    let missing: Vec<u64> = (0..3000).filter(|i| !acked.contains(i)).collect();
    assert!(
        missing.is_empty(),
        "c1 and c2 together must see every message; missing {} such as {:?}",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    // What c3 held came back to the others with a redelivery count.
    let redelivered: Vec<u64> = consumers[..2]
        .iter()
        .flat_map(|c| c.lines())
        .filter(|v| v.get("redelivery").and_then(|r| r.as_u64()).unwrap_or(0) > 0)
        .filter_map(|v| v.get("i").and_then(|i| i.as_u64()))
        .collect();
    for i in &c3_got {
        assert!(
            redelivered.contains(i),
            "message {i} held by c3 was not redelivered with a count"
        );
    }
}

#[test]
fn cumulative_ack_then_reconnect_redelivers_nothing_acknowledged_and_state_survives_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = start(&dir);
    py(
        &dir,
        "p",
        &["produce", &s.url, "cum", "--count", "1000", "--batch"],
    )
    .finish(T)
    .unwrap();
    step("consume 400 with cumulative acks, close");
    let mut c = py(
        &dir,
        "c1",
        &[
            "consume",
            &s.url,
            "cum",
            "sub",
            "--count",
            "400",
            "--ack",
            "cumulative",
        ],
    );
    c.finish(T).unwrap();
    assert_seq(&c.ints("i"), 0..400);
    step("reconnect: delivery resumes after the last acknowledged message");
    let mut c = py(
        &dir,
        "c2",
        &[
            "consume",
            &s.url,
            "cum",
            "sub",
            "--count",
            "300",
            "--ack",
            "cumulative",
        ],
    );
    c.finish(T).unwrap();
    let got = c.ints("i");
    // Batches of up to 100 are acknowledged whole: a batch that was partly consumed is
    // delivered again (the client skips nothing it was not told to); nothing before it.
    assert!(got[0] >= 300 && got[0] <= 400, "resumed at {}", got[0]);
    assert!(got.windows(2).all(|w| w[1] == w[0] + 1));
    let resumed_at = *got.last().unwrap() + 1;
    step("restart the standalone: the subscription's position is durable");
    assert_eq!(s.stop().unwrap(), 0);
    s.start().unwrap();
    let mut c = py(
        &dir,
        "c3",
        &[
            "consume",
            &s.url,
            "cum",
            "sub",
            "--count",
            "2000",
            "--timeout-ms",
            "3000",
        ],
    );
    c.finish(T).unwrap();
    let got = c.ints("i");
    assert!(
        got[0] <= resumed_at && got[0] + 100 > resumed_at,
        "resumed at {} after {resumed_at}",
        got[0]
    );
    assert_eq!(*got.last().unwrap(), 999);
}

#[test]
fn readers_from_earliest_and_from_a_message_id() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(&dir);
    py(&dir, "p", &["produce", &s.url, "rd", "--count", "500"])
        .finish(T)
        .unwrap();
    step("reader from earliest reads all 500 in order");
    let mut r = py(&dir, "r1", &["read", &s.url, "rd"]);
    let lines = r.finish(T).unwrap();
    assert_seq(&r.ints("i"), 0..500);
    let id_of_100 = lines
        .iter()
        .find(|v| v.get("i").and_then(|i| i.as_u64()) == Some(100))
        .and_then(|v| v.get("id"))
        .and_then(|v| v.as_str())
        .unwrap()
        .to_string();
    step("reader from the id of message 100 starts right after it");
    let mut r = py(&dir, "r2", &["read", &s.url, "rd", "--from", &id_of_100]);
    r.finish(T).unwrap();
    assert_seq(&r.ints("i"), 101..500);
    step("an inclusive reader from the id of (unbatched) message 100 starts at it");
    let mut r = py(
        &dir,
        "r2i",
        &["read", &s.url, "rd", "--from", &id_of_100, "--inclusive"],
    );
    r.finish(T).unwrap();
    assert_seq(&r.ints("i"), 100..500);
    step("reader from latest sees nothing old");
    let mut r = py(&dir, "r3", &["read", &s.url, "rd", "--from", "latest"]);
    r.finish(T).unwrap();
    assert!(r.ints("i").is_empty());
}

#[test]
fn kill9_during_production_then_restart_every_acknowledged_message_is_consumed() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = start(&dir);
    let mut p = py(
        &dir,
        "p",
        &["produce", &s.url, "crash", "--count", "1000000"],
    );
    p.wait_for("3,000 receipts", T, |l| {
        l.iter().filter(|v| v.get("acked").is_some()).count() >= 3000
    })
    .unwrap();
    step("kill -9 the standalone mid-production");
    s.kill9().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    p.kill9();
    let acked: BTreeSet<u64> = p.ints("acked").into_iter().collect();
    step(format!(
        "{} messages acknowledged; restart and consume everything",
        acked.len()
    ));
    s.start().unwrap();
    let mut c = py(
        &dir,
        "c",
        &[
            "consume",
            &s.url,
            "crash",
            "sub",
            "--count",
            "2000000",
            "--timeout-ms",
            "5000",
        ],
    );
    c.finish(T).unwrap();
    assert_acked_consumed_in_order(&acked, &c.ints("i"), "after kill -9 and a restart");
}

#[test]
fn sigterm_during_production_exits_0_and_every_acknowledged_message_survives() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = start(&dir);
    let mut p = py(
        &dir,
        "p",
        &["produce", &s.url, "term", "--count", "1000000"],
    );
    p.wait_for("2,000 receipts", T, |l| {
        l.iter().filter(|v| v.get("acked").is_some()).count() >= 2000
    })
    .unwrap();
    step("SIGTERM mid-production: in-flight sends are answered, the process exits 0");
    assert_eq!(s.stop().unwrap(), 0, "{}", s.log_text());
    std::thread::sleep(Duration::from_millis(300));
    p.kill9();
    let acked: BTreeSet<u64> = p.ints("acked").into_iter().collect();
    s.start().unwrap();
    let mut c = py(
        &dir,
        "c",
        &[
            "consume",
            &s.url,
            "term",
            "sub",
            "--count",
            "2000000",
            "--timeout-ms",
            "5000",
        ],
    );
    c.finish(T).unwrap();
    let got: BTreeSet<u64> = c.ints("i").into_iter().collect();
    let lost = acked.difference(&got).count();
    assert_eq!(
        lost,
        0,
        "{lost} of {} acknowledged messages lost",
        acked.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_client_10k_batched_and_unbatched_in_order_with_properties() {
    use futures::TryStreamExt;
    use pulsar::consumer::InitialPosition;
    use pulsar::{producer, ConsumerOptions, ProducerOptions, Pulsar, SubType, TokioExecutor};

    let dir = tempfile::tempdir().unwrap();
    let s = tokio::task::block_in_place(|| start(&dir));
    let pulsar: Pulsar<TokioExecutor> = Pulsar::builder(s.url.clone(), TokioExecutor)
        .build()
        .await
        .unwrap();
    // The Rust client sends the short name as given; the broker normalises it.
    let topic = "rust-orders";
    let mut consumer: pulsar::Consumer<Vec<u8>, TokioExecutor> = pulsar
        .consumer()
        .with_topic(topic)
        .with_subscription("rs")
        .with_subscription_type(SubType::Exclusive)
        .with_options(ConsumerOptions::default().with_initial_position(InitialPosition::Earliest))
        .build()
        .await
        .unwrap();
    step("10,000 unbatched, then 10,000 in batches of 100");
    for (batched, base) in [(false, 0u64), (true, 10_000u64)] {
        let mut p = pulsar
            .producer()
            .with_topic(topic)
            .with_options(ProducerOptions {
                batch_size: batched.then_some(100),
                block_queue_if_full: true,
                ..Default::default()
            })
            .build()
            .await
            .unwrap();
        let mut receipts = Vec::new();
        for i in base..base + 10_000 {
            let msg = producer::Message {
                payload: format!("msg-{i}").into_bytes(),
                properties: HashMap::from([("i".to_string(), i.to_string())]),
                ..Default::default()
            };
            receipts.push(p.send_non_blocking(msg).await.unwrap());
        }
        if batched {
            p.send_batch().await.unwrap();
        }
        for r in receipts {
            r.await.unwrap();
        }
    }
    let mut next = 0u64;
    while next < 20_000 {
        let msg = tokio::time::timeout(Duration::from_secs(30), consumer.try_next())
            .await
            .expect("a message within 30 s")
            .unwrap()
            .expect("stream open");
        let i: u64 = msg
            .metadata()
            .properties
            .iter()
            .find(|kv| kv.key == "i")
            .map(|kv| kv.value.parse().unwrap())
            .expect("property i");
        assert_eq!(i, next, "out of order");
        assert_eq!(msg.payload.data, format!("msg-{i}").into_bytes());
        consumer.ack(&msg).await.unwrap();
        next += 1;
    }
    drop(consumer);
}

#[test]
fn negative_acks_seek_unsubscribe_and_pattern_subscriptions_with_the_python_client() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(&dir);
    for name in ["nack", "seek", "seek-shared", "unsubscribe", "regex"] {
        step(format!("scenario {name}"));
        let mut c = py(
            &dir,
            name,
            &["scenario", &s.url, &format!("sc-{name}"), name],
        );
        let lines = c.finish(T).unwrap();
        assert!(
            lines.iter().any(|v| v["ok"] == name),
            "scenario {name}: {lines:?}"
        );
    }
}

#[test]
fn with_auto_creation_off_an_unknown_topic_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.env("MERIDIAN_BROKER_ALLOW_AUTO_TOPIC_CREATION", "false");
    s.start().unwrap();
    let mut p = py(&dir, "p", &["produce", &s.url, "nowhere", "--count", "1"]);
    let lines = p.finish(T).unwrap();
    let text = lines
        .iter()
        .find_map(|v| v["create_failed"].as_str())
        .expect("the producer must fail");
    assert!(text.contains("TopicNotFound"), "{text}");
    assert!(!lines.iter().any(|v| v.get("acked").is_some()));
}
