//! Work in tokens, and time to first token predicted from it.
//!
//! Per replica, this gateway keeps its **backlog**: the uncached prompt
//! tokens of the requests it sent there that have not produced their first
//! token yet (prefill still to do). Each first token **calibrates** the
//! replica's rate online, with no hand-tuned constant: the seconds it took
//! over the tokens that were ahead of it (its own included), a moving
//! average. What other gateways send shows in the replica's scraped queue:
//! the backlog counted is the larger of this gateway's own and the scraped
//! waiting requests times this replica's mean uncached tokens per request.
//!
//! A request's predicted TTFT on a replica is then
//! `rate x (backlog + its own uncached tokens)`, where the uncached tokens
//! count the prefix cache it would hit there. The same numbers say when a
//! replica is full (its predicted wait) for flow control.
//! (`routing::placement` does the accounting per request.)

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::telemetry::ewma::Ewma;

/// What routing learns of a replica from this gateway's requests.
#[derive(Default)]
pub(crate) struct Load {
    /// Uncached prompt tokens sent here, not yet at their first token.
    pub(super) backlog: AtomicU64,
    /// Seconds to first token per token ahead (prefill rate, queueing and
    /// decode interference folded in).
    pub(super) rate: Ewma,
    /// Uncached prompt tokens per request (to turn a scraped queue into tokens).
    pub(super) per_request: Ewma,
    /// Closed loop: cached tokens predicted at routing, and what the engine
    /// reported for the same requests.
    pub(crate) predicted_cached: AtomicU64,
    pub(crate) actual_cached: AtomicU64,
    /// Requests whose cached tokens fell short of the prediction (the index
    /// was corrected for them).
    pub(crate) shortfalls: AtomicU64,
}

impl Load {
    pub(crate) fn backlog(&self) -> u64 {
        self.backlog.load(Relaxed)
    }

    /// The calibrated rate (seconds per token), once learned.
    pub(crate) fn rate(&self) -> Option<f64> {
        self.rate.get()
    }

    /// Tokens ahead of a new request: the larger of this gateway's backlog
    /// and the scraped queue in tokens.
    pub(crate) fn ahead(&self, scraped_waiting: Option<f64>) -> f64 {
        let own = self.backlog() as f64;
        let per = self.per_request.get().unwrap_or(0.0);
        own.max(scraped_waiting.unwrap_or(0.0) * per)
    }
}
