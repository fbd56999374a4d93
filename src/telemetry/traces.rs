//! OpenTelemetry traces with tail-based sampling decided in the gateway.
//!
//! Nothing is recorded as spans while a request runs: its timing record is
//! enough. When it ends, the sampler decides (keep every error, every request
//! over a TTFT, E2E or largest-gap threshold, a share of the rest, under a
//! traces-per-second cap); only a kept request is turned into spans, built
//! after the fact with its real timestamps and the ids handed to the replica
//! at the start. A dropped request costs one decision and no allocation.
//! Kept spans wait in a bounded queue (full: dropped and counted) for a task
//! that exports them in batches over OTLP (gRPC or HTTP/protobuf).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, SystemTime};

use opentelemetry::trace::{
    Event, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter, SpanLinks};
use tokio::sync::mpsc;

use super::metrics::Metrics;
use super::record::RequestRecord;
use super::registry::Counter;
use crate::config::{OtlpProtocol, TracingConfig};
use crate::vocab::Endpoint;

/// Why a trace was kept (also its `sluice.sampling.reason` attribute).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keep {
    Error,
    SlowTtft,
    SlowE2e,
    Stall,
    Sampled,
}

impl Keep {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Keep::Error => "error",
            Keep::SlowTtft => "slow_ttft",
            Keep::SlowE2e => "slow_e2e",
            Keep::Stall => "stall",
            Keep::Sampled => "sampled",
        }
    }

    pub(crate) const ALL: [Keep; 5] = [
        Keep::Error,
        Keep::SlowTtft,
        Keep::SlowE2e,
        Keep::Stall,
        Keep::Sampled,
    ];
}

/// The tail sampler: a pure decision plus a per-second budget.
pub(crate) struct Sampler {
    cfg: crate::config::SamplingConfig,
    /// Budget refill: `max_per_second` tokens per second, as a GCRA TAT in ns.
    tat_ns: AtomicU64,
    /// On tokio's clock (tests run the budget on paused time).
    epoch: tokio::time::Instant,
}

impl Sampler {
    pub(crate) fn new(cfg: crate::config::SamplingConfig) -> Self {
        Self {
            cfg,
            tat_ns: AtomicU64::new(0),
            epoch: tokio::time::Instant::now(),
        }
    }

    /// Whether this request's trace qualifies to be kept, and why (before
    /// the per-second cap, `budget`).
    pub(crate) fn decide(&self, r: &RequestRecord) -> Option<Keep> {
        let c = &self.cfg;
        // Errors are the gateway's and the replicas' (5xx, or a stream that
        // broke after its 200): client errors (4xx) are sampled like successes.
        let failed =
            !r.disconnected && (r.status >= 500 || (r.status < 400 && r.error_kind.is_some()));
        if c.keep_errors && failed {
            Some(Keep::Error)
        } else if r.ttft().is_some_and(|t| t >= c.ttft_threshold) {
            Some(Keep::SlowTtft)
        } else if r.e2e().is_some_and(|t| t >= c.e2e_threshold) {
            Some(Keep::SlowE2e)
        } else if r.output_events >= 2 && r.max_gap >= c.gap_threshold {
            Some(Keep::Stall)
        } else if c.ratio > 0.0 && fastrand::f64() < c.ratio {
            Some(Keep::Sampled)
        } else {
            None
        }
    }

    /// One trace from the per-second budget (burst: one second's worth).
    pub(crate) fn budget(&self) -> bool {
        let max = self.cfg.max_per_second;
        if max == 0 {
            return true;
        }
        let interval = 1_000_000_000 / u64::from(max);
        let burst = u64::from(max) * interval;
        let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.tat_ns
            .fetch_update(Relaxed, Relaxed, |tat| {
                let new = tat.max(now) + interval;
                (new - now <= burst).then_some(new)
            })
            .is_ok()
    }
}

pub struct Traces {
    sampler: Sampler,
    tx: mpsc::Sender<SpanData>,
    scope: InstrumentationScope,
    metrics: Arc<Metrics>,
    /// Spans that found the export queue full.
    queue_full: Arc<Counter>,
}

/// Spans waiting for export; beyond this, new ones are dropped (and counted).
const QUEUE: usize = 4096;
const BATCH: usize = 512;

impl Traces {
    /// Start the exporter task. `None` when tracing is off.
    pub(crate) fn start(
        cfg: &TracingConfig,
        metrics: &Arc<Metrics>,
    ) -> anyhow::Result<Option<Arc<Self>>> {
        let Some(resolved) = cfg.resolve() else {
            return Ok(None);
        };
        let mut exporter = match resolved.protocol {
            OtlpProtocol::Grpc => {
                use opentelemetry_otlp::WithExportConfig;
                let mut b = opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_timeout(Duration::from_secs(10));
                if let Some(e) = &resolved.endpoint {
                    b = b.with_endpoint(e.clone());
                }
                b.build()?
            }
            OtlpProtocol::HttpProtobuf => {
                use opentelemetry_otlp::WithExportConfig;
                let mut b = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .with_timeout(Duration::from_secs(10));
                if let Some(e) = &resolved.endpoint {
                    b = b.with_endpoint(e.clone());
                }
                b.build()?
            }
        };
        exporter.set_resource(
            &Resource::builder()
                .with_service_name(resolved.service_name.clone())
                .build(),
        );
        let (tx, rx) = mpsc::channel(QUEUE);
        // (Every reason and decision exists at zero from the start:
        // `Metrics::know`.)
        let spans = &metrics.trace_spans;
        let (exported, failed) = (spans.get(&("exported",)), spans.get(&("export_failed",)));
        // Detached: when the last `Traces` is dropped (a config reload that
        // changed tracing), the queue closes and the task exports what is
        // left, then ends.
        tokio::spawn(export_loop(exporter, rx, exported, failed));
        tracing::info!(
            protocol = ?resolved.protocol,
            endpoint = resolved.endpoint.as_deref().unwrap_or("(OTEL_EXPORTER_OTLP_* or default)"),
            service = %resolved.service_name,
            "exporting sampled traces over OTLP"
        );
        Ok(Some(Arc::new(Self {
            sampler: Sampler::new(cfg.sampling.clone()),
            tx,
            scope: InstrumentationScope::builder("sluice")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
            metrics: metrics.clone(),
            queue_full: spans.get(&("queue_full",)),
        })))
    }

    /// Decide at the end of a request; build and queue its spans if kept.
    /// Returns the reason when kept (so exemplars can point to the trace).
    pub(crate) fn finish(&self, r: &RequestRecord) -> Option<Keep> {
        let keep = self.sampler.decide(r)?;
        let capped = !self.sampler.budget();
        let decision = if capped { "capped" } else { "kept" };
        self.metrics.traces.get(&(keep.as_str(), decision)).inc();
        if capped {
            return None;
        }
        let mut complete = true;
        for span in spans(r, keep, &self.scope) {
            if self.tx.try_send(span).is_err() {
                self.queue_full.inc();
                complete = false;
            }
        }
        // Exemplars and the access log point only to traces that will exist.
        complete.then_some(keep)
    }
}

async fn export_loop(
    exporter: opentelemetry_otlp::SpanExporter,
    mut rx: mpsc::Receiver<SpanData>,
    exported: Arc<Counter>,
    failed: Arc<Counter>,
) {
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        // Wait for the first span, then take what else is queued (up to a
        // batch) or what arrives within 200 ms.
        let Some(first) = rx.recv().await else { return };
        batch.push(first);
        let deadline = tokio::time::Instant::now() + Duration::from_millis(200);
        while batch.len() < BATCH {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(s)) => batch.push(s),
                Ok(None) | Err(_) => break,
            }
        }
        let n = batch.len() as u64;
        match exporter.export(std::mem::take(&mut batch)).await {
            Ok(()) => exported.add(n),
            Err(e) => {
                failed.add(n);
                tracing::warn!(error = %e, spans = n, "OTLP export failed");
            }
        }
    }
}

fn wall(r: &RequestRecord, at: tokio::time::Instant) -> SystemTime {
    r.wall_arrival + at.saturating_duration_since(r.arrival)
}

fn operation(e: Endpoint) -> &'static str {
    match e {
        Endpoint::Chat => "chat",
        Endpoint::Completions => "text_completion",
        Endpoint::Embeddings => "embeddings",
        // Both are conversations in GenAI terms; `sluice.endpoint` tells them apart.
        Endpoint::Messages | Endpoint::Responses => "chat",
        Endpoint::CountTokens => "count_tokens",
        Endpoint::Passthrough => "passthrough",
    }
}

/// The request's spans: a SERVER span for the whole request and, if it
/// reached a replica, a CLIENT span for the call (parent of the replica's own
/// spans), with the GenAI semantic-convention attributes.
fn spans(r: &RequestRecord, keep: Keep, scope: &InstrumentationScope) -> Vec<SpanData> {
    let Some(t) = r.trace else {
        return Vec::new();
    };
    let trace_id = TraceId::from(t.trace_id);
    let ctx = |span: u64| {
        SpanContext::new(
            trace_id,
            SpanId::from(span),
            TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        )
    };
    let end = r.end.unwrap_or_else(tokio::time::Instant::now);
    let op = operation(r.endpoint);
    let mut attrs = vec![
        KeyValue::new("gen_ai.operation.name", op),
        KeyValue::new(
            "gen_ai.request.model",
            r.requested_model.as_deref().unwrap_or(&r.model).to_string(),
        ),
        // The served name (aliases resolved), which the replica reports as
        // the response's `model`.
        KeyValue::new("gen_ai.response.model", r.model.to_string()),
        KeyValue::new("http.response.status_code", i64::from(r.status)),
        KeyValue::new("sluice.request_id", r.request_id.clone()),
        KeyValue::new("sluice.endpoint", r.endpoint.as_str()),
        KeyValue::new("sluice.stream", r.stream),
        KeyValue::new("sluice.sampling.reason", keep.as_str()),
        KeyValue::new("sluice.output_events", i64::from(r.output_events)),
        KeyValue::new("sluice.stalls", i64::from(r.stalls)),
        KeyValue::new("sluice.attempts", i64::from(r.attempts)),
    ];
    if let Some(m) = r.max_tokens {
        attrs.push(KeyValue::new("gen_ai.request.max_tokens", i64::from(m)));
    }
    if let Some(f) = r.finish_reason {
        attrs.push(KeyValue::new(
            "gen_ai.response.finish_reasons",
            opentelemetry::Value::Array(opentelemetry::Array::String(vec![
                opentelemetry::StringValue::from(f.as_str()),
            ])),
        ));
    }
    if let Some(u) = r.usage {
        attrs.push(KeyValue::new(
            "gen_ai.usage.input_tokens",
            i64::from(u.prompt_tokens),
        ));
        attrs.push(KeyValue::new(
            "gen_ai.usage.output_tokens",
            i64::from(u.completion_tokens),
        ));
    }
    if let Some(d) = r.ttft() {
        attrs.push(KeyValue::new("sluice.ttft_seconds", d.as_secs_f64()));
    }
    if r.output_events >= 2 {
        attrs.push(KeyValue::new(
            "sluice.max_gap_seconds",
            r.max_gap.as_secs_f64(),
        ));
    }
    if let Some(reason) = r.route_reason {
        attrs.push(KeyValue::new("sluice.route.reason", reason.as_str()));
    }
    if let Some(pd) = &r.pd {
        attrs.push(KeyValue::new("sluice.pd.reason", pd.reason.as_str()));
        if let Some(b) = &pd.prefill_backend {
            attrs.push(KeyValue::new("sluice.pd.prefill_backend", b.to_string()));
        }
        if let Some(d) = pd.prefill_time() {
            attrs.push(KeyValue::new("sluice.pd.prefill_seconds", d.as_secs_f64()));
        }
    }
    if let Some(b) = &r.backend {
        attrs.push(KeyValue::new("sluice.backend", b.to_string()));
    }
    if let Some(tier) = &r.tier {
        attrs.push(KeyValue::new("sluice.tier", tier.to_string()));
    }
    if let Some(k) = &r.key_name {
        attrs.push(KeyValue::new("sluice.key_name", k.to_string()));
    }
    if let Some(o) = r.ratelimit {
        attrs.push(KeyValue::new("sluice.ratelimit.outcome", o));
    }
    if let Some(f) = r.flow {
        attrs.push(KeyValue::new("sluice.flow.band", i64::from(f.band)));
        attrs.push(KeyValue::new("sluice.flow.outcome", f.outcome));
        attrs.push(KeyValue::new(
            "sluice.flow.wait_seconds",
            f.waited.as_secs_f64(),
        ));
    }
    if r.disconnected {
        attrs.push(KeyValue::new("sluice.client_disconnected", true));
    }
    // `error.type` on every failure; span status Error only for the
    // server's own (5xx, or a stream broken after its 200): a 4xx is the
    // client's, Unset per the HTTP semantic conventions for server spans.
    let status = match r.error_kind {
        Some(kind) if !r.disconnected => {
            attrs.push(KeyValue::new("error.type", kind));
            if r.status >= 500 || r.status < 400 {
                Status::error(kind)
            } else {
                Status::Unset
            }
        }
        _ => Status::Unset,
    };
    let mut events = Vec::new();
    if let Some(first) = r.first_token {
        events.push(Event::new("gen_ai.first_token", wall(r, first), vec![], 0));
    }
    for s in &r.stall_events {
        events.push(Event::new(
            "sluice.stall",
            wall(r, s.at),
            vec![KeyValue::new("sluice.gap_seconds", s.gap.as_secs_f64())],
            0,
        ));
    }
    let mut span_events = SpanEvents::default();
    span_events.events = events;
    let server = SpanData {
        span_context: ctx(t.span_id),
        parent_span_id: t.parent_span_id.map_or(SpanId::INVALID, SpanId::from),
        parent_span_is_remote: t.parent_span_id.is_some(),
        span_kind: SpanKind::Server,
        name: format!("{op} {}", r.model).into(),
        start_time: r.wall_arrival,
        end_time: wall(r, end),
        attributes: attrs,
        dropped_attributes_count: 0,
        events: span_events,
        links: SpanLinks::default(),
        status: status.clone(),
        instrumentation_scope: scope.clone(),
    };
    let mut out = vec![server];
    // A client span per call to a replica: `upstream`, or for a remote
    // prefill of a disaggregated model its two legs, `prefill` and `decode`.
    let client = |b: &str, leg: &str, span: u64, start, end, status: Status| {
        let (host, port) = b.rsplit_once(':').unwrap_or((b, ""));
        let mut attrs = vec![
            KeyValue::new("gen_ai.operation.name", op),
            KeyValue::new("gen_ai.request.model", r.model.to_string()),
            KeyValue::new("server.address", host.to_string()),
        ];
        if let Ok(p) = port.parse::<i64>() {
            attrs.push(KeyValue::new("server.port", p));
        }
        SpanData {
            span_context: ctx(span),
            parent_span_id: SpanId::from(t.span_id),
            parent_span_is_remote: false,
            span_kind: SpanKind::Client,
            name: format!("{op} {} {leg}", r.model).into(),
            start_time: wall(r, start),
            end_time: wall(r, end),
            attributes: attrs,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status,
            instrumentation_scope: scope.clone(),
        }
    };
    let prefill = r.pd.as_deref().and_then(|pd| {
        Some((
            pd.prefill_backend.as_deref()?,
            pd.prefill_sent?,
            pd.prefill_time()?,
        ))
    });
    if let Some((b, sent, took)) = prefill {
        out.push(client(
            b,
            "prefill",
            t.prefill_span_id(),
            sent,
            sent + took,
            Status::Unset,
        ));
    }
    if let (Some(sent), Some(b)) = (r.upstream_sent, &r.backend) {
        let leg = if prefill.is_some() {
            "decode"
        } else {
            "upstream"
        };
        out.push(client(b, leg, t.upstream_span_id, sent, end, status));
    }
    out
}

#[cfg(test)]
mod tests;
