//! Replicated subscriptions' acknowledgements carried to another site: `SubSync{topic, doc}`
//! sent to the broker that owns the topic there (following `Moved`), answered `SubSynced{doc}`
//! once applied. The documents are the site's (the link does not read them).

use std::time::Duration;

use crate::frame::Frame;
use crate::link::GeoLink;
use crate::request::{request_at, Answer, RequestFailure};

/// `Moved` answers followed in a row before giving up (ownership moving while we ask).
const MOVES_MAX: usize = 3;

/// Sends `doc` for `topic` to site `remote` (to broker `at` of it first, when known) and
/// returns the answer's document and the geo URL of the broker that answered (`None`: the
/// site's own URL), to ask there next time.
pub async fn send_sub_sync(
    link: &GeoLink,
    remote: &str,
    at: Option<String>,
    topic: &str,
    doc: bytes::Bytes,
    timeout: Duration,
) -> Result<(bytes::Bytes, Option<String>), RequestFailure> {
    let frame = Frame::SubSync {
        topic: topic.to_string(),
        doc,
    };
    let mut at = at;
    for _ in 0..=MOVES_MAX {
        match request_at(link, remote, at.as_deref(), &frame, timeout).await {
            Ok(Answer::Frame(Frame::SubSynced { doc })) => return Ok((doc, at)),
            Ok(Answer::Frame(other)) => {
                return Err(RequestFailure::Failed(format!(
                    "expected SubSynced, got {other:?}"
                )))
            }
            Ok(Answer::Moved(url)) => at = Some(url),
            // The broker asked last may be gone: the site's URL finds the owner.
            Err(RequestFailure::Failed(e)) if at.is_some() => {
                tracing::debug!(remote, topic, error = %e, "subscription sync: asking the site again");
                at = None;
            }
            Err(e) => return Err(e),
        }
    }
    Err(RequestFailure::Failed(format!(
        "{remote}: {topic} moved {MOVES_MAX} times in a row"
    )))
}
