//! The worker's engine endpoint: one HTTP server per worker, `/replicas/{id}/embed`,
//! `/classify` and `/info`, reachable only with the engine token the server handed out
//! at registration (the gateway presents it; clients never call workers directly).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tessera_api::engine::{EngineError as WireError, EngineInfo, EngineInput, InferRequest, InferResponse, NOT_SERVING};
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
    /// Base URL the server reaches this endpoint at.
    pub url: String,
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
    if ids.is_empty() {
        return Err(EngineError::EmptyInput { index });
    }
    if ids.len() > max {
        if !truncate {
            return Err(EngineError::InputTooLong { index, tokens: ids.len(), max });
        }
        ids.truncate(max);
    }
    let vocab = model.vocab_size();
    if let Some(&token) = ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(EngineError::TokenOutOfRange { index, token, vocab });
    }
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
        Some(Ok(answer)) => Json(InferResponse {
            outputs: answer.outputs,
            tokens,
            labels: replica.model.labels().map(<[String]>::to_vec).unwrap_or_default(),
            timings: answer.timings,
        })
        .into_response(),
        Some(Err(message)) => error(StatusCode::INTERNAL_SERVER_ERROR, "backend", message),
        None => error(StatusCode::SERVICE_UNAVAILABLE, "unhealthy", "The replica stopped before answering."),
    }
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
