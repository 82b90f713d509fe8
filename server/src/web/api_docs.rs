//! `/api/docs`: the REST API as a readable page, rendered from the same OpenAPI document
//! `/api/openapi.json` serves, so it can never describe routes that do not exist.
//! The document is walked as JSON: that is the shape clients see, and it spares this
//! page from utoipa's many schema types.

use askama::Template;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::{render, session, Layout};
use crate::error::{Error, Result};
use crate::state::AppState;

const METHODS: [&str; 8] = ["get", "post", "put", "patch", "delete", "head", "options", "trace"];

struct Param {
    name: String,
    location: String,
    required: bool,
    ty: String,
    description: String,
}

struct ResponseView {
    status: String,
    /// `ok`, `client` or `server`, for the colour of the status.
    class: &'static str,
    description: String,
    body: String,
}

struct Operation {
    anchor: String,
    method: String,
    path: String,
    /// HTML: escaped text with `backticked` spans as `<code>`.
    summary: String,
    description: String,
    params: Vec<Param>,
    /// The body's type and media type, and its description as HTML.
    request: Option<(String, String)>,
    responses: Vec<ResponseView>,
    auth: Vec<String>,
}

struct TagGroup {
    name: String,
    description: String,
    operations: Vec<Operation>,
}

struct Field {
    name: String,
    ty: String,
    required: bool,
    /// HTML, as `Operation::summary`.
    description: String,
}

struct SchemaView {
    name: String,
    /// HTML, as `Operation::summary`.
    description: String,
    /// `object`, or the whole type when it is not an object (an enum, a union).
    shape: String,
    fields: Vec<Field>,
}

#[derive(Template)]
#[template(path = "api_docs.html")]
struct ApiDocsPage {
    layout: Layout,
    title: String,
    version: String,
    description: String,
    groups: Vec<TagGroup>,
    schemas: Vec<SchemaView>,
    route_count: usize,
}

pub async fn page(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let user = session::current_user(&state, &headers).await.ok().flatten().map(|p| p.username);
    let result: Result<Response> = async {
        let doc = serde_json::to_value(&*state.openapi).map_err(Error::Encode)?;
        let groups = groups(&doc);
        let page = ApiDocsPage {
            layout: Layout::new("API", "api", user.clone()),
            title: text(&doc["info"]["title"]),
            version: text(&doc["info"]["version"]),
            description: text(&doc["info"]["description"]),
            route_count: groups.iter().map(|g| g.operations.len()).sum(),
            groups,
            schemas: schemas(&doc),
        };
        Ok(render(&page)?.into_response())
    }
    .await;
    match result {
        Ok(response) => response,
        Err(error) => super::error_page(&error, user),
    }
}

fn text(value: &Value) -> String {
    value.as_str().unwrap_or_default().to_string()
}

/// Doc comments mark names with backticks; on the page they become `<code>`. Everything
/// else is escaped, so the result is safe to insert as HTML.
fn inline_code(text: &str) -> String {
    let mut html = String::with_capacity(text.len());
    for (i, part) in text.split('`').enumerate() {
        let escaped = askama::filters::escape(part, askama::filters::Html).map(|e| e.to_string()).unwrap_or_default();
        if i % 2 == 1 {
            html.push_str(&format!("<code>{escaped}</code>"));
        } else {
            html.push_str(&escaped);
        }
    }
    html
}

/// Operations grouped by their first tag, tags in the order the document declares them.
fn groups(doc: &Value) -> Vec<TagGroup> {
    let mut groups: Vec<TagGroup> = doc["tags"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|tag| TagGroup { name: text(&tag["name"]), description: text(&tag["description"]), operations: Vec::new() })
        .collect();
    let Some(paths) = doc["paths"].as_object() else {
        return groups;
    };
    for (path, item) in paths {
        for method in METHODS {
            let Some(op) = item.get(method) else { continue };
            let tag = op["tags"].get(0).map(text).unwrap_or_else(|| "other".into());
            let operation = operation(path, method, item, op);
            match groups.iter_mut().find(|g| g.name == tag) {
                Some(group) => group.operations.push(operation),
                None => groups.push(TagGroup { name: tag, description: String::new(), operations: vec![operation] }),
            }
        }
    }
    groups.retain(|g| !g.operations.is_empty());
    groups
}

fn operation(path: &str, method: &str, item: &Value, op: &Value) -> Operation {
    let params = item["parameters"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(op["parameters"].as_array().into_iter().flatten())
        .map(|p| Param {
            name: text(&p["name"]),
            location: text(&p["in"]),
            required: p["required"].as_bool().unwrap_or(false),
            ty: p.get("schema").map(type_name).unwrap_or_else(|| "any".into()),
            description: text(&p["description"]),
        })
        .collect();
    let request = op
        .get("requestBody")
        .map(|body| (content_types(&body["content"]), inline_code(&text(&body["description"]))));
    let responses = op["responses"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(status, response)| ResponseView {
            class: match status.chars().next() {
                Some('2') | Some('3') => "ok",
                Some('4') => "client",
                _ => "server",
            },
            status: status.clone(),
            description: text(&response["description"]),
            body: content_types(&response["content"]),
        })
        .collect();
    let auth = op["security"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_object)
        .flat_map(|requirement| requirement.keys().cloned())
        .collect();
    // `post-api-v1-models-id`: letters and digits, one dash between runs.
    let anchor = format!("{method} {path}")
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|part| !part.is_empty())
        .collect::<Vec<_>>()
        .join("-");
    Operation {
        anchor,
        method: method.to_string(),
        path: path.to_string(),
        summary: inline_code(&text(&op["summary"])),
        description: inline_code(&text(&op["description"])),
        params,
        request,
        responses,
        auth,
    }
}

/// `Model (application/json)`, or just the media type when there is no schema.
fn content_types(content: &Value) -> String {
    content
        .as_object()
        .into_iter()
        .flatten()
        .map(|(media, body)| match body.get("schema") {
            Some(schema) => format!("{} ({media})", type_name(schema)),
            None => media.clone(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A schema as one line of type notation: `Model`, `Job[]`, `string (uuid) | null`.
fn type_name(schema: &Value) -> String {
    if let Some(reference) = schema["$ref"].as_str() {
        return reference.rsplit('/').next().unwrap_or(reference).to_string();
    }
    for (key, separator) in [("oneOf", " | "), ("anyOf", " | "), ("allOf", " & ")] {
        if let Some(parts) = schema[key].as_array() {
            return parts.iter().map(type_name).collect::<Vec<_>>().join(separator);
        }
    }
    if let Some(values) = schema["enum"].as_array() {
        return values.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(" | ");
    }
    let types: Vec<&str> = match &schema["type"] {
        Value::String(t) => vec![t.as_str()],
        Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    if types.is_empty() {
        return if schema.get("properties").is_some() { inline_object(schema) } else { "any".into() };
    }
    types
        .iter()
        .map(|t| match *t {
            "array" => match (&schema["items"], schema["prefixItems"].as_array()) {
                (_, Some(tuple)) => format!("[{}]", tuple.iter().map(type_name).collect::<Vec<_>>().join(", ")),
                (Value::Null, None) => "any[]".into(),
                (items, None) => format!("{}[]", type_name(items)),
            },
            "object" if schema.get("properties").is_some() => inline_object(schema),
            "null" => "null".into(),
            other => match schema["format"].as_str() {
                Some(format) => format!("{other} ({format})"),
                None => other.to_string(),
            },
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

/// `{kind: "prefetch", model: string (uuid)}` for objects defined in place (tagged enums).
fn inline_object(schema: &Value) -> String {
    let fields: Vec<String> = schema["properties"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(name, field)| format!("{name}: {}", type_name(field)))
        .collect();
    format!("{{{}}}", fields.join(", "))
}

fn schemas(doc: &Value) -> Vec<SchemaView> {
    let Some(schemas) = doc["components"]["schemas"].as_object() else {
        return Vec::new();
    };
    schemas
        .iter()
        .map(|(name, schema)| {
            let required: Vec<&str> =
                schema["required"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
            let fields: Vec<Field> = schema["properties"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(field, s)| Field {
                    name: field.clone(),
                    ty: type_name(s),
                    required: required.contains(&field.as_str()),
                    description: inline_code(&text(&s["description"])),
                })
                .collect();
            SchemaView {
                name: name.clone(),
                description: inline_code(&text(&schema["description"])),
                shape: if fields.is_empty() { type_name(schema) } else { "object".into() },
                fields,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn type_names_read_like_the_rust_types() {
        assert_eq!(type_name(&json!({"$ref": "#/components/schemas/Model"})), "Model");
        assert_eq!(type_name(&json!({"type": "array", "items": {"$ref": "#/components/schemas/Job"}})), "Job[]");
        assert_eq!(type_name(&json!({"type": ["string", "null"], "format": "uuid"})), "string (uuid) | null");
        assert_eq!(type_name(&json!({"type": "string", "enum": ["online", "offline"]})), "\"online\" | \"offline\"");
        assert_eq!(
            type_name(&json!({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "integer"}]})),
            "[integer, integer]"
        );
        assert_eq!(
            type_name(&json!({"oneOf": [{"type": "null"}, {"$ref": "#/components/schemas/Gpu"}]})),
            "null | Gpu"
        );
    }

    #[test]
    fn backticks_become_code_and_the_rest_is_escaped() {
        assert_eq!(inline_code("a `name` <b>"), "a <code>name</code> &#60;b&#62;");
    }

    #[test]
    fn operations_are_grouped_by_tag_in_declared_order() {
        let doc = json!({
            "tags": [{"name": "models", "description": "The registry"}, {"name": "jobs"}],
            "paths": {
                "/api/v1/jobs": {"get": {"tags": ["jobs"], "summary": "List jobs", "responses": {"200": {"description": ""}}}},
                "/api/v1/models/{id}": {"delete": {"tags": ["models"], "security": [{"bearer": []}],
                    "parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string", "format": "uuid"}}],
                    "responses": {"204": {"description": "gone"}, "404": {"description": "", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}}}}
            }
        });
        let groups = groups(&doc);
        assert_eq!(groups.iter().map(|g| g.name.as_str()).collect::<Vec<_>>(), ["models", "jobs"]);
        let delete = &groups[0].operations[0];
        assert_eq!((delete.method.as_str(), delete.path.as_str()), ("delete", "/api/v1/models/{id}"));
        assert_eq!(delete.auth, ["bearer"]);
        assert_eq!(delete.anchor, "delete-api-v1-models-id");
        assert_eq!(delete.params[0].ty, "string (uuid)");
        assert_eq!(delete.responses[1].body, "ErrorBody (application/json)");
        assert_eq!(delete.responses[1].class, "client");
    }
}
