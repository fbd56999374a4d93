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
