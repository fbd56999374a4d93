//! Prefill/decode disaggregation in the simulator, in both engines'
//! protocols, so a gateway's orchestration can be tested and benchmarked
//! without GPUs.
//!
//! - **vLLM (KV transfer parameters).** A request whose `kv_transfer_params`
//!   ask for `do_remote_decode` is prefilled here and, when it stops at its
//!   one-token limit (as vLLM's NIXL connector requires), answered with
//!   `kv_transfer_params` naming this replica (`remote_engine_id`,
//!   `remote_host`, `remote_port`, `remote_request_id`, block ids): the KV is
//!   kept for `--kv-ttl`. A request that carries such parameters
//!   (`do_remote_prefill`) pulls that KV from the named replica
//!   (`POST /sim/kv/pull`) before it starts: its prompt is then computed but
//!   for its last token, after a transfer time of the prompt tokens its own
//!   prefix cache lacks (vLLM's connectors pull only those) x the profile's
//!   KV bytes per token over `--kv-bandwidth`. Unknown or expired
//!   parameters fail the request (500, vLLM's `kv_load_failure_policy: fail`).
//! - **SGLang (bootstrap room).** With `--role prefill`, a request carrying
//!   `bootstrap_room` is prefilled and answered with one token; its room is
//!   then ready. With `--role decode`, it waits (up to `--kv-ttl`) for that
//!   room at `bootstrap_host:bootstrap_port` and pulls it, as above (the
//!   whole prompt's KV).
//!
//! A replica's role (`--role`) only decides the SGLang side and refuses the
//! vLLM leg it cannot play; a `mixed` one serves either vLLM leg.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::SimState;

/// `sluice sim --role`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Both legs, and plain requests.
    #[default]
    Mixed,
    Prefill,
    Decode,
}

/// What a request asks of this replica's disaggregation, read from its body.
pub(super) enum Leg {
    /// A plain request.
    None,
    /// vLLM: prefill here, hand the KV to a decode replica.
    VllmPrefill,
    /// vLLM: the prompt's KV is at `host:port` under `id`.
    VllmDecode { host: String, port: u16, id: String },
    /// SGLang: prefill here for `room`.
    SglangPrefill { room: u64 },
    /// SGLang: the prompt's KV comes from `room` at `host:port`.
    SglangDecode { host: String, port: u16, room: u64 },
}

impl Leg {
    /// A decode leg, whose prompt's KV comes from a prefill replica.
    pub(super) fn pulls(&self) -> bool {
        matches!(self, Leg::VllmDecode { .. } | Leg::SglangDecode { .. })
    }
}

/// KV kept for decode replicas to pull, until it expires or is pulled.
#[derive(Default)]
pub(super) struct Transfers {
    by_id: Mutex<HashMap<String, (u32, Instant)>>,
    /// SGLang rooms: prompt tokens once the prefill is done (`None` before).
    rooms: Mutex<HashMap<u64, (Option<u32>, Instant)>>,
    ready: Notify,
}

impl Transfers {
    fn sweep(&self, now: Instant) {
        self.by_id.lock().retain(|_, (_, until)| *until > now);
        self.rooms.lock().retain(|_, (_, until)| *until > now);
    }

    pub(super) fn offer(&self, id: String, prompt_tokens: u32, ttl: Duration) {
        let now = Instant::now();
        self.sweep(now);
        self.by_id.lock().insert(id, (prompt_tokens, now + ttl));
    }

    pub(super) fn open_room(&self, room: u64, ttl: Duration) {
        let now = Instant::now();
        self.sweep(now);
        self.rooms.lock().insert(room, (None, now + ttl));
    }

    pub(super) fn fill_room(&self, room: u64, prompt_tokens: u32) {
        if let Some(r) = self.rooms.lock().get_mut(&room) {
            r.0 = Some(prompt_tokens);
        }
        self.ready.notify_waiters();
    }
}

/// The leg a request's body asks for on a replica of `role`; `Err` with the
/// answer when that replica cannot play it.
#[expect(
    clippy::result_large_err,
    reason = "the error is the answer the handler returns at once, as `intake`'s"
)]
pub(super) fn leg(body: &Value, role: Role) -> Result<Leg, Response> {
    let params = body.get("kv_transfer_params").filter(|p| p.is_object());
    if let Some(p) = params {
        if p.get("do_remote_decode").and_then(Value::as_bool) == Some(true) {
            if role == Role::Decode {
                return Err(refuse(
                    "this replica is a decode replica: no remote decode from here",
                ));
            }
            return Ok(Leg::VllmPrefill);
        }
        if p.get("do_remote_prefill").and_then(Value::as_bool) == Some(true) {
            if role == Role::Prefill {
                return Err(refuse(
                    "this replica is a prefill replica: no remote prefill into it",
                ));
            }
            let host = p.get("remote_host").and_then(Value::as_str);
            let port = p.get("remote_port").and_then(Value::as_u64);
            let id = p.get("remote_request_id").and_then(Value::as_str);
            return match (host, port, id) {
                (Some(h), Some(port), Some(id)) => Ok(Leg::VllmDecode {
                    host: h.to_string(),
                    port: u16::try_from(port).unwrap_or(0),
                    id: id.to_string(),
                }),
                _ => Err(super::vllm_error(
                    StatusCode::BAD_REQUEST,
                    "Got invalid KVTransferParams: remote_host, remote_port and remote_request_id are required",
                )),
            };
        }
    }
    let Some(room) = body.get("bootstrap_room").and_then(Value::as_u64) else {
        return Ok(Leg::None);
    };
    match role {
        Role::Prefill => Ok(Leg::SglangPrefill { room }),
        Role::Decode => {
            let host = body.get("bootstrap_host").and_then(Value::as_str);
            let port = body.get("bootstrap_port").and_then(Value::as_u64);
            match (host, port) {
                (Some(h), Some(port)) => Ok(Leg::SglangDecode {
                    host: h.to_string(),
                    port: u16::try_from(port).unwrap_or(0),
                    room,
                }),
                _ => Err(refuse(
                    "bootstrap_host and bootstrap_port are required with bootstrap_room",
                )),
            }
        }
        Role::Mixed => Err(refuse(
            "bootstrap_room on a replica that is neither prefill nor decode (--role)",
        )),
    }
}

fn refuse(message: &str) -> Response {
    super::vllm_error(StatusCode::BAD_REQUEST, message)
}

/// Pull the prompt's KV for a decode leg: its prompt tokens, or the
/// answer that fails the request.
pub(super) async fn pull(s: &SimState, leg: &Leg) -> Result<u32, Response> {
    let (host, port, ask) = match leg {
        Leg::VllmDecode { host, port, id } => (host, *port, json!({ "request_id": id })),
        Leg::SglangDecode { host, port, room } => (host, *port, json!({ "room": room })),
        _ => return Ok(0),
    };
    let failed = |why: String| {
        s.metrics.kv_transfer_failures.inc();
        super::vllm_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("KV transfer failed: {why}"),
        )
    };
    let url = format!("http://{host}:{port}/sim/kv/pull");
    // Bounded: a room waits for its prefill at most `kv_ttl` there; this
    // side gives the prefill replica that plus a margin to answer.
    let limit = s.config.kv_ttl + Duration::from_secs(5);
    let resp = tokio::time::timeout(limit, post_json(&url, &ask))
        .await
        .map_err(|_| failed(format!("{url} did not answer")))?
        .map_err(|e| failed(format!("{url}: {e}")))?;
    match resp {
        (200, v) => v
            .get("prompt_tokens")
            .and_then(Value::as_u64)
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
            .ok_or_else(|| failed("no prompt_tokens in the answer".into())),
        (status, v) => Err(failed(format!(
            "{status} from the prefill replica: {}",
            v.get("message").and_then(Value::as_str).unwrap_or("")
        ))),
    }
}

async fn post_json(url: &str, body: &Value) -> anyhow::Result<(u16, Value)> {
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;
    let client: Client<HttpConnector, Full<bytes::Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let req = http::Request::post(url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(bytes::Bytes::from(body.to_string())))?;
    let resp = client.request(req).await?;
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await?.to_bytes();
    Ok((
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    ))
}

/// How long moving `tokens` of KV takes at `--kv-bandwidth` (engine time,
/// run `speed` times faster).
pub(super) fn transfer_time(s: &SimState, tokens: u32) -> Duration {
    let bytes_per_token = s.config.profile.map_or(131_072, |p| p.kv_bytes_per_token);
    let bytes = f64::from(tokens) * f64::from(bytes_per_token);
    Duration::from_secs_f64(bytes / s.config.kv_bandwidth.max(1.0) / s.config.speed.max(1e-9))
}

/// The `kv_transfer_params` a prefill leg answers with (the KV is offered
/// under `id` until it expires).
pub(super) fn offer(s: &SimState, id: &str, prompt_tokens: u32) -> Value {
    s.transfers
        .offer(id.to_string(), prompt_tokens, s.config.kv_ttl);
    let block = s.config.profile.map_or(16, |p| p.block_size).max(1);
    let blocks: Vec<u32> = (0..prompt_tokens.div_ceil(block)).collect();
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": &*s.fingerprint,
        "remote_block_ids": blocks,
        "remote_host": s.addr.ip().to_string(),
        "remote_port": s.addr.port(),
        "remote_request_id": id,
        "tp_size": 1,
    })
}

/// `POST /sim/kv/pull {"request_id": ID}` or `{"room": N}`: hand over the KV
/// kept for a decode replica (once), answering its prompt tokens; 404 when
/// unknown or expired. A room not yet prefilled is waited for, up to
/// `--kv-ttl`.
pub(super) async fn pull_handler(
    State(s): State<Arc<SimState>>,
    axum::Json(ask): axum::Json<Value>,
) -> Response {
    let t = &s.transfers;
    let now = Instant::now();
    t.sweep(now);
    if let Some(id) = ask.get("request_id").and_then(Value::as_str) {
        return match t.by_id.lock().remove(id) {
            Some((tokens, _)) => axum::Json(json!({ "prompt_tokens": tokens })).into_response(),
            None => super::vllm_error(
                StatusCode::NOT_FOUND,
                &format!("no KV kept for request {id} (unknown, already pulled, or expired)"),
            ),
        };
    }
    let Some(room) = ask.get("room").and_then(Value::as_u64) else {
        return refuse("give request_id or room");
    };
    let until = now + s.config.kv_ttl;
    loop {
        let ready = t.ready.notified();
        {
            let mut rooms = t.rooms.lock();
            // Not prefilled yet (or not arrived yet): wait.
            if let Some((Some(tokens), _)) = rooms.get(&room) {
                let tokens = *tokens;
                rooms.remove(&room);
                return axum::Json(json!({ "prompt_tokens": tokens })).into_response();
            }
        }
        if tokio::time::timeout_at(until, ready).await.is_err() {
            return super::vllm_error(
                StatusCode::NOT_FOUND,
                &format!("bootstrap room {room} was not prefilled within the KV lifetime"),
            );
        }
    }
}
