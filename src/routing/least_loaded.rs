//! `least_loaded`: the candidate with the least work: requests waiting in its
//! queue (from its fresh metrics) plus requests in flight from this gateway;
//! a replica whose metrics are stale counts as saturated.
//! Ties are broken by a rotating start so equal replicas share work.
//! Cost: one pass over the candidates, O(n), no allocation.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

use super::{Decision, ReplicaView, RouteCtx, RoutingPolicy};
use crate::vocab::RouteReason;

pub(crate) struct LeastLoaded {
    rotate: AtomicUsize,
    stale_after: Option<Duration>,
}

impl LeastLoaded {
    pub(crate) fn new(stale_after: Option<Duration>) -> Self {
        Self {
            rotate: AtomicUsize::new(0),
            stale_after,
        }
    }
}

/// Work counted for a replica whose metrics are stale or missing while
/// scraping is on: more than any real queue, so it is treated as saturated
/// (its silence may be an overloaded engine) and only chosen when every
/// candidate is stale, then by its in-flight count.
const STALE_WORK: f64 = 1e9;

/// In-flight from this gateway plus the replica's own queue from its fresh
/// metrics (requests waiting for room: a decode leg pulling its KV is in
/// flight already, and counting it again as waiting made agentic sessions'
/// TTFT p99 1.20x higher in the median of five seeds: docs/BENCHMARKS.md,
/// "Decode legs waiting for their KV"); stale or missing metrics count as
/// saturated ([`STALE_WORK`]).
/// With scraping off (`stale_after` unset) in-flight alone decides.
pub(super) fn work(r: &ReplicaView, ctx: &RouteCtx<'_>, stale_after: Option<Duration>) -> f64 {
    let in_flight = f64::from(r.in_flight);
    let Some(d) = stale_after else {
        return in_flight;
    };
    match r.fresh_load(ctx.now, d) {
        // (The queue is every waiting request where the engine does not
        // tell them apart: `LoadSample::queue`.)
        Some(s) => in_flight + s.queue.unwrap_or(0.0),
        None => in_flight + STALE_WORK,
    }
}

impl RoutingPolicy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least_loaded"
    }

    fn pick(&self, ctx: &RouteCtx<'_>, candidates: &[ReplicaView]) -> Option<Decision> {
        let n = candidates.len();
        if n == 0 {
            return None;
        }
        let start = self.rotate.fetch_add(1, Relaxed) % n;
        let index = (0..n).map(|i| (start + i) % n).min_by(|&a, &b| {
            work(&candidates[a], ctx, self.stale_after).total_cmp(&work(
                &candidates[b],
                ctx,
                self.stale_after,
            ))
        })?;
        Some(Decision::plain(index, RouteReason::LeastLoaded))
    }
}
