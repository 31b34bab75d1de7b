//! Bounds on the connections a listener keeps, and how a connection over them is turned away.
//!
//! The Pulsar ports count against `broker.connections_max` and `broker.connections_per_ip_max`
//! (Pulsar's `brokerMaxConnections` and `brokerMaxConnectionsPerIp`; 0 is no bound, as
//! there), the HTTP servers against their `http_connections_max` (Pulsar's
//! `maxHttpServerConnections`). Every descriptor of a process comes from one budget: without
//! a bound, a client opening connections in a loop would take the descriptors that the
//! journal, the ledgers and the other listeners need.
//!
//! A connection over a bound is answered in its protocol's terms (a Pulsar `Error` frame, an
//! HTTP 503) and closed. Refusals are cheap but not free (a task, a descriptor for up to
//! [`LINGER`]), so at most [`REFUSING_MAX`] are in progress; past that a connection is closed
//! without an answer.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Refusals answered at once; more are closed without an answer.
pub const REFUSING_MAX: usize = 64;

/// How long a refusal may take: its answer written, then what the peer still sends read
/// until it closes (closing with unread bytes would reset the connection, and the peer could
/// lose the answer before reading it).
pub const LINGER: Duration = Duration::from_secs(1);

/// Which bound a connection was over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Over {
    /// All connections together: the bound.
    Total(usize),
    /// The connections from one address: the bound.
    PerIp(usize),
}

/// Counts a listener's (or several listeners') open connections against their bounds.
#[derive(Debug)]
pub struct Limits {
    total_max: usize,
    per_ip_max: usize,
    open: Mutex<Open>,
    refusing: AtomicUsize,
    refused: AtomicU64,
    /// When a refusal was last logged ([`mono_ms`]), so that a flood is logged once a
    /// second with a count.
    logged_ms: AtomicU64,
    accept_failures: AtomicU64,
    /// ... and a failed accept.
    accept_logged_ms: AtomicU64,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    per_ip: HashMap<IpAddr, usize>,
}

/// An admitted connection; it stops counting when dropped.
#[derive(Debug)]
pub struct Admitted {
    limits: Arc<Limits>,
    ip: IpAddr,
}

/// A refusal in progress; it stops counting when dropped.
#[derive(Debug)]
pub struct Refusing {
    limits: Arc<Limits>,
}

impl Limits {
    /// `total_max` and `per_ip_max` of 0 bound nothing.
    pub fn new(total_max: usize, per_ip_max: usize) -> Arc<Limits> {
        Arc::new(Limits {
            total_max,
            per_ip_max,
            open: Mutex::default(),
            refusing: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
            logged_ms: AtomicU64::new(0),
            accept_failures: AtomicU64::new(0),
            accept_logged_ms: AtomicU64::new(0),
        })
    }

    /// Counts a connection from `ip`, or says which bound it is over (and counts nothing).
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<Admitted, Over> {
        let ip = ip.to_canonical();
        let mut open = self.open.lock().expect("connection counts");
        if self.total_max > 0 && open.total >= self.total_max {
            return Err(Over::Total(self.total_max));
        }
        if self.per_ip_max > 0 {
            let n = open.per_ip.entry(ip).or_default();
            if *n >= self.per_ip_max {
                return Err(Over::PerIp(self.per_ip_max));
            }
            *n += 1;
        }
        open.total += 1;
        Ok(Admitted {
            limits: Arc::clone(self),
            ip,
        })
    }

    /// Connections admitted and not yet dropped.
    pub fn open(&self) -> usize {
        self.open.lock().expect("connection counts").total
    }

    /// Connections refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Counts a refusal (`what` names the listener in the log, `bound` the setting) and
    /// says whether it may be answered (fewer than [`REFUSING_MAX`] in progress).
    pub fn refusing(self: &Arc<Self>, what: &str, bound: &str, over: Over) -> Option<Refusing> {
        let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        metrics::counter!("meridian_connections_refused_total", "listener" => what.to_string(), "bound" => bound.to_string())
            .increment(1);
        if log_now(&self.logged_ms) {
            let limit = match over {
                Over::Total(n) | Over::PerIp(n) => n,
            };
            tracing::warn!(
                listener = what,
                bound,
                limit,
                refused_so_far = n,
                "refusing connections over the bound (logged at most once a second)"
            );
        }
        self.refusing
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < REFUSING_MAX).then_some(n + 1)
            })
            .ok()
            .map(|_| Refusing {
                limits: Arc::clone(self),
            })
    }

    /// An accept that failed (out of descriptors, say): logged at most once a second with
    /// the count, then a pause before the next accept rather than a spin (the connections
    /// waiting meanwhile stay in the listen backlog).
    pub async fn accept_failed(&self, what: &str, e: &std::io::Error) {
        let n = self.accept_failures.fetch_add(1, Ordering::Relaxed) + 1;
        if log_now(&self.accept_logged_ms) {
            tracing::warn!(listener = what, error = %e, failed_so_far = n, "accept failed (logged at most once a second)");
        }
        tokio::time::sleep(ACCEPT_PAUSE).await;
    }
}

/// How long a listener waits after a failed accept.
pub const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// Whether a second has passed since `logged` (then it counts as logged now).
fn log_now(logged: &AtomicU64) -> bool {
    let now = mono_ms();
    let last = logged.load(Ordering::Relaxed);
    (last == 0 || now.saturating_sub(last) >= 1_000)
        && logged
            .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// Milliseconds on a monotonic clock (since the first call), so a wall clock stepped back
/// does not silence the logs.
fn mono_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut open = self.limits.open.lock().expect("connection counts");
        open.total = open.total.saturating_sub(1);
        if self.limits.per_ip_max > 0 {
            if let Some(n) = open.per_ip.get_mut(&self.ip) {
                *n -= 1;
                if *n == 0 {
                    open.per_ip.remove(&self.ip);
                }
            }
        }
    }
}

impl Drop for Refusing {
    fn drop(&mut self) {
        self.limits.refusing.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Writes `answer`, says no more, and reads what the peer still sends until it closes, all
/// within [`LINGER`]; then the connection is dropped.
pub async fn refuse<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, answer: &[u8]) {
    let _ = tokio::time::timeout(LINGER, async {
        s.write_all(answer).await?;
        s.shutdown().await?;
        let mut buf = [0u8; 4096];
        while s.read(&mut buf).await? > 0 {}
        Ok::<(), std::io::Error>(())
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn the_total_bound_counts_every_address_and_frees_on_drop() {
        let l = Limits::new(2, 0);
        let a = l.admit(ip("127.0.0.1")).unwrap();
        let _b = l.admit(ip("127.0.0.2")).unwrap();
        assert_eq!(l.admit(ip("127.0.0.3")).unwrap_err(), Over::Total(2));
        assert_eq!(l.open(), 2);
        drop(a);
        assert_eq!(l.open(), 1);
        let _c = l.admit(ip("127.0.0.3")).unwrap();
        assert_eq!(l.open(), 2);
    }

    #[test]
    fn the_per_address_bound_counts_each_address_and_a_mapped_v4_is_its_v4() {
        let l = Limits::new(0, 2);
        let a = l.admit(ip("127.0.0.1")).unwrap();
        let _b = l.admit(ip("::ffff:127.0.0.1")).unwrap();
        assert_eq!(l.admit(ip("127.0.0.1")).unwrap_err(), Over::PerIp(2));
        // Another address is not held back by the first one's count.
        let _c = l.admit(ip("127.0.0.2")).unwrap();
        let _d = l.admit(ip("127.0.0.2")).unwrap();
        assert_eq!(l.open(), 4);
        drop(a);
        let _e = l.admit(ip("127.0.0.1")).unwrap();
        // A refusal counts nothing.
        assert_eq!(l.open(), 4);
    }

    #[test]
    fn no_bound_admits_everything_and_keeps_no_map() {
        let l = Limits::new(0, 0);
        let held: Vec<_> = (0..1000)
            .map(|_| l.admit(ip("10.0.0.1")).unwrap())
            .collect();
        assert_eq!(l.open(), 1000);
        assert!(l.open.lock().unwrap().per_ip.is_empty());
        drop(held);
        assert_eq!(l.open(), 0);
    }

    #[test]
    fn refusals_in_progress_are_bounded() {
        let l = Limits::new(1, 0);
        let slots: Vec<_> = (0..REFUSING_MAX)
            .map(|_| l.refusing("test", "x", Over::Total(1)).expect("a slot"))
            .collect();
        assert!(l.refusing("test", "x", Over::Total(1)).is_none());
        assert_eq!(l.refused(), REFUSING_MAX as u64 + 1);
        drop(slots);
        assert!(l.refusing("test", "x", Over::Total(1)).is_some());
    }

    #[tokio::test]
    async fn a_refusal_s_answer_reaches_a_peer_that_had_sent_bytes() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            // Bytes the server never reads before it answers: closing on them unread
            // would reset the connection.
            c.write_all(&[7u8; 100_000]).await.unwrap();
            let mut got = Vec::new();
            c.read_to_end(&mut got).await.unwrap();
            got
        });
        let (s, _) = listener.accept().await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        refuse(s, b"no room").await;
        assert_eq!(client.await.unwrap(), b"no room");
    }
}
