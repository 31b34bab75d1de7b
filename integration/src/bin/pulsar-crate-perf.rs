//! Publish load through the stock Rust `pulsar` crate, against Meridian or any broker of the
//! Pulsar protocol (pulsar-lite), for side-by-side runs (`bench/sidebyside.sh PART=crate`).
//!
//! The crate keeps one batch in flight per producer: it sends a batch, waits for its receipt,
//! then sends the next. So its rate is the batch size over the broker's round trip, and every
//! millisecond a broker adds to a publish shows as throughput lost. `meridian perf` (many
//! batches in flight) measures what a broker can take; this measures what such a client gets.
//!
//! Without `--rate`, each producer keeps up to `--window` messages handed to the crate and not
//! yet acknowledged, until the end. With `--rate`, messages are handed over at evenly spaced
//! times from when the producer is ready (tokio's timer: in 1 ms steps), every one whose slot
//! falls in the run however late, and publish latency runs from a message's slot to its
//! receipt, so a client held up by a slow broker counts the wait (no coordinated omission).
//! With `--batch 1` the crate does not batch and its sends are pipelined.
//!
//! `pulsar-crate-perf --url pulsar://127.0.0.1:6650 [--topic T] [--producers N] [--seconds S]
//! [--warmup-seconds W] [--size BYTES] [--batch N] [--batch-delay-ms MS] [--rate MSG_PER_S]
//! [--window N]`

use std::time::{Duration, Instant};

use clap::Parser;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use hdrhistogram::Histogram;
use pulsar::{producer, ProducerOptions, Pulsar, TokioExecutor};

#[derive(Parser, Debug, Clone)]
#[command(about = "Publish load through the stock Rust pulsar crate")]
struct Args {
    #[arg(long, default_value = "pulsar://127.0.0.1:6650")]
    url: String,
    /// Topic (in public/default), or the prefix of one topic per producer (`T-0`, `T-1`, ...).
    #[arg(long, default_value = "crate-perf")]
    topic: String,
    /// Producers, each on its own topic; all share the crate's one connection per broker.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    producers: u32,
    /// Seconds measured (after the warm-up).
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Seconds run before measuring (connections, topic creation, first ledger).
    #[arg(long, default_value_t = 2)]
    warmup_seconds: u64,
    /// Payload bytes of each message.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=5_000_000))]
    size: u32,
    /// Messages per batch (the crate's `batch_size`; 1: no batching).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    batch: u32,
    /// A batch is sent this long after its first message even when not full (the crate's
    /// `batch_timeout`; Pulsar's clients default to 1 ms).
    #[arg(long, default_value_t = 1)]
    batch_delay_ms: u64,
    /// Messages per second over all producers (0: as fast as the crate goes).
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// Messages handed to the crate and not yet acknowledged, per producer.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    window: u64,
}

struct Outcome {
    acked: u64,
    latency: Histogram<u64>,
}

async fn produce(
    client: Pulsar<TokioExecutor>,
    a: Args,
    topic: String,
    start: Instant,
) -> anyhow::Result<Outcome> {
    let batching = a.batch > 1;
    let mut p = client
        .producer()
        .with_topic(format!("persistent://public/default/{topic}"))
        .with_options(ProducerOptions {
            batch_size: batching.then_some(a.batch),
            batch_timeout: batching.then(|| Duration::from_millis(a.batch_delay_ms.max(1))),
            block_queue_if_full: true,
            ..Default::default()
        })
        .build()
        .await?;
    let measure_from = start + Duration::from_secs(a.warmup_seconds);
    let end = measure_from + Duration::from_secs(a.seconds);
    let per_producer = a.rate as f64 / a.producers as f64;
    // The schedule starts once the producer is ready.
    let begun = Instant::now();
    let payload = vec![0x5au8; a.size as usize];
    let mut latency = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
    let mut acked = 0u64;
    let mut inflight = FuturesUnordered::new();
    let mut sent = 0u64;
    let mut count = |sent_at: Instant, done: Instant| {
        if sent_at >= measure_from && sent_at < end {
            acked += 1;
            let _ = latency.record((done.duration_since(sent_at).as_micros() as u64).max(1));
        }
    };
    loop {
        // Receipts are timed when polled: take every one that has come before going on.
        while let Some(Some((sent_at, done, r))) = inflight.next().now_or_never() {
            let r: Result<_, pulsar::Error> = r;
            r.map_err(|e| anyhow::anyhow!("receipt: {e}"))?;
            count(sent_at, done);
        }
        let now = Instant::now();
        let due = if per_producer > 0.0 {
            begun + Duration::from_secs_f64(sent as f64 / per_producer)
        } else {
            now
        };
        // At a rate, every message whose slot is in the run is sent, late as it may be (its
        // latency counts the wait); as fast as it goes, sending stops at the end.
        if due >= end {
            break;
        }
        if (inflight.len() as u64) < a.window && due <= now {
            let msg = producer::Message {
                payload: payload.clone(),
                ..Default::default()
            };
            let receipt = p
                .send_non_blocking(msg)
                .await
                .map_err(|e| anyhow::anyhow!("send: {e}"))?;
            inflight.push(async move {
                let r = receipt.await;
                (due, Instant::now(), r)
            });
            sent += 1;
            continue;
        }
        tokio::select! {
            Some((sent_at, done, r)) = inflight.next(), if !inflight.is_empty() => {
                r.map_err(|e| anyhow::anyhow!("receipt: {e}"))?;
                count(sent_at, done);
            }
            _ = tokio::time::sleep_until(due.into()), if due > now => {}
            else => {}
        }
    }
    // Sends of the measured interval still waiting: their receipts count, late as they are.
    while let Some((sent_at, done, r)) = inflight.next().await {
        r.map_err(|e| anyhow::anyhow!("receipt: {e}"))?;
        count(sent_at, done);
    }
    let _ = p.close().await;
    Ok(Outcome { acked, latency })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    anyhow::ensure!(a.seconds > 0, "--seconds must be at least 1");
    let client: Pulsar<TokioExecutor> = Pulsar::builder(a.url.clone(), TokioExecutor)
        .build()
        .await?;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..a.producers {
        let topic = if a.producers == 1 {
            a.topic.clone()
        } else {
            format!("{}-{i}", a.topic)
        };
        tasks.push(tokio::spawn(produce(
            client.clone(),
            a.clone(),
            topic,
            start,
        )));
    }
    let mut acked = 0u64;
    let mut latency = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
    for t in tasks {
        let o = t.await??;
        acked += o.acked;
        latency.add(&o.latency)?;
    }
    let rate = acked as f64 / a.seconds as f64;
    let ms = |q: f64| latency.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "summary crate produce: {rate:.0} msg/s {:.1} MiB/s ({acked} acknowledged; {} producer(s), batch {}, {} B) publish latency p50 {:.3} p99 {:.3} p99.9 {:.3} max {:.3} ms",
        rate * a.size as f64 / (1 << 20) as f64,
        a.producers,
        a.batch,
        a.size,
        ms(0.5),
        ms(0.99),
        ms(0.999),
        latency.max() as f64 / 1000.0
    );
    Ok(())
}
