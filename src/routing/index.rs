//! Per replica: which prefix blocks this gateway recently sent there.
//!
//! A set-associative table of block hashes: a hash can only live in the
//! eight slots of its set (one cache line), and a new hash in a full set
//! takes the place of the one inserted least recently there. A slot is eight
//! bytes: 32 bits of the hash (its tag; the set is chosen by other bits) and
//! the index's insert count when it was last inserted. So a lookup reads one
//! line, and inserting a prompt's blocks writes the lines its lookups read.
//!
//! A lookup finds the longest cached prefix by binary search, which assumes
//! that "block i is cached" is monotone along a prompt. The blocks of one
//! request are inserted together with one stamp, and every later prompt
//! that shares a head stamps that head again, so a head is never older
//! than its tail. Within a set, then, a head goes no sooner than its tail;
//! across sets it can, when the head's set is the fuller one, and the
//! answer is an estimate either way.
//!
//! Why not two generations of `HashSet`s, as before: with a workload of new
//! prompts, every block's lookup and insert touched a control group and a
//! bucket of each generation, lines of a table of megabytes that missed the
//! cache (`PrefixKv::pick` and `decide` were 2.9% of all CPU on a capped core,
//! `perf`, most of it waiting for those loads); and a generation's turn
//! dropped a table of 131,072 hashes and regrew the next from empty, rehashing
//! it at each doubling, in the path of the request that turned it
//! (docs/benchmarks-log.md, "2026-11-26 evening").
//!
//! The tags: two hashes meet only when they share a set and 32 bits, about
//! 8 in 2^32 for a lookup of a block not there. The insert count wraps after
//! 2^32 requests to the replica; a slot not inserted for that long may then
//! read as recent (it is still evicted when its set fills with newer ones).
//! The tests below hold the table to a plain model of per-set LRU.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use parking_lot::Mutex;

/// Slots per set: 8 x 8 bytes, one cache line.
const WAYS: usize = 8;
/// At most this many sets a decision loads ahead, over all its candidates
/// (64 lines: 4 KiB of the 32 KiB L1).
pub(crate) const WARM_BUDGET: usize = 64;

/// One set, on a cache line of its own.
#[repr(align(64))]
struct Set([AtomicU64; WAYS]);

/// A replica's index. Lookups take no lock: a slot is one atomic word, read
/// as it is. A lookup racing an insert may see some of the insert's blocks
/// and not others, which the next lookup corrects; the answer is an
/// estimate either way. Inserts and forgets take `writer` one at a time,
/// for the clock and the count.
#[doc(hidden)] // Public for the routing benchmark only.
pub struct PrefixIndex {
    /// `sets` sets; a slot is `tag << 32 | stamp`, 0 when empty. Made (8
    /// bytes a block, zeroed) on the first insert: a replica that only gets
    /// prompts shorter than a block (or none) costs no table.
    table: OnceLock<Box<[Set]>>,
    sets: u64,
    writer: Mutex<Writer>,
}

struct Writer {
    /// Inserts so far (modulo 2^32): the slots' stamps.
    clock: u32,
    len: usize,
}

/// Where hash `h` lives: its set (from the high bits of `h` mixed, so that
/// small test keys spread too) and its tag (its low 32 bits, never 0).
fn place(h: u64, sets: u64) -> (usize, u32) {
    let mixed = h.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let set = ((mixed >> 32) * sets) >> 32;
    (set as usize, (h as u32).max(1))
}

fn tag_of(slot: u64) -> u32 {
    (slot >> 32) as u32
}

/// How many of `n` blocks lead, by binary search, when `cached(i)` says
/// whether block `i` is cached and the cached ones are a prefix.
#[doc(hidden)] // Public for the routing benchmark's baseline, which shares it.
pub fn longest_prefix(n: usize, mut cached: impl FnMut(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0usize, n);
    // Invariant: the first `lo` blocks are cached; block `hi` (if any) is not.
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if cached(mid - 1) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// The blocks a binary search over `n` blocks probes first, level by level
/// (as [`PrefixIndex::longest_match`] computes them), at most `limit`.
/// (Inline lists: no allocation on a decision; a level holds at most twice
/// the budget.)
fn first_probes(n: usize, limit: usize, mut each: impl FnMut(usize)) {
    type Level = smallvec::SmallVec<[(usize, usize); 2 * WARM_BUDGET]>;
    let mut level: Level = smallvec::smallvec![(0usize, n)];
    let mut left = limit;
    while !level.is_empty() && left > 0 {
        let mut next = Level::new();
        for (lo, hi) in level {
            if lo >= hi || left == 0 {
                continue;
            }
            let mid = lo + (hi - lo).div_ceil(2);
            each(mid - 1);
            left -= 1;
            next.push((mid, hi));
            next.push((lo, mid - 1));
        }
        level = next;
    }
}

impl PrefixIndex {
    /// An index of about `capacity` hashes (rounded up to a multiple of 8).
    pub fn new(capacity: usize) -> Self {
        Self {
            table: OnceLock::new(),
            sets: capacity.div_ceil(WAYS).max(1) as u64,
            writer: Mutex::new(Writer { clock: 0, len: 0 }),
        }
    }

    /// Set `set`'s slots, if the table is made.
    fn set(&self, set: usize) -> Option<&[AtomicU64; WAYS]> {
        self.table.get().and_then(|t| t.get(set)).map(|s| &s.0)
    }

    fn contains(&self, h: u64) -> bool {
        let (set, tag) = place(h, self.sets);
        self.set(set)
            .is_some_and(|s| s.iter().any(|s| tag_of(s.load(Relaxed)) == tag))
    }

    /// How many leading blocks of `hashes` are cached here (their sets
    /// best [`warm`](Self::warm)ed first).
    pub fn longest_match(&self, hashes: &[u64]) -> usize {
        longest_prefix(hashes.len(), |i| self.contains(hashes[i]))
    }

    /// Load, without a lock, the sets of at most `limit` of a prompt's
    /// blocks together: all of a short prompt's (its insert writes them
    /// next), the first levels of the binary search's probes of a long one.
    /// The loads do not depend on each other, so their misses overlap;
    /// without this, each probe of the search waits for its set (the next
    /// probe depends on the answer), and so does each block's insert. With
    /// prompts new to the table these lines are rarely cached: the table
    /// is megabytes.
    pub fn warm(&self, hashes: &[u64], limit: usize) {
        let Some(table) = self.table.get() else {
            return;
        };
        let mut any = 0;
        let mut load = |i: usize| {
            if let Some(s) = table.get(place(hashes[i], self.sets).0) {
                any |= s.0[0].load(Relaxed);
            }
        };
        if hashes.len() <= limit {
            (0..hashes.len()).for_each(&mut load);
        } else {
            first_probes(hashes.len(), limit, &mut load);
        }
        std::hint::black_box(any);
    }

    /// These blocks were sent here now (one stamp for all of them).
    pub fn insert(&self, hashes: &[u64]) {
        if hashes.is_empty() {
            return;
        }
        let table = self.table.get_or_init(|| {
            (0..self.sets)
                .map(|_| Set(std::array::from_fn(|_| AtomicU64::new(0))))
                .collect()
        });
        let mut w = self.writer.lock();
        w.clock = w.clock.wrapping_add(1);
        let clock = w.clock;
        let stamp = u64::from(clock);
        for &h in hashes {
            let (set, tag) = place(h, self.sets);
            let Some(Set(slots)) = table.get(set) else {
                continue;
            };
            // The hash's slot, else an empty one, else the oldest (of equal
            // stamps the last).
            let mut free = None;
            let mut oldest = (0, 0u32);
            let mut found = false;
            for (i, slot) in slots.iter().enumerate() {
                let s = slot.load(Relaxed);
                if s == 0 {
                    free.get_or_insert(i);
                } else if tag_of(s) == tag {
                    slot.store(u64::from(tag) << 32 | stamp, Relaxed);
                    found = true;
                    break;
                } else {
                    let age = clock.wrapping_sub(s as u32);
                    if age >= oldest.1 {
                        oldest = (i, age);
                    }
                }
            }
            if found {
                continue;
            }
            let i = match free {
                Some(i) => {
                    w.len += 1;
                    i
                }
                None => oldest.0,
            };
            slots[i].store(u64::from(tag) << 32 | stamp, Relaxed);
        }
    }

    /// Forget these hashes (the replica turned out not to hold them).
    pub fn forget(&self, hashes: &[u64]) {
        let mut w = self.writer.lock();
        for &h in hashes {
            let (set, tag) = place(h, self.sets);
            for slot in self.set(set).into_iter().flatten() {
                let s = slot.load(Relaxed);
                if s != 0 && tag_of(s) == tag {
                    slot.store(0, Relaxed);
                    w.len -= 1;
                }
            }
        }
    }

    /// Hashes remembered.
    pub fn len(&self) -> usize {
        self.writer.lock().len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn longest_match_and_bounded_memory() {
        let ix = PrefixIndex::new(8);
        ix.insert(&[1, 2, 3]);
        assert_eq!(ix.longest_match(&[1, 2, 3, 4]), 3);
        assert_eq!(ix.longest_match(&[1, 2, 9, 4]), 2);
        assert_eq!(ix.longest_match(&[9]), 0);
        assert_eq!(ix.longest_match(&[]), 0);
        ix.insert(&[10, 11, 12, 13, 14, 15, 16, 17]);
        assert_eq!(ix.len(), 8);
        assert_eq!(ix.longest_match(&[1, 2, 3]), 0, "the oldest went first");
        assert_eq!(ix.longest_match(&[14, 15, 16, 17]), 4);
        ix.forget(&[16, 17]);
        assert_eq!(ix.len(), 6);
        assert_eq!(ix.longest_match(&[14, 15, 16, 17]), 2);
    }

    #[test]
    fn a_shared_head_outlives_the_tails_that_came_before() {
        // One set: eight slots.
        let ix = PrefixIndex::new(8);
        ix.insert(&[1, 2, 3, 4, 5, 6]);
        // A second prompt shares the head 1..3: it is stamped again, so the
        // third prompt's blocks take the places of the first one's tail,
        // its end first (of equal stamps, the last slot goes).
        ix.insert(&[1, 2, 3, 9]);
        ix.insert(&[20, 21, 22]);
        assert_eq!(ix.longest_match(&[1, 2, 3, 9]), 4);
        assert_eq!(ix.longest_match(&[1, 2, 3, 4, 5, 6]), 4);
        assert_eq!(ix.longest_match(&[20, 21, 22]), 3);
    }

    #[test]
    fn the_table_is_made_by_the_first_insert_and_starts_on_a_cache_line() {
        for capacity in [1, 8, 100, 4096] {
            let ix = PrefixIndex::new(capacity);
            assert!(ix.set(0).is_none());
            assert_eq!(ix.longest_match(&[1, 2]), 0);
            ix.warm(&[1, 2], 64);
            ix.forget(&[1]);
            ix.insert(&[]);
            assert!(ix.set(0).is_none(), "no table without a block");
            ix.insert(&[1]);
            let first = ix.set(0).map(|s| s.as_ptr() as usize);
            assert_eq!(first.map(|a| a % 64), Some(0));
            assert!(ix.sets as usize * WAYS >= capacity);
            assert!(ix.set(ix.sets as usize - 1).is_some());
            assert!(ix.set(ix.sets as usize).is_none());
        }
    }

    #[test]
    fn a_long_prompts_warm_loads_the_searchs_first_probes() {
        // The probes of a search over 100 blocks where every block is
        // cached (always right) and where none is (always left): warm's
        // first levels include the first probes of both.
        let mut warmed = Vec::new();
        first_probes(100, 15, |i| warmed.push(i));
        assert_eq!(warmed.len(), 15);
        assert_eq!(warmed[0], 49, "the search's first probe is block 50");
        for all_cached in [true, false] {
            let (mut lo, mut hi) = (0usize, 100usize);
            for _ in 0..4 {
                let mid = lo + (hi - lo).div_ceil(2);
                assert!(warmed.contains(&(mid - 1)), "{all_cached} {mid}");
                if all_cached {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
        }
        let mut all = Vec::new();
        first_probes(7, 64, |i| all.push(i));
        all.sort_unstable();
        assert_eq!(
            all,
            (0..7).collect::<Vec<_>>(),
            "a search's probes cover a short prompt"
        );
    }

    #[test]
    fn concurrent_inserts_lose_nothing_and_lookups_run_beside_them() {
        // Room for all: 4 threads x 500 blocks in a table of 16,384.
        let ix = std::sync::Arc::new(PrefixIndex::new(1 << 14));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let ix = ix.clone();
                std::thread::spawn(move || {
                    for i in 0..500u64 {
                        let h = xxhash_rust::xxh3::xxh3_64(&(t * 1000 + i).to_le_bytes());
                        ix.warm(&[h], 64);
                        ix.insert(&[h]);
                        assert_eq!(ix.longest_match(&[h]), 1);
                    }
                })
            })
            .collect();
        for t in threads {
            assert!(t.join().is_ok());
        }
        assert_eq!(ix.len(), 2000);
        let kept = (0..4u64)
            .flat_map(|t| (0..500u64).map(move |i| t * 1000 + i))
            .filter(|n| ix.contains(xxhash_rust::xxh3::xxh3_64(&n.to_le_bytes())))
            .count();
        assert_eq!(kept, 2000);
    }

    #[test]
    fn hashes_spread_over_the_sets() {
        // 4,096 sets: keys in a row (as tests use) and random ones fill
        // them evenly (a set index from poor bits would not).
        for keys in [
            (0..16_384u64).collect::<Vec<_>>(),
            (0..16_384u64)
                .map(|i| xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes()))
                .collect(),
        ] {
            let mut per_set = vec![0u32; 4096];
            for &k in &keys {
                per_set[place(k, 4096).0] += 1;
            }
            let max = per_set.iter().max().copied().unwrap_or(0);
            assert!(max <= 20, "{max} keys in one set (4 on average)");
        }
    }

    /// The reference: per set, the hashes in order of insertion, the most
    /// recent last, at most `WAYS` of them.
    #[derive(Default)]
    struct Model {
        sets: HashMap<usize, Vec<u32>>,
    }

    impl Model {
        fn insert(&mut self, hashes: &[u64], sets: u64) {
            for &h in hashes {
                let (set, tag) = place(h, sets);
                let lru = self.sets.entry(set).or_default();
                if let Some(i) = lru.iter().position(|&t| t == tag) {
                    lru.remove(i);
                } else if lru.len() == WAYS {
                    lru.remove(0);
                }
                lru.push(tag);
            }
        }

        fn contains(&self, h: u64, sets: u64) -> bool {
            let (set, tag) = place(h, sets);
            self.sets.get(&set).is_some_and(|l| l.contains(&tag))
        }

        fn forget(&mut self, h: u64, sets: u64) {
            let (set, tag) = place(h, sets);
            if let Some(l) = self.sets.get_mut(&set) {
                l.retain(|&t| t != tag);
            }
        }

        fn len(&self) -> usize {
            self.sets.values().map(Vec::len).sum()
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64),
        Forget(u64),
        Look(u64),
    }

    proptest! {
        /// One block per request (each its own stamp, so no ties), over few
        /// sets and keys, so that sets fill, evict and forget: the table
        /// answers as the per-set LRU model does, its length included.
        #[test]
        fn the_table_is_a_per_set_lru(
            capacity in 1usize..40,
            ops in prop::collection::vec(
                prop_oneof![
                    4 => (0u64..60).prop_map(Op::Insert),
                    1 => (0u64..60).prop_map(Op::Forget),
                    2 => (0u64..60).prop_map(Op::Look),
                ],
                1..300,
            ),
        ) {
            let ix = PrefixIndex::new(capacity);
            let mut model = Model::default();
            let sets = ix.sets;
            for op in ops {
                match op {
                    Op::Insert(h) => {
                        ix.insert(&[h]);
                        model.insert(&[h], sets);
                    }
                    Op::Forget(h) => {
                        ix.forget(&[h]);
                        model.forget(h, sets);
                    }
                    Op::Look(h) => {
                        prop_assert_eq!(ix.contains(h), model.contains(h, sets));
                    }
                }
                prop_assert_eq!(ix.len(), model.len());
            }
            for h in 0..60 {
                prop_assert_eq!(ix.contains(h), model.contains(h, sets));
            }
        }

        /// Prompts of several blocks (one stamp each, so ties): in every
        /// set, the table keeps as many blocks as fit, and no block it let go
        /// was inserted after one it kept (LRU, whatever order it breaks a
        /// tie in).
        #[test]
        fn with_prompts_of_several_blocks_a_set_keeps_its_newest(
            capacity in 1usize..40,
            // (From 1: hashes 0 and 1 share a tag, the table's one alias.)
            prompts in prop::collection::vec(prop::collection::vec(1u64..60, 1..6), 1..120),
        ) {
            let ix = PrefixIndex::new(capacity);
            let sets = ix.sets;
            // Every block inserted: its set and the stamp of its last insert.
            let mut last: HashMap<u64, (usize, usize)> = HashMap::new();
            for (stamp, blocks) in prompts.iter().enumerate() {
                ix.insert(blocks);
                for &h in blocks {
                    last.insert(h, (place(h, sets).0, stamp));
                }
            }
            let mut kept = 0;
            for set in 0..sets as usize {
                let here: Vec<(u64, usize)> = last
                    .iter()
                    .filter(|(_, (s, _))| *s == set)
                    .map(|(&h, &(_, stamp))| (h, stamp))
                    .collect();
                let (inside, outside): (Vec<_>, Vec<_>) =
                    here.iter().partition(|(h, _)| ix.contains(*h));
                prop_assert_eq!(inside.len(), here.len().min(WAYS));
                let newest_gone = outside.iter().map(|(_, t)| *t).max();
                let oldest_kept = inside.iter().map(|(_, t)| *t).min();
                if let (Some(gone), Some(kept)) = (newest_gone, oldest_kept) {
                    prop_assert!(gone <= kept, "set {}: {:?} kept, {:?} gone", set, inside, outside);
                }
                kept += inside.len();
            }
            prop_assert_eq!(ix.len(), kept);
        }
    }
}
