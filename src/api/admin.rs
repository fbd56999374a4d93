//! The admin listener: liveness, readiness, metrics, and what the gateway
//! knows about its replicas and its config. Never exposed publicly.

use axum::Json;
use sha2::Digest as _;

use axum::response::{IntoResponse, Response};
use http::{StatusCode, header};
use serde::Serialize;

use crate::state::Current;

/// The admin token, where `server.admin_auth` sets one: every route but the
/// probes (and `/metrics` with `metrics_open`) answers 401 without
/// `Authorization: Bearer TOKEN`. Compared by SHA-256 digest, so the time
/// taken says nothing of how much of a guess was right.
pub(crate) async fn require_token(
    axum::extract::State(live): axum::extract::State<std::sync::Arc<crate::state::Live>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let state = live.load();
    let Some(want) = state.admin_token else {
        return next.run(req).await;
    };
    let path = req.uri().path();
    let open = matches!(path, "/healthz" | "/readyz")
        || (path == "/metrics" && state.config.server.admin_auth.metrics_open);
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| <[u8; 32]>::from(sha2::Sha256::digest(t.trim().as_bytes())));
    if open || given == Some(want) {
        return next.run(req).await;
    }
    let body = serde_json::json!({"error": {
        "message": "the admin listener needs its token: Authorization: Bearer TOKEN (server.admin_auth)",
        "type": "authentication_error",
        "code": "invalid_admin_token",
    }});
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        Json(body),
    )
        .into_response()
}

pub(crate) async fn healthz() -> &'static str {
    "ok\n"
}

/// Ready when the config is loaded (it is, or we would not be running) and at
/// least one replica is healthy.
pub(crate) async fn readyz(Current(state): Current) -> Response {
    if state.pool.any_healthy() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no healthy replica\n").into_response()
    }
}

/// Prometheus text by default; OpenMetrics (with exemplars linking latency
/// buckets to traces) when the scraper asks for it.
pub(crate) async fn metrics(Current(state): Current, headers: http::HeaderMap) -> Response {
    let om = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/openmetrics-text"));
    state.pool.refresh_metrics();
    diagnose_now(&state);
    let sessions = state.affinity.sessions.len();
    state
        .metrics
        .sessions
        .set(i64::try_from(sessions).unwrap_or(i64::MAX));
    state.metrics.alone.set(i64::from(state.pool.alone()));
    let body = state.metrics.render(om);
    let ct = if om {
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    } else {
        "text/plain; version=0.0.4; charset=utf-8"
    };
    ([(header::CONTENT_TYPE, ct)], body).into_response()
}

/// What the doctor finds now (`sluice diagnose` prints it).
#[derive(Serialize)]
pub(crate) struct Diagnosis {
    /// No warning or critical finding (information, such as
    /// underutilisation, costs money but hurts nobody).
    healthy: bool,
    /// The most severe finding's severity, if any.
    worst: Option<crate::doctor::Severity>,
    findings: Vec<crate::doctor::Finding>,
}

/// The findings held now (this evaluation's and those not yet cleared),
/// also set in `sluice_diagnosis_active`.
pub(crate) fn diagnose_now(state: &crate::state::AppState) -> Vec<crate::doctor::Finding> {
    let now = std::time::Instant::now();
    let found = crate::doctor::diagnose(&state.pool, &state.config, &state.metrics, now);
    let findings = state
        .findings
        .observe(found, now, state.config.doctor.clear_after);
    crate::doctor::export(&findings, &state.pool, &state.metrics);
    findings
}

pub(crate) async fn diagnose(Current(state): Current) -> Json<Diagnosis> {
    let findings = diagnose_now(&state);
    Json(Diagnosis {
        healthy: findings
            .iter()
            .all(|f| f.severity == crate::doctor::Severity::Info),
        worst: findings.iter().map(|f| f.severity).max(),
        findings,
    })
}

#[derive(Serialize)]
pub(crate) struct BackendView {
    name: String,
    url: String,
    healthy: bool,
    /// Passive health: closed (serving), open (ejected), half_open (probation).
    circuit: &'static str,
    ejected_for_seconds: Option<f64>,
    in_flight: u32,
    /// Its part in a disaggregated fleet: `mixed`, `prefill` or `decode`.
    role: &'static str,
    models: Vec<String>,
    /// Seconds since the last health check, if any.
    checked_ago_seconds: Option<f64>,
    consecutive_failures: u32,
    last_error: Option<String>,
    /// From the replica's own /metrics.
    engine: Option<&'static str>,
    kv_cache_usage: Option<f64>,
    /// KV-cache geometry (vLLM's `cache_config_info`): tokens per block, blocks.
    kv_block_size: Option<u32>,
    kv_num_blocks: Option<u32>,
    requests_waiting: Option<f64>,
    /// Of those, waiting for something other than room (vLLM: pulling their
    /// KV, a grammar): not counted as a queue.
    requests_deferred: Option<f64>,
    requests_running: Option<f64>,
    /// The engine says it is full: requests waited for room at its last two
    /// scrapes.
    engine_queued: bool,
    /// Requests it runs at once: `max_concurrency`, or learned from its
    /// scrapes (what runs while its queue persists); flow control's seats.
    seats: Option<u32>,
    /// It preempted sequences since the scrape before (out of KV blocks).
    preempting: bool,
    prefix_cache_hit_rate: Option<f64>,
    metrics_age_seconds: Option<f64>,
    /// Prefix blocks this gateway remembers sending there.
    prefix_index_blocks: usize,
    /// Recent latency this gateway measured there (moving averages), if any.
    ttft_recent_seconds: Option<f64>,
    tpot_recent_seconds: Option<f64>,
}

pub(crate) async fn backends(Current(state): Current) -> Json<Vec<BackendView>> {
    let out = state
        .pool
        .replicas()
        .iter()
        .map(|r| {
            let h = r.health.load();
            let l = r.load();
            BackendView {
                name: r.name.to_string(),
                url: r.base.clone(),
                healthy: r.is_healthy(),
                circuit: r.circuit().as_str(),
                ejected_for_seconds: r.ejected_for().map(|d| d.as_secs_f64()),
                in_flight: r.in_flight(),
                role: r.role.as_str(),
                models: r.models().iter().map(|m| m.to_string()).collect(),
                checked_ago_seconds: h.checked_at.map(|t| t.elapsed().as_secs_f64()),
                consecutive_failures: h.consecutive_failures,
                last_error: h.last_error.clone(),
                engine: l.as_ref().map(|s| s.engine.as_str()),
                kv_cache_usage: l.as_ref().and_then(|s| s.kv_usage),
                kv_block_size: l.as_ref().and_then(|s| s.block_size),
                kv_num_blocks: l.as_ref().and_then(|s| s.num_blocks),
                requests_waiting: l.as_ref().and_then(|s| s.waiting),
                requests_deferred: l.as_ref().and_then(|s| s.deferred),
                requests_running: l.as_ref().and_then(|s| s.running),
                engine_queued: l.as_ref().is_some_and(|s| s.queued),
                seats: r.seats(),
                preempting: l.as_ref().is_some_and(|s| s.preempting),
                prefix_cache_hit_rate: l.as_ref().and_then(|s| s.prefix_hit_rate),
                metrics_age_seconds: l.as_ref().map(|s| s.at.elapsed().as_secs_f64()),
                prefix_index_blocks: state.affinity.blocks(&r.name),
                ttft_recent_seconds: r.ttft_recent.get(),
                tpot_recent_seconds: r.tpot_recent.get(),
            }
        })
        .collect();
    Json(out)
}

#[derive(Serialize)]
pub(crate) struct RoutingView {
    policy: &'static str,
    /// `shared`: new prefixes' homes are kept in the shared table
    /// (`routing.prefix_kv.shared_homes` with a Redis store); else `local`.
    prefix_homes: &'static str,
    sessions: SessionsView,
    replicas: Vec<ReplicaRouting>,
}

#[derive(Serialize)]
struct SessionsView {
    enabled: bool,
    /// `memory` (this gateway's table only) or `redis` (shared).
    store: &'static str,
    /// Where new sessions start (`auto` resolved, now).
    placement: crate::config::SessionPlacement,
    /// No other sender's requests show at the replicas' engines
    /// (`upstream::company`): what `auto` places by without a shared table.
    alone: bool,
    /// Sessions remembered (live and not yet evicted).
    remembered: usize,
    /// Live sessions per replica.
    per_replica: std::collections::BTreeMap<String, usize>,
    /// The most recently active sessions (keys are hashes: no ids shown).
    recent: Vec<SessionRow>,
}

#[derive(Serialize)]
struct SessionRow {
    key: String,
    replica: String,
    idle_seconds: f64,
    turns: u32,
}

#[derive(Serialize)]
struct ReplicaRouting {
    name: String,
    /// `mixed`, `prefill` or `decode`.
    role: &'static str,
    in_flight: u32,
    /// Prefix blocks this gateway remembers sending there.
    prefix_index_blocks: usize,
    /// Of the cached tokens routing predicted there, the share the engine
    /// reported lately (a moving average; 1 until the engine says:
    /// `routing::load`).
    cache_kept: f64,
}

/// What routing knows and decides by: sessions and their replicas, and per
/// replica what this gateway sends there.
pub(crate) async fn routing(Current(state): Current) -> Json<RoutingView> {
    let now = std::time::Instant::now();
    let table = &state.affinity.sessions;
    let alone = state.pool.alone();
    let per_replica = table
        .per_replica(now)
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let recent = table
        .recent(50, now)
        .into_iter()
        .map(|v| SessionRow {
            key: format!("{:016x}", v.key),
            replica: v.replica.to_string(),
            idle_seconds: v.idle.as_secs_f64(),
            turns: v.turns,
        })
        .collect();
    let replicas = state
        .pool
        .replicas()
        .iter()
        .map(|r| ReplicaRouting {
            name: r.name.to_string(),
            role: r.role.as_str(),
            in_flight: r.in_flight(),
            prefix_index_blocks: state.affinity.blocks(&r.name),
            cache_kept: state.affinity.kept(&r.name),
        })
        .collect();
    Json(RoutingView {
        policy: state.policy.name(),
        prefix_homes: if state.shared_table.as_ref().is_some_and(|t| t.homes) {
            "shared"
        } else {
            "local"
        },
        sessions: SessionsView {
            enabled: state.config.routing.sessions.enabled,
            store: if state.shared_table.is_some() {
                "redis"
            } else {
                "memory"
            },
            placement: state
                .config
                .routing
                .prefix_kv
                .session_placement
                .resolved(&state.config.routing.sessions)
                .now(alone),
            alone,
            remembered: table.len(),
            per_replica,
            recent,
        },
        replicas,
    })
}

/// The effective config; secrets print as `[redacted]`.
pub(crate) async fn config(Current(state): Current) -> Response {
    Json(&*state.config).into_response()
}
