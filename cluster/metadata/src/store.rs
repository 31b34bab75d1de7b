//! RocksDB storage of one metadata node: the Raft log, the vote, and the state machine.
//!
//! Two RocksDB databases per node: `<data_dir>/log` (cfs `log`, `raft`) and `<data_dir>/state`
//! (the others), with column families:
//!
//! | cf         | key                         | value                                   |
//! |------------|-----------------------------|-----------------------------------------|
//! | `log`      | log index (u64 BE)          | bincode `Entry`                         |
//! | `raft`     | `vote`, `committed`, `purged` | bincode                               |
//! | `kv`       | key bytes                   | bincode [`KeyValue`]                    |
//! | `sessions` | session id (u64 BE)         | bincode [`Session`]                     |
//! | `sm`       | `applied`, `membership`, `revision`, `snapshot`, `history_floor` | bincode |
//! | `events`   | revision (u64 BE) + index (u32 BE) | bincode [`Event`] (watch history) |
//!
//! **Durability.** Votes, truncation and purges are written with `sync = true` (when
//! `metadata.fsync` is on). Log appends are group-committed by [`wal_syncer`]: an entry is
//! reported persisted only after an fsync of the write-ahead log that covers it, and openraft
//! counts it toward the commit quorum only then, so a committed (acknowledged) write is on a
//! quorum's disks (`strace` shows the `fdatasync` of `log/*.log` behind the acknowledgements).
//! State-machine writes are not synced one by one: each applied batch is written atomically with
//! its applied log id, so after a crash the state is consistent at some earlier id and openraft
//! re-applies the rest from the log. Before openraft may purge the log behind a snapshot, the
//! state database's WAL is fsynced (`build_snapshot`).

use std::io::Cursor;
use std::ops::{Bound, RangeBounds};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use openraft::storage::{LogFlushed, LogState, RaftLogStorage, RaftStateMachine, Snapshot};
use openraft::{
    AnyError, Entry, EntryPayload, ErrorSubject, ErrorVerb, LogId, OptionalSend, RaftLogReader,
    RaftSnapshotBuilder, SnapshotMeta, StorageError, StorageIOError, StoredMembership, Vote,
};
use rocksdb::{
    ColumnFamilyDescriptor, Direction, IteratorMode, Options, WriteBatch, WriteOptions, DB,
};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use tokio::sync::broadcast;

use crate::model::{Event, KvState, Mutation, Response, Revision};
use crate::{NodeId, TypeConfig};

const CF_LOG: &str = "log";
const CF_RAFT: &str = "raft";
const CF_KV: &str = "kv";
const CF_SESSIONS: &str = "sessions";
const CF_SM: &str = "sm";
const CF_EVENTS: &str = "events";
/// Column families of the Raft log database (`<data_dir>/log`).
pub const LOG_CFS: [&str; 2] = [CF_LOG, CF_RAFT];
/// Column families of the state machine database (`<data_dir>/state`).
pub const STATE_CFS: [&str; 4] = [CF_KV, CF_SESSIONS, CF_SM, CF_EVENTS];
/// Column families written on every apply but read only by whole scans (loading the state at
/// start-up, replacing it with a snapshot): the in-memory [`KvState`] answers every read. They
/// get RocksDB's vector memtable, an append that is sorted once when the memtable is flushed,
/// instead of a skip-list insert per key (whose searches were about a tenth of a follower's CPU
/// under `meta bench`).
const SCAN_ONLY_CFS: [&str; 2] = [CF_KV, CF_SESSIONS];

/// Opening the store failed. The message names the directory and what RocksDB said.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("cannot open the metadata store in {path}: {message}")]
    RocksDb { path: PathBuf, message: String },
    #[error("metadata store in {path} is corrupt: {what}")]
    Corrupt { path: PathBuf, what: String },
}

fn io_err<E: std::error::Error + 'static>(
    subject: ErrorSubject<NodeId>,
    verb: ErrorVerb,
    e: E,
) -> StorageError<NodeId> {
    StorageIOError::new(subject, verb, AnyError::new(&e)).into()
}

fn enc<T: Serialize>(v: &T) -> Vec<u8> {
    // bincode cannot fail on these types: no maps with non-string keys and no size limit.
    bincode::serialize(v).expect("bincode serialization of an in-memory value")
}

fn dec<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, bincode::Error> {
    bincode::deserialize(bytes)
}

fn event_key(revision: Revision, index: u32) -> [u8; 12] {
    let mut k = [0u8; 12];
    k[..8].copy_from_slice(&revision.to_be_bytes());
    k[8..].copy_from_slice(&index.to_be_bytes());
    k
}

/// Limits the watch history keeps.
#[derive(Clone, Copy, Debug)]
pub struct StoreOptions {
    pub fsync: bool,
    pub watch_history_events: u64,
    /// Capacity of the channel of applied batches to live watchers.
    pub watch_buffer_batches: usize,
}

/// Opens (or creates) one of the node's two databases with the column families `cfs`. A damaged
/// file stops start-up here (paranoid checks), with a message that names it.
///
/// The log and the state machine live in separate databases so that applying entries never
/// waits behind the log's fsyncs.
pub fn open_db(dir: &Path, cfs: &[&str]) -> Result<(Arc<Db>, DbClosed), OpenError> {
    crate::durable_dir::create_dir_all_synced(dir).map_err(|e| OpenError::RocksDb {
        path: dir.to_path_buf(),
        message: e.to_string(),
    })?;
    let mut opts = Options::default();
    opts.create_if_missing(true);
    opts.create_missing_column_families(true);
    opts.set_paranoid_checks(true);
    // Metadata is small: 8 MiB memtables per column family, at most 32 MiB per database,
    // instead of RocksDB's 64 MiB each (idle memory of a standalone process).
    let scan_only: Vec<&str> = cfs
        .iter()
        .copied()
        .filter(|c| SCAN_ONLY_CFS.contains(c))
        .collect();
    Db::open(&opts, dir, cfs, &scan_only, 8 << 20, 32 << 20).map_err(|e| OpenError::RocksDb {
        path: dir.to_path_buf(),
        message: e.to_string(),
    })
}

/// A RocksDB database that says when it is closed: a process that reopens the same directory
/// (a node or bookie restarted in one process) must wait until the previous instance's `Drop`
/// has finished, not merely until its last `Arc` is gone.
pub struct Db {
    db: Option<DB>,
    closed: Option<std::sync::mpsc::Sender<()>>,
}

/// Resolves once its [`Db`] has been closed.
pub struct DbClosed {
    rx: std::sync::mpsc::Receiver<()>,
    done: bool,
}

impl Db {
    /// Opens `dir` with column families `cfs`, each with memtables of `write_buffer_bytes`,
    /// all of them together holding at most `db_write_buffer_bytes`. The column families in
    /// `vector_cfs` get vector memtables: cheap appends, but every read of the memtable sorts a
    /// copy of it, so only for column families that are scanned rarely and never looked up.
    /// Vector memtables take writes from one writer at a time.
    pub fn open(
        opts: &Options,
        dir: &Path,
        cfs: &[&str],
        vector_cfs: &[&str],
        write_buffer_bytes: usize,
        db_write_buffer_bytes: usize,
    ) -> Result<(Arc<Db>, DbClosed), rocksdb::Error> {
        let mut opts = opts.clone();
        // RocksDB's own log file (`LOG`) takes only the header it writes at open: Debian's
        // RocksDB 7.8 is built with its assertions, and a second write to a log file after
        // one failed (a full disk) aborts the process, so the periodic statistics dump or an
        // error message of a full disk would end a bookie or a metadata node. Every error
        // RocksDB returns reaches our own log through the call that got it.
        opts.set_log_level(rocksdb::LogLevel::Header);
        opts.set_stats_dump_period_sec(0);
        opts.set_write_buffer_size(write_buffer_bytes);
        opts.set_db_write_buffer_size(db_write_buffer_bytes);
        if !vector_cfs.is_empty() {
            opts.set_allow_concurrent_memtable_write(false);
        }
        let descriptors = cfs.iter().map(|name| {
            let mut o = Options::default();
            o.set_write_buffer_size(write_buffer_bytes);
            if vector_cfs.contains(name) {
                o.set_memtable_factory(rocksdb::MemtableFactory::Vector);
            }
            ColumnFamilyDescriptor::new(*name, o)
        });
        let db = DB::open_cf_descriptors(&opts, dir, descriptors)?;
        let (tx, rx) = std::sync::mpsc::channel();
        Ok((
            Arc::new(Db {
                db: Some(db),
                closed: Some(tx),
            }),
            DbClosed { rx, done: false },
        ))
    }
}

impl std::ops::Deref for Db {
    type Target = DB;

    fn deref(&self) -> &DB {
        self.db
            .as_ref()
            .expect("the database is open until dropped")
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        // RocksDB's destructor flushes, stops background work and releases the lock.
        drop(self.db.take());
        if let Some(tx) = self.closed.take() {
            let _ = tx.send(());
        }
    }
}

impl DbClosed {
    /// Whether the database has been closed (its `Drop` finished).
    pub fn is_closed(&mut self) -> bool {
        if !self.done {
            self.done = !matches!(
                self.rx.try_recv(),
                Err(std::sync::mpsc::TryRecvError::Empty)
            );
        }
        self.done
    }

    /// Waits up to `timeout` for the close; returns whether it happened.
    pub async fn wait(&mut self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        while !self.is_closed() {
            if std::time::Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        true
    }
}

fn cf<'a>(db: &'a DB, name: &str) -> &'a rocksdb::ColumnFamily {
    db.cf_handle(name)
        .expect("column family created by open_db")
}

// ---------------------------------------------------------------------------------------------
// Raft log
// ---------------------------------------------------------------------------------------------

#[derive(Clone)]
pub struct LogStore {
    db: Arc<Db>,
    /// Appends waiting for the group-commit fsync (see [`wal_syncer`]); `None` when
    /// `metadata.fsync` is off and appends count as persisted once written.
    syncer: Option<std::sync::mpsc::Sender<LogFlushed<TypeConfig>>>,
}

pub use crate::db_threads::{join_db_threads, join_until, spawn_db_thread};

/// Group commit of the Raft log. `append` writes entries to RocksDB (readable at once, as
/// openraft requires) and queues its completion callback here; this thread takes every queued
/// callback, fsyncs the write-ahead log once (`flush_wal(sync = true)` persists every write made
/// before it), and only then reports those entries persisted. openraft counts an entry toward the
/// commit quorum only after that report, so an acknowledged write is fsynced on a quorum.
///
/// It holds the database only while it syncs: the store's owners close it where they drop it,
/// not this thread after them (a test's `main` may be exiting by then).
fn wal_syncer(db: std::sync::Weak<Db>, rx: std::sync::mpsc::Receiver<LogFlushed<TypeConfig>>) {
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        batch.extend(rx.try_iter());
        let Some(open) = db.upgrade() else {
            // Every `LogStore` is gone, and Raft with them: nobody hears these answers.
            tracing::debug!(
                appends = batch.len(),
                "the metadata log is closed; appends left unsynced"
            );
            for cb in batch {
                cb.log_io_completed(Err(std::io::Error::other("the metadata log is closed")));
            }
            continue;
        };
        let r = open.flush_wal(true).map_err(|e| e.to_string());
        drop(open);
        match r {
            Ok(()) => batch.into_iter().for_each(|cb| cb.log_io_completed(Ok(()))),
            Err(e) => {
                tracing::error!(error = %e, "fsync of the metadata log failed");
                for cb in batch {
                    cb.log_io_completed(Err(std::io::Error::other(e.clone())));
                }
            }
        }
    }
}

impl LogStore {
    pub fn new(db: Arc<Db>, options: StoreOptions) -> Self {
        let syncer = options.fsync.then(|| {
            let (syncer, rx) = std::sync::mpsc::channel();
            let sync_db = Arc::downgrade(&db);
            spawn_db_thread("metadata-wal-sync", move || wal_syncer(sync_db, rx))
                .expect("spawning the WAL sync thread");
            syncer
        });
        Self { db, syncer }
    }

    fn fsync(&self) -> bool {
        self.syncer.is_some()
    }

    fn write(&self, batch: WriteBatch) -> Result<(), rocksdb::Error> {
        let mut wo = WriteOptions::default();
        wo.set_sync(self.fsync());
        self.db.write_opt(batch, &wo)
    }

    fn get_raft<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, StorageError<NodeId>> {
        let raw = self
            .db
            .get_cf(cf(&self.db, CF_RAFT), key)
            .map_err(|e| io_err(ErrorSubject::Store, ErrorVerb::Read, e))?;
        raw.map(|b| dec(&b))
            .transpose()
            .map_err(|e| io_err(ErrorSubject::Store, ErrorVerb::Read, e))
    }

    fn put_raft<T: Serialize>(&self, key: &str, v: &T) -> Result<(), StorageError<NodeId>> {
        let mut batch = WriteBatch::default();
        batch.put_cf(cf(&self.db, CF_RAFT), key, enc(v));
        self.write(batch)
            .map_err(|e| io_err(ErrorSubject::Store, ErrorVerb::Write, e))
    }

    fn last_entry_log_id(&self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        let mut it = self.db.iterator_cf(cf(&self.db, CF_LOG), IteratorMode::End);
        match it.next() {
            None => Ok(None),
            Some(item) => {
                let (_, v) = item.map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Read, e))?;
                let entry: Entry<TypeConfig> =
                    dec(&v).map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Read, e))?;
                Ok(Some(entry.log_id))
            }
        }
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + std::fmt::Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError<NodeId>> {
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s + 1,
            Bound::Unbounded => 0,
        };
        let start_key = start.to_be_bytes();
        let iter = self.db.iterator_cf(
            cf(&self.db, CF_LOG),
            IteratorMode::From(&start_key, Direction::Forward),
        );
        let mut out = Vec::new();
        for item in iter {
            let (k, v) = item.map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Read, e))?;
            let index = u64::from_be_bytes(k.as_ref().try_into().unwrap_or([0xff; 8]));
            if !range.contains(&index) {
                break;
            }
            let entry: Entry<TypeConfig> =
                dec(&v).map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Read, e))?;
            out.push(entry);
        }
        Ok(out)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError<NodeId>> {
        // Stored as `Option<LogId>` (see `purge`): read it back as that type. Reading a bare
        // `LogId` from it decoded garbage (shifted by the option's tag byte) and a node whose
        // log had been purged could not start again.
        let last_purged: Option<LogId<NodeId>> =
            self.get_raft::<Option<LogId<NodeId>>>("purged")?.flatten();
        let last = self.last_entry_log_id()?.or(last_purged);
        Ok(LogState {
            last_purged_log_id: last_purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError<NodeId>> {
        self.put_raft("vote", vote)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        self.get_raft("vote")
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError<NodeId>> {
        // Not synced: this is a hint that lets a restarted node re-apply committed entries before
        // it hears from a leader; a stored value is never ahead of the real commit index. Losing
        // the newest value delays that, and leaves a node that comes back still leading its term
        // with a commit index behind its log: its reads therefore wait for the whole log as of
        // their call (`NodeCore::linearize`), not only for openraft's read index. The next
        // group-commit fsync makes it durable anyway.
        let mut batch = WriteBatch::default();
        batch.put_cf(cf(&self.db, CF_RAFT), "committed", enc(&committed));
        self.db
            .write(batch)
            .map_err(|e| io_err(ErrorSubject::Store, ErrorVerb::Write, e))
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        Ok(self
            .get_raft::<Option<LogId<NodeId>>>("committed")?
            .flatten())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut batch = WriteBatch::default();
        for entry in entries {
            batch.put_cf(
                cf(&self.db, CF_LOG),
                entry.log_id.index.to_be_bytes(),
                enc(&entry),
            );
        }
        // Written without sync: readable now; durable once the syncer's fsync covers it.
        if let Err(e) = self.db.write(batch) {
            callback.log_io_completed(Err(std::io::Error::other(e.to_string())));
            return Err(io_err(ErrorSubject::Logs, ErrorVerb::Write, e));
        }
        let Some(syncer) = &self.syncer else {
            callback.log_io_completed(Ok(()));
            return Ok(());
        };
        if let Err(std::sync::mpsc::SendError(cb)) = syncer.send(callback) {
            let e = std::io::Error::other("the WAL sync thread stopped");
            cb.log_io_completed(Err(std::io::Error::other(e.to_string())));
            return Err(io_err(ErrorSubject::Logs, ErrorVerb::Write, e));
        }
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut batch = WriteBatch::default();
        batch.delete_range_cf(
            cf(&self.db, CF_LOG),
            log_id.index.to_be_bytes(),
            u64::MAX.to_be_bytes(),
        );
        batch.delete_cf(cf(&self.db, CF_LOG), u64::MAX.to_be_bytes());
        self.write(batch)
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Delete, e))
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let mut batch = WriteBatch::default();
        batch.put_cf(cf(&self.db, CF_RAFT), "purged", enc(&Some(log_id)));
        batch.delete_range_cf(
            cf(&self.db, CF_LOG),
            0u64.to_be_bytes(),
            (log_id.index + 1).to_be_bytes(),
        );
        self.write(batch)
            .map_err(|e| io_err(ErrorSubject::Logs, ErrorVerb::Delete, e))
    }
}

// ---------------------------------------------------------------------------------------------
// State machine
// ---------------------------------------------------------------------------------------------

/// What the state machine publishes to watchers after each applied batch.
#[derive(Clone, Debug)]
pub enum Notice {
    Events(Arc<Vec<Event>>),
    /// The state was replaced by a snapshot: watch history before `floor` is gone.
    Reset {
        floor: Revision,
    },
}

/// In-memory state shared between the state machine and the request handlers.
#[derive(Debug, Default)]
pub struct SmState {
    pub kv: KvState,
    pub last_applied: Option<LogId<NodeId>>,
    pub membership: StoredMembership<NodeId, openraft::BasicNode>,
    /// Watch history holds every event with revision >= `history_floor`.
    pub history_floor: Revision,
    pub history_count: u64,
}

#[derive(Serialize, Deserialize)]
struct SnapshotBlob {
    kv: KvState,
    last_applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, openraft::BasicNode>,
}

#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, openraft::BasicNode>,
    data: Vec<u8>,
}

/// The state machine and the watch history, shared with the gRPC handlers.
pub struct Shared {
    db: Arc<Db>,
    pub state: RwLock<SmState>,
    pub notices: broadcast::Sender<Notice>,
    options: StoreOptions,
}

impl Shared {
    /// Loads the state machine from disk. Every key and session is read (and so checksummed) here.
    pub fn load(db: Arc<Db>, options: StoreOptions, dir: &Path) -> Result<Arc<Self>, OpenError> {
        let corrupt = |what: String| OpenError::Corrupt {
            path: dir.to_path_buf(),
            what,
        };
        let mut st = SmState {
            history_floor: 1,
            ..SmState::default()
        };
        let sm_get = |key: &str| -> Result<Option<Vec<u8>>, OpenError> {
            db.get_cf(cf(&db, CF_SM), key)
                .map_err(|e| corrupt(format!("reading sm/{key}: {e}")))
        };
        if let Some(b) = sm_get("applied")? {
            st.last_applied = dec(&b).map_err(|e| corrupt(format!("sm/applied: {e}")))?;
        }
        if let Some(b) = sm_get("membership")? {
            st.membership = dec(&b).map_err(|e| corrupt(format!("sm/membership: {e}")))?;
        }
        if let Some(b) = sm_get("revision")? {
            st.kv.revision = dec(&b).map_err(|e| corrupt(format!("sm/revision: {e}")))?;
        }
        if let Some(b) = sm_get("history_floor")? {
            st.history_floor = dec(&b).map_err(|e| corrupt(format!("sm/history_floor: {e}")))?;
        }
        for item in db.iterator_cf(cf(&db, CF_KV), IteratorMode::Start) {
            let (k, v) = item.map_err(|e| corrupt(format!("reading kv: {e}")))?;
            let kv: crate::model::KeyValue = dec(&v)
                .map_err(|e| corrupt(format!("kv entry {:?}: {e}", String::from_utf8_lossy(&k))))?;
            st.kv.kvs.insert(kv.key.clone(), kv);
        }
        for item in db.iterator_cf(cf(&db, CF_SESSIONS), IteratorMode::Start) {
            let (_, v) = item.map_err(|e| corrupt(format!("reading sessions: {e}")))?;
            let s: crate::model::Session =
                dec(&v).map_err(|e| corrupt(format!("session entry: {e}")))?;
            st.kv.sessions.insert(s.id, s);
        }
        for item in db.iterator_cf(cf(&db, CF_EVENTS), IteratorMode::Start) {
            item.map_err(|e| corrupt(format!("reading events: {e}")))?;
            st.history_count += 1;
        }
        let (notices, _) = broadcast::channel(options.watch_buffer_batches);
        Ok(Arc::new(Self {
            db,
            state: RwLock::new(st),
            notices,
            options,
        }))
    }

    /// Events with `from <= revision <= to` from the history, in order.
    pub fn history(&self, from: Revision, to: Revision) -> Result<Vec<Event>, String> {
        let start = event_key(from, 0);
        let mut out = Vec::new();
        let iter = self.db.iterator_cf(
            cf(&self.db, CF_EVENTS),
            IteratorMode::From(&start, Direction::Forward),
        );
        for item in iter {
            let (_, v) = item.map_err(|e| e.to_string())?;
            let ev: Event = dec(&v).map_err(|e| e.to_string())?;
            if ev.revision > to {
                break;
            }
            out.push(ev);
        }
        Ok(out)
    }

    fn write_mutations(batch: &mut WriteBatch, db: &DB, mutations: &[Mutation]) {
        for m in mutations {
            match m {
                Mutation::PutKv(kv) => batch.put_cf(cf(db, CF_KV), kv.key.as_bytes(), enc(kv)),
                Mutation::DeleteKv(k) => batch.delete_cf(cf(db, CF_KV), k.as_bytes()),
                Mutation::PutSession(s) => {
                    batch.put_cf(cf(db, CF_SESSIONS), s.id.to_be_bytes(), enc(s))
                }
                Mutation::DeleteSession(id) => {
                    batch.delete_cf(cf(db, CF_SESSIONS), id.to_be_bytes())
                }
            }
        }
    }

    /// Drops the oldest whole revisions of history once it exceeds its bound by an eighth.
    fn trim_history(&self, st: &mut SmState, batch: &mut WriteBatch) -> Result<(), rocksdb::Error> {
        let max = self.options.watch_history_events;
        if st.history_count <= max + max / 8 {
            return Ok(());
        }
        let mut to_drop = st.history_count - max;
        let mut last_rev = None;
        let mut first_kept = None;
        for item in self
            .db
            .iterator_cf(cf(&self.db, CF_EVENTS), IteratorMode::Start)
        {
            let (k, _) = item?;
            let rev = u64::from_be_bytes(k[..8].try_into().unwrap_or([0; 8]));
            if to_drop == 0 && last_rev != Some(rev) {
                first_kept = Some(rev);
                break;
            }
            to_drop = to_drop.saturating_sub(1);
            last_rev = Some(rev);
            st.history_count -= 1;
        }
        let floor = first_kept.unwrap_or(st.kv.revision + 1);
        batch.delete_range_cf(
            cf(&self.db, CF_EVENTS),
            event_key(0, 0),
            event_key(floor, 0),
        );
        batch.put_cf(cf(&self.db, CF_SM), "history_floor", enc(&floor));
        st.history_floor = floor;
        Ok(())
    }
}

#[derive(Clone)]
pub struct StateMachineStore {
    pub shared: Arc<Shared>,
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachineStore {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError<NodeId>> {
        let (blob, last_applied, membership) = {
            let st = self.shared.state.read().expect("state lock");
            let blob = SnapshotBlob {
                kv: st.kv.clone(),
                last_applied: st.last_applied,
                membership: st.membership.clone(),
            };
            (enc(&blob), st.last_applied, st.membership.clone())
        };
        let snapshot_id = match last_applied {
            Some(id) => format!("{}-{}-{}", id.leader_id.term, id.index, blob.len()),
            None => format!("empty-{}", blob.len()),
        };
        let meta = SnapshotMeta {
            last_log_id: last_applied,
            last_membership: membership,
            snapshot_id,
        };
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data: blob.clone(),
        };
        let db = &self.shared.db;
        db.put_cf(cf(db, CF_SM), "snapshot", enc(&stored))
            .map_err(|e| io_err(ErrorSubject::Snapshot(None), ErrorVerb::Write, e))?;
        // openraft purges the log behind a snapshot once this returns: everything the state
        // database holds (the snapshot and every applied entry) must be durable first.
        db.flush_wal(true)
            .map_err(|e| io_err(ErrorSubject::Snapshot(None), ErrorVerb::Write, e))?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(blob)),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<
        (
            Option<LogId<NodeId>>,
            StoredMembership<NodeId, openraft::BasicNode>,
        ),
        StorageError<NodeId>,
    > {
        let st = self.shared.state.read().expect("state lock");
        Ok((st.last_applied, st.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Response>, StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let shared = &self.shared;
        let db = &shared.db;
        let mut responses = Vec::new();
        let mut events: Vec<Event> = Vec::new();
        let mut batch = WriteBatch::default();
        {
            let mut st = shared.state.write().expect("state lock");
            for entry in entries {
                st.last_applied = Some(entry.log_id);
                match entry.payload {
                    EntryPayload::Blank => responses.push(Response::None),
                    EntryPayload::Membership(m) => {
                        st.membership = StoredMembership::new(Some(entry.log_id), m);
                        batch.put_cf(cf(db, CF_SM), "membership", enc(&st.membership));
                        responses.push(Response::None);
                    }
                    EntryPayload::Normal(cmd) => {
                        let (resp, applied) = st.kv.apply(&cmd);
                        Shared::write_mutations(&mut batch, db, &applied.mutations);
                        responses.push(resp);
                        events.extend(applied.events);
                    }
                }
            }
            let mut index = 0u32;
            let mut prev_rev = 0;
            for ev in &events {
                if ev.revision != prev_rev {
                    index = 0;
                    prev_rev = ev.revision;
                }
                batch.put_cf(cf(db, CF_EVENTS), event_key(ev.revision, index), enc(ev));
                index += 1;
            }
            st.history_count += events.len() as u64;
            shared
                .trim_history(&mut st, &mut batch)
                .map_err(|e| io_err(ErrorSubject::StateMachine, ErrorVerb::Write, e))?;
            batch.put_cf(cf(db, CF_SM), "applied", enc(&st.last_applied));
            batch.put_cf(cf(db, CF_SM), "revision", enc(&st.kv.revision));
            // Written under the lock: a reader that sees revision R finds every event <= R in
            // the history (the watch hand-over depends on it).
            db.write(batch)
                .map_err(|e| io_err(ErrorSubject::StateMachine, ErrorVerb::Write, e))?;
        }
        if !events.is_empty() {
            // No receivers is fine: nobody is watching.
            let _ = shared.notices.send(Notice::Events(Arc::new(events)));
        }
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, openraft::BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        let data = snapshot.into_inner();
        let blob: SnapshotBlob = dec(&data).map_err(|e| {
            io_err(
                ErrorSubject::Snapshot(Some(meta.signature())),
                ErrorVerb::Read,
                e,
            )
        })?;
        let shared = &self.shared;
        let db = &shared.db;
        let floor;
        {
            let mut st = shared.state.write().expect("state lock");
            let mut batch = WriteBatch::default();
            for name in [CF_KV, CF_SESSIONS] {
                for item in db.iterator_cf(cf(db, name), IteratorMode::Start) {
                    let (k, _) =
                        item.map_err(|e| io_err(ErrorSubject::StateMachine, ErrorVerb::Read, e))?;
                    batch.delete_cf(cf(db, name), k);
                }
            }
            batch.delete_range_cf(
                cf(db, CF_EVENTS),
                event_key(0, 0),
                event_key(u64::MAX, u32::MAX),
            );
            let mut muts: Vec<Mutation> =
                blob.kv.kvs.values().cloned().map(Mutation::PutKv).collect();
            muts.extend(blob.kv.sessions.values().cloned().map(Mutation::PutSession));
            Shared::write_mutations(&mut batch, db, &muts);
            floor = blob.kv.revision + 1;
            batch.put_cf(cf(db, CF_SM), "history_floor", enc(&floor));
            batch.put_cf(cf(db, CF_SM), "applied", enc(&meta.last_log_id));
            batch.put_cf(cf(db, CF_SM), "membership", enc(&meta.last_membership));
            batch.put_cf(cf(db, CF_SM), "revision", enc(&blob.kv.revision));
            let stored = StoredSnapshot {
                meta: meta.clone(),
                data: data.clone(),
            };
            batch.put_cf(cf(db, CF_SM), "snapshot", enc(&stored));
            let mut wo = WriteOptions::default();
            wo.set_sync(shared.options.fsync);
            db.write_opt(batch, &wo)
                .map_err(|e| io_err(ErrorSubject::StateMachine, ErrorVerb::Write, e))?;
            st.kv = blob.kv;
            st.last_applied = meta.last_log_id;
            st.membership = meta.last_membership.clone();
            st.history_floor = floor;
            st.history_count = 0;
        }
        let _ = shared.notices.send(Notice::Reset { floor });
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<TypeConfig>>, StorageError<NodeId>> {
        let db = &self.shared.db;
        let raw = db
            .get_cf(cf(db, CF_SM), "snapshot")
            .map_err(|e| io_err(ErrorSubject::Snapshot(None), ErrorVerb::Read, e))?;
        let Some(raw) = raw else { return Ok(None) };
        let stored: StoredSnapshot =
            dec(&raw).map_err(|e| io_err(ErrorSubject::Snapshot(None), ErrorVerb::Read, e))?;
        Ok(Some(Snapshot {
            meta: stored.meta,
            snapshot: Box::new(Cursor::new(stored.data)),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::CommittedLeaderId;

    #[tokio::test]
    async fn given_a_purge_then_the_log_state_reads_the_purge_point_back() {
        let dir = tempfile::tempdir().unwrap();
        let (db, _closed) = open_db(dir.path(), &LOG_CFS).unwrap();
        let mut store = LogStore::new(
            db,
            StoreOptions {
                fsync: false,
                watch_history_events: 1_000,
                watch_buffer_batches: 16,
            },
        );
        let purged = LogId::new(CommittedLeaderId::new(3, 1), 78_999);
        store.purge(purged).await.unwrap();
        let state = store.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id, Some(purged));
        assert_eq!(state.last_log_id, Some(purged));
    }

    /// Keys and sessions live in vector memtables (appends, sorted when flushed or scanned):
    /// a restarted node must load exactly the state it applied, with keys overwritten many
    /// times in one memtable, deleted, and bound to sessions.
    #[tokio::test]
    async fn given_writes_applied_when_the_state_database_reopens_then_the_same_state_loads() {
        use crate::model::{Command, Op};
        use openraft::{Entry, EntryPayload};
        let dir = tempfile::tempdir().unwrap();
        let options = StoreOptions {
            fsync: false,
            watch_history_events: 1_000,
            watch_buffer_batches: 16,
        };
        let put = |key: String, value: Vec<u8>, session| Op::Put {
            key,
            value,
            session,
            sequential: false,
        };
        let txn = |success| Command::Txn {
            conditions: vec![],
            success,
            failure: vec![],
        };
        let mut index = 0;
        let mut entry = |cmd| {
            index += 1;
            Entry::<TypeConfig> {
                log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
                payload: EntryPayload::Normal(cmd),
            }
        };
        let applied = {
            let (db, mut closed) = open_db(dir.path(), &STATE_CFS).unwrap();
            let shared = Shared::load(db, options, dir.path()).unwrap();
            let mut sm = StateMachineStore {
                shared: Arc::clone(&shared),
            };
            let mut entries = vec![entry(Command::CreateSession { ttl_ms: 10_000 })];
            for round in 0..20u8 {
                // 50 keys, each written again every round, in batches as the leader sends them.
                let cmds = (0..50)
                    .map(|k| txn(vec![put(format!("/k/{k:03}"), vec![round; 100], 0)]))
                    .collect();
                entries.push(entry(Command::Batch(cmds)));
            }
            entries.push(entry(txn(vec![Op::Delete {
                key: "/k/01".into(),
                prefix: true,
            }])));
            sm.apply(entries).await.unwrap();
            let session = *shared
                .state
                .read()
                .unwrap()
                .kv
                .sessions
                .keys()
                .next()
                .unwrap();
            sm.apply([entry(txn(vec![put("/eph".into(), b"e".to_vec(), session)]))])
                .await
                .unwrap();
            let state = shared.state.read().unwrap().kv.clone();
            drop((sm, shared));
            assert!(closed.wait(std::time::Duration::from_secs(10)).await);
            state
        };
        assert_eq!(
            applied.kvs.len(),
            50 - 10 + 1,
            "/k/010../k/019 deleted, /eph added"
        );
        assert_eq!(applied.kvs["/k/049"].value, vec![19; 100]);
        assert_eq!(
            applied.kvs["/eph"].session,
            *applied.sessions.keys().next().unwrap()
        );
        let (db, _closed) = open_db(dir.path(), &STATE_CFS).unwrap();
        let loaded = Shared::load(db, options, dir.path()).unwrap();
        assert_eq!(loaded.state.read().unwrap().kv, applied);
    }
}
