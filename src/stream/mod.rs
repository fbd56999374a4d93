//! Streaming: the SSE splitter, the event reader, and the timed response body.

pub(crate) mod body;
pub(crate) mod chunk;
pub(crate) mod clock;
pub mod event;
pub(crate) mod protocols;
pub(crate) mod quality;
pub(crate) mod relay;
pub(crate) mod scan;
pub mod shape;
pub(crate) mod signal;
pub mod sse;

/// Benchmark support (`benches/hot_path.rs`): relay one chat stream's
/// `chunks` (one `data:` event each, or several) as a response body does,
/// with the refusal detector or without; the bytes queued for the client.
#[doc(hidden)]
pub fn relay_for_bench(
    chunks: &[bytes::Bytes],
    guard: &mut crate::request::RequestGuard,
    refusal: Option<std::sync::Arc<crate::telemetry::quality::Refusal>>,
) -> usize {
    let mut relay = relay::Relay::new(relay::Mode::OpenAi { strip_usage: true });
    relay.listen(refusal);
    let now = tokio::time::Instant::now();
    let mut out = 0;
    for c in chunks {
        if relay.ingest(c.clone(), now, guard).is_err() {
            break;
        }
        out += relay.take_out().len();
    }
    out
}
