//! A site of several brokers: registration, bundle ownership, lookups that redirect to the
//! owner, refusal at a non-owner, and a killed owner's topics served by another broker once its
//! session expires (real processes on loopback, the stock Python client).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use meridian_integration::raw::{error_of, producer, Raw};
use meridian_integration::{
    admin_json, host, run_admin, step, wait_for_bookies, BookieProc, BrokerProc, MetaCluster,
    PyClient,
};
use meridian_protocol::pb::ServerError;

mod pki;
use serde_json::Value;

const T: Duration = Duration::from_secs(120);
const TOPICS: usize = 8;
const MESSAGES: u64 = 40;

fn topic(i: usize) -> String {
    format!("persistent://public/default/site-{i}")
}

/// The `i` values a consume run printed.
fn consumed(lines: &[Value]) -> Vec<u64> {
    lines.iter().filter_map(|v| v["i"].as_u64()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_two_brokers_then_topics_have_one_owner_lookups_redirect_and_a_killed_owners_topics_move(
) {
    let cluster = MetaCluster::start(1).await.expect("metadata node");
    let endpoint = cluster.endpoints()[0].clone();
    let root = cluster.root.path().to_path_buf();
    let mut bookie = BookieProc::new("bookie", &root, &endpoint);
    bookie.start().unwrap();
    wait_for_bookies(&cluster.client(), 1, Duration::from_secs(20))
        .await
        .unwrap();
    let mut brokers: Vec<BrokerProc> = ["a", "b"]
        .iter()
        .map(|n| {
            let mut b = BrokerProc::new(n, &root, &endpoint);
            b.env("MERIDIAN_BROKER_SESSION_TTL_MS", "2000")
                .env("MERIDIAN_BROKER_LOAD_REPORT_INTERVAL_MS", "500")
                .env("MERIDIAN_BROKER_DEDUPLICATION_ENABLED", "true");
            b.start().unwrap();
            b
        })
        .collect();
    let ids: BTreeSet<String> = brokers.iter().map(|b| host(&b.url).to_string()).collect();

    step("both brokers are registered, with their URLs");
    let listed = admin_json(&brokers[0].admin_url, &["brokers", "list"]);
    let listed_ids: BTreeSet<String> = listed
        .as_array()
        .expect("a list")
        .iter()
        .map(|b| b["id"].as_str().expect("id").to_string())
        .collect();
    assert_eq!(listed_ids, ids, "{listed}");

    step("8 topics produced through a service URL that lists both brokers");
    let service = format!(
        "pulsar://{},{}",
        host(&brokers[0].url),
        host(&brokers[1].url)
    );
    let count = MESSAGES.to_string();
    for i in 0..TOPICS {
        let t = topic(i);
        let lines = PyClient::run(
            &root,
            &format!("p{i}"),
            &["produce", &service, &t, "--count", &count],
        )
        .finish(T)
        .unwrap_or_else(|e| panic!("produce {t}: {e:#}"));
        assert!(
            lines.iter().any(|v| v["done"].as_u64() == Some(MESSAGES)),
            "{t}: {lines:?}"
        );
        let acked = lines.iter().filter(|v| v.get("acked").is_some()).count() as u64;
        assert_eq!(acked, MESSAGES, "{t}: {lines:?}");
    }

    step("lookups at either broker name the same owner, and the owner is one of the two");
    let mut owner = BTreeMap::new();
    for i in 0..TOPICS {
        let t = topic(i);
        let at: Vec<String> = brokers
            .iter()
            .map(|b| {
                admin_json(&b.admin_url, &["topics", "lookup", &t])["owner"]
                    .as_str()
                    .unwrap_or_else(|| panic!("{t} has no owner"))
                    .to_string()
            })
            .collect();
        assert_eq!(at[0], at[1], "{t}: owners differ");
        assert!(ids.contains(&at[0]), "{t}: owner {}", at[0]);
        owner.insert(i, at[0].clone());
    }
    let bundles = admin_json(
        &brokers[1].admin_url,
        &["namespaces", "bundles", "public/default"],
    );
    assert_eq!(bundles.as_array().map(Vec::len), Some(4), "{bundles}");
    println!("owners: {owner:?}; bundles: {bundles}");

    step("a producer at the broker that does not own its topic is refused with ServiceNotReady");
    let t0_owner = owner[&0].clone();
    let other = brokers
        .iter()
        .find(|b| host(&b.url) != t0_owner)
        .expect("another broker");
    let mut raw = Raw::connected(&other.url);
    raw.send(&producer("site-0", 1, 1));
    let (code, msg) = error_of(&raw.expect());
    assert_eq!(code, ServerError::ServiceNotReady, "{msg}");
    assert!(msg.contains(&t0_owner), "{msg}");

    step("admin topic calls at that broker are forwarded to the owner");
    let st = admin_json(&other.admin_url, &["topics", "stats", &topic(0)]);
    assert_eq!(st["storage_entries"].as_u64(), Some(MESSAGES), "{st}");
    let internal = admin_json(&other.admin_url, &["topics", "stats-internal", &topic(0)]);
    assert_eq!(internal["entries"].as_u64(), Some(MESSAGES), "{internal}");
    let o = admin_json(&other.admin_url, &["topics", "lookup", &topic(0)]);
    assert_eq!(
        o["owner"].as_str(),
        Some(t0_owner.as_str()),
        "loading stats did not move it: {o}"
    );

    step("a partitioned topic spread over both brokers: admin calls at either broker reach every partition at its owner");
    let pt = "persistent://public/default/spread";
    let parts = 16u32;
    let (code, out, err) = run_admin(&[
        "--admin-url",
        &brokers[0].admin_url,
        "topics",
        "create-partitioned-topic",
        pt,
        "-p",
        &parts.to_string(),
    ])
    .unwrap();
    assert_eq!(code, 0, "{out}{err}");
    let lines = PyClient::run(
        &root,
        "p-spread",
        &["produce", &service, pt, "--count", "64"],
    )
    .finish(T)
    .unwrap_or_else(|e| panic!("produce {pt}: {e:#}"));
    assert!(
        lines.iter().any(|v| v["done"].as_u64() == Some(64)),
        "{lines:?}"
    );
    let part_owners: BTreeSet<String> = (0..parts)
        .map(|i| {
            admin_json(
                &brokers[0].admin_url,
                &["topics", "lookup", &format!("{pt}-partition-{i}")],
            )["owner"]
                .as_str()
                .expect("owned once produced to")
                .to_string()
        })
        .collect();
    assert_eq!(
        part_owners, ids,
        "the partitions are served by both brokers"
    );
    // Four partitions never written to: nothing of theirs is stored anywhere.
    let (code, out, err) = run_admin(&[
        "--admin-url",
        &brokers[0].admin_url,
        "topics",
        "update-partitioned-topic",
        pt,
        "-p",
        &(parts + 4).to_string(),
    ])
    .unwrap();
    assert_eq!(code, 0, "{out}{err}");
    for b in &brokers {
        let internal = admin_json(&b.admin_url, &["topics", "stats-internal", pt]);
        let all = internal.as_array().expect("one per partition");
        assert_eq!(
            all.len(),
            parts as usize,
            "the unwritten ones skipped: {internal}"
        );
        let entries: u64 = all.iter().map(|t| t["entries"].as_u64().unwrap_or(0)).sum();
        assert_eq!(entries, 64, "{internal}");
        let status = admin_json(&b.admin_url, &["topics", "compaction-status", pt]);
        assert_eq!(status["status"].as_str(), Some("NOT_RUN"), "{status}");
        admin_json(&b.admin_url, &["topics", "unload", pt]);
    }
    let plan = admin_json(
        &brokers[1].admin_url,
        &["topics", "delete", pt, "--dry-run"],
    );
    let plan_text = plan.to_string();
    for i in 0..parts {
        assert!(
            plan_text.contains(&format!("topic {pt}-partition-{i}\"")),
            "partition {i} missing from the plan: {plan}"
        );
    }
    admin_json(&brokers[1].admin_url, &["topics", "delete", pt]);
    let listed = admin_json(&brokers[0].admin_url, &["topics", "list", "public/default"]);
    assert!(!listed.to_string().contains("spread"), "{listed}");
    for i in 0..parts + 4 {
        let p = format!("{pt}-partition-{i}");
        let (code, out, err) =
            run_admin(&["--admin-url", &brokers[0].admin_url, "topics", "stats", &p]).unwrap();
        assert_ne!(code, 0, "{p} is gone: {out}{err}");
    }

    step("a durable subscription on every topic takes and acknowledges half of it");
    let half = (MESSAGES / 2).to_string();
    for i in 0..TOPICS {
        let lines = PyClient::run(
            &root,
            &format!("c{i}"),
            &["consume", &service, &topic(i), "s", "--count", &half],
        )
        .finish(T)
        .unwrap_or_else(|e| panic!("consume {}: {e:#}", topic(i)));
        assert_eq!(consumed(&lines), (0..MESSAGES / 2).collect::<Vec<_>>());
    }

    step(
        "kill -9 the owner of site-0: the other broker serves every topic once its session expires",
    );
    let victim = brokers
        .iter()
        .position(|b| host(&b.url) == t0_owner)
        .expect("the owner");
    brokers[victim].kill9().unwrap();
    let survivor = &brokers[1 - victim];
    let started = Instant::now();
    for i in 0..TOPICS {
        let lines = PyClient::run(
            &root,
            &format!("c{i}-after"),
            &["consume", &service, &topic(i), "s", "--count", &half],
        )
        .finish(T)
        .unwrap_or_else(|e| panic!("consume {} after the kill: {e:#}", topic(i)));
        assert_eq!(
            consumed(&lines),
            (MESSAGES / 2..MESSAGES).collect::<Vec<_>>(),
            "{} (owned by {} before)",
            topic(i),
            owner[&i]
        );
    }
    println!(
        "every topic consumed at the survivor {:.1} s after the kill",
        started.elapsed().as_secs_f64()
    );
    for i in 0..TOPICS {
        let o = admin_json(&survivor.admin_url, &["topics", "lookup", &topic(i)]);
        assert_eq!(o["owner"].as_str(), Some(host(&survivor.url)), "{o}");
    }
    let listed = admin_json(&survivor.admin_url, &["brokers", "list"]);
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    let survivor = 1 - victim;

    step("the killed broker comes back on its address: its crashed run's keys are taken over");
    brokers[victim].start().unwrap();
    let listed = admin_json(&brokers[victim].admin_url, &["brokers", "list"]);
    assert_eq!(listed.as_array().map(Vec::len), Some(2), "{listed}");

    step("SIGTERM the broker owning every topic while a named producer sends: it moves, no send fails, none is stored twice");
    let sends = 300u64;
    let mut p = PyClient::run(
        &root,
        "p-term",
        &[
            "produce",
            &service,
            &topic(0),
            "--count",
            &sends.to_string(),
            "--start",
            "1000",
            "--name",
            "mover",
            "--pause-every",
            "10",
            "--pause-ms",
            "30",
        ],
    );
    std::thread::sleep(Duration::from_millis(700));
    let started = Instant::now();
    assert_eq!(brokers[survivor].stop().unwrap(), 0, "a clean exit");
    println!(
        "the SIGTERMed broker handed over and exited in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let lines = p.finish(T).expect("the producer finishes");
    let failed: Vec<&Value> = lines.iter().filter(|v| v.get("failed").is_some()).collect();
    assert!(failed.is_empty(), "failed sends: {failed:?}");
    let acked = lines.iter().filter(|v| v.get("acked").is_some()).count() as u64;
    assert_eq!(acked, sends, "{lines:?}");
    let o = admin_json(&brokers[victim].admin_url, &["topics", "lookup", &topic(0)]);
    assert_eq!(o["owner"].as_str(), Some(host(&brokers[victim].url)), "{o}");
    let lines = PyClient::run(
        &root,
        "c-term",
        &[
            "consume",
            &service,
            &topic(0),
            "s",
            "--count",
            &sends.to_string(),
            "--timeout-ms",
            "3000",
        ],
    )
    .finish(T)
    .expect("consume after the handover");
    assert_eq!(consumed(&lines), (1000..1000 + sends).collect::<Vec<_>>());
    let extra = PyClient::run(
        &root,
        "c-term-2",
        &[
            "consume",
            &service,
            &topic(0),
            "s",
            "--count",
            "1",
            "--timeout-ms",
            "1500",
        ],
    )
    .finish(T)
    .expect("nothing more");
    assert_eq!(consumed(&extra), Vec::<u64>::new(), "stored twice");

    step("kill -9 and restart at once: the new run takes over the crashed run's keys, no wait");
    brokers[victim].kill9().unwrap();
    let restarted = Instant::now();
    brokers[victim].start().unwrap();
    let took = restarted.elapsed();
    assert!(
        took < Duration::from_millis(1500),
        "restart took {took:?}, a session TTL is 2 s"
    );
    let lines = PyClient::run(
        &root,
        "p-after-restart",
        &[
            "produce",
            &service,
            &topic(0),
            "--count",
            "5",
            "--start",
            "5000",
        ],
    )
    .finish(T)
    .expect("produce after the restart");
    assert_eq!(
        lines.iter().filter(|v| v.get("acked").is_some()).count(),
        5,
        "{lines:?}"
    );
}

/// A metadata node, a bookie and a broker whose metadata session lasts 2 s.
async fn one_of_each_with_a_2s_session() -> (MetaCluster, BookieProc, BrokerProc) {
    let cluster = MetaCluster::start(1).await.expect("metadata node");
    let endpoint = cluster.endpoints()[0].clone();
    let root = cluster.root.path().to_path_buf();
    let mut bookie = BookieProc::new("bookie", &root, &endpoint);
    bookie.start().unwrap();
    wait_for_bookies(&cluster.client(), 1, Duration::from_secs(20))
        .await
        .unwrap();
    let mut broker = BrokerProc::new("broker", &root, &endpoint);
    broker.env("MERIDIAN_BROKER_SESSION_TTL_MS", "2000");
    broker.start().unwrap();
    (cluster, bookie, broker)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_the_metadata_store_unreachable_then_the_broker_stops_serving_before_its_session_could_expire(
) {
    let (mut cluster, _bookie, broker) = one_of_each_with_a_2s_session().await;
    let ttl = Duration::from_millis(2000);

    step("a producer is served");
    let mut c = Raw::connected(&broker.url);
    c.send(&producer("lost-0", 1, 1));
    let f = c.expect();
    assert!(f.command.producer_success.is_some(), "{:?}", f.command);

    step("SIGSTOP the metadata store: the producer is closed within the session TTL");
    cluster.nodes[0].pause(true).unwrap();
    let paused = Instant::now();
    let closed = loop {
        match c.recv(ttl * 2) {
            meridian_integration::raw::Got::Frame(f) if f.command.close_producer.is_some() => {
                break paused.elapsed()
            }
            meridian_integration::raw::Got::Frame(_) => continue,
            other => panic!(
                "no CLOSE_PRODUCER within {:?} of the pause: {}",
                ttl * 2,
                match other {
                    meridian_integration::raw::Got::Closed => "connection closed",
                    _ => "nothing",
                }
            ),
        }
    };
    println!(
        "producer closed {} ms after the store stopped",
        closed.as_millis()
    );
    assert!(
        closed < ttl,
        "closed after {closed:?}; the session may have expired at {ttl:?}"
    );

    step("SIGCONT: the broker registers again and serves the topic");
    cluster.nodes[0].pause(false).unwrap();
    c.until_served(Duration::from_secs(30), 2, |id| producer("lost-0", id, id));
}

/// A chaos finding (seed 23): after a session loss the unload gave up closing a consumer
/// whose subscription's state was held by a call to the unreachable store, and the consumer
/// stayed on an instance nothing served, hearing nothing, until its connection dropped. Here
/// the first acknowledgement of a new subscription (which starts its cursor ledger through
/// the store) is what holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_session_lost_while_an_acknowledgement_waits_for_the_store_then_the_consumer_is_still_closed_and_served_again(
) {
    use meridian_integration::raw::{ack, flow, subscribe, Got};
    let (mut cluster, _bookie, broker) = one_of_each_with_a_2s_session().await;

    step("a consumer of a new subscription receives a message");
    let mut c = Raw::connected(&broker.url);
    let id = c.produce_one("held-0", 1, 1, b"one");
    c.send(&subscribe("held-0", "s", 7, 2));
    assert!(c.expect().command.success.is_some());
    c.send(&flow(7, 10));
    let m = loop {
        let f = c.expect();
        if let Some(m) = f.command.message {
            break m;
        }
    };
    assert_eq!(m.message_id.entry_id, id.entry_id);

    step("SIGSTOP the store, then the acknowledgement: it waits for the store while the session ends");
    cluster.nodes[0].pause(true).unwrap();
    let paused = Instant::now();
    c.send(&ack(7, 3, &id));
    // The store comes back well after the session ended and the broker's call to it gave
    // up (client.request_timeout_ms, 5 s): the consumer must have been told by then.
    let stopped_for = Duration::from_secs(12);
    let mut resumed = false;
    let closed = loop {
        if !resumed && paused.elapsed() >= stopped_for {
            cluster.nodes[0].pause(false).unwrap();
            resumed = true;
        }
        match c.recv(Duration::from_millis(200)) {
            Got::Frame(f) if f.command.close_consumer.is_some() => break paused.elapsed(),
            Got::Frame(_) | Got::Nothing => {}
            Got::Closed => panic!("the connection closed instead"),
        }
        assert!(
            paused.elapsed() < Duration::from_secs(40),
            "no CLOSE_CONSUMER within 40 s of the store stopping (resumed after {stopped_for:?}):\n{}",
            broker.log_text()
        );
    };
    if !resumed {
        cluster.nodes[0].pause(false).unwrap();
    }
    println!(
        "consumer closed {} ms after the store stopped",
        closed.as_millis()
    );
    // Closed while the store was still away: once the broker's call to it gave up.
    assert!(
        closed < stopped_for,
        "closed only after the store came back ({closed:?})"
    );

    step("the consumer subscribes again and is served");
    c.until_served(Duration::from_secs(30), 10, |r| {
        subscribe("held-0", "s", 8, r)
    });
    c.send(&flow(8, 10));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match c.recv(Duration::from_secs(1)) {
            Got::Frame(f) if f.command.message.is_some() => break,
            Got::Closed => panic!("connection closed"),
            _ => assert!(
                Instant::now() < deadline,
                "no message within 30 s of subscribing again"
            ),
        }
    }
}

/// Bundles of `public/default` per owner, from `namespaces bundles`.
fn bundle_owners(admin_url: &str) -> BTreeMap<String, usize> {
    let v = admin_json(admin_url, &["namespaces", "bundles", "public/default"]);
    let mut out = BTreeMap::new();
    for b in v.as_array().expect("bundles") {
        let owner = b["owner"].as_str().unwrap_or("(none)").to_string();
        *out.entry(owner).or_insert(0) += 1;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_second_broker_joins_a_loaded_one_then_the_load_manager_moves_bundles_to_it() {
    let cluster = MetaCluster::start(1).await.expect("metadata node");
    let endpoint = cluster.endpoints()[0].clone();
    let root = cluster.root.path().to_path_buf();
    let mut bookie = BookieProc::new("bookie", &root, &endpoint);
    bookie.start().unwrap();
    wait_for_bookies(&cluster.client(), 1, Duration::from_secs(20))
        .await
        .unwrap();
    let broker = |name: &str| {
        let mut b = BrokerProc::new(name, &root, &endpoint);
        b.env("MERIDIAN_BROKER_SESSION_TTL_MS", "2000")
            .env("MERIDIAN_BROKER_LOAD_REPORT_INTERVAL_MS", "500")
            .env("MERIDIAN_BROKER_LOAD_SHED_INTERVAL_MS", "1000")
            .env("MERIDIAN_BROKER_LOAD_SHED_GRACE_MS", "0");
        b
    };
    let mut a = broker("a");
    a.start().unwrap();
    let a_id = host(&a.url).to_string();
    // A shed destination left behind (a leader that stopped before placing its bundle, in a
    // namespace deleted since): the leader removes it.
    let stale = "/loadbalance/assign/gone/ns/0x00000000_0x40000000";
    cluster
        .client()
        .put(stale, br#"{"to":"127.0.0.1:1","at_ms":1}"#.to_vec())
        .await
        .unwrap();

    step("100 topics on the only broker: it owns all 4 bundles and leads the load manager");
    let produce = |name: &str, url: &str, round: &str| {
        let lines = PyClient::run(
            &root,
            name,
            &[
                "multi-produce",
                url,
                "persistent://public/default/lm",
                "--topics",
                "100",
                "--round",
                round,
            ],
        )
        .finish(T)
        .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert!(
            lines.iter().any(|v| v["done"].as_u64() == Some(100)),
            "{lines:?}"
        );
    };
    produce("p1", &a.url, "1");
    assert_eq!(
        bundle_owners(&a.admin_url),
        BTreeMap::from([(a_id.clone(), 4)])
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while admin_json(&a.admin_url, &["brokers", "list"])[0]["load"]["bundles"].as_u64() != Some(4) {
        assert!(Instant::now() < deadline, "no load report of 4 bundles");
        std::thread::sleep(Duration::from_millis(200));
    }
    let (code, out, err) = run_admin(&["--admin-url", &a.admin_url, "brokers", "leader"]).unwrap();
    assert_eq!(
        (code, out.split_whitespace().next()),
        (0, Some(a_id.as_str())),
        "{err}"
    );

    step("a second broker joins: bundles are shed to it and placed there by the next lookups");
    let mut b = broker("b");
    b.start().unwrap();
    let b_id = host(&b.url).to_string();
    let service = format!("pulsar://{},{}", host(&a.url), host(&b.url));
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut round = 2;
    loop {
        produce(&format!("p{round}"), &service, &round.to_string());
        let owners = bundle_owners(&b.admin_url);
        println!("round {round}: {owners:?}");
        if owners.get(&b_id).copied().unwrap_or(0) >= 2
            && owners.get(&a_id).copied().unwrap_or(0) >= 1
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "bundles did not move: {owners:?}"
        );
        std::thread::sleep(Duration::from_millis(1500));
        round += 1;
    }
    let log = a.log_text();
    assert!(log.contains("load manager decision"), "no decision logged");
    assert!(
        cluster.client().get(stale).await.unwrap().is_none(),
        "the stale shed destination is still there"
    );

    step("an admin unloads one bundle at its owner through the other broker");
    let bundles = admin_json(&a.admin_url, &["namespaces", "bundles", "public/default"]);
    let on_b = bundles
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["owner"].as_str() == Some(b_id.as_str()))
        .and_then(|x| x["range"].as_str())
        .expect("a bundle on b")
        .to_string();
    let r = admin_json(
        &a.admin_url,
        &["namespaces", "unload", "public/default", "--bundle", &on_b],
    );
    assert_eq!(r["unloaded"], serde_json::json!([on_b]), "{r}");
    let after = admin_json(&b.admin_url, &["namespaces", "bundles", "public/default"]);
    let now = after
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["range"].as_str() == Some(on_b.as_str()))
        .expect("the bundle");
    assert_ne!(now["owner"].as_str(), Some(b_id.as_str()), "{after}");
    let (code, _, err) = run_admin(&[
        "--admin-url",
        &a.admin_url,
        "namespaces",
        "unload",
        "public/default",
        "--bundle",
        "0x1_0x2",
    ])
    .unwrap();
    assert_ne!(code, 0);
    assert!(err.contains("no bundle"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_bundle_past_its_topic_limit_then_its_owner_splits_it_a_half_moves_and_nothing_acknowledged_is_lost(
) {
    let cluster = MetaCluster::start(1).await.expect("metadata node");
    let endpoint = cluster.endpoints()[0].clone();
    let root = cluster.root.path().to_path_buf();
    let mut bookie = BookieProc::new("bookie", &root, &endpoint);
    bookie.start().unwrap();
    wait_for_bookies(&cluster.client(), 1, Duration::from_secs(20))
        .await
        .unwrap();
    let broker = |name: &str| {
        let mut b = BrokerProc::new(name, &root, &endpoint);
        b.env("MERIDIAN_BROKER_SESSION_TTL_MS", "2000")
            .env("MERIDIAN_BROKER_LOAD_REPORT_INTERVAL_MS", "500")
            .env("MERIDIAN_BROKER_LOAD_SHED_INTERVAL_MS", "3600000")
            .env("MERIDIAN_BROKER_DEFAULT_BUNDLES", "1")
            .env("MERIDIAN_BROKER_BUNDLE_SPLIT_TOPICS_MAX", "8");
        b
    };
    let mut a = broker("a");
    a.start().unwrap();
    let mut b = broker("b");
    b.start().unwrap();
    let (a_id, b_id) = (host(&a.url).to_string(), host(&b.url).to_string());
    let service = format!("pulsar://{},{}", host(&a.url), host(&b.url));

    step("3 producers send slowly through both brokers while 24 topics fill the one bundle");
    let t = |i: usize| format!("persistent://public/default/split-p{i}");
    let sends = 150u64;
    for i in 0..3 {
        let lines = PyClient::run(
            &root,
            &format!("sub{i}"),
            &[
                "consume",
                &service,
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
        assert!(
            lines.iter().any(|v| v.get("subscribed").is_some()),
            "{lines:?}"
        );
    }
    let mut producers: Vec<PyClient> = (0..3)
        .map(|i| {
            PyClient::run(
                &root,
                &format!("p{i}"),
                &[
                    "produce",
                    &service,
                    &t(i),
                    "--count",
                    &sends.to_string(),
                    "--name",
                    &format!("split-{i}"),
                    "--pause-every",
                    "5",
                    "--pause-ms",
                    "60",
                ],
            )
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut round = 1;
    loop {
        let lines = PyClient::run(
            &root,
            &format!("m{round}"),
            &[
                "multi-produce",
                &service,
                "persistent://public/default/split",
                "--topics",
                "24",
                "--round",
                &round.to_string(),
            ],
        )
        .finish(T)
        .expect("multi-produce");
        assert!(
            lines.iter().any(|v| v["done"].as_u64() == Some(24)),
            "{lines:?}"
        );
        let owners = bundle_owners(&a.admin_url);
        let total: usize = owners.values().sum();
        println!("round {round}: {owners:?}");
        if total >= 3
            && owners.get(&a_id).copied().unwrap_or(0) >= 1
            && owners.get(&b_id).copied().unwrap_or(0) >= 1
        {
            break;
        }
        assert!(Instant::now() < deadline, "no splits: {owners:?}");
        std::thread::sleep(Duration::from_millis(700));
        round += 1;
    }
    let logs = format!("{}{}", a.log_text(), b.log_text());
    assert!(logs.contains("bundle split"), "no split logged");
    assert!(logs.contains("bundle_split_topics_max"), "no reason logged");

    step("an admin splits a bundle owned by b through a, once the automatic splits settled");
    let mut bundles = admin_json(&a.admin_url, &["namespaces", "bundles", "public/default"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        std::thread::sleep(Duration::from_millis(1500));
        let now = admin_json(&a.admin_url, &["namespaces", "bundles", "public/default"]);
        if now == bundles {
            break;
        }
        assert!(Instant::now() < deadline, "bundles keep changing: {now}");
        bundles = now;
    }
    let on_b = bundles
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["owner"].as_str() == Some(b_id.as_str()))
        .and_then(|x| x["range"].as_str())
        .expect("a bundle on b")
        .to_string();
    let r = admin_json(
        &a.admin_url,
        &[
            "namespaces",
            "split-bundle",
            "public/default",
            "--bundle",
            &on_b,
        ],
    );
    let halves: Vec<String> = r["halves"]
        .as_array()
        .expect("halves")
        .iter()
        .map(|h| h.as_str().expect("range").to_string())
        .collect();
    assert_eq!(halves.len(), 2, "{r}");
    let ranges: BTreeSet<String> =
        admin_json(&b.admin_url, &["namespaces", "bundles", "public/default"])
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["range"].as_str().unwrap().to_string())
            .collect();
    assert!(!ranges.contains(&on_b), "{ranges:?}");
    assert!(halves.iter().all(|h| ranges.contains(h)), "{ranges:?}");
    let (code, _, err) = run_admin(&[
        "--admin-url",
        &a.admin_url,
        "namespaces",
        "split-bundle",
        "public/default",
        "--bundle",
        "0x1_0x2",
    ])
    .unwrap();
    assert_ne!(code, 0);
    assert!(err.contains("no bundle"), "{err}");

    step("every send is acknowledged and every acknowledged message is consumed once, in order");
    for (i, p) in producers.iter_mut().enumerate() {
        let lines = p
            .finish(T)
            .unwrap_or_else(|e| panic!("producer {i}: {e:#}"));
        let acked = lines.iter().filter(|v| v.get("acked").is_some()).count() as u64;
        assert_eq!(acked, sends, "{}: {lines:?}", t(i));
    }
    for i in 0..3 {
        let lines = PyClient::run(
            &root,
            &format!("c{i}"),
            &[
                "consume",
                &service,
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
        assert_eq!(consumed(&lines), (0..sends).collect::<Vec<_>>(), "{}", t(i));
    }
}

/// A `meridian site up` process, stopped (SIGTERM, then its own clean-up) if the test fails.
struct SiteUp(std::process::Child);

impl Drop for SiteUp {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &self.0.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(30);
            while matches!(self.0.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

#[test]
fn given_site_up_then_a_site_of_separate_processes_serves_clients_and_stops_by_pid() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("site-up.out");
    let site = std::process::Command::new(meridian_integration::meridian_bin())
        .args([
            "site",
            "up",
            "--metadata",
            "1",
            "--bookies",
            "2",
            "--brokers",
            "2",
            "--data-dir",
        ])
        .arg(dir.path().join("site"))
        .env("RUST_LOG", "info")
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(dir.path().join("site-up.err")).unwrap())
        .spawn()
        .expect("meridian site up");
    let mut site = SiteUp(site);
    step("site up prints every address once the brokers serve");
    let deadline = Instant::now() + Duration::from_secs(120);
    let clients = loop {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        if let Some(l) = text
            .lines()
            .find(|l| l.trim_start().starts_with("clients: "))
        {
            break l.trim_start().trim_start_matches("clients: ").to_string();
        }
        assert!(
            site.0.try_wait().unwrap().is_none(),
            "site up exited: {text}{}",
            std::fs::read_to_string(dir.path().join("site-up.err")).unwrap_or_default()
        );
        assert!(
            Instant::now() < deadline,
            "no addresses within 120 s: {text}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let text = std::fs::read_to_string(&out).unwrap();
    assert_eq!(
        text.matches("broker: Pulsar protocol on").count(),
        2,
        "{text}"
    );
    let ports: Vec<String> = clients
        .trim_start_matches("pulsar://")
        .split(',')
        .map(str::to_string)
        .collect();
    assert_eq!(ports.len(), 2, "{clients}");

    step("a producer and a consumer through both brokers");
    let lines = PyClient::run(
        dir.path(),
        "p",
        &["produce", &clients, "site-up", "--count", "20"],
    )
    .finish(T)
    .expect("produce");
    assert_eq!(
        lines.iter().filter(|v| v.get("acked").is_some()).count(),
        20,
        "{lines:?}"
    );
    let lines = PyClient::run(
        dir.path(),
        "c",
        &["consume", &clients, "site-up", "s", "--count", "20"],
    )
    .finish(T)
    .expect("consume");
    if consumed(&lines) != (0..20).collect::<Vec<_>>() {
        for f in ["broker-1.log", "broker-2.log"] {
            let t = std::fs::read_to_string(dir.path().join("site").join(f)).unwrap_or_default();
            eprintln!("--- {f}\n{t}");
        }
        eprintln!("{lines:?}");
    }
    assert_eq!(consumed(&lines), (0..20).collect::<Vec<_>>());

    step("each bookie's /health and /metrics, at the addresses site up printed");
    let pages = text
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("bookie metrics: "))
        .unwrap_or_else(|| panic!("no bookie metrics line: {text}"));
    let pages: Vec<&str> = pages
        .split_whitespace()
        .next()
        .unwrap_or("")
        .split(',')
        .map(|u| u.trim_start_matches("http://"))
        .collect();
    assert_eq!(pages.len(), 2, "{text}");
    let mut syncs = 0.0;
    for addr in &pages {
        let health = meridian_integration::http_get(addr, "/health");
        assert!(health.contains("\"status\":\"ok\""), "{health}");
        syncs += meridian_integration::metric_value(
            &meridian_integration::http_get(addr, "/metrics"),
            "meridian_journal_sync_seconds_count",
        );
    }
    assert!(syncs > 0.0, "the 20 messages were journaled and synced");

    step("SIGTERM: every process of the site stops");
    let status = std::process::Command::new("kill")
        .args(["-TERM", &site.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(60);
    let code = loop {
        if let Some(s) = site.0.try_wait().unwrap() {
            break s;
        }
        if Instant::now() >= deadline {
            // What each process was doing: the end of every log of the site.
            for e in std::fs::read_dir(dir.path().join("site"))
                .unwrap()
                .flatten()
            {
                if e.path().extension().is_some_and(|x| x == "log") {
                    let t = std::fs::read_to_string(e.path()).unwrap_or_default();
                    let tail: Vec<&str> = t.lines().rev().take(30).collect();
                    eprintln!("--- {}", e.path().display());
                    for l in tail.iter().rev() {
                        eprintln!("{l}");
                    }
                }
            }
            panic!("site up did not stop within 60 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(code.success(), "{code}");
    for p in &ports {
        assert!(
            std::net::TcpStream::connect(p).is_err(),
            "a broker still listens on {p}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_bookies_in_two_racks_then_every_ensemble_spans_both() {
    let cluster = MetaCluster::start(1).await.expect("metadata node");
    let endpoint = cluster.endpoints()[0].clone();
    let root = cluster.root.path().to_path_buf();
    let racks = ["/r1", "/r1", "/r1", "/r2"];
    let mut bookies: Vec<BookieProc> = racks
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let mut b = BookieProc::new(&format!("bookie{i}"), &root, &endpoint);
            b.env("MERIDIAN_BOOKIE_RACK", r);
            b
        })
        .collect();
    meridian_integration::start_bookies(&mut bookies, &cluster.client(), Duration::from_secs(30))
        .await
        .unwrap();
    let rack_of: BTreeMap<String, &str> = bookies
        .iter()
        .zip(racks)
        .map(|(b, r)| (b.addr.clone(), r))
        .collect();
    let mut broker = BrokerProc::new("broker", &root, &endpoint);
    broker
        .env("MERIDIAN_BROKER_ENSEMBLE", "2")
        .env("MERIDIAN_BROKER_WRITE_QUORUM", "2")
        .env("MERIDIAN_BROKER_ACK_QUORUM", "2")
        .env("MERIDIAN_BROKER_LEDGER_ROLLOVER_ENTRIES_MAX", "3")
        .env("MERIDIAN_BROKER_LEDGER_ROLLOVER_MIN_AGE_MS", "0");
    broker.start().unwrap();

    step("6 topics, a ledger every 3 entries: each ensemble has a bookie of /r1 and one of /r2");
    let lines = PyClient::run(
        &root,
        "p",
        &[
            "multi-produce",
            &broker.url,
            "persistent://public/default/rack",
            "--topics",
            "6",
        ],
    )
    .finish(T)
    .expect("produce");
    assert!(
        lines.iter().any(|v| v["done"].as_u64() == Some(6)),
        "{lines:?}"
    );
    for i in 0..6 {
        let t = format!("persistent://public/default/rack-{i}");
        let _ = PyClient::run(
            &root,
            &format!("p{i}"),
            &["produce", &broker.url, &t, "--count", "7"],
        )
        .finish(T)
        .expect("produce");
        let st = admin_json(&broker.admin_url, &["topics", "stats-internal", &t]);
        let ledgers: Vec<u64> = st["ledgers"]
            .as_array()
            .expect("ledgers")
            .iter()
            .map(|l| l["ledger_id"].as_u64().expect("id"))
            .collect();
        assert!(ledgers.len() >= 3, "{st}");
        for l in ledgers {
            let (code, out, err) = meridian_integration::run_cli(&[
                "ledger",
                "show",
                &l.to_string(),
                "--metadata",
                &endpoint,
                "--json",
            ])
            .expect("ledger show");
            assert_eq!(code, 0, "{err}");
            let v: Value = serde_json::from_str(&out).expect("json");
            for f in v["fragments"].as_array().expect("fragments") {
                let used: BTreeSet<&str> = f["ensemble"]
                    .as_array()
                    .expect("ensemble")
                    .iter()
                    .map(|a| rack_of[a.as_str().expect("address")])
                    .collect();
                assert_eq!(used.len(), 2, "ledger {l} of {t}: {f}");
            }
        }
    }

    step("bookies list shows each bookie's rack; set-rack moves one within its refresh");
    let listed = admin_json(&broker.admin_url, &["bookies", "list"]);
    let shown: BTreeMap<String, String> = listed
        .as_array()
        .expect("a list")
        .iter()
        .map(|b| {
            assert_eq!(b["state"], "writable", "{b}");
            (
                b["address"].as_str().expect("address").to_string(),
                b["rack"].as_str().expect("rack").to_string(),
            )
        })
        .collect();
    let want: BTreeMap<String, String> = rack_of
        .iter()
        .map(|(a, r)| (a.clone(), r.to_string()))
        .collect();
    assert_eq!(shown, want);
    let moved = bookies[0].addr.clone();
    admin_json(
        &broker.admin_url,
        &["bookies", "set-rack", &moved, "--rack", "/r3"],
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let listed = admin_json(&broker.admin_url, &["bookies", "list"]);
        let rack = listed
            .as_array()
            .and_then(|l| l.iter().find(|b| b["address"] == moved.as_str()))
            .and_then(|b| b["rack"].as_str())
            .unwrap_or_default()
            .to_string();
        if rack == "/r3" {
            break;
        }
        assert!(Instant::now() < deadline, "{moved} still in {rack}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let (code, _, err) = run_admin(&[
        "--admin-url",
        &broker.admin_url,
        "bookies",
        "set-rack",
        "127.0.0.1:1",
        "--rack",
        "/r9",
    ])
    .unwrap();
    assert_ne!(code, 0);
    assert!(err.contains("NotFound"), "{err}");
    let (code, _, err) = run_admin(&[
        "--admin-url",
        &broker.admin_url,
        "bookies",
        "set-rack",
        &moved,
        "--rack",
        "r9",
    ])
    .unwrap();
    assert_ne!(code, 0);
    assert!(err.contains("/NAME"), "{err}");

    step("the /r2 bookie dies: new ensembles take what is left (one rack) and writes go on");
    bookies[3].kill9().unwrap();
    let lines = PyClient::run(
        &root,
        "p-after",
        &[
            "produce",
            &broker.url,
            "persistent://public/default/rack-0",
            "--count",
            "5",
        ],
    )
    .finish(T)
    .expect("produce with one rack left");
    assert_eq!(
        lines.iter().filter(|v| v.get("acked").is_some()).count(),
        5,
        "{lines:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_full_site_when_an_owner_is_killed_during_production_then_every_acknowledged_message_is_consumed_once(
) {
    let cluster = MetaCluster::start(3).await.expect("metadata nodes");
    let root = cluster.root.path().to_path_buf();
    let (mut bookies, mut brokers) = full_site(&cluster).await;
    let service = format!(
        "pulsar://{},{}",
        host(&brokers[0].url),
        host(&brokers[1].url)
    );
    let t = |i: usize| format!("persistent://public/default/full-{i}");

    step("8 named producers send 150 messages each, slowly, through both brokers");
    let sends = 150u64;
    let mut producers: Vec<PyClient> = (0..TOPICS)
        .map(|i| {
            PyClient::run(
                &root,
                &format!("p{i}"),
                &[
                    "produce",
                    &service,
                    &t(i),
                    "--count",
                    &sends.to_string(),
                    "--name",
                    &format!("full-{i}"),
                    "--pause-every",
                    "5",
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
            < 20
    }) {
        assert!(Instant::now() < deadline, "the producers did not start");
        std::thread::sleep(Duration::from_millis(50));
    }

    step("kill -9 the broker that owns the most of the 8 topics, in the middle of the sends");
    let mut owned = [0usize; 2];
    for i in 0..TOPICS {
        let o = admin_json(&brokers[0].admin_url, &["topics", "lookup", &t(i)]);
        let owner = o["owner"].as_str().unwrap_or_default();
        let k = brokers
            .iter()
            .position(|b| host(&b.url) == owner)
            .unwrap_or_else(|| panic!("{} owned by {owner:?}", t(i)));
        owned[k] += 1;
    }
    let victim = usize::from(owned[1] > owned[0]);
    println!("owned per broker: {owned:?}; killing broker {victim}");
    brokers[victim].kill9().unwrap();

    step("every send is acknowledged; every acknowledged message is consumed once, in order");
    for (i, p) in producers.iter_mut().enumerate() {
        let lines = p
            .finish(T)
            .unwrap_or_else(|e| panic!("producer {i}: {e:#}"));
        let failed: Vec<&Value> = lines.iter().filter(|v| v.get("failed").is_some()).collect();
        assert!(failed.is_empty(), "{}: {failed:?}", t(i));
        let acked = lines.iter().filter(|v| v.get("acked").is_some()).count() as u64;
        assert_eq!(acked, sends, "{}", t(i));
    }
    for i in 0..TOPICS {
        let lines = PyClient::run(
            &root,
            &format!("c{i}"),
            &[
                "consume",
                &service,
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
        assert_eq!(consumed(&lines), (0..sends).collect::<Vec<_>>(), "{}", t(i));
    }

    step("with the bookies in racks /r1, /r1, /r2, every fragment of every ledger spans both");
    let client = meridian_storage::ledger::LedgerClient::new(
        cluster.client(),
        meridian_storage::ledger::LedgerClientOptions::default(),
    );
    let rack_of = |addr: &str| {
        let i = bookies
            .iter()
            .position(|b| b.addr == addr)
            .expect("one of ours");
        FULL_SITE_RACKS[i]
    };
    let mut fragments = 0;
    for id in client.list().await.expect("ledgers") {
        let (m, _) = client.metadata(id).await.expect("metadata");
        for f in &m.fragments {
            let racks: BTreeSet<&str> = f.ensemble.iter().map(|a| rack_of(a)).collect();
            assert_eq!(racks.len(), 2, "ledger {id}: {f:?}");
            fragments += 1;
        }
    }
    assert!(fragments >= TOPICS, "only {fragments} fragments");
    drop(bookies.drain(..));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_full_site_when_every_process_restarts_in_turn_then_no_acknowledged_message_is_lost(
) {
    let mut cluster = MetaCluster::start(3).await.expect("metadata nodes");
    let root = cluster.root.path().to_path_buf();
    let (mut bookies, mut brokers) = full_site(&cluster).await;
    let service = format!(
        "pulsar://{},{}",
        host(&brokers[0].url),
        host(&brokers[1].url)
    );
    let t = |i: usize| format!("persistent://public/default/rolling-{i}");
    let topics = 4;
    // 300 pauses of 60 ms: at least 18 s of sending, longer than the restarts below.
    let sends = 1500u64;

    step("4 named producers send 1500 messages each, slowly, while every process restarts");
    let mut producers: Vec<PyClient> = (0..topics)
        .map(|i| {
            PyClient::run(
                &root,
                &format!("p{i}"),
                &[
                    "produce",
                    &service,
                    &t(i),
                    "--count",
                    &sends.to_string(),
                    "--name",
                    &format!("rolling-{i}"),
                    "--pause-every",
                    "5",
                    "--pause-ms",
                    "60",
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
            < 20
    }) {
        assert!(Instant::now() < deadline, "the producers did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let began = Instant::now();
    for id in 1..=3 {
        step(format!(
            "metadata node {id}: SIGTERM and start ({:.1} s in)",
            began.elapsed().as_secs_f64()
        ));
        // SIGTERM and wait for the exit.
        cluster.node(id).stop().unwrap();
        cluster.node(id).start().unwrap();
        cluster
            .wait_for_leader(Duration::from_secs(30))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(1000)).await;
    }
    for (i, b) in bookies.iter_mut().enumerate() {
        step(format!(
            "bookie {i}: SIGTERM and start ({:.1} s in)",
            began.elapsed().as_secs_f64()
        ));
        assert_eq!(b.stop().unwrap(), 0);
        b.start().unwrap();
        wait_for_bookies(&cluster.client(), 3, Duration::from_secs(30))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(1000)).await;
    }
    let sending = producers
        .iter()
        .filter(|p| !p.lines().iter().any(|v| v.get("done").is_some()))
        .count();
    assert!(
        sending > 0,
        "the producers finished before the brokers restarted ({:.1} s in)",
        began.elapsed().as_secs_f64()
    );
    for (i, b) in brokers.iter_mut().enumerate() {
        step(format!("broker {i}: SIGTERM and start"));
        assert_eq!(b.stop().unwrap(), 0);
        b.start().unwrap();
        tokio::time::sleep(Duration::from_millis(1000)).await;
    }

    step("every send is acknowledged; every message is consumed once, in order");
    for (i, p) in producers.iter_mut().enumerate() {
        let lines = p
            .finish(T)
            .unwrap_or_else(|e| panic!("producer {i}: {e:#}"));
        let failed: Vec<&Value> = lines.iter().filter(|v| v.get("failed").is_some()).collect();
        assert!(failed.is_empty(), "{}: {failed:?}", t(i));
        let acked = lines.iter().filter(|v| v.get("acked").is_some()).count() as u64;
        assert_eq!(acked, sends, "{}", t(i));
    }
    for i in 0..topics {
        let lines = PyClient::run(
            &root,
            &format!("c{i}"),
            &[
                "consume",
                &service,
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
        assert_eq!(consumed(&lines), (0..sends).collect::<Vec<_>>(), "{}", t(i));
    }
}

/// The racks of [`full_site`]'s bookies.
const FULL_SITE_RACKS: [&str; 3] = ["/r1", "/r1", "/r2"];

/// On `cluster`'s metadata nodes: 3 bookies in racks [`FULL_SITE_RACKS`] and 2 brokers (E3
/// Qw2 Qa2, deduplication on, 2 s sessions), all started.
async fn full_site(cluster: &MetaCluster) -> (Vec<BookieProc>, Vec<BrokerProc>) {
    let endpoints = cluster.endpoints().join(",");
    let root = cluster.root.path();
    let mut bookies: Vec<BookieProc> = (0..3)
        .map(|i| {
            let mut b = BookieProc::new(&format!("bookie{i}"), root, &endpoints);
            b.env("MERIDIAN_BOOKIE_RACK", FULL_SITE_RACKS[i]);
            b
        })
        .collect();
    // Restarted on new ports if one exits before it registers (a port picked free, taken
    // before it bound); a failure shows their logs.
    meridian_integration::start_bookies(&mut bookies, &cluster.client(), Duration::from_secs(30))
        .await
        .unwrap();
    let brokers = ["a", "b"]
        .iter()
        .map(|n| {
            let mut b = BrokerProc::new(n, root, &endpoints);
            b.env("MERIDIAN_BROKER_SESSION_TTL_MS", "2000")
                .env("MERIDIAN_BROKER_DEDUPLICATION_ENABLED", "true")
                .env("MERIDIAN_BROKER_ENSEMBLE", "3")
                .env("MERIDIAN_BROKER_WRITE_QUORUM", "2")
                .env("MERIDIAN_BROKER_ACK_QUORUM", "2");
            b.start().unwrap();
            b
        })
        .collect();
    (bookies, brokers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_traffic_on_one_broker_then_the_load_manager_sheds_a_busy_bundle_by_usage() {
    let cluster = MetaCluster::start(1).await.expect("metadata node");
    let endpoint = cluster.endpoints()[0].clone();
    let root = cluster.root.path().to_path_buf();
    let mut bookie = BookieProc::new("bookie", &root, &endpoint);
    bookie.start().unwrap();
    wait_for_bookies(&cluster.client(), 1, Duration::from_secs(20))
        .await
        .unwrap();
    let brokers: Vec<BrokerProc> = ["a", "b"]
        .iter()
        .map(|n| {
            let mut b = BrokerProc::new(n, &root, &endpoint);
            b.env("MERIDIAN_BROKER_SESSION_TTL_MS", "2000")
                .env("MERIDIAN_BROKER_LOAD_REPORT_INTERVAL_MS", "500")
                .env("MERIDIAN_BROKER_LOAD_SHED_INTERVAL_MS", "1000")
                .env("MERIDIAN_BROKER_LOAD_SHED_GRACE_MS", "600000")
                // 500 msg/s is a broker's whole capacity here: a few hundred messages per
                // second make it busy.
                .env("MERIDIAN_BROKER_LOAD_MSG_RATE_CAPACITY", "500");
            b.start().unwrap();
            b
        })
        .collect();
    let ids: Vec<String> = brokers.iter().map(|b| host(&b.url).to_string()).collect();
    let service = format!("pulsar://{},{}", ids[0], ids[1]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while admin_json(&brokers[0].admin_url, &["brokers", "list"])
        .as_array()
        .map(Vec::len)
        != Some(2)
    {
        assert!(Instant::now() < deadline, "both brokers registered");
        std::thread::sleep(Duration::from_millis(200));
    }

    step("lookups of 40 quiet topics place the 4 bundles two and two");
    // Lookups, not producers: traffic (and the CPU of creating 40 topics on a busy machine)
    // could make the usage rule shed a bundle already, and a shed bundle stays unowned until
    // its next lookup.
    let place_quiet = || {
        for i in 0..40 {
            let t = format!("persistent://public/default/quiet-{i}");
            // As a client follows redirects: the broker chosen takes the bundle at its own
            // lookup (or names another, which is asked in turn).
            let mut at = &brokers[0];
            for _ in 0..4 {
                let l = admin_json(&at.admin_url, &["topics", "lookup", &t]);
                if !l["owner"].as_str().unwrap_or("").is_empty() {
                    break;
                }
                let to = l["service_url"].as_str().unwrap_or("");
                match brokers.iter().find(|b| b.url == to) {
                    Some(b) => at = b,
                    None => break,
                }
            }
        }
    };
    place_quiet();
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let owners = bundle_owners(&brokers[0].admin_url);
        if owners.values().all(|n| *n == 2) && owners.len() == 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "bundles not two and two: {owners:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
        if owners.contains_key("(none)") {
            place_quiet();
        }
    }

    step("traffic on both bundles of one broker: the leader sheds one of them to the other");
    let lookup = |t: &str| admin_json(&brokers[0].admin_url, &["topics", "lookup", t]);
    let busy_owner = ids[0].clone();
    let mut hot: Vec<(String, String)> = Vec::new(); // (topic, bundle)
    for i in 0..200 {
        let t = format!("persistent://public/default/hot-{i}");
        let l = lookup(&t);
        let bundle = l["bundle"].as_str().expect("bundle").to_string();
        if l["owner"].as_str() == Some(busy_owner.as_str()) && hot.iter().all(|h| h.1 != bundle) {
            hot.push((t, bundle));
        }
        if hot.len() == 2 {
            break;
        }
    }
    assert_eq!(hot.len(), 2, "a topic in each of {busy_owner}'s bundles");
    let mut producers: Vec<_> = hot
        .iter()
        .enumerate()
        .map(|(i, (t, _))| {
            PyClient::run(
                &root,
                &format!("hot{i}"),
                &[
                    "produce",
                    &service,
                    t,
                    "--count",
                    "200000",
                    "--pause-every",
                    "50",
                    "--pause-ms",
                    "50",
                ],
            )
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    let moved = loop {
        let moved: Vec<&(String, String)> = hot
            .iter()
            .filter(|(t, _)| lookup(t)["owner"].as_str() == Some(ids[1].as_str()))
            .collect();
        if !moved.is_empty() {
            break moved.len();
        }
        assert!(
            Instant::now() < deadline,
            "no busy bundle moved within 60 s; loads: {}",
            admin_json(&brokers[0].admin_url, &["brokers", "list"])
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(moved, 1, "one busy bundle moved, the other stayed");
    // The site is even now: nothing more moves (the moved bundle went where the leader sent
    // it, not back to the broker it left).
    std::thread::sleep(Duration::from_secs(5));
    let owners: Vec<String> = hot
        .iter()
        .map(|(t, _)| lookup(t)["owner"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(
        owners.iter().filter(|o| **o == ids[1]).count(),
        1,
        "still one busy bundle on each broker: {owners:?}"
    );
    let metrics: String = brokers
        .iter()
        .map(|b| meridian_integration::http_get(&b.http, "/metrics"))
        .collect();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("meridian_load_manager_decisions_total")
                && l.contains("rule=\"usage\"")),
        "the decision is counted with its rule"
    );
    for p in &mut producers {
        p.kill9();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_https_admin_apis_then_a_topic_call_at_any_broker_is_forwarded_to_its_owner_over_tls()
{
    let cluster = MetaCluster::start(1).await.expect("metadata node");
    let endpoint = cluster.endpoints()[0].clone();
    let root = cluster.root.path().to_path_buf();
    let pki_dir = tempfile::tempdir().unwrap();
    pki::test_pki(pki_dir.path());
    let f = |n: &str| pki_dir.path().join(n).to_str().unwrap().to_string();
    let mut bookie = BookieProc::new("bookie", &root, &endpoint);
    bookie.start().unwrap();
    wait_for_bookies(&cluster.client(), 1, Duration::from_secs(20))
        .await
        .unwrap();
    let brokers: Vec<BrokerProc> = ["a", "b"]
        .iter()
        .map(|n| {
            let mut b = BrokerProc::new(n, &root, &endpoint);
            b.env("MERIDIAN_BROKER_TLS_CERT_FILE", &f("server.pem"))
                .env("MERIDIAN_BROKER_TLS_KEY_FILE", &f("server.key"))
                .env("MERIDIAN_BROKER_TLS_TRUST_CERTS_FILE", &f("ca.pem"))
                .env("MERIDIAN_BROKER_TLS_LISTEN", "127.0.0.1:0")
                .env("MERIDIAN_BROKER_ADMIN_TLS", "true");
            b.start().unwrap();
            b
        })
        .collect();
    for b in &brokers {
        assert!(b.admin_url.starts_with("https://"), "{}", b.admin_url);
    }
    let ca = f("ca.pem");
    let admin = |url: &str, args: &[&str]| -> Value {
        let mut all = vec![
            "--admin-url",
            url,
            "--tls-trust-cert-path",
            &ca,
            "--output",
            "json",
        ];
        all.extend_from_slice(args);
        let (code, out, err) = run_admin(&all).unwrap();
        assert_eq!(code, 0, "{args:?}: {out}{err}");
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while admin(&brokers[0].admin_url, &["brokers", "list"])
        .as_array()
        .map(Vec::len)
        != Some(2)
    {
        assert!(Instant::now() < deadline, "both brokers registered");
        std::thread::sleep(Duration::from_millis(200));
    }

    step("topics produced through both brokers; each topic's stats asked at the broker that does not own it");
    let service = format!(
        "pulsar://{},{}",
        host(&brokers[0].url),
        host(&brokers[1].url)
    );
    for i in 0..4 {
        let t = format!("persistent://public/default/tls-{i}");
        let lines = PyClient::run(
            &root,
            &format!("p{i}"),
            &["produce", &service, &t, "--count", "5"],
        )
        .finish(T)
        .unwrap_or_else(|e| panic!("produce {t}: {e:#}"));
        assert!(
            lines.iter().any(|v| v["done"].as_u64() == Some(5)),
            "{lines:?}"
        );
        let owner = admin(&brokers[0].admin_url, &["topics", "lookup", &t])["owner"]
            .as_str()
            .expect("owned")
            .to_string();
        let other = brokers
            .iter()
            .find(|b| host(&b.url) != owner)
            .expect("another broker");
        let st = admin(&other.admin_url, &["topics", "stats", &t]);
        assert_eq!(st["storage_entries"].as_u64(), Some(5), "{t}: {st}");
    }
}
