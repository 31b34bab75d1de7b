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
//!  entries, messages, bytes, and the age of the oldest (the data the remote would lack),
//!  but those the remote holds by their producers' ids:
//!            ── SubSync{measure, ids: per producer, ranges of those entries' ids} ──►
//!            ◄── SubSynced{held_ids: the parts held there (sent again there by a producer
//!                          that moved, deduplicated)}
//! ```

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use meridian_geo::GeoLink;
use meridian_storage::managed_ledger::Position;

use super::subs::{SubDoc, SyncDoc, SyncedDoc};
use super::Topic;
use crate::broker::dedup::{self, HeldIds};
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
        let answer = ask(link, remote, &self.full_name, SyncDoc::measuring(subs)).await?;
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
        let own = self
            .own_after(out.remote_holds, remote)
            .await
            .map_err(|e| format!("reading the log: {e}"))?;
        // Sends stored here and, sent again by their producer, at the remote too (after a
        // move, deduplicated there by their ids) are not lost with this site.
        let held = if own.asked.is_empty() {
            BTreeMap::new()
        } else {
            let asked = own
                .asked
                .iter()
                .map(|(name, h)| (name.clone(), h.ranges().to_vec()))
                .collect();
            let answer = ask(link, remote, &self.full_name, SyncDoc::asking_ids(asked)).await?;
            answer
                .held_ids
                .into_iter()
                .map(|(name, ranges)| (name, HeldIds::exact(ranges)))
                .collect()
        };
        let now = super::super::now_ms();
        for e in &own.entries {
            let there = e.ids.as_ref().is_some_and(|(name, first, highest)| {
                held.get(&**name)
                    .is_some_and(|h| h.covers(*first, *highest))
            });
            if there {
                continue;
            }
            if out.entries == 0 {
                out.oldest_ms = now.saturating_sub(e.publish_time);
                out.oldest_publish_ms = e.publish_time;
            }
            out.entries += 1;
            out.messages += e.messages;
            out.bytes += e.bytes;
        }
        Ok(())
    }

    /// This site's own entries after `after` that go to `remote`, and the ids of their
    /// producers (ranges per name).
    async fn own_after(&self, after: Option<Position>, remote: &str) -> Result<Own, BrokerError> {
        let mut own = Own::default();
        let mut next = match after {
            Some(p) if self.ml.contains(p).await => self.ml.next_position(p).await,
            // Before the log's first entry (trimmed there), or nothing held yet.
            _ => self.ml.first_position().await,
        };
        let mut names: HashMap<String, Arc<str>> = HashMap::new();
        while let Some(p) = next {
            let got = self.ml.read_range(p, 1024).await?;
            let Some(last) = got.last().map(|g| g.0) else {
                break;
            };
            for (q, bytes) in &got {
                if after.is_some_and(|a| *q <= a) {
                    continue;
                }
                let Ok(entry) = meridian_protocol::Entry::parse(bytes.clone()) else {
                    continue;
                };
                let Ok(m) = entry.metadata() else {
                    continue;
                };
                let goes = m.meridian_origin.is_none()
                    && (m.replicate_to.is_empty() || m.replicate_to.iter().any(|c| c == remote));
                if !goes {
                    continue;
                }
                // A chunk other than its message's last counts by its message's id too.
                let ids = dedup::entry_sequence(&entry).map(|s| {
                    own.asked
                        .entry(s.producer.clone())
                        .or_default()
                        .insert(s.first, s.highest);
                    let name = names
                        .entry(s.producer)
                        .or_insert_with_key(|k| Arc::from(k.as_str()))
                        .clone();
                    (name, s.first, s.highest)
                });
                own.entries.push(OwnEntry {
                    ids,
                    messages: meridian_protocol::entry::message_count(&m) as u64,
                    bytes: bytes.len() as u64,
                    publish_time: m.publish_time,
                });
            }
            next = self.ml.next_position(last).await;
        }
        Ok(own)
    }
}

/// This site's own entries that a remote lacks by position.
#[derive(Default)]
struct Own {
    entries: Vec<OwnEntry>,
    /// Their producers' ids, to ask the remote about.
    asked: BTreeMap<String, HeldIds>,
}

struct OwnEntry {
    ids: Option<(Arc<str>, i64, i64)>,
    messages: u64,
    bytes: u64,
    publish_time: u64,
}

/// Sends a drill's measuring document to the topic's owner at `remote`; its answer.
async fn ask(
    link: &Arc<GeoLink>,
    remote: &str,
    topic: &str,
    doc: SyncDoc,
) -> Result<SyncedDoc, String> {
    let doc = serde_json::to_vec(&doc).expect("doc serializes");
    let (answer, _) = meridian_geo::subsync::send_sub_sync(
        link,
        remote,
        None,
        topic,
        doc.into(),
        MEASURE_TIMEOUT,
    )
    .await
    .map_err(|e| format!("asking {remote}: {e:?}"))?;
    serde_json::from_slice(&answer).map_err(|e| format!("{remote}'s answer cannot be read: {e}"))
}
