//! The entry index of a bookie's ledger storage: where each flushed entry lies in the entry
//! logs, kept in RocksDB as pages of [`PAGE_ENTRIES`] consecutive entry ids.
//!
//! A page's key is `ledger id (u64 BE) | entry id / PAGE_ENTRIES (u64 BE)`; its value is the
//! page's records sorted by slot (`entry id % PAGE_ENTRIES`), each [`RECORD_BYTES`] long:
//! `slot: u16 BE | log: u64 BE | offset: u64 BE | len: u32 BE`. Ids a bookie does not store
//! (other bookies' stripes, entries not written yet) have no record.
//!
//! One key per entry made a flush of 80,000 entries 80,000 RocksDB inserts, which was most of
//! the flusher's time; pages make it a few hundred. A flush reads the page it extends (a page
//! is split between flushes at each flush's edge), merges its records in, and writes it back;
//! flushes and compactions hold the entry-log writer, so one page has one writer at a time.

/// Consecutive entry ids per page.
pub const PAGE_ENTRIES: u64 = 256;

/// Encoded size of one record.
pub const RECORD_BYTES: usize = 22;

/// Where an entry's envelope lies: entry log, byte offset, length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub log: u64,
    pub offset: u64,
    pub len: u32,
}

/// The page key of an entry id's page.
pub fn page_key(ledger_id: u64, entry_id: u64) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&ledger_id.to_be_bytes());
    k[8..].copy_from_slice(&(entry_id / PAGE_ENTRIES).to_be_bytes());
    k
}

/// The first key after every page of `ledger_id`: `page_key(ledger_id, 0)..ledger_end(ledger_id)`
/// holds all of them.
pub fn ledger_end(ledger_id: u64) -> [u8; 16] {
    let mut k = [0u8; 16];
    match ledger_id.checked_add(1) {
        Some(next) => k[..8].copy_from_slice(&next.to_be_bytes()),
        None => k = [0xff; 16],
    }
    k
}

/// The ledger and first entry id of a page key.
pub fn parse_key(key: &[u8]) -> Option<(u64, u64)> {
    let ledger = u64::from_be_bytes(key.get(..8)?.try_into().ok()?);
    let page = u64::from_be_bytes(key.get(8..16)?.try_into().ok()?);
    (key.len() == 16).then_some((ledger, page.checked_mul(PAGE_ENTRIES)?))
}

/// An entry id's slot in its page.
pub fn slot(entry_id: u64) -> u16 {
    (entry_id % PAGE_ENTRIES) as u16
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PageError {
    #[error("index page of {0} bytes is not a whole number of {RECORD_BYTES}-byte records")]
    Length(usize),
    #[error("index page records out of order or repeated at slot {0}")]
    Order(u16),
    #[error("index page record with slot {0}, beyond the page's {PAGE_ENTRIES} entries")]
    Slot(u16),
}

fn record(r: &[u8]) -> (u16, Location) {
    let word = |at: usize| u64::from_be_bytes(r[at..at + 8].try_into().expect("8 bytes"));
    (
        u16::from_be_bytes([r[0], r[1]]),
        Location {
            log: word(2),
            offset: word(10),
            len: u32::from_be_bytes(r[18..22].try_into().expect("4 bytes")),
        },
    )
}

fn push_record(out: &mut Vec<u8>, slot: u16, loc: &Location) {
    out.extend_from_slice(&slot.to_be_bytes());
    out.extend_from_slice(&loc.log.to_be_bytes());
    out.extend_from_slice(&loc.offset.to_be_bytes());
    out.extend_from_slice(&loc.len.to_be_bytes());
}

/// The records of a page in slot order, after checking its length, order and slots.
pub fn records(page: &[u8]) -> Result<Vec<(u16, Location)>, PageError> {
    if page.len() % RECORD_BYTES != 0 {
        return Err(PageError::Length(page.len()));
    }
    let mut out = Vec::with_capacity(page.len() / RECORD_BYTES);
    for r in page.chunks_exact(RECORD_BYTES) {
        let (slot, loc) = record(r);
        if slot as u64 >= PAGE_ENTRIES {
            return Err(PageError::Slot(slot));
        }
        if out.last().is_some_and(|(prev, _)| *prev >= slot) {
            return Err(PageError::Order(slot));
        }
        out.push((slot, loc));
    }
    Ok(out)
}

/// What can still be used of a damaged page: its whole records with a valid slot that continue
/// the ascending order, encoded as a page.
pub fn salvage(page: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(page.len());
    let mut last: Option<u16> = None;
    for r in page.chunks_exact(RECORD_BYTES) {
        let (slot, loc) = record(r);
        if slot as u64 >= PAGE_ENTRIES || last.is_some_and(|prev| prev >= slot) {
            continue;
        }
        last = Some(slot);
        push_record(&mut out, slot, &loc);
    }
    out
}

/// The location of the entry in `slot`, if the page has it (a binary search of the encoded page).
pub fn find(page: &[u8], slot: u16) -> Result<Option<Location>, PageError> {
    if page.len() % RECORD_BYTES != 0 {
        return Err(PageError::Length(page.len()));
    }
    let (mut lo, mut hi) = (0, page.len() / RECORD_BYTES);
    while lo < hi {
        let mid = (lo + hi) / 2;
        let (s, loc) = record(&page[mid * RECORD_BYTES..(mid + 1) * RECORD_BYTES]);
        match s.cmp(&slot) {
            std::cmp::Ordering::Equal => return Ok(Some(loc)),
            std::cmp::Ordering::Less => lo = mid + 1,
            std::cmp::Ordering::Greater => hi = mid,
        }
    }
    Ok(None)
}

/// The page `existing` (if any) with `new` merged in: `new` is sorted by slot without repeats,
/// and a slot in both takes the new location (an entry written again, or moved by compaction).
pub fn merge(existing: Option<&[u8]>, new: &[(u16, Location)]) -> Result<Vec<u8>, PageError> {
    let old = match existing {
        Some(page) => records(page)?,
        None => Vec::new(),
    };
    let mut out = Vec::with_capacity((old.len() + new.len()) * RECORD_BYTES);
    let (mut i, mut j) = (0, 0);
    let mut last: Option<u16> = None;
    while i < old.len() || j < new.len() {
        let take_new = match (old.get(i), new.get(j)) {
            (Some((a, _)), Some((b, _))) => {
                if a == b {
                    i += 1;
                }
                b <= a
            }
            (None, Some(_)) => true,
            _ => false,
        };
        let (slot, loc) = if take_new {
            j += 1;
            new[j - 1]
        } else {
            i += 1;
            old[i - 1]
        };
        if slot as u64 >= PAGE_ENTRIES {
            return Err(PageError::Slot(slot));
        }
        if last.is_some_and(|prev| prev >= slot) {
            return Err(PageError::Order(slot));
        }
        last = Some(slot);
        push_record(&mut out, slot, &loc);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(n: u64) -> Location {
        Location {
            log: n,
            offset: n * 1000,
            len: n as u32 + 7,
        }
    }

    #[test]
    fn given_entry_ids_then_pages_and_slots_split_them_by_page_entries() {
        assert_eq!(parse_key(&page_key(7, 0)), Some((7, 0)));
        assert_eq!(parse_key(&page_key(7, 255)), Some((7, 0)));
        assert_eq!(parse_key(&page_key(7, 256)), Some((7, 256)));
        assert_eq!(parse_key(&page_key(7, 1000)), Some((7, 768)));
        assert_eq!(slot(1000), 232);
        assert_eq!(slot(256), 0);
        // Pages of one ledger sort by entry id and fall before the next ledger's.
        assert!(page_key(7, 255) < page_key(7, 256));
        assert!(page_key(7, u64::MAX) < ledger_end(7));
        assert_eq!(ledger_end(7), page_key(8, 0));
        assert_eq!(ledger_end(u64::MAX), [0xff; 16]);
        assert_eq!(parse_key(&[0; 15]), None);
    }

    #[test]
    fn given_pages_merged_then_find_returns_every_record_and_new_locations_win() {
        let first = merge(None, &[(0, loc(1)), (3, loc(2)), (9, loc(3))]).unwrap();
        assert_eq!(first.len(), 3 * RECORD_BYTES);
        // The next flush: slots before, between, equal to and after the old ones.
        let second = merge(Some(&first), &[(1, loc(4)), (3, loc(5)), (255, loc(6))]).unwrap();
        let all = records(&second).unwrap();
        assert_eq!(
            all,
            vec![
                (0, loc(1)),
                (1, loc(4)),
                (3, loc(5)),
                (9, loc(3)),
                (255, loc(6))
            ]
        );
        for (s, l) in &all {
            assert_eq!(find(&second, *s).unwrap(), Some(*l));
        }
        for absent in [2, 4, 8, 10, 254] {
            assert_eq!(find(&second, absent).unwrap(), None);
        }
        assert_eq!(find(&[], 0).unwrap(), None);
    }

    #[test]
    fn given_a_damaged_page_then_reads_and_merges_refuse_it() {
        let page = merge(None, &[(1, loc(1)), (2, loc(2))]).unwrap();
        assert_eq!(find(&page[..30], 1), Err(PageError::Length(30)));
        assert_eq!(records(&page[..30]), Err(PageError::Length(30)));
        let mut swapped = page[RECORD_BYTES..].to_vec();
        swapped.extend_from_slice(&page[..RECORD_BYTES]);
        assert_eq!(records(&swapped), Err(PageError::Order(1)));
        assert_eq!(merge(Some(&swapped), &[]), Err(PageError::Order(1)));
        let mut beyond = page.clone();
        beyond[..2].copy_from_slice(&300u16.to_be_bytes());
        assert_eq!(records(&beyond), Err(PageError::Slot(300)));
        // New records out of order are refused too, not written.
        assert_eq!(
            merge(None, &[(5, loc(1)), (4, loc(2))]),
            Err(PageError::Order(4))
        );
        assert_eq!(merge(None, &[(256, loc(1))]), Err(PageError::Slot(256)));
        // What a flush keeps of such pages: the records that still read as a page.
        assert_eq!(
            records(&salvage(&page[..30])).unwrap(),
            vec![(1, loc(1))],
            "a torn record dropped"
        );
        assert_eq!(
            records(&salvage(&swapped)).unwrap(),
            vec![(2, loc(2))],
            "a record out of order dropped"
        );
        assert_eq!(
            records(&salvage(&beyond)).unwrap(),
            vec![(2, loc(2))],
            "a record beyond the page dropped"
        );
        assert_eq!(salvage(&page), page, "a sound page is kept whole");
    }
}
