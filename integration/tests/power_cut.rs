//! Power cuts through the power-loss file system (`meridian_integration::powercut`): every
//! process of a role runs on it, is killed -9 at a random moment under load, and everything
//! not fsynced is then dropped, as a power cut would (in turn: all of it; all but a torn
//! prefix of the last write; a random half of the unsynced pages kept). Every acknowledged message, entry and
//! metadata write must survive every cut.
//!
//! `MERIDIAN_POWER_CUTS` sets the cuts per role (5 in the README's test command; the long
//! runs reported in the README used 50 and more); `MERIDIAN_POWER_CUT_SEED` replays a run (each
//! test prints its seed). A machine without FUSE skips these tests with a message.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use meridian_integration::powercut::PowerCutFs;
use meridian_integration::{
    assert_acked_consumed_in_order, meridian_bin, recover_ledger, run_cli, start_serving, step,
    wait_for_bookies, BookieProc, MetaCluster, MetaNode, PyClient, StandaloneProc,
};
use rand::{Rng, SeedableRng};

const T: Duration = Duration::from_secs(120);

fn cuts() -> usize {
    std::env::var("MERIDIAN_POWER_CUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5)
}

/// The run's seed, printed so that a failure can be replayed.
fn rng(test: &str) -> rand::rngs::StdRng {
    let seed = std::env::var("MERIDIAN_POWER_CUT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock")
                .as_nanos() as u64
        });
    step(format!(
        "{test}: MERIDIAN_POWER_CUT_SEED={seed}, {} cuts",
        cuts()
    ));
    rand::rngs::StdRng::seed_from_u64(seed)
}

/// Mounts the file system in `dir`, or says why it cannot and returns None (the test skips).
fn mount(dir: &tempfile::TempDir) -> Option<PowerCutFs> {
    if let Some(why) = PowerCutFs::unavailable() {
        eprintln!("SKIPPED: the power-loss file system needs FUSE: {why}");
        return None;
    }
    Some(PowerCutFs::mount(&dir.path().join("backing"), &dir.path().join("mnt")).expect("mount"))
}

#[test]
fn powercut_fs_keeps_exactly_what_was_synced() {
    let dir = tempfile::tempdir().unwrap();
    let Some(fs) = mount(&dir) else { return };
    let m = fs.mountpoint.clone();

    step("a: 8 KiB written and fsynced, then 4 KiB appended and 1 KiB overwritten unsynced");
    let a = std::fs::OpenOptions::new()
        .create_new(true)
        .read(true)
        .write(true)
        .open(m.join("a"))
        .unwrap();
    a.write_all_at(&[1u8; 8192], 0).unwrap();
    a.sync_data().unwrap();
    a.write_all_at(&[2u8; 4096], 8192).unwrap();
    a.write_all_at(&[3u8; 1024], 100).unwrap();
    assert_eq!(
        std::fs::read(m.join("a")).unwrap().len(),
        12_288,
        "reads see unsynced bytes"
    );

    step("b: created and written, never synced; c: written through O_DSYNC");
    std::fs::write(m.join("b"), b"never synced").unwrap();
    let c = std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .custom_flags(libc::O_DSYNC)
        .open(m.join("c"))
        .unwrap();
    c.write_all_at(b"synchronous", 0).unwrap();

    step("d: synced at 10 KiB, truncated to 1 KiB and synced, grown unsynced");
    let d = std::fs::OpenOptions::new()
        .create_new(true)
        .read(true)
        .write(true)
        .open(m.join("d"))
        .unwrap();
    d.write_all_at(&[4u8; 10_240], 0).unwrap();
    d.sync_all().unwrap();
    d.set_len(1024).unwrap();
    d.sync_all().unwrap();
    d.write_all_at(&[5u8; 10], 5000).unwrap();

    step("the root directory fsynced: a to d are named for good");
    sync_dir(&m);

    step("e: written, fsynced and renamed in dir/, and dir/ fsynced: the new name stays");
    std::fs::create_dir(m.join("dir")).unwrap();
    sync_dir(&m);
    std::fs::write(m.join("dir/e.tmp"), b"renamed").unwrap();
    std::fs::File::open(m.join("dir/e.tmp"))
        .unwrap()
        .sync_all()
        .unwrap();
    std::fs::rename(m.join("dir/e.tmp"), m.join("dir/e")).unwrap();
    sync_dir(&m.join("dir"));

    step("f: created and fsynced, its directory not: gone; e moved and b removed without a directory fsync: back");
    let f = std::fs::File::create_new(m.join("dir/f")).unwrap();
    f.write_all_at(b"unnamed", 0).unwrap();
    f.sync_all().unwrap();
    std::fs::rename(m.join("dir/e"), m.join("e-moved")).unwrap();
    std::fs::remove_file(m.join("b")).unwrap();
    drop((a, c, d, f));

    let report = fs.cut();
    step(format!("cut: {report:?}"));
    assert_eq!(report.files, 2, "a and d: {report:?}");
    assert_eq!(report.names.undone, 3, "{report:?}");
    let a = std::fs::read(m.join("a")).unwrap();
    assert_eq!(a, vec![1u8; 8192], "a keeps its synced 8 KiB only");
    assert_eq!(std::fs::read(m.join("b")).unwrap(), b"", "b is back, empty");
    assert_eq!(std::fs::read(m.join("c")).unwrap(), b"synchronous");
    assert_eq!(std::fs::read(m.join("d")).unwrap(), vec![4u8; 1024]);
    assert_eq!(std::fs::read(m.join("dir/e")).unwrap(), b"renamed");
    assert!(!m.join("dir/e.tmp").exists());
    assert!(!m.join("e-moved").exists());
    assert!(
        !m.join("dir/f").exists(),
        "a name its directory never synced"
    );

    step("torn: the last unsynced write keeps a prefix, earlier unsynced writes are gone");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.join("a"))
        .unwrap();
    f.write_all_at(&[6u8; 100], 0).unwrap();
    f.write_all_at(&[7u8; 4096], 8192).unwrap();
    drop(f);
    let report = fs.cut_torn(7).unwrap();
    let kept = report.torn_kept.expect("a torn write");
    let a = std::fs::read(m.join("a")).unwrap();
    // The kernel may pass one write(2) on in several FUSE writes (seen once under load: the
    // file then ended at 10,202 bytes): the torn one is the last of them, its prefix lands at
    // its own offset, and what lies between is a hole.
    assert!(
        (8192 + kept..=8192 + 4096).contains(&a.len()) && kept < 4096,
        "{} bytes: {report:?}",
        a.len()
    );
    assert!(
        a[..8192].iter().all(|&b| b == 1),
        "the first write is not kept"
    );
    assert!(
        a[a.len() - kept..].iter().all(|&b| b == 7),
        "the torn prefix"
    );
    assert!(a[8192..].iter().all(|&b| b == 7 || b == 0));

    step("partial: of 16 unsynced pages over synced ones, some reach the disk, whole");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.join("a"))
        .unwrap();
    f.set_len(0).unwrap();
    f.write_all_at(&[8u8; 16 * 4096], 0).unwrap();
    f.sync_data().unwrap();
    f.write_all_at(&[9u8; 16 * 4096], 0).unwrap();
    drop(f);
    let report = fs.cut_partial(3).unwrap();
    let kept = report.pages_kept.expect("a partial cut");
    let a = std::fs::read(m.join("a")).unwrap();
    assert_eq!(a.len(), 16 * 4096);
    let new_pages = a.chunks(4096).filter(|p| p.iter().all(|&b| b == 9)).count();
    let old_pages = a.chunks(4096).filter(|p| p.iter().all(|&b| b == 8)).count();
    assert_eq!((new_pages, old_pages), (kept, 16 - kept), "{report:?}");
    assert!(
        kept > 0 && kept < 16,
        "seed 3 keeps some pages, not all: {kept}"
    );
    let counters = fs.counters();
    assert_eq!(counters.cuts, 3);
    assert!(counters.syncs >= 4, "{counters:?}");
}

#[test]
fn powercut_fs_full_refuses_what_needs_space_and_takes_overwrites() {
    let dir = tempfile::tempdir().unwrap();
    let Some(fs) = mount(&dir) else { return };
    let m = fs.mountpoint.clone();
    let a = std::fs::OpenOptions::new()
        .create_new(true)
        .read(true)
        .write(true)
        .open(m.join("a"))
        .unwrap();
    a.write_all_at(&[1u8; 4096], 0).unwrap();
    let avail = |p: &std::path::Path| rustix::fs::statvfs(p).unwrap().f_bavail;
    assert!(avail(&m) > 0);

    step("the host's reserved blocks are neither free nor part of the total (as df's Use% leaves them out)");
    let (inside, host) = (
        rustix::fs::statvfs(&m).unwrap(),
        rustix::fs::statvfs(dir.path()).unwrap(),
    );
    assert_eq!(inside.f_bfree, inside.f_bavail);
    let host_total = host
        .f_blocks
        .saturating_sub(host.f_bfree.saturating_sub(host.f_bavail));
    assert!(
        inside.f_blocks.abs_diff(host_total) < 4096,
        "{} blocks inside, {host_total} the host's without its reserve",
        inside.f_blocks
    );

    step("full: appends, reservations, new files and directories fail with ENOSPC");
    fs.set_full(true);
    let enospc = |r: std::io::Result<()>| {
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::ENOSPC));
    };
    enospc(a.write_all_at(b"more", 4096));
    enospc(std::fs::write(m.join("b"), b"new"));
    enospc(std::fs::create_dir(m.join("d")));
    enospc(
        rustix::fs::fallocate(&a, rustix::fs::FallocateFlags::empty(), 0, 1 << 20)
            .map_err(std::io::Error::from),
    );
    assert_eq!(avail(&m), 0, "no free block shows");
    step("... but not writes into space reserved before (fallocate, KEEP_SIZE)");
    fs.set_full(false);
    let r = std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .open(m.join("r"))
        .unwrap();
    rustix::fs::fallocate(&r, rustix::fs::FallocateFlags::KEEP_SIZE, 0, 8192).unwrap();
    fs.set_full(true);
    r.write_all_at(&[7u8; 8192], 0).unwrap();
    enospc(r.write_all_at(b"x", 8192));
    step("... while overwrites, syncs and reads go on");
    a.write_all_at(&[2u8; 100], 0).unwrap();
    a.sync_data().unwrap();
    assert_eq!(std::fs::read(m.join("a")).unwrap()[..100], [2u8; 100]);

    step("space back: an append works again");
    fs.set_full(false);
    a.write_all_at(b"more", 4096).unwrap();
    assert!(avail(&m) > 0);
    assert_eq!(std::fs::read(m.join("a")).unwrap().len(), 4100);
}

/// fsync of a directory: its names are durable.
fn sync_dir(path: &std::path::Path) {
    std::fs::File::open(path).unwrap().sync_all().unwrap();
}

/// Cuts power (the role's processes are already killed): the `n`th cut of a test drops every
/// unsynced byte, tears the last unsynced write, or keeps a random half of the unsynced pages,
/// in turn.
fn cut_now(fs: &PowerCutFs, rng: &mut impl Rng, n: usize) -> String {
    let report = match n % 3 {
        0 => fs.cut(),
        1 => fs.cut_torn(rng.gen()).expect("torn cut"),
        _ => fs.cut_partial(rng.gen()).expect("partial cut"),
    };
    let mode = match (report.torn_kept, report.pages_kept) {
        (Some(k), _) => format!(", torn: last write kept {k} bytes"),
        (_, Some(p)) => format!(", partial: {p} pages reached the disk"),
        _ => String::new(),
    };
    format!(
        "cut: {} files, {} KiB unsynced{mode}; names undone: {:?}",
        report.files,
        report.bytes / 1024,
        report.names.changes
    )
}

#[test]
fn given_standalone_on_powercut_fs_when_power_is_cut_under_load_then_every_acknowledged_message_survives(
) {
    let dir = tempfile::tempdir().unwrap();
    let Some((fs, mut rng, mut s)) = standalone_on_powercut_fs(&dir, "standalone") else {
        return;
    };
    let mut topics: Vec<(String, BTreeSet<u64>)> = Vec::new();
    for cut in 0..cuts() {
        s.start().expect("standalone starts");
        let topic = format!("power-{cut}");
        let receipts = rng.gen_range(200..4000);
        let batch = rng.gen_bool(0.5);
        let url = s.url.clone();
        let mut args = vec![
            "produce",
            url.as_str(),
            topic.as_str(),
            "--count",
            "1000000",
        ];
        if batch {
            args.push("--batch");
        }
        let (acked, report) = produce_then_cut(&dir, &mut s, &fs, &mut rng, cut, &args, receipts);
        step(format!(
            "cut {cut}: {} acknowledged on {topic} (batch {batch}); {report}",
            acked.len()
        ));
        topics.push((topic, acked));

        s.start().expect("restart after the cut");
        let (topic, acked) = topics.last().expect("this cut's topic");
        check_topic(&dir, &s, &format!("c{cut}"), topic, acked);
        s.kill9().unwrap();
    }
    step("every topic of every cut, read again after the last one");
    s.start().expect("start");
    for (i, (topic, acked)) in topics.iter().enumerate() {
        check_topic(&dir, &s, &format!("final{i}"), topic, acked);
    }
    assert_eq!(s.stop().unwrap(), 0, "{}", s.log_text());
}

/// Single write with recycled journal files: each round fills a scratch topic over several
/// 1 MiB journal files and deletes it, so garbage collection retires those files and one
/// becomes the journal's spare; the next journal file is made from it (its old records still in
/// it), and power is cut while a producer writes there. Every acknowledged message survives.
#[test]
fn given_journal_files_recycled_by_gc_when_power_is_cut_under_load_then_every_acknowledged_message_survives(
) {
    let dir = tempfile::tempdir().unwrap();
    let Some((fs, mut rng, mut s)) = standalone_on_powercut_fs(&dir, "recycled") else {
        return;
    };
    s.env("MERIDIAN_BOOKIE_JOURNAL_FILE_BYTES_MAX", "1048576")
        .env("MERIDIAN_BOOKIE_GC_INTERVAL_MS", "200");
    let spare = s.data_dir.join("bookie/journal/journal-spare.log");
    let mut topics: Vec<(String, BTreeSet<u64>)> = Vec::new();
    let mut recycled = 0;
    for cut in 0..cuts() {
        s.start().expect("standalone starts");
        let scratch = format!("persistent://public/default/scratch-{cut}");
        meridian_integration::perf_produce(&s.url, &scratch, 4000);
        let (code, out, err) = meridian_integration::run_admin(&[
            "--admin-url",
            &s.admin_url,
            "topics",
            "delete",
            &scratch,
            "--force",
        ])
        .unwrap();
        assert_eq!(code, 0, "{out}{err}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !spare.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if spare.exists() {
            recycled += 1;
        }
        let topic = format!("recycled-{cut}");
        let receipts = rng.gen_range(2000..6000);
        let url = s.url.clone();
        let args = [
            "produce",
            url.as_str(),
            topic.as_str(),
            "--count",
            "1000000",
        ];
        let (acked, report) = produce_then_cut(&dir, &mut s, &fs, &mut rng, cut, &args, receipts);
        step(format!(
            "cut {cut}: {} acknowledged on {topic} after a spare was {}; {report}",
            acked.len(),
            if spare.exists() { "left" } else { "taken" }
        ));
        topics.push((topic, acked));
        s.start().expect("restart after the cut");
        let (topic, acked) = topics.last().expect("this cut's topic");
        check_topic(&dir, &s, &format!("c{cut}"), topic, acked);
        s.kill9().unwrap();
    }
    assert!(
        recycled > 0,
        "no collected journal file became the spare:\n{}",
        s.log_text()
    );
    step("every topic of every cut, read again after the last one");
    s.start().expect("start");
    for (i, (topic, acked)) in topics.iter().enumerate() {
        check_topic(&dir, &s, &format!("final{i}"), topic, acked);
    }
    assert_eq!(s.stop().unwrap(), 0, "{}", s.log_text());
}

/// The power-loss file system mounted in `dir`, the seeded generator of `test`, and a
/// standalone (not started) whose data directory is on that file system; `None` without FUSE.
fn standalone_on_powercut_fs(
    dir: &tempfile::TempDir,
    test: &str,
) -> Option<(PowerCutFs, rand::rngs::StdRng, StandaloneProc)> {
    let fs = mount(dir)?;
    let mut s = StandaloneProc::new(dir.path());
    s.data_dir = fs.mountpoint.join("standalone");
    Some((fs, rng(test), s))
}

/// Runs the Python client with `args` until `receipts` sends are acknowledged, kills the
/// standalone at a random moment soon after and cuts the power: what was acknowledged, and
/// what the cut did.
fn produce_then_cut(
    dir: &tempfile::TempDir,
    s: &mut StandaloneProc,
    fs: &PowerCutFs,
    rng: &mut rand::rngs::StdRng,
    cut: usize,
    args: &[&str],
    receipts: usize,
) -> (BTreeSet<u64>, String) {
    let mut p = PyClient::run(dir.path(), &format!("p{cut}"), args);
    p.wait_for("receipts", T, |l| {
        l.iter().filter(|v| v.get("acked").is_some()).count() >= receipts
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(rng.gen_range(0..300)));
    s.kill9().unwrap();
    let report = cut_now(fs, rng, cut);
    p.kill9();
    (p.ints("acked").into_iter().collect(), report)
}

fn check_topic(
    dir: &tempfile::TempDir,
    s: &StandaloneProc,
    name: &str,
    topic: &str,
    acked: &BTreeSet<u64>,
) {
    let count = acked.last().map(|l| l + 1).unwrap_or(0).to_string();
    let mut c = PyClient::run(
        dir.path(),
        name,
        &[
            "consume",
            &s.url,
            topic,
            name,
            "--count",
            &count,
            "--timeout-ms",
            "5000",
        ],
    );
    c.finish(T).unwrap();
    assert_acked_consumed_in_order(
        acked,
        &c.ints("i"),
        &format!("{topic}, after a power cut:\n{}", s.log_text()),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_bookies_on_powercut_fs_when_power_is_cut_under_load_then_every_acknowledged_entry_survives(
) {
    let dir = tempfile::tempdir().unwrap();
    let Some(fs) = mount(&dir) else { return };
    let mut rng = rng("bookies");
    let cluster = MetaCluster::start(1).await.expect("metadata node");
    let endpoint = cluster.endpoints()[0].clone();
    let client = cluster.client();
    let mut bookies: Vec<BookieProc> = (0..3)
        .map(|i| {
            let mut b = BookieProc::new(&format!("bookie{i}"), dir.path(), &endpoint);
            b.dir = fs.mountpoint.join(format!("bookie{i}"));
            b
        })
        .collect();
    let mut ledgers: Vec<(String, u64)> = Vec::new();
    for cut in 0..cuts() {
        start_serving(&mut bookies).await;
        wait_for_bookies(&client, 3, Duration::from_secs(30))
            .await
            .expect("bookies registered");
        let stop_at = rng.gen_range(1..40) * 1000;
        let (qw, qa) = if rng.gen_bool(0.5) { (2, 2) } else { (3, 2) };
        let mut perf = Command::new(meridian_bin())
            .args(["perf", "ledger", "--metadata", &endpoint])
            .args(["--ensemble", "3", "--write-quorum", &qw.to_string()])
            .args(["--ack-quorum", &qa.to_string()])
            .args(["--entries", "10000000", "--entry-size", "512"])
            .args(["--window", "500", "--progress-every", "1000"])
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("perf");
        let mut lines = BufReader::new(perf.stdout.take().expect("stdout")).lines();
        let (mut ledger, mut acked) = (String::new(), 0u64);
        for line in lines.by_ref() {
            let line = line.expect("line");
            if let Some(rest) = line.strip_prefix("perf ledger: ledger ") {
                ledger = rest.split(',').next().expect("id").to_string();
            }
            if let Some(n) = line.strip_prefix("acknowledged ") {
                acked = n.parse().expect("count");
                if acked >= stop_at {
                    break;
                }
            }
        }
        assert!(acked >= stop_at, "the writer stopped at {acked}");
        for b in &mut bookies {
            b.kill9().expect("kill -9");
        }
        let report = cut_now(&fs, &mut rng, cut);
        let _ = perf.kill();
        let _ = perf.wait();
        step(format!(
            "cut {cut}: ledger {ledger}, at least {acked} entries acknowledged (Qw={qw} Qa={qa}); {report}"
        ));

        start_serving(&mut bookies).await;
        wait_for_bookies(&client, 3, Duration::from_secs(30))
            .await
            .expect("bookies registered after the cut");
        let last = recover_ledger(&endpoint, &ledger);
        assert!(
            last + 1 >= acked,
            "ledger {ledger} closed at {last} after a power cut, but {acked} entries were acknowledged"
        );
        check_ledger(&endpoint, &ledger, last + 1);
        ledgers.push((ledger, last + 1));
        for b in &mut bookies {
            b.kill9().expect("kill -9");
        }
    }
    step("every ledger of every cut, read again after the last one");
    start_serving(&mut bookies).await;
    for (ledger, entries) in &ledgers {
        check_ledger(&endpoint, ledger, *entries);
    }
}

/// `ledger check`: all `entries` entries read back, none unreadable.
fn check_ledger(endpoint: &str, ledger: &str, entries: u64) {
    let (code, out, err) =
        run_cli(&["ledger", "check", ledger, "--metadata", endpoint]).expect("check");
    assert_eq!(code, 0, "check {ledger}: {out}{err}");
    assert!(
        out.contains(&format!("ledger {ledger}: {entries} entries,"))
            && out.contains(" 0 unreadable"),
        "ledger {ledger}: {out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_metadata_nodes_on_powercut_fs_when_power_is_cut_under_load_then_every_acknowledged_write_survives(
) {
    let dir = tempfile::tempdir().unwrap();
    let Some(fs) = mount(&dir) else { return };
    let mut rng = rng("metadata");
    let mut nodes: Vec<MetaNode> = (1..=3)
        .map(|id| {
            let mut n = MetaNode::new(id, dir.path(), None);
            n.data_dir = fs.mountpoint.join(format!("node{id}"));
            n
        })
        .collect();
    meridian_integration::make_members(&mut nodes);
    let endpoints: Vec<String> = nodes.iter().map(|n| n.addr.clone()).collect();
    // key → value of every acknowledged put, over all cuts.
    let acked: std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>> = Default::default();
    for cut in 0..cuts() {
        for n in &mut nodes {
            n.start().expect("node");
        }
        let client = meridian_metadata::MetadataClient::connect_to(&endpoints).expect("client");
        wait_writable(&client).await;
        let before = acked.lock().unwrap().len();
        let run_ms = rng.gen_range(200..2500);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut writers = Vec::new();
        for w in 0..8 {
            let (client, acked, stop) = (client.clone(), acked.clone(), stop.clone());
            writers.push(tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let key = format!("/power/c{cut}/w{w}/{i}");
                    let value = format!("v{cut}-{w}-{i}");
                    if client.put(&key, value.clone()).await.is_ok() {
                        acked.lock().unwrap().push((key, value));
                    }
                    i += 1;
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(run_ms)).await;
        for n in &mut nodes {
            n.kill9().expect("kill -9");
        }
        let report = cut_now(&fs, &mut rng, cut);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for w in writers {
            let _ = tokio::time::timeout(Duration::from_secs(30), w).await;
        }
        let all = acked.lock().unwrap().clone();
        assert!(
            all.len() > before,
            "cut {cut}: no put acknowledged before it"
        );
        step(format!(
            "cut {cut}: {} puts acknowledged in {run_ms} ms; {report}",
            all.len() - before
        ));

        for n in &mut nodes {
            n.start().expect("restart");
        }
        let client = meridian_metadata::MetadataClient::connect_to(&endpoints).expect("client");
        // Every acknowledged put of every cut so far, against one linearizable scan: first
        // before any write (a leader back from the cut may still lead its term, with a
        // commit index from before its last writes; a write would commit past them and hide
        // a read served from behind its log), then once the cluster takes writes again.
        for when in ["before any write", "once writable"] {
            if when == "once writable" {
                wait_writable(&client).await;
            }
            let stored = scan(&client, "/power/c").await;
            let lost: Vec<&String> = all
                .iter()
                .filter(|(key, value)| stored.get(key).map(Vec::as_slice) != Some(value.as_bytes()))
                .map(|(key, _)| key)
                .collect();
            assert!(
                lost.is_empty(),
                "acknowledged puts not read after a power cut ({when}): {:?} ({} of {})\n{}",
                &lost[..lost.len().min(10)],
                lost.len(),
                all.len(),
                nodes[0].log_text()
            );
        }
        for n in &mut nodes {
            n.kill9().expect("kill -9");
        }
    }
}

/// Every key under `prefix` with its value, page by page (a page the cluster cannot answer
/// yet, just after a restart, is asked again for up to 60 s).
async fn scan(
    client: &meridian_metadata::MetadataClient,
    prefix: &str,
) -> std::collections::HashMap<String, Vec<u8>> {
    let mut out = std::collections::HashMap::new();
    let mut after = String::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let page = match client.list(prefix, &after, 0).await {
            Ok(page) => page,
            Err(e) => {
                assert!(Instant::now() < deadline, "no answer within 60 s: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        for kv in page.kvs {
            after = kv.key.clone();
            out.insert(kv.key, kv.value);
        }
        if !page.more {
            return out;
        }
    }
}

/// Waits until the cluster accepts a write.
async fn wait_writable(client: &meridian_metadata::MetadataClient) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if client.put("/power/probe", "x").await.is_ok() {
            return;
        }
        assert!(Instant::now() < deadline, "no writable cluster within 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A process the test started, killed (by its PID) and reaped when the test ends, a failing
/// one too.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A bookie's disk that fills up and frees again, many times, under as much load as the
/// machine takes: the process must live through every one (no abort in the index's RocksDB, no
/// panic), take writes again once the space is back, lose nothing it acknowledged, and stop
/// cleanly. Only the bookie's directories are on the power-loss file system (a full disk under
/// the metadata store is another fault). `MERIDIAN_DISK_FULL_SECONDS` sets the length (30 s in
/// the README's test command).
#[test]
fn given_a_bookie_disk_that_fills_and_frees_under_load_then_the_standalone_lives_and_keeps_what_it_acknowledged(
) {
    let dir = tempfile::tempdir().unwrap();
    let Some(fs) = mount(&dir) else { return };
    let mut rng = rng("disk-full");
    let seconds: u64 = std::env::var("MERIDIAN_DISK_FULL_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let mut s = StandaloneProc::new(dir.path());
    std::fs::create_dir_all(&s.data_dir).unwrap();
    std::fs::create_dir_all(fs.mountpoint.join("bookie")).unwrap();
    std::os::unix::fs::symlink(fs.mountpoint.join("bookie"), s.data_dir.join("bookie")).unwrap();
    s.start().expect("standalone starts");
    let log_tail = |s: &StandaloneProc| {
        let log = s.log_text();
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    };
    // As much load as the machine takes, batched, on four topics (our client)...
    let out = dir.path().join("perf.out");
    let mut perf = Reaped(
        Command::new(meridian_bin())
            .args(["perf", "produce", "--url", &s.url, "--topic", "load"])
            .args(["--topics", "4", "--size", "1024", "--report-every", "600"])
            .args(["--seconds", &(seconds + 5).to_string()])
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // ... and a stock client whose acknowledged sends are checked at the end.
    let mut p = PyClient::run(
        dir.path(),
        "acked",
        &["produce", &s.url, "acked", "--count", "100000000"],
    );
    let started = Instant::now();
    let mut fills = 0;
    while started.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(Duration::from_millis(rng.gen_range(200..1500)));
        fs.set_full(true);
        fills += 1;
        std::thread::sleep(Duration::from_millis(rng.gen_range(100..2000)));
        fs.set_full(false);
        if let Some(how) = s.exited() {
            panic!(
                "the standalone ended after {fills} fills ({how}):\n{}",
                log_tail(&s)
            );
        }
    }
    let _ = perf.0.wait();
    p.kill9();
    let acked: BTreeSet<u64> = p.ints("acked").into_iter().collect();
    let log = s.log_text();
    step(format!(
        "{fills} fills; {} sends acknowledged to the stock client; read-only until the disk \
         frees up {} times, for good {} times; {}",
        acked.len(),
        log.matches("read-only until the disk frees up").count(),
        log.matches("read-only from now on").count(),
        std::fs::read_to_string(&out).unwrap_or_default().trim()
    ));
    assert!(!acked.is_empty(), "nothing acknowledged:\n{}", log_tail(&s));
    // Possible by design, and rare: the disk fills during a write of the index that needs
    // new space (RocksDB preallocates its log), which leaves the bookie read-only until it
    // restarts. Seen in none of the runs so far; if it shows, it is worth a look.
    assert!(
        !log.contains("read-only from now on"),
        "the bookie went read-only for good:\n{}",
        log_tail(&s)
    );
    step("with the space back, the bookie takes writes again");
    meridian_integration::perf_produce(&s.url, "after-full", 100);
    check_topic(&dir, &s, "c-acked", "acked", &acked);
    let code = s.stop().unwrap();
    assert_eq!(code, 0, "the standalone's exit:\n{}", log_tail(&s));
}

/// The journal on a disk that fills up: a record for which no space can be reserved in the
/// file, or that needs the next file when none can be made, is refused with `NoSpace`, and
/// nothing of it is written; the journal is not failed for good, takes records again once the
/// space is back, and replays exactly the records it acknowledged, in order.
#[test]
fn given_a_full_disk_then_the_journal_refuses_records_for_a_while_and_takes_them_again() {
    use meridian_storage::journal::{self, Journal, JournalError, JournalOptions, Record};
    let dir = tempfile::tempdir().unwrap();
    let Some(fs) = mount(&dir) else { return };
    let opts = JournalOptions {
        dir: fs.mountpoint.join("journal"),
        batch_bytes_max: 64 << 10,
        flush_delay_us: 0,
        file_bytes_max: 1 << 20,
        preallocate_bytes: 256 << 10,
        queue_records_max: 1024,
        fsync: true,
        prefill: false,
        drop_synced_pages: false,
    };
    let (j, thread) = Journal::start(opts.clone()).unwrap();
    let record = |i: u64| Record {
        kind: journal::RecordKind::Add,
        ledger_id: 1,
        entry_id: i,
        data: vec![(i % 251) as u8; 10_000],
        tail: Default::default(),
    };
    let append = |i: u64| {
        let (tx, rx) = std::sync::mpsc::channel();
        j.append(record(i), Box::new(move |r| tx.send(r).unwrap()));
        rx.recv_timeout(Duration::from_secs(30)).unwrap()
    };
    let mut acked = Vec::new();
    let mut next = 0;
    // Twice: the disk fills in the middle of a file (room must be reserved for the next
    // records), then near a file's end (the next file must be made).
    for (offset, path, why) in [
        (300_000, "reserving room", "No space left on device"),
        (
            950_000,
            "starting the next file",
            "the next journal file could not be started",
        ),
    ] {
        step(format!("a full disk while {path}"));
        loop {
            let pos = append(next).expect("acknowledged");
            acked.push(next);
            next += 1;
            if pos.offset >= offset && pos.offset < offset + 100_000 {
                break;
            }
        }
        fs.set_full(true);
        let mut refused = Vec::new();
        for _ in 0..60 {
            match append(next) {
                Ok(_) => acked.push(next),
                Err(JournalError::NoSpace(why)) => refused.push(why),
                Err(e) => panic!("record {next}: {e}"),
            }
            next += 1;
        }
        assert!(refused.len() > 30, "{} of 60 refused", refused.len());
        assert!(refused.iter().all(|w| w.contains(why)), "{refused:?}");
        step(format!("{} of 60 refused: {}", refused.len(), refused[0]));
        fs.set_full(false);
        std::thread::sleep(Duration::from_millis(200));
        append(next).expect("acknowledged once the space is back");
        acked.push(next);
        next += 1;
    }
    j.stop();
    drop(j);
    thread.join();
    let mut replayed = Vec::new();
    journal::replay(
        &opts.dir,
        0,
        |_| false,
        |_, r| {
            assert_eq!(r.data, record(r.entry_id).data, "record {}", r.entry_id);
            replayed.push(r.entry_id)
        },
    )
    .unwrap();
    assert_eq!(
        replayed, acked,
        "replay returns exactly the acknowledged records"
    );
}
