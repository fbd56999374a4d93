//! The timed response body: the replica's stream, forwarded event by event to
//! the client while the gateway's clock runs.
//!
//! Each upstream chunk is split into whole SSE events (zero-copy slices), each
//! event is classified (output? usage? finish? error?) and forwarded untouched,
//! except the usage-only chunk the gateway itself asked for. Timeouts are checked
//! lazily: one timer, re-armed only when it fires, so a busy stream pays no
//! timer work per token. Whatever ends the stream (the end, a failure, a
//! timeout, the client going away) ends in `Drop`, which records the request.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::Sleep;

use super::event::{Event, classify};
use super::sse::SseSplitter;
use crate::error::{GatewayError, TimeoutPhase};
use crate::telemetry::record::Completion;
use crate::upstream::conn::Conn;
use crate::upstream::pool::{InFlight, Replica};
use std::sync::Arc;

/// Largest single SSE event accepted from a replica.
pub const MAX_EVENT_BYTES: usize = 4 << 20;

/// Events already received are sent together up to this size; beyond it they
/// go out without waiting for the rest of the burst.
const MAX_BATCH_BYTES: usize = 64 << 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// An OpenAI chat/completions stream: events parsed for timing and usage.
    OpenAi {
        /// Drop the usage-only chunk: the gateway asked for it, the client did not.
        strip_usage: bool,
    },
    /// Any other response: bytes forwarded as they come, only the end is timed.
    Raw,
}

pub struct TimedBody {
    /// The connection the body arrives on, read from `poll_frame` (see
    /// `upstream::conn`); `None` once the stream is over: back to the pool
    /// after a clean end, dropped mid-body to close the connection, which
    /// cancels the request on the replica.
    conn: Option<Conn>,
    splitter: SseSplitter,
    /// The first chunk, read before the response headers were sent.
    primed: Option<Bytes>,
    /// What goes to the client next, in order (usually one slice per chunk).
    out: VecDeque<Bytes>,
    completion: Completion,
    in_flight: InFlight,
    mode: Mode,
    idle: Duration,
    deadline: Instant,
    /// When the latest upstream chunk arrived (the timestamp of its events).
    frame_time: Instant,
    timer: Pin<Box<Sleep>>,
    done_seen: bool,
    state: State,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Streaming,
    /// Failed: send what is queued (ending in the error event), then end.
    Closing,
    Finished,
}

impl TimedBody {
    pub fn new(
        conn: Conn,
        completion: Completion,
        in_flight: InFlight,
        mode: Mode,
        idle: Duration,
        deadline: Instant,
    ) -> Self {
        let now = Instant::now();
        let first_alarm = deadline.min(now + idle);
        Self {
            conn: Some(conn),
            splitter: SseSplitter::new(MAX_EVENT_BYTES),
            primed: None,
            out: VecDeque::with_capacity(4),
            completion,
            in_flight,
            mode,
            idle,
            deadline,
            frame_time: now,
            timer: Box::pin(tokio::time::sleep_until(first_alarm.into())),
            done_seen: false,
            state: State::Streaming,
        }
    }

    /// Wait for the replica's first chunk, before any byte goes to the client:
    /// until then a failure is still an HTTP error (and retryable by policy).
    pub async fn first_chunk(&mut self) -> Result<(), GatewayError> {
        std::future::poll_fn(|cx| self.poll_first_chunk(cx)).await
    }

    fn poll_first_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), GatewayError>> {
        loop {
            let Some(up) = self.conn.as_mut() else {
                return Poll::Ready(Err(GatewayError::UpstreamProtocol(
                    "stream already closed".into(),
                )));
            };
            match ready!(up.poll_data(cx)) {
                Some(Ok(data)) => {
                    if !data.is_empty() {
                        self.frame_time = Instant::now();
                        self.primed = Some(data);
                        return Poll::Ready(Ok(()));
                    }
                }
                Some(Err(e)) => {
                    self.conn = None;
                    return Poll::Ready(Err(GatewayError::UpstreamProtocol(format!(
                        "connection lost before the first event: {e}"
                    ))));
                }
                None => {
                    self.conn = None;
                    return Poll::Ready(Err(GatewayError::UpstreamProtocol(
                        "the replica closed the stream without sending anything".into(),
                    )));
                }
            }
        }
    }

    /// The response was read to its end: the connection may serve another
    /// request, and the replica earned a success (unless it reported an error).
    fn release_conn(&mut self) {
        if let Some(c) = self.conn.take() {
            self.in_flight.replica().conns.checkin(c);
        }
        if self.completion.record.error_kind.is_none() {
            self.in_flight.replica().record_success();
        }
    }

    /// When the latest upstream chunk arrived.
    pub fn frame_time(&self) -> Instant {
        self.frame_time
    }

    pub fn replica(&self) -> &Arc<Replica> {
        self.in_flight.replica()
    }

    pub fn completion_mut(&mut self) -> &mut Completion {
        &mut self.completion
    }

    /// End the stream with an OpenAI error event; cancels the upstream request.
    fn fail(&mut self, err: GatewayError) -> Bytes {
        self.conn = None;
        if err.blames_replica() {
            self.in_flight.replica().record_failure();
        }
        self.state = State::Closing;
        self.completion.on_cut(Instant::now());
        self.completion.upstream_error(err.kind());
        let status = self.completion.record.status;
        self.completion.fail(status, err.kind());
        tracing::debug!(error = %err, "stream failed after the first byte");
        err.sse_event()
    }

    /// Decide what to do with one whole event: forward it (`Some`) or drop it.
    fn on_event(&mut self, ev: Bytes) -> Result<Option<Bytes>, GatewayError> {
        let strip_usage = matches!(self.mode, Mode::OpenAi { strip_usage: true });
        match classify(&ev) {
            Event::Done => {
                self.done_seen = true;
                self.completion.record.end = Some(self.frame_time);
                Ok(Some(ev))
            }
            Event::Chunk(c) => {
                if c.has_output {
                    self.completion.on_output(self.frame_time);
                }
                if let Some(f) = c.finish_reason {
                    self.completion.record.finish_reason = Some(f);
                }
                if let Some(u) = c.usage {
                    self.completion.record.usage = Some(u);
                }
                if c.is_error {
                    // The engine reported a failure in-band; the client gets it as is.
                    let status = self.completion.record.status;
                    self.completion.fail(status, "upstream_stream_error");
                    self.completion.upstream_error("upstream_stream_error");
                    self.in_flight.replica().record_failure();
                }
                if strip_usage && c.is_usage_only() {
                    return Ok(None);
                }
                Ok(Some(ev))
            }
            Event::Other => Ok(Some(ev)),
            Event::Malformed(why) => Err(GatewayError::UpstreamProtocol(why.into())),
        }
    }

    /// Upstream ended cleanly; an OpenAI stream must have finished properly.
    fn on_upstream_end(&mut self) -> Option<Bytes> {
        if let Mode::Raw = self.mode {
            self.completion.record.end.get_or_insert(self.frame_time);
            self.state = State::Finished;
            self.release_conn();
            return None;
        }
        if self.splitter.pending_len() > 0 && !self.done_seen {
            return Some(self.fail(GatewayError::UpstreamProtocol(
                "the replica closed the stream in the middle of an event".into(),
            )));
        }
        if !self.done_seen && self.completion.record.finish_reason.is_none() {
            return Some(self.fail(GatewayError::UpstreamProtocol(
                "the replica closed the stream before it finished".into(),
            )));
        }
        self.completion.record.end.get_or_insert(self.frame_time);
        self.state = State::Finished;
        self.release_conn();
        None
    }

    /// Called when upstream is pending: fire a timeout if one is due.
    fn poll_timers(&mut self, cx: &mut Context<'_>) -> Option<GatewayError> {
        while self.timer.as_mut().poll(cx).is_ready() {
            let now = Instant::now();
            if now >= self.deadline {
                return Some(GatewayError::UpstreamTimeout {
                    phase: TimeoutPhase::Total,
                });
            }
            let idle_at = self.frame_time + self.idle;
            if now >= idle_at {
                return Some(GatewayError::UpstreamTimeout {
                    phase: TimeoutPhase::Idle,
                });
            }
            // Not due yet (chunks kept coming): re-arm for the real deadline.
            self.timer.as_mut().reset(idle_at.min(self.deadline).into());
        }
        None
    }
}

impl TimedBody {
    /// Account every complete event of an upstream chunk now and queue what
    /// goes to the client. Events that sit side by side in the chunk leave as
    /// one slice of it (no copy), so a replica that batches events costs one
    /// downstream write, not one per event.
    fn ingest(&mut self, data: Bytes) {
        if self.splitter.pending_len() == 0 && super::sse::is_single_event(&data) {
            // One whole event, nothing carried over: no splitting, no bookkeeping.
            match self.on_event(data) {
                Ok(Some(ev)) => self.out.push_back(ev),
                Ok(None) => {}
                Err(e) => {
                    let ev = self.fail(e);
                    self.out.push_back(ev);
                }
            }
            return;
        }
        let origin = data.clone();
        self.splitter.push(data);
        loop {
            let ev = match self.splitter.next_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => return,
                Err(_) => {
                    let e = GatewayError::UpstreamProtocol(format!(
                        "an SSE event exceeded {MAX_EVENT_BYTES} bytes"
                    ));
                    let ev = self.fail(e);
                    self.out.push_back(ev);
                    return;
                }
            };
            match self.on_event(ev) {
                Ok(Some(ev)) => self.enqueue(ev, &origin),
                Ok(None) => {}
                Err(e) => {
                    let ev = self.fail(e);
                    self.out.push_back(ev);
                    return;
                }
            }
        }
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
}

impl TimedBody {
    fn queued_bytes(&self) -> usize {
        self.out.iter().map(Bytes::len).sum()
    }

    /// Everything queued, as one buffer: the slice itself when there is one
    /// (the common case, no copy), else one copy that saves a write per event.
    fn take_out(&mut self) -> Bytes {
        if self.out.len() == 1 {
            return self.out.pop_front().unwrap_or_default();
        }
        let mut buf = bytes::BytesMut::with_capacity(self.queued_bytes());
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

impl Body for TimedBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        if let Some(first) = this.primed.take() {
            match this.mode {
                Mode::Raw => return Poll::Ready(Some(Ok(Frame::data(first)))),
                Mode::OpenAi { .. } => this.ingest(first),
            }
        }
        loop {
            // Forward what is queued once nothing more is ready right now (or the
            // batch is large): a burst leaves in one write, a lone token at once.
            if !this.out.is_empty()
                && (this.state != State::Streaming || this.queued_bytes() >= MAX_BATCH_BYTES)
            {
                return Poll::Ready(Some(Ok(Frame::data(this.take_out()))));
            }
            if this.state != State::Streaming {
                this.state = State::Finished;
                return Poll::Ready(None);
            }
            let Some(up) = this.conn.as_mut() else {
                this.state = State::Finished;
                continue;
            };
            match up.poll_data(cx) {
                Poll::Ready(Some(Ok(data))) => {
                    this.frame_time = Instant::now();
                    match this.mode {
                        Mode::Raw => return Poll::Ready(Some(Ok(Frame::data(data)))),
                        Mode::OpenAi { .. } => this.ingest(data),
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    let e =
                        GatewayError::UpstreamProtocol(format!("connection lost mid-stream: {e}"));
                    let ev = this.fail(e);
                    this.out.push_back(ev);
                }
                Poll::Ready(None) => {
                    if let Some(ev) = this.on_upstream_end() {
                        this.out.push_back(ev);
                    }
                }
                Poll::Pending => {
                    if !this.out.is_empty() {
                        // Timers are checked on the next poll, after this write.
                        return Poll::Ready(Some(Ok(Frame::data(this.take_out()))));
                    }
                    match this.poll_timers(cx) {
                        Some(e) => {
                            let ev = this.fail(e);
                            this.out.push_back(ev);
                        }
                        None => return Poll::Pending,
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.state == State::Finished && self.out.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

impl Drop for TimedBody {
    fn drop(&mut self) {
        if self.state == State::Streaming {
            // Dropped mid-stream: hyper gave up on the client connection.
            self.completion.record.disconnected = true;
            self.completion.on_cut(Instant::now());
        }
        // Fields drop next: `conn` closes the replica connection (cancel),
        // `completion` records the request, `in_flight` releases the replica.
    }
}
