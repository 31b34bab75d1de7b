//! A topic's compacted view: one ledger per compaction, holding the entries that carry the
//! latest message of some key up to a horizon, each with its original position.
//!
//! Entry i of the ledger is `[version u8][ledger u64][entry u64][mask words u32][words u64*]`
//! then the stored entry's bytes unchanged (the producer's checksum still holds). A mask is
//! present when only some messages of a batch are retained: bit i set = message i kept.
//! Entries are in log order, so the entry that follows a position is found by a binary search
//! over the ledger; a small cache keeps positions already looked at.
//!
//! Knows positions and bytes, not keys (the broker's compactor decides what is retained).

use std::collections::HashMap;
use std::sync::Mutex;

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::ledger::{LedgerClient, LedgerError, LedgerReader};
use crate::managed_ledger::Position;

const VERSION: u8 = 1;
/// Most mask words one entry may carry (a batch of 2^20 messages).
const MASK_WORDS_MAX: u32 = 1 << 14;
/// Positions kept in the lookup cache before it is emptied.
const CACHE_MAX: usize = 4096;

/// One entry of a compacted ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompactedEntry {
    /// Where the entry is in the topic's log.
    pub position: Position,
    /// Which messages of a batch are retained (bit i = message i); `None`: all of them.
    pub mask: Option<Vec<u64>>,
    /// The entry as stored in the log.
    pub bytes: Bytes,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("malformed compacted entry: {0}")]
pub struct CompactedEntryError(pub String);

impl CompactedEntry {
    pub fn encode(&self) -> Bytes {
        let words = self.mask.as_deref().unwrap_or(&[]);
        debug_assert!(
            words.len() <= MASK_WORDS_MAX as usize,
            "mask of {} words",
            words.len()
        );
        let mut b = BytesMut::with_capacity(21 + words.len() * 8 + self.bytes.len());
        b.put_u8(VERSION);
        b.put_u64(self.position.ledger_id);
        b.put_u64(self.position.entry_id);
        b.put_u32(words.len() as u32);
        for w in words {
            b.put_u64(*w);
        }
        b.put_slice(&self.bytes);
        b.freeze()
    }

    pub fn decode(mut b: Bytes) -> Result<CompactedEntry, CompactedEntryError> {
        let bad = |why: &str| CompactedEntryError(why.to_string());
        if b.len() < 21 {
            return Err(bad("shorter than its header"));
        }
        let version = b.get_u8();
        if version != VERSION {
            return Err(CompactedEntryError(format!("unknown version {version}")));
        }
        let position = Position::new(b.get_u64(), b.get_u64());
        let n = b.get_u32();
        if n > MASK_WORDS_MAX || b.len() < n as usize * 8 {
            return Err(CompactedEntryError(format!(
                "mask of {n} words does not fit"
            )));
        }
        let mask = (n > 0).then(|| (0..n).map(|_| b.get_u64()).collect());
        Ok(CompactedEntry {
            position,
            mask,
            bytes: b,
        })
    }
}

/// The compacted view of a topic: what its last compaction kept, through `horizon`.
pub struct CompactedView {
    /// The compacted ledger; `None` when nothing was retained.
    pub ledger_id: Option<u64>,
    /// The last position of the log the compaction read.
    pub horizon: Position,
    pub entries: u64,
    pub bytes: u64,
    reader: Option<LedgerReader>,
    positions: Mutex<HashMap<u64, Position>>,
}

impl std::fmt::Debug for CompactedView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompactedView")
            .field("ledger_id", &self.ledger_id)
            .field("horizon", &self.horizon)
            .field("entries", &self.entries)
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CompactedViewError {
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("compacted ledger {ledger}, entry {entry}: {error}")]
    Malformed {
        ledger: u64,
        entry: u64,
        error: CompactedEntryError,
    },
    #[error("compacted ledger {ledger} has {found} entries; its record says {recorded}")]
    Mismatch {
        ledger: u64,
        found: u64,
        recorded: u64,
    },
}

impl CompactedView {
    /// Opens a (closed) compacted ledger; `ledger` `None` is a view that retained nothing.
    pub async fn open(
        client: &LedgerClient,
        ledger: Option<u64>,
        horizon: Position,
        entries: u64,
        bytes: u64,
    ) -> Result<CompactedView, CompactedViewError> {
        let reader = match ledger {
            Some(id) => {
                let r = client.open(id).await?;
                let found = r.last_entry().map_or(0, |e| e + 1);
                if found != entries {
                    return Err(CompactedViewError::Mismatch {
                        ledger: id,
                        found,
                        recorded: entries,
                    });
                }
                Some(r)
            }
            None => None,
        };
        Ok(CompactedView {
            ledger_id: ledger,
            horizon,
            entries: if reader.is_some() { entries } else { 0 },
            bytes,
            reader,
            positions: Mutex::new(HashMap::new()),
        })
    }

    /// Reads entry `index` of the view.
    pub async fn read(&self, index: u64) -> Result<CompactedEntry, CompactedViewError> {
        let Some(r) = self.reader.as_ref().filter(|_| index < self.entries) else {
            return Err(LedgerError::NoSuchEntry {
                ledger: self.ledger_id.unwrap_or(0),
                entry: index,
            }
            .into());
        };
        let ledger = r.metadata().id;
        let e = CompactedEntry::decode(r.read(index).await?).map_err(|error| {
            CompactedViewError::Malformed {
                ledger,
                entry: index,
                error,
            }
        })?;
        let mut cache = self.positions.lock().expect("positions lock");
        if cache.len() >= CACHE_MAX {
            cache.clear();
        }
        cache.insert(index, e.position);
        Ok(e)
    }

    async fn position(&self, index: u64) -> Result<Position, CompactedViewError> {
        if let Some(p) = self.positions.lock().expect("positions lock").get(&index) {
            return Ok(*p);
        }
        Ok(self.read(index).await?.position)
    }

    /// The index of the first entry after `after` (`None`: the first entry); `entries` if
    /// there is none.
    pub async fn first_after(&self, after: Option<Position>) -> Result<u64, CompactedViewError> {
        let Some(after) = after else {
            return Ok(0);
        };
        let (mut lo, mut hi) = (0, self.entries);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.position(mid).await? <= after {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        Ok(lo)
    }

    /// The entry of the view at `pos`, if the view retained it.
    pub async fn find(&self, pos: Position) -> Result<Option<CompactedEntry>, CompactedViewError> {
        if pos > self.horizon {
            return Ok(None);
        }
        let i = self.first_after(pos.before()).await?;
        if i >= self.entries {
            return Ok(None);
        }
        let e = self.read(i).await?;
        Ok((e.position == pos).then_some(e))
    }

    /// How many messages of the entry the view retained, given the batch's size.
    pub fn retained(mask: Option<&[u64]>, messages: u32) -> u32 {
        match mask {
            Some(words) => words.iter().map(|w| w.count_ones()).sum(),
            None => messages,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn compacted_entries_round_trip_and_damaged_bytes_never_panic() {
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for _ in 0..500 {
            let e = CompactedEntry {
                position: Position::new(rng.gen(), rng.gen()),
                mask: rng
                    .gen_bool(0.5)
                    .then(|| (0..rng.gen_range(1..4)).map(|_| rng.gen()).collect()),
                bytes: Bytes::from(
                    (0..rng.gen_range(0..100))
                        .map(|_| rng.gen::<u8>())
                        .collect::<Vec<u8>>(),
                ),
            };
            let b = e.encode();
            assert_eq!(
                CompactedEntry::decode(b.clone()).as_ref(),
                Ok(&e),
                "seed {seed}"
            );
            let mut bad = b.to_vec();
            let at = rng.gen_range(0..bad.len());
            bad[at] = rng.gen();
            let _ = CompactedEntry::decode(Bytes::from(bad));
            let cut = rng.gen_range(0..b.len());
            let _ = CompactedEntry::decode(b.slice(..cut));
        }
        assert!(CompactedEntry::decode(Bytes::from_static(&[2; 30])).is_err());
    }

    #[test]
    fn a_mask_says_how_many_messages_are_retained() {
        assert_eq!(CompactedView::retained(None, 7), 7);
        assert_eq!(CompactedView::retained(Some(&[0b1011]), 7), 3);
        assert_eq!(CompactedView::retained(Some(&[u64::MAX, 1]), 70), 65);
    }
}
