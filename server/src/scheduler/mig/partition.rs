//! Legal MIG partitions: which sets of (profile, start) one GPU can hold at once.
//!
//! The rules (NVIDIA MIG user guide, placements from `nvidia-smi mig -lgipp`; research note
//! §2): every instance starts at one of its profile's legal starts on the 8-slice memory
//! axis and occupies `memory` consecutive slices from there; instances never share a memory
//! slice; the compute slices add up to at most 7; a profile appears at most `max_count`
//! times. With the five classic A100 shapes (1g, 2g, 3g, 4g, 7g) the maximal partitions
//! are exactly the 19 realisations of the research note, which a test checks.

use super::catalog::{GpuModel, ProfileId, COMPUTE_SLICES, MEMORY_SLICES};

/// One GPU instance placed on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Placed {
    pub profile: ProfileId,
    pub start: u8,
}

/// Why a set of instances is not a legal partition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PartitionError {
    #[error("{gpu} has no profile named \"{name}\"; its profiles are {valid}")]
    UnknownProfile { gpu: GpuModel, name: String, valid: String },
    #[error("{profile} cannot start at memory slice {start} on {gpu}; its legal starts are {legal:?}")]
    IllegalStart { gpu: GpuModel, profile: &'static str, start: u8, legal: &'static [u8] },
    #[error("{first} at start {first_start} and {second} at start {second_start} overlap on the memory slices")]
    Overlap { first: &'static str, first_start: u8, second: &'static str, second_start: u8 },
    #[error("the instances need {used} compute slices and a GPU has {COMPUTE_SLICES}")]
    TooMuchCompute { used: u32 },
    #[error("the instances need {used} memory slices and a GPU has {MEMORY_SLICES}")]
    TooMuchMemory { used: u32 },
    #[error("{count} instances of {profile}, but a GPU holds at most {max}")]
    TooMany { profile: &'static str, count: usize, max: u8 },
    #[error("no placement of {profiles} fits on one {gpu}: the legal start positions collide")]
    NoArrangement { gpu: GpuModel, profiles: String },
}

/// The memory slices an instance occupies, as a bit mask.
pub fn memory_mask(gpu: GpuModel, slice: Placed) -> u8 {
    let p = gpu.profile(slice.profile);
    let bits = ((1u16 << p.memory) - 1) as u8;
    bits << slice.start
}

/// Checks that `slices` can exist together on one GPU.
pub fn validate(gpu: GpuModel, slices: &[Placed]) -> Result<(), PartitionError> {
    let profiles: Vec<ProfileId> = slices.iter().map(|s| s.profile).collect();
    check_totals(gpu, &profiles)?;
    for s in slices {
        let p = gpu.profile(s.profile);
        if !p.starts.contains(&s.start) {
            return Err(PartitionError::IllegalStart { gpu, profile: p.name, start: s.start, legal: p.starts });
        }
    }
    for (i, a) in slices.iter().enumerate() {
        for b in &slices[i + 1..] {
            if memory_mask(gpu, *a) & memory_mask(gpu, *b) != 0 {
                return Err(PartitionError::Overlap {
                    first: gpu.profile(a.profile).name,
                    first_start: a.start,
                    second: gpu.profile(b.profile).name,
                    second_start: b.start,
                });
            }
        }
    }
    Ok(())
}

/// Whether `slice` can be added to the legal partition `existing`.
pub fn fits(gpu: GpuModel, existing: &[Placed], slice: Placed) -> bool {
    let mut all = existing.to_vec();
    all.push(slice);
    validate(gpu, &all).is_ok()
}

/// Counts and totals, checked before any placement is tried so the error names the cause.
fn check_totals(gpu: GpuModel, profiles: &[ProfileId]) -> Result<(), PartitionError> {
    let compute: u32 = profiles.iter().map(|&p| gpu.profile(p).compute as u32).sum();
    if compute > COMPUTE_SLICES as u32 {
        return Err(PartitionError::TooMuchCompute { used: compute });
    }
    let memory: u32 = profiles.iter().map(|&p| gpu.profile(p).memory as u32).sum();
    if memory > MEMORY_SLICES as u32 {
        return Err(PartitionError::TooMuchMemory { used: memory });
    }
    for (id, p) in gpu.profiles().iter().enumerate() {
        let count = profiles.iter().filter(|&&q| q == id).count();
        if count > p.max_count as usize {
            return Err(PartitionError::TooMany { profile: p.name, count, max: p.max_count });
        }
    }
    // One 1g instance per GPU may carry the media extensions, whichever 1g it is.
    let media = profiles.iter().filter(|&&p| gpu.profile(p).name.ends_with("+me")).count();
    if media > 1 {
        let name = gpu.profiles().iter().find(|p| p.name.ends_with("+me")).map_or("+me", |p| p.name);
        return Err(PartitionError::TooMany { profile: name, count: media, max: 1 });
    }
    Ok(())
}

/// Finds legal start positions for a multiset of profiles (what mig-parted does by trying
/// orderings; here a depth-first search, biggest instances first). The result is sorted by
/// start.
pub fn arrange(gpu: GpuModel, profiles: &[ProfileId]) -> Result<Vec<Placed>, PartitionError> {
    check_totals(gpu, profiles)?;
    let mut order = profiles.to_vec();
    order.sort_by_key(|&p| {
        let pr = gpu.profile(p);
        (std::cmp::Reverse(pr.memory), pr.starts.len(), p)
    });
    let mut placed = Vec::with_capacity(order.len());
    if place_rest(gpu, &order, 0, &mut placed) {
        placed.sort_by_key(|s| s.start);
        Ok(placed)
    } else {
        let names: Vec<&str> = profiles.iter().map(|&p| gpu.profile(p).name).collect();
        Err(PartitionError::NoArrangement { gpu, profiles: names.join(" + ") })
    }
}

fn place_rest(gpu: GpuModel, order: &[ProfileId], used: u8, placed: &mut Vec<Placed>) -> bool {
    let Some((&profile, rest)) = order.split_first() else { return true };
    for &start in gpu.profile(profile).starts {
        let slice = Placed { profile, start };
        let mask = memory_mask(gpu, slice);
        if mask & used == 0 {
            placed.push(slice);
            if place_rest(gpu, rest, used | mask, placed) {
                return true;
            }
            placed.pop();
        }
    }
    false
}

/// Parses profile names and arranges them; the error names the first unknown profile.
pub fn parse_partition(gpu: GpuModel, names: &[&str]) -> Result<Vec<Placed>, PartitionError> {
    let mut ids = Vec::with_capacity(names.len());
    for name in names {
        let id = gpu.profile_id(name).ok_or_else(|| PartitionError::UnknownProfile {
            gpu,
            name: name.to_string(),
            valid: gpu.profile_names(),
        })?;
        ids.push(id);
    }
    arrange(gpu, &ids)
}

/// Every non-empty legal partition built from the `allowed` profiles, each listed once
/// (sorted by start).
pub fn enumerate_legal(gpu: GpuModel, allowed: &[ProfileId]) -> Vec<Vec<Placed>> {
    let mut out = Vec::new();
    let mut current = Vec::new();
    walk(gpu, allowed, 0, 0, &mut current, &mut out);
    out
}

/// Every legal partition from `allowed` to which no further allowed instance can be added:
/// the "realisations" of the research note.
pub fn enumerate_maximal(gpu: GpuModel, allowed: &[ProfileId]) -> Vec<Vec<Placed>> {
    enumerate_legal(gpu, allowed)
        .into_iter()
        .filter(|slices| {
            !allowed.iter().any(|&profile| {
                gpu.profile(profile).starts.iter().any(|&start| fits(gpu, slices, Placed { profile, start }))
            })
        })
        .collect()
}

/// Canonical enumeration: at each memory position either nothing starts there or one
/// instance does, so every set is produced exactly once.
fn walk(
    gpu: GpuModel,
    allowed: &[ProfileId],
    pos: u8,
    used: u8,
    current: &mut Vec<Placed>,
    out: &mut Vec<Vec<Placed>>,
) {
    if pos == MEMORY_SLICES {
        if !current.is_empty() {
            out.push(current.clone());
        }
        return;
    }
    walk(gpu, allowed, pos + 1, used, current, out);
    if used & (1 << pos) != 0 {
        return;
    }
    for &profile in allowed {
        let slice = Placed { profile, start: pos };
        if !gpu.profile(profile).starts.contains(&pos) {
            continue;
        }
        let mask = memory_mask(gpu, slice);
        if mask & used != 0 || !fits(gpu, current, slice) {
            continue;
        }
        current.push(slice);
        walk(gpu, allowed, pos + 1, used | mask, current, out);
        current.pop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The research note's notation: compute slices in start order, `x` for the compute
    /// slice a 3g instance at start 0 leaves unusable.
    fn realisation(gpu: GpuModel, slices: &[Placed]) -> String {
        let mut parts = Vec::new();
        for s in slices {
            let p = gpu.profile(s.profile);
            parts.push(p.compute.to_string());
            if p.compute == 3 && s.start == 0 {
                parts.push("x".into());
            }
        }
        parts.join(",")
    }

    fn classic(gpu: GpuModel) -> Vec<ProfileId> {
        ["1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"].iter().map(|n| gpu.profile_id(n).unwrap()).collect()
    }

    #[test]
    fn a100_has_exactly_the_nineteen_realisations_of_the_research_note() {
        let gpu = GpuModel::A100_40GB;
        let found: std::collections::BTreeSet<String> =
            enumerate_maximal(gpu, &classic(gpu)).iter().map(|s| realisation(gpu, s)).collect();
        let expected: std::collections::BTreeSet<String> = [
            "7",
            "4,3",
            "4,2,1",
            "4,1,1,1",
            "3,x,3",
            "3,x,2,1",
            "3,x,1,1,1",
            "2,2,3",
            "2,1,1,3",
            "1,1,2,3",
            "1,1,1,1,3",
            "2,2,2,1",
            "2,1,1,2,1",
            "1,1,2,2,1",
            "1,1,1,1,2,1",
            "2,2,1,1,1",
            "2,1,1,1,1,1",
            "1,1,2,1,1,1",
            "1,1,1,1,1,1,1",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        assert_eq!(expected.len(), 19);
        assert_eq!(found, expected);
        assert_eq!(enumerate_maximal(gpu, &classic(gpu)).len(), 19, "each realisation exactly once");
    }

    #[test]
    fn every_enumerated_partition_passes_the_validator() {
        for gpu in GpuModel::ALL {
            let all: Vec<ProfileId> = (0..gpu.profiles().len()).collect();
            let legal = enumerate_legal(gpu, &all);
            assert!(legal.len() > 19);
            for slices in &legal {
                validate(gpu, slices).unwrap();
            }
            // Maximal partitions with every profile, the +me and two-memory-slice 1g included.
            assert!(enumerate_maximal(gpu, &all).len() > 19);
        }
    }

    #[test]
    fn rejects_overlapping_instances_with_the_pair_named() {
        let gpu = GpuModel::A100_80GB;
        let p = |n: &str| gpu.profile_id(n).unwrap();
        let err =
            validate(gpu, &[Placed { profile: p("4g.40gb"), start: 0 }, Placed { profile: p("2g.20gb"), start: 2 }])
                .unwrap_err();
        assert!(matches!(err, PartitionError::Overlap { first: "4g.40gb", second: "2g.20gb", .. }), "{err}");
    }

    #[test]
    fn rejects_a_start_the_profile_does_not_allow() {
        let gpu = GpuModel::A100_80GB;
        let err = validate(gpu, &[Placed { profile: gpu.profile_id("3g.40gb").unwrap(), start: 2 }]).unwrap_err();
        assert_eq!(err.to_string(), "3g.40gb cannot start at memory slice 2 on A100-80GB; its legal starts are [0, 4]");
    }

    #[test]
    fn rejects_more_than_seven_compute_slices() {
        let err = parse_partition(GpuModel::H100_80GB, &["4g.40gb", "4g.40gb"]).unwrap_err();
        assert_eq!(err, PartitionError::TooMuchCompute { used: 8 });
    }

    #[test]
    fn rejects_two_media_extension_instances() {
        let err = parse_partition(GpuModel::A100_80GB, &["1g.10gb+me", "1g.10gb+me"]).unwrap_err();
        assert!(matches!(err, PartitionError::TooMany { profile: "1g.10gb+me", count: 2, max: 1 }), "{err}");
    }

    #[test]
    fn rejects_partitions_that_need_more_memory_than_the_gpu_has() {
        let err = parse_partition(GpuModel::A100_80GB, &["3g.40gb", "1g.20gb", "1g.20gb", "1g.20gb"]).unwrap_err();
        assert_eq!(err, PartitionError::TooMuchMemory { used: 10 });
    }

    /// `arrange` (search for starts) and `enumerate_legal` (walk over starts) are two routes
    /// to the same set of legal profile multisets.
    #[test]
    fn arrange_accepts_exactly_the_multisets_the_enumeration_finds() {
        fn multisets(
            n: usize,
            from: usize,
            budget: u8,
            gpu: GpuModel,
            cur: &mut Vec<ProfileId>,
            out: &mut Vec<Vec<ProfileId>>,
        ) {
            out.push(cur.clone());
            for p in from..n {
                let c = gpu.profile(p).compute;
                if c <= budget {
                    cur.push(p);
                    multisets(n, p, budget - c, gpu, cur, out);
                    cur.pop();
                }
            }
        }
        for gpu in GpuModel::ALL {
            let all: Vec<ProfileId> = (0..gpu.profiles().len()).collect();
            let legal: std::collections::HashSet<Vec<ProfileId>> = enumerate_legal(gpu, &all)
                .into_iter()
                .map(|s| {
                    let mut v: Vec<ProfileId> = s.iter().map(|x| x.profile).collect();
                    v.sort();
                    v
                })
                .collect();
            let mut candidates = Vec::new();
            multisets(all.len(), 0, COMPUTE_SLICES, gpu, &mut Vec::new(), &mut candidates);
            for m in candidates.iter().filter(|m| !m.is_empty()) {
                assert_eq!(arrange(gpu, m).is_ok(), legal.contains(m), "{gpu} {m:?}");
            }
        }
    }

    #[test]
    fn rejects_unknown_profile_names_with_the_valid_ones_listed() {
        let err = parse_partition(GpuModel::A100_80GB, &["1g.5gb"]).unwrap_err();
        assert!(
            err.to_string().starts_with("A100-80GB has no profile named \"1g.5gb\"; its profiles are 1g.10gb,"),
            "{err}"
        );
    }

    #[test]
    fn arranges_four_plus_three_with_the_three_at_start_four() {
        let gpu = GpuModel::A100_80GB;
        let slices = parse_partition(gpu, &["3g.40gb", "4g.40gb"]).unwrap();
        let named: Vec<(&str, u8)> = slices.iter().map(|s| (gpu.profile(s.profile).name, s.start)).collect();
        assert_eq!(named, vec![("4g.40gb", 0), ("3g.40gb", 4)]);
    }
}
