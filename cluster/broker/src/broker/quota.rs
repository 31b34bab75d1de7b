//! Quotas that stop producers: a topic's backlog quota (checked on the policy beat and by the
//! append that uses up its headroom) and a tenant's storage quota.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use meridian_protocol::pb::ServerError;

use super::{now_ms, Broker, BrokerError, Subscription, Topic};

/// A passed backlog quota whose policy stops producers.
#[derive(Debug, Clone)]
pub struct QuotaBreach {
    /// producer_exception (else producer_request_hold).
    pub exception: bool,
    /// Which quota: "backlog quota" or "tenant storage quota".
    pub quota: &'static str,
    /// Names what passes it: the subscription that pins the backlog, or the tenant's usage.
    pub detail: String,
}

impl QuotaBreach {
    pub fn error(&self) -> BrokerError {
        let code = if self.exception {
            ServerError::ProducerBlockedQuotaExceededException
        } else {
            ServerError::ProducerBlockedQuotaExceededError
        };
        BrokerError::new(code, format!("{} exceeded: {}", self.quota, self.detail))
    }
}

impl Topic {
    /// The quota that stops producers now, if one does: the backlog quota's, else the
    /// replication backlog quota's, else the tenant's storage quota's.
    pub fn quota_breach(&self) -> Option<QuotaBreach> {
        self.quota_breach
            .lock()
            .expect("quota lock")
            .clone()
            .or_else(|| self.repl_breach.lock().expect("quota lock").clone())
            .or_else(|| self.rpo_breach.lock().expect("quota lock").clone())
            .or_else(|| self.storage_breach.lock().expect("quota lock").clone())
    }

    /// Sets or clears the tenant storage quota's breach; producers are closed when it starts.
    pub fn set_storage_breach(&self, breach: Option<QuotaBreach>) {
        self.set_breach(&self.storage_breach, breach);
    }

    /// Sets or clears a quota's breach (`slot`); the topic's producers are closed when one
    /// starts.
    pub(super) fn set_breach(
        &self,
        slot: &Mutex<Option<QuotaBreach>>,
        breach: Option<QuotaBreach>,
    ) {
        let started = {
            let mut g = slot.lock().expect("quota lock");
            match (g.as_ref(), breach.as_ref()) {
                (Some(old), None) => {
                    tracing::info!(topic = %self.full_name, quota = old.quota, "back within the quota");
                }
                (None, Some(new)) => {
                    tracing::info!(topic = %self.full_name, quota = new.quota, detail = %new.detail, "quota exceeded: producers closed");
                }
                _ => {}
            }
            let started = g.is_none() && breach.is_some();
            *g = breach;
            started
        };
        if started {
            self.producers.fence_all();
        }
    }

    pub(super) fn set_quota_breach(&self, breach: Option<QuotaBreach>) {
        self.set_breach(&self.quota_breach, breach);
    }

    /// Checks the backlog quota against every durable subscription and acts on its policy:
    /// eviction moves the subscriptions that pass it forward; the producer policies close the
    /// topic's producers and refuse new ones until the backlog is back within the quota.
    pub async fn check_backlog_quota(
        &self,
        subs: &[Arc<Subscription>],
        q: &meridian_tenancy::model::BacklogQuota,
    ) {
        let now = now_ms();
        let mut worst: Option<String> = None;
        let mut largest = 0u64;
        // The compaction's own subscription is moved by compaction runs, not by quotas.
        for sub in subs.iter().filter(|s| !s.is_compaction()) {
            let name = sub.name();
            let backlog = sub.backlog().await;
            largest = largest.max(backlog.bytes);
            let size_over = q.limit_size_bytes > 0 && backlog.bytes > q.limit_size_bytes;
            let age_limit_ms = q.limit_time_seconds.saturating_mul(1000);
            let oldest = if q.limit_time_seconds > 0 {
                sub.oldest_unacked_publish_time().await
            } else {
                None
            };
            let time_over = oldest.is_some_and(|t| t + age_limit_ms < now);
            if !(size_over || time_over) {
                continue;
            }
            if q.policy == "consumer_backlog_eviction" {
                let r = async {
                    let mut n = 0;
                    if time_over {
                        n += sub
                            .expire_before(now.saturating_sub(age_limit_ms), false)
                            .await?;
                    }
                    if size_over {
                        n += sub.evict_to_bytes(q.limit_size_bytes).await?;
                    }
                    Ok::<u64, BrokerError>(n)
                }
                .await;
                match r {
                    Ok(n) => {
                        metrics::counter!("meridian_backlog_evicted_entries_total").increment(n);
                        tracing::info!(topic = %self.full_name, subscription = %name, entries = n, "backlog quota: evicted");
                    }
                    Err(e) => {
                        tracing::warn!(topic = %self.full_name, subscription = %name, error = %e, "backlog eviction failed")
                    }
                }
                continue;
            }
            let detail = if size_over {
                format!(
                    "subscription {name} holds {} bytes of backlog (limit {})",
                    backlog.bytes, q.limit_size_bytes
                )
            } else {
                format!(
                    "subscription {name} holds a message {} s old (limit {} s)",
                    (now - oldest.unwrap_or(now)) / 1000,
                    q.limit_time_seconds
                )
            };
            worst.get_or_insert(detail);
        }
        let headroom = if q.limit_size_bytes > 0 {
            i64::try_from(q.limit_size_bytes.saturating_sub(largest)).unwrap_or(i64::MAX - 1)
        } else {
            i64::MAX
        };
        self.quota_headroom.store(headroom, Ordering::Relaxed);
        let breach = worst.map(|detail| QuotaBreach {
            exception: q.policy == "producer_exception",
            quota: "backlog quota",
            detail,
        });
        self.set_quota_breach(breach);
    }
}

impl Broker {
    /// Asks the policy loop to check a topic's backlog quota now (an append may have passed
    /// it).
    pub fn request_quota_check(&self, topic: &str) {
        let new = self
            .quota_checks
            .lock()
            .expect("quota checks lock")
            .insert(topic.to_string());
        if new {
            self.quota_wake.notify_one();
        }
    }

    /// Checks the backlog quotas of the topics appends asked for, with the policies they hold.
    pub(super) async fn check_requested_quotas(&self) {
        let names: Vec<String> = self
            .quota_checks
            .lock()
            .expect("quota checks lock")
            .drain()
            .collect();
        for name in names {
            let loaded = {
                let topics = self.topics.lock().expect("topics lock");
                topics.get(&name).and_then(|c| c.get().cloned())
            };
            let Some(t) = loaded else { continue };
            let Some(q) = t
                .policies
                .lock()
                .expect("policies lock")
                .backlog_quota
                .clone()
            else {
                continue;
            };
            match t.durable_subscription_handles().await {
                Ok(subs) => t.check_backlog_quota(&subs, &q).await,
                Err(e) => {
                    tracing::warn!(topic = %name, error = %e, "opening subscriptions failed")
                }
            }
        }
    }

    /// The tenants' storage quotas: for each tenant of a loaded topic that has one, the bytes
    /// all its topics store (loaded topics' logs as this broker knows them, the others' as
    /// their records say) against the quota; past it, every loaded topic of the tenant refuses
    /// producers (ProducerBlockedQuotaExceededException) until it is back within.
    pub(super) async fn check_storage_quotas(&self) {
        let mut by_tenant: HashMap<String, Vec<Arc<Topic>>> = HashMap::new();
        for t in self.loaded_topics() {
            by_tenant.entry(t.name.tenant.clone()).or_default().push(t);
        }
        let store = meridian_tenancy::TenancyStore::new(self.meta.clone());
        for (tenant, topics) in by_tenant {
            let quota = match store.tenant(&tenant).await {
                Ok(t) => t.storage_quota_bytes,
                Err(meridian_tenancy::AdminError::NotFound(_)) => None,
                Err(e) => {
                    // Not known now: the breach (or its absence) stands until the next beat.
                    tracing::warn!(tenant = %tenant, error = %e, "reading the tenant failed");
                    continue;
                }
            };
            let Some(quota) = quota else {
                self.storage_breaches
                    .lock()
                    .expect("breaches lock")
                    .remove(&tenant);
                for t in &topics {
                    t.set_storage_breach(None);
                }
                continue;
            };
            let used = match self.tenant_storage_bytes(&tenant, &topics).await {
                Ok(u) => u,
                Err(e) => {
                    tracing::warn!(tenant = %tenant, error = %e, "measuring the tenant's storage failed");
                    continue;
                }
            };
            metrics::gauge!("meridian_tenant_storage_bytes", "tenant" => tenant.clone())
                .set(used as f64);
            let breach = (used > quota).then(|| QuotaBreach {
                exception: true,
                quota: "tenant storage quota",
                detail: format!("tenant {tenant} stores {used} bytes (quota {quota} bytes)"),
            });
            // Topics loaded before the next beat start with it.
            {
                let mut b = self.storage_breaches.lock().expect("breaches lock");
                match &breach {
                    Some(x) => b.insert(tenant.clone(), x.clone()),
                    None => b.remove(&tenant),
                };
            }
            for t in &topics {
                t.set_storage_breach(breach.clone());
            }
        }
    }

    /// Bytes stored by all of a tenant's topics.
    pub(super) async fn tenant_storage_bytes(
        &self,
        tenant: &str,
        loaded: &[Arc<Topic>],
    ) -> Result<u64, BrokerError> {
        let mut by_log: HashMap<&str, &Arc<Topic>> =
            loaded.iter().map(|t| (t.ml.name(), t)).collect();
        let prefix = format!(
            "{}{tenant}/",
            meridian_storage::managed_ledger::MANAGED_LEDGERS_PREFIX
        );
        let mut used = 0u64;
        let mut after = String::new();
        loop {
            let page = self.meta.list(&prefix, &after, 0).await?;
            for kv in &page.kvs {
                let log = &kv.key[meridian_storage::managed_ledger::MANAGED_LEDGERS_PREFIX.len()..];
                if let Some(t) = by_log.remove(log) {
                    used += t.ml.size().await.1;
                } else if let Ok(m) =
                    meridian_storage::managed_ledger::ManagedLedgerMetadata::decode(&kv.value)
                {
                    // `decode` checked that the sum fits.
                    used = used.saturating_add(m.ledgers.iter().map(|l| l.bytes).sum::<u64>());
                }
            }
            match page.kvs.last() {
                Some(last) if page.more => after = last.key.clone(),
                _ => break,
            }
        }
        for t in by_log.values() {
            used += t.ml.size().await.1;
        }
        Ok(used)
    }
}
