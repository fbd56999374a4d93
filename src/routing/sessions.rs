//! Sessions this gateway has placed: session key -> the replica holding its
//! history, so that a conversation's next turn goes back there.
//!
//! Bounded: at most `capacity` sessions, each forgotten `ttl` after it was
//! last seen; when full, the least recently seen one goes. Sharded by key
//! (16 locks), so decisions on different sessions rarely meet. Cost: a hash
//! lookup under a short lock per decision; eviction scans one shard, only
//! when it is full.

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
        if let Some(e) = shard.get_mut(&key) {
            let moved = e.replica != *replica;
            if moved {
                e.replica = replica.clone();
            }
            e.seen = now;
            e.turns = e.turns.saturating_add(1);
            return moved;
        }
        if shard.len() >= self.per_shard {
            let ttl = self.ttl;
            shard.retain(|_, e| now.saturating_duration_since(e.seen) < ttl);
            if shard.len() >= self.per_shard
                && let Some(oldest) = shard.iter().min_by_key(|(_, e)| e.seen).map(|(k, _)| *k)
            {
                shard.remove(&oldest);
            }
        }
        shard.insert(
            key,
            Entry {
                replica: replica.clone(),
                seen: now,
                turns: 1,
            },
        );
        false
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
        assert!(s.len() <= 32 + 1, "{}", s.len());
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
