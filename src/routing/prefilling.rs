//! Prompts this gateway has in their first prefill on a replica, for the
//! requests that would share them (`routing.prefix_kv.hold_for_prefill`).
//!
//! SGLang inserts a prompt into its radix tree when the forward pass that
//! computed it ends; a second request for the same prompt admitted before
//! that computes the whole prompt again (its default `fcfs` policy does not
//! look for duplicates in the batch). vLLM V1 caches a block when it
//! allocates it, so its second request shares the one prefill. On an engine
//! of the first kind, a request whose prefix this gateway sent to the same
//! replica moments ago, still before its first token, is held until that
//! first token (then the prefix is cached there and it prefills only its
//! own tail), or until that request's attempt ends without one, or its own
//! first-token deadline. In a cold start (16 prompts of 1,500 tokens on 4
//! replicas) those are the requests queued behind their own prompt's
//! prefill, each prefilling it again: docs/BENCHMARKS.md, "Prefix caching
//! as vLLM caches it".
//!
//! A prefill is known by its first block not cached at routing (the
//! prompt's block hashes chain, so that block names the whole prompt up to
//! it); a later request is held for it when at least [`HOLD_MIN_BLOCKS`]
//! of the blocks routing counts cached for it start at such a block and
//! cover all but [`HOLD_MIN_BLOCKS`] of that prefill, so that the tokens it
//! would prefill again are worth a wait of at most that prefill. Only
//! streamed requests mark their prefill: the gateway sees their first token
//! (a non-streamed answer's first token is its end); any request may wait.
//! A prefill whose attempt ends without a first token (failed, cut, its
//! client gone) releases its waiters, and the first streamed one to go marks
//! the prompt's prefill again ([`Prefilling::retake`]); the others wait for
//! that one where it covers their prompt as the first did.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

use parking_lot::Mutex;
use tokio::sync::Notify;

use super::cold_gate::ColdSlot;

/// Blocks (16 tokens each by default) a request must be counted cached in
/// a prefill still under way for it to wait for that prefill: 256 tokens,
/// whose prefill takes several engine steps' worth of compute on a GPU and
/// more than the few milliseconds a hold adds past the first token.
pub(crate) const HOLD_MIN_BLOCKS: usize = 16;

/// Where a request may wait for another gateway's prefill of a prompt
/// (`hashes`, computed from its first block: a new home's cold prefill,
/// `routing::shared_table`): the block, by index and hash, that a prompt
/// must share with it for the wait to pay by the rule of
/// [`Prefilling::ahead_of`] (at least [`HOLD_MIN_BLOCKS`] blocks, and all
/// but [`HOLD_MIN_BLOCKS`] of that prefill). `None`: too short to be worth
/// a wait.
pub(crate) fn reach(hashes: &[u64]) -> Option<(usize, u64)> {
    if hashes.len() < HOLD_MIN_BLOCKS {
        return None;
    }
    let i = hashes
        .len()
        .saturating_sub(HOLD_MIN_BLOCKS)
        .max(HOLD_MIN_BLOCKS)
        - 1;
    Some((i, hashes[i]))
}

/// The prefills under way on one replica, by their first block.
#[derive(Default)]
pub(crate) struct Prefilling {
    under_way: Mutex<HashMap<u64, Arc<Prefill>>>,
}

/// One prompt's prefill under way.
#[derive(Default)]
pub(crate) struct Prefill {
    /// [`RUNNING`], [`PREFILLED`] or [`ENDED`].
    state: AtomicU8,
    done: Notify,
    /// The blocks it prefills.
    span: usize,
    /// Its place in the replica's cold-prefill gate, left here at its first
    /// token for the requests held for it ([`Ahead::gate`]); given back
    /// when the last of them has taken it or stopped waiting (this is
    /// dropped with the last [`Ahead`]).
    gate: Mutex<Option<ColdSlot>>,
}

const RUNNING: u8 = 0;
const PREFILLED: u8 = 1;
const ENDED: u8 = 2;

/// A prefill under way that a request would compute again, from block
/// `at` of its prompt ([`Prefilling::ahead_of`]).
pub(crate) struct Ahead {
    at: usize,
    prefill: Arc<Prefill>,
}

impl Ahead {
    /// The block of the request's prompt where the prefill starts.
    pub(crate) fn at(&self) -> usize {
        self.at
    }

    /// Waits until the prefill's first token or its end, at most until
    /// `deadline`.
    pub(crate) async fn wait(&self, deadline: tokio::time::Instant) -> HoldOutcome {
        self.prefill.wait(deadline).await
    }

    /// The prefill's place in its replica's cold-prefill gate, for a held
    /// request that goes at its first token to keep until its own: the
    /// next cold prefill there waits for that, not for the same engine
    /// step (`routing::cold_gate`).
    pub(crate) fn gate(&self) -> Option<ColdSlot> {
        self.prefill.gate.lock().clone()
    }
}

/// How a hold ended (`sluice_routing_prefill_holds_total{outcome}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HoldOutcome {
    /// The prefill's first token came: the prompt is cached there.
    Prefilled,
    /// Its attempt ended without a first token (failed, cut, retried).
    Ended,
    /// The held request's own first-token deadline came first.
    Deadline,
}

impl HoldOutcome {
    /// Its label, one of `telemetry::metrics::PREFILL_HOLD_OUTCOMES`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            HoldOutcome::Prefilled => "prefilled",
            HoldOutcome::Ended => "ended",
            HoldOutcome::Deadline => "deadline",
        }
    }
}

/// A prefill marked under way, cleared once: at its first token
/// ([`PrefillMark::prefilled`]) or when dropped (its attempt ended).
pub(crate) struct PrefillMark {
    on: Arc<Prefilling>,
    key: u64,
    prefill: Arc<Prefill>,
}

impl Prefilling {
    /// Marks the prefill of a prompt (`hashes`, of which routing counted the
    /// first `cached` blocks cached here) under way, unless it prefills
    /// fewer than [`HOLD_MIN_BLOCKS`] blocks or the same prefill is already
    /// marked.
    pub(crate) fn begin(self: &Arc<Self>, hashes: &[u64], cached: usize) -> Option<PrefillMark> {
        if hashes.len().saturating_sub(cached) < HOLD_MIN_BLOCKS {
            return None;
        }
        let key = hashes[cached];
        let mut map = self.under_way.lock();
        let std::collections::hash_map::Entry::Vacant(slot) = map.entry(key) else {
            return None;
        };
        let prefill = Arc::new(Prefill {
            span: hashes.len() - cached,
            ..Prefill::default()
        });
        slot.insert(prefill.clone());
        Some(PrefillMark {
            on: self.clone(),
            key,
            prefill,
        })
    }

    /// The prefill under way here that a request for `hashes`, counted
    /// cached here up to block `cached`, would otherwise compute again
    /// (and where it starts among `hashes`): the
    /// earliest marked block among its cached ones, with at least
    /// [`HOLD_MIN_BLOCKS`] cached blocks from there on, and all but
    /// [`HOLD_MIN_BLOCKS`] of what that prefill computes (engines cache a
    /// long prompt chunk by chunk: a request sharing only the start of a
    /// 32k-token prefill finds that start cached long before its first
    /// token).
    pub(crate) fn ahead_of(&self, hashes: &[u64], cached: usize) -> Option<Ahead> {
        let cached = cached.min(hashes.len());
        if cached < HOLD_MIN_BLOCKS {
            return None;
        }
        let map = self.under_way.lock();
        if map.is_empty() {
            return None;
        }
        let (at, prefill) = hashes[..=cached - HOLD_MIN_BLOCKS]
            .iter()
            .enumerate()
            .find_map(|(i, h)| map.get(h).map(|p| (i, p)))?;
        (cached - at + HOLD_MIN_BLOCKS >= prefill.span).then(|| Ahead {
            at,
            prefill: prefill.clone(),
        })
    }

    /// Marks again, for a request that was waiting for it, a prefill
    /// `ahead` whose attempt ended without a first token: the prompt is
    /// not cached after all, and this request computes it from the block
    /// where that prefill started. `None` where another waiter marked it
    /// first (wait for that one: [`Prefilling::ahead_of`]).
    pub(crate) fn retake(self: &Arc<Self>, hashes: &[u64], ahead: &Ahead) -> Option<PrefillMark> {
        self.begin(hashes, ahead.at)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.under_way.lock().len()
    }
}

impl Prefill {
    fn state(&self) -> Option<HoldOutcome> {
        match self.state.load(Relaxed) {
            PREFILLED => Some(HoldOutcome::Prefilled),
            ENDED => Some(HoldOutcome::Ended),
            _ => None,
        }
    }

    async fn wait(&self, deadline: tokio::time::Instant) -> HoldOutcome {
        let done = self.done.notified();
        tokio::pin!(done);
        // Registered before the state is read: a clearing between the two
        // still wakes it.
        done.as_mut().enable();
        if let Some(o) = self.state() {
            return o;
        }
        match tokio::time::timeout_at(deadline, done).await {
            Ok(()) => self.state().unwrap_or(HoldOutcome::Ended),
            Err(_) => HoldOutcome::Deadline,
        }
    }
}

impl PrefillMark {
    /// The prefill's first token came; `gate`, its place in the replica's
    /// cold-prefill gate, passes to the requests held for it
    /// ([`Ahead::gate`]).
    pub(crate) fn prefilled(self, gate: Option<ColdSlot>) {
        *self.prefill.gate.lock() = gate;
        self.clear(PREFILLED);
    }

    fn clear(&self, to: u8) {
        {
            // The state changes under the lock: a waiter that reads it ended
            // finds it gone from the map (else it could take it up again).
            let mut map = self.on.under_way.lock();
            if self
                .prefill
                .state
                .compare_exchange(RUNNING, to, Relaxed, Relaxed)
                .is_err()
            {
                return;
            }
            if map
                .get(&self.key)
                .is_some_and(|p| Arc::ptr_eq(p, &self.prefill))
            {
                map.remove(&self.key);
            }
        }
        self.prefill.done.notify_waiters();
    }
}

impl Drop for PrefillMark {
    fn drop(&mut self) {
        self.clear(ENDED);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn memory() -> Arc<Prefilling> {
        Arc::new(Prefilling::default())
    }

    fn prompt(n: u64) -> Vec<u64> {
        (1..=n).collect()
    }

    #[test]
    fn a_request_counted_cached_in_a_prefill_under_way_finds_it() {
        let m = memory();
        let first = prompt(100);
        let mark = m.begin(&first, 0).expect("100 blocks to prefill");
        // The same prompt, counted cached (the index holds the first's blocks).
        assert!(m.ahead_of(&first, 100).is_some());
        // All but HOLD_MIN_BLOCKS of it (another question after the same
        // document): worth the wait.
        assert!(m.ahead_of(&first, 100 - HOLD_MIN_BLOCKS).is_some());
        // Only its start: engines cache a prompt chunk by chunk, and that
        // start is cached long before the whole prompt's first token.
        assert!(m.ahead_of(&first, 100 - HOLD_MIN_BLOCKS - 1).is_none());
        assert!(m.ahead_of(&first, HOLD_MIN_BLOCKS).is_none());
        // A prompt whose cached blocks were there before this prefill began:
        // the prefill under way starts at block 100 of a longer prompt.
        let second = prompt(120);
        drop(mark);
        let _tail = m.begin(&second, 100).expect("20 blocks to prefill");
        assert!(
            m.ahead_of(&second, 100).is_none(),
            "its 100 were cached before"
        );
        assert!(m.ahead_of(&second, 120).is_some());
    }

    /// Another gateway's prefill is waited for by the same rule as this
    /// gateway's own: a prompt sharing all but [`HOLD_MIN_BLOCKS`] of it,
    /// and at least [`HOLD_MIN_BLOCKS`].
    #[test]
    fn another_gateways_prefill_is_reached_as_this_gateways_own() {
        assert_eq!(reach(&prompt(15)), None);
        for n in [16, 20, 32, 33, 100] {
            let p = prompt(n);
            let (i, h) = reach(&p).unwrap();
            assert_eq!(h, p[i]);
            let m = memory();
            let _mark = m.begin(&p, 0).unwrap();
            // Sharing up to the reach: waited for here too; one block less: not.
            assert!(m.ahead_of(&p, i + 1).is_some(), "{n}: {i}");
            assert!(m.ahead_of(&p, i).is_none(), "{n}: {i}");
        }
    }

    #[test]
    fn a_short_prefill_or_one_already_under_way_is_not_marked_twice() {
        let m = memory();
        assert!(m.begin(&prompt(20), 5).is_none());
        let p = prompt(40);
        let first = m.begin(&p, 0).expect("marked");
        assert!(m.begin(&p, 0).is_none());
        assert_eq!(m.len(), 1);
        first.prefilled(None);
        assert_eq!(m.len(), 0);
        assert!(m.begin(&p, 0).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_hold_ends_at_the_first_token_at_the_attempts_end_or_at_its_deadline() {
        let m = memory();
        let p = prompt(64);
        let far = tokio::time::Instant::now() + Duration::from_secs(30);

        let mark = m.begin(&p, 0).unwrap();
        let held = m.ahead_of(&p, 64).unwrap();
        let waiting = tokio::spawn(async move { held.wait(far).await });
        tokio::task::yield_now().await;
        mark.prefilled(None);
        assert_eq!(waiting.await.unwrap(), HoldOutcome::Prefilled);

        let mark = m.begin(&p, 0).unwrap();
        let held = m.ahead_of(&p, 64).unwrap();
        drop(mark);
        // Cleared before the wait began: it does not wait.
        assert_eq!(held.wait(far).await, HoldOutcome::Ended);

        let _mark = m.begin(&p, 0).unwrap();
        let held = m.ahead_of(&p, 64).unwrap();
        let soon = tokio::time::Instant::now() + Duration::from_millis(50);
        assert_eq!(held.wait(soon).await, HoldOutcome::Deadline);
    }

    /// A prefill's place in the cold-prefill gate comes back at its first
    /// token where nothing was held for it; else the requests held for it
    /// take it and it comes back when the last has dropped it, or stopped
    /// waiting.
    #[tokio::test]
    async fn a_prefills_place_in_the_gate_passes_to_the_requests_held_for_it() {
        use crate::routing::cold_gate::ColdGate;
        let gate = ColdGate::default();
        let m = memory();
        let p = prompt(64);
        let far = tokio::time::Instant::now() + Duration::from_secs(30);
        let full = |gate: &ColdGate| gate.would_wait(1024, 1024);

        let mark = m.begin(&p, 0).unwrap();
        mark.prefilled(gate.enter(1024, 1024).await);
        assert!(!full(&gate), "nothing held: given back");

        let mark = m.begin(&p, 0).unwrap();
        let (a, b) = (m.ahead_of(&p, 64).unwrap(), m.ahead_of(&p, 64).unwrap());
        mark.prefilled(gate.enter(1024, 1024).await);
        assert_eq!(a.wait(far).await, HoldOutcome::Prefilled);
        let share = a.gate().expect("the held request's share");
        drop(a);
        assert!(full(&gate), "kept for the other held request");
        drop(b);
        assert!(full(&gate), "kept by the one that took it");
        drop(share);
        assert!(!full(&gate), "given back with the last share");
    }

    #[test]
    fn a_prefill_that_ended_without_a_first_token_is_retaken_by_one_waiter() {
        let m = memory();
        // 20 blocks cached before, 80 under way from block 20.
        let p = prompt(100);
        let mark = m.begin(&p, 20).unwrap();
        let (b, c) = (m.ahead_of(&p, 100).unwrap(), m.ahead_of(&p, 100).unwrap());
        assert_eq!((b.at, c.at), (20, 20));
        // While it runs no waiter takes it.
        assert!(m.retake(&p, &b).is_none());
        drop(mark);
        let again = m.retake(&p, &b).expect("the first waiter to go marks it");
        assert!(m.retake(&p, &c).is_none(), "one waiter computes it");
        let next = m.ahead_of(&p, 100).expect("the others wait for it");
        assert_eq!(next.at, 20);
        assert!(Arc::ptr_eq(&next.prefill, &again.prefill));
        assert_eq!(again.prefill.span, 80);
    }
}
