//! Meridian's broker: the Pulsar protocol over the storage layer, and the process roles.
//!
//! Owns: topic names ([`topic_name`]), topics, producers and subscriptions ([`broker`]), client
//! connections ([`connection`]), the listeners ([`server`], TLS in [`tls`]), `/metrics` and `/health`
//! ([`http`]), the broker's side of the admin API ([`admin`]), and `meridian standalone`
//! ([`standalone`]).
//!
//! Does not know about: how entries reach bookies (that is `meridian-storage`), frame bytes
//! (that is `meridian-protocol`).

pub mod admin;
pub mod broker;
pub mod connection;
pub mod failpoint;
pub mod frame_queue;
pub mod http;
mod publish;
pub mod server;
pub mod standalone;
pub mod tls;
pub mod topic_name;
