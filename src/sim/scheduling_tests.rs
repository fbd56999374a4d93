//! The engine model's scheduling on tokio's paused clock: deterministic, and
//! as fast as the steps can be computed.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::SimMetrics;
use super::engine::Engine;
use super::profile::{self, CacheAt, Profile};
use super::slot::{Request, Slot};

fn tiny() -> Profile {
    profile::by_name("tiny").copied().expect("the tiny profile")
}

fn submit(engine: &Engine, prompt_tokens: u32, output_tokens: u32, leak: bool) -> Arc<Slot> {
    submit_at(engine, prompt_tokens, output_tokens, leak, 0)
}

fn submit_at(
    engine: &Engine,
    prompt_tokens: u32,
    output_tokens: u32,
    leak: bool,
    priority: i64,
) -> Arc<Slot> {
    submit_request(
        engine,
        prompt_tokens,
        Vec::new(),
        output_tokens,
        leak,
        priority,
    )
}

/// A request for a prompt whose blocks hash to `hashes` (a shared prompt).
fn submit_prompt(engine: &Engine, prompt_tokens: u32, hashes: &[u64]) -> Arc<Slot> {
    submit_request(engine, prompt_tokens, hashes.to_vec(), 2, false, 0)
}

fn submit_request(
    engine: &Engine,
    prompt_tokens: u32,
    hashes: Vec<u64>,
    output_tokens: u32,
    leak: bool,
    priority: i64,
) -> Arc<Slot> {
    let slot = Arc::new(Slot::default());
    engine.submit(
        Request {
            prompt_tokens,
            hashes,
            output_tokens,
            finish_reason: "stop",
            arrival: Instant::now(),
            stall: None,
            leak,
            remote_tokens: 0,
            priority,
        },
        slot.clone(),
    );
    slot
}

#[tokio::test(start_paused = true)]
async fn without_chunked_prefill_a_long_prompt_waits_for_the_decodes() {
    for chunked in [true, false] {
        let mut p = tiny();
        p.max_num_batched_tokens = 100;
        p.chunked_prefill = chunked;
        let (engine, task) = Engine::spawn(p, 1.0, Arc::new(SimMetrics::new()));
        // 10 decodes of 300 tokens (steps of ~3 ms: ~1 s), then a prompt of
        // 95 tokens: more than the 90 the decodes leave of the budget.
        let decodes: Vec<Arc<Slot>> = (0..10).map(|_| submit(&engine, 4, 300, false)).collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let document = submit(&engine, 95, 2, false);
        tokio::time::sleep(Duration::from_millis(200)).await;
        if chunked {
            // A chunk of 90, then the last 5 beside the decodes.
            assert!(document.is_done(), "chunked: served at once");
        } else {
            assert_eq!(document.produced(), 0, "waits while decodes run");
            assert!(decodes.iter().all(|d| !d.is_done()));
        }
        // Once the decodes are done, it runs.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(document.is_done() && decodes.iter().all(|d| d.is_done()));
        task.abort();
    }
}

#[tokio::test(start_paused = true)]
async fn the_priority_policy_admits_by_priority_then_arrival() {
    for priority_scheduling in [false, true] {
        let mut p = tiny();
        // One seat: requests run one after another.
        p.max_num_seqs = 1;
        p.priority_scheduling = priority_scheduling;
        let (engine, task) = Engine::spawn(p, 1.0, Arc::new(SimMetrics::new()));
        let running = submit_at(&engine, 4, 50, false, 0);
        tokio::time::sleep(Duration::from_millis(5)).await;
        // Two free-tier requests queue, then a premium one (vLLM: lower
        // runs earlier) arrives last.
        let free: Vec<Arc<Slot>> = (0..2)
            .map(|_| submit_at(&engine, 4, 50, false, 0))
            .collect();
        tokio::time::sleep(Duration::from_millis(1)).await;
        let premium = submit_at(&engine, 4, 50, false, -10);
        let mut order = Vec::new();
        for _ in 0..2000 {
            tokio::time::sleep(Duration::from_millis(1)).await;
            for (name, s) in [
                ("free0", &free[0]),
                ("free1", &free[1]),
                ("premium", &premium),
            ] {
                if s.produced() > 0 && !order.contains(&name) {
                    order.push(name);
                }
            }
            if order.len() == 3 {
                break;
            }
        }
        assert!(running.is_done());
        let want = if priority_scheduling {
            ["premium", "free0", "free1"]
        } else {
            ["free0", "free1", "premium"]
        };
        assert_eq!(order, want, "priority scheduling {priority_scheduling}");
        task.abort();
    }
}

#[tokio::test(start_paused = true)]
async fn a_prompt_larger_than_the_budget_runs_alone() {
    let mut p = tiny();
    p.max_num_batched_tokens = 100;
    p.chunked_prefill = false;
    let (engine, task) = Engine::spawn(p, 1.0, Arc::new(SimMetrics::new()));
    let long = submit(&engine, 500, 2, false);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(long.is_done());
    task.abort();
}

#[tokio::test(start_paused = true)]
async fn a_preempted_sequence_waits_in_cpu_memory_with_swap_space() {
    // 8 blocks of 16 tokens: two sequences of 64 + 60 tokens do not fit
    // together; with swap space the preempted one waits in CPU memory.
    for swap in [0, 64] {
        let mut p = tiny();
        p.num_blocks = 8;
        p.swap_blocks = swap;
        let metrics = Arc::new(SimMetrics::new());
        let (engine, task) = Engine::spawn(p, 1.0, metrics.clone());
        let slots: Vec<Arc<Slot>> = (0..2).map(|_| submit(&engine, 64, 60, false)).collect();
        let mut most_swapped = 0;
        for _ in 0..500 {
            tokio::time::sleep(Duration::from_millis(10)).await;
            most_swapped = most_swapped.max(metrics.swapped.get());
        }
        assert!(slots.iter().all(|s| s.is_done()), "swap {swap}");
        assert!(metrics.preemptions.get() > 0, "swap {swap}");
        assert_eq!(most_swapped, i64::from(swap > 0), "swap {swap}");
        assert_eq!(metrics.swapped.get(), 0);
        assert_eq!(metrics.cpu_kv_usage.get(), 0.0);
        assert_eq!(metrics.kv_usage(), 0.0);
        task.abort();
    }
}

#[tokio::test(start_paused = true)]
async fn leaked_blocks_stay_until_a_reset() {
    let (engine, task) = Engine::spawn(tiny(), 1.0, Arc::new(SimMetrics::new()));
    let leaky = submit(&engine, 64, 2, true);
    let clean = submit(&engine, 64, 2, false);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(leaky.is_done() && clean.is_done());
    // 66 tokens: 5 blocks of 16.
    assert_eq!(engine.reset().await, 5);
    assert_eq!(engine.reset().await, 0);
    task.abort();
}

#[tokio::test(start_paused = true)]
async fn blocks_cached_at_schedule_are_shared_by_requests_for_a_prompt_being_prefilled() {
    // Two requests for the same prompt arrive together. (prompt tokens,
    // token budget, what the second finds cached: blocks cached once
    // computed, once scheduled.)
    let cases = [
        // The budget holds both prompts: admitted in the same step, the
        // second shares the first's blocks only if they are cached when
        // scheduled (19 of 20 blocks: its last token is always computed).
        (320, 1024, 0, 19 * 16),
        // 640 tokens in chunks of 256: the first takes the whole budget
        // twice, and the second is admitted beside its last chunk, when two
        // chunks are computed and the third is being computed.
        (640, 256, 32 * 16, 39 * 16),
    ];
    for (prompt, budget, once_computed, once_scheduled) in cases {
        for cache_at in [CacheAt::Compute, CacheAt::Schedule] {
            let mut p = tiny();
            p.max_num_batched_tokens = budget;
            p.cache_at = cache_at;
            let (engine, task) = Engine::spawn(p, 1.0, Arc::new(SimMetrics::new()));
            let hashes: Vec<u64> = (1..=u64::from(prompt / 16)).collect();
            let first = submit_prompt(&engine, prompt, &hashes);
            let second = submit_prompt(&engine, prompt, &hashes);
            tokio::time::sleep(Duration::from_secs(1)).await;
            assert!(first.is_done() && second.is_done());
            assert_eq!(first.cached(), 0, "{cache_at:?}, {prompt} tokens");
            let want = match cache_at {
                CacheAt::Compute => once_computed,
                CacheAt::Schedule => once_scheduled,
            };
            assert_eq!(second.cached(), want, "{cache_at:?}, {prompt} tokens");
            task.abort();
        }
    }
}
