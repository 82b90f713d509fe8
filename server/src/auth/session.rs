//! Session tokens: HS256 JWTs signed with a key from the environment or generated once
//! and kept in the data directory, so sessions survive a restart.

use std::path::Path;

use chrono::{DateTime, Duration, Utc};
use jsonwebtoken::{decode, encode, Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct Claims {
    sub: String,
    iat: i64,
    exp: i64,
}

pub struct SessionKeys {
    encoding: EncodingKey,
    decoding: DecodingKey,
    lifetime: Duration,
}

impl SessionKeys {
    pub fn new(secret: &[u8], lifetime: Duration) -> SessionKeys {
        SessionKeys {
            encoding: EncodingKey::from_secret(secret),
            decoding: DecodingKey::from_secret(secret),
            lifetime,
        }
    }

    /// The configured secret, or the one in `<data_dir>/jwt-secret` (created if absent).
    pub fn load(configured: Option<&str>, data_dir: &Path, lifetime: Duration) -> std::io::Result<SessionKeys> {
        let secret = match configured {
            Some(secret) => secret.to_string(),
            None => {
                let path = data_dir.join("jwt-secret");
                match std::fs::read_to_string(&path) {
                    Ok(secret) if !secret.trim().is_empty() => secret.trim().to_string(),
                    _ => {
                        let secret = super::secrets::generate("");
                        write_private(&path, &secret)?;
                        secret
                    }
                }
            }
        };
        Ok(SessionKeys::new(secret.as_bytes(), lifetime))
    }

    pub fn issue(&self, user_id: &str) -> (String, DateTime<Utc>) {
        let now = Utc::now();
        let expires_at = now + self.lifetime;
        let claims = Claims { sub: user_id.into(), iat: now.timestamp(), exp: expires_at.timestamp() };
        let token = encode(&Header::new(Algorithm::HS256), &claims, &self.encoding)
            .expect("HS256 signing with an in-memory key cannot fail");
        (token, expires_at)
    }

    /// The user id of a valid, unexpired token.
    pub fn verify(&self, token: &str) -> Option<String> {
        let mut validation = Validation::new(Algorithm::HS256);
        validation.leeway = 0;
        decode::<Claims>(token, &self.decoding, &validation).ok().map(|data| data.claims.sub)
    }
}

fn write_private(path: &Path, contents: &str) -> std::io::Result<()> {
    use std::io::Write;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    options.mode(0o600);
    options.open(path)?.write_all(contents.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_token_verifies_and_tampered_one_does_not() {
        let keys = SessionKeys::new(b"secret", Duration::hours(1));
        let (token, _) = keys.issue("user-1");
        assert_eq!(keys.verify(&token).as_deref(), Some("user-1"));
        let other = SessionKeys::new(b"another", Duration::hours(1));
        assert_eq!(other.verify(&token), None);
    }

    #[test]
    fn expired_token_is_refused() {
        let keys = SessionKeys::new(b"secret", Duration::seconds(-5));
        let (token, _) = keys.issue("user-1");
        assert_eq!(keys.verify(&token), None);
    }

    #[test]
    fn generated_secret_persists_in_the_data_dir() {
        let dir = tempfile::tempdir().unwrap();
        let first = SessionKeys::load(None, dir.path(), Duration::hours(1)).unwrap();
        let (token, _) = first.issue("u");
        let second = SessionKeys::load(None, dir.path(), Duration::hours(1)).unwrap();
        assert_eq!(second.verify(&token).as_deref(), Some("u"));
    }
}
