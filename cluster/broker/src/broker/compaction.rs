//! Topic compaction, as Pulsar's: a topic's compacted view keeps, up to a horizon, only the
//! latest message of each key (the partition key); an empty message removes its key; messages
//! without a key are dropped. Compacted readers (`read_compacted`) read the view, then the log
//! after the horizon. See `design/topic-compaction.md`.
//!
//! A run reads the previous view and the log after its horizon twice: once to learn each key's
//! latest message ([`KeyMap`]), once to write what is retained to a new ledger
//! ([`meridian_storage::compacted`]). The one commit point is the compare-and-set of the
//! topic's record (`/topic-compaction/<log>`) that names the new ledger; the new view is
//! installed in memory before the `__compaction` subscription (which pins everything after
//! the horizon, so nothing uncompacted is trimmed) moves to the horizon, and the previous
//! ledger is deleted after that. A crash anywhere leaves the old view or the new one whole;
//! what a crashed run had written is deleted when the topic is next loaded.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use meridian_metadata::client::{ClientError, PutOptions};
use meridian_protocol::batch::BatchIter;
use meridian_protocol::pb::ServerError;
use meridian_protocol::Entry;
use meridian_storage::compacted::{CompactedEntry, CompactedView, CompactedViewError};
use meridian_storage::managed_ledger::Position;
use serde::{Deserialize, Serialize};

use super::{now_ms, BrokerError, Topic};

/// Where each topic's compaction record is kept, by managed-ledger name.
pub const TOPIC_COMPACTION_PREFIX: &str = "/topic-compaction/";
/// The durable subscription that pins what is not compacted yet.
pub const COMPACTION_SUBSCRIPTION: &str = "__compaction";
/// Entries read from the log at once, and adds to the new ledger in flight.
const CHUNK: usize = 500;

/// Compactions running at once on a broker; more wait (RUNNING meanwhile).
static RUNNING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

impl From<CompactedViewError> for BrokerError {
    fn from(e: CompactedViewError) -> Self {
        BrokerError::new(ServerError::PersistenceError, e.to_string())
    }
}

/// A topic's compaction record.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CompactionRecord {
    /// The view's ledger (`None` with a horizon: nothing was retained).
    pub ledger: Option<u64>,
    /// The last position the view covers; `None`: never compacted.
    pub horizon: Option<Position>,
    pub entries: u64,
    pub bytes: u64,
    /// A ledger a run is writing (deleted if the run never commits).
    pub in_progress: Option<u64>,
    /// Ledgers of earlier views, to delete.
    pub retired: Vec<u64>,
}

/// The state of the last compaction on this broker (Pulsar's `LongRunningProcessStatus`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    NotRun,
    Running,
    Success,
    Error(String),
}

impl Status {
    pub fn name(&self) -> &'static str {
        match self {
            Status::NotRun => "NOT_RUN",
            Status::Running => "RUNNING",
            Status::Success => "SUCCESS",
            Status::Error(_) => "ERROR",
        }
    }
}

/// Figures of the last runs, for stats.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LastRun {
    pub last_succeed_ms: u64,
    pub last_failed_ms: u64,
    pub last_duration_ms: u64,
    /// Messages the last successful run removed.
    pub last_removed_messages: u64,
}

/// A topic's compaction: its view and the state of its runs.
#[derive(Debug)]
pub struct Compaction {
    status: Mutex<Status>,
    view: Mutex<Option<Arc<CompactedView>>>,
    last: Mutex<LastRun>,
    /// The topic was closed (unloaded) or deleted: a run stops at its next step, and none
    /// starts.
    stopped: std::sync::atomic::AtomicBool,
}

impl Default for Compaction {
    fn default() -> Self {
        Compaction {
            status: Mutex::new(Status::NotRun),
            view: Mutex::new(None),
            last: Mutex::new(LastRun::default()),
            stopped: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

impl Compaction {
    pub fn status(&self) -> Status {
        self.status.lock().expect("status lock").clone()
    }

    pub fn last_run(&self) -> LastRun {
        self.last.lock().expect("last lock").clone()
    }

    /// The compacted view, if the topic was ever compacted.
    pub fn view(&self) -> Option<Arc<CompactedView>> {
        self.view.lock().expect("view lock").clone()
    }

    /// Stops runs on this topic instance (it is closed or deleted; another instance may load
    /// the topic and compact it).
    pub fn stop(&self) {
        self.stopped
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// An error if the topic was closed or deleted.
    fn check_live(&self, topic: &Topic) -> Result<(), BrokerError> {
        if self.stopped.load(std::sync::atomic::Ordering::Acquire) {
            return Err(BrokerError::new(
                ServerError::ServiceNotReady,
                format!(
                    "{} was closed or deleted; compaction stopped",
                    topic.full_name()
                ),
            ));
        }
        Ok(())
    }

    /// Marks a run as started; false if one runs already.
    fn begin(&self) -> bool {
        let mut s = self.status.lock().expect("status lock");
        if *s == Status::Running {
            return false;
        }
        *s = Status::Running;
        true
    }

    fn finish(&self, result: &Result<u64, BrokerError>, started: Instant) {
        let mut last = self.last.lock().expect("last lock");
        last.last_duration_ms = started.elapsed().as_millis() as u64;
        let status = match result {
            Ok(removed) => {
                last.last_succeed_ms = now_ms();
                last.last_removed_messages = *removed;
                Status::Success
            }
            Err(e) => {
                last.last_failed_ms = now_ms();
                Status::Error(e.message.clone())
            }
        };
        *self.status.lock().expect("status lock") = status;
    }
}

/// What compaction sees in one entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Items {
    /// One message: its key, and whether it is empty (a tombstone).
    Single(Option<String>, bool),
    /// A batch: each message's key and whether it is empty.
    Batch(Vec<(Option<String>, bool)>),
    /// Kept as it is (a compressed or encrypted batch: its keys cannot be read here).
    Whole,
    /// Never retained (a marker, or an entry that cannot be parsed).
    Skip,
}

impl Items {
    /// Reads an entry as stored in the log.
    pub fn of(bytes: &Bytes) -> Items {
        let Ok(entry) = Entry::parse(bytes.clone()) else {
            return Items::Skip;
        };
        let Ok(meta) = entry.metadata() else {
            return Items::Skip;
        };
        if meta.marker_type.is_some() {
            return Items::Skip;
        }
        let key = |k: Option<String>| k.filter(|k| !k.is_empty());
        let compressed = meta.compression.unwrap_or(0) != 0;
        if meta.num_messages_in_batch.is_none() {
            let empty = if compressed {
                meta.uncompressed_size == Some(0)
            } else {
                entry.payload().is_empty()
            };
            return Items::Single(key(meta.partition_key), empty);
        }
        if compressed || meta.encryption_param.is_some() {
            return Items::Whole;
        }
        let mut items = Vec::new();
        for item in BatchIter::new(entry.payload()) {
            let Ok(m) = item.as_ref().map(|i| i.decode_metadata()) else {
                return Items::Whole;
            };
            let Ok(m) = m else {
                return Items::Whole;
            };
            let empty = m.payload_size == 0 || m.null_value == Some(true);
            items.push((key(m.partition_key), empty));
        }
        if items.is_empty() {
            return Items::Skip;
        }
        Items::Batch(items)
    }

    /// Messages in the entry (a batch's items; 1 otherwise).
    fn messages(&self) -> u64 {
        match self {
            Items::Batch(v) => v.len() as u64,
            _ => 1,
        }
    }
}

fn bit(mask: Option<&[u64]>, i: usize) -> bool {
    mask.is_none_or(|m| m.get(i / 64).is_some_and(|w| w >> (i % 64) & 1 == 1))
}

/// Each key's latest message (entry, index in its batch), over entries given in log order.
#[derive(Debug, Default)]
pub struct KeyMap {
    latest: HashMap<String, (Position, u32)>,
    keys_max: usize,
    /// Messages seen (retained or not).
    pub messages: u64,
}

impl KeyMap {
    pub fn new(keys_max: usize) -> KeyMap {
        KeyMap {
            keys_max,
            ..KeyMap::default()
        }
    }

    /// Takes in an entry; `mask` says which of its messages an earlier view retained.
    pub fn add(
        &mut self,
        pos: Position,
        items: &Items,
        mask: Option<&[u64]>,
    ) -> Result<(), String> {
        let mut one = |key: &Option<String>, empty: bool, i: u32| -> Result<(), String> {
            let Some(k) = key else { return Ok(()) };
            if empty {
                self.latest.remove(k);
                return Ok(());
            }
            if self.latest.len() >= self.keys_max && !self.latest.contains_key(k) {
                return Err(format!(
                    "the topic has more than {} distinct keys (broker.compaction_keys_max)",
                    self.keys_max
                ));
            }
            self.latest.insert(k.clone(), (pos, i));
            Ok(())
        };
        match items {
            Items::Single(k, empty) => one(k, *empty, 0)?,
            Items::Batch(v) => {
                for (i, (k, empty)) in v.iter().enumerate() {
                    if bit(mask, i) {
                        one(k, *empty, i as u32)?;
                    }
                }
            }
            Items::Whole | Items::Skip => {}
        }
        self.messages += match (items, mask) {
            (Items::Batch(v), Some(_)) => (0..v.len()).filter(|i| bit(mask, *i)).count() as u64,
            _ => items.messages(),
        };
        Ok(())
    }

    /// What of the entry is retained once every entry was taken in: `None` nothing,
    /// `Some(None)` all of it, `Some(Some(mask))` the messages whose bits are set.
    pub fn retained(&self, pos: Position, items: &Items) -> Option<Option<Vec<u64>>> {
        let latest = |k: &Option<String>, i: u32| {
            k.as_ref()
                .is_some_and(|k| self.latest.get(k) == Some(&(pos, i)))
        };
        match items {
            Items::Whole => Some(None),
            Items::Skip => None,
            Items::Single(k, _) => latest(k, 0).then_some(None),
            Items::Batch(v) => {
                let mut mask = vec![0u64; v.len().div_ceil(64)];
                let mut kept = 0;
                for (i, (k, _)) in v.iter().enumerate() {
                    if latest(k, i as u32) {
                        mask[i / 64] |= 1 << (i % 64);
                        kept += 1;
                    }
                }
                match kept {
                    0 => None,
                    n if n == v.len() => Some(None),
                    _ => Some(Some(mask)),
                }
            }
        }
    }
}

/// The entries a run reads, in log order: the previous view's, then the log's after its
/// horizon through `to`.
struct Source {
    view: Option<Arc<CompactedView>>,
    view_next: u64,
    log_next: Option<Position>,
    to: Position,
}

impl Source {
    async fn new(topic: &Topic, view: Option<Arc<CompactedView>>, to: Position) -> Source {
        let log_next = match view.as_ref() {
            Some(v) => topic.ml.next_position(v.horizon).await,
            None => topic.ml.first_position().await,
        };
        Source {
            view,
            view_next: 0,
            log_next,
            to,
        }
    }

    /// The next entries: (position, mask of an earlier view, bytes); empty at the end.
    async fn next(
        &mut self,
        topic: &Topic,
    ) -> Result<Vec<(Position, Option<Vec<u64>>, Bytes)>, BrokerError> {
        if let Some(v) = self.view.as_ref().filter(|v| self.view_next < v.entries) {
            let end = (self.view_next + CHUNK as u64).min(v.entries);
            let reads = futures::future::join_all((self.view_next..end).map(|i| v.read(i))).await;
            self.view_next = end;
            return reads
                .into_iter()
                .map(|r| r.map(|e| (e.position, e.mask, e.bytes)).map_err(Into::into))
                .collect();
        }
        let Some(from) = self.log_next.filter(|p| *p <= self.to) else {
            return Ok(Vec::new());
        };
        let mut got = topic.ml.read_range(from, CHUNK).await?;
        got.retain(|(p, _)| *p <= self.to);
        self.log_next = match got.last() {
            Some((last, _)) if *last < self.to => topic.ml.next_position(*last).await,
            _ => None,
        };
        Ok(got.into_iter().map(|(p, b)| (p, None, b)).collect())
    }
}

fn record_key(topic: &Topic) -> String {
    format!("{TOPIC_COMPACTION_PREFIX}{}", topic.ml.name())
}

/// The topic's record and its version (0: none).
async fn read_record(topic: &Topic) -> Result<(CompactionRecord, u64), BrokerError> {
    match topic.meta.get(&record_key(topic)).await? {
        Some(kv) => {
            let r = serde_json::from_slice(&kv.value).map_err(|e| {
                BrokerError::new(
                    ServerError::MetadataError,
                    format!("compaction record of {}: {e}", topic.full_name()),
                )
            })?;
            Ok((r, kv.mod_revision))
        }
        None => Ok((CompactionRecord::default(), 0)),
    }
}

/// Writes the record if it is still at `version`; returns the new version.
async fn write_record(
    topic: &Topic,
    r: &CompactionRecord,
    version: u64,
) -> Result<u64, BrokerError> {
    let opts = PutOptions {
        expected_version: Some(version),
        ..PutOptions::default()
    };
    let value = serde_json::to_vec(r).expect("serializable");
    match topic.meta.put_with(&record_key(topic), value, opts).await {
        Ok(p) => Ok(p.version),
        Err(ClientError::Conflict { .. }) => Err(BrokerError::new(
            ServerError::ServiceNotReady,
            format!(
                "the compaction record of {} changed meanwhile (another broker?)",
                topic.full_name()
            ),
        )),
        Err(e) => Err(e.into()),
    }
}

async fn delete_ledgers(topic: &Topic, ids: &[u64]) -> bool {
    let mut all = true;
    for id in ids {
        match topic.client.delete(*id).await {
            Ok(()) => {}
            Err(meridian_storage::ledger::LedgerError::NoSuchLedger(_)) => {}
            Err(e) => {
                all = false;
                tracing::warn!(topic = %topic.full_name(), ledger = id, error = %e, "deleting a compacted ledger failed");
            }
        }
    }
    all
}

/// At load: deletes what crashed runs left, opens the view, and moves `__compaction` up to
/// the horizon if a crash came between the commit and its acknowledgement.
pub(super) async fn restore(topic: &Arc<Topic>) -> Result<(), BrokerError> {
    let (mut r, version) = read_record(topic).await?;
    if version == 0 {
        return Ok(());
    }
    let mut gone: Vec<u64> = r.retired.clone();
    gone.extend(r.in_progress);
    if !gone.is_empty() && delete_ledgers(topic, &gone).await {
        r.retired.clear();
        r.in_progress = None;
        if let Err(e) = write_record(topic, &r, version).await {
            tracing::warn!(topic = %topic.full_name(), error = %e, "updating the compaction record failed");
        }
    }
    let Some(horizon) = r.horizon else {
        return Ok(());
    };
    match CompactedView::open(&topic.client, r.ledger, horizon, r.entries, r.bytes).await {
        Ok(view) => *topic.compaction.view.lock().expect("view lock") = Some(Arc::new(view)),
        Err(e) => {
            // The topic still serves; compacted readers read the log until a new compaction
            // writes a view again.
            tracing::error!(topic = %topic.full_name(), error = %e, "the compacted view cannot be opened; compacted readers read the log");
            *topic.compaction.status.lock().expect("status lock") =
                Status::Error(format!("the compacted view cannot be opened: {e}"));
        }
    }
    if topic
        .durable_subscriptions()
        .await?
        .iter()
        .any(|s| s == COMPACTION_SUBSCRIPTION)
    {
        let sub = topic
            .subscription_for_admin(COMPACTION_SUBSCRIPTION)
            .await?;
        if sub.mark_delete().await.is_none_or(|md| md < horizon) {
            sub.ack_through(horizon).await?;
        }
    }
    Ok(())
}

/// Deletes the topic's compaction record and ledgers (with the topic).
pub(super) async fn delete(topic: &Topic) -> Result<(), BrokerError> {
    let (r, version) = read_record(topic).await?;
    if version == 0 {
        return Ok(());
    }
    let mut ids = r.retired.clone();
    ids.extend(r.in_progress);
    ids.extend(r.ledger);
    delete_ledgers(topic, &ids).await;
    *topic.compaction.view.lock().expect("view lock") = None;
    topic.meta.delete(&record_key(topic), None).await?;
    Ok(())
}

/// What deleting the topic removes of its compaction.
pub(super) async fn deletion_plan(topic: &Topic) -> Result<Vec<String>, BrokerError> {
    let (r, _) = read_record(topic).await?;
    let mut ids: Vec<String> = r
        .ledger
        .iter()
        .chain(&r.retired)
        .chain(&r.in_progress)
        .map(u64::to_string)
        .collect();
    ids.dedup();
    Ok(if ids.is_empty() {
        Vec::new()
    } else {
        vec![format!(
            "compacted ledgers {} of {}",
            ids.join(","),
            topic.full_name()
        )]
    })
}

/// The threshold policy: compacts the topic once more than `threshold` bytes wait behind
/// the compaction's subscription (created, from the first entry, when a threshold first
/// applies).
pub(super) async fn check_threshold(topic: &Arc<Topic>, threshold: u64) -> Result<(), BrokerError> {
    if topic.compaction.status() == Status::Running {
        return Ok(());
    }
    topic.compaction.check_live(topic)?;
    topic.create_subscription(COMPACTION_SUBSCRIPTION).await?;
    let backlog = topic
        .subscription_for_admin(COMPACTION_SUBSCRIPTION)
        .await?
        .backlog()
        .await;
    if backlog.bytes > threshold {
        start(topic);
    }
    Ok(())
}

/// Starts a compaction of the topic in the background; false if one runs already.
pub fn start(topic: &Arc<Topic>) -> bool {
    if !topic.compaction.begin() {
        return false;
    }
    let topic = Arc::clone(topic);
    tokio::spawn(async move {
        let started = Instant::now();
        let result = match RUNNING.acquire().await {
            Ok(_permit) => run(&topic).await,
            Err(_) => Err(BrokerError::new(
                ServerError::ServiceNotReady,
                "shutting down",
            )),
        };
        let counter =
            |r: &'static str| metrics::counter!("meridian_compaction_runs_total", "result" => r);
        match &result {
            Ok(removed) => {
                counter("success").increment(1);
                metrics::counter!("meridian_compaction_removed_messages_total").increment(*removed);
                tracing::info!(topic = %topic.full_name(), removed, ms = started.elapsed().as_millis() as u64, "topic compacted");
            }
            Err(e) => {
                counter("error").increment(1);
                tracing::warn!(topic = %topic.full_name(), error = %e, "compaction failed");
            }
        }
        metrics::histogram!("meridian_compaction_duration_seconds")
            .record(started.elapsed().as_secs_f64());
        topic.compaction.finish(&result, started);
    });
    true
}

/// One run; returns how many messages it removed.
async fn run(topic: &Arc<Topic>) -> Result<u64, BrokerError> {
    topic.compaction.check_live(topic)?;
    // Pins what is not compacted yet (from the first entry if it is new).
    topic.create_subscription(COMPACTION_SUBSCRIPTION).await?;
    let (record, version) = read_record(topic).await?;
    let Some(to) = topic.ml.last_confirmed() else {
        return Ok(0);
    };
    if crate::failpoint::hit("compaction:pause_1s") {
        // Tests: a run that certainly lasts while other requests come.
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
    let old = topic.compaction.view();
    if old.as_ref().is_some_and(|v| v.horizon >= to) {
        return Ok(0);
    }
    // Phase 1: each key's latest message.
    let mut keys = KeyMap::new(topic.cfg.compaction_keys_max as usize);
    let mut src = Source::new(topic, old.clone(), to).await;
    loop {
        let chunk = src.next(topic).await?;
        if chunk.is_empty() {
            break;
        }
        for (pos, mask, bytes) in &chunk {
            keys.add(*pos, &Items::of(bytes), mask.as_deref())
                .map_err(|e| BrokerError::new(ServerError::NotAllowedError, e))?;
        }
    }
    drop(src);
    // Phase 2: what is retained, to a new ledger.
    let cfg = &topic.cfg;
    let mut props = topic.ml.placement_properties();
    props.extend([
        ("compacted-topic".to_string(), topic.full_name().to_string()),
        ("horizon".to_string(), to.to_string()),
    ]);
    let writer = topic
        .client
        .create(
            cfg.ensemble as usize,
            cfg.write_quorum as usize,
            cfg.ack_quorum as usize,
            props,
        )
        .await
        .map_err(|e| BrokerError::new(ServerError::PersistenceError, e.to_string()))?;
    let ledger = writer.id();
    let mut record_now = CompactionRecord {
        in_progress: Some(ledger),
        ..record.clone()
    };
    let written = async {
        let version = write_record(topic, &record_now, version).await?;
        let mut src = Source::new(topic, old.clone(), to).await;
        let mut in_flight = VecDeque::new();
        let (mut entries, mut bytes, mut kept) = (0u64, 0u64, 0u64);
        let failed = |e: meridian_storage::ledger::LedgerError| {
            BrokerError::new(ServerError::PersistenceError, e.to_string())
        };
        loop {
            let chunk = src.next(topic).await?;
            if chunk.is_empty() {
                break;
            }
            for (pos, _, b) in chunk {
                let items = Items::of(&b);
                let Some(mask) = keys.retained(pos, &items) else {
                    continue;
                };
                kept += match &mask {
                    Some(m) => m.iter().map(|w| u64::from(w.count_ones())).sum(),
                    None => items.messages(),
                };
                let e = CompactedEntry {
                    position: pos,
                    mask,
                    bytes: b,
                }
                .encode();
                entries += 1;
                bytes += e.len() as u64;
                in_flight.push_back(writer.add_queued(e).await);
                if in_flight.len() >= CHUNK {
                    if let Some(rx) = in_flight.pop_front() {
                        rx.await
                            .map_err(|_| {
                                BrokerError::new(
                                    ServerError::PersistenceError,
                                    "the ledger writer stopped",
                                )
                            })?
                            .map_err(failed)?;
                    }
                }
            }
        }
        for rx in in_flight {
            rx.await
                .map_err(|_| {
                    BrokerError::new(ServerError::PersistenceError, "the ledger writer stopped")
                })?
                .map_err(failed)?;
        }
        Ok::<_, BrokerError>((version, entries, bytes, kept))
    }
    .await;
    let closed = writer.close().await;
    let (version, entries, bytes, kept) = match (written, closed) {
        (Ok(w), Ok(_)) => w,
        (Err(e), _) => return Err(abandon(topic, ledger, e).await),
        (Ok(_), Err(e)) => {
            let e = BrokerError::new(ServerError::PersistenceError, e.to_string());
            return Err(abandon(topic, ledger, e).await);
        }
    };
    // Commit: the record names the new view.
    let (view_ledger, retired) = if entries == 0 {
        delete_ledgers(topic, &[ledger]).await;
        (
            None,
            record
                .ledger
                .into_iter()
                .chain(record.retired.clone())
                .collect::<Vec<_>>(),
        )
    } else {
        (
            Some(ledger),
            record
                .ledger
                .into_iter()
                .chain(record.retired.clone())
                .collect(),
        )
    };
    record_now = CompactionRecord {
        ledger: view_ledger,
        horizon: Some(to),
        entries,
        bytes,
        in_progress: None,
        retired,
    };
    if crate::failpoint::hit("compaction:before_commit") {
        return Err(abandon(
            topic,
            ledger,
            BrokerError::new(
                ServerError::UnknownError,
                "fail point compaction:before_commit",
            ),
        )
        .await);
    }
    if let Err(e) = topic.compaction.check_live(topic) {
        return Err(abandon(topic, ledger, e).await);
    }
    let version = match write_record(topic, &record_now, version).await {
        Ok(v) => v,
        Err(e) => return Err(abandon(topic, ledger, e).await),
    };
    let view = CompactedView::open(&topic.client, view_ledger, to, entries, bytes).await?;
    *topic.compaction.view.lock().expect("view lock") = Some(Arc::new(view));
    for s in topic.subscriptions().await {
        s.wake();
    }
    if crate::failpoint::hit("compaction:after_commit") {
        return Err(BrokerError::new(
            ServerError::UnknownError,
            "fail point compaction:after_commit",
        ));
    }
    // Only now may what the view covers be trimmed.
    topic.compaction.check_live(topic)?;
    topic
        .subscription_for_admin(COMPACTION_SUBSCRIPTION)
        .await?
        .ack_through(to)
        .await?;
    // The earlier view's ledger goes once no dispatcher reads it any more (else at the next
    // run or load).
    if let Some(old) = old {
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        while Arc::strong_count(&old) > 1 && Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        if Arc::strong_count(&old) > 1 {
            return Ok(keys.messages.saturating_sub(kept));
        }
    }
    if !record_now.retired.is_empty() && delete_ledgers(topic, &record_now.retired).await {
        record_now.retired.clear();
        if let Err(e) = write_record(topic, &record_now, version).await {
            tracing::warn!(topic = %topic.full_name(), error = %e, "updating the compaction record failed");
        }
    }
    Ok(keys.messages.saturating_sub(kept))
}

/// A run that will not commit: its ledger goes, and the record forgets it.
async fn abandon(topic: &Topic, ledger: u64, e: BrokerError) -> BrokerError {
    // A commit whose answer was lost may have been applied: then the ledger is the view.
    match read_record(topic).await {
        Ok((r, _)) if r.ledger == Some(ledger) => {
            tracing::warn!(topic = %topic.full_name(), ledger, "the compaction was committed after all; its view is used from the next load");
            return e;
        }
        Ok(_) => {}
        Err(re) => {
            tracing::warn!(topic = %topic.full_name(), ledger, error = %re, "cannot tell whether the compaction was committed; its ledger is kept");
            return e;
        }
    }
    if delete_ledgers(topic, &[ledger]).await {
        tracing::info!(topic = %topic.full_name(), "abandoned compacted ledger {ledger} deleted");
        if let Ok((mut r, v)) = read_record(topic).await {
            if r.in_progress == Some(ledger) {
                r.in_progress = None;
                let _ = write_record(topic, &r, v).await;
            }
        }
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(e: u64) -> Position {
        Position::new(1, e)
    }

    fn single(k: &str, v: &str) -> Items {
        Items::Single(Some(k.to_string()), v.is_empty())
    }

    #[test]
    fn the_latest_message_of_each_key_is_retained_and_tombstones_remove_keys() {
        let log = [
            single("a", "1"),
            single("b", "1"),
            Items::Single(None, false),
            single("a", "2"),
            single("c", "1"),
            single("c", ""),
            Items::Skip,
            Items::Whole,
        ];
        let mut k = KeyMap::new(10);
        for (i, it) in log.iter().enumerate() {
            k.add(p(i as u64), it, None).unwrap();
        }
        let kept: Vec<usize> = (0..log.len())
            .filter(|i| k.retained(p(*i as u64), &log[*i]).is_some())
            .collect();
        assert_eq!(kept, vec![1, 3, 7]);
        assert_eq!(k.messages, 8);
    }

    #[test]
    fn batches_keep_only_their_latest_items_and_an_earlier_mask_is_honoured() {
        let key = |s: &str| (Some(s.to_string()), false);
        let b0 = Items::Batch(vec![key("a"), key("b"), key("c")]);
        let b1 = Items::Batch(vec![key("a"), (Some("c".into()), true), (None, false)]);
        let mut k = KeyMap::new(10);
        k.add(p(0), &b0, None).unwrap();
        k.add(p(1), &b1, None).unwrap();
        assert_eq!(k.retained(p(0), &b0), Some(Some(vec![0b010])));
        assert_eq!(k.retained(p(1), &b1), Some(Some(vec![0b001])));
        // Incremental: the earlier view kept only b of b0; a new run over it and one more
        // entry that replaces b.
        let mut k = KeyMap::new(10);
        k.add(p(0), &b0, Some(&[0b010])).unwrap();
        assert_eq!(k.messages, 1);
        assert_eq!(k.retained(p(0), &b0), Some(Some(vec![0b010])));
        k.add(p(2), &single("b", "2"), None).unwrap();
        assert_eq!(k.retained(p(0), &b0), None);
        // All items latest: the entry is retained whole.
        let mut k = KeyMap::new(10);
        k.add(p(0), &b0, None).unwrap();
        assert_eq!(k.retained(p(0), &b0), Some(None));
    }

    #[test]
    fn too_many_keys_fail_the_run_with_the_limit_named() {
        let mut k = KeyMap::new(2);
        k.add(p(0), &single("a", "1"), None).unwrap();
        k.add(p(1), &single("b", "1"), None).unwrap();
        k.add(p(2), &single("a", "2"), None).unwrap();
        let e = k.add(p(3), &single("c", "1"), None).unwrap_err();
        assert!(e.contains("broker.compaction_keys_max"), "{e}");
    }
}
