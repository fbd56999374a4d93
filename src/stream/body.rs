//! The timed response body: the replica's stream, forwarded event by event to
//! the client while the gateway's clock runs.
//!
//! Three parts meet in one `poll_frame`, on the request's own task: reading
//! upstream ([`Upstream`], a replica connection decoded in place), relaying
//! events ([`Relay`]: split, classify, strip, coalesce) and the clock
//! ([`Deadlines`]: idle and total timeouts on one lazy timer). Whatever ends
//! the stream (its end, a failure, a timeout, the gateway's drain deadline,
//! the client going away), the request guard is dropped once the body is
//! over, which settles, reports and releases the request.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::Instant;

use super::clock::Deadlines;
use super::relay::{Mode, Relay};
use super::signal::{Signal, SignalWatch};
use crate::error::{GatewayError, UpstreamFault};
use crate::request::RequestGuard;
use crate::turn::{self, Turn};
use crate::upstream::conn::Conn;
use crate::upstream::pool::Replica;

/// Events already received are sent together up to this size; beyond it they
/// go out without waiting for the rest of the burst.
const MAX_BATCH_BYTES: usize = 64 << 10;

/// Where a response body's bytes come from.
pub(crate) trait Upstream: Send + Unpin + 'static {
    /// The next bytes of the body; `None` at its clean end.
    fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, UpstreamFault>>>;
    /// When the bytes `poll_data` last handed out arrived.
    fn read_at(&self) -> Instant {
        turn::now()
    }
    /// Whether a `poll_data` now is known to find nothing new (the bytes it
    /// last handed out emptied the source). `false` when unknown.
    fn drained(&self) -> bool {
        false
    }
    /// After a read that [`drained`](Self::drained) the source: register
    /// `cx` for the next bytes; whether it was (nothing new is ready).
    /// `false` when it cannot tell.
    fn wait(&mut self, _cx: &mut Context<'_>) -> bool {
        false
    }
    /// The body was read to its end: the connection may serve another request.
    fn reuse(self);
}

/// A replica connection whose response is being read.
pub(crate) struct ReplicaConn {
    pub conn: Conn,
    pub replica: Arc<Replica>,
}

impl Upstream for ReplicaConn {
    fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, UpstreamFault>>> {
        self.conn.poll_data(cx)
    }

    fn read_at(&self) -> Instant {
        self.conn.read_at()
    }

    fn drained(&self) -> bool {
        self.conn.drained()
    }

    fn wait(&mut self, cx: &mut Context<'_>) -> bool {
        self.conn.poll_wait(cx)
    }

    fn reuse(self) {
        self.replica.conns.checkin(self.conn);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Streaming,
    /// Failed: send what is queued (ending in the error event), then end.
    Closing,
    Finished,
}

pub(crate) struct TimedBody<U: Upstream = ReplicaConn> {
    /// `None` once the stream is over: back to the pool after a clean end,
    /// dropped mid-body to close the connection, which cancels the request
    /// on the replica.
    upstream: Option<U>,
    relay: Relay,
    raw: bool,
    clock: Deadlines,
    /// `None` once the request has ended (reported). Boxed as it came from
    /// the handler: moved in without a copy, and the body stays small.
    guard: Option<Box<RequestGuard>>,
    /// The first chunk, read before the response headers were sent.
    primed: Option<Bytes>,
    /// Fires when the gateway's drain deadline passes.
    cut: SignalWatch,
    state: State,
    /// The turn of the connection's task in which the body last answered
    /// `Pending` with every waker registered (see `turn.rs`).
    waiting: Turn,
}

impl<U: Upstream> TimedBody<U> {
    /// `cut` ends the stream with an error event when it is cancelled (the
    /// gateway's drain deadline).
    pub(crate) fn new(
        upstream: U,
        mode: Mode,
        idle: Duration,
        total: Instant,
        cut: &Signal,
    ) -> Self {
        Self {
            upstream: Some(upstream),
            relay: Relay::new(mode),
            raw: mode == Mode::Raw,
            clock: Deadlines::new(turn::now(), idle, total),
            guard: None,
            primed: None,
            cut: cut.watch(),
            state: State::Streaming,
            waiting: Turn::NONE,
        }
    }

    /// Read the answer's opening with the refusal detector, if one is on.
    pub(crate) fn with_refusal(
        mut self,
        refusal: Option<std::sync::Arc<crate::telemetry::quality::Refusal>>,
    ) -> Self {
        if !self.raw {
            self.relay.listen(refusal);
        }
        self
    }

    /// Wait for the replica's first chunk, before any byte goes to the client:
    /// until then a failure is still an HTTP error (and retryable by policy).
    pub(crate) async fn first_chunk(&mut self) -> Result<(), GatewayError> {
        std::future::poll_fn(|cx| self.poll_first_chunk(cx)).await
    }

    fn poll_first_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), GatewayError>> {
        loop {
            let Some(up) = self.upstream.as_mut() else {
                return Poll::Ready(Err(GatewayError::UpstreamProtocol(
                    "stream already closed".into(),
                )));
            };
            match ready!(up.poll_data(cx)) {
                Some(Ok(data)) => {
                    if !data.is_empty() {
                        self.clock.touch(up.read_at());
                        self.primed = Some(data);
                        return Poll::Ready(Ok(()));
                    }
                }
                Some(Err(e)) => {
                    self.upstream = None;
                    return Poll::Ready(Err(GatewayError::UpstreamProtocol(
                        e.during("connection lost before the first event"),
                    )));
                }
                None => {
                    self.upstream = None;
                    return Poll::Ready(Err(GatewayError::UpstreamProtocol(
                        "the replica closed the stream without sending anything".into(),
                    )));
                }
            }
        }
    }

    /// When the latest upstream chunk arrived.
    pub(crate) fn frame_time(&self) -> Instant {
        self.clock.last()
    }

    /// The body takes over the request: it is accounted event by event and
    /// ends when the body does. Until then events are not read (the first
    /// chunk waits in `primed`).
    #[cfg(test)]
    pub(crate) fn with_guard(mut self, guard: Box<RequestGuard>) -> Self {
        self.attach(guard);
        self
    }

    /// [`with_guard`](Self::with_guard) in place (a boxed body).
    pub(crate) fn attach(&mut self, guard: Box<RequestGuard>) {
        self.guard = Some(guard);
    }

    /// End the stream with an error event; closes the upstream connection
    /// (which cancels the request on the replica). `upstream_fault`: the
    /// replica broke it (counted against the replica), rather than the gateway.
    fn fail(&mut self, err: &GatewayError, upstream_fault: bool) {
        self.upstream = None;
        self.state = State::Closing;
        if let Some(g) = self.guard.as_mut() {
            g.on_cut(turn::now());
            if upstream_fault {
                g.attempt_error(err);
            }
            let status = g.record.status;
            g.record.fail(status, err.kind());
        }
        self.relay.push_error(err);
    }

    /// Account a chunk that arrived at `at` (Raw bodies are not read).
    fn ingest(&mut self, data: Bytes, at: Instant) {
        let Some(g) = self.guard.as_mut() else {
            return;
        };
        if let Err(e) = self.relay.ingest(data, at, g) {
            self.fail(&e, true);
        }
    }

    /// Upstream ended cleanly; an event stream must have finished properly.
    fn on_upstream_end(&mut self) {
        if !self.raw {
            let finished = self
                .guard
                .as_ref()
                .is_some_and(|g| g.record.finish_reason.is_some());
            if self.relay.pending_len() > 0 && !self.relay.done_seen {
                let e = GatewayError::UpstreamProtocol(
                    "the replica closed the stream in the middle of an event".into(),
                );
                return self.fail(&e, true);
            }
            if !self.relay.complete(finished) {
                let e = GatewayError::UpstreamProtocol(
                    "the replica closed the stream before it finished".into(),
                );
                return self.fail(&e, true);
            }
        }
        let last = self.clock.last();
        if let Some(g) = self.guard.as_mut() {
            g.record.end.get_or_insert(last);
        }
        self.state = State::Finished;
        if let Some(up) = self.upstream.take() {
            up.reuse();
        }
    }

    /// The body is over: the request ends (settled, reported, released).
    fn end(&mut self) {
        self.state = State::Finished;
        self.upstream = None;
        self.guard = None;
    }
}

impl<U: Upstream> Body for TimedBody<U> {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        // Pending already in this poll of the task: nothing can have changed
        // that has not also woken the task for another poll.
        let turn = turn::current();
        if turn.is_some() && this.waiting == turn {
            return Poll::Pending;
        }
        if let Some(first) = this.primed.take() {
            if this.raw {
                return Poll::Ready(Some(Ok(Frame::data(first))));
            }
            let at = this.clock.last();
            this.ingest(first, at);
        }
        loop {
            // Forward what is queued once nothing more is ready right now (or the
            // batch is large): a burst leaves in one write, a lone token at once.
            if this.relay.has_output()
                && (this.state != State::Streaming || this.relay.queued_bytes() >= MAX_BATCH_BYTES)
            {
                return Poll::Ready(Some(Ok(Frame::data(this.relay.take_out()))));
            }
            if this.state != State::Streaming {
                this.end();
                return Poll::Ready(None);
            }
            let Some(up) = this.upstream.as_mut() else {
                this.end();
                continue;
            };
            match up.poll_data(cx) {
                Poll::Ready(Some(Ok(data))) => {
                    let now = up.read_at();
                    let drained = up.drained();
                    this.clock.touch(now);
                    if this.raw {
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                    this.ingest(data, now);
                    // Nothing more is ready: say so without asking the socket
                    // again. In a turn, every waker is registered now, so
                    // that the server's next poll in this turn (to learn
                    // that nothing more came) is answered at once.
                    if drained && this.state == State::Streaming && this.relay.has_output() {
                        if turn.is_some()
                            && this.upstream.as_mut().is_some_and(|up| up.wait(cx))
                            && !this.cut.poll(cx)
                            && this.clock.poll_expired(cx).is_none()
                        {
                            this.waiting = turn;
                        }
                        return Poll::Ready(Some(Ok(Frame::data(this.relay.take_out()))));
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    let e = GatewayError::UpstreamProtocol(e.during("connection lost mid-stream"));
                    this.fail(&e, true);
                }
                Poll::Ready(None) => this.on_upstream_end(),
                Poll::Pending => {
                    if this.relay.has_output() {
                        // Timers are checked on the next poll, after this write.
                        return Poll::Ready(Some(Ok(Frame::data(this.relay.take_out()))));
                    }
                    if this.cut.poll(cx) {
                        this.fail(&GatewayError::ShuttingDown, false);
                        continue;
                    }
                    match this.clock.poll_expired(cx) {
                        Some(phase) => this.fail(&GatewayError::UpstreamTimeout { phase }, true),
                        None => {
                            this.waiting = turn;
                            return Poll::Pending;
                        }
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.state == State::Finished && !self.relay.has_output()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

impl<U: Upstream> Drop for TimedBody<U> {
    fn drop(&mut self) {
        if self.state == State::Streaming
            && let Some(g) = self.guard.as_mut()
        {
            // Dropped mid-stream: hyper gave up on the client connection.
            g.record.disconnected = true;
            g.on_cut(turn::now());
        }
        // First close the replica connection (which cancels the request
        // there), then end the request.
        self.upstream = None;
        self.guard = None;
    }
}

#[cfg(test)]
mod tests;
