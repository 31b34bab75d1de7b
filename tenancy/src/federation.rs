//! Global objects between sites: cluster records, tenants, namespaces and topics' own policies
//! carry versions
//! ([`crate::versions`]) in their records, deletions leave tombstones, and a peer's copies are
//! merged into this site's field by field. No site coordinates another: each stays writable
//! while cut off, and two sites that have exchanged their copies hold the same objects.
//!
//! ```text
//!  /admin/clusters/<c>, /admin/tenants/<t>, /admin/namespaces/<t>/<n>,  records with "_v"
//!    /admin/topic-policies/<t>/<n>/<topic> (a topic's own policies)
//!  /admin/deleted/clusters/<c>, .../tenants/<t>, .../namespaces/<t>/<n>,  tombstones
//!    .../topic-policies/<t>/<n>/<topic>
//!
//!  export_for(peer): every cluster record and tombstone; every tenant; the namespaces of
//!                    the tenants that allow the peer; the topic policies of those namespaces
//!                    replicated with the peer; the tombstones that name the peer
//!  merge_from(peer): in order clusters, tenants, namespaces, topic policies, tenants again (a
//!                    tenant deleted after its namespaces); each copy merged, checked, written
//!                    by CAS
//! ```
//!
//! What a peer may change here: the registry (never this site's own record away); a tenant
//! that allows the peer (a new one must allow the peer and this site); a namespace of a tenant
//! that allows the peer, listing the peer here or in the peer's copy (a new one must list the
//! peer and this site); a topic's policies in a namespace that lists the peer here. Anything else
//! in a peer's copy is skipped and reported.

use futures::future::BoxFuture;
use meridian_metadata::pb;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::model::{
    check_name, split_namespace, CLUSTERS_PREFIX, NAMESPACES_PREFIX, TENANTS_PREFIX,
    TOPIC_POLICIES_PREFIX,
};
use crate::store::{AdminError, TenancyStore};
use crate::versions::{self, Copy, Tombstone, CLOCK};

/// A peer's version further ahead of this site's clock than this is not taken (a clock far
/// off, or a bad peer, would otherwise win every later change).
pub const CLOCK_DRIFT_MAX_MS: u64 = 10 * 60 * 1000;

/// Where the tombstones of global objects are kept.
pub const TOMBSTONES_PREFIX: &str = "/admin/deleted/";

/// A global object's tombstone key (`/admin/deleted/<kind>/<name>`), or none for another key.
pub fn tombstone_key(key: &str) -> Option<String> {
    kind_of(key).map(|_| {
        format!(
            "{TOMBSTONES_PREFIX}{}",
            key.strip_prefix("/admin/").expect("admin key")
        )
    })
}

/// The kinds of global object, in the order a peer's copies are merged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Cluster,
    Tenant,
    Namespace,
    /// A topic's own policies (`/admin/topic-policies/<tenant>/<namespace>/<topic>`), shared
    /// with the sites of its namespace.
    TopicPolicies,
}

fn kind_of(key: &str) -> Option<Kind> {
    if let Some(n) = key.strip_prefix(CLUSTERS_PREFIX) {
        check_name("cluster", n).ok().map(|_| Kind::Cluster)
    } else if let Some(n) = key.strip_prefix(TENANTS_PREFIX) {
        check_name("tenant", n).ok().map(|_| Kind::Tenant)
    } else if let Some(n) = key.strip_prefix(NAMESPACES_PREFIX) {
        split_namespace(n).ok().map(|_| Kind::Namespace)
    } else if let Some(n) = key.strip_prefix(TOPIC_POLICIES_PREFIX) {
        let (ns, topic) = n.rsplit_once('/')?;
        (!topic.is_empty() && split_namespace(ns).is_ok()).then_some(Kind::TopicPolicies)
    } else {
        None
    }
}

/// One object as a site holds it, on its way to a peer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyncItem {
    /// The object's record key (`/admin/namespaces/acme/g`).
    pub key: String,
    #[serde(flatten)]
    pub copy: Copy,
}

/// What merging a peer's copies did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct MergeReport {
    /// Keys whose copy here changed (created, updated or deleted).
    pub changed: Vec<String>,
    /// Keys not taken, and why.
    pub skipped: Vec<(String, String)>,
}

/// What a site does to its own data when a namespace is deleted elsewhere: deletes the
/// namespace's topics here (the broker's part), so the namespace's record can go.
pub trait NamespaceData: Send + Sync {
    fn delete_topics<'a>(&'a self, namespace: &'a str) -> BoxFuture<'a, Result<(), AdminError>>;
}

/// This site's global objects as read at one moment ([`TenancyStore::export`]).
#[derive(Debug, Clone)]
pub struct Exported {
    clusters: Vec<(String, Copy)>,
    tenants: Vec<(String, Copy)>,
    namespaces: Vec<(String, Copy)>,
    topic_policies: Vec<(String, Copy)>,
}

impl Exported {
    /// What `peer` takes part in (see the module's picture).
    pub fn for_peer(&self, peer: &str) -> Vec<SyncItem> {
        let item = |key: &String, copy: &Copy| SyncItem {
            key: key.clone(),
            copy: copy.clone(),
        };
        let mut items: Vec<SyncItem> = self.clusters.iter().map(|(k, c)| item(k, c)).collect();
        let names_peer = |c: &Copy, kind: Kind| {
            sites_of(kind, c.record.as_ref()).iter().any(|s| s == peer)
                || c.deleted
                    .as_ref()
                    .is_some_and(|t| t.sites.iter().any(|s| s == peer))
        };
        // Every tenant goes to every peer (as Pulsar's tenants are in a store every cluster
        // shares): a peer takes a change only to a tenant that allows this site there, so a
        // tenant that stops allowing the peer still reaches it, and it converges. Deleted
        // ones only to the sites their tombstone names.
        let mut tenants = Vec::new();
        for (key, copy) in &self.tenants {
            if names_peer(copy, Kind::Tenant) && copy.record.is_some() {
                tenants.push(key.strip_prefix(TENANTS_PREFIX).expect("prefix"));
            }
            if copy.record.is_some() || names_peer(copy, Kind::Tenant) {
                items.push(item(key, copy));
            }
        }
        // Namespaces whose record lists the peer: their topics' own policies go too.
        let mut shared = std::collections::BTreeSet::new();
        for (key, copy) in &self.namespaces {
            let ns = key.strip_prefix(NAMESPACES_PREFIX).expect("prefix");
            let tenant = ns.split('/').next().unwrap_or_default();
            if tenants.contains(&tenant) || names_peer(copy, Kind::Namespace) {
                items.push(item(key, copy));
                let lists = sites_of(Kind::Namespace, copy.record.as_ref());
                if tenants.contains(&tenant) && lists.iter().any(|s| s == peer) {
                    shared.insert(ns);
                }
            }
        }
        // A topic's policies: the record to the sites of a shared namespace; a deletion only
        // to the sites its tombstone names (one made here alone names none).
        for (key, copy) in &self.topic_policies {
            let name = key.strip_prefix(TOPIC_POLICIES_PREFIX).expect("prefix");
            let to_peer = copy
                .deleted
                .as_ref()
                .is_some_and(|t| t.sites.iter().any(|s| s == peer));
            if (copy.record.is_some() && shared.contains(namespace_of_topic(name))) || to_peer {
                items.push(item(key, copy));
            }
        }
        items
    }
}

fn strings(v: Option<&Value>, field: &str) -> Vec<String> {
    v.and_then(|v| v.get(field))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// The sites an object's record names: a tenant's allowed clusters, a namespace's
/// replication clusters.
fn sites_of(kind: Kind, record: Option<&Value>) -> Vec<String> {
    match kind {
        Kind::Cluster => Vec::new(),
        Kind::Tenant => strings(record, "allowed_clusters"),
        Kind::Namespace | Kind::TopicPolicies => strings(record, "replication_clusters"),
    }
}

/// The namespace (`tenant/namespace`) of a topic's policies, from the name under
/// `/admin/topic-policies/` (the topic's own part has its `/` escaped).
fn namespace_of_topic(name: &str) -> &str {
    name.rsplit_once('/').map_or(name, |(ns, _)| ns)
}

fn damaged(key: &str, e: serde_json::Error) -> AdminError {
    AdminError::Unavailable(format!("record {key} is damaged: {e}"))
}

/// A copy as read, with the versions its keys had (0: absent), for the CAS that replaces it.
struct Held {
    copy: Copy,
    record_rev: u64,
    tomb_rev: u64,
}

impl TenancyStore {
    async fn held(&self, key: &str) -> Result<Held, AdminError> {
        let tkey = tombstone_key(key).expect("a global key");
        let (record, record_rev) = match self.meta.get(key).await? {
            Some(kv) => (
                Some(serde_json::from_slice(&kv.value).map_err(|e| damaged(key, e))?),
                kv.mod_revision,
            ),
            None => (None, 0),
        };
        let (deleted, tomb_rev) = match self.meta.get(&tkey).await? {
            Some(kv) => (
                Some(serde_json::from_slice(&kv.value).map_err(|e| damaged(&tkey, e))?),
                kv.mod_revision,
            ),
            None => (None, 0),
        };
        Ok(Held {
            copy: Copy { record, deleted },
            record_rev,
            tomb_rev,
        })
    }

    /// Creates (`version` 0) or replaces a global object's record, versioning the fields that
    /// change as changed here, now.
    pub(crate) async fn put_global(
        &self,
        key: &str,
        value: Value,
        version: u64,
        what: &str,
    ) -> Result<(), AdminError> {
        let held = self.held(key).await?;
        let raced = || {
            if version == 0 {
                AdminError::AlreadyExists(format!("{what} already exists"))
            } else {
                crate::store::raced(what)
            }
        };
        if held.record_rev != version {
            return Err(raced());
        }
        let old = held.copy.record.as_ref();
        let floor = versions::floor(old, held.copy.deleted.as_ref());
        let at = CLOCK.tick(versions::wall_ms(), &self.site, floor.as_ref());
        let next = Copy {
            record: Some(versions::stamp(old, &value, &at)),
            deleted: held.copy.deleted.clone(),
        };
        // Conditioned on the tombstone too: a deletion merged meanwhile is not outrun.
        if self.write(key, &held, &next).await? {
            Ok(())
        } else {
            Err(raced())
        }
    }

    /// Deletes a global object's record at `version`, leaving its tombstone in the same
    /// transaction; the tombstone names the sites the deletion goes to.
    pub(crate) async fn delete_global(
        &self,
        key: &str,
        version: u64,
        what: &str,
    ) -> Result<(), AdminError> {
        self.delete_copy(key, version, what, true).await
    }

    /// Deletes a global object's record here only (a topic's own policies as its topic is
    /// deleted at this site): the tombstone names no site, so it goes nowhere, and keeps an
    /// older copy from a peer from bringing the record back here.
    pub(crate) async fn delete_here(
        &self,
        key: &str,
        version: u64,
        what: &str,
    ) -> Result<(), AdminError> {
        self.delete_copy(key, version, what, false).await
    }

    async fn delete_copy(
        &self,
        key: &str,
        version: u64,
        what: &str,
        travels: bool,
    ) -> Result<(), AdminError> {
        let held = self.held(key).await?;
        let raced = || crate::store::raced(what);
        if held.record_rev != version {
            return Err(raced());
        }
        let kind = kind_of(key).expect("a global key");
        let old = held.copy.record.as_ref();
        let floor = versions::floor(old, held.copy.deleted.as_ref());
        let at = CLOCK.tick(versions::wall_ms(), &self.site, floor.as_ref());
        let mut sites = sites_of(kind, old);
        if !travels {
            sites.clear();
        } else if kind == Kind::TopicPolicies {
            // A topic's policies go to the sites of its namespace: so does their deletion.
            let name = key
                .strip_prefix(TOPIC_POLICIES_PREFIX)
                .expect("a topic's policies");
            let ns = namespace_of_topic(name);
            let ns_record = self.record(&format!("{NAMESPACES_PREFIX}{ns}")).await?;
            sites.extend(strings(ns_record.as_ref(), "replication_clusters"));
            sites.sort();
            sites.dedup();
        }
        let tomb = Tombstone { at, sites };
        let mut next = held.copy.clone();
        next.record = None;
        next.deleted = Some(tomb);
        if self.write(key, &held, &next).await? {
            Ok(())
        } else {
            Err(raced())
        }
    }

    /// Replaces `held` by `next` (record and tombstone) in one transaction; false: either
    /// changed meanwhile.
    async fn write(&self, key: &str, held: &Held, next: &Copy) -> Result<bool, AdminError> {
        let tkey = tombstone_key(key).expect("a global key");
        let mut success = Vec::new();
        if next.deleted != held.copy.deleted {
            if let Some(t) = &next.deleted {
                success.push(pb::Op {
                    op: Some(pb::op::Op::Put(pb::PutOp {
                        key: tkey.clone(),
                        value: serde_json::to_vec(t).expect("json"),
                        ..Default::default()
                    })),
                });
            }
        }
        match &next.record {
            Some(r) => success.push(pb::Op {
                op: Some(pb::op::Op::Put(pb::PutOp {
                    key: key.to_string(),
                    value: serde_json::to_vec(r).expect("json"),
                    ..Default::default()
                })),
            }),
            None if held.record_rev != 0 => success.push(pb::Op {
                op: Some(pb::op::Op::Delete(pb::DeleteOp {
                    key: key.to_string(),
                    prefix: false,
                })),
            }),
            None => {}
        }
        let resp = self
            .meta
            .txn(pb::TxnRequest {
                conditions: vec![
                    pb::Condition {
                        key: key.to_string(),
                        expected_version: held.record_rev,
                    },
                    pb::Condition {
                        key: tkey,
                        expected_version: held.tomb_rev,
                    },
                ],
                success,
                failure: vec![],
            })
            .await?;
        Ok(resp.succeeded)
    }

    async fn copies(&self, prefix: &str) -> Result<Vec<(String, Copy)>, AdminError> {
        let mut out: std::collections::BTreeMap<String, Copy> = Default::default();
        for kv in self.meta.list_all(prefix).await? {
            if kind_of(&kv.key).is_none() {
                continue;
            }
            let record = serde_json::from_slice(&kv.value).map_err(|e| damaged(&kv.key, e))?;
            out.entry(kv.key).or_default().record = Some(record);
        }
        let tprefix = format!(
            "{TOMBSTONES_PREFIX}{}",
            prefix.strip_prefix("/admin/").expect("an admin prefix")
        );
        for kv in self.meta.list_all(&tprefix).await? {
            let key = format!(
                "/admin/{}",
                kv.key.strip_prefix(TOMBSTONES_PREFIX).expect("prefix")
            );
            if kind_of(&key).is_none() {
                continue;
            }
            let t = serde_json::from_slice(&kv.value).map_err(|e| damaged(&kv.key, e))?;
            out.entry(key).or_default().deleted = Some(t);
        }
        Ok(out.into_iter().collect())
    }

    /// A record as stored here, if there is one.
    async fn record(&self, key: &str) -> Result<Option<Value>, AdminError> {
        Ok(self.get::<Value>(key).await?.map(|(v, _)| v))
    }

    /// This site's global objects that `peer` takes part in (see the module's picture).
    pub async fn export_for(&self, peer: &str) -> Result<Vec<SyncItem>, AdminError> {
        Ok(self.export().await?.for_peer(peer))
    }

    /// This site's global objects, read once for any number of peers.
    pub async fn export(&self) -> Result<Exported, AdminError> {
        Ok(Exported {
            clusters: self.copies(CLUSTERS_PREFIX).await?,
            tenants: self.copies(TENANTS_PREFIX).await?,
            namespaces: self.copies(NAMESPACES_PREFIX).await?,
            topic_policies: self.copies(TOPIC_POLICIES_PREFIX).await?,
        })
    }

    /// Merges `peer`'s copies into this site's (see the module's picture for what a peer may
    /// change).
    pub async fn merge_from(
        &self,
        peer: &str,
        mut items: Vec<SyncItem>,
        data: &dyn NamespaceData,
    ) -> Result<MergeReport, AdminError> {
        let mut report = MergeReport::default();
        items.retain(|i| match kind_of(&i.key) {
            Some(_) => true,
            None => {
                report
                    .skipped
                    .push((i.key.clone(), "not a global object".into()));
                false
            }
        });
        items.sort_by_key(|i| kind_of(&i.key));
        // Tenants once more at the end: one deleted with its namespaces goes after them.
        let again: Vec<SyncItem> = items
            .iter()
            .filter(|i| kind_of(&i.key) == Some(Kind::Tenant))
            .cloned()
            .collect();
        let horizon = versions::wall_ms() + CLOCK_DRIFT_MAX_MS;
        for (n, item) in items.iter().chain(again.iter()).enumerate() {
            let last_pass = n >= items.len();
            let newest = item
                .copy
                .record
                .as_ref()
                .and_then(versions::newest)
                .max(item.copy.deleted.as_ref().map(|t| t.at.clone()));
            if let Some(v) = newest.as_ref().filter(|v| v.0 > horizon) {
                report.skipped.push((
                    item.key.clone(),
                    format!("its version {v} is ahead of this site's clock by more than {CLOCK_DRIFT_MAX_MS} ms"),
                ));
                continue;
            }
            match self.merge_one(peer, item, data, last_pass).await {
                Ok(Some(changed)) => {
                    if let Some(v) = &newest {
                        CLOCK.observe(v);
                    }
                    if changed && !report.changed.contains(&item.key) {
                        report.changed.push(item.key.clone())
                    }
                }
                Ok(None) => {}
                // The metadata store is not there: nothing more can be merged now.
                Err(e @ AdminError::Unavailable(_)) => return Err(e),
                // This object is not taken; the others still are.
                Err(e) => {
                    if last_pass || kind_of(&item.key) != Some(Kind::Tenant) {
                        report.skipped.push((item.key.clone(), e.to_string()));
                    }
                }
            }
        }
        Ok(report)
    }

    /// One object: Some(changed) once merged, None when it waits for the last pass.
    async fn merge_one(
        &self,
        peer: &str,
        item: &SyncItem,
        data: &dyn NamespaceData,
        last_pass: bool,
    ) -> Result<Option<bool>, AdminError> {
        let kind = kind_of(&item.key).expect("checked");
        let incoming = item.copy.clone();
        let name = item
            .key
            .strip_prefix("/admin/")
            .and_then(|k| k.split_once('/'))
            .map(|(_, n)| n.to_string())
            .unwrap_or_default();
        let denied = |why: String| Err(AdminError::PermissionDenied(why));
        if kind == Kind::Cluster && name == self.site {
            // This site's own record changes only here.
            return denied(format!("site {name}'s own record changes only at {name}"));
        }
        for made in 0..crate::store::RACE_ATTEMPTS {
            if made > 0 {
                // Another change of the record came first (an admin's here).
                tokio::time::sleep(crate::store::race_pause(made)).await;
            }
            let held = self.held(&item.key).await?;
            let here = held.copy.record.as_ref();
            // What the peer may change.
            match kind {
                Kind::Cluster => {}
                Kind::Tenant => {
                    let allowed = |r: Option<&Value>| {
                        strings(r, "allowed_clusters").iter().any(|s| s == peer)
                    };
                    let ok = if here.is_some() {
                        allowed(here)
                    } else {
                        let theirs = strings(incoming.record.as_ref(), "allowed_clusters");
                        incoming.record.is_none()
                            || (theirs.iter().any(|s| s == peer) && theirs.contains(&self.site))
                    };
                    if !ok {
                        return denied(format!("tenant {name} does not allow site {peer} here"));
                    }
                }
                Kind::Namespace => {
                    let tenant = name.split('/').next().unwrap_or_default();
                    let t = self.record(&format!("{TENANTS_PREFIX}{tenant}")).await?;
                    if !strings(t.as_ref(), "allowed_clusters")
                        .iter()
                        .any(|s| s == peer)
                    {
                        return denied(format!("tenant {tenant} does not allow site {peer} here"));
                    }
                    let lists = |r: Option<&Value>, s: &str| {
                        strings(r, "replication_clusters").iter().any(|c| c == s)
                    };
                    let theirs = incoming.record.as_ref();
                    let ok = if here.is_some() {
                        lists(here, peer)
                    } else {
                        theirs.is_none() || (lists(theirs, peer) && lists(theirs, &self.site))
                    };
                    if !ok {
                        return denied(format!(
                            "namespace {name} is not replicated with site {peer} here"
                        ));
                    }
                }
                Kind::TopicPolicies => {
                    // Its namespace here, of a tenant that allows the peer, lists the peer.
                    let ns = namespace_of_topic(&name);
                    let tenant = ns.split('/').next().unwrap_or_default();
                    let t = self.record(&format!("{TENANTS_PREFIX}{tenant}")).await?;
                    let n = self.record(&format!("{NAMESPACES_PREFIX}{ns}")).await?;
                    let lists = |r: Option<&Value>, field: &str| {
                        strings(r, field).iter().any(|s| s == peer)
                    };
                    if !lists(t.as_ref(), "allowed_clusters")
                        || !lists(n.as_ref(), "replication_clusters")
                    {
                        return denied(format!(
                            "topic policies {name}: namespace {ns} is not replicated with site {peer} here"
                        ));
                    }
                }
            }
            let mut next = versions::merge(&held.copy, &incoming);
            if next == held.copy {
                return Ok(Some(false));
            }
            if here.is_some() && next.record.is_none() {
                // A deletion from elsewhere: what it would leave behind here first.
                match kind {
                    Kind::Cluster => {
                        for (tkey, t) in self.copies(TENANTS_PREFIX).await? {
                            if strings(t.record.as_ref(), "allowed_clusters").contains(&name) {
                                return Err(AdminError::FailedPrecondition(format!(
                                    "cluster {name} is still allowed to {tkey} here"
                                )));
                            }
                        }
                    }
                    Kind::Tenant => {
                        if !self.namespaces(&name).await?.is_empty() {
                            if !last_pass {
                                return Ok(None);
                            }
                            return Err(AdminError::FailedPrecondition(format!(
                                "tenant {name} still has namespaces here"
                            )));
                        }
                    }
                    Kind::Namespace => data.delete_topics(&name).await.map_err(|e| {
                        AdminError::FailedPrecondition(format!(
                            "namespace {name}'s topics here were not deleted: {e}"
                        ))
                    })?,
                    Kind::TopicPolicies => {}
                }
            }
            if let Some(record) = &next.record {
                // An object this site could not read is not taken (a field of a newer
                // Meridian's, of another type).
                let plain = versions::plain(record);
                let readable = match kind {
                    Kind::Cluster => serde_json::from_value::<crate::model::ClusterData>(plain)
                        .map(|c| crate::store::check_cluster(&c).map_err(|e| e.to_string()))
                        .map_err(|e| e.to_string())
                        .and_then(|r| r),
                    Kind::Tenant => serde_json::from_value::<crate::model::TenantInfo>(plain)
                        .map(|_| ())
                        .map_err(|e| e.to_string()),
                    Kind::Namespace | Kind::TopicPolicies => {
                        serde_json::from_value::<crate::model::NamespacePolicies>(plain)
                            .map(|_| ())
                            .map_err(|e| e.to_string())
                    }
                };
                if let Err(e) = readable {
                    return Err(AdminError::FailedPrecondition(format!(
                        "{} from {peer} is not taken: {e}",
                        item.key
                    )));
                }
            }
            if let Some(t) = next.deleted.as_mut() {
                t.sites.sort();
                t.sites.dedup();
            }
            if self.write(&item.key, &held, &next).await? {
                if kind == Kind::Namespace && next.record.is_none() {
                    self.clear_topic_policies(&name).await?;
                }
                return Ok(Some(true));
            }
        }
        Err(AdminError::FailedPrecondition(format!(
            "{} kept changing while it was merged",
            item.key
        )))
    }
}
