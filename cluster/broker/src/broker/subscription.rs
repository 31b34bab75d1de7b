//! A subscription: a cursor on the topic's log, its consumers, and a dispatcher task that
//! pushes entries to consumers holding permits.
//!
//! - Exclusive: one consumer; a second is refused with ConsumerBusy.
//! - Failover: many consumers, one active (lowest priority level, then name); the others
//!   are told with ACTIVE_CONSUMER_CHANGE and take over when it leaves.
//! - Shared: entries go round-robin to consumers that hold permits.
//! - Key_Shared: an entry goes to the consumer that owns its key's hash ([`super::key_shared`]).
//!   Unless the subscription allows out-of-order delivery, a hash is not given to a consumer
//!   while another still holds unacknowledged messages of it (a joining consumer gets a key
//!   only after the earlier messages of that key are acknowledged), and all candidates
//!   (stashed, redelivered, new) are taken in log order, so a key's messages go out in order.
//!
//! Delayed delivery (Shared and Key_Shared, as in Pulsar): an entry whose `deliver_at_time`
//! is in the future goes into the subscription's delay index (time, position) instead of to a
//! consumer, and is dispatched when due. The index is rebuilt from the log after a restart:
//! the time is in the stored entry and an undelivered message is never acknowledged, so the
//! cursor reads it again from its mark-delete position; nothing is lost or delivered early.
//!
//! Entries handed to a consumer and not yet acknowledged are pending on it; they are
//! dispatched again (redelivery count + 1) when it leaves or asks for redelivery. Permits
//! count messages: a batch entry costs its number of messages.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use meridian_protocol::pb::{self, ServerError};
use meridian_protocol::{cmd, encode_command, encode_message, Entry, ID_NONE};
use meridian_storage::cursor::{Backlog, InitialPosition, ManagedCursor};
use meridian_storage::ledger::LedgerClient;
use meridian_storage::managed_ledger::{ManagedLedger, Position};
use tokio::sync::{watch, Notify};

use super::key_shared::{self, KeySharedSpec, Selector};
use super::{BrokerError, Topic};
use crate::frame_queue::{FrameSender, TrySendError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubType {
    Exclusive,
    Shared,
    Failover,
    KeyShared,
}

impl SubType {
    pub fn from_wire(v: i32) -> Option<SubType> {
        use pb::command_subscribe::SubType as W;
        match W::try_from(v).ok()? {
            W::Exclusive => Some(SubType::Exclusive),
            W::Shared => Some(SubType::Shared),
            W::Failover => Some(SubType::Failover),
            W::KeyShared => Some(SubType::KeyShared),
        }
    }
}

/// Where a reader starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartAt {
    Initial(InitialPosition),
    /// Reading starts at this entry (a message id: the client skips what it has, the entry
    /// itself unless inclusive, a batch's messages before the index).
    At(Position),
    /// Reading starts at the first message published at or after this time, milliseconds
    /// (a reader's `start_message_rollback_duration_sec`).
    PublishTime(u64),
}

/// What SUBSCRIBE asked for, already validated.
#[derive(Debug, Clone)]
pub struct SubscribeRequest {
    pub subscription: String,
    pub sub_type: SubType,
    pub consumer_name: String,
    pub priority: i32,
    pub durable: bool,
    pub start: StartAt,
    /// Key_Shared consumers: mode, sticky ranges, out-of-order delivery.
    pub key_shared: Option<KeySharedSpec>,
    /// Subscription properties, recorded when the subscription is created.
    pub properties: std::collections::BTreeMap<String, String>,
    /// Read the topic's compacted view up to its horizon (Exclusive and Failover only).
    pub read_compacted: bool,
    /// The client asked for the subscription's acknowledgements to be replicated to the
    /// other sites of the topic (`replicate_subscription_state`).
    pub replicated: bool,
}

/// Where a consumer's frames go: its connection's writer, with the client's consumer id.
#[derive(Debug, Clone)]
pub struct ConsumerSink {
    pub connection_id: u64,
    pub consumer_id: u64,
    pub tx: FrameSender,
    /// The client handles REACHED_END_OF_TOPIC (the C++ client, and so Python, does not: it
    /// would drop the connection and reconnect, again and again).
    pub end_of_topic: bool,
}

type ConsumerKey = (u64, u64);

impl Consumer {
    /// Has permits and room in its connection's queue (else the dispatcher is woken when
    /// the queue drains).
    fn can_take(&self, wake: &Arc<Notify>) -> bool {
        self.permits > 0 && !self.blocked && self.sink.tx.has_room_or_wake(wake)
    }
}

struct Consumer {
    sink: ConsumerSink,
    /// Told the (terminated) topic is fully consumed.
    told_end: bool,
    name: String,
    priority: i32,
    permits: i64,
    /// Holds `broker.consumer_unacked_messages_max` unacknowledged messages: given nothing
    /// until it is back under half of that.
    blocked: bool,
}

impl Consumer {
    fn key(&self) -> ConsumerKey {
        (self.sink.connection_id, self.sink.consumer_id)
    }
}

struct State {
    cursor: ManagedCursor,
    /// Entries read but not yet handed out (no consumer had permits left), in dispatch order;
    /// they go before anything else next time, without reading them again.
    stash: std::collections::VecDeque<(Position, Bytes, u32)>,
    /// Messages per entry, as an exponential average: how many entries the permits cover.
    msgs_per_entry: f64,
    /// In attach order; for Failover the active one is chosen by priority, then name.
    consumers: Vec<Consumer>,
    /// Dispatched, not acknowledged: which consumer holds each entry.
    pending: BTreeMap<Position, ConsumerKey>,
    /// To dispatch again before new entries, with their redelivery counts.
    redeliver: BTreeMap<Position, u32>,
    redelivery_counts: HashMap<Position, u32>,
    /// Failover: the consumer told it is active.
    active: Option<ConsumerKey>,
    round_robin: usize,
    deleted: bool,
    /// Key_Shared: who owns which hash, and what the first consumer asked for.
    selector: Option<Selector>,
    key_shared: KeySharedSpec,
    /// Key_Shared: the hash of each pending entry, and per hash who holds how many.
    pending_hash: HashMap<Position, u16>,
    hash_holders: HashMap<u16, Vec<(ConsumerKey, u32)>>,
    /// Delayed delivery: (deliver at, ms since the epoch; position), earliest first.
    delayed: DelayIndex,
    /// Messages of each pending entry, and unacknowledged messages per consumer and in all.
    pending_msgs: HashMap<Position, u32>,
    unacked: HashMap<ConsumerKey, u64>,
    unacked_total: u64,
    /// Limits of unacknowledged messages (0: none), as Pulsar's
    /// `maxUnackedMessagesPerConsumer` and `...PerSubscription`.
    consumer_unacked_max: u64,
    subscription_unacked_max: u64,
    /// The subscription holds its limit: nobody is given anything until it is under half.
    blocked: bool,
    /// Entries read from the compacted view that it retains only some messages of: which
    /// (bit i = message i), until they are acknowledged.
    masks: BTreeMap<Position, Vec<u64>>,
}

/// Blocked at `max` (0: never), unblocked once under half of it.
fn still_blocked(blocked: bool, n: u64, max: u64) -> bool {
    max > 0 && (n >= max || (blocked && n >= max / 2))
}

impl State {
    /// After a change of `key`'s unacknowledged messages: who is blocked now.
    fn update_blocked(&mut self, key: ConsumerKey) {
        let n = self.unacked.get(&key).copied().unwrap_or(0);
        let max = self.consumer_unacked_max;
        if let Some(c) = self.consumers.iter_mut().find(|c| c.key() == key) {
            c.blocked = still_blocked(c.blocked, n, max);
        }
        self.blocked = still_blocked(
            self.blocked,
            self.unacked_total,
            self.subscription_unacked_max,
        );
    }

    /// Takes dispatched entries back from their consumer for dispatch again, counting a
    /// redelivery for each.
    fn requeue(&mut self, positions: Vec<Position>) {
        for p in positions {
            self.unpend(p);
            let n = self.redelivery_counts.entry(p).or_insert(0);
            *n += 1;
            let n = *n;
            self.redeliver.insert(p, n);
        }
    }

    /// Records a dispatched entry as pending on `key` (with its key hash on Key_Shared).
    fn pend(&mut self, pos: Position, key: ConsumerKey, hash: Option<u16>, messages: u32) {
        if let Some(old) = self.pending.insert(pos, key) {
            // Pending already (not expected): counted once.
            self.uncount(pos, old);
        }
        self.pending_msgs.insert(pos, messages);
        *self.unacked.entry(key).or_insert(0) += u64::from(messages);
        self.unacked_total += u64::from(messages);
        self.update_blocked(key);
        if let Some(h) = hash {
            self.pending_hash.insert(pos, h);
            let holders = self.hash_holders.entry(h).or_default();
            match holders.iter_mut().find(|(k, _)| *k == key) {
                Some((_, n)) => *n += 1,
                None => holders.push((key, 1)),
            }
        }
    }

    /// An entry is no longer pending (acknowledged, or taken back).
    fn unpend(&mut self, pos: Position) {
        let Some(key) = self.pending.remove(&pos) else {
            return;
        };
        self.uncount(pos, key);
        let Some(h) = self.pending_hash.remove(&pos) else {
            return;
        };
        if let Some(holders) = self.hash_holders.get_mut(&h) {
            if let Some(i) = holders.iter().position(|(k, _)| *k == key) {
                holders[i].1 -= 1;
                if holders[i].1 == 0 {
                    holders.swap_remove(i);
                }
            }
            if holders.is_empty() {
                self.hash_holders.remove(&h);
            }
        }
    }

    /// Takes a pending entry's messages off its consumer's and the subscription's counts.
    fn uncount(&mut self, pos: Position, key: ConsumerKey) {
        let m = u64::from(self.pending_msgs.remove(&pos).unwrap_or(0));
        if let Some(n) = self.unacked.get_mut(&key) {
            *n = n.saturating_sub(m);
            if *n == 0 {
                self.unacked.remove(&key);
            }
        }
        self.unacked_total = self.unacked_total.saturating_sub(m);
        self.update_blocked(key);
    }

    /// Forgets everything in flight (seek).
    fn clear_in_flight(&mut self) {
        self.stash.clear();
        self.pending.clear();
        self.pending_msgs.clear();
        self.unacked.clear();
        self.unacked_total = 0;
        self.blocked = false;
        for c in &mut self.consumers {
            c.blocked = false;
        }
        self.pending_hash.clear();
        self.hash_holders.clear();
        self.redeliver.clear();
        self.redelivery_counts.clear();
        self.delayed.clear();
        self.masks.clear();
    }

    /// Moves delayed entries that are due to the redelivery queue; returns when the next one
    /// is due (ms since the epoch).
    fn release_due(&mut self, now_ms: i64) -> Option<i64> {
        while let Some(&(at, p)) = self.delayed.first() {
            if at > now_ms {
                return Some(at);
            }
            self.delayed.pop_first();
            let n = self.redelivery_counts.get(&p).copied().unwrap_or(0);
            self.redeliver.insert(p, n);
        }
        None
    }

    /// Drops what is known about entries up to `pos` (acknowledged cumulatively).
    fn forget_through(&mut self, pos: Position) {
        let done: Vec<Position> = self.pending.range(..=pos).map(|(p, _)| *p).collect();
        for p in done {
            self.unpend(p);
            self.redelivery_counts.remove(&p);
        }
        let stale: Vec<Position> = self.redeliver.range(..=pos).map(|(p, _)| *p).collect();
        for p in stale {
            self.redeliver.remove(&p);
        }
        self.masks = self.masks.split_off(&Position::new(
            pos.ledger_id,
            pos.entry_id.saturating_add(1),
        ));
    }
}

pub struct Subscription {
    name: String,
    topic: Arc<Topic>,
    sub_type: SubType,
    durable: bool,
    /// Reads the topic's compacted view up to its horizon.
    read_compacted: bool,
    state: tokio::sync::Mutex<State>,
    /// Wakes the dispatcher (shared with connection queues that refused it for lack of room).
    wake: Arc<Notify>,
    closed: AtomicBool,
    stop: watch::Sender<bool>,
    /// Messages dispatched (counted per message of a batch), for stats.
    pub msgs_out: std::sync::atomic::AtomicU64,
    /// The subscription dispatch rate policy.
    pub limiter: super::rate::PolicyLimiter,
    /// Counts changes of the acknowledgement state (a replicated subscription's is sent to
    /// the other sites when it moved).
    pub(super) ack_version: AtomicU64,
    /// Message ids acknowledged (by consumers here or applied from other sites).
    pub(super) acks_total: AtomicU64,
    /// When recent `ack_version`s were reached (a version stands for the next ones within
    /// [`ACK_TIME_RESOLUTION`]): how long a replicated acknowledgement took to be confirmed.
    ack_times: std::sync::Mutex<std::collections::VecDeque<(u64, std::time::Instant)>>,
}

/// `ack_times` keeps a version per this interval at most ...
const ACK_TIME_RESOLUTION: Duration = Duration::from_millis(1);
/// ... and this many.
const ACK_TIMES_MAX: usize = 4096;

/// A subscription's figures, as the stats and the admin API show them.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SubscriptionStats {
    pub name: String,
    pub sub_type: String,
    pub durable: bool,
    pub consumers: usize,
    pub msg_rate_out: f64,
    pub msgs_out_total: u64,
    pub backlog_entries: u64,
    pub backlog_bytes: u64,
    pub unacked_entries: usize,
    /// Entries waiting in the delay index for their delivery time.
    pub delayed_entries: usize,
    /// The subscription's properties (given by the client that created it).
    pub properties: std::collections::BTreeMap<String, String>,
    /// Its acknowledgements are replicated to the topic's other sites.
    pub replicated: bool,
    /// Per remote site, what of them is not confirmed there yet.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub sync: Vec<super::replication::subs::SubSyncStats>,
}

/// A subscription's cursor, for `topics stats-internal`.
#[derive(Debug, Clone)]
pub struct CursorInternalStats {
    pub name: String,
    pub durable: bool,
    pub mark_delete: Option<Position>,
    pub read_position: Option<Position>,
    pub acknowledged_ranges: Vec<(Position, Position)>,
    pub cursor_ledger: Option<u64>,
    pub backlog_entries: u64,
    pub unacked_entries: usize,
    pub consumers: usize,
}

/// A subscription's delayed messages: (deliver at, ms since the epoch; position), earliest
/// first. Its memory per message is measured by `cargo bench -p meridian-broker --bench
/// delay_index`.
pub type DelayIndex = std::collections::BTreeSet<(i64, Position)>;

/// Key_Shared reads ahead of what it can hand out by at most this many dispatch batches
/// (`broker.dispatch_batch_entries_max` entries each); then a consumer that does not take its
/// keys' messages holds the others up, as in Pulsar.
const KEY_SHARED_LOOKAHEAD_BATCHES: usize = 10;

/// Wall-clock milliseconds since the epoch (the clock `deliver_at_time` is in).
fn now_ms() -> i64 {
    super::now_ms() as i64
}

/// How long after a failed flush of a cursor the dispatch loop tries again.
const FLUSH_RETRY: Duration = Duration::from_secs(1);

/// Keeps the first failure of a cursor change in `first` (the cursor took the change in
/// memory and persists it later).
fn kept_first(
    first: &mut Option<BrokerError>,
    r: Result<impl Sized, meridian_storage::cursor::CursorError>,
) {
    if let Err(e) = r {
        first.get_or_insert(e.into());
    }
}

/// The entry after the mark-delete position: where a subscription's unacknowledged entries
/// start (some later ones may be acknowledged individually).
async fn first_after_mark_delete(st: &State, ml: &ManagedLedger) -> Option<Position> {
    match st.cursor.mark_delete() {
        Some(md) => ml.next_position(md).await,
        None => ml.first_position().await,
    }
}

fn cursor_name(subscription: &str) -> String {
    crate::topic_name::escape(subscription)
}

/// Tells consumers they are closed (outside the subscription's lock). A control frame queued
/// whatever the connection's queue holds: it must not be dropped, and a client that stopped
/// reading must not hold up the unload, deletion or reset that closes its consumers.
fn close_consumers(sinks: Vec<ConsumerSink>) {
    for sink in sinks {
        let _ = sink
            .tx
            .send_now(frame(&cmd::close_consumer(sink.consumer_id, 0)));
    }
}

fn frame(cmd: &pb::BaseCommand) -> Bytes {
    let mut b = BytesMut::new();
    encode_command(&mut b, cmd);
    b.freeze()
}

impl Subscription {
    pub(super) async fn open(
        topic: Arc<Topic>,
        req: &SubscribeRequest,
        client: LedgerClient,
        appended: watch::Receiver<Option<Position>>,
    ) -> Result<Arc<Subscription>, BrokerError> {
        let ml = Arc::clone(&topic.ml);
        let initial = match req.start {
            StartAt::Initial(i) => i,
            _ => InitialPosition::Latest,
        };
        let mut cursor = if req.durable {
            ManagedCursor::open_with_properties(
                client,
                ml,
                &cursor_name(&req.subscription),
                initial,
                req.properties.clone(),
            )
            .await?
        } else {
            ManagedCursor::non_durable(ml, initial).await
        };
        if !req.durable {
            match req.start {
                StartAt::Initial(_) => {}
                StartAt::At(p) => cursor.reset_to_position(p).await?,
                StartAt::PublishTime(t) => {
                    cursor
                        .reset_to_time(t, |b| {
                            Entry::parse(b.clone())
                                .ok()
                                .and_then(|e| e.metadata().ok())
                                .map_or(0, |m| m.publish_time)
                        })
                        .await?
                }
            }
        }
        cursor.set_persist_interval(Duration::from_millis(topic.cfg.cursor_persist_interval_ms));
        let (stop, stop_rx) = watch::channel(false);
        let consumer_unacked_max = topic.cfg.consumer_unacked_messages_max;
        let subscription_unacked_max = topic.cfg.subscription_unacked_messages_max;
        let sub = Arc::new(Subscription {
            name: req.subscription.clone(),
            topic,
            sub_type: req.sub_type,
            durable: req.durable,
            read_compacted: req.read_compacted,
            state: tokio::sync::Mutex::new(State {
                cursor,
                stash: std::collections::VecDeque::new(),
                msgs_per_entry: 1.0,
                consumers: Vec::new(),
                pending: BTreeMap::new(),
                redeliver: BTreeMap::new(),
                redelivery_counts: HashMap::new(),
                active: None,
                round_robin: 0,
                deleted: false,
                selector: None,
                key_shared: KeySharedSpec::default(),
                pending_hash: HashMap::new(),
                hash_holders: HashMap::new(),
                delayed: DelayIndex::new(),
                pending_msgs: HashMap::new(),
                unacked: HashMap::new(),
                unacked_total: 0,
                consumer_unacked_max,
                subscription_unacked_max,
                blocked: false,
                masks: BTreeMap::new(),
            }),
            wake: Arc::new(Notify::new()),
            closed: AtomicBool::new(false),
            stop,
            msgs_out: std::sync::atomic::AtomicU64::new(0),
            limiter: super::rate::PolicyLimiter::default(),
            ack_version: AtomicU64::new(0),
            acks_total: AtomicU64::new(0),
            ack_times: Default::default(),
        });
        sub.limiter.update(
            sub.topic
                .policies
                .lock()
                .expect("policies lock")
                .subscription_dispatch_rate
                .as_ref(),
        );
        tokio::spawn(Arc::clone(&sub).dispatch_loop(appended, stop_rx));
        Ok(sub)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Makes the dispatcher look again (the topic changed state).
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    pub fn sub_type(&self) -> SubType {
        self.sub_type
    }

    pub fn is_durable(&self) -> bool {
        self.durable
    }

    /// Reads the compacted view (`read_compacted`).
    pub fn reads_compacted(&self) -> bool {
        self.read_compacted
    }

    /// The broker's own subscription of topic compaction.
    pub fn is_compaction(&self) -> bool {
        self.name == super::compaction::COMPACTION_SUBSCRIPTION
    }

    /// Acknowledges everything through `pos` and persists the cursor at once.
    pub async fn ack_through(&self, pos: Position) -> Result<(), BrokerError> {
        let mut st = self.state.lock().await;
        st.cursor.ack_cumulative(pos).await?;
        st.forget_through(pos);
        st.cursor.flush().await?;
        self.acks_changed();
        Ok(())
    }

    /// The acknowledgement state changed.
    fn acks_changed(&self) {
        let v = self.ack_version.fetch_add(1, Ordering::AcqRel) + 1;
        let now = std::time::Instant::now();
        let mut times = self.ack_times.lock().expect("ack times lock");
        if times
            .back()
            .is_none_or(|(_, t)| now.duration_since(*t) >= ACK_TIME_RESOLUTION)
        {
            if times.len() >= ACK_TIMES_MAX {
                times.pop_front();
            }
            times.push_back((v, now));
        }
    }

    /// When the first change after version `after` was made (to the resolution kept; the
    /// oldest kept when it is older than that).
    pub(super) fn changed_after(&self, after: u64) -> Option<std::time::Instant> {
        let times = self.ack_times.lock().expect("ack times lock");
        // The entry that stands for `after + 1`: the last at or before it.
        let i = times.partition_point(|(v, _)| *v <= after + 1);
        times.get(i.saturating_sub(1)).map(|(_, t)| *t)
    }

    /// The acknowledgement state: mark-delete position, ranges acknowledged beyond it, and
    /// batches partly acknowledged (bit i set: message i still unacknowledged).
    #[allow(clippy::type_complexity)]
    pub(super) async fn ack_state(
        &self,
    ) -> (
        Option<Position>,
        Vec<(Position, Position)>,
        Vec<(Position, Vec<u64>)>,
    ) {
        let st = self.state.lock().await;
        (
            st.cursor.mark_delete(),
            st.cursor.acknowledged_ranges(),
            st.cursor.batch_acks(),
        )
    }

    /// Messages of the entry at `pos` (`messages` of them) not acknowledged here, or of those
    /// that `other_unacked` (a batch's bits: set = unacknowledged there) says are
    /// acknowledged elsewhere, those not acknowledged here.
    pub(super) async fn unacked_messages(
        &self,
        pos: Position,
        messages: u64,
        other_unacked: Option<&[u64]>,
    ) -> u64 {
        let st = self.state.lock().await;
        if st.cursor.is_acknowledged(pos) {
            return 0;
        }
        let mine = st.cursor.batch_ack_set(pos);
        (0..messages)
            .filter(|i| {
                let (w, b) = ((i / 64) as usize, i % 64);
                let here = mine.is_none_or(|m| m.get(w).is_some_and(|x| x >> b & 1 == 1));
                let there = other_unacked.is_none_or(|o| o.get(w).is_none_or(|x| x >> b & 1 == 0));
                here && there
            })
            .count() as u64
    }

    /// Applies acknowledgements made at another site (a replicated subscription's): entries
    /// acknowledged whole, and batches partly (bit i set: message i still unacknowledged).
    /// Returns how many entries this acknowledged or changed.
    pub(super) async fn apply_remote(
        &self,
        whole: &[Position],
        partial: &[(Position, Vec<u64>)],
    ) -> Result<u64, BrokerError> {
        let mut st = self.state.lock().await;
        if st.deleted {
            // Deleted while another site's state was being read for it: nothing to apply to.
            return Ok(0);
        }
        let mut changed = 0u64;
        let mut done = Vec::new();
        // As in `ack`: what the cursor took but could not persist stays taken, and the rest
        // is applied too; the flush below persists it all or answers the failure.
        for p in whole {
            if !st.cursor.is_acknowledged(*p) {
                let _unpersisted = st.cursor.ack(*p).await;
                done.push(*p);
            }
        }
        for (p, bits) in partial {
            if st.cursor.is_acknowledged(*p) {
                continue;
            }
            let before = st.cursor.batch_ack_set(*p).map(<[u64]>::to_vec);
            let whole_now = match st.cursor.ack_batch_index(*p, bits).await {
                Ok(done) => done,
                Err(_unpersisted) => st.cursor.is_acknowledged(*p),
            };
            if whole_now {
                done.push(*p);
            } else if st.cursor.batch_ack_set(*p).map(<[u64]>::to_vec) != before {
                changed += 1;
            }
        }
        for p in &done {
            st.unpend(*p);
            st.redeliver.remove(p);
            st.redelivery_counts.remove(p);
            st.masks.remove(p);
        }
        changed += done.len() as u64;
        let flushed = if changed > 0 || st.cursor.is_dirty() {
            // Durable before the sending site is told they are applied (also what an earlier
            // attempt took but could not persist: it is not "changed" when sent again).
            st.cursor.flush().await
        } else {
            Ok(())
        };
        drop(st);
        if changed > 0 || flushed.is_err() {
            self.acks_changed();
            self.acks_total.fetch_add(changed, Ordering::Relaxed);
            // Also the flush timer for what the flush could not persist.
            self.wake.notify_one();
        }
        flushed?;
        Ok(changed)
    }

    /// The last message id as this subscription's consumers see the topic: for a compacted
    /// reader whose view covers the whole log, the view's last retained message (none if it
    /// retained nothing), so that "has a message available" does not wait for a message
    /// compaction removed.
    pub async fn last_message_id(&self) -> Option<(Position, i32)> {
        if let Some(v) =
            self.topic.compaction.view().filter(|v| {
                self.read_compacted && Some(v.horizon) == self.topic.ml.last_confirmed()
            })
        {
            let last = v.entries.checked_sub(1)?;
            if let Ok(e) = v.read(last).await {
                let index = match &e.mask {
                    Some(m) => m
                        .iter()
                        .enumerate()
                        .rev()
                        .find(|(_, w)| **w != 0)
                        .map_or(-1, |(i, w)| {
                            (i * 64 + 63 - w.leading_zeros() as usize) as i32
                        }),
                    None => Entry::parse(e.bytes)
                        .ok()
                        .and_then(|en| en.metadata().ok())
                        .and_then(|m| m.num_messages_in_batch)
                        .map_or(-1, |n| n.max(1) - 1),
                };
                return Some((e.position, index));
            }
        }
        self.topic.last_message_id().await
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    pub(super) async fn add_consumer(
        &self,
        req: &SubscribeRequest,
        sink: ConsumerSink,
    ) -> Result<(), BrokerError> {
        let mut st = self.state.lock().await;
        if st.deleted {
            return Err(BrokerError::new(
                ServerError::SubscriptionNotFound,
                format!("subscription {} was deleted", self.name),
            ));
        }
        if req.read_compacted != self.read_compacted && !st.consumers.is_empty() {
            return Err(BrokerError::new(
                ServerError::ConsumerBusy,
                format!(
                    "subscription {}'s consumers {} the compacted view; refused one that asked otherwise",
                    self.name,
                    if self.read_compacted { "read" } else { "do not read" }
                ),
            ));
        }
        if req.sub_type != self.sub_type && !st.consumers.is_empty() {
            return Err(BrokerError::new(
                ServerError::ConsumerBusy,
                format!(
                    "subscription {} is {:?}; refused a {:?} consumer",
                    self.name, self.sub_type, req.sub_type
                ),
            ));
        }
        if self.sub_type == SubType::Exclusive && !st.consumers.is_empty() {
            return Err(BrokerError::new(
                ServerError::ConsumerBusy,
                format!(
                    "exclusive subscription {} already has a consumer",
                    self.name
                ),
            ));
        }
        if self.sub_type == SubType::KeyShared {
            let spec = req.key_shared.clone().unwrap_or_default();
            if st.consumers.is_empty() {
                st.selector = Some(Selector::new(spec.sticky));
                st.key_shared = spec.clone();
            } else if (spec.sticky, spec.allow_out_of_order)
                != (st.key_shared.sticky, st.key_shared.allow_out_of_order)
            {
                return Err(BrokerError::new(
                    ServerError::ConsumerAssignError,
                    format!(
                        "Key_Shared subscription {} is {} (out-of-order delivery {}); the consumer asked otherwise",
                        self.name,
                        if st.key_shared.sticky { "sticky" } else { "auto-split" },
                        st.key_shared.allow_out_of_order
                    ),
                ));
            }
            let key = (sink.connection_id, sink.consumer_id);
            let sel = st
                .selector
                .get_or_insert_with(|| Selector::new(spec.sticky));
            sel.add(key, &req.consumer_name, &spec.ranges)
                .map_err(|e| BrokerError::new(ServerError::ConsumerAssignError, e))?;
        }
        st.consumers.push(Consumer {
            sink,
            told_end: false,
            name: req.consumer_name.clone(),
            priority: req.priority,
            permits: 0,
            blocked: false,
        });
        if self.sub_type == SubType::Failover {
            self.choose_active(&mut st).await;
        }
        Ok(())
    }

    /// Failover: the consumers in order of priority level, then name; the active one is the
    /// first, or for partition i of a partitioned topic the (i mod n)-th, as Pulsar, so a
    /// partitioned topic's partitions spread over the consumers. When it changes, everyone
    /// is told, and what the previous one held is redelivered.
    async fn choose_active(&self, st: &mut State) {
        let mut order: Vec<&Consumer> = st.consumers.iter().collect();
        order.sort_by(|a, b| (a.priority, &a.name, a.key()).cmp(&(b.priority, &b.name, b.key())));
        let at = match self.topic.name.partition() {
            Some(i) if !order.is_empty() => i as usize % order.len(),
            _ => 0,
        };
        let best = order.get(at).map(|c| c.key());
        if best == st.active {
            // A newcomer that is not active still needs to know it.
            if let Some(c) = st.consumers.last() {
                if Some(c.key()) != best {
                    let _ = c.sink.tx.send_now(frame(&cmd::active_consumer_change(
                        c.sink.consumer_id,
                        false,
                    )));
                }
            }
            return;
        }
        if let Some(prev) = st.active {
            let held: Vec<Position> = st
                .pending
                .iter()
                .filter(|(_, k)| **k == prev)
                .map(|(p, _)| *p)
                .collect();
            for p in held {
                st.unpend(p);
                st.redeliver
                    .insert(p, st.redelivery_counts.get(&p).copied().unwrap_or(0));
            }
        }
        st.active = best;
        for c in &st.consumers {
            let _ = c.sink.tx.send_now(frame(&cmd::active_consumer_change(
                c.sink.consumer_id,
                Some(c.key()) == best,
            )));
        }
        self.wake.notify_one();
    }

    /// Removes a consumer; what it held is dispatched again to the others. Returns how many
    /// consumers remain.
    pub async fn remove_consumer(&self, connection_id: u64, consumer_id: u64) -> usize {
        let key = (connection_id, consumer_id);
        let mut st = self.state.lock().await;
        st.consumers.retain(|c| c.key() != key);
        if let Some(sel) = st.selector.as_mut() {
            sel.remove(key);
        }
        let held: Vec<Position> = st
            .pending
            .iter()
            .filter(|(_, k)| **k == key)
            .map(|(p, _)| *p)
            .collect();
        st.requeue(held);
        if self.sub_type == SubType::Failover {
            if st.active == Some(key) {
                st.active = None;
            }
            self.choose_active(&mut st).await;
        }
        if st.consumers.is_empty() {
            if let Err(e) = st.cursor.flush().await {
                tracing::warn!(subscription = %self.name, error = %e, "persisting or closing the cursor failed");
            }
        }
        self.wake.notify_one();
        st.consumers.len()
    }

    pub async fn flow(&self, connection_id: u64, consumer_id: u64, permits: u32) {
        let mut st = self.state.lock().await;
        if let Some(c) = st
            .consumers
            .iter_mut()
            .find(|c| c.key() == (connection_id, consumer_id))
        {
            c.permits = c.permits.saturating_add(i64::from(permits));
        }
        drop(st);
        self.wake.notify_one();
    }

    /// Acknowledges message ids. An id with an `ack_set` (bit i set = message i of the batch
    /// still unacknowledged) acknowledges only the messages it clears; the cursor keeps the
    /// rest durable and the entry is acknowledged once none is left. An id without one
    /// acknowledges the whole entry (the Rust client's batch_index alone, as in Pulsar).
    pub async fn ack(
        &self,
        cumulative: bool,
        ids: &[pb::MessageIdData],
    ) -> Result<(), BrokerError> {
        if cumulative && matches!(self.sub_type, SubType::Shared | SubType::KeyShared) {
            return Err(BrokerError::new(
                ServerError::NotAllowedError,
                format!(
                    "cumulative acknowledgement is not allowed on the {:?} subscription {}; acknowledge each message",
                    self.sub_type, self.name
                ),
            ));
        }
        let mut st = self.state.lock().await;
        // Every id is checked before any is applied: a refused ACK changes nothing.
        let mut checked: Vec<(Position, Option<Vec<u64>>)> = Vec::with_capacity(ids.len());
        for id in ids {
            let pos = Position::new(id.ledger_id, id.entry_id);
            let ack_set = if id.ack_set.iter().any(|w| *w != 0) {
                Some(self.checked_ack_set(&st, pos, &id.ack_set).await?)
            } else {
                None
            };
            // C++'s cumulative "nothing of this ledger yet" names entry -1 of a ledger.
            let named = if cumulative && id.entry_id == ID_NONE {
                Position::new(id.ledger_id, 0)
            } else {
                pos
            };
            let behind = st.cursor.mark_delete().is_some_and(|md| named <= md);
            if !behind && !self.topic.ml.contains(named).await && !self.view_has(named).await {
                return Err(BrokerError::new(
                    ServerError::NotAllowedError,
                    format!(
                        "{} acknowledges {}:{}, which is not an entry of {} (its last is {})",
                        self.name,
                        id.ledger_id,
                        id.entry_id as i64,
                        self.topic.full_name(),
                        self.topic
                            .ml
                            .last_confirmed()
                            .map_or_else(|| "none".to_string(), |p| p.to_string()),
                    ),
                ));
            }
            checked.push((pos, ack_set));
        }
        let blocked_count = |st: &State| {
            usize::from(st.blocked) + st.consumers.iter().filter(|c| c.blocked).count()
        };
        let blocked_before = blocked_count(&st);
        let dirty_before = st.cursor.is_dirty();
        // An acknowledgement the cursor took but could not persist stays taken (dirty: the
        // cursor's next change or flush persists it), so the rest of the ACK is applied too
        // and the first failure answered once all is. Stopping at it left the rest of the
        // command's messages unacknowledged while their consumer took them for acknowledged:
        // a backlog that never drained while it stayed connected.
        let mut unpersisted: Option<BrokerError> = None;
        for (id, (pos, ack_set)) in ids.iter().zip(checked) {
            let partial = ack_set.is_some();
            if cumulative {
                // Everything before the entry, then (partly or wholly) the entry itself.
                let upto = if id.entry_id == ID_NONE || partial {
                    // C++'s "nothing of this ledger yet", or a batch not yet complete.
                    self.previous_position(Position::new(
                        id.ledger_id,
                        if id.entry_id == ID_NONE {
                            0
                        } else {
                            id.entry_id
                        },
                    ))
                    .await
                } else {
                    Some(pos)
                };
                if let Some(upto) = upto {
                    kept_first(&mut unpersisted, st.cursor.ack_cumulative(upto).await);
                    st.forget_through(upto);
                }
                if !partial || id.entry_id == ID_NONE {
                    continue;
                }
            }
            let done = if let Some(mut bits) = ack_set {
                // Messages the compacted view removed count as acknowledged.
                if let Some(mask) = st.masks.get(&pos) {
                    for (b, m) in bits
                        .iter_mut()
                        .zip(mask.iter().chain(std::iter::repeat(&0)))
                    {
                        *b &= m;
                    }
                }
                match st.cursor.ack_batch_index(pos, &bits).await {
                    Ok(done) => done,
                    Err(e) => {
                        unpersisted.get_or_insert(e.into());
                        st.cursor.is_acknowledged(pos)
                    }
                }
            } else {
                kept_first(&mut unpersisted, st.cursor.ack(pos).await);
                true
            };
            if done {
                st.unpend(pos);
                st.redeliver.remove(&pos);
                st.redelivery_counts.remove(&pos);
                st.masks.remove(&pos);
            }
        }
        self.acks_changed();
        self.acks_total
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        let unblocked = blocked_count(&st) < blocked_before;
        if unblocked
            || self.topic.terminated.load(Ordering::Acquire)
            || (!dirty_before && st.cursor.is_dirty())
        {
            // A consumer (or the subscription) back under its unacknowledged limit may be
            // given more; the last acknowledgement of a terminated topic is when consumers
            // are told; and the first acknowledgement not persisted yet (within the persist
            // interval, or after a failure) sets the dispatch loop's flush timer, which an
            // idle loop has not set.
            self.wake.notify_one();
        }
        unpersisted.map_or(Ok(()), Err)
    }

    /// A client's `ack_set` for the batch entry at `pos`, checked against the batch: at most
    /// one bit per message of it (a set may stop early: Java's `BitSet` drops trailing zero
    /// words), and bits past its last message cleared, so a batch can always complete and
    /// the set stored in every cursor snapshot stays the batch's size.
    async fn checked_ack_set(
        &self,
        st: &State,
        pos: Position,
        words: &[i64],
    ) -> Result<Vec<u64>, BrokerError> {
        let messages = match st.cursor.batch_ack_set(pos) {
            // Already checked when it was first stored.
            Some(old) => old.len() * 64,
            None => {
                let bytes = if st.cursor.is_acknowledged(pos) {
                    None
                } else if self.topic.ml.contains(pos).await {
                    Some(self.topic.ml.read(pos).await?)
                } else {
                    // A compacted view's entry in a ledger trimmed since.
                    self.view_entry(pos).await.map(|e| e.bytes)
                };
                let Some(bytes) = bytes else {
                    // Nothing to check against; the caller refuses or ignores the position.
                    return Ok(words.iter().map(|w| *w as u64).collect());
                };
                Entry::parse(bytes)
                    .ok()
                    .and_then(|e| e.metadata().ok())
                    .map_or(1, |m| meridian_protocol::entry::message_count(&m))
                    as usize
            }
        };
        let max_words = messages.div_ceil(64);
        if words.len() > max_words {
            return Err(BrokerError::new(
                ServerError::NotAllowedError,
                format!(
                    "{} acknowledges {pos} with an ack_set of {} words; its batch of {messages} messages takes at most {max_words}",
                    self.name,
                    words.len()
                ),
            ));
        }
        let mut bits: Vec<u64> = words.iter().map(|w| *w as u64).collect();
        if let Some(last) = bits.last_mut().filter(|_| words.len() == max_words) {
            let used = messages - (max_words - 1) * 64;
            if used < 64 {
                *last &= (1u64 << used) - 1;
            }
        }
        Ok(bits)
    }

    /// The entry before `pos` in the log (`None` at the start of the log).
    async fn previous_position(&self, pos: Position) -> Option<Position> {
        let ml = &self.topic.ml;
        match ml.index_of(pos).await {
            Some(i) => ml.position_at(i.checked_sub(1)?).await,
            // A compacted view's entry in a ledger trimmed since.
            None if self.in_compacted_view(pos) => pos.before(),
            None => None,
        }
    }

    /// The compacted view's entry at `pos`, for a compacted reader (a position the log may
    /// no longer have).
    async fn view_entry(
        &self,
        pos: Position,
    ) -> Option<meridian_storage::compacted::CompactedEntry> {
        let v = self
            .topic
            .compaction
            .view()
            .filter(|_| self.read_compacted)?;
        v.find(pos).await.ok().flatten()
    }

    async fn view_has(&self, pos: Position) -> bool {
        self.view_entry(pos).await.is_some()
    }

    /// Whether `pos` is covered by the compacted view this subscription reads.
    fn in_compacted_view(&self, pos: Position) -> bool {
        self.read_compacted
            && self
                .topic
                .compaction
                .view()
                .is_some_and(|v| pos <= v.horizon)
    }

    /// Puts a consumer's unacknowledged entries (all of them, or those listed) back for
    /// dispatch, counting a redelivery for each.
    pub async fn redeliver(&self, connection_id: u64, consumer_id: u64, ids: &[pb::MessageIdData]) {
        let key = (connection_id, consumer_id);
        let mut st = self.state.lock().await;
        let chosen: Vec<Position> = if ids.is_empty() {
            st.pending
                .iter()
                .filter(|(_, k)| **k == key)
                .map(|(p, _)| *p)
                .collect()
        } else {
            ids.iter()
                .map(|i| Position::new(i.ledger_id, i.entry_id))
                .filter(|p| st.pending.get(p) == Some(&key))
                .collect()
        };
        st.requeue(chosen);
        drop(st);
        self.wake.notify_one();
    }

    /// Moves the cursor (SEEK), forgets what was in flight and detaches every consumer; the
    /// caller then closes them, and they re-subscribe and read from the new position.
    pub async fn seek(&self, to: SeekTo) -> Result<Vec<ConsumerSink>, BrokerError> {
        let mut st = self.state.lock().await;
        match to {
            SeekTo::Initial(i) => st.cursor.reset(i).await?,
            SeekTo::Position(p) => st.cursor.reset_to_position(p).await?,
            SeekTo::PublishTime(t) => {
                st.cursor
                    .reset_to_time(t, |b| {
                        Entry::parse(b.clone())
                            .ok()
                            .and_then(|e| e.metadata().ok())
                            .map_or(0, |m| m.publish_time)
                    })
                    .await?
            }
        }
        st.cursor.flush().await?;
        st.clear_in_flight();
        // Detached under the same lock as the reset: nothing is dispatched from the new
        // position to a consumer that is about to be closed (it would arrive twice).
        st.active = None;
        st.selector = None;
        let sinks = st.consumers.drain(..).map(|c| c.sink).collect();
        Ok(sinks)
    }

    /// Admin: moves the subscription (as SEEK) and closes its consumers, which re-subscribe
    /// and read from the new position.
    pub async fn reset(&self, to: SeekTo) -> Result<(), BrokerError> {
        close_consumers(self.seek(to).await?);
        Ok(())
    }

    /// Admin: the first `n` unacknowledged entries after the mark-delete position, without
    /// moving anything.
    pub async fn peek(&self, n: usize) -> Result<Vec<(Position, Bytes)>, BrokerError> {
        let st = self.state.lock().await;
        let ml = &self.topic.ml;
        let mut pos = first_after_mark_delete(&st, ml).await;
        let mut out = Vec::new();
        while let Some(p) = pos {
            if out.len() >= n {
                break;
            }
            if !st.cursor.is_acknowledged(p) {
                out.push((p, ml.read(p).await?));
            }
            pos = ml.next_position(p).await;
        }
        Ok(out)
    }

    /// Acknowledgements left in memory (within the persist interval, or after a failure) get
    /// the dispatch loop's flush timer, which an idle loop has not set.
    fn flush_soon(&self, st: &State) {
        if st.cursor.is_dirty() {
            self.wake.notify_one();
        }
    }

    /// Admin: acknowledges the first `n` unacknowledged entries (all of them with `None`);
    /// with `dry_run` only counts them. Returns how many entries.
    pub async fn skip(&self, n: Option<u64>, dry_run: bool) -> Result<u64, BrokerError> {
        let mut st = self.state.lock().await;
        let ml = Arc::clone(&self.topic.ml);
        if n.is_none() {
            let entries = st.cursor.backlog().await.entries;
            if !dry_run {
                if let Some(last) = ml.last_confirmed() {
                    let r = st.cursor.ack_cumulative(last).await;
                    st.forget_through(last);
                    self.flush_soon(&st);
                    r?;
                }
            }
            return Ok(entries);
        }
        let n = n.unwrap_or(0);
        let mut pos = first_after_mark_delete(&st, &ml).await;
        let mut done = 0;
        let mut unpersisted: Option<BrokerError> = None;
        while let Some(p) = pos {
            if done >= n {
                break;
            }
            if !st.cursor.is_acknowledged(p) {
                if !dry_run {
                    kept_first(&mut unpersisted, st.cursor.ack(p).await);
                    st.unpend(p);
                    st.redeliver.remove(&p);
                }
                done += 1;
            }
            pos = ml.next_position(p).await;
        }
        self.flush_soon(&st);
        unpersisted.map_or(Ok(done), Err)
    }

    /// The publish time of the oldest unacknowledged message, if any.
    pub async fn oldest_unacked_publish_time(&self) -> Option<u64> {
        let (_, bytes) = self.peek(1).await.ok()?.into_iter().next()?;
        let e = Entry::parse(bytes).ok()?;
        e.metadata().ok().map(|m| m.publish_time)
    }

    /// Backlog eviction: acknowledges the oldest entries until the backlog is at most
    /// `limit_bytes`. Returns how many entries.
    pub async fn evict_to_bytes(&self, limit_bytes: u64) -> Result<u64, BrokerError> {
        let mut st = self.state.lock().await;
        let ml = Arc::clone(&self.topic.ml);
        let mut excess = st.cursor.backlog().await.bytes.saturating_sub(limit_bytes);
        let mut pos = first_after_mark_delete(&st, &ml).await;
        let mut done = 0;
        let mut unpersisted: Option<BrokerError> = None;
        while let Some(p) = pos.filter(|_| excess > 0) {
            if !st.cursor.is_acknowledged(p) {
                let len = ml.read(p).await?.len() as u64;
                kept_first(&mut unpersisted, st.cursor.ack(p).await);
                st.unpend(p);
                st.redeliver.remove(&p);
                excess = excess.saturating_sub(len);
                done += 1;
            }
            pos = ml.next_position(p).await;
        }
        self.flush_soon(&st);
        unpersisted.map_or(Ok(done), Err)
    }

    /// Admin (and TTL): acknowledges every entry published before `cutoff_ms`; with `dry_run`
    /// only counts them. Returns how many unacknowledged entries that was.
    pub async fn expire_before(&self, cutoff_ms: u64, dry_run: bool) -> Result<u64, BrokerError> {
        let mut st = self.state.lock().await;
        let ml = Arc::clone(&self.topic.ml);
        let Some(last) = ml.last_confirmed() else {
            return Ok(0);
        };
        let first_kept = st
            .cursor
            .position_at_time(cutoff_ms, |b| {
                Entry::parse(b.clone())
                    .ok()
                    .and_then(|e| e.metadata().ok())
                    .map_or(0, |m| m.publish_time)
            })
            .await?;
        let upto = match first_kept {
            None => Some(last),
            Some(p) => match ml.index_of(p).await.and_then(|i| i.checked_sub(1)) {
                Some(i) => ml.position_at(i).await,
                None => None,
            },
        };
        let Some(upto) = upto.filter(|u| st.cursor.mark_delete().is_none_or(|md| *u > md)) else {
            return Ok(0);
        };
        let before = st.cursor.backlog().await.entries;
        let mut count = 0;
        let mut pos = first_after_mark_delete(&st, &ml).await;
        while let Some(p) = pos.filter(|p| *p <= upto) {
            if !st.cursor.is_acknowledged(p) {
                count += 1;
            }
            pos = ml.next_position(p).await;
        }
        if !dry_run {
            let r = st.cursor.ack_cumulative(upto).await;
            st.forget_through(upto);
            debug_assert!(st.cursor.backlog().await.entries <= before);
            self.flush_soon(&st);
            r?;
        }
        Ok(count)
    }

    /// Admin: deletes a subscription that has no consumers.
    pub async fn delete_without_consumers(self: &Arc<Self>) -> Result<(), BrokerError> {
        self.delete_unless_others(None).await
    }

    /// UNSUBSCRIBE: deletes the subscription if `by` is its only consumer.
    pub async fn unsubscribe(
        self: &Arc<Self>,
        connection_id: u64,
        consumer_id: u64,
    ) -> Result<(), BrokerError> {
        self.delete_unless_others(Some((connection_id, consumer_id)))
            .await
    }

    /// Deletes the subscription (cursor and all) if no consumer other than `by` is attached.
    async fn delete_unless_others(
        self: &Arc<Self>,
        by: Option<ConsumerKey>,
    ) -> Result<(), BrokerError> {
        self.delete_with(by, false).await
    }

    /// Deletes the subscription with its topic: its consumers are closed (CLOSE_CONSUMER).
    pub async fn delete_forced(self: &Arc<Self>) -> Result<(), BrokerError> {
        self.delete_with(None, true).await
    }

    async fn delete_with(
        self: &Arc<Self>,
        by: Option<ConsumerKey>,
        force: bool,
    ) -> Result<(), BrokerError> {
        let mut st = self.state.lock().await;
        if !force && st.consumers.iter().any(|c| Some(c.key()) != by) {
            return Err(BrokerError::new(
                ServerError::ConsumerBusy,
                format!("subscription {} has other consumers", self.name),
            ));
        }
        st.cursor.delete().await?;
        st.deleted = true;
        let sinks: Vec<ConsumerSink> = st.consumers.drain(..).map(|c| c.sink).collect();
        drop(st);
        self.closed.store(true, Ordering::Relaxed);
        let _ = self.stop.send(true);
        self.topic.drop_subscription(&self.name, self).await;
        self.topic.forget_replicated(&self.name).await;
        close_consumers(sinks);
        Ok(())
    }

    pub async fn mark_delete(&self) -> Option<Position> {
        self.state.lock().await.cursor.mark_delete()
    }

    pub async fn backlog(&self) -> Backlog {
        self.state.lock().await.cursor.backlog().await
    }

    /// The subscription's figures; `msg_rate_out` is filled by the caller (it keeps the
    /// previous sample).
    pub async fn stats(&self) -> SubscriptionStats {
        let st = self.state.lock().await;
        let backlog = st.cursor.backlog().await;
        SubscriptionStats {
            name: self.name.clone(),
            sub_type: format!("{:?}", self.sub_type),
            durable: self.durable,
            consumers: st.consumers.len(),
            msg_rate_out: 0.0,
            msgs_out_total: self.msgs_out.load(Ordering::Relaxed),
            backlog_entries: backlog.entries,
            backlog_bytes: backlog.bytes,
            unacked_entries: st.pending.len(),
            delayed_entries: st.delayed.len(),
            properties: st.cursor.properties().clone(),
            replicated: false,
            sync: Vec::new(),
        }
    }

    /// The cursor's state, as `topics stats-internal` shows it.
    pub async fn internal_stats(&self) -> CursorInternalStats {
        let st = self.state.lock().await;
        CursorInternalStats {
            name: self.name.clone(),
            durable: self.durable,
            mark_delete: st.cursor.mark_delete(),
            read_position: st.cursor.read_position(),
            acknowledged_ranges: st.cursor.acknowledged_ranges(),
            cursor_ledger: st.cursor.cursor_ledger(),
            backlog_entries: st.cursor.backlog().await.entries,
            unacked_entries: st.pending.len(),
            consumers: st.consumers.len(),
        }
    }

    /// Detaches every consumer and tells it (CLOSE_CONSUMER); the clients reconnect.
    pub async fn disconnect_consumers(&self) {
        let sinks: Vec<ConsumerSink> = {
            let mut st = self.state.lock().await;
            st.clear_in_flight();
            st.active = None;
            st.selector = None;
            st.consumers.drain(..).map(|c| c.sink).collect()
        };
        close_consumers(sinks);
    }

    /// One consumer's name, available permits, unacknowledged messages, and whether it is
    /// blocked on them (its own limit or the subscription's).
    pub async fn consumer_figures(
        &self,
        connection_id: u64,
        consumer_id: u64,
    ) -> Option<(String, i64, u64, bool)> {
        let st = self.state.lock().await;
        let key = (connection_id, consumer_id);
        let c = st.consumers.iter().find(|c| c.key() == key)?;
        let unacked = st.unacked.get(&key).copied().unwrap_or(0);
        Some((c.name.clone(), c.permits, unacked, c.blocked || st.blocked))
    }

    pub async fn consumer_count(&self) -> usize {
        self.state.lock().await.consumers.len()
    }

    /// Acknowledges an entry the dispatcher skips (a marker, unreadable, or removed by a
    /// compaction). Its acknowledgement is applied whatever persisting it does: a failure
    /// leaves the cursor dirty for the next change or flush, and the round goes on (the
    /// entries after it were read already).
    async fn ack_skipped(&self, st: &mut State, pos: Position) {
        if let Err(e) = st.cursor.ack(pos).await {
            tracing::warn!(subscription = %self.name, position = %pos, error = %e, "persisting the acknowledgement of a skipped entry failed; it is persisted with the next change");
        }
    }

    /// Stops the dispatcher, persists the cursor and closes its ledger (the next opening
    /// then has nothing to recover).
    pub async fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        let _ = self.stop.send(true);
        let mut st = self.state.lock().await;
        if let Err(e) = st.cursor.close().await {
            tracing::warn!(subscription = %self.name, error = %e, "persisting the cursor failed");
        }
    }

    async fn dispatch_loop(
        self: Arc<Self>,
        mut appended: watch::Receiver<Option<Position>>,
        mut stop: watch::Receiver<bool>,
    ) {
        let flush_every = Duration::from_millis(self.topic.cfg.cursor_persist_interval_ms.max(100));
        // When the cursor's acknowledgements in memory are flushed: set once they are seen,
        // kept across the loop's wake-ups (a new timer on each would let a stream of
        // publishes with no acknowledgement put the flush off for as long as it lasts).
        let mut flush_at: Option<tokio::time::Instant> = None;
        loop {
            if *stop.borrow() {
                return;
            }
            // Boxed: the task of an idle subscription stays small.
            let progressed = match Box::pin(Self::dispatch_once(&self)).await {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(topic = %self.topic.full_name(), subscription = %self.name, error = %e, "dispatch failed; retrying");
                    // Tried again after the pause, woken or not: what failed is still due.
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                        _ = stop.changed() => return,
                    }
                    continue;
                }
            };
            if progressed {
                tokio::task::yield_now().await;
                continue;
            }
            // A timer only while acknowledgements wait to be persisted: idle subscriptions
            // cost no wake-ups.
            let (dirty, next_due) = {
                let mut st = self.state.lock().await;
                (st.cursor.is_dirty(), st.release_due(now_ms()))
            };
            let until_due = next_due.map_or(Duration::ZERO, |at| {
                Duration::from_millis(u64::try_from(at - now_ms()).unwrap_or(0))
            });
            flush_at = if dirty {
                Some(flush_at.unwrap_or_else(|| tokio::time::Instant::now() + flush_every))
            } else {
                None
            };
            tokio::select! {
                _ = tokio::time::sleep(until_due), if next_due.is_some() => {}
                _ = self.wake.notified() => {}
                r = appended.changed() => if r.is_err() { return },
                _ = stop.changed() => return,
                _ = tokio::time::sleep_until(flush_at.unwrap_or_else(tokio::time::Instant::now)), if flush_at.is_some() => {
                    let mut st = self.state.lock().await;
                    flush_at = None;
                    if let Err(e) = Box::pin(st.cursor.flush()).await {
                        tracing::warn!(subscription = %self.name, error = %e, "persisting the cursor failed; tried again in a second");
                        // Not every flush interval while the store is out: each attempt
                        // holds the subscription's lock for up to a request's timeout.
                        flush_at = Some(tokio::time::Instant::now() + FLUSH_RETRY);
                    }
                }
            }
        }
    }

    /// Sends what the consumers have permits for. Returns whether anything was sent (or
    /// put into the delay index: then there may be more to read).
    async fn dispatch_once(self: &Arc<Self>) -> Result<bool, BrokerError> {
        let batch_max = self.topic.cfg.dispatch_batch_entries_max as usize;
        // Dispatch rate limits (the topic's, over its subscriptions, and this one's): wait
        // while one is spent, then send at most what both allow.
        // No allocation per round: most subscriptions have no limit at all.
        let limiters = [
            self.topic.ns_limiters.dispatch.get(),
            self.topic.dispatch_limiter.get(),
            self.limiter.get(),
        ];
        let mut allowed = u64::MAX;
        let started = std::time::Instant::now();
        for l in limiters.iter().flatten() {
            let wait = l.wait(started);
            if !wait.is_zero() {
                tokio::time::sleep(wait.min(Duration::from_millis(500))).await;
                return Ok(true);
            }
            allowed = allowed.min(l.available_msgs(started));
        }
        let mut st = self.state.lock().await;
        if st.deleted {
            return Ok(false);
        }
        let delays = matches!(self.sub_type, SubType::Shared | SubType::KeyShared);
        let now = now_ms();
        if delays {
            st.release_due(now);
        }
        let permits: i64 = match self.sub_type {
            SubType::Exclusive => st.consumers.first().map_or(0, |c| c.permits),
            SubType::Failover => st
                .active
                .and_then(|a| st.consumers.iter().find(|c| c.key() == a))
                .map_or(0, |c| c.permits),
            _ => st.consumers.iter().map(|c| c.permits.max(0)).sum(),
        };
        let permits = permits.min(i64::try_from(allowed).unwrap_or(i64::MAX).max(1));
        if permits <= 0 || st.blocked {
            return Ok(false);
        }
        // Entries the permits cover (a batch entry costs its messages), at most batch_max.
        let budget = ((permits as f64 / st.msgs_per_entry).ceil() as usize).clamp(1, batch_max);
        let key_shared = self.sub_type == SubType::KeyShared;
        let mut entries: Vec<(Position, Bytes, u32)> = Vec::new();
        let mut wanted = Vec::new();
        // Key_Shared looks at every candidate, in log order: an entry held back for one
        // consumer must not hold back the others', and a key's messages must not overtake
        // each other. How far it reads ahead of what it could hand out is bounded.
        let stashed = st.stash.len();
        let stash_take = if key_shared { stashed } else { budget };
        while entries.len() < stash_take {
            let Some(e) = st.stash.pop_front() else { break };
            if !st.cursor.is_acknowledged(e.0) {
                entries.push(e);
            }
        }
        while key_shared || entries.len() + wanted.len() < budget {
            let Some((p, n)) = st.redeliver.pop_first() else {
                break;
            };
            if !st.cursor.is_acknowledged(p) {
                wanted.push((p, n));
            }
        }
        if !wanted.is_empty() {
            let reads =
                futures::future::join_all(wanted.iter().map(|(p, _)| self.read_again(*p))).await;
            if let Some((p, e)) = wanted
                .iter()
                .zip(&reads)
                .find_map(|((p, _), r)| r.as_ref().err().map(|e| (p, e)))
            {
                // Nothing of this round goes out: what was taken goes back where it was, in
                // order (a key's later message must not overtake one that could not be read),
                // and the dispatch loop retries after its pause.
                let e = BrokerError::new(
                    ServerError::PersistenceError,
                    format!("redelivery read of {p} failed (kept for the next round): {e}"),
                );
                for (p, n) in wanted {
                    st.redeliver.insert(p, n);
                }
                for e in entries.into_iter().rev() {
                    st.stash.push_front(e);
                }
                return Err(e);
            }
            for ((p, n), r) in wanted.into_iter().zip(reads) {
                match r {
                    Ok(Some((b, mask))) => {
                        if let Some(m) = mask {
                            st.masks.insert(p, m);
                        }
                        entries.push((p, b, n));
                    }
                    // A later compaction removed it: its key has a newer message, so it
                    // counts as acknowledged.
                    Ok(None) => {
                        st.redelivery_counts.remove(&p);
                        st.masks.remove(&p);
                        if self.durable {
                            self.ack_skipped(&mut st, p).await;
                        }
                    }
                    Err(_) => {}
                }
            }
        }
        let fresh_max = if key_shared {
            if stashed < batch_max * KEY_SHARED_LOOKAHEAD_BATCHES {
                budget
            } else {
                0
            }
        } else {
            budget.saturating_sub(entries.len())
        };
        if fresh_max > 0 {
            let fresh = self.read_fresh(&mut st, fresh_max).await?;
            for (p, b) in fresh {
                if st.pending.contains_key(&p) {
                    continue;
                }
                let n = st.redelivery_counts.get(&p).copied().unwrap_or(0);
                entries.push((p, b, n));
            }
        }
        if key_shared {
            entries.sort_unstable_by_key(|e| e.0);
        }
        if entries.is_empty() {
            if self.topic.terminated.load(Ordering::Acquire)
                && st
                    .consumers
                    .iter()
                    .any(|c| c.sink.end_of_topic && !c.told_end)
                && st.cursor.backlog().await.entries == 0
            {
                for c in st
                    .consumers
                    .iter_mut()
                    .filter(|c| c.sink.end_of_topic && !c.told_end)
                {
                    c.told_end = true;
                    let _ = c
                        .sink
                        .tx
                        .send_now(frame(&cmd::reached_end_of_topic(c.sink.consumer_id)));
                }
            }
            return Ok(false);
        }
        let mut sent = false;
        let mut unassigned = Vec::new();
        let mut dead = Vec::new();
        let dead_letter_after = self
            .topic
            .dead_letter_max_redeliveries()
            .filter(|_| self.durable);
        let mut out_msgs = 0u64;
        let mut out_bytes = 0u64;
        for (pos, bytes, redeliveries) in entries {
            if out_msgs >= allowed {
                // The rate limit is spent: the rest waits, in order, for the next round.
                unassigned.push((pos, bytes, redeliveries));
                continue;
            }
            let entry = match Entry::parse(bytes) {
                Ok(e) => e,
                Err(e) => {
                    tracing::error!(topic = %self.topic.full_name(), position = %pos, error = %e, "unreadable entry skipped");
                    self.ack_skipped(&mut st, pos).await;
                    continue;
                }
            };
            let meta = entry.metadata().ok();
            if meta.as_ref().is_some_and(|m| m.marker_type.is_some()) {
                // Broker-internal markers are never dispatched; they count as acknowledged.
                self.ack_skipped(&mut st, pos).await;
                continue;
            }
            if let Some(at) = meta
                .as_ref()
                .and_then(|m| m.deliver_at_time)
                .filter(|at| delays && *at > now)
            {
                st.delayed.insert((at, pos));
                sent = true;
                continue;
            }
            if dead_letter_after.is_some_and(|max| redeliveries > max) {
                dead.push((pos, entry, redeliveries));
                continue;
            }
            // What is still unacknowledged of a batch, less what the compacted view removed.
            let ack_set = match (st.cursor.batch_ack_set(pos), st.masks.get(&pos)) {
                (Some(acks), Some(mask)) => Some(
                    acks.iter()
                        .zip(mask.iter().chain(std::iter::repeat(&0)))
                        .map(|(a, m)| a & m)
                        .collect(),
                ),
                (Some(acks), None) => Some(acks.to_vec()),
                (None, Some(mask)) => Some(mask.clone()),
                (None, None) => None,
            };
            // A partly acknowledged batch costs only the messages left in it.
            let messages = match &ack_set {
                Some(bits) => bits.iter().map(|w| w.count_ones()).sum::<u32>().max(1),
                None => meta
                    .as_ref()
                    .map_or(1, meridian_protocol::entry::message_count),
            };
            // A declared count beyond the entry's bytes is not believed (rate limits, permits).
            let messages = messages.min(
                u32::try_from(entry.as_bytes().len())
                    .unwrap_or(u32::MAX)
                    .max(1),
            );
            st.msgs_per_entry = st.msgs_per_entry * 0.9 + f64::from(messages) * 0.1;
            let (target, hash) = if key_shared {
                let key = meta.as_ref().map_or_else(
                    || key_shared::NONE_KEY.to_vec(),
                    |m| key_shared::entry_key(&entry, m),
                );
                let h = key_shared::key_hash(&key);
                (Self::pick_by_hash(&st, h, &self.wake), Some(h))
            } else {
                (self.pick(&mut st), None)
            };
            let Some(idx) = target else {
                unassigned.push((pos, entry.into_bytes(), redeliveries));
                continue;
            };
            let mut b = BytesMut::new();
            let c = &mut st.consumers[idx];
            let mut command = cmd::message(
                c.sink.consumer_id,
                pos.ledger_id,
                pos.entry_id,
                redeliveries,
            );
            if let (Some(m), Some(bits)) = (command.message.as_mut(), ack_set) {
                // The wire's words are int64; the bits are the same.
                m.ack_set = bits.into_iter().map(|w| w as i64).collect();
            }
            encode_message(&mut b, &command, entry.as_bytes());
            let len = entry.as_bytes().len() as u64;
            // Never waits for the client under the subscription's lock: a full queue sends
            // the entry back in order, and the writer wakes this dispatcher when it drains.
            match c.sink.tx.try_send_or_wake(b.freeze(), &self.wake) {
                Ok(()) => {}
                Err(TrySendError::Full) => {
                    unassigned.push((pos, entry.into_bytes(), redeliveries));
                    continue;
                }
                Err(TrySendError::Closed) => {
                    // The connection is gone; its close will remove the consumer.
                    st.redeliver.insert(pos, redeliveries);
                    continue;
                }
            }
            c.permits -= i64::from(messages);
            let key = c.key();
            st.pend(pos, key, hash, messages);
            sent = true;
            out_msgs += u64::from(messages);
            out_bytes += len;
        }
        // Kept in order in front of the stash: they were due before anything stashed later.
        for e in unassigned.into_iter().rev() {
            st.stash.push_front(e);
        }
        if !dead.is_empty() {
            // Neither pending nor queued while they are moved; put back if that fails.
            tokio::spawn(Arc::clone(self).dead_letter(dead));
        }
        self.topic
            .counters
            .msgs_out
            .fetch_add(out_msgs, Ordering::Relaxed);
        self.msgs_out.fetch_add(out_msgs, Ordering::Relaxed);
        self.topic
            .counters
            .bytes_out
            .fetch_add(out_bytes, Ordering::Relaxed);
        for l in limiters.iter().flatten() {
            l.take(out_msgs, out_bytes, std::time::Instant::now());
        }
        metrics::counter!("meridian_dispatch_messages_total").increment(out_msgs);
        metrics::counter!("meridian_dispatch_bytes_total").increment(out_bytes);
        Ok(sent)
    }

    /// Reads up to `max` new entries: from the compacted view while the read position is
    /// before its horizon (for a compacted reader), then from the log.
    async fn read_fresh(
        &self,
        st: &mut State,
        max: usize,
    ) -> Result<Vec<(Position, Bytes)>, BrokerError> {
        let view = self.topic.compaction.view().filter(|v| {
            self.read_compacted && st.cursor.read_position().is_none_or(|r| r < v.horizon)
        });
        if let Some(v) = view {
            let mut from = v.first_after(st.cursor.read_position()).await?;
            let mut prev = st.cursor.read_position();
            loop {
                let to = (from + max as u64).min(v.entries);
                // All read before the cursor moves: a failed read moves nothing.
                let read = futures::future::join_all((from..to).map(|i| v.read(i)))
                    .await
                    .into_iter()
                    .collect::<Result<Vec<_>, _>>()?;
                let mut out = Vec::new();
                for e in read {
                    if self.durable {
                        // What the view skipped was replaced by later messages of its keys:
                        // it counts as acknowledged, so the backlog and mark-delete move on.
                        st.cursor.ack_between(prev, e.position).await;
                    }
                    prev = Some(e.position);
                    st.cursor.set_read_after(e.position);
                    if st.cursor.is_acknowledged(e.position) {
                        continue;
                    }
                    if let Some(m) = e.mask {
                        st.masks.insert(e.position, m);
                    }
                    out.push((e.position, e.bytes));
                }
                if to >= v.entries {
                    // The view is read: the log goes on after its horizon.
                    if self.durable {
                        let past = Position::new(v.horizon.ledger_id, v.horizon.entry_id + 1);
                        st.cursor.ack_between(prev, past).await;
                    }
                    st.cursor.set_read_after(v.horizon);
                }
                if !out.is_empty() {
                    return Ok(out);
                }
                if to >= v.entries {
                    break;
                }
                from = to;
            }
        }
        Ok(st.cursor.read_entries(max).await?)
    }

    /// An entry to dispatch again, with the view's mask for a compacted reader; `None` if the
    /// compacted view no longer retains it.
    async fn read_again(
        &self,
        pos: Position,
    ) -> Result<Option<(Bytes, Option<Vec<u64>>)>, BrokerError> {
        if let Some(v) = self
            .topic
            .compaction
            .view()
            .filter(|v| self.read_compacted && pos <= v.horizon)
        {
            return Ok(v.find(pos).await?.map(|e| (e.bytes, e.mask)));
        }
        Ok(Some((self.topic.ml.read(pos).await?, None)))
    }

    /// The consumer the next entry goes to, if any may take it.
    /// Moves entries redelivered too often to `<topic>-<subscription>-DLQ` (created with a
    /// subscription of the same name, so nothing moved there is lost), then acknowledges them
    /// here. Each gets the properties Pulsar's clients give dead-lettered messages
    /// (`REAL_TOPIC`, `ORIGIN_MESSAGE_ID`). At least once: a crash between the two steps moves
    /// an entry again.
    ///
    /// Boxed with a named type: its future opens subscriptions, whose dispatchers call this.
    fn dead_letter(
        self: Arc<Self>,
        dead: Vec<(Position, Entry, u32)>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        Box::pin(async move {
            let t = &self.topic.name;
            let dlq_name = crate::topic_name::TopicName {
                local: format!("{}-{}-DLQ", t.local, self.name),
                ..t.clone()
            };
            let moved = async {
                let broker = self.topic.broker.upgrade().ok_or_else(|| {
                    BrokerError::new(ServerError::ServiceNotReady, "the broker is shutting down")
                })?;
                let dlq = broker.topic_for_broker(&dlq_name).await?;
                dlq.create_subscription(&self.name).await?;
                let real_topic = self.topic.full_name().to_string();
                for (pos, entry, _) in &dead {
                    let origin = format!("{}:{}:-1", pos.ledger_id, pos.entry_id);
                    let copy = entry.with_properties(&[
                        ("REAL_TOPIC", real_topic.as_str()),
                        ("ORIGIN_MESSAGE_ID", origin.as_str()),
                    ]);
                    let messages = copy
                        .metadata()
                        .map_or(1, |m| meridian_protocol::entry::message_count(&m));
                    let bytes = copy.as_bytes().len() as u64;
                    // Durable (fsynced on the ack quorum) before the original is acknowledged.
                    let at = dlq.ml.append(copy.into_bytes()).await?;
                    dlq.on_appended(at, u64::from(messages), bytes);
                }
                Ok::<(), BrokerError>(())
            }
            .await;
            let mut st = self.state.lock().await;
            match moved {
                Ok(()) => {
                    for (pos, _, _) in &dead {
                        if let Err(e) = st.cursor.ack(*pos).await {
                            tracing::warn!(subscription = %self.name, position = %pos, error = %e, "acknowledging a dead-lettered entry failed");
                        }
                        st.redelivery_counts.remove(pos);
                    }
                    metrics::counter!("meridian_dead_lettered_entries_total")
                        .increment(dead.len() as u64);
                    tracing::info!(topic = %self.topic.full_name(), subscription = %self.name, entries = dead.len(), dead_letter_topic = %dlq_name, "entries dead-lettered");
                }
                Err(e) => {
                    tracing::warn!(topic = %self.topic.full_name(), subscription = %self.name, error = %e, "dead-lettering failed; the entries stay");
                    for (pos, _, n) in dead {
                        st.redeliver.insert(pos, n);
                    }
                }
            }
            drop(st);
            self.wake.notify_one();
        })
    }

    /// Key_Shared: the consumer owning `hash`, if it has permits and (unless out-of-order
    /// delivery is allowed) no other consumer still holds unacknowledged messages of the hash.
    fn pick_by_hash(st: &State, hash: u16, wake: &Arc<Notify>) -> Option<usize> {
        if st.blocked {
            return None;
        }
        let owner = st.selector.as_ref()?.owner(hash)?;
        let idx = st
            .consumers
            .iter()
            .position(|c| c.key() == owner && c.can_take(wake))?;
        if !st.key_shared.allow_out_of_order
            && st
                .hash_holders
                .get(&hash)
                .is_some_and(|h| h.iter().any(|(k, n)| *k != owner && *n > 0))
        {
            return None;
        }
        Some(idx)
    }

    fn pick(&self, st: &mut State) -> Option<usize> {
        if st.blocked {
            return None;
        }
        match self.sub_type {
            SubType::Exclusive => st
                .consumers
                .first()
                .filter(|c| c.can_take(&self.wake))
                .map(|_| 0),
            SubType::Failover => {
                let a = st.active?;
                st.consumers
                    .iter()
                    .position(|c| c.key() == a && c.can_take(&self.wake))
            }
            _ => {
                let n = st.consumers.len();
                for i in 0..n {
                    let idx = (st.round_robin + i) % n;
                    if st.consumers[idx].can_take(&self.wake) {
                        st.round_robin = idx + 1;
                        return Some(idx);
                    }
                }
                None
            }
        }
    }
}

/// Where SEEK moves a subscription.
#[derive(Debug, Clone, Copy)]
pub enum SeekTo {
    Initial(InitialPosition),
    Position(Position),
    PublishTime(u64),
}
