//! Bad input against a real `meridian standalone`, over raw sockets with our own codec:
//! malformed, oversize and out-of-order frames close that one connection; refusals come back
//! as precise errors; a consumer without permits receives nothing.

mod pki;

use std::time::{Duration, Instant};

use bytes::{BufMut, BytesMut};
use meridian_integration::raw::{
    ack, cmd, error_of, flow, producer, send_frame, subscribe, Got, Raw,
};
use meridian_integration::{step, StandaloneProc};
use meridian_protocol::pb::{self, base_command::Type, ServerError};
use pki::test_pki;

#[test]
fn bad_frames_close_only_their_connection_and_refusals_are_precise() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.start().unwrap();
    let url = s.url.clone();
    assert!(
        !s.log_text().contains('\u{1b}'),
        "a log written to a file carries no ANSI colour codes"
    );

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
fn connections_over_the_broker_s_bounds_are_refused_naming_the_bound_and_the_rest_served() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    test_pki(dir.path());
    let pem = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    s.env("MERIDIAN_BROKER_CONNECTIONS_MAX", "3")
        .env("MERIDIAN_BROKER_CONNECTIONS_PER_IP_MAX", "2")
        .env("MERIDIAN_BROKER_TLS_CERT_FILE", &pem("server.pem"))
        .env("MERIDIAN_BROKER_TLS_KEY_FILE", &pem("server.key"))
        // A soft limit of open files far below the hard one, as Debian's default is.
        .under(&["prlimit", "--nofile=256:"]);
    s.start().unwrap();
    let url = s.url.clone();

    step("the standalone raised its soft limit of open files to the hard one");
    let limits =
        std::fs::read_to_string(format!("/proc/{}/limits", s.pid().expect("running"))).unwrap();
    let open_files: Vec<&str> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a line for open files")
        .split_whitespace()
        .collect();
    // "Max open files SOFT HARD files"
    assert_eq!(open_files[3], open_files[4], "{limits}");
    assert_ne!(open_files[3], "256", "{limits}");
    assert!(s.log_text().contains("open files limit"), "not logged");
    let one: std::net::IpAddr = "127.0.0.1".parse().unwrap();
    let two: std::net::IpAddr = "127.0.0.2".parse().unwrap();

    step("two connections from 127.0.0.1; a third from it is refused with the per-address bound");
    let first = Raw::connect_from(&url, one).expect("first");
    let _second = Raw::connect_from(&url, one).expect("second");
    let mut third = Raw::open_from(&url, one);
    let f = third.expect();
    let (code, msg) = error_of(&f);
    assert_eq!(code, ServerError::NotAllowedError, "{msg}");
    assert!(msg.contains("broker.connections_per_ip_max = 2"), "{msg}");
    // ... and closed by the broker.
    assert!(matches!(third.recv(Duration::from_secs(5)), Got::Closed));

    step("another address gets the total's last connection; then the total bound refuses");
    let mut from_two = Raw::connect_from(&url, two).expect("from 127.0.0.2");
    let (code, msg) = Raw::connect_from(&url, two).err().expect("refused");
    assert_eq!(code, ServerError::NotAllowedError, "{msg}");
    assert!(msg.contains("broker.connections_max = 3"), "{msg}");

    step("the connections admitted work; once one leaves, a new one is served");
    from_two.send(&producer("bounds", 1, 1));
    assert!(from_two.expect().command.producer_success.is_some());
    drop(first);
    let t = Instant::now();
    let _again = loop {
        match Raw::connect_from(&url, one) {
            Ok(r) => break r,
            Err((ServerError::NotAllowedError, _)) => {
                assert!(t.elapsed() < Duration::from_secs(5), "still refused");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("{e:?}"),
        }
    };

    step("the TLS port counts with the plain one; its refusal comes after the handshake");
    let tls = s.tls_url.clone().expect("a pulsar+ssl:// port");
    let f = first_frame_over_tls(
        tls.trim_start_matches("pulsar+ssl://"),
        &dir.path().join("ca.pem"),
    );
    let (code, msg) = error_of(&f);
    assert_eq!(code, ServerError::NotAllowedError, "{msg}");
    assert!(msg.contains("broker.connections_max = 3"), "{msg}");

    step("/metrics counts the refusals by bound");
    let page = meridian_integration::http_get(&s.http, "/metrics");
    let refused = |bound: &str| {
        meridian_integration::metric_value(
            &page,
            &format!("meridian_connections_refused_total{{listener=\"pulsar\",bound=\"{bound}\"}}"),
        )
    };
    assert_eq!(refused("broker.connections_per_ip_max"), 1.0, "{page}");
    assert!(refused("broker.connections_max") >= 1.0, "{page}");
    assert_eq!(s.stop().unwrap(), 0);
}

/// Connects to `addr` over TLS (trusting `ca`), sends nothing, and returns the first frame.
fn first_frame_over_tls(addr: &str, ca: &std::path::Path) -> meridian_protocol::Frame {
    use rustls::pki_types::pem::PemObject;
    use tokio::io::AsyncReadExt;
    use tokio_rustls::rustls;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls::pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
            roots.add(c.unwrap()).unwrap();
        }
        let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let name = meridian_metadata::tls::server_name(addr).unwrap();
        let mut s = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
            .connect(name, tcp)
            .await
            .expect("the TLS handshake");
        let mut buf = BytesMut::new();
        loop {
            if let Some(f) = meridian_protocol::decode_frame(&mut buf, 1 << 20).unwrap() {
                return f;
            }
            let n = tokio::time::timeout(Duration::from_secs(5), s.read_buf(&mut buf))
                .await
                .expect("a frame within 5 s")
                .expect("read");
            assert!(n > 0, "closed with no frame");
        }
    })
}

/// Reads `s` until its server closes it; how long that took from `from`.
fn closed_by_server(s: &mut std::net::TcpStream, from: Instant, within: Duration) -> Duration {
    use std::io::Read;
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return from.elapsed(),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return from.elapsed(),
        }
        assert!(from.elapsed() < within, "still open after {within:?}");
    }
}

#[test]
fn peers_that_hold_connections_half_open_are_closed_and_do_not_hold_a_shutdown() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.env("MERIDIAN_BROKER_KEEPALIVE_INTERVAL_MS", "1000");
    s.start().unwrap();
    let admin = s.admin_url.trim_start_matches("http://").to_string();
    let addresses: serde_json::Value =
        serde_json::from_slice(&std::fs::read(s.data_dir.join("addresses.json")).unwrap()).unwrap();
    let metadata = addresses["metadata"].as_str().unwrap().to_string();
    let open = |addr: &str, bytes: &[u8]| {
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.write_all(bytes).unwrap();
        c
    };

    step("half an HTTP/2 preface to the admin API: closed after twice the keep-alive interval");
    let t = Instant::now();
    let mut half_admin = open(&admin, b"PRI * HTTP/2.0\r\n");
    let took = closed_by_server(&mut half_admin, t, Duration::from_secs(15));
    assert!(took >= Duration::from_millis(1800), "closed after {took:?}");

    step("SIGTERM while an HTTP request, an admin preface and a metadata preface are half sent");
    let _half_http = open(&s.http, b"GET /metrics HTTP/1.1\r\nHost: x\r\n");
    let _half_admin = open(&admin, b"PRI * HTTP/2.0\r\n");
    let _half_metadata = open(&metadata, b"PRI * HTTP/2.0\r\n");
    std::thread::sleep(Duration::from_millis(300));
    let pid = s.pid().expect("running");
    let t = Instant::now();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    // Before, the standalone waited for the HTTP client for as long as it held its half
    // request (and for the admin one's preface).
    while s.exited().is_none() {
        if t.elapsed() > Duration::from_secs(30) {
            s.kill9().unwrap();
            panic!("still running 30 s after SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let took = t.elapsed();
    println!("stopped {took:?} after SIGTERM");
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
    let ack = |consumer_id: u64, request_id: u64| ack(consumer_id, request_id, &id);
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

fn ack_of(
    consumer_id: u64,
    request_id: u64,
    cumulative: bool,
    ledger_id: u64,
    entry_id: u64,
    ack_set: Vec<i64>,
) -> pb::BaseCommand {
    cmd(Type::Ack, |c| {
        c.ack = Some(pb::CommandAck {
            consumer_id,
            ack_type: if cumulative {
                pb::command_ack::AckType::Cumulative
            } else {
                pb::command_ack::AckType::Individual
            } as i32,
            message_id: vec![pb::MessageIdData {
                ledger_id,
                entry_id,
                ack_set,
                ..Default::default()
            }],
            request_id: Some(request_id),
            ..Default::default()
        })
    })
}

/// The next ACK_RESPONSE (other frames are skipped).
fn ack_response(c: &mut Raw) -> pb::CommandAckResponse {
    loop {
        if let Some(r) = c.expect().command.ack_response {
            return r;
        }
    }
}

/// SUBSCRIBE of a Shared subscription.
fn shared_subscribe(topic: &str, sub: &str, consumer_id: u64, request_id: u64) -> pb::BaseCommand {
    let mut c = subscribe(topic, sub, consumer_id, request_id);
    if let Some(x) = c.subscribe.as_mut() {
        x.sub_type = pb::command_subscribe::SubType::Shared as i32;
    }
    c
}

/// (ledger, entry) of every MESSAGE that arrives until nothing comes for `idle`.
fn drain(c: &mut Raw, idle: Duration) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    while let Got::Frame(f) = c.recv(idle) {
        if let Some(m) = f.command.message.as_ref() {
            out.push((m.message_id.ledger_id, m.message_id.entry_id));
        }
    }
    out
}

#[test]
fn acks_past_the_log_cumulative_acks_on_shared_and_oversize_ack_sets_are_refused_and_change_nothing(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.start().unwrap();
    let mut c = Raw::connected(&s.url);
    c.send(&producer("ack-checks", 1, 1));
    assert!(c.expect().command.producer_success.is_some());
    let mut ids = Vec::new();
    for i in 0..3 {
        c.send_raw(&send_frame(1, i, format!("m{i}").as_bytes()));
        let r = c.expect().command.send_receipt.expect("receipt");
        ids.push(r.message_id.expect("position"));
    }
    let ledger = ids[0].ledger_id;
    let last = ids[2].entry_id;
    c.send(&subscribe("ack-checks", "exclusive", 7, 2));
    assert!(c.expect().command.success.is_some());
    let refused = |c: &mut Raw, ack: pb::BaseCommand, what: &str| -> String {
        c.send(&ack);
        let r = ack_response(c);
        assert_eq!(
            r.error,
            Some(ServerError::NotAllowedError as i32),
            "{what}: {:?}",
            r.message
        );
        r.message.unwrap_or_default()
    };

    step("a cumulative ACK past the end of the log is refused");
    let m = refused(
        &mut c,
        ack_of(7, 10, true, ledger, last + 1000, vec![]),
        "cumulative past the end",
    );
    assert!(m.contains("not an entry"), "{m}");
    step("an individual ACK of an entry that does not exist is refused");
    refused(
        &mut c,
        ack_of(7, 11, false, ledger + 50, 0, vec![]),
        "unknown ledger",
    );
    step("an ack_set longer than its batch is refused");
    let m = refused(
        &mut c,
        ack_of(7, 12, false, ledger, ids[1].entry_id, vec![1; 1000]),
        "oversize ack_set",
    );
    assert!(m.contains("1000 words"), "{m}");

    step("nothing moved: every message is still delivered");
    c.send(&flow(7, 100));
    let got = drain(&mut c, Duration::from_secs(2));
    let all: Vec<(u64, u64)> = ids.iter().map(|i| (i.ledger_id, i.entry_id)).collect();
    assert_eq!(got, all);

    step("an ack_set with bits past its one message acknowledges it (the bits are cleared)");
    c.send(&ack_of(7, 13, false, ledger, ids[0].entry_id, vec![1 << 5]));
    let r = ack_response(&mut c);
    assert_eq!(r.error, None, "{:?}", r.message);
    c.send(&cmd(Type::CloseConsumer, |x| {
        x.close_consumer = Some(pb::CommandCloseConsumer {
            consumer_id: 7,
            request_id: 14,
        })
    }));
    assert!(c.expect().command.success.is_some());
    c.send(&subscribe("ack-checks", "exclusive", 8, 15));
    assert!(c.expect().command.success.is_some());
    c.send(&flow(8, 100));
    let got = drain(&mut c, Duration::from_secs(2));
    assert_eq!(got, all[1..].to_vec());

    step("a cumulative ACK on a Shared subscription is refused");
    let mut sh = subscribe("ack-checks", "shared", 9, 16);
    if let Some(x) = sh.subscribe.as_mut() {
        x.sub_type = pb::command_subscribe::SubType::Shared as i32;
    }
    c.send(&sh);
    assert!(c.expect().command.success.is_some());
    let m = refused(
        &mut c,
        ack_of(9, 17, true, ledger, ids[0].entry_id, vec![]),
        "cumulative on Shared",
    );
    assert!(m.contains("cumulative"), "{m}");
}

#[test]
fn a_wait_for_exclusive_producer_cannot_publish_before_it_is_granted() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.start().unwrap();
    let mut owner = Raw::connected(&s.url);
    let mut exclusive = producer("wait-excl", 1, 1);
    if let Some(p) = exclusive.producer.as_mut() {
        p.producer_access_mode = Some(1); // Exclusive
    }
    owner.send(&exclusive);
    assert!(owner.expect().command.producer_success.is_some());

    step("a WaitForExclusive producer is told it is not ready");
    let mut waiter = Raw::connected(&s.url);
    let mut wait = producer("wait-excl", 1, 1);
    if let Some(p) = wait.producer.as_mut() {
        p.producer_access_mode = Some(2); // WaitForExclusive
    }
    waiter.send(&wait);
    let ps = waiter
        .expect()
        .command
        .producer_success
        .expect("PRODUCER_SUCCESS");
    assert_eq!(ps.producer_ready, Some(false));
    step("its create retried (as a client whose request timed out does): still not ready");
    let mut again = wait.clone();
    if let Some(p) = again.producer.as_mut() {
        p.request_id = 3;
    }
    waiter.send(&again);
    let ps = waiter
        .expect()
        .command
        .producer_success
        .expect("PRODUCER_SUCCESS to the retry");
    assert_eq!(ps.request_id, 3);
    assert_eq!(ps.producer_ready, Some(false));

    step("its SEND is refused and nothing is appended");
    waiter.send_raw(&send_frame(1, 0, b"too early"));
    let e = waiter.expect().command.send_error.expect("SEND_ERROR");
    assert_eq!(
        e.error,
        ServerError::NotAllowedError as i32,
        "{}",
        e.message
    );
    owner.send_raw(&send_frame(1, 0, b"owner"));
    let r = owner.expect().command.send_receipt.expect("receipt");
    assert_eq!(
        r.message_id.expect("position").entry_id,
        0,
        "the early send took no entry"
    );

    step("once the owner leaves, the waiter is granted and publishes");
    owner.send(&cmd(Type::CloseProducer, |c| {
        c.close_producer = Some(pb::CommandCloseProducer {
            producer_id: 1,
            request_id: 2,
        })
    }));
    assert!(owner.expect().command.success.is_some());
    let ps = waiter
        .expect()
        .command
        .producer_success
        .expect("second PRODUCER_SUCCESS");
    assert_eq!(ps.producer_ready, Some(true));
    waiter.send_raw(&send_frame(1, 1, b"granted"));
    let r = waiter.expect().command.send_receipt.expect("receipt");
    assert_eq!(r.message_id.expect("position").entry_id, 1);
}

#[test]
fn a_message_claiming_a_replicated_origin_is_refused_and_takes_no_entry() {
    // Field 1001 is what this site's receiving of replicated entries writes: a producer's
    // message carrying it would be taken for one (never sent on, its claimed origin believed
    // by the topic's origins, so the real site's entries would be dropped as held).
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.start().unwrap();
    let mut c = Raw::connected(&s.url);
    c.send(&producer("forged-origin", 1, 1));
    assert!(c.expect().command.producer_success.is_some());
    let forged = pb::MessageMetadata {
        producer_name: "raw".into(),
        sequence_id: 0,
        publish_time: 1,
        meridian_origin: Some(pb::MeridianOrigin {
            site: "west".into(),
            ledger_id: u64::MAX / 2,
            entry_id: 0,
        }),
        ..Default::default()
    };
    c.send_raw(&send_with(1, 0, &forged, b"forged"));
    let e = c.expect().command.send_error.expect("SEND_ERROR");
    assert_eq!(
        e.error,
        ServerError::NotAllowedError as i32,
        "{}",
        e.message
    );
    assert!(e.message.contains("meridian_origin"), "{}", e.message);

    step("the producer goes on; the refused message took no entry");
    c.send_raw(&send_frame(1, 1, b"plain"));
    let r = c.expect().command.send_receipt.expect("receipt");
    assert_eq!(r.message_id.expect("position").entry_id, 0);
}

#[test]
fn a_consumer_that_stops_reading_stalls_only_itself_not_the_subscription() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.env(
        "MERIDIAN_BROKER_CONNECTION_WRITE_QUEUE_BYTES_MAX",
        "1048576",
    )
    // A never answers pings: keep it connected for the whole test.
    .env("MERIDIAN_BROKER_KEEPALIVE_INTERVAL_MS", "300000");
    s.start().unwrap();
    let topic = "persistent://public/default/stall";
    let shared = |consumer_id: u64, request_id: u64| {
        shared_subscribe(topic, "stall", consumer_id, request_id)
    };
    step("consumer A grants a million permits and never reads its socket; B reads");
    let mut a = Raw::connected(&s.url);
    a.send(&shared(1, 1));
    assert!(a.expect().command.success.is_some());
    a.send(&flow(1, 1_000_000));
    let mut b = Raw::connected(&s.url);
    b.send(&shared(2, 1));
    assert!(b.expect().command.success.is_some());
    b.send(&flow(2, 1_000_000));

    step("40,000 messages of 1 KiB: far more than A's queue and socket hold");
    let reader = std::thread::spawn(move || {
        let got = drain(&mut b, Duration::from_secs(3));
        (b, got)
    });
    meridian_integration::perf_produce(&s.url, topic, 40_000);
    let (mut b, mut got_b) = reader.join().unwrap();
    eprintln!("B received {} of the first 40,000", got_b.len());
    assert!(
        got_b.len() > 20_000,
        "B received only {} while A stalled",
        got_b.len()
    );

    step("B's acknowledgements are answered while A stalls");
    let (l, e) = got_b[0];
    b.send(&ack_of(2, 99, false, l, e, vec![]));
    let r = loop {
        match b.recv(Duration::from_secs(10)) {
            Got::Frame(f) => {
                if let Some(r) = f.command.ack_response {
                    break r;
                }
            }
            _ => panic!("no ACK_RESPONSE within 10 s: the subscription is stalled"),
        }
    };
    assert_eq!(r.error, None);

    step("2,000 more: all of them reach B");
    let reader = std::thread::spawn(move || {
        let got = drain(&mut b, Duration::from_secs(3));
        (b, got)
    });
    meridian_integration::perf_produce(&s.url, topic, 2_000);
    let (_b, more) = reader.join().unwrap();
    assert_eq!(more.len(), 2_000, "B received {} of 2,000", more.len());
    got_b.extend(more);

    step("A reads at last: A and B together hold every message once");
    let got_a = drain(&mut a, Duration::from_secs(3));
    eprintln!("A held {}", got_a.len());
    let mut all: Vec<(u64, u64)> = got_a.iter().chain(&got_b).copied().collect();
    all.sort_unstable();
    let n = all.len();
    all.dedup();
    assert_eq!(n, all.len(), "a message went to both consumers");
    assert_eq!(n, 42_000);
}

/// A client that stops reading once its connection's write queue is full (a frozen process:
/// its kernel keeps the window shut, and TCP never gives such a peer up), after a PING whose
/// PONG may wait for room and sends whose receipts do: dropped within about a keep-alive
/// interval, its exclusive subscription and its producer's name free again, and the messages
/// it held delivered to the next consumer. Before, the connection's loop waited for room for
/// that PONG, or for its own PING, for as long as the client stayed frozen.
#[test]
fn a_client_that_stops_reading_with_its_queue_full_is_dropped_and_frees_what_it_held() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.env("MERIDIAN_BROKER_CONNECTION_WRITE_QUEUE_BYTES_MAX", "65536")
        .env("MERIDIAN_BROKER_KEEPALIVE_INTERVAL_MS", "1000");
    s.start().unwrap();
    let topic = "persistent://public/default/frozen";
    let named = |topic: &str, producer_id: u64, request_id: u64| {
        let mut c = producer(topic, producer_id, request_id);
        if let Some(p) = c.producer.as_mut() {
            p.producer_name = Some("frozen-p".into());
        }
        c
    };

    step("20,000 messages of 1 KiB");
    meridian_integration::perf_produce(&s.url, topic, 20_000);

    step("A: an exclusive consumer and a producer named frozen-p");
    let mut a = Raw::connected(&s.url);
    a.send(&subscribe(topic, "frozen", 1, 1));
    assert!(a.expect().command.success.is_some());
    a.send(&named("persistent://public/default/frozen-p", 1, 2));
    assert!(a.expect().command.producer_success.is_some());
    step("A grants a million permits, sends 10 messages and a PING, and reads nothing more");
    a.send(&flow(1, 1_000_000));
    for seq in 0..10 {
        a.send_raw(&send_frame(1, seq, b"held"));
    }
    a.send(&cmd(Type::Ping, |c| c.ping = Some(pb::CommandPing {})));
    let frozen = Instant::now();

    step(
        "B takes the exclusive subscription once A is dropped; A goes on sending PINGs, so \
          only its socket taking nothing can get it dropped",
    );
    let ping = {
        let mut b = BytesMut::new();
        meridian_protocol::encode_command(
            &mut b,
            &cmd(Type::Ping, |c| c.ping = Some(pb::CommandPing {})),
        );
        b
    };
    let mut b = loop {
        a.send_raw(&ping);
        let mut b = Raw::connected(&s.url);
        b.send(&subscribe(topic, "frozen", 1, 1));
        let f = b.expect();
        if f.command.success.is_some() {
            break b;
        }
        let (code, msg) = error_of(&f);
        assert_eq!(code, ServerError::ConsumerBusy, "{msg}");
        assert!(
            frozen.elapsed() < Duration::from_secs(15),
            "A still holds the subscription {:?} after it stopped: {msg}",
            frozen.elapsed()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("B subscribed {:?} after A stopped", frozen.elapsed());

    step("B makes a producer named frozen-p");
    b.send(&named("persistent://public/default/frozen-p", 1, 2));
    let f = b.expect();
    assert!(
        f.command.producer_success.is_some(),
        "{:?}",
        f.command.error.as_ref().map(|e| e.message.clone())
    );

    step("B receives every message A held (and answers the broker's PINGs meanwhile)");
    b.send(&flow(1, 1_000_000));
    let mut got = Vec::new();
    let (mut last, mut pinged) = (Instant::now(), Instant::now());
    while last.elapsed() < Duration::from_secs(3) {
        if pinged.elapsed() >= Duration::from_millis(200) {
            b.send(&cmd(Type::Ping, |c| c.ping = Some(pb::CommandPing {})));
            pinged = Instant::now();
        }
        match b.recv(Duration::from_millis(200)) {
            Got::Frame(f) => {
                if let Some(m) = f.command.message.as_ref() {
                    got.push((m.message_id.ledger_id, m.message_id.entry_id));
                    last = Instant::now();
                }
            }
            Got::Nothing => {}
            Got::Closed => panic!("B was dropped after {} messages", got.len()),
        }
    }
    got.sort_unstable();
    got.dedup();
    assert_eq!(got.len(), 20_000);
    drop(a);
    assert_eq!(s.stop().unwrap(), 0);
}

/// A SEEK closes every consumer of its subscription (CLOSE_CONSUMER to each): one whose
/// client stopped reading, its queue full, does not hold up the SEEK's answer, nor the
/// connection that sent it. Before, the CLOSE_CONSUMER waited for room in the stalled
/// client's queue, here for the whole keep-alive interval (300 s).
#[test]
fn a_seek_is_answered_while_another_consumer_of_its_subscription_stops_reading() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.env("MERIDIAN_BROKER_CONNECTION_WRITE_QUEUE_BYTES_MAX", "65536")
        .env("MERIDIAN_BROKER_KEEPALIVE_INTERVAL_MS", "300000");
    s.start().unwrap();
    let topic = "persistent://public/default/seek-stall";
    let shared = |consumer_id: u64, request_id: u64| {
        shared_subscribe(topic, "seek-stall", consumer_id, request_id)
    };
    step("A: a consumer with a million permits that reads nothing; B: one without permits");
    let mut a = Raw::connected(&s.url);
    a.send(&shared(1, 1));
    assert!(a.expect().command.success.is_some());
    a.send(&flow(1, 1_000_000));
    let mut b = Raw::connected(&s.url);
    b.send(&shared(2, 1));
    assert!(b.expect().command.success.is_some());
    step("20,000 messages of 1 KiB fill A's queue");
    meridian_integration::perf_produce(&s.url, topic, 20_000);

    step("B seeks the subscription to its start: answered within 5 s");
    b.send(&cmd(Type::Seek, |c| {
        c.seek = Some(pb::CommandSeek {
            consumer_id: 2,
            request_id: 2,
            message_publish_time: Some(0),
            ..Default::default()
        })
    }));
    let asked = Instant::now();
    loop {
        match b.recv(Duration::from_secs(5)) {
            Got::Frame(f) if f.command.success.is_some() => break,
            Got::Frame(f) if f.command.close_consumer.is_some() => {}
            Got::Frame(f) => panic!("unexpected answer: {:?}", f.command),
            Got::Closed => panic!("B's connection closed"),
            Got::Nothing => panic!(
                "no answer to the SEEK within {:?}: it waits on A's full queue",
                asked.elapsed()
            ),
        }
    }
    drop(a);
    assert_eq!(s.stop().unwrap(), 0);
}

#[test]
fn topics_that_fail_to_load_leave_nothing_in_the_broker() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.start().unwrap();
    let mut c = Raw::connected(&s.url);
    step("200 producers on topics of a namespace that does not exist: each refused");
    for i in 0..200u64 {
        c.send(&producer(
            &format!("persistent://public/nowhere/t{i}"),
            i,
            i,
        ));
        let f = c.expect();
        let (code, _) = error_of(&f);
        assert_eq!(code, ServerError::TopicNotFound);
    }
    step("one that loads");
    c.send(&producer("persistent://public/default/real", 1000, 1000));
    assert!(c.expect().command.producer_success.is_some());
    let health = meridian_integration::http_get(&s.http, "/health");
    let body: serde_json::Value =
        serde_json::from_str(health.split("\r\n\r\n").nth(1).unwrap_or_default()).unwrap();
    assert_eq!(body["topics"], 1, "{health}");
    assert_eq!(
        body["topic_entries"], 1,
        "failed loads left entries: {health}"
    );
}

#[test]
fn a_producer_with_an_initial_subscription_name_creates_it_before_its_first_message() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.start().unwrap();
    let mut c = Raw::connected(&s.url);
    let mut p = producer("initial-sub", 1, 1);
    if let Some(x) = p.producer.as_mut() {
        x.initial_subscription_name = Some("from-the-start".into());
    }
    c.send(&p);
    assert!(c.expect().command.producer_success.is_some());
    for i in 0..3 {
        c.send_raw(&send_frame(1, i, b"early"));
        assert!(c.expect().command.send_receipt.is_some());
    }
    step("a consumer that comes later, asking for Latest, still gets all three");
    let mut sub = subscribe("initial-sub", "from-the-start", 5, 2);
    if let Some(x) = sub.subscribe.as_mut() {
        x.initial_position = Some(pb::command_subscribe::InitialPosition::Latest as i32);
    }
    c.send(&sub);
    assert!(c.expect().command.success.is_some());
    c.send(&flow(5, 100));
    assert_eq!(drain(&mut c, Duration::from_secs(2)).len(), 3);
}

/// A SEND of one message stamped with `publish_time` (milliseconds).
fn send_at(producer_id: u64, sequence_id: u64, publish_time: u64) -> Vec<u8> {
    let meta = pb::MessageMetadata {
        producer_name: "raw".into(),
        sequence_id,
        publish_time,
        ..Default::default()
    };
    send_with(producer_id, sequence_id, &meta, b"stamped")
}

/// A SEND of one message with this metadata.
fn send_with(
    producer_id: u64,
    sequence_id: u64,
    meta: &pb::MessageMetadata,
    payload: &[u8],
) -> Vec<u8> {
    use prost::Message as _;
    let entry = meridian_protocol::Entry::build(&meta.encode_to_vec(), payload);
    let c = cmd(Type::Send, |c| {
        c.send = Some(pb::CommandSend {
            producer_id,
            sequence_id,
            ..Default::default()
        })
    });
    let mut b = BytesMut::new();
    meridian_protocol::encode_message(&mut b, &c, entry.as_bytes());
    b.to_vec()
}

#[test]
fn a_reader_with_a_rollback_duration_starts_at_messages_that_recent() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.start().unwrap();
    let mut c = Raw::connected(&s.url);
    c.send(&producer("rollback", 1, 1));
    assert!(c.expect().command.producer_success.is_some());
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut ids = Vec::new();
    // Two published an hour ago, two now.
    for (i, t) in [now_ms - 3_600_000, now_ms - 3_600_000, now_ms, now_ms]
        .into_iter()
        .enumerate()
    {
        c.send_raw(&send_at(1, i as u64, t));
        let r = c.expect().command.send_receipt.expect("receipt");
        ids.push(r.message_id.expect("position").entry_id);
    }
    step("a reader from earliest with a rollback of 60 s reads only the two recent ones");
    let mut sub = subscribe("rollback", "reader-1", 5, 2);
    if let Some(x) = sub.subscribe.as_mut() {
        x.durable = Some(false);
        x.start_message_id = Some(pb::MessageIdData {
            ledger_id: u64::MAX,
            entry_id: u64::MAX,
            ..Default::default()
        });
        x.start_message_rollback_duration_sec = Some(60);
    }
    c.send(&sub);
    assert!(c.expect().command.success.is_some());
    c.send(&flow(5, 100));
    let got: Vec<u64> = drain(&mut c, Duration::from_secs(2))
        .into_iter()
        .map(|(_, e)| e)
        .collect();
    assert_eq!(got, ids[2..].to_vec());
}

fn consumer_stats(c: &mut Raw, consumer_id: u64) -> pb::CommandConsumerStatsResponse {
    c.send(&cmd(Type::ConsumerStats, |x| {
        x.consumer_stats = Some(pb::CommandConsumerStats {
            request_id: 500 + consumer_id,
            consumer_id,
        })
    }));
    loop {
        if let Some(r) = c.expect().command.consumer_stats_response {
            return r;
        }
    }
}

#[test]
fn unacknowledged_limits_per_consumer_and_per_subscription_block_dispatch_until_acks() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.env("MERIDIAN_BROKER_CONSUMER_UNACKED_MESSAGES_MAX", "10")
        .env("MERIDIAN_BROKER_SUBSCRIPTION_UNACKED_MESSAGES_MAX", "15");
    s.start().unwrap();
    let mut p = Raw::connected(&s.url);
    p.send(&producer("unacked", 1, 1));
    assert!(p.expect().command.producer_success.is_some());
    for i in 0..30 {
        p.send_raw(&send_frame(1, i, b"m"));
        assert!(p.expect().command.send_receipt.is_some());
    }
    let shared = |sub: &str, consumer_id: u64| {
        let mut c = subscribe("unacked", sub, consumer_id, consumer_id);
        if let Some(x) = c.subscribe.as_mut() {
            x.sub_type = pb::command_subscribe::SubType::Shared as i32;
        }
        c
    };

    step("one consumer with 1,000 permits gets 10 and is blocked");
    let mut a = Raw::connected(&s.url);
    a.send(&shared("one", 1));
    assert!(a.expect().command.success.is_some());
    a.send(&flow(1, 1000));
    let got = drain(&mut a, Duration::from_secs(2));
    assert_eq!(got.len(), 10);
    let st = consumer_stats(&mut a, 1);
    assert_eq!(st.unacked_messages, Some(10));
    assert_eq!(st.blocked_consumer_on_unacked_msgs, Some(true));

    step("acks of 6 bring it under half: it gets 6 more, up to the limit again");
    for (l, e) in &got[..6] {
        a.send(&ack_of(1, 100 + e, false, *l, *e, vec![]));
    }
    let more = drain(&mut a, Duration::from_secs(2));
    assert_eq!(more.len(), 6, "{more:?}");
    let st = consumer_stats(&mut a, 1);
    assert_eq!(st.unacked_messages, Some(10));

    step("two consumers of another subscription stop at its limit of 15 together");
    let mut b1 = Raw::connected(&s.url);
    b1.send(&shared("two", 2));
    assert!(b1.expect().command.success.is_some());
    let mut b2 = Raw::connected(&s.url);
    b2.send(&shared("two", 3));
    assert!(b2.expect().command.success.is_some());
    b1.send(&flow(2, 1000));
    b2.send(&flow(3, 1000));
    std::thread::sleep(Duration::from_millis(500));
    let n1 = drain(&mut b1, Duration::from_secs(2)).len();
    let n2 = drain(&mut b2, Duration::from_secs(1)).len();
    assert_eq!(n1 + n2, 15, "{n1} + {n2}");
    assert_eq!(
        consumer_stats(&mut b1, 2).blocked_consumer_on_unacked_msgs,
        Some(true)
    );
}

#[test]
fn deduplication_forgets_a_producer_name_after_its_inactivity_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.env("MERIDIAN_BROKER_DEDUPLICATION_ENABLED", "true")
        .env("MERIDIAN_BROKER_DEDUP_PRODUCER_INACTIVITY_S", "10");
    s.start().unwrap();
    let mut c = Raw::connected(&s.url);
    // `send_frame` stamps producer name "raw": the name deduplication keys on.
    let named = |producer_id: u64, request_id: u64| {
        let mut p = producer("dedup-expiry", producer_id, request_id);
        if let Some(x) = p.producer.as_mut() {
            x.producer_name = Some("raw".into());
        }
        p
    };
    let close = |c: &mut Raw, producer_id: u64, request_id: u64| {
        c.send(&cmd(Type::CloseProducer, |x| {
            x.close_producer = Some(pb::CommandCloseProducer {
                producer_id,
                request_id,
            })
        }));
        assert!(c.expect().command.success.is_some());
    };
    c.send(&named(1, 1));
    let ps = c
        .expect()
        .command
        .producer_success
        .expect("PRODUCER_SUCCESS");
    assert_eq!(ps.last_sequence_id, Some(-1));
    for i in 0..3 {
        c.send_raw(&send_frame(1, i, b"m"));
        assert!(c.expect().command.send_receipt.is_some());
    }
    close(&mut c, 1, 2);
    step("back at once: the name is remembered and a resend is a duplicate");
    c.send(&named(2, 3));
    let ps = c
        .expect()
        .command
        .producer_success
        .expect("PRODUCER_SUCCESS");
    assert_eq!(ps.last_sequence_id, Some(2));
    c.send_raw(&send_frame(2, 2, b"again"));
    let r = c.expect().command.send_receipt.expect("receipt");
    assert_eq!(r.message_id.expect("id").entry_id, u64::MAX, "a duplicate");
    close(&mut c, 2, 4);
    step("after 10 s without it (and a stats round), the name is forgotten");
    std::thread::sleep(Duration::from_secs(17));
    c.send(&cmd(Type::Ping, |x| x.ping = Some(pb::CommandPing {})));
    c.send(&named(3, 5));
    let ps = loop {
        if let Some(ps) = c.expect().command.producer_success {
            break ps;
        }
    };
    assert_eq!(ps.last_sequence_id, Some(-1));
    c.send_raw(&send_frame(3, 0, b"fresh"));
    let r = c.expect().command.send_receipt.expect("receipt");
    assert_ne!(
        r.message_id.expect("id").entry_id,
        u64::MAX,
        "stored, not a duplicate"
    );
}

/// A SEND from producer `name` (its metadata carries the name deduplication keys on).
fn send_named(producer_id: u64, name: &str, sequence_id: u64) -> Vec<u8> {
    use prost::Message as _;
    let meta = pb::MessageMetadata {
        producer_name: name.into(),
        sequence_id,
        publish_time: 1,
        ..Default::default()
    }
    .encode_to_vec();
    let entry = meridian_protocol::Entry::build(&meta, b"n");
    let c = cmd(Type::Send, |c| {
        c.send = Some(pb::CommandSend {
            producer_id,
            sequence_id,
            ..Default::default()
        })
    });
    let mut b = BytesMut::new();
    meridian_protocol::encode_message(&mut b, &c, entry.as_bytes());
    b.to_vec()
}

#[test]
fn a_deduplication_snapshot_of_many_names_is_paged_and_survives_kill9_and_deletion() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = StandaloneProc::new(dir.path());
    s.keep_ports()
        .env("MERIDIAN_BROKER_DEDUPLICATION_ENABLED", "true")
        .env("MERIDIAN_BROKER_DEDUPLICATION_SNAPSHOT_ENTRIES", "500");
    s.start().unwrap();
    let topic = "persistent://public/default/many-names";
    let name = |i: u64| format!("a-producer-with-a-rather-long-name-{i:030}");
    step("6,000 producer names, one message each: a snapshot past one page");
    let mut c = Raw::connected(&s.url);
    for i in 0..6_000u64 {
        let mut p = producer(topic, i, 3 * i);
        if let Some(x) = p.producer.as_mut() {
            x.producer_name = Some(name(i));
        }
        c.send(&p);
        c.send_raw(&send_named(i, &name(i), 7));
        c.send(&cmd(Type::CloseProducer, |x| {
            x.close_producer = Some(pb::CommandCloseProducer {
                producer_id: i,
                request_id: 3 * i + 1,
            })
        }));
        let mut got = 0;
        while got < 3 {
            let f = c.expect();
            assert!(f.command.error.is_none(), "{:?}", f.command);
            got += 1;
        }
    }
    let pages = |s: &StandaloneProc| {
        tokio::runtime::Runtime::new().unwrap().block_on(async {
            let m = s.metadata_client().unwrap();
            m.list("/topic-dedup/public/default/persistent/many-names/", "", 0)
                .await
                .unwrap()
                .kvs
                .len()
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while pages(&s) < 2 {
        assert!(std::time::Instant::now() < deadline, "no snapshot pages");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(!s.log_text().contains("deduplication snapshot failed"));

    step("kill -9 and restart: every name is remembered");
    drop(c);
    s.kill9().unwrap();
    s.start().unwrap();
    let mut c = Raw::connected(&s.url);
    for i in [0u64, 2_999, 5_999] {
        let mut p = producer(topic, 10_000 + i, 10_000 + i);
        if let Some(x) = p.producer.as_mut() {
            x.producer_name = Some(name(i));
        }
        c.send(&p);
        let ps = c
            .expect()
            .command
            .producer_success
            .expect("PRODUCER_SUCCESS");
        assert_eq!(ps.last_sequence_id, Some(7), "{}", name(i));
    }
    drop(c);
    step("the topic is deleted: its pages go with it");
    std::thread::sleep(Duration::from_millis(500));
    let (code, _, err) = meridian_integration::run_admin(&[
        "--admin-url",
        &s.admin_url,
        "topics",
        "delete",
        topic,
        "--force",
    ])
    .unwrap();
    assert_eq!(code, 0, "{err}");
    assert_eq!(pages(&s), 0);
}
