//! Sessions this gateway has placed: session key -> the replica holding its
//! history, so that a conversation's next turn goes back there.
//!
//! Bounded: at most `capacity` sessions, each forgotten `ttl` after it was
//! last seen; when full, the least recently seen go first (an eighth of a
//! shard at a time). Sharded by key (16 locks), so decisions on different
//! sessions rarely meet. Cost: a hash lookup under a short lock per
//! decision; eviction scans one shard when it is full, which frees an
//! eighth of it.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::index::Identity;

const SHARDS: usize = 16;

/// The key of an id from `source` (a header name, `prompt_cache_key`,
/// `previous_response_id`...): the same id from two sources differs.
pub(crate) fn id_key(source: &str, id: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(
        id.as_bytes(),
        xxhash_rust::xxh3::xxh3_64(source.as_bytes()),
    )
}

/// The key a response id is remembered by (its `previous_response_id` key).
pub(crate) fn response_key(id: &str) -> u64 {
    id_key("previous_response_id", id)
}

#[derive(Debug, Clone)]
struct Entry {
    replica: Arc<str>,
    seen: Instant,
    turns: u32,
}

type Shard = HashMap<u64, Entry, BuildHasherDefault<Identity>>;

pub(crate) struct Sessions {
    shards: Vec<Mutex<Shard>>,
    per_shard: usize,
    ttl: Duration,
}

/// One session, for `/admin/routing`.
#[derive(Debug, Clone)]
pub(crate) struct SessionView {
    pub(crate) key: u64,
    pub(crate) replica: Arc<str>,
    pub(crate) idle: Duration,
    pub(crate) turns: u32,
}

impl Sessions {
    pub(crate) fn new(capacity: usize, ttl: Duration) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            per_shard: capacity.div_ceil(SHARDS).max(1),
            ttl,
        }
    }

    fn shard(&self, key: u64) -> &Mutex<Shard> {
        // The keys are hashes already: their low bits pick the shard.
        &self.shards[(key as usize) % SHARDS]
    }

    /// The replica session `key` was last placed on, if remembered.
    pub(crate) fn get(&self, key: u64, now: Instant) -> Option<Arc<str>> {
        let shard = self.shard(key).lock();
        shard
            .get(&key)
            .filter(|e| now.saturating_duration_since(e.seen) < self.ttl)
            .map(|e| e.replica.clone())
    }

    /// Session `key`'s turn went to `replica` at `now`; whether it had been
    /// on another replica before (a move).
    pub(crate) fn place(&self, key: u64, replica: &Arc<str>, now: Instant) -> bool {
        let mut shard = self.shard(key).lock();
        // Room first (a new key in a full shard), then one probe for the
        // key: a lookup and then an insert probed twice.
        if shard.len() >= self.per_shard && !shard.contains_key(&key) {
            evict(&mut shard, self.ttl, now);
        }
        match shard.entry(key) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                let e = e.get_mut();
                let moved = e.replica != *replica;
                if moved {
                    e.replica = replica.clone();
                }
                e.seen = now;
                e.turns = e.turns.saturating_add(1);
                moved
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Entry {
                    replica: replica.clone(),
                    seen: now,
                    turns: 1,
                });
                false
            }
        }
    }

    /// Forget `key`.
    pub(crate) fn forget(&self, key: u64) {
        self.shard(key).lock().remove(&key);
    }

    /// Sessions remembered now (expired ones included until evicted).
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// Live sessions per replica.
    pub(crate) fn per_replica(&self, now: Instant) -> HashMap<Arc<str>, usize> {
        let mut out = HashMap::new();
        for s in &self.shards {
            for e in s.lock().values() {
                if now.saturating_duration_since(e.seen) < self.ttl {
                    *out.entry(e.replica.clone()).or_insert(0) += 1;
                }
            }
        }
        out
    }

    /// The most recently seen sessions, at most `limit`.
    pub(crate) fn recent(&self, limit: usize, now: Instant) -> Vec<SessionView> {
        let mut all: Vec<SessionView> = self
            .shards
            .iter()
            .flat_map(|s| {
                s.lock()
                    .iter()
                    .map(|(k, e)| SessionView {
                        key: *k,
                        replica: e.replica.clone(),
                        idle: now.saturating_duration_since(e.seen),
                        turns: e.turns,
                    })
                    .collect::<Vec<_>>()
            })
            .filter(|v| v.idle < self.ttl)
            .collect();
        all.sort_by_key(|v| v.idle);
        all.truncate(limit);
        all
    }
}

/// Make room in a full shard: drop the expired entries and, if that frees
/// less than an eighth, the least recently seen entries down to seven
/// eighths. Every scan of the shard then buys at least an eighth of it in
/// inserts: O(1) per insert amortised, where evicting one entry per insert
/// scanned the whole shard every time (a `perf` profile of non-streamed
/// requests with distinct prompts showed those scans as the gateway's
/// largest user-space item once a table filled). Stopping after the expired
/// ones whenever any expired would bring the scan per insert back when
/// entries expire about as fast as new ones come.
///
/// Entries are compared by when they were seen, not by how long ago: the
/// duration per entry cost a clock subtraction each (~40 instructions), and
/// these scans were most of `Sessions::place`'s time in a `perf` profile of
/// non-streamed requests (docs/BENCHMARKS.md, "2026-11-26 midday"). The test
/// below holds this to the earlier reading by durations.
fn evict(shard: &mut Shard, ttl: Duration, now: Instant) {
    let full = shard.len();
    // At least one goes (a shard of fewer than 8 has no eighth).
    let keep = full - (full / 8).max(1);
    // Expired: seen `ttl` or longer before `now` (with no TTL, everything,
    // as the reading by durations had it). No such instant: none.
    if ttl.is_zero() {
        shard.clear();
        return;
    }
    if let Some(expired) = now.checked_sub(ttl) {
        shard.retain(|_, e| e.seen > expired);
    }
    if shard.len() <= keep {
        return;
    }
    let mut seen: Vec<Instant> = shard.values().map(|e| e.seen).collect();
    // The (len - keep)-th oldest: it and every older one go.
    let k = (seen.len() - keep).saturating_sub(1);
    let (_, &mut cutoff, _) = seen.select_nth_unstable(k);
    shard.retain(|_, e| e.seen > cutoff);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_are_remembered_moved_forgotten_and_bounded() {
        let s = Sessions::new(32, Duration::from_secs(60));
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let t0 = Instant::now();
        assert!(!s.place(1, &a, t0));
        assert_eq!(s.get(1, t0).as_deref(), Some("a"));
        assert!(s.place(1, &b, t0), "a move is reported");
        assert!(!s.place(1, &b, t0));
        assert_eq!(s.recent(10, t0)[0].turns, 3);
        // Forgotten after the TTL.
        assert_eq!(s.get(1, t0 + Duration::from_secs(61)), None);
        // Bounded: 32 in all (2 per shard); the oldest of a shard goes first.
        for k in 0..1000u64 {
            s.place(k * 16, &a, t0 + Duration::from_millis(k));
        }
        // Keys 16 apart share one shard: it holds its 2, beside key 1's.
        assert_eq!(s.len(), 2 + 1);
        assert_eq!(
            s.get(999 * 16, t0 + Duration::from_secs(1)).as_deref(),
            Some("a")
        );
        assert_eq!(
            s.get(0, t0 + Duration::from_secs(1)),
            None,
            "the oldest went"
        );
    }
}

#[cfg(test)]
mod eviction {
    use super::*;

    #[test]
    fn a_full_shard_loses_its_oldest_eighth_once_and_keeps_the_rest() {
        // One shard's worth: keys 16 apart land in one shard of 64.
        let s = Sessions::new(64 * SHARDS, Duration::from_secs(3600));
        let a: Arc<str> = Arc::from("a");
        let t0 = Instant::now();
        for k in 0..64u64 {
            s.place(k * 16, &a, t0 + Duration::from_millis(k));
        }
        assert_eq!(s.len(), 64);
        // The 65th: the oldest eighth (8) goes, the newest stay.
        s.place(64 * 16, &a, t0 + Duration::from_millis(64));
        assert_eq!(s.len(), 64 - 8 + 1);
        let at = t0 + Duration::from_secs(1);
        assert!((0..8u64).all(|k| s.get(k * 16, at).is_none()));
        assert!((8..=64u64).all(|k| s.get(k * 16, at).is_some()));
        // Room for 7 more without another eviction.
        for k in 65..72u64 {
            s.place(k * 16, &a, t0 + Duration::from_millis(k));
        }
        assert_eq!(s.len(), 64);
        // Expired entries go before any live one.
        let later = t0 + Duration::from_secs(3600) + Duration::from_millis(30);
        s.place(72 * 16, &a, later);
        assert_eq!(s.len(), 64 - 23 + 1, "keys 8 to 30 (seen by 30 ms) expired");
        // Full again; then only two expire (keys 31 and 32): the oldest live
        // ones go too, down to seven eighths, so the next inserts scan
        // nothing (not one scan per insert while a few expire at a time).
        for k in 73..95u64 {
            s.place(k * 16, &a, t0 + Duration::from_millis(k));
        }
        assert_eq!(s.len(), 64);
        let then = t0 + Duration::from_secs(3600) + Duration::from_millis(32);
        s.place(95 * 16, &a, then);
        assert_eq!(s.len(), 56 + 1);
        assert!((31..=38u64).all(|k| s.get(k * 16, then).is_none()));
        assert!((39..=95u64).all(|k| s.get(k * 16, then).is_some()));
    }

    /// The eviction as first written: by durations since each entry was seen.
    fn evict_by_durations(shard: &mut Shard, ttl: Duration, now: Instant) {
        let full = shard.len();
        let keep = full - (full / 8).max(1);
        shard.retain(|_, e| now.saturating_duration_since(e.seen) < ttl);
        if shard.len() <= keep {
            return;
        }
        let mut seen: Vec<Instant> = shard.values().map(|e| e.seen).collect();
        let k = (seen.len() - keep).saturating_sub(1);
        let (_, &mut cutoff, _) = seen.select_nth_unstable(k);
        shard.retain(|_, e| e.seen > cutoff);
    }

    proptest::proptest! {
        /// Comparing instants keeps exactly the entries comparing durations
        /// kept: any ages (some seen after `now`), any TTL, none included.
        #[test]
        fn eviction_by_instants_is_eviction_by_durations(
            ages in proptest::collection::vec(-50i64..5_000, 1..80),
            ttl_ms in 0u64..3_000,
        ) {
            let now = Instant::now() + Duration::from_secs(10);
            let a: Arc<str> = Arc::from("a");
            let mut ours = Shard::default();
            for (k, age) in ages.iter().enumerate() {
                let seen = if *age >= 0 {
                    now - Duration::from_millis(*age as u64)
                } else {
                    now + Duration::from_millis(age.unsigned_abs())
                };
                ours.insert(k as u64, Entry { replica: a.clone(), seen, turns: 1 });
            }
            let mut theirs = ours.clone();
            let ttl = Duration::from_millis(ttl_ms);
            evict(&mut ours, ttl, now);
            evict_by_durations(&mut theirs, ttl, now);
            let mut ours: Vec<u64> = ours.into_keys().collect();
            let mut theirs: Vec<u64> = theirs.into_keys().collect();
            ours.sort_unstable();
            theirs.sort_unstable();
            proptest::prop_assert_eq!(ours, theirs);
        }
    }
}
