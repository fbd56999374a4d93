//! Endpoint-picker mode: Sluice as the picker of a Gateway API Inference
//! Extension `InferencePool`, over Envoy's external processing protocol
//! (`envoy.service.ext_proc.v3.ExternalProcessor`, a bidirectional gRPC
//! stream per HTTP request).
//!
//! Each stream is served by one task ([`exchange`]) that decides with the
//! proxy's own steps over the gateway's live state (same pool, routing
//! memory, flow control and metrics as the API listener): every Sluice
//! replica decides from inputs they all see alike, so pickers run
//! active-active, without leader election. The gRPC health services
//! (`grpc.health.v1`) answer on a listener of their own: `liveness` always
//! SERVING, `readiness`, the processor's name and `""` while a replica is
//! ready.

mod exchange;
mod wire;

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;

use crate::state::Live;
use crate::stream::signal::Signal;

/// The processor's service name, as the data plane health-checks it.
pub const SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// Answers a stream may have queued for the data plane before the picker
/// waits for it to read them (a request body of up to ~16 chunks).
const QUEUED_ANSWERS: usize = 16;

/// Room in a message for what comes with a body (headers, metadata).
const MESSAGE_OVERHEAD: usize = 1 << 20;

/// HTTP/2 flow-control windows the picker grants the data plane: a body of
/// a few hundred KB arrives in one flight instead of waiting a round trip
/// per 64 KiB (h2's default). Envoy grants 256 MiB the other way; the
/// picker reads every stream's messages as they come, so the window bounds
/// bytes in flight, not memory held.
const STREAM_WINDOW: u32 = 2 << 20;
const CONNECTION_WINDOW: u32 = 16 << 20;

/// How often readiness follows the pool's health.
const READINESS_EVERY: Duration = Duration::from_millis(250);

struct Processor {
    live: Arc<Live>,
}

#[tonic::async_trait]
impl ExternalProcessor for Processor {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (tx, rx) = mpsc::channel(QUEUED_ANSWERS);
        // The state current when the stream opened serves it to its end,
        // as a request of the API listener keeps its snapshot.
        let state = self.live.load();
        // Raised when the drain deadline passes (`Gateway::shutdown`).
        let cut = state.cut.clone();
        let mut inbound = request.into_inner();
        tokio::spawn(async move {
            let mut x = exchange::Exchange::new(state, tx.clone());
            loop {
                // The cut first: a seat it frees elsewhere must not let a
                // request held here be picked after the deadline.
                let msg = tokio::select! {
                    biased;
                    () = cut.raised() => {
                        x.cut().await;
                        break;
                    }
                    m = inbound.message() => m,
                    // The data plane stopped reading: the stream is gone.
                    () = tx.closed() => break,
                };
                let m = match msg {
                    Ok(Some(m)) => m,
                    // The data plane closed or reset the stream.
                    Ok(None) | Err(_) => break,
                };
                // A request held by flow control (or a message waiting for
                // room to answer) is cut too.
                let cut_now = tokio::select! {
                    biased;
                    () = cut.raised() => true,
                    r = x.on(m) => match r {
                        Ok(()) => false,
                        Err(exchange::Over) => break,
                    },
                };
                if cut_now {
                    x.cut().await;
                    break;
                }
            }
            // `x` drops here with its request's guard: whatever was not
            // finished is reported and released.
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The picker's two servers, running until `stop`.
pub(crate) fn serve(
    live: Arc<Live>,
    listener: TcpListener,
    health: TcpListener,
    stop: &Signal,
) -> Vec<JoinHandle<()>> {
    let (reporter, health_service) = tonic_health::server::health_reporter();
    // A buffered body (and its answer) is one message: as large as the
    // largest body the gateway takes or answer it reads, not tonic's
    // default 4 MiB. Read at start, as the listener is.
    let largest = {
        let c = &live.load().config;
        let most = c
            .server
            .max_body_bytes
            .as_usize()
            .max(c.upstream.max_response_bytes.as_usize());
        most.saturating_add(MESSAGE_OVERHEAD)
    };
    let processor = ExternalProcessorServer::new(Processor { live: live.clone() })
        .max_decoding_message_size(largest)
        .max_encoding_message_size(largest);
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let s = stop.clone();
    let picker = tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .add_service(processor)
            .serve_with_incoming_shutdown(incoming, s.raised())
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "the endpoint picker's listener failed");
        }
    });
    let s = stop.clone();
    let health_incoming = TcpIncoming::from(health).with_nodelay(Some(true));
    let health_server = tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .add_service(health_service)
            .serve_with_incoming_shutdown(health_incoming, s.raised())
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "the endpoint picker's health listener failed");
        }
    });
    let s = stop.clone();
    let readiness = tokio::spawn(async move {
        reporter
            .set_service_status("liveness", ServingStatus::Serving)
            .await;
        let mut was = None;
        let mut tick = tokio::time::interval(READINESS_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = s.raised() => break,
            }
            let ready = live.load().pool.replicas().iter().any(|r| r.is_healthy());
            if was == Some(ready) {
                continue;
            }
            was = Some(ready);
            let status = if ready {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            for name in ["readiness", SERVICE, ""] {
                reporter.set_service_status(name, status).await;
            }
        }
    });
    vec![picker, health_server, readiness]
}
