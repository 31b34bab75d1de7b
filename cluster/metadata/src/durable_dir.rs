//! Directories whose existence survives a power cut. `mkdir` names a directory in its parent,
//! and POSIX makes that name durable only once the parent is fsynced: a data directory made
//! at a node's first start, written into and acknowledged from, could otherwise vanish whole
//! with the power (the power-loss file system of `integration/` showed it; etcd fsyncs its WAL
//! directory's parent for the same reason). Every role makes its data directories with
//! [`create_dir_all_synced`], and a directory that gains a file whose name matters is
//! fsynced with [`sync_dir`].

use std::io;
use std::path::{Path, PathBuf};

/// `create_dir_all`, then fsyncs the parent of every directory it made, top down, and the
/// parent of `path` even when `path` was there already (a start that made it may have been
/// cut short before its fsync).
pub fn create_dir_all_synced(path: &Path) -> io::Result<()> {
    let mut missing: Vec<PathBuf> = Vec::new();
    let mut p = path;
    loop {
        match std::fs::symlink_metadata(p) {
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::NotFound => missing.push(p.to_path_buf()),
            Err(e) => return Err(e),
        }
        match p.parent() {
            Some(q) if !q.as_os_str().is_empty() => p = q,
            _ => break,
        }
    }
    std::fs::create_dir_all(path)?;
    for dir in missing.iter().rev() {
        sync_dir(parent_of(dir))?;
    }
    if missing.is_empty() {
        sync_dir(parent_of(path))?;
    }
    Ok(())
}

/// fsync of a directory: the names in it are durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// The directory that names `path` (`.` for a bare name).
pub fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(q) if !q.as_os_str().is_empty() => q,
        _ => Path::new("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn makes_every_missing_level_and_accepts_an_existing_directory() {
        let tmp = tempfile::tempdir().expect("tmp");
        let deep = tmp.path().join("a/b/c");
        create_dir_all_synced(&deep).expect("create");
        assert!(deep.is_dir());
        create_dir_all_synced(&deep).expect("again");
        let file = tmp.path().join("f");
        std::fs::write(&file, b"x").expect("file");
        assert!(
            create_dir_all_synced(&file.join("d")).is_err(),
            "under a file"
        );
        assert_eq!(parent_of(Path::new("x")), Path::new("."));
    }
}
