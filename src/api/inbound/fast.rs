//! The fast path of reading a request body: one forward pass that fills
//! [`Lite`] for the common shapes (chat messages whose contents are strings,
//! a completion prompt or an input that is a string, the plain scalar
//! fields), validating everything it passes over as serde_json would. What
//! it is not sure about (a `\u` escape in a string it keeps, content parts,
//! Responses items, `metadata`, a duplicate field, a fractional count,
//! malformed JSON) returns `None`, and the caller reads the body with
//! serde, the reference, which also words the error a client sees.
//!
//! Why it exists: on the benchmark's 400-byte chat body serde's derived
//! reader took ~4,950 instructions a request (callgrind,
//! `benches/e2e/instructions.sh`), most of them in its field machinery and
//! in buffering the untagged `ContentLite`, not in reading the bytes; see
//! docs/benchmarks-log.md, "2026-11-25 late night". It is checked against serde
//! by the tests below (a corpus, every truncation and byte change of it)
//! and by generated bodies in `prop.rs`: it may decline, never disagree.

use std::borrow::Cow;

use super::{ContentLite, Lite, MessageLite, PromptLite, StreamOptions};
use crate::stream::scan::{escape_len, number_len, string_stop, text_stop};

/// Nesting the reader follows before it declines: it recurses (serde_json
/// skips unknown values with a loop), so a body of brackets must not reach
/// the stack's end.
const MAX_DEPTH: usize = 100;

/// The body as [`Lite`], or `None` to let serde decide.
pub(super) fn read(body: &[u8]) -> Option<Lite<'_>> {
    // serde_json checks the UTF-8 of the strings it keeps; checking the
    // whole body once is stricter (an invalid byte anywhere declines) and
    // lets the kept strings be sliced from it.
    let text = std::str::from_utf8(body).ok()?;
    let mut r = R {
        b: body,
        s: text,
        i: 0,
    };
    let mut lite = Lite::default();
    let mut seen = Seen::default();
    r.expect(b'{')?;
    if r.peek()? == b'}' {
        r.i += 1;
    } else {
        loop {
            match r.key()? {
                b"model" => {
                    seen.first(0)?;
                    lite.model = r.opt_str()?;
                }
                b"stream" => {
                    seen.first(1)?;
                    lite.stream = r.opt_bool()?;
                }
                b"stream_options" => {
                    seen.first(2)?;
                    lite.stream_options = r.stream_options()?;
                }
                b"max_tokens" => {
                    seen.first(3)?;
                    lite.max_tokens = r.opt_u32()?;
                }
                b"max_completion_tokens" => {
                    seen.first(4)?;
                    lite.max_completion_tokens = r.opt_u32()?;
                }
                b"max_output_tokens" => {
                    seen.first(5)?;
                    lite.max_output_tokens = r.opt_u32()?;
                }
                b"messages" => {
                    seen.first(6)?;
                    lite.messages = r.messages()?;
                }
                b"prompt" => {
                    seen.first(7)?;
                    lite.prompt = r.opt_str()?.map(PromptLite::Text);
                }
                b"input" => {
                    seen.first(8)?;
                    lite.input = r.opt_str()?.map(PromptLite::Text);
                }
                b"system" => {
                    seen.first(9)?;
                    lite.system = r.opt_str()?.map(ContentLite::Text);
                }
                b"cache_salt" => {
                    seen.first(10)?;
                    lite.cache_salt = r.opt_str()?;
                }
                b"prompt_cache_key" => {
                    seen.first(11)?;
                    lite.prompt_cache_key = r.opt_str()?;
                }
                b"user" => {
                    seen.first(12)?;
                    lite.user = r.opt_str()?;
                }
                b"previous_response_id" => {
                    seen.first(13)?;
                    lite.previous_response_id = r.opt_str()?;
                }
                b"instructions" => {
                    seen.first(14)?;
                    lite.instructions = r.opt_str()?;
                }
                b"metadata" => {
                    seen.first(15)?;
                    r.null()?;
                }
                _ => r.skip(1)?,
            }
            match r.next()? {
                b',' => continue,
                b'}' => break,
                _ => return None,
            }
        }
    }
    r.ws();
    (r.i == body.len()).then_some(lite)
}

/// Fields already read in one object: serde refuses a struct's field twice.
#[derive(Default)]
struct Seen(u32);

impl Seen {
    fn first(&mut self, bit: u32) -> Option<()> {
        let mask = 1 << bit;
        if self.0 & mask != 0 {
            return None;
        }
        self.0 |= mask;
        Some(())
    }
}

struct R<'a> {
    b: &'a [u8],
    /// `b`, known to be UTF-8.
    s: &'a str,
    i: usize,
}

impl<'a> R<'a> {
    fn ws(&mut self) {
        while let Some(c) = self.b.get(self.i) {
            if !matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                break;
            }
            self.i += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn expect(&mut self, c: u8) -> Option<()> {
        (self.next()? == c).then_some(())
    }

    /// A string with no escape, without its quotes (`None` on an escape).
    fn plain_str(&mut self) -> Option<&'a str> {
        self.expect(b'"')?;
        let start = self.i;
        let end = string_stop(self.b, start)?;
        if self.b[end] != b'"' {
            return None;
        }
        self.i = end + 1;
        // Both ends are at ASCII quotes, so on character boundaries.
        self.s.get(start..end)
    }

    /// An object key without escapes, and its colon.
    fn key(&mut self) -> Option<&'a [u8]> {
        let k = self.plain_str()?;
        self.expect(b':')?;
        Some(k.as_bytes())
    }

    /// Any string, escapes checked, skipped: its first piece by
    /// [`text_stop`] (it may be long), the pieces between escapes by
    /// [`string_stop`] (they are short).
    fn skip_string(&mut self) -> Option<()> {
        self.expect(b'"')?;
        let mut at = text_stop(self.b, self.i)?;
        loop {
            match self.b[at] {
                b'"' => {
                    self.i = at + 1;
                    return Some(());
                }
                b'\\' => self.i = at + 1 + escape_len(self.b.get(at + 1..)?)?,
                _ => return None,
            }
            at = string_stop(self.b, self.i)?;
        }
    }

    /// `null`, followed by a delimiter.
    fn null(&mut self) -> Option<()> {
        self.ws();
        self.b[self.i..].starts_with(b"null").then_some(())?;
        self.i += 4;
        self.delimited()
    }

    /// `true`, `false`, `null` or a number, followed by a delimiter.
    fn skip_scalar(&mut self) -> Option<()> {
        let rest = &self.b[self.i..];
        self.i += if rest.starts_with(b"true") || rest.starts_with(b"null") {
            4
        } else if rest.starts_with(b"false") {
            5
        } else {
            number_len(rest)?
        };
        self.delimited()
    }

    /// What may follow a scalar: a delimiter, whitespace or the end.
    fn delimited(&self) -> Option<()> {
        matches!(
            self.b.get(self.i),
            Some(b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') | None
        )
        .then_some(())
    }

    /// Any value, its structure checked, skipped (`depth`: levels open).
    ///
    /// The chunk scanner's `P::skip_nested` (`stream/scan.rs`) walks values
    /// the same way, but not to the same rules: it leaves string contents
    /// unchecked and finds a long string's end with `memchr2` (per SSE
    /// event, measured there), while this reader must refuse whatever serde
    /// would (control characters). Kept apart for that, not by oversight.
    fn skip(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            b'"' => self.skip_string(),
            b'{' => {
                self.i += 1;
                if self.peek()? == b'}' {
                    self.i += 1;
                    return Some(());
                }
                loop {
                    self.skip_string()?;
                    self.expect(b':')?;
                    self.skip(depth + 1)?;
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
                    self.skip(depth + 1)?;
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

    /// `Option<Cow<str>>`: `null` or a string (see [`kept_str`](Self::kept_str)).
    /// The outer `None` declines.
    fn opt_str(&mut self) -> Option<Option<Cow<'a, str>>> {
        match self.peek()? {
            b'"' => Some(Some(self.kept_str()?)),
            _ => self.null().map(|()| None),
        }
    }

    /// A string a field keeps: borrowed from the body when it has no
    /// escape, else unescaped into a copy (see [`unescape`](Self::unescape)).
    fn kept_str(&mut self) -> Option<Cow<'a, str>> {
        self.expect(b'"')?;
        let start = self.i;
        let at = text_stop(self.b, start)?;
        match self.b[at] {
            b'"' => {
                self.i = at + 1;
                // Both ends are at ASCII quotes, so on character boundaries.
                self.s.get(start..at).map(Cow::Borrowed)
            }
            b'\\' => self.unescape(start, at).map(Cow::Owned),
            _ => None,
        }
    }

    /// The rest of a string from its first escape at `at`, unescaped as
    /// serde does. Prompts are full of `\n` and `\"`, so those are read
    /// here; a `\u` escape declines (serde's rules for surrogates stay
    /// serde's). Kept out of line: inlined, it slowed the plain strings'
    /// path by 4-10% (`cargo bench --bench routing -- inspect`).
    #[inline(never)]
    fn unescape(&mut self, start: usize, mut at: usize) -> Option<String> {
        let mut out = String::with_capacity(at - start + 64);
        let mut from = start;
        loop {
            // `at` is a backslash; the text before it is plain.
            out.push_str(self.s.get(from..at)?);
            out.push(match self.b.get(at + 1)? {
                b'"' => '"',
                b'\\' => '\\',
                b'/' => '/',
                b'b' => '\u{8}',
                b'f' => '\u{c}',
                b'n' => '\n',
                b'r' => '\r',
                b't' => '\t',
                _ => return None,
            });
            from = at + 2;
            at = string_stop(self.b, from)?;
            match self.b[at] {
                b'"' => {
                    out.push_str(self.s.get(from..at)?);
                    self.i = at + 1;
                    return Some(out);
                }
                b'\\' => {}
                _ => return None,
            }
        }
    }

    /// `Option<bool>`.
    fn opt_bool(&mut self) -> Option<Option<bool>> {
        self.ws();
        let rest = &self.b[self.i..];
        let (v, n) = if rest.starts_with(b"true") {
            (Some(true), 4)
        } else if rest.starts_with(b"false") {
            (Some(false), 5)
        } else {
            return self.null().map(|()| None);
        };
        self.i += n;
        self.delimited().map(|()| v)
    }

    /// `Option<u32>`: `null` or plain digits that fit.
    fn opt_u32(&mut self) -> Option<Option<u32>> {
        if self.peek()? == b'n' {
            return self.null().map(|()| None);
        }
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
        self.delimited().map(|()| Some(n))
    }

    /// `stream_options`: `null`, or an object whose `include_usage` is read.
    fn stream_options(&mut self) -> Option<Option<StreamOptions>> {
        if self.peek()? == b'n' {
            return self.null().map(|()| None);
        }
        self.expect(b'{')?;
        let mut o = StreamOptions {
            include_usage: None,
        };
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(Some(o));
        }
        let mut seen = Seen::default();
        loop {
            match self.key()? {
                b"include_usage" => {
                    seen.first(0)?;
                    o.include_usage = self.opt_bool()?;
                }
                _ => self.skip(2)?,
            }
            match self.next()? {
                b',' => continue,
                b'}' => return Some(Some(o)),
                _ => return None,
            }
        }
    }

    /// `messages`: `null`, or an array of messages whose `role` and
    /// `content` are strings (or `null`).
    fn messages(&mut self) -> Option<Option<Vec<MessageLite<'a>>>> {
        if self.peek()? == b'n' {
            return self.null().map(|()| None);
        }
        self.expect(b'[')?;
        let mut out = Vec::new();
        if self.peek()? == b']' {
            self.i += 1;
            return Some(Some(out));
        }
        loop {
            out.push(self.message()?);
            match self.next()? {
                b',' => continue,
                b']' => return Some(Some(out)),
                _ => return None,
            }
        }
    }

    fn message(&mut self) -> Option<MessageLite<'a>> {
        self.expect(b'{')?;
        let mut m = MessageLite {
            role: None,
            content: None,
        };
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(m);
        }
        let mut seen = Seen::default();
        loop {
            match self.key()? {
                b"role" => {
                    seen.first(0)?;
                    m.role = self.opt_str()?;
                }
                b"content" => {
                    seen.first(1)?;
                    m.content = self.opt_str()?.map(ContentLite::Text);
                }
                _ => self.skip(3)?,
            }
            match self.next()? {
                b',' => continue,
                b'}' => return Some(m),
                _ => return None,
            }
        }
    }
}

#[cfg(test)]
mod prop;

#[cfg(test)]
mod tests {
    use super::*;

    /// Request bodies as clients send them (the official SDKs, agents,
    /// the benchmark), each on one line; the first `TAKEN` must take the
    /// fast path.
    const TAKEN: usize = 10;
    const CORPUS: &[&str] = &[
        r#"{"max_tokens":32,"messages":[{"content":"You are a helpful assistant.","role":"system"},{"content":"the river batch block","role":"user"}],"model":"sim-model","stream":false}"#,
        r#"{"messages":[{"role":"user","content":"Say hi"}],"model":"m","stream":true,"stream_options":{"include_usage":true}}"#,
        r#"{"model":"m","prompt":"Once upon a time","max_tokens":16,"temperature":0.7,"stop":["\n"]}"#,
        r#"{"input":"embed me","model":"e5","encoding_format":"float"}"#,
        r#"{"model":"m","messages":[{"role":"system","content":"sys"},{"role":"user","content":"q"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\": 1}"}}]},{"role":"tool","tool_call_id":"c1","content":"42"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"a":{"type":"integer"}}}}}],"max_completion_tokens":100,"user":"u-1","prompt_cache_key":"k"}"#,
        "{\n  \"model\" : \"m\" ,\n  \"messages\" : [ { \"role\" : \"user\" , \"content\" : \"caf\u{e9} \u{2615}\" } ]\n}\n",
        r#"{"model":"claude","system":"be brief","messages":[{"role":"user","content":"hi"}],"max_tokens":1024,"metadata":null}"#,
        r#"{"model":"m","input":"hi","instructions":"be brief","previous_response_id":"resp_1","max_output_tokens":50,"cache_salt":"s"}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"say \"hi\""}]}"#,
        r#"{"model":"m","system":"Rules:\n\t- be brief\r\n- path C:\\x\/y\b\f","messages":[{"role":"user","content":"line one\nline two"}]}"#,
        // Declined: \u escapes in kept strings, parts, items, metadata.
        r#"{"model":"m","messages":[{"role":"user","content":"caf\u00e9"}]}"#,
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
        r#"{"model":"m","input":[{"role":"user","content":"hi"},{"type":"function_call_output","output":"42"}]}"#,
        r#"{"model":"m","metadata":{"user_id":"u"},"messages":[]}"#,
        r#"{"model":"m","prompt":["a","b"]}"#,
        r#"{"model":"m","stream":null,"max_tokens":null,"messages":null}"#,
        // Errors for serde.
        r#"{"model":"m","model":"n"}"#,
        r#"{"model":"m","max_tokens":1.5}"#,
        r#"{"model":"m","max_tokens":-1}"#,
        r#"{"model":"m","stream":"yes"}"#,
        r#"{"model":"m","x":01}"#,
        r#"{"model":"m",}"#,
        r#"["m"]"#,
        "{\"model\":\"a\tb\"}",
        r#"{"model":"m"} x"#,
    ];

    fn serde(b: &[u8]) -> Option<Lite<'_>> {
        serde_json::from_slice(b).ok()
    }

    fn agrees(b: &[u8]) {
        if let Some(fast) = read(b) {
            assert_eq!(Some(fast), serde(b), "{}", String::from_utf8_lossy(b));
        }
    }

    #[test]
    fn agrees_with_serde_or_defers_to_it() {
        for body in CORPUS {
            agrees(body.as_bytes());
        }
    }

    #[test]
    fn declines_deep_nesting_instead_of_recursing() {
        // serde_json skips an unknown value without recursion; the fast
        // reader recurses, so it gives up on deep nesting before the stack
        // does (a hostile body of brackets must not crash the gateway).
        let deep = format!(
            r#"{{"model":"m","x":{}{}}}"#,
            "[".repeat(200_000),
            "]".repeat(200_000)
        );
        assert!(read(deep.as_bytes()).is_none());
        assert!(serde(deep.as_bytes()).is_some());
        let shallow = format!(
            r#"{{"model":"m","x":{}{}}}"#,
            "[".repeat(50),
            "]".repeat(50)
        );
        assert!(read(shallow.as_bytes()).is_some());
    }

    #[test]
    fn takes_the_fast_path_on_what_clients_send() {
        for body in &CORPUS[..TAKEN] {
            assert!(read(body.as_bytes()).is_some(), "{body}");
            assert!(serde(body.as_bytes()).is_some(), "{body}");
        }
    }

    #[test]
    fn agrees_on_every_truncation_and_single_byte_change() {
        for body in CORPUS {
            let b = body.as_bytes();
            for cut in 0..b.len() {
                agrees(&b[..cut]);
            }
            for i in 0..b.len() {
                for sub in [
                    b'"', b'\\', b'}', b']', b',', b'0', b'n', b' ', b'\t', 0x01, 0xff,
                ] {
                    let mut m = b.to_vec();
                    m[i] = sub;
                    agrees(&m);
                }
            }
        }
    }
}
