//! The gateway's own HTTP/1.1 server against hyper's, over real sockets: a
//! corpus of requests (valid, malformed, pipelined, chunked, `100-continue`,
//! oversized, large answers, HTTP/1.0, HEAD) sent byte for byte to two gateways that differ
//! only in `server.http1`, whose answers must agree: status lines, header
//! names and values (the date and generated ids aside), how each body is
//! framed, bodies (generated text aside), and whether the connection closes.
//! Then what only the gateway's own server (the default) is asked here: an
//! idle keep-alive connection closes after `server.header_timeout`, and a
//! stopping gateway finishes the answer under way and says it closes.

use std::time::Duration;

use sluice::config::Http1Server;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::*;

/// One case: what is written, in steps. A step after the first is written
/// once the answer so far ends with `wait_for` (a `100 Continue`, say).
struct Case {
    name: &'static str,
    steps: Vec<Vec<u8>>,
    wait_for: &'static [u8],
    /// The requests' methods, in order (a HEAD answer has no body).
    methods: &'static [&'static str],
}

fn case(name: &'static str, wire: impl Into<Vec<u8>>, methods: &'static [&'static str]) -> Case {
    Case {
        name,
        steps: vec![wire.into()],
        wait_for: b"",
        methods,
    }
}

fn chat(stream: bool) -> String {
    chat_body(stream).to_string()
}

/// An embeddings request of `n` inputs: an answer of ~200 bytes each.
fn embeddings(n: usize) -> String {
    let input: Vec<String> = (0..n).map(|i| format!("text {i}")).collect();
    serde_json::json!({"model": "sim-model", "input": input}).to_string()
}

/// A chat request of ~600 KB: more than the server buffers for a handler
/// that has not taken it yet, and more than one read.
fn large_chat() -> String {
    let mut body = chat_body(false);
    body["messages"][0]["content"] = "many words ".repeat(55_000).into();
    body.to_string()
}

fn post(path: &str, extra: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn chunked(body: &str, pieces: usize) -> Vec<u8> {
    let mut wire = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n".to_vec();
    let size = body.len().div_ceil(pieces);
    for (i, piece) in body.as_bytes().chunks(size).enumerate() {
        // A chunk extension on the first, upper-case hex on the rest.
        let ext = if i == 0 { ";name=value" } else { "" };
        wire.extend_from_slice(format!("{:X}{ext}\r\n", piece.len()).as_bytes());
        wire.extend_from_slice(piece);
        wire.extend_from_slice(b"\r\n");
    }
    wire.extend_from_slice(b"0\r\nx-trailer: t\r\n\r\n");
    wire
}

fn corpus() -> Vec<Case> {
    const CLOSE: &str = "connection: close\r\n";
    let get = |path: &str, extra: &str| format!("GET {path} HTTP/1.1\r\nhost: x\r\n{extra}\r\n");
    let mut many = get("/v1/models", "").replace("\r\n\r\n", "\r\n");
    for i in 0..150 {
        many.push_str(&format!("x-h{i}: v\r\n"));
    }
    many.push_str("\r\n");
    let body = chat(false);
    let (head, tail) = body.split_at(10);
    let mut cases = vec![
        case("models", get("/v1/models", CLOSE), &["GET"]),
        case("not found", get("/nope", CLOSE), &["GET"]),
        case(
            "head",
            get("/v1/models", CLOSE).replacen("GET", "HEAD", 1),
            &["HEAD"],
        ),
        case(
            "wrong method",
            get("/v1/models", CLOSE).replacen("GET", "DELETE", 1),
            &["DELETE"],
        ),
        case(
            "bad json",
            post("/v1/chat/completions", CLOSE, "{not json"),
            &["POST"],
        ),
        case(
            "empty body",
            post("/v1/chat/completions", CLOSE, ""),
            &["POST"],
        ),
        case(
            "chat",
            post("/v1/chat/completions", CLOSE, &chat(false)),
            &["POST"],
        ),
        case(
            "stream",
            post("/v1/chat/completions", CLOSE, &chat(true)),
            &["POST"],
        ),
        case("chunked body", chunked(&chat(false), 3), &["POST"]),
        case("chunked stream", chunked(&chat(true), 1), &["POST"]),
        case(
            "pipelined",
            [
                get("/v1/models", ""),
                get("/nope", ""),
                get("/v1/models", CLOSE),
            ]
            .concat(),
            &["GET", "GET", "GET"],
        ),
        case(
            "keep-alive then close",
            [
                post("/v1/chat/completions", "", &chat(false)),
                get("/v1/models", CLOSE),
            ]
            .concat(),
            &["POST", "GET"],
        ),
        case("http/1.0", "GET /v1/models HTTP/1.0\r\n\r\n", &["GET"]),
        case(
            "http/1.0 keep-alive",
            "GET /v1/models HTTP/1.0\r\nconnection: keep-alive\r\n\r\nGET /nope HTTP/1.0\r\n\r\n",
            &["GET", "GET"],
        ),
        case(
            "http/1.0 stream",
            post("/v1/chat/completions", "", &chat(true)).replacen("HTTP/1.1", "HTTP/1.0", 1),
            &["POST"],
        ),
        case(
            "declared too large",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999\r\n\r\n{",
            &["POST"],
        ),
        case("too many headers", many, &["GET"]),
        case(
            "uri too long",
            get(&format!("/{}", "a".repeat(70_000)), ""),
            &["GET"],
        ),
        case("garbage", "GARBAGE\r\n\r\n", &["GET"]),
        case(
            "no colon",
            "GET /v1/models HTTP/1.1\r\nhost: x\r\nno colon\r\n\r\n",
            &["GET"],
        ),
        case(
            "bad length",
            post("/v1/chat/completions", "content-length: x\r\n", "{}"),
            &["POST"],
        ),
        case(
            "unknown coding",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\n",
            &["POST"],
        ),
        case(
            "broken chunks",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
            &["POST"],
        ),
        case(
            "bare LF in chunks",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n2\n{}\r\n0\r\n\r\n",
            &["POST"],
        ),
        case(
            "pipelined after a chunked body",
            [
                String::from_utf8(chunked(&chat(false), 2))
                    .unwrap()
                    .replace("connection: close\r\n", ""),
                get("/v1/models", CLOSE),
            ]
            .concat(),
            &["POST", "GET"],
        ),
        case(
            "a large answer",
            post("/v1/embeddings", CLOSE, &embeddings(3_000)),
            &["POST"],
        ),
        case(
            "a large answer, kept alive, then another",
            [
                post("/v1/embeddings", "", &embeddings(2_000)),
                get("/v1/models", CLOSE),
            ]
            .concat(),
            &["POST", "GET"],
        ),
        case(
            "a body larger than the feed's limit",
            post("/v1/chat/completions", CLOSE, &large_chat()),
            &["POST"],
        ),
        case(
            "closed mid-body",
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 50\r\n\r\n{\"model\"",
            &["POST"],
        ),
    ];
    // What a first raw-socket audit found answered differently by the two
    // (or by one depending on how TCP split the bytes).
    let zeros = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{CLOSE}content-length: {:020}\r\n\r\n{body}",
        body.len()
    );
    cases.push(case("a length with leading zeros", zeros, &["POST"]));
    let long_ext = {
        let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";
        format!(
            "{head}{:X};{}\r\n{body}\r\n0\r\n\r\n",
            body.len(),
            "e".repeat(5_000)
        )
    };
    cases.push(case(
        "a 5,000-byte chunk extension",
        long_ext.clone(),
        &["POST"],
    ));
    let (first, second) = long_ext.split_at(long_ext.find(";e").unwrap() + 2_500);
    cases.push(Case {
        name: "a 5,000-byte chunk extension in two writes",
        steps: vec![first.as_bytes().to_vec(), second.as_bytes().to_vec()],
        wait_for: b"",
        methods: &["POST"],
    });
    let mut trailers = String::from_utf8(chunked(&body, 1)).unwrap();
    trailers.truncate(trailers.len() - 2);
    for i in 0..200 {
        trailers.push_str(&format!("x-t{i}: v\r\n"));
    }
    trailers.push_str("\r\n");
    cases.push(case("200 trailer lines", trailers, &["POST"]));
    cases.push(case(
        "a 70,000-byte header name",
        get(
            "/v1/models",
            &format!("{}: v\r\n{CLOSE}", "n".repeat(70_000)),
        ),
        &["GET"],
    ));
    // `100-continue`: the body goes once the go came.
    let go = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nexpect: 100-continue\r\n{CLOSE}content-length: {}\r\n\r\n",
        body.len()
    );
    cases.push(Case {
        name: "100-continue",
        steps: vec![go.into_bytes(), body.clone().into_bytes()],
        wait_for: b"100 Continue\r\n\r\n",
        methods: &["POST"],
    });
    // A body in two writes, the second after the first was surely read.
    cases.push(Case {
        name: "body in two writes",
        steps: vec![
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{CLOSE}content-length: {}\r\n\r\n{head}",
                body.len()
            )
            .into_bytes(),
            tail.as_bytes().to_vec(),
        ],
        wait_for: b"",
        methods: &["POST"],
    });
    cases
}

/// What the client saw: the bytes, and whether the server closed.
async fn exchange(addr: std::net::SocketAddr, case: &Case) -> (Vec<u8>, bool) {
    exchange_on(tokio::net::TcpStream::connect(addr).await.unwrap(), case).await
}

/// [`exchange`] on a connection made (plain or TLS).
async fn exchange_on<S>(mut s: S, case: &Case) -> (Vec<u8>, bool)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    for (i, step) in case.steps.iter().enumerate() {
        if i > 0 {
            // Wait for the go (or give the server a moment to read the
            // first write on its own: the answer cannot come before the
            // body, so the end of this wait is not what is tested).
            let waited = tokio::time::timeout(Duration::from_millis(300), async {
                while !got.ends_with(case.wait_for) || case.wait_for.is_empty() {
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&buf[..n]);
                }
            })
            .await;
            assert!(
                case.wait_for.is_empty() || waited.is_ok(),
                "{}: no `100 Continue`",
                case.name
            );
        }
        if s.write_all(step).await.is_err() || s.flush().await.is_err() {
            break;
        }
    }
    if case.name == "closed mid-body" {
        let _ = s.shutdown().await;
    }
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .is_ok();
    (got, closed)
}

#[derive(Debug, PartialEq)]
struct Answer {
    status: String,
    /// Lower-cased names, volatile values blanked.
    headers: Vec<(String, String)>,
    framing: &'static str,
    body: serde_json::Value,
}

/// The answers in `wire`, read as a client would.
fn answers(wire: &[u8], methods: &[&str]) -> Vec<Answer> {
    let mut out = Vec::new();
    let mut rest = wire;
    let mut methods = methods.iter();
    let mut method = methods.next().copied().unwrap_or("GET");
    while !rest.is_empty() {
        let mut slots = [httparse::EMPTY_HEADER; 64];
        let mut resp = httparse::Response::new(&mut slots);
        let Ok(httparse::Status::Complete(len)) = resp.parse(rest) else {
            out.push(Answer {
                status: format!("unparsable: {}", String::from_utf8_lossy(rest)),
                headers: vec![],
                framing: "",
                body: serde_json::Value::Null,
            });
            break;
        };
        let code = resp.code.unwrap();
        let status = format!("{code} {}", resp.reason.unwrap_or(""));
        let mut headers: Vec<(String, String)> = resp
            .headers
            .iter()
            .map(|h| {
                let name = h.name.to_ascii_lowercase();
                let value = String::from_utf8_lossy(h.value).to_string();
                let value = match name.as_str() {
                    "date" | "x-request-id" | "content-length" => String::new(),
                    _ => value,
                };
                (name, value)
            })
            .collect();
        headers.sort();
        let find = |n: &str| {
            resp.headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case(n))
                .map(|h| String::from_utf8_lossy(h.value).to_string())
        };
        rest = &rest[len..];
        let (framing, body): (&'static str, Vec<u8>) =
            if code < 200 || method == "HEAD" || code == 204 || code == 304 {
                ("none", vec![])
            } else if let Some(n) = find("content-length") {
                let n: usize = n.parse().unwrap();
                let n = n.min(rest.len());
                let body = rest[..n].to_vec();
                rest = &rest[n..];
                ("length", body)
            } else if find("transfer-encoding").is_some_and(|t| t.contains("chunked")) {
                let mut body = Vec::new();
                loop {
                    let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") else {
                        rest = &[];
                        break;
                    };
                    let size =
                        usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap(), 16)
                            .unwrap();
                    rest = &rest[eol + 2..];
                    if size == 0 {
                        rest = &rest[2.min(rest.len())..];
                        break;
                    }
                    body.extend_from_slice(&rest[..size]);
                    rest = &rest[size + 2..];
                }
                ("chunked", body)
            } else {
                let body = rest.to_vec();
                rest = &[];
                ("close", body)
            };
        if code >= 200 {
            method = methods.next().copied().unwrap_or("GET");
        }
        out.push(Answer {
            status,
            headers,
            framing,
            body: comparable(&body),
        });
    }
    out
}

/// A body as far as two gateways must agree on it: errors whole; answers
/// generated by the replica by their shape (keys, types); event streams by
/// their events' shapes.
fn comparable(body: &[u8]) -> serde_json::Value {
    let text = String::from_utf8_lossy(body);
    if let Ok(mut v) = serde_json::from_str::<serde_json::Value>(&text) {
        if v.get("error").is_none() {
            return shape(&v);
        }
        // Why a body could not be read is each server's own words.
        if let Some(m) = v["error"]["message"].as_str()
            && let Some((why, _)) = m.split_once(": ")
        {
            v["error"]["message"] = why.into();
        }
        return v;
    }
    if text.starts_with("data:") {
        let events: Vec<_> = text
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let data = e.trim_start_matches("data:").trim();
                serde_json::from_str::<serde_json::Value>(data)
                    .map_or_else(|_| serde_json::Value::String(data.into()), |v| shape(&v))
            })
            .collect();
        return serde_json::Value::Array(events);
    }
    serde_json::Value::String(text.into())
}

fn shape(v: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::Object(m) => Value::Object(m.iter().map(|(k, v)| (k.clone(), shape(v))).collect()),
        Value::Array(a) => Value::Array(a.iter().map(shape).collect()),
        Value::String(_) => Value::String("s".into()),
        Value::Number(_) => Value::String("n".into()),
        other => other.clone(),
    }
}

#[tokio::test]
async fn the_own_server_answers_as_hypers_does() {
    differential(None).await;
}

/// The same corpus under TLS (`server.tls`): both servers read and write
/// through rustls, and still answer alike.
#[tokio::test]
async fn the_own_server_answers_as_hypers_does_over_tls() {
    let pki = tls::Pki::new("h1");
    let pair = pki.issue("gateway", "gateway", false);
    differential(Some((pair, pki.client(None)))).await;
}

/// [`exchange`], over TLS with `tls`.
async fn send(
    addr: std::net::SocketAddr,
    case: &Case,
    tls: Option<&std::sync::Arc<rustls::ClientConfig>>,
) -> (Vec<u8>, bool) {
    match tls {
        None => exchange(addr, case).await,
        Some(c) => exchange_on(tls::connect(addr, c.clone()).await.unwrap(), case).await,
    }
}

async fn differential(tls: Option<(tls::Pair, std::sync::Arc<rustls::ClientConfig>)>) {
    let sim = start_sim(fast_sim()).await;
    let mut config = config_for(&[sim.url()]);
    config.server.max_body_bytes = sluice::config::ByteSize(1024 * 1024);
    if let Some((pair, _)) = &tls {
        config.server.tls.cert_file = Some(pair.cert.clone());
        config.server.tls.key_file = Some(pair.key.clone());
        // (The metrics below are read over plain HTTP.)
        config.server.tls.admin = false;
    }
    config.server.http1 = Http1Server::Own;
    let own = start_gateway(config.clone(), 1).await;
    config.server.http1 = Http1Server::Hyper;
    let hyper = start_gateway(config, 1).await;
    let client = tls.as_ref().map(|(_, c)| c);
    let mut differ = Vec::new();
    for case in corpus() {
        let (wire_own, closed_own) = send(own.api_addr, &case, client).await;
        let (wire_hyper, closed_hyper) = send(hyper.api_addr, &case, client).await;
        let mut a = answers(&wire_own, case.methods);
        let mut b = answers(&wire_hyper, case.methods);
        if closed_own && closed_hyper {
            // Both closed: this server always says so in the last head, hyper
            // only when it knew before writing it (not after a body it did
            // not read to its end).
            for answer in a.iter_mut().chain(b.iter_mut()) {
                answer
                    .headers
                    .retain(|h| h != &("connection".into(), "close".into()));
            }
        }
        assert!(!b.is_empty(), "{}: hyper answered nothing", case.name);
        if a != b || closed_own != closed_hyper {
            differ.push(format!(
                "{}:\n  own   (closed {closed_own}): {a:?}\n  hyper (closed {closed_hyper}): {b:?}",
                case.name
            ));
        }
    }
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    // Refused heads are counted by both, without a model: too many
    // headers, and a name too long.
    for gw in [&own, &hyper] {
        let n = gateway_metric(
            gw,
            "sluice_requests_total{model=\"\",tier=\"\",status=\"431\",error_kind=\"headers_too_large\"}",
        )
        .await;
        assert_eq!(n, 2.0);
    }
}

/// Where hyper's server is lenient and RFC 9112 is not, both follow the RFC
/// (the own server in its parser, hyper's mode in the service before any
/// handler): an HTTP/1.1 request names one valid host (section 3.2: 400),
/// and a transfer coding the server does not decode is 501 (section 6.1),
/// not the body taken with the coding dropped. In the OpenAI shape, counted,
/// the connection closed.
#[tokio::test]
async fn both_servers_follow_rfc_9112_where_hyper_alone_is_lenient() {
    let sim = start_sim(fast_sim()).await;
    let mut config = config_for(&[sim.url()]);
    config.server.http1 = Http1Server::Own;
    let own = start_gateway(config.clone(), 1).await;
    config.server.http1 = Http1Server::Hyper;
    let hyper = start_gateway(config, 1).await;
    let get = |host: &str| format!("GET /v1/models HTTP/1.1\r\n{host}connection: close\r\n\r\n");
    let gzip = {
        let body = chat(false);
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: gzip, chunked\r\nconnection: close\r\n\r\n{:X}\r\n{body}\r\n0\r\n\r\n",
            body.len()
        )
    };
    let cases = [
        ("no host", get(""), 400, "malformed_http"),
        (
            "two hosts",
            get("host: a\r\nhost: b\r\n"),
            400,
            "malformed_http",
        ),
        (
            "a path in the host",
            get("host: a/b\r\n"),
            400,
            "malformed_http",
        ),
        (
            "a space in the host",
            get("host: a b\r\n"),
            400,
            "malformed_http",
        ),
        ("gzip, chunked", gzip, 501, "unsupported_transfer_coding"),
    ];
    for gw in [&own, &hyper] {
        for (name, wire, status, code) in &cases {
            let (got, closed) = exchange(gw.api_addr, &case("", wire.clone(), &["GET"])).await;
            let resp = String::from_utf8_lossy(&got).to_string();
            let (head, body) = resp.split_once("\r\n\r\n").unwrap();
            assert!(
                head.starts_with(&format!("HTTP/1.1 {status} ")),
                "{name}: {head}"
            );
            assert!(closed, "{name}: the connection stays open");
            let body: serde_json::Value = serde_json::from_str(body).unwrap();
            assert_eq!(body["error"]["code"], *code, "{name}");
        }
        let n = gateway_metric(
            gw,
            "sluice_requests_total{model=\"\",tier=\"\",status=\"501\",error_kind=\"unsupported_transfer_coding\"}",
        )
        .await;
        assert_eq!(n, 1.0);
    }
}

/// Read one answer sized by `content-length` off `s`: its head and body.
async fn read_sized(s: &mut tokio::net::TcpStream) -> (String, Vec<u8>) {
    let mut got = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..end]).to_string();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .expect("a sized answer")
                .parse()
                .unwrap();
            if got.len() >= end + 4 + len {
                return (head, got[end + 4..end + 4 + len].to_vec());
            }
        }
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed before the answer: {got:?}");
        got.extend_from_slice(&buf[..n]);
    }
}

/// Whether the server closes `s` within `limit` (nothing else arriving).
async fn closes_within(s: &mut tokio::net::TcpStream, limit: Duration) -> bool {
    let mut buf = [0u8; 1024];
    matches!(
        tokio::time::timeout(limit, s.read(&mut buf)).await,
        Ok(Ok(0) | Err(_))
    )
}

#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed_after_the_header_timeout() {
    let sim = start_sim(fast_sim()).await;
    let mut config = config_for(&[sim.url()]);
    config.server.header_timeout = Duration::from_millis(300);
    config.server.http1 = Http1Server::Own;
    let gw = start_gateway(config, 1).await;
    let mut s = tokio::net::TcpStream::connect(gw.api_addr).await.unwrap();
    s.write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let (head, _) = read_sized(&mut s).await;
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    assert!(!head.contains("connection: close"), "{head}");
    // Kept alive, then closed once no next request came in time.
    assert!(closes_within(&mut s, Duration::from_secs(10)).await);
}

#[tokio::test]
async fn a_stopping_gateway_finishes_the_answer_under_way_and_says_it_closes() {
    let sim = start_sim(fast_sim()).await;
    let mut config = config_for(&[sim.url()]);
    config.server.http1 = Http1Server::Own;
    let gw = start_gateway(config, 1).await;
    let mut s = tokio::net::TcpStream::connect(gw.api_addr).await.unwrap();
    // The replica holds the answer for a second: the stop comes meanwhile.
    let body = chat(false);
    let wire = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-sim-fault: first_token=1s\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(wire.as_bytes()).await.unwrap();
    wait_until(
        "the replica has the request",
        Duration::from_secs(5),
        || {
            let n = sim.state.metrics.received.get();
            async move { n == 1 }
        },
    )
    .await;
    let stopping = tokio::spawn(gw.shutdown(Duration::from_secs(10)));
    let (head, body) = read_sized(&mut s).await;
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    assert!(head.contains("connection: close"), "{head}");
    let answer: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(
        answer["choices"][0]["message"]["content"].is_string(),
        "{answer}"
    );
    assert!(closes_within(&mut s, Duration::from_secs(10)).await);
    stopping.await.unwrap();
}
