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

use crate::frame::{Frame, RefusalCode};
use crate::link::{read_frame, write_frame, GeoLink};

/// Why a deletion did not reach a site.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeleteFailure {
    /// The site answered and will not delete (the topic is not replicated with this site
    /// there): asking again does not help.
    Refused(String),
    /// No answer (unreachable, timed out, the stream broke): ask again later.
    Failed(String),
}

/// Asks `remote` to delete `topic` (deleted here at `deleted_at_ms`); Ok once it has.
pub async fn send_delete(
    link: &GeoLink,
    remote: &str,
    topic: &str,
    deleted_at_ms: u64,
    timeout: Duration,
) -> Result<(), DeleteFailure> {
    let failed = DeleteFailure::Failed;
    let work = async {
        let peer = link.peer(remote).await.map_err(|e| failed(e.to_string()))?;
        let (mut send, mut recv) = peer
            .conn
            .open_bi()
            .await
            .map_err(|e| failed(format!("opening a stream: {e}")))?;
        let frame = Frame::Delete {
            topic: topic.to_string(),
            deleted_at_ms,
        };
        write_frame(&mut send, &frame)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let _ = send.finish();
        match read_frame(&mut recv, link.frame_bytes_max()).await {
            Ok(Some(Frame::Deleted)) => Ok(()),
            Ok(Some(Frame::Refused { code, reason })) => {
                let why = format!("refused by {remote}: {reason}");
                Err(if code == RefusalCode::Retry {
                    failed(why)
                } else {
                    DeleteFailure::Refused(why)
                })
            }
            Ok(Some(other)) => Err(failed(format!("expected Deleted, got {other:?}"))),
            Ok(None) => Err(failed(format!("{remote} ended the stream"))),
            Err(e) => Err(failed(e.to_string())),
        }
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| failed(format!("no answer from {remote} within {timeout:?}")))?
}
