//! Traces through a real OTLP receiver (gRPC and HTTP), tail sampling,
//! exemplars, the access log, and metrics against what the client saw.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use sluice::config::{Config, LogTarget, OtlpProtocol};

use crate::common::otlp;
use crate::common::*;

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn traced(urls: &[String], endpoint: String, protocol: OtlpProtocol) -> Config {
    let mut c = config_for(urls);
    let t = &mut c.telemetry.tracing;
    t.enabled = Some(true);
    t.endpoint = Some(endpoint);
    t.protocol = Some(protocol);
    t.service_name = Some("sluice-test".into());
    t.sampling.ttft_threshold = Duration::from_millis(400);
    t.sampling.gap_threshold = Duration::from_millis(600);
    t.sampling.ratio = 0.0;
    t.sampling.max_per_second = 0;
    // Gaps above this are stalls (counted, and events on the trace).
    c.telemetry.stall_threshold = Duration::from_millis(500);
    c
}

async fn chat(gw: &sluice::server::Gateway, fault: Option<&str>, traceparent: Option<&str>) -> u16 {
    let mut req = client()
        .post(format!("{}/v1/chat/completions", api(gw)))
        .json(&chat_body(true));
    if let Some(f) = fault {
        req = req.header("x-sim-fault", f);
    }
    if let Some(tp) = traceparent {
        req = req.header("traceparent", tp);
    }
    let r = req.send().await.unwrap();
    let s = r.status().as_u16();
    let _ = r.bytes().await;
    s
}

async fn wait_spans(store: &otlp::Store, n: usize) {
    wait_until("spans exported", Duration::from_secs(10), || {
        let k = store.requests().len();
        async move { k >= n }
    })
    .await;
}

#[tokio::test]
async fn errors_and_slow_requests_are_always_traced_over_grpc() {
    let rx = otlp::grpc().await;
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(
        traced(
            &[sim.url()],
            format!("http://{}", rx.addr),
            OtlpProtocol::Grpc,
        ),
        1,
    )
    .await;
    for _ in 0..5 {
        assert_eq!(chat(&gw, None, None).await, 200);
    }
    assert_eq!(chat(&gw, Some("error=500"), None).await, 500);
    let tp = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    assert_eq!(chat(&gw, Some("first_token=700ms"), Some(&tp)).await, 200);
    let (_, last) = get_text(&format!("{}/sim/last_request", sim.url())).await;
    let last: serde_json::Value = serde_json::from_str(&last).unwrap();
    let upstream_tp = last["headers"]["traceparent"].as_str().unwrap().to_string();
    assert_eq!(chat(&gw, Some("stall=3:900ms"), None).await, 200);

    wait_spans(&rx.store, 3).await;
    let spans = rx.store.spans();
    let servers = rx.store.requests();
    assert_eq!(
        servers.len(),
        3,
        "exactly the error, the slow and the stalled request"
    );
    let reason = |g: &otlp::Got| g.str("sluice.sampling.reason").unwrap();
    let mut reasons: Vec<String> = servers.iter().map(reason).collect();
    reasons.sort();
    assert_eq!(reasons, ["error", "slow_ttft", "stall"]);

    for s in &servers {
        assert_eq!(s.service, "sluice-test");
        assert_eq!(s.span.name, "chat sim-model");
        assert_eq!(s.str("gen_ai.operation.name").as_deref(), Some("chat"));
        assert_eq!(s.str("gen_ai.request.model").as_deref(), Some("sim-model"));
        assert!(s.str("sluice.request_id").is_some());
        assert!(s.str("sluice.route.reason").is_some());
    }
    let err = servers.iter().find(|s| reason(s) == "error").unwrap();
    assert_eq!(err.int("http.response.status_code"), Some(500));
    assert_eq!(err.str("error.type").as_deref(), Some("upstream_status"));
    assert_eq!(
        err.span.status.as_ref().map(|s| s.code),
        Some(2),
        "status ERROR"
    );

    // The slow one continues the client's trace, under the client's span; the
    // replica was handed the gateway's upstream span as its parent.
    let slow = servers.iter().find(|s| reason(s) == "slow_ttft").unwrap();
    assert_eq!(slow.trace_id_hex(), CLIENT_TRACE);
    assert_eq!(hex::encode(&slow.span.parent_span_id), CLIENT_SPAN);
    assert!(slow.int("gen_ai.usage.output_tokens").unwrap() > 0);
    assert!(slow.int("gen_ai.usage.input_tokens").unwrap() > 0);
    assert!(
        slow.span
            .events
            .iter()
            .any(|e| e.name == "gen_ai.first_token")
    );
    let client_span = spans
        .iter()
        .find(|g| g.trace_id_hex() == CLIENT_TRACE && g.span.kind == 3)
        .expect("the upstream CLIENT span");
    assert_eq!(client_span.span.parent_span_id, slow.span.span_id);
    assert!(client_span.str("server.address").is_some());
    assert_eq!(
        upstream_tp,
        format!(
            "00-{CLIENT_TRACE}-{}-01",
            hex::encode(&client_span.span.span_id)
        )
    );

    let stall = servers.iter().find(|s| reason(s) == "stall").unwrap();
    let ev = stall
        .span
        .events
        .iter()
        .find(|e| e.name == "sluice.stall")
        .expect("a stall event");
    assert!(
        ev.attributes
            .iter()
            .any(|kv| kv.key == "sluice.gap_seconds")
    );

    // Exemplars: the slow request's TTFT bucket points at its trace.
    let resp = client()
        .get(format!("{}/metrics", admin(&gw)))
        .header("accept", "application/openmetrics-text; version=1.0.0")
        .send()
        .await
        .unwrap();
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text")
    );
    let text = resp.text().await.unwrap();
    assert!(text.ends_with("# EOF\n"));
    assert!(
        text.lines().any(
            |l| l.starts_with("sluice_time_to_first_token_seconds_bucket")
                && l.contains(&format!("# {{trace_id=\"{CLIENT_TRACE}\"}}"))
        ),
        "no exemplar for the slow request"
    );
}

#[tokio::test]
async fn traces_go_over_otlp_http_too() {
    let rx = otlp::http().await;
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(
        traced(
            &[sim.url()],
            format!("http://{}", rx.addr),
            OtlpProtocol::HttpProtobuf,
        ),
        1,
    )
    .await;
    assert_eq!(chat(&gw, Some("error=503"), None).await, 503);
    wait_spans(&rx.store, 1).await;
    assert_eq!(
        rx.store.requests()[0].int("http.response.status_code"),
        Some(503)
    );
}

#[tokio::test]
async fn fast_successes_are_kept_at_the_configured_share_under_a_cap() {
    let rx = otlp::grpc().await;
    let sim = start_sim(fast_sim()).await;
    let mut cfg = traced(
        &[sim.url()],
        format!("http://{}", rx.addr),
        OtlpProtocol::Grpc,
    );
    cfg.telemetry.tracing.sampling.ratio = 0.25;
    let gw = start_gateway(cfg, 1).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    for _ in 0..160 {
        let (s, _, _) = post(&url, &chat_body(false)).await;
        assert_eq!(s, 200);
    }
    // Binomial(160, 0.25): mean 40, sd 5.5; the range is mean +- 3.6 sd.
    // Every decision is counted when its request ends; every kept trace arrives.
    let ok = r#"sluice_requests_total{model="sim-model",tier="",status="200",error_kind=""}"#;
    wait_until("all requests recorded", Duration::from_secs(10), || async {
        gateway_metric(&gw, ok).await == 160.0
    })
    .await;
    let decided = r#"sluice_traces_sampled_total{reason="sampled",decision="kept"}"#;
    let kept = gateway_metric(&gw, decided).await as usize;
    assert!((20..=60).contains(&kept), "kept {kept} of 160 at 25%");
    wait_spans(&rx.store, kept).await;
    assert_eq!(rx.store.requests().len(), kept);
    let exported = r#"sluice_trace_spans_total{outcome="exported"}"#;
    wait_until("exports counted", Duration::from_secs(10), || async {
        gateway_metric(&gw, exported).await == rx.store.spans().len() as f64
    })
    .await;

    // The per-second cap holds even for errors, and what it cuts is counted.
    let rx2 = otlp::grpc().await;
    let mut cfg = traced(
        &[sim.url()],
        format!("http://{}", rx2.addr),
        OtlpProtocol::Grpc,
    );
    cfg.telemetry.tracing.sampling.max_per_second = 3;
    let gw2 = start_gateway(cfg, 1).await;
    let started = Instant::now();
    for _ in 0..40 {
        assert_eq!(chat(&gw2, Some("error=500"), None).await, 500);
    }
    let allowed = 3 + 3 * started.elapsed().as_secs() as usize + 1;
    let kept = r#"sluice_traces_sampled_total{reason="error",decision="kept"}"#;
    let capped = r#"sluice_traces_sampled_total{reason="error",decision="capped"}"#;
    wait_until("all decisions counted", Duration::from_secs(10), || async {
        gateway_metric(&gw2, kept).await + gateway_metric(&gw2, capped).await == 40.0
    })
    .await;
    let kept = gateway_metric(&gw2, kept).await as usize;
    assert!(
        (3..=allowed).contains(&kept),
        "cap: kept {kept}, allowed {allowed}"
    );
    wait_spans(&rx2.store, kept).await;
    assert_eq!(rx2.store.requests().len(), kept);
}

#[tokio::test]
async fn one_access_log_line_per_request_without_keys() {
    let sim = start_sim(fast_sim()).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("access.log");
    let mut cfg = config_for(&[sim.url()]);
    cfg.telemetry.access_log.enabled = true;
    cfg.telemetry.access_log.target = LogTarget::File;
    cfg.telemetry.access_log.path = Some(path.clone());
    let gw = start_gateway(cfg, 1).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let (s, h, _) = post_with(
        &url,
        &chat_body(true),
        &[("authorization", "Bearer sk-secret-never-logged")],
    )
    .await;
    assert_eq!(s, 200);
    let rid = h["x-request-id"].to_str().unwrap().to_string();
    let mut bad = chat_body(false);
    bad["model"] = "nope".into();
    assert_eq!(post(&url, &bad).await.0, 404);
    let (s, _, _) = post_with(&url, &chat_body(false), &[("x-sim-fault", "error=500")]).await;
    assert_eq!(s, 500);

    let path_ref = &path;
    wait_until("three lines", Duration::from_secs(5), || async move {
        std::fs::read_to_string(path_ref)
            .unwrap_or_default()
            .lines()
            .count()
            >= 3
    })
    .await;
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(!text.contains("sk-secret"), "a key was logged");
    assert!(
        !text.contains("Hello there"),
        "a prompt was logged without include_prompts"
    );
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ok = lines
        .iter()
        .find(|l| l["request_id"] == rid.as_str())
        .unwrap();
    assert_eq!(ok["status"], 200);
    assert_eq!(ok["model"], "sim-model");
    assert_eq!(ok["stream"], true);
    assert_eq!(ok["finish_reason"], "stop");
    assert_eq!(ok["completion_tokens"], 8);
    assert_eq!(ok["backend"], sim.addr.to_string());
    assert!(ok["route_reason"].is_string());
    assert!(ok["ttft_ms"].as_f64().unwrap() > 0.0);
    assert!(ok["e2e_ms"].as_f64().unwrap() >= ok["ttft_ms"].as_f64().unwrap());
    assert_eq!(ok["trace_id"].as_str().unwrap().len(), 32);
    assert!(
        lines
            .iter()
            .any(|l| l["status"] == 404 && l["error_kind"] == "model_not_found")
    );
    assert!(
        lines
            .iter()
            .any(|l| l["status"] == 500 && l["error_kind"] == "upstream_status")
    );
}

#[tokio::test]
async fn gateway_ttft_agrees_with_what_the_client_saw() {
    let mut slow_prefill = fast_sim();
    slow_prefill.prefill_delay = Duration::from_millis(150);
    let sim = start_sim(slow_prefill).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    let mut client_ttft = Duration::ZERO;
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    let n = 6;
    let mut body = chat_body(true);
    body["stream_options"] = serde_json::json!({"include_usage": true});
    for _ in 0..n {
        let start = Instant::now();
        let resp = client()
            .post(format!("{}/v1/chat/completions", api(&gw)))
            .json(&body)
            .send()
            .await
            .unwrap();
        let mut s = resp.bytes_stream();
        let mut seen = String::new();
        let mut first = None;
        while let Some(c) = s.next().await {
            seen.push_str(&String::from_utf8_lossy(&c.unwrap()));
            if first.is_none() && seen.contains("\"content\":\" ") {
                first = Some(start.elapsed());
            }
        }
        client_ttft += first.unwrap();
        let usage = data_payloads(&seen)
            .iter()
            .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
            .find(|v| v["usage"].is_object())
            .expect("a usage chunk")["usage"]
            .clone();
        prompt_tokens += usage["prompt_tokens"].as_u64().unwrap();
        completion_tokens += usage["completion_tokens"].as_u64().unwrap();
    }
    // Counts agree exactly with what the client was told.
    let ok = r#"sluice_requests_total{model="sim-model",tier="",status="200",error_kind=""}"#;
    wait_until(
        "every request recorded",
        Duration::from_secs(10),
        || async { gateway_metric(&gw, ok).await == n as f64 },
    )
    .await;
    let m = |name: &str| format!("{name}{{model=\"sim-model\"}}");
    assert!(completion_tokens > 0);
    assert_eq!(
        gateway_metric(&gw, &m("sluice_generation_tokens_total")).await,
        completion_tokens as f64
    );
    assert_eq!(
        gateway_metric(&gw, &m("sluice_prompt_tokens_total")).await,
        prompt_tokens as f64
    );
    let client_mean = client_ttft.as_secs_f64() / n as f64;
    let sum = gateway_metric(
        &gw,
        "sluice_time_to_first_token_seconds_sum{model=\"sim-model\"}",
    )
    .await;
    let count = gateway_metric(
        &gw,
        "sluice_time_to_first_token_seconds_count{model=\"sim-model\"}",
    )
    .await;
    assert_eq!(count, n as f64);
    let gw_mean = sum / count;
    assert!(
        (client_mean - gw_mean).abs() < 0.25 * client_mean,
        "client {client_mean:.4}s vs gateway {gw_mean:.4}s"
    );
}
