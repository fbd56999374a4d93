//! Every metric Sluice exports, declared once. Names follow vLLM's where the idea
//! is the same (`vllm:time_to_first_token_seconds` -> `sluice_time_to_first_token_seconds`).
//! Labels come from closed sets only: configured or discovered model names,
//! replica names, status codes, and `&'static str` kinds. Never a user, key,
//! prompt or request id.

use std::sync::Arc;
use std::time::Instant;

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use super::registry::{Counter, Encoder, Family, FamilyInfo, FloatGauge, Gauge, Histogram, Kind};
use crate::config::{Buckets, buckets};
use crate::vocab::{Endpoint, FinishReason, LimitKind, RouteReason};

/// All series of one model, resolved once per request and then used lock-free.
pub struct ModelSeries {
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub tpot: Histogram,
    pub e2e: Histogram,
    pub queue: Histogram,
    pub overhead: Histogram,
    pub max_gap: Histogram,
    pub prompt_tokens: Counter,
    /// Prompt tokens the engines served from their prefix cache (where reported).
    pub prompt_tokens_cached: Counter,
    pub generation_tokens: Counter,
    pub prompt_tokens_per_request: Histogram,
    pub generation_tokens_per_request: Histogram,
    pub stalls: Counter,
    pub in_flight: Gauge,
    pub client_disconnects: Counter,
    /// Quality signals (no content kept): generated tokens over `max_tokens`,
    /// generations ended by their length limit, successful generations
    /// with no output at all.
    pub output_budget: Histogram,
    pub length_finishes: Counter,
    pub empty_completions: Counter,
    /// Tool calls in answers, those whose arguments are not valid JSON, and
    /// answers whose opening the refusal detector matched.
    pub tool_calls: Counter,
    pub invalid_tool_calls: Counter,
    pub refusals: Counter,
    /// Series of other families that a request with these labels ends in,
    /// looked up once: a family lookup hashes its whole label set (~200
    /// instructions, callgrind) and a request's end made two. These families
    /// never drop a series, so a kept handle stays the one exposed.
    /// `sluice_requests_total{status="200",error_kind=""}` of this model,
    /// endpoint and tier:
    pub(crate) ok_requests: OnceLock<Arc<Counter>>,
    /// `sluice_request_finish_reasons_total` of this model, by `FinishReason as usize`.
    pub(crate) finishes: [OnceLock<Arc<Counter>>; FINISH_REASONS],
    /// `sluice_routing_decisions_total` of this model, by `RouteReason as usize`.
    pub(crate) routes: [OnceLock<Arc<Counter>>; ROUTE_REASONS],
}

/// How many `RouteReason`s there are (the size of `ModelSeries::routes`).
pub(crate) const ROUTE_REASONS: usize = crate::vocab::RouteReason::Retry as usize + 1;

/// How many `FinishReason`s there are (the size of `ModelSeries::finishes`).
pub(crate) const FINISH_REASONS: usize = crate::vocab::FinishReason::Other as usize + 1;

/// The re-exported part of a replica's scrape.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ScrapedLoad {
    pub kv_usage: Option<f64>,
    pub waiting: Option<f64>,
    pub deferred: Option<f64>,
    pub running: Option<f64>,
    pub prefix_hit_rate: Option<f64>,
    pub gpu_util: Option<f64>,
    pub gpu_memory: Option<f64>,
    pub preemptions: Option<f64>,
}

pub struct BackendSeries {
    pub healthy: Gauge,
    pub in_flight: Gauge,
    pub ejected: Gauge,
    pub ejections: Counter,
    /// Attempts sent to the replica.
    pub attempts: Counter,
    /// Inter-token gaps over the stall threshold in streams it served.
    pub stalls: Counter,
    /// Closed loop of routing: prompt tokens it expected cached there, and
    /// what the replica reported cached for the same requests.
    pub cached_predicted: Counter,
    pub cached_actual: Counter,
    /// Requests sent here whose home prefix (first `home_blocks` blocks) was last sent to another
    /// replica (a shared prefix scattered by routing).
    pub prefix_elsewhere: Counter,
    /// Re-exported from the replica's own metrics.
    pub kv_usage: FloatGauge,
    pub waiting: FloatGauge,
    /// Of those waiting, waiting for something other than room (vLLM's
    /// `reason="deferred"`, SGLang's transfer, bootstrap, grammar queues).
    pub deferred: FloatGauge,
    pub running: FloatGauge,
    pub prefix_hit_rate: FloatGauge,
    /// From the replica's DCGM exporter, where configured.
    pub gpu_util: FloatGauge,
    pub gpu_memory: FloatGauge,
    /// The engine's own preemption counter (vLLM `num_preemptions_total`).
    pub preemptions: FloatGauge,
    /// Requests the engine held at the last scrape beyond this gateway's.
    pub elsewhere: Gauge,
    /// Nanoseconds since [`epoch`] of the last successful scrape (0: none yet).
    scraped_at: AtomicU64,
}

/// A process-wide time origin for timestamps kept in atomics.
pub(crate) fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl BackendSeries {
    fn new() -> Self {
        Self {
            healthy: Gauge::default(),
            in_flight: Gauge::default(),
            ejected: Gauge::default(),
            attempts: Counter::default(),
            stalls: Counter::default(),
            ejections: Counter::default(),
            cached_predicted: Counter::default(),
            cached_actual: Counter::default(),
            prefix_elsewhere: Counter::default(),
            kv_usage: FloatGauge::default(),
            waiting: FloatGauge::default(),
            deferred: FloatGauge::default(),
            running: FloatGauge::default(),
            prefix_hit_rate: FloatGauge::default(),
            gpu_util: FloatGauge::default(),
            gpu_memory: FloatGauge::default(),
            // A counter reads 0 until the engine reports one (and stays 0
            // for engines that report none), never absent.
            preemptions: FloatGauge::new(0.0),
            elsewhere: Gauge::default(),
            scraped_at: AtomicU64::new(0),
        }
    }

    /// Export a scrape of the replica's metrics (unknown values as NaN),
    /// taken at `at`.
    pub(crate) fn record_load(&self, load: ScrapedLoad, at: Instant) {
        self.kv_usage.set(load.kv_usage.unwrap_or(f64::NAN));
        self.waiting.set(load.waiting.unwrap_or(f64::NAN));
        self.deferred.set(load.deferred.unwrap_or(f64::NAN));
        self.running.set(load.running.unwrap_or(f64::NAN));
        self.prefix_hit_rate
            .set(load.prefix_hit_rate.unwrap_or(f64::NAN));
        self.gpu_util.set(load.gpu_util.unwrap_or(f64::NAN));
        self.gpu_memory.set(load.gpu_memory.unwrap_or(f64::NAN));
        self.preemptions.set(load.preemptions.unwrap_or(0.0));
        let ns = at.saturating_duration_since(epoch()).as_nanos();
        self.scraped_at
            .store(u64::try_from(ns).unwrap_or(u64::MAX).max(1), Relaxed);
    }

    /// Seconds since the last scrape; +Inf before the first.
    pub(crate) fn metrics_age(&self) -> f64 {
        match self.scraped_at.load(Relaxed) {
            0 => f64::INFINITY,
            ns => (epoch().elapsed().as_nanos() as f64 - ns as f64).max(0.0) / 1e9,
        }
    }
}

/// Rate-limit decisions per tier at one moment (counters since start), kept
/// for the doctor's windowed rates.
#[derive(Debug, Clone)]
pub struct Vitals {
    pub at: Instant,
    /// tier, rejected, all decisions.
    pub tiers: Vec<(Arc<str>, u64, u64)>,
    pub backends: Vec<BackendVitals>,
    pub models: Vec<ModelVitals>,
}

/// One model's counters in the journal (summed over endpoints and tiers).
#[derive(Debug, Clone, Default)]
pub struct ModelVitals {
    pub model: Arc<str>,
    /// Generations with usage, and their generated tokens.
    pub generations: u64,
    pub generated_tokens: f64,
    /// First tokens, and the sum of their TTFT in seconds.
    pub first_tokens: u64,
    pub ttft_sum: f64,
    /// Requests that ended, whatever their status (the traffic offered).
    pub requests: u64,
    /// Decode legs after a remote prefill, and the sum of their times to a
    /// first token in seconds (the KV transfer and a decode step).
    pub kv_waits: u64,
    pub kv_wait_sum: f64,
}

/// One replica's counters in the journal.
#[derive(Debug, Clone)]
pub struct BackendVitals {
    pub name: Arc<str>,
    /// Attempts sent, and streams' inter-token gaps over the stall threshold.
    pub attempts: u64,
    pub stalls: u64,
    /// Failed attempts by kind.
    pub failed: Vec<(&'static str, u64)>,
}

/// Label values known before the first request: every series made of them
/// is exported at zero from the start, so a dashboard panel reads 0 on a calm
/// fleet and a rule can tell "none happened" from "not exported". Set from
/// the config at start and at each reload ([`Metrics::know`]); models are
/// added as the pool learns them ([`Metrics::init_model`]). All of them are
/// bounded by the config and the fleet.
#[derive(Debug, Clone, Default)]
pub(crate) struct KnownLabels {
    /// The `tier` label requests carry: the configured tiers when keys are
    /// checked, only `""` on an open gateway.
    pub tiers: Vec<Arc<str>>,
    /// Flow control's bands.
    pub bands: Vec<Arc<str>>,
    /// The rate-limit store in use (`sluice_ratelimit_store_errors_total{store}`).
    pub store: &'static str,
    /// Kinds of a failed attempt, per replica (`sluice_upstream_errors_total{kind}`).
    pub attempt_kinds: Vec<&'static str>,
    /// Reasons of a retry, per model (`sluice_upstream_retries_total{reason}`).
    pub retry_kinds: Vec<&'static str>,
    /// Reasons the tail sampler keeps a trace (`sluice_traces_sampled_total{reason}`).
    pub trace_reasons: Vec<&'static str>,
}

/// Outcomes of a request through flow control (`sluice_flow_requests_total{outcome}`).
pub(crate) const FLOW_OUTCOMES: [&str; 4] =
    ["immediate", "waited", "shed_timeout", "shed_overflow"];

/// Outcomes of a look at a decode replica's engine before a local prefill
/// (`sluice_pd_decode_looks_total{outcome}`).
pub(crate) const PD_LOOK_OUTCOMES: [&str; 3] = ["confirmed", "refused", "failed"];

/// How a hold for a prefill under way ended
/// (`sluice_routing_prefill_holds_total{outcome}`; `routing::prefilling`).
pub(crate) const PREFILL_HOLD_OUTCOMES: [&str; 3] = ["prefilled", "ended", "deadline"];

/// Decisions of the rate limiter that name no limit
/// (`sluice_ratelimit_decisions_total{limit=""}`); a refusal by a limit is
/// `rejected` with that limit.
pub(crate) const RATELIMIT_UNLIMITED_DECISIONS: [&str; 3] =
    ["admitted", "admitted_store_down", "rejected_store_down"];

/// How long the journal of vitals is kept (the doctor's longest window).
const JOURNAL: std::time::Duration = std::time::Duration::from_secs(600);

pub struct Metrics {
    /// Vitals noted at each scrape round, oldest first (for `/admin/diagnose`).
    pub journal: parking_lot::Mutex<std::collections::VecDeque<Vitals>>,
    /// The same, thinned to one entry per 1/30 of `doctor.baseline` (at most
    /// a minute apart) and kept that long plus the journal's span: the
    /// baseline the doctor compares throughput with (about 40 entries).
    pub history: parking_lot::Mutex<std::collections::VecDeque<Vitals>>,
    /// `doctor.baseline` in nanoseconds (set with each config).
    baseline_ns: AtomicU64,
    /// model, endpoint, tier ("" without keys; bounded by the configured tiers).
    pub models: Family<(Arc<str>, &'static str, Arc<str>), ModelSeries>,
    /// The empty label (a request without a tier, a model or a tenant yet):
    /// shared, not allocated per request.
    pub no_tier: Arc<str>,
    pub requests: Family<RequestKey, Counter>,
    pub finish_reasons: Family<(Arc<str>, &'static str), Counter>,
    pub upstream_errors: Family<(Arc<str>, &'static str), Counter>,
    pub retries: Family<(Arc<str>, &'static str), Counter>,
    /// model, reason: every routing decision.
    pub routing: Family<(Arc<str>, &'static str), Counter>,
    /// model, reason: sessions that left their replica (why, as a route reason).
    pub session_moves: Family<(Arc<str>, &'static str), Counter>,
    /// Sessions this gateway remembers (set when `/metrics` is rendered).
    pub sessions: Gauge,
    /// op, outcome: the shared session table's reads and writes
    /// (`routing.sessions.store: redis`).
    pub session_store: Family<(&'static str, &'static str), Counter>,
    /// op, outcome: the shared table's prefix homes
    /// (`routing.prefix_kv.shared_homes`).
    pub home_store: Family<(&'static str, &'static str), Counter>,
    /// Flow control: model, band, outcome (`immediate`, `waited`,
    /// `shed_timeout`, `shed_overflow`).
    pub flow_requests: Family<(Arc<str>, Arc<str>, &'static str), Counter>,
    /// model, band: time spent waiting for a seat (0 for those that did not).
    pub flow_wait: Family<(Arc<str>, Arc<str>), Histogram>,
    /// model, reason: how each request of a disaggregated model was
    /// prefilled (`remote`, or why locally).
    pub pd_decisions: Family<(Arc<str>, &'static str), Counter>,
    /// model, outcome: looks at a decode replica's engine before a local
    /// prefill past `local_max_tokens` (`confirmed`, `refused`, `failed`).
    pub pd_decode_looks: Family<(Arc<str>, &'static str), Counter>,
    /// model, outcome: requests held for a prefill of their prompt under
    /// way on their replica (`routing.prefix_kv.hold_for_prefill`).
    pub prefill_holds: Family<(Arc<str>, &'static str, &'static str), Counter>,
    /// model: how long they were held.
    pub prefill_hold: Family<(Arc<str>,), Histogram>,
    /// model, outcome: cold prefills that waited for their place in their
    /// replica's gate (`routing.prefix_kv.cold_prefill_tokens`).
    pub cold_gate_waits: Family<(Arc<str>, &'static str), Counter>,
    /// model: how long they waited.
    pub cold_gate_wait: Family<(Arc<str>,), Histogram>,
    /// model: a remote prefill leg, sent to answered (TTFT's first part).
    pub pd_prefill: Family<(Arc<str>,), Histogram>,
    /// model: after a remote prefill, the decode leg sent to its first token
    /// (the KV transfer and the first decode step: TTFT's last part).
    pub pd_decode_first_token: Family<(Arc<str>,), Histogram>,
    /// model, band: requests waiting now.
    pub flow_waiting: Family<(Arc<str>, Arc<str>), Gauge>,
    /// Syncs of fairness with the other gateways (one per model per round),
    /// by outcome (`ok`, `error`).
    pub flow_share_syncs: Family<(&'static str,), Counter>,
    /// model: this gateway's part of the model's seats while gateways share
    /// them (-1: no part in force).
    pub flow_seat_part: Family<(Arc<str>,), Gauge>,
    /// pathology, backend: 1 while the doctor names it (set when `/metrics`
    /// is rendered).
    pub diagnosis_active: Family<(&'static str, Arc<str>), Gauge>,
    pub backends: Family<(Arc<str>,), BackendSeries>,
    /// backend, role: 1 (an info series, for joins: a pool's queue, KV and
    /// share of the work by `role`).
    pub backend_roles: Family<(Arc<str>, &'static str), Gauge>,
    /// tier, limit ("" when admitted), decision.
    pub ratelimit_decisions: Family<(Arc<str>, &'static str, &'static str), Counter>,
    pub ratelimit_store_errors: Family<(&'static str,), Counter>,
    pub ratelimit_store_seconds: Histogram,
    /// Tail-sampling decisions: reason kept, and `kept` or `capped` (over
    /// `max_per_second`).
    pub traces: Family<(&'static str, &'static str), Counter>,
    /// Spans by outcome: `exported`, `export_failed`, `queue_full`.
    pub trace_spans: Family<(&'static str,), Counter>,
    /// Config reloads (SIGHUP) by result: `ok`, `error` (the old config stays).
    pub config_reloads: Family<(&'static str,), Counter>,
    /// TLS certificate reloads by certificate (`server`, `upstream`) and
    /// result (`ok`, `error`: the one before stays).
    pub tls_reloads: Family<(&'static str, &'static str), Counter>,
    /// TLS handshakes with clients that failed, by listener (`api`, `admin`).
    pub tls_handshake_failures: Family<(&'static str,), Counter>,
    /// Endpoint picker: model (empty before it is known), outcome (`routed`,
    /// `dropped`, `unavailable`, `bad_request`, `error`).
    pub epp_decisions: Family<(Arc<str>, &'static str), Counter>,
    /// Endpoint picker: the request's body complete to the pick answered
    /// (flow control's wait included).
    pub epp_decision_seconds: Histogram,
    /// Replicas passing health checks, in all and per model (set when
    /// `/metrics` is rendered, from the pool).
    pub backends_healthy: Gauge,
    pub model_replicas_healthy: Family<(Arc<str>,), Gauge>,
    /// Whether replicas' metrics are scraped (`routing.metrics.enabled`);
    /// without scraping their metrics age is NaN, not +Inf (nothing is stale).
    pub scraping: AtomicBool,
    /// 1 while no other sender's requests show at the replicas' engines
    /// (the pool's `Company`; set when `/metrics` is rendered).
    pub alone: Gauge,
    pub started: Instant,
    /// What series exist at zero from the start (see [`KnownLabels`]), and
    /// the models they were made for. Read and written at setup and when the
    /// pool's models change, never per request.
    known: parking_lot::Mutex<(KnownLabels, Vec<Arc<str>>)>,
}

/// model, tier ("" without keys), status code, error kind ("" on success).
/// model, endpoint, tier, status, error kind.
pub(crate) type RequestKey = (Arc<str>, &'static str, Arc<str>, StatusLabel, &'static str);

/// A status code as a label value without formatting per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StatusLabel(pub u16);

impl AsRef<str> for StatusLabel {
    fn as_ref(&self) -> &str {
        http::StatusCode::from_u16(self.0)
            .ok()
            .map(status_str)
            .unwrap_or("other")
    }
}

fn status_str(s: http::StatusCode) -> &'static str {
    // The common codes by name; anything else by class, so the set stays closed.
    match s.as_u16() {
        200 => "200",
        201 => "201",
        204 => "204",
        400 => "400",
        401 => "401",
        403 => "403",
        404 => "404",
        405 => "405",
        408 => "408",
        409 => "409",
        413 => "413",
        414 => "414",
        422 => "422",
        429 => "429",
        431 => "431",
        499 => "499",
        500 => "500",
        501 => "501",
        502 => "502",
        503 => "503",
        504 => "504",
        c if c < 300 => "2xx",
        c if c < 400 => "3xx",
        c if c < 500 => "4xx",
        _ => "5xx",
    }
}

impl Metrics {
    /// Note the rate-limit decisions per tier now (called once per scrape
    /// round); entries older than 10 minutes are dropped.
    pub(crate) fn note_vitals(&self, at: Instant) {
        let mut tiers: Vec<(Arc<str>, u64, u64)> = Vec::new();
        self.ratelimit_decisions.for_each(|(tier, _, decision), c| {
            let n = c.get();
            let rejected = if decision.starts_with("rejected") {
                n
            } else {
                0
            };
            match tiers.iter_mut().find(|(t, _, _)| t == tier) {
                Some(e) => {
                    e.1 += rejected;
                    e.2 += n;
                }
                None => tiers.push((tier.clone(), rejected, n)),
            }
        });
        let mut backends: Vec<BackendVitals> = Vec::new();
        self.backends.for_each(|(name,), s| {
            backends.push(BackendVitals {
                name: name.clone(),
                attempts: s.attempts.get(),
                stalls: s.stalls.get(),
                failed: Vec::new(),
            });
        });
        self.upstream_errors.for_each(|(name, kind), c| {
            if let Some(b) = backends.iter_mut().find(|b| b.name == *name) {
                b.failed.push((*kind, c.get()));
            }
        });
        let mut models: Vec<ModelVitals> = Vec::new();
        self.models.for_each(|(model, _, _), s| {
            let i = match models.iter().position(|m| m.model == *model) {
                Some(i) => i,
                None => {
                    models.push(ModelVitals {
                        model: model.clone(),
                        ..ModelVitals::default()
                    });
                    models.len() - 1
                }
            };
            let m = &mut models[i];
            m.generations += s.generation_tokens_per_request.count();
            m.generated_tokens += s.generation_tokens_per_request.sum();
            m.first_tokens += s.ttft.count();
            m.ttft_sum += s.ttft.sum();
        });
        self.requests.for_each(|(model, ..), c| {
            if let Some(m) = models.iter_mut().find(|m| m.model == *model) {
                m.requests += c.get();
            }
        });
        self.pd_decode_first_token.for_each(|(model,), h| {
            if let Some(m) = models.iter_mut().find(|m| m.model == *model) {
                m.kv_waits += h.count();
                m.kv_wait_sum += h.sum();
            }
        });
        let vitals = Vitals {
            at,
            tiers,
            backends,
            models,
        };
        let baseline = std::time::Duration::from_nanos(self.baseline_ns.load(Relaxed));
        let spacing = (baseline / 30).min(std::time::Duration::from_secs(60));
        {
            let mut h = self.history.lock();
            let keep = baseline + JOURNAL + spacing;
            while h
                .front()
                .is_some_and(|v| at.saturating_duration_since(v.at) > keep)
            {
                h.pop_front();
            }
            if h.back()
                .is_none_or(|v| at.saturating_duration_since(v.at) >= spacing)
            {
                h.push_back(vitals.clone());
            }
        }
        let mut j = self.journal.lock();
        while j
            .front()
            .is_some_and(|v| at.saturating_duration_since(v.at) > JOURNAL)
        {
            j.pop_front();
        }
        j.push_back(vitals);
    }

    /// How far back the doctor's throughput baseline lies (`doctor.baseline`).
    pub(crate) fn set_baseline(&self, d: std::time::Duration) {
        self.baseline_ns
            .store(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }

    pub fn new(b: &Buckets) -> Self {
        let arc = |v: &Vec<f64>| -> Arc<[f64]> { Arc::from(v.as_slice()) };
        let (ttft, itl, tpot, e2e, queue) = (
            arc(&b.ttft),
            arc(&b.inter_token),
            arc(&b.tpot),
            arc(&b.e2e),
            arc(&b.queue),
        );
        // A remote prefill is part of a TTFT: the same buckets.
        let prefill_buckets = ttft.clone();
        let tokens: Arc<[f64]> = Arc::from(buckets::TOKENS);
        // Shares of max_tokens used: fine near 1, where truncation sits.
        let budget: Arc<[f64]> = Arc::from(&[0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0][..]);
        // Waits at the gateway run up to flow_control.max_wait (30 s default).
        let flow_queue: Arc<[f64]> = Arc::from(
            &[
                0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
                60.0,
            ][..],
        );
        Self {
            no_tier: Arc::from(""),
            journal: parking_lot::Mutex::new(std::collections::VecDeque::new()),
            history: parking_lot::Mutex::new(std::collections::VecDeque::new()),
            baseline_ns: AtomicU64::new(30 * 60 * 1_000_000_000),
            models: Family::new(&["model", "endpoint", "tier"], move || ModelSeries {
                ttft: Histogram::seconds(ttft.clone()),
                inter_token: Histogram::seconds(itl.clone()),
                tpot: Histogram::seconds(tpot.clone()),
                e2e: Histogram::seconds(e2e.clone()),
                queue: Histogram::seconds(queue.clone()),
                overhead: Histogram::seconds(queue.clone()),
                max_gap: Histogram::seconds(itl.clone()),
                prompt_tokens: Counter::default(),
                prompt_tokens_cached: Counter::default(),
                generation_tokens: Counter::default(),
                prompt_tokens_per_request: Histogram::counts_of(tokens.clone()),
                generation_tokens_per_request: Histogram::counts_of(tokens.clone()),
                stalls: Counter::default(),
                in_flight: Gauge::default(),
                client_disconnects: Counter::default(),
                output_budget: Histogram::counts_of(budget.clone()),
                length_finishes: Counter::default(),
                empty_completions: Counter::default(),
                tool_calls: Counter::default(),
                invalid_tool_calls: Counter::default(),
                refusals: Counter::default(),
                ok_requests: OnceLock::new(),
                finishes: Default::default(),
                routes: Default::default(),
            }),
            requests: Family::new(
                &["model", "endpoint", "tier", "status", "error_kind"],
                Counter::default,
            ),
            finish_reasons: Family::new(&["model", "finish_reason"], Counter::default),
            upstream_errors: Family::new(&["backend", "kind"], Counter::default),
            retries: Family::new(&["model", "reason"], Counter::default),
            routing: Family::new(&["model", "reason"], Counter::default),
            session_moves: Family::new(&["model", "reason"], Counter::default),
            sessions: Gauge::default(),
            session_store: Family::new(&["op", "outcome"], Counter::default),
            home_store: Family::new(&["op", "outcome"], Counter::default),
            flow_requests: Family::new(&["model", "band", "outcome"], Counter::default),
            flow_wait: Family::new(&["model", "band"], move || {
                Histogram::seconds(flow_queue.clone())
            }),
            flow_waiting: Family::new(&["model", "band"], Gauge::default),
            pd_decisions: Family::new(&["model", "reason"], Counter::default),
            pd_decode_looks: Family::new(&["model", "outcome"], Counter::default),
            prefill_holds: Family::new(&["model", "prefill", "outcome"], Counter::default),
            prefill_hold: Family::new(&["model"], {
                let b = prefill_buckets.clone();
                move || Histogram::seconds(b.clone())
            }),
            cold_gate_waits: Family::new(&["model", "outcome"], Counter::default),
            cold_gate_wait: Family::new(&["model"], {
                let b = prefill_buckets.clone();
                move || Histogram::seconds(b.clone())
            }),
            pd_prefill: Family::new(&["model"], {
                let b = prefill_buckets.clone();
                move || Histogram::seconds(b.clone())
            }),
            pd_decode_first_token: Family::new(&["model"], move || {
                Histogram::seconds(prefill_buckets.clone())
            }),
            flow_share_syncs: Family::new(&["outcome"], Counter::default),
            flow_seat_part: Family::new(&["model"], Gauge::default),
            diagnosis_active: Family::new(&["pathology", "backend"], Gauge::default),
            backends: Family::new(&["backend"], BackendSeries::new),
            backend_roles: Family::new(&["backend", "role"], Gauge::default),
            ratelimit_decisions: Family::new(&["tier", "limit", "decision"], Counter::default),
            ratelimit_store_errors: Family::new(&["store"], Counter::default),
            // Redis round trips: tens of microseconds on loopback, milliseconds
            // across a zone; the timeout (100 ms default) caps it.
            ratelimit_store_seconds: Histogram::seconds(Arc::from(
                &[
                    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                ][..],
            )),
            traces: Family::new(&["reason", "decision"], Counter::default),
            trace_spans: Family::new(&["outcome"], Counter::default),
            config_reloads: Family::new(&["result"], Counter::default),
            tls_reloads: Family::new(&["certificate", "result"], Counter::default),
            tls_handshake_failures: Family::new(&["listener"], Counter::default),
            epp_decisions: Family::new(&["model", "outcome"], Counter::default),
            // A pick is microseconds (the issue's objective: p99 under 1 ms
            // at 220 KB prompts); a request held by flow control waits up
            // to flow_control.max_wait (30 s default).
            epp_decision_seconds: Histogram::seconds(Arc::from(
                &[
                    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.1, 1.0, 5.0,
                    30.0,
                ][..],
            )),
            backends_healthy: Gauge::default(),
            model_replicas_healthy: Family::new(&["model"], Gauge::default),
            scraping: AtomicBool::new(true),
            alone: Gauge::default(),
            started: Instant::now(),
            known: parking_lot::Mutex::new((KnownLabels::default(), Vec::new())),
        }
    }

    /// Make every series of `known`'s label values exist (at zero), for the
    /// whole gateway and for each model seen so far; called at start and at
    /// each reload, before the pool is built.
    pub(crate) fn know(&self, known: KnownLabels) {
        for result in ["ok", "error"] {
            self.config_reloads.get(&(result,));
        }
        for outcome in ["ok", "error"] {
            self.flow_share_syncs.get(&(outcome,));
        }
        for reason in &known.trace_reasons {
            for decision in ["kept", "capped"] {
                self.traces.get(&(*reason, decision));
            }
        }
        for outcome in ["exported", "export_failed", "queue_full"] {
            self.trace_spans.get(&(outcome,));
        }
        self.ratelimit_store_errors.get(&(known.store,));
        for tier in &known.tiers {
            for decision in RATELIMIT_UNLIMITED_DECISIONS {
                self.ratelimit_decisions.get(&(tier.clone(), "", decision));
            }
            for limit in LimitKind::ALL {
                self.ratelimit_decisions
                    .get(&(tier.clone(), limit.as_str(), "rejected"));
            }
        }
        let mut k = self.known.lock();
        k.0 = known;
        let (known, models) = &*k;
        for model in models {
            self.init_model_with(known, model);
        }
    }

    /// Make the series of `model` exist (at zero) for every known tier,
    /// band and reason: called when the pool learns of a model.
    pub(crate) fn init_model(&self, model: &Arc<str>) {
        let mut k = self.known.lock();
        if k.1.iter().any(|m| m == model) {
            return;
        }
        k.1.push(model.clone());
        self.init_model_with(&k.0, model);
    }

    fn init_model_with(&self, known: &KnownLabels, model: &Arc<str>) {
        // The per-request families on the chat endpoint, the one every
        // client speaks: enough for every panel and rule to find its series,
        // without a histogram set per endpoint that may never be used.
        let chat = Endpoint::Chat.as_str();
        for tier in &known.tiers {
            self.models.get(&(model.clone(), chat, tier.clone()));
            self.requests
                .get(&(model.clone(), chat, tier.clone(), StatusLabel(200), ""));
        }
        for f in FinishReason::ALL {
            self.finish_reasons.get(&(model.clone(), f.as_str()));
        }
        for r in RouteReason::ALL {
            self.routing.get(&(model.clone(), r.as_str()));
            self.session_moves.get(&(model.clone(), r.as_str()));
        }
        for r in crate::vocab::PdReason::ALL {
            self.pd_decisions.get(&(model.clone(), r.as_str()));
        }
        for outcome in PD_LOOK_OUTCOMES {
            self.pd_decode_looks.get(&(model.clone(), outcome));
        }
        self.pd_prefill.get(&(model.clone(),));
        for of in ["own", "shared"] {
            for outcome in PREFILL_HOLD_OUTCOMES {
                self.prefill_holds.get(&(model.clone(), of, outcome));
            }
        }
        self.prefill_hold.get(&(model.clone(),));
        for outcome in ["sent", "deadline", "pressed"] {
            self.cold_gate_waits.get(&(model.clone(), outcome));
        }
        self.cold_gate_wait.get(&(model.clone(),));
        self.pd_decode_first_token.get(&(model.clone(),));
        for kind in &known.retry_kinds {
            self.retries.get(&(model.clone(), *kind));
        }
        for band in &known.bands {
            for outcome in FLOW_OUTCOMES {
                self.flow_requests
                    .get(&(model.clone(), band.clone(), outcome));
            }
            self.flow_wait.get(&(model.clone(), band.clone()));
            self.flow_waiting.get(&(model.clone(), band.clone()));
        }
        self.model_replicas_healthy.get(&(model.clone(),));
    }

    /// The series of replica `name`: its own, and its failed attempts by
    /// kind at zero. Returns its own.
    pub(crate) fn init_backend(&self, name: &Arc<str>, role: &'static str) -> Arc<BackendSeries> {
        let kinds = self.known.lock().0.attempt_kinds.clone();
        for kind in kinds {
            self.upstream_errors.get(&(name.clone(), kind));
        }
        self.backend_roles.retain(|(n, r)| n != name || *r == role);
        self.backend_roles.get(&(name.clone(), role)).set(1);
        self.backends.get(&(name.clone(),))
    }

    /// Drop the series of replicas not in `names` (gone after a reload or a
    /// DNS change), so that replica churn does not grow the exposition.
    pub(crate) fn retain_backends(&self, names: &[Arc<str>]) {
        self.backends.retain(|(n,)| names.contains(n));
        self.backend_roles.retain(|(n, _)| names.contains(n));
        self.upstream_errors.retain(|(n, _)| names.contains(n));
    }

    /// Every family the gateway exports, as declared: a Markdown table of
    /// name, type, labels and help, the generated part of `docs/metrics.md`.
    pub fn reference_table() -> String {
        let families = Self::new(&Buckets::default())
            .encode(Encoder::cataloguing())
            .catalog
            .unwrap_or_default();
        let mut out = String::from("| metric | type | labels | meaning |\n|---|---|---|---|\n");
        for FamilyInfo {
            name,
            kind,
            labels,
            help,
        } in families
        {
            let labels = labels.join(", ");
            let help = help.replace('|', "\\|");
            out.push_str(&format!("| `{name}` | {kind} | {labels} | {help} |\n"));
        }
        out
    }

    /// The Prometheus text exposition, or OpenMetrics (with exemplars).
    pub(crate) fn render(&self, openmetrics: bool) -> String {
        self.encode(Encoder::with_format(openmetrics)).finish()
    }

    /// Every family, in exposition order: the one list of what is exported.
    fn encode(&self, mut e: Encoder) -> Encoder {
        let m = &self.models;
        e.counters(
            "sluice_requests_total",
            "Requests finished, by model, endpoint, tier, HTTP status and error kind (empty on success).",
            &self.requests,
            |c| c,
        );
        e.histograms(
            "sluice_time_to_first_token_seconds",
            "Arrival at the gateway to the first event carrying generated output.",
            m,
            |s| &s.ttft,
        );
        e.histograms(
            "sluice_inter_token_latency_seconds",
            "Every gap between two output events of a stream.",
            m,
            |s| &s.inter_token,
        );
        e.histograms(
            "sluice_time_per_output_token_seconds",
            "Per request: (last token - first token) / (completion tokens - 1).",
            m,
            |s| &s.tpot,
        );
        e.histograms(
            "sluice_e2e_request_latency_seconds",
            "Arrival at the gateway to the end of the response.",
            m,
            |s| &s.e2e,
        );
        e.histograms(
            "sluice_request_queue_time_seconds",
            "Arrival at the gateway to the request being sent to the replica that served it.",
            m,
            |s| &s.queue,
        );
        e.histograms(
            "sluice_gateway_overhead_seconds",
            "Time spent in the gateway itself: arrival to the first upstream send, plus the replica's first byte to the response handed to the client.",
            m,
            |s| &s.overhead,
        );
        e.histograms(
            "sluice_request_max_inter_token_gap_seconds",
            "Per stream: its largest gap between two output events (stall detector).",
            m,
            |s| &s.max_gap,
        );
        e.counters(
            "sluice_prompt_tokens_total",
            "Prompt tokens, as reported by the replicas' usage.",
            m,
            |s| &s.prompt_tokens,
        );
        e.counters(
            "sluice_prompt_tokens_cached_total",
            "Prompt tokens the replicas served from their prefix cache (usage.prompt_tokens_details.cached_tokens, where reported).",
            m,
            |s| &s.prompt_tokens_cached,
        );
        e.counters(
            "sluice_generation_tokens_total",
            "Generated tokens, as reported by the replicas' usage.",
            m,
            |s| &s.generation_tokens,
        );
        e.histograms(
            "sluice_request_prompt_tokens",
            "Prompt tokens per request.",
            m,
            |s| &s.prompt_tokens_per_request,
        );
        e.histograms(
            "sluice_request_generation_tokens",
            "Generated tokens per request.",
            m,
            |s| &s.generation_tokens_per_request,
        );
        e.counters(
            "sluice_stream_stalls_total",
            "Inter-token gaps longer than telemetry.stall_threshold, including the silence of a stream cut before its next token.",
            m,
            |s| &s.stalls,
        );
        e.counters(
            "sluice_client_disconnects_total",
            "Requests the client abandoned before the end (the upstream request was cancelled).",
            m,
            |s| &s.client_disconnects,
        );
        e.histograms(
            "sluice_quality_output_budget_ratio",
            "Per generation with a known max_tokens: completion tokens / max_tokens (a pile-up at 1 is truncation).",
            m,
            |s| &s.output_budget,
        );
        e.counters(
            "sluice_quality_length_finishes_total",
            "Generations that ended because they reached max_tokens (finish reason length).",
            m,
            |s| &s.length_finishes,
        );
        e.counters(
            "sluice_quality_empty_completions_total",
            "Successful generations with no output: no content, no tool call, zero completion tokens.",
            m,
            |s| &s.empty_completions,
        );
        e.counters(
            "sluice_quality_tool_calls_total",
            "Tool calls in successful answers (streamed or not), read to the end of the answer.",
            m,
            |s| &s.tool_calls,
        );
        e.counters(
            "sluice_quality_invalid_tool_calls_total",
            "Tool calls whose arguments are not valid JSON (a client's json.loads would fail).",
            m,
            |s| &s.invalid_tool_calls,
        );
        e.counters(
            "sluice_quality_refusals_total",
            "Answers whose first telemetry.quality.refusal.chars characters contain a refusal phrase (opt-in; 0 while off).",
            m,
            |s| &s.refusals,
        );
        e.gauges(
            "sluice_requests_in_flight",
            "Requests being served now.",
            m,
            |s| s.in_flight.get() as f64,
        );
        e.counters(
            "sluice_request_finish_reasons_total",
            "Finished generations by finish reason (a rising `length` share means truncation).",
            &self.finish_reasons,
            |c| c,
        );
        e.counters(
            "sluice_upstream_errors_total",
            "Failed attempts against a replica and streams it broke, by kind.",
            &self.upstream_errors,
            |c| c,
        );
        e.counters(
            "sluice_upstream_retries_total",
            "Attempts repeated on another replica before the first byte, by reason.",
            &self.retries,
            |c| c,
        );
        e.counters(
            "sluice_routing_decisions_total",
            "Routing decisions, by the reason the replica was chosen.",
            &self.routing,
            |c| c,
        );
        e.counters(
            "sluice_routing_session_moves_total",
            "Sessions that left the replica holding their history (it was gone or under pressure), by the reason of the new decision.",
            &self.session_moves,
            |c| c,
        );
        e.single(
            "sluice_routing_alone",
            "1 while no other sender's requests show at the replicas' engines (their running and waiting counts beyond this gateway's in flight, over 30 scrapes with its own requests there and 5 minutes since the last sighting), else 0: routing.prefix_kv.session_placement auto then places new sessions by pressure (first_open) without a shared table.",
            Kind::Gauge,
            self.alone.get() as f64,
        );
        e.single(
            "sluice_routing_sessions",
            "Sessions this gateway remembers (each maps a conversation to its replica).",
            Kind::Gauge,
            self.sessions.get() as f64,
        );
        e.counters(
            "sluice_routing_session_store_total",
            "The shared session table's operations (routing.sessions.store: redis), by op and outcome: find (before routing a session this gateway does not know: found, absent, error), claim (a new session: ok, taken when another gateway placed it first), move, touch (ok, error).",
            &self.session_store,
            |c| c,
        );
        e.counters(
            "sluice_routing_home_store_total",
            "The shared table's prefix homes (routing.sessions.store: redis, routing.prefix_kv.shared_homes), by op and outcome: place (before routing a prompt whose prefix this gateway holds nowhere: found where another gateway homed it, placed there now, error, skipped for 2 s after an error, novel: not looked up, the new prompts whose prefix key is not a multiple of 16 while this gateway meets routing.prefix_kv.shared_homes_sampled_from (1,000 by default) and more of a model and pool in 5-10 s and finds none homed elsewhere, unless routing.prefix_kv.shared_homes_sampled is false), touch (a holder served it: its home kept, ok; elsewhere: homed on another replica, so this gateway forgets it here and looks it up next time; error), move (a prefix moved, or placed without the table: ok, error), cold (a new home's cold prefill no longer counted on its replica: at its first token, its attempt's end, or when the request went elsewhere; ok, error), watch (a request waiting for another gateway's cold prefill of its prompt, routing.prefix_kv.hold_for_prefill, could not ask whether it was done: error; it is then sent).",
            &self.home_store,
            |c| c,
        );
        e.counters(
            "sluice_flow_requests_total",
            "Requests through flow control, by model, priority band and outcome: immediate, waited (then sent), shed_timeout (waited flow_control.max_wait), shed_overflow (the queue was full).",
            &self.flow_requests,
            |c| c,
        );
        e.histograms(
            "sluice_flow_wait_seconds",
            "Time a request waited at the gateway for a replica with room (0 when it went at once); part of its queue time and TTFT.",
            &self.flow_wait,
            |h| h,
        );
        e.counters(
            "sluice_pd_decisions_total",
            "Requests of disaggregated models, by how they were prefilled: `remote`, or locally on the decode replica and why.",
            &self.pd_decisions,
            |c| c,
        );
        e.counters(
            "sluice_pd_decode_looks_total",
            "Looks at a decode replica's engine before prefilling a prompt past `local_max_tokens` there (`local_idle`, `local_stall_budget`), whose last scrape allowed it: `confirmed` (prefilled there), `refused` (the engine ran or queued streams the scrape did not show, or the allowance no longer fitted: the prompt went to the prefill pool), `failed` (no answer within 100 ms, or within a second of such a look: to the pool).",
            &self.pd_decode_looks,
            |c| c,
        );
        e.counters(
            "sluice_routing_prefill_holds_total",
            "Requests held before sending until a prefill of their prompt under way on their replica gave its first token (`routing.prefix_kv.hold_for_prefill`), by whose prefill (`own`: this gateway's; `shared`: another gateway's cold prefill of a new prefix home, seen in the shared table, routing.prefix_kv.shared_homes) and outcome: `prefilled`, `ended` (that attempt ended without one: a streamed request then marks the prefill again, unless another waiter did first, and goes; a waiter that then waits for another's mark is counted by how that wait ends; a table that did not answer counts here too), `deadline` (the held request's first-token bound, or the table's count of that prefill ran out: then it is sent).",
            &self.prefill_holds,
            |c| c,
        );
        e.histograms(
            "sluice_routing_prefill_hold_seconds",
            "How long requests were held for a prefill of their prompt under way on their replica (part of their queue time and TTFT).",
            &self.prefill_hold,
            |h| h,
        );
        e.counters(
            "sluice_routing_cold_gate_waits_total",
            "Streamed requests whose prompt their replica computes mostly afresh (256 uncached tokens or more) that waited before sending until the cold prefills this gateway had under way there (and, for a new prefix home, every gateway's placed there before it, in the shared table) left room for theirs (`routing.prefix_kv.cold_prefill_tokens`), by outcome: `sent` (room came: an earlier one gave its first token or ended), `deadline` (the request's first-token bound, or a shared table that did not answer while it waited for its turn there: then it is sent), `pressed` (the replica's engine said it was full meanwhile: its queue outlived a scrape, or it preempted; the gate stands aside there).",
            &self.cold_gate_waits,
            |c| c,
        );
        e.histograms(
            "sluice_routing_cold_gate_wait_seconds",
            "How long cold prefills waited in their replica's gate (part of their queue time and TTFT).",
            &self.cold_gate_wait,
            |h| h,
        );
        e.histograms(
            "sluice_pd_prefill_seconds",
            "Remote prefill legs of disaggregated models, sent to answered (the first part of their TTFT).",
            &self.pd_prefill,
            |h| h,
        );
        e.histograms(
            "sluice_pd_decode_first_token_seconds",
            "After a remote prefill: the decode leg sent to its first token (the KV transfer and the first decode step; the queue time and the prefill are TTFT's other parts).",
            &self.pd_decode_first_token,
            |h| h,
        );
        e.counters(
            "sluice_flow_share_syncs_total",
            "Syncs of attained service with the other gateways through Redis (flow_control.share_fairness), one per model per round, by outcome: ok, error (the round is sent again).",
            &self.flow_share_syncs,
            |c| c,
        );
        e.gauges(
            "sluice_flow_seat_part",
            "Seats of the model this gateway may fill while its tenants and other gateways' want more than the model has (flow_control.share_fairness through Redis); -1 while no part is in force.",
            &self.flow_seat_part,
            |g| g.get() as f64,
        );
        e.gauges(
            "sluice_flow_waiting_requests",
            "Requests waiting at the gateway now for a replica with room, by model and band.",
            &self.flow_waiting,
            |g| g.get() as f64,
        );
        e.gauges(
            "sluice_diagnosis_active",
            "1 while the diagnosis (/admin/diagnose) names this pathology on this replica, else 0.",
            &self.diagnosis_active,
            |g| g.get() as f64,
        );
        e.gauges(
            "sluice_backend_healthy",
            "1 if the replica passes health checks.",
            &self.backends,
            |s| s.healthy.get() as f64,
        );
        e.gauges(
            "sluice_backend_role",
            "1 for the replica's role (backends[].role: mixed, prefill, decode): join on backend to see a pool's queue, KV and load.",
            &self.backend_roles,
            |g| g.get() as f64,
        );
        e.gauges(
            "sluice_backend_in_flight",
            "Requests this gateway has in flight on the replica.",
            &self.backends,
            |s| s.in_flight.get() as f64,
        );
        e.gauges(
            "sluice_backend_ejected",
            "1 while the replica is ejected by passive health checks (outlier detection).",
            &self.backends,
            |s| s.ejected.get() as f64,
        );
        e.counters(
            "sluice_backend_attempts_total",
            "Attempts this gateway sent to the replica (retries included).",
            &self.backends,
            |s| &s.attempts,
        );
        e.counters(
            "sluice_backend_stream_stalls_total",
            "Inter-token gaps longer than telemetry.stall_threshold in streams the replica served.",
            &self.backends,
            |s| &s.stalls,
        );
        e.counters(
            "sluice_backend_ejections_total",
            "Ejections after consecutive failed requests.",
            &self.backends,
            |s| &s.ejections,
        );
        e.counters(
            "sluice_backend_cached_tokens_predicted_total",
            "Prompt tokens routing expected the replica to have cached, for requests whose usage reported cached tokens.",
            &self.backends,
            |s| &s.cached_predicted,
        );
        e.counters(
            "sluice_backend_cached_tokens_actual_total",
            "Prompt tokens the replica reported cached, for the same requests (predicted vs actual: routing's precision).",
            &self.backends,
            |s| &s.cached_actual,
        );
        e.counters(
            "sluice_backend_prefix_elsewhere_total",
            "Requests sent to the replica (first attempts) whose prompt's first routing.prefix_kv.home_blocks blocks were last sent to another replica: prompts that share a prefix, scattered (whatever the policy).",
            &self.backends,
            |s| &s.prefix_elsewhere,
        );
        e.gauges(
            "sluice_backend_kv_cache_usage_ratio",
            "KV-cache usage the replica reports (0..1), from its own /metrics.",
            &self.backends,
            |s| s.kv_usage.get(),
        );
        e.gauges(
            "sluice_backend_requests_waiting",
            "Requests the replica holds and does not run, from its own /metrics: its queue and, where the engine keeps them apart, those waiting for their KV or a grammar (sluice_backend_requests_deferred).",
            &self.backends,
            |s| s.waiting.get(),
        );
        e.gauges(
            "sluice_backend_requests_deferred",
            "Of the requests waiting at the replica, those waiting for something other than room (vLLM's num_requests_waiting_by_reason{reason=\"deferred\"}: KV pulls, grammars; SGLang's decode transfer, prefill bootstrap and grammar queues), which are no queue; NaN where the engine does not report it.",
            &self.backends,
            |s| s.deferred.get(),
        );
        e.gauges(
            "sluice_backend_requests_running",
            "Requests running in the replica's batch, from its own /metrics.",
            &self.backends,
            |s| s.running.get(),
        );
        e.gauges(
            "sluice_backend_requests_elsewhere",
            "Requests the replica's engine ran or held at the last scrape beyond this gateway's in flight there: other gateways' or clients' (0 where the engine does not report both counts).",
            &self.backends,
            |s| s.elsewhere.get() as f64,
        );
        e.gauges(
            "sluice_backend_prefix_cache_hit_ratio",
            "Prefix-cache hits over queries since the replica started, where the engine reports them.",
            &self.backends,
            |s| s.prefix_hit_rate.get(),
        );
        e.float_counters(
            "sluice_backend_engine_preemptions_total",
            "Preemptions the replica's engine reports (vllm:num_preemptions_total), re-exported from its /metrics (0 until it reports one): its rate is the replica's preemption rate.",
            &self.backends,
            |s| s.preemptions.get(),
        );
        e.gauges(
            "sluice_backend_gpu_utilization_ratio",
            "GPU utilisation of the replica (0..1, mean over its GPUs), from its DCGM exporter (backends[].dcgm_url).",
            &self.backends,
            |s| s.gpu_util.get(),
        );
        e.gauges(
            "sluice_backend_gpu_memory_usage_ratio",
            "GPU framebuffer memory used (0..1 of used + free, over its GPUs), from its DCGM exporter.",
            &self.backends,
            |s| s.gpu_memory.get(),
        );
        e.gauges(
            "sluice_backend_metrics_age_seconds",
            "Age of the last successful scrape of the replica's metrics (+Inf: never; NaN with routing.metrics.enabled false).",
            &self.backends,
            |s| {
                if self.scraping.load(Relaxed) {
                    s.metrics_age()
                } else {
                    f64::NAN
                }
            },
        );
        e.counters(
            "sluice_ratelimit_decisions_total",
            "Rate-limit decisions by tier, limit hit (requests, tokens, concurrency; empty when none) and decision (admitted, rejected, admitted_store_down, rejected_store_down).",
            &self.ratelimit_decisions,
            |c| c,
        );
        e.counters(
            "sluice_ratelimit_store_errors_total",
            "Rate-limit store calls that failed (unreachable, timed out).",
            &self.ratelimit_store_errors,
            |c| c,
        );
        e.one_histogram(
            "sluice_ratelimit_store_seconds",
            "Time of one rate-limit admission in its store: the round trip to Redis, or the in-process memory store's own time.",
            "",
            &self.ratelimit_store_seconds,
        );
        e.single(
            "sluice_backends_healthy",
            "Replicas passing health checks, over all models (0: every request gets 503).",
            Kind::Gauge,
            self.backends_healthy.get() as f64,
        );
        e.gauges(
            "sluice_model_replicas_healthy",
            "Replicas passing health checks per served model (0: that model's requests get 503).",
            &self.model_replicas_healthy,
            |g| g.get() as f64,
        );
        e.counters(
            "sluice_traces_sampled_total",
            "Requests whose trace qualified for tail sampling, by reason, and whether it was kept or capped (telemetry.tracing.sampling.max_per_second).",
            &self.traces,
            |c| c,
        );
        e.counters(
            "sluice_trace_spans_total",
            "Spans of kept traces by outcome: exported, export_failed (collector unreachable), queue_full (dropped).",
            &self.trace_spans,
            |c| c,
        );
        e.counters(
            "sluice_config_reloads_total",
            "Config reloads (SIGHUP) by result: ok, or error (the running config stays).",
            &self.config_reloads,
            |c| c,
        );
        e.counters(
            "sluice_tls_certificate_reloads_total",
            "TLS certificate reloads (file change or SIGHUP) by certificate (server: the listeners'; upstream: the client certificate for https replicas) and result (error: the certificate loaded before stays).",
            &self.tls_reloads,
            |c| c,
        );
        e.counters(
            "sluice_tls_handshake_failures_total",
            "TLS handshakes with clients that failed (untrusted or missing client certificate, plain HTTP, timeout), by listener.",
            &self.tls_handshake_failures,
            |c| c,
        );
        e.counters(
            "sluice_epp_decisions_total",
            "Endpoint picker (epp): requests decided, by model and outcome: routed (an endpoint named), dropped (429: flow control shed it or a rate limit refused it), unavailable (503: no eligible replica ready), bad_request (4xx: bad JSON, no model, unknown model), error (other).",
            &self.epp_decisions,
            |c| c,
        );
        e.one_histogram(
            "sluice_epp_decision_seconds",
            "Endpoint picker (epp): from a request's complete body to its answer (the pick, or the error), flow control's wait included.",
            "",
            &self.epp_decision_seconds,
        );
        e.single(
            "sluice_uptime_seconds",
            "Seconds since the gateway started.",
            Kind::Gauge,
            self.started.elapsed().as_secs_f64(),
        );
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(tiers: &[&str]) -> KnownLabels {
        KnownLabels {
            tiers: tiers.iter().map(|t| Arc::from(*t)).collect(),
            bands: vec![Arc::from("0")],
            store: "memory",
            attempt_kinds: vec!["upstream_connect"],
            retry_kinds: vec!["upstream_connect"],
            trace_reasons: vec!["error"],
        }
    }

    #[test]
    fn known_labels_make_series_at_zero_for_models_seen_before_and_after() {
        let m = Metrics::new(&Buckets::default());
        m.know(known(&["free"]));
        m.init_model(&Arc::from("a"));
        let b = m.init_backend(&Arc::from("r1"), "mixed");
        assert_eq!(b.attempts.get(), 0);
        let text = m.render(false);
        for series in [
            r#"sluice_upstream_retries_total{model="a",reason="upstream_connect"} 0"#,
            r#"sluice_routing_session_moves_total{model="a",reason="fallback"} 0"#,
            r#"sluice_requests_total{model="a",endpoint="chat",tier="free",status="200",error_kind=""} 0"#,
            r#"sluice_ratelimit_decisions_total{tier="free",limit="tokens",decision="rejected"} 0"#,
            r#"sluice_ratelimit_store_errors_total{store="memory"} 0"#,
            r#"sluice_config_reloads_total{result="error"} 0"#,
            r#"sluice_flow_requests_total{model="a",band="0",outcome="shed_timeout"} 0"#,
            r#"sluice_upstream_errors_total{backend="r1",kind="upstream_connect"} 0"#,
            r#"sluice_backend_engine_preemptions_total{backend="r1"} 0"#,
            r#"sluice_time_to_first_token_seconds_count{model="a",endpoint="chat",tier="free"} 0"#,
        ] {
            assert!(text.contains(series), "{series} not in\n{text}");
        }
        // A reload that adds a tier: the models already seen get it too.
        m.know(known(&["free", "pro"]));
        let text = m.render(false);
        assert!(
            text.contains(r#"sluice_requests_total{model="a",endpoint="chat",tier="pro",status="200",error_kind=""} 0"#),
            "{text}"
        );
        // A replica that leaves takes its series with it.
        m.retain_backends(&[]);
        assert!(!m.render(false).contains(r#"backend="r1""#));
    }

    #[test]
    fn the_reference_table_has_every_family_once() {
        let table = Metrics::reference_table();
        let rendered = Metrics::new(&Buckets::default()).render(false);
        let families = rendered.matches("# TYPE ").count();
        assert_eq!(table.lines().count(), families + 2, "{table}");
        assert!(table.contains("| `sluice_upstream_errors_total` | counter | backend, kind |"));
    }
}
