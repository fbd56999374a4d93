//! A prompt's prefix identity: the prompt cut into blocks of characters,
//! hashed as a chain.
//!
//! Chat messages are canonicalised as `role\ncontent\n` (text parts only), a
//! completion prompt as is; the text is cut every `block_chars` characters (on
//! UTF-8 boundaries; 64 characters is about 16 tokens, vLLM's block size) and
//! each block hashed with xxh3, seeded with the previous block's hash, the
//! first seeded with the model name and `cache_salt`. Equal prefixes give equal
//! leading hashes, in every gateway process (xxh3 with fixed seeds is stable).
//! Only full blocks are hashed, as an engine caches only full blocks.
//! Cost: one pass over the prompt bytes, no allocation beyond the hash list
//! (and a block's bytes when it spans pieces and is over 256 bytes).

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The pieces of a prompt, in order, as borrowed text. Inline up to 16
/// (a conversation of four turns): most prompts need no allocation for them.
#[derive(Debug, Default)]
pub(crate) struct PromptText<'a> {
    pub pieces: Pieces<'a>,
}

/// A prompt's pieces (see [`PromptText`]).
pub(crate) type Pieces<'a> = smallvec::SmallVec<[&'a str; 16]>;

/// Hashes of the full blocks of `prompt`, at most `max_blocks`, not yet tied
/// to a model (see [`bind_model`]: the served name is known only after alias
/// resolution, and the chain need not be computed twice).
pub(crate) fn block_hashes(
    salt: Option<&str>,
    prompt: &PromptText<'_>,
    block_chars: usize,
    max_blocks: usize,
) -> Vec<u64> {
    // Measured reason for not walking byte by byte (`cargo bench --bench
    // routing -- inspect`, docs/benchmarks-log.md "Reading long prompts"): a
    // branch per byte was two thirds of reading a 64 KB prompt, and a
    // streaming hasher per block another fifth. Here the characters of a
    // block are counted a window at a time (`bytecount`, a word at a time)
    // and a block inside one piece is hashed in one call. A block that spans
    // pieces (a chat's `role\ncontent\n` makes most short prompts one) is
    // gathered into a buffer and hashed in one call too: a streaming hasher
    // for it was a 64-byte-aligned allocation of ~600 bytes and its digest,
    // ~500 instructions a request (callgrind; docs/benchmarks-log.md "2026-11-26
    // afternoon"). `matches_the_byte_walk` checks the result against the byte
    // walk with a streaming hasher (kept in the tests).
    let mut seed = first_seed(salt);
    let mut out = Vec::new();
    // The current block's bytes from earlier pieces, when it spans pieces
    // (inline up to 256 bytes: 64 characters of up to 4 bytes).
    let mut spanning: smallvec::SmallVec<[u8; 256]> = smallvec::SmallVec::new();
    let mut chars = 0usize;
    for piece in &prompt.pieces {
        let bytes = piece.as_bytes();
        // The current block's bytes in this piece start at `start`.
        let mut start = 0;
        let mut i = 0;
        while i < bytes.len() {
            let need = block_chars - chars;
            if need > 0 {
                // The next `need` bytes hold at most `need` character starts,
                // so the block cannot end inside them: count them at once.
                let end = (i + need).min(bytes.len());
                // Character starts: the bytes that are not continuation bytes.
                chars += bytecount::num_chars(&bytes[i..end]);
                i = end;
                continue;
            }
            // The block is full: it ends where the next character starts.
            if (bytes[i] & 0xC0) != 0x80 {
                seed = if spanning.is_empty() {
                    xxh3_64_with_seed(&bytes[start..i], seed)
                } else {
                    spanning.extend_from_slice(&bytes[start..i]);
                    let digest = xxh3_64_with_seed(&spanning, seed);
                    spanning.clear();
                    digest
                };
                out.push(seed);
                if out.len() >= max_blocks {
                    return out;
                }
                start = i;
                chars = 0;
                continue;
            }
            i += 1;
        }
        spanning.extend_from_slice(&bytes[start..]);
    }
    if chars == block_chars {
        out.push(xxh3_64_with_seed(&spanning, seed));
    }
    out
}

/// The seed of a chain's first block: fixed, or derived from the tenant's
/// `cache_salt`.
fn first_seed(salt: Option<&str>) -> u64 {
    salt.map_or(0x5eed, |s| xxh3_64_with_seed(s.as_bytes(), 0x5eed))
}

/// Tie a chain to the served model: the same text under two models must not
/// look cached on one replica for the other. O(blocks).
pub(crate) fn bind_model(hashes: &mut [u64], model: &str) {
    let m = xxh3_64(model.as_bytes());
    for h in hashes {
        *h = xxh3_64_with_seed(&h.to_le_bytes(), m);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use xxhash_rust::xxh3::Xxh3;

    /// The definition, byte by byte with a streaming hasher per block: the
    /// reference `block_hashes` must agree with.
    fn byte_walk(
        salt: Option<&str>,
        prompt: &PromptText<'_>,
        block_chars: usize,
        max_blocks: usize,
    ) -> Vec<u64> {
        let mut seed = first_seed(salt);
        let mut out = Vec::new();
        let mut block = Xxh3::with_seed(seed);
        let mut chars = 0usize;
        for piece in &prompt.pieces {
            let bytes = piece.as_bytes();
            let mut start = 0;
            for (i, b) in bytes.iter().enumerate() {
                if (b & 0xC0) != 0x80 {
                    if chars == block_chars {
                        block.update(&bytes[start..i]);
                        seed = block.digest();
                        out.push(seed);
                        if out.len() >= max_blocks {
                            return out;
                        }
                        block = Xxh3::with_seed(seed);
                        start = i;
                        chars = 0;
                    }
                    chars += 1;
                }
            }
            block.update(&bytes[start..]);
        }
        if chars == block_chars {
            out.push(block.digest());
        }
        out
    }

    proptest! {
        #[test]
        fn matches_the_byte_walk(
            pieces in proptest::collection::vec("(\\PC|[a-z ]{0,40}|[é€😀]{0,5}){0,12}", 0..8),
            block_chars in 1usize..24,
            max_blocks in 1usize..40,
            salted in any::<bool>(),
        ) {
            let prompt = PromptText { pieces: pieces.iter().map(String::as_str).collect() };
            let salt = salted.then_some("tenant");
            prop_assert_eq!(
                block_hashes(salt, &prompt, block_chars, max_blocks),
                byte_walk(salt, &prompt, block_chars, max_blocks)
            );
        }
    }

    #[test]
    fn matches_the_byte_walk_on_long_prompts() {
        // Blocks inside pieces, across pieces, and multi-byte characters on
        // block boundaries, at the default block size.
        let text: String = "The gateway routes é each prompt 😀 to its replica. "
            .chars()
            .cycle()
            .take(20_000)
            .collect();
        let pieces: Vec<&str> = text.split_inclusive(' ').collect();
        for prompt in [
            PromptText {
                pieces: smallvec::smallvec![&text[..]],
            },
            PromptText {
                pieces: pieces.into(),
            },
        ] {
            assert_eq!(
                block_hashes(None, &prompt, 64, 4096),
                byte_walk(None, &prompt, 64, 4096)
            );
            // Blocks of 64 to 1,200 bytes that span pieces: xxh3's one-call
            // paths for over 240 bytes, and the gathered bytes past 256 (on
            // the heap), against the streaming hasher.
            for block_chars in [61, 100, 300] {
                assert_eq!(
                    block_hashes(None, &prompt, block_chars, 4096),
                    byte_walk(None, &prompt, block_chars, 4096),
                    "{block_chars} characters a block"
                );
            }
        }
        let emoji: String = "😀".repeat(1_000);
        let split: Vec<&str> = emoji
            .as_bytes()
            .chunks(40)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect();
        let prompt = PromptText {
            pieces: split.into(),
        };
        assert_eq!(
            block_hashes(Some("salt"), &prompt, 300, 100),
            byte_walk(Some("salt"), &prompt, 300, 100)
        );
    }

    fn hashes(pieces: &[&str]) -> Vec<u64> {
        let p = PromptText {
            pieces: pieces.into(),
        };
        block_hashes(None, &p, 4, 100)
    }

    #[test]
    fn equal_prefixes_share_leading_hashes_however_split() {
        let a = hashes(&["abcdefgh", "ijkl"]);
        let b = hashes(&["ab", "cdefghij", "kl"]);
        assert_eq!(a.len(), 3);
        assert_eq!(a, b, "block boundaries do not depend on piece boundaries");
        let c = hashes(&["abcdefgh", "ijkX"]);
        assert_eq!(a[..2], c[..2]);
        assert_ne!(a[2], c[2]);
        assert_eq!(
            hashes(&["abcdefghij"]).len(),
            2,
            "partial blocks are not hashed"
        );
    }

    #[test]
    fn blocks_count_characters_not_bytes() {
        // 4 two-byte characters make one block.
        assert_eq!(hashes(&["éééé"]).len(), 1);
        assert_eq!(hashes(&["ééé"]).len(), 0);
    }

    #[test]
    fn model_and_salt_separate_tenants() {
        let p = PromptText {
            pieces: smallvec::smallvec!["abcdefgh"],
        };
        let bound = |model: &str, salt| {
            let mut h = block_hashes(salt, &p, 4, 10);
            bind_model(&mut h, model);
            h
        };
        let base = bound("m", None);
        assert_ne!(bound("other", None), base);
        assert_ne!(bound("m", Some("tenant-a")), base);
        assert_eq!(bound("m", None), base);
    }
}
