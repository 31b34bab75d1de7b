//! Meridian's broker: the Pulsar protocol over the storage layer.
//!
//! Owns: topic names ([`topic_name`]), topics, producers and subscriptions, bundle ownership,
//! lookups and the load manager ([`broker`]), client connections ([`connection`]), the
//! listeners ([`server`], TLS in [`tls`], their connection bounds in [`admission`]), `/metrics` and `/health` ([`http`]), and the
//! broker's side of the admin API ([`admin`]).
//!
//! Does not know about: how entries reach bookies (that is `meridian-storage`), frame bytes
//! (that is `meridian-protocol`), or how roles share a process (that is the `meridian`
//! binary's crate, `meridian-roles`).

pub mod admin;
pub mod admission;
pub mod broker;
mod closing;
pub mod connection;
pub mod console;
pub mod failpoint;
pub mod frame_queue;
pub mod geo;
pub mod http;
pub mod http_server;
mod publish;
pub mod server;
pub mod tls;
pub mod topic_name;
mod warmup;
