//! Meridian's tenancy: clusters, tenants, namespaces and their policies as records in the
//! site's metadata store ([`model`], [`store`]), the gRPC admin service over them
//! ([`service`]; topic operations are delegated to the broker through [`service::TopicOps`]),
//! and the `meridian-admin` CLI (`src/bin`).
//!
//! It knows nothing of the data path: no sockets of the Pulsar protocol, no ledgers. The broker
//! reads the records (policies) and enforces them.

pub mod auth;
pub mod drill_probe;
pub mod drills;
pub mod federation;
pub mod geo_pki;
pub mod isolation;
pub mod model;
pub mod service;
pub mod site_tls;
pub mod store;
pub mod versions;

pub mod pb {
    //! Generated protobuf and gRPC types (`proto/admin.proto`).
    #![allow(clippy::all, missing_docs, unreachable_pub)]
    tonic::include_proto!("meridian.admin.v1");
    /// Descriptor set for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("admin_descriptor");
}

pub use model::NamespacePolicies;
pub use store::{AdminError, TenancyStore};
