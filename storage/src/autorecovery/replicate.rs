//! A replication worker's job: make the missing replicas of one under-replicated ledger again.
//!
//! For each missing fragment and each gone bookie of it: a replacement is chosen by the
//! placement policy (writable, not in the fragment's ensemble, racks the ensemble lacks first);
//! every entry that bookie held is read from the other replicas of its write set (the gone
//! bookie last, for a decommissioned one that still answers), its envelope verified (checksum,
//! ledger and entry) and written to the replacement as a recovery add; once all are there, the
//! bookie is swapped in the fragment's ensemble by compare-and-set. Nothing is ever deleted, and
//! an entry no replica can give verified is an error that leaves the ledger marked.

use std::collections::BTreeSet;

use bytes::Bytes;
use futures::StreamExt;
use meridian_metadata::client::ClientError;

use super::audit::{missing_fragments, MissingFragment};
use crate::ledger::{LedgerClient, LedgerError, LedgerMetadata};
use crate::proto::{self, Request, Response, Status, ADD_RECOVERY};

/// What one ledger's replication did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Replicated {
    pub fragments: usize,
    pub entries: u64,
    pub bytes: u64,
    /// The ledger was deleted meanwhile: nothing to do.
    pub deleted: bool,
}

/// Makes the replicas of `id` that were on `gone` bookies again. `window`: entries copied at once.
pub async fn replicate_ledger(
    client: &LedgerClient,
    id: u64,
    gone: &BTreeSet<String>,
    window: usize,
) -> Result<Replicated, LedgerError> {
    let mut done = Replicated::default();
    let Some(meta) = fetch(client, id).await? else {
        done.deleted = true;
        return Ok(done);
    };
    let work: Vec<(u64, String)> = missing_fragments(&meta, gone)
        .into_iter()
        .flat_map(|mf| mf.bookies.into_iter().map(move |b| (mf.first_entry, b)))
        .collect();
    for (first_entry, lost) in work {
        // The metadata as it is now: an earlier swap put a replacement in this ensemble,
        // which must not be chosen again for another slot.
        let Some(meta) = fetch(client, id).await? else {
            done.deleted = true;
            return Ok(done);
        };
        let Some(mf) = missing_fragments(&meta, gone)
            .into_iter()
            .find(|m| m.first_entry == first_entry && m.bookies.contains(&lost))
        else {
            continue;
        };
        let Some(index) = meta
            .fragment_of(mf.first_entry)
            .ensemble
            .iter()
            .position(|b| *b == lost)
        else {
            continue;
        };
        let (entries, bytes, replacement) =
            copy_fragment(client, &meta, &mf, index, gone, window).await?;
        match swap(client, id, mf.first_entry, index, &lost, &replacement).await? {
            Swap::Done => {}
            Swap::Deleted => {
                done.deleted = true;
                return Ok(done);
            }
        }
        tracing::info!(
            ledger = id,
            first_entry = mf.first_entry,
            last_entry = mf.last_entry,
            from = %lost,
            to = %replacement,
            entries,
            bytes,
            "fragment re-replicated"
        );
        metrics::counter!("meridian_autorecovery_fragments_replicated_total").increment(1);
        done.fragments += 1;
        done.entries += entries;
        done.bytes += bytes;
    }
    Ok(done)
}

async fn fetch(client: &LedgerClient, id: u64) -> Result<Option<LedgerMetadata>, LedgerError> {
    match client.metadata(id).await {
        Ok((m, _)) => Ok(Some(m)),
        Err(LedgerError::NoSuchLedger(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Copies what bookie `index` of the fragment held to a replacement; answers (entries, bytes,
/// the replacement).
async fn copy_fragment(
    client: &LedgerClient,
    meta: &LedgerMetadata,
    mf: &MissingFragment,
    index: usize,
    gone: &BTreeSet<String>,
    window: usize,
) -> Result<(u64, u64, String), LedgerError> {
    let id = meta.id;
    let q = meta.quorums()?;
    let ensemble = meta.fragment_of(mf.first_entry).ensemble.clone();
    let mut exclude: Vec<String> = ensemble.clone();
    exclude.extend(gone.iter().cloned());
    let staying: Vec<String> = (0..ensemble.len())
        .filter(|i| *i != index)
        .map(|i| ensemble[i].clone())
        .collect();
    let replacement = client
        .choose_bookies(
            1,
            &exclude,
            &staying,
            &crate::ledger::affinity_groups(&meta.properties),
        )
        .await?
        .pop()
        .expect("one chosen");
    let key = meta.key_bytes();
    let entries: Vec<u64> = (mf.first_entry..=mf.last_entry)
        .filter(|e| q.stores(index, *e))
        .collect();
    let count = entries.len() as u64;
    let mut copies = futures::stream::iter(entries)
        .map(|entry| {
            // Sources: the rest of the entry's write set, then the replaced bookie itself.
            let mut sources: Vec<String> = q
                .write_set(entry)
                .filter(|i| *i != index)
                .map(|i| ensemble[i].clone())
                .collect();
            sources.push(ensemble[index].clone());
            let replacement = replacement.clone();
            let key = key.clone();
            async move {
                let envelope = read_verified(client, id, entry, &sources).await?;
                let len = envelope.len() as u64;
                write_recovery(client, id, entry, key, envelope, &replacement).await?;
                Ok::<u64, LedgerError>(len)
            }
        })
        .buffer_unordered(window.max(1));
    let mut bytes = 0u64;
    while let Some(r) = copies.next().await {
        let len = r?;
        bytes += len;
        metrics::counter!("meridian_autorecovery_entries_copied_total").increment(1);
        metrics::counter!("meridian_autorecovery_bytes_copied_total").increment(len);
    }
    drop(copies);
    Ok((count, bytes, replacement))
}

/// The entry's envelope from the first source that gives one that verifies.
async fn read_verified(
    client: &LedgerClient,
    id: u64,
    entry: u64,
    sources: &[String],
) -> Result<Bytes, LedgerError> {
    let mut problems = Vec::new();
    for addr in sources {
        let r = client
            .pool()
            .call(
                addr,
                Request::Read {
                    ledger_id: id,
                    entry_id: entry,
                },
            )
            .await;
        match r {
            Ok(Response::Read {
                status: Status::Ok,
                entry: bytes,
                ..
            }) => match proto::open(&bytes) {
                Ok(e) if e.ledger_id == id && e.entry_id == entry => return Ok(bytes),
                Ok(_) => problems.push(format!("{addr}: the entry names another position")),
                Err(err) => problems.push(format!("{addr}: {err}")),
            },
            Ok(other) => problems.push(format!("{addr}: {other:?}")),
            Err(e) => problems.push(format!("{addr}: {e}")),
        }
    }
    Err(LedgerError::ReadFailed {
        ledger: id,
        entry,
        detail: format!(
            "no replica gave a verified copy to re-replicate: {}",
            problems.join("; ")
        ),
    })
}

async fn write_recovery(
    client: &LedgerClient,
    id: u64,
    entry: u64,
    key: Bytes,
    envelope: Bytes,
    to: &str,
) -> Result<(), LedgerError> {
    let r = client
        .pool()
        .call(
            to,
            Request::Add {
                ledger_id: id,
                entry_id: entry,
                flags: ADD_RECOVERY,
                master_key: key,
                entry: envelope,
            },
        )
        .await;
    match r {
        Ok(Response::Add {
            status: Status::Ok, ..
        }) => Ok(()),
        other => Err(LedgerError::Failed {
            ledger: id,
            detail: format!("writing entry {entry} to {to} for re-replication: {other:?}"),
        }),
    }
}

enum Swap {
    Done,
    Deleted,
}

/// Puts `replacement` where `lost` was in the fragment starting at `first_entry`, by
/// compare-and-set, again on a conflict (the writer of an open ledger changes its last
/// fragment meanwhile).
async fn swap(
    client: &LedgerClient,
    id: u64,
    first_entry: u64,
    index: usize,
    lost: &str,
    replacement: &str,
) -> Result<Swap, LedgerError> {
    for _ in 0..20 {
        let (mut m, version) = match client.metadata(id).await {
            Ok(x) => x,
            Err(LedgerError::NoSuchLedger(_)) => return Ok(Swap::Deleted),
            Err(e) => return Err(e),
        };
        let closed = m.state == crate::ledger::LedgerState::Closed;
        let last_first = m.fragments.last().map(|f| f.first_entry);
        if !closed && last_first == Some(first_entry) {
            // An open ledger's last fragment is its writer's to change.
            return Err(LedgerError::Failed {
                ledger: id,
                detail: format!("the fragment from entry {first_entry} is the open ledger's last; left to its writer"),
            });
        }
        let Some(f) = m
            .fragments
            .iter_mut()
            .find(|f| f.first_entry == first_entry)
        else {
            return Err(LedgerError::Failed {
                ledger: id,
                detail: format!("the fragment from entry {first_entry} is gone from the metadata"),
            });
        };
        if f.ensemble.get(index).map(String::as_str) != Some(lost) {
            // Someone else replaced it already: the copy made here is an extra replica.
            return Ok(Swap::Done);
        }
        if f.ensemble.iter().any(|b| b == replacement) {
            // Two slots on one bookie would leave some entries with one copy.
            return Err(LedgerError::Failed {
                ledger: id,
                detail: format!(
                    "{replacement} is already in the fragment's ensemble; choosing again"
                ),
            });
        }
        f.ensemble[index] = replacement.to_string();
        match client.cas_metadata(&m, version).await {
            Ok(_) => return Ok(Swap::Done),
            Err(LedgerError::Metadata(ClientError::Conflict { .. })) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(LedgerError::Failed {
        ledger: id,
        detail: "the ledger's metadata kept changing; the swap is left for a later try".into(),
    })
}
