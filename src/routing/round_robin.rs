//! `round_robin`: each candidate in turn. One relaxed atomic increment per
//! decision; the baseline the other policies are measured against.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use super::{Decision, RouteCtx, RouteReason, RoutingPolicy};
use crate::upstream::pool::Replica;

#[derive(Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn pick(&self, _: &RouteCtx<'_>, candidates: &[Arc<Replica>]) -> Option<Decision> {
        if candidates.is_empty() {
            return None;
        }
        let index = self.next.fetch_add(1, Relaxed) % candidates.len();
        Some(Decision {
            index,
            reason: RouteReason::RoundRobin,
        })
    }
}
