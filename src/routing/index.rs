//! Per replica: which prefix blocks this gateway recently sent there.
//!
//! Two generations of hash sets give a bounded, approximately-LRU memory: new
//! hashes go into `current`; when it holds half the capacity it becomes
//! `previous` and the old `previous` is dropped, so at most `capacity` hashes
//! are kept and anything touched in the last generation survives. A lookup
//! finds the longest cached prefix by binary search: the blocks of one request
//! are inserted together and age out together, so "block i is cached" is
//! monotone along a prompt. Cost: O(log blocks) lookups, O(blocks) inserts.

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};

/// The keys are already hashes: use them as they are.
#[derive(Default)]
pub(crate) struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Set = HashSet<u64, BuildHasherDefault<Identity>>;

pub(crate) struct PrefixIndex {
    current: Set,
    previous: Set,
    capacity: usize,
}

impl PrefixIndex {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            current: Set::default(),
            previous: Set::default(),
            capacity: capacity.max(2),
        }
    }

    fn contains(&self, h: u64) -> bool {
        self.current.contains(&h) || self.previous.contains(&h)
    }

    /// How many leading blocks of `hashes` are cached here.
    pub(crate) fn longest_match(&self, hashes: &[u64]) -> usize {
        let (mut lo, mut hi) = (0usize, hashes.len());
        // Invariant: the first `lo` blocks are cached; block `hi` (if any) is not.
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.contains(hashes[mid - 1]) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    pub(crate) fn insert(&mut self, hashes: &[u64]) {
        for (i, &h) in hashes.iter().enumerate() {
            // Most blocks of a routed prompt are here already (its shared
            // prefix): a lookup settles them. `HashSet::insert` is not inlined
            // into this loop and cost ~1.5x per block (`cargo bench --bench
            // routing`, 200 KB prompt: 17 us against 12 us per decision).
            if self.current.contains(&h) {
                continue;
            }
            if self.current.len() * 2 >= self.capacity {
                self.previous = std::mem::take(&mut self.current);
                // The blocks before this one lead to it: they move into the
                // new generation with it (a prompt's head should not age out
                // before its tail: `longest_match` assumes prefixes). Up to
                // a quarter of the capacity, so that a generation still takes
                // at least a quarter of new blocks before the next turns over
                // (memory stays bounded, the work per block O(1)).
                if i * 4 <= self.capacity {
                    self.current.extend(hashes[..i].iter().copied());
                }
            }
            self.current.insert(h);
        }
    }

    /// Forget these hashes (the replica turned out not to hold them).
    pub(crate) fn forget(&mut self, hashes: &[u64]) {
        for h in hashes {
            self.current.remove(h);
            self.previous.remove(h);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_match_and_bounded_memory() {
        let mut ix = PrefixIndex::new(8);
        ix.insert(&[1, 2, 3]);
        assert_eq!(ix.longest_match(&[1, 2, 3, 4]), 3);
        assert_eq!(ix.longest_match(&[1, 2, 9, 4]), 2);
        assert_eq!(ix.longest_match(&[9]), 0);
        assert_eq!(ix.longest_match(&[]), 0);
        ix.insert(&[10, 11, 12, 13, 14, 15, 16, 17]);
        assert!(ix.len() <= 8);
        assert_eq!(
            ix.longest_match(&[1, 2, 3]),
            0,
            "the oldest generation aged out"
        );
        assert!(ix.longest_match(&[14, 15, 16, 17]) > 0);
    }

    #[test]
    fn a_prompts_head_moves_into_the_new_generation_with_its_tail() {
        let mut ix = PrefixIndex::new(16);
        ix.insert(&[1, 2, 3, 4, 5, 6, 7, 8]);
        // Block 9 starts a new generation: 1..4, its head, go into it with
        // it, not only into the one that ages out next.
        ix.insert(&[1, 2, 3, 4, 9]);
        // A generation later, the head is still there with its tail.
        ix.insert(&[20, 21, 22, 23, 24, 25, 26, 27]);
        assert_eq!(ix.longest_match(&[1, 2, 3, 4, 9]), 5);
        assert!(ix.len() <= 16, "{}", ix.len());
    }
}
