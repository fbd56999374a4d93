//! The simulator's Anthropic Messages and OpenAI Responses: reading their
//! prompts, their error shapes, their events and whole answers, and the
//! Responses store (responses kept in this replica's memory, as vLLM keeps
//! them, so a `previous_response_id` works only where the response was made).
//!
//! Usage follows each protocol: Messages' `input_tokens` excludes the cache
//! (`cache_read_input_tokens` holds the cached part); Responses'
//! `input_tokens` is the whole prompt and `input_tokens_details.cached_tokens`
//! its cached part.

use std::collections::{HashMap, VecDeque};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use parking_lot::Mutex;
use serde_json::{Value, json};

use super::generation::Generation;

/// Responses kept (oldest forgotten first).
const STORED: usize = 10_000;

/// A prompt as (role, text) turns.
pub(super) type Turns = Vec<(String, String)>;

/// The text of a content: a string, or its text blocks and tool results.
fn content_text(c: &Value) -> String {
    match c {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .map(|p| {
                let mut t = p
                    .get("text")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                if let Some(inner) = p.get("content") {
                    t.push_str(&content_text(inner));
                }
                t
            })
            .collect(),
        _ => String::new(),
    }
}

/// A Messages request's turns: `system`, then each message.
pub(super) fn messages_turns(body: &Value) -> Turns {
    let mut turns = Vec::new();
    if let Some(system) = body.get("system") {
        turns.push(("system".to_string(), content_text(system)));
    }
    for m in body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        let text = m.get("content").map(content_text).unwrap_or_default();
        turns.push((role.to_string(), text));
    }
    turns
}

/// A Responses `input` as items (a string is one user message).
pub(super) fn input_items(body: &Value) -> Vec<Value> {
    match body.get("input") {
        Some(Value::String(s)) => vec![json!({
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": s}],
        })],
        Some(Value::Array(items)) => items.clone(),
        _ => Vec::new(),
    }
}

/// One input item as a turn.
fn item_turn(item: &Value) -> (String, String) {
    let kind = item.get("type").and_then(Value::as_str);
    let role = match (item.get("role").and_then(Value::as_str), kind) {
        (Some(r), _) => r,
        (None, Some("function_call_output")) => "tool",
        (None, Some("message") | None) => "user",
        (None, Some(_)) => "assistant",
    };
    let mut text = item.get("content").map(content_text).unwrap_or_default();
    if let Some(o) = item.get("output") {
        text.push_str(&content_text(o));
    }
    if let Some(a) = item.get("arguments").and_then(Value::as_str) {
        text.push_str(a);
    }
    (role.to_string(), text)
}

/// A Responses request's turns: `instructions`, the stored conversation of
/// `previous_response_id`, then `input`. `Err` names an unknown previous id.
pub(super) fn responses_turns(body: &Value, store: &ResponseStore) -> Result<Turns, String> {
    let mut turns = Vec::new();
    if let Some(i) = body.get("instructions").and_then(Value::as_str) {
        turns.push(("system".to_string(), i.to_string()));
    }
    if let Some(prev) = body.get("previous_response_id").and_then(Value::as_str) {
        match store.context(prev) {
            Some(ctx) => turns.extend(ctx),
            None => return Err(prev.to_string()),
        }
    }
    turns.extend(input_items(body).iter().map(item_turn));
    Ok(turns)
}

/// Anthropic's error body, its type by status.
pub(super) fn anthropic_error(status: StatusCode, message: &str) -> Response {
    let kind = match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    };
    let body = json!({"type": "error", "error": {"type": kind, "message": message}});
    (status, axum::Json(body)).into_response()
}

/// OpenAI's error body (what vLLM's Responses routes answer).
pub(super) fn openai_error(
    status: StatusCode,
    message: &str,
    param: Option<&str>,
    code: &str,
) -> Response {
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let body = json!({"error": {"message": message, "type": kind, "param": param, "code": code}});
    (status, axum::Json(body)).into_response()
}

/// A named SSE event.
pub(super) fn event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// Messages usage: the cached part apart.
fn messages_usage(g: &Generation, cached: u32, output: u32) -> Value {
    json!({
        "input_tokens": g.prompt_tokens.saturating_sub(cached),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": output,
    })
}

fn stop_reason(g: &Generation) -> &'static str {
    if g.finish_reason == "length" {
        "max_tokens"
    } else {
        "end_turn"
    }
}

/// The events before a Messages stream's first token.
pub(super) fn messages_head(g: &Generation, cached: u32) -> Vec<Bytes> {
    let message = json!({
        "id": g.id, "type": "message", "role": "assistant", "model": &*g.model,
        "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": messages_usage(g, cached, 0),
    });
    vec![
        event(
            "message_start",
            &json!({"type": "message_start", "message": message}),
        ),
        event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        event("ping", &json!({"type": "ping"})),
    ]
}

pub(super) fn messages_token(word: &str) -> Bytes {
    event(
        "content_block_delta",
        &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": word}}),
    )
}

/// The events after a Messages stream's last token.
pub(super) fn messages_tail(g: &Generation) -> Vec<Bytes> {
    vec![
        event(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": 0}),
        ),
        event(
            "message_delta",
            &json!({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason(g), "stop_sequence": null},
                    "usage": {"output_tokens": g.output_tokens}}),
        ),
        event("message_stop", &json!({"type": "message_stop"})),
    ]
}

/// A whole Messages answer.
pub(super) fn messages_whole(g: &Generation, text: &str, cached: u32) -> Value {
    json!({
        "id": g.id, "type": "message", "role": "assistant", "model": &*g.model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_reason(g), "stop_sequence": null,
        "usage": messages_usage(g, cached, g.output_tokens),
    })
}

/// The message item id of a response's output.
fn item_id(g: &Generation) -> String {
    format!("msg_{}", g.id.trim_start_matches("resp_"))
}

/// A response object: in progress (no text), or finished with `text`.
pub(super) fn response_object(g: &Generation, text: Option<&str>, cached: u32) -> Value {
    let (status, output, usage, incomplete) = match text {
        None => ("in_progress", json!([]), Value::Null, Value::Null),
        Some(t) => {
            let cut = g.finish_reason == "length";
            (
                if cut { "incomplete" } else { "completed" },
                json!([{
                    "type": "message", "id": item_id(g), "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": t, "annotations": [], "logprobs": []}],
                }]),
                json!({
                    "input_tokens": g.prompt_tokens,
                    "input_tokens_details": {"cached_tokens": cached},
                    "output_tokens": g.output_tokens,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": g.prompt_tokens + g.output_tokens,
                }),
                if cut {
                    json!({"reason": "max_output_tokens"})
                } else {
                    Value::Null
                },
            )
        }
    };
    json!({
        "id": g.id, "object": "response", "created_at": g.created, "status": status,
        "model": &*g.model, "output": output, "usage": usage,
        "incomplete_details": incomplete, "error": null,
        "instructions": g.instructions, "previous_response_id": g.previous_response_id,
        "max_output_tokens": g.max_output_tokens,
        "parallel_tool_calls": true, "tool_choice": "auto", "tools": [],
        "temperature": 1.0, "top_p": 1.0, "store": true, "text": {"format": {"type": "text"}},
        "metadata": {},
    })
}

/// A Responses event with its sequence number (taken from `seq`, then advanced).
fn numbered(seq: &mut u64, name: &str, mut data: Value) -> Bytes {
    data["type"] = Value::String(name.to_string());
    data["sequence_number"] = json!(*seq);
    *seq += 1;
    event(name, &data)
}

/// The events before a Responses stream's first token.
pub(super) fn responses_head(g: &Generation, seq: &mut u64) -> Vec<Bytes> {
    let obj = response_object(g, None, 0);
    let item = json!({"type": "message", "id": item_id(g), "status": "in_progress", "role": "assistant", "content": []});
    vec![
        numbered(seq, "response.created", json!({"response": obj})),
        numbered(seq, "response.in_progress", json!({"response": obj})),
        numbered(
            seq,
            "response.output_item.added",
            json!({"output_index": 0, "item": item}),
        ),
        numbered(
            seq,
            "response.content_part.added",
            json!({"item_id": item_id(g), "output_index": 0, "content_index": 0,
                   "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
        ),
    ]
}

pub(super) fn responses_token(g: &Generation, seq: &mut u64, word: &str) -> Bytes {
    numbered(
        seq,
        "response.output_text.delta",
        json!({"item_id": item_id(g), "output_index": 0, "content_index": 0, "delta": word, "logprobs": []}),
    )
}

/// The events after a Responses stream's last token; the finished object.
pub(super) fn responses_tail(
    g: &Generation,
    seq: &mut u64,
    text: &str,
    cached: u32,
) -> (Vec<Bytes>, Value) {
    let obj = response_object(g, Some(text), cached);
    let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
    let terminal = if obj["status"] == "incomplete" {
        "response.incomplete"
    } else {
        "response.completed"
    };
    let events = vec![
        numbered(
            seq,
            "response.output_text.done",
            json!({"item_id": item_id(g), "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
        ),
        numbered(
            seq,
            "response.content_part.done",
            json!({"item_id": item_id(g), "output_index": 0, "content_index": 0, "part": part}),
        ),
        numbered(
            seq,
            "response.output_item.done",
            json!({"output_index": 0, "item": obj["output"][0]}),
        ),
        numbered(seq, terminal, json!({"response": obj})),
    ];
    (events, obj)
}

/// The in-band error event of each protocol.
pub(super) fn error_event(responses: bool, seq: u64) -> Bytes {
    if responses {
        event(
            "error",
            &json!({"type": "error", "code": "server_error", "message": "simulated engine failure",
                    "param": null, "sequence_number": seq}),
        )
    } else {
        event(
            "error",
            &json!({"type": "error", "error": {"type": "api_error", "message": "simulated engine failure"}}),
        )
    }
}

struct Stored {
    object: Value,
    /// The conversation so far (its turns and this response's answer).
    context: Turns,
    input_items: Vec<Value>,
}

/// The responses this replica keeps.
#[derive(Default)]
pub(crate) struct ResponseStore {
    inner: Mutex<(HashMap<String, Stored>, VecDeque<String>)>,
}

impl ResponseStore {
    /// Keep a finished response: its object, what it was asked (`turns`
    /// without the instructions) and its answer.
    pub(super) fn put(&self, object: Value, turns: Turns, input_items: Vec<Value>) {
        let Some(id) = object["id"].as_str().map(str::to_string) else {
            return;
        };
        let mut context = turns;
        if let Some(text) = object
            .pointer("/output/0/content/0/text")
            .and_then(Value::as_str)
        {
            context.push(("assistant".to_string(), text.to_string()));
        }
        let mut g = self.inner.lock();
        let (map, order) = &mut *g;
        if map.len() >= STORED
            && let Some(old) = order.pop_front()
        {
            map.remove(&old);
        }
        order.push_back(id.clone());
        map.insert(
            id,
            Stored {
                object,
                context,
                input_items,
            },
        );
    }

    fn context(&self, id: &str) -> Option<Turns> {
        self.inner.lock().0.get(id).map(|s| s.context.clone())
    }

    pub(super) fn object(&self, id: &str) -> Option<Value> {
        self.inner.lock().0.get(id).map(|s| s.object.clone())
    }

    pub(super) fn input_items(&self, id: &str) -> Option<Vec<Value>> {
        self.inner.lock().0.get(id).map(|s| s.input_items.clone())
    }

    pub(super) fn delete(&self, id: &str) -> bool {
        self.inner.lock().0.remove(id).is_some()
    }
}

/// The turns a stored response is asked with later: all but the
/// instructions (which do not carry over to a follow-up).
pub(super) fn carried(turns: &Turns, body: &Value) -> Turns {
    let skip = usize::from(body.get("instructions").and_then(Value::as_str).is_some());
    turns[skip..].to_vec()
}
