//! What one SSE event of an OpenAI-style stream carries, read without allocating.
//!
//! Only the fields the gateway needs are decoded: whether any choice carries
//! generated output (the token clock), the finish reason, the usage block and an
//! error object. Everything else is skipped by serde without being built. The
//! event bytes themselves are never rewritten.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

pub(crate) use super::chunk::ChunkInfo;
use crate::vocab::{FinishReason, Usage};
use serde_json::value::RawValue;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// `data: [DONE]`
    Done,
    Chunk(ChunkInfo),
    /// Comments, keep-alives, events without data: forwarded, not counted.
    Other,
    /// A `data:` payload that is not JSON; the reason is for the error event.
    Malformed(&'static str),
}

/// Classify one complete SSE event (as cut by the splitter).
pub fn classify(event: &[u8]) -> Event {
    classify_spanned(event).0
}

/// [`classify`], and where in `event` the chunk's last non-empty output
/// string lies (quotes included) when the fast scanner read it from the
/// event's own bytes: what a stream's [`Shape`](super::shape::Shape) is
/// learned from.
pub(crate) fn classify_spanned(event: &[u8]) -> (Event, Option<Range<usize>>) {
    let Some(payload) = payload_of(event) else {
        return (Event::Other, None);
    };
    let trimmed = payload.trim_ascii();
    if trimmed == b"[DONE]" {
        return (Event::Done, None);
    }
    if let Some((info, span)) = super::scan::scan_spanned(trimmed) {
        let at = match payload {
            Cow::Borrowed(_) => offset_in(event, trimmed),
            Cow::Owned(_) => None,
        };
        let span = span.zip(at).map(|(s, at)| s.start + at..s.end + at);
        return (Event::Chunk(info), span);
    }
    let event = match chunk_info_serde(trimmed) {
        Some(c) => Event::Chunk(c),
        None => Event::Malformed("the replica sent an SSE event that is not valid JSON"),
    };
    (event, None)
}

/// Where `part` starts inside `whole`, if it is a slice of it.
fn offset_in(whole: &[u8], part: &[u8]) -> Option<usize> {
    let at = (part.as_ptr() as usize).checked_sub(whole.as_ptr() as usize)?;
    (at + part.len() <= whole.len()).then_some(at)
}

/// The data of one complete SSE event: its `data:` lines joined with `\n`
/// (SSE), or `None` for an event without data (a comment, a keep-alive).
/// Borrowed in the common case, one `data: ` line.
pub(crate) fn payload_of(event: &[u8]) -> Option<Cow<'_, [u8]>> {
    // Fast path, what engines send: one `data: ` line and the blank line.
    if let Some(rest) = event.strip_prefix(b"data: ")
        && let Some(nl) = memchr::memchr(b'\n', rest)
        && matches!(&rest[nl..], b"\n\n" | b"\n\r\n")
    {
        let payload = &rest[..nl];
        return Some(Cow::Borrowed(
            payload.strip_suffix(b"\r").unwrap_or(payload),
        ));
    }
    let mut data: Option<&[u8]> = None;
    let mut multi = false;
    for line in event.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(rest) = line.strip_prefix(b"data:") {
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            if data.is_some() {
                multi = true;
            }
            data = Some(rest);
        }
    }
    let payload = data?;
    if multi {
        // Multi-line data is joined with '\n' (SSE spec); rare, so allocate here.
        let joined: Vec<u8> = event
            .split(|b| *b == b'\n')
            .filter_map(|l| l.strip_suffix(b"\r").unwrap_or(l).strip_prefix(b"data:"))
            .map(|r| r.strip_prefix(b" ").unwrap_or(r))
            .collect::<Vec<_>>()
            .join(&b'\n');
        return Some(Cow::Owned(joined));
    }
    Some(Cow::Borrowed(payload))
}

/// Read a chunk, or a whole non-streamed response (same fields), as [`ChunkInfo`]:
/// the fast scanner when it is sure, the serde reader otherwise.
pub fn chunk_info(json: &[u8]) -> Option<ChunkInfo> {
    super::scan::scan(json).or_else(|| chunk_info_serde(json))
}

/// The reference reader (serde, skipping what it does not need).
pub fn chunk_info_serde(json: &[u8]) -> Option<ChunkInfo> {
    let c = serde_json::from_slice::<ChunkLite<'_>>(json).ok()?;
    Some(ChunkInfo {
        has_output: c.choices.has_output,
        tool_call: c.choices.tool_call,
        n_choices: c.choices.n,
        finish_reason: c.choices.finish_reason,
        usage: c.usage,
        is_error: c.error.is_some_and(|e| e.get() != "null"),
    })
}

#[derive(Deserialize)]
struct ChunkLite<'a> {
    #[serde(default)]
    choices: Choices,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default, borrow)]
    error: Option<&'a RawValue>,
}

/// The choices array folded into a summary while it is read (no Vec).
#[derive(Default)]
struct Choices {
    n: u32,
    has_output: bool,
    tool_call: bool,
    finish_reason: Option<FinishReason>,
}

impl<'de> Deserialize<'de> for Choices {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Choices;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of choices")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Choices, E> {
                Ok(Choices::default())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Choices, A::Error> {
                let mut out = Choices::default();
                while let Some(c) = seq.next_element::<ChoiceLite<'de>>()? {
                    out.n += 1;
                    let message = c.message();
                    out.has_output |= c.has_output(message.as_ref());
                    out.tool_call |= [&c.delta, &message]
                        .into_iter()
                        .any(|d| d.as_ref().is_some_and(|d| d.tool_call));
                    if c.finish_reason.is_some() {
                        out.finish_reason = c.finish_reason;
                    }
                }
                Ok(out)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
struct ChoiceLite<'a> {
    #[serde(default)]
    delta: Option<Delta>,
    /// A whole (non-streamed) answer's message: an object is read as a
    /// delta is, anything else passed over.
    #[serde(default, borrow)]
    message: Option<&'a RawValue>,
    /// `/v1/completions` chunks carry `text` instead of `delta`.
    #[serde(default, borrow)]
    text: Option<&'a RawValue>,
    #[serde(default)]
    finish_reason: Option<FinishReason>,
}

impl ChoiceLite<'_> {
    /// The message read as a delta, if it is an object.
    fn message(&self) -> Option<Delta> {
        let raw = self.message?.get();
        if !raw.trim_start().starts_with('{') {
            return None;
        }
        serde_json::from_str(raw).ok()
    }

    fn has_output(&self, message: Option<&Delta>) -> bool {
        self.delta.as_ref().is_some_and(|d| d.has_output)
            || message.is_some_and(|m| m.has_output)
            || non_empty(self.text)
    }
}

/// Whether a delta carries output: content, reasoning (vLLM `reasoning_content`
/// / `reasoning`) or tool calls. The role-only first delta carries none.
struct Delta {
    has_output: bool,
    /// Of which a tool call.
    tool_call: bool,
}

/// The delta keys that matter; any other key is skipped without allocating.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum DeltaKey {
    Content,
    ReasoningContent,
    Reasoning,
    ToolCalls,
    FunctionCall,
    #[serde(other)]
    Other,
}

impl<'de> Deserialize<'de> for Delta {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Delta;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a delta object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Delta, A::Error> {
                let (mut has_output, mut tool_call) = (false, false);
                while let Some(key) = map.next_key::<DeltaKey>()? {
                    if let DeltaKey::Other = key {
                        map.next_value::<IgnoredAny>()?;
                    } else {
                        let v: &'de RawValue = map.next_value()?;
                        let out = non_empty(Some(v));
                        has_output |= out;
                        tool_call |=
                            out && matches!(key, DeltaKey::ToolCalls | DeltaKey::FunctionCall);
                    }
                }
                Ok(Delta {
                    has_output,
                    tool_call,
                })
            }
        }
        d.deserialize_map(V)
    }
}

/// Not null, `""`, `[]` or `{}`.
fn non_empty(v: Option<&RawValue>) -> bool {
    let Some(v) = v else { return false };
    let s = v.get().trim();
    match s.as_bytes().first() {
        Some(b'[' | b'{') => !s[1..s.len().saturating_sub(1).max(1)].trim().is_empty(),
        _ => !matches!(s, "null" | "\"\""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(ev: &str) -> ChunkInfo {
        match classify(ev.as_bytes()) {
            Event::Chunk(c) => c,
            other => panic!("not a chunk: {other:?}"),
        }
    }

    #[test]
    fn role_only_delta_is_not_output() {
        let c = chunk(
            r#"data: {"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}

"#,
        );
        assert!(!c.has_output);
        assert_eq!(c.n_choices, 1);
    }

    #[test]
    fn content_reasoning_tools_and_text_are_output() {
        for body in [
            r#"{"choices":[{"delta":{"content":"Hi"}}]}"#,
            r#"{"choices":[{"delta":{"reasoning_content":"hmm"}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}"#,
            r#"{"choices":[{"text":"Hi","index":0}]}"#,
            r#"{"choices":[{"delta":{"content":"\"q\""}}]}"#,
        ] {
            assert!(chunk(&format!("data: {body}\n\n")).has_output, "{body}");
        }
    }

    #[test]
    fn usage_only_chunk_and_finish_reason() {
        let c = chunk(
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":7,\"total_tokens\":12}}\n\n",
        );
        assert!(c.is_usage_only());
        assert_eq!(
            c.usage,
            Some(Usage {
                prompt_tokens: 5,
                completion_tokens: 7,
                cached_tokens: None,
            })
        );
        // vLLM with prompt-token details: the cached part of the prompt.
        let c = chunk(
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3000,\"completion_tokens\":7,\"prompt_tokens_details\":{\"cached_tokens\":2944}}}\n\n",
        );
        assert_eq!(c.usage.and_then(|u| u.cached_tokens), Some(2944));
        let c = chunk(
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\"}],\"usage\":null}\n\n",
        );
        assert_eq!(c.finish_reason, Some(FinishReason::Length));
        assert!(!c.is_usage_only());
    }

    #[test]
    fn done_error_other_and_malformed() {
        assert_eq!(classify(b"data: [DONE]\n\n"), Event::Done);
        assert_eq!(classify(b": keep-alive\n\n"), Event::Other);
        assert!(matches!(classify(b"data: {oops\n\n"), Event::Malformed(_)));
        let c = chunk("data: {\"error\":{\"message\":\"boom\",\"code\":500}}\n\n");
        assert!(c.is_error);
    }

    #[test]
    fn multi_line_data_is_joined() {
        let c = chunk("data: {\"choices\":\ndata: [{\"delta\":{\"content\":\"a\"}}]}\n\n");
        assert!(c.has_output);
    }
}
