//! Choosing a replica for a request: a small trait, one file per policy.
//!
//! A policy sees the request's routing context and a [`ReplicaView`] of each
//! candidate that serves its model (healthy, not ejected, and excluding
//! replicas tried by earlier attempts): a snapshot of the few numbers routing
//! needs, not the pool's types. It returns a [`Decision`] with a reason from a
//! closed set, which is counted in metrics and recorded with the request.
//! What a policy remembers between decisions lives in [`Affinity`].

pub(crate) mod affinity;
pub(crate) mod cold_gate;
pub(crate) mod index;
mod least_loaded;
pub(crate) mod load;
pub(crate) mod placement;
pub(crate) mod prefilling;
pub(crate) mod prefix;
mod prefix_kv;
mod round_robin;
pub(crate) mod sessions;
pub(crate) mod shared_table;
pub mod stall_budget;

pub use affinity::Affinity;
pub use index::{PrefixIndex, longest_prefix};
pub(crate) use least_loaded::LeastLoaded;
pub use prefix_kv::PrefixKv;
pub use round_robin::RoundRobin;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{PolicyKind, RoutingConfig};
use crate::vocab::RouteReason;

/// One candidate as a policy sees it, taken for this decision.
#[derive(Debug, Clone)]
pub struct ReplicaView {
    /// The replica's stable name (the same in every gateway process).
    pub name: Arc<str>,
    /// Requests this gateway has sent there and not yet finished.
    pub in_flight: u32,
    /// The latest scrape of the replica's own metrics, if any.
    pub load: Option<LoadView>,
    /// Time per output token this gateway measured there recently (seconds).
    pub tpot: Option<f64>,
    /// Every seat is taken (its known concurrency, `flow::room`): new work
    /// goes elsewhere as under queue pressure; its sessions stay.
    pub full: bool,
}

/// A scrape of a replica's own metrics, as routing uses it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadView {
    /// KV-cache usage, 0..1.
    pub kv_usage: Option<f64>,
    /// Requests the engine holds and does not run, whatever they wait for.
    pub waiting: Option<f64>,
    /// Of those, the engine's queue (waiting for room: `LoadSample::queue`).
    pub queue: Option<f64>,
    pub running: Option<f64>,
    /// Requests waited at this scrape and the one before: the engine is full.
    pub queued: bool,
    /// It preempted sequences since the scrape before: out of KV blocks.
    pub preempting: bool,
    /// When it was scraped.
    pub at: Instant,
}

impl ReplicaView {
    /// The scrape, if it is no older than `max_age` at `now`.
    pub(crate) fn fresh_load(&self, now: Instant, max_age: Duration) -> Option<&LoadView> {
        self.load
            .as_ref()
            .filter(|l| now.saturating_duration_since(l.at) <= max_age)
    }
}

/// A request's session: which conversation it continues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionKey {
    /// A hash of the session id (or of what identifies the conversation in
    /// the prompt), bound to the served model.
    pub key: u64,
    /// The client sent an id (not derived from the prompt).
    pub explicit: bool,
    /// The request carries earlier turns (an assistant message): the
    /// session exists somewhere even if this gateway has not seen it.
    pub continuing: bool,
}

/// What a policy may look at besides the candidates.
pub struct RouteCtx<'a> {
    /// The served model name (aliases resolved).
    pub model: &'a str,
    /// Chained hashes of the prompt's blocks (`routing::prefix`); empty when
    /// the policy does not use them or the prompt is shorter than a block.
    pub hashes: &'a [u64],
    /// The request's session, when sessions are on and it has one.
    pub session: Option<SessionKey>,
    /// The prompt's length in tokens, and its tail's (the last assistant
    /// message and what follows: what the previous turn's replica lacks).
    pub prompt_tokens: u32,
    pub tail_tokens: u32,
    /// A disaggregated request's decode leg (its model has prefill replicas
    /// and its API a prefill leg): the prompt is prefilled in the prefill
    /// pool, so leaving its prefix's holder costs a KV transfer, not a
    /// prefill, while every stream a replica generates lengthens its steps.
    pub decode_leg: bool,
    /// Where a new session starts, when not where the policy's own setting
    /// says (`routing.prefix_kv.session_placement`): a disaggregated
    /// prefill leg's (`routing.disaggregation.session_placement`).
    pub session_placement: Option<crate::config::SessionPlacement>,
    /// No other sender shows at the replicas' engines
    /// (`upstream::company`): `session_placement: auto` places a new
    /// session by pressure, as `first_open`, where no other gateway would
    /// look for it by its key.
    pub alone: bool,
    /// What the shared table says of a prompt whose prefix no candidate
    /// holds in this gateway's index (`RoutingPolicy::new_home`): its home.
    pub shared_home: Option<SharedHome<'a>>,
    pub now: Instant,
}

/// A prefix's home as the shared table gives it (`routing::shared_table`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedHome<'a> {
    pub replica: &'a str,
    /// Placed by this request's lookup (else another gateway placed it).
    pub new: bool,
}

/// A prompt whose prefix is new to this gateway (`RoutingPolicy::new_home`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewHome {
    /// Its home prefix's hash.
    pub key: u64,
    /// Every candidate, the first `open` those a new home may go to, in
    /// this gateway's order of preference, the balance of what the replicas
    /// hold left out (the shared table counts that over every gateway).
    pub order: Vec<usize>,
    pub open: usize,
    /// After those, how many were left out only because their engine's
    /// queue outlived its last scrapes (a moment's view, up to a scrape
    /// interval old): the shared table may still place there when every
    /// open one has more cold prefills under way (`routing::shared_table`).
    pub queued: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Index into the candidate slice.
    pub index: usize,
    pub reason: RouteReason,
    /// The request's session left the replica it was on (which was
    /// unavailable or under pressure: `reason` says which).
    pub moved: bool,
    /// Prompt tokens expected cached there, and the index blocks that say so.
    pub cached_tokens: u32,
    pub matched_blocks: usize,
    /// The request's session, counted on this replica while the request
    /// runs there (`Placement::counting_session`).
    pub counted_session: Option<u64>,
    /// A turn of a session under way: the history it re-sends was computed
    /// by its earlier turns (`Placement::continuing`).
    pub continuing: bool,
    /// The prompt's prefix decided it (no session did): what the shared
    /// table's prefix homes are kept from.
    pub by_prefix: bool,
}

impl Decision {
    /// A decision that expects no cache (the policies that do not look).
    pub fn plain(index: usize, reason: RouteReason) -> Self {
        Self {
            index,
            reason,
            moved: false,
            cached_tokens: 0,
            matched_blocks: 0,
            counted_session: None,
            continuing: false,
            by_prefix: false,
        }
    }
}

pub trait RoutingPolicy: Send + Sync {
    fn name(&self) -> &'static str;
    /// Whether `RouteCtx::hashes` should be computed for this policy.
    fn wants_prefix(&self) -> bool {
        false
    }
    /// `None` only when `candidates` is empty.
    fn pick(&self, ctx: &RouteCtx<'_>, candidates: &[ReplicaView]) -> Option<Decision>;
    /// Whether `pick` would place this request's prefix anew (no candidate
    /// holds it in this gateway's index, and no session decides): where it
    /// may go, for the shared table to choose. Remembers nothing.
    fn new_home(&self, _ctx: &RouteCtx<'_>, _candidates: &[ReplicaView]) -> Option<NewHome> {
        None
    }
}

/// The candidates' indexes by least work (`least_loaded`'s measure), full
/// ones last: an endpoint picker's fallbacks after its pick. Remembers
/// nothing (no policy's memory is touched). O(n log n).
pub fn by_least_work(
    ctx: &RouteCtx<'_>,
    candidates: &[ReplicaView],
    stale_after: Option<Duration>,
) -> Vec<usize> {
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by(|&a, &b| {
        let (ra, rb) = (&candidates[a], &candidates[b]);
        ra.full.cmp(&rb.full).then(
            least_loaded::work(ra, ctx, stale_after).total_cmp(&least_loaded::work(
                rb,
                ctx,
                stale_after,
            )),
        )
    });
    order
}

/// The configured policy; `affinity` is what it remembers per replica (kept
/// across reloads by the caller while `index_capacity` is unchanged).
pub(crate) fn build(cfg: &RoutingConfig, affinity: Arc<Affinity>) -> Arc<dyn RoutingPolicy> {
    // Without scraping there are no samples to distrust: pressure is unknown,
    // not saturated.
    let stale_after = cfg.metrics.enabled.then_some(cfg.metrics.stale_after);
    match cfg.policy {
        PolicyKind::RoundRobin => Arc::new(RoundRobin::default()),
        PolicyKind::LeastLoaded => Arc::new(LeastLoaded::new(stale_after)),
        PolicyKind::PrefixKv => {
            let mut c = cfg.prefix_kv.clone();
            c.session_placement = c.session_placement.resolved(&cfg.sessions);
            Arc::new(PrefixKv::new(c, stale_after, affinity))
        }
    }
}
