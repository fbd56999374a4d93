//! Streaming semantics: bytes untouched, usage requested and stripped, client
//! disconnect cancels upstream, mid-stream failures end with an error event,
//! and the timing record reaches /metrics.

use std::time::{Duration, Instant};

use futures_util::StreamExt;

use crate::common::scripted::{self, Script};
use crate::common::*;

const MS: Duration = Duration::from_millis(1);

#[tokio::test]
async fn events_are_forwarded_byte_for_byte_across_odd_chunking() {
    // Odd but valid SSE: CRLF endings, comments, an event split mid-JSON across
    // chunks, two events in one chunk, escaped unicode. The client must see the
    // exact bytes (no usage chunk here, so nothing is removed).
    let chunks: Vec<(Duration, &'static [u8])> = vec![
        (MS, b": keep-alive\n\n"),
        (MS, b"data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\r\n\r\n"),
        (MS, b"data: {\"choices\":[{\"index\":0,\"delta\":{\"cont"),
        (MS, b"ent\":\"caf\\u00e9\"}}]}\n"),
        (MS, b"\ndata:{\"choices\":[{\"index\":0,\"delta\":{\"content\":\" x\"}}]}\n\ndata: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n"),
        (MS, b"data: [DONE]\n\n"),
    ];
    let expected: Vec<u8> = chunks.iter().flat_map(|(_, b)| b.to_vec()).collect();
    let backend = scripted::start("m", Script::sse(chunks)).await;
    let gw = start_gateway(config_for(&[backend.url()]), 1).await;

    let body = serde_json::json!({"model": "m", "stream": true, "messages": []});
    let resp = client()
        .post(format!("{}/v1/chat/completions", api(&gw)))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let got = resp.bytes().await.unwrap();
    assert_eq!(
        String::from_utf8_lossy(&got),
        String::from_utf8_lossy(&expected)
    );

    // Two output events: one TTFT sample and one inter-token gap.
    let m = |s: &'static str| {
        let gw = &gw;
        async move { gateway_metric(gw, s).await }
    };
    assert_eq!(
        m("sluice_time_to_first_token_seconds_count{model=\"m\"}").await,
        1.0
    );
    assert_eq!(
        m("sluice_inter_token_latency_seconds_count{model=\"m\"}").await,
        1.0
    );
    assert_eq!(
        m("sluice_request_finish_reasons_total{model=\"m\",finish_reason=\"stop\"}").await,
        1.0
    );
}

#[tokio::test]
async fn usage_is_requested_upstream_and_stripped_unless_asked() {
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    let url = format!("{}/v1/chat/completions", api(&gw));

    // Client did not ask: the replica was asked anyway, the client sees no usage chunk.
    let (status, _, body) = post(&url, &chat_body(true)).await;
    assert_eq!(status, 200);
    let (_, last) = get_text(&format!("{}/sim/last_request", sim.url())).await;
    let last: serde_json::Value = serde_json::from_str(&last).unwrap();
    assert_eq!(last["body"]["stream_options"]["include_usage"], true);
    let payloads = data_payloads(&body);
    assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"));
    assert!(
        !payloads.iter().any(|p| p.contains("\"usage\"")),
        "usage chunk leaked: {body}"
    );
    // ...and the gateway still counted exact tokens from it.
    assert_eq!(
        gateway_metric(&gw, "sluice_generation_tokens_total{model=\"sim-model\"}").await,
        8.0
    );

    // Client asked: the usage chunk reaches it, untouched.
    let mut asked = chat_body(true);
    asked["stream_options"] = serde_json::json!({"include_usage": true});
    let (_, _, body) = post(&url, &asked).await;
    let usage: Vec<serde_json::Value> = data_payloads(&body)
        .iter()
        .filter_map(|p| serde_json::from_str::<serde_json::Value>(p).ok())
        .filter(|v| v["choices"].as_array().is_some_and(|c| c.is_empty()))
        .collect();
    assert_eq!(usage.len(), 1, "{body}");
    assert_eq!(usage[0]["usage"]["completion_tokens"], 8);
    assert_eq!(
        gateway_metric(&gw, "sluice_generation_tokens_total{model=\"sim-model\"}").await,
        16.0
    );
}

#[tokio::test]
async fn events_arrive_as_they_are_generated_not_buffered() {
    // 5 tokens 150 ms apart: the first must reach the client long before the last.
    let mut cfg = fast_sim();
    cfg.token_delay = Duration::from_millis(150);
    cfg.output_tokens = 5;
    let sim = start_sim(cfg).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    let start = Instant::now();
    let resp = client()
        .post(format!("{}/v1/chat/completions", api(&gw)))
        .json(&chat_body(true))
        .send()
        .await
        .unwrap();
    let mut stream = resp.bytes_stream();
    let mut seen = String::new();
    let mut first_content_at = None;
    while let Some(chunk) = stream.next().await {
        seen.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        if first_content_at.is_none() && seen.contains("\"content\":\" ") {
            first_content_at = Some(start.elapsed());
        }
    }
    let total = start.elapsed();
    let first = first_content_at.expect("no content event");
    // Orders of magnitude only: total >= 4 gaps of 150 ms; first well before it.
    assert!(total >= Duration::from_millis(600), "{total:?}");
    assert!(first < total / 2, "first token at {first:?} of {total:?}");
}

#[tokio::test]
async fn client_disconnect_mid_stream_cancels_upstream() {
    let mut cfg = fast_sim();
    cfg.token_delay = Duration::from_millis(50);
    cfg.output_tokens = 200; // ten seconds if nobody cancels
    let sim = start_sim(cfg).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    let resp = client()
        .post(format!("{}/v1/chat/completions", api(&gw)))
        .json(&chat_body(true))
        .send()
        .await
        .unwrap();
    let mut stream = resp.bytes_stream();
    let _first = stream.next().await.unwrap().unwrap();
    let dropped_at = Instant::now();
    drop(stream);
    wait_until("the replica sees the abort", Duration::from_secs(3), || {
        let n = sim_finished(&sim, "abort");
        async move { n == 1 }
    })
    .await;
    assert!(dropped_at.elapsed() < Duration::from_secs(3));
    assert_eq!(sim.state.metrics.running.get(), 0);
    let gw_ref = &gw;
    wait_until(
        "disconnect recorded",
        Duration::from_secs(3),
        || async move {
            gateway_metric(
                gw_ref,
                "sluice_client_disconnects_total{model=\"sim-model\"}",
            )
            .await
                == 1.0
        },
    )
    .await;
    assert_eq!(
        gateway_metric(
            &gw,
            "sluice_requests_total{model=\"sim-model\",tier=\"\",status=\"499\",error_kind=\"client_disconnect\"}"
        )
        .await,
        1.0
    );
    assert_eq!(gw.state().pool.replicas()[0].in_flight(), 0);
}

#[tokio::test]
async fn client_disconnect_before_first_token_cancels_upstream() {
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    // The replica holds the first token for 20 s; the client gives up after 200 ms.
    let req = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", api(&gw)))
        .header("x-sim-fault", "first_token=20s")
        .timeout(Duration::from_millis(200))
        .json(&chat_body(true))
        .send();
    assert!(req.await.is_err());
    wait_until("the replica sees the abort", Duration::from_secs(5), || {
        let n = sim_finished(&sim, "abort");
        async move { n == 1 }
    })
    .await;
}

#[tokio::test]
async fn backend_dropping_mid_stream_gives_an_error_event_and_a_closed_stream() {
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let (status, _, body) = post_with(&url, &chat_body(true), &[("x-sim-fault", "drop=3")]).await;
    assert_eq!(status, 200, "headers were already sent");
    let payloads = data_payloads(&body);
    let content = payloads
        .iter()
        .filter(|p| p.contains("\"content\":\" "))
        .count();
    assert_eq!(content, 3, "{body}");
    let err: serde_json::Value = serde_json::from_str(&payloads[payloads.len() - 2]).unwrap();
    assert_eq!(err["error"]["code"], "upstream_protocol");
    assert_eq!(payloads.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(
        gateway_metric(
            &gw,
            "sluice_requests_total{model=\"sim-model\",tier=\"\",status=\"200\",error_kind=\"upstream_protocol\"}"
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn malformed_events_and_engine_errors_end_the_stream_cleanly() {
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    let url = format!("{}/v1/chat/completions", api(&gw));

    let (_, _, body) = post_with(&url, &chat_body(true), &[("x-sim-fault", "malformed=2")]).await;
    assert!(
        !body.contains("oops"),
        "malformed bytes must not reach the client"
    );
    let payloads = data_payloads(&body);
    let err: serde_json::Value = serde_json::from_str(&payloads[payloads.len() - 2]).unwrap();
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not valid JSON")
    );
    wait_until("replica aborted", Duration::from_secs(3), || {
        let n = sim_finished(&sim, "abort");
        async move { n == 1 }
    })
    .await;

    // An in-band engine error passes through as the engine wrote it.
    let (_, _, body) = post_with(&url, &chat_body(true), &[("x-sim-fault", "error_event=2")]).await;
    assert!(body.contains("simulated engine failure"), "{body}");
    assert!(body.ends_with("data: [DONE]\n\n"));
    assert_eq!(
        gateway_metric(
            &gw,
            "sluice_requests_total{model=\"sim-model\",tier=\"\",status=\"200\",error_kind=\"upstream_stream_error\"}"
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn a_stream_that_stops_short_is_reported_not_passed_off_as_complete() {
    // The replica ends the body cleanly but never finishes the generation.
    let chunks: Vec<(Duration, &'static [u8])> = vec![(
        MS,
        b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n",
    )];
    let backend = scripted::start("m", Script::sse(chunks)).await;
    let gw = start_gateway(config_for(&[backend.url()]), 1).await;
    let body = serde_json::json!({"model": "m", "stream": true, "messages": []});
    let (_, _, text) = post(&format!("{}/v1/chat/completions", api(&gw)), &body).await;
    assert!(text.contains("before it finished"), "{text}");
}

#[tokio::test]
async fn idle_and_total_timeouts_end_streams_with_an_error_event() {
    let sim = start_sim(fast_sim()).await;
    let mut config = config_for(&[sim.url()]);
    config.upstream.timeouts.idle = Duration::from_millis(300);
    config.telemetry.stall_threshold = Duration::from_millis(200);
    let gw = start_gateway(config, 1).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let start = Instant::now();
    let (_, _, body) = post_with(&url, &chat_body(true), &[("x-sim-fault", "stall=2:30s")]).await;
    assert!(start.elapsed() < Duration::from_secs(10), "no hang");
    assert!(body.contains("timeout_idle"), "{body}");
    wait_until("replica aborted", Duration::from_secs(3), || {
        let n = sim_finished(&sim, "abort");
        async move { n == 1 }
    })
    .await;
    // The silence the idle timeout cut is a stall, though no token ended it.
    assert_eq!(
        gateway_metric(&gw, "sluice_stream_stalls_total{model=\"sim-model\"}").await,
        1.0
    );

    let mut slow = fast_sim();
    slow.token_delay = Duration::from_millis(100);
    slow.output_tokens = 100;
    let sim2 = start_sim(slow).await;
    let mut config = config_for(&[sim2.url()]);
    config.upstream.timeouts.total = Duration::from_millis(500);
    config.upstream.timeouts.first_token = Duration::from_millis(400);
    let gw2 = start_gateway(config, 1).await;
    let (_, _, body) = post(
        &format!("{}/v1/chat/completions", api(&gw2)),
        &chat_body(true),
    )
    .await;
    assert!(body.contains("timeout_total"), "{body}");
}

#[tokio::test]
async fn a_stall_is_measured_as_a_stall() {
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let (status, _, body) =
        post_with(&url, &chat_body(true), &[("x-sim-fault", "stall=3:2500ms")]).await;
    assert_eq!(status, 200);
    assert!(body.ends_with("data: [DONE]\n\n"));
    assert_eq!(
        gateway_metric(&gw, "sluice_stream_stalls_total{model=\"sim-model\"}").await,
        1.0
    );
    // The largest gap lands in the >= 2.5 s bucket, not near 2 ms.
    let below = gateway_metric(
        &gw,
        "sluice_request_max_inter_token_gap_seconds_bucket{model=\"sim-model\",le=\"1.0\"}",
    )
    .await;
    let all = gateway_metric(
        &gw,
        "sluice_request_max_inter_token_gap_seconds_count{model=\"sim-model\"}",
    )
    .await;
    assert_eq!((below, all), (0.0, 1.0));
}

#[tokio::test]
async fn metrics_agree_with_what_clients_received() {
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    for i in 0..6 {
        let (status, _, _) = post(&url, &chat_body(i % 2 == 0)).await;
        assert_eq!(status, 200);
    }
    let m = |s: &'static str| {
        let gw = &gw;
        async move { gateway_metric(gw, s).await }
    };
    assert_eq!(
        m("sluice_requests_total{model=\"sim-model\",tier=\"\",status=\"200\",error_kind=\"\"}")
            .await,
        6.0
    );
    assert_eq!(
        m("sluice_generation_tokens_total{model=\"sim-model\"}").await,
        48.0
    );
    assert_eq!(
        m("sluice_e2e_request_latency_seconds_count{model=\"sim-model\"}").await,
        6.0
    );
    // TTFT and inter-token samples only for the 3 streams (8 tokens: 7 gaps each).
    assert_eq!(
        m("sluice_time_to_first_token_seconds_count{model=\"sim-model\"}").await,
        3.0
    );
    assert_eq!(
        m("sluice_inter_token_latency_seconds_count{model=\"sim-model\"}").await,
        21.0
    );
    assert_eq!(
        m("sluice_time_per_output_token_seconds_count{model=\"sim-model\"}").await,
        3.0
    );
    assert_eq!(
        m("sluice_requests_in_flight{model=\"sim-model\"}").await,
        0.0
    );
    // The replica agrees on tokens.
    assert_eq!(sim.state.metrics.generation_tokens.get(), 48);
}
