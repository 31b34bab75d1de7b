//! Rate limits: token buckets by messages and bytes per second, sans-IO (the caller passes the
//! time and sleeps for the wait it is given).
//!
//! A bucket holds at most one second of its rate and starts empty, so a producer held to `R`
//! messages per second sends `R` per second from its first second on. Taking more than the
//! bucket holds is allowed and leaves it in debt: the caller waits until the debt is repaid.
//! A batch of 1,000 messages therefore passes a limit of 100 per second, and the next send
//! waits ten seconds. Over any long window the rate is the limit.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use meridian_tenancy::model::RateLimit;

/// The longest a debt can make a limiter wait, seconds.
pub const DEBT_SECONDS_MAX: f64 = 60.0;

/// A token bucket over messages and bytes (a limit of 0 is none).
#[derive(Debug)]
pub struct RateLimiter {
    limit: RateLimit,
    state: Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    msgs: f64,
    bytes: f64,
    at: Instant,
}

impl RateLimiter {
    /// A limiter for `limit`, or none when it limits nothing.
    pub fn new(limit: &RateLimit, now: Instant) -> Option<Self> {
        if limit.is_unlimited() {
            return None;
        }
        Some(RateLimiter {
            limit: limit.clone(),
            state: Mutex::new(Bucket {
                msgs: 0.0,
                bytes: 0.0,
                at: now,
            }),
        })
    }

    pub fn limit(&self) -> &RateLimit {
        &self.limit
    }

    fn refill(&self, b: &mut Bucket, now: Instant) {
        // Callers may pass instants taken a little earlier: time never runs back.
        if now <= b.at {
            return;
        }
        let dt = now.duration_since(b.at).as_secs_f64();
        b.at = now;
        let m = self.limit.msgs_per_sec as f64;
        let y = self.limit.bytes_per_sec as f64;
        b.msgs = (b.msgs + m * dt).min(m);
        b.bytes = (b.bytes + y * dt).min(y);
    }

    /// How long the bucket's debt takes to repay (zero when it is not in debt).
    fn debt(&self, b: &Bucket) -> Duration {
        let mut wait: f64 = 0.0;
        if self.limit.msgs_per_sec > 0 && b.msgs < 0.0 {
            wait = wait.max(-b.msgs / self.limit.msgs_per_sec as f64);
        }
        if self.limit.bytes_per_sec > 0 && b.bytes < 0.0 {
            wait = wait.max(-b.bytes / self.limit.bytes_per_sec as f64);
        }
        Duration::from_secs_f64(wait)
    }

    /// Takes `msgs` and `bytes`; returns how long the caller should wait before going on.
    pub fn take(&self, msgs: u64, bytes: u64, now: Instant) -> Duration {
        let mut b = self.state.lock().expect("rate limiter lock");
        self.refill(&mut b, now);
        // A debt is bounded (DEBT_SECONDS_MAX of the rate): a client that declares absurd
        // message counts cannot stall a topic or namespace for days.
        let m = self.limit.msgs_per_sec as f64;
        let y = self.limit.bytes_per_sec as f64;
        if self.limit.msgs_per_sec > 0 {
            b.msgs = (b.msgs - msgs as f64).max(-m * DEBT_SECONDS_MAX);
        }
        if self.limit.bytes_per_sec > 0 {
            b.bytes = (b.bytes - bytes as f64).max(-y * DEBT_SECONDS_MAX);
        }
        self.debt(&b)
    }

    /// How long until anything may pass (zero when the bucket has tokens).
    pub fn wait(&self, now: Instant) -> Duration {
        let mut b = self.state.lock().expect("rate limiter lock");
        self.refill(&mut b, now);
        let mut wait = self.debt(&b);
        // Empty but not in debt: wait for one message's worth.
        if wait.is_zero() && self.limit.msgs_per_sec > 0 && b.msgs < 1.0 {
            wait = Duration::from_secs_f64((1.0 - b.msgs) / self.limit.msgs_per_sec as f64);
        }
        wait
    }

    /// Messages that may pass now (`u64::MAX` when messages are not limited).
    pub fn available_msgs(&self, now: Instant) -> u64 {
        if self.limit.msgs_per_sec == 0 {
            return u64::MAX;
        }
        let mut b = self.state.lock().expect("rate limiter lock");
        self.refill(&mut b, now);
        b.msgs.max(0.0) as u64
    }
}

/// A limiter that follows a policy: rebuilt when the limit changes, kept otherwise (so a
/// policy refresh does not hand out a fresh second of tokens).
#[derive(Debug, Default)]
pub struct PolicyLimiter(Mutex<Option<std::sync::Arc<RateLimiter>>>);

impl PolicyLimiter {
    pub fn update(&self, limit: Option<&RateLimit>) {
        let mut cur = self.0.lock().expect("limiter lock");
        let same = match (cur.as_ref(), limit) {
            (Some(l), Some(n)) => l.limit() == n,
            (None, None) => true,
            (None, Some(n)) => n.is_unlimited(),
            (Some(_), None) => false,
        };
        if !same {
            *cur = limit.and_then(|l| RateLimiter::new(l, Instant::now()).map(std::sync::Arc::new));
        }
    }

    pub fn get(&self) -> Option<std::sync::Arc<RateLimiter>> {
        self.0.lock().expect("limiter lock").clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(m: u64, b: u64) -> RateLimit {
        RateLimit {
            msgs_per_sec: m,
            bytes_per_sec: b,
        }
    }

    #[test]
    fn given_no_limits_then_no_limiter() {
        assert!(RateLimiter::new(&limit(0, 0), Instant::now()).is_none());
    }

    #[test]
    fn given_a_message_rate_then_sends_over_ten_seconds_pass_at_that_rate() {
        let t0 = Instant::now();
        let r = RateLimiter::new(&limit(100, 0), t0).unwrap();
        // A sender that sends one message and then waits as told.
        let mut now = t0;
        let mut sent = 0;
        while now < t0 + Duration::from_secs(10) {
            let w = r.take(1, 1000, now);
            sent += 1;
            now += w.max(Duration::from_micros(100));
        }
        assert!((995..=1005).contains(&sent), "sent {sent}");
    }

    #[test]
    fn given_a_big_batch_then_the_debt_is_waited_for() {
        let t0 = Instant::now();
        let r = RateLimiter::new(&limit(100, 0), t0).unwrap();
        let w = r.take(1000, 0, t0);
        assert_eq!(w, Duration::from_secs(10));
        assert_eq!(r.available_msgs(t0 + Duration::from_secs(5)), 0);
        assert!(r.wait(t0 + Duration::from_secs(10)) > Duration::ZERO);
        assert_eq!(r.available_msgs(t0 + Duration::from_secs(11)), 100);
    }

    #[test]
    fn given_an_absurd_batch_then_the_wait_is_bounded_and_time_never_runs_back() {
        let t0 = Instant::now();
        let r = RateLimiter::new(&limit(100, 0), t0).unwrap();
        let w = r.take(u64::from(u32::MAX), 0, t0);
        assert_eq!(w, Duration::from_secs(60));
        // An instant from before the last one refills nothing.
        let r = RateLimiter::new(&limit(100, 0), t0 + Duration::from_secs(1)).unwrap();
        assert_eq!(r.available_msgs(t0), 0);
        assert_eq!(r.available_msgs(t0 + Duration::from_secs(2)), 100);
    }

    #[test]
    fn given_a_byte_rate_then_the_bytes_decide() {
        let t0 = Instant::now();
        let r = RateLimiter::new(&limit(0, 1000), t0).unwrap();
        assert_eq!(r.available_msgs(t0), u64::MAX);
        let w = r.take(1, 2000, t0);
        assert_eq!(w, Duration::from_secs(2));
    }

    #[test]
    fn given_an_idle_bucket_then_it_holds_one_second_at_most() {
        let t0 = Instant::now();
        let r = RateLimiter::new(&limit(10, 0), t0).unwrap();
        assert_eq!(r.available_msgs(t0 + Duration::from_secs(60)), 10);
    }

    #[test]
    fn given_policy_refreshes_then_the_bucket_is_kept_unless_the_limit_changes() {
        let p = PolicyLimiter::default();
        p.update(Some(&limit(10, 0)));
        let a = p.get().unwrap();
        a.take(10, 0, Instant::now());
        p.update(Some(&limit(10, 0)));
        assert!(std::sync::Arc::ptr_eq(&a, &p.get().unwrap()));
        p.update(Some(&limit(20, 0)));
        assert_eq!(p.get().unwrap().limit().msgs_per_sec, 20);
        p.update(None);
        assert!(p.get().is_none());
        p.update(Some(&limit(0, 0)));
        assert!(p.get().is_none());
    }
}
