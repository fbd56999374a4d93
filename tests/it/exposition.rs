//! Both `/metrics` formats, checked by Prometheus' own code: the text format
//! passes `promtool check metrics`; the OpenMetrics format (with exemplars)
//! is scraped by a real Prometheus server, which must find the target up,
//! parse every sample and keep the exemplars.

use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::*;

/// A gateway with some traffic (streamed, not, an error, every trace kept so
/// that latency buckets carry exemplars).
async fn busy_gateway() -> (sluice::sim::SimHandle, sluice::server::Gateway) {
    let sim = start_sim(fast_sim()).await;
    let mut config = config_for(&[sim.url()]);
    config.telemetry.tracing.endpoint = Some("http://127.0.0.1:9".into());
    config.telemetry.tracing.sampling.ratio = 1.0;
    let gw = start_gateway(config, 1).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    for stream in [true, false, true] {
        let (s, _, _) = post(&url, &chat_body(stream)).await;
        assert_eq!(s, 200);
    }
    let (s, _, _) = post(&url, &chat_for("nope", false)).await;
    assert_eq!(s, 404);
    (sim, gw)
}

#[tokio::test]
async fn the_text_format_passes_promtool() {
    let (_sim, gw) = busy_gateway().await;
    let (s, text) = get_text(&format!("{}/metrics", admin(&gw))).await;
    assert_eq!(s, 200);
    assert!(text.contains("sluice_time_to_first_token_seconds_bucket"));
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package prometheus; scripts/test.sh installs it)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool check metrics:\n{said}");
}

#[tokio::test]
async fn a_real_prometheus_scrapes_the_openmetrics_format_with_exemplars() {
    let (_sim, gw) = busy_gateway().await;
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: sluice\n    static_configs:\n      - targets: ['{}']\n",
            gw.admin_addr
        ),
    )
    .unwrap();
    let mut prom = tokio::process::Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .arg("--enable-feature=exemplar-storage")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("prometheus (Debian package prometheus; scripts/test.sh installs it)");
    let api = format!("http://127.0.0.1:{port}/api/v1");
    // The target scraped at least once, healthy, with no parse error.
    let targets = format!("{api}/targets");
    wait_until(
        "prometheus scraped the gateway",
        Duration::from_secs(30),
        || {
            let targets = targets.clone();
            async move {
                let Ok(r) = client().get(&targets).send().await else {
                    return false;
                };
                let v: serde_json::Value = r.json().await.unwrap_or_default();
                let t = &v["data"]["activeTargets"][0];
                if t["lastError"].as_str().is_some_and(|e| !e.is_empty()) {
                    panic!("prometheus could not parse the scrape: {}", t["lastError"]);
                }
                t["health"] == "up"
            }
        },
    )
    .await;
    // It asked for OpenMetrics (what its Accept header prefers) and read the samples.
    // "up" can be reported a moment before the scrape's samples are queryable, so
    // the query is polled; it never reaches 4 if the exposition was misread.
    let q = format!("{api}/query?query=sum(sluice_requests_total)");
    wait_until(
        "prometheus read the 4 requests",
        Duration::from_secs(30),
        || {
            let q = q.clone();
            async move {
                let Ok(r) = client().get(&q).send().await else {
                    return false;
                };
                let v: serde_json::Value = r.json().await.unwrap_or_default();
                let n = v["data"]["result"][0]["value"][1]
                    .as_str()
                    .and_then(|s| s.parse::<f64>().ok());
                assert!(n <= Some(4.0), "more requests than were sent: {v}");
                n == Some(4.0)
            }
        },
    )
    .await;
    // And kept the exemplars (trace ids on the latency buckets).
    let q = format!(
        "{api}/query_exemplars?query=sluice_time_to_first_token_seconds_bucket&start=0&end=9999999999"
    );
    let v: serde_json::Value = client().get(&q).send().await.unwrap().json().await.unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["exemplars"].as_array().unwrap())
        .filter_map(|e| e["labels"]["trace_id"].as_str())
        .collect();
    assert!(!ids.is_empty(), "no exemplars: {v}");
    assert!(ids.iter().all(|id| id.len() == 32));
    let _ = prom.kill().await;
}
