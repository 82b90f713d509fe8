//! OpenAI-compatible embeddings: `POST /v1/embeddings`, `GET /v1/models[/{model}]`. The
//! official `openai` client asks for base64 unless told otherwise, so both encodings are
//! served.

use std::borrow::Cow;
use std::time::Instant;

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tessera_api::engine::{EngineInput, InferRequest};

use super::{no_deployment, timing_headers, GatewayError, ModelShape};
use crate::auth::Principal;
use crate::error::{ApiPath, Error};
use crate::state::AppState;

/// OpenAI's error body: `{"error": {"message", "type", "code"}}`.
pub(crate) fn openai_error(error: GatewayError) -> Response {
    let body = json!({"error": {"message": error.message, "type": error.kind, "code": error.status.as_u16()}});
    error.with_headers((error.status, Json(body)).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Input {
    One(String),
    Many(Vec<String>),
    Ids(Vec<u32>),
    ManyIds(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct EmbeddingsRequest {
    model: String,
    input: Input,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<usize>,
    /// Tessera's extension (as TEI's): `false` refuses over-long inputs with 413 instead
    /// of cutting them to the model's maximum.
    #[serde(default)]
    truncate: Option<bool>,
}

fn bad_request(message: impl Into<String>) -> GatewayError {
    GatewayError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

/// The response, serialised straight from the engine's vectors (no intermediate JSON
/// tree, no copy unless `dimensions` shortens them).
#[derive(Serialize)]
struct EmbeddingsResponse<'a> {
    object: &'static str,
    data: Vec<EmbeddingData<'a>>,
    model: &'a str,
    usage: Usage,
}

#[derive(Serialize)]
struct EmbeddingData<'a> {
    object: &'static str,
    index: usize,
    embedding: Embedding<'a>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Embedding<'a> {
    Float(Cow<'a, [f32]>),
    Base64(String),
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u64,
    total_tokens: u64,
}

/// Keeps the first `dimensions` values and normalises again, as Matryoshka models expect.
fn shorten(mut vector: Vec<f32>, dimensions: usize) -> Vec<f32> {
    vector.truncate(dimensions);
    let norm = vector.iter().map(|v| v * v).sum::<f32>().sqrt();
    if norm > 0.0 {
        vector.iter_mut().for_each(|v| *v /= norm);
    }
    vector
}

/// `POST /v1/embeddings`. The body (`unread`) is read and parsed only once the caller is
/// known: an anonymous client gets its 401 without the server buffering what it sent, or
/// parsing it (the untagged `input` costs several times the body's size).
pub async fn embeddings(
    State(state): State<AppState>,
    principal: Result<Principal, Error>,
    unread: Request,
) -> Response {
    let started = Instant::now();
    let result = async {
        let principal = principal?;
        let Json(request) = Json::<EmbeddingsRequest>::from_request(unread, &state).await.map_err(|e: JsonRejection| {
            // Too large is a 413 naming the limit, as on every route (in OpenAI's shape here).
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                return GatewayError::new(e.status(), "invalid_request_error", Error::from(e).public_message());
            }
            bad_request(format!("The body is not a valid embeddings request: {}", e.body_text()))
        })?;
        let inputs: Vec<EngineInput> = match request.input {
            Input::One(text) => vec![EngineInput::Text(text)],
            Input::Many(texts) => texts.into_iter().map(EngineInput::Text).collect(),
            Input::Ids(ids) => vec![EngineInput::Ids(ids)],
            Input::ManyIds(ids) => ids.into_iter().map(EngineInput::Ids).collect(),
        };
        if inputs.is_empty() {
            return Err(bad_request("'input' is empty; send a string, a list of strings, or token ids."));
        }
        let base64 = match request.encoding_format.as_deref() {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => return Err(bad_request(format!("encoding_format {other:?} is not supported; use \"float\" or \"base64\"."))),
        };
        let infer = InferRequest { inputs, truncate: request.truncate.unwrap_or(true) };
        let dimensions_of = |width: usize| match request.dimensions {
            Some(d) if d == 0 || d > width => {
                Err(bad_request(format!("'dimensions' must be between 1 and {width} for this model.")))
            }
            _ => Ok(()),
        };
        // What the model cannot answer is refused before a replica computes it.
        let check = |shape: &ModelShape| {
            if shape.classifier {
                return Err(bad_request(format!(
                    "'{}' serves a classifier, not embeddings; call /v2/models/{}/infer for its logits.",
                    request.model, request.model
                )));
            }
            // A config without `hidden_size` leaves the width to the answer.
            match shape.dimensions {
                0 => Ok(()),
                width => dimensions_of(width as usize),
            }
        };
        let (_, response) = state.gateway.infer(&state.db, &principal.scope(), &request.model, &infer, check).await?;
        dimensions_of(response.outputs.first().map_or(0, Vec::len))?;
        let data = response
            .outputs
            .iter()
            .enumerate()
            .map(|(index, vector)| {
                let vector = match request.dimensions {
                    Some(d) => Cow::Owned(shorten(vector.clone(), d)),
                    None => Cow::Borrowed(vector.as_slice()),
                };
                let embedding = if base64 {
                    let bytes: Vec<u8> = vector.iter().flat_map(|v| v.to_le_bytes()).collect();
                    Embedding::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
                } else {
                    Embedding::Float(vector)
                };
                EmbeddingData { object: "embedding", index, embedding }
            })
            .collect();
        let tokens: u64 = response.tokens.iter().map(|&n| n as u64).sum();
        let body = EmbeddingsResponse {
            object: "list",
            data,
            model: &request.model,
            usage: Usage { prompt_tokens: tokens, total_tokens: tokens },
        };
        Ok((timing_headers(&response, started), Json(body)).into_response())
    }
    .await;
    result.unwrap_or_else(openai_error)
}

/// OpenAI's model object for the deployment `name`, whose id it is.
fn model_object(name: &str, created_at: DateTime<Utc>, owner: &str) -> Value {
    json!({"id": name, "object": "model", "created": created_at.timestamp(), "owned_by": owner})
}

/// `GET /v1/models`: the deployments the caller may call (its own; every one for an admin).
pub async fn models(State(state): State<AppState>, principal: Result<Principal, Error>) -> Response {
    let result = async {
        let principal = principal?;
        let deployments = crate::deployments::list_visible(&state.db, &principal.scope()).await?;
        let data: Vec<Value> = deployments.iter().map(|d| model_object(&d.name, d.created_at, &d.owner)).collect();
        Ok::<_, GatewayError>(Json(json!({"object": "list", "data": data})).into_response())
    }
    .await;
    result.unwrap_or_else(openai_error)
}

/// `GET /v1/models/{model}` (the SDK's `models.retrieve`): the list's object for one
/// deployment, a 404 for one the caller may not call as for one that does not exist.
pub async fn model(
    State(state): State<AppState>,
    principal: Result<Principal, Error>,
    path: Result<ApiPath<String>, Error>,
) -> Response {
    let result = async {
        let principal = principal?;
        let ApiPath(name) = path?;
        // By name only: a model's id is its deployment's name, not the deployment's UUID.
        let deployment = crate::store::deployments::get(&state.db, &principal.scope(), &name)
            .await
            .map_err(Error::from)?
            .filter(|d| d.name == name)
            .ok_or_else(|| no_deployment(&name))?;
        let object = model_object(&deployment.name, deployment.created_at, &deployment.owner);
        Ok::<_, GatewayError>(Json(object).into_response())
    }
    .await;
    result.unwrap_or_else(openai_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shortened_embeddings_are_unit_length() {
        let short = shorten(vec![3.0, 4.0, 12.0], 2);
        assert_eq!(short, vec![0.6, 0.8]);
    }

    #[test]
    fn every_openai_input_shape_parses() {
        for (text, expected) in [(r#""a""#, 1), (r#"["a","b"]"#, 2), ("[1,2,3]", 1), ("[[1],[2,3]]", 2)] {
            let input: Input = serde_json::from_str(text).unwrap();
            let n = match input {
                Input::One(_) | Input::Ids(_) => 1,
                Input::Many(v) => v.len(),
                Input::ManyIds(v) => v.len(),
            };
            assert_eq!(n, expected, "{text}");
        }
    }
}
