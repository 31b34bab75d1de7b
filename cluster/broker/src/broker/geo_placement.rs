//! Placing the bundles of a namespace replicated with other sites on brokers with a geo
//! link: other sites open a topic's stream at the broker that owns it, and a broker without a
//! link cannot take it (the stream would be refused for as long as that broker owned it).

use std::collections::BTreeSet;
use std::sync::Arc;

use super::ownership::BrokerInfo;
use super::{Broker, BrokerError};

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
    /// Whether `ns` is replicated with another site (its replication clusters name one).
    pub(super) async fn replicated_elsewhere(&self, ns: &str) -> Result<bool, BrokerError> {
        let p = self.namespace_policies(ns).await?;
        Ok(p.replication_clusters
            .is_some_and(|c| c.iter().any(|c| *c != self.cfg.cluster_name)))
    }

    /// Whether a bundle of `ns` may move to the broker `to` of `brokers` as far as geo links
    /// go: `to` has one, `ns` is not replicated with another site, or no broker has a link.
    pub(super) async fn geo_link_allows(
        &self,
        ns: &str,
        to: &str,
        brokers: &[BrokerInfo],
    ) -> Result<bool, BrokerError> {
        let linked = |id: &str| brokers.iter().any(|b| b.id == id && !b.geo_url.is_empty());
        if linked(to) || !brokers.iter().any(|b| !b.geo_url.is_empty()) {
            return Ok(true);
        }
        Ok(!self.replicated_elsewhere(ns).await?)
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
        if !brokers.iter().any(|b| b.id == me) {
            // Not registered right now (registering again): no judgement on a partial list.
            return Ok(());
        }
        let linked: Vec<BrokerInfo> = brokers
            .into_iter()
            .filter(|b| !b.geo_url.is_empty())
            .collect();
        if linked.is_empty() {
            return Ok(());
        }
        let Some(broker) = self.me.upgrade() else {
            return Ok(());
        };
        let namespaces: BTreeSet<&str> = owned.iter().map(|(ns, _)| ns.as_str()).collect();
        for ns in namespaces {
            if !self.replicated_elsewhere(ns).await? {
                continue;
            }
            // Only to brokers the isolation policies let own it (none: it stays here).
            let to = match self.ownership.allowed(ns, linked.clone()).await {
                Ok(to) if !to.is_empty() => to,
                _ => continue,
            };
            for (_, b) in owned.iter().filter(|(n, _)| n == ns) {
                let reason = format!(
                    "{ns} is replicated with other sites and {me} has no geo link: {} goes to a broker with one ({})",
                    b.name(),
                    to.iter().map(|t| t.id.as_str()).collect::<Vec<_>>().join(", ")
                );
                tracing::info!(%reason, rule = "geo_link", "load manager decision");
                metrics::counter!("meridian_load_manager_decisions_total", "kind" => "release", "rule" => "geo_link")
                    .increment(1);
                // As for the isolation policies: outside the beat's time limit, and out of
                // `owned` at once.
                self.ownership.start_release(ns, b);
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
