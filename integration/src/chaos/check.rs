//! Checkers over a run's message history: what producers were told, what every topic holds at
//! the end (read from the earliest entry once every fault is healed), and what each
//! subscription delivered.
//!
//! - no acknowledged message lost: every acknowledged send is in its topic;
//! - no duplicate where deduplication is on: a send is stored once, and a subscription is
//!   handed one message id for it (redelivering that id is at-least-once, not a duplicate);
//! - per-producer order: a producer's sends are stored in the order it sent them;
//! - no message id used twice: a topic's ids are distinct, and a send's acknowledged id is
//!   where it is stored;
//! - every stored message reaches every durable subscription.

use std::collections::{BTreeMap, HashMap, HashSet};

/// A producer's send: the producer's name and the send's sequence number.
pub type SendKey = (String, u64);

/// One send as its producer saw it end.
#[derive(Clone, Debug)]
pub struct Send {
    pub topic: String,
    pub producer: String,
    pub seq: u64,
    /// The message id of the receipt (`ledger:entry[:batch]`), when acknowledged.
    pub acked: Option<String>,
}

/// One message as a reader or consumer received it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Received {
    pub producer: String,
    pub seq: u64,
    pub id: String,
}

/// A topic of the run and what was done on it.
#[derive(Clone, Debug, Default)]
pub struct TopicHistory {
    pub dedup: bool,
    pub sends: Vec<Send>,
    /// The topic's messages in order, read from the earliest at the end.
    pub stored: Vec<Received>,
    /// What each durable subscription delivered, in the order it did.
    pub delivered: BTreeMap<String, Vec<Received>>,
}

/// One broken promise, with the records that show it.
#[derive(Clone, Debug)]
pub struct Violation {
    pub kind: &'static str,
    pub topic: String,
    pub what: String,
    pub excerpt: Vec<String>,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "[{}] {}: {}", self.kind, self.topic, self.what)?;
        for line in &self.excerpt {
            writeln!(f, "    {line}")?;
        }
        Ok(())
    }
}

/// How much a check covered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Checked {
    pub sends: u64,
    pub acked: u64,
    pub stored: u64,
    pub delivered: u64,
}

/// At most this many violations of one kind per topic are reported.
const PER_KIND: usize = 5;

/// Runs every check on one topic.
pub fn check_topic(topic: &str, h: &TopicHistory) -> (Vec<Violation>, Checked) {
    let mut out = Vec::new();
    let mut report = |kind: &'static str, what: String, excerpt: Vec<String>| {
        if out.iter().filter(|v: &&Violation| v.kind == kind).count() < PER_KIND {
            out.push(Violation {
                kind,
                topic: topic.to_string(),
                what,
                excerpt,
            });
        }
    };
    let mut at: HashMap<SendKey, Vec<usize>> = HashMap::new();
    for (i, m) in h.stored.iter().enumerate() {
        at.entry((m.producer.clone(), m.seq)).or_default().push(i);
    }
    let around = |i: usize| -> Vec<String> {
        let lo = i.saturating_sub(2);
        let hi = (i + 3).min(h.stored.len());
        (lo..hi)
            .map(|k| format!("stored #{k}: {}", show(&h.stored[k])))
            .collect()
    };

    // Lost, and acknowledged where it is not stored.
    for s in &h.sends {
        let Some(id) = &s.acked else { continue };
        let key = (s.producer.clone(), s.seq);
        match at.get(&key) {
            None => {
                let near = h
                    .stored
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| m.producer == s.producer)
                    .min_by_key(|(_, m)| m.seq.abs_diff(s.seq))
                    .map(|(i, _)| around(i))
                    .unwrap_or_default();
                let mut ex = vec![format!(
                    "send {}#{} acknowledged as {id}",
                    s.producer, s.seq
                )];
                ex.extend(near);
                report(
                    "lost",
                    format!("acknowledged send {}#{} is not stored", s.producer, s.seq),
                    ex,
                );
            }
            Some(places) => {
                // A receipt names where the send is; a duplicate's receipt may name the copy
                // stored first (or no position at all: -1:-1).
                let ids: Vec<&str> = places.iter().map(|&i| h.stored[i].id.as_str()).collect();
                if !id.starts_with("-1:") && !ids.contains(&id.as_str()) {
                    let mut ex = vec![format!(
                        "send {}#{} acknowledged as {id}",
                        s.producer, s.seq
                    )];
                    ex.extend(places.iter().flat_map(|&i| around(i)));
                    report(
                        "id",
                        format!(
                            "send {}#{} acknowledged as {id} but stored at {}",
                            s.producer,
                            s.seq,
                            ids.join(", ")
                        ),
                        ex,
                    );
                }
            }
        }
    }

    // Two sends acknowledged with one id.
    let mut by_ack: HashMap<&str, &Send> = HashMap::new();
    for s in &h.sends {
        let Some(id) = s.acked.as_deref() else {
            continue;
        };
        if id.starts_with("-1:") {
            continue;
        }
        if let Some(other) = by_ack.insert(id, s) {
            if (other.producer.as_str(), other.seq) != (s.producer.as_str(), s.seq) {
                report(
                    "id",
                    format!("message id {id} acknowledged to two sends"),
                    vec![
                        format!("send {}#{}", other.producer, other.seq),
                        format!("send {}#{}", s.producer, s.seq),
                    ],
                );
            }
        }
    }

    // One id stored twice.
    let mut ids: HashMap<&str, usize> = HashMap::new();
    for (i, m) in h.stored.iter().enumerate() {
        if let Some(first) = ids.insert(m.id.as_str(), i) {
            let mut ex = around(first);
            ex.extend(around(i));
            report("id", format!("message id {} stored twice", m.id), ex);
        }
    }

    // Duplicates where deduplication is on.
    if h.dedup {
        let mut twice: Vec<(&SendKey, &Vec<usize>)> =
            at.iter().filter(|(_, places)| places.len() > 1).collect();
        twice.sort_by_key(|(_, places)| places[0]);
        for ((p, s), places) in twice {
            report(
                "duplicate",
                format!("send {p}#{s} stored {} times", places.len()),
                places.iter().flat_map(|&i| around(i)).collect(),
            );
        }
        for (sub, got) in &h.delivered {
            let mut ids_of: HashMap<SendKey, Vec<&str>> = HashMap::new();
            for m in got {
                let v = ids_of.entry((m.producer.clone(), m.seq)).or_default();
                if !v.contains(&m.id.as_str()) {
                    v.push(&m.id);
                }
            }
            let mut twice: Vec<_> = ids_of.iter().filter(|(_, v)| v.len() > 1).collect();
            twice.sort();
            for ((p, s), v) in twice {
                report(
                    "duplicate",
                    format!(
                        "subscription {sub} delivered send {p}#{s} as {} messages",
                        v.len()
                    ),
                    vec![format!("ids {}", v.join(", "))],
                );
            }
        }
    }

    // Per-producer order: each send's first copy after the previous send's first copy.
    let mut last: HashMap<&str, (u64, usize)> = HashMap::new();
    let mut first_seen: HashSet<SendKey> = HashSet::new();
    for (i, m) in h.stored.iter().enumerate() {
        if !first_seen.insert((m.producer.clone(), m.seq)) {
            continue;
        }
        if let Some(&(prev, j)) = last.get(m.producer.as_str()) {
            if m.seq < prev {
                let mut ex = around(j);
                ex.extend(around(i));
                report(
                    "order",
                    format!(
                        "{}#{} stored after {}#{prev}",
                        m.producer, m.seq, m.producer
                    ),
                    ex,
                );
            }
        }
        last.insert(&m.producer, (m.seq, i));
    }

    // Every stored message delivered to every subscription.
    for (sub, got) in &h.delivered {
        let ids: HashSet<&str> = got.iter().map(|m| m.id.as_str()).collect();
        let missing: Vec<&Received> = h
            .stored
            .iter()
            .filter(|m| !ids.contains(m.id.as_str()))
            .collect();
        if !missing.is_empty() {
            report(
                "undelivered",
                format!(
                    "subscription {sub} was not handed {} of {} stored messages",
                    missing.len(),
                    h.stored.len()
                ),
                missing.iter().take(5).map(|m| show(m)).collect(),
            );
        }
    }

    let checked = Checked {
        sends: h.sends.len() as u64,
        acked: h.sends.iter().filter(|s| s.acked.is_some()).count() as u64,
        stored: h.stored.len() as u64,
        delivered: h.delivered.values().map(|v| v.len() as u64).sum(),
    };
    (out, checked)
}

fn show(m: &Received) -> String {
    format!("{}#{} at {}", m.producer, m.seq, m.id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(p: &str, seq: u64, id: &str) -> Received {
        Received {
            producer: p.to_string(),
            seq,
            id: id.to_string(),
        }
    }

    fn acked(p: &str, seq: u64, id: &str) -> Send {
        Send {
            topic: "t".into(),
            producer: p.into(),
            seq,
            acked: Some(id.into()),
        }
    }

    fn good() -> TopicHistory {
        TopicHistory {
            dedup: true,
            sends: vec![
                acked("a", 0, "1:0"),
                acked("a", 1, "1:1"),
                acked("b", 0, "1:2"),
            ],
            stored: vec![rec("a", 0, "1:0"), rec("a", 1, "1:1"), rec("b", 0, "1:2")],
            delivered: BTreeMap::from([(
                "s".to_string(),
                vec![
                    rec("a", 0, "1:0"),
                    rec("a", 1, "1:1"),
                    // A redelivery of the same message: not a duplicate.
                    rec("a", 1, "1:1"),
                    rec("b", 0, "1:2"),
                ],
            )]),
        }
    }

    fn kinds(h: &TopicHistory) -> Vec<&'static str> {
        check_topic("t", h).0.iter().map(|v| v.kind).collect()
    }

    #[test]
    fn given_a_clean_history_then_no_violation() {
        let (v, c) = check_topic("t", &good());
        assert!(v.is_empty(), "{v:?}");
        assert_eq!(c.acked, 3);
        assert_eq!(c.delivered, 4);
    }

    #[test]
    fn given_an_acknowledged_send_missing_then_lost() {
        let mut h = good();
        h.stored.remove(1);
        h.delivered.clear();
        assert_eq!(kinds(&h), vec!["lost"]);
        // An unacknowledged send may be missing.
        h.sends[1].acked = None;
        assert!(kinds(&h).is_empty());
    }

    #[test]
    fn given_a_send_stored_twice_then_a_duplicate_only_with_dedup() {
        let mut h = good();
        h.stored.insert(2, rec("a", 1, "2:0"));
        h.delivered.clear();
        assert_eq!(kinds(&h), vec!["duplicate"]);
        h.dedup = false;
        assert!(kinds(&h).is_empty());
    }

    #[test]
    fn given_a_subscription_handed_two_copies_then_a_duplicate() {
        let mut h = good();
        h.delivered.get_mut("s").unwrap().push(rec("b", 0, "9:9"));
        assert_eq!(kinds(&h), vec!["duplicate"]);
    }

    #[test]
    fn given_a_producer_s_sends_out_of_order_then_order() {
        let mut h = good();
        h.stored.swap(0, 1);
        h.delivered.clear();
        assert_eq!(kinds(&h), vec!["order"]);
    }

    #[test]
    fn given_ids_reused_or_wrong_then_id() {
        let mut h = good();
        h.stored[2].id = "1:1".into();
        h.sends[2].acked = Some("1:1".into());
        h.delivered.clear();
        let k = kinds(&h);
        assert!(k.iter().all(|k| *k == "id") && k.len() == 2, "{k:?}");
    }

    #[test]
    fn given_a_stored_message_a_subscription_never_got_then_undelivered() {
        let mut h = good();
        h.delivered
            .get_mut("s")
            .unwrap()
            .retain(|m| m.producer != "b");
        assert_eq!(kinds(&h), vec!["undelivered"]);
    }
}
