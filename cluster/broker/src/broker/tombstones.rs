//! Global deletion: a topic of a replicated namespace deleted at one site is deleted at every
//! site of its replication clusters, and late replicated entries do not bring it back.
//!
//! ```text
//!  deleting site                                   each other site
//!  topics delete T ─► T deleted here
//!    tombstone /geo-tombstones/<T> {pending: sites}
//!  tombstone loop (every second, each broker):
//!    Delete{T, at} per pending site ─────────────► T deleted (forced), tombstone {pending: []}
//!    that site leaves `pending` ◄──────────────── Deleted
//!  a stream for T (or a partition of it) while its tombstone is live is refused (NotAllowed)
//! ```
//!
//! A tombstone is live while a site has not confirmed the deletion and for
//! `geo.tombstone_grace_ms` after the last did; then it is removed and the topic may be
//! created again (by producers or replication) like any other.

use std::sync::Arc;
use std::time::Duration;

use meridian_geo::frame::RefusalCode;
use meridian_geo::receiver::Refusal;
use serde::{Deserialize, Serialize};

use super::{now_ms, Broker, BrokerError};
use crate::topic_name::TopicName;

/// Where tombstones are kept, by the topic's managed-ledger name.
pub const TOMBSTONES_PREFIX: &str = "/geo-tombstones/";

/// A deleted global topic.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Tombstone {
    /// Its full name (a partitioned topic's: its partitions are covered too).
    pub topic: String,
    /// The site where it was deleted.
    pub site: String,
    pub deleted_at_ms: u64,
    /// Sites that have not confirmed the deletion yet (at the deleting site; empty at the
    /// others).
    pub pending: Vec<String>,
    /// When the last of them confirmed (0 while some have not).
    pub settled_at_ms: u64,
    /// Only a deletion at `pending` (the topic stays here: those sites left its replication
    /// clusters and their copies are deleted on request); refuses no stream here, and goes
    /// once every site confirmed.
    #[serde(default)]
    pub remote_only: bool,
}

impl Tombstone {
    /// Whether it still refuses the topic's streams (a remote-only one never does).
    pub fn live(&self, now: u64, grace: Duration) -> bool {
        !self.remote_only
            && (!self.pending.is_empty()
                || now < self.settled_at_ms.saturating_add(grace.as_millis() as u64))
    }

    /// Whether it is done with: every site confirmed and, unless remote-only, the grace
    /// passed.
    fn spent(&self, now: u64, grace: Duration) -> bool {
        self.pending.is_empty() && (self.remote_only || !self.live(now, grace))
    }
}

fn key(name: &TopicName) -> String {
    format!("{TOMBSTONES_PREFIX}{}", name.managed_ledger_name())
}

impl Broker {
    /// The remote sites a topic is replicated to, by its policies now (none without a link).
    pub(crate) async fn remote_replication_clusters(
        &self,
        name: &TopicName,
    ) -> Result<Vec<String>, BrokerError> {
        if self.geo.get().is_none() {
            return Ok(Vec::new());
        }
        let p = self.namespace_policies(&name.namespace()).await?;
        let own = self
            .topic_own_policies(&self.own_policies_key(name).await?)
            .await?;
        Ok(p.overlaid(&own)
            .replication_clusters
            .unwrap_or_default()
            .into_iter()
            .filter(|c| *c != self.cfg.cluster_name)
            .collect())
    }

    /// Changes `name`'s tombstone with `f` (given what is there; `None` from `f`: leave it),
    /// by compare-and-set, again after a conflict. Returns what was there before.
    async fn update_tombstone(
        &self,
        name: &TopicName,
        f: impl Fn(Option<Tombstone>) -> Option<Tombstone>,
    ) -> Result<Option<Tombstone>, BrokerError> {
        let k = key(name);
        loop {
            let (prev, version) = match self.meta.get(&k).await? {
                Some(kv) => (
                    serde_json::from_slice::<Tombstone>(&kv.value).ok(),
                    kv.mod_revision,
                ),
                None => (None, 0),
            };
            let Some(next) = f(prev.clone()) else {
                return Ok(prev);
            };
            let opts = meridian_metadata::client::PutOptions {
                expected_version: Some(version),
                ..Default::default()
            };
            let value = serde_json::to_vec(&next).expect("tombstone serializes");
            match self.meta.put_with(&k, value, opts).await {
                Ok(_) => return Ok(prev),
                Err(meridian_metadata::client::ClientError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The replication clusters a topic sets itself (not its namespace's), if any.
    pub(crate) async fn own_replication_clusters(
        &self,
        name: &TopicName,
    ) -> Result<Vec<String>, BrokerError> {
        Ok(self
            .topic_own_policies(&self.own_policies_key(name).await?)
            .await?
            .replication_clusters
            .unwrap_or_default())
    }

    /// Records that `name` is being deleted here and is to be deleted at `remotes` too,
    /// merged with a deletion already on its way (its sites stay pending). Written before the
    /// deletion, so streams for it are refused from then on; returns the record it replaced,
    /// for [`Broker::restore_tombstone`] should the deletion fail.
    pub(crate) async fn tombstone_deleted(
        &self,
        name: &TopicName,
        remotes: Vec<String>,
    ) -> Result<Option<Tombstone>, BrokerError> {
        let now = now_ms();
        let prev = self
            .update_tombstone(name, |prev| {
                let mut pending = prev.map(|t| t.pending).unwrap_or_default();
                for r in &remotes {
                    if !pending.contains(r) {
                        pending.push(r.clone());
                    }
                }
                Some(Tombstone {
                    topic: name.to_string(),
                    site: self.cfg.cluster_name.clone(),
                    deleted_at_ms: now,
                    settled_at_ms: if pending.is_empty() { now } else { 0 },
                    pending,
                    remote_only: false,
                })
            })
            .await?;
        if !remotes.is_empty() {
            tracing::info!(topic = %name, sites = %remotes.join(","), "global topic deleted here: the deletion goes to its other sites");
        }
        Ok(prev)
    }

    /// Puts back the record [`Broker::tombstone_deleted`] replaced (the deletion failed).
    pub(crate) async fn restore_tombstone(&self, name: &TopicName, prev: Option<Tombstone>) {
        let r = match prev {
            Some(t) => self
                .meta
                .put(
                    &key(name),
                    serde_json::to_vec(&t).expect("tombstone serializes"),
                )
                .await
                .map(|_| ()),
            None => self.meta.delete(&key(name), None).await.map(|_| ()),
        };
        if let Err(e) = r {
            tracing::warn!(topic = %name, error = %e, "restoring a tombstone failed");
        }
    }

    /// Wakes the loop that carries deletions to other sites.
    pub(crate) fn wake_tombstones(&self) {
        self.tombstone_wake.notify_one();
    }

    /// Asks `sites` to delete their copies of `name`, which stays here (they left its
    /// replication clusters), merged with a deletion already on its way.
    pub(crate) async fn tombstone_remote(
        &self,
        name: &TopicName,
        sites: Vec<String>,
    ) -> Result<(), BrokerError> {
        let now = now_ms();
        self.update_tombstone(name, |prev| {
            let mut t = match prev {
                // A deletion of the topic everywhere on its way: these sites join it.
                Some(t) if !t.remote_only && !t.pending.is_empty() => t,
                Some(t) if t.remote_only => t,
                _ => Tombstone {
                    topic: name.to_string(),
                    site: self.cfg.cluster_name.clone(),
                    deleted_at_ms: now,
                    remote_only: true,
                    ..Tombstone::default()
                },
            };
            for s in &sites {
                if !t.pending.contains(s) {
                    t.pending.push(s.clone());
                }
            }
            t.settled_at_ms = 0;
            Some(t)
        })
        .await?;
        tracing::info!(topic = %name, sites = %sites.join(","), "the topic's copies at sites that left its replication clusters are to be deleted");
        self.tombstone_wake.notify_one();
        Ok(())
    }

    /// The live tombstone of `name`, or of the partitioned topic it is a partition of.
    pub(crate) async fn live_tombstone(
        &self,
        name: &TopicName,
        grace: Duration,
    ) -> Result<Option<Tombstone>, BrokerError> {
        let now = now_ms();
        for n in std::iter::once(name.clone()).chain(name.parent()) {
            if let Some(kv) = self.meta.get(&key(&n)).await? {
                match serde_json::from_slice::<Tombstone>(&kv.value) {
                    Ok(t) if t.live(now, grace) => return Ok(Some(t)),
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(key = %kv.key, error = %e, "a damaged tombstone ignored")
                    }
                }
            }
        }
        Ok(None)
    }

    /// Site `origin` deleted `topic`: it is deleted here (producers and consumers closed), and
    /// a tombstone keeps late entries out. Only for a topic replicated with `origin`.
    pub(crate) async fn delete_for_site(
        &self,
        origin: &str,
        topic: &str,
        deleted_at_ms: u64,
    ) -> Result<(), Refusal> {
        let name = TopicName::parse(topic)
            .map_err(|e| Refusal::new(RefusalCode::Protocol, e.to_string()))?;
        let retry = |e: BrokerError| Refusal::new(RefusalCode::Retry, e.to_string());
        self.check_replicated_with(&name, origin)
            .await
            .map_err(|r| Refusal::new(r.code, format!("{} (deletion refused)", r.reason)))?;
        // The deletion goes on from here to the topic's other sites too (once: a deletion
        // already live here is not passed on again), so this site's tombstone stays live
        // until they have it, however long one of them is cut off.
        let others: Vec<String> = self
            .remote_replication_clusters(&name)
            .await
            .map_err(retry)?
            .into_iter()
            .filter(|c| c != origin)
            .collect();
        let grace = self
            .geo
            .get()
            .map_or(Duration::from_secs(60), |l| l.tombstone_grace());
        // The tombstone first: a stream for the topic that opens meanwhile is refused. A
        // deletion of this site's own on its way keeps its pending sites.
        let now = now_ms();
        self.update_tombstone(&name, |prev| {
            let fresh = prev.as_ref().is_none_or(|t| !t.live(now, grace));
            let mut t = prev.unwrap_or_else(|| Tombstone {
                topic: name.to_string(),
                site: origin.to_string(),
                deleted_at_ms,
                ..Tombstone::default()
            });
            if fresh {
                t.deleted_at_ms = deleted_at_ms;
                for o in &others {
                    if !t.pending.contains(o) {
                        t.pending.push(o.clone());
                    }
                }
            }
            t.remote_only = false;
            t.settled_at_ms = if t.pending.is_empty() { now } else { 0 };
            Some(t)
        })
        .await
        .map_err(retry)?;
        self.tombstone_wake.notify_one();
        match self.delete_topic(&name, true, false).await {
            Ok(_) => {
                tracing::info!(topic = %name, origin, "deleted at the request of site {origin}")
            }
            Err(e) if e.code == meridian_protocol::pb::ServerError::TopicNotFound => {}
            Err(e) => return Err(retry(e)),
        }
        Ok(())
    }

    /// Carries deletions to the sites that have not confirmed them, every second (or at once
    /// after a deletion here), and removes tombstones whose grace has passed.
    pub async fn tombstone_loop(self: Arc<Self>) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = self.tombstone_wake.notified() => {}
            }
            if self.is_closing() {
                return;
            }
            let Some(link) = self.geo.get().cloned() else {
                continue;
            };
            let kvs = match self.meta.list_all(TOMBSTONES_PREFIX).await {
                Ok(k) => k,
                Err(e) => {
                    tracing::warn!(error = %e, "listing tombstones failed");
                    continue;
                }
            };
            // A site that did not answer is not asked again this round (each ask may wait).
            let mut unreachable: Vec<String> = Vec::new();
            for kv in kvs {
                let Ok(mut t) = serde_json::from_slice::<Tombstone>(&kv.value) else {
                    continue;
                };
                if t.spent(now_ms(), link.tombstone_grace()) {
                    let _ = self.meta.delete(&kv.key, Some(kv.mod_revision)).await;
                    continue;
                }
                if t.pending.is_empty() {
                    continue;
                }
                let mut confirmed = Vec::new();
                let ask: Vec<String> = t
                    .pending
                    .iter()
                    .filter(|s| !unreachable.contains(s))
                    .cloned()
                    .collect();
                for site in &ask {
                    match meridian_geo::deletion::send_delete(
                        &link,
                        site,
                        &t.topic,
                        t.deleted_at_ms,
                        Duration::from_secs(10),
                    )
                    .await
                    {
                        Ok(()) => confirmed.push(site.clone()),
                        // It answered and will not: asking again would hold up the rest.
                        Err(meridian_geo::deletion::DeleteFailure::Refused(why)) => {
                            tracing::warn!(topic = %t.topic, site, reason = %why, "the site refused the topic's deletion; it is not asked again");
                            confirmed.push(site.clone());
                        }
                        Err(meridian_geo::deletion::DeleteFailure::Failed(e)) => {
                            tracing::debug!(topic = %t.topic, site, error = %e, "the deletion did not reach the site yet");
                            unreachable.push(site.clone());
                        }
                    }
                }
                if confirmed.is_empty() {
                    continue;
                }
                t.pending.retain(|s| !confirmed.contains(s));
                if t.pending.is_empty() {
                    t.settled_at_ms = now_ms();
                    tracing::info!(topic = %t.topic, "every site deleted the topic");
                }
                let value = serde_json::to_vec(&t).expect("tombstone serializes");
                let opts = meridian_metadata::client::PutOptions {
                    expected_version: Some(kv.mod_revision),
                    ..Default::default()
                };
                // A conflict: another broker of this site moved it on; the next round sees it.
                let _ = self.meta.put_with(&kv.key, value, opts).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_a_tombstone_then_it_is_live_until_every_site_confirmed_and_the_grace_passed() {
        let grace = Duration::from_secs(60);
        let mut t = Tombstone {
            topic: "persistent://acme/g/t".into(),
            site: "east".into(),
            deleted_at_ms: 1_000,
            pending: vec!["west".into()],
            settled_at_ms: 0,
            remote_only: false,
        };
        // Pending: live however old.
        assert!(t.live(u64::MAX, grace));
        t.pending.clear();
        t.settled_at_ms = 10_000;
        assert!(t.live(10_000, grace));
        assert!(t.live(69_999, grace));
        assert!(!t.live(70_000, grace));
        assert!(t.spent(70_000, grace));
        // A remote-only one refuses nothing here, and is done once the sites confirmed.
        let mut r = Tombstone {
            remote_only: true,
            pending: vec!["west".into()],
            ..t.clone()
        };
        assert!(!r.live(10_000, grace));
        assert!(!r.spent(10_000, grace));
        r.pending.clear();
        assert!(r.spent(10_000, grace));
        assert_eq!(
            key(&TopicName::parse("persistent://acme/g/a%b").unwrap()),
            "/geo-tombstones/acme/g/persistent/a%25b"
        );
    }
}
