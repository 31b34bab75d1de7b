//! Names that a power cut can take back: creations, removals and renames are durable only
//! once their directory is fsynced, as POSIX promises and no more (ALICE's and LazyFS's strict
//! reading). An fsync of a file makes its bytes durable, not its name.
//!
//! Each change is done at once in the backing directory, so processes see it, and recorded
//! with what undoes it: a removed file or directory, or a file a rename replaced, is moved into
//! a trash directory beside the backing one instead of being deleted. `fsyncdir` commits the
//! changes of that directory (a rename: of the directory it lands in); a cut undoes the rest,
//! newest first. Undoing is best effort where a committed change later moved what an
//! uncommitted one touched; what could not be undone is reported.

use std::io;
use std::path::{Path, PathBuf};

#[derive(Debug)]
enum Change {
    /// A file, directory or symlink made at `path`.
    Created { path: PathBuf },
    /// What was at `path`, now in the trash at `kept`.
    Removed { path: PathBuf, kept: PathBuf },
    /// Renamed from `from` to `to`; what `to` held before is in the trash at `replaced`.
    Renamed {
        from: PathBuf,
        to: PathBuf,
        replaced: Option<PathBuf>,
        exchange: bool,
    },
}

impl Change {
    /// The directory whose fsync makes this change durable.
    fn dir(&self) -> &Path {
        let p = match self {
            Change::Created { path } | Change::Removed { path, .. } => path,
            Change::Renamed { to, .. } => to,
        };
        p.parent().unwrap_or(Path::new(""))
    }
}

/// The uncommitted name changes of one file system, paths relative to its backing root.
#[derive(Debug)]
pub(super) struct Names {
    root: PathBuf,
    trash: PathBuf,
    next_trash: u64,
    changes: Vec<Change>,
}

/// What a cut did to names.
#[derive(Debug, Clone, Default)]
pub struct NamesUndone {
    pub undone: usize,
    /// Changes that could not be undone (a later committed change moved their paths).
    pub failed: usize,
    /// What was undone, newest first (`+path` a creation, `-path` a removal, `from>to` a
    /// rename), for a test's log.
    pub changes: Vec<String>,
}

impl Names {
    pub(super) fn new(root: PathBuf, trash: PathBuf) -> io::Result<Self> {
        if trash.exists() {
            std::fs::remove_dir_all(&trash)?;
        }
        std::fs::create_dir_all(&trash)?;
        Ok(Self {
            root,
            trash,
            next_trash: 0,
            changes: Vec::new(),
        })
    }

    fn trash_slot(&mut self) -> PathBuf {
        self.next_trash += 1;
        self.trash.join(self.next_trash.to_string())
    }

    pub(super) fn created(&mut self, path: &Path) {
        self.changes.push(Change::Created {
            path: path.to_path_buf(),
        });
    }

    /// unlink or rmdir: moved into the trash.
    pub(super) fn remove(&mut self, path: &Path, dir: bool) -> io::Result<()> {
        let full = self.root.join(path);
        let meta = std::fs::symlink_metadata(&full)?;
        if dir != meta.is_dir() {
            return Err(io::Error::from_raw_os_error(if dir {
                libc::ENOTDIR
            } else {
                libc::EISDIR
            }));
        }
        if dir && std::fs::read_dir(&full)?.next().is_some() {
            return Err(io::Error::from_raw_os_error(libc::ENOTEMPTY));
        }
        let kept = self.trash_slot();
        std::fs::rename(&full, &kept)?;
        self.changes.push(Change::Removed {
            path: path.to_path_buf(),
            kept,
        });
        Ok(())
    }

    /// rename(2) with its flags; a replaced target goes to the trash first.
    pub(super) fn rename(&mut self, from: &Path, to: &Path, flags: u32) -> io::Result<()> {
        let exchange = flags & libc::RENAME_EXCHANGE != 0;
        let (full_from, full_to) = (self.root.join(from), self.root.join(to));
        std::fs::symlink_metadata(&full_from)?;
        let mut replaced = None;
        if !exchange && flags & libc::RENAME_NOREPLACE == 0 {
            if let Ok(target) = std::fs::symlink_metadata(&full_to) {
                let source_dir = std::fs::symlink_metadata(&full_from)?.is_dir();
                // rename(2)'s own refusals, before anything moves.
                if target.is_dir() && !source_dir {
                    return Err(io::Error::from_raw_os_error(libc::EISDIR));
                }
                if !target.is_dir() && source_dir {
                    return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
                }
                if target.is_dir() && std::fs::read_dir(&full_to)?.next().is_some() {
                    return Err(io::Error::from_raw_os_error(libc::ENOTEMPTY));
                }
                if full_from == full_to {
                    return Ok(());
                }
                let kept = self.trash_slot();
                std::fs::rename(&full_to, &kept)?;
                replaced = Some(kept);
            }
        }
        let result = rustix::fs::renameat_with(
            rustix::fs::CWD,
            &full_from,
            rustix::fs::CWD,
            &full_to,
            rustix::fs::RenameFlags::from_bits_retain(flags),
        );
        if let Err(e) = result {
            if let Some(kept) = replaced {
                std::fs::rename(kept, &full_to)?;
            }
            return Err(e.into());
        }
        self.changes.push(Change::Renamed {
            from: from.to_path_buf(),
            to: to.to_path_buf(),
            replaced,
            exchange,
        });
        Ok(())
    }

    /// fsyncdir: the changes of `dir` are durable.
    pub(super) fn commit_dir(&mut self, dir: &Path) {
        let mut kept = Vec::new();
        for c in std::mem::take(&mut self.changes) {
            if c.dir() != dir {
                kept.push(c);
                continue;
            }
            let trash = match &c {
                Change::Removed { kept, .. } => Some(kept.clone()),
                Change::Renamed { replaced, .. } => replaced.clone(),
                Change::Created { .. } => None,
            };
            if let Some(t) = trash {
                let _ = remove_any(&t);
            }
        }
        self.changes = kept;
    }

    /// The cut: every uncommitted change undone, newest first.
    pub(super) fn undo_all(&mut self) -> NamesUndone {
        let mut report = NamesUndone::default();
        while let Some(c) = self.changes.pop() {
            let r = match &c {
                Change::Created { path } => remove_any(&self.root.join(path)),
                Change::Removed { path, kept } => std::fs::rename(kept, self.root.join(path)),
                Change::Renamed {
                    from,
                    to,
                    replaced,
                    exchange,
                } => {
                    let (f, t) = (self.root.join(from), self.root.join(to));
                    if *exchange {
                        rustix::fs::renameat_with(
                            rustix::fs::CWD,
                            &t,
                            rustix::fs::CWD,
                            &f,
                            rustix::fs::RenameFlags::EXCHANGE,
                        )
                        .map_err(io::Error::from)
                    } else {
                        // Never over what a committed change put at the source name since.
                        let back = rustix::fs::renameat_with(
                            rustix::fs::CWD,
                            &t,
                            rustix::fs::CWD,
                            &f,
                            rustix::fs::RenameFlags::NOREPLACE,
                        )
                        .map_err(io::Error::from);
                        let restored = match replaced {
                            Some(kept) if std::fs::symlink_metadata(&t).is_err() => {
                                std::fs::rename(kept, &t)
                            }
                            Some(_) => Err(io::Error::from_raw_os_error(libc::EEXIST)),
                            None => Ok(()),
                        };
                        back.and(restored)
                    }
                }
            };
            match r {
                Ok(()) => report.undone += 1,
                Err(_) => report.failed += 1,
            }
            report.changes.push(match &c {
                Change::Created { path } => format!("+{}", path.display()),
                Change::Removed { path, .. } => format!("-{}", path.display()),
                Change::Renamed { from, to, .. } => format!("{}>{}", from.display(), to.display()),
            });
        }
        report
    }
}

fn remove_any(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ls(root: &Path) -> Vec<String> {
        let mut out = Vec::new();
        for e in walk(root) {
            out.push(
                e.strip_prefix(root)
                    .expect("under root")
                    .to_string_lossy()
                    .into_owned(),
            );
        }
        out.sort();
        out
    }

    fn walk(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).expect("read_dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            }
            out.push(p);
        }
        out
    }

    #[test]
    fn uncommitted_names_are_undone_and_committed_ones_stay() {
        let tmp = tempfile::tempdir().expect("tmp");
        let root = tmp.path().join("root");
        std::fs::create_dir(&root).expect("root");
        std::fs::write(root.join("old"), b"old").expect("old");
        std::fs::write(root.join("gone"), b"gone").expect("gone");
        let mut n = Names::new(root.clone(), tmp.path().join("trash")).expect("names");

        // Committed: d/ and d/kept (each directory fsynced).
        std::fs::create_dir(root.join("d")).expect("mkdir");
        n.created(Path::new("d"));
        std::fs::write(root.join("d/kept"), b"k").expect("kept");
        n.created(Path::new("d/kept"));
        n.commit_dir(Path::new(""));
        n.commit_dir(Path::new("d"));

        // Uncommitted: a new file, a removal, a rename over an existing file, a new file in d.
        std::fs::write(root.join("new"), b"n").expect("new");
        n.created(Path::new("new"));
        n.remove(Path::new("gone"), false).expect("unlink");
        std::fs::write(root.join("tmp"), b"replacement").expect("tmp");
        n.created(Path::new("tmp"));
        n.rename(Path::new("tmp"), Path::new("old"), 0)
            .expect("rename");
        std::fs::write(root.join("d/lost"), b"l").expect("lost");
        n.created(Path::new("d/lost"));
        assert_eq!(ls(&root), ["d", "d/kept", "d/lost", "new", "old"]);
        assert_eq!(
            std::fs::read(root.join("old")).expect("old"),
            b"replacement"
        );

        let r = n.undo_all();
        assert_eq!((r.undone, r.failed), (5, 0));
        assert_eq!(ls(&root), ["d", "d/kept", "gone", "old"]);
        assert_eq!(std::fs::read(root.join("old")).expect("old"), b"old");
        assert_eq!(std::fs::read(root.join("gone")).expect("gone"), b"gone");
    }

    #[test]
    fn a_rename_is_committed_by_its_target_directory() {
        let tmp = tempfile::tempdir().expect("tmp");
        let root = tmp.path().join("root");
        std::fs::create_dir_all(root.join("a")).expect("a");
        std::fs::create_dir_all(root.join("b")).expect("b");
        std::fs::write(root.join("a/f"), b"f").expect("f");
        let mut n = Names::new(root.clone(), tmp.path().join("trash")).expect("names");
        n.rename(Path::new("a/f"), Path::new("b/f"), 0)
            .expect("rename");
        n.commit_dir(Path::new("a"));
        assert_eq!(
            n.undo_all().undone,
            1,
            "the source directory's fsync is not enough"
        );
        assert!(root.join("a/f").exists());
        n.rename(Path::new("a/f"), Path::new("b/f"), 0)
            .expect("rename");
        n.commit_dir(Path::new("b"));
        assert_eq!(n.undo_all().undone, 0);
        assert!(root.join("b/f").exists());
    }
}
