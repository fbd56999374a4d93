//! Splits a byte stream into whole SSE events without copying in the common case.
//!
//! vLLM and most engines write one event per chunk, so an incoming chunk usually
//! holds whole events: those are handed out as `Bytes` slices of the chunk (no
//! copy). Only an event that straddles chunks is assembled in a carry buffer.
//! An event ends at a blank line (`\n\n` or `\r\n\r\n`); lone-`\r` line endings
//! are not supported (no OpenAI-compatible server emits them).

use bytes::{Bytes, BytesMut};

/// An event grew past the limit without a terminating blank line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventTooLarge;

#[derive(Debug)]
pub struct SseSplitter {
    /// Bytes of an unfinished event that began in an earlier chunk.
    carry: BytesMut,
    /// The not-yet-split rest of the latest chunk.
    frame: Bytes,
    max_event_bytes: usize,
}

impl SseSplitter {
    pub fn new(max_event_bytes: usize) -> Self {
        Self {
            carry: BytesMut::new(),
            frame: Bytes::new(),
            max_event_bytes,
        }
    }

    /// Add a chunk. Call only after [`next_event`](Self::next_event) returned `None`.
    pub fn push(&mut self, chunk: Bytes) {
        if self.frame.is_empty() {
            self.frame = chunk;
        } else {
            // Not expected by the contract above; stay correct anyway.
            self.carry.extend_from_slice(&self.frame);
            self.carry.extend_from_slice(&chunk);
            self.frame = Bytes::new();
        }
    }

    /// The next complete event (terminator included), or `None` until more input.
    pub fn next_event(&mut self) -> Result<Option<Bytes>, EventTooLarge> {
        if self.carry.is_empty() {
            if let Some(end) = event_end(&self.frame, 0) {
                return Ok(Some(self.frame.split_to(end)));
            }
            if !self.frame.is_empty() {
                self.carry.extend_from_slice(&self.frame);
                self.frame = Bytes::new();
            }
            return self.check_size();
        }
        let mut from = 0;
        if !self.frame.is_empty() {
            // The blank line may straddle the chunks: resume a few bytes back.
            from = self.carry.len().saturating_sub(3);
            self.carry.extend_from_slice(&self.frame);
            self.frame = Bytes::new();
        }
        match event_end(&self.carry, from) {
            Some(end) => Ok(Some(self.carry.split_to(end).freeze())),
            None => self.check_size(),
        }
    }

    /// What is left after [`next_event`](Self::next_event) returned an event:
    /// the rest of the latest chunk, not yet split.
    pub(crate) fn take_rest(&mut self) -> Bytes {
        if self.carry.is_empty() {
            std::mem::take(&mut self.frame)
        } else {
            self.carry.split().freeze()
        }
    }

    /// Bytes received but not yet part of a complete event.
    pub(crate) fn pending_len(&self) -> usize {
        self.carry.len() + self.frame.len()
    }

    fn check_size(&self) -> Result<Option<Bytes>, EventTooLarge> {
        if self.carry.len() > self.max_event_bytes {
            Err(EventTooLarge)
        } else {
            Ok(None)
        }
    }
}

/// The length of the complete event at the start of `buf` (terminator
/// included), as [`SseSplitter::next_event`] would cut it; `None` if it has
/// not ended yet.
pub(crate) fn event_len(buf: &[u8]) -> Option<usize> {
    event_end(buf, 0)
}

/// Index just past the blank line that ends the first event in `buf[from..]`.
fn event_end(buf: &[u8], from: usize) -> Option<usize> {
    if from == 0 {
        // A leading blank line is an (empty) event of its own.
        if buf.starts_with(b"\n") {
            return Some(1);
        }
        if buf.starts_with(b"\r\n") {
            return Some(2);
        }
    }
    for i in memchr::memchr_iter(b'\n', buf.get(from..)?) {
        let i = from + i;
        match buf.get(i + 1) {
            Some(b'\n') => return Some(i + 2),
            Some(b'\r') if buf.get(i + 2) == Some(&b'\n') => return Some(i + 3),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_all(chunks: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut s = SseSplitter::new(1 << 20);
        let mut out = Vec::new();
        for c in chunks {
            s.push(Bytes::copy_from_slice(c));
            while let Ok(Some(ev)) = s.next_event() {
                out.push(ev.to_vec());
            }
        }
        out
    }

    #[test]
    fn whole_events_in_one_chunk() {
        let ev = split_all(&[b"data: a\n\ndata: b\n\n"]);
        assert_eq!(ev, vec![b"data: a\n\n".to_vec(), b"data: b\n\n".to_vec()]);
    }

    #[test]
    fn events_across_chunks_at_every_split_point() {
        let stream: &[u8] = b"data: {\"x\":1}\n\ndata: two\r\n\r\n: comment\n\ndata: [DONE]\n\n";
        let expected = split_all(&[stream]);
        assert_eq!(expected.len(), 4);
        for i in 1..stream.len() {
            for j in i..stream.len() {
                let got = split_all(&[&stream[..i], &stream[i..j], &stream[j..]]);
                assert_eq!(got, expected, "split at {i},{j}");
            }
        }
    }

    #[test]
    fn multi_line_event_is_one_event() {
        let ev = split_all(&[b"event: x\ndata: a\ndata: b\n\n"]);
        assert_eq!(ev.len(), 1);
    }

    #[test]
    fn oversized_event_is_refused() {
        let mut s = SseSplitter::new(8);
        s.push(Bytes::from_static(b"data: 0123456789"));
        assert_eq!(s.next_event(), Err(EventTooLarge));
    }

    #[test]
    fn partial_event_waits() {
        let mut s = SseSplitter::new(1024);
        s.push(Bytes::from_static(b"data: par"));
        assert_eq!(s.next_event(), Ok(None));
        assert_eq!(s.pending_len(), 9);
    }
}

#[cfg(test)]
mod prop;
