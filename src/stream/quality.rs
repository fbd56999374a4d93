//! The quality signals that need an answer's content, read without keeping
//! it: whether each tool call's arguments are valid JSON, and (opt-in,
//! `telemetry.quality.refusal`) whether the answer opens with a refusal.
//!
//! Nothing here runs per token. The relay hands an event to the
//! [`Inspector`] only when its reader flagged a tool call (chat:
//! `ChunkInfo::tool_call`; Messages and Responses: `ProtoEvent::tool_input`),
//! or while the refusal detector still listens to the answer's first
//! `chars` characters. A chat stream's argument pieces, which an engine
//! writes as the same bytes around a different string, are matched by the
//! shape learned from the first one (as `shape.rs` does for tokens): the
//! same head and tail around one valid JSON string are the same call with
//! that string as its piece, so only the string is decoded (measured in
//! docs/benchmarks-log.md "Quality signals: cost per token": 0.51 us per piece
//! parsed whole, 0.07 us by the shape). Arguments are held only until the answer ends (each
//! call's at most [`MAX_ARGS`] bytes: past that it is not judged), the
//! opening only until the phrases are checked; neither reaches any output.

use std::borrow::Cow;
use std::sync::{Arc, LazyLock};

use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::value::RawValue;

use crate::telemetry::quality::{Refusal, Verdict};
use crate::vocab::Wire;

/// Arguments longer than this are not judged (nor held).
pub(crate) const MAX_ARGS: usize = 256 << 10;

/// One tool call's arguments, as they arrive.
#[derive(Debug)]
struct Call {
    /// Choice and call index (chat), block index (Messages), output index
    /// (Responses).
    key: (u64, u64),
    args: String,
    /// Past [`MAX_ARGS`]: not judged.
    too_long: bool,
    /// Messages: the block's starting `input`, which the first
    /// `input_json_delta` replaces.
    provisional: bool,
}

/// What the string of a chat stream's pieces is: a call's arguments, or the
/// answer's text (choice 0's `content` or `text`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Piece {
    Args((u64, u64)),
    Text,
}

impl Piece {
    /// The key whose string this piece is.
    fn marker(self, completion: bool) -> &'static [u8] {
        match self {
            Piece::Args(_) => b"\"arguments\":",
            Piece::Text if completion => b"\"text\":",
            Piece::Text => b"\"content\":",
        }
    }
}

/// What a chat stream's pieces look like: the bytes before the string
/// (`head` of `frame`) and after it, and what the string is.
#[derive(Debug)]
struct PieceShape {
    frame: Vec<u8>,
    head: usize,
    piece: Piece,
}

impl PieceShape {
    /// The piece's string in `payload` if it has this shape (the JSON
    /// string, quotes included).
    fn fits<'a>(&self, payload: &'a [u8]) -> Option<&'a [u8]> {
        let (head, tail) = self.frame.split_at(self.head);
        let end = payload.len().checked_sub(tail.len())?;
        let string = payload.get(head.len()..end)?;
        (payload.starts_with(head)
            && payload.ends_with(tail)
            && super::shape::is_output_string(string))
        .then_some(string)
    }

    /// Learn from `payload`, whose only content is `piece` with string
    /// `text` (as the full reader found it): where that string lies, if its
    /// key appears once and is followed by exactly it.
    fn learn(payload: &[u8], (piece, text, completion): (Piece, &str, bool)) -> Option<Self> {
        let marker = piece.marker(completion);
        let mut at = memchr::memmem::find_iter(payload, marker);
        let start = at.next()? + marker.len();
        if at.next().is_some() {
            return None;
        }
        let start = start
            + payload[start..]
                .iter()
                .take_while(|b| b.is_ascii_whitespace())
                .count();
        let rest = payload.get(start..)?;
        // The string's end: its first unescaped quote after the opening one.
        let mut i = 1;
        loop {
            match *rest.get(i)? {
                b'"' => break,
                b'\\' => i += 1 + super::scan::escape_len(rest.get(i + 1..)?)?,
                _ => i += 1,
            }
        }
        let string = rest.get(..=i)?;
        if !super::shape::is_output_string(string) || decode(string)?.as_ref() != text {
            return None;
        }
        let end = start + string.len();
        let mut frame = payload[..start].to_vec();
        frame.extend_from_slice(&payload[end..]);
        Some(Self {
            frame,
            head: start,
            piece,
        })
    }
}

/// A JSON string token's text: borrowed when it has no escapes.
fn decode(string: &[u8]) -> Option<Cow<'_, str>> {
    let inner = string.get(1..string.len().checked_sub(1)?)?;
    if memchr::memchr(b'\\', inner).is_none() {
        return std::str::from_utf8(inner).ok().map(Cow::Borrowed);
    }
    serde_json::from_slice::<String>(string)
        .ok()
        .map(Cow::Owned)
}

/// One answer's reader (the relay boxes one only once it is needed).
#[derive(Debug)]
pub(crate) struct Inspector {
    wire: Wire,
    calls: Vec<Call>,
    /// Chat: the shape of this stream's pieces (arguments, or text while
    /// the refusal detector listens), once learned.
    shape: Option<PieceShape>,
    refusal: Option<Arc<Refusal>>,
    /// The opening so far, folded; characters in it.
    opening: String,
    opening_chars: usize,
    /// Decided: the opening was long enough to be checked.
    decided: Option<bool>,
}

impl Inspector {
    pub(crate) fn new(wire: Wire, refusal: Option<Arc<Refusal>>) -> Self {
        Self {
            wire,
            calls: Vec::new(),
            shape: None,
            refusal,
            opening: String::new(),
            opening_chars: 0,
            decided: None,
        }
    }

    /// Whether the refusal detector still wants the answer's text.
    pub(crate) fn listening(&self) -> bool {
        self.refusal.is_some() && self.decided.is_none()
    }

    /// Read one streamed event's JSON payload. Anything unreadable is left
    /// to the stream's own reader to judge.
    pub(crate) fn event(&mut self, payload: &[u8]) {
        match self.wire {
            Wire::OpenAi => {
                if let Some(s) = &self.shape
                    && let Some(string) = s.fits(payload)
                    && let Some(text) = decode(string)
                {
                    match s.piece {
                        Piece::Args(key) => self.append(key, &text),
                        Piece::Text => self.text(&text),
                    }
                    return;
                }
                let Ok(c) = serde_json::from_slice::<ChatChunk<'_>>(payload) else {
                    return;
                };
                // Read in full: it may be the stream's next shape (the
                // first piece often carries the call's id and name too).
                if let Some(s) = only_piece(&c).and_then(|p| PieceShape::learn(payload, p)) {
                    self.shape = Some(s);
                }
                for choice in c.choices {
                    let i = choice.index.unwrap_or(0);
                    if let Some(d) = choice.delta {
                        for (j, t) in d.tool_calls.into_iter().enumerate() {
                            let args = t.function.and_then(|f| f.arguments).unwrap_or_default();
                            let j = t.index.unwrap_or(j as u64);
                            self.append((i, j), &args);
                        }
                        if let Some(f) = d.function_call {
                            self.append((i, u64::MAX), &f.arguments.unwrap_or_default());
                        }
                        if i == 0
                            && let Some(text) = d.content
                        {
                            self.text(&text);
                        }
                    }
                    if i == 0
                        && let Some(text) = choice.text
                    {
                        self.text(&text);
                    }
                }
            }
            Wire::Anthropic => {
                let Ok(e) = serde_json::from_slice::<MessagesEvent<'_>>(payload) else {
                    return;
                };
                let key = (0, e.index.unwrap_or(0));
                match &*e.kind {
                    "content_block_start" => {
                        if let Some(b) = e.content_block
                            && b.kind == "tool_use"
                        {
                            // The input the block starts with stands unless
                            // `input_json_delta`s replace it (they always do
                            // in practice, starting from nothing).
                            let input = b.input.map_or("{}", RawValue::get);
                            self.start(key, input);
                        }
                    }
                    "content_block_delta" => match e.delta {
                        Some(MessagesDelta {
                            partial_json: Some(json),
                            ..
                        }) => self.append_delta(key, &json),
                        Some(MessagesDelta { text: Some(t), .. }) => self.text(&t),
                        _ => {}
                    },
                    _ => {}
                }
            }
            Wire::Responses => {
                let Ok(e) = serde_json::from_slice::<ResponsesEvent<'_>>(payload) else {
                    return;
                };
                let key = (0, e.output_index.unwrap_or(0));
                match &*e.kind {
                    "response.function_call_arguments.delta" => {
                        self.append(key, &e.delta.unwrap_or_default());
                    }
                    "response.function_call_arguments.done" => {
                        if let Some(all) = e.arguments {
                            self.replace(key, &all);
                        }
                    }
                    "response.output_text.delta" => {
                        if let Some(t) = e.delta {
                            self.text(&t);
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// The answer ended: judge what was read.
    pub(crate) fn finish(mut self) -> Verdict {
        let refusal = match (self.decided, &self.refusal) {
            (Some(r), _) => r,
            (None, Some(d)) => d.matches(&self.opening),
            (None, None) => false,
        };
        self.opening.clear();
        let mut v = Verdict {
            refusal,
            ..Verdict::default()
        };
        for c in &self.calls {
            v.tool_calls += 1;
            if !c.too_long && serde_json::from_str::<IgnoredAny>(&c.args).is_err() {
                v.invalid_tool_calls += 1;
            }
        }
        v
    }

    fn call(&mut self, key: (u64, u64)) -> &mut Call {
        let at = match self.calls.iter().position(|c| c.key == key) {
            Some(at) => at,
            None => {
                self.calls.push(Call {
                    key,
                    args: String::new(),
                    too_long: false,
                    provisional: false,
                });
                self.calls.len() - 1
            }
        };
        &mut self.calls[at]
    }

    fn append(&mut self, key: (u64, u64), part: &str) {
        let c = self.call(key);
        if c.too_long {
            return;
        }
        if c.args.len() + part.len() > MAX_ARGS {
            c.too_long = true;
            c.args = String::new();
            return;
        }
        c.args.push_str(part);
    }

    /// Messages: a tool block starts with `input`, which the first
    /// `input_json_delta` replaces.
    fn start(&mut self, key: (u64, u64), input: &str) {
        self.replace(key, input);
        self.call(key).provisional = true;
    }

    fn append_delta(&mut self, key: (u64, u64), part: &str) {
        let c = self.call(key);
        if c.provisional {
            c.provisional = false;
            c.args.clear();
            c.too_long = false;
        }
        self.append(key, part);
    }

    fn replace(&mut self, key: (u64, u64), all: &str) {
        let c = self.call(key);
        c.args.clear();
        c.too_long = all.len() > MAX_ARGS;
        if !c.too_long {
            c.args.push_str(all);
        }
    }

    fn text(&mut self, text: &str) {
        let Some(d) = self.refusal.clone() else {
            return;
        };
        if self.decided.is_some() {
            return;
        }
        for c in text.chars().take(d.chars - self.opening_chars) {
            self.opening.extend(c.to_lowercase());
            if c == '\u{2019}' {
                self.opening.pop();
                self.opening.push('\'');
            }
            self.opening_chars += 1;
        }
        if self.opening_chars >= d.chars {
            self.decided = Some(d.matches(&self.opening));
            self.opening = String::new();
        }
    }
}

/// The one piece a chunk carries, when that is all it carries (one choice;
/// one call's arguments, or choice 0's text): the chunk to learn the shape
/// from, what its string is, and whether it is a completion's `text`.
fn only_piece<'c>(c: &'c ChatChunk<'_>) -> Option<(Piece, &'c str, bool)> {
    let [choice] = c.choices.as_slice() else {
        return None;
    };
    let index = choice.index.unwrap_or(0);
    let Some(d) = choice.delta.as_ref() else {
        return (index == 0)
            .then_some(())
            .and(choice.text.as_deref())
            .map(|t| (Piece::Text, t, true));
    };
    if d.function_call.is_some() || choice.text.is_some() {
        return None;
    }
    match (d.tool_calls.as_slice(), d.content.as_deref()) {
        ([call], None) => {
            let piece = call.function.as_ref()?.arguments.as_deref()?;
            Some((Piece::Args((index, call.index.unwrap_or(0))), piece, false))
        }
        ([], Some(text)) if index == 0 => Some((Piece::Text, text, false)),
        _ => None,
    }
}

/// Whether a whole answer has a `"tool_calls"`, `"function_call"` or
/// `"tool_use"` string (a key, or a finish reason): only then is it read for
/// tool calls. Two passes, one for `"tool_` (both tool names start so) and
/// one for `"function_call"`: a pass per name cost ~1,070 instructions a
/// request, callgrind. The searchers are built once (building one per call
/// cost more than the searches).
fn mentions_a_call(body: &[u8]) -> bool {
    static TOOL: LazyLock<memchr::memmem::Finder<'static>> =
        LazyLock::new(|| memchr::memmem::Finder::new(b"\"tool_"));
    static FUNCTION: LazyLock<memchr::memmem::Finder<'static>> =
        LazyLock::new(|| memchr::memmem::Finder::new(b"\"function_call\""));
    TOOL.find_iter(body).any(|at| {
        let rest = &body[at + 6..];
        rest.starts_with(b"calls\"") || rest.starts_with(b"use\"")
    }) || FUNCTION.find(body).is_some()
}

/// Read a whole (non-streamed) answer: `None` when there is nothing to
/// judge (no tool call and no refusal detector).
pub(crate) fn whole(wire: Wire, body: &[u8], refusal: Option<&Arc<Refusal>>) -> Option<Verdict> {
    if !mentions_a_call(body) && refusal.is_none() {
        return None;
    }
    let mut i = Inspector::new(wire, refusal.cloned());
    match wire {
        Wire::OpenAi => {
            let r: ChatWhole<'_> = serde_json::from_slice(body).ok()?;
            for choice in r.choices {
                let n = choice.index.unwrap_or(0);
                if let Some(m) = choice.message {
                    for (j, t) in m.tool_calls.into_iter().enumerate() {
                        let args = t.function.and_then(|f| f.arguments).unwrap_or_default();
                        i.replace((n, j as u64), &args);
                    }
                    // A `function_call` with neither name nor arguments
                    // (`{}`) is no call, as the answer's scan reads it.
                    if let Some(f) = m
                        .function_call
                        .filter(|f| f.name.is_some() || f.arguments.is_some())
                    {
                        i.replace((n, u64::MAX), &f.arguments.unwrap_or_default());
                    }
                    if n == 0
                        && let Some(t) = m.content
                    {
                        i.text(&t);
                    }
                }
                if n == 0
                    && let Some(t) = choice.text
                {
                    i.text(&t);
                }
            }
        }
        Wire::Anthropic => {
            let m: MessagesWhole<'_> = serde_json::from_slice(body).ok()?;
            for (n, b) in m.content.into_iter().enumerate() {
                match &*b.kind {
                    "tool_use" => i.replace((0, n as u64), b.input.map_or("{}", RawValue::get)),
                    "text" => i.text(&b.text.unwrap_or_default()),
                    _ => {}
                }
            }
        }
        Wire::Responses => {
            let r: ResponsesWhole<'_> = serde_json::from_slice(body).ok()?;
            for (n, item) in r.output.into_iter().enumerate() {
                match &*item.kind {
                    "function_call" => {
                        i.replace((0, n as u64), &item.arguments.unwrap_or_default())
                    }
                    "message" => {
                        for c in item.content {
                            if c.kind == "output_text" {
                                i.text(&c.text.unwrap_or_default());
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    Some(i.finish())
}

#[derive(Deserialize)]
struct ChatChunk<'a> {
    #[serde(default, borrow)]
    choices: Vec<ChatChoice<'a>>,
}

#[derive(Deserialize)]
struct ChatChoice<'a> {
    #[serde(default)]
    index: Option<u64>,
    #[serde(default, borrow)]
    delta: Option<ChatMessage<'a>>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
}

/// A chat delta, or a whole answer's message.
#[derive(Deserialize)]
struct ChatMessage<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    tool_calls: Vec<ToolCall<'a>>,
    #[serde(default, borrow)]
    function_call: Option<Function<'a>>,
}

#[derive(Deserialize)]
struct ToolCall<'a> {
    #[serde(default)]
    index: Option<u64>,
    #[serde(default, borrow)]
    function: Option<Function<'a>>,
}

#[derive(Deserialize)]
struct Function<'a> {
    #[serde(default, borrow)]
    name: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    arguments: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct ChatWhole<'a> {
    #[serde(default, borrow)]
    choices: Vec<ChatWholeChoice<'a>>,
}

#[derive(Deserialize)]
struct ChatWholeChoice<'a> {
    #[serde(default)]
    index: Option<u64>,
    #[serde(default, borrow)]
    message: Option<ChatMessage<'a>>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct MessagesEvent<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default)]
    index: Option<u64>,
    #[serde(default, borrow)]
    content_block: Option<Block<'a>>,
    #[serde(default, borrow)]
    delta: Option<MessagesDelta<'a>>,
}

#[derive(Deserialize)]
struct MessagesDelta<'a> {
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    partial_json: Option<Cow<'a, str>>,
}

/// A Messages content block (streamed start, or a whole answer's).
#[derive(Deserialize)]
struct Block<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default, borrow)]
    input: Option<&'a RawValue>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct MessagesWhole<'a> {
    #[serde(default, borrow)]
    content: Vec<Block<'a>>,
}

#[derive(Deserialize)]
struct ResponsesEvent<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default)]
    output_index: Option<u64>,
    #[serde(default, borrow)]
    delta: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    arguments: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct ResponsesWhole<'a> {
    #[serde(default, borrow)]
    output: Vec<OutputItem<'a>>,
}

#[derive(Deserialize)]
struct OutputItem<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default, borrow)]
    arguments: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    content: Vec<OutputContent<'a>>,
}

#[derive(Deserialize)]
struct OutputContent<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
}

#[cfg(test)]
mod tests;
