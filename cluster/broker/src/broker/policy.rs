//! The policy loop: namespace and topic policies read and applied to loaded topics, message
//! TTL, retention, and retiring inactive topics.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use meridian_protocol::pb::ServerError;
use meridian_storage::managed_ledger::Position;

use super::{
    compaction, now_ms, Broker, BrokerError, NamespacePolicies, Subscription, Topic,
    NAMESPACES_PREFIX,
};
use crate::topic_name::TopicName;

impl Broker {
    /// A namespace's policies (defaults if it has no record or an empty one).
    pub async fn namespace_policies(
        &self,
        namespace: &str,
    ) -> Result<NamespacePolicies, BrokerError> {
        let Some(kv) = self
            .meta
            .get(&format!("{NAMESPACES_PREFIX}{namespace}"))
            .await?
        else {
            return Ok(NamespacePolicies::default());
        };
        serde_json::from_slice(&kv.value).map_err(|e| {
            BrokerError::new(
                ServerError::MetadataError,
                format!("policies of namespace {namespace} are damaged: {e}"),
            )
        })
    }

    /// The record of a topic's own policies: a partition's are its partitioned topic's (only
    /// when that exists: a plain topic may be named `x-partition-0` too).
    pub(super) async fn own_policies_key(&self, name: &TopicName) -> Result<String, BrokerError> {
        Ok(match name.parent() {
            Some(p) if self.partitions_of(&p).await?.is_some() => Self::topic_policies_key(&p),
            _ => Self::topic_policies_key(name),
        })
    }

    /// A topic's own policies (a partition's are its partitioned topic's); empty if none.
    pub async fn topic_own_policies(&self, key: &str) -> Result<NamespacePolicies, BrokerError> {
        let Some(kv) = self.meta.get(key).await? else {
            return Ok(NamespacePolicies::default());
        };
        serde_json::from_slice(&kv.value).map_err(|e| {
            BrokerError::new(
                ServerError::MetadataError,
                format!("topic policies {key} are damaged: {e}"),
            )
        })
    }

    pub(super) fn topic_policies_key(name: &TopicName) -> String {
        meridian_tenancy::model::topic_policies_key(&name.tenant, &name.namespace, &name.local)
    }

    /// The topic policies recorded in a namespace, by record key (one listing).
    pub(super) async fn namespace_topic_policies(
        &self,
        namespace: &str,
    ) -> Result<HashMap<String, NamespacePolicies>, BrokerError> {
        let prefix = format!(
            "{}{namespace}/",
            meridian_tenancy::model::TOPIC_POLICIES_PREFIX
        );
        let mut out = HashMap::new();
        let mut after = String::new();
        loop {
            let page = self.meta.list(&prefix, &after, 0).await?;
            for kv in &page.kvs {
                match serde_json::from_slice(&kv.value) {
                    Ok(p) => {
                        out.insert(kv.key.clone(), p);
                    }
                    Err(e) => {
                        tracing::warn!(key = %kv.key, error = %e, "damaged topic policies ignored")
                    }
                }
            }
            match page.kvs.last() {
                Some(last) if page.more => after = last.key.clone(),
                _ => return Ok(out),
            }
        }
    }

    /// Every `broker.policy_refresh_interval_ms`: re-reads the policies of the namespaces of
    /// loaded topics (an admin change takes effect within one interval; deduplication on or
    /// off applies when a topic is next loaded) and applies message TTLs: on every durable
    /// subscription, what was published more than the TTL ago is acknowledged.
    pub async fn policy_loop(self: Arc<Self>) {
        tokio::spawn(Broker::watch_drill_cuts(Arc::downgrade(&self)));
        let every = Duration::from_millis(self.cfg.policy_refresh_interval_ms);
        let expired = metrics::counter!("meridian_ttl_expired_entries_total");
        let mut next_beat = tokio::time::Instant::now() + every;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(next_beat) => {}
                _ = self.quota_wake.notified() => {
                    self.check_requested_quotas().await;
                    // At most one such check per topic every 10 ms.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            }
            next_beat = tokio::time::Instant::now() + every;
            if self.is_closing() {
                return;
            }
            self.refresh_drill_cuts().await;
            let mut by_ns: HashMap<String, Vec<Arc<Topic>>> = HashMap::new();
            for t in self.loaded_topics() {
                by_ns.entry(t.name.namespace()).or_default().push(t);
            }
            for (ns, topics) in by_ns {
                let p = match self.namespace_policies(&ns).await {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(namespace = %ns, error = %e, "reading policies failed");
                        continue;
                    }
                };
                let own = match self.namespace_topic_policies(&ns).await {
                    Ok(o) => o,
                    Err(e) => {
                        tracing::warn!(namespace = %ns, error = %e, "reading topic policies failed");
                        continue;
                    }
                };
                let ns_policies = p;
                for t in topics {
                    // Resolution: the topic's own, else the namespace's, else the broker's.
                    let p = match own.get(&t.policies_key) {
                        Some(o) => ns_policies.overlaid(o),
                        None => ns_policies.clone(),
                    };
                    let ttl_ms = u64::from(p.message_ttl_seconds.unwrap_or(0)) * 1000;
                    t.set_policies(p.clone()).await;
                    t.flush_origins().await;
                    let threshold = p
                        .compaction_threshold
                        .unwrap_or(self.cfg.compaction_threshold_bytes);
                    if threshold > 0 {
                        if let Err(e) = compaction::check_threshold(&t, threshold).await {
                            tracing::warn!(topic = %t.full_name, error = %e, "checking the compaction threshold failed");
                        }
                    }
                    if p.backlog_quota.is_none() {
                        t.set_quota_breach(None);
                    }
                    t.check_replication_quota(p.replication_backlog_quota.as_ref())
                        .await;
                    t.check_replication_lag(p.max_replication_lag.as_ref())
                        .await;
                    if ttl_ms == 0 && p.backlog_quota.is_none() && p.retention.is_none() {
                        continue;
                    }
                    // One listing of the subscriptions serves the three; TTL first (it moves
                    // subscriptions forward), then the quota, then what became trimmable.
                    let subs = match t.durable_subscription_handles().await {
                        Ok(s) => s,
                        Err(e) => {
                            tracing::warn!(topic = %t.full_name, error = %e, "opening subscriptions failed");
                            continue;
                        }
                    };
                    if ttl_ms > 0 {
                        let cutoff = now_ms().saturating_sub(ttl_ms);
                        expired.increment(t.expire_all_before(&subs, cutoff).await);
                    }
                    if let Some(q) = &p.backlog_quota {
                        t.check_backlog_quota(&subs, q).await;
                    }
                    if let Some(r) = &p.retention {
                        t.trim_consumed(&subs, r).await;
                    }
                }
            }
            self.check_storage_quotas().await;
        }
    }

    /// An inactive topic (no producer or consumer for `broker.inactive_topic_ttl_s`): deleted
    /// if `broker.inactive_topic_delete_mode` says so and allows it now, else unloaded.
    pub(super) async fn retire_inactive(&self, topic: &Arc<Topic>) {
        let p = topic.policies();
        if p.message_ttl_seconds.unwrap_or(0) > 0 || p.retention.is_some() {
            // Message TTL and retention act on loaded topics (the policy loop): such a
            // topic stays loaded so that they keep acting on it.
            return;
        }
        let mode = self.cfg.inactive_topic_delete_mode.as_str();
        let delete = match mode {
            _ if topic.name.partition().is_some() => false,
            "delete_when_no_subscriptions" => {
                topic.subscriptions().await.iter().all(|s| !s.is_durable())
            }
            "delete_when_subscriptions_caught_up" => {
                let mut caught_up = true;
                for s in topic.subscriptions().await {
                    if s.is_durable() && s.backlog().await.entries > 0 {
                        caught_up = false;
                    }
                }
                caught_up
            }
            _ => false,
        };
        let r = if delete {
            self.delete_topic(&topic.name, false, false)
                .await
                .map(|_| "deleted")
        } else {
            self.unload_topic(&topic.name).await.map(|_| "unloaded")
        };
        match r {
            Ok(what) => {
                tracing::info!(topic = %topic.full_name, ttl_s = self.cfg.inactive_topic_ttl_s, mode, "inactive topic {what}")
            }
            // A client came back meanwhile (delete refuses with clients), or storage failed:
            // tried again later.
            Err(e) => {
                tracing::debug!(topic = %topic.full_name, error = %e, "inactive topic kept")
            }
        }
    }
}

impl Topic {
    /// Deletes the ledgers every durable subscription has consumed, except what `retention`
    /// keeps (-1: no limit). Without a retention policy nothing is deleted.
    pub async fn trim_consumed(
        &self,
        subs: &[Arc<Subscription>],
        retention: &meridian_tenancy::model::Retention,
    ) {
        if retention.time_minutes == -1 && retention.size_mb == -1 {
            return; // keeps everything
        }
        let Some(last) = self.ml.last_confirmed() else {
            return;
        };
        // The first entry some subscription (or replicator) still needs; past the end if none
        // does.
        let mut keep_from = Position::new(last.ledger_id, last.entry_id.saturating_add(1));
        for mark in self.replicator_marks() {
            let needed = match mark {
                Some(md) => self.ml.next_position(md).await.unwrap_or(keep_from),
                None => match self.ml.first_position().await {
                    Some(p) => p,
                    None => return,
                },
            };
            keep_from = keep_from.min(needed);
        }
        for sub in subs {
            let needed = match sub.mark_delete().await {
                Some(md) => self.ml.next_position(md).await.unwrap_or(keep_from),
                None => match self.ml.first_position().await {
                    Some(p) => p,
                    None => return,
                },
            };
            keep_from = keep_from.min(needed);
        }
        // -1: no limit by that rule (None); 0 or more: the limit.
        let ms = (retention.time_minutes >= 0).then(|| retention.time_minutes as u64 * 60_000);
        let bytes = (retention.size_mb >= 0).then_some((retention.size_mb as u64) << 20);
        match self.ml.trim_retaining(keep_from, ms, bytes).await {
            Ok(d) if !d.is_empty() => {
                tracing::info!(topic = %self.full_name, ledgers = ?d, "consumed ledgers deleted (retention)")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(topic = %self.full_name, error = %e, "trimming failed"),
        }
    }
}
