//! A `meridian broker` over a separate metadata node and bookie, with storage faults the
//! broker must ride out without losing a message: a bookie that is down while a consumer asks
//! for redelivery; and unloads that come while the broker is busy (a hung unload, an unload
//! between a client finding its topic and attaching to it).

use std::time::{Duration, Instant};

use meridian_integration::raw::{cmd, flow, producer, send_frame, subscribe, Got, Raw};
use meridian_integration::{step, wait_for_bookies, BookieProc, BrokerProc, MetaCluster};
use meridian_metadata::MetadataClient;
use meridian_protocol::pb::{self, base_command::Type};
use meridian_protocol::ID_NONE;

fn wait_for_log(what: &str, log: impl Fn() -> String, needle: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while !log().contains(needle) {
        assert!(
            Instant::now() < deadline,
            "{what}: no {needle:?} within {timeout:?}:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A metadata node, a bookie (registered) and a broker over them with `env`, started.
async fn one_of_each(env: &[(&str, &str)]) -> (MetaCluster, BookieProc, BrokerProc) {
    let cluster = MetaCluster::start(1).await.expect("metadata node");
    let endpoint = cluster.endpoints()[0].clone();
    let mut bookie = BookieProc::new("bookie", cluster.root.path(), &endpoint);
    bookie.start().unwrap();
    wait_for_bookies(&cluster.client(), 1, Duration::from_secs(20))
        .await
        .unwrap();
    let mut broker = BrokerProc::new("broker", cluster.root.path(), &endpoint);
    for (k, v) in env {
        broker.env(k, v);
    }
    broker.start().unwrap();
    (cluster, bookie, broker)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_redelivery_read_fails_then_the_message_stays_pending_and_is_redelivered() {
    // No tail cache: a redelivery reads from the bookie.
    let (_cluster, mut bookie, broker) = one_of_each(&[
        ("MERIDIAN_BROKER_TAIL_CACHE_BYTES_MAX", "0"),
        ("MERIDIAN_BROKER_TAIL_CACHE_TOTAL_BYTES_MAX", "0"),
    ])
    .await;

    step("a Shared consumer receives one message and does not acknowledge it");
    let mut c = Raw::connected(&broker.url);
    let id = c.produce_one("redeliver-fault", 1, 1, b"keep me");
    c.send(&shared_s("redeliver-fault", 2));
    assert!(c.expect().command.success.is_some());
    c.send(&flow(7, 10));
    let m = c.expect().command.message.expect("MESSAGE");
    assert_eq!(m.message_id.entry_id, id.entry_id);

    step("the bookie dies; the consumer asks for redelivery; the read fails");
    bookie.kill9().unwrap();
    c.send(&cmd(Type::RedeliverUnacknowledgedMessages, |x| {
        x.redeliver_unacknowledged_messages = Some(pb::CommandRedeliverUnacknowledgedMessages {
            consumer_id: 7,
            ..Default::default()
        })
    }));
    wait_for_log(
        "broker",
        || broker.log_text(),
        "redelivery read",
        Duration::from_secs(30),
    );

    step("the bookie comes back: the message is redelivered, not lost");
    bookie.start().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let again = loop {
        match c.recv(Duration::from_secs(1)) {
            Got::Frame(f) if f.command.message.is_some() => break f.command.message.unwrap(),
            Got::Closed => panic!("connection closed"),
            _ => assert!(
                Instant::now() < deadline,
                "not redelivered within 30 s:\n{}",
                broker.log_text()
            ),
        }
        c.send(&cmd(Type::Ping, |x| x.ping = Some(pb::CommandPing {})));
    };
    assert_eq!(again.message_id.entry_id, id.entry_id);
    assert_eq!(again.redelivery_count, Some(1));
}

/// The next frame matching `pick` within `within`, answering pings (other frames skipped).
fn wait_frame(
    c: &mut Raw,
    within: Duration,
    pick: impl Fn(&pb::BaseCommand) -> bool,
) -> pb::BaseCommand {
    let deadline = Instant::now() + within;
    loop {
        match c.recv(Duration::from_millis(500)) {
            Got::Frame(f) if pick(&f.command) => return f.command,
            Got::Closed => panic!("connection closed"),
            _ => assert!(Instant::now() < deadline, "no such frame within {within:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_send_that_cannot_be_stored_then_no_later_send_of_its_producer_is_stored_before_it()
{
    let (cluster, mut bookie, broker) = one_of_each(&[]).await;
    let client = cluster.client();
    let mut c = Raw::connected(&broker.url);
    c.send(&producer("order-fault", 1, 1));
    assert!(c.expect().command.producer_success.is_some());
    c.send_raw(&send_frame(1, 0, b"m0"));
    wait_frame(&mut c, Duration::from_secs(10), |x| {
        x.send_receipt.is_some()
    });

    step("the only bookie dies: send 1 fails, and the producer is told to reconnect");
    bookie.kill9().unwrap();
    c.send_raw(&send_frame(1, 1, b"m1"));
    // SEND_ERROR and CLOSE_PRODUCER, in either order.
    let (mut error, mut closed) = (None, false);
    while error.is_none() || !closed {
        let f = wait_frame(&mut c, Duration::from_secs(60), |x| {
            x.send_error.is_some() || x.close_producer.is_some()
        });
        closed |= f.close_producer.is_some();
        if let Some(e) = f.send_error {
            error = Some(e.sequence_id);
        }
    }
    assert_eq!(error, Some(1));

    step("the bookie is back: send 2 of the same producer is still refused (it would overtake 1)");
    bookie.start().unwrap();
    wait_for_bookies(&client, 1, Duration::from_secs(20))
        .await
        .unwrap();
    c.send_raw(&send_frame(1, 2, b"m2"));
    let e = wait_frame(&mut c, Duration::from_secs(30), |x| {
        x.send_error.is_some() || x.send_receipt.is_some()
    });
    let err = e.send_error.expect("refused, not stored");
    assert!(err.message.contains("earlier send"), "{}", err.message);

    step("the client reconnects and sends 1 and 2 again (as often as it is refused, as clients do): the topic holds m0, m1, m2 in order");
    resend_then_read_in_order(&mut c, "order-fault", &broker);
}

/// A producer of `topic` named "raw" (the name `send_frame` writes into each message, so
/// deduplication applies to it).
fn named_producer(topic: &str, producer_id: u64, request_id: u64) -> pb::BaseCommand {
    let mut p = producer(topic, producer_id, request_id);
    if let Some(x) = p.producer.as_mut() {
        x.producer_name = Some("raw".into());
    }
    p
}

/// The client reconnects its producer and sends 1 and 2 again, as often as they are refused
/// (as clients do); then the topic holds m0, m1 and m2, in order, once each.
fn resend_then_read_in_order(c: &mut Raw, topic: &str, broker: &BrokerProc) {
    let mut pid = 1;
    let deadline = Instant::now() + Duration::from_secs(60);
    'resend: loop {
        // As clients do: the producer the broker closed is closed here too, then made again.
        c.send(&cmd(Type::CloseProducer, |x| {
            x.close_producer = Some(pb::CommandCloseProducer {
                producer_id: pid,
                request_id: 200 + pid,
            })
        }));
        wait_frame(c, Duration::from_secs(10), |x| {
            x.success.is_some() || x.error.is_some()
        });
        pid += 1;
        c.send(&named_producer(topic, pid, 100 + pid));
        wait_frame(c, Duration::from_secs(10), |x| x.producer_success.is_some());
        for (seq, body) in [(1, &b"m1"[..]), (2, &b"m2"[..])] {
            c.send_raw(&send_frame(pid, seq, body));
            let f = wait_frame(c, Duration::from_secs(30), |x| {
                x.send_receipt.is_some() || x.send_error.is_some()
            });
            if f.send_error.is_some() {
                assert!(
                    Instant::now() < deadline,
                    "still refused after 60 s: {:?}\n{}",
                    f.send_error,
                    broker.log_text()
                );
                std::thread::sleep(Duration::from_millis(200));
                continue 'resend;
            }
        }
        break;
    }
    read_m0_m1_m2(c, topic);
    assert!(
        matches!(c.recv(Duration::from_millis(700)), Got::Nothing),
        "more than the three"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_failed_send_not_yet_broken_off_then_a_later_send_waits_and_is_not_stored_before_it(
) {
    // The receipt task learns of a failed send, then waits 15 s before it breaks the producer
    // off: the window in which a later send could land in a new ledger ahead of it.
    let (cluster, mut bookie, broker) = one_of_each(&[
        ("MERIDIAN_BROKER_DEDUPLICATION_ENABLED", "true"),
        ("MERIDIAN_TEST_FAILPOINTS", "publish:slow_break_off"),
    ])
    .await;
    let client = cluster.client();
    let mut c = Raw::connected(&broker.url);
    c.send(&named_producer("race-fault", 1, 1));
    assert!(c.expect().command.producer_success.is_some());
    c.send_raw(&send_frame(1, 0, b"m0"));
    wait_frame(&mut c, Duration::from_secs(10), |x| {
        x.send_receipt.is_some()
    });

    step("the only bookie dies under send 1; its ledger's writer gives up; the bookie comes back");
    bookie.kill9().unwrap();
    // Its registration goes with its session: gone before it registers again.
    let deadline = Instant::now() + Duration::from_secs(30);
    while client
        .list("/bookies/available/", "", 0)
        .await
        .map_or(true, |p| !p.kvs.is_empty())
    {
        assert!(
            Instant::now() < deadline,
            "the killed bookie stayed registered"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    c.send_raw(&send_frame(1, 1, b"m1"));
    wait_for_log(
        "broker",
        || broker.log_text(),
        "ledger writer failed",
        Duration::from_secs(30),
    );
    bookie.start().unwrap();
    wait_for_bookies(&client, 1, Duration::from_secs(20))
        .await
        .unwrap();
    // Until the broker's ledger client counts it writable again (it polls): a new ledger
    // could be made now, well inside the 15 s before the producer is broken off.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    step(
        "send 2 before the producer is broken off: refused, not stored in a new ledger ahead of 1",
    );
    c.send_raw(&send_frame(1, 2, b"m2"));
    let mut refused = Vec::new();
    while refused.len() < 2 {
        let f = wait_frame(&mut c, Duration::from_secs(30), |x| {
            x.send_error.is_some() || x.send_receipt.is_some()
        });
        match (f.send_error, f.send_receipt) {
            (Some(e), _) => refused.push(e.sequence_id),
            (None, Some(r)) => panic!("send {} was stored: {r:?}", r.sequence_id),
            _ => unreachable!("picked above"),
        }
    }
    assert_eq!(refused, [1, 2]);
    let waited = meridian_integration::metric_value(
        &meridian_integration::http_get(&broker.http, "/metrics"),
        "meridian_publish_waits_for_in_flight_total",
    );
    assert_eq!(waited, 1.0, "send 2 waited for send 1's outcome");

    step(
        "the client sends 1 and 2 again: with deduplication on, neither is dropped as a duplicate",
    );
    resend_then_read_in_order(&mut c, "race-fault", &broker);
}

/// The producer's answers (receipts and refusals, by sequence id) up to and including its
/// CLOSE_PRODUCER, in the order they came.
fn answers_until_close(c: &mut Raw) -> Vec<String> {
    let mut seen = Vec::new();
    while seen.last().is_none_or(|s: &String| s != "close") {
        let f = wait_frame(c, Duration::from_secs(30), |x| {
            x.send_receipt.is_some() || x.send_error.is_some() || x.close_producer.is_some()
        });
        seen.push(match (f.send_receipt, f.send_error, f.close_producer) {
            (Some(r), _, _) => format!("receipt {}", r.sequence_id),
            (_, Some(e), _) => format!("refused {}", e.sequence_id),
            _ => "close".to_string(),
        });
    }
    seen
}

/// A broker restarted at once after a kill -9 takes over its earlier run's registration;
/// when that expires between being read and being deleted, the broker registers anyway (it
/// exited with a version conflict: a schedule's "could not be healed").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_earlier_runs_registration_expiring_during_the_takeover_then_the_broker_registers()
{
    let (_cluster, _bookie, mut broker) =
        one_of_each(&[("MERIDIAN_BROKER_SESSION_TTL_MS", "2000")]).await;
    let mut c = Raw::connected(&broker.url);
    c.produce_one("takeover", 1, 1, b"m0");
    drop(c);
    step("kill -9, restarted at once; the takeover pauses past the old session's expiry");
    broker.kill9().unwrap();
    broker.env("MERIDIAN_TEST_FAILPOINTS", "register:slow_takeover");
    broker.start().expect("the broker starts");
    assert!(
        broker.log_text().contains("register:slow_takeover"),
        "the takeover met the expiry:\n{}",
        broker.log_text()
    );
    step("it serves");
    let mut c = Raw::connected(&broker.url);
    c.produce_one("takeover", 2, 2, b"m1");
}

/// A stock client drops receipts that come after its producer's CLOSE_PRODUCER; one that is
/// re-created before any receipt reached it then numbers new messages again from the
/// broker's last sequence id, over ids of messages still pending, which deduplication drops
/// as repeats (acknowledged, never stored: seen with the Python client in `site_cluster`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_producer_broken_off_with_sends_in_flight_then_their_receipts_come_before_its_close(
) {
    let (_cluster, mut bookie, broker) =
        one_of_each(&[("MERIDIAN_BROKER_DEDUPLICATION_ENABLED", "true")]).await;
    let mut c = Raw::connected(&broker.url);
    c.send(&named_producer("close-after-receipts", 1, 1));
    assert!(c.expect().command.producer_success.is_some());

    step(
        "the bookie paused: sends 0, 1, 2 in flight; then 0 again, refused as still being written",
    );
    bookie.pause(true).unwrap();
    for i in 0..3 {
        c.send_raw(&send_frame(1, i, format!("m{i}").as_bytes()));
    }
    c.send_raw(&send_frame(1, 0, b"m0"));
    std::thread::sleep(Duration::from_millis(1500));
    bookie.pause(false).unwrap();

    step("receipts 0, 1, 2, then the refusal, then CLOSE_PRODUCER");
    let seen = answers_until_close(&mut c);
    assert_eq!(
        seen,
        ["receipt 0", "receipt 1", "receipt 2", "refused 0", "close"],
        "{}",
        broker.log_text()
    );
}

/// As above for a producer the broker closes because its topic is unloaded: the sends it
/// took before are answered first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_topic_unloaded_with_sends_in_flight_then_their_receipts_come_before_its_producers_close(
) {
    let (_cluster, mut bookie, broker) = one_of_each(&[]).await;
    let mut c = Raw::connected(&broker.url);
    c.send(&producer("unload-after-receipts", 1, 1));
    assert!(c.expect().command.producer_success.is_some());

    step("the bookie paused: sends 0, 1, 2 in flight; the topic is unloaded meanwhile");
    bookie.pause(true).unwrap();
    for i in 0..3 {
        c.send_raw(&send_frame(1, i, format!("m{i}").as_bytes()));
    }
    std::thread::sleep(Duration::from_millis(300));
    let mut unload = std::process::Command::new(meridian_integration::admin_bin())
        .args(["--admin-url", &broker.admin_url])
        .args(["topics", "unload", &full_name("unload-after-receipts")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The producer is closed as the unload begins; closing the log waits for the bookie.
    wait_for_log(
        "broker",
        || broker.log_text(),
        "topic unloading",
        Duration::from_secs(30),
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        unload.try_wait().unwrap().is_none(),
        "the unload waits for the bookie"
    );
    step("a send after the close is refused without an answer; the bookie resumes");
    c.send_raw(&send_frame(1, 3, b"m3"));
    std::thread::sleep(Duration::from_millis(200));
    bookie.pause(false).unwrap();

    step("receipts 0, 1, 2, then CLOSE_PRODUCER");
    let seen = answers_until_close(&mut c);
    assert_eq!(
        seen,
        ["receipt 0", "receipt 1", "receipt 2", "close"],
        "{}",
        broker.log_text()
    );
    assert!(unload.wait().unwrap().success(), "the unload succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_throttled_send_being_handed_on_when_its_producer_closes_then_its_resend_is_deduplicated(
) {
    // A throttled send, once appended, waits 8 s before it is handed to the receipt task.
    let (_cluster, _bookie, broker) = one_of_each(&[
        ("MERIDIAN_BROKER_DEDUPLICATION_ENABLED", "true"),
        ("MERIDIAN_BROKER_POLICY_REFRESH_INTERVAL_MS", "200"),
        ("MERIDIAN_TEST_FAILPOINTS", "publish:slow_hand_off"),
    ])
    .await;
    let mut c = Raw::connected(&broker.url);
    c.send(&named_producer("throttled-close", 1, 1));
    assert!(c.expect().command.producer_success.is_some());
    c.send_raw(&send_frame(1, 0, b"m0"));
    wait_frame(&mut c, Duration::from_secs(10), |x| {
        x.send_receipt.is_some()
    });

    step("a publish rate of 1 msg/s: sends 1 and 2 at once, so at least one is throttled");
    meridian_integration::geo_sites::admin_ok(&[
        "--admin-url",
        &broker.admin_url,
        "namespaces",
        "set-publish-rate",
        "public/default",
        "--msg-publish-rate",
        "1",
    ]);
    std::thread::sleep(Duration::from_secs(1));
    c.send_raw(&send_frame(1, 1, b"m1"));
    c.send_raw(&send_frame(1, 2, b"m2"));
    step("the producer closes while a throttled send, appended, is being handed on (8 s)");
    wait_for_log(
        "broker",
        || broker.log_text(),
        "publish:slow_hand_off",
        Duration::from_secs(30),
    );
    let held_from = Instant::now();
    // The resends below are not throttled (nor held).
    meridian_integration::geo_sites::admin_ok(&[
        "--admin-url",
        &broker.admin_url,
        "namespaces",
        "remove-publish-rate",
        "public/default",
    ]);
    assert!(
        held_from.elapsed() < Duration::from_secs(4),
        "the close comes well inside the hold"
    );
    step("the client makes its producer again and resends 1 and 2: neither is refused for good, each is stored once");
    resend_then_read_in_order(&mut c, "throttled-close", &broker);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_topic_s_log_fenced_while_its_broker_still_owns_it_then_a_new_producer_loads_it_again(
) {
    let (_cluster, _bookie, broker, _client, mut c) = fenced_after_m0_m1("fenced-log").await;

    step("the client makes its producer again: the topic is loaded again and takes m2");
    let mut pid = 1;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        c.send(&cmd(Type::CloseProducer, |x| {
            x.close_producer = Some(pb::CommandCloseProducer {
                producer_id: pid,
                request_id: 200 + pid,
            })
        }));
        wait_frame(&mut c, Duration::from_secs(10), |x| {
            x.success.is_some() || x.error.is_some()
        });
        pid += 1;
        c.send(&producer("fenced-log", pid, 100 + pid));
        let made = wait_frame(&mut c, Duration::from_secs(10), |x| {
            x.producer_success.is_some() || x.error.is_some()
        });
        if made.producer_success.is_some() {
            c.send_raw(&send_frame(pid, 2, b"m2"));
            let f = wait_frame(&mut c, Duration::from_secs(10), |x| {
                x.send_receipt.is_some() || x.send_error.is_some()
            });
            if f.send_receipt.is_some() {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "still refused after 30 s\n{}",
            broker.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        broker.log_text().contains("unloading it to load it again"),
        "the broker said why"
    );
    read_m0_m1_m2(&mut c, "fenced-log");
}

/// A broker's own loads of a topic (deleting it here) also load again a topic whose log was
/// fenced, instead of working on the fenced instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_topic_s_log_fenced_while_its_broker_still_owns_it_then_deleting_it_loads_it_again_and_deletes_it(
) {
    let (_cluster, _bookie, broker, client, _c) = fenced_after_m0_m1("fenced-delete").await;
    let log_records = || async {
        let page = client.list("/managed-ledgers/", "", 0).await.unwrap();
        page.kvs
            .iter()
            .filter(|kv| kv.key.contains("fenced-delete"))
            .count()
    };
    assert_eq!(log_records().await, 1);

    step("deleting the topic loads it again (its log was fenced) and deletes it, log and all");
    meridian_integration::geo_sites::admin_ok(&[
        "--admin-url",
        &broker.admin_url,
        "topics",
        "delete",
        "persistent://public/default/fenced-delete",
        "--force",
    ]);
    assert_eq!(log_records().await, 0, "{}", broker.log_text());
    assert!(
        broker.log_text().contains("unloading it to load it again"),
        "the broker said why"
    );
}

/// A site of one of each role (a roll-over every 2 entries) where producer 1 on the returned
/// connection sent m0 and m1 to `topic`; then the topic's log record is changed under the
/// broker: the roll-over after m1 fails its compare-and-set, the log is fenced, and m2 is
/// refused.
async fn fenced_after_m0_m1(
    topic: &str,
) -> (MetaCluster, BookieProc, BrokerProc, MetadataClient, Raw) {
    let (cluster, bookie, broker) = one_of_each(&[
        ("MERIDIAN_BROKER_LEDGER_ROLLOVER_ENTRIES_MAX", "2"),
        ("MERIDIAN_BROKER_LEDGER_ROLLOVER_MIN_AGE_MS", "0"),
    ])
    .await;
    let client = cluster.client();
    let mut c = Raw::connected(&broker.url);
    fence(&client, &mut c, topic).await;
    (cluster, bookie, broker, client, c)
}

/// The steps of [`fenced_after_m0_m1`] on its connection.
async fn fence(client: &MetadataClient, c: &mut Raw, topic: &str) {
    c.send(&producer(topic, 1, 1));
    assert!(c.expect().command.producer_success.is_some());
    for (seq, body) in [(0, &b"m0"[..]), (1, &b"m1"[..])] {
        c.send_raw(&send_frame(1, seq, body));
        wait_frame(c, Duration::from_secs(10), |x| x.send_receipt.is_some());
    }

    step("the log's record changes under the broker: its roll-over's compare-and-set fails, the log is fenced");
    let page = client.list("/managed-ledgers/", "", 0).await.unwrap();
    let kv = page
        .kvs
        .iter()
        .find(|kv| kv.key.contains(topic))
        .expect("the log's record");
    client.put(&kv.key, kv.value.clone()).await.unwrap();
    c.send_raw(&send_frame(1, 2, b"m2"));
    let f = wait_frame(c, Duration::from_secs(10), |x| {
        x.send_error.is_some() || x.send_receipt.is_some()
    });
    assert!(f.send_error.is_some(), "refused: {f:?}");
}

/// Subscribes to `topic` from the earliest message: it holds m0, m1 and m2, in order.
fn read_m0_m1_m2(c: &mut Raw, topic: &str) {
    c.send(&subscribe(topic, "check", 9, 4));
    wait_frame(c, Duration::from_secs(10), |x| x.success.is_some());
    c.send(&cmd(Type::Flow, |x| {
        x.flow = Some(pb::CommandFlow {
            consumer_id: 9,
            message_permits: 10,
        })
    }));
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while got.len() < 3 {
        match c.recv(Duration::from_millis(500)) {
            Got::Frame(f) if f.command.message.is_some() => {
                got.push(f.payload.expect("payload").data().to_vec())
            }
            Got::Closed => panic!("connection closed"),
            _ => assert!(Instant::now() < deadline, "received {got:?}"),
        }
    }
    assert_eq!(got, vec![b"m0".to_vec(), b"m1".to_vec(), b"m2".to_vec()]);
}

/// An unload that hangs (its bookie frozen) and whose admin caller goes away does not leave
/// the topic held: once the bookie is back, the topic is served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_unload_cancelled_midway_then_the_topic_is_served_again() {
    let (cluster, bookie, broker) = one_of_each(&[]).await;
    let topic = "cancelled-unload";
    let mut c = Raw::connected(&broker.url);
    c.send(&producer(topic, 1, 1));
    assert!(c.expect().command.producer_success.is_some());
    c.send_raw(&send_frame(1, 0, b"m0"));
    wait_frame(&mut c, Duration::from_secs(10), |x| {
        x.send_receipt.is_some()
    });

    step("the bookie freezes; an unload starts, hangs, and its caller goes away");
    let signal = |sig: &str| {
        let pid = bookie.pid().expect("the bookie runs").to_string();
        assert!(std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success());
    };
    signal("-STOP");
    // A send the frozen bookie holds: closing the topic's log waits for it.
    c.send_raw(&send_frame(1, 1, b"m1"));
    std::thread::sleep(Duration::from_millis(300));
    let mut unload = std::process::Command::new(meridian_integration::admin_bin())
        .args([
            "--admin-url",
            &broker.admin_url,
            "topics",
            "unload",
            &format!("persistent://public/default/{topic}"),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let still_running = unload.try_wait().unwrap().is_none();
    unload.kill().unwrap();
    unload.wait().unwrap();
    signal("-CONT");
    assert!(
        still_running,
        "the unload did not hang: the test shows nothing"
    );
    // Frozen, the bookie's session expired: it registers again.
    wait_for_bookies(&cluster.client(), 1, Duration::from_secs(20))
        .await
        .unwrap();

    step("the topic is served again: a new producer is made and its message stored");
    let mut c = Raw::connected(&broker.url);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut pid = 10;
    loop {
        pid += 1;
        c.send(&producer(topic, pid, pid));
        let made = wait_frame(&mut c, Duration::from_secs(40), |x| {
            x.producer_success.is_some() || x.error.is_some()
        });
        if made.producer_success.is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still refused after 30 s: {made:?}\n{}",
            broker.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    c.send_raw(&send_frame(pid, 2, b"m2"));
    let f = wait_frame(&mut c, Duration::from_secs(40), |x| {
        x.send_receipt.is_some() || x.send_error.is_some()
    });
    assert!(f.send_receipt.is_some(), "{f:?}");
}

/// How many times the broker's attaches paused at the fail point so far.
fn pauses(broker: &BrokerProc) -> usize {
    broker.log_text().matches("fail point hit").count()
}

/// Waits until an attach pauses after the `before` ones: the unload's window opens.
fn wait_for_pause(broker: &BrokerProc, before: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while pauses(broker) <= before {
        assert!(Instant::now() < deadline, "no attach paused");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `attach` (a SUBSCRIBE or PRODUCER), runs the admin CLI with `admin` (an unload, a
/// deletion) while the attach pauses at the fail point, and expects the attach to be refused
/// with ServiceNotReady.
fn refused_during(
    broker: &BrokerProc,
    admin: &[&str],
    conn: &mut Raw,
    attach: &pb::BaseCommand,
    what: &str,
) {
    let hits = pauses(broker);
    conn.send(attach);
    wait_for_pause(broker, hits);
    let mut call = admin_in_background(broker, admin);
    assert!(call.wait().unwrap().success(), "{admin:?} failed");
    let f = wait_frame(conn, Duration::from_secs(20), |x| {
        x.success.is_some() || x.producer_success.is_some() || x.error.is_some()
    });
    let Some(e) = f.error.clone() else {
        panic!("the {what} was attached to the topic after {admin:?}: {f:?}")
    };
    assert_eq!(
        e.error,
        pb::ServerError::ServiceNotReady as i32,
        "{}",
        e.message
    );
}

/// A producer (id 1) on `topic` whose first message, `m0`, is stored.
fn producing(broker: &BrokerProc, topic: &str) -> Raw {
    let mut p = Raw::connected(&broker.url);
    p.send(&producer(topic, 1, 1));
    let f = producer_answer(&mut p);
    assert!(f.producer_success.is_some(), "{f:?}");
    p.send_raw(&send_frame(1, 0, b"m0"));
    wait_frame(&mut p, Duration::from_secs(10), |x| {
        x.send_receipt.is_some()
    });
    p
}

/// Runs the admin CLI with `args` against the broker, in the background.
fn admin_in_background(broker: &BrokerProc, args: &[&str]) -> std::process::Child {
    std::process::Command::new(meridian_integration::admin_bin())
        .args(["--admin-url", &broker.admin_url])
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// What `topics list public/default` prints.
fn listed_topics(broker: &BrokerProc) -> String {
    let (code, out, err) = meridian_integration::run_admin(&[
        "--admin-url",
        &broker.admin_url,
        "topics",
        "list",
        "public/default",
    ])
    .unwrap();
    assert_eq!(code, 0, "{err}");
    out
}

fn full_name(topic: &str) -> String {
    format!("persistent://public/default/{topic}")
}

/// A consumer (or producer) that found its topic loaded, and attaches to it only after an
/// unload closed it, is refused (ServiceNotReady: it looks the topic up again), not attached
/// to an instance nothing serves any more: such a consumer heard nothing until its connection
/// dropped (the fault-schedule runner saw a subscription without deliveries for minutes after
/// its broker lost its metadata session). The fail point makes every attach wait 2 s after
/// finding its topic; the unload comes in that window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_unload_between_finding_a_topic_and_attaching_then_the_attach_is_refused_and_the_next_one_served(
) {
    let (_cluster, _bookie, broker) =
        one_of_each(&[("MERIDIAN_TEST_FAILPOINTS", "attach:pause_2s")]).await;
    let topic = "unload-while-attaching";
    let _p = producing(&broker, topic);

    step("a consumer subscribes; the topic is unloaded before it attaches: refused");
    let mut c = Raw::connected(&broker.url);
    let unload = ["topics", "unload", &full_name(topic)];
    refused_during(
        &broker,
        &unload,
        &mut c,
        &subscribe(topic, "s", 1, 1),
        "consumer",
    );

    step("a producer likewise (once it has loaded the topic again)");
    let mut p2 = Raw::connected(&broker.url);
    refused_during(
        &broker,
        &unload,
        &mut p2,
        &producer(topic, 2, 2),
        "producer",
    );

    step("subscribed again, the consumer gets what a new producer sends");
    c.send(&subscribe(topic, "s", 2, 2));
    wait_frame(&mut c, Duration::from_secs(20), |x| x.success.is_some());
    c.send(&cmd(Type::Flow, |x| {
        x.flow = Some(pb::CommandFlow {
            consumer_id: 2,
            message_permits: 10,
        })
    }));
    p2.send(&producer(topic, 3, 3));
    wait_frame(&mut p2, Duration::from_secs(20), |x| {
        x.producer_success.is_some()
    });
    p2.send_raw(&send_frame(3, 1, b"m1"));
    wait_frame(&mut p2, Duration::from_secs(10), |x| {
        x.send_receipt.is_some()
    });
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !got.contains(&b"m1".to_vec()) {
        match c.recv(Duration::from_millis(500)) {
            Got::Frame(f) if f.command.message.is_some() => {
                got.push(f.payload.expect("payload").data().to_vec())
            }
            Got::Closed => panic!("connection closed"),
            _ => assert!(Instant::now() < deadline, "received only {got:?}"),
        }
    }
    assert_eq!(got, vec![b"m0".to_vec(), b"m1".to_vec()]);
}

/// A consumer (or producer) that found its topic loaded, and attaches to it only while a
/// deletion runs, is refused (ServiceNotReady), not attached to the instance being deleted
/// (which the deletion has forgotten: a consumer there would hear nothing, and its
/// subscription's cursor would outlive the topic). The fail point makes every attach wait
/// 2 s after finding its topic; the deletion comes in that window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_deletion_between_finding_a_topic_and_attaching_then_the_attach_is_refused_and_nothing_of_the_topic_is_left(
) {
    let (cluster, _bookie, broker) =
        one_of_each(&[("MERIDIAN_TEST_FAILPOINTS", "attach:pause_2s")]).await;
    let meta = cluster.client();
    for (i, what) in ["consumer", "producer"].into_iter().enumerate() {
        let topic = format!("delete-while-attaching-{i}");
        step(format!(
            "a {what} finds {topic}; it is deleted before the {what} attaches"
        ));
        let _p = producing(&broker, &topic);
        let mut c = Raw::connected(&broker.url);
        let attach = if what == "consumer" {
            subscribe(&topic, "s", 1, 1)
        } else {
            producer(&topic, 2, 2)
        };
        let delete = ["topics", "delete", "--force", &full_name(&topic)];
        refused_during(&broker, &delete, &mut c, &attach, what);
        let out = listed_topics(&broker);
        assert!(!out.contains(&topic), "{topic} is still listed: {out}");
        let cursors = meta
            .list_all(&format!(
                "{}public/default/persistent/{topic}/",
                meridian_storage::cursor::MANAGED_CURSORS_PREFIX
            ))
            .await
            .unwrap();
        assert!(cursors.is_empty(), "cursors of {topic} left: {cursors:?}");
    }
}

/// A deletion without `--force` checks that no producer or consumer is attached, then
/// deletes. A consumer that attached after the check had its subscription deleted and was
/// closed, as `--force` would have done; now, from the deletion's start no client attaches,
/// one that did refuses it, and the topic stays with its message. The fail point makes the
/// deletion wait 2 s after its check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_consumer_attaching_after_a_deletion_without_force_checked_then_the_deletion_is_refused_and_the_topic_kept(
) {
    deletion_with_a_client_attaching_after_its_check(Attaching::Consumer).await;
}

/// The same with a producer attaching after the check: the deletion is refused, the producer
/// is let go (CLOSE_PRODUCER), is granted again, and what it sends then follows the topic's
/// first message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_producer_attaching_after_a_deletion_without_force_checked_then_the_deletion_is_refused_and_the_topic_kept(
) {
    deletion_with_a_client_attaching_after_its_check(Attaching::Producer).await;
}

#[derive(Clone, Copy, PartialEq)]
enum Attaching {
    Consumer,
    Producer,
}

async fn deletion_with_a_client_attaching_after_its_check(who: Attaching) {
    let (_cluster, _bookie, broker) =
        one_of_each(&[("MERIDIAN_TEST_FAILPOINTS", "delete:pause_after_plan_2s")]).await;
    let topic = match who {
        Attaching::Consumer => "attach-after-the-check",
        Attaching::Producer => "produce-after-the-check",
    };
    let attach = |id: u64, request: u64| match who {
        Attaching::Consumer => subscribe(topic, "s", id, request),
        Attaching::Producer => producer(topic, id, request),
    };

    step("the topic has a message and no client");
    let mut p = Raw::connected(&broker.url);
    let id = p.produce_one(topic, 1, 1, b"m0");
    p.send(&cmd(Type::CloseProducer, |c| {
        c.close_producer = Some(pb::CommandCloseProducer {
            producer_id: 1,
            request_id: 2,
        })
    }));
    wait_frame(&mut p, Duration::from_secs(10), |x| x.success.is_some());

    step("the deletion (no --force) checks, and a client attaches while it waits");
    let hits = pauses(&broker);
    let mut call = admin_in_background(&broker, &["topics", "delete", &full_name(topic)]);
    wait_for_pause(&broker, hits);
    let mut c = Raw::connected(&broker.url);
    c.send(&attach(1, 1));
    let f = wait_frame(&mut c, Duration::from_secs(20), |x| {
        x.success.is_some() || x.producer_success.is_some() || x.error.is_some()
    });
    assert!(f.error.is_none(), "{f:?}");
    assert!(
        !call.wait().unwrap().success(),
        "the deletion without --force went through with a client attached"
    );
    let out = listed_topics(&broker);
    assert!(out.contains(topic), "{topic} is gone: {out}");

    step("the client, let go by the refused deletion, attaches again and is served");
    wait_frame(&mut c, Duration::from_secs(20), |x| {
        x.close_consumer.is_some() || x.close_producer.is_some()
    });
    c.until_served(Duration::from_secs(30), 10, |r| attach(2, r));
    let mut reader = match who {
        Attaching::Consumer => c,
        Attaching::Producer => {
            c.send_raw(&send_frame(2, 1, b"m1"));
            let r = wait_frame(&mut c, Duration::from_secs(20), |x| {
                x.send_receipt.is_some()
            });
            let second = r.send_receipt.and_then(|r| r.message_id).expect("receipt");
            assert!(
                (second.ledger_id, second.entry_id) > (id.ledger_id, id.entry_id),
                "{second:?} is not after {id:?}"
            );
            let mut reader = Raw::connected(&broker.url);
            reader.until_served(Duration::from_secs(30), 1, |r| subscribe(topic, "s", 2, r));
            reader
        }
    };
    reader.send(&meridian_integration::raw::flow(2, 10));
    let m = wait_frame(&mut reader, Duration::from_secs(20), |x| {
        x.message.is_some()
    })
    .message
    .unwrap();
    assert_eq!(
        (m.message_id.ledger_id, m.message_id.entry_id),
        (id.ledger_id, id.entry_id)
    );
}

/// Waits for a PRODUCER's answer: success or an error.
fn producer_answer(c: &mut Raw) -> pb::BaseCommand {
    wait_frame(c, Duration::from_secs(20), |x| {
        x.producer_success.is_some() || x.error.is_some()
    })
}

/// Two clients ask for one topic while its first load is under way, and that load fails: the
/// second caller loads it again, and every later client gets that same instance, which an
/// unload closes. It was an instance outside the broker's map of topics (the failed caller
/// took the entry out while the other one was still waiting on it), which a third client
/// loaded a second time and an unload never reached; the fault-schedule runner saw a broker
/// load a topic three times within 2 s after a restart, the instances fencing each other's
/// log and cursors. The fail point fails the broker's first load after 3 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_failed_load_with_another_caller_waiting_then_one_instance_serves_everyone_and_is_unloaded(
) {
    let (_cluster, _bookie, broker) =
        one_of_each(&[("MERIDIAN_TEST_FAILPOINTS", "load:fail_first_after_3s")]).await;
    let topic = "failed-first-load";
    let mut a = Raw::connected(&broker.url);
    a.send(&producer(topic, 1, 1));
    std::thread::sleep(Duration::from_millis(300));
    let mut b = Raw::connected(&broker.url);
    b.send(&producer(topic, 1, 1));
    let fa = producer_answer(&mut a);
    assert!(fa.error.is_some(), "the first load did not fail: {fa:?}");
    let fb = producer_answer(&mut b);
    assert!(fb.producer_success.is_some(), "{fb:?}");

    step("a third client gets a producer too; an unload closes both");
    let mut c = Raw::connected(&broker.url);
    c.send(&producer(topic, 1, 1));
    let fc = producer_answer(&mut c);
    assert!(fc.producer_success.is_some(), "{fc:?}");
    let mut unload = admin_in_background(&broker, &["topics", "unload", &full_name(topic)]);
    assert!(unload.wait().unwrap().success(), "the unload failed");
    for (who, conn) in [("the second", &mut b), ("the third", &mut c)] {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match conn.recv(Duration::from_millis(500)) {
                Got::Frame(f) if f.command.close_producer.is_some() => break,
                Got::Closed => panic!("{who} client's connection closed"),
                _ => assert!(
                    Instant::now() < deadline,
                    "{who} client's producer was not closed by the unload: its topic instance \
                     was not the one the broker unloaded"
                ),
            }
        }
    }
}

/// A PRODUCER or SUBSCRIBE whose topic is loading waits off its connection's loop: the
/// connection's other commands are answered meanwhile. The broker used to handle a
/// connection's commands one at a time, so a load that took seconds (the previous owner's
/// ledger recovered) held up the PINGs, the LOOKUPs and other producers' sends of every
/// client sharing that connection (the stock clients share one per broker): the
/// fault-schedule runner saw the C++ client's LOOKUPs time out behind a PRODUCER and its
/// keep-alive close the connection. Also: a producer and a consumer closed by the client while
/// their topic loads are not attached once it has loaded. Fail point: `load:pause_5s:<topic>`
/// makes each load of that topic take 5 s more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_topic_loading_for_a_producer_then_the_connections_other_commands_are_answered_meanwhile(
) {
    let (_cluster, _bookie, broker) = one_of_each(&[(
        "MERIDIAN_TEST_FAILPOINTS",
        "load:pause_5s:slow-a,load:pause_5s:slow-b,load:pause_5s:slow-c",
    )])
    .await;
    let mut c = Raw::connected(&broker.url);
    c.produce_one("quick", 1, 1, b"first");
    step("a PRODUCER for a topic whose load takes 5 s; then a PING, a LOOKUP and a SEND");
    c.send(&producer("slow-a", 2, 2));
    c.send(&cmd(Type::Ping, |_| {}));
    c.send(&cmd(Type::Lookup, |x| {
        x.lookup_topic = Some(pb::CommandLookupTopic {
            topic: full_name("quick"),
            request_id: 3,
            ..Default::default()
        });
    }));
    c.send_raw(&send_frame(1, 1, b"second"));
    let mut order = Vec::new();
    while order.len() < 4 {
        let f = c.expect().command;
        let what = if f.pong.is_some() {
            "pong"
        } else if f.lookup_topic_response.is_some() {
            "lookup"
        } else if f.send_receipt.is_some() {
            "receipt"
        } else if f.producer_success.is_some() {
            "producer"
        } else {
            panic!("unexpected answer: {f:?}")
        };
        order.push(what);
    }
    assert_eq!(
        order.last(),
        Some(&"producer"),
        "the PING, LOOKUP and SEND were answered only after the PRODUCER: {order:?}"
    );
    step("the new producer sends");
    c.send_raw(&send_frame(2, 0, b"slow"));
    assert!(c.expect().command.send_receipt.is_some());

    step("a producer and a consumer closed while their topics load are not attached");
    c.send(&producer("slow-b", 4, 10));
    c.send(&subscribe("slow-c", "s", 5, 11));
    c.send(&cmd(Type::CloseProducer, |x| {
        x.close_producer = Some(pb::CommandCloseProducer {
            producer_id: 4,
            request_id: 12,
        });
    }));
    c.send(&cmd(Type::CloseConsumer, |x| {
        x.close_consumer = Some(pb::CommandCloseConsumer {
            consumer_id: 5,
            request_id: 13,
        });
    }));
    let mut answers = std::collections::BTreeMap::new();
    while answers.len() < 4 {
        let f = c.expect().command;
        if let Some(s) = &f.success {
            answers.insert(s.request_id, "success".to_string());
        } else if let Some(e) = &f.error {
            answers.insert(e.request_id, format!("error: {}", e.message));
        } else if let Some(p) = &f.producer_success {
            answers.insert(p.request_id, "producer".to_string());
        } else {
            panic!("unexpected answer: {f:?}");
        }
    }
    assert_eq!(answers[&12], "success");
    assert_eq!(answers[&13], "success");
    for r in [10, 11] {
        assert!(
            answers[&r].contains("closed by the client while its topic loaded"),
            "request {r}: {answers:?}"
        );
    }
    step("producer 4 does not exist; the topic takes an exclusive producer from another client");
    c.send_raw(&send_frame(4, 0, b"nobody"));
    let f = c.expect().command;
    assert!(
        f.send_error.is_some(),
        "producer 4 was attached after its close: {f:?}"
    );
    let mut other = Raw::connected(&broker.url);
    let mut exclusive = producer("slow-b", 1, 1);
    if let Some(p) = exclusive.producer.as_mut() {
        p.producer_access_mode = Some(1); // Exclusive
    }
    other.send(&exclusive);
    let f = producer_answer(&mut other);
    assert!(f.producer_success.is_some(), "{f:?}");
}

/// An ACK of several messages whose first could not be persisted (the store's reply to
/// recording the subscription's first cursor ledger is lost: outcome unknown) still
/// acknowledges the rest: the cursor keeps them in memory and the subscription's flush,
/// with nothing else happening, persists them, so a broker restarted after kill -9 delivers
/// none of them again. Before, the broker stopped at the failure and the rest stayed
/// unacknowledged while their consumer took them for acknowledged (the fault schedules'
/// backlogs that did not drain while the consumer stayed connected).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_ack_whose_first_message_cannot_be_persisted_then_the_rest_are_acknowledged_too() {
    let topic = "ack-unpersisted";
    let (_cluster, _bookie, mut broker) = one_of_each(&[(
        "MERIDIAN_TEST_FAILPOINTS",
        "cursor:reply_lost:public/default/persistent/ack-unpersisted/s",
    )])
    .await;
    step("three messages; a Shared consumer receives them");
    let mut c = Raw::connected(&broker.url);
    let mut ids = vec![c.produce_one(topic, 1, 1, b"m0")];
    for seq in 1..3 {
        c.send_raw(&send_frame(1, seq, format!("m{seq}").as_bytes()));
        ids.push(
            c.expect()
                .command
                .send_receipt
                .and_then(|r| r.message_id)
                .expect("receipt"),
        );
    }
    c.send(&shared_s(topic, 2));
    assert!(c.expect().command.success.is_some());
    c.send(&flow(7, 10));
    for id in &ids {
        let m = c.expect().command.message.expect("MESSAGE");
        assert_eq!(m.message_id.entry_id, id.entry_id);
    }

    step("one ACK of all three; persisting the first fails with its outcome unknown");
    c.send(&cmd(Type::Ack, |x| {
        x.ack = Some(pb::CommandAck {
            consumer_id: 7,
            ack_type: pb::command_ack::AckType::Individual as i32,
            message_id: ids
                .iter()
                .map(|id| pb::MessageIdData {
                    ledger_id: id.ledger_id,
                    entry_id: id.entry_id,
                    ..Default::default()
                })
                .collect(),
            request_id: Some(3),
            ..Default::default()
        })
    }));
    let answer = wait_frame(&mut c, Duration::from_secs(10), |f| {
        f.ack_response.is_some()
    })
    .ack_response
    .expect("ACK_RESPONSE");
    assert!(
        answer
            .message
            .as_deref()
            .is_some_and(|m| m.contains("outcome unknown")),
        "the ACK's answer names the failure: {answer:?}"
    );

    step("all three are acknowledged: no backlog, none pending for the consumer");
    let s = subscription_s(&broker, topic);
    assert_eq!(s["backlog_entries"], 0, "{s}");
    assert_eq!(
        s["unacked_entries"], 0,
        "nothing left pending for the consumer: {s}"
    );

    step("the subscription's flush persists them within a second, with nothing else happening");
    // The consumer stays connected (a consumer's close is a change of its own).
    std::thread::sleep(Duration::from_millis(1500));

    step("kill -9, restarted without the fail point: the subscription has nothing to deliver");
    broker.kill9().unwrap();
    broker.env("MERIDIAN_TEST_FAILPOINTS", "");
    broker.start().expect("the broker starts");
    let mut c = Raw::connected(&broker.url);
    let granted = c.until_served(Duration::from_secs(30), 10, |r| shared_s(topic, r));
    assert!(granted.success.is_some(), "{granted:?}");
    c.send(&flow(7, 10));
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        if let Got::Frame(f) = c.recv(Duration::from_millis(200)) {
            assert!(
                f.command.message.is_none(),
                "delivered again after its acknowledgement: {:?}",
                f.command.message
            );
        }
    }
    let s = subscription_s(&broker, topic);
    assert_eq!(s["backlog_entries"], 0, "{s}");
}

/// SUBSCRIBE of consumer 7 to `topic` as Shared subscription `s`.
fn shared_s(topic: &str, request_id: u64) -> pb::BaseCommand {
    let mut sub = subscribe(topic, "s", 7, request_id);
    if let Some(s) = sub.subscribe.as_mut() {
        s.sub_type = pb::command_subscribe::SubType::Shared as i32;
    }
    sub
}

/// Subscription `s` of `topic` as the admin's topic stats show it.
fn subscription_s(broker: &BrokerProc, topic: &str) -> serde_json::Value {
    let stats = meridian_integration::admin_json(
        &broker.admin_url,
        &["topics", "stats", &full_name(topic)],
    );
    stats["subscriptions"]
        .as_array()
        .and_then(|subs| subs.iter().find(|s| s["name"] == "s"))
        .cloned()
        .unwrap_or_else(|| panic!("subscription s in {stats}"))
}

/// A broker whose ledgers take two bookies, with one registered (`extra` set too): a send
/// that needs a new ledger waits for the second (up to 60 s).
async fn short_of_a_bookie(extra: &[(&str, &str)]) -> (MetaCluster, BookieProc, BrokerProc) {
    let mut env = vec![
        ("MERIDIAN_BROKER_ENSEMBLE", "2"),
        ("MERIDIAN_BROKER_WRITE_QUORUM", "2"),
        ("MERIDIAN_BROKER_ACK_QUORUM", "2"),
        ("MERIDIAN_BROKER_LEDGER_CREATE_WAIT_MS", "60000"),
    ];
    env.extend_from_slice(extra);
    one_of_each(&env).await
}

/// Starts a second bookie and waits for its registration.
async fn second_bookie(cluster: &MetaCluster) -> BookieProc {
    let endpoint = cluster.endpoints()[0].clone();
    let mut second = BookieProc::new("bookie-2", cluster.root.path(), &endpoint);
    second.start().unwrap();
    wait_for_bookies(&cluster.client(), 2, Duration::from_secs(30))
        .await
        .unwrap();
    second
}

/// The next frame within 5 s, which `pick` must take; `silent` says what no answer means.
fn answered_within_5s(c: &mut Raw, pick: impl Fn(&pb::BaseCommand) -> bool, silent: &str) {
    match c.recv(Duration::from_secs(5)) {
        Got::Frame(f) if pick(&f.command) => {}
        Got::Frame(f) => panic!("unexpected answer: {:?}", f.command),
        Got::Closed => panic!("connection closed"),
        Got::Nothing => panic!("no answer within 5 s: {silent}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_send_waiting_for_writable_bookies_on_a_deduplicating_topic_then_another_producer_is_created_meanwhile(
) {
    // Ledgers of two bookies, one registered; deduplication on: the send's wait for a new
    // ledger is not spent holding the topic's deduplication state, which a producer being
    // created reads (its last sequence id).
    let (cluster, _bookie, broker) =
        short_of_a_bookie(&[("MERIDIAN_BROKER_DEDUPLICATION_ENABLED", "true")]).await;
    let topic = "dedup-needs-two";
    let mut c = Raw::connected(&broker.url);
    // Named as its messages say, so its sends are checked (sequence ids).
    c.send(&named_producer(topic, 1, 1));
    assert!(c.expect().command.producer_success.is_some());

    step("a send waits for a second bookie; another connection creates a producer meanwhile");
    c.send_raw(&send_frame(1, 0, b"first"));
    assert!(
        matches!(c.recv(Duration::from_millis(500)), Got::Nothing),
        "the send was answered with one bookie"
    );
    let mut d = Raw::connected(&broker.url);
    d.send(&producer(topic, 1, 1));
    answered_within_5s(
        &mut d,
        |f| f.producer_success.is_some(),
        "the deduplication state was held by the waiting send",
    );
    d.send_raw(&send_frame(1, 0, b"second"));

    step("a second bookie registers: both sends are stored and answered");
    let _second = second_bookie(&cluster).await;
    let mut stored = Vec::new();
    for conn in [&mut c, &mut d] {
        let r = wait_frame(conn, Duration::from_secs(40), |f| {
            f.send_receipt.is_some() || f.send_error.is_some()
        });
        let receipt = r
            .send_receipt
            .clone()
            .unwrap_or_else(|| panic!("not a receipt: {r:?}"));
        let id = receipt.message_id.expect("receipt's id");
        stored.push((id.ledger_id, id.entry_id));
    }
    assert_ne!(stored[0], stored[1], "two sends, one position: {stored:?}");

    step("the first producer sends its 0 again: a duplicate, not stored twice");
    c.send_raw(&send_frame(1, 0, b"first"));
    let r = wait_frame(&mut c, Duration::from_secs(10), |f| {
        f.send_receipt.is_some() || f.send_error.is_some()
    });
    let id = r
        .send_receipt
        .and_then(|x| x.message_id)
        .expect("a receipt with an id");
    assert_eq!(
        (id.ledger_id, id.entry_id),
        (ID_NONE, ID_NONE),
        "stored again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_sends_waiting_for_writable_bookies_then_their_connection_answers_meanwhile_also_while_their_producer_closes_and_they_are_stored_in_order_before_it_is_closed(
) {
    // Ledgers of two bookies, one registered: a send waits for the second (up to 60 s).
    let (cluster, _bookie, broker) = short_of_a_bookie(&[]).await;
    let mut c = Raw::connected(&broker.url);
    c.send(&named_producer("needs-two", 1, 1));
    assert!(c.expect().command.producer_success.is_some());

    step("two sends that wait for a second bookie, then a PING and a SUBSCRIBE");
    c.send_raw(&send_frame(1, 0, b"m0"));
    c.send_raw(&send_frame(1, 1, b"m1"));
    c.send(&cmd(Type::Ping, |x| x.ping = Some(pb::CommandPing {})));
    c.send(&subscribe("needs-two", "s", 2, 2));
    let mut answered = Vec::new();
    while answered.len() < 2 {
        let f = match c.recv(Duration::from_secs(5)) {
            Got::Frame(f) => f.command,
            Got::Closed => panic!("connection closed"),
            Got::Nothing => panic!(
                "the connection answered only {answered:?} while the sends waited for bookies"
            ),
        };
        assert!(f.send_receipt.is_none(), "a receipt with one bookie: {f:?}");
        if f.pong.is_some() {
            answered.push("pong");
        } else if f.success.is_some() {
            answered.push("subscribed");
        } else {
            panic!("unexpected answer: {f:?}");
        }
    }
    let page = meridian_integration::http_get(&broker.http, "/metrics");
    assert!(
        meridian_integration::metric_value(&page, "meridian_publish_submits_moved_total") >= 1.0,
        "the waiting send was not moved off the read loop"
    );

    step("a send behind them, then CLOSE_PRODUCER: answered after the three receipts");
    c.send_raw(&send_frame(1, 2, b"m2"));
    c.send(&cmd(Type::CloseProducer, |x| {
        x.close_producer = Some(pb::CommandCloseProducer {
            producer_id: 1,
            request_id: 3,
        });
    }));
    step("a SEND after it is refused after the close; a PRODUCER of the same name right behind it waits for the close (not refused as busy); neither in the read loop: a PING is answered meanwhile");
    c.send_raw(&send_frame(1, 3, b"m3"));
    c.send(&named_producer("needs-two", 4, 4));
    c.send(&cmd(Type::Ping, |x| x.ping = Some(pb::CommandPing {})));
    answered_within_5s(
        &mut c,
        |f| f.pong.is_some(),
        "the close held the connection",
    );

    step("a second bookie registers: the sends are stored and answered, in order");
    let _second = second_bookie(&cluster).await;
    let mut stored = Vec::new();
    for seq in 0..3 {
        let r = wait_frame(&mut c, Duration::from_secs(40), |f| {
            f.send_receipt.is_some() || f.send_error.is_some() || f.success.is_some()
        });
        let Some(receipt) = r.send_receipt.clone() else {
            panic!("not a receipt: {r:?}")
        };
        assert_eq!(receipt.sequence_id, seq);
        let id = receipt.message_id.expect("receipt's id");
        stored.push((id.ledger_id, id.entry_id));
    }
    let closed = c.expect().command;
    assert_eq!(
        closed.success.as_ref().map(|s| s.request_id),
        Some(3),
        "{closed:?}"
    );
    let refused = c.expect().command;
    assert_eq!(
        refused.send_error.as_ref().map(|e| e.sequence_id),
        Some(3),
        "{refused:?}"
    );
    let created = c.expect().command;
    assert!(created.producer_success.is_some(), "{created:?}");
    c.send(&flow(2, 10));
    for want in stored {
        let f = wait_frame(&mut c, Duration::from_secs(10), |f| f.message.is_some());
        let id = f.message.expect("MESSAGE").message_id;
        assert_eq!((id.ledger_id, id.entry_id), want);
    }
}
