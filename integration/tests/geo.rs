//! Geo-replication's link between real `meridian standalone` processes: the federation's
//! certificates made by `meridian-admin geo`, the site's own cluster record with its geo URL,
//! and peers admitted only when the registry knows their site.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use meridian_config::GeoConfig;
use meridian_geo::frame::{Frame, OriginPosition, ReplicatedEntry};
use meridian_geo::link::{read_frame, write_frame};
use meridian_geo::{GeoLink, LinkError, SiteDirectory};
use meridian_integration::geo_sites::{admin_ok, geo_flags, mesh_with, wait_admin};
use meridian_integration::udp_proxy::Faults;
use meridian_integration::{admin_json, run_admin, step, StandaloneProc};

struct KnowsAll;

impl SiteDirectory for KnowsAll {
    fn knows<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<bool, String>> {
        Box::pin(async { Ok(true) })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_site_with_a_geo_link_then_only_sites_in_its_registry_are_admitted() {
    let root = tempfile::tempdir().unwrap();
    let pki = root.path().join("pki");
    let d = pki.display().to_string();

    step("meridian-admin geo create-ca and create-site-cert make the federation's files");
    admin_ok(&["geo", "create-ca", "--out-dir", &d]);
    for site in ["east", "north", "west"] {
        admin_ok(&[
            "geo",
            "create-site-cert",
            site,
            "--ca-dir",
            &d,
            "--out-dir",
            &d,
        ]);
    }
    use std::os::unix::fs::PermissionsExt;
    for key in ["ca.key", "east.key"] {
        let mode = std::fs::metadata(pki.join(key))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{key} is readable by its owner only");
    }
    let (code, _, err) = run_admin(&["geo", "create-ca", "--out-dir", &d]).unwrap();
    assert_ne!(code, 0);
    assert!(
        err.contains("must not exist"),
        "the CA key is never overwritten: {err}"
    );
    let (code, _, err) = run_admin(&[
        "geo",
        "create-site-cert",
        "no site",
        "--ca-dir",
        &d,
        "--out-dir",
        &d,
    ])
    .unwrap();
    assert_ne!(code, 0);
    assert!(err.contains("must be 1 to 64 characters"), "{err}");

    step("a site whose certificate names another site does not start, and says why");
    std::fs::create_dir_all(root.path().join("wrong")).unwrap();
    std::fs::create_dir_all(root.path().join("east")).unwrap();
    let mut wrong = StandaloneProc::new(&root.path().join("wrong"));
    let mut flags = geo_flags("east", &pki, "127.0.0.1:0");
    flags[1] = "south".into();
    wrong.args(&flags.iter().map(String::as_str).collect::<Vec<_>>());
    let err = format!("{:#}", wrong.start().unwrap_err());
    assert!(
        err.contains("geo.cert_file") && err.contains("names site \"east\""),
        "{err}"
    );

    step("east starts with its link; its own cluster record carries the geo URL");
    let mut east = StandaloneProc::new(&root.path().join("east"));
    let east_listen = format!("127.0.0.1:{}", meridian_integration::free_udp_port());
    east.args(
        &geo_flags("east", &pki, &east_listen)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    east.start().unwrap();
    let geo_url = east.geo_url.clone().expect("the banner names the geo link");
    let record = admin_json(&east.admin_url, &["clusters", "get", "east"]);
    assert_eq!(record["geo_url"], geo_url.as_str(), "{record}");
    assert_eq!(record["broker_url"], east.url.as_str(), "{record}");
    let addr = geo_url.trim_start_matches("quic://").parse().unwrap();

    step("north, unknown to east, is refused with the reason");
    let north_cfg = GeoConfig {
        listen: "127.0.0.1:0".into(),
        cert_file: pki.join("north.crt").display().to_string(),
        key_file: pki.join("north.key").display().to_string(),
        ca_file: pki.join("ca.crt").display().to_string(),
        ..GeoConfig::default()
    };
    let north = GeoLink::start(&north_cfg, "north", Arc::new(KnowsAll), None)
        .await
        .unwrap();
    match north.dial(addr, "east").await {
        Err(LinkError::Refused { reason, .. }) => {
            assert!(
                reason.contains("north is not known to site east"),
                "{reason}"
            )
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(east.log_text().contains("geo link refused"));

    step("a geo URL that is not quic://HOST:PORT is refused; clusters create north admits it");
    let (code, _, err) = run_admin(&[
        "--admin-url",
        &east.admin_url,
        "clusters",
        "create",
        "north",
        "--geo-url",
        "http://127.0.0.1:1",
    ])
    .unwrap();
    assert_eq!(code, 1);
    assert!(
        err.contains("InvalidArgument") && err.contains("quic://HOST:PORT"),
        "{err}"
    );
    let north_url = format!("quic://{}", north.local_addr());
    admin_ok(&[
        "--admin-url",
        &east.admin_url,
        "clusters",
        "create",
        "north",
        "--broker-url",
        "pulsar://127.0.0.1:1",
        "--url",
        "http://127.0.0.1:1",
        "--geo-url",
        &north_url,
    ]);
    let got = admin_json(&east.admin_url, &["clusters", "get", "north"]);
    assert_eq!(got["geo_url"], north_url.as_str());
    let peer = north.dial(addr, "east").await.unwrap();
    assert_eq!(peer.site, "east");

    step("north's entries: a damaged one, or one that came to north by replication, is refused with the reason; what came before it is kept");
    for args in [
        &[
            "tenants",
            "create",
            "acme",
            "--allowed-clusters",
            "east,north",
        ][..],
        &["namespaces", "create", "acme/g", "--clusters", "east,north"][..],
    ] {
        let mut all = vec!["--admin-url", east.admin_url.as_str()];
        all.extend_from_slice(args);
        admin_ok(&all);
    }
    let good = |seq: u64| {
        let meta = meridian_protocol::pb::MessageMetadata {
            producer_name: "north-p".into(),
            sequence_id: seq,
            publish_time: 1,
            ..Default::default()
        };
        meridian_protocol::Entry::build(&prost::Message::encode_to_vec(&meta), &[9u8; 50_000])
    };
    let mut damaged = good(1).into_bytes().to_vec();
    damaged[30_000] ^= 0x04;
    let relayed = good(2)
        .replicated(&meridian_protocol::pb::MeridianOrigin {
            site: "west".into(),
            ledger_id: 5,
            entry_id: 6,
        })
        .unwrap();
    for (bad, why) in [
        (bytes::Bytes::from(damaged), "fails its checksum"),
        (
            relayed.into_bytes(),
            "arrived there by replication and is not to be sent on",
        ),
    ] {
        let (mut send, mut recv) = peer.conn.open_bi().await.unwrap();
        let open = Frame::Open {
            topic: "persistent://acme/g/checked".into(),
            partitions: 0,
        };
        write_frame(&mut send, &open).await.unwrap();
        let held = match read_frame(&mut recv, 1 << 20).await.unwrap() {
            Some(Frame::Opened { last, .. }) => last,
            other => panic!("expected Opened, got {other:?}"),
        };
        // The next entry after what east holds, then the bad one in a frame of its own.
        let next = held.map_or(0, |p| p.entry + 1);
        let at = |entry| OriginPosition { ledger: 1, entry };
        let frames = [
            vec![ReplicatedEntry {
                at: at(next),
                bytes: good(next).into_bytes(),
            }],
            vec![ReplicatedEntry {
                at: at(next + 1),
                bytes: bad,
            }],
        ];
        for items in frames {
            write_frame(&mut send, &Frame::Entries { items })
                .await
                .unwrap();
        }
        let wait = Duration::from_secs(30);
        match tokio::time::timeout(wait, read_frame(&mut recv, 1 << 20))
            .await
            .unwrap()
            .unwrap()
        {
            Some(Frame::Ack { up_to }) => assert_eq!(up_to, at(next)),
            other => panic!("expected an Ack of {next}, got {other:?}"),
        }
        match tokio::time::timeout(wait, read_frame(&mut recv, 1 << 20))
            .await
            .unwrap()
            .unwrap()
        {
            Some(Frame::Refused { reason, .. }) => {
                assert_eq!(reason, format!("entry 1:{} of site north {why}", next + 1))
            }
            other => panic!("expected Refused, got {other:?}"),
        }
    }
    // East holds north's two good entries, and nothing of the bad ones.
    let (mut send, mut recv) = peer.conn.open_bi().await.unwrap();
    let open = Frame::Open {
        topic: "persistent://acme/g/checked".into(),
        partitions: 0,
    };
    write_frame(&mut send, &open).await.unwrap();
    match read_frame(&mut recv, 1 << 20).await.unwrap() {
        Some(Frame::Opened { last, .. }) => {
            assert_eq!(
                last,
                Some(OriginPosition {
                    ledger: 1,
                    entry: 1
                })
            )
        }
        other => panic!("expected Opened, got {other:?}"),
    }
    let stats = admin_json(
        &east.admin_url,
        &["topics", "stats", "persistent://acme/g/checked"],
    );
    assert_eq!(stats["storage_entries"], 2, "{stats}");
    drop((send, recv));

    step("after a restart the link is back, and north is still known");
    east.stop().unwrap();
    east.start().unwrap();
    assert_eq!(east.geo_url.as_deref(), Some(geo_url.as_str()));
    let record = admin_json(&east.admin_url, &["clusters", "get", "east"]);
    assert_eq!(record["geo_url"], geo_url.as_str());
    tokio::time::timeout(Duration::from_secs(30), north.dial(addr, "east"))
        .await
        .unwrap()
        .unwrap();
    north.shutdown().await;
    east.stop().unwrap();
}

/// `meridian-admin --admin-url URL ARGS` that must fail with gRPC status `status`: stderr.
fn admin_refused(url: &str, args: &[&str], status: &str) -> String {
    let mut all = vec!["--admin-url", url];
    all.extend_from_slice(args);
    let (code, _, err) = run_admin(&all).expect("meridian-admin runs");
    assert_eq!(code, 1, "{args:?} should fail");
    assert!(err.contains(status), "{args:?}: want {status}, got {err}");
    err
}

#[test]
fn given_replication_clusters_then_they_must_be_known_sites_the_tenant_may_use() {
    let root = tempfile::tempdir().unwrap();
    let mut east = StandaloneProc::new(root.path());
    east.args(&["--cluster", "east"]);
    east.start().unwrap();
    let url = east.admin_url.clone();
    let a = |args: &[&str]| {
        let mut all = vec!["--admin-url", url.as_str()];
        all.extend_from_slice(args);
        admin_ok(&all)
    };
    a(&[
        "clusters",
        "create",
        "west",
        "--geo-url",
        "quic://127.0.0.1:7300",
    ]);
    a(&["tenants", "create", "acme", "--allowed-clusters", "east"]);

    step("namespaces create --clusters: each a known site among the tenant's allowed clusters");
    let err = admin_refused(
        &url,
        &["namespaces", "create", "acme/g", "--clusters", "east,west"],
        "FailedPrecondition",
    );
    assert!(
        err.contains("west is not among tenant acme's allowed clusters"),
        "{err}"
    );
    let err = admin_refused(
        &url,
        &[
            "namespaces",
            "create",
            "acme/g",
            "--clusters",
            "east,nowhere",
        ],
        "InvalidArgument",
    );
    assert!(err.contains("nowhere does not exist"), "{err}");
    admin_refused(
        &url,
        &["namespaces", "create", "acme/g", "--clusters", "east,east"],
        "InvalidArgument",
    );
    a(&[
        "tenants",
        "update",
        "acme",
        "--allowed-clusters",
        "east,west",
    ]);
    a(&["namespaces", "create", "acme/g", "--clusters", "east,west"]);
    assert_eq!(
        admin_json(&url, &["namespaces", "get-clusters", "acme/g"]),
        serde_json::json!(["east", "west"])
    );

    step("set-clusters, and a topic's own replication clusters over its namespace's");
    a(&["namespaces", "set-clusters", "acme/g", "--clusters", "west"]);
    assert_eq!(
        admin_json(&url, &["namespaces", "get-clusters", "acme/g"]),
        serde_json::json!(["west"])
    );
    let t = "persistent://acme/g/orders";
    a(&["topics", "create", t]);
    a(&[
        "topics",
        "set-replication-clusters",
        t,
        "--clusters",
        "east",
    ]);
    assert_eq!(
        admin_json(&url, &["topics", "get-replication-clusters", t]),
        serde_json::json!(["east"])
    );
    admin_refused(
        &url,
        &[
            "topics",
            "set-replication-clusters",
            t,
            "--clusters",
            "nowhere",
        ],
        "InvalidArgument",
    );
    a(&["topics", "remove-replication-clusters", t]);
    assert_eq!(
        admin_json(&url, &["topics", "get-replication-clusters", t]),
        serde_json::Value::Null
    );
    a(&["namespaces", "remove-clusters", "acme/g"]);
    assert_eq!(
        admin_json(&url, &["namespaces", "get-clusters", "acme/g"]),
        serde_json::Value::Null
    );
    east.stop().unwrap();
}

/// Two sites on loopback, each a standalone with a geo link, that know each other and share
/// tenant `acme` with namespace `acme/g` replicated between them.
struct TwoSites {
    root: tempfile::TempDir,
    east: StandaloneProc,
    west: StandaloneProc,
}

fn two_sites() -> TwoSites {
    two_sites_with(&[])
}

/// [`two_sites`] with `MERIDIAN_*` settings for both.
fn two_sites_with(env: &[(&str, &str)]) -> TwoSites {
    let (root, mut procs) = mesh(&["east", "west"], env);
    let west = procs.pop().unwrap();
    let east = procs.pop().unwrap();
    TwoSites { root, east, west }
}

/// Sites that know each other (no proxies).
fn mesh(names: &[&str], env: &[(&str, &str)]) -> (tempfile::TempDir, Vec<StandaloneProc>) {
    let (root, procs, _) = mesh_with(names, env, false);
    (root, procs)
}

/// Reads `topic` at `url` from the earliest message until it holds `want` messages (or
/// `timeout` passes): the `i` of each, in log order.
fn read_until(
    dir: &std::path::Path,
    url: &str,
    topic: &str,
    want: usize,
    timeout: Duration,
) -> Vec<u64> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let mut r = meridian_integration::PyClient::run(dir, "reader", &["read", url, topic]);
        let got = r.finish(Duration::from_secs(120)).map(|_| r.ints("i"));
        match got {
            Ok(got) if got.len() >= want || std::time::Instant::now() > deadline => return got,
            _ if std::time::Instant::now() > deadline => return Vec::new(),
            _ => std::thread::sleep(Duration::from_millis(500)),
        }
    }
}

/// Each of `ranges` (one producer's ids, in its order) is in `got` exactly once and in order,
/// and nothing else is.
fn assert_exactly_once(got: &[u64], ranges: &[std::ops::Range<u64>], site: &str) {
    let mut seen = std::collections::BTreeSet::new();
    let dups: Vec<u64> = got
        .iter()
        .copied()
        .filter(|i| !seen.insert(*i))
        .take(10)
        .collect();
    assert!(
        dups.is_empty(),
        "{site}: duplicates {dups:?} ({} messages)",
        got.len()
    );
    for r in ranges {
        let of: Vec<u64> = got.iter().copied().filter(|i| r.contains(i)).collect();
        let missing: Vec<u64> = r.clone().filter(|i| !seen.contains(i)).take(10).collect();
        assert!(missing.is_empty(), "{site}: missing {missing:?} of {r:?}");
        assert!(
            of.windows(2).all(|w| w[0] < w[1]),
            "{site}: order of {r:?} broken"
        );
    }
    let expected: usize = ranges.iter().map(|r| r.clone().count()).sum();
    assert_eq!(got.len(), expected, "{site}: unexpected messages");
}

/// A batched producer of `count` messages numbered from `start`.
fn produce(
    dir: &std::path::Path,
    name: &str,
    url: &str,
    topic: &str,
    count: u64,
    start: u64,
) -> meridian_integration::PyClient {
    let (count, start) = (count.to_string(), start.to_string());
    meridian_integration::PyClient::run(
        dir,
        name,
        &[
            "produce", url, topic, "--count", &count, "--batch", "--start", &start,
        ],
    )
}

#[test]
fn given_two_sites_then_what_each_produces_arrives_once_at_the_other_and_survives_a_kill() {
    let mut s = two_sites();
    let dir = s.root.path().to_path_buf();
    let t = "persistent://acme/g/orders";
    const N: u64 = 2_000;

    step("both sites produce to the same topic at once (batched)");
    let mut pe = produce(&dir, "pe", &s.east.url, t, N, 0);
    let mut pw = produce(&dir, "pw", &s.west.url, t, N, 100000);
    pe.finish(Duration::from_secs(120)).unwrap();
    pw.finish(Duration::from_secs(120)).unwrap();
    let east_range = 0..N;
    let west_range = 100_000..100_000 + N;
    for (site, url) in [("east", &s.east.url), ("west", &s.west.url)] {
        let got = read_until(&dir, url, t, 2 * N as usize, Duration::from_secs(60));
        assert_exactly_once(&got, &[east_range.clone(), west_range.clone()], site);
    }

    step("kill -9 of west, east produces meanwhile, west restarts: each arrives once");
    s.west.kill9().unwrap();
    let mut pe = produce(&dir, "pe2", &s.east.url, t, N, 200000);
    pe.finish(Duration::from_secs(120)).unwrap();
    step("meanwhile east's stats show the lag: disconnected, a backlog, its age");
    let replication = |url: &str| {
        admin_json(url, &["topics", "stats", t])["replication"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let r = replication(&s.east.admin_url);
        let st = &r[0];
        if st["state"] == "disconnected" && st["backlog_entries"].as_u64() > Some(0) {
            assert_eq!(st["remote"], "west");
            assert!(st["oldest_unreplicated_age_ms"].as_u64() > Some(0), "{st}");
            assert!(!st["reason"].as_str().unwrap().is_empty(), "{st}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no lag shown: {r:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let status = admin_json(&s.east.admin_url, &["geo", "status"]);
    assert_eq!(status[0]["topic"], t, "{status}");
    assert_eq!(status[0]["remote"], "west", "{status}");
    let page = meridian_integration::http_get(&s.east.http, "/metrics");
    let series = format!("meridian_replication_backlog_entries{{topic=\"{t}\",remote=\"west\"}}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut page = page;
    while meridian_integration::metric_value(&page, &series) == 0.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no {series} in:\n{page}"
        );
        std::thread::sleep(Duration::from_millis(500));
        page = meridian_integration::http_get(&s.east.http, "/metrics");
    }
    s.west.start().unwrap();
    let later = 200_000..200_000 + N;
    let got = read_until(
        &dir,
        &s.west.url,
        t,
        3 * N as usize,
        Duration::from_secs(90),
    );
    assert_exactly_once(
        &got,
        &[east_range.clone(), west_range.clone(), later.clone()],
        "west",
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let r = replication(&s.east.admin_url);
        if r[0]["state"] == "connected" && r[0]["backlog_entries"] == 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the lag stays: {r:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let log = s.east.log_text();
    assert!(
        log.matches("replicator connected").count() >= 2,
        "east's replicator reconnected after west came back:\n{}",
        log.lines()
            .filter(|l| l.contains("replicat"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    eprintln!(
        "{}",
        log.lines()
            .filter(|l| l.contains("replicat"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    step("kill -9 of east while it sends: nothing lost, nothing twice, nothing flows back");
    let mut pe = produce(&dir, "pe3", &s.east.url, t, N, 300000);
    pe.finish(Duration::from_secs(120)).unwrap();
    s.east.kill9().unwrap();
    s.east.start().unwrap();
    let last = 300_000..300_000 + N;
    let all = [east_range, west_range, later, last];
    let got = read_until(
        &dir,
        &s.west.url,
        t,
        4 * N as usize,
        Duration::from_secs(90),
    );
    assert_exactly_once(&got, &all, "west");
    let got = read_until(
        &dir,
        &s.east.url,
        t,
        4 * N as usize,
        Duration::from_secs(30),
    );
    assert_exactly_once(&got, &all, "east");
    s.east.stop().unwrap();
    s.west.stop().unwrap();
}

/// What the stock Rust client shows of a message, beside its identity (site, `i`).
type Seen = (
    String,
    u64,
    Vec<(String, String)>,
    Option<String>,
    Option<u64>,
    Vec<u8>,
);

/// Reads `topic` at `pulsar` from the earliest message until `want` arrived and then no more
/// for a second: (site, `i`) and what the client shows of each, in log order.
async fn rust_read(
    pulsar: &pulsar::Pulsar<pulsar::TokioExecutor>,
    topic: &str,
    want: usize,
) -> Vec<((String, u64), Seen)> {
    use futures::TryStreamExt;
    use pulsar::consumer::InitialPosition;
    let mut consumer: pulsar::Consumer<Vec<u8>, pulsar::TokioExecutor> = pulsar
        .consumer()
        .with_topic(topic)
        .with_subscription("rust-reader")
        .with_subscription_type(pulsar::SubType::Exclusive)
        .with_options(
            pulsar::ConsumerOptions::default().with_initial_position(InitialPosition::Earliest),
        )
        .build()
        .await
        .unwrap();
    let mut got = Vec::new();
    loop {
        let wait = if got.len() < want { 60 } else { 1 };
        let msg = match tokio::time::timeout(Duration::from_secs(wait), consumer.try_next()).await {
            Ok(m) => m.unwrap().expect("stream open"),
            Err(_) if got.len() >= want => return got,
            Err(_) => panic!("{topic}: {} of {want} within 60 s of the last", got.len()),
        };
        let md = msg.metadata();
        let mut props: Vec<(String, String)> = md
            .properties
            .iter()
            .map(|kv| (kv.key.clone(), kv.value.clone()))
            .collect();
        props.sort();
        let prop = |k: &str| props.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        let id = (
            prop("site").expect("property site"),
            prop("i").expect("property i").parse().unwrap(),
        );
        let seen = (
            md.producer_name.clone(),
            md.publish_time,
            props.clone(),
            md.partition_key.clone(),
            md.event_time,
            msg.payload.data.clone(),
        );
        consumer.ack(&msg).await.unwrap();
        got.push((id, seen));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_the_stock_rust_client_at_both_sites_then_entries_arrive_byte_for_byte_and_replicate_to_holds(
) {
    use pulsar::{producer, ProducerOptions, Pulsar, TokioExecutor};
    let s = tokio::task::block_in_place(two_sites);
    let t = "persistent://acme/g/rust";
    const N: u64 = 1_000;
    let client = |url: String| async move {
        Pulsar::<TokioExecutor>::builder(url, TokioExecutor)
            .build()
            .await
            .unwrap()
    };
    let (east, west) = (
        client(s.east.url.clone()).await,
        client(s.west.url.clone()).await,
    );

    step("east sends 1,000 in batches of 50, west 1,000 unbatched (every tenth to west only)");
    for (pulsar, site, batched) in [(&east, "east", true), (&west, "west", false)] {
        let mut p = pulsar
            .producer()
            .with_topic(t)
            .with_name(format!("rust-{site}"))
            .with_options(ProducerOptions {
                batch_size: batched.then_some(50),
                block_queue_if_full: true,
                ..Default::default()
            })
            .build()
            .await
            .unwrap();
        let mut receipts = Vec::new();
        for i in 0..N {
            let local_only = !batched && i % 10 == 5;
            let msg = producer::Message {
                payload: format!("{site}-{i}").into_bytes(),
                properties: std::collections::HashMap::from([
                    ("i".to_string(), i.to_string()),
                    ("site".to_string(), site.to_string()),
                ]),
                partition_key: Some(format!("k{}", i % 7)),
                event_time: Some(1_700_000_000_000 + i),
                replicate_to: if local_only {
                    vec!["west".to_string()]
                } else {
                    Vec::new()
                },
                ..Default::default()
            };
            receipts.push(p.send_non_blocking(msg).await.unwrap());
        }
        if batched {
            p.send_batch().await.unwrap();
        }
        for r in receipts {
            r.await.unwrap();
        }
    }

    step("each site holds its own and the other's, once, in each producer's order; none of west's local ones reached east");
    let local_only = |(site, i): &(String, u64)| site == "west" && i % 10 == 5;
    let at_west = rust_read(&west, t, 2 * N as usize).await;
    let at_east = rust_read(&east, t, 2 * N as usize - (N / 10) as usize).await;
    for (name, got) in [("west", &at_west), ("east", &at_east)] {
        let ids: Vec<&(String, u64)> = got.iter().map(|(id, _)| id).collect();
        let unique: std::collections::BTreeSet<_> = ids.iter().collect();
        assert_eq!(unique.len(), ids.len(), "{name}: a message twice");
        for site in ["east", "west"] {
            let of: Vec<u64> = ids
                .iter()
                .filter(|(s, _)| s == site)
                .map(|(_, i)| *i)
                .collect();
            assert!(
                of.windows(2).all(|w| w[0] < w[1]),
                "{name}: {site}'s order broken"
            );
            let expected = (0..N)
                .filter(|i| name == "west" || !local_only(&(site.to_string(), *i)))
                .count();
            assert_eq!(of.len(), expected, "{name}: {site}'s messages");
        }
    }
    assert!(
        !at_east.iter().any(|(id, _)| local_only(id)),
        "a west-only message reached east"
    );

    step(
        "what the client shows of each message is the same at both sites (metadata byte for byte)",
    );
    let west_seen: std::collections::HashMap<_, _> = at_west.into_iter().collect();
    for (id, seen) in &at_east {
        let there = west_seen.get(id).expect("at west too");
        assert_eq!(seen, there, "{id:?}: east and west differ");
        assert_eq!(seen.0, format!("rust-{}", id.0), "{id:?}: producer name");
        assert_eq!(seen.4, Some(1_700_000_000_000 + id.1), "{id:?}: event time");
        assert_eq!(
            seen.5,
            format!("{}-{}", id.0, id.1).into_bytes(),
            "{id:?}: payload"
        );
    }
    let mut s = s;
    tokio::task::block_in_place(|| {
        s.east.stop().unwrap();
        s.west.stop().unwrap();
    });
}

#[test]
fn given_a_topic_produced_to_here_then_its_origins_snapshot_follows_the_log_and_a_reload_loses_nothing(
) {
    let s = two_sites();
    let dir = s.root.path().to_path_buf();
    let t = "persistent://acme/g/snapshot";
    const N: u64 = 1_000;
    let internal = |url: &str| admin_json(url, &["topics", "stats-internal", t]);

    step("east produces; west takes the topic and opens its own stream to east");
    produce(&dir, "pe1", &s.east.url, t, N, 0)
        .finish(Duration::from_secs(120))
        .unwrap();
    assert_eq!(
        read_until(&dir, &s.west.url, t, N as usize, Duration::from_secs(60)).len(),
        N as usize
    );
    step("east produces more: its stored snapshot moves to the end of its log by itself");
    produce(&dir, "pe2", &s.east.url, t, N, 10_000)
        .finish(Duration::from_secs(120))
        .unwrap();
    wait_until(
        "east's origins snapshot did not reach the end of its log",
        || {
            let st = internal(&s.east.admin_url);
            let last = st["last_confirmed"].as_str().unwrap_or("").to_string();
            !last.is_empty() && st["replication_origins"]["at"].as_str() == Some(last.as_str())
        },
    );

    step("west produces, east unloads the topic, both produce again: each arrives once");
    produce(&dir, "pw1", &s.west.url, t, N, 100_000)
        .finish(Duration::from_secs(120))
        .unwrap();
    wait_until("east's snapshot holds nothing of west", || {
        internal(&s.east.admin_url)["replication_origins"]["highest"]["west"].is_string()
    });
    admin_ok(&["--admin-url", &s.east.admin_url, "topics", "unload", t]);
    produce(&dir, "pe3", &s.east.url, t, N, 20_000)
        .finish(Duration::from_secs(120))
        .unwrap();
    produce(&dir, "pw2", &s.west.url, t, N, 110_000)
        .finish(Duration::from_secs(120))
        .unwrap();
    let all = [
        0..N,
        10_000..10_000 + N,
        20_000..20_000 + N,
        100_000..100_000 + N,
        110_000..110_000 + N,
    ];
    for (site, url) in [("east", &s.east.url), ("west", &s.west.url)] {
        let got = read_until(&dir, url, t, 5 * N as usize, Duration::from_secs(60));
        assert_exactly_once(&got, &all, site);
    }
    let (code, text, err) = run_admin(&[
        "--admin-url",
        &s.east.admin_url,
        "topics",
        "stats-internal",
        t,
    ])
    .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(
        text.contains("replication origins through") && text.contains("highest: west "),
        "{text}"
    );
}

#[test]
fn given_entries_larger_than_a_replicator_s_frames_then_each_goes_alone_and_arrives() {
    let s = two_sites();
    let t = "persistent://acme/g/large";
    step("east takes messages of 4.5 MiB (over the 4 MiB a replicator puts in a frame)");
    let out = std::process::Command::new(meridian_integration::meridian_bin())
        .args([
            "perf",
            "produce",
            "--url",
            &s.east.url,
            "--topic",
            t,
            "--size",
            &(4_500 * 1024).to_string(),
            "--messages",
            "3",
            "--seconds",
            "0",
            "--batch-max-messages",
            "1",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_until("the large entries did not all reach west", || {
        replication_of(&s.east.admin_url, t)
            .first()
            .is_some_and(|r| r["state"] == "connected" && r["backlog_entries"] == 0)
            && admin_json(&s.west.admin_url, &["topics", "stats-internal", t])["entries"].as_u64()
                == Some(3)
    });
}

#[test]
fn given_two_sites_active_active_then_a_hundred_thousand_from_each_arrive_once_in_order() {
    let mut s = two_sites();
    let dir = s.root.path().to_path_buf();
    const N: u64 = 50_000;
    let topics = ["persistent://acme/g/aa-0", "persistent://acme/g/aa-1"];
    step("east and west each produce 50,000 messages to each of two topics at once (batched)");
    let started = std::time::Instant::now();
    let mut producers = Vec::new();
    for (k, t) in topics.iter().enumerate() {
        let base = 1_000_000 * k as u64;
        producers.push(produce(&dir, &format!("e{k}"), &s.east.url, t, N, base));
        producers.push(produce(
            &dir,
            &format!("w{k}"),
            &s.west.url,
            t,
            N,
            base + 500_000,
        ));
    }
    for mut p in producers {
        p.finish(Duration::from_secs(300)).unwrap();
    }
    step("each site holds all 200,000, each once, each producer's order kept");
    for (k, t) in topics.iter().enumerate() {
        let base = 1_000_000 * k as u64;
        let ranges = [base..base + N, base + 500_000..base + 500_000 + N];
        for (site, p) in [("east", &s.east), ("west", &s.west)] {
            let got = read_until(&dir, &p.url, t, 2 * N as usize, Duration::from_secs(180));
            assert_exactly_once(&got, &ranges, &format!("{site} {t}"));
        }
    }
    eprintln!(
        "geo: 200,000 messages produced at two sites over two topics, all at both sites, checked, {:.1} s after the start",
        started.elapsed().as_secs_f64()
    );
    s.east.stop().unwrap();
    s.west.stop().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_site_of_two_brokers_then_each_topic_s_stream_is_served_by_its_owner() {
    use meridian_integration::geo_sites::{east_and_west_of_two_brokers, TwoBrokerWest};
    use meridian_integration::BrokerProc;
    let TwoBrokerWest {
        cluster: _cluster,
        root,
        endpoints,
        mut east,
        mut bookie,
        mut brokers,
        proxies,
    } = east_and_west_of_two_brokers(&[("MERIDIAN_BROKER_POLICY_REFRESH_INTERVAL_MS", "200")])
        .await;
    let at = |url: &str, args: &[&str]| {
        let mut all = vec!["--admin-url", url];
        all.extend_from_slice(args);
        admin_ok(&all)
    };
    step("west's clients spread 8 topics over both brokers; then each site produces to each");
    let topics: Vec<String> = (0..8)
        .map(|i| format!("persistent://acme/g/owned-{i}"))
        .collect();
    let service = format!(
        "pulsar://{},{}",
        brokers[0].url.trim_start_matches("pulsar://"),
        brokers[1].url.trim_start_matches("pulsar://")
    );
    for (i, t) in topics.iter().enumerate() {
        let base = 10_000 * i as u64;
        produce(&root, &format!("w{i}"), &service, t, 100, base + 5_000)
            .finish(Duration::from_secs(60))
            .unwrap();
    }
    let owners: std::collections::BTreeSet<String> = topics
        .iter()
        .map(|t| {
            admin_json(&brokers[0].admin_url, &["topics", "lookup", t])["owner"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert_eq!(
        owners.len(),
        2,
        "the topics are on both brokers: {owners:?}"
    );
    for (i, t) in topics.iter().enumerate() {
        let base = 10_000 * i as u64;
        produce(&root, &format!("e{i}"), &east.url, t, 100, base)
            .finish(Duration::from_secs(60))
            .unwrap();
    }
    step("every topic holds both sites' messages at both, once each; east was sent to b");
    for (i, t) in topics.iter().enumerate() {
        let base = 10_000 * i as u64;
        let ranges = [base..base + 100, base + 5_000..base + 5_100];
        for (site, url) in [("east", &east.url), ("west", &service)] {
            let got = read_until(&root, url, t, 200, Duration::from_secs(60));
            assert_exactly_once(&got, &ranges, &format!("{site} {t}"));
        }
    }
    assert!(
        east.log_text().contains("replicator redirected"),
        "east's replicators were sent to broker b"
    );
    for (p, n) in proxies.iter().zip(["a", "b"]) {
        let forwarded = p
            .counters
            .forwarded
            .load(std::sync::atomic::Ordering::Relaxed);
        assert!(forwarded > 0, "east reached {n} through its route");
    }
    step("one broker of west reads and sends the site's copies: the load manager's leader");
    let exports = |b: &BrokerProc| {
        meridian_integration::metric_value(
            &meridian_integration::http_get(&b.http, "/metrics"),
            "meridian_geo_object_exports_total",
        )
    };
    let before: Vec<f64> = brokers.iter().map(exports).collect();
    std::thread::sleep(Duration::from_secs(4));
    let after: Vec<f64> = brokers.iter().map(exports).collect();
    let rose: Vec<usize> = (0..2).filter(|i| after[*i] > before[*i]).collect();
    assert_eq!(rose.len(), 1, "exports before {before:?}, after {after:?}");
    let leader = admin_json(&brokers[0].admin_url, &["brokers", "leader"]);
    assert_eq!(
        leader["service_url"].as_str(),
        Some(brokers[rose[0]].url.as_str()),
        "the sender leads the load manager"
    );
    assert!(
        after.iter().zip(&before).any(|(a, b)| a - b >= 2.0),
        "the sender exports every second: before {before:?}, after {after:?}"
    );

    step("broker c joins west without a geo link; acme/l, local to west, is spread over a, b, c");
    let mut c = BrokerProc::new("c", &root, &endpoints);
    c.env("MERIDIAN_BROKER_CLUSTER_NAME", "west")
        .env("MERIDIAN_BROKER_ENSEMBLE", "1")
        .env("MERIDIAN_BROKER_WRITE_QUORUM", "1")
        .env("MERIDIAN_BROKER_ACK_QUORUM", "1")
        .env("MERIDIAN_BROKER_POLICY_REFRESH_INTERVAL_MS", "200");
    c.start().unwrap();
    let c_id = meridian_integration::host(&c.url).to_string();
    at(
        &brokers[0].admin_url,
        &["namespaces", "create", "acme/l", "--clusters", "west"],
    );
    let local: Vec<String> = (0..8)
        .map(|i| format!("persistent://acme/l/spread-{i}"))
        .collect();
    let everywhere = format!("{service},{}", meridian_integration::host(&c.url));
    let owner_of = |t: &str| {
        admin_json(&brokers[0].admin_url, &["topics", "lookup", t])["owner"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    for (i, t) in local.iter().enumerate() {
        produce(&root, &format!("l{i}"), &everywhere, t, 100, 50_000)
            .finish(Duration::from_secs(60))
            .unwrap();
    }
    let on_c = local.iter().filter(|t| owner_of(t) == c_id).count();
    assert!(
        on_c > 0,
        "c, with the fewest bundles, was given some of acme/l"
    );
    step("acme/l becomes replicated with east: c lets its bundles go, and they go to a or b");
    at(
        &brokers[0].admin_url,
        &[
            "namespaces",
            "set-clusters",
            "acme/l",
            "--clusters",
            "east,west",
        ],
    );
    wait_admin(
        &east.admin_url,
        &["namespaces", "get-clusters", "acme/l"],
        "acme/l at east",
        |out| out.contains("west"),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let owners: Vec<String> = local.iter().map(|t| owner_of(t)).collect();
        if !owners.contains(&c_id) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "c still owns some of acme/l: {owners:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(c.log_text().contains("has no geo link"), "c said why");
    for (i, t) in local.iter().enumerate() {
        produce(&root, &format!("le{i}"), &east.url, t, 100, 60_000)
            .finish(Duration::from_secs(60))
            .unwrap();
    }
    for t in &local {
        let got = read_until(&root, &service, t, 200, Duration::from_secs(60));
        assert_exactly_once(
            &got,
            &[50_000..50_100, 60_000..60_100],
            &format!("west {t}"),
        );
        assert_ne!(owner_of(t), c_id, "{t} stays off c");
    }
    step("a new replicated namespace: an admin call at c for it is served where it is placed");
    at(
        &brokers[0].admin_url,
        &["namespaces", "create", "acme/m", "--clusters", "east,west"],
    );
    let fresh = "persistent://acme/m/made-at-c";
    at(&c.admin_url, &["topics", "create", fresh]);
    let st = admin_json(&c.admin_url, &["topics", "stats", fresh]);
    assert!(st["msgs_in_total"].is_u64(), "{st}");
    assert_ne!(owner_of(fresh), c_id, "{fresh} was not taken by c");

    step("acme/t is local at each site; one of its topics on c is replicated on its own: c lets it go");
    at(
        &brokers[0].admin_url,
        &["namespaces", "create", "acme/t", "--clusters", "west"],
    );
    at(
        &east.admin_url,
        &["namespaces", "create", "acme/t", "--clusters", "east"],
    );
    let own: Vec<String> = (0..8)
        .map(|i| format!("persistent://acme/t/own-{i}"))
        .collect();
    for (i, t) in own.iter().enumerate() {
        produce(&root, &format!("t{i}"), &everywhere, t, 10, 70_000)
            .finish(Duration::from_secs(60))
            .unwrap();
    }
    let Some(single) = own.iter().find(|t| owner_of(t) == c_id).cloned() else {
        panic!("c, with the fewest bundles, was given none of acme/t");
    };
    for site in [&brokers[0].admin_url, &east.admin_url] {
        if site == &east.admin_url {
            at(site, &["topics", "create", &single]);
        }
        at(
            site,
            &[
                "topics",
                "set-replication-clusters",
                &single,
                "--clusters",
                "east,west",
            ],
        );
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while owner_of(&single) == c_id {
        assert!(
            std::time::Instant::now() < deadline,
            "c still owns {single}, replicated with east on its own"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    produce(&root, "te", &east.url, &single, 100, 80_000)
        .finish(Duration::from_secs(60))
        .unwrap();
    let got = read_until(&root, &service, &single, 110, Duration::from_secs(60));
    assert_exactly_once(
        &got,
        &[70_000..70_010, 80_000..80_100],
        &format!("west {single}"),
    );
    c.stop().unwrap();
    for b in &mut brokers {
        b.stop().unwrap();
    }
    bookie.stop().unwrap();
    east.stop().unwrap();
}

/// The `replication` section of a topic's stats at a site.
fn replication_of(admin_url: &str, topic: &str) -> Vec<serde_json::Value> {
    admin_json(admin_url, &["topics", "stats", topic])["replication"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Waits until the replicator of `topic` at `admin_url` satisfies `pred`; its stats.
fn wait_replication(
    admin_url: &str,
    topic: &str,
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let r = replication_of(admin_url, topic);
        if let Some(st) = r.first().filter(|st| pred(st)) {
            return st.clone();
        }
        assert!(std::time::Instant::now() < deadline, "{what}: {r:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn given_a_stuck_or_refused_topic_then_other_topics_replicate_and_the_stuck_one_says_why() {
    let mut s = two_sites_with(&[("MERIDIAN_GEO_STALL_AFTER_MS", "1000")]);
    let dir = s.root.path().to_path_buf();
    let west_admin = |args: &[&str]| {
        let mut all = vec!["--admin-url", s.west.admin_url.as_str()];
        all.extend_from_slice(args);
        admin_ok(&all)
    };
    let east_admin = |args: &[&str]| {
        let mut all = vec!["--admin-url", s.east.admin_url.as_str()];
        all.extend_from_slice(args);
        admin_ok(&all)
    };
    let (stuck, ok, other) = (
        "persistent://acme/g/stuck",
        "persistent://acme/g/ok",
        "persistent://acme/x/t",
    );
    // West takes nothing of acme/x from east: its namespace lists west alone.
    west_admin(&["namespaces", "create", "acme/x", "--clusters", "west"]);
    east_admin(&["namespaces", "create", "acme/x", "--clusters", "east,west"]);
    // West's copy of the stuck topic refuses every append.
    west_admin(&["topics", "create", stuck]);
    west_admin(&["topics", "terminate", stuck]);

    step("east produces to all three; the good topic arrives whole");
    let mut p1 = produce(&dir, "p1", &s.east.url, stuck, 200, 0);
    let mut p2 = produce(&dir, "p2", &s.east.url, ok, 200, 0);
    let mut p3 = produce(&dir, "p3", &s.east.url, other, 200, 0);
    for p in [&mut p1, &mut p2, &mut p3] {
        p.finish(Duration::from_secs(60)).unwrap();
    }
    let got = read_until(&dir, &s.west.url, ok, 200, Duration::from_secs(30));
    assert_exactly_once(&got, std::slice::from_ref(&(0..200)), "west");

    step("the stuck topic and the refused namespace say why at east; west holds none of them");
    let st = wait_replication(&s.east.admin_url, stuck, "stuck", |st| {
        st["state"] == "disconnected" && st["backlog_entries"].as_u64() > Some(0)
    });
    assert!(
        st["reason"].as_str().unwrap().contains("terminated"),
        "{st}"
    );
    let st = wait_replication(&s.east.admin_url, other, "refused", |st| {
        st["state"] == "disconnected"
    });
    assert!(
        st["reason"]
            .as_str()
            .unwrap()
            .contains("is not replicated with site east"),
        "{st}"
    );
    assert!(read_until(&dir, &s.west.url, stuck, 0, Duration::ZERO).is_empty());
    assert!(read_until(&dir, &s.west.url, other, 0, Duration::ZERO).is_empty());
    let ok_stats = wait_replication(&s.east.admin_url, ok, "ok", |st| {
        st["state"] == "connected" && st["backlog_entries"] == 0
    });
    assert!(ok_stats["entries_acked"].as_u64() > Some(0), "{ok_stats}");
    // The replicator's cursor is no subscription: not listed, not to be subscribed or moved.
    let subs = admin_json(&s.east.admin_url, &["subscriptions", "list", ok]);
    assert_eq!(subs, serde_json::json!([]), "{subs}");
    let err = admin_refused(
        &s.east.admin_url,
        &[
            "subscriptions",
            "skip",
            ok,
            "-s",
            "meridian.repl.west",
            "-n",
            "1",
        ],
        "NotFound",
    );
    assert!(err.contains("replicator's cursor"), "{err}");

    step("west paused (SIGSTOP): the replicator with entries in flight shows STALLED, then catches up");
    let pid = s.west.pid().unwrap().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    let mut p4 = produce(&dir, "p4", &s.east.url, ok, 200, 1000);
    p4.finish(Duration::from_secs(60)).unwrap();
    let st = wait_replication(&s.east.admin_url, ok, "stalled", |st| {
        st["state"] == "stalled"
    });
    assert!(
        st["reason"].as_str().unwrap().starts_with("STALLED"),
        "{st}"
    );
    assert!(std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status()
        .unwrap()
        .success());
    let got = read_until(&dir, &s.west.url, ok, 400, Duration::from_secs(60));
    assert_exactly_once(&got, &[0..200, 1000..1200], "west");
    let page = meridian_integration::http_get(&s.east.http, "/metrics");
    assert!(
        meridian_integration::metric_value(
            &page,
            "meridian_replication_stalls_total{remote=\"west\"}"
        ) >= 1.0,
        "{page}"
    );

    step("messages sent with replication_clusters naming east alone, or disable_replication, stay at east");
    let url = s.east.url.clone();
    let send = |name: &str, start: &str, extra: &[&str]| {
        let mut args = vec![
            "produce",
            url.as_str(),
            ok,
            "--count",
            "50",
            "--start",
            start,
        ];
        args.extend_from_slice(extra);
        let mut p = meridian_integration::PyClient::run(&dir, name, &args);
        p.finish(Duration::from_secs(60)).unwrap();
    };
    send("p5", "5000", &["--replication-clusters", "east"]);
    send("p6", "6000", &["--disable-replication"]);
    send("p7", "7000", &["--replication-clusters", "east,west"]);
    let got = read_until(&dir, &s.west.url, ok, 450, Duration::from_secs(30));
    assert_exactly_once(&got, &[0..200, 1000..1200, 7000..7050], "west");
    let got = read_until(&dir, &s.east.url, ok, 550, Duration::from_secs(30));
    assert_exactly_once(
        &got,
        &[0..200, 1000..1200, 5000..5050, 6000..6050, 7000..7050],
        "east",
    );
    wait_replication(&s.east.admin_url, ok, "drained", |st| {
        st["state"] == "connected" && st["backlog_entries"] == 0
    });
    s.east.stop().unwrap();
    s.west.stop().unwrap();
}

#[test]
fn given_three_sites_in_a_full_mesh_then_a_message_from_any_arrives_once_at_the_others() {
    let names = ["east", "west", "north"];
    let (root, mut procs) = mesh(&names, &[]);
    let dir = root.path().to_path_buf();
    let t = "persistent://acme/g/mesh";
    const N: u64 = 1_000;
    step("each site produces its own range to the same topic at once");
    let mut producers: Vec<_> = procs
        .iter()
        .enumerate()
        .map(|(i, p)| produce(&dir, &format!("p{i}"), &p.url, t, N, i as u64 * 100_000))
        .collect();
    for p in &mut producers {
        p.finish(Duration::from_secs(120)).unwrap();
    }
    let ranges: Vec<std::ops::Range<u64>> = (0..3).map(|i| i * 100_000..i * 100_000 + N).collect();
    for (p, name) in procs.iter().zip(names) {
        let got = read_until(&dir, &p.url, t, 3 * N as usize, Duration::from_secs(60));
        assert_exactly_once(&got, &ranges, name);
    }
    for p in &mut procs {
        p.stop().unwrap();
    }
}

#[test]
fn given_a_partition_and_a_lossy_link_then_every_message_arrives_once_and_the_lag_returns_to_zero()
{
    let (root, mut procs, proxies) = mesh_with(&["east", "west"], &[], true);
    let dir = root.path().to_path_buf();
    let t = "persistent://acme/g/cut";
    const N: u64 = 1_000;

    step("a lossy link (10% dropped, 10% duplicated, 0-30 ms jitter) while both produce");
    let (east, west) = (&procs[0], &procs[1]);
    for (_, _, p) in &proxies {
        p.set(Faults {
            drop_percent: 10,
            duplicate_percent: 10,
            jitter_ms: 30,
            ..Faults::default()
        });
    }
    let mut pe = produce(&dir, "pe", &east.url, t, N, 0);
    let mut pw = produce(&dir, "pw", &west.url, t, N, 100_000);
    pe.finish(Duration::from_secs(120)).unwrap();
    pw.finish(Duration::from_secs(120)).unwrap();
    let mut ranges = vec![0..N, 100_000..100_000 + N];
    for (site, p) in [("east", east), ("west", west)] {
        let got = read_until(&dir, &p.url, t, 2 * N as usize, Duration::from_secs(60));
        assert_exactly_once(&got, &ranges, site);
    }
    let dropped: u64 = proxies
        .iter()
        .map(|(_, _, p)| {
            p.counters
                .dropped
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .sum();
    assert!(
        dropped > 0,
        "the proxies dropped nothing: the test proves nothing"
    );

    step("a partition of 60 s: both sites take writes and admin changes (a TTL of 5 s, far shorter than the partition: it must not expire what is unreplicated) while cut off");
    for (_, _, p) in &proxies {
        p.partition(true);
    }
    let cut_at = std::time::Instant::now();
    let mut pe = produce(&dir, "pe2", &east.url, t, N, 200_000);
    let mut pw = produce(&dir, "pw2", &west.url, t, N, 300_000);
    pe.finish(Duration::from_secs(120)).unwrap();
    pw.finish(Duration::from_secs(120)).unwrap();
    ranges.extend([200_000..200_000 + N, 300_000..300_000 + N]);
    for p in [east, west] {
        admin_ok(&[
            "--admin-url",
            &p.admin_url,
            "namespaces",
            "set-message-ttl",
            "acme/g",
            "--ttl",
            "5",
        ]);
        let st = wait_replication(&p.admin_url, t, "cut off", |st| {
            st["state"] == "disconnected" && st["backlog_entries"].as_u64() > Some(0)
        });
        assert!(st["oldest_unreplicated_age_ms"].as_u64() > Some(0), "{st}");
    }
    // The same policy changed at both sides (west's change is the later), and one each.
    let set = |p: &StandaloneProc, args: &[&str]| {
        let mut all = vec!["--admin-url", p.admin_url.as_str(), "namespaces"];
        all.extend_from_slice(args);
        admin_ok(&all);
    };
    set(east, &["set-max-producers-per-topic", "acme/g", "-p", "7"]);
    set(east, &["set-max-consumers-per-topic", "acme/g", "-c", "11"]);
    std::thread::sleep(Duration::from_millis(20));
    set(west, &["set-max-producers-per-topic", "acme/g", "-p", "9"]);
    set(
        west,
        &["set-max-subscriptions-per-topic", "acme/g", "-m", "13"],
    );
    let policies = |p: &StandaloneProc| -> serde_json::Value {
        serde_json::from_str(&admin_ok(&[
            "--admin-url",
            &p.admin_url,
            "--output",
            "json",
            "namespaces",
            "policies",
            "acme/g",
        ]))
        .unwrap()
    };
    assert_eq!(policies(east)["max_producers_per_topic"], 7, "apart");
    assert_eq!(policies(west)["max_producers_per_topic"], 9, "apart");
    let rest = Duration::from_secs(60).saturating_sub(cut_at.elapsed());
    std::thread::sleep(rest);

    step("healed, then east killed (-9) while it catches up: everything arrives once, the lag returns to 0");
    for (_, _, p) in &proxies {
        p.partition(false);
    }
    let healed = std::time::Instant::now();
    std::thread::sleep(Duration::from_millis(300));
    procs[0].kill9().unwrap();
    procs[0].start().unwrap();
    let (east, west) = (&procs[0], &procs[1]);
    for p in [east, west] {
        wait_replication(&p.admin_url, t, "caught up", |st| {
            st["state"] == "connected" && st["backlog_entries"] == 0
        });
    }
    eprintln!(
        "geo: after a 60 s partition and a kill -9 of one site 0.3 s after the heal, both sites' replicators were connected with no backlog {:.1} s after the heal",
        healed.elapsed().as_secs_f64()
    );
    for (site, p) in [("east", east), ("west", west)] {
        let got = read_until(&dir, &p.url, t, 4 * N as usize, Duration::from_secs(60));
        assert_exactly_once(&got, &ranges, site);
    }
    // The namespace's policies changed apart converge to one value at both.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (e, w) = (policies(east), policies(west));
        if e == w {
            assert_eq!(
                e["max_producers_per_topic"], 9,
                "the later change wins: {e}"
            );
            assert_eq!(e["max_consumers_per_topic"], 11, "{e}");
            assert_eq!(e["max_subscriptions_per_topic"], 13, "{e}");
            assert_eq!(e["message_ttl_seconds"], 5, "{e}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the policies did not converge: east {e}, west {w}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    for p in &mut procs {
        p.stop().unwrap();
    }
}

#[test]
fn given_objects_made_at_one_site_then_every_site_they_name_converges_on_them() {
    let (root, mut procs) = meridian_integration::geo_sites::unlinked(&["east", "west", "north"]);
    let dir = root.path().to_path_buf();
    let (east, west, north) = (&procs[0], &procs[1], &procs[2]);
    let at = |p: &StandaloneProc, args: &[&str]| {
        let mut all = vec!["--admin-url", p.admin_url.as_str()];
        all.extend_from_slice(args);
        admin_ok(&all)
    };
    let create = |p: &StandaloneProc, name: &str, of: &StandaloneProc| {
        let geo = of.geo_url.clone().unwrap();
        at(
            p,
            &[
                "clusters",
                "create",
                name,
                "--broker-url",
                &of.url,
                "--url",
                &of.admin_url,
                "--geo-url",
                &geo,
            ],
        );
    };

    step("introductions: east knows west and north, each of them knows only east");
    create(east, "west", west);
    create(east, "north", north);
    create(west, "east", east);
    create(north, "east", east);
    step("the tenant, the namespace and a policy made at east alone");
    at(
        east,
        &[
            "tenants",
            "create",
            "acme",
            "--allowed-clusters",
            "east,west,north",
        ],
    );
    at(
        east,
        &[
            "namespaces",
            "create",
            "acme/g",
            "--clusters",
            "east,west,north",
        ],
    );
    at(
        east,
        &["namespaces", "set-message-ttl", "acme/g", "--ttl", "3600"],
    );
    at(
        east,
        &[
            "namespaces",
            "create",
            "acme/east-only",
            "--clusters",
            "east",
        ],
    );
    for (p, other) in [(west, "north"), (north, "west")] {
        wait_admin(
            &p.admin_url,
            &["clusters", "get", other],
            "the registry",
            |_| true,
        );
        wait_admin(
            &p.admin_url,
            &["tenants", "get", "acme"],
            "the tenant",
            |o| o.contains("north") && o.contains("west"),
        );
        wait_admin(
            &p.admin_url,
            &["--output", "json", "namespaces", "policies", "acme/g"],
            "the namespace",
            |o| o.contains("\"message_ttl_seconds\": 3600"),
        );
    }
    let (code, out, err) = run_admin(&[
        "--admin-url",
        &west.admin_url,
        "namespaces",
        "policies",
        "acme/east-only",
    ])
    .unwrap();
    assert_ne!(code, 0, "a namespace of east alone stays at east: {out}");
    assert!(
        err.contains("NotFound") || err.contains("does not exist"),
        "{err}"
    );

    step("north and west, introduced through east's registry, replicate to each other");
    let t = "persistent://acme/g/introduced";
    produce(&dir, "pn", &north.url, t, 50, 0)
        .finish(Duration::from_secs(60))
        .unwrap();
    let got = read_until(&dir, &west.url, t, 50, Duration::from_secs(60));
    let sent = std::slice::from_ref(&(0..50));
    assert_exactly_once(&got, sent, "west");

    step("a namespace deleted at west is deleted at east and north");
    at(
        west,
        &[
            "namespaces",
            "create",
            "acme/tmp",
            "--clusters",
            "east,west,north",
        ],
    );
    for p in [east, north] {
        wait_admin(
            &p.admin_url,
            &["namespaces", "policies", "acme/tmp"],
            "created",
            |_| true,
        );
    }
    at(west, &["namespaces", "delete", "acme/tmp"]);
    for p in [east, north] {
        wait_until(&format!("acme/tmp is still at {}", p.admin_url), || {
            let args = [
                "--admin-url",
                &p.admin_url,
                "namespaces",
                "policies",
                "acme/tmp",
            ];
            run_admin(&args).unwrap().0 != 0
        });
    }

    step("a topic's own policy set at west reaches east and north; its removal too");
    at(west, &["topics", "set-message-ttl", t, "--ttl", "99"]);
    for p in [east, north] {
        wait_admin(
            &p.admin_url,
            &["--output", "json", "topics", "policies", t],
            "the topic's policy",
            |o| o.contains("\"message_ttl_seconds\": 99"),
        );
    }
    at(east, &["topics", "remove-message-ttl", t]);
    for p in [west, north] {
        wait_admin(
            &p.admin_url,
            &["--output", "json", "topics", "policies", t],
            "the topic's policy removed",
            |o| !o.contains("message_ttl_seconds\": 99"),
        );
    }

    step("north leaves the tenant: refused while acme/g lists it, then taken everywhere");
    let err = admin_refused(
        &east.admin_url,
        &[
            "tenants",
            "update",
            "acme",
            "--allowed-clusters",
            "east,west",
        ],
        "FailedPrecondition",
    );
    assert!(err.contains("acme/g"), "{err}");
    at(
        east,
        &[
            "namespaces",
            "set-clusters",
            "acme/g",
            "--clusters",
            "east,west",
        ],
    );
    for p in [west, north] {
        wait_admin(
            &p.admin_url,
            &["namespaces", "get-clusters", "acme/g"],
            "acme/g without north",
            |o| !o.contains("north"),
        );
    }
    at(
        east,
        &[
            "tenants",
            "update",
            "acme",
            "--allowed-clusters",
            "east,west",
        ],
    );
    for p in [west, north] {
        wait_admin(
            &p.admin_url,
            &["tenants", "get", "acme"],
            "acme without north",
            |o| o.contains("west") && !o.contains("north"),
        );
    }
    for p in &mut procs {
        p.stop().unwrap();
    }
}

#[test]
fn given_a_replication_backlog_quota_then_producers_are_refused_or_the_oldest_are_dropped_and_counted(
) {
    let (root, mut procs, proxies) = mesh_with(&["east", "west"], &[], true);
    let dir = root.path().to_path_buf();
    let (east, west) = (&procs[0], &procs[1]);
    let (held, dropped) = ("persistent://acme/g/held", "persistent://acme/g/dropped");
    let sync_produce = |name: &str, topic: &str, count: u64, start: u64| {
        let (count, start) = (count.to_string(), start.to_string());
        let mut p = meridian_integration::PyClient::run(
            &dir,
            name,
            &[
                "produce", &east.url, topic, "--count", &count, "--start", &start, "--sync",
            ],
        );
        // A producer refused part-way ends with an error: what it had acknowledged counts.
        let _ = p.finish(Duration::from_secs(120));
        p.ints("acked")
    };

    step("a policy that is not one of the replication quota's is refused, naming them");
    let err = admin_refused(
        &east.admin_url,
        &[
            "namespaces",
            "set-replication-backlog-quota",
            "acme/g",
            "--limit-size",
            "2K",
            "--policy",
            "consumer_backlog_eviction",
        ],
        "InvalidArgument",
    );
    assert!(err.contains("drop_oldest"), "{err}");

    step(
        "both topics replicate; then the sites are cut apart and each topic gets a quota of 2 KiB",
    );
    for t in [held, dropped] {
        assert_eq!(sync_produce("warm", t, 10, 0).len(), 10);
        let got = read_until(&dir, &west.url, t, 10, Duration::from_secs(60));
        assert_exactly_once(&got, std::slice::from_ref(&(0..10)), "west");
    }
    for (_, _, p) in &proxies {
        p.partition(true);
    }
    for (t, policy) in [(held, "producer_exception"), (dropped, "drop_oldest")] {
        admin_ok(&[
            "--admin-url",
            &east.admin_url,
            "topics",
            "set-replication-backlog-quota",
            t,
            "--limit-size",
            "2K",
            "--policy",
            policy,
        ]);
        let q = admin_json(
            &east.admin_url,
            &["topics", "get-replication-backlog-quota", t],
        );
        assert_eq!(q["policy"], policy, "{q}");
        assert_eq!(q["limit_size_bytes"], 2048, "{q}");
    }

    step("producer_exception: past the quota a producer is refused at once, and the stats say why");
    let acked_held = sync_produce("held1", held, 200, 1000);
    assert!(!acked_held.is_empty());
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let st = admin_json(&east.admin_url, &["topics", "stats", held]);
        if st["backlog_quota_exceeded"]
            .as_str()
            .is_some_and(|d| d.contains("replication to west"))
        {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{st}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut p = meridian_integration::PyClient::run(
        &dir,
        "held2",
        &["produce", &east.url, held, "--count", "1"],
    );
    let lines = p.finish(Duration::from_secs(60)).unwrap();
    let why = lines
        .iter()
        .find_map(|v| v["create_failed"].as_str())
        .expect("refused");
    assert!(
        why.contains("ProducerBlockedQuotaExceededException"),
        "{why}"
    );

    step("drop_oldest: the oldest unreplicated entries are dropped (counted), producers go on");
    let acked_dropped = sync_produce("dropped1", dropped, 200, 1000);
    assert_eq!(acked_dropped.len(), 200);
    let st = wait_replication(&east.admin_url, dropped, "entries dropped", |st| {
        st["dropped_entries"].as_u64() > Some(0) && st["state"] != "connected"
    });
    eprintln!("geo: drop_oldest under a 2 KiB replication quota: {st}");

    step("healed: what was kept arrives once, the dropped entries never, and producers are let in again");
    for (_, _, p) in &proxies {
        p.partition(false);
    }
    for t in [held, dropped] {
        wait_replication(&east.admin_url, t, "caught up", |st| {
            st["state"] == "connected" && st["backlog_entries"] == 0
        });
    }
    // Every acknowledged send is stored; the one a refusal cut short may be too (its client
    // saw an error): west holds exactly what east holds.
    let n = acked_held.len() as u64;
    let at_east = read_until(
        &dir,
        &east.url,
        held,
        10 + n as usize,
        Duration::from_secs(60),
    );
    let m = at_east.len() as u64 - 10;
    assert!(m == n || m == n + 1, "{n} acknowledged, {m} stored");
    assert_exactly_once(&at_east, &[0..10, 1000..1000 + m], "east (held)");
    let got = read_until(
        &dir,
        &west.url,
        held,
        10 + m as usize,
        Duration::from_secs(60),
    );
    assert_exactly_once(&got, &[0..10, 1000..1000 + m], "west (held)");
    let st = replication_of(&east.admin_url, dropped).remove(0);
    let lost = st["dropped_entries"].as_u64().unwrap();
    assert!((1..200).contains(&lost), "{st}");
    let got = read_until(
        &dir,
        &west.url,
        dropped,
        10 + 200 - lost as usize,
        Duration::from_secs(60),
    );
    assert_exactly_once(&got, &[0..10, 1000 + lost..1200], "west (dropped)");
    let page = meridian_integration::http_get(&east.http, "/metrics");
    assert!(
        meridian_integration::metric_value(
            &page,
            "meridian_replication_dropped_entries_total{remote=\"west\"}"
        ) >= lost as f64,
        "{page}"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !admin_json(&east.admin_url, &["topics", "stats", held])["backlog_quota_exceeded"]
        .is_null()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the quota did not clear"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(sync_produce("held3", held, 1, 5000), vec![5000]);
    for p in &mut procs {
        p.stop().unwrap();
    }
}

/// Whether `topic` is among the topics of acme/g at the site.
fn listed(admin_url: &str, topic: &str) -> bool {
    admin_json(admin_url, &["topics", "list", "acme/g"])
        .as_array()
        .is_some_and(|a| a.iter().any(|t| t["name"] == topic))
}

/// Waits (30 s at most, checking every 200 ms) until `done` holds; fails with `what`.
fn wait_until(what: &str, done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn given_a_global_topic_deleted_while_entries_are_in_flight_then_no_site_re_creates_it() {
    let env = [("MERIDIAN_GEO_TOMBSTONE_GRACE_MS", "3000")];
    let (root, mut procs, proxies) = mesh_with(&["east", "west"], &env, true);
    let dir = root.path().to_path_buf();
    let (east, west) = (&procs[0], &procs[1]);
    let t = "persistent://acme/g/doomed";
    const N: u64 = 200;

    step("both sites produce and replicate; cut apart, both produce more (backlog both ways)");
    let mut pe = produce(&dir, "pe", &east.url, t, N, 0);
    let mut pw = produce(&dir, "pw", &west.url, t, N, 100_000);
    pe.finish(Duration::from_secs(120)).unwrap();
    pw.finish(Duration::from_secs(120)).unwrap();
    for p in [east, west] {
        let got = read_until(&dir, &p.url, t, 2 * N as usize, Duration::from_secs(60));
        assert_exactly_once(&got, &[0..N, 100_000..100_000 + N], "before the cut");
    }
    for (_, _, p) in &proxies {
        p.partition(true);
    }
    let mut pe = produce(&dir, "pe2", &east.url, t, N, 1_000);
    let mut pw = produce(&dir, "pw2", &west.url, t, N, 101_000);
    pe.finish(Duration::from_secs(120)).unwrap();
    pw.finish(Duration::from_secs(120)).unwrap();

    step("deleted at east while cut off: the dry run names west; the topic is gone at east");
    let dry = admin_ok(&[
        "--admin-url",
        &east.admin_url,
        "topics",
        "delete",
        t,
        "--dry-run",
    ]);
    assert!(dry.contains("sites west"), "{dry}");
    assert!(listed(&east.admin_url, t));
    admin_ok(&[
        "--admin-url",
        &east.admin_url,
        "topics",
        "delete",
        t,
        "--force",
    ]);
    assert!(!listed(&east.admin_url, t));
    assert!(
        listed(&west.admin_url, t),
        "west is cut off: it still has it"
    );

    step("healed one way (west dials east, east not west): east refuses west's late entries");
    for (h, o, p) in &proxies {
        if (*h, *o) == (1, 0) {
            p.partition(false);
        }
    }
    let st = wait_replication(&west.admin_url, t, "refused by the tombstone", |st| {
        st["reason"]
            .as_str()
            .is_some_and(|r| r.contains("was deleted at site east"))
    });
    eprintln!("geo: west's replicator after the one-way heal: {st}");
    assert!(!listed(&east.admin_url, t), "east re-created {t}");

    step("healed both ways: west deletes it, neither re-creates it");
    for (_, _, p) in &proxies {
        p.partition(false);
    }
    wait_until("west did not delete the topic", || {
        !listed(&west.admin_url, t)
    });
    // Longer than west's replicator waits after a refusal is not needed: its topic, and so
    // its replicator, is gone; what was in flight had its chance meanwhile.
    std::thread::sleep(Duration::from_secs(2));
    for (site, p) in [("east", east), ("west", west)] {
        assert!(!listed(&p.admin_url, t), "{site} re-created {t}");
    }

    step("after the tombstones' grace the topic may be created again, and it replicates");
    std::thread::sleep(Duration::from_secs(4));
    let mut pw = produce(&dir, "pw3", &west.url, t, 10, 200_000);
    pw.finish(Duration::from_secs(120)).unwrap();
    let got = read_until(&dir, &east.url, t, 10, Duration::from_secs(60));
    assert_exactly_once(
        &got,
        std::slice::from_ref(&(200_000..200_010)),
        "east (again)",
    );
    for p in &mut procs {
        p.stop().unwrap();
    }
}

#[test]
fn given_a_site_removed_from_the_clusters_then_its_data_is_kept_unless_deletion_is_confirmed() {
    let (root, mut procs, _) = mesh_with(&["east", "west"], &[], false);
    let dir = root.path().to_path_buf();
    let (east, west) = (&procs[0], &procs[1]);
    for p in [east, west] {
        admin_ok(&[
            "--admin-url",
            &p.admin_url,
            "namespaces",
            "create",
            "acme/h",
            "--clusters",
            "east,west",
        ]);
    }
    let (kept, gone) = ("persistent://acme/g/kept", "persistent://acme/h/gone");
    for t in [kept, gone] {
        produce(&dir, "p", &east.url, t, 50, 0)
            .finish(Duration::from_secs(120))
            .unwrap();
        let got = read_until(&dir, &west.url, t, 50, Duration::from_secs(60));
        assert_exactly_once(&got, std::slice::from_ref(&(0..50)), "west");
    }
    let at_east = |args: &[&str]| {
        let mut all = vec!["--admin-url", east.admin_url.as_str()];
        all.extend_from_slice(args);
        admin_ok(&all)
    };

    step("--dry-run says what would happen and changes nothing; deleting needs --confirm");
    let dry = at_east(&[
        "namespaces",
        "set-clusters",
        "acme/g",
        "--clusters",
        "east",
        "--dry-run",
    ]);
    assert!(
        dry.contains("replication to west stops; the data at west is kept"),
        "{dry}"
    );
    let dry = at_east(&[
        "namespaces",
        "set-clusters",
        "acme/h",
        "--clusters",
        "east",
        "--delete-remote-data",
        "--dry-run",
    ]);
    assert!(
        dry.contains(&format!("would delete {gone} at site west")),
        "{dry}"
    );
    let clusters = at_east(&["namespaces", "get-clusters", "acme/h"]);
    assert!(clusters.contains("east,west"), "{clusters}");
    let (code, _, err) = run_admin(&[
        "--admin-url",
        &east.admin_url,
        "namespaces",
        "set-clusters",
        "acme/h",
        "--clusters",
        "east",
        "--delete-remote-data",
    ])
    .unwrap();
    assert_eq!(code, 1);
    assert!(err.contains("--confirm"), "{err}");

    step("removed without deletion: replication to west stops, west keeps what it has");
    at_east(&["namespaces", "set-clusters", "acme/g", "--clusters", "east"]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !replication_of(&east.admin_url, kept).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the replicator did not stop"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    produce(&dir, "p2", &east.url, kept, 10, 1000)
        .finish(Duration::from_secs(120))
        .unwrap();

    step("removed with --delete-remote-data --confirm: west's copy is deleted, east's stays");
    let out = at_east(&[
        "namespaces",
        "set-clusters",
        "acme/h",
        "--clusters",
        "east",
        "--delete-remote-data",
        "--confirm",
    ]);
    assert!(
        out.contains(&format!("deleting {gone} at site west")),
        "{out}"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while admin_json(&west.admin_url, &["topics", "list", "acme/h"])
        .as_array()
        .is_some_and(|a| a.iter().any(|t| t["name"] == gone))
    {
        assert!(std::time::Instant::now() < deadline, "west kept {gone}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let got = read_until(&dir, &east.url, gone, 50, Duration::from_secs(60));
    assert_exactly_once(&got, std::slice::from_ref(&(0..50)), "east");
    std::thread::sleep(Duration::from_secs(2));
    let got = read_until(&dir, &west.url, kept, 50, Duration::from_secs(60));
    assert_exactly_once(
        &got,
        std::slice::from_ref(&(0..50)),
        "west (kept, nothing new)",
    );
    for p in &mut procs {
        p.stop().unwrap();
    }
}

#[test]
fn given_three_sites_and_one_cut_off_past_the_grace_then_a_deleted_topic_stays_deleted_everywhere()
{
    let env = [("MERIDIAN_GEO_TOMBSTONE_GRACE_MS", "2000")];
    let (root, mut procs, proxies) = mesh_with(&["east", "west", "north"], &env, true);
    let dir = root.path().to_path_buf();
    let (east, west, north) = (&procs[0], &procs[1], &procs[2]);
    let t = "persistent://acme/g/doomed3";

    step("a topic at all three sites; north cut off, with a backlog of its own");
    produce(&dir, "pe", &east.url, t, 50, 0)
        .finish(Duration::from_secs(120))
        .unwrap();
    for p in [west, north] {
        let got = read_until(&dir, &p.url, t, 50, Duration::from_secs(60));
        assert_exactly_once(&got, std::slice::from_ref(&(0..50)), "before the cut");
    }
    for (h, o, p) in &proxies {
        if *h == 2 || *o == 2 {
            p.partition(true);
        }
    }
    produce(&dir, "pn", &north.url, t, 20, 100_000)
        .finish(Duration::from_secs(120))
        .unwrap();

    step("deleted at east: west deletes it too; north, cut off, cannot be told");
    admin_ok(&[
        "--admin-url",
        &east.admin_url,
        "topics",
        "delete",
        t,
        "--force",
    ]);
    wait_until(&format!("west kept {t}"), || !listed(&west.admin_url, t));

    step("past the grace, north may dial west only: west still refuses north's late entries");
    std::thread::sleep(Duration::from_secs(4));
    for (h, o, p) in &proxies {
        if (*h, *o) == (2, 1) {
            p.partition(false);
        }
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let reps = replication_of(&north.admin_url, t);
        let to_west = reps.iter().find(|r| r["remote"] == "west");
        if to_west.is_some_and(|r| {
            r["reason"]
                .as_str()
                .is_some_and(|x| x.contains("was deleted at site"))
        }) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{reps:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(!listed(&west.admin_url, t), "west re-created {t}");

    step("healed: north deletes it, and no site has it");
    for (_, _, p) in &proxies {
        p.partition(false);
    }
    wait_until(&format!("north kept {t}"), || !listed(&north.admin_url, t));
    std::thread::sleep(Duration::from_secs(1));
    for (site, p) in [("east", east), ("west", west), ("north", north)] {
        assert!(!listed(&p.admin_url, t), "{site} has {t}");
    }
    for p in &mut procs {
        p.stop().unwrap();
    }
}
