//! `meridian perf geo --link-only`: the geo link alone, in this process. Two endpoints on
//! loopback with mutual TLS (a federation CA and two site certificates made for the run);
//! each stream is a replicator (`meridian_geo::replicator::run`, as brokers run it) over a
//! source of synthetic entries, received by a sink that acknowledges each frame at once (no
//! storage, no broker). Prints MiB/s and entries/s for each stream count, with UDP
//! segmentation offload (GSO) on and off, and the process's peak resident memory: what the
//! link itself costs, apart from the sites. Replication between running sites is measured
//! with `meridian perf e2e --url A --consume-url B`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use futures::future::BoxFuture;
use meridian_config::GeoConfig;
use meridian_geo::frame::{OriginPosition, ReplicatedEntry};
use meridian_geo::receiver::{Durable, Refusal, ReplicaSink, ReplicaTopic};
use meridian_geo::replicator::{ReplicaSource, ReplicatorOptions, ReplicatorStatus, SourceEntry};
use meridian_geo::{GeoLink, SiteDirectory};

#[derive(clap::Args)]
pub struct GeoPerfArgs {
    /// Measure the link alone (required: replication between sites is `perf e2e
    /// --consume-url`).
    #[arg(long)]
    link_only: bool,
    /// Streams (topics) at once, comma-separated for several runs.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 100])]
    streams: Vec<usize>,
    /// Bytes of each entry.
    #[arg(long, default_value_t = 1024)]
    entry_bytes: usize,
    /// Seconds measured per run (after 1 s of warm-up).
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// UDP segmentation offload: on, off or both (a run each).
    #[arg(long, default_value = "both")]
    gso: String,
}

/// Knows the two sites; the peer is where `addr` says.
struct Pair {
    addr: Mutex<String>,
}

impl SiteDirectory for Pair {
    fn knows<'a>(&'a self, site: &'a str) -> BoxFuture<'a, Result<bool, String>> {
        Box::pin(async move { Ok(site == "perf-a" || site == "perf-b") })
    }

    fn locate<'a>(&'a self, _site: &'a str) -> BoxFuture<'a, Result<Option<String>, String>> {
        Box::pin(async move {
            Ok(Some(format!(
                "quic://{}",
                self.addr.lock().expect("addr lock")
            )))
        })
    }
}

/// Counts what arrives and acknowledges it at once.
#[derive(Default)]
struct Counting {
    bytes: AtomicU64,
    entries: AtomicU64,
}

struct CountingTopic(Arc<Counting>);

impl ReplicaTopic for CountingTopic {
    fn submit(&self, entries: Vec<ReplicatedEntry>) -> BoxFuture<'_, Result<Durable, Refusal>> {
        Box::pin(async move {
            let bytes: usize = entries.iter().map(|e| e.bytes.len()).sum();
            self.0.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
            self.0
                .entries
                .fetch_add(entries.len() as u64, Ordering::Relaxed);
            let last = entries.last().map(|e| e.at);
            let done: Durable = Box::pin(async move { Ok(last) });
            Ok(done)
        })
    }
}

/// The sink the link holds: each stream gets a topic counting into the shared figures.
struct Sink(Arc<Counting>);

impl ReplicaSink for Sink {
    fn open<'a>(
        &'a self,
        _origin: &'a str,
        _topic: &'a str,
        _partitions: u32,
    ) -> BoxFuture<'a, Result<(Box<dyn ReplicaTopic>, Option<OriginPosition>), Refusal>> {
        let t: Box<dyn ReplicaTopic> = Box::new(CountingTopic(Arc::clone(&self.0)));
        Box::pin(async move { Ok((t, None)) })
    }
}

/// Entries made up as fast as they are asked for.
struct Synthetic {
    next: u64,
    payload: Bytes,
}

impl ReplicaSource for Synthetic {
    fn rewind(&mut self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }

    fn available(&mut self, max: usize) -> BoxFuture<'_, Result<Vec<SourceEntry>, String>> {
        Box::pin(async move {
            let out = (0..max)
                .map(|i| SourceEntry {
                    at: OriginPosition {
                        ledger: 1,
                        entry: self.next + i as u64,
                    },
                    bytes: self.payload.clone(),
                    send: true,
                })
                .collect();
            self.next += max as u64;
            Ok(out)
        })
    }

    fn wait_for_more(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(futures::future::pending())
    }

    fn done(&mut self, _pos: OriginPosition) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
}

/// The process's peak resident memory, MiB (`VmHWM`), if the system says.
fn peak_rss_mib() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = s
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

pub async fn run(a: GeoPerfArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.link_only,
        "perf geo measures the link alone (--link-only); replication between running sites: meridian perf e2e --url pulsar://A --consume-url pulsar://B"
    );
    let gso: Vec<bool> = match a.gso.as_str() {
        "on" => vec![true],
        "off" => vec![false],
        "both" => vec![true, false],
        other => anyhow::bail!("--gso {other:?}: on, off or both"),
    };
    anyhow::ensure!(
        (1..=10_000).contains(&a.entry_bytes),
        "--entry-bytes: 1 to 10000"
    );
    let dir = std::env::temp_dir().join(format!("meridian-perf-geo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let r = runs(&a, &gso, &dir).await;
    let _ = std::fs::remove_dir_all(&dir);
    r
}

async fn runs(a: &GeoPerfArgs, gso: &[bool], dir: &std::path::Path) -> anyhow::Result<()> {
    use meridian_tenancy::geo_pki;
    let ca = geo_pki::create_ca(1).map_err(anyhow::Error::msg)?;
    std::fs::write(dir.join("ca.crt"), &ca.cert_pem)?;
    let opts = meridian_tenancy::site_tls::CertOptions {
        days: 1,
        ..Default::default()
    };
    for site in ["perf-a", "perf-b"] {
        let c = geo_pki::create_site_cert(&ca.cert_pem, &ca.key_pem, site, &opts)
            .map_err(anyhow::Error::msg)?;
        std::fs::write(dir.join(format!("{site}.crt")), &c.cert_pem)?;
        std::fs::write(dir.join(format!("{site}.key")), &c.key_pem)?;
    }
    println!(
        "perf geo --link-only: two endpoints on loopback, mutual TLS, {}-byte entries, frames up to {} MiB, {} frames in flight per stream",
        a.entry_bytes,
        ReplicatorOptions::default().frame_bytes >> 20,
        ReplicatorOptions::default().window_frames
    );
    for &on in gso {
        for &n in &a.streams {
            let (mib, eps) = measure(a, dir, on, n).await?;
            println!(
                "summary geo link: gso {}, {n} streams: {mib:.1} MiB/s, {eps:.0} entries/s",
                if on { "on" } else { "off" }
            );
        }
    }
    if let Some(m) = peak_rss_mib() {
        println!("summary geo link: peak resident memory of the process {m:.0} MiB");
    }
    Ok(())
}

async fn measure(
    a: &GeoPerfArgs,
    dir: &std::path::Path,
    gso: bool,
    streams: usize,
) -> anyhow::Result<(f64, f64)> {
    let cfg = |site: &str| GeoConfig {
        listen: "127.0.0.1:0".into(),
        cert_file: dir.join(format!("{site}.crt")).display().to_string(),
        key_file: dir.join(format!("{site}.key")).display().to_string(),
        ca_file: dir.join("ca.crt").display().to_string(),
        segmentation_offload: gso,
        ..GeoConfig::default()
    };
    let counts = Arc::new(Counting::default());
    let dir_b = Arc::new(Pair {
        addr: Mutex::new(String::new()),
    });
    let b = GeoLink::start(
        &cfg("perf-b"),
        "perf-b",
        dir_b,
        Some(Arc::new(Sink(Arc::clone(&counts)))),
    )
    .await
    .context("starting the receiving endpoint")?;
    let dir_a = Arc::new(Pair {
        addr: Mutex::new(b.local_addr().to_string()),
    });
    let link_a = Arc::new(
        GeoLink::start(&cfg("perf-a"), "perf-a", dir_a, None)
            .await
            .context("starting the sending endpoint")?,
    );
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let payload = Bytes::from(vec![0x5a; a.entry_bytes]);
    let mut tasks = Vec::new();
    for i in 0..streams {
        let link = Arc::clone(&link_a);
        let stop = stop.clone();
        let payload = payload.clone();
        tasks.push(tokio::spawn(async move {
            let mut source = Synthetic { next: 0, payload };
            meridian_geo::replicator::run(
                link,
                "perf-b".into(),
                format!("persistent://perf/geo/t{i}"),
                0,
                &mut source,
                Arc::new(Mutex::new(ReplicatorStatus::default())),
                ReplicatorOptions::default(),
                stop,
            )
            .await;
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (b0, e0) = (
        counts.bytes.load(Ordering::Relaxed),
        counts.entries.load(Ordering::Relaxed),
    );
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs(a.seconds)).await;
    let secs = start.elapsed().as_secs_f64();
    let (b1, e1) = (
        counts.bytes.load(Ordering::Relaxed),
        counts.entries.load(Ordering::Relaxed),
    );
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = t.await;
    }
    Ok((
        (b1 - b0) as f64 / 1_048_576.0 / secs,
        (e1 - e0) as f64 / secs,
    ))
}
