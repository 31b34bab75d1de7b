//! One question on a stream of its own: a frame sent, one frame answered (a deletion, the
//! global objects' copies), with a deadline.

use std::time::Duration;

use crate::frame::{Frame, RefusalCode};
use crate::link::{read_frame, write_frame, GeoLink};

/// Why a question got no answer worth having.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestFailure {
    /// The site answered and will not do it: asking again does not help.
    Refused(String),
    /// No answer (unreachable, timed out, the stream broke): ask again later.
    Failed(String),
}

/// Sends `frame` to `remote` on a new stream; the answer (a refusal is an error).
pub async fn request(
    link: &GeoLink,
    remote: &str,
    frame: &Frame,
    timeout: Duration,
) -> Result<Frame, RequestFailure> {
    let failed = RequestFailure::Failed;
    let work = async {
        let peer = link.peer(remote).await.map_err(|e| failed(e.to_string()))?;
        let (mut send, mut recv) = peer
            .conn
            .open_bi()
            .await
            .map_err(|e| failed(format!("opening a stream: {e}")))?;
        write_frame(&mut send, frame)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let _ = send.finish();
        match read_frame(&mut recv, link.frame_bytes_max()).await {
            Ok(Some(Frame::Refused { code, reason })) => {
                let why = format!("refused by {remote}: {reason}");
                Err(if code == RefusalCode::Retry {
                    failed(why)
                } else {
                    RequestFailure::Refused(why)
                })
            }
            Ok(Some(answer)) => Ok(answer),
            Ok(None) => Err(failed(format!("{remote} ended the stream"))),
            Err(e) => Err(failed(e.to_string())),
        }
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| failed(format!("no answer from {remote} within {timeout:?}")))?
}
