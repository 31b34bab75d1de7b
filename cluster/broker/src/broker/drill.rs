//! A failover drill's cut at the site being "lost": a namespace's clients are sent to another
//! site and nothing of the namespace goes there from here until the restore.
//!
//! ```text
//!  /geo-drill-cuts/<namespace> = {to, service URLs of `to`, since}   (this site's store)
//!  while it is there, at every broker of this site (read by each on its policy beat; at once
//!  where the cut was made):
//!    LOOKUP of a topic of the namespace   -> Redirect to `to`'s service URL (stock clients
//!                                            follow it and are served there)
//!    PRODUCER / SUBSCRIBE here            -> ServiceNotReady (the client looks it up again)
//!    replicators to `to`                  stopped (their cursors kept); so is the sync of
//!                                            replicated subscriptions to `to`
//!    replication from `to`, and to other sites, goes on
//!  cut: the record, then the namespace's loaded topics unloaded (their clients reconnect,
//!       and are redirected)
//!  restore: the record removed, then every topic of the namespace loaded (its replicators
//!       start from their cursors: what `to` lacks is sent, once)
//! ```

use std::collections::HashMap;

use meridian_protocol::pb::ServerError;
use serde::{Deserialize, Serialize};

use super::ownership::BrokerInfo;
use super::{now_ms, Broker, BrokerError};
use crate::topic_name::TopicName;

/// Where cuts are recorded: `<prefix><namespace with / as ~>`.
pub const DRILL_CUTS_PREFIX: &str = "/geo-drill-cuts/";

/// A namespace cut over to another site.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cut {
    pub namespace: String,
    /// The site its clients are sent to.
    pub to: String,
    pub service_url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_url_tls: Option<String>,
    pub since_ms: u64,
}

/// The cuts this broker knows of, by namespace.
#[derive(Debug, Default)]
pub struct Cuts {
    known: std::sync::RwLock<HashMap<String, Cut>>,
    /// Held by each change and each re-read: a re-read that began before a cut or a restore
    /// never replaces what it did.
    gate: tokio::sync::Mutex<()>,
}

fn cut_key(ns: &str) -> String {
    format!("{DRILL_CUTS_PREFIX}{}", ns.replace('/', "~"))
}

impl Broker {
    /// The namespace's cut, if it has one.
    pub fn drill_cut(&self, ns: &str) -> Option<Cut> {
        self.cuts.known.read().expect("cuts lock").get(ns).cloned()
    }

    /// Refused while the topic's namespace is cut over to another site (clients look the
    /// topic up again and are redirected there).
    pub fn refuse_if_cut(&self, name: &TopicName) -> Result<(), BrokerError> {
        match self.drill_cut(&name.namespace()) {
            None => Ok(()),
            Some(c) => Err(BrokerError::new(
                ServerError::ServiceNotReady,
                format!(
                    "namespace {} is served at site {} (a failover drill's cut); look the topic up again",
                    c.namespace, c.to
                ),
            )),
        }
    }

    /// A LOOKUP's answer for a topic of a cut namespace: the other site.
    pub(super) fn cut_redirect(&self, ns: &str) -> Option<BrokerInfo> {
        self.drill_cut(ns).map(|c| BrokerInfo {
            id: format!("site {}", c.to),
            service_url: c.service_url,
            service_url_tls: c.service_url_tls,
            ..BrokerInfo::default()
        })
    }

    /// Follows the cuts' records as they change (a watch on `/geo-drill-cuts/`), so every
    /// broker of the site applies a cut made at another within milliseconds, not at its next
    /// policy beat (which re-reads them too, should the watch be down). Ends with the broker.
    pub(super) async fn watch_drill_cuts(broker: std::sync::Weak<Broker>) {
        loop {
            let meta = match broker.upgrade() {
                Some(b) if !b.is_closing() => b.meta.clone(),
                _ => return,
            };
            match meta.watch(DRILL_CUTS_PREFIX, true, 0).await {
                Ok(mut w) => {
                    // What changed before the watch began is read now.
                    match broker.upgrade() {
                        Some(b) if !b.is_closing() => b.refresh_drill_cuts().await,
                        _ => return,
                    }
                    loop {
                        // Woken every second to see whether the broker is closing.
                        let next =
                            tokio::time::timeout(std::time::Duration::from_secs(1), w.next()).await;
                        let Some(b) = broker.upgrade().filter(|b| !b.is_closing()) else {
                            return;
                        };
                        match next {
                            Err(_) => continue,
                            Ok(Some(Ok(_))) => b.refresh_drill_cuts().await,
                            Ok(Some(Err(e))) => {
                                tracing::debug!(error = %e, "the watch of drills' cuts broke; watching again");
                                break;
                            }
                            Ok(None) => break,
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "watching drills' cuts failed; trying again")
                }
            }
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
    }

    /// Re-reads the cuts (the watch's and the policy beat's): a namespace cut at another
    /// broker of this site has its topics here unloaded (their clients go to the other site);
    /// one whose cut ended has the replicators of its topics loaded here started again.
    pub(super) async fn refresh_drill_cuts(&self) {
        let _gate = self.cuts.gate.lock().await;
        let cuts = match self.read_cuts().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "reading failover drills' cuts failed");
                return;
            }
        };
        let old = std::mem::replace(
            &mut *self.cuts.known.write().expect("cuts lock"),
            cuts.clone(),
        );
        for ended in old.keys().filter(|ns| !cuts.contains_key(*ns)) {
            tracing::info!(namespace = %ended, "failover drill: the namespace's cut ended (seen here)");
            for t in self.loaded_topics() {
                if t.name.namespace() == *ended {
                    t.reconcile_replicators(&t.policies()).await;
                }
            }
        }
        for (ns, cut) in cuts.iter().filter(|(ns, _)| !old.contains_key(*ns)) {
            let loaded: Vec<_> = self
                .loaded_topics()
                .into_iter()
                .filter(|t| t.name.namespace() == *ns)
                .collect();
            tracing::info!(
                namespace = %ns,
                to = %cut.to,
                topics = loaded.len(),
                "failover drill: the namespace is cut over to {} (seen here)",
                cut.to
            );
            for t in loaded {
                if let Err(e) = self.unload_topic(&t.name).await {
                    tracing::warn!(topic = %t.name, error = %e, "unloading a cut namespace's topic failed");
                }
            }
        }
    }

    async fn read_cuts(&self) -> Result<HashMap<String, Cut>, BrokerError> {
        let mut out = HashMap::new();
        let mut after = String::new();
        loop {
            let page = self.meta.children(DRILL_CUTS_PREFIX, &after, 0).await?;
            for c in &page.children {
                if let Some(kv) = self.meta.get(&format!("{DRILL_CUTS_PREFIX}{c}")).await? {
                    if let Ok(cut) = serde_json::from_slice::<Cut>(&kv.value) {
                        out.insert(cut.namespace.clone(), cut);
                    }
                }
            }
            match page.children.last() {
                Some(last) if page.more => after = last.clone(),
                _ => return Ok(out),
            }
        }
    }

    /// Cuts `ns` over to site `to` (whose cluster record gives its service URLs): recorded,
    /// then its topics loaded here unloaded so their clients go there.
    pub async fn cut_namespace(&self, ns: &str, to: &str) -> Result<Cut, BrokerError> {
        if to == self.cfg.cluster_name {
            return Err(BrokerError::new(
                ServerError::NotAllowedError,
                format!("{to} is this site; a drill cuts it over to another"),
            ));
        }
        self.require_namespace(ns).await?;
        let store = meridian_tenancy::TenancyStore::new(self.meta.clone());
        let site = store
            .cluster(to)
            .await
            .map_err(|e| BrokerError::new(ServerError::MetadataError, format!("site {to}: {e}")))?;
        let cut = Cut {
            namespace: ns.to_string(),
            to: to.to_string(),
            service_url: site.service_url,
            service_url_tls: None,
            since_ms: now_ms(),
        };
        let value = serde_json::to_vec(&cut).expect("cut serializes");
        let gate = self.cuts.gate.lock().await;
        self.meta.put(&cut_key(ns), value).await?;
        self.cuts
            .known
            .write()
            .expect("cuts lock")
            .insert(ns.to_string(), cut.clone());
        drop(gate);
        let loaded: Vec<_> = self
            .loaded_topics()
            .into_iter()
            .filter(|t| t.name.namespace() == ns)
            .collect();
        tracing::info!(
            namespace = ns,
            to,
            topics = loaded.len(),
            "failover drill: the namespace is cut over to {to}"
        );
        for t in loaded {
            self.unload_topic(&t.name).await?;
        }
        Ok(cut)
    }

    /// Ends `ns`'s cut: the record removed, then `topics` (the namespace's) loaded here so
    /// that their replicators send what the other site lacks.
    pub async fn restore_namespace(
        &self,
        ns: &str,
        topics: &[TopicName],
    ) -> Result<(), BrokerError> {
        {
            let _gate = self.cuts.gate.lock().await;
            self.meta.delete(&cut_key(ns), None).await?;
            self.cuts.known.write().expect("cuts lock").remove(ns);
        }
        tracing::info!(namespace = ns, "failover drill: the namespace's cut ends");
        for name in topics {
            let parts = self.topic_parts(name).await?;
            for p in parts {
                match self.topic(&p, false).await {
                    Ok(t) => {
                        let policies = t.policies();
                        t.reconcile_replicators(&policies).await;
                    }
                    // Served by another broker of this site, or never written to.
                    Err(e) => {
                        tracing::debug!(topic = %p, error = %e, "restore: topic not loaded here")
                    }
                }
            }
        }
        Ok(())
    }
}

impl Cut {
    /// Whether replication of this namespace to `remote` is held by the cut.
    pub fn holds(&self, remote: &str) -> bool {
        self.to == remote
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_namespaces_then_their_keys_are_one_path_segment() {
        assert_eq!(cut_key("acme/g"), "/geo-drill-cuts/acme~g");
        let c = Cut {
            namespace: "acme/g".into(),
            to: "west".into(),
            service_url: "pulsar://w:6650".into(),
            service_url_tls: None,
            since_ms: 5,
        };
        assert!(c.holds("west") && !c.holds("north"));
        let json = serde_json::to_vec(&c).unwrap();
        assert_eq!(serde_json::from_slice::<Cut>(&json).unwrap(), c);
    }
}
