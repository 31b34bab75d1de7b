//! `meridian meta bench`: acknowledged puts and linearizable gets from concurrent clients, with
//! latency percentiles, and an optional probe of the disk's raw fsync rate to compare against.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use meridian_config::ClientConfig;
use meridian_metadata::MetadataClient;
use serde_json::json;

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Concurrent clients (each with one request outstanding at a time).
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Connections the clients share, round-robin (default: one per client).
    #[arg(long)]
    conns: Option<usize>,
    /// Bytes per value.
    #[arg(long, default_value_t = 100)]
    value_bytes: usize,
    /// Seconds per phase (puts, then gets).
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Distinct keys written and read.
    #[arg(long, default_value_t = 10_000)]
    keys: u64,
    /// Key prefix of the benchmark's keys.
    #[arg(long, default_value = "/bench")]
    prefix: String,
    /// Also measure raw fsyncs per second (4 KiB write + fdatasync, one at a time) in this
    /// directory, and report the puts as a fraction of it.
    #[arg(long)]
    fsync_dir: Option<PathBuf>,
    /// Skip the get phase.
    #[arg(long)]
    no_gets: bool,
}

struct Phase {
    name: &'static str,
    ops: u64,
    errors: u64,
    seconds: f64,
    hist: Histogram<u64>,
}

impl Phase {
    fn rate(&self) -> f64 {
        self.ops as f64 / self.seconds
    }

    fn ms(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64 / 1000.0
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "ops": self.ops, "errors": self.errors, "seconds": self.seconds,
            "ops_per_s": self.rate(),
            "p50_ms": self.ms(0.5), "p99_ms": self.ms(0.99), "p999_ms": self.ms(0.999),
            "max_ms": self.hist.max() as f64 / 1000.0,
        })
    }

    fn print(&self) {
        println!(
            "{:<26} {:>9.0} ops/s  p50 {:>6.2} ms  p99 {:>6.2} ms  p99.9 {:>6.2} ms  max {:>7.2} ms  ({} ops, {} errors, {:.1} s)",
            self.name,
            self.rate(),
            self.ms(0.5),
            self.ms(0.99),
            self.ms(0.999),
            self.hist.max() as f64 / 1000.0,
            self.ops,
            self.errors,
            self.seconds
        );
    }
}

async fn phase(
    name: &'static str,
    clients: &[MetadataClient],
    args: &BenchArgs,
    put: bool,
) -> anyhow::Result<Phase> {
    let value = vec![b'x'; args.value_bytes];
    let duration = Duration::from_secs_f64(args.seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (c, client) in clients.iter().enumerate() {
        let client = client.clone();
        let value = value.clone();
        let prefix = args.prefix.clone();
        let keys = args.keys;
        let n = clients.len() as u64;
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram");
            let (mut ops, mut errors) = (0u64, 0u64);
            let mut i = c as u64;
            while started.elapsed() < duration {
                let key = format!("{prefix}/{:08}", i % keys);
                i += n;
                let t = Instant::now();
                let ok = if put {
                    client.put(&key, value.clone()).await.is_ok()
                } else {
                    client.get(&key).await.is_ok()
                };
                let us = t.elapsed().as_micros() as u64;
                if ok {
                    ops += 1;
                    let _ = hist.record(us.max(1));
                } else {
                    errors += 1;
                }
            }
            (hist, ops, errors)
        }));
    }
    let mut total = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let (mut ops, mut errors) = (0, 0);
    for t in tasks {
        let (h, o, e) = t.await?;
        total.add(h)?;
        ops += o;
        errors += e;
    }
    Ok(Phase {
        name,
        ops,
        errors,
        seconds: started.elapsed().as_secs_f64(),
        hist: total,
    })
}

/// Raw fsync rate of one writer: 4 KiB appended and `fdatasync`ed, for two seconds.
fn fsync_probe(dir: &std::path::Path) -> anyhow::Result<f64> {
    let started = std::time::Instant::now();
    let n = crate::disk_probe::sync_latency(dir, 2.0)?.len();
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

pub async fn run(
    args: BenchArgs,
    cfg: &ClientConfig,
    tls: Option<std::sync::Arc<meridian_metadata::tls::SiteTls>>,
    json: bool,
) -> anyhow::Result<()> {
    anyhow::ensure!(args.clients >= 1, "--clients must be at least 1");
    anyhow::ensure!(args.keys >= 1, "--keys must be at least 1");
    let conns = args.conns.unwrap_or(args.clients);
    anyhow::ensure!(
        (1..=args.clients).contains(&conns),
        "--conns must be between 1 and --clients ({})",
        args.clients
    );
    let mut connections = Vec::with_capacity(conns);
    for _ in 0..conns {
        let c = MetadataClient::with_tls(cfg, tls.clone())?;
        c.discover_leader().await;
        connections.push(c);
    }
    let clients: Vec<MetadataClient> = (0..args.clients)
        .map(|i| connections[i % conns].clone())
        .collect();
    if !json {
        println!(
            "bench: {} clients on {} connection(s), {}-byte values, {} keys, {:.1} s per phase, endpoints {}",
            args.clients,
            conns,
            args.value_bytes,
            args.keys,
            args.seconds,
            cfg.endpoints.join(",")
        );
    }
    let puts = phase("puts (acknowledged)", &clients, &args, true).await?;
    if !json {
        puts.print();
    }
    let gets = if args.no_gets {
        None
    } else {
        let g = phase("gets (linearizable)", &clients, &args, false).await?;
        if !json {
            g.print();
        }
        Some(g)
    };
    let fsync = match &args.fsync_dir {
        Some(dir) => Some(fsync_probe(dir)?),
        None => None,
    };
    if let Some(rate) = fsync {
        if !json {
            println!(
                "fsync probe ({}): {rate:.0} fsyncs/s of 4 KiB, one writer; puts reached {:.2}x that rate",
                args.fsync_dir.as_ref().map_or(String::new(), |d| d.display().to_string()),
                puts.rate() / rate
            );
        }
    }
    if json {
        println!(
            "{}",
            json!({
                "clients": args.clients, "conns": conns, "value_bytes": args.value_bytes,
                "puts": puts.json(),
                "gets": gets.as_ref().map(Phase::json),
                "fsyncs_per_s": fsync,
                "puts_per_fsync": fsync.map(|r| puts.rate() / r),
            })
        );
    }
    Ok(())
}
