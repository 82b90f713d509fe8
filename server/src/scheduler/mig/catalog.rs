//! NVIDIA's MIG GPU-instance profiles for the GPUs Tessera plans for: how many compute and
//! memory slices each profile takes and where on the 8-slice memory axis it may start.
//!
//! Source: NVIDIA MIG user guide, "Supported MIG Profiles" and `nvidia-smi mig -lgipp`
//! (summarised in `shared/research/mig_aryl.md` §2). The four GPUs share one geometry
//! (7 compute slices, 8 memory slices); only the memory sizes in the names differ. The
//! note does not list H200 names: 1g.18gb and 2g.35gb were checked against a public
//! mig-parted configuration, the others follow NVIDIA's naming (memory share of 141 GB)
//! and should be checked against `nvidia-smi mig -lgip` on a real H200.

use std::fmt;

/// Compute slices on every MIG-capable GPU in the catalog.
pub const COMPUTE_SLICES: u8 = 7;
/// Memory slices on every MIG-capable GPU in the catalog; starts index this axis.
pub const MEMORY_SLICES: u8 = 8;

/// Index of a profile in [`GpuModel::profiles`].
pub type ProfileId = usize;

/// One GPU-instance profile: a slice shape and where it may be placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Profile {
    pub name: &'static str,
    /// Compute slices (the `Ng` in the name).
    pub compute: u8,
    /// Memory slices it occupies, starting at its start position.
    pub memory: u8,
    /// Legal start positions on the memory axis.
    pub starts: &'static [u8],
    /// Most instances of this profile one GPU can hold.
    pub max_count: u8,
    /// Memory in GB as the profile name states it.
    pub memory_gb: u16,
}

/// A GPU model whose MIG geometry the planner knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GpuModel {
    A100_40GB,
    A100_80GB,
    H100_80GB,
    H200_141GB,
}

/// The shapes, in the order every table below uses: 1g, 1g with media extensions, 1g with
/// two memory slices, 2g, 3g, 4g, 7g.
const SHAPES: [(u8, u8, &[u8], u8); 7] = [
    (1, 1, &[0, 1, 2, 3, 4, 5, 6], 7),
    (1, 1, &[0, 1, 2, 3, 4, 5, 6], 1),
    (1, 2, &[0, 2, 4, 6], 4),
    (2, 2, &[0, 2, 4], 3),
    (3, 4, &[0, 4], 2),
    (4, 4, &[0], 1),
    (7, 8, &[0], 1),
];

const fn table(names: [&'static str; 7], gb: [u16; 7]) -> [Profile; 7] {
    let mut out = [Profile { name: "", compute: 0, memory: 0, starts: &[], max_count: 0, memory_gb: 0 }; 7];
    let mut i = 0;
    while i < 7 {
        let (compute, memory, starts, max_count) = SHAPES[i];
        out[i] = Profile { name: names[i], compute, memory, starts, max_count, memory_gb: gb[i] };
        i += 1;
    }
    out
}

static A100_40GB: [Profile; 7] =
    table(["1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"], [5, 5, 10, 10, 20, 20, 40]);
static GB80: [Profile; 7] = table(
    ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    [10, 10, 20, 20, 40, 40, 80],
);
static H200_141GB: [Profile; 7] = table(
    ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
    [18, 18, 35, 35, 71, 71, 141],
);

impl GpuModel {
    pub const ALL: [GpuModel; 4] =
        [GpuModel::A100_40GB, GpuModel::A100_80GB, GpuModel::H100_80GB, GpuModel::H200_141GB];

    pub fn name(self) -> &'static str {
        match self {
            GpuModel::A100_40GB => "A100-40GB",
            GpuModel::A100_80GB => "A100-80GB",
            GpuModel::H100_80GB => "H100-80GB",
            GpuModel::H200_141GB => "H200-141GB",
        }
    }

    /// Parses a model name as [`GpuModel::name`] writes it, ignoring case.
    pub fn parse(text: &str) -> Option<GpuModel> {
        GpuModel::ALL.into_iter().find(|m| m.name().eq_ignore_ascii_case(text.trim()))
    }

    pub fn profiles(self) -> &'static [Profile] {
        match self {
            GpuModel::A100_40GB => &A100_40GB,
            GpuModel::A100_80GB | GpuModel::H100_80GB => &GB80,
            GpuModel::H200_141GB => &H200_141GB,
        }
    }

    pub fn profile(self, id: ProfileId) -> &'static Profile {
        &self.profiles()[id]
    }

    /// The profile with this exact name (names are case-sensitive in nvidia-smi too).
    pub fn profile_id(self, name: &str) -> Option<ProfileId> {
        self.profiles().iter().position(|p| p.name == name)
    }

    /// The profile that takes the whole GPU (7g).
    pub fn whole_gpu_profile(self) -> ProfileId {
        self.profiles().iter().position(|p| p.compute == COMPUTE_SLICES).expect("every catalog GPU has a 7g profile")
    }

    /// Profile names joined for error messages.
    pub fn profile_names(self) -> String {
        self.profiles().iter().map(|p| p.name).collect::<Vec<_>>().join(", ")
    }
}

impl fmt::Display for GpuModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_gpu_has_seven_profiles_on_the_same_geometry() {
        for gpu in GpuModel::ALL {
            let profiles = gpu.profiles();
            assert_eq!(profiles.len(), 7, "{gpu}");
            for p in profiles {
                for &start in p.starts {
                    assert!(start + p.memory <= MEMORY_SLICES, "{gpu} {} starts at {start}", p.name);
                }
                assert!(p.compute <= COMPUTE_SLICES);
            }
            assert_eq!(gpu.profile(gpu.whole_gpu_profile()).memory, MEMORY_SLICES);
        }
    }

    #[test]
    fn profile_names_follow_the_memory_size_of_each_gpu() {
        assert_eq!(GpuModel::A100_40GB.profile_id("3g.20gb"), Some(4));
        assert_eq!(GpuModel::A100_80GB.profile_id("3g.40gb"), Some(4));
        assert_eq!(GpuModel::H100_80GB.profile_id("1g.20gb"), Some(2));
        assert_eq!(GpuModel::H200_141GB.profile_id("7g.141gb"), Some(6));
        // The same name is a different shape on a different GPU: 1g.10gb is one memory
        // slice on an 80 GB card and two on a 40 GB card.
        let a40 = GpuModel::A100_40GB.profile(GpuModel::A100_40GB.profile_id("1g.10gb").unwrap());
        let a80 = GpuModel::A100_80GB.profile(GpuModel::A100_80GB.profile_id("1g.10gb").unwrap());
        assert_eq!((a40.memory, a80.memory), (2, 1));
        assert_eq!(GpuModel::A100_80GB.profile_id("1g.5gb"), None);
    }

    #[test]
    fn gpu_names_parse_ignoring_case() {
        assert_eq!(GpuModel::parse("a100-80gb"), Some(GpuModel::A100_80GB));
        assert_eq!(GpuModel::parse("H200-141GB"), Some(GpuModel::H200_141GB));
        assert_eq!(GpuModel::parse("V100"), None);
    }
}
