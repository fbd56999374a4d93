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
//!
//! How much of the cache routing predicts an engine actually had is kept as
//! a moving average ([`Load::kept`], shown in `/admin/routing`), not weighed
//! into the predictions: weighed so (a home's predicted hits, and the
//! backlog a request adds, counted at that share), it neither lowered the
//! TTFT p99 on two llama.cpp servers that keep half of what they are sent
//! (median of five seeds 3.75 s against 3.66 s) nor held on the simulated
//! matrix's tight-cache cell (three seeds of five 1.2-1.9x higher;
//! docs/bench/matrix/real_kept_2026-12-08).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use crate::telemetry::ewma::Ewma;
use crate::telemetry::metrics::epoch;

/// The span of one window of [`Recent`]: it counts the requests of the
/// current window and the one before, 5 to 10 seconds of them.
const WINDOW: Duration = Duration::from_secs(5);

/// Requests routed to a replica lately, counted in two alternating windows
/// (one atomic add a request; the window that comes round again is zeroed by
/// whoever sees it first, so a count may lose a request or two at a turn:
/// this is a share of traffic, not an account).
#[derive(Default)]
pub(crate) struct Recent {
    /// `counts[w % 2]` holds window `w`'s requests while `windows[w % 2] == w`.
    counts: [AtomicU64; 2],
    windows: [AtomicU64; 2],
}

impl Recent {
    fn window(now: Instant) -> u64 {
        (now.saturating_duration_since(epoch()).as_nanos() / WINDOW.as_nanos()) as u64
    }

    pub(crate) fn add(&self, now: Instant) {
        let w = Self::window(now);
        let i = (w % 2) as usize;
        let seen = self.windows[i].load(Relaxed);
        if seen != w
            && self.windows[i]
                .compare_exchange(seen, w, Relaxed, Relaxed)
                .is_ok()
        {
            self.counts[i].store(0, Relaxed);
        }
        self.counts[i].fetch_add(1, Relaxed);
    }

    /// Requests of this window and the one before.
    pub(crate) fn get(&self, now: Instant) -> u64 {
        let w = Self::window(now);
        (0..2)
            .filter(|&i| {
                let seen = self.windows[i].load(Relaxed);
                seen == w || seen + 1 == w
            })
            .map(|i| self.counts[i].load(Relaxed))
            .sum()
    }
}

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
    /// The same, lately: the share of the cached tokens predicted that the
    /// engine reported, per request, a moving average (stored plus one: an
    /// average of 0, everything evicted, is a value, not "none"). For the
    /// operator: an engine that keeps little of what it is sent (too small
    /// a cache for its prompts, or one prompt a slot) makes affinity worth
    /// little there.
    kept: Ewma,
    /// The engine has said what it had cached for a request (vLLM does with
    /// `--enable-prompt-tokens-details`, SGLang and llama.cpp always): its
    /// answers' rate samples wait for that word ([`super::placement`]).
    pub(crate) reports_cached: AtomicBool,
    /// Requests whose cached tokens fell short of the prediction (the index
    /// was corrected for them).
    pub(crate) shortfalls: AtomicU64,
    /// Those shortfalls lately (the engine evicted what it was sent here):
    /// a replica whose cache does not keep its prompts.
    pub(crate) evicting: Recent,
    /// Requests this gateway routed here lately: its share of the traffic,
    /// for placing new keys.
    pub(crate) routed: Recent,
}

impl Load {
    pub(crate) fn backlog(&self) -> u64 {
        self.backlog.load(Relaxed)
    }

    /// The calibrated rate (seconds per token), once learned.
    pub(crate) fn rate(&self) -> Option<f64> {
        self.rate.get()
    }

    /// The share of the cached tokens routing predicts here that the engine
    /// has lately had (1 until it says).
    pub(crate) fn kept(&self) -> f64 {
        self.kept.get().map_or(1.0, |k| (k - 1.0).clamp(0.0, 1.0))
    }

    /// The engine had `share` of the cached tokens predicted for a request.
    pub(crate) fn observe_kept(&self, share: f64) {
        self.kept.observe(1.0 + share.clamp(0.0, 1.0));
    }

    pub(crate) fn reports_cached(&self) -> bool {
        self.reports_cached.load(Relaxed)
    }

    /// Tokens ahead of a new request: the larger of this gateway's backlog
    /// and the scraped queue in tokens.
    pub(crate) fn ahead(&self, scraped_waiting: Option<f64>) -> f64 {
        let own = self.backlog() as f64;
        let per = self.per_request.get().unwrap_or(0.0);
        own.max(scraped_waiting.unwrap_or(0.0) * per)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_is_one_until_told_and_follows_the_engine() {
        let l = Load::default();
        assert_eq!(l.kept(), 1.0, "nothing reported: the index is trusted");
        l.observe_kept(0.0);
        assert_eq!(l.kept(), 0.0, "everything evicted is a value, not none");
        for _ in 0..20 {
            l.observe_kept(1.0);
        }
        assert!(l.kept() > 0.95, "{}", l.kept());
        for _ in 0..3 {
            l.observe_kept(0.0);
        }
        assert!((0.4..0.6).contains(&l.kept()), "{}", l.kept());
    }

    #[test]
    fn recent_counts_two_windows_and_forgets_older_ones() {
        let r = Recent::default();
        let t = epoch() + WINDOW * 10;
        for _ in 0..3 {
            r.add(t);
        }
        assert_eq!(r.get(t), 3);
        r.add(t + WINDOW);
        assert_eq!(r.get(t + WINDOW), 4, "this window and the one before");
        assert_eq!(r.get(t + WINDOW * 2), 1, "only the one before");
        r.add(t + WINDOW * 2);
        assert_eq!(r.get(t + WINDOW * 2), 2, "the oldest window was reused");
        assert_eq!(r.get(t + WINDOW * 5), 0);
    }
}
