//! I/O scheduling classes of a bookie's threads (Linux `ioprio_set`).
//!
//! A journal fdatasync that reaches the disk behind a flush of the write cache (megabytes of
//! entry log, then its own fdatasync) waits for it. The flusher thread does its routine
//! flushes and garbage collection in the idle class (`bookie.flusher_io_idle`): the disk's
//! scheduler (mq-deadline and bfq honour classes) serves the journal's requests first and the
//! flusher's when none wait, its aging bounding how long they are held back (mq-deadline's
//! `prio_aging_expire`, 10 s by default). What writers wait on goes in the default class: a
//! flush because the write cache is half full (adds wait for room once it is full), and the
//! next journal file's zero-fill (without it the journal grows files, and each fdatasync then
//! commits metadata). Writes that an fdatasync sends to the disk carry the class of the
//! thread that calls it; threads a thread starts inherit its class (RocksDB's background
//! threads, if the flusher's index writes start them, run idle). Where the scheduler ignores
//! classes (`none`), this changes nothing.

use ioprio::{Class, Pid, Priority, Target};

/// The calling thread (`IOPRIO_WHO_PROCESS` with id 0 names the calling task).
fn this_thread() -> Target {
    Target::Process(Pid::from_raw(0))
}

/// Puts the calling thread's own I/O in the idle class, or back in the default one.
pub fn set_idle_for_this_thread(idle: bool) -> std::io::Result<()> {
    let p = if idle {
        Priority::new(Class::Idle)
    } else {
        Priority::standard()
    };
    ioprio::set_priority(this_thread(), p).map_err(std::io::Error::other)
}

/// Whether the calling thread's I/O is in the idle class.
pub fn is_idle_for_this_thread() -> std::io::Result<bool> {
    ioprio::get_priority(this_thread())
        .map(|p| p.class() == Some(Class::Idle))
        .map_err(std::io::Error::other)
}

/// The flusher's class from one piece of work to the next: idle for routine flushes and
/// garbage collection, the default class for work that writers wait on. One system call per
/// change.
#[derive(Debug)]
pub struct FlusherClass {
    enabled: bool,
    idle: bool,
    warned: bool,
}

impl FlusherClass {
    /// `enabled`: `bookie.flusher_io_idle`; when off the thread keeps the default class.
    pub fn new(enabled: bool) -> Self {
        FlusherClass {
            enabled,
            idle: false,
            warned: false,
        }
    }

    /// Work that may wait until the disk has no other requests.
    pub fn background(&mut self) {
        self.set(true);
    }

    /// Work that writers wait on.
    pub fn urgent(&mut self) {
        self.set(false);
    }

    fn set(&mut self, idle: bool) {
        if !self.enabled || self.idle == idle {
            return;
        }
        match set_idle_for_this_thread(idle) {
            Ok(()) => self.idle = idle,
            Err(e) if !self.warned => {
                self.warned = true;
                tracing::warn!(error = %e, "could not change the flusher's I/O class");
            }
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn given_the_flushers_work_then_its_class_follows_and_other_threads_keep_theirs() {
        let before = super::is_idle_for_this_thread().expect("ioprio_get");
        let (background, urgent, again) = std::thread::spawn(|| {
            let mut class = super::FlusherClass::new(true);
            class.background();
            let background = super::is_idle_for_this_thread().expect("ioprio_get");
            class.urgent();
            let urgent = super::is_idle_for_this_thread().expect("ioprio_get");
            class.background();
            let again = super::is_idle_for_this_thread().expect("ioprio_get");
            (background, urgent, again)
        })
        .join()
        .unwrap();
        assert!(
            background && !urgent && again,
            "{background} {urgent} {again}"
        );
        assert_eq!(
            super::is_idle_for_this_thread().unwrap(),
            before,
            "this thread unchanged"
        );
        let off = std::thread::spawn(|| {
            let mut class = super::FlusherClass::new(false);
            class.background();
            super::is_idle_for_this_thread().expect("ioprio_get")
        })
        .join()
        .unwrap();
        assert_eq!(
            off, before,
            "bookie.flusher_io_idle = false changes nothing"
        );
    }
}
