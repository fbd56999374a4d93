//! `sluice sim`: a vLLM-compatible replica without a GPU.
//!
//! Two modes behind the same HTTP surface. The engine model (`--profile`, the
//! default) batches requests like vLLM's scheduler over a paged KV cache with
//! an automatic prefix cache (`engine.rs`, `kv.rs`, `profile.rs`), so latency,
//! queueing, KV pressure and prefix hits respond to load as a real replica's
//! do. The fixed-timing mode (`--profile fixed`) gives every request the same
//! first-token delay and token gap regardless of load, for overhead
//! benchmarks. Handlers hand a request to either and stream what its
//! [`slot::Slot`] reports, in the request's protocol: OpenAI chat and
//! completions, Anthropic Messages or OpenAI Responses (`protocols.rs`,
//! which also keeps this replica's stored responses).

mod dcgm;
pub mod disagg;
pub(crate) mod engine;
pub mod faults;
mod fixed;
mod generation;
pub(crate) mod kv;
pub(crate) mod metrics;
pub(crate) mod profile;
mod protocols;
#[cfg(test)]
mod scheduling_tests;
mod slot;
mod stream;
pub(crate) mod text;

use std::net::SocketAddr;
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::time::Instant;

use engine::Engine;
use faults::Faults;
use generation::{Api, Generation};
pub use metrics::{Dialect, SimMetrics};
use profile::Profile;
pub use profile::{CacheAt, SchedulingPolicy};
use slot::Slot;
use stream::{Keep, SimStream};

use crate::telemetry::registry::Gauge;

#[derive(Debug, Clone)]
pub struct SimConfig {
    pub model: String,
    /// The engine model's profile; `None` is the fixed-timing mode.
    pub profile: Option<Profile>,
    /// Engine time runs this many times faster than the profile says.
    pub speed: f64,
    /// Fixed mode: time to the first token.
    pub prefill_delay: Duration,
    /// Fixed mode: time between two tokens.
    pub token_delay: Duration,
    /// Tokens generated when the request sets no `max_tokens` (or a larger one).
    pub output_tokens: u32,
    /// Faults applied to a `fault_rate` share of requests.
    pub faults: Faults,
    pub fault_rate: f64,
    pub dialect: Dialect,
    /// Prefill/decode disaggregation (`disagg.rs`): this replica's role, how
    /// long KV handed to a decode replica is kept, and the bandwidth a KV
    /// transfer runs at (bytes per second).
    pub role: disagg::Role,
    pub kv_ttl: Duration,
    pub kv_bandwidth: f64,
    /// Serve HTTPS (`--tls-cert`): an `https://` replica.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            model: "sim-model".into(),
            profile: None,
            speed: 1.0,
            prefill_delay: Duration::from_millis(50),
            token_delay: Duration::from_millis(20),
            output_tokens: 64,
            faults: Faults::default(),
            fault_rate: 1.0,
            dialect: Dialect::Vllm,
            role: disagg::Role::Mixed,
            kv_ttl: Duration::from_secs(30),
            // 25 GB/s: an RDMA NIC of 200 Gb/s.
            kv_bandwidth: 25e9,
            tls: None,
        }
    }
}

impl SimConfig {
    /// The engine model with a named profile (see `profile::PROFILES`).
    pub fn engine(profile: &str, speed: f64) -> Option<Self> {
        Some(Self {
            profile: Some(*profile::by_name(profile)?),
            speed,
            ..Self::default()
        })
    }

    fn max_model_len(&self) -> u32 {
        self.profile.map_or(131_072, |p| p.max_model_len)
    }
}

pub struct SimState {
    pub config: SimConfig,
    pub metrics: Arc<SimMetrics>,
    /// Names this replica in every answer's `system_fingerprint`
    /// (`sim-ADDR`), so a client can tell which replica served it.
    fingerprint: Arc<str>,
    engine: Option<Arc<Engine>>,
    /// What `/sim/control` changed at run time (faults, reported pressure).
    control: Mutex<Control>,
    /// Headers and body of the latest request, for tests (`GET /sim/last_request`).
    last_request: Mutex<Option<Value>>,
    /// Responses kept in this replica's memory (`store`, as vLLM does).
    responses: protocols::ResponseStore,
    /// Where it listens (named in the KV transfer parameters it hands out).
    addr: SocketAddr,
    /// KV prefilled here for decode replicas to pull.
    transfers: disagg::Transfers,
}

impl SimState {
    fn cache_info(&self) -> metrics::CacheInfo {
        let p = self.config.profile;
        metrics::CacheInfo {
            block_size: p.map_or(16, |p| p.block_size),
            num_blocks: p.map_or(0, |p| p.num_blocks),
            swap_blocks: p.map_or(0, |p| p.swap_blocks),
            prefix_caching: p.is_none_or(|p| p.prefix_caching),
        }
    }

    /// Hand a request to the engine (or the fixed clock), after `delay` (the
    /// slow-first-token fault: the replica holds the request before starting).
    /// Start `req`, after `delay` where one is given: a decode leg's KV
    /// transfer (`pulling`: counted as pulling until it starts) or a fault's
    /// first-token delay (counted as held).
    fn submit(
        self: &Arc<Self>,
        req: slot::Request,
        delay: Option<Duration>,
        pulling: Option<Counted>,
    ) -> Arc<Slot> {
        let slot = Arc::new(Slot::default());
        let Some(delay) = delay else {
            drop(pulling);
            self.start(req, slot.clone());
            return slot;
        };
        let (sim, out) = (self.clone(), slot.clone());
        let held = pulling.is_none().then(|| Counted::held(&self.metrics));
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = slot.cancelled() => {}
            }
            drop((held, pulling));
            if slot.is_cancelled() {
                sim.metrics.finished("abort");
            } else {
                sim.start(req, slot);
            }
        });
        out
    }

    fn start(&self, req: slot::Request, slot: Arc<Slot>) {
        match &self.engine {
            Some(e) => e.submit(req, slot),
            None => {
                let first_at = Instant::now() + self.config.prefill_delay;
                let (delay, m) = (self.config.token_delay, self.metrics.clone());
                fixed::spawn(req, slot, first_at, delay, m);
            }
        }
    }
}

/// A request counted on one of the simulator's gauges until dropped: a
/// decode leg among those pulling their KV, a request held before the
/// engine.
pub(crate) struct Counted(Arc<SimMetrics>, fn(&SimMetrics) -> &Gauge);

impl Counted {
    fn new(m: &Arc<SimMetrics>, gauge: fn(&SimMetrics) -> &Gauge) -> Self {
        gauge(m).inc();
        Self(m.clone(), gauge)
    }

    fn pulling(m: &Arc<SimMetrics>) -> Self {
        Self::new(m, |m| &m.pulling)
    }

    fn held(m: &Arc<SimMetrics>) -> Self {
        Self::new(m, |m| &m.held)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        (self.1)(&self.0).dec();
    }
}

/// A running simulator.
pub struct SimHandle {
    pub addr: SocketAddr,
    pub state: Arc<SimState>,
    task: tokio::task::JoinHandle<()>,
    engine_task: Option<tokio::task::JoinHandle<()>>,
}

impl SimHandle {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn stop(&self) {
        self.task.abort();
        if let Some(t) = &self.engine_task {
            t.abort();
        }
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

pub async fn start(listener: TcpListener, config: SimConfig) -> std::io::Result<SimHandle> {
    let addr = listener.local_addr()?;
    let metrics = Arc::new(SimMetrics::new());
    let (engine, engine_task) = match config.profile {
        Some(p) => {
            let (e, t) = Engine::spawn(p, config.speed, metrics.clone());
            (Some(e), Some(t))
        }
        None => (None, None),
    };
    let control = Control {
        faults: config.faults.clone(),
        fault_rate: config.fault_rate,
        ..Control::default()
    };
    let state = Arc::new(SimState {
        config,
        metrics,
        fingerprint: Arc::from(format!("sim-{addr}")),
        engine,
        control: Mutex::new(control),
        last_request: Mutex::new(None),
        responses: protocols::ResponseStore::default(),
        addr,
        transfers: disagg::Transfers::default(),
    });
    let app = router(state.clone());
    let counted = state.clone();
    let tls = state.config.tls.clone();
    let task = tokio::spawn(async move {
        use axum::serve::ListenerExt;
        let listener = listener.tap_io(move |tcp| {
            counted.metrics.connections.inc();
            let _ = tcp.set_nodelay(true);
        });
        match tls {
            None => {
                let _ = axum::serve(listener, app).await;
            }
            Some(tls) => {
                let listener = TlsListener {
                    inner: listener,
                    acceptor: tokio_rustls::TlsAcceptor::from(tls),
                };
                let _ = axum::serve(listener, app).await;
            }
        }
    });
    Ok(SimHandle {
        addr,
        state,
        task,
        engine_task,
    })
}

pub(crate) fn router(state: Arc<SimState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/responses", post(responses_create))
        .route(
            "/v1/responses/{id}",
            get(response_get).delete(response_delete),
        )
        .route("/v1/responses/{id}/cancel", post(response_cancel))
        .route("/v1/responses/{id}/input_items", get(response_input_items))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .route("/dcgm/metrics", get(dcgm_metrics))
        .route("/sim/last_request", get(last_request))
        .route("/sim/control", get(get_control).put(put_control))
        .route("/sim/reset", post(reset))
        .route("/sim/kv/pull", post(disagg::pull_handler))
        .with_state(state)
}

pub(super) fn vllm_error(status: StatusCode, message: &str) -> Response {
    // vLLM's error body shape (flat, `object: "error"`).
    let body = json!({
        "object": "error",
        "message": message,
        "type": status.canonical_reason().unwrap_or("Error").replace(' ', ""),
        "param": null,
        "code": status.as_u16(),
    });
    (status, axum::Json(body)).into_response()
}

async fn models(State(s): State<Arc<SimState>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": s.config.model,
            "object": "model",
            "created": 0,
            "owned_by": "sluice-sim",
            "max_model_len": s.config.max_model_len(),
        }]
    }))
    .into_response()
}

async fn metrics(State(s): State<Arc<SimState>>) -> Response {
    let c = s.control();
    match c.metrics {
        MetricsMode::Ok => {}
        MetricsMode::Error => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        MetricsMode::Hang => return std::future::pending().await,
    }
    if c.preempting {
        s.metrics.preemptions.inc();
    }
    s.metrics.scrapes.inc();
    let text = s.metrics.render_with(
        s.config.dialect,
        &s.config.model,
        s.cache_info(),
        metrics::Overrides {
            kv_usage: c.kv_usage,
            waiting: c.waiting,
            deferred: c.deferred,
        },
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// `GET /dcgm/metrics`: the replica's GPUs as NVIDIA's dcgm-exporter shows
/// them (`dcgm.rs`). The fixed-timing mode has no engine steps: it counts as
/// fully busy while any request is in flight, on a GPU of the default profile.
async fn dcgm_metrics(State(s): State<Arc<SimState>>) -> Response {
    let now = Instant::now();
    let (profile, utilisation) = match s.config.profile {
        Some(p) => (p, s.metrics.busy.utilisation(now)),
        None => (
            profile::PROFILES[0],
            if s.metrics.running.get() > 0 {
                1.0
            } else {
                0.0
            },
        ),
    };
    let host = format!(
        "sluice-sim-{}",
        s.fingerprint.rsplit(':').next().unwrap_or("0")
    );
    let text = dcgm::render(&dcgm::Gpus {
        profile: &profile,
        kv_usage: s.metrics.kv_usage(),
        utilisation,
        host: &host,
    });
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// Run-time knobs of a simulated replica, for tests and demos of routing and
/// alerts: faults for all requests, and the pressure `/metrics` reports.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Control {
    /// Fault spec applied to a `fault_rate` share of requests ("" for none).
    #[serde(with = "fault_spec")]
    pub faults: Faults,
    pub fault_rate: f64,
    /// Report this KV-cache usage instead of the engine's.
    pub kv_usage: Option<f64>,
    /// Report this many waiting requests instead of the engine's.
    pub waiting: Option<f64>,
    /// Report this many requests waiting for something other than room
    /// instead of the decode legs pulling their KV (vLLM's
    /// `num_requests_waiting_by_reason{reason="deferred"}`, counted in its
    /// `num_requests_waiting` too; SGLang's `num_decode_transfer_queue_reqs`).
    pub deferred: Option<f64>,
    /// Count one more preemption at every `/metrics` read (an engine out of
    /// KV blocks, as its scrapes show it).
    pub preempting: bool,
    /// `ok`, `error` (500) or `hang` (never answers): a replica whose metrics go stale.
    pub metrics: MetricsMode,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MetricsMode {
    #[default]
    Ok,
    Error,
    Hang,
}

mod fault_spec {
    use super::Faults;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(f: &Faults, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&f.to_spec())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Faults, D::Error> {
        let spec = String::deserialize(d)?;
        Faults::parse(&spec).map_err(serde::de::Error::custom)
    }
}

impl SimState {
    pub fn control(&self) -> Control {
        self.control.lock().clone()
    }

    pub fn set_control(&self, c: Control) {
        *self.control.lock() = c;
    }
}

async fn get_control(State(s): State<Arc<SimState>>) -> Response {
    axum::Json(s.control()).into_response()
}

/// `PUT /sim/control` with a JSON `Control`; absent fields take their defaults.
async fn put_control(State(s): State<Arc<SimState>>, body: axum::body::Bytes) -> Response {
    match serde_json::from_slice::<Control>(&body) {
        Ok(c) => {
            s.set_control(c.clone());
            axum::Json(c).into_response()
        }
        Err(e) => vllm_error(StatusCode::BAD_REQUEST, &format!("bad control: {e}")),
    }
}

/// `POST /sim/reset`: the engine restarted by an operator (after a drain):
/// the KV blocks leaked by the `leak` fault are free again. Answers
/// `{"freed_blocks": N}` once they are.
async fn reset(State(s): State<Arc<SimState>>) -> Response {
    let freed = match &s.engine {
        Some(e) => e.reset().await,
        None => 0,
    };
    axum::Json(json!({ "freed_blocks": freed })).into_response()
}

async fn last_request(State(s): State<Arc<SimState>>) -> Response {
    let v = s.last_request.lock().clone();
    axum::Json(v.unwrap_or(Value::Null)).into_response()
}

async fn chat(State(s): State<Arc<SimState>>, req: Request) -> Response {
    generate(s, Api::Chat, req).await
}

async fn completions(State(s): State<Arc<SimState>>, req: Request) -> Response {
    generate(s, Api::Completions, req).await
}

async fn messages(State(s): State<Arc<SimState>>, req: Request) -> Response {
    generate(s, Api::Messages, req).await
}

async fn responses_create(State(s): State<Arc<SimState>>, req: Request) -> Response {
    generate(s, Api::Responses, req).await
}

/// Anthropic `count_tokens`: the prompt's tokens, as a generation would count them.
async fn count_tokens(State(s): State<Arc<SimState>>, req: Request) -> Response {
    let (body, _) = match intake(&s, Api::Messages, req).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let turns = protocols::messages_turns(&body);
    let n = crate::tokens::estimate_messages(turns.iter().map(|(_, t)| t.as_str())).max(1);
    axum::Json(json!({"input_tokens": n})).into_response()
}

fn unknown_response(id: &str) -> Response {
    protocols::openai_error(
        StatusCode::NOT_FOUND,
        &format!("Response with id '{id}' not found."),
        Some("response_id"),
        "response_not_found",
    )
}

async fn response_get(
    State(s): State<Arc<SimState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    match s.responses.object(&id) {
        Some(o) => axum::Json(o).into_response(),
        None => unknown_response(&id),
    }
}

async fn response_delete(
    State(s): State<Arc<SimState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if s.responses.delete(&id) {
        axum::Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
    } else {
        unknown_response(&id)
    }
}

/// Responses here finish before they could be cancelled: the stored object.
async fn response_cancel(
    State(s): State<Arc<SimState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    response_get(State(s), axum::extract::Path(id)).await
}

async fn response_input_items(
    State(s): State<Arc<SimState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    let Some(items) = s.responses.input_items(&id) else {
        return unknown_response(&id);
    };
    let ids: Vec<Value> = items
        .iter()
        .map(|i| i.get("id").cloned().unwrap_or(Value::Null))
        .collect();
    axum::Json(json!({
        "object": "list", "data": items, "has_more": false,
        "first_id": ids.first().cloned().unwrap_or(Value::Null),
        "last_id": ids.last().cloned().unwrap_or(Value::Null),
    }))
    .into_response()
}

/// An error in `api`'s shape.
fn api_error(api: Api, status: StatusCode, message: &str) -> Response {
    match api {
        Api::Messages => protocols::anthropic_error(status, message),
        Api::Responses => {
            let code = if status.is_server_error() {
                "server_error"
            } else {
                "invalid_request"
            };
            protocols::openai_error(status, message, None, code)
        }
        _ => vllm_error(status, message),
    }
}

/// Read the body and the faults that apply to this request.
async fn intake(s: &SimState, api: Api, req: Request) -> Result<(Value, Faults), Response> {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, 64 << 20)
        .await
        .map_err(|_| api_error(api, StatusCode::BAD_REQUEST, "cannot read body"))?;
    let body: Value = serde_json::from_slice(&bytes)
        .map_err(|e| api_error(api, StatusCode::BAD_REQUEST, &format!("invalid JSON: {e}")))?;
    remember(s, &parts.headers, &body);
    s.metrics.received.inc();
    let faults = match parts
        .headers
        .get(faults::HEADER)
        .and_then(|v| v.to_str().ok())
    {
        Some(spec) => {
            Faults::parse(spec).map_err(|e| api_error(api, StatusCode::BAD_REQUEST, &e))?
        }
        None => {
            let c = s.control();
            if !c.faults.is_empty() && fastrand::f64() < c.fault_rate {
                c.faults
            } else {
                Faults::default()
            }
        }
    };
    if let Some(code) = faults.error {
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return Err(api_error(api, status, "simulated error"));
    }
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if model != s.config.model {
        return Err(api_error(
            api,
            StatusCode::NOT_FOUND,
            &format!("The model `{model}` does not exist."),
        ));
    }
    Ok((body, faults))
}

fn remember(s: &SimState, headers: &HeaderMap, body: &Value) {
    let headers: serde_json::Map<String, Value> = headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                Value::String(v.to_str().unwrap_or_default().to_string()),
            )
        })
        .collect();
    *s.last_request.lock() = Some(json!({ "headers": headers, "body": body }));
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn generate(s: Arc<SimState>, api: Api, req: Request) -> Response {
    let arrival = Instant::now();
    let (body, faults) = match intake(&s, api, req).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    // The prompt: chat messages or completion prompts, or the protocols' turns.
    let turns = match api {
        Api::Chat | Api::Completions => None,
        Api::Messages => Some(protocols::messages_turns(&body)),
        Api::Responses => match protocols::responses_turns(&body, &s.responses) {
            Ok(t) => Some(t),
            Err(prev) => {
                return protocols::openai_error(
                    StatusCode::NOT_FOUND,
                    &format!("Response with id '{prev}' not found."),
                    Some("previous_response_id"),
                    "response_not_found",
                );
            }
        },
    };
    let prompt_tokens = match (&turns, api) {
        (Some(t), _) => crate::tokens::estimate_messages(t.iter().map(|(_, x)| x.as_str())),
        (None, Api::Completions) => text::prompt_texts(&body)
            .iter()
            .map(|t| crate::tokens::estimate(t))
            .sum(),
        (None, _) => {
            crate::tokens::estimate_messages(text::prompt_texts(&body).iter().map(String::as_str))
        }
    }
    .max(1);
    let field = |name: &str| {
        body.get(name)
            .and_then(Value::as_u64)
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
    };
    let max_tokens = match api {
        Api::Messages => match field("max_tokens") {
            Some(m) => Some(m),
            None => {
                return api_error(api, StatusCode::BAD_REQUEST, "max_tokens: Field required");
            }
        },
        Api::Responses => field("max_output_tokens"),
        _ => field("max_completion_tokens").or_else(|| field("max_tokens")),
    };
    let natural = s.config.output_tokens.max(1);
    let (output_tokens, finish_reason) = match max_tokens {
        Some(m) if m < natural => (m.max(1), "length"),
        _ => (natural, "stop"),
    };
    let limit = s.config.max_model_len();
    if prompt_tokens.saturating_add(output_tokens) > limit {
        // vLLM's wording for the same refusal.
        return api_error(
            api,
            StatusCode::BAD_REQUEST,
            &format!(
                "This model's maximum context length is {limit} tokens. However, you requested \
                 {} tokens ({prompt_tokens} in the messages, {output_tokens} in the completion). \
                 Please reduce the length of the messages or completion.",
                prompt_tokens + output_tokens
            ),
        );
    }
    // A prompt longer than the whole KV cache can hold could never be
    // scheduled: refused here, in the protocol's shape, where the engine
    // would otherwise drop it with an empty answer. (vLLM refuses to start
    // with a `max_model_len` its KV cache cannot hold, so there the same
    // prompt meets the context-length refusal above.)
    let cache = s.cache_info();
    let cache_tokens = cache.num_blocks.saturating_mul(cache.block_size);
    if s.engine.is_some() && prompt_tokens.saturating_add(1) > cache_tokens {
        return api_error(
            api,
            StatusCode::BAD_REQUEST,
            &format!(
                "The prompt ({prompt_tokens} tokens) is longer than this replica's KV cache \
                 can hold ({cache_tokens} tokens). Please reduce the length of the messages."
            ),
        );
    }
    // Prefill/decode disaggregation: which leg this is, and for a decode
    // leg its prompt's KV, pulled before it starts.
    let leg = match disagg::leg(&body, s.config.role) {
        Ok(l) => l,
        Err(resp) => return resp,
    };
    let (output_tokens, finish_reason) = match leg {
        // SGLang's prefill leg computes the prompt and one token.
        disagg::Leg::SglangPrefill { .. } => (1, "length"),
        _ => (output_tokens, finish_reason),
    };
    // A decode leg waits for its KV from here until it reaches the engine
    // (for its room's prefill under SGLang's protocol, then its transfer).
    let pulling = leg.pulls().then(|| Counted::pulling(&s.metrics));
    let remote_tokens = match disagg::pull(&s, &leg).await {
        Ok(n) => n.min(prompt_tokens),
        Err(resp) => return resp,
    };
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = body
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let prefix = match api {
        Api::Chat => "chatcmpl-",
        Api::Completions => "cmpl-",
        Api::Messages => "msg_",
        Api::Responses => "resp_",
    };
    // The same conversation gives the same canonical text in every protocol,
    // so the prefix cache is shared across them.
    let canonical = match &turns {
        Some(t) => t
            .iter()
            .map(|(role, text)| format!("{role}\n{text}\n"))
            .collect(),
        None => text::canonical_prompt(&body),
    };
    let hashes = match s.config.profile {
        Some(p) => kv::block_hashes(&s.config.model, &canonical, p.block_size),
        None => Vec::new(),
    };
    let text_field = |name: &str| body.get(name).and_then(Value::as_str).map(str::to_string);
    let generation = Generation {
        api,
        id: format!("{prefix}{:016x}", fastrand::u64(..)),
        created: unix_now(),
        model: Arc::from(s.config.model.as_str()),
        seed: text::seed_of(canonical.as_bytes()),
        prompt_tokens,
        output_tokens,
        finish_reason,
        include_usage,
        fingerprint: s.fingerprint.clone(),
        instructions: text_field("instructions"),
        previous_response_id: text_field("previous_response_id"),
        max_output_tokens: field("max_output_tokens"),
    };
    // A Responses answer is kept (unless `store: false`), with what it was asked.
    let keep = match (&turns, api) {
        (Some(t), Api::Responses) if body.get("store") != Some(&Value::Bool(false)) => Some(Keep {
            store: s.clone(),
            turns: protocols::carried(t, &body),
            items: protocols::input_items(&body),
        }),
        _ => None,
    };
    if let disagg::Leg::SglangPrefill { room } = leg {
        s.transfers.open_room(room, s.config.kv_ttl);
    }
    // A pulled prompt's KV arrives after its transfer time, as a request
    // held before it starts. Over vLLM's connectors (NIXL, Mooncake) the
    // decode replica pulls only what its own prefix cache lacks (the prompt
    // less the tokens it has computed); SGLang's decode side takes the
    // whole prompt's KV from its room.
    let pulled = match (&leg, &s.engine) {
        (disagg::Leg::VllmDecode { .. }, Some(e)) => {
            remote_tokens.saturating_sub(e.cached_tokens(&hashes, prompt_tokens))
        }
        _ => remote_tokens,
    };
    s.metrics.kv_pulled_tokens.add(u64::from(pulled));
    // (A leg that pulls nothing is no longer waiting for its KV.)
    let pulling = pulling.filter(|_| pulled > 0);
    let hold = match (pulled, faults.first_token) {
        (0, f) => f,
        (n, f) => Some(disagg::transfer_time(&s, n) + f.unwrap_or_default()),
    };
    let slot = s.submit(
        slot::Request {
            prompt_tokens,
            hashes,
            output_tokens,
            finish_reason,
            arrival,
            stall: faults.stall,
            leak: faults.leak,
            remote_tokens,
            priority: body.get("priority").and_then(Value::as_i64).unwrap_or(0),
        },
        hold,
        pulling,
    );
    if let disagg::Leg::SglangPrefill { room } = leg {
        // The room is ready once the prompt is computed (its one token out).
        let (sim, done) = (s.clone(), slot.clone());
        let ttl = s.config.kv_ttl;
        tokio::spawn(async move {
            // Bounded: a cancelled request may never finish.
            // Its token out: the prompt was computed (a request cut short
            // before it produced nothing; the handler cancels the slot as it
            // returns either way).
            if tokio::time::timeout(ttl, done.finished()).await.is_ok() && done.produced() > 0 {
                sim.transfers.fill_room(room, prompt_tokens);
            }
        });
    }
    // vLLM's prefill leg answers with the parameters a decode replica pulls
    // its KV with, when it stopped at its one-token limit.
    let offer = matches!(leg, disagg::Leg::VllmPrefill).then(|| (s.clone(), prompt_tokens));
    if stream {
        let body = SimStream::new(generation, faults, slot, keep);
        return Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::new(body))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    non_streamed(generation, slot, keep, offer).await
}

/// Cancels the request in the engine if the handler is dropped (client gone).
struct CancelOnDrop(Arc<Slot>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

async fn non_streamed(
    g: Generation,
    slot: Arc<Slot>,
    keep: Option<Keep>,
    offer: Option<(Arc<SimState>, u32)>,
) -> Response {
    let guard = CancelOnDrop(slot);
    std::future::poll_fn(|cx| {
        if guard.0.is_done() {
            return std::task::Poll::Ready(());
        }
        guard.0.register(cx.waker());
        if guard.0.is_done() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    let text: String = (0..g.output_tokens)
        .map(|i| text::word(g.seed, i))
        .collect();
    let usage = json!({
        "prompt_tokens": g.prompt_tokens,
        "completion_tokens": g.output_tokens,
        "total_tokens": g.prompt_tokens + g.output_tokens,
        "prompt_tokens_details": {"cached_tokens": guard.0.cached()},
    });
    let mut body = match g.api {
        Api::Chat => json!({
            "id": g.id, "object": "chat.completion", "created": g.created, "model": &*g.model,
            "system_fingerprint": &*g.fingerprint,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": null, "finish_reason": g.finish_reason}],
            "usage": usage,
        }),
        Api::Completions => json!({
            "id": g.id, "object": "text_completion", "created": g.created, "model": &*g.model,
            "system_fingerprint": &*g.fingerprint,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": g.finish_reason}],
            "usage": usage,
        }),
        Api::Messages => protocols::messages_whole(&g, &text, guard.0.cached()),
        Api::Responses => {
            let obj = protocols::response_object(&g, Some(&text), guard.0.cached());
            if let Some(k) = keep {
                k.store.responses.put(obj.clone(), k.turns, k.items);
            }
            obj
        }
    };
    if let Some((s, prompt_tokens)) = offer
        && g.finish_reason == "length"
        && let Some(o) = body.as_object_mut()
    {
        o.insert(
            "kv_transfer_params".into(),
            disagg::offer(&s, &g.id, prompt_tokens),
        );
    }
    axum::Json(body).into_response()
}

async fn embeddings(State(s): State<Arc<SimState>>, req: Request) -> Response {
    let (body, _faults) = match intake(&s, Api::Completions, req).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let inputs = text::prompt_texts(&body);
    let prompt_tokens: u32 = inputs.iter().map(|t| crate::tokens::estimate(t)).sum();
    s.metrics.prompt_tokens.add(u64::from(prompt_tokens));
    tokio::time::sleep(s.config.prefill_delay).await;
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let seed = text::seed_of(t.as_bytes());
            let v: Vec<f64> = (0..8)
                .map(|k| (text::mix(seed ^ k) % 2000) as f64 / 1000.0 - 1.0)
                .collect();
            json!({"object": "embedding", "index": i, "embedding": v})
        })
        .collect();
    s.metrics.finished("stop");
    axum::Json(json!({
        "object": "list",
        "data": data,
        "model": s.config.model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }))
    .into_response()
}

/// The simulator's HTTPS listener: each accepted connection's handshake
/// runs before the next accept (a test replica, not a server for the
/// public); a failed one is logged with rustls's reason and dropped.
struct TlsListener<L> {
    inner: L,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl<L> axum::serve::Listener for TlsListener<L>
where
    L: axum::serve::Listener<Io = tokio::net::TcpStream>,
    L::Addr: std::fmt::Debug,
{
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (tcp, addr) = self.inner.accept().await;
            let shake = self.acceptor.accept(tcp);
            match tokio::time::timeout(Duration::from_secs(10), shake).await {
                Ok(Ok(tls)) => return (tls, addr),
                Ok(Err(e)) => tracing::warn!(
                    peer = ?addr,
                    error = %e,
                    "TLS handshake with a client failed"
                ),
                Err(_) => tracing::warn!(peer = ?addr, "TLS handshake timed out"),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}
