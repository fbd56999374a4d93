//! Choosing a replica for a request: a small trait, one file per policy.
//!
//! A policy sees the request's routing context and the healthy candidates that
//! serve its model (already excluding replicas tried by earlier attempts) and
//! returns a [`Decision`] with a reason from a closed set, which is counted in
//! metrics and recorded with the request.

mod least_loaded;
mod round_robin;

pub use least_loaded::LeastLoaded;
pub use round_robin::RoundRobin;

use std::sync::Arc;

use crate::config::PolicyKind;
use crate::upstream::pool::Replica;

/// What a policy may look at besides the candidates.
pub struct RouteCtx<'a> {
    /// The served model name (aliases resolved).
    pub model: &'a str,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteReason {
    RoundRobin,
    LeastLoaded,
    /// An earlier attempt failed before the first byte; this is the next replica.
    Retry,
}

impl RouteReason {
    pub fn as_str(self) -> &'static str {
        match self {
            RouteReason::RoundRobin => "round_robin",
            RouteReason::LeastLoaded => "least_loaded",
            RouteReason::Retry => "retry",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Index into the candidate slice.
    pub index: usize,
    pub reason: RouteReason,
}

pub trait RoutingPolicy: Send + Sync {
    fn name(&self) -> &'static str;
    /// `None` only when `candidates` is empty.
    fn pick(&self, ctx: &RouteCtx<'_>, candidates: &[Arc<Replica>]) -> Option<Decision>;
}

pub fn build(kind: PolicyKind) -> Arc<dyn RoutingPolicy> {
    match kind {
        PolicyKind::RoundRobin => Arc::new(RoundRobin::default()),
        PolicyKind::LeastLoaded => Arc::new(LeastLoaded::default()),
    }
}
