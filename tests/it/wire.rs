//! The upstream HTTP/1.1 client against replicas writing raw bytes: every way a
//! response body can be delimited, interim responses, trailers, kept-alive
//! connections closed under it, and malformed or truncated answers.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::raw::{self, Reply, SSE};
use crate::common::*;

fn sized(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A gateway in front of these replicas (health-checked once, at start).
async fn gateway(replicas: &[&raw::Raw]) -> sluice::server::Gateway {
    let urls: Vec<String> = replicas.iter().map(|r| r.url()).collect();
    let mut config = config_for(&urls);
    config.upstream.health_check.interval = Duration::from_secs(3600);
    start_gateway(config, replicas.len()).await
}

#[tokio::test]
async fn streams_delimited_by_length_or_by_close_pass_through() {
    let sized_replica = raw::start("sized", |_| Reply::KeepAlive(sized(SSE))).await;
    let close_replica = raw::start("close", |_| {
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n";
        Reply::Close(format!("{head}{SSE}").into_bytes())
    })
    .await;
    let gw = gateway(&[&sized_replica, &close_replica]).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    for model in ["sized", "close", "sized", "close"] {
        let (status, _, body) = post(&url, &chat_for(model, true)).await;
        assert_eq!(status, 200, "{model}: {body}");
        assert_eq!(body, SSE, "{model}");
    }
    assert_eq!(
        sized_replica.connections.load(Ordering::SeqCst),
        1,
        "a sized body read to its end leaves the connection reusable"
    );
    assert_eq!(close_replica.connections.load(Ordering::SeqCst), 2);
    assert_eq!(
        gateway_metric(
            &gw,
            "sluice_request_finish_reasons_total{model=\"close\",finish_reason=\"stop\"}"
        )
        .await,
        2.0
    );
}

#[tokio::test]
async fn interim_responses_chunk_extensions_and_trailers_are_understood() {
    let replica = raw::start("chunked", |_| {
        let (a, b) = SSE.split_at(40);
        let wire = format!(
            "HTTP/1.1 100 Continue\r\n\r\n\
             HTTP/1.1 103 Early Hints\r\nlink: </hint>; rel=preload\r\n\r\n\
             HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n\
             {:x};name=value\r\n{a}\r\n{:X}\r\n{b}\r\n0\r\nx-checksum: 1\r\n\r\n",
            a.len(),
            b.len()
        );
        Reply::KeepAlive(wire.into_bytes())
    })
    .await;
    let gw = gateway(&[&replica]).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    for _ in 0..3 {
        let (status, headers, body) = post(&url, &chat_for("chunked", true)).await;
        assert_eq!(status, 200, "{body}");
        assert!(!headers.contains_key("link"), "an interim head leaked");
        assert_eq!(body, SSE);
    }
    assert_eq!(
        replica.connections.load(Ordering::SeqCst),
        1,
        "trailers read to the end leave the connection reusable"
    );
}

#[tokio::test]
async fn connection_close_and_leftover_bytes_keep_a_connection_out_of_the_pool() {
    // Both replicas keep their side open: only the gateway's reading of the
    // answer can decide not to reuse the connection.
    let says_close = raw::start("says-close", |_| {
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n";
        Reply::KeepAlive(format!("{head}content-length: {}\r\n\r\n{SSE}", SSE.len()).into_bytes())
    })
    .await;
    let overlong = raw::start("overlong", |_| {
        let mut wire = sized(SSE);
        wire.extend_from_slice(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}");
        Reply::KeepAlive(wire)
    })
    .await;
    let gw = gateway(&[&says_close, &overlong]).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    for model in ["says-close", "overlong", "says-close", "overlong"] {
        let (status, _, body) = post(&url, &chat_for(model, true)).await;
        assert_eq!(status, 200, "{model}: {body}");
        assert_eq!(body, SSE, "{model}");
    }
    assert_eq!(says_close.connections.load(Ordering::SeqCst), 2);
    assert_eq!(
        overlong.connections.load(Ordering::SeqCst),
        2,
        "bytes after the end of a response must not be read as the next one's"
    );
}

#[tokio::test]
async fn idle_connections_the_replica_closed_are_swept() {
    // `closes` answers with keep-alive framing and then closes its side, as a
    // server's idle timeout does; the gateway's sweep (with the health checks)
    // must drop that connection from its pool and keep the live one.
    let keeps = raw::start("keeps", |_| Reply::KeepAlive(sized(SSE))).await;
    let closes = raw::start("closes", |_| Reply::Close(sized(SSE))).await;
    let mut config = config_for(&[keeps.url(), closes.url()]);
    config.upstream.health_check.interval = Duration::from_millis(100);
    let gw = start_gateway(config, 2).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    for model in ["keeps", "closes"] {
        let (status, _, body) = post(&url, &chat_for(model, true)).await;
        assert_eq!(status, 200, "{model}: {body}");
    }
    let idle = |addr: std::net::SocketAddr| {
        let replicas = gw.state().pool.replicas();
        replicas
            .iter()
            .find(|r| *r.name == *addr.to_string())
            .map(|r| r.conns.idle_count())
            .unwrap()
    };
    wait_until(
        "the closed connection swept",
        Duration::from_secs(5),
        || {
            let n = idle(closes.addr);
            async move { n == 0 }
        },
    )
    .await;
    assert_eq!(idle(keeps.addr), 1, "a live idle connection is kept");
    // And the next request to the closed replica simply opens a new connection.
    let (status, _, body) = post(&url, &chat_for("closes", true)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(closes.requests.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_kept_alive_connection_closed_without_an_answer_is_resent_on_a_fresh_one() {
    // The race every pooled client meets: the replica's idle timeout closes the
    // connection just as the next request goes out on it. Here the replica
    // even reads the request before hanging up, the worst case: the gateway
    // cannot tell, and resends once on a new connection (OpenAI endpoints are
    // free of side effects; the client would otherwise get a 502 and, with the
    // OpenAI SDK, resend it itself).
    let replica = raw::start("m", |i| {
        if i == 0 {
            Reply::KeepAlive(sized(SSE))
        } else {
            Reply::Hangup
        }
    })
    .await;
    let gw = gateway(&[&replica]).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    for round in 0..3 {
        let (status, _, body) = post(&url, &chat_for("m", true)).await;
        assert_eq!(status, 200, "round {round}: {body}");
        assert_eq!(body, SSE, "round {round}");
    }
    assert_eq!(
        replica.requests.load(Ordering::SeqCst),
        5,
        "first request, then twice a hang-up followed by its resend"
    );
}

#[tokio::test]
async fn a_replica_that_answered_something_is_not_sent_the_request_again() {
    // An interim `100 Continue` proves the replica has the request: a hang-up
    // after it is a failure, not a dead idle connection.
    let replica = raw::start("m", |i| {
        if i == 0 {
            Reply::KeepAlive(sized(SSE))
        } else {
            Reply::Close(b"HTTP/1.1 100 Continue\r\n\r\n".to_vec())
        }
    })
    .await;
    let gw = gateway(&[&replica]).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let (status, _, _) = post(&url, &chat_for("m", true)).await;
    assert_eq!(status, 200);
    let (status, _, body) = post(&url, &chat_for("m", true)).await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(error_of(&body)["code"], "upstream_protocol");
    assert_eq!(replica.requests.load(Ordering::SeqCst), 2, "not resent");
}

#[tokio::test]
async fn malformed_or_truncated_answers_are_clean_errors() {
    let bad_head = raw::start("bad-head", |_| {
        Reply::KeepAlive(b"HTTP/1.1 200 OK\r\ncontent-length: zz\r\n\r\n{}".to_vec())
    })
    .await;
    let truncated = raw::start("truncated", |_| {
        Reply::Close(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 500\r\n\r\n{\"id\":"
                .to_vec(),
        )
    })
    .await;
    let bad_chunk = raw::start("bad-chunk", |_| {
        let first = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n";
        let wire = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n\
             {:x}\r\n{first}\r\nzz\r\nnot a chunk\r\n",
            first.len()
        );
        Reply::KeepAlive(wire.into_bytes())
    })
    .await;
    let two_lengths = raw::start("two-lengths", |_| {
        Reply::KeepAlive(
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 12\r\n\r\n{}".to_vec(),
        )
    })
    .await;
    let gw = gateway(&[&bad_head, &truncated, &bad_chunk, &two_lengths]).await;
    let url = format!("{}/v1/chat/completions", api(&gw));

    for model in ["bad-head", "truncated", "two-lengths"] {
        let (status, _, body) = post(&url, &chat_for(model, false)).await;
        assert_eq!(status, 502, "{model}: {body}");
        let err = error_of(&body);
        assert_eq!(err["code"], "upstream_protocol", "{model}: {body}");
    }

    let (status, _, body) = post(&url, &chat_for("bad-chunk", true)).await;
    assert_eq!(status, 200, "headers went out with the first event");
    let payloads = data_payloads(&body);
    assert_eq!(payloads.len(), 3, "{body}");
    assert!(payloads[0].contains("Hel"));
    let err: serde_json::Value = serde_json::from_str(&payloads[1]).unwrap();
    assert_eq!(err["error"]["code"], "upstream_protocol", "{body}");
    assert_eq!(payloads[2], "[DONE]");
}

#[tokio::test]
async fn a_kept_connection_bounds_each_answer_by_its_own_requests_deadline() {
    // A kept-alive connection keeps one timer for its requests' deadlines,
    // moved lazily (`Conn::passed`). Whatever an earlier request left it at,
    // nearer or later, each wait for an answer ends at its own deadline.
    const TOTAL: Duration = Duration::from_secs(3);
    const FIRST_TOKEN: Duration = Duration::from_millis(100);
    let json = concat!(
        r#"{"id":"c","object":"chat.completion","created":0,"model":"silent","#,
        r#""choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"#,
        r#""finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"#,
        r#""total_tokens":2}}"#
    );
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = sent.clone();
    let replica = raw::start("silent", move |_| match count.fetch_add(1, Ordering::SeqCst) {
        0 => Reply::KeepAlive(sized(SSE)),
        2 => Reply::KeepAlive(
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{json}",
                json.len()
            )
            .into_bytes(),
        ),
        _ => Reply::Silent,
    })
    .await;
    let mut config = config_for(&[replica.url()]);
    config.upstream.health_check.interval = Duration::from_secs(3600);
    config.upstream.timeouts.total = TOTAL;
    config.upstream.timeouts.first_token = FIRST_TOKEN;
    let gw = start_gateway(config, 1).await;
    let url = format!("{}/v1/chat/completions", api(&gw));

    // A stream leaves the timer at its first-token deadline; the whole
    // answer asked next on that connection gets its later, total one.
    let (s, _, b) = post(&url, &chat_for("silent", true)).await;
    assert_eq!((s, b.as_str()), (200, SSE));
    let t = std::time::Instant::now();
    let (s, _, b) = post(&url, &chat_for("silent", false)).await;
    let waited = t.elapsed();
    assert_eq!(s, 504, "{b}");
    assert_eq!(error_of(&b)["code"], "timeout_total");
    assert!(waited >= TOTAL, "cut at {waited:?}, before its deadline");
    assert!(waited < TOTAL * 5, "waited {waited:?}");
    assert_eq!(
        replica.connections.load(Ordering::SeqCst),
        1,
        "one kept connection"
    );

    // A whole answer leaves it at the total deadline; a stream asked next
    // on that (new) connection must not wait that long for its first token.
    let (s, _, b) = post(&url, &chat_for("silent", false)).await;
    assert_eq!(s, 200, "{b}");
    let t = std::time::Instant::now();
    let (s, _, b) = post(&url, &chat_for("silent", true)).await;
    let waited = t.elapsed();
    assert_eq!(s, 504, "{b}");
    assert_eq!(error_of(&b)["code"], "timeout_first_token");
    assert!(
        waited >= FIRST_TOKEN,
        "cut at {waited:?}, before its deadline"
    );
    // Broken, it would wait for the earlier request's deadline: TOTAL after
    // that request came, a few milliseconds before this one.
    assert!(
        waited < TOTAL / 2,
        "waited {waited:?}: the earlier request's deadline"
    );
    assert_eq!(replica.connections.load(Ordering::SeqCst), 2);
    assert_eq!(replica.requests.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn a_whole_answer_whose_body_stops_is_cut_at_the_total_deadline() {
    // The body of a whole answer is read on the connection's kept timer
    // (`Conn::collect`): a replica that sends the head and half the body,
    // then nothing, is answered 504 at the total deadline, not held open.
    const TOTAL: Duration = Duration::from_secs(2);
    let replica = raw::start("stalls", move |i| {
        let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n";
        match i {
            // The first request on the connection gets its whole answer, so
            // the second waits on a kept connection's timer.
            0 => Reply::KeepAlive(
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{WHOLE}",
                    WHOLE.len()
                )
                .into_bytes(),
            ),
            _ => Reply::Stall(format!("{head}{{\"id\":\"c\",").into_bytes()),
        }
    })
    .await;
    let mut config = config_for(&[replica.url()]);
    config.upstream.health_check.interval = Duration::from_secs(3600);
    config.upstream.timeouts.total = TOTAL;
    let gw = start_gateway(config, 1).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let (s, _, b) = post(&url, &chat_for("stalls", false)).await;
    assert_eq!(s, 200, "{b}");
    let t = std::time::Instant::now();
    let (s, _, b) = post(&url, &chat_for("stalls", false)).await;
    let waited = t.elapsed();
    assert_eq!(s, 504, "{b}");
    assert_eq!(error_of(&b)["code"], "timeout_total");
    assert!(waited >= TOTAL, "cut at {waited:?}, before its deadline");
    assert!(waited < TOTAL * 5, "waited {waited:?}");
    assert_eq!(
        replica.connections.load(Ordering::SeqCst),
        1,
        "one kept connection"
    );
}

/// A whole chat answer.
const WHOLE: &str = concat!(
    r#"{"id":"c","object":"chat.completion","created":0,"model":"stalls","#,
    r#""choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"#,
    r#""finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"#,
    r#""total_tokens":2}}"#
);
