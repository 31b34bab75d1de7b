//! Token authentication (JWT, as Pulsar's `AuthenticationProviderToken`): HS256 with a secret
//! key, or RS256 with an RSA public key (PEM). The role is the token's `sub`; an `exp`, when
//! present, is enforced. The same check serves the Pulsar protocol (CONNECT with method
//! `token`) and the admin API (`authorization: Bearer TOKEN`).

use std::path::Path;

use jsonwebtoken::{decode, encode, Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

/// Why a token was refused. The message never says whether a target exists.
#[derive(Debug, thiserror::Error)]
#[error("authentication failed: {0}")]
pub struct AuthError(pub String);

#[derive(Debug, Serialize, Deserialize)]
struct Claims {
    sub: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    exp: Option<u64>,
}

/// Checks tokens (when a key is configured) and names the roles of client certificates.
pub struct Authenticator {
    tokens: Option<(DecodingKey, Validation)>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Authenticator")
    }
}

impl Authenticator {
    /// From a secret key file (HS256, raw bytes) or an RSA public key file (RS256, PEM); with
    /// neither, tokens are refused (clients authenticate with certificates).
    pub fn from_files(secret: Option<&Path>, public: Option<&Path>) -> Result<Self, String> {
        let read = |p: &Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
        let (key, alg) = match (secret, public) {
            (Some(s), None) => (DecodingKey::from_secret(&read(s)?), Algorithm::HS256),
            (None, Some(p)) => (
                DecodingKey::from_rsa_pem(&read(p)?)
                    .map_err(|e| format!("{}: not an RSA public key in PEM: {e}", p.display()))?,
                Algorithm::RS256,
            ),
            (Some(_), Some(_)) => return Err("give a secret key or a public key, not both".into()),
            (None, None) => return Ok(Authenticator { tokens: None }),
        };
        let mut validation = Validation::new(alg);
        // Pulsar's tokens need not expire; `exp` is checked when present.
        validation.required_spec_claims = ["sub".to_string()].into_iter().collect();
        validation.leeway = 0;
        Ok(Authenticator {
            tokens: Some((key, validation)),
        })
    }

    /// The role a token carries, if it verifies.
    pub fn authenticate(&self, token: &str) -> Result<String, AuthError> {
        self.authenticate_until(token).map(|(role, _)| role)
    }

    /// The role a token carries and when it expires (`exp`, seconds since the epoch), if it
    /// verifies.
    pub fn authenticate_until(&self, token: &str) -> Result<(String, Option<u64>), AuthError> {
        let t = token.trim();
        let t = t.strip_prefix("token:").unwrap_or(t);
        let Some((key, validation)) = &self.tokens else {
            return Err(AuthError(
                "this server takes no tokens (no token key is configured); use a client certificate"
                    .into(),
            ));
        };
        decode::<Claims>(t, key, validation)
            .map(|d| (d.claims.sub, d.claims.exp))
            .map_err(|e| AuthError(e.to_string()))
    }
}

/// A new HS256 secret key: 32 random bytes.
pub fn create_secret_key() -> Vec<u8> {
    use rand::RngCore;
    let mut k = vec![0u8; 32];
    rand::thread_rng().fill_bytes(&mut k);
    k
}

/// A new RSA key pair for RS256 tokens, as PEM: (private key in PKCS#8, public key in SPKI).
/// The brokers need only the public key (`broker.token_public_key_file`).
pub fn create_key_pair() -> Result<(String, String), String> {
    use rsa::pkcs8::{EncodePrivateKey, EncodePublicKey, LineEnding};
    let private = rsa::RsaPrivateKey::new(&mut rand::thread_rng(), 2048)
        .map_err(|e| format!("generating an RSA key: {e}"))?;
    let private_pem = private
        .to_pkcs8_pem(LineEnding::LF)
        .map_err(|e| e.to_string())?
        .to_string();
    let public_pem = private
        .to_public_key()
        .to_public_key_pem(LineEnding::LF)
        .map_err(|e| e.to_string())?;
    Ok((private_pem, public_pem))
}

/// A token for `subject`, signed with a secret key (HS256) or an RSA private key in PEM
/// (RS256); `expires_at` in seconds since the epoch.
pub fn create_token(
    secret: Option<&[u8]>,
    private_pem: Option<&[u8]>,
    subject: &str,
    expires_at: Option<u64>,
) -> Result<String, String> {
    let claims = Claims {
        sub: subject.to_string(),
        exp: expires_at,
    };
    let (key, alg) = match (secret, private_pem) {
        (Some(s), None) => (EncodingKey::from_secret(s), Algorithm::HS256),
        (None, Some(p)) => (
            EncodingKey::from_rsa_pem(p).map_err(|e| format!("not an RSA private key: {e}"))?,
            Algorithm::RS256,
        ),
        _ => return Err("give exactly one of a secret key and a private key".into()),
    };
    encode(&Header::new(alg), &claims, &key).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth_with(key: &[u8]) -> Authenticator {
        let dir = tempfile_dir();
        let p = dir.join("k");
        std::fs::write(&p, key).unwrap();
        Authenticator::from_files(Some(&p), None).unwrap()
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!(
            "meridian-auth-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn now() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    }

    #[test]
    fn given_tokens_then_only_the_right_key_and_unexpired_ones_pass() {
        let key = create_secret_key();
        let a = auth_with(&key);
        let t = create_token(Some(&key), None, "app", None).unwrap();
        assert_eq!(a.authenticate(&t).unwrap(), "app");
        assert_eq!(a.authenticate(&format!("token:{t}")).unwrap(), "app");
        let later = create_token(Some(&key), None, "app", Some(now() + 3600)).unwrap();
        assert_eq!(a.authenticate(&later).unwrap(), "app");
        let expired = create_token(Some(&key), None, "app", Some(now() - 10)).unwrap();
        assert!(a.authenticate(&expired).unwrap_err().0.contains("xpired"));
        let forged = create_token(Some(&create_secret_key()), None, "admin", None).unwrap();
        assert!(a.authenticate(&forged).is_err());
        assert!(a.authenticate("not a token").is_err());
        // An unsigned token ("alg": "none") is refused.
        let unsigned = format!(
            "{}.{}.",
            "eyJhbGciOiJub25lIn0",  // {"alg":"none"}
            "eyJzdWIiOiJhZG1pbiJ9"  // {"sub":"admin"}
        );
        assert!(a.authenticate(&unsigned).is_err());
    }
}

/// The role of a client certificate (DER), parsed with `x509-parser`: its subject's common
/// name (the last CN, the most specific, if there are several), else a subject alternative
/// name of the form `meridian://role/<name>`. `None` when it has neither or is not a
/// certificate. CNs may be any DirectoryString: UTF8String, PrintableString, IA5String,
/// T61String (read as Latin-1, as in practice), BMPString (UTF-16) or UniversalString (UTF-32).
pub fn certificate_role(cert: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert).ok()?;
    let cn = cert
        .subject()
        .iter_common_name()
        .filter_map(|a| directory_string(a.attr_value()))
        .filter(|c| !c.is_empty())
        .last();
    if cn.is_some() {
        return cn;
    }
    let san = cert.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|n| match n {
        x509_parser::extensions::GeneralName::URI(u) => u
            .strip_prefix(ROLE_URI_PREFIX)
            .filter(|r| !r.is_empty() && !r.contains('/'))
            .map(str::to_string),
        _ => None,
    })
}

/// A subject alternative name `meridian://role/<name>` names a certificate's role when its
/// subject has no CN.
pub const ROLE_URI_PREFIX: &str = "meridian://role/";

/// A DirectoryString's text, by its ASN.1 tag.
fn directory_string(v: &x509_parser::der_parser::asn1_rs::Any<'_>) -> Option<String> {
    let data = v.data;
    match v.tag().0 {
        // UTF8String
        12 => String::from_utf8(data.to_vec()).ok(),
        // PrintableString, IA5String: ASCII
        19 | 22 => data
            .is_ascii()
            .then(|| String::from_utf8_lossy(data).into_owned()),
        // T61String (TeletexString): Latin-1 in practice
        20 => Some(data.iter().map(|b| char::from(*b)).collect()),
        // BMPString: UTF-16, big-endian
        30 => {
            if data.len() % 2 != 0 {
                return None;
            }
            let units = data
                .chunks_exact(2)
                .map(|c| u16::from_be_bytes([c[0], c[1]]));
            char::decode_utf16(units)
                .collect::<Result<String, _>>()
                .ok()
        }
        // UniversalString: UTF-32, big-endian
        28 => {
            if data.len() % 4 != 0 {
                return None;
            }
            data.chunks_exact(4)
                .map(|c| char::from_u32(u32::from_be_bytes([c[0], c[1], c[2], c[3]])))
                .collect()
        }
        _ => None,
    }
}

#[cfg(test)]
mod certificate_tests {
    use super::certificate_role;

    #[test]
    fn given_certificates_then_the_subject_common_name_is_the_role() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap();
        p.distinguished_name
            .push(rcgen::DnType::OrganizationName, "Acme");
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "app-1");
        let cert = p.self_signed(&key).unwrap();
        assert_eq!(certificate_role(cert.der()).as_deref(), Some("app-1"));
        // No CN: no role.
        let mut p = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap();
        p.distinguished_name = rcgen::DistinguishedName::new();
        let cert = p.self_signed(&key).unwrap();
        assert_eq!(certificate_role(cert.der()), None);
        // Garbage and truncations never panic.
        let der = cert.der().to_vec();
        for n in 0..der.len() {
            let _ = certificate_role(&der[..n]);
        }
        assert_eq!(certificate_role(b"not a certificate"), None);
    }

    fn with_cn(cn: rcgen::DnValue, sans: Vec<rcgen::SanType>) -> Option<String> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::default();
        p.subject_alt_names = sans;
        p.distinguished_name = rcgen::DistinguishedName::new();
        if !matches!(&cn, rcgen::DnValue::Utf8String(s) if s.is_empty()) {
            p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        }
        certificate_role(p.self_signed(&key).unwrap().der())
    }

    #[test]
    fn given_every_kind_of_directory_string_then_the_cn_reads_as_text() {
        use rcgen::DnValue;
        assert_eq!(
            with_cn(DnValue::Utf8String("zoë".into()), vec![]).as_deref(),
            Some("zoë")
        );
        assert_eq!(
            with_cn(DnValue::PrintableString("app".try_into().unwrap()), vec![]).as_deref(),
            Some("app")
        );
        // T61String bytes are Latin-1: 0xEB is ë (the old DER walk refused it as bad UTF-8).
        // rcgen writes ASCII T61 only, so the byte is put in afterwards (roles are read from
        // certificates rustls already verified; the parse does not check signatures).
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name.push(
            rcgen::DnType::CommonName,
            DnValue::TeletexString("zoX".try_into().unwrap()),
        );
        let mut der = p.self_signed(&key).unwrap().der().to_vec();
        // Issuer and subject alike (the certificate is self-signed).
        let at: Vec<usize> = (0..der.len() - 2)
            .filter(|i| &der[*i..*i + 3] == b"zoX")
            .collect();
        assert_eq!(at.len(), 2);
        for i in at {
            der[i + 2] = 0xeb;
        }
        assert_eq!(certificate_role(&der).as_deref(), Some("zoë"));
        // BMPString is UTF-16 (the old DER walk ignored it).
        assert_eq!(
            with_cn(
                DnValue::BmpString(rcgen::BmpString::try_from("ops-ü").unwrap()),
                vec![]
            )
            .as_deref(),
            Some("ops-ü")
        );
    }

    #[test]
    fn given_no_cn_then_a_role_uri_san_names_the_role_and_other_sans_do_not() {
        use rcgen::{DnValue, SanType};
        let uri = |u: &str| SanType::URI(u.try_into().unwrap());
        assert_eq!(
            with_cn(
                DnValue::Utf8String(String::new()),
                vec![
                    SanType::DnsName("host".try_into().unwrap()),
                    uri("meridian://role/ops")
                ]
            )
            .as_deref(),
            Some("ops")
        );
        assert_eq!(
            with_cn(
                DnValue::Utf8String(String::new()),
                vec![
                    SanType::DnsName("host".try_into().unwrap()),
                    uri("https://role/ops")
                ]
            ),
            None
        );
        assert_eq!(
            with_cn(
                DnValue::Utf8String(String::new()),
                vec![uri("meridian://role/")]
            ),
            None
        );
        // A CN wins over the SAN.
        assert_eq!(
            with_cn(
                DnValue::Utf8String("cn-role".into()),
                vec![uri("meridian://role/ops")]
            )
            .as_deref(),
            Some("cn-role")
        );
    }
}
