//! Bookie autorecovery with real processes: bookies in two racks, a broker running the auditor
//! and a replication worker, the stock Python client producing while a bookie is killed for
//! good, then `bookies decommission` of a live one.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use meridian_integration::{
    admin_json, run_admin, step, wait_for_bookies, BookieProc, BrokerProc, MetaCluster, PyClient,
};
use meridian_storage::ledger::{LedgerClient, LedgerClientOptions, LedgerState};
use meridian_storage::proto::{self, Request, Response, Status};
use serde_json::Value;

const T: Duration = Duration::from_secs(120);

/// Every ledger: no fragment names `gone`, every fragment spans both racks, and every entry
/// (up to the last of a closed ledger; of an open one, while any replica has it) is on every
/// bookie of its write set, verified. Answers the entries checked.
async fn check_ledgers(
    client: &LedgerClient,
    gone: &BTreeSet<String>,
    rack_of: &BTreeMap<String, &str>,
) -> u64 {
    let mut checked = 0;
    for id in client.list().await.expect("ledgers") {
        let (m, _) = client.metadata(id).await.expect("metadata");
        let q = m.quorums().expect("quorums");
        for f in &m.fragments {
            for b in &f.ensemble {
                assert!(!gone.contains(b), "ledger {id} still names {b}: {m:?}");
            }
            let racks: BTreeSet<&str> = f.ensemble.iter().map(|b| rack_of[b]).collect();
            assert_eq!(racks.len(), 2, "ledger {id} fragment {f:?} in one rack");
        }
        let mut entry = 0u64;
        loop {
            if m.state == LedgerState::Closed && m.last_entry.is_none_or(|l| entry > l) {
                break;
            }
            let frag = m.fragment_of(entry);
            let mut found = 0;
            let mut absent = Vec::new();
            for i in q.write_set(entry) {
                let addr = &frag.ensemble[i];
                let conn = client.connection(addr).await.expect("connect");
                let r = conn
                    .call(
                        Request::Read {
                            ledger_id: id,
                            entry_id: entry,
                        },
                        Duration::from_secs(5),
                    )
                    .await
                    .expect("read");
                match r {
                    Response::Read {
                        status: Status::Ok,
                        entry: bytes,
                        ..
                    } => {
                        let e = proto::open(&bytes).expect("verifies");
                        assert_eq!((e.ledger_id, e.entry_id), (id, entry));
                        found += 1;
                    }
                    other => absent.push(format!("{addr}: {other:?}")),
                }
            }
            if m.state != LedgerState::Closed && found == 0 {
                break;
            }
            assert!(
                absent.is_empty(),
                "ledger {id} ({:?}) entry {entry}: {absent:?}",
                m.state
            );
            checked += 1;
            entry += 1;
        }
    }
    checked
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_bookie_killed_for_good_then_every_ledger_is_back_to_its_write_quorum_and_decommission_empties_another(
) {
    let cluster = MetaCluster::start(1).await.expect("metadata node");
    let endpoint = cluster.endpoints()[0].clone();
    let root = cluster.root.path().to_path_buf();
    let racks = ["/r1", "/r1", "/r1", "/r2", "/r2"];
    let mut bookies: Vec<BookieProc> = racks
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let mut b = BookieProc::new(&format!("bookie{i}"), &root, &endpoint);
            b.env("MERIDIAN_BOOKIE_RACK", r);
            b.start().unwrap();
            b
        })
        .collect();
    wait_for_bookies(&cluster.client(), racks.len(), Duration::from_secs(30))
        .await
        .unwrap();
    let rack_of: BTreeMap<String, &str> = bookies
        .iter()
        .zip(racks)
        .map(|(b, r)| (b.addr.clone(), r))
        .collect();
    let mut broker = BrokerProc::new("broker", &root, &endpoint);
    broker
        .env("MERIDIAN_BROKER_ENSEMBLE", "3")
        .env("MERIDIAN_BROKER_WRITE_QUORUM", "2")
        .env("MERIDIAN_BROKER_ACK_QUORUM", "2")
        .env("MERIDIAN_BROKER_LEDGER_ROLLOVER_ENTRIES_MAX", "40")
        .env("MERIDIAN_BROKER_LEDGER_ROLLOVER_MIN_AGE_MS", "0")
        .env("MERIDIAN_BOOKIE_LOST_GRACE_MS", "3000")
        .env("MERIDIAN_BOOKIE_AUDIT_INTERVAL_MS", "1000");
    broker.start().unwrap();
    let t = |i: usize| format!("persistent://public/default/recover-{i}");
    let sends = 400u64;

    step("3 producers send 400 messages each, slowly; a consumer subscribes to each first");
    for i in 0..3 {
        let lines = PyClient::run(
            &root,
            &format!("sub{i}"),
            &[
                "consume",
                &broker.url,
                &t(i),
                "s",
                "--count",
                "0",
                "--timeout-ms",
                "100",
            ],
        )
        .finish(T)
        .expect("subscribe");
        assert!(lines.iter().all(|v| v.get("error").is_none()), "{lines:?}");
    }
    let mut producers: Vec<PyClient> = (0..3)
        .map(|i| {
            PyClient::run(
                &root,
                &format!("p{i}"),
                &[
                    "produce",
                    &broker.url,
                    &t(i),
                    "--count",
                    &sends.to_string(),
                    "--pause-every",
                    "10",
                    "--pause-ms",
                    "40",
                ],
            )
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while producers.iter().any(|p| {
        p.lines()
            .iter()
            .filter(|v| v.get("acked").is_some())
            .count()
            < 60
    }) {
        assert!(Instant::now() < deadline, "the producers did not start");
        std::thread::sleep(Duration::from_millis(50));
    }

    step("kill -9 a /r1 bookie for good while they send");
    let lost = bookies[0].addr.clone();
    bookies[0].kill9().unwrap();
    let started = Instant::now();

    step("every send is acknowledged");
    for (i, p) in producers.iter_mut().enumerate() {
        let lines = p
            .finish(T)
            .unwrap_or_else(|e| panic!("producer {i}: {e:#}"));
        let acked = lines.iter().filter(|v| v.get("acked").is_some()).count() as u64;
        assert_eq!(acked, sends, "{}: {lines:?}", t(i));
    }

    step("autorecovery: no record left and no ledger names the lost bookie");
    let client = LedgerClient::new(cluster.client(), LedgerClientOptions::default());
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let marked = admin_json(&broker.admin_url, &["bookies", "under-replicated"]);
        let mut naming = 0;
        for id in client.list().await.expect("ledgers") {
            let (m, _) = client.metadata(id).await.expect("metadata");
            if m.fragments.iter().any(|f| f.ensemble.contains(&lost)) {
                naming += 1;
            }
        }
        if naming == 0 && marked.as_array().is_some_and(Vec::is_empty) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{naming} ledgers still name {lost}; marked: {marked}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    println!(
        "re-replicated {:.1} s after the kill (grace 3 s)",
        started.elapsed().as_secs_f64()
    );
    let gone: BTreeSet<String> = [lost.clone()].into();
    let checked = check_ledgers(&client, &gone, &rack_of).await;
    assert!(checked >= 3 * sends / 2, "only {checked} entries checked");

    step("every acknowledged message is consumed");
    for i in 0..3 {
        let lines = PyClient::run(
            &root,
            &format!("c{i}"),
            &[
                "consume",
                &broker.url,
                &t(i),
                "s",
                "--count",
                &(sends + 1).to_string(),
                "--timeout-ms",
                "3000",
            ],
        )
        .finish(T)
        .unwrap_or_else(|e| panic!("consume {}: {e:#}", t(i)));
        let got: Vec<u64> = lines.iter().filter_map(|v| v["i"].as_u64()).collect();
        assert_eq!(got, (0..sends).collect::<Vec<_>>(), "{}", t(i));
    }

    step("decommission a live /r2 bookie: it turns read-only, then no ledger names it");
    let target = bookies[3].addr.clone();
    let (code, out, err) = run_admin(&[
        "--admin-url",
        &broker.admin_url,
        "bookies",
        "decommission",
        "127.0.0.1:1",
    ])
    .unwrap();
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("NotFound"), "{err}");
    let done = admin_json(
        &broker.admin_url,
        &["bookies", "decommission", &target, "--timeout", "120"],
    );
    assert_eq!(done["done"], true, "{done}");
    let listed = admin_json(&broker.admin_url, &["bookies", "list"]);
    let state = listed
        .as_array()
        .and_then(|l| l.iter().find(|b| b["address"] == target.as_str()))
        .map(|b| b["state"].clone());
    assert_eq!(state, Some(Value::from("decommissioned")), "{listed}");
    let gone: BTreeSet<String> = [lost, target.clone()].into();
    check_ledgers(&client, &gone, &rack_of).await;

    step("writes go on without it; a new subscription reads everything");
    let lines = PyClient::run(
        &root,
        "p-after",
        &[
            "produce",
            &broker.url,
            &t(0),
            "--count",
            "20",
            "--start",
            &sends.to_string(),
        ],
    )
    .finish(T)
    .expect("produce after");
    assert_eq!(
        lines.iter().filter(|v| v.get("acked").is_some()).count(),
        20
    );
    let lines = PyClient::run(
        &root,
        "c-all",
        &[
            "consume",
            &broker.url,
            &t(0),
            "fresh",
            "--count",
            &(sends + 21).to_string(),
            "--timeout-ms",
            "3000",
        ],
    )
    .finish(T)
    .expect("consume all");
    let got: Vec<u64> = lines.iter().filter_map(|v| v["i"].as_u64()).collect();
    assert_eq!(got, (0..sends + 20).collect::<Vec<_>>());
    check_ledgers(&client, &gone, &rack_of).await;
}
