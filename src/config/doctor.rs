//! Config of the diagnosis (`doctor`): thresholds of each pathology.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Thresholds of `/admin/diagnose`. Defaults are the reference articles'
/// (docs/RUNBOOK.md cites them per pathology).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DoctorConfig {
    /// Rates and trends are taken over this much of each replica's recent
    /// scrapes (at most the 10 minutes kept).
    #[serde(with = "humantime_serde")]
    pub window: Duration,
    /// A finding is raised at the first evaluation that sees it (one every
    /// scrape interval) and cleared only after its condition has been gone
    /// this long: evidence that comes and goes between scrapes keeps it
    /// named, with the time since which it holds.
    #[serde(with = "humantime_serde")]
    pub clear_after: Duration,
    /// KV-cache thrashing: KV usage at or above this at some scrape of the
    /// window (a scrape may land just after preemptions freed blocks)...
    pub thrashing_kv: f64,
    /// ...while the engine preempts at least this many sequences per second.
    pub thrashing_preemptions_per_second: f64,
    /// Prefill starvation: TTFT above this...
    #[serde(with = "humantime_serde")]
    pub starvation_ttft: Duration,
    /// ...while time per output token stays below this...
    #[serde(with = "humantime_serde")]
    pub starvation_itl: Duration,
    /// ...and at least this many requests wait, more than at the window's start.
    pub starvation_queue: f64,
    /// Leaked KV: the KV usage a replica would hold with nothing running,
    /// at or above this for `leak_for` at least, while its running sequences
    /// come and go: the lowest usage over that time, and the usage at its
    /// fewest running sequences less what they hold (the line through its
    /// fewest and most running, extended to none), both this high.
    pub leak_kv: f64,
    #[serde(with = "humantime_serde")]
    pub leak_for: Duration,
    /// A replica whose time per output token is this many times the median
    /// of its peers' is slow.
    pub slow_factor: f64,
    /// Uneven queues: a replica with at least `uneven_queue` waiting and
    /// `uneven_factor` times its peers' mean.
    pub uneven_queue: f64,
    pub uneven_factor: f64,
    /// Prefix-cache misses: the engine's hit rate below this...
    pub prefix_hit_low: f64,
    /// ...while it reported fewer than this share of the cached tokens
    /// routing expected there.
    pub prefix_shortfall: f64,
    /// A tier held at its limit: at least this share of its requests refused
    /// over the window...
    pub limit_share: f64,
    /// ...out of at least this many.
    pub limit_min_requests: u64,
    /// An error spike: at least this share of the attempts sent to a replica
    /// failed over the window (5%: the articles' error-rate alert)...
    pub error_share: f64,
    /// ...and at least this many.
    pub error_min: u64,
    /// Stalling streams: at least this many stalls per attempt sent to a
    /// replica over the window...
    pub stall_share: f64,
    /// ...and at least this many.
    pub stall_min: u64,
    /// Drift: a model's mean output length (either way) or mean TTFT (up)
    /// this many times its baseline (the journal before the window)...
    pub drift_factor: f64,
    /// ...each over at least this many requests.
    pub drift_min_requests: u64,
    /// Throughput drift: a model's generated tokens per second over the
    /// window against the same span this long ago (`drift_factor` times
    /// fewer while its traffic held).
    #[serde(with = "humantime_serde")]
    pub baseline: Duration,
    /// Underutilisation: over the whole window, the replica's median batch
    /// (running requests) below this...
    pub underused_batch: f64,
    /// ...never more than this many waiting...
    pub underused_queue: f64,
    /// ...and, where its DCGM exporter is configured, mean GPU utilisation
    /// below this (0..1).
    pub underused_gpu: f64,
    /// Slow KV transfers (disaggregated models): after a remote prefill,
    /// the decode leg's mean time to its first token (the KV transfer and
    /// one decode step) over the window at or above this, over at least
    /// `drift_min_requests` remote prefills.
    #[serde(with = "humantime_serde")]
    pub kv_transfer_slow: Duration,
}

impl Default for DoctorConfig {
    fn default() -> Self {
        Self {
            window: Duration::from_secs(300),
            clear_after: Duration::from_secs(60),
            thrashing_kv: 0.95,
            thrashing_preemptions_per_second: 1.0,
            starvation_ttft: Duration::from_secs(5),
            starvation_itl: Duration::from_millis(50),
            starvation_queue: 20.0,
            leak_kv: 0.3,
            leak_for: Duration::from_secs(60),
            slow_factor: 2.0,
            uneven_queue: 10.0,
            uneven_factor: 4.0,
            prefix_hit_low: 0.1,
            prefix_shortfall: 0.5,
            limit_share: 0.5,
            limit_min_requests: 10,
            error_share: 0.05,
            error_min: 5,
            stall_share: 0.05,
            stall_min: 3,
            drift_factor: 2.0,
            drift_min_requests: 20,
            baseline: Duration::from_secs(30 * 60),
            underused_batch: 8.0,
            underused_queue: 5.0,
            underused_gpu: 0.5,
            kv_transfer_slow: Duration::from_secs(1),
        }
    }
}
