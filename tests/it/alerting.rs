//! The operator kit in `charts/sluice/files`: alert rules (checked and unit-tested
//! with the real promtool), the Grafana dashboard and the runbook, held against the
//! metrics a running gateway really exports.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn promtool(args: &[&str]) -> String {
    tool("promtool", "prometheus", args)
}

fn tool(bin: &str, package: &str, args: &[&str]) -> String {
    let out = Command::new(bin)
        .args(args)
        .current_dir(repo(""))
        .output()
        .unwrap_or_else(|e| {
            panic!("{bin} not runnable ({e}); install Debian package `{package}` (.ci/run does)")
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{bin} {args:?} failed:\n{text}");
    text
}

/// `sluice_*` identifiers in a text (metric names, with histogram suffixes).
fn sluice_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let b = text.as_bytes();
    let mut i = 0;
    while let Some(off) = text[i..].find("sluice_") {
        let start = i + off;
        let boundary =
            start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_');
        let mut end = start;
        while end < b.len()
            && (b[end].is_ascii_lowercase() || b[end].is_ascii_digit() || b[end] == b'_')
        {
            end += 1;
        }
        if boundary {
            names.insert(text[start..end].to_string());
        }
        i = end;
    }
    names
}

/// Alert names declared in the rules file.
fn alert_names(rules: &str) -> Vec<String> {
    rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .map(|s| s.trim().to_string())
        .collect()
}

#[test]
fn alert_rules_pass_promtool_check_and_unit_tests() {
    let check = promtool(&["check", "rules", "charts/sluice/files/alerts.yaml"]);
    let rules = alert_names(&read("charts/sluice/files/alerts.yaml"));
    assert!(
        check.contains(&format!("SUCCESS: {} rules found", rules.len())),
        "{check}"
    );
    let test = promtool(&["test", "rules", "tests/prometheus/alerts_test.yaml"]);
    assert!(test.contains("SUCCESS"), "{test}");
}

#[test]
fn every_alert_is_tested_firing_and_has_a_runbook_section() {
    let rules_text = read("charts/sluice/files/alerts.yaml");
    let tests = read("tests/prometheus/alerts_test.yaml");
    let runbook = read("docs/RUNBOOK.md");
    let alerts = alert_names(&rules_text);
    assert!(alerts.len() >= 10, "{alerts:?}");
    for a in &alerts {
        // A promtool case in which the alert is expected to fire (non-empty exp_alerts).
        let firing = format!("alertname: {a}\n        exp_alerts:\n          - exp_labels:");
        assert!(tests.contains(&firing), "{a} has no firing test case");
        assert!(
            runbook.contains(&format!("\n## {a}\n")),
            "{a} has no section in docs/RUNBOOK.md"
        );
        let url = format!("docs/RUNBOOK.md#{}", a.to_lowercase());
        assert!(rules_text.contains(&url), "{a} does not link {url}");
    }
    // Inhibit rules only name alerts that exist.
    let inhibit = read("charts/sluice/files/alertmanager-inhibit.yaml");
    for word in inhibit.split(|c: char| !c.is_ascii_alphanumeric()) {
        if word.starts_with("Sluice") && word.len() > "Sluice".len() {
            assert!(
                alerts.iter().any(|a| a == word),
                "inhibit names unknown {word}"
            );
        }
    }
}

#[test]
fn inhibit_rules_load_in_alertmanager() {
    // The shipped file is the `inhibit_rules:` part of an alertmanager.yml:
    // put it in a minimal one and let the real amtool parse it.
    let inhibit = read("charts/sluice/files/alertmanager-inhibit.yaml");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("alertmanager.yml");
    let config = format!(
        "route:\n  receiver: pager\n  group_by: [alertname, cause]\nreceivers:\n  - name: pager\n{inhibit}"
    );
    std::fs::write(&path, config).unwrap();
    let out = tool(
        "amtool",
        "prometheus-alertmanager",
        &["check-config", path.to_str().unwrap()],
    );
    let rules = inhibit.matches("- source_matchers:").count();
    assert!(rules >= 5, "{inhibit}");
    assert!(out.contains(&format!("{rules} inhibit rules")), "{out}");
}

/// Every query of the shipped dashboard (panels and variables), one a line.
fn dashboard_queries() -> String {
    let dashboard: serde_json::Value =
        serde_json::from_str(&read("charts/sluice/files/dashboard.json")).unwrap();
    let mut ids = BTreeSet::new();
    let mut exprs = String::new();
    for p in dashboard["panels"].as_array().unwrap() {
        assert!(ids.insert(p["id"].as_u64().unwrap()), "duplicate panel id");
        if p["type"] == "row" {
            continue;
        }
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "panel {} has no query", p["title"]);
        for t in targets {
            exprs.push_str(t["expr"].as_str().unwrap());
            exprs.push('\n');
        }
    }
    for t in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(q) = t["definition"].as_str() {
            exprs.push_str(q);
            exprs.push('\n');
        }
    }
    exprs
}

/// A gateway with one replica that has served nothing exports a series of
/// every metric the shipped dashboard and alert rules name (a histogram's
/// `_bucket`, `_count` and `_sum`): panels read 0, not "No data", on a calm
/// fleet, and a rule can tell "none happened" from "not exported".
#[tokio::test]
async fn every_metric_the_dashboard_and_rules_name_has_a_series_before_any_request() {
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    let url = format!("{}/metrics", admin(&gw));
    // The replica's models are known (its series are made then).
    wait_until(
        "the model known",
        std::time::Duration::from_secs(10),
        || {
            let url = url.clone();
            async move {
                let (_, text) = get_text(&url).await;
                metric(&text, r#"sluice_model_replicas_healthy{model="sim-model"}"#) == Some(1.0)
            }
        },
    )
    .await;
    let (code, exposition) = get_text(&url).await;
    assert_eq!(code, 200);
    let histograms: BTreeSet<&str> = exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" histogram"))
        .collect();
    let series: BTreeSet<&str> = exposition
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    assert_eq!(
        metric(&exposition, "sluice_requests_total"),
        Some(0.0),
        "no traffic yet"
    );
    let mut absent = Vec::new();
    for (what, text) in [
        ("dashboard.json", dashboard_queries()),
        ("alerts.yaml", read("charts/sluice/files/alerts.yaml")),
    ] {
        for name in sluice_names(&text) {
            let wanted: Vec<String> = if histograms.contains(name.as_str()) {
                ["_bucket", "_count", "_sum"]
                    .iter()
                    .map(|s| format!("{name}{s}"))
                    .collect()
            } else {
                vec![name.clone()]
            };
            for w in wanted {
                if !series.contains(w.as_str()) {
                    absent.push(format!("{what}: {w}"));
                }
            }
        }
    }
    assert!(
        absent.is_empty(),
        "named but absent from a fresh gateway's /metrics:\n{}",
        absent.join("\n")
    );
    // The families the issue found missing on a calm fleet, by name.
    for name in [
        "sluice_upstream_retries_total",
        "sluice_config_reloads_total",
        "sluice_ratelimit_decisions_total",
        "sluice_ratelimit_store_errors_total",
        "sluice_routing_session_moves_total",
        "sluice_backend_engine_preemptions_total",
        "sluice_upstream_errors_total",
        "sluice_flow_requests_total",
        "sluice_request_finish_reasons_total",
    ] {
        assert!(series.contains(name), "{name} absent");
    }
}

#[tokio::test]
async fn dashboard_alerts_and_runbook_use_only_exported_metrics() {
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    // One request, so per-model families have series too (not required for # TYPE).
    let url = format!("{}/v1/chat/completions", api(&gw));
    let (status, _, _) = post(&url, &chat_body(true)).await;
    assert_eq!(status, 200);
    let (code, exposition) = get_text(&format!("{}/metrics", admin(&gw))).await;
    assert_eq!(code, 200);
    let exported: BTreeSet<String> = exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .map(str::to_string)
        .collect();
    assert!(
        exported.contains("sluice_time_to_first_token_seconds"),
        "{exported:?}"
    );
    assert_eq!(metric(&exposition, "sluice_backends_healthy"), Some(1.0));
    assert_eq!(
        metric(
            &exposition,
            r#"sluice_model_replicas_healthy{model="sim-model"}"#
        ),
        Some(1.0)
    );

    for (what, text) in [
        ("dashboard.json", dashboard_queries()),
        ("alerts.yaml", read("charts/sluice/files/alerts.yaml")),
        ("RUNBOOK.md", read("docs/RUNBOOK.md")),
    ] {
        let used = sluice_names(&text);
        assert!(!used.is_empty(), "{what} names no metric");
        for name in used {
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| exported.contains(*f)))
                .unwrap_or(&name);
            assert!(
                exported.contains(family),
                "{what} uses {name}, which the gateway does not export"
            );
        }
    }
}
