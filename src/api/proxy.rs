//! The request path: read, route, forward, stream back, record.
//!
//! One function serves chat, completions, embeddings and the pass-through
//! routes, so there is one hot path to keep fast. Retries happen only here,
//! before any byte reached the client, and only on another replica.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, header};

use super::request::{self, Inbound};
use crate::app::AppState;
use crate::error::{GatewayError, TimeoutPhase, normalise_upstream_error};
use crate::routing::{RouteCtx, RouteReason};
use crate::stream::body::{Mode, TimedBody};
use crate::stream::event::chunk_info;
use crate::telemetry::metrics::StatusLabel;
use crate::telemetry::record::{Completion, Endpoint, RequestRecord};
use crate::telemetry::tracecontext::TraceCtx;
use crate::upstream::client::{X_REQUEST_ID, downstream_headers, request_id, upstream_headers};
use crate::upstream::conn::{Conn, SendError};
use crate::upstream::pool::{Candidates, InFlight, Replica};

/// Largest error body read from a replica before giving up on it.
const MAX_ERROR_BODY: usize = 1 << 20;

pub async fn handle(state: Arc<AppState>, endpoint: Endpoint, req: Request<Body>) -> Response {
    let arrival = Instant::now();
    let (parts, body) = req.into_parts();
    let rid = request_id(&parts.headers);
    let mut resp = match proxy(&state, endpoint, arrival, &parts, body, &rid).await {
        Ok(r) => r,
        Err(Failure {
            recorded,
            error,
            headers,
        }) => {
            if !recorded {
                // Failed before the model was known: no model label to give.
                let key = (
                    Arc::from(""),
                    Arc::from(""),
                    StatusLabel(error.status().as_u16()),
                    error.kind(),
                );
                state.metrics.requests.get(&key).inc();
                if let Some(log) = &state.telemetry.access_log {
                    let mut r = RequestRecord::new(endpoint, Arc::from(""), false, arrival);
                    r.request_id = rid.to_str().unwrap_or_default().to_string();
                    r.trace = Some(TraceCtx::from_headers(&parts.headers));
                    r.status = error.status().as_u16();
                    r.error_kind = Some(error.kind());
                    r.end = Some(Instant::now());
                    log.write(&r, None, None);
                }
            }
            let mut resp = error.into_response();
            if let Some(h) = headers {
                h.apply(resp.headers_mut());
            }
            resp
        }
    };
    resp.headers_mut().insert(X_REQUEST_ID.clone(), rid);
    resp
}

/// A failed request; `recorded` when a [`Completion`] already counted it;
/// `headers` when a rate-limit admission had already been made.
struct Failure {
    recorded: bool,
    error: GatewayError,
    headers: Option<crate::limits::RateHeaders>,
}

fn unrecorded(error: GatewayError) -> Failure {
    Failure {
        recorded: false,
        error,
        headers: None,
    }
}

fn recorded(error: GatewayError) -> Failure {
    Failure {
        recorded: true,
        error,
        headers: None,
    }
}

async fn proxy(
    state: &AppState,
    endpoint: Endpoint,
    arrival: Instant,
    parts: &Parts,
    body: Body,
    rid: &HeaderValue,
) -> Result<Response, Failure> {
    // Who is calling, before the body is read: an unknown caller costs nothing.
    let identity = match &state.limiter {
        Some(l) => Some(l.identify(&parts.headers).map_err(unrecorded)?),
        None => None,
    };
    let limit = state.config.server.max_body_bytes.as_usize();
    let body_timeout = state.config.server.body_timeout;
    let bytes = match tokio::time::timeout(
        body_timeout,
        request::read_body(&parts.headers, body, limit),
    )
    .await
    {
        Ok(read) => read.map_err(unrecorded)?,
        Err(_) => return Err(unrecorded(GatewayError::BodyTimeout(body_timeout))),
    };
    let prefix = state.policy.wants_prefix().then(|| {
        let p = &state.config.routing.prefix_kv;
        request::PrefixParams {
            block_chars: p.block_chars,
            max_blocks: p.max_blocks,
        }
    });
    let needs = request::Needs {
        prefix,
        estimate: identity.is_some(),
        text: state
            .telemetry
            .access_log
            .as_ref()
            .is_some_and(|l| l.include_prompts),
    };
    let mut inbound = match request::inspect_with(endpoint, bytes, needs) {
        // Other `/v1/*` routes are forwarded only when they name a model;
        // without one there is nothing to route by: an unknown URL.
        Err(GatewayError::MissingModel) if endpoint == Endpoint::Passthrough => {
            return Err(unrecorded(GatewayError::UnknownRoute {
                method: parts.method.to_string(),
                path: parts.uri.path().to_string(),
            }));
        }
        r => r.map_err(unrecorded)?,
    };
    let trace = TraceCtx::from_headers(&parts.headers);
    let new_completion = |model: Arc<str>| {
        let mut record = RequestRecord::new(endpoint, model, inbound.stream, arrival);
        record.request_id = rid.to_str().unwrap_or_default().to_string();
        record.trace = Some(trace);
        record.max_tokens = inbound.max_tokens;
        if let Some(id) = &identity {
            record.tier = Some(id.tier.clone());
            record.key_name = Some(id.name.clone());
        }
        record.prompt_estimate = inbound.prompt_estimate;
        let mut c = Completion::new(
            record,
            state.telemetry.clone(),
            state.config.telemetry.stall_threshold,
        );
        c.prompt_text = inbound.prompt_text.clone();
        c
    };
    let candidates = match state.pool.resolve(&inbound.model) {
        Ok(ok) => ok,
        Err(e @ GatewayError::NoHealthyBackend(_)) => {
            let mut c = new_completion(served_name(state, &inbound));
            c.fail(e.status().as_u16(), e.kind());
            return Err(recorded(e));
        }
        Err(e) => return Err(unrecorded(e)),
    };
    let model = candidates.model.clone();
    let mut completion = new_completion(model.clone());
    let fail = |c: &mut Completion, e: GatewayError| {
        c.fail(e.status().as_u16(), e.kind());
        recorded(e)
    };
    if *model != *inbound.model {
        completion.record.requested_model = Some(Arc::from(inbound.model.as_str()));
        inbound.body =
            request::with_model(&inbound.body, &model).map_err(|e| fail(&mut completion, e))?;
    }
    crate::routing::prefix::bind_model(&mut inbound.prefix, &model);

    let mut rate_headers = None;
    if let (Some(limiter), Some(id)) = (&state.limiter, &identity) {
        let generates = matches!(endpoint, Endpoint::Chat | Endpoint::Completions);
        let mut max_tokens = inbound.max_tokens;
        if let Some(cap) = limiter.max_tokens_cap(id, &model) {
            match inbound.max_tokens {
                Some(asked) if asked > cap => {
                    return Err(fail(
                        &mut completion,
                        GatewayError::MaxTokensOverCap { asked, cap },
                    ));
                }
                None if generates => {
                    // The tier bounds every generation, also one that set no limit.
                    inbound.body = request::with_max_tokens(&inbound.body, cap)
                        .map_err(|e| fail(&mut completion, e))?;
                    max_tokens = Some(cap);
                }
                _ => {}
            }
        }
        if endpoint == Endpoint::Embeddings {
            max_tokens = Some(0);
        }
        match limiter
            .admit(id, &model, inbound.prompt_estimate, max_tokens)
            .await
        {
            Ok(admission) => {
                completion.record.ratelimit = Some(if admission.is_unlimited() {
                    "admitted_store_down"
                } else {
                    "admitted"
                });
                rate_headers = Some(admission.headers.clone());
                completion.admission = Some(admission);
            }
            Err(e) => {
                completion.record.ratelimit = Some(match e {
                    GatewayError::RateLimitUnavailable => "rejected_store_down",
                    _ => "rejected",
                });
                return Err(fail(&mut completion, e));
            }
        }
    }
    match forward(
        state, endpoint, parts, &inbound, candidates, completion, rid,
    )
    .await
    {
        Ok(mut resp) => {
            if let Some(h) = &rate_headers {
                h.apply(resp.headers_mut());
            }
            Ok(resp)
        }
        Err(e) => Err(Failure {
            recorded: true,
            error: e,
            headers: rate_headers,
        }),
    }
}

/// The served name of a known model (for labels), never the client's string.
fn served_name(state: &AppState, inbound: &Inbound) -> Arc<str> {
    state
        .pool
        .aliases
        .get(&inbound.model)
        .cloned()
        .unwrap_or_else(|| Arc::from(inbound.model.as_str()))
}

async fn forward(
    state: &AppState,
    endpoint: Endpoint,
    parts: &Parts,
    inbound: &Inbound,
    candidates: Candidates,
    mut completion: Completion,
    rid: &HeaderValue,
) -> Result<Response, GatewayError> {
    let fallback = candidates.fallback;
    let mut candidates = candidates.replicas;
    let cfg = &state.config.upstream;
    let deadline = completion.record.arrival + cfg.timeouts.total;
    let mut headers = upstream_headers(&parts.headers, rid);
    if let Some(t) = completion.record.trace {
        // The replica's spans hang under the gateway's upstream span.
        headers.insert("traceparent", t.upstream_header());
    }
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let model = completion.record.model.clone();
    let max_attempts = 1 + cfg.max_retries;
    let mut attempt = 0;
    loop {
        let ctx = RouteCtx {
            model: &model,
            hashes: &inbound.prefix,
            now: Instant::now(),
        };
        let Some(decision) = state.policy.pick(&ctx, &candidates) else {
            // Only reachable after retries exhausted the candidates.
            let e = GatewayError::NoHealthyBackend(completion.record.model.to_string());
            completion.fail(e.status().as_u16(), e.kind());
            return Err(e);
        };
        let replica = candidates.swap_remove(decision.index);
        let reason = if attempt > 0 {
            RouteReason::Retry
        } else if fallback {
            RouteReason::Fallback
        } else {
            decision.reason
        };
        state
            .metrics
            .routing
            .get(&(completion.record.model.clone(), reason.as_str()))
            .inc();
        completion.record.route_reason = Some(reason);
        attempt += 1;
        completion.record.attempts = attempt;
        completion.set_backend(replica.name.clone(), replica.series.clone());
        let in_flight = InFlight::new(replica.clone());

        let mut req = Request::builder()
            .method(parts.method.clone())
            .uri(format!("{}{}", replica.path_prefix, path))
            .body(inbound.body.clone())
            .map_err(|e| GatewayError::Internal(e.to_string()))?;
        *req.headers_mut() = headers.clone();
        req.headers_mut()
            .insert(header::HOST, replica.conns.host.clone());
        if let Some(key) = &replica.api_key {
            req.headers_mut().insert(header::AUTHORIZATION, key.clone());
        }

        let sent = Instant::now();
        completion.record.upstream_sent = Some(sent);
        completion.record.first_sent.get_or_insert(sent);
        // Streams must show a first event within `first_token`; a non-streamed
        // answer only comes when generation is over, so only `total` bounds it.
        let headers_by = if inbound.stream {
            (sent + cfg.timeouts.first_token).min(deadline)
        } else {
            deadline
        };
        let result = match send(&replica, req, headers_by, inbound.stream).await {
            Ok((resp, conn)) => {
                let up = Upstream {
                    resp,
                    conn,
                    in_flight,
                };
                return respond(
                    state, endpoint, inbound, up, completion, rid, headers_by, deadline,
                )
                .await;
            }
            Err(e) => e,
        };
        completion.upstream_error(result.kind());
        if result.blames_replica() {
            replica.record_failure();
        }
        let can_retry = result.retryable() && attempt < max_attempts && !candidates.is_empty();
        if !can_retry {
            completion.fail(result.status().as_u16(), result.kind());
            return Err(result);
        }
        tracing::debug!(backend = %replica.name, error = %result, "retrying on another replica");
        state
            .metrics
            .retries
            .get(&(completion.record.model.clone(), result.kind()))
            .inc();
    }
}

/// A replica's answer: its head and body, the connection it arrives on, and
/// the in-flight count it holds on the replica.
struct Upstream {
    resp: http::Response<()>,
    conn: Conn,
    in_flight: InFlight,
}

/// Send one attempt and wait for response headers; non-2xx answers become errors
/// carrying the replica's (normalised) body.
async fn send(
    replica: &Replica,
    req: Request<Bytes>,
    headers_by: Instant,
    stream: bool,
) -> Result<(http::Response<()>, Conn), GatewayError> {
    let phase = if stream {
        TimeoutPhase::FirstToken
    } else {
        TimeoutPhase::Total
    };
    let attempt = async {
        let mut conn = replica.conns.checkout().await?;
        let resp = match conn.send(&req).await {
            // The replica closed a kept-alive connection just as it was reused
            // (servers time idle connections out: uvicorn after 5 s): the
            // request never reached it. Once more on a fresh connection.
            Err(SendError::NotSent(_)) if conn.reused() => {
                conn = replica.conns.connect().await?;
                conn.send(&req).await
            }
            r => r,
        };
        // A request that could not have reached the replica (the connection
        // died first) is a connect error: safe to retry on another replica.
        let resp = resp.map_err(SendError::into_gateway)?;
        Ok::<_, GatewayError>((resp, conn))
    };
    let (resp, mut conn) = match tokio::time::timeout_at(headers_by.into(), attempt).await {
        Err(_) => return Err(GatewayError::UpstreamTimeout { phase }),
        Ok(r) => r?,
    };
    let status = resp.status();
    if status.is_success() {
        return Ok((resp, conn));
    }
    let read = tokio::time::timeout_at(headers_by.into(), conn.collect(MAX_ERROR_BODY));
    let body = match read.await {
        Ok(Ok(b)) => {
            replica.conns.checkin(conn);
            b
        }
        _ => Bytes::new(),
    };
    Err(GatewayError::Upstream {
        status,
        body: normalise_upstream_error(status, &body),
    })
}

#[expect(
    clippy::too_many_arguments,
    reason = "one call site; a struct would only rename them"
)]
async fn respond(
    state: &AppState,
    endpoint: Endpoint,
    inbound: &Inbound,
    upstream: Upstream,
    mut completion: Completion,
    rid: &HeaderValue,
    first_by: Instant,
    deadline: Instant,
) -> Result<Response, GatewayError> {
    let Upstream {
        resp,
        mut conn,
        in_flight,
    } = upstream;
    completion.record.upstream_first_byte = Some(Instant::now());
    let (parts, ()) = resp.into_parts();
    let headers = downstream_headers(&parts.headers, rid);
    let is_sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    completion.record.status = parts.status.as_u16();

    if is_sse || endpoint == Endpoint::Passthrough {
        let mode = if is_sse && endpoint != Endpoint::Passthrough {
            Mode::OpenAi {
                strip_usage: !inbound.client_wants_usage,
            }
        } else {
            Mode::Raw
        };
        let idle = state.config.upstream.timeouts.idle;
        let mut timed = TimedBody::new(conn, completion, in_flight, mode, idle, deadline);
        if is_sse {
            match tokio::time::timeout_at(first_by.into(), timed.first_chunk()).await {
                Ok(Ok(())) => {
                    let first = timed.frame_time();
                    timed.completion_mut().record.upstream_first_byte = Some(first);
                }
                Ok(Err(e)) => return Err(fail_before_first_byte(&mut timed, e)),
                Err(_) => {
                    let e = GatewayError::UpstreamTimeout {
                        phase: TimeoutPhase::FirstToken,
                    };
                    return Err(fail_before_first_byte(&mut timed, e));
                }
            }
        }
        timed.completion_mut().record.response_ready = Some(Instant::now());
        let mut out = Response::new(Body::new(timed));
        *out.status_mut() = parts.status;
        *out.headers_mut() = headers;
        if is_sse {
            // Tell any buffering proxy in front of us (nginx) to pass events through.
            out.headers_mut()
                .insert("x-accel-buffering", HeaderValue::from_static("no"));
        }
        return Ok(out);
    }

    // Non-streamed JSON: read it whole (bounded), take usage and finish reason.
    let limit = state.config.upstream.max_response_bytes.as_usize();
    let collected = tokio::time::timeout_at(deadline.into(), conn.collect(limit)).await;
    let bytes = match collected {
        Err(_) => {
            let e = GatewayError::UpstreamTimeout {
                phase: TimeoutPhase::Total,
            };
            in_flight.replica().record_failure();
            completion.upstream_error(e.kind());
            completion.fail(e.status().as_u16(), e.kind());
            return Err(e);
        }
        Ok(Err(err)) => {
            let e = GatewayError::UpstreamProtocol(format!("reading the response: {err}"));
            in_flight.replica().record_failure();
            completion.upstream_error(e.kind());
            completion.fail(e.status().as_u16(), e.kind());
            return Err(e);
        }
        Ok(Ok(b)) => b,
    };
    in_flight.replica().conns.checkin(conn);
    if parts.status.is_success() {
        in_flight.replica().record_success();
    }
    drop(in_flight);
    if let Some(info) = chunk_info(&bytes) {
        completion.record.usage = info.usage;
        completion.record.finish_reason = info.finish_reason;
    }
    let now = Instant::now();
    completion.record.end = Some(now);
    completion.record.response_ready = Some(now);
    drop(completion);
    let mut out = (parts.status, bytes).into_response();
    *out.headers_mut() = headers;
    Ok(out)
}

fn fail_before_first_byte(timed: &mut TimedBody, e: GatewayError) -> GatewayError {
    if e.blames_replica() {
        timed.replica().record_failure();
    }
    let c = timed.completion_mut();
    c.upstream_error(e.kind());
    c.fail(e.status().as_u16(), e.kind());
    e
}

/// 404 for anything that is not an API route.
pub async fn not_found(req: Request<Body>) -> Response {
    GatewayError::UnknownRoute {
        method: req.method().to_string(),
        path: req.uri().path().to_string(),
    }
    .into_response()
}
