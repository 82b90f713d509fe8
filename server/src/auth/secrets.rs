//! Random secrets (API tokens, worker secrets) and how they are stored: only a SHA-256
//! digest is kept, so a leaked database does not leak usable credentials.

use rand::RngCore;
use sha2::{Digest, Sha256};

/// Personal API tokens start with this, so `authenticate` knows not to parse a JWT.
pub const API_TOKEN_PREFIX: &str = "tsk_";
pub const WORKER_SECRET_PREFIX: &str = "tsw_";
pub const ENGINE_TOKEN_PREFIX: &str = "tse_";

/// `prefix` followed by 32 random bytes in hex.
pub fn generate(prefix: &str) -> String {
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    format!("{prefix}{}", hex::encode(bytes))
}

pub fn digest(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// Constant-time comparison for shared secrets.
pub fn equal(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
