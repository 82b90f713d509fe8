//! The dashboard's CSS, JavaScript and icon, compiled into the binary so it serves them
//! from any working directory. Pages link them with `?v=<version>`, so a new build is
//! picked up at once while an unchanged one is served from the browser's cache.

use std::sync::LazyLock;

use axum::extract::Path;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

const FILES: &[(&str, &str, &str)] = &[
    ("app.css", "text/css; charset=utf-8", include_str!("../../../web/app.css")),
    ("app.js", "text/javascript; charset=utf-8", include_str!("../../../web/app.js")),
    ("favicon.svg", "image/svg+xml", include_str!("../../../web/favicon.svg")),
    ("train.css", "text/css; charset=utf-8", include_str!("../../../web/train.css")),
    ("train.js", "text/javascript; charset=utf-8", include_str!("../../../web/train.js")),
];

static VERSION: LazyLock<String> = LazyLock::new(|| {
    let mut hasher = Sha256::new();
    for (name, _, body) in FILES {
        hasher.update(name.as_bytes());
        hasher.update(body.as_bytes());
    }
    hex::encode(hasher.finalize())[..12].to_string()
});

pub fn version() -> &'static str {
    &VERSION
}

pub async fn serve(Path(name): Path<String>, headers: HeaderMap) -> Response {
    let Some((_, content_type, body)) = FILES.iter().find(|(file, _, _)| *file == name) else {
        return (StatusCode::NOT_FOUND, "No such static file.").into_response();
    };
    let etag = format!("\"{}\"", version());
    let cache = [(header::CACHE_CONTROL, "public, max-age=3600".to_string()), (header::ETAG, etag.clone())];
    let matches = headers.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()) == Some(etag.as_str());
    if matches {
        return (StatusCode::NOT_MODIFIED, cache).into_response();
    }
    (cache, [(header::CONTENT_TYPE, *content_type)], *body).into_response()
}
