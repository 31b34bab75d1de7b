//! The link's TLS: TLS 1.3 only, both ends present a site certificate of the federation's CA.
//!
//! ```text
//!  dialer (site A)                                 listener (site B)
//!   presents A.crt ───────── QUIC + TLS 1.3 ─────────► requires a client certificate that
//!   accepts only a certificate of the CA naming         verifies against the CA (else the
//!   the site it dialed (SiteVerifier)                   handshake fails); the site it names
//!                                                       is then checked against the registry
//! ```
//!
//! Certificates are files, re-read every `geo.cert_reload_interval_ms` ([`TlsFiles`]); a
//! change builds new configurations for new connections, and connections up keep going.

use std::fmt;
use std::sync::Arc;

use tokio_rustls::rustls;
use tokio_rustls::rustls::client::danger::{
    HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier,
};
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio_rustls::rustls::server::ParsedCertificate;

use crate::identity::site_of_certificate;
use meridian_metadata::tls::pem_certificates;

/// ALPN of the link; a peer speaking anything else fails the handshake.
pub const ALPN: &[u8] = b"meridian-geo/1";

/// The server name every dial uses (SNI). The server's certificate is checked for the site
/// dialed, not for a host name: sites move between hosts, their names do not.
pub const SERVER_NAME: &str = "meridian-geo";

/// A problem with one of the `[geo]` files: the key, the file and why.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{key} = {path:?}: {reason}")]
pub struct TlsError {
    pub key: &'static str,
    pub path: String,
    pub reason: String,
}

/// Where the site's certificate, key and the federation CA are.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert_file: String,
    pub key_file: String,
    pub ca_file: String,
}

impl TlsFiles {
    /// The three files' bytes (to see whether they changed).
    pub fn read(&self) -> Result<[Vec<u8>; 3], TlsError> {
        let read = |key: &'static str, path: &str| {
            std::fs::read(path).map_err(|e| TlsError {
                key,
                path: path.to_string(),
                reason: format!("cannot be read: {e}"),
            })
        };
        Ok([
            read("geo.cert_file", &self.cert_file)?,
            read("geo.key_file", &self.key_file)?,
            read("geo.ca_file", &self.ca_file)?,
        ])
    }

    /// Loads and checks the material (the certificate must name `site`).
    pub fn load(&self, site: &str) -> Result<GeoTls, TlsError> {
        let [cert, key, ca] = self.read()?;
        GeoTls::from_pem(&ca, &cert, &key, site).map_err(|(key, reason)| TlsError {
            key,
            path: match key {
                "geo.ca_file" => self.ca_file.clone(),
                "geo.key_file" => self.key_file.clone(),
                _ => self.cert_file.clone(),
            },
            reason,
        })
    }
}

/// A site's link material: its certificate and key, the federation CA, and the rustls
/// configurations built from them.
pub struct GeoTls {
    /// The site this certificate names.
    pub site: String,
    /// The certificate's serial number (hex), to tell one certificate from its successor.
    pub serial: String,
    roots: Arc<rustls::RootCertStore>,
    provider: Arc<CryptoProvider>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    server: Arc<rustls::ServerConfig>,
}

impl fmt::Debug for GeoTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GeoTls")
            .field("site", &self.site)
            .field("serial", &self.serial)
            .finish()
    }
}

impl GeoTls {
    /// From PEM bytes; an error names the `[geo]` key whose file is at fault. The
    /// certificate must name `site` (this site's `broker.cluster_name`).
    pub fn from_pem(
        ca_pem: &[u8],
        cert_pem: &[u8],
        key_pem: &[u8],
        site: &str,
    ) -> Result<GeoTls, (&'static str, String)> {
        let ca = pem_certificates(ca_pem, "geo.ca_file")?;
        let chain = pem_certificates(cert_pem, "geo.cert_file")?;
        let key = PrivateKeyDer::from_pem_slice(key_pem)
            .map_err(|e| ("geo.key_file", format!("not a PEM private key: {e}")))?;
        let named = site_of_certificate(&chain[0]).map_err(|e| ("geo.cert_file", e))?;
        if named != site {
            return Err((
                "geo.cert_file",
                format!(
                    "the certificate names site {named:?}, but this site is {site:?} (broker.cluster_name, --cluster)"
                ),
            ));
        }
        let serial = x509_parser::parse_x509_certificate(&chain[0])
            .map(|(_, c)| c.raw_serial_as_string())
            .map_err(|e| ("geo.cert_file", e.to_string()))?;
        let mut roots = rustls::RootCertStore::empty();
        for c in ca {
            roots
                .add(c)
                .map_err(|e| ("geo.ca_file", format!("not a usable CA certificate: {e}")))?;
        }
        let roots = Arc::new(roots);
        // AES-128-GCM first, as between a site's roles.
        let provider = Arc::new(meridian_metadata::tls::aes_128_first_provider());
        // The certificate must verify against the CA we were given: a site certificate from
        // another federation would be refused by every peer, so refuse it here first.
        let parsed =
            ParsedCertificate::try_from(&chain[0]).map_err(|e| ("geo.cert_file", e.to_string()))?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &roots,
            &chain[1..],
            UnixTime::now(),
            provider.signature_verification_algorithms.all,
        )
        .map_err(|e| {
            (
                "geo.cert_file",
                format!("does not verify against geo.ca_file: {e}"),
            )
        })?;
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::clone(&roots),
            Arc::clone(&provider),
        )
        .build()
        .map_err(|e| ("geo.ca_file", e.to_string()))?;
        let mut server = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| ("geo.cert_file", e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| ("geo.key_file", format!("does not match geo.cert_file: {e}")))?;
        server.alpn_protocols = vec![ALPN.to_vec()];
        Ok(GeoTls {
            site: named,
            serial,
            roots,
            provider,
            chain,
            key,
            server: Arc::new(server),
        })
    }

    /// The key of the endpoint's stateless resets, derived from the site's private key: the
    /// same after a restart, so peers' connections to the process before it end at its first
    /// reset instead of at their idle timeout.
    pub fn reset_key(&self) -> ring::hmac::Key {
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        ctx.update(b"meridian-geo stateless reset v1");
        ctx.update(self.key.secret_der());
        ring::hmac::Key::new(ring::hmac::HMAC_SHA256, ctx.finish().as_ref())
    }

    /// The listener's QUIC crypto.
    pub fn quic_server(&self) -> Result<quinn::crypto::rustls::QuicServerConfig, String> {
        quinn::crypto::rustls::QuicServerConfig::try_from(Arc::clone(&self.server))
            .map_err(|e| format!("the link's TLS configuration: {e}"))
    }

    /// A dialer's QUIC crypto for a connection to `expected_site`: presents this site's
    /// certificate and accepts only a certificate of the CA naming `expected_site`.
    pub fn quic_client(
        &self,
        expected_site: &str,
    ) -> Result<quinn::crypto::rustls::QuicClientConfig, String> {
        let verifier = Arc::new(SiteVerifier {
            roots: Arc::clone(&self.roots),
            provider: Arc::clone(&self.provider),
            expected: expected_site.to_string(),
        });
        let mut client = rustls::ClientConfig::builder_with_provider(Arc::clone(&self.provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| e.to_string())?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| e.to_string())?;
        client.alpn_protocols = vec![ALPN.to_vec()];
        quinn::crypto::rustls::QuicClientConfig::try_from(client)
            .map_err(|e| format!("the link's TLS configuration: {e}"))
    }
}

/// The site a QUIC connection's peer certificate names (the handshake has verified it
/// against the CA).
pub fn peer_site(conn: &quinn::Connection) -> Result<String, String> {
    let chain = conn
        .peer_identity()
        .and_then(|any| any.downcast::<Vec<CertificateDer<'static>>>().ok())
        .ok_or("the peer presented no certificate")?;
    let first = chain.first().ok_or("the peer presented no certificate")?;
    site_of_certificate(first)
}

/// A dialer's check of the listener: the chain verifies against the federation CA, and the
/// certificate names the site dialed.
#[derive(Debug)]
struct SiteVerifier {
    roots: Arc<rustls::RootCertStore>,
    provider: Arc<CryptoProvider>,
    expected: String,
}

impl ServerCertVerifier for SiteVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        let site = site_of_certificate(end_entity).map_err(rustls::Error::General)?;
        if site != self.expected {
            return Err(rustls::Error::General(format!(
                "the peer's certificate names site {site:?}, not {:?} which was dialed",
                self.expected
            )));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
