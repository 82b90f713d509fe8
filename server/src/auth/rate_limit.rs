//! Login throttling: a token bucket per client address and per username, so neither one
//! address guessing many accounts nor many addresses guessing one account get far.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub struct LoginLimiter {
    burst: f64,
    refill: Duration,
    buckets: Mutex<HashMap<String, Bucket>>,
}

struct Bucket {
    tokens: f64,
    updated: Instant,
}

impl LoginLimiter {
    pub fn new(burst: u32, refill: Duration) -> LoginLimiter {
        LoginLimiter { burst: burst.max(1) as f64, refill, buckets: Mutex::new(HashMap::new()) }
    }

    /// Spends one attempt from every key's bucket. `Err(secs)` says how long until the
    /// emptiest bucket allows another attempt; then nothing is spent.
    pub fn attempt(&self, keys: &[String], now: Instant) -> Result<(), u64> {
        let mut buckets = self.buckets.lock().expect("limiter lock poisoned");
        if buckets.len() > 100_000 {
            // Forget full buckets so a flood of distinct keys cannot grow memory forever.
            let burst = self.burst;
            let refill = self.refill;
            buckets.retain(|_, b| refilled(b, now, burst, refill) < burst);
        }
        let mut wait = 0.0f64;
        for key in keys {
            let bucket = buckets.entry(key.clone()).or_insert(Bucket { tokens: self.burst, updated: now });
            bucket.tokens = refilled(bucket, now, self.burst, self.refill);
            bucket.updated = now;
            if bucket.tokens < 1.0 {
                wait = wait.max((1.0 - bucket.tokens) * self.refill.as_secs_f64());
            }
        }
        if wait > 0.0 {
            return Err(wait.ceil().max(1.0) as u64);
        }
        for key in keys {
            if let Some(bucket) = buckets.get_mut(key) {
                bucket.tokens -= 1.0;
            }
        }
        Ok(())
    }
}

fn refilled(bucket: &Bucket, now: Instant, burst: f64, refill: Duration) -> f64 {
    let elapsed = now.saturating_duration_since(bucket.updated).as_secs_f64();
    (bucket.tokens + elapsed / refill.as_secs_f64().max(1e-9)).min(burst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_is_allowed_then_refused_until_refill() {
        let limiter = LoginLimiter::new(3, Duration::from_secs(10));
        let keys = vec!["ip:1".to_string()];
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(limiter.attempt(&keys, t0).is_ok());
        }
        assert_eq!(limiter.attempt(&keys, t0), Err(10));
        assert!(limiter.attempt(&keys, t0 + Duration::from_secs(10)).is_ok());
    }

    #[test]
    fn one_exhausted_key_blocks_the_attempt_without_spending_the_others() {
        let limiter = LoginLimiter::new(1, Duration::from_secs(60));
        let t0 = Instant::now();
        assert!(limiter.attempt(&["user:alice".into()], t0).is_ok());
        let both = vec!["ip:2".to_string(), "user:alice".to_string()];
        assert!(limiter.attempt(&both, t0).is_err());
        assert!(limiter.attempt(&["ip:2".into()], t0).is_ok());
    }
}
