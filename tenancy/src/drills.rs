//! Failover drills' reports, kept at the site where a drill was run (`/geo-drills/<id>`), for
//! `meridian-admin geo drills list | show ID`.

use crate::pb::DrillReport;
use crate::store::{AdminError, TenancyStore};

/// Where drill reports are kept.
pub const DRILLS_PREFIX: &str = "/geo-drills/";

/// Reports kept at a site: the latest.
pub const REPORTS_KEPT: usize = 100;

/// A report id: letters, digits, `-` and `_`, 1 to 64 of them.
fn check_id(id: &str) -> Result<(), AdminError> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(AdminError::Invalid(format!(
            "drill report id {id:?}: 1 to 64 of A-Z a-z 0-9 - _"
        )))
    }
}

impl TenancyStore {
    /// Keeps a drill's report (a report with the same id is replaced).
    pub async fn put_drill_report(&self, r: &DrillReport) -> Result<(), AdminError> {
        check_id(&r.id)?;
        serde_json::from_str::<serde_json::Value>(&r.json)
            .map_err(|e| AdminError::Invalid(format!("drill report {}: its json: {e}", r.id)))?;
        let value = serde_json::to_vec(&serde_json::json!({
            "id": r.id, "started_ms": r.started_ms, "summary": r.summary, "json": r.json,
        }))
        .expect("report serializes");
        self.meta
            .put(&format!("{DRILLS_PREFIX}{}", r.id), value)
            .await
            .map_err(|e| AdminError::Unavailable(e.to_string()))?;
        // The latest REPORTS_KEPT are kept.
        let all = self.drill_reports().await?;
        for old in all.iter().take(all.len().saturating_sub(REPORTS_KEPT)) {
            self.meta
                .delete(&format!("{DRILLS_PREFIX}{}", old.id), None)
                .await
                .map_err(|e| AdminError::Unavailable(e.to_string()))?;
        }
        Ok(())
    }

    /// Every report kept here, oldest first.
    pub async fn drill_reports(&self) -> Result<Vec<DrillReport>, AdminError> {
        let mut out = Vec::new();
        let mut after = String::new();
        loop {
            let page = self
                .meta
                .children(DRILLS_PREFIX, &after, 0)
                .await
                .map_err(|e| AdminError::Unavailable(e.to_string()))?;
            for id in &page.children {
                if let Ok(r) = self.drill_report(id).await {
                    out.push(r);
                }
            }
            match page.children.last() {
                Some(last) if page.more => after = last.clone(),
                _ => break,
            }
        }
        out.sort_by(|a, b| a.started_ms.cmp(&b.started_ms).then(a.id.cmp(&b.id)));
        Ok(out)
    }

    pub async fn drill_report(&self, id: &str) -> Result<DrillReport, AdminError> {
        check_id(id)?;
        let key = format!("{DRILLS_PREFIX}{id}");
        let kv = self
            .meta
            .get(&key)
            .await
            .map_err(|e| AdminError::Unavailable(e.to_string()))?
            .ok_or_else(|| AdminError::NotFound(format!("no drill report {id}")))?;
        let v: serde_json::Value = serde_json::from_slice(&kv.value)
            .map_err(|e| AdminError::Unavailable(format!("record {key} is damaged: {e}")))?;
        Ok(DrillReport {
            id: v["id"].as_str().unwrap_or(id).to_string(),
            started_ms: v["started_ms"].as_u64().unwrap_or(0),
            summary: v["summary"].as_str().unwrap_or_default().to_string(),
            json: v["json"].as_str().unwrap_or("{}").to_string(),
        })
    }
}

/// One replicated subscription: what the other site would deliver again.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SubExposure {
    pub name: String,
    pub entries: u64,
    pub messages: u64,
}

/// One topic (or partition): what the other site would lose.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TopicExposure {
    pub topic: String,
    pub entries: u64,
    pub messages: u64,
    pub bytes: u64,
    /// How long before the measure (a drill's: the cut) the oldest of them was published.
    pub oldest_ms: u64,
    /// When it was published, ms since the epoch (0: none).
    #[serde(default)]
    pub oldest_publish_ms: u64,
    /// The last of the first site's own entries the other holds (`ledger:entry`; empty: none).
    pub remote_holds: String,
    pub subscriptions: Vec<SubExposure>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The recovery point: what would be lost over every topic.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Rpo {
    pub entries: u64,
    pub messages: u64,
    pub bytes: u64,
    /// The age of the oldest entry that would be lost, seconds.
    pub seconds: f64,
}

/// A drill's phases, each timed (ms).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Phases {
    /// From the start until the cut was in place at the first site.
    pub cut_ms: u64,
    /// From the cut until the measure was stable (what was in flight had landed).
    pub measured_ms: u64,
    /// RTO: from the cut until every topic was served at the other site.
    pub rto_ms: u64,
    /// From the cut until every replicated subscription at the other site had applied what
    /// it held of the first site's states (the subscriptions' positions in place there).
    #[serde(default)]
    pub subscriptions_ms: u64,
    /// From the cut until the restore began.
    pub hold_ms: u64,
    /// From the restore until the first site served again and the clients were sent back.
    pub restore_ms: u64,
    /// From the restore until neither site had anything of the namespace left to replicate
    /// to the other.
    pub caught_up_ms: u64,
}

/// A drill's report.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Drill {
    pub id: String,
    /// `dry-run`: measured, nothing changed.
    pub kind: String,
    pub from: String,
    pub to: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    pub started_ms: u64,
    pub finished_ms: u64,
    pub rpo: Rpo,
    /// Messages the other site would deliver again over every replicated subscription.
    pub redelivered_messages: u64,
    /// Topics that could not be measured.
    pub errors: u64,
    /// A drill that cut (not a dry run): its phases.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phases: Option<Phases>,
    /// What the figures mean where it is not plain (a failover, a failback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    pub topics: Vec<TopicExposure>,
}

impl Drill {
    /// A dry run's report from its measures.
    pub fn dry_run(
        from: &str,
        to: &str,
        namespace: Option<&str>,
        started_ms: u64,
        finished_ms: u64,
        topics: Vec<TopicExposure>,
    ) -> Drill {
        let mut rpo = Rpo::default();
        let mut redelivered_messages = 0;
        let mut errors = 0;
        for t in &topics {
            if t.error.is_some() {
                errors += 1;
                continue;
            }
            rpo.entries += t.entries;
            rpo.messages += t.messages;
            rpo.bytes += t.bytes;
            rpo.seconds = rpo.seconds.max(t.oldest_ms as f64 / 1000.0);
            redelivered_messages += t.subscriptions.iter().map(|s| s.messages).sum::<u64>();
        }
        Drill {
            id: format!("drill-{started_ms}"),
            kind: "dry-run".into(),
            from: from.into(),
            to: to.into(),
            namespace: namespace.map(str::to_string),
            started_ms,
            finished_ms,
            rpo,
            redelivered_messages,
            errors,
            phases: None,
            note: None,
            topics,
        }
    }

    /// A drill that cut at `cut_ms` (ms since the epoch): its measure after the cut (ages
    /// counted to the cut), and its phases.
    pub fn cut(
        from: &str,
        to: &str,
        namespace: &str,
        (started_ms, cut_ms, finished_ms): (u64, u64, u64),
        mut topics: Vec<TopicExposure>,
        phases: Phases,
    ) -> Drill {
        for t in topics.iter_mut().filter(|t| t.entries > 0) {
            t.oldest_ms = cut_ms.saturating_sub(t.oldest_publish_ms);
        }
        let mut d = Drill::dry_run(from, to, Some(namespace), started_ms, finished_ms, topics);
        d.kind = "drill".into();
        d.phases = Some(phases);
        d
    }

    pub fn from_json(v: &serde_json::Value) -> Option<Drill> {
        serde_json::from_value(v.clone()).ok()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("report serializes")
    }

    /// One line: what, where, and the recovery point.
    pub fn summary(&self) -> String {
        if self.kind == "failover" {
            return format!(
                "failover from {} to {}{}: served at {} {} ms after it began",
                self.from,
                self.to,
                self.namespace
                    .as_ref()
                    .map_or_else(String::new, |n| format!(" ({n})")),
                self.to,
                self.phases.as_ref().map_or(0, |p| p.rto_ms)
            );
        }
        format!(
            "{} from {} to {}{}: RPO {} entries, {} messages, {} bytes, {:.1} s; {} messages delivered again{}",
            self.kind,
            self.from,
            self.to,
            self.namespace
                .as_ref()
                .map_or_else(String::new, |n| format!(" ({n})")),
            self.rpo.entries,
            self.rpo.messages,
            self.rpo.bytes,
            self.rpo.seconds,
            self.redelivered_messages,
            if self.errors > 0 {
                format!("; {} topics not measured", self.errors)
            } else {
                String::new()
            }
        )
    }

    /// The report for people.
    pub fn table(&self) -> String {
        let phases = match &self.phases {
            None => format!(
                "measured in {} ms",
                self.finished_ms.saturating_sub(self.started_ms)
            ),
            Some(p) if self.kind != "drill" => format!(
                "RTO {} ms (subscriptions in place {} ms); restored in {} ms, caught up {} ms after the restore",
                p.rto_ms, p.subscriptions_ms, p.restore_ms, p.caught_up_ms
            ),
            Some(p) => format!(
                "cut in {} ms, measured {} ms after it; RTO {} ms (every topic served at {}), subscriptions in place {} ms; held {} ms; restored in {} ms, caught up {} ms after the restore",
                p.cut_ms, p.measured_ms, p.rto_ms, self.to, p.subscriptions_ms, p.hold_ms, p.restore_ms, p.caught_up_ms
            ),
        };
        let phases = match &self.note {
            Some(n) => format!("{phases}\n{n}"),
            None => phases,
        };
        let mut t = format!(
            "{} {}\n{phases}\n\n{:<50} {:>9} {:>9} {:>12} {:>9}\n",
            self.id,
            self.summary(),
            "topic",
            "entries",
            "messages",
            "bytes",
            "oldest s"
        );
        for x in &self.topics {
            match &x.error {
                Some(e) => t.push_str(&format!("{:<50} not measured: {e}\n", x.topic)),
                None => t.push_str(&format!(
                    "{:<50} {:>9} {:>9} {:>12} {:>9.1}\n",
                    x.topic,
                    x.entries,
                    x.messages,
                    x.bytes,
                    x.oldest_ms as f64 / 1000.0
                )),
            }
        }
        let subs: Vec<String> = self
            .topics
            .iter()
            .flat_map(|x| {
                x.subscriptions.iter().map(move |s| {
                    format!(
                        "{} {}: {} messages in {} entries",
                        x.topic, s.name, s.messages, s.entries
                    )
                })
            })
            .collect();
        if !subs.is_empty() {
            t.push_str(&format!(
                "\n{} would deliver again (acknowledged at {}):\n{}\n",
                self.to,
                self.from,
                subs.join("\n")
            ));
        }
        t
    }

    pub fn to_pb(&self) -> DrillReport {
        DrillReport {
            id: self.id.clone(),
            started_ms: self.started_ms,
            summary: self.summary(),
            json: self.json().to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exposure(topic: &str, entries: u64, oldest_ms: u64, redelivered: u64) -> TopicExposure {
        TopicExposure {
            topic: topic.into(),
            entries,
            messages: entries * 10,
            bytes: entries * 1000,
            oldest_ms,
            oldest_publish_ms: 0,
            remote_holds: "3:7".into(),
            subscriptions: vec![SubExposure {
                name: "s".into(),
                entries: 1,
                messages: redelivered,
            }],
            error: None,
        }
    }

    #[test]
    fn given_measures_then_the_report_sums_them_and_round_trips() {
        let mut bad = exposure("persistent://t/n/c", 100, 9_000, 100);
        bad.error = Some("asking west: unreachable".into());
        let d = Drill::dry_run(
            "east",
            "west",
            Some("t/n"),
            1_000,
            1_250,
            vec![
                exposure("persistent://t/n/a", 3, 2_500, 4),
                exposure("persistent://t/n/b", 2, 500, 6),
                bad,
            ],
        );
        assert_eq!(d.rpo.entries, 5);
        assert_eq!(d.rpo.messages, 50);
        assert_eq!(d.rpo.bytes, 5_000);
        assert_eq!(d.rpo.seconds, 2.5);
        assert_eq!(d.redelivered_messages, 10);
        assert_eq!(d.errors, 1);
        assert_eq!(Drill::from_json(&d.json()), Some(d.clone()));
        let table = d.table();
        assert!(table.contains("not measured: asking west"), "{table}");
        assert!(
            d.summary().contains("RPO 5 entries, 50 messages"),
            "{}",
            d.summary()
        );
    }

    #[test]
    fn given_a_drill_that_cut_then_its_phases_are_in_the_report() {
        let d = Drill::cut(
            "east",
            "west",
            "t/n",
            (0, 5, 9),
            vec![TopicExposure {
                oldest_publish_ms: 2,
                ..exposure("persistent://t/n/a", 1, 10, 0)
            }],
            Phases {
                rto_ms: 850,
                ..Phases::default()
            },
        );
        assert_eq!(d.kind, "drill");
        assert_eq!(d.rpo.seconds, 0.003, "counted to the cut");
        assert!(d.table().contains("RTO 850 ms"), "{}", d.table());
        assert_eq!(Drill::from_json(&d.json()), Some(d));
    }

    #[test]
    fn given_ids_then_only_names_of_letters_digits_dashes_are_taken() {
        assert!(check_id("drill-1733").is_ok());
        assert!(check_id("").is_err());
        assert!(check_id("a/b").is_err());
        assert!(check_id(&"x".repeat(65)).is_err());
    }
}
