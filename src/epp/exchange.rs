//! One ext_proc stream: one HTTP request through the data plane, from its
//! headers to the end of its response.
//!
//! The request's headers and body are gathered (the body until its end),
//! then decided by the proxy's own steps (`api::proxy::admit`: the body
//! read, the model resolved, limits, flow control's seat; then its routing
//! policy): the pick goes back as the destination header and metadata, and
//! the body after it. The response's headers and body pass through while
//! the proxy's stream reader (`stream::relay`) times the tokens and counts
//! usage on the request's guard. The guard owns the accounting: whenever
//! the stream ends (answered, failed, or dropped by the data plane), its
//! `Drop` reports the request and releases the replica and the seat.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, processing_request::Request,
};
use tokio::sync::mpsc;
use tonic::Status;

use super::wire::{self, Prefiller, Proceed};
use crate::api::Head;
use crate::api::disagg::{self, DecodeSide};
use crate::api::homes;
use crate::api::inbound::Inbound;
use crate::api::proxy::{self, RouteInput};
use crate::error::GatewayError;
use crate::request::RequestGuard;
use crate::routing::placement::Placement;
use crate::routing::shared_table::Leg;
use crate::routing::{Decision, RouteCtx};
use crate::state::AppState;
use crate::stream::event::chunk_info;
use crate::stream::relay::{Mode, Relay};
use crate::stream::{protocols, quality};
use crate::telemetry::record::PdRecord;
use crate::telemetry::tracecontext::TraceCtx;
use crate::turn;
use crate::upstream::pool::{AwaitingPrefill, Candidates, Replica};
use crate::vocab::{Endpoint, PdReason, RouteReason, Wire};

pub(crate) type Answers = mpsc::Sender<Result<ProcessingResponse, Status>>;

/// The stream is over for the picker: answered for good (an immediate
/// response) or the data plane went away.
pub(crate) struct Over;

/// `ip:port` of a replica, as the data plane names endpoints: its URL's
/// authority.
pub(crate) fn endpoint_of(r: &Replica) -> &str {
    let rest = r
        .base
        .split_once("://")
        .map_or(&r.base[..], |(_, rest)| rest);
    rest.split('/').next().unwrap_or(rest)
}

/// What the picker knows of one stream's request and response.
pub(crate) struct Exchange {
    state: Arc<AppState>,
    tx: Answers,
    /// The data plane's body modes (`protocol_config` of the first
    /// message; without it, full-duplex streaming, the protocol's).
    request_mode: BodySendMode,
    response_mode: BodySendMode,
    endpoint: Endpoint,
    head: Option<Head>,
    /// The endpoints the data plane allows (the subset hint), if it said.
    subset: Option<Vec<String>>,
    body: BytesMut,
    guard: Option<Box<RequestGuard>>,
    /// The pick, then its fallbacks, each with its `ip:port`.
    picks: Vec<(String, Arc<Replica>)>,
    /// The decision and routing's inputs, for an attempt moved to the
    /// fallback that served.
    route: Option<(RouteInput, Decision)>,
    client_wants_usage: bool,
    /// A streamed response's reader; `None` for a whole one.
    relay: Option<Relay>,
    /// A whole response, kept (bounded) to read its usage at its end.
    whole: Option<BytesMut>,
    /// A remote prefill named to the decode replica's sidecar: its prompt
    /// counted in the prefill replica's backlog until the decode replica
    /// answers (its prefill is done by then), and the request as not yet
    /// at the decode replica's engine (the sidecar sends it on after the
    /// prefill), whose streams a local prefill there would stall.
    prefill: Option<(Placement, AwaitingPrefill)>,
}

impl Exchange {
    pub(crate) fn new(state: Arc<AppState>, tx: Answers) -> Self {
        Self {
            state,
            tx,
            request_mode: BodySendMode::FullDuplexStreamed,
            response_mode: BodySendMode::FullDuplexStreamed,
            endpoint: Endpoint::Passthrough,
            head: None,
            subset: None,
            body: BytesMut::new(),
            guard: None,
            picks: Vec::new(),
            route: None,
            client_wants_usage: false,
            relay: None,
            whole: None,
            prefill: None,
        }
    }

    async fn send(&self, r: ProcessingResponse) -> Result<(), Over> {
        self.tx.send(Ok(r)).await.map_err(|_| Over)
    }

    fn buffered(mode: BodySendMode) -> bool {
        matches!(mode, BodySendMode::Buffered | BodySendMode::BufferedPartial)
    }

    /// Handle one message of the data plane.
    pub(crate) async fn on(&mut self, msg: ProcessingRequest) -> Result<(), Over> {
        if let Some(p) = &msg.protocol_config {
            self.request_mode = p.request_body_mode();
            self.response_mode = p.response_body_mode();
        }
        let md = msg.metadata_context.as_ref();
        match msg.request {
            Some(Request::RequestHeaders(h)) => self.request_headers(h, md).await,
            Some(Request::RequestBody(b)) => self.request_body(b).await,
            Some(Request::RequestTrailers(_)) => {
                self.send(wire::proceed(Proceed::RequestTrailers)).await
            }
            Some(Request::ResponseHeaders(h)) => self.response_headers(h, md).await,
            Some(Request::ResponseBody(b)) => self.response_body(b).await,
            Some(Request::ResponseTrailers(_)) => {
                self.finish();
                self.send(wire::proceed(Proceed::ResponseTrailers)).await
            }
            None => Ok(()),
        }
    }

    async fn request_headers(&mut self, h: HttpHeaders, md: Option<&Metadata>) -> Result<(), Over> {
        let cfg = &self.state.config.epp;
        self.subset = wire::metadata_strings(md, &cfg.subset_hint_namespace, wire::SUBSET);
        let parsed = wire::headers(h.headers.as_ref());
        let path = parsed.path.as_deref().unwrap_or("/");
        self.endpoint = Endpoint::of_path(path.split('?').next().unwrap_or(path))
            .unwrap_or(Endpoint::Passthrough);
        let rid = crate::api::request_id::RequestId::of(&http::Extensions::new(), &parsed.map);
        self.guard = Some(Box::new(RequestGuard::new(
            self.state.telemetry.clone(),
            self.endpoint,
            turn::now(),
            rid.to_str().unwrap_or_default().to_string(),
            TraceCtx::from_headers(&parsed.map),
            self.state.config.telemetry.stall_threshold,
        )));
        self.head = Some(Head {
            method: parsed
                .method
                .as_deref()
                .and_then(|m| http::Method::from_bytes(m.as_bytes()).ok())
                .unwrap_or(http::Method::POST),
            uri: path.parse().unwrap_or_else(|_| http::Uri::from_static("/")),
            headers: crate::headers::Fields::from_map(&parsed.map),
        });
        if h.end_of_stream {
            // No body: nothing names a model (400).
            return self.decide().await;
        }
        if Self::buffered(self.request_mode) {
            // Envoy sends a buffered body only after this answer; the pick
            // goes on the body's.
            return self.send(wire::proceed(Proceed::RequestHeaders)).await;
        }
        Ok(())
    }

    async fn request_body(&mut self, b: HttpBody) -> Result<(), Over> {
        if self.head.is_none() || !self.picks.is_empty() {
            // Out of order (no headers, or after the pick): passed on.
            return self.pass_request_body(b).await;
        }
        self.body.extend_from_slice(&b.body);
        let limit = self.state.config.server.max_body_bytes.as_usize();
        if self.body.len() > limit {
            return self.reject(GatewayError::PayloadTooLarge { limit }).await;
        }
        if b.end_of_stream {
            return self.decide().await;
        }
        Ok(())
    }

    async fn pass_request_body(&mut self, b: HttpBody) -> Result<(), Over> {
        if Self::buffered(self.request_mode) {
            return self.send(wire::proceed(Proceed::RequestBody)).await;
        }
        for r in wire::streamed(&Bytes::from(b.body), b.end_of_stream, false) {
            self.send(r).await?;
        }
        Ok(())
    }

    /// The body is complete: decide as the proxy does, and answer.
    async fn decide(&mut self) -> Result<(), Over> {
        let started = std::time::Instant::now();
        let bytes = std::mem::take(&mut self.body).freeze();
        let decided = {
            let (Some(head), Some(guard)) = (self.head.as_ref(), self.guard.as_deref_mut()) else {
                return Err(Over);
            };
            let admitted = admit(
                &self.state,
                self.endpoint,
                head,
                bytes,
                self.subset.as_deref(),
                guard,
            );
            // Held by flow control while the pool is full: a data plane that
            // gives up ends the wait (and the seat's place in the queue).
            tokio::select! {
                r = admitted => r,
                () = self.tx.closed() => return Err(Over),
            }
        };
        let result = match decided {
            Ok((inbound, candidates)) => self.pick(inbound, candidates).await,
            Err(e) => Err(e),
        };
        let seconds = started.elapsed().as_secs_f64();
        self.state.metrics.epp_decision_seconds.observe(seconds);
        match result {
            Ok(()) => Ok(()),
            Err(e) => self.reject(e).await,
        }
    }

    /// Pick among the admitted candidates and answer with the pick, its
    /// fallbacks and the body.
    async fn pick(&mut self, inbound: Inbound, mut c: Candidates) -> Result<(), GatewayError> {
        let state = self.state.clone();
        let guard = self
            .guard
            .as_deref_mut()
            .ok_or(GatewayError::ShuttingDown)?;
        let model = guard.record.model.clone();
        let head = self.head.as_ref().ok_or(GatewayError::ShuttingDown)?;
        let mut input = RouteInput::of(&state, &head.headers, &inbound, &model);
        // A Responses follow-up goes where its previous response is kept.
        let pinned = match (self.endpoint, inbound.session.previous_response_id) {
            (Endpoint::Responses, Some(key)) => state.affinity.responses.get(key, turn::now_std()),
            _ => None,
        };
        if self.endpoint == Endpoint::Responses {
            guard.remember_response(state.affinity.clone());
        }
        let protocol = state.config.routing.disaggregation.protocol;
        let leg = disagg::leg_api(protocol, self.endpoint, true);
        let pd = !c.prefill.is_empty() && leg == Some(true);
        let session_before = match state.shared_table {
            Some(_) => Box::pin(input.recall_session(&state, &c.replicas)).await,
            None => None,
        };
        let pool = if pd { Leg::Decode } else { Leg::Serve };
        let pinned_here = pinned
            .as_ref()
            .is_some_and(|p| c.replicas.iter().any(|r| r.name == *p));
        if state.shared_table.as_ref().is_some_and(|t| t.homes) && !pinned_here {
            let ctx = RouteCtx {
                decode_leg: pd,
                ..input.ctx(&model)
            };
            let home = Box::pin(homes::table_home(
                &state,
                &ctx,
                &c.replicas,
                proxy::view,
                pool,
                // (The picker does not see the first token.)
                false,
            ))
            .await;
            input.shared_home = home;
        }
        let decision = proxy::pick(&state, &input, &model, &c.replicas, pinned, pd);
        if state.shared_table.is_some() {
            input.record_session(&state, session_before);
            if let Some(d) = &decision {
                let ctx = RouteCtx {
                    decode_leg: pd,
                    ..input.ctx(&model)
                };
                homes::record_home(&state, &ctx, &c.replicas, pool, d);
            }
        }
        let decision = decision.ok_or_else(|| GatewayError::NoHealthyBackend(model.to_string()))?;
        let reason = if c.fallback {
            RouteReason::Fallback
        } else {
            decision.reason
        };
        proxy::count_route(&state, guard, &decision, reason);
        let primary = c.replicas.swap_remove(decision.index);
        // A disaggregated model (vLLM's protocol): the prefill planned as
        // the proxy plans it, now that the decode replica is known; the
        // decode replica's sidecar runs it on the replica named.
        let mut prefiller = None;
        if !c.prefill.is_empty() && leg == Some(false) {
            // An API the sidecar runs no prefill leg for: the decode
            // replica prefills (and no client's header names a prefiller).
            prefiller = Some(None);
            guard.record.pd = Some(Box::new(PdRecord::local(PdReason::LocalApi)));
        } else if pd {
            let ctx = input.ctx(&model);
            let side = DecodeSide {
                state: &state,
                ctx: &ctx,
                decode: &primary,
                decode_cached: decision.cached_tokens,
                view: proxy::view,
            };
            let (record, named) = match Box::pin(disagg::choose(&side, &c.prefill)).await {
                Ok((replica, placement, why)) => {
                    self.prefill = Some((placement, AwaitingPrefill::new(primary.clone())));
                    let record = PdRecord {
                        prefill_backend: Some(replica.name.clone()),
                        prefill_route: Some(why),
                        ..PdRecord::local(PdReason::Remote)
                    };
                    (record, Some(replica))
                }
                Err(local) => (local, None),
            };
            prefiller = Some(named.as_ref().map(|r| endpoint_of(r).to_string()));
            guard.record.pd = Some(Box::new(record));
        }
        self.picks
            .push((endpoint_of(&primary).to_string(), primary.clone()));
        let fallbacks = state.config.epp.fallbacks as usize;
        if fallbacks > 0 && !c.replicas.is_empty() {
            let views: Vec<_> = c.replicas.iter().map(|r| proxy::view(r)).collect();
            let m = &state.config.routing.metrics;
            let stale_after = m.enabled.then_some(m.stale_after);
            let order = crate::routing::by_least_work(&input.ctx(&model), &views, stale_after);
            for i in order.into_iter().take(fallbacks) {
                let r = c.replicas[i].clone();
                self.picks.push((endpoint_of(&r).to_string(), r));
            }
        }
        let destination = self
            .picks
            .iter()
            .map(|(e, _)| e.as_str())
            .collect::<Vec<_>>()
            .join(",");
        proxy::start_attempt(
            &state,
            guard,
            &primary,
            &decision,
            reason,
            &input,
            turn::fresh(),
        );
        state
            .metrics
            .epp_decisions
            .get(&(model.clone(), "routed"))
            .inc();
        self.client_wants_usage = inbound.client_wants_usage;
        self.route = Some((input, decision));
        // The body as the proxy would send it (the alias resolved, a tier's
        // cap, usage asked of a stream); the relay takes the usage chunk the
        // client did not ask for out of the answer again.
        let body = inbound.body;
        let ns = &state.config.epp.destination_namespace;
        let buffered = Self::buffered(self.request_mode);
        let prefiller = match &prefiller {
            None => Prefiller::None,
            Some(None) => Prefiller::Local,
            Some(Some(at)) => Prefiller::Remote(at),
        };
        let mut answer = wire::picked(ns, &destination, Some(body.len()), prefiller, buffered);
        if buffered {
            wire::with_body(&mut answer, &body);
            return self
                .send(answer)
                .await
                .map_err(|_| GatewayError::ShuttingDown);
        }
        self.send(answer)
            .await
            .map_err(|_| GatewayError::ShuttingDown)?;
        for r in wire::streamed(&body, true, false) {
            self.send(r).await.map_err(|_| GatewayError::ShuttingDown)?;
        }
        Ok(())
    }

    /// The drain deadline passed with this stream open (the proxy's streams
    /// end with an error event then). A request not yet picked is answered
    /// here: 503 in its API's shape. One picked (its request forwarded, its
    /// response perhaps under way) is reported failed and its stream ended
    /// with gRPC's `UNAVAILABLE`, not reset: the data plane applies its
    /// failure mode (fail open: the response goes on without the picker).
    pub(crate) async fn cut(&mut self) {
        if self.picks.is_empty() && self.guard.is_some() {
            let _ = self.reject(GatewayError::ShuttingDown).await;
            return;
        }
        if let Some(mut g) = self.guard.take() {
            g.on_cut(turn::now());
            let e = GatewayError::ShuttingDown;
            // No response yet: the status the proxy would have answered.
            let status = match g.record.status {
                0 => e.status().as_u16(),
                s => s,
            };
            g.record.fail(status, e.kind());
            // Dropped: reported now, its replica and seat released.
        }
        let _ = self
            .tx
            .send(Err(Status::unavailable(
                "the endpoint picker is shutting down (its drain deadline passed)",
            )))
            .await;
    }

    /// Answer the request here with `e`'s status and OpenAI-shaped body
    /// (429 for a request flow control dropped, as the protocol asks).
    async fn reject(&mut self, e: GatewayError) -> Result<(), Over> {
        let status = match &e {
            GatewayError::Overloaded { .. } => 429,
            other => other.status().as_u16(),
        };
        let outcome = match status {
            429 => "dropped",
            503 => "unavailable",
            400..=499 => "bad_request",
            _ => "error",
        };
        let wire = self.endpoint.wire();
        let mut headers = e.clone().into_response_in(wire).headers().clone();
        headers.remove(http::header::CONTENT_TYPE);
        headers.remove(http::header::CONTENT_LENGTH);
        let model = match self.guard.as_deref_mut() {
            Some(g) => {
                g.record.fail(status, e.kind());
                g.record.model.clone()
            }
            None => self.state.metrics.no_tier.clone(),
        };
        self.state
            .metrics
            .epp_decisions
            .get(&(model, outcome))
            .inc();
        // The guard reports it now, failed.
        self.guard = None;
        let _ = self
            .send(wire::immediate(status, &e.body_in(wire), &headers))
            .await;
        Err(Over)
    }

    async fn response_headers(
        &mut self,
        h: HttpHeaders,
        md: Option<&Metadata>,
    ) -> Result<(), Over> {
        self.served(md);
        // The prefill is done: its prompt leaves the prefill replica's
        // backlog, and the request is at the decode replica's engine.
        // Dropped, not timed: the decode replica's answer also waited for
        // the transfer and the decode replica's own queue, which would
        // calibrate the prefill replica's rate wrong.
        drop(self.prefill.take());
        let parsed = wire::headers(h.headers.as_ref());
        let status = parsed.status.unwrap_or(200);
        let is_sse = parsed
            .map
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if let Some(g) = self.guard.as_deref_mut() {
            let now = turn::fresh();
            g.record.status = status;
            g.record.upstream_first_byte = Some(now);
            g.record.response_ready = Some(now);
            if !(200..300).contains(&status) {
                // Passed through as the replica answered; counted against it.
                // Refused outright (503, 429), as the proxy retries: its
                // engine ran no local prefill planned there.
                if matches!(status, 503 | 429)
                    && let Some((_, replica)) = self.picks.first()
                {
                    disagg::refund_unrun(&self.state, replica, g.record.pd.as_deref_mut());
                }
                g.attempt_failed("upstream_status", status >= 500);
                g.record.fail(status, "upstream_status");
            }
        }
        let mode = match self.endpoint.wire() {
            _ if !is_sse || self.endpoint == Endpoint::Passthrough => Mode::Raw,
            Wire::OpenAi => Mode::OpenAi {
                strip_usage: !self.client_wants_usage,
            },
            wire => Mode::Named(wire),
        };
        if mode == Mode::Raw {
            self.whole = Some(BytesMut::new());
        } else {
            let mut relay = Relay::new(mode);
            relay.listen(self.state.telemetry.refusal.clone());
            self.relay = Some(relay);
        }
        self.send(wire::proceed(Proceed::ResponseHeaders)).await?;
        if h.end_of_stream {
            self.finish();
        }
        Ok(())
    }

    /// The data plane's report of the endpoint that served: when its
    /// retries went to a fallback, the attempt moves there.
    fn served(&mut self, md: Option<&Metadata>) {
        let ns = &self.state.config.epp.destination_namespace;
        let Some(served) = wire::metadata_strings(md, ns, wire::SERVED) else {
            return;
        };
        let Some(served) = served.first() else {
            return;
        };
        let (Some((first, _)), Some(guard), Some((input, decision))) = (
            self.picks.first(),
            self.guard.as_deref_mut(),
            self.route.as_ref(),
        ) else {
            return;
        };
        if first == served {
            return;
        }
        let Some((_, replica)) = self.picks.iter().find(|(e, _)| e == served) else {
            tracing::debug!(%served, "the data plane reports an endpoint the picker did not name");
            return;
        };
        // The pick failed before any byte (the data plane retried). Why is
        // not said (a refused connection, or a reset or timeout after the
        // engine took it): a local prefill's charge there stays spent, and
        // is not checked against the fallback's answer.
        if let Some(pd) = guard.record.pd.as_deref_mut() {
            pd.stall_charge = None;
        }
        guard.attempt_failed("upstream_connect", true);
        guard.end_attempt();
        let replica = replica.clone();
        proxy::start_attempt(
            &self.state,
            guard,
            &replica,
            decision,
            RouteReason::Retry,
            input,
            turn::fresh(),
        );
        self.picks.retain(|(e, _)| e == served);
    }

    async fn response_body(&mut self, b: HttpBody) -> Result<(), Over> {
        let at = turn::fresh();
        let data = Bytes::from(b.body);
        let out = match (self.relay.as_mut(), self.guard.as_deref_mut()) {
            (Some(relay), Some(guard)) => match relay.ingest(data.clone(), at, guard) {
                Ok(()) if b.end_of_stream && relay.pending_len() > 0 => {
                    let mut all = BytesMut::from(&relay.take_out()[..]);
                    all.extend_from_slice(&relay.take_pending());
                    all.freeze()
                }
                Ok(()) if relay.has_output() => relay.take_out(),
                Ok(()) => Bytes::new(),
                Err(e) => {
                    // What the replica sent is not for the picker to judge:
                    // the client gets it as it came; the reading stops.
                    guard.attempt_error(&e);
                    self.relay = None;
                    data.clone()
                }
            },
            _ => {
                let limit = self.state.config.upstream.max_response_bytes.as_usize();
                if let Some(w) = self.whole.as_mut() {
                    if w.len() + data.len() <= limit {
                        w.extend_from_slice(&data);
                    } else {
                        self.whole = None;
                    }
                }
                data.clone()
            }
        };
        if Self::buffered(self.response_mode) {
            let r = if out == data {
                wire::proceed(Proceed::ResponseBody)
            } else {
                wire::replaced(&out, true)
            };
            self.send(r).await?;
        } else if !out.is_empty() || b.end_of_stream {
            for r in wire::streamed(&out, b.end_of_stream, true) {
                self.send(r).await?;
            }
        }
        if b.end_of_stream || Self::buffered(self.response_mode) {
            self.finish();
        }
        Ok(())
    }

    /// The response is over: a whole answer's usage read, the request
    /// reported and its replica and seat released.
    fn finish(&mut self) {
        let Some(mut guard) = self.guard.take() else {
            return;
        };
        let now = turn::fresh();
        if let Some(bytes) = self.whole.take()
            && guard.record.status != 0
        {
            let wire = self.endpoint.wire();
            match wire {
                Wire::OpenAi => {
                    if let Some(info) = chunk_info(&bytes) {
                        guard.record.usage = info.usage;
                        guard.record.finish_reason = info.finish_reason;
                    }
                }
                _ => {
                    if let Some(w) = protocols::whole(wire, &bytes) {
                        guard.record.usage = w.usage;
                        guard.record.finish_reason = w.finish_reason;
                        guard.record.response_id = w.response_id;
                    }
                }
            }
            if (200..300).contains(&guard.record.status) {
                guard.record.verdict =
                    quality::whole(wire, &bytes, self.state.telemetry.refusal.as_ref());
            }
        }
        guard.record.end.get_or_insert(now);
        self.relay = None;
        drop(guard);
    }
}

/// The proxy's admission, with the caller's identity when keys are
/// checked, restricted to the subset hint when the data plane gave one.
async fn admit(
    state: &AppState,
    endpoint: Endpoint,
    head: &Head,
    bytes: Bytes,
    subset: Option<&[String]>,
    guard: &mut RequestGuard,
) -> Result<(Inbound, Candidates), GatewayError> {
    let identity = proxy::identify(state, head, guard)?;
    let within = |r: &Replica| subset.is_some_and(|s| s.iter().any(|e| e == endpoint_of(r)));
    let eligible: Option<proxy::Eligible<'_>> = subset.map(|_| &within as proxy::Eligible<'_>);
    proxy::admit(
        state,
        endpoint,
        head,
        bytes,
        identity.as_ref(),
        eligible,
        guard,
    )
    .await
}
