//! `least_loaded`: the candidate with the fewest requests in flight from this
//! gateway. Ties are broken by a rotating start so equal replicas share work.
//! Cost: one pass over the candidates, O(n), no allocation.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use super::{Decision, RouteCtx, RouteReason, RoutingPolicy};
use crate::upstream::pool::Replica;

#[derive(Default)]
pub struct LeastLoaded {
    rotate: AtomicUsize,
}

impl RoutingPolicy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least_loaded"
    }

    fn pick(&self, _: &RouteCtx<'_>, candidates: &[Arc<Replica>]) -> Option<Decision> {
        let n = candidates.len();
        if n == 0 {
            return None;
        }
        let start = self.rotate.fetch_add(1, Relaxed) % n;
        let index = (0..n)
            .map(|i| (start + i) % n)
            .min_by_key(|&i| candidates[i].in_flight())?;
        Some(Decision {
            index,
            reason: RouteReason::LeastLoaded,
        })
    }
}
