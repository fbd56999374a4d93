//! The agentic workload of `sluice bench`: coding-agent sessions.
//!
//! Every session re-sends one long shared system + tools prompt, then its own
//! growing history: its task, and per turn the assistant's answer (the text
//! the endpoint streamed back) and a new message, a long tool result in
//! `tool_share` of the turns. Between turns the agent "thinks" (exponential,
//! mean `think`). `concurrency` sessions run at once; a new one starts when
//! one ends, until `sessions` have run. With `session_header`, each request
//! carries `x-session-id` (as agents do); without it, routers only have the
//! prompt to go by.
//!
//! Besides latency, it reports what routing did for the sessions, from the
//! answers themselves (every router passes them through untouched): which
//! replica served each turn (`system_fingerprint`, which `sluice sim` sets to
//! its address), and the engine's prefix-cache hits
//! (`usage.prompt_tokens_details.cached_tokens`). Stickiness is the share of
//! turns after the first served where the previous turn was; the ideal hit
//! rate is what keeping every session whole would give (each turn finds the
//! previous turn's prompt cached, the first one the shared prompt).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::{BenchClient, BenchConfig, Sample, one_with};

/// The agentic workload's knobs.
#[derive(Debug, Clone)]
pub(crate) struct AgenticShape {
    pub sessions: u32,
    /// Mean turns per session (uniform in [turns/2, 3 turns/2], or
    /// heavy-tailed with `heavy_sessions`).
    pub turns: u32,
    /// Session lengths from a Pareto distribution (shape 1.5, about the same mean,
    /// at most 8x the mean): a few long sessions carry much of the work, as
    /// with coding agents, where blind hashing piles them onto one replica.
    pub heavy_sessions: bool,
    /// The shared system + tools prompt.
    pub shared_tokens: u32,
    /// A user message (and the task).
    pub message_tokens: u32,
    /// Share of turns that answer with a long tool result.
    pub tool_share: f64,
    pub tool_tokens: u32,
    pub max_tokens: u32,
    /// Mean think time between turns.
    pub think: Duration,
    pub session_header: bool,
}

/// What routing did for the sessions.
#[derive(Debug, Clone, Serialize, Default)]
pub(crate) struct SessionStats {
    pub sessions: u64,
    pub turns: u64,
    /// Turns after the first served where the previous turn was.
    pub stickiness: f64,
    /// The same, for second turns only (the hardest: a new session's history
    /// is short and the shared prompt is everywhere).
    pub second_turn_stickiness: f64,
    pub replicas_per_session: f64,
    /// Cached prompt tokens / prompt tokens, as the engines reported them.
    pub prefix_hit: f64,
    /// The hit rate if every session stayed whole on one replica.
    pub ideal_prefix_hit: f64,
    /// Turns served per replica.
    pub per_replica: BTreeMap<String, u64>,
    /// The busiest replica's turns over the mean.
    pub busiest_over_mean: f64,
}

/// Which turn a request was (for `--requests-json`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TurnOf {
    pub session: u32,
    /// Its number in the session, from 0.
    pub turn: u32,
    /// It answers a tool result (its new message is `tool_tokens` long).
    pub tool: bool,
}

/// One turn: its sample and what it taught about routing.
struct Turn {
    session: u32,
    index: u32,
    sample: Sample,
    /// Prompt tokens of the previous turn of this session (ideal cache hit).
    previous_prompt: u64,
}

const TOOLS: &str = "[agent system prompt and tool definitions v1] ";

fn tokens_of_text(tokens: u32, salt: &str) -> String {
    super::workload::text_of_tokens(tokens, salt)
}

/// Run the workload; the samples feed the usual report, the turns the stats.
pub(crate) async fn run(
    cfg: &BenchConfig,
    shape: &AgenticShape,
    client: &BenchClient,
    base: &str,
    model: &str,
    started: Instant,
    done: Arc<std::sync::atomic::AtomicU64>,
) -> (Vec<Sample>, SessionStats) {
    let shared = Arc::new(tokens_of_text(shape.shared_tokens, TOOLS));
    let slots = Arc::new(tokio::sync::Semaphore::new(cfg.concurrency));
    let until = cfg.duration.map(|d| started + d);
    let ctx = Arc::new(Ctx {
        client: client.clone(),
        base: base.to_string(),
        model: model.to_string(),
        key: cfg.api_key.clone(),
        shape: shape.clone(),
        shared,
        seed: cfg.seed,
        until,
        started,
        done,
        sent: std::sync::atomic::AtomicU64::new(0),
        ids: cfg.requests_out.is_some(),
    });
    let mut tasks = tokio::task::JoinSet::new();
    for s in 0..shape.sessions {
        if until.is_some_and(|u| Instant::now() >= u) {
            break;
        }
        let Ok(permit) = slots.clone().acquire_owned().await else {
            break;
        };
        let ctx = ctx.clone();
        tasks.spawn(async move {
            let turns = session(&ctx, s).await;
            drop(permit);
            turns
        });
    }
    let mut turns = Vec::new();
    while let Some(t) = tasks.join_next().await {
        turns.extend(t.unwrap_or_default());
    }
    let stats = stats(&turns, shape);
    (turns.into_iter().map(|t| t.sample).collect(), stats)
}

/// What every session of a run shares.
struct Ctx {
    client: BenchClient,
    base: String,
    model: String,
    key: Option<String>,
    shape: AgenticShape,
    shared: Arc<String>,
    seed: u64,
    until: Option<Instant>,
    started: Instant,
    done: Arc<std::sync::atomic::AtomicU64>,
    /// Turns sent so far, over all sessions (each turn's number).
    sent: std::sync::atomic::AtomicU64,
    /// Send each turn's number as `x-request-id` (`--requests-json`), so
    /// that the gateway's access log joins the client's timing.
    ids: bool,
}

async fn session(ctx: &Ctx, s: u32) -> Vec<Turn> {
    let (shape, until) = (&ctx.shape, ctx.until);
    let mut rng = fastrand::Rng::with_seed(ctx.seed ^ (u64::from(s) << 20) ^ 0xa9e7);
    let n = if shape.heavy_sessions {
        heavy_turns(&mut rng, shape.turns)
    } else {
        rng.u32(shape.turns / 2..=shape.turns * 3 / 2).max(1)
    };
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": *ctx.shared}),
        serde_json::json!({"role": "user", "content": tokens_of_text(shape.message_tokens, &format!("#session {s} task: "))}),
    ];
    let id = format!("bench-session-{}-{s}", ctx.seed);
    let mut out = Vec::new();
    let mut previous_prompt = 0;
    let mut tool = false;
    for i in 0..n {
        if until.is_some_and(|u| Instant::now() >= u) {
            break;
        }
        let body = serde_json::json!({
            "model": ctx.model,
            "messages": messages,
            "max_tokens": shape.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let index = ctx.sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let request_id = format!("bench-{index}");
        let mut headers: Vec<(&str, &str)> = Vec::new();
        if shape.session_header {
            headers.push(("x-session-id", &id));
        }
        if ctx.ids {
            headers.push(("x-request-id", &request_id));
        }
        let sent = ctx.started.elapsed();
        let mut sample = one_with(
            &ctx.client,
            &ctx.base,
            ctx.key.as_deref(),
            super::Api::Chat,
            body.to_string(),
            until,
            &headers,
            true,
        )
        .await;
        (sample.index, sample.sent) = (index, sent);
        sample.turn = Some(TurnOf {
            session: s,
            turn: i,
            tool,
        });
        ctx.done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let failed = sample.error.is_some();
        let answer = sample.content.clone().unwrap_or_default();
        let prompt = sample.prompt_tokens;
        out.push(Turn {
            session: s,
            index: i,
            sample,
            previous_prompt,
        });
        if failed {
            break;
        }
        previous_prompt = prompt;
        messages.push(serde_json::json!({"role": "assistant", "content": answer}));
        tool = rng.f64() < shape.tool_share;
        let next = if tool {
            tokens_of_text(shape.tool_tokens, &format!("Tool result {s}.{i}:\n"))
        } else {
            tokens_of_text(shape.message_tokens, &format!("#session {s} turn {i}: "))
        };
        messages.push(serde_json::json!({"role": "user", "content": next}));
        let think = -(1.0 - rng.f64()).ln() * shape.think.as_secs_f64();
        tokio::time::sleep(Duration::from_secs_f64(think)).await;
    }
    out
}

/// Turns of a heavy-tailed session: Pareto with shape 1.5 and scale
/// `mean / 3` (the untruncated mean is `mean`), at most 8x the mean, at least 1.
fn heavy_turns(rng: &mut fastrand::Rng, mean: u32) -> u32 {
    const SHAPE: f64 = 1.5;
    let scale = f64::from(mean) * (SHAPE - 1.0) / SHAPE;
    let u = 1.0 - rng.f64(); // (0, 1]
    let n = scale / u.powf(1.0 / SHAPE);
    (n.round() as u32).clamp(1, mean.saturating_mul(8).max(1))
}

/// Tokens of a `tokens`-long prompt an engine with 16-token blocks can have cached.
fn block_floor(tokens: u64) -> u64 {
    tokens / 16 * 16
}

fn stats(turns: &[Turn], shape: &AgenticShape) -> SessionStats {
    let mut by_session: BTreeMap<u32, Vec<&Turn>> = BTreeMap::new();
    for t in turns {
        by_session.entry(t.session).or_default().push(t);
    }
    let (mut kept, mut later) = (0u64, 0u64);
    let (mut kept2, mut second) = (0u64, 0u64);
    let mut replicas = 0usize;
    let mut per_replica: BTreeMap<String, u64> = BTreeMap::new();
    let (mut cached, mut prompt, mut ideal) = (0u64, 0u64, 0u64);
    // The shared prompt as the approximate tokenizer counts it (3 per message).
    let shared = u64::from(shape.shared_tokens) + 3;
    for ts in by_session.values() {
        let mut seen = std::collections::BTreeSet::new();
        let mut prev: Option<&str> = None;
        for t in ts {
            let s = &t.sample;
            if s.error.is_some() {
                prev = None;
                continue;
            }
            let r = s.replica.as_deref();
            if let Some(r) = r {
                seen.insert(r.to_string());
                *per_replica.entry(r.to_string()).or_insert(0) += 1;
            }
            if t.index > 0
                && let (Some(p), Some(r)) = (prev, r)
            {
                later += 1;
                kept += u64::from(p == r);
                if t.index == 1 {
                    second += 1;
                    kept2 += u64::from(p == r);
                }
            }
            prev = r;
            if let Some(c) = s.cached_tokens {
                cached += c;
                prompt += s.prompt_tokens;
                let best = if t.index == 0 {
                    block_floor(shared.min(s.prompt_tokens.saturating_sub(1)))
                } else {
                    block_floor(t.previous_prompt.min(s.prompt_tokens.saturating_sub(1)))
                };
                ideal += best;
            }
        }
        replicas += seen.len();
    }
    let share = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    let total: u64 = per_replica.values().sum();
    let mean = share(total, per_replica.len() as u64);
    let busiest = per_replica.values().copied().max().unwrap_or(0);
    SessionStats {
        sessions: by_session.len() as u64,
        turns: turns.len() as u64,
        stickiness: share(kept, later),
        second_turn_stickiness: share(kept2, second),
        replicas_per_session: share(replicas as u64, by_session.len() as u64),
        prefix_hit: share(cached, prompt),
        ideal_prefix_hit: share(ideal, prompt),
        per_replica,
        busiest_over_mean: if mean > 0.0 {
            busiest as f64 / mean
        } else {
            0.0
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heavy_sessions_keep_about_the_mean_and_a_long_tail() {
        let mut rng = fastrand::Rng::with_seed(3);
        let n: Vec<u32> = (0..100_000).map(|_| heavy_turns(&mut rng, 12)).collect();
        let mean = n.iter().map(|&x| f64::from(x)).sum::<f64>() / n.len() as f64;
        // Truncated at 8x the mean: a little under 12.
        assert!((9.0..12.5).contains(&mean), "mean {mean}");
        assert!(n.iter().all(|&x| (1..=96).contains(&x)));
        // A tail: some sessions run over four times the mean (uniform never does).
        let long = n.iter().filter(|&&x| x > 48).count() as f64 / n.len() as f64;
        assert!(long > 0.01, "share over 48 turns: {long}");
    }
}
