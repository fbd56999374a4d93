//! Reading what a client sent: the body (size-limited), the few fields the
//! gateway needs, and the one change it makes before forwarding (asking for
//! usage on streams). Everything else in the body is forwarded byte for byte.

use std::borrow::Cow;

use bytes::Bytes;
use http_body_util::BodyExt;
use serde::Deserialize;

use crate::error::GatewayError;
use crate::vocab::Endpoint;

mod fast;

/// The parts of a request body the gateway acts on.
#[derive(Debug, Clone)]
pub struct Inbound {
    pub model: String,
    pub stream: bool,
    /// The client asked for the usage chunk itself (`stream_options.include_usage`).
    pub client_wants_usage: bool,
    /// `max_tokens` or `max_completion_tokens`, if set.
    pub max_tokens: Option<u32>,
    /// What goes upstream: the client's bytes, or a copy asking for usage.
    pub body: Bytes,
    /// Prefix block hashes of the prompt (not yet bound to the served model),
    /// when the routing policy asked for them.
    pub prefix: Vec<u64>,
    /// Prompt tokens by the approximate tokenizer, when rate limits need it.
    pub prompt_estimate: u32,
    /// The prompt's text, when the access log includes prompts.
    pub prompt_text: Option<String>,
    /// What the body says about its session (conversation).
    pub session: SessionFields,
    /// Responses: the response this one continues.
    pub previous_response_id: Option<String>,
}

/// The body's session ids (hashed) and what identifies the conversation in
/// the prompt, for `api::session` to pick from by the configured sources.
#[derive(Debug, Clone, Copy, Default)]
pub struct SessionFields {
    pub prompt_cache_key: Option<u64>,
    pub metadata_user_id: Option<u64>,
    pub previous_response_id: Option<u64>,
    pub user: Option<u64>,
    /// The system prompt and the first user message, hashed: what tells
    /// this conversation from another one sharing the system prompt.
    pub derived: Option<u64>,
    /// Earlier turns are in the request (an assistant message).
    pub continuing: bool,
    /// Characters of the prompt's text, and of its tail: the last assistant
    /// message and what follows it (what the previous turn's replica has
    /// not seen yet).
    pub prompt_chars: u32,
    pub tail_chars: u32,
}

/// What else to extract besides the fields every request needs.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Needs {
    pub prefix: Option<PrefixParams>,
    pub estimate: bool,
    pub text: bool,
}

/// How to cut a prompt into prefix blocks (from `routing.prefix_kv`).
#[derive(Debug, Clone, Copy)]
pub struct PrefixParams {
    pub block_chars: usize,
    pub max_blocks: usize,
}

#[derive(Deserialize, Default)]
#[cfg_attr(test, derive(Debug, PartialEq))]
struct Lite<'a> {
    #[serde(default, borrow)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default, borrow)]
    messages: Option<Vec<MessageLite<'a>>>,
    #[serde(default, borrow)]
    prompt: Option<PromptLite<'a>>,
    #[serde(default, borrow)]
    cache_salt: Option<Cow<'a, str>>,
    /// Embeddings input: a string or a list of strings.
    #[serde(default, borrow)]
    input: Option<PromptLite<'a>>,
    #[serde(default, borrow)]
    prompt_cache_key: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    user: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    metadata: Option<MetadataLite<'a>>,
    #[serde(default, borrow)]
    previous_response_id: Option<Cow<'a, str>>,
    /// Anthropic Messages: the system prompt (a string or text blocks).
    #[serde(default, borrow)]
    system: Option<ContentLite<'a>>,
    /// Responses: the system prompt.
    #[serde(default, borrow)]
    instructions: Option<Cow<'a, str>>,
    /// Responses: the output limit.
    #[serde(default)]
    max_output_tokens: Option<u32>,
}

/// Anthropic's `metadata` (only `user_id` is read; anything else is skipped).
#[derive(Deserialize)]
#[cfg_attr(test, derive(Debug, PartialEq))]
struct MetadataLite<'a> {
    #[serde(default, borrow)]
    user_id: Option<Cow<'a, str>>,
}

/// A session id as a key: its source and its value, hashed.
fn id_hash(source: &str, v: &Option<Cow<'_, str>>) -> Option<u64> {
    let v = v.as_deref().filter(|v| !v.is_empty())?;
    Some(crate::routing::sessions::id_key(source, v))
}

/// A prompt as ordered turns (role and texts), whatever the protocol wrote
/// it as: chat `messages`; Anthropic `system` and `messages` (text blocks,
/// tool results); Responses `instructions` and `input` (a string, or items:
/// messages, function calls and their outputs). The same conversation gives
/// the same turns in every protocol, so its prefix blocks, session and
/// estimate agree.
/// Both lists are inline up to a few turns (most prompts): no allocation.
#[derive(Default)]
struct Turns<'a> {
    texts: Texts<'a>,
    /// Role, and the range of `texts` that is its content.
    turns: smallvec::SmallVec<[(&'a str, std::ops::Range<usize>); 4]>,
}

/// The texts of a prompt's turns, in order.
type Texts<'a> = smallvec::SmallVec<[&'a str; 8]>;

impl<'a> Turns<'a> {
    /// `None` for a prompt that is not a conversation (completions, embeddings).
    fn of(endpoint: Endpoint, lite: &'a Lite<'a>) -> Option<Self> {
        let mut t = Turns::default();
        if let Some(system) = &lite.system {
            t.push("system", |texts| system.texts(texts));
        }
        if let Some(i) = lite.instructions.as_deref() {
            t.push("system", |texts| texts.push(i));
        }
        if let Some(msgs) = &lite.messages {
            for m in msgs {
                let role = m.role.as_deref().unwrap_or("user");
                t.push(role, |texts| {
                    if let Some(c) = &m.content {
                        c.texts(texts);
                    }
                });
            }
        } else if endpoint == Endpoint::Responses {
            match &lite.input {
                Some(PromptLite::Text(text)) => t.push("user", |texts| texts.push(text)),
                Some(PromptLite::Items(items)) => {
                    for item in items {
                        t.push(item.role(), |texts| item.texts(texts));
                    }
                }
                _ => {}
            }
        }
        (!t.turns.is_empty()).then_some(t)
    }

    fn push(&mut self, role: &'a str, fill: impl FnOnce(&mut Texts<'a>)) {
        let start = self.texts.len();
        fill(&mut self.texts);
        self.turns.push((role, start..self.texts.len()));
    }

    fn iter(&self) -> impl Iterator<Item = (&'a str, &[&'a str])> {
        self.turns
            .iter()
            .map(|(role, r)| (*role, &self.texts[r.clone()]))
    }
}

/// The conversation's identity: its system turns and its first user turn,
/// hashed; whether earlier turns are present; the prompt's length and its
/// tail's (from the last assistant turn on).
fn derived_session(turns: Option<&Turns<'_>>, lite: &Lite<'_>) -> (Option<u64>, bool, u32, u32) {
    let Some(turns) = turns else {
        let chars = match &lite.prompt {
            Some(PromptLite::Text(t)) => t.len(),
            Some(PromptLite::Many(v)) => v.iter().map(|t| t.len()).sum(),
            _ => 0,
        };
        let chars = u32::try_from(chars).unwrap_or(u32::MAX);
        return (None, false, chars, chars);
    };
    let mut h = xxhash_rust::xxh3::Xxh3::with_seed(0x5e55);
    let mut first_user = false;
    let mut continuing = false;
    let (mut chars, mut tail) = (0usize, 0usize);
    for (role, texts) in turns.iter() {
        let len = texts.iter().map(|t| t.len()).sum::<usize>() + role.len() + 2;
        chars += len;
        if role == "assistant" {
            tail = 0;
        }
        tail += len;
        match role {
            "system" | "developer" => {}
            "user" if !first_user => first_user = true,
            "assistant" | "tool" => {
                continuing = true;
                continue;
            }
            _ => continue,
        }
        h.update(role.as_bytes());
        h.update(b"\n");
        for t in texts {
            h.update(t.as_bytes());
        }
        h.update(b"\n");
    }
    let c = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    (
        first_user.then(|| h.digest()),
        continuing,
        c(chars),
        c(tail),
    )
}

impl PromptLite<'_> {
    fn estimate(&self) -> u32 {
        match self {
            PromptLite::Text(t) => crate::tokens::estimate(t),
            PromptLite::Many(v) => v.iter().map(|t| crate::tokens::estimate(t)).sum(),
            PromptLite::Items(_) | PromptLite::Other(_) => 0,
        }
    }
}

#[derive(Deserialize)]
#[cfg_attr(test, derive(Debug, PartialEq))]
struct MessageLite<'a> {
    #[serde(default, borrow)]
    role: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    content: Option<ContentLite<'a>>,
}

/// Message content: a string, or parts of which the text ones count.
#[derive(Deserialize)]
#[cfg_attr(test, derive(Debug, PartialEq))]
#[serde(untagged)]
enum ContentLite<'a> {
    #[serde(borrow)]
    Text(Cow<'a, str>),
    #[serde(borrow)]
    Parts(Vec<PartLite<'a>>),
    Other(serde::de::IgnoredAny),
}

impl<'a> ContentLite<'a> {
    /// The texts of a content: the string, or its text parts and the
    /// content of tool results (Anthropic `tool_result`), in order.
    fn texts(&'a self, out: &mut Texts<'a>) {
        match self {
            ContentLite::Text(t) => out.push(t),
            ContentLite::Parts(parts) => {
                for p in parts {
                    if let Some(t) = p.text.as_deref() {
                        out.push(t);
                    }
                    if let Some(c) = &p.content {
                        c.texts(out);
                    }
                }
            }
            ContentLite::Other(_) => {}
        }
    }
}

#[derive(Deserialize)]
#[cfg_attr(test, derive(Debug, PartialEq))]
struct PartLite<'a> {
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    /// A tool result's content (Anthropic): a string or blocks.
    #[serde(default, borrow)]
    content: Option<Box<ContentLite<'a>>>,
}

/// A Responses `input` item: a message, a function call or its output.
#[derive(Deserialize)]
#[cfg_attr(test, derive(Debug, PartialEq))]
struct ItemLite<'a> {
    #[serde(rename = "type", default, borrow)]
    kind: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    role: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    content: Option<ContentLite<'a>>,
    /// `function_call_output`: what the tool returned.
    #[serde(default, borrow)]
    output: Option<ContentLite<'a>>,
    /// `function_call`: the call's arguments.
    #[serde(default, borrow)]
    arguments: Option<Cow<'a, str>>,
}

impl<'a> ItemLite<'a> {
    fn role(&'a self) -> &'a str {
        match (self.role.as_deref(), self.kind.as_deref()) {
            (Some(r), _) => r,
            (None, Some("function_call_output" | "custom_tool_call_output")) => "tool",
            (None, Some("message") | None) => "user",
            (None, Some(_)) => "assistant",
        }
    }

    fn texts(&'a self, out: &mut Texts<'a>) {
        if let Some(c) = &self.content {
            c.texts(out);
        }
        if let Some(o) = &self.output {
            o.texts(out);
        }
        if let Some(a) = self.arguments.as_deref() {
            out.push(a);
        }
    }
}

/// A completion prompt: a string or a list of strings (token-id prompts do not
/// hash: they route by model only).
#[derive(Deserialize)]
#[cfg_attr(test, derive(Debug, PartialEq))]
#[serde(untagged)]
enum PromptLite<'a> {
    #[serde(borrow)]
    Text(Cow<'a, str>),
    #[serde(borrow)]
    Many(Vec<Cow<'a, str>>),
    /// Responses `input` items.
    #[serde(borrow)]
    Items(Vec<ItemLite<'a>>),
    Other(serde::de::IgnoredAny),
}

/// The prompt as the ordered pieces `routing::prefix` hashes: `role\ncontent\n`
/// per turn, or the completion prompt(s).
fn prompt_pieces<'a>(
    turns: Option<&Turns<'a>>,
    lite: &'a Lite<'a>,
) -> crate::routing::prefix::PromptText<'a> {
    let mut pieces = crate::routing::prefix::Pieces::new();
    if let Some(turns) = turns {
        // Role, newline, texts, newline per turn: sized once, not regrown.
        pieces.reserve(3 * turns.turns.len() + turns.texts.len());
        for (role, texts) in turns.iter() {
            pieces.push(role);
            pieces.push("\n");
            pieces.extend_from_slice(texts);
            pieces.push("\n");
        }
    } else {
        match &lite.prompt {
            Some(PromptLite::Text(t)) => pieces.push(t.as_ref()),
            Some(PromptLite::Many(v)) => pieces.extend(v.iter().map(|t| t.as_ref())),
            _ => {}
        }
    }
    crate::routing::prefix::PromptText { pieces }
}

#[derive(Deserialize)]
#[cfg_attr(test, derive(Debug, PartialEq))]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// Read the whole body, refusing more than `limit` bytes (413) early when the
/// client declares its length.
pub(crate) async fn read_body(
    headers: &impl crate::headers::Lookup,
    body: axum::body::Body,
    limit: usize,
) -> Result<Bytes, GatewayError> {
    let declared = headers
        .first(&http::header::CONTENT_LENGTH)
        .and_then(crate::headers::text)
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(GatewayError::PayloadTooLarge { limit });
    }
    // What `Limited::new(body, limit).collect()` does, without its frame
    // queue (`Whole`: a body whole in the server's buffer comes as one
    // piece and is handed on as it is).
    let mut body = body;
    let mut whole = crate::upstream::conn::Whole::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            GatewayError::InvalidRequest(format!("could not read the request body: {e}"))
        })?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers: not part of the body
        };
        if !whole.push(data, limit) {
            return Err(GatewayError::PayloadTooLarge { limit });
        }
    }
    Ok(whole.finish())
}

/// Check the body and extract what routing, limits and timing need.
pub fn inspect(
    endpoint: Endpoint,
    body: Bytes,
    prefix: Option<PrefixParams>,
) -> Result<Inbound, GatewayError> {
    inspect_with(
        endpoint,
        body,
        Needs {
            prefix,
            ..Needs::default()
        },
    )
}

/// [`inspect`], extracting what `needs` asks for.
pub(crate) fn inspect_with(
    endpoint: Endpoint,
    body: Bytes,
    needs: Needs,
) -> Result<Inbound, GatewayError> {
    let (prefix, estimate) = (needs.prefix, needs.estimate);
    // The fast reader takes the common shapes; serde reads the rest and
    // words every error.
    let read = fast::read(&body).map_or_else(|| serde_json::from_slice(&body), Ok);
    let lite: Lite<'_> = read.map_err(|e| {
        let msg = if e.is_data() && body.trim_ascii_start().first() != Some(&b'{') {
            "the request body must be a JSON object".to_string()
        } else if e.is_data() {
            format!("invalid request body: {e}")
        } else {
            format!("the request body is not valid JSON: {e}")
        };
        GatewayError::InvalidRequest(msg)
    })?;
    let model = match &lite.model {
        Some(m) if !m.trim().is_empty() => m.to_string(),
        _ => return Err(GatewayError::MissingModel),
    };
    let stream = lite.stream.unwrap_or(false) && endpoint != Endpoint::Embeddings;
    let client_wants_usage = lite
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let has_stream_options = lite.stream_options.is_some();
    let max_tokens = lite
        .max_completion_tokens
        .or(lite.max_tokens)
        .or(lite.max_output_tokens);
    let asks_usage = matches!(endpoint, Endpoint::Chat | Endpoint::Completions);
    let turns = Turns::of(endpoint, &lite);
    let prefix = match prefix {
        Some(p) if endpoint.generates() || endpoint == Endpoint::CountTokens => {
            crate::routing::prefix::block_hashes(
                lite.cache_salt.as_deref(),
                &prompt_pieces(turns.as_ref(), &lite),
                p.block_chars,
                p.max_blocks,
            )
        }
        _ => Vec::new(),
    };
    // The shared approximate tokenizer, counted as the simulator counts;
    // counting tokens generates nothing and is charged as a request only.
    let prompt_estimate = match (&turns, &lite.prompt, &lite.input) {
        _ if !estimate || endpoint == Endpoint::CountTokens => 0,
        (Some(turns), _, _) => crate::tokens::estimate_messages(
            turns
                .iter()
                .flat_map(|(_, texts)| if texts.is_empty() { &[""][..] } else { texts })
                .copied(),
        ),
        (None, Some(p), _) | (None, None, Some(p)) => p.estimate(),
        _ => 0,
    };
    let prompt_text = needs
        .text
        .then(|| prompt_pieces(turns.as_ref(), &lite).pieces.concat());
    let (derived, continuing, prompt_chars, tail_chars) = derived_session(turns.as_ref(), &lite);
    let session = SessionFields {
        prompt_cache_key: id_hash("prompt_cache_key", &lite.prompt_cache_key),
        metadata_user_id: id_hash(
            "metadata.user_id",
            &lite.metadata.as_ref().and_then(|m| m.user_id.clone()),
        ),
        previous_response_id: id_hash("previous_response_id", &lite.previous_response_id),
        user: id_hash("user", &lite.user),
        derived,
        continuing,
        prompt_chars,
        tail_chars,
    };
    let previous_response_id = lite
        .previous_response_id
        .as_deref()
        .filter(|id| endpoint == Endpoint::Responses && !id.is_empty())
        .map(str::to_string);
    // The turns borrow the body (their inline lists have drop glue).
    drop(turns);
    let body = if stream && asks_usage && !client_wants_usage {
        with_usage_requested(&body, has_stream_options)?
    } else {
        body
    };
    Ok(Inbound {
        model,
        stream,
        client_wants_usage,
        max_tokens,
        body,
        prefix,
        prompt_estimate,
        prompt_text,
        session,
        previous_response_id,
    })
}

/// The body with its `model` replaced (an alias resolved to the served name).
/// Re-serialised: aliases are a convenience, not the hot path.
pub(crate) fn with_model(body: &Bytes, model: &str) -> Result<Bytes, GatewayError> {
    let mut v: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body)
        .map_err(|e| GatewayError::InvalidRequest(format!("invalid request body: {e}")))?;
    v.insert("model".into(), serde_json::Value::String(model.to_string()));
    serde_json::to_vec(&v)
        .map(Bytes::from)
        .map_err(|e| GatewayError::Internal(e.to_string()))
}

/// `body` with `member` (`"key":value`) made the first member of its top-level
/// object; every other byte stays as the client sent it.
fn with_leading_member(body: &Bytes, member: &[u8]) -> Result<Bytes, GatewayError> {
    let open = body
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .filter(|&i| body[i] == b'{')
        .ok_or_else(|| {
            GatewayError::InvalidRequest("the request body must be a JSON object".into())
        })?;
    let empty = body[open + 1..].iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let mut out = Vec::with_capacity(body.len() + member.len() + 1);
    out.extend_from_slice(&body[..=open]);
    out.extend_from_slice(member);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(&body[open + 1..]);
    Ok(Bytes::from(out))
}

/// The body with `"field": n` added (the tier's cap applied to a request
/// that set no output limit; `field` is the protocol's name for it).
pub(crate) fn with_max_tokens(body: &Bytes, field: &str, n: u32) -> Result<Bytes, GatewayError> {
    with_leading_member(body, format!("\"{field}\":{n}").as_bytes())
}

/// The body with the top-level `"priority": n` an engine schedules by. A
/// client's own `priority` (rare: only then is the body re-serialised) is
/// replaced, so a request cannot jump the engine's queue past its band.
pub(crate) fn with_priority(body: &Bytes, n: i64) -> Result<Bytes, GatewayError> {
    if memchr::memmem::find(body, b"\"priority\"").is_none() {
        return with_leading_member(body, format!("\"priority\":{n}").as_bytes());
    }
    let mut v: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body)
        .map_err(|e| GatewayError::InvalidRequest(format!("invalid request body: {e}")))?;
    v.insert("priority".into(), serde_json::Value::from(n));
    serde_json::to_vec(&v)
        .map(Bytes::from)
        .map_err(|e| GatewayError::Internal(e.to_string()))
}

/// The body with `stream_options.include_usage = true`, so that token counts are
/// exact. When the client sent no `stream_options`, the field is spliced in
/// first (the rest stays byte-identical); otherwise the object is
/// re-serialised (rare: the client set `stream_options` without usage).
fn with_usage_requested(body: &Bytes, has_stream_options: bool) -> Result<Bytes, GatewayError> {
    if !has_stream_options {
        return with_leading_member(body, br#""stream_options":{"include_usage":true}"#);
    }
    let mut v: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body)
        .map_err(|e| GatewayError::InvalidRequest(format!("invalid request body: {e}")))?;
    let opts = v
        .entry("stream_options")
        .or_insert_with(|| serde_json::Value::Object(Default::default()));
    match opts {
        serde_json::Value::Object(o) => {
            o.insert("include_usage".into(), serde_json::Value::Bool(true));
        }
        _ => {
            return Err(GatewayError::InvalidRequest(
                "`stream_options` must be an object".into(),
            ));
        }
    }
    serde_json::to_vec(&v)
        .map(Bytes::from)
        .map_err(|e| GatewayError::Internal(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priority_is_spliced_in_or_replaces_the_clients() {
        let v = |b: Bytes| serde_json::from_slice::<serde_json::Value>(&b).unwrap();
        let plain = Bytes::from_static(br#"{"model":"m","messages":[]}"#);
        let out = with_priority(&plain, -10).unwrap();
        assert!(out.ends_with(br#""model":"m","messages":[]}"#));
        assert_eq!(v(out)["priority"], -10);
        let own = Bytes::from_static(br#"{"priority":-99,"model":"m"}"#);
        let out = v(with_priority(&own, 5).unwrap());
        assert_eq!(
            (out["priority"].as_i64(), out["model"].as_str()),
            (Some(5), Some("m"))
        );
    }

    fn ok(endpoint: Endpoint, s: &str) -> Inbound {
        match inspect(endpoint, Bytes::copy_from_slice(s.as_bytes()), None) {
            Ok(i) => i,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn usage_is_spliced_into_streams_without_stream_options() {
        let i = ok(
            Endpoint::Chat,
            r#" {"model":"m","stream":true,"messages":[]}"#,
        );
        assert!(!i.client_wants_usage);
        assert_eq!(
            &i.body[..],
            br#" {"stream_options":{"include_usage":true},"model":"m","stream":true,"messages":[]}"#
        );
    }

    #[test]
    fn existing_stream_options_are_extended() {
        let i = ok(
            Endpoint::Completions,
            r#"{"model":"m","stream":true,"stream_options":{"continuous_usage_stats":true}}"#,
        );
        let v: serde_json::Value = serde_json::from_slice(&i.body).unwrap_or_default();
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["stream_options"]["continuous_usage_stats"], true);
    }

    #[test]
    fn bodies_are_untouched_when_nothing_is_needed() {
        for s in [
            r#"{"model":"m","stream":true,"stream_options":{"include_usage":true}}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        ] {
            assert_eq!(&ok(Endpoint::Chat, s).body[..], s.as_bytes());
        }
    }

    #[test]
    fn prefixes_hash_messages_by_role_and_content() {
        let p = Some(PrefixParams {
            block_chars: 8,
            max_blocks: 100,
        });
        let a = r#"{"model":"m","messages":[{"role":"system","content":"shared system prompt"},{"role":"user","content":"q1"}]}"#;
        let b = r#"{"model":"m","messages":[{"role":"system","content":[{"type":"text","text":"shared system prompt"}]},{"role":"user","content":"another"}]}"#;
        let ha = inspect(Endpoint::Chat, Bytes::from(a), p)
            .map(|i| i.prefix)
            .unwrap_or_default();
        let hb = inspect(Endpoint::Chat, Bytes::from(b), p)
            .map(|i| i.prefix)
            .unwrap_or_default();
        assert!(ha.len() >= 3);
        assert_eq!(ha[..2], hb[..2], "same system prompt, same leading blocks");
        let c = r#"{"model":"m","prompt":"system\nshared system prompt\n"}"#;
        let hc = inspect(Endpoint::Completions, Bytes::from(c), p)
            .map(|i| i.prefix)
            .unwrap_or_default();
        assert_eq!(hc[..2], ha[..2], "the canonical text is what counts");
    }

    #[test]
    fn bad_bodies_are_400s() {
        for (s, want) in [
            ("{not json", "not valid JSON"),
            ("[1,2]", "JSON object"),
            (r#"{"model":7}"#, "invalid request body"),
        ] {
            match inspect(Endpoint::Chat, Bytes::copy_from_slice(s.as_bytes()), None) {
                Err(GatewayError::InvalidRequest(m)) => assert!(m.contains(want), "{m}"),
                other => panic!("{s}: {other:?}"),
            }
        }
        assert!(matches!(
            inspect(
                Endpoint::Chat,
                Bytes::from_static(b"{\"messages\":[]}"),
                None
            ),
            Err(GatewayError::MissingModel)
        ));
    }
}
