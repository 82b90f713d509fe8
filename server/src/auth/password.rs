//! Argon2id password hashes (PHC strings). Hashing is deliberately slow and takes 19 MiB,
//! so it runs on the blocking pool, never on the async executor, and only a few at a time:
//! a burst of logins (the limiter counts per address, so many addresses get through)
//! queues for a slot briefly, then is told to come back instead of taking the memory.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use argon2::password_hash::rand_core::OsRng;
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use tokio::sync::Semaphore;

use crate::error::Error;

/// Every hash and verification of this process: one per core (at least two) at once,
/// so a flood of logins holds at most that many times Argon2's 19 MiB.
static CHECKS: LazyLock<Bound> = LazyLock::new(|| {
    let cores = std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get);
    Bound::new(cores.max(2), Duration::from_secs(2))
});

pub async fn hash(password: String) -> Result<String, Error> {
    CHECKS
        .run(move || {
            let salt = SaltString::generate(&mut OsRng);
            Argon2::default()
                .hash_password(password.as_bytes(), &salt)
                .map(|hash| hash.to_string())
                .map_err(Error::PasswordHash)
        })
        .await
}

pub async fn verify(password: String, phc: String) -> Result<bool, Error> {
    CHECKS
        .run(move || {
            let parsed = PasswordHash::new(&phc).map_err(Error::PasswordHash)?;
            Ok(Argon2::default().verify_password(password.as_bytes(), &parsed).is_ok())
        })
        .await
}

/// At most `slots` password checks at once; a caller waits up to `wait` for one.
struct Bound {
    slots: Arc<Semaphore>,
    wait: Duration,
}

impl Bound {
    fn new(slots: usize, wait: Duration) -> Bound {
        Bound { slots: Arc::new(Semaphore::new(slots)), wait }
    }

    /// Runs `check` on the blocking pool once a slot is free, or answers a 503 when none
    /// frees up within the wait. The slot goes with the check, not with the caller: a
    /// client that hangs up mid-check cannot free it while Argon2 still holds its memory.
    async fn run<T: Send + 'static>(
        &self,
        check: impl FnOnce() -> Result<T, Error> + Send + 'static,
    ) -> Result<T, Error> {
        let slot = tokio::time::timeout(self.wait, Arc::clone(&self.slots).acquire_owned())
            .await
            .map_err(|_| {
                Error::Overloaded("The server is busy checking other passwords; send the request again shortly.".into())
            })?
            .map_err(|_| Error::Invariant("the password check slots are never closed"))?;
        tokio::task::spawn_blocking(move || {
            let checked = check();
            drop(slot);
            checked
        })
        .await?
    }
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

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;

    use super::*;

    #[tokio::test]
    async fn a_check_past_the_bound_is_refused_as_busy_after_the_wait() {
        let bound = Bound::new(1, Duration::from_millis(50));
        let taken = Arc::clone(&bound.slots).try_acquire_owned().unwrap();
        let refused = bound.run(|| Ok(())).await.unwrap_err();
        assert!(matches!(refused, Error::Overloaded(_)), "{refused:?}");
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(refused.public_message().contains("checking other passwords"), "{}", refused.public_message());
        drop(taken);
        assert!(bound.run(|| Ok(())).await.is_ok(), "a free slot takes the check");
    }

    #[tokio::test]
    async fn a_check_waiting_for_a_slot_runs_once_one_frees_up() {
        let bound = Bound::new(1, Duration::from_secs(5));
        let taken = Arc::clone(&bound.slots).try_acquire_owned().unwrap();
        let free_soon = async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            drop(taken);
        };
        let (answer, ()) = tokio::join!(bound.run(|| Ok(7)), free_soon);
        assert_eq!(answer.unwrap(), 7);
    }

    #[tokio::test]
    async fn a_caller_that_gives_up_leaves_its_slot_taken_until_the_check_ends() {
        let bound = Bound::new(1, Duration::from_secs(5));
        let (finish, finished) = std::sync::mpsc::channel::<()>();
        let running = bound.run(move || {
            finished.recv().ok();
            Ok(())
        });
        assert!(tokio::time::timeout(Duration::from_millis(20), running).await.is_err(), "the check ended early");
        assert_eq!(bound.slots.available_permits(), 0, "the slot left with the caller while Argon2 ran on");
        finish.send(()).unwrap();
        for _ in 0..500 {
            if bound.slots.available_permits() == 1 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the slot never came back after its check ended");
    }
}
