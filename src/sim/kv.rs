//! The simulated KV cache: fixed-size blocks, reference counts, and an automatic
//! prefix cache, after vLLM's block pool.
//!
//! A full prompt block is registered under its chained hash (the hash of its
//! parent block and its own tokens), so equal prefixes map to equal hash chains.
//! A block whose last user finished keeps its hash while it sits in the free
//! queue; it is reused by a later request with the same prefix (a hit) until an
//! allocation needs it, oldest first (LRU eviction). Free-queue operations are
//! O(1) (an index-linked list), a prefix lookup is O(matched blocks).

use std::collections::{HashMap, hash_map::Entry};
use std::sync::Arc;

use parking_lot::Mutex;

const NIL: u32 = u32::MAX;

/// Doubly linked list of free block ids, oldest at the front.
struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    queued: Vec<bool>,
    head: u32,
    tail: u32,
    len: u32,
}

impl FreeQueue {
    fn with_all(n: u32) -> Self {
        let mut q = Self {
            prev: vec![NIL; n as usize],
            next: vec![NIL; n as usize],
            queued: vec![false; n as usize],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for b in 0..n {
            q.push_back(b);
        }
        q
    }

    fn push_back(&mut self, b: u32) {
        let i = b as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.queued[i] = true;
        self.len += 1;
    }

    fn remove(&mut self, b: u32) {
        let i = b as usize;
        if !self.queued[i] {
            return;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.queued[i] = false;
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.remove(b);
        Some(b)
    }
}

pub(crate) struct BlockPool {
    pub block_size: u32,
    num_blocks: u32,
    ref_cnt: Vec<u32>,
    hash_of: Vec<Option<u64>>,
    /// Prefix hash -> block holding it; shared with [`CachedPrefixes`], which
    /// request handlers read (a decode replica pulls only what it lacks).
    cached: Arc<Mutex<HashMap<u64, u32>>>,
    free: FreeQueue,
}

/// A read-only handle on a pool's cached prefix blocks, for request
/// handlers: how much of a prompt the engine holds when the request arrives.
#[derive(Clone)]
pub(crate) struct CachedPrefixes(Arc<Mutex<HashMap<u64, u32>>>);

impl CachedPrefixes {
    /// How many of `hashes`, from the first, have a cached block.
    pub(crate) fn leading(&self, hashes: &[u64]) -> usize {
        let cached = self.0.lock();
        hashes.iter().take_while(|h| cached.contains_key(h)).count()
    }
}

impl BlockPool {
    pub(crate) fn new(num_blocks: u32, block_size: u32) -> Self {
        Self {
            block_size,
            num_blocks,
            ref_cnt: vec![0; num_blocks as usize],
            hash_of: vec![None; num_blocks as usize],
            cached: Arc::new(Mutex::new(HashMap::new())),
            free: FreeQueue::with_all(num_blocks),
        }
    }

    pub(crate) fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// A handle on the cached prefix blocks, for readers outside the engine.
    pub(crate) fn cached_prefixes(&self) -> CachedPrefixes {
        CachedPrefixes(self.cached.clone())
    }

    /// Blocks an allocation can take (free, including cached-but-unused ones).
    pub(crate) fn num_free(&self) -> u32 {
        self.free.len
    }

    /// vLLM's `kv_cache_usage_perc`: the share of blocks in use by requests
    /// (cached blocks nobody uses count as free).
    pub(crate) fn usage(&self) -> f64 {
        if self.num_blocks == 0 {
            return 0.0;
        }
        1.0 - f64::from(self.free.len) / f64::from(self.num_blocks)
    }

    /// Blocks needed to hold `tokens` tokens.
    pub(crate) fn blocks_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.block_size)
    }

    /// The cached blocks of the longest prefix of `hashes`, taken for a request
    /// (reference counted, out of the free queue).
    pub(crate) fn take_prefix(&mut self, hashes: &[u64]) -> Vec<u32> {
        let mut out = Vec::new();
        let cached = self.cached.lock();
        for h in hashes {
            let Some(&b) = cached.get(h) else { break };
            if self.ref_cnt[b as usize] == 0 {
                self.free.remove(b);
            }
            self.ref_cnt[b as usize] += 1;
            out.push(b);
        }
        out
    }

    /// `n` fresh blocks, evicting the least recently freed cached blocks if
    /// needed; `None` (and nothing taken) if there are not enough.
    pub(crate) fn allocate(&mut self, n: u32, into: &mut Vec<u32>) -> bool {
        if self.free.len < n {
            return false;
        }
        let mut cached = self.cached.lock();
        for _ in 0..n {
            let Some(b) = self.free.pop_front() else {
                return false;
            };
            if let Some(h) = self.hash_of[b as usize].take()
                && cached.get(&h) == Some(&b)
            {
                cached.remove(&h);
            }
            self.ref_cnt[b as usize] = 1;
            into.push(b);
        }
        true
    }

    /// Release a request's blocks. Tail blocks go to the free queue first, so
    /// they are evicted before the shared prefix blocks (as vLLM does).
    pub(crate) fn release(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            let i = b as usize;
            self.ref_cnt[i] = self.ref_cnt[i].saturating_sub(1);
            if self.ref_cnt[i] == 0 {
                self.free.push_back(b);
            }
        }
    }

    /// Mark a full block as holding the prefix with this chained hash. Where
    /// a free block holds it already (a swapped-in sequence's copy from before
    /// its preemption), the live block takes over the hash: the free one is
    /// evicted first, and its eviction would otherwise lose a prefix that the
    /// live block still holds.
    pub(crate) fn register(&mut self, block: u32, hash: u64) {
        if self.hash_of[block as usize].is_some() {
            return;
        }
        let mut cached = self.cached.lock();
        match cached.entry(hash) {
            Entry::Occupied(mut e) => {
                let old = *e.get() as usize;
                if self.ref_cnt[old] == 0 {
                    self.hash_of[old] = None;
                    e.insert(block);
                }
            }
            Entry::Vacant(e) => {
                e.insert(block);
            }
        }
        self.hash_of[block as usize] = Some(hash);
    }
}

/// Chained block hashes of a prompt's text: one per full block of
/// `block_size` tokens (at [`crate::tokens::CHARS_PER_TOKEN`] characters per
/// token), each covering its parent's hash, seeded with the model name.
pub(crate) fn block_hashes(model: &str, text: &str, block_size: u32) -> Vec<u64> {
    let chars_per_block = block_size as usize * crate::tokens::CHARS_PER_TOKEN;
    let mut parent = super::text::seed_of(model.as_bytes());
    let mut out = Vec::new();
    let mut start = 0;
    let mut count = 0;
    for (i, _) in text.char_indices() {
        if count == chars_per_block {
            parent = chain(parent, &text.as_bytes()[start..i]);
            out.push(parent);
            start = i;
            count = 0;
        }
        count += 1;
    }
    if count == chars_per_block {
        out.push(chain(parent, &text.as_bytes()[start..]));
    }
    out
}

fn chain(parent: u64, bytes: &[u8]) -> u64 {
    super::text::mix(parent ^ super::text::seed_of(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_blocks_are_reused_then_evicted_lru() {
        let mut pool = BlockPool::new(4, 16);
        let mut a = Vec::new();
        assert!(pool.allocate(2, &mut a));
        pool.register(a[0], 11);
        pool.register(a[1], 22);
        assert_eq!(pool.usage(), 0.5);
        pool.release(&a);
        assert_eq!(pool.usage(), 0.0, "cached blocks count as free");
        // Same prefix: both blocks hit.
        let hit = pool.take_prefix(&[11, 22, 33]);
        assert_eq!(hit, a);
        pool.release(&hit);
        // Need all 4 blocks: the cached ones are evicted.
        let mut b = Vec::new();
        assert!(pool.allocate(4, &mut b));
        assert!(pool.take_prefix(&[11]).is_empty());
        assert!(!pool.allocate(1, &mut b), "full");
    }

    #[test]
    fn a_live_block_takes_over_a_prefix_from_a_free_copy() {
        let mut pool = BlockPool::new(4, 16);
        let mut old = Vec::new();
        assert!(pool.allocate(1, &mut old));
        pool.register(old[0], 11);
        pool.release(&old);
        // The same prefix computed again into another block (a swapped-in
        // sequence), while the old copy sits free and cached.
        let mut live = Vec::new();
        assert!(pool.allocate(1, &mut live));
        assert_ne!(live, old);
        pool.register(live[0], 11);
        // Evicting the free copy keeps the prefix: the live block holds it.
        let mut rest = Vec::new();
        assert!(pool.allocate(3, &mut rest));
        assert!(rest.contains(&old[0]), "the old copy was evicted");
        assert_eq!(pool.take_prefix(&[11]), live);
    }

    #[test]
    fn hashes_chain_over_full_blocks() {
        let text = "x".repeat(64 * 3 + 10);
        let h = block_hashes("m", &text, 16);
        assert_eq!(h.len(), 3);
        let h2 = block_hashes("m", &format!("{}{}", "x".repeat(128), "y".repeat(80)), 16);
        assert_eq!(h[..2], h2[..2], "same first two blocks");
        assert_ne!(h[2], h2[2]);
        assert_ne!(block_hashes("other", &text, 16)[0], h[0], "seeded by model");
    }
}
