//! The broker's side of the admin API: topic operations for the tenancy crate's gRPC service
//! ([`meridian_tenancy::service::TopicOps`]), and starting that service next to the broker.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use meridian_protocol::pb::ServerError;
use meridian_storage::autorecovery;
use meridian_tenancy::model::ClusterData;
use meridian_tenancy::pb;
use meridian_tenancy::service::{AdminService, Route, RunningAdmin, TopicOps};
use meridian_tenancy::{AdminError, TenancyStore};

use crate::broker::{compaction, Broker, BrokerError, Topic, TopicStats};
use crate::topic_name::TopicName;

/// The admin API's view of a broker error.
fn admin_error(e: BrokerError) -> AdminError {
    match e.code {
        ServerError::TopicNotFound | ServerError::SubscriptionNotFound => {
            AdminError::NotFound(e.message)
        }
        ServerError::InvalidTopicName => AdminError::Invalid(e.message),
        ServerError::MetadataError
        | ServerError::ServiceNotReady
        | ServerError::PersistenceError => AdminError::Unavailable(e.message),
        ServerError::AuthenticationError => AdminError::Unauthenticated(e.message),
        ServerError::AuthorizationError => AdminError::PermissionDenied(e.message),
        _ => AdminError::FailedPrecondition(e.message),
    }
}

fn to_pb(s: TopicStats, terminated: bool, t: &Topic) -> pb::TopicStats {
    let last = t.compaction.last_run();
    let compaction = pb::TopicCompactionStats {
        status: t.compaction.status().name().to_string(),
        last_succeed_ms: last.last_succeed_ms,
        last_failed_ms: last.last_failed_ms,
        last_duration_ms: last.last_duration_ms,
        last_removed_messages: last.last_removed_messages,
    };
    pb::TopicStats {
        topic: s.topic,
        msg_rate_in: s.msg_rate_in,
        msg_rate_out: s.msg_rate_out,
        bytes_rate_in: s.bytes_rate_in,
        bytes_rate_out: s.bytes_rate_out,
        msgs_in_total: s.msgs_in_total,
        msgs_out_total: s.msgs_out_total,
        storage_entries: s.storage_entries,
        storage_bytes: s.storage_bytes,
        producers: s.producers as u32,
        terminated,
        backlog_quota_exceeded: s.backlog_quota_exceeded.unwrap_or_default(),
        compaction: Some(compaction),
        replication: s
            .replication
            .into_iter()
            .map(|r| pb::ReplicationStats {
                remote: r.remote,
                state: r.state,
                reason: r.reason,
                since_ms: r.since_ms,
                backlog_entries: r.backlog_entries,
                oldest_unreplicated_age_ms: r.oldest_unreplicated_age_ms,
                last_acked: r.last_acked,
                entries_acked: r.entries_acked,
                dropped_entries: r.dropped_entries,
            })
            .collect(),
        subscriptions: s
            .subscriptions
            .into_iter()
            .map(|x| pb::SubscriptionStats {
                name: x.name,
                sub_type: x.sub_type,
                durable: x.durable,
                consumers: x.consumers as u32,
                msg_rate_out: x.msg_rate_out,
                msgs_out_total: x.msgs_out_total,
                backlog_entries: x.backlog_entries,
                backlog_bytes: x.backlog_bytes,
                unacked_entries: x.unacked_entries as u64,
                delayed_entries: x.delayed_entries as u64,
                properties: x.properties.into_iter().collect(),
                replicated: x.replicated,
                sync: x
                    .sync
                    .into_iter()
                    .map(|y| pb::SubscriptionSync {
                        remote: y.remote,
                        pending_acks: y.pending_acks,
                        pending_ms: y.pending_ms,
                        held: y.held,
                        error: y.error.unwrap_or_default(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

fn broker_to_pb(b: crate::broker::ownership::BrokerInfo) -> pb::BrokerInfo {
    let l = b.load;
    pb::BrokerInfo {
        id: b.id,
        service_url: b.service_url,
        service_url_tls: b.service_url_tls.unwrap_or_default(),
        http_url: b.http_url,
        admin_url: b.admin_url,
        started_ms: b.started_ms,
        load: Some(pb::BrokerLoad {
            cpu_percent: l.cpu_percent,
            msg_rate_in: l.msg_rate_in,
            msg_rate_out: l.msg_rate_out,
            bytes_rate_in: l.bytes_rate_in,
            bytes_rate_out: l.bytes_rate_out,
            topics: l.topics,
            bundles: l.bundles,
            connections: l.connections,
            memory_bytes: l.memory_bytes,
            reported_ms: l.reported_ms,
        }),
    }
}

fn show_position(p: Option<meridian_storage::managed_ledger::Position>) -> String {
    p.map_or_else(String::new, |p| format!("{}:{}", p.ledger_id, p.entry_id))
}

/// The ranges shown of a cursor's acknowledged ranges (all are counted).
const RANGES_SHOWN: usize = 100;

/// How long `topics lookup` waits out a bundle this broker is unloading.
const LOOKUP_PATIENCE: Duration = Duration::from_secs(5);

async fn internal_stats(t: &Arc<Topic>) -> Result<pb::TopicInternalStats, BrokerError> {
    let (entries, bytes) = t.ml.size().await;
    let mut subs = t.durable_subscription_handles().await?;
    for s in t.subscriptions().await {
        if !subs.iter().any(|d| Arc::ptr_eq(d, &s)) {
            subs.push(s);
        }
    }
    let mut cursors = Vec::new();
    for s in subs {
        let c = s.internal_stats().await;
        cursors.push(pb::CursorInternalStats {
            name: c.name,
            durable: c.durable,
            mark_delete_position: show_position(c.mark_delete),
            read_position: show_position(c.read_position),
            individually_deleted: c
                .acknowledged_ranges
                .iter()
                .take(RANGES_SHOWN)
                .map(|(a, b)| format!("[{}..{}]", show_position(Some(*a)), show_position(Some(*b))))
                .collect(),
            individually_deleted_ranges: c.acknowledged_ranges.len() as u64,
            cursor_ledger: c.cursor_ledger,
            backlog_entries: c.backlog_entries,
            unacked_entries: c.unacked_entries as u64,
            consumers: c.consumers as u32,
        });
    }
    cursors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(pb::TopicInternalStats {
        topic: t.full_name().to_string(),
        managed_ledger: t.ml.name().to_string(),
        entries,
        bytes,
        last_confirmed: show_position(t.ml.last_confirmed()),
        terminated: t.ml.is_terminated().await,
        ledgers: t
            .ml
            .ledgers()
            .await
            .into_iter()
            .map(|l| pb::LedgerInternalStats {
                ledger_id: l.ledger_id,
                entries: l.entries,
                bytes: l.bytes,
                created_ms: l.created_ms,
                closed_ms: l.closed_ms,
            })
            .collect(),
        cursors,
        replication_origins: t.stored_origins().await.ok().flatten().map(|s| {
            pb::ReplicationOriginsStats {
                at: s.at.map_or_else(String::new, |(l, e)| format!("{l}:{e}")),
                highest: s
                    .highest
                    .into_iter()
                    .map(|(site, (l, e))| (site, format!("{l}:{e}")))
                    .collect(),
            }
        }),
        compacted_ledger: t.compaction.view().map(|v| pb::CompactedLedgerStats {
            ledger_id: v.ledger_id,
            entries: v.entries,
            bytes: v.bytes,
            horizon: show_position(Some(v.horizon)),
        }),
    })
}

/// [`TopicOps`] over a broker.
pub struct BrokerTopics(pub Arc<Broker>);

impl BrokerTopics {
    fn name(&self, topic: &str) -> Result<TopicName, AdminError> {
        self.0.check_topic(topic).map_err(admin_error)
    }

    /// The admin URL of the broker that owns a (non-partitioned) topic, when another broker
    /// does; `None` to serve it here.
    async fn owner_admin_url(&self, name: &TopicName) -> Result<Option<String>, AdminError> {
        use crate::broker::ownership::Owner;
        let b = &self.0;
        let bundle = b.ownership.bundle_of(name).await.map_err(admin_error)?;
        let ns = name.namespace();
        Ok(match b.ownership.owner(&ns, &bundle).await {
            Ok(Owner::Other(o)) if !o.admin_url.is_empty() => Some(o.admin_url),
            // Unowned, and not to be taken by this broker (no geo link for a replicated
            // namespace): served where it will be placed.
            Ok(Owner::Nobody) => b
                .placed_instead(&ns, &bundle)
                .await
                .ok()
                .flatten()
                .map(|o| o.admin_url)
                .filter(|u| !u.is_empty()),
            _ => None,
        })
    }

    /// The topic, or each partition of a partitioned topic (all served here), loaded.
    async fn served_topics(
        &self,
        topic: &str,
    ) -> Result<Vec<Arc<crate::broker::Topic>>, AdminError> {
        let name = self.name(topic)?;
        let b = &self.0;
        let names = match name.partition() {
            None => match b.partitions_of(&name).await.map_err(admin_error)? {
                Some((n, _)) => (0..n).map(|i| name.partition_name(i)).collect(),
                None => vec![name],
            },
            Some(_) => vec![name],
        };
        let mut out = Vec::with_capacity(names.len());
        for n in names {
            out.push(b.topic(&n, false).await.map_err(admin_error)?);
        }
        Ok(out)
    }

    /// A subscription an admin call may move (skip, clear, expire, reset): not compaction's,
    /// which only compaction moves (moved by hand, retention could trim what no view covers).
    async fn movable(
        &self,
        topic: &str,
        subscription: &str,
    ) -> Result<Arc<crate::broker::Subscription>, AdminError> {
        if subscription == compaction::COMPACTION_SUBSCRIPTION {
            return Err(AdminError::FailedPrecondition(format!(
                "{subscription} is moved by topic compaction only (`topics compact {topic}`)"
            )));
        }
        self.subscription(topic, subscription).await
    }
}

impl BrokerTopics {
    /// An admin's setting of a registered bookie, kept at `prefix<address>` over its own
    /// configuration (its rack, its group); the bookie shows it within its registration
    /// refresh.
    async fn set_bookie_override(
        &self,
        prefix: &str,
        address: &str,
        value: String,
    ) -> Result<(), AdminError> {
        let known = self
            .0
            .ledger_client()
            .bookies()
            .await
            .map_err(|e| AdminError::Unavailable(e.to_string()))?
            .iter()
            .any(|b| b.address == address);
        if !known {
            return Err(AdminError::NotFound(format!(
                "no bookie {address} is registered"
            )));
        }
        self.0
            .meta
            .put(&format!("{prefix}{address}"), value.into_bytes())
            .await
            .map_err(|e| AdminError::Unavailable(e.to_string()))?;
        Ok(())
    }
}

impl TopicOps for BrokerTopics {
    fn list(&self, namespace: String) -> BoxFuture<'_, Result<Vec<(String, u32)>, AdminError>> {
        async move {
            let b = &self.0;
            let partitioned = b
                .partitioned_topics_of_namespace(&namespace)
                .await
                .map_err(admin_error)?;
            let mut out: Vec<(String, u32)> = partitioned
                .iter()
                .map(|(t, n)| (t.to_string(), *n))
                .collect();
            for t in b
                .topics_of_namespace(&namespace)
                .await
                .map_err(admin_error)?
            {
                let name = TopicName::parse(&t).map_err(|e| admin_error(e.into()))?;
                // Partitions are listed through their topic.
                let is_partition = name
                    .parent()
                    .is_some_and(|p| partitioned.iter().any(|(q, _)| *q == p));
                if !is_partition {
                    out.push((t, 0));
                }
            }
            out.sort();
            Ok(out)
        }
        .boxed()
    }

    fn create(&self, topic: String, partitions: u32) -> BoxFuture<'_, Result<(), AdminError>> {
        async move {
            let name = self.name(&topic)?;
            let b = &self.0;
            if partitions > 0 {
                return b
                    .create_partitioned_topic(&name, partitions)
                    .await
                    .map_err(admin_error);
            }
            if b.topic_exists(&name).await.map_err(admin_error)? {
                return Err(AdminError::AlreadyExists(format!(
                    "topic {name} already exists"
                )));
            }
            if b.partitions_of(&name).await.map_err(admin_error)?.is_some() {
                return Err(AdminError::AlreadyExists(format!(
                    "{name} already exists as a partitioned topic"
                )));
            }
            b.topic_for_broker(&name).await.map_err(admin_error)?;
            Ok(())
        }
        .boxed()
    }

    fn update_partitions(
        &self,
        topic: String,
        partitions: u32,
    ) -> BoxFuture<'_, Result<(), AdminError>> {
        async move {
            let name = self.name(&topic)?;
            self.0
                .update_partitions(&name, partitions)
                .await
                .map_err(admin_error)
        }
        .boxed()
    }

    fn stats(&self, topic: String) -> BoxFuture<'_, Result<pb::TopicStats, AdminError>> {
        async move {
            let name = self.name(&topic)?;
            let t = self.0.topic(&name, false).await.map_err(admin_error)?;
            let terminated = t.ml.is_terminated().await;
            Ok(to_pb(t.stats().await, terminated, &t))
        }
        .boxed()
    }

    fn namespace_stats(
        &self,
        namespace: String,
    ) -> BoxFuture<'_, Result<Vec<pb::TopicStats>, AdminError>> {
        async move {
            use futures::StreamExt;
            let topics: Vec<_> = self
                .0
                .loaded_topics()
                .into_iter()
                .filter(|t| t.name.namespace() == namespace)
                .collect();
            let mut out: Vec<pb::TopicStats> = futures::stream::iter(topics)
                .map(|t| async move {
                    let terminated = t.terminated.load(std::sync::atomic::Ordering::Acquire);
                    to_pb(t.stats().await, terminated, &t)
                })
                .buffer_unordered(64)
                .collect()
                .await;
            out.sort_by(|a, b| a.topic.cmp(&b.topic));
            Ok(out)
        }
        .boxed()
    }

    fn terminate(&self, topic: String) -> BoxFuture<'_, Result<String, AdminError>> {
        async move {
            let name = self.name(&topic)?;
            if self
                .0
                .partitions_of(&name)
                .await
                .map_err(admin_error)?
                .is_some()
            {
                return Err(AdminError::FailedPrecondition(format!(
                    "{name} is partitioned: terminate its partitions ({name}-partition-<i>)"
                )));
            }
            let t = self.0.topic(&name, false).await.map_err(admin_error)?;
            let last = t.terminate().await.map_err(admin_error)?;
            Ok(show_position(last))
        }
        .boxed()
    }

    fn delete(
        &self,
        topic: String,
        force: bool,
        dry_run: bool,
    ) -> BoxFuture<'_, Result<Vec<String>, AdminError>> {
        async move {
            let name = self.name(&topic)?;
            // A global topic: deleted at every site of its replication clusters.
            let remotes = self
                .0
                .remote_replication_clusters(&name)
                .await
                .map_err(admin_error)?;
            if remotes.is_empty() || dry_run {
                let mut plan = self
                    .0
                    .delete_topic(&name, force, dry_run)
                    .await
                    .map_err(admin_error)?;
                if !remotes.is_empty() {
                    plan.push(format!(
                        "the deletion goes to sites {} (a tombstone here keeps their late entries out)",
                        remotes.join(", ")
                    ));
                }
                return Ok(plan);
            }
            // What would refuse the deletion (no such topic, clients without --force) does
            // so before any record changes.
            self.0
                .delete_topic(&name, force, true)
                .await
                .map_err(admin_error)?;
            // Streams for it are refused, and the other sites are to delete it, from before
            // the deletion on; a failed deletion puts the record back as it was.
            let prev = self
                .0
                .tombstone_deleted(&name, remotes)
                .await
                .map_err(admin_error)?;
            match self.0.delete_topic(&name, force, false).await {
                Ok(plan) => {
                    self.0.wake_tombstones();
                    Ok(plan)
                }
                Err(e) => {
                    self.0.restore_tombstone(&name, prev).await;
                    Err(admin_error(e))
                }
            }
        }
        .boxed()
    }

    fn delete_remote_data(
        &self,
        namespace: String,
        sites: Vec<String>,
        dry_run: bool,
    ) -> BoxFuture<'_, Result<Vec<String>, AdminError>> {
        async move {
            let b = &self.0;
            if b.geo.get().is_none() {
                return Err(AdminError::FailedPrecondition(
                    "this site has no geo link (geo.listen) to carry the deletion".into(),
                ));
            }
            let store = TenancyStore::new(b.meta.clone());
            // This site's own copies are not remote data: `topics delete` deletes them.
            let sites: Vec<String> = sites
                .into_iter()
                .filter(|s| *s != b.cfg.cluster_name)
                .collect();
            for s in &sites {
                store.cluster(s).await?;
            }
            if !dry_run {
                // Only sites that left the clusters: one that still replicates the namespace
                // would have its copies deleted and then re-created without their history.
                let clusters = b
                    .namespace_policies(&namespace)
                    .await
                    .map_err(admin_error)?
                    .replication_clusters
                    .unwrap_or_default();
                if let Some(s) = sites.iter().find(|s| clusters.contains(s)) {
                    return Err(AdminError::FailedPrecondition(format!(
                        "{s} is still among the replication clusters of {namespace} ({}): remove it first",
                        clusters.join(",")
                    )));
                }
            }
            let topics = self.list(namespace.clone()).await?;
            let mut plan = Vec::new();
            for (topic, _) in topics {
                let name = TopicName::parse(&topic).map_err(|e| admin_error(e.into()))?;
                // A topic whose own clusters still name a site keeps replicating there.
                let own = b
                    .own_replication_clusters(&name)
                    .await
                    .map_err(admin_error)?;
                let at: Vec<String> = sites.iter().filter(|s| !own.contains(s)).cloned().collect();
                for s in &at {
                    plan.push(format!("{topic} at site {s}"));
                }
                if !dry_run && !at.is_empty() {
                    b.tombstone_remote(&name, at).await.map_err(admin_error)?;
                }
            }
            Ok(plan)
        }
        .boxed()
    }

    fn unload(&self, topic: String) -> BoxFuture<'_, Result<(), AdminError>> {
        async move {
            let name = self.name(&topic)?;
            self.0.unload_topic(&name).await.map_err(admin_error)?;
            Ok(())
        }
        .boxed()
    }

    fn route(&self, topic: String) -> BoxFuture<'_, Result<Route, AdminError>> {
        async move {
            let Ok(name) = self.name(&topic) else {
                return Ok(Route::Here); // refused here, with the reason
            };
            let b = &self.0;
            if !b
                .namespace_exists(&name.namespace())
                .await
                .map_err(admin_error)?
            {
                return Ok(Route::Here);
            }
            // A partitioned topic's partitions may be anywhere: each is served by its owner.
            if name.partition().is_none() {
                if let Some((n, _)) = b.partitions_of(&name).await.map_err(admin_error)? {
                    let mut parts = Vec::with_capacity(n as usize);
                    for i in 0..n {
                        let p = name.partition_name(i);
                        let at = self.owner_admin_url(&p).await?;
                        parts.push((p.to_string(), at));
                    }
                    return Ok(if parts.iter().all(|(_, at)| at.is_none()) {
                        Route::Here
                    } else {
                        Route::Partitions(parts)
                    });
                }
            }
            Ok(match self.owner_admin_url(&name).await? {
                Some(url) => Route::Owner(url),
                None => Route::Here,
            })
        }
        .boxed()
    }

    fn unload_bundles(
        &self,
        namespace: String,
        bundle: Option<String>,
    ) -> BoxFuture<'_, Result<Vec<String>, AdminError>> {
        async move {
            self.0
                .unload_bundles(&namespace, bundle.as_deref())
                .await
                .map_err(admin_error)
        }
        .boxed()
    }

    fn split_bundle(
        &self,
        namespace: String,
        bundle: String,
        unload: bool,
    ) -> BoxFuture<'_, Result<Vec<String>, AdminError>> {
        async move {
            let (lo, hi) = self
                .0
                .split_bundle(&namespace, &bundle, unload)
                .await
                .map_err(admin_error)?;
            Ok(vec![lo, hi])
        }
        .boxed()
    }

    fn bookies(&self) -> BoxFuture<'_, Result<Vec<pb::BookieInfo>, AdminError>> {
        async move {
            let decommissioned =
                autorecovery::decommissioned(self.0.ledger_client().metadata_client())
                    .await
                    .map_err(|e| AdminError::Unavailable(e.to_string()))?;
            let list = self
                .0
                .ledger_client()
                .bookies()
                .await
                .map_err(|e| AdminError::Unavailable(e.to_string()))?;
            let mut out: Vec<pb::BookieInfo> = list
                .into_iter()
                .map(|b| pb::BookieInfo {
                    state: if decommissioned.contains(&b.address) {
                        "decommissioned"
                    } else if b.writable {
                        "writable"
                    } else {
                        "read-only"
                    }
                    .to_string(),
                    address: b.address,
                    rack: b.rack,
                    free_bytes: b.free_bytes,
                    group: b.group,
                })
                .collect();
            out.sort_by(|a, b| a.address.cmp(&b.address));
            Ok(out)
        }
        .boxed()
    }

    fn decommission_bookie(
        &self,
        address: String,
    ) -> BoxFuture<'_, Result<pb::DecommissionStatus, AdminError>> {
        async move {
            let unavailable = |e: String| AdminError::Unavailable(e);
            let client = self.0.ledger_client();
            let registered = client
                .bookies()
                .await
                .map_err(|e| unavailable(e.to_string()))?
                .iter()
                .any(|b| b.address == address);
            let ledgers = autorecovery::ledgers_on(client, &address)
                .await
                .map_err(|e| unavailable(e.to_string()))?;
            let marked = autorecovery::decommissioned(client.metadata_client())
                .await
                .map_err(|e| unavailable(e.to_string()))?
                .contains(&address);
            if !registered && ledgers.is_empty() && !marked {
                return Err(AdminError::NotFound(format!(
                    "no bookie {address} is registered or named by a ledger"
                )));
            }
            if !marked {
                autorecovery::decommission(client.metadata_client(), &address)
                    .await
                    .map_err(|e| unavailable(e.to_string()))?;
                tracing::warn!(bookie = %address, ledgers = ledgers.len(), "bookie decommissioned by an admin");
            }
            Ok(pb::DecommissionStatus {
                address,
                done: ledgers.is_empty(),
                ledgers,
            })
        }
        .boxed()
    }

    fn under_replicated(
        &self,
    ) -> BoxFuture<'_, Result<Vec<pb::UnderReplicatedLedger>, AdminError>> {
        async move {
            let list = autorecovery::under_replicated(self.0.ledger_client().metadata_client())
                .await
                .map_err(|e| AdminError::Unavailable(e.to_string()))?;
            Ok(list
                .into_iter()
                .map(|r| pb::UnderReplicatedLedger {
                    ledger: r.ledger,
                    since_ms: r.since_ms,
                    attempts: r.attempts,
                    last_error: r.last_error,
                    fragments: r
                        .fragments
                        .into_iter()
                        .map(|f| pb::UnderReplicatedFragment {
                            first_entry: f.first_entry,
                            last_entry: f.last_entry,
                            bookies: f.bookies,
                        })
                        .collect(),
                })
                .collect())
        }
        .boxed()
    }

    fn set_bookie_rack(
        &self,
        address: String,
        rack: String,
    ) -> BoxFuture<'_, Result<(), AdminError>> {
        async move {
            let valid = rack.starts_with('/')
                && rack.len() > 1
                && !rack.split('/').skip(1).any(str::is_empty)
                && !rack.chars().any(char::is_whitespace);
            if !valid {
                return Err(AdminError::Invalid(format!(
                    "rack {rack:?} must be /NAME or /NAME/NAME..., without spaces"
                )));
            }
            self.set_bookie_override(
                meridian_storage::ledger::BOOKIE_RACKS_PREFIX,
                &address,
                rack,
            )
            .await
        }
        .boxed()
    }

    fn set_bookie_group(
        &self,
        address: String,
        group: String,
    ) -> BoxFuture<'_, Result<(), AdminError>> {
        async move {
            self.set_bookie_override(
                meridian_storage::ledger::BOOKIE_GROUPS_PREFIX,
                &address,
                group,
            )
            .await
        }
        .boxed()
    }

    fn leader(&self) -> BoxFuture<'_, Result<Option<pb::BrokerInfo>, AdminError>> {
        async move {
            Ok(self
                .0
                .leader()
                .await
                .map_err(admin_error)?
                .map(broker_to_pb))
        }
        .boxed()
    }

    fn brokers(&self) -> BoxFuture<'_, Result<Vec<pb::BrokerInfo>, AdminError>> {
        async move {
            let list = self.0.ownership.brokers().await.map_err(admin_error)?;
            Ok(list.into_iter().map(broker_to_pb).collect())
        }
        .boxed()
    }

    fn lookup(&self, topic: String) -> BoxFuture<'_, Result<pb::TopicLookup, AdminError>> {
        async move {
            use crate::broker::ownership::Lookup;
            let name = self.name(&topic)?;
            let b = &self.0;
            // A bundle this broker is unloading answers ServiceNotReady for a moment; the
            // stock clients look up again, and so does this call, for a bounded time, so that
            // an operator sees the new owner rather than the passing state. Other refusals
            // (an isolation policy that allows no broker, ...) are answered at once.
            let ns = name.namespace();
            let deadline = tokio::time::Instant::now() + LOOKUP_PATIENCE;
            let found = loop {
                match b.lookup(&name, false).await {
                    Err(e)
                        if e.code == ServerError::ServiceNotReady
                            && tokio::time::Instant::now() < deadline
                            && b.ownership
                                .bundle_of(&name)
                                .await
                                .is_ok_and(|bundle| b.ownership.is_releasing(&ns, &bundle)) =>
                    {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    r => break r.map_err(admin_error)?,
                }
            };
            let bundle = b.ownership.bundle_of(&name).await.map_err(admin_error)?;
            let (owner, to) = match found {
                Lookup::Connect => (b.ownership.id(), b.ownership.me()),
                Lookup::Redirect {
                    to,
                    authoritative: false,
                } => (to.id.clone(), to),
                // Placed on that broker by the next lookup there.
                Lookup::Redirect { to, .. } => (String::new(), to),
            };
            Ok(pb::TopicLookup {
                topic: name.to_string(),
                bundle: bundle.name(),
                owner,
                service_url: to.service_url,
                service_url_tls: to.service_url_tls.unwrap_or_default(),
            })
        }
        .boxed()
    }

    fn bundles(&self, namespace: String) -> BoxFuture<'_, Result<Vec<pb::BundleInfo>, AdminError>> {
        async move {
            use crate::broker::ownership::Owner;
            let o = &self.0.ownership;
            // As the store has them now (another broker may have split one).
            o.forget_bundles(&namespace);
            let list = o.bundle_owners(&namespace).await.map_err(admin_error)?;
            Ok(list
                .into_iter()
                .map(|(b, owner)| pb::BundleInfo {
                    range: b.name(),
                    owner: match owner {
                        Owner::Me => o.id(),
                        Owner::Other(x) => x.id,
                        Owner::Nobody => String::new(),
                    },
                })
                .collect())
        }
        .boxed()
    }

    fn compact(&self, topic: String) -> BoxFuture<'_, Result<(), AdminError>> {
        async move {
            let name = self.name(&topic)?;
            let b = &self.0;
            let parts = b.topic_parts(&name).await.map_err(admin_error)?;
            let mut topics = Vec::new();
            for p in parts {
                topics.push(b.topic(&p, false).await.map_err(admin_error)?);
            }
            if let Some(t) = topics
                .iter()
                .find(|t| t.compaction.status() == compaction::Status::Running)
            {
                return Err(AdminError::AlreadyExists(format!(
                    "Compaction already in progress for {}",
                    t.full_name()
                )));
            }
            for t in &topics {
                // A request that came in meanwhile may have started it.
                if !compaction::start(t) {
                    return Err(AdminError::AlreadyExists(format!(
                        "Compaction already in progress for {}",
                        t.full_name()
                    )));
                }
            }
            Ok(())
        }
        .boxed()
    }

    fn compaction_status(
        &self,
        topic: String,
    ) -> BoxFuture<'_, Result<pb::CompactionStatus, AdminError>> {
        async move {
            let name = self.name(&topic)?;
            let b = &self.0;
            let parts = b.topic_parts(&name).await.map_err(admin_error)?;
            let mut states = Vec::new();
            for p in parts {
                let t = b.topic(&p, false).await.map_err(admin_error)?;
                states.push((t.full_name().to_string(), t.compaction.status()));
            }
            // A partitioned topic: running if any partition runs, else failed if any failed.
            let pick = |s: &compaction::Status| {
                states
                    .iter()
                    .find(|(_, x)| std::mem::discriminant(x) == std::mem::discriminant(s))
            };
            let found = pick(&compaction::Status::Running)
                .or_else(|| pick(&compaction::Status::Error(String::new())))
                .or_else(|| pick(&compaction::Status::NotRun))
                .or_else(|| states.first());
            Ok(match found {
                Some((t, s)) => pb::CompactionStatus {
                    status: s.name().to_string(),
                    last_error: match s {
                        compaction::Status::Error(e) if states.len() > 1 => format!("{t}: {e}"),
                        compaction::Status::Error(e) => e.clone(),
                        _ => String::new(),
                    },
                },
                None => pb::CompactionStatus {
                    status: compaction::Status::NotRun.name().to_string(),
                    last_error: String::new(),
                },
            })
        }
        .boxed()
    }

    fn internal_stats(
        &self,
        topic: String,
    ) -> BoxFuture<'_, Result<Vec<pb::TopicInternalStats>, AdminError>> {
        async move {
            let name = self.name(&topic)?;
            let b = &self.0;
            let parts = b.topic_parts(&name).await.map_err(admin_error)?;
            let mut out = Vec::new();
            for p in parts {
                let t = b.topic(&p, false).await.map_err(admin_error)?;
                out.push(internal_stats(&t).await.map_err(admin_error)?);
            }
            Ok(out)
        }
        .boxed()
    }

    fn subscriptions(&self, topic: String) -> BoxFuture<'_, Result<Vec<String>, AdminError>> {
        async move {
            let name = self.name(&topic)?;
            let t = self.0.topic(&name, false).await.map_err(admin_error)?;
            let mut subs = t.durable_subscriptions().await.map_err(admin_error)?;
            subs.sort();
            Ok(subs)
        }
        .boxed()
    }

    fn create_subscription(
        &self,
        r: pb::CreateSubscriptionRequest,
    ) -> BoxFuture<'_, Result<(), AdminError>> {
        async move {
            let name = self.name(&r.topic)?;
            if r.subscription.is_empty() {
                return Err(AdminError::Invalid("empty subscription name".into()));
            }
            let t = self.0.topic(&name, false).await.map_err(admin_error)?;
            if t.durable_subscriptions()
                .await
                .map_err(admin_error)?
                .contains(&r.subscription)
            {
                return Err(AdminError::AlreadyExists(format!(
                    "{name} already has subscription {:?}",
                    r.subscription
                )));
            }
            t.create_subscription(&r.subscription)
                .await
                .map_err(admin_error)?;
            let sub = t
                .subscription_for_admin(&r.subscription)
                .await
                .map_err(admin_error)?;
            use crate::broker::subscription::SeekTo;
            use meridian_storage::cursor::InitialPosition;
            let to = match r.position.as_str() {
                "" | "latest" => SeekTo::Initial(InitialPosition::Latest),
                "earliest" => SeekTo::Initial(InitialPosition::Earliest),
                id => SeekTo::Position(position(id)?),
            };
            sub.reset(to).await.map_err(admin_error)
        }
        .boxed()
    }

    fn delete_subscription(
        &self,
        r: pb::SubscriptionRequest,
    ) -> BoxFuture<'_, Result<Vec<String>, AdminError>> {
        async move {
            let sub = self.subscription(&r.topic, &r.subscription).await?;
            let n = sub.consumer_count().await;
            if n > 0 {
                return Err(AdminError::FailedPrecondition(format!(
                    "subscription {:?} has {n} consumers; close them first",
                    r.subscription
                )));
            }
            let backlog = sub.backlog().await.entries;
            let what = format!(
                "subscription {} of {} (backlog {backlog} entries)",
                r.subscription, r.topic
            );
            if !r.dry_run {
                sub.delete_without_consumers().await.map_err(admin_error)?;
            }
            Ok(vec![what])
        }
        .boxed()
    }

    fn peek(
        &self,
        r: pb::PeekRequest,
    ) -> BoxFuture<'_, Result<Vec<pb::PeekedMessage>, AdminError>> {
        async move {
            let sub = self.subscription(&r.topic, &r.subscription).await?;
            let n = r.count.clamp(1, 1000) as usize;
            let entries = sub.peek(n).await.map_err(admin_error)?;
            Ok(entries
                .into_iter()
                .map(|(p, bytes)| {
                    let entry = meridian_protocol::Entry::parse(bytes).ok();
                    let meta = entry
                        .as_ref()
                        .and_then(|e| e.metadata().ok())
                        .unwrap_or_default();
                    pb::PeekedMessage {
                        message_id: format!("{}:{}", p.ledger_id, p.entry_id),
                        publish_time: meta.publish_time,
                        producer_name: meta.producer_name.clone(),
                        sequence_id: meta.sequence_id,
                        properties: meta
                            .properties
                            .iter()
                            .map(|kv| (kv.key.clone(), kv.value.clone()))
                            .collect(),
                        key: meta.partition_key.clone().unwrap_or_default(),
                        messages: meridian_protocol::entry::message_count(&meta),
                        payload: entry.map(|e| e.payload().to_vec()).unwrap_or_default(),
                    }
                })
                .collect())
        }
        .boxed()
    }

    fn skip(
        &self,
        r: pb::SubscriptionRequest,
        count: Option<u64>,
    ) -> BoxFuture<'_, Result<u64, AdminError>> {
        async move {
            let sub = self.movable(&r.topic, &r.subscription).await?;
            sub.skip(count, r.dry_run).await.map_err(admin_error)
        }
        .boxed()
    }

    fn expire(&self, r: pb::ExpireRequest) -> BoxFuture<'_, Result<u64, AdminError>> {
        async move {
            let sub = self.movable(&r.topic, &r.subscription).await?;
            let cutoff =
                crate::broker::now_ms().saturating_sub(r.expire_seconds.saturating_mul(1000));
            sub.expire_before(cutoff, r.dry_run)
                .await
                .map_err(admin_error)
        }
        .boxed()
    }

    fn set_replicated_subscription(
        &self,
        r: pb::ReplicatedSubscriptionRequest,
    ) -> BoxFuture<'_, Result<(), AdminError>> {
        async move {
            for t in self.served_topics(&r.topic).await? {
                if r.enabled {
                    // The subscription must exist (NotFound otherwise).
                    t.subscription_for_admin(&r.subscription)
                        .await
                        .map_err(admin_error)?;
                    t.enable_replicated(&r.subscription)
                        .await
                        .map_err(admin_error)?;
                } else {
                    t.forget_replicated(&r.subscription).await;
                }
            }
            Ok(())
        }
        .boxed()
    }

    fn geo_cut(&self, r: pb::GeoCutRequest) -> BoxFuture<'_, Result<(), AdminError>> {
        async move {
            let b = &self.0;
            if r.cut {
                b.cut_namespace(&r.namespace, &r.to)
                    .await
                    .map_err(admin_error)?;
            } else {
                let mut topics = Vec::new();
                for t in &r.topics {
                    topics.push(self.name(t)?);
                }
                b.restore_namespace(&r.namespace, &topics)
                    .await
                    .map_err(admin_error)?;
            }
            Ok(())
        }
        .boxed()
    }

    fn probe(&self, topic: String) -> BoxFuture<'_, Result<(), AdminError>> {
        async move {
            for t in self.served_topics(&topic).await? {
                self.0.refuse_if_cut(&t.name).map_err(admin_error)?;
                if t.ml.is_terminated().await {
                    return Err(AdminError::FailedPrecondition(format!(
                        "{} is terminated",
                        t.name
                    )));
                }
            }
            Ok(())
        }
        .boxed()
    }

    fn probe_subscriptions(&self, topic: String) -> BoxFuture<'_, Result<(), AdminError>> {
        async move {
            for t in self.served_topics(&topic).await? {
                t.subscriptions_applied()
                    .await
                    .map_err(AdminError::FailedPrecondition)?;
            }
            Ok(())
        }
        .boxed()
    }

    fn geo_exposure(
        &self,
        r: pb::GeoExposureRequest,
    ) -> BoxFuture<'_, Result<Vec<pb::GeoExposure>, AdminError>> {
        async move {
            let link = self.0.geo.get().cloned().ok_or_else(|| {
                AdminError::FailedPrecondition(format!(
                    "site {} has no geo link (geo.listen)",
                    self.0.cfg.cluster_name
                ))
            })?;
            if r.remote == self.0.cfg.cluster_name {
                return Err(AdminError::Invalid(format!(
                    "{} is this site; name another",
                    r.remote
                )));
            }
            let mut out = Vec::new();
            for t in self.served_topics(&r.topic).await? {
                let e = t.exposure(&link, &r.remote).await;
                out.push(pb::GeoExposure {
                    topic: e.topic,
                    remote: e.remote,
                    entries: e.entries,
                    messages: e.messages,
                    bytes: e.bytes,
                    oldest_ms: e.oldest_ms,
                    oldest_publish_ms: e.oldest_publish_ms,
                    remote_holds: e.remote_holds.map(|p| p.to_string()).unwrap_or_default(),
                    subscriptions: e
                        .subscriptions
                        .into_iter()
                        .map(|(name, n)| pb::SubscriptionExposure {
                            name,
                            entries: n.map_or(0, |x| x.0),
                            messages: n.map_or(0, |x| x.1),
                        })
                        .collect(),
                    error: e.error.unwrap_or_default(),
                });
            }
            Ok(out)
        }
        .boxed()
    }

    fn replicated_subscription(
        &self,
        r: pb::SubscriptionRequest,
    ) -> BoxFuture<'_, Result<bool, AdminError>> {
        async move {
            let mut all = true;
            for t in self.served_topics(&r.topic).await? {
                t.subscription_for_admin(&r.subscription)
                    .await
                    .map_err(admin_error)?;
                all &= t
                    .is_replicated_subscription(&r.subscription)
                    .await
                    .map_err(admin_error)?;
            }
            Ok(all)
        }
        .boxed()
    }

    fn reset_cursor(&self, r: pb::ResetCursorRequest) -> BoxFuture<'_, Result<(), AdminError>> {
        async move {
            use crate::broker::subscription::SeekTo;
            use meridian_storage::cursor::InitialPosition;
            let sub = self.movable(&r.topic, &r.subscription).await?;
            let to = match r.to {
                Some(pb::reset_cursor_request::To::PublishTimeMs(t)) => SeekTo::PublishTime(t),
                Some(pb::reset_cursor_request::To::MessageId(id)) => match id.as_str() {
                    "earliest" => SeekTo::Initial(InitialPosition::Earliest),
                    "latest" => SeekTo::Initial(InitialPosition::Latest),
                    id => SeekTo::Position(position(id)?),
                },
                None => {
                    return Err(AdminError::Invalid(
                        "reset-cursor needs a time or a message id".into(),
                    ))
                }
            };
            sub.reset(to).await.map_err(admin_error)
        }
        .boxed()
    }
}

/// `ledger:entry`
fn position(s: &str) -> Result<meridian_storage::managed_ledger::Position, AdminError> {
    let bad = || AdminError::Invalid(format!("message id {s:?} must be ledger:entry"));
    let (l, e) = s.split_once(':').ok_or_else(bad)?;
    Ok(meridian_storage::managed_ledger::Position::new(
        l.parse().map_err(|_| bad())?,
        e.parse().map_err(|_| bad())?,
    ))
}

impl BrokerTopics {
    async fn subscription(
        &self,
        topic: &str,
        sub: &str,
    ) -> Result<Arc<crate::broker::Subscription>, AdminError> {
        let name = self.name(topic)?;
        let t = self.0.topic(&name, false).await.map_err(admin_error)?;
        t.subscription_for_admin(sub).await.map_err(admin_error)
    }
}

/// Records the site's tenancy defaults (this cluster, with `geo_url` when the site has a geo
/// link, tenant `public`, namespace `public/default`) and starts the admin API on `listener`.
pub async fn start(
    broker: &Arc<Broker>,
    listener: tokio::net::TcpListener,
    geo_url: &str,
) -> anyhow::Result<RunningAdmin> {
    let store = TenancyStore::for_site(broker.meta.clone(), &broker.cfg.cluster_name);
    let addr = listener.local_addr()?;
    store
        .bootstrap_standalone(
            &broker.cfg.cluster_name,
            &ClusterData {
                service_url: broker.service_url.clone(),
                admin_url: format!(
                    "{}://{addr}",
                    if broker.cfg.admin_tls {
                        "https"
                    } else {
                        "http"
                    }
                ),
                geo_url: geo_url.to_string(),
            },
        )
        .await
        .map_err(|e| anyhow::anyhow!("recording the site's tenancy defaults: {e}"))?;
    let mut service = AdminService::new(store, Arc::new(BrokerTopics(Arc::clone(broker))));
    if broker.auth.is_some() {
        let superusers = broker
            .cfg
            .superuser_roles
            .split(',')
            .map(str::trim)
            .filter(|r| !r.is_empty())
            .map(str::to_string)
            .collect();
        service = service.with_superusers(superusers);
    }
    if !broker.cfg.tls_trust_certs_file.is_empty() {
        let ca = std::fs::read(&broker.cfg.tls_trust_certs_file).map_err(|e| {
            anyhow::anyhow!(
                "broker.tls_trust_certs_file {}: {e}",
                broker.cfg.tls_trust_certs_file
            )
        })?;
        service = service.with_peer_tls(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(ca)),
        );
    }
    let tls = if broker.cfg.admin_tls {
        Some(crate::tls::admin_config(&broker.cfg)?)
    } else {
        None
    };
    meridian_tenancy::service::serve(
        listener,
        service,
        broker.auth.clone(),
        tls,
        std::time::Duration::from_millis(broker.cfg.keepalive_interval_ms),
    )
}
