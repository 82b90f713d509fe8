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
            None => stored_secret(&data_dir.join("jwt-secret"))?,
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

/// The secret in `path`, written first if there is none. Servers sharing a data directory
/// (or a restart racing the old process) may all get here at once, so the file only ever
/// appears whole: each writes its own candidate to a temporary file and hard-links it to
/// `path`, which fails for all but the first; the others read the first's.
fn stored_secret(path: &Path) -> std::io::Result<String> {
    if let Some(secret) = read_secret(path)? {
        return Ok(secret);
    }
    let secret = super::secrets::generate("");
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("secret");
    let temporary = path.with_file_name(format!(".{name}.{}.tmp", Uuid::new_v4().simple()));
    write_private(&temporary, &secret)?;
    let linked = std::fs::hard_link(&temporary, path);
    std::fs::remove_file(&temporary)?;
    match linked {
        Ok(()) => Ok(secret),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => read_secret(path)?
            .ok_or_else(|| std::io::Error::other(format!("{} vanished while it was read", path.display()))),
        Err(e) => Err(e),
    }
}

/// The secret in `path`, `None` if there is no such file. An empty file is refused: this
/// code never writes one, and replacing it could race another server reading it.
fn read_secret(path: &Path) -> std::io::Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(secret) if secret.trim().is_empty() => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} is empty; delete it to have a new session key generated", path.display()),
        )),
        Ok(secret) => Ok(Some(secret.trim().to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Writes a new file only its owner can read, on disk before it returns (so a crash never
/// leaves a linked but empty secret).
fn write_private(path: &Path, contents: &str) -> std::io::Result<()> {
    use std::io::Write;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    options.mode(0o600);
    let mut file = options.open(path)?;
    file.write_all(contents.as_bytes())?;
    file.sync_all()
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

    /// Servers starting at once on one data directory: each start's token verifies with
    /// every other's key, and a later start reads the same secret.
    #[test]
    fn first_starts_at_once_on_one_data_dir_share_one_secret() {
        const STARTS: usize = 8;
        for _ in 0..10 {
            let dir = tempfile::tempdir().unwrap();
            let barrier = std::sync::Barrier::new(STARTS);
            let keys: Vec<SessionKeys> = std::thread::scope(|scope| {
                let starts: Vec<_> = (0..STARTS)
                    .map(|_| {
                        scope.spawn(|| {
                            barrier.wait();
                            SessionKeys::load(None, dir.path(), Duration::hours(1)).unwrap()
                        })
                    })
                    .collect();
                starts.into_iter().map(|start| start.join().unwrap()).collect()
            });
            let later = SessionKeys::load(None, dir.path(), Duration::hours(1)).unwrap();
            for key in &keys {
                let (user, session) = (Uuid::new_v4(), Uuid::new_v4());
                let (token, _) = key.issue(user, session);
                for other in keys.iter().chain([&later]) {
                    assert_eq!(other.verify(&token), Some(SessionClaims { user, session }));
                }
            }
            let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
            assert_eq!(left, ["jwt-secret"], "no temporary file is left behind");
        }
    }

    #[test]
    fn an_empty_secret_file_is_refused_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("jwt-secret"), "\n").unwrap();
        let refused = SessionKeys::load(None, dir.path(), Duration::hours(1)).err().unwrap();
        assert_eq!(refused.kind(), std::io::ErrorKind::InvalidData);
        assert!(refused.to_string().contains("jwt-secret is empty"), "{refused}");
        assert_eq!(std::fs::read_to_string(dir.path().join("jwt-secret")).unwrap(), "\n");
    }
}
