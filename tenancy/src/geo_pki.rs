//! The federation's CA and its sites' certificates for the link between sites
//! (`meridian-admin geo create-ca | create-site-cert`; the link's rules are in `meridian-geo`).
//!
//! ```text
//!  create-ca                 ──> ca.crt, ca.key     (CA: "Meridian federation CA", names no site)
//!  create-site-cert east     ──> east.crt, east.key
//!      signed by ca.key; SAN URI meridian://site/east (+ IPs, DNS names if asked)
//! ```
//!
//! One CA for every site of a federation, apart from each site's internal CA (`site_tls`):
//! a site's geo certificate names the site and nothing more, and a process certificate of a
//! site, which names a role, is refused by the link. ECDSA P-256 keys (rcgen's default); the
//! certificates carry both TLS usages, as each site dials and accepts.

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, KeyPair, KeyUsagePurpose,
};

use crate::site_tls::{issue_leaf, set_validity, with_ca_cert, CertOptions, Issued};
use meridian_metadata::tls::{check_name, URI_PREFIX};

/// The federation CA's common name; a CA of another name was not made here.
pub const CA_COMMON_NAME: &str = "Meridian federation CA";

/// The CA's parameters, built the same way each time, so a certificate signed later names
/// exactly the CA's subject as its issuer.
fn ca_params(days: u32) -> CertificateParams {
    let mut p = CertificateParams::default();
    p.distinguished_name = DistinguishedName::new();
    p.distinguished_name
        .push(DnType::CommonName, CA_COMMON_NAME);
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    set_validity(&mut p, days);
    p
}

/// A new federation CA, valid `days` days.
pub fn create_ca(days: u32) -> Result<Issued, String> {
    let key = KeyPair::generate().map_err(|e| e.to_string())?;
    let cert = ca_params(days)
        .self_signed(&key)
        .map_err(|e| e.to_string())?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Checks that `ca_cert_pem` is a federation CA of [`create_ca`] and `ca_key` its key.
fn check_ca(ca_cert_pem: &str, ca_key: &KeyPair) -> Result<(), String> {
    with_ca_cert(ca_cert_pem, ca_key, |cert| {
        let cn = cert
            .subject()
            .iter_common_name()
            .next()
            .and_then(|c| c.as_str().ok());
        if cn != Some(CA_COMMON_NAME) || !cert.is_ca() {
            return Err(format!(
            "the CA certificate is not a federation CA (made by `meridian-admin geo create-ca`; its subject is {})",
            cert.subject()
        ));
        }
        Ok(())
    })
}

/// A certificate for `site`, issued by the federation CA (`ca_cert_pem`, `ca_key_pem`).
pub fn create_site_cert(
    ca_cert_pem: &str,
    ca_key_pem: &str,
    site: &str,
    opts: &CertOptions,
) -> Result<Issued, String> {
    check_name("site", site)?;
    let ca_key = KeyPair::from_pem(ca_key_pem).map_err(|e| format!("the CA key: {e}"))?;
    check_ca(ca_cert_pem, &ca_key)?;
    // Only the issuer's name and key matter to the certificate signed here.
    let issuer = ca_params(1)
        .self_signed(&ca_key)
        .map_err(|e| e.to_string())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("meridian site {site}"));
    issue_leaf(&issuer, &ca_key, dn, format!("{URI_PREFIX}{site}"), opts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_a_federation_ca_then_site_certificates_name_the_site_and_other_cas_are_refused() {
        let ca = create_ca(3650).unwrap();
        let opts = CertOptions {
            days: 30,
            ..CertOptions::default()
        };
        let east = create_site_cert(&ca.cert_pem, &ca.key_pem, "east", &opts).unwrap();
        let (_, pem) = x509_parser::pem::parse_x509_pem(east.cert_pem.as_bytes()).unwrap();
        let cert = pem.parse_x509().unwrap();
        let san = cert.subject_alternative_name().unwrap().unwrap();
        assert!(san.value.general_names.iter().any(|n| matches!(
            n,
            x509_parser::extensions::GeneralName::URI("meridian://site/east")
        )));
        assert!(create_site_cert(&ca.cert_pem, &ca.key_pem, "ea st", &opts).is_err());
        let other = create_ca(10).unwrap();
        let err = create_site_cert(&ca.cert_pem, &other.key_pem, "east", &opts).unwrap_err();
        assert!(err.contains("does not belong"), "{err}");
        // A site's internal CA is not a federation CA.
        let internal = crate::site_tls::create_ca("east", 10).unwrap();
        let err =
            create_site_cert(&internal.cert_pem, &internal.key_pem, "east", &opts).unwrap_err();
        assert!(err.contains("not a federation CA"), "{err}");
    }
}
