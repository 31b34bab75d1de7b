//! The cross-site checker: what a replicated topic holds at its origin site against what the
//! site it replicates to holds, both read from their first message once every fault is
//! healed and replication has caught up.
//!
//! - none lost: every message stored at the origin is at the remote;
//! - none duplicated by replication: it is there as many times as at the origin;
//! - nothing from elsewhere: the remote holds no message the origin does not;
//! - order: each producer's messages are at the remote in their order at the origin.

use std::collections::{BTreeMap, HashMap};

use super::check::{Received, SendKey, Violation};

/// At most this many violations of one kind per topic are reported.
const PER_KIND: usize = 5;

fn counts(ms: &[Received]) -> BTreeMap<SendKey, usize> {
    let mut c = BTreeMap::new();
    for m in ms {
        *c.entry((m.producer.clone(), m.seq)).or_insert(0) += 1;
    }
    c
}

/// Does `remote` hold every message of `origin` (as often)? What a caller waits for.
pub fn caught_up(origin: &[Received], remote: &[Received]) -> bool {
    let have = counts(remote);
    counts(origin)
        .iter()
        .all(|(k, n)| have.get(k).copied().unwrap_or(0) >= *n)
}

/// Checks topic `topic`'s copy at `site` against its origin's.
pub fn check(topic: &str, site: &str, origin: &[Received], remote: &[Received]) -> Vec<Violation> {
    let mut out = Vec::new();
    let (at_origin, at_remote) = (counts(origin), counts(remote));
    let mut push = |kind: &'static str, what: String, excerpt: Vec<String>| {
        if out.iter().filter(|v: &&Violation| v.kind == kind).count() < PER_KIND {
            out.push(Violation {
                kind,
                topic: topic.to_string(),
                what,
                excerpt,
            });
        }
    };
    for ((p, s), n) in &at_origin {
        let got = at_remote.get(&(p.clone(), *s)).copied().unwrap_or(0);
        if got < *n {
            push(
                "replication lost",
                format!("{p}#{s} is stored {n} time(s) at the origin, {got} at {site}"),
                Vec::new(),
            );
        } else if got > *n {
            push(
                "replication duplicate",
                format!("{p}#{s} is stored {n} time(s) at the origin, {got} at {site}"),
                remote
                    .iter()
                    .filter(|m| &m.producer == p && m.seq == *s)
                    .map(|m| format!("at {site}: {}", m.id))
                    .collect(),
            );
        }
    }
    for ((p, s), n) in &at_remote {
        if !at_origin.contains_key(&(p.clone(), *s)) {
            push(
                "replication from nowhere",
                format!("{p}#{s} is stored {n} time(s) at {site} and not at the origin"),
                Vec::new(),
            );
        }
    }
    // Each producer's first copies at the remote, by their place at the origin.
    let mut place: HashMap<SendKey, usize> = HashMap::new();
    for (i, m) in origin.iter().enumerate() {
        place.entry((m.producer.clone(), m.seq)).or_insert(i);
    }
    let mut last: HashMap<&str, (usize, &Received)> = HashMap::new();
    let mut seen: HashMap<SendKey, ()> = HashMap::new();
    for m in remote {
        let key = (m.producer.clone(), m.seq);
        if seen.insert(key.clone(), ()).is_some() {
            continue;
        }
        let Some(&at) = place.get(&key) else {
            continue;
        };
        if let Some((before, prev)) = last.get(m.producer.as_str()) {
            if *before > at {
                push(
                    "replication order",
                    format!(
                        "{} is at {site} after {}, which comes after it at the origin",
                        show(m),
                        show(prev)
                    ),
                    Vec::new(),
                );
            }
        }
        last.insert(m.producer.as_str(), (at, m));
    }
    out
}

fn show(m: &Received) -> String {
    format!("{}#{} ({})", m.producer, m.seq, m.id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(p: &str, seq: u64) -> Received {
        Received {
            producer: p.into(),
            seq,
            id: format!("{seq}:0"),
        }
    }

    fn origin() -> Vec<Received> {
        vec![rec("a", 0), rec("b", 0), rec("a", 1), rec("b", 1)]
    }

    fn kinds(remote: &[Received]) -> Vec<&'static str> {
        check("t", "west", &origin(), remote)
            .iter()
            .map(|v| v.kind)
            .collect()
    }

    #[test]
    fn given_the_same_messages_in_another_interleaving_then_no_violation() {
        let remote = vec![rec("b", 0), rec("b", 1), rec("a", 0), rec("a", 1)];
        assert!(kinds(&remote).is_empty());
        assert!(caught_up(&origin(), &remote));
    }

    #[test]
    fn given_a_message_missing_then_lost_and_not_caught_up() {
        let remote = vec![rec("a", 0), rec("b", 0), rec("a", 1)];
        assert_eq!(kinds(&remote), ["replication lost"]);
        assert!(!caught_up(&origin(), &remote));
    }

    #[test]
    fn given_a_message_twice_or_one_of_nowhere_then_each_is_named() {
        let mut remote = origin();
        remote.push(rec("a", 1));
        remote.push(rec("c", 0));
        assert_eq!(
            kinds(&remote),
            ["replication duplicate", "replication from nowhere"]
        );
    }

    #[test]
    fn given_a_producer_s_messages_swapped_then_order() {
        let remote = vec![rec("a", 1), rec("b", 0), rec("a", 0), rec("b", 1)];
        assert_eq!(kinds(&remote), ["replication order"]);
    }
}
