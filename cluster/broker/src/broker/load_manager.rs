//! The site's load manager, as Pulsar's: one broker is leader (an ephemeral key of its
//! session, taken by compare-and-set) and sheds bundles from brokers that hold more than
//! others; moving a bundle is unloading it at its owner (through an unload request in the
//! metadata store, which every broker serves for its own bundles), after which the next
//! lookup places it on the least loaded broker. Unowned bundles are placed by whichever
//! broker a lookup reaches ([`super::ownership::Ownership::candidate`]), by the same rule.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use meridian_metadata::client::{ClientError, PutOptions};
use meridian_protocol::pb::ServerError;
use serde::{Deserialize, Serialize};

use super::ownership::{BrokerInfo, Bundle, Owner, OWNERS_PREFIX};
use super::{Broker, BrokerError};

pub const LEADER_KEY: &str = "/loadbalance/leader";
pub const UNLOAD_PREFIX: &str = "/loadbalance/unload/";

/// A request that a bundle's owner unload it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct UnloadRequest {
    by: String,
    reason: String,
}

/// What the leader remembers between rounds.
#[derive(Default)]
pub struct LoadManager {
    /// When each bundle (`ns/range`) was last moved: not again within the grace period.
    moved: Mutex<HashMap<String, Instant>>,
    last_round: Mutex<Option<Instant>>,
    /// The last bundle shed, until a lookup placed it again: no other moves before (its
    /// new owner's count would be wrong), or for at most a minute.
    pending: Mutex<Option<(String, Bundle, Instant)>>,
}

/// How long a shed bundle that no lookup placed holds further shedding up.
const PENDING_MAX: Duration = Duration::from_secs(60);

/// What to shed, if anything: from the broker with the most bundles to the one with the
/// fewest, when they differ by 2 or more (a move then narrows the gap without reversing it).
/// Ties go to the smaller id, so a decision does not flap between equals.
pub fn shed_choice(brokers: &[(String, u64)]) -> Option<(String, String)> {
    if brokers.len() < 2 {
        return None;
    }
    let most = brokers
        .iter()
        .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))?;
    let fewest = brokers
        .iter()
        .min_by(|a, b| a.1.cmp(&b.1).then(a.0.cmp(&b.0)))?;
    (most.1 >= fewest.1 + 2).then(|| (most.0.clone(), fewest.0.clone()))
}

fn request_key(ns: &str, b: &Bundle) -> String {
    format!("{UNLOAD_PREFIX}{ns}/{}", b.name())
}

impl Broker {
    /// One beat of the load manager, every load report: serve unload requests for this
    /// broker's bundles, hold or seek leadership, and as leader shed.
    pub(super) async fn load_manager_beat(&self) {
        if let Err(e) = self.serve_unload_requests().await {
            tracing::warn!(error = %e, "serving unload requests failed");
        }
        if let Err(e) = self.serve_split_requests().await {
            tracing::warn!(error = %e, "serving split requests failed");
        }
        if self.cfg.load_balancer_enabled && self.cfg.bundle_split_enabled {
            if let Err(e) = self.split_large_bundles().await {
                tracing::warn!(error = %e, "splitting bundles failed");
            }
        }
        match self.lead().await {
            Ok(true) => {
                let every = Duration::from_millis(self.cfg.load_shed_interval_ms);
                let due = {
                    let mut last = self.load_manager.last_round.lock().expect("lock");
                    let due = last.is_none_or(|t| t.elapsed() >= every);
                    if due {
                        *last = Some(Instant::now());
                    }
                    due
                };
                if due && self.cfg.load_balancer_enabled {
                    if let Err(e) = self.shed().await {
                        tracing::warn!(error = %e, "load shedding failed");
                    }
                }
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "load manager election failed"),
        }
    }

    /// Whether this broker leads (taking the leadership if nobody has it).
    async fn lead(&self) -> Result<bool, BrokerError> {
        let Some(session) = self.ownership.session_id() else {
            return Ok(false);
        };
        let me = self.ownership.id();
        if let Some(kv) = self.meta.get(LEADER_KEY).await? {
            let leader: BrokerInfo = serde_json::from_slice(&kv.value).unwrap_or_default();
            if kv.session == session {
                return Ok(true);
            }
            if !self.ownership.is_earlier_run(&leader, kv.session) {
                return Ok(false);
            }
            // An earlier run of this broker led: that run is gone.
            self.meta.delete(LEADER_KEY, Some(kv.mod_revision)).await?;
        }
        let opts = PutOptions {
            expected_version: Some(0),
            session,
            ..PutOptions::default()
        };
        let value = serde_json::to_vec(&self.ownership.me()).expect("serializable");
        match self.meta.put_with(LEADER_KEY, value, opts).await {
            Ok(_) => {
                tracing::info!(broker = %me, "this broker leads the site's load manager");
                metrics::counter!("meridian_load_manager_elections_total").increment(1);
                Ok(true)
            }
            Err(ClientError::Conflict { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// The leading broker, if any.
    pub async fn leader(&self) -> Result<Option<BrokerInfo>, BrokerError> {
        Ok(match self.meta.get(LEADER_KEY).await? {
            Some(kv) => serde_json::from_slice(&kv.value).ok(),
            None => None,
        })
    }

    /// One shedding round: at most one bundle moves.
    async fn shed(&self) -> Result<(), BrokerError> {
        let pending = self.load_manager.pending.lock().expect("lock").clone();
        if let Some((ns, b, at)) = pending {
            if at.elapsed() < PENDING_MAX
                && matches!(self.ownership.owner(&ns, &b).await, Ok(Owner::Nobody))
            {
                return Ok(());
            }
            *self.load_manager.pending.lock().expect("lock") = None;
        }
        let brokers = self.ownership.brokers().await?;
        let counts: Vec<(String, u64)> = brokers
            .iter()
            .map(|b| (b.id.clone(), b.load.bundles))
            .collect();
        let Some((from, to)) = shed_choice(&counts) else {
            return Ok(());
        };
        let grace = Duration::from_millis(self.cfg.load_shed_grace_ms);
        let mut owned = Vec::new();
        let mut after = String::new();
        loop {
            let page = self.meta.list(OWNERS_PREFIX, &after, 0).await?;
            for kv in &page.kvs {
                let owner: BrokerInfo = serde_json::from_slice(&kv.value).unwrap_or_default();
                if owner.id == from {
                    owned.push(kv.key[OWNERS_PREFIX.len()..].to_string());
                }
            }
            match page.kvs.last() {
                Some(last) if page.more => after = last.key.clone(),
                _ => break,
            }
        }
        let movable: Vec<String> = {
            let moved = self.load_manager.moved.lock().expect("lock");
            owned
                .into_iter()
                .filter(|k| moved.get(k).is_none_or(|t| t.elapsed() >= grace))
                .collect()
        };
        // Only a bundle the isolation policies let the target own.
        let mut pick = None;
        for k in movable {
            let ns = k.rsplit_once('/').map_or("", |(ns, _)| ns);
            if self.ownership.allows(ns, &to).await? {
                pick = Some(k);
                break;
            }
        }
        let Some(path) = pick else {
            return Ok(());
        };
        let Some((ns, range)) = path.rsplit_once('/') else {
            return Ok(());
        };
        let Some(b) = self.ownership.bundle_named_fresh(ns, range).await? else {
            return Ok(());
        };
        let n = |id: &str| counts.iter().find(|c| c.0 == id).map_or(0, |c| c.1);
        let reason = format!(
            "{from} owns {} bundles, {to} {}: shed {range} of {ns}",
            n(&from),
            n(&to)
        );
        tracing::info!(%reason, "load manager decision");
        metrics::counter!("meridian_load_manager_decisions_total", "kind" => "shed").increment(1);
        self.load_manager
            .moved
            .lock()
            .expect("lock")
            .insert(path.clone(), Instant::now());
        *self.load_manager.pending.lock().expect("lock") =
            Some((ns.to_string(), b, Instant::now()));
        self.request_unload(ns, &b, &reason).await
    }

    async fn request_unload(&self, ns: &str, b: &Bundle, reason: &str) -> Result<(), BrokerError> {
        let r = UnloadRequest {
            by: self.ownership.id(),
            reason: reason.to_string(),
        };
        self.meta
            .put(
                &request_key(ns, b),
                serde_json::to_vec(&r).expect("serializable"),
            )
            .await?;
        Ok(())
    }

    /// Unloads the requested bundles this broker owns; requests for bundles nobody owns go.
    async fn serve_unload_requests(&self) -> Result<(), BrokerError> {
        let page = self.meta.list(UNLOAD_PREFIX, "", 1000).await?;
        for kv in page.kvs {
            let path = &kv.key[UNLOAD_PREFIX.len()..];
            let Some((ns, range)) = path.rsplit_once('/') else {
                self.meta.delete(&kv.key, Some(kv.mod_revision)).await?;
                continue;
            };
            let Some(b) = self.ownership.bundle_named_fresh(ns, range).await? else {
                self.meta.delete(&kv.key, Some(kv.mod_revision)).await?;
                continue;
            };
            match self.ownership.owner(ns, &b).await {
                Ok(Owner::Me) => {
                    self.unload_bundle_here(ns, &b).await;
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

    /// Unloads a bundle this broker owns: its topics, then its ownership.
    pub(super) async fn unload_bundle_here(&self, ns: &str, b: &Bundle) {
        self.ownership.start_release(ns, b);
        for t in self.loaded_topics() {
            if t.name.namespace() == ns
                && self.ownership.bundle_of(&t.name).await.ok().as_ref() == Some(b)
            {
                self.unload_loaded(t).await;
            }
        }
        if let Err(e) = self.ownership.release(ns, b).await {
            tracing::warn!(namespace = %ns, bundle = %b.name(), error = %e, "releasing a bundle failed; it goes with the session");
        }
    }

    /// Unloads a namespace's bundle (all of them with `None`) wherever it is owned; returns
    /// the bundles unloaded. One owned elsewhere is unloaded by its owner, through a request
    /// it serves within its load report interval; this waits for that (at most 30 s).
    pub async fn unload_bundles(
        &self,
        ns: &str,
        range: Option<&str>,
    ) -> Result<Vec<String>, BrokerError> {
        self.require_namespace(ns).await?;
        // As the store has them now (another broker may have split one).
        self.ownership.forget_bundles(ns);
        let all = self.ownership.bundles(ns).await?.list();
        let chosen: Vec<Bundle> = match range {
            None => all,
            Some(r) => {
                let b = all.iter().find(|b| b.name() == r).copied().ok_or_else(|| {
                    BrokerError::new(
                        ServerError::TopicNotFound,
                        format!(
                            "{ns} has no bundle {r}; its bundles are {}",
                            all.iter().map(Bundle::name).collect::<Vec<_>>().join(", ")
                        ),
                    )
                })?;
                vec![b]
            }
        };
        let mut done = Vec::new();
        for b in chosen {
            match self.ownership.owner(ns, &b).await? {
                Owner::Nobody => {}
                Owner::Me => {
                    self.unload_bundle_here(ns, &b).await;
                    done.push(b.name());
                }
                Owner::Other(o) => {
                    self.request_unload(ns, &b, "asked by an admin").await?;
                    let deadline = Instant::now() + Duration::from_secs(30);
                    loop {
                        match self.ownership.owner(ns, &b).await? {
                            Owner::Other(x) if x.id == o.id => {}
                            _ => break,
                        }
                        if Instant::now() > deadline {
                            return Err(BrokerError::new(
                                ServerError::ServiceNotReady,
                                format!(
                                    "broker {} did not unload bundle {} of {ns} within 30 s",
                                    o.id,
                                    b.name()
                                ),
                            ));
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    done.push(b.name());
                }
            }
        }
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(v: &[(&str, u64)]) -> Vec<(String, u64)> {
        v.iter().map(|(a, n)| (a.to_string(), *n)).collect()
    }

    #[test]
    fn bundles_move_from_the_fullest_broker_to_the_emptiest_only_past_a_gap_of_two() {
        assert_eq!(shed_choice(&b(&[("a", 4)])), None, "one broker");
        assert_eq!(
            shed_choice(&b(&[("a", 4), ("b", 3)])),
            None,
            "a move would reverse it"
        );
        assert_eq!(
            shed_choice(&b(&[("a", 4), ("b", 0)])),
            Some(("a".into(), "b".into()))
        );
        assert_eq!(
            shed_choice(&b(&[("a", 1), ("b", 5), ("c", 1)])),
            Some(("b".into(), "a".into())),
            "ties to the smaller id"
        );
        assert_eq!(shed_choice(&b(&[("a", 2), ("b", 2), ("c", 2)])), None);
    }
}
