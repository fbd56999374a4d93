//! One owner per request: the guard created when a request arrives.
//!
//! [`RequestGuard`] holds everything a request accounts for: its timing
//! record, its rate-limit admission, and the in-flight count of the replica
//! its current attempt went to. Every way a request can end (answered,
//! failed before the model was known, failed upstream, stream cut, client
//! gone, handler cancelled) ends in [`Drop`], which does, in this order:
//!
//! 1. **settle** the admission with the tokens really used (refund or extra
//!    charge; the concurrency slot is freed),
//! 2. **report** the record once (metrics, trace decision, access log),
//! 3. **release** the replica: its recent-latency averages learn from a
//!    success, its success streak (outlier detection) is credited, its
//!    in-flight count and the model's fall;
//! 4. **hand over** its flow-control seat (with the tokens really used, for
//!    fairness): a request waiting for room may go now.
//!
//! The order is explicit in [`RequestGuard::end`], not a consequence of field
//! order. A failed attempt is recorded in one place,
//! [`RequestGuard::attempt_failed`].

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::GatewayError;
use crate::flow::Seat;
use crate::limits::{Admission, Identity, RateHeaders};
use crate::routing::Affinity;
use crate::routing::placement::Placement;
use crate::routing::prefilling::PrefillMark;
use crate::routing::sessions::response_key;
use crate::telemetry::Telemetry;
use crate::telemetry::metrics::ModelSeries;
use crate::telemetry::record::RequestRecord;
use crate::telemetry::tracecontext::TraceCtx;
use crate::upstream::pool::{InFlight, Replica};
use crate::vocab::{Endpoint, RouteReason};

pub struct RequestGuard {
    pub record: RequestRecord,
    /// The model's series, once the model is known (its in-flight gauge was
    /// raised then).
    series: Option<Arc<ModelSeries>>,
    admission: Option<Admission>,
    /// The current attempt's replica, holding its in-flight count.
    attempt: Option<InFlight>,
    /// Routing's accounting of the current attempt (backlog, calibration,
    /// cached tokens predicted).
    placement: Option<Placement>,
    tele: Arc<Telemetry>,
    stall_threshold: Duration,
    /// The prompt's text, only when the access log includes prompts.
    prompt_text: Option<String>,
    /// Responses: where the produced response's id is remembered.
    response_homes: Option<Arc<Affinity>>,
    /// Flow control's seat, given back last (it hands the room to a waiter).
    seat: Option<Seat>,
    /// `flow_control.output_weight`, to tell the seat the real cost.
    output_weight: f64,
    /// Output events after which the stream counts as about to finish.
    leaving_after: Option<u32>,
    /// What must live as long as the request (SGLang's prefill leg, running
    /// beside the decode one: dropped, it is aborted).
    held: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl RequestGuard {
    /// A request arrived at `arrival`; nothing about it is known yet but its
    /// id and trace context.
    pub fn new(
        tele: Arc<Telemetry>,
        endpoint: Endpoint,
        arrival: Instant,
        request_id: String,
        trace: TraceCtx,
        stall_threshold: Duration,
    ) -> Self {
        // The shared empty label: an `Arc::from("")` allocates.
        let none = tele.metrics.no_tier.clone();
        let mut record = RequestRecord::new(endpoint, none, false, arrival);
        record.request_id = request_id;
        record.trace = Some(trace);
        Self {
            record,
            series: None,
            admission: None,
            attempt: None,
            placement: None,
            tele,
            stall_threshold,
            prompt_text: None,
            response_homes: None,
            seat: None,
            output_weight: 1.0,
            leaving_after: None,
            held: None,
        }
    }

    /// The caller is known: its tier labels the request from now on, also
    /// when it fails before its model is known.
    pub(crate) fn identified(&mut self, id: &Identity) {
        self.record.tier = Some(id.tier.clone());
        self.record.key_name = Some(id.name.clone());
    }

    /// The model's series, once the model is known.
    pub(crate) fn series(&self) -> Option<&ModelSeries> {
        self.series.as_deref()
    }

    /// The served model is known (aliases resolved): its series label the
    /// request and count it in flight.
    pub fn set_model(&mut self, model: Arc<str>) {
        let m = &self.tele.metrics;
        let tier = self
            .record
            .tier
            .clone()
            .unwrap_or_else(|| m.no_tier.clone());
        let series = m
            .models
            .get(&(model.clone(), self.record.endpoint.as_str(), tier));
        series.in_flight.inc();
        if let Some(old) = self.series.replace(series) {
            old.in_flight.dec();
        }
        self.record.model = model;
    }

    /// Remember the id of the response this request produces (Responses), so
    /// that a follow-up naming it goes to the same replica.
    pub(crate) fn remember_response(&mut self, homes: Arc<Affinity>) {
        self.response_homes = Some(homes);
    }

    pub(crate) fn set_prompt_text(&mut self, text: Option<String>) {
        self.prompt_text = text;
    }

    /// The rate limiter admitted the request; settled at the end.
    pub(crate) fn admitted(&mut self, admission: Admission) {
        self.record.ratelimit = Some(if admission.is_unlimited() {
            "admitted_store_down"
        } else {
            "admitted"
        });
        self.admission = Some(admission);
    }

    /// The `x-ratelimit-*` headers of the admission, if one was made.
    pub(crate) fn rate_headers(&self) -> Option<&RateHeaders> {
        self.admission.as_ref().map(|a| &a.headers)
    }

    /// Flow control gave the request a seat.
    pub(crate) fn seated(&mut self, seat: Seat, output_weight: f64) {
        self.seat = Some(seat);
        self.output_weight = output_weight;
        // A stream with a sixteenth of its `max_tokens` left (at least one
        // token) is about to end: its seat is as good as free.
        self.leaving_after = self
            .record
            .max_tokens
            .filter(|&m| m > 1)
            .map(|m| m - (m / 16).max(1));
    }

    /// The request goes to `replica` (attempt number `attempts + 1`): its
    /// in-flight count rises until the attempt fails or the request ends.
    pub(crate) fn start_attempt(
        &mut self,
        replica: Arc<Replica>,
        reason: RouteReason,
        now: Instant,
    ) {
        self.record.route_reason = Some(reason);
        self.record.attempts += 1;
        self.record.backend = Some(replica.name.clone());
        self.record.upstream_sent = Some(now);
        self.record.first_sent.get_or_insert(now);
        self.attempt = Some(InFlight::new(replica));
        if let Some(seat) = &mut self.seat {
            seat.sent();
        }
    }

    /// Routing's accounting of the current attempt.
    pub(crate) fn placed(&mut self, p: Placement) {
        self.placement = Some(p);
    }

    /// The current attempt's prompt is being prefilled: requests for it
    /// may wait for its first token (`routing::prefilling`); `retaken`, a
    /// prefill this request waited for and marked again when its attempt
    /// ended without a first token.
    pub(crate) fn prefilling(&mut self, retaken: Option<PrefillMark>) {
        if let Some(p) = self.placement.as_mut() {
            p.mark_prefilling(retaken);
        }
    }

    /// The current attempt waited `waited` for its cold prefill's place in
    /// its replica's gate (`slot`, held until its first token) and is sent
    /// at `now`: its upstream timings start there.
    pub(crate) fn gated(
        &mut self,
        slot: Option<crate::routing::cold_gate::ColdSlot>,
        waited: Duration,
        now: Instant,
    ) {
        if let Some(p) = self.placement.as_mut() {
            p.gated(slot, waited);
        }
        self.record.upstream_sent = Some(now);
        if self.record.attempts == 1 {
            self.record.first_sent = Some(now);
        }
    }

    /// The current attempt, held for another's prefill, keeps that
    /// prefill's place in the replica's cold-prefill gate until its first
    /// token ([`Placement::sharing_gate`]).
    pub(crate) fn sharing_gate(&mut self, slot: crate::routing::cold_gate::ColdSlot) {
        if let Some(p) = self.placement.as_mut() {
            p.sharing_gate(slot);
        }
    }

    /// Keep `x` until the request ends.
    pub(crate) fn hold(&mut self, x: Box<dyn std::any::Any + Send + Sync>) {
        self.held = Some(x);
    }

    /// The replica of the current attempt.
    pub(crate) fn replica(&self) -> Option<&Arc<Replica>> {
        self.attempt.as_ref().map(InFlight::replica)
    }

    /// The current attempt failed with `kind`: counted against its replica,
    /// and towards its ejection when `blames_replica`. The attempt stays open
    /// (a stream that reported an error in-band still runs to its end); see
    /// [`end_attempt`](Self::end_attempt).
    pub(crate) fn attempt_failed(&mut self, kind: &'static str, blames_replica: bool) {
        let Some(replica) = self.replica() else {
            return;
        };
        self.tele
            .metrics
            .upstream_errors
            .get(&(replica.name.clone(), kind))
            .inc();
        if blames_replica {
            replica.record_failure();
        }
    }

    /// [`attempt_failed`](Self::attempt_failed) for a gateway error.
    pub(crate) fn attempt_error(&mut self, e: &GatewayError) {
        self.attempt_failed(e.kind(), e.blames_replica());
    }

    /// The current attempt is over (failed; another may follow): the replica's
    /// in-flight count falls now.
    pub(crate) fn end_attempt(&mut self) {
        self.attempt = None;
        if let Some(p) = self.placement.as_mut() {
            p.end_prefilling();
        }
    }

    /// The request failed with `e`: its status and kind.
    pub(crate) fn fail(&mut self, e: &GatewayError) {
        self.record.fail(e.status().as_u16(), e.kind());
    }

    /// An event carrying generated output arrived at `now` (the token clock).
    #[inline]
    pub fn on_output(&mut self, now: Instant) {
        if self.record.first_token.is_none()
            && let Some(sent) = self.record.upstream_sent
        {
            let ttft = now.saturating_duration_since(sent);
            if let Some(p) = self.placement.as_mut() {
                p.first_token(ttft);
            }
            // The replica's recent TTFT learns it now, not when the stream
            // ends: a replica whose streams run long (the very case of
            // prefill starvation) shows its slow first tokens at once. From
            // the request's sending to this replica: neither the gateway's
            // queue nor an earlier attempt elsewhere is charged to it.
            if let Some(a) = &self.attempt {
                a.replica().ttft_recent.observe(ttft.as_secs_f64());
            }
        }
        if let Some(s) = &self.series {
            self.record.on_output(now, s, self.stall_threshold);
        }
        if let Some(n) = self.leaving_after
            && self.record.output_events >= n
            && let Some(a) = &mut self.attempt
        {
            a.mark_leaving();
            self.leaving_after = None;
        }
    }

    /// The stream ended at `now` without another token (see
    /// [`RequestRecord::on_cut`]).
    pub(crate) fn on_cut(&mut self, now: Instant) {
        if let Some(s) = &self.series {
            self.record.on_cut(now, s, self.stall_threshold);
        }
    }

    /// The end, in its order: settle, report, release.
    fn end(&mut self) {
        // 1. Settle the reservation with what was really used.
        let used = self.record.used_tokens();
        if let Some(mut a) = self.admission.take() {
            a.finish(used);
        }
        // A remote prefill: the request's cached tokens are the prefill
        // replica's (the decode replica counts the KV it pulled); the closed
        // loop below still compares the decode replica with itself.
        let served_cached = self.record.usage.and_then(|u| u.cached_tokens);
        if let Some(pd) = &self.record.pd {
            let m = &self.tele.metrics;
            let model = self.record.model.clone();
            m.pd_decisions
                .get(&(model.clone(), pd.reason.as_str()))
                .inc();
            if pd.reason == crate::vocab::PdReason::Remote
                && let (Some(sent), Some(first)) =
                    (self.record.upstream_sent, self.record.first_token)
            {
                m.pd_decode_first_token
                    .get(&(model,))
                    .observe(first.saturating_duration_since(sent).as_secs_f64());
            }
        }
        if let (Some(pd), Some(u)) = (&self.record.pd, self.record.usage.as_mut())
            && let Some(c) = pd.prefill_cached
        {
            u.cached_tokens = Some(c);
        }
        // 2. Report once.
        self.tele.report(
            &mut self.record,
            self.series.as_deref(),
            self.prompt_text.as_deref(),
        );
        // 3. Release the replica, with what it taught us.
        if let Some(attempt) = self.attempt.take() {
            let r = &self.record;
            // A disaggregated model's decode replica earns the stalled gaps
            // its local prefills may cause (`api::disagg`) by its streams'.
            // A local prefill that had more to prefill than predicted (the
            // replica evicted part of what routing's index listed) owes the
            // stalls of its extra chunks.
            if let (Some(pd), Some(p)) = (&r.pd, &self.placement) {
                let now = crate::turn::now_std();
                let mut ledger = p.stall_ledger();
                if r.output_events >= 2 {
                    ledger.relayed(r.output_events - 1, now);
                }
                if let (Some(c), Some(u), Some(cached)) = (pd.stall_charge, r.usage, served_cached)
                {
                    ledger.owe(c.shortfall(u.prompt_tokens.saturating_sub(cached)), now);
                }
            }
            if let (Some(mut p), Some(actual)) = (self.placement.take(), served_cached) {
                // Closed loop: what routing expected cached against the engine.
                p.finished(actual, r.usage.as_ref().map(|u| u.prompt_tokens));
                let series = &attempt.replica().series;
                series.cached_predicted.add(u64::from(p.predicted_cached));
                series.cached_actual.add(u64::from(actual));
            }
            self.placement = None;
            if let (Some(homes), Some(id)) = (&self.response_homes, &r.response_id) {
                let name = &attempt.replica().name;
                homes
                    .responses
                    .place(response_key(id), name, crate::turn::now_std());
            }
            if r.stalls > 0 {
                attempt.replica().series.stalls.add(u64::from(r.stalls));
            }
            if r.succeeded() {
                let replica = attempt.replica();
                replica.record_success();
                if let Some(t) = r.tpot() {
                    replica.tpot_recent.observe(t.as_secs_f64());
                }
            }
            drop(attempt);
        }
        if let Some(s) = &self.series {
            s.in_flight.dec();
        }
        // 4. Give the seat back: a waiter may go now.
        if let Some(mut seat) = self.seat.take() {
            if let Some(u) = self.record.usage {
                seat.used(u.prompt_tokens, u.completion_tokens, self.output_weight);
            }
            drop(seat);
        }
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.end();
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderMap;

    use super::*;
    use crate::config::Config;
    use crate::telemetry::metrics::{Metrics, StatusLabel};
    use crate::vocab::FinishReason;

    /// The handles a model's series keeps (`ModelSeries::ok_requests`,
    /// `finishes`) are the exposed series: requests counted through them
    /// and through a lookup land in the same counters.
    #[test]
    fn requests_counted_through_kept_handles_are_the_exposed_series() {
        let metrics = Arc::new(Metrics::new(&Config::default().telemetry.buckets));
        let tele = Arc::new(Telemetry {
            metrics: metrics.clone(),
            traces: None,
            access_log: None,
            refusal: None,
        });
        let end = |status: u16, finish: FinishReason| {
            let mut g = RequestGuard::new(
                tele.clone(),
                Endpoint::Chat,
                Instant::now(),
                "t".into(),
                TraceCtx::from_headers(&HeaderMap::new()),
                Duration::from_secs(2),
            );
            g.set_model(Arc::from("m"));
            g.record.status = status;
            g.record.finish_reason = Some(finish);
        };
        for _ in 0..3 {
            end(200, FinishReason::Stop);
        }
        end(200, FinishReason::Length);
        end(400, FinishReason::Stop);
        let requests = |status| {
            metrics
                .requests
                .get(&(
                    Arc::from("m"),
                    "chat",
                    Arc::from(""),
                    StatusLabel(status),
                    "",
                ))
                .get()
        };
        assert_eq!(requests(200), 4);
        assert_eq!(requests(400), 1);
        let finishes = |f: FinishReason| {
            metrics
                .finish_reasons
                .get(&(Arc::from("m"), f.as_str()))
                .get()
        };
        assert_eq!(finishes(FinishReason::Stop), 4);
        assert_eq!(finishes(FinishReason::Length), 1);
    }
}
