//! Whether this gateway is the only one sending to its replicas, told by
//! their engines' own counts (`routing.prefix_kv.session_placement: auto`).
//!
//! Each scrape of a replica whose engine reports the requests it runs and
//! holds (vLLM, SGLang, llama.cpp and TGI all do) is set against this
//! gateway's requests in flight there. An engine's count runs behind this
//! gateway's, never ahead of it: a request leaves its batch before its
//! stream ends here, and one sent since the engine rendered its metrics is
//! counted here only. So requests beyond ours are another sender's: another
//! gateway behind the same balancer, or clients going to the engine
//! directly. A gateway is alone after enough scrapes of busy engines with
//! its own requests and none beyond them, five minutes or more after it
//! last saw another sender's; one sighting ends it at once.
//!
//! Where it errs, it errs towards company (placement by key): SGLang
//! updates its running count at its log interval, so a count left over from
//! a burst may read as another sender's; behind the endpoint picker on a
//! disaggregated fleet the sidecar's prefill requests are nobody's here.
//!
//! What it decides: a new session may be placed by its replicas' pressure
//! (`first_open`) only where no other gateway would look for it by its key
//! alone. A gateway behind a balancer with others sees their requests at the
//! first scrape of a busy replica, and pressure only differs from the key's
//! order on busy replicas: where it mistakes company for solitude (a trickle
//! of traffic), both placements send a session to the same replica.

use crate::telemetry::metrics::epoch;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Scrapes of a busy engine with only this gateway's requests, since the
/// last sighting, before it counts itself alone (30: a few seconds of
/// traffic on a handful of replicas scraped every second).
const QUIET_SCRAPES: u32 = 30;

/// Requests an engine holds for its scrape to say anything of solitude: at
/// 8 and more, another gateway sending an equal share (half of them, or
/// more with more gateways) is past `beyond_ours` but by chance. Under it a
/// scrape is no evidence either way (two gateways holding a request or two
/// each would not see each other), and an idle fleet is where placement by
/// pressure and by key agree.
const BUSY: u32 = 8;

/// How long after another sender was last seen this gateway still counts
/// it (a balancer that sends a second gateway work in bursts).
const FORGET: Duration = Duration::from_secs(300);

/// Requests at an engine beyond this gateway's that count as another
/// sender's: at least 2 and an eighth of the engine's count. (A request this
/// gateway gave up on, a timeout or a client gone, may run on for an engine
/// step after it stopped counting it here.)
fn beyond_ours(engine: u32) -> u32 {
    (engine / 8).max(2)
}

/// See the module docs. One per gateway process, shared by its replicas.
#[derive(Debug, Default)]
pub struct Company {
    /// When a scrape last showed another sender (nanoseconds since
    /// [`epoch`], at least 1; 0: never).
    seen: AtomicU64,
    /// Scrapes since then with this gateway's requests at the engine and no
    /// other sender's.
    quiet: AtomicU32,
}

impl Company {
    /// A scrape of an engine holding `engine` requests (running and
    /// waiting) while this gateway had `ours` there.
    pub(crate) fn note(&self, engine: u32, ours: u32, at: Instant) {
        if engine.saturating_sub(ours) >= beyond_ours(engine) {
            let ns = at.saturating_duration_since(epoch()).as_nanos();
            // (A slow scrape's older sighting never overwrites a newer one.)
            self.seen
                .fetch_max(u64::try_from(ns).unwrap_or(u64::MAX).max(1), Relaxed);
            self.quiet.store(0, Relaxed);
        } else if engine >= BUSY {
            let _ = self
                .quiet
                .fetch_update(Relaxed, Relaxed, |q| Some(q.saturating_add(1)));
        }
    }

    /// This gateway is the only sender its replicas' engines have shown
    /// lately (see the module docs).
    pub fn alone(&self, now: Instant) -> bool {
        if self.quiet.load(Relaxed) < QUIET_SCRAPES {
            return false;
        }
        match self.seen.load(Relaxed) {
            0 => true,
            ns => now.saturating_duration_since(epoch()) >= Duration::from_nanos(ns) + FORGET,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quiet_for(c: &Company, n: u32, at: Instant) {
        for _ in 0..n {
            c.note(BUSY, BUSY, at);
        }
    }

    #[test]
    fn alone_only_after_scrapes_with_its_own_requests_and_nobody_elses() {
        let c = Company::default();
        let now = Instant::now();
        assert!(!c.alone(now), "unknown at start");
        // Idle or lightly loaded engines say nothing either way (another
        // gateway's request or two would not show).
        for _ in 0..100 {
            c.note(0, 0, now);
            c.note(BUSY - 1, BUSY - 1, now);
        }
        assert!(!c.alone(now));
        quiet_for(&c, QUIET_SCRAPES - 1, now);
        assert!(!c.alone(now));
        // One request beyond ours (a stream given up here, still in the
        // engine's batch) is not another sender.
        c.note(11, 10, now);
        assert!(c.alone(now));
    }

    #[test]
    fn one_sighting_ends_it_and_it_returns_only_after_five_quiet_minutes() {
        let c = Company::default();
        let t0 = Instant::now();
        quiet_for(&c, QUIET_SCRAPES, t0);
        assert!(c.alone(t0));
        // Another gateway's 3 requests beside our 9.
        c.note(12, 9, t0);
        assert!(!c.alone(t0));
        quiet_for(&c, 3 * QUIET_SCRAPES, t0);
        assert!(!c.alone(t0 + FORGET - Duration::from_secs(1)));
        assert!(c.alone(t0 + FORGET));
        // At 64 requests an engine step's worth of stragglers (up to 7) is
        // still ours; 8 is another sender's.
        c.note(64, 57, t0 + FORGET);
        assert!(c.alone(t0 + FORGET));
        c.note(64, 56, t0 + FORGET);
        assert!(!c.alone(t0 + FORGET));
    }
}
