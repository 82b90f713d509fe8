//! Revocations shared by the servers of one PostgreSQL database: a server that ends a
//! session, revokes a token or disables a user announces it on a LISTEN/NOTIFY channel,
//! and every server drops its cached copy at once instead of trusting it for up to
//! `TESSERA_AUTH_CACHE_SECS`. SQLite serves one server, so nothing is announced there.

use sqlx::postgres::PgListener;
use uuid::Uuid;

use super::db::{Backend, Db};
use super::Result;

const CHANNEL: &str = "tessera_auth_revoked";

/// A credential that stopped being valid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Revoked {
    Session(Uuid),
    /// An API token, by its SHA-256 digest (hex).
    Token(String),
    User(Uuid),
}

impl Revoked {
    fn payload(&self) -> Option<String> {
        match self {
            Revoked::Session(id) => Some(format!("session:{id}")),
            // Only hex reaches the statement (NOTIFY takes no bound parameters).
            Revoked::Token(digest) if digest.bytes().all(|b| b.is_ascii_hexdigit()) => Some(format!("token:{digest}")),
            Revoked::Token(_) => None,
            Revoked::User(id) => Some(format!("user:{id}")),
        }
    }

    fn parse(payload: &str) -> Option<Revoked> {
        match payload.split_once(':')? {
            ("session", id) => id.parse().ok().map(Revoked::Session),
            ("token", digest) => Some(Revoked::Token(digest.to_string())),
            ("user", id) => id.parse().ok().map(Revoked::User),
            _ => None,
        }
    }
}

/// Tells every server listening on this database (this one included) about `revoked`.
pub async fn publish(db: &Db, revoked: &Revoked) -> Result<()> {
    let Some(payload) = revoked.payload().filter(|_| db.backend() == Backend::Postgres) else {
        return Ok(());
    };
    sqlx::query(sqlx::AssertSqlSafe(format!("NOTIFY {CHANNEL}, '{payload}'"))).execute(db.pool()).await?;
    Ok(())
}

/// A connection listening for revocations.
pub struct Subscription(PgListener);

/// What a subscription heard.
pub enum Heard {
    Revoked(Revoked),
    /// A payload this server does not know (a newer server's).
    Unknown,
    /// The connection dropped and was opened again: what was said meanwhile is lost.
    Lost,
}

/// Listens on the PostgreSQL database at `url`.
pub async fn subscribe(url: &str) -> Result<Subscription> {
    let mut listener = PgListener::connect(url).await?;
    listener.listen(CHANNEL).await?;
    Ok(Subscription(listener))
}

impl Subscription {
    /// Waits for the next announcement; an error means the database cannot be reached.
    pub async fn next(&mut self) -> Result<Heard> {
        Ok(match self.0.try_recv().await? {
            Some(notification) => Revoked::parse(notification.payload()).map_or(Heard::Unknown, Heard::Revoked),
            None => Heard::Lost,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_round_trip_and_only_hex_digests_are_sent() {
        for revoked in [Revoked::Session(Uuid::new_v4()), Revoked::Token("ab12".into()), Revoked::User(Uuid::new_v4())] {
            assert_eq!(Revoked::parse(&revoked.payload().unwrap()), Some(revoked));
        }
        assert_eq!(Revoked::Token("x'; DROP".into()).payload(), None);
        assert_eq!(Revoked::parse("nonsense"), None);
    }
}
