//! Threads that call into RocksDB, outside tokio's.
//!
//! RocksDB keeps state per thread and releases it when the thread ends. If a thread ends while
//! the process is already running `exit`'s static destructors (which tear RocksDB's globals
//! down), it crashes: segfaults of `metadata-wal-sync` (in libstdc++) and `bookie-flusher` (in
//! librocksdb) were seen at process exit, and a test binary died with SIGSEGV after printing
//! `test result: ok` (its `main` returned while the thread of the store its test had just
//! dropped was still ending). So a thread started here never ends: when its job returns it
//! waits for the next one, and `exit` stops it where it waits, without running RocksDB's
//! per-thread destructors. There are never more of them than jobs running at once. (The
//! bookie's flusher thread is not one of them: `RunningBookie` joins it when it stops.)
//!
//! A process still calls [`join_db_threads`] before it returns, so that the jobs (and the
//! stores they hold) are over before `exit`.

use std::panic::AssertUnwindSafe;
use std::sync::mpsc;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

type Job = Box<dyn FnOnce() + Send>;

struct Pool {
    /// Threads waiting for a job, each by the sender of its own queue.
    idle: Vec<mpsc::Sender<Job>>,
    /// Jobs handed out and not yet returned.
    running: usize,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    idle: Vec::new(),
    running: 0,
});

/// Signalled whenever a job returns.
static JOB_ENDED: Condvar = Condvar::new();

fn pool() -> MutexGuard<'static, Pool> {
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` on a thread that may use RocksDB: the idle one that went idle last, or a new one
/// named `name` (a thread keeps the name of the job it was started for).
pub fn spawn_db_thread<F>(name: &str, f: F) -> std::io::Result<()>
where
    F: FnOnce() + Send + 'static,
{
    let mut job: Job = Box::new(f);
    let mut p = pool();
    p.running += 1;
    while let Some(thread) = p.idle.pop() {
        match thread.send(job) {
            Ok(()) => return Ok(()),
            // Not reachable (a thread never drops its queue), but the job is not lost.
            Err(mpsc::SendError(back)) => job = back,
        }
    }
    drop(p);
    let (queue, jobs) = mpsc::channel();
    let own = queue.clone();
    let _ = queue.send(job);
    let started = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || serve(own, jobs));
    if started.is_err() {
        pool().running -= 1;
    }
    started.map(drop)
}

/// A thread's life: run each job, then wait for the next. It holds a sender of its own queue,
/// so `recv` never fails and the thread never ends.
fn serve(own: mpsc::Sender<Job>, jobs: mpsc::Receiver<Job>) {
    while let Ok(job) = jobs.recv() {
        // A job that panics ends (the panic is reported by the hook); the thread goes on.
        let _ = std::panic::catch_unwind(AssertUnwindSafe(job));
        let mut p = pool();
        p.running -= 1;
        p.idle.push(own.clone());
        drop(p);
        JOB_ENDED.notify_all();
    }
}

/// Waits up to `timeout` for every job handed to [`spawn_db_thread`] to return (each returns
/// once its store is closed); returns whether all did. Call it after the stores are shut
/// down, before the process exits.
pub fn join_db_threads(timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut p = pool();
    while p.running > 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            tracing::warn!(
                running = p.running,
                "jobs that use RocksDB are still running"
            );
            return false;
        }
        p = JOB_ENDED
            .wait_timeout(p, left)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
    true
}

/// Joins `thread` if it ends before `deadline`; returns whether it did. `join` (not only
/// `is_finished`) so that its thread-exit work is over too.
pub fn join_until(thread: std::thread::JoinHandle<()>, deadline: Instant) -> bool {
    while !thread.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    if !thread.is_finished() {
        tracing::warn!(thread = ?thread.thread().name(), "a thread that used RocksDB is still running");
        return false;
    }
    let _ = thread.join();
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_threads_when_joined_until_a_deadline_then_only_the_ended_ones_count() {
        let ends = std::thread::spawn(|| std::thread::sleep(Duration::from_millis(20)));
        assert!(join_until(ends, Instant::now() + Duration::from_secs(10)));
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let stuck = std::thread::spawn(move || {
            let _ = wait.recv();
        });
        let started = Instant::now();
        assert!(
            !join_until(stuck, Instant::now() + Duration::from_millis(50)),
            "a thread still running is reported, not waited for"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "gave up at the deadline"
        );
        drop(release);
    }
}
