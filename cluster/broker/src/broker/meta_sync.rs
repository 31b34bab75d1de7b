//! The site's global objects (cluster records, tenants, namespaces, topics' own policies)
//! carried to and merged
//! from the other sites (`meridian_tenancy::federation`, over `meridian_geo::metasync`).
//!
//! ```text
//!  meta_sync_loop, every second, at the broker that sends:  export() (the store read once),
//!  then for each other site
//!  in the registry (geo URL or route):
//!     for_peer(site) ─► JSON documents under geo.frame_bytes_max (in merge order) ─►
//!     changed since the last Synced, or 30 s old? ─► a Sync for each, one after another
//!  a peer's Sync ─► merge_global: merge_from(peer) ─► a namespace deleted there: its topics
//!     here go first (BrokerTopics::delete, forced) ─► Synced{changed, skipped}
//! ```
//!
//! Every broker of a site with a geo link runs the loop; the one that leads the site's load
//! manager sends, so the store is read once a beat per site whatever the number of brokers.
//! While none leads, or the leader has no geo link, every broker with one sends: merges are
//! idempotent compare-and-sets, so two brokers sending the same copies change nothing twice.
//! Any broker merges what a peer sends.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use meridian_geo::frame::RefusalCode;
use meridian_geo::receiver::Refusal;
use meridian_geo::request::RequestFailure;
use meridian_tenancy::federation::{NamespaceData, SyncItem};
use meridian_tenancy::service::TopicOps;
use meridian_tenancy::{AdminError, TenancyStore};

use super::Broker;

/// How often the loop looks for changes to send.
const BEAT: Duration = Duration::from_secs(1);
/// Copies are sent again this often even when nothing changed (a peer restored from an old
/// backup, a merge that was skipped there and may be taken now).
const RESEND: Duration = Duration::from_secs(30);
/// Longest one exchange may take.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);
/// A Sync frame's bytes beside its document (length, kind, the document's length).
const FRAME_OVERHEAD: u64 = 64;

/// `items` as JSON documents (arrays of them) of at most `max` bytes each, in order; the keys
/// of items too large for a document alone are returned apart (not sent).
fn documents(items: &[SyncItem], max: usize) -> (Vec<Vec<u8>>, Vec<String>) {
    let mut docs = Vec::new();
    let mut too_large = Vec::new();
    let mut doc = b"[".to_vec();
    for item in items {
        let one = serde_json::to_vec(item).expect("json");
        // `[` + the item + `]`: what a document of this item alone takes.
        if one.len() + 2 > max {
            too_large.push(item.key.clone());
            continue;
        }
        if doc.len() > 1 && doc.len() + 1 + one.len() + 1 > max {
            doc.push(b']');
            docs.push(std::mem::replace(&mut doc, b"[".to_vec()));
        }
        if doc.len() > 1 {
            doc.push(b',');
        }
        doc.extend_from_slice(&one);
    }
    doc.push(b']');
    if doc.len() > 2 || docs.is_empty() {
        docs.push(doc);
    }
    (docs, too_large)
}

/// The broker's part of a namespace deleted at another site: its topics here.
struct SiteTopics(Arc<Broker>);

impl NamespaceData for SiteTopics {
    fn delete_topics<'a>(&'a self, ns: &'a str) -> BoxFuture<'a, Result<(), AdminError>> {
        Box::pin(async move {
            let ops = crate::admin::BrokerTopics(Arc::clone(&self.0));
            for (topic, _) in ops.list(ns.to_string()).await? {
                ops.delete(topic, true, false).await?;
            }
            Ok(())
        })
    }
}

impl Broker {
    fn federation_store(&self) -> TenancyStore {
        TenancyStore::for_site(self.meta.clone(), &self.cfg.cluster_name)
    }

    /// A peer's copies of the global objects it shares with this site, merged here.
    pub(crate) async fn merge_global(
        self: &Arc<Self>,
        origin: &str,
        doc: &[u8],
    ) -> Result<(u32, u32), Refusal> {
        let items: Vec<SyncItem> = serde_json::from_slice(doc).map_err(|e| {
            Refusal::new(
                RefusalCode::Protocol,
                format!("global objects are not readable: {e}"),
            )
        })?;
        let data = SiteTopics(Arc::clone(self));
        let report = self
            .federation_store()
            .merge_from(origin, items, &data)
            .await
            .map_err(|e| Refusal::new(RefusalCode::Retry, e.to_string()))?;
        for key in &report.changed {
            tracing::info!(origin, key, "global object changed by a copy from {origin}");
        }
        for (key, why) in &report.skipped {
            tracing::debug!(origin, key, why, "global object from {origin} not taken");
        }
        metrics::counter!("meridian_geo_objects_merged_total")
            .increment(report.changed.len() as u64);
        Ok((report.changed.len() as u32, report.skipped.len() as u32))
    }

    /// Sends this site's copies to every other site of the registry when they changed (see
    /// the module's picture), until the broker closes.
    pub async fn meta_sync_loop(self: Arc<Self>) {
        let store = self.federation_store();
        // Per site: the digest of the copies it last took, and when.
        let mut sent: HashMap<String, (u64, Instant)> = HashMap::new();
        // Per site that did not answer: how many times in a row, and not before when again.
        let mut failing: HashMap<String, (u32, Instant)> = HashMap::new();
        loop {
            tokio::time::sleep(BEAT).await;
            if self.is_closing() {
                return;
            }
            let Some(link) = self.geo.get().cloned() else {
                continue;
            };
            let sends = match self.leadership().await {
                Ok((true, _)) | Ok((false, None)) => true,
                Ok((false, Some(leader))) => leader.geo_url.is_empty(),
                Err(e) => {
                    tracing::debug!(error = %e, "global objects: the leadership is not readable");
                    continue;
                }
            };
            if !sends {
                // When this broker sends again, it sends everything anew.
                sent.clear();
                continue;
            }
            let sites = match store.clusters().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "global objects: the registry is not readable");
                    continue;
                }
            };
            // Read once a beat, whatever the number of sites.
            metrics::counter!("meridian_geo_object_exports_total").increment(1);
            let exported = match store.export().await {
                Ok(e) => e,
                Err(e) => {
                    tracing::debug!(error = %e, "global objects: export failed");
                    continue;
                }
            };
            let mut due = Vec::new();
            for site in sites {
                if site == self.cfg.cluster_name
                    || failing
                        .get(&site)
                        .is_some_and(|(_, next)| Instant::now() < *next)
                {
                    continue;
                }
                let items = exported.for_peer(&site);
                // Documents the peer takes whole (each under its frame limit), in merge order.
                let max = link.frame_bytes_max().saturating_sub(FRAME_OVERHEAD) as usize;
                let (docs, too_large) = documents(&items, max);
                let mut h = std::collections::hash_map::DefaultHasher::new();
                docs.hash(&mut h);
                let digest = h.finish();
                if sent
                    .get(&site)
                    .is_some_and(|(d, at)| *d == digest && at.elapsed() < RESEND)
                {
                    continue;
                }
                // Said when the copies are sent, not every beat.
                for key in too_large {
                    tracing::warn!(
                        site,
                        key,
                        "a global object is larger than geo.frame_bytes_max; not sent to {site}"
                    );
                }
                due.push((site, digest, docs));
            }
            let results = futures::future::join_all(due.into_iter().map(|(site, digest, docs)| {
                let link = Arc::clone(&link);
                async move {
                    // One after another: a later document may need an earlier one's objects.
                    let mut total = (0u32, 0u32);
                    for doc in docs {
                        match meridian_geo::metasync::send_sync(
                            &link,
                            &site,
                            bytes::Bytes::from(doc),
                            EXCHANGE_TIMEOUT,
                        )
                        .await
                        {
                            Ok((c, s)) => total = (total.0 + c, total.1 + s),
                            Err(e) => return (site, digest, Err(e)),
                        }
                    }
                    (site, digest, Ok(total))
                }
            }))
            .await;
            for (site, digest, r) in results {
                match r {
                    Ok((changed, skipped)) => {
                        if changed > 0 {
                            tracing::info!(site, changed, skipped, "global objects sent to {site}");
                        }
                        failing.remove(&site);
                        sent.insert(site, (digest, Instant::now()));
                    }
                    Err(RequestFailure::Refused(why)) => {
                        // Not asked again until the copies change or the resend is due.
                        tracing::warn!(site, why, "global objects refused by {site}");
                        sent.insert(site, (digest, Instant::now()));
                    }
                    Err(RequestFailure::Failed(why)) => {
                        // Again after 2, 4, 8, 8 ... s.
                        let f = failing.entry(site.clone()).or_insert((0, Instant::now()));
                        f.0 = f.0.saturating_add(1);
                        let wait = Duration::from_secs(1 << f.0.min(3));
                        f.1 = Instant::now() + wait;
                        tracing::debug!(site, why, "global objects not sent to {site}");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::documents;
    use meridian_tenancy::federation::SyncItem;

    fn item(key: &str, bytes: usize) -> SyncItem {
        serde_json::from_value(serde_json::json!({
            "key": key,
            "record": {"pad": "x".repeat(bytes)},
        }))
        .unwrap()
    }

    #[test]
    fn given_copies_larger_than_a_frame_then_they_go_in_documents_under_it_in_order() {
        let items: Vec<SyncItem> = (0..50)
            .map(|i| item(&format!("/admin/namespaces/acme/n{i:02}"), 100 + i * 7))
            .collect();
        let max = 1_000;
        let (docs, too_large) = documents(&items, max);
        assert!(too_large.is_empty());
        assert!(docs.len() > 5, "{} documents", docs.len());
        let mut back = Vec::new();
        for d in &docs {
            assert!(d.len() <= max, "{} bytes", d.len());
            let part: Vec<SyncItem> = serde_json::from_slice(d).unwrap();
            assert!(!part.is_empty());
            back.extend(part);
        }
        assert_eq!(back, items, "every copy once, in order");

        let mut with_big = items[..3].to_vec();
        with_big.insert(1, item("/admin/namespaces/acme/big", 5_000));
        let (docs, too_large) = documents(&with_big, max);
        assert_eq!(too_large, vec!["/admin/namespaces/acme/big".to_string()]);
        let back: Vec<SyncItem> = docs
            .iter()
            .flat_map(|d| serde_json::from_slice::<Vec<SyncItem>>(d).unwrap())
            .collect();
        assert_eq!(back, items[..3].to_vec());

        let (docs, _) = documents(&[], max);
        assert_eq!(
            docs,
            vec![b"[]".to_vec()],
            "nothing to send is one empty document"
        );
    }
}
