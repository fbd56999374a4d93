//! The API listener's own HTTP/1.1 server (`server.http1: own`, the
//! default; `hyper` keeps hyper's server as before).
//!
//! Measured reason (docs/benchmarks-log.md, "The gateway's own HTTP/1.1
//! server"): hyper's dispatcher polls a streaming body three times per
//! wake-up, formats every chunk-size line through `fmt`, reads the client's
//! socket on every pass, and spends ~16,000 instructions of a non-streamed
//! request's ~67,000 before any gateway work. This server does what a
//! gateway in front of LLM replicas needs and nothing else:
//!
//! - one task per connection that reads heads ([`head`]), runs the handler
//!   and writes its response, one request at a time (pipelined requests wait
//!   in the read buffer);
//! - request bodies sized or chunked (decoded by the upstream client's
//!   decoder, [`Wire`]); one whole in the first read goes to the handler as
//!   one `Bytes`, a longer one is fed to it as it arrives ([`body`]), with
//!   `100 Continue` sent when the handler first asks for it;
//! - a response body polled once per wake-up, its ready frames written in one
//!   `write`; sized, chunked, or (HTTP/1.0) until close;
//! - while a request runs, a close of the client's socket cancels it (as
//!   hyper does): dropping the handler or the response body ends the
//!   request upstream;
//! - `server.header_timeout` for each head, idle keep-alive included; on
//!   shutdown, idle connections close at once and busy ones after their
//!   response.
//!
//! `tests/it/h1.rs` runs a corpus of requests (valid, malformed, pipelined,
//! chunked, `100-continue`, oversized) against both servers and requires the
//! same answers.

mod body;
mod head;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::body::Body;
use bytes::BytesMut;
use http_body::Body as _;
use tokio::io::{AsyncWrite, Interest};
use tokio::time::Instant;

use self::body::Feed;
use self::head::{Asked, BodyFraming, Out, Refused};
use crate::app::{Answer, Api};
use crate::net::{Socket, make_room};
use crate::state::Live;
use crate::stream::clock::Deadlines;
use crate::stream::signal::SignalWatch;
use crate::upstream::conn::read_draining;
use crate::upstream::http1::{BodyState, Chunk, Wire};

/// Read granularity: a request head and a typical JSON body fit.
const READ_BYTES: usize = 16 * 1024;
/// Response bytes queued before they are written without waiting for more.
const WRITE_BATCH: usize = 64 * 1024;
/// A write buffer grown past this by a large answer is not kept.
const KEEP_WBUF: usize = 64 * 1024;
/// Between requests, a write buffer up to this size is kept (an answer's
/// head and a small body: growing one from nothing for every answer cost
/// ~4,000 instructions a request in reallocations).
const KEEP_IDLE_WBUF: usize = 4 * 1024;
/// Room made for a response head and a small body at once.
const HEAD_ROOM: usize = 1024;

/// Serve one connection until it closes, the client goes away, or the
/// gateway stops (`stop`).
pub(super) async fn serve_conn(
    tcp: Socket,
    api: Api,
    live: Arc<Live>,
    mut stop: SignalWatch,
    header_timeout: Duration,
) {
    let mut conn = Connection {
        io: Io {
            tcp,
            wire: Wire {
                rbuf: BytesMut::new(),
                body: BodyState::Idle,
                strict: true,
            },
            wbuf: Vec::new(),
            written: 0,
            read_closed: false,
            unreadable: false,
            watched: false,
        },
        api,
        live,
        head_clock: Deadlines::gap(Instant::now(), header_timeout),
        armed: false,
        stopping: false,
        stage: Stage::Head,
    };
    std::future::poll_fn(|cx| {
        if !conn.stopping && stop.poll(cx) {
            conn.stopping = true;
        }
        // Each poll is a turn: a response body that registered every waker
        // answers the poll that follows its data at once (`src/turn.rs`).
        crate::turn::take(|| conn.poll(cx))
    })
    .await;
}

/// The socket and its buffers.
struct Io {
    tcp: Socket,
    /// The read buffer, and where a request body's decoding stands.
    wire: Wire,
    /// Response bytes queued; those before `written` are written.
    wbuf: Vec<u8>,
    written: usize,
    /// The client closed its side (or the socket failed).
    read_closed: bool,
    /// What follows in the socket cannot be read as HTTP (a request body
    /// broke its framing): answer, then close.
    unreadable: bool,
    /// The task's waker is registered for the socket's read readiness (a
    /// read found nothing). It stays so until that readiness comes.
    watched: bool,
}

struct Connection {
    io: Io,
    api: Api,
    live: Arc<Live>,
    /// The head being read must be complete within `header_timeout` of
    /// when it began to be awaited (the clock's last touch). The clock's
    /// timer is moved lazily, only when it fires: a kept-alive connection
    /// under load spends a clock read per request on it instead of a timer
    /// reset and a poll (~400 instructions).
    head_clock: Deadlines,
    /// The clock was touched for the head being read.
    armed: bool,
    /// The gateway is stopping: no request after the current one.
    stopping: bool,
    stage: Stage,
}

enum Stage {
    /// Reading a request head.
    Head,
    Serving(Box<Exchange>),
    /// Write what is queued, then close.
    Closing,
}

impl Connection {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            let next = match &mut self.stage {
                Stage::Head => match ready!(self.poll_head(cx)) {
                    Some(stage) => stage,
                    None => return Poll::Ready(()),
                },
                Stage::Serving(exchange) => {
                    match ready!(exchange.poll(&mut self.io, cx, self.stopping)) {
                        Ok(true) if !self.stopping => {
                            self.armed = false;
                            self.io.idle();
                            Stage::Head
                        }
                        Ok(_) => Stage::Closing,
                        Err(()) => return Poll::Ready(()),
                    }
                }
                Stage::Closing => {
                    let _ = ready!(self.io.poll_write(cx));
                    let _ = ready!(Pin::new(&mut self.io.tcp).poll_shutdown(cx));
                    return Poll::Ready(());
                }
            };
            self.stage = next;
        }
    }

    /// Read until a request head is complete: the next stage, or `None` to
    /// close (the client went away, the head timed out, the gateway stops).
    fn poll_head(&mut self, cx: &mut Context<'_>) -> Poll<Option<Stage>> {
        loop {
            if !self.io.wire.rbuf.is_empty() {
                match head::take(&mut self.io.wire.rbuf) {
                    Ok(Some(head)) => {
                        return Poll::Ready(Some(Stage::Serving(Box::new(self.start(head)))));
                    }
                    Ok(None) => {}
                    Err(Refused(code)) => {
                        self.refuse(code);
                        return Poll::Ready(Some(Stage::Closing));
                    }
                }
            }
            if self.stopping || self.io.read_closed || self.io.unreadable {
                return Poll::Ready(None);
            }
            match self.io.poll_read(cx) {
                Poll::Ready(0) => return Poll::Ready(None),
                Poll::Ready(_) => {}
                Poll::Pending => {
                    if !self.armed {
                        self.armed = true;
                        self.head_clock.touch(crate::turn::now());
                    }
                    return match self.head_clock.poll_expired(cx) {
                        Some(_) => Poll::Ready(None),
                        None => Poll::Pending,
                    };
                }
            }
        }
    }

    /// A request whose head is read: its body as far as it came, and its
    /// handler started.
    fn start(&mut self, head: head::Head) -> Exchange {
        let io = &mut self.io;
        let asked = Asked {
            head_method: head.method == http::Method::HEAD,
            version: head.version,
            close: !head.keep_alive,
        };
        let mut feed = None;
        let body = match head.body {
            BodyFraming::None => Body::empty(),
            // Whole in the read buffer: split off it, as it lies.
            BodyFraming::Length(n) if io.wire.rbuf.len() as u64 >= n => {
                Body::from(io.wire.rbuf.split_to(n as usize).freeze())
            }
            framing => {
                io.wire.body = match framing {
                    BodyFraming::Length(n) => BodyState::Length(n),
                    _ => BodyState::Chunked(Chunk::Size),
                };
                let (f, streamed) = body::channel();
                feed = Some(f);
                Body::new(streamed)
            }
        };
        let asked_head = crate::api::Head {
            method: head.method,
            uri: head.uri,
            headers: head.fields,
        };
        let mut exchange = Exchange {
            handler: Some(self.api.serve_head(asked_head, head.version, body)),
            expect_continue: head.expect_continue && feed.is_some(),
            feed,
            asked,
            response: None,
            out: Out::None,
            keep_alive: false,
        };
        // What of the body is already here goes in before the handler runs.
        if let Some(f) = &exchange.feed
            && exchange_feed(io, f)
        {
            exchange.feed = None;
        }
        exchange
    }

    /// Answer a head the parser refused, in the OpenAI error shape, counted
    /// like any request; then close.
    fn refuse(&mut self, code: u16) {
        let (answer, kind) = super::parse_errors::answer(code);
        super::parse_errors::count(&self.live, code, kind);
        self.io.wbuf.extend_from_slice(&answer);
    }
}

/// Decode what the read buffer holds of the request body into `feed`;
/// whether the body is over (at its end, or broken).
fn exchange_feed(io: &mut Io, feed: &Feed) -> bool {
    loop {
        match io.wire.decode() {
            Ok(Some(data)) => feed.push(data),
            Ok(None) => {
                if matches!(io.wire.body, BodyState::Done | BodyState::Length(0)) {
                    io.wire.body = BodyState::Idle;
                    feed.end(Ok(()));
                    return true;
                }
                if io.read_closed {
                    feed.end(Err(
                        "the client closed the connection before the body's end".into(),
                    ));
                    return true;
                }
                return false;
            }
            Err(e) => {
                feed.end(Err(format!("malformed chunked request body: {e}")));
                io.wire.body = BodyState::Idle;
                io.unreadable = true;
                return true;
            }
        }
    }
}

/// One request, from its handler's start to the end of its response.
struct Exchange {
    /// The handler, until it answers.
    handler: Option<Answer>,
    /// The request body, while it is still arriving.
    feed: Option<Feed>,
    /// `100 Continue` is owed when the handler asks for the body.
    expect_continue: bool,
    asked: Asked,
    /// The response body being written.
    response: Option<Body>,
    out: Out,
    /// The connection may carry another request after this one.
    keep_alive: bool,
}

impl Exchange {
    /// Drive the request to the end of its response: whether the connection
    /// may carry another (`Err`: close it now, the client went away or the
    /// socket failed).
    fn poll(
        &mut self,
        io: &mut Io,
        cx: &mut Context<'_>,
        stopping: bool,
    ) -> Poll<Result<bool, ()>> {
        // The handler, and the body it reads as it arrives.
        while let Some(handler) = &mut self.handler {
            if let Poll::Ready(Ok(resp)) = handler.as_mut().poll(cx) {
                self.handler = None;
                self.respond(io, resp, stopping);
                break;
            }
            if !self.poll_feed(io, cx) {
                break;
            }
        }
        // While the answer is awaited or streams, a close of the client's
        // side cancels the request. Bytes of a next request wait unread.
        if self.feed.is_none()
            && !io.read_closed
            && !io.unreadable
            && io.wire.rbuf.is_empty()
            && !io.still_watched()
            && let Poll::Ready(0) = io.poll_read(cx)
        {
            return Poll::Ready(Err(()));
        }
        let Some(body) = &mut self.response else {
            // Still waiting for the handler (a `100 Continue` may be queued).
            ready!(io.poll_write(cx))?;
            return match self.handler {
                None => Poll::Ready(Ok(self.keep_alive)),
                Some(_) => Poll::Pending,
            };
        };
        loop {
            let mut waiting = false;
            let mut ended = false;
            while io.wbuf.len() < WRITE_BATCH {
                match Pin::new(&mut *body).poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => {
                        if let Ok(data) = frame.into_data() {
                            put(&mut self.out, &mut self.keep_alive, &mut io.wbuf, &data);
                        }
                    }
                    // The connection ends mid-body: the client sees it cut.
                    Poll::Ready(Some(Err(_))) => return Poll::Ready(Err(())),
                    Poll::Ready(None) => {
                        match self.out {
                            Out::Chunked => io.wbuf.extend_from_slice(b"0\r\n\r\n"),
                            // Shorter than it said: the client cannot tell
                            // where the next answer starts.
                            Out::Sized(left) if left > 0 => self.keep_alive = false,
                            _ => {}
                        }
                        ended = true;
                        break;
                    }
                    Poll::Pending => {
                        waiting = true;
                        break;
                    }
                }
            }
            ready!(io.poll_write(cx))?;
            if ended {
                self.response = None;
                return Poll::Ready(Ok(self.keep_alive));
            }
            if waiting {
                return Poll::Pending;
            }
        }
    }

    /// Feed the request body from the socket: whether the handler should
    /// be polled again (it has more to read, or the body ended).
    fn poll_feed(&mut self, io: &mut Io, cx: &mut Context<'_>) -> bool {
        let Some(feed) = &self.feed else {
            return false;
        };
        if self.expect_continue && feed.asked() {
            self.expect_continue = false;
            io.wbuf.extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
            let _ = io.poll_write(cx);
        }
        let mut fed = false;
        while feed.wants(cx) && !io.unreadable {
            match io.poll_read(cx) {
                Poll::Ready(0) => io.read_closed = true,
                Poll::Ready(_) => {}
                Poll::Pending => break,
            }
            fed = true;
            if exchange_feed(io, feed) {
                self.feed = None;
                return true;
            }
        }
        fed
    }

    /// The handler's answer: its head queued, its body to follow.
    fn respond(&mut self, io: &mut Io, resp: http::Response<Body>, stopping: bool) {
        let (parts, body) = resp.into_parts();
        // A body not read to its end leaves the connection unusable; a
        // stopping gateway says it closes.
        let close =
            self.asked.close || stopping || self.feed.is_some() || io.read_closed || io.unreadable;
        let asked = Asked {
            close,
            ..self.asked
        };
        let exact = body.size_hint().exact();
        io.wbuf.reserve(HEAD_ROOM);
        let (out, close) = head::encode(&mut io.wbuf, parts.status, &parts.headers, exact, &asked);
        self.out = out;
        self.keep_alive = !close;
        // A stream holds its connection for long: an empty read buffer is
        // given back rather than held for the next request.
        if out == Out::Chunked && io.wire.rbuf.is_empty() {
            io.wire.rbuf = BytesMut::new();
        }
        self.response = (out != Out::None).then_some(body);
    }
}

/// Queue one frame of the response body as `out` frames it. Frames are
/// copied into the write buffer, large ones too: writing a large frame as it
/// lies (a vectored write after the buffer) was tried, and its bookkeeping cost
/// ~500 instructions on every non-streamed request (60,147 -> 60,634 and
/// 60,699, `benches/e2e/instructions.sh 3000`), more than the copy costs the
/// rare large answer, whose usage scan is a slower pass over the same bytes.
/// A sized body is
/// held to its length: what runs over is not sent, and the connection
/// closes after it.
fn put(out: &mut Out, keep_alive: &mut bool, wbuf: &mut Vec<u8>, data: &[u8]) {
    {
        match out {
            Out::None => {}
            Out::Sized(left) => {
                let n = usize::try_from(*left).map_or(data.len(), |l| l.min(data.len()));
                wbuf.extend_from_slice(&data[..n]);
                *left -= n as u64;
                if n < data.len() {
                    *keep_alive = false;
                }
            }
            Out::UntilClose => wbuf.extend_from_slice(data),
            Out::Chunked if data.is_empty() => {}
            Out::Chunked => {
                head::chunk_size_line(wbuf, data.len());
                wbuf.extend_from_slice(data);
                wbuf.extend_from_slice(b"\r\n");
            }
        }
    }
}

impl Io {
    /// Read what the socket has into the read buffer: how many bytes, 0 when
    /// the client closed (or the socket failed). No buffer is reserved before
    /// the socket is readable, so an idle connection holds none.
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<usize> {
        if self.read_closed {
            return Poll::Ready(0);
        }
        let tcp = match &mut self.tcp {
            Socket::Plain(tcp) => tcp,
            Socket::Tls(tls) => {
                // What rustls has decrypted, or a read of the socket (TLS
                // is never `watched`: its poll is the read).
                make_room(&mut self.wire.rbuf, READ_BYTES);
                return match Socket::poll_read_tls(tls, cx, &mut self.wire.rbuf) {
                    Poll::Ready(Ok(n)) if n > 0 => Poll::Ready(n),
                    Poll::Ready(_) => {
                        self.read_closed = true;
                        Poll::Ready(0)
                    }
                    Poll::Pending => Poll::Pending,
                };
            }
        };
        loop {
            match tcp.poll_read_ready(cx) {
                Poll::Ready(Ok(())) => self.watched = false,
                Poll::Ready(Err(_)) => {
                    self.read_closed = true;
                    return Poll::Ready(0);
                }
                Poll::Pending => {
                    // Registered, unless tokio's budget for this poll ran
                    // out (then it only asked to be polled again).
                    self.watched = tokio::task::coop::has_budget_remaining();
                    return Poll::Pending;
                }
            }
            let rbuf = &mut self.wire.rbuf;
            // An empty buffer with less than a full read's room left starts
            // again at its front when nothing else holds its bytes (the last
            // request's head and body dropped): no copy, no allocation, and
            // the next request lands in cache lines just used, as nginx
            // reuses its buffers, instead of the next kilobyte of sixteen.
            make_room(rbuf, READ_BYTES);
            match read_draining(tcp, rbuf) {
                Ok(Some((n, _))) if n > 0 => return Poll::Ready(n),
                Ok(None) => {}
                _ => {
                    self.read_closed = true;
                    return Poll::Ready(0);
                }
            }
        }
    }

    /// Whether the socket is known to have nothing new to read, with the
    /// task's waker still registered for when it does: then a poll of it can
    /// be skipped. Its readiness is a flag, read without a registration (the
    /// registration, a lock in tokio's reactor, is what a poll costs); the
    /// waker registered when a read last found nothing stays until that
    /// flag is raised. Once per wake-up of a stream: ~150 instructions per
    /// token fewer (callgrind, `PACED=1 benches/e2e/instructions.sh`).
    fn still_watched(&self) -> bool {
        self.watched
            && self
                .tcp
                .tcp()
                .try_io(Interest::READABLE, || Ok(()))
                .is_err()
    }

    /// Write out the queued response bytes. `Err` when the socket failed.
    fn poll_write(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ()>> {
        while self.written < self.wbuf.len() {
            match Pin::new(&mut self.tcp).poll_write(cx, &self.wbuf[self.written..]) {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(Err(())),
                Poll::Ready(Ok(n)) => self.written += n,
                Poll::Pending => return Poll::Pending,
            }
        }
        // TLS: out of rustls's buffer too.
        if let Socket::Tls(tls) = &mut self.tcp {
            match Pin::new(tls).poll_flush(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(_)) => return Poll::Ready(Err(())),
                Poll::Pending => return Poll::Pending,
            }
        }
        self.written = 0;
        self.wbuf.clear();
        if self.wbuf.capacity() > KEEP_WBUF {
            self.wbuf = Vec::new();
        }
        Poll::Ready(Ok(()))
    }

    /// Between requests: a write buffer grown past a typical answer is given
    /// back. The read buffer's room is kept for the next request (one
    /// allocation serves many), as hyper's is.
    fn idle(&mut self) {
        if self.wbuf.is_empty() && self.wbuf.capacity() > KEEP_IDLE_WBUF {
            self.wbuf = Vec::new();
        }
    }
}
