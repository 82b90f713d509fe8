//! Argon2id password hashes (PHC strings). Hashing is deliberately slow, so it runs on
//! the blocking pool, never on the async executor.

use argon2::password_hash::rand_core::OsRng;
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;

use crate::error::Error;

pub async fn hash(password: String) -> Result<String, Error> {
    tokio::task::spawn_blocking(move || {
        let salt = SaltString::generate(&mut OsRng);
        Argon2::default()
            .hash_password(password.as_bytes(), &salt)
            .map(|hash| hash.to_string())
            .map_err(Error::PasswordHash)
    })
    .await?
}

pub async fn verify(password: String, phc: String) -> Result<bool, Error> {
    tokio::task::spawn_blocking(move || {
        let parsed = PasswordHash::new(&phc).map_err(Error::PasswordHash)?;
        Ok(Argon2::default().verify_password(password.as_bytes(), &parsed).is_ok())
    })
    .await?
}

/// The rule every new password must meet, as a sentence when it does not.
pub fn check_strength(password: &str) -> Result<(), Error> {
    if password.chars().count() < 8 {
        return Err(Error::invalid("weak_password", "The password must have at least 8 characters."));
    }
    if password.len() > 1024 {
        return Err(Error::invalid("weak_password", "The password must be at most 1024 bytes long."));
    }
    Ok(())
}
