//! Bookie autorecovery, as BookKeeper's: an auditor (one per site, elected through the
//! metadata store) marks ledgers that had a replica on a bookie that is gone (absent past
//! `bookie.lost_grace_ms`) or decommissioned, and replication workers (every process that runs
//! [`run`]) take marked ledgers one at a time under a per-ledger lock and make the missing
//! replicas again ([`replicate`]).
//!
//! ```text
//!  /bookies/available/<addr>  (registrations) ─┐
//!  /bookies/decommissioned/<addr> (admin)      ├─► auditor ─► /autorecovery/underreplicated/L<id>
//!  /ledgers/L<id> (ensembles)                 ─┘                 │
//!                 worker: lock /autorecovery/locks/L<id> (ephemeral, CAS) ─► copy ─► swap (CAS)
//!                         ─► delete the record ─► unlock
//! ```

pub mod audit;
pub mod replicate;

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use meridian_metadata::client::{ClientError, MetadataClient, PutOptions};
use meridian_metadata::SessionHandle;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::ledger::{LedgerClient, LedgerError};
use audit::{missing_fragments, retry_delay_ms, GoneTracker, UnderReplicated};

/// The elected auditor: an ephemeral key of its session.
pub const AUDITOR_KEY: &str = "/autorecovery/auditor";
/// One record per under-replicated ledger (`L<id, 20 digits>`).
pub const UNDER_REPLICATED_PREFIX: &str = "/autorecovery/underreplicated/";
/// A worker's lock on a ledger it re-replicates (ephemeral).
pub const LOCKS_PREFIX: &str = "/autorecovery/locks/";
/// Bookies an admin decommissioned (`bookies decommission`): their replicas are made
/// elsewhere, the bookie itself turns read-only.
pub const DECOMMISSIONED_PREFIX: &str = "/bookies/decommissioned/";

fn record_key(id: u64) -> String {
    format!("{UNDER_REPLICATED_PREFIX}L{id:020}")
}

fn lock_key(id: u64) -> String {
    format!("{LOCKS_PREFIX}L{id:020}")
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Settings of an autorecovery process (a broker's, or `meridian autorecovery`).
#[derive(Debug, Clone)]
pub struct Options {
    /// Who runs it (the auditor record and logs).
    pub id: String,
    pub session_ttl_ms: u64,
    /// A bookie absent this long is gone (`bookie.lost_grace_ms`).
    pub lost_grace_ms: u64,
    /// While a bookie is gone, ledgers are audited again this often (new fragments appear as
    /// writers move off it).
    pub audit_interval: Duration,
    /// How often the auditor checks registrations and workers look for marked ledgers.
    pub poll: Duration,
    /// Entries a worker copies at once.
    pub window: usize,
}

impl Options {
    /// From the `[bookie]` section's autorecovery keys.
    pub fn from_config(b: &meridian_config::BookieConfig, id: String, session_ttl_ms: u64) -> Self {
        Self {
            id,
            session_ttl_ms,
            lost_grace_ms: b.lost_grace_ms,
            audit_interval: Duration::from_millis(b.audit_interval_ms),
            poll: Duration::from_secs(1),
            window: 64,
        }
    }
}

/// The decommission mark's value.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Decommissioned {
    pub since_ms: u64,
}

/// Marks `addr` decommissioned (idempotent).
pub async fn decommission(meta: &MetadataClient, addr: &str) -> Result<(), ClientError> {
    let key = format!("{DECOMMISSIONED_PREFIX}{addr}");
    let value = serde_json::to_vec(&Decommissioned { since_ms: now_ms() }).expect("json");
    match meta
        .put_with(
            &key,
            value,
            PutOptions {
                expected_version: Some(0),
                ..PutOptions::default()
            },
        )
        .await
    {
        Ok(_) | Err(ClientError::Conflict { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Addresses of decommissioned bookies.
pub async fn decommissioned(meta: &MetadataClient) -> Result<BTreeSet<String>, ClientError> {
    Ok(meta
        .children_all(DECOMMISSIONED_PREFIX)
        .await?
        .into_iter()
        .collect())
}

/// The records of under-replicated ledgers, by ledger.
pub async fn under_replicated(meta: &MetadataClient) -> Result<Vec<UnderReplicated>, ClientError> {
    Ok(records(meta).await?.into_iter().map(|(r, _)| r).collect())
}

async fn records(meta: &MetadataClient) -> Result<Vec<(UnderReplicated, u64)>, ClientError> {
    let mut out = Vec::new();
    for kv in meta.list_all(UNDER_REPLICATED_PREFIX).await? {
        match serde_json::from_slice::<UnderReplicated>(&kv.value) {
            Ok(r) => out.push((r, kv.mod_revision)),
            Err(e) => {
                tracing::warn!(key = %kv.key, error = %e, "unreadable under-replicated record")
            }
        }
    }
    Ok(out)
}

/// Ledgers whose metadata names `addr` in any fragment (what a decommission waits for).
pub async fn ledgers_on(client: &LedgerClient, addr: &str) -> Result<Vec<u64>, LedgerError> {
    let mut out = Vec::new();
    for id in client.list().await? {
        match client.metadata(id).await {
            Ok((m, _)) => {
                if m.fragments
                    .iter()
                    .any(|f| f.ensemble.iter().any(|b| b == addr))
                {
                    out.push(id);
                }
            }
            Err(LedgerError::NoSuchLedger(_)) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// The auditor's memory while it leads.
#[derive(Default)]
struct Auditor {
    tracker: GoneTracker,
    /// Bookies named by some ledger at the last full audit (`None` before the first): a
    /// decommissioned bookie no ledger names is done with, and no reason to audit again.
    named: Option<BTreeSet<String>>,
    last_gone: Option<BTreeSet<String>>,
    last_scan: Option<Instant>,
}

/// Runs the auditor election and a replication worker until `stop`.
pub async fn run(client: LedgerClient, opts: Options, mut stop: watch::Receiver<bool>) {
    let meta = client.metadata_client().clone();
    let mut session: Option<SessionHandle> = None;
    let mut auditor: Option<Auditor> = None;
    loop {
        if session.as_ref().is_some_and(|s| s.lost().is_some()) {
            session = None;
            auditor = None;
        }
        if session.is_none() {
            match meta.session(opts.session_ttl_ms).await {
                Ok(s) => session = Some(s),
                Err(e) => tracing::warn!(error = %e, "autorecovery: no metadata session yet"),
            }
        }
        if let Some(s) = &session {
            match lead(&meta, s.id, &opts.id).await {
                Ok(true) => {
                    let a = auditor.get_or_insert_with(|| {
                        tracing::info!(id = %opts.id, "this process is the site's autorecovery auditor");
                        Auditor::default()
                    });
                    if let Err(e) = audit_beat(&client, &opts, a).await {
                        tracing::warn!(error = %e, "autorecovery audit failed");
                    }
                }
                Ok(false) => auditor = None,
                Err(e) => tracing::warn!(error = %e, "autorecovery auditor election failed"),
            }
            if let Err(e) = work_beat(&client, &opts, s.id, &stop).await {
                tracing::warn!(error = %e, "autorecovery worker failed");
            }
        }
        tokio::select! {
            _ = stop.changed() => break,
            _ = tokio::time::sleep(opts.poll) => {}
        }
    }
    if let Some(s) = session {
        let _ = tokio::time::timeout(Duration::from_secs(2), s.close()).await;
    }
}

/// Whether this process is the auditor (taking the role if nobody has it).
async fn lead(meta: &MetadataClient, session: u64, id: &str) -> Result<bool, ClientError> {
    if let Some(kv) = meta.get(AUDITOR_KEY).await? {
        return Ok(kv.session == session);
    }
    let opts = PutOptions {
        expected_version: Some(0),
        session,
        ..PutOptions::default()
    };
    match meta
        .put_with(AUDITOR_KEY, id.as_bytes().to_vec(), opts)
        .await
    {
        Ok(_) => {
            metrics::counter!("meridian_autorecovery_auditor_elections_total").increment(1);
            Ok(true)
        }
        Err(ClientError::Conflict { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The auditor's beat: registrations and decommissions; a full audit of every ledger when the
/// set of gone bookies changed, at the start, and every `audit_interval` while one is gone.
async fn audit_beat(
    client: &LedgerClient,
    opts: &Options,
    a: &mut Auditor,
) -> Result<(), LedgerError> {
    let meta = client.metadata_client();
    let registered: BTreeSet<String> = client
        .bookies()
        .await?
        .into_iter()
        .map(|b| b.address)
        .collect();
    let now = now_ms();
    a.tracker.observe(now, &registered);
    let mut gone = a.tracker.gone(now, opts.lost_grace_ms);
    gone.extend(
        decommissioned(meta)
            .await?
            .into_iter()
            .filter(|b| a.named.as_ref().is_none_or(|n| n.contains(b))),
    );
    let due = a.last_scan.is_none()
        || a.last_gone.as_ref() != Some(&gone)
        || (!gone.is_empty()
            && a.last_scan
                .is_some_and(|t| t.elapsed() >= opts.audit_interval));
    if !due {
        return Ok(());
    }
    if a.last_gone.as_ref() != Some(&gone) {
        tracing::info!(gone = ?gone, absent = ?a.tracker.absent(), "autorecovery: bookies gone or decommissioned changed; auditing every ledger");
    }
    a.last_scan = Some(Instant::now());
    a.last_gone = Some(gone.clone());
    let existing: HashMap<u64, (UnderReplicated, u64)> = records(meta)
        .await?
        .into_iter()
        .map(|(r, v)| (r.ledger, (r, v)))
        .collect();
    let mut named = BTreeSet::new();
    let mut marked = 0u64;
    for id in client.list().await? {
        let m = match client.metadata(id).await {
            Ok((m, _)) => m,
            Err(LedgerError::NoSuchLedger(_)) => continue,
            Err(e) => return Err(e),
        };
        for b in m.fragments.iter().flat_map(|f| f.ensemble.iter()) {
            if named.insert(b.clone()) {
                a.tracker.note_named(now, b);
            }
        }
        let missing = missing_fragments(&m, &gone);
        let key = record_key(id);
        match (missing.is_empty(), existing.get(&id)) {
            (true, None) => {}
            (true, Some((_, v))) => {
                // Repaired, or its bookie came back: no longer under-replicated.
                let _ = meta.delete(&key, Some(*v)).await;
            }
            (false, Some((r, _))) if r.fragments == missing => marked += 1,
            (false, prev) => {
                let rec = UnderReplicated {
                    ledger: id,
                    fragments: missing,
                    since_ms: prev.map_or(now, |(r, _)| r.since_ms),
                    attempts: prev.map_or(0, |(r, _)| r.attempts),
                    last_error: prev.map_or_else(String::new, |(r, _)| r.last_error.clone()),
                    last_attempt_ms: prev.map_or(0, |(r, _)| r.last_attempt_ms),
                };
                let opts = PutOptions {
                    expected_version: Some(prev.map_or(0, |(_, v)| *v)),
                    ..PutOptions::default()
                };
                match meta
                    .put_with(&key, serde_json::to_vec(&rec).expect("json"), opts)
                    .await
                {
                    Ok(_) => {
                        tracing::info!(ledger = id, fragments = ?rec.fragments, "ledger marked under-replicated");
                        metrics::counter!("meridian_autorecovery_ledgers_marked_total")
                            .increment(1);
                        marked += 1;
                    }
                    // A worker finished it meanwhile: the next audit looks again.
                    Err(ClientError::Conflict { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
    a.tracker.retain_named(&named);
    a.named = Some(named);
    metrics::gauge!("meridian_autorecovery_under_replicated_ledgers").set(marked as f64);
    Ok(())
}

/// The worker's beat: every marked ledger not locked by another worker and not waiting out
/// a failure's retry delay, one at a time.
async fn work_beat(
    client: &LedgerClient,
    opts: &Options,
    session: u64,
    stop: &watch::Receiver<bool>,
) -> Result<(), LedgerError> {
    let meta = client.metadata_client();
    for (rec, version) in records(meta).await? {
        if *stop.borrow() {
            break;
        }
        let id = rec.ledger;
        if now_ms() < rec.last_attempt_ms + retry_delay_ms(rec.attempts) {
            continue;
        }
        let Some(lock_version) = lock(meta, id, session, &opts.id).await? else {
            continue;
        };
        let gone: BTreeSet<String> = rec
            .fragments
            .iter()
            .flat_map(|f| f.bookies.iter().cloned())
            .collect();
        let started = Instant::now();
        match replicate::replicate_ledger(client, id, &gone, opts.window).await {
            Ok(done) => {
                tracing::info!(
                    ledger = id,
                    fragments = done.fragments,
                    entries = done.entries,
                    bytes = done.bytes,
                    deleted = done.deleted,
                    ms = started.elapsed().as_millis() as u64,
                    "ledger re-replicated"
                );
                metrics::counter!("meridian_autorecovery_ledgers_replicated_total").increment(1);
                match meta.delete(&record_key(id), Some(version)).await {
                    Ok(_) => {}
                    // Marked again meanwhile (more fragments), or removed by the auditor: the
                    // next beat looks again.
                    Err(ClientError::Conflict { .. }) => {}
                    Err(e) => {
                        tracing::warn!(ledger = id, error = %e, "removing the under-replicated record failed")
                    }
                }
            }
            Err(e) => {
                tracing::warn!(ledger = id, error = %e, attempts = rec.attempts + 1, "re-replicating the ledger failed; it stays marked and is tried again later");
                metrics::counter!("meridian_autorecovery_failures_total").increment(1);
                let failed = UnderReplicated {
                    attempts: rec.attempts + 1,
                    last_error: e.to_string(),
                    last_attempt_ms: now_ms(),
                    ..rec
                };
                let put = PutOptions {
                    expected_version: Some(version),
                    ..PutOptions::default()
                };
                // Lost to the auditor's newer record: that one is tried next.
                let _ = meta
                    .put_with(
                        &record_key(id),
                        serde_json::to_vec(&failed).expect("json"),
                        put,
                    )
                    .await;
            }
        }
        if let Err(e) = meta.delete(&lock_key(id), Some(lock_version)).await {
            tracing::warn!(ledger = id, error = %e, "releasing the ledger's lock failed; the next beat takes it again");
        }
    }
    Ok(())
}

/// Takes the ledger's lock in `session`; `None` if another worker holds it. A lock of this
/// session left behind (its release failed) is taken again.
async fn lock(
    meta: &MetadataClient,
    id: u64,
    session: u64,
    who: &str,
) -> Result<Option<u64>, ClientError> {
    let opts = PutOptions {
        expected_version: Some(0),
        session,
        ..PutOptions::default()
    };
    match meta
        .put_with(&lock_key(id), who.as_bytes().to_vec(), opts)
        .await
    {
        Ok(r) => Ok(Some(r.version)),
        Err(ClientError::Conflict { .. }) => Ok(meta
            .get(&lock_key(id))
            .await?
            .filter(|kv| kv.session == session)
            .map(|kv| kv.mod_revision)),
        Err(e) => Err(e),
    }
}
