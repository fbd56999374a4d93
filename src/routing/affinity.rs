//! What routing remembers between decisions: per replica, the prefix blocks
//! this gateway sent there (`prefix_kv`'s index); per session, its replica.
//!
//! Keyed by replica name, so it outlives a config reload that keeps the
//! replica, and is shared by the policy of the old and the new state. A
//! replica that disappears is forgotten lazily: entries unused for
//! [`FORGET_AFTER`] are dropped when a new replica is first seen.
//! Lookups are lock-free (`ArcSwap` of the map, and the index's atomic
//! slots); the index's inserts take its short lock.

use foldhash::{HashMap, HashMapExt as _};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use super::index::PrefixIndex;
use super::load::Load;
use super::sessions::Sessions;
use super::stall_budget::StallLedger;
use crate::telemetry::metrics::epoch;

/// Replicas not routed to for this long are forgotten (a DNS-discovered pod
/// that went away must not keep its index forever).
pub(crate) const FORGET_AFTER: Duration = Duration::from_secs(600);

pub(crate) struct ReplicaMemory {
    pub(crate) prefixes: PrefixIndex,
    /// Work sent there and the rates learned from it.
    pub(crate) load: Load,
    /// Sessions served here lately (`session_placement: least_loaded`,
    /// see [`SessionsHere`]).
    pub(crate) sessions: Mutex<SessionsHere>,
    /// The stalled gaps this gateway's local prefills may still cause here
    /// (a decode replica of a disaggregated model: `api::disagg`).
    pub(crate) stalls: Mutex<StallLedger>,
    /// Prompts this gateway has in their first prefill here
    /// (`routing.prefix_kv.hold_for_prefill`).
    pub(crate) prefilling: Arc<super::prefilling::Prefilling>,
    /// This gateway's cold prefills under way here, paced
    /// (`routing.prefix_kv.cold_prefill_tokens`).
    pub(crate) cold_gate: super::cold_gate::ColdGate,
    /// Nanoseconds since `epoch()` of the last decision that looked here.
    used: AtomicU64,
}

/// How long an idle session's weight takes to fade by `e`.
pub(crate) const SESSION_FADE: Duration = Duration::from_secs(10);

/// The sessions this gateway served on one replica lately, for placing new
/// ones where fewest are. A session counts 1 while a turn of it is under way
/// here (however many), then `e^(-idle / 10 s)` from that turn's end (or,
/// routed without a placement to end it, from its routing): a session whose
/// turns come within seconds counts about once, whatever its pace, and one
/// that ended fades out.
///
/// Counted per turn, a replica whose turns slowed down (overloaded: each
/// waits seconds) read as less loaded than one whose few sessions turned
/// fast and took the new sessions (a dozen agent sessions on two prefill
/// replicas: 9 on one, 2 on the other). Faded from a turn's start, a
/// session of a saturated replica, whose turns wait seconds, faded during
/// its own turn and the busiest replica read light (32 sessions: 8-13
/// apart); docs/benchmarks-log.md.
#[derive(Debug, Default)]
pub(crate) struct SessionsHere {
    seen: HashMap<u64, Seen>,
    /// Idle entries are dropped once the map reaches this size.
    prune_at: usize,
}

#[derive(Debug, Clone, Copy)]
enum Seen {
    /// Turns under way here.
    Turns(u32),
    /// Idle since.
    Since(Instant),
}

impl SessionsHere {
    /// Session `key` was routed here at `now` (its turn begins with its
    /// placement, if any).
    pub(crate) fn touch(&mut self, key: u64, now: Instant) {
        if !matches!(self.seen.get(&key), Some(Seen::Turns(_))) {
            self.seen.insert(key, Seen::Since(now));
            self.prune(now);
        }
    }

    /// A turn of session `key` is under way here.
    pub(crate) fn begin(&mut self, key: u64) {
        let n = match self.seen.get(&key) {
            Some(Seen::Turns(n)) => n + 1,
            _ => 1,
        };
        self.seen.insert(key, Seen::Turns(n));
    }

    /// A turn of session `key` ended here at `now`.
    pub(crate) fn end(&mut self, key: u64, now: Instant) {
        match self.seen.get(&key) {
            Some(&Seen::Turns(n)) if n > 1 => {
                self.seen.insert(key, Seen::Turns(n - 1));
            }
            Some(Seen::Turns(_)) => {
                self.seen.insert(key, Seen::Since(now));
            }
            _ => {}
        }
    }

    /// The sessions here, each weighed as above.
    pub(crate) fn weight(&self, now: Instant) -> f64 {
        self.seen.values().map(|s| seen_weight(*s, now)).sum()
    }

    /// Drops the idle entries that weigh nothing any more (bounded memory:
    /// each prune at least halves the map or doubles the size that starts
    /// the next).
    fn prune(&mut self, now: Instant) {
        if self.seen.len() < self.prune_at.max(64) {
            return;
        }
        self.seen.retain(|_, s| seen_weight(*s, now) > 1e-3);
        self.prune_at = 2 * self.seen.len();
    }
}

fn seen_weight(s: Seen, now: Instant) -> f64 {
    match s {
        Seen::Turns(_) => 1.0,
        Seen::Since(at) => {
            let idle = now.saturating_duration_since(at).as_secs_f64();
            (-idle / SESSION_FADE.as_secs_f64()).exp()
        }
    }
}

/// Nanoseconds from `epoch()` to `now`.
fn since_epoch(now: Instant) -> u64 {
    u64::try_from(now.saturating_duration_since(epoch()).as_nanos()).unwrap_or(u64::MAX)
}

impl ReplicaMemory {
    fn touch(&self, now: Instant) {
        self.used.store(since_epoch(now), Relaxed);
    }

    fn idle_for(&self, now: Instant) -> Duration {
        Duration::from_nanos(since_epoch(now).saturating_sub(self.used.load(Relaxed)))
    }
}

/// How long a session that left a replica that lost its history stays
/// where it went before it may leave again (`Affinity::left_lately`). A
/// turn every few seconds: several turns. (Sessions leaving by turns: of
/// 87 moves in a run of 200 agentic sessions on four replicas, 24 were a
/// session's second or later, 3-44 s after its one before, 8 of them back
/// to the replica it had left; docs/BENCHMARKS.md, routing.)
pub(crate) const SETTLE: Duration = Duration::from_secs(60);

pub struct Affinity {
    replicas: ArcSwap<HashMap<Arc<str>, Arc<ReplicaMemory>>>,
    capacity: usize,
    pub(crate) sessions: Sessions,
    /// Responses API: response id -> the replica that produced it (engines
    /// keep response state in memory: a follow-up must go back there).
    pub(crate) responses: Sessions,
    /// What the session and response tables were built with (a reload
    /// keeps them while equal).
    limits: [(usize, Duration); 2],
    /// A prompt's home prefix (its first `home_blocks` blocks) -> the
    /// replica it was last sent to, whatever
    /// the policy: the doctor's evidence that routing scatters prompts that
    /// share a prefix (`sluice_backend_prefix_elsewhere_total`).
    pub(crate) home_prefixes: Sessions,
    /// Sessions this gateway placed by pressure off their key's first
    /// replica while it was the engines' only sender (`session_placement:
    /// auto`, `upstream::company`) -> that replica: once another sender
    /// shows, each goes back to its key's first, where other gateways send
    /// it. A quarter of `sessions`' capacity (only such sessions are kept).
    pub(crate) placed_by_pressure: Sessions,
    /// Sessions of a mixed fleet that left a replica that had lost their
    /// history while this gateway was the engines' only sender
    /// (`PrefixKv::session_home`, `lost`) -> where they went: each stays
    /// there for `SETTLE` (its history is prefilled there now). Only such
    /// sessions are kept.
    pub(crate) left_lately: Sessions,
    /// A session has been placed by pressure since start: until then
    /// `placed_by_pressure` is not read (a gateway never alone takes none
    /// of its locks on a session's turns).
    pub(crate) any_by_pressure: std::sync::atomic::AtomicBool,
}

impl Affinity {
    /// `capacity`: prefix blocks remembered per replica; `sessions` and
    /// `responses`: at most that many, each forgotten after that long unseen.
    pub fn new(
        capacity: usize,
        sessions: (usize, Duration),
        responses: (usize, Duration),
    ) -> Arc<Self> {
        Arc::new(Self {
            replicas: ArcSwap::from_pointee(HashMap::new()),
            capacity,
            sessions: Sessions::new(sessions.0, sessions.1),
            responses: Sessions::new(responses.0, responses.1),
            limits: [sessions, responses],
            home_prefixes: Sessions::new(4096, Duration::from_secs(600)),
            placed_by_pressure: Sessions::new((sessions.0 / 4).max(1024), sessions.1),
            left_lately: Sessions::new((sessions.0 / 4).max(1024), SETTLE),
            any_by_pressure: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Whether this memory was built with these limits (a reload keeps it).
    pub(crate) fn built_for(
        &self,
        capacity: usize,
        sessions: (usize, Duration),
        responses: (usize, Duration),
    ) -> bool {
        self.capacity == capacity && self.limits == [sessions, responses]
    }

    /// The memory of replica `name`, created on first use.
    /// (`now`: the caller's clock reading; a decision reads it once.)
    pub(crate) fn of(&self, name: &Arc<str>, now: Instant) -> Arc<ReplicaMemory> {
        if let Some(m) = self.replicas.load().get(name) {
            m.touch(now);
            return m.clone();
        }
        let fresh = Arc::new(ReplicaMemory {
            prefixes: PrefixIndex::new(self.capacity),
            load: Load::default(),
            sessions: Mutex::new(SessionsHere::default()),
            stalls: Mutex::new(StallLedger::default()),
            prefilling: Default::default(),
            cold_gate: Default::default(),
            used: AtomicU64::new(0),
        });
        fresh.touch(now);
        let mut out = fresh.clone();
        self.replicas.rcu(|map| {
            let mut next: HashMap<_, _> = map
                .iter()
                .filter(|(_, m)| m.idle_for(now) < FORGET_AFTER)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            // Another decision may have added it meanwhile: keep that one.
            out = next
                .entry(name.clone())
                .or_insert_with(|| fresh.clone())
                .clone();
            next
        });
        out
    }

    /// Prefix blocks remembered for `name` (0 when unknown), for `/admin`.
    pub(crate) fn blocks(&self, name: &str) -> usize {
        self.replicas
            .load()
            .get(name)
            .map_or(0, |m| m.prefixes.len())
    }

    /// The share of predicted cached tokens the replica's engine has lately
    /// had (`routing::load::Load::kept`; 1 for one not known here).
    pub(crate) fn kept(&self, name: &str) -> f64 {
        self.replicas
            .load()
            .get(name)
            .map_or(1.0, |m| m.load.kept())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_per_name_and_shared() {
        let t = (16, Duration::from_secs(60));
        let a = Affinity::new(64, t, t);
        let x: Arc<str> = Arc::from("x");
        let now = Instant::now();
        a.of(&x, now).prefixes.insert(&[1, 2, 3]);
        assert_eq!(a.blocks("x"), 3);
        assert_eq!(a.of(&x, now).prefixes.longest_match(&[1, 2, 9]), 2);
        assert_eq!(a.blocks("y"), 0);
    }

    #[test]
    fn an_idle_session_fades_by_e_every_ten_seconds() {
        let t0 = Instant::now();
        let mut h = SessionsHere::default();
        assert_eq!(h.weight(t0), 0.0);
        h.touch(1, t0);
        h.touch(2, t0);
        assert!((h.weight(t0) - 2.0).abs() < 1e-9);
        let later = t0 + SESSION_FADE;
        assert!((h.weight(later) - 2.0 / std::f64::consts::E).abs() < 1e-9);
        // Routed again: back to 1.
        h.touch(1, later);
        assert!((h.weight(later) - (1.0 + 1.0 / std::f64::consts::E)).abs() < 1e-9);
    }

    #[test]
    fn a_session_counts_once_while_its_turns_run_and_fades_from_their_end() {
        let t0 = Instant::now();
        let mut h = SessionsHere::default();
        // Two turns of one session at once, and a turn that runs 30 s: one
        // session, whole, all along.
        h.touch(7, t0);
        h.begin(7);
        h.begin(7);
        assert!((h.weight(t0 + Duration::from_secs(30)) - 1.0).abs() < 1e-9);
        h.end(7, t0 + Duration::from_secs(30));
        assert!((h.weight(t0 + Duration::from_secs(30)) - 1.0).abs() < 1e-9);
        // A touch while a turn is under way does not end it.
        h.touch(7, t0 + Duration::from_secs(30));
        h.end(7, t0 + Duration::from_secs(31));
        // Ended at 31 s: fades from there.
        let at = t0 + Duration::from_secs(41);
        assert!((h.weight(at) - 1.0 / std::f64::consts::E).abs() < 1e-9);
        // An end without a turn under way changes nothing.
        h.end(8, at);
        assert!((h.weight(at) - 1.0 / std::f64::consts::E).abs() < 1e-9);
    }

    #[test]
    fn idle_sessions_that_weigh_nothing_are_dropped() {
        let t0 = Instant::now();
        let mut h = SessionsHere::default();
        for k in 0..100 {
            h.touch(k, t0);
        }
        h.begin(0);
        // Long after: the next touches prune all but the turn under way and
        // themselves.
        let later = t0 + SESSION_FADE * 100;
        for k in 1000..1064 {
            h.touch(k, later);
        }
        assert!(h.seen.len() < 100, "{}", h.seen.len());
        assert!((h.weight(later) - 65.0).abs() < 1e-9);
    }
}
