//! Config of traces and the access log.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum OtlpProtocol {
    #[serde(rename = "grpc")]
    Grpc,
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
}

/// OTLP traces. Each field falls back to the standard OpenTelemetry
/// environment variable when absent: `OTEL_EXPORTER_OTLP_ENDPOINT` (or
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), `OTEL_EXPORTER_OTLP_PROTOCOL`,
/// `OTEL_SERVICE_NAME`. Tracing is on when `enabled: true`, or when it is not
/// set and an endpoint variable is.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    pub enabled: Option<bool>,
    /// gRPC: `http://collector:4317`; HTTP: `http://collector:4318` (`/v1/traces`
    /// is added when the URL has no path).
    pub endpoint: Option<String>,
    pub protocol: Option<OtlpProtocol>,
    pub service_name: Option<String>,
    pub sampling: SamplingConfig,
}

/// Tail-based sampling, decided when a request ends. The defaults keep every
/// error and every slow request, so turning tracing on needs nothing else.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SamplingConfig {
    pub keep_errors: bool,
    /// Keep every request whose TTFT reached this.
    #[serde(with = "humantime_serde")]
    pub ttft_threshold: Duration,
    /// Keep every request whose end-to-end latency reached this.
    #[serde(with = "humantime_serde")]
    pub e2e_threshold: Duration,
    /// Keep every stream whose largest inter-token gap reached this.
    #[serde(with = "humantime_serde")]
    pub gap_threshold: Duration,
    /// Share of the other requests kept, 0..1.
    pub ratio: f64,
    /// At most this many traces per second in all (0: no cap).
    pub max_per_second: u32,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            keep_errors: true,
            ttft_threshold: Duration::from_secs(2),
            e2e_threshold: Duration::from_secs(60),
            gap_threshold: Duration::from_secs(2),
            ratio: 0.01,
            max_per_second: 100,
        }
    }
}

/// Where tracing goes, after environment fallbacks.
#[derive(Debug, Clone)]
pub struct ResolvedTracing {
    pub protocol: OtlpProtocol,
    /// `None`: the exporter reads the OTEL_* endpoint variables itself.
    pub endpoint: Option<String>,
    pub service_name: String,
}

impl TracingConfig {
    pub fn resolve(&self) -> Option<ResolvedTracing> {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let env_endpoint = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"));
        let enabled = self
            .enabled
            .unwrap_or(self.endpoint.is_some() || env_endpoint.is_some());
        if !enabled {
            return None;
        }
        let protocol = self.protocol.unwrap_or_else(|| {
            match env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                .or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
                .as_deref()
            {
                Some(p) if p.starts_with("http") => OtlpProtocol::HttpProtobuf,
                _ => OtlpProtocol::Grpc,
            }
        });
        let endpoint = self.endpoint.as_ref().map(|e| match protocol {
            OtlpProtocol::HttpProtobuf => {
                let trimmed = e.trim_end_matches('/');
                let has_path =
                    url::Url::parse(trimmed).is_ok_and(|u| u.path() != "/" && !u.path().is_empty());
                if has_path {
                    trimmed.to_string()
                } else {
                    format!("{trimmed}/v1/traces")
                }
            }
            OtlpProtocol::Grpc => e.clone(),
        });
        let service_name = self
            .service_name
            .clone()
            .or_else(|| env("OTEL_SERVICE_NAME"))
            .unwrap_or_else(|| "sluice".into());
        Some(ResolvedTracing {
            protocol,
            endpoint,
            service_name,
        })
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LogTarget {
    #[default]
    Stdout,
    Stderr,
    /// Append to `path`.
    File,
}

/// One JSON line per request.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AccessLogConfig {
    pub enabled: bool,
    pub target: LogTarget,
    pub path: Option<PathBuf>,
    /// Also log the prompt's text (chat messages or completion prompt). Off by
    /// default: prompts are users' data. Completions are never logged.
    pub include_prompts: bool,
}

impl Default for AccessLogConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            target: LogTarget::Stdout,
            path: None,
            include_prompts: false,
        }
    }
}

/// Quality signals that read the answer's content (nothing of it is kept).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct QualityConfig {
    pub refusal: RefusalConfig,
}

/// The opt-in refusal detector: each answer's first `chars` characters,
/// lowercased, are looked for `phrases` (`sluice_quality_refusals_total`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RefusalConfig {
    pub enabled: bool,
    pub chars: usize,
    pub phrases: Vec<String>,
}

impl Default for RefusalConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            chars: 200,
            phrases: [
                "i cannot",
                "i can't",
                "i'm unable to",
                "i am unable to",
                "i won't",
                "i will not",
                "as an ai",
                "as a language model",
            ]
            .map(String::from)
            .to_vec(),
        }
    }
}
