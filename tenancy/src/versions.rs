//! Versions of global objects (cluster records, tenants, namespaces, topics' own policies),
//! sans-IO: how sites that
//! change them apart converge without a coordinator.
//!
//! ```text
//!  record JSON = { field: value, ..., "_v": { field: [ms, n, site], ..., "": [ms, n, site] } }
//!  tombstone   = { "at": [ms, n, site], "sites": [...] }        (the object was deleted)
//! ```
//!
//! A version is a hybrid logical clock reading (wall milliseconds, a counter for readings in
//! the same millisecond or behind a clock seen from a peer) and the site that made it; site
//! names break ties, so two versions are never equal unless one change made both. Each
//! top-level field carries the version of its last change, a removed field too (its version
//! stays with no value), and the field `""` the object's creation. Merging two copies keeps,
//! field by field, the newer version's value; a deletion keeps only what was changed after it,
//! and the object lives on only if it was created again after it. The merge is commutative,
//! associative and idempotent, so every site that has seen the same changes holds the same
//! object, whatever order they came in.

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The key of a record's versions.
pub const VERSIONS_FIELD: &str = "_v";
/// The version key of an object's creation.
pub const EXISTS: &str = "";

/// A hybrid logical clock reading and the site that took it; ordered by time, then counter,
/// then site.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
pub struct Version(pub u64, pub u32, pub String);

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}@{}", self.0, self.1, self.2)
    }
}

/// A hybrid logical clock: never behind the wall clock, never behind a reading it has seen,
/// strictly increasing.
#[derive(Debug, Default)]
pub struct Hlc {
    last: Mutex<(u64, u32)>,
}

impl Hlc {
    pub const fn new() -> Hlc {
        Hlc {
            last: Mutex::new((0, 0)),
        }
    }

    /// A reading for `site` at wall time `wall_ms`, after every reading taken or seen and
    /// after `floor`.
    pub fn tick(&self, wall_ms: u64, site: &str, floor: Option<&Version>) -> Version {
        let mut last = self.last.lock().expect("hlc lock");
        if let Some(f) = floor {
            if (f.0, f.1) > *last {
                *last = (f.0, f.1);
            }
        }
        *last = if wall_ms > last.0 {
            (wall_ms, 0)
        } else if last.1 == u32::MAX {
            (last.0 + 1, 0)
        } else {
            (last.0, last.1 + 1)
        };
        Version(last.0, last.1, site.to_string())
    }

    /// A reading seen from a peer: later readings come after it.
    pub fn observe(&self, v: &Version) {
        let mut last = self.last.lock().expect("hlc lock");
        if (v.0, v.1) > *last {
            *last = (v.0, v.1);
        }
    }
}

/// The clock of this process's tenancy records.
pub static CLOCK: Hlc = Hlc::new();

/// Milliseconds since the epoch.
pub fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A deleted object's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tombstone {
    pub at: Version,
    /// The sites the object named when it was deleted (its copies are there).
    #[serde(default)]
    pub sites: Vec<String>,
}

/// One site's copy of an object: its record (none: absent or deleted) and its deletion.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Copy {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deleted: Option<Tombstone>,
}

/// A record's fields and their versions apart.
fn split(record: &Value) -> (Map<String, Value>, BTreeMap<String, Version>) {
    let mut fields = record.as_object().cloned().unwrap_or_default();
    let versions = fields
        .remove(VERSIONS_FIELD)
        .and_then(|v| serde_json::from_value(v).ok())
        .unwrap_or_default();
    (fields, versions)
}

fn join(mut fields: Map<String, Value>, versions: BTreeMap<String, Version>) -> Value {
    fields.insert(
        VERSIONS_FIELD.to_string(),
        serde_json::to_value(versions).expect("versions serialise"),
    );
    Value::Object(fields)
}

/// The newest version in a record (its creation at least), if it has any.
pub fn newest(record: &Value) -> Option<Version> {
    split(record).1.into_values().max()
}

/// The record without its versions: what the object is.
pub fn plain(record: &Value) -> Value {
    Value::Object(split(record).0)
}

/// `new` as the next record after `old` (none: the object is created): every field whose value
/// differs (added, changed or removed) gets one version `at`, the others keep theirs.
pub fn stamp(old: Option<&Value>, new: &Value, at: &Version) -> Value {
    let (new_fields, _) = split(new);
    let (old_fields, mut versions) = match old {
        Some(o) => split(o),
        None => (Map::new(), BTreeMap::new()),
    };
    if old.is_none() {
        versions.clear();
        versions.insert(EXISTS.to_string(), at.clone());
    }
    let names: std::collections::BTreeSet<&String> =
        new_fields.keys().chain(old_fields.keys()).collect();
    for name in names {
        if new_fields.get(name) != old_fields.get(name) || old.is_none() {
            versions.insert(name.clone(), at.clone());
        }
    }
    join(new_fields, versions)
}

/// The version a change of `old` (or a creation after `deleted`) must come after.
pub fn floor(old: Option<&Value>, deleted: Option<&Tombstone>) -> Option<Version> {
    let a = old.and_then(newest);
    let b = deleted.map(|t| t.at.clone());
    a.max(b)
}

fn canonical(v: Option<&Value>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

/// Two copies of an object as one.
pub fn merge(a: &Copy, b: &Copy) -> Copy {
    let deleted = match (&a.deleted, &b.deleted) {
        (Some(x), Some(y)) => Some(if x.at >= y.at {
            let mut t = x.clone();
            if x.at == y.at {
                for s in &y.sites {
                    if !t.sites.contains(s) {
                        t.sites.push(s.clone());
                    }
                }
                t.sites.sort();
            }
            t
        } else {
            y.clone()
        }),
        (x, y) => x.clone().or_else(|| y.clone()),
    };
    let cut = deleted.as_ref().map(|t| &t.at);
    let zero = Version::default();
    // A record created before the deletion is of the object deleted: none of it stays, not
    // even a field changed after the deletion (so the order copies meet in does not matter).
    fn alive<'c>(c: &'c Copy, cut: Option<&Version>) -> Option<&'c Value> {
        c.record.as_ref().filter(|r| {
            let created = split(r).1.get(EXISTS).cloned().unwrap_or_default();
            cut.is_none_or(|d| created > *d)
        })
    }
    let (ra, rb) = (alive(a, cut), alive(b, cut));
    let (fa, va) = ra.map(split).unwrap_or_default();
    let (fb, vb) = rb.map(split).unwrap_or_default();
    let mut fields = Map::new();
    let mut versions = BTreeMap::new();
    let names: std::collections::BTreeSet<&String> = fa
        .keys()
        .chain(fb.keys())
        .chain(va.keys())
        .chain(vb.keys())
        .collect();
    // Without versions (a record from before them, or from only one side), a record is taken
    // as created at version zero.
    let exists_a = ra.map(|_| va.get(EXISTS).unwrap_or(&zero));
    let exists_b = rb.map(|_| vb.get(EXISTS).unwrap_or(&zero));
    for name in names {
        let side_a = (va.get(name).unwrap_or(&zero), fa.get(name));
        let side_b = (vb.get(name).unwrap_or(&zero), fb.get(name));
        // A field only one side has (and neither versioned) comes from that side.
        let pick_a = match side_a.0.cmp(side_b.0) {
            std::cmp::Ordering::Greater => true,
            std::cmp::Ordering::Less => false,
            std::cmp::Ordering::Equal => canonical(side_a.1) >= canonical(side_b.1),
        };
        let (v, value) = if pick_a { side_a } else { side_b };
        if cut.is_some_and(|c| v <= c) && name != EXISTS {
            continue;
        }
        if let Some(value) = value {
            fields.insert(name.clone(), value.clone());
        }
        if *v != zero {
            versions.insert(name.clone(), v.clone());
        }
    }
    let exists = exists_a.max(exists_b);
    let live = match (exists, cut) {
        (None, _) => false,
        (Some(_), None) => true,
        (Some(e), Some(c)) => e > c,
    };
    let record = live.then(|| {
        if let Some(e) = exists {
            if *e != zero {
                versions.insert(EXISTS.to_string(), e.clone());
            }
        }
        join(fields, versions)
    });
    Copy { record, deleted }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn v(ms: u64, site: &str) -> Version {
        Version(ms, 0, site.to_string())
    }

    fn copy(record: Option<Value>, deleted: Option<Version>) -> Copy {
        Copy {
            record,
            deleted: deleted.map(|at| Tombstone { at, sites: vec![] }),
        }
    }

    #[test]
    fn given_a_clock_then_readings_rise_past_the_wall_and_what_it_saw() {
        let c = Hlc::new();
        let a = c.tick(100, "east", None);
        let b = c.tick(100, "east", None);
        assert!(b > a);
        c.observe(&v(500, "west"));
        let d = c.tick(200, "east", None);
        assert!(d > v(500, "west"), "{d}");
        let e = c.tick(100, "east", Some(&Version(900, 3, "x".into())));
        assert_eq!((e.0, e.1), (900, 4));
    }

    #[test]
    fn given_a_change_then_only_the_fields_that_changed_get_its_version() {
        let created = stamp(None, &json!({"a": 1, "b": 2}), &v(1, "east"));
        assert_eq!(newest(&created), Some(v(1, "east")));
        let changed = stamp(Some(&created), &json!({"a": 1, "c": 3}), &v(2, "west"));
        let (fields, versions) = split(&changed);
        assert_eq!(Value::Object(fields), json!({"a": 1, "c": 3}));
        assert_eq!(versions["a"], v(1, "east"));
        assert_eq!(versions["b"], v(2, "west"), "a removal is a change");
        assert_eq!(versions["c"], v(2, "west"));
        assert_eq!(versions[EXISTS], v(1, "east"));
        assert_eq!(plain(&changed), json!({"a": 1, "c": 3}));
    }

    #[test]
    fn given_changes_of_different_fields_at_two_sites_then_both_are_kept_in_any_order() {
        let base = stamp(None, &json!({"ttl": 60, "retention": 10}), &v(1, "east"));
        let east = stamp(
            Some(&base),
            &json!({"ttl": 30, "retention": 10}),
            &v(5, "east"),
        );
        let west = stamp(
            Some(&base),
            &json!({"ttl": 60, "retention": 99}),
            &v(4, "west"),
        );
        let ab = merge(
            &copy(Some(east.clone()), None),
            &copy(Some(west.clone()), None),
        );
        let ba = merge(&copy(Some(west), None), &copy(Some(east), None));
        assert_eq!(ab, ba);
        assert_eq!(
            plain(ab.record.as_ref().unwrap()),
            json!({"ttl": 30, "retention": 99})
        );
        assert_eq!(merge(&ab, &ab), ab, "idempotent");
    }

    #[test]
    fn given_the_same_field_changed_at_two_sites_then_the_newer_wins_and_a_tie_goes_by_site() {
        let base = stamp(None, &json!({"ttl": 60}), &v(1, "east"));
        let east = stamp(Some(&base), &json!({"ttl": 30}), &v(5, "east"));
        let west = stamp(Some(&base), &json!({}), &v(5, "west"));
        let m = merge(
            &copy(Some(east.clone()), None),
            &copy(Some(west.clone()), None),
        );
        assert_eq!(plain(m.record.as_ref().unwrap()), json!({}), "west > east");
        let later = stamp(Some(&base), &json!({"ttl": 7}), &v(6, "east"));
        let m = merge(&copy(Some(later), None), &copy(Some(west), None));
        assert_eq!(plain(m.record.as_ref().unwrap()), json!({"ttl": 7}));
    }

    #[test]
    fn given_a_deletion_then_older_copies_stay_deleted_and_a_later_creation_lives_without_old_fields(
    ) {
        let base = stamp(None, &json!({"ttl": 60}), &v(1, "east"));
        let deleted = copy(None, Some(v(3, "west")));
        let m = merge(&copy(Some(base.clone()), None), &deleted);
        assert_eq!(m.record, None);
        assert_eq!(m.deleted.as_ref().unwrap().at, v(3, "west"));
        // A change made apart after the deletion does not bring the object back...
        let changed = stamp(Some(&base), &json!({"ttl": 5}), &v(4, "east"));
        assert_eq!(merge(&copy(Some(changed), None), &deleted).record, None);
        // ...a creation after it does, with none of the deleted object's fields.
        let again = stamp(None, &json!({"retention": 1}), &v(5, "east"));
        let m = merge(&copy(Some(again.clone()), None), &deleted);
        let m2 = merge(&m, &copy(Some(base), None));
        assert_eq!(plain(m2.record.as_ref().unwrap()), json!({"retention": 1}));
        assert_eq!(m2, merge(&copy(Some(again), Some(v(3, "west"))), &m2));
    }

    #[test]
    fn given_a_deletion_a_change_apart_and_a_creation_then_every_order_of_merging_agrees() {
        let a = stamp(None, &json!({"retention": 1}), &v(1, "east"));
        // West changes the old object after east deleted it, apart.
        let changed = copy(
            Some(stamp(
                Some(&a),
                &json!({"retention": 1, "ttl": 5}),
                &v(5, "west"),
            )),
            None,
        );
        let deleted = copy(None, Some(v(3, "east")));
        let again = Copy {
            record: Some(stamp(None, &json!({"retention": 2}), &v(7, "east"))),
            deleted: deleted.deleted.clone(),
        };
        let copies = [changed, deleted, again];
        let mut results = Vec::new();
        for order in [
            [0, 1, 2],
            [0, 2, 1],
            [1, 0, 2],
            [1, 2, 0],
            [2, 0, 1],
            [2, 1, 0],
        ] {
            let [x, y, z] = order.map(|i| &copies[i]);
            results.push(merge(&merge(x, y), z));
            results.push(merge(x, &merge(y, z)));
        }
        for r in &results {
            assert_eq!(r, &results[0]);
        }
        assert_eq!(
            plain(results[0].record.as_ref().unwrap()),
            json!({"retention": 2})
        );
    }

    #[test]
    fn given_records_from_before_versions_then_they_merge_deterministically() {
        let a = copy(Some(json!({"ttl": 1, "x": true})), None);
        let b = copy(Some(json!({"ttl": 2})), None);
        let ab = merge(&a, &b);
        assert_eq!(ab, merge(&b, &a));
        assert_eq!(
            plain(ab.record.as_ref().unwrap()),
            json!({"ttl": 2, "x": true})
        );
        // One side absent: the other's record as it is.
        let only = merge(&a, &Copy::default());
        assert_eq!(
            plain(only.record.as_ref().unwrap()),
            json!({"ttl": 1, "x": true})
        );
    }
}
