//! `round_robin`: each candidate in turn. One relaxed atomic increment per
//! decision; the baseline the other policies are measured against.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use super::{Decision, ReplicaView, RouteCtx, RoutingPolicy};
use crate::vocab::RouteReason;

#[derive(Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn pick(&self, _: &RouteCtx<'_>, candidates: &[ReplicaView]) -> Option<Decision> {
        if candidates.is_empty() {
            return None;
        }
        let index = self.next.fetch_add(1, Relaxed) % candidates.len();
        Some(Decision::plain(index, RouteReason::RoundRobin))
    }
}
