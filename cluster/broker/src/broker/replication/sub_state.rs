//! A replicated subscription's acknowledgements in terms every site shares (sans-IO).
//!
//! ```text
//!  an entry is the same entry at every site by its origin: the site that produced it and its
//!  position in that site's log (an entry produced here: this site and its local position)
//!
//!  AckState { per origin site O: through  every entry of O up to here is acknowledged
//!                                 ranges   acknowledged beyond it (within one ledger of O)
//!                                 batches  partly acknowledged (bit i set: message i not) }
//!
//!  sender (its cursor: mark-delete M, ranges, batches; each entry's origin read from it):
//!    through[this site] = M; through[O] = the highest origin position of O's entries <= M
//!    (O's entries arrive in O's order, so those are exactly O's entries up to it)
//!  receiver: an entry it holds is acknowledged by the sender's state when the sender held
//!    it too (it came from the sender, or its `replicate_to` is empty or names the sender)
//!    and the state covers its origin position; partly, by the batch's bits
//! ```
//!
//! States only grow: merging two is their union (the later `through`, the ranges of both, a
//! batch's messages acknowledged by either), so a site may send its whole state again and
//! again, in any order, and sites that hear each other's end with the same acknowledgements.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A position in an origin site's log: (ledger, entry).
pub type OPos = (u64, u64);

/// What a state says of one origin site's entries.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OriginAcks {
    /// Every entry of the origin up to and including this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub through: Option<OPos>,
    /// Acknowledged beyond `through`: inclusive ranges, each within one ledger, sorted,
    /// disjoint and not adjacent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranges: Vec<(OPos, OPos)>,
    /// Batch entries partly acknowledged, sorted: bit i set = message i still
    /// unacknowledged (Pulsar's `ack_set`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub batches: Vec<(OPos, Vec<u64>)>,
}

/// How a state covers one entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cover<'a> {
    Whole,
    /// Some messages of the batch: bit i set = message i still unacknowledged.
    Partial(&'a [u64]),
    Not,
}

impl OriginAcks {
    pub fn cover(&self, p: OPos) -> Cover<'_> {
        if self.covers_whole(p) {
            return Cover::Whole;
        }
        match self.batches.binary_search_by(|(b, _)| b.cmp(&p)) {
            Ok(i) => Cover::Partial(&self.batches[i].1),
            Err(_) => Cover::Not,
        }
    }

    /// Whether `through` or a range covers `p`.
    fn covers_whole(&self, p: OPos) -> bool {
        if self.through.is_some_and(|t| p <= t) {
            return true;
        }
        let i = self.ranges.partition_point(|(lo, _)| *lo <= p);
        i > 0 && p <= self.ranges[i - 1].1
    }

    /// The furthest entry the state says anything of: past it nothing of the origin's is
    /// covered.
    pub fn reach(&self) -> Option<OPos> {
        let ranges = self.ranges.last().map(|r| r.1);
        let batches = self.batches.last().map(|b| b.0);
        self.through.max(ranges).max(batches)
    }

    fn is_empty(&self) -> bool {
        self.through.is_none() && self.ranges.is_empty() && self.batches.is_empty()
    }

    /// Sorts and merges the ranges, drops what `through` covers, and makes a batch with
    /// nothing left unacknowledged (or covered by a range) whole.
    fn normalize(&mut self) {
        let mut ranges = std::mem::take(&mut self.ranges);
        for (p, bits) in &self.batches {
            if bits.iter().all(|w| *w == 0) {
                ranges.push((*p, *p));
            }
        }
        ranges.sort_unstable();
        let through = self.through;
        let mut out: Vec<(OPos, OPos)> = Vec::with_capacity(ranges.len());
        for (lo, hi) in ranges {
            // What `through` covers is left out.
            let lo = match through {
                Some(t) if hi <= t => continue,
                Some(t) if lo <= t => (t.0, t.1.saturating_add(1)),
                _ => lo,
            };
            match out.last_mut() {
                Some(last) if last.1 .0 == lo.0 && lo.1 <= last.1 .1.saturating_add(1) => {
                    last.1 = last.1.max(hi);
                }
                _ => out.push((lo, hi)),
            }
        }
        // A range that now begins right after `through` in its ledger moves `through`.
        while let (Some(t), Some(first)) = (self.through, out.first()) {
            if first.0 .0 == t.0 && first.0 .1 == t.1.saturating_add(1) {
                self.through = Some(first.1);
                out.remove(0);
            } else {
                break;
            }
        }
        self.ranges = out;
        let mut batches = std::mem::take(&mut self.batches);
        batches.sort_by_key(|a| a.0);
        batches.dedup_by(|later, earlier| {
            if later.0 != earlier.0 {
                return false;
            }
            and_into(&mut earlier.1, &later.1);
            true
        });
        batches.retain(|(p, bits)| !bits.iter().all(|w| *w == 0) && !self.covers_whole(*p));
        self.batches = batches;
    }

    /// Takes in what `other` acknowledges; whether anything changed.
    pub fn merge(&mut self, other: &OriginAcks) -> bool {
        let before = self.clone();
        self.through = self.through.max(other.through);
        self.ranges.extend(other.ranges.iter().copied());
        // A batch one side has whole stays whole; one both have partly, their messages
        // acknowledged by either.
        let mut batches = Vec::new();
        for (p, bits) in &self.batches {
            match other.cover(*p) {
                Cover::Whole => {}
                Cover::Partial(o) => {
                    let mut b = bits.clone();
                    and_into(&mut b, o);
                    batches.push((*p, b));
                }
                Cover::Not => batches.push((*p, bits.clone())),
            }
        }
        for (p, bits) in &other.batches {
            if matches!(before.cover(*p), Cover::Not) {
                batches.push((*p, bits.clone()));
            }
        }
        self.batches = batches;
        self.normalize();
        *self != before
    }
}

/// Messages acknowledged by either: the bits both leave unacknowledged (a shorter set's
/// missing words are all acknowledged).
fn and_into(a: &mut Vec<u64>, b: &[u64]) {
    for (i, w) in a.iter_mut().enumerate() {
        *w &= b.get(i).copied().unwrap_or(0);
    }
    while a.last() == Some(&0) {
        a.pop();
    }
}

/// A subscription's acknowledgements, per origin site.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AckState {
    pub origins: BTreeMap<String, OriginAcks>,
}

/// Words of one batch's bit set at most (a batch of at most 64 × this many messages).
const BATCH_WORDS_MAX: usize = 1024;

impl AckState {
    /// Refuses what no site sends: a range across ledgers or backwards, a batch's bit set
    /// over [`BATCH_WORDS_MAX`] words.
    pub fn check(&self) -> Result<(), String> {
        for (site, a) in &self.origins {
            for (lo, hi) in &a.ranges {
                if lo.0 != hi.0 || lo.1 > hi.1 {
                    return Err(format!(
                        "origin {site}: range {}:{}..{}:{} is not within one ledger, in order",
                        lo.0, lo.1, hi.0, hi.1
                    ));
                }
            }
            if let Some((p, _)) = a.batches.iter().find(|(_, w)| w.len() > BATCH_WORDS_MAX) {
                return Err(format!(
                    "origin {site}: batch {}:{} has over {BATCH_WORDS_MAX} words",
                    p.0, p.1
                ));
            }
        }
        Ok(())
    }

    pub fn origin(&self, site: &str) -> Option<&OriginAcks> {
        self.origins.get(site)
    }

    /// Takes in what `other` acknowledges; whether anything changed.
    pub fn merge(&mut self, other: &AckState) -> bool {
        let mut changed = false;
        for (site, acks) in &other.origins {
            if acks.is_empty() {
                continue;
            }
            changed |= self.origins.entry(site.clone()).or_default().merge(acks);
        }
        changed
    }
}

/// Whether site `sender` held an entry (so its state can speak of it): it came from there,
/// or it was replicated to every site (`replicate_to` empty) or to the sender by name.
pub fn held_by(sender: &str, origin: &str, replicate_to: &[String]) -> bool {
    origin == sender || replicate_to.is_empty() || replicate_to.iter().any(|c| c == sender)
}

/// Builds a site's state from its cursor, entry by entry beyond the mark-delete position.
pub struct Builder {
    state: AckState,
}

impl Builder {
    /// `own`: this site, whose own entries' positions are local ones, acknowledged through
    /// `mark_delete`; `through`: per other origin, the highest of its entries at or before
    /// `mark_delete`.
    pub fn new(own: &str, mark_delete: Option<OPos>, through: &BTreeMap<String, OPos>) -> Self {
        let mut state = AckState::default();
        for (site, t) in through {
            state.origins.entry(site.clone()).or_default().through = Some(*t);
        }
        if let Some(md) = mark_delete {
            state.origins.entry(own.to_string()).or_default().through = Some(md);
        }
        Builder { state }
    }

    /// An entry beyond the mark-delete position acknowledged whole.
    pub fn acked(&mut self, origin: &str, at: OPos) {
        self.origin(origin).ranges.push((at, at));
    }

    /// A batch entry partly acknowledged (bit i set: message i still unacknowledged).
    pub fn partial(&mut self, origin: &str, at: OPos, unacked: Vec<u64>) {
        self.origin(origin).batches.push((at, unacked));
    }

    fn origin(&mut self, site: &str) -> &mut OriginAcks {
        if !self.state.origins.contains_key(site) {
            self.state
                .origins
                .insert(site.to_string(), OriginAcks::default());
        }
        self.state.origins.get_mut(site).expect("inserted")
    }

    pub fn finish(mut self) -> AckState {
        for acks in self.state.origins.values_mut() {
            acks.normalize();
        }
        self.state.origins.retain(|_, a| !a.is_empty());
        self.state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acks(through: Option<OPos>, ranges: &[(OPos, OPos)], batches: &[(OPos, u64)]) -> OriginAcks {
        let mut a = OriginAcks {
            through,
            ranges: ranges.to_vec(),
            batches: batches.iter().map(|(p, b)| (*p, vec![*b])).collect(),
        };
        a.normalize();
        a
    }

    #[test]
    fn given_a_state_then_it_covers_through_ranges_and_batches_and_nothing_else() {
        let a = acks(
            Some((3, 9)),
            &[((4, 2), (4, 5)), ((5, 0), (5, 0))],
            &[((4, 8), 0b101)],
        );
        assert_eq!(a.cover((1, 100)), Cover::Whole);
        assert_eq!(a.cover((3, 9)), Cover::Whole);
        assert_eq!(a.cover((3, 10)), Cover::Not);
        assert_eq!(a.cover((4, 1)), Cover::Not);
        assert_eq!(a.cover((4, 2)), Cover::Whole);
        assert_eq!(a.cover((4, 5)), Cover::Whole);
        assert_eq!(a.cover((4, 6)), Cover::Not);
        assert_eq!(a.cover((4, 8)), Cover::Partial(&[0b101]));
        assert_eq!(a.cover((5, 0)), Cover::Whole);
        assert_eq!(a.cover((5, 1)), Cover::Not);
        assert_eq!(a.reach(), Some((5, 0)));
    }

    #[test]
    fn given_ranges_next_to_each_other_or_to_through_then_they_merge() {
        let a = acks(
            Some((2, 4)),
            &[
                ((2, 5), (2, 7)),
                ((2, 9), (2, 9)),
                ((2, 8), (2, 8)),
                ((3, 0), (3, 1)),
            ],
            &[],
        );
        // 2:5..2:9 joins `through`; a range in the next ledger does not (the ledger's end is
        // not known here).
        assert_eq!(a.through, Some((2, 9)));
        assert_eq!(a.ranges, vec![((3, 0), (3, 1))]);
        let b = acks(
            Some((2, 4)),
            &[((1, 0), (2, 6))],
            &[((2, 3), 1), ((2, 20), 0)],
        );
        assert_eq!(b.through, Some((2, 6)));
        assert_eq!(
            b.ranges,
            vec![((2, 20), (2, 20))],
            "a batch with nothing left is whole"
        );
        assert!(b.batches.is_empty(), "a batch under `through` is dropped");
    }

    #[test]
    fn given_two_states_then_merging_is_their_union_in_either_order() {
        let a = acks(
            Some((1, 5)),
            &[((1, 9), (1, 9))],
            &[((1, 7), 0b110), ((1, 12), 0b1)],
        );
        let b = acks(
            Some((1, 3)),
            &[((1, 6), (1, 6)), ((1, 12), (1, 12))],
            &[((1, 7), 0b011)],
        );
        let mut ab = a.clone();
        assert!(ab.merge(&b));
        let mut ba = b.clone();
        assert!(ba.merge(&a));
        assert_eq!(ab, ba);
        assert_eq!(ab.through, Some((1, 6)));
        assert_eq!(ab.cover((1, 7)), Cover::Partial(&[0b010]));
        assert_eq!(ab.cover((1, 8)), Cover::Not);
        assert_eq!(ab.cover((1, 9)), Cover::Whole);
        assert_eq!(
            ab.cover((1, 12)),
            Cover::Whole,
            "whole at one side is whole"
        );
        // Merging again changes nothing.
        assert!(!ab.merge(&a));
        assert!(!ab.merge(&b));
        // Batches whose bits together leave nothing are whole.
        let mut c = acks(None, &[], &[((2, 0), 0b01)]);
        c.merge(&acks(None, &[], &[((2, 0), 0b10)]));
        assert_eq!(c.cover((2, 0)), Cover::Whole);
    }

    #[test]
    fn given_a_cursor_then_the_builder_states_it_per_origin() {
        let through = BTreeMap::from([("west".to_string(), (40, 7))]);
        let mut b = Builder::new("east", Some((10, 3)), &through);
        b.acked("east", (10, 5));
        b.acked("west", (40, 8));
        b.acked("west", (40, 9));
        b.acked("east", (10, 6));
        b.partial("north", (7, 1), vec![0b100]);
        let s = b.finish();
        assert_eq!(s.origin("east").unwrap().through, Some((10, 3)));
        assert_eq!(s.origin("east").unwrap().ranges, vec![((10, 5), (10, 6))]);
        assert_eq!(s.origin("west").unwrap().through, Some((40, 9)));
        assert_eq!(
            s.origin("north").unwrap().cover((7, 1)),
            Cover::Partial(&[0b100])
        );
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<AckState>(&json).unwrap(), s);
    }

    #[test]
    fn given_a_peer_s_state_then_ranges_across_ledgers_or_backwards_are_refused() {
        let mut s = AckState::default();
        s.origins.insert(
            "west".into(),
            OriginAcks {
                through: Some((3, u64::MAX)),
                ranges: vec![((3, 5), (3, 9))],
                batches: vec![],
            },
        );
        assert!(s.check().is_ok());
        // Merging it cannot overflow past `through`'s last entry.
        let mut m = AckState::default();
        m.merge(&s);
        s.origins.get_mut("west").unwrap().ranges = vec![((3, 5), (4, 1))];
        assert!(s.check().unwrap_err().contains("within one ledger"));
        s.origins.get_mut("west").unwrap().ranges = vec![((3, 9), (3, 5))];
        assert!(s.check().is_err());
        s.origins.get_mut("west").unwrap().ranges = vec![];
        s.origins.get_mut("west").unwrap().batches = vec![((3, 1), vec![1; 1025])];
        assert!(s.check().unwrap_err().contains("words"));
    }

    #[test]
    fn given_an_entry_then_it_was_held_by_its_origin_and_the_sites_it_went_to() {
        assert!(held_by("east", "east", &["west".into()]));
        assert!(held_by("east", "west", &[]));
        assert!(held_by("east", "west", &["east".into(), "west".into()]));
        assert!(!held_by("east", "west", &["west".into()]));
    }
}
