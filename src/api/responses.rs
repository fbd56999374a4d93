//! The Responses routes that name a response rather than a model: retrieve
//! (`GET /v1/responses/{id}`), delete, cancel (`POST .../cancel`) and the
//! input items (`GET .../input_items`).
//!
//! Engines keep stored responses in their own memory, so each of these must
//! reach the replica that produced the response. The gateway remembers
//! response id -> replica from the responses it relayed (`routing::Affinity`).
//! An id it does not know (made through another gateway, or before a
//! restart) is asked of every healthy replica in turn until one does not
//! answer 404; the one that knows it is remembered. When none knows it, the
//! client gets the engine's own 404.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderValue, Request, StatusCode, header};
use tokio::time::Instant;

use super::request_id::RequestId;
use crate::error::GatewayError;
use crate::routing::sessions::response_key;
use crate::state::AppState;
use crate::telemetry::metrics::StatusLabel;
use crate::upstream::client::{X_REQUEST_ID, upstream_headers};
use crate::upstream::http1::Outgoing;
use crate::upstream::pool::Replica;

/// Largest answer read from a replica (a stored response with its output).
const MAX_ANSWER: usize = 16 << 20;

/// The metric label of these routes (`sluice_requests_total{endpoint}`).
const ENDPOINT: &str = "responses_by_id";

pub(crate) async fn by_id(state: Arc<AppState>, req: Request<Body>) -> Response {
    let (parts, _) = req.into_parts();
    let rid = RequestId::of(&parts.extensions, &parts.headers);
    let id = parts
        .uri
        .path()
        .strip_prefix("/v1/responses/")
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_default()
        .to_string();
    let (status, model, resp) = match relay(&state, &parts, &id, &rid).await {
        Ok((model, resp)) => (resp.status(), model, resp),
        Err(e) => (e.status(), Arc::from(""), e.into_response()),
    };
    let kind = if status.is_success() {
        ""
    } else {
        "upstream_status"
    };
    state
        .metrics
        .requests
        .get(&(
            model,
            ENDPOINT,
            Arc::from(""),
            StatusLabel(status.as_u16()),
            kind,
        ))
        .inc();
    resp
}

/// Which of `candidates` keeps response `id`, asked of all at once
/// (`GET /v1/responses/{id}`; the first 200 wins and is remembered). `None`
/// when none says so within a second: routing then picks as usual and the
/// engine answers that it does not know the response.
pub(crate) async fn locate(
    state: &AppState,
    candidates: &[Arc<Replica>],
    id: &str,
    rid: &HeaderValue,
) -> Option<Arc<str>> {
    let by = Instant::now() + Duration::from_secs(1);
    let mut asks = tokio::task::JoinSet::new();
    for replica in candidates {
        let (replica, rid) = (replica.clone(), rid.clone());
        let uri = format!("{}/v1/responses/{id}", replica.path_prefix);
        asks.spawn(async move {
            let mut req = Request::get(uri).body(Bytes::new()).ok()?;
            req.headers_mut().insert(X_REQUEST_ID.clone(), rid);
            req.headers_mut()
                .insert(header::HOST, replica.conns.host.clone());
            if let Some(key) = &replica.api_key {
                req.headers_mut().insert(header::AUTHORIZATION, key.clone());
            }
            let (_, mut conn) = super::send::send(&replica, Outgoing::of(&req), by, false)
                .await
                .ok()?;
            // Read the stored response so the connection can be reused.
            if let Ok(Ok(_)) = conn.collect(MAX_ANSWER, by).await {
                replica.conns.checkin(conn);
            }
            Some(replica.name.clone())
        });
    }
    while let Some(found) = asks.join_next().await {
        if let Ok(Some(name)) = found {
            state
                .affinity
                .responses
                .place(response_key(id), &name, crate::turn::now_std());
            return Some(name);
        }
    }
    None
}

/// Ask the replica that holds `id` (or each healthy one until one knows it).
async fn relay(
    state: &AppState,
    parts: &http::request::Parts,
    id: &str,
    rid: &HeaderValue,
) -> Result<(Arc<str>, Response), GatewayError> {
    let now = crate::turn::now_std();
    let replicas = state.pool.replicas();
    let home = state.affinity.responses.get(response_key(id), now);
    let known: Option<&Arc<Replica>> = home
        .as_ref()
        .and_then(|name| replicas.iter().find(|r| r.name == *name));
    let order: Vec<&Arc<Replica>> = match known {
        Some(r) => vec![r],
        None => replicas.iter().filter(|r| r.is_healthy()).collect(),
    };
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let timeout = state
        .config
        .upstream
        .timeouts
        .total
        .min(Duration::from_secs(60));
    let mut last = GatewayError::Upstream {
        status: StatusCode::NOT_FOUND,
        body: crate::error::error_body(
            &format!("Response with id '{id}' not found."),
            "invalid_request_error",
            None,
            Some("response_not_found"),
        ),
    };
    for replica in order {
        let mut req = Request::builder()
            .method(parts.method.clone())
            .uri(format!("{}{}", replica.path_prefix, path))
            .body(Bytes::new())
            .map_err(|e| GatewayError::Internal(e.to_string()))?;
        *req.headers_mut() = upstream_headers(&parts.headers, rid);
        req.headers_mut().remove(header::CONTENT_TYPE);
        req.headers_mut()
            .insert(header::HOST, replica.conns.host.clone());
        if let Some(key) = &replica.api_key {
            req.headers_mut().insert(header::AUTHORIZATION, key.clone());
        }
        let by = Instant::now() + timeout;
        match super::send::send(replica, Outgoing::of(&req), by, false).await {
            Ok((resp, mut conn)) => {
                let body = conn
                    .collect(MAX_ANSWER, by)
                    .await
                    .map_err(|_| GatewayError::UpstreamTimeout {
                        phase: crate::error::TimeoutPhase::Total,
                    })?
                    .map_err(|e| {
                        GatewayError::UpstreamProtocol(e.during("reading the response"))
                    })?;
                replica.conns.checkin(conn);
                if parts.method == http::Method::DELETE {
                    // Forget it: a later follow-up gets the engine's 404.
                    state.affinity.responses.forget(response_key(id));
                } else {
                    state
                        .affinity
                        .responses
                        .place(response_key(id), &replica.name, now);
                }
                let (head, ()) = resp.into_parts();
                let mut out = (head.status, body).into_response();
                // The replica's headers are already those that go on.
                *out.headers_mut() = head.headers;
                out.headers_mut().insert(X_REQUEST_ID.clone(), rid.clone());
                let model = replica
                    .models()
                    .first()
                    .cloned()
                    .unwrap_or_else(|| Arc::from(""));
                return Ok((model, out));
            }
            Err(e @ GatewayError::Upstream { status, .. }) if status == StatusCode::NOT_FOUND => {
                last = e;
            }
            // The replica that holds it failed: that is the answer.
            Err(e) if known.is_some() => return Err(e),
            Err(e) => {
                tracing::debug!(backend = %replica.name, error = %e, "asking for a response id");
            }
        }
    }
    Err(last)
}
