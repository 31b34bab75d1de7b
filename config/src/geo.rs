//! `[geo]`: the link between sites (QUIC with mutual TLS by the federation's CA).

use serde::{Deserialize, Serialize};

use crate::{host_port, invalid, ranges, socket_addr, ConfigError};

/// `[geo]` section, read by brokers and standalone. `listen` empty (the default) = this site
/// takes no part in geo-replication. With it, `cert_file`, `key_file` and `ca_file` are
/// required: the site's certificate (naming it `meridian://site/<broker.cluster_name>`), its
/// key, and the federation's CA (`meridian-admin geo create-ca | create-site-cert`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GeoConfig {
    /// UDP address of the link, `IP:PORT`. Default empty (off).
    pub listen: String,
    /// `HOST:PORT` other sites dial (the cluster record's geo URL). Default empty: the bound
    /// address.
    pub advertise: String,
    /// The site's certificate chain, PEM.
    pub cert_file: String,
    /// Its private key, PEM.
    pub key_file: String,
    /// The federation's CA certificate, PEM: the only root a peer site is checked against.
    pub ca_file: String,
    /// Largest frame a link stream accepts, bytes; a larger one closes that stream. Range
    /// 65,536..=268,435,456, default 16,777,216.
    pub frame_bytes_max: u64,
    /// Bytes of a peer's replicated entries one link may hold at this site: read from its
    /// streams and not yet durable, all its streams together (one stream at most an eighth;
    /// streams' first frames have another eighth beside it). A stream whose next frame does
    /// not fit waits, and its peer with it (QUIC's flow control). Range 8 ×
    /// `geo.frame_bytes_max`..=68,719,476,736, default 268,435,456.
    pub receive_bytes_max: u64,
    /// A replicator with backlog and no progress for this long is STALLED and rebuilds its
    /// stream and connection. Range 1,000..=3,600,000, default 30,000.
    pub stall_after_ms: u64,
    /// How often the certificate, key and CA files are checked for changes (a change is
    /// loaded without a restart; links up keep going). Range 100..=3,600,000, default 10,000.
    pub cert_reload_interval_ms: u64,
    /// A link that hears nothing for this long is closed (keep-alives go at a third of it), and
    /// its replicators dial again. Range 1,000..=600,000, default 5,000.
    pub idle_timeout_ms: u64,
    /// Longest a TLS handshake and the link's hello may take. Range 100..=60,000, default
    /// 10,000.
    pub handshake_timeout_ms: u64,
    /// How long a deleted global topic's tombstone keeps refusing replicated entries for it
    /// after every site confirmed the deletion (until then it always does); after it, the
    /// topic may be created again. Range 1,000..=604,800,000, default 60,000.
    pub tombstone_grace_ms: u64,
    /// How often a topic's replicated subscriptions are looked at: a changed acknowledgement
    /// state is sent to the other sites at most this long after the change. Range
    /// 10..=60,000, default 50.
    pub subscription_sync_interval_ms: u64,
    /// UDP segmentation offload (GSO) for the link's datagrams, where the kernel has it.
    /// Default true.
    pub segmentation_offload: bool,
    /// Where this site dials a peer instead of the geo URL of its cluster record, as
    /// `SITE=HOST:PORT` items (a private interconnect, a proxy), and instead of one broker's
    /// geo URL (a site of many brokers sends a topic's stream to its owner) as
    /// `HOST:PORT=HOST:PORT` items, the first being that broker's advertised geo address;
    /// the registry, which every site shares, stays as it is. Default empty.
    pub routes: Vec<String>,
}

impl Default for GeoConfig {
    fn default() -> Self {
        GeoConfig {
            listen: String::new(),
            advertise: String::new(),
            cert_file: String::new(),
            key_file: String::new(),
            ca_file: String::new(),
            frame_bytes_max: 16 << 20,
            receive_bytes_max: 256 << 20,
            stall_after_ms: 30_000,
            cert_reload_interval_ms: 10_000,
            idle_timeout_ms: 5_000,
            handshake_timeout_ms: 10_000,
            tombstone_grace_ms: 60_000,
            subscription_sync_interval_ms: 50,
            segmentation_offload: true,
            routes: Vec::new(),
        }
    }
}

impl GeoConfig {
    /// Whether this site runs the link.
    pub fn enabled(&self) -> bool {
        !self.listen.trim().is_empty()
    }

    /// `geo.routes` as (what is dialed, `HOST:PORT`) pairs, each checked: a site's name, or
    /// a broker's geo URL (`quic://HOST:PORT`, written `HOST:PORT`; a site's name on the link
    /// has no `:`).
    pub fn route_map(&self) -> Result<Vec<(String, String)>, ConfigError> {
        self.routes
            .iter()
            .map(|r| {
                let bad = |why: &str| invalid("geo.routes", r, why);
                let (from, addr) = r
                    .split_once('=')
                    .ok_or_else(|| bad("each route is SITE=HOST:PORT or HOST:PORT=HOST:PORT"))?;
                let from = from.trim();
                if from.is_empty() {
                    return Err(bad("each route is SITE=HOST:PORT; the site is empty"));
                }
                host_port(addr.trim()).map_err(|reason| invalid("geo.routes", r, reason))?;
                let url = from.strip_prefix("quic://");
                let from = match url.unwrap_or(from) {
                    broker if broker.contains(':') || url.is_some() => {
                        host_port(broker).map_err(|reason| {
                            invalid("geo.routes", r, &format!("the broker's address: {reason}"))
                        })?;
                        format!("quic://{broker}")
                    }
                    site => site.to_string(),
                };
                Ok((from, addr.trim().to_string()))
            })
            .collect()
    }

    /// Checks the `[geo]` section.
    pub fn validate(&self) -> Result<(), ConfigError> {
        ranges(&[
            (
                "geo.frame_bytes_max",
                self.frame_bytes_max,
                65_536,
                268_435_456,
                "",
            ),
            (
                "geo.receive_bytes_max",
                self.receive_bytes_max,
                self.frame_bytes_max.saturating_mul(8),
                68_719_476_736,
                " (at least 8 × geo.frame_bytes_max: a stream's share, an eighth, holds a frame)",
            ),
            (
                "geo.stall_after_ms",
                self.stall_after_ms,
                1_000,
                3_600_000,
                "",
            ),
            (
                "geo.cert_reload_interval_ms",
                self.cert_reload_interval_ms,
                100,
                3_600_000,
                "",
            ),
            (
                "geo.idle_timeout_ms",
                self.idle_timeout_ms,
                1_000,
                600_000,
                "",
            ),
            (
                "geo.handshake_timeout_ms",
                self.handshake_timeout_ms,
                100,
                60_000,
                "",
            ),
            (
                "geo.tombstone_grace_ms",
                self.tombstone_grace_ms,
                1_000,
                604_800_000,
                "",
            ),
            (
                "geo.subscription_sync_interval_ms",
                self.subscription_sync_interval_ms,
                10,
                60_000,
                "",
            ),
        ])?;
        self.route_map()?;
        if !self.advertise.is_empty() {
            host_port(&self.advertise)
                .map_err(|reason| invalid("geo.advertise", &self.advertise, reason))?;
        }
        if !self.enabled() {
            return Ok(());
        }
        socket_addr("geo.listen", &self.listen)?;
        for (key, value) in [
            ("geo.cert_file", &self.cert_file),
            ("geo.key_file", &self.key_file),
            ("geo.ca_file", &self.ca_file),
        ] {
            if value.trim().is_empty() {
                return Err(invalid(
                    key,
                    value,
                    "geo.listen needs the site's certificate, its key and the federation CA (geo.cert_file, geo.key_file, geo.ca_file; `meridian-admin geo create-site-cert`)",
                ));
            }
        }
        Ok(())
    }
}
