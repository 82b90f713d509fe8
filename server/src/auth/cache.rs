//! A short memory of credentials this server has already checked against the database:
//! API-token digests and live sessions to their user, and users to the principal they
//! sign in as. With it an inference call carrying a known token costs a SHA-256 and two
//! map lookups instead of a database write (`last_used_at`) and a read, which is most of
//! what the gateway used to add to a request.
//!
//! Entries live `ttl` at most. Revoking a token, ending a session or changing a user on
//! this server forgets the entry at once; another server sharing the same PostgreSQL
//! database hears of it through `revocations` and forgets its entry too, within
//! milliseconds; only if that announcement is lost does it trust its entry until it
//! expires, so `ttl` bounds how long a revoked token or ended session may still work
//! there (`TESSERA_AUTH_CACHE_SECS`, 0 turns the cache off).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::Principal;

/// Past this many entries, expired ones are dropped before another is added.
const PRUNE_AT: usize = 10_000;

struct Entry<T> {
    value: T,
    checked: Instant,
}

#[derive(Default)]
struct Entries {
    /// Bumped by every forget, so a lookup that read the database before a revocation
    /// cannot store what it read after it (see `Generation`).
    generation: u64,
    tokens: HashMap<String, Entry<Uuid>>,
    sessions: HashMap<Uuid, Entry<Uuid>>,
    users: HashMap<Uuid, Entry<Principal>>,
}

/// The cache's state when a database read began; `remember_*` with it stores nothing
/// if something was forgotten meanwhile.
#[derive(Debug, Clone, Copy)]
pub struct Generation(u64);

pub struct AuthCache {
    ttl: Duration,
    entries: Mutex<Entries>,
}

fn fresh<T: Clone>(entry: Option<&Entry<T>>, ttl: Duration) -> Option<T> {
    entry.filter(|e| e.checked.elapsed() < ttl).map(|e| e.value.clone())
}

fn insert<K: std::hash::Hash + Eq, T>(map: &mut HashMap<K, Entry<T>>, key: K, value: T, ttl: Duration) {
    if map.len() >= PRUNE_AT {
        map.retain(|_, e| e.checked.elapsed() < ttl);
    }
    map.insert(key, Entry { value, checked: Instant::now() });
}

impl AuthCache {
    pub fn new(ttl: Duration) -> AuthCache {
        AuthCache { ttl, entries: Mutex::new(Entries::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().expect("auth cache lock")
    }

    /// Take this before reading the database for something you will `remember_*`.
    pub fn generation(&self) -> Generation {
        Generation(self.lock().generation)
    }

    /// The user an API token (by its digest) belongs to, if checked less than `ttl` ago.
    pub fn token_user(&self, digest: &str) -> Option<Uuid> {
        fresh(self.lock().tokens.get(digest), self.ttl)
    }

    pub fn remember_token(&self, digest: String, user: Uuid, read_at: Generation) {
        let mut entries = self.lock();
        if !self.ttl.is_zero() && entries.generation == read_at.0 {
            insert(&mut entries.tokens, digest, user, self.ttl);
        }
    }

    pub fn forget_token(&self, digest: &str) {
        let mut entries = self.lock();
        entries.generation += 1;
        entries.tokens.remove(digest);
    }

    /// The user a session belongs to, if it was live less than `ttl` ago.
    pub fn session_user(&self, session: Uuid) -> Option<Uuid> {
        fresh(self.lock().sessions.get(&session), self.ttl)
    }

    pub fn remember_session(&self, session: Uuid, user: Uuid, read_at: Generation) {
        let mut entries = self.lock();
        if !self.ttl.is_zero() && entries.generation == read_at.0 {
            insert(&mut entries.sessions, session, user, self.ttl);
        }
    }

    pub fn forget_session(&self, session: Uuid) {
        let mut entries = self.lock();
        entries.generation += 1;
        entries.sessions.remove(&session);
    }

    /// Forgets everything: revocations may have been missed (another server's
    /// announcements while this one was not listening).
    pub fn forget_all(&self) {
        let mut entries = self.lock();
        entries.generation += 1;
        entries.tokens.clear();
        entries.sessions.clear();
        entries.users.clear();
    }

    pub fn user(&self, id: Uuid) -> Option<Principal> {
        fresh(self.lock().users.get(&id), self.ttl)
    }

    pub fn remember_user(&self, principal: Principal, read_at: Generation) {
        let mut entries = self.lock();
        if !self.ttl.is_zero() && entries.generation == read_at.0 {
            insert(&mut entries.users, principal.id, principal, self.ttl);
        }
    }

    /// Call whenever a user's name or role changes or the user is deleted.
    pub fn forget_user(&self, id: Uuid) {
        let mut entries = self.lock();
        entries.generation += 1;
        entries.users.remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::accounts::Role;

    fn alice() -> Principal {
        Principal { id: Uuid::new_v4(), username: "alice".into(), role: Role::User }
    }

    #[test]
    fn remembered_entries_are_returned_until_forgotten() {
        let cache = AuthCache::new(Duration::from_secs(60));
        let user = alice();
        cache.remember_token("digest".into(), user.id, cache.generation());
        cache.remember_user(user.clone(), cache.generation());
        assert_eq!(cache.token_user("digest"), Some(user.id));
        assert_eq!(cache.user(user.id).map(|p| p.username), Some("alice".into()));
        let session = Uuid::new_v4();
        cache.remember_session(session, user.id, cache.generation());
        assert_eq!(cache.session_user(session), Some(user.id));
        cache.forget_token("digest");
        cache.forget_user(user.id);
        cache.forget_session(session);
        assert_eq!(cache.token_user("digest"), None);
        assert!(cache.user(user.id).is_none());
        assert_eq!(cache.session_user(session), None);
    }

    #[test]
    fn a_read_that_began_before_a_revocation_is_not_stored() {
        let cache = AuthCache::new(Duration::from_secs(60));
        let before = cache.generation();
        cache.forget_token("digest");
        cache.remember_token("digest".into(), Uuid::new_v4(), before);
        assert_eq!(cache.token_user("digest"), None);
    }

    #[test]
    fn entries_expire_and_a_zero_ttl_stores_nothing() {
        let cache = AuthCache::new(Duration::from_millis(20));
        cache.remember_token("digest".into(), Uuid::new_v4(), cache.generation());
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(cache.token_user("digest"), None);
        let off = AuthCache::new(Duration::ZERO);
        off.remember_user(alice(), off.generation());
        assert_eq!(off.lock().users.len(), 0);
    }
}
