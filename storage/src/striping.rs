//! Striping arithmetic of a ledger: which bookies of an ensemble store an entry, when an entry
//! is acknowledged, and when enough bookies answered a recovery step.
//!
//! A ledger fragment has an ensemble of E bookies (indexes `0..E`); entry `e` is written to the
//! Qw bookies `e mod E, e+1 mod E, ..., e+Qw-1 mod E` (round-robin) and is acknowledged once Qa
//! of them confirmed it fsynced.

/// Ensemble size, write quorum and ack quorum, validated: `1 <= Qa <= Qw <= E <= 64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quorums {
    ensemble: u8,
    write: u8,
    ack: u8,
}

/// Largest supported ensemble (acknowledgements are tracked in a 64-bit mask).
pub const ENSEMBLE_MAX: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid quorums ensemble={ensemble} write_quorum={write} ack_quorum={ack}: need \
     1 <= ack_quorum <= write_quorum <= ensemble <= {ENSEMBLE_MAX}"
)]
pub struct QuorumError {
    pub ensemble: usize,
    pub write: usize,
    pub ack: usize,
}

impl Quorums {
    pub fn new(ensemble: usize, write: usize, ack: usize) -> Result<Self, QuorumError> {
        if !(1 <= ack && ack <= write && write <= ensemble && ensemble <= ENSEMBLE_MAX) {
            return Err(QuorumError {
                ensemble,
                write,
                ack,
            });
        }
        Ok(Self {
            ensemble: ensemble as u8,
            write: write as u8,
            ack: ack as u8,
        })
    }

    pub fn ensemble(&self) -> usize {
        self.ensemble as usize
    }

    pub fn write(&self) -> usize {
        self.write as usize
    }

    pub fn ack(&self) -> usize {
        self.ack as usize
    }

    /// Ensemble indexes of the bookies that store `entry`, in the order they are tried for reads.
    pub fn write_set(&self, entry: u64) -> impl Iterator<Item = usize> + '_ {
        let e = self.ensemble as u64;
        let first = entry % e;
        (0..self.write as u64).map(move |i| ((first + i) % e) as usize)
    }

    /// Whether the bookie at ensemble index `bookie` stores `entry`.
    pub fn stores(&self, bookie: usize, entry: u64) -> bool {
        let e = self.ensemble as u64;
        let distance = (bookie as u64 + e - entry % e) % e;
        distance < self.write as u64
    }

    /// How many bookies of an entry's write set must say "no such entry" before recovery may
    /// conclude the entry was never acknowledged: if fewer had it than this, no ack quorum can
    /// have formed (`Qw - Qa + 1`).
    pub fn absent_confirmations(&self) -> usize {
        (self.write - self.ack + 1) as usize
    }

    /// Whether the bookies in `answered` (a mask of ensemble indexes) intersect every possible
    /// ack quorum: every write set has at least `Qw - Qa + 1` of them. Fencing is complete (no
    /// old writer can gather an ack quorum any more) once this holds.
    pub fn covers_every_ack_quorum(&self, answered: u64) -> bool {
        let need = self.absent_confirmations();
        (0..self.ensemble as u64).all(|start| {
            self.write_set(start)
                .filter(|i| answered & (1u64 << i) != 0)
                .count()
                >= need
        })
    }
}

/// Acknowledgements of one entry by distinct bookies of its write set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AckSet {
    acked: u64,
}

impl AckSet {
    /// Records bookie `index`'s acknowledgement; returns whether the entry has now reached the
    /// ack quorum. An acknowledgement repeated by the same bookie counts once.
    pub fn ack(&mut self, q: &Quorums, index: usize) -> bool {
        debug_assert!(index < q.ensemble(), "ack from outside the ensemble");
        self.acked |= 1u64 << index;
        self.is_complete(q)
    }

    pub fn is_complete(&self, q: &Quorums) -> bool {
        self.acked.count_ones() as usize >= q.ack()
    }

    /// Forgets bookie `index` (it was replaced by an ensemble change and must be written again).
    pub fn forget(&mut self, index: usize) {
        self.acked &= !(1u64 << index);
    }

    pub fn has(&self, index: usize) -> bool {
        self.acked & (1u64 << index) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(e: usize, w: usize, a: usize) -> Quorums {
        Quorums::new(e, w, a).expect("valid quorums")
    }

    #[test]
    fn given_quorums_then_only_valid_combinations_are_accepted() {
        assert!(Quorums::new(3, 2, 2).is_ok());
        assert!(Quorums::new(1, 1, 1).is_ok());
        assert!(Quorums::new(64, 64, 1).is_ok());
        for (e, w, a) in [
            (0, 0, 0),
            (3, 2, 3),
            (2, 3, 1),
            (3, 0, 0),
            (65, 2, 2),
            (3, 3, 0),
        ] {
            let err = Quorums::new(e, w, a).expect_err("invalid");
            assert!(err
                .to_string()
                .contains("1 <= ack_quorum <= write_quorum <= ensemble <= 64"));
        }
    }

    #[test]
    fn given_entry_then_its_write_set_is_round_robin() {
        let s = |q: &Quorums, e| q.write_set(e).collect::<Vec<_>>();
        let q32 = q(3, 2, 2);
        assert_eq!(s(&q32, 0), [0, 1]);
        assert_eq!(s(&q32, 1), [1, 2]);
        assert_eq!(s(&q32, 2), [2, 0]);
        assert_eq!(s(&q32, 3), [0, 1]);
        let q53 = q(5, 3, 2);
        assert_eq!(s(&q53, 4), [4, 0, 1]);
        assert_eq!(s(&q53, u64::MAX), [0, 1, 2], "u64::MAX % 5 == 0");
        for quorums in [q32, q53, q(1, 1, 1), q(4, 4, 3), q(7, 2, 1)] {
            for entry in 0..50 {
                let set: Vec<usize> = quorums.write_set(entry).collect();
                for b in 0..quorums.ensemble() {
                    assert_eq!(
                        quorums.stores(b, entry),
                        set.contains(&b),
                        "{quorums:?} entry {entry} bookie {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn given_acks_then_entry_completes_at_ack_quorum_of_distinct_bookies() {
        let quorums = q(3, 3, 2);
        let mut a = AckSet::default();
        assert!(!a.ack(&quorums, 1));
        assert!(!a.ack(&quorums, 1), "a repeated ack counts once");
        assert!(a.ack(&quorums, 2));
        a.forget(2);
        assert!(!a.is_complete(&quorums));
        assert!(a.has(1) && !a.has(2));
    }

    #[test]
    fn given_fence_answers_then_coverage_needs_every_write_set() {
        // E=3 Qw=2 Qa=2: one answer per write set suffices; {0} misses write set [1, 2].
        let quorums = q(3, 2, 2);
        assert!(!quorums.covers_every_ack_quorum(0b001));
        assert!(quorums.covers_every_ack_quorum(0b011));
        assert!(quorums.covers_every_ack_quorum(0b101));
        // E=3 Qw=3 Qa=2: two answers per write set.
        let quorums = q(3, 3, 2);
        assert!(!quorums.covers_every_ack_quorum(0b001));
        assert!(quorums.covers_every_ack_quorum(0b011));
        // E=1: the one bookie.
        assert!(q(1, 1, 1).covers_every_ack_quorum(0b1));
        assert!(!q(1, 1, 1).covers_every_ack_quorum(0));
        assert_eq!(q(5, 3, 2).absent_confirmations(), 2);
    }
}
