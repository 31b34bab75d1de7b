//! Splitting bundles, as Pulsar's: a bundle whose topics or message rate pass a limit
//! (`broker.bundle_split_topics_max`, `broker.bundle_split_msg_rate_max`) is cut in two by
//! its owner while the namespace has fewer than `broker.namespace_bundles_max` bundles, and its
//! upper half is unloaded so that the next lookup places it on the least loaded broker (when
//! the site has another). A split is a metadata change
//! ([`super::ownership::Ownership::split`]): no data moves. An admin's
//! `namespaces split-bundle` at a broker that does not own the bundle leaves a request
//! (`/loadbalance/split/<ns>/<range>`) its owner serves within a load report interval.

use std::time::{Duration, Instant};

use meridian_protocol::pb::ServerError;
use serde::{Deserialize, Serialize};

use super::ownership::{topic_hash, Bundle, Owner};
use super::{Broker, BrokerError};

pub const SPLIT_PREFIX: &str = "/loadbalance/split/";

/// A namespace and one of its bundles.
type BundleKey = (String, Bundle);

/// A request that a bundle's owner split it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SplitRequest {
    by: String,
    unload: bool,
}

fn request_key(ns: &str, b: &Bundle) -> String {
    format!("{SPLIT_PREFIX}{ns}/{}", b.name())
}

/// Why a bundle with these figures should be split, if it should (sans-IO).
pub fn split_reason(
    topics: u64,
    msg_rate: f64,
    topics_max: u64,
    msg_rate_max: u64,
) -> Option<String> {
    if topics > topics_max {
        Some(format!(
            "{topics} topics, over broker.bundle_split_topics_max = {topics_max}"
        ))
    } else if msg_rate > msg_rate_max as f64 {
        Some(format!(
            "{msg_rate:.0} msg/s in and out, over broker.bundle_split_msg_rate_max = {msg_rate_max}"
        ))
    } else {
        None
    }
}

impl Broker {
    /// Splits a bundle this broker owns; with `unload`, its upper half is unloaded after.
    /// Answers the halves' names.
    async fn split_here(
        &self,
        ns: &str,
        b: &Bundle,
        unload: bool,
        reason: &str,
    ) -> Result<(String, String), BrokerError> {
        let (lo, hi) = self.ownership.split(ns, b).await?;
        tracing::info!(namespace = %ns, bundle = %b.name(), halves = %format!("{} {}", lo.name(), hi.name()), reason, "bundle split");
        metrics::counter!("meridian_bundles_split_total").increment(1);
        if unload {
            self.unload_bundle_here(ns, &hi).await;
        }
        Ok((lo.name(), hi.name()))
    }

    /// `namespaces split-bundle`: splits the bundle wherever it is owned (an unowned one is
    /// taken here first) and waits until it is split (at most 30 s).
    pub async fn split_bundle(
        &self,
        ns: &str,
        range: &str,
        unload: bool,
    ) -> Result<(String, String), BrokerError> {
        self.require_namespace(ns).await?;
        let Some(b) = self.ownership.bundle_named_fresh(ns, range).await? else {
            let all = self.ownership.bundles(ns).await?.list();
            return Err(BrokerError::new(
                ServerError::TopicNotFound,
                format!(
                    "{ns} has no bundle {range}; its bundles are {}",
                    all.iter().map(Bundle::name).collect::<Vec<_>>().join(", ")
                ),
            ));
        };
        let halves = |b: &Bundle| {
            let mid = b.lo + (b.hi - b.lo) / 2;
            (
                Bundle { lo: b.lo, hi: mid }.name(),
                Bundle { lo: mid, hi: b.hi }.name(),
            )
        };
        match self.ownership.owner(ns, &b).await? {
            Owner::Me => self.split_here(ns, &b, unload, "asked by an admin").await,
            Owner::Nobody => {
                if !self.ownership.acquire(ns, &b).await? {
                    return Err(BrokerError::new(
                        ServerError::ServiceNotReady,
                        format!("bundle {range} of {ns} changed hands meanwhile; retry"),
                    ));
                }
                self.split_here(ns, &b, unload, "asked by an admin").await
            }
            Owner::Other(o) => {
                let r = SplitRequest {
                    by: self.ownership.id(),
                    unload,
                };
                self.meta
                    .put(
                        &request_key(ns, &b),
                        serde_json::to_vec(&r).expect("serializable"),
                    )
                    .await?;
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    self.ownership.forget_bundles(ns);
                    if self.ownership.bundle_named(ns, range).await?.is_none() {
                        return Ok(halves(&b));
                    }
                    if Instant::now() > deadline {
                        return Err(BrokerError::new(
                            ServerError::ServiceNotReady,
                            format!(
                                "broker {} did not split bundle {range} of {ns} within 30 s",
                                o.id
                            ),
                        ));
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    /// Splits the requested bundles this broker owns; requests for bundles that are gone
    /// (split already) or that nobody owns go.
    pub(super) async fn serve_split_requests(&self) -> Result<(), BrokerError> {
        let page = self.meta.list(SPLIT_PREFIX, "", 1000).await?;
        for kv in page.kvs {
            let path = &kv.key[SPLIT_PREFIX.len()..];
            let req: Option<SplitRequest> = serde_json::from_slice(&kv.value).ok();
            let (Some((ns, range)), Some(req)) = (path.rsplit_once('/'), req) else {
                self.meta.delete(&kv.key, Some(kv.mod_revision)).await?;
                continue;
            };
            let Some(b) = self.ownership.bundle_named_fresh(ns, range).await? else {
                self.meta.delete(&kv.key, Some(kv.mod_revision)).await?;
                continue;
            };
            match self.ownership.owner(ns, &b).await {
                Ok(Owner::Me) => {
                    let why = format!("asked by an admin at {}", req.by);
                    if let Err(e) = self.split_here(ns, &b, req.unload, &why).await {
                        tracing::warn!(namespace = %ns, bundle = %range, error = %e, "a requested split failed");
                    }
                    self.meta.delete(&kv.key, Some(kv.mod_revision)).await?;
                }
                Ok(Owner::Nobody) => {
                    self.meta.delete(&kv.key, Some(kv.mod_revision)).await?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The owner's part of the load manager: at most one bundle of its own split per beat,
    /// the one most over a limit.
    pub(super) async fn split_large_bundles(&self) -> Result<(), BrokerError> {
        use std::collections::HashMap;
        let mut figures: HashMap<BundleKey, (u64, f64)> = HashMap::new();
        for t in self.loaded_topics() {
            let ns = t.name.namespace();
            let Ok(bundles) = self.ownership.bundles(&ns).await else {
                continue;
            };
            let b = bundles.of(topic_hash(&t.name));
            if !self.ownership.owns(&ns, &b) {
                continue;
            }
            let [msgs_in, msgs_out, _, _] = t.rates_per_sec();
            let f = figures.entry((ns, b)).or_default();
            f.0 += 1;
            f.1 += msgs_in + msgs_out;
        }
        let mut candidates: Vec<(BundleKey, (u64, f64), String)> = figures
            .into_iter()
            // One topic is not split off from itself: a hot topic alone in its bundle stays.
            .filter(|(_, f)| f.0 >= 2)
            .filter_map(|(k, f)| {
                split_reason(
                    f.0,
                    f.1,
                    self.cfg.bundle_split_topics_max,
                    self.cfg.bundle_split_msg_rate_max,
                )
                .map(|why| (k, f, why))
            })
            .collect();
        candidates.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then(b.1 .1.total_cmp(&a.1 .1)));
        for ((ns, b), _, why) in candidates {
            let count = self.ownership.bundles(&ns).await?.list().len() as u64;
            if count >= self.cfg.namespace_bundles_max {
                tracing::debug!(namespace = %ns, count, "not splitting: broker.namespace_bundles_max reached");
                continue;
            }
            // The upper half is unloaded to be placed elsewhere: with no other broker at
            // the site it would only be loaded here again, its clients and replicators
            // interrupted for nothing.
            // (The registry unreadable now: unloaded, as before.)
            let me = self.ownership.id();
            let others = self
                .ownership
                .brokers()
                .await
                .map_or(true, |all| all.iter().any(|o| o.id != me));
            match self.split_here(&ns, &b, others, &why).await {
                Ok(_) => return Ok(()),
                // One bundle that cannot be split (one hash wide, or changed meanwhile) must
                // not keep the others from being split.
                Err(e) => {
                    tracing::warn!(namespace = %ns, bundle = %b.name(), error = %e, "bundle split failed")
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::split_reason;

    #[test]
    fn a_bundle_is_split_only_past_a_limit() {
        assert_eq!(split_reason(10, 100.0, 10, 1000), None);
        assert!(split_reason(11, 0.0, 10, 1000)
            .expect("topics")
            .contains("bundle_split_topics_max"));
        assert!(split_reason(1, 1000.5, 10, 1000)
            .expect("rate")
            .contains("bundle_split_msg_rate_max"));
    }
}
