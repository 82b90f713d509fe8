//! Content-addressed blob store: `blobs/sha256/<hex>`. Files are written to `tmp/`,
//! hashed while written, and renamed into place only once accepted, so a half-written
//! or rejected file is never visible under a digest.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

#[derive(Debug, Clone)]
pub struct BlobStore {
    root: PathBuf,
    tmp: PathBuf,
}

impl BlobStore {
    /// Opens the store under `data_dir`, removing temp files a crash left behind.
    pub fn open(data_dir: &Path) -> std::io::Result<BlobStore> {
        let root = data_dir.join("blobs").join("sha256");
        let tmp = data_dir.join("tmp");
        std::fs::create_dir_all(&root)?;
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp)?;
        }
        std::fs::create_dir_all(&tmp)?;
        Ok(BlobStore { root, tmp })
    }

    /// Where the blob with `digest` (`sha256:<hex>`) lives, if the digest is well formed.
    pub fn path(&self, digest: &str) -> Option<PathBuf> {
        let hex = digest.strip_prefix("sha256:")?;
        (hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then(|| self.root.join(hex))
    }

    pub async fn begin(&self) -> std::io::Result<TempBlob> {
        let path = self.tmp.join(uuid::Uuid::new_v4().to_string());
        let file = tokio::fs::File::create(&path).await?;
        Ok(TempBlob { path, file: Some(file), hasher: Sha256::new(), size: 0, digest: None })
    }

    /// Moves a finished temp blob into place under its digest.
    pub async fn commit(&self, mut blob: TempBlob) -> std::io::Result<()> {
        let digest = blob.digest.clone().expect("commit of an unfinished blob");
        let target = self.path(&digest).expect("digest made by TempBlob is well formed");
        if tokio::fs::try_exists(&target).await? {
            tokio::fs::remove_file(&blob.path).await?;
        } else {
            tokio::fs::rename(&blob.path, &target).await?;
        }
        blob.path = PathBuf::new();
        Ok(())
    }

    pub async fn remove(&self, digest: &str) -> std::io::Result<()> {
        if let Some(path) = self.path(digest) {
            match tokio::fs::remove_file(path).await {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }

    /// Number of files in the temp area (tests check nothing is left behind).
    pub fn temp_files(&self) -> usize {
        std::fs::read_dir(&self.tmp).map(|dir| dir.count()).unwrap_or(0)
    }
}

/// A file being written into the store. Dropped without `commit`, it is deleted.
pub struct TempBlob {
    path: PathBuf,
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
