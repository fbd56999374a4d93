//! The access log: one JSON object per line per request, written when the
//! request's record is emitted. Timings in milliseconds, tokens from the
//! replica's usage, the replica and why it was chosen, the tier and key name
//! (never the key), the finish reason, status, and the trace id (so a line
//! leads to its trace when the trace was kept). Prompts only if configured;
//! completions never.

use parking_lot::Mutex;
use std::fs::OpenOptions;
use std::io::{LineWriter, Write};
use std::time::{Duration, SystemTime};

use serde::Serialize;

use super::record::RequestRecord;
use crate::config::{AccessLogConfig, LogTarget};

pub struct AccessLog {
    out: Mutex<Box<dyn Write + Send>>,
    pub include_prompts: bool,
}

#[derive(Serialize)]
struct Line<'a> {
    ts: String,
    request_id: &'a str,
    trace_id: Option<String>,
    trace_kept: Option<&'static str>,
    endpoint: &'static str,
    model: &'a str,
    stream: bool,
    status: u16,
    error_kind: Option<&'static str>,
    client_disconnected: bool,
    backend: Option<&'a str>,
    route_reason: Option<&'static str>,
    attempts: u32,
    tier: Option<&'a str>,
    key_name: Option<&'a str>,
    ratelimit: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    band: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    flow: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    flow_wait_ms: Option<f64>,
    /// A disaggregated model: how it was prefilled, where, how long.
    #[serde(skip_serializing_if = "Option::is_none")]
    pd: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prefill_backend: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prefill_route_reason: Option<&'static str>,
    /// Prompt tokens the prefill replica had cached (vLLM's protocol).
    #[serde(skip_serializing_if = "Option::is_none")]
    prefill_cached_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prefill_ms: Option<f64>,
    finish_reason: Option<&'static str>,
    prompt_tokens: Option<u32>,
    completion_tokens: Option<u32>,
    queue_ms: Option<f64>,
    ttft_ms: Option<f64>,
    tpot_ms: Option<f64>,
    e2e_ms: Option<f64>,
    max_gap_ms: Option<f64>,
    stalls: u32,
    output_events: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt: Option<&'a str>,
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// RFC 3339 UTC with milliseconds, from a `SystemTime` (humantime's).
pub(crate) fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

impl AccessLog {
    pub(crate) fn open(cfg: &AccessLogConfig) -> anyhow::Result<Option<Self>> {
        if !cfg.enabled {
            return Ok(None);
        }
        let out: Box<dyn Write + Send> = match cfg.target {
            LogTarget::Stdout => Box::new(LineWriter::new(std::io::stdout())),
            LogTarget::Stderr => Box::new(LineWriter::new(std::io::stderr())),
            LogTarget::File => {
                let path = cfg
                    .path
                    .as_ref()
                    .ok_or_else(|| anyhow::anyhow!("telemetry.access_log.path is needed"))?;
                let f = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|e| {
                        anyhow::anyhow!("telemetry.access_log.path {}: {e}", path.display())
                    })?;
                Box::new(LineWriter::new(f))
            }
        };
        Ok(Some(Self {
            out: Mutex::new(out),
            include_prompts: cfg.include_prompts,
        }))
    }

    pub(crate) fn write(
        &self,
        r: &RequestRecord,
        trace_kept: Option<&'static str>,
        prompt: Option<&str>,
    ) {
        let line = Line {
            ts: rfc3339(r.wall_arrival),
            request_id: &r.request_id,
            trace_id: r.trace.map(|t| t.trace_id_hex()),
            trace_kept,
            endpoint: r.endpoint.as_str(),
            model: &r.model,
            stream: r.stream,
            status: r.status,
            error_kind: r.error_kind,
            client_disconnected: r.disconnected,
            backend: r.backend.as_deref(),
            route_reason: r.route_reason.map(|x| x.as_str()),
            attempts: r.attempts,
            tier: r.tier.as_deref(),
            key_name: r.key_name.as_deref(),
            ratelimit: r.ratelimit,
            band: r.flow.map(|f| f.band),
            flow: r.flow.map(|f| f.outcome),
            flow_wait_ms: r.flow.map(|f| ms(f.waited)),
            pd: r.pd.as_ref().map(|p| p.reason.as_str()),
            prefill_backend: r.pd.as_ref().and_then(|p| p.prefill_backend.as_deref()),
            prefill_route_reason: r
                .pd
                .as_ref()
                .and_then(|p| p.prefill_route.map(|x| x.as_str())),
            prefill_cached_tokens: r.pd.as_ref().and_then(|p| p.prefill_cached),
            prefill_ms: r.pd.as_ref().and_then(|p| p.prefill_time().map(ms)),
            finish_reason: r.finish_reason.map(|f| f.as_str()),
            prompt_tokens: r.usage.map(|u| u.prompt_tokens),
            completion_tokens: r.usage.map(|u| u.completion_tokens),
            queue_ms: r
                .upstream_sent
                .map(|s| ms(s.saturating_duration_since(r.arrival))),
            ttft_ms: r.ttft().map(ms),
            tpot_ms: r.tpot().map(ms),
            e2e_ms: r.e2e().map(ms),
            max_gap_ms: (r.output_events >= 2).then(|| ms(r.max_gap)),
            stalls: r.stalls,
            output_events: r.output_events,
            prompt: prompt.filter(|_| self.include_prompts),
        };
        let Ok(mut buf) = serde_json::to_vec(&line) else {
            return;
        };
        buf.push(b'\n');
        let _ = self.out.lock().write_all(&buf);
    }
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        let t = UNIX_EPOCH + Duration::from_millis(1_795_299_051_123);
        assert_eq!(rfc3339(t), "2026-11-21T22:10:51.123Z");
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
    }
}
