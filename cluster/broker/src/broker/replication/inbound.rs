//! Peers' entries into a topic, many frames in flight: each stream's frames are checked and
//! their appends queued in order; one completer per topic waits for them in the order they
//! were queued (every stream's together) and records what landed.
//!
//! ```text
//!  stream (origin west) ─submit─► order lock: drop what is held or queued, check, queue the
//!  stream (origin north) ─submit─►   appends (in the ledger of those in flight, else after
//!                                    waiting for them) ─► Job ─► completer (one per topic):
//!                                    wait for each append, observe origins, snapshot, reply
//! ```
//!
//! No run of appends lands with a hole in it: while appends are in flight they go to the same
//! ledger (`append_queued_in`), whose writer fails whole, so when one fails every later one
//! fails too; the log moves to another ledger only once everything before has completed. And
//! origins are observed in log order, so the snapshot's position never passes an entry whose
//! origin is not in it. A stream opened while another's frames are in flight waits for them
//! before it says what it holds.
//!
//! On a deduplicating topic each entry is checked by its producer's ids first (under the
//! deduplication lock, which is also held while it is queued, so tickets follow the log):
//! one whose ids are all held here already is not appended but its origin position is
//! recorded as held (a producer that moved here resent it: see `dedup::held`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use futures::future::BoxFuture;
use meridian_geo::frame::{OriginPosition, RefusalCode, ReplicatedEntry};
use meridian_geo::inflow::{EntryBuild, EntryShaper};
use meridian_geo::receiver::{Durable, Refusal, ReplicaTopic};
use meridian_protocol::pb::MeridianOrigin;
use meridian_protocol::replica_form::ReplicaForm;
use meridian_protocol::Entry;
use meridian_storage::managed_ledger::{ManagedLedgerError, PendingAppend, Position};
use tokio::sync::{mpsc, oneshot, watch};

use crate::broker::dedup::{self, EntrySequence, ReplicaCheck, ReplicaGuard, Ticket};

use super::{append_refusal, refusal, Topic, ORIGINS_ADVANCE_EVERY, ORIGINS_SAVE_EVERY};

/// A topic's receiving order: frames queued and completed.
pub struct Inbound {
    order: tokio::sync::Mutex<Order>,
    /// Frames completed (well or not), in the order they were queued.
    done: watch::Sender<u64>,
}

#[derive(Default)]
struct Order {
    /// Frames queued so far.
    queued: u64,
    /// The ledger the appends in flight went to.
    ledger: Option<u64>,
    /// To the topic's completer (started with the first frame, again if it ended).
    jobs: Option<mpsc::UnboundedSender<Job>>,
    /// Per origin site, the stream opened last: an older stream from there queues nothing
    /// more (it and the new one would both append what the new one was told is missing).
    epochs: std::collections::HashMap<String, u64>,
}

impl Default for Inbound {
    fn default() -> Self {
        Inbound {
            order: tokio::sync::Mutex::new(Order::default()),
            done: watch::channel(0).0,
        }
    }
}

/// One entry of a frame: its append, or its outcome when it was waited for already, or
/// not appended because the topic holds its producer's ids already.
enum Step {
    Queued(PendingAppend),
    Landed(Result<Position, ManagedLedgerError>),
    Held,
}

struct Appended {
    step: Step,
    at: OriginPosition,
    messages: u64,
    bytes: u64,
    /// Its place in the topic's deduplication (recorded once it landed or failed).
    ticket: Option<Ticket>,
}

/// A checked entry of a frame: the entry, its origin position, its messages, and its
/// producer's ids where the topic deduplicates.
type Checked = (Entry, OriginPosition, u64, Option<EntrySequence>);

/// A frame for the completer.
struct Job {
    seq: u64,
    origin: String,
    entries: Vec<Appended>,
    /// Why the rest of the frame was not queued.
    stopped: Option<Refusal>,
    /// The stream's: set when this frame fails, so it takes no more.
    failed: Arc<AtomicBool>,
    reply: oneshot::Sender<Result<Option<OriginPosition>, Refusal>>,
}

impl Inbound {
    /// Waits until every frame queued so far has completed.
    async fn drained(&self, order: &Order) {
        let mut rx = self.done.subscribe();
        let _ = rx.wait_for(|d| *d >= order.queued).await;
    }
}

impl Topic {
    /// Opens a stream from `origin`: once no frame of any stream is in flight, the highest
    /// origin position held from there (what the sender is told), and the stream's epoch
    /// (streams from there opened before it take nothing more).
    pub(super) async fn held_from(
        &self,
        origin: &str,
    ) -> Result<(Option<OriginPosition>, u64), Refusal> {
        let mut order = self.repl_inbound.order.lock().await;
        self.repl_inbound.drained(&order).await;
        let held = {
            let mut g = self.repl_origins.lock().await;
            self.origins(&mut g).await?.highest(origin)
        };
        // Only once it is known: an open that fails retires no stream.
        let e = order.epochs.entry(origin.to_string()).or_default();
        *e += 1;
        Ok((held, *e))
    }

    /// The highest origin position durably held from `origin` (nothing else changes).
    pub(in crate::broker) async fn held_origin(
        &self,
        origin: &str,
    ) -> Result<Option<OriginPosition>, Refusal> {
        let mut g = self.repl_origins.lock().await;
        Ok(self.origins(&mut g).await?.highest(origin))
    }

    /// The policy beat's: writes the origins snapshot if it changed since it was last
    /// written (a burst's last frames, which the 250 ms spacing skipped). With every frame
    /// queued so far completed and recorded (the receiving order held, so none starts), no
    /// frame ever landing after a failed one (`hole`), and the topic still receiving (not
    /// closed by a deletion or a failed completer), every entry received by replication is in
    /// the origins, so the snapshot is moved to the log's end: what was produced here
    /// meanwhile is not replayed by the next load. A topic busy receiving is passed over.
    pub(in crate::broker) async fn flush_origins(&self) {
        let Ok(order) = self.repl_inbound.order.try_lock() else {
            return;
        };
        let Ok(mut g) = self.repl_origins.try_lock() else {
            return;
        };
        let Some(o) = g.as_mut() else {
            return;
        };
        if self.repl_closed.load(Ordering::Acquire) {
            return;
        }
        // A failed completer sets `done` past every count: equal means all were recorded.
        let idle = *self.repl_inbound.done.borrow() == order.queued && !o.hole;
        let mut due = o.dirty;
        if let Some(last) = self.ml.last_confirmed().filter(|_| idle) {
            let behind = o
                .snap
                .at
                .is_none_or(|a| a < (last.ledger_id, last.entry_id));
            if behind
                && o.saved_at
                    .is_none_or(|s| s.elapsed() >= ORIGINS_ADVANCE_EVERY)
            {
                o.through(last);
                due = true;
            }
        }
        drop(order);
        if due {
            self.save_origins(o).await;
        }
    }
}

/// A topic open for one origin site's entries (one stream).
pub(super) struct Incoming(Arc<Stream>);

struct Stream {
    topic: Arc<Topic>,
    origin: String,
    epoch: u64,
    /// The highest origin position held or queued from this stream.
    queued_high: tokio::sync::Mutex<Option<OriginPosition>>,
    /// A frame of this stream failed, or was refused: it takes no more.
    failed: Arc<AtomicBool>,
}

impl Incoming {
    pub(super) fn new(
        topic: Arc<Topic>,
        origin: &str,
        held: Option<OriginPosition>,
        epoch: u64,
    ) -> Self {
        Incoming(Arc::new(Stream {
            topic,
            origin: origin.to_string(),
            epoch,
            queued_high: tokio::sync::Mutex::new(held),
            failed: Arc::new(AtomicBool::new(false)),
        }))
    }
}

impl Stream {
    /// The entries after `held` (each already in its stored form, marked with its origin and
    /// its checksum checked as its bytes came: [`OriginShaper`]), in order, with their
    /// message counts.
    fn check(
        &self,
        entries: Vec<ReplicatedEntry>,
        held: Option<OriginPosition>,
    ) -> Result<Vec<Checked>, Refusal> {
        // Ids are read only where replicated entries are checked (not where a topic
        // deduplicates by the broker's default alone): a second parse of every entry otherwise.
        let dedup = self.topic.dedup.as_ref().is_some_and(|d| d.cross_site());
        let mut checked = Vec::new();
        let mut before = held;
        for item in entries {
            if held.is_some_and(|h| item.at <= h) {
                continue; // already held or queued: a range sent again
            }
            let bad = |why: &str| {
                refusal(
                    RefusalCode::Protocol,
                    format!(
                        "entry {}:{} of site {} {why}",
                        item.at.ledger, item.at.entry, self.origin
                    ),
                )
            };
            if before.is_some_and(|b| item.at <= b) {
                return Err(bad("is not after the entry before it"));
            }
            before = Some(item.at);
            let stored = Entry::parse(item.bytes).map_err(|e| bad(&e.to_string()))?;
            let meta = stored.metadata().map_err(|e| bad(&e.to_string()))?;
            let marked = MeridianOrigin {
                site: self.origin.clone(),
                ledger_id: item.at.ledger,
                entry_id: item.at.entry,
            };
            if meta.meridian_origin.as_ref() != Some(&marked) {
                return Err(bad("is not marked with its origin"));
            }
            let messages = u64::from(meridian_protocol::entry::message_count(&meta));
            let seq = dedup.then(|| dedup::entry_sequence(&stored)).flatten();
            checked.push((stored, item.at, messages, seq));
        }
        Ok(checked)
    }

    /// Refuses the stream from now on, with `r`.
    fn fail(&self, r: Refusal) -> Refusal {
        self.failed.store(true, Ordering::Release);
        r
    }

    /// Queues a frame's appends and hands it to the completer (see the module's comment).
    async fn submit(&self, entries: Vec<ReplicatedEntry>) -> Result<Durable, Refusal> {
        let t = &self.topic;
        if t.repl_closed.load(Ordering::Acquire) {
            return Err(refusal(
                RefusalCode::Retry,
                format!("{} is no longer served here", t.full_name),
            ));
        }
        let failed_before = || {
            refusal(
                RefusalCode::Retry,
                "an earlier frame of this stream was not appended",
            )
        };
        if self.failed.load(Ordering::Acquire) {
            return Err(failed_before());
        }
        let mut high = self.queued_high.lock().await;
        // Every entry is checked before any is queued: a bad one refuses the frame whole
        // (and the stream: what comes after it would pass the entries it lacks).
        let checked = self.check(entries, *high).map_err(|r| self.fail(r))?;
        let inbound = &t.repl_inbound;
        let mut order = inbound.order.lock().await;
        if order.epochs.get(&self.origin) != Some(&self.epoch) {
            return Err(self.fail(refusal(
                RefusalCode::Retry,
                format!(
                    "a newer stream from {} took {} over",
                    self.origin, t.full_name
                ),
            )));
        }
        // Again under the order lock: an earlier frame of this stream may have failed while
        // this one waited for it (another stream's drain let the log move on meanwhile).
        if self.failed.load(Ordering::Acquire) {
            return Err(failed_before());
        }
        let mut appended: Vec<Appended> = Vec::with_capacity(checked.len());
        let mut stopped = None;
        for (stored, at, messages, seq) in checked {
            let bytes = stored.as_bytes().len() as u64;
            let payload = stored.into_bytes();
            let in_flight = *inbound.done.borrow() < order.queued || !appended.is_empty();
            let held = |step| Appended {
                step,
                at,
                messages,
                bytes,
                ticket: None,
            };
            let mut guard = replica_guard(t, &seq).await;
            match replica_check(&guard, &seq) {
                ReplicaCheck::Held => {
                    appended.push(held(Step::Held));
                    *high = Some(at);
                    continue;
                }
                ReplicaCheck::Busy(why) => {
                    stopped = Some(refusal(RefusalCode::Retry, why));
                    break;
                }
                ReplicaCheck::Fresh => {}
            }
            let mut queued = match order.ledger.filter(|_| in_flight) {
                Some(l) => t.ml.append_queued_in(payload.clone(), l).await,
                None => Ok(None),
            };
            if matches!(queued, Ok(None)) {
                // The log may move on (a roll-over, a failed ledger, nothing in flight): only
                // once everything queued before has landed, and none of this stream failed.
                // The completer records what landed under the deduplication lock: let it go.
                drop(guard.take());
                inbound.drained(&order).await;
                let mut failed = false;
                for a in &mut appended {
                    let step =
                        std::mem::replace(&mut a.step, Step::Landed(Ok(Position::new(0, 0))));
                    a.step = match step {
                        Step::Queued(p) => Step::Landed(p.wait().await),
                        landed => landed,
                    };
                    failed |= matches!(a.step, Step::Landed(Err(_)));
                }
                if failed {
                    self.failed.store(true, Ordering::Release);
                    break; // the completer reports it
                }
                if self.failed.load(Ordering::Acquire) {
                    stopped = Some(failed_before());
                    break;
                }
                // The next ledger is made (writable bookies awaited) without the lock, which
                // sends and receipts need meanwhile; its failure is the append's to report.
                let _ = t.ml.make_writable(None).await;
                // Checked again: a send here may have stored the ids meanwhile.
                guard = replica_guard(t, &seq).await;
                match replica_check(&guard, &seq) {
                    ReplicaCheck::Held => {
                        appended.push(held(Step::Held));
                        *high = Some(at);
                        continue;
                    }
                    ReplicaCheck::Busy(why) => {
                        stopped = Some(refusal(RefusalCode::Retry, why));
                        break;
                    }
                    ReplicaCheck::Fresh => {}
                }
                queued = t.ml.append_queued(payload).await.map(Some);
            }
            match queued {
                Ok(Some(p)) => {
                    order.ledger = Some(p.ledger_id());
                    let ticket = guard.as_mut().zip(seq).and_then(|(g, s)| g.ticket(s));
                    drop(guard);
                    appended.push(Appended {
                        ticket,
                        ..held(Step::Queued(p))
                    });
                    *high = Some(at);
                }
                Ok(None) => unreachable!("queued anywhere"),
                Err(e) => {
                    stopped = Some(append_refusal(e));
                    break;
                }
            }
        }
        if stopped.is_some() {
            self.failed.store(true, Ordering::Release);
        }
        let seq = order.queued + 1;
        let (reply, answer) = oneshot::channel();
        let mut job = Job {
            seq,
            origin: self.origin.clone(),
            entries: appended,
            stopped,
            failed: Arc::clone(&self.failed),
            reply,
        };
        // A completer that ended (it cannot, short of a panic) is started again.
        loop {
            let jobs = order.jobs.get_or_insert_with(|| {
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(complete(Arc::downgrade(t), rx));
                tx
            });
            match jobs.send(job) {
                Ok(()) => break,
                Err(mpsc::error::SendError(back)) => {
                    tracing::warn!(topic = %t.full_name, "the receiving completer ended; starting it again");
                    order.jobs = None;
                    job = back;
                }
            }
        }
        order.queued = seq;
        let durable: Durable = Box::pin(async move {
            answer
                .await
                .unwrap_or_else(|_| Err(refusal(RefusalCode::Retry, "the topic is closing")))
        });
        Ok(durable)
    }
}

/// The topic's deduplication state, held, when it deduplicates and `seq` has ids to check.
async fn replica_guard<'a>(t: &'a Topic, seq: &Option<EntrySequence>) -> Option<ReplicaGuard<'a>> {
    match (&t.dedup, seq) {
        (Some(d), Some(_)) => d.replica().await,
        _ => None,
    }
}

fn replica_check(guard: &Option<ReplicaGuard<'_>>, seq: &Option<EntrySequence>) -> ReplicaCheck {
    match (guard, seq) {
        (Some(g), Some(s)) => g.check(s),
        _ => ReplicaCheck::Fresh,
    }
}

/// A stream's entries made into their stored form as their bytes come: marked with the
/// stream's origin site and their origin position, their checksum checked, an entry that
/// already names an origin refused (see `meridian_protocol::replica_form`).
struct OriginShaper {
    site: String,
}

struct OriginBuild(ReplicaForm);

impl EntryShaper for OriginShaper {
    fn begin(&self, at: OriginPosition, len: usize) -> Box<dyn EntryBuild> {
        let origin = MeridianOrigin {
            site: self.site.clone(),
            ledger_id: at.ledger,
            entry_id: at.entry,
        };
        Box::new(OriginBuild(ReplicaForm::new(origin, len)))
    }
}

impl EntryBuild for OriginBuild {
    fn push(&mut self, piece: &[u8]) -> Result<(), String> {
        self.0.push(piece).map_err(|e| e.0)
    }

    fn finish(self: Box<Self>) -> Result<bytes::Bytes, String> {
        self.0.finish().map(Entry::into_bytes).map_err(|e| e.0)
    }
}

impl ReplicaTopic for Incoming {
    fn shaper(&self) -> Arc<dyn EntryShaper> {
        Arc::new(OriginShaper {
            site: self.0.origin.clone(),
        })
    }

    fn submit(&self, entries: Vec<ReplicatedEntry>) -> BoxFuture<'_, Result<Durable, Refusal>> {
        // In a task of its own: once appends are queued, their frame reaches the completer
        // even if the stream goes away meanwhile (else they could land unrecorded).
        let stream = Arc::clone(&self.0);
        Box::pin(async move {
            tokio::spawn(async move { stream.submit(entries).await })
                .await
                .unwrap_or_else(|e| {
                    Err(refusal(
                        RefusalCode::Retry,
                        format!("receiving failed: {e}"),
                    ))
                })
        })
    }
}

/// The topic's completer: each frame in the order queued, its appends waited for, what landed
/// before any failure recorded, the frame answered.
async fn complete(topic: Weak<Topic>, mut jobs: mpsc::UnboundedReceiver<Job>) {
    let _guard = CompleterGuard(topic.clone());
    while let Some(job) = jobs.recv().await {
        let mut failure: Option<Refusal> = None;
        // An earlier frame of the stream failed: what it lacks may come before this one's
        // entries held already (not appended, they do not fail with the ledger), which then
        // must not carry the origin past the missing ones.
        let earlier_failed = job.failed.load(Ordering::Acquire);
        let mut landed = Vec::with_capacity(job.entries.len());
        for a in job.entries {
            let r = match a.step {
                Step::Queued(p) => Some(p.wait().await),
                Step::Landed(r) => Some(r),
                Step::Held => None,
            };
            if let Some(ticket) = a.ticket {
                let t = topic.upgrade();
                if let Some(d) = t.as_ref().and_then(|t| t.dedup.as_ref()) {
                    let pos = r.as_ref().and_then(|r| r.as_ref().ok()).copied();
                    d.record(ticket, pos).await;
                }
            }
            match r {
                Some(Ok(pos)) => {
                    landed.push((Some(pos), a.at, a.messages, a.bytes, failure.is_none()))
                }
                Some(Err(e)) => {
                    failure.get_or_insert(append_refusal(e));
                }
                None => landed.push((
                    None,
                    a.at,
                    a.messages,
                    a.bytes,
                    failure.is_none() && !earlier_failed,
                )),
            }
        }
        let failure = failure.or(job.stopped);
        let answer = match topic.upgrade() {
            None => Err(refusal(RefusalCode::Retry, "the topic is closing")),
            Some(t) => record(&t, &job.origin, &landed)
                .await
                .and_then(|high| match &failure {
                    Some(r) => Err(r.clone()),
                    None => Ok(high),
                }),
        };
        if answer.is_err() {
            job.failed.store(true, Ordering::Release);
        }
        if let Some(t) = topic.upgrade() {
            t.repl_inbound.done.send_replace(job.seq);
        }
        let _ = job.reply.send(answer);
    }
}

/// Should the completer end other than by its topic going (a bug: a panic), the topic takes
/// no more replicated entries until it is loaded again, and nothing waits for it for ever.
struct CompleterGuard(Weak<Topic>);

impl Drop for CompleterGuard {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        if let Some(t) = self.0.upgrade() {
            tracing::error!(topic = %t.full_name, "the receiving completer failed; the topic takes no replicated entries until it is loaded again");
            t.repl_closed.store(true, Ordering::Release);
            t.repl_inbound.done.send_replace(u64::MAX);
        }
    }
}

/// A frame's entry for [`record`]: where it landed (`None`: held already, not appended),
/// its origin position, messages, bytes, and whether it came before any failure.
type Landed = (Option<Position>, OriginPosition, u64, u64, bool);

/// Records a frame's landed entries (those before any failure) in the topic's origins: the
/// highest origin position held from `origin` now. When the frame's last is one held already
/// (not appended, so no replay of the log finds it), the origins are saved before the frame
/// is answered, or it is refused: the sender must not learn it is held before that is durable.
async fn record(
    t: &Topic,
    origin: &str,
    landed: &[Landed],
) -> Result<Option<OriginPosition>, Refusal> {
    let mut g = t.repl_origins.lock().await;
    let origins = t.origins(&mut g).await?;
    let mut last_local = None;
    let mut last_is_held = false;
    for &(pos, at, messages, bytes, before_failure) in landed {
        let Some(pos) = pos else {
            if before_failure {
                origins.observe(origin, at);
                origins.dirty = true;
                last_is_held = true;
                metrics::counter!("meridian_replication_duplicates_dropped_total")
                    .increment(messages);
            }
            continue;
        };
        t.on_appended(pos, messages, bytes);
        // Durable after an earlier one failed (none should: see the module's comment) is
        // not recorded: the highest position held must not pass an entry that is missing.
        if before_failure {
            origins.observe(origin, at);
            last_local = Some(pos);
            last_is_held = false;
        } else {
            // Its origin is not recorded: the snapshot must not be moved past it by the
            // beat (the next load's replay finds it).
            origins.hole = true;
        }
    }
    let mut due = false;
    if let Some(p) = last_local {
        origins.through(p);
        origins.dirty = true;
        due = origins
            .saved_at
            .is_none_or(|s| s.elapsed() >= ORIGINS_SAVE_EVERY);
    }
    if last_is_held {
        if !t.save_origins(origins).await {
            return Err(refusal(
                RefusalCode::Retry,
                "entries held here already could not be recorded as received",
            ));
        }
    } else if due {
        t.save_origins(origins).await;
    }
    Ok(origins.highest(origin))
}
