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

/// Checks tokens.
pub struct Authenticator {
    key: DecodingKey,
    validation: Validation,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Authenticator")
    }
}

impl Authenticator {
    /// From a secret key file (HS256, raw bytes) or an RSA public key file (RS256, PEM).
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
            (None, None) => return Err("a secret key or a public key is needed".into()),
        };
        let mut validation = Validation::new(alg);
        // Pulsar's tokens need not expire; `exp` is checked when present.
        validation.required_spec_claims = ["sub".to_string()].into_iter().collect();
        validation.leeway = 0;
        Ok(Authenticator { key, validation })
    }

    /// The role a token carries, if it verifies.
    pub fn authenticate(&self, token: &str) -> Result<String, AuthError> {
        let t = token.trim();
        let t = t.strip_prefix("token:").unwrap_or(t);
        decode::<Claims>(t, &self.key, &self.validation)
            .map(|d| d.claims.sub)
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
