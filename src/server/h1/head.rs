//! Request heads in, response heads out (RFC 9112), for the API listener's
//! own HTTP/1.1 server. No I/O here.
//!
//! A request head is parsed by `httparse` in the connection's read buffer,
//! then split off it: the URI and the header fields are where they lie in
//! the head (`headers::Fields`: no map, no copy, one allocation for where
//! they lie). The limits are hyper's, so that both
//! servers refuse the same requests with the same status: at most 100
//! headers (431), a head of at most 408 KiB (431), a URI of at most 65,534
//! bytes (414, `http::Uri`'s own limit), anything else that does not parse
//! or frame unambiguously 400.

use std::cell::RefCell;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, DATE, TRANSFER_ENCODING};
use http::{HeaderMap, Method, StatusCode, Uri, Version};
use smallvec::SmallVec;

use crate::headers::{Codings, Field, Fields, is_name, valid_host};

/// Headers per request head (hyper's `max_headers` default).
pub(super) const MAX_HEADERS: usize = 100;
/// Largest request head (hyper's read buffer limit, 8 KiB + 4 KiB x 100).
pub(super) const MAX_HEAD_BYTES: usize = 8192 + 4096 * 100;
/// Longest request target `http::Uri` accepts.
const MAX_URI_BYTES: usize = u16::MAX as usize - 1;
/// Longest header name `http::HeaderName` accepts (hyper answers 431 past
/// it). Every other rule of its names and values is `httparse`'s own.
const MAX_NAME_BYTES: usize = u16::MAX as usize;

/// How the request body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BodyFraming {
    None,
    Length(u64),
    Chunked,
}

/// A parsed request head.
#[derive(Debug)]
pub(super) struct Head {
    pub(super) method: Method,
    pub(super) uri: Uri,
    pub(super) version: Version,
    pub(super) fields: Fields,
    pub(super) body: BodyFraming,
    /// The client allows the connection to carry another request.
    pub(super) keep_alive: bool,
    /// `Expect: 100-continue`: the client waits for a go before the body.
    pub(super) expect_continue: bool,
}

/// A head refused: answer with this status and close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Refused(pub(super) u16);

/// Take a complete request head off the front of `rbuf`, if there is one.
/// `rbuf` keeps what follows the head (the body, a pipelined request), in
/// place: a body whole in the buffer is split off it without a copy, and the
/// buffer's room serves the next requests.
pub(super) fn take(rbuf: &mut BytesMut) -> Result<Option<Head>, Refused> {
    // Parsed in place, with where each piece lies written down; then the
    // head is split off and frozen, and the URI and values are slices of it.
    let mut slots = [const { std::mem::MaybeUninit::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_request_with_uninit_headers(
        &mut parsed,
        rbuf,
        &mut slots,
    ) {
        Ok(httparse::Status::Complete(n)) if n <= MAX_HEAD_BYTES => n,
        Ok(httparse::Status::Partial) if rbuf.len() < MAX_HEAD_BYTES => return Ok(None),
        Ok(_) => return Err(Refused(431)),
        Err(httparse::Error::TooManyHeaders) => return Err(Refused(431)),
        Err(_) => return Err(Refused(400)),
    };
    let base = rbuf.as_ptr() as usize;
    let at = |piece: &[u8]| {
        let start = piece.as_ptr() as usize - base;
        Span(start as u32, (start + piece.len()) as u32)
    };
    let method = parsed.method.map(|m| at(m.as_bytes()));
    let target = parsed.path.map(|p| at(p.as_bytes()));
    let version = parsed.version;
    // Inline for 16 headers (an SDK sends 10-15), without initialising the
    // rest: a zeroed array for MAX_HEADERS cost a 1.6 KB memset a request.
    let mut spans: SmallVec<[Span; 32]> = SmallVec::with_capacity(2 * parsed.headers.len());
    for h in parsed.headers.iter() {
        spans.push(at(h.name.as_bytes()));
        spans.push(at(h.value));
    }
    let head = rbuf.split_to(len).freeze();
    build(head, method, target, version, &spans)
}

/// Where a piece of the head lies in it.
#[derive(Clone, Copy)]
struct Span(u32, u32);

impl Span {
    fn of(self, head: &Bytes) -> &[u8] {
        &head[self.range()]
    }

    fn range(self) -> std::ops::Range<usize> {
        self.0 as usize..self.1 as usize
    }
}

/// The request of a parsed head; `headers` holds each header's name and
/// value in turn.
fn build(
    head: Bytes,
    method: Option<Span>,
    target: Option<Span>,
    version: Option<u8>,
    headers: &[Span],
) -> Result<Option<Head>, Refused> {
    const BAD: Refused = Refused(400);
    let method = Method::from_bytes(method.ok_or(BAD)?.of(&head)).map_err(|_| BAD)?;
    let target = target.ok_or(BAD)?;
    if (target.1 - target.0) as usize > MAX_URI_BYTES {
        return Err(Refused(414));
    }
    let uri = match known_uri(target.of(&head)) {
        Some(uri) => uri,
        None => Uri::from_maybe_shared(head.slice(target.0 as usize..target.1 as usize))
            .map_err(|_| BAD)?,
    };
    let version = match version {
        Some(1) => Version::HTTP_11,
        _ => Version::HTTP_10,
    };
    let mut fields = Vec::with_capacity(headers.len() / 2);
    let mut length: Option<u64> = None;
    // Transfer codings, over every `Transfer-Encoding` field in order.
    let mut chunked = None;
    let mut codings = Codings::default();
    let mut hosts = 0u32;
    let mut close = false;
    let mut keep_alive = false;
    let mut expect_continue = false;
    for pair in headers.chunks_exact(2) {
        let name = pair[0].of(&head);
        if name.len() > MAX_NAME_BYTES {
            return Err(Refused(431));
        }
        let raw = pair[1].of(&head);
        // The names the server reads, by length first (most are none).
        match name.len() {
            14 if is_name(name, b"content-length") => {
                let n = parse_length(raw).ok_or(BAD)?;
                if length.is_some_and(|l| l != n) {
                    return Err(BAD);
                }
                length = Some(n);
            }
            17 if is_name(name, b"transfer-encoding") => {
                codings.read(raw);
                chunked = Some(codings.last_chunked);
            }
            4 if is_name(name, b"host") => {
                hosts += 1;
                if !valid_host(raw.trim_ascii()) {
                    return Err(BAD);
                }
            }
            10 if is_name(name, b"connection") => {
                for token in raw.split(|b| *b == b',') {
                    let token = token.trim_ascii();
                    close |= token.eq_ignore_ascii_case(b"close");
                    keep_alive |= token.eq_ignore_ascii_case(b"keep-alive");
                }
            }
            6 if is_name(name, b"expect") => {
                expect_continue = raw.trim_ascii().eq_ignore_ascii_case(b"100-continue");
            }
            _ => {}
        }
        fields.push(Field::new(pair[0].range(), pair[1].range()));
    }
    let mut fields = Fields::new(head, fields);
    let mut keep_alive = match version {
        Version::HTTP_11 => !close,
        _ => keep_alive && !close,
    };
    // RFC 9112 3.2: an HTTP/1.1 request names its host once.
    if hosts > 1 || (version == Version::HTTP_11 && hosts == 0) {
        return Err(BAD);
    }
    let body = match (chunked, length) {
        // Only chunked can frame a request other than by length (RFC 9112
        // 6.3), and HTTP/1.0 has no chunked.
        (Some(false), _) => return Err(BAD),
        (Some(true), _) if version == Version::HTTP_10 => return Err(BAD),
        // Chunked applied twice (RFC 9112 7: a sender must not).
        (Some(true), _) if codings.chunked > 1 => return Err(BAD),
        // A coding before it this server does not decode (gzip, deflate):
        // 501, as RFC 9112 6.1 says, not the body taken with the coding
        // dropped.
        (Some(true), _) if codings.other => return Err(Refused(501)),
        (Some(true), length) => {
            // Both: chunked frames it, and the connection is not trusted
            // with another request (a smuggling attempt, RFC 9112 6.3).
            if length.is_some() {
                fields.remove(&CONTENT_LENGTH);
                keep_alive = false;
            }
            BodyFraming::Chunked
        }
        (None, Some(0) | None) => BodyFraming::None,
        (None, Some(n)) => BodyFraming::Length(n),
    };
    Ok(Some(Head {
        method,
        uri,
        version,
        fields,
        body,
        keep_alive,
        expect_continue: expect_continue && version == Version::HTTP_11,
    }))
}

/// The API's own paths, parsed once. Parsing a target into a `Uri` cost
/// ~800 instructions a request (callgrind); a clone of a parsed static one
/// costs a few dozen. A test checks each is what parsing gives.
const KNOWN_PATHS: [&str; 7] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/messages/count_tokens",
    "/v1/models",
];

fn known_uri(target: &[u8]) -> Option<Uri> {
    static PARSED: std::sync::LazyLock<[Uri; KNOWN_PATHS.len()]> =
        std::sync::LazyLock::new(|| KNOWN_PATHS.map(Uri::from_static));
    let i = KNOWN_PATHS.iter().position(|p| p.as_bytes() == target)?;
    Some(PARSED[i].clone())
}

/// A `Content-Length` value: digits only (leading zeros too), no sign, no
/// overflow.
fn parse_length(v: &[u8]) -> Option<u64> {
    crate::upstream::http1::parse_length(v.trim_ascii())
}

/// How the response body goes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Out {
    /// No body (a HEAD request, 1xx, 204, 304).
    None,
    /// `Content-Length` said how long it is: bytes left.
    Sized(u64),
    /// In chunks, each one body frame.
    Chunked,
    /// As it comes, ended by closing the connection (HTTP/1.0 clients).
    UntilClose,
}

/// What the response head needs to know about its request.
#[derive(Clone, Copy)]
pub(super) struct Asked {
    pub(super) head_method: bool,
    pub(super) version: Version,
    /// The connection closes after this response.
    pub(super) close: bool,
}

/// Write the response head into `out`; how its body must follow, and
/// whether the connection must close after it.
pub(super) fn encode(
    out: &mut Vec<u8>,
    status: StatusCode,
    headers: &HeaderMap,
    exact_len: Option<u64>,
    asked: &Asked,
) -> (Out, bool) {
    let bodiless = asked.head_method || status.is_informational() || status == 204 || status == 304;
    let mut close = asked.close;
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("Unknown").as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in headers {
        if name == TRANSFER_ENCODING || name == CONNECTION {
            continue; // This server decides both.
        }
        header(out, name.as_str().as_bytes(), value.as_bytes());
    }
    let declared =
        crate::headers::get(headers, &CONTENT_LENGTH).map(|v| parse_length(v.as_bytes()));
    let framing = if let Some(declared) = declared {
        match declared {
            _ if bodiless => Out::None,
            Some(n) => Out::Sized(n),
            // A length that does not parse frames nothing: until close.
            None => {
                close = true;
                Out::UntilClose
            }
        }
    } else if let Some(n) = exact_len.filter(|_| status != 204 && status != 304) {
        let mut digits = itoa::Buffer::new();
        header(out, b"content-length", digits.format(n).as_bytes());
        if bodiless { Out::None } else { Out::Sized(n) }
    } else if bodiless {
        Out::None
    } else if asked.version == Version::HTTP_11 {
        header(out, b"transfer-encoding", b"chunked");
        Out::Chunked
    } else {
        close = true;
        Out::UntilClose
    };
    // HTTP/1.0 closes unless told otherwise; HTTP/1.1 keeps unless told.
    match (close, asked.version == Version::HTTP_10) {
        (true, false) => header(out, b"connection", b"close"),
        (false, true) => header(out, b"connection", b"keep-alive"),
        _ => {}
    }
    if !headers.contains_key(DATE) {
        DATE_NOW.with_borrow_mut(|d| header(out, b"date", d.now()));
    }
    out.extend_from_slice(b"\r\n");
    (framing, close)
}

fn header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// A chunk-size line for `n` bytes of data: hex digits and CRLF.
pub(super) fn chunk_size_line(out: &mut Vec<u8>, n: usize) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [0u8; 16];
    let mut i = digits.len();
    let mut n = n;
    loop {
        i -= 1;
        digits[i] = HEX[n & 15];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
    out.extend_from_slice(b"\r\n");
}

/// The `Date` header's value, formatted once a second per thread.
struct DateNow {
    second: u64,
    text: [u8; 29],
}

impl DateNow {
    fn now(&mut self) -> &[u8] {
        let now = SystemTime::now();
        let second = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        if second != self.second {
            self.second = second;
            let text = httpdate::fmt_http_date(now);
            if text.len() == self.text.len() {
                self.text.copy_from_slice(text.as_bytes());
            }
        }
        &self.text
    }
}

thread_local! {
    static DATE_NOW: RefCell<DateNow> = const {
        RefCell::new(DateNow { second: 0, text: *b"Thu, 01 Jan 1970 00:00:00 GMT" })
    };
}

#[cfg(test)]
mod tests;
