//! Failover drills between real sites: `meridian-admin geo drill --dry-run` measures what one
//! site would lose if the other were lost now, and the figures equal what the test counts.

use std::time::{Duration, Instant};

use meridian_integration::geo_sites::{admin_ok, mesh_with};
use meridian_integration::{admin_json, step, PyClient, StandaloneProc};

fn admin_at(site: &StandaloneProc, args: &[&str]) -> String {
    let mut all = vec!["--admin-url", site.admin_url.as_str()];
    all.extend_from_slice(args);
    admin_ok(&all)
}

fn json_at(site: &StandaloneProc, args: &[&str]) -> serde_json::Value {
    admin_json(&site.admin_url, args)
}

/// Reads `topic` at `url` until it holds `want` messages.
fn wait_count(dir: &std::path::Path, url: &str, topic: &str, want: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let mut r = PyClient::run(dir, "reader", &["read", url, topic]);
        let n = r
            .finish(Duration::from_secs(120))
            .map(|_| r.ints("i").len())
            .unwrap_or(0);
        if n >= want {
            return;
        }
        assert!(Instant::now() < deadline, "{url}: {n} of {want} messages");
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn produce(dir: &std::path::Path, url: &str, topic: &str, count: u64, start: u64) {
    let (c, s) = (count.to_string(), start.to_string());
    let mut p = PyClient::run(
        dir,
        "producer",
        &[
            "produce", url, topic, "--count", &c, "--batch", "--start", &s,
        ],
    );
    p.finish(Duration::from_secs(120)).unwrap();
    assert_eq!(p.ints("acked").len() as u64, count);
}

#[test]
fn given_a_dry_run_drill_then_its_rpo_and_redelivery_equal_what_the_test_counts_and_nothing_changes(
) {
    // East looks at its replicated subscriptions once a minute: what its consumer
    // acknowledges after the first look is not at west when the drill measures.
    let (root, procs, _) = mesh_with(
        &["east", "west"],
        &[("MERIDIAN_GEO_SUBSCRIPTION_SYNC_INTERVAL_MS", "60000")],
        false,
    );
    let (east, west) = (&procs[0], &procs[1]);
    let dir = root.path().to_path_buf();
    let t = "persistent://acme/g/ledger";

    step("east produces 2,000; west has them");
    produce(&dir, &east.url, t, 2_000, 0);
    wait_count(&dir, &west.url, t, 2_000);

    step("at east a replicated subscription acknowledges 1,000 (600 cumulatively, 400 one by one)");
    let mut c = PyClient::run(
        &dir,
        "acker",
        &[
            "repl-sub",
            "ack",
            &east.url,
            t,
            "s1",
            "--count",
            "2000",
            "--cumulative",
            "600",
            "--individual",
            "400",
        ],
    );
    let lines = c.finish(Duration::from_secs(120)).unwrap();
    let acked = lines
        .iter()
        .find_map(|l| l.get("acked").and_then(|a| a.as_array()).map(|a| a.len()))
        .expect("acknowledged");
    assert_eq!(acked, 1_000);
    step("and s2, made replicated by the admin, is not at west yet");
    admin_at(east, &["topics", "create-subscription", t, "-s", "s2"]);
    admin_at(
        east,
        &[
            "topics",
            "set-replicated-subscription-status",
            t,
            "-s",
            "s2",
            "--enable",
        ],
    );

    step("west's topic stops taking entries (terminated there); east produces 500 more");
    admin_at(west, &["topics", "terminate", t]);
    produce(&dir, &east.url, t, 500, 2_000);

    step("the drill's dry run, run at west: RPO 500 messages, 1,000 messages delivered again");
    let report = json_at(
        west,
        &[
            "geo",
            "drill",
            "--from",
            "east",
            "--to",
            "west",
            "--namespace",
            "acme/g",
            "--dry-run",
        ],
    );
    step(format!("report: {report}"));
    assert_eq!(report["kind"], "dry-run");
    assert_eq!(report["errors"], 0, "{report}");
    assert_eq!(report["rpo"]["messages"], 500, "{report}");
    let entries = report["rpo"]["entries"].as_u64().unwrap();
    assert!((1..=500).contains(&entries), "{report}");
    assert!(
        report["rpo"]["bytes"].as_u64().unwrap() > 500 * 5,
        "{report}"
    );
    assert!(report["rpo"]["seconds"].as_f64().unwrap() > 0.0, "{report}");
    let topic = report["topics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["topic"] == t)
        .unwrap_or_else(|| panic!("{t} not in {report}"));
    let s1 = topic["subscriptions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "s1")
        .unwrap_or_else(|| panic!("s1 not in {topic}"));
    assert_eq!(s1["messages"], 1_000, "{topic}");
    assert_eq!(report["redelivered_messages"], 1_000, "{report}");

    step("nothing changed: west has no s2, and s1 there still holds all 2,000");
    let stats = json_at(west, &["topics", "stats", t]);
    let subs = stats["subscriptions"].as_array().unwrap();
    assert!(!subs.iter().any(|s| s["name"] == "s2"), "{stats}");
    let listed = admin_at(west, &["topics", "subscriptions", t]);
    assert!(!listed.contains("s2"), "{listed}");

    step("the report is kept at west: geo drills list | show");
    let id = report["id"].as_str().unwrap();
    let list = json_at(west, &["geo", "drills", "list"]);
    assert!(
        list.as_array().unwrap().iter().any(|r| r["id"] == id),
        "{list}"
    );
    let shown = json_at(west, &["geo", "drills", "show", id]);
    assert_eq!(shown, report);
    let table = admin_at(west, &["geo", "drills", "show", id]);
    assert!(
        table.contains("RPO 500") || table.contains("500 messages"),
        "{table}"
    );
}
