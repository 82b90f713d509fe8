//! Session tokens: HS256 JWTs signed with a key from the environment or generated once
//! and kept in the data directory, so sessions survive a restart. Each names its row in
//! the `sessions` table (`sid`), which `auth::authenticate` checks, so a session can be
//! ended on the server before its expiry.

use std::path::Path;

use chrono::{DateTime, Duration, Utc};
use jsonwebtoken::{decode, encode, Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

#[derive(Debug, Serialize, Deserialize)]
struct Claims {
    sub: String,
    /// The session's row; a token without one (issued before sessions were revocable)
    /// does not verify, so its holder logs in again.
    sid: Uuid,
    iat: i64,
    exp: i64,
}

/// What a valid session token says: whose it is and which session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionClaims {
    pub user: Uuid,
    pub session: Uuid,
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

    /// A token for session `session` of `user`; the caller records the session's row.
    pub fn issue(&self, user: Uuid, session: Uuid) -> (String, DateTime<Utc>) {
        let now = Utc::now();
        let expires_at = now + self.lifetime;
        let claims = Claims { sub: user.to_string(), sid: session, iat: now.timestamp(), exp: expires_at.timestamp() };
        let token = encode(&Header::new(Algorithm::HS256), &claims, &self.encoding)
            .expect("HS256 signing with an in-memory key cannot fail");
        (token, expires_at)
    }

    /// The user and session of a validly signed, unexpired token (whether the session
    /// was ended is the database's to say).
    pub fn verify(&self, token: &str) -> Option<SessionClaims> {
        let mut validation = Validation::new(Algorithm::HS256);
        validation.leeway = 0;
        let claims = decode::<Claims>(token, &self.decoding, &validation).ok()?.claims;
        Some(SessionClaims { user: claims.sub.parse().ok()?, session: claims.sid })
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
        let (user, session) = (Uuid::new_v4(), Uuid::new_v4());
        let (token, _) = keys.issue(user, session);
        assert_eq!(keys.verify(&token), Some(SessionClaims { user, session }));
        let other = SessionKeys::new(b"another", Duration::hours(1));
        assert_eq!(other.verify(&token), None);
    }

    #[test]
    fn a_token_without_a_session_id_is_refused() {
        #[derive(Serialize)]
        struct Old {
            sub: String,
            iat: i64,
            exp: i64,
        }
        let keys = SessionKeys::new(b"secret", Duration::hours(1));
        let now = Utc::now().timestamp();
        let old = Old { sub: Uuid::new_v4().to_string(), iat: now, exp: now + 3600 };
        let token = encode(&Header::new(Algorithm::HS256), &old, &EncodingKey::from_secret(b"secret")).unwrap();
        assert_eq!(keys.verify(&token), None);
    }

    #[test]
    fn expired_token_is_refused() {
        let keys = SessionKeys::new(b"secret", Duration::seconds(-5));
        let (token, _) = keys.issue(Uuid::new_v4(), Uuid::new_v4());
        assert_eq!(keys.verify(&token), None);
    }

    #[test]
    fn generated_secret_persists_in_the_data_dir() {
        let dir = tempfile::tempdir().unwrap();
        let first = SessionKeys::load(None, dir.path(), Duration::hours(1)).unwrap();
        let (user, session) = (Uuid::new_v4(), Uuid::new_v4());
        let (token, _) = first.issue(user, session);
        let second = SessionKeys::load(None, dir.path(), Duration::hours(1)).unwrap();
        assert_eq!(second.verify(&token), Some(SessionClaims { user, session }));
    }
}
