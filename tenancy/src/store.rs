//! Clusters, tenants and namespaces in the metadata store: every change a compare-and-set,
//! every refusal a precise [`AdminError`] that changes nothing.

use std::collections::BTreeMap;

use meridian_metadata::client::{ClientError, PutOptions};
use meridian_metadata::MetadataClient;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::model::*;

/// An admin request's failure, grouped by what the caller can do about it.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    Invalid(String),
    /// The target is in a state that forbids the request (not empty, in use).
    #[error("{0}")]
    FailedPrecondition(String),
    /// Another change to the same record came first: [`redone`] makes the change again.
    #[error("{0}")]
    Raced(String),
    /// Other changes of the record came first, each time the change was made, or one that
    /// a whole-record replacement would undo: nothing changed; read it again and retry.
    #[error("{0}")]
    Aborted(String),
    /// Retry later: the metadata store or the broker is not reachable or busy.
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("{0}")]
    Unauthenticated(String),
}

impl From<AdminError> for tonic::Status {
    fn from(e: AdminError) -> tonic::Status {
        match e {
            AdminError::NotFound(m) => tonic::Status::not_found(m),
            AdminError::AlreadyExists(m) => tonic::Status::already_exists(m),
            AdminError::Invalid(m) => tonic::Status::invalid_argument(m),
            AdminError::FailedPrecondition(m) => tonic::Status::failed_precondition(m),
            AdminError::Raced(m) | AdminError::Aborted(m) => tonic::Status::aborted(m),
            AdminError::Unavailable(m) => tonic::Status::unavailable(m),
            AdminError::PermissionDenied(m) => tonic::Status::permission_denied(m),
            AdminError::Unauthenticated(m) => tonic::Status::unauthenticated(m),
        }
    }
}

impl From<ClientError> for AdminError {
    fn from(e: ClientError) -> AdminError {
        AdminError::Unavailable(format!("metadata store: {e}"))
    }
}

impl From<BadName> for AdminError {
    fn from(e: BadName) -> AdminError {
        AdminError::Invalid(e.0)
    }
}

/// How many times a read-modify-write is made while another change to its record keeps
/// coming first.
pub(crate) const RACE_ATTEMPTS: u32 = 10;

/// A compare-and-set that lost to another change of `what`.
pub(crate) fn raced(what: &str) -> AdminError {
    AdminError::Raced(format!("{what} changed meanwhile"))
}

/// The pause after a read-modify-write's `made`-th lost race: 10 ms, 20, 40, ... up to
/// 320, each with up to half as much again at random, so two that race each other do not
/// meet again in step (the merges and changes that race an admin's are quick).
pub(crate) fn race_pause(made: u32) -> std::time::Duration {
    let base = 10u64 << made.saturating_sub(1).min(5);
    let jitter = rand::Rng::gen_range(&mut rand::thread_rng(), 0..=base / 2);
    std::time::Duration::from_millis(base + jitter)
}

/// Makes `attempt`, a read-modify-write, again while another change to its record comes
/// first ([`AdminError::Raced`]: a peer site's copy merged, another admin's change), as
/// Pulsar's metadata cache redoes an update that lost to a newer version. Each attempt
/// reads afresh and checks what it read. After [`RACE_ATTEMPTS`] losses the last is the
/// caller's, as [`AdminError::Aborted`] (so a `redone` within another is not redone again).
pub(crate) async fn redone<T, F, Fut>(mut attempt: F) -> Result<T, AdminError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, AdminError>>,
{
    let mut made = 1;
    loop {
        match attempt().await {
            Err(AdminError::Raced(_)) if made < RACE_ATTEMPTS => {
                tokio::time::sleep(race_pause(made)).await;
                made += 1;
            }
            Err(AdminError::Raced(m)) => {
                return Err(AdminError::Aborted(format!(
                    "{m}, each of {RACE_ATTEMPTS} times this change was made; retry"
                )))
            }
            r => return r,
        }
    }
}

/// For a request that replaces a whole record (a cluster's, a tenant's): the record as its
/// first attempt read it. Another attempt goes on only while the record is still that (what
/// came first changed none of its fields: a merge of the same fields, a stamp); a field
/// changed meanwhile was not known to the request, which is refused rather than undo it.
struct Basis<T>(std::sync::Mutex<Option<T>>);

impl<T: PartialEq + Clone> Basis<T> {
    fn new() -> Basis<T> {
        Basis(std::sync::Mutex::new(None))
    }

    fn check(&self, now: &T, what: &str) -> Result<(), AdminError> {
        let mut first = self.0.lock().expect("never held across a panic");
        match &*first {
            None => {
                *first = Some(now.clone());
                Ok(())
            }
            Some(f) if f == now => Ok(()),
            Some(_) => Err(AdminError::Aborted(format!(
                "{what} was changed by another request meanwhile; read it again and make this change again"
            ))),
        }
    }
}

/// The tenancy records of one site.
#[derive(Clone)]
pub struct TenancyStore {
    pub(crate) meta: MetadataClient,
    /// The site whose changes these are (the versions of global objects name it).
    pub(crate) site: String,
}

fn decode<T: DeserializeOwned>(key: &str, value: &[u8]) -> Result<T, AdminError> {
    serde_json::from_slice(value)
        .map_err(|e| AdminError::Unavailable(format!("record {key} is damaged: {e}")))
}

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("records serialise")
}

impl TenancyStore {
    /// A store for reading, and for changes that name no site in their versions.
    pub fn new(meta: MetadataClient) -> TenancyStore {
        TenancyStore::for_site(meta, "")
    }

    /// A store whose changes of global objects are versioned as made at `site`.
    pub fn for_site(meta: MetadataClient, site: &str) -> TenancyStore {
        TenancyStore {
            meta,
            site: site.to_string(),
        }
    }

    pub(crate) async fn get<T: DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<(T, u64)>, AdminError> {
        match self.meta.get(key).await? {
            Some(kv) => Ok(Some((decode(key, &kv.value)?, kv.mod_revision))),
            None => Ok(None),
        }
    }

    async fn children(&self, prefix: &str) -> Result<Vec<String>, AdminError> {
        let mut out = Vec::new();
        let mut after = String::new();
        loop {
            let page = self.meta.children(prefix, &after, 0).await?;
            out.extend(page.children.iter().cloned());
            match page.children.last() {
                Some(last) if page.more => after = last.clone(),
                _ => return Ok(out),
            }
        }
    }

    /// Creates `key` (absent) or replaces it at `version` (present); a race is reported.
    async fn put<T: Serialize>(
        &self,
        key: &str,
        value: &T,
        version: u64,
        what: &str,
    ) -> Result<(), AdminError> {
        if crate::federation::tombstone_key(key).is_some() {
            let value = serde_json::to_value(value).expect("records serialise");
            return self.put_global(key, value, version, what).await;
        }
        let opts = PutOptions {
            expected_version: Some(version),
            ..Default::default()
        };
        match self.meta.put_with(key, encode(value), opts).await {
            Ok(_) => Ok(()),
            Err(ClientError::Conflict { .. }) if version == 0 => {
                Err(AdminError::AlreadyExists(format!("{what} already exists")))
            }
            Err(ClientError::Conflict { .. }) => Err(raced(what)),
            Err(e) => Err(e.into()),
        }
    }

    async fn delete(&self, key: &str, version: u64, what: &str) -> Result<(), AdminError> {
        if crate::federation::tombstone_key(key).is_some() {
            return self.delete_global(key, version, what).await;
        }
        match self.meta.delete(key, Some(version)).await {
            Ok(_) => Ok(()),
            Err(ClientError::Conflict { .. }) => Err(raced(what)),
            Err(e) => Err(e.into()),
        }
    }

    // --- clusters ------------------------------------------------------------------------

    pub async fn clusters(&self) -> Result<Vec<String>, AdminError> {
        self.children(CLUSTERS_PREFIX).await
    }

    pub async fn cluster(&self, name: &str) -> Result<ClusterData, AdminError> {
        check_name("cluster", name)?;
        self.get(&format!("{CLUSTERS_PREFIX}{name}"))
            .await?
            .map(|(c, _)| c)
            .ok_or_else(|| AdminError::NotFound(format!("cluster {name} does not exist")))
    }

    pub async fn create_cluster(&self, name: &str, c: &ClusterData) -> Result<(), AdminError> {
        check_name("cluster", name)?;
        check_cluster(c)?;
        self.put(
            &format!("{CLUSTERS_PREFIX}{name}"),
            c,
            0,
            &format!("cluster {name}"),
        )
        .await
    }

    pub async fn update_cluster(&self, name: &str, c: &ClusterData) -> Result<(), AdminError> {
        let basis = Basis::new();
        redone(|| self.update_cluster_once(name, c, &basis)).await
    }

    async fn update_cluster_once(
        &self,
        name: &str,
        c: &ClusterData,
        basis: &Basis<ClusterData>,
    ) -> Result<(), AdminError> {
        check_cluster(c)?;
        let key = format!("{CLUSTERS_PREFIX}{name}");
        let what = format!("cluster {name}");
        let (old, v) = self
            .get::<ClusterData>(&key)
            .await?
            .ok_or_else(|| AdminError::NotFound(format!("{what} does not exist")))?;
        basis.check(&old, &what)?;
        self.put(&key, c, v, &what).await
    }

    /// Deletes a cluster no tenant may use.
    pub async fn delete_cluster(
        &self,
        name: &str,
        dry_run: bool,
    ) -> Result<Vec<String>, AdminError> {
        redone(|| self.delete_cluster_once(name, dry_run)).await
    }

    async fn delete_cluster_once(
        &self,
        name: &str,
        dry_run: bool,
    ) -> Result<Vec<String>, AdminError> {
        check_name("cluster", name)?;
        let key = format!("{CLUSTERS_PREFIX}{name}");
        let (_, v) = self
            .get::<ClusterData>(&key)
            .await?
            .ok_or_else(|| AdminError::NotFound(format!("cluster {name} does not exist")))?;
        for t in self.tenants().await? {
            if self
                .tenant(&t)
                .await?
                .allowed_clusters
                .iter()
                .any(|c| c == name)
            {
                return Err(AdminError::FailedPrecondition(format!(
                    "cluster {name} is allowed to tenant {t}; update the tenant first"
                )));
            }
        }
        if !dry_run {
            self.delete(&key, v, &format!("cluster {name}")).await?;
        }
        Ok(vec![format!("cluster {name}")])
    }

    // --- namespace isolation policies ------------------------------------------------------

    /// Sets (creates or replaces) a namespace isolation policy of a cluster.
    pub async fn set_isolation_policy(
        &self,
        cluster: &str,
        name: &str,
        p: &crate::isolation::NsIsolationPolicy,
    ) -> Result<(), AdminError> {
        self.cluster(cluster).await?;
        check_name("isolation policy", name)?;
        p.validate().map_err(AdminError::Invalid)?;
        let key = format!("{}{cluster}/{name}", crate::isolation::POLICIES_PREFIX);
        let what = format!("isolation policy {name}");
        redone(|| async {
            let version = self
                .get::<crate::isolation::NsIsolationPolicy>(&key)
                .await?
                .map_or(0, |(_, v)| v);
            match self.put(&key, p, version, &what).await {
                // Made meanwhile: this one replaces it.
                Err(AdminError::AlreadyExists(_)) => Err(raced(&what)),
                r => r,
            }
        })
        .await
    }

    /// A cluster's namespace isolation policies, by name.
    pub async fn isolation_policies(
        &self,
        cluster: &str,
    ) -> Result<BTreeMap<String, crate::isolation::NsIsolationPolicy>, AdminError> {
        check_name("cluster", cluster)?;
        let prefix = format!("{}{cluster}/", crate::isolation::POLICIES_PREFIX);
        let mut out = BTreeMap::new();
        for name in self.children(&prefix).await? {
            if let Some((p, _)) = self.get(&format!("{prefix}{name}")).await? {
                out.insert(name, p);
            }
        }
        Ok(out)
    }

    pub async fn delete_isolation_policy(
        &self,
        cluster: &str,
        name: &str,
    ) -> Result<(), AdminError> {
        redone(|| self.delete_isolation_policy_once(cluster, name)).await
    }

    async fn delete_isolation_policy_once(
        &self,
        cluster: &str,
        name: &str,
    ) -> Result<(), AdminError> {
        check_name("isolation policy", name)?;
        let key = format!("{}{cluster}/{name}", crate::isolation::POLICIES_PREFIX);
        let (_, v) = self
            .get::<crate::isolation::NsIsolationPolicy>(&key)
            .await?
            .ok_or_else(|| {
                AdminError::NotFound(format!("cluster {cluster} has no isolation policy {name}"))
            })?;
        self.delete(&key, v, &format!("isolation policy {name}"))
            .await
    }

    // --- tenants -------------------------------------------------------------------------

    pub async fn tenants(&self) -> Result<Vec<String>, AdminError> {
        self.children(TENANTS_PREFIX).await
    }

    pub async fn tenant(&self, name: &str) -> Result<TenantInfo, AdminError> {
        check_name("tenant", name)?;
        self.get(&format!("{TENANTS_PREFIX}{name}"))
            .await?
            .map(|(t, _)| t)
            .ok_or_else(|| AdminError::NotFound(format!("tenant {name} does not exist")))
    }

    async fn check_tenant(&self, t: &TenantInfo) -> Result<(), AdminError> {
        for c in &t.allowed_clusters {
            check_name("cluster", c)?;
            if self
                .meta
                .get(&format!("{CLUSTERS_PREFIX}{c}"))
                .await?
                .is_none()
            {
                return Err(AdminError::Invalid(format!(
                    "allowed cluster {c} does not exist"
                )));
            }
        }
        for r in &t.admin_roles {
            if r.is_empty() {
                return Err(AdminError::Invalid("an admin role is empty".into()));
            }
        }
        Ok(())
    }

    pub async fn create_tenant(&self, name: &str, t: &TenantInfo) -> Result<(), AdminError> {
        check_name("tenant", name)?;
        self.check_tenant(t).await?;
        self.put(
            &format!("{TENANTS_PREFIX}{name}"),
            t,
            0,
            &format!("tenant {name}"),
        )
        .await
    }

    /// Replaces a tenant's record by `t`; with `keep_quota`, but for its storage quota, which
    /// stays as it is.
    pub async fn update_tenant(
        &self,
        name: &str,
        t: &TenantInfo,
        keep_quota: bool,
    ) -> Result<(), AdminError> {
        let basis = Basis::new();
        redone(|| self.update_tenant_once(name, t, keep_quota, &basis)).await
    }

    async fn update_tenant_once(
        &self,
        name: &str,
        t: &TenantInfo,
        keep_quota: bool,
        basis: &Basis<TenantInfo>,
    ) -> Result<(), AdminError> {
        check_name("tenant", name)?;
        self.check_tenant(t).await?;
        let key = format!("{TENANTS_PREFIX}{name}");
        let (old, v) = self
            .get::<TenantInfo>(&key)
            .await?
            .ok_or_else(|| AdminError::NotFound(format!("tenant {name} does not exist")))?;
        // Without the quota when the request keeps it: a change of the quota alone meanwhile
        // is kept, not a reason to refuse.
        let seen = TenantInfo {
            storage_quota_bytes: old.storage_quota_bytes.filter(|_| !keep_quota),
            ..old.clone()
        };
        basis.check(&seen, &format!("tenant {name}"))?;
        let kept;
        let t = if keep_quota {
            kept = TenantInfo {
                storage_quota_bytes: old.storage_quota_bytes,
                ..t.clone()
            };
            &kept
        } else {
            t
        };
        // As Pulsar: a cluster a namespace of the tenant is replicated to stays allowed until
        // the namespace no longer lists it (a namespace without the policy is this site's).
        let removed: Vec<&String> = old
            .allowed_clusters
            .iter()
            .filter(|c| !t.allowed_clusters.contains(c))
            .collect();
        if !removed.is_empty() {
            let namespaces = self.namespaces(name).await?;
            for ns in &namespaces {
                let (p, _) = match self.policies(ns).await {
                    Ok(p) => p,
                    Err(AdminError::NotFound(_)) => continue,
                    Err(e) => return Err(e),
                };
                let clusters = p.replication_clusters.unwrap_or_else(|| {
                    [self.site.clone()]
                        .into_iter()
                        .filter(|s| !s.is_empty())
                        .collect()
                });
                if let Some(c) = removed.iter().find(|c| clusters.contains(c)) {
                    return Err(AdminError::FailedPrecondition(format!(
                        "cluster {c} is still used by namespace {ns} (its replication clusters are {}); remove it there first (namespaces set-clusters)",
                        clusters.join(",")
                    )));
                }
            }
            // A topic's own replication clusters bind it as its namespace's do (the topics
            // of namespaces that exist: a deleted namespace's leftovers bind nothing).
            let mut topic_records = Vec::new();
            for ns in &namespaces {
                topic_records.extend(
                    self.meta
                        .list_all(&format!("{TOPIC_POLICIES_PREFIX}{ns}/"))
                        .await?,
                );
            }
            for kv in topic_records {
                let Ok(p) = decode::<NamespacePolicies>(&kv.key, &kv.value) else {
                    tracing::warn!(key = %kv.key, "a topic's policies are not readable; not checked");
                    continue;
                };
                let clusters = p.replication_clusters.unwrap_or_default();
                if let Some(c) = removed.iter().find(|c| clusters.contains(c)) {
                    let topic = topic_of_policies_key(&kv.key).unwrap_or(kv.key);
                    return Err(AdminError::FailedPrecondition(format!(
                        "cluster {c} is still used by topic {topic} (its replication clusters are {}); remove it there first (topics set-replication-clusters)",
                        clusters.join(",")
                    )));
                }
            }
        }
        self.put(&key, t, v, &format!("tenant {name}")).await
    }

    /// Deletes a tenant without namespaces.
    pub async fn delete_tenant(
        &self,
        name: &str,
        dry_run: bool,
    ) -> Result<Vec<String>, AdminError> {
        self.delete_tenant_with(name, dry_run, false).await
    }

    /// What deleting a tenant whose namespaces go first (listed by the caller) removes.
    pub async fn tenant_deletion_plan(&self, name: &str) -> Result<Vec<String>, AdminError> {
        self.delete_tenant_with(name, true, true).await
    }

    async fn delete_tenant_with(
        &self,
        name: &str,
        dry_run: bool,
        skip_namespaces: bool,
    ) -> Result<Vec<String>, AdminError> {
        redone(|| self.delete_tenant_once(name, dry_run, skip_namespaces)).await
    }

    async fn delete_tenant_once(
        &self,
        name: &str,
        dry_run: bool,
        skip_namespaces: bool,
    ) -> Result<Vec<String>, AdminError> {
        check_name("tenant", name)?;
        let key = format!("{TENANTS_PREFIX}{name}");
        let (_, v) = self
            .get::<TenantInfo>(&key)
            .await?
            .ok_or_else(|| AdminError::NotFound(format!("tenant {name} does not exist")))?;
        let ns = self.namespaces(name).await?;
        if !ns.is_empty() && !skip_namespaces {
            return Err(AdminError::FailedPrecondition(format!(
                "tenant {name} has {} namespaces ({}); delete them first",
                ns.len(),
                ns.join(", ")
            )));
        }
        if !dry_run {
            self.delete(&key, v, &format!("tenant {name}")).await?;
        }
        Ok(vec![format!("tenant {name}")])
    }

    // --- namespaces ----------------------------------------------------------------------

    /// The namespaces of a tenant, as `tenant/namespace`.
    pub async fn namespaces(&self, tenant: &str) -> Result<Vec<String>, AdminError> {
        check_name("tenant", tenant)?;
        Ok(self
            .children(&format!("{NAMESPACES_PREFIX}{tenant}/"))
            .await?
            .into_iter()
            .map(|n| format!("{tenant}/{n}"))
            .collect())
    }

    pub async fn policies(&self, ns: &str) -> Result<(NamespacePolicies, u64), AdminError> {
        split_namespace(ns)?;
        self.get(&format!("{NAMESPACES_PREFIX}{ns}"))
            .await?
            .ok_or_else(|| AdminError::NotFound(format!("namespace {ns} does not exist")))
    }

    pub async fn create_namespace(
        &self,
        ns: &str,
        p: &NamespacePolicies,
    ) -> Result<(), AdminError> {
        let (tenant, _) = split_namespace(ns)?;
        p.validate().map_err(AdminError::Invalid)?;
        self.tenant(tenant).await?;
        self.check_replication_clusters(tenant, p).await?;
        self.put(
            &format!("{NAMESPACES_PREFIX}{ns}"),
            p,
            0,
            &format!("namespace {ns}"),
        )
        .await
    }

    pub async fn update_policies(
        &self,
        ns: &str,
        set: &NamespacePolicies,
        clear: &[String],
    ) -> Result<NamespacePolicies, AdminError> {
        redone(|| self.update_policies_once(ns, set, clear)).await
    }

    async fn update_policies_once(
        &self,
        ns: &str,
        set: &NamespacePolicies,
        clear: &[String],
    ) -> Result<NamespacePolicies, AdminError> {
        let (old, v) = self.policies(ns).await?;
        let new = old.updated(set, clear).map_err(AdminError::Invalid)?;
        if set.replication_clusters.is_some() {
            let (tenant, _) = split_namespace(ns)?;
            self.check_replication_clusters(tenant, &new).await?;
        }
        self.put(
            &format!("{NAMESPACES_PREFIX}{ns}"),
            &new,
            v,
            &format!("namespace {ns}"),
        )
        .await?;
        Ok(new)
    }

    /// A topic's own policies (empty when it has none) and their record's version (0: none).
    pub async fn topic_policies(
        &self,
        topic: &str,
    ) -> Result<(NamespacePolicies, u64), AdminError> {
        let (t, n, local) = split_topic(topic)?;
        self.policies(&format!("{t}/{n}")).await?;
        Ok(self
            .get(&topic_policies_key(&t, &n, &local))
            .await?
            .unwrap_or_default())
    }

    /// Changes a topic's own policies (its namespace must exist); all cleared: the record
    /// goes.
    pub async fn update_topic_policies(
        &self,
        topic: &str,
        set: &NamespacePolicies,
        clear: &[String],
    ) -> Result<NamespacePolicies, AdminError> {
        redone(|| self.update_topic_policies_once(topic, set, clear)).await
    }

    async fn update_topic_policies_once(
        &self,
        topic: &str,
        set: &NamespacePolicies,
        clear: &[String],
    ) -> Result<NamespacePolicies, AdminError> {
        let (t, n, local) = split_topic(topic)?;
        if set.publish_rate_total.is_some() || set.dispatch_rate_total.is_some() {
            return Err(AdminError::Invalid(
                "publish_rate_total and dispatch_rate_total are for the namespace's topics together: set them on the namespace".into(),
            ));
        }
        let (old, v) = self.topic_policies(topic).await?;
        let new = old.updated(set, clear).map_err(AdminError::Invalid)?;
        // What the topic ends up with must hold together too.
        let (ns, _) = self.policies(&format!("{t}/{n}")).await?;
        ns.overlaid(&new)
            .validate()
            .map_err(|e| AdminError::Invalid(format!("with namespace {t}/{n}'s policies: {e}")))?;
        if set.replication_clusters.is_some() {
            self.check_replication_clusters(&t, &new).await?;
        }
        let key = topic_policies_key(&t, &n, &local);
        let what = format!("the policies of topic {topic}");
        if new == NamespacePolicies::default() {
            if v != 0 {
                self.delete(&key, v, &what).await?;
            }
        } else {
            match self.put(&key, &new, v, &what).await {
                // The topic's first policies, and another change made some meanwhile.
                Err(AdminError::AlreadyExists(_)) => return Err(raced(&what)),
                r => r?,
            }
        }
        Ok(new)
    }

    /// Deletes the record of a topic's own policies here (the topic is being deleted here;
    /// where it is deleted at every site, each site deletes its own) with a tombstone that
    /// goes nowhere but keeps an older copy from a peer site from bringing it back.
    pub async fn delete_topic_policies_record(&self, key: &str) -> Result<(), AdminError> {
        redone(|| async {
            let Some((_, v)) = self.get::<serde_json::Value>(key).await? else {
                return Ok(());
            };
            self.delete_here(key, v, &format!("topic policies {key}"))
                .await
        })
        .await
    }

    /// Grants `actions` to `role` in a namespace (replacing its earlier grant), or with `None`
    /// revokes the role's grant. Returns the namespace's permissions.
    pub async fn set_permission(
        &self,
        ns: &str,
        role: &str,
        actions: Option<Vec<String>>,
    ) -> Result<std::collections::BTreeMap<String, Vec<String>>, AdminError> {
        redone(|| self.set_permission_once(ns, role, actions.clone())).await
    }

    async fn set_permission_once(
        &self,
        ns: &str,
        role: &str,
        actions: Option<Vec<String>>,
    ) -> Result<std::collections::BTreeMap<String, Vec<String>>, AdminError> {
        let (mut p, v) = self.policies(ns).await?;
        match actions {
            Some(a) => {
                if a.is_empty() {
                    return Err(AdminError::Invalid(
                        "grant at least one of the actions produce, consume".into(),
                    ));
                }
                let mut a = a;
                a.sort();
                a.dedup();
                p.permissions.insert(role.to_string(), a);
            }
            None => {
                if p.permissions.remove(role).is_none() {
                    return Err(AdminError::NotFound(format!(
                        "role {role} has no grant in namespace {ns}"
                    )));
                }
            }
        }
        p.validate().map_err(AdminError::Invalid)?;
        self.put(
            &format!("{NAMESPACES_PREFIX}{ns}"),
            &p,
            v,
            &format!("namespace {ns}"),
        )
        .await?;
        Ok(p.permissions)
    }

    /// Deletes a namespace; `topics` are what it still holds (then it is refused).
    pub async fn delete_namespace(
        &self,
        ns: &str,
        topics: &[String],
        dry_run: bool,
    ) -> Result<Vec<String>, AdminError> {
        if !topics.is_empty() {
            self.policies(ns).await?;
            return Err(AdminError::FailedPrecondition(format!(
                "namespace {ns} has {} topics (first: {}); delete them first",
                topics.len(),
                topics[0]
            )));
        }
        let what = format!("namespace {ns}");
        if !dry_run {
            self.policies(ns).await?;
            // First, so a failure leaves the namespace, and the request can be made again.
            self.clear_topic_policies(ns).await?;
        }
        redone(|| async {
            let (_, v) = self.policies(ns).await?;
            if dry_run {
                return Ok(());
            }
            self.delete(&format!("{NAMESPACES_PREFIX}{ns}"), v, &what)
                .await
        })
        .await?;
        Ok(vec![what])
    }

    /// Topic policies left by topics deleted without the broker, cleared as their namespace
    /// (which has no topics) is deleted: a namespace created again starts clean. Each leaves a tombstone
    /// that goes nowhere, so a peer's older copy does not come back with the namespace.
    pub(crate) async fn clear_topic_policies(&self, ns: &str) -> Result<(), AdminError> {
        let prefix = format!("{TOPIC_POLICIES_PREFIX}{ns}/");
        loop {
            let page = self.meta.list(&prefix, "", 0).await?;
            for kv in &page.kvs {
                self.delete_topic_policies_record(&kv.key).await?;
            }
            if !page.more {
                return Ok(());
            }
        }
    }

    /// A one-site standalone's records: the cluster, tenant `public`, namespace
    /// `public/default` (each created only if absent).
    pub async fn bootstrap_standalone(
        &self,
        cluster: &str,
        c: &ClusterData,
    ) -> Result<(), AdminError> {
        let ignore_existing = |r: Result<(), AdminError>| match r {
            Ok(()) | Err(AdminError::AlreadyExists(_)) => Ok(()),
            Err(e) => Err(e),
        };
        match self.create_cluster(cluster, c).await {
            Ok(()) => {}
            Err(AdminError::AlreadyExists(_)) => self.fill_own_geo_url(cluster, c).await?,
            Err(e) => return Err(e),
        }
        let public = TenantInfo {
            admin_roles: Vec::new(),
            allowed_clusters: vec![cluster.to_string()],
            storage_quota_bytes: None,
        };
        ignore_existing(self.create_tenant("public", &public).await)?;
        ignore_existing(
            self.create_namespace("public/default", &NamespacePolicies::default())
                .await,
        )
    }
}

impl TenancyStore {
    /// Replication clusters must be known sites the tenant may use (Pulsar's rule: the
    /// tenant's allowed clusters bound every namespace's and topic's).
    pub(crate) async fn check_replication_clusters(
        &self,
        tenant: &str,
        p: &NamespacePolicies,
    ) -> Result<(), AdminError> {
        let Some(clusters) = &p.replication_clusters else {
            return Ok(());
        };
        let allowed = self.tenant(tenant).await?.allowed_clusters;
        for c in clusters {
            match self.cluster(c).await {
                Ok(_) => {}
                Err(AdminError::NotFound(_)) => {
                    return Err(AdminError::Invalid(format!(
                        "replication cluster {c} does not exist (clusters create {c} ...)"
                    )))
                }
                Err(e) => return Err(e),
            }
            if !allowed.contains(c) {
                return Err(AdminError::FailedPrecondition(format!(
                    "cluster {c} is not among tenant {tenant}'s allowed clusters ({}); tenants update {tenant} --allowed-clusters ... first",
                    allowed.join(",")
                )));
            }
        }
        Ok(())
    }

    /// A site's own record made before it had a geo link gets the link's URL when a broker
    /// with one starts; a URL already there (set by an operator, or another broker's) stays.
    async fn fill_own_geo_url(&self, cluster: &str, c: &ClusterData) -> Result<(), AdminError> {
        if c.geo_url.is_empty() {
            return Ok(());
        }
        let key = format!("{CLUSTERS_PREFIX}{cluster}");
        let Some((mut existing, v)) = self.get::<ClusterData>(&key).await? else {
            return Ok(());
        };
        if !existing.geo_url.is_empty() {
            return Ok(());
        }
        existing.geo_url = c.geo_url.clone();
        match self
            .put(&key, &existing, v, &format!("cluster {cluster}"))
            .await
        {
            // Another broker filled it in meanwhile.
            Err(AdminError::Raced(_)) => Ok(()),
            other => other,
        }
    }
}

pub(crate) fn check_cluster(c: &ClusterData) -> Result<(), AdminError> {
    let has_scheme =
        |url: &str, schemes: &[&str]| url.is_empty() || schemes.iter().any(|s| url.starts_with(s));
    if !has_scheme(&c.service_url, &["pulsar://", "pulsar+ssl://"]) {
        return Err(AdminError::Invalid(format!(
            "broker URL {:?} must start with pulsar:// or pulsar+ssl://",
            c.service_url
        )));
    }
    if !has_scheme(&c.admin_url, &["http://", "https://"]) {
        return Err(AdminError::Invalid(format!(
            "admin URL {:?} must start with http:// or https://",
            c.admin_url
        )));
    }
    if !c.geo_url.is_empty() {
        let ok = c.geo_url.strip_prefix("quic://").is_some_and(|hp| {
            hp.rsplit_once(':').is_some_and(|(host, port)| {
                !host.is_empty()
                    && !host.contains(char::is_whitespace)
                    && port.parse::<u16>().is_ok_and(|p| p > 0)
            })
        });
        if !ok {
            return Err(AdminError::Invalid(format!(
                "geo URL {:?} must be quic://HOST:PORT",
                c.geo_url
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_a_whole_record_replacement_then_it_goes_on_only_over_the_record_it_first_read() {
        let basis = Basis::new();
        let first = ClusterData {
            service_url: "pulsar://a:6650".into(),
            ..Default::default()
        };
        basis.check(&first, "cluster a").unwrap();
        // What came first changed no field (a merge of the same fields): made again.
        basis.check(&first.clone(), "cluster a").unwrap();
        let changed = ClusterData {
            geo_url: "quic://a:7000".into(),
            ..first.clone()
        };
        let err = basis.check(&changed, "cluster a").unwrap_err();
        assert!(
            matches!(&err, AdminError::Aborted(m) if m.contains("cluster a") && m.contains("meanwhile")),
            "{err}"
        );
        assert_eq!(tonic::Status::from(err).code(), tonic::Code::Aborted);
    }

    #[test]
    fn given_lost_races_then_the_pauses_grow_to_a_bound_with_some_at_random() {
        for made in 1..RACE_ATTEMPTS {
            let base = 10u64 << (made - 1).min(5);
            let p = race_pause(made).as_millis() as u64;
            assert!((base..=base + base / 2).contains(&p), "{made}: {p}");
        }
    }

    #[tokio::test]
    async fn given_races_then_redone_makes_the_change_again_and_at_last_aborts() {
        let tries = std::sync::atomic::AtomicU32::new(0);
        let r = redone(|| async {
            let n = tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if n < 3 {
                Err(raced("x"))
            } else {
                Ok(n)
            }
        })
        .await;
        assert_eq!(r.unwrap(), 3);
        let tries = std::sync::atomic::AtomicU32::new(0);
        let r: Result<(), AdminError> = redone(|| async {
            tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Err(raced("namespace acme/g"))
        })
        .await;
        assert_eq!(tries.into_inner(), RACE_ATTEMPTS);
        let err = r.unwrap_err();
        assert!(
            matches!(&err, AdminError::Aborted(m) if m.contains("namespace acme/g changed meanwhile")),
            "{err}"
        );
        // Other refusals are not made again.
        let tries = std::sync::atomic::AtomicU32::new(0);
        let r: Result<(), AdminError> = redone(|| async {
            tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Err(AdminError::FailedPrecondition("in use".into()))
        })
        .await;
        assert!(r.is_err());
        assert_eq!(tries.into_inner(), 1);
    }
}
