//! Clock jumps: each process of a run reads its wall clock through libfaketime (preloaded),
//! offset by what a file of its own says, re-read every second; a jump writes the offset
//! there, the healing writes `+0` (the clock jumps back). Monotonic clocks are left alone, as
//! a wall-clock step (NTP, a VM's resume) leaves them.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context};

/// Where Debian's `libfaketime` package puts the library (`scripts/setup.sh` installs it):
/// the build for multi-threaded processes, whose cached offset threads do not tear.
pub const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// The processes' clock files, under one directory.
pub struct Clocks {
    dir: PathBuf,
    /// Off (a schedule without clock jumps): processes keep the real clock.
    on: bool,
}

impl Clocks {
    pub fn new(dir: &Path, on: bool) -> anyhow::Result<Clocks> {
        ensure!(
            !on || Path::new(LIBFAKETIME).exists(),
            "{LIBFAKETIME} is missing (scripts/setup.sh installs libfaketime): clock jumps need it"
        );
        std::fs::create_dir_all(dir)?;
        Ok(Clocks {
            dir: dir.to_path_buf(),
            on,
        })
    }

    fn file(&self, process: &str) -> PathBuf {
        self.dir.join(process)
    }

    /// The environment that puts `process`'s wall clock under its file (made here, at no
    /// offset).
    pub fn env(&self, process: &str) -> anyhow::Result<Vec<(&'static str, String)>> {
        if !self.on {
            return Ok(Vec::new());
        }
        let file = self.file(process);
        std::fs::write(&file, "+0\n").with_context(|| format!("{}", file.display()))?;
        Ok(vec![
            ("LD_PRELOAD", LIBFAKETIME.to_string()),
            ("FAKETIME_TIMESTAMP_FILE", file.display().to_string()),
            ("FAKETIME_CACHE_DURATION", "1".to_string()),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_string()),
        ])
    }

    /// Sets `process`'s wall clock `secs` seconds off the real one (0: back to it).
    pub fn jump(&self, process: &str, secs: i64) -> anyhow::Result<()> {
        let file = self.file(process);
        std::fs::write(&file, format!("{secs:+}\n")).with_context(|| format!("{}", file.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_a_jump_then_the_file_holds_the_offset_with_its_sign() {
        let dir = tempfile::tempdir().unwrap();
        // scripts/setup.sh installs the library: its absence fails here, not silently.
        let c = Clocks::new(dir.path(), true).unwrap();
        let env = c.env("broker0").unwrap();
        assert!(env.contains(&("LD_PRELOAD", LIBFAKETIME.to_string())));
        let file = dir.path().join("broker0");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "+0\n");
        c.jump("broker0", -90).unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "-90\n");
        c.jump("broker0", 300).unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "+300\n");
        let off = Clocks::new(dir.path(), false).unwrap();
        assert!(off.env("broker1").unwrap().is_empty());
    }
}
