//! The approximate tokenizer used everywhere a token count is needed before a
//! replica reports the exact one (simulator, rate-limit reservations, routing
//! block sizes).
//!
//! Rule: one token per 4 characters of text, rounded up, plus 3 tokens of
//! framing per chat message. It is the common rule of thumb for BPE tokenizers
//! on English text (OpenAI documents ~4 characters per token); real counts vary
//! by model and language, which is why every count the gateway records comes
//! from the replica's usage, never from here.

/// Characters per token.
pub(crate) const CHARS_PER_TOKEN: usize = 4;
/// Framing tokens per chat message (role markers, separators).
pub(crate) const TOKENS_PER_MESSAGE: u32 = 3;

/// Tokens in a piece of text.
pub(crate) fn estimate(text: &str) -> u32 {
    let chars = text.chars().count();
    u32::try_from(chars.div_ceil(CHARS_PER_TOKEN)).unwrap_or(u32::MAX)
}

/// Tokens of a prompt given as chat messages' contents.
pub(crate) fn estimate_messages<'a>(contents: impl IntoIterator<Item = &'a str>) -> u32 {
    contents
        .into_iter()
        .map(|c| estimate(c).saturating_add(TOKENS_PER_MESSAGE))
        .fold(0u32, u32::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_chars_per_token_rounded_up() {
        assert_eq!(estimate(""), 0);
        assert_eq!(estimate("abcd"), 1);
        assert_eq!(estimate("abcde"), 2);
        assert_eq!(estimate("héllo wörld"), 3);
        assert_eq!(estimate_messages(["abcd", "abcdefgh"]), 1 + 3 + 2 + 3);
    }
}
