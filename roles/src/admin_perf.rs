//! `meridian perf admin`: how fast the admin API answers reads. Creates `--topics` topics in a
//! namespace (loading them on the broker), then times `--requests` calls of the namespace's
//! topic stats (every topic's figures in one answer) and prints latency percentiles.

use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use meridian_tenancy::pb::admin_client::AdminClient;
use meridian_tenancy::pb::{CreateTopicRequest, Name, Namespace};

#[derive(clap::Args, Clone, Debug)]
pub struct AdminPerfArgs {
    /// The admin API.
    #[arg(long, default_value = "http://127.0.0.1:6680")]
    admin_url: String,
    /// Namespace to create the topics in (created if absent).
    #[arg(long, default_value = "public/admin-perf")]
    namespace: String,
    #[arg(long, default_value_t = 1000)]
    topics: u32,
    #[arg(long, default_value_t = 50)]
    requests: u32,
}

pub async fn run(a: AdminPerfArgs) -> anyhow::Result<()> {
    let mut c = AdminClient::connect(a.admin_url.clone())
        .await
        .with_context(|| format!("cannot reach the admin API at {}", a.admin_url))?;
    c = c.max_decoding_message_size(64 << 20);
    if let Err(s) = c
        .create_namespace(Namespace {
            name: a.namespace.clone(),
            policies: None,
        })
        .await
    {
        anyhow::ensure!(
            s.code() == tonic::Code::AlreadyExists,
            "creating the namespace: {s}"
        );
    }
    let started = Instant::now();
    for i in 0..a.topics {
        let topic = format!("persistent://{}/t-{i}", a.namespace);
        if let Err(s) = c
            .create_topic(CreateTopicRequest {
                topic,
                partitions: 0,
            })
            .await
        {
            anyhow::ensure!(
                s.code() == tonic::Code::AlreadyExists,
                "creating a topic: {s}"
            );
        }
    }
    println!(
        "created {} topics in {:.1} s",
        a.topics,
        started.elapsed().as_secs_f64()
    );
    let mut h = Histogram::<u64>::new(3)?;
    let mut answered = 0;
    for _ in 0..a.requests.max(1) {
        let t = Instant::now();
        let r = c
            .get_namespace_topic_stats(Name {
                name: a.namespace.clone(),
            })
            .await?
            .into_inner();
        h.record(t.elapsed().as_micros() as u64)?;
        answered = r.topics.len();
    }
    let ms = |q: f64| Duration::from_micros(h.value_at_quantile(q)).as_secs_f64() * 1000.0;
    println!(
        "summary admin: stats of {answered} topics in one call, {} calls: p50 {:.1} p95 {:.1} p99 {:.1} max {:.1} ms",
        a.requests.max(1),
        ms(0.5),
        ms(0.95),
        ms(0.99),
        h.max() as f64 / 1000.0
    );
    Ok(())
}
