//! Where a ledger's replicas go (BookKeeper's rack-aware policy, sans-IO): writable bookies,
//! the emptiest first, spread over as many racks as there are, racks that the rest of the
//! ensemble does not use yet before those it does.

use std::collections::BTreeMap;

use crate::ledger::BookieInfo;

/// The rack of a bookie that names none.
pub const DEFAULT_RACK: &str = "/default-rack";

/// Chooses `n` bookies from `candidates`, none of `exclude`; `used_racks` are racks the rest
/// of the ensemble already has. With affinity `groups` (primary, then secondary), only
/// bookies of the primary group, or of both once the primary has too few.
/// `Err(available)` if fewer than `n` are writable.
pub fn choose(
    candidates: &[BookieInfo],
    n: usize,
    exclude: &[String],
    used_racks: &[String],
    groups: &[String],
) -> Result<Vec<String>, usize> {
    if groups.is_empty() {
        return choose_among(candidates, n, exclude, used_racks);
    }
    let of = |gs: &[String]| -> Vec<BookieInfo> {
        candidates
            .iter()
            .filter(|b| gs.contains(&b.group))
            .cloned()
            .collect()
    };
    match choose_among(&of(&groups[..1]), n, exclude, used_racks) {
        Err(_) if groups.len() > 1 => choose_among(&of(groups), n, exclude, used_racks),
        r => r,
    }
}

fn choose_among(
    candidates: &[BookieInfo],
    n: usize,
    exclude: &[String],
    used_racks: &[String],
) -> Result<Vec<String>, usize> {
    let mut usable: Vec<&BookieInfo> = candidates
        .iter()
        .filter(|b| b.writable && !exclude.contains(&b.address))
        .collect();
    if usable.len() < n {
        return Err(usable.len());
    }
    usable.sort_by(|a, b| {
        b.free_bytes
            .cmp(&a.free_bytes)
            .then(a.address.cmp(&b.address))
    });
    // Each rack's bookies, best first; racks in the order of their best bookie.
    let mut racks: BTreeMap<&str, Vec<&BookieInfo>> = BTreeMap::new();
    let mut order: Vec<&str> = Vec::new();
    for b in &usable {
        let r = b.rack.as_str();
        if !racks.contains_key(r) {
            order.push(r);
        }
        racks.entry(r).or_default().push(b);
    }
    // Racks the ensemble does not use yet come first (a stable partition keeps their order).
    order.sort_by_key(|r| used_racks.iter().any(|u| u == r));
    let mut out = Vec::with_capacity(n);
    let mut round = 0;
    while out.len() < n {
        for r in &order {
            if out.len() == n {
                break;
            }
            if let Some(b) = racks[r].get(round) {
                out.push(b.address.clone());
            }
        }
        round += 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(address: &str, rack: &str, free: u64) -> BookieInfo {
        BookieInfo {
            address: address.into(),
            free_bytes: free,
            writable: true,
            rack: rack.into(),
            group: String::new(),
        }
    }

    #[test]
    fn ensembles_span_racks_before_they_double_up_and_prefer_the_emptiest() {
        let site = [
            b("a1", "/a", 90),
            b("a2", "/a", 80),
            b("b1", "/b", 50),
            b("b2", "/b", 70),
            b("c1", "/c", 10),
        ];
        assert_eq!(choose(&site, 3, &[], &[], &[]).unwrap(), ["a1", "b2", "c1"]);
        assert_eq!(choose(&site, 2, &[], &[], &[]).unwrap(), ["a1", "b2"]);
        assert_eq!(
            choose(&site, 4, &[], &[], &[]).unwrap(),
            ["a1", "b2", "c1", "a2"]
        );
        // Replacing one member of an ensemble on /a and /b: /c first.
        assert_eq!(
            choose(
                &site,
                1,
                &["a1".into(), "b2".into()],
                &["/a".into(), "/b".into()],
                &[]
            )
            .unwrap(),
            ["c1"]
        );
        // One rack: the emptiest.
        let flat = [
            b("x", DEFAULT_RACK, 1),
            b("y", DEFAULT_RACK, 5),
            b("z", DEFAULT_RACK, 3),
        ];
        assert_eq!(choose(&flat, 2, &[], &[], &[]).unwrap(), ["y", "z"]);
        assert_eq!(choose(&flat, 4, &[], &[], &[]), Err(3));
        let mut ro = flat.clone();
        ro[1].writable = false;
        assert_eq!(choose(&ro, 2, &[], &[], &[]).unwrap(), ["z", "x"]);
    }

    #[test]
    fn affinity_groups_keep_ensembles_in_the_primary_then_the_secondary() {
        let mut site = vec![
            b("a1", "/a", 90),
            b("a2", "/b", 80),
            b("b1", "/a", 99),
            b("b2", "/b", 98),
            b("x", "/a", 100),
        ];
        for (bk, g) in site.iter_mut().zip(["ga", "ga", "gb", "gb", ""]) {
            bk.group = g.to_string();
        }
        let ga = ["ga".to_string()];
        assert_eq!(choose(&site, 2, &[], &[], &ga).unwrap(), ["a1", "a2"]);
        // Not enough in the primary and no secondary: refused, never spilled.
        assert_eq!(choose(&site, 3, &[], &[], &ga), Err(2));
        // With a secondary: both groups, never a bookie of neither.
        let both = ["ga".to_string(), "gb".to_string()];
        let three = choose(&site, 3, &[], &[], &both).unwrap();
        assert!(!three.contains(&"x".to_string()), "{three:?}");
        assert_eq!(three.len(), 3);
        // A replacement for a1 stays in the primary while it can.
        assert_eq!(
            choose(&site, 1, &["a1".into()], &["/b".into()], &both).unwrap(),
            ["a2"]
        );
    }
}
