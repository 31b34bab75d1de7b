//! Sites joined by geo links, on loopback, for tests and benchmarks: each a `meridian
//! standalone` with a link, certificates from `meridian-admin geo`, every site knowing the
//! others (optionally through [`UdpProxy`]s the caller controls), tenant `acme` and namespace
//! `acme/g` replicated between all of them.

use std::path::Path;

use crate::udp_proxy::UdpProxy;
use crate::{run_admin, StandaloneProc};

/// `meridian-admin ARGS`, which must succeed: its output.
pub fn admin_ok(args: &[&str]) -> String {
    let (code, out, err) = run_admin(args).expect("meridian-admin runs");
    assert_eq!(code, 0, "meridian-admin {args:?}: {out}{err}");
    out
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
/// with `proxied`, each site's record of every other points at a proxy toward it.
pub fn mesh_with(
    names: &[&str],
    env: &[(&str, &str)],
    proxied: bool,
) -> (tempfile::TempDir, Vec<StandaloneProc>, Proxies) {
    let root = tempfile::tempdir().unwrap();
    let pki = root.path().join("pki");
    let d = pki.display().to_string();
    admin_ok(&["geo", "create-ca", "--out-dir", &d]);
    let mut procs = Vec::new();
    for site in names {
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
        let listen = format!("127.0.0.1:{}", crate::free_port());
        s.keep_ports()
            .args(
                &geo_flags(site, &pki, &listen)
                    .iter()
                    .map(String::as_str)
                    .collect::<Vec<_>>(),
            )
            .env("MERIDIAN_BROKER_POLICY_REFRESH_INTERVAL_MS", "200");
        for (k, v) in env {
            s.env(k, v);
        }
        s.start().unwrap();
        procs.push(s);
    }
    let all = names.join(",");
    let mut proxies = Vec::new();
    for (h, here) in procs.iter().enumerate() {
        let a = |args: &[&str]| {
            let mut all = vec!["--admin-url", here.admin_url.as_str()];
            all.extend_from_slice(args);
            admin_ok(&all)
        };
        for (o, (other, name)) in procs.iter().zip(names).enumerate() {
            if o == h {
                continue;
            }
            let real = other.geo_url.clone().unwrap();
            let geo_url = if proxied {
                let upstream = real.trim_start_matches("quic://").parse().unwrap();
                let p = UdpProxy::start(upstream);
                let url = format!("quic://{}", p.addr);
                proxies.push((h, o, p));
                url
            } else {
                real
            };
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
