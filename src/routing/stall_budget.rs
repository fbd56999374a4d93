//! A decode replica's allowance of stalled inter-token gaps, for the
//! disaggregated plan's local prefills under running streams
//! (`routing.disaggregation.local_stall_share`, `api::disagg`).
//!
//! A step that carries a prefill is longer for every stream the replica
//! decodes in it: each such stream gets one long gap per prefill chunk. A
//! stream's inter-token p99 is untouched while fewer than 1% of its gaps are
//! long, so a gateway may cause stalled gaps up to a share of the gaps it
//! relays from that replica. Counted in units every engine has (gaps: the
//! output events this gateway relayed; the streams and the engine's prefill
//! chunk), not milliseconds that suit one engine.
//!
//! Both sums fade by `e` over [`WINDOW`]: the allowance follows the
//! replica's recent traffic, and a burst of local prefills cannot spend
//! what was earned long ago. Each gateway keeps its own ledger from what it
//! relays and what it decides (no shared state): it earns by the gaps it
//! relays and charges every stream the engine decodes, its own and other
//! gateways', as a look at the engine shows them when it decides
//! (`api::disagg`), so several gateways' stalls add up to at most the
//! share of all the gaps they relay. (Counted by the last scrape instead,
//! the streams another gateway started since went uncharged: three
//! gateways, 22-42 streams a run stalled over 100 ms against 8-25 with the
//! look; docs/benchmarks-log.md.)

use std::time::{Duration, Instant};

/// How long the ledger remembers (both sums fade by `e` over it): long
/// enough to hold hundreds of gaps at a few streams, short enough that the
/// allowance follows a change of load within a minute.
pub(crate) const WINDOW: Duration = Duration::from_secs(30);

#[derive(Debug, Default)]
pub(crate) struct StallLedger {
    /// Inter-token gaps relayed from the replica (faded).
    gaps: f64,
    /// Stalled gaps the local prefills decided here are expected to cause
    /// (faded).
    stalled: f64,
    at: Option<Instant>,
}

impl StallLedger {
    fn fade(&mut self, now: Instant) {
        if let Some(at) = self.at {
            let dt = now.saturating_duration_since(at).as_secs_f64();
            let keep = (-dt / WINDOW.as_secs_f64()).exp();
            self.gaps *= keep;
            self.stalled *= keep;
        }
        // (Decisions on other threads may read the clock a little earlier.)
        self.at = Some(self.at.map_or(now, |at| at.max(now)));
    }

    /// A stream from the replica ended with `gaps` inter-token gaps.
    pub(crate) fn relayed(&mut self, gaps: u32, now: Instant) {
        self.fade(now);
        self.gaps += f64::from(gaps);
    }

    /// Stalled gaps caused beyond what was spent (a local prefill larger
    /// than predicted: its replica had evicted part of what routing's
    /// index listed), owed whatever the allowance.
    pub(crate) fn owe(&mut self, stalls: f64, now: Instant) {
        self.fade(now);
        self.stalled += stalls;
    }

    /// Give back `stalls` spent at `spent` for a local prefill the engine
    /// never ran (its request was refused or never reached it): what is
    /// left of them, faded as the ledger's sum since.
    pub(crate) fn refund(&mut self, stalls: f64, spent: Instant, now: Instant) {
        self.fade(now);
        let dt = now.saturating_duration_since(spent).as_secs_f64();
        let left = stalls * (-dt / WINDOW.as_secs_f64()).exp();
        self.stalled = (self.stalled - left).max(0.0);
    }

    /// Whether `stalls` expected stalled gaps would keep the ledger's
    /// stalls within `share` of its gaps.
    pub(crate) fn fits(&mut self, stalls: f64, share: f64, now: Instant) -> bool {
        self.fade(now);
        self.stalled + stalls <= share * self.gaps
    }

    /// Spend `stalls` expected stalled gaps if they [fit](Self::fits);
    /// whether they were spent.
    pub(crate) fn spend(&mut self, stalls: f64, share: f64, now: Instant) -> bool {
        if !self.fits(stalls, share, now) {
            return false;
        }
        self.stalled += stalls;
        true
    }
}

pub use crate::telemetry::record::StallCharge;

impl StallCharge {
    /// The stalled gaps spent.
    pub(crate) fn stalls(&self) -> f64 {
        stalls(self.streams, self.uncached, self.chunk_tokens)
    }

    /// The stalled gaps caused beyond those spent, had the engine
    /// `uncached` tokens to prefill (none when it had no more than
    /// predicted).
    pub(crate) fn shortfall(&self, uncached: u32) -> f64 {
        let actual = stalls(self.streams, uncached, self.chunk_tokens);
        (actual - self.stalls()).max(0.0)
    }
}

/// The stalled gaps a prefill of `uncached` tokens causes on a replica
/// decoding `streams` streams: one per stream for each of the engine's
/// prefill chunks of `chunk_tokens` (none when nothing is decoded there).
pub(crate) fn stalls(streams: u32, uncached: u32, chunk_tokens: u32) -> f64 {
    f64::from(streams) * f64::from(uncached.div_ceil(chunk_tokens.max(1)).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ledger_spends_only_its_share_of_the_gaps_relayed() {
        let t0 = Instant::now();
        let mut l = StallLedger::default();
        assert!(
            !l.spend(1.0, 0.005, t0),
            "nothing relayed, nothing to spend"
        );
        assert!(
            l.spend(0.0, 0.005, t0),
            "a prefill stalling no stream is free"
        );
        l.relayed(1_000, t0);
        // 0.5% of 1,000 gaps: five stalled gaps.
        assert!(l.spend(3.0, 0.005, t0));
        assert!(!l.spend(3.0, 0.005, t0), "3 + 3 over 5");
        assert!(l.spend(2.0, 0.005, t0));
        assert!(!l.spend(1.0, 0.005, t0), "spent");
        // More gaps relayed earn more.
        l.relayed(1_000, t0);
        assert!(l.spend(5.0, 0.005, t0));
    }

    #[test]
    fn what_a_ledger_holds_fades_with_time() {
        let t0 = Instant::now();
        let mut l = StallLedger::default();
        l.relayed(10_000, t0);
        assert!(l.spend(50.0, 0.005, t0));
        // Both sums fade alike: the share stays spent...
        assert!(!l.spend(1.0, 0.005, t0 + WINDOW));
        // ...and new traffic earns at its full weight against faded stalls.
        l.relayed(1_000, t0 + WINDOW);
        let (gaps, stalled) = (
            10_000.0 / std::f64::consts::E + 1_000.0,
            50.0 / std::f64::consts::E,
        );
        assert!((l.gaps - gaps).abs() < 1e-6 && (l.stalled - stalled).abs() < 1e-6);
        assert!(l.spend(4.9, 0.005, t0 + WINDOW));
        // A clock read a little earlier on another thread fades nothing back.
        l.relayed(0, t0);
        assert!((l.gaps - gaps).abs() < 1e-6);
    }

    #[test]
    fn a_prefill_larger_than_predicted_owes_its_extra_chunks() {
        let c = StallCharge {
            streams: 2,
            uncached: 200,
            chunk_tokens: 2048,
            spent_at: Instant::now(),
        };
        assert_eq!(c.stalls(), 2.0);
        assert_eq!(c.shortfall(150), 0.0, "fewer: nothing back, nothing owed");
        assert_eq!(c.shortfall(2048), 0.0, "the same one chunk");
        assert_eq!(
            c.shortfall(6000),
            4.0,
            "three chunks for two streams: two more each"
        );
        let t0 = Instant::now();
        let mut l = StallLedger::default();
        l.relayed(1_000, t0);
        l.owe(c.shortfall(6000), t0);
        assert!(!l.spend(2.0, 0.005, t0), "4 owed of 5: 2 more do not fit");
        assert!(l.spend(1.0, 0.005, t0));
    }

    #[test]
    fn a_refund_gives_back_what_was_spent_and_no_more() {
        let t0 = Instant::now();
        let mut l = StallLedger::default();
        l.relayed(1_000, t0);
        assert!(l.spend(3.0, 0.005, t0));
        assert!(!l.spend(3.0, 0.005, t0));
        l.refund(3.0, t0, t0);
        assert!(l.spend(5.0, 0.005, t0), "all five back");
        l.refund(9.0, t0, t0);
        assert!(!l.spend(5.1, 0.005, t0), "not more than was spent");
        // Later, what is left of a charge: the others' stay spent.
        let mut l = StallLedger::default();
        l.relayed(2_000, t0);
        assert!(l.spend(2.0, 0.005, t0));
        assert!(l.spend(2.0, 0.005, t0 + WINDOW));
        // At t0 + WINDOW: 2/e + 2 spent, 10/e earned; the first's 2/e back.
        l.refund(2.0, t0, t0 + WINDOW);
        assert!((l.stalled - 2.0).abs() < 1e-9, "{}", l.stalled);
    }

    #[test]
    fn a_prefill_stalls_each_stream_once_a_chunk() {
        assert_eq!(stalls(0, 10_000, 2048), 0.0);
        assert_eq!(stalls(3, 200, 2048), 3.0);
        assert_eq!(stalls(3, 2048, 2048), 3.0);
        assert_eq!(stalls(3, 2049, 2048), 6.0);
        assert_eq!(
            stalls(2, 0, 2048),
            2.0,
            "a step still carries the prompt's last token"
        );
        assert_eq!(stalls(1, 5, 0), 5.0, "a zero chunk reads as one token");
    }
}
