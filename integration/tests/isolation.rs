//! Tenant isolation on shared hardware: namespace isolation policies keep a namespace's
//! bundles on its brokers (secondaries only below the policy's minimum), bookie affinity groups
//! keep its ledgers on its bookies (also after a bookie loss and autorecovery). Real processes
//! on loopback, the stock Python client.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use meridian_integration::{
    admin_json, host, run_admin, step, BookieProc, BrokerProc, MetaCluster, PyClient,
};
use meridian_storage::ledger::{LedgerClient, LedgerClientOptions};

const T: Duration = Duration::from_secs(120);

/// Every ledger of `tenant` (its topics' and cursors' ledgers): the bookies of its fragments.
async fn bookies_of(client: &LedgerClient, tenant: &str) -> (usize, BTreeSet<String>) {
    let mut ledgers = 0;
    let mut used = BTreeSet::new();
    for id in client.list().await.expect("ledgers") {
        let Ok((m, _)) = client.metadata(id).await else {
            continue;
        };
        let owner = m
            .properties
            .get("managed-ledger")
            .or_else(|| m.properties.get("cursor"))
            .cloned()
            .unwrap_or_default();
        if owner.starts_with(&format!("{tenant}/")) {
            ledgers += 1;
            used.extend(m.fragments.iter().flat_map(|f| f.ensemble.iter().cloned()));
        }
    }
    (ledgers, used)
}

fn produce(root: &std::path::Path, name: &str, url: &str, topic: &str, start: u64, n: u64) {
    let lines = PyClient::run(
        root,
        name,
        &[
            "produce",
            url,
            topic,
            "--count",
            &n.to_string(),
            "--start",
            &start.to_string(),
        ],
    )
    .finish(T)
    .unwrap_or_else(|e| panic!("{name}: {e:#}"));
    let acked = lines.iter().filter(|v| v.get("acked").is_some()).count() as u64;
    assert_eq!(acked, n, "{name} {topic}: {lines:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_isolation_policies_and_bookie_groups_then_each_namespace_stays_on_its_brokers_and_bookies(
) {
    let cluster = MetaCluster::start(1).await.expect("metadata node");
    let endpoint = cluster.endpoints()[0].clone();
    let root = cluster.root.path().to_path_buf();
    let groups = ["ga", "ga", "ga", "gb", "gb"];
    let mut bookies: Vec<BookieProc> = groups
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let mut b = BookieProc::new(&format!("bookie{i}"), &root, &endpoint);
            b.env("MERIDIAN_BOOKIE_GROUP", g);
            b
        })
        .collect();
    meridian_integration::start_bookies(&mut bookies, &cluster.client(), Duration::from_secs(60))
        .await
        .unwrap();
    let in_group = |g: &str| -> BTreeSet<String> {
        bookies
            .iter()
            .zip(groups)
            .filter(|(_, x)| *x == g)
            .map(|(b, _)| b.addr.clone())
            .collect()
    };
    let (ga, gb) = (in_group("ga"), in_group("gb"));
    let broker = |name: &str| {
        let mut b = BrokerProc::new(name, &root, &endpoint);
        b.env("MERIDIAN_BROKER_SESSION_TTL_MS", "2000")
            .env("MERIDIAN_BROKER_LOAD_REPORT_INTERVAL_MS", "500")
            .env("MERIDIAN_BROKER_LOAD_SHED_INTERVAL_MS", "3600000")
            .env("MERIDIAN_BROKER_ENSEMBLE", "2")
            .env("MERIDIAN_BROKER_WRITE_QUORUM", "2")
            .env("MERIDIAN_BROKER_ACK_QUORUM", "2")
            .env("MERIDIAN_BOOKIE_LOST_GRACE_MS", "2000")
            .env("MERIDIAN_BOOKIE_AUDIT_INTERVAL_MS", "1000");
        b.start().unwrap();
        b
    };
    let mut b1 = broker("b1");
    let b2 = broker("b2");
    let (id1, id2) = (host(&b1.url).to_string(), host(&b2.url).to_string());
    let re = |id: &str| id.replace('.', "\\.");
    let service = format!("pulsar://{id1},{id2}");
    let admin = b2.admin_url.clone();

    step("tenants ta, tb, tc; ta on b1 (b2 below 1 live primary) and bookies ga; tb on b2 and gb; tc on b1 only");
    for t in ["ta", "tb", "tc"] {
        admin_json(
            &admin,
            &["tenants", "create", t, "--allowed-clusters", "standalone"],
        );
        admin_json(&admin, &["namespaces", "create", &format!("{t}/ns")]);
    }
    admin_json(
        &admin,
        &[
            "namespaces",
            "set-bookie-affinity-group",
            "ta/ns",
            "--primary-group",
            "ga",
        ],
    );
    admin_json(
        &admin,
        &[
            "namespaces",
            "set-bookie-affinity-group",
            "tb/ns",
            "--primary-group",
            "gb",
        ],
    );
    let g = admin_json(
        &admin,
        &["namespaces", "get-bookie-affinity-group", "ta/ns"],
    );
    assert_eq!(g["primary"], "ga", "{g}");
    admin_json(
        &admin,
        &[
            "ns-isolation-policy",
            "set",
            "standalone",
            "pa",
            "--namespaces",
            "ta/.*",
            "--primary",
            &re(&id1),
            "--secondary",
            &re(&id2),
            "--auto-failover-policy-type",
            "min_available",
            "--auto-failover-policy-params",
            "min_limit=1",
        ],
    );
    admin_json(
        &admin,
        &[
            "ns-isolation-policy",
            "set",
            "standalone",
            "pb",
            "--namespaces",
            "tb/.*",
            "--primary",
            &re(&id2),
        ],
    );
    admin_json(
        &admin,
        &[
            "ns-isolation-policy",
            "set",
            "standalone",
            "pc",
            "--namespaces",
            "tc/.*",
            "--primary",
            &re(&id1),
        ],
    );
    let listed = admin_json(&admin, &["ns-isolation-policy", "list", "standalone"]);
    assert_eq!(
        listed
            .as_object()
            .map(|o| o.keys().cloned().collect::<Vec<_>>()),
        Some(vec!["pa".to_string(), "pb".to_string(), "pc".to_string()]),
        "{listed}"
    );
    for (args, want) in [
        (
            vec![
                "ns-isolation-policy",
                "set",
                "standalone",
                "bad",
                "--namespaces",
                "ta/(",
                "--primary",
                "x",
            ],
            "regex",
        ),
        (
            vec![
                "ns-isolation-policy",
                "set",
                "nowhere",
                "p",
                "--namespaces",
                "ta/.*",
                "--primary",
                "x",
            ],
            "NotFound",
        ),
        (
            vec![
                "namespaces",
                "set-bookie-affinity-group",
                "ta/ns",
                "--primary-group",
                "bad group",
            ],
            "InvalidArgument",
        ),
    ] {
        let mut all = vec!["--admin-url", admin.as_str()];
        all.extend(args.iter().copied());
        let (code, out, err) = run_admin(&all).unwrap();
        assert_ne!(code, 0, "{args:?}: {out}");
        assert!(err.contains(want), "{args:?}: {err}");
    }

    // Brokers read the policies again at most 2 s after they last did.
    tokio::time::sleep(Duration::from_millis(2500)).await;

    step("each namespace's topics are served where its policy says, and its ledgers sit on its group");
    let topic = |t: &str, i: usize| format!("persistent://{t}/ns/iso-{i}");
    for t in ["ta", "tb", "tc"] {
        for i in 0..3 {
            produce(&root, &format!("p-{t}-{i}"), &service, &topic(t, i), 0, 20);
            let o = admin_json(&admin, &["topics", "lookup", &topic(t, i)]);
            let want = if t == "tb" { &id2 } else { &id1 };
            assert_eq!(o["owner"].as_str(), Some(want.as_str()), "{t}: {o}");
        }
    }
    let client = LedgerClient::new(cluster.client(), LedgerClientOptions::default());
    let (n, used) = bookies_of(&client, "ta").await;
    assert!(
        n >= 3 && used.is_subset(&ga),
        "ta: {n} ledgers on {used:?}, group {ga:?}"
    );
    let (n, used) = bookies_of(&client, "tb").await;
    assert!(
        n >= 3 && used.is_subset(&gb),
        "tb: {n} ledgers on {used:?}, group {gb:?}"
    );

    step("a ga bookie is lost: ta's writes go on and autorecovery keeps its ledgers in ga");
    let lost = bookies[0].addr.clone();
    bookies[0].kill9().unwrap();
    for i in 0..3 {
        produce(
            &root,
            &format!("p-ta-more-{i}"),
            &service,
            &topic("ta", i),
            20,
            20,
        );
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, used) = bookies_of(&client, "ta").await;
        if !used.contains(&lost) {
            assert!(used.is_subset(&ga), "ta left its group: {used:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "ta's ledgers still name {lost}: {used:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    step("tc's policy changes to b2: b1 lets its bundles go and they are served on b2; changed back, they return");
    let set_pc = |primary: &str| {
        admin_json(
            &admin,
            &[
                "ns-isolation-policy",
                "set",
                "standalone",
                "pc",
                "--namespaces",
                "tc/.*",
                "--primary",
                primary,
            ],
        );
    };
    for (primary, owner) in [(re(&id2), &id2), (re(&id1), &id1)] {
        set_pc(&primary);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            // Producing looks the topic up again: placed where the policy now says.
            produce(&root, "p-tc-moved", &service, &topic("tc", 0), 100, 1);
            let o = admin_json(&admin, &["topics", "lookup", &topic("tc", 0)]);
            if o["owner"].as_str() == Some(owner.as_str()) {
                break;
            }
            assert!(Instant::now() < deadline, "tc not moved to {owner}: {o}");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    step("b1 is killed: ta moves to its secondary b2; tc, with no secondary, is served nowhere");
    b1.kill9().unwrap();
    for i in 0..3 {
        produce(
            &root,
            &format!("p-ta-after-{i}"),
            &service,
            &topic("ta", i),
            40,
            10,
        );
        let o = admin_json(&b2.admin_url, &["topics", "lookup", &topic("ta", i)]);
        assert_eq!(o["owner"].as_str(), Some(id2.as_str()), "{o}");
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (code, out, err) = run_admin(&[
            "--admin-url",
            &b2.admin_url,
            "topics",
            "lookup",
            &topic("tc", 0),
        ])
        .unwrap();
        if code != 0 && err.contains("isolation policy pc") {
            break;
        }
        assert!(Instant::now() < deadline, "tc still served: {out}{err}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    step("every message of ta is there, in order");
    for i in 0..3 {
        let lines = PyClient::run(
            &root,
            &format!("c-ta-{i}"),
            &[
                "consume",
                &service,
                &topic("ta", i),
                "s",
                "--count",
                "51",
                "--timeout-ms",
                "3000",
            ],
        )
        .finish(T)
        .expect("consume");
        let got: Vec<u64> = lines.iter().filter_map(|v| v["i"].as_u64()).collect();
        assert_eq!(got, (0..50).collect::<Vec<_>>(), "{}", topic("ta", i));
    }
    let (_, used) = bookies_of(&client, "ta").await;
    assert!(used.is_subset(&ga), "ta: {used:?}");
}
