//! The gRPC admin service. Clusters, tenants and namespaces are handled here through the
//! [`TenancyStore`]; topic operations go to the broker through [`TopicOps`] (the broker
//! depends on this crate, not the other way round).

use std::net::SocketAddr;
use std::sync::Arc;

use futures::future::BoxFuture;
use tonic::{Request, Response, Status};

use crate::model::{ClusterData, NamespacePolicies, TenantInfo};
use crate::pb::admin_server::{Admin, AdminServer};
use crate::pb::*;
use crate::store::{AdminError, TenancyStore};

/// What the admin service asks of the broker.
/// Where an admin topic call is served ([`TopicOps::route`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Route {
    /// At this broker (it owns the topic, nobody does, or the call is refused here anyway).
    Here,
    /// At the admin API of the broker that owns the topic.
    Owner(String),
    /// A partitioned topic whose partitions are not all here: each partition where it is
    /// served (`None`: here; else the owner's admin URL).
    Partitions(Vec<(String, Option<String>)>),
}

pub trait TopicOps: Send + Sync + 'static {
    /// Topics of a namespace: (full name, partitions; 0 for a non-partitioned topic),
    /// partitions of partitioned topics folded into their topic.
    fn list(&self, namespace: String) -> BoxFuture<'_, Result<Vec<(String, u32)>, AdminError>>;
    /// Creates a topic; `partitions` 0 makes a non-partitioned one.
    fn create(&self, topic: String, partitions: u32) -> BoxFuture<'_, Result<(), AdminError>>;
    fn update_partitions(
        &self,
        topic: String,
        partitions: u32,
    ) -> BoxFuture<'_, Result<(), AdminError>>;
    fn stats(&self, topic: String) -> BoxFuture<'_, Result<TopicStats, AdminError>>;
    /// The stats of a namespace's topics loaded on this broker.
    fn namespace_stats(
        &self,
        namespace: String,
    ) -> BoxFuture<'_, Result<Vec<TopicStats>, AdminError>>;
    /// Terminates a topic; answers its last message id (`ledger:entry`, empty if none).
    fn terminate(&self, topic: String) -> BoxFuture<'_, Result<String, AdminError>>;
    /// Where an admin call on `topic` is served: here, at the owner's admin API, or (a
    /// partitioned topic with partitions owned by other brokers) partition by partition.
    fn route(&self, topic: String) -> BoxFuture<'_, Result<Route, AdminError>>;
    /// The site's registered brokers.
    fn brokers(&self) -> BoxFuture<'_, Result<Vec<BrokerInfo>, AdminError>>;
    /// Unloads a namespace's bundles (or one); answers the ranges unloaded.
    fn unload_bundles(
        &self,
        namespace: String,
        bundle: Option<String>,
    ) -> BoxFuture<'_, Result<Vec<String>, AdminError>>;
    /// Splits a namespace's bundle; answers the halves.
    fn split_bundle(
        &self,
        namespace: String,
        bundle: String,
        unload: bool,
    ) -> BoxFuture<'_, Result<Vec<String>, AdminError>>;
    /// The site's registered bookies.
    fn bookies(&self) -> BoxFuture<'_, Result<Vec<BookieInfo>, AdminError>>;
    /// Sets a bookie's rack.
    fn set_bookie_rack(
        &self,
        address: String,
        rack: String,
    ) -> BoxFuture<'_, Result<(), AdminError>>;
    /// Sets a bookie's affinity group.
    fn set_bookie_group(
        &self,
        address: String,
        group: String,
    ) -> BoxFuture<'_, Result<(), AdminError>>;
    /// Decommissions a bookie; answers what still names it.
    fn decommission_bookie(
        &self,
        address: String,
    ) -> BoxFuture<'_, Result<DecommissionStatus, AdminError>>;
    /// Ledgers marked under-replicated.
    fn under_replicated(&self) -> BoxFuture<'_, Result<Vec<UnderReplicatedLedger>, AdminError>>;
    /// The load manager's leader.
    fn leader(&self) -> BoxFuture<'_, Result<Option<BrokerInfo>, AdminError>>;
    /// Who serves a topic.
    fn lookup(&self, topic: String) -> BoxFuture<'_, Result<TopicLookup, AdminError>>;
    /// A namespace's bundles and owners.
    fn bundles(&self, namespace: String) -> BoxFuture<'_, Result<Vec<BundleInfo>, AdminError>>;
    /// Starts compacting a topic (every partition of a partitioned one).
    fn compact(&self, topic: String) -> BoxFuture<'_, Result<(), AdminError>>;
    /// The state of a topic's last compaction on this broker.
    fn compaction_status(
        &self,
        topic: String,
    ) -> BoxFuture<'_, Result<CompactionStatus, AdminError>>;
    /// Deletes a topic (or lists what would go); answers what goes.
    fn delete(
        &self,
        topic: String,
        force: bool,
        dry_run: bool,
    ) -> BoxFuture<'_, Result<Vec<String>, AdminError>>;
    /// Deletes the namespace's topics at other `sites` (over the geo link), or lists what
    /// would go.
    fn delete_remote_data(
        &self,
        namespace: String,
        sites: Vec<String>,
        dry_run: bool,
    ) -> BoxFuture<'_, Result<Vec<String>, AdminError>> {
        let _ = (namespace, sites, dry_run);
        Box::pin(async {
            Err(AdminError::FailedPrecondition(
                "this site has no geo link".into(),
            ))
        })
    }
    fn unload(&self, topic: String) -> BoxFuture<'_, Result<(), AdminError>>;
    fn internal_stats(
        &self,
        topic: String,
    ) -> BoxFuture<'_, Result<Vec<crate::pb::TopicInternalStats>, AdminError>>;
    fn subscriptions(&self, topic: String) -> BoxFuture<'_, Result<Vec<String>, AdminError>>;
    fn create_subscription(
        &self,
        r: CreateSubscriptionRequest,
    ) -> BoxFuture<'_, Result<(), AdminError>>;
    /// Deletes a subscription without consumers; answers what goes.
    fn delete_subscription(
        &self,
        r: SubscriptionRequest,
    ) -> BoxFuture<'_, Result<Vec<String>, AdminError>>;
    fn peek(&self, r: PeekRequest) -> BoxFuture<'_, Result<Vec<PeekedMessage>, AdminError>>;
    /// Acknowledges entries: `count` of them, or (`None`) the whole backlog.
    fn skip(
        &self,
        r: SubscriptionRequest,
        count: Option<u64>,
    ) -> BoxFuture<'_, Result<u64, AdminError>>;
    fn expire(&self, r: ExpireRequest) -> BoxFuture<'_, Result<u64, AdminError>>;
    fn reset_cursor(&self, r: ResetCursorRequest) -> BoxFuture<'_, Result<(), AdminError>>;
    /// Makes a subscription replicated, or not.
    fn set_replicated_subscription(
        &self,
        r: ReplicatedSubscriptionRequest,
    ) -> BoxFuture<'_, Result<(), AdminError>>;
    /// Whether a subscription is replicated.
    fn replicated_subscription(
        &self,
        r: SubscriptionRequest,
    ) -> BoxFuture<'_, Result<bool, AdminError>>;
    /// A failover drill's cut of a namespace over to another site, or its end.
    fn geo_cut(&self, r: GeoCutRequest) -> BoxFuture<'_, Result<(), AdminError>>;
    /// Whether the topic (each partition) is served here now.
    fn probe(&self, topic: String) -> BoxFuture<'_, Result<(), AdminError>>;
    /// Whether the topic's (each partition's) replicated subscriptions have applied what the
    /// other sites said of the entries held here.
    fn probe_subscriptions(&self, topic: String) -> BoxFuture<'_, Result<(), AdminError>>;
    /// What `remote` would lose if this site were lost now: the topic's (each partition's).
    fn geo_exposure(
        &self,
        r: GeoExposureRequest,
    ) -> BoxFuture<'_, Result<Vec<GeoExposure>, AdminError>>;
}

pub struct AdminService {
    store: TenancyStore,
    topics: Arc<dyn TopicOps>,
    /// With authentication on: the roles that may do everything. Off: everyone may.
    authz: Option<Vec<String>>,
    /// How this broker checks another broker's https admin API when it forwards a call
    /// there (the CA that issued its certificate); `None`: https peers are not forwarded to.
    peer_tls: Option<tonic::transport::ClientTlsConfig>,
}

/// What a role may administer (with authentication on):
/// - superusers: everything;
/// - a tenant's admin roles: that tenant's namespaces, topics and subscriptions, and reading
///   the tenant; listings show them only their tenants;
/// - any authenticated role: reading the clusters.
///
/// Creating, updating or deleting clusters and tenants is for superusers. A refusal is
/// PERMISSION_DENIED and says nothing of whether the target exists.
impl AdminService {
    /// Deletes a namespace; with `force`, its topics first (their clients are closed).
    /// With `dry_run`, lists what would go.
    async fn delete_namespace_with_topics(
        &self,
        ns: &str,
        force: bool,
        dry_run: bool,
    ) -> Result<Vec<String>, AdminError> {
        self.store.policies(ns).await?;
        let topics: Vec<String> = self
            .topics
            .list(ns.to_string())
            .await?
            .into_iter()
            .map(|(t, _)| t)
            .collect();
        if !force {
            return self.store.delete_namespace(ns, &topics, dry_run).await;
        }
        let mut out = Vec::new();
        for t in topics {
            out.extend(self.topics.delete(t, true, dry_run).await?);
        }
        let left: Vec<String> = if dry_run {
            Vec::new()
        } else {
            // A producer may have created a topic meanwhile: then the namespace stays.
            self.topics
                .list(ns.to_string())
                .await?
                .into_iter()
                .map(|(t, _)| t)
                .collect()
        };
        out.extend(self.store.delete_namespace(ns, &left, dry_run).await?);
        Ok(out)
    }

    pub fn new(store: TenancyStore, topics: Arc<dyn TopicOps>) -> AdminService {
        AdminService {
            store,
            topics,
            authz: None,
            peer_tls: None,
        }
    }

    /// Forwards calls to other brokers' https admin APIs, checking their certificates with
    /// `tls` (only the caller's bearer token goes along: no client certificate is presented,
    /// so a forwarded call never carries this broker's identity).
    pub fn with_peer_tls(mut self, tls: tonic::transport::ClientTlsConfig) -> AdminService {
        self.peer_tls = Some(tls);
        self
    }

    /// Turns authorization on, with these superusers.
    pub fn with_superusers(mut self, superusers: Vec<String>) -> AdminService {
        self.authz = Some(superusers);
        self
    }

    fn is_superuser(&self, role: Option<&Role>) -> bool {
        match &self.authz {
            None => true,
            Some(su) => role.is_some_and(|r| su.contains(&r.0)),
        }
    }

    fn superuser(&self, role: Option<&Role>) -> Result<(), Status> {
        if self.is_superuser(role) {
            Ok(())
        } else {
            Err(Status::permission_denied("only a superuser may do this"))
        }
    }

    /// Superusers and the tenant's admin roles. An unknown tenant is refused like a known one.
    async fn tenant_admin(&self, role: Option<&Role>, tenant: &str) -> Result<(), Status> {
        if self.is_superuser(role) {
            return Ok(());
        }
        let admin = match (role, self.store.tenant(tenant).await) {
            (Some(r), Ok(t)) => t.admin_roles.contains(&r.0),
            (_, Err(AdminError::Unavailable(m))) => return Err(Status::unavailable(m)),
            _ => false,
        };
        if admin {
            Ok(())
        } else {
            Err(Status::permission_denied(format!(
                "role {} may not administer tenant {tenant}",
                role.map_or("(none)", |r| r.0.as_str())
            )))
        }
    }
}

impl AdminService {
    /// Reading a namespace's topics (lists, stats): superusers, the tenant's admins, and roles
    /// granted produce or consume there, as Pulsar's lookup permission. An unknown namespace
    /// is refused like a known one.
    async fn namespace_reader(&self, role: Option<&Role>, ns: &str) -> Result<(), Status> {
        if self
            .tenant_admin(role, tenant_of_namespace(ns))
            .await
            .is_ok()
        {
            return Ok(());
        }
        let granted = match (role, self.store.policies(ns).await) {
            (Some(r), Ok((p, _))) => p.permissions.get(&r.0).is_some_and(|a| !a.is_empty()),
            (_, Err(AdminError::Unavailable(m))) => return Err(Status::unavailable(m)),
            _ => false,
        };
        if granted {
            Ok(())
        } else {
            Err(Status::permission_denied(format!(
                "role {} may not read namespace {ns}",
                role.map_or("(none)", |r| r.0.as_str())
            )))
        }
    }
}

/// The tenant of `tenant/namespace`.
fn tenant_of_namespace(ns: &str) -> &str {
    ns.split('/').next().unwrap_or(ns)
}

/// The tenant of a topic name in any form clients use (`x` is in `public/default`).
fn tenant_of_topic(topic: &str) -> &str {
    let rest = topic
        .strip_prefix("persistent://")
        .or_else(|| topic.strip_prefix("non-persistent://"))
        .unwrap_or(topic);
    let parts: Vec<&str> = rest.split('/').collect();
    if parts.len() >= 3 {
        parts[0]
    } else {
        "public"
    }
}

/// The namespace of a topic name in any form clients use (`x` is in `public/default`).
fn namespace_of_topic(topic: &str) -> String {
    let rest = topic
        .strip_prefix("persistent://")
        .or_else(|| topic.strip_prefix("non-persistent://"))
        .unwrap_or(topic);
    let parts: Vec<&str> = rest.split('/').collect();
    if parts.len() >= 3 {
        format!("{}/{}", parts[0], parts[1])
    } else {
        "public/default".to_string()
    }
}

fn role_of<T>(r: &Request<T>) -> Option<Role> {
    r.extensions().get::<Role>().cloned()
}

/// A namespace's or topic's policies as an admin request carries them (absent: none set).
pub fn policies_from(p: Option<crate::pb::NamespacePolicies>) -> NamespacePolicies {
    let p = p.unwrap_or_default();
    NamespacePolicies {
        deduplication_enabled: p.deduplication_enabled,
        dead_letter_max_redeliveries: p.dead_letter_max_redeliveries,
        schema_compatibility_strategy: p.schema_compatibility_strategy,
        message_ttl_seconds: p.message_ttl_seconds,
        max_producers_per_topic: p.max_producers_per_topic,
        max_consumers_per_topic: p.max_consumers_per_topic,
        max_subscriptions_per_topic: p.max_subscriptions_per_topic,
        backlog_quota: p.backlog_quota.map(quota_from),
        replication_backlog_quota: p.replication_backlog_quota.map(quota_from),
        max_replication_lag: p
            .max_replication_lag
            .map(|l| crate::model::MaxReplicationLag {
                time_seconds: l.time_seconds,
                entries: l.entries,
                policy: l.policy,
            }),
        retention: p.retention.map(|r| crate::model::Retention {
            time_minutes: r.time_minutes,
            size_mb: r.size_mb,
        }),
        publish_rate: p.publish_rate.map(rate_from),
        dispatch_rate: p.dispatch_rate.map(rate_from),
        subscription_dispatch_rate: p.subscription_dispatch_rate.map(rate_from),
        publish_rate_total: p.publish_rate_total.map(rate_from),
        dispatch_rate_total: p.dispatch_rate_total.map(rate_from),
        compaction_threshold: p.compaction_threshold,
        bookie_affinity_group: p
            .bookie_affinity_group
            .map(|g| crate::model::BookieAffinityGroup {
                primary: g.primary,
                secondary: g.secondary,
            }),
        replication_clusters: p.replication_clusters.map(|c| c.names),
        permissions: Default::default(),
    }
}

fn quota_from(q: crate::pb::BacklogQuota) -> crate::model::BacklogQuota {
    crate::model::BacklogQuota {
        limit_size_bytes: q.limit_size_bytes,
        limit_time_seconds: q.limit_time_seconds,
        policy: q.policy,
    }
}

fn quota_to(q: &crate::model::BacklogQuota) -> crate::pb::BacklogQuota {
    crate::pb::BacklogQuota {
        limit_size_bytes: q.limit_size_bytes,
        limit_time_seconds: q.limit_time_seconds,
        policy: q.policy.clone(),
    }
}

fn rate_from(r: crate::pb::RateLimit) -> crate::model::RateLimit {
    crate::model::RateLimit {
        msgs_per_sec: r.msgs_per_sec,
        bytes_per_sec: r.bytes_per_sec,
    }
}

fn rate_to(r: &crate::model::RateLimit) -> crate::pb::RateLimit {
    crate::pb::RateLimit {
        msgs_per_sec: r.msgs_per_sec,
        bytes_per_sec: r.bytes_per_sec,
    }
}

/// Policies as an admin answer carries them (the inverse of [`policies_from`], permissions
/// aside: they have calls of their own).
pub fn policies_to(p: &NamespacePolicies) -> crate::pb::NamespacePolicies {
    crate::pb::NamespacePolicies {
        deduplication_enabled: p.deduplication_enabled,
        dead_letter_max_redeliveries: p.dead_letter_max_redeliveries,
        schema_compatibility_strategy: p.schema_compatibility_strategy.clone(),
        message_ttl_seconds: p.message_ttl_seconds,
        max_producers_per_topic: p.max_producers_per_topic,
        max_consumers_per_topic: p.max_consumers_per_topic,
        max_subscriptions_per_topic: p.max_subscriptions_per_topic,
        backlog_quota: p.backlog_quota.as_ref().map(quota_to),
        replication_backlog_quota: p.replication_backlog_quota.as_ref().map(quota_to),
        max_replication_lag: p
            .max_replication_lag
            .as_ref()
            .map(|l| crate::pb::MaxReplicationLag {
                time_seconds: l.time_seconds,
                entries: l.entries,
                policy: l.policy.clone(),
            }),
        retention: p.retention.as_ref().map(|r| crate::pb::Retention {
            time_minutes: r.time_minutes,
            size_mb: r.size_mb,
        }),
        publish_rate: p.publish_rate.as_ref().map(rate_to),
        dispatch_rate: p.dispatch_rate.as_ref().map(rate_to),
        subscription_dispatch_rate: p.subscription_dispatch_rate.as_ref().map(rate_to),
        publish_rate_total: p.publish_rate_total.as_ref().map(rate_to),
        dispatch_rate_total: p.dispatch_rate_total.as_ref().map(rate_to),
        compaction_threshold: p.compaction_threshold,
        bookie_affinity_group: p.bookie_affinity_group.as_ref().map(|g| {
            crate::pb::BookieAffinityGroup {
                primary: g.primary.clone(),
                secondary: g.secondary.clone(),
            }
        }),
        replication_clusters: p
            .replication_clusters
            .as_ref()
            .map(|names| crate::pb::ClusterList {
                names: names.clone(),
            }),
    }
}

fn permissions_to(p: std::collections::BTreeMap<String, Vec<String>>) -> Permissions {
    Permissions {
        roles: p
            .into_iter()
            .map(|(role, actions)| (role, Actions { actions }))
            .collect(),
    }
}

type Reply<T> = Result<Response<T>, Status>;

fn ok<T>(t: T) -> Reply<T> {
    Ok(Response::new(t))
}

/// Marks a call forwarded by another broker: it is served where it arrives, never forwarded
/// again.
const FORWARDED: &str = "x-meridian-forwarded";

/// A request made on the caller's behalf (its credentials, its role when served here),
/// marked as forwarded.
fn on_behalf<T, U>(r: &Request<T>, body: U) -> Request<U> {
    let mut fwd = Request::new(body);
    if let Some(a) = r.metadata().get("authorization") {
        fwd.metadata_mut().insert("authorization", a.clone());
    }
    fwd.metadata_mut()
        .insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
    if let Some(role) = role_of(r) {
        fwd.extensions_mut().insert(role);
    }
    fwd
}

/// Calls `$method` with `$fwd` at the admin API `$url` (with a deadline), or here (`None`).
macro_rules! call_at {
    ($self:ident, $url:expr, $fwd:expr, $method:ident) => {
        match $url {
            Some(url) => {
                let fwd = $fwd;
                // Only a bearer token crosses to the other broker: a caller authenticated by
                // its client certificate would arrive there as nobody.
                if fwd.extensions().get::<Role>().is_some()
                    && fwd.metadata().get("authorization").is_none()
                {
                    return Err(Status::unavailable(format!(
                        "the topic is served by the broker whose admin API is {url}; a caller \
                         authenticated by a client certificate must call it there"
                    )));
                }
                let mut c = peer(url, $self.peer_tls.as_ref()).await?;
                match tokio::time::timeout(std::time::Duration::from_secs(60), c.$method(fwd)).await
                {
                    Ok(r) => r,
                    Err(_) => Err(Status::deadline_exceeded(format!(
                        "the topic's broker at {url} did not answer within 60 s"
                    ))),
                }
            }
            None => $self.$method($fwd).await,
        }
    };
}

/// A topic call made at a broker that does not own the topic goes to the owner's admin API,
/// with the caller's credentials; the owner authorizes and answers. With `$merge`, a
/// partitioned topic whose partitions are not all here is served partition by partition
/// (each at its owner) and the answers merged; without, such a call is served here (where it
/// is refused: those operations take a partition or a non-partitioned topic).
macro_rules! forward {
    ($self:ident, $r:ident, $field:ident, $method:ident) => {
        if $r.metadata().get(FORWARDED).is_none() {
            if let Route::Owner(url) = $self.topics.route($r.get_ref().$field.to_string()).await? {
                let fwd = on_behalf(&$r, $r.get_ref().clone());
                return call_at!($self, Some(url.as_str()), fwd, $method);
            }
        }
    };
    ($self:ident, $r:ident, $field:ident, $method:ident, $merge:expr) => {
        if $r.metadata().get(FORWARDED).is_none() {
            match $self.topics.route($r.get_ref().$field.to_string()).await? {
                Route::Here => {}
                Route::Owner(url) => {
                    let fwd = on_behalf(&$r, $r.get_ref().clone());
                    return call_at!($self, Some(url.as_str()), fwd, $method);
                }
                Route::Partitions(parts) => {
                    let mut answers = Vec::with_capacity(parts.len());
                    for (p, url) in &parts {
                        let mut body = $r.get_ref().clone();
                        body.$field = p.clone();
                        let fwd = on_behalf(&$r, body);
                        match call_at!($self, url.as_deref(), fwd, $method) {
                            Ok(a) => answers.push(a.into_inner()),
                            // A partition never written to has no log: nothing there.
                            Err(s) if s.code() == tonic::Code::NotFound => {}
                            Err(s) => return Err(s),
                        }
                    }
                    #[allow(clippy::redundant_closure_call)]
                    return ok(($merge)(answers));
                }
            }
        }
    };
}

/// A partitioned topic's compaction status from its partitions': running if any runs, else
/// failed if any failed (naming the partition), else not run if any has not, else the first.
fn merged_compaction_status(all: &[(String, CompactionStatus)]) -> CompactionStatus {
    let pick = |status: &str| all.iter().find(|(_, s)| s.status == status);
    match pick("RUNNING")
        .or_else(|| pick("ERROR"))
        .or_else(|| pick("NOT_RUN"))
        .or_else(|| all.first())
    {
        Some((p, s)) => CompactionStatus {
            status: s.status.clone(),
            last_error: if s.last_error.is_empty() {
                String::new()
            } else {
                format!("{p}: {}", s.last_error)
            },
        },
        None => CompactionStatus {
            status: "NOT_RUN".into(),
            last_error: String::new(),
        },
    }
}

/// A client of another broker's admin API: plaintext, or https checked with `tls`.
async fn peer(
    url: &str,
    tls: Option<&tonic::transport::ClientTlsConfig>,
) -> Result<crate::pb::admin_client::AdminClient<tonic::transport::Channel>, Status> {
    let mut endpoint = tonic::transport::Endpoint::from_shared(url.to_string())
        .map_err(|e| Status::internal(format!("admin URL {url}: {e}")))?;
    if url.starts_with("https://") {
        let Some(tls) = tls else {
            return Err(Status::unavailable(format!(
                "the topic is served by the broker whose admin API is {url}; call it there \
                 (or set broker.tls_trust_certs_file to the CA of its certificate)"
            )));
        };
        endpoint = endpoint
            .tls_config(tls.clone())
            .map_err(|e| Status::internal(format!("admin URL {url}: {e}")))?;
    } else if !url.starts_with("http://") {
        return Err(Status::unavailable(format!(
            "the topic is served by the broker whose admin API is {url}; call it there"
        )));
    }
    let ch = endpoint
        .connect_timeout(std::time::Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| Status::unavailable(format!("the topic's broker at {url}: {e}")))?;
    Ok(crate::pb::admin_client::AdminClient::new(ch))
}

impl AdminService {
    /// Each partition's compaction status, asked where the partition is served; partitions
    /// never written to are left out.
    async fn partition_compaction_statuses<T>(
        &self,
        r: &Request<T>,
        parts: &[(String, Option<String>)],
    ) -> Result<Vec<(String, CompactionStatus)>, Status> {
        let mut out = Vec::with_capacity(parts.len());
        for (p, url) in parts {
            let fwd = on_behalf(r, Name { name: p.clone() });
            match call_at!(self, url.as_deref(), fwd, get_compaction_status) {
                Ok(a) => out.push((p.clone(), a.into_inner())),
                Err(s) if s.code() == tonic::Code::NotFound => {}
                Err(s) => return Err(s),
            }
        }
        Ok(out)
    }

    /// Deletes a partitioned topic whose partitions are served by several brokers: every
    /// partition is checked first (at its owner, as a dry run), then each is deleted where it
    /// is served, then the partitioned topic's record here.
    async fn delete_partitioned(
        &self,
        r: Request<DeleteRequest>,
        parts: Vec<(String, Option<String>)>,
    ) -> Reply<DeleteResponse> {
        let d = r.get_ref().clone();
        let mut deleted = vec![format!(
            "partitioned topic {} ({} partitions)",
            d.name,
            parts.len()
        )];
        for (p, url) in &parts {
            let check = DeleteRequest {
                name: p.clone(),
                dry_run: true,
                ..d.clone()
            };
            match call_at!(self, url.as_deref(), on_behalf(&r, check), delete_topic) {
                Ok(a) => deleted.extend(a.into_inner().deleted),
                // A partition never written to has no log: nothing to delete for it.
                Err(s) if s.code() == tonic::Code::NotFound => {}
                Err(s) => return Err(s),
            }
        }
        if d.dry_run {
            return ok(DeleteResponse {
                deleted,
                dry_run: true,
            });
        }
        for (p, url) in &parts {
            let del = DeleteRequest {
                name: p.clone(),
                ..d.clone()
            };
            match call_at!(self, url.as_deref(), on_behalf(&r, del), delete_topic) {
                Ok(_) => {}
                Err(s) if s.code() == tonic::Code::NotFound => {}
                Err(s) => return Err(s),
            }
        }
        // The partitions are gone: what is left here is the record (and schema, policies).
        self.topics.delete(d.name, d.force, false).await?;
        ok(DeleteResponse {
            deleted,
            dry_run: false,
        })
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn list_clusters(&self, _: Request<Empty>) -> Reply<Names> {
        ok(Names {
            names: self.store.clusters().await?,
        })
    }

    async fn get_cluster(&self, r: Request<Name>) -> Reply<Cluster> {
        let name = r.into_inner().name;
        let c = self.store.cluster(&name).await?;
        ok(Cluster {
            name,
            service_url: c.service_url,
            admin_url: c.admin_url,
            geo_url: c.geo_url,
        })
    }

    async fn create_cluster(&self, r: Request<Cluster>) -> Reply<Empty> {
        self.superuser(role_of(&r).as_ref())?;
        let c = r.into_inner();
        let data = ClusterData {
            service_url: c.service_url,
            admin_url: c.admin_url,
            geo_url: c.geo_url,
        };
        self.store.create_cluster(&c.name, &data).await?;
        ok(Empty {})
    }

    async fn update_cluster(&self, r: Request<Cluster>) -> Reply<Empty> {
        self.superuser(role_of(&r).as_ref())?;
        let c = r.into_inner();
        let data = ClusterData {
            service_url: c.service_url,
            admin_url: c.admin_url,
            geo_url: c.geo_url,
        };
        self.store.update_cluster(&c.name, &data).await?;
        ok(Empty {})
    }

    async fn delete_cluster(&self, r: Request<DeleteRequest>) -> Reply<DeleteResponse> {
        self.superuser(role_of(&r).as_ref())?;
        let d = r.into_inner();
        let deleted = self.store.delete_cluster(&d.name, d.dry_run).await?;
        ok(DeleteResponse {
            deleted,
            dry_run: d.dry_run,
        })
    }

    async fn list_tenants(&self, r: Request<Empty>) -> Reply<Names> {
        let role = role_of(&r);
        let mut names = Vec::new();
        for t in self.store.tenants().await? {
            if self.tenant_admin(role.as_ref(), &t).await.is_ok() {
                names.push(t);
            }
        }
        ok(Names { names })
    }

    async fn get_tenant(&self, r: Request<Name>) -> Reply<Tenant> {
        let role = role_of(&r);
        let name = r.into_inner().name;
        self.tenant_admin(role.as_ref(), &name).await?;
        let t = self.store.tenant(&name).await?;
        ok(Tenant {
            name,
            admin_roles: t.admin_roles,
            allowed_clusters: t.allowed_clusters,
            storage_quota_bytes: t.storage_quota_bytes,
        })
    }

    async fn create_tenant(&self, r: Request<Tenant>) -> Reply<Empty> {
        self.superuser(role_of(&r).as_ref())?;
        let t = r.into_inner();
        let info = TenantInfo {
            admin_roles: t.admin_roles,
            allowed_clusters: t.allowed_clusters,
            storage_quota_bytes: t.storage_quota_bytes.filter(|q| *q > 0),
        };
        self.store.create_tenant(&t.name, &info).await?;
        ok(Empty {})
    }

    async fn update_tenant(&self, r: Request<Tenant>) -> Reply<Empty> {
        self.superuser(role_of(&r).as_ref())?;
        let t = r.into_inner();
        // Left out: unchanged (as the store reads it, so a change made meanwhile stays).
        let keep_quota = t.storage_quota_bytes.is_none();
        let info = TenantInfo {
            admin_roles: t.admin_roles,
            allowed_clusters: t.allowed_clusters,
            storage_quota_bytes: t.storage_quota_bytes.filter(|q| *q > 0),
        };
        self.store.update_tenant(&t.name, &info, keep_quota).await?;
        ok(Empty {})
    }

    async fn delete_tenant(&self, r: Request<DeleteRequest>) -> Reply<DeleteResponse> {
        self.superuser(role_of(&r).as_ref())?;
        let d = r.into_inner();
        let mut deleted = Vec::new();
        if d.force {
            self.store.tenant(&d.name).await?;
            for ns in self.store.namespaces(&d.name).await? {
                deleted.extend(
                    self.delete_namespace_with_topics(&ns, true, d.dry_run)
                        .await?,
                );
            }
        }
        let left = if d.force && d.dry_run {
            // The namespaces listed above would be gone.
            self.store.tenant_deletion_plan(&d.name).await?
        } else {
            self.store.delete_tenant(&d.name, d.dry_run).await?
        };
        deleted.extend(left);
        ok(DeleteResponse {
            deleted,
            dry_run: d.dry_run,
        })
    }

    async fn list_namespaces(&self, r: Request<Name>) -> Reply<Names> {
        let role = role_of(&r);
        let tenant = r.into_inner().name;
        self.tenant_admin(role.as_ref(), &tenant).await?;
        self.store.tenant(&tenant).await?;
        ok(Names {
            names: self.store.namespaces(&tenant).await?,
        })
    }

    async fn get_topic_policies(&self, r: Request<Name>) -> Reply<Namespace> {
        let role = role_of(&r);
        let name = r.into_inner().name;
        self.tenant_admin(role.as_ref(), tenant_of_topic(&name))
            .await?;
        let (p, _) = self.store.topic_policies(&name).await?;
        ok(Namespace {
            name,
            policies: Some(policies_to(&p)),
        })
    }

    async fn update_topic_policies(&self, r: Request<UpdatePoliciesRequest>) -> Reply<Namespace> {
        let role = role_of(&r);
        let u = r.into_inner();
        self.tenant_admin(role.as_ref(), tenant_of_topic(&u.namespace))
            .await?;
        let p = self
            .store
            .update_topic_policies(&u.namespace, &policies_from(u.set), &u.clear)
            .await?;
        ok(Namespace {
            name: u.namespace,
            policies: Some(policies_to(&p)),
        })
    }

    async fn get_namespace(&self, r: Request<Name>) -> Reply<Namespace> {
        let role = role_of(&r);
        let name = r.into_inner().name;
        self.tenant_admin(role.as_ref(), tenant_of_namespace(&name))
            .await?;
        let (p, _) = self.store.policies(&name).await?;
        ok(Namespace {
            name,
            policies: Some(policies_to(&p)),
        })
    }

    async fn create_namespace(&self, r: Request<Namespace>) -> Reply<Empty> {
        let role = role_of(&r);
        let n = r.into_inner();
        self.tenant_admin(role.as_ref(), tenant_of_namespace(&n.name))
            .await?;
        self.store
            .create_namespace(&n.name, &policies_from(n.policies))
            .await?;
        ok(Empty {})
    }

    async fn update_namespace_policies(
        &self,
        r: Request<UpdatePoliciesRequest>,
    ) -> Reply<Namespace> {
        let role = role_of(&r);
        let u = r.into_inner();
        self.tenant_admin(role.as_ref(), tenant_of_namespace(&u.namespace))
            .await?;
        let p = self
            .store
            .update_policies(&u.namespace, &policies_from(u.set), &u.clear)
            .await?;
        ok(Namespace {
            name: u.namespace,
            policies: Some(policies_to(&p)),
        })
    }

    async fn delete_namespace(&self, r: Request<DeleteRequest>) -> Reply<DeleteResponse> {
        let role = role_of(&r);
        let d = r.into_inner();
        self.tenant_admin(role.as_ref(), tenant_of_namespace(&d.name))
            .await?;
        let deleted = self
            .delete_namespace_with_topics(&d.name, d.force, d.dry_run)
            .await?;
        ok(DeleteResponse {
            deleted,
            dry_run: d.dry_run,
        })
    }

    async fn grant_permission(&self, r: Request<PermissionRequest>) -> Reply<Permissions> {
        let role = role_of(&r);
        let g = r.into_inner();
        self.tenant_admin(role.as_ref(), tenant_of_namespace(&g.namespace))
            .await?;
        let p = self
            .store
            .set_permission(&g.namespace, &g.role, Some(g.actions))
            .await?;
        ok(permissions_to(p))
    }

    async fn revoke_permission(&self, r: Request<PermissionRequest>) -> Reply<Permissions> {
        let role = role_of(&r);
        let g = r.into_inner();
        self.tenant_admin(role.as_ref(), tenant_of_namespace(&g.namespace))
            .await?;
        let p = self
            .store
            .set_permission(&g.namespace, &g.role, None)
            .await?;
        ok(permissions_to(p))
    }

    async fn get_permissions(&self, r: Request<Name>) -> Reply<Permissions> {
        let role = role_of(&r);
        let ns = r.into_inner().name;
        self.tenant_admin(role.as_ref(), tenant_of_namespace(&ns))
            .await?;
        let (p, _) = self.store.policies(&ns).await?;
        ok(permissions_to(p.permissions))
    }

    async fn list_topics(&self, r: Request<Name>) -> Reply<Topics> {
        let role = role_of(&r);
        let ns = r.into_inner().name;
        self.namespace_reader(role.as_ref(), &ns).await?;
        self.store.policies(&ns).await?;
        let topics = self
            .topics
            .list(ns)
            .await?
            .into_iter()
            .map(|(name, partitions)| Topic { name, partitions })
            .collect();
        ok(Topics { topics })
    }

    async fn create_topic(&self, r: Request<CreateTopicRequest>) -> Reply<Empty> {
        self.tenant_admin(role_of(&r).as_ref(), tenant_of_topic(&r.get_ref().topic))
            .await?;
        // A non-partitioned topic is made by the broker that owns (or will own) its bundle.
        if r.get_ref().partitions == 0 {
            forward!(self, r, topic, create_topic);
        }
        let c = r.into_inner();
        self.topics.create(c.topic, c.partitions).await?;
        ok(Empty {})
    }

    async fn update_partitions(&self, r: Request<UpdatePartitionsRequest>) -> Reply<Empty> {
        self.tenant_admin(role_of(&r).as_ref(), tenant_of_topic(&r.get_ref().topic))
            .await?;
        let u = r.into_inner();
        self.topics.update_partitions(u.topic, u.partitions).await?;
        ok(Empty {})
    }

    async fn get_topic_stats(&self, r: Request<Name>) -> Reply<TopicStats> {
        self.namespace_reader(role_of(&r).as_ref(), &namespace_of_topic(&r.get_ref().name))
            .await?;
        forward!(self, r, name, get_topic_stats);
        ok(self.topics.stats(r.into_inner().name).await?)
    }

    async fn get_namespace_topic_stats(&self, r: Request<Name>) -> Reply<TopicStatsList> {
        let role = role_of(&r);
        let ns = r.into_inner().name;
        self.namespace_reader(role.as_ref(), &ns).await?;
        self.store.policies(&ns).await?;
        ok(TopicStatsList {
            topics: self.topics.namespace_stats(ns).await?,
        })
    }

    async fn delete_topic(&self, r: Request<DeleteRequest>) -> Reply<DeleteResponse> {
        self.tenant_admin(role_of(&r).as_ref(), tenant_of_topic(&r.get_ref().name))
            .await?;
        if r.metadata().get(FORWARDED).is_none() {
            match self.topics.route(r.get_ref().name.clone()).await? {
                Route::Here => {}
                Route::Owner(url) => {
                    let fwd = on_behalf(&r, r.get_ref().clone());
                    return call_at!(self, Some(url.as_str()), fwd, delete_topic);
                }
                Route::Partitions(parts) => return self.delete_partitioned(r, parts).await,
            }
        }
        let d = r.into_inner();
        let deleted = self.topics.delete(d.name, d.force, d.dry_run).await?;
        ok(DeleteResponse {
            deleted,
            dry_run: d.dry_run,
        })
    }

    async fn delete_remote_data(
        &self,
        r: Request<DeleteRemoteDataRequest>,
    ) -> Reply<DeleteResponse> {
        let d = r.get_ref().clone();
        let (tenant, _) = crate::model::split_namespace(&d.namespace)
            .map_err(|e| Status::invalid_argument(e.0))?;
        self.tenant_admin(role_of(&r).as_ref(), tenant).await?;
        if d.sites.is_empty() {
            return Err(Status::invalid_argument("name the sites (--sites)"));
        }
        let deleted = self
            .topics
            .delete_remote_data(d.namespace, d.sites, d.dry_run)
            .await?;
        ok(DeleteResponse {
            deleted,
            dry_run: d.dry_run,
        })
    }

    async fn unload_topic(&self, r: Request<Name>) -> Reply<Empty> {
        self.tenant_admin(role_of(&r).as_ref(), tenant_of_topic(&r.get_ref().name))
            .await?;
        forward!(self, r, name, unload_topic, |_: Vec<Empty>| Empty {});
        self.topics.unload(r.into_inner().name).await?;
        ok(Empty {})
    }

    async fn get_topic_internal_stats(&self, r: Request<Name>) -> Reply<InternalStatsList> {
        self.namespace_reader(role_of(&r).as_ref(), &namespace_of_topic(&r.get_ref().name))
            .await?;
        forward!(self, r, name, get_topic_internal_stats, |all: Vec<
            InternalStatsList,
        >| {
            InternalStatsList {
                topics: all.into_iter().flat_map(|l| l.topics).collect(),
            }
        });
        ok(InternalStatsList {
            topics: self.topics.internal_stats(r.into_inner().name).await?,
        })
    }

    async fn terminate_topic(&self, r: Request<Name>) -> Reply<TerminateResponse> {
        self.tenant_admin(role_of(&r).as_ref(), tenant_of_topic(&r.get_ref().name))
            .await?;
        forward!(self, r, name, terminate_topic);
        let last = self.topics.terminate(r.into_inner().name).await?;
        ok(TerminateResponse {
            last_message_id: last,
        })
    }

    async fn list_brokers(&self, r: Request<Empty>) -> Reply<BrokerList> {
        self.superuser(role_of(&r).as_ref())?;
        ok(BrokerList {
            brokers: self.topics.brokers().await?,
        })
    }

    async fn unload_namespace(&self, r: Request<UnloadNamespaceRequest>) -> Reply<Names> {
        let ns = r.get_ref().namespace.clone();
        self.tenant_admin(role_of(&r).as_ref(), ns.split('/').next().unwrap_or(""))
            .await?;
        let b = r.into_inner().bundle;
        ok(Names {
            names: self
                .topics
                .unload_bundles(ns, (!b.is_empty()).then_some(b))
                .await?,
        })
    }

    async fn split_namespace_bundle(&self, r: Request<SplitBundleRequest>) -> Reply<Names> {
        let ns = r.get_ref().namespace.clone();
        self.tenant_admin(role_of(&r).as_ref(), ns.split('/').next().unwrap_or(""))
            .await?;
        let r = r.into_inner();
        if r.bundle.is_empty() {
            return Err(Status::invalid_argument(
                "--bundle 0xLO_0xHI is required (see namespaces bundles)",
            ));
        }
        ok(Names {
            names: self.topics.split_bundle(ns, r.bundle, r.unload).await?,
        })
    }

    async fn list_bookies(&self, r: Request<Empty>) -> Reply<BookieList> {
        self.superuser(role_of(&r).as_ref())?;
        ok(BookieList {
            bookies: self.topics.bookies().await?,
        })
    }

    async fn set_bookie_rack(&self, r: Request<SetBookieRackRequest>) -> Reply<Empty> {
        self.superuser(role_of(&r).as_ref())?;
        let r = r.into_inner();
        self.topics.set_bookie_rack(r.address, r.rack).await?;
        ok(Empty {})
    }

    async fn set_ns_isolation_policy(&self, r: Request<NsIsolationPolicyRequest>) -> Reply<Empty> {
        self.superuser(role_of(&r).as_ref())?;
        let r = r.into_inner();
        let p = r.policy.unwrap_or_default();
        let policy = crate::isolation::NsIsolationPolicy {
            namespaces: p.namespaces,
            primary: p.primary,
            secondary: p.secondary,
            auto_failover_policy_type: p.auto_failover_policy_type,
            min_limit: p.min_limit,
        };
        self.store
            .set_isolation_policy(&r.cluster, &r.name, &policy)
            .await?;
        ok(Empty {})
    }

    async fn get_ns_isolation_policies(&self, r: Request<Name>) -> Reply<NsIsolationPolicies> {
        self.superuser(role_of(&r).as_ref())?;
        let cluster = r.into_inner().name;
        self.store.cluster(&cluster).await?;
        let policies = self
            .store
            .isolation_policies(&cluster)
            .await?
            .into_iter()
            .map(|(name, p)| {
                (
                    name,
                    NsIsolationPolicy {
                        namespaces: p.namespaces,
                        primary: p.primary,
                        secondary: p.secondary,
                        auto_failover_policy_type: p.auto_failover_policy_type,
                        min_limit: p.min_limit,
                    },
                )
            })
            .collect();
        ok(NsIsolationPolicies { policies })
    }

    async fn delete_ns_isolation_policy(&self, r: Request<NsIsolationPolicyName>) -> Reply<Empty> {
        self.superuser(role_of(&r).as_ref())?;
        let r = r.into_inner();
        self.store
            .delete_isolation_policy(&r.cluster, &r.name)
            .await?;
        ok(Empty {})
    }

    async fn set_bookie_group(&self, r: Request<SetBookieGroupRequest>) -> Reply<Empty> {
        self.superuser(role_of(&r).as_ref())?;
        let r = r.into_inner();
        if !crate::model::valid_group_name(&r.group) {
            return Err(Status::invalid_argument(format!(
                "group {:?}: 1 to 128 letters, digits, '.', '_' or '-'",
                r.group
            )));
        }
        self.topics.set_bookie_group(r.address, r.group).await?;
        ok(Empty {})
    }

    async fn decommission_bookie(
        &self,
        r: Request<DecommissionBookieRequest>,
    ) -> Reply<DecommissionStatus> {
        self.superuser(role_of(&r).as_ref())?;
        ok(self
            .topics
            .decommission_bookie(r.into_inner().address)
            .await?)
    }

    async fn list_under_replicated(&self, r: Request<Empty>) -> Reply<UnderReplicatedList> {
        self.superuser(role_of(&r).as_ref())?;
        ok(UnderReplicatedList {
            ledgers: self.topics.under_replicated().await?,
        })
    }

    async fn get_leader_broker(&self, r: Request<Empty>) -> Reply<BrokerInfo> {
        self.superuser(role_of(&r).as_ref())?;
        match self.topics.leader().await? {
            Some(b) => ok(b),
            None => Err(Status::not_found("no broker leads the load manager yet")),
        }
    }

    async fn lookup_topic(&self, r: Request<Name>) -> Reply<TopicLookup> {
        self.namespace_reader(role_of(&r).as_ref(), &namespace_of_topic(&r.get_ref().name))
            .await?;
        ok(self.topics.lookup(r.into_inner().name).await?)
    }

    async fn get_bundles(&self, r: Request<Name>) -> Reply<BundleList> {
        let ns = r.get_ref().name.clone();
        self.namespace_reader(role_of(&r).as_ref(), &ns).await?;
        self.store.policies(&ns).await?;
        ok(BundleList {
            bundles: self.topics.bundles(ns).await?,
        })
    }

    async fn compact_topic(&self, r: Request<Name>) -> Reply<Empty> {
        self.tenant_admin(role_of(&r).as_ref(), tenant_of_topic(&r.get_ref().name))
            .await?;
        if r.metadata().get(FORWARDED).is_none() {
            if let Route::Partitions(parts) = self.topics.route(r.get_ref().name.clone()).await? {
                // No partition started while one is still compacting (as where all are here).
                let statuses = self.partition_compaction_statuses(&r, &parts).await?;
                if let Some((p, _)) = statuses.iter().find(|(_, s)| s.status == "RUNNING") {
                    return Err(Status::already_exists(format!(
                        "Compaction already in progress for {p}"
                    )));
                }
            }
        }
        forward!(self, r, name, compact_topic, |_: Vec<Empty>| Empty {});
        self.topics.compact(r.into_inner().name).await?;
        ok(Empty {})
    }

    async fn get_compaction_status(&self, r: Request<Name>) -> Reply<CompactionStatus> {
        self.namespace_reader(role_of(&r).as_ref(), &namespace_of_topic(&r.get_ref().name))
            .await?;
        if r.metadata().get(FORWARDED).is_none() {
            if let Route::Partitions(parts) = self.topics.route(r.get_ref().name.clone()).await? {
                let statuses = self.partition_compaction_statuses(&r, &parts).await?;
                return ok(merged_compaction_status(&statuses));
            }
        }
        forward!(self, r, name, get_compaction_status);
        ok(self.topics.compaction_status(r.into_inner().name).await?)
    }

    async fn list_subscriptions(&self, r: Request<Name>) -> Reply<Names> {
        self.namespace_reader(role_of(&r).as_ref(), &namespace_of_topic(&r.get_ref().name))
            .await?;
        forward!(self, r, name, list_subscriptions);
        ok(Names {
            names: self.topics.subscriptions(r.into_inner().name).await?,
        })
    }

    async fn create_subscription(&self, r: Request<CreateSubscriptionRequest>) -> Reply<Empty> {
        self.tenant_admin(role_of(&r).as_ref(), tenant_of_topic(&r.get_ref().topic))
            .await?;
        forward!(self, r, topic, create_subscription);
        self.topics.create_subscription(r.into_inner()).await?;
        ok(Empty {})
    }

    async fn delete_subscription(&self, r: Request<SubscriptionRequest>) -> Reply<DeleteResponse> {
        self.tenant_admin(role_of(&r).as_ref(), tenant_of_topic(&r.get_ref().topic))
            .await?;
        forward!(self, r, topic, delete_subscription);
        let r = r.into_inner();
        let dry_run = r.dry_run;
        let deleted = self.topics.delete_subscription(r).await?;
        ok(DeleteResponse { deleted, dry_run })
    }

    async fn peek_messages(&self, r: Request<PeekRequest>) -> Reply<PeekResponse> {
        self.tenant_admin(role_of(&r).as_ref(), tenant_of_topic(&r.get_ref().topic))
            .await?;
        forward!(self, r, topic, peek_messages);
        ok(PeekResponse {
            messages: self.topics.peek(r.into_inner()).await?,
        })
    }

    async fn skip_messages(&self, r: Request<SkipRequest>) -> Reply<CountResponse> {
        self.tenant_admin(role_of(&r).as_ref(), tenant_of_topic(&r.get_ref().topic))
            .await?;
        forward!(self, r, topic, skip_messages);
        let r = r.into_inner();
        let dry_run = r.dry_run;
        let sub = SubscriptionRequest {
            topic: r.topic,
            subscription: r.subscription,
            dry_run,
        };
        let entries = self.topics.skip(sub, Some(r.count)).await?;
        ok(CountResponse { entries, dry_run })
    }

    async fn clear_backlog(&self, r: Request<SubscriptionRequest>) -> Reply<CountResponse> {
        self.tenant_admin(role_of(&r).as_ref(), tenant_of_topic(&r.get_ref().topic))
            .await?;
        forward!(self, r, topic, clear_backlog);
        let r = r.into_inner();
        let dry_run = r.dry_run;
        let entries = self.topics.skip(r, None).await?;
        ok(CountResponse { entries, dry_run })
    }

    async fn expire_messages(&self, r: Request<ExpireRequest>) -> Reply<CountResponse> {
        self.tenant_admin(role_of(&r).as_ref(), tenant_of_topic(&r.get_ref().topic))
            .await?;
        forward!(self, r, topic, expire_messages);
        let r = r.into_inner();
        let dry_run = r.dry_run;
        let entries = self.topics.expire(r).await?;
        ok(CountResponse { entries, dry_run })
    }

    async fn reset_cursor(&self, r: Request<ResetCursorRequest>) -> Reply<Empty> {
        self.tenant_admin(role_of(&r).as_ref(), tenant_of_topic(&r.get_ref().topic))
            .await?;
        forward!(self, r, topic, reset_cursor);
        self.topics.reset_cursor(r.into_inner()).await?;
        ok(Empty {})
    }

    async fn set_replicated_subscription_status(
        &self,
        r: Request<ReplicatedSubscriptionRequest>,
    ) -> Reply<Empty> {
        self.tenant_admin(role_of(&r).as_ref(), tenant_of_topic(&r.get_ref().topic))
            .await?;
        forward!(
            self,
            r,
            topic,
            set_replicated_subscription_status,
            |_: Vec<Empty>| Empty {}
        );
        self.topics
            .set_replicated_subscription(r.into_inner())
            .await?;
        ok(Empty {})
    }

    async fn get_replicated_subscription_status(
        &self,
        r: Request<SubscriptionRequest>,
    ) -> Reply<ReplicatedSubscriptionStatus> {
        self.tenant_admin(role_of(&r).as_ref(), tenant_of_topic(&r.get_ref().topic))
            .await?;
        forward!(
            self,
            r,
            topic,
            get_replicated_subscription_status,
            |all: Vec<ReplicatedSubscriptionStatus>| ReplicatedSubscriptionStatus {
                enabled: !all.is_empty() && all.iter().all(|s| s.enabled)
            }
        );
        let enabled = self.topics.replicated_subscription(r.into_inner()).await?;
        ok(ReplicatedSubscriptionStatus { enabled })
    }

    async fn geo_exposure(&self, r: Request<GeoExposureRequest>) -> Reply<GeoExposureList> {
        self.tenant_admin(role_of(&r).as_ref(), tenant_of_topic(&r.get_ref().topic))
            .await?;
        forward!(self, r, topic, geo_exposure, |all: Vec<GeoExposureList>| {
            GeoExposureList {
                topics: all.into_iter().flat_map(|l| l.topics).collect(),
            }
        });
        ok(GeoExposureList {
            topics: self.topics.geo_exposure(r.into_inner()).await?,
        })
    }

    async fn geo_cut(&self, r: Request<GeoCutRequest>) -> Reply<Empty> {
        let (tenant, _) = crate::model::split_namespace(&r.get_ref().namespace)
            .map_err(|e| Status::invalid_argument(e.0))?;
        self.tenant_admin(role_of(&r).as_ref(), tenant).await?;
        self.topics.geo_cut(r.into_inner()).await?;
        ok(Empty {})
    }

    async fn probe_topic(&self, r: Request<Name>) -> Reply<Empty> {
        self.namespace_reader(role_of(&r).as_ref(), &namespace_of_topic(&r.get_ref().name))
            .await?;
        forward!(self, r, name, probe_topic, |_: Vec<Empty>| Empty {});
        self.topics.probe(r.into_inner().name).await?;
        ok(Empty {})
    }

    async fn probe_subscriptions(&self, r: Request<Name>) -> Reply<Empty> {
        self.namespace_reader(role_of(&r).as_ref(), &namespace_of_topic(&r.get_ref().name))
            .await?;
        forward!(self, r, name, probe_subscriptions, |_: Vec<Empty>| Empty {});
        self.topics.probe_subscriptions(r.into_inner().name).await?;
        ok(Empty {})
    }

    async fn put_drill_report(&self, r: Request<DrillReport>) -> Reply<Empty> {
        self.superuser(role_of(&r).as_ref())?;
        self.store.put_drill_report(r.get_ref()).await?;
        ok(Empty {})
    }

    async fn list_drill_reports(&self, r: Request<Empty>) -> Reply<DrillReports> {
        self.superuser(role_of(&r).as_ref())?;
        ok(DrillReports {
            reports: self.store.drill_reports().await?,
        })
    }

    async fn get_drill_report(&self, r: Request<Name>) -> Reply<DrillReport> {
        self.superuser(role_of(&r).as_ref())?;
        ok(self.store.drill_report(&r.get_ref().name).await?)
    }
}

/// A running admin server.
pub struct RunningAdmin {
    pub addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

/// What [`RunningAdmin::stop`] gives calls in progress before it ends the server.
pub const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

impl RunningAdmin {
    /// Stops accepting and waits at most [`STOP_GRACE`] for calls in progress and open
    /// connections (before, a connection that never finished its preface held the stop for as
    /// long as it stayed); what is still running then goes on without being waited for (tonic
    /// runs each connection in a task of its own) and ends with the process.
    pub async fn stop(mut self) {
        let _ = self.stop.send(());
        if tokio::time::timeout(STOP_GRACE, &mut self.task)
            .await
            .is_err()
        {
            tracing::info!(
                grace_ms = STOP_GRACE.as_millis() as u64,
                "admin connections still open after the stop's grace; not waiting for them"
            );
            self.task.abort();
        }
    }
}

/// The role an authenticated admin request carries (in the request's extensions).
#[derive(Debug, Clone)]
pub struct Role(pub String);

/// Serves the admin API (and gRPC reflection) on `listener` until stopped. With `auth`, every
/// admin call needs `authorization: Bearer TOKEN`; a missing or bad token is refused with
/// UNAUTHENTICATED before the request is looked at, the same whatever it names.
///
/// With `tls`, the API is served over TLS only; a client certificate (when the configuration
/// asks for them) authenticates a request that carries no token: its CN is the role.
///
/// `keepalive` bounds what a peer can hold: each connection is pinged (HTTP/2) that often and
/// closed when a ping is not answered within it, a write that makes no progress for it (at
/// least 30 s) fails, and a connection that sends nothing for twice it before its HTTP/2
/// handshake is done (half a preface, a TLS handshake never finished) is closed (after it,
/// the server's pings count as progress, and a dead peer is the unanswered ping's to find).
pub fn serve(
    listener: tokio::net::TcpListener,
    service: AdminService,
    auth: Option<std::sync::Arc<crate::auth::Authenticator>>,
    tls: Option<tonic::transport::ServerTlsConfig>,
    keepalive: std::time::Duration,
) -> anyhow::Result<RunningAdmin> {
    let addr = listener.local_addr()?;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    // TCP_NODELAY, as the metadata server: small answers must not wait for delayed ACKs.
    let incoming = futures::StreamExt::map(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        move |conn| {
            conn.map(|s| {
                let _ = s.set_nodelay(true);
                meridian_metadata::stall::StallBounded::new(
                    s,
                    Some(keepalive * 2),
                    // Not under 30 s: a short keep-alive is for noticing dead peers, not
                    // for cutting a call over a congested link.
                    Some(keepalive.max(std::time::Duration::from_secs(30))),
                )
            })
        },
    );
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(keepalive))
        .http2_keepalive_timeout(Some(keepalive));
    if let Some(tls) = tls {
        builder = builder.tls_config(tls)?;
    }
    let task = tokio::spawn(async move {
        let r = builder
            .add_service(AdminServer::with_interceptor(
                service,
                move |mut r: Request<()>| {
                    let Some(a) = &auth else { return Ok(r) };
                    let token = r
                        .metadata()
                        .get("authorization")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.strip_prefix("Bearer "));
                    let role = match token {
                        Some(t) => a
                            .authenticate(t)
                            .map_err(|e| Status::unauthenticated(e.to_string()))?,
                        None => r
                            .peer_certs()
                            .and_then(|c| c.first().and_then(|c| crate::auth::certificate_role(c)))
                            .ok_or_else(|| {
                                Status::unauthenticated(
                                    "a bearer token (or a client certificate) is required",
                                )
                            })?,
                    };
                    r.extensions_mut().insert(Role(role));
                    Ok(r)
                },
            ))
            .add_service(reflection)
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            })
            .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "admin server failed");
        }
    });
    Ok(RunningAdmin { addr, stop, task })
}
