//! `sluice top`: a live full-screen view of a running gateway, read from its
//! admin listener every second: per replica KV-cache, queue and batch bars,
//! TTFT and time per token; the fleet's request rate and latency
//! percentiles over the last interval; routing reasons; tenants (tiers);
//! flow control; active diagnoses. Redrawn in place on a terminal; one frame
//! per interval as plain text otherwise.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::time::Duration;

use serde::Deserialize;
use url::Url;

use crate::doctor::report::admin_get;

#[derive(Deserialize)]
struct Backend {
    name: String,
    healthy: bool,
    circuit: String,
    in_flight: u32,
    kv_cache_usage: Option<f64>,
    requests_waiting: Option<f64>,
    requests_running: Option<f64>,
    ttft_recent_seconds: Option<f64>,
    tpot_recent_seconds: Option<f64>,
    /// `mixed` (not shown), `prefill` or `decode`.
    #[serde(default)]
    role: String,
}

#[derive(Deserialize)]
struct Diagnosis {
    findings: Vec<Finding>,
}

#[derive(Deserialize)]
struct Finding {
    pathology: String,
    severity: String,
    backend: String,
    tier: Option<String>,
    model: Option<String>,
}

/// Counters and histogram buckets of one `/metrics` read, summed over the
/// labels a view does not show.
#[derive(Default, Clone)]
struct Counts {
    requests: f64,
    by_tier: BTreeMap<String, (f64, f64)>,
    reasons: BTreeMap<String, f64>,
    ttft: BTreeMap<String, f64>,
    itl: BTreeMap<String, f64>,
    waiting: f64,
}

/// A label's value, "" when absent.
fn label<'a>(labels: &'a str, name: &str) -> &'a str {
    crate::upstream::scrape::label(labels, name).unwrap_or("")
}

fn parse(text: &str) -> Counts {
    let mut c = Counts::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, v)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = v.parse::<f64>() else { continue };
        let (name, labels) = series.split_once('{').unwrap_or((series, ""));
        match name {
            "sluice_requests_total" => {
                c.requests += v;
                let t = c
                    .by_tier
                    .entry(label(labels, "tier").to_string())
                    .or_default();
                t.0 += v;
                if label(labels, "status") == "429" {
                    t.1 += v;
                }
            }
            "sluice_routing_decisions_total" => {
                *c.reasons
                    .entry(label(labels, "reason").to_string())
                    .or_default() += v;
            }
            "sluice_time_to_first_token_seconds_bucket" => {
                *c.ttft.entry(label(labels, "le").to_string()).or_default() += v;
            }
            "sluice_inter_token_latency_seconds_bucket" => {
                *c.itl.entry(label(labels, "le").to_string()).or_default() += v;
            }
            "sluice_flow_waiting_requests" => c.waiting += v,
            _ => {}
        }
    }
    c
}

/// A quantile of the observations between two reads of cumulative buckets.
fn quantile(now: &BTreeMap<String, f64>, before: &BTreeMap<String, f64>, q: f64) -> Option<f64> {
    let mut b: Vec<(f64, f64)> = now
        .iter()
        .map(|(le, n)| {
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::INFINITY)
            };
            (bound, n - before.get(le).copied().unwrap_or(0.0))
        })
        .collect();
    b.sort_by(|x, y| x.0.total_cmp(&y.0));
    let total = b.last()?.1;
    if total <= 0.0 {
        return None;
    }
    b.iter()
        .find(|(_, n)| *n >= q * total)
        .map(|(bound, _)| *bound)
}

fn bar(share: Option<f64>, width: usize) -> String {
    let Some(s) = share else {
        return format!("[{}]    -", " ".repeat(width));
    };
    let fill = ((s.clamp(0.0, 1.0) * width as f64).round() as usize).min(width);
    format!(
        "[{}{}] {:>3.0}%",
        "#".repeat(fill),
        ".".repeat(width - fill),
        s * 100.0
    )
}

fn ms(v: Option<f64>) -> String {
    match v {
        Some(s) if s.is_finite() => format!("{:.0}ms", s * 1e3),
        Some(_) => ">max".into(),
        None => "-".into(),
    }
}

/// One screen.
fn frame(
    admin: &Url,
    backends: &[Backend],
    diagnosis: &Diagnosis,
    now: &Counts,
    before: Option<&Counts>,
    secs: f64,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "sluice top  {}  (every {secs:.0}s, Ctrl-C to quit)\n",
        admin.as_str().trim_end_matches('/')
    );
    let _ = writeln!(
        out,
        "{:<22} {:<20} {:>6} {:>5} {:>9} {:>7} {:>7}  STATE",
        "REPLICA", "KV CACHE", "QUEUE", "RUN", "IN FLIGHT", "TTFT", "TPOT"
    );
    for b in backends {
        let state = if !b.healthy {
            "down".to_string()
        } else if b.circuit != "closed" {
            b.circuit.clone()
        } else {
            "ok".to_string()
        };
        let state = match b.role.as_str() {
            "" | "mixed" => state,
            role => format!("{state} ({role})"),
        };
        let name: String = b.name.chars().take(22).collect();
        let _ = writeln!(
            out,
            "{:<22} {:<20} {:>6} {:>5} {:>9} {:>7} {:>7}  {state}",
            name,
            bar(b.kv_cache_usage, 12),
            b.requests_waiting.map_or("-".into(), |w| format!("{w:.0}")),
            b.requests_running.map_or("-".into(), |r| format!("{r:.0}")),
            b.in_flight,
            ms(b.ttft_recent_seconds),
            ms(b.tpot_recent_seconds),
        );
    }
    out.push('\n');
    let rate = |n: f64, b: f64| (n - b).max(0.0) / secs;
    match before {
        Some(b) => {
            let _ = writeln!(
                out,
                "Fleet      {:.1} req/s   TTFT p50 {} p99 {}   inter-token p99 {}   waiting at the gateway {:.0}",
                rate(now.requests, b.requests),
                ms(quantile(&now.ttft, &b.ttft, 0.5)),
                ms(quantile(&now.ttft, &b.ttft, 0.99)),
                ms(quantile(&now.itl, &b.itl, 0.99)),
                now.waiting,
            );
            let reasons: Vec<String> = now
                .reasons
                .iter()
                .map(|(r, n)| (r, rate(*n, b.reasons.get(r).copied().unwrap_or(0.0))))
                .filter(|(_, v)| *v > 0.0)
                .map(|(r, v)| format!("{r} {v:.1}/s"))
                .collect();
            let _ = writeln!(
                out,
                "Routing    {}",
                if reasons.is_empty() {
                    "-".to_string()
                } else {
                    reasons.join("  ")
                }
            );
            let tiers: Vec<String> = now
                .by_tier
                .iter()
                .map(|(t, (n, limited))| {
                    let (bn, bl) = b.by_tier.get(t).copied().unwrap_or((0.0, 0.0));
                    let name = if t.is_empty() { "(no key)" } else { t.as_str() };
                    format!(
                        "{name} {:.1} req/s ({:.1} limited)",
                        rate(*n, bn),
                        rate(*limited, bl)
                    )
                })
                .collect();
            let _ = writeln!(
                out,
                "Tenants    {}",
                if tiers.is_empty() {
                    "-".to_string()
                } else {
                    tiers.join("  ")
                }
            );
        }
        None => out.push_str("Fleet      (rates from the next refresh)\n"),
    }
    out.push('\n');
    if diagnosis.findings.is_empty() {
        out.push_str("Diagnosis  healthy: no pathology found\n");
    } else {
        for f in &diagnosis.findings {
            let sev = if f.severity == "critical" {
                "CRITICAL"
            } else {
                "warning"
            };
            let on = match (&f.tier, &f.model) {
                (Some(t), _) => format!("tier {t}"),
                (_, Some(m)) => format!("model {m}"),
                _ => f.backend.clone(),
            };
            let _ = writeln!(out, "Diagnosis  {sev} {} on {on}", f.pathology);
        }
    }
    out
}

/// Read a frame's data from the gateway.
async fn read(admin: &Url) -> anyhow::Result<(Vec<Backend>, Diagnosis, Counts)> {
    let backends: Vec<Backend> =
        serde_json::from_slice(&admin_get(admin, "/admin/backends").await?)?;
    let diagnosis: Diagnosis = serde_json::from_slice(&admin_get(admin, "/admin/diagnose").await?)?;
    let metrics = admin_get(admin, "/metrics").await?;
    Ok((
        backends,
        diagnosis,
        parse(&String::from_utf8_lossy(&metrics)),
    ))
}

/// Successive frames of one gateway (rates over the time between two).
pub struct Viewer {
    admin: Url,
    interval: Duration,
    before: Option<Counts>,
}

impl Viewer {
    pub fn new(admin: Url, interval: Duration) -> Self {
        Self {
            admin,
            interval,
            before: None,
        }
    }

    /// The next frame, read from the gateway now.
    pub async fn frame(&mut self) -> anyhow::Result<String> {
        let (backends, diagnosis, counts) = read(&self.admin).await?;
        let text = frame(
            &self.admin,
            &backends,
            &diagnosis,
            &counts,
            self.before.as_ref(),
            self.interval.as_secs_f64(),
        );
        self.before = Some(counts);
        Ok(text)
    }
}

/// Print a frame: redrawn in place on a terminal (home, clear, draw), or
/// appended as plain text.
pub fn show(text: &str, tty: bool) {
    let mut out = std::io::stdout().lock();
    if tty {
        let _ = write!(out, "\x1b[H\x1b[2J{text}");
    } else {
        let _ = writeln!(out, "{text}");
    }
    let _ = out.flush();
}

/// Run until Ctrl-C (or `frames` frames): redraw in place on a terminal.
pub async fn run(admin: &Url, interval: Duration, frames: Option<u64>) -> anyhow::Result<()> {
    let tty = std::io::stdout().is_terminal();
    let mut viewer = Viewer::new(admin.clone(), interval);
    let mut tick = tokio::time::interval(interval);
    let mut n = 0u64;
    loop {
        tick.tick().await;
        show(&viewer.frame().await?, tty);
        n += 1;
        if frames.is_some_and(|f| n >= f) {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_quantiles_come_from_the_interval_only() {
        let m = |v: &[(&str, f64)]| -> BTreeMap<String, f64> {
            v.iter().map(|(k, n)| (k.to_string(), *n)).collect()
        };
        let before = m(&[("0.1", 100.0), ("1", 100.0), ("+Inf", 100.0)]);
        // Since then: 10 observations, 9 below 0.1 s and 1 between 0.1 and 1 s.
        let now = m(&[("0.1", 109.0), ("1", 110.0), ("+Inf", 110.0)]);
        assert_eq!(quantile(&now, &before, 0.5), Some(0.1));
        assert_eq!(quantile(&now, &before, 0.99), Some(1.0));
        assert_eq!(quantile(&before, &before, 0.5), None);
        assert_eq!(bar(Some(0.5), 10), "[#####.....]  50%");
    }
}
