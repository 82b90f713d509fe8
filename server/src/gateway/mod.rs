//! The inference gateway: client-facing APIs (OpenAI, KServe v2) forward to the least
//! loaded ready replica of a deployment. The ready-replica table is cached for a second
//! so a request costs no database round trip; connections to workers are kept alive.
//! A replica that does not answer within the inference timeout gets the client a 504; one
//! at capacity refuses at once (429, `Retry-After`), and the next replica is tried before
//! the client hears it. A replica that failed lately is tried after the others
//! (`ejection.rs`).
//! Everything a request needs that does not change with it (replica URLs, authorization
//! headers, metric handles) is built once per route, not per request.

mod ejection;
pub mod kserve;
pub mod openai;
pub mod stats;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use metrics::{Counter, Histogram};
use tessera_api::engine::{EngineError, InferRequest, InferResponse, NOT_SERVING, UNHEALTHY};
use uuid::Uuid;

use self::ejection::Ejections;
use self::stats::{Sample, TrafficStats};
use crate::store::db::Db;
use crate::store::{deployments, Scope};

/// How long the ready-replica table of a deployment is trusted.
const ROUTE_TTL: Duration = Duration::from_secs(1);

/// A worker that takes longer than this to accept a connection is treated as unreachable,
/// and the next replica is tried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Most bytes of JSON a replica's engine endpoint reads (axum's default body limit, which
/// `worker/src/serve/endpoint.rs` keeps). Texts can grow sixfold on their way there
/// (control characters are escaped), so the gateway checks what it would send.
const REPLICA_BODY_LIMIT_BYTES: usize = 2 << 20;

/// A failure, with the status the client should see and a sentence for it.
#[derive(Debug)]
pub struct GatewayError {
    pub status: StatusCode,
    pub kind: String,
    pub message: String,
    /// Seconds the client should wait before retrying (`Retry-After`), on a 429 or a 503.
    pub retry_after: Option<u64>,
}

impl GatewayError {
    pub fn new(status: StatusCode, kind: &str, message: impl Into<String>) -> GatewayError {
        GatewayError { status, kind: kind.into(), message: message.into(), retry_after: None }
    }

    /// `response` with this error's `Retry-After`, whichever shape its body has. Every 503
    /// carries one (a second unless the error says otherwise), as on every route of the
    /// platform, so that clients send the request again.
    pub fn with_headers(&self, mut response: axum::response::Response) -> axum::response::Response {
        let unavailable = self.status == StatusCode::SERVICE_UNAVAILABLE;
        if let Some(seconds) = self.retry_after.or(unavailable.then_some(1)) {
            response.headers_mut().insert(header::RETRY_AFTER, seconds.into());
        }
        response
    }

    fn internal(error: impl std::fmt::Display) -> GatewayError {
        tracing::error!(%error, "gateway failure");
        GatewayError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "The server hit an internal error; it has been logged.")
    }
}

/// A 503 for a deployment with no replica to answer now, with the `Retry-After` every
/// 503 of the platform carries.
fn unavailable(message: String) -> GatewayError {
    GatewayError { retry_after: Some(1), ..GatewayError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message) }
}

/// The 404 for a deployment that does not exist and for one the caller may not see: the
/// same answer, so that guessing names finds out nothing.
fn no_deployment(name: &str) -> GatewayError {
    GatewayError::new(StatusCode::NOT_FOUND, "not_found", format!("No deployment named '{name}'."))
}

impl From<crate::error::Error> for GatewayError {
    fn from(error: crate::error::Error) -> GatewayError {
        let status = error.status();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            // The database turned the request away for now: say when to send it again.
            return GatewayError { retry_after: Some(1), ..GatewayError::new(status, "unavailable", error.public_message()) };
        }
        if status.is_server_error() {
            return GatewayError::internal(error);
        }
        GatewayError::new(status, "request", error.public_message())
    }
}

struct Target {
    replica: Uuid,
    /// The engine operation's URL on the replica's worker.
    url: String,
    /// `Bearer <the worker's engine token>`, marked sensitive so it is never logged.
    authorization: HeaderValue,
    inflight: Arc<AtomicUsize>,
}

struct Route {
    fetched: Instant,
    deployment_id: Uuid,
    owner_id: Uuid,
    model: ModelShape,
    targets: Vec<Target>,
    metrics: RouteMetrics,
}

/// The Prometheus series of one deployment, looked up once per route rather than by
/// name and label on every request.
struct RouteMetrics {
    queue: Histogram,
    tokenization: Histogram,
    compute: Histogram,
    batch_size: Histogram,
    batch_tokens: Histogram,
    requests: Counter,
    tokens: Counter,
}

impl RouteMetrics {
    fn new(deployment: &str) -> RouteMetrics {
        let label = [("deployment", deployment.to_string())];
        RouteMetrics {
            queue: metrics::histogram!("tessera_inference_queue_seconds", &label),
            tokenization: metrics::histogram!("tessera_inference_tokenization_seconds", &label),
            compute: metrics::histogram!("tessera_inference_compute_seconds", &label),
            batch_size: metrics::histogram!("tessera_inference_batch_size", &label),
            batch_tokens: metrics::histogram!("tessera_inference_batch_tokens", &label),
            requests: metrics::counter!("tessera_inference_requests_total", &label),
            tokens: metrics::counter!("tessera_inference_tokens_total", &label),
        }
    }

    fn record(&self, response: &InferResponse) {
        let t = response.timings;
        self.queue.record(t.queue_us as f64 / 1e6);
        self.tokenization.record(t.tokenization_us as f64 / 1e6);
        self.compute.record(t.inference_us as f64 / 1e6);
        self.batch_size.record(t.batch_size as f64);
        self.batch_tokens.record(t.batch_tokens as f64);
        self.requests.increment(1);
        self.tokens.increment(response.tokens.iter().map(|&n| n as u64).sum());
    }
}

/// What a deployment's model gives back, read from its registered config.
#[derive(Debug, Clone)]
pub struct ModelShape {
    /// A sequence classifier answers logits; anything else, pooled embeddings.
    pub classifier: bool,
    /// Embedding width, or number of classes.
    pub dimensions: u64,
}

impl ModelShape {
    fn from_registry(architecture: &str, config: &str) -> ModelShape {
        let config: serde_json::Value = serde_json::from_str(config).unwrap_or_default();
        let classifier = architecture.ends_with("ForSequenceClassification");
        let key = if classifier { "num_labels" } else { "hidden_size" };
        ModelShape { classifier, dimensions: config[key].as_u64().unwrap_or(0) }
    }

    /// The engine operation that serves this model.
    pub fn operation(&self) -> &'static str {
        if self.classifier {
            "classify"
        } else {
            "embed"
        }
    }
}

/// What the gateway knows of a deployment a client may call.
pub struct Resolved {
    pub model: ModelShape,
    pub ready_replicas: usize,
}

pub struct Gateway {
    http: reqwest::Client,
    /// The longest a replica may take over one request, connecting included.
    timeout: Duration,
    routes: Mutex<HashMap<String, Arc<Route>>>,
    inflight: Mutex<HashMap<Uuid, Arc<AtomicUsize>>>,
    /// Replicas that failed lately, tried after the others.
    ejections: Mutex<Ejections>,
    /// Per-deployment windowed figures for the dashboard and the stats route.
    pub stats: TrafficStats,
}

/// Decrements a replica's in-flight count when the forwarded request ends, however it ends.
struct InflightGuard(Arc<AtomicUsize>);

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Gateway {
    /// A gateway that gives up on a replica after `timeout` (`--inference-timeout-secs`).
    pub fn new(timeout: Duration) -> Gateway {
        let http = reqwest::Client::builder()
            .pool_idle_timeout(Duration::from_secs(90))
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(timeout)
            .tcp_nodelay(true)
            // A replica answers; it never sends the gateway (and the user's request) on.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .expect("an HTTP client with default TLS settings builds");
        Gateway {
            http,
            timeout,
            routes: Mutex::new(HashMap::new()),
            inflight: Mutex::new(HashMap::new()),
            ejections: Mutex::new(Ejections::default()),
            stats: TrafficStats::default(),
        }
    }

    async fn route(&self, db: &Db, deployment: &str) -> Result<Arc<Route>, GatewayError> {
        if let Some(route) = self.routes.lock().expect("routes lock").get(deployment) {
            if route.fetched.elapsed() < ROUTE_TTL {
                return Ok(route.clone());
            }
        }
        // A busy database is a 503 to send again, as on every route.
        let record = deployments::route(db, deployment)
            .await
            .map_err(crate::error::Error::from)?
            .ok_or_else(|| no_deployment(deployment))?;
        let model = ModelShape::from_registry(&record.architecture, &record.config);
        let mut targets = Vec::with_capacity(record.targets.len());
        for target in record.targets {
            let mut authorization =
                HeaderValue::try_from(format!("Bearer {}", target.engine_token)).map_err(GatewayError::internal)?;
            authorization.set_sensitive(true);
            let inflight = self.inflight.lock().expect("inflight lock").entry(target.replica).or_default().clone();
            targets.push(Target {
                replica: target.replica,
                url: format!("{}/{}", target.endpoint, model.operation()),
                authorization,
                inflight,
            });
        }
        let route = Arc::new(Route {
            fetched: Instant::now(),
            deployment_id: record.deployment_id,
            owner_id: record.owner_id,
            model,
            targets,
            metrics: RouteMetrics::new(deployment),
        });
        let mut routes = self.routes.lock().expect("routes lock");
        routes.insert(deployment.to_string(), route.clone());
        let routed = |replica: Uuid| routes.values().any(|cached| cached.targets.iter().any(|t| t.replica == replica));
        self.ejections.lock().expect("ejections lock").retain(routed, Instant::now());
        Ok(route)
    }

    fn forget(&self, deployment: &str) {
        self.routes.lock().expect("routes lock").remove(deployment);
    }

    /// The route to a deployment in the caller's `scope` (its owner, or an admin).
    async fn visible_route(&self, db: &Db, scope: &Scope, deployment: &str) -> Result<Arc<Route>, GatewayError> {
        let route = self.route(db, deployment).await?;
        if !scope.sees(route.owner_id) {
            return Err(no_deployment(deployment));
        }
        Ok(route)
    }

    /// The deployment if it is in the caller's `scope` (its owner, or an admin).
    pub async fn resolve(&self, db: &Db, scope: &Scope, deployment: &str) -> Result<Resolved, GatewayError> {
        let route = self.visible_route(db, scope, deployment).await?;
        Ok(Resolved { model: route.model.clone(), ready_replicas: route.targets.len() })
    }

    /// Sends `request` to the least loaded ready replica and records the outcome; `check`
    /// refuses first what the deployment's model cannot answer (no replica computes it).
    pub async fn infer(
        &self,
        db: &Db,
        scope: &Scope,
        deployment: &str,
        request: &InferRequest,
        check: impl FnOnce(&ModelShape) -> Result<(), GatewayError>,
    ) -> Result<(ModelShape, InferResponse), GatewayError> {
        let route = self.visible_route(db, scope, deployment).await?;
        check(&route.model)?;
        let started = Instant::now();
        let outcome = self.forward(&route, deployment, request).await;
        match &outcome {
            Ok(response) => {
                route.metrics.record(response);
                self.stats.record(route.deployment_id, Sample::served(started.elapsed(), response));
            }
            Err(_) => self.stats.record(route.deployment_id, Sample::Failed),
        }
        Ok((route.model.clone(), outcome?))
    }

    /// One replica after another, in [`try_order`], until one answers. One that cannot be
    /// reached is skipped, and so is one whose answer computed nothing: a 503 of kind
    /// `not_serving` (stopping, or scaled down since the route was read) or `unhealthy` (it
    /// stopped before answering); a 401 (its worker registered again, with a new engine
    /// token, since the route was read: a client would read a 401 as its own key refused);
    /// and a 429 (at capacity), whose refusal the client gets if every replica refuses
    /// (with the soonest `Retry-After`).
    /// One that was reached but does not answer in time is not retried elsewhere: it may
    /// still be working on the request, and the client has waited the whole timeout. Nor is
    /// one that failed on the request (another 5xx): the request could fail the next too.
    /// A replica that could not be reached, timed out or failed is set back ([`ejection`]).
    ///
    /// If the client goes away, this future is dropped with the request in flight, which
    /// closes its connection to the replica; the replica then drops the queued work.
    async fn forward(&self, route: &Route, deployment: &str, request: &InferRequest) -> Result<InferResponse, GatewayError> {
        let targets = try_order(&route.targets, &self.ejections.lock().expect("ejections lock"), Instant::now());
        if targets.is_empty() {
            return Err(unavailable(format!(
                "Deployment '{deployment}' has no ready replica yet; see its state in /api/v1/deployments/{deployment}."
            )));
        }
        // Past the replica's limit its server would refuse the body while it is still being
        // sent, which reaches us as a broken connection, not as its 413.
        let body = axum::body::Bytes::from(serde_json::to_vec(request).map_err(GatewayError::internal)?);
        if body.len() > REPLICA_BODY_LIMIT_BYTES {
            return Err(GatewayError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!(
                    "The request is larger than a replica accepts ({} bytes as the replica reads it, {REPLICA_BODY_LIMIT_BYTES} \
                     at most; control characters count six bytes each); send fewer or shorter inputs per request.",
                    body.len()
                ),
            ));
        }
        let mut refused: Option<GatewayError> = None;
        for target in targets {
            target.inflight.fetch_add(1, Ordering::Relaxed);
            let _guard = InflightGuard(target.inflight.clone());
            let sent_at = Instant::now();
            let sent = self
                .http
                .post(&target.url)
                .header(header::AUTHORIZATION, target.authorization.clone())
                .header(header::CONTENT_TYPE, "application/json")
                .body(body.clone())
                .send()
                .await;
            let response = match sent {
                Ok(response) => response,
                Err(error) if error.is_connect() => {
                    // A host that is down costs each request the connect timeout: spare the next ones.
                    tracing::warn!(replica = %target.replica, %error, "replica unreachable; trying another");
                    self.eject(target);
                    self.forget(deployment);
                    continue;
                }
                Err(error) => return Err(self.failed(target, deployment, error)),
            };
            let status = response.status();
            if status.is_success() {
                let answer = response.json().await.map_err(|error| self.failed(target, deployment, error))?;
                self.ejections.lock().expect("ejections lock").succeeded(target.replica, sent_at);
                return Ok(answer);
            }
            if status == StatusCode::UNAUTHORIZED {
                // The route read again has the worker's new engine token; until then it goes last.
                tracing::warn!(replica = %target.replica, "replica refused the engine token; trying another");
                self.eject(target);
                self.forget(deployment);
                continue;
            }
            let retry_after = response
                .headers()
                .get(header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok());
            let body = response.bytes().await.map_err(|error| self.failed(target, deployment, error))?;
            let error = match serde_json::from_slice::<EngineError>(&body) {
                Ok(error) => GatewayError { retry_after, ..GatewayError::new(status, &error.kind, error.error) },
                // The engine's HTTP layer refused the request before the engine read it: its
                // body limit (1.5 MB of control characters is 9 MB as JSON). The client can
                // act on that; anything else unexplained is ours.
                Err(_) if status == StatusCode::PAYLOAD_TOO_LARGE => GatewayError::new(
                    status,
                    "too_large",
                    "The request is larger than a replica accepts; send fewer or shorter inputs per request.",
                ),
                Err(e) => {
                    let detail = format!("{status} with a body that is not an engine error ({e})");
                    return Err(self.bad_gateway(target, deployment, "answered what no engine says", detail));
                }
            };
            // Only a refusal that computed nothing goes on: a replica that broke down on
            // the request (a 500) could take the next one down with it.
            // It stopped or is stopping (scaled down, lent): the route read again leaves it out.
            if status == StatusCode::SERVICE_UNAVAILABLE && [NOT_SERVING, UNHEALTHY].contains(&error.kind.as_str()) {
                tracing::warn!(replica = %target.replica, message = %error.message, "replica not serving; trying another");
                self.forget(deployment);
                continue;
            }
            if status == StatusCode::TOO_MANY_REQUESTS {
                let wait = |e: &GatewayError| e.retry_after.unwrap_or(u64::MAX);
                if refused.as_ref().is_none_or(|soonest| wait(soonest) > wait(&error)) {
                    refused = Some(error);
                }
                continue;
            }
            if status.is_server_error() {
                self.eject(target);
            }
            return Err(error);
        }
        if let Some(error) = refused {
            return Err(error);
        }
        Err(unavailable(format!("No replica of '{deployment}' could be reached or is serving; retry shortly.")))
    }

    /// Sets `target` back after a failure, so that the next requests try it last.
    fn eject(&self, target: &Target) {
        self.ejections.lock().expect("ejections lock").failed(target.replica, Instant::now());
    }

    /// What the client hears when a reached replica fails it: 504 when it ran out of time,
    /// else a 502.
    fn failed(&self, target: &Target, deployment: &str, error: reqwest::Error) -> GatewayError {
        if !error.is_timeout() {
            return self.bad_gateway(target, deployment, "broke off while answering", error.to_string());
        }
        tracing::warn!(replica = %target.replica, timeout_s = self.timeout.as_secs_f64(), "replica did not answer in time");
        self.eject(target);
        GatewayError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout",
            format!(
                "Deployment '{deployment}' did not answer within {} s; it may be overloaded, retry shortly or send fewer inputs at once.",
                self.timeout.as_secs_f64()
            ),
        )
    }

    /// A 502, as a proxy answers when what it forwards to fails: a reached replica broke
    /// the exchange off (it stopped mid-request: scaled down, lent, crashed) or answered
    /// what no engine says. The client hears `what`, the log also `detail` (which names
    /// the replica's address); the replica is set back, and the deployment's routes are
    /// read again for the next request.
    fn bad_gateway(&self, target: &Target, deployment: &str, what: &str, detail: String) -> GatewayError {
        tracing::warn!(replica = %target.replica, detail, "replica {what}");
        self.eject(target);
        self.forget(deployment);
        GatewayError::new(
            StatusCode::BAD_GATEWAY,
            "bad_gateway",
            format!("A replica of '{deployment}' {what}; retry shortly."),
        )
    }
}

/// `targets` in the order to try them: those not set back by a recent failure first, each
/// group least loaded first. One set back is tried last rather than dropped, so that a
/// deployment whose every replica failed lately is still served by one that recovered.
fn try_order<'a>(targets: &'a [Target], ejections: &Ejections, now: Instant) -> Vec<&'a Target> {
    // Each key is read once: in-flight counts move while the sort runs.
    let mut keyed: Vec<((bool, usize), &Target)> = targets
        .iter()
        .map(|target| ((ejections.ejected(target.replica, now), target.inflight.load(Ordering::Relaxed)), target))
        .collect();
    keyed.sort_by_key(|&(key, _)| key);
    keyed.into_iter().map(|(_, target)| target).collect()
}

/// `x-queue-time`, `x-tokenization-time`, `x-inference-time`, `x-total-time` (ms, as TEI).
pub fn timing_headers(response: &InferResponse, started: Instant) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let ms = |us: u64| HeaderValue::from_str(&format!("{:.3}", us as f64 / 1000.0)).expect("a number is a valid header");
    headers.insert("x-queue-time", ms(response.timings.queue_us));
    headers.insert("x-tokenization-time", ms(response.timings.tokenization_us));
    headers.insert("x-inference-time", ms(response.timings.inference_us));
    headers.insert("x-total-time", ms(started.elapsed().as_micros() as u64));
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_database_is_a_503_to_send_again_and_other_server_errors_stay_internal() {
        let busy = GatewayError::from(crate::error::Error::Database(sqlx::Error::PoolTimedOut));
        let seen = |e: &GatewayError| (e.status, e.kind.clone(), e.retry_after);
        assert_eq!(seen(&busy), (StatusCode::SERVICE_UNAVAILABLE, "unavailable".into(), Some(1)));
        let broken = GatewayError::from(crate::error::Error::Invariant("a test"));
        assert_eq!(seen(&broken), (StatusCode::INTERNAL_SERVER_ERROR, "internal".into(), None));
    }

    #[test]
    fn every_503_carries_retry_after() {
        let retry_after = |error: GatewayError| {
            let response = error.with_headers(axum::response::IntoResponse::into_response(error.status));
            response.headers().get(header::RETRY_AFTER).map(|value| value.to_str().unwrap().to_string())
        };
        // An engine's 503 of a kind the gateway does not retry reaches the client as it came.
        let passed_on = GatewayError::new(StatusCode::SERVICE_UNAVAILABLE, "draining", "The engine said so.");
        assert_eq!(retry_after(passed_on), Some("1".to_string()));
        let full = GatewayError::new(StatusCode::TOO_MANY_REQUESTS, "overloaded", "The queue is full.");
        let told = GatewayError { retry_after: Some(7), ..full };
        assert_eq!(retry_after(told), Some("7".to_string()));
        assert_eq!(retry_after(GatewayError::new(StatusCode::BAD_GATEWAY, "bad_gateway", "It broke off.")), None);
    }

    #[test]
    fn replicas_set_back_are_tried_last_and_the_rest_least_loaded_first() {
        let target = |inflight: usize| Target {
            replica: Uuid::new_v4(),
            url: String::new(),
            authorization: HeaderValue::from_static("Bearer engine-token"),
            inflight: Arc::new(AtomicUsize::new(inflight)),
        };
        let targets = [target(0), target(2), target(1)];
        let now = Instant::now();
        let mut ejections = Ejections::default();
        ejections.failed(targets[0].replica, now);
        let order: Vec<usize> =
            try_order(&targets, &ejections, now).iter().map(|t| t.inflight.load(Ordering::Relaxed)).collect();
        assert_eq!(order, [1, 2, 0], "the idle replica failed lately: it goes last, not away");
    }
}
