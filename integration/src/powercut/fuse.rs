//! The FUSE side of the power-loss file system: a pass-through to a backing directory whose
//! file contents change only when a sync says so. Writes, truncations and `fallocate`s are
//! kept in memory per inode ([`Pending`]) and read back from there; `fsync`, `fdatasync` and
//! writes through an `O_SYNC`/`O_DSYNC` descriptor write them to the backing file. Names
//! (create, rename, unlink, mkdir) go to the backing directory at once and are recorded
//! ([`Names`]) until an fsync of their directory commits them; a cut undoes the rest.
//!
//! Every request runs on fuser's one session thread under the [`State`] lock, which the test's
//! thread also takes to cut power.

use super::names::{Names, NamesUndone};
use super::pending::{Durable, Pending};
use fuser::{
    FileAttr, FileType, Filesystem, KernelConfig, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow,
};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Attributes and names are never cached by the kernel: a cut changes sizes behind its back.
const TTL: Duration = Duration::ZERO;
const ROOT_INO: u64 = 1;

/// An open file: the backing file (always read-write, the process runs as root) and whether
/// every write through it is synchronous.
struct Handle {
    ino: u64,
    file: File,
    sync_writes: bool,
}

/// A file's last write not yet synced, for a torn cut.
pub(super) struct LastWrite {
    /// Order of the writes over all files.
    pub seq: u64,
    pub off: u64,
    pub data: Vec<u8>,
}

/// Counters of what the file system saw.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counters {
    pub writes: u64,
    pub bytes_written: u64,
    pub syncs: u64,
    pub cuts: u64,
    /// Bytes of pending pages dropped by cuts.
    pub bytes_dropped: u64,
}

pub(super) struct State {
    root: PathBuf,
    /// Inode → path under `root` ("" for the root). Unlinked inodes leave this map.
    paths: HashMap<u64, PathBuf>,
    inos: HashMap<PathBuf, u64>,
    next_ino: u64,
    pub(super) pending: HashMap<u64, Pending>,
    handles: HashMap<u64, Handle>,
    next_fh: u64,
    /// Inode → its last unsynced write.
    pub(super) last_writes: HashMap<u64, LastWrite>,
    pub(super) counters: Counters,
    names: Names,
    /// A full disk: what would take space fails with ENOSPC and `statfs` shows none free.
    pub(super) full: bool,
    /// Inode → the end of the space `fallocate` reserved for it (beyond its length with
    /// KEEP_SIZE): writes within it need no new space, on a full disk too.
    reserved: HashMap<u64, u64>,
}

impl State {
    pub(super) fn new(root: PathBuf, trash: PathBuf) -> io::Result<Self> {
        let mut s = Self {
            names: Names::new(root.clone(), trash)?,
            root,
            paths: HashMap::new(),
            inos: HashMap::new(),
            next_ino: ROOT_INO + 1,
            pending: HashMap::new(),
            handles: HashMap::new(),
            next_fh: 1,
            last_writes: HashMap::new(),
            counters: Counters::default(),
            full: false,
            reserved: HashMap::new(),
        };
        s.paths.insert(ROOT_INO, PathBuf::new());
        s.inos.insert(PathBuf::new(), ROOT_INO);
        Ok(s)
    }

    /// The names part of a cut: uncommitted creations, removals and renames undone. Inode
    /// numbers are handed out afresh after it (the processes that held them are gone).
    pub(super) fn undo_names(&mut self) -> NamesUndone {
        let undone = self.names.undo_all();
        self.paths.retain(|&ino, _| ino == ROOT_INO);
        self.inos.retain(|_, &mut ino| ino == ROOT_INO);
        undone
    }

    /// The backing path of a live inode.
    pub(super) fn backing(&self, ino: u64) -> Result<PathBuf, i32> {
        self.paths
            .get(&ino)
            .map(|p| self.root.join(p))
            .ok_or(libc::ENOENT)
    }

    fn child(&self, parent: u64, name: &OsStr) -> Result<PathBuf, i32> {
        Ok(self.paths.get(&parent).ok_or(libc::ENOENT)?.join(name))
    }

    fn ino_of(&mut self, rel: &Path) -> u64 {
        if let Some(&ino) = self.inos.get(rel) {
            return ino;
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.paths.insert(ino, rel.to_path_buf());
        self.inos.insert(rel.to_path_buf(), ino);
        ino
    }

    /// The name `rel` no longer refers to its inode (unlinked, or replaced by a rename).
    fn unmap(&mut self, rel: &Path) {
        if let Some(ino) = self.inos.remove(rel) {
            self.paths.remove(&ino);
            self.forget_if_unused(ino);
        }
    }

    /// An inode without a name and without open handles can never be read again.
    fn forget_if_unused(&mut self, ino: u64) {
        if !self.paths.contains_key(&ino) && !self.handles.values().any(|h| h.ino == ino) {
            self.pending.remove(&ino);
            self.last_writes.remove(&ino);
        }
    }

    fn attr(&self, ino: u64, meta: &Metadata) -> FileAttr {
        let kind = kind_of(meta);
        let size = match self.pending.get(&ino) {
            Some(p) if kind == FileType::RegularFile => p.len(),
            _ => meta.len(),
        };
        FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: time(meta.atime(), meta.atime_nsec()),
            mtime: time(meta.mtime(), meta.mtime_nsec()),
            ctime: time(meta.ctime(), meta.ctime_nsec()),
            crtime: time(meta.ctime(), meta.ctime_nsec()),
            kind,
            perm: (meta.mode() & 0o7777) as u16,
            nlink: meta.nlink() as u32,
            uid: meta.uid(),
            gid: meta.gid(),
            rdev: meta.rdev() as u32,
            blksize: 4096,
            flags: 0,
        }
    }

    fn stat(&self, ino: u64) -> Result<FileAttr, i32> {
        // An open file whose name is gone still answers through its handle.
        let meta = match self.backing(ino) {
            Ok(path) => std::fs::symlink_metadata(path).map_err(errno)?,
            Err(e) => self
                .handles
                .values()
                .find(|h| h.ino == ino)
                .ok_or(e)?
                .file
                .metadata()
                .map_err(errno)?,
        };
        Ok(self.attr(ino, &meta))
    }

    fn entry(&mut self, rel: &Path) -> Result<FileAttr, i32> {
        let meta = std::fs::symlink_metadata(self.root.join(rel)).map_err(errno)?;
        let ino = self.ino_of(rel);
        Ok(self.attr(ino, &meta))
    }

    fn pending_mut(&mut self, ino: u64, file: &File) -> Result<&mut Pending, i32> {
        match self.pending.entry(ino) {
            std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
            std::collections::hash_map::Entry::Vacant(e) => {
                let len = file.durable_len().map_err(errno)?;
                Ok(e.insert(Pending::new(len)))
            }
        }
    }

    /// fsync: the inode's pending bytes to its backing file.
    fn sync(&mut self, ino: u64, fh: u64) -> Result<(), i32> {
        self.counters.syncs += 1;
        let Some(p) = self.pending.get(&ino) else {
            return Ok(());
        };
        let mut file = self
            .handles
            .get(&fh)
            .ok_or(libc::EBADF)?
            .file
            .try_clone()
            .map_err(errno)?;
        // A failed fsync keeps what was pending (a real one keeps the dirty pages too).
        p.apply(&mut file).map_err(errno)?;
        self.pending.remove(&ino);
        self.last_writes.remove(&ino);
        Ok(())
    }

    fn open_handle(&mut self, ino: u64, file: File, flags: i32) -> Result<u64, i32> {
        if flags & libc::O_TRUNC != 0 {
            self.pending_mut(ino, &file)?.truncate(0);
        }
        let fh = self.next_fh;
        self.next_fh += 1;
        let sync_writes = flags & (libc::O_SYNC | libc::O_DSYNC) != 0;
        self.handles.insert(
            fh,
            Handle {
                ino,
                file,
                sync_writes,
            },
        );
        Ok(fh)
    }

    fn write(&mut self, ino: u64, fh: u64, off: u64, data: &[u8]) -> Result<(), i32> {
        let h = self.handles.get(&fh).ok_or(libc::EBADF)?;
        let (file, sync) = (h.file.try_clone().map_err(errno)?, h.sync_writes);
        let (full, reserved) = (self.full, self.reserved.get(&ino).copied().unwrap_or(0));
        let p = self.pending_mut(ino, &file)?;
        // A full disk still takes writes into space the file holds or reserved.
        if full && off + data.len() as u64 > p.len().max(reserved) {
            return Err(libc::ENOSPC);
        }
        p.write(&file, off, data).map_err(errno)?;
        self.counters.writes += 1;
        self.counters.bytes_written += data.len() as u64;
        let seq = self.counters.writes;
        self.last_writes.insert(
            ino,
            LastWrite {
                seq,
                off,
                data: data.to_vec(),
            },
        );
        if sync {
            self.sync(ino, fh)?;
        }
        Ok(())
    }

    fn read(&self, ino: u64, fh: u64, off: u64, size: usize) -> Result<Vec<u8>, i32> {
        let file = &self.handles.get(&fh).ok_or(libc::EBADF)?.file;
        match self.pending.get(&ino) {
            Some(p) => p.read(file, off, size).map_err(errno),
            None => {
                let mut buf = vec![0u8; size];
                let mut done = 0;
                while done < size {
                    let n = file
                        .read_durable(&mut buf[done..], off + done as u64)
                        .map_err(errno)?;
                    if n == 0 {
                        break;
                    }
                    done += n;
                }
                buf.truncate(done);
                Ok(buf)
            }
        }
    }

    fn file_for(&self, ino: u64, fh: Option<u64>) -> Result<File, i32> {
        if let Some(h) = fh.and_then(|fh| self.handles.get(&fh)) {
            return h.file.try_clone().map_err(errno);
        }
        OpenOptions::new()
            .read(true)
            .write(true)
            .open(self.backing(ino)?)
            .map_err(errno)
    }
}

fn time(secs: i64, nsecs: i64) -> SystemTime {
    if secs >= 0 {
        UNIX_EPOCH + Duration::new(secs as u64, nsecs as u32)
    } else {
        UNIX_EPOCH
    }
}

fn kind_of(meta: &Metadata) -> FileType {
    let t = meta.file_type();
    if t.is_dir() {
        FileType::Directory
    } else if t.is_symlink() {
        FileType::Symlink
    } else {
        FileType::RegularFile
    }
}

/// The reply of a request that answers nothing but success or an errno.
fn answer(reply: ReplyEmpty, result: Result<(), i32>) {
    match result {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e),
    }
}

fn errno(e: io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

/// The fuser adapter: every request takes the state lock.
pub(super) struct PowerCutFuse {
    pub(super) state: Arc<Mutex<State>>,
}

impl PowerCutFuse {
    fn st(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl PowerCutFuse {
    /// unlink (`dir` false) or rmdir: the name goes, undoably until its directory is synced.
    fn remove_name(&mut self, parent: u64, name: &OsStr, dir: bool, reply: ReplyEmpty) {
        let mut st = self.st();
        let result = st.child(parent, name).and_then(|rel| {
            st.names.remove(&rel, dir).map_err(errno)?;
            st.unmap(&rel);
            Ok(())
        });
        answer(reply, result);
    }
}

impl Filesystem for PowerCutFuse {
    fn init(&mut self, _req: &Request<'_>, config: &mut KernelConfig) -> Result<(), libc::c_int> {
        let _ = config.set_max_write(1 << 20);
        Ok(())
    }

    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        let mut st = self.st();
        match st.child(parent, name).and_then(|rel| st.entry(&rel)) {
            Ok(attr) => reply.entry(&TTL, &attr, 0),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        match self.st().stat(ino) {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<u64>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<u32>,
        reply: ReplyAttr,
    ) {
        let mut st = self.st();
        let result = (|| {
            if let Some(mode) = mode {
                let path = st.backing(ino)?;
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode & 0o7777))
                    .map_err(errno)?;
            }
            if uid.is_some() || gid.is_some() {
                std::os::unix::fs::chown(st.backing(ino)?, uid, gid).map_err(errno)?;
            }
            if let Some(size) = size {
                let file = st.file_for(ino, fh)?;
                st.pending_mut(ino, &file)?.truncate(size);
            }
            st.stat(ino)
        })();
        match result {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&mut self, _req: &Request<'_>, ino: u64, reply: ReplyData) {
        use std::os::unix::ffi::OsStrExt;
        let st = self.st();
        match st
            .backing(ino)
            .and_then(|p| std::fs::read_link(p).map_err(errno))
        {
            Ok(target) => reply.data(target.as_os_str().as_bytes()),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let mut st = self.st();
        let full = st.full;
        let result = st.child(parent, name).and_then(|rel| {
            if full {
                return Err(libc::ENOSPC);
            }
            std::fs::DirBuilder::new()
                .mode(mode & !umask & 0o7777)
                .create(st.root.join(&rel))
                .map_err(errno)?;
            st.names.created(&rel);
            st.entry(&rel)
        });
        match result {
            Ok(attr) => reply.entry(&TTL, &attr, 0),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        self.remove_name(parent, name, false, reply);
    }

    fn rmdir(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        self.remove_name(parent, name, true, reply);
    }

    fn symlink(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let mut st = self.st();
        let result = st.child(parent, link_name).and_then(|rel| {
            std::os::unix::fs::symlink(target, st.root.join(&rel)).map_err(errno)?;
            st.names.created(&rel);
            st.entry(&rel)
        });
        match result {
            Ok(attr) => reply.entry(&TTL, &attr, 0),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
        reply: ReplyEmpty,
    ) {
        let mut st = self.st();
        let result = (|| {
            let from = st.child(parent, name)?;
            let to = st.child(newparent, newname)?;
            let exchange = flags & libc::RENAME_EXCHANGE != 0;
            st.names.rename(&from, &to, flags).map_err(errno)?;
            let moved = st.inos.remove(&from);
            let other = st.inos.remove(&to);
            if exchange {
                if let Some(ino) = other {
                    st.inos.insert(from.clone(), ino);
                    st.paths.insert(ino, from.clone());
                }
            } else if let Some(ino) = other {
                st.paths.remove(&ino);
                st.forget_if_unused(ino);
            }
            if let Some(ino) = moved {
                st.inos.insert(to.clone(), ino);
                st.paths.insert(ino, to.clone());
            }
            // What lies under a renamed directory moves with it.
            let mut renames: Vec<(u64, PathBuf)> = Vec::new();
            for (&ino, p) in &st.paths {
                if Some(ino) == moved || Some(ino) == other {
                    continue;
                }
                if let Ok(rest) = p.strip_prefix(&from) {
                    if !rest.as_os_str().is_empty() {
                        renames.push((ino, to.join(rest)));
                    }
                } else if exchange {
                    if let Ok(rest) = p.strip_prefix(&to) {
                        if !rest.as_os_str().is_empty() {
                            renames.push((ino, from.join(rest)));
                        }
                    }
                }
            }
            // Two passes: with an exchange, one inode's new path is another's old one.
            for (ino, _) in &renames {
                if let Some(old) = st.paths.remove(ino) {
                    st.inos.remove(&old);
                }
            }
            for (ino, new) in renames {
                st.paths.insert(ino, new.clone());
                st.inos.insert(new, ino);
            }
            Ok(())
        })();
        answer(reply, result);
    }

    fn link(
        &mut self,
        _req: &Request<'_>,
        _ino: u64,
        _newparent: u64,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        // One path per inode keeps the model simple; no role of Meridian makes hard links.
        reply.error(libc::EPERM);
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, flags: i32, reply: ReplyOpen) {
        let mut st = self.st();
        let result = st.backing(ino).and_then(|path| {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .or_else(|_| File::open(&path))
                .map_err(errno)?;
            st.open_handle(ino, file, flags)
        });
        match result {
            Ok(fh) => reply.opened(fh, 0),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        match self.st().read(ino, fh, offset.max(0) as u64, size as usize) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        fh: u64,
        offset: i64,
        data: &[u8],
        _write_flags: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyWrite,
    ) {
        match self.st().write(ino, fh, offset.max(0) as u64, data) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn flush(&mut self, _req: &Request<'_>, _ino: u64, _fh: u64, _lock: u64, reply: ReplyEmpty) {
        // close() does not sync.
        reply.ok();
    }

    fn release(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        fh: u64,
        _flags: i32,
        _lock_owner: Option<u64>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let mut st = self.st();
        st.handles.remove(&fh);
        st.forget_if_unused(ino);
        reply.ok();
    }

    fn fsync(&mut self, _req: &Request<'_>, ino: u64, fh: u64, _datasync: bool, reply: ReplyEmpty) {
        answer(reply, self.st().sync(ino, fh));
    }

    fn readdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        let mut st = self.st();
        let result = (|| {
            let rel = st.paths.get(&ino).cloned().ok_or(libc::ENOENT)?;
            let mut names: Vec<(std::ffi::OsString, FileType)> =
                std::fs::read_dir(st.root.join(&rel))
                    .map_err(errno)?
                    .filter_map(|e| e.ok())
                    .filter_map(|e| {
                        let kind = e.metadata().ok().map(|m| kind_of(&m))?;
                        Some((e.file_name(), kind))
                    })
                    .collect();
            names.sort_by(|a, b| a.0.cmp(&b.0));
            let parent = rel.parent().map(|p| st.ino_of(p)).unwrap_or(ROOT_INO);
            let mut entries = vec![
                (ino, FileType::Directory, std::ffi::OsString::from(".")),
                (parent, FileType::Directory, std::ffi::OsString::from("..")),
            ];
            for (name, kind) in names {
                let child = st.ino_of(&rel.join(&name));
                entries.push((child, kind, name));
            }
            Ok(entries)
        })();
        match result {
            Ok(entries) => {
                for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize)
                {
                    if reply.add(ino, (i + 1) as i64, kind, &name) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(e),
        }
    }

    fn fsyncdir(&mut self, _req: &Request<'_>, ino: u64, _fh: u64, _ds: bool, reply: ReplyEmpty) {
        let mut st = self.st();
        st.counters.syncs += 1;
        match st.paths.get(&ino).cloned() {
            Some(dir) => {
                st.names.commit_dir(&dir);
                reply.ok();
            }
            None => reply.error(libc::ENOENT),
        }
    }

    fn statfs(&mut self, _req: &Request<'_>, _ino: u64, reply: ReplyStatfs) {
        let (root, full) = {
            let st = self.st();
            (st.root.clone(), st.full)
        };
        match rustix::fs::statvfs(&root) {
            // The blocks the host file system reserves (for root) are neither free nor part
            // of the total here, as `df`'s Use% leaves them out. A host disk with a large
            // reserve (this machine's: 161 of 252 GiB) would otherwise read as 90% used by the
            // processes inside with three quarters of the rest free, and a bookie, writable
            // again only once usage is 5 points below `disk_usage_percent_max`, would stay
            // read-only after a full-disk fault for as long as the host stayed that full.
            Ok(s) => reply.statfs(
                s.f_blocks
                    .saturating_sub(s.f_bfree.saturating_sub(s.f_bavail)),
                if full { 0 } else { s.f_bavail },
                if full { 0 } else { s.f_bavail },
                s.f_files,
                s.f_ffree,
                s.f_bsize as u32,
                s.f_namemax as u32,
                s.f_frsize as u32,
            ),
            Err(e) => reply.error(e.raw_os_error()),
        }
    }

    fn access(&mut self, _req: &Request<'_>, ino: u64, _mask: i32, reply: ReplyEmpty) {
        match self.st().stat(ino) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let mut st = self.st();
        let result = (|| {
            let rel = st.child(parent, name)?;
            let existed = std::fs::symlink_metadata(st.root.join(&rel)).is_ok();
            if st.full && !existed {
                return Err(libc::ENOSPC);
            }
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .create_new(flags & libc::O_EXCL != 0)
                .mode(mode & !umask & 0o7777)
                .open(st.root.join(&rel))
                .map_err(errno)?;
            if !existed {
                st.names.created(&rel);
            }
            let ino = st.ino_of(&rel);
            let fh = st.open_handle(ino, file, flags)?;
            Ok((st.stat(ino)?, fh))
        })();
        match result {
            Ok((attr, fh)) => reply.created(&TTL, &attr, 0, fh, 0),
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        fh: u64,
        offset: i64,
        length: i64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let mut st = self.st();
        let result = (|| {
            let (off, len) = (offset.max(0) as u64, length.max(0) as u64);
            let file = st.file_for(ino, Some(fh))?;
            let keep_size = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
            let full = st.full;
            let reserved = st.reserved.get(&ino).copied().unwrap_or(0);
            let p = st.pending_mut(ino, &file)?;
            match mode & !libc::FALLOC_FL_KEEP_SIZE {
                // Space reservation: only the size can change.
                0 if full && off + len > p.len().max(reserved) => return Err(libc::ENOSPC),
                0 => {
                    if keep_size {
                        let end = st.reserved.entry(ino).or_insert(0);
                        *end = (*end).max(off + len);
                        return Ok(());
                    }
                    if off + len > p.len() {
                        p.truncate(off + len);
                    }
                }
                m if m == libc::FALLOC_FL_PUNCH_HOLE || m == libc::FALLOC_FL_ZERO_RANGE => {
                    let end = if keep_size {
                        (off + len).min(p.len())
                    } else {
                        off + len
                    };
                    if end > off {
                        p.write(&file, off, &vec![0u8; (end - off) as usize])
                            .map_err(errno)?;
                    }
                }
                _ => return Err(libc::EOPNOTSUPP),
            }
            Ok(())
        })();
        answer(reply, result);
    }
}
