//! Keyset paging of the API's lists (jobs, models, datasets): newest first, `limit` rows a
//! page, `before` the last row of the previous page, and while more rows follow a `Link`
//! header naming the next page (`rel="next"`), as GitHub's API pages. The body stays a
//! plain JSON array, so a client that never pages reads the first page as it read the list.

use std::future::Future;

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::{ApiJson, ApiQuery, Error, Result};
use crate::store::StoreError;

/// The most rows a page holds, and the page size of a request that names none.
pub const MAX_LIMIT: u32 = 500;

/// The paging parameters of a list that takes no others; a handler takes it as it is, its
/// rejection our error body (an unknown parameter is a 400 naming it).
#[derive(Debug, Deserialize, utoipa::IntoParams, axum::extract::FromRequestParts)]
#[from_request(via(ApiQuery), rejection(Error))]
#[serde(deny_unknown_fields)]
pub struct PageQuery {
    /// At most this many, 1 to 500 (default 500).
    pub limit: Option<u32>,
    /// Only those listed after this one: the last of the previous page.
    pub before: Option<Uuid>,
}

/// One page of a list, newest first.
#[derive(Debug)]
pub struct Page<T> {
    pub rows: Vec<T>,
    /// Whether older rows follow the last one.
    pub more: bool,
}

/// The page size a request asks for: [`MAX_LIMIT`] when it names none; 400 outside 1 to
/// [`MAX_LIMIT`].
pub fn limit(asked: Option<u32>) -> Result<u32> {
    let limit = asked.unwrap_or(MAX_LIMIT);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(Error::BadRequest(format!("limit must be 1 to {MAX_LIMIT}.")));
    }
    Ok(limit)
}

/// A page of at most `limit` rows read by `list`, a store read that takes how many rows
/// to return and answers `None` when its `before` names no row the caller may see: a 400
/// that names the rows (`what`: "job", "model").
pub async fn read<T, F>(what: &str, limit: u32, list: impl FnOnce(u32) -> F) -> Result<Page<T>>
where
    F: Future<Output = Result<Option<Vec<T>>, StoreError>>,
{
    // One more than asked tells whether a next page exists.
    let mut rows = list(limit + 1).await?.ok_or_else(|| {
        Error::BadRequest(format!(
            "before names no {what} you can see; pass the id of the last {what} of the previous page."
        ))
    })?;
    let more = rows.len() > limit as usize;
    rows.truncate(limit as usize);
    Ok(Page { rows, more })
}

/// The `Link` header value naming the page after `page` of the list at `path` (under
/// `/api/v1`), `None` on the last page: the same `limit`, the page's last row (`id` tells
/// its id) as `before`, and the list's other parameters (`filters`, each `&name=value`).
pub fn next_link<T>(page: &Page<T>, id: impl Fn(&T) -> Uuid, path: &str, limit: u32, filters: &str) -> Option<String> {
    let last = page.rows.last().filter(|_| page.more)?;
    Some(format!("</api/v1/{path}?limit={limit}&before={}{filters}>; rel=\"next\"", id(last)))
}

/// `page` as the API answers a list: its rows as a JSON array, with the `Link` header of
/// [`next_link`] while more rows follow.
pub fn respond<T: Serialize>(
    page: Page<T>,
    id: impl Fn(&T) -> Uuid,
    path: &str,
    limit: u32,
    filters: &str,
) -> Result<Response> {
    let next = next_link(&page, id, path, limit, filters);
    let mut response = ApiJson(page.rows).into_response();
    if let Some(next) = next {
        let value = HeaderValue::from_str(&next).map_err(|_| Error::Invariant("a next-page link is printable ASCII"))?;
        response.headers_mut().insert(header::LINK, value);
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u128) -> Vec<Uuid> {
        (1..=n).map(Uuid::from_u128).collect()
    }

    #[test]
    fn a_limit_defaults_to_the_most_and_is_refused_outside_one_to_the_most() {
        assert_eq!(limit(None).unwrap(), MAX_LIMIT);
        assert_eq!(limit(Some(1)).unwrap(), 1);
        assert_eq!(limit(Some(MAX_LIMIT)).unwrap(), MAX_LIMIT);
        for asked in [0, MAX_LIMIT + 1] {
            let error = limit(Some(asked)).unwrap_err();
            assert!(matches!(&error, Error::BadRequest(m) if m == "limit must be 1 to 500."), "{error:?}");
        }
    }

    #[tokio::test]
    async fn a_read_asks_for_one_row_more_and_keeps_limit_rows() {
        let page = read("model", 3, |n| async move { Ok(Some(ids(n as u128))) }).await.unwrap();
        assert_eq!((page.rows, page.more), (ids(3), true));
        let page = read("model", 3, |_| async { Ok(Some(ids(3))) }).await.unwrap();
        assert_eq!((page.rows, page.more), (ids(3), false));
    }

    #[tokio::test]
    async fn a_before_that_names_nothing_visible_is_a_400_naming_the_rows() {
        let error = read::<Uuid, _>("dataset", 3, |_| async { Ok(None) }).await.unwrap_err();
        let Error::BadRequest(message) = error else { panic!("{error:?}") };
        assert!(message.starts_with("before names no dataset you can see"), "{message}");
    }

    #[test]
    fn the_next_link_carries_the_limit_the_last_id_and_the_filters_and_the_last_page_has_none() {
        let page = Page { rows: ids(2), more: true };
        let link = next_link(&page, |id| *id, "jobs", 2, "&state=queued").unwrap();
        assert_eq!(link, format!("</api/v1/jobs?limit=2&before={}&state=queued>; rel=\"next\"", Uuid::from_u128(2)));
        assert_eq!(next_link(&Page { rows: ids(2), more: false }, |id| *id, "jobs", 2, ""), None);
        assert_eq!(next_link(&Page { rows: Vec::<Uuid>::new(), more: true }, |id| *id, "jobs", 2, ""), None);
    }
}
