//! Reading what a client sent: the body (size-limited), the few fields the
//! gateway needs, and the one change it makes before forwarding (asking for
//! usage on streams). Everything else in the body is forwarded byte for byte.

use std::borrow::Cow;

use bytes::Bytes;
use http::HeaderMap;
use http_body_util::{BodyExt, Limited};
use serde::Deserialize;

use crate::error::GatewayError;
use crate::telemetry::record::Endpoint;

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
}

#[derive(Deserialize)]
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
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// Read the whole body, refusing more than `limit` bytes (413) early when the
/// client declares its length.
pub async fn read_body(
    headers: &HeaderMap,
    body: axum::body::Body,
    limit: usize,
) -> Result<Bytes, GatewayError> {
    let declared = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(GatewayError::PayloadTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(GatewayError::PayloadTooLarge { limit })
        }
        Err(e) => Err(GatewayError::InvalidRequest(format!(
            "could not read the request body: {e}"
        ))),
    }
}

/// Check the body and extract what routing and timing need.
pub fn inspect(endpoint: Endpoint, body: Bytes) -> Result<Inbound, GatewayError> {
    let lite: Lite<'_> = serde_json::from_slice(&body).map_err(|e| {
        let msg = if e.is_data() && body.trim_ascii_start().first() != Some(&b'{') {
            "the request body must be a JSON object".to_string()
        } else if e.is_data() {
            format!("invalid request body: {e}")
        } else {
            format!("the request body is not valid JSON: {e}")
        };
        GatewayError::InvalidRequest(msg)
    })?;
    let model = match lite.model {
        Some(m) if !m.trim().is_empty() => m.into_owned(),
        _ => return Err(GatewayError::MissingModel),
    };
    let stream = lite.stream.unwrap_or(false) && endpoint != Endpoint::Embeddings;
    let client_wants_usage = lite
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let has_stream_options = lite.stream_options.is_some();
    let max_tokens = lite.max_completion_tokens.or(lite.max_tokens);
    let asks_usage = matches!(endpoint, Endpoint::Chat | Endpoint::Completions);
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
    })
}

/// The body with its `model` replaced (an alias resolved to the served name).
/// Re-serialised: aliases are a convenience, not the hot path.
pub fn with_model(body: &Bytes, model: &str) -> Result<Bytes, GatewayError> {
    let mut v: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body)
        .map_err(|e| GatewayError::InvalidRequest(format!("invalid request body: {e}")))?;
    v.insert("model".into(), serde_json::Value::String(model.to_string()));
    serde_json::to_vec(&v)
        .map(Bytes::from)
        .map_err(|e| GatewayError::Internal(e.to_string()))
}

/// The body with `stream_options.include_usage = true`, so that token counts are
/// exact. When the client sent no `stream_options`, the field is spliced in after
/// the opening brace (the rest stays byte-identical); otherwise the object is
/// re-serialised (rare: the client set `stream_options` without usage).
fn with_usage_requested(body: &Bytes, has_stream_options: bool) -> Result<Bytes, GatewayError> {
    const FIELD: &[u8] = br#""stream_options":{"include_usage":true},"#;
    if !has_stream_options {
        let open = body
            .iter()
            .position(|b| !b.is_ascii_whitespace())
            .filter(|&i| body[i] == b'{')
            .ok_or_else(|| {
                GatewayError::InvalidRequest("the request body must be a JSON object".into())
            })?;
        let mut out = Vec::with_capacity(body.len() + FIELD.len());
        out.extend_from_slice(&body[..=open]);
        out.extend_from_slice(FIELD);
        out.extend_from_slice(&body[open + 1..]);
        return Ok(Bytes::from(out));
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

    fn ok(endpoint: Endpoint, s: &str) -> Inbound {
        match inspect(endpoint, Bytes::copy_from_slice(s.as_bytes())) {
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
    fn bad_bodies_are_400s() {
        for (s, want) in [
            ("{not json", "not valid JSON"),
            ("[1,2]", "JSON object"),
            (r#"{"model":7}"#, "invalid request body"),
        ] {
            match inspect(Endpoint::Chat, Bytes::copy_from_slice(s.as_bytes())) {
                Err(GatewayError::InvalidRequest(m)) => assert!(m.contains(want), "{m}"),
                other => panic!("{s}: {other:?}"),
            }
        }
        assert!(matches!(
            inspect(Endpoint::Chat, Bytes::from_static(b"{\"messages\":[]}")),
            Err(GatewayError::MissingModel)
        ));
    }
}
