//! Streaming: the SSE splitter, the event reader, and the timed response body.

pub mod body;
pub mod event;
pub mod scan;
pub mod sse;
