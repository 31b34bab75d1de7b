//! Managed cursors: named positions of consumers in a managed ledger.
//!
//! ```text
//!  state:  mark-delete M (every entry <= M acknowledged) + ranges acknowledged beyond M
//!          + read position (next entry to hand out)
//!  durable cursor: every change appends a snapshot {M, ranges} to the cursor's own ledger;
//!          /managed-cursors/<managed ledger>/<cursor> (CAS) names that ledger and keeps M
//!  open:   recover the cursor ledger (fence its old writer), read its last snapshot; the new
//!          cursor ledger (holding that state first) is started by the first change, and then
//!          the old one is deleted; a new cursor is recorded with its start position and no
//!          ledger, so an idle subscription costs one key, no ledger
//!  non-durable cursor (readers): the same state, never persisted
//! ```
//!
//! A snapshot keeps at most `ranges_persisted_max` ranges (the oldest); acknowledgements past
//! them are lost by a crash and those entries are delivered again (at least once), as Pulsar's
//! `managedLedgerMaxUnackedRangesToPersist` does.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use meridian_metadata::client::{ClientError, PutOptions};
use serde::{Deserialize, Serialize};

use crate::ledger::{LedgerClient, LedgerError, LedgerWriter};
use crate::managed_ledger::{ManagedLedger, ManagedLedgerError, Position};
use crate::rangeset::RangeSet;

pub const MANAGED_CURSORS_PREFIX: &str = "/managed-cursors/";

/// Where a cursor starts or is reset to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitialPosition {
    Earliest,
    Latest,
}

/// What a snapshot entry of a cursor ledger holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CursorSnapshot {
    /// `None`: nothing acknowledged yet (the cursor is before the first entry).
    pub mark_delete: Option<Position>,
    pub ranges: Vec<(Position, Position)>,
    /// Batch entries partly acknowledged: bit i set = message i still unacknowledged.
    pub batch_acks: Vec<(Position, Vec<u64>)>,
}

/// Version 1: mark-delete and ranges; version 2 adds partly acknowledged batches.
const SNAPSHOT_VERSION: u8 = 2;
/// Words of one batch's bit set (a batch of at most 64 × this many messages).
const BATCH_ACK_WORDS_MAX: u64 = 1024;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(b: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&byte, rest) = b.split_first()?;
        *b = rest;
        v |= u64::from(byte & 0x7f).checked_shl(shift)?;
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

impl CursorSnapshot {
    /// Compact encoding: varints, each range as deltas from the previous one (ledger delta,
    /// then start and length within the ledger), so many ranges cost a few bytes each.
    ///
    /// `version | has_md | [md ledger, md entry] | count | (ledger delta, lo delta, hi - lo)*
    ///  | batch count | (ledger, entry, words, word*)*`
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.ranges.len() * 6);
        out.push(SNAPSHOT_VERSION);
        match self.mark_delete {
            Some(md) => {
                out.push(1);
                put_varint(&mut out, md.ledger_id);
                put_varint(&mut out, md.entry_id);
            }
            None => out.push(0),
        }
        put_varint(&mut out, self.ranges.len() as u64);
        let (mut ledger, mut entry) = (0u64, 0u64);
        for (lo, hi) in &self.ranges {
            if lo.ledger_id != ledger {
                entry = 0;
            }
            put_varint(&mut out, lo.ledger_id - ledger);
            put_varint(&mut out, lo.entry_id.saturating_sub(entry));
            // A range within one ledger (the cursor only merges within a ledger).
            debug_assert_eq!(lo.ledger_id, hi.ledger_id, "a range spans ledgers");
            put_varint(&mut out, hi.entry_id.saturating_sub(lo.entry_id));
            ledger = lo.ledger_id;
            entry = hi.entry_id;
        }
        put_varint(&mut out, self.batch_acks.len() as u64);
        for (p, words) in &self.batch_acks {
            put_varint(&mut out, p.ledger_id);
            put_varint(&mut out, p.entry_id);
            put_varint(&mut out, words.len() as u64);
            for w in words {
                put_varint(&mut out, *w);
            }
        }
        out
    }

    pub fn decode(mut b: &[u8]) -> Option<CursorSnapshot> {
        let (&version, rest) = b.split_first()?;
        if version != 1 && version != SNAPSHOT_VERSION {
            return None;
        }
        b = rest;
        let (&has_md, rest) = b.split_first()?;
        b = rest;
        let mark_delete = match has_md {
            0 => None,
            1 => Some(Position::new(get_varint(&mut b)?, get_varint(&mut b)?)),
            _ => return None,
        };
        let count = get_varint(&mut b)?;
        if count > b.len() as u64 {
            return None;
        }
        let mut ranges = Vec::with_capacity(count as usize);
        let (mut ledger, mut entry) = (0u64, 0u64);
        for _ in 0..count {
            let dl = get_varint(&mut b)?;
            if dl != 0 {
                entry = 0;
            }
            ledger = ledger.checked_add(dl)?;
            let lo = entry.checked_add(get_varint(&mut b)?)?;
            let hi = lo.checked_add(get_varint(&mut b)?)?;
            ranges.push((Position::new(ledger, lo), Position::new(ledger, hi)));
            entry = hi;
        }
        let mut batch_acks = Vec::new();
        if version >= 2 {
            let count = get_varint(&mut b)?;
            if count > b.len() as u64 {
                return None;
            }
            for _ in 0..count {
                let p = Position::new(get_varint(&mut b)?, get_varint(&mut b)?);
                let n = get_varint(&mut b)?;
                if n > BATCH_ACK_WORDS_MAX || n > b.len() as u64 {
                    return None;
                }
                let words = (0..n)
                    .map(|_| get_varint(&mut b))
                    .collect::<Option<Vec<u64>>>()?;
                batch_acks.push((p, words));
            }
        }
        b.is_empty().then_some(CursorSnapshot {
            mark_delete,
            ranges,
            batch_acks,
        })
    }
}

/// The cursor's record in the metadata store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CursorInfo {
    pub cursor_ledger: Option<u64>,
    pub mark_delete: Option<Position>,
    /// Given when the cursor was created (a subscription's properties); kept as they are.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub properties: BTreeMap<String, String>,
}

#[derive(Debug, thiserror::Error)]
pub enum CursorError {
    #[error(transparent)]
    ManagedLedger(#[from] ManagedLedgerError),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error(transparent)]
    Metadata(#[from] ClientError),
    #[error("cursor {0}: changed by another owner")]
    Fenced(String),
    #[error("cursor {0} was closed: it takes no more changes")]
    Closed(String),
    #[error("invalid cursor name {0:?}: non-empty, no `/`")]
    BadName(String),
    #[error("corrupt cursor state {key}: {detail}")]
    BadState { key: String, detail: String },
}

/// Backlog of a cursor: entries not yet acknowledged, and their approximate size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Backlog {
    pub entries: u64,
    pub bytes: u64,
}

struct Durable {
    client: LedgerClient,
    key: String,
    version: u64,
    /// Started by the first change after the cursor was opened.
    writer: Option<LedgerWriter>,
    /// The ledger recorded before this one (the previous owner's, or one this owner gave
    /// up: rolled, or failed); deleted once the next one is recorded.
    previous: Option<u64>,
    /// A ledger whose recording has an unknown outcome (the store's reply was lost): the
    /// next start reads the record first to learn whether it names it.
    unsure: Option<u64>,
    /// Ledgers found not recorded after such an outcome: a put still on its way could name
    /// one yet, so they are deleted only once a later recording has changed the version.
    unrecorded: Vec<u64>,
    snapshots: u64,
}

/// The least time between a failed persist and the next change's attempt.
const PERSIST_RETRY: std::time::Duration = std::time::Duration::from_millis(100);

pub struct ManagedCursor {
    name: String,
    ml: Arc<ManagedLedger>,
    mark_delete: Option<Position>,
    ranges: RangeSet<Position>,
    /// Batch entries partly acknowledged (batch-index acks): bit i set = message i still
    /// unacknowledged, as in Pulsar's `ack_set`. Fully acknowledged entries leave this map.
    batch_acks: BTreeMap<Position, Vec<u64>>,
    /// Properties given at creation (a subscription's).
    properties: BTreeMap<String, String>,
    /// The last position handed out or skipped by reads; reading goes on after it.
    read_after: Option<Position>,
    durable: Option<Durable>,
    ranges_persisted_max: usize,
    /// Snapshots per cursor ledger before a new one is started.
    snapshots_per_ledger: u64,
    /// At most one snapshot per this interval; changes in between are persisted by the next
    /// change after it or by [`flush`](ManagedCursor::flush). Zero: every change is persisted
    /// before the call returns.
    persist_interval: std::time::Duration,
    last_persist: Option<std::time::Instant>,
    /// After a failed persist: no change persists before this (the flush still does).
    retry_after: Option<std::time::Instant>,
    dirty: bool,
    /// Closed cleanly ([`ManagedCursor::close`]): takes no more changes.
    closed: bool,
}

fn cursor_key(ml: &str, cursor: &str) -> String {
    format!("{MANAGED_CURSORS_PREFIX}{ml}/{cursor}")
}

/// An acknowledged range ahead at least this long (entries, less one) ends a read before it.
const SKIP_RANGE_MIN: u64 = 63;

impl ManagedCursor {
    fn blank(ml: Arc<ManagedLedger>, name: &str) -> ManagedCursor {
        ManagedCursor {
            name: name.to_string(),
            ml,
            mark_delete: None,
            ranges: RangeSet::new(),
            batch_acks: BTreeMap::new(),
            properties: BTreeMap::new(),
            read_after: None,
            durable: None,
            ranges_persisted_max: 10_000,
            snapshots_per_ledger: 10_000,
            persist_interval: std::time::Duration::ZERO,
            last_persist: None,
            retry_after: None,
            dirty: false,
            closed: false,
        }
    }

    /// A cursor that is never persisted (a reader), starting at `start`.
    pub async fn non_durable(ml: Arc<ManagedLedger>, start: InitialPosition) -> ManagedCursor {
        let mut c = Self::blank(ml, "");
        c.move_to(start).await;
        c
    }

    /// Recovers the ledger of durable cursor `name` of log `ml` (fences its writer, closes
    /// it) without opening the cursor, so that its next opening only reads the last snapshot.
    /// Nothing is created. The caller knows no cursor of its own writes that ledger (a
    /// broker's subscription not open there).
    pub async fn recover_ledger(
        client: &LedgerClient,
        ml: &str,
        name: &str,
    ) -> Result<(), CursorError> {
        let key = cursor_key(ml, name);
        let Some(kv) = client.metadata_client().get(&key).await? else {
            return Ok(());
        };
        let info: CursorInfo =
            serde_json::from_slice(&kv.value).map_err(|e| CursorError::BadState {
                key,
                detail: e.to_string(),
            })?;
        if let Some(id) = info.cursor_ledger {
            client.open_recover(id).await?;
        }
        Ok(())
    }

    /// Opens the durable cursor `name` of `ml` (creating it at `initial` if it does not exist).
    pub async fn open(
        client: LedgerClient,
        ml: Arc<ManagedLedger>,
        name: &str,
        initial: InitialPosition,
    ) -> Result<ManagedCursor, CursorError> {
        Self::open_with_properties(client, ml, name, initial, BTreeMap::new()).await
    }

    /// [`open`](ManagedCursor::open), recording `properties` if the cursor is created now (an
    /// existing cursor keeps the ones it was created with).
    pub async fn open_with_properties(
        client: LedgerClient,
        ml: Arc<ManagedLedger>,
        name: &str,
        initial: InitialPosition,
        properties: BTreeMap<String, String>,
    ) -> Result<ManagedCursor, CursorError> {
        if name.is_empty() || name.contains('/') {
            return Err(CursorError::BadName(name.to_string()));
        }
        let key = cursor_key(ml.name(), name);
        let existing = client.metadata_client().get(&key).await?;
        let mut c = Self::blank(ml, name);
        let (previous, version) = match &existing {
            None => {
                c.move_to(initial).await;
                // Recorded now (so the subscription and its start position exist), without a
                // ledger: that comes with the first acknowledgement.
                c.properties = properties;
                let info = CursorInfo {
                    cursor_ledger: None,
                    mark_delete: c.mark_delete,
                    properties: c.properties.clone(),
                };
                let put = client
                    .metadata_client()
                    .put_with(
                        &key,
                        serde_json::to_vec(&info).expect("serializable"),
                        PutOptions {
                            expected_version: Some(0),
                            ..PutOptions::default()
                        },
                    )
                    .await;
                match put {
                    Ok(p) => (None, p.version),
                    Err(ClientError::Conflict { .. }) => {
                        return Err(CursorError::Fenced(name.to_string()))
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            Some(kv) => {
                let info: CursorInfo =
                    serde_json::from_slice(&kv.value).map_err(|e| CursorError::BadState {
                        key: key.clone(),
                        detail: e.to_string(),
                    })?;
                c.mark_delete = info.mark_delete;
                c.properties = info.properties;
                if let Some(id) = info.cursor_ledger {
                    // Its writer may be a crashed owner: recover before reading the last snapshot.
                    let reader = client.open_recover(id).await?;
                    if let Some(last) = reader.last_entry() {
                        let bytes = reader.read(last).await?;
                        let snap = CursorSnapshot::decode(&bytes).ok_or_else(|| {
                            CursorError::BadState {
                                key: format!("cursor ledger {id} entry {last}"),
                                detail: "undecodable snapshot".into(),
                            }
                        })?;
                        c.mark_delete = snap.mark_delete;
                        for (lo, hi) in snap.ranges {
                            c.ranges.insert_range(lo, hi);
                        }
                        c.batch_acks = snap.batch_acks.into_iter().collect();
                    }
                }
                c.read_after = c.mark_delete;
                (info.cursor_ledger, kv.mod_revision)
            }
        };
        c.durable = Some(Durable {
            client,
            key,
            version,
            writer: None,
            previous,
            unsure: None,
            unrecorded: Vec::new(),
            snapshots: 0,
        });
        Ok(c)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The properties the cursor was created with.
    pub fn properties(&self) -> &BTreeMap<String, String> {
        &self.properties
    }

    /// Every entry up to this position is acknowledged (`None`: none is).
    pub fn mark_delete(&self) -> Option<Position> {
        self.mark_delete
    }

    /// The ledger the cursor's snapshots go to (`None`: not durable, or none started yet).
    pub fn cursor_ledger(&self) -> Option<u64> {
        let d = self.durable.as_ref()?;
        d.writer.as_ref().map(|w| w.id()).or(d.previous)
    }

    /// Ranges acknowledged beyond the mark-delete position.
    pub fn acknowledged_ranges(&self) -> Vec<(Position, Position)> {
        self.ranges.iter().collect()
    }

    /// Starts a new cursor ledger holding the current state, records it (CAS), and deletes the
    /// previous one. Failed, the cursor stays durable with no ledger of its own and dirty:
    /// the next change or flush tries again (a start cancelled before its recording leaves
    /// it so too; one cancelled after it has its version stale, and is Fenced until the
    /// topic is loaded again).
    async fn start_cursor_ledger(&mut self) -> Result<(), CursorError> {
        let r = match self.resolve_unsure().await {
            Ok(()) => {
                let d = self.durable.as_ref().expect("durable");
                self.record_new_cursor_ledger(&d.client, &d.key, d.version)
                    .await
            }
            Err(e) => Err((e, None)),
        };
        let name = self.name.clone();
        let d = self.durable.as_mut().expect("durable");
        match r {
            Ok((writer, version)) => {
                d.version = version;
                d.writer = Some(writer);
                d.snapshots = 1;
                // The version moved: no put still on its way can name these any more.
                let old: Vec<u64> = d
                    .previous
                    .take()
                    .into_iter()
                    .chain(std::mem::take(&mut d.unrecorded))
                    .collect();
                for old in old {
                    if let Err(e) = d.client.delete(old).await {
                        tracing::warn!(cursor = %name, ledger = old, error = %e, "deleting the previous cursor ledger failed");
                    }
                }
                Ok(())
            }
            Err((e, unsure)) => {
                if unsure.is_some() {
                    d.unsure = unsure;
                }
                self.dirty = true;
                Err(e)
            }
        }
    }

    /// After a recording whose outcome was unknown: whether the record names that ledger
    /// (it then replaced `previous`, which is deleted), or still has the version it had (the
    /// ledger is unused, and deleted once a later recording moves the version); otherwise
    /// another owner changed it (Fenced).
    async fn resolve_unsure(&mut self) -> Result<(), CursorError> {
        let name = self.name.clone();
        let Some(d) = self.durable.as_mut() else {
            return Ok(());
        };
        let Some(id) = d.unsure else {
            return Ok(());
        };
        let kv = d.client.metadata_client().get(&d.key).await?;
        let named = kv.as_ref().and_then(|kv| {
            serde_json::from_slice::<CursorInfo>(&kv.value)
                .ok()
                .and_then(|i| i.cursor_ledger)
        });
        // The cursor's fields change before any await: cancelled at the deletion, it is left
        // consistent (the deletion is tried again or the ledger left).
        match kv {
            Some(kv) if named == Some(id) => {
                let old = d.previous.replace(id);
                d.version = kv.mod_revision;
                d.unsure = None;
                if let Some(old) = old {
                    if let Err(e) = d.client.delete(old).await {
                        tracing::warn!(cursor = %name, ledger = old, error = %e, "deleting the previous cursor ledger failed");
                    }
                }
            }
            Some(kv) if kv.mod_revision == d.version => {
                d.unrecorded.push(id);
                d.unsure = None;
            }
            _ => return Err(CursorError::Fenced(name)),
        }
        Ok(())
    }

    /// A new cursor ledger holding the current state, recorded under `key` if its version is
    /// still `version`: the ledger's writer and the record's new version. Failed: the error,
    /// and the ledger if whether it was recorded is unknown.
    async fn record_new_cursor_ledger(
        &self,
        client: &LedgerClient,
        key: &str,
        version: u64,
    ) -> Result<(LedgerWriter, u64), (CursorError, Option<u64>)> {
        let mut props = self.ml.placement_properties();
        props.insert(
            "cursor".to_string(),
            format!("{}/{}", self.ml.name(), self.name),
        );
        let (e, qw, qa) = self.ml.quorums();
        let writer = client
            .create(e, qw, qa, props)
            .await
            .map_err(|e| (e.into(), None))?;
        if let Err(e) = writer.add(self.snapshot_bytes()).await {
            let id = writer.id();
            drop(writer);
            let _ = client.delete(id).await;
            return Err((e.into(), None));
        }
        let info = CursorInfo {
            cursor_ledger: Some(writer.id()),
            mark_delete: self.mark_delete,
            properties: self.properties.clone(),
        };
        let put = client
            .metadata_client()
            .put_with(
                key,
                serde_json::to_vec(&info).expect("serializable"),
                PutOptions {
                    expected_version: Some(version),
                    ..PutOptions::default()
                },
            )
            .await;
        let put = match put {
            Ok(_)
                if crate::failpoint::hit(&format!(
                    "cursor:reply_lost:{}/{}",
                    self.ml.name(),
                    self.name
                )) =>
            {
                Err(ClientError::Indeterminate(
                    "fail point: the reply was lost".into(),
                ))
            }
            put => put,
        };
        match put {
            Ok(p) => Ok((writer, p.version)),
            Err(e) => {
                let id = writer.id();
                let _ = writer.close().await;
                let unsure = if e.write_not_applied() {
                    let _ = client.delete(id).await;
                    None
                } else {
                    // The record may name it now: deleted, the cursor could not be opened
                    // again. It holds a snapshot of the state; the next start finds out.
                    tracing::warn!(cursor = %self.name, ledger = id, error = %e, "whether the new cursor ledger was recorded is unknown; it is kept");
                    Some(id)
                };
                Err((
                    match e {
                        ClientError::Conflict { .. } => CursorError::Fenced(self.name.clone()),
                        other => other.into(),
                    },
                    unsure,
                ))
            }
        }
    }

    fn snapshot_bytes(&self) -> Bytes {
        let ranges: Vec<(Position, Position)> =
            self.ranges.iter().take(self.ranges_persisted_max).collect();
        let batch_acks = self
            .batch_acks
            .iter()
            .take(self.ranges_persisted_max)
            .map(|(p, w)| (*p, w.clone()))
            .collect();
        Bytes::from(
            CursorSnapshot {
                mark_delete: self.mark_delete,
                ranges,
                batch_acks,
            }
            .encode(),
        )
    }

    /// Whether acknowledgements wait to be persisted (by the next change after the interval,
    /// or by [`flush`](ManagedCursor::flush)).
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// Persists at most one snapshot per `interval` (as Pulsar's mark-delete rate limit does):
    /// acknowledgements in between live in memory until the next snapshot or [`flush`], and a
    /// crash before it delivers them again. Zero (the default) persists every change.
    ///
    /// [`flush`]: ManagedCursor::flush
    pub fn set_persist_interval(&mut self, interval: std::time::Duration) {
        self.persist_interval = interval;
    }

    /// Persists the state now if anything changed since the last snapshot.
    pub async fn flush(&mut self) -> Result<(), CursorError> {
        if self.dirty {
            self.persist_now().await?;
        }
        Ok(())
    }

    /// A clean unload: persists what is pending and closes the cursor ledger, so that the
    /// next opening reads its last snapshot without recovering the ledger (a recovery fences
    /// the ledger's bookies and cannot finish while one holding its last snapshot is down).
    /// Its changes fail from here on with `Closed`: the next opening fences nothing, so this
    /// instance must never record a ledger of its own over the next owner's state. Deleting
    /// it still works.
    pub async fn close(&mut self) -> Result<(), CursorError> {
        // Closed whatever the flush gives: a failed one must not leave this instance able
        // to record a ledger of its own later.
        let flushed = self.flush().await;
        self.closed = true;
        let Some(d) = self.durable.as_mut() else {
            return flushed;
        };
        if let Some(writer) = d.writer.take() {
            // Still the recorded one: replaced (and deleted) by the next ledger started.
            d.previous = Some(writer.id());
            d.snapshots = 0;
            let closed = writer.close().await;
            flushed?;
            closed?;
            return Ok(());
        }
        flushed
    }

    /// A change happened: persist it now, or later under the rate limit.
    async fn persist(&mut self) -> Result<(), CursorError> {
        self.dirty = true;
        if self.closed && self.durable.is_some() {
            return Err(CursorError::Closed(self.name.clone()));
        }
        let now = std::time::Instant::now();
        let due = self
            .last_persist
            .is_none_or(|t| now.duration_since(t) >= self.persist_interval)
            && self.retry_after.is_none_or(|t| now >= t);
        if due {
            if let Err(e) = self.persist_now().await {
                // Tried again by a change once the interval (at least PERSIST_RETRY) has
                // passed since this failure, or by the flush; not by every change
                // meanwhile: an acknowledgement of a thousand messages while the store is
                // out costs one timeout, not one each.
                self.retry_after =
                    Some(std::time::Instant::now() + self.persist_interval.max(PERSIST_RETRY));
                return Err(e);
            }
            self.retry_after = None;
        }
        Ok(())
    }

    /// Makes the current state durable (a no-op for non-durable cursors): appends a snapshot to
    /// the cursor ledger; every `snapshots_per_ledger` snapshots a new cursor ledger starts.
    async fn persist_now(&mut self) -> Result<(), CursorError> {
        if self.closed && self.durable.is_some() {
            self.dirty = true;
            return Err(CursorError::Closed(self.name.clone()));
        }
        self.dirty = false;
        self.last_persist = Some(std::time::Instant::now());
        let bytes = self.snapshot_bytes();
        let Some(d) = self.durable.as_mut() else {
            return Ok(());
        };
        let Some(writer) = d.writer.as_ref() else {
            // The first change since the cursor was opened (or since its ledger was given
            // up): start a ledger with this state.
            return self.start_cursor_ledger().await;
        };
        match writer.add(bytes).await {
            Ok(_) => d.snapshots += 1,
            Err(LedgerError::Fenced(_)) => {
                self.dirty = true;
                return Err(CursorError::Fenced(self.name.clone()));
            }
            Err(e) => {
                // A writer that failed takes no more adds: the next change or flush starts a
                // new ledger, which replaces this one once recorded.
                let failed = d.writer.take().expect("writer");
                d.previous = Some(failed.id());
                d.snapshots = 0;
                self.dirty = true;
                return Err(e.into());
            }
        }
        if d.snapshots >= self.snapshots_per_ledger {
            // Replaced by the next ledger, which deletes it once recorded. The state is
            // persisted already: a failure here only leaves the next change to start it.
            let writer = d.writer.take().expect("writer");
            d.previous = Some(writer.id());
            d.snapshots = 0;
            if let Err(e) = writer.close().await {
                tracing::warn!(cursor = %self.name, error = %e, "closing a full cursor ledger failed");
            }
            if let Err(e) = self.start_cursor_ledger().await {
                tracing::warn!(cursor = %self.name, error = %e, "starting the next cursor ledger failed; the next change tries again");
            }
        }
        Ok(())
    }

    async fn next_after(&self, p: Option<Position>) -> Option<Position> {
        match p {
            Some(p) => self.ml.next_position(p).await,
            None => self.ml.first_position().await,
        }
    }

    /// Moves the mark-delete position over acknowledged ranges that now follow it.
    async fn fold(&mut self) {
        while let (Some(n), Some((lo, hi))) =
            (self.next_after(self.mark_delete).await, self.ranges.first())
        {
            // A range that starts before the next entry of the log covers it, or names only
            // positions the log does not have (a compacted view's entries in trimmed
            // ledgers): either way the mark-delete position moves over it.
            if lo > n {
                break;
            }
            self.ranges.remove_through(hi);
            self.mark_delete = Some(hi);
        }
    }

    /// Acknowledges one entry (and persists the cursor).
    pub async fn ack(&mut self, pos: Position) -> Result<(), CursorError> {
        if self.is_acknowledged(pos) {
            return Ok(());
        }
        self.ranges.insert(pos);
        self.batch_acks.remove(&pos);
        self.fold().await;
        self.persist().await
    }

    /// Acknowledges some messages of a batch entry: `unacked` has bit i set for each message
    /// still unacknowledged (the client's `ack_set`), and is intersected with what was left.
    /// When none is left the entry is acknowledged. Returns whether it now is.
    pub async fn ack_batch_index(
        &mut self,
        pos: Position,
        unacked: &[u64],
    ) -> Result<bool, CursorError> {
        if self.is_acknowledged(pos) {
            return Ok(true);
        }
        let merged: Vec<u64> = match self.batch_acks.get(&pos) {
            Some(old) => old
                .iter()
                .zip(unacked.iter().chain(std::iter::repeat(&0)))
                .map(|(a, b)| a & b)
                .collect(),
            None => unacked.to_vec(),
        };
        if merged.iter().all(|w| *w == 0) {
            self.ack(pos).await?;
            return Ok(true);
        }
        if self.batch_acks.get(&pos) == Some(&merged) {
            return Ok(false);
        }
        self.batch_acks.insert(pos, merged);
        self.persist().await?;
        Ok(false)
    }

    /// Acknowledges every entry of the log strictly between `after` (`None`: from the start)
    /// and `before`: entries a compacted view skipped (a later message of their keys
    /// replaced them). Persisted with the next acknowledgement or flush.
    pub async fn ack_between(&mut self, after: Option<Position>, before: Position) {
        let Some(last) = self.ml.last_confirmed() else {
            return;
        };
        // Nothing at or before the mark-delete position needs it.
        let after = match (after, self.mark_delete) {
            (Some(a), Some(md)) => Some(a.max(md)),
            (a, md) => a.or(md),
        };
        let mut changed = false;
        for l in self.ml.ledgers().await {
            let id = l.ledger_id;
            let lo = match after {
                Some(a) if a.ledger_id > id => continue,
                Some(a) if a.ledger_id == id => a.entry_id.saturating_add(1),
                _ => 0,
            };
            // One past the last entry of the range in this ledger.
            let end = if before.ledger_id < id {
                break;
            } else if before.ledger_id == id {
                before.entry_id
            } else {
                match l.entries {
                    Some(n) => n,
                    None if last.ledger_id == id => last.entry_id.saturating_add(1),
                    None => 0,
                }
            };
            if lo < end {
                self.ranges
                    .insert_range(Position::new(id, lo), Position::new(id, end - 1));
                changed = true;
            }
        }
        if changed {
            let ranges = &self.ranges;
            self.batch_acks.retain(|p, _| !ranges.contains(*p));
            self.fold().await;
            self.dirty = true;
        }
    }

    /// Every partly acknowledged batch entry with what is left of it (bit i = message i).
    pub fn batch_acks(&self) -> Vec<(Position, Vec<u64>)> {
        self.batch_acks
            .iter()
            .map(|(p, w)| (*p, w.clone()))
            .collect()
    }

    /// What is left unacknowledged of a partly acknowledged batch entry (bit i = message i).
    pub fn batch_ack_set(&self, pos: Position) -> Option<&[u64]> {
        self.batch_acks.get(&pos).map(Vec::as_slice)
    }

    /// Acknowledges every entry up to and including `pos` (and persists the cursor).
    pub async fn ack_cumulative(&mut self, pos: Position) -> Result<(), CursorError> {
        if self.mark_delete.is_some_and(|md| pos <= md) {
            return Ok(());
        }
        self.mark_delete = Some(pos);
        self.ranges.remove_through(pos);
        self.batch_acks.retain(|p, _| *p > pos);
        self.fold().await;
        if self.read_after.is_none_or(|r| r < pos) {
            self.read_after = Some(pos);
        }
        self.persist().await
    }

    pub fn is_acknowledged(&self, pos: Position) -> bool {
        self.mark_delete.is_some_and(|md| pos <= md) || self.ranges.contains(pos)
    }

    /// Reads up to `max` entries after the read position, skipping acknowledged ones, and moves
    /// the read position past them. A read that fails after earlier ones this call returns
    /// what those found.
    pub async fn read_entries(
        &mut self,
        max: usize,
    ) -> Result<Vec<(Position, Bytes)>, CursorError> {
        let mut out = Vec::new();
        'reading: while out.len() < max {
            // Nothing through the mark-delete position is read again (it can pass the read
            // position when an acknowledgement fills the gap before a range).
            self.read_after = self.read_after.max(self.mark_delete);
            let Some(mut start) = self.next_after(self.read_after).await else {
                break;
            };
            // Ranges acknowledged beyond the mark-delete position are passed over without
            // reading them (a consumer that acknowledged all but a few of thousands of
            // entries read them all again, a few at a time, holding its subscription's lock:
            // a schedule's 49 s without a delivery).
            while let Some((_, hi)) = self.ranges.range_containing(start) {
                self.read_after = Some(hi);
                match self.next_after(Some(hi)).await {
                    Some(n) => start = n,
                    None => break 'reading,
                }
            }
            // Parallel reads of the next positions, acknowledged ones dropped after; up to a
            // long acknowledged range ahead, in this ledger or a later one (short ones are
            // read through: stopping at each would make scattered acknowledgements one read
            // each).
            let mut want = max - out.len();
            if let Some((lo, hi)) = self.ranges.first_from(start) {
                if hi.ledger_id == lo.ledger_id && hi.entry_id - lo.entry_id >= SKIP_RANGE_MIN {
                    let ahead = if lo.ledger_id == start.ledger_id {
                        Some(lo.entry_id - start.entry_id)
                    } else {
                        match (self.ml.index_of(start).await, self.ml.index_of(lo).await) {
                            (Some(a), Some(b)) => b.checked_sub(a),
                            _ => None,
                        }
                    };
                    // (Never 0: `start` is not in a range. A 0 would end the read here.)
                    if let Some(ahead) = ahead.filter(|a| *a > 0) {
                        want = want.min(usize::try_from(ahead).unwrap_or(want));
                    }
                }
            }
            let batch = match self.ml.read_range(start, want).await {
                Ok(b) => b,
                // What was read stays read (the read position is past it): handed on.
                Err(_) if !out.is_empty() => break,
                Err(e) => return Err(e.into()),
            };
            if batch.is_empty() {
                break;
            }
            for (p, b) in batch {
                if !self.is_acknowledged(p) {
                    out.push((p, b));
                }
                self.read_after = Some(p);
            }
        }
        Ok(out)
    }

    /// Entries not acknowledged yet and their approximate size (the log's average entry size).
    pub async fn backlog(&self) -> Backlog {
        let (total, total_bytes) = self.ml.size().await;
        let Some(last) = self.ml.last_confirmed() else {
            return Backlog::default();
        };
        let last_index = self.ml.index_of(last).await.unwrap_or(0);
        let after_md = match self.mark_delete {
            None => last_index + 1,
            Some(md) => match self.ml.index_of(md).await {
                Some(i) => last_index.saturating_sub(i),
                // Trimmed away: everything kept is after it.
                None => last_index + 1,
            },
        };
        let acked: u64 = self
            .ranges
            .iter()
            .map(|(lo, hi)| {
                if lo.ledger_id == hi.ledger_id {
                    hi.entry_id - lo.entry_id + 1
                } else {
                    1
                }
            })
            .sum();
        let entries = after_md.saturating_sub(acked);
        let bytes = entries
            .saturating_mul(total_bytes)
            .checked_div(total)
            .unwrap_or(0);
        Backlog { entries, bytes }
    }

    async fn move_to(&mut self, to: InitialPosition) {
        self.ranges = RangeSet::new();
        self.batch_acks.clear();
        match to {
            InitialPosition::Earliest => self.mark_delete = None,
            InitialPosition::Latest => self.mark_delete = self.ml.last_confirmed(),
        }
        self.read_after = self.mark_delete;
    }

    /// Resets the cursor to the earliest or latest entry (and persists it).
    /// Positions the cursor so reading starts after `pos` (everything through it counts as
    /// acknowledged), as a reader started from a message id is.
    pub async fn reset_after(&mut self, pos: Position) -> Result<(), CursorError> {
        self.ranges = RangeSet::new();
        self.batch_acks.clear();
        self.mark_delete = Some(pos);
        self.read_after = Some(pos);
        self.persist().await
    }

    /// Reading starts again after the mark-delete position: entries read and not
    /// acknowledged are read again (a replicator after a reconnect).
    pub fn rewind(&mut self) {
        self.read_after = self.mark_delete;
    }

    /// The position reading continues after (`None`: from the first entry).
    pub fn read_position(&self) -> Option<Position> {
        self.read_after
    }

    /// Deletes the cursor: its record in the metadata store and its cursor ledger.
    pub async fn delete(&mut self) -> Result<(), CursorError> {
        self.resolve_unsure().await?;
        let Some(d) = self.durable.as_mut() else {
            return Ok(());
        };
        if let Some(w) = d.writer.take() {
            // Its ledger is the recorded one from here (a failed deletion leaves the cursor
            // durable, to start a new ledger or be deleted again).
            d.previous = Some(w.id());
            let _ = w.close().await;
        }
        match d
            .client
            .metadata_client()
            .delete(&d.key, Some(d.version))
            .await
        {
            Ok(_) => {}
            Err(ClientError::Conflict { .. }) => {
                return Err(CursorError::Fenced(self.name.clone()))
            }
            Err(e) => return Err(e.into()),
        }
        let d = self.durable.take().expect("durable");
        // With the record gone no put still on its way can name the unrecorded ones.
        for id in d.previous.into_iter().chain(d.unrecorded) {
            if let Err(e) = d.client.delete(id).await {
                tracing::warn!(cursor = %self.name, ledger = id, error = %e, "deleting the cursor ledger failed");
            }
        }
        Ok(())
    }

    pub async fn reset(&mut self, to: InitialPosition) -> Result<(), CursorError> {
        self.move_to(to).await;
        self.persist().await
    }

    /// Resets the cursor so that `pos` is the next entry read: everything before it counts as
    /// acknowledged, everything from it on as not (and persists it).
    pub async fn reset_to_position(&mut self, pos: Position) -> Result<(), CursorError> {
        self.ranges = RangeSet::new();
        self.batch_acks.clear();
        // A position of the log: the entry before it. One before the log's first entry (in
        // a trimmed ledger, as a compacted view's entries may be): the position just before
        // it, so nothing before it counts as unread.
        let last = self.ml.last_confirmed();
        self.mark_delete = match self.ml.index_of(pos).await.and_then(|i| i.checked_sub(1)) {
            Some(i) => self.ml.position_at(i).await,
            // Past the end of the log: from the next entry appended.
            None if last.is_some_and(|l| pos > l) => last,
            None => pos.before(),
        };
        self.read_after = self.mark_delete;
        self.persist().await
    }

    /// Moves only the read position: reading continues after `pos` (entries through it were
    /// served from elsewhere, such as the topic's compacted view).
    pub fn set_read_after(&mut self, pos: Position) {
        self.read_after = Some(pos);
    }

    /// Resets the cursor to the first entry whose publish time (as `publish_time` reads it
    /// from the entry) is at or after `time`: a binary search over the log.
    pub async fn reset_to_time(
        &mut self,
        time: u64,
        publish_time: impl Fn(&Bytes) -> u64,
    ) -> Result<(), CursorError> {
        if self.ml.last_confirmed().is_none() {
            return self.reset(InitialPosition::Earliest).await;
        }
        match self.position_at_time(time, publish_time).await? {
            Some(p) => self.reset_to_position(p).await,
            None => self.reset(InitialPosition::Latest).await,
        }
    }

    /// The first entry published at or after `time` (binary search over the log; publish
    /// times are taken as non-decreasing), `None` if every entry is older.
    pub async fn position_at_time(
        &self,
        time: u64,
        publish_time: impl Fn(&Bytes) -> u64,
    ) -> Result<Option<Position>, CursorError> {
        let Some(last) = self.ml.last_confirmed() else {
            return Ok(None);
        };
        let first = self.ml.first_position().await.unwrap_or(last);
        let (mut lo, mut hi) = (
            self.ml.index_of(first).await.unwrap_or(0),
            self.ml.index_of(last).await.unwrap_or(0) + 1,
        );
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let Some(p) = self.ml.position_at(mid).await else {
                break;
            };
            if publish_time(&self.ml.read(p).await?) < time {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        Ok(self.ml.position_at(lo).await)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn given_snapshots_then_compact_encoding_round_trips_and_costs_a_few_bytes_per_range() {
        let seed: u64 = rand::random();
        println!("seed {seed}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for _ in 0..500 {
            let mut ranges = Vec::new();
            let mut ledger = rng.gen_range(0..1_000u64);
            let mut entry = 0u64;
            for _ in 0..rng.gen_range(0..200) {
                if rng.gen_bool(0.1) {
                    ledger += rng.gen_range(1..5);
                    entry = 0;
                }
                let lo = entry + rng.gen_range(0..10);
                let hi = lo + rng.gen_range(0..10);
                ranges.push((Position::new(ledger, lo), Position::new(ledger, hi)));
                entry = hi + 2;
            }
            let batch_acks = (0..rng.gen_range(0..4))
                .map(|_| {
                    let words = (0..rng.gen_range(1..3)).map(|_| rng.gen()).collect();
                    (Position::new(rng.gen_range(0..1000), rng.gen()), words)
                })
                .collect();
            let s = CursorSnapshot {
                mark_delete: rng
                    .gen_bool(0.8)
                    .then(|| Position::new(rng.gen(), rng.gen())),
                ranges,
                batch_acks,
            };
            let bytes = s.encode();
            assert_eq!(
                CursorSnapshot::decode(&bytes).as_ref(),
                Some(&s),
                "seed {seed}"
            );
            assert!(
                bytes.len() <= 24 + s.ranges.len() * 6 + s.batch_acks.len() * 60,
                "seed {seed}: {} bytes",
                bytes.len()
            );
            // Damaged bytes never panic.
            let mut bad = bytes.clone();
            let at = rng.gen_range(0..bad.len());
            bad[at] = rng.gen();
            let _ = CursorSnapshot::decode(&bad);
            let _ = CursorSnapshot::decode(&bytes[..rng.gen_range(0..bytes.len())]);
        }
    }
}
