//! TLS (rustls with ring) for the Pulsar protocol's TLS port: the server's certificate and
//! key from PEM files and, with `broker.tls_trust_certs_file`, client certificates checked
//! against those CAs (mutual TLS). A client without a certificate is still let in (it may
//! authenticate with a token); one with a certificate that does not verify is not. The role
//! of a client certificate is its subject's CN ([`meridian_tenancy::auth::certificate_role`]).

use std::sync::Arc;

use anyhow::Context;
use meridian_config::BrokerConfig;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::server::HANDSHAKE_TIMEOUT;

fn certs(path: &str, key: &str) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .with_context(|| format!("{key} {path}"))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{key} {path}: not PEM certificates"))?;
    anyhow::ensure!(!certs.is_empty(), "{key} {path}: no certificate in it");
    Ok(certs)
}

/// The TLS acceptor `cfg` describes, or `None` without `broker.tls_cert_file`.
pub fn acceptor(cfg: &BrokerConfig) -> anyhow::Result<Option<tokio_rustls::TlsAcceptor>> {
    if cfg.tls_cert_file.is_empty() {
        return Ok(None);
    }
    let chain = certs(&cfg.tls_cert_file, "broker.tls_cert_file")?;
    let key = PrivateKeyDer::from_pem_file(&cfg.tls_key_file).with_context(|| {
        format!(
            "broker.tls_key_file {}: not a PEM private key",
            cfg.tls_key_file
        )
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?;
    let builder = if cfg.tls_trust_certs_file.is_empty() {
        builder.with_no_client_auth()
    } else {
        let mut roots = rustls::RootCertStore::empty();
        for c in certs(&cfg.tls_trust_certs_file, "broker.tls_trust_certs_file")? {
            roots
                .add(c)
                .context("broker.tls_trust_certs_file: a certificate is not a usable CA")?;
        }
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .allow_unauthenticated()
                .build()
                .context("broker.tls_trust_certs_file")?;
        builder.with_client_cert_verifier(verifier)
    };
    let config = builder
        .with_single_cert(chain, key)
        .context("broker.tls_cert_file and broker.tls_key_file do not match")?;
    Ok(Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))))
}

/// The admin API's TLS configuration (tonic), from the same files.
pub fn admin_config(cfg: &BrokerConfig) -> anyhow::Result<tonic::transport::ServerTlsConfig> {
    let read = |p: &str, key: &str| std::fs::read(p).with_context(|| format!("{key} {p}"));
    let mut c = tonic::transport::ServerTlsConfig::new()
        .identity(tonic::transport::Identity::from_pem(
            read(&cfg.tls_cert_file, "broker.tls_cert_file")?,
            read(&cfg.tls_key_file, "broker.tls_key_file")?,
        ))
        // A peer that opens a connection and never finishes its handshake is dropped (as
        // on the Pulsar TLS port).
        .timeout(HANDSHAKE_TIMEOUT);
    if !cfg.tls_trust_certs_file.is_empty() {
        c = c
            .client_ca_root(tonic::transport::Certificate::from_pem(read(
                &cfg.tls_trust_certs_file,
                "broker.tls_trust_certs_file",
            )?))
            .client_auth_optional(true);
    }
    Ok(c)
}

/// The role of the client certificate a TLS session carries, if any.
pub fn peer_role(conn: &rustls::ServerConnection) -> Option<String> {
    conn.peer_certificates()
        .and_then(|c| c.first())
        .and_then(|c| meridian_tenancy::auth::certificate_role(c))
}

/// Binds `broker.tls_listen` and serves the Pulsar protocol over TLS there, when
/// `broker.tls_cert_file` is set; lookups then also answer `pulsar+ssl://` with that port
/// (on the advertised host, if one is configured).
pub async fn start(
    broker: &Arc<crate::broker::Broker>,
) -> anyhow::Result<Option<crate::server::RunningServer>> {
    let Some(acceptor) = acceptor(&broker.cfg)? else {
        return Ok(None);
    };
    let l = tokio::net::TcpListener::bind(&broker.cfg.tls_listen)
        .await
        .with_context(|| {
            format!(
                "broker.tls_listen: cannot listen on {}",
                broker.cfg.tls_listen
            )
        })?;
    let addr = l.local_addr()?;
    let host = match broker.cfg.advertise.rsplit_once(':') {
        Some((host, _)) => host.to_string(),
        None => addr.ip().to_string(),
    };
    let _ = broker
        .service_url_tls
        .set(format!("pulsar+ssl://{host}:{}", addr.port()));
    Ok(Some(crate::server::serve_tls(
        Arc::clone(broker),
        l,
        acceptor,
    )?))
}

/// TLS between roles (`[tls]`): this process's certificate and the site CA, or `None` when the
/// section is empty (plaintext). With `role`, the certificate must name that role (a bookie
/// runs with a bookie's certificate, a broker with a broker's).
pub fn site(
    cfg: &meridian_config::TlsConfig,
    role: Option<meridian_metadata::tls::ProcessRole>,
) -> anyhow::Result<Option<Arc<meridian_metadata::tls::SiteTls>>> {
    let tls = meridian_metadata::tls::SiteTls::load(cfg)?;
    if let (Some(t), Some(role)) = (&tls, role) {
        anyhow::ensure!(
            t.identity.role == role,
            "tls.cert_file {} names {}; this process is a {role} (make its certificate with \
             `meridian-admin site-tls create-cert --role {role}`)",
            cfg.cert_file,
            t.identity
        );
    }
    Ok(tls)
}
