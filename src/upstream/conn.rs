//! Upstream HTTP/1.1 connections, read by the request that uses them.
//!
//! A client library runs each connection in its own task (or at least its own
//! state machine) and hands the response body over a channel: every SSE event
//! then costs a wake-up and a hand-off. Here the request owns its connection:
//! it writes the request, parses the response head (`httparse`), and the
//! response body decodes the replica's bytes (chunked, `Content-Length` or
//! close-delimited) straight from the socket inside its own `poll_frame`. A
//! burst already in the read buffer is forwarded in one go, and nothing but the
//! request's own task is ever woken. The pool is a short critical section per
//! request (checkout and check-in), never per event. Idle connections are
//! checked with a non-blocking peek when taken, and swept with the health
//! checks; a connection goes back only when its response was read exactly to
//! its end and its framing was unambiguous.
//!
//! Only what the gateway sends is supported: one request at a time per
//! connection (no pipelining), a body with `Content-Length`, no
//! `Expect: 100-continue`. Responses may be chunked, sized or close-delimited;
//! interim 1xx responses are skipped.

use parking_lot::Mutex;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderValue, Response, StatusCode};
use tokio::io::{AsyncWrite, Interest};
use tokio::net::TcpStream;
use tokio::time::Sleep;

use super::http1::{BodyState, Outgoing, Wire, forwarded};
use crate::error::{GatewayError, TimeoutPhase, UpstreamFault};
use crate::net::{Socket, make_room};
use crate::turn;

/// Largest response head accepted from a replica.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Interim (1xx) responses skipped before the real one.
const MAX_INTERIM: usize = 8;
/// Read granularity: a burst of events fits, an idle stream does not hold much.
const READ_BYTES: usize = 16 * 1024;
/// An idle connection is peeked for a close (one `recv` syscall) only when
/// it has been idle this long. Servers close idle keep-alive connections
/// after seconds (uvicorn, vLLM's server: 5 s), so one idle for less was
/// almost surely not closed on purpose; if it was (a replica going away),
/// the send fails before any answer and is retried on another connection
/// (`SendError::NotSent`). Under load, connections come back within
/// milliseconds: one syscall saved per request.
const PEEK_AFTER: Duration = Duration::from_millis(500);

/// Idle connections to one replica.
pub struct ConnPool {
    /// `host:port` to connect to.
    addr: String,
    /// The `Host` header sent with every request.
    pub host: HeaderValue,
    idle: Mutex<Vec<Idle>>,
    max_idle: usize,
    idle_timeout: Duration,
    connect_timeout: Duration,
    /// `https://`: the handshake each new connection makes.
    tls: Option<UpstreamTls>,
}

/// How an `https://` replica's connections are made.
pub(crate) struct UpstreamTls {
    /// The connector, and the name the replica's certificate must carry
    /// (the URL's host). `Err`: why there is none (`upstream.tls` did not
    /// load, the host cannot be a certificate's name); every connection
    /// fails with it.
    pub(crate) connect: Result<
        (
            tokio_rustls::TlsConnector,
            rustls::pki_types::ServerName<'static>,
        ),
        std::sync::Arc<str>,
    >,
}

struct Idle {
    conn: Conn,
    since: Instant,
}

/// A connection checked out for one request. Dropping it closes the socket,
/// which is how a cancelled request is cancelled on the replica.
pub(crate) struct Conn {
    io: Socket,
    wire: Wire,
    /// The connection may carry another request once the body is read.
    keep_alive: bool,
    /// It served a request before (a failure to send on it is retryable).
    reused: bool,
    /// When the latest bytes were read: the arrival time of everything
    /// decoded from them (one clock read per socket read, not per chunk).
    read_at: tokio::time::Instant,
    /// The latest read was shorter than the space offered: the socket had
    /// nothing more, and its readiness was cleared (see `poll_fill`).
    drained: bool,
    /// The timer of a request's deadline while its answer is awaited
    /// ([`Conn::passed`]), made with the first request and kept.
    due: Option<Pin<Box<Sleep>>>,
}

/// A body gathered from its pieces, at most a limit: a body that comes in
/// one piece (the common case: it was whole in one read) is handed on as it
/// came, with no copy and no allocation (~300 instructions a non-streamed
/// answer, ~500 a request body, callgrind); more pieces are copied into one
/// buffer. [`Conn::collect`] and the request body's reader
/// (`api::inbound::read_body`) gather with it.
#[derive(Default)]
pub(crate) struct Whole {
    first: Option<Bytes>,
    more: BytesMut,
    len: usize,
}

impl Whole {
    /// Add the next piece; `false` once the body is over `limit` bytes.
    pub(crate) fn push(&mut self, data: Bytes, limit: usize) -> bool {
        self.len += data.len();
        if self.len > limit {
            return false;
        }
        match &self.first {
            None if self.more.is_empty() => self.first = Some(data),
            _ => {
                if let Some(f) = self.first.take() {
                    self.more.extend_from_slice(&f);
                }
                self.more.extend_from_slice(&data);
            }
        }
        true
    }

    /// The whole body.
    pub(crate) fn finish(self) -> Bytes {
        self.first.unwrap_or_else(|| self.more.freeze())
    }
}

/// A deadline passed before the answer did ([`Conn::collect`]).
#[derive(Debug)]
pub(crate) struct TimedOut;

/// Why a request got no response.
#[derive(Debug)]
pub(crate) enum SendError {
    /// The connection died before the request could have been processed (it
    /// could not be written, or a reused connection was closed by the replica
    /// before any answer): safe to retry on another replica.
    NotSent(UpstreamFault),
    /// The request went out; the answer was missing or malformed.
    Failed(UpstreamFault),
    /// The deadline passed before the response head (`phase`: which
    /// deadline that was, for the error).
    TimedOut,
}

impl SendError {
    pub(crate) fn into_gateway(self, phase: TimeoutPhase) -> GatewayError {
        match self {
            SendError::NotSent(e) => GatewayError::UpstreamConnect(e),
            SendError::Failed(e) => GatewayError::UpstreamProtocol(e),
            SendError::TimedOut => GatewayError::UpstreamTimeout { phase },
        }
    }
}

impl ConnPool {
    pub(crate) fn new(
        addr: String,
        host: HeaderValue,
        max_idle: usize,
        idle_timeout: Duration,
        connect_timeout: Duration,
        tls: Option<UpstreamTls>,
    ) -> Self {
        Self {
            addr,
            host,
            idle: Mutex::new(Vec::new()),
            max_idle,
            idle_timeout,
            connect_timeout,
            tls,
        }
    }

    /// A live idle connection, if there is one (else [`connect`](Self::connect)).
    pub(crate) fn idle_conn(&self) -> Option<Conn> {
        while let Some(mut c) = self.take_idle() {
            let idle = turn::now_std().saturating_duration_since(c.since);
            if idle < self.idle_timeout && (idle < PEEK_AFTER || c.conn.is_quiet()) {
                return Some(c.conn);
            }
        }
        None
    }

    /// Drop idle connections past the idle timeout or closed by the replica.
    /// Run periodically (with the health checks), so a pool that stops being
    /// used does not hold half-closed sockets until its next request.
    pub(crate) fn sweep(&self) {
        let stale: Vec<Idle> = {
            let mut idle = self.idle.lock();
            let mut stale = Vec::new();
            for mut i in std::mem::take(&mut *idle) {
                if turn::now_std().saturating_duration_since(i.since) < self.idle_timeout
                    && i.conn.is_quiet()
                {
                    idle.push(i);
                } else {
                    stale.push(i);
                }
            }
            stale
        };
        // Closed outside the lock.
        drop(stale);
    }

    /// Idle connections held now.
    pub fn idle_count(&self) -> usize {
        self.idle.lock().len()
    }

    fn take_idle(&self) -> Option<Idle> {
        self.idle.lock().pop()
    }

    /// A new connection (for a retry after a kept-alive one turned out dead).
    pub(crate) async fn connect(&self) -> Result<Conn, GatewayError> {
        let by = tokio::time::Instant::now() + self.connect_timeout;
        let io = match tokio::time::timeout_at(by, TcpStream::connect(&self.addr)).await {
            Err(_) => {
                return Err(GatewayError::UpstreamTimeout {
                    phase: TimeoutPhase::Connect,
                });
            }
            Ok(Err(e)) => {
                return Err(GatewayError::UpstreamConnect(UpstreamFault::io(
                    format!("connecting to {}", self.addr),
                    e,
                )));
            }
            Ok(Ok(t)) => t,
        };
        // Requests and tokens are small writes; Nagle would hold each for an ACK.
        let _ = io.set_nodelay(true);
        let io = match &self.tls {
            None => Socket::Plain(io),
            Some(tls) => Socket::Tls(Box::new(self.handshake(tls, io, by).await?)),
        };
        Ok(Conn {
            io,
            wire: Wire {
                rbuf: BytesMut::with_capacity(READ_BYTES),
                body: BodyState::Idle,
                strict: false,
            },
            keep_alive: false,
            reused: false,
            read_at: turn::now(),
            drained: false,
            due: None,
        })
    }

    /// The TLS handshake of a new connection, within the connect timeout. A
    /// certificate refused (expired, not for this name, from an unknown CA)
    /// fails it with rustls's reason, in the error and the log.
    async fn handshake(
        &self,
        tls: &UpstreamTls,
        tcp: TcpStream,
        by: tokio::time::Instant,
    ) -> Result<tokio_rustls::TlsStream<TcpStream>, GatewayError> {
        let (connector, name) = tls.connect.as_ref().map_err(|e| {
            GatewayError::UpstreamConnect(UpstreamFault::from(format!("upstream.tls: {e}")))
        })?;
        match tokio::time::timeout_at(by, connector.connect(name.clone(), tcp)).await {
            Err(_) => Err(GatewayError::UpstreamTimeout {
                phase: TimeoutPhase::Connect,
            }),
            Ok(Err(e)) => {
                // (An I/O error shows rustls's reason as its own.)
                let why = e.to_string();
                tracing::warn!(replica = %self.addr, error = %why, "TLS handshake with a replica failed");
                Err(GatewayError::UpstreamConnect(UpstreamFault::from(format!(
                    "TLS handshake with {}: {why}",
                    self.addr
                ))))
            }
            Ok(Ok(s)) => Ok(tokio_rustls::TlsStream::Client(s)),
        }
    }

    /// Keep a connection whose response was read to the end, if it can carry
    /// another request.
    pub(crate) fn checkin(&self, c: Conn) {
        self.checkin_at(c, turn::now_std());
    }

    /// [`ConnPool::checkin`] at `now`, the caller's clock reading.
    pub(crate) fn checkin_at(&self, mut c: Conn, now: Instant) {
        if c.wire.body != BodyState::Done || !c.keep_alive || !c.wire.rbuf.is_empty() {
            return;
        }
        c.wire.body = BodyState::Idle;
        c.reused = true;
        c.release_waker();
        // Dropped after the lock: closing a socket and taking a connection's
        // timer out of tokio's wheel are not done while holding it.
        let expired: Vec<Idle> = {
            let mut idle = self.idle.lock();
            // Checkout takes the newest; the oldest may have outlived the idle
            // timeout (the replica has likely closed them): drop those here so
            // a pool that never drains to them does not keep dead sockets.
            let expired = idle
                .iter()
                .take_while(|i| now.saturating_duration_since(i.since) >= self.idle_timeout)
                .count();
            let expired = idle.drain(..expired).collect();
            // A full pool does not take it: dropped after the lock too.
            if idle.len() < self.max_idle {
                idle.push(Idle {
                    conn: c,
                    since: now,
                });
            }
            expired
        };
        drop(expired);
    }
}

impl Conn {
    /// Whether the connection came from the idle pool (served a request before).
    pub(crate) fn reused(&self) -> bool {
        self.reused
    }

    /// An idle connection has nothing to read: a replica that closed it has
    /// sent FIN (or RST) by now, and unsolicited bytes mean it is out of step.
    /// A peek is a direct non-blocking syscall, so it sees a close the
    /// runtime's reactor has not processed yet.
    fn is_quiet(&mut self) -> bool {
        let tcp = match &mut self.io {
            Socket::Plain(tcp) => tcp,
            Socket::Tls(tls) => return Socket::tls_is_quiet(tls),
        };
        let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        matches!(socket2::SockRef::from(&*tcp).peek(&mut probe),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    }

    /// Whether `by` has passed; if not, the task is woken when it does.
    ///
    /// The connection keeps one timer for every request it carries, moved
    /// only when it fires (then to the current request's deadline) or when a
    /// nearer deadline comes. A `tokio::time::timeout_at` per request put a
    /// timer in tokio's wheel and took it out again, each under the wheel's
    /// lock: ~500 instructions a request (callgrind). Deadlines grow with
    /// time, so while a connection carries requests of one kind the kept
    /// timer is due before the next request's and is moved only when it
    /// fires early (then it wakes whichever task polled it last: one
    /// spurious poll). A stream after a whole answer has a nearer deadline
    /// (first token, not total), so mixed traffic moves it more often, as
    /// often as before at worst. A connection going back to the pool gives
    /// up the waker its timer holds ([`Conn::release_waker`]).
    fn passed(&mut self, by: tokio::time::Instant, cx: &mut Context<'_>) -> bool {
        let timer = self
            .due
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(by)));
        if timer.deadline() > by {
            timer.as_mut().reset(by);
        }
        while timer.as_mut().poll(cx).is_ready() {
            // Fired: read the clock itself (the turn's time could be a
            // moment old), and if the deadline is still ahead, wait for it.
            if turn::fresh() >= by {
                return true;
            }
            timer.as_mut().reset(by);
        }
        false
    }

    /// Before the connection waits in the pool: its timer gives up the waker
    /// of the task that used it last. Held, it kept that finished task's
    /// memory allocated while the connection sat idle (+5 MiB after a wave
    /// of 2,000 streams, `benches/e2e/idle_memory.py`), and a timer firing
    /// then woke that task for nothing. A poll with a no-op waker swaps it
    /// without the wheel's lock (the timer stays where it is).
    fn release_waker(&mut self) {
        if let Some(timer) = self.due.as_mut() {
            let _ = timer
                .as_mut()
                .poll(&mut Context::from_waker(std::task::Waker::noop()));
        }
    }

    /// Send the request and read the response head, both by `by` (else
    /// [`SendError::TimedOut`]). The body follows through
    /// [`poll_data`](Self::poll_data). The head's headers are those that go
    /// on to the client (see [`forwarded::Forwarded::resp`]).
    pub(crate) async fn send(
        &mut self,
        req: &Outgoing,
        by: tokio::time::Instant,
    ) -> Result<Response<()>, SendError> {
        let head_only = req.head_only;
        let mut written = 0;
        std::future::poll_fn(|cx| {
            while written < req.wire.len() {
                match Pin::new(&mut self.io).poll_write(cx, &req.wire[written..]) {
                    Poll::Ready(Ok(0)) => {
                        return Poll::Ready(Err(SendError::NotSent(
                            "writing the request: the connection is closed".into(),
                        )));
                    }
                    Poll::Ready(Ok(n)) => written += n,
                    Poll::Ready(Err(e)) => {
                        return Poll::Ready(Err(SendError::NotSent(UpstreamFault::io(
                            "writing the request",
                            e,
                        ))));
                    }
                    Poll::Pending if self.passed(by, cx) => {
                        return Poll::Ready(Err(SendError::TimedOut));
                    }
                    Poll::Pending => return Poll::Pending,
                }
            }
            // TLS: out of rustls's buffer (plain: nothing held).
            match Pin::new(&mut self.io).poll_flush(cx) {
                Poll::Ready(Ok(())) => Poll::Ready(Ok(())),
                Poll::Ready(Err(e)) => Poll::Ready(Err(SendError::NotSent(UpstreamFault::io(
                    "writing the request",
                    e,
                )))),
                Poll::Pending if self.passed(by, cx) => Poll::Ready(Err(SendError::TimedOut)),
                Poll::Pending => Poll::Pending,
            }
        })
        .await?;
        // Whether the replica answered anything (an interim response counts):
        // only a reused connection that closes with no answer at all is taken
        // for one the replica had already closed.
        let mut answered = false;
        for _ in 0..=MAX_INTERIM {
            let (head, head_len) = loop {
                if let Some(parsed) = forwarded::read(&self.wire.rbuf, head_only)
                    .map_err(|e| SendError::Failed(e.into()))?
                {
                    break parsed;
                }
                if self.wire.rbuf.len() > MAX_HEAD_BYTES {
                    return Err(SendError::Failed(
                        format!("response head larger than {MAX_HEAD_BYTES} bytes").into(),
                    ));
                }
                let got = std::future::poll_fn(|cx| match self.poll_fill(cx) {
                    Poll::Pending if self.passed(by, cx) => Poll::Ready(Err(None)),
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(r) => Poll::Ready(r.map_err(Some)),
                })
                .await;
                answered |= matches!(got, Ok(n) if n > 0);
                match got {
                    Ok(0) if !answered && self.reused => {
                        return Err(SendError::NotSent(
                            "the replica closed the kept-alive connection".into(),
                        ));
                    }
                    Ok(0) => {
                        return Err(SendError::Failed(
                            "connection closed before a complete response head".into(),
                        ));
                    }
                    Ok(_) => {}
                    Err(None) => return Err(SendError::TimedOut),
                    Err(Some(e)) => {
                        let msg = UpstreamFault::io("reading the response", e);
                        return Err(if !answered && self.reused {
                            SendError::NotSent(msg)
                        } else {
                            SendError::Failed(msg)
                        });
                    }
                }
            };
            self.wire.rbuf.advance(head_len);
            let status = head.resp.status();
            if status == StatusCode::SWITCHING_PROTOCOLS {
                return Err(SendError::Failed(
                    "the replica switched protocols unasked (101)".into(),
                ));
            }
            if status.is_informational() {
                // 100 Continue, 103 Early Hints: the real answer follows.
                continue;
            }
            let framing = head.framing.map_err(|e| SendError::Failed(e.into()))?;
            self.wire.body = framing.body;
            self.keep_alive = head.keep_alive && framing.reusable;
            return Ok(head.resp);
        }
        Err(SendError::Failed(
            format!("more than {MAX_INTERIM} interim (1xx) responses").into(),
        ))
    }

    /// When the bytes [`poll_data`](Self::poll_data) hands out were read.
    pub(crate) fn read_at(&self) -> tokio::time::Instant {
        self.read_at
    }

    /// Whether a [`poll_data`](Self::poll_data) now would find nothing new:
    /// the latest read emptied the socket and what it brought was decoded.
    /// Bytes that arrived since then are found by the next poll, which waits
    /// for the reactor's word on them either way.
    pub(crate) fn drained(&self) -> bool {
        // A body whose end was decoded still has that end to report.
        // Bytes left undecoded (a framing error held for the next call, a
        // line cut by the read) are the next poll's to look at.
        self.drained
            && self.wire.rbuf.is_empty()
            && !matches!(self.wire.body, BodyState::Done | BodyState::Length(0))
    }

    /// After a read that [`drained`](Self::drained) the socket: register
    /// `cx` for its next bytes. Whether it was (nothing came since).
    pub(crate) fn poll_wait(&self, cx: &mut Context<'_>) -> bool {
        // (A TLS connection never reads as drained: its poll waits.)
        self.drained() && self.io.tcp().poll_read_ready(cx).is_pending()
    }

    /// The next piece of the response body: `None` at its end.
    pub(crate) fn poll_data(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, UpstreamFault>>> {
        loop {
            match self.wire.decode() {
                Ok(Some(data)) => return Poll::Ready(Some(Ok(data))),
                Ok(None) if self.wire.body == BodyState::Done => return Poll::Ready(None),
                Ok(None) => {}
                Err(e) => return Poll::Ready(Some(Err(e.into()))),
            }
            match ready!(self.poll_fill(cx)) {
                Ok(0) if self.wire.body == BodyState::UntilClose => {
                    self.wire.body = BodyState::Done;
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    return Poll::Ready(Some(Err(
                        "connection closed before the end of the response body".into(),
                    )));
                }
                Ok(_) => {}
                Err(e) => return Poll::Ready(Some(Err(UpstreamFault::io("reading", e)))),
            }
        }
    }

    /// Read a whole body (at most `limit` bytes) by `by`, else
    /// `Err(TimedOut)`: what `tokio::time::timeout_at(by, ..)` of the read
    /// gives, on the connection's kept timer ([`Conn::passed`]) instead of a
    /// timer of its own (~600 instructions a non-streamed request).
    pub(crate) async fn collect(
        &mut self,
        limit: usize,
        by: tokio::time::Instant,
    ) -> Result<Result<Bytes, UpstreamFault>, TimedOut> {
        let mut whole = Whole::default();
        loop {
            let next = std::future::poll_fn(|cx| match self.poll_data(cx) {
                Poll::Pending if self.passed(by, cx) => Poll::Ready(Err(TimedOut)),
                Poll::Pending => Poll::Pending,
                Poll::Ready(next) => Poll::Ready(Ok(next)),
            })
            .await?;
            match next {
                None => return Ok(Ok(whole.finish())),
                Some(Err(e)) => return Ok(Err(e)),
                Some(Ok(data)) => {
                    if !whole.push(data, limit) {
                        return Ok(Err(format!("response larger than {limit} bytes").into()));
                    }
                }
            }
        }
    }

    /// Read what the socket has into the buffer: the byte count, 0 at EOF
    /// (see [`read_draining`]).
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
        let rbuf = &mut self.wire.rbuf;
        // As the server's read buffer (`server::h1`).
        make_room(rbuf, READ_BYTES);
        let io = match &mut self.io {
            Socket::Plain(tcp) => tcp,
            Socket::Tls(tls) => {
                let n = ready!(Socket::poll_read_tls(tls, cx, rbuf))?;
                if n > 0 {
                    self.read_at = turn::now();
                }
                return Poll::Ready(Ok(n));
            }
        };
        loop {
            match read_draining(io, rbuf)? {
                Some((n, drained)) => {
                    self.drained = drained;
                    if n > 0 {
                        self.read_at = turn::now();
                    }
                    return Poll::Ready(Ok(n));
                }
                None => ready!(io.poll_read_ready(cx))?,
            }
        }
    }
}

/// One read of `tcp` into `rbuf`, if the reactor holds it readable: the byte
/// count (0 at EOF) and whether the read drained the socket; `None` when it
/// is not readable (poll its readiness, which registers the task).
///
/// A read shorter than the space offered drained the socket (TCP hands over
/// all it has), so the read readiness is cleared right away, as nginx does:
/// the next poll waits for the reactor instead of spending a `recv` on
/// `EAGAIN`, one syscall saved per event on a paced stream. The readiness is
/// captured before the read, so data that arrives after it raises a new
/// readiness that this does not clear; a close is never cleared by tokio.
/// Both the replicas' connections and the gateway's own server read so.
pub(crate) fn read_draining(
    tcp: &TcpStream,
    rbuf: &mut BytesMut,
) -> std::io::Result<Option<(usize, bool)>> {
    let mut got = None;
    let read = tcp.try_io(Interest::READABLE, || {
        let offered = rbuf.capacity() - rbuf.len();
        let n = tcp.try_read_buf(rbuf)?;
        let drained = n > 0 && n < offered;
        got = Some((n, drained));
        if drained {
            Err(std::io::ErrorKind::WouldBlock.into())
        } else {
            Ok(n)
        }
    });
    match (read, got) {
        (_, Some(read)) => Ok(Some(read)),
        (Err(e), None) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
        (Err(e), None) => Err(e),
        (Ok(n), None) => Ok(Some((n, false))),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::task::{Wake, Waker};

    use super::*;

    /// A task's waker, standing for the task's memory: held while its
    /// `Arc` has more than one owner.
    struct Task;
    impl Wake for Task {
        fn wake(self: Arc<Self>) {}
    }

    /// A replica serving `cert` (self-signed, for `localhost`) over TLS,
    /// answering one `/v1/models` per connection; and a pool trusting
    /// `trusted` to reach it.
    async fn tls_replica(
        cert: &rcgen::Certificate,
        key: &rcgen::KeyPair,
        trusted: &rcgen::Certificate,
    ) -> ConnPool {
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
        let provider = crate::net::tls::provider();
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
            )
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut buf = vec![0u8; 4096];
                    let _ = tls.read(&mut buf).await;
                    let body = r#"{"object":"list","data":[]}"#;
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = tls.write_all(answer.as_bytes()).await;
                    let _ = tls.flush().await;
                });
            }
        });
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from(trusted.der().to_vec()))
            .unwrap();
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        ConnPool::new(
            addr.to_string(),
            HeaderValue::from_static("localhost"),
            4,
            Duration::from_secs(60),
            Duration::from_secs(5),
            Some(UpstreamTls {
                connect: Ok((
                    tokio_rustls::TlsConnector::from(Arc::new(client)),
                    ServerName::try_from("localhost").unwrap(),
                )),
            }),
        )
    }

    fn self_signed(name: &str, expired: bool) -> (rcgen::Certificate, rcgen::KeyPair) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2020, 12, 31);
        }
        (params.self_signed(&key).unwrap(), key)
    }

    #[tokio::test]
    async fn an_https_replica_is_read_through_tls_and_a_refused_certificate_says_why() {
        let (cert, key) = self_signed("replica", false);
        let pool = tls_replica(&cert, &key, &cert).await;
        let mut conn = pool.connect().await.unwrap();
        let req = Outgoing {
            wire: b"GET /v1/models HTTP/1.1\r\nhost: localhost\r\n\r\n".to_vec(),
            head_only: false,
        };
        let by = tokio::time::Instant::now() + Duration::from_secs(5);
        let head = conn.send(&req, by).await.unwrap();
        assert_eq!(head.status(), 200);
        let body = conn.collect(1 << 20, by).await.unwrap().unwrap();
        assert_eq!(&body[..], br#"{"object":"list","data":[]}"#);

        // An expired certificate, and one nobody vouches for: no
        // connection, and the error says which.
        let (old, old_key) = self_signed("old", true);
        let pool = tls_replica(&old, &old_key, &old).await;
        let err = pool.connect().await.err().unwrap().to_string();
        assert!(err.contains("TLS handshake with"), "{err}");
        assert!(err.contains("certificate expired"), "{err}");
        let (other, _) = self_signed("other", false);
        let pool = tls_replica(&cert, &key, &other).await;
        let err = pool.connect().await.err().unwrap().to_string();
        assert!(err.contains("UnknownIssuer"), "{err}");
    }

    #[tokio::test]
    async fn a_connection_in_the_pool_holds_no_tasks_waker() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let pool = ConnPool::new(
            listener.local_addr().unwrap().to_string(),
            HeaderValue::from_static("replica"),
            4,
            Duration::from_secs(60),
            Duration::from_secs(1),
            None,
        );
        let mut conn = pool.connect().await.unwrap();
        let task = Arc::new(Task);
        let waker = Waker::from(task.clone());
        let by = tokio::time::Instant::now() + Duration::from_secs(60);
        // Waiting for an answer: the kept timer holds the task's waker.
        assert!(!conn.passed(by, &mut Context::from_waker(&waker)));
        drop(waker);
        assert_eq!(Arc::strong_count(&task), 2, "the timer holds the waker");
        // A whole answer read: the connection goes back to the pool.
        conn.wire.body = BodyState::Done;
        conn.keep_alive = true;
        pool.checkin(conn);
        assert_eq!(pool.idle_count(), 1);
        assert_eq!(
            Arc::strong_count(&task),
            1,
            "the pool's connection let it go"
        );
    }

    #[test]
    fn a_body_in_one_piece_is_kept_as_it_came_and_pieces_are_joined() {
        let one = Bytes::from_static(b"{\"a\":1}");
        let mut w = Whole::default();
        assert!(w.push(one.clone(), 100));
        let got = w.finish();
        assert_eq!(got, one);
        assert_eq!(got.as_ptr(), one.as_ptr(), "no copy");
        let mut w = Whole::default();
        for piece in [&b"ab"[..], b"", b"cd", b"e"] {
            assert!(w.push(Bytes::copy_from_slice(piece), 5));
        }
        assert_eq!(w.finish(), Bytes::from_static(b"abcde"));
        let mut w = Whole::default();
        assert!(w.push(Bytes::from_static(b"abc"), 5));
        assert!(!w.push(Bytes::from_static(b"def"), 5), "over the limit");
        assert_eq!(Whole::default().finish(), Bytes::new());
    }
}
