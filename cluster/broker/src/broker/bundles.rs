//! A namespace's bundles, sans-IO: ranges of the hash of topic names (Murmur3-32 of the full
//! name, as Pulsar's), their names, which bundle holds a topic, and splitting one in two.

use serde::{Deserialize, Serialize};

use crate::topic_name::TopicName;

/// The hash space of topic names: `[0, 2^32)`.
pub const HASH_END: u64 = 1 << 32;

/// A hash range `[lo, hi)` of a namespace's topic names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bundle {
    pub lo: u64,
    pub hi: u64,
}

impl Bundle {
    /// Pulsar's name of a range: `0x00000000_0x40000000` (the last ends at `0xffffffff`).
    pub fn name(&self) -> String {
        format!("0x{:08x}_0x{:08x}", self.lo, self.hi.min(HASH_END - 1))
    }

    pub fn contains(&self, hash: u32) -> bool {
        (self.lo..self.hi).contains(&u64::from(hash))
    }
}

/// A namespace's bundles: their boundaries, first 0 and last 2^32.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bundles {
    pub boundaries: Vec<u64>,
}

impl Bundles {
    /// `n` equal ranges.
    pub fn even(n: u64) -> Bundles {
        let n = n.clamp(1, 1 << 16);
        Bundles {
            boundaries: (0..=n).map(|i| i * HASH_END / n).collect(),
        }
    }

    pub fn list(&self) -> Vec<Bundle> {
        self.boundaries
            .windows(2)
            .map(|w| Bundle { lo: w[0], hi: w[1] })
            .collect()
    }

    /// The bundle holding `hash`.
    pub fn of(&self, hash: u32) -> Bundle {
        let h = u64::from(hash);
        let i = self
            .boundaries
            .partition_point(|b| *b <= h)
            .saturating_sub(1);
        let i = i.min(self.boundaries.len().saturating_sub(2));
        Bundle {
            lo: self.boundaries[i],
            hi: self.boundaries[i + 1],
        }
    }

    pub fn valid(&self) -> bool {
        self.boundaries.len() >= 2
            && self.boundaries[0] == 0
            && self.boundaries.last() == Some(&HASH_END)
            && self.boundaries.windows(2).all(|w| w[0] < w[1])
    }
}

/// Where a topic name falls in its namespace's hash space (Murmur3-32 of the full name).
pub fn topic_hash(topic: &TopicName) -> u32 {
    super::key_shared::murmur3_32(topic.to_string().as_bytes(), 0)
}

impl Bundles {
    /// These bundles with `b` cut in two at its midpoint; `None` if `b` is not one of them or
    /// is too small to cut.
    pub fn split(&self, b: &Bundle) -> Option<(Bundles, Bundle, Bundle)> {
        let i = self.boundaries.iter().position(|x| *x == b.lo)?;
        if self.boundaries.get(i + 1) != Some(&b.hi) || b.hi - b.lo < 2 {
            return None;
        }
        let mid = b.lo + (b.hi - b.lo) / 2;
        let mut boundaries = self.boundaries.clone();
        boundaries.insert(i + 1, mid);
        Some((
            Bundles { boundaries },
            Bundle { lo: b.lo, hi: mid },
            Bundle { lo: mid, hi: b.hi },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_cuts_one_bundle_at_its_midpoint_and_keeps_the_rest() {
        let b = Bundles::even(4);
        let second = b.list()[1];
        let (after, lo, hi) = b.split(&second).expect("splits");
        assert!(after.valid());
        assert_eq!(after.list().len(), 5);
        assert_eq!(
            (lo.lo, lo.hi, hi.lo, hi.hi),
            (second.lo, 0x6000_0000, 0x6000_0000, second.hi)
        );
        assert_eq!(lo.name(), "0x40000000_0x60000000");
        for h in [0x4000_0000u32, 0x5fff_ffff, 0x6000_0000, 0x7fff_ffff] {
            let of = after.of(h);
            assert!(of == lo || of == hi);
            assert!(of.contains(h));
        }
        assert_eq!(after.list()[0], b.list()[0]);
        assert_eq!(after.list()[4], b.list()[3]);
        // Not one of them, or too small.
        assert!(after.split(&second).is_none());
        let tiny = Bundles {
            boundaries: vec![0, 1, HASH_END],
        };
        assert!(tiny.split(&Bundle { lo: 0, hi: 1 }).is_none());
    }

    #[test]
    fn even_bundles_cover_the_hash_space_and_every_hash_falls_in_one() {
        for n in [1u64, 2, 3, 4, 7, 16] {
            let b = Bundles::even(n);
            assert!(b.valid(), "{b:?}");
            let list = b.list();
            assert_eq!(list.len() as u64, n);
            for h in [
                0u32,
                1,
                0x3fff_ffff,
                0x4000_0000,
                0x7fff_ffff,
                0xffff_fffe,
                u32::MAX,
            ] {
                let of = b.of(h);
                assert!(of.contains(h), "{h:#x} in {of:?} of {n}");
                assert_eq!(list.iter().filter(|x| x.contains(h)).count(), 1);
            }
        }
        assert_eq!(Bundles::even(4).list()[0].name(), "0x00000000_0x40000000");
        assert_eq!(Bundles::even(4).list()[3].name(), "0xc0000000_0xffffffff");
    }

    #[test]
    fn bundles_records_that_do_not_cover_the_space_are_not_valid() {
        for bad in [
            vec![],
            vec![0],
            vec![1, HASH_END],
            vec![0, 5, 5, HASH_END],
            vec![0, 10],
        ] {
            assert!(
                !Bundles {
                    boundaries: bad.clone()
                }
                .valid(),
                "{bad:?}"
            );
        }
    }
}
