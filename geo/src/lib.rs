//! Meridian's geo-replication: sites joined by a QUIC link (mutual TLS by the federation's
//! CA) that carries the topics of global namespaces.
//!
//! - [`identity`]: a site's name in its certificate (`meridian://site/<name>`).
//! - [`tls`]: the link's TLS 1.3 configurations, certificate files and their reload.
//! - [`frame`]: the frames of the link's streams, sans-IO.
//! - [`link`]: the endpoint: accepting peers the registry knows, dialing, the hello, and
//!   handing peers' topic streams to the receiver.
//! - [`receiver`]: a topic stream's receiving end (append, acknowledge once durable).
//! - [`inflow`]: a topic stream's frames read with each entry shaped into the site's form as
//!   its bytes come.
//! - [`budget`]: what a peer's link may hold here (frames read and not yet durable).
//! - [`replicator`]: a topic's sending end per remote site (window, acknowledgements,
//!   reconnects with back-off).
//! - [`request`]: one question on a stream of its own, one answer.
//! - [`deletion`]: a global topic's deletion carried to another site.
//! - [`metasync`]: the global objects (registry, tenants, namespaces) carried to another
//!   site and merged there.
//! - [`subsync`]: replicated subscriptions' acknowledgements carried to a topic's owner at
//!   another site.
//!
//! It knows nothing of how a broker dispatches: what it needs from the site (the registry
//! today) comes through small traits the broker implements.

pub mod budget;
pub mod deletion;
pub mod frame;
pub mod identity;
pub mod inflow;
pub mod link;
pub mod metasync;
pub mod receiver;
pub mod replicator;
pub mod request;
pub mod subsync;
pub mod tls;

pub use link::{GeoLink, LinkError, Peer, SiteDirectory};
