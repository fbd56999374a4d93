//! Reading the streams (and whole answers) of the protocols coding agents
//! speak: Anthropic Messages and OpenAI Responses.
//!
//! Both name their events, and each event's JSON repeats its name as
//! `type`, so only the `data:` payload is read (the `event:` line is not
//! needed). Only what the request accounts is decoded; serde skips the rest
//! without building it. The bytes are never rewritten.
//!
//! **Messages** (`message_start`, `content_block_*`, `message_delta`,
//! `message_stop`, `ping`, `error`): output is a `content_block_delta`
//! carrying text, thinking or tool-input JSON; usage starts in
//! `message_start` and every `message_delta` overrides the fields it carries
//! (they are cumulative). Anthropic's `input_tokens` excludes the cache:
//! prompt tokens = `input_tokens + cache_read_input_tokens +
//! cache_creation_input_tokens`, cached = `cache_read_input_tokens`.
//!
//! **Responses** (`response.created` ... `response.completed` |
//! `response.incomplete` | `response.failed`, `error`): output is any
//! `*.delta` event with a non-empty string delta (text, refusal, reasoning,
//! function-call arguments); usage is the terminal event's
//! `response.usage` (`input_tokens` is the whole prompt,
//! `input_tokens_details.cached_tokens` its cached part).

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::vocab::{FinishReason, Usage, Wire};

/// What one event tells the gateway.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct ProtoEvent {
    /// Carries generated output (the token clock).
    pub has_output: bool,
    pub finish_reason: Option<FinishReason>,
    /// The stream's last event: `message_stop`, or a terminal `response.*`.
    pub terminal: bool,
    /// An error reported in-band (`error`, `response.failed`).
    pub is_error: bool,
    /// Responses: the response's id, when the event carries the response.
    pub response_id: Option<String>,
    /// Starts or carries a tool call's input (the quality inspector reads it).
    pub tool_input: bool,
}

/// One stream's reader: the event summaries, and what accumulates over the
/// stream (usage, whether a tool was called, the sequence numbers).
#[derive(Debug, Clone)]
pub(crate) struct ProtoReader {
    wire: Wire,
    usage: UsageFold,
    /// Responses: the terminal event's usage.
    final_usage: Option<Usage>,
    tool_call: bool,
    /// Responses: the last `sequence_number` seen.
    last_seq: Option<u64>,
}

impl ProtoReader {
    pub(crate) fn new(wire: Wire) -> Self {
        Self {
            wire,
            usage: UsageFold::default(),
            final_usage: None,
            tool_call: false,
            last_seq: None,
        }
    }

    /// Read one event's data; `Err` when it is not the protocol's JSON.
    pub(crate) fn read(&mut self, payload: &[u8]) -> Result<ProtoEvent, &'static str> {
        match self.wire {
            Wire::Anthropic => self.read_messages(payload),
            Wire::Responses => self.read_responses(payload),
            Wire::OpenAi => Err("not a Messages or Responses stream"),
        }
    }

    pub(crate) fn wire(&self) -> Wire {
        self.wire
    }

    /// The usage reported so far (final once the stream is over).
    pub(crate) fn usage(&self) -> Option<Usage> {
        match self.wire {
            Wire::Anthropic => self.usage.usage(),
            _ => self.final_usage,
        }
    }

    /// The `sequence_number` an event added by the gateway takes (Responses).
    pub(crate) fn next_sequence(&self) -> u64 {
        self.last_seq.map_or(0, |s| s + 1)
    }

    fn read_messages(&mut self, payload: &[u8]) -> Result<ProtoEvent, &'static str> {
        let e: MessagesEvent<'_> = serde_json::from_slice(payload)
            .map_err(|_| "the replica sent a Messages event that is not valid JSON")?;
        let mut out = ProtoEvent::default();
        match &*e.kind {
            "message_start" => {
                if let Some(u) = e.message.and_then(|m| m.usage) {
                    self.usage.apply(&u);
                }
            }
            "content_block_start" => {
                out.tool_input = e.content_block.is_some_and(|b| b.kind == "tool_use");
            }
            "content_block_delta" => {
                out.has_output = e.delta.as_ref().is_some_and(MessagesDelta::has_output);
                out.tool_input = e.delta.as_ref().is_some_and(|d| non_empty(d.partial_json));
            }
            "message_delta" => {
                if let Some(u) = &e.usage {
                    self.usage.apply(u);
                }
                out.finish_reason = e
                    .delta
                    .as_ref()
                    .and_then(|d| d.stop_reason.as_deref())
                    .map(stop_reason);
            }
            "message_stop" => out.terminal = true,
            "error" => out.is_error = true,
            _ => {}
        }
        Ok(out)
    }

    fn read_responses(&mut self, payload: &[u8]) -> Result<ProtoEvent, &'static str> {
        let e: ResponsesEvent<'_> = serde_json::from_slice(payload)
            .map_err(|_| "the replica sent a Responses event that is not valid JSON")?;
        if let Some(s) = e.sequence_number {
            self.last_seq = Some(self.last_seq.map_or(s, |l| l.max(s)));
        }
        let kind = &*e.kind;
        let mut out = ProtoEvent {
            has_output: kind.ends_with(".delta") && non_empty_string(e.delta),
            ..ProtoEvent::default()
        };
        if kind.starts_with("response.function_call_arguments.") {
            self.tool_call = true;
            out.tool_input = true;
        }
        let response = e.response.as_ref();
        if let Some(r) = response {
            out.response_id = r.id.as_deref().map(str::to_string);
        }
        match kind {
            "response.completed" | "response.incomplete" | "response.failed" => {
                out.terminal = true;
                self.final_usage = response.and_then(|r| r.usage.map(ResponsesUsage::usage));
                match kind {
                    "response.completed" => {
                        out.finish_reason = Some(if self.tool_call {
                            FinishReason::ToolCalls
                        } else {
                            FinishReason::Stop
                        });
                    }
                    "response.incomplete" => {
                        let why = response
                            .and_then(|r| r.incomplete_details.as_ref())
                            .and_then(|d| d.reason.as_deref());
                        out.finish_reason = Some(incomplete_reason(why));
                    }
                    _ => out.is_error = true,
                }
            }
            "error" => out.is_error = true,
            _ => {}
        }
        Ok(out)
    }
}

/// What a whole (non-streamed) answer says.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Whole {
    pub usage: Option<Usage>,
    pub finish_reason: Option<FinishReason>,
    pub response_id: Option<String>,
}

/// Read a whole Messages message or Responses response object.
pub(crate) fn whole(wire: Wire, body: &[u8]) -> Option<Whole> {
    match wire {
        Wire::Anthropic => {
            let m: MessagesWhole<'_> = serde_json::from_slice(body).ok()?;
            let mut fold = UsageFold::default();
            if let Some(u) = &m.usage {
                fold.apply(u);
            }
            Some(Whole {
                usage: fold.usage(),
                finish_reason: m.stop_reason.as_deref().map(stop_reason),
                response_id: None,
            })
        }
        Wire::Responses => {
            let r: ResponseObject<'_> = serde_json::from_slice(body).ok()?;
            let finish_reason = match r.status.as_deref() {
                Some("completed") => Some(if r.output.iter().any(|i| i.is_call()) {
                    FinishReason::ToolCalls
                } else {
                    FinishReason::Stop
                }),
                Some("incomplete") => Some(incomplete_reason(
                    r.incomplete_details
                        .as_ref()
                        .and_then(|d| d.reason.as_deref()),
                )),
                _ => None,
            };
            Some(Whole {
                usage: r.usage.map(ResponsesUsage::usage),
                finish_reason,
                response_id: r.id.as_deref().map(str::to_string),
            })
        }
        Wire::OpenAi => None,
    }
}

/// Anthropic's `stop_reason` in the gateway's closed set.
fn stop_reason(s: &str) -> FinishReason {
    match s {
        "end_turn" | "stop_sequence" => FinishReason::Stop,
        "max_tokens" => FinishReason::Length,
        "tool_use" => FinishReason::ToolCalls,
        "refusal" => FinishReason::ContentFilter,
        _ => FinishReason::Other,
    }
}

/// Responses' `incomplete_details.reason` in the gateway's closed set.
fn incomplete_reason(s: Option<&str>) -> FinishReason {
    match s {
        Some("max_output_tokens") => FinishReason::Length,
        Some("content_filter") => FinishReason::ContentFilter,
        _ => FinishReason::Other,
    }
}

/// A JSON string other than `""`.
fn non_empty_string(v: Option<&RawValue>) -> bool {
    v.is_some_and(|v| {
        let s = v.get().as_bytes();
        s.first() == Some(&b'"') && s.len() > 2
    })
}

/// Not null, `""`, `[]` or `{}`.
fn non_empty(v: Option<&RawValue>) -> bool {
    v.is_some_and(|v| !matches!(v.get().trim(), "null" | "\"\"" | "[]" | "{}"))
}

#[derive(Debug, Default, Clone, Copy)]
struct UsageFold {
    input: Option<u32>,
    cache_read: Option<u32>,
    cache_creation: Option<u32>,
    output: Option<u32>,
    seen: bool,
}

impl UsageFold {
    /// Fields present override (Anthropic's counts are cumulative).
    fn apply(&mut self, u: &MessagesUsage) {
        self.seen = true;
        self.input = u.input_tokens.or(self.input);
        self.cache_read = u.cache_read_input_tokens.or(self.cache_read);
        self.cache_creation = u.cache_creation_input_tokens.or(self.cache_creation);
        self.output = u.output_tokens.or(self.output);
    }

    fn usage(&self) -> Option<Usage> {
        self.seen.then(|| {
            let n = |v: Option<u32>| v.unwrap_or(0);
            Usage {
                prompt_tokens: n(self.input)
                    .saturating_add(n(self.cache_read))
                    .saturating_add(n(self.cache_creation)),
                completion_tokens: n(self.output),
                cached_tokens: self.cache_read,
            }
        })
    }
}

#[derive(Deserialize)]
struct MessagesEvent<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default)]
    message: Option<MessagesStart>,
    #[serde(default, borrow)]
    content_block: Option<BlockKind<'a>>,
    #[serde(default, borrow)]
    delta: Option<MessagesDelta<'a>>,
    #[serde(default)]
    usage: Option<MessagesUsage>,
}

/// A `content_block_start`'s block, by its type only.
#[derive(Deserialize)]
struct BlockKind<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
}

#[derive(Deserialize)]
struct MessagesStart {
    #[serde(default)]
    usage: Option<MessagesUsage>,
}

/// A `content_block_delta`'s or `message_delta`'s `delta`.
#[derive(Deserialize)]
struct MessagesDelta<'a> {
    #[serde(default, borrow)]
    text: Option<&'a RawValue>,
    #[serde(default, borrow)]
    thinking: Option<&'a RawValue>,
    #[serde(default, borrow)]
    partial_json: Option<&'a RawValue>,
    #[serde(default, borrow)]
    stop_reason: Option<Cow<'a, str>>,
}

impl MessagesDelta<'_> {
    /// Text, thinking or tool input; a signature or citation is not output.
    fn has_output(&self) -> bool {
        non_empty(self.text) || non_empty(self.thinking) || non_empty(self.partial_json)
    }
}

#[derive(Deserialize)]
struct MessagesUsage {
    #[serde(default)]
    input_tokens: Option<u32>,
    #[serde(default)]
    output_tokens: Option<u32>,
    #[serde(default)]
    cache_read_input_tokens: Option<u32>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u32>,
}

#[derive(Deserialize)]
struct MessagesWhole<'a> {
    #[serde(default, borrow)]
    stop_reason: Option<Cow<'a, str>>,
    #[serde(default)]
    usage: Option<MessagesUsage>,
}

#[derive(Deserialize)]
struct ResponsesEvent<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default, borrow)]
    delta: Option<&'a RawValue>,
    #[serde(default, borrow)]
    response: Option<ResponseObject<'a>>,
    #[serde(default)]
    sequence_number: Option<u64>,
}

#[derive(Deserialize)]
struct ResponseObject<'a> {
    #[serde(default, borrow)]
    id: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    status: Option<Cow<'a, str>>,
    #[serde(default)]
    usage: Option<ResponsesUsage>,
    #[serde(default, borrow)]
    incomplete_details: Option<Incomplete<'a>>,
    #[serde(default, borrow, deserialize_with = "items")]
    output: Vec<OutputItem<'a>>,
}

/// `output`, also when it is `null`.
fn items<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<OutputItem<'de>>, D::Error> {
    Ok(Option::<Vec<OutputItem<'de>>>::deserialize(d)?.unwrap_or_default())
}

#[derive(Deserialize)]
struct OutputItem<'a> {
    #[serde(rename = "type", default, borrow)]
    kind: Option<Cow<'a, str>>,
}

impl OutputItem<'_> {
    fn is_call(&self) -> bool {
        self.kind
            .as_deref()
            .is_some_and(|k| k == "function_call" || k == "custom_tool_call")
    }
}

#[derive(Deserialize)]
struct Incomplete<'a> {
    #[serde(default, borrow)]
    reason: Option<Cow<'a, str>>,
}

#[derive(Deserialize, Clone, Copy)]
struct ResponsesUsage {
    #[serde(default)]
    input_tokens: u32,
    #[serde(default)]
    output_tokens: u32,
    #[serde(default)]
    input_tokens_details: Option<InputDetails>,
}

impl ResponsesUsage {
    fn usage(self) -> Usage {
        Usage {
            prompt_tokens: self.input_tokens,
            completion_tokens: self.output_tokens,
            cached_tokens: self.input_tokens_details.and_then(|d| d.cached_tokens),
        }
    }
}

#[derive(Deserialize, Clone, Copy)]
struct InputDetails {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(wire: Wire, events: &[&str]) -> (ProtoReader, Vec<ProtoEvent>) {
        let mut r = ProtoReader::new(wire);
        let out = events
            .iter()
            .map(|e| r.read(e.as_bytes()).unwrap())
            .collect();
        (r, out)
    }

    #[test]
    fn messages_usage_folds_and_excludes_nothing_cached() {
        let (r, ev) = read_all(
            Wire::Anthropic,
            &[
                r#"{"type":"message_start","message":{"id":"msg_1","usage":{"input_tokens":20,"cache_read_input_tokens":2980,"cache_creation_input_tokens":0,"output_tokens":1}}}"#,
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
                r#"{"type":"ping"}"#,
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":""}}"#,
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#,
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"thinking_delta","thinking":"hm"}}"#,
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"signature_delta","signature":"abc"}}"#,
                r#"{"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{\"a\""}}"#,
                r#"{"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":15}}"#,
                r#"{"type":"message_stop"}"#,
            ],
        );
        let outputs: Vec<bool> = ev.iter().map(|e| e.has_output).collect();
        assert_eq!(
            outputs,
            [
                false, false, false, false, true, true, false, true, false, false
            ]
        );
        assert_eq!(ev[8].finish_reason, Some(FinishReason::ToolCalls));
        assert!(ev[9].terminal);
        assert_eq!(
            r.usage(),
            Some(Usage {
                prompt_tokens: 3000,
                completion_tokens: 15,
                cached_tokens: Some(2980)
            })
        );
    }

    #[test]
    fn messages_errors_and_stop_reasons() {
        let (_, ev) = read_all(
            Wire::Anthropic,
            &[r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#],
        );
        assert!(ev[0].is_error);
        for (s, f) in [
            ("end_turn", FinishReason::Stop),
            ("stop_sequence", FinishReason::Stop),
            ("max_tokens", FinishReason::Length),
            ("refusal", FinishReason::ContentFilter),
            ("pause_turn", FinishReason::Other),
        ] {
            assert_eq!(stop_reason(s), f);
        }
        let mut r = ProtoReader::new(Wire::Anthropic);
        assert!(r.read(b"{oops").is_err());
        assert!(r.read(b"[1]").is_err());
    }

    #[test]
    fn responses_usage_output_and_ends() {
        let (r, ev) = read_all(
            Wire::Responses,
            &[
                r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","status":"in_progress","usage":null,"output":[]}}"#,
                r#"{"type":"response.output_text.delta","sequence_number":4,"item_id":"m","output_index":0,"content_index":0,"delta":"Hi"}"#,
                r#"{"type":"response.output_text.delta","sequence_number":5,"delta":""}"#,
                r#"{"type":"response.reasoning_summary_text.delta","sequence_number":6,"delta":"hm"}"#,
                r#"{"type":"response.completed","sequence_number":9,"response":{"id":"resp_1","status":"completed","usage":{"input_tokens":3000,"input_tokens_details":{"cached_tokens":2048},"output_tokens":2,"total_tokens":3002}}}"#,
            ],
        );
        assert_eq!(ev[0].response_id.as_deref(), Some("resp_1"));
        let outputs: Vec<bool> = ev.iter().map(|e| e.has_output).collect();
        assert_eq!(outputs, [false, true, false, true, false]);
        assert!(ev[4].terminal);
        assert_eq!(ev[4].finish_reason, Some(FinishReason::Stop));
        assert_eq!(r.next_sequence(), 10);
        assert_eq!(
            r.usage(),
            Some(Usage {
                prompt_tokens: 3000,
                completion_tokens: 2,
                cached_tokens: Some(2048)
            })
        );
        let (_, ev) = read_all(
            Wire::Responses,
            &[
                r#"{"type":"response.function_call_arguments.delta","delta":"{}"}"#,
                r#"{"type":"response.completed","response":{"status":"completed","usage":null}}"#,
            ],
        );
        assert_eq!(ev[1].finish_reason, Some(FinishReason::ToolCalls));
        let (_, ev) = read_all(
            Wire::Responses,
            &[
                r#"{"type":"response.incomplete","response":{"status":"incomplete","incomplete_details":{"reason":"max_output_tokens"}}}"#,
                r#"{"type":"response.failed","response":{"status":"failed","error":{"code":"server_error","message":"x"}}}"#,
                r#"{"type":"error","code":"server_error","message":"x","param":null,"sequence_number":3}"#,
            ],
        );
        assert_eq!(ev[0].finish_reason, Some(FinishReason::Length));
        assert!(ev[1].is_error && ev[1].terminal);
        assert!(ev[2].is_error && !ev[2].terminal);
    }

    #[test]
    fn whole_answers() {
        let w = whole(
            Wire::Anthropic,
            br#"{"id":"msg_1","type":"message","content":[{"type":"text","text":"x"}],"stop_reason":"max_tokens","usage":{"input_tokens":7,"output_tokens":3}}"#,
        )
        .unwrap();
        assert_eq!(w.finish_reason, Some(FinishReason::Length));
        assert_eq!(
            w.usage,
            Some(Usage {
                prompt_tokens: 7,
                completion_tokens: 3,
                cached_tokens: None
            })
        );
        let w = whole(
            Wire::Responses,
            br#"{"id":"resp_9","object":"response","status":"completed","output":[{"type":"function_call","name":"f","arguments":"{}"}],"usage":{"input_tokens":5,"output_tokens":2,"input_tokens_details":{"cached_tokens":0}}}"#,
        )
        .unwrap();
        assert_eq!(w.response_id.as_deref(), Some("resp_9"));
        assert_eq!(w.finish_reason, Some(FinishReason::ToolCalls));
        assert_eq!(w.usage.map(|u| u.prompt_tokens), Some(5));
    }
}
