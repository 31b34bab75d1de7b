//! When a global object's tombstone may go: once every site it travels to has taken it, and
//! `geo.tombstone_grace_ms` later.
//!
//! ```text
//!  each beat: export ─► for each travelling tombstone, the sites whose copies carry it
//!             (Exported::for_peer)                    = must take it
//!  a peer's Synced for a document: its tombstones, less the keys it skipped = took it
//!  must take ⊆ took ─► covered (now) ─► grace later, and the deletion itself older than the
//!  grace ─► TenancyStore::collect_tombstone (only if still the same tombstone)
//! ```
//!
//! A peer that took a tombstone keeps its own until the sites it sends to took it; a tombstone
//! older than the grace that arrives where none is held is not kept again (what it deletes
//! still goes), so two sites never hand one back and forth. A site that never answers keeps
//! the tombstones that go to it for good. What was taken is remembered in memory: after a
//! restart it is learned again from the next exchanges.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use crate::federation::SyncItem;
use crate::versions::{Tombstone, Version};

#[derive(Debug)]
struct Progress {
    /// The tombstone's version: another one (deleted again) starts over.
    at: Version,
    tombstone: Tombstone,
    /// The sites it goes to (as of the last beat).
    must: BTreeSet<String>,
    /// The sites that took it.
    took: BTreeSet<String>,
    /// Since when every site it goes to has taken it.
    covered_since: Option<Instant>,
}

/// What the sites took of this site's tombstones (see the module's picture).
#[derive(Debug)]
pub struct TombstoneCollector {
    grace: Duration,
    by_key: HashMap<String, Progress>,
}

impl TombstoneCollector {
    pub fn new(grace: Duration) -> TombstoneCollector {
        TombstoneCollector {
            grace,
            by_key: HashMap::new(),
        }
    }

    /// A beat's tombstones (`Exported::tombstones`) and what each other site is sent
    /// (`Exported::for_peer`): the sites each tombstone must reach. Tombstones gone from the
    /// export are forgotten.
    pub fn plan<'a>(
        &mut self,
        tombstones: &[(&str, &Tombstone)],
        sent: impl IntoIterator<Item = (&'a str, &'a [SyncItem])>,
    ) {
        let mut must: HashMap<&str, BTreeSet<String>> = tombstones
            .iter()
            .map(|(k, _)| (*k, BTreeSet::new()))
            .collect();
        for (site, items) in sent {
            for item in items {
                if item.copy.deleted.is_some() {
                    if let Some(m) = must.get_mut(item.key.as_str()) {
                        m.insert(site.to_string());
                    }
                }
            }
        }
        self.by_key
            .retain(|k, p| tombstones.iter().any(|(key, t)| key == k && t.at == p.at));
        for (key, t) in tombstones {
            let p = self
                .by_key
                .entry(key.to_string())
                .or_insert_with(|| Progress {
                    at: t.at.clone(),
                    tombstone: (*t).clone(),
                    must: BTreeSet::new(),
                    took: BTreeSet::new(),
                    covered_since: None,
                });
            p.tombstone = (*t).clone();
            p.must = must.remove(key).unwrap_or_default();
            if !p.must.is_subset(&p.took) {
                p.covered_since = None;
            }
        }
    }

    /// `site` answered a document of `items` and did not take `skipped`: it holds the
    /// document's other tombstones.
    pub fn took(&mut self, site: &str, items: &[SyncItem], skipped: &[String]) {
        for item in items {
            let Some(t) = &item.copy.deleted else {
                continue;
            };
            if skipped.contains(&item.key) {
                continue;
            }
            if let Some(p) = self.by_key.get_mut(&item.key).filter(|p| p.at == t.at) {
                p.took.insert(site.to_string());
            }
        }
    }

    /// The tombstones that may go now, by key: every site they go to took them at least
    /// `grace` ago. The caller removes them ([`crate::TenancyStore::collect_tombstone`], which
    /// also waits until the deletion itself is older than the grace) and then calls
    /// [`TombstoneCollector::collected`].
    pub fn due(&mut self, now: Instant) -> Vec<(String, Tombstone)> {
        let mut out = Vec::new();
        for (key, p) in &mut self.by_key {
            if !p.must.is_subset(&p.took) {
                continue;
            }
            let since = *p.covered_since.get_or_insert(now);
            if now.duration_since(since) >= self.grace {
                out.push((key.clone(), p.tombstone.clone()));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// `key`'s tombstone is gone.
    pub fn collected(&mut self, key: &str) {
        self.by_key.remove(key);
    }

    /// How many tombstones wait: for a site to take them, or for the grace.
    pub fn waiting(&self) -> usize {
        self.by_key.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::versions::Copy;

    fn tomb(ms: u64, sites: &[&str]) -> Tombstone {
        Tombstone {
            at: Version(ms, 0, "east".into()),
            sites: sites.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn item(key: &str, t: &Tombstone) -> SyncItem {
        SyncItem {
            key: key.into(),
            copy: Copy {
                record: None,
                deleted: Some(t.clone()),
            },
        }
    }

    const NS: &str = "/admin/namespaces/acme/g";

    #[test]
    fn given_a_tombstone_then_it_is_due_a_grace_after_every_site_it_goes_to_took_it() {
        let grace = Duration::from_secs(60);
        let mut c = TombstoneCollector::new(grace);
        let t = tomb(1_000, &["east", "north", "west"]);
        let to_west = vec![item(NS, &t)];
        let to_north = vec![item(NS, &t)];
        let t0 = Instant::now();
        c.plan(
            &[(NS, &t)],
            [("west", &to_west[..]), ("north", &to_north[..])],
        );
        c.took("west", &to_west, &[]);
        assert!(c.due(t0 + grace * 2).is_empty(), "north has not taken it");
        c.took("north", &to_north, &[NS.to_string()]);
        assert!(c.due(t0 + grace * 2).is_empty(), "north skipped it");
        c.took("north", &to_north, &[]);
        let covered = t0 + grace * 3;
        assert!(c.due(covered).is_empty(), "covered now: the grace starts");
        assert!(c.due(covered + grace / 2).is_empty());
        assert_eq!(c.due(covered + grace), vec![(NS.to_string(), t.clone())]);
        c.collected(NS);
        assert_eq!(c.waiting(), 0);
    }

    #[test]
    fn given_a_new_site_or_a_new_deletion_then_the_count_starts_over() {
        let grace = Duration::from_secs(1);
        let mut c = TombstoneCollector::new(grace);
        let t = tomb(1_000, &["east", "west"]);
        let items = vec![item(NS, &t)];
        let t0 = Instant::now();
        c.plan(&[(NS, &t)], [("west", &items[..])]);
        c.took("west", &items, &[]);
        assert!(c.due(t0).is_empty());
        // A site joins that the tombstone now goes to: not covered any more.
        c.plan(&[(NS, &t)], [("west", &items[..]), ("south", &items[..])]);
        assert!(c.due(t0 + grace * 5).is_empty(), "south has not taken it");
        c.took("south", &items, &[]);
        assert!(c.due(t0 + grace * 5).is_empty(), "the grace starts again");
        assert_eq!(c.due(t0 + grace * 6).len(), 1);

        // Deleted again (a new version): what was taken of the old one does not count.
        let t2 = tomb(2_000, &["east", "west"]);
        let items2 = vec![item(NS, &t2)];
        c.plan(&[(NS, &t2)], [("west", &items2[..])]);
        c.took("west", &items, &[]);
        assert!(c.due(t0 + grace * 9).is_empty(), "the old one's taking");
        c.took("west", &items2, &[]);
        c.due(t0 + grace * 9);
        assert_eq!(c.due(t0 + grace * 10), vec![(NS.to_string(), t2)]);

        // Gone from the export (collected by another broker, or recreated): forgotten.
        c.plan(&[], [("west", &[][..])]);
        assert_eq!(c.waiting(), 0);
    }

    #[test]
    fn given_a_tombstone_that_goes_nowhere_then_it_is_due_after_the_grace() {
        let grace = Duration::from_secs(1);
        let mut c = TombstoneCollector::new(grace);
        let t = tomb(1_000, &[]);
        let t0 = Instant::now();
        c.plan(&[("/admin/clusters/gone", &t)], std::iter::empty());
        assert!(c.due(t0).is_empty());
        assert_eq!(c.due(t0 + grace).len(), 1);
    }
}
