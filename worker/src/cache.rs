//! The model cache (`<data>/models/<id>/`) kept within its disk, as kubelet collects
//! unused images: before a model is fetched, when the filesystem holding the cache would be
//! more than [`HIGH`] full with it, the folders of models no job of this worker uses are
//! deleted, least recently fetched first, until it would be at most [`LOW`] full or none is
//! left. A model in use is never deleted; one that was is fetched again when a job needs it.
//! Without this a long-lived worker's disk fills with every model it ever served, and
//! then every download fails.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use uuid::Uuid;

/// Past this share of the filesystem used, a fetch first makes room.
pub const HIGH: f64 = 0.85;
/// What making room aims for.
pub const LOW: f64 = 0.80;

/// Written into a model's folder each time a job fetches it: its mtime is the last use.
const FETCHED: &str = ".last-fetched";

/// The models this worker's jobs use now, shared by its jobs.
#[derive(Default)]
pub struct ModelCache {
    users: Mutex<HashMap<Uuid, usize>>,
}

/// A job's use of a cached model: while it lives, the model's folder stays.
pub struct InUse {
    cache: Arc<ModelCache>,
    model: Uuid,
}

impl Drop for InUse {
    fn drop(&mut self) {
        let mut users = self.cache.users.lock().expect("model cache lock");
        if let Some(count) = users.get_mut(&self.model) {
            *count -= 1;
            if *count == 0 {
                users.remove(&self.model);
            }
        }
    }
}

/// How full a filesystem is, in bytes.
#[derive(Debug, Clone, Copy)]
pub struct Disk {
    pub total: u64,
    pub free: u64,
}

/// A model folder in the cache.
#[derive(Debug, Clone)]
pub struct Cached {
    pub model: Uuid,
    pub fetched: SystemTime,
    pub bytes: u64,
}

impl ModelCache {
    /// Marks `model` in use until the answer is dropped, and as fetched now under `models`.
    pub fn hold(self: &Arc<Self>, models: &Path, model: Uuid) -> InUse {
        *self.users.lock().expect("model cache lock").entry(model).or_insert(0) += 1;
        let folder = models.join(model.to_string());
        if let Err(error) = std::fs::create_dir_all(&folder).and_then(|_| std::fs::write(folder.join(FETCHED), b"")) {
            tracing::warn!(%error, folder = %folder.display(), "could not mark the model folder as used");
        }
        InUse { cache: Arc::clone(self), model }
    }

    /// Makes room under `models` for `model`, of `size` bytes in all, less what its folder
    /// holds already ([`HIGH`], [`LOW`]); answers the models deleted. No job takes a model
    /// up while this runs.
    pub fn make_room(&self, models: &Path, model: Uuid, size: u64) -> std::io::Result<Vec<Cached>> {
        let users = self.users.lock().expect("model cache lock");
        let incoming = size.saturating_sub(folder_bytes(&models.join(model.to_string())).unwrap_or(0));
        let disk = disk(models)?;
        if !over(disk, incoming, HIGH) {
            return Ok(Vec::new());
        }
        let in_use: HashSet<Uuid> = users.keys().copied().collect();
        let deleted = to_delete(cached(models)?, &in_use, disk, incoming);
        for model in &deleted {
            std::fs::remove_dir_all(models.join(model.model.to_string()))?;
            tracing::info!(model = %model.model, bytes = model.bytes, "deleted an unused cached model to make room");
        }
        Ok(deleted)
    }
}

/// Whether `disk` with `incoming` more bytes is fuller than `share`.
fn over(disk: Disk, incoming: u64, share: f64) -> bool {
    let used = disk.total.saturating_sub(disk.free).saturating_add(incoming);
    used as f64 > share * disk.total as f64
}

/// The models to delete, least recently fetched first and none in use, until `incoming`
/// more bytes would leave `disk` at most [`LOW`] full (all unused ones if that is not enough).
pub fn to_delete(mut cached: Vec<Cached>, in_use: &HashSet<Uuid>, disk: Disk, incoming: u64) -> Vec<Cached> {
    cached.retain(|c| !in_use.contains(&c.model));
    cached.sort_by_key(|c| (c.fetched, c.model));
    let mut free = disk.free;
    let mut deleted = Vec::new();
    for model in cached {
        if !over(Disk { free, ..disk }, incoming, LOW) {
            break;
        }
        free = free.saturating_add(model.bytes);
        deleted.push(model);
    }
    deleted
}

/// The model folders under `models` (folders named by a model id; anything else is left be).
fn cached(models: &Path) -> std::io::Result<Vec<Cached>> {
    let mut cached = Vec::new();
    let Ok(entries) = std::fs::read_dir(models) else { return Ok(cached) };
    for entry in entries {
        let entry = entry?;
        let Some(model) = entry.file_name().to_str().and_then(|name| name.parse::<Uuid>().ok()) else { continue };
        if !entry.file_type()?.is_dir() {
            continue;
        }
        let fetched = std::fs::metadata(entry.path().join(FETCHED)).or_else(|_| entry.metadata())?.modified()?;
        cached.push(Cached { model, fetched, bytes: folder_bytes(&entry.path())? });
    }
    Ok(cached)
}

fn folder_bytes(folder: &Path) -> std::io::Result<u64> {
    let mut bytes = 0;
    for entry in std::fs::read_dir(folder)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        bytes += if kind.is_dir() { folder_bytes(&entry.path())? } else { entry.metadata()?.len() };
    }
    Ok(bytes)
}

/// The size and free space of the filesystem holding `path` (its nearest existing folder).
fn disk(path: &Path) -> std::io::Result<Disk> {
    use std::os::unix::ffi::OsStrExt;
    let existing = path.ancestors().find(|p| p.exists()).unwrap_or(Path::new("/"));
    let name = std::ffi::CString::new(existing.as_os_str().as_bytes())?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `name` is a NUL-terminated path and `stat` is written by statvfs on success.
    if unsafe { libc::statvfs(name.as_ptr(), stat.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it filled `stat`.
    let stat = unsafe { stat.assume_init() };
    let block = stat.f_frsize as u64;
    Ok(Disk { total: stat.f_blocks as u64 * block, free: stat.f_bavail as u64 * block })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn model(age_s: u64, bytes: u64) -> Cached {
        Cached { model: Uuid::new_v4(), fetched: SystemTime::UNIX_EPOCH + Duration::from_secs(1000 - age_s), bytes }
    }

    #[test]
    fn the_least_recently_fetched_unused_models_go_until_the_disk_is_back_under_the_low_mark() {
        let (old, older, oldest, held) = (model(10, 50), model(20, 50), model(30, 50), model(40, 500));
        let cached = vec![old.clone(), held.clone(), oldest.clone(), older.clone()];
        let in_use = HashSet::from([held.model]);
        // 1000 bytes, 120 free: fetching 30 would use 910 (over 850); 800 needs 110 freed.
        let disk = Disk { total: 1000, free: 120 };
        let deleted: Vec<Uuid> = to_delete(cached.clone(), &in_use, disk, 30).iter().map(|c| c.model).collect();
        assert_eq!(deleted, [oldest.model, older.model, old.model], "oldest first, the held one kept");
        // 750 used is under the low mark already.
        let deleted: Vec<Uuid> = to_delete(cached.clone(), &in_use, Disk { total: 1000, free: 250 }, 0).iter().map(|c| c.model).collect();
        assert!(deleted.is_empty(), "already under the low mark");
        let deleted: Vec<Uuid> = to_delete(cached, &in_use, Disk { total: 1000, free: 160 }, 0).iter().map(|c| c.model).collect();
        assert_eq!(deleted, [oldest.model], "one folder brings 840 used down to 790");
    }

    #[test]
    fn only_a_fetch_past_the_high_mark_makes_room() {
        let disk = Disk { total: 1000, free: 200 };
        assert!(!over(disk, 50, HIGH));
        assert!(over(disk, 51, HIGH));
    }

    #[test]
    fn a_held_model_is_kept_until_its_last_job_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Arc::new(ModelCache::default());
        let model = Uuid::new_v4();
        let (first, second) = (cache.hold(dir.path(), model), cache.hold(dir.path(), model));
        assert!(dir.path().join(model.to_string()).join(FETCHED).exists());
        drop(first);
        assert!(cache.users.lock().unwrap().contains_key(&model));
        drop(second);
        assert!(cache.users.lock().unwrap().is_empty());
        let found = cached(dir.path()).unwrap();
        assert_eq!(found.iter().map(|c| c.model).collect::<Vec<_>>(), [model]);
        assert!(disk(&dir.path().join("not yet")).unwrap().total > 0, "a folder not made yet is on its parent's disk");
    }
}
