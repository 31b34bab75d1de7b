//! Bad input against a real `meridian standalone`, over raw sockets with our own codec:
//! malformed, oversize and out-of-order frames close that one connection; refusals come back
//! as precise errors; a consumer without permits receives nothing.

use std::time::{Duration, Instant};

use bytes::{BufMut, BytesMut};
use meridian_integration::raw::{cmd, error_of, producer, send_frame, subscribe, Got, Raw};
use meridian_integration::{step, StandaloneProc};
use meridian_protocol::pb::{self, base_command::Type, ServerError};

#[test]
fn bad_frames_close_only_their_connection_and_refusals_are_precise() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.start().unwrap();
    let url = s.url.clone();

    step("a healthy connection with a producer");
    let mut good = Raw::connected(&url);
    good.send(&producer("bad-input", 1, 1));
    assert!(good.expect().command.producer_success.is_some());
    good.send_raw(&send_frame(1, 0, b"first"));
    assert!(good.expect().command.send_receipt.is_some());

    step("a frame announcing more than the limit closes that connection");
    let mut r = Raw::connected(&url);
    let mut b = BytesMut::new();
    b.put_u32(64 << 20);
    r.send_raw(&b);
    r.assert_closed("oversize frame");

    step("a command that is not protobuf closes that connection");
    let mut r = Raw::connected(&url);
    let mut b = BytesMut::new();
    b.put_u32(4 + 5);
    b.put_u32(5);
    b.put_slice(&[0xff, 0xff, 0xff, 0xff, 0xff]);
    r.send_raw(&b);
    r.assert_closed("garbage command");

    step("SEND before CONNECT closes that connection");
    let mut r = Raw::open(&url);
    r.send_raw(&send_frame(1, 0, b"x"));
    r.assert_closed("out of order");

    step("a second CONNECT closes that connection");
    let mut r = Raw::connected(&url);
    r.send(&cmd(Type::Connect, |c| {
        c.connect = Some(pb::CommandConnect {
            client_version: "again".into(),
            ..Default::default()
        })
    }));
    r.assert_closed("second CONNECT");

    step("the healthy connection is unaffected");
    good.send_raw(&send_frame(1, 1, b"second"));
    assert!(good.expect().command.send_receipt.is_some());
    good.send(&cmd(Type::Ping, |c| c.ping = Some(pb::CommandPing {})));
    assert!(good.expect().command.pong.is_some());

    step("invalid topic names get InvalidTopicName with the reason; the connection stays");
    good.send(&producer("persistent://only-two/parts", 2, 2));
    let (code, msg) = error_of(&good.expect());
    assert_eq!(code, ServerError::InvalidTopicName);
    assert!(
        msg.contains("expected persistent://tenant/namespace/topic"),
        "{msg}"
    );
    good.send(&producer("a b/ns/x", 3, 3));
    let (code, msg) = error_of(&good.expect());
    assert_eq!(code, ServerError::InvalidTopicName);
    assert!(msg.contains("tenant \"a b\""), "{msg}");

    step("non-persistent topics are refused clearly, in lookups too");
    good.send(&cmd(Type::Lookup, |c| {
        c.lookup_topic = Some(pb::CommandLookupTopic {
            topic: "non-persistent://public/default/x".into(),
            request_id: 4,
            ..Default::default()
        })
    }));
    let f = good.expect();
    let l = f.command.lookup_topic_response.unwrap();
    assert_eq!(l.error, Some(ServerError::NotAllowedError as i32));
    assert!(l.message.unwrap().contains("non-persistent"));

    step("a topic in a namespace that does not exist is TopicNotFound");
    good.send(&producer("persistent://nobody/nothing/x", 5, 5));
    let (code, msg) = error_of(&good.expect());
    assert_eq!(code, ServerError::TopicNotFound);
    assert!(
        msg.contains("namespace nobody/nothing does not exist"),
        "{msg}"
    );

    step("a consumer without permits receives nothing; FLOW 1 brings exactly one message");
    let mut c1 = Raw::connected(&url);
    c1.send(&subscribe("bad-input", "ex", 7, 1));
    assert!(c1.expect().command.success.is_some());
    assert!(
        matches!(c1.recv(Duration::from_millis(700)), Got::Nothing),
        "pushed without permits"
    );
    c1.send(&cmd(Type::Flow, |c| {
        c.flow = Some(pb::CommandFlow {
            consumer_id: 7,
            message_permits: 1,
        })
    }));
    let m = c1.expect();
    let msg = m.command.message.as_ref().expect("MESSAGE");
    assert_eq!(msg.consumer_id, 7);
    let payload = m.payload.as_ref().unwrap();
    assert!(
        payload.checksum_ok(),
        "the broker forwards the producer's checksum"
    );
    assert_eq!(&payload.data()[..], b"first");
    assert!(
        matches!(c1.recv(Duration::from_millis(500)), Got::Nothing),
        "more than the permits"
    );

    step("CONSUMER_STATS answers with the consumer's figures");
    c1.send(&cmd(Type::ConsumerStats, |c| {
        c.consumer_stats = Some(pb::CommandConsumerStats {
            request_id: 2,
            consumer_id: 7,
        })
    }));
    let f = c1.expect();
    let st = f
        .command
        .consumer_stats_response
        .expect("CONSUMER_STATS_RESPONSE");
    assert_eq!(st.error_code, None, "{:?}", st.error_message);
    assert_eq!(st.available_permits, Some(0));
    assert_eq!(st.unacked_messages, Some(1));
    assert_eq!(st.r#type.as_deref(), Some("Exclusive"));
    assert!(st.msg_backlog.unwrap() >= 1);
    c1.send(&cmd(Type::ConsumerStats, |c| {
        c.consumer_stats = Some(pb::CommandConsumerStats {
            request_id: 3,
            consumer_id: 99,
        })
    }));
    let f = c1.expect();
    let st = f
        .command
        .consumer_stats_response
        .expect("CONSUMER_STATS_RESPONSE");
    assert_eq!(st.error_code, Some(ServerError::ConsumerNotFound as i32));

    step("a second consumer on the exclusive subscription is ConsumerBusy");
    let mut c2 = Raw::connected(&url);
    c2.send(&subscribe("bad-input", "ex", 1, 9));
    let (code, msg) = error_of(&c2.expect());
    assert_eq!(code, ServerError::ConsumerBusy);
    assert!(
        msg.contains("exclusive subscription ex already has a consumer"),
        "{msg}"
    );

    step("a checksum mismatch fails that send only");
    let mut bad = send_frame(1, 2, b"corrupted");
    let last = bad.len() - 1;
    bad[last] ^= 0x55;
    good.send_raw(&bad);
    let f = good.expect();
    let e = f.command.send_error.expect("SEND_ERROR");
    assert_eq!(e.error, ServerError::ChecksumError as i32);
    good.send_raw(&send_frame(1, 3, b"third"));
    assert!(good.expect().command.send_receipt.is_some());

    assert_eq!(s.stop().unwrap(), 0);
}

#[test]
fn keepalive_pings_and_drops_silent_clients_and_connection_limits_hold() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.env("MERIDIAN_BROKER_KEEPALIVE_INTERVAL_MS", "1000")
        .env("MERIDIAN_BROKER_CONNECTION_HANDLES_MAX", "2");
    s.start().unwrap();
    let url = s.url.clone();

    step("a silent client is pinged, then dropped after a whole interval without a byte");
    let mut silent = Raw::connected(&url);
    let started = Instant::now();
    let mut pinged = false;
    loop {
        match silent.recv_any(Duration::from_millis(200)) {
            Got::Frame(f) if f.command.ping.is_some() => pinged = true,
            Got::Frame(_) | Got::Nothing => {}
            Got::Closed => break,
        }
        assert!(started.elapsed() < Duration::from_secs(10), "never dropped");
    }
    assert!(pinged, "the broker pinged before dropping");
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "dropped too early"
    );

    step("a client that answers pings stays connected");
    let mut alive = Raw::connected(&url);
    let until = Instant::now() + Duration::from_millis(2500);
    while Instant::now() < until {
        alive.send(&cmd(Type::Ping, |c| c.ping = Some(pb::CommandPing {})));
        assert!(alive.expect().command.pong.is_some());
        std::thread::sleep(Duration::from_millis(300));
    }

    step("broker.connection_handles_max = 2: a third producer on one connection is refused");
    alive.send(&producer("limits", 1, 1));
    assert!(alive.expect().command.producer_success.is_some());
    alive.send(&producer("limits", 2, 2));
    assert!(alive.expect().command.producer_success.is_some());
    alive.send(&producer("limits", 3, 3));
    let (code, msg) = error_of(&alive.expect());
    assert_eq!(code, ServerError::TooManyRequests);
    assert!(msg.contains("broker.connection_handles_max"), "{msg}");
    assert_eq!(s.stop().unwrap(), 0);
}

#[test]
fn subscription_properties_are_recorded_at_creation_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.start().unwrap();
    let mut c = Raw::connected(&s.url);
    let mut sub = subscribe("props", "billing", 1, 1);
    let props = |pairs: &[(&str, &str)]| -> Vec<pb::KeyValue> {
        pairs
            .iter()
            .map(|(k, v)| pb::KeyValue {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect()
    };
    sub.subscribe.as_mut().unwrap().subscription_properties =
        props(&[("team", "billing"), ("tier", "gold")]);
    c.send(&sub);
    assert!(c.expect().command.success.is_some());
    let stats = meridian_integration::http_get(&s.http, "/stats?topic=props");
    assert!(
        stats.contains(r#""properties":{"team":"billing","tier":"gold"}"#),
        "{stats}"
    );
    step("restart; a later subscribe with other properties does not change them");
    drop(c);
    assert_eq!(s.stop().unwrap(), 0);
    s.start().unwrap();
    let mut c = Raw::connected(&s.url);
    let mut sub = subscribe("props", "billing", 1, 1);
    sub.subscribe.as_mut().unwrap().subscription_properties = props(&[("team", "other")]);
    c.send(&sub);
    assert!(c.expect().command.success.is_some());
    let stats = meridian_integration::http_get(&s.http, "/stats?topic=props");
    assert!(
        stats.contains(r#""properties":{"team":"billing","tier":"gold"}"#),
        "{stats}"
    );
}

#[test]
fn acks_with_a_request_id_get_an_ack_response_and_errors_name_the_consumer() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.start().unwrap();
    let mut c = Raw::connected(&s.url);
    c.send(&producer("acks", 1, 1));
    assert!(c.expect().command.producer_success.is_some());
    c.send_raw(&send_frame(1, 0, b"one"));
    let receipt = c.expect().command.send_receipt.expect("receipt");
    let id = receipt.message_id.expect("position");
    c.send(&subscribe("acks", "s", 7, 2));
    assert!(c.expect().command.success.is_some());
    let ack = |consumer_id: u64, request_id: u64| {
        cmd(Type::Ack, |c| {
            c.ack = Some(pb::CommandAck {
                consumer_id,
                ack_type: pb::command_ack::AckType::Individual as i32,
                message_id: vec![pb::MessageIdData {
                    ledger_id: id.ledger_id,
                    entry_id: id.entry_id,
                    ..Default::default()
                }],
                request_id: Some(request_id),
                ..Default::default()
            })
        })
    };
    c.send(&ack(7, 40));
    let r = c.expect().command.ack_response.expect("ACK_RESPONSE");
    assert_eq!((r.consumer_id, r.request_id), (7, Some(40)));
    assert_eq!(r.error, None);
    c.send(&ack(99, 41));
    let r = c.expect().command.ack_response.expect("ACK_RESPONSE");
    assert_eq!(r.request_id, Some(41));
    assert_eq!(r.error, Some(ServerError::ConsumerNotFound as i32));
    assert!(r.message.unwrap_or_default().contains("99"));
}
