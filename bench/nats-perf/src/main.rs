//! `nats-perf URL RATE SECONDS SIZE WINDOW`: publishes SIZE-byte messages to a JetStream stream
//! with at most WINDOW acknowledgements outstanding, at RATE messages per second (0: as fast as
//! the window allows), and prints throughput and publish-to-ack latency percentiles — the same
//! figures `meridian perf produce` prints, for NATS driven by its own client.
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use hdrhistogram::Histogram;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    let url = a.get(1).cloned().unwrap_or_else(|| "nats://127.0.0.1:4222".into());
    let rate: f64 = a.get(2).map_or(0.0, |s| s.parse().unwrap());
    let seconds: u64 = a.get(3).map_or(15, |s| s.parse().unwrap());
    let size: usize = a.get(4).map_or(1024, |s| s.parse().unwrap());
    let window: usize = a.get(5).map_or(1000, |s| s.parse().unwrap());
    let client = async_nats::connect(&url).await?;
    let js = jetstream::new(client);
    let _ = js.delete_stream("PERF").await;
    js.create_stream(jetstream::stream::Config {
        name: "PERF".into(),
        subjects: vec!["perf.>".into()],
        ..Default::default()
    })
    .await?;
    let payload = bytes::Bytes::from(vec![0xab; size]);
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let mut inflight: VecDeque<(Instant, jetstream::context::PublishAckFuture)> = VecDeque::new();
    let start = Instant::now();
    let end = start + Duration::from_secs(seconds);
    let mut n = 0u64;
    let mut acked = 0u64;
    while Instant::now() < end {
        if rate > 0.0 {
            let at = start + Duration::from_secs_f64(n as f64 / rate);
            // Collect acks while waiting for the next slot.
            while Instant::now() < at {
                if let Some((t, f)) = inflight.pop_front() {
                    f.await?;
                    h.record(t.elapsed().as_micros().max(1) as u64)?;
                    acked += 1;
                } else {
                    tokio::time::sleep_until(at.into()).await;
                }
            }
        }
        if inflight.len() >= window {
            let (t, f) = inflight.pop_front().expect("non-empty");
            f.await?;
            h.record(t.elapsed().as_micros().max(1) as u64)?;
            acked += 1;
        }
        let t = Instant::now();
        let f = js.publish("perf.a", payload.clone()).await?;
        inflight.push_back((t, f));
        n += 1;
    }
    for (t, f) in inflight {
        f.await?;
        h.record(t.elapsed().as_micros().max(1) as u64)?;
        acked += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "summary nats publish: {acked} messages in {secs:.1} s = {:.0} msg/s; latency p50 {:.3} p95 {:.3} p99 {:.3} p99.9 {:.3} max {:.3} ms",
        acked as f64 / secs,
        ms(0.5),
        ms(0.95),
        ms(0.99),
        ms(0.999),
        h.max() as f64 / 1000.0
    );
    Ok(())
}
