//! The bookie server: stores ledger entries for writers and serves them to readers.
//!
//! ```text
//!  connection task ── decode ──► Add:   check key/fence ─► journal (group commit) ─┐
//!        ▲                       Read:  ledger storage (blocking pool)             │
//!        │                       Fence: mark fenced ─► journal fence record ───────┤
//!        └──── writer task ◄──── responses (one write per burst) ◄─────────────────┘
//!  flusher thread: ledger_storage.flush ─► remove checkpointed journal files (those the
//!                  index does not point into: with single write, journal files are the store); GC
//! ```
//!
//! An add is answered only after the journal's fsync covered it. A damaged frame closes that
//! connection only.

pub mod index;
pub mod ledger_storage;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use meridian_metadata::stall::StallBounded;
use meridian_metadata::tls::{SiteTls, BOOKIE_READ_ROLES, BOOKIE_WRITE_ROLES};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Semaphore};

use crate::client::{
    register_local_bookie, unregister_local_bookie, LocalConnect, LocalLink, LocalRequest,
};
use crate::journal::{self, Journal, JournalOptions, JournalThread, Record, RecordKind};
use crate::proto::{self, Frame, Request, Response, Status, ADD_RECOVERY, NONE};
use ledger_storage::{LedgerStorage, StorageOptions};

/// Everything a bookie needs to run (built from `[bookie]` in the configuration).
#[derive(Debug, Clone)]
pub struct BookieOptions {
    pub journal: JournalOptions,
    pub storage: StorageOptions,
    pub flush_interval_ms: u64,
    pub gc_interval_ms: u64,
    pub frame_bytes_max: usize,
    pub requests_in_flight_max: usize,
    /// A connection whose peer takes no byte of its responses this long is closed.
    pub write_stall: Duration,
    /// Above this share of a disk used (journal or ledger directory), the bookie turns read-only.
    pub disk_usage_percent_max: u64,
    /// The flusher thread's I/O in the idle class ([`crate::io_priority`]).
    pub flusher_io_idle: bool,
}

impl BookieOptions {
    /// The options `[bookie]` describes.
    pub fn from_config(c: &meridian_config::BookieConfig) -> Self {
        BookieOptions {
            journal: JournalOptions {
                dir: c.journal_dir.clone().into(),
                batch_bytes_max: c.journal_batch_bytes_max as usize,
                flush_delay_us: c.journal_flush_delay_us,
                file_bytes_max: c.journal_file_bytes_max,
                preallocate_bytes: c.journal_preallocate_bytes,
                prefill: c.journal_prefill,
                drop_synced_pages: c.single_write,
                queue_records_max: c.journal_queue_records_max as usize,
                fsync: c.fsync,
            },
            storage: StorageOptions {
                ledger_dir: c.ledger_dir.clone().into(),
                write_cache_bytes_max: c.write_cache_bytes_max as usize,
                read_cache_bytes_max: c.read_cache_bytes_max as usize,
                entry_log_bytes_max: c.entry_log_bytes_max,
                compaction_live_ratio_min: c.compaction_live_percent_min as f64 / 100.0,
                fsync: c.fsync,
                // The journal's, set when storage opens.
                journal_dir: None,
                journal_spare_bytes: None,
                single_write: c.single_write,
            },
            flush_interval_ms: c.flush_interval_ms,
            gc_interval_ms: c.gc_interval_ms,
            frame_bytes_max: c.frame_bytes_max as usize,
            requests_in_flight_max: c.requests_in_flight_max as usize,
            write_stall: Duration::from_millis(c.write_stall_ms),
            disk_usage_percent_max: c.disk_usage_percent_max,
            flusher_io_idle: c.flusher_io_idle,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BookieError {
    #[error(transparent)]
    Journal(#[from] journal::JournalError),
    #[error(transparent)]
    Storage(#[from] ledger_storage::StorageError),
    #[error("bookie: {0}")]
    Io(#[from] std::io::Error),
}

/// The state shared by connections and the flusher.
pub struct BookieCore {
    storage: Arc<LedgerStorage>,
    journal: Journal,
    read_only: AtomicBool,
    read_only_reason: std::sync::Mutex<String>,
    /// Read-only because the disk is too full (not for an error): lifted once usage falls
    /// [`DISK_HYSTERESIS_PERCENT`] below the limit.
    disk_full: AtomicBool,
    /// When a write last found no space (see [`BookieCore::note_no_space`]).
    no_space_at: std::sync::Mutex<Option<std::time::Instant>>,
    /// Free bytes at the last disk check (the fuller of the journal's and the ledgers' file
    /// systems): a full disk takes recovery adds while at least [`RECOVERY_ADDS_FREE_BYTES_MIN`]
    /// are left.
    disk_free: AtomicU64,
    /// This bookie's own address once an admin decommissioned it (`bookies decommission`):
    /// read-only for writers (recovery adds still land), and ledgers whose metadata no longer
    /// names it are deleted by the orphan scan.
    decommissioned: std::sync::Mutex<Option<String>>,
    /// Ledgers the last orphan scan found no longer naming this decommissioned bookie: deleted
    /// only if the next scan finds the same (a copy made here just before the metadata swap
    /// that names it is never taken for one that moved away).
    moved_away: std::sync::Mutex<std::collections::BTreeSet<u64>>,
    opts: BookieOptions,
    /// `meridian_bookie_add_seconds`: an add from its request to its answer (adds answered Ok).
    add_latency: metrics::Histogram,
    /// `meridian_bookie_add_reserve_seconds`: an add's wait for room in the write cache.
    reserve_wait: metrics::Histogram,
}

/// Whether a bookie is read-only for a full disk after a usage reading: past `max` it turns
/// so, and stays so until usage is [`DISK_HYSTERESIS_PERCENT`] below `max`.
fn disk_full_next(was_full: bool, used_pct: u64, max: u64) -> bool {
    if used_pct > max {
        true
    } else {
        was_full && used_pct + DISK_HYSTERESIS_PERCENT > max
    }
}

/// How far below `bookie.disk_usage_percent_max` usage must fall before a bookie that turned
/// read-only for a full disk takes writes again (BookKeeper's low-water mark, 5 points lower).
pub const DISK_HYSTERESIS_PERCENT: u64 = 5;

/// How long a bookie stays read-only, with no room, after a write found no space.
pub const NO_SPACE_HOLD: Duration = Duration::from_secs(2);

/// Free bytes a bookie read-only for a full disk keeps for recovery adds: below them it
/// refuses those too (what is left is for the journal's records of adds already taken).
pub const RECOVERY_ADDS_FREE_BYTES_MIN: u64 = 64 << 20;

impl BookieCore {
    pub fn storage(&self) -> &LedgerStorage {
        &self.storage
    }

    /// The journal's fdatasyncs since this bookie opened (adds that arrive together share
    /// one).
    pub fn journal_syncs(&self) -> u64 {
        self.journal.stats().syncs.load(Ordering::Relaxed)
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only.load(Ordering::Relaxed)
            || self.disk_full.load(Ordering::Relaxed)
            || self.decommissioned_as().is_some()
    }

    /// Read-only for a reason that still lets recovery adds in (ledger recovery rewriting an
    /// entry it found, autorecovery), as BookKeeper lets high-priority writes into a read-only
    /// bookie: decommissioned, or past `bookie.disk_usage_percent_max` with at least
    /// [`RECOVERY_ADDS_FREE_BYTES_MIN`] free; never after an error made it read-only. Without
    /// this, a topic whose open ledger has a replica here could not be recovered (fenced and
    /// closed) by its next owner, and so could not be served at all, not even read.
    fn takes_recovery_adds_only(&self) -> bool {
        !self.read_only.load(Ordering::Relaxed)
            && (self.decommissioned_as().is_some() || self.disk_full.load(Ordering::Relaxed))
            && (!self.disk_full.load(Ordering::Relaxed)
                || self.disk_free.load(Ordering::Relaxed) >= RECOVERY_ADDS_FREE_BYTES_MIN)
    }

    /// The address this bookie was decommissioned as, if it was.
    pub fn decommissioned_as(&self) -> Option<String> {
        self.decommissioned.lock().expect("lock").clone()
    }

    /// An admin decommissioned this bookie (seen by its registration loop).
    pub fn set_decommissioned(&self, addr: &str) {
        let mut d = self.decommissioned.lock().expect("lock");
        if d.is_none() {
            tracing::warn!(bookie = %addr, "this bookie is decommissioned: read-only for writers; its ledgers are re-replicated elsewhere");
            *d = Some(addr.to_string());
        }
    }

    /// Why the bookie is read-only, if it is.
    pub fn read_only_reason(&self) -> Option<String> {
        if self.takes_recovery_adds_only() && !self.disk_full.load(Ordering::Relaxed) {
            return Some("decommissioned".into());
        }
        self.is_read_only()
            .then(|| self.read_only_reason.lock().expect("lock").clone())
    }

    /// Turns read-only while the disk is past the limit, writable again once usage is
    /// [`DISK_HYSTERESIS_PERCENT`] below it (unless an error made it read-only for good).
    fn check_disk(&self, free: u64, used_pct: u64) {
        let lately = self.no_space_lately();
        self.disk_free
            .store(if lately { 0 } else { free }, Ordering::Relaxed);
        let max = self.opts.disk_usage_percent_max;
        let was = self.disk_full.load(Ordering::Relaxed);
        let full = disk_full_next(was, used_pct, max) || (was && lately);
        if full {
            if !was {
                self.turn_disk_full(format!(
                    "disk {used_pct}% used, above bookie.disk_usage_percent_max = {max}"
                ));
            }
        } else if was
            && self.disk_full.swap(false, Ordering::Relaxed)
            && !self.read_only.load(Ordering::Relaxed)
        {
            tracing::info!(
                used_pct,
                "disk usage is back under the limit: the bookie takes writes again"
            );
        }
    }

    /// A write found no space on the disk (the usage check had not seen it full): read-only
    /// as for a full disk, with no room (no flush, no recovery add), for at least
    /// [`NO_SPACE_HOLD`] and then until a usage check finds the disk under the limit again
    /// (a file system out of inodes or quota fails writes while `statfs` shows space: without
    /// the hold the bookie would turn writable and read-only again at every check).
    fn note_no_space(&self, why: &str) {
        *self.no_space_at.lock().expect("lock") = Some(std::time::Instant::now());
        self.disk_free.store(0, Ordering::Relaxed);
        if !self.disk_full.load(Ordering::Relaxed) {
            self.turn_disk_full(format!("no space left on the disk ({why})"));
        }
    }

    /// Read-only for a full disk, for `why`.
    fn turn_disk_full(&self, why: String) {
        // The reason is in place before the flag that makes the bookie read-only: a reader
        // that sees the flag then finds the reason (both under its lock).
        let mut reason = self.read_only_reason.lock().expect("lock");
        if !self.read_only.load(Ordering::Relaxed) {
            reason.clone_from(&why);
        }
        self.disk_full.store(true, Ordering::Relaxed);
        drop(reason);
        tracing::error!(reason = %why, "bookie is read-only until the disk frees up");
    }

    /// Whether a write found no space less than [`NO_SPACE_HOLD`] ago.
    fn no_space_lately(&self) -> bool {
        self.no_space_at
            .lock()
            .expect("lock")
            .is_some_and(|at| at.elapsed() < NO_SPACE_HOLD)
    }

    /// Whether the disk has room for the flusher's writes: at least
    /// [`RECOVERY_ADDS_FREE_BYTES_MIN`] free at the last usage check (counted as none while a
    /// write found no space lately).
    fn has_room(&self) -> bool {
        self.disk_free.load(Ordering::Relaxed) >= RECOVERY_ADDS_FREE_BYTES_MIN
    }

    fn set_read_only(&self, why: String) {
        let mut reason = self.read_only_reason.lock().expect("lock");
        reason.clone_from(&why);
        let was = self.read_only.swap(true, Ordering::Relaxed);
        drop(reason);
        if !was {
            tracing::error!(reason = %why, "bookie is read-only from now on");
        }
    }

    /// Free bytes on the ledger directory's file system, and the used percentage of the fuller
    /// of the journal's and the ledgers' file systems.
    pub fn disk_usage(&self) -> (u64, u64) {
        let mut free = u64::MAX;
        let mut used_pct = 0;
        for dir in [&self.opts.journal.dir, &self.opts.storage.ledger_dir] {
            if let Ok(s) = rustix::fs::statvfs(dir.as_path()) {
                let total = s.f_blocks.saturating_mul(s.f_frsize);
                let avail = s.f_bavail.saturating_mul(s.f_frsize);
                free = free.min(avail);
                if let Some(avail_pct) = avail.saturating_mul(100).checked_div(total) {
                    used_pct = used_pct.max(100u64.saturating_sub(avail_pct));
                }
            }
        }
        (if free == u64::MAX { 0 } else { free }, used_pct)
    }
}

/// A started bookie.
pub struct RunningBookie {
    pub core: Arc<BookieCore>,
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
    flusher: Option<std::thread::JoinHandle<()>>,
    journal_thread: Option<JournalThread>,
    index_closed: Option<meridian_metadata::store::DbClosed>,
}

impl RunningBookie {
    /// Lets ledger clients of this process reach this bookie without a socket: connections
    /// the [`BookiePool`](crate::client::BookiePool) makes to `addr` from now on are in-process
    /// ones (no frames, no copies into and out of the kernel, no checksum of the response).
    /// The bookie still checks every entry's checksum. Its TCP listener keeps serving
    /// other processes. A standalone's broker writes to its embedded bookie this way.
    pub fn serve_in_process(&self) {
        let core = Arc::clone(&self.core);
        let stop = self.stop.subscribe();
        let connect: LocalConnect = Arc::new(move || {
            let runtime = tokio::runtime::Handle::try_current().ok()?;
            if *stop.borrow() {
                return None;
            }
            let (requests, requests_rx) = mpsc::unbounded_channel();
            let (responses_tx, responses) = mpsc::unbounded_channel();
            let (closed_tx, closed) = tokio::sync::oneshot::channel();
            let core = Arc::clone(&core);
            let stop = stop.clone();
            runtime.spawn(async move {
                local_connection(core, requests_rx, responses_tx, stop).await;
                drop(closed_tx);
            });
            Some(LocalLink {
                requests,
                responses,
                closed,
            })
        });
        register_local_bookie(&self.addr.to_string(), connect);
    }

    /// Stops accepting, closes connections, flushes the write cache, stops the journal.
    pub async fn shutdown(mut self) {
        unregister_local_bookie(&self.addr.to_string());
        let _ = self.stop.send(true);
        let _ = (&mut self.server).await;
        if let Some(f) = self.flusher.take() {
            let _ = tokio::task::spawn_blocking(move || f.join()).await;
        }
        let core = Arc::clone(&self.core);
        let journal_thread = self.journal_thread.take();
        let _ = tokio::task::spawn_blocking(move || {
            flush_once(&core);
            core.journal.stop();
            if let Some(t) = journal_thread {
                t.join();
            }
        })
        .await;
        // The index database closes when the last holder of the storage lets go (requests in
        // flight, a registration task); a restart in this process must wait for that.
        let closed = self.index_closed.take();
        drop(self);
        if let Some(mut closed) = closed {
            if !closed.wait(Duration::from_secs(10)).await {
                tracing::warn!("the bookie's index database is still open 10 s after shutdown");
            }
        }
    }

    /// Stops serving at once, as a crash would: no flush. Only what the journal fsynced
    /// survives (tests use this for kill -9 inside one process).
    pub async fn crash(mut self) {
        unregister_local_bookie(&self.addr.to_string());
        let _ = self.stop.send(true);
        self.server.abort();
        let _ = (&mut self.server).await;
        if let Some(f) = self.flusher.take() {
            let _ = tokio::task::spawn_blocking(move || f.join()).await;
        }
        self.core.journal.stop();
        if let Some(t) = self.journal_thread.take() {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
    }
}

impl Drop for RunningBookie {
    /// Dropped without `shutdown` (a test that failed half-way, a start that failed later on):
    /// stop the threads instead of leaving them running; wait at most 5 s for the flusher.
    fn drop(&mut self) {
        unregister_local_bookie(&self.addr.to_string());
        let _ = self.stop.send(true);
        self.server.abort();
        self.core.journal.stop();
        if let Some(t) = self.journal_thread.take() {
            t.detach();
        }
        // The flusher sees the stop within a tick unless a flush is under way: wait a little
        // for it, so that a process ending next does not end while it is inside RocksDB.
        if let Some(f) = self.flusher.take() {
            meridian_metadata::store::join_until(
                f,
                std::time::Instant::now() + Duration::from_secs(5),
            );
        }
    }
}

/// Accepts and at once closes every connection on `listener` until `opened`; then hands it
/// back.
async fn refuse_until(
    listener: TcpListener,
    mut opened: tokio::sync::oneshot::Receiver<()>,
) -> TcpListener {
    loop {
        tokio::select! {
            biased;
            _ = &mut opened => return listener,
            r = listener.accept() => {
                if r.is_err() {
                    // Out of descriptors, say: not a reason to spin.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }
}

/// Opens storage, replays the journal, and starts serving on `listener`.
pub async fn start(
    opts: BookieOptions,
    listener: TcpListener,
) -> Result<RunningBookie, BookieError> {
    start_with_tls(opts, None, listener).await
}

/// As [`start`], serving only TLS when `tls` is given: a connection must present a
/// certificate of the site CA, and its role decides what it may ask ([`Access`]).
pub async fn start_with_tls(
    opts: BookieOptions,
    tls: Option<Arc<SiteTls>>,
    listener: TcpListener,
) -> Result<RunningBookie, BookieError> {
    let addr = listener.local_addr()?;
    let mut opts = opts;
    opts.storage.single_write = single_write_applies(&opts)?;
    opts.journal.drop_synced_pages = opts.storage.single_write;
    let o = opts.clone();
    // Until the journal is replayed, a connection is closed as it comes: its client learns at
    // once that this bookie does not serve yet (one left waiting in the listen queue cost it
    // a whole request timeout, an add's ensemble change or a recovery's step).
    let (opened, opened_rx) = tokio::sync::oneshot::channel::<()>();
    let refusing = tokio::spawn(refuse_until(listener, opened_rx));
    let slow = crate::failpoint::hit(&format!(
        "bookie:open_pause_2s:{}",
        opts.journal.dir.display()
    ));
    let storage = tokio::task::spawn_blocking(move || {
        if slow {
            std::thread::sleep(Duration::from_secs(2));
        }
        open_storage(&o)
    })
    .await;
    let _ = opened.send(());
    let listener = refusing
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let (storage, journal, journal_thread, index_closed) =
        storage.map_err(|e| std::io::Error::other(e.to_string()))??;
    let core = Arc::new(BookieCore {
        storage: Arc::new(storage),
        journal,
        read_only: AtomicBool::new(false),
        read_only_reason: std::sync::Mutex::default(),
        disk_full: AtomicBool::new(false),
        no_space_at: std::sync::Mutex::default(),
        disk_free: AtomicU64::new(u64::MAX),
        decommissioned: std::sync::Mutex::default(),
        moved_away: std::sync::Mutex::default(),
        opts,
        add_latency: metrics::histogram!("meridian_bookie_add_seconds"),
        reserve_wait: metrics::histogram!("meridian_bookie_add_reserve_seconds"),
    });
    let (stop, stop_rx) = watch::channel(false);
    let flusher = {
        let core = Arc::clone(&core);
        let stop_rx = stop_rx.clone();
        std::thread::Builder::new()
            .name("bookie-flusher".into())
            .spawn(move || flusher(core, stop_rx))?
    };
    let server = tokio::spawn(serve(Arc::clone(&core), listener, tls, stop_rx));
    Ok(RunningBookie {
        core,
        addr,
        stop,
        server,
        flusher: Some(flusher),
        journal_thread: Some(journal_thread),
        index_closed: Some(index_closed),
    })
}

type Opened = (
    LedgerStorage,
    Journal,
    JournalThread,
    meridian_metadata::store::DbClosed,
);

/// Whether `bookie.single_write` applies: not where the journal and the ledgers are on
/// different file systems. A journal on a disk of its own (BookKeeper's advice) is sized
/// for a journal; as the entries' store it would fill up.
fn single_write_applies(opts: &BookieOptions) -> std::io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    if !opts.storage.single_write {
        return Ok(false);
    }
    let (j, l) = (&opts.journal.dir, &opts.storage.ledger_dir);
    meridian_metadata::durable_dir::create_dir_all_synced(j)?;
    meridian_metadata::durable_dir::create_dir_all_synced(l)?;
    if std::fs::metadata(j)?.dev() != std::fs::metadata(l)?.dev() {
        tracing::warn!(
            journal = %j.display(),
            ledgers = %l.display(),
            "bookie.single_write does not apply: the journal and the ledgers are on different file systems; entries are copied into entry logs"
        );
        return Ok(false);
    }
    Ok(true)
}

fn open_storage(opts: &BookieOptions) -> Result<Opened, BookieError> {
    let mut storage_opts = opts.storage.clone();
    storage_opts.journal_dir = Some(opts.journal.dir.clone());
    storage_opts.journal_spare_bytes = opts.journal.prefill.then_some(opts.journal.file_bytes_max);
    let (storage, checkpoint, index_closed) = LedgerStorage::open(storage_opts)?;
    meridian_metadata::durable_dir::create_dir_all_synced(&opts.journal.dir)?;
    let j = &opts.journal;
    for (seq, path) in journal::list_files(&j.dir)? {
        if seq < checkpoint && !storage.stores_in_journal_file(seq) {
            journal::retire(&j.dir, &path, j.file_bytes_max, j.prefill)?;
        }
    }
    let mut replayed = 0u64;
    let stored_in = |seq| storage.stores_in_journal_file(seq);
    let report = journal::replay(&opts.journal.dir, checkpoint, stored_in, |pos, r| {
        replayed += 1;
        apply_record(&storage, pos, r);
        storage.note_applied(pos.file);
    })?;
    tracing::info!(
        files = report.len(),
        records = replayed,
        checkpoint,
        "journal replayed"
    );
    let (journal, thread) = Journal::start(opts.journal.clone())?;
    // Every record of the files before the new one is applied now: the next flush's
    // checkpoint passes them (journal files kept as the store are collected only then).
    storage.note_applied(journal.first_file());
    Ok((storage, journal, thread, index_closed))
}

/// Journal record data of an add or a fence: `key_len: u8 | master key`; an add's envelope follows
/// as the record's tail.
fn key_record_data(master_key: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(1 + master_key.len());
    v.push(master_key.len() as u8);
    v.extend_from_slice(master_key);
    v
}

fn split_record_data(data: &[u8]) -> Option<(&[u8], &[u8])> {
    let n = *data.first()? as usize;
    if data.len() < 1 + n {
        return None;
    }
    Some((&data[1..1 + n], &data[1 + n..]))
}

fn apply_record(storage: &LedgerStorage, pos: journal::Position, r: Record) {
    let Some((key, rest)) = split_record_data(&r.data) else {
        tracing::error!(
            ledger_id = r.ledger_id,
            entry_id = r.entry_id,
            "journal record without a key; skipped"
        );
        return;
    };
    match r.kind {
        RecordKind::Add => {
            let envelope = Bytes::copy_from_slice(rest);
            let at = journal::data_offset(pos) + (r.data.len() - rest.len()) as u64;
            match proto::open(&envelope) {
                Ok(e) => storage.add_durable(
                    r.ledger_id,
                    r.entry_id,
                    e.lac,
                    key,
                    (None, &envelope),
                    Some((pos.file, at)),
                    false,
                ),
                Err(err) => {
                    tracing::error!(ledger_id = r.ledger_id, entry_id = r.entry_id, error = %err, "journal entry does not verify; skipped")
                }
            }
        }
        RecordKind::Fence => {
            // A fence that fails now (another key) failed when it was first made, too.
            let _ = storage.fence(r.ledger_id, key);
        }
    }
}

/// Moves the write cache to entry logs (or, with single write, indexes it where the journal
/// wrote it), then removes the journal files the checkpoint covers that hold no indexed entry.
/// The journal keeps writing meanwhile (no roll: a new file costs the journal thread a stall).
fn flush_once(core: &BookieCore) {
    let started = std::time::Instant::now();
    let flushed = core.storage.flush();
    metrics::histogram!("meridian_bookie_flush_seconds").record(started.elapsed().as_secs_f64());
    match flushed {
        Ok(checkpoint) => {
            let j = &core.opts.journal;
            if let Ok(files) = journal::list_files(&j.dir) {
                for (s, path) in files {
                    if s < checkpoint && !core.storage.stores_in_journal_file(s) {
                        if let Err(e) = journal::retire(&j.dir, &path, j.file_bytes_max, j.prefill)
                        {
                            tracing::warn!(path = %path.display(), error = %e, "removing a checkpointed journal file failed");
                        }
                    }
                }
            }
        }
        Err(e) => core.set_read_only(format!("flushing the write cache: {e}")),
    }
}

/// Zeroes the journal's next spare file a little at a time once the current file is half
/// written and no checkpointed file was recycled as the spare (journal module docs). 1 MiB per
/// call, every 5 ms at most: about 200 MB/s, in steps short enough that the journal's own
/// fsyncs do not wait long behind them.
/// After a failure (a full disk, most likely) it waits a minute before trying again; the
/// journal then grows its files as they are written.
fn prepare_spare(
    core: &BookieCore,
    not_before: &mut std::time::Instant,
    class: &mut crate::io_priority::FlusherClass,
) {
    let j = &core.opts.journal;
    // Zeroing every next file ahead would write each byte twice again: with single write the
    // spares are the journal files garbage collection retires.
    if !j.prefill
        || core.opts.storage.single_write
        || std::time::Instant::now() < *not_before
        || core.is_read_only()
        || core
            .journal
            .stats()
            .file_len
            .load(std::sync::atomic::Ordering::Relaxed)
            < j.file_bytes_max / 2
        || journal::spare_ready(&j.dir)
    {
        return;
    }
    // The journal waits for it once its file is full.
    class.urgent();
    if let Err(e) = journal::prepare_spare(&j.dir, j.file_bytes_max, 1 << 20) {
        tracing::warn!(error = %e, "zero-filling a spare journal file failed; trying again in a minute");
        *not_before = std::time::Instant::now() + Duration::from_secs(60);
    }
}

/// A bookie that has taken no add for this long gives its write cache's memory back.
const WRITE_CACHE_TRIM_IDLE: Duration = Duration::from_secs(30);

fn flusher(core: Arc<BookieCore>, stop: watch::Receiver<bool>) {
    let mut class = crate::io_priority::FlusherClass::new(core.opts.flusher_io_idle);
    let interval = Duration::from_millis(core.opts.flush_interval_ms);
    let gc_interval = Duration::from_millis(core.opts.gc_interval_ms);
    let mut last_flush = std::time::Instant::now();
    let mut last_gc = std::time::Instant::now();
    let mut spare_not_before = std::time::Instant::now();
    let mut last_busy = std::time::Instant::now();
    let mut trimmed = true;
    while !*stop.borrow() {
        std::thread::sleep(Duration::from_millis(5));
        let cached = core.storage.write_cache_bytes();
        if cached > 0 {
            last_busy = std::time::Instant::now();
            trimmed = false;
        } else if !trimmed && last_busy.elapsed() >= WRITE_CACHE_TRIM_IDLE {
            let freed = core.storage.trim_write_cache();
            tracing::debug!(freed, "idle: gave the write cache's free chunks back");
            trimmed = true;
        }
        let half_full = cached >= core.opts.storage.write_cache_bytes_max / 2;
        if half_full || last_flush.elapsed() >= interval {
            if half_full {
                class.urgent();
            } else {
                class.background();
            }
            // The disk first: nothing is written while it has almost no space left (a
            // write the index's RocksDB fails on makes the bookie read-only until it
            // restarts); the write cache and the journal hold the entries meanwhile. Past
            // `disk_usage_percent_max` with room left it flushes as always (recovery adds
            // still come, and checkpointed journal files are retired).
            let (free, used_pct) = core.disk_usage();
            core.check_disk(free, used_pct);
            if core.has_room() {
                flush_once(&core);
            }
            last_flush = std::time::Instant::now();
        }
        prepare_spare(&core, &mut spare_not_before, &mut class);
        if last_gc.elapsed() >= gc_interval {
            class.background();
            // Compaction writes new entry logs: not without room. Removing logs of deleted
            // ledgers frees space and goes on.
            match core.storage.collect_garbage(core.has_room()) {
                Ok(0) => {}
                Ok(freed) => tracing::info!(freed, "garbage collection freed bytes"),
                Err(e) => tracing::error!(error = %e, "garbage collection failed"),
            }
            last_gc = std::time::Instant::now();
        }
    }
}

/// What a connection's peer may ask, decided once at its handshake.
#[derive(Debug, Clone)]
pub struct Access {
    /// Who the peer is, for the log.
    peer: String,
    /// Adds, fences and deletes: `Err` holds the refusal.
    write: Result<(), String>,
    /// Reads and LAC reads.
    read: Result<(), String>,
}

impl Access {
    /// A plaintext connection (no `[tls]`): everything, as before TLS between roles.
    fn any(peer: String) -> Self {
        Access {
            peer,
            write: Ok(()),
            read: Ok(()),
        }
    }

    /// A TLS connection whose peer presented `chain` (verified against the site CA).
    pub fn of_peer(
        tls: &SiteTls,
        chain: Option<&[meridian_metadata::tls::rustls::pki_types::CertificateDer<'_>]>,
        addr: std::net::SocketAddr,
    ) -> Self {
        let peer = match tls.peer_identity(chain) {
            Ok(id) => format!("{addr} ({id})"),
            Err(_) => addr.to_string(),
        };
        Access {
            peer,
            write: tls
                .authorize_peer(chain, BOOKIE_WRITE_ROLES, "bookie add, fence or delete")
                .map(drop),
            read: tls
                .authorize_peer(chain, BOOKIE_READ_ROLES, "bookie read")
                .map(drop),
        }
    }

    /// Why `request` is refused, if it is.
    pub fn refusal(&self, request: &Request) -> Option<&str> {
        let verdict = if request.is_write() {
            &self.write
        } else {
            &self.read
        };
        verdict.as_ref().err().map(String::as_str)
    }
}

/// How long a TLS client has to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

async fn serve(
    core: Arc<BookieCore>,
    listener: TcpListener,
    tls: Option<Arc<SiteTls>>,
    mut stop: watch::Receiver<bool>,
) {
    let acceptor = tls.as_ref().map(|t| t.acceptor());
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    let core = Arc::clone(&core);
                    let stop = stop.clone();
                    let acceptor = acceptor.clone();
                    let tls = tls.clone();
                    conns.spawn(async move {
                        let result = match (acceptor, tls) {
                            (Some(acceptor), Some(tls)) => {
                                let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                                    Ok(Ok(s)) => s,
                                    Ok(Err(e)) => {
                                        tracing::warn!(%peer, error = %e, "bookie connection refused: TLS handshake failed");
                                        return;
                                    }
                                    Err(_) => {
                                        tracing::warn!(%peer, "bookie connection refused: no TLS handshake within {HANDSHAKE_TIMEOUT:?}");
                                        return;
                                    }
                                };
                                let access = Access::of_peer(&tls, stream.get_ref().1.peer_certificates(), peer);
                                let (rd, wr) = tokio::io::split(stream);
                                connection(core, rd, wr, access, stop).await
                            }
                            _ => {
                                let (rd, wr) = stream.into_split();
                                connection(core, rd, wr, Access::any(peer.to_string()), stop).await
                            }
                        };
                        if let Err(e) = result {
                            tracing::info!(%peer, error = %e, "bookie connection closed");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
    conns.shutdown().await;
}

/// One client connection: requests are read and started in order, answered as they complete.
async fn connection<R, W>(
    core: Arc<BookieCore>,
    mut rd: R,
    wr: W,
    access: Access,
    mut stop: watch::Receiver<bool>,
) -> Result<(), String>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut refused = 0u64;
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let permits = Arc::new(Semaphore::new(core.opts.requests_in_flight_max));
    let writer_permits = Arc::clone(&permits);
    // Why the writer ended, when it gave the socket up (dropped unsent when it ended because
    // the connection did).
    let (gave_up, mut writer_gave_up) = tokio::sync::oneshot::channel::<String>();
    let stall = core.opts.write_stall;
    let writer = tokio::spawn(async move {
        // A peer that takes no byte of its responses for the bound (a frozen broker: its
        // kernel keeps the window shut) is given up, and what was queued for it let go;
        // before, up to `requests_in_flight_max` responses (reads of up to a frame each) were
        // held for as long as it stayed frozen.
        let mut wr = StallBounded::writes(wr, Some(stall));
        let mut out = Vec::with_capacity(64 << 10);
        while let Some(first) = rx.recv().await {
            out.clear();
            out.extend_from_slice(&first);
            let mut n = 1;
            while out.len() < (1 << 20) {
                match rx.try_recv() {
                    Ok(more) => {
                        out.extend_from_slice(&more);
                        n += 1;
                    }
                    Err(_) => break,
                }
            }
            // A TLS stream may hold the end of what it was given until flushed.
            let written = match wr.write_all(&out).await {
                Ok(()) => wr.flush().await,
                Err(e) => Err(e),
            };
            if let Err(e) = written {
                // The reason first: the read loop reads it once its wait for permits fails.
                let _ = gave_up.send(format!("writing responses failed: {e}"));
                // The read loop waits for no more permits: the connection ends.
                writer_permits.close();
                return;
            }
            writer_permits.add_permits(n);
        }
    });
    let mut buf = BytesMut::with_capacity(64 << 10);
    let result = loop {
        let frame = match proto::decode(&mut buf, core.opts.frame_bytes_max) {
            Ok(Some(f)) => f,
            Ok(None) => {
                let n = tokio::select! {
                    _ = stop.changed() => break Ok(()),
                    why = &mut writer_gave_up => {
                        break Err(why.unwrap_or_else(|_| "its writer ended".into()));
                    }
                    n = rd.read_buf(&mut buf) => n,
                };
                match n {
                    Ok(0) => break Ok(()),
                    Ok(_) => continue,
                    Err(e) => break Err(e.to_string()),
                }
            }
            Err(e) => break Err(format!("malformed frame: {e}")),
        };
        let (id, request) = match frame {
            Frame::Request { id, request } => (id, request),
            Frame::Response { .. } => break Err("a response frame sent to a bookie".into()),
        };
        let Ok(permit) = Arc::clone(&permits).acquire_owned().await else {
            // Closed by the writer, which gave the socket up.
            break Err(writer_gave_up
                .try_recv()
                .unwrap_or_else(|_| "its writer ended".into()));
        };
        // Released by the writer once the response is written.
        permit.forget();
        if let Some(reason) = access.refusal(&request) {
            // Logged once per connection at warn, then at debug: a refused peer cannot flood
            // the log.
            refused += 1;
            if refused == 1 {
                tracing::warn!(peer = %access.peer, %reason, "bookie request refused");
            } else {
                tracing::debug!(peer = %access.peer, %reason, refused, "bookie request refused");
            }
            send(
                &Reply::Wire(tx.clone()),
                id,
                request.refused(Status::Forbidden),
            );
            continue;
        }
        handle(&core, id, request, Reply::Wire(tx.clone())).await;
    };
    drop(tx);
    let _ = writer.await;
    result
}

/// An in-process connection ([`RunningBookie::serve_in_process`]): the same requests, limit on
/// requests in flight and answers as [`connection`], without a socket, frames or copies.
async fn local_connection(
    core: Arc<BookieCore>,
    mut requests: mpsc::UnboundedReceiver<(u64, LocalRequest)>,
    responses: mpsc::UnboundedSender<(u64, Response)>,
    mut stop: watch::Receiver<bool>,
) {
    let permits = Arc::new(Semaphore::new(core.opts.requests_in_flight_max));
    let serve = async {
        while let Some((id, request)) = requests.recv().await {
            let Ok(permit) = Arc::clone(&permits).acquire_owned().await else {
                break;
            };
            // Given back when the response is sent.
            permit.forget();
            let reply = Reply::Local(responses.clone(), Arc::clone(&permits));
            match request {
                LocalRequest::Plain(request) => handle(&core, id, request, reply).await,
                LocalRequest::Add {
                    ledger_id,
                    entry_id,
                    master_key,
                    sealed,
                } => {
                    let add = Add {
                        ledger_id,
                        entry_id,
                        flags: 0,
                        master_key,
                        header: sealed.header,
                        payload: sealed.payload,
                    };
                    handle_add(&core, id, add, reply).await;
                }
            }
        }
    };
    // A stop ends the connection even while a request waits (for room in the write cache, say):
    // that request was not journaled, and the client fails it once every started one is answered
    // and this connection's end of the responses is gone.
    tokio::select! {
        _ = stop.wait_for(|stopped| *stopped) => {}
        () = serve => {}
    }
}

/// Where a request's response goes.
#[derive(Clone)]
enum Reply {
    /// Encoded, to the connection's writer (which gives the request's permit back).
    Wire(mpsc::UnboundedSender<Vec<u8>>),
    /// As it is, to an in-process client; the request's permit is given back on the way.
    Local(mpsc::UnboundedSender<(u64, Response)>, Arc<Semaphore>),
}

fn send(tx: &Reply, id: u64, response: Response) {
    match tx {
        Reply::Wire(tx) => {
            let frame = Frame::Response { id, response };
            let mut out = Vec::with_capacity(proto::encoded_len_hint(&frame));
            proto::encode(&frame, &mut out);
            let _ = tx.send(out);
        }
        Reply::Local(tx, permits) => {
            let _ = tx.send((id, response));
            permits.add_permits(1);
        }
    }
}

fn add_response(ledger_id: u64, entry_id: u64, status: Status) -> Response {
    Response::Add {
        status,
        ledger_id,
        entry_id,
    }
}

/// An add as the bookie handles it: the envelope's header apart from its payload (both
/// sliced from a request read off a socket, or as an in-process writer sealed them).
struct Add {
    ledger_id: u64,
    entry_id: u64,
    flags: u8,
    master_key: Bytes,
    header: [u8; proto::ENVELOPE_HEADER_BYTES],
    payload: Bytes,
}

async fn handle_add(core: &Arc<BookieCore>, id: u64, add: Add, tx: Reply) {
    let Add {
        ledger_id,
        entry_id,
        flags,
        master_key,
        header,
        payload,
    } = add;
    let started = Instant::now();
    let reply = move |status| add_response(ledger_id, entry_id, status);
    if core.is_read_only() && !(flags & proto::ADD_RECOVERY != 0 && core.takes_recovery_adds_only())
    {
        return send(&tx, id, reply(Status::ReadOnly));
    }
    // What decoding a frame checks on a socket, for in-process adds too: the key's length
    // (it is journaled behind a one-byte length) and the entry's size.
    let entry_len = header.len() + payload.len();
    if master_key.len() > proto::MASTER_KEY_BYTES_MAX || entry_len > core.opts.frame_bytes_max {
        tracing::warn!(
            ledger_id,
            entry_id,
            entry_len,
            key_len = master_key.len(),
            "add refused: entry over bookie.frame_bytes_max or master key over {} bytes",
            proto::MASTER_KEY_BYTES_MAX
        );
        return send(&tx, id, reply(Status::BadRequest));
    }
    let lac = match proto::open_sealed(&header, payload.clone()) {
        Ok(e) if e.ledger_id == ledger_id && e.entry_id == entry_id => e.lac,
        Ok(_) => return send(&tx, id, reply(Status::BadChecksum)),
        Err(e) => {
            tracing::warn!(ledger_id, entry_id, error = %e, "add refused: entry does not verify");
            return send(&tx, id, reply(Status::BadChecksum));
        }
    };
    if let Err(status) = core
        .storage
        .check_add(ledger_id, &master_key, flags & ADD_RECOVERY != 0)
    {
        return send(&tx, id, reply(status));
    }
    // Counted in the write cache from now on; waits while it is full (the flusher is behind)
    // until a flush makes room.
    let reserved = entry_len;
    let reserving = Instant::now();
    core.storage.reserve(reserved).await;
    core.reserve_wait.record(reserving.elapsed().as_secs_f64());
    // The record holds the key and the envelope's header; the payload follows them in the
    // record from its own buffer (the journal file has the envelope in one piece).
    let mut data = key_record_data(&master_key);
    data.extend_from_slice(&header);
    let record = Record {
        kind: RecordKind::Add,
        ledger_id,
        entry_id,
        data,
        tail: payload.clone(),
    };
    let storage = Arc::clone(&core.storage);
    let core2 = Arc::clone(core);
    let add_latency = core.add_latency.clone();
    journal_append(
        &core.journal,
        record,
        Box::new(move |r| match r {
            Ok(pos) => {
                // Durable (journal fsync returned): readable, then acknowledged. The write
                // cache keeps a small entry as a copy (the connection's read buffer is reused
                // instead of pinned until the next flush), a large one as it is.
                storage.add_durable(
                    ledger_id,
                    entry_id,
                    lac,
                    &master_key,
                    (Some(&header), &payload),
                    // The envelope follows the key in the record's data.
                    Some((
                        pos.file,
                        journal::data_offset(pos) + 1 + master_key.len() as u64,
                    )),
                    true,
                );
                storage.note_applied(pos.file);
                send(&tx, id, reply(Status::Ok));
                add_latency.record(started.elapsed().as_secs_f64());
            }
            Err(e @ journal::JournalError::TooLarge { .. }) => {
                storage.release(reserved);
                tracing::warn!(ledger_id, entry_id, error = %e, "add refused");
                send(&tx, id, reply(Status::BadRequest));
            }
            Err(journal::JournalError::NoSpace(why)) => {
                storage.release(reserved);
                core2.note_no_space(&why);
                send(&tx, id, reply(Status::ReadOnly));
            }
            Err(e) => {
                storage.release(reserved);
                core2.set_read_only(format!("journal: {e}"));
                send(&tx, id, reply(Status::ReadOnly));
            }
        }),
    );
}

async fn handle(core: &Arc<BookieCore>, id: u64, request: Request, tx: Reply) {
    match request {
        Request::Add {
            ledger_id,
            entry_id,
            flags,
            master_key,
            entry,
        } => {
            let Some(header) = entry.get(..proto::ENVELOPE_HEADER_BYTES) else {
                tracing::warn!(
                    ledger_id,
                    entry_id,
                    len = entry.len(),
                    "add refused: entry shorter than its header"
                );
                let response = add_response(ledger_id, entry_id, Status::BadChecksum);
                return send(&tx, id, response);
            };
            let header = header.try_into().expect("header bytes");
            let payload = entry.slice(proto::ENVELOPE_HEADER_BYTES..);
            let add = Add {
                ledger_id,
                entry_id,
                flags,
                master_key,
                header,
                payload,
            };
            handle_add(core, id, add, tx).await;
        }
        Request::Read {
            ledger_id,
            entry_id,
        } => {
            let storage = Arc::clone(&core.storage);
            tokio::task::spawn_blocking(move || {
                let response = match read_checked(&storage, ledger_id, entry_id) {
                    Ok(entry) => Response::Read {
                        status: Status::Ok,
                        ledger_id,
                        entry_id,
                        entry,
                    },
                    Err(status) => Response::Read {
                        status,
                        ledger_id,
                        entry_id,
                        entry: Bytes::new(),
                    },
                };
                send(&tx, id, response);
            });
        }
        Request::ReadRange {
            ledger_id,
            first_entry,
            count_max,
            bytes_max,
        } => {
            let storage = Arc::clone(&core.storage);
            let frame_max = core.opts.frame_bytes_max.saturating_sub(64);
            tokio::task::spawn_blocking(move || {
                let bytes_max = (bytes_max as usize).min(frame_max);
                let mut entries = Vec::new();
                let mut total = 0usize;
                let mut status = Status::Ok;
                for i in 0..count_max as u64 {
                    let Some(entry_id) = first_entry.checked_add(i) else {
                        break;
                    };
                    match read_checked(&storage, ledger_id, entry_id) {
                        Ok(e) => {
                            if !entries.is_empty() && total + e.len() + 4 > bytes_max {
                                break;
                            }
                            total += e.len() + 4;
                            entries.push(e);
                        }
                        Err(Status::NoSuchEntry) => break,
                        Err(s) => {
                            if entries.is_empty() {
                                status = s;
                            }
                            break;
                        }
                    }
                }
                if entries.is_empty() && status == Status::Ok {
                    status = Status::NoSuchEntry;
                }
                send(
                    &tx,
                    id,
                    Response::ReadRange {
                        status,
                        ledger_id,
                        entries,
                    },
                );
            });
        }
        Request::ReadLac { ledger_id } => {
            let response = match core.storage.ledger_state(ledger_id) {
                Some(s) => Response::Lac {
                    status: Status::Ok,
                    ledger_id,
                    lac: s.lac,
                    last_entry: s.last_entry,
                    fence: false,
                },
                None => Response::Lac {
                    status: Status::NoSuchLedger,
                    ledger_id,
                    lac: NONE,
                    last_entry: NONE,
                    fence: false,
                },
            };
            send(&tx, id, response);
        }
        Request::Fence {
            ledger_id,
            master_key,
        } => {
            let fail = move |status| Response::Lac {
                status,
                ledger_id,
                lac: NONE,
                last_entry: NONE,
                fence: true,
            };
            if let Err(status) = core.storage.fence(ledger_id, &master_key) {
                return send(&tx, id, fail(status));
            }
            let storage = Arc::clone(&core.storage);
            // The fence is answered once durable: after a restart the old writer is still refused.
            journal_append(
                &core.journal,
                Record {
                    kind: RecordKind::Fence,
                    ledger_id,
                    entry_id: 0,
                    data: key_record_data(&master_key),
                    tail: Bytes::new(),
                },
                Box::new(move |r| {
                    if let Ok(pos) = &r {
                        storage.note_applied(pos.file);
                    }
                    let response = match (r, storage.ledger_state(ledger_id)) {
                        (Ok(_), Some(s)) => Response::Lac {
                            status: Status::Ok,
                            ledger_id,
                            lac: s.lac,
                            last_entry: s.last_entry,
                            fence: true,
                        },
                        (Ok(_), None) => fail(Status::NoSuchLedger),
                        (Err(_), _) => fail(Status::ReadOnly),
                    };
                    send(&tx, id, response);
                }),
            );
        }
        Request::Delete { ledger_id } => {
            let storage = Arc::clone(&core.storage);
            tokio::task::spawn_blocking(move || {
                let status = match storage.delete(ledger_id) {
                    Ok(()) => Status::Ok,
                    Err(e) => {
                        tracing::error!(ledger_id, error = %e, "deleting a ledger failed");
                        Status::Internal
                    }
                };
                send(&tx, id, Response::Delete { status, ledger_id });
            });
        }
    }
}

/// Queues a journal record from a connection task. When the journal's queue is full this waits
/// for room without holding up the other tasks of this runtime worker.
fn journal_append(journal: &Journal, record: Record, done: journal::Done) {
    if let Err((record, done)) = journal.try_append(record, done) {
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => {
                tokio::task::block_in_place(|| journal.append(record, done))
            }
            _ => journal.append(record, done),
        }
    }
}

/// Reads an entry and verifies its checksum: a damaged entry is reported, never served.
/// Garbage collection may move an entry between the index lookup and the read (its old file
/// then removed, or recycled as the journal's spare and written over): a read that fails or
/// does not verify is tried once more from a fresh lookup.
fn read_checked(storage: &LedgerStorage, ledger_id: u64, entry_id: u64) -> Result<Bytes, Status> {
    let once = || {
        let entry = storage.read(ledger_id, entry_id)?;
        match proto::open(&entry) {
            Ok(e) if e.ledger_id == ledger_id && e.entry_id == entry_id => Ok(entry),
            Ok(_) | Err(_) => {
                // Not served again from the read cache either.
                storage.forget_read(ledger_id, entry_id);
                Err(Status::BadChecksum)
            }
        }
    };
    match once() {
        Err(s @ (Status::NoSuchEntry | Status::NoSuchLedger)) => Err(s),
        Err(first) => {
            let again = once();
            match &again {
                Ok(_) => tracing::info!(
                    ledger_id,
                    entry_id,
                    first = ?first,
                    "an entry read again from the index after a failed read (moved meanwhile, or a transient error)"
                ),
                Err(Status::BadChecksum) => tracing::error!(
                    ledger_id,
                    entry_id,
                    "stored entry does not verify; not served"
                ),
                Err(_) => {}
            }
            again
        }
        ok => ok,
    }
}

/// Announces the bookie under `/bookies/available/<advertise>` (an ephemeral key of a session
/// with `ttl_ms`) and refreshes it every `refresh` with free space and writability. Runs until
/// `stop`; a lost session is re-created.
pub async fn register(
    core: Arc<BookieCore>,
    meta: meridian_metadata::MetadataClient,
    advertise: String,
    rack: String,
    ttl_ms: u64,
    refresh: Duration,
    stop: watch::Receiver<bool>,
) {
    register_in_group(
        core,
        meta,
        advertise,
        rack,
        String::new(),
        ttl_ms,
        refresh,
        stop,
    )
    .await
}

/// [`register`] with a bookie affinity group (`bookie.group`; an admin's `bookies set-group`,
/// kept at `/bookies/groups/<advertise>`, wins over it).
#[allow(clippy::too_many_arguments)]
pub async fn register_in_group(
    core: Arc<BookieCore>,
    meta: meridian_metadata::MetadataClient,
    advertise: String,
    rack: String,
    group: String,
    ttl_ms: u64,
    refresh: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let key = format!("{}{advertise}", crate::ledger::BOOKIES_PREFIX);
    let mut session: Option<meridian_metadata::SessionHandle> = None;
    loop {
        if session.as_ref().is_some_and(|s| s.lost().is_some()) {
            session = None;
        }
        if session.is_none() {
            match meta.session(ttl_ms).await {
                Ok(s) => session = Some(s),
                Err(e) => tracing::warn!(error = %e, "bookie registration: no session yet"),
            }
        }
        if let Some(s) = &session {
            let (free_bytes, _) = core.disk_usage();
            // An admin's rack (`bookies set-rack`) wins over the configured one.
            let rack_key = format!("{}{advertise}", crate::ledger::BOOKIE_RACKS_PREFIX);
            let rack = match meta.get(&rack_key).await {
                Ok(Some(kv)) => String::from_utf8(kv.value).unwrap_or_else(|_| rack.clone()),
                _ => rack.clone(),
            };
            let decom_key = format!("{}{advertise}", crate::autorecovery::DECOMMISSIONED_PREFIX);
            if let Ok(Some(_)) = meta.get(&decom_key).await {
                core.set_decommissioned(&advertise);
            }
            let group_key = format!("{}{advertise}", crate::ledger::BOOKIE_GROUPS_PREFIX);
            let group = match meta.get(&group_key).await {
                Ok(Some(kv)) => String::from_utf8(kv.value).unwrap_or_else(|_| group.clone()),
                _ => group.clone(),
            };
            let info = crate::ledger::BookieInfo {
                address: advertise.clone(),
                free_bytes,
                writable: !core.is_read_only(),
                rack,
                group,
            };
            let value = serde_json::to_vec(&info).expect("serializable");
            let opts = meridian_metadata::client::PutOptions {
                session: s.id,
                ..Default::default()
            };
            if let Err(e) = meta.put_with(&key, value, opts).await {
                tracing::warn!(error = %e, key = %key, "bookie registration failed");
            }
        }
        tokio::select! {
            _ = stop.changed() => break,
            _ = tokio::time::sleep(refresh) => {}
        }
    }
    if let Some(s) = session {
        // Unregister promptly if the store answers; otherwise the session's TTL does it.
        let _ = tokio::time::timeout(Duration::from_secs(2), s.close()).await;
    }
}

/// Deletes ledgers this bookie stores whose metadata is gone: ledgers deleted while this bookie
/// was down or unreachable (the deleting client could not tell it). A ledger's metadata is
/// written before its first add, so a ledger with entries here and no metadata is an orphan.
/// A decommissioned bookie also deletes a ledger whose metadata has not named it in two scans
/// in a row (autorecovery made its replicas elsewhere).
/// Any error reading the metadata store skips that ledger: nothing is deleted on doubt.
/// Returns the ids deleted.
pub async fn delete_orphans(
    core: &BookieCore,
    meta: &meridian_metadata::MetadataClient,
) -> Vec<u64> {
    let mut deleted = Vec::new();
    let was_moved = std::mem::take(&mut *core.moved_away.lock().expect("lock"));
    let mut seen_moved = std::collections::BTreeSet::new();
    for (id, _) in core.storage.ledgers() {
        match meta.get(&crate::ledger::ledger_key(id)).await {
            Ok(None) => {
                let storage = Arc::clone(&core.storage);
                match tokio::task::spawn_blocking(move || storage.delete(id)).await {
                    Ok(Ok(())) => {
                        tracing::info!(ledger = id, "deleted an orphan ledger (no metadata)");
                        deleted.push(id);
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(ledger = id, error = %e, "deleting an orphan ledger failed")
                    }
                    Err(e) => {
                        tracing::warn!(ledger = id, error = %e, "deleting an orphan ledger failed")
                    }
                }
            }
            Ok(Some(kv)) => {
                // A decommissioned bookie gives up what autorecovery has made elsewhere: the
                // ledger's metadata no longer names it. (Only a decommissioned one: any other
                // bookie may be a replacement whose copy is not yet swapped in.)
                let Some(me) = core.decommissioned_as() else {
                    continue;
                };
                let Ok(m) = crate::ledger::LedgerMetadata::decode(&kv.value) else {
                    continue;
                };
                if m.fragments.iter().any(|f| f.ensemble.contains(&me)) {
                    continue;
                }
                seen_moved.insert(id);
                if !was_moved.contains(&id) {
                    continue;
                }
                let storage = Arc::clone(&core.storage);
                if let Ok(Ok(())) = tokio::task::spawn_blocking(move || storage.delete(id)).await {
                    tracing::info!(
                        ledger = id,
                        "decommissioned: deleted a ledger now replicated elsewhere"
                    );
                    deleted.push(id);
                }
            }
            Err(e) => {
                tracing::debug!(ledger = id, error = %e, "orphan check skipped");
            }
        }
    }
    *core.moved_away.lock().expect("lock") = seen_moved;
    deleted
}

/// Runs [`delete_orphans`] every `interval` until `stop`.
pub async fn orphan_scanner(
    core: Arc<BookieCore>,
    meta: meridian_metadata::MetadataClient,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        delete_orphans(&core, &meta).await;
    }
}

#[cfg(test)]
mod tests {
    use super::{disk_full_next, read_checked, LedgerStorage, StorageOptions};
    use crate::proto::{self, Status, NONE};

    /// A read whose bytes do not verify (here: damaged on disk; in life also a journal file
    /// recycled under a read that looked the index up before garbage collection moved the
    /// entry) is refused and not kept in the read cache: once the bytes are right again the
    /// entry is served.
    #[test]
    fn given_a_read_that_does_not_verify_then_it_is_refused_and_not_cached() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (s, _, _) = LedgerStorage::open(StorageOptions {
            ledger_dir: dir.path().to_path_buf(),
            write_cache_bytes_max: 1 << 20,
            read_cache_bytes_max: 1 << 20,
            entry_log_bytes_max: 1 << 20,
            compaction_live_ratio_min: 0.5,
            fsync: false,
            journal_dir: None,
            journal_spare_bytes: None,
            single_write: false,
        })
        .expect("open");
        let payload = b"an entry that reads back only when its bytes are right";
        let entry = proto::seal(9, 0, NONE, payload);
        s.add_durable(9, 0, NONE, b"key", (None, &entry), None, false);
        s.flush().expect("flush");
        let log = std::fs::read_dir(dir.path().join("entrylogs"))
            .expect("entry logs")
            .map(|e| e.expect("entry").path())
            .find(|p| p.extension().is_some_and(|x| x == "log"))
            .expect("an entry log");
        let bytes = std::fs::read(&log).expect("read log");
        let at = bytes
            .windows(payload.len())
            .position(|w| w == payload)
            .expect("payload in the log");
        let set = |b: u8| {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&log)
                .expect("open log");
            f.write_all_at(&[b], at as u64).expect("write");
        };
        set(payload[0] ^ 0xff);
        assert_eq!(read_checked(&s, 9, 0), Err(Status::BadChecksum));
        set(payload[0]);
        assert_eq!(read_checked(&s, 9, 0).expect("read"), entry);
    }

    #[test]
    fn given_disk_usage_readings_then_read_only_has_a_low_water_mark() {
        // A 90% limit: past it read-only; back to writable at 85% or less, not before.
        assert!(!disk_full_next(false, 90, 90));
        assert!(disk_full_next(false, 91, 90));
        assert!(disk_full_next(true, 86, 90));
        assert!(!disk_full_next(true, 85, 90));
        assert!(!disk_full_next(false, 86, 90));
    }
}
