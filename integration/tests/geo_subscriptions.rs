//! Replicated subscriptions between real sites: what a consumer acknowledged at one site is
//! acknowledged at the others, exactly (stock Python client, batch-index acknowledgements).

use std::time::{Duration, Instant};

use meridian_integration::geo_sites::{
    mesh_with, produce_acked as produce, wait_messages as wait_count,
};
use meridian_integration::{admin_json, step, PyClient, StandaloneProc};

/// The subscription's stats at a site (`None`: it has no such subscription).
fn sub_stats(site: &StandaloneProc, topic: &str, sub: &str) -> Option<serde_json::Value> {
    let s = admin_json(&site.admin_url, &["topics", "stats", topic]);
    s["subscriptions"]
        .as_array()?
        .iter()
        .find(|x| x["name"] == sub)
        .cloned()
}

/// Waits until `site` shows the subscription's acknowledgements confirmed by `remote`.
fn wait_synced(site: &StandaloneProc, topic: &str, sub: &str, remote: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = sub_stats(site, topic, sub);
        let synced = s.as_ref().and_then(|s| {
            s["sync"]
                .as_array()?
                .iter()
                .find(|y| y["remote"] == remote)
                .filter(|y| y["pending_acks"] == 0 && y["error"].is_null())
                .cloned()
        });
        if let Some(s) = s.clone().filter(|_| synced.is_some()) {
            assert_eq!(s["replicated"], true, "{s}");
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "{topic} {sub}: not synced to {remote}: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `repl-sub ack`: the messages it acknowledged.
fn ack_at(
    dir: &std::path::Path,
    url: &str,
    topic: &str,
    sub: &str,
    count: u64,
    cumulative: u64,
    individual: u64,
) -> Vec<u64> {
    let (count, cumulative, individual) = (
        count.to_string(),
        cumulative.to_string(),
        individual.to_string(),
    );
    let mut c = PyClient::run(
        dir,
        "acker",
        &[
            "repl-sub",
            "ack",
            url,
            topic,
            sub,
            "--count",
            &count,
            "--cumulative",
            &cumulative,
            "--individual",
            &individual,
        ],
    );
    let lines = c.finish(Duration::from_secs(180)).unwrap();
    let last = lines
        .iter()
        .find(|l| l.get("acked").is_some())
        .unwrap_or_else(|| panic!("no acknowledgements: {lines:?}"));
    assert_eq!(last["received"], count.parse::<u64>().unwrap(), "{last}");
    last["acked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect()
}

/// `repl-sub drain`: what the subscription delivers, acknowledging nothing.
fn drain_at(dir: &std::path::Path, url: &str, topic: &str, sub: &str) -> Vec<u64> {
    let mut c = PyClient::run(
        dir,
        "drainer",
        &["repl-sub", "drain", url, topic, sub, "--idle-ms", "5000"],
    );
    c.finish(Duration::from_secs(180)).unwrap();
    c.ints("i")
}

/// What of `all` is not in `acked`, sorted.
fn unacked(all: std::ops::Range<u64>, acked: &[u64]) -> Vec<u64> {
    let acked: std::collections::BTreeSet<u64> = acked.iter().copied().collect();
    all.filter(|i| !acked.contains(i)).collect()
}

fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

#[test]
fn given_acknowledgements_at_one_site_then_the_subscription_moves_to_the_other_exactly() {
    let (root, procs, _) = mesh_with(&["east", "west"], &[], false);
    let (east, west) = (&procs[0], &procs[1]);
    let dir = root.path().to_path_buf();
    let t = "persistent://acme/g/orders";
    const N: u64 = 10_000;

    step("east produces 10,000 messages in batches; west has them");
    produce(&dir, &east.url, t, N, 0);
    wait_count(&dir, &west.url, t, N as usize);

    step("at east a replicated subscription acknowledges 5,000: 2,000 cumulatively, 3,000 one by one out of order (batch-index acks)");
    let acked = ack_at(&dir, &east.url, t, "s1", N, 2_000, 3_000);
    assert_eq!(acked.len(), 5_000);
    let s = wait_synced(east, t, "s1", "west");
    step(format!("east's stats of the subscription: {s}"));
    assert_eq!(
        s["sync"][0]["held"], 0,
        "west has every entry the state speaks of: nothing held there: {s}"
    );
    let page = meridian_integration::http_get(&east.http, "/metrics");
    let confirmed = meridian_integration::metric_value(
        &page,
        "meridian_replicated_subscription_sync_seconds_count{remote=\"west\"}",
    );
    assert!(confirmed > 0.0, "no confirmed states in /metrics:\n{page}");

    step("at west the same subscription delivers exactly the 5,000 east did not acknowledge");
    let got = drain_at(&dir, &west.url, t, "s1");
    assert_eq!(sorted(got.clone()).len(), got.len(), "duplicates at west");
    assert_eq!(sorted(got), unacked(0..N, &acked));

    step("west acknowledges 1,000 more of them; back at east the subscription delivers the other 4,000");
    let acked_west = ack_at(&dir, &west.url, t, "s1", 5_000, 0, 1_000);
    wait_synced(west, t, "s1", "east");
    let all_acked: Vec<u64> = acked.iter().chain(&acked_west).copied().collect();
    let got = drain_at(&dir, &east.url, t, "s1");
    assert_eq!(sorted(got), unacked(0..N, &all_acked));

    step("east deletes s1; what west sends of it afterwards does not bring it back at east");
    meridian_integration::geo_sites::admin_ok(&[
        "--admin-url",
        &east.admin_url,
        "topics",
        "unsubscribe",
        t,
        "-s",
        "s1",
    ]);
    let more = ack_at(&dir, &west.url, t, "s1", 4_000, 0, 100);
    assert_eq!(more.len(), 100);
    wait_synced(west, t, "s1", "east");
    let subs = meridian_integration::geo_sites::admin_ok(&[
        "--admin-url",
        &east.admin_url,
        "topics",
        "subscriptions",
        t,
    ]);
    assert!(!subs.contains("s1"), "s1 came back at east: {subs}");
}

#[test]
fn given_three_sites_and_one_down_then_the_subscription_moves_between_the_other_two_and_the_third_catches_up(
) {
    let (root, mut procs, _) = mesh_with(&["east", "west", "north"], &[], false);
    let dir = root.path().to_path_buf();
    let t = "persistent://acme/g/payments";
    const N: u64 = 3_000;

    step("east produces 3,000; west and north have them");
    produce(&dir, &procs[0].url, t, N, 0);
    wait_count(&dir, &procs[1].url, t, N as usize);
    wait_count(&dir, &procs[2].url, t, N as usize);

    step("at east the admin makes subscription s2 replicated; a consumer acknowledges the first 1,000 cumulatively");
    let east_admin = procs[0].admin_url.clone();
    let admin = |args: &[&str]| {
        let mut all = vec!["--admin-url", east_admin.as_str()];
        all.extend_from_slice(args);
        meridian_integration::geo_sites::admin_ok(&all)
    };
    admin(&[
        "topics",
        "create-subscription",
        t,
        "-s",
        "s2",
        "-m",
        "earliest",
    ]);
    let status = || {
        admin(&[
            "topics",
            "get-replicated-subscription-status",
            t,
            "-s",
            "s2",
        ])
    };
    assert_eq!(status().trim(), "false");
    admin(&[
        "topics",
        "set-replicated-subscription-status",
        t,
        "-s",
        "s2",
        "--enable",
    ]);
    assert_eq!(status().trim(), "true");
    let acked_east = ack_at(&dir, &procs[0].url, t, "s2", N, 1_000, 0);
    assert_eq!(acked_east, (0..1_000).collect::<Vec<_>>());
    wait_synced(&procs[0], t, "s2", "west");
    wait_synced(&procs[0], t, "s2", "north");

    step(
        "north goes down (kill -9); at west the subscription acknowledges 1,000 of the other 2,000",
    );
    procs[2].kill9().unwrap();
    let acked_west = ack_at(&dir, &procs[1].url, t, "s2", 2_000, 0, 1_000);
    assert!(acked_west.iter().all(|i| *i >= 1_000));
    wait_synced(&procs[1], t, "s2", "east");

    step("back at east the subscription delivers exactly the 1,000 acknowledged nowhere");
    let acked: Vec<u64> = (0..1_000).chain(acked_west.iter().copied()).collect();
    let got = drain_at(&dir, &procs[0].url, t, "s2");
    assert_eq!(sorted(got), unacked(0..N, &acked));

    step("north returns: east's and west's acknowledgements reach it, and it delivers the same 1,000");
    procs[2].start().unwrap();
    wait_synced(&procs[1], t, "s2", "north");
    wait_synced(&procs[0], t, "s2", "north");
    let got = drain_at(&dir, &procs[2].url, t, "s2");
    assert_eq!(sorted(got), unacked(0..N, &acked));
    for args in [
        vec![
            "topics",
            "get-replicated-subscription-status",
            t,
            "-s",
            "nope",
        ],
        vec![
            "topics",
            "set-replicated-subscription-status",
            t,
            "-s",
            "nope",
            "--enable",
        ],
    ] {
        let mut all = vec!["--admin-url", east_admin.as_str()];
        all.extend_from_slice(&args);
        let (code, out, err) = meridian_integration::run_admin(&all).unwrap();
        assert_ne!(code, 0, "{out}");
        assert!(err.contains("NotFound") && err.contains("nope"), "{err}");
    }
}

/// A consumer of a replicated subscription waited for the topic's replicated-subscriptions
/// lock, which applying another site's state holds while it reads the entries that state
/// covers (up to 200,000, from the bookies after a reload): a fault schedule saw SUBSCRIBE
/// unanswered for over 20 s. The topic's stats waited for it too (the lock is now one per
/// subscription, held by the apply, and the stats read the remotes' sync without it). The
/// fail point makes every such read pause 5 s first.
#[test]
fn given_another_sites_state_being_applied_then_a_consumer_of_the_replicated_subscription_attaches_and_the_stats_answer_at_once(
) {
    use meridian_integration::raw::{subscribe, Got, Raw};
    let (root, procs, _) = mesh_with(
        &["east", "west"],
        &[("MERIDIAN_TEST_FAILPOINTS", "repl:slow_scan_5s")],
        false,
    );
    let (east, west) = (&procs[0], &procs[1]);
    let dir = root.path().to_path_buf();
    let t = "persistent://acme/g/applying";

    step("east produces 200 messages; at west a replicated subscription acknowledges 100");
    produce(&dir, &east.url, t, 200, 0);
    wait_count(&dir, &west.url, t, 200);
    let hits = |s: &StandaloneProc| s.log_text().matches("fail point hit").count();
    let before = hits(east);
    ack_at(&dir, &west.url, t, "s1", 200, 100, 0);

    step("east applies west's state (paused in its read); a consumer of s1 subscribes there");
    let deadline = Instant::now() + Duration::from_secs(60);
    while hits(east) <= before {
        assert!(Instant::now() < deadline, "east applied no state of west's");
        std::thread::sleep(Duration::from_millis(20));
    }
    let paused = Instant::now();
    let mut c = Raw::connected(&east.url);
    let mut sub = subscribe(t, "s1", 1, 1);
    if let Some(s) = sub.subscribe.as_mut() {
        s.replicate_subscription_state = Some(true);
    }
    let asked = Instant::now();
    c.send(&sub);
    let answer = loop {
        match c.recv(Duration::from_secs(20)) {
            Got::Frame(f) if f.command.success.is_some() || f.command.error.is_some() => break f,
            Got::Frame(_) => continue,
            Got::Closed => panic!("connection closed"),
            Got::Nothing => panic!("no answer to SUBSCRIBE within 20 s"),
        }
    };
    let took = asked.elapsed();
    println!("SUBSCRIBE answered in {} ms", took.as_millis());
    assert!(answer.command.success.is_some(), "{:?}", answer.command);
    assert!(
        took < Duration::from_secs(3),
        "SUBSCRIBE waited {took:?} for the state being applied"
    );

    step("the topic's stats answer while the apply still reads");
    let asked = Instant::now();
    let stats = sub_stats(east, t, "s1").expect("s1 in the stats");
    let took = asked.elapsed();
    println!("stats answered in {} ms", took.as_millis());
    assert!(
        asked.duration_since(paused) < Duration::from_secs(4),
        "the stats were asked after the apply's 5 s pause"
    );
    assert_eq!(stats["replicated"], true, "{stats}");
    assert!(
        took < Duration::from_secs(3),
        "the stats waited {took:?} for the state being applied"
    );
}
