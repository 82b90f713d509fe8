//! Throughput tables: what one replica of a model serves on each MIG profile, from the
//! profiler's measurements, with the profiles nobody measured estimated by a cost model.
//!
//! The cost model: at the same batch size, throughput grows with the compute slices `c`
//! of a profile as `c^α` with α = [`SCALING_EXPONENT`] < 1, because a small transformer
//! does not keep a larger instance's SMs as busy (MIG-serving's observation that two
//! 1/7 instances can beat one 2/7); p99 latency at that batch shrinks by the same factor.
//! An unmeasured profile is estimated from the measured profile of the same GPU model
//! with the nearest compute-slice count (the larger one on a tie). Memory is not
//! modelled: the encoder models served here fit the smallest instance.
//!
//! The planner reads, per profile, the best throughput over the batch sizes whose p99
//! meets the latency SLO (MIG-serving folds the SLO into the table the same way).

use super::mig::GpuModel;

/// α in throughput ∝ compute_slices^α.
pub const SCALING_EXPONENT: f64 = 0.85;

/// One row: a batch size on a profile of a GPU model.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub gpu_model: String,
    pub profile: String,
    pub batch_size: u32,
    pub throughput: f64,
    pub p99_ms: f64,
    pub estimated: bool,
    pub simulated: bool,
    pub measured_at: Option<i64>,
}

/// The measured rows plus an estimated row for every (profile, batch size) of a GPU model
/// that has at least one measured profile but not this one.
pub fn complete(measured: &[Row]) -> Vec<Row> {
    let mut rows: Vec<Row> = measured.to_vec();
    let mut models: Vec<&str> = measured.iter().map(|r| r.gpu_model.as_str()).collect();
    models.sort_unstable();
    models.dedup();
    for name in models {
        let Some(gpu) = GpuModel::parse(name) else {
            continue;
        };
        let compute = |profile: &str| gpu.profile_id(profile).map(|p| gpu.profile(p).compute);
        let have: Vec<(&str, u8)> = {
            let mut v: Vec<(&str, u8)> = measured
                .iter()
                .filter(|r| r.gpu_model == name)
                .filter_map(|r| Some((r.profile.as_str(), compute(&r.profile)?)))
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        if have.is_empty() {
            continue;
        }
        for target in gpu.profiles() {
            if have.iter().any(|(p, _)| *p == target.name) {
                continue;
            }
            let &(reference, c_ref) = have
                .iter()
                .min_by_key(|(_, c)| (c.abs_diff(target.compute), std::cmp::Reverse(*c)))
                .expect("have is not empty");
            let factor = (target.compute as f64 / c_ref as f64).powf(SCALING_EXPONENT);
            for r in measured
                .iter()
                .filter(|r| r.gpu_model == name && r.profile == reference)
            {
                rows.push(Row {
                    profile: target.name.to_string(),
                    throughput: r.throughput * factor,
                    p99_ms: r.p99_ms / factor,
                    estimated: true,
                    measured_at: None,
                    ..r.clone()
                });
            }
        }
    }
    rows.sort_by(|a, b| {
        (a.gpu_model.as_str(), a.profile.as_str(), a.batch_size).cmp(&(
            b.gpu_model.as_str(),
            b.profile.as_str(),
            b.batch_size,
        ))
    });
    rows
}

/// A profile's rate for the planner: the best throughput among rows whose p99 meets
/// `latency_ms` (any row when there is no SLO), and whether it is an estimate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    pub throughput: f64,
    pub estimated: bool,
}

/// Rates of `gpu`'s profiles (indexed by profile id) from a completed table; `None`
/// where no row meets the SLO.
pub fn rates(rows: &[Row], gpu: GpuModel, latency_ms: Option<f64>) -> Vec<Option<Rate>> {
    gpu.profiles()
        .iter()
        .map(|profile| {
            rows.iter()
                .filter(|r| GpuModel::parse(&r.gpu_model) == Some(gpu) && r.profile == profile.name)
                .filter(|r| latency_ms.is_none_or(|l| r.p99_ms <= l))
                .max_by(|a, b| a.throughput.total_cmp(&b.throughput))
                .map(|r| Rate {
                    throughput: r.throughput,
                    estimated: r.estimated,
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(profile: &str, batch_size: u32, throughput: f64, p99_ms: f64) -> Row {
        Row {
            gpu_model: "H100-80GB".into(),
            profile: profile.into(),
            batch_size,
            throughput,
            p99_ms,
            estimated: false,
            simulated: false,
            measured_at: Some(1),
        }
    }

    #[test]
    fn unmeasured_profiles_scale_sub_linearly_from_the_nearest_measured_one() {
        let table = complete(&[
            row("1g.10gb", 8, 100.0, 80.0),
            row("7g.80gb", 8, 500.0, 16.0),
        ]);
        let two = table.iter().find(|r| r.profile == "2g.20gb").unwrap();
        assert!(two.estimated);
        assert!((two.throughput - 100.0 * 2f64.powf(SCALING_EXPONENT)).abs() < 1e-9);
        assert!(two.throughput < 200.0, "sub-linear");
        // 4g is 3 slices from both 1g and 7g: the larger wins the tie.
        let four = table.iter().find(|r| r.profile == "4g.40gb").unwrap();
        assert!((four.throughput - 500.0 * (4.0f64 / 7.0).powf(SCALING_EXPONENT)).abs() < 1e-9);
        let measured = table.iter().filter(|r| !r.estimated).count();
        assert_eq!(measured, 2);
        assert_eq!(table.len(), 7, "every H100 profile has a row");
    }

    #[test]
    fn the_rate_is_the_best_batch_that_meets_the_latency_slo() {
        let table = complete(&[
            row("3g.40gb", 1, 50.0, 20.0),
            row("3g.40gb", 16, 400.0, 40.0),
            row("3g.40gb", 64, 700.0, 90.0),
        ]);
        let gpu = GpuModel::H100_80GB;
        let three = gpu.profile_id("3g.40gb").unwrap();
        assert_eq!(
            rates(&table, gpu, Some(50.0))[three].unwrap().throughput,
            400.0
        );
        assert_eq!(rates(&table, gpu, None)[three].unwrap().throughput, 700.0);
        assert!(rates(&table, gpu, Some(10.0))[three].is_none());
        // A smaller instance is slower: its estimated p99 at batch 16 is 40 / (1/3)^α ≈ 102 ms.
        let one = gpu.profile_id("1g.10gb").unwrap();
        assert!(rates(&table, gpu, Some(50.0))[one].is_none());
        assert!(rates(&table, gpu, Some(120.0))[one].unwrap().estimated);
        assert!(
            rates(&table, GpuModel::A100_80GB, None)
                .iter()
                .all(Option::is_none),
            "no A100 measurement"
        );
    }
}
