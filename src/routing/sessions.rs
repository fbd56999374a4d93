//! Sessions this gateway has placed: session key -> the replica holding its
//! history, so that a conversation's next turn goes back there.
//!
//! Bounded: at most `capacity` sessions (rounded up to a multiple of 128),
//! each forgotten `ttl` after it was last seen. The table is
//! set-associative: a key can only live in the eight slots of its set (two
//! cache lines, read together), and a new key in a full set takes the place
//! of the one seen least recently there. So a decision touches one set, and
//! the insert after a lookup writes the lines the lookup brought in.
//!
//! Why not a `HashMap` of entries, as before: every request of a workload of
//! new conversations inserted a new key, and that store missed the cache
//! (an entry of 48 bytes in a table of up to 100,000); the shard's unlock
//! right after it waited for it. `Sessions::place` was the gateway's largest
//! user-space item in a `perf` profile of non-streamed requests, 2.75-2.9%
//! of all CPU, and a full shard also paid a scan to evict an eighth of it
//! (docs/benchmarks-log.md, "2026-11-26 afternoon"). Slots here are 16 bytes:
//! the replica is an index into the shard's few names, the time a 32-bit
//! count of sixteenths of a second. The tests below hold the table to a
//! plain model of per-set LRU (`Model`).
//!
//! What that costs: eviction is least recently seen within a set, not over
//! the whole table, so a live session can go while other sets have room when
//! more than eight live keys share its set. With keys hashed over the
//! default 12,500 sets (100,000 sessions), the share of live sessions so
//! displaced (the least recently seen of their set) is about 2 in 10^7 at
//! 10,000 live, 1.5 in 10^4 at 25,000 and 0.8% at 50,000 (Poisson, with the
//! excess over eight per set). Eight ways rather than four (one line): four
//! displace 4.5x as many at 50,000 and 700x at 10,000.
//!
//! Times are sixteenths of a second since the table was made, in 32 bits,
//! and an age is their wrapping difference: ages up to 2^31 ticks (4.25
//! years) read as they are, older ones as "just now" (a decision that read
//! the clock before the one that placed an entry). So a TTL is at most half
//! that (2.1 years), an entry past its TTL reads as expired for years, and
//! any place in its set empties it; only one left 4.25 years in a set
//! nobody wrote to could come back (a routing hint to where it was).
//!
//! Sharded by key (16 locks, each on its own cache line), so decisions on
//! different sessions rarely meet. A slot is two atomic words, written only
//! under its shard's lock; [`Sessions::warm`] reads a set without the lock,
//! to bring its lines in beside the decision's other loads (a lock's atomic
//! instruction waits for the loads before it, so they must all be issued
//! before the first one).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

const SHARDS: usize = 16;
/// Slots per set: 8 x 16 bytes, two cache lines.
const WAYS: usize = 8;
/// Names a shard keeps before it drops those no slot points at.
const NAMES: usize = 1024;
/// A tick of the table's clock: a sixteenth of a second.
const TICK_NANOS: u32 = 62_500_000;
/// The longest age that reads as an age, in ticks (older reads as "just
/// now"): 4.25 years.
const HORIZON: u32 = i32::MAX as u32;
/// The longest TTL, in ticks: half the horizon (2.1 years).
const MAX_TTL: u32 = HORIZON / 2;

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

/// One remembered session; `turns == 0`: an empty slot.
#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    key: u64,
    /// Ticks since the table's epoch, modulo 2^32.
    seen: u32,
    /// Index into the shard's `names`.
    name: u16,
    turns: u16,
}

/// Eight slots, two words each: the key, then `seen | name << 32 | turns
/// << 48`.
#[repr(align(128))]
struct Set([AtomicU64; 2 * WAYS]);

impl Default for Set {
    fn default() -> Self {
        Self(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl Set {
    fn get(&self, i: usize) -> Slot {
        let meta = self.0[2 * i + 1].load(Relaxed);
        Slot {
            key: self.0[2 * i].load(Relaxed),
            seen: meta as u32,
            name: (meta >> 32) as u16,
            turns: (meta >> 48) as u16,
        }
    }

    fn put(&self, i: usize, s: Slot) {
        self.0[2 * i].store(s.key, Relaxed);
        let meta = u64::from(s.seen) | u64::from(s.name) << 32 | u64::from(s.turns) << 48;
        self.0[2 * i + 1].store(meta, Relaxed);
    }

    fn slots(&self) -> [Slot; WAYS] {
        std::array::from_fn(|i| self.get(i))
    }
}

/// What a shard's lock guards: its names, its count, and the right to write
/// its sets.
struct Shard {
    /// The replicas slots point at (by index), each name once.
    names: Vec<Arc<str>>,
    /// Occupied slots (expired ones included until taken or forgotten).
    occupied: usize,
}

/// A shard: its lock on a cache line of its own, and its sets (written
/// under the lock, read without it only by `warm`).
#[repr(align(64))]
struct Padded {
    lock: Mutex<Shard>,
    sets: Box<[Set]>,
}

pub(crate) struct Sessions {
    shards: Box<[Padded]>,
    sets_per_shard: usize,
    epoch: Instant,
    /// The TTL in ticks (at most `MAX_TTL`); 0: nothing is kept.
    ttl: u32,
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
        let sets_per_shard = capacity.div_ceil(SHARDS * WAYS).max(1);
        Self {
            shards: (0..SHARDS)
                .map(|_| Padded {
                    lock: Mutex::new(Shard {
                        names: Vec::new(),
                        occupied: 0,
                    }),
                    sets: (0..sets_per_shard).map(|_| Set::default()).collect(),
                })
                .collect(),
            sets_per_shard,
            epoch: Instant::now(),
            // Rounded up: a TTL under a tick still keeps entries for one.
            ttl: u32::try_from(ttl.as_nanos().div_ceil(u128::from(TICK_NANOS)))
                .unwrap_or(MAX_TTL)
                .min(MAX_TTL),
        }
    }

    /// `now` in the table's ticks (modulo 2^32; before the epoch too, so
    /// that every age is a wrapping difference).
    fn ticks(&self, now: Instant) -> u32 {
        let since = |d: Duration| {
            (d.as_secs() as u32)
                .wrapping_mul(1_000_000_000 / TICK_NANOS)
                .wrapping_add(d.subsec_nanos() / TICK_NANOS)
        };
        match now.checked_duration_since(self.epoch) {
            Some(d) => since(d),
            None => since(self.epoch - now).wrapping_neg(),
        }
    }

    /// The shard and the set of `key`: its low bits pick the shard, its
    /// high ones the set (the keys are hashes already).
    fn place_of(&self, key: u64) -> (&Padded, usize) {
        let shard = &self.shards[(key as usize) % SHARDS];
        let set = ((key >> 32) * self.sets_per_shard as u64) >> 32;
        (shard, set as usize)
    }

    /// Load `key`'s set (both lines) without taking its lock: issued with a
    /// decision's other table loads, their misses overlap instead of each
    /// waiting for the one before.
    pub(crate) fn warm(&self, key: u64) {
        let (shard, set) = self.place_of(key);
        let set = &shard.sets[set].0;
        std::hint::black_box(set[0].load(Relaxed) | set[WAYS].load(Relaxed));
    }

    /// Whether a slot is live at `now`.
    fn live(&self, slot: &Slot, now: u32) -> bool {
        slot.turns != 0 && age(now, slot.seen) < self.ttl
    }

    /// The replica session `key` was last placed on, if remembered.
    pub(crate) fn get(&self, key: u64, now: Instant) -> Option<Arc<str>> {
        self.find(key, now, |shard, s| {
            shard.names[usize::from(s.name)].clone()
        })
    }

    /// Whether session `key` is remembered (`get` without the name).
    pub(crate) fn contains(&self, key: u64, now: Instant) -> bool {
        self.find(key, now, |_, _| ()).is_some()
    }

    /// `read` of session `key`'s live slot, under its shard's lock.
    fn find<R>(&self, key: u64, now: Instant, read: impl FnOnce(&Shard, &Slot) -> R) -> Option<R> {
        let now = self.ticks(now);
        let (shard, set) = self.place_of(key);
        let lock = shard.lock.lock();
        let set = &shard.sets[set];
        // Keys first: the rest of a slot only where the key matches.
        let slot = (0..WAYS)
            .filter(|&i| set.0[2 * i].load(Relaxed) == key)
            .map(|i| set.get(i))
            .find(|s| self.live(s, now))?;
        Some(read(&lock, &slot))
    }

    /// Session `key`'s turn went to `replica` at `now`; whether it had been
    /// on another replica before (a move).
    pub(crate) fn place(&self, key: u64, replica: &Arc<str>, now: Instant) -> bool {
        if self.ttl == 0 {
            return false;
        }
        let now = self.ticks(now);
        let (padded, set) = self.place_of(key);
        let mut lock = padded.lock.lock();
        let shard = &mut *lock;
        let Some(name) = shard.name(&padded.sets, replica, now, self.ttl) else {
            // Over a thousand live replicas in one shard: this one is not
            // kept, and the key no longer points at where it was.
            shard.forget(&padded.sets[set], key);
            return false;
        };
        let set = &padded.sets[set];
        let mut slots = set.slots();
        // The key's slot if live, else an empty or expired one, else the one
        // seen least recently.
        let mut found = None;
        let mut free = None;
        let mut oldest = (0, 0u32);
        for (i, s) in slots.iter_mut().enumerate() {
            if s.turns != 0 && age(now, s.seen) >= self.ttl {
                // Expired: emptied here, so that no set that is written to
                // keeps an entry long enough for its age to wrap.
                *s = Slot::default();
                set.put(i, *s);
                shard.occupied -= 1;
            }
            if s.turns == 0 {
                free.get_or_insert(i);
            } else if s.key == key {
                found = Some(i);
            } else if age(now, s.seen) >= oldest.1 {
                oldest = (i, age(now, s.seen));
            }
        }
        if let Some(i) = found {
            let s = &mut slots[i];
            let moved = s.name != name;
            s.name = name;
            s.seen = now;
            s.turns = s.turns.saturating_add(1);
            set.put(i, *s);
            return moved;
        }
        let i = match free {
            Some(i) => {
                shard.occupied += 1;
                i
            }
            None => oldest.0,
        };
        set.put(
            i,
            Slot {
                key,
                seen: now,
                name,
                turns: 1,
            },
        );
        false
    }

    /// Forget `key`.
    pub(crate) fn forget(&self, key: u64) {
        let (shard, set) = self.place_of(key);
        shard.lock.lock().forget(&shard.sets[set], key);
    }

    /// Sessions remembered now (expired ones included until their slot is
    /// taken).
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock.lock().occupied).sum()
    }

    /// Every live session, with the name of its replica.
    fn each_live(&self, now: Instant, mut f: impl FnMut(u64, &Arc<str>, u32, u16)) {
        let now = self.ticks(now);
        for shard in &self.shards {
            let lock = shard.lock.lock();
            for s in shard.sets.iter().flat_map(Set::slots) {
                if self.live(&s, now) {
                    f(
                        s.key,
                        &lock.names[usize::from(s.name)],
                        age(now, s.seen),
                        s.turns,
                    );
                }
            }
        }
    }

    /// Live sessions per replica.
    pub(crate) fn per_replica(&self, now: Instant) -> HashMap<Arc<str>, usize> {
        let mut out = HashMap::new();
        self.each_live(now, |_, name, _, _| {
            *out.entry(name.clone()).or_insert(0) += 1;
        });
        out
    }

    /// The most recently seen sessions, at most `limit`.
    pub(crate) fn recent(&self, limit: usize, now: Instant) -> Vec<SessionView> {
        let mut all = Vec::new();
        self.each_live(now, |key, name, idle, turns| {
            all.push(SessionView {
                key,
                replica: name.clone(),
                idle: Duration::from_nanos(u64::from(idle) * u64::from(TICK_NANOS)),
                turns: u32::from(turns),
            });
        });
        all.sort_by_key(|v| v.idle);
        all.truncate(limit);
        all
    }
}

impl Shard {
    /// Empty `key`'s slot in `set` (one of this shard's), if it has one.
    fn forget(&mut self, set: &Set, key: u64) {
        for (i, s) in set.slots().into_iter().enumerate() {
            if s.turns != 0 && s.key == key {
                set.put(i, Slot::default());
                self.occupied -= 1;
            }
        }
    }

    /// The index of `replica`'s name, added if new (`None`: the shard holds
    /// `NAMES` names that live slots point at).
    fn name(&mut self, sets: &[Set], replica: &Arc<str>, now: u32, ttl: u32) -> Option<u16> {
        let find = |names: &[Arc<str>]| {
            names
                .iter()
                .position(|n| Arc::ptr_eq(n, replica) || **n == **replica)
        };
        if let Some(i) = find(&self.names) {
            return u16::try_from(i).ok();
        }
        if self.names.len() >= NAMES {
            self.drop_unused_names(sets, now, ttl);
            if self.names.len() >= NAMES {
                return None;
            }
        }
        self.names.push(replica.clone());
        u16::try_from(self.names.len() - 1).ok()
    }

    /// Drop the names no live slot points at (replicas long gone, with
    /// discovery renaming them), renumbering the slots; expired slots are
    /// emptied first.
    fn drop_unused_names(&mut self, sets: &[Set], now: u32, ttl: u32) {
        for set in sets {
            for (i, s) in set.slots().into_iter().enumerate() {
                if s.turns != 0 && age(now, s.seen) >= ttl {
                    set.put(i, Slot::default());
                    self.occupied -= 1;
                }
            }
        }
        let mut used = vec![false; self.names.len()];
        for s in sets.iter().flat_map(Set::slots).filter(|s| s.turns != 0) {
            used[usize::from(s.name)] = true;
        }
        let mut renumbered = vec![0u16; self.names.len()];
        let mut next = 0u16;
        for (i, u) in used.iter().enumerate() {
            if *u {
                renumbered[i] = next;
                next += 1;
            }
        }
        let mut i = 0;
        self.names.retain(|_| {
            i += 1;
            used[i - 1]
        });
        for set in sets {
            for (i, mut s) in set.slots().into_iter().enumerate() {
                if s.turns != 0 {
                    s.name = renumbered[usize::from(s.name)];
                    set.put(i, s);
                }
            }
        }
    }
}

/// How long before `now` a slot was seen, in ticks: the wrapping
/// difference, with ages past the horizon (a slot seen after `now`, by a
/// decision that read the clock later) taken as 0.
fn age(now: u32, seen: u32) -> u32 {
    let a = now.wrapping_sub(seen);
    if a > HORIZON { 0 } else { a }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key of shard `shard` and of its first set, told apart by `n` (a
    /// table of at most 128 sessions has one set per shard).
    fn key(shard: u64, n: u64) -> u64 {
        (n << 4) | shard
    }

    /// A key of shard `shard` and set `set` of a table with `per_shard` sets
    /// a shard, told apart by `n`.
    fn in_set(shard: u64, set: u64, per_shard: u64, n: u64) -> u64 {
        let high = (set << 32).div_ceil(per_shard);
        (high << 32) | (n << 4) | shard
    }

    /// `n` ticks of the table's clock.
    fn tick(n: u64) -> Duration {
        Duration::from_nanos(n * u64::from(TICK_NANOS))
    }

    #[test]
    fn sessions_are_remembered_moved_forgotten_and_bounded() {
        let s = Sessions::new(32, Duration::from_secs(60));
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let t0 = Instant::now();
        assert!(!s.place(1, &a, t0));
        assert_eq!(s.get(1, t0).as_deref(), Some("a"));
        assert!(s.contains(1, t0));
        assert!(s.place(1, &b, t0), "a move is reported");
        assert!(!s.place(1, &b, t0));
        // The same name in another allocation is the same replica.
        assert!(!s.place(1, &Arc::from("b"), t0));
        assert_eq!(s.recent(10, t0)[0].turns, 4);
        // Forgotten after the TTL.
        let later = t0 + Duration::from_secs(61);
        assert_eq!(s.get(1, later), None);
        assert!(!s.contains(1, later));
        // And not a move when it comes back elsewhere: it was forgotten.
        assert!(!s.place(1, &a, later));
        assert_eq!(s.recent(10, later)[0].turns, 1);
        s.forget(1);
        assert_eq!(s.get(1, later), None);
        assert_eq!(s.len(), 0);
        // Bounded: 32 rounds up to one set of 8 per shard; keys of one shard
        // share it, and the least recently seen goes first.
        for n in 0..1000u64 {
            s.place(key(0, n), &a, t0 + tick(n));
        }
        s.place(key(3, 0), &b, t0 + tick(500));
        assert_eq!(s.len(), 8 + 1);
        let at = t0 + tick(1000);
        assert!((992..1000).all(|n| s.get(key(0, n), at).is_some()));
        assert_eq!(s.get(key(0, 991), at), None, "the oldest went");
        assert_eq!(s.per_replica(at).get("a"), Some(&8));
        assert_eq!(s.per_replica(at).get("b"), Some(&1));
        let recent = s.recent(3, at);
        assert_eq!(
            recent.iter().map(|v| v.key).collect::<Vec<_>>(),
            [key(0, 999), key(0, 998), key(0, 997)]
        );
        assert_eq!(recent[0].idle, tick(1));
    }

    #[test]
    fn keys_spread_over_every_set() {
        // 1,600 hashed keys in room for 12,800 (100 sets of 8 per shard):
        // one per set on average, so all stay unless sets are chosen badly
        // (nine in one set of a good spread: about one chance in 600 for
        // the table, and these keys are fixed).
        let s = Sessions::new(12_800, Duration::from_secs(60));
        let a: Arc<str> = Arc::from("a");
        let t0 = Instant::now();
        let keys: Vec<u64> = (0..1_600u64)
            .map(|n| id_key("test", &n.to_string()))
            .collect();
        for &k in &keys {
            s.place(k, &a, t0);
        }
        assert_eq!(s.len(), keys.len());
        assert!(keys.iter().all(|&k| s.contains(k, t0)));
    }

    #[test]
    fn a_full_set_gives_up_expired_slots_before_live_ones() {
        let s = Sessions::new(1, Duration::from_secs(10));
        let a: Arc<str> = Arc::from("a");
        let t0 = Instant::now();
        for n in 0..8u64 {
            s.place(key(5, n), &a, t0 + Duration::from_secs(n));
        }
        // At 12 s, keys 0 to 2 (seen at 0-2 s) have expired; 3 is the oldest
        // live one and stays.
        let t = t0 + Duration::from_secs(12);
        s.place(key(5, 100), &a, t);
        assert_eq!(s.len(), 8 - 3 + 1, "the expired slots were emptied");
        assert!((3..8).all(|n| s.contains(key(5, n), t)));
        assert!(s.contains(key(5, 100), t));
        // No TTL: nothing is kept.
        let none = Sessions::new(100, Duration::ZERO);
        assert!(!none.place(1, &a, t0));
        assert_eq!(none.get(1, t0), None);
    }

    #[test]
    fn a_shard_drops_the_names_no_slot_points_at() {
        let s = Sessions::new(1, Duration::from_secs(3600));
        let t0 = Instant::now();
        // One shard, one set: each new replica name takes the set's oldest
        // slot, so at most 8 names are pointed at while over a thousand are
        // seen.
        for n in 0..3000u64 {
            let name: Arc<str> = Arc::from(format!("r{n}"));
            assert!(!s.place(key(7, n), &name, t0 + tick(n)));
        }
        let at = t0 + tick(3000);
        assert!(s.shards[7].lock.lock().names.len() <= NAMES);
        for n in 2992..3000u64 {
            assert_eq!(s.get(key(7, n), at).as_deref(), Some(&*format!("r{n}")));
        }
    }

    #[test]
    fn a_key_whose_replica_cannot_be_named_is_forgotten() {
        // 200 sets of 8 a shard: room for 1,600 live sessions in shard 0.
        let s = Sessions::new(200 * 8 * SHARDS, Duration::from_secs(3600));
        let t0 = Instant::now();
        let old: Arc<str> = Arc::from("old");
        let first = in_set(0, 0, 200, 0);
        s.place(first, &old, t0);
        // 1,023 more live sessions, each on a replica of its own: the
        // shard's names are full, every one pointed at.
        for n in 1..NAMES as u64 {
            let name: Arc<str> = Arc::from(format!("r{n}"));
            s.place(in_set(0, n / 8, 200, n % 8), &name, t0);
        }
        assert_eq!(s.shards[0].lock.lock().names.len(), NAMES);
        // The first session's next turn goes to yet another replica: it
        // cannot be named, so it is forgotten rather than left pointing at
        // the old one.
        assert!(!s.place(first, &Arc::from("new"), t0));
        assert_eq!(s.get(first, t0), None);
        assert_eq!(s.len(), NAMES - 1);
        // Once the others expire, their names go and new ones fit again.
        let later = t0 + Duration::from_secs(3601);
        assert!(!s.place(first, &Arc::from("new"), later));
        assert_eq!(s.get(first, later).as_deref(), Some("new"));
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn ages_wrap_and_a_clock_read_later_is_now() {
        assert_eq!(age(10, 3), 7);
        assert_eq!(age(3, u32::MAX - 1), 5, "across the wrap");
        assert_eq!(age(3, 10), 0, "seen after now");
        let s = Sessions::new(1, Duration::from_secs(60));
        let a: Arc<str> = Arc::from("a");
        // Instants before the table's epoch are ages too.
        let before = s.epoch - Duration::from_secs(5);
        s.place(9, &a, before);
        assert!(s.contains(9, s.epoch));
        assert_eq!(s.recent(1, s.epoch)[0].idle, Duration::from_secs(5));
        // A decision that read the clock earlier than the one that placed it.
        assert!(s.contains(9, before - tick(3)));
        // The longest TTL leaves years between expiry and the horizon.
        let long = Sessions::new(1, Duration::from_secs(100 * 365 * 86_400));
        assert_eq!(long.ttl, MAX_TTL);
        long.place(9, &a, long.epoch);
        assert!(!long.contains(9, long.epoch + tick(u64::from(MAX_TTL))));
    }

    /// The table as specified, written plainly: per set (shard by the low
    /// bits, set by the high ones), at most `WAYS` entries; a place empties
    /// the set's expired entries first, then updates the key's or adds it,
    /// pushing out the one seen least recently when the set is full.
    #[derive(Default)]
    struct Model {
        sets: HashMap<(u64, u64), Vec<Kept>>,
    }

    /// Key, seen (ticks), replica, turns.
    type Kept = (u64, u64, &'static str, u32);

    impl Model {
        fn set(key: u64, per_shard: u64) -> (u64, u64) {
            (key % SHARDS as u64, ((key >> 32) * per_shard) >> 32)
        }

        fn place(&mut self, key: u64, name: &'static str, now: u64, ttl: u64, ps: u64) -> bool {
            let set = self.sets.entry(Self::set(key, ps)).or_default();
            set.retain(|e| now - e.1 < ttl);
            if let Some(e) = set.iter_mut().find(|e| e.0 == key) {
                let moved = e.2 != name;
                *e = (key, now, name, e.3 + 1);
                return moved;
            }
            if set.len() == WAYS {
                let oldest = (0..WAYS).min_by_key(|&i| set[i].1).unwrap();
                set.remove(oldest);
            }
            set.push((key, now, name, 1));
            false
        }

        fn get(&self, key: u64, now: u64, ttl: u64, ps: u64) -> Option<&'static str> {
            self.sets
                .get(&Self::set(key, ps))?
                .iter()
                .find(|e| e.0 == key && now - e.1 < ttl)
                .map(|e| e.2)
        }
    }

    proptest::proptest! {
        /// The table keeps exactly what the model keeps, and reports the
        /// same moves: any order of places and forgets of keys that crowd a
        /// few sets, any pace, any TTL.
        #[test]
        fn the_table_is_per_set_lru(
            capacity in proptest::sample::select(vec![1usize, 128, 300, 1000]),
            ttl in 1u64..200,
            ops in proptest::collection::vec(
                (0u64..48, 0usize..3, 1u64..20, proptest::bool::weighted(0.1)),
                1..400,
            ),
        ) {
            const NAMES: [&str; 3] = ["a", "b", "c"];
            let s = Sessions::new(capacity, tick(ttl));
            let ps = s.sets_per_shard as u64;
            let names: Vec<Arc<str>> = NAMES.iter().map(|n| Arc::from(*n)).collect();
            // 48 keys: 3 shards' worth of 16, spread over high bits.
            let keys: Vec<u64> = (0..48u64)
                .map(|i| (i % 3) | (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) & !0xf))
                .collect();
            let mut model = Model::default();
            let mut now = 0u64;
            for (k, n, step, forget) in ops {
                now += step;
                let at = s.epoch + tick(now);
                let key = keys[k as usize];
                // Warming a set reads it and changes nothing.
                s.warm(key);
                if forget {
                    s.forget(key);
                    if let Some(set) = model.sets.get_mut(&Model::set(key, ps)) {
                        set.retain(|e| e.0 != key);
                    }
                } else {
                    let moved = s.place(key, &names[n], at);
                    proptest::prop_assert_eq!(moved, model.place(key, NAMES[n], now, ttl, ps));
                }
                for &key in &keys {
                    let got = s.get(key, at);
                    proptest::prop_assert_eq!(got.as_deref(), model.get(key, now, ttl, ps));
                }
                let live: usize = model
                    .sets
                    .values()
                    .map(|set| set.iter().filter(|e| now - e.1 < ttl).count())
                    .sum();
                proptest::prop_assert_eq!(s.per_replica(at).values().sum::<usize>(), live);
                // Expired entries count until their set is written to.
                let kept: usize = model.sets.values().map(Vec::len).sum();
                proptest::prop_assert_eq!(s.len(), kept);
            }
        }
    }
}
