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
    match request_at(link, remote, None, frame, timeout).await? {
        Answer::Frame(f) => Ok(f),
        Answer::Moved(url) => Err(RequestFailure::Refused(format!(
            "refused by {remote}: served by {url}"
        ))),
    }
}

/// What a question to one broker got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Frame(Frame),
    /// Another broker of the site serves it: its geo URL.
    Moved(String),
}

/// Sends `frame` to `remote` (at its geo URL, or at broker `at` of it) on a new stream; the
/// answer, or where the site says to ask instead.
pub async fn request_at(
    link: &GeoLink,
    remote: &str,
    at: Option<&str>,
    frame: &Frame,
    timeout: Duration,
) -> Result<Answer, RequestFailure> {
    let failed = RequestFailure::Failed;
    let work = async {
        let peer = match at {
            Some(url) => link.peer_at(remote, url).await,
            None => link.peer(remote).await,
        }
        .map_err(|e| failed(e.to_string()))?;
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
            Ok(Some(Frame::Refused {
                code: RefusalCode::Moved,
                reason,
            })) => Ok(Answer::Moved(reason)),
            Ok(Some(Frame::Refused { code, reason })) => {
                let why = format!("refused by {remote}: {reason}");
                Err(if code == RefusalCode::Retry {
                    failed(why)
                } else {
                    RequestFailure::Refused(why)
                })
            }
            Ok(Some(answer)) => Ok(Answer::Frame(answer)),
            Ok(None) => Err(failed(format!("{remote} ended the stream"))),
            Err(e) => Err(failed(e.to_string())),
        }
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| failed(format!("no answer from {remote} within {timeout:?}")))?
}
