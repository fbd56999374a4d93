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
use super::quality::Inspector;
use super::shape::Shape;
use super::sse::SseSplitter;
use crate::error::GatewayError;
use crate::request::RequestGuard;
use crate::telemetry::quality::Refusal;
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
    /// Reads tool-call arguments and the answer's opening (quality
    /// signals); boxed, as most streams never need one.
    inspect: Option<Box<Inspector>>,
    /// The refusal detector still wants the answer's text.
    listening: bool,
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
            inspect: None,
            listening: false,
        }
    }

    /// Read the answer's opening for refusal phrases (not a raw stream).
    pub(crate) fn listen(&mut self, refusal: Option<std::sync::Arc<Refusal>>) {
        if let Some(r) = refusal {
            self.inspect = Some(Box::new(Inspector::new(self.wire(), Some(r))));
            self.listening = true;
        }
    }

    fn wire(&self) -> Wire {
        self.proto.as_ref().map_or(Wire::OpenAi, ProtoReader::wire)
    }

    /// Hand one event to the quality inspector.
    fn inspect(&mut self, ev: &[u8]) {
        let Some(payload) = payload_of(ev) else {
            return;
        };
        let wire = self.wire();
        let i = self
            .inspect
            .get_or_insert_with(|| Box::new(Inspector::new(wire, None)));
        i.event(&payload);
        self.listening = i.listening();
    }

    /// The answer is over: what its content said goes on the record.
    fn settle(&mut self, guard: &mut RequestGuard) {
        if let Some(i) = self.inspect.take() {
            guard.record.verdict = Some(i.finish());
        }
        self.listening = false;
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
        let data = if self.splitter.pending_len() == 0 {
            data
        } else {
            // An event began in an earlier chunk: the splitter finishes it.
            self.splitter.push(data);
            let ev = match self.splitter.next_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => return Ok(()),
                Err(_) => return Err(too_large()),
            };
            if self.on_event(&ev, at, guard)? {
                self.out.push_back(ev);
            }
            self.splitter.take_rest()
        };
        // The whole events side by side, each read in place; those forwarded
        // leave as slices of `data`, one per run (usually all of it).
        let (mut pos, mut run) = (0, 0);
        while let Some(len) = super::sse::event_len(&data[pos..]) {
            match self.on_event(&data[pos..pos + len], at, guard) {
                Ok(true) => {}
                Ok(false) => {
                    self.forward(&data, run, pos);
                    run = pos + len;
                }
                Err(e) => {
                    self.forward(&data, run, pos);
                    return Err(e);
                }
            }
            pos += len;
        }
        if run == 0 && pos == data.len() {
            self.out.push_back(data);
            return Ok(());
        }
        self.forward(&data, run, pos);
        if pos < data.len() {
            // An event that ends in a later chunk: carried.
            self.splitter.push(data.slice(pos..));
            if self.splitter.next_event().is_err() {
                return Err(too_large());
            }
        }
        Ok(())
    }

    /// Queue `data[from..to]` for the client, if anything.
    fn forward(&mut self, data: &Bytes, from: usize, to: usize) {
        if to > from {
            self.out.push_back(data.slice(from..to));
        }
    }

    /// Read one whole event: whether it goes to the client.
    fn on_event(
        &mut self,
        ev: &[u8],
        at: Instant,
        guard: &mut RequestGuard,
    ) -> Result<bool, GatewayError> {
        if self.proto.is_some() {
            return self.on_named_event(ev, at, guard);
        }
        match self.shape.classify(ev) {
            Event::Done => {
                self.done_seen = true;
                guard.record.end = Some(at);
                self.settle(guard);
                Ok(true)
            }
            Event::Chunk(c) => {
                if c.tool_call || (self.listening && c.has_output) {
                    self.inspect(ev);
                }
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
                    guard.record.fail(status, crate::error::STREAM_ERROR);
                    guard.attempt_failed(crate::error::STREAM_ERROR, true);
                }
                Ok(!(self.strip_usage && c.is_usage_only()))
            }
            Event::Other => Ok(true),
            Event::Malformed(why) => Err(GatewayError::UpstreamProtocol(why.into())),
        }
    }

    /// Read one whole event of a Messages or Responses stream; all are forwarded.
    fn on_named_event(
        &mut self,
        ev: &[u8],
        at: Instant,
        guard: &mut RequestGuard,
    ) -> Result<bool, GatewayError> {
        let (Some(reader), Some(payload)) = (self.proto.as_mut(), payload_of(ev)) else {
            // A comment or keep-alive.
            return Ok(true);
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
        if e.tool_input || (self.listening && e.has_output) {
            self.inspect(ev);
        }
        if e.is_error {
            self.errored = true;
            let status = guard.record.status;
            guard.record.fail(status, crate::error::STREAM_ERROR);
            guard.attempt_failed(crate::error::STREAM_ERROR, true);
        }
        if e.terminal {
            self.done_seen = true;
            guard.record.end = Some(at);
            self.settle(guard);
        }
        Ok(true)
    }

    /// Bytes of an event that has not ended yet.
    pub(crate) fn pending_len(&self) -> usize {
        self.splitter.pending_len()
    }

    /// The bytes of an event that never ended, taken: a stream that is over
    /// passes them on as they came (the endpoint picker forwards every byte).
    pub(crate) fn take_pending(&mut self) -> Bytes {
        self.splitter.take_rest()
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

fn too_large() -> GatewayError {
    GatewayError::UpstreamProtocol(format!("an SSE event exceeded {MAX_EVENT_BYTES} bytes").into())
}

#[cfg(test)]
mod corpus;
