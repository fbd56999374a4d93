//! The dashboard shows data: a real Prometheus server scrapes `sluice demo`
//! (the real binary) for a minute, then every panel's every query returns
//! at least one series (a healthy zero, not "No data"), and every alert rule
//! has been evaluated without error.

use std::process::Stdio;
use std::time::Duration;

use crate::common::*;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// GET a Prometheus API path; the JSON answer.
async fn prom(api: &str, path: &str, query: &[(&str, &str)]) -> serde_json::Value {
    let url = reqwest::Url::parse_with_params(&format!("{api}{path}"), query).unwrap();
    let r = client().get(url).send().await.unwrap();
    r.json().await.unwrap()
}

/// A panel's query as Grafana would send it with every variable on "All".
fn as_sent(expr: &str) -> String {
    let mut e = expr.replace("$__rate_interval", "20s");
    for var in ["model", "endpoint", "backend", "tier"] {
        e = e.replace(&format!("${var}"), ".*");
    }
    assert!(
        !e.contains('$'),
        "a variable the test does not know: {expr}"
    );
    e
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_panel_shows_data_and_every_rule_evaluates_against_a_real_prometheus() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let (api_port, admin_port, prom_port) = (free_port(), free_port(), free_port());
    let _demo = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["demo", "--duration", "240s"])
        .arg(format!("--listen=127.0.0.1:{api_port}"))
        .arg(format!("--admin-listen=127.0.0.1:{admin_port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files: ['{}']\n\
             scrape_configs:\n  - job_name: sluice\n    static_configs:\n      - targets: ['127.0.0.1:{admin_port}']\n",
            root.join("charts/sluice/files/alerts.yaml").display()
        ),
    )
    .unwrap();
    let _prom = tokio::process::Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{prom_port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("prometheus (Debian package prometheus; scripts/test.sh installs it)");
    let api = format!("http://127.0.0.1:{prom_port}/api/v1");

    // A minute of scrapes of the running demo (60 successful ones), asked
    // once a second.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let mut poll = tokio::time::interval(Duration::from_secs(1));
    loop {
        poll.tick().await;
        let url = reqwest::Url::parse_with_params(
            &format!("{api}/query"),
            [("query", "sum_over_time(up{job=\"sluice\"}[5m])")],
        )
        .unwrap();
        let answer: serde_json::Value = match client().get(url).send().await {
            Ok(r) => r.json().await.unwrap_or_default(),
            Err(_) => serde_json::Value::Null,
        };
        let scraped = answer["data"]["result"][0]["value"][1]
            .as_str()
            .and_then(|s| s.parse::<f64>().ok())
            .unwrap_or(0.0);
        if scraped >= 60.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no minute of successful scrapes of sluice demo ({scraped} so far)"
        );
    }

    // Every query of every panel returns data.
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("charts/sluice/files/dashboard.json")).unwrap(),
    )
    .unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().into_iter().flatten() {
            let expr = as_sent(t["expr"].as_str().unwrap());
            queries.push((panel["title"].to_string(), expr));
        }
    }
    let asked = queries.len();
    // A panel of rare events (upstream errors, retries: a rate over 20 s)
    // can be momentarily empty on a loaded machine; each empty one is asked
    // again, once a second, for up to a minute more (the demo outlives it).
    let mut empty = queries;
    let until = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut still = Vec::new();
        for (title, expr) in empty {
            let v = prom(&api, "/query", &[("query", &expr)]).await;
            assert_eq!(v["status"], "success", "{expr}: {v}");
            // A series whose value is a number (NaN draws nothing either).
            let shown = v["data"]["result"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|r| r["value"][1].as_str().is_some_and(|x| x != "NaN"));
            if !shown {
                still.push((title, expr));
            }
        }
        empty = still;
        if empty.is_empty() || tokio::time::Instant::now() >= until {
            break;
        }
        poll.tick().await;
    }
    let empty: Vec<String> = empty.iter().map(|(t, e)| format!("{t}: {e}")).collect();
    assert!(
        asked > 40,
        "only {asked} queries: the dashboard was not read"
    );
    assert!(
        empty.is_empty(),
        "panels with no data:\n{}",
        empty.join("\n")
    );

    // The demo's traces went out (to its own OTLP sink), none failed.
    let spans = |outcome: &str| {
        let q = format!("sum(sluice_trace_spans_total{{outcome=\"{outcome}\"}})");
        let api = api.clone();
        async move {
            let v = prom(&api, "/query", &[("query", &q)]).await;
            v["data"]["result"][0]["value"][1]
                .as_str()
                .and_then(|s| s.parse::<f64>().ok())
        }
    };
    assert!(spans("exported").await > Some(0.0), "no span exported");
    assert_eq!(spans("export_failed").await, Some(0.0));

    // A minute of the healthy demo under load names only what the demo
    // causes: its free tier held at its limit, and errors on the replica
    // it makes fail (at most that one).
    let d: serde_json::Value = client()
        .get(format!("http://127.0.0.1:{admin_port}/admin/diagnose"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let findings = d["findings"].as_array().unwrap();
    let mut erring = std::collections::BTreeSet::new();
    for f in findings {
        match f["pathology"].as_str().unwrap() {
            "tenant_at_limit" => assert_eq!(f["tier"], "free", "{f}"),
            "error_spike" => {
                erring.insert(f["backend"].as_str().unwrap().to_string());
            }
            _ => panic!("the healthy demo named {f}"),
        }
    }
    assert!(erring.len() <= 1, "errors named on {erring:?}");

    // Every alert rule has been evaluated, without error.
    let v = prom(&api, "/rules", &[]).await;
    let mut rules = 0;
    for g in v["data"]["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            rules += 1;
            assert_eq!(
                r["health"], "ok",
                "rule {} in {}: {r}",
                r["name"], g["name"]
            );
        }
    }
    let written = std::fs::read_to_string(root.join("charts/sluice/files/alerts.yaml"))
        .unwrap()
        .matches("- alert:")
        .count();
    assert_eq!(rules, written, "rules loaded vs written in alerts.yaml");
}
