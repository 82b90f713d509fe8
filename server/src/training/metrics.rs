//! A training job's metric series. Every reported point is stored (one row per job,
//! series, name and step); a point reported again replaces the earlier one, so a job
//! that resumed from a checkpoint and re-ran some steps still reads as one run. This
//! checks what workers send (`store::training` writes it); reads can be downsampled for
//! charts.

use std::collections::BTreeMap;

use tessera_api::parallel::RankStep;
use tessera_api::train::{MetricRow, StepPhase, TrainingMetrics};
use uuid::Uuid;

use super::downsample;
use crate::error::{Error, Result};
use crate::store::db::{now_ms, Db};
use crate::store::gangs;
use crate::store::training::{self as store, Point, Series};

/// Points one report may carry (the JSON body limit caps it too).
pub const MAX_POINTS_PER_REPORT: usize = 200_000;

fn check(point: &Point) -> Result<()> {
    // A name is a key (and a PostgreSQL column refuses a NUL), so it is refused, not cleaned.
    if point.name.is_empty() || point.name.len() > 200 || point.name == "step" || point.name.chars().any(char::is_control) {
        return Err(Error::invalid(
            "invalid_metric",
            "Metric names have 1 to 200 characters, none of them a control character, and are not 'step'.",
        ));
    }
    if !point.value.is_finite() {
        return Err(Error::invalid(
            "invalid_metric",
            format!("The value of '{}' at step {} is not a finite number.", point.name, point.step),
        ));
    }
    if point.step < 0 {
        return Err(Error::invalid("invalid_metric", "Steps are 0 or more."));
    }
    Ok(())
}

/// The points of a worker's report, stamped `now` (the rows carry no time).
pub fn points_of(report: &TrainingMetrics, now: i64) -> Result<Vec<Point>> {
    let mut points = Vec::new();
    for (series, rows) in [(Series::Step, &report.steps), (Series::Eval, &report.evals)] {
        for row in rows {
            let step = i64::try_from(row.step).map_err(|_| Error::invalid("invalid_metric", "A step is too large."))?;
            for (name, value) in &row.values {
                points.push(Point { series, name: name.clone(), step, value: *value, at: now, phase: row.phase });
            }
        }
    }
    Ok(points)
}

/// Stores points (last write wins per job, series, name and step) and raises the job's
/// progress to the highest training step among them.
pub async fn store(db: &Db, job: Uuid, points: Vec<Point>) -> Result<()> {
    if points.len() > MAX_POINTS_PER_REPORT {
        return Err(Error::PayloadTooLarge(format!("Send at most {MAX_POINTS_PER_REPORT} metric points per request.")));
    }
    points.iter().try_for_each(check)?;
    Ok(store::upsert_metrics(db, job, &points).await?)
}

/// Stores a worker's report, stamped with the server's clock. `rank`: the reporting rank
/// of a data-parallel job, whose timings are the only rank rows it may send.
pub async fn store_report(db: &Db, job: Uuid, report: &TrainingMetrics, rank: Option<u32>) -> Result<()> {
    if !report.ranks.is_empty() {
        if report.ranks.iter().any(|r| Some(r.rank) != rank) {
            return Err(Error::invalid("invalid_metric", "A rank reports its own step timings only."));
        }
        let finite = |r: &RankStep| {
            [r.iter_ms, r.wait_ms, r.allreduce_ms].iter().chain(&r.predicted_ms).all(|v| v.is_finite() && *v >= 0.0)
        };
        if !report.ranks.iter().all(finite) || report.ranks.len() > MAX_POINTS_PER_REPORT {
            return Err(Error::invalid("invalid_metric", "Step timings are finite milliseconds, 0 or more."));
        }
        gangs::upsert_rank_steps(db, job, &report.ranks).await?;
    }
    store(db, job, points_of(report, now_ms())?).await
}

/// A job's series as rows by step. With `max_points`, each metric is downsampled on its
/// own (min/max per bucket), so a row then holds only the metrics kept at its step.
pub async fn read(db: &Db, job: Uuid, max_points: Option<usize>) -> Result<TrainingMetrics> {
    Ok(read_counted(db, job, max_points).await?.0)
}

/// [`read`], with how many points each metric has in all (before downsampling).
pub async fn read_counted(
    db: &Db,
    job: Uuid,
    max_points: Option<usize>,
) -> Result<(TrainingMetrics, BTreeMap<String, usize>)> {
    let mut series: BTreeMap<(Series, String), Vec<(i64, f64)>> = BTreeMap::new();
    let mut phases: BTreeMap<(Series, i64), StepPhase> = BTreeMap::new();
    for (kind, name, step, value, phase) in store::metrics(db, job).await? {
        series.entry((kind, name)).or_default().push((step, value));
        if let Some(phase) = phase {
            phases.insert((kind, step), phase);
        }
    }
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for ((_, name), points) in &series {
        *counts.entry(name.clone()).or_default() += points.len();
    }
    let mut steps: BTreeMap<i64, BTreeMap<String, f64>> = BTreeMap::new();
    let mut evals: BTreeMap<i64, BTreeMap<String, f64>> = BTreeMap::new();
    for ((kind, name), points) in series {
        let kept = match max_points {
            Some(max) => downsample::min_max(&points, max),
            None => points,
        };
        let target = if kind == Series::Eval { &mut evals } else { &mut steps };
        for (step, value) in kept {
            target.entry(step).or_default().insert(name.clone(), value);
        }
    }
    let rows_of = |kind: Series, map: BTreeMap<i64, BTreeMap<String, f64>>| {
        map.into_iter()
            .map(|(step, values)| MetricRow { step: step as u64, phase: phases.get(&(kind, step)).copied(), values })
            .collect()
    };
    let mut ranks = gangs::rank_steps(db, job).await?;
    if let Some(max) = max_points {
        // Every k-th step of each rank, so the series keep their shape.
        let per_rank = ranks.iter().map(|r| r.rank).max().map_or(1, |m| m as usize + 1);
        let stride = ranks.len().div_ceil(max.saturating_mul(per_rank).max(1)).max(1);
        ranks.retain(|r| r.step % stride as u64 == 0);
    }
    Ok((TrainingMetrics { steps: rows_of(Series::Step, steps), evals: rows_of(Series::Eval, evals), ranks }, counts))
}
