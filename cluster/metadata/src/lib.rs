//! Meridian's per-site metadata store.
//!
//! Owns: a versioned key-value store with `/`-separated keys, compare-and-set, all-or-nothing
//! transactions, ordered prefix scans and child listings, watches from a revision, sessions with
//! leases and ephemeral keys, and sequential keys — replicated with openraft over tonic gRPC,
//! with the Raft log and the state machine in RocksDB. Also the Rust client library, and an
//! embedded single-node mode with the same client API.
//!
//! Deliberately does not know about topics, tenants or ledgers: those are key layouts chosen by
//! the crates that use it.
//!
//! ```text
//!  client ──gRPC Metadata──> any node ──(forward if follower)──> leader
//!                                                                 │ client_write
//!                                              openraft ──Raft gRPC──> followers
//!                                                 │ append (fsync)      │
//!                                              store::LogStore       store::LogStore
//!                                                 │ apply               │ apply
//!                                              model::KvState ──> watch history + notices
//! ```

pub mod client;
pub mod db_threads;
pub mod durable_dir;
pub mod embedded;
pub mod model;
pub mod network;
pub mod node;
pub mod service;
pub mod stall;
pub mod store;
pub mod tls;

pub mod pb {
    //! Generated protobuf and gRPC types (`proto/metadata.proto`).
    #![allow(clippy::all, missing_docs, unreachable_pub)]
    tonic::include_proto!("meridian.metadata.v1");
    /// Descriptor set for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("metadata_descriptor");
}

pub use client::{ClientError, MetadataClient, SessionHandle, WatchStream};
pub use model::{Command, KeyValue, Response};
pub use node::{MetadataNode, NodeError};

/// Node ids are small positive integers chosen by the operator (`--node-id`).
pub type NodeId = u64;

openraft::declare_raft_types!(
    /// openraft's type configuration for the metadata store.
    pub TypeConfig:
        D = model::Command,
        R = model::Response,
        NodeId = NodeId,
        Node = openraft::BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = std::io::Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// The Raft instance of a metadata node.
pub type Raft = openraft::Raft<TypeConfig>;
