//! A topic this broker owns: its log, producers, subscriptions, policies and limits.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use meridian_config::BrokerConfig;
use meridian_metadata::MetadataClient;
use meridian_protocol::pb::ServerError;
use meridian_storage::ledger::LedgerClient;
use meridian_storage::managed_ledger::{ManagedLedger, Position};
use tokio::sync::watch;

use super::quota::QuotaBreach;
use super::stats::{Rates, TopicCounters};
use super::{
    compaction, dedup, producers, rate, subscription, Broker, BrokerError, ConsumerSink,
    NamespacePolicies, SubType, SubscribeRequest, Subscription, TOPIC_EPOCHS_PREFIX,
};
use crate::topic_name::TopicName;

/// A topic this broker owns.
pub struct Topic {
    pub name: TopicName,
    pub(super) full_name: String,
    pub ml: Arc<ManagedLedger>,
    pub(super) client: LedgerClient,
    pub(super) cfg: Arc<BrokerConfig>,
    pub(super) meta: MetadataClient,
    pub producers: producers::Producers,
    pub(super) subscriptions: tokio::sync::Mutex<HashMap<String, Arc<Subscription>>>,
    pub(super) appended: watch::Sender<Option<Position>>,
    pub counters: TopicCounters,
    pub(super) rates: Mutex<Rates>,
    /// Present when the topic deduplicates sends.
    pub dedup: Option<Arc<dedup::Dedup>>,
    /// The namespace's policies, refreshed by the broker's policy loop.
    pub(super) policies: Mutex<NamespacePolicies>,
    /// The record of the topic's own policies (its partitioned topic's, for a partition).
    pub(super) policies_key: String,
    /// The broker, for what a topic does to other topics (dead-lettering).
    pub broker: std::sync::Weak<Broker>,
    /// Terminated: no more messages (mirrors the log's record, for cheap checks).
    pub terminated: AtomicBool,
    /// Since when (ms since the epoch) no producer or consumer is attached; 0 while one is
    /// (sampled every stats interval, for `broker.inactive_topic_ttl_s`).
    pub(super) idle_since_ms: AtomicU64,
    /// Set while a backlog quota with a producer policy is passed.
    pub(super) quota_breach: Mutex<Option<QuotaBreach>>,
    /// Set while the tenant stores more than its storage quota.
    pub(super) storage_breach: Mutex<Option<QuotaBreach>>,
    /// Set while a replication backlog quota with a producer policy is passed.
    pub(super) repl_breach: Mutex<Option<QuotaBreach>>,
    /// Set while the recovery-point policy (max replication lag) with a producer policy is
    /// passed.
    pub(super) rpo_breach: Mutex<Option<QuotaBreach>>,
    /// Bytes that may be appended before the backlog quota's size limit may be passed (the
    /// limit less the largest backlog at the last check; `i64::MAX` without a size limit).
    /// The append that uses it up asks for a check at once: the quota is checked on the
    /// write path, not only on the policy beat.
    pub(super) quota_headroom: AtomicI64,
    /// The publish rate policy: sends past it wait (the connection is not read meanwhile).
    pub publish_limiter: rate::PolicyLimiter,
    /// The topic's dispatch rate policy, its subscriptions together.
    pub dispatch_limiter: rate::PolicyLimiter,
    /// The namespace's totals (`publish_rate_total`, `dispatch_rate_total`), shared by all
    /// its topics on this broker.
    pub ns_limiters: Arc<NamespaceLimiters>,
    /// The compacted view and the state of compaction runs.
    pub compaction: compaction::Compaction,
    /// The highest origin position held per origin site (geo-replication's receiving side),
    /// loaded on first use.
    pub(super) repl_origins: tokio::sync::Mutex<Option<super::replication::Origins>>,
    /// Peers' frames queued into the log and their completion in order.
    pub(super) repl_inbound: super::replication::inbound::Inbound,
    /// Replicators to other sites, by remote site.
    pub(super) replicators: Mutex<HashMap<String, super::replication::Replicator>>,
    /// Replicated subscriptions: their acknowledgements to and from other sites.
    pub(super) repl_subs: super::replication::subs::ReplSubs,
    /// Closed: no replicator starts, no replicated entry is taken.
    pub(super) repl_closed: AtomicBool,
    /// Unloaded here: no producer, consumer or subscription attaches any more (one that did
    /// would be left on an instance nothing serves, and hear nothing).
    pub(super) detached: AtomicBool,
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

    /// The topic stops serving here (it is being unloaded or deleted): its producers are
    /// closed, and no producer or consumer attaches from now on; they are refused with
    /// ServiceNotReady and look the topic up again. The caller closes the consumers after.
    pub(super) fn stop_attaching(&self) {
        self.refuse_new_clients();
        self.producers.close_all();
    }

    /// No producer or consumer attaches from now on (ServiceNotReady); those attached stay.
    pub(super) fn refuse_new_clients(&self) {
        self.detached.store(true, Ordering::Release);
        self.producers.refuse_new();
    }

    /// Producers and consumers attached.
    pub(super) async fn clients(&self) -> (usize, usize) {
        let mut consumers = 0;
        for s in self.subscriptions().await {
            consumers += s.consumer_count().await;
        }
        (self.producer_count(), consumers)
    }

    /// NotAllowedError naming the clients attached, if any (a deletion without `--force`).
    pub(super) async fn refuse_if_clients(&self) -> Result<(), BrokerError> {
        let (producers, consumers) = self.clients().await;
        if producers > 0 || consumers > 0 {
            return Err(BrokerError::new(
                ServerError::NotAllowedError,
                format!(
                    "{} has {producers} producers and {consumers} consumers connected; --force closes them",
                    self.full_name
                ),
            ));
        }
        Ok(())
    }

    /// Stops serving the topic here: no client attaches any more, its producers are closed
    /// and its consumers disconnected (they look it up again), then it is closed (an unload,
    /// or an instance a deletion left behind).
    pub(super) async fn shut(&self) {
        self.stop_attaching();
        for s in self.subscriptions().await {
            s.disconnect_consumers().await;
        }
        self.close().await;
    }

    /// ServiceNotReady once the topic stopped serving here (the client looks it up again).
    pub fn refuse_if_detached(&self) -> Result<(), BrokerError> {
        if self.detached.load(Ordering::Acquire) {
            return Err(BrokerError::new(
                ServerError::ServiceNotReady,
                format!(
                    "{} is being unloaded or deleted on this broker; look it up again",
                    self.full_name
                ),
            ));
        }
        Ok(())
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

    pub(super) async fn record_epoch(&self, epoch: u64) {
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

    /// Attaches a consumer, creating the subscription (and its durable cursor) if needed; a
    /// consumer that asks for its acknowledgements to be replicated makes the subscription a
    /// replicated one.
    pub async fn subscribe(
        self: &Arc<Self>,
        req: SubscribeRequest,
        sink: ConsumerSink,
    ) -> Result<Arc<Subscription>, BrokerError> {
        // Recorded first: a consumer is never left attached to a subscription whose
        // replication could not be recorded. Not on an unloaded topic (`attach` would refuse
        // the consumer after the record was written).
        if req.replicated && req.durable && !self.detached.load(Ordering::Acquire) {
            self.enable_replicated(&req.subscription).await?;
        }
        self.attach(req, sink).await
    }

    async fn attach(
        self: &Arc<Self>,
        req: SubscribeRequest,
        sink: ConsumerSink,
    ) -> Result<Arc<Subscription>, BrokerError> {
        if req
            .subscription
            .starts_with(super::replication::REPL_CURSOR_PREFIX)
        {
            return Err(BrokerError::new(
                ServerError::NotAllowedError,
                format!(
                    "subscription names beginning {} are the replicators' cursors; choose another name",
                    super::replication::REPL_CURSOR_PREFIX
                ),
            ));
        }
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
        // Checked under the lock that the unloading takes to list the subscriptions whose
        // consumers it closes: a consumer either is among them or is refused here.
        self.refuse_if_detached()?;
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
        self.open_idle_subscription(name, false).await
    }

    /// [`create_subscription`](Self::create_subscription); `deleting`: for the topic's own
    /// deletion, which opens each durable subscription to delete it after the topic stopped
    /// taking clients.
    async fn open_idle_subscription(
        self: &Arc<Self>,
        name: &str,
        deleting: bool,
    ) -> Result<(), BrokerError> {
        let mut subs = self.subscriptions.lock().await;
        if subs.get(name).is_some_and(|s| !s.is_closed()) {
            return Ok(());
        }
        // Opened on an unloaded topic, it would run with nothing to stop it.
        if !deleting {
            self.refuse_if_detached()?;
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
            replicated: false,
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

    /// Recovers the cursor ledger of durable subscription `name` if it is not open here, so
    /// that a consumer's SUBSCRIBE then opens it without that wait (a connection's warm-up).
    /// Opens and creates nothing; not for the broker's own cursors (the replicators',
    /// compaction's), which may be writing theirs.
    pub async fn recover_subscription_ledger(&self, name: &str) -> Result<(), BrokerError> {
        if name.starts_with(super::replication::REPL_CURSOR_PREFIX)
            || name == compaction::COMPACTION_SUBSCRIPTION
        {
            return Ok(());
        }
        // Under the lock an opening takes: no instance of this subscription starts writing
        // its ledger meanwhile.
        let subs = self.subscriptions.lock().await;
        if subs.get(name).is_some_and(|s| !s.is_closed()) {
            return Ok(());
        }
        self.refuse_if_detached()?;
        meridian_storage::cursor::ManagedCursor::recover_ledger(&self.client, self.ml.name(), name)
            .await?;
        Ok(())
    }

    /// Whether subscription `name` is open here (false while the subscriptions are locked:
    /// one may be opening, which can take a cursor ledger's recovery).
    pub fn has_open_subscription(&self, name: &str) -> bool {
        self.subscriptions
            .try_lock()
            .is_ok_and(|subs| subs.get(name).is_some_and(|s| !s.is_closed()))
    }

    /// A durable subscription for the admin API: the open one, or its cursor opened (without
    /// consumers); NotFound if the subscription does not exist.
    pub async fn subscription_for_admin(
        self: &Arc<Self>,
        name: &str,
    ) -> Result<Arc<Subscription>, BrokerError> {
        self.open_subscription_for_admin(name, false).await
    }

    /// [`subscription_for_admin`](Self::subscription_for_admin), `deleting` as in
    /// [`open_idle_subscription`](Self::open_idle_subscription).
    async fn open_subscription_for_admin(
        self: &Arc<Self>,
        name: &str,
        deleting: bool,
    ) -> Result<Arc<Subscription>, BrokerError> {
        if name.starts_with(super::replication::REPL_CURSOR_PREFIX) {
            return Err(BrokerError::new(
                ServerError::SubscriptionNotFound,
                format!("{name} is a replicator's cursor, not a subscription"),
            ));
        }
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
        self.open_idle_subscription(name, deleting).await?;
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
                let name = crate::topic_name::unescape(c);
                // Replicators' cursors are not subscriptions: no policy, admin call or client
                // may move them (`replication.rs`).
                if !name.starts_with(super::replication::REPL_CURSOR_PREFIX) {
                    out.push(name);
                }
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
    pub async fn set_policies(self: &Arc<Self>, p: NamespacePolicies) {
        self.reconcile_replicators(&p).await;
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
    pub(super) async fn deletion_plan(&self, force: bool) -> Result<Vec<String>, BrokerError> {
        if !force {
            self.refuse_if_clients().await?;
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
    /// records. From its start the topic takes no producer, consumer or subscription (a
    /// client that found it before attaches to nothing that is being deleted: refused with
    /// ServiceNotReady, it looks the topic up again); the caller forgets the topic, and shuts
    /// it ([`shut`](Self::shut)) if the deletion fails midway (the next lookup loads what is
    /// left).
    pub(super) async fn delete(self: &Arc<Self>) -> Result<(), BrokerError> {
        self.stop_attaching();
        self.compaction.stop();
        self.stop_replicators();
        self.delete_replication_state().await?;
        for name in self.durable_subscriptions().await? {
            self.open_subscription_for_admin(&name, true)
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
        let (producers, consumers) = self.clients().await;
        if producers + consumers > 0 {
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

    /// Stops every subscription's dispatcher, persists its cursor and closes its ledger, then
    /// closes the log; no consumer or subscription attaches any more (producers:
    /// `stop_attaching`).
    pub async fn close(&self) {
        // Before the subscriptions are listed (under their lock): none is opened after, by
        // a consumer or by the replicated subscriptions' sync, on an instance nothing serves.
        self.detached.store(true, Ordering::Release);
        self.stop_replicators();
        // A save of the origins in flight lands before the topic is given up (saves hold
        // this lock; none follows): a later owner's deletion of the record is not undone.
        drop(self.repl_origins.lock().await);
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
