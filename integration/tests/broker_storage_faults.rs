//! A `meridian broker` over a separate metadata node and bookie, with storage faults the
//! broker must ride out without losing a message: a bookie that is down while a consumer asks
//! for redelivery.

use std::time::{Duration, Instant};

use meridian_integration::raw::{cmd, producer, send_frame, subscribe, Got, Raw};
use meridian_integration::{step, wait_for_bookies, BookieProc, BrokerProc, MetaCluster};
use meridian_protocol::pb::{self, base_command::Type};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_redelivery_read_fails_then_the_message_stays_pending_and_is_redelivered() {
    let cluster = MetaCluster::start(1).await.expect("metadata node");
    let endpoint = cluster.endpoints()[0].clone();
    let mut bookie = BookieProc::new("bookie", cluster.root.path(), &endpoint);
    bookie.start().unwrap();
    wait_for_bookies(&cluster.client(), 1, Duration::from_secs(20))
        .await
        .unwrap();
    let mut broker = BrokerProc::new("broker", cluster.root.path(), &endpoint);
    // No tail cache: a redelivery reads from the bookie.
    broker
        .env("MERIDIAN_BROKER_TAIL_CACHE_BYTES_MAX", "0")
        .env("MERIDIAN_BROKER_TAIL_CACHE_TOTAL_BYTES_MAX", "0");
    broker.start().unwrap();

    step("a Shared consumer receives one message and does not acknowledge it");
    let mut c = Raw::connected(&broker.url);
    c.send(&producer("redeliver-fault", 1, 1));
    assert!(c.expect().command.producer_success.is_some());
    c.send_raw(&send_frame(1, 0, b"keep me"));
    let id = c
        .expect()
        .command
        .send_receipt
        .and_then(|r| r.message_id)
        .expect("receipt");
    let mut sub = subscribe("redeliver-fault", "s", 7, 2);
    if let Some(s) = sub.subscribe.as_mut() {
        s.sub_type = pb::command_subscribe::SubType::Shared as i32;
    }
    c.send(&sub);
    assert!(c.expect().command.success.is_some());
    c.send(&cmd(Type::Flow, |x| {
        x.flow = Some(pb::CommandFlow {
            consumer_id: 7,
            message_permits: 10,
        })
    }));
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
