//! The worker's engine endpoint: one HTTP server per worker, `/replicas/{id}/embed`,
//! `/classify` and `/info`, reachable only with the engine token the server handed out
//! at registration (the gateway presents it; clients never call workers directly).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tessera_api::engine::{EngineError as WireError, EngineInfo, EngineInput, InferRequest, InferResponse, NOT_SERVING, UNHEALTHY};
use tokio::sync::Semaphore;
use uuid::Uuid;

use super::batcher::{Queue, Request, SubmitError, Task};
use crate::engine::{EmbeddingModel, EngineError};

/// A replica as the endpoint serves it.
pub struct Replica {
    pub model: Arc<EmbeddingModel>,
    pub model_id: Uuid,
    pub task: Task,
    pub queue: Queue,
}

pub struct Endpoint {
    replicas: RwLock<HashMap<Uuid, Arc<Replica>>>,
    /// Requests tokenized at once, one per core: the others wait their turn, and are
    /// refused then if the queue filled meanwhile (a burst is not tokenized whole first).
    tokenizing: Arc<Semaphore>,
    token: RwLock<String>,
    /// Engine processes of this worker that were told to stop and have not exited yet
    /// (answering what they admitted): their slices are not free for another job.
    stopping: Arc<AtomicUsize>,
    /// Base URL the server reaches this endpoint at.
    pub url: String,
}

/// An engine process counted as stopping (see [`Endpoint::stopping`]).
pub struct Stopping(Arc<AtomicUsize>);

impl Drop for Stopping {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Removes its replica from the endpoint when dropped (the serve job ended or was aborted).
pub struct Registration {
    endpoint: Arc<Endpoint>,
    id: Uuid,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.endpoint.replicas.write().expect("replicas lock").remove(&self.id);
    }
}

impl Registration {
    /// Takes the replica off the endpoint, so a new request hears `not_serving` (which the
    /// gateway retries on another replica), and waits up to `within` for the requests it
    /// had admitted to be answered: every handler holds the replica until it answers.
    /// False when some were still running at the deadline.
    pub async fn drain(self, within: Duration) -> bool {
        let Some(replica) = self.endpoint.replicas.write().expect("replicas lock").remove(&self.id) else {
            return true;
        };
        let deadline = Instant::now() + within;
        while Arc::strong_count(&replica) > 1 {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }
}

impl Endpoint {
    /// Listens on `listen`; `advertise` (default: the bound address) is the URL the server
    /// is told to use.
    pub async fn start(listen: &str, advertise: Option<String>) -> std::io::Result<Arc<Endpoint>> {
        let listener = tokio::net::TcpListener::bind(listen).await?;
        let address: SocketAddr = listener.local_addr()?;
        let url = advertise.unwrap_or_else(|| format!("http://{address}")).trim_end_matches('/').to_string();
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let endpoint = Arc::new(Endpoint {
            replicas: RwLock::new(HashMap::new()),
            tokenizing: Arc::new(Semaphore::new(cores)),
            token: RwLock::new(String::new()),
            stopping: Arc::default(),
            url,
        });
        let app = Router::new()
            .route("/replicas/{id}/embed", post(embed))
            .route("/replicas/{id}/classify", post(classify))
            .route("/replicas/{id}/info", get(info))
            .with_state(endpoint.clone());
        tokio::spawn(async move {
            if let Err(error) = axum::serve(listener, app).await {
                tracing::error!(%error, "the engine endpoint stopped");
            }
        });
        tracing::info!(%address, url = %endpoint.url, "engine endpoint listening");
        Ok(endpoint)
    }

    /// The token the server gave this worker when it (re-)registered.
    pub fn set_token(&self, token: String) {
        *self.token.write().expect("token lock") = token;
    }

    /// Counts an engine process of this worker as stopping until the guard is dropped.
    pub fn stopping(&self) -> Stopping {
        self.stopping.fetch_add(1, Ordering::SeqCst);
        Stopping(self.stopping.clone())
    }

    /// Whether an engine process of this worker is still stopping.
    pub fn any_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst) > 0
    }

    /// The current engine token (a per-slice engine process is started with it).
    pub fn token(&self) -> String {
        self.token.read().expect("token lock").clone()
    }

    pub fn add(self: &Arc<Self>, id: Uuid, replica: Replica) -> Registration {
        self.replicas.write().expect("replicas lock").insert(id, Arc::new(replica));
        Registration { endpoint: self.clone(), id }
    }

    pub fn replica_url(&self, id: Uuid) -> String {
        format!("{}/replicas/{id}", self.url)
    }
}

fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    (status, Json(WireError { error: message.into(), kind: kind.into() })).into_response()
}

/// A refusal by the queue: 429 with `Retry-After` when the replica is at capacity (the
/// gateway tries another replica, then passes it on), 413 over the request token cap.
fn refused(e: SubmitError) -> Response {
    let message = e.to_string();
    match e {
        SubmitError::Overloaded { retry_after_secs, .. } => {
            let mut response = error(StatusCode::TOO_MANY_REQUESTS, "overloaded", message);
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, retry_after_secs.into());
            response
        }
        SubmitError::TooManyTokens { .. } => error(StatusCode::PAYLOAD_TOO_LARGE, "too_large", message),
        SubmitError::Closed => error(StatusCode::SERVICE_UNAVAILABLE, NOT_SERVING, message),
    }
}

fn engine_error(e: EngineError) -> Response {
    match &e {
        EngineError::InputTooLong { .. } => error(StatusCode::PAYLOAD_TOO_LARGE, "too_long", e.to_string()),
        _ if e.is_input_error() => error(StatusCode::UNPROCESSABLE_ENTITY, "validation", e.to_string()),
        _ => {
            tracing::error!(error = %e, "engine failure");
            error(StatusCode::INTERNAL_SERVER_ERROR, "backend", "The engine failed; see the worker's log.")
        }
    }
}

fn authorize(endpoint: &Endpoint, headers: &HeaderMap, id: Uuid) -> Result<Arc<Replica>, Response> {
    let expected = endpoint.token.read().expect("token lock").clone();
    let given = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    let same = !expected.is_empty()
        && given.len() == expected.len()
        && given.bytes().zip(expected.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
    if !same {
        return Err(error(StatusCode::UNAUTHORIZED, "unauthorized", "Only the Tessera server may call this endpoint."));
    }
    let replica = endpoint.replicas.read().expect("replicas lock").get(&id).cloned();
    replica.ok_or_else(|| error(StatusCode::SERVICE_UNAVAILABLE, NOT_SERVING, format!("Replica {id} is not served here.")))
}

/// Names the input an error is about (the engine numbers inputs within its own call).
fn at_index(error: EngineError, index: usize) -> EngineError {
    match error {
        EngineError::InputTooLong { tokens, max, .. } => EngineError::InputTooLong { index, tokens, max },
        EngineError::EmptyInput { .. } => EngineError::EmptyInput { index },
        EngineError::TokenOutOfRange { token, vocab, .. } => EngineError::TokenOutOfRange { index, token, vocab },
        other => other,
    }
}

/// Token ids sent by the client are used as they are (special tokens included), once
/// they are known to fit the model.
fn check_ids(model: &EmbeddingModel, index: usize, mut ids: Vec<u32>, truncate: bool) -> Result<Vec<u32>, EngineError> {
    let max = model.max_input_tokens();
    if ids.len() > max {
        if !truncate {
            return Err(EngineError::InputTooLong { index, tokens: ids.len(), max });
        }
        ids.truncate(max);
    }
    model.check_tokens(index, &ids)?;
    Ok(ids)
}

/// Token ids of every input, checked against the model's limits before anything queues.
fn tokenize(model: &EmbeddingModel, request: InferRequest) -> Result<(Vec<Vec<u32>>, u64), EngineError> {
    let started = Instant::now();
    let mut sequences = Vec::with_capacity(request.inputs.len());
    for (index, input) in request.inputs.into_iter().enumerate() {
        let ids = match input {
            EngineInput::Text(text) => model.tokenize(&text, request.truncate).map_err(|e| at_index(e, index))?,
            EngineInput::Ids(ids) => check_ids(model, index, ids, request.truncate)?,
        };
        sequences.push(ids);
    }
    Ok((sequences, started.elapsed().as_micros() as u64))
}

async fn infer(endpoint: Arc<Endpoint>, headers: HeaderMap, id: Uuid, wanted: Task, request: InferRequest) -> Response {
    let replica = match authorize(&endpoint, &headers, id) {
        Ok(replica) => replica,
        Err(response) => return response,
    };
    if replica.task != wanted {
        let message = match replica.task {
            Task::Embed => "This model gives embeddings, not class logits.",
            Task::Classify => "This model is a classifier; ask for logits, not embeddings.",
        };
        return error(StatusCode::UNPROCESSABLE_ENTITY, "validation", message);
    }
    if request.inputs.is_empty() {
        return error(StatusCode::UNPROCESSABLE_ENTITY, "validation", "Send at least one input.");
    }
    let max_inputs = replica.queue.admission().max_request_inputs as usize;
    if request.inputs.len() > max_inputs {
        let message = format!(
            "The request holds {} inputs; a request may hold at most {max_inputs} (max_request_inputs): split it.",
            request.inputs.len()
        );
        return error(StatusCode::PAYLOAD_TOO_LARGE, "too_large", message);
    }
    // Under overload most requests are refused: refuse them before they cost tokenization,
    // here and again once it is their turn to be tokenized.
    if let Err(e) = replica.queue.check() {
        return refused(e);
    }
    let arrived = Instant::now();
    let turn = endpoint.tokenizing.clone().acquire_owned();
    let limit = replica.queue.admission().max_queue_wait();
    let Ok(turn) = tokio::time::timeout(limit, turn).await else {
        // It waited its whole queue-time limit for a tokenizer: at capacity, as a full queue.
        return refused(SubmitError::Overloaded { wait: limit, limit, retry_after_secs: 1 });
    };
    let turn = turn.expect("the tokenizing semaphore is never closed");
    let waited = arrived.elapsed();
    if let Err(e) = replica.queue.check() {
        return refused(e);
    }
    let model = replica.model.clone();
    // The turn ends when the tokenization does, even if the client hangs up before.
    let tokenized = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        tokenize(&model, request)
    })
    .await;
    let (sequences, tokenization_us) = match tokenized {
        Ok(Ok(done)) => done,
        Ok(Err(e)) => return engine_error(e),
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, "backend", format!("tokenization panicked: {e}")),
    };
    let tokens: Vec<u32> = sequences.iter().map(|s| s.len() as u32).collect();
    // If the caller hangs up from here on, this handler is dropped with `pending`, which
    // takes the request off the queue before it is computed.
    // Queue time is the waiting, for a tokenizer's turn and for the batch; tokenization is
    // timed on its own (TEI's split).
    let enqueued = Instant::now().checked_sub(waited).unwrap_or(arrived);
    let pending = match replica.queue.submit(Request { sequences, tokenization_us, enqueued }) {
        Ok(pending) => pending,
        Err(e) => return refused(e),
    };
    match pending.answer().await {
        Some(Ok(answer)) => match first_not_finite(&answer.outputs) {
            Some(index) => {
                tracing::error!(replica = %id, index, "the model computed a value that is not finite");
                let message = format!(
                    "The model computed a value that is not finite (NaN or infinity) for input {index}; its weights \
                     or its precision do not suit this input (f16 overflows past 65504: serve it in f32 or bf16)."
                );
                error(StatusCode::INTERNAL_SERVER_ERROR, "backend", message)
            }
            None => Json(InferResponse {
                outputs: answer.outputs,
                tokens,
                labels: replica.model.labels().map(<[String]>::to_vec).unwrap_or_default(),
                timings: answer.timings,
            })
            .into_response(),
        },
        Some(Err(message)) => error(StatusCode::INTERNAL_SERVER_ERROR, "backend", message),
        None => error(StatusCode::SERVICE_UNAVAILABLE, UNHEALTHY, "The replica stopped before answering."),
    }
}

/// The first output holding NaN or infinity, which JSON cannot carry (it would reach the
/// gateway as `null` and read as a broken replica).
fn first_not_finite(outputs: &[Vec<f32>]) -> Option<usize> {
    outputs.iter().position(|output| output.iter().any(|v| !v.is_finite()))
}

async fn embed(State(endpoint): State<Arc<Endpoint>>, Path(id): Path<Uuid>, headers: HeaderMap, Json(request): Json<InferRequest>) -> Response {
    infer(endpoint, headers, id, Task::Embed, request).await
}

async fn classify(State(endpoint): State<Arc<Endpoint>>, Path(id): Path<Uuid>, headers: HeaderMap, Json(request): Json<InferRequest>) -> Response {
    infer(endpoint, headers, id, Task::Classify, request).await
}

async fn info(State(endpoint): State<Arc<Endpoint>>, Path(id): Path<Uuid>, headers: HeaderMap) -> Response {
    let replica = match authorize(&endpoint, &headers, id) {
        Ok(replica) => replica,
        Err(response) => return response,
    };
    let labels = replica.model.labels().map(<[String]>::to_vec).unwrap_or_default();
    Json(EngineInfo {
        model_id: replica.model_id.to_string(),
        architecture: format!("{:?}", replica.task).to_lowercase(),
        dimensions: if labels.is_empty() { replica.model.dimension() as u32 } else { labels.len() as u32 },
        max_input_tokens: replica.model.max_input_tokens() as u32,
        labels,
    })
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::first_not_finite;

    #[test]
    fn the_first_output_holding_nan_or_infinity_is_named() {
        assert_eq!(first_not_finite(&[vec![1.0, -2.0], vec![0.0]]), None);
        assert_eq!(first_not_finite(&[vec![1.0], vec![f32::NAN], vec![f32::INFINITY]]), Some(1));
        assert_eq!(first_not_finite(&[vec![f32::NEG_INFINITY]]), Some(0));
    }
}
