//! A training job's metric series. Every reported point is stored (one row per job,
//! series, name and step); a point reported again replaces the earlier one, so a job
//! that resumed from a checkpoint and re-ran some steps still reads as one run. Writes
//! are batched into multi-row upserts; reads can be downsampled for charts.

use std::collections::{BTreeMap, HashMap};

use sqlx::Row;
use tessera_api::train::{MetricRow, TrainingMetrics};
use uuid::Uuid;

use super::downsample;
use crate::store::db::{now_ms, Db};
use crate::error::{Error, Result};

/// Which series a point belongs to: one per training step, or one per evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Series {
    Step,
    Eval,
}

impl Series {
    fn as_str(self) -> &'static str {
        match self {
            Series::Step => "step",
            Series::Eval => "eval",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub series: Series,
    pub name: String,
    pub step: i64,
    pub value: f64,
    /// Epoch milliseconds.
    pub at: i64,
}

/// Rows per INSERT statement: 6 parameters each stays far below both databases' limits.
const ROWS_PER_STATEMENT: usize = 500;
/// Points one report may carry (the JSON body limit caps it too).
pub const MAX_POINTS_PER_REPORT: usize = 200_000;

fn check(point: &Point) -> Result<()> {
    if point.name.is_empty() || point.name.len() > 200 || point.name == "step" {
        return Err(Error::invalid("invalid_metric", "Metric names have 1 to 200 characters and are not 'step'."));
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
                points.push(Point { series, name: name.clone(), step, value: *value, at: now });
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
    // One statement may not upsert the same row twice (PostgreSQL refuses), so the
    // report's own repeats are settled here: the later point wins.
    let mut latest: HashMap<(Series, &str, i64), &Point> = HashMap::with_capacity(points.len());
    for point in &points {
        latest.insert((point.series, point.name.as_str(), point.step), point);
    }
    let unique: Vec<&Point> = latest.into_values().collect();
    let job_id = job.to_string();
    let mut tx = db.begin().await?;
    for chunk in unique.chunks(ROWS_PER_STATEMENT) {
        let values: Vec<String> = (0..chunk.len())
            .map(|i| {
                let p = i * 6;
                format!("(${}, ${}, ${}, ${}, ${}, ${})", p + 1, p + 2, p + 3, p + 4, p + 5, p + 6)
            })
            .collect();
        let sql = format!(
            "INSERT INTO job_metrics (job_id, series, name, step, value, at) VALUES {} \
             ON CONFLICT (job_id, series, name, step) DO UPDATE SET value = excluded.value, at = excluded.at",
            values.join(", ")
        );
        let mut query = sqlx::query(&sql);
        for point in chunk {
            query = query
                .bind(job_id.clone())
                .bind(point.series.as_str())
                .bind(point.name.clone())
                .bind(point.step)
                .bind(point.value)
                .bind(point.at);
        }
        query.execute(&mut *tx).await?;
    }
    if let Some(step) = points.iter().filter(|p| p.series == Series::Step).map(|p| p.step).max() {
        sqlx::query(
            "UPDATE jobs SET progress_step = $1 WHERE id = $2 AND (progress_step IS NULL OR progress_step < $1)",
        )
        .bind(step)
        .bind(&job_id)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Stores a worker's report, stamped with the server's clock.
pub async fn store_report(db: &Db, job: Uuid, report: &TrainingMetrics) -> Result<()> {
    store(db, job, points_of(report, now_ms())?).await
}

/// A job's series as rows by step. With `max_points`, each metric is downsampled on its
/// own (min/max per bucket), so a row then holds only the metrics kept at its step.
pub async fn read(db: &Db, job: Uuid, max_points: Option<usize>) -> Result<TrainingMetrics> {
    let rows =
        sqlx::query("SELECT series, name, step, value FROM job_metrics WHERE job_id = $1 ORDER BY series, name, step")
            .bind(job.to_string())
            .fetch_all(db.pool())
            .await?;
    let mut series: BTreeMap<(String, String), Vec<(i64, f64)>> = BTreeMap::new();
    for row in &rows {
        let key = (row.try_get::<String, _>("series")?, row.try_get::<String, _>("name")?);
        series.entry(key).or_default().push((row.try_get("step")?, row.try_get("value")?));
    }
    let mut steps: BTreeMap<i64, BTreeMap<String, f64>> = BTreeMap::new();
    let mut evals: BTreeMap<i64, BTreeMap<String, f64>> = BTreeMap::new();
    for ((kind, name), points) in series {
        let kept = match max_points {
            Some(max) => downsample::min_max(&points, max),
            None => points,
        };
        let target = if kind == Series::Eval.as_str() { &mut evals } else { &mut steps };
        for (step, value) in kept {
            target.entry(step).or_default().insert(name.clone(), value);
        }
    }
    let rows_of = |map: BTreeMap<i64, BTreeMap<String, f64>>| {
        map.into_iter().map(|(step, values)| MetricRow { step: step as u64, values }).collect()
    };
    Ok(TrainingMetrics { steps: rows_of(steps), evals: rows_of(evals) })
}
