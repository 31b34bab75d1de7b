//! Three `meridian metadata` processes on loopback: crashes, restarts, membership changes,
//! sessions, and the `meridian meta` command line.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use meridian_integration::{run_cli, step, MetaCluster, MetaNode};
use meridian_metadata::model::{Event, EventKind};
use meridian_metadata::{ClientError, MetadataClient};

/// Puts until acknowledged, retrying when the outcome is unknown (a put of the same value twice
/// is harmless). Returns the acknowledged version.
async fn put_acked(client: &MetadataClient, key: &str, value: &str) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match client.put(key, value).await {
            Ok(v) => return v,
            Err(e @ (ClientError::Indeterminate(_) | ClientError::Unavailable { .. }))
                if Instant::now() < deadline =>
            {
                eprintln!("put {key}: {e}; retrying");
            }
            Err(e) => panic!("put {key} failed: {e}"),
        }
    }
}

/// Collects a watch's events in the background.
fn collect(mut watch: meridian_metadata::WatchStream) -> Arc<Mutex<Vec<Event>>> {
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&events);
    tokio::spawn(async move {
        while let Some(batch) = watch.next().await {
            match batch {
                Ok(b) => sink.lock().unwrap().extend(b),
                Err(e) => panic!("watch failed: {e}"),
            }
        }
    });
    events
}

async fn wait_until<F: Fn() -> bool>(what: &str, timeout: Duration, f: F) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_three_nodes_when_leader_is_killed_then_writes_resume_and_nothing_is_lost() {
    let mut cluster = MetaCluster::start(3).await.unwrap();
    let client = cluster.client();
    let leader = cluster
        .wait_for_leader(Duration::from_secs(10))
        .await
        .unwrap();
    step(format!("cluster up, leader is node {leader}"));

    let watch = client.watch("/load/", true, 0).await.unwrap();
    let start_revision = watch.revision + 1;
    let seen = collect(watch);

    step("1,000 puts from 16 writers; kill -9 the leader after 500 acknowledgements");
    let acked = Arc::new(Mutex::new(BTreeMap::<String, String>::new()));
    let next = Arc::new(AtomicU64::new(0));
    let count = Arc::new(AtomicU64::new(0));
    let killed_at: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let resumed_after: Arc<Mutex<Option<Duration>>> = Arc::new(Mutex::new(None));
    let mut writers = Vec::new();
    for _ in 0..16 {
        let (client, acked, next, count) = (
            client.clone(),
            Arc::clone(&acked),
            Arc::clone(&next),
            Arc::clone(&count),
        );
        let (killed_at, resumed_after) = (Arc::clone(&killed_at), Arc::clone(&resumed_after));
        writers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= 1_000 {
                    return;
                }
                let (key, value) = (format!("/load/{i:04}"), format!("value-{i}"));
                let started = Instant::now();
                put_acked(&client, &key, &value).await;
                let done_at = Instant::now();
                // Resumed = the first write that began after the kill was acknowledged.
                if let Some(k) = *killed_at.lock().unwrap() {
                    let mut r = resumed_after.lock().unwrap();
                    if started > k {
                        let after = done_at - k;
                        if r.is_none_or(|prev| after < prev) {
                            *r = Some(after);
                        }
                    }
                }
                acked.lock().unwrap().insert(key, value);
                count.fetch_add(1, Ordering::SeqCst);
            }
        }));
    }
    wait_until("500 acknowledged puts", Duration::from_secs(60), || {
        count.load(Ordering::SeqCst) >= 500
    })
    .await;
    let victim = cluster
        .wait_for_leader(Duration::from_secs(5))
        .await
        .unwrap();
    *killed_at.lock().unwrap() = Some(Instant::now());
    cluster.node(victim).kill9().unwrap();
    step(format!("killed leader node {victim} with SIGKILL"));
    for w in writers {
        w.await.unwrap();
    }
    let resumed = resumed_after
        .lock()
        .unwrap()
        .expect("a write after the kill");
    step(format!("writes resumed {resumed:?} after the kill"));
    assert!(
        resumed < Duration::from_secs(5),
        "writes took {resumed:?} to resume after the leader died"
    );
    let new_leader = cluster
        .wait_for_leader(Duration::from_secs(5))
        .await
        .unwrap();
    assert_ne!(new_leader, victim);

    step("restart the killed node; it catches up");
    cluster.node(victim).start().unwrap();
    let restarted = cluster.node(victim).client();
    let target = client.members().await.unwrap().last_applied;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(m) = restarted.members().await {
            if m.node == victim && m.last_applied >= target {
                break;
            }
        }
        assert!(Instant::now() < deadline, "node {victim} did not catch up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Its own copy of the data, replayed from its own history, holds every write.
    let replay = collect(
        restarted
            .watch("/load/", true, start_revision)
            .await
            .unwrap(),
    );

    step("every acknowledged write reads back");
    let acked = acked.lock().unwrap().clone();
    assert_eq!(acked.len(), 1_000);
    for (key, value) in &acked {
        let kv = client
            .get(key)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{key} lost"));
        assert_eq!(String::from_utf8(kv.value).unwrap(), *value, "{key}");
    }

    step("the watch saw every event exactly once, in revision order");
    let revision_now = client.list("/load/", "", 1).await.unwrap().revision;
    wait_until("the watch to catch up", Duration::from_secs(10), || {
        seen.lock().unwrap().last().map(|e| e.revision) >= Some(revision_now)
    })
    .await;
    wait_until(
        "the replay on the restarted node",
        Duration::from_secs(10),
        || replay.lock().unwrap().last().map(|e| e.revision) >= Some(revision_now),
    )
    .await;
    let seen = seen.lock().unwrap().clone();
    let replay = replay.lock().unwrap().clone();
    let revisions: Vec<u64> = seen.iter().map(|e| e.revision).collect();
    assert!(
        revisions.windows(2).all(|w| w[0] < w[1]),
        "watch events out of order or repeated"
    );
    let keys: BTreeSet<&str> = seen.iter().map(|e| e.kv.key.as_str()).collect();
    assert_eq!(keys.len(), 1_000, "every key's put was seen");
    assert!(seen.iter().all(|e| e.kind == EventKind::Put));
    // The live watch (which moved nodes when the leader died) and the restarted node's history
    // agree event for event.
    assert_eq!(seen, replay, "live watch and replayed history differ");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_one_node_when_growing_to_three_and_back_then_writes_keep_flowing() {
    let root = tempfile::tempdir().unwrap();
    let mut n1 = MetaNode::new(1, root.path(), None);
    let members = format!("1={}", n1.addr);
    n1.set_initial_members(members);
    n1.start().unwrap();
    let mut n2 = MetaNode::new(2, root.path(), None);
    let mut n3 = MetaNode::new(3, root.path(), None);
    n2.start().unwrap();
    n3.start().unwrap();
    let endpoints = [n1.addr.clone(), n2.addr.clone(), n3.addr.clone()];
    let client = MetadataClient::connect_to(&endpoints).unwrap();

    step("a node started without --initial-members says it is not a member");
    let err = n2.client().get("/x").await.unwrap_err().to_string();
    assert!(err.contains("not a member"), "{err}");

    step("writes flow in the background during the changes");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (client, stop) = (client.clone(), Arc::clone(&stop));
        tokio::spawn(async move {
            let mut acked = Vec::new();
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let key = format!("/grow/{i:06}");
                put_acked(&client, &key, "v").await;
                acked.push(key);
                i += 1;
            }
            acked
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    step("add node 2 through the client API, node 3 through `meridian meta add-member`");
    client.add_member(2, &n2.addr, false).await.unwrap();
    let (code, out, err) = run_cli(&[
        "meta",
        "--endpoints",
        &endpoints.join(","),
        "add-member",
        "3",
        &n3.addr,
    ])
    .unwrap();
    assert_eq!(code, 0, "add-member: {out}{err}");
    let m = client.members().await.unwrap();
    let voters: BTreeSet<u64> = m.members.iter().filter(|x| x.voter).map(|x| x.id).collect();
    assert_eq!(voters, BTreeSet::from([1, 2, 3]));
    // The new nodes now serve reads (forwarding to the leader as needed).
    assert!(n3.client().get("/grow/000000").await.unwrap().is_some());
    tokio::time::sleep(Duration::from_millis(300)).await;

    step("shrink back to node 1");
    let (code, out, err) = run_cli(&[
        "meta",
        "--endpoints",
        &endpoints.join(","),
        "--json",
        "remove-member",
        "3",
    ])
    .unwrap();
    assert_eq!(code, 0, "remove-member: {out}{err}");
    let json: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(json["members"].as_array().unwrap().len(), 2, "{out}");
    client.remove_member(2).await.unwrap();
    let m = client.members().await.unwrap();
    assert_eq!(m.members.len(), 1);
    assert_eq!(m.members[0].id, 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    let acked = writer.await.unwrap();
    step(format!(
        "{} writes acknowledged during the changes",
        acked.len()
    ));
    assert!(acked.len() > 10);

    step("every acknowledged write is on node 1");
    let only1 = n1.client();
    for key in &acked {
        assert!(only1.get(key).await.unwrap().is_some(), "{key} lost");
    }
    drop(root);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_every_node_paused_for_two_thirds_of_a_session_s_ttl_then_the_session_stays_surely_alive(
) {
    let mut cluster = MetaCluster::start(3).await.unwrap();
    let client = cluster.client();
    // Keep-alive rounds every 2 s, each trying for up to 2 s.
    let ttl = Duration::from_secs(6);
    let session = client.session(ttl.as_millis() as u64).await.unwrap();

    step("right after a keep-alive, every node pauses for over two thirds of the TTL");
    let mut validity = session.validity();
    tokio::time::timeout(Duration::from_secs(10), validity.changed())
        .await
        .expect("a keep-alive within 10 s")
        .unwrap();
    let renewed = Instant::now();
    for n in &mut cluster.nodes {
        n.pause(true).unwrap();
    }
    // Rounds into paused nodes fail (a round a third of the TTL after the renewal, and the
    // next a third after that); the nodes come back 4.6 s after the renewal, 1.4 s before
    // the lease would lapse.
    tokio::time::sleep_until((renewed + Duration::from_millis(4_600)).into()).await;
    for n in &mut cluster.nodes {
        n.pause(false).unwrap();
    }

    step("the session is renewed well before it could lapse");
    // (A keep-alive in flight when they come back is answered: the client before the quicker
    // retry passed this too.)
    let mut least = Duration::MAX;
    while renewed.elapsed() < Duration::from_millis(7_500) {
        let left = session
            .valid_until()
            .into_std()
            .saturating_duration_since(Instant::now());
        least = least.min(left);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        least >= Duration::from_millis(300),
        "the session came within {least:?} of lapsing"
    );
    eprintln!("the session came within {least:?} of lapsing, no nearer");
    assert_eq!(session.lost(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_session_when_keepalives_stop_then_ephemeral_keys_vanish_within_ttl() {
    let cluster = MetaCluster::start(3).await.unwrap();
    let client = cluster.client();
    let ttl_ms = 1_000;
    let mut session = client.session(ttl_ms).await.unwrap();
    let owned = client
        .put_with(
            "/live/broker-1",
            "here",
            meridian_metadata::client::PutOptions {
                session: session.id,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let watch = client.watch("/live/", true, owned.version).await.unwrap();
    let seen = collect(watch);

    step("keep-alives hold the key past several TTLs");
    tokio::time::sleep(Duration::from_millis(3 * ttl_ms)).await;
    assert!(client.get("/live/broker-1").await.unwrap().is_some());

    step("stop the keep-alives");
    session.stop_keep_alive();
    let stopped = Instant::now();
    loop {
        if client.get("/live/broker-1").await.unwrap().is_none() {
            break;
        }
        assert!(
            stopped.elapsed() < Duration::from_millis(ttl_ms + 1_500),
            "key outlived its TTL"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let gone_after = stopped.elapsed();
    step(format!(
        "ephemeral key gone {gone_after:?} after the last keep-alive"
    ));
    assert!(
        gone_after >= Duration::from_millis(ttl_ms * 2 / 3),
        "expired too early: {gone_after:?}"
    );

    wait_until(
        "the watcher to see the delete",
        Duration::from_secs(5),
        || seen.lock().unwrap().len() >= 2,
    )
    .await;
    let seen = seen.lock().unwrap().clone();
    let kinds: Vec<(EventKind, &str)> = seen.iter().map(|e| (e.kind, e.kv.key.as_str())).collect();
    assert_eq!(
        kinds,
        vec![
            (EventKind::Put, "/live/broker-1"),
            (EventKind::Delete, "/live/broker-1")
        ]
    );
    let err = client.keep_alive(session.id).await.unwrap_err();
    assert!(matches!(err, ClientError::FailedPrecondition(_)), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_cli_then_put_get_list_and_errors_follow_the_contract() {
    let cluster = MetaCluster::start(1).await.unwrap();
    let ep = cluster.endpoints().join(",");
    let cli = |args: &[&str]| {
        let mut all = vec!["meta", "--endpoints", &ep];
        all.extend_from_slice(args);
        run_cli(&all).unwrap()
    };
    let (code, out, _) = cli(&["put", "/cli/a", "alpha"]);
    assert_eq!((code, out.trim()), (0, "1"), "put prints the new version");
    let (code, out, _) = cli(&["put", "/cli/b", "beta"]);
    assert_eq!((code, out.trim()), (0, "2"));
    let (code, out, _) = cli(&["get", "/cli/a"]);
    assert_eq!((code, out.as_str()), (0, "alpha\n"));
    let (code, out, err) = cli(&["get", "/cli/missing"]);
    assert_eq!(code, 1);
    assert_eq!(out, "");
    assert!(err.contains("key not found: /cli/missing"), "{err}");
    let (code, out, _) = cli(&["list", "/cli/"]);
    assert_eq!((code, out.as_str()), (0, "/cli/a\n/cli/b\n"));
    let (_, out, _) = cli(&["--json", "get", "/cli/b"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["value"].as_str(), v["version"].as_u64()),
        (Some("beta"), Some(2))
    );

    step("compare-and-set through the CLI");
    let (code, _, err) = cli(&["put", "/cli/a", "x", "--expect-version", "7"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("expected version 7, current version 1"),
        "{err}"
    );
    let (code, _, err) = cli(&["put", "/cli/a", "x", "--create"]);
    assert_eq!(code, 1, "{err}");
    let (code, out, _) = cli(&["del", "/cli/a", "--expect-version", "1"]);
    assert_eq!((code, out.trim()), (0, "1"));

    step("bad input gets a clear error and changes nothing");
    let big = "k".repeat(2_000);
    let (code, _, err) = cli(&["put", &format!("/cli/{big}"), "v"]);
    assert_eq!(code, 1);
    assert!(err.contains("metadata.key_bytes_max"), "{err}");
    let (code, _, err) = cli(&["put", "relative/key", "v"]);
    assert_eq!(code, 1);
    assert!(err.contains("must start with '/'"), "{err}");
    let (_, out, _) = cli(&["list", "/cli/"]);
    assert_eq!(out, "/cli/b\n");

    step("watch --count replays from a revision and exits");
    let (code, out, _) = cli(&[
        "watch",
        "/cli/",
        "--prefix",
        "--from-revision",
        "1",
        "--count",
        "3",
    ]);
    assert_eq!(code, 0);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            "PUT 1 /cli/a alpha",
            "PUT 2 /cli/b beta",
            "DELETE 3 /cli/a "
        ]
    );

    step("bench: clients multiplexed on fewer connections; every put and get lands");
    let (code, out, err) = cli(&[
        "--json",
        "bench",
        "--clients",
        "6",
        "--conns",
        "2",
        "--seconds",
        "1",
        "--keys",
        "20",
        "--prefix",
        "/benchtest",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["clients"].as_u64(), v["conns"].as_u64()),
        (Some(6), Some(2))
    );
    for phase in ["puts", "gets"] {
        assert!(v[phase]["ops"].as_u64().unwrap() > 0, "{phase}: {out}");
        assert_eq!(v[phase]["errors"].as_u64(), Some(0), "{phase}: {out}");
    }
    let (_, out, _) = cli(&["list", "/benchtest/"]);
    assert_eq!(
        out.lines().count(),
        20,
        "each of the 20 keys was written: {out}"
    );
    let (code, _, err) = cli(&[
        "bench",
        "--clients",
        "2",
        "--conns",
        "3",
        "--seconds",
        "0.2",
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains("--conns must be between 1 and --clients (2)"),
        "{err}"
    );

    step("members");
    let (code, out, _) = cli(&["members"]);
    assert_eq!(code, 0);
    assert!(out.contains("voter") && out.contains('*'), "{out}");

    step("an unreachable endpoint list fails within the deadline");
    let dead = format!("127.0.0.1:{}", meridian_integration::free_port());
    let t = Instant::now();
    let (code, _, err) = run_cli(&[
        "meta",
        "--endpoints",
        &dead,
        "--timeout-ms",
        "500",
        "get",
        "/x",
    ])
    .unwrap();
    assert_eq!(code, 1);
    assert!(err.contains("unavailable"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_corrupt_store_when_node_starts_then_it_stops_naming_the_file() {
    let mut cluster = MetaCluster::start(1).await.unwrap();
    cluster.client().put("/c/k", "v").await.unwrap();
    let node = cluster.node(1);
    node.stop().unwrap();
    step("damage the MANIFEST of the node's state database");
    let mut damaged = Vec::new();
    for entry in std::fs::read_dir(node.data_dir.join("state")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if name.starts_with("MANIFEST-") {
            let len = std::fs::metadata(&path).unwrap().len();
            let mut bytes = std::fs::read(&path).unwrap();
            for b in bytes.iter_mut().skip(8).take(len as usize / 2) {
                *b = 0xA5;
            }
            std::fs::write(&path, bytes).unwrap();
            damaged.push(name);
        }
    }
    assert!(!damaged.is_empty());
    node.start().unwrap();
    let code = node.wait_exit(Duration::from_secs(20)).unwrap();
    let log = node.log_text();
    assert_ne!(code, 0, "a corrupt store must stop the node; log:\n{log}");
    assert!(
        log.contains(&node.data_dir.display().to_string()),
        "the message names the store's directory; log:\n{log}"
    );
    assert!(
        log.contains("Corruption") || log.contains("corrupt"),
        "{log}"
    );
}

#[test]
fn config_print_and_invalid_values() {
    let (code, out, _) = run_cli(&["config", "print", "--role", "metadata"]).unwrap();
    assert_eq!(code, 0);
    assert!(
        out.contains("[metadata]") && out.contains("node_id = 1"),
        "{out}"
    );
    let out = std::process::Command::new(meridian_integration::meridian_bin())
        .args(["config", "print", "--role", "meta"])
        .env("MERIDIAN_CLIENT_REQUEST_TIMEOUT_MS", "1234")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("request_timeout_ms = 1234"),
        "env overrides defaults: {text}"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("m.toml");
    let check = |content: &str, expected: &str| {
        std::fs::write(&file, content).unwrap();
        let path = file.to_str().unwrap();
        let (code, _, err) =
            run_cli(&["--config", path, "config", "print", "--role", "metadata"]).unwrap();
        assert_eq!(code, 2, "{content:?} must be refused");
        assert!(err.contains(expected), "{content:?}: {err}");
    };
    check(
        "[metadata]\nheartbeat_interval_ms = 5\n",
        "metadata.heartbeat_interval_ms = 5 is out of range; accepted 10..=10000",
    );
    check("[metadata]\nnod_id = 5\n", "unknown key metadata.nod_id");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_paused_leader_when_it_resumes_then_it_never_serves_a_stale_read() {
    let mut cluster = MetaCluster::start(3).await.unwrap();
    let client = cluster.client();
    client.put("/stale/k", "old").await.unwrap();
    let old_leader = cluster
        .wait_for_leader(Duration::from_secs(5))
        .await
        .unwrap();
    let via_old = cluster.node(old_leader).client();
    // Reads through the old leader work (and take its lease path) before the pause.
    assert_eq!(
        via_old.get("/stale/k").await.unwrap().unwrap().value,
        b"old"
    );

    step(format!(
        "SIGSTOP the leader, node {old_leader}; the others elect and move on"
    ));
    cluster.node(old_leader).pause(true).unwrap();
    let others: Vec<String> = cluster
        .nodes
        .iter()
        .filter(|n| n.id != old_leader)
        .map(|n| n.addr.clone())
        .collect();
    let survivors = MetadataClient::connect_to(&others).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let new_version = loop {
        match survivors.put("/stale/k", "new").await {
            Ok(v) => break v,
            Err(e) => {
                assert!(Instant::now() < deadline, "no new leader: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    step(format!(
        "new value at version {new_version} without node {old_leader}"
    ));

    step("queue reads on the frozen leader's open connection, then SIGCONT it");
    // These wait in its socket buffers and are handled the moment it resumes, racing with
    // whatever it learns about the new term.
    let queued: Vec<_> = (0..32)
        .map(|_| {
            let c = via_old.clone();
            tokio::spawn(async move { c.get("/stale/k").await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    cluster.node(old_leader).pause(false).unwrap();
    let mut answers = Vec::new();
    for q in queued {
        match q.await.unwrap() {
            Ok(kv) => answers.push(kv.map(|kv| String::from_utf8(kv.value).unwrap())),
            Err(e) => eprintln!("queued read refused: {e}"),
        }
    }
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(2) {
        match via_old.get("/stale/k").await {
            Ok(kv) => answers.push(kv.map(|kv| String::from_utf8(kv.value).unwrap())),
            Err(e) => eprintln!("read through the old leader refused: {e}"),
        }
    }
    step(format!("{} answered reads", answers.len()));
    assert!(
        !answers.is_empty(),
        "the resumed node must serve (or forward) reads again"
    );
    assert!(
        answers.iter().all(|a| a.as_deref() == Some("new")),
        "stale read after the pause: {answers:?}"
    );
}
