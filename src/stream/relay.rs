//! Relaying events: a replica's bytes cut into whole SSE events, each read
//! once for what the request accounts (output? finish? usage? error?), and
//! queued for the client untouched (the usage chunk the client did not ask
//! for excepted).
//!
//! Events that sit side by side in one upstream chunk leave as one slice of
//! it (no copy), so a replica that batches events costs one downstream write,
//! not one per event. No I/O and no clock here: the body hands in each chunk
//! with the time it arrived.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};
use tokio::time::Instant;

use super::event::{Event, payload_of};
use super::protocols::ProtoReader;
use super::shape::Shape;
use super::sse::SseSplitter;
use crate::error::GatewayError;
use crate::request::RequestGuard;
use crate::vocab::Wire;

/// Largest single SSE event accepted from a replica.
pub(crate) const MAX_EVENT_BYTES: usize = 4 << 20;

/// How a response's events are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// An OpenAI chat/completions stream: events parsed for timing and usage.
    OpenAi {
        /// Drop the usage-only chunk: the gateway asked for it, the client did not.
        strip_usage: bool,
    },
    /// An Anthropic Messages or OpenAI Responses stream: events read for
    /// timing and usage, all forwarded.
    Named(Wire),
    /// Any other response: bytes forwarded as they come, only the end is timed.
    Raw,
}

pub(crate) struct Relay {
    splitter: SseSplitter,
    /// What goes to the client next, in order (usually one slice per chunk).
    out: VecDeque<Bytes>,
    strip_usage: bool,
    /// What this stream's token events look like (chat and completions).
    shape: Shape,
    /// The reader of a Messages or Responses stream.
    proto: Option<ProtoReader>,
    /// The stream's last event was seen (`data: [DONE]`, `message_stop`, a
    /// terminal `response.*`).
    pub done_seen: bool,
    /// The replica reported an error in-band (Messages, Responses): the
    /// client has its error event, the stream may end without more.
    pub(crate) errored: bool,
}

impl Relay {
    pub(crate) fn new(mode: Mode) -> Self {
        Self {
            splitter: SseSplitter::new(MAX_EVENT_BYTES),
            out: VecDeque::with_capacity(4),
            strip_usage: matches!(mode, Mode::OpenAi { strip_usage: true }),
            shape: Shape::default(),
            proto: match mode {
                Mode::Named(wire) => Some(ProtoReader::new(wire)),
                _ => None,
            },
            done_seen: false,
            errored: false,
        }
    }

    /// Whether a stream that ends now ended properly: its last event came
    /// (or an error the client already has); for chat also a finish reason.
    pub(crate) fn complete(&self, finished: bool) -> bool {
        match self.proto {
            Some(_) => self.done_seen || self.errored,
            None => self.done_seen || finished,
        }
    }

    /// Queue `err` as the stream's last event, in the stream's protocol.
    pub(crate) fn push_error(&mut self, err: &GatewayError) {
        let event = match &self.proto {
            None => err.sse_event(),
            Some(p) => err.named_sse_event(p.wire(), p.next_sequence()),
        };
        self.out.push_back(event);
    }

    /// Account every complete event of `data` (arrived at `at`) on `guard`
    /// and queue what goes to the client. A broken event is an error: what
    /// came before it is still queued, nothing after it is read.
    pub(crate) fn ingest(
        &mut self,
        data: Bytes,
        at: Instant,
        guard: &mut RequestGuard,
    ) -> Result<(), GatewayError> {
        if self.splitter.pending_len() == 0 && super::sse::is_single_event(&data) {
            // One whole event, nothing carried over: no splitting, no bookkeeping.
            if let Some(ev) = self.on_event(data, at, guard)? {
                self.out.push_back(ev);
            }
            return Ok(());
        }
        let origin = data.clone();
        self.splitter.push(data);
        loop {
            let ev = match self.splitter.next_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => return Ok(()),
                Err(_) => {
                    return Err(GatewayError::UpstreamProtocol(
                        format!("an SSE event exceeded {MAX_EVENT_BYTES} bytes").into(),
                    ));
                }
            };
            if let Some(ev) = self.on_event(ev, at, guard)? {
                self.enqueue(ev, &origin);
            }
        }
    }

    /// Read one whole event: forward it (`Some`) or drop it.
    fn on_event(
        &mut self,
        ev: Bytes,
        at: Instant,
        guard: &mut RequestGuard,
    ) -> Result<Option<Bytes>, GatewayError> {
        if self.proto.is_some() {
            return self.on_named_event(ev, at, guard);
        }
        match self.shape.classify(&ev) {
            Event::Done => {
                self.done_seen = true;
                guard.record.end = Some(at);
                Ok(Some(ev))
            }
            Event::Chunk(c) => {
                if c.has_output {
                    guard.on_output(at);
                }
                if let Some(f) = c.finish_reason {
                    guard.record.finish_reason = Some(f);
                }
                if let Some(u) = c.usage {
                    guard.record.usage = Some(u);
                }
                if c.is_error {
                    // The engine reported a failure in-band; the client gets it as is.
                    let status = guard.record.status;
                    guard.record.fail(status, "upstream_stream_error");
                    guard.attempt_failed("upstream_stream_error", true);
                }
                if self.strip_usage && c.is_usage_only() {
                    return Ok(None);
                }
                Ok(Some(ev))
            }
            Event::Other => Ok(Some(ev)),
            Event::Malformed(why) => Err(GatewayError::UpstreamProtocol(why.into())),
        }
    }

    /// Read one whole event of a Messages or Responses stream; all are forwarded.
    fn on_named_event(
        &mut self,
        ev: Bytes,
        at: Instant,
        guard: &mut RequestGuard,
    ) -> Result<Option<Bytes>, GatewayError> {
        let (Some(reader), Some(payload)) = (self.proto.as_mut(), payload_of(&ev)) else {
            // A comment or keep-alive.
            return Ok(Some(ev));
        };
        let e = reader
            .read(&payload)
            .map_err(|why| GatewayError::UpstreamProtocol(why.into()))?;
        if e.has_output {
            guard.on_output(at);
        }
        if let Some(f) = e.finish_reason {
            guard.record.finish_reason = Some(f);
        }
        if let Some(u) = reader.usage() {
            guard.record.usage = Some(u);
        }
        if let Some(id) = e.response_id
            && guard.record.response_id.is_none()
        {
            guard.record.response_id = Some(id);
        }
        if e.is_error {
            self.errored = true;
            let status = guard.record.status;
            guard.record.fail(status, "upstream_stream_error");
            guard.attempt_failed("upstream_stream_error", true);
        }
        if e.terminal {
            self.done_seen = true;
            guard.record.end = Some(at);
        }
        Ok(Some(ev))
    }

    fn enqueue(&mut self, ev: Bytes, origin: &Bytes) {
        if let Some(last) = self.out.back_mut()
            && let Some(start) = offset_in(origin, last)
            && offset_in(origin, &ev) == Some(start + last.len())
        {
            *last = origin.slice(start..start + last.len() + ev.len());
            return;
        }
        self.out.push_back(ev);
    }

    /// Bytes of an event that has not ended yet.
    pub(crate) fn pending_len(&self) -> usize {
        self.splitter.pending_len()
    }

    pub(crate) fn has_output(&self) -> bool {
        !self.out.is_empty()
    }

    pub(crate) fn queued_bytes(&self) -> usize {
        self.out.iter().map(Bytes::len).sum()
    }

    /// Everything queued, as one buffer: the slice itself when there is one
    /// (the common case, no copy), else one copy that saves a write per event.
    pub(crate) fn take_out(&mut self) -> Bytes {
        if self.out.len() == 1 {
            return self.out.pop_front().unwrap_or_default();
        }
        let mut buf = BytesMut::with_capacity(self.queued_bytes());
        for b in self.out.drain(..) {
            buf.extend_from_slice(&b);
        }
        buf.freeze()
    }
}

/// Where `part` starts inside `whole`, if it is a slice of it.
fn offset_in(whole: &Bytes, part: &Bytes) -> Option<usize> {
    let (w, p) = (whole.as_ptr() as usize, part.as_ptr() as usize);
    (p >= w && p + part.len() <= w + whole.len()).then(|| p - w)
}

#[cfg(test)]
mod corpus;
