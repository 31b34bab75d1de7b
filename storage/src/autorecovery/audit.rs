//! What the auditor decides, sans-IO: which bookies are gone (absent past the grace period, or
//! decommissioned) and which fragments of a ledger had a replica on one of them.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::ledger::{LedgerMetadata, LedgerState};

/// A run of a ledger's entries that lost a replica: entries `first_entry..=last_entry` of the
/// fragment starting at `first_entry`, whose replicas on `bookies` are to be made again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MissingFragment {
    pub first_entry: u64,
    pub last_entry: u64,
    pub bookies: Vec<String>,
}

/// The record of an under-replicated ledger (`/autorecovery/underreplicated/L<id>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnderReplicated {
    pub ledger: u64,
    pub fragments: Vec<MissingFragment>,
    /// When the auditor first marked it, ms since the epoch.
    pub since_ms: u64,
    /// Failed re-replications so far, the last one's error and when it ended (workers wait
    /// [`retry_delay_ms`] after it before trying again).
    #[serde(default)]
    pub attempts: u32,
    #[serde(default)]
    pub last_error: String,
    #[serde(default)]
    pub last_attempt_ms: u64,
}

/// How long workers wait after the `attempts`-th failure of a ledger: 5 s doubling, at most
/// 5 minutes.
pub fn retry_delay_ms(attempts: u32) -> u64 {
    if attempts == 0 {
        return 0;
    }
    (5_000u64 << (attempts - 1).min(6)).min(300_000)
}

/// The fragments of `meta` with a replica on a bookie of `gone`. An open ledger's last fragment
/// (or one in recovery) is left out: its writer's own ensemble change (on its next add) or the
/// recovery that closes it covers the tail, and nobody else may change it meanwhile. Fragments
/// without entries (a closed ledger's end) are left out.
pub fn missing_fragments(meta: &LedgerMetadata, gone: &BTreeSet<String>) -> Vec<MissingFragment> {
    let mut out = Vec::new();
    for (i, f) in meta.fragments.iter().enumerate() {
        let last = match meta.fragments.get(i + 1) {
            Some(next) => match next.first_entry.checked_sub(1) {
                Some(l) => l,
                None => continue,
            },
            None => match (meta.state, meta.last_entry) {
                (LedgerState::Closed, Some(l)) => l,
                _ => continue,
            },
        };
        if last < f.first_entry {
            continue;
        }
        let bookies: Vec<String> = f
            .ensemble
            .iter()
            .filter(|b| gone.contains(*b))
            .cloned()
            .collect();
        if !bookies.is_empty() {
            out.push(MissingFragment {
                first_entry: f.first_entry,
                last_entry: last,
                bookies,
            });
        }
    }
    out
}

/// Which bookies are gone: every bookie the auditor knows of (registered once, or named by a
/// ledger) that has not been registered for `grace_ms`.
#[derive(Debug, Default)]
pub struct GoneTracker {
    /// Known bookies not registered now, with when they were first seen absent.
    absent_since: BTreeMap<String, u64>,
    registered: BTreeSet<String>,
}

impl GoneTracker {
    /// The registrations seen at `now_ms`.
    pub fn observe(&mut self, now_ms: u64, registered: &BTreeSet<String>) {
        for b in &self.registered {
            if !registered.contains(b) {
                self.absent_since.entry(b.clone()).or_insert(now_ms);
            }
        }
        self.absent_since.retain(|b, _| !registered.contains(b));
        self.registered = registered.clone();
    }

    /// A bookie named by a ledger: if it is not registered, its absence counts from `now_ms`
    /// (when nobody saw it leave, as at the auditor's start).
    pub fn note_named(&mut self, now_ms: u64, bookie: &str) {
        if !self.registered.contains(bookie) {
            self.absent_since
                .entry(bookie.to_string())
                .or_insert(now_ms);
        }
    }

    /// Forgets absent bookies no ledger names any more (after a full scan).
    pub fn retain_named(&mut self, named: &BTreeSet<String>) {
        self.absent_since.retain(|b, _| named.contains(b));
    }

    /// Bookies absent for at least `grace_ms` at `now_ms`.
    pub fn gone(&self, now_ms: u64, grace_ms: u64) -> BTreeSet<String> {
        self.absent_since
            .iter()
            .filter(|(_, since)| now_ms.saturating_sub(**since) >= grace_ms)
            .map(|(b, _)| b.clone())
            .collect()
    }

    /// Bookies absent, gone or not yet, with since when.
    pub fn absent(&self) -> &BTreeMap<String, u64> {
        &self.absent_since
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::Fragment;

    fn meta(state: LedgerState, last: Option<u64>, frags: &[(u64, &[&str])]) -> LedgerMetadata {
        LedgerMetadata {
            id: 7,
            ensemble_size: 3,
            write_quorum: 2,
            ack_quorum: 2,
            state,
            last_entry: last,
            master_key: String::new(),
            fragments: frags
                .iter()
                .map(|(first, e)| Fragment {
                    first_entry: *first,
                    ensemble: e.iter().map(|s| s.to_string()).collect(),
                })
                .collect(),
            created_ms: 0,
            properties: Default::default(),
        }
    }

    fn set(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn given_a_closed_ledger_then_every_fragment_with_a_gone_bookie_is_missing() {
        let m = meta(
            LedgerState::Closed,
            Some(20),
            &[(0, &["a", "b", "c"]), (10, &["a", "d", "c"])],
        );
        let got = missing_fragments(&m, &set(&["a"]));
        assert_eq!(
            got,
            vec![
                MissingFragment {
                    first_entry: 0,
                    last_entry: 9,
                    bookies: vec!["a".into()]
                },
                MissingFragment {
                    first_entry: 10,
                    last_entry: 20,
                    bookies: vec!["a".into()]
                },
            ]
        );
        assert_eq!(
            missing_fragments(&m, &set(&["b"])),
            vec![MissingFragment {
                first_entry: 0,
                last_entry: 9,
                bookies: vec!["b".into()]
            }]
        );
        assert!(missing_fragments(&m, &set(&["x"])).is_empty());
    }

    #[test]
    fn given_an_open_ledger_then_its_last_fragment_is_the_writers() {
        let m = meta(
            LedgerState::Open,
            None,
            &[(0, &["a", "b", "c"]), (5, &["d", "b", "c"])],
        );
        let got = missing_fragments(&m, &set(&["a", "b"]));
        assert_eq!(
            got,
            vec![MissingFragment {
                first_entry: 0,
                last_entry: 4,
                bookies: vec!["a".into(), "b".into()]
            }]
        );
        let rec = meta(LedgerState::InRecovery, None, &[(0, &["a", "b", "c"])]);
        assert!(missing_fragments(&rec, &set(&["a"])).is_empty());
    }

    #[test]
    fn given_ledgers_without_entries_then_nothing_is_missing() {
        let empty = meta(LedgerState::Closed, None, &[(0, &["a", "b", "c"])]);
        assert!(missing_fragments(&empty, &set(&["a"])).is_empty());
        // A closed ledger whose last fragment starts after its last entry.
        let m = meta(
            LedgerState::Closed,
            Some(4),
            &[(0, &["a", "b", "c"]), (5, &["a", "d", "c"])],
        );
        assert_eq!(missing_fragments(&m, &set(&["a"])).len(), 1);
    }

    #[test]
    fn failed_ledgers_are_retried_later_and_later() {
        assert_eq!(retry_delay_ms(0), 0);
        assert_eq!(retry_delay_ms(1), 5_000);
        assert_eq!(retry_delay_ms(2), 10_000);
        assert_eq!(retry_delay_ms(7), 300_000);
        assert_eq!(retry_delay_ms(40), 300_000);
    }

    #[test]
    fn given_registrations_over_time_then_a_bookie_is_gone_only_past_the_grace() {
        let mut t = GoneTracker::default();
        t.observe(0, &set(&["a", "b"]));
        t.observe(1_000, &set(&["b"]));
        assert!(t.gone(2_000, 5_000).is_empty());
        assert_eq!(t.gone(6_000, 5_000), set(&["a"]));
        // Back before the grace ran out elsewhere: forgotten.
        t.observe(6_500, &set(&["a", "b"]));
        assert!(t.gone(20_000, 5_000).is_empty());
        // Named by a ledger but never seen: absent from when it was noticed.
        t.note_named(10_000, "z");
        assert!(t.gone(14_000, 5_000).is_empty());
        assert_eq!(t.gone(15_000, 5_000), set(&["z"]));
        t.retain_named(&set(&["a"]));
        assert!(t.gone(30_000, 5_000).is_empty());
    }
}
