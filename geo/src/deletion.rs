//! A global topic's deletion carried to another site: a stream of its own that begins with
//! `Delete{topic, deleted_at_ms}` and ends with the receiver's `Deleted` (or a refusal).
//!
//! ```text
//!  deleting site                      receiving site
//!  Delete{topic, at} ─────────────►  ReplicaSink::delete: the namespace lists the sender?
//!                                      delete the topic, keep a tombstone ─► Deleted
//!                                                                   else ─► Refused{..}
//! ```
//!
//! The deleting site keeps its own tombstone, with the sites that have not answered
//! `Deleted` yet, and sends again until each has; a receiver deletes idempotently.

use std::time::Duration;

use crate::frame::Frame;
use crate::link::GeoLink;
pub use crate::request::RequestFailure as DeleteFailure;

/// Asks `remote` to delete `topic` (deleted here at `deleted_at_ms`); Ok once it has.
pub async fn send_delete(
    link: &GeoLink,
    remote: &str,
    topic: &str,
    deleted_at_ms: u64,
    timeout: Duration,
) -> Result<(), DeleteFailure> {
    let frame = Frame::Delete {
        topic: topic.to_string(),
        deleted_at_ms,
    };
    match crate::request::request(link, remote, &frame, timeout).await? {
        Frame::Deleted => Ok(()),
        other => Err(DeleteFailure::Failed(format!(
            "expected Deleted, got {other:?}"
        ))),
    }
}
