//! Metrics (registry and catalog), the per-request record, and log setup.

pub(crate) mod access_log;
pub(crate) mod ewma;
pub mod metrics;
pub mod quality;
pub(crate) mod record;
pub(crate) mod registry;
pub mod tracecontext;
pub(crate) mod traces;

use std::sync::Arc;

/// Where a finished request is reported: metrics, traces, access log.
pub struct Telemetry {
    pub metrics: Arc<metrics::Metrics>,
    pub traces: Option<Arc<traces::Traces>>,
    pub access_log: Option<access_log::AccessLog>,
    /// The opt-in refusal detector (`telemetry.quality.refusal`).
    pub refusal: Option<Arc<quality::Refusal>>,
}

/// Human-readable logs on stderr; `SLUICE_LOG_FORMAT=json` for one JSON object
/// per line. Level from `RUST_LOG` (default `info`).
pub fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("SLUICE_LOG_FORMAT").is_ok_and(|v| v == "json");
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
