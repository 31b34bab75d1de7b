//! The bookie's journal: an append-only, checksummed, group-committed log of every write.
//!
//! ```text
//!  appenders ──(bounded queue)──► journal thread ──► write(batch) ──► sync thread ──► fdatasync
//!                                  collects until: the queue is empty,    covers every batch
//!                                  batch_bytes_max is reached, or         written meanwhile
//!                                  flush_delay_us has passed since the          │ the batches'
//!                                  batch's first record                         ▼ callbacks
//!                                                                      completion thread
//! ```
//!
//! An entry is acknowledged (its callback gets `Ok`) only after the fdatasync that covers it has
//! returned: one fsync acknowledges every record of the batch, and of every batch written while
//! the fdatasync before it ran. The journal thread writes the next batches into the page cache
//! while the sync thread waits on the disk (as BookKeeper's force-write thread): at the maximum
//! batched publish rate the journal was busy 85% of the time writing and syncing one batch after
//! the other. Callbacks run on a completion thread, batch after batch in journal order (a
//! bookie's callback puts the entry into its write cache and answers: at 200,000 adds/s that was
//! about 40% of the journal thread's time).
//!
//! Files are `journal-<seq as 16 hex digits>.log`, rotated after `file_bytes_max`. A file starts
//! with a 16-byte header (magic, format version, sequence number); then records:
//!
//! ```text
//!  len: u32 LE | crc32c: u32 LE | payload (len bytes)
//!  crc32c covers the file's sequence number, len and payload, so bytes left from an older
//!  file never verify in a newer one.
//! ```
//!
//! Replay at start-up reads every file in order and stops a file at its first record that is
//! not whole or does not verify (a torn tail: a write cut by a crash, which no fsync covered, so
//! nobody was acknowledged for it). It truncates the file there and never panics on it. A new
//! process always writes into a new file.
//!
//! Pre-filled files (`prefill`): an fdatasync after an append that grows a file, or that
//! writes into space reserved with `fallocate`, must also commit file metadata (the size, the
//! extents): on this machine a 4 KiB write and fsync took 0.15-0.20 ms, against 0.11-0.14 ms
//! overwriting blocks that already hold data. So a new journal file is, when one is ready, the spare
//! `journal-spare.log`: either a checkpointed journal file recycled whole (its old records are
//! left in place and never verify in the new file: the checksum covers the file's sequence) or a
//! file of zeroes written ahead ([`prepare_spare`], from the bookie's flusher thread, at most a
//! few MiB at a time). A fresh journal directory gets its first file zero-filled before the
//! journal starts. Without a spare, files are reserved in steps of `preallocate_bytes`.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"MRDNJRNL";
const FORMAT_VERSION: u32 = 1;
const FILE_HEADER_BYTES: u64 = 16;
const RECORD_HEADER_BYTES: usize = 8;
/// No single record may be larger than this (a garbage length in a torn tail must not make
/// replay allocate gigabytes).
pub const RECORD_BYTES_MAX: usize = 64 << 20;

/// What a journal record says. The journal itself only checks framing and checksums; the bookie
/// interprets kinds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub kind: RecordKind,
    pub ledger_id: u64,
    pub entry_id: u64,
    pub data: Vec<u8>,
    /// Bytes written right after `data` in the same record, from their own buffer (a bookie's
    /// entry: not copied into `data` first). Replay returns them at the end of `data`.
    pub tail: bytes::Bytes,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RecordKind {
    /// An entry as the writer sent it.
    Add = 1,
    /// The ledger was fenced: later adds from its writer are refused.
    Fence = 2,
}

impl RecordKind {
    fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Self::Add),
            2 => Some(Self::Fence),
            _ => None,
        }
    }
}

/// Where a record lives: file sequence number and byte offset of its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Position {
    pub file: u64,
    pub offset: u64,
}

/// The file offset of the data of the record at `pos` (its tail follows the data).
pub fn data_offset(pos: Position) -> u64 {
    pos.offset + (RECORD_HEADER_BYTES + 17) as u64
}

/// Encoded size of a record (header included).
pub fn encoded_len(r: &Record) -> usize {
    RECORD_HEADER_BYTES + 17 + r.data.len() + r.tail.len()
}

#[cfg(test)]
fn encode_into(buf: &mut Vec<u8>, file: u64, r: &Record) {
    encode_head(buf, file, r, true);
}

/// Appends record `r` to `buf`, its tail included only if `copy_tail`; otherwise the tail's
/// bytes must follow in the file right after what this appended. The checksum covers the tail
/// either way.
fn encode_head(buf: &mut Vec<u8>, file: u64, r: &Record, copy_tail: bool) {
    let payload_len = 17 + r.data.len() + r.tail.len();
    let start = buf.len();
    buf.extend_from_slice(&(payload_len as u32).to_le_bytes());
    buf.extend_from_slice(&[0; 4]);
    buf.push(r.kind as u8);
    buf.extend_from_slice(&r.ledger_id.to_le_bytes());
    buf.extend_from_slice(&r.entry_id.to_le_bytes());
    buf.extend_from_slice(&r.data);
    if copy_tail {
        buf.extend_from_slice(&r.tail);
    }
    let mut crc = record_crc(file, &buf[start..start + 4], &buf[start + 8..]);
    if !copy_tail {
        crc = crc32c::crc32c_append(crc, &r.tail);
    }
    buf[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// Tails this large are written from their own buffers rather than copied into the batch
/// (see [`Batch`]). Smaller ones are cheaper to copy than to give a slice of their own.
const GATHER_TAIL_MIN: usize = 16 << 10;

/// The bytes of one group commit, in file order: headers, data and small tails copied into
/// `buf`, large tails ([`GATHER_TAIL_MIN`]) referenced where they are and written with the rest
/// in vectored writes. At the maximum batched publish rate (entries of about 128 KiB) copying
/// them into the batch was 3.4% of a standalone's CPU.
#[derive(Default)]
struct Batch {
    buf: Vec<u8>,
    /// Each large tail with the length of `buf` it follows.
    tails: Vec<(usize, bytes::Bytes)>,
    /// Bytes of the batch in all.
    len: usize,
}

impl Batch {
    fn with_capacity(n: usize) -> Self {
        Self {
            buf: Vec::with_capacity(n),
            ..Self::default()
        }
    }

    fn push(&mut self, file: u64, r: &Record) {
        let gather = r.tail.len() >= GATHER_TAIL_MIN;
        encode_head(&mut self.buf, file, r, !gather);
        if gather {
            self.tails.push((self.buf.len(), r.tail.clone()));
        }
        self.len += encoded_len(r);
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn clear(&mut self) {
        self.buf.clear();
        self.tails.clear();
        self.len = 0;
    }

    /// The batch as slices in file order.
    fn slices(&self) -> Vec<io::IoSlice<'_>> {
        let mut out = Vec::with_capacity(2 * self.tails.len() + 1);
        let mut from = 0;
        for (at, tail) in &self.tails {
            if *at > from {
                out.push(io::IoSlice::new(&self.buf[from..*at]));
            }
            out.push(io::IoSlice::new(tail));
            from = *at;
        }
        if self.buf.len() > from {
            out.push(io::IoSlice::new(&self.buf[from..]));
        }
        out
    }
}

/// Writes every slice, at most `IOV_MAX`-sized groups per `writev` call.
fn write_all_vectored(mut file: &File, mut slices: &mut [io::IoSlice<'_>]) -> io::Result<()> {
    const SLICES_PER_CALL: usize = 1024;
    while !slices.is_empty() {
        let n = slices.len().min(SLICES_PER_CALL);
        let written = file.write_vectored(&slices[..n])?;
        if written == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        io::IoSlice::advance_slices(&mut slices, written);
    }
    Ok(())
}

fn record_crc(file: u64, len: &[u8], payload: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&file.to_le_bytes());
    let crc = crc32c::crc32c_append(crc, len);
    crc32c::crc32c_append(crc, payload)
}

/// Why replay stopped reading a file before its end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TailDamage {
    /// The header claims more bytes than the file holds.
    Short { len: usize },
    /// The length is zero or above [`RECORD_BYTES_MAX`] (zeroes of pre-allocated space included).
    BadLength { len: usize },
    /// The checksum does not match.
    Checksum { expected: u32, actual: u32 },
    /// The payload does not parse (unknown kind or too short).
    BadPayload,
}

/// What [`decode_file`] found in one file's bytes (after the header).
#[derive(Debug, Default)]
pub struct Decoded {
    pub records: Vec<(Position, Record)>,
    /// Offset of the first byte after the last good record.
    pub end: u64,
    /// Set when something other than pre-allocated zeroes follows the last good record.
    pub damage: Option<TailDamage>,
}

/// One step of decoding: what starts at the front of `rest`.
enum Step {
    /// A whole record of this many bytes (header included).
    Record(Record, usize),
    /// The record goes on past `rest`; more bytes may complete it.
    NeedMore,
    /// The last record was before this point; with damage unless what follows is zeroes.
    End(Option<TailDamage>),
}

/// Decodes the record at the front of `rest`, in file `file`. `eof`: nothing follows `rest`.
fn decode_step(file: u64, rest: &[u8], eof: bool) -> Step {
    if rest.len() < RECORD_HEADER_BYTES {
        return if !eof {
            Step::NeedMore
        } else if rest.iter().any(|b| *b != 0) {
            Step::End(Some(TailDamage::Short { len: rest.len() }))
        } else {
            Step::End(None)
        };
    }
    let len = u32::from_le_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
    let crc = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes"));
    if len == 0 && crc == 0 {
        // Pre-allocated space: the end of what was written, unless non-zero bytes follow
        // (looked for in what was read: the rest of the file when decoding a whole file).
        return Step::End(
            rest.iter()
                .any(|b| *b != 0)
                .then_some(TailDamage::BadLength { len }),
        );
    }
    if !(17..=RECORD_BYTES_MAX).contains(&len) {
        return Step::End(Some(TailDamage::BadLength { len }));
    }
    if rest.len() < RECORD_HEADER_BYTES + len {
        return if eof {
            Step::End(Some(TailDamage::Short { len }))
        } else {
            Step::NeedMore
        };
    }
    let payload = &rest[RECORD_HEADER_BYTES..RECORD_HEADER_BYTES + len];
    let actual = record_crc(file, &rest[0..4], payload);
    if actual != crc {
        return Step::End(Some(TailDamage::Checksum {
            expected: crc,
            actual,
        }));
    }
    let Some(kind) = RecordKind::from_u8(payload[0]) else {
        return Step::End(Some(TailDamage::BadPayload));
    };
    Step::Record(
        Record {
            kind,
            ledger_id: u64::from_le_bytes(payload[1..9].try_into().expect("8 bytes")),
            entry_id: u64::from_le_bytes(payload[9..17].try_into().expect("8 bytes")),
            data: payload[17..].to_vec(),
            tail: bytes::Bytes::new(),
        },
        RECORD_HEADER_BYTES + len,
    )
}

/// Decodes the records of file `file` whose bytes (header included) are `bytes`. Pure: no I/O.
pub fn decode_file(file: u64, bytes: &[u8]) -> Decoded {
    let mut out = Decoded {
        end: FILE_HEADER_BYTES,
        ..Decoded::default()
    };
    let mut at = FILE_HEADER_BYTES as usize;
    while at < bytes.len() {
        match decode_step(file, &bytes[at..], true) {
            Step::Record(record, n) => {
                out.records.push((
                    Position {
                        file,
                        offset: at as u64,
                    },
                    record,
                ));
                at += n;
                out.end = at as u64;
            }
            Step::NeedMore => unreachable!("eof is set"),
            Step::End(damage) => {
                out.damage = damage;
                break;
            }
        }
    }
    out
}

/// [`decode_file`] over a file read a chunk at a time: a pre-filled file is mostly zeroes or
/// an older file's bytes after its records, and is not read past its end of records (beyond
/// one chunk).
fn decode_path(file: u64, path: &Path) -> Result<Option<Decoded>, JournalError> {
    const CHUNK: usize = 8 << 20;
    let mut f = File::open(path).map_err(io_at(path))?;
    let mut buf: Vec<u8> = Vec::new();
    let mut eof = false;
    let mut fill = |buf: &mut Vec<u8>, eof: &mut bool| -> Result<(), JournalError> {
        let n = (&mut f)
            .take(CHUNK as u64)
            .read_to_end(buf)
            .map_err(io_at(path))?;
        *eof = n < CHUNK;
        Ok(())
    };
    fill(&mut buf, &mut eof)?;
    if buf.len() < FILE_HEADER_BYTES as usize {
        return Ok(None);
    }
    check_header(&buf, file).map_err(|()| JournalError::BadHeader {
        path: path.to_path_buf(),
    })?;
    let mut out = Decoded {
        end: FILE_HEADER_BYTES,
        ..Decoded::default()
    };
    // `buf` holds the file's bytes from offset `base`; `at` is relative to it.
    let mut base = 0u64;
    let mut at = FILE_HEADER_BYTES as usize;
    loop {
        if at >= buf.len() && eof {
            break;
        }
        match decode_step(file, &buf[at..], eof) {
            Step::Record(record, n) => {
                out.records.push((
                    Position {
                        file,
                        offset: base + at as u64,
                    },
                    record,
                ));
                at += n;
                out.end = base + at as u64;
            }
            Step::NeedMore => {
                buf.drain(..at);
                base += at as u64;
                at = 0;
                fill(&mut buf, &mut eof)?;
            }
            Step::End(damage) => {
                out.damage = damage;
                break;
            }
        }
    }
    Ok(Some(out))
}

/// Settings of a journal (from `bookie.journal_*` in the configuration).
#[derive(Debug, Clone)]
pub struct JournalOptions {
    pub dir: PathBuf,
    /// Flush once this many bytes are waiting.
    pub batch_bytes_max: usize,
    /// Flush once the oldest waiting record has waited this long.
    pub flush_delay_us: u64,
    /// Start a new file once the current one holds this many bytes.
    pub file_bytes_max: u64,
    /// Grow files on disk in steps of this many bytes ahead of the writes.
    pub preallocate_bytes: u64,
    /// Capacity of the appenders' queue, in records; appenders wait when it is full.
    pub queue_records_max: usize,
    /// fdatasync each batch (only tests and benchmarks of the CPU path turn this off).
    pub fsync: bool,
    /// Write into pre-filled files (recycled or zero-filled spares; module docs).
    pub prefill: bool,
    /// Drop what an fdatasync made durable from the page cache (`posix_fadvise` DONTNEED):
    /// a bookie whose journal files are its store (`bookie.single_write`) writes each byte into
    /// pages not in the cache (its journal files are recycled only once garbage collection
    /// retires them, long after their pages were written), and taking fresh pages for every
    /// write cost it about 45% of its maximum publish rate.
    pub drop_synced_pages: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("journal {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("journal {path}: not a Meridian journal file (bad header)")]
    BadHeader { path: PathBuf },
    /// An earlier write or fsync failed; the journal refuses writes until the bookie restarts
    /// (after a failed fsync the page cache's state is unknown).
    #[error("journal is read-only after an earlier failure: {0}")]
    Failed(String),
    #[error("the journal has stopped")]
    Stopped,
    /// A record over [`RECORD_BYTES_MAX`]: replay would take it for damage, so it is refused
    /// (the journal goes on).
    #[error("journal record of {len} bytes is over the limit of {max}")]
    TooLarge { len: usize, max: usize },
    /// The disk had no space for the record (reserving room in the file, or starting the next
    /// file, failed with ENOSPC) and nothing of it was written: the journal goes on, and takes
    /// records again once there is space.
    #[error("journal: no space left on the disk for the record: {0}")]
    NoSpace(String),
}

/// Whether `e` failed for want of space on the disk.
fn is_no_space(e: &JournalError) -> bool {
    matches!(e, JournalError::Io { source, .. } if source.raw_os_error() == Some(rustix::io::Errno::NOSPC.raw_os_error()))
}

fn io_at(path: &Path) -> impl FnOnce(io::Error) -> JournalError + '_ {
    move |source| JournalError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn file_name(seq: u64) -> String {
    format!("journal-{seq:016x}.log")
}

/// The path of journal file `seq` in `dir`.
pub fn file_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(file_name(seq))
}

fn parse_file_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix("journal-")?.strip_suffix(".log")?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// The journal files in `dir`, oldest first.
pub fn list_files(dir: &Path) -> Result<Vec<(u64, PathBuf)>, JournalError> {
    let mut files = Vec::new();
    for item in fs::read_dir(dir).map_err(io_at(dir))? {
        let item = item.map_err(io_at(dir))?;
        if let Some(seq) = item.file_name().to_str().and_then(parse_file_name) {
            files.push((seq, item.path()));
        }
    }
    files.sort();
    Ok(files)
}

const SPARE_NAME: &str = "journal-spare.log";
const SPARE_TMP_NAME: &str = "journal-spare.tmp";

fn sync_dir(dir: &Path) -> Result<(), JournalError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_at(dir))
}

/// The sequence a recycled spare had as a journal file (from its header, which keeps the low
/// 32 bits), or `None` for a zero-filled one.
fn spare_former_seq(dir: &Path) -> Option<u64> {
    let mut h = [0u8; FILE_HEADER_BYTES as usize];
    File::open(dir.join(SPARE_NAME))
        .and_then(|mut f| f.read_exact(&mut h))
        .ok()?;
    (h[0..12] == header(0)[0..12])
        .then(|| u32::from_le_bytes(h[12..16].try_into().expect("4 bytes")) as u64)
}

/// Whether a spare file is ready in `dir`.
pub fn spare_ready(dir: &Path) -> bool {
    dir.join(SPARE_NAME).exists()
}

/// Zero-fills the next spare journal file of `dir`, at most `budget` more bytes per call (each
/// call's zeroes are fsynced before it returns, so that they never wait in the page cache for
/// the journal's own fdatasync). Returns `true` once a spare of `file_bytes_max` bytes is
/// ready. On failure the partial spare is removed.
pub fn prepare_spare(dir: &Path, file_bytes_max: u64, budget: u64) -> Result<bool, JournalError> {
    if spare_ready(dir) {
        return Ok(true);
    }
    let tmp = dir.join(SPARE_TMP_NAME);
    let mut f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&tmp)
        .map_err(io_at(&tmp))?;
    let have = f.metadata().map_err(io_at(&tmp))?.len();
    let target = have.saturating_add(budget).min(file_bytes_max);
    static ZEROS: [u8; 1 << 20] = [0; 1 << 20];
    let mut at = have;
    let written = (|| {
        while at < target {
            let n = (target - at).min(ZEROS.len() as u64) as usize;
            f.write_all(&ZEROS[..n])?;
            at += n as u64;
        }
        f.sync_data()
    })();
    if let Err(e) = written {
        // Give the space back (a full disk is the likely cause).
        let _ = fs::remove_file(&tmp);
        return Err(io_at(&tmp)(e));
    }
    if at < file_bytes_max {
        return Ok(false);
    }
    fs::rename(&tmp, dir.join(SPARE_NAME)).map_err(io_at(&tmp))?;
    sync_dir(dir)?;
    Ok(true)
}

/// Disposes of a journal file that no longer holds anything needed (the checkpoint passed it,
/// and no index entry points into it): it becomes the spare when there is none and it holds at
/// least half of `file_bytes_max` (with `prefill`), else it is removed. Returns whether it
/// became the spare.
pub fn retire(
    dir: &Path,
    path: &Path,
    file_bytes_max: u64,
    prefill: bool,
) -> Result<bool, JournalError> {
    let len = fs::metadata(path).map_err(io_at(path))?.len();
    if prefill && !spare_ready(dir) && len >= file_bytes_max / 2 {
        // A half-made zero-filled spare is not needed any more.
        let _ = fs::remove_file(dir.join(SPARE_TMP_NAME));
        // No directory fsync: after a crash the old name may come back, and a journal file
        // older than the checkpoint that no index entry points into is retired at start-up.
        return fs::rename(path, dir.join(SPARE_NAME))
            .map(|()| true)
            .map_err(io_at(path));
    }
    fs::remove_file(path).map(|()| false).map_err(io_at(path))
}

/// What replay did to one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileReplay {
    pub file: u64,
    pub path: PathBuf,
    pub records: usize,
    pub end: u64,
    pub damage: Option<TailDamage>,
}

/// Reads every journal file in `dir` from sequence `from` on, in order, and hands each good
/// record to `apply` (older files are a bookie's entry store, not replayed). A damaged tail is
/// logged with its file and offset and truncated away; what follows it is never returned.
pub fn replay(
    dir: &Path,
    from: u64,
    keep_whole: impl Fn(u64) -> bool,
    mut apply: impl FnMut(Position, Record),
) -> Result<Vec<FileReplay>, JournalError> {
    meridian_metadata::durable_dir::create_dir_all_synced(dir).map_err(io_at(dir))?;
    let mut report = Vec::new();
    for (seq, path) in list_files(dir)?.into_iter().filter(|(s, _)| *s >= from) {
        let Some(decoded) = decode_path(seq, &path)? else {
            // Created but the header never made it to disk: nothing was acknowledged from it.
            tracing::warn!(path = %path.display(), "journal file without a whole header; removing it");
            fs::remove_file(&path).map_err(io_at(&path))?;
            continue;
        };
        if let Some(damage) = decoded.damage.as_ref().filter(|_| keep_whole(seq)) {
            // The index points into this file (a bookie's entry store): what follows the bad
            // record may be indexed entries, which reads check one by one. Left as it is: a
            // new process writes into a new file anyway. After a crash this is the torn tail.
            tracing::info!(
                path = %path.display(),
                offset = decoded.end,
                ?damage,
                "journal records end before the file does (a torn tail, or damage); the file holds indexed entries, so it is replayed up to there and left whole"
            );
        } else if let Some(damage) = &decoded.damage {
            // Expected after a crash (a write no fsync covered), and in a recycled file (an
            // older file's bytes follow the records); corruption otherwise.
            tracing::info!(
                path = %path.display(),
                offset = decoded.end,
                ?damage,
                "journal records end before the file does (a torn tail, or a recycled file's older bytes); truncating it there"
            );
            let f = OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(io_at(&path))?;
            f.set_len(decoded.end).map_err(io_at(&path))?;
            f.sync_all().map_err(io_at(&path))?;
        }
        report.push(FileReplay {
            file: seq,
            path: path.clone(),
            records: decoded.records.len(),
            end: decoded.end,
            damage: decoded.damage,
        });
        for (pos, r) in decoded.records {
            apply(pos, r);
        }
    }
    Ok(report)
}

fn header(seq: u64) -> [u8; FILE_HEADER_BYTES as usize] {
    let mut h = [0u8; FILE_HEADER_BYTES as usize];
    h[0..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    // Low 32 bits of the sequence: a file renamed to another sequence is caught here; the full
    // sequence is in every record's checksum.
    h[12..16].copy_from_slice(&(seq as u32).to_le_bytes());
    h
}

fn check_header(bytes: &[u8], seq: u64) -> Result<(), ()> {
    if bytes[0..16] == header(seq) {
        Ok(())
    } else {
        Err(())
    }
}

/// Completion of one append: `Ok(position)` once fsynced.
pub type Done = Box<dyn FnOnce(Result<Position, JournalError>) + Send>;
/// Completion of a roll: the new file's sequence number.
pub type RollDone = Box<dyn FnOnce(Result<u64, JournalError>) + Send>;

/// Callbacks of one batch (or a roll's), run in order on the completion thread.
type Completion = Box<dyn FnOnce() + Send>;

/// Batches whose callbacks may wait for the completion thread before the journal waits too.
const COMPLETIONS_QUEUED_MAX: usize = 64;

enum Op {
    /// A record, its callback, and when it was queued.
    Append(Record, Done, Instant),
    /// Roll to a new file now; answers with the sequence number of the new file.
    Roll(RollDone),
    /// Flush what is queued before this, then end the thread.
    Stop,
}

/// Counters of a journal since it started.
#[derive(Debug, Default)]
pub struct JournalStats {
    /// Batches written.
    pub flushes: AtomicU64,
    /// fdatasyncs: one covers every batch written while the one before it ran, so under load
    /// there are fewer of these than batches.
    pub syncs: AtomicU64,
    pub records: AtomicU64,
    pub bytes: AtomicU64,
    /// Bytes written into the current file (header included).
    pub file_len: AtomicU64,
}

/// Handle to the journal thread. Dropping every handle stops the thread after it has flushed
/// what was queued.
#[derive(Clone)]
pub struct Journal {
    tx: SyncSender<Op>,
    stats: Arc<JournalStats>,
    first_file: u64,
}

/// Joins the journal thread on drop (after every [`Journal`] handle is gone).
pub struct JournalThread(Option<JoinHandle<()>>);

impl JournalThread {
    /// Lets the thread finish on its own.
    pub fn detach(mut self) {
        self.0.take();
    }

    pub fn join(mut self) {
        if let Some(h) = self.0.take() {
            let _ = h.join();
        }
    }
}

impl Drop for JournalThread {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            let _ = h.join();
        }
    }
}

impl Journal {
    /// Starts writing into a new file after the newest one in `opts.dir`. Call [`replay`]
    /// first: files written before are not read here.
    pub fn start(opts: JournalOptions) -> Result<(Journal, JournalThread), JournalError> {
        meridian_metadata::durable_dir::create_dir_all_synced(&opts.dir)
            .map_err(io_at(&opts.dir))?;
        let existing = list_files(&opts.dir)?;
        if opts.prefill && existing.is_empty() {
            // A fresh journal: its first file is zero-filled now (once per bookie), so that
            // its fdatasyncs are as fast as later ones. Best effort: without the room for it,
            // files grow as they are written.
            if let Err(e) = prepare_spare(&opts.dir, opts.file_bytes_max, u64::MAX) {
                tracing::warn!(error = %e, "zero-filling the first journal file failed; writing without it");
            }
        }
        // After every file older than it: a recycled spare's older records are told apart
        // from new ones by the sequence in their checksums, so no sequence is used twice.
        let next = existing
            .last()
            .map_or(1, |(s, _)| s + 1)
            .max(spare_former_seq(&opts.dir).map_or(0, |s| s + 1));
        let writer = Writer::create(&opts, next)?;
        let (tx, rx) = mpsc::sync_channel(opts.queue_records_max.max(1));
        let stats = Arc::new(JournalStats::default());
        let thread_stats = Arc::clone(&stats);
        // Bounded: when callbacks fall this many batches behind, the journal waits for them.
        let (done_tx, done_rx) = mpsc::sync_channel::<Completion>(COMPLETIONS_QUEUED_MAX);
        let completions = std::thread::Builder::new()
            .name("bookie-journal-done".into())
            .spawn(move || {
                for job in done_rx {
                    job();
                }
            })
            .map_err(|e| JournalError::Failed(format!("spawning the completion thread: {e}")))?;
        let (sync_tx, sync_rx) = mpsc::sync_channel::<SyncJob>(SYNCS_QUEUED_MAX);
        let failure = Arc::new(std::sync::Mutex::new(None));
        let sync_failure = Arc::clone(&failure);
        let fsync = opts.fsync;
        let drop_synced_pages = opts.drop_synced_pages;
        let sync_stats = Arc::clone(&stats);
        let syncer = std::thread::Builder::new()
            .name("bookie-journal-sync".into())
            .spawn(move || {
                sync_thread(
                    sync_rx,
                    (fsync, drop_synced_pages),
                    sync_failure,
                    sync_stats,
                    done_tx,
                )
            })
            .map_err(|e| JournalError::Failed(format!("spawning the sync thread: {e}")))?;
        let thread = std::thread::Builder::new()
            .name("bookie-journal".into())
            .spawn(move || {
                run(writer, opts, rx, thread_stats, &sync_tx, &failure);
                // Every batch is synced and every callback has run once the journal thread is
                // joined.
                drop(sync_tx);
                let _ = syncer.join();
                let _ = completions.join();
            })
            .map_err(|e| JournalError::Failed(format!("spawning the journal thread: {e}")))?;
        Ok((
            Journal {
                tx,
                stats,
                first_file: next,
            },
            JournalThread(Some(thread)),
        ))
    }

    /// The sequence of the first file this journal writes: every record in older files was
    /// written before it started.
    pub fn first_file(&self) -> u64 {
        self.first_file
    }

    pub fn stats(&self) -> &JournalStats {
        &self.stats
    }

    /// Queues `record`; `done` runs on the completion thread once it is fsynced (or failed), after
    /// the callbacks of every record queued before it. Blocks while the queue is full.
    pub fn append(&self, record: Record, done: Done) {
        let op = Op::Append(record, done, Instant::now());
        if let Err(mpsc::SendError(Op::Append(_, done, _))) = self.tx.send(op) {
            done(Err(JournalError::Stopped));
        }
    }

    /// Closes the current file and starts the next; `done` gets the new file's sequence.
    /// Every file older than the answer is complete once `done` runs.
    /// [`append`](Self::append) without waiting: gives the record back when the queue is full.
    pub fn try_append(&self, record: Record, done: Done) -> Result<(), (Record, Done)> {
        match self.tx.try_send(Op::Append(record, done, Instant::now())) {
            Ok(()) => Ok(()),
            Err(mpsc::TrySendError::Full(Op::Append(r, d, _))) => Err((r, d)),
            Err(mpsc::TrySendError::Disconnected(Op::Append(_, d, _))) => {
                d(Err(JournalError::Stopped));
                Ok(())
            }
            Err(_) => unreachable!("only appends are sent here"),
        }
    }

    /// Ends the journal thread after flushing everything queued before this call; later
    /// appends fail with [`JournalError::Stopped`].
    pub fn stop(&self) {
        let _ = self.tx.send(Op::Stop);
    }

    pub fn roll(&self, done: RollDone) {
        if let Err(mpsc::SendError(Op::Roll(done))) = self.tx.send(Op::Roll(done)) {
            done(Err(JournalError::Stopped));
        }
    }
}

struct Writer {
    seq: u64,
    path: PathBuf,
    /// Shared with the sync thread, which fdatasyncs what this writes.
    file: Arc<File>,
    /// Bytes written so far (header included).
    len: u64,
    /// Bytes reserved on disk.
    allocated: u64,
    preallocate_bytes: u64,
    /// Reservations stop here (the file rotates about there): a file kept as a bookie's
    /// store must not hold reserved blocks it never uses.
    file_bytes_max: u64,
}

impl Writer {
    fn create(opts: &JournalOptions, seq: u64) -> Result<Writer, JournalError> {
        let path = opts.dir.join(file_name(seq));
        if opts.prefill {
            if let Some(w) = Self::from_spare(opts, seq, &path)? {
                return Ok(w);
            }
        }
        let file = OpenOptions::new()
            .create_new(true)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io_at(&path))?;
        let start = |mut file: File| {
            file.write_all(&header(seq)).map_err(io_at(&path))?;
            let mut w = Writer {
                seq,
                path: path.clone(),
                file: Arc::new(file),
                len: FILE_HEADER_BYTES,
                allocated: 0,
                preallocate_bytes: opts.preallocate_bytes,
                file_bytes_max: opts.file_bytes_max,
            };
            w.reserve(0)?;
            w.file.sync_all().map_err(io_at(&w.path))?;
            // The new name must survive a crash too.
            sync_dir(&opts.dir)?;
            Ok(w)
        };
        start(file).inspect_err(|e| {
            // Nothing was written to it yet: a later roll (once there is space) makes it
            // again. A file left behind would refuse that roll (create_new).
            if let Err(rm) = fs::remove_file(&path) {
                tracing::warn!(path = %path.display(), error = %rm, cause = %e, "removing a journal file that could not be started failed");
            }
        })
    }

    /// Takes the spare file as file `seq`: its header is rewritten and made durable before
    /// the rename, so that a crash leaves either the spare or a file with this header.
    fn from_spare(
        opts: &JournalOptions,
        seq: u64,
        path: &Path,
    ) -> Result<Option<Writer>, JournalError> {
        let spare = opts.dir.join(SPARE_NAME);
        let mut file = match OpenOptions::new().read(true).write(true).open(&spare) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_at(&spare)(e)),
        };
        file.write_all(&header(seq)).map_err(io_at(&spare))?;
        file.sync_data().map_err(io_at(&spare))?;
        let size = file.metadata().map_err(io_at(&spare))?.len();
        fs::rename(&spare, path).map_err(io_at(&spare))?;
        sync_dir(&opts.dir)?;
        Ok(Some(Writer {
            seq,
            path: path.to_path_buf(),
            file: Arc::new(file),
            len: FILE_HEADER_BYTES,
            // Appends below this overwrite blocks that hold data already.
            allocated: size,
            preallocate_bytes: opts.preallocate_bytes,
            file_bytes_max: opts.file_bytes_max,
        }))
    }

    /// Makes sure the file has room for `more` bytes past `len`, reserving whole steps of
    /// `preallocate_bytes`: later fdatasyncs then do not also have to grow the file.
    fn reserve(&mut self, more: u64) -> Result<(), JournalError> {
        let need = self.len + more;
        if need <= self.allocated || self.preallocate_bytes == 0 {
            return Ok(());
        }
        let step = self.preallocate_bytes;
        let target = (need.div_ceil(step) * step).min(self.file_bytes_max.max(need));
        rustix::fs::fallocate(
            &self.file,
            rustix::fs::FallocateFlags::KEEP_SIZE,
            self.allocated,
            target - self.allocated,
        )
        .map_err(|e| JournalError::Io {
            path: self.path.clone(),
            source: e.into(),
        })?;
        self.allocated = target;
        Ok(())
    }

    /// Writes `batch` into the file (the page cache); the sync thread makes it durable. A
    /// batch for which no space could be reserved is not written at all:
    /// [`JournalError::NoSpace`].
    fn write_batch(&mut self, batch: &Batch) -> Result<(), JournalError> {
        self.reserve(batch.len as u64).map_err(|e| {
            if is_no_space(&e) {
                JournalError::NoSpace(e.to_string())
            } else {
                e
            }
        })?;
        write_all_vectored(&self.file, &mut batch.slices()).map_err(io_at(&self.path))?;
        self.len += batch.len as u64;
        Ok(())
    }
}

/// Work for the sync thread, in journal order.
enum SyncJob {
    /// A batch written into `file` (the page cache): fdatasync it, then answer `waiters`.
    Written {
        file: Arc<File>,
        path: PathBuf,
        waiters: Vec<(Position, Done)>,
        /// When its write into the page cache returned.
        written: Instant,
    },
    /// Callbacks that run after those of every batch before them (a roll's answer, appends
    /// refused after a failure).
    Then(Completion),
}

/// After starting the next file failed for want of space, records that need it are refused
/// for this long before it is tried again.
const ROLL_RETRY: Duration = Duration::from_millis(100);

/// Batches written and waiting for the sync thread before the journal thread waits too.
const SYNCS_QUEUED_MAX: usize = 64;

/// The sync thread: fdatasyncs what the journal thread wrote, in order, while that thread
/// collects and writes the next batches (BookKeeper's force-write thread). Every batch written
/// into the same file while one fdatasync ran is covered by the next one. A batch's callbacks
/// go to the completion thread only after the fdatasync that covers it returned. After a failed
/// fdatasync every later batch fails too: the kernel may have dropped the unsynced pages, and a
/// later fdatasync would not say so.
fn sync_thread(
    rx: mpsc::Receiver<SyncJob>,
    (fsync, drop_synced_pages): (bool, bool),
    failure: Arc<std::sync::Mutex<Option<String>>>,
    stats: Arc<JournalStats>,
    completions: SyncSender<Completion>,
) {
    let complete = |job: Completion| {
        if let Err(mpsc::SendError(job)) = completions.send(job) {
            job();
        }
    };
    let sync_latency = metrics::histogram!("meridian_journal_sync_seconds");
    let sync_wait = metrics::histogram!("meridian_journal_sync_wait_seconds");
    let completion_wait = metrics::histogram!("meridian_journal_completion_seconds");
    let mut next: Option<SyncJob> = None;
    // With `drop_synced_pages`: the file whose synced pages are dropped, and up to where.
    let mut dropped: Option<(Arc<File>, u64)> = None;
    loop {
        let job = match next.take() {
            Some(job) => job,
            None => match rx.recv() {
                Ok(job) => job,
                Err(_) => return,
            },
        };
        let (file, path, mut waiters, written) = match job {
            SyncJob::Then(job) => {
                complete(job);
                continue;
            }
            SyncJob::Written {
                file,
                path,
                waiters,
                written,
            } => (file, path, waiters, written),
        };
        while let Ok(more) = rx.try_recv() {
            match more {
                SyncJob::Written {
                    file: f,
                    waiters: w,
                    ..
                } if Arc::ptr_eq(&f, &file) => waiters.extend(w),
                other => {
                    next = Some(other);
                    break;
                }
            }
        }
        // How long the oldest batch this fdatasync covers waited for it (behind the one before).
        sync_wait.record(written.elapsed().as_secs_f64());
        let failed = failure.lock().expect("failure lock").clone();
        let result = match failed {
            Some(why) => Err(why),
            None if fsync => {
                let started = Instant::now();
                // Acknowledged means durable: nobody hears back before this returns.
                let r = file.sync_data();
                stats.syncs.fetch_add(1, Ordering::Relaxed);
                let took = started.elapsed();
                sync_latency.record(took.as_secs_f64());
                if took > Duration::from_millis(10) {
                    tracing::debug!(
                        records = waiters.len(),
                        took_us = took.as_micros() as u64,
                        "slow journal fdatasync"
                    );
                }
                r.map_err(|e| format!("{}: {e}", path.display()))
            }
            None => Ok(()),
        };
        // Every record that starts before the last one answered here was written before
        // this fdatasync began: the whole pages before that record are durable.
        let end = waiters.iter().map(|(p, _)| p.offset).max().unwrap_or(0) / 4096 * 4096;
        let synced = result.is_ok();
        if let Err(why) = &result {
            tracing::error!(error = %why, "journal fdatasync failed; the journal is read-only from now on");
            failure
                .lock()
                .expect("failure lock")
                .get_or_insert_with(|| why.clone());
        }
        let synced_at = Instant::now();
        let completion_wait = completion_wait.clone();
        complete(Box::new(move || {
            // Behind the callbacks of earlier batches on the completion thread.
            completion_wait.record(synced_at.elapsed().as_secs_f64());
            for (pos, done) in waiters {
                done(match &result {
                    Ok(()) => Ok(pos),
                    Err(why) => Err(JournalError::Failed(why.clone())),
                });
            }
        }));
        // After the answers are on their way: this only frees memory.
        if synced && drop_synced_pages {
            let from = match &dropped {
                Some((f, to)) if Arc::ptr_eq(f, &file) => *to,
                _ => 0,
            };
            if let Some(len) = std::num::NonZeroU64::new(end.saturating_sub(from)) {
                // Advice only: a failure changes nothing but the cache.
                let _ = rustix::fs::fadvise(&*file, from, Some(len), rustix::fs::Advice::DontNeed);
                dropped = Some((Arc::clone(&file), end));
            }
        }
    }
}

fn run(
    mut writer: Writer,
    opts: JournalOptions,
    rx: mpsc::Receiver<Op>,
    stats: Arc<JournalStats>,
    syncs: &SyncSender<SyncJob>,
    failure: &std::sync::Mutex<Option<String>>,
) {
    // After everything sent to the sync thread before (inline once it is gone, which never
    // happens while the journal runs: it ends after this function returns).
    let complete = |job: Completion| {
        if let Err(mpsc::SendError(SyncJob::Then(job))) = syncs.send(SyncJob::Then(job)) {
            job();
        }
    };
    let delay = Duration::from_micros(opts.flush_delay_us);
    let mut failed: Option<String> = None;
    // When starting the next file last failed for want of space.
    let mut roll_refused_at: Option<Instant> = None;
    // When the present time without space to start the next file began (for its log lines).
    let mut roll_refused_since: Option<Instant> = None;
    let mut batch = Batch::with_capacity(opts.batch_bytes_max.min(4 << 20) + 4096);
    let mut waiting: Vec<(Position, Done)> = Vec::new();
    let mut pending_op: Option<Op> = None;
    let queue_latency = metrics::histogram!("meridian_journal_queue_seconds");
    let write_latency = metrics::histogram!("meridian_journal_write_seconds");
    let batch_records = metrics::histogram!("meridian_journal_batch_records");
    loop {
        let first = match pending_op.take() {
            Some(op) => op,
            None => match rx.recv() {
                Ok(op) => op,
                Err(_) => return,
            },
        };
        let started = Instant::now();
        if failed.is_none() {
            // An fdatasync failed: refuse from now on rather than write more.
            failed = failure.lock().expect("failure lock").clone();
        }
        let mut roll = None;
        let mut stopping = false;
        let mut op = Some(first);
        // The batch's oldest record: how long it waited before its batch was written.
        let mut oldest = Instant::now();
        // Collect one batch.
        while let Some(next) = op.take() {
            match next {
                Op::Roll(done) => {
                    roll = Some(done);
                    break;
                }
                Op::Stop => {
                    stopping = true;
                    break;
                }
                Op::Append(record, done, queued) => {
                    let record_len = encoded_len(&record);
                    let len = record_len - RECORD_HEADER_BYTES;
                    if let Some(why) = &failed {
                        let why = why.clone();
                        complete(Box::new(move || done(Err(JournalError::Failed(why)))));
                    } else if len > RECORD_BYTES_MAX {
                        let max = RECORD_BYTES_MAX;
                        complete(Box::new(move || {
                            done(Err(JournalError::TooLarge { len, max }))
                        }));
                    } else {
                        if writer.len + (batch.len + record_len) as u64 > opts.file_bytes_max
                            && writer.len + batch.len as u64 > FILE_HEADER_BYTES
                        {
                            if roll_refused_at.is_some_and(|at| at.elapsed() < ROLL_RETRY) {
                                // The next file could not be started for want of space a
                                // moment ago: refused, not queued behind a roll that fails;
                                // after the records before it are answered (the batch they
                                // are in is written first).
                                if batch.is_empty() {
                                    let why = "the next journal file could not be started".into();
                                    complete(Box::new(move || {
                                        done(Err(JournalError::NoSpace(why)))
                                    }));
                                } else {
                                    pending_op = Some(Op::Append(record, done, queued));
                                    break;
                                }
                            } else {
                                // This record starts the next file: flush this batch first.
                                pending_op = Some(Op::Append(record, done, queued));
                                roll_after_flush(&mut roll);
                                break;
                            }
                        } else {
                            let pos = Position {
                                file: writer.seq,
                                offset: writer.len + batch.len as u64,
                            };
                            batch.push(writer.seq, &record);
                            waiting.push((pos, done));
                            oldest = oldest.min(queued);
                        }
                    }
                }
            }
            if batch.len >= opts.batch_bytes_max {
                break;
            }
            op = match rx.try_recv() {
                Ok(op) => Some(op),
                Err(TryRecvError::Empty) => {
                    // Nothing more queued. Flush now unless a delay is configured and left.
                    let left = delay.saturating_sub(started.elapsed());
                    if left.is_zero() || waiting.is_empty() {
                        None
                    } else {
                        match rx.recv_timeout(left) {
                            Ok(op) => Some(op),
                            Err(RecvTimeoutError::Timeout) => None,
                            Err(RecvTimeoutError::Disconnected) => None,
                        }
                    }
                }
                Err(TryRecvError::Disconnected) => None,
            };
        }
        if !batch.is_empty() {
            let write_started = Instant::now();
            queue_latency.record(write_started.duration_since(oldest).as_secs_f64());
            let result = writer.write_batch(&batch);
            let written = Instant::now();
            write_latency.record(written.duration_since(write_started).as_secs_f64());
            batch_records.record(waiting.len() as f64);
            stats.flushes.fetch_add(1, Ordering::Relaxed);
            stats
                .records
                .fetch_add(waiting.len() as u64, Ordering::Relaxed);
            stats.bytes.fetch_add(batch.len as u64, Ordering::Relaxed);
            stats.file_len.store(writer.len, Ordering::Relaxed);
            batch.clear();
            let answered = std::mem::take(&mut waiting);
            match result {
                Ok(()) => {
                    let job = SyncJob::Written {
                        file: Arc::clone(&writer.file),
                        path: writer.path.clone(),
                        waiters: answered,
                        written,
                    };
                    if let Err(mpsc::SendError(SyncJob::Written { waiters, .. })) = syncs.send(job)
                    {
                        for (_, done) in waiters {
                            done(Err(JournalError::Failed(
                                "the journal's sync thread stopped".into(),
                            )));
                        }
                    }
                }
                Err(JournalError::NoSpace(why)) => {
                    // Nothing of the batch was written: the next batch starts where it would
                    // have.
                    tracing::warn!(error = %why, records = answered.len(), "journal batch refused: no space on the disk");
                    complete(Box::new(move || {
                        for (_, done) in answered {
                            done(Err(JournalError::NoSpace(why.clone())));
                        }
                    }));
                }
                Err(e) => {
                    let why = e.to_string();
                    tracing::error!(error = %why, "journal write failed; the journal is read-only from now on");
                    failed = Some(why.clone());
                    failure
                        .lock()
                        .expect("failure lock")
                        .get_or_insert_with(|| why.clone());
                    complete(Box::new(move || {
                        for (_, done) in answered {
                            done(Err(JournalError::Failed(why.clone())));
                        }
                    }));
                }
            }
        }
        if let Some(done) = roll {
            let result = match &failed {
                Some(why) => Err(JournalError::Failed(why.clone())),
                None => Writer::create(&opts, writer.seq + 1).map(|w| {
                    writer = w;
                    writer.seq
                }),
            };
            match &result {
                // The disk is full: the current file stays; records that need the next one
                // are refused until a roll succeeds (tried again after ROLL_RETRY). Said once
                // when it starts and once when it ends, not at every try.
                Err(e) if is_no_space(e) => {
                    if roll_refused_since.is_none() {
                        tracing::warn!(error = %e, "the next journal file cannot be started: no space on the disk; records that need it are refused until it can");
                        roll_refused_since = Some(Instant::now());
                    }
                    roll_refused_at = Some(Instant::now());
                }
                Err(e) => {
                    failed.get_or_insert_with(|| e.to_string());
                }
                Ok(_) => {
                    if let Some(since) = roll_refused_since.take() {
                        tracing::info!(
                            refused_ms = since.elapsed().as_millis() as u64,
                            "the next journal file started after a time without space"
                        );
                    }
                    roll_refused_at = None;
                }
            }
            // After the callbacks of everything written before the roll.
            complete(Box::new(move || done(result)));
        }
        if stopping {
            return;
        }
    }
}

/// A size-triggered roll: no one waits for its answer.
fn roll_after_flush(roll: &mut Option<RollDone>) {
    if roll.is_none() {
        *roll = Some(Box::new(|r| {
            match r {
                // Logged by the journal's loop, once per time without space.
                Err(e) if is_no_space(&e) => {}
                Err(e) => tracing::error!(error = %e, "starting the next journal file failed"),
                Ok(_) => {}
            }
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::sync::{Arc, Mutex};

    fn opts(dir: &Path) -> JournalOptions {
        JournalOptions {
            dir: dir.to_path_buf(),
            batch_bytes_max: 64 << 10,
            flush_delay_us: 0,
            file_bytes_max: 1 << 20,
            preallocate_bytes: 256 << 10,
            prefill: false,
            drop_synced_pages: false,
            queue_records_max: 1024,
            fsync: true,
        }
    }

    fn rec(ledger: u64, entry: u64, len: usize) -> Record {
        Record {
            kind: RecordKind::Add,
            ledger_id: ledger,
            entry_id: entry,
            data: (0..len).map(|i| (i as u64 + entry) as u8).collect(),
            tail: bytes::Bytes::new(),
        }
    }

    /// Appends `records` and waits for every acknowledgement.
    fn write_all(o: JournalOptions, records: &[Record]) -> Vec<Position> {
        let (journal, thread) = Journal::start(o).expect("journal starts");
        let (tx, rx) = mpsc::channel();
        for (i, r) in records.iter().enumerate() {
            let tx = tx.clone();
            journal.append(
                r.clone(),
                Box::new(move |res| {
                    tx.send((i, res.expect("append acknowledged")))
                        .expect("send")
                }),
            );
        }
        drop(journal);
        thread.join();
        let mut got: Vec<(usize, Position)> = rx.try_iter().collect();
        got.sort();
        assert_eq!(got.len(), records.len(), "every append was answered");
        got.into_iter().map(|(_, p)| p).collect()
    }

    fn read_back(dir: &Path) -> (Vec<(Position, Record)>, Vec<FileReplay>) {
        let mut out = Vec::new();
        let report = replay(dir, 0, |_| false, |p, r| out.push((p, r))).expect("replay");
        (out, report)
    }

    fn prefilled(dir: &Path, file_bytes_max: u64) -> JournalOptions {
        JournalOptions {
            file_bytes_max,
            prefill: true,
            drop_synced_pages: false,
            ..opts(dir)
        }
    }

    #[test]
    fn given_a_slow_callback_when_more_records_come_then_they_are_written_meanwhile_and_answered_after_it(
    ) {
        use std::sync::atomic::AtomicBool;
        let dir = tempfile::tempdir().expect("tempdir");
        let (journal, thread) = Journal::start(opts(dir.path())).expect("journal starts");
        let (started_tx, started_rx) = mpsc::channel();
        let (seen_tx, seen_rx) = mpsc::channel();
        let first_done = Arc::new(AtomicBool::new(false));
        let (j, f) = (journal.clone(), Arc::clone(&first_done));
        journal.append(
            rec(1, 0, 100),
            Box::new(move |r| {
                r.expect("first record acknowledged");
                started_tx.send(()).expect("send");
                // Holds its batch's callbacks until a second batch is written (or 10 s pass).
                let deadline = Instant::now() + Duration::from_secs(10);
                while j.stats().flushes.load(Ordering::Relaxed) < 2 && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
                seen_tx
                    .send(j.stats().flushes.load(Ordering::Relaxed))
                    .expect("send");
                f.store(true, Ordering::SeqCst);
            }),
        );
        started_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the first callback runs");
        let (second_tx, second_rx) = mpsc::channel();
        let f = Arc::clone(&first_done);
        journal.append(
            rec(1, 1, 100),
            Box::new(move |r| {
                second_tx
                    .send((r.is_ok(), f.load(Ordering::SeqCst)))
                    .expect("send");
            }),
        );
        let flushes = seen_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the first callback ends");
        assert_eq!(
            flushes, 2,
            "the second batch was written while the first batch's callback ran"
        );
        let (ok, after_first) = second_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the second callback runs");
        assert!(ok, "second record acknowledged");
        assert!(after_first, "callbacks run in journal order");
        drop(journal);
        thread.join();
    }

    #[test]
    fn given_prefill_when_a_fresh_journal_starts_then_its_first_file_is_zeroes_of_full_size() {
        let dir = tempfile::tempdir().expect("tempdir");
        let records: Vec<Record> = (0..50).map(|i| rec(3, i, 100)).collect();
        let positions = write_all(prefilled(dir.path(), 4 << 20), &records);
        let files = list_files(dir.path()).expect("list");
        assert_eq!(files.len(), 1);
        let len = fs::metadata(&files[0].1).expect("metadata").len();
        assert_eq!(len, 4 << 20, "appends overwrote the zero-filled file");
        let (replayed, report) = read_back(dir.path());
        assert_eq!(replayed.len(), 50);
        assert_eq!(
            replayed.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
            positions
        );
        assert_eq!(report[0].damage, None, "zeroes follow the records");
        assert!(!spare_ready(dir.path()), "the spare became the first file");
    }

    #[test]
    fn given_a_recycled_file_when_replayed_then_only_its_new_records_return() {
        let dir = tempfile::tempdir().expect("tempdir");
        let o = prefilled(dir.path(), 2 << 20);
        // File 1 full of old records (the rest went into file 2), then retired as the spare.
        let old: Vec<Record> = (0..1100).map(|i| rec(1, i, 2000)).collect();
        write_all(o.clone(), &old);
        let (first, _) = list_files(dir.path()).expect("list")[0].clone();
        assert_eq!(first, 1);
        let mut files = list_files(dir.path()).expect("list");
        assert!(files.len() >= 2, "2 MiB files rotate: {files:?}");
        let (_, path1) = files.remove(0);
        retire(dir.path(), &path1, o.file_bytes_max, true).expect("retire");
        assert!(spare_ready(dir.path()), "a full file is recycled");
        for (_, p) in files {
            fs::remove_file(p).expect("remove");
        }
        // The next journal writes far fewer records of the same size into the recycled file:
        // its records end where an old one starts, and that one must not verify.
        let new: Vec<Record> = (0..10).map(|i| rec(2, i, 2000)).collect();
        write_all(o.clone(), &new);
        let files = list_files(dir.path()).expect("list");
        assert_eq!(files.len(), 1);
        assert_eq!(
            files[0].0, 2,
            "no sequence is used twice, even with no file left"
        );
        assert!(fs::metadata(&files[0].1).expect("metadata").len() >= 1 << 20);
        let (replayed, report) = read_back(dir.path());
        assert_eq!(
            replayed.into_iter().map(|(_, r)| r).collect::<Vec<_>>(),
            new,
            "the old records under the new header do not verify"
        );
        assert!(
            matches!(report[0].damage, Some(TailDamage::Checksum { .. })),
            "{report:?}"
        );
        // Replay truncated the file at its last record: a second replay finds the same.
        let (again, report) = read_back(dir.path());
        assert_eq!(again.len(), 10);
        assert_eq!(report[0].damage, None);
    }

    #[test]
    fn given_a_file_larger_than_a_read_chunk_when_replayed_then_records_across_chunks_return() {
        let dir = tempfile::tempdir().expect("tempdir");
        let o = JournalOptions {
            batch_bytes_max: 1 << 20,
            ..prefilled(dir.path(), 24 << 20)
        };
        // About 18 MiB of odd-sized records: several cross the 8 MiB read chunks.
        let records: Vec<Record> = (0..6000)
            .map(|i| rec(5, i, 3001 + (i % 7) as usize))
            .collect();
        let positions = write_all(o, &records);
        let (replayed, report) = read_back(dir.path());
        assert_eq!(report.len(), 1);
        assert_eq!(
            replayed.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
            positions
        );
        assert_eq!(
            replayed.into_iter().map(|(_, r)| r).collect::<Vec<_>>(),
            records
        );
    }

    #[test]
    fn given_a_spare_prepared_in_steps_then_it_is_ready_only_when_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let max = 3 << 20;
        assert!(!prepare_spare(dir.path(), max, 1 << 20).expect("step 1"));
        assert!(!prepare_spare(dir.path(), max, 1 << 20).expect("step 2"));
        assert!(!spare_ready(dir.path()));
        assert!(prepare_spare(dir.path(), max, 1 << 20).expect("step 3"));
        assert!(spare_ready(dir.path()));
        let spare = dir.path().join(SPARE_NAME);
        assert_eq!(fs::metadata(&spare).expect("metadata").len(), max);
        // Not a journal file: replay skips it.
        let (replayed, report) = read_back(dir.path());
        assert!(replayed.is_empty() && report.is_empty());
        // A short file is removed, not recycled, and the spare stays.
        let short = dir.path().join(file_name(9));
        fs::write(&short, header(9)).expect("write");
        retire(dir.path(), &short, max, true).expect("retire");
        assert!(!short.exists() && spare_ready(dir.path()));
    }

    #[test]
    fn given_a_record_with_a_tail_when_replayed_then_the_tail_ends_its_data() {
        let dir = tempfile::tempdir().expect("tempdir");
        let with_tail = Record {
            tail: bytes::Bytes::from_static(b"-and-the-entry"),
            ..rec(4, 1, 5)
        };
        let plain = rec(4, 2, 9);
        write_all(opts(dir.path()), &[with_tail.clone(), plain.clone()]);
        let (replayed, report) = read_back(dir.path());
        assert_eq!(report[0].damage, None);
        let mut whole = with_tail.data.clone();
        whole.extend_from_slice(b"-and-the-entry");
        assert_eq!(replayed[0].1.data, whole);
        assert!(replayed[0].1.tail.is_empty());
        assert_eq!(replayed[1].1, plain);
    }

    #[test]
    fn given_large_tails_among_small_records_when_replayed_then_every_byte_is_in_place() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        // Tails at, around and far above the size written from its own buffer, between
        // records copied whole, in batches large enough to take many of them.
        let records: Vec<Record> = (0..300u64)
            .map(|i| {
                let len = match i % 5 {
                    0 => GATHER_TAIL_MIN,
                    1 => GATHER_TAIL_MIN - 1,
                    2 => rng.gen_range(GATHER_TAIL_MIN..200_000),
                    3 => 0,
                    _ => rng.gen_range(1..3000),
                };
                let tail: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
                Record {
                    tail: tail.into(),
                    ..rec(6, i, (i as usize * 13) % 50)
                }
            })
            .collect();
        let o = JournalOptions {
            batch_bytes_max: 4 << 20,
            ..opts(dir.path())
        };
        let positions = write_all(o, &records);
        let (replayed, report) = read_back(dir.path());
        assert!(report.iter().all(|f| f.damage.is_none()), "{report:?}");
        assert_eq!(replayed.len(), records.len());
        for ((pos, got), (want, at)) in replayed.iter().zip(records.iter().zip(&positions)) {
            let mut whole = want.data.clone();
            whole.extend_from_slice(&want.tail);
            assert_eq!(got.data, whole, "record {}", want.entry_id);
            assert_eq!(pos, at);
        }
    }

    #[test]
    fn given_batches_written_while_an_fdatasync_runs_then_one_fdatasync_covers_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Small batches, and the first callback holds the completion thread until 100 batches
        // are written: the sync thread then waits on the completion queue with batches queued
        // behind it, so however fast this disk syncs, later fdatasyncs must cover several.
        let o = JournalOptions {
            batch_bytes_max: 8 << 10,
            queue_records_max: 4096,
            ..opts(dir.path())
        };
        let (journal, thread) = Journal::start(o).expect("journal starts");
        let stats = Arc::clone(&journal.stats);
        let answered = Arc::new(Mutex::new(Vec::new()));
        let records: Vec<Record> = (0..2000).map(|i| rec(3, i, 4000)).collect();
        for (i, r) in records.iter().enumerate() {
            let answered = Arc::clone(&answered);
            let stats = Arc::clone(&stats);
            journal.append(
                r.clone(),
                Box::new(move |res| {
                    res.expect("append acknowledged");
                    if i == 0 {
                        let deadline = Instant::now() + Duration::from_secs(20);
                        while stats.flushes.load(Ordering::Relaxed) < 100
                            && Instant::now() < deadline
                        {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                    answered.lock().expect("lock").push(i);
                }),
            );
        }
        drop(journal);
        thread.join();
        let flushes = stats.flushes.load(Ordering::Relaxed);
        let syncs = stats.syncs.load(Ordering::Relaxed);
        assert!(flushes >= 600, "{flushes} batches");
        assert!(syncs < flushes, "{syncs} fdatasyncs for {flushes} batches");
        // Answered in journal order, every one, and all of it replays.
        assert_eq!(
            *answered.lock().expect("lock"),
            (0..2000).collect::<Vec<_>>()
        );
        let (replayed, _) = read_back(dir.path());
        assert_eq!(
            replayed.into_iter().map(|(_, r)| r).collect::<Vec<_>>(),
            records
        );
    }

    #[test]
    fn given_more_slices_than_one_writev_takes_then_all_are_written_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("v");
        let parts: Vec<Vec<u8>> = (0..3000u32)
            .map(|i| i.to_le_bytes().repeat(1 + i as usize % 7))
            .collect();
        let mut slices: Vec<io::IoSlice<'_>> = parts.iter().map(|p| io::IoSlice::new(p)).collect();
        let f = File::create(&path).expect("create");
        write_all_vectored(&f, &mut slices).expect("write");
        assert_eq!(fs::read(&path).expect("read"), parts.concat());
    }

    #[test]
    fn given_acknowledged_appends_when_replayed_then_every_record_returns_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let records: Vec<Record> = (0..1200)
            .map(|i| rec(7, i, (i as usize * 37) % 3000))
            .collect();
        let positions = write_all(opts(dir.path()), &records);
        let (replayed, report) = read_back(dir.path());
        assert_eq!(
            replayed.iter().map(|(_, r)| r.clone()).collect::<Vec<_>>(),
            records
        );
        assert_eq!(
            replayed.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
            positions
        );
        assert!(report.iter().all(|f| f.damage.is_none()), "{report:?}");
        assert!(report.len() > 1, "1 MiB files rotate: {report:?}");
    }

    #[test]
    fn given_torn_tail_when_replayed_then_good_records_return_and_file_is_truncated() {
        let dir = tempfile::tempdir().expect("tempdir");
        let records: Vec<Record> = (0..20).map(|i| rec(1, i, 100)).collect();
        write_all(opts(dir.path()), &records);
        let (_, path) = list_files(dir.path()).expect("list").pop().expect("a file");
        let full = fs::read(&path).expect("read");
        let end = read_back(dir.path()).1[0].end as usize;
        // Cut the last record in half: a write the crash interrupted.
        let cut = end - 50;
        fs::write(&path, &full[..cut]).expect("write");
        let (replayed, report) = read_back(dir.path());
        assert_eq!(replayed.len(), 19);
        assert!(
            matches!(report[0].damage, Some(TailDamage::Short { .. })),
            "{report:?}"
        );
        let len_after = fs::metadata(&path).expect("stat").len();
        assert_eq!(
            len_after, report[0].end,
            "truncated at the last good record"
        );
        // A second replay finds a clean file.
        let (again, report) = read_back(dir.path());
        assert_eq!(again.len(), 19);
        assert_eq!(report[0].damage, None);
        // A new journal continues in a new file; both replay.
        write_all(opts(dir.path()), &[rec(2, 0, 10)]);
        let (all, report) = read_back(dir.path());
        assert_eq!(all.len(), 20);
        assert_eq!(report.len(), 2);
    }

    #[test]
    fn given_a_damaged_file_that_holds_indexed_entries_when_replayed_then_it_is_left_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let records: Vec<Record> = (0..20).map(|i| rec(1, i, 100)).collect();
        write_all(opts(dir.path()), &records);
        let (seq, path) = list_files(dir.path()).expect("list").pop().expect("a file");
        let mut bytes = fs::read(&path).expect("read");
        let end = read_back(dir.path()).1[0].end as usize;
        // A damaged record in the middle: what follows it stays on disk for the index.
        bytes[end / 2] ^= 0xff;
        fs::write(&path, &bytes).expect("write");
        let mut got = 0;
        let report = replay(dir.path(), 0, |s| s == seq, |_, _| got += 1).expect("replay");
        assert!(got < 20 && report[0].damage.is_some(), "{got} {report:?}");
        assert_eq!(fs::metadata(&path).expect("stat").len(), bytes.len() as u64);
        // Without indexed entries in it, the same file is truncated at the damage.
        replay(dir.path(), 0, |_| false, |_, _| {}).expect("replay");
        assert_eq!(fs::metadata(&path).expect("stat").len(), report[0].end);
        // Files before `from` are not read at all.
        let mut later = 0;
        replay(dir.path(), seq + 1, |_| false, |_, _| later += 1).expect("replay");
        assert_eq!(later, 0);
    }

    #[test]
    fn given_steps_larger_than_a_file_then_no_file_reserves_more_than_it_may_hold() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let o = JournalOptions {
            file_bytes_max: 1 << 20,
            preallocate_bytes: 4 << 20,
            ..opts(dir.path())
        };
        let records: Vec<Record> = (0..300).map(|i| rec(1, i, 10_000)).collect();
        write_all(o, &records);
        let files = list_files(dir.path()).expect("list");
        assert!(files.len() >= 2, "{files:?}");
        for (_, path) in files {
            let allocated = fs::metadata(&path).expect("stat").blocks() * 512;
            // A file ends at most one batch past the limit; blocks round up to 4 KiB.
            assert!(
                allocated <= (1 << 20) + (64 << 10),
                "{}: {allocated} bytes allocated",
                path.display()
            );
        }
    }

    #[test]
    fn given_flipped_byte_when_replayed_then_checksum_stops_the_file_there() {
        let dir = tempfile::tempdir().expect("tempdir");
        let records: Vec<Record> = (0..10).map(|i| rec(3, i, 64)).collect();
        let positions = write_all(opts(dir.path()), &records);
        let (_, path) = list_files(dir.path()).expect("list").pop().expect("a file");
        let mut bytes = fs::read(&path).expect("read");
        let at = positions[6].offset as usize + RECORD_HEADER_BYTES + 20;
        bytes[at] ^= 0x40;
        fs::write(&path, &bytes).expect("write");
        let (replayed, report) = read_back(dir.path());
        assert_eq!(replayed.len(), 6, "records before the damaged one");
        assert!(matches!(
            report[0].damage,
            Some(TailDamage::Checksum { .. })
        ));
        assert_eq!(report[0].end, positions[6].offset);
    }

    #[test]
    fn given_bytes_of_another_file_then_they_do_not_verify() {
        // A record is bound to its file's sequence number.
        let mut buf = header(5).to_vec();
        encode_into(&mut buf, 5, &rec(1, 1, 10));
        assert_eq!(decode_file(5, &buf).records.len(), 1);
        let mut other = header(6).to_vec();
        other.extend_from_slice(&buf[16..]);
        let d = decode_file(6, &other);
        assert!(d.records.is_empty());
        assert!(matches!(d.damage, Some(TailDamage::Checksum { .. })));
    }

    #[test]
    fn given_random_garbage_then_decode_never_panics_and_keeps_whole_records_only() {
        let seed: u64 = rand::random();
        println!("seed {seed}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for _ in 0..2_000 {
            let mut buf = header(1).to_vec();
            let n = rng.gen_range(0..5);
            for i in 0..n {
                encode_into(&mut buf, 1, &rec(1, i, rng.gen_range(0..100)));
            }
            let good = buf.len();
            match rng.gen_range(0..3) {
                0 => buf.truncate(rng.gen_range(16..=good)),
                1 => {
                    let extra: Vec<u8> = (0..rng.gen_range(1..64)).map(|_| rng.gen()).collect();
                    buf.extend_from_slice(&extra);
                }
                _ => {
                    if good > 16 {
                        let at = rng.gen_range(16..good);
                        buf[at] = rng.gen();
                    }
                }
            }
            let d = decode_file(1, &buf);
            assert!(d.end as usize <= buf.len(), "seed {seed}");
            assert!(d.records.len() <= n as usize, "seed {seed}");
            for (i, (_, r)) in d.records.iter().enumerate() {
                assert_eq!(r.entry_id, i as u64, "seed {seed}");
            }
        }
    }

    #[test]
    fn given_many_appends_with_a_flush_delay_then_one_fsync_covers_many_records() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut o = opts(dir.path());
        o.flush_delay_us = 20_000;
        o.batch_bytes_max = 1 << 20;
        let (journal, thread) = Journal::start(o).expect("journal");
        let order = Arc::new(Mutex::new(Vec::new()));
        for i in 0..1000u64 {
            let order = Arc::clone(&order);
            journal.append(
                rec(9, i, 10),
                Box::new(move |r| {
                    r.expect("ok");
                    order.lock().expect("lock").push(i);
                }),
            );
        }
        let rolled = Arc::new(Mutex::new(None));
        let r = Arc::clone(&rolled);
        journal.roll(Box::new(move |seq| {
            *r.lock().expect("lock") = Some(seq.expect("rolled"));
        }));
        let stats = Arc::clone(&journal.stats);
        drop(journal);
        thread.join();
        let order = order.lock().expect("lock").clone();
        assert_eq!(
            order,
            (0..1000).collect::<Vec<_>>(),
            "acknowledged in append order"
        );
        // Appends queued within the delay share batches: far fewer than one each.
        let flushes = stats.flushes.load(Ordering::Relaxed);
        assert!(
            (1..=10).contains(&flushes),
            "{flushes} batches for 1,000 appends"
        );
        assert_eq!(stats.records.load(Ordering::Relaxed), 1000);
        assert_eq!(
            *rolled.lock().expect("lock"),
            Some(2),
            "rolled to the second file"
        );
        let (replayed, report) = read_back(dir.path());
        assert_eq!(replayed.len(), 1000);
        assert_eq!(report.len(), 2, "the roll started a second (empty) file");
    }

    #[test]
    fn given_foreign_file_with_journal_name_then_replay_refuses_it_by_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(file_name(3));
        fs::write(&path, b"this is not a journal file at all").expect("write");
        let err = replay(dir.path(), 0, |_| false, |_, _| {}).expect_err("bad header");
        assert!(
            err.to_string().contains("journal-0000000000000003.log"),
            "{err}"
        );
    }
}
