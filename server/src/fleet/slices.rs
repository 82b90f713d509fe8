//! The slices workers offer, checked before the store records them: each reported MIG
//! partition must be legal for its GPU model, and starts are arranged when the worker
//! could not read them. Binding replicas to slices (one per slice; a pinned replica waits
//! for its slice) is `store::slices`.

use std::collections::BTreeMap;

use tessera_api::mig::Slice;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::scheduler::mig::{arrange, validate, GpuModel, Placed};
use crate::store::db::Db;
use crate::store::slices as store;

/// Fills in legal starts for the MIG slices of each known GPU model, or says what is
/// wrong with the reported partition.
pub fn with_starts(slices: &[Slice]) -> Result<Vec<Slice>> {
    let mut by_gpu: BTreeMap<&str, Vec<&Slice>> = BTreeMap::new();
    for s in slices {
        by_gpu.entry(s.gpu_uuid.as_str()).or_default().push(s);
    }
    let mut out = Vec::with_capacity(slices.len());
    for (gpu_uuid, group) in by_gpu {
        let model = group[0].gpu_model.as_deref().and_then(GpuModel::parse);
        let mig: Vec<&Slice> = group
            .iter()
            .copied()
            .filter(|s| s.profile.is_some())
            .collect();
        let Some(model) = model.filter(|_| !mig.is_empty()) else {
            out.extend(group.into_iter().cloned());
            continue;
        };
        let invalid =
            |what: String| Error::invalid("invalid_slices", format!("GPU {gpu_uuid}: {what}"));
        let mut ids = Vec::with_capacity(mig.len());
        for s in &mig {
            let name = s.profile.as_deref().unwrap_or_default();
            ids.push(model.profile_id(name).ok_or_else(|| {
                invalid(format!(
                    "{model} has no MIG profile \"{name}\"; its profiles are {}",
                    model.profile_names()
                ))
            })?);
        }
        let starts: Vec<Option<u8>> = mig.iter().map(|s| s.start).collect();
        let placed: Vec<Placed> = if starts.iter().all(Option::is_some) {
            let placed: Vec<Placed> = ids
                .iter()
                .zip(&starts)
                .map(|(&profile, s)| Placed {
                    profile,
                    start: s.unwrap(),
                })
                .collect();
            validate(model, &placed)
                .map_err(|e| invalid(format!("not a legal MIG partition: {e}")))?;
            placed
        } else if starts.iter().all(Option::is_none) {
            // Arranged in order of the sorted placement, then matched back by profile.
            let mut arranged = arrange(model, &ids)
                .map_err(|e| invalid(format!("not a legal MIG partition: {e}")))?;
            ids.iter()
                .map(|&p| {
                    let i = arranged
                        .iter()
                        .position(|a| a.profile == p)
                        .expect("arrange keeps every profile");
                    arranged.remove(i)
                })
                .collect()
        } else {
            return Err(invalid(
                "give a start for every MIG instance or for none".into(),
            ));
        };
        for (s, p) in mig.iter().zip(placed) {
            out.push(Slice {
                start: Some(p.start),
                ..(*s).clone()
            });
        }
        out.extend(
            group
                .iter()
                .filter(|s| s.profile.is_none())
                .map(|s| (*s).clone()),
        );
    }
    Ok(out)
}

/// Records what a registering worker offers: `slices` as [`with_starts`] arranged them
/// (checked before the registration changes anything).
pub async fn record(db: &Db, worker: Uuid, allow_repartition: bool, slices: &[Slice]) -> Result<()> {
    Ok(store::record(db, worker, allow_repartition, slices).await?)
}

/// The first of `slices` another online worker (not named `name`) offers, with its name.
pub async fn offered_by_another(db: &Db, name: &str, slices: &[Slice], online_since: i64) -> Result<Option<(String, String)>> {
    Ok(store::offered_by_another(db, name, slices, online_since).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(gpu: &str, profile: Option<&str>, start: Option<u8>) -> Slice {
        Slice {
            uuid: format!("{gpu}-{profile:?}-{start:?}"),
            gpu_uuid: gpu.into(),
            gpu_index: 0,
            gpu_model: Some("H100-80GB".into()),
            profile: profile.map(Into::into),
            start,
            memory_bytes: 0,
            simulated: true,
        }
    }

    #[test]
    fn starts_are_arranged_when_none_were_reported() {
        let out = with_starts(&[
            slice("g", Some("2g.20gb"), None),
            slice("g", Some("3g.40gb"), None),
            slice("g", Some("2g.20gb"), None),
        ])
        .unwrap();
        let placed: Vec<Placed> = out
            .iter()
            .map(|s| Placed {
                profile: GpuModel::H100_80GB
                    .profile_id(s.profile.as_deref().unwrap())
                    .unwrap(),
                start: s.start.unwrap(),
            })
            .collect();
        validate(GpuModel::H100_80GB, &placed).unwrap();
        assert_eq!(
            out.iter()
                .filter(|s| s.profile.as_deref() == Some("2g.20gb"))
                .count(),
            2
        );
    }

    #[test]
    fn an_illegal_or_unknown_partition_is_refused_with_the_reason() {
        let err = with_starts(&[
            slice("g", Some("4g.40gb"), None),
            slice("g", Some("4g.40gb"), None),
        ])
        .unwrap_err();
        assert!(
            err.to_string().contains("GPU g: not a legal MIG partition"),
            "{err}"
        );
        let err = with_starts(&[slice("g", Some("1g.5gb"), None)]).unwrap_err();
        assert!(
            err.to_string()
                .contains("H100-80GB has no MIG profile \"1g.5gb\""),
            "{err}"
        );
        let err = with_starts(&[
            slice("g", Some("3g.40gb"), Some(0)),
            slice("g", Some("3g.40gb"), None),
        ])
        .unwrap_err();
        assert!(err.to_string().contains("every MIG instance or for none"));
        let err = with_starts(&[slice("g", Some("3g.40gb"), Some(2))]).unwrap_err();
        assert!(
            err.to_string().contains("not a legal MIG partition"),
            "{err}"
        );
    }
}
