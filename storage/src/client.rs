//! Connections to bookies: pipelined requests matched to responses by request id.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use meridian_metadata::stall::{is_stall, StallBounded};
use meridian_metadata::tls::SiteTls;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use crate::proto::{self, Frame, Request, Response};

#[derive(Debug, Clone, thiserror::Error)]
pub enum BookieClientError {
    #[error("bookie {addr}: {reason}")]
    Unreachable { addr: String, reason: String },
    #[error("bookie {addr}: no answer within {ms} ms")]
    Timeout { addr: String, ms: u64 },
}

/// What to do with a response (or with the connection's failure).
pub type OnResponse = Box<dyn FnOnce(Result<Response, BookieClientError>) + Send>;
type Pending = Arc<Mutex<HashMap<u64, OnResponse>>>;

/// Writes every head and body of `batch` in order, with as few `writev` calls as the socket
/// allows. The connection's writer is [`StallBounded`]: a bookie that stopped reading (a frozen
/// process, or a hung disk that holds every request slot it has) fails it with `TimedOut`
/// rather than keeping this connection, and everything queued on it, for ever.
async fn write_all_vectored<W: AsyncWrite + Unpin>(
    wr: &mut W,
    batch: &[Out],
) -> std::io::Result<()> {
    let mut slices: Vec<std::io::IoSlice<'_>> = batch
        .iter()
        .flat_map(|o| [&o.head[..], &o.body[..]])
        .filter(|s| !s.is_empty())
        .map(std::io::IoSlice::new)
        .collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = wr.write_vectored(rest).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        std::io::IoSlice::advance_slices(&mut rest, n);
    }
    // A TLS stream may hold the end of what it was given until flushed (a no-op on TCP).
    wr.flush().await
}

/// Removes request `id`'s waiter, if still there, when dropped.
struct Forget {
    pending: Pending,
    id: Option<u64>,
}

impl Drop for Forget {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.pending.lock().expect("pending lock").remove(&id);
        }
    }
}

/// Hands the response to request `id` to whoever waits for it (nobody, if it already failed).
fn answer(pending: &Pending, id: u64, response: Response) {
    let waiter = pending.lock().expect("pending lock").remove(&id);
    if let Some(waiter) = waiter {
        waiter(Ok(response));
    }
}

/// Marks the connection broken and fails every waiter. `broken` is set under the waiters'
/// lock, where [`BookieConn::register`] looks at it: no request registers after the drain and
/// waits for ever.
fn fail_all(pending: &Pending, broken: &AtomicBool, addr: &str) {
    let waiters: Vec<OnResponse> = {
        let mut p = pending.lock().expect("pending lock");
        broken.store(true, Ordering::Relaxed);
        p.drain().map(|(_, w)| w).collect()
    };
    for w in waiters {
        w(Err(BookieClientError::Unreachable {
            addr: addr.to_string(),
            reason: "connection closed".into(),
        }));
    }
}

/// Bytes of one request for the connection's writer: an encoded frame, or the head of an add
/// whose entry payload follows as `body` (shared with the ledger writer, not copied).
struct Out {
    head: Vec<u8>,
    body: Bytes,
}

/// Requests the writer gathers into one vectored write at most (each is up to two slices;
/// Linux takes up to 1024).
const WRITE_BATCH_MAX: usize = 256;

/// Two ends of an in-process connection to a bookie: requests in, responses out, each with
/// its request id. The bookie answers exactly as it does on a socket.
pub struct LocalLink {
    pub requests: mpsc::UnboundedSender<(u64, LocalRequest)>,
    pub responses: mpsc::UnboundedReceiver<(u64, Response)>,
    /// Resolves (its sender dropped) when the bookie's end of the connection stops taking
    /// requests: the client fails what is still unanswered at once, as a socket's EOF would,
    /// instead of waiting for the requests the bookie had started.
    pub closed: oneshot::Receiver<()>,
}

/// A request on an in-process connection.
#[derive(Debug)]
pub enum LocalRequest {
    /// As it would be decoded off a socket.
    Plain(Request),
    /// An add (not a recovery one) whose envelope stays in the writer's two parts, header and
    /// payload, so that the payload is never copied behind its header: the bookie journals and
    /// caches the parts as they are. On a socket the same add is one [`Request::Add`].
    Add {
        ledger_id: u64,
        entry_id: u64,
        master_key: Bytes,
        sealed: proto::Sealed,
    },
}

/// Opens a [`LocalLink`] to a bookie of this process; `None` once it stopped.
pub type LocalConnect = Arc<dyn Fn() -> Option<LocalLink> + Send + Sync>;

/// Bookies of this process that take connections without a socket, by the address they are
/// known by (the one in ledger ensembles), as BookKeeper's local transport for a bookie in the
/// same JVM. A standalone's broker reaches its embedded bookie this way.
static LOCAL_BOOKIES: Mutex<Vec<(String, LocalConnect)>> = Mutex::new(Vec::new());

/// Makes the bookie known as `addr` reachable in this process through `connect`.
pub fn register_local_bookie(addr: &str, connect: LocalConnect) {
    let mut local = LOCAL_BOOKIES.lock().expect("local bookies lock");
    local.retain(|(a, _)| a != addr);
    local.push((addr.to_string(), connect));
}

/// Forgets the in-process bookie `addr`: new connections to it go over TCP.
pub fn unregister_local_bookie(addr: &str) {
    LOCAL_BOOKIES
        .lock()
        .expect("local bookies lock")
        .retain(|(a, _)| a != addr);
}

fn local_bookie(addr: &str) -> Option<LocalConnect> {
    LOCAL_BOOKIES
        .lock()
        .expect("local bookies lock")
        .iter()
        .find(|(a, _)| a == addr)
        .map(|(_, c)| Arc::clone(c))
}

/// Where a connection's requests go.
enum Sink {
    /// Encoded, to the task that writes them to the socket.
    Wire(mpsc::UnboundedSender<Out>),
    /// As they are, to a bookie of this process.
    Local(mpsc::UnboundedSender<(u64, LocalRequest)>),
}

/// One connection to a bookie: over TCP, or in-process ([`register_local_bookie`]). Cheap to
/// share; broken for good once an I/O error happened, or the bookie took no byte for the
/// pool's request timeout (the pool then makes a new one).
pub struct BookieConn {
    addr: String,
    sink: Sink,
    pending: Pending,
    next_id: AtomicU64,
    broken: Arc<AtomicBool>,
}

impl BookieConn {
    fn with_sink(addr: &str, sink: Sink) -> Arc<Self> {
        Arc::new(Self {
            addr: addr.to_string(),
            sink,
            pending: Arc::default(),
            next_id: AtomicU64::new(1),
            broken: Arc::default(),
        })
    }

    pub async fn connect(
        addr: &str,
        timeout: Duration,
        frame_bytes_max: usize,
    ) -> Result<Arc<Self>, BookieClientError> {
        Self::connect_with_tls(addr, timeout, frame_bytes_max, None, None).await
    }

    /// Connects to the bookie at `addr`; over TLS when `tls` is given (this process's
    /// certificate presented, the bookie's checked against the site CA and `addr`'s host).
    /// With `stall`, the connection breaks (every request on it failed) once the bookie has
    /// taken no byte of what is to be sent for that long.
    pub async fn connect_with_tls(
        addr: &str,
        timeout: Duration,
        frame_bytes_max: usize,
        tls: Option<&SiteTls>,
        stall: Option<Duration>,
    ) -> Result<Arc<Self>, BookieClientError> {
        let unreachable = |reason: String| BookieClientError::Unreachable {
            addr: addr.to_string(),
            reason,
        };
        let started = tokio::time::Instant::now();
        let stream = tokio::time::timeout(timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| unreachable("connect timed out".into()))?
            .map_err(|e| unreachable(e.to_string()))?;
        let _ = stream.set_nodelay(true);
        let Some(tls) = tls else {
            let (rd, wr) = stream.into_split();
            return Ok(Self::start_io(addr, rd, wr, frame_bytes_max, stall));
        };
        let name = meridian_metadata::tls::server_name(addr).map_err(unreachable)?;
        let left = timeout.saturating_sub(started.elapsed());
        let stream = tokio::time::timeout(left, tls.connector().connect(name, stream))
            .await
            .map_err(|_| unreachable("TLS handshake timed out".into()))?
            .map_err(|e| unreachable(format!("TLS handshake: {e}")))?;
        let (rd, wr) = tokio::io::split(stream);
        Ok(Self::start_io(addr, rd, wr, frame_bytes_max, stall))
    }

    /// Starts the connection's writer and reader tasks on the two halves of its stream.
    fn start_io<R, W>(
        addr: &str,
        mut rd: R,
        wr: W,
        frame_bytes_max: usize,
        stall: Option<Duration>,
    ) -> Arc<Self>
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (tx, mut rx) = mpsc::unbounded_channel::<Out>();
        let conn = Self::with_sink(addr, Sink::Wire(tx));
        let pending = Arc::clone(&conn.pending);
        let broken = Arc::clone(&conn.broken);
        let wbroken = Arc::clone(&broken);
        let waddr = addr.to_string();
        let addr_owned = addr.to_string();
        let wpending = Arc::clone(&pending);
        let reader = tokio::spawn(async move {
            let mut buf = BytesMut::with_capacity(256 << 10);
            loop {
                match proto::decode(&mut buf, frame_bytes_max) {
                    Ok(Some(Frame::Response { id, response })) => {
                        answer(&pending, id, response);
                        continue;
                    }
                    Ok(Some(Frame::Request { .. })) => {
                        tracing::warn!(addr = %addr_owned, "bookie sent a request frame; closing");
                        break;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(addr = %addr_owned, error = %e, "malformed frame from bookie; closing");
                        break;
                    }
                }
                match rd.read_buf(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
            fail_all(&pending, &broken, &addr_owned);
        });
        let mut wr = StallBounded::writes(wr, stall);
        tokio::spawn(async move {
            // What is queued goes out in one vectored write: frame heads and entry payloads
            // straight from their buffers, with no copy into a staging buffer.
            let mut batch: Vec<Out> = Vec::with_capacity(WRITE_BATCH_MAX);
            while let Some(first) = rx.recv().await {
                batch.clear();
                batch.push(first);
                let mut bytes = batch[0].head.len() + batch[0].body.len();
                while bytes < (1 << 20) && batch.len() < WRITE_BATCH_MAX {
                    match rx.try_recv() {
                        Ok(more) => {
                            bytes += more.head.len() + more.body.len();
                            batch.push(more);
                        }
                        Err(_) => break,
                    }
                }
                if let Err(e) = write_all_vectored(&mut wr, &batch).await {
                    if is_stall(&e) {
                        // Its answers will not come either: the reader goes too.
                        tracing::warn!(addr = %waddr, error = %e, "giving the bookie's connection up");
                        reader.abort();
                    }
                    break;
                }
            }
            fail_all(&wpending, &wbroken, &waddr);
        });
        conn
    }

    /// A connection over `link` to the in-process bookie known as `addr`.
    pub fn local(addr: &str, link: LocalLink) -> Arc<Self> {
        let LocalLink {
            requests,
            mut responses,
            mut closed,
        } = link;
        let conn = Self::with_sink(addr, Sink::Local(requests));
        let pending = Arc::clone(&conn.pending);
        let broken = Arc::clone(&conn.broken);
        let addr = addr.to_string();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    r = responses.recv() => match r {
                        Some((id, response)) => answer(&pending, id, response),
                        None => break,
                    },
                    _ = &mut closed => {
                        // The bookie stopped: what it answered already still counts.
                        while let Ok((id, response)) = responses.try_recv() {
                            answer(&pending, id, response);
                        }
                        break;
                    }
                }
            }
            fail_all(&pending, &broken, &addr);
        });
        conn
    }

    /// Whether this connection reaches its bookie inside this process.
    pub fn is_local(&self) -> bool {
        matches!(self.sink, Sink::Local(_))
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Requests sent and not yet answered (nor given up by their caller).
    pub fn requests_waiting(&self) -> usize {
        self.pending.lock().expect("pending lock").len()
    }

    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    /// Sends `request`; `on_response` runs with the answer (on the connection's reader task),
    /// or with an error if the connection fails first (on its reader or writer task, or at
    /// once when it is broken already). Requests sent in order leave in order.
    pub fn send_with(&self, request: Request, on_response: OnResponse) {
        self.send_registered(request, on_response);
    }

    /// [`send_with`](Self::send_with), returning the request's id (`None`: the connection is
    /// broken and `on_response` has failed).
    fn send_registered(&self, request: Request, on_response: OnResponse) -> Option<u64> {
        let id = self.register(on_response)?;
        let sent = match &self.sink {
            Sink::Wire(tx) => {
                let frame = Frame::Request { id, request };
                let mut head = Vec::with_capacity(proto::encoded_len_hint(&frame));
                proto::encode(&frame, &mut head);
                let body = Bytes::new();
                tx.send(Out { head, body }).is_ok()
            }
            Sink::Local(tx) => tx.send((id, LocalRequest::Plain(request))).is_ok(),
        };
        if !sent {
            self.closed(id);
        }
        Some(id)
    }

    /// Sends an add of `sealed` (the ledger writer's path): the payload goes to the socket from
    /// its own buffer (to an in-process bookie, as it is: [`LocalRequest::Add`]).
    /// `on_response` as for [`send_with`](Self::send_with).
    pub fn send_add(
        &self,
        ledger_id: u64,
        entry_id: u64,
        master_key: &[u8],
        sealed: &proto::Sealed,
        on_response: OnResponse,
    ) {
        let Some(id) = self.register(on_response) else {
            return;
        };
        let sent = match &self.sink {
            Sink::Wire(tx) => {
                let mut head = Vec::with_capacity(64 + master_key.len());
                proto::encode_add(id, ledger_id, entry_id, 0, master_key, sealed, &mut head);
                let body = sealed.payload.clone();
                tx.send(Out { head, body }).is_ok()
            }
            Sink::Local(tx) => {
                let request = LocalRequest::Add {
                    ledger_id,
                    entry_id,
                    master_key: Bytes::copy_from_slice(master_key),
                    sealed: sealed.clone(),
                };
                tx.send((id, request)).is_ok()
            }
        };
        if !sent {
            self.closed(id);
        }
    }

    /// A new request id with `on_response` waiting on it; `None` (and `on_response` failed)
    /// when the connection is broken.
    fn register(&self, on_response: OnResponse) -> Option<u64> {
        {
            let mut pending = self.pending.lock().expect("pending lock");
            // Under the lock [`fail_all`] sets it in.
            if !self.is_broken() {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                pending.insert(id, on_response);
                return Some(id);
            }
        }
        on_response(Err(BookieClientError::Unreachable {
            addr: self.addr.clone(),
            reason: "connection closed".into(),
        }));
        None
    }

    /// The connection is gone: fails request `id`'s waiter, and later requests at once.
    fn closed(&self, id: u64) {
        self.broken.store(true, Ordering::Relaxed);
        // Taken out before it runs: the lock is not held while a callback runs.
        let waiter = self.pending.lock().expect("pending lock").remove(&id);
        if let Some(w) = waiter {
            w(Err(BookieClientError::Unreachable {
                addr: self.addr.clone(),
                reason: "connection closed".into(),
            }));
        }
    }

    /// Sends `request` and returns a future of its response; the request is on its way when
    /// this returns.
    pub fn send(
        &self,
        request: Request,
    ) -> impl std::future::Future<Output = Result<Response, BookieClientError>> + Send + 'static
    {
        let (tx, rx) = oneshot::channel();
        let id = self.send_registered(
            request,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        // Whoever stops waiting (a deadline, a speculative read answered by another replica)
        // leaves no waiter behind: a bookie that never answers would otherwise grow the map.
        let forget = Forget {
            pending: Arc::clone(&self.pending),
            id,
        };
        let addr = self.addr.clone();
        async move {
            let _forget = forget;
            rx.await.unwrap_or_else(|_| {
                Err(BookieClientError::Unreachable {
                    addr,
                    reason: "connection closed".into(),
                })
            })
        }
    }

    /// [`send`](Self::send) with a deadline.
    pub async fn call(
        &self,
        request: Request,
        timeout: Duration,
    ) -> Result<Response, BookieClientError> {
        let fut = self.send(request);
        tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| BookieClientError::Timeout {
                addr: self.addr.clone(),
                ms: timeout.as_millis() as u64,
            })?
    }
}

/// A bookie's connection in a [`BookiePool`]: (re)made under its own lock, so a bookie that
/// is slow to connect holds up only requests to it.
type ConnSlot = Arc<tokio::sync::Mutex<Option<Arc<BookieConn>>>>;

/// Connections by bookie address, made on first use and remade when broken.
pub struct BookiePool {
    conns: Mutex<HashMap<String, ConnSlot>>,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    pub frame_bytes_max: usize,
    /// TLS between roles: connections over TCP present this process's certificate.
    pub tls: Option<Arc<SiteTls>>,
}

impl BookiePool {
    pub fn new(
        connect_timeout: Duration,
        request_timeout: Duration,
        frame_bytes_max: usize,
        tls: Option<Arc<SiteTls>>,
    ) -> Arc<Self> {
        Arc::new(Self {
            conns: Mutex::default(),
            connect_timeout,
            request_timeout,
            frame_bytes_max,
            tls,
        })
    }

    pub async fn get(&self, addr: &str) -> Result<Arc<BookieConn>, BookieClientError> {
        let slot = Arc::clone(
            self.conns
                .lock()
                .expect("bookie pool lock")
                .entry(addr.to_string())
                .or_default(),
        );
        let mut conn = slot.lock().await;
        if let Some(c) = conn.as_ref().filter(|c| !c.is_broken()) {
            return Ok(Arc::clone(c));
        }
        let c = match local_bookie(addr).and_then(|connect| connect()) {
            Some(link) => BookieConn::local(addr, link),
            None => {
                BookieConn::connect_with_tls(
                    addr,
                    self.connect_timeout,
                    self.frame_bytes_max,
                    self.tls.as_deref(),
                    Some(self.request_timeout),
                )
                .await?
            }
        };
        *conn = Some(Arc::clone(&c));
        Ok(c)
    }

    /// One request with the pool's deadline.
    pub async fn call(&self, addr: &str, request: Request) -> Result<Response, BookieClientError> {
        let c = self.get(addr).await?;
        c.call(request, self.request_timeout).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bookie whose connect hangs (its listener's accept queue full: the kernel drops the
    /// SYNs) holds up only requests to it, not connections to other bookies.
    #[tokio::test]
    async fn a_bookie_slow_to_connect_holds_up_only_itself() {
        let full = tokio::net::TcpSocket::new_v4().unwrap();
        full.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let full = full.listen(0).unwrap();
        let full_addr = full.local_addr().unwrap().to_string();
        let _queued = TcpStream::connect(&full_addr).await.unwrap();
        let live = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let live_addr = live.local_addr().unwrap().to_string();

        let pool = BookiePool::new(
            Duration::from_secs(5),
            Duration::from_secs(5),
            1 << 20,
            None,
        );
        let hanging = tokio::spawn({
            let pool = Arc::clone(&pool);
            async move { pool.get(&full_addr).await.map(|_| ()) }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !hanging.is_finished(),
            "the full listener's connect should hang"
        );
        let started = std::time::Instant::now();
        pool.get(&live_addr).await.unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "a connection to another bookie waited {:?}",
            started.elapsed()
        );
        assert!(matches!(
            hanging.await.unwrap(),
            Err(BookieClientError::Unreachable { .. })
        ));
    }

    /// A bookie that accepts and then reads nothing (a frozen process; a hung disk holding
    /// every request slot): once it has taken no byte for the pool's request timeout, its
    /// connection breaks, every request on it fails (what was queued is let go), and the pool
    /// connects anew.
    #[tokio::test]
    async fn a_bookie_that_takes_no_bytes_has_its_connection_given_up() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let pool = BookiePool::new(
            Duration::from_secs(2),
            Duration::from_millis(500),
            8 << 20,
            None,
        );
        let conn = pool.get(&addr).await.unwrap();
        let failed = Arc::new(AtomicU64::new(0));
        // 64 MiB: more than both ends' socket buffers take.
        for entry_id in 0..16 {
            let failed = Arc::clone(&failed);
            conn.send_with(
                Request::Add {
                    ledger_id: 1,
                    entry_id,
                    flags: 0,
                    master_key: Bytes::from_static(b"k"),
                    entry: Bytes::from(vec![0u8; 4 << 20]),
                },
                Box::new(move |r| {
                    if r.is_err() {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }),
            );
        }
        let started = std::time::Instant::now();
        while !(conn.is_broken() && failed.load(Ordering::Relaxed) == 16) {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the connection to a bookie that reads nothing was kept ({} of 16 adds failed)",
                failed.load(Ordering::Relaxed)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let again = pool.get(&addr).await.unwrap();
        assert!(!Arc::ptr_eq(&conn, &again), "a new connection");
        assert!(!again.is_broken());
        accepted.abort();
    }
}
