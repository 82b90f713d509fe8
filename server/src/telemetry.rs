//! Prometheus metrics: request counts and latencies by route and status, plus gauges
//! (queue depth, workers online) refreshed when `/metrics` is scraped. The metrics name
//! every tenant's deployments, so scraping needs the scrape token or an admin.

use std::sync::OnceLock;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::auth::{self, secrets};
use crate::error::{Error, Result};
use crate::state::AppState;

/// Latency buckets, 0.5 ms to 10 s: an HTTP request, or one stage of an inference.
const SECONDS: &[f64] = &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
/// Requests in one engine batch.
const BATCH_SIZE: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];
/// Tokens in one engine batch, up to the largest token budgets.
const BATCH_TOKENS: &[f64] =
    &[16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0];

/// Every histogram gets buckets: without them the exporter writes a summary, whose
/// quantiles cannot be aggregated across servers or deployments.
const BUCKETS: &[(&str, &[f64])] = &[
    ("http_request_duration_seconds", SECONDS),
    ("tessera_inference_queue_seconds", SECONDS),
    ("tessera_inference_tokenization_seconds", SECONDS),
    ("tessera_inference_compute_seconds", SECONDS),
    ("tessera_inference_batch_size", BATCH_SIZE),
    ("tessera_inference_batch_tokens", BATCH_TOKENS),
];

/// The recorder is process-global; tests start many servers in one process.
pub fn recorder() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            BUCKETS
                .iter()
                .fold(PrometheusBuilder::new(), |builder, (name, buckets)| {
                    builder.set_buckets_for_metric(Matcher::Full((*name).into()), buckets).expect("bucket list is not empty")
                })
                .install_recorder()
                .expect("no other metrics recorder is installed")
        })
        .clone()
}

/// Records every request under its route template (`/api/v1/models/{id}`), never the raw
/// path, so label cardinality stays bounded.
pub async fn track(request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let method = method_label(request.method()).to_string();
    let started = Instant::now();
    let response = next.run(request).await;
    let labels = [("method", method), ("route", route), ("status", response.status().as_u16().to_string())];
    metrics::counter!("http_requests_total", &labels).increment(1);
    metrics::histogram!("http_request_duration_seconds", &labels).record(started.elapsed().as_secs_f64());
    response
}

/// The method as a label value: the standard ones by name, anything else (`FOO`, a
/// random extension method per request) as `other`, so a client cannot mint series.
fn method_label(method: &Method) -> &'static str {
    const KNOWN: [Method; 9] = [
        Method::GET,
        Method::POST,
        Method::PUT,
        Method::PATCH,
        Method::DELETE,
        Method::HEAD,
        Method::OPTIONS,
        Method::CONNECT,
        Method::TRACE,
    ];
    KNOWN.iter().find(|m| *m == method).map_or("other", |m| m.as_str())
}

/// Who may scrape: the configured scrape token, or an admin's session or API token.
async fn check_scraper(state: &AppState, headers: &HeaderMap) -> Result<()> {
    let Some(token) = auth::bearer_of(headers) else {
        let how = match state.config.metrics_token {
            Some(_) => "the scrape token (TESSERA_METRICS_TOKEN) or an admin's API token",
            None => "an admin's API token, or start the server with TESSERA_METRICS_TOKEN for Prometheus",
        };
        return Err(Error::Unauthorized(format!("/metrics needs `Authorization: Bearer <token>` with {how}.")));
    };
    if let Some(expected) = &state.config.metrics_token {
        if secrets::equal(token, expected) {
            return Ok(());
        }
    }
    let principal = auth::authenticate(state, token).await?;
    if principal.is_admin() {
        Ok(())
    } else {
        Err(Error::Forbidden(
            "/metrics names every tenant's deployments; only admins and the scrape token may read it.".into(),
        ))
    }
}

/// `GET /metrics` in the Prometheus text format, for the scrape token or an admin.
pub async fn render(State(state): State<AppState>, headers: HeaderMap) -> Result<Response> {
    check_scraper(&state, &headers).await?;
    metrics::gauge!("tessera_queue_depth").set(crate::store::jobs::depth(&state.db).await? as f64);
    metrics::gauge!("tessera_workers_online").set(crate::workers::count_online(&state).await? as f64);
    let body = state.metrics.render();
    Ok(([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_methods_share_one_label() {
        assert_eq!(method_label(&Method::PATCH), "PATCH");
        assert_eq!(method_label(&Method::from_bytes(b"FOO").unwrap()), "other");
        assert_eq!(method_label(&Method::from_bytes(b"BREW").unwrap()), "other");
    }
}
