//! Namespace isolation policies, as Pulsar's `ns-isolation-policy` (sans-IO): which brokers of
//! a cluster may own a namespace's bundles. A policy names namespaces (regexes over
//! `tenant/namespace`), primary brokers and secondary brokers (regexes over broker ids,
//! `host:port`) and an auto-failover rule: `min_available` with `min_limit` = N uses the
//! secondaries too once fewer than N primaries are alive. A namespace no policy names goes on
//! brokers that are no policy's primary. Kept at `/admin/ns-isolation-policies/<cluster>/<name>`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub const POLICIES_PREFIX: &str = "/admin/ns-isolation-policies/";

/// The one auto-failover rule (Pulsar's).
pub const MIN_AVAILABLE: &str = "min_available";

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NsIsolationPolicy {
    pub namespaces: Vec<String>,
    pub primary: Vec<String>,
    pub secondary: Vec<String>,
    pub auto_failover_policy_type: String,
    pub min_limit: u32,
}

fn full(re: &str) -> Result<regex::Regex, String> {
    regex::Regex::new(&format!("^(?:{re})$")).map_err(|e| format!("regex {re:?}: {e}"))
}

fn any_matches(res: &[String], s: &str) -> bool {
    res.iter()
        .any(|r| full(r).map(|re| re.is_match(s)).unwrap_or(false))
}

impl NsIsolationPolicy {
    /// Checks the policy; the error names what is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if self.namespaces.is_empty() {
            return Err("--namespaces: at least one regex is required".into());
        }
        if self.primary.is_empty() {
            return Err("--primary: at least one broker regex is required".into());
        }
        for re in self
            .namespaces
            .iter()
            .chain(&self.primary)
            .chain(&self.secondary)
        {
            full(re)?;
        }
        if self.auto_failover_policy_type != MIN_AVAILABLE {
            return Err(format!(
                "--auto-failover-policy-type {:?}: the only type is {MIN_AVAILABLE}",
                self.auto_failover_policy_type
            ));
        }
        if self.min_limit > 1_000 {
            return Err(format!(
                "min_limit {} is out of range 0..=1000",
                self.min_limit
            ));
        }
        Ok(())
    }

    pub fn covers(&self, namespace: &str) -> bool {
        any_matches(&self.namespaces, namespace)
    }
}

/// The brokers of `alive` that may own a bundle of `namespace` under `policies` (by name; the
/// first in name order that names the namespace applies). `Err` says why none may.
pub fn allowed_brokers(
    policies: &BTreeMap<String, NsIsolationPolicy>,
    namespace: &str,
    alive: &[String],
) -> Result<Vec<String>, String> {
    if let Some((name, p)) = policies.iter().find(|(_, p)| p.covers(namespace)) {
        let primary: Vec<String> = alive
            .iter()
            .filter(|b| any_matches(&p.primary, b))
            .cloned()
            .collect();
        if !primary.is_empty() && primary.len() >= p.min_limit as usize {
            return Ok(primary);
        }
        let mut all = primary;
        all.extend(
            alive
                .iter()
                .filter(|b| !all_contains(&all, b) && any_matches(&p.secondary, b))
                .cloned()
                .collect::<Vec<_>>(),
        );
        if all.is_empty() {
            return Err(format!(
                "isolation policy {name} allows no live broker for {namespace} (primary {:?}, secondary {:?})",
                p.primary, p.secondary
            ));
        }
        return Ok(all);
    }
    let shared: Vec<String> = alive
        .iter()
        .filter(|b| !policies.values().any(|p| any_matches(&p.primary, b)))
        .cloned()
        .collect();
    if shared.is_empty() {
        return Err(format!(
            "every live broker is some isolation policy's primary, and no policy names {namespace}"
        ));
    }
    Ok(shared)
}

fn all_contains(v: &[String], b: &str) -> bool {
    v.iter().any(|x| x == b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(ns: &str, primary: &str, secondary: &str, min: u32) -> NsIsolationPolicy {
        NsIsolationPolicy {
            namespaces: vec![ns.into()],
            primary: vec![primary.into()],
            secondary: if secondary.is_empty() {
                vec![]
            } else {
                vec![secondary.into()]
            },
            auto_failover_policy_type: MIN_AVAILABLE.into(),
            min_limit: min,
        }
    }

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn a_namespace_goes_to_its_primaries_then_secondaries_below_the_minimum() {
        let mut ps = BTreeMap::new();
        ps.insert("a".to_string(), policy("ta/.*", "h:1", "h:2", 1));
        ps.insert("c".to_string(), policy("tc/.*", "h:1", "", 1));
        let alive = v(&["h:1", "h:2", "h:3"]);
        assert_eq!(allowed_brokers(&ps, "ta/ns", &alive), Ok(v(&["h:1"])));
        // Primary gone: the secondary.
        assert_eq!(
            allowed_brokers(&ps, "ta/ns", &v(&["h:2", "h:3"])),
            Ok(v(&["h:2"]))
        );
        // No secondary: nowhere, with the policy named.
        let e = allowed_brokers(&ps, "tc/ns", &v(&["h:2", "h:3"])).unwrap_err();
        assert!(e.contains("policy c"), "{e}");
        // Others stay off primaries.
        assert_eq!(
            allowed_brokers(&ps, "other/ns", &alive),
            Ok(v(&["h:2", "h:3"]))
        );
        assert!(allowed_brokers(&ps, "other/ns", &v(&["h:1"])).is_err());
        // A regex matches whole names only.
        assert_eq!(
            allowed_brokers(&ps, "xta/ns", &alive),
            Ok(v(&["h:2", "h:3"]))
        );
    }

    #[test]
    fn min_limit_brings_in_secondaries_while_primaries_are_few() {
        let mut ps = BTreeMap::new();
        ps.insert("a".to_string(), policy("ta/.*", "p.*", "s.*", 2));
        assert_eq!(
            allowed_brokers(&ps, "ta/x", &v(&["p1", "p2", "s1"])),
            Ok(v(&["p1", "p2"]))
        );
        assert_eq!(
            allowed_brokers(&ps, "ta/x", &v(&["p1", "s1"])),
            Ok(v(&["p1", "s1"]))
        );
    }

    #[test]
    fn policies_are_validated() {
        assert!(policy("ta/.*", "h:1", "", 1).validate().is_ok());
        assert!(policy("ta/(", "h:1", "", 1)
            .validate()
            .unwrap_err()
            .contains("regex"));
        let mut p = policy("ta/.*", "h:1", "", 1);
        p.auto_failover_policy_type = "other".into();
        assert!(p.validate().unwrap_err().contains(MIN_AVAILABLE));
        p = policy("ta/.*", "h:1", "", 1);
        p.primary.clear();
        assert!(p.validate().unwrap_err().contains("--primary"));
    }
}
