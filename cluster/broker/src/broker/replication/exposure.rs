//! A failover drill's measure for one topic: what a remote site would lose if this site were
//! lost now (changes nothing at either site).
//!
//! ```text
//!  this site ── SubSync{measure, each replicated subscription's state} ──► the topic's owner
//!                                                                          at the remote
//!            ◄── SubSynced{holds: the highest of this site's entries held durably there,
//!                          per subscription: entries and messages there that this site
//!                          acknowledged and the remote has not}
//!  then this site's own entries after `holds` that go to the remote (its `replicate_to`):
//!  entries, messages, bytes, and the age of the oldest (the data the remote would lack)
//! ```

use std::sync::Arc;

use meridian_geo::GeoLink;
use meridian_storage::managed_ledger::Position;

use super::subs::{SubDoc, SyncDoc, SyncedDoc};
use super::Topic;
use crate::broker::BrokerError;

/// The answer's deadline.
const MEASURE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// What a remote would lose of one topic.
#[derive(Debug, Clone, Default)]
pub struct Exposure {
    pub topic: String,
    pub remote: String,
    /// This site's own entries durable here and not held there, their messages and bytes.
    pub entries: u64,
    pub messages: u64,
    pub bytes: u64,
    /// How long ago the oldest of them was published, ms.
    pub oldest_ms: u64,
    /// When it was published, ms since the epoch.
    pub oldest_publish_ms: u64,
    /// The last of this site's own entries the remote holds.
    pub remote_holds: Option<Position>,
    /// Per replicated subscription: (name, entries, messages) the remote would deliver again
    /// (acknowledged here, not there); `None` counts: the subscription is not there.
    pub subscriptions: Vec<(String, Option<(u64, u64)>)>,
    /// Why the remote could not be asked (nothing above is measured then).
    pub error: Option<String>,
}

impl Topic {
    /// What `remote` would lose of this topic if this site were lost now.
    pub async fn exposure(self: &Arc<Self>, link: &Arc<GeoLink>, remote: &str) -> Exposure {
        let mut out = Exposure {
            topic: self.full_name.clone(),
            remote: remote.to_string(),
            ..Exposure::default()
        };
        match self.measure(link, remote, &mut out).await {
            Ok(()) => {}
            Err(e) => out.error = Some(e),
        }
        out
    }

    async fn measure(
        self: &Arc<Self>,
        link: &Arc<GeoLink>,
        remote: &str,
        out: &mut Exposure,
    ) -> Result<(), String> {
        let subs: Vec<SubDoc> = self
            .replicated_states()
            .await
            .map_err(|e| format!("stating the replicated subscriptions: {e}"))?;
        let doc = serde_json::to_vec(&SyncDoc::measuring(subs)).expect("doc serializes");
        let (answer, _) = meridian_geo::subsync::send_sub_sync(
            link,
            remote,
            None,
            &self.full_name,
            doc.into(),
            MEASURE_TIMEOUT,
        )
        .await
        .map_err(|e| format!("asking {remote}: {e:?}"))?;
        let answer: SyncedDoc = serde_json::from_slice(&answer)
            .map_err(|e| format!("{remote}'s answer cannot be read: {e}"))?;
        out.remote_holds = answer.holds.map(|(l, e)| Position::new(l, e));
        out.subscriptions = answer
            .subs
            .iter()
            .map(|s| {
                (
                    s.name.clone(),
                    (!s.missing).then_some((s.entries, s.messages)),
                )
            })
            .collect();
        self.count_after(out.remote_holds, remote, out)
            .await
            .map_err(|e| format!("reading the log: {e}"))
    }

    /// This site's own entries after `after` that go to `remote`: counted into `out`.
    async fn count_after(
        &self,
        after: Option<Position>,
        remote: &str,
        out: &mut Exposure,
    ) -> Result<(), BrokerError> {
        let mut next = match after {
            Some(p) if self.ml.contains(p).await => self.ml.next_position(p).await,
            // Before the log's first entry (trimmed there), or nothing held yet.
            _ => self.ml.first_position().await,
        };
        let now = super::super::now_ms();
        while let Some(p) = next {
            let got = self.ml.read_range(p, 1024).await?;
            let Some(last) = got.last().map(|g| g.0) else {
                break;
            };
            for (q, bytes) in &got {
                if after.is_some_and(|a| *q <= a) {
                    continue;
                }
                let Some(m) = meridian_protocol::Entry::parse(bytes.clone())
                    .ok()
                    .and_then(|e| e.metadata().ok())
                else {
                    continue;
                };
                let goes = m.meridian_origin.is_none()
                    && (m.replicate_to.is_empty() || m.replicate_to.iter().any(|c| c == remote));
                if !goes {
                    continue;
                }
                if out.entries == 0 {
                    out.oldest_ms = now.saturating_sub(m.publish_time);
                    out.oldest_publish_ms = m.publish_time;
                }
                out.entries += 1;
                out.messages += meridian_protocol::entry::message_count(&m) as u64;
                out.bytes += bytes.len() as u64;
            }
            next = self.ml.next_position(last).await;
        }
        Ok(())
    }
}
