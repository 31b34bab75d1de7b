//! A connection's outbound frames: a queue bounded in bytes between the tasks that answer
//! the client (replies, receipts, dispatchers) and the one writer task that owns the socket.
//!
//! ```text
//!  reply / receipt ── send().await (waits for room) ──┐
//!  dispatcher ─────── try_send_or_wake() (never waits) ┼─► VecDeque<Bytes> ─► writer ─► socket
//!  control frames ─── send_now() (small, never lost) ──┘        │
//!                                       drained under half ─────┴─► wakes waiting senders and
//!                                                                   the dispatchers that were
//!                                                                   refused for lack of room
//! ```
//!
//! A dispatcher holds its subscription's lock while it hands out entries, so it must never
//! wait for a client that does not read its socket: it offers each frame with
//! [`FrameSender::try_send_or_wake`], and a full queue means "this consumer has no room now";
//! the writer wakes the dispatcher once the queue has drained. The bound is in bytes
//! (`broker.connection_write_queue_bytes_max`): one frame may take the queue past it, so a
//! frame larger than the bound still goes out.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::Notify;

/// The queue is gone: the writer ended (its socket failed, or took no byte for its stall
/// bound).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the connection's writer is gone")]
pub struct Closed;

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TrySendError {
    #[error("the connection's write queue is full")]
    Full,
    #[error("the connection's writer is gone")]
    Closed,
}

struct State {
    frames: VecDeque<Bytes>,
    bytes: usize,
    senders: usize,
    /// The writer is gone: every send fails.
    closed: bool,
    /// Dispatchers refused for lack of room, woken when the queue drains.
    refused: Vec<Arc<Notify>>,
}

struct Shared {
    state: Mutex<State>,
    bytes_max: usize,
    /// Wakes the writer: a frame was queued, or the last sender left.
    frames_ready: Notify,
    /// Wakes senders waiting for room (and those waiting after `closed`).
    room: Notify,
    /// Wakes those waiting for the writer to be gone ([`FrameSender::closed`]).
    gone: Notify,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("frame queue lock")
    }
}

/// The sending side; clones share the queue. The writer ends once every sender is dropped
/// and the queue is empty.
pub struct FrameSender {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for FrameSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.shared.lock();
        f.debug_struct("FrameSender")
            .field("bytes", &st.bytes)
            .field("bytes_max", &self.shared.bytes_max)
            .field("closed", &st.closed)
            .finish()
    }
}

/// The writer's side.
pub struct FrameReceiver {
    shared: Arc<Shared>,
}

/// A queue of at most `bytes_max` bytes (plus the one frame that crossed it).
pub fn channel(bytes_max: usize) -> (FrameSender, FrameReceiver) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            frames: VecDeque::new(),
            bytes: 0,
            senders: 1,
            closed: false,
            refused: Vec::new(),
        }),
        bytes_max: bytes_max.max(1),
        frames_ready: Notify::new(),
        room: Notify::new(),
        gone: Notify::new(),
    });
    (
        FrameSender {
            shared: Arc::clone(&shared),
        },
        FrameReceiver { shared },
    )
}

impl Clone for FrameSender {
    fn clone(&self) -> Self {
        self.shared.lock().senders += 1;
        FrameSender {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl Drop for FrameSender {
    fn drop(&mut self) {
        let last = {
            let mut st = self.shared.lock();
            st.senders -= 1;
            st.senders == 0
        };
        if last {
            self.shared.frames_ready.notify_one();
        }
    }
}

impl FrameSender {
    fn push(&self, st: &mut State, frame: Bytes) {
        st.bytes += frame.len();
        st.frames.push_back(frame);
        self.shared.frames_ready.notify_one();
    }

    /// Queues `frame` once the queue is under its bound (the caller waits meanwhile).
    pub async fn send(&self, frame: Bytes) -> Result<(), Closed> {
        loop {
            // Registered before the check, so a drain between the two is not missed.
            let room = self.shared.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            {
                let mut st = self.shared.lock();
                if st.closed {
                    return Err(Closed);
                }
                if st.bytes < self.shared.bytes_max {
                    self.push(&mut st, frame);
                    return Ok(());
                }
            }
            room.await;
        }
    }

    /// Queues `frame` if the queue is under its bound, without waiting.
    pub fn try_send(&self, frame: Bytes) -> Result<(), TrySendError> {
        self.offer(frame, None)
    }

    /// As [`try_send`](Self::try_send); when the queue is full, `waker` is notified once it
    /// has drained (a dispatcher's wake-up).
    pub fn try_send_or_wake(&self, frame: Bytes, waker: &Arc<Notify>) -> Result<(), TrySendError> {
        self.offer(frame, Some(waker))
    }

    fn offer(&self, frame: Bytes, waker: Option<&Arc<Notify>>) -> Result<(), TrySendError> {
        let mut st = self.shared.lock();
        if st.closed {
            return Err(TrySendError::Closed);
        }
        if st.bytes >= self.shared.bytes_max {
            if let Some(w) = waker {
                if !st.refused.iter().any(|r| Arc::ptr_eq(r, w)) {
                    st.refused.push(Arc::clone(w));
                }
            }
            return Err(TrySendError::Full);
        }
        self.push(&mut st, frame);
        Ok(())
    }

    /// Queues a small control frame whatever the bound (CLOSE_PRODUCER,
    /// ACTIVE_CONSUMER_CHANGE, ...): it must not be lost, and its sender cannot wait.
    pub fn send_now(&self, frame: Bytes) -> Result<(), Closed> {
        let mut st = self.shared.lock();
        if st.closed {
            return Err(Closed);
        }
        self.push(&mut st, frame);
        Ok(())
    }

    /// Whether the writer is gone (its socket failed, or took no bytes for too long): every
    /// send fails.
    #[cfg(test)]
    pub fn is_closed(&self) -> bool {
        self.shared.lock().closed
    }

    /// Resolves once the writer is gone. Made once and polled many times (it does not count
    /// as a sender, so it does not keep the writer going).
    pub fn closed(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let shared = Arc::clone(&self.shared);
        async move {
            loop {
                let gone = shared.gone.notified();
                tokio::pin!(gone);
                // Registered before the check, so a close between the two is not missed.
                gone.as_mut().enable();
                if shared.lock().closed {
                    return;
                }
                gone.await;
            }
        }
    }

    /// Whether a frame offered now would be refused for lack of room.
    pub fn is_full(&self) -> bool {
        let st = self.shared.lock();
        !st.closed && st.bytes >= self.shared.bytes_max
    }

    /// Whether a frame offered now would be taken (or fail as closed); when the queue is
    /// full, `waker` is notified once it has drained.
    pub fn has_room_or_wake(&self, waker: &Arc<Notify>) -> bool {
        let mut st = self.shared.lock();
        if st.closed || st.bytes < self.shared.bytes_max {
            return true;
        }
        if !st.refused.iter().any(|r| Arc::ptr_eq(r, waker)) {
            st.refused.push(Arc::clone(waker));
        }
        false
    }

    /// Bytes queued and not yet taken by the writer.
    pub fn queued_bytes(&self) -> usize {
        self.shared.lock().bytes
    }
}

impl FrameReceiver {
    /// The next queued frame, without waiting.
    pub fn try_recv(&mut self) -> Option<Bytes> {
        let f = {
            let mut st = self.shared.lock();
            let f = st.frames.pop_front()?;
            st.bytes -= f.len();
            f
        };
        self.shared.room.notify_waiters();
        Some(f)
    }

    /// Appends queued frames to `out` until it holds at least `bytes_max` bytes or the queue
    /// is empty, waiting for the first. `false` once every sender is gone and nothing is left.
    pub async fn recv_into(&mut self, out: &mut Vec<u8>, bytes_max: usize) -> bool {
        loop {
            let ready = self.shared.frames_ready.notified();
            tokio::pin!(ready);
            ready.as_mut().enable();
            let (took, wake) = {
                let mut st = self.shared.lock();
                let mut took = false;
                while out.len() < bytes_max {
                    let Some(f) = st.frames.pop_front() else {
                        break;
                    };
                    st.bytes -= f.len();
                    out.extend_from_slice(&f);
                    took = true;
                }
                if !took && st.senders == 0 {
                    return false;
                }
                let wake = if took && st.bytes < self.shared.bytes_max / 2 {
                    std::mem::take(&mut st.refused)
                } else {
                    Vec::new()
                };
                (took, wake)
            };
            if took {
                self.shared.room.notify_waiters();
                for w in wake {
                    w.notify_one();
                }
                return true;
            }
            ready.await;
        }
    }
}

impl Drop for FrameReceiver {
    fn drop(&mut self) {
        let refused = {
            let mut st = self.shared.lock();
            st.closed = true;
            st.frames.clear();
            st.bytes = 0;
            std::mem::take(&mut st.refused)
        };
        self.shared.room.notify_waiters();
        self.shared.gone.notify_waiters();
        // Dispatchers refused here look again and find the consumer's connection gone.
        for w in refused {
            w.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn frame(n: usize) -> Bytes {
        Bytes::from(vec![7u8; n])
    }

    #[tokio::test]
    async fn given_a_full_queue_then_try_send_refuses_and_the_drain_wakes_the_refused() {
        let (tx, mut rx) = channel(100);
        tx.try_send(frame(60)).unwrap();
        tx.try_send(frame(60)).unwrap(); // crosses the bound: the frame still goes in
        let waker = Arc::new(Notify::new());
        assert_eq!(
            tx.try_send_or_wake(frame(1), &waker),
            Err(TrySendError::Full)
        );
        assert!(tx.is_full());
        assert_eq!(tx.queued_bytes(), 120);
        let woken = waker.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        let mut out = Vec::new();
        assert!(rx.recv_into(&mut out, 1 << 20).await);
        assert_eq!(out.len(), 120);
        tokio::time::timeout(Duration::from_secs(1), woken)
            .await
            .expect("the refused dispatcher is woken");
        tx.try_send(frame(10)).unwrap();
    }

    #[tokio::test]
    async fn given_a_full_queue_then_send_waits_for_room_and_control_frames_pass() {
        let (tx, mut rx) = channel(10);
        tx.send(frame(10)).await.unwrap();
        tx.send_now(frame(3)).unwrap();
        let tx2 = tx.clone();
        let waiting = tokio::spawn(async move { tx2.send(frame(5)).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "send waits while the queue is full");
        let mut out = Vec::new();
        assert!(rx.recv_into(&mut out, 1 << 20).await);
        assert_eq!(out.len(), 13);
        tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        out.clear();
        assert!(rx.recv_into(&mut out, 1 << 20).await);
        assert_eq!(out.len(), 5);
    }

    #[tokio::test]
    async fn given_every_sender_dropped_then_the_writer_drains_and_ends() {
        let (tx, mut rx) = channel(1000);
        let tx2 = tx.clone();
        tx.try_send(frame(4)).unwrap();
        drop(tx);
        tx2.try_send(frame(4)).unwrap();
        drop(tx2);
        let mut out = Vec::new();
        assert!(rx.recv_into(&mut out, 1 << 20).await);
        assert_eq!(out.len(), 8);
        assert!(!rx.recv_into(&mut out, 1 << 20).await);
    }

    #[tokio::test]
    async fn given_the_writer_gone_then_every_send_fails_and_waiters_are_released() {
        let (tx, rx) = channel(4);
        tx.try_send(frame(4)).unwrap();
        let tx2 = tx.clone();
        let waiting = tokio::spawn(async move { tx2.send(frame(1)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(rx);
        assert_eq!(
            tokio::time::timeout(Duration::from_secs(1), waiting)
                .await
                .unwrap()
                .unwrap(),
            Err(Closed)
        );
        assert_eq!(tx.try_send(frame(1)), Err(TrySendError::Closed));
        assert_eq!(tx.send_now(frame(1)), Err(Closed));
        assert!(!tx.is_full());
    }

    #[tokio::test]
    async fn closed_resolves_once_the_writer_is_gone_and_not_before() {
        let (tx, rx) = channel(4);
        let tx2 = tx.clone();
        let watching = tokio::spawn(async move { tx2.closed().await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!watching.is_finished());
        assert!(!tx.is_closed());
        drop(rx);
        tokio::time::timeout(Duration::from_secs(1), watching)
            .await
            .expect("woken when the writer went")
            .unwrap();
        assert!(tx.is_closed());
        // Already gone: at once.
        tokio::time::timeout(Duration::from_secs(1), tx.closed())
            .await
            .unwrap();
    }
}
