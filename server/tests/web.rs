//! The dashboard over real HTTP: signing in with the form, the session cookie's
//! attributes, every page rendering with and without data, uploads through the web
//! route, and state-changing posts refused from another origin.

mod support;

use reqwest::header::{HeaderMap, LOCATION, SET_COOKIE};
use reqwest::redirect::Policy;
use reqwest::{Client, Response, StatusCode};
use serde_json::{json, Value};
use support::{model_form, tiny_model, Backend, TestServer, ADMIN_PASSWORD};

/// A browser-like client that shows redirects instead of following them.
fn browser() -> Client {
    Client::builder().redirect(Policy::none()).build().unwrap()
}

fn header(response: &Response, name: impl reqwest::header::AsHeaderName) -> &str {
    response.headers().get(name).map(|v| v.to_str().unwrap()).unwrap_or("")
}

/// Signs in through the form; returns the `Cookie` header value for later requests.
async fn sign_in(server: &TestServer, http: &Client) -> String {
    let response = http
        .post(format!("{}/login", server.url))
        .form(&[("username", "admin"), ("password", ADMIN_PASSWORD), ("next", "/")])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let set_cookie = header(&response, SET_COOKIE);
    set_cookie.split(';').next().unwrap().to_string()
}

async fn page(server: &TestServer, http: &Client, cookie: &str, path: &str) -> (StatusCode, String) {
    let response = http.get(format!("{}{path}", server.url)).header("cookie", cookie).send().await.unwrap();
    let status = response.status();
    (status, response.text().await.unwrap())
}

async fn upload(server: &TestServer, http: &Client, cookie: &str, name: &str) -> Response {
    http.post(format!("{}/models/upload", server.url))
        .header("cookie", cookie)
        .header("x-requested-with", "XMLHttpRequest")
        .multipart(model_form(name, tiny_model()))
        .send()
        .await
        .unwrap()
}

/// The pages are served with `style-src 'self'; script-src 'self'`: a browser ignores a
/// `style` attribute, a `<style>` or inline `<script>`, and an `on…=` handler, so no
/// template may use one (a progress bar drawn with an inline width always looked full).
#[test]
fn no_template_holds_what_the_content_security_policy_refuses() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../templates");
    let mut refused = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        for (number, line) in text.lines().enumerate() {
            let line = line.to_ascii_lowercase();
            if line.contains(" style=") || line.contains("<style") || inline_script(&line) || handler(&line) {
                refused.push(format!("{}:{}: {}", path.display(), number + 1, line.trim()));
            }
        }
    }
    assert!(refused.is_empty(), "the CSP refuses these:\n{}", refused.join("\n"));
}

/// Whether `line` opens a `<script>` without a `src`.
fn inline_script(line: &str) -> bool {
    line.match_indices("<script").any(|(at, _)| !line[at..].split('>').next().unwrap_or_default().contains(" src="))
}

/// Whether `line` has an event handler attribute such as ` onclick="…"`.
fn handler(line: &str) -> bool {
    line.split(' ').filter_map(|word| word.split_once('=')).any(|(name, _)| {
        name.len() > 2 && name.starts_with("on") && name.bytes().all(|b| b.is_ascii_lowercase())
    })
}

#[tokio::test]
async fn pages_without_a_session_redirect_to_login_and_fragments_get_401() {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();

    let response = http.get(format!("{}/models", server.url)).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(header(&response, LOCATION), "/login?next=/models");

    let response = http.get(format!("{}/jobs?state=failed", server.url)).send().await.unwrap();
    assert_eq!(header(&response, LOCATION), "/login?next=/jobs%3Fstate%3Dfailed");

    let response = http.get(format!("{}/models?fragment=table", server.url)).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);

    let response = http.get(format!("{}/", server.url)).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(header(&response, LOCATION), "/models");

    let response = http.get(format!("{}/models", server.url)).header("cookie", "tessera_session=forged.jwt.value").send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER, "a forged session is no session");

    let (status, body) = page(&server, &http, "", "/login").await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains(r#"name="password""#), "{body}");
}

#[tokio::test]
async fn wrong_password_renders_the_form_again_with_401_and_the_reason() {
    let server = TestServer::start(Backend::Sqlite).await;
    let response = browser()
        .post(format!("{}/login", server.url))
        .form(&[("username", "admin"), ("password", "not-the-password")])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert!(header(&response, SET_COOKIE).is_empty());
    let body = response.text().await.unwrap();
    assert!(body.contains("Wrong username or password."), "{body}");
    assert!(body.contains(r#"value="admin""#), "the username is kept: {body}");
    assert!(!body.contains("not-the-password"), "the password is not: {body}");
}

#[tokio::test]
async fn repeated_failed_logins_are_throttled_with_429_and_retry_after() {
    let server = TestServer::start_tweaked(Backend::Sqlite, |config| config.login_burst = 1).await;
    let http = browser();
    let attempt = || http.post(format!("{}/login", server.url)).form(&[("username", "admin"), ("password", "nope")]).send();
    assert_eq!(attempt().await.unwrap().status(), StatusCode::UNAUTHORIZED);
    let response = attempt().await.unwrap();
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(!header(&response, "retry-after").is_empty());
    let body = response.text().await.unwrap();
    assert!(body.contains("Too many attempts"), "{body}");
}

#[tokio::test]
async fn login_sets_a_strict_http_only_cookie_for_the_session_lifetime() {
    let server = TestServer::start(Backend::Sqlite).await;
    let response = browser()
        .post(format!("{}/login", server.url))
        .form(&[("username", "admin"), ("password", ADMIN_PASSWORD), ("next", "/jobs?state=failed")])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(header(&response, LOCATION), "/jobs?state=failed");
    let cookie = header(&response, SET_COOKIE);
    assert!(cookie.starts_with("tessera_session=ey"), "{cookie}");
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/", &format!("Max-Age={}", server.config.session_hours * 3600)] {
        assert!(cookie.split("; ").any(|a| a == attribute), "{attribute} missing from {cookie}");
    }

    let response = browser()
        .post(format!("{}/login", server.url))
        .form(&[("username", "admin"), ("password", ADMIN_PASSWORD), ("next", "//evil.example/")])
        .send()
        .await
        .unwrap();
    assert_eq!(header(&response, LOCATION), "/", "next may not leave the site");
}

/// Behind a proxy that serves the dashboard at `--public-url`: a form posted from there is
/// this site's, and on an https one every cookie is Secure (the session's, a notice's);
/// a plain-HTTP server sets none Secure, and without the setting that origin is refused.
#[tokio::test]
async fn behind_its_public_url_forms_are_accepted_and_cookies_are_secure() {
    let public = "https://ml.example.com";
    let login = |server: &TestServer| {
        let form = [("username", "admin"), ("password", ADMIN_PASSWORD), ("next", "/")];
        browser().post(format!("{}/login", server.url)).header("origin", public).form(&form).send()
    };
    let plain = TestServer::start(Backend::Sqlite).await;
    assert_eq!(login(&plain).await.unwrap().status(), StatusCode::FORBIDDEN, "another site without the setting");
    let form = [("username", "admin"), ("password", ADMIN_PASSWORD), ("next", "/")];
    let response = browser().post(format!("{}/login", plain.url)).form(&form).send().await.unwrap();
    let session = header(&response, SET_COOKIE);
    assert!(session.starts_with("tessera_session=ey") && !session.contains("Secure"), "plain HTTP: {session}");

    let server = TestServer::start_tweaked(Backend::Sqlite, |config| config.public_url = Some(public.parse().unwrap())).await;
    let response = login(&server).await.unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let session = header(&response, SET_COOKIE);
    assert!(session.starts_with("tessera_session=ey") && session.ends_with("; Secure"), "{session}");
    let cookie = session.split(';').next().unwrap().to_string();
    let http = browser();
    let changed = http
        .post(format!("{}/account/password", server.url))
        .header("cookie", &cookie)
        .header("origin", public)
        .form(&[("current_password", ADMIN_PASSWORD), ("new_password", "another-long-password")])
        .send()
        .await
        .unwrap();
    assert_eq!(changed.status(), StatusCode::SEE_OTHER);
    let notice = header(&changed, SET_COOKIE);
    assert!(notice.starts_with("tessera_notice=") && notice.ends_with("; Secure"), "{notice}");
    let (_, workers) = page(&server, &http, &cookie, "/workers").await;
    assert!(workers.contains("--server https://ml.example.com"), "workers are told the public URL");
    drop(plain);
}

#[tokio::test]
async fn logout_clears_the_cookie() {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    let cookie = sign_in(&server, &http).await;
    let response = http.post(format!("{}/logout", server.url)).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(header(&response, LOCATION), "/login");
    let cleared = header(&response, SET_COOKIE);
    assert!(cleared.starts_with("tessera_session=;") && cleared.contains("Max-Age=0"), "{cleared}");
}

#[tokio::test]
async fn empty_pages_say_what_to_do_next() {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    let cookie = sign_in(&server, &http).await;

    let (status, models) = page(&server, &http, &cookie, "/models").await;
    assert_eq!(status, StatusCode::OK);
    assert!(models.contains("No models yet — upload one"), "{models}");
    assert!(models.contains("webkitdirectory"), "the upload form offers a folder picker");
    assert!(models.contains(r#"data-live="/models?fragment=table""#));
    assert!(models.contains("&#34;model.safetensors&#34;"), "the allowlist is rendered for the script");
    assert!(models.contains(">admin<") && models.contains(r#"action="/logout""#), "the nav shows the user");

    let (status, workers) = page(&server, &http, &cookie, "/workers").await;
    assert_eq!(status, StatusCode::OK);
    assert!(workers.contains("No workers online") && workers.contains("TESSERA_WORKER_TOKEN"), "{workers}");

    let (status, jobs) = page(&server, &http, &cookie, "/jobs").await;
    assert_eq!(status, StatusCode::OK);
    assert!(jobs.contains("No jobs yet"), "{jobs}");

    let (status, new_job) = page(&server, &http, &cookie, "/jobs/new").await;
    assert_eq!(status, StatusCode::OK);
    assert!(new_job.contains("No models to prefetch yet"), "{new_job}");

    let (status, missing) = page(&server, &http, &cookie, "/models/00000000-0000-0000-0000-000000000000").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(missing.contains("Model not found"), "{missing}");

    let (status, missing) = page(&server, &http, &cookie, "/no/such/page").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(missing.contains("There is no page at this address"), "{missing}");
}

#[tokio::test]
async fn a_model_uploaded_through_the_dashboard_is_listed_prefetched_and_deleted() {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    let cookie = sign_in(&server, &http).await;

    let response = upload(&server, &http, &cookie, "tiny-bert").await;
    assert_eq!(response.status(), StatusCode::CREATED);
    let model: Value = response.json().await.unwrap();
    let id = model["id"].as_str().unwrap().to_string();
    assert_eq!(model["name"], "tiny-bert");

    let response = upload(&server, &http, &cookie, "tiny-bert").await;
    assert_eq!(response.status(), StatusCode::CONFLICT);
    let error: Value = response.json().await.unwrap();
    assert!(error["error"]["message"].as_str().unwrap().contains("already have a model named 'tiny-bert'"));

    let (_, list) = page(&server, &http, &cookie, "/models").await;
    assert!(list.contains(r#"data-model="tiny-bert""#) && list.contains("BertModel"), "{list}");
    let (status, fragment) = page(&server, &http, &cookie, "/models?fragment=table").await;
    assert_eq!(status, StatusCode::OK);
    assert!(fragment.contains("tiny-bert") && !fragment.contains("<html"), "a fragment is only the table: {fragment}");

    let (status, detail) = page(&server, &http, &cookie, &format!("/models/{id}")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(detail.contains("1_Pooling/config.json") && detail.contains(model["digest"].as_str().unwrap()), "{detail}");

    // Prefetch it: the form posts, the job page shows it queued, cancel ends it.
    let response = http
        .post(format!("{}/jobs/new", server.url))
        .header("cookie", &cookie)
        .form(&[("model", id.as_str()), ("name", ""), ("max_attempts", "2")])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let job_page = header(&response, LOCATION).to_string();
    assert!(job_page.starts_with("/jobs/"), "{job_page}");
    let (_, job) = page(&server, &http, &cookie, &job_page).await;
    assert!(job.contains("prefetch tiny-bert") && job.contains("badge-queued") && job.contains("0 of 2"), "{job}");
    let (_, jobs) = page(&server, &http, &cookie, "/jobs?state=queued").await;
    assert!(jobs.contains("prefetch tiny-bert"), "{jobs}");
    let (_, jobs) = page(&server, &http, &cookie, "/jobs?state=failed&fragment=table").await;
    assert!(jobs.contains("No failed jobs"), "{jobs}");

    let cancel = format!("{}{job_page}/cancel", server.url);
    let response = http.post(&cancel).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let (_, job) = page(&server, &http, &cookie, &format!("{job_page}?fragment=detail")).await;
    assert!(job.contains("badge-cancelled") && job.contains("data-live-final"), "{job}");
    let response = http.post(&cancel).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert!(response.text().await.unwrap().contains("nothing to cancel"));

    let response = http
        .post(format!("{}/jobs/new", server.url))
        .header("cookie", &cookie)
        .form(&[("model", id.as_str()), ("max_attempts", "0")])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(response.text().await.unwrap().contains("max_attempts must be between 1 and 100"));

    let response = http.post(format!("{}/models/{id}/delete", server.url)).header("cookie", &cookie).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(header(&response, LOCATION), "/models");
    let (_, list) = page(&server, &http, &cookie, "/models").await;
    assert!(list.contains("No models yet"), "{list}");
}

#[tokio::test]
async fn upload_without_a_session_is_a_401_with_the_error_body() {
    let server = TestServer::start(Backend::Sqlite).await;
    let response = upload(&server, &browser(), "", "anonymous").await;
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unauthorized");
}

#[tokio::test]
async fn workers_page_lists_registered_workers_online() {
    let server = TestServer::start(Backend::Sqlite).await;
    server.register_worker("gpu-box-7").await;
    let http = browser();
    let cookie = sign_in(&server, &http).await;
    let (status, body) = page(&server, &http, &cookie, "/workers?fragment=table").await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains(r#"data-worker="gpu-box-7""#) && body.contains("badge-online"), "{body}");
}

#[tokio::test]
async fn posts_from_another_origin_are_refused() {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    let cookie = sign_in(&server, &http).await;
    let response = upload(&server, &http, &cookie, "kept").await;
    let id = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();

    let mut foreign = HeaderMap::new();
    foreign.insert("origin", "http://evil.example".parse().unwrap());
    let response = http
        .post(format!("{}/models/{id}/delete", server.url))
        .header("cookie", &cookie)
        .headers(foreign.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    assert_page_headers(&response, "a post from another site");
    assert!(response.text().await.unwrap().contains("sent from another site"));
    let response = http
        .post(format!("{}/login", server.url))
        .headers(foreign)
        .form(&[("username", "admin"), ("password", ADMIN_PASSWORD)])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    assert!(header(&response, SET_COOKIE).is_empty());
    let (_, list) = page(&server, &http, &cookie, "/models").await;
    assert!(list.contains(r#"data-model="kept""#), "the model survived");

    // The page's own origin is fine.
    let response = http
        .post(format!("{}/models/{id}/delete", server.url))
        .header("cookie", &cookie)
        .header("origin", &server.url)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
}

#[tokio::test]
async fn api_docs_list_every_route_without_signing_in() {
    let server = TestServer::start(Backend::Sqlite).await;
    let (status, body) = page(&server, &browser(), "", "/api/docs").await;
    assert_eq!(status, StatusCode::OK);
    for path in ["/api/v1/models/{id}", "/api/v1/jobs/{id}/cancel", "/api/v1/agent/claim", "/api/openapi.json"] {
        assert!(body.contains(path), "{path} missing");
    }
    assert!(body.contains("method-delete") && body.contains("ErrorBody"), "methods and schema names are shown");
}

#[tokio::test]
async fn static_assets_are_embedded_with_types_and_cache_headers() {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    for (name, content_type) in [("app.css", "text/css"), ("app.js", "text/javascript"), ("favicon.svg", "image/svg+xml")] {
        let response = http.get(format!("{}/static/{name}", server.url)).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{name}");
        assert!(header(&response, "content-type").starts_with(content_type), "{name}");
        assert!(header(&response, "cache-control").contains("max-age"), "{name}");
        let etag = header(&response, "etag").to_string();
        let again = http.get(format!("{}/static/{name}", server.url)).header("if-none-match", etag).send().await.unwrap();
        assert_eq!(again.status(), StatusCode::NOT_MODIFIED);
    }
    let response = http.get(format!("{}/static/missing.js", server.url)).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
}

/// The headers every dashboard response carries (`web::guard`), `no-store` among them.
fn assert_page_headers(response: &Response, what: &str) {
    assert!(header(response, "content-security-policy").contains("frame-ancestors 'none'"), "{what}");
    assert_eq!(header(response, "x-frame-options"), "DENY", "{what}");
    assert_eq!(header(response, "x-content-type-options"), "nosniff", "{what}");
    assert_eq!(header(response, "referrer-policy"), "same-origin", "{what}");
    assert_eq!(header(response, "cache-control"), "no-store", "{what}");
}

/// What a signed-in user's pages and fragments show is theirs: no cache keeps it. The
/// static assets keep their own caching, 304s included.
#[tokio::test]
async fn signed_in_pages_are_not_stored_and_static_assets_are_cached() {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    let cookie = sign_in(&server, &http).await;
    let pages = [
        "/models", "/models?fragment=table", "/jobs", "/jobs/new", "/deployments", "/datasets", "/account", "/users",
        "/workers", "/mig", "/fleet", "/api/docs", "/no/such/page",
    ];
    for path in pages {
        let response = http.get(format!("{}{path}", server.url)).header("cookie", &cookie).send().await.unwrap();
        assert!(response.status().is_success() || path == "/no/such/page", "{path}: {}", response.status());
        assert!(header(&response, "content-type").starts_with("text/html"), "{path}");
        assert_page_headers(&response, path);
    }
    for name in ["app.css", "app.js", "favicon.svg"] {
        let asset = http.get(format!("{}/static/{name}", server.url)).header("cookie", &cookie);
        let response = asset.try_clone().unwrap().send().await.unwrap();
        assert_eq!(header(&response, "cache-control"), "public, max-age=3600", "{name}");
        let etag = header(&response, "etag").to_string();
        let again = asset.header("if-none-match", etag).send().await.unwrap();
        assert_eq!(again.status(), StatusCode::NOT_MODIFIED);
        assert_eq!(header(&again, "cache-control"), "public, max-age=3600", "{name}");
    }
}

/// What axum's extractors refuse on a dashboard route (a query or path field that does not
/// parse, a path segment that is not UTF-8) and a static file that does not exist are the
/// error page: axum's status, the navigation, a sentence on what to change and every
/// page's headers (they were the API's JSON, without them). A script's request still gets
/// JSON, with the headers; the API's rejections stay JSON, without them.
#[tokio::test]
async fn refused_dashboard_requests_are_error_pages_with_the_page_headers() {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    let cookie = sign_in(&server, &http).await;
    let job = "00000000-0000-0000-0000-000000000001";
    let fix = "Correct that part of the address or form, or follow the link from the dashboard again.";
    let refused = [
        ("/jobs/compare?ids=a&ids=b".to_string(), StatusCode::BAD_REQUEST, ["ids", fix]),
        (format!("/jobs/{job}/checkpoints/ten/files/model.safetensors"), StatusCode::BAD_REQUEST, ["`ten`", fix]),
        ("/models/%FF".to_string(), StatusCode::BAD_REQUEST, ["UTF-8", fix]),
        ("/static/nope".to_string(), StatusCode::NOT_FOUND, ["static file", "Check the address, or pick a section"]),
    ];
    for (path, status, sentences) in refused {
        let response = http.get(format!("{}{path}", server.url)).header("cookie", &cookie).send().await.unwrap();
        assert_eq!(response.status(), status, "{path}");
        assert!(header(&response, "content-type").starts_with("text/html"), "{path}");
        assert_page_headers(&response, &path);
        let body = response.text().await.unwrap();
        for sentence in sentences {
            assert!(body.contains(sentence), "{path}: no {sentence:?} in {body}");
        }
        assert!(body.contains(">admin<"), "{path}: the nav shows the user");
    }
    // Refused before any page runs: a method the route does not take, a NUL byte.
    for (method, path, sentence) in [
        (reqwest::Method::PUT, "/models", "/models does not accept PUT; open it from the menu or send"),
        (reqwest::Method::GET, "/models/a%00b", "The URL holds a NUL byte (%00)"),
    ] {
        let response = http.request(method.clone(), format!("{}{path}", server.url)).header("cookie", &cookie);
        let response = response.header("origin", &server.url).send().await.unwrap();
        assert!(response.status().is_client_error(), "{method} {path}: {}", response.status());
        assert!(header(&response, "content-type").starts_with("text/html"), "{method} {path}");
        assert_page_headers(&response, path);
        let body = response.text().await.unwrap();
        assert!(body.contains(sentence) && body.contains(">admin<"), "{method} {path}: {body}");
    }

    let response = http
        .get(format!("{}/jobs/compare?ids=a&ids=b", server.url))
        .header("cookie", &cookie)
        .header("x-requested-with", "fetch")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_page_headers(&response, "a script's compare");
    assert_eq!(response.json::<Value>().await.unwrap()["error"]["code"], "bad_request");

    let admin = server.admin().await;
    for path in ["/jobs/not-a-uuid", "/models/%FF", "/models/a%00b"] {
        let response = server.get(&admin, path).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{path}");
        assert!(header(&response, "content-type").starts_with("application/json"), "{path}");
        assert!(header(&response, "cache-control").is_empty() && header(&response, "x-frame-options").is_empty());
        assert_eq!(response.json::<Value>().await.unwrap()["error"]["code"], "bad_request", "{path}");
    }
}

/// Error pages that repeat what the address asked for (a deployment's name, a path
/// segment axum could not parse) escape it: a `<script>` in the URL comes back as text.
#[tokio::test]
async fn error_pages_escape_what_the_address_holds() {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    let cookie = sign_in(&server, &http).await;
    let job = "00000000-0000-0000-0000-000000000001";
    let script = "%3Cscript%3Ealert(1)%3C%2Fscript%3E";
    for path in [format!("/deployments/{script}"), format!("/jobs/{job}/checkpoints/{script}/files/x")] {
        let (status, body) = page(&server, &http, &cookie, &path).await;
        assert!(status.is_client_error(), "{path}: {status}");
        assert!(body.contains("&#60;script&#62;alert(1)&#60;/script&#62;"), "{path}: {body}");
        assert!(!body.contains("<script>alert"), "{path}: {body}");
    }
}

/// Posts a dashboard form and returns the response (redirects are not followed).
async fn post_form(server: &TestServer, http: &Client, cookie: &str, path: &str, form: &[(&str, &str)]) -> Response {
    http.post(format!("{}{path}", server.url)).header("cookie", cookie).form(form).send().await.unwrap()
}

#[tokio::test]
async fn deployments_are_created_scaled_and_deleted_from_the_dashboard() {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    let cookie = sign_in(&server, &http).await;

    let (status, empty) = page(&server, &http, &cookie, "/deployments").await;
    assert_eq!(status, StatusCode::OK);
    assert!(empty.contains("No deployments yet") && empty.contains("No models to serve yet"), "{empty}");
    assert!(empty.contains(r#"href="/deployments" class="active""#), "the nav highlights the section");

    let model: Value = upload(&server, &http, &cookie, "tiny-bert").await.json().await.unwrap();
    let model_id = model["id"].as_str().unwrap();
    let (_, form) = page(&server, &http, &cookie, "/deployments").await;
    assert!(form.contains(&format!(r#"<option value="{model_id}""#)), "{form}");

    let response = post_form(&server, &http, &cookie, "/deployments", &[("name", "embedder"), ("model", model_id), ("replicas", "1")]).await;
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let detail = header(&response, LOCATION).to_string();
    assert!(detail.starts_with("/deployments/") && detail.len() == "/deployments/".len() + 36, "{detail}");

    let (status, body) = page(&server, &http, &cookie, &detail).await;
    assert_eq!(status, StatusCode::OK);
    for expected in ["embedder", "tiny-bert", "badge-pending", "waiting for a worker", "not placed yet", "No requests in the last 10 minutes"] {
        assert!(body.contains(expected), "{expected} missing: {body}");
    }
    assert!(body.contains(&format!(r#"data-live="{detail}?fragment=detail""#)), "the page follows itself live");
    assert!(body.contains(r#"data-figure="p99 latency""#) && body.contains(r#"data-chart="Tokens per batch""#), "{body}");

    let (_, table) = page(&server, &http, &cookie, "/deployments?fragment=table").await;
    assert!(table.contains(r#"data-deployment="embedder""#) && table.contains("0/1") && !table.contains("<html"), "{table}");

    let response = post_form(&server, &http, &cookie, &format!("{detail}/scale"), &[("replicas", "2")]).await;
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let (_, fragment) = page(&server, &http, &cookie, &format!("{detail}?fragment=detail")).await;
    assert_eq!(fragment.matches("data-replica=").count(), 2, "{fragment}");
    assert!(!fragment.contains("<html"));

    let response = post_form(&server, &http, &cookie, &format!("{detail}/scale"), &[("replicas", "100")]).await;
    assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(response.text().await.unwrap().contains("replicas must be between 0 and 64"));
    let response = post_form(&server, &http, &cookie, "/deployments", &[("name", "embedder"), ("model", model_id), ("replicas", "1")]).await;
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert!(response.text().await.unwrap().contains("already exists"));
    let response = post_form(&server, &http, &cookie, "/deployments", &[("name", "other"), ("model", model_id), ("replicas", "two")]).await;
    assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let body = response.text().await.unwrap();
    assert!(body.contains("replicas must be a whole number") && body.contains(r#"value="other""#), "the form keeps its values: {body}");

    // Another user neither sees it nor can delete it; a post from another site is refused.
    let admin = server.admin().await;
    let bob = format!("tessera_session={}", server.user(&admin, "bob").await);
    assert_eq!(page(&server, &http, &bob, &detail).await.0, StatusCode::NOT_FOUND);
    assert_eq!(post_form(&server, &http, &bob, &format!("{detail}/delete"), &[]).await.status(), StatusCode::NOT_FOUND);
    let response = http
        .post(format!("{}{detail}/delete", server.url))
        .header("cookie", &cookie)
        .header("origin", "http://evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::FORBIDDEN);

    let response = post_form(&server, &http, &cookie, &format!("{detail}/delete"), &[]).await;
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    assert_eq!(header(&response, LOCATION), "/deployments");
    let (_, list) = page(&server, &http, &cookie, "/deployments").await;
    assert!(list.contains("No deployments yet"), "{list}");
}

/// A server with a signed-in browser and a model uploaded through it; the model's id.
async fn admin_s_model() -> (TestServer, Client, String, String) {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    let cookie = sign_in(&server, &http).await;
    let model: Value = upload(&server, &http, &cookie, "tiny-bert").await.json().await.unwrap();
    let id = model["id"].as_str().unwrap().to_string();
    (server, http, cookie, id)
}

/// What a deployment holds on the dashboard: its model's delete is refused on the model's
/// page, which says why; a replica's job page points to the deployment that scales it
/// instead of offering a cancel that cannot work; the loaning form keeps an exact headroom.
#[tokio::test]
async fn a_deployment_s_model_replicas_and_headroom_on_the_dashboard() {
    let (server, http, cookie, model_id) = admin_s_model().await;
    let model_id = model_id.as_str();
    let form = [("name", "embedder"), ("model", model_id), ("replicas", "1")];
    let detail = header(&post_form(&server, &http, &cookie, "/deployments", &form).await, LOCATION).to_string();

    let response = post_form(&server, &http, &cookie, &format!("/models/{model_id}/delete"), &[]).await;
    assert_eq!(response.status(), StatusCode::CONFLICT);
    let body = response.text().await.unwrap();
    assert!(body.contains("served by deployment") && body.contains("alert-error"), "{body}");
    assert!(body.contains("1_Pooling/config.json"), "the model's page, its files listed: {body}");

    let (_, fragment) = page(&server, &http, &cookie, &format!("{detail}?fragment=detail")).await;
    let replica = fragment.split(r#"data-replica=""#).nth(1).and_then(|rest| rest.split('"').next()).unwrap().to_string();
    let (status, job) = page(&server, &http, &cookie, &format!("/jobs/{replica}")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(!job.contains("/cancel\""), "no cancel form for a replica: {job}");
    assert!(job.contains(&format!(r#"href="{detail}""#)), "{job}");

    let saved = [("loanable", "on"), ("headroom_percent", "12.5")];
    post_form(&server, &http, &cookie, &format!("{detail}/loaning"), &saved).await;
    let (_, body) = page(&server, &http, &cookie, &detail).await;
    assert!(body.contains(r#"name="headroom_percent" value="12.5""#), "{body}");
}

/// Posts a form the deployment's page refuses: a 422 with the reason, the page's figures
/// still the deployment's (one replica wanted, none ready).
async fn refused_on_page(
    server: &TestServer,
    http: &Client,
    cookie: &str,
    path: &str,
    form: &[(&str, &str)],
) -> String {
    let response = post_form(server, http, cookie, path, form).await;
    assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY, "{path} {form:?}");
    let body = response.text().await.unwrap();
    assert!(body.contains("alert-error") && body.contains("0 of 1 replicas ready"), "{body}");
    body
}

/// A refused form on a deployment's page shows the reason with a 422 and keeps what was
/// sent in its fields, escaped, while the page's figures stay the deployment's; a reload
/// shows the deployment's own values again.
#[tokio::test]
async fn refused_scale_and_loaning_forms_keep_what_was_sent() {
    let (server, http, cookie, model_id) = admin_s_model().await;
    let form = [("name", "embedder"), ("model", model_id.as_str()), ("replicas", "1")];
    let detail = header(&post_form(&server, &http, &cookie, "/deployments", &form).await, LOCATION).to_string();
    let scale = format!("{detail}/scale");
    let loaning = format!("{detail}/loaning");

    let body = refused_on_page(&server, &http, &cookie, &scale, &[("replicas", "100")]).await;
    assert!(body.contains("replicas must be between 0 and 64."), "{body}");
    assert!(body.contains(r#"name="replicas" value="100""#), "{body}");
    let body = refused_on_page(&server, &http, &cookie, &scale, &[("replicas", r#"3 "<b>"#)]).await;
    assert!(body.contains("replicas must be a whole number between 0 and 64."), "{body}");
    assert!(body.contains(r#"name="replicas" value="3 &#34;&#60;b&#62;""#), "{body}");
    assert!(!body.contains(r#"3 "<b>"#), "never as sent: {body}");

    // Not loanable yet: the box the user ticked stays ticked beside the headroom they typed.
    let form = [("loanable", "on"), ("headroom_percent", "500")];
    let body = refused_on_page(&server, &http, &cookie, &loaning, &form).await;
    assert!(body.contains("The headroom is a percentage from 0 to 400"), "{body}");
    assert!(body.contains(r#"name="loanable" checked"#), "{body}");
    assert!(body.contains(r#"name="headroom_percent" value="500""#), "{body}");
    let form = [("loanable", "on"), ("headroom_percent", "lots & <more>")];
    let body = refused_on_page(&server, &http, &cookie, &loaning, &form).await;
    assert!(body.contains("The headroom is a percentage from 0 to 400"), "{body}");
    assert!(body.contains(r#"name="headroom_percent" value="lots &#38; &#60;more&#62;""#), "{body}");
    assert!(body.contains(r#"name="replicas" value="1""#), "the other form shows the deployment's: {body}");

    let (_, body) = page(&server, &http, &cookie, &detail).await;
    assert!(body.contains(r#"name="replicas" value="1""#) && !body.contains("alert-error"), "{body}");
    assert!(body.contains(r#"name="headroom_percent" value="20""#), "{body}");
    assert!(!body.contains(r#"name="loanable" checked"#), "{body}");
}

/// The forms that make things keep every field a refusal sent back (escaped) and never a
/// password.
#[tokio::test]
async fn refused_create_forms_keep_their_fields_and_never_a_password() {
    let (server, http, cookie, model_id) = admin_s_model().await;
    let model_id = model_id.as_str();
    let selected = format!(r#"<option value="{model_id}" selected>"#);

    let form = [("name", "<i>emb</i>"), ("model", model_id), ("replicas", "2")];
    let response = post_form(&server, &http, &cookie, "/deployments", &form).await;
    assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let body = response.text().await.unwrap();
    assert!(body.contains("alert-error") && body.contains(r#"value="&#60;i&#62;emb&#60;/i&#62;""#), "{body}");
    assert!(body.contains(&selected) && body.contains(r#"name="replicas" value="2""#), "{body}");
    let form = [
        ("name", "embedder"),
        ("model", model_id),
        ("replicas", "2"),
        ("max_batch_tokens", "100"),
        ("max_batch_requests", "8"),
        ("loanable", "on"),
        ("headroom_percent", "35"),
    ];
    let response = post_form(&server, &http, &cookie, "/deployments", &form).await;
    assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let body = response.text().await.unwrap();
    assert!(body.contains("max_batch_tokens must be between 512 and 1048576"), "{body}");
    for kept in [
        r#"name="name" value="embedder""#,
        r#"name="max_batch_tokens" value="100""#,
        r#"name="max_batch_requests" value="8""#,
        r#"name="loanable" checked"#,
        r#"name="headroom_percent" value="35""#,
    ] {
        assert!(body.contains(kept), "{kept} missing: {body}");
    }

    let form = [("model", model_id), ("name", "warm <cache>"), ("max_attempts", "0")];
    let response = post_form(&server, &http, &cookie, "/jobs/new", &form).await;
    assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let body = response.text().await.unwrap();
    assert!(body.contains("max_attempts must be between 1 and 100") && body.contains(&selected), "{body}");
    assert!(body.contains(r#"value="warm &#60;cache&#62;""#) && body.contains(r#"value="0""#), "{body}");

    let form = [("current_password", "not-my-password"), ("new_password", "a-new-secret")];
    let response = post_form(&server, &http, &cookie, "/account/password", &form).await;
    assert!(response.status().is_client_error(), "{}", response.status());
    let body = response.text().await.unwrap();
    assert!(body.contains("alert-error"), "{body}");
    assert!(!body.contains("not-my-password") && !body.contains("a-new-secret"), "{body}");
}

/// A refused dataset upload shows the reason and keeps the name typed (the browser cannot
/// keep the file); an accepted one is listed.
#[tokio::test]
async fn a_refused_dataset_upload_keeps_its_name() {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    let cookie = sign_in(&server, &http).await;
    let send = |bytes: &'static [u8]| {
        let file = reqwest::multipart::Part::bytes(bytes).file_name("wine.csv");
        let form = reqwest::multipart::Form::new().text("name", "wine-quality").part("file", file);
        http.post(format!("{}/datasets/upload", server.url)).header("cookie", &cookie).multipart(form).send()
    };
    let response = send(b"a,b\n1\n").await.unwrap();
    assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let body = response.text().await.unwrap();
    assert!(body.contains("alert-error") && body.contains(r#"value="wine-quality""#), "{body}");
    let response = send(b"a,b\n1,2\n").await.unwrap();
    let (location, body) = support::follow_notice(&server, &http, &cookie, response).await;
    assert_eq!(location, "/datasets");
    assert!(body.contains("Uploaded") && body.contains("1 rows, 2 columns"), "{body}");
    // Reloading shows the list without the notice and uploads nothing again.
    let (_, body) = page(&server, &http, &cookie, "/datasets").await;
    assert!(!body.contains("Uploaded") && body.contains("wine-quality"), "{body}");
    // The form's URL in the address bar goes to the page, not to a JSON 405.
    let response = http.get(format!("{}/datasets/upload", server.url)).header("cookie", &cookie).send().await.unwrap();
    assert_eq!((response.status(), header(&response, LOCATION)), (StatusCode::SEE_OTHER, "/datasets"));
    let response = http.get(format!("{}/jobs/a%0D%0A%FF/cancel", server.url)).header("cookie", &cookie).send().await.unwrap();
    assert_eq!((response.status(), header(&response, LOCATION)), (StatusCode::SEE_OTHER, "/jobs"));
}

/// A small training job `name` on the toy dataset `data`.
fn toy_training(data: &str, name: &str) -> Value {
    json!({"name": name, "model": {"kind": "mlp", "hidden": [8]}, "dataset": data,
        "task": {"type": "classification", "label_column": "label", "validation_split": 0.25},
        "optimizer": {"type": "sgd"}, "batch_size": 8, "max_steps": 10, "eval_every": 5, "checkpoint_every": 5,
        "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1})
}

/// A data-parallel job is never leased itself: its page names the workers of its ranks.
#[tokio::test]
async fn a_data_parallel_job_s_page_names_its_ranks_workers() {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    let cookie = sign_in(&server, &http).await;
    let admin = server.admin().await;
    let mut spec = toy_training(&server.toy_dataset(&admin).await, "dp");
    spec["parallel"] = json!({"ranks": [{"device": "cpu"}, {"device": "cpu"}]});
    let created: Value = server.post(&admin, "/jobs", spec).await.json().await.unwrap();
    let id = created["id"].as_str().unwrap();
    let (_, waiting) = page(&server, &http, &cookie, &format!("/jobs/{id}")).await;
    assert!(waiting.contains("not leased yet"), "{waiting}");
    for name in ["box-a", "box-b"] {
        let (_, secret) = server.register_worker(name).await;
        let claimed = server.post(&secret, "/agent/claim", json!({"kinds": ["train_rank"]})).await;
        assert_eq!(claimed.status(), StatusCode::OK);
    }
    let (_, held) = page(&server, &http, &cookie, &format!("/jobs/{id}")).await;
    assert!(held.contains("rank 0: box-a") && held.contains("rank 1: box-b"), "{held}");
}

/// An ended job's checkpoints are deleted from its page; a job that may still resume from
/// them keeps them, and the page says why.
#[tokio::test]
async fn an_ended_job_s_checkpoints_are_deleted_from_its_page() {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    let cookie = sign_in(&server, &http).await;
    let admin = server.admin().await;
    let spec = toy_training(&server.toy_dataset(&admin).await, "kept");
    let created: Value = server.post(&admin, "/jobs", spec).await.json().await.unwrap();
    let id = created["id"].as_str().unwrap();
    let (_, secret) = server.register_worker("box").await;
    assert_eq!(server.post(&secret, "/agent/claim", json!({"kinds": ["train"]})).await.status(), StatusCode::OK);
    let files = reqwest::multipart::Part::bytes(vec![7u8; 100]).file_name("model.safetensors");
    let form = reqwest::multipart::Form::new().text("step", "5").part("files", files);
    let url = server.api(&format!("/agent/jobs/{id}/checkpoints"));
    let uploaded = server.http.post(&url).bearer_auth(&secret).multipart(form).send().await.unwrap();
    assert_eq!(uploaded.status(), StatusCode::CREATED);

    let delete = format!("/jobs/{id}/checkpoints/delete");
    let (_, running) = page(&server, &http, &cookie, &format!("/jobs/{id}")).await;
    assert!(!running.contains(&delete), "no delete button while the job may resume: {running}");
    let refused = post_form(&server, &http, &cookie, &delete, &[]).await;
    assert_eq!(refused.status(), StatusCode::CONFLICT);
    let body = refused.text().await.unwrap();
    assert!(body.contains("alert-error") && body.contains("may still resume from its checkpoints"), "{body}");

    assert_eq!(server.post(&admin, &format!("/jobs/{id}/cancel"), json!({})).await.status(), StatusCode::OK);
    let (_, ended) = page(&server, &http, &cookie, &format!("/jobs/{id}")).await;
    assert!(ended.contains(&delete), "{ended}");
    let response = post_form(&server, &http, &cookie, &delete, &[]).await;
    let (location, body) = support::follow_notice(&server, &http, &cookie, response).await;
    assert_eq!(location, format!("/jobs/{id}"));
    assert!(body.contains("Deleted 1 checkpoint of ") && body.contains("No checkpoint yet."), "{body}");
    let listed: Vec<Value> = server.get(&admin, &format!("/jobs/{id}/checkpoints")).await.json().await.unwrap();
    assert!(listed.is_empty(), "{listed:?}");
}

/// An attribute value as the browser reads it (askama escapes `&` as `&#38;`).
fn unescape(value: &str) -> String {
    value.replace("&#38;", "&").replace("&amp;", "&")
}

/// The href of a list page's "Older jobs" link (`what`: "job").
fn older_link(html: &str, what: &str) -> Option<String> {
    let end = html.find(&format!("\" rel=\"next\">Older {what}s"))?;
    let start = html[..end].rfind("href=\"")? + "href=\"".len();
    Some(unescape(&html[start..end]))
}

/// What a list page names its rows by (`data-job="…"`: `what` is "job"), top to bottom.
fn listed(html: &str, what: &str) -> Vec<String> {
    let row = format!("<tr data-{what}=\"");
    html.split(&row).skip(1).map(|rest| rest[..rest.find('"').unwrap()].to_string()).collect()
}

/// A browser signed in as the admin, its cookie, and the admin's id, for rows the test
/// writes through the store.
async fn admin_browser(server: &TestServer) -> (Client, String, uuid::Uuid) {
    let http = browser();
    let cookie = sign_in(server, &http).await;
    let admin = tessera_server::store::users::find_by_name(&server.state.db, "admin").await.unwrap().unwrap();
    (http, cookie, admin.id)
}

/// The ids of the jobs a jobs page lists, top to bottom.
fn listed_jobs(html: &str) -> Vec<String> {
    listed(html, "job")
}

/// Each page of a list from `first`, following its "Older" links to the last: the page's
/// address and HTML.
async fn walk(server: &TestServer, http: &Client, cookie: &str, first: &str, what: &str) -> Vec<(String, String)> {
    let mut pages = Vec::new();
    let mut next = Some(first.to_string());
    while let Some(path) = next {
        let (status, html) = page(server, http, cookie, &path).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        assert_eq!(html.contains(&format!("← Newest {what}s")), path != first, "{path}");
        next = older_link(&html, what);
        pages.push((path, html));
        assert!(pages.len() < 100, "the pages of {first} never end");
    }
    pages
}

#[tokio::test]
async fn the_jobs_page_pages_through_every_job_with_counts_of_all() {
    use tessera_api::jobs::JobSpec;
    use tessera_server::store::{self, jobs::NewJob, Scope};
    let server = TestServer::start(Backend::Sqlite).await;
    let (http, cookie, owner) = admin_browser(&server).await;
    let db = &server.state.db;
    let mut jobs = Vec::new();
    for i in 0..230 {
        let spec = JobSpec::Prefetch { model: uuid::Uuid::new_v4() };
        jobs.push(store::jobs::insert(db, &NewJob::new(owner, &format!("job {i}"), &spec, 1)).await.unwrap());
    }
    for job in jobs.iter().step_by(10) {
        assert!(store::jobs::cancel(db, &Scope::all(), *job, "test").await.unwrap());
    }

    let pages = walk(&server, &http, &cookie, "/jobs", "job").await;
    for (path, html) in &pages {
        // The tabs count every job, not the page's.
        assert!(html.contains("all <span class=\"count\">230</span>"), "{path}: {html}");
        assert!(html.contains("cancelled <span class=\"count\">23</span>"), "{path}");
    }
    let shown: Vec<Vec<String>> = pages.iter().map(|(_, html)| listed_jobs(html)).collect();
    assert_eq!(shown.iter().map(Vec::len).collect::<Vec<_>>(), [100, 100, 30]);
    let newest_first: Vec<String> = jobs.iter().rev().map(|id| id.to_string()).collect();
    assert_eq!(shown.concat(), newest_first, "every job once, newest first");

    // The state filter travels with the pages, and the live refresh re-reads this page.
    let (_, html) = page(&server, &http, &cookie, "/jobs?state=queued").await;
    assert_eq!(listed_jobs(&html).len(), 100);
    let older = older_link(&html, "job").unwrap();
    assert!(older.contains("state=queued"), "{older}");
    let (_, html) = page(&server, &http, &cookie, &older).await;
    assert_eq!(listed_jobs(&html).len(), 100, "207 queued jobs: 100, 100, 7");
    let live = html.split("data-live=\"").nth(1).unwrap();
    let live = unescape(&live[..live.find('"').unwrap()]);
    let before = older.split("before=").nth(1).unwrap().split('&').next().unwrap();
    assert!(live.contains(&format!("before={before}")) && live.contains("state=queued"), "{live}");
    let (_, fragment) = page(&server, &http, &cookie, &live).await;
    assert_eq!(listed_jobs(&fragment), listed_jobs(&html));
    let (_, last) = page(&server, &http, &cookie, &older_link(&html, "job").unwrap()).await;
    assert_eq!(listed_jobs(&last).len(), 7);
    assert_eq!(older_link(&last, "job"), None);

    let (status, html) = page(&server, &http, &cookie, "/jobs?before=last").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(html.contains("is not a job id"), "{html}");
    let (status, html) = page(&server, &http, &cookie, &format!("/jobs?before={}", uuid::Uuid::new_v4())).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(html.contains("before names no job"), "{html}");
}

/// The models and datasets pages page as the jobs page does: 100 rows a page, newest
/// first, an "Older" link while more follow and a "Newest" one on older pages; the models
/// page's live refresh re-reads the page shown. A `before` that is no row's id is a 400.
#[tokio::test]
async fn the_models_and_datasets_pages_page_through_every_row() {
    use tessera_api::datasets::{Dataset, DatasetFormat};
    use tessera_server::store::{self, models::NewModel};
    let server = TestServer::start(Backend::Sqlite).await;
    let (http, cookie, owner) = admin_browser(&server).await;
    let db = &server.state.db;
    let digest = format!("sha256:{}", "0".repeat(64));
    let ledger = sqlx::query("INSERT INTO blobs (digest, refs, touched_at) VALUES ($1, 0, 0)").bind(&digest);
    ledger.execute(db.pool()).await.unwrap();
    let mut tx = db.begin().await.unwrap();
    for i in 0..130 {
        let name = format!("row-{i:03}");
        let model = NewModel {
            id: uuid::Uuid::new_v4(),
            owner,
            name: &name,
            digest: &digest,
            architecture: "BertModel",
            config: &json!({}),
            size_bytes: 1,
            created_at: 1000 + i,
        };
        store::models::insert(&mut tx, &model, &[]).await.unwrap();
        let dataset = Dataset {
            id: uuid::Uuid::new_v4(),
            name: name.clone(),
            digest: digest.clone(),
            format: DatasetFormat::Csv,
            columns: Vec::new(),
            rows: 1,
            size_bytes: 1,
            owner: "admin".into(),
            created_at: chrono::DateTime::from_timestamp_millis(1000 + i).unwrap(),
        };
        store::datasets::insert(&mut tx, owner, &dataset).await.unwrap();
    }
    tx.commit().await.unwrap();
    let newest_first: Vec<String> = (0..130).rev().map(|i| format!("row-{i:03}")).collect();

    for (path, what) in [("/models", "model"), ("/datasets", "dataset")] {
        let pages = walk(&server, &http, &cookie, path, what).await;
        let shown: Vec<Vec<String>> = pages.iter().map(|(_, html)| listed(html, what)).collect();
        assert_eq!(shown.iter().map(Vec::len).collect::<Vec<_>>(), [100, 30], "{path}");
        assert_eq!(shown.concat(), newest_first, "every {what} once, newest first");

        let (status, html) = page(&server, &http, &cookie, &format!("{path}?before=last")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}");
        assert!(html.contains(&format!("is not a {what} id")), "{html}");
        let (status, html) = page(&server, &http, &cookie, &format!("{path}?before={}", uuid::Uuid::new_v4())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}");
        assert!(html.contains(&format!("before names no {what}")), "{html}");
    }

    // The live refresh of an older models page re-reads that page.
    let (_, first) = page(&server, &http, &cookie, "/models").await;
    assert!(first.contains(r#"data-live="/models?fragment=table""#));
    let older = older_link(&first, "model").unwrap();
    let (_, html) = page(&server, &http, &cookie, &older).await;
    let live = html.split("data-live=\"").nth(1).unwrap();
    let live = unescape(&live[..live.find('"').unwrap()]);
    assert_eq!(live, format!("{older}&fragment=table"));
    let (_, fragment) = page(&server, &http, &cookie, &live).await;
    assert_eq!(listed(&fragment, "model"), listed(&html, "model"));
    assert!(fragment.contains("← Newest models") && !fragment.contains("<html"), "{fragment}");
}

/// Every dashboard page and form, with unknown, malformed and real ids in its path, query
/// parameters and form fields of the wrong type, answers below 500 (a page saying what is
/// wrong, a redirect, or the page itself).
#[tokio::test]
async fn no_page_answers_malformed_requests_with_a_5xx() {
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    let cookie = sign_in(&server, &http).await;
    let admin = server.admin().await;
    let model = server.upload_model(&admin, "tiny", tiny_model()).await.json::<Value>().await.unwrap();
    let model = model["id"].as_str().unwrap().to_string();
    let dataset = server.toy_dataset(&admin).await;
    let created = server.post(&admin, "/deployments", serde_json::json!({"name": "embedder", "model": "tiny"})).await;
    assert_eq!(created.status(), 201);
    let job = server.post(&admin, "/jobs", serde_json::json!({"name": "p", "spec": {"kind": "prefetch", "model": "tiny"}})).await;
    let job = job.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
    let long = "x".repeat(300);
    let ids = ["00000000-0000-0000-0000-000000000001", "nope", "%FF", "a%00b", &long, &model, &dataset, "embedder", &job, "latest", "1"];
    let pages = [
        "/", "/account", "/users", "/models", "/models/{}", "/jobs", "/jobs/new", "/jobs/compare", "/jobs/{}",
        "/jobs/{}/series", "/jobs/{}/checkpoints/{}/files/{}", "/datasets", "/deployments", "/deployments/{}",
        "/workers", "/mig", "/fleet", "/api/docs", "/static/{}",
    ];
    let queries = ["", "?state=x&before=x&fragment=table&max_points=99999999999999999999&jobs=x&a=%FF&series=x"];
    let mut failures = Vec::new();
    let mut sent = 0;
    for page in pages {
        let paths: Vec<String> =
            if page.contains("{}") { ids.iter().map(|id| page.replace("{}", id)).collect() } else { vec![page.to_string()] };
        for path in paths {
            for query in queries {
                let response =
                    http.get(format!("{}{path}{query}", server.url)).header("cookie", &cookie).send().await.unwrap();
                sent += 1;
                if response.status().is_server_error() {
                    failures.push(format!("GET {path}{query}: {}", response.status()));
                }
            }
        }
    }
    // The forms, sent fields of the wrong type or none; deletes last, so the real ids last.
    let forms = [
        "/account/password", "/users/{}/disable", "/users/{}/enable", "/jobs/new", "/deployments",
        "/deployments/{}/scale", "/deployments/{}/loaning", "/jobs/{}/cancel", "/jobs/{}/checkpoints/delete",
        "/models/{}/delete", "/datasets/{}/delete", "/deployments/{}/delete",
    ];
    let fields: [&[(&str, &str)]; 3] = [
        &[],
        &[("replicas", "-1"), ("name", "\0"), ("model", "%FF"), ("max_attempts", "lots"), ("loanable", "maybe")],
        &[("current_password", ""), ("new_password", "x"), ("throughput", "1e400"), ("headroom", "NaN")],
    ];
    for form in forms {
        let paths: Vec<String> =
            if form.contains("{}") { ids.iter().map(|id| form.replace("{}", id)).collect() } else { vec![form.to_string()] };
        for path in paths {
            for body in fields {
                let response = post_form(&server, &http, &cookie, &path, body).await;
                sent += 1;
                if response.status().is_server_error() {
                    failures.push(format!("POST {path} {body:?}: {}", response.status()));
                }
            }
        }
    }
    assert!(sent > 100, "{sent} requests");
    assert!(failures.is_empty(), "{} of {sent} requests:\n{}", failures.len(), failures.join("\n"));
}

/// A compare link keeps its jobs pickable and drawn however many jobs came after them
/// (the picker lists the newest 500).
#[tokio::test]
async fn a_compare_link_shows_a_job_older_than_the_newest_500() {
    use tessera_api::jobs::JobSpec;
    use tessera_server::store::{self, jobs::NewJob};
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    let cookie = sign_in(&server, &http).await;
    let admin = server.admin().await;
    let dataset = server.toy_dataset(&admin).await;
    let body = serde_json::json!({"name": "old-run", "model": {"kind": "mlp", "hidden": [8]}, "dataset": dataset,
        "task": {"type": "classification", "label_column": "label", "validation_split": 0.2},
        "optimizer": {"type": "sgd", "momentum": 0.9}, "batch_size": 8, "max_steps": 10, "eval_every": 5,
        "checkpoint_every": 5, "lr_schedule": {"type": "constant", "lr": 0.1}, "seed": 1});
    let response = server.post(&admin, "/jobs", body.clone()).await;
    assert_eq!(response.status(), 201);
    let old = response.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string();
    let db = &server.state.db;
    let owner = store::users::find_by_name(db, "admin").await.unwrap().unwrap().id;
    let run = store::jobs::spec(db, old.parse().unwrap()).await.unwrap().unwrap();
    for i in 0..500 {
        let spec = JobSpec::Prefetch { model: uuid::Uuid::new_v4() };
        store::jobs::insert(db, &NewJob::new(owner, &format!("job {i}"), &spec, 1)).await.unwrap();
    }
    let mut parallel = body.clone();
    parallel["name"] = "dp-run".into();
    parallel["parallel"] = serde_json::json!({"ranks": [{"device": "cpu"}, {"device": "cpu"}]});
    assert_eq!(server.post(&admin, "/jobs", parallel).await.status(), 201);
    let (_, html) = page(&server, &http, &cookie, "/jobs/compare").await;
    assert!(html.contains("old-run"), "jobs of other kinds do not push a run out of the picker");
    assert!(html.contains("dp-run"), "a data-parallel run is a training job too");
    let runs: Vec<Value> = server.get(&admin, "/jobs?kind=train").await.json().await.unwrap();
    assert_eq!(runs.iter().map(|j| j["name"].as_str().unwrap()).collect::<Vec<_>>(), ["dp-run", "old-run"]);
    for i in 0..500 {
        store::jobs::insert(db, &NewJob::new(owner, &format!("run {i}"), &run, 1)).await.unwrap();
    }
    let (_, html) = page(&server, &http, &cookie, "/jobs/compare").await;
    assert!(!html.contains("old-run"), "the picker lists the newest 500 training jobs");
    let (status, html) = page(&server, &http, &cookie, &format!("/jobs/compare?ids={old},nope")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(html.contains(&format!("value=\"{old}\" data-compare-job=\"old-run\" checked")), "{html}");
    assert!(html.contains(&format!("data-compare=\"{old}\"")), "and drawn");
}

/// A server with a signed-in browser and a queued job `name` of the admin's.
async fn admin_s_job(name: &str) -> (TestServer, Client, String, uuid::Uuid) {
    use tessera_api::jobs::JobSpec;
    use tessera_server::store::{self, jobs::NewJob};
    let server = TestServer::start(Backend::Sqlite).await;
    let http = browser();
    let cookie = sign_in(&server, &http).await;
    let db = &server.state.db;
    let owner = store::users::find_by_name(db, "admin").await.unwrap().unwrap().id;
    let spec = JobSpec::Prefetch { model: uuid::Uuid::new_v4() };
    let job = store::jobs::insert(db, &NewJob::new(owner, name, &spec, 1)).await.unwrap();
    (server, http, cookie, job)
}

/// A job page shows the newest 1,000 lines of a long log and counts the ones before.
#[tokio::test]
async fn a_job_page_shows_the_newest_lines_of_a_long_log() {
    let (server, http, cookie, job) = admin_s_job("chatty").await;
    let db = &server.state.db;
    let lines: Vec<String> = (1..=10_500).map(|i| format!("line number {i}.")).collect();
    tessera_server::store::jobs::append_logs(db, job, &lines, 0).await.unwrap();
    let (status, html) = page(&server, &http, &cookie, &format!("/jobs/{job}")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(html.contains("line number 10500.") && html.contains("line number 9501."), "the newest 1,000");
    assert!(!html.contains("line number 9500."), "no more");
    assert!(html.contains("9500 earlier lines are not shown"), "and the count of the rest");
}

/// A metric's card counts all its points, though the page shows a downsampled few.
#[tokio::test]
async fn a_job_page_counts_every_point_of_a_long_series() {
    use tessera_server::store::training::{Point, Series};
    let (server, http, cookie, job) = admin_s_job("long").await;
    let db = &server.state.db;
    let point =
        |step: i64| Point { series: Series::Step, name: "loss".into(), step, value: 1.0 / (step + 1) as f64, at: 0, phase: None };
    tessera_server::training::metrics::store(db, job, (0..1000).map(point).collect()).await.unwrap();
    let (status, html) = page(&server, &http, &cookie, &format!("/jobs/{job}")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(html.contains("1000 points · min"), "{html}");
    assert!(html.contains("of the 1000 points"), "{html}");
}
