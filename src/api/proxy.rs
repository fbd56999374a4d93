//! The request path: read, route, forward, stream back, record.
//!
//! One function serves chat, completions, embeddings and the pass-through
//! routes, so there is one hot path to keep fast. A [`RequestGuard`] is made
//! when the request arrives and owns its accounting to the end: every failure
//! marks it and returns, and its `Drop` reports the request once, whatever
//! step it failed at. Retries happen only here, before any byte reached the
//! client, and only on another replica.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderValue, Request, header};
use tokio::time::Instant;

use super::Head;
use super::homes::{record_home, table_home};
use super::inbound::{self, Inbound};
use super::request_id::RequestId;
use super::send;
use crate::config::{EnginePriority, HoldForPrefill};
use crate::error::{GatewayError, TimeoutPhase};
use crate::flow::Ask;
use crate::headers::Lookup;
use crate::limits::Identity;
use crate::request::RequestGuard;
use crate::routing::placement::Placement;
use crate::routing::shared_table::{ColdMark, Leg, TableHome, Turn};
use crate::routing::{Decision, LoadView, ReplicaView, RouteCtx, SessionKey};
use crate::routing::{cold_gate, prefilling};
use crate::state::AppState;
use crate::stream::body::{ReplicaConn, TimedBody};
use crate::stream::event::chunk_info;
use crate::stream::relay::Mode;
use crate::stream::{protocols, quality};
use crate::telemetry::record::FlowOutcome;
use crate::telemetry::tracecontext::{TRACEPARENT, TraceCtx};
use crate::turn;
use crate::upstream::client::proxied_request;
use crate::upstream::pool::{Candidates, Replica};
use crate::vocab::{Endpoint, RouteReason, Wire};

/// How long a replica's recent TPOT counts for routing: a replica that got no
/// traffic because it was slow is tried again once its old measurement fades.
const LATENCY_MEMORY: std::time::Duration = std::time::Duration::from_secs(30);

// Header names parsed once: a lookup by `&str` parses the name on every
// request (~190 instructions each, callgrind).
static TTFT_OBJECTIVE: http::HeaderName = http::HeaderName::from_static("x-sluice-ttft-objective");
static PRIORITY: http::HeaderName = http::HeaderName::from_static("x-sluice-priority");

pub(crate) async fn handle(
    state: Arc<AppState>,
    endpoint: Endpoint,
    req: Request<Body>,
) -> Response {
    let (parts, body) = req.into_parts();
    let rid = RequestId::of(&parts.extensions, &parts.headers);
    handle_as(state, endpoint, &Head::of(&parts), body, rid).await
}

/// [`handle`] with the request id already assigned (the direct dispatch of
/// the generation routes: no trip through the request's extensions).
pub(crate) async fn handle_as(
    state: Arc<AppState>,
    endpoint: Endpoint,
    parts: &Head,
    body: Body,
    rid: HeaderValue,
) -> Response {
    let arrival = turn::now();
    // Boxed, as a stream's body is in `respond`: that keeps this request's
    // future under 4 KiB, which jemalloc allocates and frees on its fast
    // path (5,696 bytes before; ~430 instructions a request), and a stream's
    // body takes the guard over as it is, without a copy.
    let mut guard = Box::new(RequestGuard::new(
        state.telemetry.clone(),
        endpoint,
        arrival,
        rid.to_str().unwrap_or_default().to_string(),
        TraceCtx::from_fields(&parts.headers),
        state.config.telemetry.stall_threshold,
    ));
    let reply = proxy(&state, endpoint, parts, body, &rid, &mut guard).await;
    let mut resp = match reply {
        Ok(Reply::Full(resp)) => resp,
        Ok(Reply::Stream(mut resp)) => {
            if let Some(h) = guard.rate_headers() {
                h.apply_in(endpoint.wire(), resp.headers_mut());
            }
            // The body owns the request from here to its end.
            let (head, mut timed) = resp.into_parts();
            timed.attach(guard);
            return Response::from_parts(head, Body::new(timed));
        }
        Err(error) => {
            guard.fail(&error);
            error.into_response_in(endpoint.wire())
        }
    };
    if let Some(h) = guard.rate_headers() {
        h.apply_in(endpoint.wire(), resp.headers_mut());
    }
    resp
}

/// A successful answer: whole, or a stream whose body is still to get the
/// request's guard.
enum Reply {
    Full(Response),
    /// The body boxed from the start: `respond` awaits its first chunk
    /// through the box, so that the request's future does not hold it.
    Stream(http::Response<Box<TimedBody>>),
}

async fn proxy(
    state: &AppState,
    endpoint: Endpoint,
    parts: &Head,
    body: Body,
    rid: &HeaderValue,
    guard: &mut RequestGuard,
) -> Result<Reply, GatewayError> {
    // Who is calling, before the body is read: an unknown caller costs nothing.
    let identity = identify(state, parts, guard)?;
    let limit = state.config.server.max_body_bytes.as_usize();
    let body_timeout = state.config.server.body_timeout;
    let bytes = tokio::time::timeout_at(
        guard.record.arrival + body_timeout,
        inbound::read_body(&parts.headers, body, limit),
    )
    .await
    .map_err(|_| GatewayError::BodyTimeout(body_timeout))??;
    let (inbound, mut candidates) = admit(
        state,
        endpoint,
        parts,
        bytes,
        identity.as_ref(),
        None,
        guard,
    )
    .await?;
    forward(
        state,
        endpoint,
        parts,
        &inbound,
        &mut candidates,
        rid,
        guard,
    )
    .await
}

/// The caller, when keys are checked (`None`: an open gateway), noted on
/// the guard; an unknown or missing key is the error.
pub(crate) fn identify(
    state: &AppState,
    parts: &Head,
    guard: &mut RequestGuard,
) -> Result<Option<Arc<Identity>>, GatewayError> {
    let Some(l) = &state.limiter else {
        return Ok(None);
    };
    let id = l.identify(&parts.headers)?;
    guard.identified(&id);
    Ok(Some(id))
}

/// Which replicas a request may go to beyond serving its model (the
/// endpoint picker's subset hint).
pub(crate) type Eligible<'a> = &'a (dyn Fn(&Replica) -> bool + Sync);

/// The steps the proxy and the endpoint picker (`epp`) share, from a
/// request's body to its admission: the body read for what the gateway
/// needs, the model resolved to its replicas (only the `eligible` ones when
/// given: none eligible is 503), the tier's limits, and flow control's seat
/// (waiting here while every replica is full). On return the guard holds the
/// model, the admission and the seat.
pub(crate) async fn admit(
    state: &AppState,
    endpoint: Endpoint,
    parts: &Head,
    bytes: Bytes,
    identity: Option<&Arc<Identity>>,
    eligible: Option<Eligible<'_>>,
    guard: &mut RequestGuard,
) -> Result<(Inbound, Candidates), GatewayError> {
    // Policies that route by prefix get every block; the others still get
    // the first `home_blocks` (the doctor's evidence of prompts scattered
    // across replicas).
    let wants_prefix = state.policy.wants_prefix();
    let prefix = Some({
        let p = &state.config.routing.prefix_kv;
        inbound::PrefixParams {
            block_chars: p.block_chars,
            max_blocks: if wants_prefix {
                p.max_blocks
            } else {
                p.home_blocks.max(1)
            },
        }
    });
    let needs = inbound::Needs {
        prefix,
        estimate: identity.is_some(),
        text: state
            .telemetry
            .access_log
            .as_ref()
            .is_some_and(|l| l.include_prompts),
    };
    let mut inbound = match inbound::inspect_with(endpoint, bytes, needs) {
        // Other `/v1/*` routes are forwarded only when they name a model;
        // without one there is nothing to route by: an unknown URL.
        Err(GatewayError::MissingModel) if endpoint == Endpoint::Passthrough => {
            return Err(GatewayError::UnknownRoute {
                method: parts.method.to_string(),
                path: parts.uri.path().to_string(),
            });
        }
        r => r?,
    };
    guard.record.stream = inbound.stream;
    guard.record.max_tokens = inbound.max_tokens;
    guard.record.prompt_estimate = inbound.prompt_estimate;
    guard.set_prompt_text(inbound.prompt_text.take());
    let mut candidates = match state.pool.resolve(&inbound.model) {
        Ok(ok) => ok,
        Err(e @ GatewayError::NoHealthyBackend(_)) => {
            // A known model: labelled with its served name.
            guard.set_model(served_name(state, &inbound));
            return Err(e);
        }
        Err(e) => return Err(e),
    };
    let model = candidates.model.clone();
    guard.set_model(model.clone());
    if let Some(ok) = eligible {
        candidates.replicas.retain(|r| ok(r));
        if candidates.replicas.is_empty() {
            return Err(GatewayError::NoHealthyBackend(model.to_string()));
        }
    }
    if *model != *inbound.model {
        guard.record.requested_model = Some(Arc::from(inbound.model.as_str()));
        inbound.body = inbound::with_model(&inbound.body, &model)?;
    }
    crate::routing::prefix::bind_model(&mut inbound.prefix, &model);

    if let (Some(limiter), Some(id)) = (&state.limiter, &identity) {
        let generates = endpoint.generates();
        let mut max_tokens = inbound.max_tokens;
        if let Some(cap) = limiter.max_tokens_cap(id, &model) {
            match inbound.max_tokens {
                Some(asked) if asked > cap => {
                    return Err(GatewayError::MaxTokensOverCap { asked, cap });
                }
                None if generates => {
                    // The tier bounds every generation, also one that set no limit.
                    let field = match endpoint {
                        Endpoint::Responses => "max_output_tokens",
                        _ => "max_tokens",
                    };
                    inbound.body = inbound::with_max_tokens(&inbound.body, field, cap)?;
                    max_tokens = Some(cap);
                }
                _ => {}
            }
        }
        if matches!(endpoint, Endpoint::Embeddings | Endpoint::CountTokens) {
            max_tokens = Some(0);
        }
        match limiter
            .admit(id, &model, inbound.prompt_estimate, max_tokens)
            .await
        {
            Ok(admission) => guard.admitted(admission),
            Err(e) => {
                guard.record.ratelimit = Some(match e {
                    GatewayError::RateLimitUnavailable => "rejected_store_down",
                    _ => "rejected",
                });
                return Err(e);
            }
        }
    }
    // Flow control (generation only): wait here while every replica is
    // full.
    if !matches!(endpoint, Endpoint::CountTokens | Endpoint::Passthrough) {
        let ask = Ask {
            model: model.clone(),
            tier: identity.as_ref().map(|i| i.tier.clone()),
            tenant: identity.as_ref().map_or_else(
                || state.telemetry.metrics.no_tier.clone(),
                |i| i.name.clone(),
            ),
            asked_priority: asked_priority(&parts.headers)?,
            ttft_objective: ttft_objective(&parts.headers)?,
            prompt_tokens: inbound.prompt_estimate,
            max_tokens: guard.record.max_tokens,
        };
        match state
            .flow
            .admit(&state.pool, &candidates.replicas, ask)
            .await
        {
            Ok(None) => {}
            Ok(Some(passed)) => {
                guard.record.flow = Some(FlowOutcome {
                    band: passed.band,
                    outcome: passed.outcome,
                    waited: passed.waited,
                });
                guard.seated(passed.seat, state.config.flow_control.output_weight);
            }
            Err(e) => {
                let band = state.flow.band(
                    identity.as_ref().map(|i| &*i.tier),
                    asked_priority(&parts.headers).ok().flatten(),
                );
                if let GatewayError::Overloaded { waited, .. } = &e {
                    guard.record.flow = Some(FlowOutcome {
                        band,
                        outcome: e.kind(),
                        waited: *waited,
                    });
                }
                return Err(e);
            }
        }
    }
    Ok((inbound, candidates))
}

/// `x-sluice-ttft-objective`: how soon the request wants its first token
/// (`500ms`, `2s`); among its tenant's waiting requests, the earliest
/// deadline goes first.
fn ttft_objective(headers: &impl Lookup) -> Result<Option<Duration>, GatewayError> {
    let Some(v) = headers.first(&TTFT_OBJECTIVE) else {
        return Ok(None);
    };
    crate::headers::text(v)
        .and_then(|s| humantime::parse_duration(s.trim()).ok())
        .map(Some)
        .ok_or_else(|| {
            GatewayError::InvalidRequest(
                "x-sluice-ttft-objective must be a duration such as 500ms or 2s".into(),
            )
        })
}

/// `x-sluice-priority`: an integer band the request asks for (it may only
/// lower its tier's).
fn asked_priority(headers: &impl Lookup) -> Result<Option<i32>, GatewayError> {
    let Some(v) = headers.first(&PRIORITY) else {
        return Ok(None);
    };
    crate::headers::text(v)
        .and_then(|s| s.trim().parse::<i32>().ok())
        .map(Some)
        .ok_or_else(|| {
            GatewayError::InvalidRequest(
                "x-sluice-priority must be an integer (a priority band; it can only lower your tier's)"
                    .into(),
            )
        })
}

/// The served name of a known model (for labels), never the client's string.
fn served_name(state: &AppState, inbound: &Inbound) -> Arc<str> {
    state
        .pool
        .aliases
        .get(&inbound.model)
        .cloned()
        .unwrap_or_else(|| Arc::from(inbound.model.as_str()))
}

/// What routing sees of a replica now.
pub fn view(r: &Replica) -> ReplicaView {
    let full = r
        .seats()
        .is_some_and(|seats| r.busy() >= seats + r.leaving());
    ReplicaView {
        name: r.name.clone(),
        in_flight: r.in_flight(),
        load: r.load().map(|s| LoadView {
            kv_usage: s.kv_usage,
            waiting: s.waiting,
            queue: s.queue(),
            running: s.running,
            queued: s.queued,
            preempting: s.preempting,
            at: s.at,
        }),
        tpot: r.tpot_recent.fresh(LATENCY_MEMORY),
        full,
    }
}

/// What routing reads of a request, the same for each of its attempts
/// (the proxy's and the endpoint picker's).
pub(crate) struct RouteInput {
    session: Option<SessionKey>,
    prompt_tokens: u32,
    tail_tokens: u32,
    /// The prompt's home prefix (its first `home_blocks` blocks, or all of
    /// a shorter prompt: what `prefix_kv` homes it by), for the doctor's
    /// evidence of scattered prompts. A prompt that shares only an opening
    /// line with others is a prefix of its own.
    home_prefix: Option<u64>,
    /// The prompt's blocks, shared by the attempts' placements (the closed
    /// loop corrects the index with them).
    hashes: Arc<[u64]>,
    tokens_per_block: u32,
    /// The shared table's home of a prompt whose prefix this gateway holds
    /// nowhere ([`table_home`]).
    pub(crate) shared_home: Option<TableHome>,
    /// No other sender shows at the replicas' engines (`RouteCtx::alone`).
    alone: bool,
}

impl RouteInput {
    pub(crate) fn of(
        state: &AppState,
        headers: &impl Lookup,
        inbound: &Inbound,
        model: &str,
    ) -> Self {
        let session = super::session::key(
            &state.config.routing.sessions,
            headers,
            &inbound.session,
            model,
        );
        let chars = |c: u32| {
            u32::try_from((c as usize).div_ceil(crate::tokens::CHARS_PER_TOKEN)).unwrap_or(u32::MAX)
        };
        let home_prefix = {
            let blocks = &inbound.prefix;
            let n = state.config.routing.prefix_kv.home_blocks.min(blocks.len());
            n.checked_sub(1).and_then(|i| blocks.get(i)).copied()
        };
        Self {
            session,
            prompt_tokens: chars(inbound.session.prompt_chars).max(inbound.prompt_estimate),
            tail_tokens: chars(inbound.session.tail_chars),
            home_prefix,
            hashes: if state.policy.wants_prefix() {
                Arc::from(inbound.prefix.as_slice())
            } else {
                Arc::from([])
            },
            tokens_per_block: u32::try_from(
                state.config.routing.prefix_kv.block_chars / crate::tokens::CHARS_PER_TOKEN,
            )
            .unwrap_or(16)
            .max(1),
            shared_home: None,
            alone: state.pool.alone(),
        }
    }

    /// With a shared session table: a session this gateway does not know
    /// (or knows on a replica no longer among `candidates`: another gateway
    /// may have moved it already), that names itself (an id) or carries
    /// earlier turns, is looked up there before routing. Returns the
    /// session's replica as this gateway knows it then, for
    /// [`RouteInput::record_session`].
    pub(crate) async fn recall_session(
        &self,
        state: &AppState,
        candidates: &[Arc<Replica>],
    ) -> Option<Arc<str>> {
        let s = self.session?;
        let store = state.shared_table.as_ref()?;
        let known = state.affinity.sessions.get(s.key, turn::now_std());
        let there = |name: &Arc<str>| candidates.iter().any(|c| c.name == *name);
        if known.as_ref().is_some_and(there) || !(s.explicit || s.continuing) {
            return known;
        }
        store.recall(&state.affinity, s.key).await;
        state.affinity.sessions.get(s.key, turn::now_std())
    }

    /// With a shared session table: where routing left the session
    /// (`before`: what [`RouteInput::recall_session`] returned) is written
    /// there, in the background. Returns where it is now (the `before` of
    /// a retry's decision).
    pub(crate) fn record_session(
        &self,
        state: &AppState,
        before: Option<Arc<str>>,
    ) -> Option<Arc<str>> {
        let (s, store) = (self.session?, state.shared_table.as_ref()?);
        let after = state.affinity.sessions.get(s.key, turn::now_std());
        store.record(&state.affinity, s.key, before, after.clone());
        after
    }

    /// The policy's context, now.
    pub(crate) fn ctx<'a>(&'a self, model: &'a str) -> RouteCtx<'a> {
        RouteCtx {
            model,
            hashes: &self.hashes,
            session: self.session,
            prompt_tokens: self.prompt_tokens,
            tail_tokens: self.tail_tokens,
            decode_leg: false,
            session_placement: None,
            alone: self.alone,
            shared_home: self.shared_home.as_ref().map(TableHome::shared),
            now: turn::now_std(),
        }
    }
}

/// The policy's decision among `candidates` (`pinned`: the replica that
/// keeps a Responses follow-up's previous response, if it is one of them;
/// `decode_leg`: the request's prefill goes to the prefill pool, see
/// [`RouteCtx::decode_leg`]). `None` only when there is no candidate.
pub(crate) fn pick(
    state: &AppState,
    input: &RouteInput,
    model: &str,
    candidates: &[Arc<Replica>],
    pinned: Option<Arc<str>>,
    decode_leg: bool,
) -> Option<Decision> {
    let views: Vec<ReplicaView> = candidates.iter().map(|r| view(r)).collect();
    let home = pinned.and_then(|name| views.iter().position(|v| v.name == name));
    match home {
        Some(index) => Some(Decision::plain(index, RouteReason::ResponseHome)),
        None => {
            let ctx = RouteCtx {
                decode_leg,
                ..input.ctx(model)
            };
            state.policy.pick(&ctx, &views)
        }
    }
}

/// Count a decision (`reason`: its final reason) in the routing metrics.
pub(crate) fn count_route(
    state: &AppState,
    guard: &RequestGuard,
    decision: &Decision,
    reason: RouteReason,
) {
    let model = &guard.record.model;
    let count = || state.metrics.routing.get(&(model.clone(), reason.as_str()));
    // Kept in the model's series after the first lookup (see `ModelSeries`).
    match guard.series().and_then(|s| s.routes.get(reason as usize)) {
        Some(cell) => cell.get_or_init(count).inc(),
        None => count().inc(),
    }
    if decision.moved {
        state
            .metrics
            .session_moves
            .get(&(model.clone(), reason.as_str()))
            .inc();
    }
}

/// The request goes to `replica` at `sent`: its in-flight count rises (in
/// the guard, until the attempt or the request ends), and routing remembers
/// where the prompt went.
pub(crate) fn start_attempt(
    state: &AppState,
    guard: &mut RequestGuard,
    replica: &Arc<Replica>,
    decision: &Decision,
    reason: RouteReason,
    input: &RouteInput,
    sent: Instant,
) {
    // Where the prompt went is remembered for every attempt; a retry goes
    // to another replica by design, so it is not counted as scattering.
    if let Some(home) = input.home_prefix
        && state
            .affinity
            .home_prefixes
            .place(home, &replica.name, sent.into_std())
        && reason != RouteReason::Retry
    {
        replica.series.prefix_elsewhere.inc();
    }
    guard.start_attempt(replica.clone(), reason, sent);
    guard.placed(
        Placement::new(
            state.affinity.of(&replica.name, sent.into_std()),
            input.prompt_tokens.saturating_sub(decision.cached_tokens),
            decision.cached_tokens,
            input.hashes.clone(),
            decision.matched_blocks,
            input.tokens_per_block,
        )
        .counting_session(decision.counted_session)
        .continuing(decision.continuing)
        .cold(
            input
                .shared_home
                .as_ref()
                .and_then(|h| h.cold_on(&replica.name)),
        ),
    );
}

/// Whether requests to `replica` wait for a prefill of their prompt under
/// way there (`routing.prefix_kv.hold_for_prefill`).
fn holds_for_prefill(state: &AppState, replica: &Replica) -> bool {
    match state.config.routing.prefix_kv.hold_for_prefill {
        HoldForPrefill::Off => false,
        HoldForPrefill::On => true,
        HoldForPrefill::Auto => replica
            .load()
            .is_some_and(|s| s.engine == crate::vocab::EngineKind::Sglang),
    }
}

/// What a request held for a prefill under way needs to mark that prefill
/// again should its attempt end without a first token.
struct Held<'a> {
    on: &'a Arc<prefilling::Prefilling>,
    hashes: &'a [u64],
    /// The blocks routing counted cached.
    cached: usize,
    /// Whether the request marks its own prefill (a stream).
    marks: bool,
}

/// Waits for `ahead`, a prefill of the request's prompt under way on its
/// replica that it would otherwise compute again, until its first token, at
/// most the request's first-token bound (then it has that bound again from
/// its sending). Where that prefill's attempt ends without a first token a
/// streamed request marks it again and goes (the mark returned for its
/// placement, with the block it starts at: what routing counted cached from
/// there is not), unless another waiter did first: then it waits for that
/// one where it covers its prompt. Counted in
/// `sluice_routing_prefill_holds_total{outcome}` by how its last wait ended
/// (`ended` for the request that marks it again or goes without it) and the
/// whole wait in `sluice_routing_prefill_hold_seconds`. A stream that goes
/// at the prefill's first token takes that prefill's place in the
/// replica's cold-prefill gate with it, until its own first token
/// (`routing::cold_gate`).
async fn hold_for_prefill(
    state: &AppState,
    guard: &RequestGuard,
    held: Held<'_>,
    mut ahead: prefilling::Ahead,
    deadline: Instant,
) -> HoldEnd {
    let now = turn::fresh();
    let by = (now + state.config.upstream.timeouts.first_token).min(deadline);
    let mut retaken = None;
    let mut gate = None;
    let outcome = loop {
        let outcome = ahead.wait(by).await;
        if outcome == prefilling::HoldOutcome::Prefilled && held.marks {
            gate = ahead.gate();
        }
        if outcome != prefilling::HoldOutcome::Ended {
            break outcome;
        }
        if held.marks
            && let Some(mark) = held.on.retake(held.hashes, &ahead)
        {
            retaken = Some((mark, ahead.at()));
            break outcome;
        }
        // (An ended prefill has left the map: this is another.)
        match held.on.ahead_of(held.hashes, held.cached) {
            Some(next) => ahead = next,
            None => break outcome,
        }
    };
    count_hold(state, guard, "own", outcome, now);
    HoldEnd { retaken, gate }
}

/// How a request's hold for a prefill under way ended ([`hold_for_prefill`]).
struct HoldEnd {
    /// The prefill it marks again, from the block it starts at.
    retaken: Option<(prefilling::PrefillMark, usize)>,
    /// The prefill's place in the cold-prefill gate, kept until this
    /// request's first token.
    gate: Option<cold_gate::ColdSlot>,
}

/// Waits for `under_way`, another gateway's cold prefill of the request's
/// prompt on its replica (the prompt's home in the shared table), as
/// [`hold_for_prefill`] waits for this gateway's own, and counts it
/// (`sluice_routing_prefill_holds_total{prefill="shared"}`). `true`: the
/// prefill came (the prompt is cached there); otherwise the request goes
/// and computes it.
async fn hold_for_shared_prefill(
    state: &AppState,
    guard: &RequestGuard,
    under_way: &crate::routing::shared_table::UnderWay,
    deadline: Instant,
) -> bool {
    let now = turn::fresh();
    let by = (now + state.config.upstream.timeouts.first_token).min(deadline);
    let outcome = under_way.wait(by).await;
    count_hold(state, guard, "shared", outcome, now);
    outcome == prefilling::HoldOutcome::Prefilled
}

/// A cold prefill's wait for its place in its replica's gate.
struct Pace<'a> {
    /// Its uncached tokens, and the gate's budget.
    uncached: u32,
    budget: u32,
    /// When it was to be sent, and how long it may wait.
    sent: Instant,
    by: Instant,
    /// Its count in the shared table, where it is a new home's cold prefill
    /// there: its turn among every gateway's.
    mark: Option<&'a Arc<ColdMark>>,
}

/// Waits, at most until `by`, for a cold prefill's place in its replica's
/// gate (`routing::cold_gate`): its uncached tokens beside those of the
/// cold prefills under way there, within the budget. A new home's cold
/// prefill counted in the shared table first waits for its turn among every
/// gateway's cold prefills placed there before it (as many may run beside it
/// as fit in the budget at its own size); then every one waits for this
/// gateway's own. Where the replica's engine says it is full
/// (`cold_gate::pressed`) nothing waits, and a request waiting goes when
/// that is seen. The place is held by the attempt's placement until its
/// first token; a request that waited is counted
/// (`sluice_routing_cold_gate_waits_total`), and its upstream timings start
/// when it goes (returned; `sent` when it did not wait).
async fn pace_cold_prefill(
    state: &AppState,
    guard: &mut RequestGuard,
    replica: &Replica,
    pace: Pace<'_>,
) -> Instant {
    let Pace {
        uncached,
        budget,
        sent,
        by,
        mark,
    } = pace;
    // An engine that says it is full sets the first token's wait itself:
    // the gate stands aside (`cold_gate::pressed`).
    if cold_gate::pressed(replica) {
        guard.gated(None, Duration::ZERO, sent);
        return sent;
    }
    let went = |guard: &mut RequestGuard, outcome: &'static str| {
        let now = turn::fresh();
        let took = now.saturating_duration_since(sent);
        count_cold_wait(state, guard, outcome, took);
        guard.gated(None, took, now);
        now
    };
    let mut waited = false;
    if let Some(mark) = mark {
        let beside = u64::from(budget / uncached.max(1)).saturating_sub(1);
        let came = tokio::select! {
            t = mark.turn(beside, by) => Some(t),
            () = cold_gate::until_pressed(replica) => None,
        };
        match came {
            Some(Turn::Now) => {}
            Some(Turn::Came) => waited = true,
            Some(Turn::GaveUp) => return went(guard, "deadline"),
            None => return went(guard, "pressed"),
        }
    }
    let memory = state.affinity.of(&replica.name, turn::now_std());
    let gate = &memory.cold_gate;
    let slot = if gate.would_wait(uncached, budget) {
        waited = true;
        // (The same `enter` throughout: it keeps its place in line.)
        tokio::select! {
            slot = tokio::time::timeout_at(by, gate.enter(uncached, budget)) => slot.ok().flatten(),
            () = cold_gate::until_pressed(replica) => return went(guard, "pressed"),
        }
    } else {
        gate.enter(uncached, budget).await
    };
    if !waited {
        guard.gated(slot, Duration::ZERO, sent);
        return sent;
    }
    let now = turn::fresh();
    let took = now.saturating_duration_since(sent);
    let outcome = if slot.is_some() { "sent" } else { "deadline" };
    count_cold_wait(state, guard, outcome, took);
    guard.gated(slot, took, now);
    now
}

/// Counts a cold prefill that waited `took` in its replica's gate.
fn count_cold_wait(state: &AppState, guard: &RequestGuard, outcome: &'static str, took: Duration) {
    let model = &guard.record.model;
    let m = &state.metrics;
    m.cold_gate_waits.get(&(model.clone(), outcome)).inc();
    m.cold_gate_wait
        .get(&(model.clone(),))
        .observe(took.as_secs_f64());
}

/// Counts a hold for a prefill under way (`of`: `own`, this gateway's;
/// `shared`, another gateway's) that began at `since`.
fn count_hold(
    state: &AppState,
    guard: &RequestGuard,
    of: &'static str,
    outcome: prefilling::HoldOutcome,
    since: Instant,
) {
    let model = &guard.record.model;
    let m = &state.metrics;
    m.prefill_holds
        .get(&(model.clone(), of, outcome.as_str()))
        .inc();
    m.prefill_hold
        .get(&(model.clone(),))
        .observe(turn::fresh().saturating_duration_since(since).as_secs_f64());
}

async fn forward(
    state: &AppState,
    endpoint: Endpoint,
    parts: &Head,
    inbound: &Inbound,
    // Borrowed: an argument moved into an async fn is kept twice in the
    // request's future (the caller's copy and the callee's).
    candidates: &mut Candidates,
    rid: &HeaderValue,
    guard: &mut RequestGuard,
) -> Result<Reply, GatewayError> {
    let fallback = candidates.fallback;
    // A disaggregated model's prefill replicas (`api/disagg.rs`), for the
    // APIs whose prefill leg the engines serve.
    let prefills = std::mem::take(&mut candidates.prefill);
    let protocol = state.config.routing.disaggregation.protocol;
    let prefills = match super::disagg::leg_api(protocol, endpoint, false) {
        Some(true) => prefills,
        Some(false) if !prefills.is_empty() => {
            guard.record.pd = Some(Box::new(crate::telemetry::record::PdRecord::local(
                crate::vocab::PdReason::LocalApi,
            )));
            Vec::new()
        }
        _ => Vec::new(),
    };
    let candidates = &mut candidates.replicas;
    let cfg = &state.config.upstream;
    let deadline = guard.record.arrival + cfg.timeouts.total;
    // The replica's spans hang under the gateway's upstream span.
    let traceparent = guard.record.trace.map(|t| t.upstream_value());
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let model = guard.record.model.clone();
    let max_attempts = 1 + cfg.max_retries;
    let mut input = RouteInput::of(state, &parts.headers, inbound, &model);
    // A Responses follow-up goes where its previous response is kept; when
    // that replica is gone, routing picks as usual and the engine answers
    // that it does not know the response.
    let mut pinned = match (endpoint, inbound.session.previous_response_id) {
        (Endpoint::Responses, Some(key)) => state.affinity.responses.get(key, turn::now_std()),
        _ => None,
    };
    if endpoint == Endpoint::Responses {
        guard.remember_response(state.affinity.clone());
        if pinned.is_none()
            && candidates.len() > 1
            && let Some(id) = &inbound.previous_response_id
        {
            // Made through another gateway, or before a restart: ask.
            pinned = super::responses::locate(state, candidates, id, rid).await;
        }
    }
    // (Boxed: only with a shared session table, kept out of every
    // request's future otherwise.)
    let mut session_before = match state.shared_table {
        Some(_) => Box::pin(input.recall_session(state, candidates)).await,
        None => None,
    };
    let decode_leg = !prefills.is_empty();
    let leg = if decode_leg { Leg::Decode } else { Leg::Serve };
    // (A Responses follow-up whose replica is among the candidates goes
    // there: nothing to look up.)
    let pinned_here = pinned
        .as_ref()
        .is_some_and(|p| candidates.iter().any(|c| c.name == *p));
    if state.shared_table.as_ref().is_some_and(|t| t.homes) && !pinned_here {
        let ctx = RouteCtx {
            decode_leg,
            ..input.ctx(&model)
        };
        let home = Box::pin(table_home(
            state,
            &ctx,
            candidates,
            view,
            leg,
            inbound.stream,
        ))
        .await;
        input.shared_home = home;
    }
    loop {
        // In a block: what only the decision needs is not kept in the
        // request's future across the send (it is the size of the future
        // that each request allocates and writes).
        let decision = pick(state, &input, &model, candidates, pinned.take(), decode_leg);
        if state.shared_table.is_some() {
            session_before = input.record_session(state, session_before.take());
            if let Some(d) = decision.as_ref().filter(|_| guard.record.attempts == 0) {
                let ctx = RouteCtx {
                    decode_leg,
                    ..input.ctx(&model)
                };
                record_home(state, &ctx, candidates, leg, d);
            }
        }
        let Some(mut decision) = decision else {
            // Only reachable after retries exhausted the candidates.
            return Err(GatewayError::NoHealthyBackend(model.to_string()));
        };
        let replica = candidates.swap_remove(decision.index);
        let reason = if guard.record.attempts > 0 {
            RouteReason::Retry
        } else if fallback {
            RouteReason::Fallback
        } else {
            decision.reason
        };
        count_route(state, guard, &decision, reason);
        // Where the engine shares a prompt only once its prefill has run, a
        // request for a prompt this gateway sent there moments ago waits
        // for that prefill's first token (boxed: rare).
        let holds = !decode_leg
            && input.hashes.len() >= prefilling::HOLD_MIN_BLOCKS
            && holds_for_prefill(state, &replica);
        let mut retaken = None;
        let mut gate_share = None;
        if holds && decision.matched_blocks >= prefilling::HOLD_MIN_BLOCKS {
            let memory = state.affinity.of(&replica.name, turn::now_std());
            if let Some(ahead) = memory
                .prefilling
                .ahead_of(&input.hashes, decision.matched_blocks)
            {
                let held = Held {
                    on: &memory.prefilling,
                    hashes: &input.hashes,
                    cached: decision.matched_blocks,
                    marks: inbound.stream,
                };
                let end = Box::pin(hold_for_prefill(state, guard, held, ahead, deadline)).await;
                gate_share = end.gate;
                retaken = end.retaken.map(|(mark, at)| {
                    // Cached only up to where the prefill it takes up
                    // starts: its placement predicts what it computes.
                    let at_tokens = u32::try_from(at)
                        .unwrap_or(u32::MAX)
                        .saturating_mul(input.tokens_per_block);
                    decision.matched_blocks = at;
                    decision.cached_tokens = decision.cached_tokens.min(at_tokens);
                    mark
                });
            }
        } else if holds
            && guard.record.attempts == 0
            && let Some(under_way) = input
                .shared_home
                .as_ref()
                .and_then(|h| h.prefill_on(&replica.name, &input.hashes))
        {
            // Another gateway's cold prefill of this prompt is under way
            // there (this gateway holds none of it): marked here first, so
            // that this gateway's next requests for it wait for this one.
            let memory = state.affinity.of(&replica.name, turn::now_std());
            retaken = inbound
                .stream
                .then(|| {
                    memory
                        .prefilling
                        .begin(&input.hashes, decision.matched_blocks)
                })
                .flatten();
            if Box::pin(hold_for_shared_prefill(state, guard, under_way, deadline)).await {
                // Cached there now: its placement predicts it.
                let shared = under_way.shared_blocks().max(decision.matched_blocks);
                let tokens = u32::try_from(shared)
                    .unwrap_or(u32::MAX)
                    .saturating_mul(input.tokens_per_block);
                decision.matched_blocks = shared;
                decision.cached_tokens = decision
                    .cached_tokens
                    .max(tokens.min(input.prompt_tokens.saturating_sub(1)));
            }
        }

        // The client's body as it came unless the replica takes a priority
        // field (borrowed: a clone is a reference count up and down).
        let with_priority;
        let body = match (replica.engine_priority, guard.record.flow.map(|f| f.band)) {
            (EnginePriority::Off, _) | (_, None) => &inbound.body,
            _ if !matches!(endpoint, Endpoint::Chat | Endpoint::Completions) => &inbound.body,
            (EnginePriority::Vllm, Some(band)) => {
                with_priority = inbound::with_priority(&inbound.body, -i64::from(band))?;
                &with_priority
            }
            (EnginePriority::Sglang, Some(band)) => {
                with_priority = inbound::with_priority(&inbound.body, i64::from(band))?;
                &with_priority
            }
        };
        // A disaggregated model: the prefill, remote or local, planned now
        // that the decode replica is known (boxed: a rare path's state stays
        // out of every request's future).
        let pd_body;
        let mut sglang = None;
        let local_body = body;
        let body = if prefills.is_empty() {
            body
        } else {
            let ctx = input.ctx(&model);
            let prefill_tp = guard.record.trace.map(|t| t.prefill_value());
            let attempt = super::disagg::Attempt {
                state,
                parts,
                path,
                wire: endpoint.wire(),
                rid,
                traceparent: prefill_tp.as_ref().map(|t| &t[..]),
                ctx: &ctx,
                decode: &replica,
                decode_cached: decision.cached_tokens,
                deadline,
                view,
            };
            let planned = Box::pin(super::disagg::prefill(attempt, body, &prefills)).await?;
            // (Counted when the request ends, with its final reason.)
            guard.record.pd = Some(Box::new(planned.record));
            sglang = planned.sglang;
            pd_body = planned.body;
            &pd_body
        };
        // A replica at the root takes the client's path as it came.
        let prefixed;
        let path = if replica.path_prefix.is_empty() {
            path
        } else {
            prefixed = format!("{}{}", replica.path_prefix, path);
            prefixed.as_str()
        };
        let build = |body: &Bytes| {
            let mut added: [(&http::HeaderName, &[u8]); 3] =
                [(&header::HOST, replica.conns.host.as_bytes()); 3];
            let mut n = 1;
            if let Some(t) = &traceparent {
                added[n] = (&TRACEPARENT, t);
                n += 1;
            }
            if let Some(key) = &replica.api_key {
                added[n] = (&header::AUTHORIZATION, key.as_bytes());
                n += 1;
            }
            proxied_request(&parts.method, path, &parts.headers, rid, &added[..n], body)
        };
        let req = build(body);

        // Read afresh: the gateway's overhead ends here.
        let sent = turn::fresh();
        start_attempt(state, guard, &replica, &decision, reason, &input, sent);
        if holds && inbound.stream {
            guard.prefilling(retaken);
        }
        if let Some(share) = gate_share {
            guard.sharing_gate(share);
        }
        // A cold prefill waits for its place in the replica's gate (boxed:
        // only cold streams).
        let budget = state.config.routing.prefix_kv.cold_prefill_tokens;
        let uncached = input.prompt_tokens.saturating_sub(decision.cached_tokens);
        // (A prompt another gateway homed there is cached there, or waited
        // for above, whatever this gateway's index counted.)
        let home = input.shared_home.as_ref();
        let sent = if inbound.stream
            && !decode_leg
            && budget > 0
            && uncached >= cold_gate::COLD_MIN_TOKENS
            && state.config.routing.policy == crate::config::PolicyKind::PrefixKv
            && !home.is_some_and(|h| h.found_on(&replica.name))
        {
            let pace = Pace {
                uncached,
                budget,
                sent,
                by: (sent + cfg.timeouts.first_token).min(deadline),
                mark: home.and_then(|h| h.cold_here(&replica.name)),
            };
            Box::pin(pace_cold_prefill(state, guard, &replica, pace)).await
        } else {
            sent
        };
        // Streams must show a first event within `first_token`; a non-streamed
        // answer only comes when generation is over, so only `total` bounds it.
        let headers_by = if inbound.stream {
            (sent + cfg.timeouts.first_token).min(deadline)
        } else {
            deadline
        };
        // The answer is taken out of the result before `respond` is awaited:
        // a result matched around that await would be kept in the request's
        // future beside what `respond` keeps.
        let mut sent = match sglang.as_mut() {
            None => send::send(&replica, req, headers_by, inbound.stream).await,
            // SGLang's decode leg, beside its prefill leg (boxed: rare).
            Some(leg) => {
                let local = build(local_body);
                match Box::pin(super::disagg::send_beside(
                    &replica,
                    req,
                    local,
                    headers_by,
                    inbound.stream,
                    leg,
                ))
                .await
                {
                    Ok((answer, fell_back)) => {
                        if fell_back && let Some(pd) = guard.record.pd.as_mut() {
                            pd.reason = crate::vocab::PdReason::LocalFallback;
                            pd.prefill_backend = None;
                        }
                        Ok(answer)
                    }
                    Err(e) => Err(e),
                }
            }
        };
        // The decode replica could not fetch the prefill's KV (it answered an
        // error before any byte reached the client): once more, prefilling
        // locally.
        if matches!(sent, Err(GatewayError::Upstream { .. }))
            && let Some(pd) = guard.record.pd.as_mut()
            && pd.reason == crate::vocab::PdReason::Remote
        {
            tracing::warn!(backend = %replica.name, "the decode replica could not use the remote prefill; prefilling there");
            pd.reason = crate::vocab::PdReason::LocalKvFetchFailed;
            pd.prefill_cached = None;
            sent = Box::pin(send::send(
                &replica,
                build(local_body),
                headers_by,
                inbound.stream,
            ))
            .await;
        }
        if let Some(leg) = sglang.take() {
            guard.hold(Box::new(leg));
        }
        let (resp, conn) = match sent {
            Ok(answer) => answer,
            Err(error) => {
                guard.attempt_error(&error);
                guard.end_attempt();
                if error.retryable() {
                    super::disagg::refund_unrun(state, &replica, guard.record.pd.as_deref_mut());
                }
                let can_retry = error.retryable()
                    && guard.record.attempts < max_attempts
                    && !candidates.is_empty();
                if !can_retry {
                    return Err(error);
                }
                tracing::debug!(backend = %replica.name, error = %error, "retrying on another replica");
                state
                    .metrics
                    .retries
                    .get(&(model.clone(), error.kind()))
                    .inc();
                continue;
            }
        };
        let up = ReplicaConn { conn, replica };
        return respond(state, endpoint, inbound, resp, up, headers_by, guard).await;
    }
}

async fn respond(
    state: &AppState,
    endpoint: Endpoint,
    inbound: &Inbound,
    resp: http::Response<()>,
    mut up: ReplicaConn,
    first_by: Instant,
    guard: &mut RequestGuard,
) -> Result<Reply, GatewayError> {
    guard.record.upstream_first_byte = Some(turn::now());
    let status = resp.status();
    // The replica's headers are already those that go on to the client
    // (taken in a block: the rest of the head is not kept across awaits).
    let headers = {
        let (parts, ()) = resp.into_parts();
        parts.headers
    };
    // (`x-request-id` is set on every response by `request_id::given`.)
    let is_sse = crate::headers::get(&headers, &header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    guard.record.status = status.as_u16();
    let deadline = guard.record.arrival + state.config.upstream.timeouts.total;

    if is_sse || endpoint == Endpoint::Passthrough {
        let mode = match endpoint.wire() {
            _ if !is_sse || endpoint == Endpoint::Passthrough => Mode::Raw,
            Wire::OpenAi => Mode::OpenAi {
                strip_usage: !inbound.client_wants_usage,
            },
            wire => Mode::Named(wire),
        };
        let idle = state.config.upstream.timeouts.idle;
        let mut timed = Box::new(
            TimedBody::new(up, mode, idle, deadline, &state.cut)
                .with_refusal(state.telemetry.refusal.clone()),
        );
        if is_sse {
            let first = match tokio::time::timeout_at(first_by, timed.first_chunk()).await {
                Ok(r) => r,
                Err(_) => Err(GatewayError::UpstreamTimeout {
                    phase: TimeoutPhase::FirstToken,
                }),
            };
            if let Err(e) = first {
                // Nothing reached the client: still a plain HTTP error.
                drop(timed);
                guard.attempt_error(&e);
                return Err(e);
            }
            guard.record.upstream_first_byte = Some(timed.frame_time());
        }
        guard.record.response_ready = Some(turn::fresh());
        let mut out = http::Response::new(timed);
        *out.status_mut() = status;
        *out.headers_mut() = headers;
        if is_sse {
            // Tell any buffering proxy in front of us (nginx) to pass events through.
            out.headers_mut()
                .insert("x-accel-buffering", HeaderValue::from_static("no"));
        }
        return Ok(Reply::Stream(out));
    }

    // Non-streamed JSON: read it whole (bounded), take usage and finish reason.
    let limit = state.config.upstream.max_response_bytes.as_usize();
    let bytes = match up.conn.collect(limit, deadline).await {
        Err(_) => Err(GatewayError::UpstreamTimeout {
            phase: TimeoutPhase::Total,
        }),
        Ok(Err(err)) => Err(GatewayError::UpstreamProtocol(
            err.during("reading the response"),
        )),
        Ok(Ok(b)) => Ok(b),
    };
    let bytes = match bytes {
        Ok(b) => b,
        Err(e) => {
            guard.attempt_error(&e);
            return Err(e);
        }
    };
    // Whether the answer may hold a tool call (unknown: yes).
    let mut calls = true;
    match endpoint.wire() {
        Wire::OpenAi => {
            if let Some(info) = chunk_info(&bytes) {
                guard.record.usage = info.usage;
                guard.record.finish_reason = info.finish_reason;
                calls = info.tool_call;
            }
        }
        wire => {
            if let Some(w) = protocols::whole(wire, &bytes) {
                guard.record.usage = w.usage;
                guard.record.finish_reason = w.finish_reason;
                guard.record.response_id = w.response_id;
            }
        }
    }
    // Without a tool call or a refusal detector there is nothing to judge:
    // the scan above read every message, so `whole`'s own search of the body
    // (~600 instructions a request) is skipped.
    if status.is_success() && (calls || state.telemetry.refusal.is_some()) {
        guard.record.verdict =
            quality::whole(endpoint.wire(), &bytes, state.telemetry.refusal.as_ref());
    }
    // The answer's end, read once (afresh: the usage scan above counts) for
    // the record and the pool.
    let now = turn::fresh();
    up.replica.conns.checkin_at(up.conn, now.into_std());
    guard.record.end = Some(now);
    guard.record.response_ready = Some(now);
    // Built in place: `into_response` would make a map with its own
    // `content-type`, only to be replaced.
    let mut out = Response::new(Body::from(bytes));
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    Ok(Reply::Full(out))
}

/// 404 for anything that is not an API route.
pub(crate) async fn not_found(req: Request<Body>) -> Response {
    GatewayError::UnknownRoute {
        method: req.method().to_string(),
        path: req.uri().path().to_string(),
    }
    .into_response()
}
