//! A connection's producers being closed after a CLOSE_PRODUCER, off its read loop.
//!
//! Closing a producer settles the sends it still holds (stored and answered before the
//! CLOSE_PRODUCER's SUCCESS; see [`crate::publish::Publisher::close`]), which can take a wait
//! for writable bookies of up to `broker.ledger_create_wait_ms`. The read loop hands each
//! close to a task of its own and goes on; what must come after a close waits for it, not
//! the loop:
//!
//! ```text
//!  CLOSE_PRODUCER id ─► close task: settle the sends, leave the topic, SUCCESS
//!  PRODUCER (same id, or same topic) ─► out to wait (crate::warmup), then handled as before
//!  SEND / CLOSE_PRODUCER for an id being closed ─► answered by a task once the close is done
//!  the connection's end ─► waits for every close
//! ```

use std::collections::HashMap;
use std::future::Future;

use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::sync::watch;

/// One close under way: its producer's topic, and a receiver whose sender the close task
/// drops when it is done (however it ends).
struct Close {
    topic: String,
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
    /// Runs `close` (which answers the CLOSE_PRODUCER itself) in a task of its own for
    /// producer `id` of `topic` (its full name).
    pub fn start(
        &mut self,
        id: u64,
        topic: String,
        close: impl Future<Output = ()> + Send + 'static,
    ) {
        self.by_id.retain(|_, c| !c.finished());
        let (tx, done) = watch::channel(());
        tokio::spawn(async move {
            let _done = tx;
            close.await;
        });
        self.by_id.insert(id, Close { topic, done });
    }

    /// Until the close of producer `id` is done, if one is under way.
    pub fn of(&self, id: u64) -> Option<BoxFuture<'static, ()>> {
        self.by_id
            .get(&id)
            .filter(|c| !c.finished())
            .map(Close::wait)
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

    /// Closes under way: they count against the connection's producers and consumers.
    pub fn len(&self) -> usize {
        self.by_id.values().filter(|c| !c.finished()).count()
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

    #[tokio::test]
    async fn given_closes_under_way_then_what_follows_them_waits_for_exactly_those() {
        let mut closing = Closing::default();
        let (release, held) = tokio::sync::oneshot::channel::<()>();
        closing.start(1, "t1".into(), async move {
            let _ = held.await;
        });
        closing.start(2, "t2".into(), async {});
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(closing.len(), 1, "the second close is done");
        assert!(closing.of(2).is_none());
        assert!(closing.before(3, Some("t3")).is_none());
        assert!(closing.before(2, Some("t2")).is_none());
        let by_id = closing.before(1, None).expect("the same id waits");
        let by_topic = closing.before(3, Some("t1")).expect("the same topic waits");
        let of = closing.of(1).expect("under way");
        let waits = futures::future::join3(by_id, by_topic, of);
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
        assert_eq!(closing.len(), 0);
        closing.finish().await;
    }

    #[tokio::test]
    async fn given_a_close_that_panics_then_it_counts_as_done() {
        let mut closing = Closing::default();
        closing.start(1, "t".into(), async { panic!("a close that fails") });
        tokio::time::timeout(Duration::from_secs(5), closing.finish())
            .await
            .expect("finish returns");
        assert_eq!(closing.len(), 0);
    }
}
