//! The threads of `spawn_db_thread` (the process's pool: this file is a test binary of its
//! own, so no other test's store holds one): a thread whose job returns is not ended but takes
//! the next job; joining waits for the jobs, not the threads.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use meridian_metadata::db_threads::{join_db_threads, spawn_db_thread};

#[test]
fn given_jobs_then_their_threads_are_reused_never_end_and_joining_waits_for_the_jobs() {
    let thread_of = |hold: Option<mpsc::Receiver<()>>| {
        let (tx, rx) = mpsc::channel();
        spawn_db_thread("db-threads-test", move || {
            tx.send(std::thread::current().id()).unwrap();
            if let Some(hold) = hold {
                let _ = hold.recv();
            }
        })
        .unwrap();
        rx.recv().unwrap()
    };
    let first = thread_of(None);
    assert!(join_db_threads(Duration::from_secs(10)));
    assert_eq!(thread_of(None), first, "an idle thread takes the next job");
    assert!(join_db_threads(Duration::from_secs(10)));

    let (release, hold) = mpsc::channel();
    let holding = thread_of(Some(hold));
    let other = thread_of(None);
    assert_ne!(other, holding, "a busy thread is not handed a job");
    let started = Instant::now();
    assert!(
        !join_db_threads(Duration::from_millis(100)),
        "a job still running is reported"
    );
    assert!(started.elapsed() >= Duration::from_millis(100));
    drop(release);
    assert!(join_db_threads(Duration::from_secs(10)));

    let (tx, rx) = mpsc::channel();
    spawn_db_thread("db-threads-test", move || {
        tx.send(std::thread::current().id()).unwrap();
        panic!("a job that panics");
    })
    .unwrap();
    let panicked = rx.recv().unwrap();
    assert!(
        join_db_threads(Duration::from_secs(10)),
        "a job that panicked has returned"
    );
    // The thread that went idle last takes the next job.
    assert_eq!(
        thread_of(None),
        panicked,
        "the thread of a job that panicked takes jobs still"
    );
    assert!(join_db_threads(Duration::from_secs(10)));
}
