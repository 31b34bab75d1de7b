//! Journal throughput against this disk's own limit, in one run.
//!
//! `cargo bench -p meridian-storage --bench journal -- [--entries N] [--entry-bytes B]
//! [--window W] [--dir DIR] [--flush-delay-us U] [--batch-bytes-max B]`
//!
//! Prints: the disk's fsync'd sequential write bandwidth (1 MiB writes, fdatasync after each)
//! and fsyncs per second of 4 KiB appends; then the journal with `window` appends in flight:
//! entries/s, MB/s, records per fsync, and acknowledgement latency percentiles.

use std::io::Write;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use meridian_storage::journal::{Journal, JournalOptions, Record, RecordKind};

struct Args {
    entries: u64,
    entry_bytes: usize,
    window: usize,
    dir: std::path::PathBuf,
    flush_delay_us: u64,
    batch_bytes_max: usize,
}

fn args() -> Args {
    let mut a = Args {
        entries: 200_000,
        entry_bytes: 1024,
        window: 1000,
        dir: std::env::temp_dir(),
        flush_delay_us: 0,
        batch_bytes_max: 1 << 20,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().expect("a value after the flag");
        match k.as_str() {
            "--entries" => a.entries = v().parse().expect("number"),
            "--entry-bytes" => a.entry_bytes = v().parse().expect("number"),
            "--window" => a.window = v().parse().expect("number"),
            "--dir" => a.dir = v().into(),
            "--flush-delay-us" => a.flush_delay_us = v().parse().expect("number"),
            "--batch-bytes-max" => a.batch_bytes_max = v().parse().expect("number"),
            "--bench" => {}
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

fn disk_probe(dir: &std::path::Path) {
    let path = dir.join("meridian-disk-probe");
    let mut f = std::fs::File::create(&path).expect("probe file");
    let block = vec![0x5au8; 1 << 20];
    let t = Instant::now();
    let mut n = 0u64;
    while t.elapsed() < Duration::from_secs(3) {
        f.write_all(&block).expect("write");
        f.sync_data().expect("fdatasync");
        n += 1;
    }
    let mbps = n as f64 / t.elapsed().as_secs_f64() * 1.048576;
    drop(f);
    let mut f = std::fs::File::create(&path).expect("probe file");
    let small = vec![0x5au8; 4096];
    let t = Instant::now();
    let mut m = 0u64;
    while t.elapsed() < Duration::from_secs(2) {
        f.write_all(&small).expect("write");
        f.sync_data().expect("fdatasync");
        m += 1;
    }
    let _ = std::fs::remove_file(&path);
    println!(
        "disk ({}): {mbps:.0} MB/s sequential with an fdatasync after every 1 MiB; {:.0} fdatasyncs/s of 4 KiB appends",
        dir.display(),
        m as f64 / t.elapsed().as_secs_f64()
    );
}

fn main() {
    let a = args();
    disk_probe(&a.dir);
    let dir = tempfile::tempdir_in(&a.dir).expect("tempdir");
    let (journal, thread) = Journal::start(JournalOptions {
        dir: dir.path().to_path_buf(),
        batch_bytes_max: a.batch_bytes_max,
        flush_delay_us: a.flush_delay_us,
        file_bytes_max: 512 << 20,
        preallocate_bytes: 64 << 20,
        queue_records_max: a.window.max(1),
        fsync: true,
        prefill: true,
        drop_synced_pages: false,
    })
    .expect("journal");
    let in_flight = Arc::new((Mutex::new(0usize), Condvar::new()));
    let (lat_tx, lat_rx) = mpsc::channel::<u64>();
    let payload = vec![0xa5u8; a.entry_bytes];
    let start = Instant::now();
    for i in 0..a.entries {
        {
            let (m, cv) = &*in_flight;
            let mut n = m.lock().expect("lock");
            while *n >= a.window {
                n = cv.wait(n).expect("wait");
            }
            *n += 1;
        }
        let sent = Instant::now();
        let in_flight = Arc::clone(&in_flight);
        let lat_tx = lat_tx.clone();
        journal.append(
            Record {
                kind: RecordKind::Add,
                ledger_id: 1,
                entry_id: i,
                data: payload.clone(),
                tail: bytes::Bytes::new(),
            },
            Box::new(move |r| {
                r.expect("journal append");
                let _ = lat_tx.send(sent.elapsed().as_micros() as u64);
                let (m, cv) = &*in_flight;
                *m.lock().expect("lock") -= 1;
                cv.notify_one();
            }),
        );
    }
    drop(lat_tx);
    let mut hist = hdrhistogram::Histogram::<u64>::new(3).expect("histogram");
    for us in lat_rx.iter() {
        hist.record(us).expect("record");
    }
    let elapsed = start.elapsed().as_secs_f64();
    let stats = journal.stats();
    let syncs = stats.syncs.load(std::sync::atomic::Ordering::Relaxed);
    let bytes = stats.bytes.load(std::sync::atomic::Ordering::Relaxed);
    drop(journal);
    thread.join();
    println!(
        "journal: {} entries of {} B, window {}: {:.0} entries/s, {:.0} MB/s, {:.1} entries per fsync ({} fsyncs); ack latency p50 {:.2} ms p99 {:.2} ms p99.9 {:.2} ms max {:.2} ms",
        a.entries,
        a.entry_bytes,
        a.window,
        a.entries as f64 / elapsed,
        bytes as f64 / elapsed / 1e6,
        a.entries as f64 / syncs.max(1) as f64,
        syncs,
        hist.value_at_quantile(0.5) as f64 / 1000.0,
        hist.value_at_quantile(0.99) as f64 / 1000.0,
        hist.value_at_quantile(0.999) as f64 / 1000.0,
        hist.max() as f64 / 1000.0,
    );
}
