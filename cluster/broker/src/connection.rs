//! One client connection: decodes frames, answers commands, and writes frames back through a
//! writer task.
//!
//! ```text
//!  socket ─► read loop ─ decode_frame ─► handle(command) ─► Broker / Topic / Subscription
//!                │                              │
//!                │ SEND: append_queued ─► producer's receipt task (awaits durability in SEND order)
//!                ▼                              ▼
//!            keep-alive     frame queue (bounded in bytes) ─► writer task ─► socket
//! ```
//!
//! Any malformed, oversize or out-of-order frame closes this connection only, with the reason
//! logged. A producer's SEND queue is bounded: when it is full the read loop waits, which is
//! the backpressure a client sees.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures::future::BoxFuture;
use meridian_metadata::stall::{is_stall, StallBounded};
use meridian_protocol::pb::{self, base_command::Type, ServerError};
use meridian_protocol::{cmd, decode_frame, encode_command, Frame, ID_NONE, PROTOCOL_VERSION_MAX};
use meridian_storage::cursor::InitialPosition;
use meridian_storage::managed_ledger::Position;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use crate::broker::key_shared::{self, KeySharedSpec};
use crate::broker::producers::{AccessMode, Admission, ProducerSink};
use crate::broker::schema::version_bytes;
use crate::broker::subscription::{SeekTo, StartAt};
use crate::broker::{
    Broker, BrokerError, ConsumerSink, SubType, SubscribeRequest, Subscription, Topic,
};
use crate::closing::Closing;
use crate::frame_queue::{self, FrameReceiver, FrameSender};
use crate::publish::{Publisher, SendRequest};
use crate::warmup::{Target, Warmed, Warming};

/// How long before a token expires the broker asks for fresh credentials (AUTH_CHALLENGE).
const AUTH_REFRESH_AHEAD: Duration = Duration::from_secs(5);

/// The instant of `exp` (seconds since the epoch) on this process's monotonic clock.
fn instant_of_epoch_s(exp: u64) -> Instant {
    let now_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let left = (exp as f64 - now_s).max(0.0);
    Instant::now() + Duration::from_secs_f64(left.min(1e9))
}

/// How long a reader's subscription waits for the reader to come back after a SEEK.
const READER_RETURN_WAIT: Duration = Duration::from_secs(60);
const SERVER_VERSION: &str = concat!("Meridian-", env!("CARGO_PKG_VERSION"));

/// Why a connection is being closed (logged).
#[derive(Debug)]
struct Close(String);

pub(crate) fn frame(c: &pb::BaseCommand) -> Bytes {
    let mut b = BytesMut::new();
    encode_command(&mut b, c);
    b.freeze()
}

struct ProducerEntry {
    publisher: Publisher,
    schema_version: Option<u64>,
}

/// What PRODUCER_SUCCESS says about a new producer.
struct CreatedProducer {
    name: String,
    /// The version of the producer's schema, if it has one.
    schema_version: Option<u64>,
    /// On a deduplicating topic the highest sequence id persisted under the name, else -1.
    last_sequence_id: i64,
    /// The topic epoch granted to an exclusive producer.
    epoch: Option<u64>,
    /// WaitForExclusive in line: yields the epoch once the topic is granted.
    waiting: Option<tokio::sync::oneshot::Receiver<u64>>,
    /// Whether it may send now (PRODUCER_SUCCESS's `producer_ready`): false for a
    /// WaitForExclusive producer still in line, also when its create is retried.
    ready: bool,
}

struct ConsumerEntry {
    topic: Arc<Topic>,
    sub: Arc<Subscription>,
}

struct Conn {
    broker: Arc<Broker>,
    id: u64,
    peer: SocketAddr,
    tx: FrameSender,
    connected: bool,
    client_version: String,
    /// The authenticated role (with `broker.authentication_enabled`).
    role: Option<String>,
    /// The role of the client certificate (TLS with client certificates).
    tls_role: Option<String>,
    /// When the CONNECT (or last refreshed) token expires; AUTH_CHALLENGE goes out
    /// `AUTH_REFRESH_AHEAD` before, and the connection closes at it unless refreshed.
    token_expires: Option<Instant>,
    /// The token's `exp`, seconds since the epoch.
    token_exp_s: Option<u64>,
    /// An AUTH_CHALLENGE is out for the current token.
    challenged: bool,
    protocol_version: i32,
    producers: HashMap<u64, ProducerEntry>,
    /// Producers being closed after a CLOSE_PRODUCER, each in a task of its own
    /// ([`crate::closing`]).
    closing: Closing,
    consumers: HashMap<u64, ConsumerEntry>,
    /// PRODUCER and SUBSCRIBE commands out while their topic loads ([`crate::warmup`]).
    warming: Warming,
}

/// Serves one accepted connection until the client leaves, a frame is bad, or `stop`.
/// `tls_role` is the role of the client certificate of a TLS connection (mutual TLS).
pub async fn serve<R, W>(
    broker: Arc<Broker>,
    mut rd: R,
    wr: W,
    peer: SocketAddr,
    id: u64,
    tls_role: Option<String>,
    mut stop: watch::Receiver<bool>,
) where
    R: tokio::io::AsyncRead + Unpin + Send,
    W: tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (tx, rx) = frame_queue::channel(broker.cfg.connection_write_queue_bytes_max as usize);
    let keepalive = Duration::from_millis(broker.cfg.keepalive_interval_ms);
    // A socket that takes no byte for a keep-alive interval is given up, as a client that
    // sends none is.
    let mut writer = tokio::spawn(write_loop(wr, rx, Some(keepalive)));
    broker.connection_opened();
    let (warming, mut warmed) = Warming::new();
    let mut conn = Conn {
        broker: Arc::clone(&broker),
        id,
        peer,
        tx,
        connected: false,
        client_version: String::new(),
        role: None,
        tls_role,
        token_expires: None,
        token_exp_s: None,
        challenged: false,
        protocol_version: 0,
        producers: HashMap::new(),
        closing: Closing::default(),
        consumers: HashMap::new(),
        warming,
    };
    let max_frame = broker.cfg.frame_bytes_max();
    let mut buf = BytesMut::with_capacity(64 * 1024);
    let mut last_read = Instant::now();
    let mut ping_sent = false;
    // Dropped for sending nothing for a keep-alive interval.
    let mut silent = false;
    let writer_gone = conn.tx.closed();
    tokio::pin!(writer_gone);
    let mut tick = tokio::time::interval(keepalive / 2);
    tick.tick().await;
    let reason: String = 'conn: loop {
        tokio::select! {
            r = rd.read_buf(&mut buf) => {
                match r {
                    Ok(0) => break 'conn "closed by the client".into(),
                    Ok(_) => {}
                    Err(e) => break 'conn format!("read error: {e}"),
                }
                last_read = Instant::now();
                ping_sent = false;
                loop {
                    match decode_frame(&mut buf, max_frame) {
                        Ok(Some(f)) => {
                            if let Err(Close(why)) = conn.admit(f).await {
                                break 'conn why;
                            }
                        }
                        Ok(None) => break,
                        Err(e) => break 'conn e.to_string(),
                    }
                }
                if buf.capacity() - buf.len() < 4096 {
                    buf.reserve(64 * 1024);
                }
            }
            Some(w) = warmed.recv() => {
                if let Err(Close(why)) = conn.rejoin(w).await {
                    break 'conn why;
                }
            }
            _ = &mut writer_gone => {
                break 'conn format!(
                    "its writer ended (the socket failed, or took no bytes for {} ms)",
                    keepalive.as_millis()
                );
            }
            _ = tick.tick() => {
                let idle = last_read.elapsed();
                if idle >= keepalive && ping_sent {
                    silent = true;
                    break 'conn format!("no bytes from the client for {} ms", idle.as_millis());
                }
                if idle >= keepalive / 2 && !ping_sent && conn.connected {
                    // Whatever the queue holds: a client that stopped reading (frozen, or
                    // cut off) has filled it, and waiting for room here would stop this
                    // loop from ever dropping it.
                    ping_sent = conn.tx.send_now(frame(&cmd::ping())).is_ok();
                }
            }
            _ = tokio::time::sleep_until(conn.auth_timer_at()), if conn.token_expires.is_some() => {
                if let Err(Close(why)) = conn.on_auth_timer().await {
                    break 'conn why;
                }
            }
            _ = stop.changed() => break 'conn "the broker is shutting down".into(),
        }
    };
    tracing::debug!(connection = id, peer = %peer, reason = %reason, "connection closing");
    if !reason.starts_with("closed by") && !reason.starts_with("the broker") {
        tracing::warn!(connection = id, peer = %peer, client = %conn.client_version, reason = %reason, "closing the connection");
    }
    // A client silent for a keep-alive interval gets nothing more: what is queued for it
    // (the answers of the cleanup too, such as receipts of the sends it settles) is dropped
    // rather than waiting for the writer to give its socket up.
    if silent {
        writer.abort();
    }
    conn.cleanup().await;
    let warming = std::mem::replace(&mut conn.warming, Warming::new().0);
    drop(conn);
    drop(warmed);
    // The writer ends once every sender is gone (consumers' sinks were dropped above) and
    // what they queued is written; it is given 5 s for that.
    if tokio::time::timeout(Duration::from_secs(5), &mut writer)
        .await
        .is_err()
    {
        writer.abort();
    }
    // Loads this connection started finish before it counts as closed (as an inline load
    // did); what they bring back attaches nothing.
    warming.finish().await;
    broker.connection_closed();
}

/// Writes queued frames, coalescing whatever is queued (up to 1 MiB) into one write, until
/// every sender is gone or the socket fails, or (with `stall`) takes no byte for that long:
/// the peer stopped reading (a frozen process, whose kernel keeps the window shut, is never
/// given up by TCP). Ending drops the queue, so every sender waiting for room fails at once.
/// Shared with `meridian perf`'s client.
pub async fn write_loop<W: tokio::io::AsyncWrite + Unpin>(
    wr: W,
    mut rx: FrameReceiver,
    stall: Option<Duration>,
) {
    let mut wr = StallBounded::writes(wr, stall);
    let mut out = Vec::with_capacity(256 * 1024);
    while rx.recv_into(&mut out, 1 << 20).await {
        let written = match wr.write_all(&out).await {
            // A TLS stream may keep records it could not write yet: they go out now, not
            // with the next frame.
            Ok(()) => wr.flush().await,
            Err(e) => Err(e),
        };
        if let Err(e) = written {
            if is_stall(&e) {
                tracing::debug!(error = %e, "giving the connection up");
            }
            return;
        }
        out.clear();
    }
    let _ = wr.shutdown().await;
}

fn missing(what: &str) -> Close {
    Close(format!("{what} frame without its command body"))
}

impl Conn {
    async fn reply(&self, c: pb::BaseCommand) -> Result<(), Close> {
        self.send_frame(frame(&c)).await
    }

    async fn send_frame(&self, f: Bytes) -> Result<(), Close> {
        self.tx
            .send(f)
            .await
            .map_err(|_| Close("writer gone".into()))
    }

    /// Handles a frame, or sends a PRODUCER or SUBSCRIBE out to wait for its topic's load
    /// ([`crate::warmup`]) where it would wait on this loop. One the connection may not make
    /// (unauthorized, over its limit, a bad name, a cut site) is handled now, and refused.
    async fn admit(&mut self, f: Frame) -> Result<(), Close> {
        if let Some(target) = Target::of(&f).filter(|_| self.connected) {
            let attached = if target.producer {
                self.producers.contains_key(&target.id)
            } else {
                self.consumers.contains_key(&target.id)
            };
            if !attached && self.check_handles().is_ok() && self.warming.has_room() {
                if let Some((name, after)) = self.to_warm_up(&target).await {
                    self.warming
                        .start(Arc::clone(&self.broker), name, target, f, after);
                    return Ok(());
                }
            }
        }
        self.handle(f).await
    }

    /// The topic `t` waits for, and a close under way that a producer waits for first
    /// ([`Closing::before`]), when it would wait and the connection may attach to it.
    async fn to_warm_up(
        &self,
        t: &Target,
    ) -> Option<(crate::topic_name::TopicName, Option<BoxFuture<'static, ()>>)> {
        let name = self.broker.check_topic(&t.topic).ok()?;
        let after = if t.producer {
            self.closing.before(t.id, Some(&name.to_string()))
        } else {
            None
        };
        // Loaded, nothing closing (the common case): handled now, without authorizing twice.
        if after.is_none() && !Warming::needed(&self.broker, &name, t) {
            return None;
        }
        let action = if t.producer { "produce" } else { "consume" };
        self.broker
            .authorize(self.role.as_deref(), &name.namespace(), Some(action))
            .await
            .ok()?;
        self.broker.refuse_if_cut(&name).ok()?;
        Some((name, after))
    }

    /// A command back from its warm-up: handled now, unless its producer or consumer was
    /// closed meanwhile or the load failed (the error answers it).
    async fn rejoin(&mut self, w: Warmed) -> Result<(), Close> {
        let target = Target::of(&w.frame).expect("only PRODUCER and SUBSCRIBE go out");
        if !self.warming.returned(&w, &target) {
            let what = if target.producer {
                "producer"
            } else {
                "consumer"
            };
            return self
                .reply(cmd::error(
                    target.request_id,
                    ServerError::ServiceNotReady,
                    format!("the {what} was closed by the client while its topic loaded"),
                ))
                .await;
        }
        if let Some(e) = w.failed {
            return self
                .reply(cmd::error(target.request_id, e.code, e.message))
                .await;
        }
        // A close on its topic began while it was out: it waits for that too, out again.
        if target.producer && !self.producers.contains_key(&target.id) && self.warming.has_room() {
            if let Ok(name) = self.broker.check_topic(&target.topic) {
                if let Some(after) = self.closing.before(target.id, Some(&name.to_string())) {
                    self.warming.start(
                        Arc::clone(&self.broker),
                        name,
                        target,
                        w.frame,
                        Some(after),
                    );
                    return Ok(());
                }
            }
        }
        self.handle(w.frame).await
    }

    async fn handle(&mut self, f: Frame) -> Result<(), Close> {
        let c = f.command;
        let t = Type::try_from(c.r#type)
            .map_err(|_| Close(format!("unknown command type {}", c.r#type)))?;
        if !self.connected && t != Type::Connect {
            return Err(Close(format!("{t:?} before CONNECT")));
        }
        match t {
            Type::Connect => {
                let connect = c.connect.ok_or_else(|| missing("CONNECT"))?;
                if self.connected {
                    return Err(Close("a second CONNECT".into()));
                }
                if let Some(a) = &self.broker.auth {
                    // Tokens: CONNECT carries method "token" and the JWT. Client
                    // certificates: method "tls"; the role is the certificate's CN.
                    let checked = match connect.auth_method_name.as_deref() {
                        Some("token") => a
                            .authenticate_until(&String::from_utf8_lossy(
                                connect.auth_data.as_deref().unwrap_or_default(),
                            ))
                            .map(|(role, exp)| {
                                self.token_exp_s = exp;
                                self.token_expires = exp.map(instant_of_epoch_s);
                                role
                            })
                            .map_err(|e| e.to_string()),
                        Some("tls") => self.tls_role.clone().ok_or_else(|| {
                            "authentication failed: method \"tls\" without a verified client certificate with a CN".to_string()
                        }),
                        other => Err(format!(
                            "authentication failed: method {:?}; this broker takes \"token\" and, on its TLS port, \"tls\"",
                            other.unwrap_or("none")
                        )),
                    };
                    match checked {
                        Ok(role) => self.role = Some(role),
                        Err(why) => {
                            self.reply(cmd::error(
                                u64::MAX,
                                ServerError::AuthenticationError,
                                why.clone(),
                            ))
                            .await?;
                            return Err(Close(why));
                        }
                    }
                }
                self.connected = true;
                self.client_version = connect.client_version.clone();
                let version = connect
                    .protocol_version
                    .unwrap_or(0)
                    .clamp(0, PROTOCOL_VERSION_MAX);
                self.protocol_version = version;
                tracing::debug!(connection = self.id, peer = %self.peer, client = %connect.client_version, version, role = ?self.role, "connected");
                self.reply(cmd::connected(
                    SERVER_VERSION,
                    version,
                    self.broker.cfg.message_bytes_max as i32,
                ))
                .await
            }
            Type::Ping => self.reply(cmd::pong()).await,
            Type::Pong => Ok(()),
            Type::PartitionedMetadata => {
                let m = c
                    .partition_metadata
                    .ok_or_else(|| missing("PARTITIONED_METADATA"))?;
                let n = match self.readable_topic(&m.topic).await {
                    Ok(t) => self.broker.partitioned_metadata(&t).await,
                    Err(e) => Err(e),
                };
                let r = match n {
                    Ok(n) => cmd::partitioned_metadata(m.request_id, n),
                    Err(e) => cmd::partitioned_metadata_error(m.request_id, e.code, e.message),
                };
                self.reply(r).await
            }
            Type::Lookup => {
                let l = c.lookup_topic.ok_or_else(|| missing("LOOKUP"))?;
                let answer = match self.readable_topic(&l.topic).await {
                    Ok(t) => {
                        self.broker
                            .lookup(&t, l.authoritative.unwrap_or(false))
                            .await
                    }
                    Err(e) => Err(e),
                };
                let r = match answer {
                    Ok(crate::broker::ownership::Lookup::Connect) => cmd::lookup_connect(
                        l.request_id,
                        &self.broker.service_url,
                        self.broker.service_url_tls.get().map(String::as_str),
                    ),
                    Ok(crate::broker::ownership::Lookup::Redirect { to, authoritative }) => {
                        cmd::lookup_redirect(
                            l.request_id,
                            &to.service_url,
                            to.service_url_tls.as_deref(),
                            authoritative,
                        )
                    }
                    Err(e) => cmd::lookup_error(l.request_id, e.code, e.message),
                };
                self.reply(r).await
            }
            Type::Producer => {
                let p = c.producer.ok_or_else(|| missing("PRODUCER"))?;
                let request_id = p.request_id;
                match self.create_producer(p).await {
                    Ok(created) => {
                        let success = |epoch: Option<u64>, ready: bool| {
                            let mut r = cmd::producer_success(
                                request_id,
                                &created.name,
                                created.last_sequence_id,
                            );
                            if let Some(ps) = r.producer_success.as_mut() {
                                ps.topic_epoch = epoch;
                                ps.producer_ready = Some(ready);
                                ps.schema_version = created.schema_version.map(version_bytes);
                            }
                            r
                        };
                        self.reply(success(created.epoch, created.ready)).await?;
                        // WaitForExclusive: a second PRODUCER_SUCCESS, ready, once granted.
                        if let Some(granted) = created.waiting {
                            let tx = self.tx.clone();
                            let base = success(None, true);
                            tokio::spawn(async move {
                                if let Ok(epoch) = granted.await {
                                    let mut r = base;
                                    if let Some(ps) = r.producer_success.as_mut() {
                                        ps.topic_epoch = Some(epoch);
                                    }
                                    let _ = tx.send(frame(&r)).await;
                                }
                            });
                        }
                        Ok(())
                    }
                    Err(e) => self.reply(cmd::error(request_id, e.code, e.message)).await,
                }
            }
            Type::Send => {
                let s = c.send.ok_or_else(|| missing("SEND"))?;
                let payload = f
                    .payload
                    .ok_or_else(|| Close("SEND without a message".into()))?;
                self.send(s, payload).await
            }
            Type::CloseProducer => {
                let p = c.close_producer.ok_or_else(|| missing("CLOSE_PRODUCER"))?;
                self.warming.cancel(true, p.producer_id);
                let success = frame(&cmd::success(p.request_id));
                let Some(e) = self.producers.remove(&p.producer_id) else {
                    // Closed already, or being closed: answered after that close's SUCCESS.
                    return match self.closing.defer(p.producer_id, success) {
                        Ok(()) => Ok(()),
                        Err(now) => self.send_frame(now).await,
                    };
                };
                if !self.closing.has_room() {
                    // As many closes run apart as may: this one runs here.
                    close_producer(e).await;
                    return self.send_frame(success).await;
                }
                // Its sends are settled (stored and answered) before SUCCESS, off this loop:
                // one waiting for writable bookies would hold every producer and consumer of
                // the connection for up to `broker.ledger_create_wait_ms`.
                let topic = e.publisher.topic.full_name().to_string();
                let tx = self.tx.clone();
                self.closing
                    .start(p.producer_id, topic, close_producer(e), success, tx);
                Ok(())
            }
            Type::Subscribe => {
                let s = c.subscribe.ok_or_else(|| missing("SUBSCRIBE"))?;
                let request_id = s.request_id;
                let r = match self.subscribe(s).await {
                    Ok(()) => cmd::success(request_id),
                    Err(e) => cmd::error(request_id, e.code, e.message),
                };
                self.reply(r).await
            }
            Type::Flow => {
                let fl = c.flow.ok_or_else(|| missing("FLOW"))?;
                if let Some(e) = self.consumers.get(&fl.consumer_id) {
                    e.sub
                        .flow(self.id, fl.consumer_id, fl.message_permits)
                        .await;
                }
                Ok(())
            }
            Type::Ack => {
                let a = c.ack.ok_or_else(|| missing("ACK"))?;
                let cumulative = a.ack_type == pb::command_ack::AckType::Cumulative as i32;
                let result = match self.consumers.get(&a.consumer_id) {
                    Some(e) => e.sub.ack(cumulative, &a.message_id).await,
                    None => Err(BrokerError::new(
                        ServerError::ConsumerNotFound,
                        format!("no consumer {}", a.consumer_id),
                    )),
                };
                if let Err(e) = &result {
                    tracing::warn!(connection = self.id, consumer = a.consumer_id, error = %e, "ack failed");
                }
                if let Some(request_id) = a.request_id {
                    let mut r = cmd::ack_response(a.consumer_id, request_id);
                    if let (Err(e), Some(ar)) = (result, r.ack_response.as_mut()) {
                        ar.error = Some(e.code as i32);
                        ar.message = Some(e.message);
                    }
                    self.reply(r).await?;
                }
                Ok(())
            }
            Type::RedeliverUnacknowledgedMessages => {
                let r = c
                    .redeliver_unacknowledged_messages
                    .ok_or_else(|| missing("REDELIVER_UNACKNOWLEDGED_MESSAGES"))?;
                if let Some(e) = self.consumers.get(&r.consumer_id) {
                    e.sub
                        .redeliver(self.id, r.consumer_id, &r.message_ids)
                        .await;
                }
                Ok(())
            }
            Type::CloseConsumer => {
                let cc = c.close_consumer.ok_or_else(|| missing("CLOSE_CONSUMER"))?;
                self.warming.cancel(false, cc.consumer_id);
                self.remove_consumer(cc.consumer_id).await;
                self.reply(cmd::success(cc.request_id)).await
            }
            Type::Unsubscribe => {
                let u = c.unsubscribe.ok_or_else(|| missing("UNSUBSCRIBE"))?;
                let r = match self.consumers.get(&u.consumer_id) {
                    None => cmd::error(
                        u.request_id,
                        ServerError::ConsumerNotFound,
                        format!("no consumer {}", u.consumer_id),
                    ),
                    Some(e) => match e.sub.unsubscribe(self.id, u.consumer_id).await {
                        Ok(()) => {
                            self.consumers.remove(&u.consumer_id);
                            cmd::success(u.request_id)
                        }
                        Err(e) => cmd::error(u.request_id, e.code, e.message),
                    },
                };
                self.reply(r).await
            }
            Type::Seek => {
                let s = c.seek.ok_or_else(|| missing("SEEK"))?;
                self.seek(s).await
            }
            Type::GetLastMessageId => {
                let g = c
                    .get_last_message_id
                    .ok_or_else(|| missing("GET_LAST_MESSAGE_ID"))?;
                let Some(e) = self.consumers.get(&g.consumer_id) else {
                    return self
                        .reply(cmd::error(
                            g.request_id,
                            ServerError::ConsumerNotFound,
                            format!("no consumer {}", g.consumer_id),
                        ))
                        .await;
                };
                let last = match e.sub.last_message_id().await {
                    Some((p, batch_index)) => pb::MessageIdData {
                        batch_index: Some(batch_index),
                        ..cmd::message_id(p.ledger_id, p.entry_id)
                    },
                    None => cmd::message_id(ID_NONE, ID_NONE),
                };
                let md = e
                    .sub
                    .mark_delete()
                    .await
                    .map(|p| cmd::message_id(p.ledger_id, p.entry_id));
                self.reply(cmd::last_message_id(g.request_id, last, md))
                    .await
            }
            Type::GetTopicsOfNamespace => {
                let g = c
                    .get_topics_of_namespace
                    .ok_or_else(|| missing("GET_TOPICS_OF_NAMESPACE"))?;
                let listed = match self
                    .broker
                    .authorize(self.role.as_deref(), &g.namespace, None)
                    .await
                {
                    Ok(()) => self.broker.topics_of_namespace(&g.namespace).await,
                    Err(e) => Err(e),
                };
                let r = match listed {
                    Ok(t) => cmd::topics_of_namespace(g.request_id, t),
                    Err(e) => cmd::error(g.request_id, e.code, e.message),
                };
                self.reply(r).await
            }
            Type::GetSchema => {
                let g = c.get_schema.ok_or_else(|| missing("GET_SCHEMA"))?;
                // Any grant on the namespace (produce or consume) may read its schemas.
                let found = match self.readable_topic(&g.topic).await {
                    Ok(t) => {
                        self.broker
                            .get_schema(&t, g.schema_version.as_deref())
                            .await
                    }
                    Err(e) => Err(e),
                };
                let r = match found {
                    Ok(Some((v, schema))) => {
                        cmd::get_schema(g.request_id, schema.to_wire(), version_bytes(v))
                    }
                    // "No schema" is TopicNotFound to the clients (C++ reads it so).
                    Ok(None) => cmd::get_schema_error(
                        g.request_id,
                        ServerError::TopicNotFound,
                        format!("{} has no schema", g.topic),
                    ),
                    Err(e) => cmd::get_schema_error(g.request_id, e.code, e.message),
                };
                self.reply(r).await
            }
            Type::GetOrCreateSchema => {
                let g = c
                    .get_or_create_schema
                    .ok_or_else(|| missing("GET_OR_CREATE_SCHEMA"))?;
                let added = match self.broker.check_topic(&g.topic) {
                    Ok(t) => self.get_or_create_schema(&t, &g.schema).await,
                    Err(e) => Err(e),
                };
                let r = match added {
                    Ok(v) => cmd::get_or_create_schema(g.request_id, version_bytes(v.unwrap_or(0))),
                    Err(e) => cmd::get_or_create_schema_error(g.request_id, e.code, e.message),
                };
                self.reply(r).await
            }
            Type::ConsumerStats => {
                let s = c.consumer_stats.ok_or_else(|| missing("CONSUMER_STATS"))?;
                let r = self.consumer_stats(s.request_id, s.consumer_id).await;
                self.reply(r).await
            }
            Type::AuthResponse => {
                let r = c.auth_response.ok_or_else(|| missing("AUTH_RESPONSE"))?;
                self.on_auth_response(r)
            }
            Type::NewTxn
            | Type::AddPartitionToTxn
            | Type::AddSubscriptionToTxn
            | Type::EndTxn
            | Type::EndTxnOnPartition
            | Type::EndTxnOnSubscription
            | Type::TcClientConnectRequest => {
                let r = [
                    c.new_txn,
                    c.add_partition_to_txn,
                    c.add_subscription_to_txn,
                    c.end_txn,
                    c.end_txn_on_partition,
                    c.end_txn_on_subscription,
                    c.tc_client_connect_request,
                ]
                .into_iter()
                .flatten()
                .next()
                .ok_or_else(|| missing("transaction"))?;
                self.reply(cmd::error(
                    r.request_id,
                    ServerError::NotAllowedError,
                    "transactions are not supported",
                ))
                .await
            }
            other => Err(Close(format!("unexpected command {other:?} from a client"))),
        }
    }

    /// CONSUMER_STATS: the consumer's figures and its subscription's.
    async fn consumer_stats(&self, request_id: u64, consumer_id: u64) -> pb::BaseCommand {
        let Some(e) = self.consumers.get(&consumer_id) else {
            return cmd::consumer_stats_error(
                request_id,
                ServerError::ConsumerNotFound,
                format!("no consumer {consumer_id} on this connection"),
            );
        };
        let Some((name, permits, unacked, blocked)) =
            e.sub.consumer_figures(self.id, consumer_id).await
        else {
            return cmd::consumer_stats_error(
                request_id,
                ServerError::ConsumerNotFound,
                format!("consumer {consumer_id} has left its subscription"),
            );
        };
        // The topic's stats carry each subscription's figures and its sampled rate.
        let topic = e.topic.stats().await;
        let Some(sub) = topic.subscriptions.iter().find(|s| s.name == e.sub.name()) else {
            return cmd::consumer_stats_error(
                request_id,
                ServerError::SubscriptionNotFound,
                format!("subscription {} has ended", e.sub.name()),
            );
        };
        let mut c = cmd::consumer_stats(request_id);
        if let Some(r) = c.consumer_stats_response.as_mut() {
            r.msg_rate_out = Some(sub.msg_rate_out);
            r.consumer_name = Some(name);
            r.available_permits = Some(permits.max(0) as u64);
            r.unacked_messages = Some(unacked);
            r.blocked_consumer_on_unacked_msgs = Some(blocked);
            r.address = Some(self.peer.to_string());
            r.r#type = Some(sub.sub_type.clone());
            r.msg_backlog = Some(sub.backlog_entries);
        }
        c
    }

    fn handles(&self) -> usize {
        self.producers.len() + self.consumers.len() + self.warming.len()
    }

    fn check_handles(&self) -> Result<(), BrokerError> {
        if self.handles() as u64 >= self.broker.cfg.connection_handles_max {
            return Err(BrokerError::new(
                ServerError::TooManyRequests,
                format!(
                    "this connection already has {} producers and consumers (broker.connection_handles_max)",
                    self.handles()
                ),
            ));
        }
        Ok(())
    }

    /// When the token timer fires next: the challenge ahead of expiry, then the expiry.
    fn auth_timer_at(&self) -> tokio::time::Instant {
        let exp = self.token_expires.unwrap_or_else(Instant::now);
        let at = if self.challenged {
            exp
        } else {
            exp.checked_sub(AUTH_REFRESH_AHEAD).unwrap_or(exp)
        };
        at.into()
    }

    /// Ahead of expiry: AUTH_CHALLENGE (the stock clients answer with fresh credentials). At
    /// expiry without a refresh: the connection closes.
    async fn on_auth_timer(&mut self) -> Result<(), Close> {
        if !self.challenged {
            self.challenged = true;
            return self
                .reply(cmd::auth_challenge(
                    SERVER_VERSION,
                    self.protocol_version,
                    "token",
                ))
                .await;
        }
        let why = "the token expired and was not refreshed (AUTH_CHALLENGE unanswered or answered with the same token)".to_string();
        let _ = self
            .reply(cmd::error(
                u64::MAX,
                ServerError::AuthenticationError,
                why.clone(),
            ))
            .await;
        Err(Close(why))
    }

    /// AUTH_RESPONSE: the refreshed token must verify and carry the same role, else the
    /// connection closes.
    fn on_auth_response(&mut self, r: pb::CommandAuthResponse) -> Result<(), Close> {
        let Some(a) = &self.broker.auth else {
            return Ok(());
        };
        if self.token_expires.is_none() && !self.challenged {
            // Nothing was asked (a certificate's session, or a token that never expires).
            return Ok(());
        }
        let data = r.response.unwrap_or_default();
        if data.auth_method_name.as_deref() != Some("token") {
            return Err(Close(format!(
                "AUTH_RESPONSE with method {:?}; this connection authenticated with \"token\"",
                data.auth_method_name.unwrap_or_default()
            )));
        }
        let token = String::from_utf8_lossy(data.auth_data.as_deref().unwrap_or_default());
        match a.authenticate_until(&token) {
            Ok((role, exp)) if Some(&role) == self.role.as_ref() => {
                if exp != self.token_exp_s {
                    // A new expiry: challenged afresh ahead of it (never, without one).
                    self.challenged = false;
                    self.token_exp_s = exp;
                    self.token_expires = exp.map(instant_of_epoch_s);
                }
                tracing::debug!(connection = self.id, role = %role, "credentials refreshed");
                Ok(())
            }
            Ok((role, _)) => Err(Close(format!(
                "refreshed credentials name role {role:?}, not {:?}",
                self.role.as_deref().unwrap_or_default()
            ))),
            Err(e) => Err(Close(format!("refreshed credentials do not verify: {e}"))),
        }
    }

    /// GET_OR_CREATE_SCHEMA: registers a schema as a producer would, so only a role that may
    /// produce there, and only in a namespace that exists (the registry's keys would stay
    /// behind otherwise).
    async fn get_or_create_schema(
        &self,
        t: &crate::topic_name::TopicName,
        schema: &pb::Schema,
    ) -> Result<Option<u64>, BrokerError> {
        self.broker
            .authorize(self.role.as_deref(), &t.namespace(), Some("produce"))
            .await?;
        self.broker.require_namespace(&t.namespace()).await?;
        self.broker.schema_for_producer(t, Some(schema)).await
    }

    /// Creates a producer in its access mode.
    async fn create_producer(
        &mut self,
        p: pb::CommandProducer,
    ) -> Result<CreatedProducer, BrokerError> {
        let name = self
            .broker
            .check_topic(&p.topic)
            .ok()
            .map(|t| t.to_string());
        // A retried create of a producer attached here is answered as it is (a fenced one is
        // made again, and waits like a new one).
        let retried = self
            .producers
            .get(&p.producer_id)
            .is_some_and(|e| !e.publisher.handle.is_fenced());
        let waits = if retried {
            None
        } else {
            self.closing.before(p.producer_id, name.as_deref())
        };
        if let Some(closed) = waits {
            // A close under way of this id, or on this topic, comes first. Such a PRODUCER
            // waits for it off this loop ([`Conn::admit`], [`Conn::rejoin`]); here only when
            // the connection has no room for that, or did not send it out (not authorized).
            closed.await;
        }
        if let Some(existing) = self.producers.get(&p.producer_id) {
            if existing.publisher.handle.is_fenced() {
                // Fenced meanwhile: the client re-creates it; it is judged afresh (and is
                // refused if it comes back with its old epoch).
                if let Some(e) = self.producers.remove(&p.producer_id) {
                    close_producer(e).await;
                }
            } else if existing.publisher.topic.full_name()
                == self.broker.check_topic(&p.topic)?.to_string()
            {
                // A retried create of a producer that already exists on this connection.
                let last = match &existing.publisher.topic.dedup {
                    Some(d) => d.last_sequence_id(&existing.publisher.handle.name).await,
                    None => -1,
                };
                let exclusive = existing.publisher.handle.mode.is_exclusive();
                let schema_version = existing.schema_version;
                return Ok(CreatedProducer {
                    schema_version,
                    name: existing.publisher.handle.name.clone(),
                    last_sequence_id: last,
                    epoch: exclusive.then(|| existing.publisher.topic.producers.epoch()),
                    waiting: None,
                    // Its second PRODUCER_SUCCESS, ready, comes once granted (to the first
                    // create's request id).
                    ready: existing.publisher.handle.is_granted(),
                });
            } else {
                return Err(BrokerError::new(
                    ServerError::ProducerBusy,
                    format!("producer id {} is in use on this connection", p.producer_id),
                ));
            }
        }
        self.check_handles()?;
        let mode = AccessMode::from_wire(p.producer_access_mode.unwrap_or(0)).ok_or_else(|| {
            BrokerError::new(
                ServerError::NotAllowedError,
                format!("unknown producer access mode {:?}", p.producer_access_mode),
            )
        })?;
        let name = self.broker.check_topic(&p.topic)?;
        self.broker
            .authorize(self.role.as_deref(), &name.namespace(), Some("produce"))
            .await?;
        self.broker.refuse_if_cut(&name)?;
        let topic = self.broker.topic(&name, true).await?;
        attach_pause().await;
        if let Some(sub) = p
            .initial_subscription_name
            .as_deref()
            .filter(|n| !n.is_empty())
        {
            // As Pulsar: the subscription exists from the producer's first message on (at
            // the start of the log if it is new), so nothing sent before a consumer comes is
            // missed. It takes the right to consume as well.
            self.broker
                .authorize(self.role.as_deref(), &name.namespace(), Some("consume"))
                .await?;
            topic.create_subscription(sub).await?;
        }
        if topic.ml.is_terminated().await {
            return Err(BrokerError::new(
                ServerError::TopicTerminatedError,
                format!("{name} is terminated: it takes no more messages"),
            ));
        }
        if let Some(b) = topic.quota_breach() {
            return Err(b.error());
        }
        // Not for a topic being deleted (or unloaded) meanwhile: its schema record would
        // outlive the deletion.
        topic.refuse_if_detached()?;
        let schema_version = self
            .broker
            .schema_for_producer(&name, p.schema.as_ref())
            .await?;
        let broker = Arc::clone(&self.broker);
        let sink = ProducerSink {
            producer_id: p.producer_id,
        };
        let admission = topic
            .add_producer(
                p.producer_name.as_deref().filter(|n| !n.is_empty()),
                || broker.generate_producer_name(),
                mode,
                p.topic_epoch,
                sink,
            )
            .await?;
        let (handle, epoch, waiting) = match admission {
            Admission::Ready { handle, epoch } => (handle, epoch, None),
            Admission::Waiting { handle, ready } => (handle, None, Some(ready)),
        };
        let last_sequence_id = match &topic.dedup {
            Some(d) => d.last_sequence_id(&handle.name).await,
            None => -1,
        };
        tracing::debug!(connection = self.id, topic = %topic.full_name(), producer = %handle.name, ?mode, "producer created");
        let name = handle.name.clone();
        let publisher = Publisher::start(
            p.producer_id,
            topic,
            handle,
            self.broker.cfg.message_bytes_max,
            self.broker.cfg.producer_pending_sends_max as usize,
            self.tx.clone(),
        );
        self.producers.insert(
            p.producer_id,
            ProducerEntry {
                publisher,
                schema_version,
            },
        );
        Ok(CreatedProducer {
            schema_version,
            name,
            last_sequence_id,
            epoch,
            ready: waiting.is_none(),
            waiting,
        })
    }

    async fn send(
        &mut self,
        s: pb::CommandSend,
        payload: meridian_protocol::Payload,
    ) -> Result<(), Close> {
        let Some(p) = self.producers.get(&s.producer_id) else {
            let refused = frame(&cmd::send_error(
                s.producer_id,
                s.sequence_id,
                ServerError::NotAllowedError,
                "no such producer on this connection",
            ));
            // A producer being closed: refused after its close's SUCCESS (and so after the
            // receipts of its earlier sends).
            return match self.closing.defer(s.producer_id, refused) {
                Ok(()) => Ok(()),
                Err(now) => self.send_frame(now).await,
            };
        };
        if p.publisher
            .send(SendRequest::new(s, payload))
            .await
            .is_err()
        {
            // The receipt task stops only when the writer is gone: the client has closed.
            return Err(Close(
                "closed by the client (receipts could not be written)".into(),
            ));
        }
        Ok(())
    }

    /// A topic name the connection's role may read about (any grant on its namespace):
    /// lookups, partition counts, schemas.
    async fn readable_topic(
        &self,
        name: &str,
    ) -> Result<crate::topic_name::TopicName, BrokerError> {
        let t = self.broker.check_topic(name)?;
        self.broker
            .authorize(self.role.as_deref(), &t.namespace(), None)
            .await?;
        Ok(t)
    }

    async fn subscribe(&mut self, s: pb::CommandSubscribe) -> Result<(), BrokerError> {
        let name = self.broker.check_topic(&s.topic)?;
        self.broker
            .authorize(self.role.as_deref(), &name.namespace(), Some("consume"))
            .await?;
        self.broker.refuse_if_cut(&name)?;
        if s.subscription.is_empty() {
            return Err(BrokerError::new(
                ServerError::NotAllowedError,
                "empty subscription name",
            ));
        }
        let sub_type = SubType::from_wire(s.sub_type).ok_or_else(|| {
            BrokerError::new(
                ServerError::NotAllowedError,
                format!("unknown subscription type {}", s.sub_type),
            )
        })?;
        if let Some(existing) = self.consumers.get(&s.consumer_id) {
            if existing.topic.full_name() == name.to_string()
                && existing.sub.name() == s.subscription
                && !existing.sub.is_closed()
                && existing
                    .sub
                    .consumer_figures(self.id, s.consumer_id)
                    .await
                    .is_some()
            {
                // A retried SUBSCRIBE of a consumer that is still attached.
                return Ok(());
            }
            // Closed by the broker (seek) or gone: attach it afresh.
            self.remove_consumer(s.consumer_id).await;
        }
        self.check_handles()?;
        let durable = s.durable.unwrap_or(true);
        let initial = if s.initial_position
            == Some(pb::command_subscribe::InitialPosition::Earliest as i32)
        {
            InitialPosition::Earliest
        } else {
            InitialPosition::Latest
        };
        let rollback_s = s.start_message_rollback_duration_sec.unwrap_or(0);
        let start = match (&s.start_message_id, durable) {
            // A reader "from N seconds ago" (Pulsar's startMessageFromRollbackDuration).
            (_, false) if rollback_s > 0 => {
                let now_ms = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64);
                StartAt::PublishTime(now_ms.saturating_sub(rollback_s.saturating_mul(1000)))
            }
            (Some(id), false) => start_of(id),
            _ => StartAt::Initial(initial),
        };
        let consumer_name = s
            .consumer_name
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| format!("consumer-{}-{}", self.id, s.consumer_id));
        let topic = self
            .broker
            .topic(&name, s.force_topic_creation.unwrap_or(true))
            .await?;
        attach_pause().await;
        self.broker
            .schema_for_consumer(&name, s.schema.as_ref())
            .await?;
        let key_shared = match (&s.key_shared_meta, sub_type) {
            (Some(m), SubType::KeyShared) => Some(key_shared_spec(m)?),
            _ => None,
        };
        let req = SubscribeRequest {
            subscription: s.subscription.clone(),
            sub_type,
            consumer_name,
            priority: s.priority_level.unwrap_or(0),
            durable,
            start,
            key_shared,
            properties: s
                .subscription_properties
                .iter()
                .map(|kv| (kv.key.clone(), kv.value.clone()))
                .collect(),
            read_compacted: s.read_compacted.unwrap_or(false),
            replicated: durable && s.replicate_subscription_state.unwrap_or(false),
        };
        let sink = ConsumerSink {
            connection_id: self.id,
            consumer_id: s.consumer_id,
            tx: self.tx.clone(),
            end_of_topic: !self.client_version.starts_with("Pulsar-CPP"),
        };
        let sub = topic.subscribe(req, sink).await?;
        tracing::debug!(connection = self.id, topic = %topic.full_name(), subscription = %s.subscription, "consumer subscribed");
        self.consumers
            .insert(s.consumer_id, ConsumerEntry { topic, sub });
        Ok(())
    }

    async fn seek(&mut self, s: pb::CommandSeek) -> Result<(), Close> {
        let Some(e) = self.consumers.get(&s.consumer_id) else {
            return self
                .reply(cmd::error(
                    s.request_id,
                    ServerError::ConsumerNotFound,
                    format!("no consumer {}", s.consumer_id),
                ))
                .await;
        };
        let to = match (&s.message_id, s.message_publish_time) {
            (Some(id), _) => match start_of(id) {
                StartAt::Initial(i) => SeekTo::Initial(i),
                StartAt::At(p) => SeekTo::Position(p),
                StartAt::PublishTime(t) => SeekTo::PublishTime(t),
            },
            (None, Some(t)) => SeekTo::PublishTime(t),
            (None, None) => {
                return self
                    .reply(cmd::error(
                        s.request_id,
                        ServerError::NotAllowedError,
                        "SEEK needs a message id or a publish time",
                    ))
                    .await
            }
        };
        let sub = Arc::clone(&e.sub);
        let topic = Arc::clone(&e.topic);
        match sub.seek(to).await {
            Ok(sinks) => {
                // As Pulsar does: the subscription's consumers are closed (they re-subscribe
                // and read from the new position), and then the SEEK is answered. The order
                // matters to the C++ client: a CLOSE_CONSUMER that arrives while its seek is
                // in progress makes it re-subscribe from the seek target; one that arrives
                // after the answer, from where it had read (a reader then drops everything
                // before that).
                for sink in sinks {
                    // Queued whatever the queue holds (a control frame): another client's
                    // consumer that stopped reading must not hold up this loop.
                    let _ = sink
                        .tx
                        .send_now(frame(&cmd::close_consumer(sink.consumer_id, 0)));
                    if sink.connection_id == self.id {
                        self.consumers.remove(&sink.consumer_id);
                    }
                }
                self.reply(cmd::success(s.request_id)).await?;
                if !sub.is_durable() {
                    // A reader's subscription is kept, reset, for the reader to come back to
                    // (its client re-subscribes from where it had read, not from the seek
                    // target); if it has not come back within a minute it goes.
                    tokio::spawn(async move {
                        tokio::time::sleep(READER_RETURN_WAIT).await;
                        if sub.consumer_count().await == 0 {
                            sub.close().await;
                            topic.drop_subscription(sub.name(), &sub).await;
                        }
                    });
                }
                Ok(())
            }
            Err(e) => {
                self.reply(cmd::error(s.request_id, e.code, e.message))
                    .await
            }
        }
    }

    async fn remove_consumer(&mut self, consumer_id: u64) {
        if let Some(e) = self.consumers.remove(&consumer_id) {
            let left = e.sub.remove_consumer(self.id, consumer_id).await;
            if left == 0 && !e.sub.is_durable() {
                e.sub.close().await;
                e.topic.drop_subscription(e.sub.name(), &e.sub).await;
            }
        }
    }

    /// The connection is ending: producers finish their in-flight sends (receipts are written
    /// if the socket still takes them), consumers' unacknowledged entries go to the others.
    async fn cleanup(&mut self) {
        for (_, p) in self.producers.drain() {
            close_producer(p).await;
        }
        self.closing.finish().await;
        let ids: Vec<u64> = self.consumers.keys().copied().collect();
        for id in ids {
            self.remove_consumer(id).await;
        }
    }
}

/// Closes a producer: its queued sends are settled first (see `Publisher::close`), so none
/// is appended after the topic counts it gone (an exclusive producer could be attached by
/// then).
async fn close_producer(p: ProducerEntry) {
    let (topic, handle) = (
        Arc::clone(&p.publisher.topic),
        Arc::clone(&p.publisher.handle),
    );
    p.publisher.close().await;
    topic.remove_producer(&handle);
}

/// A Key_Shared consumer's request: mode (0 auto-split, 1 sticky), ranges within 0..=65535.
fn key_shared_spec(m: &pb::KeySharedMeta) -> Result<KeySharedSpec, BrokerError> {
    let bad = |msg: String| BrokerError::new(ServerError::ConsumerAssignError, msg);
    let sticky = match m.key_shared_mode {
        0 => false,
        1 => true,
        other => return Err(bad(format!("unknown Key_Shared mode {other}"))),
    };
    let max = (key_shared::HASH_RANGE - 1) as i32;
    let ranges = m
        .hash_ranges
        .iter()
        .map(|r| {
            if (0..=max).contains(&r.start) && (0..=max).contains(&r.end) {
                Ok((r.start as u16, r.end as u16))
            } else {
                Err(bad(format!(
                    "hash range [{}, {}] is outside 0..={max}",
                    r.start, r.end
                )))
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(KeySharedSpec {
        sticky,
        ranges,
        allow_out_of_order: m.allow_out_of_order_delivery.unwrap_or(false),
    })
}

/// Where a message id from a client says to start.
fn start_of(id: &pb::MessageIdData) -> StartAt {
    const LATEST: u64 = i64::MAX as u64;
    if id.ledger_id == ID_NONE {
        return StartAt::Initial(InitialPosition::Earliest);
    }
    if id.ledger_id == LATEST && id.entry_id == LATEST {
        return StartAt::Initial(InitialPosition::Latest);
    }
    // At the entry, batched or not, as Pulsar's broker: the client drops what it has already
    // (the entry itself unless the reader is inclusive, a batch's messages before the index).
    // Starting after it lost the first message of an inclusive reader.
    StartAt::At(Position::new(id.ledger_id, id.entry_id))
}

/// Fail point `attach:pause_2s`: a producer or consumer waits 2 s between finding its topic
/// and attaching to it, the window in which an unload may come (a test makes it come then).
async fn attach_pause() {
    if crate::failpoint::hit("attach:pause_2s") {
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;

    use super::*;

    #[tokio::test]
    async fn a_writer_whose_peer_takes_no_bytes_gives_it_up_and_its_waiting_senders_fail() {
        // The peer keeps its end open and never reads.
        let (ours, _theirs) = tokio::io::duplex(1024);
        let (tx, rx) = frame_queue::channel(4096);
        let started = tokio::time::Instant::now();
        let writer = tokio::spawn(write_loop(ours, rx, Some(Duration::from_millis(500))));
        // Fill the pipe and the queue, until a send waits for room.
        while matches!(
            tokio::time::timeout(
                Duration::from_millis(50),
                tx.send(Bytes::from(vec![1u8; 1024])),
            )
            .await,
            Ok(Ok(()))
        ) {}
        let waiting = tokio::time::timeout(Duration::from_secs(5), tx.send(Bytes::from("x")))
            .await
            .expect("a waiting send fails once the writer gives up");
        assert!(waiting.is_err());
        assert!(tx.is_closed());
        writer.await.unwrap();
        assert!(started.elapsed() >= Duration::from_millis(500));
    }

    #[tokio::test]
    async fn a_writer_whose_peer_reads_slowly_goes_on_past_the_stall_bound() {
        let (ours, mut theirs) = tokio::io::duplex(1024);
        let (tx, rx) = frame_queue::channel(1 << 20);
        let writer = tokio::spawn(write_loop(ours, rx, Some(Duration::from_millis(500))));
        // 24 KiB at 1 KiB every 50 ms: 1.2 s in all, each write taken well within 500 ms.
        tx.send(Bytes::from(vec![2u8; 24 * 1024])).await.unwrap();
        drop(tx);
        let mut got = 0;
        let mut buf = [0u8; 1024];
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            match theirs.read(&mut buf).await.unwrap() {
                0 => break,
                n => got += n,
            }
        }
        assert_eq!(got, 24 * 1024);
        writer.await.unwrap();
    }
}
