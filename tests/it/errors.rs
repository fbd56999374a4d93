//! Every failure a client can see: OpenAI-shaped body, right status.

use std::time::Duration;

use crate::common::*;

async fn send_raw(url: &str, body: &'static str) -> (u16, String) {
    let resp = client()
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

#[tokio::test]
async fn client_errors_are_400_404_405_413() {
    let sim = start_sim(fast_sim()).await;
    let mut config = config_for(&[sim.url()]);
    config.server.max_body_bytes = sluice::config::ByteSize(4096);
    let gw = start_gateway(config, 1).await;
    let chat = format!("{}/v1/chat/completions", api(&gw));

    let (s, b) = send_raw(&chat, "{not json").await;
    assert_eq!(s, 400);
    assert_eq!(error_of(&b)["type"], "invalid_request_error");

    let (s, b) = send_raw(&chat, r#"{"messages":[]}"#).await;
    assert_eq!(s, 400);
    assert_eq!(error_of(&b)["param"], "model");

    let (s, b) = send_raw(&chat, r#"{"model":"gpt-7","messages":[]}"#).await;
    assert_eq!(s, 404);
    let e = error_of(&b);
    assert_eq!(e["code"], "model_not_found");

    let big = serde_json::json!({"model": "sim-model", "messages": [{"role": "user", "content": "x".repeat(10_000)}]});
    let (s, _, b) = post(&chat, &big).await;
    assert_eq!(s, 413);
    assert_eq!(error_of(&b)["code"], "request_too_large");

    let (s, b) = get_text(&chat).await;
    assert_eq!(s, 405);
    error_of(&b);

    let (s, b) = get_text(&format!("{}/v2/anything", api(&gw))).await;
    assert_eq!(s, 404);
    assert_eq!(error_of(&b)["code"], "unknown_url");

    // Under /v1: any method but POST on an unknown route, and a POST that
    // names no model (nothing to route it by), are unknown URLs too.
    let (s, b) = get_text(&format!("{}/v1/files", api(&gw))).await;
    assert_eq!(s, 404, "{b}");
    assert_eq!(error_of(&b)["code"], "unknown_url");
    let (s, b) = send_raw(&format!("{}/v1/files", api(&gw)), r#"{"purpose":"x"}"#).await;
    assert_eq!(s, 404, "{b}");
    assert_eq!(error_of(&b)["message"], "Invalid URL (POST /v1/files)");

    // None of these reached the replica.
    assert_eq!(sim.state.metrics.received.get(), 0);
    assert_eq!(
        gateway_metric(
            &gw,
            "sluice_requests_total{model=\"\",tier=\"\",status=\"404\",error_kind=\"model_not_found\"}"
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn upstream_errors_pass_through_with_status_and_normalised_body() {
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    let chat = format!("{}/v1/chat/completions", api(&gw));
    for (fault, status) in [("error=422", 422), ("error=500", 500)] {
        let (s, _, b) = post_with(&chat, &chat_body(true), &[("x-sim-fault", fault)]).await;
        assert_eq!(s, status, "{b}");
        let e = error_of(&b);
        assert_eq!(e["message"], "simulated error");
    }
}

#[tokio::test]
async fn no_healthy_backend_is_503_and_not_ready() {
    // A replica nobody listens on: known model (from config), never healthy.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let mut config = config_for(&[dead]);
    config.backends[0].models = vec!["sim-model".into()];
    let gw = start_gateway(config, 0).await;
    let (s, b) = get_text(&format!("{}/readyz", admin(&gw))).await;
    assert_eq!(s, 503, "{b}");
    let (s, _, b) = post(
        &format!("{}/v1/chat/completions", api(&gw)),
        &chat_body(false),
    )
    .await;
    assert_eq!(s, 503);
    assert_eq!(error_of(&b)["code"], "no_healthy_backend");
    // What SluiceNoHealthyReplica alerts on: the fleet and the model at 0.
    assert_eq!(gateway_metric(&gw, "sluice_backends_healthy").await, 0.0);
    let per_model = r#"sluice_model_replicas_healthy{model="sim-model"}"#;
    let (_, text) = get_text(&format!("{}/metrics", admin(&gw))).await;
    assert_eq!(metric(&text, per_model), Some(0.0), "{text}");
    let (s, _) = get_text(&format!("{}/healthz", admin(&gw))).await;
    assert_eq!(s, 200, "alive even when not ready");
}

#[tokio::test]
async fn first_token_timeout_is_504() {
    let sim = start_sim(fast_sim()).await;
    let mut config = config_for(&[sim.url()]);
    config.upstream.timeouts.first_token = Duration::from_millis(300);
    let gw = start_gateway(config, 1).await;
    let (s, _, b) = post_with(
        &format!("{}/v1/chat/completions", api(&gw)),
        &chat_body(true),
        &[("x-sim-fault", "first_token=10s")],
    )
    .await;
    assert_eq!(s, 504);
    assert_eq!(error_of(&b)["code"], "timeout_first_token");
    wait_until("replica aborted", Duration::from_secs(3), || {
        let n = sim_finished(&sim, "abort");
        async move { n == 1 }
    })
    .await;
}

#[tokio::test]
async fn a_client_too_slow_to_send_its_body_gets_408() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sim = start_sim(fast_sim()).await;
    let mut config = config_for(&[sim.url()]);
    config.server.body_timeout = Duration::from_millis(300);
    let gw = start_gateway(config, 1).await;
    // Headers promise 100 bytes; 10 come, then nothing.
    let mut tcp = tokio::net::TcpStream::connect(gw.api_addr).await.unwrap();
    tcp.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
          content-length: 100\r\n\r\n{\"model\":",
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 4096];
        while !got.windows(4).any(|w| w == b"\r\n\r\n") || !got.ends_with(b"}") {
            let n = tcp.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    assert!(read.is_ok(), "no answer to a stalled body");
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("\"code\":\"body_timeout\""), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered after the body timeout, not a minute later"
    );
    assert_eq!(sim.state.metrics.received.get(), 0);
}

#[tokio::test]
async fn a_client_too_slow_to_send_its_headers_is_disconnected() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sim = start_sim(fast_sim()).await;
    let mut config = config_for(&[sim.url()]);
    config.server.header_timeout = Duration::from_millis(300);
    let gw = start_gateway(config, 1).await;
    let mut tcp = tokio::net::TcpStream::connect(gw.api_addr).await.unwrap();
    tcp.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    // The rest of the headers never come: the gateway closes the connection.
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 1024];
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "a connection with unfinished headers is held open"
    );
    // Requests that do arrive in time are served as usual.
    let (status, _, _) = post(
        &format!("{}/v1/chat/completions", api(&gw)),
        &chat_body(false),
    )
    .await;
    assert_eq!(status, 200);
}
