//! The admin listener: liveness, readiness, metrics, and what the gateway
//! knows about its replicas and its config. Never exposed publicly.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use http::{StatusCode, header};
use serde::Serialize;

use crate::app::AppState;

pub async fn healthz() -> &'static str {
    "ok\n"
}

/// Ready when the config is loaded (it is, or we would not be running) and at
/// least one replica is healthy.
pub async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    if state.pool.any_healthy() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no healthy replica\n").into_response()
    }
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let body = state.metrics.render();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

#[derive(Serialize)]
pub struct BackendView {
    name: String,
    url: String,
    healthy: bool,
    in_flight: u32,
    models: Vec<String>,
    /// Seconds since the last health check, if any.
    checked_ago_seconds: Option<f64>,
    consecutive_failures: u32,
    last_error: Option<String>,
}

pub async fn backends(State(state): State<Arc<AppState>>) -> Json<Vec<BackendView>> {
    let out = state
        .pool
        .replicas
        .iter()
        .map(|r| {
            let h = r.health.load();
            BackendView {
                name: r.name.to_string(),
                url: r.base.clone(),
                healthy: r.is_healthy(),
                in_flight: r.in_flight(),
                models: r.models().iter().map(|m| m.to_string()).collect(),
                checked_ago_seconds: h.checked_at.map(|t| t.elapsed().as_secs_f64()),
                consecutive_failures: h.consecutive_failures,
                last_error: h.last_error.clone(),
            }
        })
        .collect();
    Json(out)
}

/// The effective config; secrets print as `[redacted]`.
pub async fn config(State(state): State<Arc<AppState>>) -> Response {
    Json(&*state.config).into_response()
}
