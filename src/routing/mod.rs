//! Choosing a replica for a request: a small trait, one file per policy.
//!
//! A policy sees the request's routing context and the candidates that serve
//! its model (healthy, not ejected, and excluding replicas tried by earlier
//! attempts) and returns a [`Decision`] with a reason from a closed set, which
//! is counted in metrics and recorded with the request.

pub mod index;
mod least_loaded;
pub mod prefix;
mod prefix_kv;
mod round_robin;

pub use least_loaded::LeastLoaded;
pub use prefix_kv::PrefixKv;
pub use round_robin::RoundRobin;

use std::sync::Arc;
use std::time::Instant;

use crate::config::PolicyKind;
use crate::config::RoutingConfig;
use crate::upstream::pool::Replica;

/// What a policy may look at besides the candidates.
pub struct RouteCtx<'a> {
    /// The served model name (aliases resolved).
    pub model: &'a str,
    /// Chained hashes of the prompt's blocks (`routing::prefix`); empty when
    /// the policy does not use them or the prompt is shorter than a block.
    pub hashes: &'a [u64],
    pub now: Instant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteReason {
    RoundRobin,
    LeastLoaded,
    /// The replica holding the prompt's prefix (or its consistent-hash home).
    Affinity,
    /// The preferred replica's KV cache was above `kv_high`.
    SpillKv,
    /// The preferred replica's queue was above `queue_high`.
    SpillQueue,
    /// The preferred replica's metrics were too old to trust.
    SpillStale,
    /// The home replica carried more than its bounded share of in-flight load.
    SpillLoad,
    /// Every candidate was filtered out (pressure, stale metrics, ejection):
    /// the least loaded of them was used rather than failing.
    Fallback,
    /// An earlier attempt failed before the first byte; this is the next replica.
    Retry,
}

impl RouteReason {
    pub fn as_str(self) -> &'static str {
        match self {
            RouteReason::RoundRobin => "round_robin",
            RouteReason::LeastLoaded => "least_loaded",
            RouteReason::Affinity => "affinity",
            RouteReason::SpillKv => "spill_kv",
            RouteReason::SpillQueue => "spill_queue",
            RouteReason::SpillStale => "spill_stale",
            RouteReason::SpillLoad => "spill_load",
            RouteReason::Fallback => "fallback",
            RouteReason::Retry => "retry",
        }
    }

    pub const ALL: [RouteReason; 9] = [
        RouteReason::RoundRobin,
        RouteReason::LeastLoaded,
        RouteReason::Affinity,
        RouteReason::SpillKv,
        RouteReason::SpillQueue,
        RouteReason::SpillStale,
        RouteReason::SpillLoad,
        RouteReason::Fallback,
        RouteReason::Retry,
    ];
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Index into the candidate slice.
    pub index: usize,
    pub reason: RouteReason,
}

pub trait RoutingPolicy: Send + Sync {
    fn name(&self) -> &'static str;
    /// Whether `RouteCtx::hashes` should be computed for this policy.
    fn wants_prefix(&self) -> bool {
        false
    }
    /// `None` only when `candidates` is empty.
    fn pick(&self, ctx: &RouteCtx<'_>, candidates: &[Arc<Replica>]) -> Option<Decision>;
}

pub fn build(cfg: &RoutingConfig) -> Arc<dyn RoutingPolicy> {
    // Without scraping there are no samples to distrust: pressure is unknown,
    // not saturated.
    let stale_after = cfg.metrics.enabled.then_some(cfg.metrics.stale_after);
    match cfg.policy {
        PolicyKind::RoundRobin => Arc::new(RoundRobin::default()),
        PolicyKind::LeastLoaded => Arc::new(LeastLoaded::new(stale_after)),
        PolicyKind::PrefixKv => Arc::new(PrefixKv::new(cfg.prefix_kv.clone(), stale_after)),
    }
}
