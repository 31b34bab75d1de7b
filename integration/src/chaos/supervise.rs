//! `meridian-chaos` under a supervisor: the run is a child in a process group of its own,
//! with its temporary files under a directory of its own, so a signal that ends the run
//! ends all it started. Before, SIGTERM or Ctrl-C killed the run alone and left the site's
//! processes running, its power-cut mounts dead (their server was the run) and its data in
//! the temporary directory.

use std::ffi::OsString;
use std::path::Path;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use rustix::process::{kill_process_group, test_kill_process_group, Pid, Signal};
use tokio::signal::unix::{signal, SignalKind};

use crate::powercut::{detach, mounts_under};

/// Set in the supervised child's environment: it runs the schedule itself.
pub const SUPERVISED: &str = "MERIDIAN_CHAOS_SUPERVISED";

/// How long the run's processes have to be gone after they were killed.
const GONE_WITHIN: Duration = Duration::from_secs(10);

/// Runs this program again, with `args`, as the supervised child and waits for it; returns
/// the exit code to leave with: the child's, or 128 + the signal that ended the run
/// (SIGTERM, SIGINT or SIGHUP here: the child's process group is killed, the mounts under
/// its temporary directory detached, and the directory removed unless `keep`). Whatever the
/// child left behind when it ended on its own (it crashed) goes the same way, but a
/// `--keep` run's files stay.
pub fn supervise(args: Vec<OsString>, keep: bool) -> anyhow::Result<i32> {
    let dir = tempfile::Builder::new()
        .prefix("meridian-chaos-")
        .tempdir()
        .context("making the run's temporary directory")?
        .keep();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (code, signalled) = match rt.block_on(run_child(args, &dir)) {
        Ok(Ended::Exited(status)) => (exit_code(status), false),
        Ok(Ended::Signalled(sig)) => (128 + sig, true),
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
    };
    for mp in mounts_under(&dir) {
        detach(&mp);
    }
    if keep && !signalled {
        // Its kept files are under the directory; empty (nothing kept), it goes.
        let _ = std::fs::remove_dir(&dir);
    } else if keep {
        eprintln!("chaos: the run's files are kept in {}", dir.display());
    } else if let Err(e) = std::fs::remove_dir_all(&dir) {
        eprintln!("chaos: {} was not removed: {e}", dir.display());
    }
    Ok(code)
}

enum Ended {
    Exited(ExitStatus),
    /// This signal came, and the run was ended.
    Signalled(i32),
}

async fn run_child(args: Vec<OsString>, dir: &Path) -> anyhow::Result<Ended> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    let mut child = tokio::process::Command::new(std::env::current_exe()?)
        .args(args)
        .env(SUPERVISED, "1")
        .env("TMPDIR", dir)
        // Its own group: Ctrl-C at a terminal reaches this supervisor only, which ends the
        // group as a whole.
        .process_group(0)
        .spawn()
        .context("starting the run")?;
    let group = child
        .id()
        .and_then(|id| Pid::from_raw(id as i32))
        .context("the run has no process id")?;
    let ended = tokio::select! {
        status = child.wait() => Ended::Exited(status?),
        _ = term.recv() => Ended::Signalled(libc::SIGTERM),
        _ = int.recv() => Ended::Signalled(libc::SIGINT),
        _ = hup.recv() => Ended::Signalled(libc::SIGHUP),
    };
    if let Ended::Signalled(sig) = ended {
        eprintln!("chaos: signal {sig}: ending the run (its processes, mounts and files)");
    }
    // Signalled, or it ended on its own and may have left processes behind (it crashed).
    let _ = kill_process_group(group, Signal::KILL);
    // Reaped, the run is no longer a member of its group.
    child.wait().await?;
    let deadline = Instant::now() + GONE_WITHIN;
    while test_kill_process_group(group).is_ok() {
        if Instant::now() > deadline {
            eprintln!("chaos: processes of group {group:?} outlived SIGKILL for {GONE_WITHIN:?}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(ended)
}

fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt as _;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}
