//! The header rules of forwarding, and the pooled client of the gateway's own
//! calls to the replicas (health checks, metrics scrapes, discovery).
//!
//! Proxied requests do not use this client: they go over `conn.rs`, where the
//! request owns its connection and decodes the body inside its own poll. The
//! background calls are few and not latency-critical, so hyper-util's pooled
//! client serves them.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, header};
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::http1::Outgoing;
use crate::config::UpstreamConfig;
use crate::headers::{Fields, Lookup, is_name, text};

pub(crate) type HttpClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

pub(crate) fn build_client(cfg: &UpstreamConfig) -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_connect_timeout(Some(cfg.timeouts.connect));
    // Tokens are small writes; Nagle would hold each for an ACK.
    conn.set_nodelay(true);
    conn.set_keepalive(Some(Duration::from_secs(30)));
    // `https://` replicas' checks and scrapes trust what their requests
    // trust (`upstream.tls`; the state's build has checked that it loads
    // where a replica needs it).
    conn.enforce_http(false);
    let tls = crate::net::tls::shared_client(&cfg.tls)
        .map(|c| {
            let mut config = (*c.config).clone();
            // (hyper-rustls sets ALPN itself.)
            config.alpn_protocols.clear();
            config
        })
        .unwrap_or_else(|_| {
            // (None is used: no replica is `https://`.)
            rustls::ClientConfig::builder()
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth()
        });
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(conn);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(cfg.pool_idle_timeout)
        .pool_max_idle_per_host(cfg.pool_max_idle_per_host)
        .build(https)
}

pub(crate) static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Connection-level headers that must not cross a proxy (RFC 9110 7.6.1).
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// Headers named in `Connection:` are hop-by-hop too.
fn connection_listed(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect()
}

/// A client's header that never reaches a replica (`listed`: the names its
/// `Connection` lists): one connection's headers, the client's credentials,
/// and what the gateway writes itself. The one rule of [`upstream_headers`]
/// and (by name as it came, [`stays_here_raw`]) [`proxied_request`].
fn stays_here(name: &HeaderName, listed: &[HeaderName]) -> bool {
    is_hop_by_hop(name)
        || listed.contains(name)
        || name == header::AUTHORIZATION
        || name == "x-api-key"
        || name == header::HOST
        || name == header::CONTENT_LENGTH
        || name == header::ACCEPT_ENCODING
        || name == X_REQUEST_ID
}

/// [`stays_here`] for a name as it came (any case): by its length, then at
/// most three comparisons. `listed` holds the tokens `Connection` lists.
fn stays_here_raw(name: &[u8], listed: &[&[u8]]) -> bool {
    let is = |n: &[u8]| name.eq_ignore_ascii_case(n);
    let fixed = match name.len() {
        2 => is(b"te"),
        4 => is(b"host"),
        7 => is(b"trailer") || is(b"upgrade"),
        9 => is(b"x-api-key"),
        10 => is(b"connection") || is(b"keep-alive"),
        12 => is(b"x-request-id"),
        13 => is(b"authorization"),
        14 => is(b"content-length"),
        15 => is(b"accept-encoding"),
        16 => is(b"proxy-connection"),
        17 => is(b"transfer-encoding"),
        18 => is(b"proxy-authenticate"),
        19 => is(b"proxy-authorization"),
        _ => false,
    };
    fixed || listed.iter().any(|l| l.eq_ignore_ascii_case(name))
}

/// The names a client's `Connection` fields list, as they came.
fn connection_listed_raw(client: &Fields) -> Vec<&[u8]> {
    let mut listed = Vec::new();
    for (name, value) in client.iter() {
        if is_name(name, b"connection") && text(value).is_some() {
            listed.extend(
                value
                    .split(|b| *b == b',')
                    .map(<[u8]>::trim_ascii)
                    .filter(|n| !n.is_empty()),
            );
        }
    }
    listed
}

/// The headers sent to a replica: the client's, minus hop-by-hop headers, its
/// `Authorization` and `x-api-key` (a gateway key is not the replica's key), `Host`, the body
/// framing (recomputed) and `Accept-Encoding` (streams must stay readable to
/// the gateway), plus the request id and the replica's own key.
pub(crate) fn upstream_headers(client: &HeaderMap, request_id: &HeaderValue) -> HeaderMap {
    let listed = connection_listed(client);
    // Room for the two added here and the proxy's `traceparent`, `host` and
    // `authorization`: a full map grows by rehashing every entry.
    let mut out = HeaderMap::with_capacity(client.len() + 5);
    for (name, value) in client {
        if !stays_here(name, &listed) {
            out.append(name.clone(), value.clone());
        }
    }
    out.insert(X_REQUEST_ID.clone(), request_id.clone());
    out.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    out
}

/// The request a replica gets for a proxied one, written straight to the
/// wire: the client's headers that [`upstream_headers`] keeps (names in
/// lower case, as a map writes them), the request id,
/// `content-type: application/json`, then `added` (trace context,
/// `Host`, the replica's key: each replaces the client's of that name), the
/// length and the body. Building [`upstream_headers`]' map and encoding it
/// cost ~2,400 instructions a request (callgrind); this is one pass with no
/// map. The test below holds it to that map's encoding. `added` values are
/// written as they are: they must be header values (no CR or LF; checked in
/// debug builds), as `HeaderValue`s' bytes and the hex `traceparent` are.
pub(crate) fn proxied_request(
    method: &Method,
    path: &str,
    client: &Fields,
    request_id: &HeaderValue,
    added: &[(&HeaderName, &[u8])],
    body: &[u8],
) -> Outgoing {
    let listed = connection_listed_raw(client);
    let mut out = Vec::with_capacity(192 + client.len() * 48 + body.len());
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    let mut line = |name: &[u8], value: &[u8]| {
        let at = out.len();
        out.extend_from_slice(name);
        out[at..].make_ascii_lowercase();
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    };
    for (name, value) in client.iter() {
        // `content-type` and `added` are written below, in the client's place.
        if stays_here_raw(name, &listed)
            || is_name(name, b"content-type")
            || added
                .iter()
                .any(|(n, _)| is_name(name, n.as_str().as_bytes()))
        {
            continue;
        }
        line(name, value);
    }
    line(X_REQUEST_ID.as_str().as_bytes(), request_id.as_bytes());
    line(b"content-type", b"application/json");
    for (name, value) in added {
        // Raw bytes go on the wire as they are: only a header value's may.
        debug_assert!(
            HeaderValue::from_bytes(value).is_ok(),
            "{name}: not a header value"
        );
        line(name.as_str().as_bytes(), value);
    }
    if !body.is_empty() || method != Method::GET {
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(itoa::Buffer::new().format(body.len()).as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body);
    Outgoing {
        wire: out,
        head_only: method == Method::HEAD,
    }
}

/// The headers returned to the client from a replica's response: the
/// reference of what `http1::forwarded` passes on (its test compares the two).
#[cfg(test)]
pub(crate) fn downstream_headers(upstream: &HeaderMap, request_id: &HeaderValue) -> HeaderMap {
    let listed = connection_listed(upstream);
    let mut out = HeaderMap::with_capacity(upstream.len() + 1);
    for (name, value) in upstream {
        if is_hop_by_hop(name)
            || listed.contains(name)
            || name == header::CONTENT_LENGTH
            || name == header::DATE
            || name == header::SERVER
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out.insert(X_REQUEST_ID.clone(), request_id.clone());
    out
}

/// The client's `x-request-id` if it is sane (visible ASCII, at most 128
/// bytes), else a fresh random one.
pub(crate) fn request_id(client: &impl Lookup) -> HeaderValue {
    if let Some(v) = client.first(&X_REQUEST_ID)
        && !v.is_empty()
        && v.len() <= 128
        && v.iter().all(|b| b.is_ascii_graphic())
        && let Ok(v) = HeaderValue::from_bytes(v)
    {
        return v;
    }
    // 32 hex digits written in place (`format!` cost ~1,000 instructions a
    // request; the test below checks the same digits).
    let id = crate::telemetry::tracecontext::hex32(fastrand::u128(..));
    HeaderValue::from_bytes(&id).unwrap_or_else(|_| HeaderValue::from_static("unknown"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarding_strips_what_must_not_cross() {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer client"),
        );
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(header::HOST, HeaderValue::from_static("gw"));
        h.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("gzip"));
        h.insert("traceparent", HeaderValue::from_static("00-abc-def-01"));
        let id = HeaderValue::from_static("rid");
        let out = upstream_headers(&h, &id);
        assert!(out.get(header::AUTHORIZATION).is_none());
        assert!(out.get("x-secret").is_none());
        assert!(out.get(header::CONNECTION).is_none());
        assert!(out.get(header::HOST).is_none());
        assert!(out.get(header::ACCEPT_ENCODING).is_none());
        assert_eq!(out.get("traceparent"), h.get("traceparent"));
        assert_eq!(out.get(&X_REQUEST_ID), Some(&id));
    }

    /// A request's head lines as (name, value) pairs grouped by name in
    /// order of first appearance, values in order (what a `HeaderMap`
    /// keeps), and the request line and body.
    type Lines = (String, Vec<(String, Vec<String>)>, Vec<u8>);

    fn lines_by_name(wire: &[u8]) -> Lines {
        let text = String::from_utf8_lossy(wire).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let mut lines = head.split("\r\n");
        let first = lines.next().unwrap().to_string();
        let mut grouped: Vec<(String, Vec<String>)> = Vec::new();
        for l in lines {
            let (n, v) = l.split_once(": ").unwrap();
            match grouped.iter_mut().find(|(g, _)| g == n) {
                Some((_, vs)) => vs.push(v.to_string()),
                None => grouped.push((n.to_string(), vec![v.to_string()])),
            }
        }
        grouped.sort_by(|a, b| a.0.cmp(&b.0));
        (first, grouped, body.as_bytes().to_vec())
    }

    /// The fields of a head that carries `map`'s headers, the `upper`-th
    /// names in upper case.
    fn as_written(map: &HeaderMap, upper: &[bool]) -> Fields {
        let mut head = Vec::new();
        let mut at = Vec::new();
        for (i, (name, value)) in map.iter().enumerate() {
            let n = head.len();
            head.extend_from_slice(name.as_str().as_bytes());
            if upper.get(i).copied().unwrap_or(false) {
                head[n..].make_ascii_uppercase();
            }
            let end = head.len();
            head.extend_from_slice(b": ");
            let v = head.len();
            head.extend_from_slice(value.as_bytes());
            at.push(crate::headers::Field::new(n..end, v..head.len()));
            head.extend_from_slice(b"\r\n");
        }
        Fields::new(Bytes::from(head), at)
    }

    proptest::proptest! {
        /// The direct writer sends what the header map, encoded, sends.
        #[test]
        fn proxied_requests_are_what_the_map_encodes(
            headers in proptest::collection::vec(
                (
                    proptest::prop_oneof![
                        proptest::strategy::Just("connection".to_string()),
                        proptest::strategy::Just("authorization".to_string()),
                        proptest::strategy::Just("x-api-key".to_string()),
                        proptest::strategy::Just("host".to_string()),
                        proptest::strategy::Just("content-type".to_string()),
                        proptest::strategy::Just("content-length".to_string()),
                        proptest::strategy::Just("transfer-encoding".to_string()),
                        proptest::strategy::Just("accept-encoding".to_string()),
                        proptest::strategy::Just("traceparent".to_string()),
                        proptest::strategy::Just("x-request-id".to_string()),
                        proptest::strategy::Just("te".to_string()),
                        "x-[a-c]",
                        "[a-z][a-z-]{0,10}",
                    ],
                    proptest::prop_oneof![
                        proptest::strategy::Just("close, x-a".to_string()),
                        proptest::strategy::Just("keep-alive".to_string()),
                        "[ -~]{0,16}",
                    ],
                ),
                0..10,
            ),
            with_trace in proptest::bool::ANY,
            with_key in proptest::bool::ANY,
            body in "[ -~]{0,40}",
            get in proptest::bool::ANY,
            upper in proptest::collection::vec(proptest::bool::ANY, 10),
        ) {
            let mut client = HeaderMap::new();
            for (n, v) in &headers {
                client.append(
                    HeaderName::from_bytes(n.as_bytes()).unwrap(),
                    HeaderValue::from_str(v.trim()).unwrap(),
                );
            }
            let rid = HeaderValue::from_static("rid-1");
            let trace = HeaderValue::from_static("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
            let host = HeaderValue::from_static("replica:8000");
            let key = HeaderValue::from_static("Bearer replica");
            let traceparent = HeaderName::from_static("traceparent");
            let mut added: Vec<(&HeaderName, &[u8])> = Vec::new();
            if with_trace {
                added.push((&traceparent, trace.as_bytes()));
            }
            added.push((&header::HOST, host.as_bytes()));
            if with_key {
                added.push((&header::AUTHORIZATION, key.as_bytes()));
            }
            let method = if get { Method::GET } else { Method::POST };
            let body = Bytes::from(body);
            // The reference: the map, its additions, then the encoder.
            let mut map = upstream_headers(&client, &rid);
            for (n, v) in &added {
                map.insert((*n).clone(), HeaderValue::from_bytes(v).unwrap());
            }
            let mut req = http::Request::builder()
                .method(method.clone())
                .uri("/v1/chat/completions?x=1")
                .body(body.clone())
                .unwrap();
            *req.headers_mut() = map;
            let theirs = Outgoing::of(&req);
            // Ours from the fields as they came, names in any case.
            let fields = as_written(&client, &upper);
            let ours = proxied_request(&method, "/v1/chat/completions?x=1", &fields, &rid, &added, &body);
            proptest::prop_assert_eq!(ours.head_only, theirs.head_only);
            proptest::prop_assert_eq!(lines_by_name(&ours.wire), lines_by_name(&theirs.wire));
        }
    }

    #[test]
    fn request_ids_are_kept_when_sane() {
        let mut h = HeaderMap::new();
        h.insert(&X_REQUEST_ID, HeaderValue::from_static("abc-123"));
        assert_eq!(request_id(&h), "abc-123");
        h.insert(&X_REQUEST_ID, HeaderValue::from_static("has space"));
        assert_ne!(request_id(&h), "has space");
        assert_eq!(request_id(&HeaderMap::new()).len(), 32);
        // The digits are those `format!("{:032x}")` gives for the same number.
        fastrand::seed(7);
        let written = request_id(&HeaderMap::new());
        fastrand::seed(7);
        assert_eq!(written, format!("{:032x}", fastrand::u128(..)).as_str());
    }
}
