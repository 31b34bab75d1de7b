//! The replication backlog quota (a namespace or topic policy): how large and how old a
//! topic's unreplicated backlog to any one remote site may grow. Without one nothing
//! unreplicated is ever dropped (TTL, retention and backlog eviction never move a
//! replicator's cursor). Past it, by its policy: producers wait (`producer_request_hold`:
//! their sends are refused with the retriable quota error until the backlog is back within),
//! producers are refused (`producer_exception`), or the oldest unreplicated entries are no
//! longer sent to that remote (`drop_oldest`: the replicator's cursor moves past them, and
//! `topics stats` counts them as `dropped_entries`).
//!
//! The backlog's bytes are its entries times the log's average entry size (as a
//! subscription's backlog is measured); its age is the publish time of its oldest entry.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use meridian_protocol::Entry;
use meridian_storage::cursor::{InitialPosition, ManagedCursor};
use meridian_storage::managed_ledger::Position;
use meridian_tenancy::model::BacklogQuota;

use super::quota::QuotaBreach;
use super::{now_ms, Topic};

/// An entry's publish time, ms since the epoch (0 if it cannot be read).
fn publish_time(b: &bytes::Bytes) -> u64 {
    Entry::parse(b.clone())
        .ok()
        .and_then(|e| e.metadata().ok())
        .map_or(0, |m| m.publish_time)
}

impl Topic {
    /// Checks every replicator's backlog against the topic's replication backlog quota
    /// (`None`: none, so nothing is held or dropped) and acts on its policy.
    pub(super) async fn check_replication_quota(&self, q: Option<&BacklogQuota>) {
        let Some(q) = q else {
            self.set_breach(&self.repl_breach, None);
            return;
        };
        type Rep = (
            String,
            Option<Position>,
            Arc<std::sync::Mutex<Option<Position>>>,
        );
        let reps: Vec<Rep> = self
            .replicators
            .lock()
            .expect("replicators lock")
            .iter()
            .filter(|(_, r)| r.opened.load(Ordering::Acquire))
            .map(|(k, r)| {
                (
                    k.clone(),
                    *r.mark.lock().expect("mark lock"),
                    Arc::clone(&r.drop_through),
                )
            })
            .collect();
        let (total, total_bytes) = self.ml.size().await;
        let avg = total_bytes.checked_div(total).unwrap_or(0).max(1);
        let now = now_ms();
        let age_limit_ms = q.limit_time_seconds.saturating_mul(1000);
        let mut worst: Option<String> = None;
        for (remote, mark, drop_through) in reps {
            let (entries, age_ms) = self.replication_backlog(mark).await;
            let bytes = entries.saturating_mul(avg);
            let size_over = q.limit_size_bytes > 0 && bytes > q.limit_size_bytes;
            let time_over = q.limit_time_seconds > 0 && age_ms > age_limit_ms;
            if !(size_over || time_over) {
                continue;
            }
            if q.policy == "drop_oldest" {
                let through = self.drop_target(q, avg, size_over, time_over, now).await;
                if let Some(p) = through.filter(|p| mark.is_none_or(|m| *p > m)) {
                    let mut g = drop_through.lock().expect("drop lock");
                    if g.is_none_or(|old| p > old) {
                        *g = Some(p);
                    }
                }
                continue;
            }
            let detail = if size_over {
                format!(
                    "replication to {remote} is {bytes} bytes behind (replication backlog quota {} bytes)",
                    q.limit_size_bytes
                )
            } else {
                format!(
                    "replication to {remote} is {} s behind (replication backlog quota {} s)",
                    age_ms / 1000,
                    q.limit_time_seconds
                )
            };
            worst.get_or_insert(detail);
        }
        let breach = worst.map(|detail| QuotaBreach {
            exception: q.policy == "producer_exception",
            quota: "replication backlog quota",
            detail,
        });
        self.set_breach(&self.repl_breach, breach);
    }

    /// The last entry a `drop_oldest` quota drops: what leaves at most the size limit (at
    /// the average entry size) and nothing older than the time limit after it.
    async fn drop_target(
        &self,
        q: &BacklogQuota,
        avg: u64,
        size_over: bool,
        time_over: bool,
        now: u64,
    ) -> Option<Position> {
        let last = self.ml.last_confirmed()?;
        let last_index = self.ml.index_of(last).await?;
        let mut through: Option<u64> = None;
        if size_over {
            let keep = q.limit_size_bytes / avg;
            through = last_index.checked_sub(keep);
        }
        if time_over {
            let cutoff = now.saturating_sub(q.limit_time_seconds.saturating_mul(1000));
            let probe =
                ManagedCursor::non_durable(Arc::clone(&self.ml), InitialPosition::Earliest).await;
            let by_time = match probe.position_at_time(cutoff, publish_time).await {
                Ok(Some(first_kept)) => self
                    .ml
                    .index_of(first_kept)
                    .await
                    .and_then(|i| i.checked_sub(1)),
                Ok(None) => Some(last_index),
                Err(e) => {
                    tracing::warn!(topic = %self.full_name, error = %e, "finding the entries past the replication backlog quota's time failed");
                    None
                }
            };
            through = through.max(by_time);
        }
        self.ml.position_at(through?).await
    }
}
