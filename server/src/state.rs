//! The state every handler receives: the store, configuration, keys, caches and the
//! gateway. It depends on no handler module, so handlers depend on it and not on each
//! other; `app` builds it (`AppState::open`) and wires the routes.

use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusHandle;

use crate::auth::cache::AuthCache;
use crate::auth::rate_limit::LoginLimiter;
use crate::auth::session::SessionKeys;
use crate::config::Config;
use crate::store::db::Db;
use crate::gateway::Gateway;
use crate::registry::blobs::BlobStore;

#[derive(Clone)]
pub struct AppState {
    pub db: Db,
    pub config: Arc<Config>,
    pub sessions: Arc<SessionKeys>,
    /// Credentials checked recently, so a known token costs no database round trip.
    pub auth_cache: Arc<AuthCache>,
    pub login_limiter: Arc<LoginLimiter>,
    pub blobs: BlobStore,
    pub metrics: PrometheusHandle,
    pub openapi: Arc<utoipa::openapi::OpenApi>,
    pub gateway: Arc<Gateway>,
}

