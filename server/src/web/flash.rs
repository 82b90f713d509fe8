//! Post/redirect/get for the dashboard's forms. A form that succeeds answers with a 303 to
//! the page it belongs to and leaves its notice ("Uploaded 'wine': 1599 rows") in a
//! short-lived cookie, which that page shows once and clears; reloading the page then
//! shows the page, not a second submission. A GET of a form's URL (the address bar after
//! a refused form, a bookmark) is sent to the page too.
//!
//! The notice travels in a cookie rather than the query string so that no link can make a
//! page of ours say what its author wants.

use axum::http::{header, HeaderMap, HeaderValue, Uri};
use axum::response::{IntoResponse, Redirect, Response};

use super::session::cookie;

const COOKIE: &str = "tessera_notice";

/// The notices are the server's own sentences with names in them; a longer one is cut.
const MAX_NOTICE: usize = 1024;

/// A 303 to `to` that carries `notice` to the page there.
pub fn redirect(to: &str, notice: &str) -> Response {
    let mut notice = notice.to_string();
    if notice.len() > MAX_NOTICE {
        let mut end = MAX_NOTICE;
        while !notice.is_char_boundary(end) {
            end -= 1;
        }
        notice.truncate(end);
    }
    let value = format!("{COOKIE}={}; HttpOnly; SameSite=Strict; Path=/; Max-Age=60", encode(&notice));
    let mut response = Redirect::to(to).into_response();
    response.headers_mut().insert(header::SET_COOKIE, HeaderValue::from_str(&value).expect("an encoded notice is ASCII"));
    response
}

/// The notice a redirect left for this page, if any.
pub fn notice(headers: &HeaderMap) -> Option<String> {
    cookie(headers, COOKIE).and_then(decode)
}

/// `response` with the notice cookie cleared, when the request carried one: it is shown once.
pub fn shown(mut response: Response, headers: &HeaderMap) -> Response {
    if cookie(headers, COOKIE).is_some() {
        let value = HeaderValue::from_static("tessera_notice=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0");
        response.headers_mut().append(header::SET_COOKIE, value);
    }
    response
}

/// A GET of a form's URL: the page the form is on.
pub fn back_to(page: &'static str) -> axum::routing::MethodRouter<crate::state::AppState> {
    axum::routing::get(move || async move { Redirect::to(page) })
}

/// A GET of a form's URL under `/{section}/{id}/…`: that item's page, or the section's when
/// the id (as sent, still percent-encoded) is not a plain name: it goes into a header.
pub fn back_to_item(section: &'static str) -> axum::routing::MethodRouter<crate::state::AppState> {
    axum::routing::get(move |uri: Uri| async move {
        let id = uri.path().split('/').nth(2).unwrap_or_default();
        let plain = !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if plain {
            Redirect::to(&format!("/{section}/{id}"))
        } else {
            Redirect::to(&format!("/{section}"))
        }
    })
}

fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

fn decode(text: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(text.len());
    let mut rest = text.as_bytes();
    while let Some((&first, tail)) = rest.split_first() {
        if first == b'%' {
            let hex = std::str::from_utf8(tail.get(..2)?).ok()?;
            bytes.push(u8::from_str_radix(hex, 16).ok()?);
            rest = &tail[2..];
        } else {
            bytes.push(first);
            rest = tail;
        }
    }
    String::from_utf8(bytes).ok().filter(|notice| !notice.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notice_survives_the_cookie_and_odd_ones_do_not_break_it() {
        for notice in ["Uploaded 'wine': 1599 rows, 12 columns.", "ünïcode; a=b, \"quoted\"", "50% done"] {
            assert_eq!(decode(&encode(notice)).as_deref(), Some(notice));
        }
        assert_eq!(decode("%4"), None);
        assert_eq!(decode("%ZZ"), None);
        assert_eq!(decode("%FF"), None, "not UTF-8");
        let long = "é".repeat(MAX_NOTICE);
        let response = redirect("/datasets", &long);
        let set = response.headers()[header::SET_COOKIE].to_str().unwrap();
        assert!(set.len() < 4096, "a cookie a browser keeps");
        assert_eq!(response.headers()[header::LOCATION], "/datasets");
    }
}
