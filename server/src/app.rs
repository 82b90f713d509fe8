//! The application: opening the state, the router, and the server's lifetime (start-up,
//! background lease expiry, graceful shutdown). It only wires: nothing imports `app`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, Method, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tower_http::trace::TraceLayer;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use crate::auth::cache::AuthCache;
use crate::auth::rate_limit::LoginLimiter;
use crate::auth::session::SessionKeys;
use crate::config::{Config, ConfigError};
use crate::gateway::{kserve, openai, Gateway, GatewayError};
use crate::registry::blobs::{BlobError, BlobStore};
use crate::state::AppState;
use crate::store::db::Db;
use crate::{
    accounts, auth, datasets, deployments, error, fleet, gangs, jobs, loaning, openapi, registry, telemetry, training, web,
    workers,
};

/// Why the server could not start: a setting is refused, the data directory, the
/// database, or the first admin could not be set up, or the address could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Setup(#[from] error::Error),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("blob store: {0}")]
    Blobs(#[from] BlobError),
}

impl AppState {
    /// Opens the data directory and database, runs migrations, and creates the first
    /// admin when there is no user (printing a generated password once).
    pub async fn open(config: Config) -> Result<AppState, StartError> {
        config.check_secrets()?;
        std::fs::create_dir_all(&config.data_dir)?;
        let db = Db::connect(&config.database_url()).await?;
        if let Some(password) = accounts::bootstrap_admin(&db, config.admin_password.as_deref()).await? {
            println!("Created user 'admin' with password: {password}");
            println!("It is shown only this once; change it or set TESSERA_ADMIN_PASSWORD for new installs.");
        }
        let sessions = SessionKeys::load(
            config.jwt_secret.as_deref(),
            &config.data_dir,
            chrono::Duration::hours(config.session_hours as i64),
        )?;
        let (_, mut openapi) = api_router().split_for_parts();
        // axum spells a catch-all segment `{*path}`; OpenAPI knows only `{path}`.
        openapi.paths.paths = std::mem::take(&mut openapi.paths.paths)
            .into_iter()
            .map(|(path, item)| (path.replace("{*", "{"), item))
            .collect();
        let state = AppState {
            blobs: BlobStore::open(&config).await?,
            login_limiter: Arc::new(LoginLimiter::new(config.login_burst, Duration::from_secs(config.login_refill_secs))),
            sessions: Arc::new(sessions),
            auth_cache: Arc::new(AuthCache::new(Duration::from_secs(config.auth_cache_secs))),
            metrics: telemetry::recorder(),
            openapi: Arc::new(openapi),
            gateway: Arc::new(Gateway::new(Duration::from_secs(config.inference_timeout_secs))),
            config: Arc::new(config),
            db,
        };
        auth::revocations::spawn_listener(&state);
        Ok(state)
    }
}

/// Every `/api/v1` route, with its OpenAPI annotation.
fn api_router() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .routes(routes!(accounts::login))
        .routes(routes!(accounts::me))
        .routes(routes!(accounts::logout))
        .routes(routes!(accounts::password))
        .routes(routes!(accounts::create, accounts::list))
        .routes(routes!(accounts::update))
        .routes(routes!(accounts::tokens::create, accounts::tokens::list))
        .routes(routes!(accounts::tokens::revoke))
        .routes(without_body_limit(routes!(registry::routes::upload, registry::routes::list)))
        .routes(routes!(registry::routes::get, registry::routes::delete))
        .routes(routes!(registry::routes::download))
        .routes(routes!(jobs::create, jobs::list))
        .routes(routes!(jobs::get))
        .routes(routes!(jobs::cancel))
        .routes(routes!(jobs::preempt))
        .routes(routes!(jobs::logs))
        .routes(routes!(training::routes::job_metrics))
        .routes(routes!(training::routes::job_lr_stages))
        .routes(routes!(training::routes::job_checkpoints, training::routes::delete_job_checkpoints))
        .routes(routes!(training::routes::checkpoint_file))
        .routes(routes!(training::routes::job_precision_plan))
        .routes(without_body_limit(routes!(datasets::upload, datasets::list)))
        .routes(routes!(datasets::get, datasets::delete))
        .routes(routes!(datasets::download))
        .routes(routes!(deployments::routes::create, deployments::routes::list))
        .routes(routes!(deployments::routes::get, deployments::routes::update, deployments::routes::delete))
        .routes(routes!(deployments::routes::stats))
        .routes(routes!(workers::list))
        .routes(routes!(workers::remove))
        .routes(routes!(loaning::routes::get))
        .routes(routes!(fleet::profiles::create, fleet::profiles::get))
        .routes(routes!(fleet::profiles::agent_report))
        .routes(routes!(workers::agent::register))
        .routes(routes!(workers::agent::heartbeat))
        .routes(routes!(workers::agent::claim))
        .routes(routes!(workers::agent::report_status))
        .routes(routes!(workers::agent::append_logs))
        .routes(routes!(workers::agent::record_metrics))
        .routes(routes!(gangs::rendezvous))
        .routes(routes!(gangs::regroup))
        .routes(routes!(registry::routes::agent_get))
        .routes(routes!(registry::routes::agent_download))
        .routes(routes!(datasets::agent_get))
        .routes(routes!(datasets::agent_download))
        .routes(routes!(training::routes::agent_metrics))
        .routes(routes!(training::routes::agent_lr_stage))
        .routes(without_body_limit(routes!(training::routes::agent_upload_checkpoint)))
        .routes(routes!(training::routes::agent_latest_checkpoint))
        .routes(routes!(training::routes::agent_checkpoint_file))
        .routes(routes!(training::routes::agent_precision_plan))
}

/// Uploads are capped by the registry while they stream, not by axum's body limit
/// (`error::JSON_BODY_LIMIT_BYTES`, which still guards every JSON route).
fn without_body_limit(
    (schemas, paths, method_router): utoipa_axum::router::UtoipaMethodRouter<AppState>,
) -> utoipa_axum::router::UtoipaMethodRouter<AppState> {
    (schemas, paths, method_router.layer(DefaultBodyLimit::disable()))
}

pub fn router(state: AppState) -> Router {
    let (api, _) = api_router().split_for_parts();
    Router::new()
        .merge(api)
        .route("/api/openapi.json", get(openapi_json))
        .route("/api", axum::routing::any(error::api_not_found))
        .route("/api/", axum::routing::any(error::api_not_found))
        .route("/api/{*rest}", axum::routing::any(error::api_not_found))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{model}", get(openai::model))
        .route("/v2", get(kserve::server_metadata))
        .route("/v2/health/live", get(kserve::live))
        .route("/v2/health/ready", get(kserve::ready))
        .route("/v2/models/{name}", get(kserve::model_metadata))
        .route("/v2/models/{name}/versions/{version}", get(kserve::model_metadata))
        .route("/v2/models/{name}/ready", get(kserve::model_ready))
        .route("/v2/models/{name}/versions/{version}/ready", get(kserve::model_ready))
        .route("/v2/models/{name}/infer", post(kserve::infer))
        .route("/v2/models/{name}/versions/{version}/infer", post(kserve::infer))
        // The gateway's own 404s, so an unknown gateway path is not the dashboard's page.
        .route("/v1", axum::routing::any(gateway_not_found))
        .route("/v1/", axum::routing::any(gateway_not_found))
        .route("/v1/{*rest}", axum::routing::any(gateway_not_found))
        .route("/v2/", axum::routing::any(gateway_not_found))
        .route("/v2/{*rest}", axum::routing::any(gateway_not_found))
        .route("/healthz", get(healthz))
        .route("/metrics", get(telemetry::render))
        .merge(web::routes(&state))
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn(shape_plain_rejections))
        .layer(axum::middleware::map_response(close_after_a_413))
        .layer(axum::middleware::from_fn_with_state(state.clone(), refuse_nul_bytes))
        .layer(axum::middleware::from_fn(telemetry::track))
        .layer(TraceLayer::new_for_http())
        .with_state(state)
}

/// A path under `/v1` or `/v2` that no route serves: a 404 in that family's shape.
async fn gateway_not_found(uri: Uri) -> Response {
    let message = if is_openai(uri.path()) {
        "No such OpenAI-compatible route; this server serves GET /v1/models[/{model}] and POST /v1/embeddings."
    } else {
        "No such KServe route; this server serves /v2, /v2/health/{live,ready} and /v2/models/{name}[/versions/{version}] \
         with /ready and /infer."
    };
    family_error(uri.path(), error::Error::NotFound(message.into()))
}

/// A 405 in the error shape of the route family called; on the dashboard's paths, its page.
async fn method_not_allowed(State(state): State<AppState>, method: Method, headers: HeaderMap, uri: Uri) -> Response {
    let path = uri.path();
    let message = if is_dashboard(path) {
        format!("{path} does not accept {method}; open it from the menu or send its form from its page.")
    } else {
        format!("{path} does not accept {method}; see /api/openapi.json for the methods it takes.")
    };
    refusal(&state, &headers, &uri, error::Error::MethodNotAllowed(message)).await
}

/// Refuses a path or query string that holds an encoded NUL byte (`%00`) before any
/// route sees it: no name or file holds one, and PostgreSQL errors on it.
async fn refuse_nul_bytes(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let uri = request.uri();
    let encoded = uri.path_and_query().map_or("", |p| p.as_str());
    if encoded.contains("%00") {
        let message = "The URL holds a NUL byte (%00), which no name or path may contain.";
        return refusal(&state, request.headers(), uri, error::Error::BadRequest(message.into())).await;
    }
    next.run(request).await
}

/// `error` for a request refused before its route's handler ran: the dashboard's error
/// page on the dashboard's paths, the error shape of its route family elsewhere.
async fn refusal(state: &AppState, headers: &HeaderMap, uri: &Uri, error: error::Error) -> Response {
    if is_dashboard(uri.path()) {
        web::refusal(state, headers, uri, error).await
    } else {
        family_error(uri.path(), error)
    }
}

/// A rejection no handler shaped gets the error shape of its route family like every
/// other 4xx: axum's extractors answer in plain text. The dashboard's routes shape their
/// own (`web::guard`: an error page, or JSON for a script), so what comes here is the API's
/// and the gateway's.
async fn shape_plain_rejections(request: Request, next: Next) -> Response {
    let path = request.uri().path().to_string();
    match error::PlainRejection::of(next.run(request).await).await {
        Ok(rejection) => rejection.shaped(|error| family_error(&path, error)),
        Err(response) => response,
    }
}

/// A 413 leaves the rest of its body unread, so the connection cannot carry another
/// request: saying so keeps a client from reusing it and failing its next request.
async fn close_after_a_413(mut response: Response) -> Response {
    if response.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
        let close = axum::http::HeaderValue::from_static("close");
        response.headers_mut().insert(axum::http::header::CONNECTION, close);
    }
    response
}

/// `error` in the shape of the route family `path` belongs to: OpenAI's on `/v1`,
/// KServe's on `/v2`, the platform's JSON everywhere else (for the dashboard's paths
/// `refusal` picks its page instead).
fn family_error(path: &str, error: error::Error) -> Response {
    if is_openai(path) {
        openai::openai_error(GatewayError::new(error.status(), "invalid_request_error", error.public_message()))
    } else if is_kserve(path) {
        kserve::kserve_error(GatewayError::new(error.status(), "invalid", error.public_message()))
    } else {
        error.into_response()
    }
}

fn is_openai(path: &str) -> bool {
    path == "/v1" || path.starts_with("/v1/")
}

fn is_kserve(path: &str) -> bool {
    path == "/v2" || path.starts_with("/v2/")
}

/// A path of the dashboard's: every one that is not the API's, the gateway's, or the
/// server's own probes.
fn is_dashboard(path: &str) -> bool {
    let api = path == "/api" || path.starts_with("/api/");
    !(api || is_openai(path) || is_kserve(path) || path == "/healthz" || path == "/metrics")
}

async fn openapi_json(axum::extract::State(state): axum::extract::State<AppState>) -> axum::Json<utoipa::openapi::OpenApi> {
    axum::Json((*state.openapi).clone())
}

async fn healthz(axum::extract::State(state): axum::extract::State<AppState>) -> error::Result<&'static str> {
    state.db.ping().await?;
    Ok("ok")
}

/// Requeues jobs whose leases expired, settles gangs and restarts ended replicas, every
/// few seconds, until the server stops; each sweep marks the leases watched for
/// [`lease_watch_ms`] (`store::jobs::watched`).
fn spawn_lease_expiry(state: AppState, server: Uuid) {
    let period = Duration::from_secs((state.config.lease_ttl_secs / 3).clamp(1, 5));
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(period);
        loop {
            ticker.tick().await;
            match crate::store::jobs::expire_leases(&state.db).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(jobs = n, "expired leases requeued or failed"),
                Err(e) => tracing::warn!(error = %e, "lease expiry failed"),
            }
            let until = crate::store::db::now_ms() + lease_watch_ms(&state);
            if let Err(e) = crate::store::jobs::watched(&state.db, server, until).await {
                tracing::warn!(error = %e, "recording the lease sweep failed");
            }
            // After expiry: a gang that just lost a rank is requeued in the same tick.
            match crate::store::gangs::sweep(&state.db, crate::store::db::now_ms(), None).await {
                Ok(swept) if swept == Default::default() => {}
                Ok(swept) => tracing::info!(?swept, "gangs released, requeued or settled"),
                Err(e) => tracing::warn!(error = %e, "gang sweep failed"),
            }
            // After expiry too: a replica that just ran out of attempts restarts in the same tick.
            let online_since = crate::workers::online_since(&state);
            match crate::deployments::repair(&state.db, crate::store::db::now_ms(), online_since).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(replicas = n, "ended replicas restarted"),
                Err(e) => tracing::warn!(error = %e, "replica repair failed"),
            }
        }
    });
}

/// Serves until Ctrl-C or SIGTERM.
pub async fn serve(config: Config) -> Result<(), StartError> {
    let bind = config.bind.clone();
    let state = AppState::open(config).await?;
    // Bound before the leases are touched: a server that cannot take its port changes nothing.
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    let address = listener.local_addr()?;
    let server = Uuid::new_v4();
    let ttl_ms = state.config.lease_ttl_secs as i64 * 1000;
    match crate::store::jobs::grace_leases(&state.db, server, ttl_ms, lease_watch_ms(&state)).await {
        Ok(None) => tracing::info!("leases swept moments ago (by another server, or before a restart): none extended"),
        Ok(Some(0)) => {}
        Ok(Some(n)) => tracing::info!(jobs = n, "leases the workers could not renew while no server ran extended"),
        Err(e) => tracing::warn!(error = %e, "extending leases at start failed"),
    }
    spawn_lease_expiry(state.clone(), server);
    registry::gc::spawn(state.clone());
    loaning::spawn(state.clone());
    println!("Tessera is listening on http://{address}");
    tracing::info!(%address, "listening");
    axum::serve(listener, router(state).into_make_service_with_connect_info::<SocketAddr>())
        .with_graceful_shutdown(shutdown_signal())
        .await?;
    Ok(())
}

/// How long after a lease sweep the leases count as watched: half a lease, so a server
/// down for less lets a live worker's lease (renewed every heartbeat) run on unextended.
fn lease_watch_ms(state: &AppState) -> i64 {
    state.config.lease_ttl_secs as i64 * 500
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        if let Ok(mut signal) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            signal.recv().await;
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = terminate => {} }
}
