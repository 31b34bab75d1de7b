//! `meridian bookie`, `meridian ledger ...` and `meridian perf ledger`.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use meridian_config::Config;
use meridian_metadata::MetadataClient;
use meridian_storage::bookie::{self, BookieOptions};
use meridian_storage::ledger::{LedgerClient, LedgerClientOptions};

#[derive(clap::Args)]
pub struct BookieArgs {
    /// Metadata store endpoints, `HOST:PORT,...` (client.endpoints).
    #[arg(long)]
    metadata: Option<String>,
    /// Address to serve the bookie protocol on (bookie.listen).
    #[arg(long)]
    listen: Option<String>,
    /// Address writers and readers use, the bookie's identity (bookie.advertise).
    #[arg(long)]
    advertise: Option<String>,
    /// Journal directory (bookie.journal_dir).
    #[arg(long)]
    journal_dir: Option<String>,
    /// Entry log and index directory (bookie.ledger_dir).
    #[arg(long)]
    ledger_dir: Option<String>,
    /// The bookie's rack, /NAME (bookie.rack); ensembles spread over racks.
    #[arg(long)]
    rack: Option<String>,
    /// The bookie affinity group it belongs to (bookie.group).
    #[arg(long)]
    group: Option<String>,
    /// Address of /metrics and /health (bookie.http_listen; not served unless set).
    #[arg(long)]
    http_listen: Option<String>,
}

impl BookieArgs {
    pub fn overrides(&self) -> Vec<(String, String)> {
        let mut o = Vec::new();
        let mut add = |k: &str, v: &Option<String>| {
            if let Some(v) = v {
                o.push((k.to_string(), v.clone()));
            }
        };
        add("client.endpoints", &self.metadata);
        add("bookie.listen", &self.listen);
        add("bookie.advertise", &self.advertise);
        add("bookie.journal_dir", &self.journal_dir);
        add("bookie.ledger_dir", &self.ledger_dir);
        add("bookie.rack", &self.rack);
        add("bookie.group", &self.group);
        add("bookie.http_listen", &self.http_listen);
        o
    }
}

#[derive(clap::Args)]
pub struct AutorecoveryArgs {
    /// Metadata store endpoints, `HOST:PORT,...` (client.endpoints).
    #[arg(long)]
    metadata: Option<String>,
    /// A bookie unregistered this long is lost, milliseconds (bookie.lost_grace_ms).
    #[arg(long)]
    lost_grace_ms: Option<String>,
}

impl AutorecoveryArgs {
    pub fn overrides(&self) -> Vec<(String, String)> {
        let mut o = Vec::new();
        if let Some(v) = &self.metadata {
            o.push(("client.endpoints".to_string(), v.clone()));
        }
        if let Some(v) = &self.lost_grace_ms {
            o.push(("bookie.lost_grace_ms".to_string(), v.clone()));
        }
        o
    }
}

/// `meridian autorecovery`: the auditor election and a replication worker, alone. With
/// `[tls]` it presents a broker's certificate (it writes to bookies and ledger metadata as
/// brokers do).
pub async fn run_autorecovery(cfg: Config) -> anyhow::Result<()> {
    let tls = crate::tls_of(&cfg, Some(meridian_metadata::tls::ProcessRole::Broker))?;
    let meta = MetadataClient::with_tls(&cfg.client, tls.clone()).context("client.endpoints")?;
    let client = LedgerClient::new(
        meta,
        LedgerClientOptions {
            tls,
            ..LedgerClientOptions::default()
        },
    );
    let id = format!("autorecovery {}", std::process::id());
    println!(
        "meridian autorecovery: metadata {}, lost after {} ms",
        cfg.client.endpoints.join(","),
        cfg.bookie.lost_grace_ms
    );
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(meridian_storage::autorecovery::run(
        client,
        meridian_storage::autorecovery::Options::from_config(
            &cfg.bookie,
            id,
            cfg.broker.session_ttl_ms,
        ),
        stop_rx,
    ));
    crate::shutdown_signal().await;
    let _ = stop.send(true);
    let _ = task.await;
    Ok(())
}

pub async fn run_bookie(cfg: Config) -> anyhow::Result<()> {
    let b = &cfg.bookie;
    let listener = tokio::net::TcpListener::bind(&b.listen)
        .await
        .with_context(|| format!("bookie.listen {}", b.listen))?;
    // Before the journal starts, so its first histograms are recorded.
    let metrics = (!b.http_listen.is_empty())
        .then(|| meridian_broker::http::init_metrics(cfg.broker.metrics_series_idle_s));
    let tls = crate::tls_of(&cfg, Some(meridian_metadata::tls::ProcessRole::Bookie))?;
    let meta = MetadataClient::with_tls(&cfg.client, tls.clone()).context("client.endpoints")?;
    let running = bookie::start_with_tls(BookieOptions::from_config(b), tls, listener)
        .await
        .context("starting the bookie")?;
    // Bound once the bookie runs (journal replayed, first file ready): until then a probe is
    // refused at once rather than left waiting.
    let http = match metrics {
        Some(m) => {
            let l = tokio::net::TcpListener::bind(&b.http_listen)
                .await
                .with_context(|| format!("bookie.http_listen {}", b.http_listen))?;
            Some(crate::bookie_http::serve(
                Arc::clone(&running.core),
                m,
                l,
                b.http_connections_max as usize,
            )?)
        }
        None => None,
    };
    let advertise = if b.advertise.is_empty() {
        running.addr.to_string()
    } else {
        b.advertise.clone()
    };
    let pages = http
        .as_ref()
        .map(|h| format!("; HTTP on http://{} (/metrics, /health)", h.addr))
        .unwrap_or_default();
    println!(
        "meridian bookie {advertise} listening on {} (journal in {}, ledgers in {}; metadata {}{pages})",
        running.addr,
        b.journal_dir,
        b.ledger_dir,
        cfg.client.endpoints.join(",")
    );
    let (stop_reg, stop_rx) = tokio::sync::watch::channel(false);
    let orphans = tokio::spawn(bookie::orphan_scanner(
        Arc::clone(&running.core),
        meta.clone(),
        Duration::from_millis(b.gc_interval_ms),
        stop_rx.clone(),
    ));
    let registration = tokio::spawn(bookie::register_in_group(
        Arc::clone(&running.core),
        meta,
        advertise,
        b.rack.clone(),
        b.group.clone(),
        b.session_ttl_ms,
        Duration::from_millis((b.session_ttl_ms / 3).max(500)),
        stop_rx,
    ));
    crate::shutdown_signal().await;
    tracing::info!("signal received; stopping");
    let _ = stop_reg.send(true);
    let _ = registration.await;
    let _ = orphans.await;
    // First: its pages hold the bookie's core, and the index database closes only once
    // nothing does (shutdown waits up to 10 s for that).
    if let Some(h) = http {
        h.shutdown().await;
    }
    running.shutdown().await;
    Ok(())
}

#[derive(clap::Args)]
pub struct LedgerArgs {
    /// Metadata store endpoints, `HOST:PORT,...` (client.endpoints).
    #[arg(long, global = true)]
    metadata: Option<String>,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: LedgerCommand,
}

#[derive(clap::Subcommand)]
enum LedgerCommand {
    /// List ledgers.
    List,
    /// Show a ledger's metadata.
    Show { id: u64 },
    /// Recover a ledger: fence it on its bookies, recover every entry that may have been
    /// acknowledged, close it. Prints the last entry.
    Recover { id: u64 },
    /// Read every entry of a closed ledger (checksums verified); exit non-zero if any is
    /// missing or damaged.
    Check { id: u64 },
    /// Read entries of a ledger (checksums verified).
    Read {
        id: u64,
        /// First entry.
        #[arg(long, default_value_t = 0)]
        from: u64,
        /// Most entries to print.
        #[arg(long, default_value_t = 10)]
        count: u64,
    },
}

impl LedgerArgs {
    pub fn overrides(&self) -> Vec<(String, String)> {
        self.metadata
            .iter()
            .map(|m| ("client.endpoints".to_string(), m.clone()))
            .collect()
    }
}

pub async fn run_ledger(args: LedgerArgs, cfg: Config) -> anyhow::Result<ExitCode> {
    let tls = crate::tls_of(&cfg, None)?;
    let meta = MetadataClient::with_tls(&cfg.client, tls.clone()).context("client.endpoints")?;
    let client = LedgerClient::new(
        meta,
        LedgerClientOptions {
            tls,
            ..LedgerClientOptions::default()
        },
    );
    match args.command {
        LedgerCommand::List => {
            let ids = client.list().await?;
            if args.json {
                println!("{}", serde_json::to_string(&ids)?);
            } else {
                for id in ids {
                    println!("{id}");
                }
            }
        }
        LedgerCommand::Show { id } => {
            let (m, version) = client.metadata(id).await?;
            if args.json {
                println!("{}", serde_json::to_string(&m)?);
            } else {
                println!("ledger {} (metadata version {version})", m.id);
                println!("  state: {:?}", m.state);
                println!(
                    "  quorums: ensemble {} write {} ack {}",
                    m.ensemble_size, m.write_quorum, m.ack_quorum
                );
                match m.last_entry {
                    Some(l) => println!("  last entry: {l}"),
                    None => println!("  last entry: none"),
                }
                for f in &m.fragments {
                    println!(
                        "  fragment from entry {}: {}",
                        f.first_entry,
                        f.ensemble.join(", ")
                    );
                }
            }
        }
        LedgerCommand::Recover { id } => {
            let reader = client.open_recover(id).await?;
            match reader.last_entry() {
                Some(l) => println!("ledger {id} closed; last entry {l}"),
                None => println!("ledger {id} closed; no entries"),
            }
        }
        LedgerCommand::Check { id } => {
            let reader = client.open(id).await?;
            let Some(last) = reader.last_entry() else {
                if reader.metadata().state != meridian_storage::ledger::LedgerState::Closed {
                    anyhow::bail!("ledger {id} is not closed (recover it first)");
                }
                println!("ledger {id}: no entries");
                return Ok(ExitCode::SUCCESS);
            };
            use futures::StreamExt;
            let reader = &reader;
            let mut reads = futures::stream::iter(0..=last)
                .map(|i| async move { (i, reader.read(i).await) })
                .buffered(256);
            let mut bad = 0u64;
            let mut bytes = 0u64;
            while let Some((i, r)) = reads.next().await {
                match r {
                    Ok(p) => bytes += p.len() as u64,
                    Err(e) => {
                        bad += 1;
                        eprintln!("entry {i}: {e}");
                    }
                }
            }
            println!(
                "ledger {id}: {} entries, {bytes} bytes, {bad} unreadable",
                last + 1
            );
            if bad > 0 {
                return Ok(ExitCode::FAILURE);
            }
        }
        LedgerCommand::Read { id, from, count } => {
            let reader = client.open(id).await?;
            let mut failed = false;
            for entry in from..from.saturating_add(count) {
                if reader.last_entry().is_some_and(|l| entry > l) {
                    break;
                }
                match reader.read(entry).await {
                    Ok(p) => {
                        if args.json {
                            println!(
                                "{}",
                                serde_json::json!({"entry": entry, "bytes": p.len(), "text": String::from_utf8_lossy(&p)})
                            );
                        } else {
                            println!(
                                "{entry}\t{} B\t{}",
                                p.len(),
                                String::from_utf8_lossy(&p[..p.len().min(80)])
                            );
                        }
                    }
                    Err(e) => {
                        eprintln!("entry {entry}: {e}");
                        failed = true;
                        break;
                    }
                }
            }
            if failed {
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(clap::Args)]
pub struct PerfArgs {
    #[command(subcommand)]
    command: PerfCommand,
}

#[derive(clap::Subcommand)]
enum PerfCommand {
    /// Write entries to running bookies and print throughput and latency percentiles.
    Ledger(PerfLedgerArgs),
    /// Publish over the Pulsar protocol; print throughput and publish latency percentiles.
    Produce(crate::pulsar_perf::ProduceArgs),
    /// Consume over the Pulsar protocol; print throughput.
    Consume(crate::pulsar_perf::ConsumeArgs),
    /// Publish and consume the same topics; print publish and end-to-end latency.
    E2e(crate::pulsar_perf::E2eArgs),
    /// Time the admin API's namespace-wide topic stats over many topics.
    Admin(crate::admin_perf::AdminPerfArgs),
    /// The geo link alone (`--link-only`): MiB/s over 1 and 100 streams, GSO on and off.
    Geo(crate::geo_perf::GeoPerfArgs),
    /// The disk's own limits: 1 MiB writes each fdatasynced (MB/s) and 4 KiB writes each
    /// fdatasynced (rate and latency percentiles).
    Disk(crate::disk_probe::DiskArgs),
}

#[derive(clap::Args)]
struct PerfLedgerArgs {
    /// Metadata store endpoints, `HOST:PORT,...` (client.endpoints).
    #[arg(long)]
    metadata: Option<String>,
    #[arg(long, default_value_t = 1)]
    ensemble: usize,
    #[arg(long, default_value_t = 1)]
    write_quorum: usize,
    #[arg(long, default_value_t = 1)]
    ack_quorum: usize,
    #[arg(long, default_value_t = 100_000)]
    entries: u64,
    #[arg(long, default_value_t = 1024)]
    entry_size: usize,
    /// Adds in flight.
    #[arg(long, default_value_t = 1000)]
    window: usize,
    /// Read every acknowledged entry back at the end and check it; exit non-zero if any is
    /// missing or corrupt.
    #[arg(long)]
    verify: bool,
    /// Print `acknowledged N` after every N acknowledged entries (0: never).
    #[arg(long, default_value_t = 0)]
    progress_every: u64,
}

impl PerfArgs {
    pub fn overrides(&self) -> Vec<(String, String)> {
        match &self.command {
            PerfCommand::Ledger(a) => a
                .metadata
                .iter()
                .map(|m| ("client.endpoints".to_string(), m.clone()))
                .collect(),
            _ => Vec::new(),
        }
    }
}

/// The payload of entry `i`: its number, then a filler that depends on it.
fn perf_payload(i: u64, size: usize) -> Bytes {
    let mut v = Vec::with_capacity(size.max(8));
    v.extend_from_slice(&i.to_be_bytes());
    let fill = (i as u8).wrapping_mul(31).wrapping_add(7);
    v.resize(size.max(8), fill);
    Bytes::from(v)
}

pub async fn run_perf(args: PerfArgs, cfg: Config) -> anyhow::Result<ExitCode> {
    let a = match args.command {
        PerfCommand::Ledger(a) => a,
        PerfCommand::Produce(a) => {
            return crate::pulsar_perf::produce(a)
                .await
                .map(|()| ExitCode::SUCCESS)
        }
        PerfCommand::Consume(a) => {
            return crate::pulsar_perf::consume(a)
                .await
                .map(|()| ExitCode::SUCCESS)
        }
        PerfCommand::E2e(a) => return crate::pulsar_perf::e2e(a).await.map(|()| ExitCode::SUCCESS),
        PerfCommand::Admin(a) => {
            return crate::admin_perf::run(a).await.map(|()| ExitCode::SUCCESS)
        }
        PerfCommand::Geo(a) => return crate::geo_perf::run(a).await.map(|()| ExitCode::SUCCESS),
        PerfCommand::Disk(a) => {
            return tokio::task::spawn_blocking(move || crate::disk_probe::run(a))
                .await?
                .map(|()| ExitCode::SUCCESS)
        }
    };
    let tls = crate::tls_of(&cfg, None)?;
    let meta = MetadataClient::with_tls(&cfg.client, tls.clone()).context("client.endpoints")?;
    let client = LedgerClient::new(
        meta,
        LedgerClientOptions {
            window: a.window,
            tls,
            ..Default::default()
        },
    );
    let writer = client
        .create(a.ensemble, a.write_quorum, a.ack_quorum, BTreeMap::new())
        .await
        .context("creating the ledger")?;
    let id = writer.id();
    println!(
        "perf ledger: ledger {id}, E={} Qw={} Qa={}, {} entries of {} B, window {}",
        a.ensemble, a.write_quorum, a.ack_quorum, a.entries, a.entry_size, a.window
    );
    // Adds complete in entry order. The sending loop itself collects the outcomes that are in
    // after each add, so an add's latency is read as soon as the loop wakes for the permit its
    // completion freed (a separate collector task could fall behind under load and count its
    // own delay as latency); what is still out when the loop ends is awaited in order.
    let mut tally = Tally::new(a.progress_every);
    let mut outstanding: std::collections::VecDeque<(Instant, Outcome)> =
        std::collections::VecDeque::with_capacity(a.window.max(1));
    let start = Instant::now();
    for i in 0..a.entries {
        let sent = Instant::now();
        let rx = writer.add_queued(perf_payload(i, a.entry_size)).await;
        outstanding.push_back((sent, rx));
        while let Some((sent, rx)) = outstanding.front_mut() {
            match rx.try_recv() {
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) => break,
                Ok(r) => tally.record(*sent, Some(r)),
                Err(tokio::sync::oneshot::error::TryRecvError::Closed) => tally.record(*sent, None),
            }
            outstanding.pop_front();
        }
    }
    for (sent, rx) in outstanding {
        tally.record(sent, rx.await.ok());
    }
    let Tally {
        hist,
        errors,
        first_error,
        ..
    } = tally;
    let secs = start.elapsed().as_secs_f64();
    let ms = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "adds: {:.0} entries/s, {:.1} MB/s; latency p50 {:.2} ms p99 {:.2} ms p99.9 {:.2} ms max {:.2} ms ({} acknowledged, {errors} errors, {secs:.2} s)",
        hist.len() as f64 / secs,
        hist.len() as f64 * a.entry_size as f64 / secs / 1e6,
        ms(0.5),
        ms(0.99),
        ms(0.999),
        hist.max() as f64 / 1000.0,
        hist.len(),
    );
    if let Some(e) = first_error {
        eprintln!("first error: {e}");
    }
    let last = writer.close().await.context("closing the ledger")?;
    let mut code = if errors > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    };
    if a.verify {
        let reader = client.open(id).await?;
        let end = last.map_or(0, |l| l + 1);
        let start = Instant::now();
        let mut bad = 0u64;
        let mut reads = futures::stream::FuturesOrdered::new();
        use futures::StreamExt;
        let mut next = 0u64;
        let mut checked = 0u64;
        while checked < end {
            while next < end && reads.len() < a.window.max(1) {
                let r = &reader;
                let i = next;
                reads.push_back(async move { (i, r.read(i).await) });
                next += 1;
            }
            let Some((i, r)) = reads.next().await else {
                break;
            };
            checked += 1;
            match r {
                Ok(p) if p == perf_payload(i, a.entry_size) => {}
                Ok(_) => {
                    bad += 1;
                    eprintln!("entry {i}: content differs");
                }
                Err(e) => {
                    bad += 1;
                    eprintln!("entry {i}: {e}");
                }
            }
        }
        let missing = a.entries.saturating_sub(end);
        println!(
            "verify: {checked} entries read back in {:.2} s, {bad} bad, {missing} never acknowledged",
            start.elapsed().as_secs_f64()
        );
        if bad > 0 || missing > 0 {
            code = ExitCode::FAILURE;
        }
    }
    Ok(code)
}

type Outcome = tokio::sync::oneshot::Receiver<Result<u64, meridian_storage::ledger::LedgerError>>;

/// Outcomes of `perf ledger`'s adds: latencies of the acknowledged ones, and errors.
struct Tally {
    hist: hdrhistogram::Histogram<u64>,
    errors: u64,
    first_error: Option<String>,
    progress_every: u64,
}

impl Tally {
    fn new(progress_every: u64) -> Self {
        Tally {
            hist: hdrhistogram::Histogram::new(3).expect("histogram"),
            errors: 0,
            first_error: None,
            progress_every,
        }
    }

    /// `None`: the writer stopped before answering.
    fn record(
        &mut self,
        sent: Instant,
        outcome: Option<Result<u64, meridian_storage::ledger::LedgerError>>,
    ) {
        match outcome {
            Some(Ok(_)) => {
                self.hist
                    .record((sent.elapsed().as_micros() as u64).max(1))
                    .expect("record");
                if self.progress_every > 0 && self.hist.len() % self.progress_every == 0 {
                    println!("acknowledged {}", self.hist.len());
                }
            }
            Some(Err(e)) => {
                self.errors += 1;
                self.first_error.get_or_insert(e.to_string());
            }
            None => {
                self.errors += 1;
                self.first_error
                    .get_or_insert_with(|| "writer stopped".to_string());
            }
        }
    }
}
