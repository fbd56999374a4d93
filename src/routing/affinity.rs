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
use crate::telemetry::metrics::epoch;

/// Replicas not routed to for this long are forgotten (a DNS-discovered pod
/// that went away must not keep its index forever).
pub(crate) const FORGET_AFTER: Duration = Duration::from_secs(600);

pub(crate) struct ReplicaMemory {
    pub(crate) prefixes: PrefixIndex,
    /// Work sent there and the rates learned from it.
    pub(crate) load: Load,
    /// Sessions served here lately, each by how recently
    /// (`session_placement: least_loaded`, see [`Decayed::renew`]).
    pub(crate) session_turns: Mutex<Decayed>,
    /// Nanoseconds since `epoch()` of the last decision that looked here.
    used: AtomicU64,
}

/// A count that fades: each new event adds one (a renewed one what it lost,
/// [`Decayed::renew`]), and the sum decays by `e` every [`TURNS_DECAY`]:
/// about the events of the last ten seconds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Decayed {
    value: f64,
    at: Option<Instant>,
}

pub(crate) const TURNS_DECAY: Duration = Duration::from_secs(10);

impl Decayed {
    pub(crate) const fn new() -> Self {
        Self {
            value: 0.0,
            at: None,
        }
    }

    pub(crate) fn get(&self, now: Instant) -> f64 {
        self.at.map_or(0.0, |at| {
            let dt = now.saturating_duration_since(at).as_secs_f64();
            self.value * (-dt / TURNS_DECAY.as_secs_f64()).exp()
        })
    }

    fn add_weight(&mut self, now: Instant, w: f64) {
        self.value = self.get(now) + w;
        self.at = Some(now.max(self.at.unwrap_or(now)));
    }

    /// A turn of one of the sessions counted, whose last turn here was
    /// `since` ago (`None`: new here, counted 1). The sum is then, over the
    /// sessions served here, `e^(-age / 10 s)` of each one's last turn: its
    /// term back to 1 at each turn, so a session whose turns come within a
    /// few seconds of each other counts about once, whatever its pace (one
    /// that waits tens of seconds between turns fades in between, as an
    /// idle one should). Counted per turn instead, a
    /// replica whose turns slowed down (overloaded: each waits seconds)
    /// read as less loaded than one whose few sessions turned fast, and took
    /// the new sessions: with a dozen agent sessions on two prefill replicas
    /// one held 9 of them while the other had 2 (docs/benchmarks-log.md).
    pub(crate) fn renew(&mut self, now: Instant, since: Option<Duration>) {
        let faded = since.map_or(0.0, |d| {
            (-d.as_secs_f64() / TURNS_DECAY.as_secs_f64()).exp()
        });
        self.add_weight(now, 1.0 - faded);
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
            session_turns: Mutex::new(Decayed::new()),
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
    fn a_decayed_count_fades_by_e_every_ten_seconds() {
        let t0 = Instant::now();
        let mut d = Decayed::new();
        assert_eq!(d.get(t0), 0.0);
        d.renew(t0, None);
        d.renew(t0, None);
        assert!((d.get(t0) - 2.0).abs() < 1e-9);
        let later = t0 + TURNS_DECAY;
        assert!((d.get(later) - 2.0 / std::f64::consts::E).abs() < 1e-9);
        d.renew(later, None);
        assert!((d.get(later) - (1.0 + 2.0 / std::f64::consts::E)).abs() < 1e-9);
    }

    #[test]
    fn a_renewed_session_counts_once_however_fast_it_turns() {
        let t0 = Instant::now();
        let (mut fast, mut slow) = (Decayed::new(), Decayed::new());
        // One session turning every second, against three every five.
        fast.renew(t0, None);
        for s in 0..3 {
            slow.renew(t0 + Duration::from_millis(s), None);
        }
        for i in 1..=20u32 {
            fast.renew(
                t0 + Duration::from_secs(i.into()),
                Some(Duration::from_secs(1)),
            );
            if i % 5 == 0 {
                for _ in 0..3 {
                    slow.renew(
                        t0 + Duration::from_secs(i.into()),
                        Some(Duration::from_secs(5)),
                    );
                }
            }
        }
        let end = t0 + Duration::from_secs(20);
        assert!((fast.get(end) - 1.0).abs() < 1e-6, "{}", fast.get(end));
        assert!((slow.get(end) - 3.0).abs() < 1e-2, "{}", slow.get(end));
        // Five seconds on, unrenewed, they fade alike.
        let later = end + Duration::from_secs(5);
        assert!((slow.get(later) / fast.get(later) - 3.0).abs() < 1e-2);
    }
}
