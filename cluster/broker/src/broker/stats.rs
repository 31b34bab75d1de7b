//! A topic's figures (counters, rates sampled every stats interval) and the broker's stats
//! loop, which also finds inactive topics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{now_ms, Broker, SubscriptionStats, Topic};

/// Counters of one topic, kept for the stats and the admin API.
#[derive(Debug, Default)]
pub struct TopicCounters {
    pub msgs_in: AtomicU64,
    pub bytes_in: AtomicU64,
    pub msgs_out: AtomicU64,
    pub bytes_out: AtomicU64,
}

/// A topic's figures, as the stats (`/stats`) and the admin API show them. Rates are per
/// second over the last sampling interval of [`Broker::stats_loop`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct TopicStats {
    pub topic: String,
    pub msg_rate_in: f64,
    pub msg_rate_out: f64,
    pub bytes_rate_in: f64,
    pub bytes_rate_out: f64,
    pub msgs_in_total: u64,
    pub msgs_out_total: u64,
    pub storage_entries: u64,
    pub storage_bytes: u64,
    pub producers: usize,
    pub subscriptions: Vec<SubscriptionStats>,
    /// While the backlog quota is passed: which subscription pins the backlog, and how.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backlog_quota_exceeded: Option<String>,
    /// Each replicator to another site.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replication: Vec<super::replication::ReplicationStats>,
}

/// The last sample of a topic's counters and the rates computed from it.
#[derive(Debug, Default, Clone)]
pub(super) struct Rates {
    pub(super) at: Option<std::time::Instant>,
    pub(super) totals: [u64; 4],
    pub(super) per_sec: [f64; 4],
    pub(super) subs: HashMap<String, (u64, f64)>,
}

impl Topic {
    /// Messages in, messages out, bytes in, bytes out per second, as last sampled.
    pub fn rates_per_sec(&self) -> [f64; 4] {
        self.rates.lock().expect("rates lock").per_sec
    }

    /// Samples the counters and updates the rates (called by the stats loop).
    pub async fn sample_rates(&self) {
        let totals = [
            self.counters.msgs_in.load(Ordering::Relaxed),
            self.counters.msgs_out.load(Ordering::Relaxed),
            self.counters.bytes_in.load(Ordering::Relaxed),
            self.counters.bytes_out.load(Ordering::Relaxed),
        ];
        let subs: Vec<(String, u64)> = self
            .subscriptions()
            .await
            .iter()
            .map(|s| (s.name().to_string(), s.msgs_out.load(Ordering::Relaxed)))
            .collect();
        let now = std::time::Instant::now();
        let mut r = self.rates.lock().expect("rates lock");
        if let Some(at) = r.at {
            let dt = now.duration_since(at).as_secs_f64().max(1e-3);
            let prev = r.totals;
            for ((rate, now), before) in r.per_sec.iter_mut().zip(totals).zip(prev) {
                *rate = now.saturating_sub(before) as f64 / dt;
            }
            let old = std::mem::take(&mut r.subs);
            for (name, out) in subs {
                let rate = old
                    .get(&name)
                    .map_or(0.0, |(prev, _)| out.saturating_sub(*prev) as f64 / dt);
                r.subs.insert(name, (out, rate));
            }
        } else {
            r.subs = subs.into_iter().map(|(n, o)| (n, (o, 0.0))).collect();
        }
        r.at = Some(now);
        r.totals = totals;
    }

    /// The topic's figures: rates from the last sample, backlog per subscription, storage.
    pub async fn stats(&self) -> TopicStats {
        let (storage_entries, storage_bytes) = self.ml.size().await;
        let mut subscriptions = Vec::new();
        for sub in self.subscriptions().await {
            subscriptions.push(sub.stats().await);
        }
        let r = self.rates.lock().expect("rates lock").clone();
        for s in &mut subscriptions {
            s.msg_rate_out = r.subs.get(&s.name).map_or(0.0, |(_, rate)| *rate);
        }
        subscriptions.sort_by(|a, b| a.name.cmp(&b.name));
        let mut synced = self.replicated_sub_stats().await;
        for s in &mut subscriptions {
            if let Some(sync) = synced.remove(&s.name) {
                s.replicated = true;
                s.sync = sync;
            }
        }
        TopicStats {
            topic: self.full_name.clone(),
            msg_rate_in: r.per_sec[0],
            msg_rate_out: r.per_sec[1],
            bytes_rate_in: r.per_sec[2],
            bytes_rate_out: r.per_sec[3],
            msgs_in_total: self.counters.msgs_in.load(Ordering::Relaxed),
            msgs_out_total: self.counters.msgs_out.load(Ordering::Relaxed),
            storage_entries,
            storage_bytes,
            producers: self.producer_count(),
            subscriptions,
            backlog_quota_exceeded: self.quota_breach().map(|b| b.detail),
            replication: self.replication_stats().await,
        }
    }
}

impl Broker {
    /// Publishes backlog and size gauges of every loaded topic every `interval`.
    pub async fn stats_loop(self: Arc<Self>, interval: Duration) {
        loop {
            tokio::time::sleep(interval).await;
            if self.is_closing() {
                return;
            }
            // Set every interval, so the exporter's idle timeout never drops it.
            metrics::gauge!("meridian_connections").set(self.connection_count() as f64);
            let dedup_idle_ms = self.cfg.dedup_producer_inactivity_s.saturating_mul(1000);
            let mut inactive = Vec::new();
            let mut ns_backlog: HashMap<(String, String), u64> = HashMap::new();
            for topic in self.loaded_topics() {
                if topic.idle_for_ms(now_ms()).await
                    >= self.cfg.inactive_topic_ttl_s.saturating_mul(1000)
                    && self.cfg.inactive_topic_ttl_s > 0
                    && !topic.replicates()
                {
                    inactive.push(Arc::clone(&topic));
                    continue;
                }
                topic.sample_rates().await;
                if let Some(d) = &topic.dedup {
                    d.expire(dedup_idle_ms, &|n| topic.producers.is_attached(n))
                        .await;
                }
                let (_, bytes) = topic.ml.size().await;
                metrics::gauge!("meridian_topic_storage_bytes", "topic" => topic.full_name.clone())
                    .set(bytes as f64);
                for r in topic.replication_stats().await {
                    let labels = [
                        ("topic", topic.full_name.clone()),
                        ("remote", r.remote.clone()),
                    ];
                    metrics::gauge!("meridian_replication_backlog_entries", &labels)
                        .set(r.backlog_entries as f64);
                    metrics::gauge!(
                        "meridian_replication_oldest_unreplicated_age_seconds",
                        &labels
                    )
                    .set(r.oldest_unreplicated_age_ms as f64 / 1000.0);
                    metrics::gauge!("meridian_replication_connected", &labels)
                        .set(if r.state == "connected" { 1.0 } else { 0.0 });
                    metrics::gauge!("meridian_replication_acked_entries", &labels)
                        .set(r.entries_acked as f64);
                    *ns_backlog
                        .entry((topic.name.namespace(), r.remote))
                        .or_insert(0) += r.backlog_entries;
                }
                for sub in topic.subscriptions().await {
                    let backlog = sub.backlog().await;
                    metrics::gauge!(
                        "meridian_subscription_backlog_entries",
                        "topic" => topic.full_name.clone(),
                        "subscription" => sub.name().to_string()
                    )
                    .set(backlog.entries as f64);
                }
                for (sub, remotes) in topic.replicated_sub_stats().await {
                    for y in remotes {
                        let labels = [
                            ("topic", topic.full_name.clone()),
                            ("subscription", sub.clone()),
                            ("remote", y.remote),
                        ];
                        metrics::gauge!("meridian_replicated_subscription_pending_acks", &labels)
                            .set(y.pending_acks as f64);
                        metrics::gauge!(
                            "meridian_replicated_subscription_pending_seconds",
                            &labels
                        )
                        .set(y.pending_ms as f64 / 1000.0);
                        metrics::gauge!("meridian_replicated_subscription_held", &labels)
                            .set(y.held as f64);
                    }
                }
            }
            for ((namespace, remote), backlog) in ns_backlog {
                metrics::gauge!(
                    "meridian_replication_namespace_backlog_entries",
                    "namespace" => namespace,
                    "remote" => remote
                )
                .set(backlog as f64);
            }
            for topic in inactive {
                self.retire_inactive(&topic).await;
            }
        }
    }
}
