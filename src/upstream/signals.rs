//! What this gateway knows about a replica's load: the latest scrape of its
//! own metrics (the latency measured here is a `telemetry::ewma::Ewma`).

use std::time::Instant;

pub(crate) use crate::telemetry::ewma::Ewma;
use crate::vocab::EngineKind;

/// One scrape's worth of what routing needs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadSample {
    pub engine: EngineKind,
    /// KV-cache usage, 0..1.
    pub kv_usage: Option<f64>,
    /// Requests the engine holds and does not run, whatever they wait for.
    pub waiting: Option<f64>,
    /// Of those, requests that wait for something other than room (a seat
    /// or KV blocks): their KV pulled from a prefill replica, a grammar
    /// compiled (vLLM's `num_requests_waiting_by_reason{reason="deferred"}`;
    /// SGLang's decode transfer, prefill bootstrap and grammar queues;
    /// `None` where the engine does not tell them apart).
    pub deferred: Option<f64>,
    /// Those waiting for room, where the engine says so (vLLM's
    /// `reason="capacity"`; SGLang's waiting and decode prealloc queues).
    pub waiting_for_room: Option<f64>,
    pub running: Option<f64>,
    pub block_size: Option<u32>,
    pub num_blocks: Option<u32>,
    /// Prefix-cache hits / queries since the replica started.
    pub prefix_hit_rate: Option<f64>,
    /// Preemptions since the replica started (vLLM `num_preemptions_total`).
    pub preemptions: Option<f64>,
    /// Sequences swapped to CPU memory, and the CPU KV cache's usage (vLLM
    /// engines that report them).
    pub swapped: Option<f64>,
    pub cpu_kv_usage: Option<f64>,
    /// Prefix-cache hits and queries since the replica started (counters).
    pub prefix_hits: Option<f64>,
    pub prefix_queries: Option<f64>,
    /// This gateway's closed-loop counters for the replica when the sample
    /// was kept (`Replica::set_load`): prompt tokens routing expected cached
    /// there, and those the engine reported cached, for the same requests.
    pub cached_predicted: Option<f64>,
    pub cached_actual: Option<f64>,
    /// This gateway's attempts sent there, and those whose first prompt
    /// block was last sent elsewhere (counters, stamped the same way).
    pub attempts: Option<f64>,
    pub prefix_elsewhere: Option<f64>,
    /// From the replica's DCGM exporter (`backends[].dcgm_url`): GPU
    /// utilisation (0..1, mean over its GPUs) and framebuffer memory used
    /// (0..1 of used + free, over its GPUs).
    pub gpu_util: Option<f64>,
    pub gpu_memory: Option<f64>,
    /// The engine's own word that it is full: requests were waiting at this
    /// scrape and at the one before (a scrape interval is dozens of engine
    /// steps: a queue that outlives it is one the engine could not take in).
    /// Set by `Replica::set_load` from the previous sample.
    pub queued: bool,
    /// Its preemption counter rose since the previous scrape: it ran out of
    /// KV blocks for the sequences it runs (set likewise).
    pub preempting: bool,
    pub at: Instant,
}

impl LoadSample {
    /// The engine's queue: requests waiting for room, those waiting for
    /// anything else ([`Self::deferred`]) left out. A decode replica's
    /// engine counts a request pulling its prompt's KV as waiting (vLLM's
    /// `WAITING_FOR_REMOTE_KVS`; SGLang keeps it in a transfer queue, apart
    /// from its waiting queue): it starts once its KV arrives, and is no
    /// sign of a full engine. Where the engine does not tell them apart,
    /// every waiting request.
    pub fn queue(&self) -> Option<f64> {
        match (self.waiting_for_room, self.waiting, self.deferred) {
            (Some(room), _, _) => Some(room),
            (None, Some(w), Some(d)) => Some((w - d).max(0.0)),
            (None, w, _) => w,
        }
    }

    /// A sample taken at `at` that knows nothing yet (fields are filled in
    /// with struct update syntax: `LoadSample { waiting: Some(2.0), ..LoadSample::empty(e, at) }`).
    pub fn empty(engine: EngineKind, at: Instant) -> Self {
        Self {
            engine,
            kv_usage: None,
            waiting: None,
            deferred: None,
            waiting_for_room: None,
            running: None,
            block_size: None,
            num_blocks: None,
            prefix_hit_rate: None,
            preemptions: None,
            swapped: None,
            cpu_kv_usage: None,
            prefix_hits: None,
            prefix_queries: None,
            cached_predicted: None,
            cached_actual: None,
            attempts: None,
            prefix_elsewhere: None,
            gpu_util: None,
            gpu_memory: None,
            queued: false,
            preempting: false,
            at,
        }
    }
}
