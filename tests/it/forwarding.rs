//! What crosses the gateway: headers, endpoints, model lists, retries, drain.

use std::time::Duration;

use crate::common::scripted::{self, Script};
use crate::common::*;
use sluice::config::{PolicyKind, Secret};

async fn last_request(sim: &sluice::sim::SimHandle) -> serde_json::Value {
    let (_, text) = get_text(&format!("{}/sim/last_request", sim.url())).await;
    serde_json::from_str(&text).unwrap()
}

#[tokio::test]
async fn headers_request_id_and_credentials() {
    let sim = start_sim(fast_sim()).await;
    let mut config = config_for(&[sim.url()]);
    config.backends[0].api_key = Some(Secret::new("replica-key"));
    let gw = start_gateway(config, 1).await;
    let url = format!("{}/v1/chat/completions", api(&gw));

    let (s, h, _) = post_with(
        &url,
        &chat_body(false),
        &[
            ("authorization", "Bearer client-key"),
            ("x-request-id", "req-42"),
            ("connection", "keep-alive, x-hop"),
            ("x-hop", "1"),
            (
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
        ],
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(h["x-request-id"], "req-42");
    let seen = &last_request(&sim).await["headers"];
    assert_eq!(
        seen["authorization"], "Bearer replica-key",
        "client key must not cross"
    );
    assert_eq!(seen["x-request-id"], "req-42");
    assert!(seen.get("x-hop").is_none(), "hop-by-hop header crossed");
    // W3C trace context: same trace, the gateway's span as the replica's parent.
    let tp = seen["traceparent"].as_str().unwrap();
    assert!(
        tp.starts_with("00-0af7651916cd43dd8448eb211c80319c-"),
        "{tp}"
    );
    assert!(
        !tp.contains("b7ad6b7169203331") && tp.ends_with("-01"),
        "{tp}"
    );

    // Without one, an id is generated, returned, and sent upstream.
    let (_, h, _) = post(&url, &chat_body(true)).await;
    let id = h["x-request-id"].to_str().unwrap().to_string();
    assert_eq!(id.len(), 32);
    assert_eq!(
        last_request(&sim).await["headers"]["x-request-id"],
        id.as_str()
    );

    // The admin view never shows the key.
    let (_, cfg) = get_text(&format!("{}/admin/config", admin(&gw))).await;
    assert!(
        !cfg.contains("replica-key") && cfg.contains("[redacted]"),
        "{cfg}"
    );
}

#[tokio::test]
async fn models_are_the_union_of_healthy_replicas_plus_aliases() {
    let a = start_sim(fast_sim()).await;
    let mut other = fast_sim();
    other.model = "other-model".into();
    let b = start_sim(other).await;
    let mut config = config_for(&[a.url(), b.url()]);
    config
        .models
        .aliases
        .insert("gpt-4o".into(), "other-model".into());
    let gw = start_gateway(config, 2).await;
    let (s, text) = get_text(&format!("{}/v1/models", api(&gw))).await;
    assert_eq!(s, 200);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["object"], "list");
    let mut ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, ["gpt-4o", "other-model", "sim-model"]);

    // Each model goes to its replica; the alias is rewritten to its target.
    let chat = format!("{}/v1/chat/completions", api(&gw));
    for (model, status) in [("gpt-4o", 200), ("other-model", 200), ("sim-model", 200)] {
        let body = serde_json::json!({"model": model, "messages": [], "stream": true});
        let (s, _, text) = post(&chat, &body).await;
        assert_eq!(s, status, "{model}: {text}");
    }
    assert_eq!(a.state.metrics.received.get(), 1);
    assert_eq!(b.state.metrics.received.get(), 2);
    assert_eq!(last_request(&b).await["body"]["model"], "other-model");
    assert_eq!(
        gateway_metric(
            &gw,
            "sluice_requests_total{model=\"other-model\",tier=\"\",status=\"200\",error_kind=\"\"}"
        )
        .await,
        2.0,
        "aliases are counted under the served model"
    );

    // A replica that goes away leaves the list.
    b.stop();
    drop(b);
    let api_url = format!("{}/v1/models", api(&gw));
    wait_until("other-model gone", Duration::from_secs(5), || {
        let u = api_url.clone();
        async move { !get_text(&u).await.1.contains("other-model") }
    })
    .await;
}

#[tokio::test]
async fn completions_embeddings_and_passthrough() {
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    let base = api(&gw);

    let body = serde_json::json!({"model": "sim-model", "prompt": "Once upon", "stream": true, "max_tokens": 3});
    let (s, _, text) = post(&format!("{base}/v1/completions"), &body).await;
    assert_eq!(s, 200);
    let texts = data_payloads(&text)
        .iter()
        .filter(|p| p.contains("\"text\""))
        .count();
    assert_eq!(texts, 3, "{text}");
    assert_eq!(
        gateway_metric(
            &gw,
            "sluice_request_finish_reasons_total{model=\"sim-model\",finish_reason=\"length\"}"
        )
        .await,
        1.0
    );

    let body = serde_json::json!({"model": "sim-model", "input": ["a", "bb"]});
    let (s, _, text) = post(&format!("{base}/v1/embeddings"), &body).await;
    assert_eq!(s, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert_eq!(
        gateway_metric(&gw, "sluice_prompt_tokens_total{model=\"sim-model\"}").await,
        v["usage"]["prompt_tokens"].as_f64().unwrap() + 3.0 // + the completion's prompt
    );

    // Other /v1/* routes naming a model go through untouched (here the sim
    // answers 404 for a route it lacks: the status passes through).
    let body = serde_json::json!({"model": "sim-model", "query": "q", "documents": ["d"]});
    let (s, _, text) = post(&format!("{base}/v1/rerank"), &body).await;
    assert_eq!(s, 404, "{text}");
    assert_eq!(
        sim.state.metrics.received.get(),
        2,
        "rerank is not counted by the sim"
    );
}

#[tokio::test]
async fn retries_only_before_the_first_byte_and_on_another_replica() {
    // One replica refuses with 503: every request still succeeds via the other.
    let good = start_sim(fast_sim()).await;
    let mut busy = fast_sim();
    busy.faults = sluice::sim::faults::Faults::parse("error=503").unwrap();
    let bad = start_sim(busy).await;
    let mut config = config_for(&[good.url(), bad.url()]);
    config.routing.policy = PolicyKind::RoundRobin;
    let gw = start_gateway(config, 2).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    for _ in 0..4 {
        let (s, _, b) = post(&url, &chat_body(true)).await;
        assert_eq!(s, 200, "{b}");
    }
    assert_eq!(good.state.metrics.received.get(), 4);
    let refused = bad.state.metrics.received.get();
    assert!(refused >= 1, "round robin must have tried the busy replica");
    assert_eq!(
        gateway_metric(
            &gw,
            "sluice_upstream_retries_total{model=\"sim-model\",reason=\"upstream_status\"}"
        )
        .await,
        refused as f64,
        "every refusal was retried once"
    );

    // A mid-stream failure is never retried: the client gets the error event.
    let (_, _, b) = post_with(&url, &chat_body(true), &[("x-sim-fault", "drop=2")]).await;
    assert!(b.contains("upstream_protocol"), "{b}");
}

#[tokio::test]
async fn connect_failures_retry_on_another_replica() {
    let sim = start_sim(fast_sim()).await;
    let doomed = scripted::start("sim-model", Script::sse(vec![])).await;
    let mut config = config_for(&[doomed.url(), sim.url()]);
    config.routing.policy = PolicyKind::RoundRobin;
    config.upstream.health_check.interval = Duration::from_secs(3600);
    let gw = start_gateway(config, 2).await;
    doomed.kill();
    let url = format!("{}/v1/chat/completions", api(&gw));
    for _ in 0..2 {
        let (s, _, b) = post(&url, &chat_body(false)).await;
        assert_eq!(s, 200, "{b}");
    }
    assert_eq!(sim.state.metrics.received.get(), 2);
    let retries = gateway_metric(
        &gw,
        "sluice_upstream_retries_total{model=\"sim-model\",reason=\"upstream_connect\"}",
    )
    .await;
    assert!(
        retries >= 1.0,
        "round robin must have tried the dead replica"
    );
    let refused = format!(
        "sluice_upstream_errors_total{{backend=\"{}\",kind=\"upstream_connect\"}}",
        doomed.addr
    );
    assert_eq!(gateway_metric(&gw, &refused).await, retries);
}

#[tokio::test]
async fn shutdown_drains_open_streams() {
    let mut cfg = fast_sim();
    cfg.token_delay = Duration::from_millis(40);
    cfg.output_tokens = 20;
    let sim = start_sim(cfg).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let stream = tokio::spawn(async move { post(&url, &chat_body(true)).await });
    wait_until("stream started", Duration::from_secs(3), || {
        let n = sim.state.metrics.running.get();
        async move { n == 1 }
    })
    .await;
    gw.shutdown(Duration::from_secs(10)).await;
    let (s, _, body) = stream.await.unwrap();
    assert_eq!(s, 200);
    assert!(
        body.ends_with("data: [DONE]\n\n"),
        "stream cut by shutdown: {body}"
    );
    assert_eq!(sim_finished(&sim, "stop"), 1);
}

#[tokio::test]
async fn upstream_connections_are_kept_alive_and_reused() {
    let sim = start_sim(fast_sim()).await;
    let mut config = config_for(&[sim.url()]);
    config.upstream.health_check.interval = Duration::from_secs(3600);
    let gw = start_gateway(config, 1).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let before = sim.state.metrics.connections.get();
    for i in 0..12 {
        let (s, _, _) = match i % 3 {
            0 => post(&url, &chat_body(true)).await,
            1 => post(&url, &chat_body(false)).await,
            _ => post_with(&url, &chat_body(true), &[("x-sim-fault", "error=429")]).await,
        };
        assert!(s == 200 || s == 429);
    }
    let opened = sim.state.metrics.connections.get() - before;
    assert_eq!(
        opened, 1,
        "sequential requests must share one keep-alive connection"
    );

    // A stream the client abandons closes its connection (that is the cancel);
    // the next request opens a fresh one.
    let resp = client()
        .post(&url)
        .json(&chat_body(true))
        .header("x-sim-fault", "first_token=10s")
        .timeout(Duration::from_millis(100))
        .send()
        .await;
    assert!(resp.is_err());
    wait_until("abort seen", Duration::from_secs(3), || {
        let n = sim_finished(&sim, "abort");
        async move { n == 1 }
    })
    .await;
    let (s, _, _) = post(&url, &chat_body(true)).await;
    assert_eq!(s, 200);
    assert_eq!(sim.state.metrics.connections.get() - before, 2);
}

/// The generation routes are served without the router (`app::Api`); each
/// path must still reach its own endpoint, with a request id, and every other
/// path must still go through the router (a trailing slash is another route).
#[tokio::test]
async fn dispatch_agrees_with_the_router() {
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    let cases = [
        ("/v1/chat/completions", "chat", "error"),
        ("/v1/chat/completions?trace=1", "chat", "error"),
        ("/v1/completions", "completions", "error"),
        ("/v1/embeddings", "embeddings", "error"),
        ("/v1/messages", "messages", "type"),
        ("/v1/messages/count_tokens", "count_tokens", "type"),
        ("/v1/responses", "responses", "error"),
        ("/v1/chat/completions/", "passthrough", "error"),
    ];
    for (path, endpoint, shape) in cases {
        let series = format!("sluice_requests_total{{endpoint=\"{endpoint}\",status=\"400\"}}");
        let before = gateway_metric(&gw, &series).await;
        // Not JSON: every endpoint refuses it in its own protocol's shape.
        let resp = client()
            .post(format!("{}{path}", api(&gw)))
            .header("content-type", "application/json")
            .body("{not json")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 400, "{path}");
        assert_eq!(
            resp.headers()["x-request-id"].len(),
            32,
            "{path}: no generated request id"
        );
        let body: serde_json::Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
        assert!(body.get(shape).is_some(), "{path}: {body}");
        assert_eq!(
            gateway_metric(&gw, &series).await,
            before + 1.0,
            "{path} was not served as `{endpoint}`"
        );
    }
    // A GET of a generation route is still the router's 405.
    let (s, _) = get_text(&format!("{}/v1/chat/completions", api(&gw))).await;
    assert_eq!(s, 405);
}
