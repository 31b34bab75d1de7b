//! A producer's publish path on one connection, apart from the connection's read loop:
//!
//! ```text
//!  read loop ─ SEND ─► publish rate allows it now? ── yes ─► submit: done in 5 ms? ── yes ─► receipt queue
//!                          │ no (or sends already wait)             │ no: handed over begun         ▲
//!                          └─► throttle queue ◄──────────────────────┘                              │
//!                                 └─► throttle task: finishes a begun one; sleeps until each ───────┘
//!                                     throttled send's turn and submits it; in order
//!  receipt queue ─► receipt task: awaits each append's durability in SEND order ─► SEND_RECEIPT
//! ```
//!
//! A throttled producer waits in its own task, never in the read loop: the connection keeps
//! answering pings, acknowledgements and other producers meanwhile. So does a send whose
//! submission takes longer than `HAND_OVER_AFTER` (5 ms: its log makes a new ledger, waits
//! for writable bookies, or waits for the producer's sends in flight before it moves on):
//! the read loop hands it, begun, to the throttle task to finish there. Shorter waits (a
//! lock, a full write window) are waited out in the read loop. A send goes through the throttle queue whenever an earlier one of its
//! producer is still there, so a producer's sends are appended, and answered, in SEND order.
//! Both queues are bounded (`broker.producer_pending_sends_max`): a client past that bound
//! waits in the read loop, which is the backpressure it sees.
//!
//! A send goes to the ledger of its producer's sends in flight, or waits until they are
//! answered ([`InFlight`]): it never lands in a later ledger while an earlier one of its
//! producer may still fail there.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use meridian_protocol::pb::{self, ServerError};
use meridian_protocol::{cmd, Entry, Payload, ID_NONE};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::broker::dedup::{queue_entry, Submitted};
use crate::broker::producers::ProducerHandle;
use crate::broker::{BrokerError, Topic};
use crate::connection::frame;
use crate::frame_queue::FrameSender;

/// One SEND as it was read.
pub(crate) struct SendRequest {
    pub send: pb::CommandSend,
    pub payload: Payload,
    pub received: Instant,
    /// Messages in it (a batch's count, never more than its bytes).
    pub messages: u64,
    pub bytes: u64,
}

impl SendRequest {
    pub fn new(send: pb::CommandSend, payload: Payload) -> SendRequest {
        let bytes = payload.body.len() as u64;
        // Each message of a batch takes at least a byte: a count beyond that is not believed
        // (it would only feed rate limits and stats).
        let messages = u64::try_from(send.num_messages.unwrap_or(1).max(1))
            .unwrap_or(1)
            .min(bytes.max(1));
        SendRequest {
            send,
            payload,
            received: Instant::now(),
            messages,
            bytes,
        }
    }
}

/// What a producer's sends go through on this connection.
pub(crate) struct Publisher {
    pub topic: Arc<Topic>,
    pub handle: Arc<ProducerHandle>,
    message_bytes_max: u64,
    receipts_tx: mpsc::Sender<PendingSend>,
    receipts: JoinHandle<()>,
    throttle_tx: mpsc::Sender<Throttled>,
    throttle: JoinHandle<()>,
    /// Tells the throttle task to stop between sends.
    stop: watch::Sender<bool>,
    /// Sends in the throttle queue or its task whose outcome is not yet in the receipt queue
    /// (begun submissions included).
    throttled: Arc<AtomicUsize>,
    in_flight: Arc<InFlight>,
}

/// The receipt task is gone: the client's connection has closed.
pub(crate) struct ReceiptsGone;

/// How long the read loop waits for a send's submission before it hands it to the throttle
/// task.
const HAND_OVER_AFTER: Duration = Duration::from_millis(5);

/// A submission under way, owning what it needs, so that it can finish in another task.
type SubmitFuture = std::pin::Pin<Box<dyn std::future::Future<Output = PendingSend> + Send>>;

/// What the throttle task is handed, in SEND order.
enum Throttled {
    /// A send to submit once it is due; `by_rate`: held back by a publish rate (else it only
    /// queued behind an earlier send).
    Due {
        send: SendRequest,
        due: Instant,
        by_rate: bool,
    },
    /// A send whose submission began in the read loop and could not finish at once.
    Begun(SubmitFuture, Submitting),
}

/// Where a producer's sends in flight (appended, not yet answered) went, and how many there
/// are. A later send is appended only into that ledger; when it takes no more (its writer
/// failed, it is due to roll over, or it closed), the send waits until those are answered.
/// Otherwise a send could land in the next ledger while an earlier one fails in the last:
/// the client's resend of the failed one would come after it, and, deduplicated, be dropped
/// as already persisted (acknowledged, never stored).
#[derive(Default)]
pub(crate) struct InFlight {
    /// (ledger, sends in flight there).
    at: std::sync::Mutex<(u64, u64)>,
    settled: tokio::sync::Notify,
    /// The receipt task ended: what is in flight is never answered here.
    gone: std::sync::atomic::AtomicBool,
    /// Sends whose checks began, and of them those whose outcome is in the receipt queue
    /// (a producer submits one at a time: from the read loop, or from its throttle task
    /// while that holds sends).
    submits_started: AtomicU64,
    submits_queued: AtomicU64,
}

/// Counts a send as submitted from its start until it is dropped (once its outcome is
/// queued).
struct Submitting(Arc<InFlight>);

impl Submitting {
    fn start(in_flight: &Arc<InFlight>) -> Self {
        // SeqCst with the fenced flag: see `ProducerHandle::is_fenced`.
        in_flight.submits_started.fetch_add(1, Ordering::SeqCst);
        Submitting(Arc::clone(in_flight))
    }
}

impl Drop for Submitting {
    fn drop(&mut self) {
        self.0.submits_queued.fetch_add(1, Ordering::SeqCst);
    }
}

impl InFlight {
    fn ledger(&self) -> Option<u64> {
        let (ledger, n) = *self.at.lock().expect("in-flight lock");
        (n > 0).then_some(ledger)
    }

    fn appended(&self, ledger: u64) {
        let mut at = self.at.lock().expect("in-flight lock");
        *at = (ledger, at.1 + 1);
    }

    fn answered(&self) {
        let mut at = self.at.lock().expect("in-flight lock");
        at.1 = at.1.saturating_sub(1);
        if at.1 == 0 {
            self.settled.notify_waiters();
        }
    }

    /// Until no send is in flight (true), or the receipt task ended (false).
    async fn settled(&self) -> bool {
        loop {
            let notified = self.settled.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.gone.load(Ordering::Acquire) {
                return false;
            }
            if self.ledger().is_none() {
                return true;
            }
            notified.await;
        }
    }
}

/// Held by the receipt task: however it ends (a panic included), a send waiting for the
/// producer's sends in flight is let go.
struct ReceiptsEnd(Arc<InFlight>);

impl Drop for ReceiptsEnd {
    fn drop(&mut self) {
        self.0.gone.store(true, Ordering::Release);
        self.0.settled.notify_waiters();
    }
}

impl Publisher {
    pub fn start(
        producer_id: u64,
        topic: Arc<Topic>,
        handle: Arc<ProducerHandle>,
        message_bytes_max: u64,
        pending_sends_max: usize,
        tx: FrameSender,
    ) -> Publisher {
        let (receipts_tx, rx) = mpsc::channel(pending_sends_max);
        let in_flight = Arc::new(InFlight::default());
        let receipts = tokio::spawn(receipt_loop(
            producer_id,
            Arc::clone(&topic),
            Arc::clone(&handle),
            Arc::clone(&in_flight),
            rx,
            tx,
        ));
        let (throttle_tx, throttle_rx) = mpsc::channel(pending_sends_max);
        let throttled = Arc::new(AtomicUsize::new(0));
        let (stop, stop_rx) = watch::channel(false);
        let throttle = tokio::spawn(throttle_loop(
            Arc::clone(&topic),
            Arc::clone(&handle),
            Arc::clone(&in_flight),
            message_bytes_max,
            (throttle_rx, stop_rx),
            receipts_tx.clone(),
            Arc::clone(&throttled),
        ));
        Publisher {
            topic,
            handle,
            message_bytes_max,
            receipts_tx,
            receipts,
            throttle_tx,
            throttle,
            stop,
            throttled,
            in_flight,
        }
    }

    /// Takes one SEND: submitted at once, or queued behind the publish rate.
    pub async fn send(&self, r: SendRequest) -> Result<(), ReceiptsGone> {
        // Past a publish rate (the topic's, or the namespace's over all its topics) the send
        // waits for its turn; each send's debt is taken in SEND order, at arrival.
        let wait = [
            self.topic.publish_limiter.get(),
            self.topic.ns_limiters.publish.get(),
        ]
        .into_iter()
        .flatten()
        .map(|l| l.take(r.messages, r.bytes, r.received))
        .max()
        .unwrap_or_default();
        if wait.is_zero() && self.throttled.load(Ordering::Acquire) == 0 {
            let submitting = Submitting::start(&self.in_flight);
            let mut submission = self.submission(r);
            let ps = match poll_once(&mut submission).await {
                Some(ps) => ps,
                // A brief wait (a lock, a full write window) is waited out here, as before
                // (the client's backpressure); a long one (a new ledger, writable bookies,
                // the producer's sends in flight) not in the read loop.
                None => match tokio::time::timeout(HAND_OVER_AFTER, &mut submission).await {
                    Ok(ps) => ps,
                    Err(_) => {
                        metrics::counter!("meridian_publish_submits_moved_total").increment(1);
                        return self.queue(Throttled::Begun(submission, submitting)).await;
                    }
                },
            };
            let queued = self.receipts_tx.send(ps).await.map_err(|_| ReceiptsGone);
            drop(submitting);
            return queued;
        }
        if !wait.is_zero() {
            metrics::counter!("meridian_publish_throttled_total").increment(1);
        }
        let due = r.received + wait;
        self.queue(Throttled::Due {
            send: r,
            due,
            by_rate: !wait.is_zero(),
        })
        .await
    }

    /// A send's submission, owning what it needs. Outside the task's cooperative budget: a
    /// read loop that has used its budget up would otherwise see every send pending.
    fn submission(&self, r: SendRequest) -> SubmitFuture {
        let (topic, handle, in_flight) = (
            Arc::clone(&self.topic),
            Arc::clone(&self.handle),
            Arc::clone(&self.in_flight),
        );
        let message_bytes_max = self.message_bytes_max;
        Box::pin(tokio::task::unconstrained(async move {
            submit(&topic, &handle, &in_flight, message_bytes_max, r).await
        }))
    }

    /// Hands a send to the throttle task, behind those it holds.
    async fn queue(&self, t: Throttled) -> Result<(), ReceiptsGone> {
        self.throttled.fetch_add(1, Ordering::AcqRel);
        if self.throttle_tx.send(t).await.is_err() {
            self.throttled.fetch_sub(1, Ordering::AcqRel);
            return Err(ReceiptsGone);
        }
        Ok(())
    }

    /// Closes the producer's path: sends still waiting for their turn under a publish rate
    /// are dropped (never appended, never acknowledged), and every send queued after the
    /// first of them; the others (whose submission began, or that only queued behind one
    /// that had) are submitted, awaited and answered, in order. That can take the
    /// submission's own wait (writable bookies: up to `broker.ledger_create_wait_ms`); a
    /// CLOSE_PRODUCER's close runs in a task of its own ([`crate::closing`]), so the
    /// connection's read loop does not wait for it.
    /// A send the throttle task has begun to submit is submitted and handed on whole: cut
    /// between its append and its hand-off, its deduplication ticket would stay pending
    /// (its resends refused as still being written, the topic's snapshots held back).
    pub async fn close(self) {
        let _ = self.stop.send(true);
        let _ = self.throttle.await;
        drop(self.receipts_tx);
        drop(self.throttle_tx);
        let _ = self.receipts.await;
    }
}

/// Polls `submission` once: its outcome if it finished, `None` if it waits (it can then be
/// polled on in another task).
async fn poll_once(submission: &mut SubmitFuture) -> Option<PendingSend> {
    use std::task::Poll;
    std::future::poll_fn(|cx| {
        Poll::Ready(match submission.as_mut().poll(cx) {
            Poll::Ready(ps) => Some(ps),
            Poll::Pending => None,
        })
    })
    .await
}

/// Sleeps until each throttled send is due, then submits it, in order, and finishes the
/// submissions the read loop began (one can only be first in the queue: the read loop hands
/// one over only when the task holds nothing). Told to stop, it submits and hands on what
/// the read loop would have submitted at once (see [`Publisher::close`]) and drops the rest
/// from the first send held back by a rate; a send being submitted is handed on first.
async fn throttle_loop(
    topic: Arc<Topic>,
    handle: Arc<ProducerHandle>,
    in_flight: Arc<InFlight>,
    message_bytes_max: u64,
    (mut rx, mut stop): (mpsc::Receiver<Throttled>, watch::Receiver<bool>),
    receipts: mpsc::Sender<PendingSend>,
    throttled: Arc<AtomicUsize>,
) {
    // A closed `stop` (the publisher dropped) stops too.
    let mut stopping = false;
    loop {
        let next = if stopping {
            match rx.try_recv() {
                Ok(next) => next,
                Err(_) => return,
            }
        } else {
            let next = tokio::select! {
                biased;
                _ = stop.wait_for(|s| *s) => None,
                next = rx.recv() => match next {
                    Some(next) => Some(next),
                    None => return,
                },
            };
            match next {
                Some(next) => next,
                None => {
                    stopping = true;
                    continue;
                }
            }
        };
        let (ps, submitting) = match next {
            Throttled::Begun(submission, submitting) => (submission.await, submitting),
            Throttled::Due { send, due, by_rate } => {
                if by_rate {
                    if stopping {
                        return;
                    }
                    let stopped = tokio::select! {
                        biased;
                        _ = stop.wait_for(|s| *s) => true,
                        _ = tokio::time::sleep_until(due.into()) => false,
                    };
                    if stopped {
                        return;
                    }
                }
                let submitting = Submitting::start(&in_flight);
                (
                    submit(&topic, &handle, &in_flight, message_bytes_max, send).await,
                    submitting,
                )
            }
        };
        if crate::failpoint::hit("publish:slow_hand_off") {
            tokio::time::sleep(Duration::from_secs(8)).await;
        }
        let gone = receipts.send(ps).await.is_err();
        drop(submitting);
        // Only after the append was submitted and its outcome queued: a later send that
        // sees no throttled one left is appended after this one.
        throttled.fetch_sub(1, Ordering::AcqRel);
        if gone {
            return;
        }
    }
}

/// Checks one SEND and appends it (deduplicated where the topic says so).
async fn submit(
    topic: &Topic,
    handle: &ProducerHandle,
    in_flight: &InFlight,
    message_bytes_max: u64,
    r: SendRequest,
) -> PendingSend {
    let submitted = Instant::now();
    // Read before the checks: none in flight means any earlier failure has already broken
    // the producer off (the receipt task breaks it off before it counts a send answered).
    let only_in = in_flight.ledger();
    let mut silent = false;
    let append = match refusal(topic, handle, message_bytes_max, &r.payload).await {
        Some((e, quiet)) => {
            silent = quiet;
            Err(e)
        }
        None => {
            let entry = Entry::from_payload(&r.payload);
            let highest = r.send.highest_sequence_id;
            let mut appended = append(topic, &handle.name, highest, entry, only_in).await;
            if let Ok(Submitted::NotThere(entry)) = appended {
                // Their ledger takes no more: only once they are answered (a failure among
                // them breaks the producer off) does the log move on for this producer, and
                // the send is checked again (it may have been fenced or closed meanwhile).
                tracing::debug!(topic = %topic.name, producer = %handle.name, "a send waits for the producer's sends in flight before the log moves on");
                metrics::counter!("meridian_publish_waits_for_in_flight_total").increment(1);
                appended = if !in_flight.settled().await {
                    Err(BrokerError::new(
                        ServerError::PersistenceError,
                        "the producer's earlier sends were not answered; it reconnects and sends again",
                    ))
                } else if let Some((e, quiet)) =
                    refusal(topic, handle, message_bytes_max, &r.payload).await
                {
                    silent = quiet;
                    Err(e)
                } else {
                    append(topic, &handle.name, highest, entry, None).await
                };
            }
            if let Ok(Submitted::Appended(pa, _)) = &appended {
                in_flight.appended(pa.ledger_id());
            }
            appended.inspect_err(|e| {
                if matches!(
                    e.code,
                    ServerError::PersistenceError | ServerError::ServiceNotReady
                ) {
                    // The next send must not be stored ahead of this one.
                    handle.break_off();
                }
            })
        }
    };
    PendingSend {
        // Read after this send's own checks and append: set, the break came at this send or
        // before it (never at a later one).
        after_break: handle.is_broken(),
        sequence_id: r.send.sequence_id,
        submitted,
        highest_sequence_id: r.send.highest_sequence_id,
        messages: r.messages,
        bytes: r.bytes,
        received: r.received,
        append,
        silent,
    }
}

/// Why a SEND is refused before it is appended, if it is (and whether silently: its producer
/// was closed by the broker and the client sends it again after reconnecting).
async fn refusal(
    topic: &Topic,
    handle: &ProducerHandle,
    message_bytes_max: u64,
    payload: &Payload,
) -> Option<(BrokerError, bool)> {
    let mut silent = false;
    let refused = if !handle.is_granted() {
        BrokerError::new(
            ServerError::NotAllowedError,
            "this WaitForExclusive producer is still waiting for exclusive access; wait for its second PRODUCER_SUCCESS (producer_ready) before sending",
        )
    } else if handle.is_broken() {
        BrokerError::new(
            ServerError::PersistenceError,
            "an earlier send of this producer could not be stored; it reconnects and sends again from that one, in order",
        )
    } else if handle.is_fenced() {
        if let Some(b) = topic.quota_breach() {
            b.error()
        } else if topic.ml.is_terminated().await {
            BrokerError::new(
                ServerError::TopicTerminatedError,
                "the topic is terminated: it takes no more messages",
            )
        } else if handle.is_closed_by_broker() {
            // Sent before the client saw CLOSE_PRODUCER: it sends this again once it has
            // reconnected (to wherever the topic is served now).
            silent = true;
            BrokerError::new(
                ServerError::ServiceNotReady,
                "the topic is no longer served by this producer's connection; sent again after reconnecting",
            )
        } else {
            BrokerError::new(
                ServerError::ProducerFenced,
                "this producer was fenced by an exclusive producer",
            )
        }
    } else if !payload.checksum_ok() {
        BrokerError::new(ServerError::ChecksumError, "message checksum mismatch")
    } else if payload.body.len() as u64 > message_bytes_max + 4096 {
        BrokerError::new(
            ServerError::NotAllowedError,
            "message larger than broker.message_bytes_max",
        )
    } else if payload.claims_origin() {
        BrokerError::new(
            ServerError::NotAllowedError,
            "the message's metadata carries field 1001 (meridian_origin), which only geo-replication writes",
        )
    } else {
        return None;
    };
    Some((refused, silent))
}

/// Appends `entry` (deduplicated where the topic says so), only into ledger `only_in` if
/// given ([`Submitted::NotThere`] when it takes no more).
async fn append(
    topic: &Topic,
    producer: &str,
    highest: Option<u64>,
    entry: Entry,
    only_in: Option<u64>,
) -> Result<Submitted, BrokerError> {
    if let Some(d) = &topic.dedup {
        return d.submit(&topic.ml, producer, highest, entry, only_in).await;
    }
    Ok(match queue_entry(&topic.ml, entry, only_in).await? {
        Ok(pa) => Submitted::Appended(pa, None),
        Err(entry) => Submitted::NotThere(entry),
    })
}

pub(crate) struct PendingSend {
    sequence_id: u64,
    submitted: Instant,
    highest_sequence_id: Option<u64>,
    messages: u64,
    bytes: u64,
    received: Instant,
    append: Result<Submitted, BrokerError>,
    /// Refused without an answer (its producer was closed by the broker).
    silent: bool,
    /// Its producer was broken off when it was submitted (by it or an earlier send).
    after_break: bool,
}

/// Awaits each send's durability in SEND order and answers it. A producer fenced or closed
/// by the broker (its topic unloaded, terminated or over quota) is sent its CLOSE_PRODUCER
/// here, once every send submitted before is answered: a stock client drops receipts that
/// come after a CLOSE_PRODUCER and, re-created before its first receipt, numbers new
/// messages over ids of pending ones.
pub(crate) async fn receipt_loop(
    producer_id: u64,
    topic: Arc<Topic>,
    handle: Arc<ProducerHandle>,
    in_flight: Arc<InFlight>,
    mut rx: mpsc::Receiver<PendingSend>,
    tx: FrameSender,
) {
    let _end = ReceiptsEnd(Arc::clone(&in_flight));
    let mut r = Receipts::new(producer_id, topic, handle, Arc::clone(&in_flight), tx);
    let mut fence_told = false;
    loop {
        tokio::select! {
            biased;
            next = rx.recv() => match next {
                Some(ps) => r.answer(ps).await,
                None => return,
            },
            () = r.handle.fenced_notice(), if !fence_told => {
                fence_told = true;
                // Every send whose checks began before the fence is answered first (one
                // still being submitted too); those after it are refused.
                let before = in_flight.submits_started.load(Ordering::SeqCst);
                while in_flight.submits_queued.load(Ordering::SeqCst) < before {
                    tokio::select! {
                        next = rx.recv() => match next {
                            Some(ps) => r.answer(ps).await,
                            None => return,
                        },
                        () = tokio::time::sleep(Duration::from_millis(5)) => {}
                    }
                }
                while let Ok(ps) = rx.try_recv() {
                    r.answer(ps).await;
                }
                if r.handle.take_close_notice() {
                    let close = r.handle.close_frame();
                    r.write(close).await;
                }
            }
        }
    }
}

/// The receipt task's state: where answers go and what it counts.
struct Receipts {
    producer_id: u64,
    topic: Arc<Topic>,
    handle: Arc<ProducerHandle>,
    in_flight: Arc<InFlight>,
    tx: FrameSender,
    published: metrics::Counter,
    published_bytes: metrics::Counter,
    publish_latency: metrics::Histogram,
    storage_latency: metrics::Histogram,
    errors: metrics::Counter,
    duplicates: metrics::Counter,
    /// Once the client is gone receipts are no longer written, but every pending send is
    /// still awaited: deduplication must learn what became durable.
    client_gone: bool,
    last_error_logged: Option<Instant>,
}

impl Receipts {
    fn new(
        producer_id: u64,
        topic: Arc<Topic>,
        handle: Arc<ProducerHandle>,
        in_flight: Arc<InFlight>,
        tx: FrameSender,
    ) -> Receipts {
        // Resolved once per producer, not per SEND (each macro call looks the metric up).
        Receipts {
            producer_id,
            topic,
            handle,
            in_flight,
            tx,
            published: metrics::counter!("meridian_publish_messages_total"),
            published_bytes: metrics::counter!("meridian_publish_bytes_total"),
            publish_latency: metrics::histogram!("meridian_publish_latency_seconds"),
            storage_latency: metrics::histogram!("meridian_storage_write_latency_seconds"),
            errors: metrics::counter!("meridian_publish_errors_total"),
            duplicates: metrics::counter!("meridian_publish_duplicates_total"),
            client_gone: false,
            last_error_logged: None,
        }
    }

    async fn write(&mut self, frame: bytes::Bytes) {
        if !self.client_gone && self.tx.send(frame).await.is_err() {
            self.client_gone = true;
        }
    }

    /// Awaits one send's outcome and answers it.
    async fn answer(&mut self, ps: PendingSend) {
        if ps.silent {
            return;
        }
        let (topic, handle, producer_id) = (
            Arc::clone(&self.topic),
            Arc::clone(&self.handle),
            self.producer_id,
        );
        let submitted = ps.submitted;
        let mut after_break = ps.after_break;
        let outcome = match ps.append {
            Ok(Submitted::Appended(pa, ticket)) => {
                let r = pa.wait().await.map_err(BrokerError::from);
                if r.is_err() {
                    after_break = true;
                    if crate::failpoint::hit("publish:slow_break_off") {
                        tokio::time::sleep(Duration::from_secs(15)).await;
                    }
                    // Later sends must wait for the client to send this one again.
                    handle.break_off();
                }
                if let (Some(d), Some(t)) = (&topic.dedup, ticket) {
                    d.record(t, r.as_ref().ok().copied()).await;
                }
                // After the producer was broken off and deduplication learnt the outcome: a
                // send waiting for this one then sees both.
                self.in_flight.answered();
                r.map(Some)
            }
            Ok(Submitted::Duplicate) => Ok(None),
            // Resolved in `submit`; never queued as such.
            Ok(Submitted::NotThere(_)) => Err(BrokerError::new(
                ServerError::PersistenceError,
                "the send was not stored; it is sent again after reconnecting",
            )),
            Err(e) => Err(e),
        };
        let refused = outcome.is_err();
        let reply = match outcome {
            Ok(Some(pos)) => {
                topic.on_appended(pos, ps.messages, ps.bytes);
                self.published.increment(ps.messages);
                self.published_bytes.increment(ps.bytes);
                self.publish_latency
                    .record(ps.received.elapsed().as_secs_f64());
                self.storage_latency
                    .record(submitted.elapsed().as_secs_f64());
                let mut c =
                    cmd::send_receipt(producer_id, ps.sequence_id, pos.ledger_id, pos.entry_id);
                if let Some(r) = c.send_receipt.as_mut() {
                    r.highest_sequence_id = ps.highest_sequence_id;
                }
                c
            }
            // A duplicate of a persisted message: acknowledged, at no position (as Pulsar).
            Ok(None) => {
                self.duplicates.increment(ps.messages);
                cmd::send_receipt(producer_id, ps.sequence_id, ID_NONE, ID_NONE)
            }
            Err(e) => {
                self.errors.increment(1);
                // At most one line a second per producer: a failing topic can refuse many
                // sends.
                if self
                    .last_error_logged
                    .is_none_or(|t: Instant| t.elapsed() >= Duration::from_secs(1))
                {
                    self.last_error_logged = Some(Instant::now());
                    tracing::warn!(topic = %topic.name, producer_id, code = ?e.code, error = %e.message, "send refused");
                }
                cmd::send_error(producer_id, ps.sequence_id, e.code, e.message)
            }
        };
        self.write(frame(&reply)).await;
        // The first refusal at or after the send that broke the producer off: every send
        // before it is answered now, so the client has taken their receipts before it
        // reconnects. (A refusal for another reason, submitted before the break, is not.)
        if refused && after_break && handle.take_break_notice() {
            self.write(handle.close_frame()).await;
        }
    }
}
