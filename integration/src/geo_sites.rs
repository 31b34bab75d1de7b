//! Sites joined by geo links, on loopback, for tests and benchmarks: each a `meridian
//! standalone` with a link, certificates from `meridian-admin geo`, every site knowing the
//! others (optionally through [`UdpProxy`]s the caller controls), tenant `acme` and namespace
//! `acme/g` replicated between all of them.

use std::path::{Path, PathBuf};

use std::time::{Duration, Instant};

use crate::udp_proxy::{Faults, UdpProxy};
use crate::{run_admin, BookieProc, BrokerProc, MetaCluster, PyClient, StandaloneProc};

/// `meridian-admin ARGS`, which must succeed: its output.
pub fn admin_ok(args: &[&str]) -> String {
    let (code, out, err) = run_admin(args).expect("meridian-admin runs");
    assert_eq!(code, 0, "meridian-admin {args:?}: {out}{err}");
    out
}

/// A federation CA in `pki` (`ca.crt`, `ca.key`) and a certificate for each of `sites`
/// (`SITE.crt`, `SITE.key`), made by `meridian-admin geo`.
pub fn federation_pki(pki: &Path, sites: &[&str]) {
    let d = pki.display().to_string();
    admin_ok(&["geo", "create-ca", "--out-dir", &d]);
    for s in sites {
        admin_ok(&[
            "geo",
            "create-site-cert",
            s,
            "--ca-dir",
            &d,
            "--out-dir",
            &d,
        ]);
    }
}

/// The flags of a site's geo link: `--cluster SITE --geo-listen LISTEN --geo-cert ...`, the
/// files in `pki` (`SITE.crt`, `SITE.key`, `ca.crt`).
pub fn geo_flags(site: &str, pki: &Path, listen: &str) -> Vec<String> {
    let p = |f: &str| pki.join(f).display().to_string();
    vec![
        "--cluster".into(),
        site.into(),
        "--geo-listen".into(),
        listen.into(),
        "--geo-cert".into(),
        p(&format!("{site}.crt")),
        "--geo-key".into(),
        p(&format!("{site}.key")),
        "--geo-ca".into(),
        p("ca.crt"),
    ]
}

/// Links between two sites, each through a proxy: `[(from, to, proxy)]`.
pub type Proxies = Vec<(usize, usize, UdpProxy)>;

/// Sites named `names` under a new temporary directory, with `MERIDIAN_*` settings `env`;
/// with `proxied`, each site dials every other through a proxy of its own toward it
/// (`geo.routes`), while the registry, which the sites share, has the real addresses.
pub fn mesh_with(
    names: &[&str],
    env: &[(&str, &str)],
    proxied: bool,
) -> (tempfile::TempDir, Vec<StandaloneProc>, Proxies) {
    let listens: Vec<String> = names
        .iter()
        .map(|_| format!("127.0.0.1:{}", crate::free_udp_port()))
        .collect();
    let mut proxies = Vec::new();
    let mut routes: Vec<Vec<String>> = vec![Vec::new(); names.len()];
    if proxied {
        for (h, routes) in routes.iter_mut().enumerate() {
            for (o, (name, listen)) in names.iter().zip(&listens).enumerate() {
                if o != h {
                    let p = UdpProxy::start(listen.parse().unwrap());
                    routes.push(format!("{name}={}", p.addr));
                    proxies.push((h, o, p));
                }
            }
        }
    }
    let (root, procs) = sites(names, &listens, &routes, env);
    let all = names.join(",");
    for here in &procs {
        // A record may have come over the link from a site made earlier: then it is there.
        let a = |args: &[&str]| {
            let mut all = vec!["--admin-url", here.admin_url.as_str()];
            all.extend_from_slice(args);
            let (code, out, err) = run_admin(&all).expect("meridian-admin runs");
            assert!(
                code == 0 || err.contains("already exists"),
                "meridian-admin {all:?}: {out}{err}"
            );
        };
        for (other, name) in procs.iter().zip(names) {
            if std::ptr::eq(other, here) {
                continue;
            }
            let geo_url = other.geo_url.clone().unwrap();
            a(&[
                "clusters",
                "create",
                name,
                "--broker-url",
                &other.url,
                "--url",
                &other.admin_url,
                "--geo-url",
                &geo_url,
            ]);
        }
        a(&["tenants", "create", "acme", "--allowed-clusters", &all]);
        a(&["namespaces", "create", "acme/g", "--clusters", &all]);
    }
    (root, procs, proxies)
}

/// Sites named `names` with links on `listens` (each dialing through its `routes`, `SITE=ADDR`
/// items), certificates of one federation CA, and no records of each other yet.
pub fn sites(
    names: &[&str],
    listens: &[String],
    routes: &[Vec<String>],
    env: &[(&str, &str)],
) -> (tempfile::TempDir, Vec<StandaloneProc>) {
    let root = tempfile::tempdir().unwrap();
    let pki = root.path().join("pki");
    let d = pki.display().to_string();
    admin_ok(&["geo", "create-ca", "--out-dir", &d]);
    let mut procs = Vec::new();
    for (i, site) in names.iter().enumerate() {
        admin_ok(&[
            "geo",
            "create-site-cert",
            site,
            "--ca-dir",
            &d,
            "--out-dir",
            &d,
        ]);
        let dir = root.path().join(site);
        std::fs::create_dir_all(&dir).unwrap();
        let mut s = StandaloneProc::new(&dir);
        let listen = &listens[i];
        s.keep_ports()
            .args(
                &geo_flags(site, &pki, listen)
                    .iter()
                    .map(String::as_str)
                    .collect::<Vec<_>>(),
            )
            .env("MERIDIAN_BROKER_POLICY_REFRESH_INTERVAL_MS", "200")
            .env("MERIDIAN_GEO_ROUTES", &routes[i].join(","));
        for (k, v) in env {
            s.env(k, v);
        }
        s.start().unwrap();
        procs.push(s);
    }
    (root, procs)
}

/// Sites named `names` that know nothing of each other (the caller introduces them).
pub fn unlinked(names: &[&str]) -> (tempfile::TempDir, Vec<StandaloneProc>) {
    let listens: Vec<String> = names
        .iter()
        .map(|_| format!("127.0.0.1:{}", crate::free_udp_port()))
        .collect();
    sites(names, &listens, &vec![Vec::new(); names.len()], &[])
}

/// `meridian-admin --admin-url SITE ARGS`, which must succeed: its output.
pub fn admin_at(site: &StandaloneProc, args: &[&str]) -> String {
    let mut all = vec!["--admin-url", site.admin_url.as_str()];
    all.extend_from_slice(args);
    admin_ok(&all)
}

/// Reads `topic` at `url` with the stock client until it holds `want` messages (2 minutes
/// at most).
pub fn wait_messages(dir: &Path, url: &str, topic: &str, want: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let n = read_all(dir, url, topic).len();
        if n >= want {
            return;
        }
        assert!(Instant::now() < deadline, "{url}: {n} of {want} messages");
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Every message of `topic` at `url` (a stock-client reader from the earliest): the `i` of
/// each, in log order.
pub fn read_all(dir: &Path, url: &str, topic: &str) -> Vec<u64> {
    let mut r = PyClient::run(dir, "reader", &["read", url, topic]);
    r.finish(Duration::from_secs(120))
        .map(|_| r.ints("i"))
        .unwrap_or_default()
}

/// A batched stock-client producer of `count` messages numbered from `start`: every one
/// acknowledged.
pub fn produce_acked(dir: &Path, url: &str, topic: &str, count: u64, start: u64) {
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

/// Delays every datagram of site `from`'s link toward site `to` by `delay_ms` (each way),
/// through the proxy [`mesh_with`] put there.
pub fn slow_link(proxies: &Proxies, from: usize, to: usize, delay_ms: u64) {
    let (_, _, p) = proxies
        .iter()
        .find(|(f, t, _)| *f == from && *t == to)
        .expect("a proxy between the two sites");
    p.set(Faults {
        delay_ms,
        ..Faults::default()
    });
}

/// Runs `meridian-admin --admin-url URL ARGS` until it succeeds with an output `ok` accepts
/// (30 s at most); that output.
pub fn wait_admin(url: &str, args: &[&str], what: &str, ok: impl Fn(&str) -> bool) -> String {
    let mut all = vec!["--admin-url", url];
    all.extend_from_slice(args);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (code, out, err) = run_admin(&all).unwrap();
        if code == 0 && ok(&out) {
            return out;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: meridian-admin {args:?}: {out}{err}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Site east, a standalone, and site west of two brokers (`a`, `b`, each with a geo link)
/// over one metadata node and one bookie; east dials west's links through `proxies` (a's,
/// b's); the sites know each other, tenant `acme` and namespace `acme/g` replicated between
/// them.
pub struct TwoBrokerWest {
    pub cluster: MetaCluster,
    pub root: PathBuf,
    /// The metadata endpoints (for more brokers at west).
    pub endpoints: String,
    pub east: StandaloneProc,
    pub bookie: BookieProc,
    pub brokers: Vec<BrokerProc>,
    pub proxies: Vec<UdpProxy>,
}

impl TwoBrokerWest {
    /// West's service URL naming both brokers.
    pub fn west_service(&self) -> String {
        format!(
            "pulsar://{},{}",
            crate::host(&self.brokers[0].url),
            crate::host(&self.brokers[1].url)
        )
    }
}

/// Starts [`TwoBrokerWest`], west's brokers with `MERIDIAN_*` settings `west_env` (east's
/// policy beat every 200 ms).
pub async fn east_and_west_of_two_brokers(west_env: &[(&str, &str)]) -> TwoBrokerWest {
    let cluster = MetaCluster::start(1).await.expect("metadata node");
    let root = cluster.root.path().to_path_buf();
    let pki = root.join("pki");
    federation_pki(&pki, &["east", "west"]);
    let file = |f: &str| pki.join(f).display().to_string();
    crate::step(
        "east: a standalone; west: one metadata node, a bookie, brokers a and b, each with a link",
    );
    crate::step(
        "east dials west's record (a's link) and b's link each through a proxy (geo.routes)",
    );
    let west_listens: Vec<String> = (0..2)
        .map(|_| format!("127.0.0.1:{}", crate::free_udp_port()))
        .collect();
    let proxies: Vec<UdpProxy> = west_listens
        .iter()
        .map(|l| UdpProxy::start(l.parse().unwrap()))
        .collect();
    let east_dir = root.join("east");
    std::fs::create_dir_all(&east_dir).unwrap();
    let mut east = StandaloneProc::new(&east_dir);
    let east_listen = format!("127.0.0.1:{}", crate::free_udp_port());
    east.args(
        &geo_flags("east", &pki, &east_listen)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    )
    .env(
        "MERIDIAN_GEO_ROUTES",
        &format!(
            "west={},{}={}",
            proxies[0].addr, west_listens[1], proxies[1].addr
        ),
    );
    east.env("MERIDIAN_BROKER_POLICY_REFRESH_INTERVAL_MS", "200");
    east.start().unwrap();
    let endpoints = cluster.endpoints().join(",");
    let mut bookie = BookieProc::new("bookie", &root, &endpoints);
    bookie.start().unwrap();
    crate::wait_for_bookies(&cluster.client(), 1, Duration::from_secs(30))
        .await
        .unwrap();
    let mut brokers = Vec::new();
    let mut geo_urls = Vec::new();
    for (n, listen) in ["a", "b"].into_iter().zip(&west_listens) {
        let mut b = BrokerProc::new(n, &root, &endpoints);
        b.env("MERIDIAN_BROKER_CLUSTER_NAME", "west")
            .env("MERIDIAN_BROKER_ENSEMBLE", "1")
            .env("MERIDIAN_BROKER_WRITE_QUORUM", "1")
            .env("MERIDIAN_BROKER_ACK_QUORUM", "1")
            .env("MERIDIAN_GEO_LISTEN", listen)
            .env("MERIDIAN_GEO_CERT_FILE", &file("west.crt"))
            .env("MERIDIAN_GEO_KEY_FILE", &file("west.key"))
            .env("MERIDIAN_GEO_CA_FILE", &file("ca.crt"));
        for (k, v) in west_env {
            b.env(k, v);
        }
        b.start().unwrap();
        geo_urls.push(format!("quic://{listen}"));
        brokers.push(b);
    }
    crate::step(
        "the sites introduced (east knows west at broker a's link); acme/g made at east alone",
    );
    let at = |url: &str, args: &[&str]| {
        let mut all = vec!["--admin-url", url];
        all.extend_from_slice(args);
        admin_ok(&all)
    };
    let east_geo = east.geo_url.clone().unwrap();
    at(
        &east.admin_url,
        &[
            "clusters",
            "create",
            "west",
            "--broker-url",
            &brokers[0].url,
            "--url",
            &brokers[0].admin_url,
            "--geo-url",
            &geo_urls[0],
        ],
    );
    at(
        &brokers[0].admin_url,
        &[
            "clusters",
            "create",
            "east",
            "--broker-url",
            &east.url,
            "--url",
            &east.admin_url,
            "--geo-url",
            &east_geo,
        ],
    );
    at(
        &east.admin_url,
        &[
            "tenants",
            "create",
            "acme",
            "--allowed-clusters",
            "east,west",
        ],
    );
    at(
        &east.admin_url,
        &["namespaces", "create", "acme/g", "--clusters", "east,west"],
    );
    for b in &brokers {
        wait_admin(
            &b.admin_url,
            &["namespaces", "policies", "acme/g"],
            "acme/g at west",
            |_| true,
        );
    }
    TwoBrokerWest {
        cluster,
        root,
        endpoints,
        east,
        bookie,
        brokers,
        proxies,
    }
}
