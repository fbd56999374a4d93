//! Thin HTTP handlers: the proxied API, the model list, and the admin endpoints.

pub(crate) mod admin;
pub(crate) mod disagg;
pub(crate) mod homes;
pub mod inbound;
pub(crate) mod models;
pub mod proxy;
pub(crate) mod request_id;
pub(crate) mod responses;
pub(crate) mod send;
pub(crate) mod session;

/// A request's method, target and headers, as the request path reads them:
/// the own HTTP/1.1 server's head as it came, or a map's fields (hyper's
/// server, the router).
#[derive(Debug)]
pub(crate) struct Head {
    pub(crate) method: http::Method,
    pub(crate) uri: http::Uri,
    pub(crate) headers: crate::headers::Fields,
}

impl Head {
    /// The head of a request from hyper's server or the router.
    pub(crate) fn of(parts: &http::request::Parts) -> Self {
        Self {
            method: parts.method.clone(),
            uri: parts.uri.clone(),
            headers: crate::headers::Fields::from_map(&parts.headers),
        }
    }
}
