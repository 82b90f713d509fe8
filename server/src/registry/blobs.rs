//! Content-addressed blob store: `blobs/sha256/<hex>` in an object store, the data
//! directory by default or an S3 bucket that several servers share. Uploads stream to a
//! temp file in this server's own staging directory, are hashed while written, and go
//! into the store only once accepted, so a half-written or rejected file is never
//! visible under a digest. Which blobs may go is the ledger's business (`gc`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::body::Bytes;
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use object_store::local::LocalFileSystem;
use object_store::path::Path as Location;
use object_store::{GetResultPayload, ObjectStore, ObjectStoreExt};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use crate::config::Config;
use crate::store::db::{now_ms, Db};
use crate::store::{blobs as ledger, StoreError};

/// Where blobs live inside the store (the data directory or the bucket's prefix).
const BLOBS: &str = "blobs/sha256";

/// Staging directories of dead servers are found by their lock; one that never got a
/// lock (a crash while it was being made) goes after this long.
const ABANDONED_STAGING_SECS: u64 = 3600;

/// What the blob store can fail with: the local disk, the object store, or the ledger.
#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("object store: {0}")]
    Object(#[from] object_store::Error),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The ledger says a row refers to this blob, but the store does not hold it.
    #[error("blob {0} is missing from the object store")]
    Missing(String),
    /// `TESSERA_BLOB_STORE` is neither `local` nor an `s3://` URL.
    #[error("TESSERA_BLOB_STORE must be 'local' or s3://BUCKET[/PREFIX]; got {0:?}")]
    Setting(String),
}

/// Which object store holds the blobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The data directory: temp files sit inside the store, so a commit is a rename.
    Local,
    /// An S3-compatible bucket: a commit uploads the temp file.
    S3,
}

#[derive(Debug, Clone)]
pub struct BlobStore {
    objects: Arc<dyn ObjectStore>,
    kind: Kind,
    staging: Arc<Staging>,
}

impl BlobStore {
    /// Opens the store `config` names and this server's staging directory, removing the
    /// staging directories of servers that are gone (never another live server's).
    pub async fn open(config: &Config) -> Result<BlobStore, BlobError> {
        let staging = Staging::create(&config.data_dir)?;
        let (objects, kind): (Arc<dyn ObjectStore>, Kind) = match config.blob_store.as_deref() {
            None | Some("") | Some("local") => {
                std::fs::create_dir_all(config.data_dir.join(BLOBS))?;
                // fsync: each rename into place is durable (the file and its directory).
                let local = LocalFileSystem::new_with_prefix(&config.data_dir)?.with_fsync(true);
                (Arc::new(local), Kind::Local)
            }
            Some(url) => (s3(config, url)?, Kind::S3),
        };
        // A bucket that does not exist or refuses the credentials stops the start-up,
        // not the first upload.
        objects.list_with_delimiter(Some(&Location::from(BLOBS))).await?;
        Ok(BlobStore { objects, kind, staging: Arc::new(staging) })
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Where the blob with `digest` (`sha256:<hex>`) lives, if the digest is well formed.
    fn location(digest: &str) -> Option<Location> {
        let hex = digest.strip_prefix("sha256:")?;
        (hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| Location::from(format!("{BLOBS}/{hex}")))
    }

    pub async fn begin(&self) -> std::io::Result<TempBlob> {
        let name = uuid::Uuid::new_v4().to_string();
        let path = self.staging.dir.join(&name);
        let file = tokio::fs::File::create(&path).await?;
        Ok(TempBlob { path, name, file: Some(file), hasher: Sha256::new(), size: 0, digest: None })
    }

    /// Puts finished temp blobs into the store under their digests. Their ledger rows are
    /// touched first, so garbage collection on any server leaves them alone until the
    /// rows that reference them are written (within the grace period).
    pub async fn commit(&self, db: &Db, blobs: Vec<TempBlob>) -> Result<(), BlobError> {
        let digests: Vec<String> =
            blobs.iter().map(|b| b.digest.clone().expect("commit of an unfinished blob")).collect();
        ledger::touch(db, &digests.iter().map(String::as_str).collect::<Vec<_>>(), now_ms()).await?;
        for (mut blob, digest) in blobs.into_iter().zip(digests) {
            let target = Self::location(&digest).expect("digest made by TempBlob is well formed");
            match self.kind {
                Kind::Local => {
                    let from = self.staging.location.clone().join(blob.name.as_str());
                    self.objects.rename(&from, &target).await?;
                    blob.path = PathBuf::new();
                }
                Kind::S3 => {
                    if !self.contains(&target).await? {
                        self.upload(&blob.path, target).await?;
                    }
                }
            }
        }
        Ok(())
    }

    async fn contains(&self, location: &Location) -> Result<bool, BlobError> {
        match self.objects.head(location).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Streams a local file into the store: one request when small, a multipart upload
    /// (complete or not at all) when large.
    async fn upload(&self, path: &Path, location: Location) -> Result<(), BlobError> {
        let mut source = tokio::fs::File::open(path).await?;
        let mut writer = object_store::buffered::BufWriter::with_capacity(self.objects.clone(), location, 16 << 20);
        if let Err(e) = tokio::io::copy(&mut source, &mut writer).await {
            let _ = writer.abort().await;
            return Err(e.into());
        }
        writer.shutdown().await?;
        Ok(())
    }

    /// The bytes of a stored blob, as a stream.
    pub async fn read(&self, digest: &str) -> Result<BoxStream<'static, std::io::Result<Bytes>>, BlobError> {
        let location = Self::location(digest).ok_or_else(|| BlobError::Missing(digest.to_string()))?;
        let found = match self.objects.get(&location).await {
            Ok(found) => found,
            Err(object_store::Error::NotFound { .. }) => return Err(BlobError::Missing(digest.to_string())),
            Err(e) => return Err(e.into()),
        };
        Ok(match found.payload {
            // object_store reads a local file 8 KiB per blocking call; model files are
            // hundreds of MiB, so read them in 1 MiB pieces.
            GetResultPayload::File(file, _) => {
                tokio_util::io::ReaderStream::with_capacity(tokio::fs::File::from_std(file), 1 << 20).boxed()
            }
            GetResultPayload::Stream(stream) => stream.map(|chunk| chunk.map_err(std::io::Error::other)).boxed(),
        })
    }

    /// Whether the store holds `digest`'s bytes.
    pub async fn exists(&self, digest: &str) -> Result<bool, BlobError> {
        match Self::location(digest) {
            Some(location) => self.contains(&location).await,
            None => Ok(false),
        }
    }

    /// Deletes a blob's bytes (gone already is fine). Only garbage collection calls this,
    /// with the blob's ledger row locked (`store::blobs::begin_deletion`).
    pub async fn remove(&self, digest: &str) -> Result<(), BlobError> {
        if let Some(location) = Self::location(digest) {
            match self.objects.delete(&location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Every blob in the store with its modification time (ms), for orphan collection.
    /// Objects whose name is no digest are not the store's and are left alone.
    pub(crate) fn list(&self) -> BoxStream<'static, Result<(String, i64), BlobError>> {
        self.objects
            .list(Some(&Location::from(BLOBS)))
            .filter_map(|meta| async move {
                let meta = match meta {
                    Ok(meta) => meta,
                    Err(e) => return Some(Err(e.into())),
                };
                let digest = format!("sha256:{}", meta.location.filename().unwrap_or_default());
                Self::location(&digest).is_some().then(|| Ok((digest, meta.last_modified.timestamp_millis())))
            })
            .boxed()
    }

    /// Removes the staging directories of servers that are gone (start-up does it; the
    /// collector repeats it for servers that died since).
    pub(crate) fn sweep_staging(&self) -> std::io::Result<usize> {
        Staging::sweep(self.staging.dir.parent().expect("staging sits in tmp/"))
    }

    /// Number of files in this server's staging directory (tests check nothing is left
    /// behind).
    pub fn temp_files(&self) -> usize {
        std::fs::read_dir(&self.staging.dir)
            .map(|dir| dir.filter_map(|e| e.ok()).filter(|e| e.file_name() != LOCK).count())
            .unwrap_or(0)
    }

    /// This server's staging directory.
    pub fn staging_dir(&self) -> &Path {
        &self.staging.dir
    }
}

/// An S3 bucket (and key prefix) from `s3://BUCKET[/PREFIX]`, with the endpoint, region
/// and credentials of `config`; anything not set there comes from the usual `AWS_*`
/// environment variables.
fn s3(config: &Config, url: &str) -> Result<Arc<dyn ObjectStore>, BlobError> {
    let rest = url.strip_prefix("s3://").ok_or_else(|| BlobError::Setting(url.to_string()))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(BlobError::Setting(url.to_string()));
    }
    // object_store's HTTP client brings rustls without a crypto provider; ring is the
    // one the rest of the server already uses. A second call finds it installed.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut builder = object_store::aws::AmazonS3Builder::from_env().with_bucket_name(bucket);
    if let Some(endpoint) = &config.s3_endpoint {
        builder = builder.with_endpoint(endpoint).with_allow_http(endpoint.starts_with("http://"));
    }
    if let Some(region) = &config.s3_region {
        builder = builder.with_region(region);
    }
    if let Some(key) = &config.s3_access_key_id {
        builder = builder.with_access_key_id(key);
    }
    if let Some(secret) = &config.s3_secret_access_key {
        builder = builder.with_secret_access_key(secret);
    }
    let bucket = builder.build()?;
    let prefix = prefix.trim_matches('/');
    Ok(if prefix.is_empty() {
        Arc::new(bucket)
    } else {
        Arc::new(object_store::prefix::PrefixStore::new(bucket, prefix))
    })
}

const LOCK: &str = ".lock";

/// This server's own directory for uploads in progress, `tmp/<id>/`, held by an
/// exclusive lock on `tmp/<id>/.lock` for as long as the server lives. Several servers
/// may share a data directory: each removes only directories whose lock it can take,
/// so no start-up deletes another live server's uploads.
#[derive(Debug)]
struct Staging {
    dir: PathBuf,
    /// `dir` relative to the data directory, as the local object store names it.
    location: Location,
    _lock: std::fs::File,
}

impl Staging {
    fn create(data_dir: &Path) -> std::io::Result<Staging> {
        let tmp = data_dir.join("tmp");
        std::fs::create_dir_all(&tmp)?;
        Staging::sweep(&tmp)?;
        // Made under a dot name and locked before it gets its real one, so a sweep never
        // sees this directory without its lock held.
        let id = uuid::Uuid::new_v4().to_string();
        let making = tmp.join(format!(".{id}"));
        std::fs::create_dir(&making)?;
        let lock = std::fs::File::create(making.join(LOCK))?;
        lock.try_lock().map_err(std::io::Error::from)?;
        let dir = tmp.join(&id);
        std::fs::rename(&making, &dir)?;
        std::fs::File::open(&tmp)?.sync_all()?;
        Ok(Staging { dir, location: Location::from(format!("tmp/{id}")), _lock: lock })
    }

    /// Removes every staging directory under `tmp` whose lock is free (its server is
    /// gone), directories still being made that were abandoned long ago, and loose files
    /// an older version left. Returns how many it removed; what it cannot remove is
    /// logged and left for the next sweep.
    fn sweep(tmp: &Path) -> std::io::Result<usize> {
        let mut removed = 0;
        for entry in std::fs::read_dir(tmp)? {
            let entry = entry?;
            let path = entry.path();
            let outcome = match entry.file_type() {
                Ok(kind) if kind.is_dir() && !entry.file_name().to_string_lossy().starts_with('.') => {
                    sweep_staging_dir(&path)
                }
                Ok(kind) if older_than(&entry, ABANDONED_STAGING_SECS) => {
                    if kind.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) }
                        .map(|()| true)
                }
                Ok(_) => Ok(false),
                Err(e) => Err(e),
            };
            match outcome {
                Ok(true) => removed += 1,
                Ok(false) => {}
                // Another server sweeping the same directory got there first.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(path = %path.display(), error = %e, "could not remove a stale staging entry"),
            }
        }
        Ok(removed)
    }
}

/// Removes a staging directory if its lock is free; true when it did.
fn sweep_staging_dir(dir: &Path) -> std::io::Result<bool> {
    let lock = match std::fs::File::open(dir.join(LOCK)) {
        Ok(lock) => lock,
        // Staging directories get their name only once locked: one without a lock file
        // is a sweep's leftover, not a live server's.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::remove_dir_all(dir)?;
            return Ok(true);
        }
        Err(e) => return Err(e),
    };
    match lock.try_lock() {
        Ok(()) => {
            std::fs::remove_dir_all(dir)?;
            Ok(true)
        }
        Err(std::fs::TryLockError::WouldBlock) => Ok(false),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    }
}

fn older_than(entry: &std::fs::DirEntry, secs: u64) -> bool {
    let modified = entry.metadata().and_then(|m| m.modified());
    modified.is_ok_and(|m| m.elapsed().is_ok_and(|age| age.as_secs() > secs))
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A file being written into the store. Dropped without `commit`, it is deleted.
pub struct TempBlob {
    path: PathBuf,
    /// The file's name in the staging directory.
    name: String,
    file: Option<tokio::fs::File>,
    hasher: Sha256,
    size: u64,
    digest: Option<String>,
}

impl TempBlob {
    pub async fn write(&mut self, chunk: &[u8]) -> std::io::Result<()> {
        let file = self.file.as_mut().expect("write after finish");
        file.write_all(chunk).await?;
        self.hasher.update(chunk);
        self.size += chunk.len() as u64;
        Ok(())
    }

    /// Flushes to disk and fixes the digest.
    pub async fn finish(&mut self) -> std::io::Result<String> {
        let mut file = self.file.take().expect("finish called twice");
        file.flush().await?;
        file.sync_all().await?;
        let digest = format!("sha256:{}", hex::encode(std::mem::take(&mut self.hasher).finalize()));
        self.digest = Some(digest.clone());
        Ok(digest)
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The temp file, for validation before the blob is committed.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempBlob {
    fn drop(&mut self) {
        if !self.path.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
