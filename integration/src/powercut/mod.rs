//! A power-loss file system for tests (after Jepsen's LazyFS).
//!
//! [`PowerCutFs::mount`] mounts, with FUSE, a directory whose file contents stay in memory
//! until `fsync`, `fdatasync` or an `O_SYNC`/`O_DSYNC` write makes them durable (writes them
//! to a backing directory). [`PowerCutFs::cut`] then does what a power cut does to a machine
//! whose processes were killed: everything not synced is gone. [`PowerCutFs::cut_torn`] also
//! keeps a random prefix of the last unsynced write, as a disk that tore it would;
//! [`PowerCutFs::cut_partial`] keeps a random half of the unsynced pages, as a page cache that
//! had written some of them back would.
//!
//! kill -9 leaves the page cache to the kernel, so a test that only kills processes cannot see a
//! missing fsync; a test that kills them and then cuts power here can.
//!
//! ```text
//!   process ──write──► FUSE ──► Pending pages (memory) ──fsync──► backing file
//!                                     │
//!   test: kill -9 every process, cut()┘ dropped
//! ```
//!
//! Names (create, rename, unlink, mkdir) are durable only once their directory is fsynced
//! (`names.rs`); a cut undoes the others. [`PowerCutFs::set_full`] makes the disk full.

mod fuse;
mod names;
pub mod pending;

pub use fuse::Counters;
pub use names::NamesUndone;

use anyhow::{bail, Context};
use fuse::{PowerCutFuse, State};
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// A mounted power-loss file system. Dropping it unmounts; kill the processes using it first.
pub struct PowerCutFs {
    state: Arc<Mutex<State>>,
    session: Option<fuser::BackgroundSession>,
    pub mountpoint: PathBuf,
    pub backing: PathBuf,
}

/// What a cut dropped.
#[derive(Debug, Clone, Default)]
pub struct CutReport {
    /// Files that had unsynced bytes.
    pub files: usize,
    /// Pending bytes dropped (whole pages).
    pub bytes: u64,
    /// For a torn cut: bytes of the last unsynced write that were kept.
    pub torn_kept: Option<usize>,
    /// For a partial cut: unsynced pages that reached the disk.
    pub pages_kept: Option<usize>,
    /// Creations, removals and renames whose directory was not fsynced, undone.
    pub names: NamesUndone,
}

impl PowerCutFs {
    /// Why FUSE cannot be used here, if it cannot.
    pub fn unavailable() -> Option<String> {
        if !Path::new("/dev/fuse").exists() {
            return Some("no /dev/fuse".to_string());
        }
        let root = rustix::process::geteuid().is_root();
        let fusermount = std::env::var_os("PATH").is_some_and(|paths| {
            std::env::split_paths(&paths).any(|d| d.join("fusermount3").exists())
        });
        if !root && !fusermount {
            return Some("not root and no fusermount3 (Debian package fuse3)".to_string());
        }
        None
    }

    /// Mounts at `mountpoint` (an empty directory) with `backing` (a directory) holding what is
    /// durable.
    pub fn mount(backing: &Path, mountpoint: &Path) -> anyhow::Result<Self> {
        if let Some(why) = Self::unavailable() {
            bail!("FUSE unavailable: {why}");
        }
        std::fs::create_dir_all(backing)?;
        std::fs::create_dir_all(mountpoint)?;
        let backing = backing.canonicalize()?;
        let trash = backing.with_file_name(format!(
            ".{}.powercut-trash",
            backing
                .file_name()
                .map_or("backing".into(), |n| n.to_string_lossy())
        ));
        let state = Arc::new(Mutex::new(State::new(backing.clone(), trash)?));
        let fs = PowerCutFuse {
            state: state.clone(),
        };
        let options = vec![
            fuser::MountOption::FSName("meridian-powercut".to_string()),
            fuser::MountOption::Subtype("powercut".to_string()),
        ];
        // No AutoUnmount: fuser adds allow_other with it, which fusermount3 refuses to users
        // unless /etc/fuse.conf allows it; Drop unmounts (lazily if still busy).
        let session = fuser::spawn_mount2(fs, mountpoint, &options)
            .with_context(|| format!("mounting the power-loss file system at {mountpoint:?}"))?;
        Ok(Self {
            state,
            session: Some(session),
            mountpoint: mountpoint.to_path_buf(),
            backing,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops every unsynced byte. Kill the processes on the mount first: a power cut is
    /// instantaneous, and a process that went on writing after it would not be one.
    pub fn cut(&self) -> CutReport {
        let mut st = self.lock();
        let mut report = CutReport {
            files: st.pending.len(),
            bytes: st.pending.values().map(|p| p.pending_bytes()).sum(),
            torn_kept: None,
            pages_kept: None,
            names: NamesUndone::default(),
        };
        st.pending.clear();
        st.last_writes.clear();
        st.counters.cuts += 1;
        st.counters.bytes_dropped += report.bytes;
        report.names = st.undo_names();
        report
    }

    /// A cut that keeps a random prefix (chosen by `seed`) of the last write not synced since
    /// (over all files), written over its file's durable bytes.
    pub fn cut_torn(&self, seed: u64) -> anyhow::Result<CutReport> {
        let mut torn_kept = None;
        {
            let mut st = self.lock();
            // The newest among files that still have a name (an unlinked file is gone anyway).
            let last = st
                .last_writes
                .iter()
                .filter(|(&ino, _)| st.backing(ino).is_ok())
                .max_by_key(|(_, w)| w.seq)
                .map(|(&ino, _)| ino);
            if let Some((path, w)) =
                last.and_then(|ino| Some((st.backing(ino).ok()?, st.last_writes.remove(&ino)?)))
            {
                let keep =
                    rand::rngs::StdRng::seed_from_u64(seed).gen_range(0..w.data.len().max(1));
                let file = std::fs::OpenOptions::new().write(true).open(&path)?;
                std::os::unix::fs::FileExt::write_all_at(&file, &w.data[..keep], w.off)?;
                torn_kept = Some(keep);
            }
        }
        // Then the rest is dropped and names not committed are undone (the torn file too, if
        // its own creation was not).
        let mut report = self.cut();
        report.torn_kept = torn_kept;
        Ok(report)
    }

    /// A cut after which each unsynced page reached the disk with probability one half (chosen
    /// by `seed`), in no particular order, as a page cache writing back dirty pages would
    /// leave it; truncations since the last sync are lost.
    pub fn cut_partial(&self, seed: u64) -> anyhow::Result<CutReport> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut kept_pages = 0;
        {
            let st = self.lock();
            let mut inos: Vec<u64> = st.pending.keys().copied().collect();
            inos.sort_unstable();
            for ino in inos {
                let Ok(path) = st.backing(ino) else { continue };
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .read(true)
                    .open(&path)?;
                kept_pages += st.pending[&ino].apply_some(&mut file, |_| rng.gen_bool(0.5))?;
            }
        }
        let mut report = self.cut();
        report.pages_kept = Some(kept_pages);
        Ok(report)
    }

    /// Makes the disk full (`true`) or gives it its space back: while full, writes past a
    /// file's end, space reservations, new files and directories fail with ENOSPC, and
    /// `statfs` shows no free block. Overwrites, reads, syncs and removals go on.
    pub fn set_full(&self, full: bool) {
        self.lock().full = full;
    }

    pub fn counters(&self) -> Counters {
        self.lock().counters
    }

    /// Bytes written but not yet synced, over all files.
    pub fn pending_bytes(&self) -> u64 {
        self.lock()
            .pending
            .values()
            .map(|p| p.pending_bytes())
            .sum()
    }
}

impl Drop for PowerCutFs {
    fn drop(&mut self) {
        drop(self.session.take());
        // A process still holding a file open (a test that failed before stopping it) keeps
        // the mount busy: detach it, so no dead mount outlives the test.
        if is_mounted(&self.mountpoint) {
            detach(&self.mountpoint);
        }
    }
}

/// Detaches the mount at `mountpoint` now, lazily: one still busy (or whose server is gone)
/// goes when its last user lets go.
pub fn detach(mountpoint: &Path) {
    let (cmd, args): (&str, &[&str]) = if rustix::process::geteuid().is_root() {
        ("umount", &["-l"])
    } else {
        ("fusermount3", &["-u", "-z"])
    };
    let _ = std::process::Command::new(cmd)
        .args(args)
        .arg(mountpoint)
        .status();
}

/// The mount points under `dir` now (from /proc/self/mountinfo), deepest first.
pub fn mounts_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let Ok(dir) = dir.canonicalize() else {
        return Vec::new();
    };
    let mut found: Vec<std::path::PathBuf> = mount_points()
        .filter(|mp| mp.starts_with(&dir) && mp != &dir)
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found
}

/// A mount point as mountinfo writes it: space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .and_then(|d| {
                let v = d.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0'));
                u8::try_from(v).ok()
            });
        match (b[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `path` is a mount point now (from /proc/self/mountinfo).
fn is_mounted(path: &Path) -> bool {
    // The parent, not the mount point: a mount whose server is gone cannot be stat'ed.
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return false;
    };
    let Ok(path) = parent.canonicalize().map(|p| p.join(name)) else {
        return false;
    };
    mount_points().any(|mp| mp == path)
}

/// Every mount point now (from /proc/self/mountinfo; none when it cannot be read).
fn mount_points() -> impl Iterator<Item = std::path::PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|mp| std::path::PathBuf::from(unescape_mountinfo(mp)))
        .collect::<Vec<_>>()
        .into_iter()
}

#[cfg(test)]
mod tests {
    use super::unescape_mountinfo;

    #[test]
    fn given_mountinfo_escapes_then_the_path_is_what_was_mounted() {
        assert_eq!(unescape_mountinfo("/tmp/a\\040b"), "/tmp/a b");
        assert_eq!(unescape_mountinfo("/tmp/tab\\011x\\134y"), "/tmp/tab\tx\\y");
        // Not an escape: kept as it is.
        assert_eq!(unescape_mountinfo("/tmp/a\\9b\\"), "/tmp/a\\9b\\");
        assert_eq!(unescape_mountinfo("/tmp/\\777"), "/tmp/\\777");
    }
}
