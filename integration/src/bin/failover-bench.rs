//! Broker failover time, measured: a site of one metadata node, one bookie and two brokers
//! (separate processes on loopback); TOPICS topics all owned by one broker; kill -9 of that
//! broker, then the time until every topic accepts a send (PRODUCER and a SEND receipt) at
//! the other broker. The killed broker is restarted and the next round kills the other one,
//! so every round moves every topic. Prints each round and p50/max over KILLS rounds.
//!
//! `cargo run -p meridian-integration --bin failover-bench -- [KILLS] [TOPICS] [TTL_MS]`
//! (defaults 10, 100, 5000: the default `broker.session_ttl_ms`).

use std::time::{Duration, Instant};

use meridian_integration::raw::{cmd, producer, send_frame, Got, Raw};
use meridian_integration::{wait_for_bookies, BookieProc, BrokerProc, MetaCluster};
use meridian_protocol::pb::base_command::Type;

/// Tries PRODUCER + SEND of `topic` at `url` until both succeed; the time it took.
fn serve_time(url: &str, topic: &str, started: Instant, id: &mut u64) -> Duration {
    loop {
        *id += 1;
        let mut c = match std::net::TcpStream::connect(url.trim_start_matches("pulsar://")) {
            Ok(_) => Raw::connected(url),
            Err(_) => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
        };
        c.send(&producer(topic, *id, *id));
        let ok = matches!(c.recv(Duration::from_secs(10)), Got::Frame(f) if f.command.producer_success.is_some());
        if ok {
            c.send_raw(&send_frame(*id, 0, b"failover"));
            if matches!(c.recv(Duration::from_secs(10)), Got::Frame(f) if f.command.send_receipt.is_some())
            {
                c.send(&cmd(Type::CloseProducer, |x| {
                    x.close_producer = Some(meridian_protocol::pb::CommandCloseProducer {
                        producer_id: *id,
                        request_id: *id + 1_000_000,
                    })
                }));
                return started.elapsed();
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers: KILLS TOPICS TTL_MS"))
        .collect();
    let kills = args.first().copied().unwrap_or(10) as usize;
    let topics = args.get(1).copied().unwrap_or(100) as usize;
    let ttl = args.get(2).copied().unwrap_or(5_000).to_string();
    let cluster = MetaCluster::start(1).await?;
    let endpoint = cluster.endpoints()[0].clone();
    let root = cluster.root.path().to_path_buf();
    let mut bookie = BookieProc::new("bookie", &root, &endpoint);
    bookie.start()?;
    wait_for_bookies(&cluster.client(), 1, Duration::from_secs(20)).await?;
    let mut brokers: Vec<BrokerProc> = ["a", "b"]
        .iter()
        .map(|n| {
            let mut b = BrokerProc::new(n, &root, &endpoint);
            b.env("MERIDIAN_BROKER_SESSION_TTL_MS", &ttl)
                .env("MERIDIAN_BROKER_LOAD_BALANCER_ENABLED", "false");
            b
        })
        .collect();
    brokers[0].start()?;
    let names: Vec<String> = (0..topics).map(|i| format!("failover-{i}")).collect();
    let mut id = 0;
    // Every topic at broker a (the only one yet).
    for t in &names {
        serve_time(&brokers[0].url, t, Instant::now(), &mut id);
    }
    brokers[1].start()?;
    println!("kills {kills}, topics {topics}, broker.session_ttl_ms {ttl}");
    let mut owner = 0;
    let mut all = Vec::new();
    let mut firsts = Vec::new();
    for round in 1..=kills {
        let survivor = 1 - owner;
        brokers[owner].kill9()?;
        let started = Instant::now();
        // Every topic probed at once, as its clients would retry (16 threads).
        let url = brokers[survivor].url.clone();
        let base = id;
        let times: Vec<f64> = std::thread::scope(|sc| {
            let handles: Vec<_> = names
                .chunks(names.len().div_ceil(16))
                .enumerate()
                .map(|(k, chunk)| {
                    let url = url.clone();
                    sc.spawn(move || {
                        let mut id = base + (k as u64 + 1) * 10_000_000;
                        chunk
                            .iter()
                            .map(|t| serve_time(&url, t, started, &mut id).as_secs_f64())
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().expect("a probe thread"))
                .collect()
        });
        id = base + 1_000_000_000 * round as u64;
        let max = times.iter().copied().fold(0.0, f64::max);
        let first = times.iter().copied().fold(f64::MAX, f64::min);
        println!(
            "round {round}: first topic served after {first:.2} s, all {topics} after {max:.2} s"
        );
        all.push(max);
        firsts.push(first);
        brokers[owner].start()?;
        owner = survivor;
    }
    all.sort_by(f64::total_cmp);
    firsts.sort_by(f64::total_cmp);
    println!(
        "every topic served again after a kill -9: p50 {:.2} s, max {:.2} s (first topic: p50 {:.2} s) over {kills} kills",
        pct(&all, 0.5),
        all[all.len() - 1],
        pct(&firsts, 0.5)
    );
    Ok(())
}
