//! The global objects (cluster records, tenants, namespaces) carried to another site: a
//! stream of its own that begins with `Sync{doc}` (this site's copies of what the peer takes
//! part in) and ends with the peer's `Synced{changed, skipped}` once it merged them.
//!
//! ```text
//!  site east                            site west
//!  Sync{east's copies} ─────────────►  ReplicaSink::sync: merge field by field (newer wins),
//!                                        keep deletions ─► Synced{changed, skipped}
//!  ◄───────────── Sync{west's copies}   (each site sends its own, on its own beat)
//! ```
//!
//! What the copies are and how they merge is the site's (the broker's registry); the link
//! carries bytes. Each site sends when what it would send changed, and again now and then,
//! so two sites that meet after a partition converge within a beat or two.

use std::time::Duration;

use crate::frame::Frame;
use crate::link::GeoLink;
use crate::request::RequestFailure;

/// Sends `doc` to `remote`; what it changed and did not take there.
pub async fn send_sync(
    link: &GeoLink,
    remote: &str,
    doc: bytes::Bytes,
    timeout: Duration,
) -> Result<(u32, u32), RequestFailure> {
    match crate::request::request(link, remote, &Frame::Sync { doc }, timeout).await? {
        Frame::Synced { changed, skipped } => Ok((changed, skipped)),
        other => Err(RequestFailure::Failed(format!(
            "expected Synced, got {other:?}"
        ))),
    }
}
