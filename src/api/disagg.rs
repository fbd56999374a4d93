//! Prefill/decode disaggregation: for a model with `prefill` replicas, each
//! request is planned once its decode replica is chosen (by the routing
//! policy, among the decode and mixed replicas, as any request):
//!
//! 1. **Local or remote.** The decode replica prefills the prompt itself when
//!    it already holds at least `routing.disaggregation.local_share` of it
//!    (its prefix or its session: `local_cached`), when no prefill replica
//!    can be used (`local_no_prefill_replica`), or when the prefill
//!    replicas' predicted wait (the prompt tokens queued ahead there, over
//!    their calibrated rate) is longer than the local prefill would take
//!    (`local_pool_busy`; a session's turn: at its prefill home), both
//!    within `local_max_tokens` uncached tokens;
//!    past it, on a decode replica that decodes nothing, when the pool is
//!    busy as above (`local_idle`: no stream pays for it); past it, on one
//!    that decodes streams, when the prefill replica the prompt would go
//!    to waits longer than that and at least the pool's mean, and the
//!    stalled gaps it causes them fit this gateway's allowance there
//!    (`local_stall_budget`: a share of the gaps relayed from it,
//!    [`crate::routing::stall_budget`]). The streams past the bound are
//!    counted by a look at the decode replica's engine when the last scrape
//!    allows the prefill (other gateways may have started streams since:
//!    [`scrape::glance`], `sluice_pd_decode_looks_total`).
//!    Otherwise the prefill is remote (`remote`).
//! 2. **Which prefill replica:** the routing policy's pick among the
//!    `prefill` and `mixed` replicas (not the decode replica): prefix
//!    affinity and predicted wait, as for any request; a session's turns
//!    keep one prefill replica (its history's KV is cached there), under a
//!    session key of their own, placed by load
//!    (`routing.disaggregation.session_placement`).
//! 3. **vLLM's protocol** (NIXL, Mooncake; vLLM's own disaggregation proxy
//!    and vllm-router do the same): the client's body with `stream: false`,
//!    `max_tokens` (and `max_completion_tokens`, where sent) 1, no
//!    `stream_options`, and `kv_transfer_params` asking for a remote decode
//!    goes to the prefill replica, within `prefill_timeout`; the
//!    `kv_transfer_params` of its answer go, as they came, into the client's
//!    own body for the decode replica, whose answer streams to the client as
//!    any answer does. Chat, completions and Messages (vLLM answers the
//!    parameters on all three); Responses is prefilled by the decode replica
//!    (`local_api`, [`leg_api`]).
//! 4. **Failures, nothing lost.** A prefill replica that refuses, fails or
//!    times out: one other prefill replica, then a local prefill
//!    (`local_fallback`; off, the request fails with 503). An answer
//!    without transfer parameters (its one token ended it) is prefilled
//!    locally (`local_no_kv`). A decode replica that cannot fetch the KV
//!    (a non-2xx answer before any byte reached the client) is asked once
//!    more with a local prefill (`local_kv_fetch_failed`, in the proxy). A
//!    client that leaves during the prefill drops it: the prefill
//!    replica's connection closes at once, which is how vLLM aborts.
//!
//! 5. **SGLang's protocol** (`protocol: sglang`): the client's body with
//!    `bootstrap_host`, `bootstrap_port` and a random `bootstrap_room` goes to
//!    the prefill replica (drained and checked in a task) and to the decode
//!    replica at once (chat and completions); the decode answer streams to
//!    the client. A prefill
//!    that fails before the decode replica answers drops the decode leg and
//!    prefills locally (`local_fallback`); one that fails later leaves the
//!    decode replica to its own timeout (its room never fills).
//!
//! 6. **Through the endpoint picker** (`epp`, vLLM's protocol), where the
//!    data plane sends one request: the same plan ([`choose`]), the leg run
//!    by the decode replica's sidecar on the prefill replica the pick names
//!    (llm-d's `x-prefiller-host-port`).

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Method, header};
use serde_json::{Map, Value, json};
use tokio::time::Instant;

use super::Head;
use super::homes;
use super::send;
use crate::config::PdProtocol;
use crate::error::GatewayError;
use crate::routing::placement::Placement;
use crate::routing::shared_table::Leg;
use crate::routing::shared_table::{ColdMark, TableHome};
use crate::routing::stall_budget::{StallCharge, StallLedger};
use crate::routing::{ReplicaView, RouteCtx, SessionKey};
use crate::state::AppState;
use crate::telemetry::record::PdRecord;
use crate::telemetry::tracecontext::TRACEPARENT;
use crate::upstream::client::proxied_request;
use crate::upstream::pool::{InFlight, Replica};
use crate::upstream::scrape;
use crate::vocab::{Endpoint, PdReason, RouteReason, Wire};

/// Prefill replicas tried for one request before it is prefilled locally.
const PREFILL_TRIES: usize = 2;

/// Largest prefill answer read (a one-token answer and its parameters).
const MAX_PREFILL_ANSWER: usize = 1 << 20;

/// What the proxy knows of the attempt a prefill is planned for.
pub(crate) struct Attempt<'a> {
    pub state: &'a AppState,
    pub parts: &'a Head,
    /// The request's path as the client sent it.
    pub path: &'a str,
    /// The API of the request (and of the prefill answer).
    pub wire: Wire,
    pub rid: &'a HeaderValue,
    /// `traceparent` for the prefill legs (the trace's prefill span).
    pub traceparent: Option<&'a [u8]>,
    /// The routing context of the decode decision (the prefill's is the
    /// same, its session keyed apart: see [`prefill`]).
    pub ctx: &'a RouteCtx<'a>,
    pub decode: &'a Replica,
    /// Prompt tokens routing expects cached on the decode replica.
    pub decode_cached: u32,
    pub deadline: Instant,
    /// What routing sees of a replica (the proxy's `view`).
    pub view: fn(&Replica) -> ReplicaView,
}

impl<'a> Attempt<'a> {
    fn side(&self) -> DecodeSide<'a> {
        DecodeSide {
            state: self.state,
            ctx: self.ctx,
            decode: self.decode,
            decode_cached: self.decode_cached,
            view: self.view,
        }
    }
}

/// What a plan knows of the decode replica chosen (the proxy's attempt, or
/// the endpoint picker's pick).
pub(crate) struct DecodeSide<'a> {
    pub state: &'a AppState,
    pub ctx: &'a RouteCtx<'a>,
    pub decode: &'a Replica,
    /// Prompt tokens routing expects cached on the decode replica.
    pub decode_cached: u32,
    /// What routing sees of a replica (the proxy's `view`).
    pub view: fn(&Replica) -> ReplicaView,
}

/// Where a prefill goes: the decode replica itself (and why), or the
/// prefill replicas to pick from, in the routing context of their pick.
enum Route<'a> {
    Local(PdRecord),
    Pool(Vec<Arc<Replica>>, RouteCtx<'a>),
}

/// Steps 1 and 2's inputs: local (and why) or the pool, with a session's
/// prefill key (see [`prefill`]).
async fn route<'a>(s: &DecodeSide<'a>, prefills: &[Arc<Replica>]) -> Route<'a> {
    let cfg = &s.state.config.routing.disaggregation;
    let prompt = s.ctx.prompt_tokens.max(1);
    // What a local prefill would add to the decode replica's steps.
    let light = cfg
        .local_max_tokens
        .is_none_or(|m| s.ctx.prompt_tokens.saturating_sub(s.decode_cached) <= m);
    if light && f64::from(s.decode_cached) >= cfg.local_share * f64::from(prompt) {
        return Route::Local(PdRecord::local(PdReason::LocalCached));
    }
    let pool: Vec<Arc<Replica>> = prefills
        .iter()
        .filter(|p| p.name != s.decode.name)
        .cloned()
        .collect();
    if pool.is_empty() {
        return Route::Local(PdRecord::local(PdReason::LocalNoPrefill));
    }
    let wait = pool_wait(s, &pool);
    if light && wait.busy() {
        return Route::Local(PdRecord::local(PdReason::LocalPoolBusy));
    }
    // Past the bound, a local prefill lengthens the steps of the streams the
    // decode replica decodes, counted by this gateway's requests in flight
    // there and the engine's own count. The last scrape's is up to an
    // interval old and, through several gateways, misses the streams the
    // others started since, so what it allows is confirmed by a look at the
    // engine now ([`scrape::glance`]). (Three gateways sharing the table,
    // agentic sessions: 22-42 streams a run stalled over 100 ms counted by
    // the scrape, most under another gateway's local prefill; 8-25 with
    // the look, none under `local_idle`; docs/benchmarks-log.md.)
    if !light && wait.busy() {
        let idle_wanted = cfg.local_when_idle;
        let stalls_wanted = cfg.local_stall_share > 0.0 && wait.long_queue();
        let scraped = decoding_scraped(s);
        // The allowance's charge for `d`'s streams, if wanted.
        let charge = |d: Decoding| stalls_wanted.then(|| stall_charge(s, d.streams)).flatten();
        let fits = charge(scraped).is_some_and(|c| {
            with_ledger(s, |l| l.fits(c.stalls(), cfg.local_stall_share, s.ctx.now))
        });
        if (idle_wanted && scraped.idle) || fits {
            let now = decoding_now(s).await;
            let local = now.and_then(|d| {
                // A decode replica that decodes nothing: a prefill there
                // lengthens no stream's step, whatever its length, so it
                // takes what the busy pool would queue. (Not also what it
                // holds by routing's index, as `local_cached` past the
                // bound: tried on retrieval, 8 documents of ~6,000 tokens
                // over decode caches of ~32,000, 54-69 prompts a run went
                // local so, and the slowest warm ones were prefilled whole
                // there (~630 ms, no token cached: most likely the index
                // still listed what the engine had evicted); warm TTFT p99
                // 533-690 ms against 64-431 ms before;
                // docs/benchmarks-log.md.)
                if idle_wanted && d.idle {
                    return Some(PdRecord::local(PdReason::LocalIdle));
                }
                // A decode replica that decodes streams: a prefill there
                // stalls each of them once a chunk, which leaves their
                // inter-token p99 alone while under 1% of their gaps
                // (`local_stall_share`, [`stall_charge`]). On agentic
                // sessions, 32 at once over 2 prefill + 2 decode replicas,
                // the prefill pool was every router's bottleneck (TTFT p50
                // ~2.7 s) while the decode replicas decoded 1.2-1.7 streams
                // on average and a local prefill's first token came in ~36
                // ms (docs/benchmarks-log.md). Being small (a few local
                // prefills a second), the allowance goes to the prompts
                // bound for the longer queues of the pool: the TTFT tail is
                // their queue (a session's turns keep their prefill
                // replica, one of which queued 6.2-6.6 s while the other
                // 1.1-4.2 s for 40 s). A session's turn lacks little on its
                // decode replica, which holds its history (~200 tokens: one
                // short step for the streams it stalls).
                let charge = charge(d).filter(|c| {
                    with_ledger(s, |l| l.spend(c.stalls(), cfg.local_stall_share, s.ctx.now))
                })?;
                Some(PdRecord {
                    stall_charge: Some(charge),
                    ..PdRecord::local(PdReason::LocalStallBudget)
                })
            });
            // (Without scrapes there was no look.)
            let outcome = match (now, &local) {
                _ if !s.state.config.routing.metrics.enabled => None,
                (None, _) => Some("failed"),
                (Some(_), Some(_)) => Some("confirmed"),
                (Some(_), None) => Some("refused"),
            };
            if let Some(outcome) = outcome {
                s.state
                    .metrics
                    .pd_decode_looks
                    .get(&(s.ctx.model.into(), outcome))
                    .inc();
            }
            if let Some(record) = local {
                return Route::Local(record);
            }
        }
    }
    // A session's prefills go to one prefill replica, where the KV of its
    // history stays cached from its last turn (only the new message and the
    // last answer are prefilled), as its turns go to one decode replica. It
    // has a key of its own in the session table (the session's key is its
    // decode home). A new one starts where the fewest sessions went
    // lately (`routing.disaggregation.session_placement: least_loaded`, the
    // default), not by its key's order: a prefill replica does nothing but
    // prefill, so its share of the sessions is its queue, and with a dozen
    // sessions at once hashing left one replica 9-11 of them for tens of
    // seconds (their histories evicted from its cache, re-prefilled whole
    // behind each other) while the other had 0-2: agentic sessions' TTFT p99
    // 0.55-0.90x vllm-router's by key, 0.68-1.49x by load (median 1.02x;
    // docs/BENCHMARKS.md).
    // The cost: each gateway places its own (without a shared table, a
    // session sent through several may prefill on one replica per gateway).
    let ctx = RouteCtx {
        session: s.ctx.session.map(|k| SessionKey {
            key: prefill_session(k.key),
            ..k
        }),
        decode_leg: false,
        session_placement: Some(cfg.prefill_session_placement(&s.state.config.routing)),
        // (The decode leg's shared home is not the prefill leg's.)
        shared_home: None,
        ..*s.ctx
    };
    Route::Pool(pool, ctx)
}

/// The endpoint picker's plan, where the data plane sends one request and
/// the decode replica's sidecar runs the prefill (llm-d's convention: the
/// prefill replica named in `x-prefiller-host-port`): the prefill replica,
/// with the accounting of the prompt there (kept until the decode replica
/// answers) and why routing chose it, or why the decode replica prefills
/// itself.
pub(crate) async fn choose(
    s: &DecodeSide<'_>,
    prefills: &[Arc<Replica>],
) -> Result<(Arc<Replica>, Placement, RouteReason), PdRecord> {
    let (mut pool, ctx) = match route(s, prefills).await {
        Route::Local(record) => return Err(record),
        Route::Pool(pool, ctx) => (pool, ctx),
    };
    // With shared prefix homes, as the proxy's prefill leg (`prefill`).
    let home = Box::pin(homes::table_home(
        s.state,
        &ctx,
        &pool,
        s.view,
        Leg::Prefill,
        false,
    ))
    .await;
    let ctx = RouteCtx {
        shared_home: home.as_ref().map(TableHome::shared),
        ..ctx
    };
    let views: Vec<ReplicaView> = pool.iter().map(|r| (s.view)(r)).collect();
    let pick = s
        .state
        .policy
        .pick(&ctx, &views)
        .ok_or_else(|| PdRecord::local(PdReason::LocalNoPrefill))?;
    homes::record_home(s.state, &ctx, &pool, Leg::Prefill, &pick);
    let replica = pool.swap_remove(pick.index);
    let placement = Placement::new(
        s.state.affinity.of(&replica.name, ctx.now),
        s.ctx
            .prompt_tokens
            .max(1)
            .saturating_sub(pick.cached_tokens),
        pick.cached_tokens,
        Arc::from(ctx.hashes),
        pick.matched_blocks,
        tokens_per_block(s.state),
    )
    .counting_session(pick.counted_session)
    .continuing(pick.continuing)
    .cold(home.as_ref().and_then(|h| h.cold_on(&replica.name)));
    Ok((replica, placement, pick.reason))
}

/// Plan the prefill of `body` (the body the decode replica would get) and
/// run it when remote: the body for the decode replica and what was done.
pub(crate) async fn prefill(
    a: Attempt<'_>,
    body: &Bytes,
    prefills: &[Arc<Replica>],
) -> Result<Planned, GatewayError> {
    let planned_local = |record| Planned {
        body: body.clone(),
        record,
        sglang: None,
    };
    let local = |reason| planned_local(PdRecord::local(reason));
    let cfg = &a.state.config.routing.disaggregation;
    let prompt = a.ctx.prompt_tokens.max(1);
    let (mut pool, ctx) = match route(&a.side(), prefills).await {
        Route::Local(record) => return Ok(planned_local(record)),
        Route::Pool(pool, ctx) => (pool, ctx),
    };
    // With shared prefix homes, a prefix new here is homed in the prefill
    // pool as every gateway homes it.
    let home = Box::pin(homes::table_home(
        a.state,
        &ctx,
        &pool,
        a.view,
        Leg::Prefill,
        false,
    ))
    .await;
    let ctx = RouteCtx {
        shared_home: home.as_ref().map(TableHome::shared),
        ..ctx
    };
    // (A retry's decision goes elsewhere by design: not written.)
    let pick_in = |pool: &[Arc<Replica>], first: bool| {
        let views: Vec<ReplicaView> = pool.iter().map(|r| (a.view)(r)).collect();
        let pick = a.state.policy.pick(&ctx, &views)?;
        if first {
            homes::record_home(a.state, &ctx, pool, Leg::Prefill, &pick);
        }
        Some(pick)
    };
    if cfg.protocol == PdProtocol::Sglang {
        let Some(pick) = pick_in(&pool, true) else {
            return Ok(local(PdReason::LocalNoPrefill));
        };
        let replica = pool.swap_remove(pick.index);
        let cold = home.as_ref().and_then(|h| h.cold_on(&replica.name));
        return sglang(&a, body, replica, pick.reason, cold);
    }
    for tried in 0..PREFILL_TRIES {
        let Some(pick) = pick_in(&pool, tried == 0) else {
            break;
        };
        let replica = pool.swap_remove(pick.index);
        let placement = Placement::new(
            a.state.affinity.of(&replica.name, ctx.now),
            prompt.saturating_sub(pick.cached_tokens),
            pick.cached_tokens,
            Arc::from(ctx.hashes),
            pick.matched_blocks,
            tokens_per_block(a.state),
        )
        .counting_session(pick.counted_session)
        .continuing(pick.continuing)
        .cold(home.as_ref().and_then(|h| h.cold_on(&replica.name)));
        match leg(&a, &replica, body, placement).await {
            Ok((params, cached, sent, took)) => {
                a.state
                    .metrics
                    .pd_prefill
                    .get(&(a.ctx.model.into(),))
                    .observe(took.as_secs_f64());
                let Some(params) = params else {
                    // Its one token ended the answer: nothing to transfer.
                    return Ok(local(PdReason::LocalNoKv));
                };
                return Ok(Planned {
                    body: with_member(body, "kv_transfer_params", params)?,
                    record: PdRecord {
                        reason: PdReason::Remote,
                        prefill_backend: Some(replica.name.clone()),
                        prefill_route: Some(pick.reason),
                        prefill_sent: Some(sent),
                        prefill: Some(took),
                        prefill_done: None,
                        prefill_cached: cached,
                        stall_charge: None,
                    },
                    sglang: None,
                });
            }
            Err(e) => {
                tracing::warn!(backend = %replica.name, error = %e, "prefill leg failed; trying another or prefilling locally");
                a.state
                    .metrics
                    .upstream_errors
                    .get(&(replica.name.clone(), e.kind()))
                    .inc();
                if pool.is_empty() {
                    break;
                }
            }
        }
    }
    if cfg.local_fallback {
        Ok(local(PdReason::LocalFallback))
    } else {
        Err(GatewayError::NoHealthyBackend(format!(
            "{} (no prefill replica answered; routing.disaggregation.local_fallback is off)",
            a.ctx.model
        )))
    }
}

/// Whether a generation of `endpoint` to a disaggregated model gets a
/// prefill leg (`Some(true)`), is prefilled by its decode replica because
/// the engines have no leg for its API (`Some(false)`: `local_api`), or is
/// not a generation (`None`: counted nowhere). vLLM takes
/// `kv_transfer_params` on chat, completions and Messages and answers them
/// there, but not on Responses (whose stored state also lives on the
/// replica that answered); SGLang's Messages takes no bootstrap fields; the
/// decode sidecar behind the endpoint picker (`picker`) runs the legs of
/// chat and completions only (llm-d's).
pub(crate) fn leg_api(protocol: PdProtocol, endpoint: Endpoint, picker: bool) -> Option<bool> {
    match endpoint {
        Endpoint::Chat | Endpoint::Completions => Some(true),
        Endpoint::Messages => Some(protocol == PdProtocol::Vllm && !picker),
        Endpoint::Responses => Some(false),
        Endpoint::Embeddings | Endpoint::CountTokens | Endpoint::Passthrough => None,
    }
}

/// The key of a session's prefill home, apart from its decode home's.
fn prefill_session(key: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(&key.to_le_bytes(), 0x5052_4546_494c_4c00)
}

/// A planned prefill: the body the decode replica gets, what was decided,
/// and for SGLang's protocol the prefill leg running beside the decode one.
pub(crate) struct Planned {
    pub body: Bytes,
    pub record: PdRecord,
    pub sglang: Option<SglangLeg>,
}

/// SGLang's prefill leg, sent at the same time as the decode leg: its
/// outcome, and the task, aborted when dropped (the request ended or its
/// client left).
pub(crate) struct SglangLeg {
    outcome: tokio::sync::oneshot::Receiver<Result<(), GatewayError>>,
    task: tokio::task::AbortHandle,
}

impl Drop for SglangLeg {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// SGLang's protocol: the same body, with `bootstrap_host`, `bootstrap_port`
/// (the prefill replica's, `null` for the engine's default) and a random
/// `bootstrap_room`, goes to the prefill replica now (drained and checked in
/// a task) and to the decode replica by the caller ([`send_beside`]).
/// (`cold`: a new prefill home's cold prefill, counted by the shared table
/// until the prefill replica's answer, which comes with its KV ready.)
fn sglang(
    a: &Attempt<'_>,
    body: &Bytes,
    replica: Arc<Replica>,
    why: RouteReason,
    cold: Option<Arc<ColdMark>>,
) -> Result<Planned, GatewayError> {
    let host = url::Url::parse(&replica.base)
        .ok()
        .and_then(|u| u.host_str().map(|h| h.trim_matches(['[', ']']).to_string()))
        .unwrap_or_default();
    let room = fastrand::u64(..) & (i64::MAX as u64);
    let mut v = object(body)?;
    v.insert("bootstrap_host".into(), Value::String(host));
    v.insert(
        "bootstrap_port".into(),
        replica.bootstrap_port.map_or(Value::Null, Value::from),
    );
    v.insert("bootstrap_room".into(), Value::from(room));
    let both = serde_json::to_vec(&v)
        .map(Bytes::from)
        .map_err(|e| GatewayError::Internal(e.to_string()))?;
    let mut leg = v;
    leg.insert("stream".into(), Value::Bool(false));
    leg.remove("stream_options");
    let leg = serde_json::to_vec(&leg)
        .map(Bytes::from)
        .map_err(|e| GatewayError::Internal(e.to_string()))?;
    let req = request(a, &replica, &leg);
    let by =
        (Instant::now() + a.state.config.routing.disaggregation.prefill_timeout).min(a.deadline);
    let (tx, outcome) = tokio::sync::oneshot::channel();
    let done = Arc::new(std::sync::OnceLock::new());
    let set_done = done.clone();
    let sent = Instant::now();
    let metrics = a.state.metrics.clone();
    let model: Arc<str> = a.ctx.model.into();
    let name = replica.name.clone();
    let task = tokio::spawn(async move {
        let _in_flight = InFlight::new(replica.clone());
        let started = Instant::now();
        let result = async {
            let (_, mut conn) = send::send(&replica, req, by, false).await?;
            let answer = conn.collect(MAX_PREFILL_ANSWER, by).await;
            drop(cold);
            match answer {
                Ok(Ok(_)) => {
                    replica.conns.checkin(conn);
                    Ok(())
                }
                Ok(Err(e)) => Err(GatewayError::UpstreamProtocol(
                    e.during("reading the prefill answer"),
                )),
                Err(_) => Err(GatewayError::UpstreamTimeout {
                    phase: crate::error::TimeoutPhase::Total,
                }),
            }
        }
        .await;
        match &result {
            Ok(()) => {
                let took = started.elapsed();
                let _ = set_done.set(took);
                metrics
                    .pd_prefill
                    .get(&(model,))
                    .observe(took.as_secs_f64());
            }
            Err(e) => {
                tracing::warn!(backend = %replica.name, error = %e, "SGLang prefill leg failed");
                metrics
                    .upstream_errors
                    .get(&(replica.name.clone(), e.kind()))
                    .inc();
            }
        }
        let _ = tx.send(result);
    })
    .abort_handle();
    Ok(Planned {
        body: both,
        record: PdRecord {
            reason: PdReason::Remote,
            prefill_backend: Some(name),
            prefill_route: Some(why),
            prefill_sent: Some(sent),
            prefill: None,
            prefill_done: Some(done),
            prefill_cached: None,
            stall_charge: None,
        },
        sglang: Some(SglangLeg { outcome, task }),
    })
}

/// Send the decode leg of SGLang's protocol while its prefill leg runs: if
/// the prefill fails before the decode replica answers (it would wait for a
/// room that never fills), the decode leg is dropped (its connection closed)
/// and `local` is sent instead, the decode replica prefilling itself.
/// `Ok(true)`: that happened.
pub(crate) async fn send_beside(
    replica: &Replica,
    decode: crate::upstream::http1::Outgoing,
    local: crate::upstream::http1::Outgoing,
    by: Instant,
    stream: bool,
    leg: &mut SglangLeg,
) -> Result<(Answer, bool), GatewayError> {
    // Boxed, so that dropping it below ends it (and closes its connection).
    let mut sent = Box::pin(send::send(replica, decode, by, stream));
    tokio::select! {
        r = &mut sent => return r.map(|a| (a, false)),
        out = &mut leg.outcome => {
            if matches!(out, Ok(Ok(()))) {
                // The prefill is done: its room is ready for the decode leg.
                return sent.await.map(|a| (a, false));
            }
        }
    }
    // Dropped before an answer: the decode replica's connection closes.
    drop(sent);
    send::send(replica, local, by, stream)
        .await
        .map(|a| (a, true))
}

/// What `send::send` answers: the response head and its connection.
pub(crate) type Answer = (http::Response<()>, crate::upstream::conn::Conn);

/// The request for one leg on `replica`, with the client's headers.
fn request(a: &Attempt<'_>, replica: &Replica, body: &[u8]) -> crate::upstream::http1::Outgoing {
    let prefixed;
    let path = if replica.path_prefix.is_empty() {
        a.path
    } else {
        prefixed = format!("{}{}", replica.path_prefix, a.path);
        prefixed.as_str()
    };
    let mut added: Vec<(&http::HeaderName, &[u8])> =
        vec![(&header::HOST, replica.conns.host.as_bytes())];
    if let Some(t) = a.traceparent {
        added.push((&TRACEPARENT, t));
    }
    if let Some(key) = &replica.api_key {
        added.push((&header::AUTHORIZATION, key.as_bytes()));
    }
    proxied_request(&Method::POST, path, &a.parts.headers, a.rid, &added, body)
}

/// The prefill pool's predicted wait for the prompt against the decode
/// replica's own prefill of what it lacks: tokens queued ahead at the prefill
/// replicas' calibrated rates, against the decode replica's rate times the
/// prompt's uncached tokens there.
struct PoolWait {
    /// At the prefill replica the prompt would go to: its session's
    /// prefill home while this gateway knows one in the pool (its turns
    /// keep it), else the shortest wait.
    target: f64,
    /// The pool's mean.
    mean: f64,
    local: f64,
}

impl PoolWait {
    /// The pool would make the prompt wait longer than the local prefill.
    fn busy(&self) -> bool {
        self.target > self.local
    }

    /// ...and the prompt is bound for one of its longer queues: at least
    /// the pool's mean (in a pool of several, a prompt without a prefill
    /// home only while its replicas wait alike).
    fn long_queue(&self) -> bool {
        self.busy() && self.target >= self.mean
    }
}

fn pool_wait(a: &DecodeSide<'_>, pool: &[Arc<Replica>]) -> PoolWait {
    let now = a.ctx.now;
    let rate_and_ahead = |r: &Replica| {
        let m = a.state.affinity.of(&r.name, now);
        // The prefills ahead: requests waiting for room (SGLang's prefill
        // replica holds those waiting for their decode side apart).
        let waiting = r.load().and_then(|s| s.queue());
        (m.load.rate(), m.load.ahead(waiting))
    };
    let (decode_rate, _) = rate_and_ahead(a.decode);
    let ahead: Vec<(Option<f64>, f64)> = pool.iter().map(|p| rate_and_ahead(p)).collect();
    // A rate not learned yet is taken from the other side (a decode replica
    // that never prefilled has none); none known: the same unit on both
    // sides (tokens).
    let any_pool_rate = ahead.iter().find_map(|(rate, _)| *rate);
    let local_rate = decode_rate.or(any_pool_rate).unwrap_or(1.0);
    let uncached = f64::from(a.ctx.prompt_tokens.saturating_sub(a.decode_cached));
    let waits: Vec<f64> = ahead
        .iter()
        .map(|(rate, ahead)| rate.unwrap_or(local_rate) * ahead)
        .collect();
    let home = a.ctx.session.and_then(|k| {
        let name = a.state.affinity.sessions.get(prefill_session(k.key), now)?;
        pool.iter().position(|p| p.name == name)
    });
    let shortest = waits.iter().copied().fold(f64::INFINITY, f64::min);
    PoolWait {
        target: home.map_or(shortest, |i| waits[i]),
        mean: waits.iter().sum::<f64>() / waits.len().max(1) as f64,
        local: local_rate * uncached,
    }
}

/// The streams a decode replica decodes, as this gateway counts them.
#[derive(Debug, Clone, Copy)]
struct Decoding {
    streams: u32,
    /// Nothing running or waiting there (a prefill now lengthens no
    /// stream's step; a stream that arrives during it waits for its first
    /// token, as behind any prefill).
    idle: bool,
}

/// By this gateway's requests in flight there and the engine's latest
/// scrape (when fresh: idle only by a fresh one), whichever shows more.
fn decoding_scraped(s: &DecodeSide<'_>) -> Decoding {
    let v = (s.view)(s.decode);
    let max_age = s.state.config.routing.metrics.stale_after;
    let fresh = v.fresh_load(s.ctx.now, max_age);
    let running = fresh
        .and_then(|l| l.running)
        .map_or(0, |r| r.max(0.0).round() as u32);
    // (Not those still waiting for their remote prefill: not decoding.)
    let in_flight = s.decode.in_flight_at_engine();
    Decoding {
        streams: in_flight.max(running),
        idle: in_flight == 0
            && fresh.is_some_and(|l| {
                l.running.is_some_and(|r| r < 0.5) && l.waiting.unwrap_or(0.0) < 0.5
            }),
    }
}

/// By a look at the engine now ([`scrape::glance`]): other gateways'
/// requests there (what the engine runs and queues beyond this gateway's
/// in flight at the look: their queued decode legs start within a step or
/// a KV transfer) plus this gateway's in flight now, or what the engine
/// runs if more. `None` when the engine did not answer; without scrapes
/// (`routing.metrics.enabled: false`), this gateway's count alone.
async fn decoding_now(s: &DecodeSide<'_>) -> Option<Decoding> {
    let m = &s.state.config.routing.metrics;
    if !m.enabled {
        return Some(decoding_scraped(s));
    }
    let g = scrape::glance(s.decode, &s.state.client, m.engine).await?;
    let in_flight = s.decode.in_flight_at_engine();
    let running = g.running.max(0.0).round() as u32;
    let seen = (g.running + g.waiting).max(0.0).round() as u32;
    let streams = (in_flight + seen.saturating_sub(g.in_flight)).max(running);
    Some(Decoding {
        streams,
        idle: streams == 0 && g.waiting < 0.5,
    })
}

/// `f` on this gateway's stall ledger of the decode replica.
fn with_ledger<T>(s: &DecodeSide<'_>, f: impl FnOnce(&mut StallLedger) -> T) -> T {
    f(&mut s.state.affinity.of(&s.decode.name, s.ctx.now).stalls.lock())
}

/// A request planned as a local prefill under running streams
/// (`local_stall_budget`) that `decode` refused or that never reached it
/// (an error a retry may follow, [`GatewayError::retryable`]): the engine
/// stalled nothing, and the allowance spent is given back. (Kept spent, it
/// held the next prompts off a replica for a prefill that ran elsewhere or
/// not at all.)
pub(crate) fn refund_unrun(state: &AppState, decode: &Replica, record: Option<&mut PdRecord>) {
    // (Taken: refunded once, and not checked against usage at the end.)
    if let Some(c) = record.and_then(|pd| pd.stall_charge.take()) {
        let now = crate::turn::now_std();
        let memory = state.affinity.of(&decode.name, now);
        memory.stalls.lock().refund(c.stalls(), c.spent_at, now);
    }
}

/// The stalled gaps a local prefill of the prompt would cause on the
/// decode replica's `streams` ([`crate::routing::stall_budget`]): each
/// stalled once per `prefill_chunk_tokens` of what the replica lacks. Only
/// a prefill of one chunk, and not where nothing decodes (`local_idle`'s
/// case).
fn stall_charge(s: &DecodeSide<'_>, streams: u32) -> Option<StallCharge> {
    let cfg = &s.state.config.routing.disaggregation;
    let uncached = s.ctx.prompt_tokens.saturating_sub(s.decode_cached);
    // One chunk at most, as routing's index sees it: each stream there is
    // stalled once, by one step. (A turn whose history the decode replica
    // had evicted is still prefilled whole there, 10,000 tokens: five
    // ~210-ms steps for every stream decoding there; it owes them when it
    // ends. Refusing replicas found evicting in the last 5-10 s instead left
    // 10 such prefills a run on agentic sessions, where their decode
    // replicas evict all the time. A session's idle time tells them apart,
    // over 2 s: 160 of 249 in 35 runs, but it would also send 235 of the
    // 2,484 predicted right to the saturated pool, where the TTFT tail is
    // made, to spare stalls that leave the inter-token p99 level;
    // docs/benchmarks-log.md.)
    if uncached > cfg.prefill_chunk_tokens || streams == 0 {
        return None;
    }
    Some(StallCharge {
        streams,
        uncached,
        chunk_tokens: cfg.prefill_chunk_tokens,
        spent_at: s.ctx.now,
    })
}

fn tokens_per_block(state: &AppState) -> u32 {
    u32::try_from(state.config.routing.prefix_kv.block_chars / crate::tokens::CHARS_PER_TOKEN)
        .unwrap_or(16)
        .max(1)
}

/// One prefill leg on `replica`: the transfer parameters of its answer (if
/// any), its cached prompt tokens, when it was sent and how long it took.
async fn leg(
    a: &Attempt<'_>,
    replica: &Arc<Replica>,
    body: &Bytes,
    mut placement: Placement,
) -> Result<(Option<Value>, Option<u32>, Instant, std::time::Duration), GatewayError> {
    let cfg = &a.state.config;
    let body = prefill_body(body)?;
    let req = request(a, replica, &body);
    let _in_flight = InFlight::new(replica.clone());
    let started = Instant::now();
    let by = (started + cfg.routing.disaggregation.prefill_timeout).min(a.deadline);
    let (_, mut conn) = send::send(replica, req, by, false).await?;
    let bytes = match conn.collect(MAX_PREFILL_ANSWER, by).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            return Err(GatewayError::UpstreamProtocol(
                e.during("reading the prefill answer"),
            ));
        }
        Err(_) => {
            return Err(GatewayError::UpstreamTimeout {
                phase: crate::error::TimeoutPhase::Total,
            });
        }
    };
    replica.conns.checkin(conn);
    let took = started.elapsed();
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
        GatewayError::UpstreamProtocol(format!("the prefill answer is not JSON: {e}").into())
    })?;
    let params = v
        .get("kv_transfer_params")
        .filter(|p| p.is_object())
        .cloned();
    let (cached, prompt) = prefill_usage(a.wire, &v, &bytes);
    // Its one token and its usage came together: the rate learns from
    // what the engine prefilled.
    placement.first_token_cached(took, cached, prompt);
    if let Some(c) = cached {
        placement.finished(c, prompt);
    }
    Ok((params, cached, started, took))
}

/// The prefill answer's cached and prompt tokens, in its API's shape:
/// OpenAI's `usage.prompt_tokens` and `prompt_tokens_details.cached_tokens`,
/// or Anthropic's (read as the proxy reads a whole Messages answer).
fn prefill_usage(wire: Wire, v: &Value, bytes: &[u8]) -> (Option<u32>, Option<u32>) {
    if wire == Wire::Anthropic {
        return crate::stream::protocols::whole(wire, bytes)
            .and_then(|w| w.usage)
            .map_or((None, None), |u| (u.cached_tokens, Some(u.prompt_tokens)));
    }
    let n = |p: &str| {
        v.pointer(p)
            .and_then(Value::as_u64)
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
    };
    (
        n("/usage/prompt_tokens_details/cached_tokens"),
        n("/usage/prompt_tokens"),
    )
}

/// The prefill leg's body (vLLM): the client's, answered whole with one
/// token, asking the engine to keep the KV for a remote decode.
pub(crate) fn prefill_body(body: &Bytes) -> Result<Bytes, GatewayError> {
    let mut v = object(body)?;
    v.insert("stream".into(), Value::Bool(false));
    v.remove("stream_options");
    v.insert("max_tokens".into(), json!(1));
    if v.contains_key("max_completion_tokens") {
        v.insert("max_completion_tokens".into(), json!(1));
    }
    // vLLM checks min_tokens <= max_tokens.
    for min in ["min_tokens", "min_completion_tokens"] {
        if v.get(min).and_then(Value::as_u64).is_some_and(|n| n > 1) {
            v.insert(min.into(), json!(1));
        }
    }
    v.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    serde_json::to_vec(&v)
        .map(Bytes::from)
        .map_err(|e| GatewayError::Internal(e.to_string()))
}

/// `body` with the top-level `key` set to `value`.
fn with_member(body: &Bytes, key: &str, value: Value) -> Result<Bytes, GatewayError> {
    let mut v = object(body)?;
    v.insert(key.into(), value);
    serde_json::to_vec(&v)
        .map(Bytes::from)
        .map_err(|e| GatewayError::Internal(e.to_string()))
}

fn object(body: &Bytes) -> Result<Map<String, Value>, GatewayError> {
    serde_json::from_slice(body)
        .map_err(|e| GatewayError::InvalidRequest(format!("invalid request body: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_body_asks_one_token_whole_and_keeps_the_rest() {
        let body = Bytes::from_static(
            br#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":300,"max_completion_tokens":300,"min_tokens":5,"messages":[{"role":"user","content":"hi"}],"temperature":0.2}"#,
        );
        let v: Value = serde_json::from_slice(&prefill_body(&body).unwrap()).unwrap();
        assert_eq!(v["stream"], false);
        assert!(v.get("stream_options").is_none());
        assert_eq!(
            (
                v["max_tokens"].as_u64(),
                v["max_completion_tokens"].as_u64()
            ),
            (Some(1), Some(1))
        );
        assert_eq!(v["min_tokens"], 1);
        assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(v["kv_transfer_params"]["do_remote_prefill"], false);
        assert_eq!(v["messages"][0]["content"], "hi");
        assert_eq!(v["temperature"], 0.2);
        // Not added where the client did not send it.
        let plain = Bytes::from_static(br#"{"model":"m","prompt":"x"}"#);
        let v: Value = serde_json::from_slice(&prefill_body(&plain).unwrap()).unwrap();
        assert!(v.get("max_completion_tokens").is_none());
        assert_eq!(v["max_tokens"], 1);
    }

    #[test]
    fn a_prefill_answers_usage_is_read_in_its_apis_shape() {
        let openai = br#"{"usage":{"prompt_tokens":300,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":128}}}"#;
        let v: Value = serde_json::from_slice(openai).unwrap();
        assert_eq!(
            prefill_usage(Wire::OpenAi, &v, openai),
            (Some(128), Some(300))
        );
        // Anthropic's: the prompt is input, cache read and cache creation.
        let anthropic = br#"{"type":"message","content":[],"stop_reason":"max_tokens","usage":{"input_tokens":172,"cache_read_input_tokens":128,"cache_creation_input_tokens":0,"output_tokens":1}}"#;
        let v: Value = serde_json::from_slice(anthropic).unwrap();
        assert_eq!(
            prefill_usage(Wire::Anthropic, &v, anthropic),
            (Some(128), Some(300))
        );
        assert_eq!(
            prefill_usage(Wire::OpenAi, &v, anthropic),
            (None, None),
            "the other API's fields are not read"
        );
    }

    #[test]
    fn only_the_apis_the_engines_serve_a_prefill_leg_for_get_one() {
        use PdProtocol::{Sglang, Vllm};
        for (protocol, endpoint, picker, leg) in [
            (Vllm, Endpoint::Chat, false, Some(true)),
            (Sglang, Endpoint::Completions, false, Some(true)),
            (Vllm, Endpoint::Messages, false, Some(true)),
            (Vllm, Endpoint::Messages, true, Some(false)),
            (Sglang, Endpoint::Messages, false, Some(false)),
            (Vllm, Endpoint::Responses, false, Some(false)),
            (Vllm, Endpoint::Embeddings, false, None),
            (Vllm, Endpoint::CountTokens, false, None),
        ] {
            assert_eq!(
                leg_api(protocol, endpoint, picker),
                leg,
                "{protocol:?} {endpoint:?} picker={picker}"
            );
        }
    }

    #[test]
    fn the_decode_body_carries_the_prefills_parameters_as_they_came() {
        let body = Bytes::from_static(br#"{"model":"m","stream":true,"max_tokens":300}"#);
        let params = json!({"do_remote_prefill": true, "remote_block_ids": [1, 2], "tp_size": 1});
        let v: Value = serde_json::from_slice(
            &with_member(&body, "kv_transfer_params", params.clone()).unwrap(),
        )
        .unwrap();
        assert_eq!(v["kv_transfer_params"], params);
        assert_eq!(
            (v["stream"].as_bool(), v["max_tokens"].as_u64()),
            (Some(true), Some(300))
        );
    }
}
