//! Who a site is on the link: its certificate names it in one subject alternative name
//! `meridian://site/<name>`, issued by the federation's CA (`meridian-admin geo`).
//!
//! This is not the identity of a process inside a site (`meridian://site/<site>/role/...`,
//! `meridian_metadata::tls`): a geo certificate names a whole site and nothing more, and a
//! process certificate is refused here (it names a role).

use meridian_metadata::tls::{check_name, meridian_uri, URI_PREFIX};

/// The subject alternative name of a site's geo certificate.
pub fn site_uri(site: &str) -> String {
    format!("{URI_PREFIX}{site}")
}

/// Checks a site name (the same rule as every identity: 1 to 64 of `A-Z a-z 0-9 . _ -`).
pub fn check_site(site: &str) -> Result<(), String> {
    check_name("site", site)
}

/// The site a certificate (DER) names: its one `meridian://site/<name>` URI. A certificate
/// with none, with two, or naming a process of a site (`.../role/...`) names no site.
pub fn site_of_certificate(der: &[u8]) -> Result<String, String> {
    let uri = meridian_uri(der, "a site")?;
    let site = &uri[URI_PREFIX.len()..];
    if site.contains('/') {
        return Err(format!(
            "{uri:?} names a process of a site, not a site (a geo certificate is made by `meridian-admin geo create-site-cert`)"
        ));
    }
    check_site(site)?;
    Ok(site.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, KeyPair, SanType};

    fn cert_with(uris: &[&str]) -> Vec<u8> {
        let mut p = CertificateParams::default();
        for u in uris {
            p.subject_alt_names
                .push(SanType::URI((*u).try_into().unwrap()));
        }
        p.self_signed(&KeyPair::generate().unwrap())
            .unwrap()
            .der()
            .to_vec()
    }

    #[test]
    fn given_certificates_then_only_one_site_uri_names_a_site() {
        assert_eq!(
            site_of_certificate(&cert_with(&["meridian://site/east"])).unwrap(),
            "east"
        );
        let two = site_of_certificate(&cert_with(&[
            "meridian://site/east",
            "meridian://site/west",
        ]));
        assert!(two.unwrap_err().contains("more than one"));
        let process = site_of_certificate(&cert_with(&["meridian://site/east/role/broker/b1"]));
        assert!(process.unwrap_err().contains("names a process"));
        let none = site_of_certificate(&cert_with(&["https://example.com/"]));
        assert!(none
            .unwrap_err()
            .contains("no meridian://site/... name naming a site"));
        let bad = site_of_certificate(&cert_with(&["meridian://site/a b"]));
        assert!(bad.is_err());
        assert!(site_of_certificate(b"garbage").is_err());
    }
}
