//! Cold prefills paced per replica (`routing.prefix_kv.cold_prefill_tokens`):
//! a streamed request whose prompt the replica will compute mostly afresh
//! waits at the gateway while the cold prefills this gateway already sent
//! there, still before their first tokens, and its own would exceed a step's
//! worth of tokens; requests whose prompts are cached there go straight on.
//!
//! Engines schedule their queue first come, first served (vLLM's default
//! policy, SGLang's `fcfs`), and a prefill takes the step's token budget
//! (`max_num_batched_tokens`, SGLang's `chunked_prefill_size`) ahead of
//! everything queued after it. Several cold prefills sent to one replica at
//! once queue there, and a request whose prompt is cached, which needs a few
//! dozen tokens of a step, waits behind all of them: in the matrix's
//! `many_keys` cold start (64 prompts of ~1,500 tokens, four replicas, 2,048
//! batched tokens a step) half of the 30 slowest requests were such cached
//! requests queued behind 3-7 cold prefills (docs/BENCHMARKS.md). Held here
//! instead, the cold prefills run in the same order one step's worth at a
//! time, and the cached requests join the next step. The engine's prefill
//! work is the same; what is lost is the moment between a first token and
//! the next cold prefill's arrival, when a step may run without one.
//!
//! A [`ColdGate`] is a fair (first come, first served) semaphore of tokens:
//! a prompt takes its uncached tokens, at most the whole budget (a prompt
//! over the budget runs alone), and gives them back at its first token or
//! when its attempt ends ([`crate::routing::placement::Placement`]).
//!
//! Where requests were held for that prompt's prefill
//! (`routing::prefilling`), its place passes to them at its first token and
//! comes back at their first tokens (or their attempts' ends): they go to
//! the engine at the moment the next cold prefill would, and an engine
//! takes both into one step, so that a request whose prompt is now cached,
//! a few dozen tokens of work, paid a whole cold prefill's step. On the
//! matrix's slow engine (`few_keys_slow`, steps of ~470 ms with a cold
//! prefill in them) such requests took 1,004 ms, the peer's same requests
//! 515 ms; with the place handed on, 542 ms (docs/benchmarks-log.md,
//! 2026-12-07).
//!
//! The gate stands aside on a replica whose engine says it is full
//! ([`pressed`]: its queue outlived a scrape, or it preempts), and a cold
//! prefill waiting there goes when that is seen. There a first token waits
//! for room in the engine (seats, KV blocks), not for the prefills ahead of
//! it, so a place in the gate would be held for the engine's queue time and
//! the gate would line cold prefills up behind it: on the matrix's
//! `sessions` cell (agent sessions on an overloaded fleet, histories and
//! tool results prefilled cold) cold prefills waited up to 40 s at the
//! gateway and the TTFT p99 went from 9.7 to 20.9 s (docs/BENCHMARKS.md).

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::upstream::pool::Replica;

/// Uncached tokens from which a prompt is a cold prefill for the gate: 256,
/// as a prefill worth waiting for (`prefilling::HOLD_MIN_BLOCKS` blocks of
/// 16 tokens). A request with fewer (a cached prompt's own tail, a short
/// chat) is never held.
pub(crate) const COLD_MIN_TOKENS: u32 = 256;

/// How often a cold prefill waiting in its replica's gate looks again at
/// whether the engine is [`pressed`]: a fiftieth of the default 1 s scrape
/// interval, a fifth of the tests' 100 ms (only waiting requests look).
const PRESSED_LOOK: Duration = Duration::from_millis(20);

/// The replica's engine says it is full: requests waited at its last two
/// scrapes, or it preempted since the one before (routing's `pressed`,
/// read from the last sample however old: a replica whose scrapes stopped
/// while it was full is left as without the gate). The gate does not apply
/// there.
pub(crate) fn pressed(replica: &Replica) -> bool {
    replica.load().is_some_and(|s| s.queued || s.preempting)
}

/// Returns once the replica's engine is [`pressed`], looking every
/// [`PRESSED_LOOK`] (for a cold prefill waiting in its gate, which then
/// goes).
pub(crate) async fn until_pressed(replica: &Replica) {
    let mut every = tokio::time::interval(PRESSED_LOOK);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        if pressed(replica) {
            return;
        }
    }
}

/// One replica's cold prefills under way from this gateway, in tokens.
pub(crate) struct ColdGate {
    tokens: Arc<Semaphore>,
    /// The budget its permits were sized to (a reload may change it).
    size: Mutex<u32>,
}

impl Default for ColdGate {
    fn default() -> Self {
        Self {
            tokens: Arc::new(Semaphore::new(0)),
            size: Mutex::new(0),
        }
    }
}

/// A cold prefill's place in the gate, given back when the last of its
/// holders drops it: the cold prefill until its first token, then the
/// requests held for that prefill until theirs
/// ([`crate::routing::prefilling`]).
pub(crate) type ColdSlot = Arc<OwnedSemaphorePermit>;

impl ColdGate {
    /// Waits until `uncached` tokens fit in `budget` beside the cold
    /// prefills under way (all of it for a prompt over the budget), after
    /// those that came first. `None` where the gate does not apply (a budget
    /// of 0, or fewer than [`COLD_MIN_TOKENS`]). Cancel-safe: a request that
    /// stops waiting takes nothing.
    pub(crate) async fn enter(&self, uncached: u32, budget: u32) -> Option<ColdSlot> {
        if budget == 0 || uncached < COLD_MIN_TOKENS {
            return None;
        }
        self.resize(budget);
        self.tokens
            .clone()
            .acquire_many_owned(uncached.min(budget))
            .await
            .ok()
            .map(Arc::new)
    }

    /// Whether `uncached` tokens would wait now (for the caller's count).
    pub(crate) fn would_wait(&self, uncached: u32, budget: u32) -> bool {
        if budget == 0 || uncached < COLD_MIN_TOKENS {
            return false;
        }
        self.resize(budget);
        self.tokens.available_permits() < uncached.min(budget) as usize
    }

    /// Sizes the semaphore to `budget` tokens (a reload that changed it:
    /// the difference is added, or forgotten as permits come back).
    fn resize(&self, budget: u32) {
        let mut size = self.size.lock();
        if *size == budget {
            return;
        }
        if budget > *size {
            self.tokens.add_permits((budget - *size) as usize);
        } else {
            // Only permits available now can be forgotten; the rest of the
            // shrink waits for the next call.
            let gone = self.tokens.forget_permits((*size - budget) as usize);
            *size -= u32::try_from(gone).unwrap_or(0);
            return;
        }
        *size = budget;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn cold_prefills_wait_in_order_for_the_budget_and_cached_ones_pass() {
        let gate = Arc::new(ColdGate::default());
        // The first of two 1,500-token prompts goes; the second waits.
        assert!(!gate.would_wait(1500, 2048));
        let first = gate.enter(1500, 2048).await.expect("a cold prefill");
        assert!(gate.would_wait(1500, 2048));
        let g = gate.clone();
        let second = tokio::spawn(async move { g.enter(1500, 2048).await });
        // A cached request's tail is never held.
        assert!(gate.enter(40, 2048).await.is_none());
        assert!(!gate.would_wait(40, 2048));
        // Off: nothing is held.
        assert!(gate.enter(1500, 0).await.is_none());
        tokio::task::yield_now().await;
        assert!(!second.is_finished());
        // The first's first token lets the second go.
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), second)
            .await
            .expect("released")
            .expect("joined");
        assert!(second.is_some());
    }

    #[tokio::test]
    async fn prompts_that_fit_together_go_together_and_one_over_the_budget_goes_alone() {
        let gate = ColdGate::default();
        let a = gate.enter(600, 2048).await.expect("a");
        let b = gate.enter(600, 2048).await.expect("b");
        let c = gate.enter(600, 2048).await.expect("c");
        // 1,800 under way: a fourth of 600 waits.
        assert!(gate.would_wait(600, 2048));
        drop((a, b, c));
        // One over the budget takes all of it, and goes when nothing is under way.
        let big = gate.enter(5000, 2048).await.expect("alone");
        assert!(gate.would_wait(300, 2048));
        drop(big);
        assert!(!gate.would_wait(300, 2048));
    }

    #[tokio::test]
    async fn a_reload_resizes_the_budget() {
        let gate = ColdGate::default();
        drop(gate.enter(1000, 2048).await);
        // Grown: 4,096 tokens fit two 2,000-token prompts.
        let a = gate.enter(2000, 4096).await.expect("a");
        assert!(!gate.would_wait(2000, 4096));
        drop(a);
        // Shrunk back: one at a time.
        let a = gate.enter(2000, 2048).await.expect("a");
        assert!(gate.would_wait(2000, 2048));
        drop(a);
    }
}
