//! `meridian perf produce|consume|e2e`: load over the Pulsar protocol, in the spirit of
//! `pulsar-perf` and the OpenMessaging benchmark. It speaks the protocol through our codec with
//! a small client of its own (direct connection, no lookup), so it drives Meridian and any
//! other Pulsar-protocol broker (pulsar-lite) alike, with many sends in flight.
//!
//! Publish latency is measured from the moment a message is handed to the producer (at a fixed
//! rate, when its slot in the schedule comes) to its receipt, as pulsar-perf does; with batching
//! it includes the wait for the batch. End-to-end latency reads that same send time, stamped in
//! the first 8 bytes of each payload, when the consumer receives the message.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use bytes::{BufMut, Bytes, BytesMut};
use hdrhistogram::Histogram;
use meridian_broker::frame_queue::FrameSender;
use meridian_protocol::batch::BatchIter;
use meridian_protocol::pb::{self, base_command::Type};
use meridian_protocol::{decode_frame, encode_command, encode_message, Entry};
use prost::Message as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::disk_probe::percentiles;
use crate::stage_metrics::Snapshot;

#[derive(clap::Args, Clone, Debug)]
pub struct CommonArgs {
    /// Broker service URL.
    #[arg(long, default_value = "pulsar://127.0.0.1:6650")]
    url: String,
    /// Topic, or prefix of the topics when --topics > 1 (`TOPIC-0`, `TOPIC-1`, ...).
    #[arg(long, default_value = "perf")]
    topic: String,
    /// Number of topics.
    #[arg(long, default_value_t = 1)]
    topics: usize,
    /// Seconds to run (0: until --messages are done).
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Print a line every this many seconds.
    #[arg(long, default_value_t = 5)]
    report_every: u64,
    /// Leave the first this many seconds out of the summary's latency percentiles (a warm-up
    /// phase, as in the OpenMessaging benchmark: topic creation, first ledger, connections).
    /// The per-interval lines still show them.
    #[arg(long, default_value_t = 0)]
    warmup_seconds: u64,
    /// Also measure 4 KiB write+fdatasync latency in this directory during the run, to read
    /// latencies beside the disk's own.
    #[arg(long)]
    fsync_probe_dir: Option<String>,
    /// The broker's PID (same machine): its resident memory (VmRSS) is printed at the start
    /// and at the end of the run.
    #[arg(long)]
    broker_pid: Option<u32>,
    /// The broker's HTTP address (`HOST:PORT`): its `/stats` of the topics is printed at the end
    /// (backlog, unacknowledged and delayed entries per subscription), and where publishes'
    /// time went after the warm-up (`stage` lines: the broker's and its bookie's latency
    /// histograms of `/metrics`, per stage).
    #[arg(long)]
    stats_http: Option<String>,
}

#[derive(clap::Args, Clone, Debug)]
pub struct ProduceArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Producers per topic, each on its own connection.
    #[arg(long, default_value_t = 1)]
    producers: usize,
    /// Messages per second over all producers (0: as fast as possible).
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// Message size, bytes (at least 8: the send time is stamped in the first 8).
    #[arg(long, default_value_t = 1024)]
    size: usize,
    /// Messages per batch (1: no batching).
    #[arg(long, default_value_t = 1000)]
    batch_max_messages: usize,
    /// Largest batch, bytes.
    #[arg(long, default_value_t = 128 * 1024)]
    batch_max_bytes: usize,
    /// Send a batch after its first message waited this long, microseconds.
    #[arg(long, default_value_t = 1000)]
    batch_delay_us: u64,
    /// Messages in flight per producer (sent, receipt not yet back).
    #[arg(long, default_value_t = 10_000)]
    pending_max: usize,
    /// Stop after this many messages over all producers (0: no limit).
    #[arg(long, default_value_t = 0)]
    messages: u64,
    /// Give messages one of this many keys (`key-<n mod N>`, as partition key), in turn
    /// (0: no keys). For Key_Shared runs.
    #[arg(long, default_value_t = 0)]
    keys: u64,
    /// Delayed delivery: each message is to be delivered this many milliseconds after it is
    /// sent (`deliver_at_time`; 0: at once).
    #[arg(long, default_value_t = 0)]
    deliver_after_ms: u64,
}

/// How consumers share a subscription.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PerfSubType {
    Exclusive,
    Shared,
    Failover,
    KeyShared,
}

impl PerfSubType {
    fn wire(self) -> i32 {
        use pb::command_subscribe::SubType as W;
        (match self {
            PerfSubType::Exclusive => W::Exclusive,
            PerfSubType::Shared => W::Shared,
            PerfSubType::Failover => W::Failover,
            PerfSubType::KeyShared => W::KeyShared,
        }) as i32
    }

    /// Shared kinds acknowledge each message; the others cumulatively.
    fn individual_acks(self) -> bool {
        matches!(self, PerfSubType::Shared | PerfSubType::KeyShared)
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct ConsumeArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Subscription name.
    #[arg(long, default_value = "perf-sub")]
    subscription: String,
    /// Where a new subscription starts: earliest or latest.
    #[arg(long, default_value = "earliest")]
    initial: String,
    /// Permits granted at once (the client's receiver queue).
    #[arg(long, default_value_t = 1000)]
    receiver_queue: u32,
    /// Subscription type.
    #[arg(long, value_enum, default_value = "exclusive")]
    subscription_type: PerfSubType,
    /// Consumers per topic, each on its own connection.
    #[arg(long, default_value_t = 1)]
    consumers: usize,
    /// Stop after this many messages over all topics (0: no limit).
    #[arg(long, default_value_t = 0)]
    messages: u64,
}

#[derive(clap::Args, Clone, Debug)]
pub struct E2eArgs {
    #[command(flatten)]
    produce: ProduceArgs,
    /// Subscription name.
    #[arg(long, default_value = "perf-e2e")]
    subscription: String,
    /// Permits granted at once (the client's receiver queue).
    #[arg(long, default_value_t = 1000)]
    receiver_queue: u32,
    /// Subscription type.
    #[arg(long, value_enum, default_value = "exclusive")]
    subscription_type: PerfSubType,
    /// Consumers per topic, each on its own connection.
    #[arg(long, default_value_t = 1)]
    consumers: usize,
    /// Consume at this broker instead of --url's: another site's, to measure geo-replication
    /// (publish at one site to delivery at the other).
    #[arg(long)]
    consume_url: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// A small Pulsar client.

type Routes<T> = Arc<Mutex<HashMap<u64, T>>>;

struct Conn {
    tx: FrameSender,
    requests: Routes<oneshot::Sender<pb::BaseCommand>>,
    receipts: Routes<mpsc::UnboundedSender<Result<(), String>>>,
    messages: Routes<mpsc::UnboundedSender<(pb::MessageIdData, Entry)>>,
    next_request: AtomicU64,
}

fn frame(c: &pb::BaseCommand) -> Bytes {
    let mut b = BytesMut::new();
    encode_command(&mut b, c);
    b.freeze()
}

fn base(t: Type) -> pb::BaseCommand {
    pb::BaseCommand {
        r#type: t as i32,
        ..Default::default()
    }
}

impl Conn {
    async fn connect(url: &str) -> anyhow::Result<Arc<Conn>> {
        let addr = url
            .strip_prefix("pulsar://")
            .with_context(|| format!("{url}: expected pulsar://HOST:PORT"))?;
        let stream = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        stream.set_nodelay(true)?;
        let (mut rd, mut wr) = stream.into_split();
        let mut c = base(Type::Connect);
        c.connect = Some(pb::CommandConnect {
            client_version: concat!("meridian-perf-", env!("CARGO_PKG_VERSION")).into(),
            protocol_version: Some(19),
            ..Default::default()
        });
        wr.write_all(&frame(&c)).await?;
        let mut buf = BytesMut::with_capacity(1 << 20);
        loop {
            if let Some(f) = decode_frame(&mut buf, 64 << 20)? {
                if f.command.connected.is_some() {
                    break;
                }
                if let Some(e) = f.command.error {
                    bail!("broker refused the connection: {}", e.message);
                }
                continue;
            }
            if rd.read_buf(&mut buf).await? == 0 {
                bail!("connection closed during CONNECT");
            }
        }
        let (tx, rx) = meridian_broker::frame_queue::channel(16 << 20);
        tokio::spawn(meridian_broker::connection::write_loop(wr, rx, None));
        let conn = Arc::new(Conn {
            tx,
            requests: Arc::default(),
            receipts: Arc::default(),
            messages: Arc::default(),
            next_request: AtomicU64::new(1),
        });
        let c2 = Arc::clone(&conn);
        tokio::spawn(async move {
            'read: loop {
                loop {
                    match decode_frame(&mut buf, 64 << 20) {
                        Ok(Some(f)) => c2.route(f).await,
                        Ok(None) => break,
                        Err(e) => {
                            eprintln!("perf: bad frame from the broker: {e}");
                            break 'read;
                        }
                    }
                }
                match rd.read_buf(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
            // The connection is over: whoever waits for a receipt, a message or a reply
            // hears of it (their channels close).
            c2.receipts.lock().expect("lock").clear();
            c2.messages.lock().expect("lock").clear();
            c2.requests.lock().expect("lock").clear();
        });
        Ok(conn)
    }

    async fn route(&self, f: meridian_protocol::Frame) {
        let c = f.command;
        if c.ping.is_some() {
            let mut p = base(Type::Pong);
            p.pong = Some(pb::CommandPong {});
            let _ = self.tx.send(frame(&p)).await;
            return;
        }
        if let Some(r) = &c.send_receipt {
            if let Some(q) = self.receipts.lock().expect("lock").get(&r.producer_id) {
                let _ = q.send(Ok(()));
            }
            return;
        }
        if let Some(e) = &c.send_error {
            if let Some(q) = self.receipts.lock().expect("lock").get(&e.producer_id) {
                let _ = q.send(Err(e.message.clone()));
            }
            return;
        }
        if let Some(m) = &c.message {
            let (Some(p), Some(q)) = (
                f.payload,
                self.messages
                    .lock()
                    .expect("lock")
                    .get(&m.consumer_id)
                    .cloned(),
            ) else {
                return;
            };
            let _ = q.send((m.message_id.clone(), Entry::from_payload(&p)));
            return;
        }
        let request_id = c
            .success
            .as_ref()
            .map(|s| s.request_id)
            .or(c.error.as_ref().map(|e| e.request_id))
            .or(c.producer_success.as_ref().map(|p| p.request_id));
        if let Some(id) = request_id {
            if let Some(w) = self.requests.lock().expect("lock").remove(&id) {
                let _ = w.send(c);
            }
        }
    }

    async fn request(
        &self,
        mut c: pb::BaseCommand,
        set: impl FnOnce(&mut pb::BaseCommand, u64),
    ) -> anyhow::Result<pb::BaseCommand> {
        let id = self.next_request.fetch_add(1, Ordering::Relaxed);
        set(&mut c, id);
        let (w, r) = oneshot::channel();
        self.requests.lock().expect("lock").insert(id, w);
        self.tx.send(frame(&c)).await.context("connection closed")?;
        let reply = tokio::time::timeout(Duration::from_secs(30), r)
            .await
            .context("no reply within 30 s")?
            .context("connection closed")?;
        if let Some(e) = &reply.error {
            bail!("broker error {}: {}", e.error, e.message);
        }
        Ok(reply)
    }
}

// ---------------------------------------------------------------------------------------------
// Figures.

struct Recorder {
    interval: Histogram<u64>,
    total: Histogram<u64>,
}

impl Recorder {
    fn new() -> Mutex<Recorder> {
        Mutex::new(Recorder {
            interval: Histogram::new_with_bounds(1, 60_000_000, 3).expect("bounds"),
            total: Histogram::new_with_bounds(1, 60_000_000, 3).expect("bounds"),
        })
    }
}

fn record(r: &Mutex<Recorder>, us: u64) {
    let mut r = r.lock().expect("lock");
    let us = us.clamp(1, 60_000_000);
    let _ = r.interval.record(us);
    let _ = r.total.record(us);
}

#[derive(Default)]
struct Counters {
    msgs: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    /// The broker's message of the first refused send, printed with the summary.
    first_error: Mutex<Option<String>>,
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

fn topic_names(c: &CommonArgs) -> Vec<String> {
    if c.topics <= 1 {
        vec![c.topic.clone()]
    } else {
        (0..c.topics).map(|i| format!("{}-{i}", c.topic)).collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Producing.

struct InFlight {
    due: Vec<u64>,
    bytes: u64,
}

/// One producer: its own connection, batches, a window of messages in flight.
/// Evenly spaced send slots at a fixed rate (slot `n` at `start + n / rate`), from an OS
/// thread that sleeps until each one, as pulsar-perf's rate limiter does. tokio's timer wakes
/// in 1 ms steps: at 10,000 msg/s it sent 10 messages at once every millisecond, a burstier
/// load than the rate describes. A producer that falls behind finds its slots waiting (up to
/// the channel's 64) and then takes the later ones as soon as it can, as before. The thread
/// ends when the receiver is dropped.
fn pacer(start: Instant, rate: f64) -> mpsc::Receiver<()> {
    let (tx, rx) = mpsc::channel(64);
    std::thread::Builder::new()
        .name("perf-pacer".into())
        .spawn(move || {
            let mut n = 0u64;
            loop {
                let at = start + Duration::from_secs_f64(n as f64 / rate);
                let now = Instant::now();
                if at > now {
                    std::thread::sleep(at - now);
                }
                if tx.blocking_send(()).is_err() {
                    return;
                }
                n += 1;
            }
        })
        .expect("spawning the pacer thread");
    rx
}

#[allow(clippy::too_many_arguments)]
async fn run_producer(
    url: String,
    topic: String,
    a: ProduceArgs,
    rate: f64,
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    counters: Arc<Counters>,
    latency: Arc<Mutex<Recorder>>,
) -> anyhow::Result<()> {
    let conn = Conn::connect(&url).await?;
    let producer_id = 1u64;
    let mut c = base(Type::Producer);
    c.producer = Some(pb::CommandProducer {
        topic: topic.clone(),
        producer_id,
        ..Default::default()
    });
    let reply = conn
        .request(c, |c, id| c.producer.as_mut().expect("set").request_id = id)
        .await
        .with_context(|| format!("creating a producer on {topic}"))?;
    let name = reply
        .producer_success
        .map(|p| p.producer_name)
        .unwrap_or_default();
    let (rtx, mut rrx) = mpsc::unbounded_channel();
    conn.receipts.lock().expect("lock").insert(producer_id, rtx);
    let window = Arc::new(Semaphore::new(a.pending_max));
    let inflight: Arc<Mutex<VecDeque<InFlight>>> = Arc::default();
    // Receipts arrive in SEND order: match them with the in-flight queue.
    let receipts = {
        let inflight = Arc::clone(&inflight);
        let window = Arc::clone(&window);
        let counters = Arc::clone(&counters);
        let latency = Arc::clone(&latency);
        tokio::spawn(async move {
            while let Some(r) = rrx.recv().await {
                let Some(b) = inflight.lock().expect("lock").pop_front() else {
                    continue;
                };
                let now = now_us();
                if r.is_ok() {
                    for d in &b.due {
                        record(&latency, now.saturating_sub(*d));
                    }
                    counters
                        .msgs
                        .fetch_add(b.due.len() as u64, Ordering::Relaxed);
                    counters.bytes.fetch_add(b.bytes, Ordering::Relaxed);
                } else {
                    counters
                        .errors
                        .fetch_add(b.due.len() as u64, Ordering::Relaxed);
                    if let Err(why) = r {
                        counters
                            .first_error
                            .lock()
                            .expect("lock")
                            .get_or_insert(why);
                    }
                }
                window.add_permits(b.due.len());
            }
            // The connection closed: no receipt will come, and the sender stops waiting.
            window.close();
        })
    };
    let size = a.size.max(8);
    let batching = a.batch_max_messages > 1;
    let mut seq = 0u64;
    let mut batch = BytesMut::new();
    let mut due: Vec<u64> = Vec::new();
    let mut batch_started = Instant::now();
    let start = Instant::now();
    let mut ticks = (rate > 0.0).then(|| pacer(start, rate));
    let mut n = 0u64;
    let filler = vec![0xabu8; size - 8];
    let key_of = |seq: u64| (a.keys > 0).then(|| format!("key-{}", seq % a.keys));
    let flush = |batch: &mut BytesMut, due: &mut Vec<u64>, seq: &mut u64| -> (Bytes, InFlight) {
        let count = due.len();
        let now = now_us() / 1000;
        let meta = pb::MessageMetadata {
            producer_name: name.clone(),
            sequence_id: *seq,
            publish_time: now,
            num_messages_in_batch: batching.then_some(count as i32),
            // A batch's key is its items'; a single message carries its own.
            partition_key: if batching { None } else { key_of(*seq) },
            deliver_at_time: (a.deliver_after_ms > 0).then(|| (now + a.deliver_after_ms) as i64),
            ..Default::default()
        }
        .encode_to_vec();
        let payload = batch.split().freeze();
        let entry = Entry::build(&meta, &payload);
        let mut c = base(Type::Send);
        c.send = Some(pb::CommandSend {
            producer_id,
            sequence_id: *seq,
            num_messages: batching.then_some(count as i32),
            ..Default::default()
        });
        *seq += count as u64;
        let mut f = BytesMut::new();
        encode_message(&mut f, &c, entry.as_bytes());
        (
            f.freeze(),
            InFlight {
                due: std::mem::take(due),
                bytes: payload.len() as u64,
            },
        )
    };
    loop {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        if a.messages > 0 && sent.fetch_add(1, Ordering::Relaxed) >= a.messages {
            break;
        }
        // When the message is due (fixed rate) or now (unthrottled).
        let due_us = if rate > 0.0 {
            let at = Duration::from_secs_f64(n as f64 / rate);
            let wake = start + at;
            let deadline = batch_started + Duration::from_micros(a.batch_delay_us);
            if !due.is_empty() && deadline < wake {
                tokio::time::sleep_until(deadline.into()).await;
                let (f, inf) = flush(&mut batch, &mut due, &mut seq);
                inflight.lock().expect("lock").push_back(inf);
                conn.tx.send(f).await.context("connection closed")?;
            }
            if let Some(ticks) = ticks.as_mut() {
                if ticks.recv().await.is_none() {
                    break;
                }
            }
            // Stamped when actually sent, as pulsar-perf does.
            now_us()
        } else {
            now_us()
        };
        n += 1;
        let permit = match window.try_acquire() {
            Ok(p) => p,
            Err(_) => {
                if !due.is_empty() {
                    let (f, inf) = flush(&mut batch, &mut due, &mut seq);
                    inflight.lock().expect("lock").push_back(inf);
                    conn.tx.send(f).await.context("connection closed")?;
                }
                match next_permit(&window, &stop).await? {
                    Some(p) => p,
                    None => break,
                }
            }
        };
        permit.forget();
        if due.is_empty() {
            batch_started = Instant::now();
        }
        let mut data = BytesMut::with_capacity(size);
        data.put_u64(due_us);
        data.put_slice(&filler);
        if batching {
            let sm = pb::SingleMessageMetadata {
                payload_size: size as i32,
                partition_key: key_of(seq + due.len() as u64),
                ..Default::default()
            }
            .encode_to_vec();
            batch.put_u32(sm.len() as u32);
            batch.put_slice(&sm);
        }
        batch.put_slice(&data);
        due.push(due_us);
        let full = due.len() >= a.batch_max_messages
            || batch.len() + size >= a.batch_max_bytes
            || batch_started.elapsed() >= Duration::from_micros(a.batch_delay_us);
        if full {
            let (f, inf) = flush(&mut batch, &mut due, &mut seq);
            inflight.lock().expect("lock").push_back(inf);
            conn.tx.send(f).await.context("connection closed")?;
        }
    }
    if !due.is_empty() {
        let (f, inf) = flush(&mut batch, &mut due, &mut seq);
        inflight.lock().expect("lock").push_back(inf);
        conn.tx.send(f).await.context("connection closed")?;
    }
    // Wait for the outstanding receipts (bounded).
    let deadline = Instant::now() + Duration::from_secs(30);
    while !inflight.lock().expect("lock").is_empty()
        && !window.is_closed()
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    receipts.abort();
    // Sends never answered (the connection closed, or nothing answered in time) are errors.
    let unanswered: usize = inflight
        .lock()
        .expect("lock")
        .iter()
        .map(|b| b.due.len())
        .sum();
    if unanswered > 0 {
        counters
            .errors
            .fetch_add(unanswered as u64, Ordering::Relaxed);
        bail!("{unanswered} sends on {topic} got no receipt");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Consuming.

#[allow(clippy::too_many_arguments)]
async fn run_consumer(
    url: String,
    topic: String,
    subscription: String,
    sub_type: PerfSubType,
    earliest: bool,
    receiver_queue: u32,
    stop: Arc<AtomicBool>,
    limit: u64,
    counters: Arc<Counters>,
    e2e: Option<Arc<Mutex<Recorder>>>,
    ready: oneshot::Sender<()>,
) -> anyhow::Result<()> {
    let conn = Conn::connect(&url).await?;
    let consumer_id = 1u64;
    let (mtx, mut mrx) = mpsc::unbounded_channel();
    conn.messages.lock().expect("lock").insert(consumer_id, mtx);
    let mut c = base(Type::Subscribe);
    c.subscribe = Some(pb::CommandSubscribe {
        topic: topic.clone(),
        subscription,
        sub_type: sub_type.wire(),
        consumer_id,
        initial_position: Some(if earliest {
            pb::command_subscribe::InitialPosition::Earliest as i32
        } else {
            pb::command_subscribe::InitialPosition::Latest as i32
        }),
        ..Default::default()
    });
    conn.request(c, |c, id| {
        c.subscribe.as_mut().expect("set").request_id = id
    })
    .await
    .with_context(|| format!("subscribing to {topic}"))?;
    let flow = |n: u32| {
        let mut f = base(Type::Flow);
        f.flow = Some(pb::CommandFlow {
            consumer_id,
            message_permits: n,
        });
        frame(&f)
    };
    conn.tx.send(flow(receiver_queue)).await?;
    let _ = ready.send(());
    let mut since_flow = 0u32;
    let mut to_ack: Vec<pb::MessageIdData> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let (id, entry) = match tokio::time::timeout(Duration::from_millis(200), mrx.recv()).await {
            Ok(Some(m)) => m,
            Ok(None) => bail!("the connection to the broker closed"),
            Err(_) => continue,
        };
        let meta = entry.metadata().ok();
        let count = meta
            .as_ref()
            .map_or(1, meridian_protocol::entry::message_count);
        let payload = entry.payload();
        let now = now_us();
        if let Some(rec) = &e2e {
            if meta
                .as_ref()
                .is_some_and(|m| m.num_messages_in_batch.is_some())
            {
                for item in BatchIter::new(payload.clone()).flatten() {
                    if item.data.len() >= 8 {
                        let sent = u64::from_be_bytes(item.data[..8].try_into().expect("8"));
                        record(rec, now.saturating_sub(sent));
                    }
                }
            } else if payload.len() >= 8 {
                let sent = u64::from_be_bytes(payload[..8].try_into().expect("8"));
                record(rec, now.saturating_sub(sent));
            }
        }
        counters.msgs.fetch_add(u64::from(count), Ordering::Relaxed);
        counters
            .bytes
            .fetch_add(payload.len() as u64, Ordering::Relaxed);
        since_flow += count;
        // Shared kinds acknowledge every entry (one ACK per 64 ids); the others the last
        // entry cumulatively every 64 entries.
        let individual = sub_type.individual_acks();
        if individual || to_ack.is_empty() {
            to_ack.push(pb::MessageIdData {
                ledger_id: id.ledger_id,
                entry_id: id.entry_id,
                ..Default::default()
            });
        } else {
            to_ack[0].ledger_id = id.ledger_id;
            to_ack[0].entry_id = id.entry_id;
        }
        if since_flow >= receiver_queue / 2 {
            conn.tx.send(flow(since_flow)).await?;
            since_flow = 0;
        }
        if to_ack.len() >= 64 || (!individual && since_flow == 0) {
            let mut a = base(Type::Ack);
            a.ack = Some(pb::CommandAck {
                consumer_id,
                ack_type: if individual {
                    pb::command_ack::AckType::Individual
                } else {
                    pb::command_ack::AckType::Cumulative
                } as i32,
                message_id: std::mem::take(&mut to_ack),
                ..Default::default()
            });
            conn.tx.send(frame(&a)).await?;
        }
        if limit > 0 && counters.msgs.load(Ordering::Relaxed) >= limit {
            stop.store(true, Ordering::Relaxed);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Commands.

struct Report {
    label: &'static str,
    counters: Arc<Counters>,
    latency: Option<(&'static str, Arc<Mutex<Recorder>>)>,
}

async fn report_loop(
    reports: Vec<Report>,
    every: Duration,
    warmup: Duration,
    stop: Arc<AtomicBool>,
) {
    let start = Instant::now();
    let mut warming = !warmup.is_zero();
    let mut last: Vec<(u64, u64)> = vec![(0, 0); reports.len()];
    let mut last_t = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if warming && start.elapsed() >= warmup {
            warming = false;
            for r in &reports {
                if let Some((_, rec)) = &r.latency {
                    rec.lock().expect("lock").total.reset();
                }
            }
            println!(
                "[{:>5.1}s] warm-up over: the summary's latencies start here",
                start.elapsed().as_secs_f64()
            );
        }
        if last_t.elapsed() < every {
            continue;
        }
        let dt = last_t.elapsed().as_secs_f64();
        last_t = Instant::now();
        for (r, l) in reports.iter().zip(last.iter_mut()) {
            let m = r.counters.msgs.load(Ordering::Relaxed);
            let b = r.counters.bytes.load(Ordering::Relaxed);
            let mut line = format!(
                "[{:>5.1}s] {}: {:>10.0} msg/s {:>8.1} MiB/s",
                start.elapsed().as_secs_f64(),
                r.label,
                (m - l.0) as f64 / dt,
                (b - l.1) as f64 / dt / 1048576.0
            );
            *l = (m, b);
            if let Some((name, rec)) = &r.latency {
                let mut rec = rec.lock().expect("lock");
                line.push_str(&format!(" | {name} {}", percentiles(&rec.interval)));
                rec.interval.reset();
            }
            println!("{line}");
        }
    }
}

fn summary(label: &str, c: &Counters, secs: f64, latency: Option<(&str, &Mutex<Recorder>)>) {
    let m = c.msgs.load(Ordering::Relaxed);
    let b = c.bytes.load(Ordering::Relaxed);
    let e = c.errors.load(Ordering::Relaxed);
    println!(
        "summary {label}: {m} messages in {secs:.1} s = {:.0} msg/s, {:.1} MiB/s{}",
        m as f64 / secs,
        b as f64 / secs / 1048576.0,
        if e > 0 {
            let first = c
                .first_error
                .lock()
                .expect("lock")
                .clone()
                .unwrap_or_default();
            format!(", {e} failed (first: {first})")
        } else {
            String::new()
        }
    );
    if let Some((name, rec)) = latency {
        println!(
            "summary {label} {name} latency: {}",
            percentiles(&rec.lock().expect("lock").total)
        );
    }
}

/// A permit of the send window once a receipt frees one; `None` once the run is to stop
/// (`--seconds` over), an error once the connection closed (the
/// receipts' task closes the window then).
async fn next_permit<'a>(
    window: &'a Semaphore,
    stop: &AtomicBool,
) -> anyhow::Result<Option<tokio::sync::SemaphorePermit<'a>>> {
    loop {
        tokio::select! {
            p = window.acquire() => {
                return p.map(Some).map_err(|_| anyhow::anyhow!("the connection to the broker closed with sends unanswered"));
            }
            _ = tokio::time::sleep(Duration::from_millis(50)) => {
                if stop.load(Ordering::Relaxed) {
                    return Ok(None);
                }
            }
        }
    }
}

async fn stop_after(seconds: u64, stop: Arc<AtomicBool>) {
    if seconds == 0 {
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(seconds);
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Relaxed);
}

fn spawn_producers(
    a: &ProduceArgs,
    stop: &Arc<AtomicBool>,
    counters: &Arc<Counters>,
    latency: &Arc<Mutex<Recorder>>,
) -> Vec<tokio::task::JoinHandle<anyhow::Result<()>>> {
    let topics = topic_names(&a.common);
    let total = topics.len() * a.producers.max(1);
    let rate = a.rate as f64 / total as f64;
    let sent = Arc::new(AtomicU64::new(0));
    let mut out = Vec::new();
    for t in &topics {
        for _ in 0..a.producers.max(1) {
            out.push(tokio::spawn(run_producer(
                a.common.url.clone(),
                t.clone(),
                a.clone(),
                rate,
                Arc::clone(stop),
                Arc::clone(&sent),
                Arc::clone(counters),
                Arc::clone(latency),
            )));
        }
    }
    out
}

/// Waits for every task (one that failed does not end the others' run), then answers the
/// first failure.
async fn join_all(tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>) -> anyhow::Result<()> {
    let mut first = None;
    for t in tasks {
        let r = t.await.context("task panicked").and_then(|r| r);
        if let Err(e) = r {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// VmRSS of a process, KiB.
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Prints the broker's resident memory, if asked (`--broker-pid`).
fn print_broker_memory(c: &CommonArgs, when: &str) {
    if let Some(pid) = c.broker_pid {
        match rss_kib(pid) {
            Some(kib) => println!(
                "broker {pid} resident memory {when}: {:.1} MiB",
                kib as f64 / 1024.0
            ),
            None => println!("broker {pid}: no /proc/{pid}/status"),
        }
    }
}

/// Prints the broker's `/stats` of the run's topics, if asked (`--stats-http`).
async fn print_broker_stats(c: &CommonArgs) {
    let Some(addr) = &c.stats_http else { return };
    for t in topic_names(c) {
        match http_get(addr, &format!("/stats?topic={t}")).await {
            Ok(body) => println!("broker stats of {t}: {body}"),
            Err(e) => println!("broker stats of {t}: {e:#}"),
        }
    }
}

/// `/metrics` once the warm-up is over (`None` without `--stats-http`).
fn stages_after_warmup(c: &CommonArgs) -> tokio::task::JoinHandle<Option<Snapshot>> {
    let addr = c.stats_http.clone();
    let warmup = Duration::from_secs(c.warmup_seconds);
    tokio::spawn(async move {
        tokio::time::sleep(warmup).await;
        Some(Snapshot::parse(&http_get(&addr?, "/metrics").await.ok()?))
    })
}

/// Prints where publishes' time went since `before` was taken.
async fn print_stages(c: &CommonArgs, before: tokio::task::JoinHandle<Option<Snapshot>>) {
    let (Some(addr), Ok(Some(before))) = (&c.stats_http, before.await) else {
        return;
    };
    match http_get(addr, "/metrics").await {
        Ok(page) => {
            for line in Snapshot::parse(&page).report_since(&before) {
                println!("stage {line}");
            }
        }
        Err(e) => println!("stage latencies: {e:#}"),
    }
}

async fn http_get(addr: &str, path: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    let body = out.split_once("\r\n\r\n").map_or(out.as_str(), |(_, b)| b);
    Ok(body.trim().to_string())
}

/// One consumer per topic; returns once every one has subscribed and granted its permits.
#[allow(clippy::too_many_arguments)]
async fn spawn_consumers(
    common: &CommonArgs,
    subscription: &str,
    sub_type: PerfSubType,
    consumers: usize,
    earliest: bool,
    receiver_queue: u32,
    stop: &Arc<AtomicBool>,
    limit: u64,
    counters: &Arc<Counters>,
    e2e: Option<&Arc<Mutex<Recorder>>>,
) -> Vec<tokio::task::JoinHandle<anyhow::Result<()>>> {
    let mut tasks = Vec::new();
    let mut readies = Vec::new();
    for t in topic_names(common)
        .into_iter()
        .flat_map(|t| std::iter::repeat_n(t, consumers.max(1)))
    {
        let (rt, rr) = oneshot::channel();
        readies.push(rr);
        tasks.push(tokio::spawn(run_consumer(
            common.url.clone(),
            t,
            subscription.to_string(),
            sub_type,
            earliest,
            receiver_queue,
            Arc::clone(stop),
            limit,
            Arc::clone(counters),
            e2e.map(Arc::clone),
            rt,
        )));
    }
    for r in readies {
        let _ = r.await;
    }
    tasks
}

pub async fn produce(a: ProduceArgs) -> anyhow::Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    let probe = a
        .common
        .fsync_probe_dir
        .clone()
        .map(|d| crate::disk_probe::background_latency(d, Arc::clone(&stop)));
    let counters = Arc::new(Counters::default());
    let latency = Arc::new(Recorder::new());
    print_broker_memory(&a.common, "at the start");
    let stages = stages_after_warmup(&a.common);
    let start = Instant::now();
    let tasks = spawn_producers(&a, &stop, &counters, &latency);
    let reporter = tokio::spawn(report_loop(
        vec![Report {
            label: "produce",
            counters: Arc::clone(&counters),
            latency: Some(("publish", Arc::clone(&latency))),
        }],
        Duration::from_secs(a.common.report_every.max(1)),
        Duration::from_secs(a.common.warmup_seconds),
        Arc::clone(&stop),
    ));
    let timer = tokio::spawn(stop_after(a.common.seconds, Arc::clone(&stop)));
    let r = join_all(tasks).await;
    let secs = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let _ = timer.await;
    let _ = reporter.await;
    summary("produce", &counters, secs, Some(("publish", &latency)));
    crate::disk_probe::print_background(probe);
    print_broker_memory(&a.common, "at the end");
    print_stages(&a.common, stages).await;
    print_broker_stats(&a.common).await;
    r
}

pub async fn consume(a: ConsumeArgs) -> anyhow::Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    let probe = a
        .common
        .fsync_probe_dir
        .clone()
        .map(|d| crate::disk_probe::background_latency(d, Arc::clone(&stop)));
    let counters = Arc::new(Counters::default());
    print_broker_memory(&a.common, "at the start");
    let tasks = spawn_consumers(
        &a.common,
        &a.subscription,
        a.subscription_type,
        a.consumers,
        a.initial != "latest",
        a.receiver_queue,
        &stop,
        a.messages,
        &counters,
        None,
    )
    .await;
    let start = Instant::now();
    let reporter = tokio::spawn(report_loop(
        vec![Report {
            label: "consume",
            counters: Arc::clone(&counters),
            latency: None,
        }],
        Duration::from_secs(a.common.report_every.max(1)),
        Duration::from_secs(a.common.warmup_seconds),
        Arc::clone(&stop),
    ));
    let timer = tokio::spawn(stop_after(a.common.seconds, Arc::clone(&stop)));
    let r = join_all(tasks).await;
    let secs = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let _ = timer.await;
    let _ = reporter.await;
    summary("consume", &counters, secs, None);
    crate::disk_probe::print_background(probe);
    print_broker_memory(&a.common, "at the end");
    print_broker_stats(&a.common).await;
    r
}

pub async fn e2e(a: E2eArgs) -> anyhow::Result<()> {
    let p = &a.produce;
    let stop = Arc::new(AtomicBool::new(false));
    let probe = p
        .common
        .fsync_probe_dir
        .clone()
        .map(|d| crate::disk_probe::background_latency(d, Arc::clone(&stop)));
    let consumed = Arc::new(Counters::default());
    let e2e_latency = Arc::new(Recorder::new());
    print_broker_memory(&p.common, "at the start");
    let mut consume_at = p.common.clone();
    if let Some(url) = &a.consume_url {
        consume_at.url = url.clone();
    }
    let tasks = spawn_consumers(
        &consume_at,
        &a.subscription,
        a.subscription_type,
        a.consumers,
        false,
        a.receiver_queue,
        &stop,
        0,
        &consumed,
        Some(&e2e_latency),
    )
    .await;
    let produced = Arc::new(Counters::default());
    let publish = Arc::new(Recorder::new());
    let stages = stages_after_warmup(&p.common);
    let start = Instant::now();
    let producers = spawn_producers(p, &stop, &produced, &publish);
    let reporter = tokio::spawn(report_loop(
        vec![
            Report {
                label: "produce",
                counters: Arc::clone(&produced),
                latency: Some(("publish", Arc::clone(&publish))),
            },
            Report {
                label: "consume",
                counters: Arc::clone(&consumed),
                latency: Some(("end-to-end", Arc::clone(&e2e_latency))),
            },
        ],
        Duration::from_secs(p.common.report_every.max(1)),
        Duration::from_secs(p.common.warmup_seconds),
        Arc::clone(&stop),
    ));
    let timer = tokio::spawn(stop_after(p.common.seconds, Arc::clone(&stop)));
    let r = join_all(producers).await;
    let secs = start.elapsed().as_secs_f64();
    // Let the consumer drain what is in flight.
    let drain = Instant::now() + Duration::from_secs(5);
    while consumed.msgs.load(Ordering::Relaxed) < produced.msgs.load(Ordering::Relaxed)
        && Instant::now() < drain
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let _ = timer.await;
    let _ = reporter.await;
    let consumers = join_all(tasks).await;
    summary("produce", &produced, secs, Some(("publish", &publish)));
    summary(
        "consume",
        &consumed,
        secs,
        Some(("end-to-end", &e2e_latency)),
    );
    crate::disk_probe::print_background(probe);
    print_broker_memory(&p.common, "at the end");
    print_stages(&p.common, stages).await;
    print_broker_stats(&p.common).await;
    r.and(consumers)
}
