//! `prefix_kv` (the default): send a request where it will see its first
//! token soonest, counting the KV cache it would hit, and keep
//! conversations and shared prefixes where they already are.
//!
//! Algorithm, per request:
//! 1. **Pressure filter.** A candidate whose last scrape is older than
//!    `stale_after` (or missing) is treated as saturated; one at or above
//!    `kv_high` KV-cache usage, or with `queue_high` requests waiting, or with
//!    every seat taken (`ReplicaView::full`), gets no new work. If every
//!    candidate is filtered (`fallback`), the request goes, where the
//!    candidates with fresh metrics hold different shares of its prompt,
//!    to the one among them whose predicted TTFT (step 3, no session history
//!    counted) is least; else to the one with least work; it never fails.
//! 2. **Home.** Where the request belongs, decided from inputs every gateway
//!    sees alike (no shared state), by rendezvous (highest-random-weight)
//!    hashing over the candidates' names:
//!    - with a **session** (`RouteCtx::session`): the replica this gateway
//!      last sent it to while that one is there with fresh metrics (under KV
//!      or queue pressure too: its history is there); else the first open
//!      replica in the session key's own order (`session_new`; a session
//!      whose replica went away or went silent moves and is counted). Every
//!      gateway computes the same first replica, so a session sent to several
//!      gateways by a load balancer stays whole; one unknown here that
//!      carries earlier turns goes to the first replica alive in that order,
//!      where another gateway put it. Its history counts as cached there.
//!      With `session_placement: least_loaded` (one gateway), a new session
//!      (or one unknown here) goes instead to the open replica that served
//!      the fewest sessions lately (`affinity::SessionsHere`); with
//!      `first_open`, and with `auto` while this gateway is the engines'
//!      only sender (`RouteCtx::alone`), to the first open one in its
//!      key's order;
//!    - without: the prompt's home by its first `home_blocks` block hashes
//!      with bounded loads (the first in that order whose in-flight count is
//!      within `load_factor` x the mean), so requests that share a prefix
//!      meet on one replica, and a hot prefix spreads to the next.
//! 3. **Predicted TTFT** on each open candidate
//!    (`routing::load`): `rate x (tokens ahead + uncached tokens)`, with the
//!    rate calibrated online per replica and the uncached tokens counting
//!    the prefix it has cached (`routing::index`).
//! 4. **Stay or detour.** The home is chosen unless another candidate's
//!    predicted TTFT is lower by more than `detour_margin` of the home's:
//!    staying would cost more than its cache saves. A detour serves this
//!    request elsewhere: where more of its prefix is cached (`affinity`), or
//!    for its wait (`detour`); to a replica holding less of it only from a
//!    home whose engine says it is full (`spill_*`, or `detour` when every
//!    replica is full); a session's home stays where it is. A new
//!    prefix is not detoured: its placement weighed the waits already, and
//!    where it is served it is held for the run.
//!    The reason is `session`, `session_new` or `affinity` when the home is
//!    kept, else why it was passed over (`spill_*`), else `least_loaded`.
//! 5. The prompt's block hashes are added to the winner's index.
//!
//! Cost: O(n log n) in the candidates for the rankings, O(n log blocks)
//! index lookups, O(blocks) to insert, one sharded-table lookup for a
//! session; the block hashing itself (O(prompt bytes)) is done once per
//! request in `routing::prefix`. See `benches/routing.rs`.

use std::sync::Arc;
use std::time::Duration;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::affinity::{Affinity, ReplicaMemory};
use super::index::WARM_BUDGET;
use super::{Decision, NewHome, ReplicaView, RouteCtx, RoutingPolicy, least_loaded};
use crate::config::{PrefixKvConfig, SessionPlacement};
use crate::vocab::RouteReason;

pub struct PrefixKv {
    cfg: PrefixKvConfig,
    /// `None`: scraping is off, so there is no pressure information to trust
    /// or distrust; only prefix and load decide.
    stale_after: Option<Duration>,
    /// Each replica's index of the prefix blocks routed there, its load, and
    /// the session table.
    affinity: Arc<Affinity>,
}

impl PrefixKv {
    pub fn new(
        cfg: PrefixKvConfig,
        stale_after: Option<Duration>,
        affinity: Arc<Affinity>,
    ) -> Self {
        Self {
            cfg,
            stale_after,
            affinity,
        }
    }
}

/// Why a candidate may not take new work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blocked {
    No,
    Stale,
    Kv,
    Queue,
}

impl Blocked {
    fn spill(self) -> RouteReason {
        match self {
            Blocked::Kv => RouteReason::SpillKv,
            Blocked::Queue => RouteReason::SpillQueue,
            Blocked::Stale => RouteReason::SpillStale,
            Blocked::No => RouteReason::SpillLoad,
        }
    }
}

struct View {
    blocked: Blocked,
    /// What the engine says of itself: its queue outlived a scrape
    /// (`Queue`) or it preempted (`Kv`). It blocks new work only while some
    /// other candidate says neither (`pick`): when every replica is full,
    /// the cache decides where the wait is shortest.
    pressed: Blocked,
    in_flight: f64,
    /// For placing new keys: this gateway's requests in flight there, the
    /// engine's own queue at its last fresh scrape (`least_loaded::work`),
    /// and the requests this gateway sent there in the last 5-10 s (not for
    /// a decode leg).
    work: f64,
    /// Blocked only because its engine's queue outlived its last scrapes
    /// while another replica's did not (`views`).
    queued_only: bool,
    /// Scraped KV-cache usage (0 unknown): a tiebreak, never a stop.
    kv: f64,
    /// Leading prompt blocks this gateway's index says are cached there.
    matched: usize,
    /// Tokens ahead of a new request there.
    ahead: f64,
    rate: Option<f64>,
    memory: Arc<ReplicaMemory>,
}

/// Requests in flight a prefix's home may carry above its fair share
/// before its bounded load spills new requests elsewhere (see `prefix_home`).
const LOAD_SLACK: f64 = 8.0;

/// A replica's rendezvous weight for a key (stable across processes).
pub(crate) fn rendezvous(key: u64, name: &str) -> u64 {
    xxh3_64_with_seed(name.as_bytes(), key)
}

/// Candidates in a key's rendezvous order.
fn order(key: u64, candidates: &[ReplicaView]) -> Vec<usize> {
    let mut o: Vec<usize> = (0..candidates.len()).collect();
    o.sort_by_key(|&i| std::cmp::Reverse(rendezvous(key, &candidates[i].name)));
    o
}

/// Where a key goes among the replicas that pass `eligible`, scanned in the
/// key's rendezvous order (ties go to the earlier: on an even fleet a key
/// goes where its own order says, which every gateway computes the same).
///
/// - A new home (`held`: each replica's prefix blocks in this gateway's
///   index, and the prompt's own): the replica holding least, in whole prompts' worth of blocks
///   (the prefixes placed there and the traffic they brought, as a router
///   that sees every prompt balances its trees; gateways whose indexes
///   differ by less than a prompt still see the same replicas as least
///   full); then the one with fewer prompts like this one queued for
///   prefill (the tokens ahead there in units of this prompt: a cold
///   prefill in progress counts, a few cached requests do not); then the
///   least work (this gateway's requests in flight there, the engine's own
///   queue, the requests it sent there lately).
/// - Among a prefix's holders (`held` is `None`): the fewest prompts queued
///   for prefill, then the least work.
fn place(
    ranked: &[usize],
    views: &[View],
    prompt_tokens: u32,
    held: Option<(&[f64], usize)>,
    eligible: impl Fn(usize) -> bool,
) -> Option<usize> {
    let size = |i: usize| held.map_or(0.0, |(blocks, own)| (blocks[i] / own.max(1) as f64).round());
    // `min_by` keeps the first of equals: the earlier in the order.
    ranked
        .iter()
        .copied()
        .filter(|&i| eligible(i))
        .min_by(|&a, &b| {
            size(a)
                .total_cmp(&size(b))
                .then_with(|| by_wait(views, prompt_tokens, a, b))
        })
}

/// [`place`]'s order after the balance: fewer prompts like this one queued
/// for prefill, then less work.
fn by_wait(views: &[View], prompt_tokens: u32, a: usize, b: usize) -> std::cmp::Ordering {
    let prompts_ahead = |i: usize| (views[i].ahead / f64::from(prompt_tokens.max(1))).round();
    prompts_ahead(a)
        .total_cmp(&prompts_ahead(b))
        .then(views[a].work.total_cmp(&views[b].work))
}

/// Where a new home may go: within its bounded load, and for a decode leg
/// not among the replicas generating the most streams.
struct Limits {
    /// Requests in flight from which a replica is past its bounded load:
    /// `load_factor` times a replica's fair share of what is in flight
    /// (this request included), and never fewer than `LOAD_SLACK` requests
    /// above that share: leaving a holder costs a cold prefill elsewhere,
    /// which a few requests more in a batch of dozens never cost. (At
    /// 1.25-2x alone, the cold start's handful of requests in flight
    /// crossed the bound by chance and spilled prefills onto replicas busy
    /// with their own.)
    bound: f64,
    /// A decode leg's: the fewest streams an open replica generates (this
    /// gateway's in flight). It leaves the holder when another open replica
    /// generates at least two streams fewer: only then does sending it
    /// there even the batches out. The prompt is prefilled in the prefill
    /// pool wherever it decodes, so leaving costs a KV transfer and the KV
    /// it takes, not a prefill, while each stream more in a batch lengthens
    /// every step of the batch. (Decode legs by least work alone evened the
    /// steps but spread long shared documents over every decode replica's
    /// KV: retrieval's TTFT p99 ratio fell from 1.90x to 1.47x;
    /// docs/benchmarks-log.md.)
    fewest: Option<f64>,
}

impl Limits {
    fn of(ctx: &RouteCtx<'_>, cfg: &PrefixKvConfig, views: &[View]) -> Self {
        let total: f64 = views.iter().map(|v| v.in_flight).sum();
        let share = (total + 1.0) / views.len().max(1) as f64;
        let fewest = if ctx.decode_leg {
            views
                .iter()
                .filter(|v| v.blocked == Blocked::No)
                .map(|v| v.in_flight)
                .min_by(f64::total_cmp)
        } else {
            None
        };
        Self {
            bound: (cfg.load_factor * share).max(share + LOAD_SLACK).ceil(),
            fewest,
        }
    }

    fn within(&self, views: &[View], i: usize) -> bool {
        views[i].in_flight < self.bound
    }

    fn uneven(&self, views: &[View], i: usize) -> bool {
        self.fewest.is_some_and(|f| views[i].in_flight >= f + 2.0)
    }
}

/// The mean calibrated rate of the replicas `among` that have one (1.0
/// when none has: then every prediction uses it and only tokens compare).
fn mean_rate(views: &[View], among: impl Iterator<Item = usize>) -> f64 {
    let (sum, known) = among
        .filter_map(|i| views[i].rate)
        .fold((0.0, 0usize), |(sum, k), r| (sum + r, k + 1));
    if known == 0 { 1.0 } else { sum / known as f64 }
}

/// Predicted seconds to first token on a replica: its rate (else
/// `fleet_rate`) times the tokens ahead there and the prompt's tokens it
/// does not hold (its indexed blocks, or `history` known held beyond them).
fn predicted_ttft(v: &View, tpb: u32, prompt_tokens: u32, history: u32, fleet_rate: f64) -> f64 {
    let blocks = u32::try_from(v.matched).unwrap_or(u32::MAX);
    let cached = blocks.saturating_mul(tpb).max(history).min(prompt_tokens);
    v.rate.unwrap_or(fleet_rate) * (v.ahead + f64::from(prompt_tokens - cached))
}

/// The prefix blocks this gateway's index lists for each replica.
fn sizes(views: &[View]) -> Vec<f64> {
    views
        .iter()
        .map(|v| v.memory.prefixes.len() as f64)
        .collect()
}

/// Where a request belongs, and why.
struct Home {
    index: usize,
    reason: RouteReason,
    /// Tokens the home is known to hold beyond the index (a session's history).
    history: u32,
    moved: bool,
}

impl RoutingPolicy for PrefixKv {
    fn name(&self) -> &'static str {
        "prefix_kv"
    }

    fn wants_prefix(&self) -> bool {
        true
    }

    fn new_home(&self, ctx: &RouteCtx<'_>, candidates: &[ReplicaView]) -> Option<NewHome> {
        let key = self.home_key(ctx.hashes)?;
        if candidates.len() < 2 || self.by_session(ctx).is_some() {
            return None;
        }
        // Held here (the common case): decided without the views.
        let home = &ctx.hashes[..self.cfg.home_blocks.min(ctx.hashes.len())];
        let held = |r: &ReplicaView| {
            let memory = self.affinity.of(&r.name, ctx.now);
            memory.prefixes.longest_match(home) >= home.len()
        };
        if candidates.iter().any(held) {
            return None;
        }
        let views = self.views(ctx, candidates);
        let open = |i: usize| views[i].blocked == Blocked::No;
        if !(0..views.len()).any(open) {
            return None;
        }
        let limits = Limits::of(ctx, &self.cfg, &views);
        let ranked = order(key, candidates);
        let mut order: Vec<usize> = ranked
            .iter()
            .copied()
            .filter(|&i| open(i) && limits.within(&views, i) && !limits.uneven(&views, i))
            .collect();
        if order.is_empty() {
            order = ranked.iter().copied().filter(|&i| open(i)).collect();
        }
        // As `place` orders them after the balance (a stable sort keeps
        // the rendezvous order between equals); then the others.
        order.sort_by(|&a, &b| by_wait(&views, ctx.prompt_tokens, a, b));
        let open = order.len();
        // Then those left out only for their engine's queue at its last
        // scrapes, within their bounded load: every gateway sees that queue
        // until the next scrape, and all of them would send every new prompt
        // of that interval to the others (`routing::shared_table` weighs
        // them against the cold prefills under way there).
        let mut queued: Vec<usize> = ranked
            .iter()
            .copied()
            .filter(|&i| {
                !order.contains(&i)
                    && views[i].queued_only
                    && limits.within(&views, i)
                    && !limits.uneven(&views, i)
            })
            .collect();
        queued.sort_by(|&a, &b| by_wait(&views, ctx.prompt_tokens, a, b));
        let queued_n = queued.len();
        order.extend(queued);
        let rest: Vec<usize> = ranked
            .iter()
            .copied()
            .filter(|i| !order.contains(i))
            .collect();
        order.extend(rest);
        Some(NewHome {
            key,
            order,
            open,
            queued: queued_n,
        })
    }

    fn pick(&self, ctx: &RouteCtx<'_>, candidates: &[ReplicaView]) -> Option<Decision> {
        // (Read before: deciding remembers a derived session.)
        let by_session = self.by_session(ctx);
        let mut d = self.choose(ctx, candidates, by_session)?;
        d.by_prefix = by_session.is_none();
        Some(d)
    }
}

impl PrefixKv {
    /// [`RoutingPolicy::pick`]'s decision (`by_session`: the session that
    /// decides it, if one does).
    fn choose(
        &self,
        ctx: &RouteCtx<'_>,
        candidates: &[ReplicaView],
        by_session: Option<super::SessionKey>,
    ) -> Option<Decision> {
        let n = candidates.len();
        if n == 0 {
            return None;
        }
        let views = self.views(ctx, candidates);
        // The replicas not under pressure, as an iterator (no list allocated
        // per request).
        let open = || (0..n).filter(|&i| views[i].blocked == Blocked::No);
        let tpb = self.tokens_per_block();
        if open().next().is_none() {
            // Everything is under pressure or unknown: the request waits
            // wherever it goes. A session waits where its history is (or, new,
            // where its placement puts it), and is remembered there: taken
            // by the shortest predicted wait like any request, its turns
            // scattered, each re-prefilling its history (32 agentic sessions
            // on 2 full prefill replicas: 68 of 100 sessions prefilled on
            // both; docs/benchmarks-log.md).
            if by_session.is_some()
                && let Some(home) = self.session_home(ctx, candidates, &views)
            {
                self.remember(ctx, candidates, &views, home.index);
                return Some(self.at_home(ctx, &views, &home));
            }
            // Where the replicas whose word is fresh hold different shares
            // of its prompt, the least predicted TTFT, its cache counted, is
            // the shortest wait. Taken by least work, a
            // prompt whose document one full replica held went as often to
            // one that held nothing and paid a cold prefill (retrieval on a
            // disaggregated fleet in its cold start, both prefill replicas
            // full: seed 3's warm TTFT p99 457 -> 68 ms). Where they hold
            // the same, least work: it balances seats better than the
            // predictions' noisy rates (0.4-1.9% more goodput on a
            // seat-bound fleet without flow control; docs/benchmarks-log.md).
            // A disaggregated decode leg too: the prediction is of a prefill,
            // done in the prefill pool wherever it decodes.
            let fresh = || (0..n).filter(|&i| views[i].blocked != Blocked::Stale);
            let held = |i: usize| views[i].matched;
            let differ = !ctx.decode_leg && fresh().map(held).min() != fresh().map(held).max();
            let rate = mean_rate(&views, fresh());
            let wait = |i: usize| predicted_ttft(&views[i], tpb, ctx.prompt_tokens, 0, rate);
            let i = fresh()
                .filter(|_| differ)
                .min_by(|&a, &b| wait(a).total_cmp(&wait(b)))
                .or_else(|| {
                    (0..n).min_by(|&a, &b| {
                        least_loaded::work(&candidates[a], ctx, self.stale_after)
                            .total_cmp(&least_loaded::work(&candidates[b], ctx, self.stale_after))
                    })
                })?;
            return Some(self.decide(ctx, &views, i, RouteReason::Fallback, 0, false, false));
        }
        let home = match by_session {
            Some(_) => self.session_home(ctx, candidates, &views),
            None => None,
        }
        .unwrap_or_else(|| self.prefix_home(ctx, candidates, &views));
        let remember = |index: usize| {
            // An explicit session's home is where every gateway looks for
            // it; a derived one's is where it was served.
            let at = match ctx.session {
                Some(s) if s.explicit => home.index,
                _ => index,
            };
            self.remember(ctx, candidates, &views, at);
        };
        // Stay or detour, by predicted TTFT.
        let fleet_rate = mean_rate(&views, open());
        let predict = |i: usize, history: u32| {
            predicted_ttft(&views[i], tpb, ctx.prompt_tokens, history, fleet_rate)
        };
        let stay = predict(home.index, home.history);
        let best = open().min_by(|&a, &b| {
            predict(a, 0)
                .total_cmp(&predict(b, 0))
                .then(views[a].kv.total_cmp(&views[b].kv))
                .then(a.cmp(&b))
        })?;
        // A session is worth more than this turn's cache: its next turns
        // come back to its home. Its turns leave only for a much faster
        // replica, and an explicit session's first turn does not leave (its
        // home is where every gateway will look for it).
        //
        // A new prefix's placement is final: it already weighed the
        // replicas' waits among those holding least, and the replica it is
        // served on becomes its holder for the run. Detoured to a faster
        // replica holding more, it unbalanced the fleet for good: on the
        // matrix's `few_keys` cell the seeds where 1-4 of the 16 prefixes'
        // first requests detoured ended 6/4/3/3 (busiest 1.22-1.52x the mean),
        // those where none did within 1.07x.
        // Nor is a disaggregated decode leg: the prediction is of a prefill,
        // and its prompt is prefilled in the prefill pool wherever it decodes
        // (it would undo the decode leg's own spill to fewer streams).
        // So is a home the shared table gave a prefix new here: every
        // gateway sends the prefix there, and a detour would make the replica
        // it went to a second holder in this gateway's index alone (through
        // three gateways on small caches, such detours' cold prefills
        // evicted other prompts, whose holders then moved them).
        let from_table = by_session.is_none()
            && ctx
                .shared_home
                .is_some_and(|h| *candidates[home.index].name == *h.replica);
        let margin = match ctx.session {
            _ if home.reason == RouteReason::PrefixNew || ctx.decode_leg || from_table => 1.0,
            Some(s) if s.explicit && !s.continuing => 1.0,
            Some(s) if s.explicit || s.continuing => self.cfg.session_detour_margin,
            _ => self.cfg.detour_margin,
        };
        // To a replica holding less of the prompt than its home (a
        // stranger), only from a home whose engine says it is full (its
        // queue outlived a scrape, it preempts, its seats are all taken):
        // there the prompt is prefilled cold, which the prediction counts
        // for this request alone, not for the requests that then queue
        // behind that prefill, nor for the prompts it evicts where the cache
        // has no room. On an open home the wait predicted is this gateway's
        // own backlog and rates, which in a cold start are the moment's
        // prefills and a few noisy samples. On the matrix's `few_keys_tight`,
        // five seeds with 2-4 such detours each had whole-run p99s of
        // 96-167 ms (median 132; in seed 1 of an earlier run a detour's
        // prefill evicted two prompts from a full cache, whose next requests
        // were prefilled cold again), with this rule 69-166 ms (median 101);
        // docs/BENCHMARKS.md.
        let stranger = views[best].matched < views[home.index].matched;
        let home_full =
            views[home.index].blocked != Blocked::No || views[home.index].pressed != Blocked::No;
        let detour = best != home.index
            && (home_full || !stranger)
            && predict(best, 0) < stay * (1.0 - margin);
        if detour {
            // Where more of the prompt is cached: affinity to that prefix. A
            // pressed home's spill keeps its reason; otherwise the detour is
            // for its wait (`detour`). A session's home (what its next turns
            // look for) stays.
            let reason = match home.reason {
                _ if views[best].matched > views[home.index].matched
                    && ctx.session.is_none_or(|s| !s.continuing) =>
                {
                    RouteReason::Affinity
                }
                r @ (RouteReason::SpillKv | RouteReason::SpillQueue | RouteReason::SpillStale) => r,
                // A home kept under its engine's queue, left for the wait.
                _ if views[home.index].blocked != Blocked::No => views[home.index].blocked.spill(),
                _ => RouteReason::Detour,
            };
            remember(best);
            // Off a home that holds the prompt's prefix, to a replica that
            // holds less of it: this one request is served there, and the
            // prefix keeps its home.
            return Some(self.decide(ctx, &views, best, reason, 0, home.moved, stranger));
        }
        remember(home.index);
        Some(self.at_home(ctx, &views, &home))
    }

    /// Each candidate as this decision sees it: its pressure (the engine's
    /// own word blocks new work only while another replica has room: when
    /// all are full, waiting where the cache is beats waiting anywhere) and
    /// the prompt's blocks its index lists.
    fn views(&self, ctx: &RouteCtx<'_>, candidates: &[ReplicaView]) -> Vec<View> {
        let mut views: Vec<View> = candidates.iter().map(|r| self.view(ctx, r)).collect();
        if views
            .iter()
            .any(|v| v.blocked == Blocked::No && v.pressed == Blocked::No)
        {
            for v in &mut views {
                if v.blocked == Blocked::No {
                    v.blocked = v.pressed;
                    v.queued_only = v.pressed == Blocked::Queue;
                }
            }
        }
        self.warm(ctx, &views);
        if !ctx.hashes.is_empty() {
            for v in &mut views {
                v.matched = v.memory.prefixes.longest_match(ctx.hashes);
            }
        }
        views
    }

    /// The request's session when its session decides where it goes: a
    /// session's turns follow its home. A session derived from the prompt
    /// (no id sent) starts where its prefix leads, and is remembered there
    /// for its next turns.
    fn by_session(&self, ctx: &RouteCtx<'_>) -> Option<super::SessionKey> {
        ctx.session.filter(|s| {
            s.explicit || s.continuing || self.affinity.sessions.contains(s.key, ctx.now)
        })
    }

    /// The request served at its home.
    fn at_home(&self, ctx: &RouteCtx<'_>, views: &[View], home: &Home) -> Decision {
        self.decide(
            ctx,
            views,
            home.index,
            home.reason,
            home.history,
            home.moved,
            false,
        )
    }

    /// The request's session (if any) lives on replica `at` from now.
    fn remember(&self, ctx: &RouteCtx<'_>, candidates: &[ReplicaView], views: &[View], at: usize) {
        let Some(s) = ctx.session else { return };
        if self.placement(ctx) == SessionPlacement::LeastLoaded {
            // Counted where it lives (a detoured turn's session stays at
            // home).
            views[at].memory.sessions.lock().touch(s.key, ctx.now);
        }
        self.affinity
            .sessions
            .place(s.key, &candidates[at].name, ctx.now);
    }

    /// Where a new session starts: the request's own placement (a
    /// disaggregated prefill leg's) or the policy's.
    fn placement(&self, ctx: &RouteCtx<'_>) -> SessionPlacement {
        ctx.session_placement
            .unwrap_or(self.cfg.session_placement)
            .now(ctx.alone)
    }

    fn tokens_per_block(&self) -> u32 {
        u32::try_from(self.cfg.block_chars / crate::tokens::CHARS_PER_TOKEN)
            .unwrap_or(1)
            .max(1)
    }

    fn view(&self, ctx: &RouteCtx<'_>, r: &ReplicaView) -> View {
        let c = &self.cfg;
        let fresh = self.stale_after.and_then(|d| r.fresh_load(ctx.now, d));
        let kv = fresh.and_then(|s| s.kv_usage).unwrap_or(0.0);
        // (`queue_high` by the engine's queue: requests waiting for room.)
        let queue = fresh.and_then(|s| s.queue);
        let blocked = match fresh {
            None if self.stale_after.is_none() && r.full => Blocked::Queue,
            None if self.stale_after.is_none() => Blocked::No,
            None => Blocked::Stale,
            Some(_) if c.kv_high.is_some_and(|k| kv >= k) => Blocked::Kv,
            Some(_) if r.full || c.queue_high.is_some_and(|q| queue.unwrap_or(0.0) >= q) => {
                Blocked::Queue
            }
            Some(_) => Blocked::No,
        };
        let pressed = match fresh {
            Some(s) if s.queued => Blocked::Queue,
            Some(s) if s.preempting => Blocked::Kv,
            _ => Blocked::No,
        };
        let memory = self.affinity.of(&r.name, ctx.now);
        View {
            blocked,
            pressed,
            in_flight: f64::from(r.in_flight),
            // A decode leg weighs the streams generating there now (its
            // prompt is prefilled elsewhere), not the requests sent lately.
            work: least_loaded::work(r, ctx, self.stale_after)
                + if ctx.decode_leg {
                    0.0
                } else {
                    memory.load.routed.get(ctx.now) as f64
                },
            queued_only: false,
            kv,
            // (Read in `pick`, after `warm`.)
            matched: 0,
            // The prefills ahead: requests waiting for room (a decode leg
            // waiting for its KV has nothing to prefill).
            ahead: memory.load.ahead(queue),
            rate: memory.load.rate(),
            memory,
        }
    }

    /// The home of a request with a session (`None`: no open candidate).
    fn session_home(
        &self,
        ctx: &RouteCtx<'_>,
        candidates: &[ReplicaView],
        views: &[View],
    ) -> Option<Home> {
        let s = ctx.session?;
        let table = &self.affinity.sessions;
        let known = table.get(s.key, ctx.now);
        let here = known
            .as_ref()
            .and_then(|k| candidates.iter().position(|c| c.name == *k));
        // What the session's replica holds beyond this gateway's index: all
        // but the tail (the last answer and the new message).
        let history = if s.continuing {
            ctx.prompt_tokens.saturating_sub(ctx.tail_tokens)
        } else {
            0
        };
        let placement = self.placement(ctx);
        // A session stays on its replica while that replica is there and its
        // metrics are fresh, under KV or queue pressure too: its history is
        // there (a pressed replica only takes no new sessions).
        //
        // A disaggregated prefill leg's session, though, leaves a prefill
        // replica that by the engine's own word has probably lost its
        // history: its engine queues and keeps evicting what it was sent (its
        // cached tokens fell short of this gateway's index lately). There a
        // turn most likely re-prefills the whole history behind other such
        // prefills; anywhere else it costs the same prefill without the
        // queue. So while another replica is open the session is placed
        // anew, as a new one would be (by load only: by its key's order it
        // would land where it is). (12 agentic sessions on 2 prefill
        // replicas: one replica's cache lost its sessions' histories and took
        // 36,000 uncached tokens in 2 s, turns waiting 3-5 s, while the other
        // took 1,300: TTFT p99 0.45x vllm-router's in that seed, 1.26x with
        // this.) Not on a mixed fleet through several gateways, where the
        // session's decode and KV move with it: on heavy-tailed sessions
        // through three gateways every replica queued and evicted by turns,
        // and 700 of 2,477 turns moved (58.7% sticky); docs/benchmarks-log.md.
        // It leaves only for a replica with fewer prompt tokens ahead (its
        // engine's queue, or this gateway's prefills pending there): there
        // the turn's whole prompt waits less than here. Without it, four
        // sessions left one replica within a second, 40,000 tokens of
        // histories that evicted two sessions there (seed 5 of 12 agentic
        // sessions, 31 moves, 8 sessions moved twice or more).
        // (A prefill leg is the one request that brings its own placement.)
        //
        // So does a session of a mixed fleet under `auto` while this gateway
        // is the engines' only sender (`RouteCtx::alone`): no other gateway
        // looks for it, and its history, evicted, is prefilled whole at its
        // next turn wherever it goes. (Not a disaggregated decode leg: one
        // leaves a replica for another generating two streams fewer,
        // `spill_load`.) (Heavy-tailed sessions, one gateway: the last long
        // sessions stayed on one replica whose engine queued and evicted
        // their histories by turns for 15 minutes while two replicas ran
        // nothing; busiest's share of in flight 0.58, TTFT p99 16.6 s.
        // Leaving: 8.9 s, and the p99 lower in all nine seeds of two session
        // cells measured both ways, 94.2-98.6% of turns staying; 95.8-98.6%
        // with a session that left staying where it went for `SETTLE`;
        // docs/BENCHMARKS.md, routing.)
        let prefill_leg = ctx.session_placement.is_some();
        let by_load = placement != SessionPlacement::Rendezvous;
        let auto =
            ctx.session_placement.is_none() && self.cfg.session_placement == SessionPlacement::Auto;
        // Where it may go from `home`: fewer prompt tokens ahead; for a
        // mixed fleet's session also at most half this gateway's requests
        // in flight there (moving whenever another replica was open for a
        // moment, 302 of 2,477 turns of heavy-tailed sessions moved, 86.7%
        // sticky, TTFT p50 349 -> 1,006 ms: each move re-prefills a history;
        // the trap above is replicas running nothing beside one that
        // queues).
        let roomier = |v: &View, home: &View| {
            v.ahead < home.ahead && (prefill_leg || v.in_flight * 2.0 <= home.in_flight)
        };
        // (A mixed fleet's session that left lately stays where it went for
        // a while, `affinity::SETTLE`: its history is there now, and
        // leaving by turns as the pressure moves re-prefills it each time.)
        let left_lately = &self.affinity.left_lately;
        let lost = |i: usize| {
            (prefill_leg && by_load || auto && ctx.alone && !ctx.decode_leg)
                && s.continuing
                && views[i].blocked == Blocked::Queue
                && views[i].memory.load.evicting.get(ctx.now) > 0
                && views.iter().any(|v| {
                    v.blocked == Blocked::No && v.pressed == Blocked::No && roomier(v, &views[i])
                })
                && (prefill_leg || !left_lately.contains(s.key, ctx.now))
        };
        // `auto` (its own, not a prefill leg's): placed by pressure while
        // this gateway is the engines' only sender (`RouteCtx::alone`).
        // Once another sender shows, a session it placed so off its key's
        // first replica, still there, goes back to the key's first alive,
        // where the other gateways send it (its next turn re-prefills its
        // history once); left where it is, the gateways would alternate it
        // between two replicas for the rest of its life.
        let by_pressure = &self.affinity.placed_by_pressure;
        let any_by_pressure = &self.affinity.any_by_pressure;
        let regather = |i: usize| {
            auto && !ctx.alone
                && any_by_pressure.load(std::sync::atomic::Ordering::Relaxed)
                && by_pressure.get(s.key, ctx.now).as_ref() == Some(&candidates[i].name)
        };
        if let Some(i) = here
            && views[i].blocked != Blocked::Stale
            && !lost(i)
            && !regather(i)
        {
            return Some(Home {
                index: i,
                reason: RouteReason::Session,
                history,
                moved: false,
            });
        }
        let order = order(s.key, candidates);
        let alive = |i: &usize| views[*i].blocked != Blocked::Stale;
        // A session leaving a replica that lost its history counts every
        // replica with as many prompt tokens ahead as shut: it goes where
        // less waits (one exists, or it would not leave).
        let leaving = here.filter(|&i| lost(i));
        let behind = |i: usize| leaving.is_some_and(|h| !roomier(&views[i], &views[h]));
        let first = if placement == SessionPlacement::TwoChoices {
            // New, moving, or unknown here (with a shared table, one that
            // nobody placed yet): of the first two replicas alive in the
            // key's order, the open one (its engine neither queues nor
            // preempts); when both are open or both pressed, the one with
            // less work (the engine's queue, this gateway's requests in
            // flight and lately sent), ties in the key's order. Two choices
            // per key: keys differ in their pairs, so gateways reading the
            // same scrapes spread their new sessions over every pair instead
            // of sending them all to the one replica that looks open or
            // least loaded.
            // (`min_by` keeps the first of equals: the key's order.)
            let shut = |i: usize| views[i].blocked != Blocked::No || behind(i);
            order
                .iter()
                .copied()
                .filter(alive)
                .take(2)
                .min_by(|&a, &b| {
                    shut(a)
                        .cmp(&shut(b))
                        .then(views[a].work.total_cmp(&views[b].work))
                })
        } else if placement == SessionPlacement::FirstOpen {
            // New, moving, or unknown here (with a shared table, one that
            // nobody placed yet): the first replica in the key's order whose
            // engine is not pressed (it queues or preempts), else the first
            // alive. Where another gateway would look for it is in the table.
            // (When all are pressed, the one with the least work instead was
            // tried: gateways reading the same scrapes send their new
            // sessions to the same replica until the next one; on heavy-tailed
            // sessions through three gateways the p99 fell in one seed of
            // three and rose in two; docs/benchmarks-log.md.)
            order
                .iter()
                .copied()
                .find(|&i| views[i].blocked == Blocked::No && !behind(i))
                .or_else(|| order.iter().copied().find(alive))
        } else if placement == SessionPlacement::LeastLoaded {
            // New, moving, or unknown here (this one gateway restarted or
            // forgot it: no order tells where it was): the open replica with
            // the fewest sessions lately (a turn under way counts 1, an idle
            // session fades: `SessionsHere`); when none is open, the alive
            // one with the fewest; ties in the key's order. (Falling back to
            // the key's order when all were shut piled sessions up by the
            // draw of their keys on a saturated pool: at 32 agentic sessions
            // on 2 prefill replicas, 8-10 apart; docs/benchmarks-log.md.)
            let sessions: Vec<f64> = views
                .iter()
                .map(|v| v.memory.sessions.lock().weight(ctx.now))
                .collect();
            let shut = |i: usize| views[i].blocked != Blocked::No || behind(i);
            order.iter().copied().filter(alive).min_by(|&a, &b| {
                shut(a)
                    .cmp(&shut(b))
                    .then(sessions[a].total_cmp(&sessions[b]))
            })
        } else {
            // New, moving, or placed by another gateway: the first replica
            // alive in the key's order, whatever its pressure. Every gateway
            // computes the same one at any time, so a session sent through
            // several gateways stays whole without shared state. (Skipping
            // pressed replicas here made gateways disagree: pressure changes
            // between two turns, and a gateway meeting a session under way
            // cannot know what its first gateway saw. Through three gateways
            // behind a round-robin balancer, on an overloaded fleet, 10-17%
            // of the turns went to another replica and re-prefilled their
            // history; docs/benchmarks-log.md.)
            order.iter().copied().find(alive)
        }?;
        let reason = match here {
            // Placed where it was after all (no open replica in its
            // placement's reach): its history may be there yet.
            Some(i) if i == first && views[i].blocked != Blocked::Stale => {
                return Some(Home {
                    index: i,
                    reason: RouteReason::Session,
                    history,
                    moved: false,
                });
            }
            Some(i) if lost(i) => {
                if !prefill_leg {
                    left_lately.place(s.key, &candidates[first].name, ctx.now);
                }
                RouteReason::Rehome
            }
            Some(i) if views[i].blocked != Blocked::Stale && regather(i) => {
                by_pressure.forget(s.key);
                RouteReason::Rehome
            }
            Some(i) if views[i].blocked != Blocked::No => views[i].blocked.spill(),
            _ => RouteReason::SessionNew,
        };
        if auto && ctx.alone {
            // Placed off its key's first replica alive by pressure: noted,
            // to go back there once another sender shows (above).
            if order.iter().copied().find(alive) != Some(first) {
                any_by_pressure.store(true, std::sync::atomic::Ordering::Relaxed);
                by_pressure.place(s.key, &candidates[first].name, ctx.now);
            } else if any_by_pressure.load(std::sync::atomic::Ordering::Relaxed) {
                by_pressure.forget(s.key);
            }
        }
        let moved = known.is_some();
        // A session that continues and is unknown here was placed there by
        // another gateway: its history is there too (not so when placed by
        // load: nothing says where its history is).
        let by_key = placement == SessionPlacement::Rendezvous;
        let history = if known.is_none() && by_key {
            history
        } else {
            0
        };
        Some(Home {
            index: first,
            reason,
            history,
            moved,
        })
    }

    /// Load the lines of the tables this decision reads and writes: each
    /// candidate's prefix sets, the session's set, and the set of the
    /// prompt's home prefix (where `forward` records the replica it went
    /// to). These are megabytes, and a new prompt's lines are rarely
    /// cached. The loads do not depend on one another, so their misses
    /// overlap; read in turn, each would wait for the one before, since a
    /// lock's atomic instruction waits for every load issued before it.
    /// Called after the views, whose reference counts are such instructions.
    fn warm(&self, ctx: &RouteCtx<'_>, views: &[View]) {
        if !ctx.hashes.is_empty() {
            // A bounded number of lines over all candidates (at least the
            // first two levels of each one's search).
            let limit = (WARM_BUDGET / views.len().max(1)).max(3);
            for v in views {
                v.memory.prefixes.warm(ctx.hashes, limit);
            }
        }
        if let Some(s) = ctx.session {
            self.affinity.sessions.warm(s.key);
        }
        if let Some(home) = self.home_key(ctx.hashes) {
            self.affinity.home_prefixes.warm(home);
        }
    }

    /// The hash of a prompt's home prefix: its `home_blocks`-th block, or
    /// the last of a shorter prompt (`None`: no block).
    fn home_key(&self, hashes: &[u64]) -> Option<u64> {
        super::shared_table::home_key(hashes, self.cfg.home_blocks)
    }

    /// The home of a request by its prompt's prefix: a replica this
    /// gateway already sent the prefix to, first in the prefix's rendezvous
    /// order, while it is open and within its bounded load. Otherwise (a
    /// prefix new here, or its holders pressed or past their bound) a new
    /// home: the less busy of the first two open replicas within their bound
    /// in that order ([`place`]), so cold prefills spread instead of queueing
    /// on one replica, and a prefix that outgrows its home gets a second one.
    /// A prompt shorter than a block has no prefix to keep: the least busy
    /// open replica.
    fn prefix_home(&self, ctx: &RouteCtx<'_>, candidates: &[ReplicaView], views: &[View]) -> Home {
        let c = &self.cfg;
        let n = candidates.len();
        let key = self
            .home_key(ctx.hashes)
            // Shorter than a block: the model alone orders the replicas.
            .unwrap_or_else(|| xxh3_64_with_seed(ctx.model.as_bytes(), 0));
        let ranked = order(key, candidates);
        let limits = Limits::of(ctx, c, views);
        let open = |i: usize| views[i].blocked == Blocked::No;
        let within = |i: usize| limits.within(views, i);
        let home_len = c.home_blocks.min(ctx.hashes.len());
        // The shared table's home of a prefix no candidate holds here
        // (`routing::shared_table`): held there, as if this gateway had
        // placed it.
        let table = ctx.shared_home.and_then(|h| {
            Some((
                candidates.iter().position(|c| *c.name == *h.replica)?,
                h.new,
            ))
        });

        // Of the replicas holding it (a prefix that outgrew one home has
        // two), the least loaded, as a new key would be placed. A holder
        // whose engine queues, whose seats are all taken, or which preempts
        // keeps its prefix (as a session's replica keeps its session); it
        // only gets no new keys. Sending the prefix elsewhere costs its whole
        // prompt's prefill and KV there, to spare the home the few blocks of
        // a question and an answer; on caches too small for the fleet's
        // prefixes such moves evicted each other's prefixes in turn (hit
        // rates of 0.38-0.87 and seconds of TTFT in the matrix's tight-cache
        // cell). Its bounded load still moves a prefix that outgrows it (a
        // detour by predicted TTFT serves one request elsewhere, and to a
        // replica holding less of it only once its engine says it is full).
        let held = |i: usize| {
            home_len > 0 && (views[i].matched >= home_len || table.is_some_and(|(t, _)| t == i))
        };
        let keeps = |i: usize| views[i].blocked != Blocked::Stale;
        // A prefix outgrows its home when the home's engine says so (it
        // queues, or its seats are all taken) and the home carries more than
        // its bounded load: a holder that still batches everything it gets
        // keeps it, however many requests it has in flight. A second home
        // costs a cold prefill and, on a cache that is full, evicts another
        // prefix there, which then misses and is prefilled again; in the
        // matrix's tight-cache cell such moves for in-flight counts alone
        // cascaded into seconds of TTFT.
        let pressed = |i: usize| views[i].blocked != Blocked::No || views[i].pressed != Blocked::No;
        let outgrown = |i: usize| pressed(i) && !within(i);
        // A holder whose engine keeps evicting what it was sent (its cached
        // tokens fell short of the index's lately), while it holds at least
        // two prompts more than the open replica holding the fewest, has
        // more prompts than its cache keeps: the prefix moves to a new home
        // and is forgotten here. Only then: on a fleet whose caches are all
        // too small, or balanced, moving on every shortfall moved prompts
        // in turn (each move a cold prefill that evicts another prompt
        // there; `many_keys`: 2.2x the new homes, warm p99 6.5x). Each move
        // makes the holder hold one fewer, so they stop by themselves.
        let evicting = |i: usize| held(i) && views[i].memory.load.evicting.get(ctx.now) > 0;
        let listed = (0..n).any(evicting).then(|| sizes(views));
        let prompts = |s: &[f64], i: usize| (s[i] / ctx.hashes.len().max(1) as f64).round();
        let crowded = |i: usize| {
            listed.as_deref().is_some_and(|s| {
                evicting(i) && (0..n).any(|j| open(j) && prompts(s, j) + 2.0 <= prompts(s, i))
            })
        };
        // A decode leg leaves the holder for a replica generating fewer
        // streams (`Limits::fewest`).
        let uneven = |i: usize| limits.uneven(views, i);
        if let Some(i) = place(&ranked, views, ctx.prompt_tokens, None, |i| {
            held(i) && keeps(i) && !outgrown(i) && !crowded(i) && !uneven(i)
        }) {
            // Placed by the table for this request: a new home.
            let reason = match table {
                Some((t, true)) if t == i => RouteReason::PrefixNew,
                _ => RouteReason::Affinity,
            };
            return Home {
                index: i,
                reason,
                history: 0,
                moved: false,
            };
        }
        // Why the prefix's home could not keep it.
        let reason = match ranked.iter().copied().find(|&i| held(i)) {
            Some(h) if crowded(h) => RouteReason::Rehome,
            Some(h) if keeps(h) => RouteReason::SpillLoad,
            Some(h) => views[h].blocked.spill(),
            None if home_len == 0 => RouteReason::LeastLoaded,
            None => RouteReason::PrefixNew,
        };
        // A new home balances what the replicas hold: the prefix blocks this
        // gateway sent each (the prefixes placed there, and the traffic
        // they bring), as a router that sees every prompt balances its
        // trees. Read only here and for a holder that evicted lately: both
        // are rare events. A prompt
        // shorter than a block has nothing to keep: the least work.
        let fresh;
        let blocks: &[f64] = match &listed {
            _ if home_len == 0 => &[],
            Some(s) => s,
            None => {
                fresh = sizes(views);
                &fresh
            }
        };
        let held_blocks = (home_len > 0).then_some((blocks, ctx.hashes.len()));
        let prompt = ctx.prompt_tokens;
        let index = place(&ranked, views, prompt, held_blocks, |i| {
            open(i) && within(i) && !uneven(i)
        })
        .or_else(|| place(&ranked, views, prompt, held_blocks, open))
        .unwrap_or(ranked[0]);
        if reason == RouteReason::Rehome {
            for (i, v) in views.iter().enumerate() {
                if i != index && crowded(i) {
                    v.memory.prefixes.forget(&ctx.hashes[..v.matched]);
                }
            }
        }
        Home {
            index,
            reason,
            history: 0,
            moved: false,
        }
    }

    /// The decision for candidate `index`: the prompt's blocks go into its
    /// index; the cache expected there is reported for the closed loop.
    #[allow(clippy::too_many_arguments)]
    fn decide(
        &self,
        ctx: &RouteCtx<'_>,
        views: &[View],
        index: usize,
        reason: RouteReason,
        history: u32,
        moved: bool,
        detoured: bool,
    ) -> Decision {
        let v = &views[index];
        let tpb = self.tokens_per_block();
        let cached = (v.matched as u32 * tpb)
            .max(history)
            .min(ctx.prompt_tokens.saturating_sub(1));
        // The prompt's blocks go into the index of the replica it went to,
        // which makes that replica a holder of its prefix, except after a
        // detour to a replica that did not hold it: one request served
        // elsewhere for its wait (whatever kept it from its home) is not a
        // second home. (A second home on a full cache evicts another prefix there,
        // which then misses and is prefilled again; in the matrix's tight
        // cells detours made homes that evicted each other in turn.)
        if !ctx.hashes.is_empty() && !detoured {
            v.memory.prefixes.insert(ctx.hashes);
        }
        v.memory.load.routed.add(ctx.now);
        // A session counted here by `least_loaded` counts whole while its
        // turn runs (not after a detour: it is counted at its home).
        let counted_session = ctx
            .session
            .filter(|_| !detoured && self.placement(ctx) == SessionPlacement::LeastLoaded)
            .map(|s| s.key);
        Decision {
            index,
            reason,
            moved,
            cached_tokens: cached,
            matched_blocks: v.matched,
            counted_session,
            // Served where its history is credited (not a detour, a move or
            // a new placement, where its blocks were just sent).
            continuing: history > 0 && !detoured,
            // (Set by `pick`.)
            by_prefix: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering::Relaxed;
    use std::time::Instant;

    use super::*;
    use crate::routing::affinity::SETTLE;
    use crate::routing::least_loaded::LeastLoaded;
    use crate::routing::{LoadView, SessionKey};

    fn replicas(n: usize) -> Vec<ReplicaView> {
        (0..n)
            .map(|i| ReplicaView {
                name: Arc::from(format!("10.0.0.{i}:8000")),
                in_flight: 0,
                load: Some(sample(0.1, 0.0)),
                tpot: None,
                full: false,
            })
            .collect()
    }

    fn sample(kv: f64, waiting: f64) -> LoadView {
        LoadView {
            kv_usage: Some(kv),
            waiting: Some(waiting),
            queue: Some(waiting),
            running: Some(1.0),
            queued: waiting >= 1.0,
            preempting: false,
            at: Instant::now(),
        }
    }

    fn policy() -> PrefixKv {
        PrefixKv::new(
            PrefixKvConfig::default(),
            Some(Duration::from_secs(5)),
            Affinity::new(
                1024,
                (64, Duration::from_secs(60)),
                (64, Duration::from_secs(60)),
            ),
        )
    }

    fn pick(p: &PrefixKv, reps: &[ReplicaView], hashes: &[u64]) -> Decision {
        pick_leg(p, reps, hashes, false)
    }

    fn pick_leg(p: &PrefixKv, reps: &[ReplicaView], hashes: &[u64], decode_leg: bool) -> Decision {
        let ctx = RouteCtx {
            model: "m",
            hashes,
            session: None,
            prompt_tokens: 1000,
            tail_tokens: 0,
            decode_leg,
            session_placement: None,
            alone: false,
            shared_home: None,
            now: Instant::now(),
        };
        p.pick(&ctx, reps)
            .unwrap_or(Decision::plain(usize::MAX, RouteReason::Retry))
    }

    /// Uncached prompt tokens this gateway has sent to `r`, not yet at
    /// their first token.
    fn set_backlog(p: &PrefixKv, r: &ReplicaView, n: u64) {
        p.affinity
            .of(&r.name, Instant::now())
            .load
            .backlog
            .store(n, Relaxed)
    }

    /// A policy placing new sessions by `placement`.
    fn placing(placement: SessionPlacement) -> PrefixKv {
        let cfg = PrefixKvConfig {
            session_placement: placement,
            ..PrefixKvConfig::default()
        };
        let t = (64, Duration::from_secs(60));
        PrefixKv::new(cfg, Some(Duration::from_secs(5)), Affinity::new(1024, t, t))
    }

    /// A turn of session `key` with an id.
    fn session_turn(key: u64, continuing: bool, now: Instant) -> RouteCtx<'static> {
        RouteCtx {
            model: "m",
            hashes: &[1, 2, 3],
            session: Some(SessionKey {
                key,
                explicit: true,
                continuing,
            }),
            prompt_tokens: 1000,
            tail_tokens: 10,
            decode_leg: false,
            session_placement: None,
            alone: false,
            shared_home: None,
            now,
        }
    }

    /// `reps` with their scrapes taken at `at`.
    fn scraped_at(reps: &[ReplicaView], at: Instant) -> Vec<ReplicaView> {
        let mut reps = reps.to_vec();
        for l in reps.iter_mut().filter_map(|r| r.load.as_mut()) {
            l.at = at;
        }
        reps
    }

    #[test]
    fn least_loaded_placement_starts_sessions_where_fewest_went() {
        let reps = replicas(4);
        let p = placing(SessionPlacement::LeastLoaded);
        let t0 = Instant::now();
        let turn = |key: u64, continuing: bool, at: Duration| {
            p.pick(
                &session_turn(key, continuing, t0 + at),
                &scraped_at(&reps, t0 + at),
            )
            .unwrap()
        };
        // Four new sessions take the four replicas, one each.
        let first: Vec<usize> = (0..4u64)
            .map(|k| turn(k, false, Duration::ZERO).index)
            .collect();
        let mut seen = first.clone();
        seen.sort_unstable();
        assert_eq!(seen, [0, 1, 2, 3], "{first:?}");
        // Session 0 keeps turning, every second, on its replica; the others
        // went quiet. Ten seconds on, the next three new sessions (two turns
        // each) avoid session 0's replica, whatever their keys' order says.
        for s in 1..=10 {
            assert_eq!(turn(0, true, Duration::from_secs(s)).index, first[0]);
        }
        let at = Duration::from_secs(10);
        let mut next: Vec<usize> = (100..103u64)
            .map(|key| {
                let d = turn(key, false, at);
                assert_eq!(d.reason, RouteReason::SessionNew);
                // Its own next turn stays on it.
                assert_eq!(turn(key, true, at).index, d.index);
                d.index
            })
            .collect();
        next.sort_unstable();
        let mut others: Vec<usize> = first[1..].to_vec();
        others.sort_unstable();
        assert_eq!(next, others);
        // One session counts once however fast it turns: replica 1 with two
        // sessions turning every 5 s is busier than replica 0 with one
        // turning every second and one gone quiet (counted by turns, 10
        // against 4, replica 1 would look the less loaded).
        let p = placing(SessionPlacement::LeastLoaded);
        let reps = replicas(2);
        let turn = |key: u64, continuing: bool, at: Duration| {
            p.pick(
                &session_turn(key, continuing, t0 + at),
                &scraped_at(&reps, t0 + at),
            )
            .unwrap()
        };
        let mut on: [Vec<u64>; 2] = [vec![], vec![]];
        for key in 0..4u64 {
            on[turn(key, false, Duration::ZERO).index].push(key);
        }
        // Two each; replica 0's turn every second, replica 1's every 5 s,
        // and replica 0 loses a session.
        for s in 1..=10u64 {
            turn(on[0][0], true, Duration::from_secs(s));
            if s % 5 == 0 {
                for &k in &on[1] {
                    turn(k, true, Duration::from_secs(s));
                }
            }
        }
        assert_eq!(turn(1000, false, Duration::from_secs(10)).index, 0);
    }

    #[test]
    fn least_loaded_placement_spreads_sessions_when_every_replica_is_shut() {
        // Every engine full: new sessions still go where fewest went, not
        // where their keys' order starts (eight keys that all start on
        // replica 0 take the four replicas two each), and their next turns
        // wait there, where their histories are.
        let mut reps = replicas(4);
        for r in &mut reps {
            r.full = true;
        }
        let p = placing(SessionPlacement::LeastLoaded);
        let now = Instant::now();
        let keys: Vec<u64> = (0..10_000u64)
            .filter(|&k| order(k, &reps)[0] == 0)
            .take(8)
            .collect();
        let mut on = [0; 4];
        let homes: Vec<usize> = keys
            .iter()
            .map(|&k| {
                let d = p.pick(&session_turn(k, false, now), &reps).unwrap();
                assert_eq!(d.reason, RouteReason::SessionNew);
                on[d.index] += 1;
                d.index
            })
            .collect();
        assert_eq!(on, [2, 2, 2, 2]);
        for (&k, &home) in keys.iter().zip(&homes) {
            let d = p.pick(&session_turn(k, true, now), &reps).unwrap();
            assert_eq!((d.index, d.reason), (home, RouteReason::Session));
        }
    }

    #[test]
    fn a_session_leaves_a_replica_that_queues_and_keeps_evicting_where_nobody_else_looks() {
        // A disaggregated prefill leg: it brings its own placement.
        let leg = |key: u64, continuing: bool, now: Instant| RouteCtx {
            session_placement: Some(SessionPlacement::LeastLoaded),
            alone: false,
            ..session_turn(key, continuing, now)
        };
        let evicting = |p: &PrefixKv, r: &ReplicaView, now: Instant| {
            p.affinity.of(&r.name, now).load.evicting.add(now);
        };
        // Prompt tokens this gateway sent there whose prefill is pending.
        let ahead = |p: &PrefixKv, r: &ReplicaView, tokens: u64| {
            p.affinity
                .of(&r.name, Instant::now())
                .load
                .backlog
                .fetch_add(tokens, Relaxed);
        };
        // A session placed by `first`, whose replica then queues, evicts and
        // has 20,000 prompt tokens pending; that replica.
        let lost_home = |p: &PrefixKv, first: &RouteCtx<'_>, reps: &mut [ReplicaView]| {
            let home = p.pick(first, reps).unwrap().index;
            evicting(p, &reps[home], first.now);
            ahead(p, &reps[home], 20_000);
            reps[home].load = Some(sample(0.5, 4.0));
            home
        };
        let p = placing(SessionPlacement::Rendezvous);
        let now = Instant::now();
        let mut reps = replicas(2);
        let home = p.pick(&leg(7, false, now), &reps).unwrap().index;
        let other = 1 - home;
        let turn = |reps: &[ReplicaView]| p.pick(&leg(7, true, now), reps).unwrap();
        // Its engine queues: the session waits there, its history is there.
        reps[home].load = Some(sample(0.5, 4.0));
        let d = turn(&reps);
        assert_eq!((d.index, d.reason), (home, RouteReason::Session));
        // It also evicted what it was sent lately: placed anew, on the open
        // replica (fewer prompt tokens ahead there), and its next turns
        // follow it there.
        evicting(&p, &reps[home], now);
        ahead(&p, &reps[home], 20_000);
        let d = turn(&reps);
        assert_eq!(
            (d.index, d.reason, d.moved),
            (other, RouteReason::Rehome, true)
        );
        // Nothing of its history is credited where it lands.
        assert_eq!(d.cached_tokens, 0);
        let d = turn(&replicas(2));
        assert_eq!((d.index, d.reason), (other, RouteReason::Session));
        // Nor for an open replica with more ahead of it (sessions that
        // left before this one): there the whole prompt waits longer.
        let q = placing(SessionPlacement::Rendezvous);
        let mut reps = replicas(2);
        let home = q.pick(&leg(7, false, now), &reps).unwrap().index;
        reps[home].load = Some(sample(0.5, 4.0));
        evicting(&q, &reps[home], now);
        ahead(&q, &reps[home], 20_000);
        ahead(&q, &reps[1 - home], 30_000);
        let d = q.pick(&leg(7, true, now), &reps).unwrap();
        assert_eq!((d.index, d.reason), (home, RouteReason::Session));
        // Of three, it goes where fewer tokens wait, not where fewer
        // sessions are.
        let q = placing(SessionPlacement::Rendezvous);
        let mut reps = replicas(3);
        let home = q.pick(&leg(7, false, now), &reps).unwrap().index;
        let (busy, free) = ((home + 1) % 3, (home + 2) % 3);
        reps[home].load = Some(sample(0.5, 4.0));
        evicting(&q, &reps[home], now);
        ahead(&q, &reps[home], 20_000);
        ahead(&q, &reps[busy], 30_000);
        q.affinity
            .of(&reps[free].name, now)
            .sessions
            .lock()
            .begin(99);
        let d = q.pick(&leg(7, true, now), &reps).unwrap();
        assert_eq!((d.index, d.reason), (free, RouteReason::Rehome));
        // Evicting but not queued, or queued with nowhere open: it stays.
        let q = placing(SessionPlacement::Rendezvous);
        let mut reps = replicas(2);
        let home = q.pick(&leg(7, false, now), &reps).unwrap().index;
        evicting(&q, &reps[home], now);
        let d = q.pick(&leg(7, true, now), &reps).unwrap();
        assert_eq!((d.index, d.reason), (home, RouteReason::Session));
        for r in &mut reps {
            r.full = true;
        }
        let d = q.pick(&leg(7, true, now), &reps).unwrap();
        assert_eq!((d.index, d.reason), (home, RouteReason::Session));
        // Nor for a replica open only by this gateway's seats: its engine
        // queues too.
        reps[1 - home].full = false;
        reps[1 - home].load = Some(sample(0.5, 4.0));
        let d = q.pick(&leg(7, true, now), &reps).unwrap();
        assert_eq!((d.index, d.reason), (home, RouteReason::Session));
        // A request of a mixed fleet stays, whatever its placement (its
        // decode and KV would move with it, and another gateway may look
        // for it there); so does a leg placed by its key's order, which
        // would put it back. Under `auto` while this gateway is the
        // engines' only sender, a mixed fleet's session leaves too.
        for (placement, own, alone, leaves) in [
            (SessionPlacement::LeastLoaded, None, false, false),
            (SessionPlacement::FirstOpen, None, false, false),
            (SessionPlacement::FirstOpen, None, true, false),
            (SessionPlacement::Auto, None, false, false),
            (SessionPlacement::Auto, None, true, true),
            (
                SessionPlacement::Rendezvous,
                Some(SessionPlacement::Rendezvous),
                false,
                false,
            ),
        ] {
            let r = placing(placement);
            let turn = |continuing: bool| RouteCtx {
                session_placement: own,
                alone,
                ..session_turn(7, continuing, now)
            };
            let mut reps = replicas(2);
            let home = lost_home(&r, &turn(false), &mut reps);
            let d = r.pick(&turn(true), &reps).unwrap();
            let want = if leaves {
                (1 - home, RouteReason::Rehome)
            } else {
                (home, RouteReason::Session)
            };
            assert_eq!((d.index, d.reason), want, "{placement:?} alone {alone}");
        }
        // Alone, a mixed fleet's session leaves only for a replica with at
        // most half this gateway's requests in flight at its home.
        let r = placing(SessionPlacement::Auto);
        let turn = |continuing: bool| RouteCtx {
            alone: true,
            ..session_turn(7, continuing, now)
        };
        let mut reps = replicas(2);
        let home = lost_home(&r, &turn(false), &mut reps);
        reps[home].in_flight = 4;
        reps[1 - home].in_flight = 3;
        let d = r.pick(&turn(true), &reps).unwrap();
        assert_eq!((d.index, d.reason), (home, RouteReason::Session));
        reps[1 - home].in_flight = 2;
        // (A disaggregated decode leg is not this rule's.)
        let leg = RouteCtx {
            decode_leg: true,
            ..turn(true)
        };
        assert_ne!(r.pick(&leg, &reps).unwrap().reason, RouteReason::Rehome);
        let d = r.pick(&turn(true), &reps).unwrap();
        assert_eq!((d.index, d.reason), (1 - home, RouteReason::Rehome));
    }

    #[test]
    fn a_session_that_left_a_replica_that_lost_its_history_stays_where_it_went_for_a_while() {
        // Alone under `auto`, with sessions remembered longer than `SETTLE`.
        let cfg = PrefixKvConfig {
            session_placement: SessionPlacement::Auto,
            ..PrefixKvConfig::default()
        };
        let t = (64, Duration::from_secs(600));
        let p = PrefixKv::new(cfg, Some(Duration::from_secs(5)), Affinity::new(1024, t, t));
        let turn = |continuing: bool, now: Instant| RouteCtx {
            alone: true,
            ..session_turn(7, continuing, now)
        };
        // At `now` replica `i`'s engine queues, it evicted lately, and
        // `tokens` more prompt tokens are pending there; or it is open.
        let lose = |reps: &mut [ReplicaView], i: usize, tokens: u64, now: Instant| {
            let m = p.affinity.of(&reps[i].name, now);
            m.load.evicting.add(now);
            m.load.backlog.fetch_add(tokens, Relaxed);
            reps[i].load = Some(LoadView {
                at: now,
                ..sample(0.5, 4.0)
            });
            reps[i].in_flight = 4;
        };
        let open = |reps: &mut [ReplicaView], i: usize, now: Instant| {
            reps[i].load = Some(LoadView {
                at: now,
                ..sample(0.1, 0.0)
            });
            reps[i].in_flight = 0;
        };
        let now = Instant::now();
        let mut reps = replicas(2);
        let home = p.pick(&turn(false, now), &reps).unwrap().index;
        let other = 1 - home;
        lose(&mut reps, home, 20_000, now);
        let d = p.pick(&turn(true, now), &reps).unwrap();
        assert_eq!((d.index, d.reason), (other, RouteReason::Rehome));
        // Where it went loses its history in turn a moment later, while the
        // replica it left is open again with less ahead: it stays.
        let soon = now + Duration::from_secs(5);
        lose(&mut reps, other, 40_000, soon);
        open(&mut reps, home, soon);
        let d = p.pick(&turn(true, soon), &reps).unwrap();
        assert_eq!((d.index, d.reason), (other, RouteReason::Session));
        // Once it has stayed there for `SETTLE`, it may leave again.
        let later = now + SETTLE + Duration::from_secs(1);
        lose(&mut reps, other, 0, later);
        open(&mut reps, home, later);
        let d = p.pick(&turn(true, later), &reps).unwrap();
        assert_eq!((d.index, d.reason), (home, RouteReason::Rehome));
    }

    #[test]
    fn a_requests_own_placement_overrides_the_policys() {
        // The policy places by key; a disaggregated prefill leg says least
        // loaded: its new sessions spread one a replica whatever their keys.
        let reps = replicas(4);
        let p = placing(SessionPlacement::Rendezvous);
        let now = Instant::now();
        let leg = |key: u64| RouteCtx {
            session_placement: Some(SessionPlacement::LeastLoaded),
            alone: false,
            ..session_turn(key, false, now)
        };
        // Keys whose rendezvous order starts on one replica: by key, all there.
        let same: Vec<u64> = (0..1000u64)
            .filter(|&k| order(k, &reps)[0] == 0)
            .take(4)
            .collect();
        assert!(
            same.iter()
                .all(|&k| p.pick(&session_turn(k, false, now), &reps).unwrap().index == 0)
        );
        let p = placing(SessionPlacement::Rendezvous);
        let mut spread: Vec<usize> = same
            .iter()
            .map(|&k| p.pick(&leg(k), &reps).unwrap().index)
            .collect();
        spread.sort_unstable();
        assert_eq!(spread, [0, 1, 2, 3]);
    }

    #[test]
    fn first_open_placement_starts_sessions_past_pressed_replicas_in_key_order() {
        let mut reps = replicas(4);
        let p = placing(SessionPlacement::FirstOpen);
        let now = Instant::now();
        let ctx = |key: u64, continuing: bool| session_turn(key, continuing, now);
        // Each key's first replica in its order queues (its engine says so
        // across scrapes): the key's second replica takes it instead.
        for key in 0..16u64 {
            let o = order(key, &reps);
            for (i, r) in reps.iter_mut().enumerate() {
                r.load = Some(sample(0.1, if i == o[0] { 20.0 } else { 0.0 }));
            }
            let d = p.pick(&ctx(key, false), &reps).unwrap();
            assert_eq!(d.index, o[1], "key {key}");
            assert_eq!(d.reason, RouteReason::SessionNew);
            // Its next turn stays there once the first is free again.
            for r in reps.iter_mut() {
                r.load = Some(sample(0.1, 0.0));
            }
            assert_eq!(p.pick(&ctx(key, true), &reps).unwrap().index, o[1]);
        }
        // Every replica queued: the first in the key's order.
        for r in reps.iter_mut() {
            r.load = Some(sample(0.1, 20.0));
        }
        let o = order(99, &reps);
        assert_eq!(p.pick(&ctx(99, false), &reps).unwrap().index, o[0]);
    }

    #[test]
    fn auto_placement_starts_sessions_past_pressed_replicas_only_while_alone() {
        let mut reps = replicas(4);
        let p = placing(SessionPlacement::Auto);
        let now = Instant::now();
        for key in 0..16u64 {
            let o = order(key, &reps);
            for (i, r) in reps.iter_mut().enumerate() {
                r.load = Some(sample(0.1, if i == o[0] { 20.0 } else { 0.0 }));
            }
            // In company: the key's first, whatever its pressure.
            let d = p.pick(&session_turn(key, false, now), &reps).unwrap();
            assert_eq!(d.index, o[0], "key {key}");
            // Alone: past it (a new key: the first is remembered).
            let alone = RouteCtx {
                alone: true,
                ..session_turn(key + 1000, false, now)
            };
            let o = order(key + 1000, &reps);
            for (i, r) in reps.iter_mut().enumerate() {
                r.load = Some(sample(0.1, if i == o[0] { 20.0 } else { 0.0 }));
            }
            assert_eq!(p.pick(&alone, &reps).unwrap().index, o[1], "key {key}");
            // Its next turn stays there while the gateway is alone...
            let next = RouteCtx {
                alone: true,
                ..session_turn(key + 1000, true, now)
            };
            assert_eq!(p.pick(&next, &reps).unwrap().index, o[1]);
            // ...and goes back to the key's first once another sender shows
            // (where the other gateways send it), then stays.
            let next = session_turn(key + 1000, true, now);
            let d = p.pick(&next, &reps).unwrap();
            assert_eq!(
                (d.index, d.reason),
                (o[0], RouteReason::Rehome),
                "key {key}"
            );
            assert_eq!(p.pick(&next, &reps).unwrap().index, o[0]);
        }
    }

    #[test]
    fn two_choices_placement_keeps_new_sessions_within_the_keys_first_two() {
        let mut reps = replicas(4);
        let now = Instant::now();
        let ctx = |key: u64| session_turn(key, false, now);
        for key in 0..16u64 {
            let o = order(key, &reps);
            // The key's first queues: its second takes the session.
            for (i, r) in reps.iter_mut().enumerate() {
                r.load = Some(sample(0.1, if i == o[0] { 20.0 } else { 0.0 }));
            }
            let p = placing(SessionPlacement::TwoChoices);
            let d = p.pick(&ctx(key), &reps).unwrap();
            assert_eq!(d.index, o[1], "key {key}");
            assert_eq!(d.reason, RouteReason::SessionNew);
            // Its first two queue, the other two are open: still one of its
            // two (first_open would send it to its third), the one with the
            // shorter queue.
            for (i, r) in reps.iter_mut().enumerate() {
                let waiting = if i == o[0] {
                    30.0
                } else if i == o[1] {
                    20.0
                } else {
                    0.0
                };
                r.load = Some(sample(0.1, waiting));
            }
            let p = placing(SessionPlacement::TwoChoices);
            assert_eq!(p.pick(&ctx(key), &reps).unwrap().index, o[1], "key {key}");
            // Every replica queued alike: the key's first.
            for r in reps.iter_mut() {
                r.load = Some(sample(0.1, 20.0));
            }
            let p = placing(SessionPlacement::TwoChoices);
            assert_eq!(p.pick(&ctx(key), &reps).unwrap().index, o[0], "key {key}");
        }
    }

    #[test]
    fn independent_gateways_agree_and_prefixes_spread() {
        let (mut a, mut b) = (replicas(4), replicas(4));
        // The same scrapes: the engines' queues are uneven (queues no
        // longer than a scrape, so no replica is pressed).
        for (i, waiting) in [30.0, 0.0, 50.0, 10.0].into_iter().enumerate() {
            let s = LoadView {
                queued: false,
                ..sample(0.1, waiting)
            };
            a[i].load = Some(s);
            b[i].load = Some(s);
        }
        let (pa, pb) = (policy(), policy());
        let mut used = std::collections::HashSet::new();
        let mut homes = [0; 4];
        for key in 0..12u64 {
            let h = [key, key + 1000];
            let da = pick(&pa, &a, &h);
            let db = pick(&pb, &b, &h);
            assert_eq!(da.index, db.index, "prefix {key}");
            assert_eq!(da.reason, RouteReason::PrefixNew);
            homes[da.index] += 1;
            if key == 0 {
                // Nothing held anywhere yet: the shortest queue.
                assert_eq!(da.index, 1);
            }
            // Its next request goes where this one went, whatever the load.
            for p in [&pa, &pb] {
                let again = pick(p, &a, &h);
                assert_eq!(
                    (again.index, again.reason),
                    (da.index, RouteReason::Affinity)
                );
            }
        }
        // New homes go where least is held: three prefixes each.
        assert_eq!(homes, [3; 4]);
        // On an even fleet, hashing alone spreads the prefixes.
        let even = replicas(4);
        for key in 100..140u64 {
            used.insert(pick(&pa, &even, &[key, key + 1000]).index);
        }
        assert_eq!(used.len(), 4, "40 prefixes use all 4 replicas: {used:?}");
    }

    #[test]
    fn cold_prefills_spread_where_hashing_alone_piles_them() {
        // 16 new prefixes arrive before any is served: each one's request
        // occupies the replica it went to.
        let spread = |load_aware: bool| {
            let mut reps = replicas(4);
            let p = policy();
            let mut per = [0u32; 4];
            for key in 0..16u64 {
                let h = [key * 7919, key * 7919 + 1];
                let i = if load_aware {
                    pick(&p, &reps, &h).index
                } else {
                    order(h[1], &reps)[0]
                };
                per[i] += 1;
                reps[i].in_flight += 1;
            }
            per
        };
        let hashed = spread(false);
        let placed = spread(true);
        let gap = |p: [u32; 4]| p.iter().max().unwrap_or(&0) - p.iter().min().unwrap_or(&0);
        // Fixed keys: rendezvous alone puts them 7/3/3/3 here.
        let most = |p: [u32; 4]| p.iter().copied().max().unwrap_or(0);
        // Fixed keys: rendezvous alone puts them 3/6/6/1 here; the less busy
        // of two choices, 4/4/5/3.
        assert!(gap(hashed) >= 4, "{hashed:?} {placed:?}");
        assert!(gap(placed) <= 2, "{placed:?} (hashing alone: {hashed:?})");
        assert!(most(placed) <= 5, "{placed:?}");
    }

    #[test]
    fn a_new_prefix_goes_where_less_is_held_then_less_traffic_went() {
        let reps = replicas(2);
        let p = policy();
        // A busy prefix: its home has served 20 requests lately.
        let hot = [1, 2];
        let home = pick(&p, &reps, &hot).index;
        for _ in 0..19 {
            assert_eq!(pick(&p, &reps, &hot).index, home);
        }
        let other = 1 - home;
        // The first new prefix: the other holds nothing. The second: each
        // holds one prefix, the home carried the traffic. The third: the
        // other now holds two.
        let got: Vec<(usize, RouteReason)> = (10..13u64)
            .map(|key| {
                let d = pick(&p, &reps, &[key, key + 1]);
                (d.index, d.reason)
            })
            .collect();
        let new = RouteReason::PrefixNew;
        assert_eq!(got, [(other, new), (other, new), (home, new)]);
    }

    #[test]
    fn pressure_is_what_the_engine_says_and_spills() {
        let mut reps = replicas(3);
        let p = policy();
        let h = [7, 8, 9];
        let home = pick(&p, &reps, &h).index;
        // A KV cache near full is how engines run at full batch: no spill.
        reps[home].load = Some(sample(0.97, 0.0));
        let d = pick(&p, &reps, &h);
        assert_eq!((d.index, d.reason), (home, RouteReason::Affinity));
        // Preempting (out of blocks) while others are not: its prefix stays
        // (a move costs the whole prompt's KV elsewhere), new prefixes go
        // elsewhere (spill_kv when a prefix's home is taken from it).
        reps[home].load = Some(LoadView {
            preempting: true,
            ..sample(0.97, 0.0)
        });
        let d = pick(&p, &reps, &h);
        assert_eq!((d.index, d.reason), (home, RouteReason::Affinity));
        for key in 70..80u64 {
            assert_ne!(pick(&p, &reps, &[key, key + 1]).index, home, "{key}");
        }
        reps[home].load = Some(sample(0.1, 0.0));
        // A queue that outlived a scrape while others have none: the prefix
        // it holds stays (a cold prefill elsewhere costs more than a short
        // queue), new prefixes go elsewhere.
        let h = [17, 18, 19];
        let home = pick(&p, &reps, &h).index;
        reps[home].load = Some(sample(0.2, 2.0));
        let d = pick(&p, &reps, &h);
        assert_eq!((d.index, d.reason), (home, RouteReason::Affinity));
        for key in 50..60u64 {
            assert_ne!(
                pick(&p, &reps, &[key, key + 1, key + 2]).index,
                home,
                "{key}"
            );
        }
        // Every replica queued: none has room, the cache decides.
        for r in &mut reps {
            r.load = Some(sample(0.5, 3.0));
        }
        let d = pick(&p, &reps, &h);
        assert_eq!((d.index, d.reason), (home, RouteReason::Affinity));
        for r in &mut reps {
            r.load = Some(sample(0.1, 0.0));
        }
        let h = [27, 28, 29];
        let home = pick(&p, &reps, &h).index;
        let mut old = sample(0.1, 0.0);
        old.at = Instant::now() - Duration::from_secs(60);
        reps[home].load = Some(old);
        assert_eq!(pick(&p, &reps, &h).reason, RouteReason::SpillStale);
        reps[home].load = Some(sample(0.1, 0.0));
        let back = pick(&p, &reps, &h);
        assert_eq!((back.index, back.reason), (home, RouteReason::Affinity));
        for r in &mut reps {
            r.load = Some(old);
        }
        assert_eq!(pick(&p, &reps, &h).reason, RouteReason::Fallback);
    }

    #[test]
    fn an_operators_thresholds_still_stop_new_work() {
        let cfg = PrefixKvConfig {
            kv_high: Some(0.9),
            queue_high: Some(8.0),
            ..PrefixKvConfig::default()
        };
        let t = (64, Duration::from_secs(60));
        let p = PrefixKv::new(cfg, Some(Duration::from_secs(5)), Affinity::new(1024, t, t));
        let mut reps = replicas(3);
        let h = [1, 2, 3];
        let home = pick(&p, &reps, &h).index;
        // Past `kv_high`: its own prefix stays, new work goes elsewhere.
        reps[home].load = Some(sample(0.95, 0.0));
        assert_eq!(pick(&p, &reps, &h).index, home);
        for key in 30..40u64 {
            assert_ne!(pick(&p, &reps, &[key, key + 1]).index, home, "{key}");
        }
        let h = [4, 5, 6];
        let home = pick(&p, &reps, &h).index;
        reps[home].load = Some(LoadView {
            queued: false,
            ..sample(0.2, 9.0)
        });
        // Past `queue_high`: its own prefix stays (a short wait there beats
        // a cold prefill elsewhere), new work goes elsewhere.
        assert_eq!(pick(&p, &reps, &h).index, home);
        let d = pick(&p, &reps, &[40, 41, 42]);
        assert_ne!(d.index, home);
    }

    #[test]
    fn stale_metrics_count_as_saturated_for_least_loaded() {
        let mut reps = replicas(2);
        let ll = LeastLoaded::new(Some(Duration::from_secs(5)));
        let ctx = RouteCtx {
            model: "m",
            hashes: &[],
            session: None,
            prompt_tokens: 1000,
            tail_tokens: 0,
            decode_leg: false,
            session_placement: None,
            alone: false,
            shared_home: None,
            now: Instant::now(),
        };
        // Replica 0 is silent (stale) and idle; replica 1 is fresh with a queue.
        let mut old = sample(0.1, 0.0);
        old.at = Instant::now() - Duration::from_secs(60);
        reps[0].load = Some(old);
        reps[1].load = Some(sample(0.5, 30.0));
        for _ in 0..4 {
            assert_eq!(ll.pick(&ctx, &reps).map(|d| d.index), Some(1));
        }
        // Everything stale: in-flight decides.
        reps[1].load = Some(old);
        reps[1].in_flight = 1;
        assert_eq!(ll.pick(&ctx, &reps).map(|d| d.index), Some(0));
    }

    #[test]
    fn when_every_replica_is_full_the_prompt_waits_where_its_prefix_is() {
        let mut reps = replicas(2);
        let p = policy();
        let h = [90, 91, 92, 93];
        let home = pick(&p, &reps, &h).index;
        let other = 1 - home;
        // Every seat taken on both, and more of this gateway's requests on
        // the home: least work would send the prompt where nothing of it is
        // cached.
        for r in &mut reps {
            r.full = true;
        }
        reps[home].in_flight = 6;
        let d = pick(&p, &reps, &h);
        assert_eq!((d.index, d.reason), (home, RouteReason::Fallback));
        // Not for a disaggregated decode leg (the prediction is of a
        // prefill): least work.
        let d = pick_leg(&p, &reps, &h, true);
        assert_eq!((d.index, d.reason), (other, RouteReason::Fallback));
        // A prediction, not stickiness: a home with a long backlog to
        // prefill loses to the other's cold prefill.
        set_backlog(&p, &reps[home], 1_000_000);
        assert_eq!(pick(&p, &reps, &h).index, other);
        set_backlog(&p, &reps[home], 0);
        // A prompt no replica holds: least work, as seats balance best
        // (the other is predicted slower, and carries less).
        set_backlog(&p, &reps[other], 10);
        let d = pick(&p, &reps, &[200, 201]);
        assert_eq!((d.index, d.reason), (other, RouteReason::Fallback));
        // Nothing fresh: least work, however long the other's predicted
        // wait and whoever holds the prompt.
        set_backlog(&p, &reps[other], 1_000_000);
        let only_home = [300, 301, 302];
        p.affinity
            .of(&reps[home].name, Instant::now())
            .prefixes
            .insert(&only_home);
        let mut old = sample(0.1, 0.0);
        old.at = Instant::now() - Duration::from_secs(60);
        for r in &mut reps {
            r.load = Some(old);
        }
        let d = pick(&p, &reps, &only_home);
        assert_eq!((d.index, d.reason), (other, RouteReason::Fallback));
    }

    #[test]
    fn a_detour_serves_one_request_and_makes_no_home() {
        let reps = replicas(3);
        let p = policy();
        let h = [77, 78];
        // (The first pick makes the home; later ones read its index.)
        let first = pick(&p, &reps, &h);
        assert_eq!(first.reason, RouteReason::PrefixNew);
        let home = first.index;
        let now = Instant::now();
        let backlog = |i: usize, n: u64| set_backlog(&p, &reps[i], n);
        // Its home has a long backlog of prompts to prefill by this
        // gateway's count, where another replica would give the first token
        // much sooner.
        backlog(home, 1_000_000);
        // (A disaggregated decode leg stays: the wait predicted is for a
        // prefill, and its prompt is prefilled in the prefill pool.)
        let leg = pick_leg(&p, &reps, &h, true);
        assert_eq!((leg.index, leg.reason), (home, RouteReason::Affinity));
        // While its engine does not say it is full, the request stays: the
        // wait predicted there is this gateway's backlog alone, and a
        // replica holding none of the prompt would prefill it cold.
        let d = pick(&p, &reps, &h);
        assert_eq!((d.index, d.reason), (home, RouteReason::Affinity));
        // Its engine's queue outlives a scrape: this request leaves...
        let mut queued = reps.clone();
        queued[home].load = Some(sample(0.1, 4.0));
        let d = pick(&p, &queued, &h);
        assert_eq!(d.reason, RouteReason::SpillQueue);
        assert_ne!(d.index, home);
        // ...without becoming a holder of the prefix there.
        assert_eq!(p.affinity.of(&reps[d.index].name, now).prefixes.len(), 0);
        // So too when its seats are all taken (it keeps its prefix, and this
        // request leaves for the wait).
        let mut full = reps.clone();
        full[home].full = true;
        let d = pick(&p, &full, &h);
        assert_eq!(d.reason, RouteReason::SpillQueue);
        assert_ne!(d.index, home);
        assert_eq!(p.affinity.of(&reps[d.index].name, now).prefixes.len(), 0);
        backlog(home, 0);
        let back = pick(&p, &reps, &h);
        assert_eq!((back.index, back.reason), (home, RouteReason::Affinity));
    }

    #[test]
    fn an_open_home_still_detours_to_a_replica_holding_as_much_of_the_prompt() {
        let reps = replicas(3);
        // Sessions that may leave for a replica twice as fast (by default
        // they never do).
        let cfg = PrefixKvConfig {
            session_detour_margin: 0.5,
            ..PrefixKvConfig::default()
        };
        let t = (64, Duration::from_secs(60));
        let p = PrefixKv::new(cfg, Some(Duration::from_secs(5)), Affinity::new(1024, t, t));
        let now = Instant::now();
        // A session's first turn makes its home (and its blocks' holder).
        let home = p.pick(&session_turn(7, false, now), &reps).unwrap().index;
        // Another replica holds the same blocks (a spill served them there).
        let other = (home + 1) % reps.len();
        p.affinity
            .of(&reps[other].name, now)
            .prefixes
            .insert(&[1, 2, 3]);
        // The home's engine has room, but this gateway's backlog there makes
        // it much slower: the turn goes to the equal holder for its wait (no
        // stranger, so no word from the engine is needed)...
        set_backlog(&p, &reps[home], 1_000_000);
        let d = p.pick(&session_turn(7, true, now), &reps).unwrap();
        assert_eq!((d.index, d.reason), (other, RouteReason::Detour));
        // ...while the session keeps its home.
        set_backlog(&p, &reps[home], 0);
        let back = p.pick(&session_turn(7, true, now), &reps).unwrap();
        assert_eq!((back.index, back.reason), (home, RouteReason::Session));
        // (Without a session two equal holders are both homes: the prefix's
        // home is the faster of them, `affinity`, not a detour.)
    }

    #[test]
    fn a_new_prefix_is_held_where_it_was_placed_even_if_another_is_faster() {
        let reps = replicas(2);
        let p = policy();
        let now = Instant::now();
        // Replica `a` holds a prefix; `b` holds none but has a long backlog.
        let held = [5, 6];
        let a = pick(&p, &reps, &held).index;
        let b = 1 - a;
        set_backlog(&p, &reps[b], 1_000_000);
        // A new prefix goes where less is held, and stays there: a detour
        // to the faster `a` would make it hold two prefixes to `b`'s one.
        let new = [70, 71];
        let d = pick(&p, &reps, &new);
        assert_eq!((d.index, d.reason), (b, RouteReason::PrefixNew));
        assert_eq!(p.affinity.of(&reps[a].name, now).prefixes.len(), 2);
        // Its next request (a known prefix now) stays with it while `b`'s
        // engine does not say it is full, and leaves for the wait once it
        // does, without moving it.
        let next = pick(&p, &reps, &new);
        assert_eq!((next.index, next.reason), (b, RouteReason::Affinity));
        let mut queued = reps.clone();
        queued[b].load = Some(sample(0.1, 4.0));
        let next = pick(&p, &queued, &new);
        assert_eq!((next.index, next.reason), (a, RouteReason::SpillQueue));
        assert_eq!(p.affinity.of(&reps[a].name, now).prefixes.len(), 2);
    }

    #[test]
    fn a_home_that_keeps_evicting_gives_prompts_away_while_it_holds_more() {
        use crate::routing::placement::Placement;
        let reps = replicas(3);
        let p = policy();
        let now = Instant::now();
        let tpb = p.tokens_per_block();
        // Prompts of 40 blocks; each new one goes where the fewest are held.
        let prompt = |k: u64| -> Vec<u64> { (0..40).map(|b| k * 1000 + b).collect() };
        let mut homes = vec![Vec::new(); 3];
        for k in 0..6 {
            let d = pick(&p, &reps, &prompt(k));
            assert_eq!(d.reason, RouteReason::PrefixNew);
            homes[d.index].push(k);
        }
        assert!(homes.iter().all(|h| h.len() == 2), "{homes:?}");
        // Its engine evicts the tail of a prompt it was sent (it keeps the
        // first half): the closed loop hears of it at the request's end.
        let evict = |i: usize, k: u64| {
            let mem = p.affinity.of(&reps[i].name, now);
            let h = prompt(k);
            Placement::new(mem, 1, 40 * tpb, Arc::from(h.as_slice()), 40, tpb)
                .finished(20 * tpb, None);
        };
        // On a balanced fleet an eviction moves nothing: the prompt stays.
        evict(0, homes[0][0]);
        let d = pick(&p, &reps, &prompt(homes[0][0]));
        assert_eq!((d.index, d.reason), (0, RouteReason::Affinity));
        // Replica 0 gets two more prompts (sent there while the others were
        // pressed, say): it holds four to the others' two.
        for k in [6, 7] {
            p.affinity
                .of(&reps[0].name, now)
                .prefixes
                .insert(&prompt(k));
            homes[0].push(k);
        }
        let stay = pick(&p, &reps, &prompt(6));
        assert_eq!((stay.index, stay.reason), (0, RouteReason::Affinity));
        // Now its evictions give a prompt away, to a replica holding two,
        // and it is forgotten there: its next request stays at its new home.
        evict(0, 6);
        let moved = pick(&p, &reps, &prompt(6));
        assert_eq!(moved.reason, RouteReason::Rehome);
        assert_ne!(moved.index, 0);
        assert_eq!(
            p.affinity
                .of(&reps[0].name, now)
                .prefixes
                .longest_match(&prompt(6)),
            0
        );
        assert_eq!(pick(&p, &reps, &prompt(6)).index, moved.index);
        // Holding three to the others' three and two, replica 0 keeps the
        // rest, evicting or not.
        evict(0, 7);
        let kept = pick(&p, &reps, &prompt(7));
        assert_eq!((kept.index, kept.reason), (0, RouteReason::Affinity));
    }

    #[test]
    fn a_hot_prefix_spreads_under_bounded_loads_once_its_home_queues() {
        // Engines of 16 seats: past them, a replica's engine queues.
        let run = |seats: u32| {
            let mut reps = replicas(3);
            let p = policy();
            let h = [42, 43];
            let mut per = [0usize; 3];
            let mut spilled = 0;
            for k in 0..60 {
                let d = pick(&p, &reps, &h);
                per[d.index] += 1;
                spilled += usize::from(d.reason == RouteReason::SpillLoad);
                reps[d.index].in_flight += 1;
                if reps[d.index].in_flight > seats {
                    reps[d.index].load = Some(sample(0.5, 2.0));
                }
                if k < 8 {
                    // A few requests above its share never move a prefix: a
                    // spill would cost a cold prefill elsewhere.
                    assert_eq!(
                        d.reason,
                        if k == 0 {
                            RouteReason::PrefixNew
                        } else {
                            RouteReason::Affinity
                        }
                    );
                }
            }
            (per, spilled)
        };
        // No replica beyond its bounded share (load_factor x 60 / 3, plus the
        // request that reaches the bound), and more than one replica used.
        let (per, spilled) = run(16);
        let share = (PrefixKvConfig::default().load_factor * 60.0 / 3.0).ceil() as usize + 1;
        assert!(per.iter().all(|&n| n <= share), "{per:?}");
        assert!(per.iter().filter(|&&n| n > 0).count() >= 2, "{per:?}");
        assert!(spilled > 0);
        // An engine that batches all of it (no queue) keeps its prefix.
        let (per, spilled) = run(1000);
        assert_eq!(per.iter().max(), Some(&60), "{per:?}");
        assert_eq!(spilled, 0);
    }

    #[test]
    fn a_decode_leg_leaves_its_holder_only_for_a_replica_two_streams_lighter() {
        let mut reps = replicas(2);
        let p = policy();
        let h = [5, 6, 7];
        let home = pick_leg(&p, &reps, &h, true).index;
        let other = 1 - home;
        let decode = |reps: &[ReplicaView]| {
            let d = pick_leg(&p, reps, &h, true);
            (d.index, d.reason)
        };
        // One stream more at the holder: moving would not even them out.
        reps[home].in_flight = 1;
        assert_eq!(decode(&reps), (home, RouteReason::Affinity));
        // Two more: a request that prefills where it decodes keeps its
        // prefix (leaving costs a cold prefill), a decode leg evens the
        // streams out.
        reps[home].in_flight = 2;
        assert_eq!(pick(&p, &reps, &h).index, home);
        assert_eq!(decode(&reps), (other, RouteReason::SpillLoad));
        // The prefix now has two holders: the legs go to the one with
        // fewer streams while they differ by two, and stay where they are
        // otherwise.
        reps[other].in_flight = 3;
        assert_eq!(decode(&reps), (home, RouteReason::Affinity));
        reps[other].in_flight = 5;
        assert_eq!(decode(&reps), (home, RouteReason::Affinity));
        reps[home].in_flight = 7;
        assert_eq!(decode(&reps), (other, RouteReason::Affinity));
    }
}
