//! A UDP proxy for the links between sites: it sits between two QUIC endpoints and drops,
//! delays, reorders (by jitter), duplicates or partitions datagrams on command.
//!
//! ```text
//!  site A ──► proxy.addr ──(faults)──► upstream (site B's geo port)
//!  site A ◄── proxy.addr ◄─(faults)─── one socket per peer address of A, toward B
//! ```
//!
//! It runs on a thread of its own (a current-thread runtime), so sync tests drive it; the
//! test changes its faults at any time and reads what it did.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::Rng;
use tokio::net::UdpSocket;

/// What the proxy does to datagrams, both ways.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Faults {
    /// Drop everything.
    pub partitioned: bool,
    pub drop_percent: u32,
    pub duplicate_percent: u32,
    /// Every datagram waits this long, plus up to `jitter_ms` more (which reorders them).
    pub delay_ms: u64,
    pub jitter_ms: u64,
}

#[derive(Debug, Default)]
pub struct Counters {
    pub forwarded: AtomicU64,
    pub dropped: AtomicU64,
    pub duplicated: AtomicU64,
}

pub struct UdpProxy {
    /// Where the proxied side sends to.
    pub addr: SocketAddr,
    faults: Arc<Mutex<Faults>>,
    pub counters: Arc<Counters>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl UdpProxy {
    /// A proxy on a free loopback port toward `upstream`.
    pub fn start(upstream: SocketAddr) -> UdpProxy {
        let front = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind the proxy");
        front.set_nonblocking(true).expect("non-blocking");
        let addr = front.local_addr().expect("bound");
        let faults = Arc::new(Mutex::new(Faults::default()));
        let counters = Arc::new(Counters::default());
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let (f, c) = (Arc::clone(&faults), Arc::clone(&counters));
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("proxy runtime");
            rt.block_on(async move {
                let front = Arc::new(UdpSocket::from_std(front).expect("tokio socket"));
                tokio::select! {
                    _ = serve(front, upstream, f, c) => {}
                    _ = stopped => {}
                }
            });
        });
        UdpProxy {
            addr,
            faults,
            counters,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Applies `f` from now on.
    pub fn set(&self, f: Faults) {
        *self.faults.lock().expect("faults lock") = f;
    }

    /// Cuts the link (every datagram dropped) or heals it (no fault).
    pub fn partition(&self, cut: bool) {
        self.set(Faults {
            partitioned: cut,
            ..Faults::default()
        });
    }
}

impl Drop for UdpProxy {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Sends `data` to `to` through `socket` as the faults say.
fn pass(
    socket: &Arc<UdpSocket>,
    to: SocketAddr,
    data: Vec<u8>,
    faults: &Mutex<Faults>,
    counters: &Counters,
) {
    let f = faults.lock().expect("faults lock").clone();
    let mut rng = rand::thread_rng();
    if f.partitioned || (f.drop_percent > 0 && rng.gen_range(0..100) < f.drop_percent) {
        counters.dropped.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let copies = if f.duplicate_percent > 0 && rng.gen_range(0..100) < f.duplicate_percent {
        counters.duplicated.fetch_add(1, Ordering::Relaxed);
        2
    } else {
        1
    };
    counters.forwarded.fetch_add(1, Ordering::Relaxed);
    for _ in 0..copies {
        let wait = f.delay_ms
            + if f.jitter_ms > 0 {
                rng.gen_range(0..=f.jitter_ms)
            } else {
                0
            };
        if wait == 0 {
            let _ = socket.try_send_to(&data, to);
        } else {
            let (socket, data) = (Arc::clone(socket), data.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(wait)).await;
                let _ = socket.send_to(&data, to).await;
            });
        }
    }
}

async fn serve(
    front: Arc<UdpSocket>,
    upstream: SocketAddr,
    faults: Arc<Mutex<Faults>>,
    counters: Arc<Counters>,
) {
    let mut toward: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
    let mut buf = vec![0u8; 65_536];
    loop {
        let Ok((n, from)) = front.recv_from(&mut buf).await else {
            continue;
        };
        let back = match toward.get(&from) {
            Some(b) => Arc::clone(b),
            None => {
                let b = Arc::new(UdpSocket::bind("127.0.0.1:0").await.expect("bind"));
                toward.insert(from, Arc::clone(&b));
                // Replies from upstream go back to `from` through the front socket.
                let (b2, front2, f2, c2) = (
                    Arc::clone(&b),
                    Arc::clone(&front),
                    Arc::clone(&faults),
                    Arc::clone(&counters),
                );
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 65_536];
                    loop {
                        let Ok((n, _)) = b2.recv_from(&mut buf).await else {
                            continue;
                        };
                        pass(&front2, from, buf[..n].to_vec(), &f2, &c2);
                    }
                });
                b
            }
        };
        pass(&back, upstream, buf[..n].to_vec(), &faults, &counters);
    }
}
