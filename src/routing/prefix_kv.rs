//! `prefix_kv` (the default): send a prompt where its prefix is already in KV
//! cache, unless that replica is under pressure.
//!
//! Algorithm, per request:
//! 1. **Pressure filter.** A candidate whose last scrape is older than
//!    `stale_after` (or missing) is treated as saturated; one at or above
//!    `kv_high` KV-cache usage, or with `queue_high` requests waiting, gets no
//!    new work. If every candidate is filtered, the one with least work is used
//!    (`fallback`) rather than failing.
//! 2. **Home.** Rendezvous (highest-random-weight) hashing of the prompt's
//!    first `home_blocks` block hashes over the candidates' names ranks the
//!    replicas identically in every gateway process, with no shared state. With
//!    bounded loads, the home is the first in that ranking whose in-flight count
//!    is within `load_factor` x the mean, so a hot prefix spills to its next
//!    replica instead of piling onto one.
//! 3. **Match.** Each replica's index of recently routed block hashes gives the
//!    longest cached prefix (binary search).
//! 4. **Score** the unfiltered candidates:
//!    `prefix x matched share + home x [home] - kv x usage
//!     - queue x waiting / queue_high - load x in_flight / bound
//!     - latency x slowness`; highest wins. Slowness is the replica's recent
//!    time per output token over the candidates' median, minus one, in 0..2
//!    (measured by this gateway; forgotten after 30 s without traffic).
//!    A replica at or over the load bound gets no credit for its match, so a
//!    hot prefix spreads to the next replicas (which then cache it too).
//!    The reason is `affinity` when the winner is the preferred replica (the
//!    longest match, else the home), else why the preferred one was passed
//!    over (`spill_kv`, `spill_queue`, `spill_stale`, `spill_load`), else
//!    `least_loaded`.
//! 5. The prompt's block hashes are added to the winner's index.
//!
//! Cost: O(n log n) in the candidates for the ranking, O(n log blocks) index
//! lookups, O(blocks) to insert; the block hashing itself (O(prompt bytes)) is
//! done once per request in `routing::prefix`. See `benches/routing.rs`.

use std::sync::Arc;
use std::time::Duration;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::affinity::{Affinity, ReplicaMemory};
use super::{Decision, ReplicaView, RouteCtx, RoutingPolicy, least_loaded};
use crate::config::PrefixKvConfig;
use crate::vocab::RouteReason;

pub struct PrefixKv {
    cfg: PrefixKvConfig,
    /// `None`: scraping is off, so there is no pressure information to trust
    /// or distrust; only prefix and load decide.
    stale_after: Option<Duration>,
    /// Each replica's index of the prefix blocks routed there.
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

struct View {
    blocked: Blocked,
    kv: f64,
    waiting: f64,
    in_flight: f64,
    matched: usize,
    rank: u64,
    /// Recent time per output token measured here, if fresh.
    tpot: Option<f64>,
    memory: Arc<ReplicaMemory>,
}

/// A replica's rendezvous weight for a prefix key (stable across processes).
pub(super) fn rendezvous(key: u64, name: &str) -> u64 {
    xxh3_64_with_seed(name.as_bytes(), key)
}

impl RoutingPolicy for PrefixKv {
    fn name(&self) -> &'static str {
        "prefix_kv"
    }

    fn wants_prefix(&self) -> bool {
        true
    }

    fn pick(&self, ctx: &RouteCtx<'_>, candidates: &[ReplicaView]) -> Option<Decision> {
        let n = candidates.len();
        if n == 0 {
            return None;
        }
        let c = &self.cfg;
        let key = ctx
            .hashes
            .get(c.home_blocks.min(ctx.hashes.len()).wrapping_sub(1))
            .copied()
            // Shorter than a block: the model alone decides the home.
            .unwrap_or_else(|| xxh3_64_with_seed(ctx.model.as_bytes(), 0));
        let views: Vec<View> = candidates
            .iter()
            .map(|r| {
                let fresh = self.stale_after.and_then(|d| r.fresh_load(ctx.now, d));
                let kv = fresh.and_then(|s| s.kv_usage).unwrap_or(0.0);
                let waiting = fresh.and_then(|s| s.waiting).unwrap_or(0.0);
                let blocked = match fresh {
                    None if self.stale_after.is_none() => Blocked::No,
                    None => Blocked::Stale,
                    Some(_) if kv >= c.kv_high => Blocked::Kv,
                    Some(_) if waiting >= c.queue_high => Blocked::Queue,
                    Some(_) => Blocked::No,
                };
                let memory = self.affinity.of(&r.name);
                let matched = if ctx.hashes.is_empty() {
                    0
                } else {
                    memory.prefixes.lock().longest_match(ctx.hashes)
                };
                View {
                    blocked,
                    kv,
                    waiting,
                    in_flight: f64::from(r.in_flight),
                    matched,
                    rank: rendezvous(key, &r.name),
                    tpot: r.tpot,
                    memory,
                }
            })
            .collect();

        // Bounded loads: a replica's fair share of what is in flight, plus one.
        let total: f64 = views.iter().map(|v| v.in_flight).sum();
        let bound = (c.load_factor * (total + 1.0) / n as f64).ceil().max(1.0);
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| views[b].rank.cmp(&views[a].rank));
        let top = order[0];
        let home = order
            .iter()
            .copied()
            .find(|&i| views[i].in_flight < bound)
            .unwrap_or(top);
        let best_match = (0..n)
            .filter(|&i| views[i].matched > 0)
            .max_by_key(|&i| (views[i].matched, views[i].rank));
        let preferred = best_match.unwrap_or(top);

        // Slowness relative to the others: decode speed is the replica's own
        // (TTFT mostly reflects cache hits, which this policy causes).
        let mut tpots: Vec<f64> = views.iter().filter_map(|v| v.tpot).collect();
        tpots.sort_by(f64::total_cmp);
        let median = tpots.get(tpots.len() / 2).copied();
        let slowness = |v: &View| match (v.tpot, median) {
            // Up to 2: a replica 3x slower than the median loses even its own
            // cached, home prefixes (worth 1.3); a mildly slow one keeps them.
            (Some(t), Some(m)) if m > 0.0 => (t / m - 1.0).clamp(0.0, 2.0),
            _ => 0.0,
        };
        let blocks = ctx.hashes.len().max(1) as f64;
        let w = &c.weights;
        let score = |i: usize| {
            let v = &views[i];
            // Bounded loads apply to affinity too: over its share, a replica's
            // cached prefix stops attracting work, so a hot prefix spreads.
            let matched = if v.in_flight < bound { v.matched } else { 0 };
            w.prefix * matched as f64 / blocks + if i == home { w.home } else { 0.0 }
                - w.kv * v.kv
                - w.queue * (v.waiting / c.queue_high.max(1.0)).min(1.0)
                - w.load * v.in_flight / bound
                - w.latency * slowness(v)
        };
        let chosen = (0..n)
            .filter(|&i| views[i].blocked == Blocked::No)
            .max_by(|&a, &b| {
                score(a)
                    .total_cmp(&score(b))
                    .then(views[a].rank.cmp(&views[b].rank))
            });

        let (index, reason) = match chosen {
            None => {
                // Everything is under pressure or unknown: least work wins.
                let i = (0..n).min_by(|&a, &b| {
                    least_loaded::work(&candidates[a], ctx, self.stale_after)
                        .total_cmp(&least_loaded::work(&candidates[b], ctx, self.stale_after))
                })?;
                (i, RouteReason::Fallback)
            }
            Some(i) if i == preferred => (i, RouteReason::Affinity),
            Some(i) => {
                let reason = match views[preferred].blocked {
                    Blocked::Kv => RouteReason::SpillKv,
                    Blocked::Queue => RouteReason::SpillQueue,
                    Blocked::Stale => RouteReason::SpillStale,
                    Blocked::No if views[preferred].in_flight >= bound => RouteReason::SpillLoad,
                    Blocked::No => RouteReason::LeastLoaded,
                };
                (i, reason)
            }
        };
        if !ctx.hashes.is_empty() {
            views[index].memory.prefixes.lock().insert(ctx.hashes);
        }
        Some(Decision { index, reason })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::routing::LoadView;
    use crate::routing::least_loaded::LeastLoaded;

    fn replicas(n: usize) -> Vec<ReplicaView> {
        (0..n)
            .map(|i| ReplicaView {
                name: Arc::from(format!("10.0.0.{i}:8000")),
                in_flight: 0,
                load: Some(sample(0.1, 0.0)),
                tpot: None,
            })
            .collect()
    }

    fn sample(kv: f64, waiting: f64) -> LoadView {
        LoadView {
            kv_usage: Some(kv),
            waiting: Some(waiting),
            running: Some(1.0),
            at: Instant::now(),
        }
    }

    fn policy() -> PrefixKv {
        PrefixKv::new(
            PrefixKvConfig::default(),
            Some(Duration::from_secs(5)),
            Affinity::new(1024),
        )
    }

    fn pick(p: &PrefixKv, reps: &[ReplicaView], hashes: &[u64]) -> Decision {
        let ctx = RouteCtx {
            model: "m",
            hashes,
            now: Instant::now(),
        };
        p.pick(&ctx, reps).unwrap_or(Decision {
            index: usize::MAX,
            reason: RouteReason::Retry,
        })
    }

    #[test]
    fn independent_gateways_agree_and_prefixes_spread() {
        let (a, b) = (replicas(4), replicas(4));
        let (pa, pb) = (policy(), policy());
        let mut used = std::collections::HashSet::new();
        for key in 0..40u64 {
            let h = [key, key + 1000];
            let da = pick(&pa, &a, &h);
            let db = pick(&pb, &b, &h);
            assert_eq!(da.index, db.index, "prefix {key}");
            assert_eq!(da.reason, RouteReason::Affinity);
            used.insert(da.index);
        }
        assert_eq!(used.len(), 4, "40 prefixes use all 4 replicas");
    }

    #[test]
    fn pressure_and_staleness_spill() {
        let mut reps = replicas(3);
        let p = policy();
        let h = [7, 8, 9];
        let home = pick(&p, &reps, &h).index;
        reps[home].load = Some(sample(0.97, 0.0));
        let d = pick(&p, &reps, &h);
        assert_ne!(d.index, home);
        assert_eq!(d.reason, RouteReason::SpillKv);
        reps[home].load = Some(sample(0.2, 50.0));
        assert_eq!(pick(&p, &reps, &h).reason, RouteReason::SpillQueue);
        let mut old = sample(0.1, 0.0);
        old.at = Instant::now() - Duration::from_secs(60);
        reps[home].load = Some(old);
        assert_eq!(pick(&p, &reps, &h).reason, RouteReason::SpillStale);
        reps[home].load = Some(sample(0.1, 0.0));
        let back = pick(&p, &reps, &h);
        assert_eq!((back.index, back.reason), (home, RouteReason::Affinity));
        for r in &mut reps {
            r.load = Some(sample(0.99, 0.0));
        }
        assert_eq!(pick(&p, &reps, &h).reason, RouteReason::Fallback);
    }

    #[test]
    fn stale_metrics_count_as_saturated_for_least_loaded() {
        let mut reps = replicas(2);
        let ll = LeastLoaded::new(Some(Duration::from_secs(5)));
        let ctx = RouteCtx {
            model: "m",
            hashes: &[],
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
    fn a_hot_prefix_spreads_under_bounded_loads() {
        let mut reps = replicas(3);
        let p = policy();
        let h = [42, 43];
        let mut per = [0usize; 3];
        let mut spilled = 0;
        for _ in 0..12 {
            let d = pick(&p, &reps, &h);
            per[d.index] += 1;
            spilled += usize::from(d.reason == RouteReason::SpillLoad);
            reps[d.index].in_flight += 1;
        }
        // No replica beyond its bounded share (load_factor x 12 / 3, plus the
        // request that reaches the bound), and more than one replica used.
        let share = (PrefixKvConfig::default().load_factor * 12.0 / 3.0).ceil() as usize + 1;
        assert!(per.iter().all(|&n| n <= share), "{per:?}");
        assert!(per.iter().filter(|&&n| n > 0).count() >= 2, "{per:?}");
        assert!(spilled > 0);
    }
}
