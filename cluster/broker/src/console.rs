//! The console: `/console` on a broker's HTTP port, a page (served from the binary, no build
//! step) that reads `/console/data` every 2 s: the sites of the registry and the link to each,
//! every replicated topic's lag per remote (a table, and a chart the page keeps over the last
//! five minutes), replicated subscriptions' sync lag, and the last failover drills' reports.

use std::sync::Arc;

use serde::Serialize;

use crate::broker::Broker;

/// The page.
pub const PAGE: &str = include_str!("console/index.html");

/// Drills' reports shown, the latest.
const DRILLS_SHOWN: usize = 10;

#[derive(Debug, Serialize)]
pub struct ConsoleData {
    pub site: String,
    pub now_ms: u64,
    pub sites: Vec<SiteRow>,
    pub topics: Vec<TopicRow>,
    pub subscriptions: Vec<SubRow>,
    pub drills: Vec<DrillRow>,
}

#[derive(Debug, Serialize)]
pub struct SiteRow {
    pub name: String,
    pub geo_url: String,
    /// `this site`, `connected` or `not connected`.
    pub link: String,
}

#[derive(Debug, Serialize)]
pub struct TopicRow {
    pub topic: String,
    pub remote: String,
    pub state: String,
    pub reason: String,
    pub backlog_entries: u64,
    pub oldest_ms: u64,
}

#[derive(Debug, Serialize)]
pub struct SubRow {
    pub topic: String,
    pub subscription: String,
    pub remote: String,
    pub pending_acks: u64,
    pub pending_ms: u64,
    pub held: u64,
}

#[derive(Debug, Serialize)]
pub struct DrillRow {
    pub id: String,
    pub summary: String,
}

/// What the page shows, as this broker sees it.
pub async fn data(broker: &Arc<Broker>) -> ConsoleData {
    let own = broker.cfg.cluster_name.clone();
    let store = meridian_tenancy::TenancyStore::new(broker.meta.clone());
    let linked = broker
        .geo
        .get()
        .map(|l| l.linked_sites())
        .unwrap_or_default();
    let mut sites = Vec::new();
    for name in store.clusters().await.unwrap_or_default() {
        let geo_url = store
            .cluster(&name)
            .await
            .map(|c| c.geo_url)
            .unwrap_or_default();
        let link = if name == own {
            "this site"
        } else if linked.contains(&name) {
            "connected"
        } else {
            "not connected"
        };
        sites.push(SiteRow {
            name,
            geo_url,
            link: link.to_string(),
        });
    }
    let mut topics = Vec::new();
    let mut subscriptions = Vec::new();
    for t in broker.loaded_topics() {
        for r in t.replication_stats().await {
            topics.push(TopicRow {
                topic: t.full_name().to_string(),
                remote: r.remote,
                state: r.state,
                reason: r.reason,
                backlog_entries: r.backlog_entries,
                oldest_ms: r.oldest_unreplicated_age_ms,
            });
        }
        for (sub, remotes) in t.replicated_sub_stats().await {
            for y in remotes {
                subscriptions.push(SubRow {
                    topic: t.full_name().to_string(),
                    subscription: sub.clone(),
                    remote: y.remote,
                    pending_acks: y.pending_acks,
                    pending_ms: y.pending_ms,
                    held: y.held,
                });
            }
        }
    }
    // The oldest lag first, as `geo status`.
    topics.sort_by(|a, b| b.oldest_ms.cmp(&a.oldest_ms).then(a.topic.cmp(&b.topic)));
    subscriptions.sort_by(|a, b| (&a.topic, &a.subscription).cmp(&(&b.topic, &b.subscription)));
    let drills: Vec<DrillRow> = store
        .drill_reports()
        .await
        .unwrap_or_default()
        .into_iter()
        .rev()
        .take(DRILLS_SHOWN)
        .map(|r| DrillRow {
            id: r.id,
            summary: r.summary,
        })
        .collect();
    ConsoleData {
        site: own,
        now_ms: crate::broker::now_ms(),
        sites,
        topics,
        subscriptions,
        drills,
    }
}
