//! The receiving end of a topic's stream: what a peer site sends is appended here, and
//! acknowledged only once durable.
//!
//! ```text
//!  sender                        receiver (this site)
//!  Open{topic, partitions} ───►  ReplicaSink::open: allowed? owned here? ─► Opened{last}
//!                                                                   else ─► Refused{code, why}
//!  Entries{..} ──────────────►  each entry shaped (the site's form, checked) as it is read,
//!  Entries{..} ──────────────►    then ReplicaTopic::submit (drops what it already holds,
//!  ...  (up to 16 frames queued)   queues the appends) ─► in order, once durable ─► Ack{up_to}
//! ```
//!
//! Every entry is shaped, also one of a range sent again that the site already holds: one
//! the shaper refuses ends the stream even then.
//!
//! The stream reads the next frame while the ones before it are being made durable, and
//! acknowledges them in order as they are; a refusal from either ends the stream after the
//! acknowledgements of what did land. A frame's body is read only once the link's receive
//! budget has room for it ([`crate::budget`]), held until its entries are durable.
//!
//! The site behind the traits decides what is a duplicate: the highest origin position it
//! holds per (topic, origin site) is stored with the data, so a range sent again after a
//! reconnect, a restart or a move of the topic is dropped, not appended twice.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tracing::{debug, info, warn};

use crate::budget::{Held, ReceiveBudget, StreamBudget};
use crate::frame::{Frame, OriginPosition, RefusalCode, ReplicatedEntry};
use crate::inflow::{read_shaped, AsSent, EntryShaper, Shaped};
use crate::link::{read_frame_body, read_frame_len, write_frame, StreamError};

/// Why a stream is not served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: RefusalCode,
    pub reason: String,
}

impl Refusal {
    pub fn new(code: RefusalCode, reason: impl Into<String>) -> Self {
        Refusal {
            code,
            reason: reason.into(),
        }
    }
}

/// The site's side of receiving: opening a topic for a peer's entries.
pub trait ReplicaSink: Send + Sync + 'static {
    /// Opens `topic` (`partitions` at the origin; 0: not partitioned) for entries from site
    /// `origin`: the topic, and the highest origin position it holds from `origin`.
    #[allow(clippy::type_complexity)]
    fn open<'a>(
        &'a self,
        origin: &'a str,
        topic: &'a str,
        partitions: u32,
    ) -> BoxFuture<'a, Result<(Box<dyn ReplicaTopic>, Option<OriginPosition>), Refusal>>;

    /// Site `origin` deleted `topic` at `deleted_at_ms`: delete it here too (idempotently)
    /// and keep it from being re-created by late replicated entries.
    fn delete<'a>(
        &'a self,
        origin: &'a str,
        topic: &'a str,
        deleted_at_ms: u64,
    ) -> BoxFuture<'a, Result<(), Refusal>> {
        let _ = (origin, topic, deleted_at_ms);
        Box::pin(async {
            Err(Refusal::new(
                RefusalCode::NotAllowed,
                "this site takes no deletions",
            ))
        })
    }

    /// Site `origin`'s acknowledgements of its replicated subscriptions of `topic` (`doc`):
    /// apply them where the topic is owned here; the answer's document.
    fn sub_sync<'a>(
        &'a self,
        origin: &'a str,
        topic: &'a str,
        doc: bytes::Bytes,
    ) -> BoxFuture<'a, Result<bytes::Bytes, Refusal>> {
        let _ = (origin, topic, doc);
        Box::pin(async {
            Err(Refusal::new(
                RefusalCode::NotAllowed,
                "this site takes no replicated subscriptions",
            ))
        })
    }

    /// Site `origin`'s copies of the global objects it shares with this site (`doc`, see
    /// [`crate::metasync`]): merge them; how many changed here and how many were not taken.
    fn sync<'a>(
        &'a self,
        origin: &'a str,
        doc: bytes::Bytes,
    ) -> BoxFuture<'a, Result<(u32, u32), Refusal>> {
        let _ = (origin, doc);
        Box::pin(async {
            Err(Refusal::new(
                RefusalCode::NotAllowed,
                "this site takes no global objects",
            ))
        })
    }
}

/// Completes once a frame's entries are durable: the highest origin position held from the
/// stream's origin then.
pub type Durable = BoxFuture<'static, Result<Option<OriginPosition>, Refusal>>;

/// A topic open for a peer's entries.
pub trait ReplicaTopic: Send + Sync {
    /// Queues the appends of the entries it does not hold yet, in order, and returns once
    /// they are queued, with what completes once they are durable. Frames submitted one after
    /// another complete in that order, and none completes well after one before it failed.
    fn submit(&self, entries: Vec<ReplicatedEntry>) -> BoxFuture<'_, Result<Durable, Refusal>>;

    /// What this topic's entries become as their bytes come off the stream; `submit` gets
    /// them in that form. By default each is kept as sent.
    fn shaper(&self) -> Arc<dyn EntryShaper> {
        Arc::new(AsSent)
    }
}

/// Frames of a stream queued at once, at most (the sender keeps fewer in flight).
pub const FRAMES_IN_FLIGHT: usize = 16;

/// Frames of a stream read ahead of the one being checked and queued.
const READ_AHEAD_FRAMES: usize = 1;

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn refuse(send: &mut quinn::SendStream, r: Refusal) {
    let frame = Frame::Refused {
        code: r.code,
        reason: r.reason,
    };
    let _ = write_frame(send, &frame).await;
    let _ = send.finish();
}

/// Reads a stream's first frame once the first frames' budget has room for it.
async fn read_first(
    recv: &mut quinn::RecvStream,
    max: u64,
    budget: &StreamBudget,
) -> Result<Option<(Frame, Held)>, StreamError> {
    let Some(len) = read_frame_len(recv, max).await? else {
        return Ok(None);
    };
    let held = budget.hold_first(len).await;
    Ok(Some((read_frame_body(recv, len, true).await?, held)))
}

/// Reads the stream's next frame once its budget has room for it, its entries shaped into
/// the topic's form as they come.
async fn read_held(
    recv: &mut quinn::RecvStream,
    max: u64,
    budget: &StreamBudget,
    shaper: &dyn EntryShaper,
) -> Result<Option<(Shaped, Held)>, StreamError> {
    let Some(len) = read_frame_len(recv, max).await? else {
        return Ok(None);
    };
    let held = budget.hold(len).await;
    Ok(Some((read_shaped(recv, len, shaper).await?, held)))
}

/// Serves one topic stream of `origin` until it ends, breaks, or is refused. What its frames
/// hold until they are durable is counted in `budget` (the peer connection's).
pub async fn serve_stream(
    sink: &dyn ReplicaSink,
    origin: &str,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    frame_bytes_max: u64,
    open_timeout: Duration,
    budget: &ReceiveBudget,
) {
    let budget = budget.stream();
    let first = match tokio::time::timeout(
        open_timeout,
        read_first(&mut recv, frame_bytes_max, &budget),
    )
    .await
    {
        // Its room is held until it is answered.
        Ok(Ok(Some(f))) => f,
        Ok(Ok(None)) => return,
        Ok(Err(e)) => {
            warn!(origin, error = %e, "geo stream closed: a bad first frame");
            return;
        }
        Err(_) => {
            warn!(
                origin,
                "geo stream closed: no Open within {open_timeout:?} (or no room for it in geo.receive_bytes_max)"
            );
            return;
        }
    };
    let (first, first_held) = first;
    let (topic, partitions) = match first {
        Frame::Open { topic, partitions } => (topic, partitions),
        Frame::Delete {
            topic,
            deleted_at_ms,
        } => {
            match sink.delete(origin, &topic, deleted_at_ms).await {
                Ok(()) => {
                    info!(origin, topic, "deleted: the topic was deleted at {origin}");
                    let _ = write_frame(&mut send, &Frame::Deleted).await;
                    let _ = send.finish();
                }
                Err(r) => {
                    warn!(origin, topic, reason = %r.reason, "geo deletion refused");
                    refuse(&mut send, r).await;
                }
            }
            return;
        }
        Frame::Sync { doc } => {
            match sink.sync(origin, doc).await {
                Ok((changed, skipped)) => {
                    // Skipped ones come with every resend (a tenant that does not allow this
                    // site): said at info only when something changed.
                    if changed > 0 {
                        info!(
                            origin,
                            changed, skipped, "global objects merged from {origin}"
                        );
                    } else if skipped > 0 {
                        debug!(origin, skipped, "global objects from {origin}: none taken");
                    }
                    let _ = write_frame(&mut send, &Frame::Synced { changed, skipped }).await;
                    let _ = send.finish();
                }
                Err(r) => {
                    warn!(origin, reason = %r.reason, "global objects refused");
                    refuse(&mut send, r).await;
                }
            }
            return;
        }
        Frame::SubSync { topic, doc } => {
            match sink.sub_sync(origin, &topic, doc).await {
                Ok(doc) => {
                    let _ = write_frame(&mut send, &Frame::SubSynced { doc }).await;
                    let _ = send.finish();
                }
                Err(r) => {
                    if r.code == RefusalCode::Moved {
                        debug!(origin, topic, owner = %r.reason, "subscription sync: the topic is served elsewhere");
                    } else {
                        warn!(origin, topic, reason = %r.reason, "subscription sync refused");
                    }
                    refuse(&mut send, r).await;
                }
            }
            return;
        }
        _ => {
            let r = Refusal::new(
                RefusalCode::Protocol,
                "a stream begins with Open, Delete, Sync or SubSync",
            );
            refuse(&mut send, r).await;
            return;
        }
    };
    let (target, last) = match sink.open(origin, &topic, partitions).await {
        Ok(x) => x,
        Err(r) => {
            warn!(origin, topic, reason = %r.reason, "geo stream refused");
            refuse(&mut send, r).await;
            return;
        }
    };
    drop(first_held);
    let opened = Frame::Opened {
        last,
        frame_bytes_max,
    };
    if write_frame(&mut send, &opened).await.is_err() {
        return;
    }
    debug!(origin, topic, ?last, "geo stream open");
    // The acknowledging half: frames' completions in order, an Ack for each that lands; the
    // first refusal ends the stream.
    let (queued, mut completions) = tokio::sync::mpsc::channel::<Durable>(FRAMES_IN_FLIGHT);
    let acks = {
        let (origin, topic) = (origin.to_string(), topic.clone());
        async move {
            while let Some(done) = completions.recv().await {
                match done.await {
                    Ok(Some(up_to)) => {
                        if write_frame(&mut send, &Frame::Ack { up_to }).await.is_err() {
                            return;
                        }
                    }
                    Ok(None) => {}
                    Err(r) => {
                        warn!(origin, topic, reason = %r.reason, "geo stream refused");
                        refuse(&mut send, r).await;
                        return;
                    }
                }
            }
        }
    };
    // The stream's bytes are read by a task of their own, a frame ahead of the one being
    // checked and queued (a read is not cancel-safe): a frame is read only once there is
    // room for it.
    let (read_tx, mut read_rx) = tokio::sync::mpsc::channel(READ_AHEAD_FRAMES);
    let shaper = target.shaper();
    let reader = tokio::spawn(async move {
        loop {
            let Ok(room) = read_tx.reserve().await else {
                return;
            };
            let r = read_held(&mut recv, frame_bytes_max, &budget, &*shaper).await;
            // A frame stopped at a refused entry leaves the rest of its bytes unread: nothing
            // after it on the stream can be read as a frame.
            let more = matches!(r, Ok(Some((Shaped::Frame(_), _))));
            room.send(r);
            if !more {
                return;
            }
        }
    });
    let _reader = AbortOnDrop(reader);
    let reads = async move {
        loop {
            let frame = match read_rx.recv().await {
                Some(Ok(Some(f))) => f,
                Some(Ok(None)) | None => return,
                Some(Err(e)) => {
                    warn!(origin, topic, error = %e, "geo stream closed");
                    return;
                }
            };
            let (frame, held) = frame;
            let (done, last): (Durable, bool) = match frame {
                Shaped::Frame(Frame::Entries { items }) => match target.submit(items).await {
                    // The frame's room is given back once its entries are durable.
                    Ok(d) => (
                        Box::pin(async move {
                            let r = d.await;
                            drop(held);
                            r
                        }),
                        false,
                    ),
                    Err(r) => (Box::pin(async move { Err(r) }), true),
                },
                Shaped::Refused { at, reason } => {
                    let r = Refusal::new(
                        RefusalCode::Protocol,
                        format!("entry {}:{} of site {origin} {reason}", at.ledger, at.entry),
                    );
                    (Box::pin(async move { Err(r) }), true)
                }
                Shaped::Frame(_) => {
                    let r = Refusal::new(RefusalCode::Protocol, "expected Entries");
                    (Box::pin(async move { Err(r) }), true)
                }
            };
            // A refusal is the last thing queued; the acknowledging half ends the stream.
            if queued.send(done).await.is_err() || last {
                return;
            }
        }
    };
    // The reading half ends when the stream does, or when the acknowledging half stopped
    // taking completions (it refused, or the peer went away).
    let mut acks = tokio::spawn(acks);
    tokio::select! {
        _ = reads => {
            let _ = acks.await;
        }
        _ = &mut acks => {}
    }
}
