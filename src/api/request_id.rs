//! The request id: taken from the client's `x-request-id` when sane, else
//! generated; set on every response (errors, 404s and 405s included) and sent
//! to the replica. The app's outermost layer assigns it.

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use http::{Extensions, HeaderMap, HeaderValue};

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

/// Assign the id, run `handler`, and answer with the id whatever the response
/// (the router's layer, and the routes served without the router).
pub(crate) async fn around<F>(mut req: Request, handler: impl FnOnce(Request) -> F) -> Response
where
    F: Future<Output = Response>,
{
    let id = request_id(req.headers());
    req.extensions_mut().insert(RequestId(id.clone()));
    let mut resp = handler(req).await;
    resp.headers_mut().insert(X_REQUEST_ID.clone(), id);
    resp
}

/// [`around`] for a handler that takes the id as an argument: the same
/// answer, without storing the id in the request's extensions (a map
/// allocated per request).
pub(crate) async fn given<F>(
    req: Request,
    handler: impl FnOnce(Request, HeaderValue) -> F,
) -> Response
where
    F: Future<Output = Response>,
{
    let id = request_id(req.headers());
    let mut resp = handler(req, id.clone()).await;
    resp.headers_mut().insert(X_REQUEST_ID.clone(), id);
    resp
}
