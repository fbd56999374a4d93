//! Anthropic Messages and OpenAI Responses through the gateway, over real
//! sockets with `sluice sim` replicas: the official SDKs as clients, usage and
//! timing counted request by request, errors in each protocol's shape, keys
//! sent as `x-api-key`, token limits held, and Responses follow-ups reaching
//! the replica that keeps their previous response.

use std::time::Duration;

use sluice::config::{ApiKey, Config, Secret, TierConfig};

use crate::common::*;
use crate::routing::{routing_config, sims, start_routed, urls};

pub(crate) const KEY: &str = "sk-test-agent";

pub(crate) fn keyed(mut c: Config, tier: TierConfig) -> Config {
    use sha2::Digest;
    c.auth.keys = vec![ApiKey {
        name: "agent".into(),
        tier: "t".into(),
        sha256: Secret::new(hex::encode(sha2::Sha256::digest(KEY.as_bytes()))),
    }];
    c.tiers.insert("t".into(), tier);
    c
}

/// What the replica last received (headers and body).
async fn last_request(sim: &sluice::sim::SimHandle) -> serde_json::Value {
    let (_, text) = get_text(&format!("{}/sim/last_request", sim.url())).await;
    serde_json::from_str(&text).unwrap()
}

/// Run `tests/python/sdk_protocols.py MODE` against the gateway.
pub(crate) async fn sdk(mode: &str, gw: &sluice::server::Gateway) -> serde_json::Value {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/sdk_protocols.py");
    let out = tokio::process::Command::new(python::python())
        .args([script, mode, &api(gw), &admin(gw), KEY])
        .output()
        .await
        .expect(python::MISSING);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "SDK script ({mode}) failed:\n{stderr}"
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Each request's usage as the SDK saw it equals what the gateway counted
/// for it; a stream's inter-token gaps are one fewer than its deltas.
fn assert_counted_exactly(v: &serde_json::Value) {
    assert_counted(v, true);
}

/// As [`assert_counted_exactly`]; `cached`: the cached tokens too (not
/// behind a disaggregated fleet, where the gateway reports the prefill
/// replica's and the client sees the decode replica's).
pub(crate) fn assert_counted(v: &serde_json::Value, cached: bool) {
    let requests = v["requests"].as_array().unwrap();
    assert!(requests.len() >= 4, "{v}");
    let n = |v: &serde_json::Value| v.as_f64().unwrap();
    for r in requests {
        let g = &r["gateway"];
        assert_eq!(
            n(&g["sluice_prompt_tokens_total"]),
            n(&r["sdk_prompt"]),
            "{r}"
        );
        if cached {
            assert_eq!(
                n(&g["sluice_prompt_tokens_cached_total"]),
                n(&r["sdk_cached"]),
                "{r}"
            );
        }
        assert_eq!(
            n(&g["sluice_generation_tokens_total"]),
            n(&r["sdk_output"]),
            "{r}"
        );
        assert!(n(&r["sdk_prompt"]) > 100.0, "{r}");
        if r["stream"] == true {
            let deltas = n(&r["deltas"]);
            assert!(deltas >= 2.0, "{r}");
            assert_eq!(n(&r["sdk_output"]), deltas, "{r}");
            let gaps = n(&g["sluice_inter_token_latency_seconds_count"]);
            assert_eq!(gaps, deltas - 1.0, "{r}");
            assert_eq!(
                n(&g["sluice_time_to_first_token_seconds_count"]),
                1.0,
                "{r}"
            );
        }
    }
}

#[tokio::test]
async fn the_anthropic_sdk_speaks_messages_through_the_gateway() {
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(keyed(config_for(&[sim.url()]), TierConfig::default()), 1).await;
    let v = sdk("messages", &gw).await;
    assert_counted_exactly(&v);
    assert!(v["count_tokens"].as_u64().unwrap() > 100, "{v}");
    // The key went as x-api-key, and was not passed on to the replica.
    let last = last_request(&sim).await;
    assert!(last["headers"].get("x-api-key").is_none(), "{last}");
    // A stream the replica cut ends with Anthropic's error event: the SDK raises.
    assert_eq!(v["cut_stream"], "APIStatusError", "{v}");
    assert_eq!(v["cut_stream_body"]["type"], "error", "{v}");
    assert_eq!(v["cut_stream_body"]["error"]["type"], "api_error", "{v}");
    assert_eq!(v["unknown_model"]["type"], "error", "{v}");
    assert_eq!(
        v["unknown_model"]["error"]["type"], "not_found_error",
        "{v}"
    );
    // Metrics carry the endpoint.
    let ok = gateway_metric(
        &gw,
        "sluice_requests_total{model=\"sim-model\",endpoint=\"messages\",status=\"200\",error_kind=\"\"}",
    )
    .await;
    assert_eq!(ok, 6.0);
    assert_eq!(
        gateway_metric(
            &gw,
            "sluice_requests_total{model=\"sim-model\",endpoint=\"count_tokens\",status=\"200\"}"
        )
        .await,
        1.0
    );
}

#[tokio::test]
async fn the_openai_sdk_speaks_responses_through_the_gateway() {
    let sims = sims(3).await;
    let gw = start_routed(
        keyed(routing_config(&urls(&sims)), TierConfig::default()),
        3,
    )
    .await;
    let v = sdk("responses", &gw).await;
    assert_counted_exactly(&v);
    // Every follow-up found its previous response (a replica that does not
    // keep it answers 404): they went where it was made.
    let requests = v["requests"].as_array().unwrap();
    for r in &requests[1..] {
        assert_eq!(r["status"], "completed", "{r}");
    }
    assert_eq!(
        gateway_metric(
            &gw,
            "sluice_routing_decisions_total{model=\"sim-model\",reason=\"response_home\"}"
        )
        .await,
        3.0
    );
    assert_eq!(v["retrieved"], requests[3]["id"], "{v}");
    let events = v["cut_stream_events"].as_array().unwrap();
    assert_eq!(events.last().unwrap(), "error", "{v}");
    assert!(events.iter().all(|e| e != "response.completed"), "{v}");
}

#[tokio::test]
async fn the_anthropic_sdk_backs_off_on_429() {
    let sim = start_sim(fast_sim()).await;
    let tier = TierConfig {
        requests_per_minute: Some(20),
        ..Default::default()
    };
    let gw = start_gateway(keyed(config_for(&[sim.url()]), tier), 1).await;
    let v = sdk("messages_429", &gw).await;
    assert_eq!(v["error_class"], "RateLimitError", "{v}");
    assert_eq!(v["body"]["type"], "error", "{v}");
    assert_eq!(v["body"]["error"]["type"], "rate_limit_error", "{v}");
    assert!(v["retry_after"].as_str().unwrap().parse::<u64>().unwrap() >= 1);
    assert_eq!(
        v["ratelimit_headers"],
        serde_json::json!([
            "anthropic-ratelimit-requests-limit",
            "anthropic-ratelimit-requests-remaining",
            "anthropic-ratelimit-requests-reset"
        ])
    );
    assert_eq!(v["retried_ok"], true, "{v}");
    assert!(v["since_refusal_seconds"].as_f64().unwrap() > 1.0, "{v}");
}

/// A Messages request of about `chars` characters of prompt.
fn message(chars: usize, max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": "sim-model", "max_tokens": max_tokens, "stream": stream,
        "system": "s".repeat(chars / 2),
        "messages": [{"role": "user", "content": [{"type": "text", "text": "u".repeat(chars / 2)}]}],
    })
}

#[tokio::test]
async fn token_limits_hold_on_messages_and_responses() {
    let sim = start_sim(fast_sim()).await;
    // 2,000 tokens a minute; each request is ~500 prompt tokens plus its output.
    let tier = TierConfig {
        tokens_per_minute: Some(2000),
        max_tokens: Some(8),
        ..Default::default()
    };
    for (path, body) in [
        ("/v1/messages", message(2000, 8, true)),
        (
            "/v1/responses",
            serde_json::json!({"model": "sim-model", "stream": true,
                "instructions": "s".repeat(1000), "input": [{"role": "user", "content": [{"type": "input_text", "text": "u".repeat(1000)}]}]}),
        ),
    ] {
        // A gateway each: a fresh budget.
        let gw = start_gateway(keyed(config_for(&[sim.url()]), tier.clone()), 1).await;
        let url = api(&gw);
        let mut admitted = 0;
        let mut refused = None;
        for _ in 0..10 {
            let (status, headers, text) =
                post_with(&format!("{url}{path}"), &body, &[("x-api-key", KEY)]).await;
            match status {
                200 => admitted += 1,
                429 => {
                    refused = Some((headers, text));
                    break;
                }
                s => panic!("{path}: {s} {text}"),
            }
        }
        // About 2000 / (500 + 8) requests fit: the budget holds.
        assert!((3..=4).contains(&admitted), "{path}: {admitted} admitted");
        let (headers, text) = refused.unwrap_or_else(|| panic!("{path}: never refused"));
        assert!(headers.contains_key("retry-after"));
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        if path == "/v1/messages" {
            assert_eq!(v["error"]["type"], "rate_limit_error", "{text}");
            assert!(headers.contains_key("anthropic-ratelimit-tokens-remaining"));
            assert!(!headers.contains_key("x-ratelimit-remaining-tokens"));
        } else {
            assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{text}");
            assert!(headers.contains_key("x-ratelimit-remaining-tokens"));
        }
        // The Responses request set no output limit: the tier's cap was sent.
        if path == "/v1/responses" {
            let last = last_request(&sim).await;
            assert_eq!(last["body"]["max_output_tokens"], 8, "{last}");
        }
    }
}

#[tokio::test]
async fn messages_errors_are_in_anthropic_shape_before_and_during_the_stream() {
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    let url = format!("{}/v1/messages", api(&gw));
    // Before the first byte: the gateway's own refusal and the replica's.
    let (status, _, text) = post(&url, &serde_json::json!({"max_tokens": 5, "messages": []})).await;
    assert_eq!(status, 400, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let (status, _, text) = post_with(
        &url,
        &message(100, 5, true),
        &[("x-sim-fault", "error=503")],
    )
    .await;
    assert_eq!(status, 503, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["type"], "overloaded_error", "{text}");
    // During it: a stall past the idle timeout ends it with an error event.
    let mut c = config_for(&[sim.url()]);
    c.upstream.timeouts.idle = Duration::from_millis(300);
    let gw2 = start_gateway(c, 1).await;
    let (status, _, text) = post_with(
        &format!("{}/v1/messages", api(&gw2)),
        &message(100, 8, true),
        &[("x-sim-fault", "stall=2:10s")],
    )
    .await;
    assert_eq!(status, 200);
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    assert!(last.starts_with("event: error\ndata: {"), "{text}");
    assert!(last.contains("\"timeout_error\""), "{text}");
    assert!(
        !text.contains("[DONE]") && !text.contains("message_stop"),
        "{text}"
    );
}

#[tokio::test]
async fn responses_ids_are_found_across_gateways_and_forgotten_on_delete() {
    let sims = sims(3).await;
    let a = start_routed(routing_config(&urls(&sims)), 3).await;
    let b = start_routed(routing_config(&urls(&sims)), 3).await;
    let body = serde_json::json!({"model": "sim-model", "input": "hello", "max_output_tokens": 4});
    let (status, _, text) = post(&format!("{}/v1/responses", api(&a)), &body).await;
    assert_eq!(status, 200, "{text}");
    let id = serde_json::from_str::<serde_json::Value>(&text).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    // Gateway b never saw it: a follow-up asks the replicas, finds the one
    // that keeps it (the others would answer 404) and goes there.
    let follow =
        serde_json::json!({"model": "sim-model", "input": "more", "previous_response_id": id});
    for _ in 0..3 {
        let (status, _, text) = post(&format!("{}/v1/responses", api(&b)), &follow).await;
        assert_eq!(status, 200, "{text}");
    }
    // So does a by-id request through a third gateway.
    let c = start_routed(routing_config(&urls(&sims)), 3).await;
    let (status, text) = get_text(&format!("{}/v1/responses/{id}", api(&c))).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains(&id));
    // Unknown ids: the engine's own 404, in OpenAI's shape.
    let (status, text) = get_text(&format!("{}/v1/responses/resp_nope", api(&a))).await;
    assert_eq!(status, 404, "{text}");
    error_of(&text);
    // Deleted: a follow-up is refused by the engine, cleanly.
    let resp = client()
        .delete(format!("{}/v1/responses/{id}", api(&a)))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let (status, _, text) = post(&format!("{}/v1/responses", api(&a)), &follow).await;
    assert_eq!(status, 404, "{text}");
    assert_eq!(error_of(&text)["param"], "previous_response_id", "{text}");
}
