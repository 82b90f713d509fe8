//! Server configuration: every setting is a flag with an environment variable.

use std::path::PathBuf;
use std::str::FromStr;

use axum::http::Uri;
use clap::Args;

use crate::auth::client::Cidr;

/// The shortest worker token or JWT secret the server accepts.
pub const MIN_SECRET_BYTES: usize = 32;

/// A setting the server refuses to start with.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{setting} is {length} bytes long; it must be at least {MIN_SECRET_BYTES} (try `openssl rand -hex 32`)")]
    ShortSecret { setting: &'static str, length: usize },
}

/// Where the dashboard is reached, as `--public-url` gives it: a scheme and a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicUrl {
    /// `https://host[:port]`, without a trailing slash.
    url: String,
    authority: String,
    https: bool,
}

impl PublicUrl {
    pub fn as_str(&self) -> &str {
        &self.url
    }

    /// `host[:port]`, as a browser's `Origin` names it.
    pub fn authority(&self) -> &str {
        &self.authority
    }

    pub fn is_https(&self) -> bool {
        self.https
    }
}

impl FromStr for PublicUrl {
    type Err = String;

    fn from_str(text: &str) -> Result<PublicUrl, String> {
        let wrong = || format!("'{text}' is not a site's URL: write its scheme and host, e.g. https://ml.example.com");
        let uri = Uri::from_str(text.trim()).map_err(|_| wrong())?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(wrong()),
        };
        let authority = uri.authority().filter(|a| !a.as_str().contains('@')).ok_or_else(wrong)?.as_str();
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(format!("'{text}' has a path; the dashboard is served from the root of its host"));
        }
        let scheme = if https { "https" } else { "http" };
        Ok(PublicUrl { url: format!("{scheme}://{authority}"), authority: authority.to_ascii_lowercase(), https })
    }
}

#[derive(Debug, Clone, Args)]
pub struct Config {
    /// Address the HTTP server listens on.
    #[arg(long, env = "TESSERA_BIND", default_value = "127.0.0.1:8080")]
    pub bind: String,

    /// Where blobs, the SQLite database and generated secrets live.
    #[arg(long, env = "TESSERA_DATA_DIR", default_value = ".data")]
    pub data_dir: PathBuf,

    /// `postgres://…` selects PostgreSQL; default: a SQLite file in the data directory.
    #[arg(long, env = "TESSERA_DATABASE_URL")]
    pub database_url: Option<String>,

    /// Shared secret workers present when they join; at least 32 bytes.
    #[arg(long, env = "TESSERA_WORKER_TOKEN", hide_env_values = true)]
    pub worker_token: Option<String>,

    /// Password for the `admin` user created when the database has no users.
    #[arg(long, env = "TESSERA_ADMIN_PASSWORD", hide_env_values = true)]
    pub admin_password: Option<String>,

    /// Key that signs session tokens, at least 32 bytes; default: generated once and kept
    /// in the data directory.
    #[arg(long, env = "TESSERA_JWT_SECRET", hide_env_values = true)]
    pub jwt_secret: Option<String>,

    /// Largest model upload accepted, in bytes, all files together.
    #[arg(long, env = "TESSERA_MAX_UPLOAD_BYTES", default_value_t = 4 << 30)]
    pub max_upload_bytes: u64,

    /// How long a session token stays valid.
    #[arg(long, env = "TESSERA_SESSION_HOURS", default_value_t = 12)]
    pub session_hours: u64,

    /// How long a lease lives without a heartbeat renewing it.
    #[arg(long, env = "TESSERA_LEASE_TTL_SECS", default_value_t = 30)]
    pub lease_ttl_secs: u64,

    /// How long the ranks of a data-parallel job have, from the first rank's claim, to be
    /// claimed and meet; a gang that does not form is released with no attempt spent.
    #[arg(long, env = "TESSERA_GANG_RENDEZVOUS_SECS", default_value_t = 60)]
    pub gang_rendezvous_secs: u64,

    /// How often workers are asked to heartbeat; three missed beats mark one offline.
    #[arg(long, env = "TESSERA_HEARTBEAT_SECS", default_value_t = 5)]
    pub heartbeat_secs: u64,

    /// Login attempts allowed in a burst per client address and username; one address
    /// may spend five times as many across all usernames.
    #[arg(long, env = "TESSERA_LOGIN_BURST", default_value_t = 10)]
    pub login_burst: u32,

    /// Seconds for one spent login attempt to come back.
    #[arg(long, env = "TESSERA_LOGIN_REFILL_SECS", default_value_t = 6)]
    pub login_refill_secs: u64,

    /// Reverse proxies in front of this server, comma-separated addresses or blocks
    /// (`10.0.0.0/8,::1`). A login from one of them is throttled by the client address it
    /// appended to `X-Forwarded-For`, not its own; from other peers that header is ignored.
    #[arg(long, env = "TESSERA_TRUSTED_PROXIES", value_delimiter = ',')]
    pub trusted_proxies: Vec<Cidr>,

    /// The URL people reach the dashboard at when a proxy stands in front
    /// (`https://ml.example.com`): forms posted from it are this site's, an `https://` one
    /// marks every cookie Secure, and the workers page tells workers to use it.
    #[arg(long, env = "TESSERA_PUBLIC_URL")]
    pub public_url: Option<PublicUrl>,

    /// Seconds this server trusts an API token or user it has checked without asking the
    /// database again. Revoking a token here takes effect at once; with several servers on
    /// one PostgreSQL database, the others may accept it for up to this long. 0: no cache.
    #[arg(long, env = "TESSERA_AUTH_CACHE_SECS", default_value_t = 10)]
    pub auth_cache_secs: u64,

    /// Seconds the gateway waits for a replica to answer an inference request before it
    /// gives the client a 504, so a hung worker cannot hold requests forever.
    #[arg(long, env = "TESSERA_INFERENCE_TIMEOUT_SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub inference_timeout_secs: u64,

    /// Bearer token Prometheus sends to scrape `/metrics` (at least 32 bytes). An admin's
    /// session or API token is accepted too; without this setting only admins may scrape.
    #[arg(long, env = "TESSERA_METRICS_TOKEN", hide_env_values = true)]
    pub metrics_token: Option<String>,

    /// Accept any engine endpoint a worker reports (`TESSERA_WORKER_ADVERTISE_URL` behind
    /// NAT or a proxy). By default its host must be the address the worker connects from,
    /// so a worker cannot point the gateway, and its engine token, at another machine.
    #[arg(long, env = "TESSERA_ALLOW_ADVERTISED_ENDPOINTS", default_value_t = false)]
    pub allow_advertised_endpoints: bool,

    /// Where blobs (model files, datasets, checkpoints) live: `local` (the data directory)
    /// or `s3://BUCKET[/PREFIX]`, an S3-compatible bucket several servers can share.
    #[arg(long, env = "TESSERA_BLOB_STORE")]
    pub blob_store: Option<String>,

    /// The S3 endpoint, for S3-compatible servers (MinIO, …); `http://` is allowed.
    #[arg(long, env = "TESSERA_S3_ENDPOINT")]
    pub s3_endpoint: Option<String>,

    /// The bucket's region; default `AWS_REGION`, else us-east-1.
    #[arg(long, env = "TESSERA_S3_REGION")]
    pub s3_region: Option<String>,

    /// S3 credentials (else the other usual `AWS_*` sources).
    #[arg(long, env = "AWS_ACCESS_KEY_ID", hide_env_values = true)]
    pub s3_access_key_id: Option<String>,

    /// The secret key that goes with the S3 access key id.
    #[arg(long, env = "AWS_SECRET_ACCESS_KEY", hide_env_values = true)]
    pub s3_secret_access_key: Option<String>,

    /// Seconds an unreferenced blob is kept before garbage collection deletes it. It must
    /// exceed the longest upload (a blob is written before the row that references it)
    /// and lets downloads that began before a delete finish.
    #[arg(long, env = "TESSERA_BLOB_GRACE_SECS", default_value_t = 3600)]
    pub blob_grace_secs: u64,

    /// Seconds between capacity-loaning rounds (issue 16): one server at a time lends idle
    /// serving slices to training, takes them back, and places training ranks on slices.
    #[arg(long, env = "TESSERA_LOAN_ROUND_SECS", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub loan_round_secs: u64,

    /// Seconds a data-parallel job takes to stop at a checkpoint and start again on its
    /// slices (fetch the checkpoint, re-form its ranks): what the loaning round charges a
    /// preemption, and a resize that cannot happen in place (a job with a precision plan).
    #[arg(long, env = "TESSERA_GANG_RESTART_SECS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(0..=86400))]
    pub gang_restart_secs: u64,

    /// Seconds a running elastic job pauses to grow or shrink in place (its ranks stop at a
    /// step, rank 0 checkpoints, joining ranks load it, the ring re-forms): what the
    /// loaning round charges a resize. The default allows for a GPU model's checkpoint
    /// hand-over; bench/results/aryl.md has the pause measured on this platform.
    #[arg(long, env = "TESSERA_GANG_REGROUP_SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(0..=86400))]
    pub gang_regroup_secs: u64,

    /// Most jobs one user may have queued or running at once (serving replicas count
    /// against the replica quota instead). Admins are not bound by quotas.
    #[arg(long, env = "TESSERA_QUOTA_JOBS", default_value_t = 32)]
    pub quota_jobs: u64,

    /// Most serving replicas one user's deployments may ask for, all deployments together.
    #[arg(long, env = "TESSERA_QUOTA_REPLICAS", default_value_t = 16)]
    pub quota_replicas: u64,

    /// Most bytes one user may store: models, datasets and their jobs' checkpoints.
    #[arg(long, env = "TESSERA_QUOTA_STORAGE_BYTES", default_value_t = 64 << 30)]
    pub quota_storage_bytes: u64,
}

impl Config {
    /// The configuration with every default, rooted at `data_dir`.
    pub fn with_data_dir(data_dir: PathBuf) -> Config {
        Config {
            bind: "127.0.0.1:0".into(),
            data_dir,
            database_url: None,
            worker_token: None,
            admin_password: None,
            jwt_secret: None,
            max_upload_bytes: 4 << 30,
            session_hours: 12,
            lease_ttl_secs: 30,
            gang_rendezvous_secs: 60,
            heartbeat_secs: 5,
            login_burst: 10,
            login_refill_secs: 6,
            trusted_proxies: Vec::new(),
            public_url: None,
            auth_cache_secs: 10,
            inference_timeout_secs: 60,
            metrics_token: None,
            allow_advertised_endpoints: false,
            blob_store: None,
            s3_endpoint: None,
            s3_region: None,
            s3_access_key_id: None,
            s3_secret_access_key: None,
            blob_grace_secs: 3600,
            quota_jobs: 32,
            quota_replicas: 16,
            quota_storage_bytes: 64 << 30,
            loan_round_secs: 5,
            gang_restart_secs: 60,
            gang_regroup_secs: 10,
        }
    }

    /// Refuses secrets short enough to guess: an empty worker token would let anyone
    /// register a worker, and an empty JWT secret would let anyone sign an admin session.
    pub fn check_secrets(&self) -> Result<(), ConfigError> {
        let settings = [
            ("TESSERA_WORKER_TOKEN", &self.worker_token),
            ("TESSERA_JWT_SECRET", &self.jwt_secret),
            ("TESSERA_METRICS_TOKEN", &self.metrics_token),
        ];
        for (setting, value) in settings {
            if let Some(value) = value {
                if value.len() < MIN_SECRET_BYTES {
                    return Err(ConfigError::ShortSecret { setting, length: value.len() });
                }
            }
        }
        Ok(())
    }

    pub fn database_url(&self) -> String {
        match &self.database_url {
            Some(url) => url.clone(),
            None => format!("sqlite://{}?mode=rwc", self.data_dir.join("tessera.db").display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_public_url_is_a_scheme_and_a_host() {
        let public: PublicUrl = "https://ML.example.com:8443/".parse().unwrap();
        assert_eq!((public.as_str(), public.authority(), public.is_https()), ("https://ML.example.com:8443", "ml.example.com:8443", true));
        assert!(!"http://10.0.0.1".parse::<PublicUrl>().unwrap().is_https());
        for wrong in ["ml.example.com", "ftp://ml.example.com", "https://user@ml.example.com", "not a url"] {
            let error = wrong.parse::<PublicUrl>().unwrap_err();
            assert!(error.contains("write its scheme and host"), "{wrong}: {error}");
        }
        let error = "https://ml.example.com/tessera".parse::<PublicUrl>().unwrap_err();
        assert!(error.contains("has a path"), "{error}");
    }
}
