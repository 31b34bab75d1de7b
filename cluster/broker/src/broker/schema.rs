//! The schema registry: each topic's schemas, in versions, in the metadata store.
//!
//! ```text
//!  /schemas/<tenant>/<ns>/persistent/<topic>   {"versions": [{type, data (hex), properties}, ...]}
//! ```
//!
//! A partitioned topic has one registry for all its partitions. A producer (or
//! GET_OR_CREATE_SCHEMA) with a schema gets the version of an identical schema, or its schema
//! is added as a new version if it passes the compatibility check of the namespace's strategy
//! (`schema_compatibility_strategy`, default FULL as in Pulsar), else IncompatibleSchema. A
//! consumer's schema is checked the same way and added only to an empty registry. Producers and
//! consumers without a schema (bytes) are always let in, as in Pulsar by default. Avro and JSON
//! schemas evolve by Avro's resolution rules ([`super::avro`]); other kinds only by staying the
//! same.

use std::collections::BTreeMap;

use meridian_metadata::client::{ClientError, PutOptions};
use meridian_protocol::pb::{self, ServerError};
use serde::{Deserialize, Serialize};

use super::{avro, Broker, BrokerError};
use crate::topic_name::{escape, TopicName};

pub const SCHEMAS_PREFIX: &str = "/schemas/";

/// Schema kinds on the wire (Schema.type) that evolve by Avro rules.
const TYPE_JSON: i32 = 2;
const TYPE_AVRO: i32 = 4;
/// Schema.type "None": a bytes producer or consumer.
const TYPE_NONE: i32 = 0;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredSchema {
    #[serde(rename = "type")]
    pub kind: i32,
    pub name: String,
    /// The definition, hex-encoded.
    pub data: String,
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

impl StoredSchema {
    pub fn from_wire(s: &pb::Schema) -> StoredSchema {
        StoredSchema {
            kind: s.r#type,
            name: s.name.clone(),
            data: hex(&s.schema_data),
            properties: s
                .properties
                .iter()
                .map(|kv| (kv.key.clone(), kv.value.clone()))
                .collect(),
        }
    }

    pub fn to_wire(&self) -> pb::Schema {
        pb::Schema {
            name: self.name.clone(),
            schema_data: unhex(&self.data),
            r#type: self.kind,
            properties: self
                .properties
                .iter()
                .map(|(k, v)| pb::KeyValue {
                    key: k.clone(),
                    value: v.clone(),
                })
                .collect(),
        }
    }

    /// Same definition (name and properties aside, as Pulsar compares schema hashes).
    fn same(&self, other: &StoredSchema) -> bool {
        self.kind == other.kind && self.data == other.data
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Registry {
    versions: Vec<StoredSchema>,
}

/// How a new schema must relate to the registered ones (Pulsar's strategies).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    AlwaysCompatible,
    AlwaysIncompatible,
    Backward,
    Forward,
    Full,
    BackwardTransitive,
    ForwardTransitive,
    FullTransitive,
}

impl Strategy {
    pub fn parse(s: &str) -> Option<Strategy> {
        Some(match s.to_ascii_uppercase().as_str() {
            "ALWAYS_COMPATIBLE" => Strategy::AlwaysCompatible,
            "ALWAYS_INCOMPATIBLE" => Strategy::AlwaysIncompatible,
            "BACKWARD" => Strategy::Backward,
            "FORWARD" => Strategy::Forward,
            "FULL" => Strategy::Full,
            "BACKWARD_TRANSITIVE" => Strategy::BackwardTransitive,
            "FORWARD_TRANSITIVE" => Strategy::ForwardTransitive,
            "FULL_TRANSITIVE" => Strategy::FullTransitive,
            _ => return None,
        })
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .filter_map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok())
        .collect()
}

/// A version as clients carry it: 8 bytes, big-endian.
pub fn version_bytes(v: u64) -> Vec<u8> {
    v.to_be_bytes().to_vec()
}

fn incompatible(message: String) -> BrokerError {
    BrokerError::new(ServerError::IncompatibleSchema, message)
}

/// Checks `new` against the registered `versions` (oldest first) under `strategy`.
pub fn check_compatible(
    strategy: Strategy,
    versions: &[StoredSchema],
    new: &StoredSchema,
) -> Result<(), String> {
    let Some(latest) = versions.last() else {
        return Ok(());
    };
    if strategy == Strategy::AlwaysCompatible {
        return Ok(());
    }
    if strategy == Strategy::AlwaysIncompatible {
        return Err("the strategy ALWAYS_INCOMPATIBLE allows no new schema".into());
    }
    if new.kind != latest.kind {
        return Err(format!(
            "schema type {} differs from the topic's {}",
            new.kind, latest.kind
        ));
    }
    if new.kind != TYPE_AVRO && new.kind != TYPE_JSON {
        return Err(format!(
            "schemas of type {} cannot evolve; only an identical schema is accepted",
            new.kind
        ));
    }
    let parse = |s: &StoredSchema| {
        avro::parse(&unhex(&s.data))
            .map_err(|e| format!("schema {:?} is not an Avro definition: {e}", s.name))
    };
    let n = parse(new)?;
    let against: &[StoredSchema] = match strategy {
        Strategy::BackwardTransitive | Strategy::ForwardTransitive | Strategy::FullTransitive => {
            versions
        }
        _ => std::slice::from_ref(latest),
    };
    let (backward, forward) = match strategy {
        Strategy::Backward | Strategy::BackwardTransitive => (true, false),
        Strategy::Forward | Strategy::ForwardTransitive => (false, true),
        _ => (true, true),
    };
    for old in against {
        let o = parse(old)?;
        if backward {
            avro::can_read(&n, &o).map_err(|e| {
                format!("the new schema cannot read data written with an existing one: {e}")
            })?;
        }
        if forward {
            avro::can_read(&o, &n).map_err(|e| {
                format!("an existing schema cannot read data written with the new one: {e}")
            })?;
        }
    }
    Ok(())
}

impl Broker {
    pub(super) fn schema_key(name: &TopicName) -> String {
        let base = name.parent().unwrap_or_else(|| name.clone());
        format!(
            "{SCHEMAS_PREFIX}{}/{}/persistent/{}",
            base.tenant,
            base.namespace,
            escape(&base.local)
        )
    }

    async fn registry(&self, name: &TopicName) -> Result<(Registry, u64), BrokerError> {
        match self.meta.get(&Self::schema_key(name)).await? {
            None => Ok((Registry::default(), 0)),
            Some(kv) => {
                let r = serde_json::from_slice(&kv.value).map_err(|e| {
                    BrokerError::new(
                        ServerError::MetadataError,
                        format!("schema registry of {name} is damaged: {e}"),
                    )
                })?;
                Ok((r, kv.mod_revision))
            }
        }
    }

    async fn strategy(&self, name: &TopicName) -> Result<Strategy, BrokerError> {
        let p = self.namespace_policies(&name.namespace()).await?;
        Ok(p.schema_compatibility_strategy
            .as_deref()
            .and_then(Strategy::parse)
            .unwrap_or(Strategy::Full))
    }

    /// A producer's (or GET_OR_CREATE_SCHEMA's) schema: its version, added if new and
    /// compatible. `None` for a producer without a schema.
    pub async fn schema_for_producer(
        &self,
        name: &TopicName,
        schema: Option<&pb::Schema>,
    ) -> Result<Option<u64>, BrokerError> {
        let Some(schema) = schema.filter(|s| s.r#type != TYPE_NONE) else {
            return Ok(None);
        };
        let new = StoredSchema::from_wire(schema);
        // A lost race with another writer of the registry is retried.
        for _ in 0..5 {
            let (mut reg, version) = self.registry(name).await?;
            if let Some(i) = reg.versions.iter().position(|v| v.same(&new)) {
                return Ok(Some(i as u64));
            }
            check_compatible(self.strategy(name).await?, &reg.versions, &new)
                .map_err(|e| incompatible(format!("{name}: {e}")))?;
            reg.versions.push(new.clone());
            let put = self
                .meta
                .put_with(
                    &Self::schema_key(name),
                    serde_json::to_vec(&reg).expect("registry serialises"),
                    PutOptions {
                        expected_version: Some(version),
                        ..Default::default()
                    },
                )
                .await;
            match put {
                Ok(_) => {
                    tracing::info!(topic = %name, version = reg.versions.len() - 1, kind = new.kind, "schema added");
                    return Ok(Some(reg.versions.len() as u64 - 1));
                }
                Err(ClientError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(BrokerError::new(
            ServerError::ServiceNotReady,
            format!("{name}: the schema registry kept changing; retry"),
        ))
    }

    /// A consumer's schema: accepted if identical to a version or compatible with them (added
    /// only when the registry is empty).
    pub async fn schema_for_consumer(
        &self,
        name: &TopicName,
        schema: Option<&pb::Schema>,
    ) -> Result<(), BrokerError> {
        let Some(schema) = schema.filter(|s| s.r#type != TYPE_NONE) else {
            return Ok(());
        };
        let (reg, _) = self.registry(name).await?;
        if reg.versions.is_empty() {
            return self
                .schema_for_producer(name, Some(schema))
                .await
                .map(|_| ());
        }
        let new = StoredSchema::from_wire(schema);
        if reg.versions.iter().any(|v| v.same(&new)) {
            return Ok(());
        }
        check_compatible(self.strategy(name).await?, &reg.versions, &new)
            .map_err(|e| incompatible(format!("{name}: {e}")))
    }

    /// GET_SCHEMA: a version (8 bytes, big-endian), or the latest; `None` if there is none.
    pub async fn get_schema(
        &self,
        name: &TopicName,
        version: Option<&[u8]>,
    ) -> Result<Option<(u64, StoredSchema)>, BrokerError> {
        let (reg, _) = self.registry(name).await?;
        let v = match version.filter(|v| !v.is_empty()) {
            Some(b) => {
                let arr: [u8; 8] = b.try_into().map_err(|_| {
                    BrokerError::new(
                        ServerError::IncompatibleSchema,
                        format!("schema version of {} bytes; versions are 8", b.len()),
                    )
                })?;
                u64::from_be_bytes(arr)
            }
            None => match reg.versions.len() {
                0 => return Ok(None),
                n => n as u64 - 1,
            },
        };
        Ok(reg
            .versions
            .get(usize::try_from(v).unwrap_or(usize::MAX))
            .map(|s| (v, s.clone())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn avro(def: &str) -> StoredSchema {
        StoredSchema {
            kind: TYPE_AVRO,
            name: "s".into(),
            data: hex(def.as_bytes()),
            properties: BTreeMap::new(),
        }
    }

    const V1: &str = r#"{"type":"record","name":"U","fields":[{"name":"a","type":"int"}]}"#;
    const ADD_DEFAULT: &str = r#"{"type":"record","name":"U","fields":[{"name":"a","type":"int"},{"name":"b","type":"string","default":""}]}"#;
    const ADD_REQUIRED: &str = r#"{"type":"record","name":"U","fields":[{"name":"a","type":"int"},{"name":"c","type":"string"}]}"#;
    const DROP_A: &str = r#"{"type":"record","name":"U","fields":[]}"#;

    #[test]
    fn given_strategies_then_the_directions_checked_differ() {
        let v = vec![avro(V1)];
        assert!(check_compatible(Strategy::Full, &v, &avro(ADD_DEFAULT)).is_ok());
        assert!(check_compatible(Strategy::Full, &v, &avro(ADD_REQUIRED)).is_err());
        // Dropping a field without a default: new readers are fine, old readers are not.
        assert!(check_compatible(Strategy::Backward, &v, &avro(DROP_A)).is_ok());
        assert!(check_compatible(Strategy::Forward, &v, &avro(DROP_A)).is_err());
        assert!(check_compatible(Strategy::Forward, &v, &avro(ADD_REQUIRED)).is_ok());
        assert!(check_compatible(Strategy::AlwaysCompatible, &v, &avro(ADD_REQUIRED)).is_ok());
        assert!(check_compatible(Strategy::AlwaysIncompatible, &v, &avro(ADD_DEFAULT)).is_err());
    }

    #[test]
    fn given_transitive_then_every_version_is_checked() {
        // v0 has `a`; v1 dropped it (backward-compatible with v0); v2 adds `a` back as a string.
        let v = vec![avro(V1), avro(DROP_A)];
        let back =
            r#"{"type":"record","name":"U","fields":[{"name":"a","type":"string","default":""}]}"#;
        assert!(check_compatible(Strategy::Backward, &v, &avro(back)).is_ok());
        assert!(check_compatible(Strategy::BackwardTransitive, &v, &avro(back)).is_err());
    }

    #[test]
    fn given_other_kinds_or_a_type_change_then_only_identical_passes() {
        let s = |kind, data: &str| StoredSchema {
            kind,
            name: "s".into(),
            data: hex(data.as_bytes()),
            properties: BTreeMap::new(),
        };
        let v = vec![s(1, "")];
        assert!(check_compatible(Strategy::Full, &v, &s(1, "x")).is_err());
        assert!(check_compatible(Strategy::Full, &[avro(V1)], &s(TYPE_JSON, V1)).is_err());
        assert_eq!(unhex(&hex(b"\x00\xffab")), b"\x00\xffab");
    }
}
