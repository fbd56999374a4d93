//! The demo's trace sink: an OTLP/HTTP receiver (`POST /v1/traces`, protobuf)
//! in the demo's own process, so that `sluice demo` runs with tracing on
//! without a collector. It decodes each export and counts the spans; it
//! keeps nothing else. A real deployment points `telemetry.tracing.endpoint`
//! at its collector instead.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message as _;
use tokio::net::TcpListener;

/// What the sink received.
#[derive(Debug, Default)]
pub(crate) struct Received {
    pub exports: AtomicU64,
    pub spans: AtomicU64,
}

/// Listen on a free loopback port; the OTLP/HTTP base URL and the counts.
pub(crate) async fn start() -> anyhow::Result<(String, Arc<Received>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr: SocketAddr = listener.local_addr()?;
    let got = Arc::new(Received::default());
    let app = Router::new()
        .route("/v1/traces", post(export))
        .with_state(got.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((format!("http://{addr}"), got))
}

async fn export(State(got): State<Arc<Received>>, body: Bytes) -> impl IntoResponse {
    let Ok(req) = ExportTraceServiceRequest::decode(body) else {
        return (StatusCode::BAD_REQUEST, "not an OTLP trace export").into_response();
    };
    let spans: usize = req
        .resource_spans
        .iter()
        .flat_map(|r| &r.scope_spans)
        .map(|s| s.spans.len())
        .sum();
    got.exports.fetch_add(1, Relaxed);
    got.spans.fetch_add(spans as u64, Relaxed);
    // An empty ExportTraceServiceResponse: everything accepted.
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/x-protobuf")],
        Bytes::new(),
    )
        .into_response()
}
