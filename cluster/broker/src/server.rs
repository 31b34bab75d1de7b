//! The Pulsar-protocol listener: accepts connections and stops them on shutdown.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::TlsAcceptor;

use crate::admission::{self, Over};
use crate::broker::Broker;
use crate::connection::frame;
use meridian_protocol::{cmd, pb::ServerError, ID_NONE};

pub struct RunningServer {
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
    accept: JoinHandle<()>,
}

/// Serves the Pulsar protocol on `listener` for `broker`.
pub fn serve(broker: Arc<Broker>, listener: TcpListener) -> std::io::Result<RunningServer> {
    serve_with(broker, listener, None)
}

/// Serves the Pulsar protocol over TLS (`pulsar+ssl://`) on `listener`.
pub fn serve_tls(
    broker: Arc<Broker>,
    listener: TcpListener,
    tls: TlsAcceptor,
) -> std::io::Result<RunningServer> {
    serve_with(broker, listener, Some(tls))
}

fn serve_with(
    broker: Arc<Broker>,
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
) -> std::io::Result<RunningServer> {
    let addr = listener.local_addr()?;
    let (stop, stop_rx) = watch::channel(false);
    let accept = tokio::spawn(accept_loop(broker, listener, tls, stop_rx));
    Ok(RunningServer { addr, stop, accept })
}

/// A TLS handshake that takes longer than this is given up.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

async fn serve_one(
    broker: Arc<Broker>,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    id: u64,
    tls: Option<TlsAcceptor>,
    stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let Some(tls) = tls else {
        let (rd, wr) = stream.into_split();
        return crate::connection::serve(broker, rd, wr, peer, id, None, stop).await;
    };
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(stream)).await {
        Ok(Ok(s)) => {
            let role = crate::tls::peer_role(s.get_ref().1);
            let (rd, wr) = tokio::io::split(s);
            crate::connection::serve(broker, rd, wr, peer, id, role, stop).await;
        }
        Ok(Err(e)) => {
            tracing::warn!(peer = %peer, error = %e, "TLS handshake failed");
        }
        Err(_) => tracing::warn!(peer = %peer, "TLS handshake timed out"),
    }
}

/// Turns away a connection over `broker.connections_max` or `broker.connections_per_ip_max`
/// as Pulsar does: an `Error` (NotAllowedError, request id -1) naming the bound, then the
/// connection closed (the stock clients fail that connection's attempt and try again later).
/// Over TLS the handshake is made first (within [`REFUSAL_HANDSHAKE`]), so the client can
/// read why.
fn refuse(broker: &Broker, stream: tokio::net::TcpStream, tls: Option<TlsAcceptor>, over: Over) {
    let (bound, message) = match over {
        Over::Total(n) => (
            "broker.connections_max",
            format!("the broker holds its most connections (broker.connections_max = {n}); try again later"),
        ),
        Over::PerIp(n) => (
            "broker.connections_per_ip_max",
            format!("this address holds the broker's most connections from one address (broker.connections_per_ip_max = {n}); try again later"),
        ),
    };
    let Some(slot) = broker.admission.refusing("pulsar", bound, over) else {
        return;
    };
    let error = frame(&cmd::error(ID_NONE, ServerError::NotAllowedError, message));
    tokio::spawn(async move {
        let _ = stream.set_nodelay(true);
        match tls {
            None => admission::refuse(stream, &error).await,
            Some(tls) => {
                if let Ok(Ok(s)) = tokio::time::timeout(REFUSAL_HANDSHAKE, tls.accept(stream)).await
                {
                    admission::refuse(s, &error).await;
                }
            }
        }
        drop(slot);
    });
}

/// How long a refused connection's TLS handshake may take.
const REFUSAL_HANDSHAKE: Duration = Duration::from_secs(2);

async fn accept_loop(
    broker: Arc<Broker>,
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    mut stop: watch::Receiver<bool>,
) {
    static IDS: AtomicU64 = AtomicU64::new(1);
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, peer)) => match broker.admission.admit(peer.ip()) {
                    Ok(admitted) => {
                        let id = IDS.fetch_add(1, Ordering::Relaxed);
                        let one = serve_one(Arc::clone(&broker), stream, peer, id, tls.clone(), stop.clone());
                        conns.spawn(async move {
                            one.await;
                            drop(admitted);
                        });
                    }
                    Err(over) => refuse(&broker, stream, tls.clone(), over),
                },
                Err(e) => broker.admission.accept_failed("pulsar", &e).await,
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            _ = stop.changed() => break,
        }
    }
    drop(listener);
    // Connections see the same stop signal: they finish in-flight sends and close.
    let drain = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(20), drain)
        .await
        .is_err()
    {
        tracing::warn!("connections did not finish within 20 s; aborting them");
        conns.abort_all();
    }
}

impl RunningServer {
    /// Stops accepting, lets every connection finish its in-flight sends, and returns once
    /// they are closed.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.accept.await;
    }
}
