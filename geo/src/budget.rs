//! What a peer's link may hold at this site: the bytes of frames read from its streams and not
//! yet durable (`geo.receive_bytes_max`, all its streams together; one stream an eighth of it),
//! and beside it an eighth for streams' first frames (Open, Delete, Sync) until they are
//! answered, so a new stream is never queued behind data.
//!
//! ```text
//!  stream reader: length ─► StreamBudget::hold(len) ─► body ─► submit ─► durable ─► Held dropped
//!                           (the stream's share, then the link's; waits while either is full,
//!                            and the peer waits with it through QUIC's flow control)
//!  first frame:   length ─► StreamBudget::hold_first(len) ─► body ─► answered ─► Held dropped
//! ```
//!
//! Whatever the backlog at the peer and however many streams it opens, what its frames hold
//! here stays under the budget and the first frames' eighth. A stream whose appends are slow
//! holds at most its share: appends stuck in eight topics at once fill the link's budget, and
//! the others then wait until those complete or fail.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Counted in KiB (a semaphore's permits are `u32` a request).
const UNIT: u64 = 1024;

/// A stream's share of its link's budget (and the first frames' budget beside it).
pub const STREAM_SHARE_DIVISOR: u64 = 8;

/// One peer connection's budget.
#[derive(Clone)]
pub struct ReceiveBudget {
    link: Arc<Semaphore>,
    /// Streams' first frames, until answered.
    first: Arc<Semaphore>,
    link_units: u32,
    stream_units: u32,
    site: String,
}

impl ReceiveBudget {
    /// A budget of `bytes` (at least one unit) for the connection of peer `site`.
    pub fn new(bytes: u64, site: &str) -> ReceiveBudget {
        let link_units = u32::try_from((bytes / UNIT).max(1)).unwrap_or(u32::MAX);
        let link_units = link_units.min(Semaphore::MAX_PERMITS as u32);
        let stream_units = (link_units / STREAM_SHARE_DIVISOR as u32).max(1);
        ReceiveBudget {
            link: Arc::new(Semaphore::new(link_units as usize)),
            first: Arc::new(Semaphore::new(stream_units as usize)),
            link_units,
            stream_units,
            site: site.to_string(),
        }
    }

    /// The budget of one of the connection's streams.
    pub fn stream(&self) -> StreamBudget {
        StreamBudget {
            own: Arc::new(Semaphore::new(self.stream_units as usize)),
            link: self.clone(),
        }
    }

    /// Bytes free in the link's budget now.
    pub fn available_bytes(&self) -> u64 {
        self.link.available_permits() as u64 * UNIT
    }
}

/// A stream's share of its link's budget.
pub struct StreamBudget {
    own: Arc<Semaphore>,
    link: ReceiveBudget,
}

/// Room for one frame, given back when dropped (once its entries are durable, or refused).
pub struct Held {
    _own: OwnedSemaphorePermit,
    _link: Option<OwnedSemaphorePermit>,
    bytes: u64,
    site: String,
}

impl Drop for Held {
    fn drop(&mut self) {
        metrics::gauge!("meridian_geo_receive_held_bytes", "site" => self.site.clone())
            .decrement(self.bytes as f64);
    }
}

/// A frame's length in the budget's units.
fn units_of(len: usize) -> u32 {
    u32::try_from((len as u64).div_ceil(UNIT)).unwrap_or(u32::MAX)
}

impl StreamBudget {
    /// Waits for room for a frame of `len` bytes: the stream's share first (so a stream
    /// waiting for its own share holds none of the link's), then the link's. A frame larger
    /// than a share takes the whole share.
    pub async fn hold(&self, len: usize) -> Held {
        let units = units_of(len);
        let share = units.min(self.link.stream_units);
        let own = self.take(&self.own, share, "stream").await;
        let whole = units.min(self.link.link_units);
        let link = self.take(&self.link.link, whole, "link").await;
        self.held(own, Some(link), len)
    }

    /// Waits for room for a stream's first frame of `len` bytes in the first frames' budget
    /// (a frame larger than it takes all of it).
    pub async fn hold_first(&self, len: usize) -> Held {
        let share = units_of(len).min(self.link.stream_units);
        let permit = self.take(&self.link.first, share, "first").await;
        self.held(permit, None, len)
    }

    /// `units` of `budget`, at once if they are free, else counted as a wait and awaited.
    async fn take(
        &self,
        budget: &Arc<Semaphore>,
        units: u32,
        name: &'static str,
    ) -> OwnedSemaphorePermit {
        if let Ok(p) = Arc::clone(budget).try_acquire_many_owned(units) {
            return p;
        }
        self.waited(name);
        Arc::clone(budget)
            .acquire_many_owned(units)
            .await
            .expect("a receive budget is never closed")
    }

    fn held(
        &self,
        own: OwnedSemaphorePermit,
        link: Option<OwnedSemaphorePermit>,
        len: usize,
    ) -> Held {
        metrics::gauge!("meridian_geo_receive_held_bytes", "site" => self.link.site.clone())
            .increment(len as f64);
        Held {
            _own: own,
            _link: link,
            bytes: len as u64,
            site: self.link.site.clone(),
        }
    }

    fn waited(&self, budget: &'static str) {
        metrics::counter!(
            "meridian_geo_receive_budget_waits_total",
            "site" => self.link.site.clone(),
            "budget" => budget
        )
        .increment(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const K: usize = 1024;

    async fn blocked(f: impl std::future::Future<Output = Held>) -> bool {
        tokio::time::timeout(Duration::from_millis(50), f)
            .await
            .is_err()
    }

    #[tokio::test]
    async fn given_a_full_share_or_link_then_a_frame_waits_until_room_is_given_back() {
        // 128 KiB for the link: 16 KiB a stream.
        let budget = ReceiveBudget::new(128 * 1024, "west");
        let a = budget.stream();
        let first = a.hold(10 * K).await;
        assert_eq!(budget.available_bytes(), 118 * 1024);
        // The stream's share has 6 KiB left: an 8 KiB frame waits for the first.
        assert!(blocked(a.hold(8 * K)).await, "over the stream's share");
        drop(first);
        let second = a.hold(8 * K).await;
        assert_eq!(budget.available_bytes(), 120 * 1024);
        // Other streams take the rest of the link, then wait.
        let others: Vec<_> = (0..7).map(|_| budget.stream()).collect();
        let mut held = Vec::new();
        for s in &others {
            held.push(s.hold(16 * K).await);
        }
        assert_eq!(budget.available_bytes(), 8 * 1024);
        let ninth = budget.stream();
        assert!(blocked(ninth.hold(9 * K)).await, "over the link's budget");
        // A new stream's first frame does not wait behind them.
        let opening = budget.stream().hold_first(K).await;
        drop(second);
        let _ok = ninth.hold(9 * K).await;
        drop(held);
        drop(opening);
        assert_eq!(budget.available_bytes(), 119 * 1024);
    }

    #[tokio::test]
    async fn given_first_frames_then_they_have_a_budget_of_their_own() {
        let budget = ReceiveBudget::new(128 * 1024, "west");
        let a = budget.stream().hold_first(12 * K).await;
        assert_eq!(
            budget.available_bytes(),
            128 * 1024,
            "the link's is untouched"
        );
        assert!(blocked(budget.stream().hold_first(8 * K)).await);
        drop(a);
        let _b = budget.stream().hold_first(8 * K).await;
    }

    #[tokio::test]
    async fn given_a_frame_larger_than_a_share_then_it_takes_the_share_and_still_fits() {
        let budget = ReceiveBudget::new(128 * 1024, "west");
        let s = budget.stream();
        let big = s.hold(40 * K).await;
        assert_eq!(budget.available_bytes(), 88 * 1024);
        drop(big);
        assert_eq!(budget.available_bytes(), 128 * 1024);
        let first = s.hold_first(40 * K).await;
        drop(first);
    }
}
