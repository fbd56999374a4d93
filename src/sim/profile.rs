//! Engine profiles: the numbers that make a simulated replica behave like a
//! model on a GPU. Each is a fit to public vLLM measurements (sources below),
//! not a measurement of ours; they are approximate by design.
//!
//! Step time of one engine iteration (one forward pass over the batch):
//! `step_base + per_seq * sequences_in_batch + per_prefill_token * prompt_tokens_in_step`.
//! - `step_base` is the time of a decode step at batch size 1 (memory-bound:
//!   reading the weights once), i.e. 1 / single-stream tokens per second.
//! - `per_seq` is fitted so that the step time at a large batch matches the
//!   published saturated output throughput (tokens/s = batch / step time).
//! - `per_prefill_token` is 1 / prefill throughput (compute-bound).
//! - `num_blocks` is the KV capacity in 16-token blocks: (GPU memory x 0.9 -
//!   weights - activations) / (2 x layers x KV heads x head dim x 2 bytes) / 16.
//! - `per_swap_block` is the time to copy one KV block between GPU and CPU
//!   memory over PCIe (block bytes / ~25 GB/s effective on Gen5, ~16 GB/s on
//!   Gen4), added to the step that swaps it.
//!
//! Sources:
//! - Llama-3.1-8B on 1x H100 80GB: ~12,500 output tokens/s saturated (BF16,
//!   FlashInfer), morphllm.com/vllm-benchmarks (2026); single-stream decode
//!   ~140 tokens/s and the v0.6 TPOT figures of the vLLM blog "vLLM v0.6.0: 2.7x
//!   Throughput Improvement and 5x Latency Reduction" (2024); KV capacity
//!   cross-checked with a published per-GPU table (543k tokens for this model on
//!   an H100 NVL 94GB; ~470k on 80GB).
//! - Llama-3.1-8B on 1x A100 40GB: ~75 tokens/s single stream, knee at
//!   concurrency 8, 1024-token prompts (johnmusgrave.com, "vLLM throughput-latency
//!   sweep on NVIDIA A100", 2025).
//! - Llama-3.1-70B with tensor parallelism 4 on H100: Lambda Labs'
//!   vllm-benchmark report (v0.6.0 figures: ~2x the A100 throughput, TPOT in the
//!   20-30 ms range at moderate load).

use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Profile {
    pub name: &'static str,
    pub about: &'static str,
    /// Tokens per KV block (vLLM's default is 16).
    pub block_size: u32,
    /// KV-cache capacity in blocks.
    pub num_blocks: u32,
    /// Most sequences in one batch (`--max-num-seqs`).
    pub max_num_seqs: u32,
    /// Token budget of one step (`--max-num-batched-tokens`; chunked prefill).
    pub max_num_batched_tokens: u32,
    pub step_base: Duration,
    pub per_seq: Duration,
    pub per_prefill_token: Duration,
    pub max_model_len: u32,
    /// Automatic prefix caching (`--enable-prefix-caching`); off, every prompt
    /// is computed from scratch.
    pub prefix_caching: bool,
    /// CPU KV blocks for swapping (vLLM V0's `--swap-space`, here in blocks):
    /// 0 preempts by recomputation only; otherwise a preempted sequence's
    /// blocks are copied to CPU memory while they fit, and back later.
    pub swap_blocks: u32,
    /// Time to copy one KV block between GPU and CPU memory.
    pub per_swap_block: Duration,
    /// Chunked prefill (`--enable-chunked-prefill`, on by default): a prompt
    /// is prefilled over several steps in what the step's token budget
    /// leaves. Off, a prompt is prefilled whole in one step, and only when it
    /// fits in what the running decodes leave of the budget (see `engine.rs`).
    pub chunked_prefill: bool,
    /// vLLM's `--scheduling-policy priority`: waiting requests are taken by
    /// their body's `priority` (lower first), then by arrival, and a
    /// sequence preempted for blocks is the lowest-priority one running.
    /// Off (`fcfs`, vLLM's default): arrival order.
    pub priority_scheduling: bool,
    /// When a prompt block the engine computes becomes a prefix-cache hit
    /// for other requests (`--cache-at`).
    pub cache_at: CacheAt,
    /// The GPU, as dcgm-exporter's `modelName` shows it, and how many the
    /// engine runs on (tensor parallelism).
    pub gpu: &'static str,
    pub gpus: u32,
    /// Memory of one GPU, in MiB.
    pub gpu_memory_mib: u32,
    /// Memory of one GPU not in the KV pool: its share of the weights,
    /// activations, CUDA graphs and context, in MiB.
    pub fixed_mib: u32,
    /// KV bytes one token takes on one GPU (2 x layers x KV heads x head dim
    /// x 2 bytes, divided by the tensor-parallel degree).
    pub kv_bytes_per_token: u32,
}

const fn us(n: u64) -> Duration {
    Duration::from_micros(n)
}

const fn ns(n: u64) -> Duration {
    Duration::from_nanos(n)
}

pub(crate) const PROFILES: &[Profile] = &[
    Profile {
        name: "h100-llama3-8b",
        about: "Llama-3.1-8B BF16 on 1x H100 80GB",
        block_size: 16,
        num_blocks: 29_000,
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
        // 140 tok/s single stream; 256 seqs -> ~12,300 tok/s.
        step_base: us(7_100),
        per_seq: us(53),
        // ~20k prompt tokens/s.
        per_prefill_token: us(50),
        max_model_len: 131_072,
        prefix_caching: true,
        swap_blocks: 0,
        // 2 MiB per block (128 KiB per token) at ~25 GB/s (PCIe Gen5).
        per_swap_block: us(80),
        chunked_prefill: true,
        priority_scheduling: false,
        cache_at: CacheAt::Compute,
        gpu: "NVIDIA H100 80GB HBM3",
        gpus: 1,
        gpu_memory_mib: 81_559,
        // 16 GB of weights, ~1.5 GB of activations and context.
        fixed_mib: 16_500,
        kv_bytes_per_token: 131_072,
    },
    Profile {
        name: "a100-llama3-8b",
        about: "Llama-3.1-8B BF16 on 1x A100 40GB",
        block_size: 16,
        // (36 GB - 16 GB weights - ~2 GB) / 128 KiB per token / 16
        num_blocks: 8_600,
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
        // 75 tok/s single stream; 64 seqs -> ~3,500 tok/s.
        step_base: us(13_300),
        per_seq: us(80),
        // 1024-token prompt prefill ~90 ms.
        per_prefill_token: us(88),
        max_model_len: 131_072,
        prefix_caching: true,
        swap_blocks: 0,
        // 2 MiB per block at ~16 GB/s (PCIe Gen4).
        per_swap_block: us(130),
        chunked_prefill: true,
        priority_scheduling: false,
        cache_at: CacheAt::Compute,
        gpu: "NVIDIA A100-SXM4-40GB",
        gpus: 1,
        gpu_memory_mib: 40_960,
        fixed_mib: 16_500,
        kv_bytes_per_token: 131_072,
    },
    Profile {
        name: "h100x4-llama3-70b",
        about: "Llama-3.1-70B BF16, tensor parallel 4 on H100 80GB",
        block_size: 16,
        // (288 GB - 140 GB weights - ~8 GB) / 320 KiB per token / 16
        num_blocks: 27_000,
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
        // ~50 tok/s single stream; 256 seqs -> ~3,600 tok/s.
        step_base: us(20_000),
        per_seq: us(200),
        per_prefill_token: us(125),
        max_model_len: 131_072,
        prefix_caching: true,
        swap_blocks: 0,
        // 5 MiB per block, a quarter on each GPU's own link.
        per_swap_block: us(50),
        chunked_prefill: true,
        priority_scheduling: false,
        cache_at: CacheAt::Compute,
        gpu: "NVIDIA H100 80GB HBM3",
        gpus: 4,
        gpu_memory_mib: 81_559,
        // A quarter of 140 GB of weights, ~2.5 GB of the rest.
        fixed_mib: 36_000,
        kv_bytes_per_token: 81_920,
    },
    Profile {
        name: "tiny",
        about: "a small, fast engine for tests: 4,096 tokens of KV, 16 sequences",
        block_size: 16,
        num_blocks: 256,
        max_num_seqs: 16,
        max_num_batched_tokens: 2048,
        step_base: us(2_000),
        per_seq: us(100),
        per_prefill_token: ns(10_000),
        max_model_len: 4096,
        prefix_caching: true,
        swap_blocks: 0,
        per_swap_block: us(20),
        chunked_prefill: true,
        priority_scheduling: false,
        cache_at: CacheAt::Compute,
        gpu: "NVIDIA L4",
        gpus: 1,
        gpu_memory_mib: 23_034,
        fixed_mib: 1_500,
        kv_bytes_per_token: 65_536,
    },
];

pub(crate) fn by_name(name: &str) -> Option<&'static Profile> {
    PROFILES.iter().find(|p| p.name == name)
}

pub(crate) fn names() -> String {
    PROFILES
        .iter()
        .map(|p| p.name)
        .collect::<Vec<_>>()
        .join(", ")
}

impl Profile {
    /// The prompt blocks admission may take from the prefix cache: whole
    /// blocks short of the last prompt token, which is always computed; none
    /// without prefix caching.
    pub(crate) fn usable_prefix_blocks(&self, prompt_tokens: u32) -> usize {
        if self.prefix_caching {
            (prompt_tokens.saturating_sub(1) / self.block_size) as usize
        } else {
            0
        }
    }

    /// Duration of one step with `seqs` sequences and `prefill` prompt tokens.
    pub(crate) fn step_time(&self, seqs: u32, prefill: u32) -> Duration {
        self.step_base + self.per_seq * seqs + self.per_prefill_token * prefill
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_match_their_sources() {
        let p = by_name("h100-llama3-8b").copied().unwrap_or(PROFILES[0]);
        let single = 1.0 / p.step_time(1, 0).as_secs_f64();
        assert!(
            (120.0..160.0).contains(&single),
            "{single} tok/s single stream"
        );
        let batch = 256.0 / p.step_time(256, 0).as_secs_f64();
        assert!(
            (11_000.0..13_500.0).contains(&batch),
            "{batch} tok/s at 256"
        );
        let kv_tokens = p.num_blocks * p.block_size;
        assert!((400_000..550_000).contains(&kv_tokens));
    }
}

/// `sluice sim --cache-at`: when a prompt block becomes a prefix-cache hit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum CacheAt {
    /// Once the step that computes it has ended (SGLang's radix tree inserts
    /// a prompt's KV after the forward pass).
    #[default]
    Compute,
    /// As soon as the step that computes it is scheduled (vLLM V1's KV cache
    /// manager caches a request's full blocks when it allocates them): a
    /// request admitted in the same step, or while a long prompt's chunks
    /// are in flight, shares them.
    Schedule,
}

/// `sluice sim --scheduling-policy` (vLLM's flag of the same name).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SchedulingPolicy {
    /// Arrival order (vLLM's default).
    #[default]
    Fcfs,
    /// The body's `priority`, lower first, then arrival.
    Priority,
}
