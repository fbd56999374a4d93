//! The per-request timing record: filled on the hot path, reported once.
//!
//! The record is plain data plus the token clock ([`RequestRecord::on_output`]).
//! Who owns it and when it is reported is the request guard's business
//! (the `request` module); [`Telemetry::report`](super::Telemetry::report) turns a
//! finished record into metrics, a trace decision and an access-log line.
//! Times are tokio's, so tests on paused time see the clock they drive.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::Telemetry;
use super::metrics::{ModelSeries, StatusLabel};
use crate::vocab::{Endpoint, FinishReason, RouteReason, Usage};

/// Status recorded for a request the client abandoned (nginx's convention).
pub(crate) const CLIENT_CLOSED: u16 = 499;

/// A gap between tokens above the stall threshold, for the trace's events.
#[derive(Debug, Clone, Copy)]
pub struct StallEvent {
    /// When the token that ended the gap arrived.
    pub at: Instant,
    pub gap: Duration,
}

/// Stall events kept per request (the count has no limit).
const MAX_STALL_EVENTS: usize = 8;

/// What flow control did with a request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlowOutcome {
    pub band: i32,
    pub outcome: &'static str,
    pub waited: Duration,
}

/// Inter-token gaps are put into the histogram this many at a time (and
/// at the stream's end): a few atomic adds per batch instead of three per
/// token. A long stream's gaps show within 16 tokens; a scrape may miss the
/// last few of a stream still running, as it misses the stream's TTFT-to-end
/// figures until it ends.
const GAP_BATCH: usize = 16;

#[derive(Debug, Clone)]
pub struct RequestRecord {
    pub request_id: String,
    /// W3C trace context (ids for the spans this request may export).
    pub trace: Option<super::tracecontext::TraceCtx>,
    /// Wall-clock time of `arrival`, for span and log timestamps.
    pub wall_arrival: std::time::SystemTime,
    pub endpoint: Endpoint,
    /// The served model name (aliases resolved): the label on metrics.
    pub model: Arc<str>,
    /// The client's name for it, when that was an alias.
    pub requested_model: Option<Arc<str>>,
    pub stream: bool,
    pub arrival: Instant,
    /// When the attempt that served the request was sent upstream.
    pub upstream_sent: Option<Instant>,
    /// When the first attempt was sent (gateway overhead ends there).
    pub first_sent: Option<Instant>,
    /// When the replica's answer (first chunk, or whole body) arrived.
    pub upstream_first_byte: Option<Instant>,
    /// When the response was handed to the client connection.
    pub response_ready: Option<Instant>,
    pub backend: Option<Arc<str>>,
    /// Why the serving replica was chosen (for the access log and traces).
    pub route_reason: Option<RouteReason>,
    /// The caller's tier and key name, when keys are configured.
    pub tier: Option<Arc<str>>,
    pub key_name: Option<Arc<str>>,
    /// Prompt tokens by the approximate tokenizer (settles a cut-short stream).
    pub prompt_estimate: u32,
    /// `max_tokens` as sent upstream.
    pub max_tokens: Option<u32>,
    /// What the answer's content said (tool calls and their validity, a
    /// refusal), when it was read to the end.
    pub verdict: Option<super::quality::Verdict>,
    /// `admitted`, `rejected_<limit>`, `admitted_store_down`, when limits apply.
    pub ratelimit: Option<&'static str>,
    /// Flow control: the band, how it passed (`immediate`, `waited`, or the
    /// shed's error kind) and how long it waited.
    pub flow: Option<FlowOutcome>,
    pub stall_events: Vec<StallEvent>,
    pub attempts: u32,
    pub first_token: Option<Instant>,
    pub last_token: Option<Instant>,
    pub output_events: u32,
    pub max_gap: Duration,
    /// Inter-token gaps not yet in the histogram (see [`GAP_BATCH`]).
    gaps: Vec<Duration>,
    pub stalls: u32,
    pub usage: Option<Usage>,
    pub finish_reason: Option<FinishReason>,
    /// HTTP status the client got (for streams: the status of the headers sent).
    pub status: u16,
    /// Closed-set error label; `None` on success.
    pub error_kind: Option<&'static str>,
    pub end: Option<Instant>,
    /// The client went away before the response ended.
    pub disconnected: bool,
    /// Responses: the id of the response the replica produced (where a
    /// later `previous_response_id` must go).
    pub response_id: Option<String>,
    /// A disaggregated model: how the request was prefilled (boxed: rare).
    pub pd: Option<Box<PdRecord>>,
}

/// How a request of a disaggregated model was prefilled.
#[derive(Debug, Clone)]
pub struct PdRecord {
    pub reason: crate::vocab::PdReason,
    /// The prefill replica of the leg that served (a remote prefill).
    pub prefill_backend: Option<Arc<str>>,
    /// Why routing chose that prefill replica (its prefix, a new home, a
    /// spill for load, ...).
    pub prefill_route: Option<crate::vocab::RouteReason>,
    /// The remote prefill leg: when it was sent, and sent to answered.
    pub prefill_sent: Option<Instant>,
    pub prefill: Option<Duration>,
    /// SGLang's protocol: the prefill leg runs beside the decode one, and
    /// its time is set here when it answers (read when the request ends).
    pub prefill_done: Option<Arc<std::sync::OnceLock<Duration>>>,
    /// Prompt tokens the prefill replica had cached (reported as the
    /// request's cached tokens: the decode replica's count the transfer).
    pub prefill_cached: Option<u32>,
    /// A local prefill under running streams (`local_stall_budget`): what
    /// it spent of the decode replica's allowance, checked at the end.
    pub stall_charge: Option<StallCharge>,
}

/// What a local prefill spent of its decode replica's allowance
/// (`routing::stall_budget`): the streams it stalls and the uncached tokens
/// predicted, checked against the engine's count when the request ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StallCharge {
    pub streams: u32,
    pub uncached: u32,
    pub chunk_tokens: u32,
    /// When it was spent (a refund gives back what is left of it).
    pub spent_at: std::time::Instant,
}

impl PdRecord {
    /// A prefill done by the decode replica itself, for `reason`.
    pub fn local(reason: crate::vocab::PdReason) -> Self {
        PdRecord {
            reason,
            prefill_backend: None,
            prefill_route: None,
            prefill_sent: None,
            prefill: None,
            prefill_done: None,
            prefill_cached: None,
            stall_charge: None,
        }
    }

    /// The remote prefill leg's time, sent to answered, if it answered.
    pub fn prefill_time(&self) -> Option<Duration> {
        self.prefill
            .or_else(|| self.prefill_done.as_ref()?.get().copied())
    }
}

impl RequestRecord {
    pub(crate) fn new(endpoint: Endpoint, model: Arc<str>, stream: bool, arrival: Instant) -> Self {
        let wall_arrival = std::time::SystemTime::now()
            .checked_sub(crate::turn::now().saturating_duration_since(arrival))
            .unwrap_or_else(std::time::SystemTime::now);
        Self {
            request_id: String::new(),
            trace: None,
            wall_arrival,
            endpoint,
            model,
            requested_model: None,
            stream,
            arrival,
            upstream_sent: None,
            first_sent: None,
            upstream_first_byte: None,
            response_ready: None,
            backend: None,
            route_reason: None,
            tier: None,
            key_name: None,
            prompt_estimate: 0,
            max_tokens: None,
            verdict: None,
            ratelimit: None,
            flow: None,
            stall_events: Vec::new(),
            attempts: 0,
            first_token: None,
            last_token: None,
            output_events: 0,
            max_gap: Duration::ZERO,
            gaps: Vec::new(),
            stalls: 0,
            usage: None,
            finish_reason: None,
            status: 0,
            error_kind: None,
            end: None,
            disconnected: false,
            response_id: None,
            pd: None,
        }
    }

    pub(crate) fn ttft(&self) -> Option<Duration> {
        self.first_token.map(|t| t - self.arrival)
    }

    pub(crate) fn e2e(&self) -> Option<Duration> {
        self.end.map(|t| t - self.arrival)
    }

    /// (last token - first token) / (completion tokens - 1), as vLLM defines TPOT.
    pub(crate) fn tpot(&self) -> Option<Duration> {
        let n = self.usage.map(|u| u.completion_tokens)?;
        let (first, last) = (self.first_token?, self.last_token?);
        (n > 1).then(|| (last - first) / (n - 1))
    }

    /// Time spent in the gateway itself: arrival to the first upstream send,
    /// plus the replica's first byte to the response handed to the client.
    pub(crate) fn gateway_overhead(&self) -> Option<Duration> {
        let before = self.first_sent?.saturating_duration_since(self.arrival);
        let after = match (self.upstream_first_byte, self.response_ready) {
            (Some(a), Some(b)) => b.saturating_duration_since(a),
            _ => Duration::ZERO,
        };
        Some(before + after)
    }

    pub(crate) fn succeeded(&self) -> bool {
        self.error_kind.is_none() && !self.disconnected && (200..300).contains(&self.status)
    }

    /// Mark the request failed with a closed-set kind and status.
    pub(crate) fn fail(&mut self, status: u16, kind: &'static str) {
        self.status = status;
        self.error_kind = Some(kind);
    }

    /// An event carrying generated output arrived at `now`. Per token: a few
    /// atomics, no allocation, no lock.
    #[inline]
    pub(crate) fn on_output(&mut self, now: Instant, series: &ModelSeries, stall: Duration) {
        match self.last_token {
            None => {
                self.first_token = Some(now);
                series.ttft.observe_duration(now - self.arrival);
            }
            Some(prev) => {
                let gap = now - prev;
                if self.gaps.len() >= GAP_BATCH {
                    self.flush_gaps(series);
                } else if self.gaps.capacity() == 0 {
                    self.gaps.reserve_exact(GAP_BATCH);
                }
                self.gaps.push(gap);
                self.note_gap(now, gap, series, stall);
            }
        }
        self.last_token = Some(now);
        self.output_events += 1;
    }

    /// Put the gaps held back into the inter-token histogram.
    pub(crate) fn flush_gaps(&mut self, series: &ModelSeries) {
        series.inter_token.observe_durations(&self.gaps);
        self.gaps.clear();
    }

    /// A silence of `gap` ending at `now`: the largest gap, and a stall when
    /// over the threshold.
    #[inline]
    fn note_gap(&mut self, now: Instant, gap: Duration, series: &ModelSeries, stall: Duration) {
        if gap > self.max_gap {
            self.max_gap = gap;
        }
        if gap > stall {
            self.stalls += 1;
            series.stalls.inc();
            if self.stall_events.len() < MAX_STALL_EVENTS {
                self.stall_events.push(StallEvent { at: now, gap });
            }
        }
    }

    /// The stream ended at `now` without another output event (timeout,
    /// broken replica, client gone): the silence since the last token is a
    /// gap too. It counts toward the largest gap and as a stall when over the
    /// threshold (a stall cut by the idle timeout is the clearest stall of
    /// all); it is not an inter-token latency, as no token ended it.
    pub(crate) fn on_cut(&mut self, now: Instant, series: &ModelSeries, stall: Duration) {
        if let Some(prev) = self.last_token {
            self.note_gap(now, now.saturating_duration_since(prev), series, stall);
        }
    }

    /// Tokens the request consumed: the replica's usage, or, for a stream cut
    /// short (no usage chunk), the prompt estimate plus the output events seen.
    pub(crate) fn used_tokens(&self) -> u32 {
        match self.usage {
            Some(u) => u.prompt_tokens.saturating_add(u.completion_tokens),
            None if self.upstream_sent.is_some() => {
                self.prompt_estimate.saturating_add(self.output_events)
            }
            None => 0,
        }
    }
}

impl Telemetry {
    /// Report a finished request once: its status settled (a request that
    /// produced no response was abandoned by its client), then histograms and
    /// counters (the model's `series` when its model was known), the tail
    /// sampler's decision with exemplars for a kept trace, and the access-log
    /// line (`prompt` only when the log includes prompts).
    pub(crate) fn report(
        &self,
        r: &mut RequestRecord,
        series: Option<&ModelSeries>,
        prompt: Option<&str>,
    ) {
        let end = *r.end.get_or_insert_with(Instant::now);
        if r.status == 0 {
            // Dropped before any response was produced: the client left.
            r.disconnected = true;
        }
        if r.disconnected {
            r.status = CLIENT_CLOSED;
            r.error_kind.get_or_insert("client_disconnect");
        }
        if let Some(s) = series {
            r.flush_gaps(s);
            observe(r, end, s);
        }
        let m = &self.metrics;
        if let Some(f) = r.finish_reason {
            let get = || m.finish_reasons.get(&(r.model.clone(), f.as_str()));
            match series {
                // The series is the request's model's (`set_model` sets both).
                Some(s) if let Some(cell) = s.finishes.get(f as usize) => {
                    cell.get_or_init(get).inc();
                }
                _ => get().inc(),
            }
        }
        let get = || {
            let tier = r.tier.clone().unwrap_or_else(|| m.no_tier.clone());
            m.requests.get(&(
                r.model.clone(),
                r.endpoint.as_str(),
                tier,
                StatusLabel(r.status),
                r.error_kind.unwrap_or(""),
            ))
        };
        match series {
            // The series' labels are this request's model, endpoint and tier.
            Some(s) if r.status == 200 && r.error_kind.is_none() => {
                s.ok_requests.get_or_init(get).inc();
            }
            _ => get().inc(),
        }
        // Tail sampling: decided now that the request is over.
        let kept = self.traces.as_ref().and_then(|t| t.finish(r));
        if let (Some(_), Some(t), Some(s)) = (kept, r.trace, series) {
            // Exemplars point from a latency bucket to a trace that exists.
            let id = t.trace_id_hex();
            if let Some(v) = r.ttft() {
                s.ttft.exemplar(v.as_secs_f64(), &id);
            }
            if r.succeeded() {
                s.e2e.exemplar((end - r.arrival).as_secs_f64(), &id);
                if let Some(v) = r.tpot() {
                    s.tpot.exemplar(v.as_secs_f64(), &id);
                }
                if r.output_events >= 2 {
                    s.max_gap.exemplar(r.max_gap.as_secs_f64(), &id);
                }
            }
        }
        if let Some(log) = &self.access_log {
            log.write(r, kept.map(|k| k.as_str()), prompt);
        }
    }
}

/// The quality signals of a successful generation, from its counts alone.
fn quality(r: &RequestRecord, s: &ModelSeries) {
    let completion = r.usage.map(|u| u.completion_tokens);
    if let (Some(c), Some(max)) = (completion, r.max_tokens.filter(|&m| m > 0)) {
        s.output_budget.observe(f64::from(c) / f64::from(max));
    }
    if r.finish_reason == Some(FinishReason::Length) {
        s.length_finishes.inc();
    }
    let nothing = if r.stream {
        r.output_events == 0
    } else {
        completion == Some(0)
    };
    if nothing && r.finish_reason != Some(FinishReason::ToolCalls) {
        s.empty_completions.inc();
    }
    if let Some(v) = r.verdict {
        s.tool_calls.add(u64::from(v.tool_calls));
        s.invalid_tool_calls.add(u64::from(v.invalid_tool_calls));
        if v.refusal {
            s.refusals.inc();
        }
    }
}

/// The model's histograms and token counters for a finished request.
fn observe(r: &RequestRecord, end: Instant, s: &ModelSeries) {
    if r.disconnected {
        s.client_disconnects.inc();
    }
    if let Some(sent) = r.upstream_sent {
        s.queue
            .observe_duration(sent.saturating_duration_since(r.arrival));
    }
    if let Some(o) = r.gateway_overhead() {
        s.overhead.observe_duration(o);
    }
    if let Some(u) = r.usage {
        s.prompt_tokens.add(u64::from(u.prompt_tokens));
        if let Some(c) = u.cached_tokens {
            s.prompt_tokens_cached.add(u64::from(c));
        }
        s.generation_tokens.add(u64::from(u.completion_tokens));
        s.prompt_tokens_per_request
            .observe(f64::from(u.prompt_tokens));
        if r.endpoint != Endpoint::Embeddings {
            s.generation_tokens_per_request
                .observe(f64::from(u.completion_tokens));
        }
    }
    if r.endpoint.generates() && r.succeeded() {
        quality(r, s);
    }
    if r.succeeded() {
        s.e2e.observe_duration(end - r.arrival);
        if let Some(tpot) = r.tpot() {
            s.tpot.observe_duration(tpot);
        }
        if r.output_events >= 2 {
            s.max_gap.observe_duration(r.max_gap);
        }
    }
}
