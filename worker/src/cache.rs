//! The worker's cache of models (`<data>/models/<id>/`) and datasets
//! (`<data>/datasets/<sha256 hex>/`), kept within its disk as kubelet collects unused
//! images: before a fetch, when the filesystem holding the cache would be more than
//! [`HIGH`] full with it, the entries no job of this worker uses are deleted, models and
//! datasets alike, least recently fetched first, until it would be at most [`LOW`] full or
//! none is left. An entry in use is never deleted; one that was is fetched again when a job
//! needs it. Without this a long-lived worker's disk fills with every model it ever served,
//! and then every download fails.
//!
//! A dataset is immutable and named by its digest, so a training job's attempts and a
//! gang's ranks on this worker download it once ([`Cache::dataset`]); its file is checked
//! against the digest each time it is read, and fetched again if it no longer matches.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use sha2::{Digest as _, Sha256};
use uuid::Uuid;

/// Past this share of the filesystem used, a fetch first makes room.
pub const HIGH: f64 = 0.85;
/// What making room aims for.
pub const LOW: f64 = 0.80;

/// The folder under the data dir that holds the cached models.
pub const MODELS: &str = "models";
/// The folder under the data dir that holds the cached datasets.
pub const DATASETS: &str = "datasets";

/// Written into an entry's folder each time a job fetches it: its mtime is the last use.
const FETCHED: &str = ".last-fetched";
/// A cached dataset's bytes, in its folder.
const DATASET_FILE: &str = "dataset";

/// A dataset's SHA-256, as the hex digits that name its folder.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

impl Digest {
    /// `sha256:<64 hex digits>` as the server writes it; none for anything else, which
    /// could not safely name a folder.
    pub fn parse(digest: &str) -> Option<Digest> {
        Digest::of_hex(digest.strip_prefix("sha256:")?)
    }

    fn of_hex(hex: &str) -> Option<Digest> {
        let plain = hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        plain.then(|| Digest(hex.to_string()))
    }

    fn matches(&self, bytes: &[u8]) -> bool {
        hex::encode(Sha256::digest(bytes)) == self.0
    }
}

/// What the cache holds: a model's folder of files, or a dataset's file.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Entry {
    Model(Uuid),
    Dataset(Digest),
}

impl Entry {
    /// The entry's folder under the data dir `data`.
    pub fn folder(&self, data: &Path) -> PathBuf {
        match self {
            Entry::Model(model) => data.join(MODELS).join(model.to_string()),
            Entry::Dataset(digest) => data.join(DATASETS).join(&digest.0),
        }
    }

    /// The entry whose folder in the `kind` folder ([`MODELS`], [`DATASETS`]) is `name`.
    fn named(kind: &str, name: &str) -> Option<Entry> {
        match kind {
            MODELS => name.parse().ok().map(Entry::Model),
            DATASETS => Digest::of_hex(name).map(Entry::Dataset),
            _ => None,
        }
    }
}

/// Whether [`Cache::dataset`] read the dataset from the cache or had it fetched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    Cached,
    Fetched,
}

/// The entries this worker's jobs use now, shared by its jobs.
#[derive(Default)]
pub struct Cache {
    users: Mutex<HashMap<Entry, usize>>,
    /// One lock per dataset (kept once made): a job asking for a dataset another job is
    /// fetching waits, then reads what that one wrote.
    fetching: Mutex<HashMap<Digest, Arc<tokio::sync::Mutex<()>>>>,
}

/// A job's use of a cached entry: while it lives, the entry stays.
pub struct InUse {
    cache: Arc<Cache>,
    entry: Entry,
}

impl Drop for InUse {
    fn drop(&mut self) {
        let mut users = self.cache.users.lock().expect("cache lock");
        if let Some(count) = users.get_mut(&self.entry) {
            *count -= 1;
            if *count == 0 {
                users.remove(&self.entry);
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

/// An entry's folder in the cache.
#[derive(Debug, Clone)]
pub struct Cached {
    pub entry: Entry,
    pub fetched: SystemTime,
    pub bytes: u64,
}

impl Cache {
    /// Marks `entry` in use until the answer is dropped, and as fetched now under `data`.
    pub fn hold(self: &Arc<Self>, data: &Path, entry: Entry) -> InUse {
        *self.users.lock().expect("cache lock").entry(entry.clone()).or_insert(0) += 1;
        let folder = entry.folder(data);
        if let Err(error) = std::fs::create_dir_all(&folder).and_then(|_| std::fs::write(folder.join(FETCHED), b"")) {
            tracing::warn!(%error, folder = %folder.display(), "could not mark the cache folder as used");
        }
        InUse { cache: Arc::clone(self), entry }
    }

    /// Makes room under `data` for `entry`, of `size` bytes in all, less what its folder
    /// holds already ([`HIGH`], [`LOW`]); answers the entries deleted. No job takes an
    /// entry up while this runs.
    pub fn make_room(&self, data: &Path, entry: &Entry, size: u64) -> std::io::Result<Vec<Cached>> {
        let users = self.users.lock().expect("cache lock");
        let folder = entry.folder(data);
        let incoming = size.saturating_sub(folder_bytes(&folder).unwrap_or(0));
        let disk = disk(&folder)?;
        if !over(disk, incoming, HIGH) {
            return Ok(Vec::new());
        }
        let in_use: HashSet<Entry> = users.keys().cloned().collect();
        let deleted = to_delete(cached(data)?, &in_use, disk, incoming);
        for old in &deleted {
            std::fs::remove_dir_all(old.entry.folder(data))?;
            tracing::info!(entry = ?old.entry, bytes = old.bytes, "deleted an unused cache entry to make room");
        }
        Ok(deleted)
    }

    /// The bytes of the dataset of `digest`: its cached file under `data` if that still
    /// matches the digest, else what `fetch` writes at the path it is given (atomically,
    /// as the client's downloads do); a cached file that does not match is deleted first.
    /// The caller holds the dataset first ([`Cache::hold`]), so making room never deletes it.
    pub async fn dataset<E: From<std::io::Error>>(
        &self,
        data: &Path,
        digest: &Digest,
        fetch: impl AsyncFnOnce(&Path) -> Result<(), E>,
    ) -> Result<(Vec<u8>, Found), E> {
        let lock = self.fetching.lock().expect("cache lock").entry(digest.clone()).or_default().clone();
        let _fetching = lock.lock().await;
        let folder = Entry::Dataset(digest.clone()).folder(data);
        let file = folder.join(DATASET_FILE);
        match tokio::fs::read(&file).await {
            Ok(bytes) if digest.matches(&bytes) => return Ok((bytes, Found::Cached)),
            Ok(_) => {
                tracing::warn!(file = %file.display(), "a cached dataset does not match its digest; fetching it again");
                tokio::fs::remove_file(&file).await?;
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(error.into()),
        }
        tokio::fs::create_dir_all(&folder).await?;
        fetch(&file).await?;
        Ok((tokio::fs::read(&file).await?, Found::Fetched))
    }
}

/// Whether `disk` with `incoming` more bytes is fuller than `share`.
fn over(disk: Disk, incoming: u64, share: f64) -> bool {
    let used = disk.total.saturating_sub(disk.free).saturating_add(incoming);
    used as f64 > share * disk.total as f64
}

/// The entries to delete, least recently fetched first and none in use, until `incoming`
/// more bytes would leave `disk` at most [`LOW`] full (all unused ones if that is not enough).
pub fn to_delete(mut cached: Vec<Cached>, in_use: &HashSet<Entry>, disk: Disk, incoming: u64) -> Vec<Cached> {
    cached.retain(|c| !in_use.contains(&c.entry));
    cached.sort_by(|a, b| (a.fetched, &a.entry).cmp(&(b.fetched, &b.entry)));
    let mut free = disk.free;
    let mut deleted = Vec::new();
    for old in cached {
        if !over(Disk { free, ..disk }, incoming, LOW) {
            break;
        }
        free = free.saturating_add(old.bytes);
        deleted.push(old);
    }
    deleted
}

/// The entries' folders under `data` (folders named by a model id or a dataset's digest;
/// anything else is left be).
fn cached(data: &Path) -> std::io::Result<Vec<Cached>> {
    let mut cached = Vec::new();
    for kind in [MODELS, DATASETS] {
        let Ok(folders) = std::fs::read_dir(data.join(kind)) else { continue };
        for folder in folders {
            let folder = folder?;
            let Some(entry) = folder.file_name().to_str().and_then(|name| Entry::named(kind, name)) else { continue };
            if !folder.file_type()?.is_dir() {
                continue;
            }
            let fetched = std::fs::metadata(folder.path().join(FETCHED)).or_else(|_| folder.metadata())?.modified()?;
            cached.push(Cached { entry, fetched, bytes: folder_bytes(&folder.path())? });
        }
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
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    use super::*;

    fn at(age_s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1000 - age_s)
    }

    fn model(age_s: u64, bytes: u64) -> Cached {
        Cached { entry: Entry::Model(Uuid::new_v4()), fetched: at(age_s), bytes }
    }

    fn dataset(age_s: u64, bytes: u64) -> Cached {
        let digest = Digest::parse(&sha256_of(Uuid::new_v4().as_bytes())).unwrap();
        Cached { entry: Entry::Dataset(digest), fetched: at(age_s), bytes }
    }

    fn sha256_of(bytes: &[u8]) -> String {
        format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
    }

    fn entries(cached: &[Cached]) -> Vec<Entry> {
        cached.iter().map(|c| c.entry.clone()).collect()
    }

    #[test]
    fn the_least_recently_fetched_unused_entries_go_until_the_disk_is_back_under_the_low_mark() {
        let (old, older, oldest, held) = (dataset(10, 50), model(20, 50), dataset(30, 50), model(40, 500));
        let cached = vec![old.clone(), held.clone(), oldest.clone(), older.clone()];
        let in_use = HashSet::from([held.entry.clone()]);
        // 1000 bytes, 120 free: fetching 30 would use 910 (over 850); 800 needs 110 freed.
        let disk = Disk { total: 1000, free: 120 };
        let deleted = entries(&to_delete(cached.clone(), &in_use, disk, 30));
        assert_eq!(
            deleted,
            entries(&[oldest.clone(), older, old]),
            "oldest first, models and datasets alike, the held one kept"
        );
        // 750 used is under the low mark already.
        assert!(
            to_delete(cached.clone(), &in_use, Disk { total: 1000, free: 250 }, 0).is_empty(),
            "already under the low mark"
        );
        let deleted = entries(&to_delete(cached, &in_use, Disk { total: 1000, free: 160 }, 0));
        assert_eq!(deleted, entries(&[oldest]), "one folder brings 840 used down to 790");
    }

    #[test]
    fn a_dataset_in_use_is_never_deleted_even_when_the_disk_stays_full() {
        let (used, unused) = (dataset(50, 100), model(10, 100));
        let in_use = HashSet::from([used.entry.clone()]);
        let deleted = to_delete(vec![used, unused.clone()], &in_use, Disk { total: 1000, free: 0 }, 100);
        assert_eq!(entries(&deleted), entries(&[unused]), "all the unused ones, and only those");
    }

    #[test]
    fn only_a_fetch_past_the_high_mark_makes_room() {
        let disk = Disk { total: 1000, free: 200 };
        assert!(!over(disk, 50, HIGH));
        assert!(over(disk, 51, HIGH));
    }

    #[test]
    fn a_held_entry_is_kept_until_its_last_job_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Arc::new(Cache::default());
        let model = Entry::Model(Uuid::new_v4());
        let (first, second) = (cache.hold(dir.path(), model.clone()), cache.hold(dir.path(), model.clone()));
        assert!(model.folder(dir.path()).join(FETCHED).exists());
        drop(first);
        assert!(cache.users.lock().unwrap().contains_key(&model));
        drop(second);
        assert!(cache.users.lock().unwrap().is_empty());
        let dataset = Entry::Dataset(Digest::parse(&sha256_of(b"rows")).unwrap());
        drop(cache.hold(dir.path(), dataset.clone()));
        std::fs::create_dir_all(dir.path().join(DATASETS).join("not-a-digest")).unwrap();
        let mut found = entries(&cached(dir.path()).unwrap());
        found.sort();
        assert_eq!(found, [model, dataset], "both kinds are found, other folders left be");
        assert!(disk(&dir.path().join("not yet")).unwrap().total > 0, "a folder not made yet is on its parent's disk");
    }

    #[test]
    fn only_a_sha256_digest_names_a_dataset_folder() {
        assert!(Digest::parse(&sha256_of(b"rows")).is_some());
        for refused in ["sha256:0", "md5:00", "sha256:../../etc", &sha256_of(b"rows").to_uppercase()] {
            assert!(Digest::parse(refused).is_none(), "{refused}");
        }
    }

    /// Reads the dataset of `bytes` through `cache`, counting the fetches (which write it).
    async fn read(cache: &Cache, data: &Path, bytes: &[u8], fetches: &AtomicU32) -> (Vec<u8>, Found) {
        let digest = Digest::parse(&sha256_of(bytes)).unwrap();
        let fetch = async |target: &Path| {
            fetches.fetch_add(1, Ordering::SeqCst);
            tokio::fs::write(target, bytes).await
        };
        cache.dataset(data, &digest, fetch).await.unwrap()
    }

    #[tokio::test]
    async fn a_second_read_of_a_dataset_does_not_fetch_it_again() {
        let dir = tempfile::tempdir().unwrap();
        let (cache, fetches) = (Cache::default(), AtomicU32::new(0));
        let rows = b"f,y\n1,0\n";
        assert_eq!(read(&cache, dir.path(), rows, &fetches).await, (rows.to_vec(), Found::Fetched));
        assert_eq!(read(&cache, dir.path(), rows, &fetches).await, (rows.to_vec(), Found::Cached));
        assert_eq!(fetches.load(Ordering::SeqCst), 1);
        // Two jobs at once (a gang's ranks on one worker): one fetch, the other reads it.
        let other = b"f,y\n2,1\n";
        let (first, second) =
            tokio::join!(read(&cache, dir.path(), other, &fetches), read(&cache, dir.path(), other, &fetches));
        assert_eq!((first.0, second.0), (other.to_vec(), other.to_vec()));
        assert_eq!(fetches.load(Ordering::SeqCst), 2, "one more fetch for the second dataset");
    }

    #[tokio::test]
    async fn a_corrupted_or_truncated_cached_dataset_is_fetched_again() {
        let dir = tempfile::tempdir().unwrap();
        let (cache, fetches) = (Cache::default(), AtomicU32::new(0));
        let rows = b"f,y\n1,0\n2,1\n";
        let file = Entry::Dataset(Digest::parse(&sha256_of(rows)).unwrap()).folder(dir.path()).join(DATASET_FILE);
        read(&cache, dir.path(), rows, &fetches).await;
        for damaged in [&b"f,y\n1,0\n2,7\n"[..], &rows[..5]] {
            std::fs::write(&file, damaged).unwrap();
            assert_eq!(read(&cache, dir.path(), rows, &fetches).await, (rows.to_vec(), Found::Fetched));
            assert_eq!(std::fs::read(&file).unwrap(), rows, "the damaged file was replaced");
        }
        assert_eq!(fetches.load(Ordering::SeqCst), 3);
    }
}
