//! Active health checks and model discovery: each replica's `/v1/models`,
//! fetched on an interval. Success marks it healthy and refreshes its model
//! list; two failures in a row mark it unhealthy (one lost probe is not an outage).

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use bytes::Bytes;
use http::{Method, Request, header};
use http_body_util::{BodyExt, Full, Limited};
use serde::Deserialize;

use super::client::HttpClient;
use super::pool::{Health, Pool, Replica};
use crate::config::HealthCheckConfig;

/// Consecutive failed checks before a healthy replica is taken out.
const FAILURES_TO_EJECT: u32 = 2;

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
}

/// Check every replica once, concurrently; publish a new model index if any
/// replica's models or health changed.
pub(crate) async fn check_all(pool: &Pool, client: &HttpClient, cfg: &HealthCheckConfig) {
    let mut tasks = tokio::task::JoinSet::new();
    for r in pool.replicas().iter() {
        let (r, client, timeout) = (r.clone(), client.clone(), cfg.timeout);
        tasks.spawn(async move {
            let result = tokio::time::timeout(timeout, fetch_models(&r, &client))
                .await
                .unwrap_or_else(|_| {
                    Err(format!(
                        "no answer within {}",
                        humantime::format_duration(timeout)
                    ))
                });
            apply(&r, result)
        });
    }
    let mut changed = false;
    while let Some(res) = tasks.join_next().await {
        changed |= res.unwrap_or(false);
    }
    if changed {
        pool.rebuild_index();
    }
}

/// Run checks forever at the configured interval (the caller aborts the task).
pub(crate) async fn run(pool: Arc<Pool>, client: HttpClient, cfg: HealthCheckConfig) {
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        check_all(&pool, &client, &cfg).await;
        for r in pool.replicas().iter() {
            r.conns.sweep();
        }
    }
}

async fn fetch_models(r: &Replica, client: &HttpClient) -> Result<Vec<Arc<str>>, String> {
    let uri = format!("{}/v1/models", r.base);
    let mut req = Request::builder()
        .method(Method::GET)
        .uri(uri)
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    if let Some(key) = &r.api_key {
        req.headers_mut().insert(header::AUTHORIZATION, key.clone());
    }
    let resp = client.request(req).await.map_err(|e| causes(&e))?;
    let status = resp.status();
    let body = Limited::new(resp.into_body(), 4 << 20)
        .collect()
        .await
        .map_err(|e| format!("reading body: {e}"))?
        .to_bytes();
    if !status.is_success() {
        return Err(format!("/v1/models answered {status}"));
    }
    let list: ModelList = serde_json::from_slice(&body)
        .map_err(|e| format!("/v1/models is not a model list: {e}"))?;
    Ok(list.data.into_iter().map(|m| Arc::from(m.id)).collect())
}

/// An error and its causes, `: `-joined: hyper's `client error (Connect)`
/// alone does not say that a certificate was refused, or why.
fn causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(c) = next {
        text.push_str(": ");
        text.push_str(&c.to_string());
        next = c.source();
    }
    text
}

/// Record one check's result; true if the replica's models or health changed.
fn apply(r: &Replica, result: Result<Vec<Arc<str>>, String>) -> bool {
    let prev = r.health.load_full();
    let was_healthy = r.is_healthy();
    let mut next = Health {
        checked_at: Some(Instant::now()),
        ..Health::clone(&prev)
    };
    let healthy = match result {
        Ok(models) => {
            next.models = models;
            next.last_error = None;
            next.consecutive_failures = 0;
            true
        }
        Err(e) => {
            next.last_error = Some(e);
            next.consecutive_failures = prev.consecutive_failures.saturating_add(1);
            was_healthy && next.consecutive_failures < FAILURES_TO_EJECT
        }
    };
    let models_changed = next.models != prev.models;
    if healthy != was_healthy {
        if healthy {
            tracing::info!(backend = %r.name, "replica is healthy");
        } else {
            tracing::warn!(backend = %r.name, error = next.last_error.as_deref().unwrap_or(""), "replica is unhealthy");
        }
    }
    r.health.store(Arc::new(next));
    r.healthy.store(healthy, Relaxed);
    r.series.healthy.set(i64::from(healthy));
    models_changed || healthy != was_healthy
}
