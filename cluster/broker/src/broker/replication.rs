//! Geo-replication in the broker: the receiving side of peers' topic streams
//! ([`GeoSink`], [`inbound`]: frames in flight, their appends and origins) and this site's replicators ([`Topic::reconcile_replicators`],
//! [`TopicSource`]).
//!
//! ```text
//!  receiving (meridian_geo::receiver)              sending (meridian_geo::replicator)
//!  open: the namespace (or topic) lists the        per remote in the topic's replication
//!    sender's site? partitions agree (created       clusters: cursor meridian.repl.<remote>
//!    on first use)? the topic loads here?           (Earliest), entries produced here sent,
//!  submit (inbound.rs): drop origin positions      entries that arrived by replication
//!    already held or queued, check each entry's     skipped; the cursor moves on the
//!    checksum, queue it marked with its origin;     remote's acknowledgement only
//!    the topic's completer waits for it, records
//!    the highest origin position held, answers
//! ```
//!
//! The highest origin position per (topic, origin site) is recovered on first use from a
//! snapshot (`/topic-repl-origins/<log>`: the positions and the local position through which
//! they are known) plus the entries after it, each of which names its origin in its metadata
//! (`Entry::origin`). An append is acknowledged only after it is durable; the snapshot is
//! written after it at most every 250 ms (and by the policy beat when a burst's last frames
//! were not), so a crash covers what the snapshot lacks by the replay, and a range sent again
//! is dropped: no duplicates, no loss. While nothing is being received the beat moves the
//! snapshot's position to the log's end every 5 s (entries produced here hold no origin), and
//! a load's replay writes it every 64 MiB and at its end, so a load replays little.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use futures::future::BoxFuture;
use meridian_geo::frame::{OriginPosition, RefusalCode};
use meridian_geo::receiver::{Refusal, ReplicaSink, ReplicaTopic};
use meridian_geo::replicator::{
    LinkState, ReplicaSource, ReplicatorOptions, ReplicatorStatus, SourceEntry,
};
use meridian_protocol::Entry;
use meridian_storage::cursor::{InitialPosition, ManagedCursor};
use meridian_storage::managed_ledger::Position;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::{Broker, NamespacePolicies, Topic};
use crate::topic_name::TopicName;

pub(super) mod exposure;
pub(super) mod inbound;
pub(super) mod sub_state;
pub(super) mod subs;

/// Replicators' cursors are named so: `meridian.repl.<remote site>`.
pub const REPL_CURSOR_PREFIX: &str = "meridian.repl.";

/// Where each topic's origins snapshot is kept (by managed-ledger name).
pub const ORIGINS_PREFIX: &str = "/topic-repl-origins/";

/// The highest origin position held per origin site, known through local position `at`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct OriginsSnapshot {
    pub at: Option<(u64, u64)>,
    pub highest: BTreeMap<String, (u64, u64)>,
}

/// A topic's origins, loaded.
#[derive(Debug)]
pub struct Origins {
    snap: OriginsSnapshot,
    /// When the snapshot was last written (None: not since loading).
    saved_at: Option<std::time::Instant>,
    /// Changed since it was last written (the policy beat writes it: [`Topic::flush_origins`]).
    dirty: bool,
    /// An entry landed whose origin was not recorded: the snapshot is not moved to the log's
    /// end until the topic is loaded again.
    hole: bool,
}

/// The origins snapshot is written at most this often: what comes after it is replayed from
/// the log on load, so a rarer snapshot costs only replay time, never a duplicate.
const ORIGINS_SAVE_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// While the origins are loaded and nothing is being received, the snapshot is moved to the
/// end of the log at most this often (entries produced here need no replay), so loading the
/// topic again replays only what came after.
const ORIGINS_ADVANCE_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// A replay of the log writes the snapshot each time it has read this many bytes.
const ORIGINS_REPLAY_SAVE_BYTES: u64 = 64 << 20;

impl Origins {
    fn highest(&self, site: &str) -> Option<OriginPosition> {
        self.snap
            .highest
            .get(site)
            .map(|&(ledger, entry)| OriginPosition { ledger, entry })
    }

    /// The snapshot holds everything up to local position `p` (never moved back).
    fn through(&mut self, p: Position) {
        if self.snap.at.is_none_or(|a| a < (p.ledger_id, p.entry_id)) {
            self.snap.at = Some((p.ledger_id, p.entry_id));
        }
    }

    fn observe(&mut self, site: &str, at: OriginPosition) {
        let e = self
            .snap
            .highest
            .entry(site.to_string())
            .or_insert((at.ledger, at.entry));
        if (at.ledger, at.entry) > *e {
            *e = (at.ledger, at.entry);
        }
    }
}

/// A running replicator of a topic to one remote site.
pub struct Replicator {
    stop: watch::Sender<bool>,
    pub status: Arc<Mutex<ReplicatorStatus>>,
    /// Its cursor's mark-delete position (retention keeps what it has not sent).
    pub(super) mark: Arc<Mutex<Option<Position>>>,
    /// Opened yet (until then, everything counts as needed).
    pub(super) opened: Arc<AtomicBool>,
    /// Set when its remote left the replication clusters: the cursor goes with it.
    delete_cursor: Arc<AtomicBool>,
    /// Asked by a `drop_oldest` replication backlog quota: entries through this position are
    /// not sent (the cursor moves past them at the replicator's next step).
    pub(super) drop_through: Arc<Mutex<Option<Position>>>,
    /// Entries dropped so (since the topic was loaded here).
    pub(super) dropped: Arc<AtomicU64>,
}

/// What a replicator's task shares with its [`Replicator`].
struct Handles {
    stop: watch::Receiver<bool>,
    status: Arc<Mutex<ReplicatorStatus>>,
    mark: Arc<Mutex<Option<Position>>>,
    opened: Arc<AtomicBool>,
    delete_cursor: Arc<AtomicBool>,
    drop_through: Arc<Mutex<Option<Position>>>,
    dropped: Arc<AtomicU64>,
}

impl Replicator {
    fn handles(&self) -> Handles {
        Handles {
            stop: self.stop.subscribe(),
            status: Arc::clone(&self.status),
            mark: Arc::clone(&self.mark),
            opened: Arc::clone(&self.opened),
            delete_cursor: Arc::clone(&self.delete_cursor),
            drop_through: Arc::clone(&self.drop_through),
            dropped: Arc::clone(&self.dropped),
        }
    }
}

async fn open_cursor(topic: &Topic, name: &str) -> Result<ManagedCursor, String> {
    ManagedCursor::open(
        topic.client.clone(),
        Arc::clone(&topic.ml),
        name,
        InitialPosition::Earliest,
    )
    .await
    .map_err(|e| e.to_string())
}

/// One replicator's task: its cursor, then the link loop until stopped; the cursor is
/// deleted after when its remote left the replication clusters.
async fn replicate(
    topic: Arc<Topic>,
    link: Arc<meridian_geo::GeoLink>,
    remote: String,
    partitions: u32,
    h: Handles,
) {
    let cursor_name = format!("{REPL_CURSOR_PREFIX}{remote}");
    let cursor = loop {
        match open_cursor(&topic, &cursor_name).await {
            Ok(c) => break c,
            Err(e) => {
                tracing::warn!(topic = %topic.full_name, remote, error = %e, "opening the replicator's cursor failed; trying again");
                if *h.stop.borrow() {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
    };
    *h.mark.lock().expect("mark lock") = cursor.mark_delete();
    h.opened.store(true, Ordering::Release);
    let mut source = TopicSource {
        remote: remote.clone(),
        appended: topic.appended.subscribe(),
        topic: Arc::clone(&topic),
        cursor,
        cursor_name,
        broken: false,
        mark: h.mark,
        drop_through: h.drop_through,
        dropped: h.dropped,
    };
    let name = topic.full_name.clone();
    tracing::info!(topic = %name, remote, "replicator started");
    let opts = ReplicatorOptions {
        stall_after: link.stall_after(),
        ..ReplicatorOptions::default()
    };
    meridian_geo::replicator::run(
        link,
        remote.clone(),
        name,
        partitions,
        &mut source,
        h.status,
        opts,
        h.stop,
    )
    .await;
    if h.delete_cursor.load(Ordering::Acquire) {
        if let Err(e) = source.cursor.delete().await {
            tracing::warn!(topic = %topic.full_name, remote, error = %e, "deleting the replicator's cursor failed");
        }
    }
}

fn refusal(code: RefusalCode, reason: impl Into<String>) -> Refusal {
    Refusal::new(code, reason)
}

/// A failed append: a terminated topic takes nothing more (asking again soon will not help);
/// anything else may pass.
fn append_refusal(e: meridian_storage::managed_ledger::ManagedLedgerError) -> Refusal {
    let code = match e {
        meridian_storage::managed_ledger::ManagedLedgerError::Terminated { .. } => {
            RefusalCode::NotAllowed
        }
        _ => RefusalCode::Retry,
    };
    refusal(code, e.to_string())
}

impl Topic {
    /// The origins, loaded on first use: the snapshot, then the entries after it.
    async fn origins<'a>(
        &self,
        guard: &'a mut Option<Origins>,
    ) -> Result<&'a mut Origins, Refusal> {
        if guard.is_none() {
            let key = self.origins_key();
            let retry = |e: String| refusal(RefusalCode::Retry, e);
            let mut snap: OriginsSnapshot = match self.meta.get(&key).await {
                Ok(Some(kv)) => serde_json::from_slice(&kv.value)
                    .map_err(|e| retry(format!("origins snapshot {key} is damaged: {e}")))?,
                Ok(None) => OriginsSnapshot::default(),
                Err(e) => return Err(retry(e.to_string())),
            };
            let mut next = match snap.at {
                Some((l, e)) => self.ml.next_position(Position::new(l, e)).await,
                None => self.ml.first_position().await,
            };
            let mut o = Origins {
                snap: OriginsSnapshot::default(),
                saved_at: None,
                dirty: false,
                hole: false,
            };
            std::mem::swap(&mut o.snap, &mut snap);
            let mut replayed = 0u64;
            // Bytes replayed since the snapshot was last written: a long replay keeps its
            // progress, should it be cut short (the next load starts from there).
            let mut unsaved = 0u64;
            while let Some(start) = next {
                if self.repl_closed.load(Ordering::Acquire) {
                    // Closed or being deleted meanwhile: nothing more to load for.
                    return Err(retry(format!("{} is closing", self.full_name)));
                }
                let batch = self
                    .ml
                    .read_range(start, 256)
                    .await
                    .map_err(|e| retry(format!("replaying the topic's origins: {e}")))?;
                let Some(&(last, _)) = batch.last() else {
                    break;
                };
                for (p, bytes) in batch {
                    unsaved += bytes.len() as u64;
                    if let Some(origin) = Entry::parse(bytes)
                        .ok()
                        .and_then(|e| e.origin().ok().flatten())
                    {
                        o.observe(
                            &origin.site,
                            OriginPosition {
                                ledger: origin.ledger_id,
                                entry: origin.entry_id,
                            },
                        );
                    }
                    o.through(p);
                    replayed += 1;
                }
                if unsaved >= ORIGINS_REPLAY_SAVE_BYTES {
                    self.save_origins(&mut o).await;
                    unsaved = 0;
                }
                next = self.ml.next_position(last).await;
            }
            if unsaved > 0 {
                // What was replayed is not replayed again by the next load.
                self.save_origins(&mut o).await;
            }
            tracing::debug!(topic = %self.full_name, replayed, origins = ?o.snap.highest, "replication origins loaded");
            *guard = Some(o);
        }
        Ok(guard.as_mut().expect("loaded above"))
    }

    /// Where the topic's origins snapshot is stored.
    fn origins_key(&self) -> String {
        format!("{ORIGINS_PREFIX}{}", self.ml.name())
    }

    /// The origins snapshot as stored (what a load starts from), if there is one.
    pub async fn stored_origins(&self) -> Result<Option<OriginsSnapshot>, super::BrokerError> {
        let key = self.origins_key();
        match self.meta.get(&key).await? {
            Some(kv) => Ok(serde_json::from_slice(&kv.value).ok()),
            None => Ok(None),
        }
    }

    /// Saves are made under `repl_origins`' lock, and none once the topic stopped receiving
    /// (closed or being deleted): the deletion of the record, under that lock too, is never
    /// followed by a save that brings it back. A save skipped costs only replay time (but
    /// see `inbound::record`: entries held already, not appended, are only in the snapshot).
    /// Whether it was saved.
    async fn save_origins(&self, o: &mut Origins) -> bool {
        if self.repl_closed.load(Ordering::Acquire) {
            return false;
        }
        let key = self.origins_key();
        let value = serde_json::to_vec(&o.snap).expect("origins serialize");
        o.saved_at = Some(std::time::Instant::now());
        match self.meta.put(&key, value).await {
            Ok(_) => {
                o.dirty = false;
                true
            }
            // The next load replays from the older snapshot: nothing is lost, only time.
            Err(e) => {
                tracing::warn!(topic = %self.full_name, error = %e, "saving the replication origins failed");
                false
            }
        }
    }

    /// Starts and stops replicators to follow the replication clusters in `p`.
    pub(super) async fn reconcile_replicators(self: &Arc<Self>, p: &NamespacePolicies) {
        let Some(broker) = self.broker.upgrade() else {
            return;
        };
        let Some(link) = broker.geo.get() else {
            return;
        };
        let local = &self.cfg.cluster_name;
        // A failover drill's cut holds replication to the site it cut over to.
        let held = broker.drill_cut(&self.name.namespace()).map(|c| c.to);
        let want: BTreeSet<String> = p
            .replication_clusters
            .iter()
            .flatten()
            .filter(|c| *c != local)
            .cloned()
            .collect();
        let partitions = match self.name.parent() {
            Some(parent) if self.name.partition().is_some() => broker
                .partitions_of(&parent)
                .await
                .ok()
                .flatten()
                .map_or(0, |(n, _)| n),
            _ => 0,
        };
        if !want.is_empty() {
            self.ensure_sub_sync_if_any().await;
        }
        let mut reps = self.replicators.lock().expect("replicators lock");
        // A topic closed meanwhile (unloaded, deleted) starts nothing more.
        if self.repl_closed.load(Ordering::Acquire) {
            return;
        }
        reps.retain(|remote, r| {
            if held.as_deref() == Some(remote.as_str()) && want.contains(remote) {
                tracing::info!(topic = %self.full_name, remote, "replication to {remote} held by a failover drill's cut (its cursor is kept)");
                let _ = r.stop.send(true);
                return false;
            }
            let keep = want.contains(remote);
            if !keep {
                tracing::info!(topic = %self.full_name, remote, "replication to {remote} stops (no longer in the replication clusters); its cursor is deleted");
                r.delete_cursor
                    .store(true, Ordering::Release);
                let _ = r.stop.send(true);
            }
            keep
        });
        for remote in want {
            if reps.contains_key(&remote) || held.as_deref() == Some(remote.as_str()) {
                continue;
            }
            let r = Replicator {
                stop: watch::channel(false).0,
                status: Arc::new(Mutex::new(ReplicatorStatus::default())),
                mark: Arc::new(Mutex::new(None)),
                opened: Arc::new(AtomicBool::new(false)),
                delete_cursor: Arc::new(AtomicBool::new(false)),
                drop_through: Arc::new(Mutex::new(None)),
                dropped: Arc::new(AtomicU64::new(0)),
            };
            tokio::spawn(replicate(
                Arc::clone(self),
                Arc::clone(link),
                remote.clone(),
                partitions,
                r.handles(),
            ));
            reps.insert(remote, r);
        }
    }

    /// Stops every replicator and starts none again (the topic closes).
    pub(super) fn stop_replicators(&self) {
        let mut reps = self.replicators.lock().expect("replicators lock");
        self.repl_closed.store(true, Ordering::Release);
        for (_, r) in reps.drain() {
            let _ = r.stop.send(true);
        }
    }

    /// Deletes the replicators' cursors and the origins snapshot (the topic is deleted).
    pub(super) async fn delete_replication_state(&self) -> Result<(), super::BrokerError> {
        let prefix = format!(
            "{}{}/",
            meridian_storage::cursor::MANAGED_CURSORS_PREFIX,
            self.ml.name()
        );
        let page = self.meta.children(&prefix, "", 0).await?;
        for c in page
            .children
            .iter()
            .filter(|c| c.starts_with(REPL_CURSOR_PREFIX))
        {
            let mut cursor = ManagedCursor::open(
                self.client.clone(),
                Arc::clone(&self.ml),
                c,
                InitialPosition::Earliest,
            )
            .await?;
            cursor.delete().await?;
        }
        // After any save in flight (made under this lock); none follows (`stop_replicators`
        // closed the topic's receiving).
        let _saves = self.repl_origins.lock().await;
        self.meta.delete(&self.origins_key(), None).await?;
        self.delete_replicated_subs().await?;
        Ok(())
    }

    /// What each replicator has been acknowledged through (`None`: nothing yet, so it needs
    /// the whole log).
    pub(super) fn replicator_marks(&self) -> Vec<Option<Position>> {
        self.replicators
            .lock()
            .expect("replicators lock")
            .values()
            .map(|r| {
                if r.opened.load(Ordering::Acquire) {
                    *r.mark.lock().expect("mark lock")
                } else {
                    None
                }
            })
            .collect()
    }

    /// The replicators' states, by remote site.
    pub fn replication_status(&self) -> BTreeMap<String, ReplicatorStatus> {
        self.replicators
            .lock()
            .expect("replicators lock")
            .iter()
            .map(|(k, r)| (k.clone(), r.status.lock().expect("status lock").clone()))
            .collect()
    }
}

/// A replicator's figures, as `topics stats` shows them.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ReplicationStats {
    pub remote: String,
    /// connecting, connected, disconnected or stalled.
    pub state: String,
    /// Why it is disconnected or stalled.
    pub reason: String,
    /// Since when (ms since the epoch) it is disconnected or stalled; 0 otherwise.
    pub since_ms: u64,
    /// Entries of the log after what the remote acknowledged (those that arrived here by
    /// replication too, which are passed over, not sent).
    pub backlog_entries: u64,
    /// How old the oldest of them is (its publish time), ms; 0 without a backlog.
    pub oldest_unreplicated_age_ms: u64,
    /// The last position the remote acknowledged, `ledger:entry`; empty: none yet.
    pub last_acked: String,
    /// Entries the remote acknowledged since the replicator started.
    pub entries_acked: u64,
    /// Entries a `drop_oldest` replication backlog quota kept from the remote (since the
    /// topic was loaded here).
    pub dropped_entries: u64,
}

impl Topic {
    /// Each replicator's figures, by remote site (from its cursor: an unload does not reset
    /// them).
    pub async fn replication_stats(&self) -> Vec<ReplicationStats> {
        let reps: Vec<(String, ReplicatorStatus, Option<Position>, bool, u64)> = self
            .replicators
            .lock()
            .expect("replicators lock")
            .iter()
            .map(|(k, r)| {
                (
                    k.clone(),
                    r.status.lock().expect("status lock").clone(),
                    *r.mark.lock().expect("mark lock"),
                    r.opened.load(Ordering::Acquire),
                    r.dropped.load(Ordering::Relaxed),
                )
            })
            .collect();
        let mut out = Vec::new();
        for (remote, st, mark, opened, dropped_entries) in reps {
            let (state, reason, since_ms) = match st.state {
                LinkState::Connecting => ("connecting", String::new(), 0),
                LinkState::Connected => ("connected", String::new(), 0),
                LinkState::Disconnected { since_ms, reason } => ("disconnected", reason, since_ms),
                LinkState::Stalled { since_ms, reason } => ("stalled", reason, since_ms),
            };
            let (backlog_entries, oldest_unreplicated_age_ms) = self
                .replication_backlog(if opened { mark } else { None })
                .await;
            out.push(ReplicationStats {
                remote,
                state: state.to_string(),
                reason,
                since_ms,
                backlog_entries,
                oldest_unreplicated_age_ms,
                last_acked: st
                    .last_acked
                    .map(|p| format!("{}:{}", p.ledger, p.entry))
                    .unwrap_or_default(),
                entries_acked: st.entries_acked,
                dropped_entries,
            });
        }
        out.sort_by(|a, b| a.remote.cmp(&b.remote));
        out
    }

    /// Entries after `mark` (all kept ones when `None`) and the age of the first of them.
    pub(super) async fn replication_backlog(&self, mark: Option<Position>) -> (u64, u64) {
        let Some(last) = self.ml.last_confirmed() else {
            return (0, 0);
        };
        let first = match mark {
            Some(m) if m >= last => return (0, 0),
            Some(m) => self.ml.next_position(m).await,
            None => self.ml.first_position().await,
        };
        let Some(first) = first else {
            return (0, 0);
        };
        let (Some(a), Some(b)) = (self.ml.index_of(first).await, self.ml.index_of(last).await)
        else {
            return (0, 0);
        };
        let age = match self
            .ml
            .read(first)
            .await
            .ok()
            .and_then(|b| Entry::parse(b).ok())
        {
            Some(e) => e.metadata().map_or(0, |m| {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64);
                now.saturating_sub(m.publish_time)
            }),
            None => 0,
        };
        (b.saturating_sub(a) + 1, age)
    }

    /// Whether the topic replicates to another site (its replicators keep it loaded).
    pub fn replicates(&self) -> bool {
        !self
            .replicators
            .lock()
            .expect("replicators lock")
            .is_empty()
    }
}

/// About how many bytes a replicator reads from the log at a time (it stops at the chunk
/// that reaches them), and at most how many entries.
const READ_BYTES: u64 = 4 << 20;
const READ_ENTRIES_MAX: usize = 4096;

/// The topic's log through a replicator's cursor.
struct TopicSource {
    /// The site it sends to.
    remote: String,
    topic: Arc<Topic>,
    cursor: ManagedCursor,
    cursor_name: String,
    /// A move of the cursor failed (fenced, or the store unreachable): it is opened again
    /// before the next session.
    broken: bool,
    appended: watch::Receiver<Option<Position>>,
    mark: Arc<Mutex<Option<Position>>>,
    drop_through: Arc<Mutex<Option<Position>>>,
    dropped: Arc<AtomicU64>,
}

impl TopicSource {
    /// Whether an entry goes to this remote: produced here (not arrived by replication), and
    /// not restricted by its producer to other sites (`replicate_to`, which the clients'
    /// `replication_clusters` and `disable_replication` set).
    fn sends(&self, m: &meridian_protocol::pb::MessageMetadata) -> bool {
        m.meridian_origin.is_none()
            && (m.replicate_to.is_empty() || m.replicate_to.contains(&self.remote))
    }

    /// Moves the cursor past what a `drop_oldest` quota asked to drop, counting the entries.
    async fn apply_drop(&mut self) -> Result<(), String> {
        let Some(through) = *self.drop_through.lock().expect("drop lock") else {
            return Ok(());
        };
        let mark = self.cursor.mark_delete();
        if mark.is_none_or(|m| m < through) {
            let ml = &self.topic.ml;
            let first = match mark {
                Some(m) => ml.index_of(m).await.map(|i| i + 1),
                None => match ml.first_position().await {
                    Some(p) => ml.index_of(p).await,
                    None => None,
                },
            };
            let n = match (first, ml.index_of(through).await) {
                (Some(a), Some(b)) => (b + 1).saturating_sub(a),
                _ => 0,
            };
            if let Err(e) = self.cursor.ack_cumulative(through).await {
                self.broken = true;
                return Err(format!("dropping the oldest entries: {e}"));
            }
            *self.mark.lock().expect("mark lock") = self.cursor.mark_delete();
            self.dropped.fetch_add(n, Ordering::Relaxed);
            metrics::counter!("meridian_replication_dropped_entries_total", "remote" => self.remote.clone())
                .increment(n);
            tracing::warn!(topic = %self.topic.full_name, remote = %self.remote, entries = n, through = %format!("{}:{}", through.ledger_id, through.entry_id), "replication backlog quota (drop_oldest): the oldest unreplicated entries are not sent");
        }
        let mut g = self.drop_through.lock().expect("drop lock");
        if *g == Some(through) {
            *g = None;
        }
        Ok(())
    }
}

impl ReplicaSource for TopicSource {
    fn rewind(&mut self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            if self.broken {
                self.cursor = open_cursor(&self.topic, &self.cursor_name).await?;
                self.broken = false;
            }
            self.apply_drop().await?;
            self.cursor.rewind();
            Ok(())
        })
    }

    fn available(&mut self, max: usize) -> BoxFuture<'_, Result<Vec<SourceEntry>, String>> {
        Box::pin(async move {
            self.apply_drop().await?;
            // Seen before reading: an append after this wakes `wait_for_more`.
            self.appended.borrow_and_update();
            // Read in small chunks until about READ_BYTES (many small entries, few large
            // ones): what one read holds stays bounded whatever the entries' sizes.
            let chunk = max.clamp(1, 64);
            let mut entries = Vec::new();
            let mut bytes = 0u64;
            while entries.len() < READ_ENTRIES_MAX && bytes < READ_BYTES {
                let got = self
                    .cursor
                    .read_entries(chunk.min(READ_ENTRIES_MAX - entries.len()))
                    .await
                    .map_err(|e| format!("reading {}: {e}", self.topic.full_name))?;
                if got.is_empty() {
                    break;
                }
                bytes += got.iter().map(|(_, b)| b.len() as u64).sum::<u64>();
                entries.extend(got);
            }
            Ok(entries
                .into_iter()
                .map(|(p, bytes)| {
                    let meta = Entry::parse(bytes.clone())
                        .ok()
                        .and_then(|e| e.metadata().ok());
                    SourceEntry {
                        at: OriginPosition {
                            ledger: p.ledger_id,
                            entry: p.entry_id,
                        },
                        bytes,
                        send: meta.is_some_and(|m| self.sends(&m)),
                    }
                })
                .collect())
        })
    }

    fn wait_for_more(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if self.appended.changed().await.is_err() {
                futures::future::pending::<()>().await;
            }
        })
    }

    fn done(&mut self, pos: OriginPosition) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            if let Err(e) = self
                .cursor
                .ack_cumulative(Position::new(pos.ledger, pos.entry))
                .await
            {
                self.broken = true;
                return Err(format!("moving the replicator's cursor: {e}"));
            }
            *self.mark.lock().expect("mark lock") = self.cursor.mark_delete();
            Ok(())
        })
    }

    fn settle(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if self.broken {
                match open_cursor(&self.topic, &self.cursor_name).await {
                    Ok(c) => {
                        self.cursor = c;
                        self.broken = false;
                    }
                    Err(_) => return,
                }
            }
            if let Err(e) = self.apply_drop().await {
                tracing::warn!(topic = %self.topic.full_name, remote = %self.remote, error = %e, "applying the replication backlog quota failed");
            }
        })
    }
}

/// The receiving side: a broker's [`ReplicaSink`] (held weakly: the link lives in the broker).
pub struct GeoSink(pub Weak<Broker>);

impl Broker {
    /// Refused unless `name`'s namespace exists here and its replication clusters (the
    /// topic's own, else its namespace's) name site `origin`.
    pub(crate) async fn check_replicated_with(
        &self,
        name: &TopicName,
        origin: &str,
    ) -> Result<(), Refusal> {
        let retry = |e: super::BrokerError| refusal(RefusalCode::Retry, e.to_string());
        let ns = name.namespace();
        if !self.namespace_exists(&ns).await.map_err(retry)? {
            return Err(refusal(
                RefusalCode::NotAllowed,
                format!(
                    "namespace {ns} does not exist at site {}",
                    self.cfg.cluster_name
                ),
            ));
        }
        let p = self.namespace_policies(&ns).await.map_err(retry)?;
        let key = self.own_policies_key(name).await.map_err(retry)?;
        let own = self.topic_own_policies(&key).await.map_err(retry)?;
        let clusters = p.overlaid(&own).replication_clusters.unwrap_or_default();
        if !clusters.iter().any(|c| c == origin) {
            return Err(refusal(
                RefusalCode::NotAllowed,
                format!(
                    "{name} at site {} is not replicated with site {origin} (its replication clusters: {})",
                    self.cfg.cluster_name,
                    clusters.join(",")
                ),
            ));
        }
        Ok(())
    }
}

impl GeoSink {
    /// The broker, and `topic` if site `origin` replicates it with this site.
    async fn replicated_topic(
        &self,
        origin: &str,
        topic: &str,
    ) -> Result<(Arc<Broker>, TopicName), Refusal> {
        let broker = self
            .0
            .upgrade()
            .ok_or_else(|| refusal(RefusalCode::Retry, "the broker is shutting down"))?;
        let name =
            TopicName::parse(topic).map_err(|e| refusal(RefusalCode::Protocol, e.to_string()))?;
        broker.check_replicated_with(&name, origin).await?;
        Ok((broker, name))
    }
}

impl ReplicaSink for GeoSink {
    fn sync<'a>(
        &'a self,
        origin: &'a str,
        doc: bytes::Bytes,
    ) -> BoxFuture<'a, Result<(u32, u32), Refusal>> {
        Box::pin(async move {
            let broker = self
                .0
                .upgrade()
                .ok_or_else(|| refusal(RefusalCode::Retry, "the broker is shutting down"))?;
            broker.merge_global(origin, &doc).await
        })
    }

    fn sub_sync<'a>(
        &'a self,
        origin: &'a str,
        topic: &'a str,
        doc: bytes::Bytes,
    ) -> BoxFuture<'a, Result<bytes::Bytes, Refusal>> {
        Box::pin(async move {
            let (broker, name) = self.replicated_topic(origin, topic).await?;
            let retry = |e: super::BrokerError| refusal(RefusalCode::Retry, e.to_string());
            if let Some(url) = broker.geo_owner_elsewhere(&name).await.map_err(retry)? {
                return Err(refusal(RefusalCode::Moved, url));
            }
            let t = broker.topic(&name, true).await.map_err(retry)?;
            t.take_sub_sync(origin, &doc).await
        })
    }

    fn delete<'a>(
        &'a self,
        origin: &'a str,
        topic: &'a str,
        deleted_at_ms: u64,
    ) -> BoxFuture<'a, Result<(), Refusal>> {
        Box::pin(async move {
            let broker = self
                .0
                .upgrade()
                .ok_or_else(|| refusal(RefusalCode::Retry, "the broker is shutting down"))?;
            broker.delete_for_site(origin, topic, deleted_at_ms).await
        })
    }

    fn open<'a>(
        &'a self,
        origin: &'a str,
        topic: &'a str,
        partitions: u32,
    ) -> BoxFuture<'a, Result<(Box<dyn ReplicaTopic>, Option<OriginPosition>), Refusal>> {
        Box::pin(async move {
            let (broker, name) = self.replicated_topic(origin, topic).await?;
            let retry = |e: super::BrokerError| refusal(RefusalCode::Retry, e.to_string());
            if let Some(link) = broker.geo.get() {
                let grace = link.tombstone_grace();
                if let Some(t) = broker.live_tombstone(&name, grace).await.map_err(retry)? {
                    return Err(refusal(
                        RefusalCode::NotAllowed,
                        format!(
                            "{} was deleted at site {} ({} s ago): a tombstone keeps its late entries out",
                            t.topic,
                            t.site,
                            super::now_ms().saturating_sub(t.deleted_at_ms) / 1000
                        ),
                    ));
                }
            }
            if partitions > 0 {
                let parent = name
                    .parent()
                    .filter(|_| name.partition().is_some_and(|i| i < partitions))
                    .ok_or_else(|| {
                        refusal(
                            RefusalCode::Protocol,
                            format!("{topic} is not a partition of a topic of {partitions}"),
                        )
                    })?;
                match broker.partitions_of(&parent).await.map_err(retry)? {
                    Some((n, _)) if n == partitions => {}
                    Some((n, _)) => {
                        return Err(refusal(
                            RefusalCode::NotAllowed,
                            format!(
                            "{parent} has {n} partitions at site {}, {partitions} at site {origin}",
                            broker.cfg.cluster_name
                        ),
                        ))
                    }
                    None => {
                        if let Err(e) = broker.create_partitioned_topic(&parent, partitions).await {
                            // Created meanwhile by another stream: checked again next time.
                            tracing::debug!(topic = %parent, error = %e, "creating the partitioned topic of a replicated partition");
                        }
                    }
                }
            }
            // Served by the broker that owns it: another one sends the stream there.
            if let Some(url) = broker.geo_owner_elsewhere(&name).await.map_err(retry)? {
                return Err(refusal(RefusalCode::Moved, url));
            }
            let t = broker.topic(&name, true).await.map_err(retry)?;
            let (last, epoch) = t.held_from(origin).await?;
            let target: Box<dyn ReplicaTopic> =
                Box::new(inbound::Incoming::new(t, origin, last, epoch));
            Ok((target, last))
        })
    }
}
