//! The tenancy model as stored in the metadata store, with its validation. Sans-IO.
//!
//! ```text
//!  /admin/clusters/<cluster>            ClusterData (JSON)
//!  /admin/tenants/<tenant>              TenantInfo
//!  /admin/namespaces/<tenant>/<ns>      NamespacePolicies
//! ```

use std::fmt;

use serde::{Deserialize, Serialize};

pub const CLUSTERS_PREFIX: &str = "/admin/clusters/";
pub const TENANTS_PREFIX: &str = "/admin/tenants/";
pub const NAMESPACES_PREFIX: &str = "/admin/namespaces/";
/// A topic's own policies: `/admin/topic-policies/<tenant>/<namespace>/<topic>` (the topic's
/// local name with `%` and `/` escaped), in the namespace record's form.
pub const TOPIC_POLICIES_PREFIX: &str = "/admin/topic-policies/";

/// The record of a topic's own policies.
pub fn topic_policies_key(tenant: &str, namespace: &str, local: &str) -> String {
    format!(
        "{TOPIC_POLICIES_PREFIX}{tenant}/{namespace}/{}",
        local.replace('%', "%25").replace('/', "%2F")
    )
}

/// The topic (`persistent://t/n/x`) whose own policies are at `key` ([`topic_policies_key`]).
pub fn topic_of_policies_key(key: &str) -> Option<String> {
    let rest = key.strip_prefix(TOPIC_POLICIES_PREFIX)?;
    let (ns, local) = rest.rsplit_once('/')?;
    Some(format!(
        "persistent://{ns}/{}",
        local.replace("%2F", "/").replace("%25", "%")
    ))
}

/// Splits a topic name as clients write it (`persistent://t/n/x`, `t/n/x`, or `x` in
/// `public/default`) into tenant, namespace and local name, checking them.
pub fn split_topic(topic: &str) -> Result<(String, String, String), BadName> {
    let rest = topic.strip_prefix("persistent://").unwrap_or(topic);
    if rest.contains("://") {
        return Err(BadName(format!(
            "topic {topic:?}: only persistent:// topics have policies"
        )));
    }
    let parts: Vec<&str> = rest.splitn(3, '/').collect();
    let (t, n, local) = match parts.as_slice() {
        [x] => ("public", "default", *x),
        [t, n, x] => (*t, *n, *x),
        _ => {
            return Err(BadName(format!(
                "topic {topic:?} must be persistent://tenant/namespace/topic"
            )))
        }
    };
    check_name("tenant", t)?;
    check_name("namespace", n)?;
    if local.is_empty() || local.len() > 1024 {
        return Err(BadName(format!(
            "topic {topic:?}: the topic's name must be 1 to 1024 bytes"
        )));
    }
    Ok((t.to_string(), n.to_string(), local.to_string()))
}

/// Most sites a namespace or topic is replicated between.
pub const REPLICATION_CLUSTERS_MAX: usize = 64;

/// Longest tenant, cluster or namespace name part.
pub const NAME_BYTES_MAX: usize = 128;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ClusterData {
    pub service_url: String,
    pub admin_url: String,
    /// `quic://HOST:PORT` of the site's geo link; empty when it has none.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub geo_url: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TenantInfo {
    pub admin_roles: Vec<String>,
    pub allowed_clusters: Vec<String>,
    /// Most bytes the tenant's topics may store together (their logs, backlog and retained
    /// data alike); past it the brokers refuse its producers. None: no quota.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub storage_quota_bytes: Option<u64>,
}

/// A namespace's record: its policies. A policy left out falls back to the broker's
/// configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NamespacePolicies {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deduplication_enabled: Option<bool>,
    /// Broker-side dead-letter policy of the namespace's subscriptions: a message about to be
    /// redelivered more than this many times is moved to `<topic>-<subscription>-DLQ` instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dead_letter_max_redeliveries: Option<u32>,
    /// How a topic's schemas may evolve: one of [`SCHEMA_STRATEGIES`]; FULL when unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schema_compatibility_strategy: Option<String>,
    /// Messages older than this many seconds are acknowledged on every subscription (0: no
    /// TTL).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message_ttl_seconds: Option<u32>,
    /// Most producers on one topic (0: no limit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_producers_per_topic: Option<u32>,
    /// Most consumers on one topic, over its subscriptions (0: no limit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_consumers_per_topic: Option<u32>,
    /// Most subscriptions on one topic (0: no limit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_subscriptions_per_topic: Option<u32>,
    /// How large and how old a topic's backlog (its slowest subscription's) may grow, and what
    /// happens then.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backlog_quota: Option<BacklogQuota>,
    /// How much acknowledged data is kept (for readers); none set: all of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retention: Option<Retention>,
    /// Each topic's publish rate (Pulsar's `set-publish-rate`): producers past it are slowed
    /// (the broker stops reading their connections), not refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub publish_rate: Option<RateLimit>,
    /// Each topic's dispatch rate, over its subscriptions together.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dispatch_rate: Option<RateLimit>,
    /// Each subscription's dispatch rate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subscription_dispatch_rate: Option<RateLimit>,
    /// The namespace's topics together (on each broker): publish rate. A tenant cannot get
    /// around it by opening more topics.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub publish_rate_total: Option<RateLimit>,
    /// The namespace's topics together (on each broker): dispatch rate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dispatch_rate_total: Option<RateLimit>,
    /// Compact a topic by itself once more than this many bytes were published since its
    /// last compaction (0: only when asked); unset: the broker's
    /// `broker.compaction_threshold_bytes`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compaction_threshold: Option<u64>,
    /// The bookie affinity groups the namespace's ledgers stay in (Pulsar's
    /// `set-bookie-affinity-group`): the primary group's bookies, and the secondary's too
    /// once the primary has too few writable ones.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bookie_affinity_group: Option<BookieAffinityGroup>,
    /// The sites the topics are replicated between (Pulsar's namespace `clusters`, a topic's
    /// replication clusters); none set: this site alone. Each must have a cluster record and
    /// be among the tenant's allowed clusters (checked by the store).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replication_clusters: Option<Vec<String>>,
    /// How large and how old a topic's unreplicated backlog to any one remote site may grow,
    /// and what happens then (policy one of [`REPLICATION_BACKLOG_QUOTA_POLICIES`]); none set:
    /// no bound (nothing unreplicated is ever dropped).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replication_backlog_quota: Option<BacklogQuota>,
    /// The recovery-point policy: how far behind any remote site a topic's replication may
    /// fall (the age of its oldest unreplicated entry, and/or how many entries), and what
    /// happens then (policy one of [`MAX_REPLICATION_LAG_POLICIES`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_replication_lag: Option<MaxReplicationLag>,
    /// Roles granted `produce` and/or `consume` in the namespace (with authentication on).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub permissions: std::collections::BTreeMap<String, Vec<String>>,
}

/// Bookie affinity groups: primary, and an optional secondary (empty: none).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BookieAffinityGroup {
    pub primary: String,
    pub secondary: String,
}

impl BookieAffinityGroup {
    /// As ledgers carry it: `primary` or `primary,secondary`.
    pub fn placement(&self) -> String {
        if self.secondary.is_empty() {
            self.primary.clone()
        } else {
            format!("{},{}", self.primary, self.secondary)
        }
    }
}

/// Whether `g` is a valid bookie group name (as `bookie.group`).
pub fn valid_group_name(g: &str) -> bool {
    !g.is_empty()
        && g.len() <= 128
        && g.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// A rate limit by messages and bytes per second; 0 limits nothing by that measure.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RateLimit {
    pub msgs_per_sec: u64,
    pub bytes_per_sec: u64,
}

impl RateLimit {
    pub fn is_unlimited(&self) -> bool {
        self.msgs_per_sec == 0 && self.bytes_per_sec == 0
    }
}

/// Highest rate limits accepted (messages and bytes per second).
pub const RATE_MSGS_MAX: u64 = 100_000_000;
pub const RATE_BYTES_MAX: u64 = 1 << 40;

/// Largest compaction threshold accepted, bytes (1 PiB).
pub const COMPACTION_THRESHOLD_MAX: u64 = 1 << 50;

/// The actions a namespace grant can give.
pub const ACTIONS: &[&str] = &["produce", "consume"];

/// Retention of acknowledged data, as Pulsar's: -1 is no limit, 0 keeps nothing by that rule;
/// data is kept while either rule keeps it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Retention {
    pub time_minutes: i64,
    pub size_mb: i64,
}

/// A backlog quota: limits (0: none) and the action when one is passed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BacklogQuota {
    pub limit_size_bytes: u64,
    pub limit_time_seconds: u64,
    /// One of [`BACKLOG_QUOTA_POLICIES`].
    pub policy: String,
}

/// The recovery-point policy's limits (0: that limit is not set).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MaxReplicationLag {
    pub time_seconds: u64,
    pub entries: u64,
    /// One of [`MAX_REPLICATION_LAG_POLICIES`].
    pub policy: String,
}

/// What a passed recovery-point policy does: counted and logged only (`alert`), or producers
/// at the lagging site wait (`producer_request_hold`) or are refused (`producer_exception`).
pub const MAX_REPLICATION_LAG_POLICIES: &[&str] =
    &["alert", "producer_request_hold", "producer_exception"];

/// What a passed backlog quota does (Pulsar's names).
pub const BACKLOG_QUOTA_POLICIES: &[&str] = &[
    "producer_request_hold",
    "producer_exception",
    "consumer_backlog_eviction",
];

/// What a passed replication backlog quota does: producers wait (their sends are refused
/// with a retriable error) or are refused, or the oldest unreplicated entries are no longer
/// sent to that remote (counted as dropped).
pub const REPLICATION_BACKLOG_QUOTA_POLICIES: &[&str] =
    &["producer_request_hold", "producer_exception", "drop_oldest"];

/// The schema compatibility strategies (Pulsar's names).
pub const SCHEMA_STRATEGIES: &[&str] = &[
    "ALWAYS_COMPATIBLE",
    "ALWAYS_INCOMPATIBLE",
    "BACKWARD",
    "FORWARD",
    "FULL",
    "BACKWARD_TRANSITIVE",
    "FORWARD_TRANSITIVE",
    "FULL_TRANSITIVE",
];

/// Field names of [`NamespacePolicies`], as `clear` takes them.
pub const POLICY_FIELDS: &[&str] = &[
    "deduplication_enabled",
    "dead_letter_max_redeliveries",
    "schema_compatibility_strategy",
    "message_ttl_seconds",
    "max_producers_per_topic",
    "max_consumers_per_topic",
    "max_subscriptions_per_topic",
    "backlog_quota",
    "retention",
    "publish_rate",
    "dispatch_rate",
    "subscription_dispatch_rate",
    "publish_rate_total",
    "dispatch_rate_total",
    "compaction_threshold",
    "bookie_affinity_group",
    "replication_clusters",
    "replication_backlog_quota",
    "max_replication_lag",
];

impl NamespacePolicies {
    /// Checks the values; the error names the policy and the accepted range.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(n) = self.dead_letter_max_redeliveries {
            if !(1..=1_000_000).contains(&n) {
                return Err(format!(
                    "dead_letter_max_redeliveries {n} is out of range 1..=1000000"
                ));
            }
        }
        if let Some(t) = self.message_ttl_seconds {
            if t > 315_360_000 {
                return Err(format!(
                    "message_ttl_seconds {t} is out of range 0..=315360000 (ten years; 0: no TTL)"
                ));
            }
        }
        for (name, v) in [
            ("max_producers_per_topic", self.max_producers_per_topic),
            ("max_consumers_per_topic", self.max_consumers_per_topic),
            (
                "max_subscriptions_per_topic",
                self.max_subscriptions_per_topic,
            ),
        ] {
            if let Some(n) = v.filter(|n| *n > 1_000_000) {
                return Err(format!(
                    "{name} {n} is out of range 0..=1000000 (0: no limit)"
                ));
            }
        }
        if let Some(t) = self
            .compaction_threshold
            .filter(|t| *t > COMPACTION_THRESHOLD_MAX)
        {
            return Err(format!(
                "compaction_threshold {t} is out of range 0..={COMPACTION_THRESHOLD_MAX} bytes (1 PiB; 0: only when asked)"
            ));
        }
        if let Some(g) = &self.bookie_affinity_group {
            if !valid_group_name(&g.primary)
                || !(g.secondary.is_empty() || valid_group_name(&g.secondary))
            {
                return Err(format!(
                    "bookie affinity groups {:?} / {:?}: a group is 1 to 128 letters, digits, '.', '_' or '-' (the primary is required)",
                    g.primary, g.secondary
                ));
            }
        }
        if let Some(clusters) = &self.replication_clusters {
            if clusters.is_empty() || clusters.len() > REPLICATION_CLUSTERS_MAX {
                return Err(format!(
                    "replication_clusters: 1 to {REPLICATION_CLUSTERS_MAX} clusters (remove the policy for this site alone)"
                ));
            }
            for (i, c) in clusters.iter().enumerate() {
                check_name("cluster", c).map_err(|e| format!("replication_clusters: {e}"))?;
                if clusters[..i].contains(c) {
                    return Err(format!("replication_clusters: {c} is named twice"));
                }
            }
        }
        for (what, quota, accepted) in [
            ("backlog quota", &self.backlog_quota, BACKLOG_QUOTA_POLICIES),
            (
                "replication backlog quota",
                &self.replication_backlog_quota,
                REPLICATION_BACKLOG_QUOTA_POLICIES,
            ),
        ] {
            let Some(q) = quota else { continue };
            if !accepted.contains(&q.policy.as_str()) {
                return Err(format!(
                    "{what} policy {:?} is not one of {}",
                    q.policy,
                    accepted.join(", ")
                ));
            }
            if q.limit_size_bytes == 0 && q.limit_time_seconds == 0 {
                return Err(format!("a {what} needs a size limit, a time limit or both"));
            }
        }
        if let Some(l) = &self.max_replication_lag {
            if !MAX_REPLICATION_LAG_POLICIES.contains(&l.policy.as_str()) {
                return Err(format!(
                    "max replication lag policy {:?} is not one of {}",
                    l.policy,
                    MAX_REPLICATION_LAG_POLICIES.join(", ")
                ));
            }
            if l.time_seconds == 0 && l.entries == 0 {
                return Err(
                    "a max replication lag needs a time limit, an entries limit or both".into(),
                );
            }
        }
        for (name, r) in [
            ("publish_rate", &self.publish_rate),
            ("dispatch_rate", &self.dispatch_rate),
            (
                "subscription_dispatch_rate",
                &self.subscription_dispatch_rate,
            ),
            ("publish_rate_total", &self.publish_rate_total),
            ("dispatch_rate_total", &self.dispatch_rate_total),
        ] {
            if let Some(r) = r {
                if r.msgs_per_sec > RATE_MSGS_MAX || r.bytes_per_sec > RATE_BYTES_MAX {
                    return Err(format!(
                        "{name} {} msg/s, {} B/s is out of range: messages 0..={RATE_MSGS_MAX}, bytes 0..={RATE_BYTES_MAX} per second (0: no limit)",
                        r.msgs_per_sec, r.bytes_per_sec
                    ));
                }
            }
        }
        for (role, actions) in &self.permissions {
            if role.is_empty() {
                return Err("a permission's role is empty".into());
            }
            if let Some(a) = actions.iter().find(|a| !ACTIONS.contains(&a.as_str())) {
                return Err(format!(
                    "action {a:?} for role {role} is not one of {}",
                    ACTIONS.join(", ")
                ));
            }
        }
        if let Some(r) = &self.retention {
            if r.time_minutes < -1 || r.size_mb < -1 {
                return Err(format!(
                    "retention time {} min and size {} MB must each be -1 (no limit) or more",
                    r.time_minutes, r.size_mb
                ));
            }
            // As Pulsar: a backlog quota larger than the retention that is to keep the data
            // contradicts it (0: retention keeps nothing by that rule; -1: no limit).
            if let Some(q) = &self.backlog_quota {
                let size = u64::try_from(r.size_mb)
                    .unwrap_or(0)
                    .saturating_mul(1 << 20);
                if size > 0 && q.limit_size_bytes > size {
                    return Err(format!(
                        "retention size {} MB is smaller than the backlog quota's {} bytes: the quota needs retention at least as large",
                        r.size_mb, q.limit_size_bytes
                    ));
                }
                let secs = u64::try_from(r.time_minutes)
                    .unwrap_or(0)
                    .saturating_mul(60);
                if secs > 0 && q.limit_time_seconds > secs {
                    return Err(format!(
                        "retention time {} min is shorter than the backlog quota's {} s: the quota needs retention at least as long",
                        r.time_minutes, q.limit_time_seconds
                    ));
                }
            }
        }
        if let Some(s) = &self.schema_compatibility_strategy {
            if !SCHEMA_STRATEGIES.contains(&s.to_ascii_uppercase().as_str()) {
                return Err(format!(
                    "schema_compatibility_strategy {s:?} is not one of {}",
                    SCHEMA_STRATEGIES.join(", ")
                ));
            }
        }
        Ok(())
    }

    /// These policies with the fields `over` sets in their place: a topic's own policies over
    /// its namespace's. Grants stay the namespace's.
    pub fn overlaid(&self, over: &NamespacePolicies) -> NamespacePolicies {
        let mut p = self.clone();
        p.apply_set(over);
        p
    }

    fn apply_set(&mut self, set: &NamespacePolicies) {
        let p = self;
        if set.deduplication_enabled.is_some() {
            p.deduplication_enabled = set.deduplication_enabled;
        }
        if set.dead_letter_max_redeliveries.is_some() {
            p.dead_letter_max_redeliveries = set.dead_letter_max_redeliveries;
        }
        if let Some(s) = &set.schema_compatibility_strategy {
            p.schema_compatibility_strategy = Some(s.to_ascii_uppercase());
        }
        if set.message_ttl_seconds.is_some() {
            p.message_ttl_seconds = set.message_ttl_seconds;
        }
        if set.max_producers_per_topic.is_some() {
            p.max_producers_per_topic = set.max_producers_per_topic;
        }
        if set.max_consumers_per_topic.is_some() {
            p.max_consumers_per_topic = set.max_consumers_per_topic;
        }
        if set.max_subscriptions_per_topic.is_some() {
            p.max_subscriptions_per_topic = set.max_subscriptions_per_topic;
        }
        if set.backlog_quota.is_some() {
            p.backlog_quota = set.backlog_quota.clone();
        }
        if set.retention.is_some() {
            p.retention = set.retention.clone();
        }
        if set.publish_rate.is_some() {
            p.publish_rate = set.publish_rate.clone();
        }
        if set.dispatch_rate.is_some() {
            p.dispatch_rate = set.dispatch_rate.clone();
        }
        if set.subscription_dispatch_rate.is_some() {
            p.subscription_dispatch_rate = set.subscription_dispatch_rate.clone();
        }
        if set.publish_rate_total.is_some() {
            p.publish_rate_total = set.publish_rate_total.clone();
        }
        if set.dispatch_rate_total.is_some() {
            p.dispatch_rate_total = set.dispatch_rate_total.clone();
        }
        if set.compaction_threshold.is_some() {
            p.compaction_threshold = set.compaction_threshold;
        }
        if set.bookie_affinity_group.is_some() {
            p.bookie_affinity_group = set.bookie_affinity_group.clone();
        }
        if set.replication_clusters.is_some() {
            p.replication_clusters = set.replication_clusters.clone();
        }
        if set.replication_backlog_quota.is_some() {
            p.replication_backlog_quota = set.replication_backlog_quota.clone();
        }
        if set.max_replication_lag.is_some() {
            p.max_replication_lag = set.max_replication_lag.clone();
        }
    }

    /// Applies `set` (its present fields) and then removes the fields named in `clear`.
    pub fn updated(&self, set: &NamespacePolicies, clear: &[String]) -> Result<Self, String> {
        let mut p = self.clone();
        p.apply_set(set);
        for f in clear {
            match f.as_str() {
                "deduplication_enabled" => p.deduplication_enabled = None,
                "dead_letter_max_redeliveries" => p.dead_letter_max_redeliveries = None,
                "schema_compatibility_strategy" => p.schema_compatibility_strategy = None,
                "message_ttl_seconds" => p.message_ttl_seconds = None,
                "max_producers_per_topic" => p.max_producers_per_topic = None,
                "max_consumers_per_topic" => p.max_consumers_per_topic = None,
                "max_subscriptions_per_topic" => p.max_subscriptions_per_topic = None,
                "backlog_quota" => p.backlog_quota = None,
                "retention" => p.retention = None,
                "publish_rate" => p.publish_rate = None,
                "dispatch_rate" => p.dispatch_rate = None,
                "subscription_dispatch_rate" => p.subscription_dispatch_rate = None,
                "publish_rate_total" => p.publish_rate_total = None,
                "dispatch_rate_total" => p.dispatch_rate_total = None,
                "compaction_threshold" => p.compaction_threshold = None,
                "bookie_affinity_group" => p.bookie_affinity_group = None,
                "replication_clusters" => p.replication_clusters = None,
                "replication_backlog_quota" => p.replication_backlog_quota = None,
                "max_replication_lag" => p.max_replication_lag = None,
                other => {
                    return Err(format!(
                        "unknown policy {other:?}; policies are {}",
                        POLICY_FIELDS.join(", ")
                    ))
                }
            }
        }
        p.validate()?;
        Ok(p)
    }
}

/// What is wrong with a name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadName(pub String);

impl fmt::Display for BadName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A tenant or cluster name, or one part of a namespace: letters, digits, `-`, `_`, `.`, `=`,
/// `:`, 1 to 128 bytes (Pulsar's characters).
pub fn check_name(what: &str, name: &str) -> Result<(), BadName> {
    if name.is_empty() || name.len() > NAME_BYTES_MAX {
        return Err(BadName(format!(
            "{what} name {name:?} must be 1 to {NAME_BYTES_MAX} bytes"
        )));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || "-_.=:".contains(*c)))
    {
        return Err(BadName(format!(
            "{what} name {name:?} has {c:?}; use letters, digits, '-', '_', '.', '=', ':'"
        )));
    }
    Ok(())
}

/// Splits `tenant/namespace`, checking both parts.
pub fn split_namespace(ns: &str) -> Result<(&str, &str), BadName> {
    let Some((t, n)) = ns.split_once('/') else {
        return Err(BadName(format!(
            "namespace {ns:?} must be tenant/namespace"
        )));
    };
    check_name("tenant", t)?;
    check_name("namespace", n)?;
    Ok((t, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_names_then_only_pulsar_characters_pass() {
        assert!(check_name("tenant", "acme-1_x.y").is_ok());
        assert!(check_name("tenant", "").is_err());
        assert!(check_name("tenant", "a/b").unwrap_err().0.contains("'/'"));
        assert!(check_name("tenant", &"x".repeat(129)).is_err());
        assert_eq!(split_namespace("acme/orders").unwrap(), ("acme", "orders"));
        assert!(split_namespace("acme").is_err());
        assert!(split_namespace("acme/or/ders").is_err());
    }

    #[test]
    fn given_a_max_replication_lag_then_its_policy_and_a_limit_are_required() {
        let l = |policy: &str, secs: u64, entries: u64| NamespacePolicies {
            max_replication_lag: Some(MaxReplicationLag {
                time_seconds: secs,
                entries,
                policy: policy.into(),
            }),
            ..Default::default()
        };
        let err = l("drop_oldest", 5, 0).validate().unwrap_err();
        assert!(
            err.contains("alert, producer_request_hold, producer_exception"),
            "{err}"
        );
        let err = l("alert", 0, 0).validate().unwrap_err();
        assert!(err.contains("time limit"), "{err}");
        assert!(l("producer_request_hold", 5, 0).validate().is_ok());
        assert!(l("alert", 0, 100).validate().is_ok());
        let cleared = l("alert", 5, 0)
            .updated(
                &NamespacePolicies::default(),
                &["max_replication_lag".to_string()],
            )
            .unwrap();
        assert!(cleared.max_replication_lag.is_none());
    }

    #[test]
    fn given_a_replication_backlog_quota_then_its_own_policies_and_a_limit_are_required() {
        let q = |policy: &str, size: u64, secs: u64| NamespacePolicies {
            replication_backlog_quota: Some(BacklogQuota {
                limit_size_bytes: size,
                limit_time_seconds: secs,
                policy: policy.into(),
            }),
            ..Default::default()
        };
        let err = q("consumer_backlog_eviction", 1, 0).validate().unwrap_err();
        assert!(err.contains("replication backlog quota"), "{err}");
        assert!(err.contains("drop_oldest"), "{err}");
        assert!(q("drop_oldest", 0, 0)
            .validate()
            .unwrap_err()
            .contains("size limit, a time limit or both"));
        assert!(q("drop_oldest", 0, 60).validate().is_ok());
        let p = NamespacePolicies::default()
            .updated(&q("producer_exception", 1 << 20, 0), &[])
            .unwrap();
        assert_eq!(
            p.replication_backlog_quota.as_ref().unwrap().policy,
            "producer_exception"
        );
        let cleared = p
            .updated(
                &NamespacePolicies::default(),
                &["replication_backlog_quota".to_string()],
            )
            .unwrap();
        assert!(cleared.replication_backlog_quota.is_none());
        // The subscriptions' quota does not take the replication quota's policy.
        let sub = NamespacePolicies {
            backlog_quota: q("drop_oldest", 1, 0).replication_backlog_quota,
            ..Default::default()
        };
        assert!(sub.validate().unwrap_err().contains("backlog quota policy"));
    }

    #[test]
    fn given_policy_updates_then_bad_values_are_refused_with_the_range() {
        let p = NamespacePolicies::default();
        let set = NamespacePolicies {
            dead_letter_max_redeliveries: Some(0),
            ..Default::default()
        };
        assert!(p.updated(&set, &[]).unwrap_err().contains("1..=1000000"));
        let set = NamespacePolicies {
            schema_compatibility_strategy: Some("sideways".into()),
            ..Default::default()
        };
        assert!(p.updated(&set, &[]).unwrap_err().contains("FULL"));
        let set = NamespacePolicies {
            deduplication_enabled: Some(true),
            schema_compatibility_strategy: Some("backward".into()),
            ..Default::default()
        };
        let q = p.updated(&set, &[]).unwrap();
        assert_eq!(q.schema_compatibility_strategy.as_deref(), Some("BACKWARD"));
        let r = q.updated(
            &NamespacePolicies::default(),
            &["deduplication_enabled".into()],
        );
        assert_eq!(r.unwrap().deduplication_enabled, None);
        assert!(q
            .updated(&NamespacePolicies::default(), &["nope".into()])
            .unwrap_err()
            .contains("unknown policy"));
        let set = NamespacePolicies {
            retention: Some(Retention {
                time_minutes: -2,
                size_mb: 10,
            }),
            ..Default::default()
        };
        assert!(p
            .updated(&set, &[])
            .unwrap_err()
            .contains("-1 (no limit) or more"));
        let set = NamespacePolicies {
            backlog_quota: Some(BacklogQuota {
                policy: "producer_exception".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(p
            .updated(&set, &[])
            .unwrap_err()
            .contains("needs a size limit"));
        // A backlog quota beyond the retention that keeps its data contradicts it.
        let set = NamespacePolicies {
            backlog_quota: Some(BacklogQuota {
                limit_size_bytes: 20 << 20,
                limit_time_seconds: 0,
                policy: "producer_request_hold".into(),
            }),
            retention: Some(Retention {
                time_minutes: -1,
                size_mb: 10,
            }),
            ..Default::default()
        };
        assert!(p
            .updated(&set, &[])
            .unwrap_err()
            .contains("retention size 10 MB is smaller"));
        let mut ok = set.clone();
        ok.retention = Some(Retention {
            time_minutes: 60,
            size_mb: 20,
        });
        assert!(p.updated(&ok, &[]).is_ok());
        let mut long = ok.clone();
        long.backlog_quota.as_mut().unwrap().limit_time_seconds = 7200;
        assert!(p
            .updated(&long, &[])
            .unwrap_err()
            .contains("retention time 60 min is shorter"));
        // A topic's overrides over its namespace's, field by field; grants stay.
        let mut ns = NamespacePolicies {
            message_ttl_seconds: Some(3600),
            max_producers_per_topic: Some(5),
            ..Default::default()
        };
        ns.permissions.insert("app".into(), vec!["produce".into()]);
        let own = NamespacePolicies {
            message_ttl_seconds: Some(1),
            ..Default::default()
        };
        let eff = ns.overlaid(&own);
        assert_eq!(eff.message_ttl_seconds, Some(1));
        assert_eq!(eff.max_producers_per_topic, Some(5));
        assert_eq!(eff.permissions.len(), 1);
        // Stored form: only what is set.
        assert_eq!(
            serde_json::to_string(&NamespacePolicies::default()).unwrap(),
            "{}"
        );
    }
}
