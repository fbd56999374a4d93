//! Helpers shared by the integration tests: start the simulator and the gateway
//! on loopback port 0, wait on conditions with deadlines, read SSE and metrics.

#![allow(dead_code, reason = "each test module uses some of the helpers")]

pub mod dns;
pub mod kube;
pub mod otlp;
pub mod python;
pub mod raw;
pub mod redis;
pub mod scripted;
pub mod tls;

use std::future::Future;
use std::time::{Duration, Instant};

use sluice::config::{BackendConfig, Config};
use sluice::server::{self, Gateway};
use sluice::sim::{self, SimConfig, SimHandle};
use tokio::net::TcpListener;

/// A fast simulator: 10 ms to the first token, 2 ms per token, 8 tokens.
pub fn fast_sim() -> SimConfig {
    SimConfig {
        model: "sim-model".into(),
        prefill_delay: Duration::from_millis(10),
        token_delay: Duration::from_millis(2),
        output_tokens: 8,
        ..SimConfig::default()
    }
}

pub async fn start_sim(cfg: SimConfig) -> SimHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    sim::start(listener, cfg).await.unwrap()
}

/// A config on loopback port 0 with these backends and quick health checks.
pub fn config_for(urls: &[String]) -> Config {
    let mut c = Config::default();
    c.server.listen = "127.0.0.1:0".parse().unwrap();
    c.server.admin_listen = "127.0.0.1:0".parse().unwrap();
    c.upstream.health_check.interval = Duration::from_millis(200);
    // Tests that read the access log turn it on, into a file.
    c.telemetry.access_log.enabled = false;
    // `SLUICE_TEST_HTTP1=hyper` runs the suite on hyper's server instead of
    // the gateway's own (the default).
    if std::env::var("SLUICE_TEST_HTTP1").as_deref() == Ok("hyper") {
        c.server.http1 = sluice::config::Http1Server::Hyper;
    }
    c.backends = urls
        .iter()
        .map(|u| BackendConfig::from_url(u.parse().unwrap()))
        .collect();
    c
}

/// Start the gateway and wait until `healthy` replicas pass health checks.
pub async fn start_gateway(config: Config, healthy: usize) -> Gateway {
    let gw = server::start(config).await.unwrap();
    let pool = gw.state().pool.clone();
    wait_until("replicas healthy", Duration::from_secs(10), || {
        let pool = pool.clone();
        async move { pool.replicas().iter().filter(|r| r.is_healthy()).count() >= healthy }
    })
    .await;
    gw
}

pub fn api(gw: &Gateway) -> String {
    format!("http://{}", gw.api_addr)
}

pub fn admin(gw: &Gateway) -> String {
    format!("http://{}", gw.admin_addr)
}

/// Poll `cond` until it holds; panic with `what` after `limit`.
pub async fn wait_until<F, Fut>(what: &str, limit: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    let mut poll = tokio::time::interval(Duration::from_millis(10));
    loop {
        poll.tick().await;
        if cond().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
    }
}

/// A prompt of about 1,500 tokens sent straight to `sim`'s engine (not
/// through a gateway): on a cache of 96 blocks it evicts what was there.
pub async fn evict_with_a_long_prompt(sim: &sluice::sim::SimHandle) {
    let long: String = (0..1_100).map(|w| format!("w{w} ")).collect();
    let (status, _, text) = post_with(
        &format!("{}/v1/chat/completions", sim.url()),
        &serde_json::json!({"model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": long}]}),
        &[],
    )
    .await;
    assert_eq!(status, 200, "{text}");
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

pub fn chat_body(stream: bool) -> serde_json::Value {
    chat_for("sim-model", stream)
}

/// A chat request for `model`.
pub fn chat_for(model: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "stream": stream,
        "messages": [{"role": "user", "content": "Hello there, how are you?"}],
    })
}

/// The `data:` payloads of a complete SSE body.
pub fn data_payloads(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|ev| {
            ev.lines()
                .find_map(|l| l.strip_prefix("data: ").map(str::to_string))
        })
        .collect()
}

/// POST a JSON body and read the whole response.
pub async fn post(
    url: &str,
    body: &serde_json::Value,
) -> (u16, reqwest::header::HeaderMap, String) {
    post_with(url, body, &[]).await
}

pub async fn post_with(
    url: &str,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut req = client().post(url).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await.unwrap();
    (status, headers, text)
}

pub async fn get_text(url: &str) -> (u16, String) {
    let resp = client().get(url).send().await.unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

/// The value of a series in Prometheus text: `name{labels}` names the
/// samples of `name` carrying at least those labels (others, e.g.
/// `endpoint`, are summed over); `None` when no sample matches.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    let (name, want) = split_series(series);
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((s, v)) = line.rsplit_once(' ') else {
            continue;
        };
        let (n, labels) = split_series(s);
        if n != name || !want.iter().all(|w| labels.contains(w)) {
            continue;
        }
        if let Ok(v) = v.parse::<f64>() {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// `name{a="x",b="y"}` as the name and its `a="x"` pairs.
fn split_series(s: &str) -> (&str, Vec<&str>) {
    match s.split_once('{') {
        Some((name, rest)) => {
            let body = rest.strip_suffix('}').unwrap_or(rest);
            let mut pairs = Vec::new();
            let (mut start, mut quoted, mut escaped) = (0, false, false);
            for (i, c) in body.char_indices() {
                match c {
                    _ if escaped => escaped = false,
                    '\\' => escaped = true,
                    '"' => quoted = !quoted,
                    ',' if !quoted => {
                        pairs.push(&body[start..i]);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            if start < body.len() {
                pairs.push(&body[start..]);
            }
            (name, pairs)
        }
        None => (s, Vec::new()),
    }
}

pub async fn gateway_metric(gw: &Gateway, series: &str) -> f64 {
    let (_, text) = get_text(&format!("{}/metrics", admin(gw))).await;
    metric(&text, series).unwrap_or(0.0)
}

/// `sluice_pd_decisions_total` of the test model for `reason`.
pub async fn pd_decisions(gw: &Gateway, reason: &str) -> f64 {
    gateway_metric(
        gw,
        &format!("sluice_pd_decisions_total{{model=\"sim-model\",reason=\"{reason}\"}}"),
    )
    .await
}

/// `sluice check-config` on a config file of `yaml`: whether it passed, and
/// what it said on stderr.
pub fn check_config(yaml: &str) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.yaml");
    std::fs::write(&path, yaml).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["check-config", path.to_str().unwrap()])
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The simulator's count of finished requests by reason (`abort` = cancelled).
pub fn sim_finished(sim: &SimHandle, reason: &'static str) -> u64 {
    sim.state.metrics.finished_count(reason)
}

/// The JSON error object of an OpenAI-shaped error body.
pub fn error_of(body: &str) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_str(body)
        .unwrap_or_else(|e| panic!("error body is not JSON ({e}): {body}"));
    let err = v.get("error").cloned().expect("no `error` object");
    for k in ["message", "type", "param", "code"] {
        assert!(err.get(k).is_some(), "error object lacks `{k}`: {body}");
    }
    err
}
