//! KServe Open Inference Protocol v2, as Triton implements it, including Triton's binary
//! tensor extension: `tritonclient[http]` sends inputs and asks for outputs in binary by
//! default. Errors are `{"error": "..."}` on every route, as the protocol says.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tessera_api::engine::{EngineInput, InferRequest};

use super::{timing_headers, GatewayError};
use crate::auth::Principal;
use crate::error::{ApiPath, Error};
use crate::state::AppState;

const HEADER_LENGTH: &str = "inference-header-content-length";

/// The one version a deployment has: it serves one model, which an update replaces.
const VERSION: &str = "1";

pub(crate) fn kserve_error(error: GatewayError) -> Response {
    error.with_headers((error.status, Json(json!({"error": error.message}))).into_response())
}

fn bad_request(message: impl Into<String>) -> GatewayError {
    GatewayError::new(StatusCode::BAD_REQUEST, "invalid", message)
}

pub async fn server_metadata() -> Json<Value> {
    Json(json!({"name": "tessera", "version": env!("CARGO_PKG_VERSION"), "extensions": ["binary_tensor_data"]}))
}

pub async fn live() -> Json<Value> {
    Json(json!({"live": true}))
}

pub async fn ready(State(state): State<AppState>) -> Response {
    match state.db.ping().await {
        Ok(_) => Json(json!({"ready": true})).into_response(),
        Err(_) => kserve_error(GatewayError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "The database is unreachable.")),
    }
}

/// A path's `{version}`, when it names one, must be [`VERSION`]: any other is a 404 that
/// says which exists, rather than version 1 answering for it.
fn check_version(segments: &[String]) -> Result<(), GatewayError> {
    match segments {
        [name, version] if version != VERSION => Err(GatewayError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("Model '{name}' has no version '{version}'; its only version is \"{VERSION}\"."),
        )),
        _ => Ok(()),
    }
}

fn output_name(classifier: bool) -> &'static str {
    if classifier {
        "logits"
    } else {
        "embedding"
    }
}

pub async fn model_metadata(
    State(state): State<AppState>,
    principal: Result<Principal, Error>,
    path: Result<ApiPath<Vec<String>>, Error>,
) -> Response {
    let result = async {
        let principal = principal?;
        let ApiPath(segments) = path?;
        let name = &segments[0];
        let resolved = state.gateway.resolve(&state.db, &principal.scope(), name).await?;
        check_version(&segments)?;
        Ok::<_, GatewayError>(Json(json!({
            "name": name,
            "versions": [VERSION],
            "platform": "tessera",
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": output_name(resolved.model.classifier), "datatype": "FP32",
                         "shape": [-1, resolved.model.dimensions]}],
        }))
        .into_response())
    }
    .await;
    result.unwrap_or_else(kserve_error)
}

pub async fn model_ready(
    State(state): State<AppState>,
    principal: Result<Principal, Error>,
    path: Result<ApiPath<Vec<String>>, Error>,
) -> Response {
    let result = async {
        let principal = principal?;
        let ApiPath(segments) = path?;
        let name = &segments[0];
        let resolved = state.gateway.resolve(&state.db, &principal.scope(), name).await?;
        check_version(&segments)?;
        let ready = resolved.ready_replicas > 0;
        // The protocol answers with the status: 200 for true, a 4xx for false (Triton's 400);
        // a 5xx would say that the server failed.
        let status = if ready { StatusCode::OK } else { StatusCode::BAD_REQUEST };
        Ok::<_, GatewayError>((status, Json(json!({"name": name, "ready": ready}))).into_response())
    }
    .await;
    result.unwrap_or_else(kserve_error)
}

/// Splits a request into its JSON header and the binary tensors that follow it.
fn split_body<'a>(headers: &HeaderMap, body: &'a [u8]) -> Result<(Value, &'a [u8]), GatewayError> {
    let json_len = match headers.get(HEADER_LENGTH) {
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n <= body.len())
            .ok_or_else(|| bad_request("Inference-Header-Content-Length must be a byte count within the body."))?,
        None => body.len(),
    };
    let header = serde_json::from_slice(&body[..json_len])
        .map_err(|e| bad_request(format!("The inference request header is not valid JSON: {e}")))?;
    Ok((header, &body[json_len..]))
}

/// BYTES elements in the binary layout: a 4-byte little-endian length, then the bytes.
fn decode_bytes_tensor(mut raw: &[u8]) -> Result<Vec<String>, GatewayError> {
    let mut out = Vec::new();
    while !raw.is_empty() {
        let (len, rest) = raw.split_at_checked(4).ok_or_else(|| bad_request("A BYTES element is cut short."))?;
        let len = u32::from_le_bytes(len.try_into().expect("four bytes")) as usize;
        let (text, rest) = rest.split_at_checked(len).ok_or_else(|| bad_request("A BYTES element is cut short."))?;
        out.push(String::from_utf8(text.to_vec()).map_err(|_| bad_request("A BYTES element is not UTF-8 text."))?);
        raw = rest;
    }
    Ok(out)
}

fn flatten_strings(value: &Value, out: &mut Vec<String>) -> Result<(), GatewayError> {
    match value {
        Value::String(s) => out.push(s.clone()),
        Value::Array(items) => items.iter().try_for_each(|item| flatten_strings(item, out))?,
        _ => return Err(bad_request("BYTES input data must be strings.")),
    }
    Ok(())
}

/// The texts of the request's one BYTES input, from JSON `data` or the binary section.
fn texts(header: &Value, mut binary: &[u8]) -> Result<Vec<String>, GatewayError> {
    let inputs = header["inputs"].as_array().filter(|i| !i.is_empty()).ok_or_else(|| bad_request("The request has no inputs."))?;
    let mut texts = None;
    for input in inputs {
        let size = input["parameters"]["binary_data_size"].as_u64().map(|n| n as usize);
        let (data, rest) = match size {
            Some(n) => binary.split_at_checked(n).ok_or_else(|| bad_request("binary_data_size runs past the body."))?,
            None => (&[][..], binary),
        };
        binary = rest;
        if input["datatype"] != "BYTES" {
            return Err(bad_request(format!("Input {} must be BYTES (texts); got {}.", input["name"], input["datatype"])));
        }
        if texts.is_some() {
            return Err(bad_request("Send one BYTES input holding the texts."));
        }
        let mut values = Vec::new();
        match size {
            Some(_) => values = decode_bytes_tensor(data)?,
            None => flatten_strings(&input["data"], &mut values)?,
        }
        check_shape(input, values.len())?;
        texts = Some(values);
    }
    let texts = texts.unwrap_or_default();
    if texts.is_empty() {
        return Err(bad_request("The BYTES input holds no texts."));
    }
    Ok(texts)
}

/// KServe requires a `shape`: non-negative dimensions whose product is the number of
/// elements sent, as Triton checks, so a client's mistake is not silently served.
fn check_shape(input: &Value, elements: usize) -> Result<(), GatewayError> {
    let name = &input["name"];
    let shape = &input["shape"];
    let dims = shape.as_array().ok_or_else(|| bad_request(format!("Input {name} needs a shape, such as [{elements}].")))?;
    let mut product = 1u64;
    for dim in dims {
        let dim = dim.as_u64().ok_or_else(|| {
            bad_request(format!("Input {name} has shape {shape}; every dimension must be a non-negative integer."))
        })?;
        product = product.saturating_mul(dim);
    }
    if product != elements as u64 {
        return Err(bad_request(format!(
            "Input {name} has shape {shape}, which holds {product} elements, but {elements} were sent."
        )));
    }
    Ok(())
}

fn wants_binary(header: &Value) -> bool {
    header["parameters"]["binary_data_output"].as_bool().unwrap_or(false)
        || header["outputs"].as_array().is_some_and(|outputs| {
            outputs.iter().any(|o| o["parameters"]["binary_data"].as_bool().unwrap_or(false))
        })
}

/// Answers an inference request. As Triton does, the model and its version are looked up
/// before the body is read: a request for what does not exist is that 404 whatever it
/// sends, and the server neither waits for nor buffers a body it would not use.
pub async fn infer(
    State(state): State<AppState>,
    principal: Result<Principal, Error>,
    path: Result<ApiPath<Vec<String>>, Error>,
    headers: HeaderMap,
    incoming: Request,
) -> Response {
    let started = Instant::now();
    let result = async {
        let principal = principal?;
        let ApiPath(segments) = path?;
        let name = segments[0].clone();
        state.gateway.resolve(&state.db, &principal.scope(), &name).await?;
        check_version(&segments)?;
        // An oversized body is a 413 in KServe's shape, not axum's plain text.
        let body = Bytes::from_request(incoming, &state).await.map_err(|rejection| {
            let status = rejection.status();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                let limit = crate::error::JSON_BODY_LIMIT_BYTES;
                return GatewayError::new(status, "invalid", format!("The request body is larger than this route accepts ({limit} bytes at most)."));
            }
            GatewayError::new(status, "invalid", rejection.body_text())
        })?;
        let (header, binary) = split_body(&headers, &body)?;
        let texts = texts(&header, binary)?;
        // `parameters.truncate: false` refuses over-long inputs (413) instead of cutting them.
        let truncate = header["parameters"]["truncate"].as_bool().unwrap_or(true);
        let request = InferRequest { inputs: texts.into_iter().map(EngineInput::Text).collect(), truncate };
        // The version was checked above; the route is looked up again (cached), so a
        // deployment deleted meanwhile is the 404 that names it.
        let (shape, response) = state.gateway.infer(&state.db, &principal.scope(), &name, &request, |_| Ok(())).await?;
        let rows = response.outputs.len();
        let width = response.outputs.first().map_or(0, Vec::len);
        let values: Vec<f32> = response.outputs.iter().flatten().copied().collect();
        let mut output = json!({"name": output_name(shape.classifier), "datatype": "FP32", "shape": [rows, width]});
        let mut reply = json!({"model_name": name, "model_version": VERSION, "outputs": []});
        if let Some(id) = header.get("id") {
            reply["id"] = id.clone();
        }
        let timing = timing_headers(&response, started);
        if wants_binary(&header) {
            let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            output["parameters"] = json!({"binary_data_size": raw.len()});
            reply["outputs"] = json!([output]);
            let mut bytes = serde_json::to_vec(&reply).expect("JSON serialises");
            let json_len = bytes.len();
            bytes.extend_from_slice(&raw);
            let mut response = (timing, bytes).into_response();
            response.headers_mut().insert(HEADER_LENGTH, json_len.into());
            response.headers_mut().insert(header::CONTENT_TYPE, "application/octet-stream".parse().expect("valid"));
            return Ok(response);
        }
        output["data"] = json!(values);
        reply["outputs"] = json!([output]);
        Ok::<_, GatewayError>((timing, Json(reply)).into_response())
    }
    .await;
    result.unwrap_or_else(kserve_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_tensor(texts: &[&str]) -> Vec<u8> {
        texts.iter().flat_map(|t| (t.len() as u32).to_le_bytes().into_iter().chain(t.bytes())).collect()
    }

    #[test]
    fn binary_bytes_input_is_decoded() {
        let raw = bytes_tensor(&["hello", "", "wörld"]);
        let header = json!({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [3], "parameters": {"binary_data_size": raw.len()}}]});
        assert_eq!(texts(&header, &raw).unwrap(), vec!["hello", "", "wörld"]);
    }

    #[test]
    fn json_input_may_be_nested() {
        let header = json!({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": [["a"], ["b"]]}]});
        assert_eq!(texts(&header, &[]).unwrap(), vec!["a", "b"]);
    }

    #[test]
    fn truncated_binary_and_wrong_types_are_refused() {
        let mut raw = bytes_tensor(&["hello"]);
        raw.pop();
        let header = json!({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": raw.len()}}]});
        assert!(texts(&header, &raw).is_err());
        let header = json!({"inputs": [{"name": "t", "datatype": "FP32", "shape": [1], "data": [1.0]}]});
        assert!(texts(&header, &[]).unwrap_err().message.contains("BYTES"));
    }

    #[test]
    fn shapes_must_hold_the_data_sent() {
        for shape in [json!([7]), json!([-3]), json!([1.5]), json!("1"), Value::Null, json!([2, 0])] {
            let header = json!({"inputs": [{"name": "t", "datatype": "BYTES", "shape": shape, "data": ["a"]}]});
            assert!(texts(&header, &[]).unwrap_err().message.contains("shape"), "{shape}");
        }
        let header = json!({"inputs": [{"name": "t", "datatype": "BYTES", "shape": [1, 1], "data": ["a"]}]});
        assert_eq!(texts(&header, &[]).unwrap(), vec!["a"]);
    }

    #[test]
    fn header_length_splits_json_from_tensors() {
        let json = br#"{"inputs":[]}"#;
        let mut body = json.to_vec();
        body.extend_from_slice(&[1, 2, 3]);
        let mut headers = HeaderMap::new();
        headers.insert(HEADER_LENGTH, json.len().into());
        let (header, rest) = split_body(&headers, &body).unwrap();
        assert_eq!((header, rest), (json!({"inputs": []}), &[1u8, 2, 3][..]));
    }
}
