//! Ledger recovery: what a client does with a ledger whose writer may be gone before it reads
//! the ledger to its end or writes after it.
//!
//! ```text
//!  InRecovery (CAS) ─► fence the last fragment's bookies (LAC from their answers)
//!  ─► read forward from LAC+1 a window of entries at once, each from its write set
//!     (first verified copy wins; stop at the first entry that no replica holds and enough
//!     replicas confirm absent)
//!  ─► rewrite the window's entries at once, each to its whole write set (a bookie of the last
//!     fragment that cannot take them replaced from the first entry it missed)
//!  ─► Closed at the last entry found (CAS), the replacements recorded with it
//! ```
//!
//! Windows matter for more than round trips: a bookie answers an add only after its journal's
//! fdatasync, and adds that arrive together share one, so rewriting hundreds of entries one at
//! a time cost hundreds of syncs (tens of seconds on a busy disk, while the topic waited).

use std::collections::BTreeSet;
use std::sync::Arc;

use bytes::Bytes;
use futures::stream::{FuturesUnordered, StreamExt};

use super::{
    affinity_groups, Fragment, LedgerClient, LedgerError, LedgerMetadata, LedgerReader, LedgerState,
};
use crate::proto::{self, Request, Response, Status, ADD_RECOVERY, NONE};
use crate::striping::Quorums;
use meridian_metadata::client::ClientError;

/// A window: entries read, then rewritten all at once, at most this many and about this many
/// bytes (the read that passes the bytes ends it).
const WINDOW_ENTRIES: u64 = 256;
const WINDOW_BYTES: usize = 16 << 20;
/// Entries a window's reads ask for at once (read in order; the first absent one ends the
/// recovery).
const READS_IN_FLIGHT: usize = 16;

/// What the replicas of one entry said of it.
enum Found {
    /// A copy that verifies.
    Entry(Bytes),
    /// Enough replicas lack it that it cannot have been acknowledged.
    Absent,
    /// Neither: why.
    Unknown(String),
}

/// One entry's rewrite to a bookie that did not take it.
struct Missed {
    /// The bookie's place in the ensemble.
    index: usize,
    why: String,
    /// Whether another bookie could take it instead (unreachable, read-only, failing), as
    /// against an answer no replacement changes (fenced by a third client, a refused key).
    replaceable: bool,
}

/// One recovery's state.
struct Recovery<'a> {
    client: &'a LedgerClient,
    /// The metadata as fenced: entries are looked for where the writer put them.
    meta: LedgerMetadata,
    q: Quorums,
    key: Bytes,
    /// Ensemble changes of the rewrites, recorded only with the close: a recovery started
    /// again after this one stopped midway must never take a replacement's "no such entry"
    /// for an answer.
    changes: Vec<Fragment>,
    /// Bookies that could not be reached or refused a rewrite: no rewrite goes to them again
    /// during this recovery (they are still read).
    down: BTreeSet<String>,
    rewritten: u64,
}

impl LedgerClient {
    /// Opens a ledger with recovery: fences it on its bookies (its writer can add no more),
    /// recovers every entry that may have been acknowledged, and closes it.
    pub async fn open_recover(&self, id: u64) -> Result<LedgerReader, LedgerError> {
        let (mut meta, mut version) = self.metadata(id).await?;
        if meta.state == LedgerState::Closed {
            return Ok(LedgerReader {
                client: self.clone(),
                meta,
            });
        }
        if meta.state == LedgerState::Open {
            meta.state = LedgerState::InRecovery;
            version = self.cas_metadata(&meta, version).await?;
        }
        let mut r = Recovery {
            client: self,
            q: meta.quorums()?,
            key: meta.key_bytes(),
            meta,
            changes: Vec::new(),
            down: BTreeSet::new(),
            rewritten: 0,
        };
        let lac = r.fence().await?;
        let first = if lac == NONE { 0 } else { lac + 1 };
        let end = r.recover_from(first).await?;
        let meta = r.close(version, end.checked_sub(1)).await?;
        Ok(LedgerReader {
            client: self.clone(),
            meta,
        })
    }
}

impl Recovery<'_> {
    fn id(&self) -> u64 {
        self.meta.id
    }

    fn last_fragment(&self) -> &Fragment {
        self.meta.fragments.last().expect("a ledger has a fragment")
    }

    /// Fences enough bookies of the last fragment that no ack quorum can form for the old
    /// writer; the highest LAC they report.
    async fn fence(&mut self) -> Result<u64, LedgerError> {
        let id = self.id();
        let ensemble = self.last_fragment().ensemble.clone();
        let calls = ensemble.iter().enumerate().map(|(i, addr)| {
            let pool = Arc::clone(&self.client.pool);
            let request = Request::Fence {
                ledger_id: id,
                master_key: self.key.clone(),
            };
            let addr = addr.clone();
            async move { (i, pool.call(&addr, request).await) }
        });
        let mut answered = 0u64;
        let mut lac = NONE;
        let mut errors = Vec::new();
        for (i, r) in futures::future::join_all(calls).await {
            match r {
                Ok(Response::Lac {
                    status: Status::Ok,
                    lac: l,
                    ..
                }) => {
                    answered |= 1 << i;
                    if l != NONE && (lac == NONE || l > lac) {
                        lac = l;
                    }
                }
                Ok(Response::Lac {
                    status: Status::Unauthorized,
                    ..
                }) => {
                    return Err(LedgerError::Failed {
                        ledger: id,
                        detail: format!("bookie {} refused the ledger's key", ensemble[i]),
                    })
                }
                Ok(other) => errors.push(format!("{}: {other:?}", ensemble[i])),
                Err(e) => {
                    self.down.insert(ensemble[i].clone());
                    errors.push(e.to_string())
                }
            }
        }
        if !self.q.covers_every_ack_quorum(answered) {
            return Err(LedgerError::Failed {
                ledger: id,
                detail: format!("could not fence enough bookies: {}", errors.join("; ")),
            });
        }
        Ok(lac)
    }

    /// Reads and rewrites from `first` on, a window at a time, up to the first entry that
    /// cannot have been acknowledged: that entry's number (the end).
    async fn recover_from(&mut self, first: u64) -> Result<u64, LedgerError> {
        let mut next = first;
        loop {
            let (entries, ended, unreachable) = {
                // Read in order, READS_IN_FLIGHT at once, until the window is full in entries
                // or bytes or the recovery's end is found.
                let mut reads = futures::stream::iter(next..next + WINDOW_ENTRIES)
                    .map(|e| self.read(e))
                    .buffered(READS_IN_FLIGHT);
                let mut entries = Vec::new();
                let mut bytes = 0;
                let mut ended = false;
                let mut unreachable = Vec::new();
                while let Some((found, gone)) = reads.next().await {
                    unreachable.extend(gone);
                    let e = next + entries.len() as u64;
                    match found {
                        Found::Entry(b) => {
                            bytes += b.len();
                            entries.push(b);
                        }
                        Found::Absent => {
                            ended = true;
                            break;
                        }
                        Found::Unknown(why) => {
                            return Err(LedgerError::Failed {
                                ledger: self.id(),
                                detail: format!(
                                    "recovery cannot tell whether entry {e} was acknowledged: {why}"
                                ),
                            })
                        }
                    }
                    if bytes >= WINDOW_BYTES {
                        break;
                    }
                }
                (entries, ended, unreachable)
            };
            self.down.extend(unreachable);
            self.rewrite(next, &entries).await?;
            next += entries.len() as u64;
            if ended {
                return Ok(next);
            }
        }
    }

    /// Asks `entry`'s whole write set for it (where the writer put it): the first copy that
    /// verifies answers; it is absent only once every replica answered and enough of them
    /// lack it (a copy anywhere is recovered, as BookKeeper does: taking the first "no such
    /// entry" for the answer would close the ledger before an entry a replica holds).
    /// With the bookies that could not be reached.
    async fn read(&self, entry: u64) -> (Found, Vec<String>) {
        let id = self.id();
        let frag = self.meta.fragment_of(entry);
        let mut asks: FuturesUnordered<_> = self
            .q
            .write_set(entry)
            .map(|i| super::read_from(&self.client.pool, frag.ensemble[i].clone(), id, entry))
            .collect();
        let mut problems = Vec::new();
        let mut absent = 0;
        let mut unreachable = Vec::new();
        while let Some((addr, r)) = asks.next().await {
            match r {
                Ok(Response::Read {
                    status: Status::Ok,
                    entry: bytes,
                    ..
                }) => match proto::open(&bytes) {
                    Ok(e) if e.ledger_id == id && e.entry_id == entry => {
                        return (Found::Entry(bytes), unreachable)
                    }
                    _ => problems.push(format!("{addr}: an entry that does not verify")),
                },
                Ok(Response::Read {
                    status: Status::NoSuchEntry | Status::NoSuchLedger,
                    ..
                }) => {
                    absent += 1;
                    problems.push(format!("{addr}: no such entry"));
                }
                Ok(other) => problems.push(format!("{addr}: {other:?}")),
                Err(e) => {
                    problems.push(format!("{addr}: {e}"));
                    unreachable.push(addr);
                }
            }
        }
        if absent >= self.q.absent_confirmations() {
            return (Found::Absent, unreachable);
        }
        (Found::Unknown(problems.join("; ")), unreachable)
    }

    /// The ensemble a rewrite of `entry` goes to: this recovery's last change if it covers
    /// the entry, else where the writer put it.
    fn ensemble_for(&self, entry: u64) -> &[String] {
        match self.changes.last() {
            Some(f) if f.first_entry <= entry => &f.ensemble,
            _ => &self.meta.fragment_of(entry).ensemble,
        }
    }

    /// Rewrites `entries` (numbered from `first`) each to its whole write set, all at once, so
    /// that each is on at least Qa bookies. In the ledger's last fragment, bookies that cannot
    /// take them are replaced from the first entry that missed an ack quorum on, as a
    /// writer's ensemble change would, and the entries from there on written again. An entry
    /// of an earlier fragment was acknowledged before the writer changed its ensemble (it does
    /// so only after its LAC): its rewrite is only a help.
    async fn rewrite(&mut self, first: u64, entries: &[Bytes]) -> Result<(), LedgerError> {
        let id = self.id();
        let last_start = self.last_fragment().first_entry;
        let mut from = 0;
        let mut replaced = 0;
        while from < entries.len() {
            let writes = entries[from..]
                .iter()
                .enumerate()
                .map(|(k, bytes)| self.write(first + (from + k) as u64, bytes.clone()));
            let outcomes = futures::future::join_all(writes).await;
            self.rewritten += outcomes.len() as u64;
            let mut short: Option<(u64, String)> = None;
            for (k, missed) in outcomes.into_iter().enumerate() {
                let entry = first + (from + k) as u64;
                let ensemble = self.ensemble_for(entry).to_vec();
                for m in missed.iter().filter(|m| m.replaceable) {
                    self.down.insert(ensemble[m.index].clone());
                }
                if self.q.write() - missed.len() >= self.q.ack() || short.is_some() {
                    continue;
                }
                let why = missed
                    .iter()
                    .map(|m| format!("{}: {}", ensemble[m.index], m.why))
                    .collect::<Vec<_>>()
                    .join("; ");
                if entry < last_start {
                    tracing::warn!(ledger = id, entry, problems = %why, "recovery: an entry acknowledged before an ensemble change could not be rewritten to a whole ack quorum; it stays where it was acknowledged");
                    continue;
                }
                if missed.iter().any(|m| !m.replaceable) || replaced >= 2 * self.q.write() {
                    return Err(self.short(entry, &why, ""));
                }
                short = Some((entry, why));
            }
            let Some((entry, why)) = short else {
                return Ok(());
            };
            replaced += self.replace_down_from(entry, &why).await?;
            from = (entry - first) as usize;
        }
        Ok(())
    }

    fn short(&self, entry: u64, why: &str, more: &str) -> LedgerError {
        LedgerError::Failed {
            ledger: self.id(),
            detail: format!(
                "recovery could not rewrite entry {entry} to {} bookies: {why}{more}",
                self.q.ack()
            ),
        }
    }

    /// Writes one entry to its write set: the bookies that did not take it.
    fn write(&self, entry: u64, bytes: Bytes) -> impl std::future::Future<Output = Vec<Missed>> {
        let id = self.id();
        let ensemble = self.ensemble_for(entry).to_vec();
        let calls: Vec<_> = self
            .q
            .write_set(entry)
            .map(|index| {
                let addr = ensemble[index].clone();
                let skip = self.down.contains(&addr);
                let pool = Arc::clone(&self.client.pool);
                let request = Request::Add {
                    ledger_id: id,
                    entry_id: entry,
                    flags: ADD_RECOVERY,
                    master_key: self.key.clone(),
                    entry: bytes.clone(),
                };
                async move {
                    if skip {
                        return Some(Missed {
                            index,
                            why: "not reached earlier in this recovery".into(),
                            replaceable: true,
                        });
                    }
                    match pool.call(&addr, request).await {
                        Ok(Response::Add {
                            status: Status::Ok, ..
                        }) => None,
                        Ok(Response::Add {
                            status: s @ (Status::ReadOnly | Status::Internal),
                            ..
                        }) => Some(Missed {
                            index,
                            why: format!("{s:?}"),
                            replaceable: true,
                        }),
                        Ok(other) => Some(Missed {
                            index,
                            why: format!("{other:?}"),
                            replaceable: false,
                        }),
                        Err(e) => Some(Missed {
                            index,
                            why: e.to_string(),
                            replaceable: true,
                        }),
                    }
                }
            })
            .collect();
        async move {
            futures::future::join_all(calls)
                .await
                .into_iter()
                .flatten()
                .collect()
        }
    }

    /// Replaces every bookie of the ensemble in force at `entry` that could not be reached or
    /// refused a rewrite, from `entry` on: how many were replaced.
    async fn replace_down_from(&mut self, entry: u64, why: &str) -> Result<usize, LedgerError> {
        let id = self.id();
        let mut ensemble = self.ensemble_for(entry).to_vec();
        let gone: Vec<usize> = (0..ensemble.len())
            .filter(|&i| self.down.contains(&ensemble[i]))
            .collect();
        if gone.is_empty() {
            return Err(self.short(entry, why, ""));
        }
        let staying: Vec<String> = (0..ensemble.len())
            .filter(|i| !gone.contains(i))
            .map(|i| ensemble[i].clone())
            .collect();
        let mut exclude = ensemble.clone();
        exclude.extend(self.last_fragment().ensemble.iter().cloned());
        exclude.extend(self.down.iter().cloned());
        exclude.sort();
        exclude.dedup();
        let chosen = self
            .client
            .choose_bookies(
                gone.len(),
                &exclude,
                &staying,
                &affinity_groups(&self.meta.properties),
            )
            .await
            .map_err(|e| {
                self.short(
                    entry,
                    why,
                    &format!(", and no bookie can replace them: {e}"),
                )
            })?;
        for (&i, to) in gone.iter().zip(chosen) {
            tracing::info!(ledger = id, from = %ensemble[i], to = %to, first_entry = entry, "recovery: ensemble changed");
            ensemble[i] = to;
        }
        let f = Fragment {
            first_entry: entry,
            ensemble,
        };
        match self.changes.last_mut() {
            Some(l) if l.first_entry == entry => *l = f,
            _ => self.changes.push(f),
        }
        Ok(gone.len())
    }

    /// Closes the ledger at `last_entry` with this recovery's ensemble changes. Autorecovery
    /// may have replaced a bookie of an earlier fragment meanwhile: its metadata is taken and
    /// closed instead, as long as the fenced fragment is still the last.
    async fn close(
        self,
        mut version: u64,
        last_entry: Option<u64>,
    ) -> Result<LedgerMetadata, LedgerError> {
        let id = self.id();
        let fenced_last = self.last_fragment().clone();
        let mut meta = self.meta.clone();
        for f in &self.changes {
            meta.append_fragment(f.clone());
        }
        let mut attempts = 0;
        loop {
            meta.state = LedgerState::Closed;
            meta.last_entry = last_entry;
            match self.client.cas_metadata(&meta, version).await {
                Ok(_) => break,
                Err(LedgerError::Metadata(ClientError::Conflict { .. })) if attempts < 10 => {
                    attempts += 1;
                    let (now, v) = self.client.metadata(id).await?;
                    if now.state != LedgerState::InRecovery
                        || now.fragments.last() != Some(&fenced_last)
                    {
                        return Err(LedgerError::Failed {
                            ledger: id,
                            detail: format!(
                                "another client changed the ledger during recovery (now {:?})",
                                now.state
                            ),
                        });
                    }
                    meta = now;
                    for f in &self.changes {
                        meta.append_fragment(f.clone());
                    }
                    version = v;
                }
                Err(e) => return Err(e),
            }
        }
        tracing::info!(
            ledger = id,
            last_entry = ?meta.last_entry,
            rewritten = self.rewritten,
            ensemble_changes = self.changes.len(),
            "ledger recovered and closed"
        );
        Ok(meta)
    }
}
