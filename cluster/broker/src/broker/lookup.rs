//! The broker's part in a site of many brokers: answering LOOKUP (Connect at the owner,
//! Redirect elsewhere, an unowned bundle placed first), serving a topic only where its bundle
//! is owned, and keeping the registration: the session, the load report, and giving up every
//! topic when the session cannot be renewed.

use std::sync::Arc;
use std::time::Duration;

use meridian_protocol::pb::ServerError;

use super::ownership::{LoadReport, Lookup, Owner, ProcessSampler};
use super::{Broker, BrokerError};
use crate::topic_name::TopicName;

impl Broker {
    /// Answers a LOOKUP of `name`. `authoritative`: the client was sent here as the broker
    /// chosen for the topic's unowned bundle, which this broker then takes.
    pub async fn lookup(
        &self,
        name: &TopicName,
        authoritative: bool,
    ) -> Result<Lookup, BrokerError> {
        let ns = name.namespace();
        self.require_namespace(&ns).await?;
        // Cut over to another site by a failover drill: served there.
        if let Some(to) = self.cut_redirect(&ns) {
            return Ok(Lookup::Redirect {
                to,
                authoritative: false,
            });
        }
        let o = &self.ownership;
        let mut b = o.bundle_of(name).await?;
        let mut owner = o.owner(&ns, &b).await?;
        if matches!(owner, Owner::Nobody) {
            // The bundles as this broker read them may predate a split elsewhere: read them
            // again before placing (unowned bundles are rare; owned ones need no read).
            o.forget_bundles(&ns);
            let fresh = o.bundle_of(name).await?;
            if fresh != b {
                b = fresh;
                owner = o.owner(&ns, &b).await?;
            }
        }
        match owner {
            Owner::Me => Ok(Lookup::Connect),
            Owner::Other(to) => Ok(Lookup::Redirect {
                to,
                authoritative: false,
            }),
            Owner::Nobody => {
                let chosen = o.candidate(&ns, &b, self.replicated_elsewhere(&ns)).await?;
                if !authoritative && chosen.id != o.id() {
                    tracing::debug!(topic = %name, bundle = %b.name(), to = %chosen.id, "unowned bundle placed on another broker");
                    return Ok(Lookup::Redirect {
                        to: chosen,
                        authoritative: true,
                    });
                }
                if o.acquire(&ns, &b).await? {
                    return Ok(Lookup::Connect);
                }
                match o.owner(&ns, &b).await? {
                    Owner::Me => Ok(Lookup::Connect),
                    Owner::Other(to) => Ok(Lookup::Redirect {
                        to,
                        authoritative: false,
                    }),
                    Owner::Nobody => Err(BrokerError::new(
                        ServerError::ServiceNotReady,
                        format!("bundle {} of {ns} changed hands meanwhile; retry", b.name()),
                    )),
                }
            }
        }
    }

    /// Before a topic is loaded here: this broker owns its bundle (taking it if nobody does).
    /// Owned elsewhere: ServiceNotReady, so the client looks the topic up again.
    /// Answers the session the ownership is held in: a load that finishes in another session
    /// must not serve.
    pub(super) async fn ensure_owned(&self, name: &TopicName) -> Result<u64, BrokerError> {
        let ns = name.namespace();
        let o = &self.ownership;
        let b = o.bundle_of(name).await?;
        let held = || {
            o.session_id().filter(|_| o.owns(&ns, &b)).ok_or_else(|| {
                BrokerError::new(
                    ServerError::ServiceNotReady,
                    "this broker's session ended meanwhile; retry",
                )
            })
        };
        if o.owns(&ns, &b) {
            return held();
        }
        let owner = o.owner(&ns, &b).await?;
        if matches!(owner, Owner::Nobody) {
            self.refuse_unlinked_acquisition(&ns).await?;
        }
        let other = match owner {
            Owner::Me => return held(),
            Owner::Nobody if !o.allows(&ns, &o.id()).await? => {
                return Err(BrokerError::new(
                    ServerError::ServiceNotReady,
                    format!(
                        "{name}: the namespace isolation policies do not let broker {} own its bundle; look it up again",
                        o.id()
                    ),
                ))
            }
            Owner::Nobody if o.acquire(&ns, &b).await? => return held(),
            // Taken meanwhile: by a concurrent load here (two topics of one bundle), or by
            // another broker.
            Owner::Nobody => match o.owner(&ns, &b).await? {
                Owner::Me => {
                    // The concurrent load's acquisition may not have recorded it yet.
                    for _ in 0..20 {
                        if o.owns(&ns, &b) {
                            break;
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                    return held();
                }
                Owner::Other(x) => x.id,
                Owner::Nobody => {
                    return Err(BrokerError::new(
                        ServerError::ServiceNotReady,
                        format!("{name}: its bundle could not be taken now; look it up again"),
                    ))
                }
            },
            Owner::Other(x) => x.id,
        };
        Err(BrokerError::new(
            ServerError::ServiceNotReady,
            format!(
                "{name} is served by broker {other}, not this one ({}); look it up again",
                o.id()
            ),
        ))
    }

    /// The geo URL of the broker that owns `name`'s bundle, when that is another broker
    /// (None: this one, or nobody yet, and this one may take it). An owner without a geo link
    /// is an error to retry later: it lets the bundle go at its next load report when a broker
    /// with a link may take it ([`Broker::release_unlinked`]), and placement prefers those.
    pub async fn geo_owner_elsewhere(
        &self,
        name: &TopicName,
    ) -> Result<Option<String>, BrokerError> {
        let ns = name.namespace();
        let b = self.ownership.bundle_of(name).await?;
        match self.ownership.owner(&ns, &b).await? {
            Owner::Me => Ok(None),
            // Taken here, unless this broker (with a listener but no geo URL of its own) may
            // not take it: then sent where it will be placed.
            Owner::Nobody => Ok(self
                .placed_instead(&ns, &b)
                .await?
                .map(|o| o.geo_url)
                .filter(|u| !u.is_empty())),
            Owner::Other(o) if !o.geo_url.is_empty() => Ok(Some(o.geo_url)),
            Owner::Other(o) => Err(BrokerError::new(
                ServerError::ServiceNotReady,
                format!(
                    "{name} is served by broker {}, which has no geo link; it moves to a broker with one",
                    o.id
                ),
            )),
        }
    }

    /// Sets the URLs the registration shows (the TLS one is taken from the TLS listener).
    pub fn announce(&self, http_url: &str, admin_url: &str) {
        self.ownership.set_urls(http_url, admin_url);
        if let Some(tls) = self.service_url_tls.get() {
            self.ownership.set_tls_url(tls);
        }
    }

    /// Registers the broker (a new metadata session). Another live broker with this id is an
    /// error.
    pub async fn register(&self) -> Result<(), BrokerError> {
        self.ownership.register().await
    }

    /// Keeps the registration. A watchdog that does nothing else waits for the session's
    /// sure end: when it comes without a renewal (or the session is found lost) every topic
    /// stops serving, before the store could give the bundles to another broker, and the
    /// broker registers again. Load reports and the load manager run in a task of their own,
    /// so a slow metadata call never delays the watchdog. A standalone (its site's only
    /// broker) keeps its topics: nobody else could take them.
    pub async fn ownership_loop(self: Arc<Self>) {
        let reporter = tokio::spawn(Arc::clone(&self).report_loop());
        let tick = Duration::from_millis(50);
        loop {
            match self.ownership.serving_until() {
                Some(until) if tokio::time::Instant::now() < until => {
                    tokio::time::sleep(tick.min(until - tokio::time::Instant::now())).await;
                    continue;
                }
                Some(_) => {}
                None if self.is_closing() => break,
                None => {}
            }
            // The session is over or not surely alive: stop serving, then register anew.
            let had = self.ownership.owns_any() || !self.loaded_topics().is_empty();
            let lost = self.ownership.lose();
            if had && !self.ownership.sole() {
                tracing::warn!(bundles = lost.len(), "the broker's metadata session could not be renewed in time: it stops serving every topic");
                metrics::counter!("meridian_broker_sessions_lost_total").increment(1);
                self.unload_all().await;
            }
            if self.is_closing() {
                break;
            }
            while let Err(e) = self.ownership.register().await {
                tracing::warn!(error = %e, "registering the broker failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                if self.is_closing() {
                    break;
                }
            }
        }
        reporter.abort();
    }

    /// Load reports every `broker.load_report_interval_ms`, each followed by a beat of the
    /// load manager, each bounded in time.
    async fn report_loop(self: Arc<Self>) {
        let every = Duration::from_millis(self.cfg.load_report_interval_ms);
        let limit = Duration::from_millis(self.cfg.session_ttl_ms);
        let mut sampler = ProcessSampler::new();
        loop {
            if self.is_closing() {
                return;
            }
            let load = self.load_report(&mut sampler).await;
            match tokio::time::timeout(limit, self.ownership.report(load)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "writing the load report failed"),
                Err(_) => tracing::warn!("writing the load report timed out"),
            }
            if tokio::time::timeout(limit, self.load_manager_beat())
                .await
                .is_err()
            {
                tracing::warn!("a load manager beat timed out");
            }
            tokio::time::sleep(every).await;
        }
    }

    async fn load_report(&self, sampler: &mut ProcessSampler) -> LoadReport {
        let (cpu_percent, memory_bytes) = sampler.sample();
        let mut r = LoadReport {
            cpu_percent,
            memory_bytes,
            connections: self.connection_count(),
            reported_ms: super::now_ms(),
            cpu_cores: std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
            ..LoadReport::default()
        };
        // The rates the stats loop sampled (no backlog or storage figures: they cost reads).
        let mut by_bundle: std::collections::HashMap<String, f64> = Default::default();
        for t in self.loaded_topics() {
            let [msgs_in, msgs_out, bytes_in, bytes_out] = t.rates_per_sec();
            r.topics += 1;
            r.msg_rate_in += msgs_in;
            r.msg_rate_out += msgs_out;
            r.bytes_rate_in += bytes_in;
            r.bytes_rate_out += bytes_out;
            if msgs_in + msgs_out > 0.0 {
                if let Ok(b) = self.ownership.bundle_of(&t.name).await {
                    *by_bundle
                        .entry(format!("{}/{}", t.name.namespace(), b.name()))
                        .or_default() += msgs_in + msgs_out;
                }
            }
        }
        let mut busiest: Vec<(String, f64)> = by_bundle.into_iter().collect();
        busiest.sort_by(|a, b| b.1.total_cmp(&a.1));
        busiest.truncate(super::ownership::BUNDLE_RATES_MAX);
        r.bundle_msg_rates = busiest.into_iter().collect();
        r
    }

    /// Unloads every loaded topic: producers and consumers are closed (they look the topics
    /// up again), cursors persisted, logs closed.
    pub async fn unload_all(&self) {
        use futures::StreamExt;
        let topics = self.loaded_topics();
        // First every topic stops serving (nothing here waits for the metadata store, which
        // may be what is unreachable) ...
        let held = self.hold(topics.iter().map(|t| t.name.to_string()).collect());
        let topics: Vec<_> = topics
            .into_iter()
            .filter(|t| self.forget_if_loaded(t))
            .collect();
        for t in &topics {
            t.stop_attaching();
        }
        // Their consumers are closed, all topics at once. A subscription's state (or a
        // topic's list of subscriptions) may be held by a call to the metadata store that
        // takes its time: the unload waits a bounded time, and the closing goes on in the
        // background until done. Given up, the consumers would stay attached to an instance
        // nothing serves and hear nothing until their connection dropped (seen in a fault
        // schedule: minutes).
        let limit = Duration::from_millis(self.cfg.session_ttl_ms / 4);
        let closing: Vec<_> = topics
            .iter()
            .map(|t| {
                let t = Arc::clone(t);
                tokio::spawn(async move {
                    // Each subscription on its own: one whose state is held does not hold up
                    // the others.
                    let subs = t.subscriptions().await;
                    futures::future::join_all(subs.iter().map(|s| s.disconnect_consumers())).await;
                })
            })
            .collect();
        let deadline = tokio::time::Instant::now() + limit;
        let mut late = Vec::new();
        for (t, mut task) in topics.iter().zip(closing) {
            match tokio::time::timeout_at(deadline, &mut task).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::error!(topic = %t.name, error = %e, "closing consumers failed")
                }
                Err(_) => late.push(t.name.to_string()),
            }
        }
        if !late.is_empty() {
            tracing::warn!(topics = late.len(), first = %late[0], "closing consumers takes long; they are closed once their subscriptions are free");
        }
        // ... then cursors are persisted and logs closed, as far as the store allows.
        let limit = Duration::from_millis(self.cfg.session_ttl_ms);
        futures::stream::iter(topics)
            .for_each_concurrent(64, |t| async move {
                if tokio::time::timeout(limit, t.close()).await.is_err() {
                    tracing::warn!(topic = %t.name, "closing an unloaded topic timed out");
                }
            })
            .await;
        drop(held);
    }

    /// Graceful shutdown's first step (SIGTERM): the broker leaves the placement list, then
    /// hands its bundles over one by one: each bundle's topics are unloaded (their producers
    /// and consumers closed; the clients look the topics up again) and the bundle released,
    /// so the next lookup places it on another broker. Nothing is loaded here meanwhile.
    pub async fn hand_over(&self) {
        self.closing
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.ownership.set_closing();
        if let Err(e) = self.ownership.deregister().await {
            tracing::warn!(error = %e, "leaving the broker list failed");
        }
        if let Err(e) = self.step_down().await {
            tracing::warn!(error = %e, "giving up the load manager's leadership failed");
        }
        let owned = self.ownership.owned();
        let started = std::time::Instant::now();
        for (ns, b) in &owned {
            self.unload_bundle_here(ns, b).await;
        }
        tracing::info!(
            bundles = owned.len(),
            ms = started.elapsed().as_millis() as u64,
            "bundles handed over"
        );
    }

    /// Graceful shutdown's last step: the registration and every bundle are released at once.
    pub async fn release_ownership(&self) {
        self.ownership.release_all().await;
    }
}
