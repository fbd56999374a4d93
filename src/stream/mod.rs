//! Streaming: the SSE splitter, the event reader, and the timed response body.

pub mod body;
pub mod chunk;
pub mod clock;
pub mod event;
pub mod relay;
pub mod scan;
pub mod sse;
