//! The link between sites: one QUIC endpoint per broker on `geo.listen` (UDP) that both
//! accepts peers and dials them.
//!
//! ```text
//!  dial(addr, site)                              accept loop (each connection its own task)
//!   QUIC + TLS 1.3 handshake (tls.rs) ─────────►  handshake: client certificate of the CA
//!                                                 site named by the certificate known to
//!                                                   the registry (SiteDirectory)? else close
//!                                                   REFUSED "unknown site ..."
//!   control stream: Hello{version, site} ──────►  same version, same site as the certificate?
//!                   ◄────── Welcome{version, site}  else close REFUSED / PROTOCOL
//! ```
//!
//! Every refusal is logged with the peer's address and the reason, and counted in
//! `meridian_geo_link_refused_total{reason}`. Certificates are re-read every
//! `geo.cert_reload_interval_ms`: a change that loads is used by new connections (the
//! listener's configuration is swapped, dials take the new one), connections up keep going; a
//! change that does not load is logged and the previous material kept.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::BytesMut;
use futures::future::BoxFuture;
use meridian_config::GeoConfig;
use tracing::{info, warn};

use crate::frame::{Frame, FrameError, LENGTH_BYTES, PROTOCOL_VERSION};
use crate::receiver::ReplicaSink;
use crate::tls::{peer_site, GeoTls, TlsError, TlsFiles, SERVER_NAME};

/// Close codes of the link's connections.
pub mod close {
    /// The endpoint is shutting down.
    pub const SHUTDOWN: u32 = 0;
    /// The peer's identity is refused (unknown site, hello naming another site).
    pub const REFUSED: u32 = 1;
    /// The peer broke the link protocol (bad frame, other version, no hello in time).
    pub const PROTOCOL: u32 = 2;
}

/// Which sites this site knows (its registry: a cluster record per site). A peer naming a
/// site it does not know is refused.
pub trait SiteDirectory: Send + Sync + 'static {
    fn knows<'a>(&'a self, site: &'a str) -> BoxFuture<'a, Result<bool, String>>;

    /// The geo URL (`quic://HOST:PORT`) of a site, from its cluster record.
    fn locate<'a>(&'a self, _site: &'a str) -> BoxFuture<'a, Result<Option<String>, String>> {
        Box::pin(async { Ok(None) })
    }
}

/// Why the link could not start, or a dial failed.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("geo.listen = {addr}: cannot bind: {reason}")]
    Bind { addr: String, reason: String },
    #[error("connecting to site {site} at {addr}: {reason}")]
    Connect {
        site: String,
        addr: SocketAddr,
        reason: String,
    },
    #[error("site {site} at {addr} refused the link: {reason}")]
    Refused {
        site: String,
        addr: SocketAddr,
        reason: String,
    },
    #[error("link to site {site} at {addr}: {what} took longer than {timeout:?}")]
    Timeout {
        site: String,
        addr: SocketAddr,
        what: &'static str,
        timeout: Duration,
    },
    #[error("site {site} cannot be reached: {reason}")]
    Unknown { site: String, reason: String },
    #[error("link to site {site} at {addr}: {reason}")]
    Protocol {
        site: String,
        addr: SocketAddr,
        reason: String,
    },
}

/// The link's limits, from `[geo]`.
#[derive(Debug, Clone)]
pub struct LinkOptions {
    pub frame_bytes_max: u64,
    /// Bytes of a peer connection's frames held here until durable (`geo.receive_bytes_max`).
    pub receive_bytes_max: u64,
    pub stall_after: Duration,
    pub idle_timeout: Duration,
    pub handshake_timeout: Duration,
    pub cert_reload_interval: Duration,
    /// How long a settled deletion's tombstone still refuses the topic's streams.
    pub tombstone_grace: Duration,
    /// How often replicated subscriptions are looked at (`geo.subscription_sync_interval_ms`).
    pub subscription_sync_interval: Duration,
    /// UDP segmentation offload (`geo.segmentation_offload`).
    pub segmentation_offload: bool,
    /// Where a peer is dialed instead of its cluster record's geo URL, by site name, or
    /// instead of one of its brokers' geo URLs, by that URL (`geo.routes`).
    pub routes: HashMap<String, String>,
}

impl From<&GeoConfig> for LinkOptions {
    fn from(c: &GeoConfig) -> Self {
        LinkOptions {
            frame_bytes_max: c.frame_bytes_max,
            receive_bytes_max: c.receive_bytes_max,
            stall_after: Duration::from_millis(c.stall_after_ms),
            idle_timeout: Duration::from_millis(c.idle_timeout_ms),
            handshake_timeout: Duration::from_millis(c.handshake_timeout_ms),
            cert_reload_interval: Duration::from_millis(c.cert_reload_interval_ms),
            tombstone_grace: Duration::from_millis(c.tombstone_grace_ms),
            subscription_sync_interval: Duration::from_millis(c.subscription_sync_interval_ms),
            segmentation_offload: c.segmentation_offload,
            // Checked with the rest of the configuration.
            routes: c.route_map().unwrap_or_default().into_iter().collect(),
        }
    }
}

/// A link to a peer site, after the handshake and the hello.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The peer site, as its certificate names it.
    pub site: String,
    pub conn: quinn::Connection,
}

/// A peer connected to this endpoint, for status pages and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboundPeer {
    pub site: String,
    pub addr: SocketAddr,
}

struct Shared {
    site: String,
    endpoint: quinn::Endpoint,
    tls: RwLock<Arc<GeoTls>>,
    transport: Arc<quinn::TransportConfig>,
    opts: LinkOptions,
    directory: Arc<dyn SiteDirectory>,
    inbound: Mutex<HashMap<usize, InboundPeer>>,
    /// Where peers' topic streams go (none: they are refused).
    sink: Option<Arc<dyn ReplicaSink>>,
    /// Links this site dialed, shared by its replicators to each remote; one slot per site,
    /// so a dial to a site that does not answer holds up no other.
    outbound: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Option<Peer>>>>>,
    /// Times the certificate files were looked at.
    reload_checks: std::sync::atomic::AtomicU64,
}

/// This site's end of the link.
pub struct GeoLink {
    shared: Arc<Shared>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    advertise: String,
}

impl std::fmt::Debug for GeoLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GeoLink")
            .field("site", &self.shared.site)
            .field("advertise", &self.advertise)
            .finish()
    }
}

fn transport(opts: &LinkOptions) -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    let idle = quinn::IdleTimeout::try_from(opts.idle_timeout).unwrap_or(quinn::VarInt::MAX.into());
    t.max_idle_timeout(Some(idle));
    t.keep_alive_interval(Some(opts.idle_timeout / 3));
    // Each replicated topic partition holds a stream of its own for as long as it replicates.
    t.max_concurrent_bidi_streams(STREAMS_MAX.into());
    t.enable_segmentation_offload(opts.segmentation_offload);
    // The peer acknowledges every tenth packet rather than every second one (QUIC's ACK
    // frequency extension; where the peer lacks it, this asks nothing): a receiving site
    // sent an ACK, and the sending site handled it, for every two packets of a stream.
    let mut acks = quinn::AckFrequencyConfig::default();
    acks.ack_eliciting_threshold(quinn::VarInt::from_u32(9));
    t.ack_frequency_config(Some(acks));
    // Flow control: quinn's defaults (1.25 MB a stream, 10 MB a connection in flight) are
    // below one replicator's window of the 4 MiB frames it sends, so a stream would wait for
    // the receiver's credit every megabyte. A stream may have two such frames in quinn's
    // buffers unread, a connection 64 MiB (the frames its streams have read and not yet made
    // durable are bounded apart, for the whole connection: `geo.receive_bytes_max`).
    t.stream_receive_window(STREAM_WINDOW_BYTES.into());
    t.receive_window(CONNECTION_WINDOW_BYTES.into());
    t.send_window(CONNECTION_WINDOW_BYTES.into());
    Arc::new(t)
}

/// Bytes a peer may send on one stream beyond what this site has read.
pub const STREAM_WINDOW_BYTES: u32 = 8 << 20;
/// Bytes a peer may send on a connection (all its streams) beyond what this site has read;
/// and what this site keeps unacknowledged towards a peer.
pub const CONNECTION_WINDOW_BYTES: u32 = 64 << 20;

/// Topic streams one peer may have open on a link at once.
pub const STREAMS_MAX: u32 = 100_000;

fn server_config(
    tls: &GeoTls,
    transport: &Arc<quinn::TransportConfig>,
) -> Result<quinn::ServerConfig, String> {
    let mut c = quinn::ServerConfig::with_crypto(Arc::new(tls.quic_server()?));
    c.transport_config(Arc::clone(transport));
    Ok(c)
}

impl GeoLink {
    /// Loads the certificates (naming `site`), binds `cfg.listen` and starts accepting peers
    /// that `directory` knows.
    pub async fn start(
        cfg: &GeoConfig,
        site: &str,
        directory: Arc<dyn SiteDirectory>,
        sink: Option<Arc<dyn ReplicaSink>>,
    ) -> Result<GeoLink, LinkError> {
        let files = TlsFiles {
            cert_file: cfg.cert_file.clone(),
            key_file: cfg.key_file.clone(),
            ca_file: cfg.ca_file.clone(),
        };
        let tls = files.load(site)?;
        let opts = LinkOptions::from(cfg);
        let transport = transport(&opts);
        let bind_err = |reason: String| LinkError::Bind {
            addr: cfg.listen.clone(),
            reason,
        };
        let addr: SocketAddr = cfg.listen.parse().map_err(|e| bind_err(format!("{e}")))?;
        let endpoint = quinn::Endpoint::new(
            quinn::EndpointConfig::new(Arc::new(tls.reset_key())),
            Some(server_config(&tls, &transport).map_err(bind_err)?),
            std::net::UdpSocket::bind(addr).map_err(|e| bind_err(e.to_string()))?,
            Arc::new(quinn::TokioRuntime),
        )
        .map_err(|e| bind_err(e.to_string()))?;
        let local = endpoint.local_addr().map_err(|e| bind_err(e.to_string()))?;
        let advertise = if cfg.advertise.is_empty() {
            local.to_string()
        } else {
            cfg.advertise.clone()
        };
        info!(site, %local, %advertise, serial = %tls.serial, "geo link listening");
        let shared = Arc::new(Shared {
            site: site.to_string(),
            endpoint,
            tls: RwLock::new(Arc::new(tls)),
            transport,
            opts,
            directory,
            inbound: Mutex::new(HashMap::new()),
            sink,
            outbound: Mutex::new(HashMap::new()),
            reload_checks: std::sync::atomic::AtomicU64::new(0),
        });
        let tasks = vec![
            tokio::spawn(accept_loop(Arc::clone(&shared))),
            tokio::spawn(reload_loop(Arc::clone(&shared), files)),
        ];
        Ok(GeoLink {
            shared,
            tasks,
            advertise,
        })
    }

    /// The bound UDP address.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared
            .endpoint
            .local_addr()
            .expect("a bound endpoint has an address")
    }

    /// What other sites dial (`geo.advertise`, else the bound address).
    pub fn advertise(&self) -> &str {
        &self.advertise
    }

    /// How many times the certificate files were looked at since the start.
    pub fn reload_checks(&self) -> u64 {
        self.shared
            .reload_checks
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The serial number of the certificate in use (hex).
    pub fn certificate_serial(&self) -> String {
        self.shared.tls.read().expect("tls lock").serial.clone()
    }

    /// Sites with a connection up, either way (for status pages).
    pub fn linked_sites(&self) -> std::collections::BTreeSet<String> {
        let mut out: std::collections::BTreeSet<String> =
            self.inbound().into_iter().map(|p| p.site).collect();
        let outbound = self.shared.outbound.lock().expect("outbound lock");
        for (key, slot) in outbound.iter() {
            let up = slot
                .try_lock()
                .is_ok_and(|p| p.as_ref().is_some_and(|p| p.conn.close_reason().is_none()));
            if up {
                out.insert(key.split(' ').next().unwrap_or(key).to_string());
            }
        }
        out
    }

    /// Peers connected to this endpoint now.
    pub fn inbound(&self) -> Vec<InboundPeer> {
        let mut v: Vec<_> = self
            .shared
            .inbound
            .lock()
            .expect("inbound lock")
            .values()
            .cloned()
            .collect();
        v.sort_by(|a, b| (&a.site, a.addr).cmp(&(&b.site, b.addr)));
        v
    }

    /// Dials `site` at `addr`: the handshake (its certificate must name `site`), then the
    /// hello on the control stream.
    pub async fn dial(&self, addr: SocketAddr, site: &str) -> Result<Peer, LinkError> {
        let shared = &self.shared;
        let timeout = shared.opts.handshake_timeout;
        let connect_err = |reason: String| LinkError::Connect {
            site: site.to_string(),
            addr,
            reason,
        };
        let crypto = {
            let tls = Arc::clone(&shared.tls.read().expect("tls lock"));
            tls.quic_client(site).map_err(connect_err)?
        };
        let mut client = quinn::ClientConfig::new(Arc::new(crypto));
        client.transport_config(Arc::clone(&shared.transport));
        let timed_out = |what| LinkError::Timeout {
            site: site.to_string(),
            addr,
            what,
            timeout,
        };
        let connecting = shared
            .endpoint
            .connect_with(client, addr, SERVER_NAME)
            .map_err(|e| connect_err(e.to_string()))?;
        let conn = tokio::time::timeout(timeout, connecting)
            .await
            .map_err(|_| timed_out("the TLS handshake"))?
            .map_err(|e| closed_error(site, addr, e))?;
        let hello = async {
            let (mut send, mut recv) = conn.open_bi().await?;
            write_frame(
                &mut send,
                &Frame::Hello {
                    version: PROTOCOL_VERSION,
                    site: shared.site.clone(),
                },
            )
            .await?;
            read_frame(&mut recv, shared.opts.frame_bytes_max).await
        };
        let answer = tokio::time::timeout(timeout, hello)
            .await
            .map_err(|_| timed_out("the hello"))?;
        match answer {
            Ok(Some(Frame::Welcome { version, site: s }))
                if version == PROTOCOL_VERSION && s == site =>
            {
                Ok(Peer {
                    site: site.to_string(),
                    conn,
                })
            }
            Ok(other) => {
                conn.close(close::PROTOCOL.into(), b"expected a welcome");
                Err(LinkError::Protocol {
                    site: site.to_string(),
                    addr,
                    reason: format!("expected a welcome of version {PROTOCOL_VERSION} from {site}, got {other:?}"),
                })
            }
            Err(StreamError::Connection(e)) => Err(closed_error(site, addr, e)),
            Err(e) => Err(LinkError::Protocol {
                site: site.to_string(),
                addr,
                reason: e.to_string(),
            }),
        }
    }

    /// How long a replicator with entries in flight waits for an acknowledgement before it
    /// rebuilds its stream (`geo.stall_after_ms`).
    pub fn stall_after(&self) -> Duration {
        self.shared.opts.stall_after
    }

    /// The largest frame a stream takes (`geo.frame_bytes_max`).
    pub fn frame_bytes_max(&self) -> u64 {
        self.shared.opts.frame_bytes_max
    }

    /// How long a settled deletion's tombstone still refuses the topic's streams
    /// (`geo.tombstone_grace_ms`).
    pub fn tombstone_grace(&self) -> Duration {
        self.shared.opts.tombstone_grace
    }

    /// How often replicated subscriptions are looked at (`geo.subscription_sync_interval_ms`).
    pub fn subscription_sync_interval(&self) -> Duration {
        self.shared.opts.subscription_sync_interval
    }

    /// A link to `site` for replicators: the one up, else a new one dialed at the geo URL of
    /// its cluster record.
    pub async fn peer(&self, site: &str) -> Result<Peer, LinkError> {
        let slot = Arc::clone(
            self.shared
                .outbound
                .lock()
                .expect("outbound lock")
                .entry(site.to_string())
                .or_default(),
        );
        let mut slot = slot.lock().await;
        if let Some(p) = slot.as_ref() {
            if p.conn.close_reason().is_none() {
                return Ok(p.clone());
            }
        }
        let unknown = |reason: String| LinkError::Unknown {
            site: site.to_string(),
            reason,
        };
        let url = match self.shared.opts.routes.get(site) {
            // A route says where, not whom: the site must be known here all the same.
            Some(route) => match self.shared.directory.knows(site).await {
                Ok(true) => format!("quic://{route}"),
                Ok(false) => return Err(unknown("it has no cluster record here".to_string())),
                Err(e) => return Err(unknown(e)),
            },
            None => self
                .shared
                .directory
                .locate(site)
                .await
                .map_err(unknown)?
                .ok_or_else(|| unknown("its cluster record has no geo URL".to_string()))?,
        };
        let peer = self.dial_url(site, &url).await?;
        *slot = Some(peer.clone());
        Ok(peer)
    }

    /// A link to `site` at one of its brokers' geo URL (`quic://HOST:PORT`; a topic's stream
    /// is served by the broker that owns the topic there), dialed where `geo.routes` sends
    /// that URL if it does: the one up, else a new one. The certificate that answers must
    /// name `site`, as for [`GeoLink::peer`].
    pub async fn peer_at(&self, site: &str, url: &str) -> Result<Peer, LinkError> {
        let slot = {
            let mut outbound = self.shared.outbound.lock().expect("outbound lock");
            // Links to brokers that went away are forgotten (a site's own slots stay).
            outbound.retain(|key, slot| {
                !key.contains(' ')
                    || slot.try_lock().map_or(true, |p| {
                        p.as_ref().is_some_and(|p| p.conn.close_reason().is_none())
                    })
            });
            Arc::clone(outbound.entry(format!("{site} {url}")).or_default())
        };
        let mut slot = slot.lock().await;
        if let Some(p) = slot.as_ref() {
            if p.conn.close_reason().is_none() {
                return Ok(p.clone());
            }
        }
        let peer = match self.shared.opts.routes.get(url) {
            Some(route) => self.dial_url(site, &format!("quic://{route}")).await?,
            None => self.dial_url(site, url).await?,
        };
        *slot = Some(peer.clone());
        Ok(peer)
    }

    async fn dial_url(&self, site: &str, url: &str) -> Result<Peer, LinkError> {
        let unknown = |reason: String| LinkError::Unknown {
            site: site.to_string(),
            reason,
        };
        let host_port = url
            .strip_prefix("quic://")
            .ok_or_else(|| unknown(format!("geo URL {url:?} is not quic://HOST:PORT")))?;
        let addr = tokio::net::lookup_host(host_port)
            .await
            .map_err(|e| unknown(format!("resolving {host_port}: {e}")))?
            .next()
            .ok_or_else(|| unknown(format!("{host_port} resolves to no address")))?;
        self.dial(addr, site).await
    }

    /// Closes every connection and stops accepting.
    pub async fn shutdown(&self) {
        for t in &self.tasks {
            t.abort();
        }
        self.shared
            .endpoint
            .close(close::SHUTDOWN.into(), b"site shutting down");
        let _ =
            tokio::time::timeout(Duration::from_secs(2), self.shared.endpoint.wait_idle()).await;
    }
}

impl Drop for GeoLink {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// A dial's failure from how its connection ended: the peer's refusal with its reason, or a
/// transport failure.
fn closed_error(site: &str, addr: SocketAddr, e: quinn::ConnectionError) -> LinkError {
    let reason = match &e {
        quinn::ConnectionError::ApplicationClosed(c) => {
            String::from_utf8_lossy(&c.reason).into_owned()
        }
        quinn::ConnectionError::ConnectionClosed(c) => format!("{c}"),
        other => {
            return LinkError::Connect {
                site: site.to_string(),
                addr,
                reason: other.to_string(),
            }
        }
    };
    LinkError::Refused {
        site: site.to_string(),
        addr,
        reason,
    }
}

/// Reading or writing a frame on a stream.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("the connection ended: {0}")]
    Connection(#[from] quinn::ConnectionError),
    #[error("the stream was reset or stopped: {0}")]
    Stream(String),
}

impl From<quinn::ReadExactError> for StreamError {
    fn from(e: quinn::ReadExactError) -> Self {
        match e {
            quinn::ReadExactError::ReadError(quinn::ReadError::ConnectionLost(c)) => {
                StreamError::Connection(c)
            }
            other => StreamError::Stream(other.to_string()),
        }
    }
}

impl From<quinn::WriteError> for StreamError {
    fn from(e: quinn::WriteError) -> Self {
        match e {
            quinn::WriteError::ConnectionLost(c) => StreamError::Connection(c),
            other => StreamError::Stream(other.to_string()),
        }
    }
}

/// Reads one frame; `None` at the stream's clean end before a frame began. A length over
/// `max` is refused before its bytes are read.
pub async fn read_frame(
    recv: &mut quinn::RecvStream,
    max: u64,
) -> Result<Option<Frame>, StreamError> {
    match read_frame_len(recv, max).await? {
        Some(len) => read_frame_body(recv, len, false).await.map(Some),
        None => Ok(None),
    }
}

/// Reads the next frame's length (checked against `max`); `None` at the stream's end.
pub async fn read_frame_len(
    recv: &mut quinn::RecvStream,
    max: u64,
) -> Result<Option<usize>, StreamError> {
    let mut prefix = [0u8; LENGTH_BYTES];
    match recv.read_exact(&mut prefix).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    Ok(Some(Frame::announced_len(prefix, max)?))
}

/// Reads the body of a frame whose length [`read_frame_len`] read.
///
/// The bytes are copied once out of quinn's buffers as they come (holding its chunks would
/// keep whole datagram buffers alive outside flow control), and the frame's entries are
/// slices of that copy. With `budgeted` (the caller holds `len` in its receive budget) the
/// buffer is allocated whole at once; otherwise it starts at 64 KiB at most and grows with
/// the bytes that came, so an announced length alone allocates no more than that.
pub async fn read_frame_body(
    recv: &mut quinn::RecvStream,
    len: usize,
    budgeted: bool,
) -> Result<Frame, StreamError> {
    let body = BytesMut::with_capacity(if budgeted { len } else { len.min(64 * 1024) });
    crate::inflow::read_body(recv, len, body).await
}

/// Writes one frame.
pub async fn write_frame(send: &mut quinn::SendStream, frame: &Frame) -> Result<(), StreamError> {
    let mut pieces = frame.encode_pieces();
    send.write_all_chunks(&mut pieces).await?;
    Ok(())
}

fn refused(reason: &'static str) {
    metrics::counter!("meridian_geo_link_refused_total", "reason" => reason).increment(1);
}

async fn accept_loop(shared: Arc<Shared>) {
    while let Some(incoming) = shared.endpoint.accept().await {
        tokio::spawn(serve_incoming(Arc::clone(&shared), incoming));
    }
}

async fn serve_incoming(shared: Arc<Shared>, incoming: quinn::Incoming) {
    let addr = incoming.remote_address();
    let timeout = shared.opts.handshake_timeout;
    let conn = match tokio::time::timeout(timeout, incoming).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            warn!(peer = %addr, error = %e, "geo link refused: the TLS handshake failed (no certificate, or not one of the federation CA)");
            refused("handshake");
            return;
        }
        Err(_) => {
            warn!(peer = %addr, "geo link refused: no TLS handshake within {timeout:?}");
            refused("handshake_timeout");
            return;
        }
    };
    let site = match peer_site(&conn) {
        Ok(s) => s,
        Err(e) => {
            warn!(peer = %addr, error = %e, "geo link refused: the certificate names no site");
            refused("identity");
            conn.close(close::REFUSED.into(), format!("refused: {e}").as_bytes());
            return;
        }
    };
    if site == shared.site {
        warn!(peer = %addr, site, "geo link refused: the certificate names this site");
        refused("identity");
        conn.close(
            close::REFUSED.into(),
            b"refused: the certificate names the site it dials",
        );
        return;
    }
    match shared.directory.knows(&site).await {
        Ok(true) => {}
        Ok(false) => {
            warn!(peer = %addr, site, "geo link refused: site {site} is not in this site's registry (clusters create {site} ...)");
            refused("unknown_site");
            conn.close(
                close::REFUSED.into(),
                format!("refused: site {site} is not known to site {}", shared.site).as_bytes(),
            );
            return;
        }
        Err(e) => {
            warn!(peer = %addr, site, error = %e, "geo link refused: the registry could not be read");
            refused("registry");
            conn.close(
                close::REFUSED.into(),
                b"refused: the registry could not be read; try again",
            );
            return;
        }
    }
    let hello = async {
        let (mut send, mut recv) = conn.accept_bi().await?;
        let first = read_frame(&mut recv, shared.opts.frame_bytes_max).await?;
        Ok::<_, StreamError>((
            send_welcome(&mut send, &shared.site, first, &site).await,
            send,
        ))
    };
    let outcome = tokio::time::timeout(timeout, hello).await;
    let (code, reason) = match outcome {
        Ok(Ok((Ok(()), _send))) => {
            let id = conn.stable_id();
            info!(peer = %addr, site, "geo link from site {site} up");
            shared.inbound.lock().expect("inbound lock").insert(
                id,
                InboundPeer {
                    site: site.clone(),
                    addr,
                },
            );
            metrics::gauge!("meridian_geo_links", "direction" => "inbound").increment(1.0);
            let why = serve_streams(&shared, &conn, &site).await;
            shared.inbound.lock().expect("inbound lock").remove(&id);
            metrics::gauge!("meridian_geo_links", "direction" => "inbound").decrement(1.0);
            info!(peer = %addr, site, reason = %why, "geo link from site {site} down");
            return;
        }
        Ok(Ok((Err((code, reason)), _))) => (code, reason),
        Ok(Err(e)) => (close::PROTOCOL, format!("bad hello: {e}")),
        Err(_) => (close::PROTOCOL, format!("no hello within {timeout:?}")),
    };
    warn!(peer = %addr, site, "geo link refused: {reason}");
    refused(if code == close::REFUSED {
        "identity"
    } else {
        "protocol"
    });
    conn.close(code.into(), reason.as_bytes());
}

/// Serves a peer's topic streams (each in a task of its own) until the connection ends.
async fn serve_streams(
    shared: &Arc<Shared>,
    conn: &quinn::Connection,
    site: &str,
) -> quinn::ConnectionError {
    // What this peer's frames may hold here, all its streams together.
    let budget = crate::budget::ReceiveBudget::new(shared.opts.receive_bytes_max, site);
    loop {
        let (send, recv) = match conn.accept_bi().await {
            Ok(s) => s,
            Err(e) => return e,
        };
        let Some(sink) = shared.sink.clone() else {
            let mut send = send;
            let _ = write_frame(
                &mut send,
                &Frame::Refused {
                    code: crate::frame::RefusalCode::NotAllowed,
                    reason: format!("site {} takes no replicated topics", shared.site),
                },
            )
            .await;
            let _ = send.finish();
            continue;
        };
        let (site, max, timeout) = (
            site.to_string(),
            shared.opts.frame_bytes_max,
            shared.opts.handshake_timeout,
        );
        let budget = budget.clone();
        tokio::spawn(async move {
            crate::receiver::serve_stream(sink.as_ref(), &site, send, recv, max, timeout, &budget)
                .await
        });
    }
}

/// Checks the dialer's hello against its certificate's site and answers it.
async fn send_welcome(
    send: &mut quinn::SendStream,
    own: &str,
    first: Option<Frame>,
    cert_site: &str,
) -> Result<(), (u32, String)> {
    match first {
        Some(Frame::Hello { version, site }) => {
            if version != PROTOCOL_VERSION {
                return Err((
                    close::PROTOCOL,
                    format!("link protocol version {version}; this site speaks {PROTOCOL_VERSION}"),
                ));
            }
            if site != cert_site {
                return Err((
                    close::REFUSED,
                    format!(
                        "the hello names site {site:?} but the certificate names {cert_site:?}"
                    ),
                ));
            }
        }
        other => return Err((close::PROTOCOL, format!("expected a hello, got {other:?}"))),
    }
    write_frame(
        send,
        &Frame::Welcome {
            version: PROTOCOL_VERSION,
            site: own.to_string(),
        },
    )
    .await
    .map_err(|e| (close::PROTOCOL, e.to_string()))
}

async fn reload_loop(shared: Arc<Shared>, files: TlsFiles) {
    let mut last = files.read().ok();
    loop {
        tokio::time::sleep(shared.opts.cert_reload_interval).await;
        let now = files.read();
        shared
            .reload_checks
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let now = match now {
            Ok(b) => b,
            Err(e) => {
                if last.is_some() {
                    warn!(error = %e, "geo certificates cannot be read; keeping the ones in use");
                }
                last = None;
                continue;
            }
        };
        if last.as_ref() == Some(&now) {
            continue;
        }
        last = Some(now);
        let loaded = files.load(&shared.site).and_then(|tls| {
            let config = server_config(&tls, &shared.transport).map_err(|reason| TlsError {
                key: "geo.cert_file",
                path: files.cert_file.clone(),
                reason,
            })?;
            Ok((tls, config))
        });
        match loaded {
            Ok((tls, config)) => {
                info!(serial = %tls.serial, "geo certificates reloaded; new connections use them, links up keep going");
                shared.endpoint.set_server_config(Some(config));
                *shared.tls.write().expect("tls lock") = Arc::new(tls);
                metrics::counter!("meridian_geo_cert_reloads_total", "outcome" => "loaded")
                    .increment(1);
            }
            Err(e) => {
                warn!(error = %e, "geo certificates changed but do not load; keeping the ones in use");
                metrics::counter!("meridian_geo_cert_reloads_total", "outcome" => "refused")
                    .increment(1);
            }
        }
    }
}
