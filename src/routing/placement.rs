//! A [`Placement`]: the accounting of one request on the replica it was
//! sent to. It adds to the replica's backlog when made, takes it back at the
//! first token or when dropped, calibrates the replica's rate from the first
//! token's wait, and at the end reports the cached tokens routing predicted
//! against those the engine reported (the closed loop: an index that
//! promised more than the engine had is corrected).

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use super::affinity::ReplicaMemory;
use super::cold_gate::ColdSlot;
use super::prefilling::PrefillMark;
use super::shared_table::ColdMark;

/// One request's accounting on the replica it was sent to.
pub(crate) struct Placement {
    memory: Arc<ReplicaMemory>,
    /// Uncached prompt tokens it adds to the backlog until its first token.
    uncached: u64,
    /// The backlog when it was sent, its own tokens included.
    ahead: u64,
    /// Cached tokens routing expected the engine to have.
    pub(crate) predicted_cached: u32,
    /// The prompt's block hashes and how many blocks routing counted cached
    /// (to correct the index if the engine had fewer).
    hashes: Arc<[u64]>,
    matched_blocks: usize,
    tokens_per_block: u32,
    started: bool,
    /// The first token's wait, kept until the engine says what it had
    /// cached (see [`Placement::first_token`]).
    waited: Option<Duration>,
    /// The session whose turn this is, counted on the replica until the
    /// placement ends ([`super::affinity::SessionsHere`]).
    session: Option<u64>,
    /// A turn of a session under way ([`Placement::continuing`]).
    continuing: bool,
    /// A new home's cold prefill, counted by the shared table until the
    /// first token ([`Placement::cold`]).
    cold: Option<Arc<ColdMark>>,
    /// Its prompt's prefill marked under way here until the first token
    /// ([`Placement::mark_prefilling`]).
    prefilling: Option<PrefillMark>,
    /// Its cold prefill's place in the replica's gate, given back at the
    /// first token ([`Placement::gated`]), or passed on there to the
    /// requests held for its prefill; or such a request's share of that
    /// place ([`Placement::sharing_gate`]).
    gate: Option<ColdSlot>,
    /// How long it waited in that gate before it was sent: part of the wait
    /// its placement predicted, so counted in the rate's sample.
    gate_wait: Duration,
}

impl Placement {
    pub(crate) fn new(
        memory: Arc<ReplicaMemory>,
        uncached: u32,
        predicted_cached: u32,
        hashes: Arc<[u64]>,
        matched_blocks: usize,
        tokens_per_block: u32,
    ) -> Self {
        let uncached = u64::from(uncached.max(1));
        let ahead = memory.load.backlog.fetch_add(uncached, Relaxed) + uncached;
        memory.load.per_request.observe(uncached as f64);
        Self {
            memory,
            uncached,
            ahead,
            predicted_cached,
            hashes,
            matched_blocks,
            tokens_per_block,
            started: false,
            waited: None,
            session: None,
            continuing: false,
            cold: None,
            prefilling: None,
            gate: None,
            gate_wait: Duration::ZERO,
        }
    }

    /// The request waited `waited` for its cold prefill's place in the
    /// replica's gate (`routing::cold_gate`), which it holds until its first
    /// token.
    pub(crate) fn gated(&mut self, slot: Option<ColdSlot>, waited: Duration) {
        self.gate = slot;
        self.gate_wait = waited;
    }

    /// The shared table counts this prompt's cold prefill on the replica
    /// (its prefix's new home) until its first token, or until it ends
    /// without one.
    pub(crate) fn cold(mut self, mark: Option<Arc<ColdMark>>) -> Self {
        self.cold = mark;
        self
    }

    /// Requests for the same prompt sent here before its first token may
    /// wait for it ([`super::prefilling`]); dropped without one, they go.
    /// `retaken`: the mark of a prefill this request waited for, whose
    /// attempt ended without a first token (routing counted it cached).
    pub(crate) fn mark_prefilling(&mut self, retaken: Option<PrefillMark>) {
        self.prefilling = retaken.or_else(|| {
            self.memory
                .prefilling
                .begin(&self.hashes, self.matched_blocks)
        });
    }

    /// The attempt ended without a first token: those waiting for its
    /// prefill go (`ended`), before any retry is routed.
    pub(crate) fn end_prefilling(&mut self) {
        drop(self.prefilling.take());
        drop(self.gate.take());
    }

    /// A request held for another's prefill (`routing::prefilling`) keeps
    /// that prefill's place in the replica's cold-prefill gate until its own
    /// first token (`routing::cold_gate`), or until its attempt ends.
    pub(crate) fn sharing_gate(&mut self, slot: ColdSlot) {
        self.gate.get_or_insert(slot);
    }

    fn prefilled(&mut self) {
        let gate = self.gate.take();
        if let Some(mark) = self.cold.take() {
            mark.prefilled();
        }
        // Its place in the gate passes to the requests held for its prefill.
        match self.prefilling.take() {
            Some(mark) => mark.prefilled(gate),
            None => drop(gate),
        }
    }

    /// Counts session `key` (the decision's `counted_session`) on the
    /// replica while this request runs there.
    pub(crate) fn counting_session(mut self, key: Option<u64>) -> Self {
        if let Some(k) = key {
            self.memory.sessions.lock().begin(k);
        }
        self.session = key;
        self
    }

    /// A turn of a session under way: the history it re-sends was computed
    /// by the session's earlier turns, which have ended, so cached tokens
    /// short of routing's prediction mean the engine evicted it, even with
    /// other prompts pending there (see [`Placement::finished`]).
    pub(crate) fn continuing(mut self, yes: bool) -> Self {
        self.continuing = yes;
        self
    }

    /// The first token came `ttft` after the request was sent: its prefill
    /// is done, its tokens leave the backlog.
    ///
    /// Where routing predicted cached tokens, the rate learns at the end
    /// ([`Placement::finished`]), from the tokens the engine says it
    /// prefilled: a stream's usage comes with its last event, and a prompt
    /// whose prefix the engine had evicted took a whole prefill over the few
    /// tokens predicted. Counted at the first token, one such answer
    /// multiplied the replica's rate (a sample weighs a fifth of the
    /// average: a 10x sample, 2.8x), and the prompts it held left it for
    /// replicas predicted faster that held nothing. Where routing predicted
    /// nothing cached the engine can only have prefilled less, and the rate
    /// learns at once (no delay in a cold start, where rates are first
    /// learned). An answer that never says (no usage, or cut) is counted at
    /// the end by the prediction. On a replica whose engine has never said
    /// what it had cached (vLLM without `--enable-prompt-tokens-details`)
    /// nothing better would come at the end, so the prediction is counted at
    /// once, as before, not a generation later.
    pub(crate) fn first_token(&mut self, ttft: Duration) {
        self.prefilled();
        let ttft = ttft + self.gate_wait;
        if self.predicted_cached == 0 || !self.memory.load.reports_cached() {
            self.first_token_over(ttft, self.ahead);
        } else if !self.started {
            self.started = true;
            self.memory.load.backlog.fetch_sub(self.uncached, Relaxed);
            self.waited = Some(ttft);
        }
    }

    /// The same where the engine's cached tokens come with the first token
    /// (a prefill leg's whole answer): the rate learns from the tokens the
    /// engine prefilled for this request, not those routing predicted. A
    /// prompt whose prefix the engine had evicted took a whole prefill over
    /// the few tokens predicted; counted so, it multiplied the replica's
    /// rate, and the next requests for its prefixes left it for a replica
    /// predicted faster that held nothing (retrieval on a disaggregated
    /// fleet: such detours were the slowest warm requests, ~640 ms cold
    /// prefills against ~15 ms; docs/benchmarks-log.md).
    pub(crate) fn first_token_cached(
        &mut self,
        ttft: Duration,
        actual: Option<u32>,
        engine_prompt: Option<u32>,
    ) {
        self.prefilled();
        let ttft = ttft + self.gate_wait;
        let ahead = self.ahead_done(actual, engine_prompt);
        self.first_token_over(ttft, ahead);
    }

    /// The tokens that were ahead of the first token, this request's as the
    /// engine prefilled them where it says (`actual` cached of its
    /// `engine_prompt`), else as routing predicted.
    fn ahead_done(&self, actual: Option<u32>, engine_prompt: Option<u32>) -> u64 {
        match actual {
            Some(a) => {
                let prompt = self.uncached + u64::from(self.predicted_cached);
                let done = prompt.saturating_sub(u64::from(self.in_ours(a, engine_prompt)));
                (self.ahead - self.uncached) + done.max(1)
            }
            None => self.ahead,
        }
    }

    fn first_token_over(&mut self, ttft: Duration, ahead: u64) {
        if self.started {
            return;
        }
        self.started = true;
        self.memory.load.backlog.fetch_sub(self.uncached, Relaxed);
        self.calibrate(ttft, ahead);
    }

    fn calibrate(&self, ttft: Duration, ahead: u64) {
        let rate = ttft.as_secs_f64() / ahead.max(1) as f64;
        if rate.is_finite() && rate > 0.0 {
            self.memory.load.rate.observe(rate);
        }
    }

    /// The engine's `actual` cached tokens of the `engine_prompt` it counted,
    /// in the gateway's tokens (see [`Placement::finished`]).
    fn in_ours(&self, actual: u32, engine_prompt: Option<u32>) -> u32 {
        let ours = self.uncached + u64::from(self.predicted_cached);
        match engine_prompt {
            Some(p) if p > 0 && actual <= p => {
                u32::try_from(u64::from(actual) * ours / u64::from(p)).unwrap_or(u32::MAX)
            }
            _ => actual,
        }
    }

    /// The replica's stall ledger ([`super::stall_budget`]): what a
    /// disaggregated model's request relayed from it and owes it.
    pub(crate) fn stall_ledger(
        &self,
    ) -> parking_lot::MutexGuard<'_, super::stall_budget::StallLedger> {
        self.memory.stalls.lock()
    }

    /// The engine reported `actual` cached tokens of the `engine_prompt` it
    /// counted: count both sides, and if it had less than predicted by more
    /// than a block (a session's turn: more than its history's last blocks),
    /// forget the blocks the index claimed beyond what the engine held.
    ///
    /// In the gateway's tokens: an engine counts its own (its tokenizer, its
    /// chat template), so its cached count is read as the share of its
    /// prompt it found cached, times the prompt as the gateway counts it.
    /// Compared raw, a tokenizer counting 10% fewer tokens than the
    /// gateway's estimate would look, on a 1,500-token prefix, like an
    /// eviction of its last nine blocks at every request.
    ///
    /// A first token's wait kept for the rate is counted now, over what the
    /// engine prefilled where it had less cached than predicted, never over
    /// fewer tokens than predicted: an engine that reports more cached than
    /// routing knew (a disaggregated decode leg counts the KV it pulled, so
    /// its whole prompt) prefilled little or nothing, and its wait over a
    /// token or two would read as a replica thousands of times slower.
    pub(crate) fn finished(&mut self, actual: u32, engine_prompt: Option<u32>) {
        if let Some(ttft) = self.waited.take() {
            let done = self.ahead_done(Some(actual), engine_prompt);
            self.calibrate(ttft, done.max(self.ahead));
        }
        let actual = self.in_ours(actual, engine_prompt);
        let l = &self.memory.load;
        l.reports_cached.store(true, Relaxed);
        l.predicted_cached
            .fetch_add(u64::from(self.predicted_cached), Relaxed);
        l.actual_cached.fetch_add(u64::from(actual), Relaxed);
        let tpb = self.tokens_per_block.max(1);
        // Sent while other prompts were still being prefilled there, a
        // request may have found its prefix not computed yet (the request
        // that brings it still in its prefill): no evidence it was evicted.
        // The index is corrected by a request sent when nothing was pending.
        // Not so a session's turn: its history was computed by turns that
        // have ended. (Waiting for a moment with nothing pending, a replica
        // whose queue of re-prefilled histories never emptied was never
        // found evicting: 12 agentic sessions, docs/benchmarks-log.md.)
        let pending = self.ahead > self.uncached && !self.continuing;
        // A turn's prediction is its history, whose last blocks the engine
        // does not hold: the earlier prompt's partial last block, and the
        // block where the chat template joins the turns (which it renders
        // differently once an answer follows): 48 tokens, three of vLLM's
        // 16-token blocks, and at least one of this gateway's. Of 12 agentic
        // sessions' turns on `sluice sim`, 92% found all but 0-47 tokens of
        // their earlier prompt cached, almost all the rest all but 112 or
        // more (evicted); with one block of slack most turns counted, and
        // every session's replica read as evicting (docs/benchmarks-log.md).
        let slack = if self.continuing { tpb.max(48) } else { tpb };
        // What the engine kept of the prediction, within the same slack
        // (a prediction under a block's worth says nothing).
        if self.predicted_cached >= tpb {
            let had = actual.saturating_add(slack).min(self.predicted_cached);
            l.observe_kept(f64::from(had) / f64::from(self.predicted_cached));
        }
        if actual + slack < self.predicted_cached && !pending {
            l.shortfalls.fetch_add(1, Relaxed);
            l.evicting.add(std::time::Instant::now());
            let held = (actual / tpb) as usize;
            let claimed = self.matched_blocks.min(self.hashes.len());
            if held < claimed {
                self.memory.prefixes.forget(&self.hashes[held..claimed]);
            }
        }
    }
}

impl Drop for Placement {
    fn drop(&mut self) {
        // Without its first token: those waiting for it go (`ended`).
        drop(self.prefilling.take());
        self.prefilled();
        if let Some(k) = self.session {
            self.memory.sessions.lock().end(k, crate::turn::now_std());
        }
        if !self.started {
            // Failed, or cut before its first token: no longer ahead of anyone.
            self.memory.load.backlog.fetch_sub(self.uncached, Relaxed);
        }
        if let Some(ttft) = self.waited.take() {
            // The engine never said what it had cached: the prediction.
            self.calibrate(ttft, self.ahead);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::routing::Affinity;

    fn memory() -> Arc<ReplicaMemory> {
        let t = (64, Duration::from_secs(60));
        Affinity::new(1024, t, t).of(&Arc::from("r"), Instant::now())
    }

    #[test]
    fn a_placement_counts_its_session_whole_until_it_ends() {
        let m = memory();
        let t0 = Instant::now();
        let turn = placed(&m, &[1, 2], 0).counting_session(Some(9));
        // However long the turn runs, its session counts 1.
        let long_after = t0 + Duration::from_secs(600);
        assert!((m.sessions.lock().weight(long_after) - 1.0).abs() < 1e-9);
        drop(turn);
        // Ended: it fades from now (600 s on, nothing left).
        let ended = crate::turn::now_std();
        assert!(m.sessions.lock().weight(ended) > 0.99);
        assert!(m.sessions.lock().weight(ended + Duration::from_secs(600)) < 1e-9);
        // A placement without a session counts none.
        drop(placed(&m, &[3], 0).counting_session(None));
        assert!(m.sessions.lock().weight(ended + Duration::from_secs(600)) < 1e-9);
    }

    fn placed(m: &Arc<ReplicaMemory>, hashes: &[u64], cached: u32) -> Placement {
        let h: Arc<[u64]> = Arc::from(hashes);
        Placement::new(m.clone(), 1000 - cached, cached, h, hashes.len(), 16)
    }

    #[test]
    fn a_shortfall_forgets_the_blocks_the_engine_did_not_have() {
        let m = memory();
        let h = [1, 2, 3, 4];
        m.prefixes.insert(&h);
        // Nothing else pending there: the engine had evicted the prefix.
        let mut p = placed(&m, &h, 64);
        p.finished(0, Some(1000));
        drop(p);
        assert_eq!(m.prefixes.longest_match(&h), 0);
        assert_eq!(m.load.shortfalls.load(Relaxed), 1);
    }

    #[test]
    fn another_tokenizers_count_is_read_as_a_share_of_its_own_prompt() {
        let m = memory();
        let h: Vec<u64> = (1..=40).collect();
        m.prefixes.insert(&h);
        // The index promised 640 of a 1,000-token prompt; the engine counts
        // 20% fewer tokens and found the same share cached: no shortfall.
        placed(&m, &h, 640).finished(512, Some(800));
        assert_eq!(m.prefixes.longest_match(&h), 40);
        assert_eq!(m.load.shortfalls.load(Relaxed), 0);
        // Compared raw, 512 against 640 would have forgotten 8 blocks.
        placed(&m, &h, 640).finished(512, None);
        assert_eq!(m.prefixes.longest_match(&h), 32);
        // The same tokenizer after an eviction: half the share, corrected.
        m.prefixes.insert(&h);
        placed(&m, &h, 640).finished(256, Some(800));
        assert_eq!(m.prefixes.longest_match(&h), 20);
        assert_eq!(m.load.shortfalls.load(Relaxed), 2);
    }

    #[test]
    fn a_shortfall_while_others_were_prefilling_there_forgets_nothing_but_a_sessions_history() {
        let m = memory();
        let h = [1, 2, 3, 4];
        m.prefixes.insert(&h);
        // The request that brings the prefix is still in its prefill.
        let leader = placed(&m, &h, 0);
        let mut follower = placed(&m, &h, 64);
        follower.finished(0, Some(1000));
        assert_eq!(m.prefixes.longest_match(&h), 4, "kept");
        assert_eq!(m.load.shortfalls.load(Relaxed), 0);
        // A session's turn short of its history by its last blocks only
        // (the earlier prompt's partial block, the template's join):
        // nothing evicted.
        let mut joined = placed(&m, &h, 64).continuing(true);
        joined.finished(64 - 47, Some(1000));
        assert_eq!(m.load.shortfalls.load(Relaxed), 0);
        // Short of more, its history (computed by its earlier turns) was
        // evicted, whatever else is pending there.
        let mut turn = placed(&m, &h, 64).continuing(true);
        turn.finished(0, Some(1000));
        assert_eq!(m.prefixes.longest_match(&h), 0);
        assert_eq!(m.load.shortfalls.load(Relaxed), 1);
        assert!(m.load.evicting.get(std::time::Instant::now()) > 0);
        drop((leader, follower, joined, turn));
    }

    #[test]
    fn what_the_engine_kept_of_the_prediction_is_averaged_per_replica() {
        let m = memory();
        let h: Vec<u64> = (1..=50).collect();
        assert_eq!(m.load.kept(), 1.0, "nothing reported: the index is trusted");
        // The engine reports half of 800 predicted (within a block), then
        // all but a block.
        placed(&m, &h, 800).finished(400 - 16, Some(1000));
        assert!((m.load.kept() - 0.5).abs() < 1e-9, "{}", m.load.kept());
        placed(&m, &h, 800).finished(800 - 16, Some(1000));
        assert!((m.load.kept() - 0.6).abs() < 1e-9, "{}", m.load.kept());
        // A prediction under a block says nothing; nor does none.
        placed(&m, &h, 8).finished(0, Some(1000));
        placed(&m, &h, 0).finished(0, Some(1000));
        assert!((m.load.kept() - 0.6).abs() < 1e-9, "{}", m.load.kept());
    }

    #[test]
    fn the_rate_learns_from_what_the_engine_prefilled_when_it_says() {
        // Predicted 900 of 1,000 tokens cached; the engine had none (its
        // prefix evicted) and took 100 ms: 0.1 ms a token, not 1 ms.
        let m = memory();
        let mut p = placed(&m, &[1], 900);
        p.first_token_cached(Duration::from_millis(100), Some(0), Some(1000));
        let rate = m.load.rate().unwrap();
        assert!((rate - 1e-4).abs() < 1e-9, "{rate}");
        assert_eq!(m.load.backlog(), 0, "its predicted tokens were taken back");
        // Not said: the prediction's tokens, as before.
        let m = memory();
        let mut p = placed(&m, &[1], 900);
        p.first_token_cached(Duration::from_millis(100), None, None);
        let rate = m.load.rate().unwrap();
        assert!((rate - 1e-3).abs() < 1e-9, "{rate}");
    }

    /// A placement predicting `cached` of 1,000 tokens whose first token
    /// came after 100 ms, on a replica whose engine reports cached tokens.
    fn streamed(cached: u32) -> (Arc<ReplicaMemory>, Placement) {
        let m = memory();
        m.load.reports_cached.store(true, Relaxed);
        let mut p = placed(&m, &[1], cached);
        p.first_token(Duration::from_millis(100));
        (m, p)
    }

    /// The replica's rate, checked against `want` seconds a token.
    fn rate_is(m: &ReplicaMemory, want: f64) -> f64 {
        let rate = m.load.rate().unwrap();
        assert!((rate - want).abs() < 1e-9, "{rate} != {want}");
        rate
    }

    #[test]
    fn a_streamed_answer_calibrates_from_what_the_engine_prefilled_at_its_end() {
        // Predicted 900 cached; the engine had evicted them. At the first
        // token only the backlog falls.
        let (m, mut p) = streamed(900);
        assert_eq!(m.load.backlog(), 0);
        assert_eq!(m.load.rate(), None, "not yet: the usage comes at the end");
        // The usage says none was cached: 0.1 ms a token, not 1 ms.
        p.finished(0, Some(1000));
        let rate = rate_is(&m, 1e-4);
        drop(p);
        assert!((m.load.rate().unwrap() - rate).abs() < 1e-12, "once");

        // An answer that never says: counted when dropped, by the prediction.
        let (m, p) = streamed(900);
        drop(p);
        rate_is(&m, 1e-3);

        // Nothing predicted cached: learned at the first token.
        let (m, mut p) = streamed(0);
        let rate = rate_is(&m, 1e-4);
        p.finished(500, Some(1000));
        assert!((m.load.rate().unwrap() - rate).abs() < 1e-12, "once");

        // The engine had more cached than predicted (a decode leg counts the
        // KV it pulled: the whole prompt): never over fewer tokens than
        // predicted, so not 100 ms over one token.
        let (m, mut p) = streamed(900);
        p.finished(1000, Some(1000));
        rate_is(&m, 1e-3);
    }

    #[test]
    fn an_engine_that_never_says_what_it_had_cached_calibrates_at_the_first_token() {
        // Nothing better would come at the end: the prediction, at once.
        let m = memory();
        let mut p = placed(&m, &[1], 900);
        p.first_token(Duration::from_millis(100));
        let rate = rate_is(&m, 1e-3);
        drop(p);
        assert!((m.load.rate().unwrap() - rate).abs() < 1e-12, "once");
        // Once it has said, the next answers wait for its word.
        placed(&m, &[1], 900).finished(900, Some(1000));
        assert!(m.load.reports_cached());
        let mut p = placed(&m, &[1], 900);
        p.first_token(Duration::from_millis(100));
        assert!((m.load.rate().unwrap() - rate).abs() < 1e-12, "deferred");
        p.finished(0, Some(1000));
        assert!(
            m.load.rate().unwrap() < rate,
            "learned from 1,000 tokens prefilled"
        );
    }
}
