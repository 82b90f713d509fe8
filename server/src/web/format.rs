//! How values read on a page: sizes in binary units, times as "3 s ago" with the exact
//! instant kept for a tooltip, digests shortened to what a person compares.

use chrono::{DateTime, Utc};

/// `86.7 MiB`: one decimal from KiB up, whole bytes below.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// A span of time in its largest sensible unit: `42 s`, `5 min`, `3 h`, `2 d`.
pub fn span(seconds: i64) -> String {
    let s = seconds.max(0);
    match s {
        0..=59 => format!("{s} s"),
        60..=3599 => format!("{} min", s / 60),
        3600..=86_399 => format!("{} h", s / 3600),
        _ => format!("{} d", s / 86_400),
    }
}

/// `3 s ago`, `just now`, or `in 20 s` for an instant still ahead (a lease expiry).
pub fn ago(at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let seconds = (now - at).num_seconds();
    if seconds == 0 {
        "just now".into()
    } else if seconds < 0 {
        format!("in {}", span(-seconds))
    } else {
        format!("{} ago", span(seconds))
    }
}

/// The exact instant, for a `title` attribute or a timings table.
pub fn instant(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// `sha256:0123…` → its first 12 hex digits, enough to tell files apart by eye.
pub fn short_digest(digest: &str) -> String {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    hex.chars().take(12).collect()
}

/// How long a run took, from start to finish (or to now while it runs).
pub fn elapsed(from: DateTime<Utc>, to: DateTime<Utc>) -> String {
    let millis = (to - from).num_milliseconds().max(0);
    if millis < 10_000 {
        format!("{:.1} s", millis as f64 / 1000.0)
    } else {
        let s = millis / 1000;
        match s {
            0..=59 => format!("{s} s"),
            60..=3599 => format!("{} min {} s", s / 60, s % 60),
            _ => format!("{} h {} min", s / 3600, (s % 3600) / 60),
        }
    }
}

/// A metric value without trailing zeros: `0.25`, `312.5`, `91578367`; one too small for
/// six decimals to show three digits of it in scientific notation (`2.5e-7`, a learning
/// rate near the end of its decay, not `0`), and so is one too large for its digits to
/// mean anything (`1e23`, a diverged loss, not `99999999999999991611392`).
pub fn number(value: f64) -> String {
    if !value.is_finite() {
        return value.to_string();
    }
    let without_zeros = |text: &str| text.trim_end_matches('0').trim_end_matches('.').to_string();
    if value != 0.0 && (value.abs() < 1e-4 || value.abs() >= 1e15) {
        let text = format!("{value:.2e}");
        let (mantissa, exponent) = text.split_once('e').expect("scientific notation has an exponent");
        return format!("{}e{exponent}", without_zeros(mantissa));
    }
    without_zeros(&format!("{value:.6}"))
}

/// Points of an SVG polyline drawing `values` in a 100 × 24 box, oldest at the left and
/// the smallest value at the bottom; a flat series is drawn through the middle.
pub fn sparkline(values: &[f64]) -> String {
    let finite: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    let (min, max) = finite.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
    let last = finite.len().saturating_sub(1).max(1) as f64;
    finite
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let x = i as f64 / last * 100.0;
            let y = if max > min { 23.0 - (v - min) / (max - min) * 22.0 } else { 12.0 };
            format!("{x:.1},{y:.1}")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn sizes_use_binary_units_with_one_decimal() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1024), "1.0 KiB");
        assert_eq!(bytes(90_868_376), "86.7 MiB");
        assert_eq!(bytes(80 * (1 << 30)), "80.0 GiB");
    }

    #[test]
    fn times_read_as_ago_or_ahead() {
        let now = Utc.with_ymd_and_hms(2025, 1, 1, 12, 0, 0).unwrap();
        assert_eq!(ago(now - chrono::Duration::seconds(3), now), "3 s ago");
        assert_eq!(ago(now - chrono::Duration::milliseconds(400), now), "just now");
        assert_eq!(ago(now - chrono::Duration::minutes(5), now), "5 min ago");
        assert_eq!(ago(now - chrono::Duration::hours(49), now), "2 d ago");
        assert_eq!(ago(now + chrono::Duration::seconds(20), now), "in 20 s");
        assert_eq!(instant(now), "2025-01-01 12:00:00 UTC");
    }

    #[test]
    fn elapsed_keeps_tenths_for_short_runs() {
        let start = Utc.with_ymd_and_hms(2025, 1, 1, 12, 0, 0).unwrap();
        assert_eq!(elapsed(start, start + chrono::Duration::milliseconds(1234)), "1.2 s");
        assert_eq!(elapsed(start, start + chrono::Duration::seconds(125)), "2 min 5 s");
        assert_eq!(elapsed(start, start + chrono::Duration::seconds(3 * 3600 + 120)), "3 h 2 min");
    }

    #[test]
    fn numbers_drop_trailing_zeros() {
        assert_eq!(number(312.5), "312.5");
        assert_eq!(number(91_578_367.0), "91578367");
        assert_eq!(number(0.000_123_4), "0.000123");
        assert_eq!(number(f64::NAN), "NaN");
        assert_eq!(number(0.0), "0");
        assert_eq!(number(2.5e-7), "2.5e-7");
        assert_eq!(number(-3e-9), "-3e-9");
        assert_eq!(number(1.234_56e-5), "1.23e-5");
        assert_eq!(number(1e23), "1e23");
        assert_eq!(number(-f64::from(f32::MAX)), "-3.4e38");
        assert_eq!(number(999_999_999_999_999.0), "999999999999999");
    }

    #[test]
    fn sparkline_spans_the_box_with_the_minimum_at_the_bottom() {
        assert_eq!(sparkline(&[1.0, 3.0, 2.0]), "0.0,23.0 50.0,1.0 100.0,12.0");
        assert_eq!(sparkline(&[5.0, 5.0]), "0.0,12.0 100.0,12.0");
        assert_eq!(sparkline(&[7.0]), "0.0,12.0");
        assert_eq!(sparkline(&[]), "");
    }

    #[test]
    fn digests_shorten_to_twelve_hex_digits() {
        assert_eq!(short_digest("sha256:0123456789abcdef"), "0123456789ab");
        assert_eq!(short_digest("abc"), "abc");
    }
}
