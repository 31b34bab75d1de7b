//! A topic's producers and their access modes, after Pulsar:
//!
//! - **Shared**: any number, unless an exclusive producer holds the topic.
//! - **Exclusive**: only when no other producer is attached; refused otherwise
//!   (ProducerFenced against an exclusive holder, ProducerBusy against shared ones).
//! - **WaitForExclusive**: like Exclusive, but instead of failing it waits in line; the broker
//!   answers PRODUCER_SUCCESS with `producer_ready = false` at once and again, ready, when the
//!   topic is free.
//! - **ExclusiveWithFencing**: takes the topic at once; every other producer is fenced
//!   (closed by the broker, and refused when it comes back with an older epoch).
//!
//! Every grant of exclusive access raises the topic epoch (kept in the metadata store, so
//! fencing survives restarts). A producer that comes back with an epoch older than the topic's
//! is refused with ProducerFenced.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use meridian_protocol::pb::ServerError;
use meridian_protocol::{cmd, encode_command};
use tokio::sync::oneshot;

use super::BrokerError;

/// How a producer shares its topic (CommandProducer.producer_access_mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessMode {
    Shared,
    Exclusive,
    WaitForExclusive,
    ExclusiveWithFencing,
}

impl AccessMode {
    pub fn from_wire(v: i32) -> Option<AccessMode> {
        Some(match v {
            0 => AccessMode::Shared,
            1 => AccessMode::Exclusive,
            2 => AccessMode::WaitForExclusive,
            3 => AccessMode::ExclusiveWithFencing,
            _ => return None,
        })
    }

    pub fn is_exclusive(self) -> bool {
        self != AccessMode::Shared
    }
}

/// Where a producer lives: its id on its connection (whose receipt task writes to it).
pub struct ProducerSink {
    pub producer_id: u64,
}

/// One attached (or waiting) producer.
pub struct ProducerHandle {
    pub name: String,
    pub mode: AccessMode,
    sink: ProducerSink,
    fenced: AtomicBool,
    /// False while a WaitForExclusive producer is in line: its sends are refused until the
    /// topic is granted to it.
    granted: AtomicBool,
    /// A send of it failed to be stored: no later send is stored until the client has
    /// reconnected and sends again from the failed one (else they would overtake it).
    broken: AtomicBool,
    /// Its CLOSE_PRODUCER went out (for being broken off, fenced or closed): once only.
    close_told: AtomicBool,
    /// Fenced or closed by the broker: its receipt task sends CLOSE_PRODUCER once the sends
    /// before are answered (a permit, so one before the task starts is not missed).
    closing: tokio::sync::Notify,
    /// Closed by the broker (the topic unloaded, deleted, over quota or terminated), not
    /// fenced by another producer: sends still in flight from before the client saw
    /// CLOSE_PRODUCER are dropped unanswered, as Pulsar does for a closing topic, and the
    /// client sends them again once it has reconnected.
    closed_by_broker: AtomicBool,
}

impl ProducerHandle {
    pub fn is_closed_by_broker(&self) -> bool {
        self.closed_by_broker.load(Ordering::Acquire)
    }

    /// Fenced by an ExclusiveWithFencing producer: its sends are refused.
    pub fn is_fenced(&self) -> bool {
        // SeqCst with the receipt task's count of sends being submitted: a send that finds
        // the producer not fenced is counted before the task looks (publish.rs).
        self.fenced.load(Ordering::SeqCst)
    }

    /// Whether the producer may publish (a WaitForExclusive producer only once granted).
    pub fn is_granted(&self) -> bool {
        self.granted.load(Ordering::Acquire)
    }

    /// A send failed to be stored: later sends are refused. The client is told to reconnect
    /// (CLOSE_PRODUCER, after which it sends again from the failed one, in order) by the
    /// receipt task once it has answered every earlier send ([`Self::take_break_notice`]):
    /// a stock client drops receipts that come after a CLOSE_PRODUCER, and one re-created
    /// before any receipt reached it numbers its next messages again over ids it has given
    /// to messages still pending.
    pub fn break_off(&self) {
        self.broken.store(true, Ordering::Release);
    }

    /// True the first time it is called on a broken producer, unless its CLOSE_PRODUCER
    /// went out already: the caller sends it ([`Self::close_frame`]).
    pub fn take_break_notice(&self) -> bool {
        self.is_broken() && self.take_close_notice()
    }

    /// True the first time: the caller sends its CLOSE_PRODUCER.
    pub fn take_close_notice(&self) -> bool {
        !self.close_told.swap(true, Ordering::AcqRel)
    }

    /// CLOSE_PRODUCER for this producer.
    pub fn close_frame(&self) -> bytes::Bytes {
        let mut b = BytesMut::new();
        encode_command(&mut b, &cmd::close_producer(self.sink.producer_id, 0));
        b.freeze()
    }

    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Closed by the broker (its topic unloaded, terminated or over quota): its sends are
    /// refused from now on, without an answer, and it is told as a fenced one is.
    fn close_by_broker(&self) {
        self.closed_by_broker.store(true, Ordering::Release);
        self.fence();
    }

    /// Until the producer is fenced or closed by the broker ([`Self::fence`]).
    pub async fn fenced_notice(&self) {
        self.closing.notified().await
    }

    /// Fenced (by an ExclusiveWithFencing producer, or closed by the broker): its sends are
    /// refused from now on, and its receipt task tells the client (CLOSE_PRODUCER) once every
    /// send submitted before is answered: a stock client drops receipts that come after a
    /// CLOSE_PRODUCER. Once only.
    fn fence(&self) {
        if !self.fenced.swap(true, Ordering::SeqCst) {
            self.closing.notify_one();
        }
    }
}

/// The outcome of attaching a producer.
pub enum Admission {
    /// Attached; `epoch` is the topic epoch granted to an exclusive producer.
    Ready {
        handle: Arc<ProducerHandle>,
        epoch: Option<u64>,
    },
    /// In line for exclusive access: `ready` yields the epoch once granted.
    Waiting {
        handle: Arc<ProducerHandle>,
        ready: oneshot::Receiver<u64>,
    },
}

#[derive(Default)]
struct Inner {
    by_name: HashMap<String, Arc<ProducerHandle>>,
    exclusive: Option<String>,
    epoch: u64,
    waiting: VecDeque<(Arc<ProducerHandle>, oneshot::Sender<u64>)>,
    /// The topic stopped serving here (unloaded, or being deleted): no producer attaches any
    /// more (those attached stay until [`Producers::close_all`]).
    closed: bool,
}

impl Inner {
    fn grant(&mut self, handle: &Arc<ProducerHandle>, requested: Option<u64>) -> u64 {
        if requested != Some(self.epoch) {
            self.epoch += 1;
        }
        self.exclusive = Some(handle.name.clone());
        self.by_name.insert(handle.name.clone(), Arc::clone(handle));
        handle.granted.store(true, Ordering::Release);
        self.epoch
    }

    /// Hands the topic to the first waiter still there, if the topic is free.
    fn promote(&mut self) -> Option<u64> {
        while self.exclusive.is_none() && self.by_name.is_empty() {
            let (h, tx) = self.waiting.pop_front()?;
            let epoch = self.grant(&h, None);
            if tx.send(epoch).is_ok() {
                return Some(epoch);
            }
            // The waiter's connection is gone.
            self.by_name.remove(&h.name);
            self.exclusive = None;
        }
        None
    }
}

/// The registry of one topic.
#[derive(Default)]
pub struct Producers {
    inner: Mutex<Inner>,
}

impl Producers {
    pub fn new(epoch: u64) -> Producers {
        Producers {
            inner: Mutex::new(Inner {
                epoch,
                ..Inner::default()
            }),
        }
    }

    /// The current topic epoch.
    pub fn epoch(&self) -> u64 {
        self.lock().epoch
    }

    pub fn count(&self) -> usize {
        self.lock().by_name.len()
    }

    /// Whether a producer of this name is attached or in line.
    pub fn is_attached(&self, name: &str) -> bool {
        let g = self.lock();
        g.by_name.contains_key(name) || g.waiting.iter().any(|(h, _)| h.name == name)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("producers lock")
    }

    /// Attaches a producer named `name` (generated or given) in `mode`; `requested_epoch` is
    /// the epoch a returning exclusive producer held; at most `max` producers (0: no limit).
    pub fn add(
        &self,
        name: String,
        mode: AccessMode,
        requested_epoch: Option<u64>,
        sink: ProducerSink,
        topic: &str,
        max: usize,
    ) -> Result<Admission, BrokerError> {
        let mut g = self.lock();
        if g.closed {
            // The client looks the topic up again and finds where it is served now.
            return Err(BrokerError::new(
                ServerError::ServiceNotReady,
                format!("{topic} is being unloaded or deleted on this broker; look it up again"),
            ));
        }
        if max > 0 && g.by_name.len() + g.waiting.len() >= max {
            return Err(BrokerError::new(
                ServerError::ProducerBusy,
                format!(
                    "{topic} has reached its limit of {max} producers (max_producers_per_topic)"
                ),
            ));
        }
        if g.by_name.contains_key(&name) || g.waiting.iter().any(|(h, _)| h.name == name) {
            return Err(BrokerError::new(
                ServerError::ProducerBusy,
                format!("producer {name:?} is already connected to {topic}"),
            ));
        }
        if mode.is_exclusive() {
            if let Some(e) = requested_epoch.filter(|e| *e < g.epoch) {
                return Err(BrokerError::new(
                    ServerError::ProducerFenced,
                    format!(
                        "producer {name:?} was fenced: its epoch {e} is older than {topic}'s {}",
                        g.epoch
                    ),
                ));
            }
        }
        let handle = Arc::new(ProducerHandle {
            name: name.clone(),
            mode,
            sink,
            fenced: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            close_told: AtomicBool::new(false),
            closing: tokio::sync::Notify::new(),
            closed_by_broker: AtomicBool::new(false),
            granted: AtomicBool::new(mode != AccessMode::WaitForExclusive),
        });
        let busy = |g: &Inner| -> Option<BrokerError> {
            if let Some(x) = &g.exclusive {
                return Some(BrokerError::new(
                    ServerError::ProducerFenced,
                    format!("{topic} has an exclusive producer, {x:?}"),
                ));
            }
            if !g.by_name.is_empty() {
                return Some(BrokerError::new(
                    ServerError::ProducerBusy,
                    format!(
                        "{topic} has {} shared producers; exclusive access needs none",
                        g.by_name.len()
                    ),
                ));
            }
            None
        };
        match mode {
            AccessMode::Shared => {
                if let Some(x) = &g.exclusive {
                    return Err(BrokerError::new(
                        ServerError::ProducerBusy,
                        format!("{topic} has an exclusive producer, {x:?}"),
                    ));
                }
                g.by_name.insert(name, Arc::clone(&handle));
                Ok(Admission::Ready {
                    handle,
                    epoch: None,
                })
            }
            AccessMode::Exclusive => match busy(&g) {
                Some(e) => Err(e),
                None => {
                    let epoch = g.grant(&handle, requested_epoch);
                    Ok(Admission::Ready {
                        handle,
                        epoch: Some(epoch),
                    })
                }
            },
            AccessMode::WaitForExclusive => {
                if busy(&g).is_none() && g.waiting.is_empty() {
                    let epoch = g.grant(&handle, requested_epoch);
                    return Ok(Admission::Ready {
                        handle,
                        epoch: Some(epoch),
                    });
                }
                let (tx, ready) = oneshot::channel();
                g.waiting.push_back((Arc::clone(&handle), tx));
                Ok(Admission::Waiting { handle, ready })
            }
            AccessMode::ExclusiveWithFencing => {
                for (_, other) in g.by_name.drain() {
                    other.fence();
                }
                g.exclusive = None;
                let epoch = g.grant(&handle, None);
                Ok(Admission::Ready {
                    handle,
                    epoch: Some(epoch),
                })
            }
        }
    }

    /// Closes every producer (the topic was terminated); their sends are refused.
    pub fn fence_all(&self) {
        let mut g = self.lock();
        for (_, p) in g.by_name.drain() {
            p.close_by_broker();
        }
        g.exclusive = None;
    }

    /// No producer attaches from now on; those attached stay (a deletion without `--force`
    /// counts them next, under the same lock as `add`, so none slips in between).
    pub fn refuse_new(&self) {
        self.lock().closed = true;
    }

    /// Closes every producer, those in line too, and refuses new ones (the topic is
    /// unloaded): a producer that came in after [`fence_all`](Self::fence_all) would be
    /// left on an instance of the topic nothing serves any more.
    pub fn close_all(&self) {
        let mut g = self.lock();
        g.closed = true;
        for (_, p) in g.by_name.drain() {
            p.close_by_broker();
        }
        for (p, _) in g.waiting.drain(..) {
            p.close_by_broker();
        }
        g.exclusive = None;
    }

    /// Detaches a producer (or takes it out of line); the next waiter may get the topic.
    /// Returns the epoch granted to a promoted waiter.
    pub fn remove(&self, handle: &Arc<ProducerHandle>) -> Option<u64> {
        let mut g = self.lock();
        if g.by_name
            .get(&handle.name)
            .is_some_and(|h| Arc::ptr_eq(h, handle))
        {
            g.by_name.remove(&handle.name);
            if g.exclusive.as_deref() == Some(handle.name.as_str()) {
                g.exclusive = None;
            }
        }
        g.waiting.retain(|(h, _)| !Arc::ptr_eq(h, handle));
        g.promote()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sink(id: u64) -> ProducerSink {
        ProducerSink { producer_id: id }
    }

    fn add(p: &Producers, name: &str, mode: AccessMode) -> Result<Admission, BrokerError> {
        p.add(name.into(), mode, None, sink(1), "t", 0)
    }

    #[test]
    fn given_a_limit_then_producers_beyond_it_are_busy() {
        let p = Producers::default();
        for n in ["a", "b"] {
            ready(p.add(n.into(), AccessMode::Shared, None, sink(1), "t", 2));
        }
        let e = p.add("c".into(), AccessMode::Shared, None, sink(1), "t", 2);
        assert_eq!(code(e), ServerError::ProducerBusy);
    }

    fn ready(a: Result<Admission, BrokerError>) -> (Arc<ProducerHandle>, Option<u64>) {
        match a {
            Ok(Admission::Ready { handle, epoch }) => (handle, epoch),
            Ok(Admission::Waiting { .. }) => panic!("waiting, not ready"),
            Err(e) => panic!("refused: {e}"),
        }
    }

    fn code(a: Result<Admission, BrokerError>) -> ServerError {
        match a {
            Err(e) => e.code,
            Ok(_) => panic!("admitted"),
        }
    }

    #[test]
    fn given_shared_producers_then_exclusive_is_busy_and_names_are_unique() {
        let p = Producers::default();
        ready(add(&p, "a", AccessMode::Shared));
        ready(add(&p, "b", AccessMode::Shared));
        assert_eq!(
            code(add(&p, "a", AccessMode::Shared)),
            ServerError::ProducerBusy
        );
        assert_eq!(
            code(add(&p, "x", AccessMode::Exclusive)),
            ServerError::ProducerBusy
        );
        assert_eq!(p.count(), 2);
    }

    #[test]
    fn given_an_exclusive_producer_then_others_are_refused_until_it_leaves() {
        let p = Producers::default();
        let (x, epoch) = ready(add(&p, "x", AccessMode::Exclusive));
        assert_eq!(epoch, Some(1));
        assert_eq!(
            code(add(&p, "s", AccessMode::Shared)),
            ServerError::ProducerBusy
        );
        assert_eq!(
            code(add(&p, "y", AccessMode::Exclusive)),
            ServerError::ProducerFenced
        );
        p.remove(&x);
        let (_, epoch) = ready(add(&p, "y", AccessMode::Exclusive));
        assert_eq!(epoch, Some(2));
    }

    #[test]
    fn given_waiters_then_they_get_the_topic_in_order_when_it_frees() {
        let p = Producers::default();
        let (x, _) = ready(add(&p, "x", AccessMode::Exclusive));
        let Ok(Admission::Waiting {
            handle: w1,
            ready: mut r1,
        }) = add(&p, "w1", AccessMode::WaitForExclusive)
        else {
            panic!("w1 waits")
        };
        let Ok(Admission::Waiting { ready: mut r2, .. }) =
            add(&p, "w2", AccessMode::WaitForExclusive)
        else {
            panic!("w2 waits")
        };
        assert!(r1.try_recv().is_err());
        assert!(x.is_granted());
        assert!(
            !w1.is_granted(),
            "a waiter may not publish before its grant"
        );
        assert_eq!(p.remove(&x), Some(2));
        assert_eq!(r1.try_recv().unwrap(), 2);
        assert!(w1.is_granted());
        assert!(r2.try_recv().is_err(), "w2 still waits behind w1");
        assert_eq!(p.remove(&w1), Some(3));
        assert_eq!(r2.try_recv().unwrap(), 3);
    }

    #[test]
    fn given_a_waiter_whose_connection_left_then_the_next_one_is_promoted() {
        let p = Producers::default();
        let (x, _) = ready(add(&p, "x", AccessMode::Exclusive));
        let Ok(Admission::Waiting { ready: r1, .. }) = add(&p, "w1", AccessMode::WaitForExclusive)
        else {
            panic!()
        };
        let Ok(Admission::Waiting { ready: mut r2, .. }) =
            add(&p, "w2", AccessMode::WaitForExclusive)
        else {
            panic!()
        };
        drop(r1);
        assert!(p.remove(&x).is_some());
        assert!(r2.try_recv().is_ok());
        assert_eq!(p.count(), 1);
    }

    #[test]
    fn given_new_producers_refused_then_those_attached_stay_and_a_fencing_one_fences_nobody() {
        let p = Producers::default();
        let a = ready(p.add("a".into(), AccessMode::Shared, None, sink(1), "t", 0)).0;
        p.refuse_new();
        let refused = p.add(
            "f".into(),
            AccessMode::ExclusiveWithFencing,
            None,
            sink(2),
            "t",
            0,
        );
        assert_eq!(code(refused), ServerError::ServiceNotReady);
        assert!(
            !a.is_fenced(),
            "the attached producer was fenced by a refused one"
        );
        assert_eq!(p.count(), 1);
    }

    #[test]
    fn given_fencing_then_everyone_else_is_closed_and_old_epochs_are_refused() {
        let p = Producers::default();
        let a = ready(p.add("a".into(), AccessMode::Shared, None, sink(7), "t", 0)).0;
        let (old, old_epoch) = ready(p.add(
            "f0".into(),
            AccessMode::ExclusiveWithFencing,
            None,
            sink(2),
            "t",
            0,
        ));
        assert!(a.is_fenced());
        use futures::FutureExt;
        assert!(
            a.fenced_notice().now_or_never().is_some(),
            "the fenced producer's receipt task is told to send its CLOSE_PRODUCER"
        );
        assert!(a.fenced_notice().now_or_never().is_none(), "once only");
        let (_, epoch) = ready(p.add(
            "f1".into(),
            AccessMode::ExclusiveWithFencing,
            None,
            sink(3),
            "t",
            0,
        ));
        assert!(old.is_fenced());
        assert!(epoch > old_epoch);
        // The first fencer comes back with its old epoch: refused.
        let again = p.add(
            "f0b".into(),
            AccessMode::Exclusive,
            old_epoch,
            sink(4),
            "t",
            0,
        );
        assert_eq!(code(again), ServerError::ProducerFenced);
    }
}
