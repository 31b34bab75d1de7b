//! The broker's state: topics (each a managed ledger), their producers and subscriptions.
//!
//! ```text
//!  Broker ── topics: name ─► Topic ── ManagedLedger (the log)
//!                               ├── producers (names, access modes, topic epoch)
//!                               ├── subscriptions: name ─► Subscription ── ManagedCursor
//!                               │                                └── dispatcher task ─► consumers' connections
//!                               └── appended: watch<last position> ─► wakes the dispatchers
//! ```
//!
//! Connections ([`crate::connection`]) decode frames and call in here; nothing in this module
//! knows about sockets.

pub mod avro;
pub mod bundle_split;
pub mod bundles;
pub mod compaction;
pub mod dedup;
pub mod key_shared;
pub mod load_manager;
pub mod lookup;
pub mod ownership;
pub mod partitioned;
pub mod producers;
pub mod rate;
pub mod schema;
pub mod subscription;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use meridian_config::BrokerConfig;
use meridian_metadata::MetadataClient;
use meridian_protocol::pb::ServerError;
use meridian_storage::cursor::CursorError;
use meridian_storage::ledger::LedgerClient;
use meridian_storage::managed_ledger::{
    managed_ledger_key, ManagedLedger, ManagedLedgerError, ManagedLedgerOptions, Position,
};
use tokio::sync::{watch, OnceCell};

use crate::topic_name::{Domain, TopicName, TopicNameError};
pub use subscription::{ConsumerSink, SubType, SubscribeRequest, Subscription, SubscriptionStats};

/// Where topic epochs (raised by each grant of exclusive producer access) are kept.
pub const TOPIC_EPOCHS_PREFIX: &str = "/topic-epochs/";

/// Where namespaces are recorded (the tenancy crate owns the records).
pub use meridian_tenancy::model::NAMESPACES_PREFIX;

/// A namespace's record: its policies (the tenancy crate owns the model).
pub use meridian_tenancy::NamespacePolicies;

/// A failure that a client sees as a `ServerError` and a message.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct BrokerError {
    pub code: ServerError,
    pub message: String,
}

impl BrokerError {
    pub fn new(code: ServerError, message: impl Into<String>) -> Self {
        BrokerError {
            code,
            message: message.into(),
        }
    }
}

impl From<TopicNameError> for BrokerError {
    fn from(e: TopicNameError) -> Self {
        BrokerError::new(ServerError::InvalidTopicName, e.to_string())
    }
}

impl From<ManagedLedgerError> for BrokerError {
    fn from(e: ManagedLedgerError) -> Self {
        let code = match &e {
            ManagedLedgerError::Fenced { .. } => ServerError::ServiceNotReady,
            ManagedLedgerError::Terminated { .. } => ServerError::TopicTerminatedError,
            _ => ServerError::PersistenceError,
        };
        BrokerError::new(code, e.to_string())
    }
}

impl From<CursorError> for BrokerError {
    fn from(e: CursorError) -> Self {
        let code = match &e {
            CursorError::Fenced(_) => ServerError::ServiceNotReady,
            CursorError::BadName(_) => ServerError::NotAllowedError,
            _ => ServerError::PersistenceError,
        };
        BrokerError::new(code, e.to_string())
    }
}

impl From<meridian_metadata::client::ClientError> for BrokerError {
    fn from(e: meridian_metadata::client::ClientError) -> Self {
        BrokerError::new(ServerError::MetadataError, e.to_string())
    }
}

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
}

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

/// The last sample of a topic's counters and the rates computed from it.
#[derive(Debug, Default, Clone)]
struct Rates {
    at: Option<std::time::Instant>,
    totals: [u64; 4],
    per_sec: [f64; 4],
    subs: HashMap<String, (u64, f64)>,
}

/// A topic this broker owns.
pub struct Topic {
    pub name: TopicName,
    full_name: String,
    pub ml: Arc<ManagedLedger>,
    client: LedgerClient,
    cfg: Arc<BrokerConfig>,
    meta: MetadataClient,
    pub producers: producers::Producers,
    subscriptions: tokio::sync::Mutex<HashMap<String, Arc<Subscription>>>,
    appended: watch::Sender<Option<Position>>,
    pub counters: TopicCounters,
    rates: Mutex<Rates>,
    /// Present when the topic deduplicates sends.
    pub dedup: Option<Arc<dedup::Dedup>>,
    /// The namespace's policies, refreshed by the broker's policy loop.
    policies: Mutex<NamespacePolicies>,
    /// The record of the topic's own policies (its partitioned topic's, for a partition).
    policies_key: String,
    /// The broker, for what a topic does to other topics (dead-lettering).
    pub broker: std::sync::Weak<Broker>,
    /// Terminated: no more messages (mirrors the log's record, for cheap checks).
    pub terminated: AtomicBool,
    /// Since when (ms since the epoch) no producer or consumer is attached; 0 while one is
    /// (sampled every stats interval, for `broker.inactive_topic_ttl_s`).
    idle_since_ms: AtomicU64,
    /// Set while a backlog quota with a producer policy is passed.
    quota_breach: Mutex<Option<QuotaBreach>>,
    /// Set while the tenant stores more than its storage quota.
    storage_breach: Mutex<Option<QuotaBreach>>,
    /// Bytes that may be appended before the backlog quota's size limit may be passed (the
    /// limit less the largest backlog at the last check; `i64::MAX` without a size limit).
    /// The append that uses it up asks for a check at once: the quota is checked on the
    /// write path, not only on the policy beat.
    quota_headroom: AtomicI64,
    /// The publish rate policy: sends past it wait (the connection is not read meanwhile).
    pub publish_limiter: rate::PolicyLimiter,
    /// The topic's dispatch rate policy, its subscriptions together.
    pub dispatch_limiter: rate::PolicyLimiter,
    /// The namespace's totals (`publish_rate_total`, `dispatch_rate_total`), shared by all
    /// its topics on this broker.
    pub ns_limiters: Arc<NamespaceLimiters>,
    /// The compacted view and the state of compaction runs.
    pub compaction: compaction::Compaction,
}

/// Rate limits over all of a namespace's topics on this broker.
#[derive(Debug, Default)]
pub struct NamespaceLimiters {
    pub publish: rate::PolicyLimiter,
    pub dispatch: rate::PolicyLimiter,
}

impl Topic {
    pub fn full_name(&self) -> &str {
        &self.full_name
    }

    /// Attaches a producer in its access mode; generates a name unless one is given. A given
    /// name already connected is refused with ProducerBusy. A raised topic epoch is recorded
    /// before the producer is answered, so fencing holds across restarts.
    pub async fn add_producer(
        &self,
        given: Option<&str>,
        generated: impl FnOnce() -> String,
        mode: producers::AccessMode,
        requested_epoch: Option<u64>,
        sink: producers::ProducerSink,
    ) -> Result<producers::Admission, BrokerError> {
        let name = given.map_or_else(generated, str::to_string);
        let before = self.producers.epoch();
        let a = self.producers.add(
            name,
            mode,
            requested_epoch,
            sink,
            &self.full_name,
            self.policies().max_producers_per_topic.unwrap_or(0) as usize,
        )?;
        let after = self.producers.epoch();
        if after != before {
            self.record_epoch(after).await;
        }
        Ok(a)
    }

    /// Detaches a producer; a waiting exclusive producer may be granted the topic.
    pub fn remove_producer(self: &Arc<Self>, handle: &Arc<producers::ProducerHandle>) {
        if let Some(epoch) = self.producers.remove(handle) {
            let topic = Arc::clone(self);
            tokio::spawn(async move { topic.record_epoch(epoch).await });
        }
    }

    pub fn producer_count(&self) -> usize {
        self.producers.count()
    }

    async fn record_epoch(&self, epoch: u64) {
        let key = format!("{TOPIC_EPOCHS_PREFIX}{}", self.ml.name());
        if let Err(e) = self.meta.put(&key, epoch.to_string()).await {
            tracing::warn!(topic = %self.full_name, epoch, error = %e, "recording the topic epoch failed");
        }
    }

    /// Called once an entry is durable: counts it and wakes the dispatchers.
    pub fn on_appended(&self, pos: Position, messages: u64, bytes: u64) {
        self.counters.msgs_in.fetch_add(messages, Ordering::Relaxed);
        self.counters.bytes_in.fetch_add(bytes, Ordering::Relaxed);
        let b = i64::try_from(bytes).unwrap_or(i64::MAX);
        let before = self.quota_headroom.fetch_sub(b, Ordering::Relaxed);
        if before >= 0 && before < b && before != i64::MAX {
            // This append may have passed the backlog quota: check the topic now.
            if let Some(broker) = self.broker.upgrade() {
                broker.request_quota_check(&self.full_name);
            }
        }
        self.appended.send_if_modified(|last| {
            if last.is_none_or(|l| pos > l) {
                *last = Some(pos);
                true
            } else {
                false
            }
        });
    }

    /// Attaches a consumer, creating the subscription (and its durable cursor) if needed.
    pub async fn subscribe(
        self: &Arc<Self>,
        req: SubscribeRequest,
        sink: ConsumerSink,
    ) -> Result<Arc<Subscription>, BrokerError> {
        if req.subscription == compaction::COMPACTION_SUBSCRIPTION {
            return Err(BrokerError::new(
                ServerError::NotAllowedError,
                format!(
                    "{} is the broker's own subscription (topic compaction); choose another name",
                    compaction::COMPACTION_SUBSCRIPTION
                ),
            ));
        }
        if req.read_compacted && matches!(req.sub_type, SubType::Shared | SubType::KeyShared) {
            return Err(BrokerError::new(
                ServerError::NotAllowedError,
                format!(
                    "read_compacted is only allowed on Exclusive and Failover subscriptions; {} is {:?}",
                    req.subscription, req.sub_type
                ),
            ));
        }
        let mut subs = self.subscriptions.lock().await;
        let limits = self.policies();
        if let Some(max) = limits.max_consumers_per_topic.filter(|m| *m > 0) {
            let mut n = 0;
            for s in subs.values() {
                n += s.consumer_count().await;
            }
            if n >= max as usize {
                return Err(BrokerError::new(
                    ServerError::ConsumerBusy,
                    format!(
                        "{} has reached its limit of {max} consumers (max_consumers_per_topic)",
                        self.full_name
                    ),
                ));
            }
        }
        if let Some(max) = limits.max_subscriptions_per_topic.filter(|m| *m > 0) {
            if !subs.contains_key(&req.subscription) {
                let mut names: std::collections::BTreeSet<String> =
                    self.durable_subscriptions().await?.into_iter().collect();
                names.extend(subs.keys().cloned());
                if !names.contains(&req.subscription) && names.len() >= max as usize {
                    return Err(BrokerError::new(
                        ServerError::NotAllowedError,
                        format!(
                            "{} has reached its limit of {max} subscriptions (max_subscriptions_per_topic)",
                            self.full_name
                        ),
                    ));
                }
            }
        }
        if let Some(sub) = subs.get(&req.subscription) {
            let sub = Arc::clone(sub);
            // Opened without consumers (by the admin API, or as a dead-letter topic's) under
            // another type: reopened under the type its first consumer asks for.
            let retype = (sub.sub_type() != req.sub_type
                || sub.reads_compacted() != req.read_compacted)
                && sub.consumer_count().await == 0;
            if !sub.is_closed() && !retype {
                sub.add_consumer(&req, sink).await?;
                return Ok(sub);
            }
            if retype {
                sub.close().await;
            }
            subs.remove(&req.subscription);
        }
        let sub = Subscription::open(
            Arc::clone(self),
            &req,
            self.client.clone(),
            self.appended.subscribe(),
        )
        .await?;
        sub.add_consumer(&req, sink).await?;
        subs.insert(req.subscription.clone(), Arc::clone(&sub));
        Ok(sub)
    }

    /// Creates a durable subscription with no consumer, from the earliest entry, unless it
    /// exists (the subscription a dead-letter topic is created with).
    pub async fn create_subscription(self: &Arc<Self>, name: &str) -> Result<(), BrokerError> {
        let mut subs = self.subscriptions.lock().await;
        if subs.get(name).is_some_and(|s| !s.is_closed()) {
            return Ok(());
        }
        let req = SubscribeRequest {
            subscription: name.to_string(),
            sub_type: SubType::Shared,
            consumer_name: String::new(),
            priority: 0,
            durable: true,
            start: subscription::StartAt::Initial(
                meridian_storage::cursor::InitialPosition::Earliest,
            ),
            key_shared: None,
            properties: Default::default(),
            read_compacted: false,
        };
        let sub = Subscription::open(
            Arc::clone(self),
            &req,
            self.client.clone(),
            self.appended.subscribe(),
        )
        .await?;
        subs.insert(name.to_string(), sub);
        Ok(())
    }

    /// A durable subscription for the admin API: the open one, or its cursor opened (without
    /// consumers); NotFound if the subscription does not exist.
    pub async fn subscription_for_admin(
        self: &Arc<Self>,
        name: &str,
    ) -> Result<Arc<Subscription>, BrokerError> {
        if let Some(s) = self
            .subscriptions
            .lock()
            .await
            .get(name)
            .filter(|s| !s.is_closed())
        {
            return Ok(Arc::clone(s));
        }
        if !self
            .durable_subscriptions()
            .await?
            .iter()
            .any(|s| s == name)
        {
            return Err(BrokerError::new(
                ServerError::SubscriptionNotFound,
                format!("{} has no subscription {name:?}", self.full_name),
            ));
        }
        self.create_subscription(name).await?;
        self.subscriptions
            .lock()
            .await
            .get(name)
            .cloned()
            .ok_or_else(|| {
                BrokerError::new(
                    ServerError::ServiceNotReady,
                    "subscription closed meanwhile",
                )
            })
    }

    /// The names of the topic's durable subscriptions (open or not).
    pub async fn durable_subscriptions(&self) -> Result<Vec<String>, BrokerError> {
        let prefix = format!(
            "{}{}/",
            meridian_storage::cursor::MANAGED_CURSORS_PREFIX,
            self.ml.name()
        );
        let mut out = Vec::new();
        let mut after = String::new();
        loop {
            let page = self.meta.children(&prefix, &after, 0).await?;
            for c in &page.children {
                out.push(crate::topic_name::unescape(c));
            }
            match page.children.last() {
                Some(last) if page.more => after = last.clone(),
                _ => return Ok(out),
            }
        }
    }

    /// Every durable subscription, opened (without consumers) where it is not. One listing of
    /// the topic's cursors; fails if any cannot be opened (callers then do nothing).
    pub async fn durable_subscription_handles(
        self: &Arc<Self>,
    ) -> Result<Vec<Arc<Subscription>>, BrokerError> {
        let mut out = Vec::new();
        for name in self.durable_subscriptions().await? {
            out.push(self.subscription_for_admin(&name).await?);
        }
        Ok(out)
    }

    /// Acknowledges, on every durable subscription, what was published before `cutoff_ms`
    /// (message TTL). Returns the entries acknowledged.
    pub async fn expire_all_before(&self, subs: &[Arc<Subscription>], cutoff_ms: u64) -> u64 {
        let mut total = 0;
        // Not the compaction's subscription: what it has not compacted yet is not expired.
        for sub in subs.iter().filter(|s| !s.is_compaction()) {
            match sub.expire_before(cutoff_ms, false).await {
                Ok(n) => total += n,
                Err(e) => {
                    tracing::warn!(topic = %self.full_name, subscription = %sub.name(), error = %e, "TTL expiry failed")
                }
            }
        }
        total
    }

    /// Forgets a subscription that has ended (unsubscribed, or a reader whose consumer left).
    pub async fn drop_subscription(&self, name: &str, sub: &Arc<Subscription>) {
        let mut subs = self.subscriptions.lock().await;
        if subs.get(name).is_some_and(|s| Arc::ptr_eq(s, sub)) {
            subs.remove(name);
        }
    }

    pub async fn subscriptions(&self) -> Vec<Arc<Subscription>> {
        self.subscriptions.lock().await.values().cloned().collect()
    }

    /// The last message's id: entry and, for a batch, the index of its last message. `None`
    /// for an empty topic.
    pub async fn last_message_id(&self) -> Option<(Position, i32)> {
        let pos = self.ml.last_confirmed()?;
        let batch_index = match self.ml.read(pos).await {
            Ok(b) => meridian_protocol::Entry::parse(b)
                .ok()
                .and_then(|e| e.metadata().ok())
                .and_then(|m| m.num_messages_in_batch)
                .map_or(-1, |n| n.max(1) - 1),
            Err(_) => -1,
        };
        Some((pos, batch_index))
    }

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
        }
    }

    /// The passed backlog quota that stops producers, if any.
    /// The quota that stops producers now, if one does: the backlog quota's, else the
    /// tenant's storage quota's.
    pub fn quota_breach(&self) -> Option<QuotaBreach> {
        self.quota_breach
            .lock()
            .expect("quota lock")
            .clone()
            .or_else(|| self.storage_breach.lock().expect("quota lock").clone())
    }

    /// Sets or clears the tenant storage quota's breach; producers are closed when it starts.
    pub fn set_storage_breach(&self, breach: Option<QuotaBreach>) {
        self.set_breach(&self.storage_breach, breach);
    }

    /// Sets or clears a quota's breach (`slot`); the topic's producers are closed when one
    /// starts.
    fn set_breach(&self, slot: &Mutex<Option<QuotaBreach>>, breach: Option<QuotaBreach>) {
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
        // The first entry some subscription still needs; past the end if none does.
        let mut keep_from = Position::new(last.ledger_id, last.entry_id.saturating_add(1));
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

    fn set_quota_breach(&self, breach: Option<QuotaBreach>) {
        self.set_breach(&self.quota_breach, breach);
    }

    /// The dead-letter policy's redelivery limit (read on every dispatch: no clone of the
    /// policies).
    pub fn dead_letter_max_redeliveries(&self) -> Option<u32> {
        self.policies
            .lock()
            .expect("policies lock")
            .dead_letter_max_redeliveries
    }

    /// Sets the policies (as last read) and the rate limits that follow them, for the topic
    /// and its open subscriptions.
    pub async fn set_policies(&self, p: NamespacePolicies) {
        match p.backlog_quota.as_ref().map(|q| q.limit_size_bytes) {
            // A size limit not checked yet: the next append asks for a check.
            Some(l) if l > 0 => {
                let _ = self.quota_headroom.compare_exchange(
                    i64::MAX,
                    0,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
            _ => self.quota_headroom.store(i64::MAX, Ordering::Relaxed),
        }
        self.publish_limiter.update(p.publish_rate.as_ref());
        self.dispatch_limiter.update(p.dispatch_rate.as_ref());
        self.ns_limiters
            .publish
            .update(p.publish_rate_total.as_ref());
        self.ns_limiters
            .dispatch
            .update(p.dispatch_rate_total.as_ref());
        let sub_rate = p.subscription_dispatch_rate.clone();
        self.ml
            .set_bookie_affinity(p.bookie_affinity_group.as_ref().map(|g| g.placement()));
        *self.policies.lock().expect("policies lock") = p;
        for s in self.subscriptions().await {
            s.limiter.update(sub_rate.as_ref());
        }
    }

    /// The namespace's policies as last read.
    pub fn policies(&self) -> NamespacePolicies {
        self.policies.lock().expect("policies lock").clone()
    }

    /// Terminates the topic: no more messages (its log refuses appends, also after restarts);
    /// its producers are closed and new ones refused; consumers are told once they have read
    /// everything. Returns the last message's position.
    pub async fn terminate(&self) -> Result<Option<Position>, BrokerError> {
        let last = self.ml.terminate().await?;
        self.terminated.store(true, Ordering::Release);
        self.producers.fence_all();
        for sub in self.subscriptions().await {
            sub.wake();
        }
        tracing::info!(topic = %self.full_name, last = ?last, "topic terminated");
        Ok(last)
    }

    /// What deleting the topic removes: the topic, its subscriptions, its ledgers. Refused
    /// while producers or consumers are connected, unless `force` (they are closed then).
    async fn deletion_plan(&self, force: bool) -> Result<Vec<String>, BrokerError> {
        let producers = self.producer_count();
        let mut consumers = 0;
        for s in self.subscriptions().await {
            consumers += s.consumer_count().await;
        }
        if (producers > 0 || consumers > 0) && !force {
            return Err(BrokerError::new(
                ServerError::NotAllowedError,
                format!(
                    "{} has {producers} producers and {consumers} consumers connected; --force closes them",
                    self.full_name
                ),
            ));
        }
        let mut out = vec![format!("topic {}", self.full_name)];
        for s in self.durable_subscriptions().await? {
            out.push(format!("subscription {s} of {}", self.full_name));
        }
        let ledgers = self.ml.ledgers().await;
        if !ledgers.is_empty() {
            let ids: Vec<String> = ledgers.iter().map(|l| l.ledger_id.to_string()).collect();
            out.push(format!("ledgers {} of {}", ids.join(","), self.full_name));
        }
        out.extend(compaction::deletion_plan(self).await?);
        Ok(out)
    }

    /// Deletes the topic: closes its producers and consumers, deletes its subscriptions
    /// (cursors and their ledgers), its log and ledgers, and its epoch and deduplication
    /// records. The caller forgets the topic.
    async fn delete(self: &Arc<Self>) -> Result<(), BrokerError> {
        self.producers.fence_all();
        self.compaction.stop();
        for name in self.durable_subscriptions().await? {
            self.subscription_for_admin(&name)
                .await?
                .delete_forced()
                .await?;
        }
        // Readers (non-durable) are closed too.
        for s in self.subscriptions().await {
            s.delete_forced().await?;
        }
        self.ml.delete().await?;
        compaction::delete(self).await?;
        // A deduplication snapshot still being written would re-create its record.
        if let Some(d) = &self.dedup {
            d.stop_snapshots().await;
        }
        for prefix in [TOPIC_EPOCHS_PREFIX, dedup::DEDUP_PREFIX] {
            self.meta
                .delete(&format!("{prefix}{}", self.ml.name()), None)
                .await?;
        }
        dedup::delete_pages(
            &self.meta,
            &format!("{}{}", dedup::DEDUP_PREFIX, self.ml.name()),
            None,
        )
        .await?;
        tracing::info!(topic = %self.full_name, "topic deleted");
        Ok(())
    }

    /// How long no producer or consumer has been attached (0 while one is), as of `now`;
    /// the first call that finds none starts the count.
    pub async fn idle_for_ms(&self, now: u64) -> u64 {
        let mut clients = self.producers.count();
        for s in self.subscriptions().await {
            clients += s.consumer_count().await;
        }
        if clients > 0 {
            self.idle_since_ms.store(0, Ordering::Relaxed);
            return 0;
        }
        match self.idle_since_ms.load(Ordering::Relaxed) {
            0 => {
                self.idle_since_ms.store(now.max(1), Ordering::Relaxed);
                0
            }
            since => now.saturating_sub(since),
        }
    }

    /// Stops every subscription's dispatcher and persists its cursor, then closes the log.
    pub async fn close(&self) {
        self.compaction.stop();
        for sub in self.subscriptions().await {
            sub.close().await;
        }
        if let Err(e) = self.ml.close().await {
            tracing::warn!(topic = %self.full_name, error = %e, "closing the managed ledger failed");
        }
        if let Some(d) = &self.dedup {
            d.flush().await;
        }
    }
}

/// The broker: serves the topics of the bundles it owns on its site ([`ownership`]).
pub struct Broker {
    pub cfg: Arc<BrokerConfig>,
    pub meta: MetadataClient,
    client: LedgerClient,
    topics: Mutex<HashMap<String, Arc<OnceCell<Arc<Topic>>>>>,
    /// `pulsar://host:port` that lookups answer with.
    pub service_url: String,
    /// `pulsar+ssl://...` once the TLS port is bound (lookups answer it too).
    pub service_url_tls: std::sync::OnceLock<String>,
    /// The broker's registration and the bundles it owns.
    pub ownership: Arc<ownership::Ownership>,
    /// The load manager's memory (used while this broker leads).
    load_manager: load_manager::LoadManager,
    producer_names: AtomicU64,
    run_id: String,
    /// Shared by every topic's tail cache (`broker.tail_cache_total_bytes_max`).
    tail_cache_budget: Arc<meridian_storage::managed_ledger::CacheBudget>,
    closing: AtomicBool,
    /// Topics being unloaded: loading them waits for that (ServiceNotReady, which clients
    /// retry), so a returning client never meets two owners of one log.
    unloading: Mutex<HashMap<String, usize>>,
    /// Tenants past their storage quota (as of the last policy beat), by name.
    storage_breaches: Mutex<HashMap<String, QuotaBreach>>,
    /// Topics whose appends may have passed their backlog quota, checked by the policy loop
    /// at once (woken by `quota_wake`).
    quota_checks: Mutex<std::collections::HashSet<String>>,
    quota_wake: tokio::sync::Notify,
    /// Namespace-wide rate limits, by namespace.
    ns_limiters: Mutex<HashMap<String, Arc<NamespaceLimiters>>>,
    connections: AtomicU64,
    me: std::sync::Weak<Broker>,
    /// Checks tokens when `broker.authentication_enabled`.
    pub auth: Option<Arc<meridian_tenancy::auth::Authenticator>>,
}

impl Broker {
    pub fn new(
        cfg: BrokerConfig,
        meta: MetadataClient,
        client: LedgerClient,
        service_url: String,
    ) -> anyhow::Result<Arc<Broker>> {
        let run_id = format!(
            "{:x}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64 % 0xffff_ffff)
        ) + &format!("{:x}", std::process::id());
        let tail_cache_budget = meridian_storage::managed_ledger::CacheBudget::new(
            cfg.tail_cache_total_bytes_max as usize,
        );
        let auth = if cfg.authentication_enabled {
            let path = |p: &str| (!p.is_empty()).then(|| std::path::PathBuf::from(p));
            let a = meridian_tenancy::auth::Authenticator::from_files(
                path(&cfg.token_secret_key_file).as_deref(),
                path(&cfg.token_public_key_file).as_deref(),
            )
            .map_err(|e| anyhow::anyhow!("broker.token_*_key_file: {e}"))?;
            Some(Arc::new(a))
        } else {
            None
        };
        let id = service_url
            .split_once("://")
            .map_or(service_url.as_str(), |(_, a)| a)
            .to_string();
        let ownership = Arc::new(
            ownership::Ownership::new(
                meta.clone(),
                ownership::BrokerInfo {
                    id: id.clone(),
                    service_url: service_url.clone(),
                    run_id: run_id.clone(),
                    ..Default::default()
                },
                cfg.session_ttl_ms,
                cfg.default_bundles,
                // The bound address is this process's alone only when it names one interface.
                cfg.advertise.is_empty() && !id.starts_with("0.0.0.0:") && !id.starts_with("[::]:"),
            )
            .with_cluster(&cfg.cluster_name),
        );
        Ok(Arc::new_cyclic(|me| Broker {
            me: me.clone(),
            ownership,
            load_manager: load_manager::LoadManager::default(),
            auth,
            tail_cache_budget,
            cfg: Arc::new(cfg),
            meta,
            client,
            topics: Mutex::default(),
            service_url,
            service_url_tls: std::sync::OnceLock::new(),
            producer_names: AtomicU64::new(0),
            run_id,
            closing: AtomicBool::new(false),
            unloading: Mutex::default(),
            storage_breaches: Mutex::default(),
            quota_checks: Mutex::default(),
            ns_limiters: Mutex::default(),
            quota_wake: tokio::sync::Notify::new(),
            connections: AtomicU64::new(0),
        }))
    }

    /// The ledger client (bookies, ledgers) the broker writes through.
    pub fn ledger_client(&self) -> &LedgerClient {
        &self.client
    }

    /// A producer name unique on this site: `<cluster>-<broker run>-<n>`.
    pub fn generate_producer_name(&self) -> String {
        let n = self.producer_names.fetch_add(1, Ordering::Relaxed);
        format!("{}-{}-{n}", self.cfg.cluster_name, self.run_id)
    }

    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Relaxed)
    }

    pub fn connection_opened(&self) {
        let n = self.connections.fetch_add(1, Ordering::Relaxed) + 1;
        metrics::gauge!("meridian_connections").set(n as f64);
    }

    pub fn connection_closed(&self) {
        let n = self
            .connections
            .fetch_sub(1, Ordering::Relaxed)
            .saturating_sub(1);
        metrics::gauge!("meridian_connections").set(n as f64);
    }

    pub fn connection_count(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    /// Whether `role` is one of `broker.superuser_roles`.
    pub fn is_superuser(&self, role: &str) -> bool {
        self.cfg
            .superuser_roles
            .split(',')
            .map(str::trim)
            .any(|r| !r.is_empty() && r == role)
    }

    /// With authentication on: may `role` do `action` ("produce", "consume", or `None` for
    /// either, as a lookup needs) on topics of `namespace`? Superusers and the tenant's admin
    /// roles may; others need a grant in the namespace. The refusal says nothing of whether
    /// the topic exists.
    pub async fn authorize(
        &self,
        role: Option<&str>,
        namespace: &str,
        action: Option<&str>,
    ) -> Result<(), BrokerError> {
        if self.auth.is_none() {
            return Ok(());
        }
        let Some(role) = role else {
            return Err(BrokerError::new(
                ServerError::AuthorizationError,
                "not authenticated",
            ));
        };
        if self.is_superuser(role) {
            return Ok(());
        }
        let tenant = namespace.split('/').next().unwrap_or(namespace);
        let store = meridian_tenancy::TenancyStore::new(self.meta.clone());
        if let Ok(t) = store.tenant(tenant).await {
            if t.admin_roles.iter().any(|r| r == role) {
                return Ok(());
            }
        }
        let granted = self
            .namespace_policies(namespace)
            .await?
            .permissions
            .get(role)
            .is_some_and(|acts| match action {
                Some(a) => acts.iter().any(|x| x == a),
                None => !acts.is_empty(),
            });
        if granted {
            Ok(())
        } else {
            Err(BrokerError::new(
                ServerError::AuthorizationError,
                format!(
                    "role {role} may not {} in namespace {namespace}",
                    action.unwrap_or("use topics")
                ),
            ))
        }
    }

    /// The record of a topic's own policies: a partition's are its partitioned topic's (only
    /// when that exists: a plain topic may be named `x-partition-0` too).
    async fn own_policies_key(&self, name: &TopicName) -> Result<String, BrokerError> {
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

    fn topic_policies_key(name: &TopicName) -> String {
        meridian_tenancy::model::topic_policies_key(&name.tenant, &name.namespace, &name.local)
    }

    /// The topic policies recorded in a namespace, by record key (one listing).
    async fn namespace_topic_policies(
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

    /// Checks a name clients sent and that this broker serves it (persistent topics only).
    pub fn check_topic(&self, name: &str) -> Result<TopicName, BrokerError> {
        let t = TopicName::parse(name)?;
        if t.domain == Domain::NonPersistent {
            return Err(BrokerError::new(
                ServerError::NotAllowedError,
                format!("{t}: non-persistent topics are not supported yet; use persistent://"),
            ));
        }
        Ok(t)
    }

    /// The topic, loading it (opening its managed ledger as owner) on first use. With
    /// `create` false, or auto-creation off, a topic without a log is TopicNotFound.
    pub async fn topic(&self, name: &TopicName, create: bool) -> Result<Arc<Topic>, BrokerError> {
        if self.is_closing() {
            return Err(BrokerError::new(
                ServerError::ServiceNotReady,
                "the broker is shutting down",
            ));
        }
        let full = name.to_string();
        let cell = {
            let mut topics = self.topics.lock().expect("topics lock");
            Arc::clone(topics.entry(full.clone()).or_default())
        };
        let loaded = cell
            .get_or_try_init(|| async { self.load_topic(name, create, false).await })
            .await;
        match loaded {
            Ok(topic) => Ok(Arc::clone(topic)),
            Err(e) => {
                self.forget_failed_load(&full, &cell);
                Err(e)
            }
        }
    }

    /// A load that failed leaves nothing behind: a client naming topics that do not exist
    /// (or cannot be loaded) must not grow the topic map.
    fn forget_failed_load(&self, full: &str, cell: &Arc<OnceCell<Arc<Topic>>>) {
        let mut topics = self.topics.lock().expect("topics lock");
        if topics
            .get(full)
            .is_some_and(|c| Arc::ptr_eq(c, cell) && c.get().is_none())
        {
            topics.remove(full);
        }
    }

    /// Topics in the map (loaded, or being loaded).
    pub fn topics_in_map(&self) -> usize {
        self.topics.lock().expect("topics lock").len()
    }

    /// A topic the broker itself needs (a dead-letter topic): created in its (existing)
    /// namespace whatever `broker.allow_auto_topic_creation` says.
    pub async fn topic_for_broker(&self, name: &TopicName) -> Result<Arc<Topic>, BrokerError> {
        let cell = {
            let mut topics = self.topics.lock().expect("topics lock");
            Arc::clone(topics.entry(name.to_string()).or_default())
        };
        let loaded = cell
            .get_or_try_init(|| async { self.load_topic(name, true, true).await })
            .await;
        match loaded {
            Ok(topic) => Ok(Arc::clone(topic)),
            Err(e) => {
                self.forget_failed_load(&name.to_string(), &cell);
                Err(e)
            }
        }
    }

    /// Deletes a topic (a partitioned topic: all its partitions and its record), its
    /// subscriptions, ledgers and schema. Refused while clients are connected unless `force`;
    /// with `dry_run` only lists what would go. Every partition is checked before any is
    /// deleted.
    pub async fn delete_topic(
        &self,
        name: &TopicName,
        force: bool,
        dry_run: bool,
    ) -> Result<Vec<String>, BrokerError> {
        let parts = self.topic_parts(name).await?;
        let partitioned = parts.len() != 1 || parts[0] != *name;
        let mut topics = Vec::new();
        let mut out = Vec::new();
        if partitioned {
            out.push(format!(
                "partitioned topic {name} ({} partitions)",
                parts.len()
            ));
        }
        for p in &parts {
            // A partition never written to has no log: nothing to delete for it.
            if !self.topic_exists(p).await? {
                continue;
            }
            let t = self.topic_for_broker(p).await?;
            out.extend(t.deletion_plan(force).await?);
            topics.push(t);
        }
        if dry_run {
            return Ok(out);
        }
        // Every partition is held (loads answer ServiceNotReady) until the whole topic is
        // gone: a client that comes back early must not re-create a deleted partition while
        // its partitioned topic still exists.
        let keys: Vec<String> = parts.iter().map(ToString::to_string).collect();
        self.hold(&keys);
        let r = async {
            for t in &topics {
                self.forget_topic(&t.name);
                t.delete().await?;
            }
            if partitioned {
                self.meta
                    .delete(&partitioned::partitioned_topic_key(name), None)
                    .await?;
            }
            if name.partition().is_none() {
                self.meta.delete(&Self::schema_key(name), None).await?;
                self.meta
                    .delete(&Self::topic_policies_key(name), None)
                    .await?;
            }
            Ok::<(), BrokerError>(())
        }
        .await;
        self.release(&keys);
        r?;
        Ok(out)
    }

    /// The topics behind a name: a partitioned topic's partitions, or the topic itself
    /// (TopicNotFound if it has no log).
    pub async fn topic_parts(&self, name: &TopicName) -> Result<Vec<TopicName>, BrokerError> {
        match (name.partition(), self.partitions_of(name).await?) {
            (None, Some((n, _))) => Ok((0..n).map(|i| name.partition_name(i)).collect()),
            _ if self.topic_exists(name).await? => Ok(vec![name.clone()]),
            _ => Err(BrokerError::new(
                ServerError::TopicNotFound,
                format!("topic {name} does not exist"),
            )),
        }
    }

    /// Holds topics (being unloaded or deleted): loading them answers ServiceNotReady, which
    /// clients retry. Holds nest: two operations on one topic release it only when both
    /// are done.
    fn hold(&self, keys: &[String]) {
        let mut u = self.unloading.lock().expect("unloading lock");
        for k in keys {
            *u.entry(k.clone()).or_default() += 1;
        }
    }

    fn release(&self, keys: &[String]) {
        let mut u = self.unloading.lock().expect("unloading lock");
        for k in keys {
            if let Some(n) = u.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    u.remove(k);
                }
            }
        }
    }

    /// Unloads a topic (a partitioned topic: its loaded partitions): its producers and
    /// consumers are closed (they reconnect by themselves), its cursors persisted and its log
    /// closed; the next lookup loads it again. Answers how many topics were unloaded.
    pub async fn unload_topic(&self, name: &TopicName) -> Result<usize, BrokerError> {
        let parts = self.topic_parts(name).await?;
        let mut n = 0;
        for p in parts {
            let loaded = {
                let topics = self.topics.lock().expect("topics lock");
                topics.get(&p.to_string()).and_then(|c| c.get().cloned())
            };
            let Some(t) = loaded else { continue };
            self.unload_loaded(t).await;
            n += 1;
        }
        Ok(n)
    }

    /// Unloads a loaded topic: it stops serving at once (producers fenced, consumers closed,
    /// the topic forgotten), then its cursors are persisted and its log closed.
    async fn unload_loaded(&self, t: Arc<Topic>) {
        let keys = [t.name.to_string()];
        self.hold(&keys);
        self.forget_topic(&t.name);
        t.producers.fence_all();
        for s in t.subscriptions().await {
            s.disconnect_consumers().await;
        }
        t.close().await;
        self.release(&keys);
        tracing::info!(topic = %t.name, "topic unloaded");
    }

    /// Drops a topic from the loaded ones (after deleting or unloading it).
    fn forget_topic(&self, name: &TopicName) {
        self.topics
            .lock()
            .expect("topics lock")
            .remove(&name.to_string());
    }

    /// Whether a (non-partitioned) topic or partition has a log.
    pub async fn topic_exists(&self, name: &TopicName) -> Result<bool, BrokerError> {
        Ok(self
            .meta
            .get(&managed_ledger_key(&name.managed_ledger_name()))
            .await?
            .is_some())
    }

    async fn load_topic(
        &self,
        name: &TopicName,
        create: bool,
        force: bool,
    ) -> Result<Arc<Topic>, BrokerError> {
        let full = name.to_string();
        if self
            .unloading
            .lock()
            .expect("unloading lock")
            .contains_key(&full)
        {
            return Err(BrokerError::new(
                ServerError::ServiceNotReady,
                format!("{full} is being unloaded; retry"),
            ));
        }
        if name.partition().is_none() && self.partitions_of(name).await?.is_some() {
            return Err(BrokerError::new(
                ServerError::NotAllowedError,
                format!("{full} is a partitioned topic: use its partitions {full}-partition-<i>"),
            ));
        }
        if !self.topic_exists(name).await? {
            // A partition of a partitioned topic exists as soon as the topic has it.
            let parent = match name.parent() {
                Some(parent) => self.partitions_of(&parent).await?.map(|(n, _)| (parent, n)),
                None => None,
            };
            match parent {
                Some((parent, n)) => {
                    let i = name.partition().unwrap_or(u32::MAX);
                    if i >= n {
                        return Err(BrokerError::new(
                            ServerError::TopicNotFound,
                            format!("{parent} has {n} partitions; there is no partition {i}"),
                        ));
                    }
                }
                None => {
                    if !(create && (force || self.cfg.allow_auto_topic_creation)) {
                        return Err(BrokerError::new(
                            ServerError::TopicNotFound,
                            format!("topic {full} does not exist"),
                        ));
                    }
                    let ns = name.namespace();
                    if !self.namespace_exists(&ns).await? {
                        return Err(BrokerError::new(
                            ServerError::TopicNotFound,
                            format!("namespace {ns} does not exist (topic {full})"),
                        ));
                    }
                }
            }
        }
        // Served only where its bundle is owned (checked again once loaded).
        let session = self.ensure_owned(name).await?;
        let ml_name = name.managed_ledger_name();
        let policies_key = self.own_policies_key(name).await?;
        let policies = self
            .namespace_policies(&name.namespace())
            .await?
            .overlaid(&self.topic_own_policies(&policies_key).await?);
        let opts = ManagedLedgerOptions {
            bookie_affinity: policies
                .bookie_affinity_group
                .as_ref()
                .map(|g| g.placement()),
            ensemble: self.cfg.ensemble as usize,
            write_quorum: self.cfg.write_quorum as usize,
            ack_quorum: self.cfg.ack_quorum as usize,
            rollover_entries_max: self.cfg.ledger_rollover_entries_max,
            rollover_min_age_ms: self.cfg.ledger_rollover_min_age_ms,
            tail_cache_bytes_max: self.cfg.tail_cache_bytes_max as usize,
            tail_cache_budget: Some(Arc::clone(&self.tail_cache_budget)),
            ..ManagedLedgerOptions::default()
        };
        let ml = ManagedLedger::open(self.client.clone(), &ml_name, opts).await?;
        let terminated = ml.is_terminated().await;
        let policies_kept = policies.clone();
        let dedup = if policies
            .deduplication_enabled
            .unwrap_or(self.cfg.deduplication_enabled)
        {
            Some(Arc::new(
                dedup::Dedup::recover(
                    self.meta.clone(),
                    &ml,
                    self.cfg.deduplication_snapshot_entries,
                )
                .await?,
            ))
        } else {
            None
        };
        let epoch = match self
            .meta
            .get(&format!("{TOPIC_EPOCHS_PREFIX}{ml_name}"))
            .await?
        {
            Some(kv) => String::from_utf8_lossy(&kv.value).parse().unwrap_or(0),
            None => 0,
        };
        tracing::info!(topic = %full, deduplication = dedup.is_some(), epoch, "topic loaded");
        let last = ml.last_confirmed();
        let topic = Arc::new(Topic {
            name: name.clone(),
            full_name: full,
            ml,
            client: self.client.clone(),
            cfg: Arc::clone(&self.cfg),
            meta: self.meta.clone(),
            producers: producers::Producers::new(epoch),
            subscriptions: tokio::sync::Mutex::default(),
            appended: watch::channel(last).0,
            counters: TopicCounters::default(),
            rates: Mutex::default(),
            dedup,
            policies: Mutex::new(NamespacePolicies::default()),
            policies_key,
            broker: self.me.clone(),
            terminated: AtomicBool::new(terminated),
            idle_since_ms: AtomicU64::new(0),
            quota_breach: Mutex::new(None),
            storage_breach: Mutex::new(None),
            quota_headroom: AtomicI64::new(i64::MAX),
            publish_limiter: rate::PolicyLimiter::default(),
            dispatch_limiter: rate::PolicyLimiter::default(),
            ns_limiters: Arc::clone(
                self.ns_limiters
                    .lock()
                    .expect("limiters lock")
                    .entry(name.namespace())
                    .or_default(),
            ),
            compaction: compaction::Compaction::default(),
        });
        topic.set_policies(policies_kept).await;
        compaction::restore(&topic).await?;
        // A load is long (log recovery, deduplication state): the ownership it began under
        // must still hold, or another broker may serve the topic now.
        let b = self.ownership.bundle_of(name).await?;
        if self.ownership.session_id() != Some(session)
            || !self.ownership.owns(&name.namespace(), &b)
        {
            topic.close().await;
            return Err(BrokerError::new(
                ServerError::ServiceNotReady,
                format!(
                    "{full_name} lost its owner while loading; look it up again",
                    full_name = name
                ),
            ));
        }
        let breach = self
            .storage_breaches
            .lock()
            .expect("breaches lock")
            .get(&name.tenant)
            .cloned();
        topic.set_storage_breach(breach);
        Ok(topic)
    }

    /// Topics loaded on this broker.
    pub fn loaded_topics(&self) -> Vec<Arc<Topic>> {
        self.topics
            .lock()
            .expect("topics lock")
            .values()
            .filter_map(|c| c.get().cloned())
            .collect()
    }

    /// Topics of a namespace: those with a log, and every partition of its partitioned
    /// topics (created or not yet), sorted.
    pub async fn topics_of_namespace(&self, namespace: &str) -> Result<Vec<String>, BrokerError> {
        let prefix = format!(
            "{}{namespace}/persistent/",
            meridian_storage::managed_ledger::MANAGED_LEDGERS_PREFIX
        );
        let mut out = std::collections::BTreeSet::new();
        let mut after = String::new();
        loop {
            let page = self.meta.children(&prefix, &after, 0).await?;
            for local in &page.children {
                let local = crate::topic_name::unescape(local);
                out.insert(format!("persistent://{namespace}/{local}"));
            }
            match page.children.last() {
                Some(last) if page.more => after = last.clone(),
                _ => break,
            }
        }
        for (name, n) in self.partitioned_topics_of_namespace(namespace).await? {
            for i in 0..n {
                out.insert(name.partition_name(i).to_string());
            }
        }
        Ok(out.into_iter().collect())
    }

    /// Stops serving: refuses new topics, stops dispatchers, persists cursors, closes logs.
    pub async fn close(&self) {
        self.closing.store(true, Ordering::Relaxed);
        // Many topics close at once: each close is a few metadata writes and a ledger close.
        use futures::StreamExt;
        futures::stream::iter(self.loaded_topics())
            .for_each_concurrent(64, |topic| async move { topic.close().await })
            .await;
        // Last: other brokers may take the bundles once the logs are closed.
        self.ownership.release_all().await;
    }

    /// Every `broker.policy_refresh_interval_ms`: re-reads the policies of the namespaces of
    /// loaded topics (an admin change takes effect within one interval; deduplication on or
    /// off applies when a topic is next loaded) and applies message TTLs: on every durable
    /// subscription, what was published more than the TTL ago is acknowledged.
    pub async fn policy_loop(self: Arc<Self>) {
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
    async fn check_requested_quotas(&self) {
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
    async fn check_storage_quotas(&self) {
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
    async fn tenant_storage_bytes(
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
                } else if let Ok(m) = serde_json::from_slice::<
                    meridian_storage::managed_ledger::ManagedLedgerMetadata,
                >(&kv.value)
                {
                    used += m.ledgers.iter().map(|l| l.bytes).sum::<u64>();
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

    /// An inactive topic (no producer or consumer for `broker.inactive_topic_ttl_s`): deleted
    /// if `broker.inactive_topic_delete_mode` says so and allows it now, else unloaded.
    async fn retire_inactive(&self, topic: &Arc<Topic>) {
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
            for topic in self.loaded_topics() {
                if topic.idle_for_ms(now_ms()).await
                    >= self.cfg.inactive_topic_ttl_s.saturating_mul(1000)
                    && self.cfg.inactive_topic_ttl_s > 0
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
                for sub in topic.subscriptions().await {
                    let backlog = sub.backlog().await;
                    metrics::gauge!(
                        "meridian_subscription_backlog_entries",
                        "topic" => topic.full_name.clone(),
                        "subscription" => sub.name().to_string()
                    )
                    .set(backlog.entries as f64);
                }
            }
            for topic in inactive {
                self.retire_inactive(&topic).await;
            }
        }
    }
}

/// Wall-clock milliseconds since the epoch.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
