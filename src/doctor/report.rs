//! `sluice diagnose`: ask a running gateway's admin listener what is wrong
//! and print it for a person (or as JSON). Exits 2 when a finding is critical.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use url::Url;

use super::Severity;
use crate::term::print_out;

/// Something critical was found (the report is printed; the exit code says it).
#[derive(Debug, thiserror::Error)]
#[error("a critical pathology was found")]
pub struct Critical;

#[derive(Deserialize)]
struct Diagnosis {
    healthy: bool,
    worst: Option<Severity>,
    findings: Vec<Finding>,
}

#[derive(Deserialize)]
struct Finding {
    pathology: String,
    severity: Severity,
    backend: String,
    tier: Option<String>,
    model: Option<String>,
    evidence: serde_json::Map<String, serde_json::Value>,
    window_seconds: f64,
    cause: String,
    action: String,
    #[serde(default)]
    since: Option<String>,
    #[serde(default)]
    for_seconds: Option<f64>,
    #[serde(default = "yes")]
    active: bool,
    #[serde(default)]
    gone_seconds: Option<f64>,
}

fn yes() -> bool {
    true
}

/// The admin token the commands send (`--admin-token`, `SLUICE_ADMIN_TOKEN`):
/// set once by the command, before its first request.
static TOKEN: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Send this token to the admin listener (a command's `--admin-token`).
pub fn use_token(token: Option<String>) {
    if let Some(t) = token {
        let _ = TOKEN.set(t);
    }
}

/// GET `path` from a gateway's admin listener (for the commands that read a
/// running gateway: `diagnose`, `top`).
pub async fn admin_get(admin: &Url, path: &str) -> anyhow::Result<Bytes> {
    let url = format!("{}{path}", admin.as_str().trim_end_matches('/'));
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let mut req = http::Request::get(&url).body(Full::new(Bytes::new()))?;
    if let Some(t) = TOKEN.get() {
        req.headers_mut()
            .insert(http::header::AUTHORIZATION, format!("Bearer {t}").parse()?);
    }
    let resp = tokio::time::timeout(std::time::Duration::from_secs(10), client.request(req))
        .await
        .map_err(|_| anyhow::anyhow!("{url} did not answer within 10 s"))?
        .map_err(|e| {
            anyhow::anyhow!("cannot reach {url}: {e} (is --admin the gateway's admin listener?)")
        })?;
    anyhow::ensure!(
        resp.status() != http::StatusCode::UNAUTHORIZED,
        "{url} answered 401: the admin listener wants its token (--admin-token or SLUICE_ADMIN_TOKEN)"
    );
    anyhow::ensure!(
        resp.status().is_success(),
        "{url} answered {}",
        resp.status()
    );
    Ok(resp.into_body().collect().await?.to_bytes())
}

pub async fn run(admin: &Url, json: bool) -> anyhow::Result<()> {
    let url = format!("{}/admin/diagnose", admin.as_str().trim_end_matches('/'));
    let body = admin_get(admin, "/admin/diagnose").await?;
    let d: Diagnosis = serde_json::from_slice(&body)
        .map_err(|e| anyhow::anyhow!("{url} did not answer a diagnosis: {e}"))?;
    if json {
        print_out(&String::from_utf8_lossy(&body));
    } else {
        print_out(&text(&d));
    }
    if d.worst == Some(Severity::Critical) {
        return Err(Critical.into());
    }
    Ok(())
}

/// A duration for a person: `45 s`, `12 min`, `3.5 h`.
fn ago(secs: f64) -> String {
    if secs < 120.0 {
        format!("{secs:.0} s")
    } else if secs < 7200.0 {
        format!("{:.0} min", secs / 60.0)
    } else {
        format!("{:.1} h", secs / 3600.0)
    }
}

fn text(d: &Diagnosis) -> String {
    if d.findings.is_empty() {
        return "healthy: no pathology found".into();
    }
    let mut out = if d.healthy {
        format!("healthy: {} note(s) for information\n", d.findings.len())
    } else {
        format!("{} finding(s)\n", d.findings.len())
    };
    for f in &d.findings {
        let sev = match f.severity {
            Severity::Critical => "CRITICAL",
            Severity::Warning => "warning",
            Severity::Info => "info",
        };
        let on = match (&f.tier, &f.model) {
            (Some(t), _) => format!("tier {t}"),
            (_, Some(m)) => format!("model {m}"),
            _ => f.backend.clone(),
        };
        out.push_str(&format!("\n{sev}  {}  on {on}", f.pathology));
        if let (Some(since), Some(secs)) = (&f.since, f.for_seconds) {
            out.push_str(&format!("  since {since} ({})", ago(secs)));
        }
        if !f.active {
            let gone = f
                .gone_seconds
                .map_or_else(String::new, |g| format!(" {}", ago(g)));
            out.push_str(&format!("  [not seen{gone} ago; held until it stays gone]"));
        }
        out.push('\n');
        let ev: Vec<String> = f.evidence.iter().map(|(k, v)| format!("{k}={v}")).collect();
        out.push_str(&format!("  evidence: {}", ev.join(", ")));
        if f.window_seconds > 0.0 {
            out.push_str(&format!(" (over {:.0} s)", f.window_seconds));
        }
        out.push('\n');
        out.push_str(&format!("  cause:    {}\n", f.cause));
        out.push_str(&format!("  action:   {}\n", f.action));
    }
    out
}
