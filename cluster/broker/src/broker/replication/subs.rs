//! Replicated subscriptions: a subscription's acknowledgements carried to the topic's other
//! sites and applied there, exactly (the model is `sub_state.rs`).
//!
//! ```text
//!  /repl-subs/<log>/<subscription>   the subscription is replicated; what its sender knows:
//!                                    the mark-delete position it read entries through, and
//!                                    per other origin the highest origin position up to it
//!
//!  each topic with one, at its owner, every 50 ms (sub_sync_loop):
//!    send: a subscription whose acknowledgements changed since a remote last confirmed
//!      them (or every 10 s, every second while the remote holds some): its state, built
//!      from the cursor (each entry's origin read from its metadata; entries past the
//!      mark-delete position cached), to each site the topic replicates to, at the broker
//!      that owns the topic there (SubSync, following Moved)
//!    apply (on SubSync, and again while some of a remote's state waits for entries): the
//!      states merged per sending site; entries after the mark-delete position read in
//!      order, each acknowledged as far as a state covers it (its origin and position, and
//!      only if the sender held it); what a state says of entries not here yet is held
//! ```
//!
//! Consumers at several sites at once get the union of their acknowledgements.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use meridian_geo::frame::RefusalCode;
use meridian_geo::receiver::Refusal;
use meridian_geo::GeoLink;
use meridian_protocol::pb::ServerError;
use meridian_protocol::Entry;
use meridian_storage::managed_ledger::Position;
use serde::{Deserialize, Serialize};

use super::sub_state::{held_by, AckState, Builder, Cover, OPos};
use super::{Topic, REPL_CURSOR_PREFIX};
use crate::broker::{BrokerError, Subscription};

/// Where replicated subscriptions are recorded: `<prefix><log>/<escaped subscription>`.
pub const REPL_SUBS_PREFIX: &str = "/repl-subs/";

/// How often a topic's replicated subscriptions are looked at, without a link yet (else
/// `geo.subscription_sync_interval_ms`).
const SYNC_INTERVAL: Duration = Duration::from_millis(50);
/// A state is sent again this often even when nothing changed (a remote that restarted
/// forgets what it held).
const RESEND: Duration = Duration::from_secs(10);
/// ... and this often while the remote holds some of it for entries still to come.
const RESEND_HELD: Duration = Duration::from_secs(1);
/// After a failed send.
const RETRY: Duration = Duration::from_secs(1);
/// A SubSync's deadline.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);
/// Entries read per apply at most (the rest at the next).
const APPLY_SCAN_MAX: usize = 200_000;
/// Entries read at once.
const READ_CHUNK: usize = 1024;
/// The record of what the sender knows is written at most this often.
const TRACK_SAVE_INTERVAL: Duration = Duration::from_secs(1);

/// What a sender knows of its mark-delete position, kept in the subscription's record.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Track {
    /// Entries were read through this position.
    md: Option<Position>,
    /// Per origin other than this site, the highest origin position at or before `md`.
    through: BTreeMap<String, OPos>,
    /// The subscription was deleted here or made not replicated: what other sites send of
    /// it is not taken (so they do not bring it back) until it is made replicated again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    disabled: bool,
}

/// A SubSync's document.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct SyncDoc {
    subs: Vec<SubDoc>,
    /// A drill's measure: nothing is applied; the answer says what would be, and what the
    /// receiver holds of the sender's entries.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    measure: bool,
    /// (measure) Per producer name, ranges of sequence ids of the sender's entries the
    /// receiver does not hold by position: which of them does it hold by its producers' ids
    /// (sends stored at both sites, deduplicated)?
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    ids: BTreeMap<String, Vec<(i64, i64)>>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct SubDoc {
    name: String,
    state: AckState,
}

impl SyncDoc {
    /// A drill's measure of these states.
    pub(super) fn measuring(subs: Vec<SubDoc>) -> SyncDoc {
        SyncDoc {
            subs,
            measure: true,
            ids: BTreeMap::new(),
        }
    }

    /// A drill's question: which of these ids does the receiver hold?
    pub(super) fn asking_ids(ids: BTreeMap<String, Vec<(i64, i64)>>) -> SyncDoc {
        SyncDoc {
            subs: Vec::new(),
            measure: true,
            ids,
        }
    }
}

/// A SubSynced's document.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct SyncedDoc {
    pub(super) subs: Vec<SubAnswer>,
    /// (measure) The highest of the sender's own entries the receiver holds durably.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) holds: Option<OPos>,
    /// (measure) Of the ids asked about, the ranges held here (deduplicating topics only).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(super) held_ids: BTreeMap<String, Vec<(i64, i64)>>,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct SubAnswer {
    pub(super) name: String,
    /// Entries acknowledged (or batches changed) by applying it.
    applied: u64,
    /// (origin site) parts of the state that speak of entries not here yet.
    held: u64,
    /// (measure) Entries here the state acknowledges and this site has not, and messages.
    #[serde(default)]
    pub(super) entries: u64,
    #[serde(default)]
    pub(super) messages: u64,
    /// (measure) The subscription does not exist here.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) missing: bool,
    /// The subscription was deleted here or made not replicated: nothing taken.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) ignored: bool,
}

/// What goes to one remote in a round: the states, and (subscription, `ack_version`,
/// `acks_total`) of each when it was built.
type Outgoing = (Vec<SubDoc>, Vec<(String, u64, u64)>);

/// A topic's replicated subscriptions.
#[derive(Default)]
pub struct ReplSubs {
    state: tokio::sync::Mutex<State>,
    running: AtomicBool,
    /// The names in `state.subs`, as of the last change (made under `state`'s lock): a
    /// consumer of a subscription already replicated attaches without waiting for that lock,
    /// which is held across calls to the metadata store.
    known: std::sync::Mutex<std::collections::BTreeSet<String>>,
}

impl ReplSubs {
    /// `known` follows `st.subs` (called under the state's lock after each change).
    fn note(&self, st: &State) {
        *self.known.lock().expect("known lock") = st.subs.keys().cloned().collect();
    }

    fn is_known(&self, sub: &str) -> bool {
        self.known.lock().expect("known lock").contains(sub)
    }
}

#[derive(Default)]
struct State {
    loaded: bool,
    subs: BTreeMap<String, Arc<SubEntry>>,
    /// Subscriptions deleted here or made not replicated (their records say so).
    disabled: std::collections::BTreeSet<String>,
}

impl State {
    fn entries(&self) -> Vec<(String, Arc<SubEntry>)> {
        self.subs
            .iter()
            .map(|(n, e)| (n.clone(), Arc::clone(e)))
            .collect()
    }
}

/// One replicated subscription. Its work is locked while a round or an apply reads the
/// entries it needs (up to [`APPLY_SCAN_MAX`] of them), and on its own: the topic's other
/// replicated subscriptions, its deletion and the stats do not wait for that. Its remotes'
/// sync is locked only for moments. Lock order: the map (`State`) may be taken while `work`
/// is held, never the other way round.
#[derive(Default)]
struct SubEntry {
    work: tokio::sync::Mutex<SubRepl>,
    remotes: std::sync::Mutex<BTreeMap<String, RemoteSync>>,
}

impl SubEntry {
    fn new(r: SubRepl) -> Arc<SubEntry> {
        Arc::new(SubEntry {
            work: tokio::sync::Mutex::new(r),
            remotes: std::sync::Mutex::default(),
        })
    }

    fn remotes(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, RemoteSync>> {
        self.remotes.lock().expect("remotes lock")
    }
}

#[derive(Default)]
struct SubRepl {
    track: Track,
    saved: Option<(Track, Instant)>,
    /// What each other site said, merged.
    incoming: BTreeMap<String, AckState>,
    /// Parts of `incoming` waiting for entries, at the last apply.
    held: u64,
    /// The log's end at the last apply.
    applied_to: Option<Position>,
    /// Where the next apply's scan goes on (one cut short by [`APPLY_SCAN_MAX`]).
    scan_from: Option<Position>,
    /// What the site held of each other origin when the last apply began.
    applied_holds: BTreeMap<String, Option<OPos>>,
    /// Origins of entries after the mark-delete position, as read.
    origins: BTreeMap<Position, EntryOrigin>,
}

#[derive(Debug, Clone)]
struct EntryOrigin {
    /// `None`: produced here.
    site: Option<String>,
    at: OPos,
    replicate_to: Vec<String>,
    /// Messages in the entry (a batch's count).
    messages: u64,
}

/// What states acknowledge of a subscription's entries after its mark-delete position.
#[derive(Debug, Default)]
struct Covered {
    /// Entries acknowledged whole, with their messages.
    whole: Vec<(Position, u64)>,
    /// Batches partly: bit i set = message i still unacknowledged.
    partial: Vec<(Position, Vec<u64>)>,
    /// (sender, origin) parts that speak of entries not here yet.
    held: u64,
    /// Where a scan cut short stopped.
    stopped_at: Option<Position>,
    /// What the site held of each other origin the states speak of, as the scan began (the
    /// entries it could apply to).
    holds: BTreeMap<String, Option<OPos>>,
}

/// One remote site's side of a replicated subscription, as its sender sees it.
#[derive(Debug, Default, Clone)]
struct RemoteSync {
    /// The subscription's `ack_version` the remote confirmed last.
    confirmed: u64,
    /// Its `acks_total` then.
    confirmed_acks: u64,
    held: u64,
    /// The broker of the remote site that answered last.
    at: Option<String>,
    next: Option<Instant>,
    error: Option<String>,
}

/// A replicated subscription's sync with one remote, for stats.
#[derive(Debug, Clone, Serialize)]
pub struct SubSyncStats {
    pub remote: String,
    /// Acknowledgements here the remote has not confirmed yet.
    pub pending_acks: u64,
    /// How long the oldest of them has waited, ms.
    pub pending_ms: u64,
    /// Parts of this site's state the remote holds for entries it does not have yet.
    pub held: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

fn entry_origin(pos: Position, bytes: &bytes::Bytes) -> EntryOrigin {
    let meta = Entry::parse(bytes.clone())
        .ok()
        .and_then(|e| e.metadata().ok());
    match meta {
        Some(m) => {
            let messages = meridian_protocol::entry::message_count(&m) as u64;
            match m.meridian_origin {
                Some(o) => EntryOrigin {
                    site: Some(o.site),
                    at: (o.ledger_id, o.entry_id),
                    replicate_to: m.replicate_to,
                    messages,
                },
                None => EntryOrigin {
                    site: None,
                    at: (pos.ledger_id, pos.entry_id),
                    replicate_to: m.replicate_to,
                    messages,
                },
            }
        }
        // Not a message (never the case for a topic's entries): taken as this site's own.
        None => EntryOrigin {
            site: None,
            at: (pos.ledger_id, pos.entry_id),
            replicate_to: Vec::new(),
            messages: 1,
        },
    }
}

fn opos(p: Position) -> OPos {
    (p.ledger_id, p.entry_id)
}

impl Topic {
    fn repl_subs_key(&self, sub: &str) -> String {
        format!(
            "{REPL_SUBS_PREFIX}{}/{}",
            self.ml.name(),
            crate::topic_name::escape(sub)
        )
    }

    /// Makes `sub` a replicated subscription (recorded; its acknowledgements go to the
    /// topic's other sites from now on).
    pub async fn enable_replicated(self: &Arc<Self>, sub: &str) -> Result<(), BrokerError> {
        if self.repl_subs.is_known(sub) {
            // Replicated already (its record written): nothing to wait for.
            self.ensure_sub_sync();
            return Ok(());
        }
        let mut st = self.repl_subs.state.lock().await;
        // Under the lock a deletion takes to drop the records (after the topic stopped
        // taking clients): no record is written for a topic being deleted or unloaded.
        self.refuse_if_detached()?;
        self.load_replicated(&mut st).await?;
        if !st.subs.contains_key(sub) {
            let mut r = SubRepl::default();
            self.save_track(sub, &mut r, true).await?;
            tracing::info!(topic = %self.full_name, subscription = sub, "the subscription is replicated");
            st.disabled.remove(sub);
            st.subs.insert(sub.to_string(), SubEntry::new(r));
            self.repl_subs.note(&st);
        }
        drop(st);
        self.ensure_sub_sync();
        Ok(())
    }

    /// Whether `sub` is a replicated subscription.
    pub async fn is_replicated_subscription(&self, sub: &str) -> Result<bool, BrokerError> {
        let mut st = self.repl_subs.state.lock().await;
        self.load_replicated(&mut st).await?;
        Ok(st.subs.contains_key(sub))
    }

    /// Forgets a subscription that was deleted or is no longer replicated (its record too).
    pub async fn forget_replicated(&self, sub: &str) {
        let mut st = self.repl_subs.state.lock().await;
        if let Err(e) = self.load_replicated(&mut st).await {
            tracing::warn!(topic = %self.full_name, subscription = sub, error = %e, "reading the replicated subscriptions failed");
        }
        if st.subs.remove(sub).is_some() {
            self.repl_subs.note(&st);
            self.disable_record(&mut st, sub).await;
        }
    }

    /// Records that `sub` is no longer replicated here (what other sites send of it is not
    /// taken).
    async fn disable_record(&self, st: &mut State, sub: &str) {
        let value = serde_json::to_vec(&Track {
            disabled: true,
            ..Track::default()
        })
        .expect("track serializes");
        if let Err(e) = self.meta.put(&self.repl_subs_key(sub), value).await {
            tracing::warn!(topic = %self.full_name, subscription = sub, error = %e, "recording that the subscription is no longer replicated failed");
        }
        st.disabled.insert(sub.to_string());
    }

    /// Deletes every replicated subscription's record (the topic is deleted).
    pub(in crate::broker) async fn delete_replicated_subs(&self) -> Result<(), BrokerError> {
        let mut st = self.repl_subs.state.lock().await;
        st.subs.clear();
        st.disabled.clear();
        self.repl_subs.note(&st);
        let prefix = format!("{REPL_SUBS_PREFIX}{}/", self.ml.name());
        loop {
            let page = self.meta.children(&prefix, "", 0).await?;
            for c in &page.children {
                self.meta.delete(&format!("{prefix}{c}"), None).await?;
            }
            if !page.more {
                return Ok(());
            }
        }
    }

    /// The replicated subscriptions (their records read first, once).
    async fn sub_entries(&self) -> Result<Vec<(String, Arc<SubEntry>)>, BrokerError> {
        let mut st = self.repl_subs.state.lock().await;
        self.load_replicated(&mut st).await?;
        Ok(st.entries())
    }

    /// The entry of replicated subscription `sub`, if it is one.
    async fn sub_entry(&self, sub: &str) -> Result<Option<Arc<SubEntry>>, BrokerError> {
        let mut st = self.repl_subs.state.lock().await;
        self.load_replicated(&mut st).await?;
        Ok(st.subs.get(sub).cloned())
    }

    /// Reads the records of the topic's replicated subscriptions once.
    async fn load_replicated(&self, st: &mut State) -> Result<(), BrokerError> {
        if st.loaded {
            return Ok(());
        }
        let prefix = format!("{REPL_SUBS_PREFIX}{}/", self.ml.name());
        let mut after = String::new();
        loop {
            let page = self.meta.children(&prefix, &after, 0).await?;
            for c in &page.children {
                let name = crate::topic_name::unescape(c);
                let track: Track = match self.meta.get(&format!("{prefix}{c}")).await? {
                    Some(kv) => serde_json::from_slice(&kv.value).unwrap_or_default(),
                    None => continue,
                };
                if track.disabled {
                    st.disabled.insert(name);
                    continue;
                }
                st.subs.entry(name).or_insert_with(|| {
                    SubEntry::new(SubRepl {
                        saved: Some((track.clone(), Instant::now())),
                        track,
                        ..SubRepl::default()
                    })
                });
            }
            match page.children.last() {
                Some(last) if page.more => after = last.clone(),
                _ => break,
            }
        }
        st.loaded = true;
        self.repl_subs.note(st);
        Ok(())
    }

    async fn save_track(&self, sub: &str, r: &mut SubRepl, now: bool) -> Result<(), BrokerError> {
        if let Some((saved, at)) = &r.saved {
            if *saved == r.track || (!now && at.elapsed() < TRACK_SAVE_INTERVAL) {
                return Ok(());
            }
        }
        let value = serde_json::to_vec(&r.track).expect("track serializes");
        self.meta.put(&self.repl_subs_key(sub), value).await?;
        r.saved = Some((r.track.clone(), Instant::now()));
        Ok(())
    }

    /// Starts the topic's sync loop unless it runs.
    pub(in crate::broker) fn ensure_sub_sync(self: &Arc<Self>) {
        if self.repl_closed.load(Ordering::Acquire) {
            return;
        }
        if !self.repl_subs.running.swap(true, Ordering::AcqRel) {
            tokio::spawn(sub_sync_loop(Arc::clone(self)));
        }
    }

    /// The open subscription `name`, opened (without consumers) if it is durable and not;
    /// `Ok(None)` when it does not exist (any more).
    async fn replicated_handle(
        self: &Arc<Self>,
        name: &str,
    ) -> Result<Option<Arc<Subscription>>, BrokerError> {
        match self.subscription_for_admin(name).await {
            Ok(s) => Ok(Some(s)),
            Err(e) if e.code == ServerError::SubscriptionNotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Starts the sync loop of a topic that replicates and has replicated subscriptions
    /// (the policy beat calls it; the loop ends when there are none).
    pub(in crate::broker) async fn ensure_sub_sync_if_any(self: &Arc<Self>) {
        if self.repl_subs.running.load(Ordering::Acquire) {
            return;
        }
        let any = {
            let mut st = self.repl_subs.state.lock().await;
            if let Err(e) = self.load_replicated(&mut st).await {
                tracing::debug!(topic = %self.full_name, error = %e, "reading the replicated subscriptions");
            }
            !st.subs.is_empty()
        };
        if any {
            self.ensure_sub_sync();
        }
    }

    /// Origins of the entries from `from` on (`count` of them), read where not cached.
    async fn read_origins(
        &self,
        cache: &mut BTreeMap<Position, EntryOrigin>,
        from: Position,
        count: usize,
    ) -> Result<Vec<(Position, EntryOrigin)>, BrokerError> {
        let mut out = Vec::with_capacity(count.min(READ_CHUNK));
        let mut next = Some(from);
        while let Some(p) = next {
            if out.len() >= count {
                break;
            }
            if let Some(o) = cache.get(&p) {
                out.push((p, o.clone()));
                next = self.ml.next_position(p).await;
                continue;
            }
            let want = (count - out.len()).min(READ_CHUNK);
            let read = self.ml.read_range(p, want).await?;
            let Some(last) = read.last().map(|r| r.0) else {
                break;
            };
            for (q, bytes) in &read {
                let o = entry_origin(*q, bytes);
                cache.insert(*q, o.clone());
                out.push((*q, o));
            }
            next = self.ml.next_position(last).await;
        }
        Ok(out)
    }

    /// Moves `r.track` to mark-delete position `md`: the highest origin of each other site up
    /// to it, from the entries between the last one read and it.
    async fn advance_track(
        &self,
        r: &mut SubRepl,
        md: Option<Position>,
    ) -> Result<(), BrokerError> {
        if md > r.track.md {
            let mut next = match r.track.md {
                Some(p) => self.ml.next_position(p).await,
                None => self.ml.first_position().await,
            };
            while let Some(p) = next.filter(|p| Some(*p) <= md) {
                let got = self.read_origins(&mut r.origins, p, READ_CHUNK).await?;
                let Some(last) = got.last().map(|g| g.0) else {
                    break;
                };
                for (q, o) in got {
                    if Some(q) > md {
                        break;
                    }
                    if let Some(site) = o.site {
                        let t = r.track.through.entry(site).or_insert(o.at);
                        *t = (*t).max(o.at);
                    }
                }
                next = self.ml.next_position(last).await;
            }
            r.track.md = md;
        }
        if let Some(md) = md {
            r.origins = r
                .origins
                .split_off(&Position::new(md.ledger_id, md.entry_id + 1));
        }
        Ok(())
    }

    /// The subscription's acknowledgements as every site reads them.
    async fn local_state(
        &self,
        sub: &Subscription,
        r: &mut SubRepl,
    ) -> Result<AckState, BrokerError> {
        let own = self.cfg.cluster_name.clone();
        let (md, ranges, batches) = sub.ack_state().await;
        self.advance_track(r, md).await?;
        let mut b = Builder::new(&own, md.map(opos), &r.track.through);
        for (lo, hi) in ranges {
            let n = (hi.entry_id - lo.entry_id + 1) as usize;
            for (_, o) in self.read_origins(&mut r.origins, lo, n).await? {
                b.acked(o.site.as_deref().unwrap_or(&own), o.at);
            }
        }
        for (p, bits) in batches {
            if let Some((_, o)) = self.read_origins(&mut r.origins, p, 1).await?.pop() {
                b.partial(o.site.as_deref().unwrap_or(&own), o.at, bits);
            }
        }
        Ok(b.finish())
    }

    /// What `incoming` (per sending site, its state) acknowledges of the entries after the
    /// subscription's mark-delete position, read in order from `from` (`None`: right after
    /// the mark-delete position): entries whole, batches partly; how many (sender, origin)
    /// parts speak of entries not here yet; and where a scan cut short by
    /// [`APPLY_SCAN_MAX`] stopped.
    async fn scan_incoming(
        &self,
        sub: &Subscription,
        incoming: &BTreeMap<String, AckState>,
        r: &mut SubRepl,
        from: Option<Position>,
    ) -> Result<Covered, BrokerError> {
        if crate::failpoint::hit("repl:slow_scan_5s") {
            tokio::time::sleep(std::time::Duration::from_secs(5)).await;
        }
        let own = self.cfg.cluster_name.clone();
        let (md, _, _) = sub.ack_state().await;
        self.advance_track(r, md).await?;
        // (sending site, origin site, the furthest entry the state speaks of), less those
        // whose furthest entry is at or before the mark-delete position (acknowledged here).
        let done_through = |origin: &str| -> Option<OPos> {
            if origin == own {
                md.map(opos)
            } else {
                r.track.through.get(origin).copied()
            }
        };
        let parts: Vec<(String, String, OPos)> = incoming
            .iter()
            .flat_map(|(from, s)| {
                s.origins
                    .iter()
                    .filter_map(|(o, a)| Some((from.clone(), o.clone(), a.reach()?)))
            })
            .filter(|(_, o, reach)| done_through(o).is_none_or(|d| *reach > d))
            .collect();
        let mut open = parts.clone();
        let mut out = Covered::default();
        for (_, origin, _) in &parts {
            if *origin != own && !out.holds.contains_key(origin) {
                let have = self.held_origin_pos(origin).await?;
                out.holds.insert(origin.clone(), have);
            }
        }
        let mut next = match (from, md) {
            (Some(f), Some(m)) if f > m => Some(f),
            (Some(f), None) => Some(f),
            (_, Some(p)) => self.ml.next_position(p).await,
            (_, None) => self.ml.first_position().await,
        };
        let mut scanned = 0;
        while let Some(p) = next {
            if open.is_empty() {
                break;
            }
            if scanned >= APPLY_SCAN_MAX {
                out.stopped_at = Some(p);
                break;
            }
            let got = self.read_origins(&mut r.origins, p, READ_CHUNK).await?;
            let Some(last) = got.last().map(|g| g.0) else {
                break;
            };
            scanned += got.len();
            for (q, o) in got {
                let site = o.site.as_deref().unwrap_or(&own);
                let mut bits: Option<Vec<u64>> = None;
                let mut is_whole = false;
                for (from, state) in incoming {
                    if !held_by(from, site, &o.replicate_to) {
                        continue;
                    }
                    match state.origin(site).map(|a| a.cover(o.at)) {
                        Some(Cover::Whole) => is_whole = true,
                        Some(Cover::Partial(b)) => {
                            bits = Some(match bits {
                                None => b.to_vec(),
                                Some(mut mine) => {
                                    for (i, w) in mine.iter_mut().enumerate() {
                                        *w &= b.get(i).copied().unwrap_or(0);
                                    }
                                    mine
                                }
                            })
                        }
                        _ => {}
                    }
                }
                if is_whole {
                    out.whole.push((q, o.messages));
                } else if let Some(b) = bits {
                    out.partial.push((q, b));
                }
                // The furthest entry a state speaks of is here: the scan need not go on for it.
                open.retain(|(_, origin, reach)| !(origin == site && o.at >= *reach));
            }
            next = self.ml.next_position(last).await;
        }
        // Held: what speaks of entries this site does not have (yet), by what it holds of
        // each origin, not by how far the scan went.
        let last_here = self.ml.last_confirmed().map(opos);
        let mut held = 0;
        for (_, origin, reach) in &parts {
            let have = if *origin == own {
                last_here
            } else {
                self.held_origin_pos(origin).await?
            };
            if have.is_none_or(|h| *reach > h) {
                held += 1;
            }
        }
        out.held = held;
        Ok(out)
    }

    /// Applies what the other sites said to the subscription. Returns the entries it
    /// acknowledged or changed; `r.held` is what waits for entries to come.
    async fn apply_incoming(
        &self,
        sub: &Subscription,
        r: &mut SubRepl,
    ) -> Result<u64, BrokerError> {
        r.applied_to = self.ml.last_confirmed();
        let incoming = std::mem::take(&mut r.incoming);
        let from = r.scan_from.take();
        let c = self.scan_incoming(sub, &incoming, r, from).await;
        r.incoming = incoming;
        let c = c?;
        r.held = c.held;
        r.applied_holds = c.holds;
        // Cut short: the next apply goes on from there (and then starts over).
        r.scan_from = c.stopped_at;
        let whole: Vec<Position> = c.whole.iter().map(|w| w.0).collect();
        sub.apply_remote(&whole, &c.partial).await
    }

    /// What applying `state` from `origin` (beside what is held already) would acknowledge
    /// here that is not: entries and messages. Changes nothing.
    async fn measure_incoming(
        &self,
        sub: &Subscription,
        r: &mut SubRepl,
        origin: &str,
        state: &AckState,
    ) -> Result<(u64, u64), BrokerError> {
        let mut incoming = r.incoming.clone();
        incoming.entry(origin.to_string()).or_default().merge(state);
        let c = self.scan_incoming(sub, &incoming, r, None).await?;
        let (mut entries, mut messages) = (0, 0);
        for (p, n) in c.whole {
            let left = sub.unacked_messages(p, n, None).await;
            if left > 0 {
                entries += 1;
                messages += left;
            }
        }
        for (p, bits) in c.partial {
            let n = self
                .read_origins(&mut r.origins, p, 1)
                .await?
                .first()
                .map_or(0, |o| o.1.messages);
            let left = sub.unacked_messages(p, n, Some(&bits)).await;
            if left > 0 {
                entries += 1;
                messages += left;
            }
        }
        Ok((entries, messages))
    }

    /// Site `origin`'s SubSync for this topic: merged and applied; the answer's document.
    pub(in crate::broker) async fn take_sub_sync(
        self: &Arc<Self>,
        origin: &str,
        doc: &[u8],
    ) -> Result<bytes::Bytes, Refusal> {
        let doc: SyncDoc = serde_json::from_slice(doc).map_err(|e| {
            Refusal::new(
                RefusalCode::Protocol,
                format!("subscription sync document: {e}"),
            )
        })?;
        let retry = |e: BrokerError| Refusal::new(RefusalCode::Retry, e.to_string());
        let mut answer = SyncedDoc::default();
        for s in doc.subs {
            if s.name.is_empty()
                || s.name.starts_with(REPL_CURSOR_PREFIX)
                || s.name == super::super::compaction::COMPACTION_SUBSCRIPTION
            {
                return Err(Refusal::new(
                    RefusalCode::Protocol,
                    format!("{:?} is not a subscription name", s.name),
                ));
            }
            if doc.measure {
                s.state.check().map_err(|e| {
                    Refusal::new(
                        RefusalCode::Protocol,
                        format!("subscription {}: {e}", s.name),
                    )
                })?;
                answer
                    .subs
                    .push(self.measure_one(origin, s).await.map_err(retry)?);
                continue;
            }
            s.state.check().map_err(|e| {
                Refusal::new(
                    RefusalCode::Protocol,
                    format!("subscription {}: {e}", s.name),
                )
            })?;
            let disabled = {
                let mut st = self.repl_subs.state.lock().await;
                self.load_replicated(&mut st).await.map_err(retry)?;
                st.disabled.contains(&s.name)
            };
            if disabled {
                answer.subs.push(SubAnswer {
                    name: s.name,
                    applied: 0,
                    held: 0,
                    entries: 0,
                    messages: 0,
                    missing: false,
                    ignored: true,
                });
                continue;
            }
            // The subscription exists here from now on, and is replicated too (so what its
            // consumers here acknowledge goes back).
            self.create_subscription(&s.name).await.map_err(retry)?;
            self.enable_replicated(&s.name).await.map_err(retry)?;
            let Some(sub) = self.replicated_handle(&s.name).await.map_err(retry)? else {
                return Err(Refusal::new(
                    RefusalCode::Retry,
                    format!("subscription {} is not open", s.name),
                ));
            };
            let Some(entry) = self.sub_entry(&s.name).await.map_err(retry)? else {
                return Err(Refusal::new(
                    RefusalCode::Retry,
                    format!("subscription {} was deleted meanwhile", s.name),
                ));
            };
            let mut r = entry.work.lock().await;
            r.incoming
                .entry(origin.to_string())
                .or_default()
                .merge(&s.state);
            let applied = self.apply_incoming(&sub, &mut r).await.map_err(retry)?;
            answer.subs.push(SubAnswer {
                name: s.name,
                applied,
                held: r.held,
                entries: 0,
                messages: 0,
                missing: false,
                ignored: false,
            });
        }
        if doc.measure {
            answer.holds = self.held_origin(origin).await?.map(|p| (p.ledger, p.entry));
            if let Some(d) = &self.dedup {
                answer.held_ids = d.held_within(&doc.ids).await;
            }
        }
        Ok(serde_json::to_vec(&answer)
            .expect("answer serializes")
            .into())
    }

    /// Every replicated subscription's state as it is now (for a drill's measure).
    pub(super) async fn replicated_states(self: &Arc<Self>) -> Result<Vec<SubDoc>, BrokerError> {
        let mut out = Vec::new();
        for (name, entry) in self.sub_entries().await? {
            let Some(sub) = self.replicated_handle(&name).await? else {
                continue;
            };
            let mut r = entry.work.lock().await;
            out.push(SubDoc {
                state: self.local_state(&sub, &mut r).await?,
                name,
            });
        }
        Ok(out)
    }

    /// A drill's measure of one subscription's state from `origin`: what applying it would
    /// acknowledge here (nothing is applied, nothing created).
    async fn measure_one(
        self: &Arc<Self>,
        origin: &str,
        s: SubDoc,
    ) -> Result<SubAnswer, BrokerError> {
        let mut answer = SubAnswer {
            name: s.name.clone(),
            applied: 0,
            held: 0,
            entries: 0,
            messages: 0,
            missing: false,
            ignored: false,
        };
        let exists = self.durable_subscriptions().await?.contains(&s.name)
            || self.subscriptions.lock().await.contains_key(&s.name);
        let Some(sub) = exists
            .then_some(())
            .map(|_| self.replicated_handle(&s.name))
        else {
            answer.missing = true;
            return Ok(answer);
        };
        let Some(sub) = sub.await? else {
            answer.missing = true;
            return Ok(answer);
        };
        let (entries, messages) = match self.sub_entry(&s.name).await? {
            Some(e) => {
                let mut r = e.work.lock().await;
                self.measure_incoming(&sub, &mut r, origin, &s.state)
                    .await?
            }
            None => {
                self.measure_incoming(&sub, &mut SubRepl::default(), origin, &s.state)
                    .await?
            }
        };
        answer.entries = entries;
        answer.messages = messages;
        Ok(answer)
    }

    /// Whether every replicated subscription here has applied what the other sites said of
    /// the entries this site holds: nothing held, or the last apply saw the whole log (what
    /// it still holds speaks of entries not here). Else which has not (a drill's measure of
    /// when the subscriptions' positions are in place at the site it cut over to).
    ///
    /// What a state holds can only be applied to entries of other sites that came since
    /// (this site's own are all here), so entries produced here meanwhile do not count.
    pub(crate) async fn subscriptions_applied(&self) -> Result<(), String> {
        let entries = self.repl_subs.state.lock().await.entries();
        for (name, entry) in entries {
            let (held, holds) = {
                let r = entry.work.lock().await;
                if r.scan_from.is_some() {
                    return Err(format!(
                        "subscription {name} of {}: applying the other sites' states goes on",
                        self.full_name
                    ));
                }
                (r.held, r.applied_holds.clone())
            };
            if held == 0 {
                continue;
            }
            for (origin, then) in &holds {
                let now = self
                    .held_origin_pos(origin)
                    .await
                    .map_err(|e| e.to_string())?;
                if now != *then {
                    return Err(format!(
                        "subscription {name} of {} has {held} parts of other sites' states to apply to entries that came from {origin}",
                        self.full_name
                    ));
                }
            }
        }
        Ok(())
    }

    /// [`Topic::held_origin`] as a position pair, its refusal as a broker error.
    async fn held_origin_pos(&self, origin: &str) -> Result<Option<OPos>, BrokerError> {
        Ok(self
            .held_origin(origin)
            .await
            .map_err(|e| BrokerError::new(ServerError::ServiceNotReady, e.reason))?
            .map(|p| (p.ledger, p.entry)))
    }

    /// Each replicated subscription's sync with each remote, for `topics stats`.
    pub(crate) async fn replicated_sub_stats(&self) -> BTreeMap<String, Vec<SubSyncStats>> {
        let entries = self.repl_subs.state.lock().await.entries();
        let subs = self.subscriptions.lock().await.clone();
        let mut out = BTreeMap::new();
        for (name, entry) in entries {
            let sub = subs.get(&name);
            let acks = sub.map_or(0, |s| s.acks_total.load(Ordering::Relaxed));
            let version = sub.map_or(0, |s| s.ack_version.load(Ordering::Acquire));
            let list = entry
                .remotes()
                .iter()
                .map(|(remote, rs)| SubSyncStats {
                    remote: remote.clone(),
                    pending_acks: acks.saturating_sub(rs.confirmed_acks),
                    pending_ms: sub
                        .filter(|_| rs.confirmed < version)
                        .and_then(|s| s.changed_after(rs.confirmed))
                        .map_or(0, |t| t.elapsed().as_millis() as u64),
                    held: rs.held,
                    error: rs.error.clone(),
                })
                .collect();
            out.insert(name.clone(), list);
        }
        out
    }

    /// One round of the sync loop: held states applied again where entries came, and
    /// states that changed sent.
    async fn sync_round(self: &Arc<Self>, link: &Arc<GeoLink>) -> Result<(), BrokerError> {
        let remotes: Vec<String> = self
            .replicators
            .lock()
            .expect("replicators lock")
            .keys()
            .cloned()
            .collect();
        let now = Instant::now();
        let mut sending: BTreeMap<String, Outgoing> = BTreeMap::new();
        let entries = self.sub_entries().await?;
        if entries.is_empty() {
            return Err(BrokerError::new(
                ServerError::SubscriptionNotFound,
                "no replicated subscription",
            ));
        }
        let mut ats: BTreeMap<String, String> = BTreeMap::new();
        for (name, entry) in &entries {
            let sub = match self.replicated_handle(name).await {
                Ok(Some(s)) => s,
                Ok(None) => {
                    // Deleted without this broker seeing it (by another owner).
                    let mut st = self.repl_subs.state.lock().await;
                    if st.subs.get(name).is_some_and(|e| Arc::ptr_eq(e, entry)) {
                        st.subs.remove(name);
                        self.repl_subs.note(&st);
                        self.disable_record(&mut st, name).await;
                    }
                    continue;
                }
                Err(e) => {
                    tracing::debug!(topic = %self.full_name, subscription = %name, error = %e, "replicated subscription not open");
                    continue;
                }
            };
            let mut r = entry.work.lock().await;
            if (r.held > 0 && self.ml.last_confirmed() != r.applied_to) || r.scan_from.is_some() {
                self.apply_incoming(&sub, &mut r).await?;
            }
            let version = sub.ack_version.load(Ordering::Acquire);
            let acks = sub.acks_total.load(Ordering::Relaxed);
            let due: Vec<String> = {
                let mut rems = entry.remotes();
                rems.retain(|k, _| remotes.contains(k));
                for (remote, rs) in rems.iter() {
                    if let Some(at) = &rs.at {
                        ats.entry(remote.clone()).or_insert_with(|| at.clone());
                    }
                }
                remotes
                    .iter()
                    .filter(|remote| {
                        let rs = rems.entry((*remote).clone()).or_default();
                        let waited = rs.next.is_none_or(|t| now >= t);
                        (rs.confirmed < version && rs.error.is_none()) || waited
                    })
                    .cloned()
                    .collect()
            };
            if due.is_empty() {
                continue;
            }
            let state = self.local_state(&sub, &mut r).await?;
            {
                // Under the map's lock, and only while the subscription is still this one:
                // a deletion or a disabling writes its record under that lock, and a record
                // written after it would make the subscription replicated again.
                let st = self.repl_subs.state.lock().await;
                if st.subs.get(name).is_some_and(|e| Arc::ptr_eq(e, entry)) {
                    if let Err(e) = self.save_track(name, &mut r, false).await {
                        tracing::debug!(topic = %self.full_name, subscription = %name, error = %e, "saving a replicated subscription's record");
                    }
                }
            }
            for remote in due {
                let e = sending.entry(remote).or_default();
                e.0.push(SubDoc {
                    name: name.clone(),
                    state: state.clone(),
                });
                e.1.push((name.clone(), version, acks));
            }
        }
        if sending.is_empty() {
            return Ok(());
        }
        let sends = sending.into_iter().map(|(remote, (subs, sent))| {
            let at = ats.get(&remote).cloned();
            let doc = serde_json::to_vec(&SyncDoc {
                subs,
                measure: false,
                ids: BTreeMap::new(),
            })
            .expect("sync doc serializes");
            let link = Arc::clone(link);
            let topic = self.full_name.clone();
            async move {
                let res = meridian_geo::subsync::send_sub_sync(
                    &link,
                    &remote,
                    at,
                    &topic,
                    doc.into(),
                    SEND_TIMEOUT,
                )
                .await;
                (remote, sent, res)
            }
        });
        let results = futures::future::join_all(sends).await;
        let entries: BTreeMap<String, Arc<SubEntry>> = entries.into_iter().collect();
        let subs = self.subscriptions.lock().await.clone();
        let now = Instant::now();
        for (remote, sent, res) in results {
            let answer = match &res {
                Ok((doc, _)) => serde_json::from_slice::<SyncedDoc>(doc).ok(),
                Err(_) => None,
            };
            for (name, version, acks) in sent {
                let Some(entry) = entries.get(&name) else {
                    continue;
                };
                let mut rems = entry.remotes();
                let Some(rs) = rems.get_mut(&remote) else {
                    continue;
                };
                match (&res, &answer) {
                    (Ok((_, at)), Some(a)) => {
                        let held = a.subs.iter().find(|s| s.name == name).map_or(0, |s| s.held);
                        if version > rs.confirmed {
                            // From the oldest acknowledgement newly confirmed to its confirmation.
                            let first = subs.get(&name).and_then(|s| s.changed_after(rs.confirmed));
                            if let Some(t) = first {
                                metrics::histogram!(
                                    "meridian_replicated_subscription_sync_seconds",
                                    "remote" => remote.clone()
                                )
                                .record(now.duration_since(t).as_secs_f64());
                            }
                        }
                        rs.confirmed = rs.confirmed.max(version);
                        rs.confirmed_acks = rs.confirmed_acks.max(acks);
                        rs.held = held;
                        rs.at = at.clone();
                        rs.error = None;
                        rs.next = Some(now + if held > 0 { RESEND_HELD } else { RESEND });
                    }
                    (Ok(_), None) => {
                        rs.error = Some(format!(
                            "{remote} answered a document this site cannot read"
                        ));
                        rs.next = Some(now + RETRY);
                    }
                    (Err(e), _) => {
                        if rs.error.is_none() {
                            tracing::info!(topic = %self.full_name, subscription = %name, remote, error = ?e, "replicated subscription: sending its acknowledgements failed; retrying");
                        }
                        rs.error = Some(format!("{e:?}"));
                        rs.next = Some(now + RETRY);
                    }
                }
            }
        }
        Ok(())
    }
}

/// A topic's replicated subscriptions looked at every `geo.subscription_sync_interval_ms`
/// until the topic closes.
async fn sub_sync_loop(topic: Arc<Topic>) {
    let every = topic
        .broker
        .upgrade()
        .and_then(|b| b.geo.get().map(|l| l.subscription_sync_interval()))
        .unwrap_or(SYNC_INTERVAL);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if topic.repl_closed.load(Ordering::Acquire) {
            break;
        }
        let Some(link) = topic
            .broker
            .upgrade()
            .and_then(|b| b.geo.get().map(Arc::clone))
        else {
            continue;
        };
        match topic.sync_round(&link).await {
            Ok(()) => {}
            // None left: the loop ends (started again by the next one).
            Err(e) if e.code == ServerError::SubscriptionNotFound => break,
            Err(e) => {
                tracing::debug!(topic = %topic.full_name, error = %e, "replicated subscriptions: a sync round failed")
            }
        }
    }
    topic.repl_subs.running.store(false, Ordering::Release);
}
