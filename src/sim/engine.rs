//! The engine model behind `sluice sim`: continuous batching stepped like
//! vLLM's scheduler, over the KV block pool of `kv.rs`.
//!
//! Each step: running sequences first (a prefill chunk or one decode token
//! each, allocating KV blocks; when blocks run out the most recently admitted
//! sequence is preempted: its blocks are copied to CPU swap space if the
//! profile has room there (vLLM V0's `--swap-space`), else freed for
//! recomputation later), then, if nothing was preempted, swapped sequences
//! back onto the GPU, oldest first, and only when none is left swapped,
//! waiting sequences in arrival order while the batch has room
//! (`max_num_seqs`), token budget (`max_num_batched_tokens`, chunked prefill)
//! and blocks. A new sequence first takes its cached prefix blocks, so only
//! uncached prompt tokens cost prefill time. A prompt's full blocks become
//! cached for others when the step computing them ends (`--cache-at
//! compute`, as SGLang inserts into its radix tree after the forward pass),
//! or as soon as that step is scheduled (`--cache-at schedule`, as vLLM V1
//! caches the blocks it allocates: a request admitted later in the same
//! step attends to KV written earlier in the same forward pass, so requests
//! for a prompt being prefilled share it). The step then lasts
//! `profile.step_time(batch, prefill tokens) / speed` plus the copy time of
//! the blocks swapped, after which every sequence that caught up with its
//! prompt emits one token. A sequence with the `leak` fault hands its blocks
//! to nobody when it ends; [`Engine::reset`] frees them.
//!
//! With `--scheduling-policy priority` (vLLM's), the waiting queue and the
//! running batch are ordered by the request's `priority` (lower first), then
//! arrival, so a high-priority request is admitted first when a seat and
//! blocks free, and the one preempted for blocks is the lowest-priority one.
//!
//! Without chunked prefill (`--no-chunked-prefill`, vLLM V1's scheduler with
//! chunked prefill disabled) a prompt is prefilled whole in one step, and
//! only in the token budget the running decodes left: the running sequences
//! are scheduled first (one token each), so with `k` decodes running a
//! prompt of `P` tokens waits until `k <= max_num_batched_tokens - P`, and
//! the queue is served in order, so every request behind it waits too.
//! Long decodes thus keep long prompts (and the queue behind them) out for
//! as long as they run, while their own steps stay fast: the prefill
//! starvation of the reference articles (high TTFT, normal inter-token
//! latency, a growing queue). A prompt larger than the whole budget runs in
//! a step of its own. Chunked prefill instead gives a prompt whatever the
//! decodes leave, a chunk per step, so it always progresses.
//!
//! Cost per step: O(running + admitted) work and one timer; the HTTP streams
//! are woken through their [`Slot`], never by a channel per token.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use super::SimMetrics;
use super::kv::{BlockPool, CachedPrefixes};
use super::profile::{CacheAt, Profile};
use super::slot::{Request, Slot};

struct Seq {
    req: Request,
    slot: Arc<Slot>,
    blocks: Vec<u32>,
    /// Tokens whose KV is computed.
    computed: u32,
    generated: u32,
    /// Prompt blocks already registered in the prefix cache.
    registered: usize,
    scheduled: bool,
    /// Admitted to the batch at least once (counted in queue time and prompt tokens).
    admitted: bool,
    /// A stall fault in progress: not scheduled until then (keeps its blocks).
    paused_until: Option<Instant>,
    /// Swapped out: the CPU blocks holding its KV (0 when on the GPU).
    cpu_blocks: u32,
    last_token: Option<Instant>,
}

impl Seq {
    /// Tokens that must have KV before the next token can be produced.
    fn target(&self) -> u32 {
        self.req.prompt_tokens + self.generated
    }

    /// Make the full prompt blocks of its first `computed` tokens prefix-cache
    /// hits for other requests (once; later calls add the blocks since).
    fn register_blocks(&mut self, pool: &mut BlockPool) {
        let bs = pool.block_size as usize;
        let full =
            (self.computed.min(self.req.prompt_tokens) as usize / bs).min(self.req.hashes.len());
        while self.registered < full {
            pool.register(
                self.blocks[self.registered],
                self.req.hashes[self.registered],
            );
            self.registered += 1;
        }
    }
}

pub(crate) struct Engine {
    /// The prefix cache as request handlers see it.
    prefixes: CachedPrefixes,
    profile: Profile,
    intake: parking_lot::Mutex<Vec<Seq>>,
    /// Restarts asked for (`POST /sim/reset`), each answered with the
    /// number of leaked blocks it freed.
    resets: parking_lot::Mutex<Vec<oneshot::Sender<u32>>>,
    notify: Notify,
}

impl Engine {
    /// Start the engine loop on the current runtime.
    pub(crate) fn spawn(
        profile: Profile,
        speed: f64,
        metrics: Arc<SimMetrics>,
    ) -> (Arc<Engine>, tokio::task::JoinHandle<()>) {
        let pool = BlockPool::new(profile.num_blocks, profile.block_size);
        let engine = Arc::new(Engine {
            prefixes: pool.cached_prefixes(),
            profile,
            intake: parking_lot::Mutex::new(Vec::new()),
            resets: parking_lot::Mutex::new(Vec::new()),
            notify: Notify::new(),
        });
        let task = tokio::spawn(run(engine.clone(), profile, pool, speed, metrics));
        (engine, task)
    }

    /// The prompt tokens of `hashes` (a prompt of `prompt_tokens`) its prefix
    /// cache holds now: what admission would take, as it would count it (at
    /// least the last prompt token is always computed).
    pub(crate) fn cached_tokens(&self, hashes: &[u64], prompt_tokens: u32) -> u32 {
        let usable = self.profile.usable_prefix_blocks(prompt_tokens);
        let blocks = self.prefixes.leading(&hashes[..hashes.len().min(usable)]);
        u32::try_from(blocks).unwrap_or(u32::MAX) * self.profile.block_size
    }

    pub(crate) fn submit(&self, req: Request, slot: Arc<Slot>) {
        let seq = Seq {
            req,
            slot: slot.clone(),
            blocks: Vec::new(),
            computed: 0,
            generated: 0,
            registered: 0,
            scheduled: false,
            admitted: false,
            paused_until: None,
            cpu_blocks: 0,
            last_token: None,
        };
        self.intake.lock().push(seq);
        self.notify.notify_one();
    }

    /// What an operator's restart of a drained engine does to leaked
    /// memory: the blocks no request holds are freed. Requests in flight
    /// keep running (a drained replica has none). Resolves, after the
    /// engine's current step, with the number of blocks freed.
    pub(crate) async fn reset(&self) -> u32 {
        let (tx, rx) = oneshot::channel();
        self.resets.lock().push(tx);
        self.notify.notify_one();
        rx.await.unwrap_or(0)
    }
}

struct State {
    profile: Profile,
    pool: BlockPool,
    running: Vec<Seq>,
    waiting: VecDeque<Seq>,
    /// Preempted sequences whose KV sits in CPU memory, oldest arrival first.
    swapped: VecDeque<Seq>,
    /// CPU blocks in use by `swapped`.
    cpu_used: u32,
    /// Blocks copied between GPU and CPU in this step (either way).
    swap_io: u32,
    /// Blocks of ended requests with the leak fault: allocated, owned by nobody.
    leaked: Vec<u32>,
    metrics: Arc<SimMetrics>,
}

async fn run(
    engine: Arc<Engine>,
    profile: Profile,
    pool: BlockPool,
    speed: f64,
    metrics: Arc<SimMetrics>,
) {
    let mut st = State {
        profile,
        pool,
        running: Vec::new(),
        waiting: VecDeque::new(),
        swapped: VecDeque::new(),
        cpu_used: 0,
        swap_io: 0,
        leaked: Vec::new(),
        metrics,
    };
    let speed = if speed > 0.0 { speed } else { 1.0 };
    let mut clock = Instant::now();
    loop {
        let arrived = std::mem::take(&mut *engine.intake.lock());
        st.waiting.extend(arrived);
        let resets = std::mem::take(&mut *engine.resets.lock());
        if !resets.is_empty() {
            let freed = st.free_leaked();
            for r in resets {
                let _ = r.send(freed);
            }
        }
        if st.running.is_empty() && st.waiting.is_empty() && st.swapped.is_empty() {
            st.publish();
            engine.notify.notified().await;
            clock = Instant::now();
            continue;
        }
        let (batch, prefill) = st.schedule();
        st.publish();
        if batch == 0 {
            // Nothing fits (every waiting request was cancelled or is too big
            // for an empty cache); wait for a change rather than spin.
            st.drop_unservable();
            tokio::select! {
                _ = engine.notify.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(10)) => {}
            }
            clock = Instant::now();
            continue;
        }
        let copy = st.profile.per_swap_block * st.swap_io;
        let step = (st.profile.step_time(batch, prefill) + copy).div_f64(speed);
        // Absolute deadlines: timer granularity does not accumulate into drift.
        clock = (clock + step).max(Instant::now() - Duration::from_millis(50));
        st.metrics.busy.record(clock - step, clock);
        tokio::time::sleep_until(clock).await;
        st.complete_step();
    }
}

impl State {
    /// Pick this step's work; returns (sequences in the batch, prefill tokens).
    fn schedule(&mut self) -> (u32, u32) {
        let bs = self.pool.block_size;
        let mut budget = self.profile.max_num_batched_tokens;
        let mut prefill = 0u32;
        let mut preempted = false;
        let schedule_time = self.profile.cache_at == CacheAt::Schedule;
        // Cancelled requests leave first.
        let metrics = &self.metrics;
        let (pool, leaked) = (&mut self.pool, &mut self.leaked);
        self.running.retain_mut(|s| {
            let keep = !s.slot.is_cancelled();
            if !keep {
                free_or_leak(pool, leaked, s);
                metrics.finished("abort");
            }
            keep
        });
        self.waiting.retain(|s| {
            let keep = !s.slot.is_cancelled();
            if !keep {
                metrics.finished("abort");
            }
            keep
        });
        let cpu_used = &mut self.cpu_used;
        self.swapped.retain(|s| {
            let keep = !s.slot.is_cancelled();
            if !keep {
                *cpu_used -= s.cpu_blocks;
                metrics.finished("abort");
            }
            keep
        });
        self.swap_io = 0;
        for s in &mut self.running {
            s.scheduled = false;
        }
        if self.profile.priority_scheduling {
            // vLLM's priority policy: the queue by (priority, arrival), and
            // the running batch in the same order, so the sequence preempted
            // for blocks (the last) is the lowest-priority, latest one.
            let key = |s: &Seq| (s.req.priority, s.req.arrival);
            self.waiting.make_contiguous().sort_by_key(key);
            self.running.sort_by_key(key);
        }

        let now = Instant::now();
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            if self.running[i].paused_until.is_some_and(|t| t > now) {
                i += 1;
                continue;
            }
            let need = self.running[i].target() - self.running[i].computed;
            let n = need.min(budget);
            let want = self.pool.blocks_for(self.running[i].computed + n);
            let mut self_preempted = false;
            while want > self.running[i].blocks.len() as u32 + self.pool.num_free() {
                // Out of blocks: preempt the most recent arrival, to CPU
                // memory if it fits there, else for recomputation later.
                let Some(victim) = self.running.pop() else {
                    break;
                };
                self.metrics.preemptions.inc();
                preempted = true;
                let was_self = self.running.len() == i;
                self.preempt(victim);
                if was_self {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted {
                break;
            }
            let s = &mut self.running[i];
            let extra = want.saturating_sub(s.blocks.len() as u32);
            if !self.pool.allocate(extra, &mut s.blocks) {
                break;
            }
            if s.computed < s.req.prompt_tokens {
                prefill += n.min(s.req.prompt_tokens - s.computed);
            }
            s.scheduled = true;
            s.computed += n;
            if schedule_time {
                s.register_blocks(&mut self.pool);
            }
            budget -= n;
            i += 1;
        }

        // Swapped sequences come back before any new one is admitted (vLLM
        // V0), oldest first, when the GPU has their blocks again.
        while !preempted && budget > 0 && (self.running.len() as u32) < self.profile.max_num_seqs {
            let Some(s) = self.swapped.front() else {
                break;
            };
            let n = (s.target() - s.computed).min(budget);
            let want = self.pool.blocks_for(s.computed + n);
            if want > self.pool.num_free() {
                break;
            }
            let Some(mut s) = self.swapped.pop_front() else {
                break;
            };
            if !self.pool.allocate(want, &mut s.blocks) {
                self.swapped.push_front(s);
                break;
            }
            self.cpu_used -= s.cpu_blocks;
            self.swap_io += s.cpu_blocks;
            s.cpu_blocks = 0;
            if s.computed < s.req.prompt_tokens {
                prefill += n.min(s.req.prompt_tokens - s.computed);
            }
            s.computed += n;
            s.scheduled = true;
            if schedule_time {
                s.register_blocks(&mut self.pool);
            }
            budget -= n;
            self.running.push(s);
        }

        while !preempted
            && self.swapped.is_empty()
            && budget > 0
            && (self.running.len() as u32) < self.profile.max_num_seqs
        {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            if s.blocks.is_empty() {
                // Prefix cache: take the cached blocks of the longest matching
                // prefix; at least one prompt token is always computed.
                let usable = self.profile.usable_prefix_blocks(s.req.prompt_tokens);
                let hashes = &s.req.hashes[..s.req.hashes.len().min(usable)];
                s.blocks = self.pool.take_prefix(hashes);
                s.computed = s.blocks.len() as u32 * bs;
                s.registered = s.blocks.len();
                // KV pulled from a prefill replica: computed but for the
                // last token (its blocks are allocated below, as a prefill's).
                if !s.admitted {
                    s.slot.set_cached(s.computed);
                }
                s.computed = s.computed.max(
                    s.req
                        .remote_tokens
                        .min(s.req.prompt_tokens.saturating_sub(1)),
                );
            }
            let need = s.target() - s.computed;
            let alone = budget == self.profile.max_num_batched_tokens;
            let n = if self.profile.chunked_prefill {
                need.min(budget)
            } else if need <= budget || alone {
                // Whole, in this step (a prompt over the budget runs alone).
                need
            } else {
                // No chunked prefill: the prompt does not fit in what the
                // running decodes left of the budget. It waits at the head
                // of the queue, and everything behind it waits too.
                self.pool.release(&s.blocks);
                s.blocks.clear();
                s.computed = 0;
                s.registered = 0;
                self.waiting.push_front(s);
                break;
            };
            let want = self.pool.blocks_for(s.computed + n);
            let extra = want.saturating_sub(s.blocks.len() as u32);
            if !self.pool.allocate(extra, &mut s.blocks) {
                // Does not fit now: give back the prefix and wait at the front.
                self.pool.release(&s.blocks);
                s.blocks.clear();
                s.computed = 0;
                s.registered = 0;
                self.waiting.push_front(s);
                break;
            }
            if !s.admitted {
                s.admitted = true;
                let m = &self.metrics;
                m.queue_time.observe_duration(s.req.arrival.elapsed());
                m.prompt_tokens.add(u64::from(s.req.prompt_tokens));
                m.prefix_queries.add(u64::from(s.req.prompt_tokens));
                m.prefix_hits.add(u64::from(s.slot.cached()));
            }
            if s.computed < s.req.prompt_tokens {
                prefill += n.min(s.req.prompt_tokens - s.computed);
            }
            s.computed += n;
            s.scheduled = true;
            if schedule_time {
                // vLLM V1: cached when allocated, so a request admitted
                // after this one in the same step shares its prompt.
                s.register_blocks(&mut self.pool);
            }
            budget = budget.saturating_sub(n);
            self.running.push(s);
        }
        let batch = self.running.iter().filter(|s| s.scheduled).count() as u32;
        (batch, prefill)
    }

    /// The step ran: register full prompt blocks, emit a token for every
    /// sequence that caught up, retire finished ones.
    fn complete_step(&mut self) {
        let now = Instant::now();
        for s in self.running.iter_mut().filter(|s| s.scheduled) {
            s.register_blocks(&mut self.pool);
            if s.computed < s.target() {
                continue; // still prefilling (chunked)
            }
            s.generated += 1;
            self.metrics.generation_tokens.inc();
            match s.last_token {
                None => self.metrics.ttft.observe_duration(now - s.req.arrival),
                Some(prev) => self.metrics.itl.observe_duration(now - prev),
            }
            s.last_token = Some(now);
            s.slot.push(s.generated);
            if let Some((n, d)) = s.req.stall
                && n == s.generated
            {
                s.paused_until = Some(now + d);
            }
        }
        let metrics = &self.metrics;
        let (pool, leaked) = (&mut self.pool, &mut self.leaked);
        self.running.retain_mut(|s| {
            if s.generated < s.req.output_tokens {
                return true;
            }
            free_or_leak(pool, leaked, s);
            metrics.e2e.observe_duration(now - s.req.arrival);
            metrics.finished(s.req.finish_reason);
            s.slot.finish();
            false
        });
    }

    /// Take a running sequence off the GPU: its blocks are copied to CPU
    /// memory if the swap space holds them (it resumes where it was),
    /// otherwise dropped (it is recomputed from its prompt later).
    fn preempt(&mut self, mut victim: Seq) {
        // Only a sequence not yet scheduled in this step is preempted, so a
        // block registered at schedule time (`CacheAt::Schedule`) was computed
        // before its owner could be preempted.
        debug_assert!(
            !victim.scheduled,
            "preempted a sequence scheduled in this step"
        );
        let n = victim.blocks.len() as u32;
        self.pool.release(&victim.blocks);
        victim.blocks.clear();
        victim.registered = 0;
        victim.scheduled = false;
        if n > 0 && self.cpu_used + n <= self.profile.swap_blocks {
            victim.cpu_blocks = n;
            self.cpu_used += n;
            self.swap_io += n;
            self.swapped.push_front(victim);
        } else {
            victim.computed = 0;
            self.waiting.push_front(victim);
        }
    }

    /// Free every leaked block; returns how many there were.
    fn free_leaked(&mut self) -> u32 {
        let n = self.leaked.len() as u32;
        self.pool.release(&self.leaked);
        self.leaked.clear();
        n
    }

    /// Requests that can never fit (prompt larger than the whole cache) fail.
    fn drop_unservable(&mut self) {
        let cap = self.pool.num_blocks();
        let pool = &self.pool;
        let metrics = &self.metrics;
        self.waiting.retain(|s| {
            let fits = pool.blocks_for(s.req.prompt_tokens + 1) <= cap;
            if !fits {
                metrics.finished("error");
                s.slot.finish();
            }
            fits
        });
    }

    fn publish(&self) {
        let m = &self.metrics;
        m.running.set(self.running.len() as i64);
        let intake_waiting = self.waiting.len() as i64;
        m.waiting.set(intake_waiting);
        m.kv_usage.set(self.pool.usage());
        m.swapped.set(self.swapped.len() as i64);
        let cpu = match self.profile.swap_blocks {
            0 => 0.0,
            n => f64::from(self.cpu_used) / f64::from(n),
        };
        m.cpu_kv_usage.set(cpu);
    }
}

/// A request ended: its blocks go back to the pool, or, with the leak
/// fault, to nobody.
fn free_or_leak(pool: &mut BlockPool, leaked: &mut Vec<u32>, s: &mut Seq) {
    if s.req.leak {
        leaked.append(&mut s.blocks);
    } else {
        pool.release(&s.blocks);
    }
}
