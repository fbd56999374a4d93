//! `sluice sim`: a vLLM-compatible replica without a GPU.
//!
//! This is the fixed-timing mode: the first token after `prefill_delay`, then
//! one token every `token_delay`, with faults on cue. The engine model
//! (batching, KV cache, prefix cache) grows behind the same HTTP surface:
//! handlers ask [`SimState::schedule`] when tokens are due.

pub mod faults;
mod stream;
pub mod text;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
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

use crate::telemetry::registry::{Counter, Encoder, Family, Gauge, Kind};
use faults::Faults;
use stream::{Api, Generation, SimStream};

#[derive(Debug, Clone)]
pub struct SimConfig {
    pub model: String,
    /// Time to the first token.
    pub prefill_delay: Duration,
    /// Time between two tokens.
    pub token_delay: Duration,
    /// Tokens generated when the request sets no `max_tokens` (or a larger one).
    pub output_tokens: u32,
    /// Faults applied to a `fault_rate` share of requests.
    pub faults: Faults,
    pub fault_rate: f64,
    pub max_model_len: u32,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            model: "sim-model".into(),
            prefill_delay: Duration::from_millis(50),
            token_delay: Duration::from_millis(20),
            output_tokens: 64,
            faults: Faults::default(),
            fault_rate: 1.0,
            max_model_len: 8192,
        }
    }
}

/// Counters in vLLM's names, for `/metrics` and for tests to read.
pub struct SimMetrics {
    pub running: Gauge,
    pub waiting: Gauge,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub received: Counter,
    /// TCP connections accepted (keep-alive reuse shows as a small number).
    pub connections: Counter,
    finished: Family<(&'static str,), Counter>,
}

impl SimMetrics {
    fn new() -> Self {
        Self {
            running: Gauge::default(),
            waiting: Gauge::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            received: Counter::default(),
            connections: Counter::default(),
            finished: Family::new(&["finished_reason"], Counter::default),
        }
    }

    pub fn finished(&self, reason: &'static str) {
        self.finished.get(&(reason,)).inc();
    }

    pub fn finished_count(&self, reason: &'static str) -> u64 {
        self.finished.get(&(reason,)).get()
    }

    fn render(&self) -> String {
        let mut e = Encoder::new();
        e.single(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            Kind::Gauge,
            self.running.get() as f64,
        );
        e.single(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            Kind::Gauge,
            self.waiting.get() as f64,
        );
        e.single(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            Kind::Gauge,
            0.0,
        );
        e.single(
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            Kind::Counter,
            self.prompt_tokens.get() as f64,
        );
        e.single(
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            Kind::Counter,
            self.generation_tokens.get() as f64,
        );
        e.single(
            "sluice_sim_connections_total",
            "TCP connections the simulator accepted (not a vLLM metric).",
            Kind::Counter,
            self.connections.get() as f64,
        );
        e.counters(
            "vllm:request_success_total",
            "Count of finished requests, by finish reason (abort: the client went away).",
            &self.finished,
            |c| c,
        );
        e.out
    }
}

pub struct SimState {
    pub config: SimConfig,
    pub metrics: SimMetrics,
    /// Headers and body of the latest request, for tests (`GET /sim/last_request`).
    last_request: Mutex<Option<Value>>,
}

impl SimState {
    pub fn new(config: SimConfig) -> Arc<Self> {
        Arc::new(Self {
            config,
            metrics: SimMetrics::new(),
            last_request: Mutex::new(None),
        })
    }

    /// When the first token is due and the gap between tokens.
    fn schedule(&self, faults: &Faults) -> (Instant, Duration) {
        let first = self.config.prefill_delay + faults.first_token.unwrap_or_default();
        (Instant::now() + first, self.config.token_delay)
    }
}

/// A running simulator.
pub struct SimHandle {
    pub addr: SocketAddr,
    pub state: Arc<SimState>,
    task: tokio::task::JoinHandle<()>,
}

impl SimHandle {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn start(listener: TcpListener, config: SimConfig) -> std::io::Result<SimHandle> {
    let addr = listener.local_addr()?;
    let state = SimState::new(config);
    let app = router(state.clone());
    let counted = state.clone();
    let task = tokio::spawn(async move {
        use axum::serve::ListenerExt;
        let listener = listener.tap_io(move |tcp| {
            counted.metrics.connections.inc();
            let _ = tcp.set_nodelay(true);
        });
        let _ = axum::serve(listener, app).await;
    });
    Ok(SimHandle { addr, state, task })
}

pub fn router(state: Arc<SimState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .route("/sim/last_request", get(last_request))
        .with_state(state)
}

fn vllm_error(status: StatusCode, message: &str) -> Response {
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
            "max_model_len": s.config.max_model_len,
        }]
    }))
    .into_response()
}

async fn metrics(State(s): State<Arc<SimState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

async fn last_request(State(s): State<Arc<SimState>>) -> Response {
    let v = s.last_request.lock().map(|g| g.clone()).unwrap_or_default();
    axum::Json(v.unwrap_or(Value::Null)).into_response()
}

async fn chat(State(s): State<Arc<SimState>>, req: Request) -> Response {
    generate(s, Api::Chat, req).await
}

async fn completions(State(s): State<Arc<SimState>>, req: Request) -> Response {
    generate(s, Api::Completions, req).await
}

/// Read the body and the faults that apply to this request.
async fn intake(s: &SimState, req: Request) -> Result<(Value, Faults), Response> {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, 64 << 20)
        .await
        .map_err(|_| vllm_error(StatusCode::BAD_REQUEST, "cannot read body"))?;
    let body: Value = serde_json::from_slice(&bytes)
        .map_err(|e| vllm_error(StatusCode::BAD_REQUEST, &format!("invalid JSON: {e}")))?;
    remember(s, &parts.headers, &body);
    s.metrics.received.inc();
    let faults = match parts
        .headers
        .get(faults::HEADER)
        .and_then(|v| v.to_str().ok())
    {
        Some(spec) => Faults::parse(spec).map_err(|e| vllm_error(StatusCode::BAD_REQUEST, &e))?,
        None if !s.config.faults.is_empty() && fastrand::f64() < s.config.fault_rate => {
            s.config.faults.clone()
        }
        None => Faults::default(),
    };
    if let Some(code) = faults.error {
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return Err(vllm_error(status, "simulated error"));
    }
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if model != s.config.model {
        return Err(vllm_error(
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
    if let Ok(mut g) = s.last_request.lock() {
        *g = Some(json!({ "headers": headers, "body": body }));
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn generate(s: Arc<SimState>, api: Api, req: Request) -> Response {
    let (body, faults) = match intake(&s, req).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let texts = text::prompt_texts(&body);
    let prompt_tokens = match api {
        Api::Chat => crate::tokens::estimate_messages(texts.iter().map(String::as_str)),
        Api::Completions => texts.iter().map(|t| crate::tokens::estimate(t)).sum(),
    };
    s.metrics.prompt_tokens.add(u64::from(prompt_tokens));
    let max_tokens = body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_u64)
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX));
    let natural = s.config.output_tokens.max(1);
    let (output_tokens, finish_reason) = match max_tokens {
        Some(m) if m < natural => (m.max(1), "length"),
        _ => (natural, "stop"),
    };
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = body
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let prefix = match api {
        Api::Chat => "chatcmpl",
        Api::Completions => "cmpl",
    };
    let generation = Generation {
        api,
        id: format!("{prefix}-{:016x}", fastrand::u64(..)),
        created: unix_now(),
        model: Arc::from(s.config.model.as_str()),
        seed: text::seed_of(texts.concat().as_bytes()),
        prompt_tokens,
        output_tokens,
        finish_reason,
        include_usage,
    };
    let (first_at, token_delay) = s.schedule(&faults);
    if stream {
        let body = SimStream::new(s.clone(), generation, faults, first_at, token_delay);
        return Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::new(body))
            .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    non_streamed(s, generation, first_at, token_delay).await
}

/// Counts a non-streamed request as running until it answers or is abandoned.
struct Running<'a> {
    s: &'a SimState,
    done: bool,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.s.metrics.running.dec();
        if !self.done {
            self.s.metrics.finished("abort");
        }
    }
}

async fn non_streamed(
    s: Arc<SimState>,
    g: Generation,
    first_at: Instant,
    token_delay: Duration,
) -> Response {
    s.metrics.running.inc();
    let mut running = Running { s: &s, done: false };
    let end = first_at + token_delay * g.output_tokens.saturating_sub(1);
    tokio::time::sleep_until(end).await;
    let text: String = (0..g.output_tokens)
        .map(|i| text::word(g.seed, i))
        .collect();
    s.metrics.generation_tokens.add(u64::from(g.output_tokens));
    s.metrics.finished(g.finish_reason);
    running.done = true;
    drop(running);
    let usage = json!({
        "prompt_tokens": g.prompt_tokens,
        "completion_tokens": g.output_tokens,
        "total_tokens": g.prompt_tokens + g.output_tokens,
    });
    let body = match g.api {
        Api::Chat => json!({
            "id": g.id, "object": "chat.completion", "created": g.created, "model": &*g.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": null, "finish_reason": g.finish_reason}],
            "usage": usage,
        }),
        Api::Completions => json!({
            "id": g.id, "object": "text_completion", "created": g.created, "model": &*g.model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": g.finish_reason}],
            "usage": usage,
        }),
    };
    axum::Json(body).into_response()
}

async fn embeddings(State(s): State<Arc<SimState>>, req: Request) -> Response {
    let (body, _faults) = match intake(&s, req).await {
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
