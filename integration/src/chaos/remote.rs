//! The second site of a two-site run: site `west`, a `meridian standalone` with a geo link,
//! to which the main site (`east`) replicates namespace `chaos/geo`, and the link between
//! them: east's brokers dial west through a [`UdpProxy`] the schedule partitions or makes
//! lossy. West's own links to east (global objects, subscription state) go direct: the faults
//! are on the replication path.

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::geo_sites::{admin_ok, federation_pki, geo_flags, wait_admin};
use crate::udp_proxy::{Faults, UdpProxy};
use crate::{free_udp_port, StandaloneProc};

/// The replicated namespace.
pub const NAMESPACE: &str = "chaos/geo";

pub struct Remote {
    pub west: StandaloneProc,
    /// East's way to west's link.
    pub proxy: UdpProxy,
    pki: PathBuf,
}

impl Remote {
    /// The federation's certificates in `root/pki`, and site west started under `root/west`
    /// (blocking: run it off the runtime's workers).
    pub fn start(root: &Path) -> anyhow::Result<Remote> {
        let pki = root.join("pki");
        federation_pki(&pki, &["east", "west"]);
        let dir = root.join("west");
        std::fs::create_dir_all(&dir)?;
        let listen = format!("127.0.0.1:{}", free_udp_port());
        let mut west = StandaloneProc::new(&dir);
        west.keep_ports().args(
            &geo_flags("west", &pki, &listen)
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
        );
        west.start().context("starting site west")?;
        let proxy = UdpProxy::start(listen.parse()?);
        Ok(Remote { west, proxy, pki })
    }

    /// The `MERIDIAN_*` settings that make a broker of site east, dialing west through the
    /// proxy, its link on `listen`.
    pub fn east_broker_env(&self, listen: &str) -> Vec<(&'static str, String)> {
        let file = |f: &str| self.pki.join(f).display().to_string();
        vec![
            ("MERIDIAN_BROKER_CLUSTER_NAME", "east".into()),
            ("MERIDIAN_GEO_LISTEN", listen.into()),
            ("MERIDIAN_GEO_CERT_FILE", file("east.crt")),
            ("MERIDIAN_GEO_KEY_FILE", file("east.key")),
            ("MERIDIAN_GEO_CA_FILE", file("ca.crt")),
            ("MERIDIAN_GEO_ROUTES", format!("west={}", self.proxy.addr)),
        ]
    }

    /// Makes the sites known to each other and the replicated namespace (deduplication on),
    /// through east's admin API at `east_admin` (east's broker `east_url`, link `east_geo`),
    /// and waits until west has it (blocking).
    pub fn link(&self, east_admin: &str, east_url: &str, east_geo: &str) {
        let at = |url: &str, args: &[&str]| {
            let mut all = vec!["--admin-url", url];
            all.extend_from_slice(args);
            admin_ok(&all);
        };
        let west_geo = self.west.geo_url.clone().expect("west's link");
        at(
            east_admin,
            &[
                "clusters",
                "create",
                "west",
                "--broker-url",
                &self.west.url,
                "--url",
                &self.west.admin_url,
                "--geo-url",
                &west_geo,
            ],
        );
        at(
            &self.west.admin_url,
            &[
                "clusters",
                "create",
                "east",
                "--broker-url",
                east_url,
                "--url",
                east_admin,
                "--geo-url",
                &format!("quic://{east_geo}"),
            ],
        );
        at(
            east_admin,
            &[
                "tenants",
                "create",
                "chaos",
                "--allowed-clusters",
                "east,west",
            ],
        );
        at(
            east_admin,
            &["namespaces", "create", NAMESPACE, "--clusters", "east,west"],
        );
        at(
            east_admin,
            &["namespaces", "set-deduplication", NAMESPACE, "--enable"],
        );
        wait_admin(
            &self.west.admin_url,
            &["namespaces", "policies", NAMESPACE],
            "the replicated namespace at west",
            |_| true,
        );
    }

    /// Cuts the link east dials (`partition`) or makes it drop, duplicate and delay datagrams.
    pub fn disturb(&self, partition: bool) {
        self.proxy.set(if partition {
            Faults {
                partitioned: true,
                ..Faults::default()
            }
        } else {
            Faults {
                drop_percent: 20,
                duplicate_percent: 5,
                delay_ms: 20,
                jitter_ms: 30,
                ..Faults::default()
            }
        });
    }

    pub fn heal_link(&self) {
        self.proxy.set(Faults::default());
    }
}
