//! Bookies as real processes: one metadata node, four bookies, the `meridian perf ledger` and
//! `meridian ledger` tools, kill -9 and restarts.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use meridian_integration::{
    http_get, meridian_bin, metric_value, recover_ledger, run_cli, start_serving, step,
    wait_for_bookies, BookieProc, MetaCluster,
};

fn ledger_show(endpoint: &str, id: &str) -> serde_json::Value {
    let (code, out, err) =
        run_cli(&["ledger", "show", id, "--metadata", endpoint, "--json"]).expect("run");
    assert_eq!(code, 0, "ledger show failed: {err}");
    serde_json::from_str(&out).expect("json")
}

/// One metadata node and `n` bookies, all registered.
async fn start_site(n: usize) -> (MetaCluster, Vec<BookieProc>) {
    let cluster = MetaCluster::start(1).await.expect("metadata node");
    let endpoint = cluster.endpoints()[0].clone();
    let mut bookies: Vec<BookieProc> = (0..n)
        .map(|i| BookieProc::new(&format!("bookie{i}"), cluster.root.path(), &endpoint))
        .collect();
    for b in &mut bookies {
        b.start().expect("bookie");
    }
    wait_for_bookies(&cluster.client(), n, Duration::from_secs(20))
        .await
        .expect("bookies registered");
    (cluster, bookies)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_bookie_killed_mid_stream_then_writes_go_on_and_every_entry_survives_restarts() {
    let (cluster, mut bookies) = start_site(4).await;
    let endpoint = cluster.endpoints()[0].clone();
    let client = cluster.client();

    step("perf ledger: 100,000 entries, E=3 Qw=2 Qa=2; kill -9 one ensemble bookie at 50,000");
    let mut perf = Command::new(meridian_bin())
        .args(["perf", "ledger", "--metadata", &endpoint])
        .args([
            "--ensemble",
            "3",
            "--write-quorum",
            "2",
            "--ack-quorum",
            "2",
        ])
        .args([
            "--entries",
            "100000",
            "--entry-size",
            "256",
            "--window",
            "1000",
        ])
        .args(["--progress-every", "10000", "--verify"])
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("perf");
    let stdout = perf.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut ledger = String::new();
    let mut victim = String::new();
    let mut output = Vec::new();
    for line in lines.by_ref() {
        let line = line.expect("line");
        output.push(line.clone());
        if let Some(rest) = line.strip_prefix("perf ledger: ledger ") {
            ledger = rest.split(',').next().expect("id").to_string();
        }
        if line == "acknowledged 50000" {
            let meta = ledger_show(&endpoint, &ledger);
            victim = meta["fragments"][0]["ensemble"][1]
                .as_str()
                .expect("addr")
                .to_string();
            let b = bookies
                .iter_mut()
                .find(|b| b.addr == victim)
                .expect("victim is ours");
            b.kill9().expect("kill -9");
            break;
        }
    }
    output.extend(lines.map(|l| l.expect("line")));
    let status = perf.wait().expect("perf exit");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut perf.stderr.take().expect("stderr"), &mut err)
        .expect("stderr");
    assert!(
        status.success(),
        "perf failed:\n{}\n{err}",
        output.join("\n")
    );
    assert!(
        !victim.is_empty(),
        "perf finished before 50,000 acknowledgements:\n{}",
        output.join("\n")
    );
    let verify = output
        .iter()
        .find(|l| l.starts_with("verify:"))
        .expect("verify line");
    assert!(
        verify.contains("100000 entries read back")
            && verify.contains(" 0 bad, 0 never acknowledged"),
        "{verify}"
    );

    step("the ledger is closed, with a later fragment that leaves out the killed bookie");
    let meta = ledger_show(&endpoint, &ledger);
    assert_eq!(meta["state"], "closed");
    assert_eq!(meta["last_entry"], 99_999);
    let fragments = meta["fragments"].as_array().expect("fragments");
    assert!(fragments.len() >= 2, "{meta}");
    let last_ensemble = fragments.last().expect("fragment")["ensemble"].to_string();
    assert!(!last_ensemble.contains(&victim), "{meta}");

    step("each surviving bookie's /metrics has its journal's fdatasyncs; /health says ok");
    let mut synced = 0;
    for b in bookies.iter().filter(|b| b.addr != victim) {
        let health = http_get(&b.http, "/health");
        assert!(
            health.starts_with("HTTP/1.0 200") || health.starts_with("HTTP/1.1 200"),
            "{health}"
        );
        assert!(health.contains("\"status\":\"ok\""), "{health}");
        let metrics = http_get(&b.http, "/metrics");
        if metric_value(&metrics, "meridian_journal_sync_seconds_count") > 0.0 {
            synced += 1;
        }
    }
    // Every entry went to two of the three that were written to (E=3, Qw=2).
    assert!(
        synced >= 2,
        "journal fdatasyncs on {synced} bookies' /metrics"
    );

    step("kill -9 every bookie, restart all four on the same directories: every entry reads back");
    for b in &mut bookies {
        b.kill9().expect("kill -9");
    }
    start_serving(&mut bookies).await;
    wait_for_bookies(&client, 4, Duration::from_secs(20))
        .await
        .expect("bookies registered again");
    let (code, out, err) =
        run_cli(&["ledger", "check", &ledger, "--metadata", &endpoint]).expect("check");
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("100000 entries, 25600000 bytes, 0 unreadable"),
        "{out}"
    );

    step("a clean stop exits 0");
    for b in &mut bookies {
        assert_eq!(b.stop().expect("stop"), 0, "{}", b.log_text());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_writer_killed_mid_stream_when_recovered_then_ledger_closes_at_or_after_last_acknowledged(
) {
    // The bookies stay up until the end of the test (dropped last).
    let (cluster, _bookies) = start_site(3).await;
    let endpoint = cluster.endpoints()[0].clone();

    step("a writer acknowledges at least 20,000 entries, then is killed -9");
    let mut perf = Command::new(meridian_bin())
        .args(["perf", "ledger", "--metadata", &endpoint])
        .args([
            "--ensemble",
            "3",
            "--write-quorum",
            "3",
            "--ack-quorum",
            "2",
        ])
        .args([
            "--entries",
            "1000000",
            "--entry-size",
            "100",
            "--window",
            "500",
        ])
        .args(["--progress-every", "1000"])
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("perf");
    let mut lines = BufReader::new(perf.stdout.take().expect("stdout")).lines();
    let mut ledger = String::new();
    let mut acked = 0u64;
    for line in lines.by_ref() {
        let line = line.expect("line");
        if let Some(rest) = line.strip_prefix("perf ledger: ledger ") {
            ledger = rest.split(',').next().expect("id").to_string();
        }
        if let Some(n) = line.strip_prefix("acknowledged ") {
            acked = n.parse().expect("count");
            if acked >= 20_000 {
                perf.kill().expect("kill -9 the writer");
                break;
            }
        }
    }
    let _ = perf.wait();

    step("recover from another process: closed at or after the last acknowledged entry");
    let last = recover_ledger(&endpoint, &ledger);
    assert!(
        last + 1 >= acked,
        "closed at {last}, but {acked} entries were acknowledged"
    );
    let meta = ledger_show(&endpoint, &ledger);
    assert_eq!(meta["state"], "closed");
    let (code, out, err) =
        run_cli(&["ledger", "check", &ledger, "--metadata", &endpoint]).expect("check");
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(&format!("{} entries", last + 1)), "{out}");
}
