//! The fast path of reading a chunk: a single forward pass over the JSON that
//! answers only what the gateway asks (output? finish reason? usage? error?).
//!
//! It skips strings with `memchr` and builds no value, which makes it several
//! times cheaper than serde on a typical 200-byte chunk (see
//! `benches/hot_path.rs`). It is conservative: input it is not sure about (an
//! escaped key, a duplicate key, a fractional token count, malformed JSON)
//! returns `None` and the caller falls back to the serde reader in `event.rs`,
//! the reference. One thing it does not check is the *content* of strings
//! (control characters, UTF-8): such an event is forwarded as sent and the
//! client's JSON parser reports it. Cost: O(payload bytes), no allocation.

use std::ops::Range;

use super::chunk::ChunkInfo;
use crate::vocab::{FinishReason, Usage};

/// Read a chunk, or `None` to let the serde reader decide.
pub(crate) fn scan(json: &[u8]) -> Option<ChunkInfo> {
    scan_spanned(json).map(|(info, _)| info)
}

/// [`scan`], and where the last non-empty output string (a delta's
/// `content`, `reasoning_content` or `reasoning`, a completion's `text`)
/// lies in `json`, quotes included: what [`super::shape`] learns a stream's
/// event shape from.
pub(crate) fn scan_spanned(json: &[u8]) -> Option<(ChunkInfo, Option<Range<usize>>)> {
    let mut p = P {
        b: json,
        i: 0,
        span: None,
    };
    let mut info = ChunkInfo::default();
    let mut seen = Seen::default();
    p.expect(b'{')?;
    if p.peek()? == b'}' {
        p.i += 1;
    } else {
        loop {
            match p.key()? {
                b"choices" => {
                    seen.first(0)?;
                    p.choices(&mut info)?;
                }
                b"usage" => {
                    seen.first(1)?;
                    info.usage = p.usage()?;
                }
                b"error" => {
                    seen.first(2)?;
                    info.is_error = !p.null_or_skip()?;
                }
                _ => p.skip_value()?,
            }
            match p.next()? {
                b',' => continue,
                b'}' => break,
                _ => return None,
            }
        }
    }
    p.ws();
    (p.i == json.len()).then_some((info, p.span))
}

/// Keys already read in one object: serde refuses duplicates of a struct's
/// fields, so the fast path must not accept them either.
#[derive(Default)]
struct Seen(u8);

impl Seen {
    fn first(&mut self, bit: u8) -> Option<()> {
        let mask = 1 << bit;
        if self.0 & mask != 0 {
            return None;
        }
        self.0 |= mask;
        Some(())
    }
}

struct P<'a> {
    b: &'a [u8],
    i: usize,
    /// The last non-empty output string seen (see [`scan_spanned`]).
    span: Option<Range<usize>>,
}

impl<'a> P<'a> {
    #[inline(always)]
    fn ws(&mut self) {
        while let Some(c) = self.b.get(self.i) {
            if !matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                break;
            }
            self.i += 1;
        }
    }

    #[inline(always)]
    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.b.get(self.i).copied()
    }

    #[inline(always)]
    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    #[inline(always)]
    fn expect(&mut self, c: u8) -> Option<()> {
        (self.next()? == c).then_some(())
    }

    /// An object key without escapes or control characters, and its colon.
    #[inline(always)]
    fn key(&mut self) -> Option<&'a [u8]> {
        self.expect(b'"')?;
        let start = self.i;
        // Keys are short: a word at a time beats `memchr2`'s setup. A
        // control character (invalid JSON) declines too.
        let end = string_stop(self.b, start)?;
        if self.b[end] != b'"' {
            return None;
        }
        self.i = end + 1;
        self.expect(b':')?;
        Some(&self.b[start..end])
    }

    /// Skip a string value; returns whether it is non-empty. Escapes are
    /// checked (they are on the rare path); other contents are not.
    #[inline(always)]
    fn skip_string(&mut self) -> Option<bool> {
        self.expect(b'"')?;
        let start = self.i;
        loop {
            let at = self.i + memchr::memchr2(b'"', b'\\', &self.b[self.i..])?;
            if self.b[at] == b'\\' {
                self.i = at + 1 + escape_len(self.b.get(at + 1..)?)?;
                continue;
            }
            self.i = at + 1;
            return Some(at > start);
        }
    }

    /// `true`, `false`, `null` or a JSON number, followed by a delimiter.
    #[inline(always)]
    fn skip_scalar(&mut self) -> Option<()> {
        let rest = &self.b[self.i..];
        let n = if rest.starts_with(b"true") || rest.starts_with(b"null") {
            4
        } else if rest.starts_with(b"false") {
            5
        } else {
            number_len(rest)?
        };
        self.i += n;
        matches!(
            self.b.get(self.i),
            Some(b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') | None
        )
        .then_some(())
    }

    fn skip_value(&mut self) -> Option<()> {
        self.skip_nested(0)
    }

    /// Skip any value, checking its structure; nesting beyond serde_json's
    /// limit (128) is left to serde.
    fn skip_nested(&mut self, depth: usize) -> Option<()> {
        if depth > 128 {
            return None;
        }
        match self.peek()? {
            b'"' => self.skip_string().map(|_| ()),
            b'{' => {
                self.i += 1;
                if self.peek()? == b'}' {
                    self.i += 1;
                    return Some(());
                }
                loop {
                    self.skip_string()?;
                    self.expect(b':')?;
                    self.skip_nested(depth + 1)?;
                    match self.next()? {
                        b',' => continue,
                        b'}' => return Some(()),
                        _ => return None,
                    }
                }
            }
            b'[' => {
                self.i += 1;
                if self.peek()? == b']' {
                    self.i += 1;
                    return Some(());
                }
                loop {
                    self.skip_nested(depth + 1)?;
                    match self.next()? {
                        b',' => continue,
                        b']' => return Some(()),
                        _ => return None,
                    }
                }
            }
            _ => self.skip_scalar(),
        }
    }

    /// A delta's `tool_calls` array: whether it is non-empty (as
    /// [`non_empty`](Self::non_empty)), and each call's non-empty
    /// `function.arguments` string remembered as the output string's place.
    /// Its content changes no answer (a non-empty array is output, whatever
    /// it holds), so the stream's shape may be learned around it: a tool
    /// call's argument pieces then take the fast path as tokens do.
    fn tool_calls(&mut self) -> Option<bool> {
        self.expect(b'[')?;
        if self.peek()? == b']' {
            self.i += 1;
            return Some(false);
        }
        loop {
            if self.peek()? == b'{' {
                self.object_with(b"function", |p| {
                    if p.peek()? == b'{' {
                        p.object_with(b"arguments", |p| {
                            if p.peek()? != b'"' {
                                return p.skip_value();
                            }
                            let start = p.i;
                            if p.skip_string()? {
                                p.span = Some(start..p.i);
                            }
                            Some(())
                        })
                    } else {
                        p.skip_value()
                    }
                })?;
            } else {
                self.skip_value()?;
            }
            match self.next()? {
                b',' => continue,
                b']' => return Some(true),
                _ => return None,
            }
        }
    }

    /// An object whose `key` is read by `read` (at its value) and every
    /// other key skipped; keys with escapes are left to serde.
    fn object_with(&mut self, key: &[u8], read: impl Fn(&mut Self) -> Option<()>) -> Option<()> {
        self.expect(b'{')?;
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(());
        }
        loop {
            if self.key()? == key {
                read(self)?;
            } else {
                self.skip_value()?;
            }
            match self.next()? {
                b',' => continue,
                b'}' => return Some(()),
                _ => return None,
            }
        }
    }

    /// `null` (true) or any other value, skipped (false).
    #[inline(always)]
    fn null_or_skip(&mut self) -> Option<bool> {
        self.ws();
        let null = self.b[self.i..].starts_with(b"null");
        self.skip_value()?;
        Some(null)
    }

    /// Whether a value carries something: not null, "", [] or {}.
    fn non_empty(&mut self) -> Option<bool> {
        match self.peek()? {
            b'"' => self.skip_string(),
            b'n' => self.null_or_skip().map(|null| !null),
            b'[' | b'{' => {
                let open = self.i;
                self.i += 1;
                let close = self.peek()?;
                self.i = open;
                self.skip_value()?;
                Some(!matches!(close, b']' | b'}'))
            }
            _ => self.skip_scalar().map(|_| true),
        }
    }

    /// An output value: [`non_empty`](Self::non_empty), and a non-empty
    /// string's place remembered.
    fn output(&mut self) -> Option<bool> {
        self.ws();
        let start = self.i;
        let out = self.non_empty()?;
        if out && self.b.get(start) == Some(&b'"') {
            self.span = Some(start..self.i);
        }
        Some(out)
    }

    fn choices(&mut self, info: &mut ChunkInfo) -> Option<()> {
        if self.peek()? == b'n' {
            return self.null_or_skip().map(|_| ());
        }
        self.expect(b'[')?;
        if self.peek()? == b']' {
            self.i += 1;
            return Some(());
        }
        loop {
            self.choice(info)?;
            info.n_choices += 1;
            match self.next()? {
                b',' => continue,
                b']' => return Some(()),
                _ => return None,
            }
        }
    }

    fn choice(&mut self, info: &mut ChunkInfo) -> Option<()> {
        self.expect(b'{')?;
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(());
        }
        let mut seen = Seen::default();
        loop {
            match self.key()? {
                b"delta" => {
                    seen.first(0)?;
                    if self.peek()? == b'n' {
                        self.null_or_skip()?;
                    } else {
                        self.delta(info)?;
                    }
                }
                // A whole answer's `message` (an object) is read as a
                // chunk's `delta`: its output and tool calls (the answer's
                // quality check is skipped when it has none). Any other
                // value is passed over, as before it was read. A chunk
                // that carries one is read the same way.
                b"message" => {
                    seen.first(3)?;
                    if self.peek()? == b'{' {
                        self.delta(info)?;
                    } else {
                        self.skip_value()?;
                    }
                }
                b"text" => {
                    seen.first(1)?;
                    info.has_output |= self.output()?;
                }
                b"finish_reason" => {
                    seen.first(2)?;
                    if let Some(f) = self.finish_reason()? {
                        info.finish_reason = Some(f);
                    }
                }
                _ => self.skip_value()?,
            }
            match self.next()? {
                b',' => continue,
                b'}' => return Some(()),
                _ => return None,
            }
        }
    }

    fn delta(&mut self, info: &mut ChunkInfo) -> Option<()> {
        self.expect(b'{')?;
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(());
        }
        loop {
            match self.key()? {
                b"content" | b"reasoning_content" | b"reasoning" => {
                    info.has_output |= self.output()?;
                }
                b"tool_calls" | b"function_call" => {
                    let called = if self.peek()? == b'[' {
                        self.tool_calls()?
                    } else {
                        self.non_empty()?
                    };
                    info.has_output |= called;
                    info.tool_call |= called;
                }
                _ => self.skip_value()?,
            }
            match self.next()? {
                b',' => continue,
                b'}' => return Some(()),
                _ => return None,
            }
        }
    }

    /// `null`, or a finish reason string without escapes.
    fn finish_reason(&mut self) -> Option<Option<FinishReason>> {
        if self.peek()? == b'n' {
            return self.null_or_skip().and_then(|null| null.then_some(None));
        }
        let s = self.key_like_string()?;
        Some(Some(match s {
            b"stop" => FinishReason::Stop,
            b"length" => FinishReason::Length,
            b"tool_calls" => FinishReason::ToolCalls,
            b"content_filter" => FinishReason::ContentFilter,
            b"function_call" => FinishReason::FunctionCall,
            b"abort" => FinishReason::Abort,
            _ => FinishReason::Other,
        }))
    }

    /// A string value without escapes (as `key` reads keys), no colon after.
    #[inline(always)]
    fn key_like_string(&mut self) -> Option<&'a [u8]> {
        self.expect(b'"')?;
        let start = self.i;
        let end = string_stop(self.b, start)?;
        if self.b[end] != b'"' {
            return None;
        }
        self.i = end + 1;
        Some(&self.b[start..end])
    }

    fn usage(&mut self) -> Option<Option<Usage>> {
        if self.peek()? == b'n' {
            return self.null_or_skip().and_then(|null| null.then_some(None));
        }
        self.expect(b'{')?;
        let mut u = Usage::default();
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(Some(u));
        }
        let mut seen = Seen::default();
        loop {
            match self.key()? {
                b"prompt_tokens" => {
                    seen.first(0)?;
                    u.prompt_tokens = self.count()?;
                }
                b"completion_tokens" => {
                    seen.first(1)?;
                    u.completion_tokens = self.count()?;
                }
                b"prompt_tokens_details" => {
                    seen.first(2)?;
                    u.cached_tokens = self.details()?;
                }
                _ => self.skip_value()?,
            }
            match self.next()? {
                b',' => continue,
                b'}' => return Some(Some(u)),
                _ => return None,
            }
        }
    }

    /// `prompt_tokens_details`: `null`, or an object whose `cached_tokens`
    /// (a count or `null`) is the answer.
    fn details(&mut self) -> Option<Option<u32>> {
        if self.peek()? == b'n' {
            return self.null_or_skip().and_then(|null| null.then_some(None));
        }
        self.expect(b'{')?;
        let mut cached = None;
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(None);
        }
        let mut seen = Seen::default();
        loop {
            match self.key()? {
                b"cached_tokens" => {
                    seen.first(0)?;
                    cached = if self.peek()? == b'n' {
                        self.null_or_skip()?.then_some(None)?
                    } else {
                        Some(self.count()?)
                    };
                }
                _ => self.skip_value()?,
            }
            match self.next()? {
                b',' => continue,
                b'}' => return Some(cached),
                _ => return None,
            }
        }
    }

    /// A plain non-negative integer that fits in u32 (anything else: fall back).
    #[inline(always)]
    fn count(&mut self) -> Option<u32> {
        self.ws();
        let rest = &self.b[self.i..];
        let len = number_len(rest)?;
        let digits = &rest[..len];
        if !digits.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let n = digits.iter().try_fold(0u32, |n, c| {
            n.checked_mul(10)?.checked_add(u32::from(c - b'0'))
        })?;
        self.i += len;
        matches!(
            self.b.get(self.i),
            Some(b',' | b'}' | b' ' | b'\t' | b'\n' | b'\r')
        )
        .then_some(n)
    }
}

/// Where a string's raw text stops: the index of the first `"`, `\\` or
/// control character (which JSON forbids in strings) at or after `i`.
///
/// Eight bytes at a time (SWAR, as serde_json's own string reader does):
/// `memchr2` for the quote and backslash plus a pass for control characters
/// cost ~190 instructions per short string in
/// `api::inbound::fast` (callgrind), this ~30; object keys here take it too.
/// Long strings take [`text_stop`]. Checked against a plain byte loop by
/// `string_stop_finds_the_first_stop`.
pub(crate) fn string_stop(b: &[u8], mut i: usize) -> Option<usize> {
    while let Some(word) = b.get(i..i + 8) {
        if let Some(at) = word_stop(word) {
            return Some(i + at);
        }
        i += 8;
    }
    let rest = b.get(i..)?;
    rest.iter()
        .position(|&c| c == b'"' || c == b'\\' || c < 0x20)
        .map(|at| i + at)
}

/// [`string_stop`] for strings that may be long (a prompt's text): past its
/// first 32 bytes, the string is crossed 32 bytes at a time by a test the
/// compiler turns into SIMD compares ([`block_has_stop`]), and SWAR finds the
/// stop in the block that has one. The body's reader with it (`inspect`):
/// -13% on a 1 KiB prompt, -25% on 10 KiB, -33% on 64 and 200 KiB; -2% and
/// +2% on 1 and 10 KiB of short lines, where escapes come every few dozen
/// bytes (`cargo bench --bench routing -- inspect`, docs/benchmarks-log.md
/// "2026-11-26 morning"). Not for keys, nor for the short pieces between
/// escapes: there the extra loop costs more than it finds (the response
/// scanner's inlined key reads: +500 instructions a request, callgrind).
/// Checked against a byte loop by
/// `text_stop_agrees_with_a_byte_loop_on_long_strings`.
pub(crate) fn text_stop(b: &[u8], mut i: usize) -> Option<usize> {
    const BLOCK: usize = 32;
    let short_end = i.saturating_add(BLOCK);
    while i < short_end {
        let Some(word) = b.get(i..i + 8) else { break };
        if let Some(at) = word_stop(word) {
            return Some(i + at);
        }
        i += 8;
    }
    while let Some(block) = b
        .get(i..i + BLOCK)
        .and_then(|b| <&[u8; BLOCK]>::try_from(b).ok())
    {
        if block_has_stop(block) {
            break;
        }
        i += BLOCK;
    }
    // The stop is in the next block, or in the tail shorter than a block.
    string_stop(b, i)
}

/// The first stop byte of an 8-byte word, if it has one.
#[inline(always)]
fn word_stop(word: &[u8]) -> Option<usize> {
    const ONES: u64 = u64::from_ne_bytes([1; 8]);
    const HIGH: u64 = ONES << 7;
    let v = u64::from_le_bytes(word.try_into().ok()?);
    // A byte's high bit is set where it is zero after the xor (or below
    // 0x20). Bytes above a match may be flagged wrongly (a borrow), the
    // lowest flag never is, and only the lowest is used.
    let quote = v ^ (ONES * u64::from(b'"'));
    let backslash = v ^ (ONES * u64::from(b'\\'));
    let found = (quote.wrapping_sub(ONES) & !quote)
        | (backslash.wrapping_sub(ONES) & !backslash)
        | (v.wrapping_sub(ONES * 0x20) & !v);
    let found = found & HIGH;
    (found != 0).then(|| (found.trailing_zeros() / 8) as usize)
}

/// Whether a block holds a stop byte. A fixed-size block and a branch-free
/// fold (bitwise, not `||`) are what let the compiler vectorise it: SSE2
/// compares of 16 bytes, ~22 instructions for the 32. A slice or a
/// short-circuiting test compiled to a byte loop, slower than SWAR (+75% on
/// the 10 KiB prompt of `cargo bench --bench routing -- inspect`).
#[inline(always)]
fn block_has_stop(block: &[u8; 32]) -> bool {
    block.iter().fold(0u8, |acc, &c| {
        acc | u8::from(c == b'"') | u8::from(c == b'\\') | u8::from(c < 0x20)
    }) != 0
}

/// Length of a valid escape after its backslash (`n`, `"`, `u00e9`, ...).
pub(crate) fn escape_len(rest: &[u8]) -> Option<usize> {
    match rest.first()? {
        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Some(1),
        b'u' => rest
            .get(1..5)?
            .iter()
            .all(u8::is_ascii_hexdigit)
            .then_some(5),
        _ => None,
    }
}

/// Length of a JSON number at the start of `b` (RFC 8259 grammar).
pub(crate) fn number_len(b: &[u8]) -> Option<usize> {
    let mut i = usize::from(b.first() == Some(&b'-'));
    let digits = |i: usize| b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
    match b.get(i)? {
        b'0' => i += 1,
        b'1'..=b'9' => i += digits(i),
        _ => return None,
    }
    if b.get(i) == Some(&b'.') {
        let d = digits(i + 1);
        if d == 0 {
            return None;
        }
        i += 1 + d;
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        let d = digits(i);
        if d == 0 {
            return None;
        }
        i += d;
    }
    Some(i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::event::chunk_info_serde;

    /// The committed corpus, one chunk per line; the first 12 are what
    /// engines send (the fast path must take them).
    fn corpus() -> Vec<String> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/corpus/chunks/engines.jsonl"
        );
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(String::from)
            .collect()
    }

    #[test]
    fn a_whole_answers_message_is_read_as_a_delta_and_anything_else_passed_over() {
        let corpus = corpus();
        let whole: Vec<&String> = corpus
            .iter()
            .filter(|l| l.contains("\"choices\"") && l.contains("\"message\":"))
            .collect();
        assert_eq!(whole.len(), 3);
        let read = |j: &str| {
            let fast = scan(j.as_bytes()).expect("the fast path takes whole answers");
            assert_eq!(Some(fast), chunk_info_serde(j.as_bytes()), "{j}");
            fast
        };
        let calls = read(whole[0]);
        assert!(calls.tool_call && calls.has_output);
        assert_eq!(calls.finish_reason, Some(FinishReason::ToolCalls));
        let text = read(whole[1]);
        assert!(!text.tool_call && text.has_output);
        assert_eq!(text.usage.map(|u| u.completion_tokens), Some(2));
        let odd = read(whole[2]);
        assert!(!odd.tool_call && !odd.has_output);
        assert_eq!(
            odd.usage.map(|u| u.prompt_tokens),
            Some(1),
            "usage is still read"
        );
    }

    #[test]
    fn agrees_with_the_serde_reader_or_defers_to_it() {
        for json in &corpus() {
            let fast = scan(json.as_bytes());
            let slow = chunk_info_serde(json.as_bytes());
            if let Some(f) = fast {
                assert_eq!(Some(f), slow, "{json}");
            }
        }
    }

    #[test]
    fn agrees_on_every_truncation_and_single_byte_change() {
        for json in &corpus() {
            let b = json.as_bytes();
            for cut in 0..b.len() {
                if let Some(f) = scan(&b[..cut]) {
                    assert_eq!(Some(f), chunk_info_serde(&b[..cut]), "{}", &json[..cut]);
                }
            }
            for i in 0..b.len() {
                for sub in [b'"', b'\\', b'}', b']', b',', b'0', b'n', b' '] {
                    let mut m = b.to_vec();
                    m[i] = sub;
                    if let Some(f) = scan(&m) {
                        assert_eq!(
                            Some(f),
                            chunk_info_serde(&m),
                            "{}",
                            String::from_utf8_lossy(&m)
                        );
                    }
                }
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn text_stop_agrees_with_a_byte_loop_on_long_strings(
            len in 0usize..400,
            fill in proptest::sample::select(vec![b'a', 0x20, 0x21, 0x23, 0x5b, 0x5d, 0x80, 0xff]),
            stops in proptest::collection::vec(
                (0usize..400, proptest::sample::select(vec![b'"', b'\\', 0x00, 0x1f])),
                0..3,
            ),
            from in 0usize..420,
        ) {
            let mut b = vec![fill; len];
            for (at, s) in stops {
                if at < len {
                    b[at] = s;
                }
            }
            let naive = b
                .get(from..)
                .and_then(|r| r.iter().position(|&c| c == b'"' || c == b'\\' || c < 0x20))
                .map(|at| from + at);
            proptest::prop_assert_eq!(text_stop(&b, from), naive);
        }
    }

    #[test]
    fn string_stop_finds_the_first_stop() {
        let naive = |b: &[u8], i: usize| {
            b.get(i..)?
                .iter()
                .position(|&c| c == b'"' || c == b'\\' || c < 0x20)
                .map(|at| i + at)
        };
        // Every stop byte and its neighbours (0x1f/0x20, 0x21/0x23,
        // 0x5b/0x5d, bytes with the high bit set) at every place in words
        // of up to 20 bytes, after every start.
        let fill = [b'a', 0x20, 0x21, 0x23, 0x5b, 0x5d, 0x80, 0xa2, 0xdc, 0xff];
        let stops = [b'"', b'\\', 0x00, 0x01, 0x1f];
        for len in 0..20 {
            for f in fill {
                for s in stops {
                    for at in 0..=len {
                        let mut b = vec![f; len];
                        if at < len {
                            b[at] = s;
                        }
                        // A second stop later, to catch a flag above the first.
                        if at + 3 < len {
                            b[at + 3] = b'"';
                        }
                        for i in 0..=len + 1 {
                            assert_eq!(string_stop(&b, i), naive(&b, i), "{b:?} from {i}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn takes_the_fast_path_on_what_engines_send() {
        for json in &corpus()[..12] {
            assert!(scan(json.as_bytes()).is_some(), "{json}");
        }
    }
}

#[cfg(test)]
pub(crate) mod prop;
