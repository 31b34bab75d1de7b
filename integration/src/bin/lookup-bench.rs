//! LOOKUP throughput at the owner of a topic (Connect) and at another broker (Redirect): a
//! metadata node, a bookie and two brokers on loopback; one connection per broker sends
//! LOOKUPs of 100 topics owned by one broker, WINDOW in flight, for SECONDS each, alternating
//! owner and non-owner RUNS times. Prints lookups per second of each run.
//!
//! `cargo run -p meridian-integration --bin lookup-bench -- [SECONDS] [RUNS] [WINDOW]`
//! (defaults 5, 3, 64).

use std::time::{Duration, Instant};

use meridian_integration::raw::{cmd, producer, send_frame, Got, Raw};
use meridian_integration::{wait_for_bookies, BookieProc, BrokerProc, MetaCluster};
use meridian_protocol::pb::{self, base_command::Type, command_lookup_topic_response::LookupType};

const TOPICS: usize = 100;

fn lookup(topic: &str, request_id: u64) -> pb::BaseCommand {
    cmd(Type::Lookup, |c| {
        c.lookup_topic = Some(pb::CommandLookupTopic {
            topic: topic.into(),
            request_id,
            authoritative: Some(false),
            advertised_listener_name: None,
        })
    })
}

/// Lookups per second for `secs` seconds, `window` in flight; every answer must be `want`.
fn run(url: &str, names: &[String], secs: u64, window: usize, want: LookupType) -> f64 {
    let mut c = Raw::connected(url);
    let mut next = 0u64;
    let mut in_flight = 0usize;
    let mut done = 0u64;
    let started = Instant::now();
    let until = started + Duration::from_secs(secs);
    loop {
        while in_flight < window && Instant::now() < until {
            c.send(&lookup(&names[next as usize % names.len()], next));
            next += 1;
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        match c.recv(Duration::from_secs(10)) {
            Got::Frame(f) => {
                let r = f.command.lookup_topic_response.expect("LOOKUP_RESPONSE");
                assert_eq!(r.response, Some(want as i32), "{r:?}");
                in_flight -= 1;
                done += 1;
            }
            other => panic!("no answer: {}", matches!(other, Got::Closed)),
        }
    }
    done as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers: SECONDS RUNS WINDOW"))
        .collect();
    let secs = args.first().copied().unwrap_or(5);
    let runs = args.get(1).copied().unwrap_or(3);
    let window = args.get(2).copied().unwrap_or(64) as usize;
    let cluster = MetaCluster::start(1).await?;
    let endpoint = cluster.endpoints()[0].clone();
    let root = cluster.root.path().to_path_buf();
    let mut bookie = BookieProc::new("bookie", &root, &endpoint);
    bookie.start()?;
    wait_for_bookies(&cluster.client(), 1, Duration::from_secs(20)).await?;
    let mut owner = BrokerProc::new("owner", &root, &endpoint);
    owner
        .env("MERIDIAN_BROKER_LOAD_BALANCER_ENABLED", "false")
        .start()?;
    let names: Vec<String> = (0..TOPICS)
        .map(|i| format!("persistent://public/default/lookup-{i}"))
        .collect();
    // Every topic loaded at the owner (the only broker yet).
    let mut c = Raw::connected(&owner.url);
    for (i, t) in names.iter().enumerate() {
        let id = i as u64 + 1;
        c.send(&producer(t, id, id));
        assert!(c.expect().command.producer_success.is_some());
        c.send_raw(&send_frame(id, 0, b"x"));
        assert!(c.expect().command.send_receipt.is_some());
    }
    let mut other = BrokerProc::new("other", &root, &endpoint);
    other
        .env("MERIDIAN_BROKER_LOAD_BALANCER_ENABLED", "false")
        .start()?;
    println!("seconds {secs}, runs {runs}, window {window}, topics {TOPICS}");
    for r in 1..=runs {
        let at_owner = run(&owner.url, &names, secs, window, LookupType::Connect);
        let elsewhere = run(&other.url, &names, secs, window, LookupType::Redirect);
        println!(
            "run {r}: at the owner {at_owner:.0} lookups/s (Connect), at the other broker {elsewhere:.0} lookups/s (Redirect)"
        );
    }
    Ok(())
}
