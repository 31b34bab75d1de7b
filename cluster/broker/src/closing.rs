//! A connection's producers being closed after a CLOSE_PRODUCER, off its read loop.
//!
//! Closing a producer settles the sends it still holds (stored and answered before the
//! CLOSE_PRODUCER's SUCCESS; see [`crate::publish::Publisher::close`]), which can take a wait
//! for writable bookies of up to `broker.ledger_create_wait_ms`. The read loop hands each
//! close to a task of its own and goes on; what must come after a close waits for it, not
//! the loop:
//!
//! ```text
//!  CLOSE_PRODUCER id ─► close task: settle the sends, leave the topic, SUCCESS, then the
//!                        answers deferred meanwhile, in order
//!  PRODUCER (same id, or same topic) ─► out to wait (crate::warmup), then handled as before
//!  SEND / CLOSE_PRODUCER for an id being closed ─► its answer deferred to the close task
//!  the connection's end ─► waits for every close
//! ```
//!
//! At most [`CLOSES_MAX`] closes run apart per connection; past that, a close runs in the
//! loop as it did before (the client's backpressure).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::sync::watch;

use crate::frame_queue::FrameSender;

/// Closes a connection may run apart from its loop at once.
pub(crate) const CLOSES_MAX: usize = 16;

/// Answers waiting for a close (`None` once the close task has sent them all).
type Deferred = Arc<Mutex<Option<Vec<Bytes>>>>;

/// One close under way: its producer's topic, the answers deferred to it, and a receiver
/// whose sender the close task drops when it is done (however it ends).
struct Close {
    topic: String,
    deferred: Deferred,
    done: watch::Receiver<()>,
}

impl Close {
    fn finished(&self) -> bool {
        self.done.has_changed().is_err()
    }

    fn wait(&self) -> BoxFuture<'static, ()> {
        let mut done = self.done.clone();
        // Never sent on: this ends when the sender is dropped.
        async move { while done.changed().await.is_ok() {} }.boxed()
    }
}

/// The producers of one connection being closed, by producer id.
#[derive(Default)]
pub(crate) struct Closing {
    by_id: HashMap<u64, Close>,
}

impl Closing {
    /// Whether another close may run apart (the finished ones forgotten).
    pub fn has_room(&mut self) -> bool {
        self.by_id.retain(|_, c| !c.finished());
        self.by_id.len() < CLOSES_MAX
    }

    /// Runs `close` in a task of its own for producer `id` of `topic` (its full name); once
    /// it is done the task sends `answer` (the CLOSE_PRODUCER's SUCCESS) and then the answers
    /// deferred to it, on `tx`.
    pub fn start(
        &mut self,
        id: u64,
        topic: String,
        close: impl Future<Output = ()> + Send + 'static,
        answer: Bytes,
        tx: FrameSender,
    ) {
        self.by_id.retain(|_, c| !c.finished());
        let (done_tx, done) = watch::channel(());
        let deferred: Deferred = Arc::new(Mutex::new(Some(Vec::new())));
        let later = Arc::clone(&deferred);
        tokio::spawn(async move {
            let _done = done_tx;
            // A close that panics leaves its CLOSE_PRODUCER unanswered (logged); the answers
            // deferred to it are still sent.
            match std::panic::AssertUnwindSafe(close).catch_unwind().await {
                Ok(()) => {
                    let _ = tx.send(answer).await;
                }
                Err(_) => {
                    tracing::error!(producer = id, "a producer's close failed (it panicked); its CLOSE_PRODUCER is not answered");
                }
            }
            // Until none is left: one deferred while these were being sent is sent too; after
            // the last, the next ones are answered at once, so none overtakes these.
            loop {
                let next = {
                    let mut d = later.lock().expect("deferred lock");
                    match d.as_mut().map(std::mem::take) {
                        Some(v) if !v.is_empty() => v,
                        _ => {
                            *d = None;
                            break;
                        }
                    }
                };
                for f in next {
                    let _ = tx.send(f).await;
                }
            }
        });
        self.by_id.insert(
            id,
            Close {
                topic,
                deferred,
                done,
            },
        );
    }

    /// Defers `answer` (to a SEND or CLOSE_PRODUCER of producer `id`) until the close of `id`
    /// has answered, if one is under way; else gives it back, to be sent now.
    pub fn defer(&self, id: u64, answer: Bytes) -> Result<(), Bytes> {
        let Some(c) = self.by_id.get(&id).filter(|c| !c.finished()) else {
            return Err(answer);
        };
        match c.deferred.lock().expect("deferred lock").as_mut() {
            Some(v) => {
                v.push(answer);
                Ok(())
            }
            None => Err(answer),
        }
    }

    /// What a new producer `id` on `topic` (its full name) waits for: the closes under way of
    /// that id (it is reused) or on that topic (the closed producer leaves the topic only at
    /// its close's end: a new one of the same name, or an exclusive one, would be refused
    /// before that).
    pub fn before(&self, id: u64, topic: Option<&str>) -> Option<BoxFuture<'static, ()>> {
        let waits: Vec<_> = self
            .by_id
            .iter()
            .filter(|(i, c)| !c.finished() && (**i == id || Some(c.topic.as_str()) == topic))
            .map(|(_, c)| c.wait())
            .collect();
        (!waits.is_empty()).then(|| futures::future::join_all(waits).map(|_| ()).boxed())
    }

    /// The connection ended: until every close is done.
    pub async fn finish(&mut self) {
        for (_, c) in self.by_id.drain() {
            c.wait().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn answer(n: u8) -> Bytes {
        Bytes::from(vec![n])
    }

    /// A close held until the returned sender is used (or dropped).
    fn held() -> (
        tokio::sync::oneshot::Sender<()>,
        impl Future<Output = ()> + Send + 'static,
    ) {
        let (release, held) = tokio::sync::oneshot::channel::<()>();
        (release, async move {
            let _ = held.await;
        })
    }

    #[tokio::test]
    async fn given_closes_under_way_then_what_follows_them_waits_for_exactly_those() {
        let mut closing = Closing::default();
        let (tx, _rx) = crate::frame_queue::channel(1 << 20);
        let (release, close) = held();
        closing.start(1, "t1".into(), close, answer(1), tx.clone());
        closing.start(2, "t2".into(), async {}, answer(2), tx);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(closing.has_room());
        assert_eq!(closing.by_id.len(), 1, "the second close is done");
        assert!(closing.before(3, Some("t3")).is_none());
        assert!(closing.before(2, Some("t2")).is_none());
        let by_id = closing.before(1, None).expect("the same id waits");
        let by_topic = closing.before(3, Some("t1")).expect("the same topic waits");
        let waits = futures::future::join(by_id, by_topic);
        tokio::pin!(waits);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut waits)
                .await
                .is_err(),
            "done before the close"
        );
        release.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), waits)
            .await
            .expect("done once the close is");
        closing.finish().await;
    }

    #[tokio::test]
    async fn given_answers_deferred_to_a_close_then_they_follow_its_own_in_order() {
        let mut closing = Closing::default();
        let (tx, mut rx) = crate::frame_queue::channel(1 << 20);
        let (release, close) = held();
        closing.start(7, "t".into(), close, answer(0), tx.clone());
        for n in 1..=3 {
            closing.defer(7, answer(n)).expect("deferred");
        }
        assert_eq!(closing.defer(8, answer(9)), Err(answer(9)), "no close of 8");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(rx.try_recv().is_none(), "answered before the close");
        release.send(()).unwrap();
        closing.finish().await;
        let got: Vec<u8> = std::iter::from_fn(|| rx.try_recv()).map(|f| f[0]).collect();
        assert_eq!(got, [0, 1, 2, 3]);
        closing.start(7, "t".into(), async {}, answer(0), tx);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            closing.defer(7, answer(1)),
            Err(answer(1)),
            "done: sent now"
        );
    }

    #[tokio::test]
    async fn given_more_closes_than_may_run_apart_then_there_is_no_room() {
        let mut closing = Closing::default();
        let (tx, _rx) = crate::frame_queue::channel(1 << 20);
        let mut releases = Vec::new();
        for id in 0..CLOSES_MAX as u64 {
            assert!(closing.has_room());
            let (release, close) = held();
            releases.push(release);
            closing.start(id, "t".into(), close, answer(0), tx.clone());
        }
        assert!(!closing.has_room());
        drop(releases);
        closing.finish().await;
        assert!(closing.has_room());
    }

    #[tokio::test]
    async fn given_a_close_that_panics_then_it_counts_as_done_and_what_waited_for_it_is_answered() {
        let mut closing = Closing::default();
        let (tx, mut rx) = crate::frame_queue::channel(1 << 20);
        let (release, held) = tokio::sync::oneshot::channel::<()>();
        closing.start(
            1,
            "t".into(),
            async move {
                let _ = held.await;
                panic!("a close that fails")
            },
            answer(0),
            tx,
        );
        closing.defer(1, answer(1)).expect("deferred");
        release.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), closing.finish())
            .await
            .expect("finish returns");
        assert!(closing.has_room());
        let got: Vec<u8> = std::iter::from_fn(|| rx.try_recv()).map(|f| f[0]).collect();
        assert_eq!(got, [1], "the deferred answer, not the close's own");
    }
}
