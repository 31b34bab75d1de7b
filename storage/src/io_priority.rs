//! I/O scheduling classes of a bookie's threads (Linux `ioprio_set`).
//!
//! A journal fdatasync that reaches the disk behind a flush of the write cache (megabytes of
//! entry log, then its own fdatasync) waits for it; so does one behind zero-filling a spare
//! journal file. The flusher thread, which does both and garbage collection, runs in the idle
//! class (`bookie.flusher_io_idle`): the disk's scheduler (mq-deadline and bfq honour classes)
//! serves the journal's requests first and the flusher's when none wait, its aging bounding
//! how long a flush is held back (mq-deadline's `prio_aging_expire`, 10 s by default); a
//! flush held back fills the write cache, and adds then wait for room as they do whenever
//! the disk cannot keep up. Writes that an fdatasync sends to the disk carry the class of the
//! thread that calls it. Where the scheduler ignores classes (`none`), this changes nothing.

use ioprio::{Class, Pid, Priority, Target};

/// The calling thread (`IOPRIO_WHO_PROCESS` with id 0 names the calling task).
fn this_thread() -> Target {
    Target::Process(Pid::from_raw(0))
}

/// Puts the calling thread's own I/O in the idle class.
pub fn idle_for_this_thread() -> std::io::Result<()> {
    ioprio::set_priority(this_thread(), Priority::new(Class::Idle)).map_err(std::io::Error::other)
}

/// Whether the calling thread's I/O is in the idle class.
pub fn is_idle_for_this_thread() -> std::io::Result<bool> {
    ioprio::get_priority(this_thread())
        .map(|p| p.class() == Some(Class::Idle))
        .map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    #[test]
    fn given_a_thread_put_in_the_idle_class_then_it_reads_back_and_other_threads_keep_theirs() {
        assert!(!super::is_idle_for_this_thread().expect("ioprio_get"));
        let idle = std::thread::spawn(|| {
            super::idle_for_this_thread().expect("ioprio_set");
            super::is_idle_for_this_thread().expect("ioprio_get")
        })
        .join()
        .unwrap();
        assert!(idle, "the thread that asked is idle");
        assert!(
            !super::is_idle_for_this_thread().unwrap(),
            "this thread unchanged"
        );
    }
}
