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
//!
//! This module is the broker and its topic map (loading, unloading, deleting topics); a topic
//! is [`topic`], its figures [`stats`], the policy loop (namespace and topic policies, TTL,
//! retention, inactive topics) [`policy`], backlog and tenant storage quotas [`quota`],
//! authorization [`auth`], ownership of bundles [`ownership`] and the load manager
//! [`load_manager`].

mod auth;
pub mod avro;
pub mod bundle_split;
pub mod bundles;
pub mod compaction;
pub mod dedup;
pub mod drill;
mod error;
pub mod geo_placement;
pub mod key_shared;
pub mod load_manager;
pub mod lookup;
mod meta_sync;
pub mod ownership;
pub mod partitioned;
mod policy;
pub mod producers;
mod quota;
pub mod rate;
mod repl_quota;
pub mod replication;
mod rpo_policy;
pub mod schema;
mod stats;
pub mod subscription;
pub mod tombstones;
mod topic;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use meridian_config::BrokerConfig;
use meridian_metadata::MetadataClient;
use meridian_protocol::pb::ServerError;

use meridian_storage::ledger::LedgerClient;
use meridian_storage::managed_ledger::{managed_ledger_key, ManagedLedger, ManagedLedgerOptions};
use tokio::sync::{watch, OnceCell};

use crate::topic_name::{Domain, TopicName};
pub use error::BrokerError;
pub use quota::QuotaBreach;
pub use stats::{TopicCounters, TopicStats};
pub use subscription::{ConsumerSink, SubType, SubscribeRequest, Subscription, SubscriptionStats};
pub use topic::{NamespaceLimiters, Topic};

/// Where topic epochs (raised by each grant of exclusive producer access) are kept.
pub const TOPIC_EPOCHS_PREFIX: &str = "/topic-epochs/";

/// Where namespaces are recorded (the tenancy crate owns the records).
pub use meridian_tenancy::model::NAMESPACES_PREFIX;

/// A namespace's record: its policies (the tenancy crate owns the model).
pub use meridian_tenancy::NamespacePolicies;

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
    /// Wakes the tombstone loop after a global topic's deletion here.
    tombstone_wake: tokio::sync::Notify,
    /// Namespace-wide rate limits, by namespace.
    ns_limiters: Mutex<HashMap<String, Arc<NamespaceLimiters>>>,
    connections: AtomicU64,
    /// The Pulsar ports' connections against `broker.connections_max` and
    /// `broker.connections_per_ip_max` (both ports together).
    pub(crate) admission: Arc<crate::admission::Limits>,
    me: std::sync::Weak<Broker>,
    /// Checks tokens when `broker.authentication_enabled`.
    pub auth: Option<Arc<meridian_tenancy::auth::Authenticator>>,
    /// The link to other sites, once started (`geo.listen`).
    pub geo: std::sync::OnceLock<Arc<meridian_geo::GeoLink>>,
    /// Namespaces cut over to another site by a failover drill.
    pub(crate) cuts: drill::Cuts,
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
        let admission = crate::admission::Limits::new(
            cfg.connections_max as usize,
            cfg.connections_per_ip_max as usize,
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
            geo: std::sync::OnceLock::new(),
            cuts: Default::default(),
            producer_names: AtomicU64::new(0),
            run_id,
            closing: AtomicBool::new(false),
            unloading: Mutex::default(),
            storage_breaches: Mutex::default(),
            quota_checks: Mutex::default(),
            ns_limiters: Mutex::default(),
            quota_wake: tokio::sync::Notify::new(),
            tombstone_wake: tokio::sync::Notify::new(),
            connections: AtomicU64::new(0),
            admission,
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
        self.topic_loaded(name, create, false).await
    }

    /// The loaded topic, loading it on first use (`for_broker`: created whatever
    /// auto-creation says, see [`load_topic`](Self::load_topic)). A loaded topic whose log was
    /// fenced is unloaded and loaded again, once.
    async fn topic_loaded(
        &self,
        name: &TopicName,
        create: bool,
        for_broker: bool,
    ) -> Result<Arc<Topic>, BrokerError> {
        let full = name.to_string();
        let mut reloaded = false;
        loop {
            let cell = {
                let mut topics = self.topics.lock().expect("topics lock");
                Arc::clone(topics.entry(full.clone()).or_default())
            };
            let loaded = cell
                .get_or_try_init(|| async { self.load_topic(name, create, for_broker).await })
                .await;
            let topic = match loaded {
                Ok(topic) => Arc::clone(topic),
                Err(e) => {
                    self.forget_failed_load(&full, cell);
                    return Err(e);
                }
            };
            // Loaded into an entry taken out of the map meanwhile (a deletion, an unload):
            // no one would unload this instance, and the next caller would load another.
            let current = self
                .topics
                .lock()
                .expect("topics lock")
                .get(&full)
                .is_some_and(|c| Arc::ptr_eq(c, &cell));
            if !current {
                if !topic.detached.load(Ordering::Acquire) {
                    topic.close().await;
                }
                return Err(BrokerError::new(
                    ServerError::ServiceNotReady,
                    format!("{full} was unloaded while it loaded; look it up again"),
                ));
            }
            if !topic.ml.is_fenced() {
                return Ok(topic);
            }
            if reloaded {
                return Err(BrokerError::new(
                    ServerError::ServiceNotReady,
                    format!("{full}: its log was fenced again once loaded; retry"),
                ));
            }
            reloaded = true;
            // Its log took no more entries here (a change of its record failed): loaded
            // again, it re-reads the record (and, if another broker owns it now, the load
            // is refused). Only the loaded instance is unloaded, once.
            let held = self.hold(vec![full.clone()]);
            if self.forget_if_loaded(&topic) {
                tracing::warn!(topic = %name, "the topic's log was fenced: unloading it to load it again");
                self.finish_unload(topic, held).await;
            }
        }
    }

    /// Forgets `t` if it is still the loaded instance of its name; whether it was.
    fn forget_if_loaded(&self, t: &Arc<Topic>) -> bool {
        let key = t.name.to_string();
        let mut topics = self.topics.lock().expect("topics lock");
        let loaded = topics
            .get(&key)
            .and_then(|c| c.get())
            .is_some_and(|x| Arc::ptr_eq(x, t));
        if loaded {
            topics.remove(&key);
        }
        loaded
    }

    /// A load that failed leaves nothing behind: a client naming topics that do not exist
    /// (or cannot be loaded) must not grow the topic map. Unless another caller holds the
    /// cell too (it took it from the map, under this lock): that one loads again in it once
    /// this load failed, and a cell taken out of the map meanwhile would give it an instance
    /// of the topic outside the map, which a later caller loads a second time (two instances
    /// fencing each other's log and cursors, the first one never unloaded). The last caller
    /// whose load fails removes it.
    fn forget_failed_load(&self, full: &str, cell: Arc<OnceCell<Arc<Topic>>>) {
        let mut topics = self.topics.lock().expect("topics lock");
        if topics.get(full).is_some_and(|c| {
            // The map's and this caller's.
            Arc::ptr_eq(c, &cell) && c.get().is_none() && Arc::strong_count(c) == 2
        }) {
            topics.remove(full);
        }
        // Dropped under the lock, as every clone is made: of two callers failing at once,
        // the second sees only its own and the map's.
        drop(cell);
        drop(topics);
    }

    /// Topics in the map (loaded, or being loaded).
    pub fn topics_in_map(&self) -> usize {
        self.topics.lock().expect("topics lock").len()
    }

    /// A topic the broker itself needs (a dead-letter topic): created in its (existing)
    /// namespace whatever `broker.allow_auto_topic_creation` says.
    pub async fn topic_for_broker(&self, name: &TopicName) -> Result<Arc<Topic>, BrokerError> {
        self.topic_loaded(name, true, true).await
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
        if crate::failpoint::hit("delete:pause_after_plan_2s") {
            tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        }
        // Every partition is held (loads answer ServiceNotReady) until the whole topic is
        // gone: a client that comes back early must not re-create a deleted partition while
        // its partitioned topic still exists.
        let held = self.hold(parts.iter().map(ToString::to_string).collect());
        let r = async {
            if !force {
                // A client may have attached after its topic was checked: from here none
                // attaches, and one that did refuses the deletion as at the check. The
                // topics are let go then (their clients look them up again and load them
                // anew), as nothing tells apart the ones that were refused meanwhile.
                for t in &topics {
                    t.refuse_new_clients();
                }
                for t in &topics {
                    if let Err(e) = t.refuse_if_clients().await {
                        for t in &topics {
                            self.shut_reloaded(t).await;
                            t.shut().await;
                        }
                        return Err(e);
                    }
                }
            }
            for t in &topics {
                // A topic loaded again since it was checked (its log fenced, then reloaded)
                // stops serving before its log is deleted under it.
                self.shut_reloaded(t).await;
                if let Err(e) = t.delete().await {
                    // It takes no client any more and is out of the map: its consumers are
                    // let go and it is closed, so that nothing of it runs on; the next lookup
                    // loads what is left of the topic.
                    t.shut().await;
                    return Err(e);
                }
            }
            if partitioned {
                self.meta
                    .delete(&partitioned::partitioned_topic_key(name), None)
                    .await?;
            }
            if name.partition().is_none() {
                self.meta.delete(&Self::schema_key(name), None).await?;
                // With a tombstone: a peer site's older copy does not bring them back.
                meridian_tenancy::TenancyStore::for_site(self.meta.clone(), &self.cfg.cluster_name)
                    .delete_topic_policies_record(&Self::topic_policies_key(name))
                    .await
                    .map_err(|e| BrokerError::new(ServerError::MetadataError, e.to_string()))?;
            }
            Ok::<(), BrokerError>(())
        }
        .await;
        drop(held);
        r?;
        Ok(out)
    }

    /// Takes `t`'s name out of the map of loaded topics, and shuts the instance found there
    /// if it is another one than `t` (loaded again since `t` was).
    async fn shut_reloaded(&self, t: &Arc<Topic>) {
        if let Some(other) = self.take_loaded(&t.name).filter(|o| !Arc::ptr_eq(o, t)) {
            other.shut().await;
        }
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

    /// Holds topics (being unloaded or deleted) until the returned guard is dropped: loading
    /// them answers ServiceNotReady, which clients retry. Holds nest: two operations on one
    /// topic release it only when both are done. An operation cancelled midway (an admin
    /// call whose caller went away) releases its hold as one that finished does.
    fn hold(&self, keys: Vec<String>) -> Held<'_> {
        let mut u = self.unloading.lock().expect("unloading lock");
        for k in &keys {
            *u.entry(k.clone()).or_default() += 1;
        }
        Held {
            unloading: &self.unloading,
            keys,
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
        let held = self.hold(vec![t.name.to_string()]);
        // Unless another unload (of a fenced log) got there first: that one closes it.
        if self.forget_if_loaded(&t) {
            self.finish_unload(t, held).await;
        }
    }

    /// The rest of [`Broker::unload_loaded`], for a topic held and forgotten.
    async fn finish_unload(&self, t: Arc<Topic>, held: Held<'_>) {
        tracing::info!(topic = %t.name, "topic unloading: closing its producers and consumers");
        t.shut().await;
        drop(held);
        tracing::info!(topic = %t.name, "topic unloaded");
    }

    /// Drops a topic from the loaded ones (to delete or unload it): the instance that was
    /// loaded, if one was.
    fn take_loaded(&self, name: &TopicName) -> Option<Arc<Topic>> {
        self.topics
            .lock()
            .expect("topics lock")
            .remove(&name.to_string())
            .and_then(|c| c.get().cloned())
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
        // Fail point `load:pause_5s:<local name>`: that topic's loads take 5 s more.
        if crate::failpoint::hit(&format!("load:pause_5s:{}", name.local)) {
            tokio::time::sleep(std::time::Duration::from_secs(5)).await;
        }
        if crate::failpoint::hit("load:fail_first_after_3s")
            && !FIRST_LOAD_FAILED.swap(true, Ordering::Relaxed)
        {
            tokio::time::sleep(std::time::Duration::from_secs(3)).await;
            return Err(BrokerError::new(
                ServerError::ServiceNotReady,
                format!("{full}: the fail point failed its first load"),
            ));
        }
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
            create_wait_ms: self.cfg.ledger_create_wait_ms,
            tail_cache_bytes_max: self.cfg.tail_cache_bytes_max as usize,
            tail_cache_budget: Some(Arc::clone(&self.tail_cache_budget)),
            ..ManagedLedgerOptions::default()
        };
        let opening = std::time::Instant::now();
        let ml = ManagedLedger::open(self.client.clone(), &ml_name, opts).await?;
        let open_ms = opening.elapsed().as_millis() as u64;
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
                    // Across sites only where the namespace's own (global) record says so:
                    // a site's broker default is not known to the others.
                    policies.deduplication_enabled == Some(true),
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
        tracing::info!(
            topic = %full,
            deduplication = dedup.is_some(),
            epoch,
            open_ms,
            since_open_ms = opening.elapsed().as_millis() as u64 - open_ms,
            "topic loaded"
        );
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
            repl_breach: Mutex::new(None),
            rpo_breach: Mutex::new(None),
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
            repl_origins: tokio::sync::Mutex::new(None),
            repl_inbound: Default::default(),
            replicators: Mutex::default(),
            repl_closed: AtomicBool::new(false),
            detached: AtomicBool::new(false),
            repl_subs: Default::default(),
        });
        topic.set_policies(policies_kept).await;
        // A load that fails from here on closes the topic (its replicators have started).
        if let Err(e) = compaction::restore(&topic).await {
            topic.close().await;
            return Err(e);
        }
        // A load is long (log recovery, deduplication state): the ownership it began under
        // must still hold, or another broker may serve the topic now.
        let b = match self.ownership.bundle_of(name).await {
            Ok(b) => b,
            Err(e) => {
                topic.close().await;
                return Err(e);
            }
        };
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

    /// The topic if it is loaded here (no load started).
    pub fn loaded_topic(&self, name: &TopicName) -> Option<Arc<Topic>> {
        self.topics
            .lock()
            .expect("topics lock")
            .get(&name.to_string())
            .and_then(|c| c.get().cloned())
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
}

/// Fail point `load:fail_first_after_3s`: the broker's first topic load fails after 3 s
/// (other callers wait for it meanwhile, and load again once it failed).
static FIRST_LOAD_FAILED: AtomicBool = AtomicBool::new(false);

/// Wall-clock milliseconds since the epoch.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A hold on topics (see [`Broker::hold`]), released when dropped.
struct Held<'a> {
    unloading: &'a Mutex<HashMap<String, usize>>,
    keys: Vec<String>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut u = self.unloading.lock().expect("unloading lock");
        for k in &self.keys {
            if let Some(n) = u.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    u.remove(k);
                }
            }
        }
    }
}
