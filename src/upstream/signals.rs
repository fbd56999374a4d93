//! What this gateway knows about a replica's load: the latest scrape of its
//! own metrics (the latency measured here is a `telemetry::ewma::Ewma`).

use std::time::Instant;

pub(crate) use crate::telemetry::ewma::Ewma;
use crate::vocab::EngineKind;

/// One scrape's worth of what routing needs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadSample {
    pub engine: EngineKind,
    /// KV-cache usage, 0..1.
    pub kv_usage: Option<f64>,
    pub waiting: Option<f64>,
    pub running: Option<f64>,
    pub block_size: Option<u32>,
    pub num_blocks: Option<u32>,
    /// Prefix-cache hits / queries since the replica started.
    pub prefix_hit_rate: Option<f64>,
    pub at: Instant,
}
