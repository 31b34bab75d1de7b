//! Message deduplication by producer name and sequence id (Pulsar's semantics).
//!
//! Per producer name a topic keeps the highest sequence id *pushed* (accepted, perhaps still
//! in flight) and the highest *persisted* (durable). A SEND whose first sequence id is at most
//! the persisted one is a duplicate: it is not stored and is answered with a receipt at
//! (-1, -1). At most the pushed one but above the persisted one, its fate is not known yet:
//! it fails with PersistenceError, so the client reconnects and resends, and by then it is
//! one or the other.
//!
//! ```text
//!  submit (under the lock): check ─► append_queued ─► ticket t (ML order = ticket order)
//!  receipt task: durable at p ─► record(t, p): persisted[name] = max(.., highest)
//!                                 tickets done in a row ─► "recorded up to" S
//!  every `deduplication_snapshot_entries`: /topic-dedup/<log> = {S, persisted}
//!  topic load: snapshot, then replay the entries after S (their metadata carry name and ids)
//! ```
//!
//! The snapshot's position S is one up to which *every* entry has been recorded, although
//! producers' receipt tasks record out of order; replaying from S is therefore enough, and
//! replaying an entry twice is harmless (a maximum).
//!
//! A producer name is one producer across the sites of a replicated topic (as Pulsar's
//! deduplication reads a replicated message's original producer name): entries that came by
//! geo-replication count as held under their producer's name, and are themselves checked
//! before they are appended, by the ranges of ids held ([`held`]), so that a producer's
//! sends that were in flight when it moved to another site are stored once at every site.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use meridian_metadata::MetadataClient;
use meridian_protocol::batch::BatchIter;
use meridian_protocol::pb::ServerError;
use meridian_protocol::Entry;
use meridian_storage::managed_ledger::{ManagedLedger, PendingAppend, Position, Queued};
use serde::{Deserialize, Serialize};

use super::BrokerError;

pub mod held;
pub use held::HeldIds;

/// Queues `entry` in `ml`, only into ledger `only_in` if given: the entry comes back
/// (`Err`) when that ledger takes no more.
pub(crate) async fn queue_entry(
    ml: &Arc<ManagedLedger>,
    entry: Entry,
    only_in: Option<u64>,
) -> Result<Result<PendingAppend, Entry>, BrokerError> {
    Ok(
        match ml.queue_in(entry.as_bytes().clone(), only_in).await? {
            Some(pa) => Ok(pa),
            None => Err(entry),
        },
    )
}

/// Where deduplication snapshots live, by managed-ledger name.
pub const DEDUP_PREFIX: &str = "/topic-dedup/";

/// Entries read at once while replaying after the snapshot.
const REPLAY_BATCH: usize = 500;

/// What the sequence ids of a stored entry say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntrySequence {
    pub producer: String,
    /// The SEND's sequence id (a batch's first message).
    pub first: i64,
    /// The last message's: from `highest_sequence_id`, the last batch item, or first + n - 1.
    pub highest: i64,
    /// A chunk other than its message's last: not checked (all chunks share the id).
    pub partial_chunk: bool,
}

/// Reads producer name and sequence ids from an entry; `None` for markers and entries
/// without a producer.
pub fn entry_sequence(entry: &Entry) -> Option<EntrySequence> {
    let m = entry.metadata().ok()?;
    if m.marker_type.is_some() || m.producer_name.is_empty() {
        return None;
    }
    let first = m.sequence_id as i64;
    let mut highest = first.max(m.highest_sequence_id.map_or(-1, |h| h as i64));
    if let Some(n) = m.num_messages_in_batch {
        let from_items = if m.compression.unwrap_or(0) == 0 {
            BatchIter::new(entry.payload())
                .map_while(Result::ok)
                .last()
                .and_then(|it| it.decode_metadata().ok())
                .and_then(|s| s.sequence_id)
                .map(|s| s as i64)
        } else {
            None
        };
        highest = highest.max(from_items.unwrap_or(first + i64::from(n.max(1)) - 1));
    }
    let partial_chunk = matches!(
        (m.chunk_id, m.num_chunks_from_msg),
        (Some(id), Some(n)) if id < n - 1
    );
    Some(EntrySequence {
        producer: m.producer_name,
        first,
        highest,
        partial_chunk,
    })
}

#[derive(Debug, Serialize, Deserialize)]
struct Snapshot {
    /// Every entry up to here is in `producers` (absent: none recorded yet).
    ledger_id: Option<u64>,
    entry_id: Option<u64>,
    /// Per name its highest id (a plain number, as brokers before ranges read it).
    producers: HashMap<String, i64>,
    /// Per name the ranges of ids held (absent: everything up to its highest).
    #[serde(default, skip_serializing_if = "HashMap::is_empty")]
    held: HashMap<String, HeldIds>,
    /// A map too large for one metadata value is in `pages` values
    /// `<key>/<generation>/<i>`, written before this head; the head names its generation,
    /// so a snapshot cut short leaves the previous one whole. Absent in small snapshots
    /// (and in those written before pages).
    #[serde(default, skip_serializing_if = "is_zero")]
    pages: u32,
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    generation: u64,
}

/// A name's state in a snapshot: its highest persisted id, with the ranges of ids held
/// (a bare number: a snapshot from before ranges were kept).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
enum NameState {
    Full { seq: i64, held: HeldIds },
    Seq(i64),
}

impl NameState {
    fn split(self) -> (i64, HeldIds) {
        match self {
            NameState::Full { seq, held } => (seq, held),
            NameState::Seq(seq) => (seq, HeldIds::through(seq)),
        }
    }
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

/// Bytes of producer map per metadata value (the store takes 1 MiB by default).
const SNAPSHOT_PAGE_BYTES: usize = 256 << 10;

/// A snapshot as the head value and its pages (none when it fits in one value).
fn encode_snapshot(
    recorded_upto: Option<Position>,
    persisted: &HashMap<String, i64>,
    held: &HashMap<String, HeldIds>,
    generation: u64,
) -> (Bytes, Vec<Bytes>) {
    let mut pages: Vec<Bytes> = Vec::new();
    let mut page: HashMap<&str, NameState> = HashMap::new();
    let mut page_bytes = 0;
    for (name, seq) in persisted {
        let held = held
            .get(name)
            .cloned()
            .unwrap_or_else(|| HeldIds::through(*seq));
        let n = name.len() + 40 + 44 * held.ranges().len();
        if page_bytes + n > SNAPSHOT_PAGE_BYTES && !page.is_empty() {
            pages.push(Bytes::from(
                serde_json::to_vec(&page).expect("page serialises"),
            ));
            page.clear();
            page_bytes = 0;
        }
        page.insert(name, NameState::Full { seq: *seq, held });
        page_bytes += n;
    }
    let paged = !pages.is_empty();
    if paged && !page.is_empty() {
        pages.push(Bytes::from(
            serde_json::to_vec(&page).expect("page serialises"),
        ));
    }
    let (producers, held) = if paged {
        (HashMap::new(), HashMap::new())
    } else {
        let mut producers = HashMap::with_capacity(page.len());
        let mut held = HashMap::new();
        for (name, state) in page {
            let (seq, ids) = state.split();
            producers.insert(name.to_string(), seq);
            if ids != HeldIds::through(seq) {
                held.insert(name.to_string(), ids);
            }
        }
        (producers, held)
    };
    let head = Snapshot {
        ledger_id: recorded_upto.map(|p| p.ledger_id),
        entry_id: recorded_upto.map(|p| p.entry_id),
        producers,
        held,
        pages: pages.len() as u32,
        generation: if paged { generation } else { 0 },
    };
    let head = Bytes::from(serde_json::to_vec(&head).expect("snapshot serialises"));
    (head, pages)
}

/// A snapshot ready to write.
struct EncodedSnapshot {
    head: Bytes,
    pages: Vec<Bytes>,
    generation: u64,
}

impl EncodedSnapshot {
    async fn write(self, meta: &MetadataClient, key: &str) {
        let pages = self.pages.len();
        if let Err(e) = write_snapshot(meta, key, self.head, self.pages, self.generation).await {
            tracing::warn!(key = %key, pages, error = %e, "deduplication snapshot failed");
        }
    }
}

/// Where page `i` of generation `g` of the snapshot at `key` lives.
fn page_key(key: &str, generation: u64, i: u32) -> String {
    format!("{key}/{generation:020}/{i:06}")
}

/// Writes a snapshot: its pages first, then the head, then removes every other
/// generation's pages (a crash leaves the previous snapshot whole, or spare pages that the
/// next snapshot removes).
async fn write_snapshot(
    meta: &MetadataClient,
    key: &str,
    head: Bytes,
    pages: Vec<Bytes>,
    generation: u64,
) -> Result<(), meridian_metadata::client::ClientError> {
    let n = pages.len() as u32;
    for (i, p) in pages.into_iter().enumerate() {
        meta.put(&page_key(key, generation, i as u32), p).await?;
    }
    meta.put(key, head).await?;
    let keep = (n > 0).then(|| format!("{key}/{generation:020}/"));
    delete_pages(meta, key, keep.as_deref()).await
}

/// Deletes the snapshot pages under `key`, but those starting with `keep`.
pub async fn delete_pages(
    meta: &MetadataClient,
    key: &str,
    keep: Option<&str>,
) -> Result<(), meridian_metadata::client::ClientError> {
    let prefix = format!("{key}/");
    let mut after = String::new();
    loop {
        let page = meta.list(&prefix, &after, 0).await?;
        for kv in &page.kvs {
            if keep.is_none_or(|k| !kv.key.starts_with(k)) {
                meta.delete(&kv.key, None).await?;
            }
        }
        match page.kvs.last() {
            Some(last) if page.more => after = last.key.clone(),
            _ => return Ok(()),
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum TicketState {
    Pending,
    Done(Position),
    Failed,
}

#[derive(Default)]
struct Inner {
    pushed: HashMap<String, i64>,
    persisted: HashMap<String, i64>,
    next_ticket: u64,
    inflight: BTreeMap<u64, TicketState>,
    recorded_upto: Option<Position>,
    since_snapshot: u64,
    /// When each name last sent or attached (ms since the epoch; recovered names: when the
    /// topic loaded).
    last_active_ms: HashMap<String, u64>,
    /// The ticket of each name's latest push (what `pushed` holds came with it).
    last_push: HashMap<String, u64>,
    /// The ids held of each name, stored here or replicated here (durable).
    held: HashMap<String, HeldIds>,
    /// Replicated entries queued and not yet recorded, by ticket: (name, first, highest).
    /// Their ids may be below `pushed`, which then does not show them.
    replicas_in_flight: HashMap<u64, (String, i64, i64)>,
}

impl Inner {
    /// Forgets names that neither sent nor attached for `inactivity_ms`, are not attached
    /// now, and have nothing in flight (as Pulsar's
    /// `brokerDeduplicationProducerInactivityTimeoutMinutes`). Returns them.
    fn expire(
        &mut self,
        now_ms: u64,
        inactivity_ms: u64,
        attached: &dyn Fn(&str) -> bool,
    ) -> Vec<String> {
        let idle: Vec<String> = self
            .persisted
            .keys()
            .chain(self.pushed.keys())
            .filter(|n| {
                let last = self.last_active_ms.get(*n).copied().unwrap_or(0);
                now_ms.saturating_sub(last) >= inactivity_ms
                    && !attached(n)
                    && self.pushed.get(*n) == self.persisted.get(*n)
            })
            .cloned()
            .collect::<std::collections::BTreeSet<String>>()
            .into_iter()
            .collect();
        for n in &idle {
            self.persisted.remove(n);
            self.pushed.remove(n);
            self.last_active_ms.remove(n);
            self.last_push.remove(n);
            self.held.remove(n);
        }
        idle
    }

    /// A checked send of `producer` up to `highest`, submitted as ticket `id`.
    fn push(&mut self, producer: &str, id: u64, highest: i64) {
        self.pushed.insert(producer.to_string(), highest);
        self.last_push.insert(producer.to_string(), id);
    }

    /// Ids `first..=highest` of `producer` are durable here.
    fn persist(&mut self, producer: &str, first: i64, highest: i64) {
        // The name is copied only the first time (this runs for every send).
        match self.persisted.get_mut(producer) {
            Some(v) => *v = (*v).max(highest),
            None => {
                self.persisted.insert(producer.to_string(), highest.max(-1));
            }
        }
        match self.held.get_mut(producer) {
            Some(h) => h.insert(first, highest),
            None => {
                let mut h = HeldIds::default();
                h.insert(first, highest);
                self.held.insert(producer.to_string(), h);
            }
        }
    }

    /// What to do with a replicated entry of `s.producer`. A chunk other than its message's
    /// last is held when its message is (all its chunks share the id); else appended, not
    /// tracked (the last chunk is).
    fn check_replica(&self, s: &EntrySequence) -> ReplicaCheck {
        if self
            .held
            .get(&s.producer)
            .is_some_and(|h| h.covers(s.first, s.highest))
        {
            return ReplicaCheck::Held;
        }
        if s.partial_chunk {
            return ReplicaCheck::Fresh;
        }
        let overlaps = |&(ref name, first, highest): &(String, i64, i64)| {
            *name == s.producer && first <= s.highest && s.first <= highest
        };
        if let Some((_, first, highest)) = self.replicas_in_flight.values().find(|r| overlaps(r)) {
            return ReplicaCheck::Busy(format!(
                "sequence ids {first}..={highest} of {} are being written here from another site; send them again later",
                s.producer
            ));
        }
        let persisted = self.persisted.get(&s.producer).copied().unwrap_or(-1);
        let pushed = self.pushed.get(&s.producer).copied().unwrap_or(-1);
        if pushed > persisted && s.highest > persisted && s.first <= pushed {
            return ReplicaCheck::Busy(format!(
                "sequence ids {}..={} of {} are being written here; send them again later",
                s.first, s.highest, s.producer
            ));
        }
        ReplicaCheck::Fresh
    }

    /// Ticket `t` was not stored: what was pushed for its name falls back to what is durable,
    /// unless a later push of the name is in flight (its own outcome settles it; lowered now,
    /// a resend could be appended beside it, and stored twice if both land).
    fn not_stored(&mut self, t: &Ticket) {
        if self.last_push.get(&t.producer) != Some(&t.id) {
            return;
        }
        self.last_push.remove(&t.producer);
        match self.persisted.get(&t.producer).copied() {
            Some(p) => self.pushed.insert(t.producer.clone(), p),
            None => self.pushed.remove(&t.producer),
        };
    }
}

/// A submitted entry's place in the deduplication order.
#[derive(Debug)]
pub struct Ticket {
    id: u64,
    producer: String,
    first: i64,
    highest: i64,
}

/// What to do with an entry that came by geo-replication, by its producer's ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicaCheck {
    /// Every id is held here already (stored here by the producer, or replicated before):
    /// not appended.
    Held,
    /// Some ids are in a send of the producer here whose outcome is not known yet: try later.
    Busy(String),
    /// Append it.
    Fresh,
}

/// The deduplication state held while a replicated entry is checked and queued, so that
/// tickets follow the log's order.
pub struct ReplicaGuard<'a>(tokio::sync::MutexGuard<'a, Inner>);

impl ReplicaGuard<'_> {
    pub fn check(&self, s: &EntrySequence) -> ReplicaCheck {
        self.0.check_replica(s)
    }

    /// The entry of `s` was queued: its ticket (the log's next); `None` for a chunk other
    /// than its message's last (not tracked). A local send of the same ids, or a replicated
    /// entry of them from another site, meanwhile waits for its outcome.
    pub fn ticket(&mut self, s: EntrySequence) -> Option<Ticket> {
        if s.partial_chunk {
            return None;
        }
        let g = &mut self.0;
        let id = g.next_ticket;
        g.next_ticket += 1;
        g.inflight.insert(id, TicketState::Pending);
        g.replicas_in_flight
            .insert(id, (s.producer.clone(), s.first, s.highest));
        if g.pushed.get(&s.producer).is_none_or(|&p| p < s.highest) {
            g.push(&s.producer, id, s.highest);
        }
        g.last_active_ms.insert(s.producer.clone(), super::now_ms());
        Some(Ticket {
            id,
            producer: s.producer,
            first: s.first,
            highest: s.highest,
        })
    }
}

/// The outcome of submitting a SEND to a deduplicating topic.
pub enum Submitted {
    Appended(PendingAppend, Option<Ticket>),
    /// Already persisted: answer with a receipt at (-1, -1).
    Duplicate,
    /// Not appended: the ledger it had to go to takes no more (`only_in`); nothing was
    /// recorded, and the entry comes back.
    NotThere(Entry),
}

/// A topic's deduplication state.
pub struct Dedup {
    meta: MetadataClient,
    key: String,
    snapshot_every: u64,
    inner: tokio::sync::Mutex<Inner>,
    snapshotting: Arc<AtomicBool>,
    /// Snapshots were stopped for good (`stop_snapshots`).
    stopped: AtomicBool,
    /// The generation of the last snapshot's pages; each snapshot writes the next.
    generation: Arc<std::sync::atomic::AtomicU64>,
    /// Replicated entries count under their producers' names and are checked (the
    /// namespace's own record deduplicates, so every site of it does).
    cross_site: bool,
}

impl Dedup {
    /// Loads the snapshot of `ml` and replays the entries after it.
    pub async fn recover(
        meta: MetadataClient,
        ml: &Arc<ManagedLedger>,
        snapshot_every: u64,
        cross_site: bool,
    ) -> Result<Dedup, BrokerError> {
        let started = std::time::Instant::now();
        let key = format!("{DEDUP_PREFIX}{}", ml.name());
        let mut inner = Inner::default();
        let snap: Option<Snapshot> = match meta.get(&key).await? {
            Some(kv) => Some(serde_json::from_slice(&kv.value).map_err(|e| {
                BrokerError::new(
                    ServerError::MetadataError,
                    format!("deduplication snapshot {key} is damaged: {e}"),
                )
            })?),
            None => None,
        };
        let mut from = ml.first_position().await;
        let mut generation = 0;
        if let Some(mut s) = snap {
            generation = s.generation;
            for i in 0..s.pages {
                let pk = page_key(&key, s.generation, i);
                let Some(kv) = meta.get(&pk).await? else {
                    return Err(BrokerError::new(
                        ServerError::MetadataError,
                        format!("deduplication snapshot {key} lacks its page {pk}"),
                    ));
                };
                let page: HashMap<String, NameState> =
                    serde_json::from_slice(&kv.value).map_err(|e| {
                        BrokerError::new(
                            ServerError::MetadataError,
                            format!("deduplication snapshot page {pk} is damaged: {e}"),
                        )
                    })?;
                for (name, state) in page {
                    let (seq, held) = state.split();
                    s.producers.insert(name.clone(), seq);
                    s.held.insert(name, held);
                }
            }
            for (name, seq) in s.producers {
                let held = s
                    .held
                    .remove(&name)
                    .unwrap_or_else(|| HeldIds::through(seq));
                inner.persisted.insert(name.clone(), seq);
                inner.held.insert(name, held);
            }
            if let (Some(l), Some(e)) = (s.ledger_id, s.entry_id) {
                let at = Position::new(l, e);
                inner.recorded_upto = Some(at);
                from = ml.next_position(at).await;
            }
        }
        let mut replayed = 0u64;
        while let Some(start) = from {
            let batch = ml.read_range(start, REPLAY_BATCH).await?;
            let Some((last, _)) = batch.last() else { break };
            let last = *last;
            for (pos, bytes) in batch {
                replayed += 1;
                inner.recorded_upto = Some(pos);
                let Ok(entry) = Entry::parse(bytes) else {
                    continue;
                };
                // Replicated entries too where a producer name is one producer across sites
                // (else they are other sites' producers).
                if !cross_site && entry.origin().ok().flatten().is_some() {
                    continue;
                }
                if let Some(seq) = entry_sequence(&entry).filter(|s| !s.partial_chunk) {
                    inner.persist(&seq.producer, seq.first, seq.highest);
                }
            }
            from = ml.next_position(last).await;
        }
        inner.pushed = inner.persisted.clone();
        let now = super::now_ms();
        inner.last_active_ms = inner.persisted.keys().map(|n| (n.clone(), now)).collect();
        tracing::info!(log = %ml.name(), producers = inner.persisted.len(), replayed, ms = started.elapsed().as_millis() as u64, "deduplication state recovered");
        Ok(Dedup {
            meta,
            key,
            snapshot_every,
            inner: tokio::sync::Mutex::new(inner),
            snapshotting: Arc::new(AtomicBool::new(false)),
            stopped: AtomicBool::new(false),
            generation: Arc::new(std::sync::atomic::AtomicU64::new(generation)),
            cross_site,
        })
    }

    /// Of the ranges of ids asked about per producer name, those held here (a drill's
    /// measure: sends stored at both sites are not lost with either).
    pub async fn held_within(
        &self,
        asked: &BTreeMap<String, Vec<(i64, i64)>>,
    ) -> BTreeMap<String, Vec<(i64, i64)>> {
        let mut out = BTreeMap::new();
        if !self.cross_site {
            return out;
        }
        let g = self.inner.lock().await;
        for (name, ranges) in asked {
            let Some(held) = g.held.get(name) else {
                continue;
            };
            let parts: Vec<(i64, i64)> = ranges
                .iter()
                .flat_map(|&(lo, hi)| held.within(lo, hi))
                .collect();
            if !parts.is_empty() {
                out.insert(name.clone(), parts);
            }
        }
        out
    }

    /// Whether replicated entries are checked here (see `cross_site`).
    pub fn cross_site(&self) -> bool {
        self.cross_site
    }

    /// Holds the state while a replicated entry is checked and queued ([`ReplicaGuard`]);
    /// `None` where replicated entries are not checked (see `cross_site`).
    pub async fn replica(&self) -> Option<ReplicaGuard<'_>> {
        if !self.cross_site {
            return None;
        }
        Some(ReplicaGuard(self.inner.lock().await))
    }

    /// The highest persisted sequence id of `producer`, -1 if none (PRODUCER_SUCCESS). A
    /// producer attaching counts as activity of its name.
    pub async fn last_sequence_id(&self, producer: &str) -> i64 {
        let mut g = self.inner.lock().await;
        if g.persisted.contains_key(producer) {
            g.last_active_ms
                .insert(producer.to_string(), super::now_ms());
        }
        g.persisted.get(producer).copied().unwrap_or(-1)
    }

    /// Forgets producer names inactive for `inactivity_ms` that are not `attached`, and
    /// writes a snapshot without them. Returns how many went.
    pub async fn expire(
        &self,
        inactivity_ms: u64,
        attached: &(dyn Fn(&str) -> bool + Sync),
    ) -> usize {
        let (gone, snapshot) = {
            let mut g = self.inner.lock().await;
            let gone = g.expire(super::now_ms(), inactivity_ms, attached);
            let snapshot = (!gone.is_empty() && !self.snapshotting.swap(true, Ordering::AcqRel))
                .then(|| self.snapshot_of(&g));
            (gone, snapshot)
        };
        if let Some(s) = snapshot {
            s.write(&self.meta, &self.key).await;
            self.snapshotting.store(false, Ordering::Release);
        }
        if !gone.is_empty() {
            tracing::debug!(key = %self.key, producers = gone.len(), "inactive producer names forgotten");
        }
        gone.len()
    }

    /// Checks a SEND and, unless it is a duplicate, appends it. The lock is held across the
    /// check and the append into the open ledger, so that tickets follow the log's order;
    /// not while a new ledger is made (writable bookies awaited), after which the checks
    /// run again.
    /// `only_in`: append only into that ledger (where the producer's sends in flight went),
    /// else [`Submitted::NotThere`].
    pub async fn submit(
        &self,
        ml: &Arc<ManagedLedger>,
        producer: &str,
        send_highest: Option<u64>,
        entry: Entry,
        only_in: Option<u64>,
    ) -> Result<Submitted, BrokerError> {
        let seq = entry_sequence(&entry);
        let checked = seq.filter(|s| !s.partial_chunk && s.producer == producer);
        // A new ledger (writable bookies awaited, up to the log's window) is made without the
        // lock, which the receipts of earlier sends (`record`) and producers being created
        // (`last_sequence_id`) need meanwhile; then the checks run again under it.
        let mut made = false;
        let (mut g, pa) = loop {
            let g = self.inner.lock().await;
            if let Some(s) = &checked {
                let persisted = g.persisted.get(producer).copied().unwrap_or(-1);
                let pushed = g.pushed.get(producer).copied().unwrap_or(-1);
                if s.first <= persisted {
                    return Ok(Submitted::Duplicate);
                }
                if s.first <= pushed {
                    return Err(BrokerError::new(
                        ServerError::PersistenceError,
                        format!(
                            "sequence id {} of {producer} is still being written; resend it later",
                            s.first
                        ),
                    ));
                }
            }
            if made {
                // The log moved on again meanwhile (rarely): a ledger is made under the lock.
                match queue_entry(ml, entry, only_in).await? {
                    Ok(pa) => break (g, pa),
                    Err(entry) => return Ok(Submitted::NotThere(entry)),
                }
            }
            match ml.queue_in_open(entry.as_bytes().clone(), only_in).await? {
                Queued::Appended(pa) => break (g, pa),
                Queued::NotThere => return Ok(Submitted::NotThere(entry)),
                Queued::NeedsLedger => {
                    drop(g);
                    if !ml.make_writable(only_in).await? {
                        return Ok(Submitted::NotThere(entry));
                    }
                    made = true;
                }
            }
        };
        let id = g.next_ticket;
        g.next_ticket += 1;
        g.inflight.insert(id, TicketState::Pending);
        let first = checked.as_ref().map_or(i64::MIN, |s| s.first);
        let highest = checked.map(|s| {
            let h = s.highest.max(send_highest.map_or(-1, |h| h as i64));
            g.push(producer, id, h);
            h
        });
        if highest.is_some() {
            g.last_active_ms
                .insert(producer.to_string(), super::now_ms());
        }
        Ok(Submitted::Appended(
            pa,
            Some(Ticket {
                id,
                producer: producer.to_string(),
                first,
                highest: highest.unwrap_or(i64::MIN),
            }),
        ))
    }

    /// Records a submitted entry's outcome; takes a snapshot when enough entries passed.
    pub async fn record(&self, ticket: Ticket, outcome: Option<Position>) {
        let snapshot = {
            let mut g = self.inner.lock().await;
            g.replicas_in_flight.remove(&ticket.id);
            match outcome {
                Some(pos) => {
                    if ticket.highest != i64::MIN {
                        g.persist(&ticket.producer, ticket.first, ticket.highest);
                    }
                    g.inflight.insert(ticket.id, TicketState::Done(pos));
                }
                None => {
                    g.not_stored(&ticket);
                    g.inflight.insert(ticket.id, TicketState::Failed);
                }
            }
            while let Some((&id, &state)) = g.inflight.first_key_value() {
                match state {
                    TicketState::Pending => break,
                    TicketState::Done(pos) => {
                        g.recorded_upto = Some(pos);
                        g.since_snapshot += 1;
                    }
                    TicketState::Failed => {}
                }
                g.inflight.remove(&id);
            }
            if g.since_snapshot >= self.snapshot_every
                && !self.snapshotting.swap(true, Ordering::AcqRel)
            {
                g.since_snapshot = 0;
                Some(self.snapshot_of(&g))
            } else {
                None
            }
        };
        if let Some(s) = snapshot {
            let (meta, key, flag) = (
                self.meta.clone(),
                self.key.clone(),
                Arc::clone(&self.snapshotting),
            );
            tokio::spawn(async move {
                s.write(&meta, &key).await;
                flag.store(false, Ordering::Release);
            });
        }
    }

    /// The snapshot of `g`, as the next generation (taken under the snapshotting flag).
    fn snapshot_of(&self, g: &Inner) -> EncodedSnapshot {
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        let (head, pages) = encode_snapshot(g.recorded_upto, &g.persisted, &g.held, generation);
        EncodedSnapshot {
            head,
            pages,
            generation,
        }
    }

    /// Waits for a snapshot being written and starts no more (the topic is being deleted);
    /// a later [`flush`](Self::flush) writes nothing.
    pub async fn stop_snapshots(&self) {
        while self.snapshotting.swap(true, Ordering::AcqRel) {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        self.stopped.store(true, Ordering::Release);
    }

    /// Writes a snapshot now (topic close), after any in flight; nothing once snapshots were
    /// stopped (a deletion that failed after it closes the topic: a snapshot would undo the
    /// deletion's removal of the record, and the flag it waits for stays taken).
    pub async fn flush(&self) {
        if self.stopped.load(Ordering::Acquire) {
            return;
        }
        while self.snapshotting.swap(true, Ordering::AcqRel) {
            if self.stopped.load(Ordering::Acquire) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let s = self.snapshot_of(&*self.inner.lock().await);
        s.write(&self.meta, &self.key).await;
        self.snapshotting.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meridian_protocol::pb::{MessageMetadata, SingleMessageMetadata};
    use prost::Message as _;

    fn entry(meta: MessageMetadata, payload: &[u8]) -> Entry {
        Entry::build(&meta.encode_to_vec(), payload)
    }

    fn meta(name: &str, seq: u64) -> MessageMetadata {
        MessageMetadata {
            producer_name: name.into(),
            sequence_id: seq,
            publish_time: 1,
            ..Default::default()
        }
    }

    fn batch(items: &[(u64, &[u8])]) -> Vec<u8> {
        let mut out = Vec::new();
        for (seq, data) in items {
            let m = SingleMessageMetadata {
                payload_size: data.len() as i32,
                sequence_id: Some(*seq),
                ..Default::default()
            }
            .encode_to_vec();
            out.extend_from_slice(&(m.len() as u32).to_be_bytes());
            out.extend_from_slice(&m);
            out.extend_from_slice(data);
        }
        out
    }

    #[test]
    fn given_a_map_past_one_page_then_it_is_split_in_pages_that_hold_it_whole() {
        let small: HashMap<String, i64> = (0..10).map(|i| (format!("p{i}"), i)).collect();
        let mut held = HashMap::new();
        held.insert("p3".to_string(), HeldIds::default());
        held.get_mut("p3").unwrap().insert(1, 1);
        held.get_mut("p3").unwrap().insert(3, 3);
        let (head, pages) = encode_snapshot(Some(Position::new(3, 4)), &small, &held, 7);
        assert!(pages.is_empty());
        let h: Snapshot = serde_json::from_slice(&head).unwrap();
        assert_eq!((h.pages, h.generation), (0, 0));
        assert_eq!(
            h.producers, small,
            "plain numbers, as brokers before ranges read them"
        );
        assert_eq!(
            h.held.len(),
            1,
            "only names whose ids are not everything up to the highest"
        );
        assert_eq!(h.held["p3"].ranges(), &[(1, 1), (3, 3)]);
        let older: serde_json::Value = serde_json::from_slice(&head).unwrap();
        assert!(older["producers"]["p3"].is_i64());
        let big: HashMap<String, i64> = (0..20_000)
            .map(|i| (format!("producer-with-a-long-name-{i:040}"), i))
            .collect();
        let (head, pages) = encode_snapshot(Some(Position::new(3, 4)), &big, &HashMap::new(), 7);
        let h: Snapshot = serde_json::from_slice(&head).unwrap();
        assert!(h.producers.is_empty());
        assert_eq!(h.generation, 7);
        assert_eq!(h.pages as usize, pages.len());
        assert!(pages.len() > 3, "{} pages", pages.len());
        let mut back = HashMap::new();
        for p in &pages {
            assert!(p.len() < 1 << 20, "a page of {} bytes", p.len());
            let m: HashMap<String, NameState> = serde_json::from_slice(p).unwrap();
            back.extend(m.into_iter().map(|(k, v)| (k, v.split().0)));
        }
        assert_eq!(back, big);
        assert!(
            page_key("/topic-dedup/t/n/persistent/x", 7, 2)
                < page_key("/topic-dedup/t/n/persistent/x", 7, 10)
        );
    }

    #[test]
    fn given_a_failed_send_with_a_later_push_in_flight_then_pushed_waits_for_the_later_one() {
        let mut g = Inner::default();
        g.persisted.insert("p".into(), 0);
        g.push("p", 1, 1);
        g.push("p", 2, 2);
        let ticket = |id, highest| Ticket {
            id,
            producer: "p".into(),
            first: highest,
            highest,
        };
        g.not_stored(&ticket(1, 1));
        assert_eq!(g.pushed["p"], 2, "send 2 is still in flight");
        g.not_stored(&ticket(2, 2));
        assert_eq!(g.pushed["p"], 0, "back to what is durable");
        g.push("p", 3, 1);
        g.not_stored(&ticket(2, 2));
        assert_eq!(
            g.pushed["p"], 1,
            "a stale outcome leaves the new push alone"
        );
    }

    #[test]
    fn given_a_snapshot_from_before_ranges_then_its_names_hold_everything_up_to_their_highest() {
        let old = br#"{"ledger_id":3,"entry_id":4,"producers":{"p":41}}"#;
        let h: Snapshot = serde_json::from_slice(old).unwrap();
        assert_eq!(h.producers["p"], 41);
        assert!(h.held.is_empty());
        assert!(HeldIds::through(41).covers(0, 41));
        let page: HashMap<String, NameState> = serde_json::from_slice(br#"{"q":5}"#).unwrap();
        assert_eq!(page["q"], NameState::Seq(5));
    }

    fn seq(first: i64, highest: i64) -> EntrySequence {
        EntrySequence {
            producer: "p".into(),
            first,
            highest,
            partial_chunk: false,
        }
    }

    #[test]
    fn given_a_producer_that_moved_sites_then_replicated_entries_are_checked_by_the_ids_held() {
        let mut g = Inner::default();
        // 0..=99 came by replication; the producer moved here and resent from 101.
        g.persist("p", 0, 99);
        g.persist("p", 101, 180);
        assert_eq!(g.check_replica(&seq(100, 100)), ReplicaCheck::Fresh);
        assert_eq!(g.check_replica(&seq(101, 120)), ReplicaCheck::Held);
        assert_eq!(g.check_replica(&seq(50, 50)), ReplicaCheck::Held);
        assert_eq!(g.check_replica(&seq(181, 190)), ReplicaCheck::Fresh);
        // A send of 181..=190 in flight here: the replicated copy waits for its outcome.
        g.pushed.insert("p".into(), 190);
        assert!(matches!(
            g.check_replica(&seq(185, 185)),
            ReplicaCheck::Busy(_)
        ));
        assert_eq!(g.check_replica(&seq(100, 100)), ReplicaCheck::Fresh);
        let other = EntrySequence {
            producer: "q".into(),
            ..seq(101, 120)
        };
        assert_eq!(g.check_replica(&other), ReplicaCheck::Fresh);
    }

    #[tokio::test]
    async fn given_chunks_and_replicas_in_flight_then_each_is_checked_by_what_it_needs() {
        let g = tokio::sync::Mutex::new(Inner::default());
        let mut guard = ReplicaGuard(g.lock().await);
        guard.0.persist("p", 101, 180);
        let chunk = |id| EntrySequence {
            partial_chunk: true,
            ..seq(id, id)
        };
        assert_eq!(
            guard.check(&chunk(150)),
            ReplicaCheck::Held,
            "its message is here"
        );
        assert_eq!(guard.check(&chunk(100)), ReplicaCheck::Fresh);
        assert!(
            guard.ticket(chunk(100)).is_none(),
            "the last chunk is tracked"
        );
        // 100 from one site queued: the same ids from a third site wait for its outcome.
        let t = guard.ticket(seq(100, 100)).unwrap();
        assert!(matches!(guard.check(&seq(100, 100)), ReplicaCheck::Busy(_)));
        assert_eq!(guard.check(&seq(99, 99)), ReplicaCheck::Fresh);
        drop(guard);
        let d = Dedup {
            meta: MetadataClient::new(&meridian_config::ClientConfig {
                endpoints: vec!["127.0.0.1:1".into()],
                ..Default::default()
            })
            .unwrap(),
            key: "/topic-dedup/x".into(),
            snapshot_every: u64::MAX,
            inner: g,
            snapshotting: Arc::new(AtomicBool::new(false)),
            stopped: AtomicBool::new(false),
            generation: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            cross_site: true,
        };
        d.record(t, Some(Position::new(1, 1))).await;
        let guard = d.replica().await.unwrap();
        assert_eq!(guard.check(&seq(100, 100)), ReplicaCheck::Held);
    }

    #[tokio::test]
    async fn given_a_replicated_entry_below_the_highest_then_its_ticket_leaves_pushed_alone() {
        let g = tokio::sync::Mutex::new(Inner::default());
        let mut guard = ReplicaGuard(g.lock().await);
        guard.0.persist("p", 101, 180);
        guard.0.pushed.insert("p".into(), 180);
        let t = guard.ticket(seq(100, 100)).unwrap();
        assert_eq!(guard.0.pushed["p"], 180);
        assert_eq!((t.first, t.highest), (100, 100));
        guard.0.persist(&t.producer, t.first, t.highest);
        assert_eq!(guard.0.held["p"].ranges(), &[(100, 180)]);
        assert_eq!(guard.0.persisted["p"], 180);
    }

    #[test]
    fn given_names_idle_past_the_timeout_then_they_are_forgotten_unless_attached_or_in_flight() {
        let mut g = Inner::default();
        for (n, seq, at) in [
            ("idle", 5, 1_000),
            ("attached", 3, 1_000),
            ("fresh", 9, 9_000),
        ] {
            g.persisted.insert(n.into(), seq);
            g.pushed.insert(n.into(), seq);
            g.last_active_ms.insert(n.into(), at);
        }
        // In flight: pushed beyond persisted.
        g.persisted.insert("writing".into(), 1);
        g.pushed.insert("writing".into(), 2);
        g.last_active_ms.insert("writing".into(), 1_000);
        let gone = g.expire(10_000, 5_000, &|n| n == "attached");
        assert_eq!(gone, vec!["idle".to_string()]);
        let mut left: Vec<&String> = g.persisted.keys().collect();
        left.sort();
        assert_eq!(left, ["attached", "fresh", "writing"]);
        assert!(!g.pushed.contains_key("idle"));
    }

    #[test]
    fn given_single_message_then_first_and_highest_are_its_id() {
        let s = entry_sequence(&entry(meta("p", 7), b"x")).unwrap();
        assert_eq!((s.producer.as_str(), s.first, s.highest), ("p", 7, 7));
        assert!(!s.partial_chunk);
    }

    #[test]
    fn given_batch_then_highest_is_the_last_items_id() {
        let m = MessageMetadata {
            num_messages_in_batch: Some(3),
            ..meta("p", 10)
        };
        let s = entry_sequence(&entry(m, &batch(&[(10, b"a"), (11, b"b"), (15, b"c")]))).unwrap();
        assert_eq!((s.first, s.highest), (10, 15));
    }

    #[test]
    fn given_compressed_batch_then_highest_counts_messages() {
        let m = MessageMetadata {
            num_messages_in_batch: Some(4),
            compression: Some(1),
            ..meta("p", 10)
        };
        let s = entry_sequence(&entry(m, b"opaque")).unwrap();
        assert_eq!((s.first, s.highest), (10, 13));
    }

    #[test]
    fn given_chunks_then_only_the_last_is_checked() {
        let chunk = |id| MessageMetadata {
            chunk_id: Some(id),
            num_chunks_from_msg: Some(3),
            ..meta("p", 4)
        };
        assert!(
            entry_sequence(&entry(chunk(0), b"a"))
                .unwrap()
                .partial_chunk
        );
        assert!(
            entry_sequence(&entry(chunk(1), b"a"))
                .unwrap()
                .partial_chunk
        );
        assert!(
            !entry_sequence(&entry(chunk(2), b"a"))
                .unwrap()
                .partial_chunk
        );
    }

    #[test]
    fn given_marker_then_no_sequence() {
        let m = MessageMetadata {
            marker_type: Some(10),
            ..meta("p", 1)
        };
        assert_eq!(entry_sequence(&entry(m, b"")), None);
    }
}
