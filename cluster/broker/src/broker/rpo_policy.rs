//! The recovery-point policy (`max_replication_lag`, a namespace or topic policy): how far
//! behind any remote site a topic's replication may fall, as the age of its oldest
//! unreplicated entry and/or their count. Checked on the policy beat against each
//! replicator's cursor. Past it, by its policy: counted and logged (`alert`: the gauge
//! `meridian_replication_lag_exceeded{topic,remote}` is 1), or producers of the topic at this
//! site wait (`producer_request_hold`: sends refused with the retriable quota error) or are
//! refused (`producer_exception`), with the remote and its lag named, until it is back within.

use std::sync::atomic::Ordering;

use meridian_tenancy::model::MaxReplicationLag;

use super::quota::QuotaBreach;
use super::Topic;

impl Topic {
    /// Checks every replicator's lag against the recovery-point policy (`None`: none).
    pub(super) async fn check_replication_lag(&self, l: Option<&MaxReplicationLag>) {
        let reps: Vec<(String, Option<meridian_storage::managed_ledger::Position>)> = self
            .replicators
            .lock()
            .expect("replicators lock")
            .iter()
            .filter(|(_, r)| r.opened.load(Ordering::Acquire))
            .map(|(k, r)| (k.clone(), *r.mark.lock().expect("mark lock")))
            .collect();
        let mut worst: Option<String> = None;
        for (remote, mark) in reps {
            let (entries, age_ms) = match l {
                Some(_) => self.replication_backlog(mark).await,
                None => (0, 0),
            };
            let over = l.and_then(|l| {
                if l.time_seconds > 0 && age_ms > l.time_seconds.saturating_mul(1000) {
                    Some(format!(
                        "replication to {remote} is {:.1} s behind (max replication lag {} s)",
                        age_ms as f64 / 1000.0,
                        l.time_seconds
                    ))
                } else if l.entries > 0 && entries > l.entries {
                    Some(format!(
                        "replication to {remote} is {entries} entries behind (max replication lag {} entries)",
                        l.entries
                    ))
                } else {
                    None
                }
            });
            metrics::gauge!(
                "meridian_replication_lag_exceeded",
                "topic" => self.full_name.clone(),
                "remote" => remote.clone()
            )
            .set(if over.is_some() { 1.0 } else { 0.0 });
            if let Some(detail) = over {
                if l.is_some_and(|l| l.policy == "alert") {
                    tracing::warn!(topic = %self.full_name, remote, "{detail}");
                } else {
                    worst.get_or_insert(detail);
                }
            }
        }
        let breach = worst.map(|detail| QuotaBreach {
            exception: l.is_some_and(|l| l.policy == "producer_exception"),
            quota: "recovery-point policy",
            detail,
        });
        self.set_breach(&self.rpo_breach, breach);
    }
}
