//! The simulator's `/metrics`, in the names of the engine it imitates.
//!
//! - `vllm` (default): current vLLM V1 names plus the older aliases a fleet may
//!   still scrape (`vllm:gpu_cache_usage_perc`, `vllm:time_per_output_token_seconds`,
//!   `vllm:gpu_prefix_cache_*`), label `model_name`.
//! - `sglang`: SGLang's `sglang:*` names (docs/references/production_metrics.md of
//!   sgl-project/sglang): `num_running_reqs`, `num_queue_reqs`, `token_usage`,
//!   `cache_hit_rate`, token counters and latency histograms, label `model_name`;
//!   disaggregation's queues (`num_decode_transfer_queue_reqs` and the
//!   prealloc ones, `python/sglang/srt/metrics/collector.py`).
//! - `llamacpp`: llama.cpp `llama-server --metrics` names (`llamacpp:*`, no labels):
//!   `requests_processing`, `requests_deferred`, `kv_cache_usage_ratio`,
//!   `kv_cache_tokens`, `prompt_tokens_total`, `tokens_predicted_total`.
//! - `tgi`: Hugging Face TGI's router names (`tgi_*`, no labels, per its metrics
//!   reference): `tgi_queue_size`, `tgi_batch_current_size`, `tgi_request_count`.
//!   TGI exports no KV-cache usage.

use std::sync::Arc;

use crate::telemetry::registry::{Counter, Encoder, Family, FloatGauge, Gauge, Histogram, Kind};

/// Which engine's metric names `/metrics` uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Dialect {
    #[default]
    Vllm,
    Sglang,
    Llamacpp,
    Tgi,
}

// vLLM's own bucket bounds, so a dashboard built for vLLM reads the simulator alike.
const TTFT: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const E2E: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

pub struct SimMetrics {
    pub running: Gauge,
    /// The engine's queue (set at every engine step).
    pub waiting: Gauge,
    /// Requests held before they reach the engine by a fault's first-token
    /// delay (reported as waiting, beside the engine's queue).
    pub held: Gauge,
    /// Decode legs waiting for their prompt's KV: an SGLang leg for its
    /// room's prefill, then either leg for its transfer time (vLLM's
    /// `num_requests_waiting_by_reason{reason="deferred"}`, SGLang's
    /// `num_decode_transfer_queue_reqs`).
    pub pulling: Gauge,
    pub kv_usage: FloatGauge,
    /// Sequences swapped out to CPU memory, and the share of the CPU KV
    /// blocks they hold (vLLM V0, with swap space).
    pub swapped: Gauge,
    pub cpu_kv_usage: FloatGauge,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub prefix_queries: Counter,
    pub prefix_hits: Counter,
    pub preemptions: Counter,
    /// Decode legs whose KV could not be pulled (unknown, expired, the
    /// prefill replica unreachable).
    pub kv_transfer_failures: Counter,
    /// HTTP requests received (any endpoint that generates).
    pub received: Counter,
    /// `/metrics` pages served (scrapes, looks).
    pub scrapes: Counter,
    /// Prompt tokens whose KV decode legs pulled (what their own cache
    /// lacked, over vLLM's protocol).
    pub kv_pulled_tokens: Counter,
    /// TCP connections accepted (keep-alive reuse shows as a small number).
    pub connections: Counter,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
    /// The engine's recent steps (GPU utilisation of `/dcgm/metrics`).
    pub(crate) busy: super::dcgm::Busy,
    finished: Family<(&'static str,), Counter>,
}

impl SimMetrics {
    pub(crate) fn new() -> Self {
        Self {
            running: Gauge::default(),
            waiting: Gauge::default(),
            held: Gauge::default(),
            pulling: Gauge::default(),
            kv_usage: FloatGauge::default(),
            swapped: Gauge::default(),
            cpu_kv_usage: FloatGauge::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            preemptions: Counter::default(),
            kv_transfer_failures: Counter::default(),
            received: Counter::default(),
            scrapes: Counter::default(),
            kv_pulled_tokens: Counter::default(),
            connections: Counter::default(),
            ttft: Histogram::seconds(Arc::from(TTFT)),
            itl: Histogram::seconds(Arc::from(ITL)),
            e2e: Histogram::seconds(Arc::from(E2E)),
            queue_time: Histogram::seconds(Arc::from(E2E)),
            busy: super::dcgm::Busy::default(),
            finished: Family::new(&["finished_reason"], Counter::default),
        }
    }

    pub(crate) fn finished(&self, reason: &'static str) {
        self.finished.get(&(reason,)).inc();
    }

    pub fn finished_count(&self, reason: &'static str) -> u64 {
        self.finished.get(&(reason,)).get()
    }

    /// Finished requests of every reason.
    pub(crate) fn finished_total(&self) -> u64 {
        ["stop", "length", "abort", "error"]
            .iter()
            .map(|r| self.finished_count(r))
            .sum()
    }

    /// The KV-cache usage the engine last published (0 to 1).
    pub fn kv_usage(&self) -> f64 {
        self.kv_usage.get()
    }

    /// Share of prompt tokens served from the prefix cache so far.
    pub(crate) fn hit_rate(&self) -> f64 {
        let q = self.prefix_queries.get();
        if q == 0 {
            0.0
        } else {
            self.prefix_hits.get() as f64 / q as f64
        }
    }

    /// Render with reported pressure overridden (`/sim/control`).
    pub(crate) fn render_with(
        &self,
        dialect: Dialect,
        model: &str,
        cache: CacheInfo,
        o: Overrides,
    ) -> String {
        let view = View {
            kv: o.kv_usage.unwrap_or_else(|| self.kv_usage.get()),
            waiting: o
                .waiting
                .unwrap_or((self.waiting.get() + self.held.get()) as f64),
            deferred: o.deferred.unwrap_or(self.pulling.get() as f64),
        };
        let mut e = Encoder::new();
        let m = format!("model_name=\"{}\"", model.replace('"', "'"));
        match dialect {
            Dialect::Vllm => self.render_vllm(&mut e, &m, cache, view),
            Dialect::Sglang => self.render_sglang(&mut e, &m, view),
            Dialect::Llamacpp => self.render_llamacpp(&mut e, cache, view),
            Dialect::Tgi => self.render_tgi(&mut e, view),
        }
        e.one(
            "sluice_sim_connections_total",
            "TCP connections the simulator accepted (not an engine metric).",
            Kind::Counter,
            "",
            self.connections.get() as f64,
        );
        e.finish()
    }

    fn render_vllm(&self, e: &mut Encoder, m: &str, cache: CacheInfo, v: View) {
        use Kind::{Counter as C, Gauge as G};
        e.one(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            G,
            m,
            self.running.get() as f64,
        );
        e.one(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            G,
            m,
            v.waiting + v.deferred,
        );
        e.several(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting, by why they wait.",
            G,
            &[
                (&format!("{m},reason=\"capacity\""), v.waiting),
                (&format!("{m},reason=\"deferred\""), v.deferred),
            ],
        );
        e.one(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            G,
            m,
            v.kv,
        );
        e.one(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage (older name of kv_cache_usage_perc).",
            G,
            m,
            v.kv,
        );
        if cache.swap_blocks > 0 {
            // vLLM V0's swap gauges; V1 has no swap space and no such series.
            e.one(
                "vllm:num_requests_swapped",
                "Number of requests swapped to CPU.",
                G,
                m,
                self.swapped.get() as f64,
            );
            e.one(
                "vllm:cpu_cache_usage_perc",
                "CPU KV-cache usage. 1 means 100 percent usage.",
                G,
                m,
                self.cpu_kv_usage.get(),
            );
        }
        e.one(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in tokens.",
            C,
            m,
            self.prefix_queries.get() as f64,
        );
        e.one(
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in tokens.",
            C,
            m,
            self.prefix_hits.get() as f64,
        );
        e.one(
            "vllm:gpu_prefix_cache_queries_total",
            "Prefix cache queries, in tokens (older name).",
            C,
            m,
            self.prefix_queries.get() as f64,
        );
        e.one(
            "vllm:gpu_prefix_cache_hits_total",
            "Prefix cache hits, in tokens (older name).",
            C,
            m,
            self.prefix_hits.get() as f64,
        );
        e.one(
            "vllm:num_preemptions_total",
            "Cumulative number of preemptions from the engine.",
            C,
            m,
            self.preemptions.get() as f64,
        );
        e.one(
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            C,
            m,
            self.prompt_tokens.get() as f64,
        );
        e.one(
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            C,
            m,
            self.generation_tokens.get() as f64,
        );
        let mut fin = Encoder::new();
        fin.counters(
            "vllm:request_success_total",
            "Count of finished requests, by finished reason (abort: the client went away).",
            &self.finished,
            |c| c,
        );
        // Add model_name to each series of the family.
        e.out.push_str(
            &fin.out
                .replace("{finished_reason=", &format!("{{{m},finished_reason=")),
        );
        e.one_histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            m,
            &self.ttft,
        );
        e.one_histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            m,
            &self.itl,
        );
        e.one_histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (older name).",
            m,
            &self.itl,
        );
        e.one_histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            m,
            &self.e2e,
        );
        e.one_histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            m,
            &self.queue_time,
        );
        let info = format!(
            "block_size=\"{}\",num_gpu_blocks=\"{}\",num_cpu_blocks=\"{}\",enable_prefix_caching=\"{}\",cache_dtype=\"auto\"",
            cache.block_size,
            cache.num_blocks,
            cache.swap_blocks,
            if cache.prefix_caching {
                "True"
            } else {
                "False"
            }
        );
        e.one(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig.",
            G,
            &info,
            1.0,
        );
    }

    fn render_sglang(&self, e: &mut Encoder, m: &str, v: View) {
        use Kind::{Counter as C, Gauge as G};
        e.one(
            "sglang:num_running_reqs",
            "The number of running requests.",
            G,
            m,
            self.running.get() as f64,
        );
        e.one(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            G,
            m,
            v.waiting,
        );
        e.one(
            "sglang:num_grammar_queue_reqs",
            "The number of requests in the grammar waiting queue.",
            G,
            m,
            0.0,
        );
        // Disaggregation's queues (SGLang exports them in every mode): the
        // simulator's prefill side never waits for its decode side, and a
        // decode leg has its room (blocks) from the start, so only the
        // transfer queue fills (a decode leg waiting for its prefill, then
        // for its transfer).
        e.one(
            "sglang:num_prefill_prealloc_queue_reqs",
            "The number of requests in the prefill prealloc queue.",
            G,
            m,
            0.0,
        );
        e.one(
            "sglang:num_decode_prealloc_queue_reqs",
            "The number of requests in the decode prealloc queue.",
            G,
            m,
            0.0,
        );
        e.one(
            "sglang:num_decode_transfer_queue_reqs",
            "The number of requests in the decode transfer queue.",
            G,
            m,
            v.deferred,
        );
        e.one(
            "sglang:num_retracted_requests_total",
            "Total number of retracted requests.",
            C,
            m,
            self.preemptions.get() as f64,
        );
        e.one("sglang:token_usage", "The token usage.", G, m, v.kv);
        e.one(
            "sglang:cache_hit_rate",
            "The prefix cache hit rate.",
            G,
            m,
            self.hit_rate(),
        );
        e.one(
            "sglang:prompt_tokens_total",
            "Number of prefill tokens processed.",
            C,
            m,
            self.prompt_tokens.get() as f64,
        );
        e.one(
            "sglang:generation_tokens_total",
            "Number of generation tokens processed.",
            C,
            m,
            self.generation_tokens.get() as f64,
        );
        e.one(
            "sglang:num_requests_total",
            "Number of requests processed.",
            C,
            m,
            self.finished_total() as f64,
        );
        e.one_histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            m,
            &self.ttft,
        );
        e.one_histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            m,
            &self.itl,
        );
        e.one_histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            m,
            &self.e2e,
        );
    }

    /// TGI's router metrics (`tgi_*`, no labels): queue and batch, no KV usage.
    fn render_tgi(&self, e: &mut Encoder, v: View) {
        use Kind::{Counter as C, Gauge as G};
        // (Neither TGI nor llama.cpp tells waits apart.)
        let queue = v.waiting + v.deferred;
        e.one("tgi_queue_size", "Current queue size", G, "", queue);
        e.one(
            "tgi_batch_current_size",
            "Current batch size",
            G,
            "",
            self.running.get() as f64,
        );
        e.one(
            "tgi_request_count",
            "Total number of requests",
            C,
            "",
            self.received.get() as f64,
        );
    }

    fn render_llamacpp(&self, e: &mut Encoder, cache: CacheInfo, v: View) {
        use Kind::{Counter as C, Gauge as G};
        let kv_tokens = (v.kv * f64::from(cache.num_blocks * cache.block_size)).round();
        e.one(
            "llamacpp:prompt_tokens_total",
            "Number of prompt tokens processed.",
            C,
            "",
            self.prompt_tokens.get() as f64,
        );
        e.one(
            "llamacpp:tokens_predicted_total",
            "Number of generation tokens processed.",
            C,
            "",
            self.generation_tokens.get() as f64,
        );
        e.one(
            "llamacpp:kv_cache_usage_ratio",
            "KV-cache usage. 1 means 100 percent usage.",
            G,
            "",
            v.kv,
        );
        e.one(
            "llamacpp:kv_cache_tokens",
            "KV-cache tokens.",
            G,
            "",
            kv_tokens,
        );
        e.one(
            "llamacpp:requests_processing",
            "Number of requests processing.",
            G,
            "",
            self.running.get() as f64,
        );
        e.one(
            "llamacpp:requests_deferred",
            "Number of requests deferred.",
            G,
            "",
            v.waiting + v.deferred,
        );
    }
}

impl Default for SimMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Reported-pressure overrides (the simulator's `/sim/control`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Overrides {
    pub kv_usage: Option<f64>,
    pub waiting: Option<f64>,
    pub deferred: Option<f64>,
}

/// The values a render reports.
#[derive(Clone, Copy)]
struct View {
    kv: f64,
    /// Waiting for room (vLLM's `reason="capacity"`).
    waiting: f64,
    /// Waiting for anything else (`reason="deferred"`: KV pulls, grammars;
    /// SGLang's decode transfer queue).
    deferred: f64,
}

/// The KV-cache shape reported by `vllm:cache_config_info`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CacheInfo {
    pub block_size: u32,
    pub num_blocks: u32,
    /// CPU blocks of swap space (0: none).
    pub swap_blocks: u32,
    pub prefix_caching: bool,
}
