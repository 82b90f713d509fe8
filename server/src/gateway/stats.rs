//! What this server has forwarded to each deployment, for its dashboard page and
//! `GET /api/v1/deployments/{id}/stats`: totals since the server started, and a rolling
//! window of the last ten minutes in five-second buckets (request rate, latency
//! percentiles, batch size, tokens per batch). Prometheus keeps the same figures as
//! cumulative histograms for scraping; a page needs them windowed, so they are kept
//! here too, in memory only. Each server of a shared database counts its own requests.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tessera_api::deployments::{DeploymentStats, Percentiles, TrafficBucket, TrafficSummary};
use tessera_api::engine::InferResponse;
use uuid::Uuid;

pub const BUCKET_SECONDS: u64 = 5;
pub const WINDOW_BUCKETS: usize = 120;
/// The request rate shown as "now" is over this many most recent buckets (one minute).
const RATE_BUCKETS: u64 = 12;

/// Latency histogram: bin `i` holds latencies in [FIRST·GROWTH^i, FIRST·GROWTH^(i+1)) ms,
/// so a percentile read back is within ±7% of the true one, from 50 µs to two minutes.
const FIRST_MS: f64 = 0.05;
const GROWTH: f64 = 1.15;
const BINS: usize = 106;

fn bin_of(ms: f64) -> usize {
    if ms <= FIRST_MS {
        return 0;
    }
    ((ms / FIRST_MS).ln() / GROWTH.ln()).floor().min((BINS - 1) as f64) as usize
}

/// The geometric middle of a bin: what a percentile falling in it reads as.
fn bin_value(bin: usize) -> f64 {
    FIRST_MS * GROWTH.powf(bin as f64 + 0.5)
}

/// One outcome the gateway saw.
#[derive(Debug, Clone, Copy)]
pub enum Sample {
    Served { latency: Duration, tokens: u64, batch_size: u32, batch_tokens: u32 },
    Failed,
}

impl Sample {
    pub fn served(latency: Duration, response: &InferResponse) -> Sample {
        Sample::Served {
            latency,
            tokens: response.tokens.iter().map(|&n| n as u64).sum(),
            batch_size: response.timings.batch_size,
            batch_tokens: response.timings.batch_tokens,
        }
    }
}

#[derive(Clone)]
struct Counts {
    requests: u64,
    errors: u64,
    tokens: u64,
    batch_size_sum: u64,
    batch_tokens_sum: u64,
    /// Requests served per latency bin; as wide as `requests`, so that no bin wraps first.
    latency: [u64; BINS],
}

impl Default for Counts {
    fn default() -> Counts {
        Counts { requests: 0, errors: 0, tokens: 0, batch_size_sum: 0, batch_tokens_sum: 0, latency: [0; BINS] }
    }
}

impl Counts {
    fn add(&mut self, sample: Sample) {
        self.requests += 1;
        match sample {
            Sample::Served { latency, tokens, batch_size, batch_tokens } => {
                self.tokens += tokens;
                self.batch_size_sum += batch_size as u64;
                self.batch_tokens_sum += batch_tokens as u64;
                self.latency[bin_of(latency.as_secs_f64() * 1e3)] += 1;
            }
            Sample::Failed => self.errors += 1,
        }
    }

    fn merge(&mut self, other: &Counts) {
        self.requests += other.requests;
        self.errors += other.errors;
        self.tokens += other.tokens;
        self.batch_size_sum += other.batch_size_sum;
        self.batch_tokens_sum += other.batch_tokens_sum;
        self.latency.iter_mut().zip(other.latency.iter()).for_each(|(a, b)| *a += b);
    }

    /// Nearest-rank percentile over the histogram.
    fn percentile(&self, served: u64, p: f64) -> f64 {
        let rank = ((p / 100.0) * served as f64).ceil().max(1.0) as u64;
        let mut seen = 0u64;
        for (bin, &count) in self.latency.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return bin_value(bin);
            }
        }
        bin_value(BINS - 1)
    }

    fn summary(&self) -> TrafficSummary {
        let served = self.requests - self.errors;
        let mean = |sum: u64| (served > 0).then(|| sum as f64 / served as f64);
        TrafficSummary {
            requests: self.requests,
            errors: self.errors,
            tokens: self.tokens,
            latency_ms: (served > 0).then(|| Percentiles {
                p50: self.percentile(served, 50.0),
                p95: self.percentile(served, 95.0),
                p99: self.percentile(served, 99.0),
            }),
            mean_batch_size: mean(self.batch_size_sum),
            mean_batch_tokens: mean(self.batch_tokens_sum),
        }
    }
}

/// One deployment's totals and ring of buckets; slot `n % WINDOW_BUCKETS` holds bucket
/// `n` (counted from the server's start) until bucket `n + WINDOW_BUCKETS` reuses it.
struct Window {
    total: Counts,
    ring: Vec<(u64, Counts)>,
}

impl Window {
    fn new() -> Window {
        Window { total: Counts::default(), ring: vec![(u64::MAX, Counts::default()); WINDOW_BUCKETS] }
    }

    fn add(&mut self, bucket: u64, sample: Sample) {
        self.total.add(sample);
        let slot = &mut self.ring[(bucket % WINDOW_BUCKETS as u64) as usize];
        if slot.0 != bucket {
            *slot = (bucket, Counts::default());
        }
        slot.1.add(sample);
    }

    fn bucket(&self, bucket: u64) -> Option<&Counts> {
        let slot = &self.ring[(bucket % WINDOW_BUCKETS as u64) as usize];
        (slot.0 == bucket).then_some(&slot.1)
    }
}

pub struct TrafficStats {
    started: Instant,
    started_at: DateTime<Utc>,
    windows: Mutex<HashMap<Uuid, Window>>,
}

impl Default for TrafficStats {
    fn default() -> TrafficStats {
        TrafficStats { started: Instant::now(), started_at: Utc::now(), windows: Mutex::new(HashMap::new()) }
    }
}

impl TrafficStats {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Window>> {
        self.windows.lock().expect("traffic stats lock")
    }

    pub fn record(&self, deployment: Uuid, sample: Sample) {
        self.record_at(deployment, sample, self.started.elapsed());
    }

    fn record_at(&self, deployment: Uuid, sample: Sample, since_start: Duration) {
        let bucket = since_start.as_secs() / BUCKET_SECONDS;
        self.lock().entry(deployment).or_insert_with(Window::new).add(bucket, sample);
    }

    /// A deleted deployment's figures go with it.
    pub fn forget(&self, deployment: Uuid) {
        self.lock().remove(&deployment);
    }

    /// Requests per second over the last minute, for a list of deployments.
    pub fn request_rate(&self, deployment: Uuid) -> f64 {
        let now = self.started.elapsed();
        let windows = self.lock();
        windows.get(&deployment).map_or(0.0, |w| rate(w, now))
    }

    /// Requests per second over the last `buckets` buckets (the current one in part): the
    /// loaning round's short window, so returning demand shows within seconds.
    pub fn recent_rate(&self, deployment: Uuid, buckets: u64) -> f64 {
        let now = self.started.elapsed();
        let windows = self.lock();
        windows.get(&deployment).map_or(0.0, |w| rate_over(w, now, buckets))
    }

    pub fn snapshot(&self, deployment: Uuid) -> DeploymentStats {
        self.snapshot_at(deployment, self.started.elapsed())
    }

    fn snapshot_at(&self, deployment: Uuid, now: Duration) -> DeploymentStats {
        let current = now.as_secs() / BUCKET_SECONDS;
        let first = (current + 1).saturating_sub(WINDOW_BUCKETS as u64);
        let empty = Window::new();
        let windows = self.lock();
        let window = windows.get(&deployment).unwrap_or(&empty);
        let mut whole = Counts::default();
        let buckets = (first..=current)
            .map(|n| {
                let counts = window.bucket(n).cloned().unwrap_or_default();
                whole.merge(&counts);
                TrafficBucket {
                    start: self.started_at + chrono::Duration::seconds((n * BUCKET_SECONDS) as i64),
                    request_rate: counts.requests as f64 / bucket_span(n, now).as_secs_f64(),
                    traffic: counts.summary(),
                }
            })
            .collect();
        DeploymentStats {
            deployment,
            since: self.started_at,
            total: window.total.summary(),
            request_rate: rate(window, now),
            window_seconds: (WINDOW_BUCKETS as u64 * BUCKET_SECONDS) as u32,
            bucket_seconds: BUCKET_SECONDS as u32,
            window: whole.summary(),
            buckets,
        }
    }
}

/// How much of bucket `n` has passed at `now`: all of it, or the part so far of the
/// current one (at least a second, so a request just now is not a rate in the thousands).
fn bucket_span(n: u64, now: Duration) -> Duration {
    let start = Duration::from_secs(n * BUCKET_SECONDS);
    (now.saturating_sub(start)).clamp(Duration::from_secs(1), Duration::from_secs(BUCKET_SECONDS))
}

fn rate(window: &Window, now: Duration) -> f64 {
    rate_over(window, now, RATE_BUCKETS)
}

fn rate_over(window: &Window, now: Duration, buckets: u64) -> f64 {
    let current = now.as_secs() / BUCKET_SECONDS;
    let first = (current + 1).saturating_sub(buckets.max(1));
    let requests: u64 = (first..=current).filter_map(|n| window.bucket(n)).map(|c| c.requests).sum();
    let span = now.saturating_sub(Duration::from_secs(first * BUCKET_SECONDS)).max(Duration::from_secs(1));
    requests as f64 / span.as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(ms: u64, batch_size: u32) -> Sample {
        Sample::Served { latency: Duration::from_millis(ms), tokens: 10, batch_size, batch_tokens: batch_size * 10 }
    }

    #[test]
    fn histogram_percentiles_are_within_the_bin_width() {
        let stats = TrafficStats::default();
        let id = Uuid::new_v4();
        for ms in 1..=100 {
            stats.record_at(id, served(ms, 1), Duration::from_secs(1));
        }
        let latency = stats.snapshot_at(id, Duration::from_secs(2)).window.latency_ms.unwrap();
        for (got, want) in [(latency.p50, 50.0), (latency.p95, 95.0), (latency.p99, 99.0)] {
            assert!((got / want - 1.0).abs() < 0.08, "{got} vs {want}");
        }
    }

    #[test]
    fn buckets_roll_out_of_the_window_but_totals_stay() {
        let stats = TrafficStats::default();
        let id = Uuid::new_v4();
        stats.record_at(id, served(5, 2), Duration::from_secs(0));
        stats.record_at(id, Sample::Failed, Duration::from_secs(7));
        let early = stats.snapshot_at(id, Duration::from_secs(9));
        assert_eq!((early.window.requests, early.window.errors), (2, 1));
        assert_eq!(early.buckets.len(), 2, "one bucket per five seconds since the start");
        assert_eq!(early.buckets[0].traffic.mean_batch_size, Some(2.0));
        assert_eq!(early.buckets[1].traffic.latency_ms, None, "a bucket with only errors has no latency");

        let late = stats.snapshot_at(id, Duration::from_secs(WINDOW_BUCKETS as u64 * BUCKET_SECONDS + 3));
        assert_eq!(late.buckets.len(), WINDOW_BUCKETS);
        assert_eq!((late.window.requests, late.window.errors), (1, 1), "the first bucket left the window");
        assert_eq!((late.total.requests, late.total.errors, late.total.tokens), (2, 1, 10));
    }

    #[test]
    fn request_rate_covers_the_last_minute() {
        let stats = TrafficStats::default();
        let id = Uuid::new_v4();
        for second in 0..120 {
            stats.record_at(id, served(1, 1), Duration::from_secs(second));
            stats.record_at(id, served(1, 1), Duration::from_millis(second * 1000 + 500));
        }
        let rate = stats.snapshot_at(id, Duration::from_secs(120)).request_rate;
        assert!((rate - 2.0).abs() < 0.05, "{rate}");
        assert_eq!(stats.snapshot_at(Uuid::new_v4(), Duration::from_secs(120)).request_rate, 0.0);
        stats.forget(id);
        assert_eq!(stats.snapshot_at(id, Duration::from_secs(120)).total.requests, 0);
    }

    #[test]
    fn latency_bins_count_past_four_billion() {
        let mut busy = Counts::default();
        let many = u64::from(u32::MAX);
        busy.requests = many;
        busy.latency[bin_of(1.0)] = many;
        let mut total = busy.clone();
        total.merge(&busy);
        assert_eq!(total.latency[bin_of(1.0)], 2 * many);
        let p50 = total.percentile(total.requests, 50.0);
        assert!((p50 - 1.0).abs() < 0.08, "{p50}");
    }
}
