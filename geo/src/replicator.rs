//! The sending end: one replicator per (topic, remote site), in the broker that owns the
//! topic. It reads the topic's log through a durable cursor (the site's [`ReplicaSource`]),
//! sends what was produced here on the topic's own stream, and moves the cursor only when the
//! remote acknowledges a durable append.
//!
//! ```text
//!  loop: peer link (shared per remote site) ─► open stream ─► Open ─► Opened{last}
//!        rewind the source to after its acknowledged position
//!        ┌─ window of `window_frames` Entries frames in flight ◄── Ack{up_to} (reader task)
//!        └─ source.available() / wait_for_more()
//!  on any failure: state Disconnected{reason}, back-off with jitter (doubling to a bound),
//!  again; a refusal (not allowed here) waits the longest back-off.
//! ```
//!
//! Entries that arrived here by replication are not sent on (full mesh, no loops): they are
//! acknowledged with the batch around them.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use crate::frame::{Frame, OriginPosition, RefusalCode, ReplicatedEntry};
use crate::link::{read_frame, write_frame, GeoLink};

/// An entry of the topic's log, as the source reads it.
#[derive(Debug, Clone)]
pub struct SourceEntry {
    pub at: OriginPosition,
    pub bytes: bytes::Bytes,
    /// Produced at this site (sent); false for an entry that arrived by replication.
    pub send: bool,
}

/// The topic's log through the replicator's durable cursor.
pub trait ReplicaSource: Send + 'static {
    /// Reading starts again after the last position marked [`done`](Self::done).
    fn rewind(&mut self) -> BoxFuture<'_, Result<(), String>>;
    /// The next entries after the read position, at most `max`, without waiting (maybe none).
    fn available(&mut self, max: usize) -> BoxFuture<'_, Result<Vec<SourceEntry>, String>>;
    /// Waits until the log may hold more (cancel-safe).
    fn wait_for_more(&mut self) -> BoxFuture<'_, ()>;
    /// Everything up to `pos` is done: the remote holds it, or it is not to be sent.
    fn done(&mut self, pos: OriginPosition) -> BoxFuture<'_, Result<(), String>>;
    /// Called before each attempt to connect (so at least every back-off while the remote
    /// is unreachable): the source applies what it was asked meanwhile, such as dropping
    /// its oldest entries under a replication backlog quota.
    fn settle(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

/// What a replicator is doing, for stats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkState {
    Connecting,
    Connected,
    /// Not connected since then, and why.
    Disconnected {
        since_ms: u64,
        reason: String,
    },
    /// Entries were in flight and no acknowledgement came for `stall_after`: the stream is
    /// being rebuilt.
    Stalled {
        since_ms: u64,
        reason: String,
    },
}

#[derive(Debug, Clone)]
pub struct ReplicatorStatus {
    pub state: LinkState,
    /// The last origin position the remote acknowledged.
    pub last_acked: Option<OriginPosition>,
    /// Entries sent and acknowledged since the replicator started.
    pub entries_acked: u64,
}

impl Default for ReplicatorStatus {
    fn default() -> Self {
        ReplicatorStatus {
            state: LinkState::Connecting,
            last_acked: None,
            entries_acked: 0,
        }
    }
}

/// A replicator's limits.
#[derive(Debug, Clone)]
pub struct ReplicatorOptions {
    /// Entries frames sent and not yet acknowledged, at most.
    pub window_frames: usize,
    /// Entries read from the log at a time.
    pub batch_entries: usize,
    /// Bytes of one Entries frame, at most (an entry larger than this goes alone).
    pub frame_bytes: usize,
    pub backoff_min: Duration,
    /// The longest wait between two attempts while the remote is unreachable (short: a
    /// healed partition is used again at once).
    pub backoff_max: Duration,
    /// The wait after the remote refused the stream (its configuration must change first).
    pub refused_wait: Duration,
    /// How long the remote may take to answer Open.
    pub open_timeout: Duration,
    /// Entries in flight and no acknowledgement for this long: STALLED, the stream is rebuilt.
    pub stall_after: Duration,
}

impl Default for ReplicatorOptions {
    fn default() -> Self {
        ReplicatorOptions {
            window_frames: 8,
            batch_entries: 256,
            frame_bytes: 4 << 20,
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_secs(1),
            refused_wait: Duration::from_secs(10),
            open_timeout: Duration::from_secs(10),
            stall_after: Duration::from_secs(30),
        }
    }
}

/// How a stall's reason begins.
pub const STALLED: &str = "STALLED";

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Runs one replicator until `stop` turns true.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    link: Arc<GeoLink>,
    remote: String,
    topic: String,
    partitions: u32,
    source: &mut impl ReplicaSource,
    status: Arc<Mutex<ReplicatorStatus>>,
    opts: ReplicatorOptions,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = opts.backoff_min;
    // The broker of the remote site that serves the topic, once the site said which.
    let mut at: Option<String> = None;
    // Redirections in a row: past a few (brokers disagreeing while the topic moves), the
    // back-off applies.
    let mut moves = 0u32;
    loop {
        if *stop.borrow() {
            return;
        }
        source.settle().await;
        let started = Instant::now();
        let outcome = tokio::select! {
            r = session(&link, &remote, &mut at, &topic, partitions, source, &status, &opts) => r,
            _ = stop.wait_for(|s| *s) => return,
        };
        let (reason, refused) = match outcome {
            Ok(()) => return,
            Err(e) if e.0.starts_with(MOVED) && moves < 3 => {
                // Open it at the broker named, at once.
                moves += 1;
                info!(topic, remote, reason = %e.0, "replicator redirected");
                continue;
            }
            Err(e) => e,
        };
        moves = 0;
        warn!(topic, remote, reason = %reason, "replicator disconnected; trying again");
        let since_ms = now_ms();
        status.lock().expect("status lock").state = if reason.starts_with(STALLED) {
            metrics::counter!("meridian_replication_stalls_total", "remote" => remote.clone())
                .increment(1);
            LinkState::Stalled {
                since_ms,
                reason: reason.clone(),
            }
        } else {
            LinkState::Disconnected {
                since_ms,
                reason: reason.clone(),
            }
        };
        if started.elapsed() > Duration::from_secs(30) {
            backoff = opts.backoff_min;
        }
        let wait = if refused {
            opts.refused_wait
        } else {
            // Jitter: between half and all of the back-off.
            let half = backoff / 2;
            half + Duration::from_millis(rand_below(half.as_millis() as u64 + 1))
        };
        backoff = (backoff * 2).min(opts.backoff_max);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// A cheap jitter source (no need for a cryptographic one).
fn rand_below(n: u64) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos() as u64);
    nanos.wrapping_mul(6364136223846793005) % n.max(1)
}

/// A batch sent in one or more frames: the last sent position (None: nothing in it to send)
/// and the batch's last position, done once every frame up to it is acknowledged.
struct InFlight {
    last_sent: Option<OriginPosition>,
    batch_last: OriginPosition,
    frames: usize,
    entries: u64,
}

type SessionError = (String, bool);

/// How a session that was sent to another broker of the remote site ends.
const MOVED: &str = "moved";

#[allow(clippy::too_many_arguments)]
async fn session(
    link: &GeoLink,
    remote: &str,
    at: &mut Option<String>,
    topic: &str,
    partitions: u32,
    source: &mut impl ReplicaSource,
    status: &Mutex<ReplicatorStatus>,
    opts: &ReplicatorOptions,
) -> Result<(), SessionError> {
    let err = |e: String| (e, false);
    let peer = match at.as_deref() {
        Some(url) => match link.peer_at(remote, url).await {
            Ok(p) => p,
            Err(e) => {
                // The broker named is gone: ask the site again.
                *at = None;
                return Err(err(e.to_string()));
            }
        },
        None => link.peer(remote).await.map_err(|e| err(e.to_string()))?,
    };
    let (mut send, mut recv) = tokio::time::timeout(opts.open_timeout, peer.conn.open_bi())
        .await
        .map_err(|_| {
            err(format!(
                "no stream to {remote} within {:?}",
                opts.open_timeout
            ))
        })?
        .map_err(|e| err(format!("opening the topic's stream: {e}")))?;
    // Bounded as the answer is: a remote whose connection grants no flow-control credit (its
    // other streams' bytes unread) would otherwise hold this write, and the replicator, for
    // ever (QUIC's idle timeout ends only a silent connection).
    let open = Frame::Open {
        topic: topic.to_string(),
        partitions,
    };
    tokio::time::timeout(opts.open_timeout, write_frame(&mut send, &open))
        .await
        .map_err(|_| {
            err(format!(
                "could not send Open within {:?}",
                opts.open_timeout
            ))
        })?
        .map_err(|e| err(e.to_string()))?;
    let max = link.frame_bytes_max();
    let answer = tokio::time::timeout(opts.open_timeout, read_frame(&mut recv, max))
        .await
        .map_err(|_| err(format!("no answer to Open within {:?}", opts.open_timeout)))?
        .map_err(|e| err(e.to_string()))?;
    let remote_max = match answer {
        Some(Frame::Opened {
            last,
            frame_bytes_max,
        }) => {
            info!(topic, remote, ?last, "replicator connected");
            frame_bytes_max as usize
        }
        Some(Frame::Refused {
            code: RefusalCode::Moved,
            reason,
        }) => {
            if at.as_deref() == Some(reason.as_str()) {
                // Sent back to where it is: the site is moving the topic; ask it again.
                *at = None;
                return Err(err(format!("{remote} is moving {topic}")));
            }
            let to = format!("{MOVED}: {remote} serves {topic} at {reason}");
            *at = Some(reason);
            return Err(err(to));
        }
        Some(Frame::Refused { code, reason }) => {
            // Any other answer: the site's own address decides next time.
            *at = None;
            return Err((
                format!("refused by {remote}: {reason}"),
                code != RefusalCode::Retry,
            ));
        }
        other => return Err(err(format!("expected Opened, got {other:?}"))),
    };
    // A frame's own bytes beside its entries': length, kind, count. Frames are cut at
    // `frame_bytes`; an entry larger than that (up to the remote's limit) goes alone.
    let remote_limit = remote_max.saturating_sub(16);
    let frame_limit = opts.frame_bytes.min(remote_limit);
    let deadline = opts.stall_after;
    let stalled = || {
        err(format!(
            "{STALLED}: the remote takes no more bytes for {deadline:?}; the stream is rebuilt"
        ))
    };
    source.rewind().await.map_err(err)?;
    status.lock().expect("status lock").state = LinkState::Connected;

    // Acknowledgements are read by a task of their own (a read is not cancel-safe).
    let (ack_tx, mut acks) = mpsc::channel::<Result<OriginPosition, String>>(64);
    let reader = tokio::spawn(async move {
        loop {
            let msg = match read_frame(&mut recv, max).await {
                Ok(Some(Frame::Ack { up_to })) => Ok(up_to),
                Ok(Some(Frame::Refused { reason, .. })) => Err(format!("refused: {reason}")),
                Ok(Some(other)) => Err(format!("unexpected frame {other:?}")),
                Ok(None) => Err("the remote ended the stream".to_string()),
                Err(e) => Err(e.to_string()),
            };
            let end = msg.is_err();
            if ack_tx.send(msg).await.is_err() || end {
                return;
            }
        }
    });
    let _reader = AbortOnDrop(reader);

    let mut in_flight: VecDeque<InFlight> = VecDeque::new();
    let mut frames_in_flight = 0usize;
    // When the last acknowledgement came (or the first frame of an idle window went out).
    let mut last_progress: Option<tokio::time::Instant> = None;
    loop {
        // Send while the window has room and the log has entries.
        while frames_in_flight < opts.window_frames {
            let batch = source.available(opts.batch_entries).await.map_err(err)?;
            let Some(batch_last) = batch.last().map(|e| e.at) else {
                break;
            };
            let mut last_sent = None;
            let mut frame: Vec<ReplicatedEntry> = Vec::new();
            let mut frame_bytes = 0usize;
            let mut frames = 0usize;
            let mut entries = 0u64;
            for e in batch.into_iter().filter(|e| e.send) {
                let size = e.bytes.len() + 20;
                if size > remote_limit {
                    return Err((
                        format!(
                            "entry {}:{} of {} bytes is over {remote}'s frame limit of {remote_max} bytes (geo.frame_bytes_max there)",
                            e.at.ledger,
                            e.at.entry,
                            e.bytes.len()
                        ),
                        true,
                    ));
                }
                if !frame.is_empty() && frame_bytes + size > frame_limit {
                    let f = Frame::Entries {
                        items: std::mem::take(&mut frame),
                    };
                    tokio::time::timeout(deadline, write_frame(&mut send, &f))
                        .await
                        .map_err(|_| stalled())?
                        .map_err(|e| err(e.to_string()))?;
                    frames += 1;
                    frame_bytes = 0;
                }
                entries += 1;
                frame_bytes += size;
                last_sent = Some(e.at);
                frame.push(ReplicatedEntry {
                    at: e.at,
                    bytes: e.bytes,
                });
            }
            if !frame.is_empty() {
                let f = Frame::Entries { items: frame };
                tokio::time::timeout(deadline, write_frame(&mut send, &f))
                    .await
                    .map_err(|_| stalled())?
                    .map_err(|e| err(e.to_string()))?;
                frames += 1;
            }
            if in_flight.is_empty() {
                last_progress = Some(tokio::time::Instant::now());
            }
            frames_in_flight += frames;
            if last_sent.is_none() && in_flight.is_empty() {
                source.done(batch_last).await.map_err(err)?;
            } else {
                in_flight.push_back(InFlight {
                    last_sent,
                    batch_last,
                    frames,
                    entries,
                });
            }
        }
        let stall = async {
            match last_progress {
                Some(at) if !in_flight.is_empty() => {
                    tokio::time::sleep_until(at + opts.stall_after).await
                }
                _ => futures::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = stall => {
                return Err(err(format!(
                    "{STALLED}: entries in flight and no acknowledgement for {:?}; the stream is rebuilt",
                    opts.stall_after
                )));
            }
            ack = acks.recv() => {
                last_progress = Some(tokio::time::Instant::now());
                let up_to = match ack {
                    Some(Ok(p)) => p,
                    Some(Err(e)) => return Err(err(e)),
                    None => return Err(err("the stream's reader stopped".to_string())),
                };
                let mut done = None;
                let mut acked = 0u64;
                while let Some(f) = in_flight.front() {
                    if f.last_sent.is_some_and(|s| s > up_to) {
                        break;
                    }
                    let f = in_flight.pop_front().expect("front exists");
                    frames_in_flight = frames_in_flight.saturating_sub(f.frames);
                    done = Some(f.batch_last);
                    acked += f.entries;
                }
                if let Some(d) = done {
                    source.done(d).await.map_err(err)?;
                    let mut st = status.lock().expect("status lock");
                    st.last_acked = Some(up_to);
                    st.entries_acked += acked;
                }
            }
            _ = source.wait_for_more(), if frames_in_flight < opts.window_frames => {}
        }
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
