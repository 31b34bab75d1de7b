//! Tenant isolation on shared hardware, measured: tenant A's namespace kept on broker 1 and
//! bookies 1-2, tenant B's on broker 2 and bookies 3-4 (namespace isolation policies and bookie
//! affinity groups), and A's publish latency alone against A's with B flooding, in one run.
//!
//! A publishes at a fixed rate (unbatched 1 KiB, `meridian perf produce`, with the disk's own
//! 4 KiB write+fdatasync latency probed beside it); B floods as fast as its producers can
//! (batched, 4 topics) while held to a namespace publish rate (`namespaces
//! set-publish-rate-total`), its "maximum rate" as an operator sets it for a tenant on shared
//! hardware. The phases alternate (A alone, A with B capped, ...), each flood followed by a
//! pause so the bookies' background writes of B's data end before the next phase; one last
//! phase lets B flood without a cap. Every process shares this machine's cores and its one
//! disk: separate brokers and bookies cannot hide that, so the figures show what separate
//! processes buy on one machine, and what a rate cap adds.
//!
//! `MERIDIAN_BIN=target/release/meridian cargo run --release -p meridian-integration --bin
//! isolation-bench -- [SECONDS] [A_RATE] [B_CAP] [ROUNDS] [SETTLE_SECONDS]` (defaults 15,
//! 2000, 20000, 3, 20).

use std::process::{Command, Stdio};
use std::time::Duration;

use meridian_integration::{
    admin_json, host, meridian_bin, wait_for_bookies, BookieProc, BrokerProc, MetaCluster,
};

/// What one `meridian perf produce` run measured.
#[derive(Debug, Clone, Copy, Default)]
struct Run {
    rate: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    max: f64,
    /// The disk's 4 KiB write+fdatasync p99 and maximum meanwhile (with a probe directory).
    disk_p99: f64,
    disk_max: f64,
}

/// `ISOLATION_BENCH_B_DIR=DIR` puts B's bookies' journals and ledgers under DIR (another disk,
/// or a tmpfs standing in for one): then only the cores are shared, and the phase without a
/// cap is left out (it would write gigabytes there).
fn b_dir() -> Option<std::path::PathBuf> {
    std::env::var_os("ISOLATION_BENCH_B_DIR").map(std::path::PathBuf::from)
}

/// `ISOLATION_BENCH_PIN=1` pins A's broker, bookies and client to the first core and B's to
/// the second (`taskset`), as if each tenant had a machine's cores of its own (the metadata
/// node floats).
fn pinned() -> bool {
    std::env::var("ISOLATION_BENCH_PIN").is_ok_and(|v| v == "1")
}

use meridian_integration::pin_to_cpu as pin;

/// `ISOLATION_BENCH_LOGS=DIR` keeps every process's log and each `perf` run's output (with
/// figures every second) there.
fn logs_dir() -> Option<std::path::PathBuf> {
    std::env::var_os("ISOLATION_BENCH_LOGS").map(std::path::PathBuf::from)
}

/// Journal fdatasyncs that took longer than 50 ms, and all of them, so far, per bookie (from
/// each bookie's /metrics).
fn slow_syncs(bookies: &[BookieProc]) -> Vec<(f64, f64)> {
    bookies
        .iter()
        .map(|b| {
            let m = meridian_integration::http_get(&b.http, "/metrics");
            let value = |series: &str| meridian_integration::metric_value(&m, series);
            let all = value("meridian_journal_sync_seconds_count");
            let fast = value("meridian_journal_sync_seconds_bucket{le=\"0.05\"}");
            (all - fast, all)
        })
        .collect()
}

/// `meridian perf produce` against one broker.
fn perf(
    url: &str,
    topic: &str,
    topics: usize,
    rate: u64,
    batch: u64,
    seconds: u64,
    probe: Option<&str>,
) -> anyhow::Result<Run> {
    let mut cmd = if pinned() {
        // A's topics are ta/..., B's tb/...
        let cpu = if topic.contains("//ta/") { "0" } else { "1" };
        let mut c = Command::new("taskset");
        c.args(["-c", cpu]).arg(meridian_bin());
        c
    } else {
        Command::new(meridian_bin())
    };
    cmd.args(["perf", "produce"]);
    if let Some(dir) = probe {
        cmd.args(["--fsync-probe-dir", dir]);
    }
    let out = cmd
        .args([
            "--url",
            url,
            "--topic",
            topic,
            "--topics",
            &topics.to_string(),
            "--rate",
            &rate.to_string(),
            "--batch-max-messages",
            &batch.to_string(),
            "--seconds",
            &seconds.to_string(),
            "--warmup-seconds",
            "3",
            "--report-every",
            if logs_dir().is_some() { "1" } else { "60" },
        ])
        .stdin(Stdio::null())
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    if let Some(dir) = logs_dir() {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("perf-{}.txt", topic.replace(['/', ':'], "_"))))?;
        writeln!(f, "=== {:?}\n{text}", std::time::SystemTime::now())?;
    }
    anyhow::ensure!(
        out.status.success(),
        "perf produce {topic}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let num_after = |line: &str, word: &str| -> Option<f64> {
        let mut it = line.split_whitespace();
        while let Some(w) = it.next() {
            if w == word {
                return it.next()?.trim_end_matches(',').parse().ok();
            }
        }
        None
    };
    let mut r = Run::default();
    for line in text.lines().filter(|l| l.starts_with("summary")) {
        if line.starts_with("summary disk") {
            r.disk_p99 = num_after(line, "p99").unwrap_or(0.0);
            r.disk_max = num_after(line, "max").unwrap_or(0.0);
        } else if line.contains("latency:") {
            r.p50 = num_after(line, "p50").unwrap_or(0.0);
            r.p99 = num_after(line, "p99").unwrap_or(0.0);
            r.p999 = num_after(line, "p99.9").unwrap_or(0.0);
            r.max = num_after(line, "max").unwrap_or(0.0);
        } else if let Some(x) = line
            .split(" = ")
            .nth(1)
            .and_then(|x| x.split_whitespace().next())
        {
            r.rate = x.parse().unwrap_or(0.0);
        }
    }
    anyhow::ensure!(r.p99 > 0.0, "no latency summary in: {text}");
    Ok(r)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| {
            a.parse()
                .expect("numbers: SECONDS A_RATE B_CAP ROUNDS SETTLE_SECONDS")
        })
        .collect();
    let seconds = args.first().copied().unwrap_or(15);
    let a_rate = args.get(1).copied().unwrap_or(2_000);
    let b_cap = args.get(2).copied().unwrap_or(20_000);
    let rounds = args.get(3).copied().unwrap_or(3);
    let settle = Duration::from_secs(args.get(4).copied().unwrap_or(20));

    let cluster = MetaCluster::start(1).await?;
    let endpoint = cluster.endpoints()[0].clone();
    let root = cluster.root.path().to_path_buf();
    let groups = ["ga", "ga", "gb", "gb"];
    let mut bookies = Vec::new();
    for (i, g) in groups.iter().enumerate() {
        let mut b = BookieProc::new(&format!("bookie{i}"), &root, &endpoint);
        b.env("MERIDIAN_BOOKIE_GROUP", g);
        if let (Some(dir), "gb") = (b_dir(), *g) {
            b.dir = dir.join(format!("bookie{i}"));
        }
        if logs_dir().is_some() {
            // Each journal fdatasync over 10 ms, with its time.
            b.env("RUST_LOG", "info,meridian_storage::journal=debug");
        }
        b.start()?;
        bookies.push(b);
    }
    wait_for_bookies(&cluster.client(), groups.len(), Duration::from_secs(30)).await?;
    let mut brokers = Vec::new();
    for name in ["b1", "b2"] {
        let mut b = BrokerProc::new(name, &root, &endpoint);
        b.env("MERIDIAN_BROKER_ENSEMBLE", "2")
            .env("MERIDIAN_BROKER_WRITE_QUORUM", "2")
            .env("MERIDIAN_BROKER_ACK_QUORUM", "2")
            .env("MERIDIAN_BROKER_LOAD_BALANCER_ENABLED", "false")
            .env("MERIDIAN_BROKER_BUNDLE_SPLIT_ENABLED", "false");
        b.start()?;
        brokers.push(b);
    }
    if pinned() {
        for (i, b) in bookies.iter().enumerate() {
            pin(b.pid(), if i < 2 { "0" } else { "1" })?;
        }
        pin(brokers[0].pid(), "0")?;
        pin(brokers[1].pid(), "1")?;
    }
    let admin = brokers[0].admin_url.clone();
    let re = |b: &BrokerProc| host(&b.url).replace('.', "\\.");
    for (t, g, b) in [("ta", "ga", &brokers[0]), ("tb", "gb", &brokers[1])] {
        admin_json(
            &admin,
            &["tenants", "create", t, "--allowed-clusters", "standalone"],
        );
        let ns = format!("{t}/ns");
        admin_json(&admin, &["namespaces", "create", &ns]);
        admin_json(
            &admin,
            &[
                "namespaces",
                "set-bookie-affinity-group",
                &ns,
                "--primary-group",
                g,
            ],
        );
        admin_json(
            &admin,
            &[
                "ns-isolation-policy",
                "set",
                "standalone",
                &format!("p-{t}"),
                "--namespaces",
                &format!("{t}/.*"),
                "--primary",
                &re(b),
            ],
        );
    }
    let a_url = brokers[0].url.clone();
    let b_url = brokers[1].url.clone();
    println!(
        "A: ta/ns on {} and bookies ga; B: tb/ns on {} and bookies gb (E=Qw=Qa=2)",
        host(&a_url),
        host(&b_url)
    );
    println!("A publishes {a_rate} msg/s unbatched 1 KiB for {seconds} s (3 s warm-up left out); B floods 4 topics batched 1 KiB");
    let a_topic = "persistent://ta/ns/latency";
    let b_topic = "persistent://tb/ns/flood";
    let probe = root.join("fsync-probe");
    std::fs::create_dir_all(&probe)?;
    let probe = probe.to_str().expect("utf-8 path").to_string();
    let set_cap = |cap: u64| {
        admin_json(
            &admin,
            &[
                "namespaces",
                "set-publish-rate-total",
                "tb/ns",
                "-m",
                &cap.to_string(),
            ],
        );
    };
    // Topics created and ledgers opened before the first measurement (B held to its cap).
    set_cap(b_cap);
    perf(&a_url, a_topic, 1, a_rate, 1, 5, None)?;
    perf(&b_url, b_topic, 4, 0, 1000, 5, None)?;
    std::thread::sleep(settle);

    // A phase: A measured, B flooding meanwhile (capped or not) or idle.
    let phase = |flood: Option<u64>| -> anyhow::Result<(Run, Option<Run>)> {
        if let Some(cap) = flood {
            set_cap(cap);
            // Policies reach the broker within one refresh interval.
            std::thread::sleep(Duration::from_secs(2));
        }
        let b = flood.map(|_| {
            let url = b_url.clone();
            std::thread::spawn(move || perf(&url, b_topic, 4, 0, 1000, seconds + 4, None))
        });
        if b.is_some() {
            std::thread::sleep(Duration::from_secs(2));
        }
        let a = perf(&a_url, a_topic, 1, a_rate, 1, seconds, Some(&probe))?;
        let b = match b {
            Some(h) => Some(h.join().expect("flood thread")?),
            None => None,
        };
        if b.is_some() {
            // The bookies write B's data out behind the journal for a while yet.
            std::thread::sleep(settle);
        }
        Ok((a, b))
    };
    let synced_before = std::cell::RefCell::new(slow_syncs(&bookies));
    let show = |name: &str, a: &Run, b: &Option<Run>| {
        let b_text = b.map_or(String::new(), |b| format!("; B {:.0} msg/s", b.rate));
        let now = slow_syncs(&bookies);
        let slow: Vec<String> = now
            .iter()
            .zip(synced_before.borrow().iter())
            .map(|(n, b)| format!("{}/{}", n.0 - b.0, n.1 - b.1))
            .collect();
        *synced_before.borrow_mut() = now;
        println!(
            "{name:>22}: A {:.0} msg/s p50 {:.2} p99 {:.2} p99.9 {:.2} max {:.1} ms (disk fdatasync p99 {:.2} max {:.1} ms; journal fdatasyncs over 50 ms / all, bookies 1-4: {}){b_text}",
            a.rate, a.p50, a.p99, a.p999, a.max, a.disk_p99, a.disk_max, slow.join(" ")
        );
    };
    let mut alone = Vec::new();
    let mut capped = Vec::new();
    for round in 1..=rounds {
        let (a, b) = phase(None)?;
        show(&format!("round {round} alone"), &a, &b);
        alone.push(a);
        let (a, b) = phase(Some(b_cap))?;
        show(&format!("round {round} B capped"), &a, &b);
        capped.push((a, b.unwrap_or_default()));
    }
    let last = if b_dir().is_none() {
        let (unlimited, b_unlimited) = phase(Some(0))?;
        show("last: B without a cap", &unlimited, &b_unlimited);
        Some((unlimited, b_unlimited))
    } else {
        println!(
            "B's bookies on {}: no phase without a cap",
            b_dir().unwrap_or_default().display()
        );
        None
    };

    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let (alone_med, capped_med) = (
        median(&alone.iter().map(|r| r.p99).collect::<Vec<_>>()),
        median(&capped.iter().map(|r| r.0.p99).collect::<Vec<_>>()),
    );
    println!(
        "medians over the rounds: A's publish p99 alone {alone_med:.2} ms, with B at its cap {capped_med:.2} ms = {:.2}x",
        capped_med / alone_med
    );
    let alone_p99 = mean(&alone.iter().map(|r| r.p99).collect::<Vec<_>>());
    let alone_disk = mean(&alone.iter().map(|r| r.disk_p99).collect::<Vec<_>>());
    let capped_p99 = mean(&capped.iter().map(|r| r.0.p99).collect::<Vec<_>>());
    let capped_disk = mean(&capped.iter().map(|r| r.0.disk_p99).collect::<Vec<_>>());
    let capped_rate = mean(&capped.iter().map(|r| r.1.rate).collect::<Vec<_>>());
    println!(
        "means: A's publish p99 alone {alone_p99:.2} ms (disk {alone_disk:.2} ms); with B at its cap ({capped_rate:.0} msg/s) {capped_p99:.2} ms (disk {capped_disk:.2} ms) = {:.2}x",
        capped_p99 / alone_p99
    );
    // On one disk the disk's own latency moves with B's writes: A's p99 over the disk's p99
    // in the same window is what Meridian adds on top of it.
    let over_disk = |v: &[Run]| {
        median(
            &v.iter()
                .map(|r| r.p99 / r.disk_p99.max(1e-9))
                .collect::<Vec<_>>(),
        )
    };
    let capped_runs: Vec<Run> = capped.iter().map(|r| r.0).collect();
    println!(
        "medians of A's p99 over the disk's fdatasync p99 in the same window: alone {:.2}, with B at its cap {:.2}",
        over_disk(&alone),
        over_disk(&capped_runs)
    );
    if let Some((unlimited, b_unlimited)) = last {
        println!(
            "with B uncapped ({:.0} msg/s): {:.2} ms (disk {:.2} ms) = {:.2}x",
            b_unlimited.map_or(0.0, |b| b.rate),
            unlimited.p99,
            unlimited.disk_p99,
            unlimited.p99 / alone_p99
        );
    }
    drop(brokers);
    drop(bookies);
    if let Some(dir) = logs_dir() {
        for e in std::fs::read_dir(&root)?.flatten() {
            if e.path().extension().is_some_and(|x| x == "log") {
                std::fs::copy(e.path(), dir.join(e.file_name()))?;
            }
        }
    }
    Ok(())
}
