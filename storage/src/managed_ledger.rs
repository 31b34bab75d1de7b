//! A managed ledger: a named, append-only log made of a chain of ledgers (one per topic
//! partition, later).
//!
//! ```text
//!  /managed-ledgers/<name>  (JSON, every change a CAS)
//!     ledgers: [L7 closed 0..=999] [L12 closed 0..=999] [L15 open]  ◄── appends go to the last
//!  append ─► LedgerWriter of the open ledger ─► Position(ledger, entry) ─► tail cache
//!  roll-over: entries / bytes / age of the open ledger past a limit ─► close it, create the next
//!  open by a new owner: the last ledger, if not closed, is recovered (fenced) before appending
//!  trim: ledgers wholly before the given position and outside retention are deleted
//! ```

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use meridian_metadata::client::{ClientError, PutOptions};
use serde::{Deserialize, Serialize};

use crate::ledger::{LedgerClient, LedgerError, LedgerReader, LedgerWriter};
use crate::rangeset::Step;

pub const MANAGED_LEDGERS_PREFIX: &str = "/managed-ledgers/";

/// Where an entry is: its ledger and its id in that ledger. Ordered like the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Position {
    pub ledger_id: u64,
    pub entry_id: u64,
}

impl Position {
    pub const fn new(ledger_id: u64, entry_id: u64) -> Self {
        Self {
            ledger_id,
            entry_id,
        }
    }
}

impl Position {
    /// The position just before this one in the order of positions (it may name no entry:
    /// `l:e-1`, or the end of ledger `l-1` for `l:0`); `None` before `0:0`.
    pub fn before(self) -> Option<Position> {
        match (self.entry_id.checked_sub(1), self.ledger_id.checked_sub(1)) {
            (Some(e), _) => Some(Position::new(self.ledger_id, e)),
            (None, Some(l)) => Some(Position::new(l, u64::MAX)),
            (None, None) => None,
        }
    }
}

impl std::fmt::Display for Position {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.ledger_id, self.entry_id)
    }
}

impl Step for Position {
    /// The next entry of the same ledger. Ledger boundaries are crossed by the managed ledger,
    /// which knows where each ledger ends.
    fn next(self) -> Option<Self> {
        self.entry_id
            .checked_add(1)
            .map(|e| Position::new(self.ledger_id, e))
    }
}

/// One ledger of the chain as the managed ledger records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerInfo {
    pub ledger_id: u64,
    /// Entries in the ledger once it is closed (`None` while it is the open one).
    pub entries: Option<u64>,
    pub bytes: u64,
    pub created_ms: u64,
    pub closed_ms: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManagedLedgerMetadata {
    pub ledgers: Vec<LedgerInfo>,
    /// Free-form properties kept with the log (cursors record theirs elsewhere).
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

impl ManagedLedgerMetadata {
    /// A managed ledger's record as stored, checked: its ledgers in ascending id order, only
    /// the last one open, and entry and byte counts whose sums fit (positions and backlogs
    /// are computed from them), so a damaged record is refused with the reason.
    pub fn decode(bytes: &[u8]) -> Result<ManagedLedgerMetadata, String> {
        let m: ManagedLedgerMetadata = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        for w in m.ledgers.windows(2) {
            if w[1].ledger_id <= w[0].ledger_id {
                return Err(format!(
                    "ledger {} listed after ledger {}",
                    w[1].ledger_id, w[0].ledger_id
                ));
            }
            if w[0].entries.is_none() {
                return Err(format!(
                    "ledger {} is open but not the last",
                    w[0].ledger_id
                ));
            }
        }
        let (mut entries, mut bytes) = (0u64, 0u64);
        for l in &m.ledgers {
            entries = entries
                .checked_add(l.entries.unwrap_or(0))
                .ok_or("entry counts that overflow")?;
            bytes = bytes
                .checked_add(l.bytes)
                .ok_or("byte counts that overflow")?;
        }
        Ok(m)
    }
}

/// Settings of a managed ledger.
#[derive(Debug, Clone)]
pub struct ManagedLedgerOptions {
    pub ensemble: usize,
    pub write_quorum: usize,
    pub ack_quorum: usize,
    pub rollover_entries_max: u64,
    pub rollover_bytes_max: u64,
    pub rollover_age_ms: u64,
    /// A ledger is not rolled over by entries or bytes before it is this old (as Pulsar's
    /// `managedLedgerMinLedgerRolloverTimeMinutes`): a roll-over pauses appends for a ledger
    /// close and create, so a busy topic should not pay it every few seconds. 0: no minimum.
    pub rollover_min_age_ms: u64,
    pub tail_cache_bytes_max: usize,
    /// A byte budget shared with other managed ledgers (a broker's topics): the tail caches
    /// together stay within it. `None`: only the per-ledger bound applies.
    pub tail_cache_budget: Option<Arc<CacheBudget>>,
    /// Acknowledged data kept this long anyway (readers may still read it); 0: none.
    pub retention_ms: u64,
    /// ... and up to this many bytes of it; 0: none.
    pub retention_bytes: u64,
    /// Bookie affinity groups of new ledgers, `primary[,secondary]` (`None`: any bookie).
    pub bookie_affinity: Option<String>,
    /// How long an append waits for enough writable bookies to make a new ledger before it
    /// fails ([`ManagedLedger::queue_in`]); 0: it fails at once.
    pub create_wait_ms: u64,
}

/// How often an append waiting for writable bookies tries to make a ledger again.
const CREATE_RETRY: std::time::Duration = std::time::Duration::from_millis(250);

impl Default for ManagedLedgerOptions {
    fn default() -> Self {
        Self {
            ensemble: 1,
            write_quorum: 1,
            ack_quorum: 1,
            rollover_entries_max: 50_000,
            rollover_bytes_max: 1 << 30,
            rollover_age_ms: 4 * 3600 * 1000,
            rollover_min_age_ms: 0,
            tail_cache_bytes_max: 64 << 20,
            tail_cache_budget: None,
            retention_ms: 0,
            retention_bytes: 0,
            bookie_affinity: None,
            create_wait_ms: 5_000,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ManagedLedgerError {
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error(transparent)]
    Metadata(#[from] ClientError),
    #[error("managed ledger {name}: another owner changed it (it is fenced for this one)")]
    Fenced { name: String },
    #[error("managed ledger {name}: no entry at {position}")]
    NoEntry { name: String, position: Position },
    #[error(
        "invalid managed ledger name {0:?}: non-empty `/`-separated segments without empty parts"
    )]
    BadName(String),
    #[error("corrupt managed ledger metadata {key}: {detail}")]
    BadMetadata { key: String, detail: String },
    #[error("managed ledger {name} is terminated: it takes no more entries")]
    Terminated { name: String },
    #[error("managed ledger {name} is closed here (its topic was unloaded)")]
    Closed { name: String },
}

impl ManagedLedgerError {
    /// Whether a write of the log's record that failed with this was certainly not applied
    /// (a version conflict, a store that did nothing, a refused request); `false` when it may
    /// have been (the reply was lost).
    fn write_not_applied(&self) -> bool {
        match self {
            ManagedLedgerError::Fenced { .. } => true,
            ManagedLedgerError::Metadata(e) => e.write_not_applied(),
            _ => false,
        }
    }
}

/// The property of a terminated log (it takes no more entries).
pub const TERMINATED_PROPERTY: &str = "terminated";

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub fn managed_ledger_key(name: &str) -> String {
    format!("{MANAGED_LEDGERS_PREFIX}{name}")
}

struct Open {
    writer: Arc<LedgerWriter>,
    ledger_id: u64,
    entries: u64,
    bytes: u64,
    opened: Instant,
}

struct State {
    meta: ManagedLedgerMetadata,
    version: u64,
    open: Option<Open>,
    /// The open ledger's writer failed (no writable bookie to replace a failed one): the next
    /// append abandons it and starts a new ledger.
    broken: Option<u64>,
}

/// A byte budget shared by the tail caches of many managed ledgers.
#[derive(Debug)]
pub struct CacheBudget {
    used: std::sync::atomic::AtomicUsize,
    max: usize,
}

impl CacheBudget {
    pub fn new(max: usize) -> Arc<CacheBudget> {
        Arc::new(CacheBudget {
            used: std::sync::atomic::AtomicUsize::new(0),
            max,
        })
    }

    /// Bytes held by every cache sharing this budget.
    pub fn used(&self) -> usize {
        self.used.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn over(&self) -> bool {
        self.used() > self.max
    }
}

/// A bounded cache of recently appended entries, which tailing readers hit.
#[derive(Default)]
struct TailCache {
    entries: BTreeMap<Position, Bytes>,
    bytes: usize,
    budget: Option<Arc<CacheBudget>>,
}

impl TailCache {
    fn account(&mut self, added: usize, removed: usize) {
        self.bytes = self.bytes + added - removed;
        if let Some(b) = &self.budget {
            b.used
                .fetch_add(added, std::sync::atomic::Ordering::Relaxed);
            b.used
                .fetch_sub(removed, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn over_budget(&self) -> bool {
        self.budget.as_ref().is_some_and(|b| b.over())
    }
}

impl Drop for TailCache {
    fn drop(&mut self) {
        let bytes = self.bytes;
        self.account(0, bytes);
    }
}

/// An entry submitted by [`ManagedLedger::append_queued`], not yet known to be durable.
pub struct PendingAppend {
    ml: Arc<ManagedLedger>,
    ledger_id: u64,
    outcome: tokio::sync::oneshot::Receiver<Result<u64, LedgerError>>,
    payload: Bytes,
}

impl PendingAppend {
    /// The ledger the entry went to.
    pub fn ledger_id(&self) -> u64 {
        self.ledger_id
    }

    /// The entry's position once an ack quorum of bookies has fsynced it.
    pub async fn wait(self) -> Result<Position, ManagedLedgerError> {
        let ml = self.ml;
        let entry_id = match self.outcome.await {
            Ok(Ok(e)) => e,
            Ok(Err(LedgerError::Fenced(_))) => {
                ml.fence();
                return Err(ManagedLedgerError::Fenced {
                    name: ml.name.clone(),
                });
            }
            Ok(Err(e)) => {
                let mut st = ml.state.lock().await;
                if st
                    .open
                    .as_ref()
                    .is_some_and(|o| o.ledger_id == self.ledger_id)
                {
                    st.broken = Some(self.ledger_id);
                }
                return Err(e.into());
            }
            Err(_) => return Err(LedgerError::Closed(self.ledger_id).into()),
        };
        let pos = Position::new(self.ledger_id, entry_id);
        {
            let mut lc = ml.last_confirmed.lock().expect("lock");
            if lc.is_none_or(|p| pos > p) {
                *lc = Some(pos);
            }
        }
        ml.cache_insert(pos, self.payload);
        Ok(pos)
    }
}

/// The named log. One owner appends; any number of readers read.
pub struct ManagedLedger {
    name: String,
    key: String,
    client: LedgerClient,
    opts: ManagedLedgerOptions,
    /// Serializes appends' submission and roll-overs (completion is awaited outside it).
    state: tokio::sync::Mutex<State>,
    cache: Mutex<TailCache>,
    readers: tokio::sync::Mutex<HashMap<u64, Arc<LedgerReader>>>,
    last_confirmed: Mutex<Option<Position>>,
    /// The bookie affinity groups new ledgers (and its cursors' ledgers) stay in:
    /// `primary[,secondary]` ([`crate::ledger::BOOKIE_AFFINITY_PROPERTY`]).
    affinity: Mutex<Option<String>>,
    /// Another owner changed the log's record, or recording a change of it failed: this
    /// owner takes no more entries (an atomic, so it is read without waiting for appends).
    fenced: std::sync::atomic::AtomicBool,
    /// Closed by its owner ([`ManagedLedger::close`]): it makes no new ledger.
    closed: std::sync::atomic::AtomicBool,
    /// Entries `read_range` asked the bookies for (not the tail cache).
    entries_read: std::sync::atomic::AtomicU64,
    /// Since when no new ledger could be made for want of writable bookies (`None`: one
    /// could, or none was needed): appends wait for bookies only within
    /// `create_wait_ms` of it, not each for the whole of it ([`ManagedLedger::queue_in`]).
    short_of_bookies_since: Mutex<Option<Instant>>,
    /// Whether `short_of_bookies_since` is set: an append that needed no wait reads this
    /// and takes the lock only to clear a shortage.
    short_of_bookies: std::sync::atomic::AtomicBool,
}

/// What an append into the open ledger did ([`ManagedLedger::queue_in_open`]).
pub enum Queued {
    Appended(PendingAppend),
    /// The log takes no more into the ledger named (`only_in`).
    NotThere,
    /// It would first need a new ledger: nothing was done.
    NeedsLedger,
}

/// Whether the open ledger can take an append ([`ManagedLedger::make_writable`]).
#[derive(Debug, PartialEq, Eq)]
enum Prep {
    Ready,
    NotThere,
    NeedsLedger,
}

impl ManagedLedger {
    /// Opens (creating if needed) the managed ledger `name` as its owner: recovers the last
    /// ledger if a previous owner left it open and records that (CAS, which also fences a
    /// previous owner's later changes). The first append starts a new ledger.
    pub async fn open(
        client: LedgerClient,
        name: &str,
        opts: ManagedLedgerOptions,
    ) -> Result<Arc<ManagedLedger>, ManagedLedgerError> {
        if name.is_empty() || name.split('/').any(|s| s.is_empty()) {
            return Err(ManagedLedgerError::BadName(name.to_string()));
        }
        let key = managed_ledger_key(name);
        let meta_client = client.metadata_client().clone();
        let (mut meta, mut version) = match meta_client.get(&key).await? {
            Some(kv) => (
                ManagedLedgerMetadata::decode(&kv.value).map_err(|detail| {
                    ManagedLedgerError::BadMetadata {
                        key: key.clone(),
                        detail,
                    }
                })?,
                kv.mod_revision,
            ),
            None => (ManagedLedgerMetadata::default(), 0),
        };
        // A previous owner's open ledger: fence and close it at its last acknowledged entry.
        if let Some(last) = meta.ledgers.last_mut() {
            if last.entries.is_none() {
                let reader = client.open_recover(last.ledger_id).await?;
                last.entries = Some(reader.last_entry().map_or(0, |l| l + 1));
                last.closed_ms = Some(now_ms());
                tracing::info!(name, ledger = last.ledger_id, entries = ?last.entries, "recovered the previous owner's ledger");
            }
        }
        let opts_budget = opts.tail_cache_budget.clone();
        let affinity = opts.bookie_affinity.clone();
        let ml = Arc::new(ManagedLedger {
            name: name.to_string(),
            key: key.clone(),
            client,
            opts,
            state: tokio::sync::Mutex::new(State {
                meta: ManagedLedgerMetadata::default(),
                version: 0,
                open: None,
                broken: None,
            }),
            cache: Mutex::new(TailCache {
                entries: BTreeMap::new(),
                bytes: 0,
                budget: opts_budget,
            }),
            readers: tokio::sync::Mutex::default(),
            last_confirmed: Mutex::new(None),
            affinity: Mutex::new(affinity),
            fenced: Default::default(),
            closed: Default::default(),
            entries_read: Default::default(),
            short_of_bookies_since: Mutex::default(),
            short_of_bookies: Default::default(),
        });
        // Record the recovery (or create the log) before the first new ledger.
        version = ml.cas(&meta, version).await?;
        let last = meta
            .ledgers
            .iter()
            .rev()
            .find(|l| l.entries.is_some_and(|n| n > 0))
            .map(|l| Position::new(l.ledger_id, l.entries.expect("closed") - 1));
        *ml.last_confirmed.lock().expect("lock") = last;
        {
            let mut st = ml.state.lock().await;
            st.meta = std::mem::take(&mut meta);
            st.version = version;
            // The first ledger of this owner is created by the first append: a topic that is
            // only read (or idle) holds no ledger writer.
        }
        Ok(ml)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    async fn cas(
        &self,
        meta: &ManagedLedgerMetadata,
        version: u64,
    ) -> Result<u64, ManagedLedgerError> {
        let r = self
            .client
            .metadata_client()
            .put_with(
                &self.key,
                serde_json::to_vec(meta).expect("serializable"),
                PutOptions {
                    expected_version: Some(version),
                    ..PutOptions::default()
                },
            )
            .await;
        match r {
            Ok(p) => Ok(p.version),
            Err(ClientError::Conflict { .. }) => Err(ManagedLedgerError::Fenced {
                name: self.name.clone(),
            }),
            Err(e) => Err(e.into()),
        }
    }

    /// Keeps new ledgers in these bookie affinity groups (`primary[,secondary]`; `None`: any
    /// bookie). Ledgers already written stay where they are.
    pub fn set_bookie_affinity(&self, groups: Option<String>) {
        *self.affinity.lock().expect("lock") = groups;
    }

    /// The properties that place a new ledger of this log or of its cursors.
    pub fn placement_properties(&self) -> BTreeMap<String, String> {
        let mut props = BTreeMap::new();
        if let Some(g) = self.affinity.lock().expect("lock").clone() {
            props.insert(crate::ledger::BOOKIE_AFFINITY_PROPERTY.to_string(), g);
        }
        props
    }

    /// The log's ensemble size, write quorum and ack quorum (its cursors' ledgers use them too:
    /// acknowledgement state is as durable as the messages).
    pub fn quorums(&self) -> (usize, usize, usize) {
        (
            self.opts.ensemble,
            self.opts.write_quorum,
            self.opts.ack_quorum,
        )
    }

    /// Creates the next ledger and records it (CAS) as the open one.
    async fn start_ledger(&self, st: &mut State) -> Result<(), ManagedLedgerError> {
        let mut props = self.placement_properties();
        props.insert("managed-ledger".to_string(), self.name.clone());
        let writer = self
            .client
            .create(
                self.opts.ensemble,
                self.opts.write_quorum,
                self.opts.ack_quorum,
                props,
            )
            .await?;
        let ledger_id = writer.id();
        let mut meta = st.meta.clone();
        meta.ledgers.push(LedgerInfo {
            ledger_id,
            entries: None,
            bytes: 0,
            created_ms: now_ms(),
            closed_ms: None,
        });
        let mut recorded = self.cas(&meta, st.version).await;
        if recorded.is_ok()
            && crate::failpoint::hit(&format!("managed_ledger:reply_lost:{}", self.name))
        {
            recorded =
                Err(ClientError::Indeterminate("fail point: the reply was lost".into()).into());
        }
        match recorded {
            Ok(v) => {
                st.version = v;
                st.meta = meta;
            }
            Err(e) => {
                self.fence();
                let _ = writer.close().await;
                if e.write_not_applied() {
                    let _ = self.client.delete(ledger_id).await;
                } else {
                    // The log may name it now: deleting it would leave a log that cannot be
                    // opened (its last ledger missing). Empty, it costs a metadata record.
                    tracing::warn!(name = %self.name, ledger = ledger_id, error = %e, "whether the new ledger was recorded is unknown; it is kept");
                }
                return Err(e);
            }
        }
        st.open = Some(Open {
            writer: Arc::new(writer),
            ledger_id,
            entries: 0,
            bytes: 0,
            opened: Instant::now(),
        });
        Ok(())
    }

    /// Closes the open ledger (after its pending adds) and records its size.
    async fn close_open(&self, st: &mut State) -> Result<(), ManagedLedgerError> {
        let Some(open) = st.open.take() else {
            return Ok(());
        };
        let writer = match Arc::try_unwrap(open.writer) {
            Ok(w) => w,
            Err(shared) => {
                // Appends still hold it: wait until they are done with it.
                let mut shared = shared;
                loop {
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    match Arc::try_unwrap(shared) {
                        Ok(w) => break w,
                        Err(s) => shared = s,
                    }
                }
            }
        };
        let confirmed = writer.confirmed();
        let last = match writer.close().await {
            Ok(last) => last,
            Err(LedgerError::Fenced(_)) => {
                // Another owner is recovering the ledger: this one is done with the log.
                self.fence();
                return Err(ManagedLedgerError::Fenced {
                    name: self.name.clone(),
                });
            }
            Err(e) => {
                // Its own metadata could not be closed (the writer failed with no bookie to
                // go on with, a store error): as for a failed writer, the managed ledger
                // records it closed at the last add confirmed (every acknowledged entry is at
                // or before it, and no add is pending once a close is answered), so it is not
                // left open behind the next ledger.
                let last = confirmed.get();
                tracing::warn!(name = %self.name, ledger = open.ledger_id, last_entry = ?last, error = %e, "closing the ledger failed; recorded closed at its last add confirmed");
                last
            }
        };
        self.record_closed(st, open.ledger_id, last, open.bytes)
            .await?;
        Ok(())
    }

    /// Records (CAS) that `ledger_id` is closed with entries through `last`.
    async fn record_closed(
        &self,
        st: &mut State,
        ledger_id: u64,
        last: Option<u64>,
        bytes: u64,
    ) -> Result<(), ManagedLedgerError> {
        let mut meta = st.meta.clone();
        if let Some(info) = meta.ledgers.iter_mut().find(|l| l.ledger_id == ledger_id) {
            info.entries = Some(last.map_or(0, |l| l + 1));
            info.bytes = bytes;
            info.closed_ms = Some(now_ms());
        }
        st.version = self
            .cas(&meta, st.version)
            .await
            .inspect_err(|_| self.fence())?;
        st.meta = meta;
        // A reader cached while it was open has its old metadata.
        self.readers.lock().await.remove(&ledger_id);
        Ok(())
    }

    /// Gives up the open ledger after its writer failed: the managed ledger records it closed
    /// at the writer's last add confirmed (every acknowledged entry is at or before it), without
    /// needing the failed bookies. The ledger's own metadata stays open; its entries past that
    /// point were never acknowledged and are not part of the log.
    async fn abandon_open(&self, st: &mut State) -> Result<(), ManagedLedgerError> {
        let Some(open) = st.open.take() else {
            return Ok(());
        };
        let last = open.writer.last_add_confirmed();
        self.record_closed(st, open.ledger_id, last, open.bytes)
            .await?;
        tracing::warn!(name = %self.name, ledger = open.ledger_id, last_entry = ?last, "abandoned a failed ledger; appends go on in a new one");
        Ok(())
    }

    fn roll_due(&self, open: &Open) -> bool {
        let age = open.opened.elapsed().as_millis() as u64;
        let full = open.entries >= self.opts.rollover_entries_max
            || open.bytes >= self.opts.rollover_bytes_max;
        (full && age >= self.opts.rollover_min_age_ms) || age >= self.opts.rollover_age_ms
    }

    /// Appends an entry; returns its position once it is on an ack quorum of bookies.
    pub async fn append(self: &Arc<Self>, payload: Bytes) -> Result<Position, ManagedLedgerError> {
        self.append_queued(payload).await?.wait().await
    }

    /// Submits an entry and returns once it is queued, with a handle that completes when the
    /// entry is on an ack quorum of bookies (fsynced on each: acknowledged means durable).
    /// Entries submitted one after another complete in that order, so a caller can submit in
    /// order and await completions elsewhere (receipts in SEND order, many in flight).
    pub async fn append_queued(
        self: &Arc<Self>,
        payload: Bytes,
    ) -> Result<PendingAppend, ManagedLedgerError> {
        self.queue_in(payload, None)
            .await
            .map(|p| p.expect("queued anywhere"))
    }

    /// As [`ManagedLedger::append_queued`], but only into ledger `ledger`: none when the entry
    /// would go elsewhere (the ledger failed, is due to roll over, or is closed). A caller with
    /// appends in flight there queues more this way, so that if one of them fails every later
    /// one fails too (a ledger's writer fails whole), and waits for them before it lets the
    /// log move on: a run of appends never lands with a hole in it.
    pub async fn append_queued_in(
        self: &Arc<Self>,
        payload: Bytes,
        ledger: u64,
    ) -> Result<Option<PendingAppend>, ManagedLedgerError> {
        self.queue_in(payload, Some(ledger)).await
    }

    /// [`ManagedLedger::append_queued_in`] when `only_in` names a ledger, else
    /// [`ManagedLedger::append_queued`] (always `Some`).
    ///
    /// A new ledger that cannot be made for want of writable bookies (one restarting, or
    /// between two registrations of its session) is tried again until
    /// [`ManagedLedgerOptions::create_wait_ms`] after the shortage was first met, before the
    /// append fails: a failed append makes a producer reconnect and send again, and a stock
    /// client that reconnects before its first receipt numbers its next messages again from
    /// the broker's last sequence id, over ids it has already given to messages still pending
    /// (deduplication then drops them as repeats). The window is the log's, not each
    /// append's: once it has run out, appends fail at once until a ledger is made.
    pub async fn queue_in(
        self: &Arc<Self>,
        payload: Bytes,
        only_in: Option<u64>,
    ) -> Result<Option<PendingAppend>, ManagedLedgerError> {
        let r = self
            .within_create_wait(
                || self.try_queue_in(&payload, only_in, true),
                |q| matches!(q, Queued::Appended(_)),
            )
            .await?;
        Ok(match r {
            Queued::Appended(pa) => Some(pa),
            Queued::NotThere | Queued::NeedsLedger => None,
        })
    }

    /// [`ManagedLedger::queue_in`] into the open ledger only: [`Queued::NeedsLedger`] where
    /// the append would first make a new ledger (none open, one broken, or one due to roll
    /// over), with nothing done. See [`ManagedLedger::make_writable`].
    pub async fn queue_in_open(
        self: &Arc<Self>,
        payload: Bytes,
        only_in: Option<u64>,
    ) -> Result<Queued, ManagedLedgerError> {
        self.try_queue_in(&payload, only_in, false).await
    }

    /// Makes the log ready to take an append (`only_in`: into that ledger) without queuing
    /// one: a ledger due to roll over is closed, a broken one abandoned, and a new one made,
    /// waiting for writable bookies as [`ManagedLedger::queue_in`] does, within the same
    /// window. `Ok(false)`: the log does not take more into `only_in`. A caller that must
    /// queue its append under a lock of its own (deduplication's) calls this first, so the
    /// wait for bookies is not spent holding that lock; the append itself makes a ledger
    /// again if the log moved on meanwhile.
    pub async fn make_writable(
        self: &Arc<Self>,
        only_in: Option<u64>,
    ) -> Result<bool, ManagedLedgerError> {
        self.within_create_wait(
            || async {
                let mut st = self.state.lock().await;
                Ok(self.prepare(&mut st, only_in, true).await? == Prep::Ready)
            },
            |ready| *ready,
        )
        .await
    }

    /// Runs `attempt` until it needs no new ledger, or one is made, or the log's window for
    /// writable bookies ran out (`placed`: the attempt's outcome took a ledger).
    async fn within_create_wait<T, F, Fut>(
        &self,
        mut attempt: F,
        placed: impl Fn(&T) -> bool,
    ) -> Result<T, ManagedLedgerError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, ManagedLedgerError>>,
    {
        let wait = std::time::Duration::from_millis(self.opts.create_wait_ms);
        loop {
            let r = attempt().await;
            let short = matches!(
                r,
                Err(ManagedLedgerError::Ledger(
                    LedgerError::NotEnoughBookies { .. }
                ))
            );
            // The common case (placed, no shortage on record) takes no lock.
            let clears = r.as_ref().is_ok_and(&placed);
            let waits = if !short
                && (!clears
                    || !self
                        .short_of_bookies
                        .load(std::sync::atomic::Ordering::Acquire))
            {
                false
            } else {
                let mut since = self.short_of_bookies_since.lock().expect("shortage lock");
                if short {
                    self.short_of_bookies
                        .store(true, std::sync::atomic::Ordering::Release);
                    since.get_or_insert_with(Instant::now).elapsed() + CREATE_RETRY < wait
                } else {
                    *since = None;
                    self.short_of_bookies
                        .store(false, std::sync::atomic::Ordering::Release);
                    false
                }
            };
            if !waits {
                return r;
            }
            if let Err(e) = &r {
                tracing::debug!(name = %self.name, error = %e, "no ledger can be made yet; an append waits for writable bookies");
            }
            tokio::time::sleep(CREATE_RETRY).await;
        }
    }

    /// Readies the open ledger for an append (see [`ManagedLedger::make_writable`]) under
    /// the state lock; without `make`, only where that needs no new ledger.
    async fn prepare(
        &self,
        st: &mut State,
        only_in: Option<u64>,
        make: bool,
    ) -> Result<Prep, ManagedLedgerError> {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(ManagedLedgerError::Closed {
                name: self.name.clone(),
            });
        }
        if self.is_fenced() {
            return Err(ManagedLedgerError::Fenced {
                name: self.name.clone(),
            });
        }
        if st.meta.properties.contains_key(TERMINATED_PROPERTY) {
            return Err(ManagedLedgerError::Terminated {
                name: self.name.clone(),
            });
        }
        if let Some(ledger) = only_in {
            let stays = st.broken.is_none()
                && st
                    .open
                    .as_ref()
                    .is_some_and(|o| o.ledger_id == ledger && !self.roll_due(o));
            if !stays {
                return Ok(Prep::NotThere);
            }
        }
        if !make && (st.broken.is_some() || st.open.as_ref().is_none_or(|o| self.roll_due(o))) {
            return Ok(Prep::NeedsLedger);
        }
        if let Some(id) = st.broken.take() {
            if st.open.as_ref().is_some_and(|o| o.ledger_id == id) {
                self.abandon_open(st).await?;
            }
        }
        if st.open.as_ref().is_some_and(|o| self.roll_due(o)) {
            self.close_open(st).await?;
        }
        if st.open.is_none() {
            // After a roll-over or an abandoned ledger; if creating it fails (no writable
            // bookie), this append fails and the next one tries again.
            self.start_ledger(st).await?;
        }
        Ok(Prep::Ready)
    }

    async fn try_queue_in(
        self: &Arc<Self>,
        payload: &Bytes,
        only_in: Option<u64>,
        make: bool,
    ) -> Result<Queued, ManagedLedgerError> {
        let (writer, ledger_id) = {
            let mut st = self.state.lock().await;
            match self.prepare(&mut st, only_in, make).await? {
                Prep::Ready => {}
                Prep::NotThere => return Ok(Queued::NotThere),
                Prep::NeedsLedger => return Ok(Queued::NeedsLedger),
            }
            let open = st.open.as_mut().expect("an open ledger after start");
            open.entries += 1;
            open.bytes += payload.len() as u64;
            (Arc::clone(&open.writer), open.ledger_id)
        };
        let outcome = writer.add_queued(payload.clone()).await;
        drop(writer);
        Ok(Queued::Appended(PendingAppend {
            ml: Arc::clone(self),
            ledger_id,
            outcome,
            payload: payload.clone(),
        }))
    }

    fn cache_insert(&self, pos: Position, payload: Bytes) {
        let max = self.opts.tail_cache_bytes_max;
        if payload.len() > max {
            return;
        }
        let mut c = self.cache.lock().expect("cache lock");
        let added = payload.len();
        let removed = c.entries.insert(pos, payload).map_or(0, |old| old.len());
        c.account(added, removed);
        // Oldest first, down to this ledger's bound and, when the caches together are over
        // the shared budget, further (possibly to nothing: reads then go to the bookies).
        while c.bytes > max || c.over_budget() {
            let Some((_, v)) = c.entries.pop_first() else {
                break;
            };
            c.account(0, v.len());
        }
    }

    /// Ends the log: later appends fail with [`ManagedLedgerError::Terminated`], also after a
    /// restart (recorded in the log's metadata). Appends already submitted complete. Returns
    /// the last position once they have.
    pub async fn terminate(&self) -> Result<Option<Position>, ManagedLedgerError> {
        let mut st = self.state.lock().await;
        if !st.meta.properties.contains_key(TERMINATED_PROPERTY) {
            let mut meta = st.meta.clone();
            meta.properties
                .insert(TERMINATED_PROPERTY.to_string(), now_ms().to_string());
            st.version = self
                .cas(&meta, st.version)
                .await
                .inspect_err(|_| self.fence())?;
            st.meta = meta;
        }
        // What was submitted before is on its way; closing the open ledger waits for it.
        if st.open.is_some() {
            self.close_open(&mut st).await?;
        }
        drop(st);
        Ok(self.last_confirmed())
    }

    /// Whether the log is terminated.
    pub async fn is_terminated(&self) -> bool {
        self.state
            .lock()
            .await
            .meta
            .properties
            .contains_key(TERMINATED_PROPERTY)
    }

    /// The newest acknowledged position.
    pub fn last_confirmed(&self) -> Option<Position> {
        *self.last_confirmed.lock().expect("lock")
    }

    /// The ledgers of the chain, oldest first.
    pub async fn ledgers(&self) -> Vec<LedgerInfo> {
        self.state.lock().await.meta.ledgers.clone()
    }

    /// The position of the first entry, if any.
    pub async fn first_position(&self) -> Option<Position> {
        let ledgers = self.ledgers().await;
        let last = self.last_confirmed()?;
        ledgers
            .iter()
            .find(|l| l.entries.is_none_or(|n| n > 0) && Position::new(l.ledger_id, 0) <= last)
            .map(|l| Position::new(l.ledger_id, 0))
    }

    /// The position after `pos` in the log (crossing into the next ledger), if that entry
    /// exists yet.
    pub async fn next_position(&self, pos: Position) -> Option<Position> {
        let last = self.last_confirmed()?;
        if pos >= last {
            return None;
        }
        let ledgers = self.ledgers().await;
        next_in(&ledgers, pos).filter(|p| *p <= last)
    }

    /// Whether this owner's log is fenced (another owner changed its record, or recording a
    /// change of its own failed): it takes no more entries here until it is opened again.
    pub fn is_fenced(&self) -> bool {
        self.fenced.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Marks this owner's log fenced: it takes no more entries or record changes.
    fn fence(&self) {
        self.fenced
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Entries in the log (through the last confirmed one) and their bytes.
    pub async fn size(&self) -> (u64, u64) {
        let st = self.state.lock().await;
        let mut entries = 0;
        let mut bytes = 0;
        for l in &st.meta.ledgers {
            match l.entries {
                Some(n) => {
                    entries += n;
                    bytes += l.bytes;
                }
                None => {
                    if let Some(lc) = self.last_confirmed().filter(|p| p.ledger_id == l.ledger_id) {
                        entries += lc.entry_id + 1;
                    }
                    if let Some(o) = st.open.as_ref().filter(|o| o.ledger_id == l.ledger_id) {
                        bytes += o.bytes;
                    }
                }
            }
        }
        (entries, bytes)
    }

    /// Whether `pos` names an entry of the log: its ledger is in the chain (not trimmed) and
    /// the entry is confirmed (at most the last confirmed one, and within a closed ledger's
    /// entries).
    pub async fn contains(&self, pos: Position) -> bool {
        if self.last_confirmed().is_none_or(|l| pos > l) {
            return false;
        }
        self.ledgers()
            .await
            .iter()
            .find(|l| l.ledger_id == pos.ledger_id)
            .is_some_and(|l| l.entries.is_none_or(|n| pos.entry_id < n))
    }

    /// The index of `pos` in the log (0 for its first entry still kept).
    pub async fn index_of(&self, pos: Position) -> Option<u64> {
        let ledgers = self.ledgers().await;
        let mut base: u64 = 0;
        for l in &ledgers {
            if l.ledger_id == pos.ledger_id {
                // A position past a closed ledger's end names no entry.
                if l.entries.is_some_and(|n| pos.entry_id >= n) {
                    return None;
                }
                return base.checked_add(pos.entry_id);
            }
            base += l.entries.unwrap_or(0);
        }
        None
    }

    /// The position of the entry at `index` (see [`index_of`](Self::index_of)).
    pub async fn position_at(&self, index: u64) -> Option<Position> {
        let ledgers = self.ledgers().await;
        let last = self.last_confirmed()?;
        let mut base = 0;
        for l in &ledgers {
            let n = l.entries.unwrap_or(u64::MAX);
            if index < base + n {
                let p = Position::new(l.ledger_id, index - base);
                return (p <= last).then_some(p);
            }
            base += n;
        }
        None
    }

    /// Reads the entry at `pos` (tail cache first).
    pub async fn read(&self, pos: Position) -> Result<Bytes, ManagedLedgerError> {
        if let Some(v) = self.cache.lock().expect("cache lock").entries.get(&pos) {
            return Ok(v.clone());
        }
        if self.last_confirmed().is_none_or(|l| pos > l) {
            return Err(ManagedLedgerError::NoEntry {
                name: self.name.clone(),
                position: pos,
            });
        }
        let reader = self.reader(pos.ledger_id, false).await?;
        let r = match reader.read(pos.entry_id).await {
            // Cached metadata may be stale: an open ledger's ensemble change moved later
            // entries to other bookies, or it was closed; autorecovery replaced a bookie of
            // any ledger (and the one replaced may have deleted its copy). Refresh it once and
            // retry.
            Err(_) => {
                self.reader(pos.ledger_id, true)
                    .await?
                    .read(pos.entry_id)
                    .await
            }
            r => r,
        };
        r.map_err(|e| match e {
            LedgerError::NoSuchEntry { .. } => ManagedLedgerError::NoEntry {
                name: self.name.clone(),
                position: pos,
            },
            other => other.into(),
        })
    }

    /// A reader of ledger `id`, cached: opening one reads the ledger's metadata from the
    /// store, too slow to do per entry. `refresh` replaces the cached one.
    async fn reader(
        &self,
        id: u64,
        refresh: bool,
    ) -> Result<Arc<LedgerReader>, ManagedLedgerError> {
        let mut readers = self.readers.lock().await;
        if !refresh {
            if let Some(r) = readers.get(&id) {
                return Ok(Arc::clone(r));
            }
        }
        let r = Arc::new(self.client.open(id).await?);
        readers.insert(id, Arc::clone(&r));
        Ok(r)
    }

    /// Entries [`read_range`](Self::read_range) has asked the bookies for (those not in the
    /// tail cache), since the log was opened here.
    pub fn entries_read_from_bookies(&self) -> u64 {
        self.entries_read.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Reads up to `max` entries from `from` on, in log order.
    pub async fn read_range(
        &self,
        from: Position,
        max: usize,
    ) -> Result<Vec<(Position, Bytes)>, ManagedLedgerError> {
        use futures::{StreamExt, TryStreamExt};
        // Positions first (from the ledger list, no I/O); those in the tail cache are taken
        // from it, the others are read as runs of consecutive entries of one ledger, each
        // about RUN_BYTES by the log's average entry size, several runs at once: small entries
        // go many to a request, large ones (read from the disk one by one at the bookie) are
        // still read several at once.
        const RUN_BYTES: u64 = 256 << 10;
        const RUNS_IN_FLIGHT: usize = 16;
        let Some(last) = self.last_confirmed() else {
            return Ok(Vec::new());
        };
        let (entries, bytes) = self.size().await;
        let run_max = (RUN_BYTES / (bytes / entries.max(1)).max(1)).max(1);
        let ledgers = self.ledgers().await;
        let mut pieces: Vec<Piece> = Vec::new();
        let mut taken = 0;
        let mut pos = Some(from).filter(|p| *p <= last);
        while let Some(p) = pos {
            if taken >= max {
                break;
            }
            taken += 1;
            let cached = self
                .cache
                .lock()
                .expect("cache lock")
                .entries
                .get(&p)
                .cloned();
            match (cached, pieces.last_mut()) {
                (Some(bytes), _) => pieces.push(Piece::Cached(p, bytes)),
                (
                    None,
                    Some(Piece::Run {
                        ledger,
                        first,
                        count,
                    }),
                ) if *ledger == p.ledger_id
                    && *first + *count == p.entry_id
                    && *count < run_max =>
                {
                    *count += 1
                }
                (None, _) => pieces.push(Piece::Run {
                    ledger: p.ledger_id,
                    first: p.entry_id,
                    count: 1,
                }),
            }
            pos = next_in(&ledgers, p).filter(|n| *n <= last);
        }
        let read: Vec<Vec<(Position, Bytes)>> = futures::stream::iter(pieces)
            .map(|piece| async move {
                match piece {
                    Piece::Cached(p, bytes) => Ok(vec![(p, bytes)]),
                    Piece::Run {
                        ledger,
                        first,
                        count,
                    } => {
                        self.entries_read
                            .fetch_add(count, std::sync::atomic::Ordering::Relaxed);
                        self.read_run(ledger, first, count).await
                    }
                }
            })
            .buffered(RUNS_IN_FLIGHT)
            .try_collect()
            .await?;
        Ok(read.into_iter().flatten().collect())
    }

    /// Reads entries `first..first + count` of `ledger`, all of them, in order. Cached ledger
    /// metadata may be stale (see [`read`](Self::read)): after a failed read it is refreshed
    /// and the read retried once (again after each read that made progress).
    async fn read_run(
        &self,
        ledger: u64,
        first: u64,
        count: u64,
    ) -> Result<Vec<(Position, Bytes)>, ManagedLedgerError> {
        let mut out = Vec::with_capacity(count as usize);
        let mut refreshed = false;
        while (out.len() as u64) < count {
            let next = first.saturating_add(out.len() as u64);
            let reader = self.reader(ledger, false).await?;
            match reader.read_range(next, count - out.len() as u64).await {
                Ok(payloads) => {
                    refreshed = false;
                    for (i, bytes) in payloads.into_iter().enumerate() {
                        out.push((Position::new(ledger, next.saturating_add(i as u64)), bytes));
                    }
                }
                Err(_) if !refreshed => {
                    refreshed = true;
                    self.reader(ledger, true).await?;
                }
                Err(LedgerError::NoSuchEntry { entry, .. }) => {
                    return Err(ManagedLedgerError::NoEntry {
                        name: self.name.clone(),
                        position: Position::new(ledger, entry),
                    })
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(out)
    }

    /// Deletes the ledgers that end before `keep_from` (what no cursor needs) and that no
    /// retention rule keeps. The open ledger is never deleted. Returns the deleted ids.
    pub async fn trim(&self, keep_from: Position) -> Result<Vec<u64>, ManagedLedgerError> {
        // Options: 0 is "no such rule"; a rule that is set keeps what it covers.
        let (ms, bytes) = (self.opts.retention_ms, self.opts.retention_bytes);
        let rule = |v: u64, other: u64| match (v, other) {
            (0, 0) => Some(0),
            (0, _) => None,
            (v, _) => Some(v),
        };
        self.trim_retaining(keep_from, rule(ms, bytes), rule(bytes, ms))
            .await
    }

    /// [`trim`](ManagedLedger::trim) with a retention given here, as Pulsar's: a consumed
    /// ledger is deleted once it passes either rule: older than `retention_ms`, or beyond
    /// `retention_bytes` counting from the newest (`None`: no limit by that rule; `Some(0)`:
    /// that rule keeps nothing).
    pub async fn trim_retaining(
        &self,
        keep_from: Position,
        retention_ms: Option<u64>,
        retention_bytes: Option<u64>,
    ) -> Result<Vec<u64>, ManagedLedgerError> {
        let mut st = self.state.lock().await;
        let now = now_ms();
        let candidates: Vec<&LedgerInfo> = st
            .meta
            .ledgers
            .iter()
            .filter(|l| l.entries.is_some() && l.ledger_id < keep_from.ledger_id)
            .collect();
        // Retention keeps the newest of the consumed ledgers, by age and by size.
        let mut kept_bytes = 0u64;
        let mut doomed = Vec::new();
        for l in candidates.iter().rev() {
            let young =
                retention_ms.is_none_or(|r| l.closed_ms.is_some_and(|c| now.saturating_sub(c) < r));
            let fits = retention_bytes.is_none_or(|r| kept_bytes.saturating_add(l.bytes) <= r);
            if young && fits {
                kept_bytes += l.bytes;
            } else {
                doomed.push(l.ledger_id);
            }
        }
        if doomed.is_empty() {
            return Ok(doomed);
        }
        doomed.sort_unstable();
        let mut meta = st.meta.clone();
        meta.ledgers.retain(|l| !doomed.contains(&l.ledger_id));
        st.version = self
            .cas(&meta, st.version)
            .await
            .inspect_err(|_| self.fence())?;
        st.meta = meta;
        drop(st);
        for id in &doomed {
            self.readers.lock().await.remove(id);
            if let Err(e) = self.client.delete(*id).await {
                tracing::warn!(name = %self.name, ledger = id, error = %e, "deleting a trimmed ledger failed; it stays on the bookies");
            }
        }
        {
            let mut c = self.cache.lock().expect("cache lock");
            c.entries.retain(|p, _| !doomed.contains(&p.ledger_id));
            let kept: usize = c.entries.values().map(|v| v.len()).sum();
            let dropped = c.bytes - kept;
            c.account(0, dropped);
        }
        Ok(doomed)
    }

    /// Deletes the log: closes its open ledger, removes its record (CAS: a log another owner
    /// changed meanwhile is left alone, with [`ManagedLedgerError::Fenced`]), then deletes its
    /// ledgers from the bookies. Afterwards this handle refuses appends. Returns the ids of the
    /// deleted ledgers. The caller deletes the cursors first: a cursor left behind would
    /// point into ledgers that are gone.
    pub async fn delete(&self) -> Result<Vec<u64>, ManagedLedgerError> {
        let mut st = self.state.lock().await;
        self.close_open(&mut st).await?;
        match self
            .client
            .metadata_client()
            .delete(&self.key, Some(st.version))
            .await
        {
            Ok(_) => {}
            Err(ClientError::Conflict { .. }) => {
                self.fence();
                return Err(ManagedLedgerError::Fenced {
                    name: self.name.clone(),
                });
            }
            Err(e) => return Err(e.into()),
        }
        self.fence();
        let ids: Vec<u64> = st.meta.ledgers.iter().map(|l| l.ledger_id).collect();
        st.meta.ledgers.clear();
        drop(st);
        self.readers.lock().await.clear();
        for id in &ids {
            if let Err(e) = self.client.delete(*id).await {
                // Its metadata stays, so `meridian ledger list` shows it and the orphan scan
                // does not apply: logged for the operator.
                tracing::warn!(name = %self.name, ledger = id, error = %e, "deleting a ledger of a deleted log failed");
            }
        }
        {
            let mut c = self.cache.lock().expect("cache lock");
            c.entries.clear();
            let dropped = c.bytes;
            c.account(0, dropped);
        }
        Ok(ids)
    }

    /// Closes the open ledger; the managed ledger can be opened again (by this or another
    /// owner) later.
    pub async fn close(&self) -> Result<(), ManagedLedgerError> {
        let mut st = self.state.lock().await;
        // Under the state lock: an append waiting for bookies makes no ledger after this.
        self.closed
            .store(true, std::sync::atomic::Ordering::Release);
        self.close_open(&mut st).await
    }
}

/// A part of a [`ManagedLedger::read_range`]: an entry found in the tail cache, or a run of
/// consecutive entries of one ledger to read from the bookies.
enum Piece {
    Cached(Position, Bytes),
    Run { ledger: u64, first: u64, count: u64 },
}

/// The position after `pos` in the chain `ledgers` (crossing into the next non-empty ledger); the
/// caller bounds it by the last confirmed position. A `pos` in a ledger no longer in the chain
/// (trimmed behind a reader, which durable cursors never are) is followed by the first entry
/// of the next ledger that is: without that, a reader left there would read nothing again.
fn next_in(ledgers: &[LedgerInfo], pos: Position) -> Option<Position> {
    let Some(i) = ledgers.iter().position(|l| l.ledger_id == pos.ledger_id) else {
        return ledgers
            .iter()
            .find(|l| l.ledger_id > pos.ledger_id && l.entries.is_none_or(|n| n > 0))
            .map(|l| Position::new(l.ledger_id, 0));
    };
    let next = pos.entry_id.checked_add(1);
    let in_ledger = match (ledgers[i].entries, next) {
        (_, None) => false,
        (Some(n), Some(e)) => e < n,
        (None, Some(_)) => true,
    };
    if let (true, Some(e)) = (in_ledger, next) {
        return Some(Position::new(pos.ledger_id, e));
    }
    ledgers[i + 1..]
        .iter()
        .find(|l| l.entries.is_none_or(|n| n > 0))
        .map(|l| Position::new(l.ledger_id, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger(ledger_id: u64, entries: Option<u64>) -> LedgerInfo {
        LedgerInfo {
            ledger_id,
            entries,
            bytes: 0,
            created_ms: 0,
            closed_ms: None,
        }
    }

    #[test]
    fn given_a_damaged_log_record_then_decode_refuses_it_with_the_reason() {
        let encode = |ledgers: Vec<LedgerInfo>| {
            serde_json::to_vec(&ManagedLedgerMetadata {
                ledgers,
                properties: BTreeMap::new(),
            })
            .unwrap()
        };
        let sound = encode(vec![ledger(5, Some(2)), ledger(8, None)]);
        assert_eq!(
            ManagedLedgerMetadata::decode(&sound).unwrap().ledgers.len(),
            2
        );
        let refused = |ledgers, why: &str| {
            let e = ManagedLedgerMetadata::decode(&encode(ledgers)).unwrap_err();
            assert!(e.contains(why), "{e}");
        };
        refused(vec![ledger(8, Some(1)), ledger(5, None)], "listed after");
        refused(vec![ledger(5, Some(1)), ledger(5, None)], "listed after");
        refused(
            vec![ledger(5, None), ledger(8, None)],
            "open but not the last",
        );
        refused(
            vec![ledger(5, Some(u64::MAX)), ledger(8, Some(1))],
            "entry counts",
        );
        // Before the check, a broker summing these for a backlog quota overflowed.
        let (mut big, mut one) = (ledger(5, Some(1)), ledger(8, None));
        (big.bytes, one.bytes) = (u64::MAX, 1);
        refused(vec![big, one], "byte counts");
    }

    #[test]
    fn next_in_crosses_ledgers_and_leaves_a_trimmed_one_for_the_next_that_is_kept() {
        let chain = [ledger(5, Some(2)), ledger(6, Some(0)), ledger(8, None)];
        let p = Position::new;
        assert_eq!(next_in(&chain, p(5, 0)), Some(p(5, 1)));
        assert_eq!(
            next_in(&chain, p(5, 1)),
            Some(p(8, 0)),
            "over the empty ledger 6"
        );
        assert_eq!(next_in(&chain, p(8, 41)), Some(p(8, 42)));
        // Ledgers 3 and 7 were trimmed (or never held anything): the next kept one follows.
        assert_eq!(next_in(&chain, p(3, 9)), Some(p(5, 0)));
        assert_eq!(next_in(&chain, p(7, 0)), Some(p(8, 0)));
        assert_eq!(next_in(&chain, p(9, 0)), None, "past the chain");
    }

    #[test]
    fn the_position_before_one_may_name_no_entry_and_next_in_never_overflows() {
        let p = Position::new;
        assert_eq!(p(4, 3).before(), Some(p(4, 2)));
        assert_eq!(p(4, 0).before(), Some(p(3, u64::MAX)));
        assert_eq!(p(0, 0).before(), None);
        let chain = [ledger(5, Some(0)), ledger(6, Some(3)), ledger(8, None)];
        assert_eq!(next_in(&chain, p(5, u64::MAX)), Some(p(6, 0)));
        assert_eq!(next_in(&chain, p(8, u64::MAX)), None);
    }
}
