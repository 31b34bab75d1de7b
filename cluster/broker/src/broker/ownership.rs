//! Brokers of a site and who owns which topics, as Pulsar's: each broker registers an
//! ephemeral key of its metadata session (`/brokers/available/<id>`, with its URLs and a load
//! report); a namespace's topic names are hashed into bundles (hash ranges,
//! `/namespace-bundles/<tenant>/<ns>`), and each bundle is owned by one broker through an
//! ephemeral key of that broker's session (`/bundle-owners/<tenant>/<ns>/<range>`), taken by
//! compare-and-set, so two brokers never own one bundle. A broker serves a topic only while it
//! owns its bundle and its session is surely alive ([`SessionHandle::valid_until`]); when it
//! cannot renew the session it stops serving before the store could give the bundles to
//! another broker.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use meridian_metadata::client::{ClientError, PutOptions};
use meridian_metadata::{MetadataClient, SessionHandle};
use meridian_protocol::pb::ServerError;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::BrokerError;
use crate::topic_name::TopicName;

pub const BROKERS_PREFIX: &str = "/brokers/available/";
pub const BUNDLES_PREFIX: &str = "/namespace-bundles/";
pub const OWNERS_PREFIX: &str = "/bundle-owners/";

pub use super::bundles::{topic_hash, Bundle, Bundles};

/// How long isolation policies read from the store are used before they are read again.
const POLICIES_TTL: Duration = Duration::from_secs(2);

/// A cluster's namespace isolation policies, by name.
type IsolationPolicies = BTreeMap<String, meridian_tenancy::isolation::NsIsolationPolicy>;

/// What a broker publishes about itself.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BrokerInfo {
    /// `host:port` of its Pulsar listener as clients reach it: unique on a site.
    pub id: String,
    pub service_url: String,
    pub service_url_tls: Option<String>,
    pub http_url: String,
    pub admin_url: String,
    pub started_ms: u64,
    /// This run of the broker process (a restart has another): keys of this run are never
    /// taken over as an earlier run's.
    pub run_id: String,
    pub load: LoadReport,
    /// `quic://HOST:PORT` of its geo link (empty: none): where other sites open the streams
    /// of the topics it owns.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub geo_url: String,
}

/// A broker's load, refreshed every `broker.load_report_interval_ms`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LoadReport {
    /// Of one core (100 = one core busy).
    pub cpu_percent: f64,
    pub msg_rate_in: f64,
    pub msg_rate_out: f64,
    pub bytes_rate_in: f64,
    pub bytes_rate_out: f64,
    pub topics: u64,
    pub bundles: u64,
    pub connections: u64,
    pub memory_bytes: u64,
    pub reported_ms: u64,
    /// Cores this process may use (its CPU capacity is 100 per core).
    pub cpu_cores: u64,
    /// Messages per second in and out of the busiest bundles (`<ns>/<range>`, at most
    /// [`BUNDLE_RATES_MAX`], only those with traffic), for the load manager's choice.
    pub bundle_msg_rates: BTreeMap<String, f64>,
}

/// How many bundles' rates a load report carries.
pub const BUNDLE_RATES_MAX: usize = 32;

/// Where the load manager records the broker a shed bundle goes to: the lookups that place it
/// again choose that broker (while registered, allowed by the isolation policies, and for at
/// most [`ASSIGNMENT_TTL_MS`]), not the one with the fewest bundles, which is often the one
/// it was shed from.
pub const ASSIGN_PREFIX: &str = "/loadbalance/assign/";

/// How long a recorded destination is followed, milliseconds.
pub const ASSIGNMENT_TTL_MS: u64 = 60_000;

/// The destination of a shed bundle (`/loadbalance/assign/<ns>/<range>`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Assignment {
    pub to: String,
    pub at_ms: u64,
}

/// Who owns a bundle.
#[derive(Debug, Clone, PartialEq)]
pub enum Owner {
    Me,
    Other(BrokerInfo),
    Nobody,
}

/// The session this broker's keys live in, and what it owns in it.
struct Held {
    session: SessionHandle,
    /// Bundles owned in this session, by namespace.
    owned: HashMap<String, BTreeMap<Bundle, ()>>,
}

/// This broker's registration and ownership.
pub struct Ownership {
    meta: MetadataClient,
    /// The id is the address this process has bound (no `broker.advertise`): no other live
    /// broker can have it, so keys of an earlier run under it (a crash) are taken over at
    /// once instead of waited out.
    takeover: bool,
    /// The only broker of its site (`meridian standalone`, whose metadata store is its own):
    /// any other broker's keys are an earlier run's, taken over at once.
    sole: std::sync::atomic::AtomicBool,
    ttl_ms: u64,
    default_bundles: u64,
    me: Mutex<BrokerInfo>,
    held: Mutex<Option<Held>>,
    /// Namespaces' bundles as read, with the record's version (they change only by splits;
    /// taking a bundle is conditional on that version, so a stale copy cannot take a bundle
    /// that was split).
    bundles: Mutex<HashMap<String, (Bundles, u64)>>,
    /// Bundles this broker placed on each broker since that broker's last load report.
    placed: Mutex<HashMap<String, u64>>,
    /// Handing over (graceful shutdown): nothing more is taken or reported.
    closing: std::sync::atomic::AtomicBool,
    /// Bundles being given up: no longer owned for serving, and not taken back by a lookup
    /// that finds their key still in this session, until the key is deleted.
    releasing: Mutex<std::collections::HashSet<(String, Bundle)>>,
    /// The cluster's isolation policies as last read, and when (read again after
    /// [`POLICIES_TTL`]).
    policies: Mutex<Option<(Instant, Arc<IsolationPolicies>)>>,
    /// This site's cluster name (`broker.cluster_name`): its namespace isolation policies
    /// decide which brokers may own which namespaces' bundles.
    cluster: String,
}

fn ns_path(ns: &str) -> String {
    ns.to_string()
}

fn bundles_key(ns: &str) -> String {
    format!("{BUNDLES_PREFIX}{}", ns_path(ns))
}

fn owner_key(ns: &str, b: &Bundle) -> String {
    format!("{OWNERS_PREFIX}{}/{}", ns_path(ns), b.name())
}

fn unavailable(m: impl Into<String>) -> BrokerError {
    BrokerError::new(ServerError::ServiceNotReady, m)
}

impl Ownership {
    pub fn new(
        meta: MetadataClient,
        me: BrokerInfo,
        ttl_ms: u64,
        default_bundles: u64,
        takeover: bool,
    ) -> Self {
        Ownership {
            meta,
            takeover,
            sole: std::sync::atomic::AtomicBool::new(false),
            ttl_ms,
            default_bundles,
            me: Mutex::new(me),
            held: Mutex::new(None),
            bundles: Mutex::new(HashMap::new()),
            placed: Mutex::new(HashMap::new()),
            closing: std::sync::atomic::AtomicBool::new(false),
            cluster: String::new(),
            releasing: Mutex::default(),
            policies: Mutex::default(),
        }
    }

    /// The cluster whose isolation policies apply.
    pub fn with_cluster(mut self, cluster: &str) -> Self {
        self.cluster = cluster.to_string();
        self
    }

    /// The cluster's namespace isolation policies, by name.
    pub async fn isolation_policies(&self) -> Result<Arc<IsolationPolicies>, BrokerError> {
        if let Some((at, p)) = self.policies.lock().expect("policies lock").as_ref() {
            if at.elapsed() < POLICIES_TTL {
                return Ok(Arc::clone(p));
            }
        }
        let p = Arc::new(self.read_isolation_policies().await?);
        *self.policies.lock().expect("policies lock") = Some((Instant::now(), Arc::clone(&p)));
        Ok(p)
    }

    async fn read_isolation_policies(&self) -> Result<IsolationPolicies, BrokerError> {
        let prefix = format!(
            "{}{}/",
            meridian_tenancy::isolation::POLICIES_PREFIX,
            self.cluster
        );
        let mut out = BTreeMap::new();
        for kv in self.meta.list_all(&prefix).await? {
            match serde_json::from_slice(&kv.value) {
                Ok(p) => {
                    out.insert(kv.key[prefix.len()..].to_string(), p);
                }
                Err(e) => tracing::warn!(key = %kv.key, error = %e, "unreadable isolation policy"),
            }
        }
        Ok(out)
    }

    /// Of `brokers`, those the isolation policies let own a bundle of `ns`
    /// (ServiceNotReady naming the policy when none may).
    pub async fn allowed(
        &self,
        ns: &str,
        brokers: Vec<BrokerInfo>,
    ) -> Result<Vec<BrokerInfo>, BrokerError> {
        let policies = self.isolation_policies().await?;
        if policies.is_empty() {
            return Ok(brokers);
        }
        let ids: Vec<String> = brokers.iter().map(|b| b.id.clone()).collect();
        let ok = meridian_tenancy::isolation::allowed_brokers(&policies, ns, &ids)
            .map_err(unavailable)?;
        Ok(brokers.into_iter().filter(|b| ok.contains(&b.id)).collect())
    }

    /// Whether the isolation policies let the broker `id` own a bundle of `ns` now.
    pub async fn allows(&self, ns: &str, id: &str) -> Result<bool, BrokerError> {
        let policies = self.isolation_policies().await?;
        if policies.is_empty() {
            return Ok(true);
        }
        let ids: Vec<String> = self.brokers().await?.into_iter().map(|b| b.id).collect();
        Ok(
            meridian_tenancy::isolation::allowed_brokers(&policies, ns, &ids)
                .is_ok_and(|ok| ok.iter().any(|b| b == id)),
        )
    }

    /// Graceful shutdown has begun: no bundle is taken any more, no report written.
    pub fn set_closing(&self) {
        self.closing
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    fn is_closing(&self) -> bool {
        self.closing.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether this broker is its site's only one.
    pub fn sole(&self) -> bool {
        self.is_sole()
    }

    /// Whether anything is owned in the current session.
    pub fn owns_any(&self) -> bool {
        self.owned_count() > 0
    }

    /// Whether a key written by `info` in session `session` is an earlier, crashed run's
    /// (this broker's address, or any broker's on a standalone), to be taken over.
    fn earlier_run(&self, info: &BrokerInfo, session: u64, current: Option<u64>) -> bool {
        let me = self.me();
        info.run_id != me.run_id
            && Some(session) != current
            && ((info.id == me.id && self.takeover) || self.is_sole())
    }

    /// The current session, while it surely lives.
    pub fn session_id(&self) -> Option<u64> {
        let held = self.held.lock().expect("held lock");
        held.as_ref()
            .filter(|h| self.alive(h))
            .map(|h| h.session.id)
    }

    /// Whether a key of `info` in `session` is an earlier, crashed run's.
    pub fn is_earlier_run(&self, info: &BrokerInfo, session: u64) -> bool {
        self.earlier_run(info, session, self.session_id())
    }

    /// A namespace's bundle by its name (`0x..._0x...`), if it has one.
    pub async fn bundle_named(&self, ns: &str, range: &str) -> Result<Option<Bundle>, BrokerError> {
        Ok(self
            .bundles(ns)
            .await?
            .list()
            .into_iter()
            .find(|b| b.name() == range))
    }

    /// [`bundle_named`](Self::bundle_named), reading the bundles again once if the name is
    /// not among them as read (another broker split one since).
    pub async fn bundle_named_fresh(
        &self,
        ns: &str,
        range: &str,
    ) -> Result<Option<Bundle>, BrokerError> {
        if let Some(b) = self.bundle_named(ns, range).await? {
            return Ok(Some(b));
        }
        self.forget_bundles(ns);
        self.bundle_named(ns, range).await
    }

    /// Marks this broker as its site's only one (standalone).
    pub fn set_sole(&self) {
        self.sole.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    fn is_sole(&self) -> bool {
        self.sole.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn me(&self) -> BrokerInfo {
        self.me.lock().expect("me lock").clone()
    }

    pub fn id(&self) -> String {
        self.me.lock().expect("me lock").id.clone()
    }

    /// Sets the TLS URL (known once its port is bound).
    pub fn set_tls_url(&self, url: &str) {
        self.me.lock().expect("me lock").service_url_tls = Some(url.to_string());
    }

    /// Sets the geo link's URL.
    pub fn set_geo_url(&self, url: &str) {
        self.me.lock().expect("me lock").geo_url = url.to_string();
    }

    /// Sets the HTTP and admin URLs.
    pub fn set_urls(&self, http: &str, admin: &str) {
        let mut me = self.me.lock().expect("me lock");
        me.http_url = http.to_string();
        me.admin_url = admin.to_string();
    }

    /// How long before the session's sure end the broker stops serving: the time a check
    /// and the closing of topics may take.
    fn margin(&self) -> Duration {
        Duration::from_millis((self.ttl_ms / 5).clamp(100, 1_000))
    }

    /// Whether the current session surely lives for a while yet.
    fn alive(&self, h: &Held) -> bool {
        h.session.lost().is_none() && Instant::now() + self.margin() < h.session.valid_until()
    }

    /// Registers the broker in a new session. Another live broker with the same id is an
    /// error once its session has had time to expire (a crashed broker's key lingers until
    /// then).
    pub async fn register(&self) -> Result<(), BrokerError> {
        let session = self.meta.session(self.ttl_ms).await?;
        let mut me = self.me();
        me.started_ms = super::now_ms();
        *self.me.lock().expect("me lock") = me.clone();
        let key = format!("{BROKERS_PREFIX}{}", me.id);
        if self.is_sole() {
            // Earlier runs of this site's only broker (under other addresses) are gone.
            for b in self.brokers().await? {
                if b.id != me.id {
                    self.meta
                        .delete(&format!("{BROKERS_PREFIX}{}", b.id), None)
                        .await?;
                }
            }
        }
        let deadline = Instant::now() + Duration::from_millis(self.ttl_ms * 2 + 1_000);
        loop {
            let opts = PutOptions {
                expected_version: Some(0),
                session: session.id,
                ..PutOptions::default()
            };
            let value = serde_json::to_vec(&me).expect("serializable");
            match self.meta.put_with(&key, value, opts).await {
                Ok(_) => break,
                Err(ClientError::Conflict { .. }) if self.takeover => {
                    // An earlier run of this process's address (it crashed): its key goes.
                    if let Some(kv) = self.meta.get(&key).await? {
                        tracing::info!(broker = %me.id, "taking over the registration of an earlier run");
                        if crate::failpoint::hit("register:slow_takeover") {
                            tokio::time::sleep(Duration::from_millis(self.ttl_ms * 2 + 500)).await;
                        }
                        match self.meta.delete(&key, Some(kv.mod_revision)).await {
                            // Gone with its session meanwhile, or written again: put again.
                            Ok(_) | Err(ClientError::Conflict { .. }) => {}
                            Err(e) => return Err(e.into()),
                        }
                    }
                }
                Err(ClientError::Conflict { .. }) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(ClientError::Conflict { .. }) => {
                    return Err(BrokerError::new(
                        ServerError::ServiceNotReady,
                        format!(
                            "another broker is registered as {} and alive (its key {key} outlived {} ms); give this one another broker.advertise or listen address",
                            me.id,
                            self.ttl_ms * 2 + 1_000
                        ),
                    ))
                }
                Err(e) => return Err(e.into()),
            }
        }
        *self.held.lock().expect("held lock") = Some(Held {
            session,
            owned: HashMap::new(),
        });
        tracing::info!(broker = %me.id, "broker registered");
        Ok(())
    }

    /// Writes the load report into the registration.
    pub async fn report(&self, load: LoadReport) -> Result<(), BrokerError> {
        if self.is_closing() {
            return Ok(());
        }
        let session = {
            let held = self.held.lock().expect("held lock");
            match held.as_ref() {
                Some(h) if self.alive(h) => h.session.id,
                _ => return Ok(()),
            }
        };
        let mut me = self.me();
        me.load = load;
        me.load.bundles = self.owned_count() as u64;
        *self.me.lock().expect("me lock") = me.clone();
        let opts = PutOptions {
            session,
            ..PutOptions::default()
        };
        let key = format!("{BROKERS_PREFIX}{}", me.id);
        self.meta
            .put_with(&key, serde_json::to_vec(&me).expect("serializable"), opts)
            .await?;
        self.placed.lock().expect("placed lock").clear();
        Ok(())
    }

    fn owned_count(&self) -> usize {
        self.held
            .lock()
            .expect("held lock")
            .as_ref()
            .map_or(0, |h| h.owned.values().map(BTreeMap::len).sum())
    }

    /// Until when ownership holds (the session's sure end less the margin); `None` without
    /// a session.
    pub fn serving_until(&self) -> Option<Instant> {
        let held = self.held.lock().expect("held lock");
        let h = held.as_ref()?;
        h.session
            .lost()
            .is_none()
            .then(|| h.session.valid_until() - self.margin())
    }

    /// Gives up everything: the session ended or could not be renewed. Returns the
    /// namespaces and bundles that were owned.
    pub fn lose(&self) -> Vec<(String, Bundle)> {
        let held = self.held.lock().expect("held lock").take();
        let Some(h) = held else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (ns, bs) in h.owned {
            for b in bs.into_keys() {
                out.push((ns.clone(), b));
            }
        }
        // Dropping the handle stops its keep-alives; the store expires the rest.
        drop(h.session);
        out
    }

    /// Leaves the list of brokers new bundles are placed on (graceful shutdown); what it owns
    /// stays owned until released.
    pub async fn deregister(&self) -> Result<(), BrokerError> {
        let key = format!("{BROKERS_PREFIX}{}", self.id());
        self.meta.delete(&key, None).await?;
        Ok(())
    }

    /// The bundles owned now.
    pub fn owned(&self) -> Vec<(String, Bundle)> {
        let held = self.held.lock().expect("held lock");
        held.as_ref().map_or_else(Vec::new, |h| {
            h.owned
                .iter()
                .flat_map(|(ns, bs)| bs.keys().map(move |b| (ns.clone(), *b)))
                .collect()
        })
    }

    /// Gives a bundle up (its topics were unloaded): its key goes, and the next lookup places
    /// it on another broker.
    pub async fn release(&self, ns: &str, b: &Bundle) -> Result<(), BrokerError> {
        self.start_release(ns, b);
        let r = self.delete_own_key(ns, b).await;
        self.releasing
            .lock()
            .expect("releasing lock")
            .remove(&(ns.to_string(), *b));
        r?;
        tracing::info!(namespace = %ns, bundle = %b.name(), "bundle released");
        metrics::counter!("meridian_bundles_released_total").increment(1);
        Ok(())
    }

    /// Deletes a bundle's owner key if it is this session's: one written by another broker
    /// after this one's session ended (and its key with it) stays.
    async fn delete_own_key(&self, ns: &str, b: &Bundle) -> Result<(), BrokerError> {
        let key = owner_key(ns, b);
        let Some(kv) = self.meta.get(&key).await? else {
            return Ok(());
        };
        if Some(kv.session) != self.session_id() {
            return Ok(());
        }
        match self.meta.delete(&key, Some(kv.mod_revision)).await {
            Ok(_) | Err(ClientError::Conflict { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// [`start_release`](Self::start_release) of a bundle this broker still owns and is not
    /// already giving up; whether it was (a caller that read `owned` earlier may find the
    /// bundle gone meanwhile: unloaded by an admin, or lost with the session).
    pub fn try_start_release(&self, ns: &str, b: &Bundle) -> bool {
        let mut releasing = self.releasing.lock().expect("releasing lock");
        if releasing.contains(&(ns.to_string(), *b)) || !self.owns(ns, b) {
            return false;
        }
        releasing.insert((ns.to_string(), *b));
        let mut held = self.held.lock().expect("held lock");
        if let Some(m) = held.as_mut().and_then(|h| h.owned.get_mut(ns)) {
            m.remove(b);
        }
        true
    }

    /// A bundle is being given up (its topics are about to be unloaded): it no longer counts
    /// as owned, and lookups meanwhile are told to retry instead of taking it back, until
    /// [`release`](Self::release) deletes its key.
    pub fn start_release(&self, ns: &str, b: &Bundle) {
        self.releasing
            .lock()
            .expect("releasing lock")
            .insert((ns.to_string(), *b));
        let mut held = self.held.lock().expect("held lock");
        if let Some(m) = held.as_mut().and_then(|h| h.owned.get_mut(ns)) {
            m.remove(b);
        }
    }

    /// Whether a bundle is being given up here ([`start_release`](Self::start_release) until
    /// [`release`](Self::release) is done).
    pub fn is_releasing(&self, ns: &str, b: &Bundle) -> bool {
        self.releasing
            .lock()
            .expect("releasing lock")
            .contains(&(ns.to_string(), *b))
    }

    /// Releases every bundle and ends the session (graceful shutdown): the ephemeral keys go
    /// at once, so other brokers take the bundles without waiting for an expiry.
    pub async fn release_all(&self) {
        let held = self.held.lock().expect("held lock").take();
        if let Some(h) = held {
            if let Err(e) = h.session.close().await {
                tracing::warn!(error = %e, "closing the broker's session failed; its keys expire");
            }
        }
    }

    /// All registered brokers.
    pub async fn brokers(&self) -> Result<Vec<BrokerInfo>, BrokerError> {
        let mut out = Vec::new();
        let mut after = String::new();
        loop {
            let page = self.meta.list(BROKERS_PREFIX, &after, 0).await?;
            for kv in &page.kvs {
                if let Ok(b) = serde_json::from_slice::<BrokerInfo>(&kv.value) {
                    out.push(b);
                }
            }
            match page.kvs.last() {
                Some(last) if page.more => after = last.key.clone(),
                _ => break,
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    /// A namespace's bundles, recorded with `broker.default_bundles` ranges on first use.
    pub async fn bundles(&self, ns: &str) -> Result<Bundles, BrokerError> {
        Ok(self.bundles_versioned(ns).await?.0)
    }

    /// [`bundles`](Self::bundles) and the version of their record.
    async fn bundles_versioned(&self, ns: &str) -> Result<(Bundles, u64), BrokerError> {
        if let Some(b) = self.bundles.lock().expect("bundles lock").get(ns) {
            return Ok(b.clone());
        }
        let key = bundles_key(ns);
        let b = loop {
            if let Some(kv) = self.meta.get(&key).await? {
                let b: Bundles = serde_json::from_slice(&kv.value)
                    .ok()
                    .filter(Bundles::valid)
                    .ok_or_else(|| {
                        BrokerError::new(
                            ServerError::MetadataError,
                            format!("{key} does not hold valid bundles"),
                        )
                    })?;
                break (b, kv.mod_revision);
            }
            let b = Bundles::even(self.default_bundles);
            match self
                .meta
                .create(&key, serde_json::to_vec(&b).expect("serializable"))
                .await
            {
                Ok(v) => break (b, v),
                Err(ClientError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        self.bundles
            .lock()
            .expect("bundles lock")
            .insert(ns.to_string(), b.clone());
        Ok(b)
    }

    /// Forgets the namespace's bundles as read (another broker split one).
    pub fn forget_bundles(&self, ns: &str) {
        self.bundles.lock().expect("bundles lock").remove(ns);
    }

    /// Cuts a bundle this broker owns in two (a metadata change, in one transaction: the
    /// namespace's boundaries, an ownership key for each half in this broker's session, the
    /// parent's key removed). The halves' topics stay loaded here; nothing is copied.
    pub async fn split(&self, ns: &str, b: &Bundle) -> Result<(Bundle, Bundle), BrokerError> {
        use meridian_metadata::pb;
        if self.is_closing() {
            return Err(unavailable("this broker is shutting down; no splits"));
        }
        let session = match self.session_id() {
            Some(s) if self.owns(ns, b) => s,
            _ => {
                return Err(unavailable(format!(
                    "bundle {} of {ns} is not owned by this broker; retry",
                    b.name()
                )))
            }
        };
        let key = bundles_key(ns);
        let kv = self.meta.get(&key).await?.ok_or_else(|| {
            BrokerError::new(ServerError::MetadataError, format!("{key} is missing"))
        })?;
        let current: Bundles = serde_json::from_slice(&kv.value)
            .ok()
            .filter(Bundles::valid)
            .ok_or_else(|| {
                BrokerError::new(
                    ServerError::MetadataError,
                    format!("{key} does not hold valid bundles"),
                )
            })?;
        let (after, lo, hi) = current.split(b).ok_or_else(|| {
            BrokerError::new(
                ServerError::InvalidTopicName,
                format!(
                    "bundle {} of {ns} cannot be split (not one of its bundles, or one hash)",
                    b.name()
                ),
            )
        })?;
        let parent = owner_key(ns, b);
        let own = self
            .meta
            .get(&parent)
            .await?
            .filter(|o| o.session == session)
            .ok_or_else(|| {
                unavailable(format!(
                    "bundle {} of {ns} is not owned in this broker's session",
                    b.name()
                ))
            })?;
        let me = serde_json::to_vec(&self.me()).expect("serializable");
        let put = |key: String, value: Vec<u8>, session: u64| pb::Op {
            op: Some(pb::op::Op::Put(pb::PutOp {
                key,
                value,
                session,
                sequential: false,
            })),
        };
        let cond = |key: String, expected_version: u64| pb::Condition {
            key,
            expected_version,
        };
        let resp = self
            .meta
            .txn(pb::TxnRequest {
                conditions: vec![
                    cond(key.clone(), kv.mod_revision),
                    cond(parent.clone(), own.mod_revision),
                    cond(owner_key(ns, &lo), 0),
                    cond(owner_key(ns, &hi), 0),
                ],
                success: vec![
                    put(key.clone(), serde_json::to_vec(&after).expect("json"), 0),
                    put(owner_key(ns, &lo), me.clone(), session),
                    put(owner_key(ns, &hi), me, session),
                    pb::Op {
                        op: Some(pb::op::Op::Delete(pb::DeleteOp {
                            key: parent,
                            prefix: false,
                        })),
                    },
                ],
                failure: vec![],
            })
            .await?;
        if !resp.succeeded {
            self.forget_bundles(ns);
            return Err(unavailable(format!(
                "bundle {} of {ns} changed meanwhile; retry",
                b.name()
            )));
        }
        let version = resp.results.first().map_or(0, |r| r.version);
        self.bundles
            .lock()
            .expect("bundles lock")
            .insert(ns.to_string(), (after, version));
        if let Some(h) = self
            .held
            .lock()
            .expect("held lock")
            .as_mut()
            .filter(|h| h.session.id == session)
        {
            let m = h.owned.entry(ns.to_string()).or_default();
            m.remove(b);
            m.insert(lo, ());
            m.insert(hi, ());
        }
        Ok((lo, hi))
    }

    /// The bundle a topic falls in.
    pub async fn bundle_of(&self, topic: &TopicName) -> Result<Bundle, BrokerError> {
        Ok(self
            .bundles(&topic.namespace())
            .await?
            .of(topic_hash(topic)))
    }

    /// Whether this broker owns the bundle now (and its session surely lives).
    pub fn owns(&self, ns: &str, b: &Bundle) -> bool {
        let held = self.held.lock().expect("held lock");
        held.as_ref()
            .is_some_and(|h| self.alive(h) && h.owned.get(ns).is_some_and(|m| m.contains_key(b)))
    }

    /// Who owns a bundle, as the store says (this broker included).
    pub async fn owner(&self, ns: &str, b: &Bundle) -> Result<Owner, BrokerError> {
        if self.owns(ns, b) {
            return Ok(Owner::Me);
        }
        if self
            .releasing
            .lock()
            .expect("releasing lock")
            .contains(&(ns.to_string(), *b))
        {
            return Err(unavailable(format!(
                "bundle {} of {ns} is being unloaded; look the topic up again",
                b.name()
            )));
        }
        match self.meta.get(&owner_key(ns, b)).await? {
            None => Ok(Owner::Nobody),
            Some(kv) => {
                let info: BrokerInfo = serde_json::from_slice(&kv.value).map_err(|e| {
                    BrokerError::new(
                        ServerError::MetadataError,
                        format!("{}: {e}", owner_key(ns, b)),
                    )
                })?;
                let current = self
                    .held
                    .lock()
                    .expect("held lock")
                    .as_ref()
                    .map(|h| h.session.id);
                if self.earlier_run(&info, kv.session, current) {
                    // An earlier run's ownership (it crashed): free again.
                    self.meta.delete(&kv.key, Some(kv.mod_revision)).await?;
                    return Ok(Owner::Nobody);
                }
                if info.id == self.id() && Some(kv.session) == current {
                    // Taken in this session by a put whose answer was lost: ours.
                    let mut held = self.held.lock().expect("held lock");
                    if let Some(h) = held.as_mut().filter(|h| h.session.id == kv.session) {
                        h.owned.entry(ns.to_string()).or_default().insert(*b, ());
                        return Ok(Owner::Me);
                    }
                }
                if info.id == self.id() {
                    // A key of an earlier session of this broker, not expired yet.
                    return Err(unavailable(format!(
                        "bundle {} of {ns} is still held by an earlier session of this broker; retry",
                        b.name()
                    )));
                }
                Ok(Owner::Other(info))
            }
        }
    }

    /// Takes an unowned bundle (compare-and-set of its ephemeral key). False if another
    /// broker has it.
    pub async fn acquire(&self, ns: &str, b: &Bundle) -> Result<bool, BrokerError> {
        if self.owns(ns, b) {
            return Ok(true);
        }
        if self.is_closing() {
            return Err(unavailable(
                "this broker is shutting down; look the topic up again",
            ));
        }
        let session = {
            let held = self.held.lock().expect("held lock");
            match held.as_ref() {
                Some(h) if self.alive(h) => h.session.id,
                _ => {
                    return Err(unavailable(
                        "this broker has no live metadata session; retry",
                    ))
                }
            }
        };
        // Only while the bundles are as this broker read them: a bundle split meanwhile is
        // not one any more.
        let (bundles, bundles_version) = self.bundles_versioned(ns).await?;
        if !bundles.list().contains(b) {
            self.forget_bundles(ns);
            return Ok(false);
        }
        // Only where the namespace isolation policies allow.
        if !self.allows(ns, &self.id()).await? {
            return Ok(false);
        }
        let value = serde_json::to_vec(&self.me()).expect("serializable");
        let resp = self
            .meta
            .txn(meridian_metadata::pb::TxnRequest {
                conditions: vec![
                    meridian_metadata::pb::Condition {
                        key: owner_key(ns, b),
                        expected_version: 0,
                    },
                    meridian_metadata::pb::Condition {
                        key: bundles_key(ns),
                        expected_version: bundles_version,
                    },
                ],
                success: vec![meridian_metadata::pb::Op {
                    op: Some(meridian_metadata::pb::op::Op::Put(
                        meridian_metadata::pb::PutOp {
                            key: owner_key(ns, b),
                            value,
                            session,
                            sequential: false,
                        },
                    )),
                }],
                failure: vec![],
            })
            .await?;
        if !resp.succeeded {
            let key = bundles_key(ns);
            if resp
                .current
                .iter()
                .any(|c| c.key == key && c.expected_version != bundles_version)
            {
                tracing::info!(namespace = %ns, "the namespace's bundles changed (a split); reading them again");
                self.forget_bundles(ns);
            }
            return Ok(false);
        }
        let mut held = self.held.lock().expect("held lock");
        let alive = held.as_ref().is_some_and(|h| self.alive(h));
        match held.as_mut() {
            Some(h) if h.session.id == session && alive => {
                h.owned.entry(ns.to_string()).or_default().insert(*b, ());
                tracing::info!(namespace = %ns, bundle = %b.name(), "bundle owned");
                metrics::counter!("meridian_bundles_acquired_total").increment(1);
                Ok(true)
            }
            _ => Err(unavailable("this broker's session ended meanwhile; retry")),
        }
    }

    /// Where an unowned bundle should go: the broker with the fewest bundles (as last
    /// reported, plus those placed on it since), ties broken by a hash of the bundle and the
    /// broker, so brokers asked at once mostly agree. `linked` (awaited only when a broker
    /// has a geo link): only brokers with a geo link if any of those allowed has one (a
    /// namespace replicated with other sites).
    pub async fn candidate(
        &self,
        ns: &str,
        b: &Bundle,
        linked: impl std::future::Future<Output = Result<bool, BrokerError>>,
    ) -> Result<BrokerInfo, BrokerError> {
        let registered = self.brokers().await?;
        let none_registered = registered.is_empty();
        let linked = registered.iter().any(|x| !x.geo_url.is_empty()) && linked.await?;
        let mut brokers = self.allowed(ns, registered).await?;
        if linked {
            brokers = super::geo_placement::linked_if_any(brokers);
        }
        if let Some(kv) = self
            .meta
            .get(&format!("{ASSIGN_PREFIX}{ns}/{}", b.name()))
            .await?
        {
            if let Ok(a) = serde_json::from_slice::<Assignment>(&kv.value) {
                // Written by the leader's clock: skew either way counts against it.
                let fresh = super::now_ms().abs_diff(a.at_ms) < ASSIGNMENT_TTL_MS;
                if let Some(x) = brokers.iter().find(|x| fresh && x.id == a.to) {
                    *self
                        .placed
                        .lock()
                        .expect("placed lock")
                        .entry(x.id.clone())
                        .or_insert(0) += 1;
                    return Ok(x.clone());
                }
            }
        }
        let placed = self.placed.lock().expect("placed lock").clone();
        let tie = |id: &str| {
            super::key_shared::murmur3_32(format!("{ns}/{}/{id}", b.name()).as_bytes(), 0)
        };
        let best = brokers
            .into_iter()
            .min_by_key(|x| {
                (
                    x.load.bundles + placed.get(&x.id).copied().unwrap_or(0),
                    tie(&x.id),
                )
            })
            .or_else(|| (none_registered && !self.is_closing()).then(|| self.me()))
            .ok_or_else(|| unavailable("no broker to place the bundle on; retry"))?;
        *self
            .placed
            .lock()
            .expect("placed lock")
            .entry(best.id.clone())
            .or_insert(0) += 1;
        Ok(best)
    }

    /// Every bundle of a namespace and its owner.
    pub async fn bundle_owners(&self, ns: &str) -> Result<Vec<(Bundle, Owner)>, BrokerError> {
        let mut out = Vec::new();
        for b in self.bundles(ns).await?.list() {
            let releasing = self
                .releasing
                .lock()
                .expect("releasing lock")
                .contains(&(ns.to_string(), b));
            if releasing {
                // Being unloaded here: nobody's in a moment.
                out.push((b, Owner::Nobody));
                continue;
            }
            out.push((b, self.owner(ns, &b).await?));
        }
        Ok(out)
    }
}

/// What a LOOKUP is answered.
#[derive(Debug, Clone, PartialEq)]
pub enum Lookup {
    /// Connect here.
    Connect,
    /// Ask that broker; `authoritative`: it was chosen and takes the bundle then.
    Redirect { to: BrokerInfo, authoritative: bool },
}

/// The broker process's share of the metrics and load report, from `/proc/self`.
pub struct ProcessSampler {
    last: Option<(std::time::Instant, u64)>,
}

impl Default for ProcessSampler {
    fn default() -> Self {
        Self::new()
    }
}

impl ProcessSampler {
    pub fn new() -> ProcessSampler {
        ProcessSampler { last: None }
    }

    /// (CPU percent of one core since the last call, resident bytes).
    pub fn sample(&mut self) -> (f64, u64) {
        let ticks = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| {
                // Fields after the command name (which may hold spaces) in parentheses.
                let rest = s.rsplit_once(')')?.1;
                let f: Vec<&str> = rest.split_whitespace().collect();
                let utime: u64 = f.get(11)?.parse().ok()?;
                let stime: u64 = f.get(12)?.parse().ok()?;
                Some(utime + stime)
            })
            .unwrap_or(0);
        let rss = std::fs::read_to_string("/proc/self/statm")
            .ok()
            .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
            .map_or(0, |pages| pages * 4096);
        let now = std::time::Instant::now();
        let cpu = match self.last {
            // Clock ticks are 1/100 s on Linux.
            Some((at, before)) => {
                let secs = now.duration_since(at).as_secs_f64().max(1e-3);
                ticks.saturating_sub(before) as f64 / 100.0 / secs * 100.0
            }
            None => 0.0,
        };
        self.last = Some((now, ticks));
        (cpu, rss)
    }
}

/// Shared by the broker: the ownership, if the broker takes part in a site's ownership.
pub type SharedOwnership = Arc<Ownership>;
