//! Login throttling: a token bucket per client address and username, and a wider one per
//! client address. Keying the narrow bucket by address too means an attacker elsewhere
//! cannot lock `admin` out by spending its attempts; the wide one still stops one address
//! from trying many usernames quickly. An IPv6 client counts as its /64, the block one
//! host or subscriber is handed: one address each would give it billions of buckets.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How many times the per-(address, username) burst one address may spend across all
/// usernames: room for a few people behind one NAT, not for a sweep of accounts.
const ADDRESS_BURST_FACTOR: f64 = 5.0;

pub struct LoginLimiter {
    burst: f64,
    refill: Duration,
    buckets: Mutex<HashMap<String, Bucket>>,
}

struct Bucket {
    tokens: f64,
    burst: f64,
    updated: Instant,
}

impl LoginLimiter {
    pub fn new(burst: u32, refill: Duration) -> LoginLimiter {
        LoginLimiter { burst: burst.max(1) as f64, refill, buckets: Mutex::new(HashMap::new()) }
    }

    /// Spends one attempt of `username` from `address`. `Err(secs)` says how long until
    /// the emptiest bucket allows another attempt; then nothing is spent.
    pub fn attempt(&self, address: IpAddr, username: &str, now: Instant) -> Result<(), u64> {
        let address = client_of(address);
        let keys = [
            (format!("ip:{address}"), self.burst * ADDRESS_BURST_FACTOR),
            (format!("ip-user:{address}/{username}"), self.burst),
        ];
        self.spend(&keys, now)
    }

    /// How many buckets the limiter holds (each costs memory until it refills).
    pub fn tracked(&self) -> usize {
        self.buckets.lock().expect("limiter lock poisoned").len()
    }

    fn spend(&self, keys: &[(String, f64)], now: Instant) -> Result<(), u64> {
        let mut buckets = self.buckets.lock().expect("limiter lock poisoned");
        if buckets.len() > 100_000 {
            // Forget full buckets so a flood of distinct keys cannot grow memory forever.
            let refill = self.refill;
            buckets.retain(|_, b| refilled(b, now, refill) < b.burst);
        }
        let mut wait = 0.0f64;
        for (key, burst) in keys {
            let bucket = buckets.entry(key.clone()).or_insert(Bucket { tokens: *burst, burst: *burst, updated: now });
            bucket.tokens = refilled(bucket, now, self.refill);
            bucket.updated = now;
            if bucket.tokens < 1.0 {
                wait = wait.max((1.0 - bucket.tokens) * self.refill.as_secs_f64());
            }
        }
        if wait > 0.0 {
            return Err(wait.ceil().max(1.0) as u64);
        }
        for (key, _) in keys {
            if let Some(bucket) = buckets.get_mut(key) {
                bucket.tokens -= 1.0;
            }
        }
        Ok(())
    }
}

/// The client an address is counted as: an IPv4 address (also when it comes IPv4-mapped,
/// as a dual-stack listener hands it over) is itself; an IPv6 one is its /64.
fn client_of(address: IpAddr) -> IpAddr {
    match address.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & (u128::MAX << 64))),
        v4 => v4,
    }
}

fn refilled(bucket: &Bucket, now: Instant, refill: Duration) -> f64 {
    let elapsed = now.saturating_duration_since(bucket.updated).as_secs_f64();
    (bucket.tokens + elapsed / refill.as_secs_f64().max(1e-9)).min(bucket.burst)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn burst_is_allowed_then_refused_until_refill() {
        let limiter = LoginLimiter::new(3, Duration::from_secs(10));
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(limiter.attempt(ip(1), "alice", t0).is_ok());
        }
        assert_eq!(limiter.attempt(ip(1), "alice", t0), Err(10));
        assert!(limiter.attempt(ip(1), "alice", t0 + Duration::from_secs(10)).is_ok());
    }

    #[test]
    fn one_address_spending_a_username_does_not_lock_it_out_elsewhere() {
        let limiter = LoginLimiter::new(1, Duration::from_secs(3600));
        let t0 = Instant::now();
        assert!(limiter.attempt(ip(1), "admin", t0).is_ok());
        assert!(limiter.attempt(ip(1), "admin", t0).is_err());
        assert!(limiter.attempt(ip(2), "admin", t0).is_ok());
    }

    #[test]
    fn addresses_of_one_ipv6_64_share_their_buckets() {
        let limiter = LoginLimiter::new(1, Duration::from_secs(3600));
        let t0 = Instant::now();
        let v6 = |text: &str| text.parse::<IpAddr>().unwrap();
        assert!(limiter.attempt(v6("2001:db8:1:2::1"), "admin", t0).is_ok());
        assert!(limiter.attempt(v6("2001:db8:1:2:ffff:ffff:ffff:fffe"), "admin", t0).is_err(), "a rotated address");
        assert!(limiter.attempt(v6("2001:db8:1:3::1"), "admin", t0).is_ok(), "the next /64 is another client");
        // One /64 sweeping usernames from fresh addresses spends one wide bucket.
        let swept = (0..100u128)
            .filter(|n| {
                let address = IpAddr::V6(Ipv6Addr::from(0x2001_0db8_0000_0009_0000_0000_0000_0000u128 | *n));
                limiter.attempt(address, &format!("user{n}"), t0).is_ok()
            })
            .count();
        assert_eq!(swept, ADDRESS_BURST_FACTOR as usize);
    }

    #[test]
    fn an_ipv4_mapped_address_counts_as_its_ipv4_address() {
        let limiter = LoginLimiter::new(1, Duration::from_secs(3600));
        let t0 = Instant::now();
        assert!(limiter.attempt(ip(7), "admin", t0).is_ok());
        let mapped = IpAddr::V6(std::net::Ipv4Addr::new(10, 0, 0, 7).to_ipv6_mapped());
        assert!(limiter.attempt(mapped, "admin", t0).is_err());
        assert!(limiter.attempt(ip(8), "admin", t0).is_ok(), "IPv4 addresses are not grouped");
    }

    #[test]
    fn one_address_cannot_sweep_many_usernames() {
        let limiter = LoginLimiter::new(2, Duration::from_secs(3600));
        let t0 = Instant::now();
        let allowed = (0..100).filter(|n| limiter.attempt(ip(3), &format!("user{n}"), t0).is_ok()).count();
        assert_eq!(allowed, 2 * ADDRESS_BURST_FACTOR as usize);
    }
}
