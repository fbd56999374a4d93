//! The request id: taken from the client's `x-request-id` when sane, else
//! generated; set on every response (errors, 404s and 405s included) and sent
//! to the replica. The app's outermost layer assigns it.

use axum::body::Body;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use http::{Extensions, HeaderMap, HeaderValue};

use super::Head;
use crate::upstream::client::{X_REQUEST_ID, request_id};

/// The id assigned to a request, in its extensions.
#[derive(Debug, Clone)]
pub(crate) struct RequestId(pub HeaderValue);

impl RequestId {
    /// The id of a request (assigned by [`layer`]; derived from the headers
    /// when the request did not pass through it).
    pub(crate) fn of(extensions: &Extensions, headers: &HeaderMap) -> HeaderValue {
        match extensions.get::<RequestId>() {
            Some(id) => id.0.clone(),
            None => request_id(headers),
        }
    }
}

/// Middleware: assign the id, and answer with it whatever the response.
pub(crate) async fn layer(req: Request, next: Next) -> Response {
    around(req, |req| next.run(req)).await
}

/// Assign the id, run `handler` with the id in the request's extensions, and
/// answer with the id whatever the response (the router's layer).
pub(crate) async fn around<F>(req: Request, handler: impl FnOnce(Request) -> F) -> Response
where
    F: Future<Output = Response>,
{
    let id = request_id(req.headers());
    let mut req = req;
    req.extensions_mut().insert(RequestId(id.clone()));
    // Awaited in place, as in `given`: a future passed to another async fn
    // would be held twice in this one (the argument, then the awaitee).
    let mut resp = handler(req).await;
    resp.headers_mut().insert(X_REQUEST_ID.clone(), id);
    resp
}

/// Assign the id, run `handler` with it as an argument, and answer with the
/// id whatever the response: the routes served without the router, which
/// skip the request's extensions (a map allocated per request). Every
/// response's `x-request-id` is set here (or by [`around`]), once.
///
/// The head is borrowed, as the handler borrows it: one copy of it lives in
/// the request's future instead of one per level (168 bytes each; the
/// future's size is what each request allocates and writes).
pub(crate) async fn given<'a, F>(
    head: &'a Head,
    body: Body,
    handler: impl FnOnce(&'a Head, Body, HeaderValue) -> F,
) -> Response
where
    F: Future<Output = Response>,
{
    let id = request_id(&head.headers);
    let mut resp = handler(head, body, id.clone()).await;
    resp.headers_mut().insert(X_REQUEST_ID.clone(), id);
    resp
}
