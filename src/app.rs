//! The gateway as a function: `build_app(state) -> Router`, no socket, so tests
//! can drive it in-process and the server binds it to listeners.

use std::sync::Arc;

use arc_swap::ArcSwap;
use axum::Router;
use axum::extract::{FromRequestParts, Request};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::request::Parts;

use crate::api::{admin, models, proxy};
use crate::config::Config;
use crate::error::GatewayError;
use crate::limits::Limiter;
use crate::routing::{self, RoutingPolicy};
use crate::telemetry::Telemetry;
use crate::telemetry::access_log::AccessLog;
use crate::telemetry::metrics::Metrics;
use crate::telemetry::record::Endpoint;
use crate::telemetry::traces::Traces;
use crate::upstream::client::{HttpClient, build_client};
use crate::upstream::pool::Pool;

/// Everything a request needs, shared by all handlers.
pub struct AppState {
    pub config: Arc<Config>,
    pub pool: Arc<Pool>,
    pub client: HttpClient,
    pub policy: Arc<dyn RoutingPolicy>,
    pub metrics: Arc<Metrics>,
    /// Metrics, traces and the access log, for finished requests.
    pub telemetry: Arc<Telemetry>,
    /// API keys and tier limits; `None` when the gateway is open.
    pub limiter: Option<Arc<Limiter>>,
    /// For the `created` field of `/v1/models`.
    pub started_unix: u64,
}

impl AppState {
    pub fn new(config: Config) -> anyhow::Result<Arc<Self>> {
        Self::build(config, None)
    }

    /// The state for `config`; on a reload, `previous` hands over what must
    /// outlive it: the metric registry, replicas that stay (connections,
    /// health, prefix index, in-flight counts), the rate-limit store when its
    /// settings are unchanged (counters and concurrency slots carry on), and
    /// the trace exporter when tracing is unchanged. The access log is opened
    /// again (a rotated file is picked up).
    pub fn build(config: Config, previous: Option<&AppState>) -> anyhow::Result<Arc<Self>> {
        let metrics = match previous {
            Some(p) => p.metrics.clone(),
            None => Arc::new(Metrics::new(&config.telemetry.buckets)),
        };
        let limiter = Limiter::from_config(
            &config,
            metrics.clone(),
            previous.and_then(|p| p.limiter.as_deref()),
        )?;
        let traces = match previous {
            Some(p) if same_tracing(&p.config, &config) => p.telemetry.traces.clone(),
            _ => Traces::start(&config.telemetry.tracing, &metrics)?,
        };
        let telemetry = Arc::new(Telemetry {
            metrics: metrics.clone(),
            traces,
            access_log: AccessLog::open(&config.telemetry.access_log)?,
        });
        let pool = Arc::new(Pool::new(
            &config,
            metrics.clone(),
            previous.map(|p| &*p.pool),
        ));
        // The client of health checks and scrapes, with its kept-alive
        // connections, unless its settings changed.
        let client = match previous {
            Some(p) if same_upstream(&p.config, &config) => p.client.clone(),
            _ => build_client(&config.upstream),
        };
        let policy = routing::build(&config.routing);
        let started_unix = previous.map_or_else(
            || {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0)
            },
            |p| p.started_unix,
        );
        Ok(Arc::new(Self {
            config: Arc::new(config),
            pool,
            client,
            policy,
            metrics,
            telemetry,
            limiter,
            started_unix,
        }))
    }
}

fn same_upstream(a: &Config, b: &Config) -> bool {
    let json = |c: &Config| serde_json::to_string(&c.upstream).ok();
    json(a).is_some() && json(a) == json(b)
}

fn same_tracing(a: &Config, b: &Config) -> bool {
    let json = |c: &Config| serde_json::to_string(&c.telemetry.tracing).ok();
    json(a).is_some() && json(a) == json(b)
}

/// The gateway's live state, swapped whole by a config reload. A request
/// loads it once and keeps that snapshot to its end, so a reload never
/// changes a request midway: its stream keeps its replica, its limits and
/// its telemetry.
pub struct Live {
    current: ArcSwap<AppState>,
}

impl Live {
    pub fn new(state: Arc<AppState>) -> Arc<Self> {
        Arc::new(Self {
            current: ArcSwap::new(state),
        })
    }

    pub fn load(&self) -> Arc<AppState> {
        self.current.load_full()
    }

    pub fn store(&self, state: Arc<AppState>) {
        self.current.store(state);
    }
}

/// Extractor: the state current when the request arrived.
pub struct Current(pub Arc<AppState>);

impl FromRequestParts<Arc<Live>> for Current {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(_: &mut Parts, live: &Arc<Live>) -> Result<Self, Self::Rejection> {
        Ok(Current(live.load()))
    }
}

async fn chat(Current(s): Current, req: Request) -> Response {
    proxy::handle(s, Endpoint::Chat, req).await
}

async fn completions(Current(s): Current, req: Request) -> Response {
    proxy::handle(s, Endpoint::Completions, req).await
}

async fn embeddings(Current(s): Current, req: Request) -> Response {
    proxy::handle(s, Endpoint::Embeddings, req).await
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

/// The public API. No middleware stack yet: each handler does its own body
/// limit (to answer 413 in the OpenAI shape) and no layer may buffer or time
/// out a stream as a whole.
pub fn build_app(state: Arc<Live>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models::list))
        // Other `/v1/*` routes: POSTs naming a model go through; any other
        // method there is an unknown URL (404), not a wrong method (405).
        .route("/v1/{*rest}", post(passthrough).fallback(proxy::not_found))
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(proxy::not_found)
        .with_state(state)
}

/// The admin listener: metrics, probes and introspection.
pub fn build_admin(state: Arc<Live>) -> Router {
    Router::new()
        .route("/metrics", get(admin::metrics))
        .route("/healthz", get(admin::healthz))
        .route("/readyz", get(admin::readyz))
        .route("/admin/backends", get(admin::backends))
        .route("/admin/config", get(admin::config))
        .fallback(|req: Request| async move { proxy::not_found(req).await.into_response() })
        .with_state(state)
}
