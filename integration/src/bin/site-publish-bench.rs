//! A two-broker site's maximum publish rate over 8 topics against a one-broker site, in one
//! run with the same client: the stock Rust `pulsar` crate (lookups, redirects to the owner),
//! batched 1 KiB messages, a window of sends in flight per producer. Each site is separate
//! processes on loopback (a metadata node, one bookie, the brokers); the runs alternate
//! (1, 2, 1, 2 brokers). On two cores this shows what the extra broker and hop cost, not
//! scaling: every process shares the same two cores and disk.
//!
//! `MERIDIAN_BIN=target/release/meridian cargo run --release -p meridian-integration --bin
//! site-publish-bench -- [SECONDS] [TOPICS] [ROUNDS]` (defaults 15, 8, 2).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::stream::FuturesUnordered;
use futures::StreamExt;
use meridian_integration::{wait_for_bookies, BookieProc, BrokerProc, MetaCluster};
use pulsar::{producer, ProducerOptions, Pulsar, TokioExecutor};

const WINDOW: usize = 2_000;
const SIZE: usize = 1_024;

async fn run(brokers: usize, seconds: u64, topics: usize) -> anyhow::Result<(f64, String)> {
    let cluster = MetaCluster::start(1).await?;
    let endpoint = cluster.endpoints()[0].clone();
    let root = cluster.root.path().to_path_buf();
    let mut bookie = BookieProc::new("bookie", &root, &endpoint);
    bookie.start()?;
    wait_for_bookies(&cluster.client(), 1, Duration::from_secs(20)).await?;
    let mut procs: Vec<BrokerProc> = (0..brokers)
        .map(|i| {
            let mut b = BrokerProc::new(&format!("b{i}"), &root, &endpoint);
            b.env("MERIDIAN_BROKER_LOAD_REPORT_INTERVAL_MS", "500")
                .env("MERIDIAN_BROKER_DEFAULT_BUNDLES", "8")
                // Placement by lookups only: no splits or shedding while it measures.
                .env("MERIDIAN_BROKER_BUNDLE_SPLIT_ENABLED", "false")
                .env("MERIDIAN_BROKER_LOAD_BALANCER_ENABLED", "false");
            b
        })
        .collect();
    for b in &mut procs {
        b.start()?;
    }
    // Every broker registered before the first lookup places bundles.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let client: Pulsar<TokioExecutor> = Pulsar::builder(procs[0].url.clone(), TokioExecutor)
        .build()
        .await?;
    let deadline = Instant::now() + Duration::from_secs(3 + seconds);
    let measure_from = Instant::now() + Duration::from_secs(3);
    let mut tasks = Vec::new();
    for t in 0..topics {
        let mut p = client
            .producer()
            .with_topic(format!("persistent://public/default/site-bench-{t}"))
            .with_options(ProducerOptions {
                batch_size: Some(1_000),
                block_queue_if_full: true,
                ..Default::default()
            })
            .build()
            .await?;
        tasks.push(tokio::spawn(async move {
            let payload = vec![0x5au8; SIZE];
            let mut inflight = FuturesUnordered::new();
            let mut acked = 0u64;
            while Instant::now() < deadline {
                while inflight.len() < WINDOW {
                    let msg = producer::Message {
                        payload: payload.clone(),
                        ..Default::default()
                    };
                    match p.send_non_blocking(msg).await {
                        Ok(r) => inflight.push(r),
                        Err(e) => return Err(anyhow::anyhow!("send: {e}")),
                    }
                }
                if let Some(r) = inflight.next().await {
                    r.map_err(|e| anyhow::anyhow!("receipt: {e}"))?;
                    if Instant::now() >= measure_from {
                        acked += 1;
                    }
                }
            }
            Ok::<u64, anyhow::Error>(acked)
        }));
    }
    let mut total = 0u64;
    for t in tasks {
        total += t.await??;
    }
    // Who served what.
    let mut owners: BTreeMap<String, usize> = BTreeMap::new();
    for t in 0..topics {
        let (code, out, _) = meridian_integration::run_admin(&[
            "--admin-url",
            &procs[0].admin_url,
            "topics",
            "lookup",
            &format!("persistent://public/default/site-bench-{t}"),
        ])?;
        let owner = if code == 0 {
            out.split_whitespace().next().unwrap_or("?").to_string()
        } else {
            "?".to_string()
        };
        *owners.entry(owner).or_default() += 1;
    }
    drop(client);
    Ok((total as f64 / seconds as f64, format!("{owners:?}")))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers: SECONDS TOPICS ROUNDS"))
        .collect();
    let seconds = args.first().copied().unwrap_or(15);
    let topics = args.get(1).copied().unwrap_or(8) as usize;
    let rounds = args.get(2).copied().unwrap_or(2);
    println!("{topics} topics, 1 KiB batched (1,000 per batch), {WINDOW} sends in flight per producer, {seconds} s measured after 3 s");
    let mut one = Vec::new();
    let mut two = Vec::new();
    for r in 1..=rounds {
        for n in [1usize, 2] {
            let (rate, owners) = run(n, seconds, topics).await?;
            println!("round {r}, {n} broker(s): {rate:.0} msg/s (topics per broker {owners})");
            if n == 1 {
                one.push(rate);
            } else {
                two.push(rate);
            }
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    println!(
        "one broker {:.0} msg/s, two brokers {:.0} msg/s: ratio {:.2}",
        mean(&one),
        mean(&two),
        mean(&two) / mean(&one)
    );
    Ok(())
}
