//! `meridian-chaos` under a supervisor: the run is a child in a process group of its own,
//! with its temporary files under a directory of its own, so a signal that ends the run
//! ends all it started. Before, SIGTERM or Ctrl-C killed the run alone and left the site's
//! processes running, its power-cut mounts dead (their server was the run) and its data in
//! the temporary directory.

use std::ffi::OsString;
use std::path::PathBuf;
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
/// (SIGTERM, SIGINT or SIGHUP here, each unless it was ignored when this process started,
/// as under `nohup`: the child's process group is killed, the mounts under its temporary
/// directory detached, and the directory removed unless `keep`). Whatever the child left
/// behind when it ended on its own (it crashed) goes the same way, but a `--keep` run's
/// files stay.
pub fn supervise(args: Vec<OsString>, keep: bool) -> anyhow::Result<i32> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (dir, ended) = rt.block_on(run_child(args));
    let Some(dir) = dir else {
        // Nothing was started (the error says why).
        return ended.map(|_| 1);
    };
    for mp in mounts_under(&dir) {
        detach(&mp);
    }
    let (code, signalled) = match &ended {
        Ok(Ended::Exited(status)) => (exit_code(*status), false),
        Ok(Ended::Signalled(sig)) => (128 + sig, true),
        Err(_) => (1, false),
    };
    if keep && !signalled && ended.is_ok() {
        // Its kept files are under the directory (their paths printed); nothing kept, it goes.
        if std::fs::remove_dir(&dir).is_err() && dir.exists() {
            eprintln!("chaos: the run's files are in {}", dir.display());
        }
    } else if keep {
        eprintln!("chaos: the run's files are kept in {}", dir.display());
    } else if let Err(e) = std::fs::remove_dir_all(&dir) {
        eprintln!("chaos: {} was not removed: {e}", dir.display());
    }
    ended?;
    Ok(code)
}

enum Ended {
    Exited(ExitStatus),
    /// This signal came, and the run was ended.
    Signalled(i32),
}

/// Whether `sig` was ignored when this process started (`nohup` ignores SIGHUP): then it
/// is left so, and the child inherits it.
fn ignored(sig: i32) -> bool {
    // The kernel's mask of ignored signals, in hex: bit n - 1 for signal n.
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (sig - 1)) != 0)
}

/// The run's directory (once made) and how the run ended; its process group is gone either
/// way (or [`GONE_WITHIN`] has passed).
async fn run_child(args: Vec<OsString>) -> (Option<PathBuf>, anyhow::Result<Ended>) {
    let mut handled = Vec::new();
    for (kind, number) in [
        (SignalKind::terminate(), libc::SIGTERM),
        (SignalKind::interrupt(), libc::SIGINT),
        (SignalKind::hangup(), libc::SIGHUP),
    ] {
        if !ignored(number) {
            match signal(kind) {
                Ok(s) => handled.push((s, number)),
                Err(e) => return (None, Err(e.into())),
            }
        }
    }
    // Made once the signals are handled: one that comes earlier leaves nothing behind.
    let dir = match tempfile::Builder::new().prefix("meridian-chaos-").tempdir() {
        Ok(d) => d.keep(),
        Err(e) => return (None, Err(e).context("making the run's temporary directory")),
    };
    let spawned = tokio::process::Command::new(match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => return (Some(dir), Err(e.into())),
    })
    .args(args)
    .env(SUPERVISED, "1")
    .env("TMPDIR", &dir)
    // Its own group: Ctrl-C at a terminal reaches this supervisor only, which ends the group
    // as a whole.
    .process_group(0)
    .spawn()
    .context("starting the run");
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) => return (Some(dir), Err(e)),
    };
    let Some(group) = child.id().and_then(|id| Pid::from_raw(id as i32)) else {
        return (Some(dir), Err(anyhow::anyhow!("the run has no process id")));
    };
    let any = !handled.is_empty();
    let signalled = async move {
        let waits = handled.iter_mut().map(|(s, n)| {
            let n = *n;
            Box::pin(async move {
                s.recv().await;
                n
            })
        });
        futures::future::select_all(waits).await.0
    };
    let ended = tokio::select! {
        status = child.wait() => status.map(Ended::Exited).map_err(anyhow::Error::from),
        sig = signalled, if any => Ok(Ended::Signalled(sig)),
    };
    if let Ok(Ended::Signalled(sig)) = ended {
        eprintln!("chaos: signal {sig}: ending the run (its processes, mounts and files)");
    }
    end_group(group, &mut child).await;
    (Some(dir), ended)
}

/// Kills every process of `group` (signalled, or the run ended and may have left processes
/// behind: it crashed), reaps the run, and waits until none is left.
async fn end_group(group: Pid, child: &mut tokio::process::Child) {
    let _ = kill_process_group(group, Signal::KILL);
    let deadline = Instant::now() + GONE_WITHIN;
    // Reaped, the run is no longer a member of its group.
    let _ = tokio::time::timeout(GONE_WITHIN, child.wait()).await;
    while test_kill_process_group(group).is_ok() {
        if Instant::now() > deadline {
            eprintln!("chaos: processes of group {group:?} outlived SIGKILL for {GONE_WITHIN:?}");
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt as _;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}
