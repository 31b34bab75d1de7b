//! Mutual TLS between a site's roles, and who may use which internal port.
//!
//! Every process of a site with `[tls]` set holds a certificate issued by the site's internal
//! CA (`meridian-admin site-tls`). The certificate names the process in a subject alternative
//! name `meridian://site/<site>/role/<role>/<name>`. Servers (metadata nodes, bookies) accept
//! only TLS, require a client certificate that verifies against the site CA alone (a
//! certificate of another site's CA fails the handshake), and then check the role the
//! certificate names against what the request needs:
//!
//! ```text
//!  port                     admitted roles
//!  metadata client gRPC     broker, bookie, admin, metadata (a follower forwarding)
//!    add/remove member      admin, metadata
//!  metadata Raft gRPC       metadata, named by a member's node id
//!  bookie add/fence/delete  broker (its ledger client writes and recovers)
//!  bookie reads             broker, bookie, admin
//! ```
//!
//! Clients check the other way too: a metadata client accepts only a server certificate naming a
//! metadata node of its site, a bookie client only a bookie's ([`RoleVerifier`]), so a stolen
//! broker key cannot pose as the metadata store.
//!
//! This module owns the identity format, the refusal rule and the rustls/tonic configurations;
//! the services call [`authorize`] with the roles they admit. Without `[tls]` nothing here runs
//! and the ports are plaintext (standalone on loopback by default).

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use meridian_config::TlsConfig;
pub use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// Scheme and authority of identity URIs.
pub const URI_PREFIX: &str = "meridian://site/";

/// What a process is to the rest of its site.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProcessRole {
    /// A metadata node (its certificate's name is its node id).
    Metadata,
    /// A bookie.
    Bookie,
    /// A broker (also the role of tools that write ledgers: `perf ledger`, `ledger recover`).
    Broker,
    /// The admin service and operators' tools (`meridian meta`, `meridian ledger read`).
    Admin,
}

impl ProcessRole {
    pub const ALL: [ProcessRole; 4] = [
        ProcessRole::Metadata,
        ProcessRole::Bookie,
        ProcessRole::Broker,
        ProcessRole::Admin,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ProcessRole::Metadata => "metadata",
            ProcessRole::Bookie => "bookie",
            ProcessRole::Broker => "broker",
            ProcessRole::Admin => "admin",
        }
    }
}

impl fmt::Display for ProcessRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ProcessRole {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        ProcessRole::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| {
                format!("unknown role {s:?}; expected metadata, bookie, broker or admin")
            })
    }
}

/// Roles admitted to the metadata store's client API (a follower forwards to the leader as
/// itself).
pub const METADATA_API_ROLES: &[ProcessRole] = &[
    ProcessRole::Broker,
    ProcessRole::Bookie,
    ProcessRole::Admin,
    ProcessRole::Metadata,
];
/// Roles that may add and remove members (of the client API's roles): admin tools, and metadata
/// nodes forwarding such a request to the leader.
pub const MEMBERSHIP_ROLES: &[ProcessRole] = &[ProcessRole::Admin, ProcessRole::Metadata];
/// Roles admitted to Raft RPCs (the node also checks the name is a member's id).
pub const RAFT_ROLES: &[ProcessRole] = &[ProcessRole::Metadata];
/// Roles that may change what a bookie stores (add, fence, delete): brokers, whose ledger
/// clients write and recover ledgers (tools that write, `perf ledger` and `ledger recover`,
/// run with a broker's certificate).
pub const BOOKIE_WRITE_ROLES: &[ProcessRole] = &[ProcessRole::Broker];
/// Roles that may read a bookie's entries and LACs.
pub const BOOKIE_READ_ROLES: &[ProcessRole] =
    &[ProcessRole::Broker, ProcessRole::Bookie, ProcessRole::Admin];

/// Who a certificate says its holder is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub site: String,
    pub role: ProcessRole,
    pub name: String,
}

/// Site and process names: 1..=64 of `A-Z a-z 0-9 . _ -`, so a URI never needs escaping.
pub fn check_name(what: &str, s: &str) -> Result<(), String> {
    let ok = !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} {s:?} must be 1 to 64 characters of A-Z, a-z, 0-9, '.', '_' or '-'"
        ))
    }
}

impl Identity {
    pub fn new(site: &str, role: ProcessRole, name: &str) -> Result<Self, String> {
        check_name("site", site)?;
        check_name("name", name)?;
        Ok(Identity {
            site: site.to_string(),
            role,
            name: name.to_string(),
        })
    }

    /// `meridian://site/<site>/role/<role>/<name>`.
    pub fn uri(&self) -> String {
        format!("{URI_PREFIX}{}/role/{}/{}", self.site, self.role, self.name)
    }

    /// Parses [`Identity::uri`]'s form; anything else is refused with the reason.
    pub fn parse_uri(uri: &str) -> Result<Self, String> {
        let bad = || format!("{uri:?} is not meridian://site/<site>/role/<role>/<name>");
        let rest = uri.strip_prefix(URI_PREFIX).ok_or_else(bad)?;
        let parts: Vec<&str> = rest.split('/').collect();
        let [site, "role", role, name] = parts[..] else {
            return Err(bad());
        };
        Identity::new(site, role.parse()?, name)
    }

    /// The identity a certificate (DER) names: its one subject alternative name of the form
    /// [`Identity::uri`]. A certificate with none, or with two, names nobody.
    pub fn from_certificate(der: &[u8]) -> Result<Self, String> {
        Identity::parse_uri(&meridian_uri(der, "its role")?)
    }
}

/// The one `meridian://site/...` subject alternative name of a certificate (DER); `naming`
/// says what it should name, for the error when there is none. Two of them name nobody.
pub fn meridian_uri(der: &[u8], naming: &str) -> Result<String, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("not an X.509 certificate: {e}"))?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| format!("bad subject alternative names: {e}"))?
        .ok_or_else(|| {
            format!("the certificate has no subject alternative name naming {naming}")
        })?;
    let mut found = san.value.general_names.iter().filter_map(|n| match n {
        x509_parser::extensions::GeneralName::URI(u) if u.starts_with(URI_PREFIX) => Some(*u),
        _ => None,
    });
    let uri = found.next().ok_or_else(|| {
        format!("the certificate has no meridian://site/... name naming {naming}")
    })?;
    if found.next().is_some() {
        return Err("the certificate names more than one meridian identity".to_string());
    }
    Ok(uri.to_string())
}

/// The certificates of a PEM file; `key` names the configuration key in the error.
pub fn pem_certificates(
    pem: &[u8],
    key: &'static str,
) -> Result<Vec<CertificateDer<'static>>, (&'static str, String)> {
    let v = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| (key, format!("not PEM certificates: {e}")))?;
    if v.is_empty() {
        return Err((key, "no certificate in it".to_string()));
    }
    Ok(v)
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:?} of site {:?}", self.role, self.name, self.site)
    }
}

/// The rule every internal port applies: the peer's certificate must name this site and one
/// of `allowed`. `what` names the port or request in the refusal.
pub fn authorize<'a>(
    peer: Result<&'a Identity, &str>,
    own_site: &str,
    allowed: &[ProcessRole],
    what: &str,
) -> Result<&'a Identity, String> {
    let peer = peer.map_err(|e| format!("{what} refused: {e}"))?;
    if peer.site != own_site {
        return Err(format!(
            "{what} refused: the certificate names {peer}, this is site {own_site:?}"
        ));
    }
    if !allowed.contains(&peer.role) {
        let allowed: Vec<&str> = allowed.iter().map(|r| r.as_str()).collect();
        return Err(format!(
            "{what} refused to {peer}: only {} may",
            allowed.join(", ")
        ));
    }
    Ok(peer)
}

/// Why TLS between roles could not be set up; names the `[tls]` key at fault.
#[derive(Debug, thiserror::Error)]
#[error("{key} {path}: {reason}")]
pub struct TlsError {
    pub key: &'static str,
    pub path: String,
    pub reason: String,
}

/// Checks a server's certificate as webpki does (the site CA, the address's name), then that it
/// names one of `expected` of this site, or this very process (a standalone's own store).
#[derive(Debug)]
pub struct RoleVerifier {
    inner: Arc<rustls::client::WebPkiServerVerifier>,
    own: Identity,
    expected: &'static [ProcessRole],
}

impl rustls::client::danger::ServerCertVerifier for RoleVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let verified = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        let peer = Identity::from_certificate(end_entity)
            .map_err(|e| rustls::Error::General(format!("the server's certificate: {e}")))?;
        if peer == self.own || (peer.site == self.own.site && self.expected.contains(&peer.role)) {
            return Ok(verified);
        }
        let expected: Vec<&str> = self.expected.iter().map(|r| r.as_str()).collect();
        Err(rustls::Error::General(format!(
            "the server's certificate names {peer}; expected a {} of site {:?}",
            expected.join(" or "),
            self.own.site
        )))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// A process's TLS material: its certificate and key, the site CA, and the configurations
/// built from them once.
pub struct SiteTls {
    /// Who this process is (from its own certificate).
    pub identity: Identity,
    ca_pem: Vec<u8>,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    server: Arc<rustls::ServerConfig>,
    /// Connections to bookies: the server must be a bookie of this site.
    client: Arc<rustls::ClientConfig>,
    /// Connections to metadata nodes (tonic): the server must be a metadata node of this site.
    metadata_verifier: Arc<RoleVerifier>,
    /// Identities of peer certificates already parsed, by their DER bytes (a gRPC request
    /// carries its connection's certificate; parsing it once per request would cost more).
    seen: Mutex<HashMap<Vec<u8>, Result<Identity, String>>>,
}

impl fmt::Debug for SiteTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SiteTls")
            .field("identity", &self.identity)
            .finish()
    }
}

/// Peer identities cached at most; the cache starts over past it.
const SEEN_MAX: usize = 4096;

impl SiteTls {
    /// The `[tls]` section's material, or `None` when TLS between roles is off.
    pub fn load(cfg: &TlsConfig) -> Result<Option<Arc<SiteTls>>, TlsError> {
        if !cfg.enabled() {
            return Ok(None);
        }
        let read = |key: &'static str, path: &str| {
            std::fs::read(path).map_err(|e| TlsError {
                key,
                path: path.to_string(),
                reason: format!("cannot be read: {e}"),
            })
        };
        let ca = read("tls.ca_file", &cfg.ca_file)?;
        let cert = read("tls.cert_file", &cfg.cert_file)?;
        let key = read("tls.key_file", &cfg.key_file)?;
        Self::from_pem(ca, cert, key)
            .map(|t| Some(Arc::new(t)))
            .map_err(|(key, reason)| TlsError {
                key,
                path: match key {
                    "tls.ca_file" => cfg.ca_file.clone(),
                    "tls.key_file" => cfg.key_file.clone(),
                    _ => cfg.cert_file.clone(),
                },
                reason,
            })
    }

    /// From PEM bytes; an error names the `[tls]` key whose file is at fault.
    pub fn from_pem(
        ca_pem: Vec<u8>,
        cert_pem: Vec<u8>,
        key_pem: Vec<u8>,
    ) -> Result<SiteTls, (&'static str, String)> {
        let ca = pem_certificates(&ca_pem, "tls.ca_file")?;
        let chain = pem_certificates(&cert_pem, "tls.cert_file")?;
        let private = || {
            PrivateKeyDer::from_pem_slice(&key_pem)
                .map_err(|e| ("tls.key_file", format!("not a PEM private key: {e}")))
        };
        let identity = Identity::from_certificate(&chain[0]).map_err(|e| ("tls.cert_file", e))?;
        let mut roots = rustls::RootCertStore::empty();
        for c in ca {
            roots
                .add(c)
                .map_err(|e| ("tls.ca_file", format!("not a usable CA certificate: {e}")))?;
        }
        let roots = Arc::new(roots);
        let provider = Arc::new(aes_128_first_provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::clone(&roots),
            Arc::clone(&provider),
        )
        .build()
        .map_err(|e| ("tls.ca_file", e.to_string()))?;
        let mut server = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| ("tls.cert_file", e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), private()?)
            .map_err(|e| ("tls.key_file", format!("does not match tls.cert_file: {e}")))?;
        server.alpn_protocols = vec![b"meridian-bookie".to_vec()];
        let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::clone(&roots),
            Arc::clone(&provider),
        )
        .build()
        .map_err(|e| ("tls.ca_file", e.to_string()))?;
        let verifier = |expected| {
            Arc::new(RoleVerifier {
                inner: Arc::clone(&webpki),
                own: identity.clone(),
                expected,
            })
        };
        let mut client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| ("tls.cert_file", e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(verifier(&[ProcessRole::Bookie]))
            .with_client_auth_cert(chain, private()?)
            .map_err(|e| ("tls.key_file", format!("does not match tls.cert_file: {e}")))?;
        client.alpn_protocols = vec![b"meridian-bookie".to_vec()];
        let metadata_verifier = verifier(&[ProcessRole::Metadata]);
        Ok(SiteTls {
            metadata_verifier,
            identity,
            ca_pem,
            cert_pem,
            key_pem,
            server: Arc::new(server),
            client: Arc::new(client),
            seen: Mutex::new(HashMap::new()),
        })
    }

    /// This process's site.
    pub fn site(&self) -> &str {
        &self.identity.site
    }

    /// The identity a peer's certificate chain names (its first certificate), cached.
    pub fn peer_identity(&self, chain: Option<&[CertificateDer<'_>]>) -> Result<Identity, String> {
        let Some(first) = chain.and_then(|c| c.first()) else {
            return Err("no client certificate".to_string());
        };
        let mut seen = self.seen.lock().expect("identity cache lock");
        if let Some(known) = seen.get(first.as_ref()) {
            return known.clone();
        }
        let identity = Identity::from_certificate(first);
        if seen.len() >= SEEN_MAX {
            seen.clear();
        }
        seen.insert(first.as_ref().to_vec(), identity.clone());
        identity
    }

    /// Checks a peer's certificate chain against `allowed` ([`authorize`]).
    pub fn authorize_peer(
        &self,
        chain: Option<&[CertificateDer<'_>]>,
        allowed: &[ProcessRole],
        what: &str,
    ) -> Result<Identity, String> {
        let peer = self.peer_identity(chain);
        authorize(
            peer.as_ref().map_err(String::as_str),
            self.site(),
            allowed,
            what,
        )
        .cloned()
    }

    /// A bookie's acceptor: TLS only, a client certificate of the site CA required.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(Arc::clone(&self.server))
    }

    /// A connector to bookies: presents this process's certificate, trusts only the site CA and
    /// only a bookie's certificate (or this process's own).
    pub fn connector(&self) -> tokio_rustls::TlsConnector {
        tokio_rustls::TlsConnector::from(Arc::clone(&self.client))
    }

    /// A gRPC server's TLS (metadata nodes): client certificates of the site CA required.
    pub fn tonic_server(&self) -> tonic::transport::ServerTlsConfig {
        tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(
                &self.cert_pem,
                &self.key_pem,
            ))
            .client_ca_root(tonic::transport::Certificate::from_pem(&self.ca_pem))
            .client_auth_optional(false)
            // A peer that opens a connection and never finishes its handshake is dropped.
            .timeout(std::time::Duration::from_secs(10))
    }

    /// A gRPC client's TLS to metadata nodes: this process's certificate; the server's is
    /// checked by [`SiteTls::metadata_verifier`] (give both to
    /// `Endpoint::tls_config_with_verifier`).
    pub fn tonic_client(&self) -> tonic::transport::ClientTlsConfig {
        tonic::transport::ClientTlsConfig::new().identity(tonic::transport::Identity::from_pem(
            &self.cert_pem,
            &self.key_pem,
        ))
    }

    /// The site CA as the only root, and a server certificate naming a metadata node of this
    /// site (or this process itself).
    pub fn metadata_verifier(&self) -> Arc<RoleVerifier> {
        Arc::clone(&self.metadata_verifier)
    }
}

/// The name a server at `addr` (`HOST:PORT`) must have in its certificate: its IP address,
/// or its DNS name.
pub fn server_name(addr: &str) -> Result<ServerName<'static>, String> {
    let host = match addr.rsplit_once(':') {
        Some((h, _)) => h.trim_start_matches('[').trim_end_matches(']'),
        None => addr,
    };
    ServerName::try_from(host.to_string()).map_err(|e| format!("{addr}: not a server name: {e}"))
}

/// A tonic interceptor admitting only requests whose TLS peer is of `allowed`; with `tls`
/// `None` (plaintext) every request passes. A refusal is PERMISSION_DENIED (UNAUTHENTICATED
/// without a certificate), and logged.
pub fn interceptor(
    tls: Option<Arc<SiteTls>>,
    allowed: &'static [ProcessRole],
    what: &'static str,
) -> impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone {
    move |request: tonic::Request<()>| {
        let Some(tls) = &tls else {
            return Ok(request);
        };
        let certs = request.peer_certs();
        match tls.authorize_peer(certs.as_deref().map(Vec::as_slice), allowed, what) {
            Ok(_) => Ok(request),
            Err(reason) => Err(refusal(&request, certs.is_none(), reason)),
        }
    }
}

/// Logs a refused request and builds its status.
pub fn refusal<T>(request: &tonic::Request<T>, no_cert: bool, reason: String) -> tonic::Status {
    let peer = request
        .remote_addr()
        .map_or_else(|| "?".to_string(), |a| a.to_string());
    tracing::warn!(%peer, %reason, "request refused");
    if no_cert {
        tonic::Status::unauthenticated(reason)
    } else {
        tonic::Status::permission_denied(reason)
    }
}

/// ring's suites with AES-128-GCM first (ring puts AES-256-GCM first), for connections whose
/// both ends are Meridian's (between roles, the geo link): each byte is sealed at one end and
/// opened at the other, and AES-128 does 10 rounds to AES-256's 14. Both ends prefer it, so
/// they negotiate it; nothing is dropped, so a peer that offers only AES-256 still connects.
pub fn aes_128_first_provider() -> rustls::crypto::CryptoProvider {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(site: &str, role: ProcessRole, name: &str) -> Identity {
        Identity::new(site, role, name).unwrap()
    }

    /// A CA of `site` and certificates of it (the real ones come from `meridian-admin
    /// site-tls`, in `meridian-tenancy`, which this crate cannot use).
    struct Pki {
        ca: rcgen::Certificate,
        ca_key: rcgen::KeyPair,
    }

    impl Pki {
        fn new(site: &str) -> Pki {
            let ca_key = rcgen::KeyPair::generate().unwrap();
            let mut p = rcgen::CertificateParams::default();
            p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            p.distinguished_name
                .push(rcgen::DnType::CommonName, format!("{site} CA"));
            let ca = p.self_signed(&ca_key).unwrap();
            Pki { ca, ca_key }
        }

        /// The `[tls]` material of a process `name` of `role`, its certificate issued by this CA.
        fn cert(&self, site: &str, role: ProcessRole, name: &str) -> SiteTls {
            let id = Identity::new(site, role, name).unwrap();
            let key = rcgen::KeyPair::generate().unwrap();
            let mut p = rcgen::CertificateParams::default();
            p.subject_alt_names = vec![
                rcgen::SanType::URI(id.uri().try_into().unwrap()),
                rcgen::SanType::IpAddress("127.0.0.1".parse().unwrap()),
            ];
            p.extended_key_usages = vec![
                rcgen::ExtendedKeyUsagePurpose::ServerAuth,
                rcgen::ExtendedKeyUsagePurpose::ClientAuth,
            ];
            let cert = p.signed_by(&key, &self.ca, &self.ca_key).unwrap();
            SiteTls::from_pem(
                self.ca.pem().into_bytes(),
                cert.pem().into_bytes(),
                key.serialize_pem().into_bytes(),
            )
            .unwrap()
        }
    }

    /// Serves one TLS handshake with `server`'s acceptor; returns the client's outcome (the
    /// suite negotiated).
    async fn handshake(server: &SiteTls, client: &SiteTls) -> Result<rustls::CipherSuite, String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = server.acceptor();
        tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            if let Ok(mut s) = acceptor.accept(tcp).await {
                use tokio::io::AsyncWriteExt;
                let _ = s.write_all(b"x").await;
                let _ = s.flush().await;
            }
        });
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut s = client
            .connector()
            .connect(server_name(&addr.to_string()).unwrap(), tcp)
            .await
            .map_err(|e| e.to_string())?;
        use tokio::io::AsyncReadExt;
        let mut b = [0u8; 1];
        s.read_exact(&mut b).await.map_err(|e| e.to_string())?;
        let suite = s.get_ref().1.negotiated_cipher_suite();
        suite.map(|s| s.suite()).ok_or_else(|| "no suite".into())
    }

    #[tokio::test]
    async fn given_a_server_certificate_of_another_role_then_clients_refuse_it() {
        let east = Pki::new("east");
        let bookie = east.cert("east", ProcessRole::Bookie, "bk1");
        let broker = east.cert("east", ProcessRole::Broker, "b1");
        let broker2 = east.cert("east", ProcessRole::Broker, "b2");
        let node = east.cert("east", ProcessRole::Metadata, "1");
        // A bookie client (a broker) takes a bookie, not a broker posing as one; both ends
        // prefer AES-128-GCM.
        assert_eq!(
            handshake(&bookie, &broker).await.unwrap(),
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
        );
        let err = handshake(&broker2, &broker).await.unwrap_err();
        assert!(err.contains("expected a bookie"), "{err}");
        // A certificate of the right role from another CA is refused by webpki first.
        let west = Pki::new("west");
        let west_bookie = west.cert("east", ProcessRole::Bookie, "bk1");
        let err = handshake(&west_bookie, &broker).await.unwrap_err();
        assert!(err.contains("UnknownIssuer"), "{err}");
        // The metadata verifier: metadata nodes only (or the process itself).
        use rustls::client::danger::ServerCertVerifier;
        let verify = |client: &SiteTls, server: &SiteTls| {
            let pem = server.cert_pem.clone();
            let der = CertificateDer::pem_slice_iter(&pem)
                .next()
                .unwrap()
                .unwrap();
            client
                .metadata_verifier()
                .verify_server_cert(
                    &der,
                    &[],
                    &server_name("127.0.0.1:1").unwrap(),
                    &[],
                    rustls::pki_types::UnixTime::now(),
                )
                .map(drop)
                .map_err(|e| e.to_string())
        };
        verify(&broker, &node).unwrap();
        verify(&broker, &broker).unwrap();
        let err = verify(&broker, &bookie).unwrap_err();
        assert!(err.contains("expected a metadata"), "{err}");
        assert!(verify(&broker, &broker2).is_err());
    }

    #[test]
    fn given_the_provider_then_aes_128_gcm_comes_first_and_nothing_is_dropped() {
        let p = aes_128_first_provider();
        assert_eq!(
            p.cipher_suites[0].suite(),
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
        );
        assert_eq!(
            p.cipher_suites.len(),
            rustls::crypto::ring::default_provider().cipher_suites.len()
        );
    }

    #[test]
    fn given_an_identity_then_its_uri_round_trips() {
        let b = id("east", ProcessRole::Broker, "b1");
        assert_eq!(b.uri(), "meridian://site/east/role/broker/b1");
        assert_eq!(Identity::parse_uri(&b.uri()).unwrap(), b);
        for role in ProcessRole::ALL {
            let i = id("s-1.x", role, "n_2");
            assert_eq!(Identity::parse_uri(&i.uri()).unwrap(), i);
        }
    }

    #[test]
    fn given_malformed_uris_then_they_name_nobody() {
        for bad in [
            "meridian://role/broker",
            "meridian://site/east/role/broker",
            "meridian://site/east/role/broker/b1/x",
            "meridian://site/east/rol/broker/b1",
            "meridian://site/east/role/superuser/b1",
            "meridian://site//role/broker/b1",
            "meridian://site/east/role/broker/",
            "meridian://site/ea st/role/broker/b1",
            "https://site/east/role/broker/b1",
        ] {
            assert!(Identity::parse_uri(bad).is_err(), "{bad}");
        }
    }

    /// Each role against each port's admitted roles, same site and another site.
    #[test]
    fn given_the_port_rules_then_each_role_is_admitted_exactly_where_listed() {
        use ProcessRole::Broker;
        let ports: [(&str, &[ProcessRole]); 5] = [
            ("metadata client", METADATA_API_ROLES),
            ("membership", MEMBERSHIP_ROLES),
            ("raft", RAFT_ROLES),
            ("bookie write", BOOKIE_WRITE_ROLES),
            ("bookie read", BOOKIE_READ_ROLES),
        ];
        let mut table = String::new();
        for (port, allowed) in ports {
            for role in ProcessRole::ALL {
                for site in ["east", "west"] {
                    let peer = id(site, role, "x");
                    let verdict = match authorize(Ok(&peer), "east", allowed, port) {
                        Ok(_) => "ok".to_string(),
                        Err(e) => e,
                    };
                    table.push_str(&format!("{port} / {role}@{site}: {verdict}\n"));
                }
            }
        }
        expect_test::expect![[r#"
            metadata client / metadata@east: ok
            metadata client / metadata@west: metadata client refused: the certificate names metadata "x" of site "west", this is site "east"
            metadata client / bookie@east: ok
            metadata client / bookie@west: metadata client refused: the certificate names bookie "x" of site "west", this is site "east"
            metadata client / broker@east: ok
            metadata client / broker@west: metadata client refused: the certificate names broker "x" of site "west", this is site "east"
            metadata client / admin@east: ok
            metadata client / admin@west: metadata client refused: the certificate names admin "x" of site "west", this is site "east"
            membership / metadata@east: ok
            membership / metadata@west: membership refused: the certificate names metadata "x" of site "west", this is site "east"
            membership / bookie@east: membership refused to bookie "x" of site "east": only admin, metadata may
            membership / bookie@west: membership refused: the certificate names bookie "x" of site "west", this is site "east"
            membership / broker@east: membership refused to broker "x" of site "east": only admin, metadata may
            membership / broker@west: membership refused: the certificate names broker "x" of site "west", this is site "east"
            membership / admin@east: ok
            membership / admin@west: membership refused: the certificate names admin "x" of site "west", this is site "east"
            raft / metadata@east: ok
            raft / metadata@west: raft refused: the certificate names metadata "x" of site "west", this is site "east"
            raft / bookie@east: raft refused to bookie "x" of site "east": only metadata may
            raft / bookie@west: raft refused: the certificate names bookie "x" of site "west", this is site "east"
            raft / broker@east: raft refused to broker "x" of site "east": only metadata may
            raft / broker@west: raft refused: the certificate names broker "x" of site "west", this is site "east"
            raft / admin@east: raft refused to admin "x" of site "east": only metadata may
            raft / admin@west: raft refused: the certificate names admin "x" of site "west", this is site "east"
            bookie write / metadata@east: bookie write refused to metadata "x" of site "east": only broker may
            bookie write / metadata@west: bookie write refused: the certificate names metadata "x" of site "west", this is site "east"
            bookie write / bookie@east: bookie write refused to bookie "x" of site "east": only broker may
            bookie write / bookie@west: bookie write refused: the certificate names bookie "x" of site "west", this is site "east"
            bookie write / broker@east: ok
            bookie write / broker@west: bookie write refused: the certificate names broker "x" of site "west", this is site "east"
            bookie write / admin@east: bookie write refused to admin "x" of site "east": only broker may
            bookie write / admin@west: bookie write refused: the certificate names admin "x" of site "west", this is site "east"
            bookie read / metadata@east: bookie read refused to metadata "x" of site "east": only broker, bookie, admin may
            bookie read / metadata@west: bookie read refused: the certificate names metadata "x" of site "west", this is site "east"
            bookie read / bookie@east: ok
            bookie read / bookie@west: bookie read refused: the certificate names bookie "x" of site "west", this is site "east"
            bookie read / broker@east: ok
            bookie read / broker@west: bookie read refused: the certificate names broker "x" of site "west", this is site "east"
            bookie read / admin@east: ok
            bookie read / admin@west: bookie read refused: the certificate names admin "x" of site "west", this is site "east"
        "#]]
        .assert_eq(&table);
        let none = authorize(Err("no client certificate"), "east", &[Broker], "raft");
        assert_eq!(none.unwrap_err(), "raft refused: no client certificate");
    }
}
