//! The gateway as functions of its state, no socket: `build_app` (the public
//! API's router), `Api` (the service the listener runs: the generation routes
//! directly, the router for the rest) and `build_admin`.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::api::{Head, admin, models, proxy, request_id, responses};
use crate::error::GatewayError;
use crate::state::{Current, Live};
use crate::vocab::Endpoint;

async fn chat(Current(s): Current, req: Request) -> Response {
    proxy::handle(s, Endpoint::Chat, req).await
}

async fn completions(Current(s): Current, req: Request) -> Response {
    proxy::handle(s, Endpoint::Completions, req).await
}

async fn embeddings(Current(s): Current, req: Request) -> Response {
    proxy::handle(s, Endpoint::Embeddings, req).await
}

async fn messages(Current(s): Current, req: Request) -> Response {
    proxy::handle(s, Endpoint::Messages, req).await
}

async fn count_tokens(Current(s): Current, req: Request) -> Response {
    proxy::handle(s, Endpoint::CountTokens, req).await
}

async fn responses_create(Current(s): Current, req: Request) -> Response {
    proxy::handle(s, Endpoint::Responses, req).await
}

async fn response_by_id(Current(s): Current, req: Request) -> Response {
    responses::by_id(s, req).await
}

async fn passthrough(Current(s): Current, req: Request) -> Response {
    proxy::handle(s, Endpoint::Passthrough, req).await
}

async fn method_not_allowed(req: Request) -> Response {
    let e = GatewayError::InvalidRequest(format!(
        "method {} is not allowed on {}",
        req.method(),
        req.uri().path()
    ));
    let mut r = e.into_response();
    *r.status_mut() = http::StatusCode::METHOD_NOT_ALLOWED;
    r
}

/// The public API. One layer, outermost: the request id, so that every
/// answer carries it (404s, 405s and errors too). Nothing else is a layer:
/// each handler does its own body limit (to answer 413 in the OpenAI shape)
/// and no layer may buffer or time out a stream as a whole.
pub(crate) fn build_app(state: Arc<Live>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/responses", post(responses_create))
        .route(
            "/v1/responses/{id}",
            get(response_by_id).delete(response_by_id),
        )
        .route("/v1/responses/{id}/cancel", post(response_by_id))
        .route("/v1/responses/{id}/input_items", get(response_by_id))
        .route("/v1/models", get(models::list))
        // Other `/v1/*` routes: POSTs naming a model go through; any other
        // method there is an unknown URL (404), not a wrong method (405).
        .route("/v1/{*rest}", post(passthrough).fallback(proxy::not_found))
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(proxy::not_found)
        .layer(axum::middleware::from_fn(request_id::layer))
        .with_state(state)
}

/// The `POST` routes served without the router: the generation endpoints
/// whose path is exactly theirs (the router maps the same paths to the same
/// handlers; `dispatch_agrees_with_the_router` checks it).
fn direct_route(method: &http::Method, path: &str) -> Option<Endpoint> {
    if method != http::Method::POST {
        return None;
    }
    Endpoint::of_path(path)
}

/// The public API as hyper's connection service. The generation endpoints go
/// straight to their handler with the request id the router's layer would
/// assign; everything else goes through [`build_app`]'s router.
///
/// Measured reason (docs/benchmarks-log.md, "The hot path at nginx's cost"): going
/// around the router, its `from_fn` layer and the tower adapters saved ~5,300
/// instructions per non-streamed request, 6% of the gateway's user-space work
/// on that path (callgrind; docs/bench/instructions_2026-11-25.txt).
#[derive(Clone)]
pub(crate) struct Api {
    live: Arc<Live>,
    router: Router,
}

impl Api {
    pub(crate) fn new(live: Arc<Live>) -> Self {
        Self {
            router: build_app(live.clone()),
            live,
        }
    }
}

/// A request's answer under way.
pub(crate) type Answer = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

impl Api {
    /// Answer one request from hyper's server.
    pub(crate) fn serve(&self, req: Request) -> Answer {
        match direct_route(req.method(), req.uri().path()) {
            Some(endpoint) => {
                let (parts, body) = req.into_parts();
                self.direct(endpoint, Head::of(&parts), body)
            }
            // The router is always ready (axum's `poll_ready` is `Ready(Ok)`).
            None => Box::pin(tower_service::Service::call(&mut self.router.clone(), req)),
        }
    }

    /// Answer one request from the gateway's own HTTP/1.1 server: its head
    /// as it came (`version` only matters to the router's handlers).
    pub(crate) fn serve_head(&self, head: Head, version: http::Version, body: Body) -> Answer {
        match direct_route(&head.method, head.uri.path()) {
            Some(endpoint) => self.direct(endpoint, head, body),
            None => {
                let mut req = Request::new(body);
                *req.method_mut() = head.method;
                *req.uri_mut() = head.uri;
                *req.version_mut() = version;
                *req.headers_mut() = head.headers.to_map();
                Box::pin(tower_service::Service::call(&mut self.router.clone(), req))
            }
        }
    }

    /// A generation route, without the router.
    fn direct(&self, endpoint: Endpoint, head: Head, body: Body) -> Answer {
        let state = self.live.load();
        Box::pin(async move {
            Ok(request_id::given(&head, body, |head, body, id| {
                proxy::handle_as(state, endpoint, head, body, id)
            })
            .await)
        })
    }
}

impl hyper::service::Service<Request<hyper::body::Incoming>> for Api {
    type Response = Response;
    type Error = Infallible;
    type Future = Answer;

    fn call(&self, req: Request<hyper::body::Incoming>) -> Answer {
        if let Some(code) = crate::headers::rfc9112(req.version(), req.headers()) {
            let resp = refused(&self.live, code);
            return Box::pin(std::future::ready(Ok(resp)));
        }
        self.serve(req.map(Body::new))
    }
}

/// The admin listener: metrics, probes and introspection.
pub(crate) fn build_admin(state: Arc<Live>) -> Router {
    Router::new()
        .route("/metrics", get(admin::metrics))
        .route("/healthz", get(admin::healthz))
        .route("/readyz", get(admin::readyz))
        .route("/admin/backends", get(admin::backends))
        .route("/admin/routing", get(admin::routing))
        .route("/admin/diagnose", get(admin::diagnose))
        .route("/admin/config", get(admin::config))
        .fallback(|req: Request| async move { proxy::not_found(req).await.into_response() })
        // The admin token (`server.admin_auth`), outermost: nothing but the
        // probes (and `/metrics` where opened) is read without it, not even
        // a 404.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            admin::require_token,
        ))
        .with_state(state)
}

/// The answer to a request [`crate::headers::rfc9112`] refuses, counted as a refused head
/// is; the connection closes after it.
fn refused(live: &Live, code: u16) -> axum::response::Response {
    let (_, message, kind) = crate::error::refusal(code);
    count_refused(live, code, kind);
    let body = crate::error::error_body(message, "invalid_request_error", None, Some(kind));
    let mut resp = axum::response::Response::new(axum::body::Body::from(body));
    *resp.status_mut() = http::StatusCode::from_u16(code).unwrap_or(http::StatusCode::BAD_REQUEST);
    let h = resp.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    h.insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    h.insert(
        "x-request-id",
        crate::upstream::client::request_id(&http::HeaderMap::new()),
    );
    resp
}

/// A request refused before any handler, counted as a request without a
/// model.
pub(crate) fn count_refused(live: &Live, code: u16, kind: &'static str) {
    let key = (
        Arc::from(""),
        "",
        Arc::from(""),
        crate::telemetry::metrics::StatusLabel(code),
        kind,
    );
    live.load().metrics.requests.get(&key).inc();
}
