//! A replica's response head as the proxy needs it, in one pass over what
//! `httparse` found: the status, the headers that go on to the client, how
//! the body ends and whether the connection can carry another request.
//!
//! The reference is the three-step reading it replaces: [`parse_head`] (every
//! header into a map), [`body_kind`] and [`keeps_alive`] read from that map,
//! and `client::downstream_headers` filtering it into a second map. That
//! costs ~5,000 instructions a request (callgrind, a four-header head: two
//! maps, a copy of every value, three lookups); this reading builds one map
//! of only the headers that are passed on. The property test below holds the
//! two to the same answer on arbitrary heads.
//!
//! [`parse_head`]: super::parse_head

use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, Version};

use super::{BodyState, Chunk, Framing, MAX_HEADERS, parse_length};

/// A response head read for forwarding.
pub(in crate::upstream) struct Forwarded {
    /// The status, version and the headers the client gets (everything but
    /// hop-by-hop headers, those `Connection` names, `Content-Length`,
    /// `Date` and `Server`: the gateway writes its own).
    pub(in crate::upstream) resp: Response<()>,
    /// How the body ends: what [`body_kind`](super::body_kind) says (an
    /// error only matters for a final response, so it is kept, not raised).
    pub(in crate::upstream) framing: Result<Framing, String>,
    /// Whether the replica keeps the connection open
    /// ([`keeps_alive`](super::keeps_alive)).
    pub(in crate::upstream) keep_alive: bool,
}

/// What a header is to the proxy.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Passed on to the client (unless `Connection` names it).
    Kept,
    /// The gateway's to write, never the replica's: a header of one
    /// connection (RFC 9110 7.6.1), or `Date` and `Server`.
    Dropped,
    TransferEncoding,
    ContentLength,
    Connection,
}

/// A header's class by its name, any case: the length first, then at most
/// two comparisons (a scan of the whole list cost ~500 instructions a head).
fn class(name: &[u8]) -> Class {
    let is = |n: &[u8]| name.eq_ignore_ascii_case(n);
    match name.len() {
        2 if is(b"te") => Class::Dropped,
        4 if is(b"date") => Class::Dropped,
        6 if is(b"server") => Class::Dropped,
        7 if is(b"trailer") || is(b"upgrade") => Class::Dropped,
        10 if is(b"connection") => Class::Connection,
        10 if is(b"keep-alive") => Class::Dropped,
        14 if is(b"content-length") => Class::ContentLength,
        16 if is(b"proxy-connection") => Class::Dropped,
        17 if is(b"transfer-encoding") => Class::TransferEncoding,
        18 if is(b"proxy-authenticate") => Class::Dropped,
        19 if is(b"proxy-authorization") => Class::Dropped,
        _ => Class::Kept,
    }
}

/// A complete response head at the start of `buf` (`head_only`: it answers
/// a `HEAD`), and its length; `None` while incomplete.
pub(in crate::upstream) fn read(
    buf: &[u8],
    head_only: bool,
) -> Result<Option<(Forwarded, usize)>, String> {
    if buf.is_empty() {
        return Ok(None);
    }
    let mut slots = [const { std::mem::MaybeUninit::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut []);
    let config = httparse::ParserConfig::default();
    let len = match config.parse_response_with_uninit_headers(&mut parsed, buf, &mut slots) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(format!("malformed response head: {e}")),
    };
    let status = parsed
        .code
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or("malformed response status")?;
    let version = if parsed.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    let headers = &*parsed.headers;

    // First pass: the framing fields, and whether `Connection` names others.
    let mut classes = [Class::Kept; MAX_HEADERS];
    let mut facts = Facts::default();
    let mut names_others = false;
    for (h, c) in headers.iter().zip(classes.iter_mut()) {
        *c = class(h.name.as_bytes());
        match *c {
            Class::TransferEncoding => facts.transfer_encoding(h.value),
            Class::ContentLength => facts.content_length(h.value),
            Class::Connection if visible(h.value) => {
                for token in tokens(h.value) {
                    if token.eq_ignore_ascii_case(b"close") {
                        facts.close = true;
                    } else if token.eq_ignore_ascii_case(b"keep-alive") {
                        facts.keep_alive = true;
                    }
                    if !token.is_empty() {
                        names_others = true;
                    }
                }
            }
            _ => {}
        }
    }

    // Second pass: the headers that go on. Every value is checked as the
    // reference's map checks it, those not kept too.
    let mut map = HeaderMap::with_capacity(headers.len());
    for (h, c) in headers.iter().zip(classes) {
        let name = h.name.as_bytes();
        // (A name listed in `Connection` that is no valid name is not
        // listed: the reference parses the listed names.)
        if c != Class::Kept
            || (names_others
                && listed_in_connection(headers, name)
                && HeaderName::from_bytes(name).is_ok())
        {
            if !valid_value(h.value) {
                return Err(format!(
                    "malformed value of response header {}",
                    h.name.to_ascii_lowercase()
                ));
            }
            continue;
        }
        let name = HeaderName::from_bytes(name)
            .map_err(|_| format!("malformed response header name {:?}", h.name))?;
        let value = match common_value(h.value) {
            Some(v) => v,
            None => HeaderValue::from_bytes(h.value)
                .map_err(|_| format!("malformed value of response header {name}"))?,
        };
        map.append(name, value);
    }
    let mut resp = Response::new(());
    *resp.status_mut() = status;
    *resp.version_mut() = version;
    *resp.headers_mut() = map;
    let framing = facts.framing(status, version, head_only);
    let keep_alive = if version == Version::HTTP_10 {
        facts.keep_alive
    } else {
        !facts.close
    };
    Ok(Some((
        Forwarded {
            resp,
            framing,
            keep_alive,
        },
        len,
    )))
}

/// The values nearly every answer of an engine carries (its content types),
/// as static values made at compile time: the same bytes without a copy into
/// an allocation of their own (-123 instructions a request, callgrind). The
/// property test below reads them as the reference does.
fn common_value(value: &[u8]) -> Option<HeaderValue> {
    const COMMON: [HeaderValue; 4] = [
        HeaderValue::from_static("application/json"),
        HeaderValue::from_static("text/event-stream"),
        HeaderValue::from_static("application/json; charset=utf-8"),
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    ];
    COMMON.into_iter().find(|c| c.as_bytes() == value)
}

/// What the framing fields said, read in order as the reference reads them.
#[derive(Default)]
struct Facts {
    /// Some transfer coding was named; whether the last one is `chunked`.
    coded: bool,
    last_chunked: bool,
    /// A `Content-Length` field was present.
    has_length: bool,
    /// The length, or the first problem with the lengths.
    length: Option<Result<u64, &'static str>>,
    /// `Connection` tokens.
    close: bool,
    keep_alive: bool,
}

impl Facts {
    fn transfer_encoding(&mut self, value: &[u8]) {
        for coding in value
            .split(|b| *b == b',')
            .map(<[u8]>::trim_ascii)
            .filter(|t| !t.is_empty())
        {
            self.coded = true;
            self.last_chunked = coding.eq_ignore_ascii_case(b"chunked");
        }
    }

    fn content_length(&mut self, value: &[u8]) {
        self.has_length = true;
        if matches!(self.length, Some(Err(_))) {
            return;
        }
        for part in value.split(|b| *b == b',') {
            let Some(n) = parse_length(part.trim_ascii()) else {
                self.length = Some(Err("malformed Content-Length"));
                return;
            };
            if matches!(self.length, Some(Ok(l)) if l != n) {
                self.length = Some(Err("conflicting Content-Length values"));
                return;
            }
            self.length = Some(Ok(n));
        }
    }

    /// [`body_kind`](super::body_kind)'s answer.
    fn framing(
        &self,
        status: StatusCode,
        version: Version,
        head_only: bool,
    ) -> Result<Framing, String> {
        if head_only || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
            return Ok(Framing {
                body: BodyState::Done,
                reusable: true,
            });
        }
        if self.coded {
            let clean = !self.has_length && version == Version::HTTP_11;
            return Ok(Framing {
                body: if self.last_chunked {
                    BodyState::Chunked(Chunk::Size)
                } else {
                    BodyState::UntilClose
                },
                reusable: self.last_chunked && clean,
            });
        }
        Ok(match self.length {
            Some(Err(e)) => return Err(e.into()),
            Some(Ok(n)) => Framing {
                body: BodyState::Length(n),
                reusable: true,
            },
            None => Framing {
                body: BodyState::UntilClose,
                reusable: false,
            },
        })
    }
}

/// A `Connection` value's comma-separated tokens, trimmed.
fn tokens(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value.split(|b| *b == b',').map(<[u8]>::trim_ascii)
}

/// Whether a `Connection` field (one whose value is readable as text, as the
/// reference requires) names `name`.
fn listed_in_connection(headers: &[httparse::Header<'_>], name: &[u8]) -> bool {
    headers.iter().any(|h| {
        h.name.eq_ignore_ascii_case("connection")
            && visible(h.value)
            && tokens(h.value).any(|t| t.eq_ignore_ascii_case(name))
    })
}

/// What `HeaderValue::to_str` accepts: visible ASCII, spaces and tabs.
fn visible(value: &[u8]) -> bool {
    value.iter().all(|&b| b == b'\t' || (32..127).contains(&b))
}

/// What `HeaderValue::from_bytes` accepts.
fn valid_value(value: &[u8]) -> bool {
    value.iter().all(|&b| b == b'\t' || (b >= 32 && b != 127))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::{body_kind, keeps_alive, parse_head};
    use super::*;
    use crate::upstream::client::downstream_headers;

    /// A reading: status, headers passed on, framing, keep-alive and the
    /// head's length; `None` while incomplete.
    type Reading =
        Result<Option<(StatusCode, HeaderMap, Result<Framing, String>, bool, usize)>, String>;
    /// The same with the headers listed in order.
    type Listed = Result<
        Option<(
            StatusCode,
            Vec<(String, Vec<u8>)>,
            Result<Framing, String>,
            bool,
            usize,
        )>,
        String,
    >;

    /// The reference's answer for the same bytes.
    fn reference(buf: &[u8], head_only: bool) -> Reading {
        let rid = HeaderValue::from_static("rid");
        Ok(parse_head(buf)?.map(|(resp, n)| {
            let mut passed = downstream_headers(resp.headers(), &rid);
            passed.remove(&crate::upstream::client::X_REQUEST_ID);
            let framing = body_kind(&resp, head_only);
            (resp.status(), passed, framing, keeps_alive(&resp), n)
        }))
    }

    fn this(buf: &[u8], head_only: bool) -> Reading {
        Ok(read(buf, head_only)?.map(|(f, n)| {
            let status = f.resp.status();
            let (mut parts, ()) = f.resp.into_parts();
            // The gateway sets its own (as the reference's map did).
            parts.headers.remove(&crate::upstream::client::X_REQUEST_ID);
            (status, parts.headers, f.framing, f.keep_alive, n)
        }))
    }

    /// Header lists in the order they were received (a `HeaderMap` compares
    /// names in any order; the client sees them in this one).
    fn in_order(r: Reading) -> Listed {
        r.map(|o| {
            o.map(|(s, h, f, k, n)| {
                let list = h
                    .iter()
                    .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                    .collect();
                (s, list, f, k, n)
            })
        })
    }

    #[test]
    fn engines_heads_read_as_the_reference_reads_them() {
        let heads: [&[u8]; 8] = [
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 567\r\ndate: Wed, 25 Nov 2026 19:49:52 GMT\r\n\r\n{}",
            b"HTTP/1.1 200 OK\r\ndate: x\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nConnection: close, X-Secret\r\nx-secret: 1\r\nX-Kept: 2\r\ncontent-length: 3\r\n\r\nabc",
            b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ntransfer-encoding: chunked\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 10\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n",
            b"HTTP/1.1 204 No Content\r\nx-a: 1\r\nx-a: 2\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-le",
        ];
        for head in heads {
            for head_only in [false, true] {
                assert_eq!(
                    in_order(this(head, head_only)),
                    in_order(reference(head, head_only)),
                    "{}",
                    String::from_utf8_lossy(head)
                );
            }
        }
        let (f, _) = read(heads[2], false).unwrap().unwrap();
        assert!(f.resp.headers().get("x-secret").is_none());
        assert!(!f.keep_alive);
    }

    proptest! {
        #[test]
        fn arbitrary_heads_read_as_the_reference_reads_them(
            version in prop_oneof![Just("1.1"), Just("1.0")],
            status in 100u16..600,
            headers in proptest::collection::vec(
                (
                    prop_oneof![
                        Just("Connection".to_string()),
                        Just("connection".to_string()),
                        Just("Transfer-Encoding".to_string()),
                        Just("Content-Length".to_string()),
                        Just("date".to_string()),
                        Just("Server".to_string()),
                        Just("keep-alive".to_string()),
                        Just("content-type".to_string()),
                        Just("x-request-id".to_string()),
                        // Every dropped name, in some case.
                        Just("TE".to_string()),
                        Just("Trailer".to_string()),
                        Just("upgrade".to_string()),
                        Just("Proxy-Connection".to_string()),
                        Just("proxy-authenticate".to_string()),
                        Just("Proxy-Authorization".to_string()),
                        "x-[a-c]{1,2}",
                        "[a-zA-Z][a-zA-Z-]{0,12}",
                    ],
                    prop_oneof![
                        Just("close".to_string()),
                        Just("keep-alive, x-a".to_string()),
                        Just("X-B , close".to_string()),
                        Just("x-a, Upgrade, te".to_string()),
                        Just("chunked".to_string()),
                        Just("gzip, chunked".to_string()),
                        Just("chunked, gzip".to_string()),
                        Just("12".to_string()),
                        Just("5, 5".to_string()),
                        Just("+5".to_string()),
                        // The values read as static ones (`common_value`).
                        Just("application/json".to_string()),
                        Just("text/event-stream; charset=utf-8".to_string()),
                        "[0-9]{1,3}",
                        "[ -~]{0,20}",
                        "[\\x00-\\xff]{0,6}",
                    ],
                ),
                0..10,
            ),
            head_only in any::<bool>(),
        ) {
            let mut wire = format!("HTTP/{version} {status} X\r\n").into_bytes();
            for (n, v) in &headers {
                wire.extend_from_slice(n.as_bytes());
                wire.extend_from_slice(b": ");
                wire.extend_from_slice(v.trim().as_bytes());
                wire.extend_from_slice(b"\r\n");
            }
            wire.extend_from_slice(b"\r\nrest");
            let ours = in_order(this(&wire, head_only));
            let theirs = in_order(reference(&wire, head_only));
            // Both refuse, or both read the same; error wording aside.
            match (&ours, &theirs) {
                (Err(_), Err(_)) => {}
                _ => prop_assert_eq!(ours, theirs, "{}", String::from_utf8_lossy(&wire)),
            }
        }
    }
}
