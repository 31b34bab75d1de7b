//! A site's internal CA and its processes' certificates (`meridian-admin site-tls`), for TLS
//! between roles (`[tls]`; the rules are in `meridian_metadata::tls`).
//!
//! ```text
//!  create-ca   --site east           ──> ca.pem, ca.key          (CA: meridian://site/east)
//!  create-cert --role broker --name b1 ──> broker-b1.pem, broker-b1.key
//!              signed by ca.key; SAN URI meridian://site/east/role/broker/b1 (+ IPs, DNS names)
//! ```
//!
//! ECDSA P-256 keys (rcgen's default). Certificates carry both TLS usages (server and client):
//! every process is a client of the metadata store, and metadata nodes and bookies serve.

use std::net::IpAddr;

use meridian_metadata::tls::{check_name, Identity, ProcessRole, URI_PREFIX};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

/// A certificate and its private key, PEM.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

/// Days since 1970-01-01 as a (year, month, day) civil date (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i32, u8, u8) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u8;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u8;
    let year = (yoe + era * 400 + i64::from(month <= 2)) as i32;
    (year, month, day)
}

/// Valid from yesterday (clocks differ a little) for `days` days.
pub(crate) fn set_validity(params: &mut CertificateParams, days: u32) {
    let today = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| (d.as_secs() / 86_400) as i64);
    let (y, m, d) = civil_from_days(today - 1);
    params.not_before = rcgen::date_time_ymd(y, m, d);
    let (y, m, d) = civil_from_days(today + i64::from(days));
    params.not_after = rcgen::date_time_ymd(y, m, d);
}

/// The CA's parameters for `site`: built the same way each time, so a certificate signed
/// later names exactly the CA's subject as its issuer.
fn ca_params(site: &str, days: u32) -> Result<CertificateParams, String> {
    let mut p = CertificateParams::default();
    p.distinguished_name = DistinguishedName::new();
    p.distinguished_name.push(
        DnType::CommonName,
        format!("Meridian site {site} internal CA"),
    );
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p.subject_alt_names = vec![SanType::URI(
        format!("{URI_PREFIX}{site}")
            .try_into()
            .map_err(|e| format!("site URI: {e}"))?,
    )];
    set_validity(&mut p, days);
    Ok(p)
}

/// A new internal CA for `site`, valid `days` days.
pub fn create_ca(site: &str, days: u32) -> Result<Issued, String> {
    check_name("site", site)?;
    let key = KeyPair::generate().map_err(|e| e.to_string())?;
    let cert = ca_params(site, days)?
        .self_signed(&key)
        .map_err(|e| e.to_string())?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// The site a CA certificate (PEM) of [`create_ca`] is for, checked against its key.
pub fn ca_site(ca_cert_pem: &str, ca_key: &KeyPair) -> Result<String, String> {
    with_ca_cert(ca_cert_pem, ca_key, |cert| {
        let san = cert
            .subject_alternative_name()
            .ok()
            .flatten()
            .ok_or("the CA certificate names no site (not made by `site-tls create-ca`)")?;
        san.value
            .general_names
            .iter()
            .find_map(|n| match n {
                x509_parser::extensions::GeneralName::URI(u) => u
                    .strip_prefix(URI_PREFIX)
                    .filter(|s| check_name("site", s).is_ok())
                    .map(str::to_string),
                _ => None,
            })
            .ok_or_else(|| {
                "the CA certificate names no site (not made by `site-tls create-ca`)".to_string()
            })
    })
}

/// Parses a CA certificate (PEM), checks that `ca_key` is its key, and hands it to `f`.
pub(crate) fn with_ca_cert<T>(
    ca_cert_pem: &str,
    ca_key: &KeyPair,
    f: impl FnOnce(&x509_parser::certificate::X509Certificate<'_>) -> Result<T, String>,
) -> Result<T, String> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(ca_cert_pem.as_bytes())
        .map_err(|e| format!("the CA certificate is not PEM: {e}"))?;
    let cert = pem
        .parse_x509()
        .map_err(|e| format!("the CA certificate does not parse: {e}"))?;
    if cert.public_key().raw != ca_key.public_key_der().as_slice() {
        return Err("the CA key does not belong to the CA certificate".to_string());
    }
    f(&cert)
}

/// What a process certificate says beyond its identity: the addresses it serves on.
#[derive(Debug, Clone, Default)]
pub struct CertOptions {
    pub ips: Vec<IpAddr>,
    pub dns_names: Vec<String>,
    pub days: u32,
}

/// A certificate for process `name` of `role`, issued by the CA (`ca_cert_pem`, `ca_key_pem`)
/// for the site the CA names.
pub fn create_cert(
    ca_cert_pem: &str,
    ca_key_pem: &str,
    role: ProcessRole,
    name: &str,
    opts: &CertOptions,
) -> Result<Issued, String> {
    let ca_key = KeyPair::from_pem(ca_key_pem).map_err(|e| format!("the CA key: {e}"))?;
    let site = ca_site(ca_cert_pem, &ca_key)?;
    if role == ProcessRole::Metadata && name.parse::<u64>().is_err() {
        return Err(format!(
            "a metadata node's certificate is named by its node id (--name 1), not {name:?}"
        ));
    }
    let identity = Identity::new(&site, role, name)?;
    // Only the issuer's name and key matter to the certificate signed here; the CA certificate
    // peers trust is the one in the CA's file.
    let issuer = ca_params(&site, 1)?
        .self_signed(&ca_key)
        .map_err(|e| e.to_string())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("meridian {role} {name}"));
    dn.push(DnType::OrganizationName, site);
    issue_leaf(&issuer, &ca_key, dn, identity.uri(), opts)
}

/// A leaf certificate signed by `issuer` (whose key is `ca_key`): subject `dn`, the identity
/// `uri` and `opts`' addresses as subject alternative names, both TLS usages.
pub(crate) fn issue_leaf(
    issuer: &rcgen::Certificate,
    ca_key: &KeyPair,
    dn: DistinguishedName,
    uri: String,
    opts: &CertOptions,
) -> Result<Issued, String> {
    let mut p = CertificateParams::default();
    p.distinguished_name = dn;
    p.is_ca = IsCa::ExplicitNoCa;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    p.use_authority_key_identifier_extension = true;
    p.subject_alt_names.push(SanType::URI(
        uri.try_into().map_err(|e| format!("identity URI: {e}"))?,
    ));
    for ip in &opts.ips {
        p.subject_alt_names.push(SanType::IpAddress(*ip));
    }
    for dns in &opts.dns_names {
        p.subject_alt_names.push(SanType::DnsName(
            dns.as_str()
                .try_into()
                .map_err(|e| format!("DNS name {dns:?}: {e}"))?,
        ));
    }
    set_validity(&mut p, opts.days);
    let key = KeyPair::generate().map_err(|e| e.to_string())?;
    let cert = p
        .signed_by(&key, issuer, ca_key)
        .map_err(|e| e.to_string())?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use meridian_metadata::tls::SiteTls;

    #[test]
    fn given_known_days_then_civil_dates_are_right() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_789), (2026, 12, 2));
    }

    #[test]
    fn given_a_ca_then_its_certificates_name_site_and_role_and_load() {
        let ca = create_ca("east", 3650).unwrap();
        let opts = CertOptions {
            ips: vec!["127.0.0.1".parse().unwrap()],
            days: 365,
            ..CertOptions::default()
        };
        let b = create_cert(&ca.cert_pem, &ca.key_pem, ProcessRole::Broker, "b1", &opts).unwrap();
        let tls = SiteTls::from_pem(
            ca.cert_pem.clone().into_bytes(),
            b.cert_pem.into_bytes(),
            b.key_pem.into_bytes(),
        )
        .unwrap();
        assert_eq!(
            tls.identity,
            Identity::new("east", ProcessRole::Broker, "b1").unwrap()
        );
        let err = create_cert(
            &ca.cert_pem,
            &ca.key_pem,
            ProcessRole::Metadata,
            "m1",
            &opts,
        )
        .unwrap_err();
        assert!(err.contains("node id"), "{err}");
        let other = create_ca("west", 10).unwrap();
        let err = create_cert(
            &ca.cert_pem,
            &other.key_pem,
            ProcessRole::Broker,
            "b",
            &opts,
        )
        .unwrap_err();
        assert!(err.contains("does not belong"), "{err}");
        assert!(create_ca("ea st", 1).is_err());
    }
}
