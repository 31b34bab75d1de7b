//! The link on loopback: real QUIC, real TLS, certificates made as `meridian-admin geo` makes
//! them.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use meridian_config::GeoConfig;
use meridian_geo::frame::{Frame, OriginPosition, ReplicatedEntry, PROTOCOL_VERSION};
use meridian_geo::inflow::{EntryBuild, EntryShaper};
use meridian_geo::link::{read_frame, write_frame};
use meridian_geo::receiver::{Durable, Refusal, ReplicaSink, ReplicaTopic};
use meridian_geo::{GeoLink, LinkError, SiteDirectory};
use meridian_tenancy::geo_pki;
use meridian_tenancy::site_tls::{CertOptions, Issued};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

#[derive(Default)]
struct Registry(Mutex<BTreeSet<String>>);

impl SiteDirectory for Registry {
    fn knows<'a>(&'a self, site: &'a str) -> BoxFuture<'a, Result<bool, String>> {
        Box::pin(async move { Ok(self.0.lock().unwrap().contains(site)) })
    }
}

fn registry(sites: &[&str]) -> Arc<Registry> {
    Arc::new(Registry(Mutex::new(
        sites.iter().map(|s| s.to_string()).collect(),
    )))
}

struct Pki {
    ca: Issued,
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        Pki {
            ca: geo_pki::create_ca(30).unwrap(),
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn cert(&self, site: &str) -> Issued {
        let opts = CertOptions {
            days: 30,
            ..CertOptions::default()
        };
        geo_pki::create_site_cert(&self.ca.cert_pem, &self.ca.key_pem, site, &opts).unwrap()
    }

    /// Writes the site's files; `[geo]` pointing at them.
    fn config(&self, site: &str) -> GeoConfig {
        let issued = self.cert(site);
        self.write(site, &issued);
        let p = |f: String| self.dir.path().join(f).display().to_string();
        GeoConfig {
            listen: "127.0.0.1:0".into(),
            cert_file: p(format!("{site}.crt")),
            key_file: p(format!("{site}.key")),
            ca_file: p("ca.crt".into()),
            cert_reload_interval_ms: 100,
            handshake_timeout_ms: 5_000,
            ..GeoConfig::default()
        }
    }

    fn write(&self, site: &str, issued: &Issued) {
        std::fs::write(self.dir.path().join("ca.crt"), &self.ca.cert_pem).unwrap();
        std::fs::write(
            self.dir.path().join(format!("{site}.crt")),
            &issued.cert_pem,
        )
        .unwrap();
        std::fs::write(self.dir.path().join(format!("{site}.key")), &issued.key_pem).unwrap();
    }
}

async fn start(pki: &Pki, site: &str, known: &[&str]) -> GeoLink {
    GeoLink::start(&pki.config(site), site, registry(known), None)
        .await
        .unwrap()
}

/// A client that accepts any server certificate, presenting `cert` (or none), and sends a
/// hello naming `hello_site`: what the listener answers, or how it closed the connection.
async fn raw_dial(
    addr: SocketAddr,
    cert: Option<&Issued>,
    hello_site: &str,
) -> Result<Frame, String> {
    #[derive(Debug)]
    struct AnyServer(Arc<rustls::crypto::CryptoProvider>);
    impl rustls::client::danger::ServerCertVerifier for AnyServer {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &rustls::pki_types::ServerName<'_>,
            _: &[u8],
            _: rustls::pki_types::UnixTime,
        ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &rustls::DigitallySignedStruct,
        ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(
                m,
                c,
                d,
                &self.0.signature_verification_algorithms,
            )
        }
        fn verify_tls13_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &rustls::DigitallySignedStruct,
        ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(
                m,
                c,
                d,
                &self.0.signature_verification_algorithms,
            )
        }
        fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
            self.0.signature_verification_algorithms.supported_schemes()
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(provider)));
    let mut config = match cert {
        Some(c) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_slice(c.cert_pem.as_bytes()).unwrap()],
                PrivateKeyDer::from_pem_slice(c.key_pem.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![meridian_geo::tls::ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(config).unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    let run = async {
        let conn = endpoint
            .connect(addr, "meridian-geo")
            .unwrap()
            .await
            .map_err(|e| e.to_string())?;
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        write_frame(
            &mut send,
            &Frame::Hello {
                version: PROTOCOL_VERSION,
                site: hello_site.to_string(),
            },
        )
        .await
        .map_err(|e| e.to_string())?;
        match read_frame(&mut recv, 1 << 20).await {
            Ok(Some(f)) => Ok(f),
            Ok(None) => Err("stream ended".to_string()),
            Err(e) => Err(e.to_string()),
        }
    };
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("the listener answers or closes within 10 s")
}

#[tokio::test]
async fn given_two_sites_that_know_each_other_then_each_dials_the_other() {
    let pki = Pki::new();
    let east = start(&pki, "east", &["west"]).await;
    let west = start(&pki, "west", &["east"]).await;
    let peer = east.dial(west.local_addr(), "west").await.unwrap();
    assert_eq!(peer.site, "west");
    let back = west.dial(east.local_addr(), "east").await.unwrap();
    assert_eq!(back.site, "east");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(west.inbound().len(), 1);
    assert_eq!(west.inbound()[0].site, "east");
    assert_eq!(east.inbound()[0].site, "west");
}

#[tokio::test]
async fn given_peers_without_a_good_identity_then_the_listener_refuses_them() {
    let pki = Pki::new();
    let west = start(&pki, "west", &["east"]).await;
    let addr = west.local_addr();

    // The control: a certificate of the CA naming a known site is welcomed.
    let east = pki.cert("east");
    assert!(matches!(
        raw_dial(addr, Some(&east), "east").await,
        Ok(Frame::Welcome { .. })
    ));
    // No certificate: the handshake fails.
    let err = raw_dial(addr, None, "east").await.unwrap_err();
    assert!(err.contains("peer sent no certificates"), "{err}");
    // A certificate of another CA naming a known site: the handshake fails.
    let rogue = Pki::new().cert("east");
    let err = raw_dial(addr, Some(&rogue), "east").await.unwrap_err();
    assert!(err.contains("invalid peer certificate"), "{err}");
    // A site the registry does not know.
    let north = pki.cert("north");
    let err = raw_dial(addr, Some(&north), "north").await.unwrap_err();
    assert!(err.contains("north is not known to site west"), "{err}");
    // A hello naming another site than the certificate.
    let err = raw_dial(addr, Some(&east), "north").await.unwrap_err();
    assert!(err.contains("the certificate names \"east\""), "{err}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(west.inbound().is_empty(), "{:?}", west.inbound());

    // Dialing: the unknown site is told why; a listener whose certificate names another site
    // than the one dialed is refused by the dialer.
    let north_link = start(&pki, "north", &["west"]).await;
    match north_link.dial(addr, "west").await {
        Err(LinkError::Refused { reason, .. }) => {
            assert!(reason.contains("north is not known"), "{reason}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let east_link = start(&pki, "east", &["west"]).await;
    let err = east_link.dial(addr, "south").await.unwrap_err();
    assert!(err.to_string().contains("names site \"west\""), "{err}");
}

#[tokio::test]
async fn given_new_certificate_files_then_new_links_use_them_and_links_up_keep_going() {
    let pki = Pki::new();
    let west_cfg = pki.config("west");
    let west = GeoLink::start(&west_cfg, "west", registry(&["east"]), None)
        .await
        .unwrap();
    let east = start(&pki, "east", &["west"]).await;
    let first = east.dial(west.local_addr(), "west").await.unwrap();
    let old_serial = west.certificate_serial();

    // A damaged file is not taken: the old certificate stays in use.
    std::fs::write(&west_cfg.cert_file, "not a certificate").unwrap();
    let checks = west.reload_checks();
    while west.reload_checks() < checks + 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(west.certificate_serial(), old_serial);
    let _kept = east.dial(west.local_addr(), "west").await.unwrap();

    // A new certificate is.
    pki.write("west", &pki.cert("west"));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while west.certificate_serial() == old_serial {
        assert!(tokio::time::Instant::now() < deadline, "not reloaded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let second = east.dial(west.local_addr(), "west").await.unwrap();
    let served = second
        .conn
        .peer_identity()
        .unwrap()
        .downcast::<Vec<CertificateDer<'static>>>()
        .unwrap();
    let (_, cert) = x509_parser::parse_x509_certificate(&served[0]).unwrap();
    assert_eq!(cert.raw_serial_as_string(), west.certificate_serial());
    assert_ne!(cert.raw_serial_as_string(), old_serial);
    // The first link is still up.
    assert!(first.conn.close_reason().is_none());
    assert_eq!(
        west.inbound().iter().filter(|p| p.site == "east").count(),
        3
    );
    // A certificate naming another site is not taken.
    let serial = west.certificate_serial();
    pki.write("west", &pki.cert("south"));
    let checks = west.reload_checks();
    while west.reload_checks() < checks + 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(west.certificate_serial(), serial);
}

/// A site whose appends become durable a while after they are queued, counting the bytes
/// queued and not yet durable.
#[derive(Default)]
struct SlowSink {
    held: std::sync::atomic::AtomicU64,
    most: std::sync::atomic::AtomicU64,
    landed: std::sync::atomic::AtomicU64,
}

struct SlowSite(Arc<SlowSink>);
struct SlowTopic(Arc<SlowSink>);

impl ReplicaSink for SlowSite {
    fn open<'a>(
        &'a self,
        _origin: &'a str,
        _topic: &'a str,
        _partitions: u32,
    ) -> BoxFuture<'a, Result<(Box<dyn ReplicaTopic>, Option<OriginPosition>), Refusal>> {
        let t: Box<dyn ReplicaTopic> = Box::new(SlowTopic(Arc::clone(&self.0)));
        Box::pin(async move { Ok((t, None)) })
    }
}

impl ReplicaTopic for SlowTopic {
    fn submit(&self, entries: Vec<ReplicatedEntry>) -> BoxFuture<'_, Result<Durable, Refusal>> {
        use std::sync::atomic::Ordering::SeqCst;
        let s = Arc::clone(&self.0);
        Box::pin(async move {
            let bytes: u64 = entries.iter().map(|e| e.bytes.len() as u64).sum();
            let now = s.held.fetch_add(bytes, SeqCst) + bytes;
            s.most.fetch_max(now, SeqCst);
            let last = entries.last().map(|e| e.at);
            let n = entries.len() as u64;
            let d: Durable = Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(30)).await;
                s.held.fetch_sub(bytes, SeqCst);
                s.landed.fetch_add(n, SeqCst);
                Ok(last)
            });
            Ok(d)
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_peer_that_floods_many_streams_then_what_its_frames_hold_stays_within_the_budget() {
    use std::sync::atomic::Ordering::SeqCst;
    let pki = Pki::new();
    let budget = 512 * 1024;
    let sink = Arc::new(SlowSink::default());
    let east = GeoLink::start(
        &GeoConfig {
            frame_bytes_max: 64 * 1024,
            receive_bytes_max: budget,
            ..pki.config("east")
        },
        "east",
        registry(&["west"]),
        Some(Arc::new(SlowSite(Arc::clone(&sink)))),
    )
    .await
    .unwrap();
    let west = start(&pki, "west", &["east"]).await;
    let peer = west.dial(east.local_addr(), "east").await.unwrap();
    // 8 streams each send 20 frames of 15 entries of 4 KiB at once, never waiting for an
    // acknowledgement: 9.8 MB wanted in flight against a budget of 512 KiB.
    let (streams, frames, per_frame) = (8u64, 20u64, 15u64);
    let mut tasks = Vec::new();
    for s in 0..streams {
        let conn = peer.conn.clone();
        tasks.push(tokio::spawn(async move {
            let (mut send, mut recv) = conn.open_bi().await.unwrap();
            let open = Frame::Open {
                topic: format!("persistent://acme/g/t{s}"),
                partitions: 0,
            };
            write_frame(&mut send, &open).await.unwrap();
            let opened = read_frame(&mut recv, 1 << 20).await.unwrap();
            assert!(matches!(opened, Some(Frame::Opened { .. })), "{opened:?}");
            let writer = tokio::spawn(async move {
                for f in 0..frames {
                    let items = (0..per_frame)
                        .map(|i| ReplicatedEntry {
                            at: OriginPosition {
                                ledger: 1,
                                entry: f * per_frame + i,
                            },
                            bytes: bytes::Bytes::from(vec![s as u8; 4096]),
                        })
                        .collect();
                    write_frame(&mut send, &Frame::Entries { items })
                        .await
                        .unwrap();
                }
                send
            });
            let last = frames * per_frame - 1;
            loop {
                match read_frame(&mut recv, 1 << 20).await.unwrap() {
                    Some(Frame::Ack { up_to }) if up_to.entry == last => break,
                    Some(Frame::Ack { .. }) => {}
                    other => panic!("expected Ack, got {other:?}"),
                }
            }
            drop(writer.await.unwrap());
        }));
    }
    tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(tasks))
        .await
        .expect("every stream's frames land within 60 s")
        .into_iter()
        .for_each(|r| r.unwrap());
    assert_eq!(sink.landed.load(SeqCst), streams * frames * per_frame);
    let most = sink.most.load(SeqCst);
    assert!(
        most > 0 && most <= budget,
        "at most {most} bytes held at once, budget {budget}"
    );
}

/// A site that refuses an entry whose first byte is 0xff as its bytes come (a shaper of its
/// own), and makes the others durable at once.
struct PickySite;
struct PickyTopic;
struct Picky;
struct PickyEntry(Vec<u8>);

impl ReplicaSink for PickySite {
    fn open<'a>(
        &'a self,
        _origin: &'a str,
        _topic: &'a str,
        _partitions: u32,
    ) -> BoxFuture<'a, Result<(Box<dyn ReplicaTopic>, Option<OriginPosition>), Refusal>> {
        let t: Box<dyn ReplicaTopic> = Box::new(PickyTopic);
        Box::pin(async move { Ok((t, None)) })
    }
}

impl ReplicaTopic for PickyTopic {
    fn submit(&self, entries: Vec<ReplicatedEntry>) -> BoxFuture<'_, Result<Durable, Refusal>> {
        let last = entries.last().map(|e| e.at);
        Box::pin(async move {
            let d: Durable = Box::pin(async move { Ok(last) });
            Ok(d)
        })
    }

    fn shaper(&self) -> Arc<dyn EntryShaper> {
        Arc::new(Picky)
    }
}

impl EntryShaper for Picky {
    fn begin(&self, _at: OriginPosition, _len: usize) -> Box<dyn EntryBuild> {
        Box::new(PickyEntry(Vec::new()))
    }
}

impl EntryBuild for PickyEntry {
    fn push(&mut self, piece: &[u8]) -> Result<(), String> {
        if self.0.is_empty() && piece.first() == Some(&0xff) {
            return Err("begins with 0xff".into());
        }
        self.0.extend_from_slice(piece);
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<bytes::Bytes, String> {
        Ok(self.0.into())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_entry_its_site_refuses_as_it_arrives_then_the_frames_before_are_acknowledged_and_the_stream_says_why(
) {
    let pki = Pki::new();
    let east = GeoLink::start(
        &pki.config("east"),
        "east",
        registry(&["west"]),
        Some(Arc::new(PickySite)),
    )
    .await
    .unwrap();
    let west = start(&pki, "west", &["east"]).await;
    let peer = west.dial(east.local_addr(), "east").await.unwrap();
    let (mut send, mut recv) = peer.conn.open_bi().await.unwrap();
    let open = Frame::Open {
        topic: "persistent://acme/g/t".into(),
        partitions: 0,
    };
    write_frame(&mut send, &open).await.unwrap();
    let opened = read_frame(&mut recv, 1 << 20).await.unwrap();
    assert!(matches!(opened, Some(Frame::Opened { .. })), "{opened:?}");
    // Three frames of three 40 KiB entries each (many packets each); the middle frame's
    // middle entry is refused.
    for f in 0..3u64 {
        let items = (0..3u64)
            .map(|i| {
                let first = if (f, i) == (1, 1) { 0xff } else { 1 };
                let mut bytes = vec![7u8; 40 * 1024];
                bytes[0] = first;
                ReplicatedEntry {
                    at: OriginPosition {
                        ledger: 1,
                        entry: f * 3 + i,
                    },
                    bytes: bytes.into(),
                }
            })
            .collect();
        write_frame(&mut send, &Frame::Entries { items })
            .await
            .unwrap();
    }
    async fn read(
        recv: &mut quinn::RecvStream,
    ) -> Result<Result<Option<Frame>, meridian_geo::link::StreamError>, tokio::time::error::Elapsed>
    {
        tokio::time::timeout(Duration::from_secs(10), read_frame(recv, 1 << 20)).await
    }
    match read(&mut recv).await.unwrap().unwrap() {
        Some(Frame::Ack { up_to }) => assert_eq!((up_to.ledger, up_to.entry), (1, 2)),
        other => panic!("expected the first frame's Ack, got {other:?}"),
    }
    match read(&mut recv).await.unwrap().unwrap() {
        Some(Frame::Refused { code, reason }) => {
            assert_eq!(code, meridian_geo::frame::RefusalCode::Protocol);
            assert_eq!(reason, "entry 1:4 of site west begins with 0xff");
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    // Nothing after the refusal: the stream ends.
    assert!(matches!(read(&mut recv).await.unwrap(), Ok(None)));
}
