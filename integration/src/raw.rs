//! A raw Pulsar-protocol client over our codec, for tests that need frames the stock clients
//! never send (bad input) or fields they do not expose.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use meridian_protocol::pb::{self, base_command::Type, ServerError};
use meridian_protocol::{decode_frame, encode_command, encode_message, Entry, Frame};
use prost::Message as _;

/// One connection, read with a timeout.
pub struct Raw {
    s: TcpStream,
    buf: BytesMut,
}

pub enum Got {
    Frame(Box<Frame>),
    Closed,
    Nothing,
}

impl Raw {
    pub fn open(url: &str) -> Raw {
        let addr = url.trim_start_matches("pulsar://");
        let s = TcpStream::connect(addr).expect("connect");
        Raw {
            s,
            buf: BytesMut::new(),
        }
    }

    pub fn connected(url: &str) -> Raw {
        let mut r = Raw::open(url);
        r.send(&pb::BaseCommand {
            r#type: Type::Connect as i32,
            connect: Some(pb::CommandConnect {
                client_version: "raw-test".into(),
                protocol_version: Some(19),
                ..Default::default()
            }),
            ..Default::default()
        });
        match r.recv(Duration::from_secs(10)) {
            Got::Frame(f) => assert!(f.command.connected.is_some(), "{:?}", f.command),
            _ => panic!("no CONNECTED"),
        }
        r
    }

    /// A connection from `source` (a loopback address other than 127.0.0.1, say: Linux
    /// routes all of 127.0.0.0/8 to the loopback device).
    pub fn open_from(url: &str, source: std::net::IpAddr) -> Raw {
        let addr: std::net::SocketAddr = url
            .trim_start_matches("pulsar://")
            .parse()
            .expect("an IP:PORT url");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .expect("a runtime");
        let s = rt
            .block_on(async {
                let sock = if source.is_ipv4() {
                    tokio::net::TcpSocket::new_v4()?
                } else {
                    tokio::net::TcpSocket::new_v6()?
                };
                sock.bind(std::net::SocketAddr::new(source, 0))?;
                sock.connect(addr).await?.into_std()
            })
            .expect("connect");
        s.set_nonblocking(false).expect("blocking");
        Raw {
            s,
            buf: BytesMut::new(),
        }
    }

    /// CONNECT from `source` ([`Raw::open_from`]); the broker's refusal if it refuses.
    pub fn connect_from(url: &str, source: std::net::IpAddr) -> Result<Raw, (ServerError, String)> {
        Raw::open_from(url, source).handshake(None)
    }

    /// CONNECT with a token (method `token`), or none; the broker's refusal if it refuses.
    pub fn connect_as(url: &str, token: Option<&str>) -> Result<Raw, (ServerError, String)> {
        Raw::open(url).handshake(token)
    }

    fn handshake(self, token: Option<&str>) -> Result<Raw, (ServerError, String)> {
        let mut r = self;
        r.send(&pb::BaseCommand {
            r#type: Type::Connect as i32,
            connect: Some(pb::CommandConnect {
                client_version: "raw-test".into(),
                protocol_version: Some(19),
                auth_method_name: token.map(|_| "token".to_string()),
                auth_data: token.map(|t| t.as_bytes().to_vec()),
                ..Default::default()
            }),
            ..Default::default()
        });
        match r.recv(Duration::from_secs(10)) {
            Got::Frame(f) if f.command.connected.is_some() => Ok(r),
            Got::Frame(f) if f.command.error.is_some() => Err(error_of(&f)),
            Got::Frame(f) => panic!("unexpected answer to CONNECT: {:?}", f.command),
            Got::Closed => Err((ServerError::UnknownError, "closed".into())),
            Got::Nothing => panic!("no answer to CONNECT"),
        }
    }

    pub fn send(&mut self, c: &pb::BaseCommand) {
        let mut b = BytesMut::new();
        encode_command(&mut b, c);
        self.s.write_all(&b).unwrap();
    }

    pub fn send_raw(&mut self, bytes: &[u8]) {
        let _ = self.s.write_all(bytes);
    }

    /// The next frame other than a PING.
    pub fn recv(&mut self, timeout: Duration) -> Got {
        self.recv_inner(timeout, true)
    }

    /// The next frame, PINGs included.
    pub fn recv_any(&mut self, timeout: Duration) -> Got {
        self.recv_inner(timeout, false)
    }

    fn recv_inner(&mut self, timeout: Duration, skip_pings: bool) -> Got {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(f) =
                decode_frame(&mut self.buf, 64 << 20).expect("valid frames from the broker")
            {
                if skip_pings && f.command.ping.is_some() {
                    continue;
                }
                return Got::Frame(Box::new(f));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Got::Nothing;
            }
            self.s.set_read_timeout(Some(left)).unwrap();
            let mut tmp = [0u8; 65536];
            match self.s.read(&mut tmp) {
                Ok(0) => return Got::Closed,
                Ok(n) => self.buf.extend_from_slice(&tmp[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return Got::Nothing
                }
                Err(_) => return Got::Closed,
            }
        }
    }

    pub fn expect(&mut self) -> Frame {
        match self.recv(Duration::from_secs(10)) {
            Got::Frame(f) => *f,
            Got::Closed => panic!("connection closed"),
            Got::Nothing => panic!("no reply"),
        }
    }

    /// Opens producer `producer_id` on `topic`, sends one message (sequence id 0) and returns
    /// its receipt's id.
    pub fn produce_one(
        &mut self,
        topic: &str,
        producer_id: u64,
        request_id: u64,
        payload: &[u8],
    ) -> pb::MessageIdData {
        self.send(&producer(topic, producer_id, request_id));
        let f = self.expect();
        assert!(f.command.producer_success.is_some(), "{:?}", f.command);
        self.send_raw(&send_frame(producer_id, 0, payload));
        self.expect()
            .command
            .send_receipt
            .and_then(|r| r.message_id)
            .expect("receipt")
    }

    /// Sends `make(request_id)` (a SUBSCRIBE or PRODUCER), again with the next request id
    /// 300 ms after each refusal, until the broker grants it; panics with the last refusal
    /// once `within` has passed. Returns the grant.
    pub fn until_served(
        &mut self,
        within: Duration,
        first_request: u64,
        make: impl Fn(u64) -> pb::BaseCommand,
    ) -> pb::BaseCommand {
        let deadline = Instant::now() + within;
        let mut request = first_request;
        loop {
            self.send(&make(request));
            let f = loop {
                let f = self.expect();
                let c = &f.command;
                if c.success.is_some() || c.producer_success.is_some() || c.error.is_some() {
                    break f;
                }
            };
            if f.command.error.is_none() {
                return f.command;
            }
            let (code, msg) = error_of(&f);
            assert!(
                Instant::now() < deadline,
                "not served within {within:?}: {code:?} {msg}"
            );
            std::thread::sleep(Duration::from_millis(300));
            request += 1;
        }
    }

    pub fn assert_closed(&mut self, why: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.recv(Duration::from_secs(1)) {
                Got::Closed => return,
                Got::Frame(_) => continue,
                Got::Nothing if Instant::now() < deadline => continue,
                Got::Nothing => panic!("{why}: the connection stayed open"),
            }
        }
    }
}

pub fn cmd(t: Type, f: impl FnOnce(&mut pb::BaseCommand)) -> pb::BaseCommand {
    let mut c = pb::BaseCommand {
        r#type: t as i32,
        ..Default::default()
    };
    f(&mut c);
    c
}

pub fn producer(topic: &str, producer_id: u64, request_id: u64) -> pb::BaseCommand {
    cmd(Type::Producer, |c| {
        c.producer = Some(pb::CommandProducer {
            topic: topic.into(),
            producer_id,
            request_id,
            ..Default::default()
        })
    })
}

pub fn subscribe(topic: &str, sub: &str, consumer_id: u64, request_id: u64) -> pb::BaseCommand {
    cmd(Type::Subscribe, |c| {
        c.subscribe = Some(pb::CommandSubscribe {
            topic: topic.into(),
            subscription: sub.into(),
            sub_type: pb::command_subscribe::SubType::Exclusive as i32,
            consumer_id,
            request_id,
            initial_position: Some(pb::command_subscribe::InitialPosition::Earliest as i32),
            ..Default::default()
        })
    })
}

/// FLOW: `permits` more messages for the consumer.
pub fn flow(consumer_id: u64, permits: u32) -> pb::BaseCommand {
    cmd(Type::Flow, |c| {
        c.flow = Some(pb::CommandFlow {
            consumer_id,
            message_permits: permits,
        })
    })
}

/// An individual ACK of one message id, answered with an ACK_RESPONSE (`request_id`).
pub fn ack(consumer_id: u64, request_id: u64, id: &pb::MessageIdData) -> pb::BaseCommand {
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
}

pub fn send_frame(producer_id: u64, sequence_id: u64, payload: &[u8]) -> Vec<u8> {
    let meta = pb::MessageMetadata {
        producer_name: "raw".into(),
        sequence_id,
        publish_time: 1,
        ..Default::default()
    }
    .encode_to_vec();
    let entry = Entry::build(&meta, payload);
    let c = cmd(Type::Send, |c| {
        c.send = Some(pb::CommandSend {
            producer_id,
            sequence_id,
            ..Default::default()
        })
    });
    let mut b = BytesMut::new();
    encode_message(&mut b, &c, entry.as_bytes());
    b.to_vec()
}

pub fn error_of(f: &Frame) -> (ServerError, String) {
    let e = f
        .command
        .error
        .as_ref()
        .unwrap_or_else(|| panic!("expected ERROR, got {:?}", f.command));
    (ServerError::try_from(e.error).unwrap(), e.message.clone())
}
