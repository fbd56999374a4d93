//! Config of flow control: what happens when no replica can take more work.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Flow control (`flow_control`): while every replica of a model is full,
/// requests wait at the gateway (bounded) and leave by priority band, fairly
/// between tenants within a band. The defaults, and why:
///
/// - `max_wait` 30s: longer than any engine's own step stalls, shorter than
///   the SDKs' request timeouts (600 s), so a client gets a real answer (503
///   with `Retry-After`) long before it gives up on its own; a tier's
///   `max_wait` replaces it.
/// - `max_queue` 1,000 per model: the waiting list is memory only (no replica
///   resources), but a flood should be shed, lowest band first, rather than
///   grow without bound.
/// - `output_weight` 4: a generated token costs an engine several times a
///   prompt token (one decode step of the whole batch per token, against
///   prompt tokens prefilled thousands per step), so fairness counts service
///   in input tokens plus 4 x output tokens.
/// - `recheck` 100ms: waiters are woken at once when a request ends; a
///   replica's scraped pressure (KV, queue) is re-read this often while
///   anything waits (scrapes come every second by default).
/// - `share_fairness` on, every `share_interval` 250ms: with the Redis
///   rate-limit store (`rate_limits.store: redis`), the gateways add the
///   service they gave each tenant to one total per model in Redis and read
///   the others' back, so a tenant's requests through other gateways count
///   here while tenants compete here (a tenant cannot get N shares through N
///   gateways); they also publish what each tenant wants there, and while
///   the tenants want more seats than the model has, each gateway fills at
///   most its part (max-min between tenants, by band). A quarter of a second
///   is a few requests' worth at a saturated fleet, and one small round trip
///   per model.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct FlowControlConfig {
    /// Off: saturated replicas take the excess (the engines queue it).
    pub enabled: bool,
    /// Longest wait at the gateway before a 503 with `Retry-After`.
    #[serde(with = "humantime_serde")]
    pub max_wait: Duration,
    /// Most requests waiting per model; beyond it the newest request of the
    /// lowest band waiting is shed (503) to make room for a higher one.
    pub max_queue: usize,
    /// Weight of an output token against an input token in fairness.
    pub output_weight: f64,
    /// How often waiters re-read the replicas' pressure.
    #[serde(with = "humantime_serde")]
    pub recheck: Duration,
    /// Share attained service and the seats between gateways through the
    /// Redis store (only with `rate_limits.store: redis`).
    pub share_fairness: bool,
    /// How often the shared service is synchronised.
    #[serde(with = "humantime_serde")]
    pub share_interval: Duration,
}

impl Default for FlowControlConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_wait: Duration::from_secs(30),
            max_queue: 1000,
            output_weight: 4.0,
            recheck: Duration::from_millis(100),
            share_fairness: true,
            share_interval: Duration::from_millis(250),
        }
    }
}

/// How a replica's engine takes a request's priority (`backends[].engine_priority`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EnginePriority {
    /// Not sent.
    #[default]
    Off,
    /// vLLM (`--scheduling-policy priority`): body field `priority`, lower
    /// runs earlier; sent as minus the band.
    Vllm,
    /// SGLang (`--enable-priority-scheduling`): body field `priority`, higher
    /// runs earlier; sent as the band.
    Sglang,
}
