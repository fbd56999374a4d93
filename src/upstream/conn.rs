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

use std::sync::Mutex;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Version};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::TcpStream;

use crate::error::{GatewayError, TimeoutPhase};

/// Largest response head accepted from a replica.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Largest chunk-size line (with extensions) or trailer line.
const MAX_LINE_BYTES: usize = 4 * 1024;
/// Headers per response head.
const MAX_HEADERS: usize = 128;
/// Interim (1xx) responses skipped before the real one.
const MAX_INTERIM: usize = 8;
/// Trailer section of a chunked body.
const MAX_TRAILER_BYTES: usize = 16 * 1024;
/// Read granularity: a burst of events fits, an idle stream does not hold much.
const READ_BYTES: usize = 16 * 1024;

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
}

struct Idle {
    conn: Conn,
    since: Instant,
}

/// A connection checked out for one request. Dropping it closes the socket,
/// which is how a cancelled request is cancelled on the replica.
pub struct Conn {
    io: TcpStream,
    wire: Wire,
    /// The connection may carry another request once the body is read.
    keep_alive: bool,
    /// It served a request before (a failure to send on it is retryable).
    reused: bool,
}

/// The read side: received bytes and where the body decoder stands.
struct Wire {
    /// Received, not yet consumed.
    rbuf: BytesMut,
    body: BodyState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyState {
    /// No response yet (or between requests).
    Idle,
    /// `Content-Length`: bytes left.
    Length(u64),
    /// Chunked: what is expected next.
    Chunked(Chunk),
    /// Until the replica closes the connection.
    UntilClose,
    /// The body was read to its end.
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// A chunk-size line.
    Size,
    /// Bytes left in the current chunk.
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    /// Trailer lines until an empty one (bytes read so far).
    Trailers(usize),
}

/// Why a request got no response.
#[derive(Debug)]
pub enum SendError {
    /// The connection died before the request could have been processed (it
    /// could not be written, or a reused connection was closed by the replica
    /// before any answer): safe to retry on another replica.
    NotSent(String),
    /// The request went out; the answer was missing or malformed.
    Failed(String),
}

impl SendError {
    pub fn into_gateway(self) -> GatewayError {
        match self {
            SendError::NotSent(e) => GatewayError::UpstreamConnect(e),
            SendError::Failed(e) => GatewayError::UpstreamProtocol(e),
        }
    }
}

impl ConnPool {
    pub fn new(
        addr: String,
        host: HeaderValue,
        max_idle: usize,
        idle_timeout: Duration,
        connect_timeout: Duration,
    ) -> Self {
        Self {
            addr,
            host,
            idle: Mutex::new(Vec::new()),
            max_idle,
            idle_timeout,
            connect_timeout,
        }
    }

    /// A live idle connection, or a new one.
    pub async fn checkout(&self) -> Result<Conn, GatewayError> {
        while let Some(c) = self.take_idle() {
            if c.since.elapsed() < self.idle_timeout && c.conn.is_quiet() {
                return Ok(c.conn);
            }
        }
        self.connect().await
    }

    /// Drop idle connections past the idle timeout or closed by the replica.
    /// Run periodically (with the health checks), so a pool that stops being
    /// used does not hold half-closed sockets until its next request.
    pub fn sweep(&self) {
        let stale: Vec<Idle> = match self.idle.lock() {
            Ok(mut idle) => {
                let (keep, stale) = std::mem::take(&mut *idle)
                    .into_iter()
                    .partition(|i| i.since.elapsed() < self.idle_timeout && i.conn.is_quiet());
                *idle = keep;
                stale
            }
            Err(_) => return,
        };
        // Closed outside the lock.
        drop(stale);
    }

    /// Idle connections held now.
    pub fn idle_count(&self) -> usize {
        self.idle.lock().map_or(0, |i| i.len())
    }

    fn take_idle(&self) -> Option<Idle> {
        self.idle.lock().ok()?.pop()
    }

    /// A new connection (for a retry after a kept-alive one turned out dead).
    pub async fn connect(&self) -> Result<Conn, GatewayError> {
        let io = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(&self.addr))
            .await
        {
            Err(_) => {
                return Err(GatewayError::UpstreamTimeout {
                    phase: TimeoutPhase::Connect,
                });
            }
            Ok(Err(e)) => return Err(GatewayError::UpstreamConnect(format!("{}: {e}", self.addr))),
            Ok(Ok(t)) => t,
        };
        // Requests and tokens are small writes; Nagle would hold each for an ACK.
        let _ = io.set_nodelay(true);
        Ok(Conn {
            io,
            wire: Wire {
                rbuf: BytesMut::with_capacity(READ_BYTES),
                body: BodyState::Idle,
            },
            keep_alive: false,
            reused: false,
        })
    }

    /// Keep a connection whose response was read to the end, if it can carry
    /// another request.
    pub fn checkin(&self, mut c: Conn) {
        if c.wire.body != BodyState::Done || !c.keep_alive || !c.wire.rbuf.is_empty() {
            return;
        }
        c.wire.body = BodyState::Idle;
        c.reused = true;
        if let Ok(mut idle) = self.idle.lock() {
            // Checkout takes the newest; the oldest may have outlived the idle
            // timeout (the replica has likely closed them): drop those here so
            // a pool that never drains to them does not keep dead sockets.
            let expired = idle
                .iter()
                .take_while(|i| i.since.elapsed() >= self.idle_timeout)
                .count();
            idle.drain(..expired);
            if idle.len() >= self.max_idle {
                return;
            }
            idle.push(Idle {
                conn: c,
                since: Instant::now(),
            });
        }
    }
}

impl Conn {
    /// Whether the connection came from the idle pool (served a request before).
    pub fn reused(&self) -> bool {
        self.reused
    }

    /// An idle connection has nothing to read: a replica that closed it has
    /// sent FIN (or RST) by now, and unsolicited bytes mean it is out of step.
    /// A peek is a direct non-blocking syscall, so it sees a close the
    /// runtime's reactor has not processed yet.
    fn is_quiet(&self) -> bool {
        let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        matches!(socket2::SockRef::from(&self.io).peek(&mut probe),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    }

    /// Send the request and read the response head. The body follows through
    /// [`poll_data`](Self::poll_data).
    pub async fn send(&mut self, req: &Request<Bytes>) -> Result<Response<()>, SendError> {
        let head_only = req.method() == Method::HEAD;
        let wire = encode_request(req);
        if let Err(e) = self.io.write_all(&wire).await {
            return Err(SendError::NotSent(format!("writing the request: {e}")));
        }
        // Whether the replica answered anything (an interim response counts):
        // only a reused connection that closes with no answer at all is taken
        // for one the replica had already closed.
        let mut answered = false;
        for _ in 0..=MAX_INTERIM {
            let (resp, head_len) = loop {
                if let Some(parsed) = parse_head(&self.wire.rbuf).map_err(SendError::Failed)? {
                    break parsed;
                }
                if self.wire.rbuf.len() > MAX_HEAD_BYTES {
                    return Err(SendError::Failed(format!(
                        "response head larger than {MAX_HEAD_BYTES} bytes"
                    )));
                }
                let got = std::future::poll_fn(|cx| self.poll_fill(cx)).await;
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
                    Err(e) => {
                        let msg = format!("reading the response: {e}");
                        return Err(if !answered && self.reused {
                            SendError::NotSent(msg)
                        } else {
                            SendError::Failed(msg)
                        });
                    }
                }
            };
            self.wire.rbuf.advance(head_len);
            let status = resp.status();
            if status == StatusCode::SWITCHING_PROTOCOLS {
                return Err(SendError::Failed(
                    "the replica switched protocols unasked (101)".into(),
                ));
            }
            if status.is_informational() {
                // 100 Continue, 103 Early Hints: the real answer follows.
                continue;
            }
            let framing = body_kind(&resp, head_only).map_err(SendError::Failed)?;
            self.wire.body = framing.body;
            self.keep_alive = keeps_alive(&resp) && framing.reusable;
            return Ok(resp);
        }
        Err(SendError::Failed(format!(
            "more than {MAX_INTERIM} interim (1xx) responses"
        )))
    }

    /// The next piece of the response body: `None` at its end.
    pub fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, String>>> {
        loop {
            match self.wire.decode() {
                Ok(Some(data)) => return Poll::Ready(Some(Ok(data))),
                Ok(None) if self.wire.body == BodyState::Done => return Poll::Ready(None),
                Ok(None) => {}
                Err(e) => return Poll::Ready(Some(Err(e))),
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
                Err(e) => return Poll::Ready(Some(Err(e.to_string()))),
            }
        }
    }

    /// Read a whole body (at most `limit` bytes).
    pub async fn collect(&mut self, limit: usize) -> Result<Bytes, String> {
        let mut buf = BytesMut::new();
        loop {
            match std::future::poll_fn(|cx| self.poll_data(cx)).await {
                None => return Ok(buf.freeze()),
                Some(Err(e)) => return Err(e),
                Some(Ok(data)) => {
                    if buf.len() + data.len() > limit {
                        return Err(format!("response larger than {limit} bytes"));
                    }
                    if buf.is_empty() && data.len() == buf.capacity() {
                        buf = BytesMut::from(data);
                    } else {
                        buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }

    /// Read what the socket has into the buffer: the byte count, 0 at EOF.
    ///
    /// A read shorter than the space offered drained the socket (TCP hands
    /// over all it has), so the read readiness is cleared right away, as
    /// nginx does: the next poll waits for the reactor instead of spending a
    /// `recv` on `EAGAIN`, one syscall saved per event on a paced stream. The
    /// readiness is captured before the read, so data that arrives after it
    /// raises a new readiness that this does not clear; a close is never
    /// cleared by tokio.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
        let (io, rbuf) = (&self.io, &mut self.wire.rbuf);
        if rbuf.capacity() - rbuf.len() < READ_BYTES / 4 {
            rbuf.reserve(READ_BYTES);
        }
        loop {
            let mut got = None;
            let read = io.try_io(Interest::READABLE, || {
                let offered = rbuf.capacity() - rbuf.len();
                let n = io.try_read_buf(rbuf)?;
                got = Some(n);
                if n > 0 && n < offered {
                    Err(std::io::ErrorKind::WouldBlock.into())
                } else {
                    Ok(n)
                }
            });
            match (read, got) {
                (_, Some(n)) => return Poll::Ready(Ok(n)),
                (Err(e), None) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    ready!(io.poll_read_ready(cx))?;
                }
                (Err(e), None) => return Poll::Ready(Err(e)),
                (Ok(n), None) => return Poll::Ready(Ok(n)),
            }
        }
    }
}

impl Wire {
    /// Body bytes decodable from the buffer now, if any.
    fn decode(&mut self) -> Result<Option<Bytes>, String> {
        loop {
            match self.body {
                BodyState::Idle | BodyState::Done => return Ok(None),
                BodyState::Length(0) => {
                    self.body = BodyState::Done;
                    return Ok(None);
                }
                BodyState::Length(left) => {
                    if self.rbuf.is_empty() {
                        return Ok(None);
                    }
                    let n = take(left, self.rbuf.len());
                    self.body = BodyState::Length(left - n as u64);
                    return Ok(Some(self.rbuf.split_to(n).freeze()));
                }
                BodyState::UntilClose => {
                    if self.rbuf.is_empty() {
                        return Ok(None);
                    }
                    return Ok(Some(self.rbuf.split().freeze()));
                }
                BodyState::Chunked(Chunk::Size) => {
                    let Some(line) = self.line()? else {
                        return Ok(None);
                    };
                    let size = chunk_size(&line)?;
                    self.body = BodyState::Chunked(if size == 0 {
                        Chunk::Trailers(0)
                    } else {
                        Chunk::Data(size)
                    });
                }
                BodyState::Chunked(Chunk::Data(left)) => {
                    if self.rbuf.is_empty() {
                        return Ok(None);
                    }
                    let n = take(left, self.rbuf.len());
                    let rest = left - n as u64;
                    self.body = BodyState::Chunked(if rest == 0 {
                        Chunk::DataEnd
                    } else {
                        Chunk::Data(rest)
                    });
                    return Ok(Some(self.rbuf.split_to(n).freeze()));
                }
                BodyState::Chunked(Chunk::DataEnd) => {
                    let Some(line) = self.line()? else {
                        return Ok(None);
                    };
                    if !line.is_empty() {
                        return Err("chunk data longer than its declared size".into());
                    }
                    self.body = BodyState::Chunked(Chunk::Size);
                }
                BodyState::Chunked(Chunk::Trailers(seen)) => {
                    let Some(line) = self.line()? else {
                        return Ok(None);
                    };
                    if line.is_empty() {
                        self.body = BodyState::Done;
                        return Ok(None);
                    }
                    let seen = seen + line.len() + 2;
                    if seen > MAX_TRAILER_BYTES {
                        return Err(format!("trailers larger than {MAX_TRAILER_BYTES} bytes"));
                    }
                    self.body = BodyState::Chunked(Chunk::Trailers(seen));
                }
            }
        }
    }

    /// One CRLF- (or LF-) terminated line from the buffer, without its ending.
    fn line(&mut self) -> Result<Option<Bytes>, String> {
        match memchr::memchr(b'\n', &self.rbuf) {
            Some(i) => {
                let mut line = self.rbuf.split_to(i + 1).freeze();
                line.truncate(i);
                if line.last() == Some(&b'\r') {
                    line.truncate(i - 1);
                }
                Ok(Some(line))
            }
            None if self.rbuf.len() > MAX_LINE_BYTES => {
                Err("chunk-size or trailer line too long".into())
            }
            None => Ok(None),
        }
    }
}

fn take(left: u64, available: usize) -> usize {
    usize::try_from(left).map_or(available, |l| l.min(available))
}

/// The request on the wire: head and body in one buffer, one write.
fn encode_request(req: &Request<Bytes>) -> Vec<u8> {
    let body = req.body();
    let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
    let mut out = Vec::with_capacity(256 + req.headers().len() * 48 + body.len());
    out.extend_from_slice(req.method().as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in req.headers() {
        if name == http::header::CONTENT_LENGTH || name == http::header::TRANSFER_ENCODING {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !body.is_empty() || req.method() != Method::GET {
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(body.len().to_string().as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    out
}

/// A complete response head at the start of `buf`, and its length.
fn parse_head(buf: &[u8]) -> Result<Option<(Response<()>, usize)>, String> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut headers);
    let len = match parsed.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(format!("malformed response head: {e}")),
    };
    let status = parsed
        .code
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or("malformed response status")?;
    let mut map = HeaderMap::with_capacity(parsed.headers.len());
    for h in parsed.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| format!("malformed response header name {:?}", h.name))?;
        let value = HeaderValue::from_bytes(h.value)
            .map_err(|_| format!("malformed value of response header {name}"))?;
        map.append(name, value);
    }
    let mut resp = Response::new(());
    *resp.status_mut() = status;
    *resp.version_mut() = if parsed.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    *resp.headers_mut() = map;
    Ok(Some((resp, len)))
}

/// Whether the connection stays open after this response.
fn keeps_alive(resp: &Response<()>) -> bool {
    let has = |token: &str| {
        resp.headers()
            .get_all(http::header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    };
    if resp.version() == Version::HTTP_10 {
        has("keep-alive")
    } else {
        !has("close")
    }
}

/// How a response body is delimited, and whether that framing allows the
/// connection to carry another request.
#[derive(Debug, PartialEq, Eq)]
struct Framing {
    body: BodyState,
    reusable: bool,
}

/// How the body of this response is delimited (RFC 9112 section 6.3). Framing
/// that a request smuggling attack would use (both `Transfer-Encoding` and
/// `Content-Length`, `Transfer-Encoding` in HTTP/1.0) is decoded by the
/// transfer coding and the connection is closed after it; conflicting lengths
/// are an error.
fn body_kind(resp: &Response<()>, head_only: bool) -> Result<Framing, String> {
    let status = resp.status();
    if head_only || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        return Ok(Framing {
            body: BodyState::Done,
            reusable: true,
        });
    }
    let headers = resp.headers();
    let mut codings = headers
        .get_all(http::header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
        .peekable();
    if codings.peek().is_some() {
        let chunked = codings
            .last()
            .is_some_and(|t| t.eq_ignore_ascii_case(b"chunked"));
        let clean = !headers.contains_key(http::header::CONTENT_LENGTH)
            && resp.version() == Version::HTTP_11;
        return Ok(Framing {
            body: if chunked {
                BodyState::Chunked(Chunk::Size)
            } else {
                BodyState::UntilClose
            },
            reusable: chunked && clean,
        });
    }
    let mut length = None;
    for value in headers.get_all(http::header::CONTENT_LENGTH) {
        for part in value.as_bytes().split(|b| *b == b',') {
            let n = parse_length(part.trim_ascii()).ok_or("malformed Content-Length")?;
            if length.is_some_and(|l| l != n) {
                return Err("conflicting Content-Length values".into());
            }
            length = Some(n);
        }
    }
    Ok(match length {
        Some(n) => Framing {
            body: BodyState::Length(n),
            reusable: true,
        },
        None => Framing {
            body: BodyState::UntilClose,
            reusable: false,
        },
    })
}

/// A decimal length: digits only (no sign, no spaces), at most 19 of them.
fn parse_length(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// The size in a chunk-size line: hex digits, then optional whitespace and
/// `;` extensions (ignored).
fn chunk_size(line: &[u8]) -> Result<u64, String> {
    let end = line
        .iter()
        .position(|b| !b.is_ascii_hexdigit())
        .unwrap_or(line.len());
    let (digits, rest) = line.split_at(end);
    let rest = rest.trim_ascii_start();
    if !(rest.is_empty() || rest.starts_with(b";")) {
        return Err("malformed chunk size".into());
    }
    let significant = match digits.iter().position(|d| *d != b'0') {
        Some(i) => &digits[i..],
        None if digits.is_empty() => return Err("malformed chunk size".into()),
        None => return Ok(0),
    };
    if significant.len() > 15 {
        return Err("chunk size too large".into());
    }
    let mut n: u64 = 0;
    for d in significant {
        let v = match d {
            b'0'..=b'9' => d - b'0',
            b'a'..=b'f' => d - b'a' + 10,
            _ => d - b'A' + 10,
        };
        n = n * 16 + u64::from(v);
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn_state(body: BodyState, input: &[u8]) -> Wire {
        Wire {
            rbuf: BytesMut::from(input),
            body,
        }
    }

    fn drain(c: &mut Wire) -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        while let Some(d) = c.decode()? {
            out.extend_from_slice(&d);
        }
        Ok(out)
    }

    #[test]
    fn chunked_bodies_decode_with_extensions_and_trailers() {
        let wire = b"5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nx-trailer: 1\r\n\r\n";
        let mut c = conn_state(BodyState::Chunked(Chunk::Size), wire);
        assert_eq!(drain(&mut c), Ok(b"hello, world".to_vec()));
        assert_eq!(c.body, BodyState::Done);
        assert!(c.rbuf.is_empty());
    }

    #[test]
    fn chunked_decoding_resumes_across_reads() {
        let wire = b"a\r\n0123456789\r\n0\r\n\r\n";
        for cut in 1..wire.len() {
            let mut c = conn_state(BodyState::Chunked(Chunk::Size), &wire[..cut]);
            let mut got = drain(&mut c).unwrap_or_default();
            c.rbuf.extend_from_slice(&wire[cut..]);
            got.extend(drain(&mut c).unwrap_or_default());
            assert_eq!(got, b"0123456789", "cut at {cut}");
            assert_eq!(c.body, BodyState::Done, "cut at {cut}");
        }
    }

    #[test]
    fn malformed_chunks_are_errors() {
        let mut c = conn_state(BodyState::Chunked(Chunk::Size), b"zz\r\n");
        assert!(drain(&mut c).is_err());
        let mut c = conn_state(BodyState::Chunked(Chunk::Size), b"2\r\nabc\r\n");
        assert!(drain(&mut c).is_err());
    }

    #[test]
    fn sized_bodies_stop_at_their_length() {
        let mut c = conn_state(BodyState::Length(3), b"abc");
        assert_eq!(drain(&mut c), Ok(b"abc".to_vec()));
        assert_eq!(c.body, BodyState::Done);
    }

    fn head(wire: &[u8]) -> (Response<()>, usize) {
        match parse_head(wire) {
            Ok(Some(parsed)) => parsed,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn heads_parse_and_say_how_the_body_ends() {
        let wire = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\nrest";
        let (r, n) = head(wire);
        assert_eq!(&wire[n..], b"rest");
        assert_eq!(r.status(), 200);
        assert!(keeps_alive(&r));
        assert_eq!(
            body_kind(&r, false),
            Ok(Framing {
                body: BodyState::Chunked(Chunk::Size),
                reusable: true
            })
        );
        let (r, _) = head(b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\nconnection: close\r\n\r\n");
        assert!(!keeps_alive(&r));
        assert_eq!(
            body_kind(&r, false).map(|f| f.body),
            Ok(BodyState::Length(12))
        );
        assert_eq!(body_kind(&r, true).map(|f| f.body), Ok(BodyState::Done));
        let (r, _) = head(b"HTTP/1.0 200 OK\r\n\r\n");
        assert!(!keeps_alive(&r));
        assert_eq!(
            body_kind(&r, false),
            Ok(Framing {
                body: BodyState::UntilClose,
                reusable: false
            })
        );
        assert!(matches!(
            parse_head(b"HTTP/1.1 200 OK\r\ncontent-le"),
            Ok(None)
        ));
        assert!(parse_head(b"garbage\r\n\r\n").is_err());
    }

    #[test]
    fn ambiguous_framing_is_refused_or_ends_the_connection() {
        let kind = |wire: &[u8]| body_kind(&head(wire).0, false);
        // Two different lengths: which one ends the body is anyone's guess.
        assert!(
            kind(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 10\r\n\r\n").is_err()
        );
        assert!(kind(b"HTTP/1.1 200 OK\r\ncontent-length: 5, 10\r\n\r\n").is_err());
        assert!(kind(b"HTTP/1.1 200 OK\r\ncontent-length: +5\r\n\r\n").is_err());
        // Repeated equal lengths are one length.
        assert_eq!(
            kind(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 5\r\n\r\n"),
            Ok(Framing {
                body: BodyState::Length(5),
                reusable: true
            })
        );
        // Transfer-Encoding wins over Content-Length, and the connection is not reused.
        assert_eq!(
            kind(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n"),
            Ok(Framing {
                body: BodyState::Chunked(Chunk::Size),
                reusable: false
            })
        );
        // The last coding decides, across repeated fields.
        assert_eq!(
            kind(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: gzip\r\n\r\n"
            ),
            Ok(Framing {
                body: BodyState::UntilClose,
                reusable: false
            })
        );
        assert_eq!(
            kind(
                b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ntransfer-encoding: chunked\r\n\r\n"
            ),
            Ok(Framing {
                body: BodyState::Chunked(Chunk::Size),
                reusable: false
            })
        );
    }

    #[test]
    fn chunk_sizes_are_strict_hex() {
        assert_eq!(chunk_size(b"1f"), Ok(31));
        assert_eq!(chunk_size(b"0000000000000000000a"), Ok(10));
        assert_eq!(chunk_size(b"5 ;name=value"), Ok(5));
        assert_eq!(chunk_size(b"000"), Ok(0));
        for bad in [&b""[..], b"5 junk", b"-5", b"0x5", b"1000000000000000"] {
            assert!(
                chunk_size(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn trailers_are_bounded() {
        let mut wire = b"0\r\n".to_vec();
        for _ in 0..1000 {
            wire.extend_from_slice(b"x-trailer: 0123456789\r\n");
        }
        let mut c = conn_state(BodyState::Chunked(Chunk::Size), &wire);
        assert!(drain(&mut c).is_err());
    }

    #[test]
    fn requests_carry_their_length_once() {
        let mut req = Request::new(Bytes::from_static(b"{}"));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = http::Uri::from_static("/v1/chat/completions");
        let h = req.headers_mut();
        h.insert("host", HeaderValue::from_static("replica:8000"));
        h.insert("content-length", HeaderValue::from_static("999"));
        h.insert("x-request-id", HeaderValue::from_static("r1"));
        assert_eq!(
            String::from_utf8_lossy(&encode_request(&req)),
            "POST /v1/chat/completions HTTP/1.1\r\nhost: replica:8000\r\nx-request-id: r1\r\ncontent-length: 2\r\n\r\n{}"
        );
    }
}
