//! A compact set of closed ranges, the shape of a cursor's individually acknowledged messages.
//!
//! A cursor keeps a mark-delete position (everything up to it is acknowledged) and the ranges
//! acknowledged beyond it. Acknowledgements arrive one by one and out of order; adjacent and
//! overlapping ranges merge as they come, so a consumer that acknowledges everything in some
//! order ends up with one range, which [`RangeSet::advance`] then folds into the mark-delete
//! position.

use std::collections::BTreeMap;
use std::fmt;

/// Values with a successor: what "adjacent" means for a range set.
pub trait Step: Ord + Copy {
    /// The next value, or `None` at the end of the domain.
    fn next(self) -> Option<Self>;
}

impl Step for u64 {
    fn next(self) -> Option<u64> {
        self.checked_add(1)
    }
}

/// Disjoint, non-adjacent closed ranges `[lo, hi]`, kept by their start.
#[derive(Clone, PartialEq, Eq)]
pub struct RangeSet<T: Step> {
    ranges: BTreeMap<T, T>,
}

impl<T: Step> Default for RangeSet<T> {
    fn default() -> Self {
        Self {
            ranges: BTreeMap::new(),
        }
    }
}

impl<T: Step + fmt::Debug> fmt::Debug for RangeSet<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.ranges.iter().map(|(lo, hi)| lo..=hi))
            .finish()
    }
}

impl<T: Step> RangeSet<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of disjoint ranges (what persisting the set costs).
    pub fn range_count(&self) -> usize {
        self.ranges.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The ranges in order.
    pub fn iter(&self) -> impl Iterator<Item = (T, T)> + '_ {
        self.ranges.iter().map(|(lo, hi)| (*lo, *hi))
    }

    pub fn first(&self) -> Option<(T, T)> {
        self.ranges.iter().next().map(|(lo, hi)| (*lo, *hi))
    }

    pub fn contains(&self, x: T) -> bool {
        self.ranges
            .range(..=x)
            .next_back()
            .is_some_and(|(_, hi)| x <= *hi)
    }

    /// The range that holds `x`, if one does.
    pub fn range_containing(&self, x: T) -> Option<(T, T)> {
        self.ranges
            .range(..=x)
            .next_back()
            .filter(|(_, hi)| x <= **hi)
            .map(|(lo, hi)| (*lo, *hi))
    }

    /// The first range that starts at or after `x`.
    pub fn first_from(&self, x: T) -> Option<(T, T)> {
        self.ranges.range(x..).next().map(|(lo, hi)| (*lo, *hi))
    }

    pub fn insert(&mut self, x: T) {
        self.insert_range(x, x);
    }

    /// Adds `[lo, hi]`, merging with every range it overlaps or touches. Panics if `lo > hi`.
    pub fn insert_range(&mut self, lo: T, hi: T) {
        assert!(lo <= hi, "range set: empty range inserted");
        let mut lo = lo;
        let mut hi = hi;
        // A range starting at or before `lo` that reaches `lo` (or ends just before it).
        if let Some((&plo, &phi)) = self.ranges.range(..=lo).next_back() {
            if phi >= lo || phi.next() == Some(lo) {
                lo = plo;
                hi = hi.max(phi);
                self.ranges.remove(&plo);
            }
        }
        // Ranges starting inside `[lo, hi]` or right after `hi`.
        loop {
            let after = match self.ranges.range(lo..).next() {
                Some((&nlo, &nhi)) if nlo <= hi || hi.next() == Some(nlo) => (nlo, nhi),
                _ => break,
            };
            self.ranges.remove(&after.0);
            hi = hi.max(after.1);
        }
        self.ranges.insert(lo, hi);
    }

    /// Forgets every value `<= x` (the mark-delete position moved to `x`).
    pub fn remove_through(&mut self, x: T) {
        let below: Vec<T> = self.ranges.range(..=x).map(|(lo, _)| *lo).collect();
        for lo in below {
            let hi = self.ranges.remove(&lo).expect("present");
            if hi > x {
                if let Some(start) = x.next() {
                    self.ranges.insert(start, hi);
                }
            }
        }
    }

    /// Moves a mark-delete position forward over the range that starts right after it, if any,
    /// and returns the new position.
    pub fn advance(&mut self, mark_delete: T) -> T {
        self.remove_through(mark_delete);
        match self.first() {
            Some((lo, hi)) if mark_delete.next() == Some(lo) => {
                self.ranges.remove(&lo);
                hi
            }
            _ => mark_delete,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeSet;

    fn set(ranges: &[(u64, u64)]) -> RangeSet<u64> {
        let mut s = RangeSet::new();
        for &(lo, hi) in ranges {
            s.insert_range(lo, hi);
        }
        s
    }

    fn check(ranges: &[(u64, u64)], expect: &str) {
        assert_eq!(format!("{:?}", set(ranges)), expect, "inserting {ranges:?}");
    }

    #[test]
    fn given_ranges_when_inserted_then_overlapping_and_adjacent_ones_merge() {
        check(&[], "[]");
        check(&[(5, 5)], "[5..=5]");
        check(&[(5, 5), (7, 7)], "[5..=5, 7..=7]");
        check(&[(5, 5), (7, 7), (6, 6)], "[5..=7]");
        check(&[(1, 3), (4, 6)], "[1..=6]");
        check(&[(4, 6), (1, 3)], "[1..=6]");
        check(&[(1, 10), (3, 4)], "[1..=10]");
        check(&[(3, 4), (1, 10)], "[1..=10]");
        check(&[(1, 2), (5, 6), (9, 10), (2, 9)], "[1..=10]");
        check(&[(1, 2), (5, 6), (9, 10), (4, 4)], "[1..=2, 4..=6, 9..=10]");
        check(
            &[(u64::MAX, u64::MAX), (u64::MAX - 1, u64::MAX - 1)],
            "[18446744073709551614..=18446744073709551615]",
        );
        check(
            &[(0, 0), (u64::MAX, u64::MAX)],
            "[0..=0, 18446744073709551615..=18446744073709551615]",
        );
    }

    #[test]
    fn given_acks_beyond_mark_delete_when_gap_fills_then_advance_folds_them_in() {
        let mut s = set(&[(12, 14), (20, 20)]);
        assert_eq!(s.advance(10), 10, "11 is not acknowledged yet");
        s.insert(11);
        assert_eq!(s.advance(10), 14);
        assert_eq!(format!("{s:?}"), "[20..=20]");
        s.remove_through(25);
        assert!(s.is_empty());
        let mut s = set(&[(3, 9)]);
        s.remove_through(5);
        assert_eq!(format!("{s:?}"), "[6..=9]");
        assert_eq!(s.advance(5), 9);
    }

    #[test]
    fn given_random_operations_then_the_set_matches_a_plain_set_of_values() {
        let seed: u64 = rand::random();
        println!("seed {seed} (rerun with this value in the test to reproduce)");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for _ in 0..200 {
            let mut s = RangeSet::new();
            let mut model = BTreeSet::new();
            for _ in 0..60 {
                if rng.gen_bool(0.85) {
                    let lo = rng.gen_range(0..200u64);
                    let hi = lo + rng.gen_range(0..6);
                    s.insert_range(lo, hi);
                    model.extend(lo..=hi);
                } else {
                    let x = rng.gen_range(0..200u64);
                    s.remove_through(x);
                    model.retain(|v| *v > x);
                }
                let values: BTreeSet<u64> = s.iter().flat_map(|(lo, hi)| lo..=hi).collect();
                assert_eq!(values, model, "seed {seed}");
                // Stored ranges never touch: the set is as compact as it can be.
                let ranges: Vec<_> = s.iter().collect();
                for w in ranges.windows(2) {
                    assert!(w[0].1 + 1 < w[1].0, "seed {seed}: {ranges:?} not compact");
                }
                for probe in 0..210 {
                    assert_eq!(s.contains(probe), model.contains(&probe), "seed {seed}");
                }
            }
        }
    }
}
