//! Partitioned topics: a name with N partitions recorded in the metadata store, each partition
//! (`<name>-partition-<i>`) an ordinary topic with its own managed ledger.
//!
//! ```text
//!  /admin/partitioned-topics/<tenant>/<ns>/persistent/<escaped local>  {"partitions": N}
//! ```
//!
//! Clients ask PARTITIONED_METADATA first and fan out to the N partitions themselves. A
//! partition's topic is created on first use whenever its index is below N, whatever
//! `broker.allow_auto_topic_creation` says: the partitioned topic's record is the permission.

use meridian_metadata::client::ClientError;
use meridian_protocol::pb::ServerError;
use serde::{Deserialize, Serialize};

use super::{Broker, BrokerError, NAMESPACES_PREFIX};
use crate::topic_name::{escape, TopicName};

/// Where partitioned topics are recorded.
pub const PARTITIONED_TOPICS_PREFIX: &str = "/admin/partitioned-topics/";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PartitionedTopicRecord {
    pub partitions: u32,
}

/// The metadata key of a partitioned topic.
pub fn partitioned_topic_key(name: &TopicName) -> String {
    format!(
        "{PARTITIONED_TOPICS_PREFIX}{}/{}/persistent/{}",
        name.tenant,
        name.namespace,
        escape(&name.local)
    )
}

/// A lost compare-and-set (MetadataError from `record_partitions`) told as NotAllowed.
fn lost_race(e: BrokerError, message: impl FnOnce() -> String) -> BrokerError {
    if e.code == ServerError::MetadataError {
        BrokerError::new(ServerError::NotAllowedError, message())
    } else {
        e
    }
}

impl Broker {
    /// The partition count of `name` with its record's version: `None` for a non-partitioned
    /// (or unknown) topic.
    pub async fn partitions_of(&self, name: &TopicName) -> Result<Option<(u32, u64)>, BrokerError> {
        let Some(kv) = self.meta.get(&partitioned_topic_key(name)).await? else {
            return Ok(None);
        };
        let rec: PartitionedTopicRecord = serde_json::from_slice(&kv.value).map_err(|e| {
            BrokerError::new(
                ServerError::MetadataError,
                format!("partitioned topic record of {name} is damaged: {e}"),
            )
        })?;
        Ok(Some((rec.partitions, kv.mod_revision)))
    }

    /// The answer to PARTITIONED_METADATA: N for a partitioned topic, 0 otherwise. With
    /// auto-creation of type `partitioned`, an unknown name in an existing namespace becomes
    /// a partitioned topic of `broker.default_num_partitions` here, as in Pulsar.
    pub async fn partitioned_metadata(&self, name: &TopicName) -> Result<u32, BrokerError> {
        if name.partition().is_some() {
            return Ok(0);
        }
        if let Some((n, _)) = self.partitions_of(name).await? {
            return Ok(n);
        }
        if !self.cfg.allow_auto_topic_creation
            || self.cfg.allow_auto_topic_creation_type != "partitioned"
            || self.topic_exists(name).await?
            || !self.namespace_exists(&name.namespace()).await?
        {
            return Ok(0);
        }
        let n = self.cfg.default_num_partitions as u32;
        match self.record_partitions(name, n, Some(0)).await {
            Ok(()) => {
                tracing::info!(topic = %name, partitions = n, "partitioned topic auto-created");
                Ok(n)
            }
            // Created meanwhile by another request.
            Err(e) if e.code == ServerError::MetadataError => {
                Ok(self.partitions_of(name).await?.map_or(0, |(n, _)| n))
            }
            Err(e) => Err(e),
        }
    }

    /// Creates a partitioned topic of `partitions` partitions. Refused if the name is taken
    /// (partitioned or not), names a partition, or its namespace does not exist.
    pub async fn create_partitioned_topic(
        &self,
        name: &TopicName,
        partitions: u32,
    ) -> Result<(), BrokerError> {
        self.check_partition_count(name, partitions)?;
        if name.partition().is_some() {
            return Err(BrokerError::new(
                ServerError::InvalidTopicName,
                format!("{name} is a partition's name; a partitioned topic cannot be named so"),
            ));
        }
        if !self.namespace_exists(&name.namespace()).await? {
            return Err(BrokerError::new(
                ServerError::TopicNotFound,
                format!("namespace {} does not exist", name.namespace()),
            ));
        }
        if self.topic_exists(name).await? {
            return Err(BrokerError::new(
                ServerError::NotAllowedError,
                format!("{name} already exists as a non-partitioned topic"),
            ));
        }
        self.record_partitions(name, partitions, Some(0))
            .await
            .map_err(|e| lost_race(e, || format!("partitioned topic {name} already exists")))
    }

    /// Grows a partitioned topic to `partitions` (never shrinks: data lives in partitions).
    /// Clients pick the new partitions up at their next partition refresh or reconnect.
    pub async fn update_partitions(
        &self,
        name: &TopicName,
        partitions: u32,
    ) -> Result<(), BrokerError> {
        self.check_partition_count(name, partitions)?;
        let Some((current, version)) = self.partitions_of(name).await? else {
            return Err(BrokerError::new(
                ServerError::TopicNotFound,
                format!("{name} is not a partitioned topic"),
            ));
        };
        if partitions <= current {
            return Err(BrokerError::new(
                ServerError::NotAllowedError,
                format!(
                    "{name} has {current} partitions; the count can only grow (asked {partitions})"
                ),
            ));
        }
        self.record_partitions(name, partitions, Some(version))
            .await
            .map_err(|e| lost_race(e, || format!("{name} changed meanwhile; retry")))
    }

    fn check_partition_count(&self, name: &TopicName, n: u32) -> Result<(), BrokerError> {
        if n == 0 || u64::from(n) > self.cfg.partitions_max {
            return Err(BrokerError::new(
                ServerError::NotAllowedError,
                format!(
                    "{name}: {n} partitions is out of range 1..={} (broker.partitions_max)",
                    self.cfg.partitions_max
                ),
            ));
        }
        Ok(())
    }

    /// Writes the record with a compare-and-set on `expected` (0: must be absent); a lost
    /// race is a MetadataError.
    async fn record_partitions(
        &self,
        name: &TopicName,
        partitions: u32,
        expected: Option<u64>,
    ) -> Result<(), BrokerError> {
        let value =
            serde_json::to_vec(&PartitionedTopicRecord { partitions }).expect("record serialises");
        let opts = meridian_metadata::client::PutOptions {
            expected_version: expected,
            ..Default::default()
        };
        match self
            .meta
            .put_with(&partitioned_topic_key(name), value, opts)
            .await
        {
            Ok(_) => Ok(()),
            Err(ClientError::Conflict { .. }) => Err(BrokerError::new(
                ServerError::MetadataError,
                format!("{name}: the partitioned topic record changed meanwhile"),
            )),
            Err(e) => Err(e.into()),
        }
    }

    pub async fn namespace_exists(&self, namespace: &str) -> Result<bool, BrokerError> {
        Ok(self
            .meta
            .get(&format!("{NAMESPACES_PREFIX}{namespace}"))
            .await?
            .is_some())
    }

    /// TopicNotFound naming the namespace unless it exists.
    pub async fn require_namespace(&self, namespace: &str) -> Result<(), BrokerError> {
        if self.namespace_exists(namespace).await? {
            Ok(())
        } else {
            Err(BrokerError::new(
                ServerError::TopicNotFound,
                format!("namespace {namespace} does not exist"),
            ))
        }
    }

    /// Partitioned topics of a namespace, with their partition counts.
    pub async fn partitioned_topics_of_namespace(
        &self,
        namespace: &str,
    ) -> Result<Vec<(TopicName, u32)>, BrokerError> {
        let prefix = format!("{PARTITIONED_TOPICS_PREFIX}{namespace}/persistent/");
        let mut out = Vec::new();
        let mut after = String::new();
        loop {
            let page = self.meta.children(&prefix, &after, 0).await?;
            for local in &page.children {
                let unescaped = crate::topic_name::unescape(local);
                let name = TopicName::parse(&format!("persistent://{namespace}/{unescaped}"))?;
                if let Some((n, _)) = self.partitions_of(&name).await? {
                    out.push((name, n));
                }
            }
            match page.children.last() {
                Some(last) if page.more => after = last.clone(),
                _ => break,
            }
        }
        Ok(out)
    }
}
