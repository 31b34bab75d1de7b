//! The ranges of sequence ids a topic holds per producer name (deduplication across sites):
//! a stored state (JSON, as snapshots keep it) loads in order, and then any sequence of
//! inserts keeps the ranges sorted, apart and at most `MAX_RANGES` long, holds every id just
//! inserted, and `covers` and `within` agree with the ranges.
//! Run: `scripts/fuzz cluster/broker held_ids`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use meridian_broker::broker::dedup::held::{HeldIds, MAX_RANGES};

fn sound(h: &HeldIds) {
    for w in h.ranges().windows(2) {
        assert!(
            w[0].1.saturating_add(1) < w[1].0,
            "ranges apart and in order: {h:?}"
        );
    }
    for &(lo, hi) in h.ranges() {
        assert!(lo <= hi, "{h:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    // A stored state, up to the first NUL; then 16-byte (first, highest) pairs to insert.
    let (state, ops) = match data.iter().position(|&c| c == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (&data[..0], data),
    };
    let mut h: HeldIds = serde_json::from_slice(state).unwrap_or_default();
    sound(&h);
    let loaded = h.ranges().len();
    for op in ops.chunks_exact(16) {
        let first = i64::from_le_bytes(op[..8].try_into().unwrap());
        let highest = i64::from_le_bytes(op[8..].try_into().unwrap());
        h.insert(first, highest);
        sound(&h);
        assert!(h.ranges().len() <= MAX_RANGES.max(loaded));
        assert!(
            h.covers(first, highest),
            "{first}..={highest} just inserted: {h:?}"
        );
        let parts: Vec<(i64, i64)> = h.within(first, highest).collect();
        assert_eq!(
            parts.len(),
            1,
            "one range holds what was just inserted: {parts:?}"
        );
    }
    for &(lo, hi) in h.ranges() {
        assert!(h.covers(lo, hi));
        // Ranges are apart: the id before each is not held.
        assert!(lo == i64::MIN || !h.covers(lo - 1, lo - 1), "{h:?}");
    }
});
