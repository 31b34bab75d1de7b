//! The site's load manager, as Pulsar's: one broker is leader (an ephemeral key of its
//! session, taken by compare-and-set) and sheds bundles from brokers used more than the
//! site's average (CPU, message rates: [`usage_shed_choice`], as Pulsar's ThresholdShedder)
//! or, when usage is even, from brokers that hold more bundles than others
//! ([`shed_choice`]); moving a bundle is unloading it at its owner (through an unload request in the
//! metadata store, which every broker serves for its own bundles), after which the next
//! lookup places it on the least loaded broker. Unowned bundles are placed by whichever
//! broker a lookup reaches ([`super::ownership::Ownership::candidate`]), by the same rule.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use meridian_metadata::client::{ClientError, PutOptions};
use meridian_protocol::pb::ServerError;
use serde::{Deserialize, Serialize};

use super::ownership::{
    Assignment, BrokerInfo, Bundle, Owner, ASSIGNMENT_TTL_MS, ASSIGN_PREFIX, OWNERS_PREFIX,
};
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
    pending: Mutex<Option<Pending>>,
}

/// The last bundle shed: its namespace, the bundle, the broker it was shed from, and when.
type Pending = (String, Bundle, String, Instant);

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

/// A broker's usage in percent of its capacity: the larger of its CPU over its cores and its
/// message rate (in and out) over `msg_capacity`.
pub fn usage_percent(l: &super::ownership::LoadReport, msg_capacity: f64) -> f64 {
    let cpu = l.cpu_percent / l.cpu_cores.max(1) as f64;
    let msgs = (l.msg_rate_in + l.msg_rate_out) / msg_capacity.max(1.0) * 100.0;
    cpu.max(msgs)
}

/// A broker as the usage rule sees it.
#[derive(Debug, Clone)]
pub struct Usage {
    pub id: String,
    /// Percent of capacity ([`usage_percent`]).
    pub percent: f64,
    /// Messages per second in and out.
    pub msg_rate: f64,
    /// Messages per second of its busiest bundles.
    pub bundles: Vec<(String, f64)>,
}

/// A shedding decision by usage.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageShed {
    pub from: String,
    pub to: String,
    /// The bundles worth moving, best first (`<ns>/<range>`): each leaves the target within
    /// the threshold above the average once moved, so the move is not undone by the next.
    pub candidates: Vec<String>,
    pub reason: String,
}

/// The usage rule: the most used broker sheds when it is more than `threshold` points above
/// the site's average, to the least used one; a bundle's share of its owner's usage is its
/// share of the owner's message rate. Only a broker carrying more traffic than the site's
/// average sheds (usage from other work, such as autorecovery, is not moved by moving
/// bundles); bundles without traffic never move by this rule; a bundle so hot that it would
/// put its new owner past the threshold is left to splitting.
pub fn usage_shed_choice(brokers: &[Usage], threshold: f64) -> Option<UsageShed> {
    if brokers.len() < 2 {
        return None;
    }
    let avg = brokers.iter().map(|b| b.percent).sum::<f64>() / brokers.len() as f64;
    let from = brokers
        .iter()
        .max_by(|a, b| a.percent.total_cmp(&b.percent).then(b.id.cmp(&a.id)))?;
    let to = brokers
        .iter()
        .min_by(|a, b| a.percent.total_cmp(&b.percent).then(a.id.cmp(&b.id)))?;
    let avg_rate = brokers.iter().map(|b| b.msg_rate).sum::<f64>() / brokers.len() as f64;
    if from.percent <= avg + threshold || from.id == to.id || from.msg_rate <= avg_rate {
        return None;
    }
    let room = avg + threshold - to.percent;
    let total: f64 = from.bundles.iter().map(|b| b.1).sum();
    if total <= 0.0 {
        return None;
    }
    let mut fits: Vec<(String, f64)> = from
        .bundles
        .iter()
        .filter(|b| b.1 > 0.0)
        .map(|(name, rate)| (name.clone(), rate / total * from.percent))
        .filter(|(_, share)| *share <= room + 1e-9)
        .collect();
    // The largest share that fits first: the fewest moves to even the site out.
    fits.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if fits.is_empty() {
        return None;
    }
    Some(UsageShed {
        from: from.id.clone(),
        to: to.id.clone(),
        reason: format!(
            "{} used {:.0}% (site average {avg:.0}%, threshold {threshold:.0} points), {} {:.0}%",
            from.id, from.percent, to.id, to.percent
        ),
        candidates: fits.into_iter().map(|f| f.0).collect(),
    })
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
        if let Err(e) = self.release_disallowed().await {
            tracing::warn!(error = %e, "checking bundles against the isolation policies failed");
        }
        if let Err(e) = self.release_unlinked().await {
            tracing::warn!(error = %e, "checking replicated bundles against geo links failed");
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
                if due {
                    if let Err(e) = self.sweep_assignments().await {
                        tracing::warn!(error = %e, "removing stale shed destinations failed");
                    }
                }
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

    /// Whether this broker leads now (as the store says; it does not seek the leadership),
    /// and the leader, if any.
    pub(super) async fn leadership(&self) -> Result<(bool, Option<BrokerInfo>), BrokerError> {
        let Some(kv) = self.meta.get(LEADER_KEY).await? else {
            return Ok((false, None));
        };
        let me = self.ownership.session_id() == Some(kv.session);
        Ok((me, serde_json::from_slice(&kv.value).ok()))
    }

    /// Gives up the leadership if this broker holds it (a graceful shutdown: another broker
    /// takes it at its next beat, and meanwhile sends the site's global objects).
    pub(super) async fn step_down(&self) -> Result<(), BrokerError> {
        let Some(session) = self.ownership.session_id() else {
            return Ok(());
        };
        if let Some(kv) = self.meta.get(LEADER_KEY).await? {
            if kv.session == session {
                self.meta.delete(LEADER_KEY, Some(kv.mod_revision)).await?;
                tracing::info!("this broker no longer leads the site's load manager");
            }
        }
        Ok(())
    }

    /// The leading broker, if any.
    pub async fn leader(&self) -> Result<Option<BrokerInfo>, BrokerError> {
        Ok(self.leadership().await?.1)
    }

    /// Removes shed destinations ([`ASSIGN_PREFIX`]) that no lookup follows any more (older
    /// than [`ASSIGNMENT_TTL_MS`], as [`super::ownership::Ownership::candidate`] judges them):
    /// a leader that stopped between writing one and seeing its bundle placed, or a namespace
    /// deleted meanwhile, leaves them behind. Returns how many went.
    async fn sweep_assignments(&self) -> Result<usize, BrokerError> {
        let now = super::now_ms();
        let mut removed = 0;
        for kv in self.meta.list_all(ASSIGN_PREFIX).await? {
            let stale = !serde_json::from_slice::<Assignment>(&kv.value)
                .is_ok_and(|a| now.abs_diff(a.at_ms) < ASSIGNMENT_TTL_MS);
            if !stale {
                continue;
            }
            // Unless it was rewritten or removed meanwhile.
            match self.meta.delete(&kv.key, Some(kv.mod_revision)).await {
                Ok(true) => removed += 1,
                Ok(false) | Err(ClientError::Conflict { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if removed > 0 {
            tracing::info!(removed, "removed stale shed destinations");
        }
        Ok(removed)
    }

    /// One shedding round: at most one bundle moves.
    async fn shed(&self) -> Result<(), BrokerError> {
        let pending = self.load_manager.pending.lock().expect("lock").clone();
        if let Some((ns, b, from, at)) = pending {
            // Not yet let go by the broker it was shed from, or not yet placed again.
            let waiting = match self.ownership.owner(&ns, &b).await {
                Ok(Owner::Nobody) => true,
                Ok(Owner::Other(o)) => o.id == from,
                Ok(Owner::Me) => self.ownership.id() == from,
                Err(_) => true,
            };
            if at.elapsed() < PENDING_MAX && waiting {
                return Ok(());
            }
            *self.load_manager.pending.lock().expect("lock") = None;
            // Placed (or given up on): its destination is no longer needed.
            let _ = self
                .meta
                .delete(&format!("{ASSIGN_PREFIX}{ns}/{}", b.name()), None)
                .await;
        }
        let brokers = self.ownership.brokers().await?;
        let capacity = self.cfg.load_msg_rate_capacity as f64;
        let threshold = self.cfg.load_shed_threshold_percent as f64;
        let usage: Vec<Usage> = brokers
            .iter()
            .map(|b| Usage {
                id: b.id.clone(),
                percent: usage_percent(&b.load, capacity),
                msg_rate: b.load.msg_rate_in + b.load.msg_rate_out,
                bundles: b
                    .load
                    .bundle_msg_rates
                    .iter()
                    .map(|(k, v)| (k.clone(), *v))
                    .collect(),
            })
            .collect();
        let grace = Duration::from_millis(self.cfg.load_shed_grace_ms);
        // Namespaces replicated with other sites, as read this round.
        let mut replicated = std::collections::HashMap::new();
        if let Some(choice) = usage_shed_choice(&usage, threshold) {
            for path in &choice.candidates {
                let recent = self
                    .load_manager
                    .moved
                    .lock()
                    .expect("lock")
                    .get(path)
                    .is_some_and(|t| t.elapsed() < grace);
                let Some((ns, range)) = path.rsplit_once('/') else {
                    continue;
                };
                if recent
                    || !self.ownership.allows(ns, &choice.to).await?
                    || !self
                        .geo_link_allows(ns, &choice.to, &brokers, &mut replicated)
                        .await?
                {
                    continue;
                }
                let Some(b) = self.ownership.bundle_named_fresh(ns, range).await? else {
                    continue;
                };
                let rate = usage
                    .iter()
                    .find(|u| u.id == choice.from)
                    .and_then(|u| u.bundles.iter().find(|x| &x.0 == path))
                    .map_or(0.0, |x| x.1);
                let reason = format!(
                    "{}: shed {range} of {ns} ({rate:.0} msg/s) to {}",
                    choice.reason, choice.to
                );
                return self
                    .shed_bundle(ns, b, path, &reason, "usage", &choice.to)
                    .await;
            }
        }
        let average = usage.iter().map(|u| u.percent).sum::<f64>() / usage.len().max(1) as f64;
        let counts: Vec<(String, u64)> = brokers
            .iter()
            .map(|b| (b.id.clone(), b.load.bundles))
            .collect();
        let Some((from, to)) = shed_choice(&counts) else {
            return Ok(());
        };
        // Not onto a broker already used past the threshold: bundle counts only even out
        // brokers that have room.
        if usage
            .iter()
            .any(|u| u.id == to && u.percent > average + threshold)
        {
            return Ok(());
        }
        let rate_of = |path: &str| {
            usage
                .iter()
                .find(|u| u.id == from)
                .and_then(|u| u.bundles.iter().find(|x| x.0 == path))
                .map_or(0.0, |x| x.1)
        };
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
        let mut movable: Vec<String> = {
            let moved = self.load_manager.moved.lock().expect("lock");
            owned
                .into_iter()
                .filter(|k| moved.get(k).is_none_or(|t| t.elapsed() >= grace))
                .collect()
        };
        // The quietest bundles first: evening out counts should not move the traffic.
        movable.sort_by(|a, b| rate_of(a).total_cmp(&rate_of(b)));
        // Only a bundle the isolation policies let the target own, and that leaves the target
        // within the usage threshold (else the usage rule would move traffic back).
        let (from_usage, from_rate) = usage.iter().find(|u| u.id == from).map_or((0.0, 0.0), |u| {
            (u.percent, u.bundles.iter().map(|x| x.1).sum::<f64>())
        });
        let to_usage = usage.iter().find(|u| u.id == to).map_or(0.0, |u| u.percent);
        let mut pick = None;
        for k in movable {
            let share = if from_rate > 0.0 {
                rate_of(&k) / from_rate * from_usage
            } else {
                0.0
            };
            if to_usage + share > average + threshold {
                continue;
            }
            let ns = k.rsplit_once('/').map_or("", |(ns, _)| ns);
            if self.ownership.allows(ns, &to).await?
                && self
                    .geo_link_allows(ns, &to, &brokers, &mut replicated)
                    .await?
            {
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
        self.shed_bundle(ns, b, &path, &reason, "bundles", &to)
            .await
    }

    /// Sheds one bundle to `to`: logged and counted with its rule and reason, remembered for
    /// the grace period, its destination recorded for the lookups that place it again
    /// ([`ASSIGN_PREFIX`]), and unloaded at its owner.
    async fn shed_bundle(
        &self,
        ns: &str,
        b: Bundle,
        path: &str,
        reason: &str,
        rule: &'static str,
        to: &str,
    ) -> Result<(), BrokerError> {
        let hint = Assignment {
            to: to.to_string(),
            at_ms: super::now_ms(),
        };
        self.meta
            .put(
                &format!("{ASSIGN_PREFIX}{path}"),
                serde_json::to_vec(&hint).expect("serializable"),
            )
            .await?;
        tracing::info!(%reason, rule, "load manager decision");
        metrics::counter!("meridian_load_manager_decisions_total", "kind" => "shed", "rule" => rule)
            .increment(1);
        self.load_manager
            .moved
            .lock()
            .expect("lock")
            .insert(path.to_string(), Instant::now());
        let from = match self.ownership.owner(ns, &b).await {
            Ok(Owner::Other(o)) => o.id,
            _ => self.ownership.id(),
        };
        *self.load_manager.pending.lock().expect("lock") =
            Some((ns.to_string(), b, from, Instant::now()));
        self.request_unload(ns, &b, reason).await
    }

    /// Unloads the bundles this broker owns that the namespace isolation policies no longer
    /// let it own (a policy changed, or a primary broker came back for a namespace served by
    /// a secondary), so the next lookups place them where the policies say. Not subject to
    /// `broker.load_balancer_enabled`: the policies are a rule, not a preference.
    async fn release_disallowed(&self) -> Result<(), BrokerError> {
        if self.is_closing() {
            return Ok(());
        }
        let policies = self.ownership.isolation_policies().await?;
        if policies.is_empty() {
            return Ok(());
        }
        let me = self.ownership.id();
        let ids: Vec<String> = self
            .ownership
            .brokers()
            .await?
            .into_iter()
            .map(|b| b.id)
            .collect();
        if !ids.contains(&me) {
            // Not registered right now (registering again): no judgement on a partial list.
            return Ok(());
        }
        let Some(broker) = self.me.upgrade() else {
            return Ok(());
        };
        for (ns, b) in self.ownership.owned() {
            // Only when the policies name other live brokers for it: a policy that allows no
            // live broker (a typo, every broker some policy's primary) leaves bundles where
            // they are served rather than taking them offline.
            let elsewhere = match meridian_tenancy::isolation::allowed_brokers(&policies, &ns, &ids)
            {
                Ok(ok) => !ok.is_empty() && !ok.contains(&me),
                Err(e) => {
                    tracing::warn!(namespace = %ns, error = %e, "isolation policies allow no live broker; its bundles stay where they are");
                    false
                }
            };
            if !elsewhere {
                continue;
            }
            let reason = format!(
                "the namespace isolation policies no longer let {me} own {} of {ns}",
                b.name()
            );
            tracing::info!(%reason, rule = "isolation", "load manager decision");
            metrics::counter!("meridian_load_manager_decisions_total", "kind" => "release", "rule" => "isolation")
                .increment(1);
            // Outside the beat's time limit: an unload cut short would leave the bundle
            // neither served here nor free to take. The bundle leaves `owned` at once, so the
            // next beat does not start it again.
            self.ownership.start_release(&ns, &b);
            let broker = Arc::clone(&broker);
            tokio::spawn(async move { broker.unload_bundle_here(&ns, &b).await });
        }
        Ok(())
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
                // Being unloaded already (by an earlier beat's task): its task removes the
                // request when done.
                Ok(Owner::Me) if self.ownership.is_releasing(ns, &b) => {}
                Ok(Owner::Me) => {
                    // In a task of its own, outside the beat's time limit: an unload cut short
                    // would leave the bundle neither served here nor free to take.
                    let Some(broker) = self.me.upgrade() else {
                        return Ok(());
                    };
                    self.ownership.start_release(ns, &b);
                    let ns = ns.to_string();
                    tokio::spawn(async move {
                        broker.unload_bundle_here(&ns, &b).await;
                        if let Err(e) = broker.meta.delete(&kv.key, Some(kv.mod_revision)).await {
                            tracing::warn!(key = %kv.key, error = %e, "removing a served unload request failed");
                        }
                    });
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

    fn u(id: &str, percent: f64, bundles: &[(&str, f64)]) -> Usage {
        Usage {
            id: id.into(),
            percent,
            msg_rate: bundles.iter().map(|b| b.1).sum(),
            bundles: bundles.iter().map(|(n, r)| (n.to_string(), *r)).collect(),
        }
    }

    #[test]
    fn a_broker_used_past_the_threshold_sheds_the_largest_bundle_the_target_has_room_for() {
        // a at 80%, b at 10%: average 45, b may take up to 45 points (to 55). Shares of a's
        // 80%: x 60, y 15, z 5.
        let c = usage_shed_choice(
            &[
                u(
                    "a",
                    80.0,
                    &[("t/n/x", 600.0), ("t/n/y", 150.0), ("t/n/z", 50.0)],
                ),
                u("b", 10.0, &[]),
            ],
            10.0,
        )
        .expect("a sheds");
        assert_eq!((c.from.as_str(), c.to.as_str()), ("a", "b"));
        assert_eq!(c.candidates, vec!["t/n/y".to_string(), "t/n/z".to_string()]);
        assert!(c.reason.contains("a used 80%"), "{}", c.reason);
        // Two even halves: one moves (the target ends 5 points over the average of 50).
        let c = usage_shed_choice(
            &[
                u("a", 100.0, &[("t/n/x", 500.0), ("t/n/y", 500.0)]),
                u("b", 0.0, &[]),
            ],
            10.0,
        )
        .expect("a sheds");
        assert_eq!(c.candidates, vec!["t/n/x".to_string(), "t/n/y".to_string()]);
    }

    #[test]
    fn usage_within_the_threshold_or_without_traffic_moves_nothing() {
        assert_eq!(
            usage_shed_choice(&[u("a", 50.0, &[("t/n/x", 10.0)]), u("b", 35.0, &[])], 10.0),
            None,
            "a is 7.5 points above the average of 42.5"
        );
        assert_eq!(
            usage_shed_choice(&[u("a", 90.0, &[]), u("b", 0.0, &[])], 10.0),
            None,
            "CPU without traffic: nothing to move"
        );
        assert_eq!(
            usage_shed_choice(
                &[u("a", 90.0, &[("t/n/hot", 100.0)]), u("b", 0.0, &[])],
                10.0
            ),
            None,
            "one hot bundle would only move the problem: splitting handles it"
        );
        assert_eq!(
            usage_shed_choice(&[u("a", 90.0, &[("t/n/x", 1.0)])], 10.0),
            None
        );
        assert_eq!(
            usage_shed_choice(
                &[
                    u("a", 90.0, &[("t/n/x", 10.0)]),
                    u("b", 10.0, &[("t/n/y", 500.0)])
                ],
                10.0
            ),
            None,
            "a's CPU comes from other work: its traffic is below the average"
        );
    }

    #[test]
    fn usage_is_the_larger_of_cpu_over_cores_and_rate_over_capacity() {
        let l = crate::broker::ownership::LoadReport {
            cpu_percent: 150.0,
            cpu_cores: 2,
            msg_rate_in: 30_000.0,
            msg_rate_out: 10_000.0,
            ..Default::default()
        };
        assert_eq!(usage_percent(&l, 200_000.0), 75.0);
        assert_eq!(usage_percent(&l, 20_000.0), 200.0);
    }
}
