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
//! request (checkout and check-in), never per event.
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
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::error::{GatewayError, TimeoutPhase};

/// Largest response head accepted from a replica.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Largest chunk-size line (with extensions) or trailer line.
const MAX_LINE_BYTES: usize = 4 * 1024;
/// Headers per response head.
const MAX_HEADERS: usize = 128;
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
    /// Trailer lines until an empty one.
    Trailers,
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
            // A replica that closed an idle connection has sent FIN by now: a
            // non-blocking read notices, so the request does not go down a dead
            // socket. Anything but "nothing to read" means the connection is over.
            let mut probe = [0u8; 1];
            let quiet = matches!(c.conn.io.try_read(&mut probe),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
            if quiet && c.since.elapsed() < self.idle_timeout {
                return Ok(c.conn);
            }
        }
        self.connect().await
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

    /// Send the request and read the response head. The body follows through
    /// [`poll_data`](Self::poll_data).
    pub async fn send(&mut self, req: &Request<Bytes>) -> Result<Response<()>, SendError> {
        let head_only = req.method() == Method::HEAD;
        let wire = encode_request(req);
        if let Err(e) = self.io.write_all(&wire).await {
            return Err(SendError::NotSent(format!("writing the request: {e}")));
        }
        loop {
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
                match got {
                    Ok(0) if self.wire.rbuf.is_empty() && self.reused => {
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
                        return Err(if self.wire.rbuf.is_empty() && self.reused {
                            SendError::NotSent(msg)
                        } else {
                            SendError::Failed(msg)
                        });
                    }
                }
            };
            self.wire.rbuf.advance(head_len);
            let status = resp.status();
            if status.is_informational() {
                // 100 Continue, 103 Early Hints: the real answer follows.
                continue;
            }
            self.keep_alive = keeps_alive(&resp);
            self.wire.body = body_kind(&resp, head_only).map_err(SendError::Failed)?;
            if self.wire.body == BodyState::UntilClose {
                self.keep_alive = false;
            }
            return Ok(resp);
        }
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
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
        let rbuf = &mut self.wire.rbuf;
        if rbuf.capacity() - rbuf.len() < READ_BYTES / 4 {
            rbuf.reserve(READ_BYTES);
        }
        loop {
            match self.io.try_read_buf(rbuf) {
                Ok(n) => return Poll::Ready(Ok(n)),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    ready!(self.io.poll_read_ready(cx))?;
                }
                Err(e) => return Poll::Ready(Err(e)),
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
                        Chunk::Trailers
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
                BodyState::Chunked(Chunk::Trailers) => {
                    let Some(line) = self.line()? else {
                        return Ok(None);
                    };
                    if line.is_empty() {
                        self.body = BodyState::Done;
                        return Ok(None);
                    }
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

/// How the body of this response is delimited (RFC 9112 section 6.3).
fn body_kind(resp: &Response<()>, head_only: bool) -> Result<BodyState, String> {
    let status = resp.status();
    if head_only || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        return Ok(BodyState::Done);
    }
    let headers = resp.headers();
    if let Some(te) = headers.get(http::header::TRANSFER_ENCODING) {
        let last = te
            .to_str()
            .ok()
            .and_then(|v| v.rsplit(',').next())
            .map(str::trim);
        return if last.is_some_and(|t| t.eq_ignore_ascii_case("chunked")) {
            Ok(BodyState::Chunked(Chunk::Size))
        } else {
            Ok(BodyState::UntilClose)
        };
    }
    match headers.get(http::header::CONTENT_LENGTH) {
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map(BodyState::Length)
            .ok_or_else(|| "malformed Content-Length".to_string()),
        None => Ok(BodyState::UntilClose),
    }
}

/// The size in a chunk-size line (hex, extensions ignored).
fn chunk_size(line: &[u8]) -> Result<u64, String> {
    let end = line
        .iter()
        .position(|b| *b == b';' || *b == b' ' || *b == b'\t')
        .unwrap_or(line.len());
    let digits = &line[..end];
    if digits.is_empty() || digits.len() > 15 {
        return Err("malformed chunk size".into());
    }
    let mut n: u64 = 0;
    for d in digits {
        let v = match d {
            b'0'..=b'9' => d - b'0',
            b'a'..=b'f' => d - b'a' + 10,
            b'A'..=b'F' => d - b'A' + 10,
            _ => return Err("malformed chunk size".into()),
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
        assert_eq!(body_kind(&r, false), Ok(BodyState::Chunked(Chunk::Size)));
        let (r, _) = head(b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\nconnection: close\r\n\r\n");
        assert!(!keeps_alive(&r));
        assert_eq!(body_kind(&r, false), Ok(BodyState::Length(12)));
        assert_eq!(body_kind(&r, true), Ok(BodyState::Done));
        let (r, _) = head(b"HTTP/1.0 200 OK\r\n\r\n");
        assert!(!keeps_alive(&r));
        assert_eq!(body_kind(&r, false), Ok(BodyState::UntilClose));
        assert!(matches!(
            parse_head(b"HTTP/1.1 200 OK\r\ncontent-le"),
            Ok(None)
        ));
        assert!(parse_head(b"garbage\r\n\r\n").is_err());
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
