//! A bookie's ledger storage, behind the journal: a write cache, entry logs, a RocksDB index
//! of entry locations (pages of 256 entry ids, see [`index`]), a read cache, and per-ledger
//! state.
//!
//! ```text
//!  journal callback ──► write cache (sorted, bounded in bytes)
//!                         │ flush: take the cache; S = journal file of the newest applied record
//!                         ▼
//!                  entry log (append, fdatasync) ──► index + ledger states + checkpoint S
//!                                                    (one synced RocksDB write)
//!                         then journal files < S are removed
//!  reads: write cache → the batch being flushed → read cache → index + entry log (or journal file)
//! ```
//!
//! Entry logs are `entrylog-<id as 16 hex digits>.log` holding `len: u32 BE | envelope`
//! records; an index location points at the envelope. A process always starts a new entry log.
//! Space comes back when every ledger with entries in a log is deleted (the log is removed)
//! or when a log is mostly dead (its live entries are copied to the current log first).
//!
//! Single write (`bookie.single_write`, the default): an entry's envelope is already on disk,
//! fsynced, where the journal wrote it, so a flush writes no entry log: it indexes each entry at
//! its place in its journal file (log id [`JOURNAL_LOG_BIT`] | file sequence) and counts the
//! file's bytes per ledger as an entry log's. Journal files the index points into are kept past
//! the checkpoint (they are not replayed again: replay starts at the checkpoint) and collected
//! like entry logs once the checkpoint has passed them: retired when every ledger in them is
//! deleted, or their live entries copied into the current entry log first when they are mostly
//! dead. A retired journal file becomes the journal's spare when there is none (and it holds at
//! least half of a journal file), else it is removed.
//! Entry logs then hold only what compaction moved. Each byte reaches the disk once instead of
//! twice, and the journal's fdatasyncs no longer queue behind entry-log writes.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use bytes::{Bytes, BytesMut};
use rocksdb::{IteratorMode, Options, WriteBatch, WriteOptions, DB};
use serde::{Deserialize, Serialize};

use super::index::{self, Location};
use crate::proto::{self, Status, NONE};

/// Entry locations, in pages (see [`index`]).
const CF_PAGES: &str = "index_pages";
/// One key per entry, written by bookies before index pages; moved to pages at start-up.
const CF_LEGACY_INDEX: &str = "index";
const CF_LEDGERS: &str = "ledgers";
const CF_LOGS: &str = "logs";
const CF_META: &str = "meta";
/// Where bookies before single write kept the checkpoint (read once, then removed).
const KEY_CHECKPOINT_LEGACY: &str = "journal_checkpoint";
/// The checkpoint, under a key older bookies do not know: one opening these files again finds
/// no checkpoint and replays every journal file (copying what journal files hold into its
/// entry logs) instead of removing the journal files the index points into.
const KEY_CHECKPOINT: &str = "journal_checkpoint_v2";

/// Settings of a bookie's ledger storage (`bookie.*` in the configuration).
#[derive(Debug, Clone)]
pub struct StorageOptions {
    pub ledger_dir: PathBuf,
    pub write_cache_bytes_max: usize,
    pub read_cache_bytes_max: usize,
    pub entry_log_bytes_max: u64,
    /// A non-current entry log whose live bytes fall below this fraction is compacted.
    pub compaction_live_ratio_min: f64,
    pub fsync: bool,
    /// The journal's directory (set by the bookie when it opens storage): journal files the
    /// index points into (see `single_write`) are read and collected there.
    pub journal_dir: Option<PathBuf>,
    /// The journal's `file_bytes_max` when it takes spares (`journal_prefill`; set with
    /// `journal_dir`): a journal file collected here becomes the spare when there is none, so
    /// that the next file overwrites blocks already written (no extents to convert at each
    /// fdatasync) instead of growing a new one.
    pub journal_spare_bytes: Option<u64>,
    /// `bookie.single_write`: journal files stay where they are as the entries' store (the
    /// index points into them; module docs) instead of entries being copied into entry logs.
    pub single_write: bool,
}

/// What a bookie knows of one ledger. Survives restarts (RocksDB, rebuilt from the journal for
/// what was not flushed yet).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerState {
    pub master_key: Vec<u8>,
    pub fenced: bool,
    /// Highest LastAddConfirmed seen in an entry ([`NONE`] if none).
    pub lac: u64,
    /// Highest entry id stored ([`NONE`] if none).
    pub last_entry: u64,
    pub deleted: bool,
}

impl LedgerState {
    fn new(master_key: &[u8]) -> Self {
        Self {
            master_key: master_key.to_vec(),
            fenced: false,
            lac: NONE,
            last_entry: NONE,
            deleted: false,
        }
    }

    fn note_entry(&mut self, entry_id: u64, lac: u64) {
        if self.last_entry == NONE || entry_id > self.last_entry {
            self.last_entry = entry_id;
        }
        if lac != NONE && (self.lac == NONE || lac > self.lac) {
            self.lac = lac;
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("ledger storage {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("ledger index: {0}")]
    Index(#[from] rocksdb::Error),
    #[error("ledger storage: {0}")]
    Corrupt(String),
    /// A write to the index failed before: no later one is tried in this process. Debian's
    /// RocksDB 7.8 (built with its assertions) aborts the process when a log writer that
    /// failed (a full disk) is used again, so the bookie stays read-only until it restarts,
    /// which replays the journal over the index as it was last synced.
    #[error(
        "ledger index: an earlier write failed ({0}); no index write until the bookie restarts"
    )]
    IndexFailed(String),
}

fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> StorageError + '_ {
    move |source| StorageError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn corrupt_page(ledger_id: u64, first_entry: u64) -> impl FnOnce(index::PageError) -> StorageError {
    move |e| {
        StorageError::Corrupt(format!(
            "index page of ledger {ledger_id} from entry {first_entry}: {e}"
        ))
    }
}

fn log_name(id: u64) -> String {
    format!("entrylog-{id:016x}.log")
}

/// Index locations in journal files kept as the entry store carry this bit in their log id
/// (the rest is the journal file's sequence); entry logs' ids never reach it.
pub const JOURNAL_LOG_BIT: u64 = 1 << 63;

/// The log id of journal file `seq` (see [`JOURNAL_LOG_BIT`]).
pub fn journal_log(seq: u64) -> u64 {
    JOURNAL_LOG_BIT | seq
}

fn parse_log_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix("entrylog-")?.strip_suffix(".log")?;
    (hex.len() == 16).then(|| u64::from_str_radix(hex, 16).ok())?
}

struct EntryLogWriter {
    id: u64,
    path: PathBuf,
    file: File,
    /// Bytes on disk so far; a multiple of [`DIRECT_ALIGN`] when `direct`.
    len: u64,
    /// Opened with O_DIRECT: flushed entries skip the page cache (the journal already paid for
    /// one copy through it). Falls back to buffered writes where the file system refuses.
    direct: bool,
    /// Staging buffer of [`STAGE_BYTES`], allocated once and reused: written out whenever full
    /// (an aligned chunk), and padded at the end of a flush.
    stage: Vec<u8>,
    stage_off: usize,
    staged: usize,
}

/// Alignment of O_DIRECT writes (offset, length and buffer address).
const DIRECT_ALIGN: usize = 4096;
/// Entries at least this large are read from entry logs with O_DIRECT. Entry logs are written
/// with O_DIRECT, so their bytes are not in the page cache: a buffered read reads them into it
/// and then copies them, which took about half of a bookie's CPU while a consumer caught up a
/// backlog of batched (128 KiB) entries; reading those directly took the catch-up from about
/// 300,000 to 420,000-480,000 msg/s. Smaller entries are read buffered: the kernel's
/// read-ahead serves many of them with one disk read (direct reads of 1 KiB entries went from
/// about 52,000 to 40,000 msg/s). The block (4 KiB) around an entry is read with it, at most
/// a quarter more at this size.
const DIRECT_READ_BYTES_MIN: usize = 32 << 10;
/// An entry log open for reads: buffered, and with O_DIRECT where the file system allows it.
type LogReader = (File, Option<File>);

/// Size of the staging buffer (a multiple of [`DIRECT_ALIGN`]): each O_DIRECT write of a flush
/// is this large. A journal fsync that arrives during one waits for it on a shared disk, so
/// smaller writes interleave better: with 1 MiB instead of 4 MiB, one bookie's add p99 at full
/// speed was lower in each of 4 alternating pairs (300,000 entries: 12.9-15.7 ms against
/// 14.0-18.5 ms), at the same throughput.
const STAGE_BYTES: usize = 1 << 20;

impl EntryLogWriter {
    fn create(dir: &Path, id: u64, stage: Option<Vec<u8>>) -> Result<Self, StorageError> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join(log_name(id));
        let direct = OpenOptions::new()
            .create_new(true)
            .write(true)
            .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
            .open(&path);
        let (file, direct) = match direct {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
                let _ = fs::remove_file(&path);
                let f = OpenOptions::new()
                    .create_new(true)
                    .write(true)
                    .open(&path)
                    .map_err(io_at(&path))?;
                (f, false)
            }
            Err(e) => return Err(io_at(&path)(e)),
        };
        // The log's name must outlive a power cut as its bytes do: the index will point here.
        meridian_metadata::durable_dir::sync_dir(dir).map_err(io_at(dir))?;
        let stage = stage.unwrap_or_else(|| vec![0u8; STAGE_BYTES + DIRECT_ALIGN]);
        let stage_off = stage.as_ptr().align_offset(DIRECT_ALIGN);
        Ok(Self {
            id,
            path,
            file,
            len: 0,
            direct,
            stage,
            stage_off,
            staged: 0,
        })
    }

    /// Where the next pushed byte lands in the file.
    fn position(&self) -> u64 {
        self.len + self.staged as u64
    }

    /// Stages `bytes` for the log, writing out every full chunk.
    fn push(&mut self, mut bytes: &[u8]) -> Result<(), StorageError> {
        use std::os::unix::fs::FileExt;
        while !bytes.is_empty() {
            let room = STAGE_BYTES - self.staged;
            let n = room.min(bytes.len());
            let at = self.stage_off + self.staged;
            self.stage[at..at + n].copy_from_slice(&bytes[..n]);
            self.staged += n;
            bytes = &bytes[n..];
            if self.staged == STAGE_BYTES {
                let chunk = &self.stage[self.stage_off..self.stage_off + STAGE_BYTES];
                self.file
                    .write_all_at(chunk, self.len)
                    .map_err(io_at(&self.path))?;
                self.len += STAGE_BYTES as u64;
                self.staged = 0;
            }
        }
        Ok(())
    }

    /// Writes what is staged (padded with zeroes to the O_DIRECT alignment when direct) and
    /// fsyncs the log: everything pushed so far is durable when this returns.
    fn finish(&mut self, fsync: bool) -> Result<(), StorageError> {
        use std::os::unix::fs::FileExt;
        if self.staged > 0 {
            let n = if self.direct {
                let padded = self.staged.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
                self.stage[self.stage_off + self.staged..self.stage_off + padded].fill(0);
                padded
            } else {
                self.staged
            };
            let chunk = &self.stage[self.stage_off..self.stage_off + n];
            self.file
                .write_all_at(chunk, self.len)
                .map_err(io_at(&self.path))?;
            self.len += n as u64;
            self.staged = 0;
        }
        if fsync {
            self.file.sync_data().map_err(io_at(&self.path))?;
        }
        Ok(())
    }
}

/// An entry envelope in the write cache: its bytes are `head` (if any) then `body`.
#[derive(Debug, Clone)]
pub(crate) struct Held {
    /// The envelope's header, kept apart from a large payload so that the payload need not be
    /// copied behind it; `None` when `body` is the whole envelope.
    head: Option<[u8; proto::ENVELOPE_HEADER_BYTES]>,
    body: Bytes,
    /// Where the envelope already lies on disk, durably (in a journal file kept as a store):
    /// a flush indexes it there instead of writing it again.
    stored: Option<Location>,
}

impl Held {
    fn whole(body: Bytes) -> Self {
        Self {
            head: None,
            body,
            stored: None,
        }
    }

    fn head(&self) -> &[u8] {
        self.head.as_ref().map_or(&[], |h| &h[..])
    }

    fn len(&self) -> usize {
        self.head().len() + self.body.len()
    }

    /// The envelope in one buffer: shared when there is no head, else a copy (a read of an
    /// entry that is not in an entry log yet).
    fn to_bytes(&self) -> Bytes {
        match &self.head {
            None => self.body.clone(),
            Some(h) => [&h[..], &self.body[..]].concat().into(),
        }
    }
}

/// Entries held between the journal and the entry logs. Their bytes live in reused chunks: once
/// the pool has grown to what the load needs, the write path allocates no fresh memory, whose
/// first touch (zeroing pages) was the largest cost in a profile of a loaded bookie. The pool
/// grows on demand (an idle bookie holds one chunk, not the whole cache) up to twice the cache:
/// the entries being filled and, while a flush writes them out, the ones taken before, as
/// BookKeeper's two write caches. A pool bounded by the cache alone let go of chunks during
/// every flush under load and allocated new ones: 14% of a standalone's CPU zeroed fresh pages
/// and copied into them at 650,000 msg/s. [`trim`](WriteCache::trim) gives back the free chunks
/// of a bookie gone idle.
#[derive(Default)]
struct WriteCache {
    entries: BTreeMap<(u64, u64), Held>,
    bytes: usize,
    /// Bytes of adds admitted (in the journal) but not in `entries` yet.
    reserved: usize,
    chunk: BytesMut,
    /// Used-up chunks; one is reused once every entry carved from it is gone (flushed).
    spent: VecDeque<BytesMut>,
    chunks_max: usize,
    /// Chunks allocated since start (the pool's growth; flat once it covers the load).
    chunks_allocated: u64,
}

/// Size of a write-cache chunk; larger entries get an allocation of their own.
const CHUNK_BYTES: usize = 4 << 20;

/// Entries this large are kept in the write cache without a copy (see [`WriteCache::keep`]).
/// At the maximum batched publish rate (entries of about 128 KiB) the copy was 5% of a
/// standalone's CPU. Large enough that an entry is most of the buffer it was read into (a
/// connection's read buffer starts at 64 KiB): a 16 KiB entry kept this way could pin four
/// times its size while the cache counts only its own bytes.
const SHARE_BYTES_MIN: usize = 64 << 10;

impl WriteCache {
    fn new(bytes_max: usize) -> Self {
        let chunks_max = 2 * bytes_max.div_ceil(CHUNK_BYTES) + 2;
        let spent = VecDeque::new();
        Self {
            entries: BTreeMap::new(),
            bytes: 0,
            reserved: 0,
            chunk: BytesMut::with_capacity(CHUNK_BYTES),
            spent,
            chunks_max,
            chunks_allocated: 0,
        }
    }

    /// What the cache keeps for the envelope `head` (if any) then `body`. A `body` of
    /// [`SHARE_BYTES_MIN`] or more is kept as it came (no copy): it fills most of the buffer it
    /// was read into, so keeping that buffer until the next flush costs little more than the
    /// entry. A smaller entry is copied into the current chunk, so that a few small entries do
    /// not pin whole read buffers.
    fn keep(&mut self, head: Option<&[u8; proto::ENVELOPE_HEADER_BYTES]>, body: &Bytes) -> Held {
        if body.len() >= SHARE_BYTES_MIN {
            return Held {
                head: head.copied(),
                body: body.clone(),
                stored: None,
            };
        }
        let head = head.map_or(&[][..], |h| &h[..]);
        Held::whole(self.copy_in(head, body))
    }

    /// A copy of `head` then `body` carved from the current chunk.
    fn copy_in(&mut self, head: &[u8], body: &[u8]) -> Bytes {
        let len = head.len() + body.len();
        if len > CHUNK_BYTES / 4 {
            let mut v = Vec::with_capacity(len);
            v.extend_from_slice(head);
            v.extend_from_slice(body);
            return v.into();
        }
        if self.chunk.capacity() - self.chunk.len() < len {
            let full = std::mem::take(&mut self.chunk);
            self.spent.push_back(full);
            self.chunk = self.reuse_chunk();
        }
        self.chunk.extend_from_slice(head);
        self.chunk.extend_from_slice(body);
        self.chunk.split().freeze()
    }

    fn reuse_chunk(&mut self) -> BytesMut {
        for _ in 0..self.spent.len() {
            let mut c = self.spent.pop_front().expect("non-empty");
            if c.try_reclaim(CHUNK_BYTES) {
                return c;
            }
            self.spent.push_back(c);
        }
        while self.spent.len() > self.chunks_max {
            // Still referenced (a reader holds an entry): let it go when that reader does.
            self.spent.pop_front();
        }
        self.chunks_allocated += 1;
        metrics::counter!("meridian_bookie_write_cache_chunks_allocated_total").increment(1);
        BytesMut::with_capacity(CHUNK_BYTES)
    }

    /// Lets go of every used-up chunk nothing refers to any more; returns how many.
    fn trim(&mut self) -> usize {
        let before = self.spent.len();
        self.spent.retain_mut(|c| !c.try_reclaim(CHUNK_BYTES));
        before - self.spent.len()
    }
}

/// A read cache bounded in bytes; the oldest insertions go first.
#[derive(Default)]
struct ReadCache {
    entries: HashMap<(u64, u64), Bytes>,
    order: VecDeque<(u64, u64)>,
    bytes: usize,
}

impl ReadCache {
    fn insert(&mut self, key: (u64, u64), value: Bytes, max: usize) {
        if value.len() > max {
            return;
        }
        if let Some(old) = self.entries.insert(key, value.clone()) {
            self.bytes -= old.len();
        } else {
            self.order.push_back(key);
        }
        self.bytes += value.len();
        while self.bytes > max {
            let Some(k) = self.order.pop_front() else {
                break;
            };
            if let Some(v) = self.entries.remove(&k) {
                self.bytes -= v.len();
            }
        }
    }

    /// Forgets one entry (its key stays in `order` until evicted; evicting it then finds
    /// nothing).
    fn remove(&mut self, key: (u64, u64)) {
        if let Some(v) = self.entries.remove(&key) {
            self.bytes -= v.len();
        }
    }

    fn remove_ledger(&mut self, ledger_id: u64) {
        self.entries.retain(|(l, _), v| {
            if *l == ledger_id {
                self.bytes -= v.len();
                false
            } else {
                true
            }
        });
        self.order.retain(|(l, _)| *l != ledger_id);
    }
}

/// Live bytes per ledger in one entry log (what garbage collection decides on).
type LogUsage = BTreeMap<u64, u64>;

pub struct LedgerStorage {
    opts: StorageOptions,
    db: Arc<meridian_metadata::store::Db>,
    logs_dir: PathBuf,
    cache: Mutex<WriteCache>,
    /// The batch being flushed: still readable until the index points at its new home.
    flushing: RwLock<Arc<BTreeMap<(u64, u64), Held>>>,
    ledgers: Mutex<HashMap<u64, LedgerState>>,
    read_cache: Mutex<ReadCache>,
    /// Open entry logs for reads.
    readers: Mutex<HashMap<u64, Arc<LogReader>>>,
    /// Held for the whole of a flush or a compaction: one writer of entry logs at a time.
    writer: Mutex<EntryLogWriter>,
    usage: Mutex<BTreeMap<u64, LogUsage>>,
    /// Journal file of the newest record applied here (records are applied in journal order).
    applied_file: std::sync::atomic::AtomicU64,
    /// The checkpoint last written to the index: a flush with nothing new to write (no
    /// entries, no changed ledger states, the same checkpoint) writes nothing and syncs
    /// nothing, so frequent flushes cost an idle bookie nothing.
    flushed_checkpoint: std::sync::atomic::AtomicU64,
    /// Woken whenever a flush empties the write cache (adds wait on it while it is full).
    space: tokio::sync::Notify,
    /// Ledgers fenced since the last flush (ledgers that got entries are known from the batch,
    /// so the add path does not record them).
    dirty: Mutex<std::collections::HashSet<u64>>,
    /// Why a write to the index failed, once one did (see [`StorageError::IndexFailed`]).
    /// Held across each write, so that two writers cannot both reach RocksDB after a failure.
    index_failed: Mutex<Option<String>>,
}

impl LedgerStorage {
    /// Opens the index and ledger states; returns the storage, the journal checkpoint (every
    /// journal file older than it is already in entry logs), and what tells when the index
    /// database is closed again.
    pub fn open(
        opts: StorageOptions,
    ) -> Result<(Self, u64, meridian_metadata::store::DbClosed), StorageError> {
        let write_cache_bytes_max = opts.write_cache_bytes_max;
        let logs_dir = opts.ledger_dir.join("entrylogs");
        let index_dir = opts.ledger_dir.join("index");
        meridian_metadata::durable_dir::create_dir_all_synced(&logs_dir)
            .map_err(io_at(&logs_dir))?;
        // RocksDB makes its own directory without fsyncing the parent.
        meridian_metadata::durable_dir::create_dir_all_synced(&index_dir)
            .map_err(io_at(&index_dir))?;
        let mut o = Options::default();
        o.create_if_missing(true);
        o.create_missing_column_families(true);
        o.set_paranoid_checks(true);
        let (db, closed) = meridian_metadata::store::Db::open(
            &o,
            &index_dir,
            &[CF_PAGES, CF_LEGACY_INDEX, CF_LEDGERS, CF_LOGS, CF_META],
            // Pages are read back by every flush that extends one, and by reads.
            &[],
            // Larger memtables than metadata's, still bounded.
            32 << 20,
            64 << 20,
        )?;
        let ledgers: HashMap<u64, LedgerState> = load_json_by_id(&db, CF_LEDGERS, "ledger state")?
            .into_iter()
            .collect();
        let usage: BTreeMap<u64, LogUsage> = load_json_by_id(&db, CF_LOGS, "entry log usage")?
            .into_iter()
            .collect();
        let checkpoint = read_checkpoint(&db)?;
        let migrated = migrate_legacy_index(&db, opts.fsync)?;
        if migrated > 0 {
            tracing::info!(
                entries = migrated,
                "moved the per-entry index to index pages"
            );
        }
        let mut next_log = 1;
        for item in fs::read_dir(&logs_dir).map_err(io_at(&logs_dir))? {
            let item = item.map_err(io_at(&logs_dir))?;
            if let Some(id) = item.file_name().to_str().and_then(parse_log_name) {
                next_log = next_log.max(id + 1);
                if !usage.contains_key(&id) {
                    // Written by a flush that never reached the index: nothing points into it,
                    // and its entries are still in the journal.
                    fs::remove_file(item.path()).map_err(io_at(&item.path()))?;
                }
            }
        }
        let writer = EntryLogWriter::create(&logs_dir, next_log, None)?;
        Ok((
            Self {
                opts,
                db,
                logs_dir,
                cache: Mutex::new(WriteCache::new(write_cache_bytes_max)),
                flushing: RwLock::default(),
                ledgers: Mutex::new(ledgers),
                read_cache: Mutex::default(),
                readers: Mutex::default(),
                writer: Mutex::new(writer),
                usage: Mutex::new(usage),
                applied_file: std::sync::atomic::AtomicU64::new(checkpoint),
                flushed_checkpoint: std::sync::atomic::AtomicU64::new(checkpoint),
                space: tokio::sync::Notify::new(),
                dirty: Mutex::default(),
                index_failed: Mutex::default(),
            },
            checkpoint,
            closed,
        ))
    }

    /// A journal record of file `file` was applied (an add made readable, a fence noted).
    pub fn note_applied(&self, file: u64) {
        self.applied_file
            .fetch_max(file, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether an add may be journaled for this ledger.
    pub fn check_add(
        &self,
        ledger_id: u64,
        master_key: &[u8],
        recovery: bool,
    ) -> Result<(), Status> {
        let ledgers = self.ledgers.lock().expect("ledgers lock");
        match ledgers.get(&ledger_id) {
            None => Ok(()),
            Some(s) if s.deleted => Err(Status::NoSuchLedger),
            Some(s) if s.master_key != master_key => Err(Status::Unauthorized),
            Some(s) if s.fenced && !recovery => Err(Status::Fenced),
            Some(_) => Ok(()),
        }
    }

    /// An add is durable in the journal: make it readable. Also used by journal replay. The
    /// envelope is `(head, body)`: its header apart from its payload, or (`None`) all in `body`;
    /// `journaled` is where the journal wrote it (file, offset of the envelope), which a flush
    /// indexes when journal files are the store.
    #[allow(clippy::too_many_arguments)]
    pub fn add_durable(
        &self,
        ledger_id: u64,
        entry_id: u64,
        lac: u64,
        master_key: &[u8],
        (head, body): (Option<&[u8; proto::ENVELOPE_HEADER_BYTES]>, &Bytes),
        journaled: Option<(u64, u64)>,
        reserved: bool,
    ) {
        if reserved {
            self.release(head.map_or(0, |h| h.len()) + body.len());
        }
        {
            let mut ledgers = self.ledgers.lock().expect("ledgers lock");
            let state = ledgers
                .entry(ledger_id)
                .or_insert_with(|| LedgerState::new(master_key));
            if state.deleted {
                // Deleted while the add was in the journal: drop it.
                return;
            }
            state.note_entry(entry_id, lac);
        }
        let mut cache = self.cache.lock().expect("cache lock");
        let mut envelope = cache.keep(head, body);
        if let (true, Some(_), Some((file, offset))) =
            (self.opts.single_write, &self.opts.journal_dir, journaled)
        {
            envelope.stored = Some(Location {
                log: journal_log(file),
                offset,
                len: envelope.len() as u32,
            });
        }
        cache.bytes += envelope.len();
        if let Some(old) = cache.entries.insert((ledger_id, entry_id), envelope) {
            cache.bytes -= old.len();
        }
    }

    /// Fences the ledger (creating its state if this bookie has none: the old writer must be
    /// refused here too). The caller journals a fence record before answering.
    pub fn fence(&self, ledger_id: u64, master_key: &[u8]) -> Result<(), Status> {
        let mut ledgers = self.ledgers.lock().expect("ledgers lock");
        let state = ledgers
            .entry(ledger_id)
            .or_insert_with(|| LedgerState::new(master_key));
        if state.deleted {
            return Err(Status::NoSuchLedger);
        }
        if state.master_key != master_key {
            return Err(Status::Unauthorized);
        }
        state.fenced = true;
        drop(ledgers);
        self.dirty.lock().expect("dirty lock").insert(ledger_id);
        Ok(())
    }

    pub fn ledger_state(&self, ledger_id: u64) -> Option<LedgerState> {
        self.ledgers
            .lock()
            .expect("ledgers lock")
            .get(&ledger_id)
            .filter(|s| !s.deleted)
            .cloned()
    }

    /// Admits an add of `n` bytes into the write cache, waiting while it is full (until a flush
    /// makes room). The bytes are counted from now on, so adds in the journal cannot overrun the
    /// bound; [`add_durable`](Self::add_durable) with `reserved` or
    /// [`release`](Self::release) settles them.
    pub async fn reserve(&self, n: usize) {
        loop {
            let notified = self.space.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut c = self.cache.lock().expect("cache lock");
                let used = c.bytes + c.reserved;
                // An entry larger than the whole cache still gets in once the cache is empty.
                if used + n <= self.opts.write_cache_bytes_max || used == 0 {
                    c.reserved += n;
                    return;
                }
            }
            // The timeout is a safety net only: flushes wake every waiter.
            let _ = tokio::time::timeout(std::time::Duration::from_millis(100), notified).await;
        }
    }

    /// Gives back a reservation whose add failed.
    pub fn release(&self, n: usize) {
        let mut c = self.cache.lock().expect("cache lock");
        c.reserved = c.reserved.saturating_sub(n);
    }

    /// Gives the write cache's free chunks back (a bookie gone idle); returns their bytes.
    pub fn trim_write_cache(&self) -> usize {
        self.cache.lock().expect("cache lock").trim() * CHUNK_BYTES
    }

    /// Bytes in the write cache, counting admitted adds still in the journal.
    pub fn write_cache_bytes(&self) -> usize {
        let c = self.cache.lock().expect("cache lock");
        c.bytes + c.reserved
    }

    /// Reads one entry's envelope (checked by the caller before it goes out).
    pub fn read(&self, ledger_id: u64, entry_id: u64) -> Result<Bytes, Status> {
        if self.ledger_state(ledger_id).is_none() {
            return Err(Status::NoSuchLedger);
        }
        let key = (ledger_id, entry_id);
        if let Some(v) = self.cache.lock().expect("cache lock").entries.get(&key) {
            return Ok(v.to_bytes());
        }
        if let Some(v) = self.flushing.read().expect("flushing lock").get(&key) {
            return Ok(v.to_bytes());
        }
        if let Some(v) = self
            .read_cache
            .lock()
            .expect("read cache lock")
            .entries
            .get(&key)
        {
            return Ok(v.clone());
        }
        let loc = match self
            .db
            .get_pinned_cf(cf(&self.db, CF_PAGES), index::page_key(ledger_id, entry_id))
        {
            Ok(Some(page)) => match index::find(&page, index::slot(entry_id)) {
                Ok(Some(loc)) => loc,
                Ok(None) => return Err(Status::NoSuchEntry),
                Err(e) => {
                    tracing::error!(error = %e, ledger_id, entry_id, "index page unreadable");
                    return Err(Status::Internal);
                }
            },
            Ok(None) => return Err(Status::NoSuchEntry),
            Err(e) => {
                tracing::error!(error = %e, ledger_id, entry_id, "index read failed");
                return Err(Status::Internal);
            }
        };
        let value = self.read_at(loc).map_err(|e| {
            tracing::error!(error = %e, ledger_id, entry_id, "entry log read failed");
            Status::Internal
        })?;
        self.read_cache.lock().expect("read cache lock").insert(
            key,
            value.clone(),
            self.opts.read_cache_bytes_max,
        );
        Ok(value)
    }

    /// Forgets what the read cache holds of an entry: a read of it that did not verify (the
    /// bytes of a file written over after garbage collection moved the entry, or damage).
    pub fn forget_read(&self, ledger_id: u64, entry_id: u64) {
        self.read_cache
            .lock()
            .expect("read cache lock")
            .remove((ledger_id, entry_id));
    }

    /// An entry log opened for reads, buffered and (where the file system allows it) with
    /// O_DIRECT: [`read_at`](Self::read_at) reads large entries directly.
    fn reader(&self, log: u64) -> Result<Arc<LogReader>, StorageError> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut readers = self.readers.lock().expect("readers lock");
        if let Some(f) = readers.get(&log) {
            return Ok(Arc::clone(f));
        }
        let path = self.log_path(log);
        let direct = OpenOptions::new()
            .read(true)
            .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
            .open(&path);
        let direct = match direct {
            Ok(f) => Some(f),
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => None,
            Err(e) => return Err(io_at(&path)(e)),
        };
        let f = Arc::new((File::open(&path).map_err(io_at(&path))?, direct));
        readers.insert(log, Arc::clone(&f));
        Ok(f)
    }

    /// The file of a log id: an entry log, or a journal file kept as the store.
    fn log_path(&self, log: u64) -> PathBuf {
        match &self.opts.journal_dir {
            Some(dir) if log & JOURNAL_LOG_BIT != 0 => {
                crate::journal::file_path(dir, log & !JOURNAL_LOG_BIT)
            }
            _ => self.logs_dir.join(log_name(log)),
        }
    }

    /// Whether the index points into journal file `seq` (kept as the store: not to be
    /// removed or recycled when the checkpoint passes it).
    pub fn stores_in_journal_file(&self, seq: u64) -> bool {
        self.usage
            .lock()
            .expect("usage lock")
            .contains_key(&journal_log(seq))
    }

    fn read_at(&self, loc: Location) -> Result<Bytes, StorageError> {
        let f = self.reader(loc.log)?;
        let at = |e| io_at(&self.log_path(loc.log))(e);
        let file = match &f.1 {
            Some(direct) if loc.len as usize >= DIRECT_READ_BYTES_MIN => direct,
            _ => {
                let mut buf = vec![0u8; loc.len as usize];
                f.0.read_exact_at(&mut buf, loc.offset).map_err(at)?;
                return Ok(Bytes::from(buf));
            }
        };
        // O_DIRECT: offset, length and buffer aligned; the entry is sliced out of the blocks
        // that hold it, without a copy.
        let align = DIRECT_ALIGN as u64;
        let start = loc.offset / align * align;
        let end = (loc.offset + loc.len as u64).div_ceil(align) * align;
        let span = (end - start) as usize;
        let mut buf = vec![0u8; span + DIRECT_ALIGN];
        let off = buf.as_ptr().align_offset(DIRECT_ALIGN);
        let need = (loc.offset + loc.len as u64 - start) as usize;
        let mut got = 0usize;
        while got < need {
            // Whole blocks from an aligned offset; only the file's end reads short.
            match file.read_at(&mut buf[off + got..off + span], start + got as u64) {
                Ok(0) => {
                    return Err(at(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!(
                            "entry log ends before offset {}",
                            loc.offset + loc.len as u64
                        ),
                    )))
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(at(e)),
            }
        }
        let from = off + (loc.offset - start) as usize;
        Ok(Bytes::from(buf).slice(from..from + loc.len as usize))
    }

    /// Marks the ledger deleted (durably) and forgets its entries; the space comes back when
    /// garbage collection removes or compacts the entry logs that hold them.
    pub fn delete(&self, ledger_id: u64) -> Result<(), StorageError> {
        // Not while a flush or compaction runs: one that read a page of this ledger before the
        // deletion would write it back after it.
        let _writer = self.writer.lock().expect("writer lock");
        let state = {
            let mut ledgers = self.ledgers.lock().expect("ledgers lock");
            let Some(state) = ledgers.get_mut(&ledger_id) else {
                return Ok(());
            };
            state.deleted = true;
            state.clone()
        };
        let mut batch = WriteBatch::default();
        batch.put_cf(
            cf(&self.db, CF_LEDGERS),
            ledger_id.to_be_bytes(),
            to_json(&state),
        );
        batch.delete_range_cf(
            cf(&self.db, CF_PAGES),
            index::page_key(ledger_id, 0),
            index::ledger_end(ledger_id),
        );
        self.write_synced(batch)?;
        {
            let mut cache = self.cache.lock().expect("cache lock");
            let keys: Vec<_> = cache
                .entries
                .range((ledger_id, 0)..=(ledger_id, u64::MAX))
                .map(|(k, _)| *k)
                .collect();
            for k in keys {
                let v = cache.entries.remove(&k).expect("present");
                cache.bytes -= v.len();
            }
        }
        self.read_cache
            .lock()
            .expect("read cache lock")
            .remove_ledger(ledger_id);
        Ok(())
    }

    /// Writes `batch` to the index (synced with `fsync`), unless an earlier write failed
    /// ([`StorageError::IndexFailed`]).
    fn write_synced(&self, batch: WriteBatch) -> Result<(), StorageError> {
        let mut failed = self.index_failed.lock().expect("index failure lock");
        if let Some(why) = &*failed {
            return Err(StorageError::IndexFailed(why.clone()));
        }
        write_synced(&self.db, batch, self.opts.fsync).inspect_err(|e| {
            *failed = Some(e.to_string());
        })
    }

    /// Moves the write cache to entry logs and the index, then records the checkpoint: the
    /// journal file of the newest record applied when the cache was taken. Every record of an
    /// older file is then in entry logs and the index (records are applied in journal order),
    /// so journal files older than the returned checkpoint may be removed once this returns.
    pub fn flush(&self) -> Result<u64, StorageError> {
        let mut writer = self.writer.lock().expect("writer lock");
        let (batch_entries, checkpoint) = {
            let mut cache = self.cache.lock().expect("cache lock");
            let taken = std::mem::take(&mut cache.entries);
            cache.bytes = 0;
            let checkpoint = self.applied_file.load(std::sync::atomic::Ordering::Relaxed);
            (Arc::new(taken), checkpoint)
        };
        self.space.notify_waiters();
        if batch_entries.is_empty()
            && self.dirty.lock().expect("dirty lock").is_empty()
            && self
                .flushed_checkpoint
                .load(std::sync::atomic::Ordering::Relaxed)
                == checkpoint
        {
            return Ok(checkpoint);
        }
        *self.flushing.write().expect("flushing lock") = Arc::clone(&batch_entries);
        let result = self.write_entries(&mut writer, &batch_entries, checkpoint);
        if result.is_ok() {
            self.flushed_checkpoint
                .store(checkpoint, std::sync::atomic::Ordering::Relaxed);
        }
        if result.is_err() {
            // Put them back: still in the journal, still readable, flushed next time.
            let mut cache = self.cache.lock().expect("cache lock");
            for (k, v) in batch_entries.iter() {
                if !cache.entries.contains_key(k) {
                    cache.bytes += v.len();
                    cache.entries.insert(*k, v.clone());
                }
            }
        }
        *self.flushing.write().expect("flushing lock") = Arc::default();
        result.map(|()| checkpoint)
    }

    fn write_entries(
        &self,
        writer: &mut EntryLogWriter,
        entries: &BTreeMap<(u64, u64), Held>,
        checkpoint: u64,
    ) -> Result<(), StorageError> {
        let mut batch = WriteBatch::default();
        let mut touched: BTreeMap<u64, LogUsage> = BTreeMap::new();
        // The ledgers in this flush (keys are sorted, so each ledger's entries are one run),
        // found before taking the ledgers lock: every add takes that lock too, so it is held
        // for one look-up per ledger, not one per entry.
        let mut ids: Vec<u64> = entries.keys().map(|(l, _)| *l).collect();
        ids.dedup();
        let deleted: std::collections::HashSet<u64> = {
            let ledgers = self.ledgers.lock().expect("ledgers lock");
            ids.iter()
                .copied()
                .filter(|l| ledgers.get(l).is_some_and(|s| s.deleted))
                .collect()
        };
        // The page being filled (ledger, page key) and its new records; bytes per (log, ledger)
        // summed over each run of one ledger in one log.
        let mut page: Option<(u64, [u8; 16])> = None;
        let mut records: Vec<(u16, Location)> = Vec::new();
        let mut run: Option<(u64, u64, u64)> = None;
        // Whether anything went to the entry log (which then needs its fsync).
        let mut wrote = false;
        for ((ledger_id, entry_id), value) in entries {
            if deleted.contains(ledger_id) {
                continue;
            }
            let loc = match value.stored {
                // Already on disk where the journal wrote it: indexed there.
                Some(loc) => loc,
                None => {
                    wrote = true;
                    if writer.position() > self.opts.entry_log_bytes_max {
                        writer.finish(self.opts.fsync)?;
                        let next = writer.id + 1;
                        let stage = std::mem::take(&mut writer.stage);
                        *writer = EntryLogWriter::create(&self.logs_dir, next, Some(stage))?;
                    }
                    let offset = writer.position() + 4;
                    writer.push(&(value.len() as u32).to_be_bytes())?;
                    writer.push(value.head())?;
                    writer.push(&value.body)?;
                    Location {
                        log: writer.id,
                        offset,
                        len: value.len() as u32,
                    }
                }
            };
            let key = index::page_key(*ledger_id, *entry_id);
            if page.is_none_or(|(_, k)| k != key) {
                if let Some((ledger, k)) = page {
                    put_page(&self.db, &mut batch, ledger, &k, &records)?;
                }
                records.clear();
                page = Some((*ledger_id, key));
            }
            records.push((index::slot(*entry_id), loc));
            let bytes = value.len() as u64 + 4;
            match &mut run {
                Some((log, ledger, sum)) if *log == loc.log && ledger == ledger_id => *sum += bytes,
                _ => {
                    if let Some((log, ledger, sum)) = run {
                        *touched.entry(log).or_default().entry(ledger).or_default() += sum;
                    }
                    run = Some((loc.log, *ledger_id, bytes));
                }
            }
        }
        if let Some((ledger, k)) = page {
            put_page(&self.db, &mut batch, ledger, &k, &records)?;
        }
        if let Some((log, ledger, sum)) = run {
            *touched.entry(log).or_default().entry(ledger).or_default() += sum;
        }
        if wrote {
            writer.finish(self.opts.fsync)?;
        }
        // The index may only point at bytes that are on disk.
        {
            let mut usage = self.usage.lock().expect("usage lock");
            for (log, add) in touched {
                let u = usage.entry(log).or_default();
                for (ledger, bytes) in add {
                    *u.entry(ledger).or_default() += bytes;
                }
                batch.put_cf(cf(&self.db, CF_LOGS), log.to_be_bytes(), to_json(u));
            }
        }
        // Only the states that changed: journal files up to the checkpoint go after this, so
        // every state they hold must be in this batch.
        let fenced = std::mem::take(&mut *self.dirty.lock().expect("dirty lock"));
        let mut dirty = fenced.clone();
        dirty.extend(ids.iter().copied());
        {
            let ledgers = self.ledgers.lock().expect("ledgers lock");
            for id in &dirty {
                if let Some(state) = ledgers.get(id) {
                    batch.put_cf(cf(&self.db, CF_LEDGERS), id.to_be_bytes(), to_json(state));
                }
            }
        }
        batch.put_cf(
            cf(&self.db, CF_META),
            KEY_CHECKPOINT,
            checkpoint.to_be_bytes(),
        );
        batch.delete_cf(cf(&self.db, CF_META), KEY_CHECKPOINT_LEGACY);
        let result = self.write_synced(batch);
        if result.is_err() {
            self.dirty.lock().expect("dirty lock").extend(fenced);
        }
        result
    }

    /// Removes entry logs whose every ledger is deleted, and (with `compact`) compacts
    /// non-current logs whose live share fell under `compaction_live_ratio_min`. Returns the
    /// bytes freed on disk.
    pub fn collect_garbage(&self, compact: bool) -> Result<u64, StorageError> {
        let mut writer = self.writer.lock().expect("writer lock");
        let current = writer.id;
        let deleted: std::collections::HashSet<u64> = self
            .ledgers
            .lock()
            .expect("ledgers lock")
            .iter()
            .filter(|(_, s)| s.deleted)
            .map(|(id, _)| *id)
            .collect();
        // A journal file from the checkpoint on may still be written to, and its records are
        // replayed after a restart: only older ones are collected.
        let checkpoint = self
            .flushed_checkpoint
            .load(std::sync::atomic::Ordering::Relaxed);
        let candidates: Vec<(u64, LogUsage)> = self
            .usage
            .lock()
            .expect("usage lock")
            .iter()
            .filter(|(id, _)| {
                **id != current
                    && (**id & JOURNAL_LOG_BIT == 0 || **id & !JOURNAL_LOG_BIT < checkpoint)
            })
            .map(|(id, u)| (*id, u.clone()))
            .collect();
        let mut freed = 0;
        for (log, u) in candidates {
            let total: u64 = u.values().sum();
            let live: u64 = u
                .iter()
                .filter(|(l, _)| !deleted.contains(l))
                .map(|(_, b)| *b)
                .sum();
            if live > 0
                && (!compact
                    || (live as f64) >= (total as f64) * self.opts.compaction_live_ratio_min)
            {
                continue;
            }
            if live > 0 {
                self.compact_log(&mut writer, log, &u, &deleted)?;
            }
            let path = self.log_path(log);
            let size = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            let mut batch = WriteBatch::default();
            batch.delete_cf(cf(&self.db, CF_LOGS), log.to_be_bytes());
            self.write_synced(batch)?;
            self.usage.lock().expect("usage lock").remove(&log);
            self.readers.lock().expect("readers lock").remove(&log);
            // A read that looked the index up before the repoint and opens the file after this
            // fails or does not verify, and is tried again from the index (`read_checked`).
            let disposed = match (&self.opts.journal_dir, self.opts.journal_spare_bytes) {
                (Some(dir), Some(file_bytes_max)) if log & JOURNAL_LOG_BIT != 0 => {
                    crate::journal::retire(dir, &path, file_bytes_max, true).map_err(|e| match e {
                        crate::journal::JournalError::Io { source, .. } => source,
                        other => std::io::Error::other(other.to_string()),
                    })
                }
                _ => fs::remove_file(&path).map(|()| false),
            };
            let spare = match disposed {
                Ok(spare) => spare,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
                Err(e) => return Err(io_at(&path)(e)),
            };
            // A read between the first removal and the retirement may have opened the file
            // again by its name: its descriptor would keep the spare (and the journal file made
            // of it) open for good.
            self.readers.lock().expect("readers lock").remove(&log);
            // Kept as the journal's spare, its blocks stay allocated.
            if !spare {
                freed += size;
            }
            tracing::info!(path = %path.display(), live, total, spare, "entry log collected");
        }
        Ok(freed)
    }

    /// Copies the live entries of `log` into the current entry log and repoints the index.
    fn compact_log(
        &self,
        writer: &mut EntryLogWriter,
        log: u64,
        usage: &LogUsage,
        deleted: &std::collections::HashSet<u64>,
    ) -> Result<(), StorageError> {
        let mut moved = BTreeMap::new();
        for ledger in usage.keys().filter(|l| !deleted.contains(l)) {
            let from = index::page_key(*ledger, 0);
            let mut read = rocksdb::ReadOptions::default();
            read.set_iterate_upper_bound(index::ledger_end(*ledger));
            let iter = self.db.iterator_cf_opt(
                cf(&self.db, CF_PAGES),
                read,
                IteratorMode::From(&from, rocksdb::Direction::Forward),
            );
            for item in iter {
                let (k, v) = item?;
                let Some((_, first)) = index::parse_key(&k) else {
                    return Err(StorageError::Corrupt(format!(
                        "index page key of {} bytes",
                        k.len()
                    )));
                };
                for (slot, loc) in index::records(&v).map_err(corrupt_page(*ledger, first))? {
                    if loc.log == log {
                        let entry_id = first + slot as u64;
                        let bytes = self.read_at(loc)?;
                        // The log is removed after this: what moves must be the entry, whole.
                        match proto::open(&bytes) {
                            Ok(e) if e.ledger_id == *ledger && e.entry_id == entry_id => {}
                            other => {
                                return Err(StorageError::Corrupt(format!(
                                    "entry {entry_id} of ledger {ledger} in log {log:#x} does not verify ({:?}); the log is kept",
                                    other.map(|e| (e.ledger_id, e.entry_id))
                                )))
                            }
                        }
                        moved.insert((*ledger, entry_id), Held::whole(bytes));
                    }
                }
            }
        }
        let checkpoint = read_checkpoint(&self.db)?;
        self.write_entries(writer, &moved, checkpoint)
    }

    /// Ledgers this bookie stores (not deleted), with their state.
    pub fn ledgers(&self) -> Vec<(u64, LedgerState)> {
        let mut v: Vec<_> = self
            .ledgers
            .lock()
            .expect("ledgers lock")
            .iter()
            .filter(|(_, s)| !s.deleted)
            .map(|(id, s)| (*id, s.clone()))
            .collect();
        v.sort_by_key(|(id, _)| *id);
        v
    }
}

fn cf<'a>(db: &'a DB, name: &str) -> &'a rocksdb::ColumnFamily {
    db.cf_handle(name).expect("column family created at open")
}

fn to_json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("serializable")
}

/// Every `(u64 id, JSON value)` of column family `name`.
fn load_json_by_id<T: serde::de::DeserializeOwned>(
    db: &DB,
    name: &str,
    what: &str,
) -> Result<Vec<(u64, T)>, StorageError> {
    let mut out = Vec::new();
    for item in db.iterator_cf(cf(db, name), IteratorMode::Start) {
        let (k, v) = item?;
        let id = u64::from_be_bytes(
            k.as_ref()
                .try_into()
                .map_err(|_| StorageError::Corrupt(format!("{what} key")))?,
        );
        let value = serde_json::from_slice(&v)
            .map_err(|e| StorageError::Corrupt(format!("{what} of {id}: {e}")))?;
        out.push((id, value));
    }
    Ok(out)
}

fn write_synced(db: &DB, batch: WriteBatch, fsync: bool) -> Result<(), StorageError> {
    let mut wo = WriteOptions::default();
    wo.set_sync(fsync);
    db.write_opt(batch, &wo)?;
    Ok(())
}

/// Adds to `batch` the page `key` of `ledger_id` with `records` (sorted by slot) merged into
/// what the index holds for it.
fn put_page(
    db: &DB,
    batch: &mut WriteBatch,
    ledger_id: u64,
    key: &[u8; 16],
    records: &[(u16, Location)],
) -> Result<(), StorageError> {
    let pages = cf(db, CF_PAGES);
    let existing = db.get_pinned_cf(pages, key)?;
    let first = index::parse_key(key).map_or(0, |(_, first)| first);
    let page = match index::merge(existing.as_deref(), records) {
        Ok(page) => page,
        Err(e) => {
            // A damaged stored page must not stop every flush (the write cache would fill and
            // adds to every ledger stall): keep what still reads, log what is lost.
            let stored = existing.as_deref().unwrap_or_default();
            let kept = index::salvage(stored);
            tracing::error!(
                ledger_id,
                first_entry = first,
                error = %e,
                stored_records = stored.len() / index::RECORD_BYTES,
                kept_records = kept.len() / index::RECORD_BYTES,
                "index page damaged; rewritten from the records that still read"
            );
            index::merge(Some(&kept), records).map_err(corrupt_page(ledger_id, first))?
        }
    };
    batch.put_cf(pages, key, page);
    Ok(())
}

/// Moves a per-entry index (one key `ledger | entry` -> `log | offset | len` per entry, as
/// bookies wrote before index pages) into pages, in synced batches, and empties it. Returns how
/// many entries it moved.
fn migrate_legacy_index(db: &DB, fsync: bool) -> Result<u64, StorageError> {
    // Small in tests, so that a test crosses batch (and page) boundaries.
    const BATCH_ENTRIES: usize = if cfg!(test) { 100 } else { 65_536 };
    let legacy = cf(db, CF_LEGACY_INDEX);
    let mut moved = 0u64;
    let mut pages: BTreeMap<[u8; 16], Vec<(u16, Location)>> = BTreeMap::new();
    let mut pending = 0usize;
    let write = |pages: &mut BTreeMap<[u8; 16], Vec<(u16, Location)>>| {
        let mut batch = WriteBatch::default();
        for (key, records) in std::mem::take(pages) {
            let ledger = index::parse_key(&key).map_or(0, |(ledger, _)| ledger);
            put_page(db, &mut batch, ledger, &key, &records)?;
        }
        write_synced(db, batch, fsync)
    };
    for item in db.iterator_cf(legacy, IteratorMode::Start) {
        let (k, v) = item?;
        if k.len() != 16 || v.len() != 20 {
            return Err(StorageError::Corrupt(format!(
                "legacy index record {k:02x?} -> {v:02x?}"
            )));
        }
        let word = |b: &[u8], at: usize| u64::from_be_bytes(b[at..at + 8].try_into().expect("8"));
        let (ledger, entry) = (word(&k, 0), word(&k, 8));
        let loc = Location {
            log: word(&v, 0),
            offset: word(&v, 8),
            len: u32::from_be_bytes(v[16..20].try_into().expect("4 bytes")),
        };
        // Keys sort by (ledger, entry), so each page's records arrive in slot order.
        pages
            .entry(index::page_key(ledger, entry))
            .or_default()
            .push((index::slot(entry), loc));
        moved += 1;
        pending += 1;
        if pending >= BATCH_ENTRIES {
            write(&mut pages)?;
            pending = 0;
        }
    }
    if moved == 0 {
        return Ok(0);
    }
    write(&mut pages)?;
    let mut batch = WriteBatch::default();
    batch.delete_range_cf(legacy, [0u8; 16], [0xffu8; 16]);
    batch.delete_cf(legacy, [0xffu8; 16]);
    write_synced(db, batch, fsync)?;
    Ok(moved)
}

fn read_checkpoint(db: &DB) -> Result<u64, StorageError> {
    let at = match db.get_cf(cf(db, CF_META), KEY_CHECKPOINT)? {
        Some(v) => Some(v),
        None => db.get_cf(cf(db, CF_META), KEY_CHECKPOINT_LEGACY)?,
    };
    match at {
        Some(v) => Ok(u64::from_be_bytes(
            v.as_slice()
                .try_into()
                .map_err(|_| StorageError::Corrupt("checkpoint".into()))?,
        )),
        None => Ok(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn open(dir: &Path) -> LedgerStorage {
        LedgerStorage::open(StorageOptions {
            ledger_dir: dir.to_path_buf(),
            write_cache_bytes_max: 64 << 20,
            read_cache_bytes_max: 0,
            entry_log_bytes_max: 1 << 30,
            compaction_live_ratio_min: 0.5,
            fsync: true,
            journal_dir: None,
            journal_spare_bytes: None,
            single_write: false,
        })
        .expect("open")
        .0
    }

    /// Carves `bytes` worth of 1,100-byte entries from the cache's chunks.
    fn fill(c: &mut WriteCache, bytes: usize) -> Vec<Bytes> {
        let data = vec![7u8; 1100];
        (0..bytes / data.len())
            .map(|_| c.copy_in(&[], &data))
            .collect()
    }

    #[test]
    fn given_a_cache_refilled_while_a_flush_runs_when_load_goes_on_then_its_chunks_are_reused() {
        let max = 40 << 20;
        let mut c = WriteCache::new(max);
        // A full cache is taken by a flush, and the cache fills again while it runs.
        let mut flushing = fill(&mut c, max);
        let mut filling = fill(&mut c, max);
        let mut grown = 0;
        for round in 0..8 {
            // That flush ends; the next takes what filled meanwhile.
            drop(std::mem::replace(
                &mut flushing,
                std::mem::take(&mut filling),
            ));
            filling = fill(&mut c, max);
            if round == 2 {
                grown = c.chunks_allocated;
            }
        }
        assert_eq!(
            c.chunks_allocated, grown,
            "the pool covers the cache and a flush's entries: no fresh chunk once it has grown"
        );
        drop((flushing, filling));
        let spent = c.spent.len();
        assert_eq!(c.trim(), spent, "an idle cache gives every free chunk back");
        fill(&mut c, 3 * CHUNK_BYTES);
        assert!(
            c.chunks_allocated > grown,
            "after a trim, chunks are allocated again"
        );
    }

    #[test]
    fn given_large_and_small_entries_when_cached_then_only_small_ones_are_copied() {
        let mut c = WriteCache::new(64 << 20);
        let large = Bytes::from(vec![7u8; SHARE_BYTES_MIN]);
        let head = [9u8; proto::ENVELOPE_HEADER_BYTES];
        let kept = c.keep(Some(&head), &large);
        assert_eq!(
            kept.body.as_ptr(),
            large.as_ptr(),
            "a large entry is kept as it came"
        );
        assert_eq!(kept.head(), head);
        assert_eq!(kept.to_bytes(), [&head[..], &large[..]].concat());
        let small = Bytes::from(vec![8u8; SHARE_BYTES_MIN - 1]);
        let kept = c.keep(Some(&head), &small);
        assert_eq!(kept.to_bytes(), [&head[..], &small[..]].concat());
        assert!(
            kept.head().is_empty(),
            "a small entry is copied whole into a chunk"
        );
        assert_ne!(kept.body.as_ptr(), small.as_ptr());
    }

    #[test]
    fn given_entries_of_every_alignment_when_flushed_then_entry_log_reads_return_them_exactly() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        // Sizes around the 4 KiB blocks of O_DIRECT reads, small and large: entries start and
        // end inside blocks, on their edges, and span many.
        let sizes = [
            1usize, 13, 4095, 4096, 4097, 100, 8191, 8192, 70_000, 200_001, 3, 131_072,
        ];
        let entries: Vec<Bytes> = sizes
            .iter()
            .map(|n| (0..*n).map(|_| rng.gen()).collect::<Vec<u8>>().into())
            .collect();
        {
            let s = open(dir.path());
            for (i, e) in entries.iter().enumerate() {
                // Every other one long enough has its header apart, as adds from in-process
                // writers.
                const H: usize = proto::ENVELOPE_HEADER_BYTES;
                match e.get(..H) {
                    Some(h) if i % 2 == 0 => {
                        let h: &[u8; H] = h.try_into().expect("header bytes");
                        s.add_durable(
                            9,
                            i as u64,
                            NONE,
                            b"key",
                            (Some(h), &e.slice(H..)),
                            None,
                            false,
                        )
                    }
                    _ => s.add_durable(9, i as u64, NONE, b"key", (None, e), None, false),
                }
            }
            s.flush().expect("flush");
            for (i, e) in entries.iter().enumerate() {
                assert_eq!(
                    s.read(9, i as u64).expect("read").as_ref(),
                    &e[..],
                    "entry {i}"
                );
            }
        }
        // After a restart, from the entry log only.
        let s = open(dir.path());
        for (i, e) in entries.iter().enumerate().rev() {
            assert_eq!(
                s.read(9, i as u64).expect("read").as_ref(),
                &e[..],
                "entry {i}"
            );
        }
        assert_eq!(s.read(9, sizes.len() as u64), Err(Status::NoSuchEntry));
    }

    fn entry(ledger: u64, id: u64, version: u8) -> Bytes {
        let mut v = format!("ledger {ledger} entry {id} v{version} ").into_bytes();
        v.resize(300 + (id as usize % 700), version);
        v.into()
    }

    /// Entry ids a bookie holds of a ledger striped E=3, Qw=2 (two of every three, as bookie 0).
    fn striped(range: std::ops::Range<u64>) -> Vec<u64> {
        range.filter(|e| e % 3 != 2).collect()
    }

    fn pages_of(s: &LedgerStorage, ledger: u64) -> usize {
        s.db.iterator_cf(
            cf(&s.db, CF_PAGES),
            IteratorMode::From(&index::page_key(ledger, 0), rocksdb::Direction::Forward),
        )
        .map(|i| i.expect("iterate"))
        .take_while(|(k, _)| k[..8] == ledger.to_be_bytes())
        .count()
    }

    #[test]
    fn given_striped_entries_flushed_in_parts_across_pages_then_each_reads_back_and_gaps_are_absent(
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let ids = striped(0..1_000);
        {
            let s = open(dir.path());
            // Flush edges inside pages (256 ids each): 100, 300, 700.
            for part in [0..100, 100..300, 300..700, 700..1_000] {
                for id in ids.iter().filter(|id| part.contains(*id)) {
                    s.add_durable(4, *id, NONE, b"key", (None, &entry(4, *id, 1)), None, false);
                }
                // Another ledger's entries interleaved in the same flushes.
                s.add_durable(
                    5,
                    part.start,
                    NONE,
                    b"key",
                    (None, &entry(5, part.start, 1)),
                    None,
                    false,
                );
                s.flush().expect("flush");
            }
            // Written again (as a recovery would): the new location wins.
            s.add_durable(4, 301, NONE, b"key", (None, &entry(4, 301, 2)), None, false);
            s.flush().expect("flush");
            assert_eq!(pages_of(&s, 4), 4, "1,000 ids make 4 pages");
        }
        let s = open(dir.path());
        for id in 0..1_000u64 {
            let got = s.read(4, id);
            if id % 3 == 2 {
                assert_eq!(got, Err(Status::NoSuchEntry), "entry {id} was never stored");
            } else {
                let version = if id == 301 { 2 } else { 1 };
                assert_eq!(got.expect("read"), entry(4, id, version), "entry {id}");
            }
        }
        for id in [0, 100, 300, 700] {
            assert_eq!(s.read(5, id).expect("read"), entry(5, id, 1));
        }
        assert_eq!(s.read(4, 1_000), Err(Status::NoSuchEntry));
        assert_eq!(s.read(4, u64::MAX - 1), Err(Status::NoSuchEntry));
        // Deleting a ledger drops its pages and leaves its neighbour's.
        s.delete(4).expect("delete");
        assert_eq!(pages_of(&s, 4), 0);
        assert_eq!(pages_of(&s, 5), 3);
        assert_eq!(s.read(5, 700).expect("read"), entry(5, 700, 1));
    }

    #[test]
    fn given_a_per_entry_index_of_an_older_bookie_when_opened_then_it_moves_to_pages() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ids = striped(0..600);
        {
            let s = open(dir.path());
            for id in &ids {
                s.add_durable(8, *id, NONE, b"key", (None, &entry(8, *id, 1)), None, false);
            }
            s.flush().expect("flush");
            // Rewrite the index as older bookies kept it: a key per entry, no pages.
            let mut batch = WriteBatch::default();
            for item in s.db.iterator_cf(cf(&s.db, CF_PAGES), IteratorMode::Start) {
                let (k, v) = item.expect("iterate");
                let (ledger, first) = index::parse_key(&k).expect("page key");
                for (slot, loc) in index::records(&v).expect("page") {
                    let mut key = ledger.to_be_bytes().to_vec();
                    key.extend_from_slice(&(first + slot as u64).to_be_bytes());
                    let mut value = loc.log.to_be_bytes().to_vec();
                    value.extend_from_slice(&loc.offset.to_be_bytes());
                    value.extend_from_slice(&loc.len.to_be_bytes());
                    batch.put_cf(cf(&s.db, CF_LEGACY_INDEX), key, value);
                }
                batch.delete_cf(cf(&s.db, CF_PAGES), k);
            }
            s.db.write(batch).expect("write");
            assert_eq!(pages_of(&s, 8), 0);
        }
        let s = open(dir.path());
        assert_eq!(pages_of(&s, 8), 3);
        let legacy =
            s.db.iterator_cf(cf(&s.db, CF_LEGACY_INDEX), IteratorMode::Start)
                .count();
        assert_eq!(legacy, 0, "the per-entry index is emptied");
        for id in 0..600u64 {
            match s.read(8, id) {
                Ok(v) => assert_eq!(v, entry(8, id, 1), "entry {id}"),
                Err(e) => assert!(id % 3 == 2 && e == Status::NoSuchEntry, "entry {id}: {e:?}"),
            }
        }
    }

    #[test]
    fn given_a_checkpoint_of_an_older_bookie_then_it_is_read_and_moved_to_a_key_older_bookies_do_not_know(
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let s = open(dir.path());
            s.db.put_cf(
                cf(&s.db, CF_META),
                KEY_CHECKPOINT_LEGACY,
                7u64.to_be_bytes(),
            )
            .expect("put");
        }
        let s = open(dir.path());
        assert_eq!(read_checkpoint(&s.db).expect("read"), 7);
        s.note_applied(9);
        s.add_durable(3, 0, NONE, b"key", (None, &entry(3, 0, 1)), None, false);
        assert_eq!(s.flush().expect("flush"), 9);
        assert!(s
            .db
            .get_cf(cf(&s.db, CF_META), KEY_CHECKPOINT_LEGACY)
            .expect("get")
            .is_none());
        assert_eq!(read_checkpoint(&s.db).expect("read"), 9);
    }

    #[test]
    fn given_a_damaged_index_page_when_a_flush_extends_it_then_the_flush_succeeds_and_keeps_what_reads(
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = open(dir.path());
        for id in 0..10 {
            s.add_durable(3, id, NONE, b"key", (None, &entry(3, id, 1)), None, false);
        }
        s.flush().expect("flush");
        // Tear the page's last record (as a bad disk might).
        let key = index::page_key(3, 0);
        let page = s.db.get_cf(cf(&s.db, CF_PAGES), key).unwrap().unwrap();
        s.db.put_cf(cf(&s.db, CF_PAGES), key, &page[..page.len() - 5])
            .unwrap();
        assert_eq!(
            s.read(3, 0),
            Err(Status::Internal),
            "a damaged page is not read"
        );
        for id in 10..20 {
            s.add_durable(3, id, NONE, b"key", (None, &entry(3, id, 1)), None, false);
        }
        s.flush().expect("a flush over a damaged page");
        for id in (0..9).chain(10..20) {
            assert_eq!(s.read(3, id).expect("read"), entry(3, id, 1), "entry {id}");
        }
        assert_eq!(
            s.read(3, 9),
            Err(Status::NoSuchEntry),
            "the torn record is lost"
        );
    }
}
