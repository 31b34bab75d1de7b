//! Sockets that give up on a peer that stops taking or sending bytes.
//!
//! TCP never gives up a peer whose kernel still answers: a frozen process (SIGSTOP, a
//! debugger, a stuck VM) keeps its receive window shut and acknowledges every probe, and a
//! client that opened a connection and sends nothing more (or a request's first half) is
//! idle, not gone. A task writing to the one or reading from the other waits for as long as
//! the peer stays so, holding whatever it holds: queued frames, a request's state, a file
//! descriptor, a server's graceful shutdown.
//!
//! [`StallBounded`] wraps a stream so that a write (or flush, or shutdown) that makes no
//! progress for its write bound, and a read that gets nothing for its read bound while
//! nothing is written either, fail with `TimedOut`. Progress resets the clock: a slow peer
//! that takes a few bytes at a time goes on, and so does one downloading a long answer.
//!
//! Every role's sockets toward peers it does not control use it: the broker's client
//! connections and its connections to bookies, the bookie's connections, the HTTP pages, and
//! the gRPC servers' accepted connections (`incoming`).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// A stream whose reads and writes fail with `TimedOut` after their bound without progress
/// (`None`: no bound on that side).
pub struct StallBounded<S> {
    inner: S,
    read: Bound,
    write: Bound,
}

struct Bound {
    limit: Option<Duration>,
    /// Set when an operation first waited without progress; cleared by progress.
    timer: Option<Pin<Box<Sleep>>>,
    what: &'static str,
}

impl Bound {
    fn new(limit: Option<Duration>, what: &'static str) -> Self {
        Bound {
            limit,
            timer: None,
            what,
        }
    }

    /// `r`, or `TimedOut` once it has been pending for the whole bound.
    fn check<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if r.is_ready() {
            self.timer = None;
            return r;
        }
        let Some(limit) = self.limit else {
            return Poll::Pending;
        };
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => {
                self.timer = None;
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    Stalled(format!(
                        "the peer {} for {} ms",
                        self.what,
                        limit.as_millis()
                    )),
                )))
            }
        }
    }
}

impl<S> StallBounded<S> {
    /// `inner` with a bound on reads that get nothing and on writes that make no progress.
    pub fn new(inner: S, read: Option<Duration>, write: Option<Duration>) -> Self {
        StallBounded {
            inner,
            read: Bound::new(read, "sent no bytes"),
            write: Bound::new(write, "took no bytes"),
        }
    }

    /// Only writes bounded (the write half of a split stream).
    pub fn writes(inner: S, write: Option<Duration>) -> Self {
        Self::new(inner, None, write)
    }
}

/// A bound's giving up, inside the `TimedOut` error it returns.
#[derive(Debug)]
struct Stalled(String);

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Stalled {}

/// Whether `e` is a bound's giving up (not the socket's own failure, such as the kernel's
/// `ETIMEDOUT`).
pub fn is_stall(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<Stalled>())
}

impl<S: AsyncRead + Unpin> AsyncRead for StallBounded<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        this.read.check(cx, r)
    }
}

impl<S> StallBounded<S> {
    /// A write that took bytes is progress for the read side too: a server producing or
    /// sending a response keeps polling its read side (hyper, to notice a client hanging up;
    /// h2 between its own writes), and a peer downloading it sends nothing meanwhile.
    fn wrote(&mut self, r: &Poll<io::Result<usize>>) {
        if !matches!(r, Poll::Ready(Ok(n)) if *n > 0) {
            return;
        }
        // Moved, not dropped: a read waiting in another task keeps its wake-up.
        if let (Some(timer), Some(limit)) = (self.read.timer.as_mut(), self.read.limit) {
            timer.as_mut().reset(tokio::time::Instant::now() + limit);
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for StallBounded<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.wrote(&r);
        this.write.check(cx, r)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.wrote(&r);
        this.write.check(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_flush(cx);
        this.write.check(cx, r)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.write.check(cx, r)
    }
}

/// The gRPC servers (metadata, admin) take their accepted connections through this.
impl tonic::transport::server::Connected for StallBounded<tokio::net::TcpStream> {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_peer_that_takes_nothing_fails_the_write_and_a_slow_one_does_not() {
        let (a, _b) = tokio::io::duplex(1024);
        let mut w = StallBounded::writes(a, Some(Duration::from_millis(200)));
        // Fills the pipe, then waits: nobody reads.
        let t = std::time::Instant::now();
        let e = w.write_all(&[7u8; 4096]).await.expect_err("nobody reads");
        assert!(is_stall(&e), "{e}");
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
            "{waited:?}"
        );

        // A reader taking at most 256 bytes every 20 ms (well under the bound each time) lets
        // 8 KiB through, which takes longer than the bound in all.
        let (a, mut b2) = tokio::io::duplex(256);
        let reader = tokio::spawn(async move {
            let mut got = 0;
            let mut buf = [0u8; 256];
            while got < 8192 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                got += b2.read(&mut buf).await.expect("read");
            }
            got
        });
        let mut w = StallBounded::writes(a, Some(Duration::from_millis(200)));
        w.write_all(&[1u8; 8192])
            .await
            .expect("a slow reader is not given up");
        w.flush().await.expect("flush");
        assert_eq!(reader.await.expect("reader"), 8192);
    }

    #[tokio::test]
    async fn a_read_waiting_while_writes_go_out_fails_only_a_bound_after_the_last_write() {
        let (a, mut b) = tokio::io::duplex(1 << 20);
        let (mut rd, mut wr) = tokio::io::split(StallBounded::new(
            a,
            Some(Duration::from_millis(1000)),
            None,
        ));
        // A read in a task of its own, waiting for bytes that never come.
        let read = tokio::spawn(async move {
            let t = std::time::Instant::now();
            let r = rd.read(&mut [0u8; 8]).await;
            (r, t.elapsed())
        });
        // Writes go out every 100 ms for 2.5 s (the peer takes them), then stop.
        for _ in 0..25 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            wr.write_all(b"answer").await.expect("write");
        }
        let stopped = std::time::Instant::now();
        let (r, waited) = read.await.expect("read task");
        let e = r.expect_err("nothing ever comes");
        assert!(is_stall(&e), "{e}");
        assert!(waited >= Duration::from_millis(2500), "{waited:?}");
        assert!(
            stopped.elapsed() >= Duration::from_millis(900),
            "{:?}",
            stopped.elapsed()
        );
        let mut got = vec![0u8; 150];
        b.read_exact(&mut got).await.expect("the answers");
    }

    #[tokio::test]
    async fn a_peer_that_sends_nothing_fails_the_read_after_the_bound_not_before() {
        let (a, mut b) = tokio::io::duplex(1024);
        let mut r = StallBounded::new(a, Some(Duration::from_millis(300)), None);
        // Bytes every 100 ms keep it going.
        let sender = tokio::spawn(async move {
            for _ in 0..8 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                b.write_all(b"x").await.expect("write");
            }
            b
        });
        let mut buf = [0u8; 1];
        for _ in 0..8 {
            r.read_exact(&mut buf).await.expect("bytes keep coming");
        }
        let _b = sender.await.expect("sender");
        let t = std::time::Instant::now();
        let e = r.read(&mut buf).await.expect_err("nothing more comes");
        assert!(is_stall(&e), "{e}");
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
    }
}
