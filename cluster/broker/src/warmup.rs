//! A PRODUCER or SUBSCRIBE whose topic is not loaded here (or whose durable subscription is
//! not open: its cursor ledger may need recovering) waits for that off its connection's loop;
//! so does a PRODUCER behind a close under way of the same id or on the same topic
//! ([`crate::closing`]).
//!
//! A load can take seconds (the previous owner's ledger is recovered, a cursor's ledger too),
//! and the stock clients share one connection per broker: a loop that waited would leave
//! every other command of the connection unanswered meanwhile (its PINGs, its LOOKUPs, other
//! producers' SENDs), until the client's operation timeout or keep-alive gave up on the whole
//! connection. So the loop hands the command to a task that loads the topic and recovers the
//! subscription's cursor ledger (opening and creating nothing), and handles it once they are
//! ready, as it would have at once. At most [`WARMING_MAX`] tasks per connection; past that,
//! and for a producer or consumer id already attached, the command is handled at once as
//! before. A connection waits for its tasks when it ends, as it waited for a load before.
//!
//! ```text
//!  PRODUCER / SUBSCRIBE ─► authorized, topic not loaded (or subscription not open)?
//!      yes ─► ticket (per producer or consumer id) ─► task: load, recover ─► Warmed ─► loop:
//!               CLOSE_PRODUCER / CLOSE_CONSUMER meanwhile cancels the tickets out
//!               load failed ─► the error answers the request; else the command is handled
//!      no  ─► handled now
//! ```

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use futures::future::BoxFuture;
use meridian_protocol::pb::base_command::Type;
use meridian_protocol::Frame;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::broker::{Broker, BrokerError};
use crate::topic_name::TopicName;

/// Warm-up tasks a connection may have at once.
pub(crate) const WARMING_MAX: usize = 16;

/// A command back from its warm-up.
pub(crate) struct Warmed {
    pub frame: Frame,
    pub ticket: u64,
    /// The load's error, which answers the request.
    pub failed: Option<BrokerError>,
}

/// What a PRODUCER or SUBSCRIBE attaches to.
pub(crate) struct Target {
    pub producer: bool,
    /// The producer's or consumer's id.
    pub id: u64,
    pub request_id: u64,
    pub topic: String,
    /// Created by the load if it does not exist (a consumer may ask that it is not).
    pub create: bool,
    /// A durable subscription whose cursor ledger is recovered with the topic's load.
    pub subscription: Option<String>,
}

impl Target {
    /// The target of a PRODUCER or SUBSCRIBE frame (none for other commands, or one missing
    /// its body: handled, and refused, as usual).
    pub fn of(f: &Frame) -> Option<Target> {
        let c = &f.command;
        match Type::try_from(c.r#type).ok()? {
            Type::Producer => {
                let p = c.producer.as_ref()?;
                Some(Target {
                    producer: true,
                    id: p.producer_id,
                    request_id: p.request_id,
                    topic: p.topic.clone(),
                    create: true,
                    subscription: None,
                })
            }
            Type::Subscribe => {
                let s = c.subscribe.as_ref()?;
                Some(Target {
                    producer: false,
                    id: s.consumer_id,
                    request_id: s.request_id,
                    topic: s.topic.clone(),
                    create: s.force_topic_creation.unwrap_or(true),
                    subscription: (s.durable.unwrap_or(true) && !s.subscription.is_empty())
                        .then(|| s.subscription.clone()),
                })
            }
            _ => None,
        }
    }
}

/// A connection's commands out for their warm-up.
pub(crate) struct Warming {
    tx: mpsc::UnboundedSender<Warmed>,
    next_ticket: u64,
    /// Tickets out, by producer id and by consumer id.
    producers: HashMap<u64, Vec<u64>>,
    consumers: HashMap<u64, Vec<u64>>,
    /// Tickets whose producer or consumer the client closed while they were out.
    cancelled: HashSet<u64>,
    tasks: JoinSet<()>,
}

impl Warming {
    pub fn new() -> (Warming, mpsc::UnboundedReceiver<Warmed>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let w = Warming {
            tx,
            next_ticket: 0,
            producers: HashMap::new(),
            consumers: HashMap::new(),
            cancelled: HashSet::new(),
            tasks: JoinSet::new(),
        };
        (w, rx)
    }

    /// Whether another task may start (the finished ones reaped).
    pub fn has_room(&mut self) -> bool {
        while self.tasks.try_join_next().is_some() {}
        self.tasks.len() < WARMING_MAX
    }

    /// The connection ended: waits for its tasks (what they load stays loaded; nothing
    /// attaches).
    pub async fn finish(mut self) {
        while self.tasks.join_next().await.is_some() {}
    }

    /// Commands out (they count against the connection's producers and consumers).
    pub fn len(&self) -> usize {
        self.producers.values().map(Vec::len).sum::<usize>()
            + self.consumers.values().map(Vec::len).sum::<usize>()
    }

    /// Whether `name` needs a warm-up before `target` attaches: its topic is not loaded, or
    /// its durable subscription is not open (or is being opened).
    pub fn needed(broker: &Broker, name: &TopicName, target: &Target) -> bool {
        let Some(topic) = broker.loaded_topic(name) else {
            return true;
        };
        match &target.subscription {
            Some(sub) => !topic.has_open_subscription(sub),
            None => false,
        }
    }

    /// Sends `frame` out to load its topic (and recover its subscription's cursor ledger),
    /// once `after` is done (a close under way, [`crate::closing`]); it comes back through
    /// the receiver.
    pub fn start(
        &mut self,
        broker: Arc<Broker>,
        name: TopicName,
        target: Target,
        frame: Frame,
        after: Option<BoxFuture<'static, ()>>,
    ) {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let ids = if target.producer {
            &mut self.producers
        } else {
            &mut self.consumers
        };
        ids.entry(target.id).or_default().push(ticket);
        let tx = self.tx.clone();
        self.tasks.spawn(async move {
            if let Some(after) = after {
                after.await;
            }
            let failed = warm(&broker, &name, &target).await.err();
            // The connection may be gone: then nothing attaches.
            let _ = tx.send(Warmed {
                frame,
                ticket,
                failed,
            });
        });
    }

    /// The client closed this producer (or consumer): its commands out attach nothing.
    pub fn cancel(&mut self, producer: bool, id: u64) {
        let ids = if producer {
            &mut self.producers
        } else {
            &mut self.consumers
        };
        if let Some(tickets) = ids.remove(&id) {
            self.cancelled.extend(tickets);
        }
    }

    /// `w` is back: whether it still attaches (not cancelled meanwhile).
    pub fn returned(&mut self, w: &Warmed, target: &Target) -> bool {
        let ids = if target.producer {
            &mut self.producers
        } else {
            &mut self.consumers
        };
        if let Some(tickets) = ids.get_mut(&target.id) {
            tickets.retain(|t| *t != w.ticket);
            if tickets.is_empty() {
                ids.remove(&target.id);
            }
        }
        !self.cancelled.remove(&w.ticket)
    }
}

/// Loads the topic and recovers the durable subscription's cursor ledger if it is not open
/// (a failure there is left to the command itself, which says why).
async fn warm(broker: &Broker, name: &TopicName, target: &Target) -> Result<(), BrokerError> {
    let topic = broker.topic(name, target.create).await?;
    if let Some(sub) = &target.subscription {
        if let Err(e) = topic.recover_subscription_ledger(sub).await {
            tracing::debug!(topic = %name, subscription = %sub, error = %e, "recovering the subscription's cursor ledger ahead of its consumer failed; the SUBSCRIBE tries again");
        }
    }
    Ok(())
}
