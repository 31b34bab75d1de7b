//! Serving HTTP pages (the broker's `/metrics`, `/health`, `/stats`, `/console`; a bookie's
//! `/metrics` and `/health`) with bounds a peer cannot hold open.
//!
//! axum's server alone keeps a connection for as long as its peer does: a client that sent
//! half a request and nothing more, or stopped reading a response, held its connection (a
//! task, a file descriptor) for ever, and a graceful shutdown waited for it, so a broker or
//! standalone given SIGTERM did not stop while one such client stayed. Here every accepted
//! connection is [`StallBounded`] both ways ([`STALL`]: an idle keep-alive connection is closed
//! after it too, as Jetty's idle timeout does in Pulsar), and a shutdown waits at most
//! [`SHUTDOWN_GRACE`] for them to finish what they serve (axum runs each connection in a task
//! of its own: one still open then ends by its bound, or with the process).

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use meridian_metadata::stall::StallBounded;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A connection that sends no byte (no request, or no rest of one) or takes no byte of a
/// response for this long is closed.
pub const STALL: Duration = Duration::from_secs(30);

/// How long a shutdown waits for open connections.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// A running HTTP server.
pub struct RunningHttp {
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// Serves `app` on `listener` until [`RunningHttp::shutdown`], each connection bounded by
/// [`STALL`].
pub fn serve_router(app: Router, listener: TcpListener) -> std::io::Result<RunningHttp> {
    serve_router_bounded(app, listener, STALL)
}

/// [`serve_router`] with another bound (tests).
pub fn serve_router_bounded(
    app: Router,
    listener: TcpListener,
    stall: Duration,
) -> std::io::Result<RunningHttp> {
    let addr = listener.local_addr()?;
    let (stop, mut stop_rx) = watch::channel(false);
    let listener = Bounded {
        inner: listener,
        stall,
    };
    let task = tokio::spawn(async move {
        let r = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop_rx.changed().await;
            })
            .await;
        if let Err(e) = r {
            tracing::warn!(error = %e, "HTTP server stopped");
        }
    });
    Ok(RunningHttp { addr, stop, task })
}

impl RunningHttp {
    /// Stops accepting, lets open connections finish for at most [`SHUTDOWN_GRACE`], and
    /// returns (a connection still open then is ended by its own bound, or with the process).
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        if tokio::time::timeout(SHUTDOWN_GRACE, &mut self.task)
            .await
            .is_err()
        {
            tracing::info!(
                grace_ms = SHUTDOWN_GRACE.as_millis() as u64,
                "HTTP connections still open after the shutdown's grace; not waiting for them"
            );
            self.task.abort();
        }
    }
}

/// Accepts as axum's listener does, each connection with `TCP_NODELAY` and bounded.
struct Bounded {
    inner: TcpListener,
    stall: Duration,
}

impl axum::serve::Listener for Bounded {
    type Io = StallBounded<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (stream, peer) = axum::serve::Listener::accept(&mut self.inner).await;
        let _ = stream.set_nodelay(true);
        (
            StallBounded::new(stream, Some(self.stall), Some(self.stall)),
            peer,
        )
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn server(stall: Duration) -> RunningHttp {
        let app = Router::new()
            .route("/small", get(|| async { "ok" }))
            // Far more than a socket's buffers hold: a client that reads none of it keeps
            // the server writing.
            .route("/big", get(|| async { "x".repeat(64 << 20) }));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        serve_router_bounded(app, listener, stall).expect("serve")
    }

    /// Reads until the server closes the connection; how long that took.
    async fn closed_after(s: &mut TcpStream, within: Duration) -> Duration {
        let t = Instant::now();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match tokio::time::timeout(within, s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return t.elapsed(),
                Ok(Ok(_)) => {}
                Err(_) => panic!("the connection was still open after {within:?}"),
            }
        }
    }

    #[tokio::test]
    async fn a_half_sent_request_is_dropped_after_the_bound_and_does_not_hold_the_shutdown() {
        let http = server(Duration::from_millis(800)).await;
        // A whole request is answered.
        let mut ok = TcpStream::connect(http.addr).await.expect("connect");
        ok.write_all(b"GET /small HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut answer = String::new();
        ok.read_to_string(&mut answer).await.expect("read");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

        // Half a request, then nothing: closed once the bound passes, not before.
        let mut half = TcpStream::connect(http.addr).await.expect("connect");
        half.write_all(b"GET /small HTTP/1.1\r\nHost: x\r\n")
            .await
            .expect("write");
        let took = closed_after(&mut half, Duration::from_secs(10)).await;
        assert!(took >= Duration::from_millis(700), "closed after {took:?}");

        // Another half request while the server shuts down: the shutdown does not wait
        // for it past its grace (before: for as long as the client held it).
        let mut held = TcpStream::connect(http.addr).await.expect("connect");
        held.write_all(b"GET /small HTTP/1.1\r\n")
            .await
            .expect("write");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let t = Instant::now();
        http.shutdown().await;
        assert!(
            t.elapsed() < SHUTDOWN_GRACE + Duration::from_secs(2),
            "{:?}",
            t.elapsed()
        );
        drop(held);
    }

    #[tokio::test]
    async fn a_shutdown_waits_for_a_held_connection_no_longer_than_its_grace() {
        // A bound longer than the grace: only the grace can end the wait.
        let http = server(Duration::from_secs(60)).await;
        let mut held = TcpStream::connect(http.addr).await.expect("connect");
        held.write_all(b"GET /small HTTP/1.1\r\nHost: x\r\n")
            .await
            .expect("write");
        tokio::time::sleep(Duration::from_millis(200)).await;
        let t = Instant::now();
        http.shutdown().await;
        let took = t.elapsed();
        assert!(
            took >= SHUTDOWN_GRACE - Duration::from_millis(100)
                && took < SHUTDOWN_GRACE + Duration::from_secs(2),
            "{took:?}"
        );
        drop(held);
    }

    #[tokio::test]
    async fn a_client_downloading_a_response_for_longer_than_the_bound_gets_all_of_it() {
        let http = server(Duration::from_millis(800)).await;
        let mut s = TcpStream::connect(http.addr).await.expect("connect");
        s.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .expect("write");
        // At most 1 MiB every 40 ms: 64 MiB take more than 2.5 s, with the client sending
        // nothing meanwhile (before the read side counted that as a stall).
        let t = Instant::now();
        let mut got = 0usize;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            tokio::time::sleep(Duration::from_millis(40)).await;
            match s.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) => panic!("after {got} bytes: {e}"),
            }
        }
        assert!(got > 64 << 20, "{got} bytes");
        assert!(
            t.elapsed() > Duration::from_millis(1600),
            "{:?}",
            t.elapsed()
        );
        http.shutdown().await;
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_a_response_is_dropped_after_the_bound() {
        let http = server(Duration::from_millis(800)).await;
        let mut s = TcpStream::connect(http.addr).await.expect("connect");
        s.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        // Reads nothing for 3 s: the server's writes make no progress past the socket's
        // buffers, so it gives the connection up.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let mut got = 0usize;
        let mut buf = vec![0u8; 1 << 20];
        let t = Instant::now();
        loop {
            match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(n)) => got += n,
                Err(_) => panic!("still open after {:?}, {got} bytes read", t.elapsed()),
            }
        }
        assert!(got < 64 << 20, "the whole response came: {got} bytes");
        http.shutdown().await;
    }
}
