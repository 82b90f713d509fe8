//! The links under a dashboard list that pages by keyset as the API does (`before` the
//! last row shown), so an older page stays put while new rows arrive: the jobs, models
//! and datasets lists. `templates/pager.html` draws them.

use uuid::Uuid;

use crate::error::{Error, Result};
use crate::paging::Page;

/// Rows a page of a dashboard list shows.
pub const PAGE_SIZE: u32 = 100;

/// Where a list's pages are: its path and the filter every page of it keeps (`state=queued`,
/// or empty).
pub struct PageUrl<'a> {
    pub path: &'static str,
    pub filter: &'a str,
}

impl PageUrl<'_> {
    /// The page after `before` (the first page for `None`), with the `extra` parameters
    /// (`fragment=table`, or empty).
    pub fn at(&self, before: Option<Uuid>, extra: &str) -> String {
        let before = before.map(|id| format!("before={id}"));
        let params: Vec<&str> =
            before.as_deref().into_iter().chain([extra, self.filter]).filter(|p| !p.is_empty()).collect();
        if params.is_empty() {
            self.path.to_string()
        } else {
            format!("{}?{}", self.path, params.join("&"))
        }
    }
}

/// The links to the pages around one.
pub struct Pager {
    /// Back to the newest rows, when this is an older page.
    pub newest: Option<String>,
    /// The next older page, when more rows follow.
    pub older: Option<String>,
    /// What the list holds, one of them ("job"): the links say "Older jobs".
    pub noun: &'static str,
}

impl Pager {
    /// The links around `page` of `url`'s list, the page after `before`; `id` tells a
    /// row's id.
    pub fn new<T>(
        url: &PageUrl,
        before: Option<Uuid>,
        page: &Page<T>,
        id: impl Fn(&T) -> Uuid,
        noun: &'static str,
    ) -> Pager {
        Pager {
            newest: before.map(|_| url.at(None, "")),
            older: page.rows.last().filter(|_| page.more).map(|last| url.at(Some(id(last)), "")),
            noun,
        }
    }
}

/// The `before` of a list page's address (none when absent or empty); 400 when it is not
/// an id, `noun` naming what the list holds.
pub fn before(text: Option<&str>, noun: &str) -> Result<Option<Uuid>> {
    match text {
        None | Some("") => Ok(None),
        Some(text) => text.parse().map(Some).map_err(|_| {
            Error::BadRequest(format!("before={text:?} is not a {noun} id; follow the page's Older {noun}s link."))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_addresses_keep_the_filter_after_before_and_the_extra_parameters() {
        let id = Uuid::from_u128(7);
        let jobs = PageUrl { path: "/jobs", filter: "state=queued" };
        assert_eq!(jobs.at(None, ""), "/jobs?state=queued");
        assert_eq!(jobs.at(Some(id), "fragment=table"), format!("/jobs?before={id}&fragment=table&state=queued"));
        let models = PageUrl { path: "/models", filter: "" };
        assert_eq!(models.at(None, ""), "/models");
        assert_eq!(models.at(None, "fragment=table"), "/models?fragment=table");
        assert_eq!(models.at(Some(id), ""), format!("/models?before={id}"));
    }

    #[test]
    fn an_older_link_follows_a_page_with_more_and_a_newest_link_any_older_page() {
        let url = PageUrl { path: "/models", filter: "" };
        let (first, last) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let page = Page { rows: vec![first, last], more: true };
        let pager = Pager::new(&url, None, &page, |id| *id, "model");
        assert_eq!((pager.newest, pager.older), (None, Some(format!("/models?before={last}"))));
        let page = Page { rows: vec![first], more: false };
        let pager = Pager::new(&url, Some(last), &page, |id| *id, "model");
        assert_eq!((pager.newest, pager.older), (Some("/models".into()), None));
    }

    #[test]
    fn a_before_that_is_no_id_is_a_400_pointing_at_the_link() {
        assert_eq!(before(None, "job").unwrap(), None);
        assert_eq!(before(Some(""), "job").unwrap(), None);
        let id = Uuid::from_u128(3);
        assert_eq!(before(Some(&id.to_string()), "job").unwrap(), Some(id));
        let error = before(Some("last"), "model").unwrap_err();
        let Error::BadRequest(message) = error else { panic!("{error:?}") };
        assert_eq!(message, "before=\"last\" is not a model id; follow the page's Older models link.");
    }
}
