//! `least_loaded`: the candidate with the least work: requests waiting in its
//! queue (from its fresh metrics) plus requests in flight from this gateway.
//! Ties are broken by a rotating start so equal replicas share work.
//! Cost: one pass over the candidates, O(n), no allocation.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

use super::{Decision, RouteCtx, RouteReason, RoutingPolicy};
use crate::upstream::pool::Replica;

pub struct LeastLoaded {
    rotate: AtomicUsize,
    stale_after: Option<Duration>,
}

impl LeastLoaded {
    pub fn new(stale_after: Option<Duration>) -> Self {
        Self {
            rotate: AtomicUsize::new(0),
            stale_after,
        }
    }
}

/// In-flight from this gateway plus the replica's own queue when its metrics
/// are fresh (stale or missing metrics add nothing: in-flight still counts).
pub fn work(r: &Replica, ctx: &RouteCtx<'_>, stale_after: Option<Duration>) -> f64 {
    let waiting = r
        .load()
        .filter(|s| stale_after.is_some_and(|d| ctx.now.saturating_duration_since(s.at) <= d))
        .and_then(|s| s.waiting)
        .unwrap_or(0.0);
    f64::from(r.in_flight()) + waiting
}

impl RoutingPolicy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least_loaded"
    }

    fn pick(&self, ctx: &RouteCtx<'_>, candidates: &[Arc<Replica>]) -> Option<Decision> {
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
        Some(Decision {
            index,
            reason: RouteReason::LeastLoaded,
        })
    }
}
