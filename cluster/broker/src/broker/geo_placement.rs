//! Placing the bundles of a namespace replicated with other sites on brokers with a geo
//! link: other sites open a topic's stream at the broker that owns it, and a broker without a
//! link cannot take it (the stream would be refused for as long as that broker owned it).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use meridian_protocol::pb::ServerError;

use super::bundles::Bundle;
use super::ownership::BrokerInfo;
use super::{Broker, BrokerError, NamespacePolicies};

/// Of `brokers`, those with a geo link, when any has one (else all: a site without links
/// places as it would without replication).
pub fn linked_if_any(brokers: Vec<BrokerInfo>) -> Vec<BrokerInfo> {
    if brokers.iter().any(|b| !b.geo_url.is_empty()) {
        brokers
            .into_iter()
            .filter(|b| !b.geo_url.is_empty())
            .collect()
    } else {
        brokers
    }
}

impl Broker {
    /// Whether `ns` is replicated with another site: its replication clusters name one, or
    /// a topic's own replication clusters do (its bundle must sit where the stream can come).
    pub(super) async fn replicated_elsewhere(&self, ns: &str) -> Result<bool, BrokerError> {
        let elsewhere = |p: &NamespacePolicies| {
            p.replication_clusters
                .as_ref()
                .is_some_and(|c| c.iter().any(|c| *c != self.cfg.cluster_name))
        };
        if elsewhere(&self.namespace_policies(ns).await?) {
            return Ok(true);
        }
        Ok(self
            .namespace_topic_policies(ns)
            .await?
            .values()
            .any(elsewhere))
    }

    /// Whether a bundle of `ns` may move to the broker `to` of `brokers` as far as geo links
    /// go: `to` has one, `ns` is not replicated with another site, or no broker has a link.
    /// `known`: what a shedding round has read of namespaces so far.
    pub(super) async fn geo_link_allows(
        &self,
        ns: &str,
        to: &str,
        brokers: &[BrokerInfo],
        known: &mut HashMap<String, bool>,
    ) -> Result<bool, BrokerError> {
        let linked = |id: &str| brokers.iter().any(|b| b.id == id && !b.geo_url.is_empty());
        if linked(to) || !brokers.iter().any(|b| !b.geo_url.is_empty()) {
            return Ok(true);
        }
        if let Some(r) = known.get(ns) {
            return Ok(!r);
        }
        let r = self.replicated_elsewhere(ns).await?;
        known.insert(ns.to_string(), r);
        Ok(!r)
    }

    /// Of the live brokers (`brokers`, else read) the isolation policies let own a bundle of
    /// `ns`, those with a geo link, when `ns` is replicated with another site and this broker
    /// has none (else empty): where its unowned bundles go instead of here.
    async fn linked_instead(
        &self,
        ns: &str,
        brokers: Option<&[BrokerInfo]>,
    ) -> Result<Vec<BrokerInfo>, BrokerError> {
        if !self.ownership.me().geo_url.is_empty() {
            return Ok(Vec::new());
        }
        let brokers = match brokers {
            Some(b) => b.to_vec(),
            None => self.ownership.brokers().await?,
        };
        // No broker with a link (a site without geo-replication): nothing more to read.
        if !brokers.iter().any(|b| !b.geo_url.is_empty()) || !self.replicated_elsewhere(ns).await? {
            return Ok(Vec::new());
        }
        // The policies judge the whole site, as placement does; then the linked ones.
        Ok(self
            .ownership
            .allowed(ns, brokers)
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|b| !b.geo_url.is_empty())
            .collect())
    }

    /// Refuses (ServiceNotReady, so the client looks the topic up again) to take an unowned
    /// bundle of `ns` at this broker, which has no geo link, when `ns` is replicated with
    /// another site and a broker with one may take it: an admin call or a client that skipped
    /// the lookup would otherwise place it here until the next beat lets it go.
    pub(super) async fn refuse_unlinked_acquisition(&self, ns: &str) -> Result<(), BrokerError> {
        let to = self.linked_instead(ns, None).await?;
        if to.is_empty() {
            return Ok(());
        }
        Err(BrokerError::new(
            ServerError::ServiceNotReady,
            format!(
                "{ns} is replicated with other sites and broker {} has no geo link: its bundles go to a broker with one ({}); look the topic up again",
                self.ownership.id(),
                to.iter().map(|t| t.id.as_str()).collect::<Vec<_>>().join(", ")
            ),
        ))
    }

    /// Where an unowned bundle `b` of `ns` goes instead of this broker, which has no geo
    /// link, when `ns` is replicated with another site and a broker with one may take it:
    /// an admin call is forwarded there, a stream sent there (Moved).
    pub(crate) async fn placed_instead(
        &self,
        ns: &str,
        b: &Bundle,
    ) -> Result<Option<BrokerInfo>, BrokerError> {
        if self.linked_instead(ns, None).await?.is_empty() {
            return Ok(None);
        }
        let to = self.ownership.candidate(ns, b, async { Ok(true) }).await?;
        Ok((to.id != self.ownership.id()).then_some(to))
    }

    /// Unloads the bundles this broker (which has no geo link) owns of namespaces replicated
    /// with other sites when a live broker with a link may own them, so the next lookup or
    /// stream places them there. Not subject to `broker.load_balancer_enabled`, like the
    /// isolation policies: a bundle left here could not take replicated entries.
    pub(super) async fn release_unlinked(&self) -> Result<(), BrokerError> {
        if self.is_closing() || !self.ownership.me().geo_url.is_empty() {
            return Ok(());
        }
        let owned = self.ownership.owned();
        if owned.is_empty() {
            return Ok(());
        }
        let brokers = self.ownership.brokers().await?;
        let me = self.ownership.id();
        if !brokers.iter().any(|b| b.id == me) || !brokers.iter().any(|b| !b.geo_url.is_empty()) {
            // Not registered right now (registering again: no judgement on a partial list),
            // or no broker with a link.
            return Ok(());
        }
        let Some(broker) = self.me.upgrade() else {
            return Ok(());
        };
        let namespaces: BTreeSet<&str> = owned.iter().map(|(ns, _)| ns.as_str()).collect();
        for ns in namespaces {
            // Only to brokers the isolation policies let own it (none: it stays here).
            let to = match self.linked_instead(ns, Some(&brokers)).await {
                Ok(to) if !to.is_empty() => to,
                Ok(_) => continue,
                Err(e) => {
                    tracing::warn!(namespace = %ns, error = %e, "checking a namespace's bundles against geo links failed");
                    continue;
                }
            };
            for (_, b) in owned.iter().filter(|(n, _)| n == ns) {
                // Still owned here and not being given up already (the reads above took
                // time: an admin's unload, or the session, may have taken it meanwhile).
                if !self.ownership.try_start_release(ns, b) {
                    continue;
                }
                let reason = format!(
                    "{ns} is replicated with other sites and {me} has no geo link: {} goes to a broker with one ({})",
                    b.name(),
                    to.iter().map(|t| t.id.as_str()).collect::<Vec<_>>().join(", ")
                );
                tracing::info!(%reason, rule = "geo_link", "load manager decision");
                metrics::counter!("meridian_load_manager_decisions_total", "kind" => "release", "rule" => "geo_link")
                    .increment(1);
                // As for the isolation policies: outside the beat's time limit (the bundle
                // left `owned` above).
                let (broker, ns, b) = (Arc::clone(&broker), ns.to_string(), *b);
                tokio::spawn(async move { broker.unload_bundle_here(&ns, &b).await });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(id: &str, geo: &str) -> BrokerInfo {
        BrokerInfo {
            id: id.into(),
            geo_url: geo.into(),
            ..BrokerInfo::default()
        }
    }

    #[test]
    fn brokers_with_a_link_are_preferred_when_there_are_any() {
        let ids = |v: Vec<BrokerInfo>| v.into_iter().map(|b| b.id).collect::<Vec<_>>();
        assert_eq!(
            ids(linked_if_any(vec![
                b("a", ""),
                b("b", "quic://b:1"),
                b("c", "quic://c:1")
            ])),
            ["b", "c"]
        );
        assert_eq!(ids(linked_if_any(vec![b("a", ""), b("b", "")])), ["a", "b"]);
        assert!(linked_if_any(Vec::new()).is_empty());
    }
}
