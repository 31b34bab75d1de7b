//! Serving HTTP pages (the broker's `/metrics`, `/health`, `/stats`, `/console`; a bookie's
//! `/metrics` and `/health`) with bounds a peer cannot hold open.
//!
//! axum's own server keeps a connection for as long as its peer does: a client that sent
//! half a request and nothing more, or sent it a byte at a time, or stopped reading a
//! response, held its connection (a task, a file descriptor) for ever, and a graceful
//! shutdown waited for it. Here hyper serves each connection (HTTP/1.1, the router as its
//! service) with these bounds:
//! - a request's head (or, on a keep-alive connection, the next one's) must arrive whole
//!   within the stall bound ([`STALL`]), however its bytes are spread;
//! - a connection that sends no byte or takes no byte of a response for [`STALL`] is closed
//!   ([`StallBounded`]; an idle keep-alive connection too, as Jetty's idle timeout does in
//!   Pulsar);
//! - at most `connections_max` connections are open; one more is answered 503 and closed
//!   ([`crate::admission`]);
//! - a shutdown stops accepting, lets open connections finish the request they serve for at
//!   most [`SHUTDOWN_GRACE`], then closes what is left.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use meridian_metadata::stall::StallBounded;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::admission::{self, Limits};

/// A connection that sends no byte (no request, or no rest of one) or takes no byte of a
/// response for this long is closed, and a request's head must arrive within it.
pub const STALL: Duration = Duration::from_secs(30);

/// How long a shutdown waits for open connections.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// What a connection over the bound is told.
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 42\r\nconnection: close\r\n\r\ntoo many connections to this HTTP server\r\n";

/// A running HTTP server.
pub struct RunningHttp {
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// Serves `app` on `listener` until [`RunningHttp::shutdown`], each connection bounded by
/// [`STALL`], at most `connections_max` at once (the setting `bound` names, in logs and
/// `/metrics`).
pub fn serve_router(
    app: Router,
    listener: TcpListener,
    connections_max: usize,
    bound: &'static str,
) -> std::io::Result<RunningHttp> {
    serve_router_bounded(app, listener, connections_max, bound, STALL)
}

/// [`serve_router`] with another stall bound (tests).
pub fn serve_router_bounded(
    app: Router,
    listener: TcpListener,
    connections_max: usize,
    bound: &'static str,
    stall: Duration,
) -> std::io::Result<RunningHttp> {
    let addr = listener.local_addr()?;
    let (stop, stop_rx) = watch::channel(false);
    let limits = Limits::new(connections_max.max(1), 0);
    let task = tokio::spawn(accept_loop(app, listener, limits, bound, stall, stop_rx));
    Ok(RunningHttp { addr, stop, task })
}

impl RunningHttp {
    /// Stops accepting, lets open connections finish what they serve for at most
    /// [`SHUTDOWN_GRACE`], closes those still open, and returns.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        if tokio::time::timeout(SHUTDOWN_GRACE + Duration::from_secs(3), &mut self.task)
            .await
            .is_err()
        {
            self.task.abort();
        }
    }
}

async fn accept_loop(
    app: Router,
    listener: TcpListener,
    limits: Arc<Limits>,
    bound: &'static str,
    stall: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, peer)) => match limits.admit(peer.ip()) {
                    Ok(admitted) => {
                        let app = app.clone();
                        let stop = stop.clone();
                        conns.spawn(async move {
                            serve_one(app, stream, stall, stop).await;
                            drop(admitted);
                        });
                    }
                    Err(over) => {
                        if let Some(slot) = limits.refusing("http", bound, over) {
                            tokio::spawn(async move {
                                admission::refuse(stream, BUSY).await;
                                drop(slot);
                            });
                        }
                    }
                },
                Err(e) => limits.accept_failed("http", &e).await,
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            _ = stop.changed() => break,
        }
    }
    drop(listener);
    let drain = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(SHUTDOWN_GRACE, drain).await.is_err() {
        tracing::info!(
            grace_ms = SHUTDOWN_GRACE.as_millis() as u64,
            open = conns.len(),
            "HTTP connections still open after the shutdown's grace; closing them"
        );
        conns.abort_all();
        while conns.join_next().await.is_some() {}
    }
}

/// Serves one connection until its peer or a bound ends it, or a shutdown (which lets the
/// request in progress finish).
async fn serve_one(
    app: Router,
    stream: TcpStream,
    stall: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(StallBounded::new(stream, Some(stall), Some(stall)));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(stall);
    let conn = http.serve_connection(io, TowerToHyperService::new(app));
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "HTTP connection ended");
            }
            return;
        }
        _ = stop.changed() => {}
    }
    conn.as_mut().graceful_shutdown();
    if let Err(e) = conn.await {
        tracing::debug!(error = %e, "HTTP connection ended");
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
        serve_router_bounded(app, listener, 1000, "test", stall).expect("serve")
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
    async fn a_shutdown_closes_a_response_the_client_does_not_take_after_its_grace() {
        // A stall bound longer than the grace: only the grace can end the wait.
        let http = server(Duration::from_secs(60)).await;
        let mut busy = TcpStream::connect(http.addr).await.expect("connect");
        busy.write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let t = Instant::now();
        http.shutdown().await;
        let took = t.elapsed();
        assert!(
            // Closed by the accept loop's own abort at the grace, not by the outer bound's
            // three seconds later.
            took >= SHUTDOWN_GRACE - Duration::from_millis(100)
                && took < SHUTDOWN_GRACE + Duration::from_millis(1500),
            "{took:?}"
        );
        // The connection was closed, not left to its bound: what was sent ends.
        let mut got = 0usize;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            match tokio::time::timeout(Duration::from_secs(5), busy.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(n)) => got += n,
                Err(_) => panic!("still open 5 s after the shutdown, {got} bytes read"),
            }
        }
        assert!(got < 64 << 20, "the whole response came: {got} bytes");
    }

    #[tokio::test]
    async fn a_request_head_sent_a_byte_at_a_time_is_dropped_at_the_bound() {
        let http = server(Duration::from_millis(800)).await;
        let mut drip = TcpStream::connect(http.addr).await.expect("connect");
        drip.write_all(b"GET /small HTTP/1.1\r\nX-Drip: ")
            .await
            .expect("write");
        // A byte every 200 ms: each well within the stall bound, the head never whole.
        let t = Instant::now();
        let mut buf = [0u8; 1024];
        loop {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "still open after {:?}",
                t.elapsed()
            );
            if drip.write_all(b"a").await.is_err() {
                break;
            }
            match tokio::time::timeout(Duration::from_millis(200), drip.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                // hyper may answer a timed-out head with an error status first.
                Ok(Ok(_)) | Err(_) => {}
            }
        }
        let took = t.elapsed();
        assert!(took >= Duration::from_millis(700), "closed after {took:?}");
        http.shutdown().await;
    }

    #[tokio::test]
    async fn connections_over_the_bound_are_answered_503_and_the_rest_served() {
        let app = Router::new().route("/small", get(|| async { "ok" }));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let http = serve_router_bounded(app, listener, 2, "test.http_connections_max", STALL)
            .expect("serve");
        let get_small = |close: bool| {
            let addr = http.addr;
            async move {
                let mut s = TcpStream::connect(addr).await.expect("connect");
                let conn = if close { "close" } else { "keep-alive" };
                s.write_all(
                    format!("GET /small HTTP/1.1\r\nHost: x\r\nConnection: {conn}\r\n\r\n")
                        .as_bytes(),
                )
                .await
                .expect("write");
                let mut answer = vec![0u8; 4096];
                let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut answer))
                    .await
                    .expect("an answer")
                    .expect("read");
                (s, String::from_utf8_lossy(&answer[..n]).to_string())
            }
        };
        // Two keep-alive connections held open.
        let (first, a) = get_small(false).await;
        let (_second, b) = get_small(false).await;
        assert!(
            a.starts_with("HTTP/1.1 200") && b.starts_with("HTTP/1.1 200"),
            "{a}\n{b}"
        );
        // A third is told why and closed.
        let (mut third, c) = get_small(true).await;
        assert!(c.starts_with("HTTP/1.1 503"), "{c}");
        assert!(c.contains("too many connections"), "{c}");
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), third.read_to_end(&mut rest))
            .await
            .expect("closed")
            .expect("read");
        // Once one of the two leaves, a new connection is served.
        drop(first);
        let t = Instant::now();
        loop {
            let (_s, d) = get_small(true).await;
            if d.starts_with("HTTP/1.1 200") {
                break;
            }
            assert!(d.starts_with("HTTP/1.1 503"), "{d}");
            assert!(t.elapsed() < Duration::from_secs(5), "still refused: {d}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        http.shutdown().await;
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
