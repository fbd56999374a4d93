//! The fast path of reading a stream's most common event, a token: the
//! stream's event shape, learned once and matched with two `memcmp`s.
//!
//! An engine writes every token of a stream as the same bytes around a
//! different string, e.g. vLLM's
//!
//! ```text
//! data: {"id":"chatcmpl-7","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":
//! " the"
//! },"logprobs":null,"finish_reason":null}]}\n\n
//! ```
//!
//! The first such event is read in full (`classify_spanned`: the scanner,
//! which says where the output string lies) and the bytes before the string
//! (the head) and after it (the tail) are kept with the answer. A later event
//! that is the head, one JSON string and the tail gets the same answer
//! without being parsed: the cost is two comparisons and one pass over the
//! string (for its closing quote), not a walk over every key.
//!
//! Why the answer is the same, exactly (the differential tests in
//! `shape/tests.rs` check it on the corpora and on generated events):
//! - The template's first `\n` is in its last three bytes (checked when it is
//!   learned), so neither the head nor the tail before that has one; the
//!   string is refused if it has one. The new event is then one `data: `
//!   line too, and `payload_of` hands the scanner the head's JSON, the
//!   string and the tail's JSON, as for the template.
//! - The scanner reads left to right without looking back: after the same
//!   head it is in the same state, at an opening quote. It skips a string
//!   to its first unescaped quote, checking only the escapes (`\x` with `x`
//!   one of `"\/bfnrt`, or `\u` and four hex digits); the string is refused
//!   unless it is valid by that rule and ends exactly where the tail begins.
//!   The string's only effect is "output seen" (it is an output field's
//!   value); the template's was non-empty, and so must this one be. After
//!   it, the scanner is in the template's state again and reads the same
//!   tail to the same end.
//!
//! So an event the shape takes is one the full reader would give the same
//! answer for; anything else (the first token, a finish reason, usage, an
//! error, another engine's shape, a changed `created` second) goes the full
//! way and may become the new shape. Cost of a miss: the full read, plus a
//! copy of ~200 bytes when the shape is re-learned.

use super::chunk::ChunkInfo;
use super::event::{Event, classify_spanned};
use super::scan::escape_len;

/// What one stream's token events look like; empty until learned.
#[derive(Debug, Default)]
pub struct Shape {
    /// The head's bytes, then the tail's.
    frame: Vec<u8>,
    /// Where the head ends in `frame`.
    head: usize,
    /// The answer for every event of this shape.
    info: ChunkInfo,
}

impl Shape {
    /// Classify one complete SSE event (as cut by the splitter): by the
    /// learned shape when the event has it, else in full, learning from it.
    pub fn classify(&mut self, event: &[u8]) -> Event {
        if let Some(info) = self.fits(event) {
            return Event::Chunk(info);
        }
        let (read, span) = classify_spanned(event);
        if let (Event::Chunk(info), Some(span)) = (&read, span) {
            self.learn(event, span.start, span.end, *info);
        }
        read
    }

    /// The answer for `event` if it has this shape.
    pub fn fits(&self, event: &[u8]) -> Option<ChunkInfo> {
        if self.frame.is_empty() {
            return None;
        }
        let (head, tail) = self.frame.split_at(self.head);
        let end = event.len().checked_sub(tail.len())?;
        let string = event.get(head.len()..end)?;
        (event.ends_with(tail) && event.starts_with(head) && is_output_string(string))
            .then_some(self.info)
    }

    /// Keep `event` as the shape: its output string is `event[start..end]`.
    /// Only plain tokens are kept (one choice with output, nothing else to
    /// learn), and only the one-line shape whose first `\n` ends the event.
    fn learn(&mut self, event: &[u8], start: usize, end: usize, info: ChunkInfo) {
        let plain = info.has_output
            && info.n_choices == 1
            && info.finish_reason.is_none()
            && info.usage.is_none()
            && !info.is_error;
        let one_line = event.starts_with(b"data: ")
            && memchr::memchr(b'\n', event)
                .is_some_and(|nl| matches!(&event[nl..], b"\n\n" | b"\n\r\n"));
        if !plain || !one_line || end <= start || end > event.len() {
            return;
        }
        self.frame.clear();
        self.frame.extend_from_slice(&event[..start]);
        self.frame.extend_from_slice(&event[end..]);
        self.head = start;
        self.info = info;
    }
}

/// One non-empty JSON string, quotes included, that the scanner would skip
/// as a whole: no unescaped `"` before the last byte, valid escapes, and no
/// `\n` (which would end the `data:` line).
pub(super) fn is_output_string(s: &[u8]) -> bool {
    let [b'"', inner @ .., b'"'] = s else {
        return false;
    };
    if inner.is_empty() {
        return false;
    }
    let mut i = 0;
    while let Some(at) = memchr::memchr3(b'"', b'\\', b'\n', &inner[i..]) {
        let at = i + at;
        if inner[at] != b'\\' {
            return false;
        }
        match escape_len(&inner[at + 1..]) {
            Some(n) => i = at + 1 + n,
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests;
