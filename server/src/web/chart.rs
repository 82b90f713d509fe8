//! Time-series charts drawn as inline SVG on the server, as the job page's sparklines
//! are: no script or chart library, and a live fragment refresh redraws them. One chart
//! is one or more lines over the same evenly spaced buckets, on a y axis from zero to a
//! round number; a bucket without a value leaves a gap.

/// The drawing box; the SVG stretches it to the card's width.
const WIDTH: f64 = 300.0;
const HEIGHT: f64 = 80.0;
/// Width of the dash that draws a lone value.
const DASH: f64 = 4.0;

pub struct Line {
    /// Legend text, e.g. `p95`.
    pub name: &'static str,
    /// CSS class that colours it: `line-1`, `line-2`, `line-3`.
    pub class: &'static str,
    /// SVG path data (`M x y L x y …`).
    pub path: String,
    /// The newest value, for the legend.
    pub last: String,
}

pub struct Chart {
    pub title: &'static str,
    pub unit: &'static str,
    /// The value at the top of the y axis.
    pub top: String,
    pub lines: Vec<Line>,
    pub empty: bool,
}

/// The smallest 1, 2 or 5 × 10ⁿ at or above `value`.
fn round_up(value: f64) -> f64 {
    if value <= 0.0 || !value.is_finite() {
        return 1.0;
    }
    let magnitude = 10f64.powf(value.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * magnitude).find(|&v| v >= value * (1.0 - 1e-9)).unwrap_or(10.0 * magnitude)
}

/// Path data for `values` (oldest first) on a y axis from 0 to `top`. An isolated value
/// (a bucket between two empty ones) becomes a short dash, so it stays visible.
fn path(values: &[Option<f64>], top: f64) -> String {
    let step = WIDTH / (values.len().max(2) - 1) as f64;
    let mut out = String::new();
    let mut drawing = false;
    for (i, value) in values.iter().enumerate() {
        let Some(v) = value.filter(|v| v.is_finite()) else {
            drawing = false;
            continue;
        };
        let (x, y) = (i as f64 * step, HEIGHT - (v / top).clamp(0.0, 1.0) * HEIGHT);
        let continues = drawing;
        drawing = true;
        let separator = if out.is_empty() { "" } else { " " };
        let isolated = values.get(i + 1).copied().flatten().is_none();
        if continues {
            out.push_str(&format!(" L{x:.1} {y:.1}"));
        } else if isolated {
            let start = (x - DASH / 2.0).clamp(0.0, WIDTH - DASH);
            out.push_str(&format!("{separator}M{start:.1} {y:.1} h{DASH}"));
        } else {
            out.push_str(&format!("{separator}M{x:.1} {y:.1}"));
        }
    }
    out
}

/// A chart of one or more named series sharing a y axis; `format` writes the legend's
/// latest values.
pub fn chart(title: &'static str, unit: &'static str, series: &[(&'static str, Vec<Option<f64>>)], format: fn(f64) -> String) -> Chart {
    let max = series.iter().flat_map(|(_, values)| values.iter().flatten().copied()).filter(|v| v.is_finite()).fold(0.0, f64::max);
    let top = round_up(max);
    let classes = ["line-1", "line-2", "line-3"];
    let lines = series
        .iter()
        .enumerate()
        .map(|(i, (name, values))| Line {
            name,
            class: classes[i % classes.len()],
            path: path(values, top),
            last: values.iter().rev().flatten().next().map(|&v| format(v)).unwrap_or_else(|| "—".into()),
        })
        .collect();
    let empty = series.iter().all(|(_, values)| values.iter().all(Option::is_none));
    Chart { title, unit, top: format(top), lines, empty }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_axis_tops_out_at_a_round_number() {
        assert_eq!(round_up(0.0), 1.0);
        assert_eq!(round_up(0.7), 1.0);
        assert_eq!(round_up(1.0), 1.0);
        assert_eq!(round_up(13.0), 20.0);
        assert_eq!(round_up(430.0), 500.0);
        assert_eq!(round_up(5001.0), 10_000.0);
    }

    #[test]
    fn gaps_break_the_line_and_lone_values_are_dashes() {
        let values = [Some(0.0), Some(10.0), None, Some(5.0), None];
        assert_eq!(path(&values, 10.0), "M0.0 80.0 L75.0 0.0 M223.0 40.0 h4");
        assert_eq!(path(&[None, None], 1.0), "");
    }

    #[test]
    fn lines_share_one_axis_and_report_their_latest_value() {
        let c = chart("Latency", "ms", &[("p50", vec![Some(1.0), Some(2.0)]), ("p99", vec![Some(8.0), None])], |v| format!("{v}"));
        assert_eq!(c.top, "10");
        assert_eq!((c.lines[0].last.as_str(), c.lines[1].last.as_str()), ("2", "8"));
        assert_eq!(c.lines[1].class, "line-2");
        assert!(!c.empty);
        assert!(chart("Rate", "/s", &[("all", vec![None])], |v| format!("{v}")).empty);
    }
}
