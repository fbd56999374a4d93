//! The on-call doctor: the known pathologies of an LLM fleet, named from what
//! the gateway already sees (each replica's scrapes of the last minutes and
//! its own measurements of the requests it sent there).
//!
//! [`diagnose`] is a pure function of those inputs, evaluated on demand
//! (`GET /admin/diagnose`, `sluice diagnose`, and each `/metrics` render for
//! `sluice_diagnosis_active`): a finding lasts exactly as long as its
//! evidence, so it clears by itself when the pathology ends. Thresholds are
//! `doctor.*` (defaults from the reference articles).

mod held;
pub mod report;

pub use held::Held;

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::config::{Config, DoctorConfig};
use crate::telemetry::metrics::{Metrics, ModelVitals, Vitals};
use crate::upstream::pool::{Pool, Replica};
use crate::upstream::signals::LoadSample;

/// Every pathology this module can name (the label values of
/// `sluice_diagnosis_active`).
pub const PATHOLOGIES: &[&str] = &[
    "kv_cache_thrashing",
    "cpu_swapping",
    "prefill_starvation",
    "leaked_kv",
    "slow_replica",
    "uneven_queues",
    "stale_metrics",
    "prefix_cache_misses",
    "error_spike",
    "stalling_streams",
    "underutilisation",
    "prefill_pool_saturated",
    "decode_pool_out_of_kv",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Costs money, hurts nobody (underutilisation): no alert pages for it.
    Info,
    Warning,
    Critical,
}

/// One thing wrong, where, why the doctor thinks so, and what to do.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub pathology: &'static str,
    pub severity: Severity,
    /// The replica ("" for a finding about a tier).
    #[serde(serialize_with = "as_str")]
    pub backend: Arc<str>,
    /// The tier, for a finding about a tenant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    /// The model, for a finding about a model's traffic.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The values the finding rests on.
    pub evidence: serde_json::Map<String, serde_json::Value>,
    /// Seconds of scrapes the evidence was taken over.
    pub window_seconds: f64,
    pub cause: String,
    pub action: String,
    /// Since when it holds (RFC 3339, UTC), and for how long: set where
    /// findings are held ([`Held`]), not by [`diagnose`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub for_seconds: Option<f64>,
    /// Its condition was seen at the latest evaluation; `false` while it is
    /// held after its evidence went (for `gone_seconds`, until
    /// `doctor.clear_after`).
    pub active: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gone_seconds: Option<f64>,
}

fn as_str<S: serde::Serializer>(v: &Arc<str>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(v)
}

/// Fewer predicted cached tokens than this over the window say nothing.
const MIN_PREDICTED_TOKENS: f64 = 1000.0;

/// Fewer requests sent to a replica over the window say nothing of how
/// routing spreads prefixes.
const MIN_SCATTERED_REQUESTS: f64 = 10.0;

/// What the doctor reads of one replica.
struct Patient<'a> {
    replica: &'a Replica,
    /// Scrapes within the window, oldest first.
    samples: Vec<LoadSample>,
}

impl Patient<'_> {
    fn last(&self) -> Option<&LoadSample> {
        self.samples.last()
    }

    fn span(&self) -> f64 {
        match (self.samples.first(), self.samples.last()) {
            (Some(a), Some(b)) => b.at.saturating_duration_since(a.at).as_secs_f64(),
            _ => 0.0,
        }
    }

    /// A counter's increase over the window (a restart counts from 0), and
    /// the seconds it was taken over.
    fn increase(&self, pick: impl Fn(&LoadSample) -> Option<f64>) -> Option<(f64, f64)> {
        let points: Vec<(Instant, f64)> = self
            .samples
            .iter()
            .filter_map(|s| pick(s).map(|v| (s.at, v)))
            .collect();
        let (first, last) = (points.first()?, points.last()?);
        let secs = last.0.saturating_duration_since(first.0).as_secs_f64();
        if secs <= 0.0 {
            return None;
        }
        let mut total = 0.0;
        for w in points.windows(2) {
            let d = w[1].1 - w[0].1;
            total += if d >= 0.0 { d } else { w[1].1 };
        }
        Some((total, secs))
    }

    /// A counter's rate per second over the window.
    fn rate(&self, pick: impl Fn(&LoadSample) -> Option<f64>) -> Option<f64> {
        self.increase(pick).map(|(n, secs)| n / secs)
    }
}

fn evidence(pairs: &[(&str, serde_json::Value)]) -> serde_json::Map<String, serde_json::Value> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_string(), v.clone()))
        .collect()
}

fn round(v: f64, digits: i32) -> serde_json::Value {
    let f = 10f64.powi(digits);
    serde_json::Value::from((v * f).round() / f)
}

/// Mean tokens per request (prompt + generated) the gateway has seen, over
/// every model: the sequence length a KV budget must hold.
fn mean_sequence_tokens(metrics: &Metrics) -> Option<f64> {
    let (mut tokens, mut requests) = (0u64, 0u64);
    metrics.models.for_each(|_, s| {
        tokens += s.prompt_tokens.get() + s.generation_tokens.get();
        requests += s.prompt_tokens_per_request.count();
    });
    (requests > 0).then(|| tokens as f64 / requests as f64)
}

/// Every finding about the fleet now, most severe first.
pub fn diagnose(pool: &Pool, config: &Config, metrics: &Metrics, now: Instant) -> Vec<Finding> {
    let d = &config.doctor;
    let window = d.window.min(crate::upstream::pool::HISTORY);
    let scraping = config.routing.metrics.enabled;
    let policy_name = config.routing.policy.as_str();
    let stale_after = config.routing.metrics.stale_after;
    let replicas = pool.replicas();
    let patients: Vec<Patient<'_>> = replicas
        .iter()
        .filter(|r| r.is_healthy())
        .map(|r| Patient {
            replica: r,
            samples: r
                .history()
                .into_iter()
                .filter(|s| now.saturating_duration_since(s.at) <= window)
                .collect(),
        })
        .collect();
    let mut out = Vec::new();
    for p in &patients {
        let name = p.replica.name.clone();
        let span = p.span();
        let finding = |pathology, severity, ev, cause: String, action: String| Finding {
            severity,
            ..Finding::warning(pathology, name.clone(), ev, span, cause, action)
        };
        // Stale metrics: the replica answers health checks, its metrics do not.
        if scraping {
            let age = p
                .replica
                .load()
                .map(|s| now.saturating_duration_since(s.at));
            // Never read yet: stale only once it had the time to be read.
            let stale = match age {
                Some(a) => a > stale_after,
                None => p.replica.known_for() > stale_after,
            };
            if stale {
                out.push(finding(
                    "stale_metrics",
                    Severity::Warning,
                    evidence(&[
                        (
                            "metrics_age_seconds",
                            age.map_or(serde_json::Value::Null, |a| round(a.as_secs_f64(), 1)),
                        ),
                        ("stale_after_seconds", round(stale_after.as_secs_f64(), 1)),
                    ]),
                    "its /metrics has not been read recently: routing treats it as saturated and flow control cannot see its pressure".into(),
                    "check that the engine serves /metrics on the API port and that nothing blocks it (routing.metrics.engine names the dialect)".into(),
                ));
                continue;
            }
        }
        let Some(last) = p.last() else { continue };
        let kv = last.kv_usage.unwrap_or(0.0);
        let waiting = last.queue().unwrap_or(0.0);
        let ttft = p.replica.ttft_recent.fresh(window);
        let tpot = p.replica.tpot_recent.fresh(window);

        // KV-cache thrashing: preempting, and full at some scrape of the
        // window (the scrape after a preemption may see the blocks it freed).
        let kv_max = p
            .samples
            .iter()
            .filter_map(|s| s.kv_usage)
            .fold(kv, f64::max);
        if let Some(rate) = p.rate(|s| s.preemptions)
            && kv_max >= d.thrashing_kv
            && rate >= d.thrashing_preemptions_per_second
        {
            let mut ev = vec![
                ("kv_cache_usage", round(kv, 3)),
                ("kv_cache_usage_max", round(kv_max, 3)),
                ("preemptions_per_second", round(rate, 2)),
            ];
            if let Some(t) = ttft {
                ev.push(("ttft_recent_seconds", round(t, 3)));
            }
            let safe = match (
                last.num_blocks,
                last.block_size,
                mean_sequence_tokens(metrics),
            ) {
                (Some(blocks), Some(size), Some(len)) if len > 0.0 => {
                    let n = (f64::from(blocks) * f64::from(size) * 0.85 / len).floor();
                    ev.push(("kv_blocks", serde_json::Value::from(blocks)));
                    ev.push(("mean_sequence_tokens", round(len, 0)));
                    ev.push(("safe_max_num_seqs", round(n, 0)));
                    format!(
                        "reduce --max-num-seqs to {n} (85% of {blocks} blocks x {size} tokens / {len:.0} tokens per sequence), or add KV memory (quantised KV cache, more GPUs)"
                    )
                }
                _ => {
                    "reduce --max-num-seqs, or add KV memory (quantised KV cache, more GPUs)".into()
                }
            };
            out.push(finding(
                "kv_cache_thrashing",
                Severity::Critical,
                evidence(&ev),
                "more running sequences than the KV cache holds: the engine evicts sequences and recomputes them later".into(),
                safe,
            ));
        }
        // CPU swapping.
        let swapped = last.swapped.unwrap_or(0.0);
        let cpu_kv = last.cpu_kv_usage.unwrap_or(0.0);
        if swapped > 0.0 || cpu_kv > 0.0 {
            out.push(finding(
                "cpu_swapping",
                Severity::Critical,
                evidence(&[
                    ("requests_swapped", round(swapped, 0)),
                    ("cpu_kv_cache_usage", round(cpu_kv, 3)),
                ]),
                "KV blocks are swapped to CPU memory: generation stalls mid-stream".into(),
                "reduce --max-num-seqs (or --swap-space 0 to preempt by recomputation instead), or add KV memory".into(),
            ));
        }
        // Prefill starvation: first tokens slow, decode fine, the queue long
        // and not draining. "Not draining" rather than "growing": the queue
        // in front of a starved engine stops growing once every client has a
        // request in it (closed-loop clients, or flow control's seats), and
        // the pathology is just as real on that plateau.
        let first_waiting = p.samples.first().and_then(LoadSample::queue).unwrap_or(0.0);
        if let (Some(t), Some(itl)) = (ttft, tpot)
            && t > d.starvation_ttft.as_secs_f64()
            && itl < d.starvation_itl.as_secs_f64()
            && waiting >= d.starvation_queue
            && waiting >= first_waiting
        {
            out.push(finding(
                "prefill_starvation",
                Severity::Warning,
                evidence(&[
                    ("ttft_recent_seconds", round(t, 3)),
                    ("time_per_output_token_seconds", round(itl, 4)),
                    ("requests_waiting", round(waiting, 0)),
                    ("requests_waiting_at_window_start", round(first_waiting, 0)),
                ]),
                "running decodes keep new requests from their prefill: the queue stays long while streams run fast".into(),
                "enable chunked prefill (--enable-chunked-prefill, --max-num-batched-tokens 2048), or lower --max-num-seqs to leave room for prefill".into(),
            ));
        }
        // Prefix-cache misses: the engine's hit rate low over the window
        // although the prompts share prefixes. Which problem: routing sent
        // prompts where their prefix was cached and the engine no longer had
        // it (cache size, or caching off); or routing scattered them (most
        // requests sent here carry a prefix last sent to another replica).
        if let (Some((hits, _)), Some((queries, _))) = (
            p.increase(|s| s.prefix_hits),
            p.increase(|s| s.prefix_queries),
        ) && queries > 0.0
            && hits / queries < d.prefix_hit_low
        {
            let total =
                |pick: fn(&LoadSample) -> Option<f64>| p.increase(pick).map_or(0.0, |x| x.0);
            let (predicted, actual) = (total(|s| s.cached_predicted), total(|s| s.cached_actual));
            let (sent, elsewhere) = (total(|s| s.attempts), total(|s| s.prefix_elsewhere));
            if predicted >= MIN_PREDICTED_TOKENS && actual < d.prefix_shortfall * predicted {
                out.push(finding(
                    "prefix_cache_misses",
                    Severity::Warning,
                    evidence(&[
                        ("engine_prefix_hit_rate", round(hits / queries, 3)),
                        ("cached_tokens_predicted", round(predicted, 0)),
                        ("cached_tokens_reported", round(actual, 0)),
                    ]),
                    "a cache-size problem, not routing: routing keeps prompts that share a prefix together, but the engine no longer holds the prefixes it was sent (evicted before they are reused), or prefix caching is off".into(),
                    "enable prefix caching (--enable-prefix-caching), give the replica more KV memory, or add replicas so each holds fewer distinct prefixes".into(),
                ));
            } else if sent >= MIN_SCATTERED_REQUESTS && elsewhere >= 0.5 * sent {
                out.push(finding(
                    "prefix_cache_misses",
                    Severity::Warning,
                    evidence(&[
                        ("engine_prefix_hit_rate", round(hits / queries, 3)),
                        ("requests_sent", round(sent, 0)),
                        ("prefix_last_sent_elsewhere", round(elsewhere, 0)),
                    ]),
                    "a routing problem: most requests sent here carry a prefix that was last sent to another replica, so every replica must hold every prefix and none keeps them".into(),
                    format!(
                        "route by prefix (routing.policy: prefix_kv, the default; it is {}), or find why prompts leave their prefix's home (load spills: the homes' queues and KV pressure)",
                        policy_name
                    ),
                ));
            }
        }
        // Leaked KV: memory held that no running sequence accounts for.
        if let Some(l) = leak(p, d, now) {
            out.push(finding(
                "leaked_kv",
                Severity::Warning,
                evidence(&[
                    ("kv_cache_usage", round(kv, 3)),
                    ("kv_cache_usage_floor", round(l.floor, 3)),
                    ("kv_held_with_nothing_running", round(l.idle, 3)),
                    ("requests_running_min", round(l.running_min, 0)),
                    ("requests_running_max", round(l.running_max, 0)),
                    ("held_seconds", round(l.held, 1)),
                ]),
                "KV blocks stay allocated that no running request accounts for: finished or aborted requests did not free them".into(),
                "restart the replica (drain it first); report the engine version: some exit path does not free its blocks".into(),
            ));
        }
    }
    // Across replicas: one much slower than its peers; queues piled on one.
    let tpots: Vec<(usize, f64)> = patients
        .iter()
        .enumerate()
        .filter_map(|(i, p)| p.replica.tpot_recent.fresh(window).map(|t| (i, t)))
        .collect();
    if tpots.len() >= 2 {
        for &(i, t) in &tpots {
            let mut others: Vec<f64> = tpots
                .iter()
                .filter(|(j, _)| *j != i)
                .map(|(_, t)| *t)
                .collect();
            others.sort_by(f64::total_cmp);
            let median = others[others.len() / 2];
            if median > 0.0 && t >= d.slow_factor * median {
                let p = &patients[i];
                out.push(Finding::warning(
                    "slow_replica",
                    p.replica.name.clone(),
                    evidence(&[
                        ("time_per_output_token_seconds", round(t, 4)),
                        ("peers_median_seconds", round(median, 4)),
                        ("factor", round(t / median, 1)),
                    ]),
                    window.as_secs_f64(),
                    "it generates much slower than the replicas serving the same traffic: a degraded GPU, throttling, a noisy neighbour, or a different engine configuration",
                    "compare its GPU clocks and temperature, engine flags and version with its peers; drain it if it does not recover",
                ));
            }
        }
    }
    let queues: Vec<(usize, f64)> = patients
        .iter()
        .enumerate()
        .filter_map(|(i, p)| p.last().and_then(LoadSample::queue).map(|w| (i, w)))
        .collect();
    if queues.len() >= 2 {
        for &(i, w) in &queues {
            let others: Vec<f64> = queues
                .iter()
                .filter(|(j, _)| *j != i)
                .map(|(_, w)| *w)
                .collect();
            let mean = others.iter().sum::<f64>() / others.len() as f64;
            if w >= d.uneven_queue && w >= d.uneven_factor * (mean + 1.0) {
                let p = &patients[i];
                out.push(Finding::warning(
                    "uneven_queues",
                    p.replica.name.clone(),
                    evidence(&[
                        ("requests_waiting", round(w, 0)),
                        ("peers_mean_waiting", round(mean, 1)),
                    ]),
                    0.0,
                    "requests queue on this replica while its peers have room: routing keeps sending there (a hot prefix or session home), or it is slower",
                    "check the dashboard's routing decisions (affinity share) and this replica's speed; routing.prefix_kv.load_factor bounds a hot prefix",
                ));
            }
        }
    }
    underused(&patients, d, window, &mut out);
    pools(&patients, &mut out);
    from_journal(metrics, d, window, now, &mut out);
    throughput(metrics, d, window, now, &mut out);
    out.sort_by_key(|f| std::cmp::Reverse(f.severity));
    out
}

/// The evidence of a leak on one replica.
struct Leak {
    /// The lowest KV usage over `leak_for`.
    floor: f64,
    /// The usage it would hold with nothing running (see [`leak`]).
    idle: f64,
    running_min: f64,
    running_max: f64,
    /// Seconds of scrapes it was read over.
    held: f64,
}

/// A KV floor that stays high while running sequences come and go: over the
/// scrapes of the last `leak_for` (covering at least 80% of it), the lowest
/// KV usage is at or above `leak_kv`, and so is what the replica would hold
/// with nothing running: the usage at its fewest running sequences less
/// what they hold, read off the line through its scrapes with the fewest
/// and the most running (a replica always at one batch size says nothing:
/// no line; one that ran nothing holds what it shows). A busy replica whose
/// usage follows its batch extends to about zero, however full it runs; a
/// replica that still serves traffic but never frees a leaked share keeps
/// that share at every batch size.
fn leak(p: &Patient<'_>, d: &DoctorConfig, now: Instant) -> Option<Leak> {
    let recent: Vec<(f64, f64, Instant)> = p
        .samples
        .iter()
        .filter(|s| now.saturating_duration_since(s.at) <= d.leak_for)
        .filter_map(|s| Some((s.kv_usage?, s.running.unwrap_or(0.0), s.at)))
        .collect();
    let (first, last) = (recent.first()?, recent.last()?);
    let held = last.2.saturating_duration_since(first.2);
    if held.as_secs_f64() < 0.8 * d.leak_for.as_secs_f64() || recent.len() < 3 {
        return None;
    }
    let floor = recent.iter().map(|r| r.0).fold(f64::INFINITY, f64::min);
    let running_min = recent.iter().map(|r| r.1).fold(f64::INFINITY, f64::min);
    let running_max = recent.iter().map(|r| r.1).fold(0.0, f64::max);
    // The mean usage at the fewest and at the most running sequences.
    let mean_at = |r: f64| {
        let at: Vec<f64> = recent.iter().filter(|x| x.1 == r).map(|x| x.0).collect();
        at.iter().sum::<f64>() / at.len().max(1) as f64
    };
    let (low, high) = (mean_at(running_min), mean_at(running_max));
    let idle = if running_min == 0.0 {
        low
    } else if running_max > running_min {
        let per_sequence = ((high - low) / (running_max - running_min)).max(0.0);
        low - per_sequence * running_min
    } else {
        return None;
    };
    (floor >= d.leak_kv && idle >= d.leak_kv).then_some(Leak {
        floor,
        idle,
        running_min,
        running_max,
        held: held.as_secs_f64(),
    })
}

/// A disaggregated fleet's pools: every prefill replica's queue persisting
/// over most of the window (the prefill pool is too small for the prompts
/// sent to it), or every decode replica preempting or keeping a queue
/// (the decode pool is out of KV: vLLM preempts; SGLang's decode replicas
/// retract, or hold new requests in their prealloc queue until KV frees up,
/// as a decode replica out of seats holds them in its waiting queue; its
/// requests waiting for their prefill or their KV are no queue). Named on
/// each replica of the pool; the action says which pool to grow.
fn pools(patients: &[Patient<'_>], out: &mut Vec<Finding>) {
    use crate::config::Role;
    let of = |role: Role| -> Vec<&Patient<'_>> {
        patients
            .iter()
            .filter(|p| p.replica.role == role && p.samples.len() >= 3)
            .collect()
    };
    // The share of a replica's scrapes of which `pick` holds.
    let share = |p: &Patient<'_>, pick: fn(&LoadSample) -> bool| {
        p.samples.iter().filter(|s| pick(s)).count() as f64 / p.samples.len() as f64
    };
    let queued_share = |p: &Patient<'_>| share(p, |s| s.queue().unwrap_or(0.0) >= 1.0);
    let prefill = of(Role::Prefill);
    if !prefill.is_empty() && prefill.iter().all(|p| queued_share(p) >= 0.8) {
        for p in &prefill {
            out.push(Finding::warning(
                "prefill_pool_saturated",
                p.replica.name.clone(),
                evidence(&[
                    ("share_of_scrapes_with_requests_waiting", round(queued_share(p), 2)),
                    ("requests_waiting", round(p.last().and_then(LoadSample::queue).unwrap_or(0.0), 0)),
                    ("prefill_replicas", serde_json::Value::from(prefill.len())),
                ]),
                p.span(),
                "every prefill replica keeps a queue: the prompts sent to the prefill pool outrun it, and wait there",
                "add prefill replicas; meanwhile a decode replica that decodes nothing prefills what the pool would queue (local_idle in sluice_pd_decisions_total), and with routing.disaggregation.local_max_tokens above 0 so do the others, within that bound (local_pool_busy)",
            ));
        }
    }
    let decode = of(Role::Decode);
    let preempting = |p: &Patient<'_>| p.rate(|s| s.preemptions).is_some_and(|r| r > 0.0);
    // A queue that outlives a scrape (every SGLang decode leg passes its
    // prealloc queue on the way in), and only where the engine tells
    // requests pulling their KV apart: an older vLLM counts a slow pull as
    // waiting (kv_transfer_slow names that).
    let persisting_share = |p: &Patient<'_>| share(p, |s| s.queued);
    let decode_queued = |p: &Patient<'_>| {
        p.samples.iter().all(|s| s.deferred.is_some()) && persisting_share(p) >= 0.8
    };
    if !decode.is_empty()
        && (decode.iter().all(|p| preempting(p)) || decode.iter().all(|p| decode_queued(p)))
    {
        for p in &decode {
            out.push(Finding {
                severity: Severity::Critical,
                ..Finding::warning(
                    "decode_pool_out_of_kv",
                    p.replica.name.clone(),
                    evidence(&[
                        ("preemptions_per_second", round(p.rate(|s| s.preemptions).unwrap_or(0.0), 2)),
                        ("share_of_scrapes_with_a_persisting_queue", round(persisting_share(p), 2)),
                        ("kv_cache_usage", round(p.last().and_then(|s| s.kv_usage).unwrap_or(0.0), 3)),
                        ("decode_replicas", serde_json::Value::from(decode.len())),
                    ]),
                    p.span(),
                    "every decode replica preempts, or keeps requests waiting for room: the sequences the pool generates do not fit its KV cache (or its seats)",
                    "add decode replicas (or KV memory: a quantised KV cache, more GPUs); lower max_tokens for the tiers that drive the load",
                )
            });
        }
    }
}

/// How little a replica did over the window.
struct Underuse {
    batch_p50: f64,
    running_mean: f64,
    waiting_max: f64,
    gpu_util: Option<f64>,
}

/// Whether `p` ran small batches with no queue over the whole window (and
/// an idle GPU, where its DCGM exporter says).
fn underuse(p: &Patient<'_>, d: &DoctorConfig, window: std::time::Duration) -> Option<Underuse> {
    // The whole window must be covered: a replica that just started, or a
    // lull that just began, is not a trend.
    if p.samples.len() < 3 || p.span() < 0.8 * window.as_secs_f64() {
        return None;
    }
    let mut running = p
        .samples
        .iter()
        .map(|s| s.running)
        .collect::<Option<Vec<f64>>>()?;
    let running_mean = running.iter().sum::<f64>() / running.len() as f64;
    running.sort_by(f64::total_cmp);
    let batch_p50 = running[running.len() / 2];
    let waiting_max = p
        .samples
        .iter()
        .filter_map(LoadSample::queue)
        .fold(0.0, f64::max);
    let gpus: Vec<f64> = p.samples.iter().filter_map(|s| s.gpu_util).collect();
    let gpu_util = (!gpus.is_empty()).then(|| gpus.iter().sum::<f64>() / gpus.len() as f64);
    (batch_p50 < d.underused_batch
        && waiting_max < d.underused_queue
        && gpu_util.is_none_or(|g| g < d.underused_gpu))
    .then_some(Underuse {
        batch_p50,
        running_mean,
        waiting_max,
        gpu_util,
    })
}

/// Underutilisation (information, not harm): replicas running small batches
/// with nothing waiting over the whole window. The action counts how many
/// replicas would carry the fleet's running sequences at the target batch.
fn underused(
    patients: &[Patient<'_>],
    d: &DoctorConfig,
    window: std::time::Duration,
    out: &mut Vec<Finding>,
) {
    let found: Vec<(&Patient<'_>, Underuse)> = patients
        .iter()
        .filter_map(|p| underuse(p, d, window).map(|u| (p, u)))
        .collect();
    if found.is_empty() {
        return;
    }
    let fleet_running: f64 = patients
        .iter()
        .filter_map(|p| {
            let r: Vec<f64> = p.samples.iter().filter_map(|s| s.running).collect();
            (!r.is_empty()).then(|| r.iter().sum::<f64>() / r.len() as f64)
        })
        .sum();
    let needed = (fleet_running / d.underused_batch).ceil().max(1.0);
    let all = found.len() == patients.len();
    for (p, u) in found {
        let mut ev = vec![
            ("batch_p50", round(u.batch_p50, 1)),
            ("running_mean", round(u.running_mean, 2)),
            ("waiting_max", round(u.waiting_max, 0)),
        ];
        if let Some(g) = u.gpu_util {
            ev.push(("gpu_utilization_mean", round(g, 3)));
        }
        ev.push(("fleet_running_mean", round(fleet_running, 1)));
        let (cause, action) = if all {
            (
                "the whole fleet runs small batches with nothing waiting: traffic is low for its size".to_string(),
                format!(
                    "{needed:.0} of {} replicas would hold the fleet's {fleet_running:.1} running sequences at a batch of {:.0}: scale in; if clients are held back (429s, flow control waiting), raise the tier limits or max_concurrency instead",
                    patients.len(),
                    d.underused_batch
                ),
            )
        } else {
            (
                "this replica runs small batches with nothing waiting while its peers are busier: routing sends it little (prefix or session homes elsewhere)".to_string(),
                "compare the replicas' shares on the dashboard's routing row; routing.prefix_kv.load_factor bounds how much a hot prefix piles on its home".to_string(),
            )
        };
        out.push(Finding {
            severity: Severity::Info,
            ..Finding::warning(
                "underutilisation",
                p.replica.name.clone(),
                evidence(&ev),
                p.span(),
                cause,
                action,
            )
        });
    }
}

/// The journal's entries that the counter-based findings compare.
struct Span<'a> {
    /// The oldest entry kept (the start of a baseline).
    oldest: &'a Vitals,
    /// The first entry within the window, and the newest.
    first: &'a Vitals,
    last: &'a Vitals,
    /// Seconds from `first` to `last`.
    secs: f64,
}

/// Findings from the journal of counters (per tier, per replica, per model).
fn from_journal(
    metrics: &Metrics,
    d: &DoctorConfig,
    window: std::time::Duration,
    now: Instant,
    out: &mut Vec<Finding>,
) {
    let journal = metrics.journal.lock();
    let (Some(oldest), Some(first), Some(last)) = (
        journal.front(),
        journal
            .iter()
            .find(|v| now.saturating_duration_since(v.at) <= window),
        journal.back(),
    ) else {
        return;
    };
    let secs = last.at.saturating_duration_since(first.at).as_secs_f64();
    if secs <= 0.0 {
        return;
    }
    let span = Span {
        oldest,
        first,
        last,
        secs,
    };
    tenants(&span, d, out);
    errors(&span, d, out);
    drift(&span, d, window, out);
    kv_transfers(&span, d, out);
}

/// A disaggregated model whose decode legs wait long for the prefilled KV:
/// over the window, the mean time from a decode leg's send to its first
/// token after a remote prefill (`sluice_pd_decode_first_token_seconds`: the
/// KV transfer and one decode step, tens of milliseconds on a healthy RDMA
/// or NVLink path) at or above `doctor.kv_transfer_slow`. Named on the model
/// (the gateway times the legs per model), as the drift findings are.
fn kv_transfers(span: &Span<'_>, d: &DoctorConfig, out: &mut Vec<Finding>) {
    for m in &span.last.models {
        let before = span
            .first
            .models
            .iter()
            .find(|x| x.model == m.model)
            .cloned()
            .unwrap_or_default();
        let n = m.kv_waits.saturating_sub(before.kv_waits);
        if n < d.drift_min_requests {
            continue;
        }
        let mean = (m.kv_wait_sum - before.kv_wait_sum) / n as f64;
        if mean < d.kv_transfer_slow.as_secs_f64() {
            continue;
        }
        out.push(Finding {
            model: Some(m.model.to_string()),
            ..Finding::warning(
                "kv_transfer_slow",
                Arc::from(""),
                evidence(&[
                    ("mean_decode_first_token_seconds", round(mean, 3)),
                    ("remote_prefills", serde_json::Value::from(n)),
                ]),
                span.secs,
                "after a remote prefill, the decode replicas wait long for the prefilled KV: a slow or congested transfer path (a KV connector over TCP instead of RDMA, a saturated NIC), or decode replicas out of KV",
                "check the KV connector's transport and the network between the pools; look for decode_pool_out_of_kv; meanwhile routing.disaggregation.local_max_tokens above 0 prefills prompts the decode replicas mostly hold there",
            )
        });
    }
}

impl Finding {
    /// A warning about `backend` ("" for a tier or a model), over `secs`.
    fn warning(
        pathology: &'static str,
        backend: Arc<str>,
        evidence: serde_json::Map<String, serde_json::Value>,
        secs: f64,
        cause: impl Into<String>,
        action: impl Into<String>,
    ) -> Self {
        Finding {
            pathology,
            severity: Severity::Warning,
            backend,
            tier: None,
            model: None,
            evidence,
            window_seconds: (secs * 10.0).round() / 10.0,
            cause: cause.into(),
            action: action.into(),
            since: None,
            for_seconds: None,
            active: true,
            gone_seconds: None,
        }
    }
}

/// A replica failing a share of the attempts sent to it, by kind; or whose
/// streams stall.
fn errors(span: &Span<'_>, d: &DoctorConfig, out: &mut Vec<Finding>) {
    for b in &span.last.backends {
        let before = span.first.backends.iter().find(|x| x.name == b.name);
        let sent = b.attempts.saturating_sub(before.map_or(0, |x| x.attempts));
        let stalls = b.stalls.saturating_sub(before.map_or(0, |x| x.stalls));
        if stalls >= d.stall_min && stalls as f64 >= d.stall_share * sent as f64 {
            out.push(Finding::warning(
                "stalling_streams",
                b.name.clone(),
                evidence(&[
                    ("stalls", serde_json::Value::from(stalls)),
                    ("attempts", serde_json::Value::from(sent)),
                ]),
                span.secs,
                "its streams go silent mid-generation (gaps over telemetry.stall_threshold): preemption, CPU swapping, a stuck engine step, or the network",
                "look at its KV usage and preemptions (kv_cache_thrashing, cpu_swapping findings), then its engine log and network; traces with sluice.max_gap_seconds show which requests",
            ));
        }
        let mut by_kind: Vec<(&'static str, u64)> = b
            .failed
            .iter()
            .map(|(k, n)| {
                let was = before
                    .and_then(|x| x.failed.iter().find(|(bk, _)| bk == k))
                    .map_or(0, |(_, n)| *n);
                (*k, n.saturating_sub(was))
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        let failed: u64 = by_kind.iter().map(|(_, n)| n).sum();
        if sent == 0 || failed < d.error_min || (failed as f64) < d.error_share * sent as f64 {
            continue;
        }
        by_kind.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
        let kinds: serde_json::Map<String, serde_json::Value> = by_kind
            .iter()
            .map(|(k, n)| ((*k).to_string(), serde_json::Value::from(*n)))
            .collect();
        out.push(Finding::warning(
            "error_spike",
            b.name.clone(),
            evidence(&[
                ("failed_share", round(failed as f64 / sent as f64, 3)),
                ("attempts", serde_json::Value::from(sent)),
                ("failed_by_kind", serde_json::Value::Object(kinds)),
            ]),
            span.secs,
            format!(
                "attempts sent to it fail, mostly `{}`: see the upstream errors of that kind in the gateway's log",
                by_kind[0].0
            ),
            "check the replica's own log and health; connect and timeout kinds point at the network or an overloaded engine, upstream_status at the engine refusing requests; passive health ejects it after consecutive failures",
        ));
    }
}

/// A model's output length or TTFT far from its own recent baseline: the
/// window against the journal before it (up to 10 minutes).
fn drift(span: &Span<'_>, d: &DoctorConfig, window: std::time::Duration, out: &mut Vec<Finding>) {
    if std::ptr::eq(span.oldest, span.first) {
        // No baseline older than the window yet.
        return;
    }
    let find = |v: &Vitals, m: &str| {
        v.models
            .iter()
            .find(|x| &*x.model == m)
            .cloned()
            .unwrap_or_default()
    };
    // The mean of `sum` per `n` between two entries, over enough requests.
    let mean = |from: &ModelVitals,
                to: &ModelVitals,
                n: fn(&ModelVitals) -> u64,
                sum: fn(&ModelVitals) -> f64| {
        let count = n(to).saturating_sub(n(from));
        (count >= d.drift_min_requests).then(|| (sum(to) - sum(from)) / count as f64)
    };
    let secs = window.as_secs_f64();
    for m in &span.last.models {
        // Baseline: oldest -> first; now: first -> last.
        let (a, b) = (find(span.oldest, &m.model), find(span.first, &m.model));
        let model = Some(m.model.to_string());
        if let (Some(base), Some(cur)) = (
            mean(&a, &b, |x| x.generations, |x| x.generated_tokens),
            mean(&b, m, |x| x.generations, |x| x.generated_tokens),
        ) && base > 0.0
            && (cur >= d.drift_factor * base || cur * d.drift_factor <= base)
        {
            out.push(Finding {
                model: model.clone(),
                ..Finding::warning(
                    "output_length_drift",
                    Arc::from(""),
                    evidence(&[
                        ("mean_output_tokens", round(cur, 1)),
                        ("baseline_mean_output_tokens", round(base, 1)),
                    ]),
                    secs,
                    "answers are much longer or shorter than a few minutes ago: a changed client, prompt template or model, or answers cut short (truncation, empty answers)",
                    "compare the quality signals (sluice_quality_*: length finishes, empty answers) and what changed in clients or the model's deployment",
                )
            });
        }
        if let (Some(base), Some(cur)) = (
            mean(&a, &b, |x| x.first_tokens, |x| x.ttft_sum),
            mean(&b, m, |x| x.first_tokens, |x| x.ttft_sum),
        ) && base > 0.0
            && cur >= d.drift_factor * base
        {
            out.push(Finding {
                model,
                ..Finding::warning(
                    "latency_drift",
                    Arc::from(""),
                    evidence(&[
                        ("mean_ttft_seconds", round(cur, 3)),
                        ("baseline_mean_ttft_seconds", round(base, 3)),
                    ]),
                    secs,
                    "time to first token is far above its own recent baseline: more load than the fleet serves, longer prompts, or a degraded replica",
                    "look at the replicas' queues and KV usage and the other findings; flow control sheds the lowest band when the fleet stays full",
                )
            });
        }
    }
}

/// A model generating `drift_factor` times fewer tokens per second over the
/// window than over the same span `doctor.baseline` ago, while its traffic
/// held (requests ending at 80% of the rate then or more: less traffic is
/// not a pathology). The evidence says which of the three it is: shorter
/// answers, fewer requests completing, or slower generation.
fn throughput(
    metrics: &Metrics,
    d: &DoctorConfig,
    window: std::time::Duration,
    now: Instant,
    out: &mut Vec<Finding>,
) {
    let (then_start, then_end) = match (
        now.checked_sub(d.baseline + window),
        now.checked_sub(d.baseline),
    ) {
        (Some(a), Some(b)) => (a, b),
        _ => return,
    };
    // The newest entry at or before `t`, and the first within the window.
    let (now_pair, then_pair) = {
        let h = metrics.history.lock();
        let at_or_before = |t: Instant| h.iter().rev().find(|v| v.at <= t).cloned();
        let j = metrics.journal.lock();
        let first = j
            .iter()
            .find(|v| now.saturating_duration_since(v.at) <= window)
            .cloned();
        (
            first.zip(j.back().cloned()),
            at_or_before(then_start).zip(at_or_before(then_end)),
        )
    };
    let (Some((n0, n1)), Some((t0, t1))) = (now_pair, then_pair) else {
        return;
    };
    let (secs_now, secs_then) = (
        n1.at.saturating_duration_since(n0.at).as_secs_f64(),
        t1.at.saturating_duration_since(t0.at).as_secs_f64(),
    );
    // Half the window at least on each side: a baseline too thin says nothing.
    let half = window.as_secs_f64() / 2.0;
    if secs_now < half || secs_then < half {
        return;
    }
    let find = |v: &Vitals, m: &str| {
        v.models
            .iter()
            .find(|x| &*x.model == m)
            .cloned()
            .unwrap_or_default()
    };
    for m in &n1.models {
        let (a, b) = (find(&t0, &m.model), find(&t1, &m.model));
        let c = find(&n0, &m.model);
        let (done_then, done_now) = (
            b.generations.saturating_sub(a.generations),
            m.generations.saturating_sub(c.generations),
        );
        let (asked_then, asked_now) = (
            b.requests.saturating_sub(a.requests) as f64 / secs_then,
            m.requests.saturating_sub(c.requests) as f64 / secs_now,
        );
        if done_then < d.drift_min_requests {
            continue;
        }
        let tokens_then = (b.generated_tokens - a.generated_tokens) / secs_then;
        let tokens_now = (m.generated_tokens - c.generated_tokens) / secs_now;
        if tokens_then <= 0.0
            || tokens_now * d.drift_factor > tokens_then
            || asked_now < 0.8 * asked_then
        {
            continue;
        }
        let per_then = (b.generated_tokens - a.generated_tokens) / done_then as f64;
        let per_now = if done_now > 0 {
            (m.generated_tokens - c.generated_tokens) / done_now as f64
        } else {
            0.0
        };
        let completed_then = done_then as f64 / secs_then;
        let completed_now = done_now as f64 / secs_now;
        let cause = if completed_now * 1.5 < completed_then {
            "the same traffic arrives but fewer requests complete: errors, refusals or timeouts (see the error and tenant findings and sluice_requests_total by status)"
        } else if per_now * 1.5 < per_then {
            "requests complete at the same rate but their answers are shorter: a changed client or prompt, or truncation (output_length_drift, the quality signals)"
        } else {
            "the same requests complete with fewer tokens each second: generation is slower or streams are cut (look at time per output token and stalls)"
        };
        out.push(Finding {
            model: Some(m.model.to_string()),
            ..Finding::warning(
                "throughput_drift",
                Arc::from(""),
                evidence(&[
                    ("generated_tokens_per_second", round(tokens_now, 1)),
                    ("baseline_generated_tokens_per_second", round(tokens_then, 1)),
                    ("requests_per_second", round(asked_now, 2)),
                    ("baseline_requests_per_second", round(asked_then, 2)),
                    ("completed_per_second", round(completed_now, 2)),
                    ("baseline_completed_per_second", round(completed_then, 2)),
                    ("tokens_per_answer", round(per_now, 1)),
                    ("baseline_tokens_per_answer", round(per_then, 1)),
                    ("baseline_age_seconds", round(d.baseline.as_secs_f64(), 0)),
                ]),
                window.as_secs_f64(),
                cause,
                "compare with the baseline on the dashboard (tokens per second, requests by status, finish reasons); the other findings usually name the replica",
            )
        });
    }
}

/// A tier held at its limit: most of its requests refused over the window.
fn tenants(span: &Span<'_>, d: &DoctorConfig, out: &mut Vec<Finding>) {
    for (tier, rejected, total) in &span.last.tiers {
        let (r0, t0) = span
            .first
            .tiers
            .iter()
            .find(|(t, _, _)| t == tier)
            .map_or((0, 0), |(_, r, t)| (*r, *t));
        let (rejected, total) = (rejected.saturating_sub(r0), total.saturating_sub(t0));
        if total < d.limit_min_requests || (rejected as f64) < d.limit_share * total as f64 {
            continue;
        }
        out.push(Finding {
            tier: Some(tier.to_string()),
            ..Finding::warning(
                "tenant_at_limit",
                Arc::from(""),
                evidence(&[
                    ("rejected_share", round(rejected as f64 / total as f64, 3)),
                    ("rejected_per_second", round(rejected as f64 / span.secs, 2)),
                    ("requests_per_second", round(total as f64 / span.secs, 2)),
                ]),
                span.secs,
                format!("tier {tier} sends more than its limits allow: most of its requests get 429"),
                "check which key (the access log's key_name) and whether its client backs off on Retry-After; raise the tier's limits or move the key to a larger tier",
            )
        });
    }
}

/// Set `sluice_diagnosis_active{pathology, backend}`: 1 for each finding,
/// 0 for every other pathology of every replica (a healthy zero, not a gap).
pub fn export(findings: &[Finding], pool: &Pool, metrics: &Metrics) {
    let names: Vec<Arc<str>> = pool.replicas().iter().map(|r| r.name.clone()).collect();
    metrics
        .diagnosis_active
        .retain(|(_, b)| names.iter().any(|n| n == b));
    for n in &names {
        for p in PATHOLOGIES {
            let on = findings
                .iter()
                .any(|f| f.pathology == *p && f.backend == *n);
            metrics
                .diagnosis_active
                .get(&(*p, n.clone()))
                .set(i64::from(on));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BackendConfig;

    fn sample(at: Instant, preemptions: f64) -> LoadSample {
        LoadSample {
            kv_usage: Some(0.97),
            waiting: Some(0.0),
            running: Some(8.0),
            block_size: Some(16),
            num_blocks: Some(1000),
            preemptions: Some(preemptions),
            ..LoadSample::empty(crate::vocab::EngineKind::Vllm, at)
        }
    }

    #[test]
    fn counter_rates_survive_an_engine_restart() {
        let metrics = Metrics::new(&Config::default().telemetry.buckets);
        let b = BackendConfig::from_url("http://127.0.0.1:9".parse().unwrap());
        let r = Replica::from_config(&b, None, &Default::default(), &metrics);
        let t = Instant::now();
        let samples = vec![
            sample(t, 100.0),
            sample(t + std::time::Duration::from_secs(1), 110.0),
            // Restarted: the counter starts again from 0 and reaches 5.
            sample(t + std::time::Duration::from_secs(2), 5.0),
            sample(t + std::time::Duration::from_secs(4), 15.0),
        ];
        let p = Patient {
            replica: &r,
            samples,
        };
        // 10 + 5 + 10 preemptions over 4 s.
        assert_eq!(p.rate(|s| s.preemptions), Some(6.25));
        assert_eq!(p.span(), 4.0);
    }
}
