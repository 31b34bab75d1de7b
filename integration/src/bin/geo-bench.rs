//! Geo-replication measured on loopback with mutual TLS: two sites (standalones with geo
//! links, `meridian_integration::geo_sites`), 1 KiB messages, batched, one run.
//!
//! 1. local: `meridian perf produce` at site A to a namespace that is not replicated, as fast
//!    as it goes: the site's own maximum publish rate in this run;
//! 2. replicated: `meridian perf e2e --url A --consume-url B` as fast as it goes to a
//!    replicated topic: what B delivers per second is the replication throughput, beside 1;
//! 3. lag: the same at a fixed rate (10,000 msg/s by default), once what 2 left unreplicated
//!    is sent: the end-to-end latency, publish at A to delivery at B, is the replication lag
//!    plus B's dispatch;
//! 4. catch-up: B paused (SIGSTOP) while A takes batched messages as fast as it goes for
//!    `SECONDS`, then resumed: the rate at which B takes them (A's producer is not competing
//!    for the machine meanwhile), beside 1;
//! 5. backlog: B paused while A takes `BACKLOG` unbatched messages (one entry each), then
//!    resumed: the time until A's replicator sends again and until its backlog is 0, and the
//!    drain rate in entries per second;
//! 6. subsync: a replicated subscription (Shared, so each message is acknowledged by id) at A
//!    consuming `LAG_RATE` unbatched messages per second: the time from an acknowledgement at
//!    A until B confirmed it applied, from A's `meridian_replicated_subscription_sync_seconds`;
//! 7. drill: `geo drill --from a --to b` over 100 replicated topics (20,000 messages among
//!    them first): its RTO, and the publish p99 at A of a namespace the drill does not touch
//!    (`LAG_RATE` unbatched msg/s for `SECONDS`) before and during the drill.
//!
//! `MERIDIAN_BIN=target/release/meridian MERIDIAN_ADMIN_BIN=target/release/meridian-admin
//! cargo run --release -p meridian-integration --bin geo-bench -- [SECONDS] [LAG_RATE]
//! [BACKLOG]` (defaults 20, 10000, 1000000). `GEO_BENCH_PHASES=catchup,backlog` runs only
//! those phases after 1 (`replicated` is 2 and 3); the sites' PIDs are printed, so a profiler
//! can be attached to them. `GEO_BENCH_PIN=1` gives each site a core of its own (A's threads
//! on CPU 0; B's, the clients' and geo-bench's on CPU 1, with `taskset`), as if each site had
//! its own machine: A's local maximum is then what one core takes from a client elsewhere,
//! and the catch-up what one core sends to another (the disk is still shared); in phases 2
//! and 3 the clients share B's core.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use meridian_integration::geo_sites::{admin_ok, mesh_with};
use meridian_integration::{admin_json, meridian_bin, pin_to_cpu};

/// Runs `meridian perf ARGS`, prints its summary lines, returns its output.
fn perf(label: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(meridian_bin())
        .arg("perf")
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    anyhow::ensure!(
        out.status.success(),
        "perf {label}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in text.lines().filter(|l| l.starts_with("summary")) {
        println!("{label}: {line}");
    }
    Ok(text)
}

/// Whether each site runs on a core of its own (`GEO_BENCH_PIN=1`).
fn pinned() -> bool {
    std::env::var("GEO_BENCH_PIN").is_ok_and(|v| v == "1")
}

/// The msg/s of the summary line of `label` (`summary produce: ... = N msg/s`).
fn rate_of(text: &str, label: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(&format!("summary {label}:")))
        .and_then(|l| l.split(" = ").nth(1))
        .and_then(|x| x.split_whitespace().next())
        .and_then(|x| x.parse().ok())
        .unwrap_or(0.0)
}

fn backlog_at(admin_url: &str, topic: &str) -> Option<u64> {
    admin_json(admin_url, &["topics", "stats", topic])["replication"][0]["backlog_entries"].as_u64()
}

fn signal(pid: u32, sig: &str) -> anyhow::Result<()> {
    anyhow::ensure!(Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()?
        .success());
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers: SECONDS LAG_RATE BACKLOG"))
        .collect();
    let seconds = args.first().copied().unwrap_or(20).to_string();
    let lag_rate = args.get(1).copied().unwrap_or(10_000).to_string();
    let backlog = args.get(2).copied().unwrap_or(1_000_000);
    let phases: Vec<String> = std::env::var("GEO_BENCH_PHASES")
        .unwrap_or_default()
        .split(',')
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect();
    if let Some(bad) = phases
        .iter()
        .find(|p| !["replicated", "catchup", "backlog", "subsync", "drill"].contains(&p.as_str()))
    {
        anyhow::bail!(
            "GEO_BENCH_PHASES: {bad:?} is not replicated, catchup, backlog, subsync or drill"
        );
    }
    let phase = |name: &str| phases.is_empty() || phases.iter().any(|p| p == name);

    let (_root, sites, _) = mesh_with(&["a", "b"], &[], false);
    let (a, b) = (&sites[0], &sites[1]);
    for s in [a, b] {
        admin_ok(&[
            "--admin-url",
            &s.admin_url,
            "namespaces",
            "create",
            "acme/local",
        ]);
    }
    let common = |topic: &str| -> Vec<String> {
        [
            "--topic",
            topic,
            "--size",
            "1024",
            "--seconds",
            &seconds,
            "--warmup-seconds",
            "3",
            "--report-every",
            "60",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let run = |label: &str, kind: &str, extra: &[&str], topic: &str| {
        let mut v: Vec<String> = vec![kind.to_string(), "--url".into(), a.url.clone()];
        v.extend(extra.iter().map(|s| s.to_string()));
        v.extend(common(topic));
        let refs: Vec<&str> = v.iter().map(String::as_str).collect();
        perf(label, &refs)
    };

    println!("geo-bench: two sites on loopback, mutual TLS on the link, 1 KiB messages batched");
    let (apid, bpid) = (a.pid().expect("running"), b.pid().expect("running"));
    println!("site A pid {apid}, site B pid {bpid}");
    if pinned() {
        pin_to_cpu(Some(apid), "0")?;
        pin_to_cpu(Some(bpid), "1")?;
        // This process too: the clients and admin calls it starts run beside B.
        pin_to_cpu(Some(std::process::id()), "1")?;
        println!("pinned: site A on CPU 0; site B, the clients and geo-bench on CPU 1");
    }
    let (mib, syncs) = disk(_root.path())?;
    println!(
        "disk: {mib:.0} MiB/s of 1 MiB writes with fdatasync, {syncs:.0} fdatasyncs/s of 4 KiB"
    );
    let local = run("local", "produce", &[], "persistent://acme/local/max")?;
    let consume_b = ["--consume-url", b.url.as_str()];
    let l = rate_of(&local, "produce");
    if phase("replicated") {
        let repl = run("replicated", "e2e", &consume_b, "persistent://acme/g/max")?;
        let r = rate_of(&repl, "consume");
        println!(
            "replication throughput: {r:.0} msg/s delivered at B, {:.0}% of A's local maximum of {l:.0} msg/s",
            100.0 * r / l.max(1.0)
        );
        // What A took beyond what B delivered is still being replicated: the lag is measured
        // once that is done, not beside it.
        let left = backlog_at(&a.admin_url, "persistent://acme/g/max").unwrap_or(0);
        let (_, took) = drain(&a.admin_url, "persistent://acme/g/max", left)?;
        println!(
            "replicated: the {left} entries A still held for B were sent in {:.1} s",
            took.as_secs_f64()
        );
        let mut extra = consume_b.to_vec();
        extra.extend(["--rate", lag_rate.as_str()]);
        run("lag", "e2e", &extra, "persistent://acme/g/lag")?;
    }

    let warm = |topic: &str| {
        // The topic and its replicator first, then the pause.
        perf(
            "warm",
            &[
                "produce",
                "--url",
                &a.url,
                "--topic",
                topic,
                "--messages",
                "10",
                "--seconds",
                "0",
                "--batch-max-messages",
                "1",
                "--report-every",
                "60",
            ],
        )
    };

    if phase("subsync") {
        subsync(a, &seconds, &lag_rate)?;
    }
    if phase("drill") {
        drill(a, b, seconds.parse().unwrap_or(20), &lag_rate)?;
    }

    // Catch-up: B paused, A takes batched messages for SECONDS, B resumed.
    if phase("catchup") {
        let topic = "persistent://acme/g/catchup";
        warm(topic)?;
        signal(bpid, "-STOP")?;
        run("catchup-fill", "produce", &[], topic)?;
        let st = admin_json(&a.admin_url, &["topics", "stats", topic]);
        let sent = st["msgs_in_total"].as_u64().unwrap_or(0) as f64;
        let bytes = st["storage_bytes"].as_u64().unwrap_or(0) as f64;
        let filled = backlog_at(&a.admin_url, topic).unwrap_or(0);
        signal(bpid, "-CONT")?;
        let (_, drained) = drain(&a.admin_url, topic, filled)?;
        let secs = drained.as_secs_f64();
        let rate = sent / secs;
        println!(
        "catch-up: {sent:.0} batched messages ({filled} entries, {:.0} MiB) taken by B in {secs:.1} s = {rate:.0} msg/s, {:.1} MiB/s, {:.0}% of A's local maximum",
        bytes / 1048576.0,
        bytes / 1048576.0 / secs,
        100.0 * rate / l.max(1.0)
    );
    }

    // Backlog: B paused, A takes BACKLOG one-message entries, B resumed.
    if !phase("backlog") {
        return Ok(());
    }
    let topic = "persistent://acme/g/backlog";
    warm(topic)?;
    signal(bpid, "-STOP")?;
    let n = backlog.to_string();
    perf(
        "backlog-fill",
        &[
            "produce",
            "--url",
            &a.url,
            "--topic",
            topic,
            "--messages",
            &n,
            "--seconds",
            "0",
            "--batch-max-messages",
            "1",
            "--size",
            "1024",
            "--report-every",
            "60",
        ],
    )?;
    let filled = backlog_at(&a.admin_url, topic).unwrap_or(0);
    signal(bpid, "-CONT")?;
    let (first_progress, drained) = drain(&a.admin_url, topic, filled)?;
    println!(
        "backlog: {filled} entries held while B was paused; after resuming, traffic again in {:.2} s, drained in {:.1} s = {:.0} entries/s",
        first_progress.as_secs_f64(),
        drained.as_secs_f64(),
        filled as f64 / drained.as_secs_f64()
    );
    Ok(())
}

/// Phase 6: a replicated subscription's acknowledgements at `rate` per second, and how long
/// each took to be applied at the other site (A's histogram: from the acknowledgement to the
/// confirmation of the state that carried it).
fn subsync(
    a: &meridian_integration::StandaloneProc,
    seconds: &str,
    rate: &str,
) -> anyhow::Result<()> {
    let topic = "persistent://acme/g/acks";
    let admin = |args: &[&str]| {
        let mut all = vec!["--admin-url", a.admin_url.as_str()];
        all.extend_from_slice(args);
        admin_ok(&all)
    };
    admin(&["topics", "create", topic]);
    admin(&["topics", "create-subscription", topic, "-s", "acks"]);
    admin(&[
        "topics",
        "set-replicated-subscription-status",
        topic,
        "-s",
        "acks",
        "--enable",
    ]);
    let before = sync_buckets(&a.http);
    let out = perf(
        "subsync",
        &[
            "e2e",
            "--url",
            &a.url,
            "--topic",
            topic,
            "--subscription",
            "acks",
            "--subscription-type",
            "shared",
            "--rate",
            rate,
            "--batch-max-messages",
            "1",
            "--size",
            "1024",
            "--seconds",
            seconds,
            "--report-every",
            "60",
        ],
    )?;
    // Let the last states be confirmed.
    std::thread::sleep(Duration::from_secs(2));
    let after = sync_buckets(&a.http);
    let d: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, n)| {
            (
                *le,
                n - before.iter().find(|b| b.0 == *le).map_or(0.0, |b| b.1),
            )
        })
        .collect();
    let total = d.last().map_or(0.0, |x| x.1);
    let q = |p: f64| {
        d.iter()
            .find(|(_, n)| *n >= p * total)
            .map_or(f64::INFINITY, |(le, _)| *le)
    };
    println!(
        "subsync: {:.0} msg/s consumed at A, each acknowledged (Shared); {total:.0} states confirmed by B; acknowledgement to confirmation p50 <= {:.0} ms, p99 <= {:.0} ms (histogram bounds)",
        rate_of(&out, "consume"),
        q(0.5) * 1000.0,
        q(0.99) * 1000.0
    );
    Ok(())
}

/// Phase 7: a drill over 100 topics (`acme/g/drill-0` .. `-99`, each with messages at both
/// sites): its RTO, and the publish latency at A of a namespace the drill does not touch
/// (`acme/local`, `RATE` msg/s unbatched), before the drill and during it, in the same run.
fn drill(
    a: &meridian_integration::StandaloneProc,
    b: &meridian_integration::StandaloneProc,
    seconds: u64,
    rate: &str,
) -> anyhow::Result<()> {
    let topics = "persistent://acme/g/drill";
    perf(
        "drill-fill",
        &[
            "produce",
            "--url",
            &a.url,
            "--topic",
            topics,
            "--topics",
            "100",
            "--messages",
            "20000",
            "--seconds",
            "0",
            "--report-every",
            "60",
        ],
    )?;
    // Every topic's replicator has sent what it had.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let l = admin_json(&a.admin_url, &["topics", "list", "acme/g"]);
        let n = l.as_array().map_or(0, |v| v.len());
        let all_sent = (0..100)
            .all(|i| backlog_at(&a.admin_url, &format!("{topics}-{i}")).is_some_and(|x| x == 0));
        if n >= 100 && all_sent {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the drill's topics did not replicate"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let secs = seconds.to_string();
    let latency = |label: &str| {
        perf(
            label,
            &[
                "produce",
                "--url",
                &a.url,
                "--topic",
                "persistent://acme/local/beside-drill",
                "--rate",
                rate,
                "--batch-max-messages",
                "1",
                "--size",
                "1024",
                "--seconds",
                &secs,
                "--report-every",
                "60",
            ],
        )
    };
    let before = latency("drill-before")?;
    let b_admin = b.admin_url.clone();
    let hold = format!("{}s", seconds.saturating_sub(4).max(1));
    let drill = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        meridian_integration::run_admin(&[
            "--admin-url",
            &b_admin,
            "--output",
            "json",
            "geo",
            "drill",
            "--from",
            "a",
            "--to",
            "b",
            "--namespace",
            "acme/g",
            "--hold",
            &hold,
        ])
    });
    let during = latency("drill-during")?;
    let (code, out, err) = drill
        .join()
        .map_err(|_| anyhow::anyhow!("the drill's thread panicked"))??;
    anyhow::ensure!(code == 0, "geo drill: {out}{err}");
    let report: serde_json::Value = serde_json::from_str(&out)?;
    let p99 = |text: &str| {
        text.lines()
            .find(|l| l.starts_with("summary produce publish latency"))
            .and_then(|l| l.split(" p99 ").nth(1))
            .and_then(|x| x.split_whitespace().next())
            .unwrap_or("?")
            .to_string()
    };
    println!(
        "drill over {} topics: RTO {} ms (every topic served at B), subscriptions in place {} ms, measured {} ms after the cut, caught up {} ms after the restore; publish p99 at A of acme/local at {rate} msg/s: {} ms before, {} ms during the drill",
        report["topics"].as_array().map_or(0, |t| t.len()),
        report["phases"]["rto_ms"],
        report["phases"]["subscriptions_ms"],
        report["phases"]["measured_ms"],
        report["phases"]["caught_up_ms"],
        p99(&before),
        p99(&during)
    );
    Ok(())
}

/// A's `meridian_replicated_subscription_sync_seconds` buckets toward B: (le, count),
/// cumulative, ascending.
fn sync_buckets(http: &str) -> Vec<(f64, f64)> {
    let page = meridian_integration::http_get(http, "/metrics");
    let mut v: Vec<(f64, f64)> = page
        .lines()
        .filter(|l| l.starts_with("meridian_replicated_subscription_sync_seconds_bucket{"))
        .filter(|l| l.contains("remote=\"b\""))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            let n: f64 = l.rsplit(' ').next()?.parse().ok()?;
            Some((le, n))
        })
        .collect();
    v.sort_by(|x, y| x.0.total_cmp(&y.0));
    v
}

/// The disk's own limits where the sites keep their data, as fio would measure them: MiB/s
/// of 1 MiB writes each followed by fdatasync, and fdatasyncs/s of 4 KiB writes, 3 s each.
fn disk(dir: &std::path::Path) -> anyhow::Result<(f64, f64)> {
    use std::io::Write;
    let path = dir.join("geo-bench-disk-probe");
    let mut f = std::fs::File::create(&path)?;
    let mut run = |block: usize| -> anyhow::Result<f64> {
        let buf = vec![0x5au8; block];
        let start = Instant::now();
        let mut n = 0u64;
        while start.elapsed() < Duration::from_secs(3) {
            f.write_all(&buf)?;
            f.sync_data()?;
            n += 1;
        }
        Ok(n as f64 / start.elapsed().as_secs_f64())
    };
    let mib = run(1 << 20)?;
    let syncs = run(4096)?;
    drop(f);
    std::fs::remove_file(&path)?;
    Ok((mib, syncs))
}

/// Waits until the replication backlog of `topic` (`filled` entries at the start) is 0:
/// the time until it first went down, and until it was 0.
fn drain(admin_url: &str, topic: &str, filled: u64) -> anyhow::Result<(Duration, Duration)> {
    let resumed = Instant::now();
    let mut first_progress = None;
    loop {
        let left = backlog_at(admin_url, topic).unwrap_or(filled);
        if first_progress.is_none() && left < filled {
            first_progress = Some(resumed.elapsed());
        }
        if left == 0 {
            return Ok((first_progress.unwrap_or_default(), resumed.elapsed()));
        }
        anyhow::ensure!(
            resumed.elapsed() < Duration::from_secs(600),
            "the backlog did not drain in 10 minutes ({left} left)"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
