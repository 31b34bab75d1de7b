//! The sequence ids of one producer name that a topic holds, as ranges.
//!
//! Local sends are checked by the highest sequence id (Pulsar's rule); an entry that comes
//! by geo-replication is checked by these ranges, because across sites a producer's ids do
//! not arrive in order: after a failover the producer's resends are stored at the other
//! site first, and the entries its first site had acknowledged but not yet replicated come
//! later, below them. Those must be kept, the resends' originals dropped.
//!
//! ```text
//!  held: [0 ─ 99] (replicated)   [101 ─ 180] (the producer, moved here)
//!  later from the first site: 100 → kept   101..120 → already held: dropped
//! ```
//!
//! A producer with contiguous ids (the stock clients' own) keeps one range per move; ids
//! with gaps (set by the application) would make one per entry, so past [`MAX_RANGES`] the
//! two lowest ranges are joined: the ids between them, oldest history, count as held.

use serde::{Deserialize, Serialize};

/// Ranges kept per producer name.
pub const MAX_RANGES: usize = 16;

/// Inclusive ranges of sequence ids, in order, neither overlapping nor adjacent. A stored
/// state is put in that form as it loads (as [`HeldIds::exact`] does), so a damaged or
/// hand-made snapshot cannot break the order the searches rely on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "Vec<(i64, i64)>")]
pub struct HeldIds(Vec<(i64, i64)>);

impl From<Vec<(i64, i64)>> for HeldIds {
    fn from(ranges: Vec<(i64, i64)>) -> Self {
        HeldIds::exact(ranges)
    }
}

impl HeldIds {
    /// Everything up to `highest` (a state recorded before ranges were kept: the highest id
    /// alone, as Pulsar's rule reads it).
    pub fn through(highest: i64) -> Self {
        HeldIds(vec![(i64::MIN, highest)])
    }

    /// Ranges as given (a peer's answer), joined where they touch, none dropped.
    pub fn exact(ranges: impl IntoIterator<Item = (i64, i64)>) -> Self {
        let mut v: Vec<(i64, i64)> = ranges
            .into_iter()
            .map(|(a, b)| (a.min(b), a.max(b)))
            .collect();
        v.sort_unstable();
        let mut out: Vec<(i64, i64)> = Vec::with_capacity(v.len());
        for (lo, hi) in v {
            match out.last_mut() {
                Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
                _ => out.push((lo, hi)),
            }
        }
        HeldIds(out)
    }

    /// Adds `first..=highest`.
    pub fn insert(&mut self, first: i64, highest: i64) {
        let (lo, hi) = (first.min(highest), first.max(highest));
        // The ranges touching or overlapping lo..=hi are joined with it.
        let start = self.0.partition_point(|&(_, h)| h.saturating_add(1) < lo);
        let end = self.0.partition_point(|&(l, _)| l <= hi.saturating_add(1));
        let (mut nlo, mut nhi) = (lo, hi);
        if start < end {
            nlo = nlo.min(self.0[start].0);
            nhi = nhi.max(self.0[end - 1].1);
        }
        self.0.splice(start..end, [(nlo, nhi)]);
        if self.0.len() > MAX_RANGES {
            let (_, h) = self.0.remove(1);
            self.0[0].1 = h;
        }
    }

    /// Whether every id of `first..=highest` is held.
    pub fn covers(&self, first: i64, highest: i64) -> bool {
        let (lo, hi) = (first.min(highest), first.max(highest));
        let i = self.0.partition_point(|&(_, h)| h < lo);
        self.0.get(i).is_some_and(|&(l, h)| l <= lo && hi <= h)
    }

    /// The parts of `lo..=hi` that are held.
    pub fn within(&self, lo: i64, hi: i64) -> impl Iterator<Item = (i64, i64)> + '_ {
        let (lo, hi) = (lo.min(hi), lo.max(hi));
        let i = self.0.partition_point(|&(_, h)| h < lo);
        self.0[i..]
            .iter()
            .take_while(move |&&(l, _)| l <= hi)
            .map(move |&(l, h)| (l.max(lo), h.min(hi)))
    }

    pub fn ranges(&self) -> &[(i64, i64)] {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(ranges: &[(i64, i64)]) -> HeldIds {
        let mut h = HeldIds::default();
        for &(a, b) in ranges {
            h.insert(a, b);
        }
        h
    }

    #[test]
    fn given_a_stored_state_out_of_order_then_it_loads_in_order() {
        let h: HeldIds = serde_json::from_str("[[20,30],[5,1],[25,40],[41,41]]").unwrap();
        assert_eq!(h.ranges(), &[(1, 5), (20, 41)]);
        // Before, the ranges loaded as stored, and a search over them missed 22.
        assert!(h.covers(22, 22));
        assert_eq!(serde_json::to_string(&h).unwrap(), "[[1,5],[20,41]]");
    }

    #[test]
    fn given_adjacent_or_overlapping_ranges_then_they_join() {
        let h = held(&[(0, 9), (10, 19), (15, 30), (40, 40)]);
        assert_eq!(h.ranges(), &[(0, 30), (40, 40)]);
        let h = held(&[(40, 50), (0, 9), (20, 30), (10, 39)]);
        assert_eq!(h.ranges(), &[(0, 50)]);
    }

    #[test]
    fn given_a_producer_that_moved_then_the_gap_is_not_held() {
        // 0..99 replicated here, the producer's resends from 101, then 100 comes late.
        let mut h = held(&[(0, 99), (101, 180)]);
        assert!(!h.covers(100, 100));
        assert!(h.covers(101, 120));
        assert!(h.covers(0, 0));
        assert!(!h.covers(95, 104), "a batch only partly held is not held");
        assert!(!h.covers(181, 181));
        let parts: Vec<_> = h.within(90, 110).collect();
        assert_eq!(parts, [(90, 99), (101, 110)]);
        assert_eq!(h.within(110, 90).collect::<Vec<_>>(), parts);
        assert_eq!(h.within(181, 200).count(), 0);
        h.insert(100, 100);
        assert_eq!(h.ranges(), &[(0, 180)]);
    }

    #[test]
    fn given_more_ranges_than_kept_then_the_lowest_gap_closes() {
        let mut h = HeldIds::default();
        for i in 0..(MAX_RANGES as i64 + 3) {
            h.insert(i * 10, i * 10);
        }
        assert_eq!(h.ranges().len(), MAX_RANGES);
        assert!(h.covers(0, 30), "the oldest gaps count as held");
        assert!(!h.covers(175, 175), "recent gaps stay open");
        assert!(h.covers(180, 180));
    }

    #[test]
    fn given_many_ranges_from_a_peer_then_exact_keeps_each() {
        let many: Vec<(i64, i64)> = (0..40).map(|i| (i * 10, i * 10)).collect();
        let h = HeldIds::exact(many.iter().rev().copied().chain([(21, 20)]));
        assert_eq!(
            h.ranges().len(),
            40,
            "(21, 20) joined with 20, none dropped"
        );
        assert!(!h.covers(5, 5));
        assert!(h.covers(20, 21));
    }

    #[test]
    fn given_a_state_from_before_ranges_then_everything_up_to_its_highest_is_held() {
        let h = HeldIds::through(41);
        assert!(h.covers(-5, 41));
        assert!(!h.covers(41, 42));
        assert_eq!(
            serde_json::to_string(&held(&[(1, 2), (4, 5)])).unwrap(),
            "[[1,2],[4,5]]"
        );
    }
}
