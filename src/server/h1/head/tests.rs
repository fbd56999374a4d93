use http::{HeaderName, HeaderValue};

use super::*;
use crate::headers::Lookup;

fn take_all(wire: &[u8]) -> Result<Option<Head>, Refused> {
    take(&mut BytesMut::from(wire))
}

fn head(wire: &[u8]) -> Head {
    take_all(wire).unwrap().unwrap()
}

#[test]
fn heads_parse_into_requests_with_their_framing() {
    let mut buf = BytesMut::from(
        &b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nX-Two: a\r\nx-two: b\r\n\r\n{}NEXT"[..],
    );
    let h = take(&mut buf).unwrap().unwrap();
    let rest = buf;
    assert_eq!(h.method, Method::POST);
    assert_eq!(h.uri.path(), "/v1/chat/completions");
    assert_eq!(h.uri.query(), Some("x=1"));
    assert_eq!(h.version, Version::HTTP_11);
    // The fields as they came, names in their case, in order.
    let fields: Vec<_> = h.fields.iter().collect();
    assert_eq!(
        fields,
        [
            (&b"Host"[..], &b"a"[..]),
            (b"Content-Length", b"2"),
            (b"X-Two", b"a"),
            (b"x-two", b"b")
        ]
    );
    assert_eq!(
        h.fields.first(&HeaderName::from_static("host")),
        Some(&b"a"[..])
    );
    assert_eq!(
        h.fields.first(&HeaderName::from_static("x-two")),
        Some(&b"a"[..])
    );
    assert_eq!(h.body, BodyFraming::Length(2));
    assert!(h.keep_alive && !h.expect_continue);
    assert_eq!(&rest[..], b"{}NEXT");

    let h = head(
        b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: Chunked\r\nexpect: 100-Continue\r\n\r\n",
    );
    assert_eq!(h.body, BodyFraming::Chunked);
    assert!(h.expect_continue);
    // Codings over several fields, empty elements skipped.
    let h = head(
        b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: ,\r\ntransfer-encoding: chunked\r\n\r\n",
    );
    assert_eq!(h.body, BodyFraming::Chunked);
    let h = head(
        b"GET / HTTP/1.1\r\nhost: a\r\nconnection: keep-alive, close\r\ncontent-length: 0\r\n\r\n",
    );
    assert_eq!(h.body, BodyFraming::None);
    assert!(!h.keep_alive);
    // HTTP/1.0: closes unless asked to keep alive; no 100-continue.
    assert!(!head(b"GET / HTTP/1.0\r\n\r\n").keep_alive);
    let h = head(b"POST / HTTP/1.0\r\nConnection: Keep-Alive\r\nexpect: 100-continue\r\ncontent-length: 1\r\n\r\nx");
    assert!(h.keep_alive && !h.expect_continue);
    // Both framings: chunked wins, the length goes, the connection closes.
    let h = head(
        b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n",
    );
    assert_eq!(h.body, BodyFraming::Chunked);
    assert!(h.fields.first(&CONTENT_LENGTH).is_none() && !h.keep_alive);
    assert_eq!(h.fields.len(), 2);
}

#[test]
fn partial_heads_wait_and_keep_their_bytes() {
    let mut buf = BytesMut::from(&b"GET / HTTP/1.1\r\nhost: a\r\n"[..]);
    assert!(take(&mut buf).unwrap().is_none());
    assert_eq!(&buf[..], b"GET / HTTP/1.1\r\nhost: a\r\n");
    buf.extend_from_slice(b"\r\n");
    let h = take(&mut buf).unwrap().unwrap();
    assert_eq!(
        h.fields.first(&HeaderName::from_static("host")),
        Some(&b"a"[..])
    );
    assert!(buf.is_empty());
}

#[test]
fn refusals_have_hypers_statuses() {
    let refused = |wire: &[u8]| take_all(wire).err().map(|r| r.0);
    let mut many = b"GET / HTTP/1.1\r\nhost: a\r\n".to_vec();
    for i in 0..=MAX_HEADERS {
        many.extend_from_slice(format!("x-{i}: v\r\n").as_bytes());
    }
    many.extend_from_slice(b"\r\n");
    assert_eq!(refused(&many), Some(431));
    let long = format!(
        "GET /{} HTTP/1.1\r\nhost: a\r\n\r\n",
        "a".repeat(MAX_URI_BYTES)
    );
    assert_eq!(refused(long.as_bytes()), Some(414));
    let huge = format!(
        "GET / HTTP/1.1\r\nhost: a\r\nx: {}",
        "a".repeat(MAX_HEAD_BYTES)
    );
    assert_eq!(refused(huge.as_bytes()), Some(431));
    for bad in [
        &b"GARBAGE\r\n\r\n"[..],
        b"GET / HTTP/1.1\r\nhost: a\r\nno colon\r\n\r\n",
        b"GET / HTTP/2.0\r\n\r\n",
        b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: -1\r\n\r\n",
        b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
        b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 99999999999999999999\r\n\r\n",
        b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: gzip\r\n\r\n",
        b"POST / HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n",
    ] {
        assert_eq!(refused(bad), Some(400), "{}", String::from_utf8_lossy(bad));
    }
    // A header name `http::HeaderName` would refuse (the one rule of names
    // that is not `httparse`'s): longer than 65,535 bytes, 431 as hyper says.
    let named = |n: usize| format!("GET / HTTP/1.1\r\nhost: a\r\n{}: v\r\n\r\n", "a".repeat(n));
    assert_eq!(refused(named(MAX_NAME_BYTES + 1).as_bytes()), Some(431));
    assert!(HeaderName::from_bytes("a".repeat(MAX_NAME_BYTES + 1).as_bytes()).is_err());
    assert_eq!(head(named(MAX_NAME_BYTES).as_bytes()).fields.len(), 2);
    assert!(HeaderName::from_bytes("a".repeat(MAX_NAME_BYTES).as_bytes()).is_ok());
    // RFC 9112 where hyper is lenient: a coding this server does not
    // decode is 501 (not the body with it dropped); a request's host named
    // once, without a path or a space.
    for (bad, status) in [
        (&b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: gzip, chunked\r\n\r\n"[..], 501),
        (b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n\r\n", 501),
        (b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked, chunked\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nhost: a\r\nhost: a\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nhost: a/b\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nhost: a b\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nhost: u@a\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nhost: a:8x\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nhost: [::1\r\n\r\n", 400),
        (b"GET / HTTP/1.0\r\nhost: a\r\nhost: b\r\n\r\n", 400),
    ] {
        assert_eq!(refused(bad), Some(status), "{}", String::from_utf8_lossy(bad));
    }
    for good in [
        "a",
        "a:8080",
        "sluice.default.svc.cluster.local:80",
        "127.0.0.1:9",
        "[::1]:8080",
        "[fe80::1]",
        "xn--bcher-kva.example",
        "",
        "a:",
    ] {
        let wire = format!("GET / HTTP/1.1\r\nhost: {good}\r\n\r\n");
        assert!(take_all(wire.as_bytes()).is_ok(), "host {good:?}");
    }
    // HTTP/1.0 has no Host requirement.
    assert!(take_all(b"GET / HTTP/1.0\r\n\r\n").is_ok());
    // Leading zeros are digits (RFC 9110 8.6); too many of them are not an
    // overflow.
    let h = head(b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 00000000000000000057\r\n\r\n");
    assert_eq!(h.body, BodyFraming::Length(57));
    // The same length twice is one length.
    let h = head(b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 3\r\ncontent-length: 3\r\n\r\n");
    assert_eq!(h.body, BodyFraming::Length(3));
}

fn encoded(
    status: u16,
    headers: &[(&str, &str)],
    exact: Option<u64>,
    asked: Asked,
) -> (String, Out, bool) {
    let mut map = HeaderMap::new();
    for (k, v) in headers {
        map.append(
            HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    let mut out = Vec::new();
    let (framing, close) = encode(
        &mut out,
        StatusCode::from_u16(status).unwrap(),
        &map,
        exact,
        &asked,
    );
    (String::from_utf8(out).unwrap(), framing, close)
}

const GET11: Asked = Asked {
    head_method: false,
    version: Version::HTTP_11,
    close: false,
};

#[test]
fn response_heads_say_how_their_body_ends() {
    let (text, out, close) = encoded(200, &[("content-type", "text/event-stream")], None, GET11);
    assert!(text.starts_with("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\ndate: "), "{text}");
    assert!(text.ends_with(" GMT\r\n\r\n"));
    assert_eq!((out, close), (Out::Chunked, false));

    let (text, out, _) = encoded(404, &[], Some(12), GET11);
    assert!(text.contains("\r\ncontent-length: 12\r\n"), "{text}");
    assert_eq!(out, Out::Sized(12));
    // A length the handler set is kept, and not written twice.
    let (text, out, _) = encoded(200, &[("content-length", "3")], Some(3), GET11);
    assert_eq!(text.matches("content-length").count(), 1);
    assert_eq!(out, Out::Sized(3));
    // One that does not parse frames nothing: the body ends with the connection.
    let (_, out, close) = encoded(200, &[("content-length", "x")], None, GET11);
    assert_eq!((out, close), (Out::UntilClose, true));
    // HEAD: the length, no body.
    let head = Asked {
        head_method: true,
        ..GET11
    };
    let (text, out, _) = encoded(200, &[], Some(7), head);
    assert!(text.contains("content-length: 7"));
    assert_eq!(out, Out::None);
    // 204 and 304 have no body, and no length is made up for them.
    let (text, out, _) = encoded(204, &[], Some(0), GET11);
    assert!(!text.contains("content-length") && !text.contains("transfer-encoding"));
    assert_eq!(out, Out::None);
    // HTTP/1.0: no chunks; the body ends with the connection.
    let v10 = Asked {
        version: Version::HTTP_10,
        ..GET11
    };
    let (text, out, close) = encoded(200, &[], None, v10);
    assert!(!text.contains("connection") && !text.contains("chunked"));
    assert_eq!((out, close), (Out::UntilClose, true));
    let (text, _, close) = encoded(200, &[], Some(1), v10);
    assert!(text.contains("connection: keep-alive") && !close);
    // Closing: said once; the handler's own connection header is not copied.
    let closing = Asked {
        close: true,
        ..GET11
    };
    let (text, _, close) = encoded(200, &[("connection", "keep-alive")], Some(0), closing);
    assert!(close && text.matches("connection").count() == 1 && text.contains("connection: close"));
    // A date the handler set is kept.
    let (text, _, _) = encoded(200, &[("date", "then")], Some(0), GET11);
    assert_eq!(text.matches("date").count(), 1);
    assert!(text.contains("date: then"));
}

#[test]
fn chunk_size_lines_are_hex() {
    for n in [1usize, 9, 10, 15, 16, 255, 4096, 65535, 1 << 40] {
        let mut out = Vec::new();
        chunk_size_line(&mut out, n);
        assert_eq!(out, format!("{n:x}\r\n").into_bytes());
    }
}

#[test]
fn the_date_is_the_clocks() {
    let mut out = Vec::new();
    encode(&mut out, StatusCode::OK, &HeaderMap::new(), Some(0), &GET11);
    let text = String::from_utf8(out).unwrap();
    let date = text
        .split("date: ")
        .nth(1)
        .unwrap()
        .split("\r\n")
        .next()
        .unwrap();
    let then = httpdate::parse_http_date(date).unwrap();
    let now = SystemTime::now();
    let apart = now.duration_since(then).unwrap_or_default();
    assert!(apart.as_secs() < 5, "{date}");
}

#[test]
fn known_paths_are_what_parsing_gives() {
    for path in KNOWN_PATHS {
        let parsed = Uri::from_maybe_shared(Bytes::copy_from_slice(path.as_bytes())).unwrap();
        let known = known_uri(path.as_bytes()).unwrap();
        assert_eq!(known, parsed);
        assert_eq!(known.path(), parsed.path());
        assert_eq!(known.query(), None);
        assert_eq!(known.path_and_query(), parsed.path_and_query());
    }
    // Anything else (a query, another path) is parsed.
    assert!(known_uri(b"/v1/chat/completions?x=1").is_none());
    assert!(known_uri(b"/v1/chat/completion").is_none());
    let h = head(b"POST /v1/messages HTTP/1.1\r\nhost: a\r\n\r\n");
    assert_eq!(h.uri.path(), "/v1/messages");
}
