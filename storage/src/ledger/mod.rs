//! The ledger client: create, write, close, open, recover, read and delete ledgers.
//!
//! Ledger metadata lives in the metadata store at `/ledgers/L<id, 20 digits>` (JSON), ids come
//! from the sequential key `/ledgers/ids/id-`, and bookies announce themselves under
//! `/bookies/available/<address>` (ephemeral). Every metadata change is a compare-and-set.
//!
//! A writer is one task that owns the ledger's write state:
//!
//! ```text
//!  add(payload) ─► entry id, envelope (with the LAC) ─► Qw bookies of the entry's write set
//!  bookie acks ─► AckSet per entry ─► entries complete in id order once Qa acked ─► LAC moves
//!  bookie error ─► ensemble change: new fragment from LAC+1 with a replacement bookie (CAS),
//!                  unacknowledged entries resent to it
//!  fenced ─► every pending and later add fails: another client recovered the ledger
//! ```

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use meridian_metadata::client::{ClientError, MetadataClient, PutOptions};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

use crate::client::{BookieClientError, BookieConn, BookiePool};
use crate::proto::{self, Request, Response, Status, NONE};
use crate::striping::{AckSet, QuorumError, Quorums};

mod recovery;

pub const LEDGERS_PREFIX: &str = "/ledgers/";
pub const LEDGER_IDS_PREFIX: &str = "/ledgers/ids/id-";
pub const BOOKIES_PREFIX: &str = "/bookies/available/";
/// A bookie's rack as set by an admin (`bookies set-rack`), over its `bookie.rack`.
pub const BOOKIE_RACKS_PREFIX: &str = "/bookies/racks/";
/// A bookie's affinity group as set by an admin (`bookies set-group`), over its
/// `bookie.group`.
pub const BOOKIE_GROUPS_PREFIX: &str = "/bookies/groups/";
/// The ledger property naming the bookie affinity groups its replicas must stay in:
/// `primary` or `primary,secondary` (a namespace's `set-bookie-affinity-group`). Ledger
/// creation, ensemble changes and autorecovery all read it.
pub const BOOKIE_AFFINITY_PROPERTY: &str = "bookie-affinity";

/// The affinity groups a ledger's properties name, primary first (none: any bookie).
pub fn affinity_groups(properties: &BTreeMap<String, String>) -> Vec<String> {
    properties
        .get(BOOKIE_AFFINITY_PROPERTY)
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|g| !g.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

pub fn ledger_key(id: u64) -> String {
    format!("{LEDGERS_PREFIX}L{id:020}")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LedgerState {
    Open,
    InRecovery,
    Closed,
}

/// A run of entries written to one ensemble.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fragment {
    pub first_entry: u64,
    pub ensemble: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerMetadata {
    pub id: u64,
    pub ensemble_size: usize,
    pub write_quorum: usize,
    pub ack_quorum: usize,
    pub state: LedgerState,
    /// Last entry of a closed ledger (`None`: closed empty, or not closed).
    pub last_entry: Option<u64>,
    /// Hex of the key bookies check on every add and fence.
    pub master_key: String,
    pub fragments: Vec<Fragment>,
    pub created_ms: u64,
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

impl LedgerMetadata {
    /// A ledger's metadata record as stored, checked: what the writer, readers, recovery and
    /// autorecovery take for granted of it holds, so a damaged or foreign record is refused
    /// with the reason instead of failing somewhere later (an empty fragment list, an ensemble
    /// shorter than the ledger's ensemble size, a key that is not hex).
    pub fn decode(bytes: &[u8]) -> Result<LedgerMetadata, String> {
        let m: LedgerMetadata = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        m.check()?;
        Ok(m)
    }

    fn check(&self) -> Result<(), String> {
        self.quorums().map_err(|e| e.to_string())?;
        let Some(first) = self.fragments.first() else {
            return Err("no fragment".to_string());
        };
        if first.first_entry != 0 {
            return Err(format!(
                "the first fragment starts at entry {}, not 0",
                first.first_entry
            ));
        }
        for w in self.fragments.windows(2) {
            if w[1].first_entry <= w[0].first_entry {
                return Err(format!(
                    "fragments out of order: entry {} after {}",
                    w[1].first_entry, w[0].first_entry
                ));
            }
        }
        if let Some(f) = self
            .fragments
            .iter()
            .find(|f| f.ensemble.len() != self.ensemble_size)
        {
            return Err(format!(
                "the fragment from entry {} has {} bookies, the ensemble size is {}",
                f.first_entry,
                f.ensemble.len(),
                self.ensemble_size
            ));
        }
        if self.master_key.len() % 2 != 0 || !self.master_key.bytes().all(|b| b.is_ascii_hexdigit())
        {
            return Err("the master key is not hex".to_string());
        }
        Ok(())
    }

    pub fn quorums(&self) -> Result<Quorums, QuorumError> {
        Quorums::new(self.ensemble_size, self.write_quorum, self.ack_quorum)
    }

    /// The fragment holding `entry`.
    pub fn fragment_of(&self, entry: u64) -> &Fragment {
        self.fragments
            .iter()
            .rev()
            .find(|f| f.first_entry <= entry)
            .unwrap_or(&self.fragments[0])
    }

    pub fn key_bytes(&self) -> Bytes {
        Bytes::from(hex_decode(&self.master_key))
    }

    /// Adds an ensemble change: a fragment from `f.first_entry` on (the last one's ensemble
    /// replaced if it starts there too).
    fn append_fragment(&mut self, f: Fragment) {
        match self.fragments.last_mut() {
            Some(last) if last.first_entry == f.first_entry => last.ensemble = f.ensemble,
            _ => self.fragments.push(f),
        }
    }
}

/// What a bookie says of itself in the metadata store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BookieInfo {
    pub address: String,
    pub free_bytes: u64,
    pub writable: bool,
    /// Where it stands (`bookie.rack`); ensembles spread over racks.
    #[serde(default = "default_rack")]
    pub rack: String,
    /// Its bookie affinity group (`bookie.group`; empty: none).
    #[serde(default)]
    pub group: String,
}

fn default_rack() -> String {
    crate::placement::DEFAULT_RACK.to_string()
}

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error(transparent)]
    Metadata(#[from] ClientError),
    #[error(transparent)]
    Quorum(#[from] QuorumError),
    #[error("ledger {0} does not exist")]
    NoSuchLedger(u64),
    #[error("ledger {ledger}: entry {entry} does not exist")]
    NoSuchEntry { ledger: u64, entry: u64 },
    #[error("ledger {0} was fenced: another client recovered it, this writer may not add")]
    Fenced(u64),
    #[error("ledger {0} is closed")]
    Closed(u64),
    #[error("need {needed} writable bookies, {available} available ({detail})")]
    NotEnoughBookies {
        needed: usize,
        available: usize,
        detail: String,
    },
    #[error("ledger {ledger}: entry {entry} could not be read: {detail}")]
    ReadFailed {
        ledger: u64,
        entry: u64,
        detail: String,
    },
    #[error("ledger {ledger}: {detail}")]
    Failed { ledger: u64, detail: String },
    #[error("corrupt ledger metadata at {key}: {detail}")]
    BadMetadata { key: String, detail: String },
}

/// Settings of the ledger client.
#[derive(Debug, Clone)]
pub struct LedgerClientOptions {
    /// Entries a writer may have in flight (sent, not yet acknowledged).
    pub window: usize,
    /// A bookie that has not answered an add or read within this is treated as failed.
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    /// A read also asks the next replica if the first has not answered within this.
    pub speculative_read_delay: Duration,
    pub frame_bytes_max: usize,
    /// TLS between roles (`[tls]`): bookies are reached over TLS with this process's
    /// certificate. `None` = plaintext (in-process bookies never use it).
    pub tls: Option<Arc<meridian_metadata::tls::SiteTls>>,
}

impl Default for LedgerClientOptions {
    fn default() -> Self {
        Self {
            window: 1000,
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            speculative_read_delay: Duration::from_millis(50),
            frame_bytes_max: 5 << 20,
            tls: None,
        }
    }
}

#[derive(Clone)]
pub struct LedgerClient {
    meta: MetadataClient,
    pool: Arc<BookiePool>,
    opts: LedgerClientOptions,
    /// The registered writable bookies, polled by one task per client once a writer exists:
    /// an idle writer whose ensemble holds a bookie that left or turned read-only (lost,
    /// decommissioned, full) moves off it without waiting for its next add.
    writable: Arc<std::sync::OnceLock<tokio::sync::watch::Receiver<Arc<BTreeSet<String>>>>>,
}

/// How often a client polls the bookie registrations for its idle writers.
const WRITABLE_POLL: Duration = Duration::from_secs(1);
/// Polls in a row a bookie must be missing from the writable ones before idle writers move
/// off it.
const WRITABLE_POLLS_MISSED: u32 = 3;

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn hex_encode(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Pairs of hex digits as bytes (a pair that is not hex is skipped; [`LedgerMetadata::decode`]
/// refuses keys with any).
fn hex_decode(s: &str) -> Vec<u8> {
    s.as_bytes()
        .chunks_exact(2)
        .filter_map(|p| {
            let digit = |c: u8| (c as char).to_digit(16);
            Some((digit(p[0])? * 16 + digit(p[1])?) as u8)
        })
        .collect()
}

impl LedgerClient {
    pub fn new(meta: MetadataClient, opts: LedgerClientOptions) -> Self {
        let pool = BookiePool::new(
            opts.connect_timeout,
            opts.request_timeout,
            opts.frame_bytes_max,
            opts.tls.clone(),
        );
        Self {
            meta,
            pool,
            opts,
            writable: Arc::default(),
        }
    }

    /// The registered writable bookies, as last polled (the poller starts on first use; it
    /// ends when every receiver is gone). The first value is sent on its first answer.
    fn writable_bookies(&self) -> tokio::sync::watch::Receiver<Arc<BTreeSet<String>>> {
        self.writable
            .get_or_init(|| {
                let (tx, rx) = tokio::sync::watch::channel(Arc::new(BTreeSet::new()));
                let client = self.clone_without_monitor();
                tokio::spawn(async move {
                    // A bookie counts as unwritable only once it was missing from the
                    // writable ones in WRITABLE_POLLS_MISSED polls in a row (a restart or a
                    // store hiccup does not move every idle ledger).
                    let mut missed: BTreeMap<String, u32> = BTreeMap::new();
                    loop {
                        if let Ok(list) = client.bookies().await {
                            let writable: BTreeSet<String> = list
                                .into_iter()
                                .filter(|b| b.writable)
                                .map(|b| b.address)
                                .collect();
                            let known: Vec<String> = tx.borrow().iter().cloned().collect();
                            for b in known {
                                if writable.contains(&b) {
                                    missed.remove(&b);
                                } else {
                                    *missed.entry(b).or_default() += 1;
                                }
                            }
                            missed.retain(|b, _| !writable.contains(b));
                            let mut now = writable;
                            now.extend(
                                missed
                                    .iter()
                                    .filter(|(_, n)| **n < WRITABLE_POLLS_MISSED)
                                    .map(|(b, _)| b.clone()),
                            );
                            missed.retain(|_, n| *n < WRITABLE_POLLS_MISSED);
                            tx.send_if_modified(|cur| {
                                let changed = **cur != now;
                                if changed {
                                    *cur = Arc::new(now);
                                }
                                changed
                            });
                        }
                        tokio::select! {
                            _ = tx.closed() => return,
                            _ = tokio::time::sleep(WRITABLE_POLL) => {}
                        }
                    }
                });
                rx
            })
            .clone()
    }

    /// This client without the writable-bookies poller (the poller's own client must not keep
    /// its receiver alive).
    fn clone_without_monitor(&self) -> Self {
        Self {
            meta: self.meta.clone(),
            pool: Arc::clone(&self.pool),
            opts: self.opts.clone(),
            writable: Arc::default(),
        }
    }

    pub fn metadata_client(&self) -> &MetadataClient {
        &self.meta
    }

    /// This client's connection to the bookie at `addr` (made if there is none yet): over TCP,
    /// or in-process when a bookie of this process serves that address.
    pub async fn connection(&self, addr: &str) -> Result<Arc<BookieConn>, BookieClientError> {
        self.pool.get(addr).await
    }

    /// Registered bookies, as they describe themselves.
    pub async fn bookies(&self) -> Result<Vec<BookieInfo>, LedgerError> {
        let mut out = Vec::new();
        let mut after = String::new();
        loop {
            let page = self.meta.list(BOOKIES_PREFIX, &after, 0).await?;
            for kv in &page.kvs {
                match serde_json::from_slice::<BookieInfo>(&kv.value) {
                    Ok(b) => out.push(b),
                    Err(e) => {
                        tracing::warn!(key = %kv.key, error = %e, "unreadable bookie registration")
                    }
                }
            }
            match (page.more, page.kvs.last()) {
                (true, Some(last)) => after = last.key.clone(),
                _ => break,
            }
        }
        Ok(out)
    }

    /// `n` writable bookies not in `exclude` (the rest of an ensemble, and a failed member),
    /// spread over racks, racks of `staying` (the members that stay in the ensemble) last,
    /// the emptiest first ([`crate::placement`]).
    pub(crate) async fn choose_bookies(
        &self,
        n: usize,
        exclude: &[String],
        staying: &[String],
        groups: &[String],
    ) -> Result<Vec<String>, LedgerError> {
        let all = self.bookies().await?;
        // A decommissioned bookie turns read-only within its registration refresh; until
        // then it must not be chosen either.
        let decommissioned = crate::autorecovery::decommissioned(&self.meta).await?;
        let mut exclude = exclude.to_vec();
        exclude.extend(decommissioned);
        let exclude = &exclude[..];
        let used: Vec<String> = all
            .iter()
            .filter(|b| staying.contains(&b.address))
            .map(|b| b.rack.clone())
            .collect();
        crate::placement::choose(&all, n, exclude, &used, groups).map_err(|available| {
            LedgerError::NotEnoughBookies {
                needed: n,
                available,
                detail: if groups.is_empty() {
                    format!("registered under {BOOKIES_PREFIX}, excluding {exclude:?}")
                } else {
                    format!(
                        "in bookie affinity groups {groups:?} (primary first), excluding {exclude:?}"
                    )
                },
            }
        })
    }

    /// Creates a ledger on `ensemble_size` bookies and returns its writer.
    pub async fn create(
        &self,
        ensemble_size: usize,
        write_quorum: usize,
        ack_quorum: usize,
        properties: BTreeMap<String, String>,
    ) -> Result<LedgerWriter, LedgerError> {
        let q = Quorums::new(ensemble_size, write_quorum, ack_quorum)?;
        let ensemble = self
            .choose_bookies(ensemble_size, &[], &[], &affinity_groups(&properties))
            .await?;
        // Connect now, so the first adds do not wait for it (a failure shows up at the first
        // add, which then changes the ensemble).
        futures::future::join_all(ensemble.iter().map(|a| self.pool.get(a))).await;
        let id_key = self
            .meta
            .put_with(
                LEDGER_IDS_PREFIX,
                Vec::new(),
                PutOptions {
                    sequential: true,
                    ..PutOptions::default()
                },
            )
            .await?
            .key;
        let id: u64 =
            id_key[LEDGER_IDS_PREFIX.len()..]
                .parse()
                .map_err(|_| LedgerError::BadMetadata {
                    key: id_key.clone(),
                    detail: "sequential suffix is not a number".into(),
                })?;
        let key: [u8; 20] = rand::random();
        let meta = LedgerMetadata {
            id,
            ensemble_size,
            write_quorum,
            ack_quorum,
            state: LedgerState::Open,
            last_entry: None,
            master_key: hex_encode(&key),
            fragments: vec![Fragment {
                first_entry: 0,
                ensemble,
            }],
            created_ms: now_ms(),
            properties,
        };
        let version = self
            .meta
            .create(
                &ledger_key(id),
                serde_json::to_vec(&meta).expect("serializable"),
            )
            .await?;
        Ok(LedgerWriter::spawn(self.clone(), meta, version, q))
    }

    /// The ledger's metadata and its version.
    pub async fn metadata(&self, id: u64) -> Result<(LedgerMetadata, u64), LedgerError> {
        let key = ledger_key(id);
        let kv = self
            .meta
            .get(&key)
            .await?
            .ok_or(LedgerError::NoSuchLedger(id))?;
        let m = LedgerMetadata::decode(&kv.value)
            .map_err(|detail| LedgerError::BadMetadata { key, detail })?;
        Ok((m, kv.mod_revision))
    }

    /// The pool of bookie connections (autorecovery reads and writes single replicas).
    pub(crate) fn pool(&self) -> &BookiePool {
        &self.pool
    }

    pub(crate) async fn cas_metadata(
        &self,
        m: &LedgerMetadata,
        version: u64,
    ) -> Result<u64, LedgerError> {
        Ok(self
            .meta
            .put_with(
                &ledger_key(m.id),
                serde_json::to_vec(m).expect("serializable"),
                PutOptions {
                    expected_version: Some(version),
                    ..PutOptions::default()
                },
            )
            .await?
            .version)
    }

    /// Ids of every ledger, ascending.
    pub async fn list(&self) -> Result<Vec<u64>, LedgerError> {
        let mut ids = Vec::new();
        let mut after = String::new();
        loop {
            let page = self.meta.children(LEDGERS_PREFIX, &after, 0).await?;
            for name in &page.children {
                if let Some(id) = name.strip_prefix('L').and_then(|d| d.parse().ok()) {
                    ids.push(id);
                }
            }
            match (page.more, page.children.last()) {
                (true, Some(last)) => after = format!("{LEDGERS_PREFIX}{last}"),
                _ => break,
            }
        }
        Ok(ids)
    }

    /// Opens a ledger for reading as it is now (an open ledger's readable end is its LAC).
    pub async fn open(&self, id: u64) -> Result<LedgerReader, LedgerError> {
        let (meta, _) = self.metadata(id).await?;
        Ok(LedgerReader {
            client: self.clone(),
            meta,
        })
    }

    /// Deletes the ledger: its entries on every bookie that has a fragment, then its metadata.
    pub async fn delete(&self, id: u64) -> Result<(), LedgerError> {
        let (meta, version) = self.metadata(id).await?;
        let mut bookies: Vec<String> = meta
            .fragments
            .iter()
            .flat_map(|f| f.ensemble.clone())
            .collect();
        bookies.sort();
        bookies.dedup();
        for addr in bookies {
            match self
                .pool
                .call(&addr, Request::Delete { ledger_id: id })
                .await
            {
                Ok(Response::Delete {
                    status: Status::Ok | Status::NoSuchLedger,
                    ..
                }) => {}
                other => {
                    tracing::warn!(ledger = id, bookie = %addr, result = ?other, "bookie did not delete the ledger; its space stays used")
                }
            }
        }
        self.meta.delete(&ledger_key(id), Some(version)).await?;
        Ok(())
    }
}

/// Reads a ledger.
pub struct LedgerReader {
    client: LedgerClient,
    meta: LedgerMetadata,
}

impl LedgerReader {
    pub fn metadata(&self) -> &LedgerMetadata {
        &self.meta
    }

    /// The last entry of a closed ledger.
    pub fn last_entry(&self) -> Option<u64> {
        self.meta.last_entry
    }

    /// Reads one entry from a replica, asking the next replica too if the first is slow or
    /// fails. The payload is returned only if its checksum verifies.
    pub async fn read(&self, entry: u64) -> Result<Bytes, LedgerError> {
        let id = self.meta.id;
        let q = self.meta.quorums()?;
        let frag = self.meta.fragment_of(entry);
        let set: Vec<String> = q
            .write_set(entry)
            .map(|i| frag.ensemble[i].clone())
            .collect();
        let mut tries = futures::stream::FuturesUnordered::new();
        let mut problems = Vec::new();
        let mut absent = 0;
        let start = |addr: String| read_from(&self.client.pool, addr, id, entry);
        let mut next = 0;
        tries.push(start(set[next].clone()));
        next += 1;
        use futures::StreamExt;
        loop {
            let timer = tokio::time::sleep(self.client.opts.speculative_read_delay);
            tokio::select! {
                done = tries.next() => {
                    let Some((addr, r)) = done else { break };
                    match r {
                        Ok(Response::Read { status: Status::Ok, entry: bytes, .. }) => match proto::open(&bytes) {
                            Ok(e) if e.ledger_id == id && e.entry_id == entry => return Ok(e.payload),
                            Ok(_) => problems.push(format!("{addr}: entry names another position")),
                            Err(err) => problems.push(format!("{addr}: {err}")),
                        },
                        Ok(Response::Read { status: Status::NoSuchEntry | Status::NoSuchLedger, .. }) => {
                            absent += 1;
                            problems.push(format!("{addr}: no such entry"));
                        }
                        Ok(other) => problems.push(format!("{addr}: {other:?}")),
                        Err(e) => problems.push(e.to_string()),
                    }
                    if next < set.len() {
                        tries.push(start(set[next].clone()));
                        next += 1;
                    }
                }
                _ = timer, if next < set.len() => {
                    // Speculative read: the first replica is slow.
                    tries.push(start(set[next].clone()));
                    next += 1;
                }
            }
        }
        if absent == set.len() {
            return Err(LedgerError::NoSuchEntry { ledger: id, entry });
        }
        Err(LedgerError::ReadFailed {
            ledger: id,
            entry,
            detail: problems.join("; "),
        })
    }

    /// Reads entries `first..first + count` in order, as many as one request to one replica
    /// gives (at least one; fewer than `count` when the fragment or the closed ledger ends, a
    /// frame fills or that replica lacks the next one): the payloads, each verified. In an open
    /// ledger the caller asks only for confirmed entries (a replica may hold later ones that
    /// were never acknowledged).
    ///
    /// One request carries many entries only where every replica of the fragment holds every
    /// entry of it (ensemble size = write quorum). It goes to the first replica of the first
    /// entry's write set and, as [`read`](Self::read) does, also to the next one when the first
    /// has not answered within the speculative delay or answered with nothing usable; the first
    /// usable answer is taken. When none is, the first entry is read alone through `read`
    /// (whose error says what each replica answered). A striped fragment is read entry by
    /// entry through `read`: up to 64 entries a call, all at once.
    pub async fn read_range(&self, first: u64, count: u64) -> Result<Vec<Bytes>, LedgerError> {
        use futures::{StreamExt, TryStreamExt};
        let id = self.meta.id;
        let q = self.meta.quorums()?;
        let frag = self.meta.fragment_of(first);
        let fragment_end = self
            .meta
            .fragments
            .iter()
            .map(|f| f.first_entry)
            .filter(|&f| f > first)
            .min()
            .unwrap_or(u64::MAX);
        let mut count = count.min(fragment_end - first);
        if self.meta.state == LedgerState::Closed {
            // Nothing past the close is served, whatever a replica holds.
            let end = self.meta.last_entry.map_or(0, |l| l.saturating_add(1));
            if first >= end {
                return Err(LedgerError::NoSuchEntry {
                    ledger: id,
                    entry: first,
                });
            }
            count = count.min(end - first);
        }
        if count > 1 && self.meta.ensemble_size == self.meta.write_quorum {
            let request = Request::ReadRange {
                ledger_id: id,
                first_entry: first,
                count_max: count.min(u32::MAX as u64) as u32,
                bytes_max: self
                    .client
                    .opts
                    .frame_bytes_max
                    .saturating_sub(64)
                    .min(u32::MAX as usize) as u32,
            };
            let set: Vec<String> = q
                .write_set(first)
                .map(|i| frag.ensemble[i].clone())
                .collect();
            let start = |addr: String| {
                let pool = Arc::clone(&self.client.pool);
                let request = request.clone();
                async move { pool.call(&addr, request).await }
            };
            // The verified prefix of an answer (empty: nothing usable).
            let usable = |r: Result<Response, _>| -> Vec<Bytes> {
                let Ok(Response::ReadRange {
                    status: Status::Ok,
                    entries,
                    ..
                }) = r
                else {
                    return Vec::new();
                };
                let mut payloads = Vec::with_capacity(entries.len());
                for (entry, bytes) in (first..).zip(entries.iter().take(count as usize)) {
                    match proto::open(bytes) {
                        Ok(e) if e.ledger_id == id && e.entry_id == entry => {
                            payloads.push(e.payload)
                        }
                        // Not served from this replica: another one, or the entry-by-entry
                        // read, finds a good copy.
                        _ => break,
                    }
                }
                payloads
            };
            let mut tries = futures::stream::FuturesUnordered::new();
            let mut asked = set.iter().cloned();
            tries.extend(asked.next().map(start));
            loop {
                let timer = tokio::time::sleep(self.client.opts.speculative_read_delay);
                tokio::select! {
                    done = tries.next() => {
                        let Some(r) = done else { break };
                        let payloads = usable(r);
                        if !payloads.is_empty() {
                            return Ok(payloads);
                        }
                        tries.extend(asked.next().map(start));
                    }
                    _ = timer, if asked.len() > 0 => tries.extend(asked.next().map(start)),
                }
            }
            return Ok(vec![self.read(first).await?]);
        }
        const READS_IN_FLIGHT: u64 = 64;
        let last = first.saturating_add(count.clamp(1, READS_IN_FLIGHT) - 1);
        futures::stream::iter(first..=last)
            .map(|entry| self.read(entry))
            .buffered(READS_IN_FLIGHT as usize)
            .try_collect()
            .await
    }
}

/// Asks one replica for one entry: its address with the answer (reads and recovery race the
/// replicas of a write set with these).
fn read_from(
    pool: &Arc<BookiePool>,
    addr: String,
    ledger_id: u64,
    entry_id: u64,
) -> impl std::future::Future<Output = (String, Result<Response, BookieClientError>)> {
    let pool = Arc::clone(pool);
    async move {
        let r = pool
            .call(
                &addr,
                Request::Read {
                    ledger_id,
                    entry_id,
                },
            )
            .await;
        (addr, r)
    }
}

/// Why an entry is still pending.
struct Pending {
    entry: u64,
    /// Header and payload, the payload shared with the caller's buffer (never copied here).
    envelope: proto::Sealed,
    acks: AckSet,
    reply: Option<oneshot::Sender<Result<u64, LedgerError>>>,
    _permit: OwnedSemaphorePermit,
    sent_at: Instant,
}

enum Cmd {
    Add(
        Bytes,
        oneshot::Sender<Result<u64, LedgerError>>,
        OwnedSemaphorePermit,
    ),
    Ack {
        entry: u64,
        index: usize,
        addr: String,
        result: Result<Response, BookieClientError>,
    },
    Close(oneshot::Sender<Result<Option<u64>, LedgerError>>),
}

/// Writes one ledger. Adds complete in entry order.
pub struct LedgerWriter {
    id: u64,
    tx: mpsc::UnboundedSender<Cmd>,
    window: Arc<Semaphore>,
    lac: Arc<std::sync::atomic::AtomicU64>,
}

/// A writer's last add confirmed ([`LedgerWriter::confirmed`]).
#[derive(Clone)]
pub struct Confirmed(Arc<std::sync::atomic::AtomicU64>);

impl Confirmed {
    /// The last entry known to be on an ack quorum, if any.
    pub fn get(&self) -> Option<u64> {
        let v = self.0.load(std::sync::atomic::Ordering::Relaxed);
        (v != NONE).then_some(v)
    }
}

impl LedgerWriter {
    fn spawn(client: LedgerClient, meta: LedgerMetadata, version: u64, q: Quorums) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let window = Arc::new(Semaphore::new(client.opts.window.max(1)));
        let lac = Arc::new(std::sync::atomic::AtomicU64::new(NONE));
        let id = meta.id;
        let writable = client.writable_bookies();
        let actor = WriterActor {
            writable,
            writable_gone: false,
            writable_recheck: false,
            client,
            key: meta.key_bytes(),
            ensemble: meta.fragments.last().expect("fragment").ensemble.clone(),
            meta,
            version,
            q,
            next_entry: 0,
            lac: NONE,
            lac_shared: Arc::clone(&lac),
            pending: VecDeque::new(),
            failed: None,
            conns: Vec::new(),
            tx: tx.downgrade(),
            closing: None,
        };
        tokio::spawn(actor.run(rx));
        Self {
            id,
            tx,
            window,
            lac,
        }
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// The last entry known to be on an ack quorum, if any.
    pub fn last_add_confirmed(&self) -> Option<u64> {
        self.confirmed().get()
    }

    /// The writer's last add confirmed, readable after the writer is gone (closed, or its
    /// close failed).
    pub fn confirmed(&self) -> Confirmed {
        Confirmed(Arc::clone(&self.lac))
    }

    /// Queues an add (waiting while the window is full) and returns where its outcome will
    /// arrive: the entry id once it is on Qa bookies' fsynced journals.
    pub async fn add_queued(&self, payload: Bytes) -> oneshot::Receiver<Result<u64, LedgerError>> {
        let (reply, rx) = oneshot::channel();
        let permit = Arc::clone(&self.window)
            .acquire_owned()
            .await
            .expect("the window semaphore is never closed");
        if let Err(mpsc::error::SendError(Cmd::Add(_, reply, _))) =
            self.tx.send(Cmd::Add(payload, reply, permit))
        {
            let _ = reply.send(Err(LedgerError::Closed(self.id)));
        }
        rx
    }

    /// Adds an entry and waits until it is acknowledged.
    pub async fn add(&self, payload: Bytes) -> Result<u64, LedgerError> {
        self.add_queued(payload)
            .await
            .await
            .unwrap_or(Err(LedgerError::Closed(self.id)))
    }

    /// Waits for pending adds, then records the last entry and state CLOSED.
    pub async fn close(self) -> Result<Option<u64>, LedgerError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Cmd::Close(reply))
            .map_err(|_| LedgerError::Closed(self.id))?;
        rx.await.unwrap_or(Err(LedgerError::Closed(self.id)))
    }
}

struct WriterActor {
    client: LedgerClient,
    /// The client's registered writable bookies ([`LedgerClient::writable_bookies`]).
    writable: tokio::sync::watch::Receiver<Arc<BTreeSet<String>>>,
    writable_gone: bool,
    /// The writable bookies changed while adds were pending: look again once they are done.
    writable_recheck: bool,
    meta: LedgerMetadata,
    version: u64,
    key: Bytes,
    q: Quorums,
    ensemble: Vec<String>,
    next_entry: u64,
    lac: u64,
    lac_shared: Arc<std::sync::atomic::AtomicU64>,
    pending: VecDeque<Pending>,
    /// Set once the writer cannot go on (fenced, no bookies): every add fails with it.
    failed: Option<String>,
    conns: Vec<Option<Arc<BookieConn>>>,
    /// Weak: in-flight requests hold strong clones until they answer, so the actor ends
    /// once its `LedgerWriter` is dropped and nothing is in flight (no task is left behind).
    tx: mpsc::WeakUnboundedSender<Cmd>,
    closing: Option<oneshot::Sender<Result<Option<u64>, LedgerError>>>,
}

impl WriterActor {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Cmd>) {
        self.conns = vec![None; self.ensemble.len()];
        // Timeouts are checked only while adds are pending: an idle ledger (a topic nobody
        // writes to) costs no wake-ups. The handlers are boxed so that the idle task is small.
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let busy = !self.pending.is_empty();
            let cmd = tokio::select! {
                c = rx.recv() => match c { Some(c) => c, None => return },
                _ = tick.tick(), if busy => {
                    Box::pin(self.check_timeouts()).await;
                    continue;
                }
                changed = self.writable.changed(), if !self.writable_gone => {
                    match changed {
                        Ok(()) => Box::pin(self.move_off_unwritable()).await,
                        // The poller ended (the runtime is stopping): no more news.
                        Err(_) => self.writable_gone = true,
                    }
                    continue;
                }
            };
            match cmd {
                Cmd::Add(payload, reply, permit) => {
                    Box::pin(self.add(payload, reply, permit)).await
                }
                Cmd::Ack {
                    entry,
                    index,
                    addr,
                    result,
                } => Box::pin(self.ack(entry, index, addr, result)).await,
                Cmd::Close(reply) => {
                    self.closing = Some(reply);
                }
            }
            if self.writable_recheck && self.pending.is_empty() && self.closing.is_none() {
                Box::pin(self.move_off_unwritable()).await;
            }
            if self.closing.is_some() && self.pending.is_empty() {
                let reply = self.closing.take().expect("closing");
                let _ = reply.send(Box::pin(self.close()).await);
                return;
            }
        }
    }

    fn fail_error(&self) -> LedgerError {
        match &self.failed {
            Some(why) if why == "fenced" => LedgerError::Fenced(self.meta.id),
            Some(why) => LedgerError::Failed {
                ledger: self.meta.id,
                detail: why.clone(),
            },
            None => LedgerError::Closed(self.meta.id),
        }
    }

    async fn conn(&mut self, index: usize) -> Option<Arc<BookieConn>> {
        if let Some(c) = &self.conns[index] {
            if !c.is_broken() {
                return Some(Arc::clone(c));
            }
        }
        match self.client.pool.get(&self.ensemble[index]).await {
            Ok(c) => {
                self.conns[index] = Some(Arc::clone(&c));
                Some(c)
            }
            Err(_) => None,
        }
    }

    async fn add(
        &mut self,
        payload: Bytes,
        reply: oneshot::Sender<Result<u64, LedgerError>>,
        permit: OwnedSemaphorePermit,
    ) {
        if self.failed.is_some() || self.closing.is_some() {
            let _ = reply.send(Err(self.fail_error()));
            return;
        }
        let entry = self.next_entry;
        self.next_entry += 1;
        let envelope = proto::seal_parts(self.meta.id, entry, self.lac, payload);
        self.pending.push_back(Pending {
            entry,
            envelope: envelope.clone(),
            acks: AckSet::default(),
            reply: Some(reply),
            _permit: permit,
            sent_at: Instant::now(),
        });
        let set: Vec<usize> = self.q.write_set(entry).collect();
        for index in set {
            self.send_to(entry, index, envelope.clone()).await;
        }
    }

    async fn send_to(&mut self, entry: u64, index: usize, envelope: proto::Sealed) {
        let addr = self.ensemble[index].clone();
        let Some(tx) = self.tx.upgrade() else {
            // The writer handle is gone: nobody waits for this entry.
            return;
        };
        match self.conn(index).await {
            Some(c) => c.send_add(
                self.meta.id,
                entry,
                &self.key,
                &envelope,
                Box::new(move |result| {
                    let _ = tx.send(Cmd::Ack {
                        entry,
                        index,
                        addr,
                        result,
                    });
                }),
            ),
            None => {
                let _ = tx.send(Cmd::Ack {
                    entry,
                    index,
                    addr: addr.clone(),
                    result: Err(BookieClientError::Unreachable {
                        addr,
                        reason: "cannot connect".into(),
                    }),
                });
            }
        }
    }

    async fn ack(
        &mut self,
        entry: u64,
        index: usize,
        addr: String,
        result: Result<Response, BookieClientError>,
    ) {
        if self.ensemble.get(index) != Some(&addr) {
            // From a bookie replaced since: its acks no longer count.
            return;
        }
        match result {
            Ok(Response::Add {
                status: Status::Ok, ..
            }) => {
                let q = self.q;
                // Pending entries are consecutive ids: index by offset from the front.
                let front = self.pending.front().map(|p| p.entry);
                if let Some(p) = front
                    .and_then(|f| entry.checked_sub(f))
                    .and_then(|i| self.pending.get_mut(i as usize))
                {
                    debug_assert_eq!(p.entry, entry);
                    p.acks.ack(&q, index);
                }
                self.complete_in_order();
            }
            Ok(Response::Add {
                status: Status::Fenced | Status::Unauthorized,
                ..
            }) => {
                self.fail("fenced".into());
            }
            Ok(Response::Add {
                status: Status::Forbidden,
                ..
            }) => {
                // Another bookie would refuse this process's certificate just the same.
                self.fail(format!(
                    "bookie {addr} refuses adds from this process's certificate \
                     (TLS between roles: adds need a broker's certificate)"
                ));
            }
            Ok(other) => {
                tracing::warn!(ledger = self.meta.id, entry, bookie = %addr, response = ?other, "add refused; changing the ensemble");
                self.replace_bookie(index).await;
            }
            Err(e) => {
                tracing::warn!(ledger = self.meta.id, entry, error = %e, "bookie failed; changing the ensemble");
                self.replace_bookie(index).await;
            }
        }
    }

    fn complete_in_order(&mut self) {
        while let Some(front) = self.pending.front() {
            if !front.acks.is_complete(&self.q) {
                break;
            }
            let mut p = self.pending.pop_front().expect("front");
            self.lac = p.entry;
            // Before the reply: what was acknowledged is never past what `Confirmed` reads.
            self.lac_shared
                .store(self.lac, std::sync::atomic::Ordering::Relaxed);
            if let Some(reply) = p.reply.take() {
                let _ = reply.send(Ok(p.entry));
            }
        }
    }

    fn fail(&mut self, why: String) {
        if self.failed.is_none() {
            tracing::warn!(ledger = self.meta.id, reason = %why, "ledger writer failed");
            self.failed = Some(why);
        }
        let err_of = |s: &Self| s.fail_error();
        while let Some(mut p) = self.pending.pop_front() {
            if let Some(reply) = p.reply.take() {
                let _ = reply.send(Err(err_of(self)));
            }
        }
    }

    async fn check_timeouts(&mut self) {
        let timeout = self.client.opts.request_timeout;
        let stale: Option<(u64, Vec<usize>)> = self.pending.front().and_then(|p| {
            (p.sent_at.elapsed() > timeout).then(|| {
                (
                    p.entry,
                    self.q
                        .write_set(p.entry)
                        .filter(|i| !p.acks.has(*i))
                        .collect(),
                )
            })
        });
        if let Some((entry, silent)) = stale {
            for index in silent {
                tracing::warn!(ledger = self.meta.id, entry, bookie = %self.ensemble[index], "no answer in time; changing the ensemble");
                self.replace_bookie(index).await;
            }
        }
    }

    /// An idle writer (nothing pending; adds find failed bookies themselves) whose ensemble
    /// holds a bookie no longer registered writable changes its ensemble now, so the bookie's
    /// replicas are all in earlier fragments, which autorecovery makes again. Without a
    /// replacement it stays as it is (an add would try again).
    async fn move_off_unwritable(&mut self) {
        let writable = Arc::clone(&self.writable.borrow_and_update());
        if self.failed.is_some() || self.closing.is_some() || writable.is_empty() {
            self.writable_recheck = false;
            return;
        }
        if !self.pending.is_empty() {
            self.writable_recheck = true;
            return;
        }
        self.writable_recheck = false;
        for index in 0..self.ensemble.len() {
            if !writable.contains(&self.ensemble[index]) {
                tracing::info!(ledger = self.meta.id, bookie = %self.ensemble[index], "bookie no longer registered writable; idle writer changes its ensemble");
                self.replace_bookie_with(index, false).await;
            }
        }
    }

    /// Ensemble change: a new fragment from LAC+1 with `index` replaced, recorded with CAS;
    /// then every pending entry that bookie should hold is sent to the replacement.
    async fn replace_bookie(&mut self, index: usize) {
        self.replace_bookie_with(index, true).await
    }

    /// [`replace_bookie`](Self::replace_bookie); `must`: without a replacement the writer
    /// fails (an add needs one), otherwise it stays as it is.
    async fn replace_bookie_with(&mut self, index: usize, must: bool) {
        if self.failed.is_some() {
            return;
        }
        let mut attempts = 0;
        let replacement = loop {
            let staying: Vec<String> = (0..self.ensemble.len())
                .filter(|i| *i != index)
                .map(|i| self.ensemble[i].clone())
                .collect();
            let groups = affinity_groups(&self.meta.properties);
            match self
                .client
                .choose_bookies(1, &self.ensemble, &staying, &groups)
                .await
            {
                Ok(mut v) => break v.remove(0),
                Err(e) if !must => {
                    tracing::warn!(ledger = self.meta.id, error = %e, "no bookie to move an idle ledger to; it stays");
                    return;
                }
                Err(e) => {
                    attempts += 1;
                    if attempts >= 5 {
                        self.fail(format!(
                            "no replacement for bookie {}: {e}",
                            self.ensemble[index]
                        ));
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        let mut ensemble = self.ensemble.clone();
        let old = std::mem::replace(&mut ensemble[index], replacement.clone());
        let first_entry = if self.lac == NONE { 0 } else { self.lac + 1 };
        let mut adopted = 0;
        loop {
            let mut meta = self.meta.clone();
            meta.append_fragment(Fragment {
                first_entry,
                ensemble: ensemble.clone(),
            });
            let e = match self.client.cas_metadata(&meta, self.version).await {
                Ok(v) => {
                    self.version = v;
                    self.meta = meta;
                    break;
                }
                Err(e) => e,
            };
            if matches!(e, LedgerError::Metadata(ClientError::Conflict { .. }))
                && adopted < 10
                && self.adopt_after_conflict().await
            {
                adopted += 1;
                continue;
            }
            // Someone else changed the ledger (recovery): this writer is done.
            let state = self
                .client
                .metadata(self.meta.id)
                .await
                .map(|(m, _)| m.state);
            if matches!(state, Ok(LedgerState::InRecovery | LedgerState::Closed)) {
                self.fail("fenced".into());
            } else if !must {
                // An idle move that could not be recorded: the writer stays as it was.
                tracing::warn!(ledger = self.meta.id, error = %e, "recording an idle writer's ensemble change failed; it stays");
            } else {
                self.fail(format!("recording the ensemble change failed: {e}"));
            }
            return;
        }
        tracing::info!(ledger = self.meta.id, from = %old, to = %replacement, first_entry, "ensemble changed");
        self.ensemble = ensemble;
        self.conns[index] = None;
        let resend: Vec<(u64, proto::Sealed)> = self
            .pending
            .iter_mut()
            .filter(|p| self.q.stores(index, p.entry))
            .map(|p| {
                p.acks.forget(index);
                p.sent_at = Instant::now();
                (p.entry, p.envelope.clone())
            })
            .collect();
        for (entry, envelope) in resend {
            self.send_to(entry, index, envelope).await;
        }
    }

    async fn close(&mut self) -> Result<Option<u64>, LedgerError> {
        if self.failed.is_some() {
            return Err(self.fail_error());
        }
        let mut adopted = 0;
        loop {
            let mut meta = self.meta.clone();
            meta.state = LedgerState::Closed;
            meta.last_entry = (self.lac != NONE).then_some(self.lac);
            match self.client.cas_metadata(&meta, self.version).await {
                Ok(v) => {
                    self.version = v;
                    self.meta = meta;
                    return Ok(self.meta.last_entry);
                }
                Err(LedgerError::Metadata(ClientError::Conflict { .. })) => {
                    if adopted < 10 && self.adopt_after_conflict().await {
                        adopted += 1;
                        continue;
                    }
                    // Fenced only if the ledger is no longer this writer's (recovered,
                    // closed, gone); a read that failed is that failure, not a fencing.
                    return Err(match self.client.metadata(self.meta.id).await {
                        Ok((m, _)) if m.state == LedgerState::Open => LedgerError::Failed {
                            ledger: self.meta.id,
                            detail: "its metadata changed while closing".into(),
                        },
                        Err(e @ LedgerError::Metadata(_)) => e,
                        _ => LedgerError::Fenced(self.meta.id),
                    });
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// After a compare-and-set of the metadata lost to another client: autorecovery replaces
    /// bookies of an open ledger's earlier fragments (never the last, which is this writer's).
    /// If the ledger is still open and its last fragment is this writer's, the stored metadata
    /// is taken and `true` says try again; anything else (recovery, close) is not ours to undo.
    async fn adopt_after_conflict(&mut self) -> bool {
        match self.client.metadata(self.meta.id).await {
            Ok((m, v))
                if m.state == LedgerState::Open
                    && m.fragments.last() == self.meta.fragments.last() =>
            {
                tracing::info!(
                    ledger = self.meta.id,
                    "ledger metadata changed by autorecovery; taking it"
                );
                self.meta = m;
                self.version = v;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> serde_json::Value {
        serde_json::json!({
            "id": 7, "ensemble_size": 2, "write_quorum": 2, "ack_quorum": 1,
            "state": "open", "last_entry": null, "master_key": "00ff",
            "fragments": [
                {"first_entry": 0, "ensemble": ["a:1", "b:1"]},
                {"first_entry": 10, "ensemble": ["a:1", "c:1"]}
            ],
            "created_ms": 1
        })
    }

    fn decode(v: &serde_json::Value) -> Result<LedgerMetadata, String> {
        LedgerMetadata::decode(&serde_json::to_vec(v).unwrap())
    }

    #[test]
    fn given_a_sound_record_then_it_decodes() {
        let m = decode(&record()).unwrap();
        assert_eq!(m.fragment_of(12).ensemble[1], "c:1");
        assert_eq!(&m.key_bytes()[..], &[0, 255]);
    }

    /// Each of these made a reader panic before the record was checked (an empty fragment
    /// list indexed, a key sliced inside a UTF-8 character, a short ensemble indexed by the
    /// striping), or misplaced entries (fragments out of order).
    #[test]
    fn given_a_damaged_record_then_it_is_refused_with_the_reason() {
        let cases: [(&str, serde_json::Value, &str); 6] = [
            ("fragments", serde_json::json!([]), "no fragment"),
            (
                "fragments",
                serde_json::json!([{"first_entry": 3, "ensemble": ["a:1", "b:1"]}]),
                "starts at entry 3",
            ),
            (
                "fragments",
                serde_json::json!([
                    {"first_entry": 0, "ensemble": ["a:1", "b:1"]},
                    {"first_entry": 0, "ensemble": ["a:1", "b:1"]}
                ]),
                "out of order",
            ),
            (
                "fragments",
                serde_json::json!([{"first_entry": 0, "ensemble": ["a:1"]}]),
                "has 1 bookies",
            ),
            ("master_key", serde_json::json!("é0"), "not hex"),
            ("write_quorum", serde_json::json!(3), "invalid quorums"),
        ];
        for (field, value, why) in cases {
            let mut v = record();
            v[field] = value;
            let e = decode(&v).unwrap_err();
            assert!(e.contains(why), "{field}: {e}");
        }
        assert!(LedgerMetadata::decode(b"{").is_err());
    }
}
