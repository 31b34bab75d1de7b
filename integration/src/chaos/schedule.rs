//! Seeded fault schedules: the same seed and length give the same schedule, printed before a
//! run and with any violation it finds.
//!
//! Faults come one at a time (each healed before the next), so a site's quorums hold through
//! every schedule: one of three metadata nodes, one of four bookies (ensemble 3: a spare is
//! left) or one of two brokers is out at a time (or a bookie's disk is full, or a process's
//! wall clock jumps ahead or back); or, now and then, the power of the whole site goes (every
//! process killed, every disk loses what was not synced, all started again). With a second
//! site, its link or its process takes one fault in four.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A process of the site.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    Metadata(usize),
    /// The metadata node that leads when the fault starts.
    MetadataLeader,
    Bookie(usize),
    Broker(usize),
    /// Every process of the site (power cuts only).
    Site,
    /// The link east dials to the second site (partitions and lossy links only).
    Link,
    /// The second site, a standalone (kills and pauses).
    Remote,
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Metadata(i) => write!(f, "metadata node {}", i + 1),
            Target::MetadataLeader => write!(f, "the metadata leader"),
            Target::Bookie(i) => write!(f, "bookie {i}"),
            Target::Broker(i) => write!(f, "broker {i}"),
            Target::Site => write!(f, "the whole site"),
            Target::Link => write!(f, "the link to site west"),
            Target::Remote => write!(f, "site west"),
        }
    }
}

/// What happens to the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Action {
    /// kill -9, down for the fault's length, then started again on its addresses.
    Kill,
    /// SIGSTOP for the fault's length, then SIGCONT: frozen with its sockets open.
    Pause,
    /// kill -9, then what its disk had not synced is lost (see [`Cut`]); started again after
    /// the fault's length.
    PowerCut(Cut),
    /// A bookie's disk full for the fault's length (writes that need space fail with ENOSPC,
    /// no free block shows), then its space back.
    DiskFull,
    /// No datagram through the link for the fault's length.
    Partition,
    /// The link drops a fifth of the datagrams, duplicates some, delays and reorders them.
    Flaky,
    /// The target's wall clock this many seconds off (ahead or behind) for the fault's
    /// length, then back.
    ClockJump(i64),
}

/// What a power cut leaves of the bytes written and not synced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Cut {
    /// Nothing.
    Clean,
    /// A random prefix of the last write (a torn write), from this seed.
    Torn(u64),
    /// A random half of the unsynced pages (a page cache that wrote some back), from this seed.
    Partial(u64),
}

/// One fault of a schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// Milliseconds after the previous fault healed.
    pub after_ms: u64,
    pub action: Action,
    pub target: Target,
    /// How long the target stays killed or paused.
    pub length_ms: u64,
}

impl Fault {
    /// The fault's kind, as the report counts them.
    pub fn kind(&self) -> String {
        let who = match self.target {
            Target::Metadata(_) => "metadata",
            Target::MetadataLeader => "metadata-leader",
            Target::Bookie(_) => "bookie",
            Target::Broker(_) => "broker",
            Target::Site => "site",
            Target::Link => "link",
            Target::Remote => "remote-site",
        };
        let what = match self.action {
            Action::Kill => "kill",
            Action::Pause => "pause",
            Action::PowerCut(_) => "power-cut",
            Action::DiskFull => "disk-full",
            Action::Partition => "partition",
            Action::Flaky => "flaky",
            Action::ClockJump(_) => "clock-jump",
        };
        format!("{what} {who}")
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.action {
            Action::Kill => "kill -9",
            Action::Pause => "SIGSTOP",
            Action::PowerCut(Cut::Clean) => "cut the power of",
            Action::PowerCut(Cut::Torn(_)) => "cut the power (tearing a write) of",
            Action::PowerCut(Cut::Partial(_)) => "cut the power (half the pages written) of",
            Action::DiskFull => "fill the disk of",
            Action::Partition => "partition",
            Action::Flaky => "make lossy",
            Action::ClockJump(secs) => {
                return write!(
                    f,
                    "+{} ms: jump the clock of {} by {secs:+} s for {} ms",
                    self.after_ms, self.target, self.length_ms
                )
            }
        };
        write!(
            f,
            "+{} ms: {what} {} for {} ms",
            self.after_ms, self.target, self.length_ms
        )
    }
}

/// The shortest quiet stretch: a gap this long or longer between two faults.
pub const QUIET_MS: u64 = 15_000;

/// How many of each process a site has.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub metadata: usize,
    pub bookies: usize,
    pub brokers: usize,
    /// A second site, and the link to it, take faults too.
    pub remote: bool,
}

/// Faults, one after another, until their gaps and lengths add up to `total_ms`.
pub fn generate(seed: u64, total_ms: u64, shape: Shape) -> Vec<Fault> {
    generate_only(seed, total_ms, shape, |_| true)
}

/// [`generate`] with only the faults `keep` accepts (the others are drawn and skipped, so a
/// seed gives the same faults of a kind with and without a filter, and the time is filled).
pub fn generate_only(
    seed: u64,
    total_ms: u64,
    shape: Shape,
    keep: impl Fn(&Fault) -> bool,
) -> Vec<Fault> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    let mut used = 0;
    // A filter nothing passes ends after this many draws.
    let mut draws = 0u32;
    loop {
        draws += 1;
        if draws > 100_000 {
            return out;
        }
        // Mostly short gaps; one in five a quiet stretch, where the runner measures the rates
        // and latency a fault may have left lower.
        let after_ms = if rng.gen_range(0..5) == 0 {
            rng.gen_range(QUIET_MS..QUIET_MS + 10_000)
        } else {
            rng.gen_range(1_000..4_000)
        };
        // With a second site, one fault in four is of the link to it or of that site (drawn
        // only then, so a one-site seed gives the schedule it always gave).
        let remote = shape.remote && rng.gen_range(0..4) == 0;
        let mut target = match rng.gen_range(0..4) {
            0 => Target::Metadata(rng.gen_range(0..shape.metadata)),
            1 => Target::MetadataLeader,
            2 => Target::Bookie(rng.gen_range(0..shape.bookies)),
            _ => Target::Broker(rng.gen_range(0..shape.brokers)),
        };
        let action = match rng.gen_range(0..20) {
            0..=7 => Action::Kill,
            8..=12 => Action::Pause,
            13..=14 => {
                target = Target::Bookie(rng.gen_range(0..shape.bookies));
                Action::DiskFull
            }
            15..=16 => Action::ClockJump(if rng.gen_bool(0.5) {
                rng.gen_range(1..=600)
            } else {
                -rng.gen_range(1..=300)
            }),
            _ => {
                let cut = match rng.gen_range(0..3) {
                    0 => Cut::Clean,
                    1 => Cut::Torn(rng.gen()),
                    _ => Cut::Partial(rng.gen()),
                };
                // One power cut in six is the whole site's; a broker keeps nothing on disk,
                // so its power cut is a kill.
                if rng.gen_range(0..6) == 0 {
                    target = Target::Site;
                }
                if matches!(target, Target::Broker(_)) {
                    Action::Kill
                } else {
                    Action::PowerCut(cut)
                }
            }
        };
        let mut length_ms = rng.gen_range(300..5_000);
        if matches!(action, Action::ClockJump(_)) {
            // The processes read their clock's offset once a second.
            length_ms = length_ms.max(2_000);
        }
        let (action, target) = if remote {
            // Long enough for a backlog and the replicators' back-off to show.
            length_ms = rng.gen_range(2_000..10_000);
            match rng.gen_range(0..4) {
                0 => (Action::Partition, Target::Link),
                1 => (Action::Flaky, Target::Link),
                2 => (Action::Kill, Target::Remote),
                _ => (Action::Pause, Target::Remote),
            }
        } else {
            (action, target)
        };
        let f = Fault {
            after_ms,
            action,
            target,
            length_ms,
        };
        if !keep(&f) {
            continue;
        }
        used += after_ms + length_ms;
        if used > total_ms && !out.is_empty() {
            return out;
        }
        out.push(f);
        if used > total_ms {
            return out;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: Shape = Shape {
        metadata: 3,
        bookies: 4,
        brokers: 2,
        remote: false,
    };

    #[test]
    fn given_a_seed_then_the_same_schedule_every_time_and_another_for_another_seed() {
        let a = generate(7, 120_000, SHAPE);
        assert_eq!(a, generate(7, 120_000, SHAPE));
        assert_ne!(a, generate(8, 120_000, SHAPE));
        let total: u64 = a.iter().map(|f| f.after_ms + f.length_ms).sum();
        assert!(total <= 120_000 && total > 120_000 - 30_000, "{total}");
        assert!(a.iter().any(|f| f.after_ms >= QUIET_MS), "a quiet stretch");
    }

    #[test]
    fn given_a_filter_then_only_its_faults_fill_the_time() {
        let only = generate_only(7, 120_000, SHAPE, |f| f.action == Action::DiskFull);
        assert!(only.len() > 5 && only.iter().all(|f| f.action == Action::DiskFull));
        let total: u64 = only.iter().map(|f| f.after_ms + f.length_ms).sum();
        assert!(total > 120_000 - 30_000, "{total}");
        assert!(generate_only(7, 120_000, SHAPE, |_| false).is_empty());
    }

    #[test]
    fn given_a_long_schedule_then_every_kind_of_fault_comes_up() {
        let kinds: std::collections::BTreeSet<String> = generate(1, 1_800_000, SHAPE)
            .iter()
            .map(Fault::kind)
            .collect();
        // kill, pause and clock jump of each of the four targets, power cuts of the three
        // that keep data and of the whole site, a bookie's full disk.
        assert_eq!(kinds.len(), 17, "{kinds:?}");
        // With a second site: its link's partitions and losses, its kills and pauses too;
        // the one-site faults still come up.
        let two = Shape {
            remote: true,
            ..SHAPE
        };
        let kinds: std::collections::BTreeSet<String> = (1..=4)
            .flat_map(|seed| generate(seed, 1_800_000, two))
            .map(|f| f.kind())
            .collect();
        assert_eq!(kinds.len(), 21, "{kinds:?}");
    }

    #[test]
    fn given_one_site_then_no_fault_of_a_second_one_and_given_two_then_some() {
        let one = generate(3, 120_000, SHAPE);
        assert!(one
            .iter()
            .all(|f| !matches!(f.target, Target::Link | Target::Remote)));
        let two = generate(
            3,
            120_000,
            Shape {
                remote: true,
                ..SHAPE
            },
        );
        assert!(two
            .iter()
            .any(|f| matches!(f.target, Target::Link | Target::Remote)));
    }
}
