//! The boundary error: every failure a client can see, its status, its metric
//! label, and its body in the request's protocol (OpenAI's shape for chat,
//! completions, embeddings and Responses; Anthropic's for Messages), before
//! a stream starts and as a stream's last event, rendered in one place.

use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};
use serde::Serialize;

use crate::vocab::Wire;

/// Who caused a failure: decides the error `type` and whether a retry can help.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorSource {
    Client,
    Upstream,
    Internal,
}

/// What went wrong talking to a replica, and the I/O error behind it when
/// there was one (kept as the error's source, so a log of the failure says
/// why: "writing the request" caused by "Connection reset by peer").
#[derive(Debug, Clone, thiserror::Error)]
#[error("{context}")]
pub struct UpstreamFault {
    context: String,
    #[source]
    source: Option<std::sync::Arc<std::io::Error>>,
}

impl UpstreamFault {
    /// While doing `context`, `source` happened.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self {
            context: context.into(),
            source: Some(std::sync::Arc::new(source)),
        }
    }
}

impl UpstreamFault {
    /// The same fault, described as happening while doing `what`.
    pub fn during(mut self, what: &str) -> Self {
        self.context = format!("{what}: {}", self.context);
        self
    }
}

impl From<String> for UpstreamFault {
    fn from(context: String) -> Self {
        Self {
            context,
            source: None,
        }
    }
}

impl From<&str> for UpstreamFault {
    fn from(context: &str) -> Self {
        context.to_string().into()
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum GatewayError {
    #[error("{0}")]
    InvalidRequest(String),
    #[error("you must provide a model parameter")]
    MissingModel,
    #[error("The model `{0}` does not exist or is not served here.")]
    ModelNotFound(String),
    #[error("request body exceeds the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("the request body did not arrive within {0:?} (server.body_timeout)")]
    BodyTimeout(std::time::Duration),
    #[error("Invalid URL ({method} {path})")]
    UnknownRoute { method: String, path: String },
    #[error("no healthy replica serves model `{0}`")]
    NoHealthyBackend(String),
    #[error("could not connect to a replica: {0}")]
    UpstreamConnect(#[source] UpstreamFault),
    #[error("the replica did not answer within {phase} timeout")]
    UpstreamTimeout { phase: TimeoutPhase },
    #[error("the replica broke the response: {0}")]
    UpstreamProtocol(#[source] UpstreamFault),
    /// A non-2xx answer from a replica, passed through with its status; the body
    /// was normalised to the OpenAI shape by [`normalise_upstream_error`].
    #[error("replica answered {status}")]
    Upstream { status: StatusCode, body: Bytes },
    #[error("internal error: {0}")]
    Internal(String),
    #[error("{0}")]
    Unauthorized(String),
    #[error("max_tokens is {asked}, above the {cap} your tier allows")]
    MaxTokensOverCap { asked: u32, cap: u32 },
    #[error("{message}")]
    RateLimited {
        limit: crate::vocab::LimitKind,
        message: String,
        retry_after: std::time::Duration,
        /// The rate-limit headers of the refusal (rendered by `limits`).
        headers: Box<http::HeaderMap>,
    },
    #[error("the rate-limit store is unreachable and rate_limits.on_store_error is fail_closed")]
    RateLimitUnavailable,
    /// Flow control: every replica of the model stayed full for the whole
    /// wait (`timed_out`), or the waiting list was full.
    #[error("{}", overloaded_message(model, *waited, *retry_after, *timed_out))]
    Overloaded {
        model: String,
        waited: std::time::Duration,
        retry_after: std::time::Duration,
        timed_out: bool,
    },
    /// The gateway is shutting down and its drain deadline passed while the
    /// request was still running.
    #[error("the gateway is shutting down (its drain deadline passed); retry the request")]
    ShuttingDown,
}

fn overloaded_message(
    model: &str,
    waited: std::time::Duration,
    retry_after: std::time::Duration,
    timed_out: bool,
) -> String {
    let secs = retry_after.as_secs_f64().ceil().max(1.0);
    if timed_out {
        format!(
            "Every replica of `{model}` is at capacity: no room appeared within {:.1}s \
             (flow_control.max_wait). Retry after {secs}s.",
            waited.as_secs_f64()
        )
    } else {
        format!(
            "Every replica of `{model}` is at capacity and too many requests are waiting; \
             retry after {secs}s."
        )
    }
}

/// Which timeout fired; also the `kind` label of timeout errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeoutPhase {
    Connect,
    FirstToken,
    Idle,
    Total,
}

impl TimeoutPhase {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            TimeoutPhase::Connect => "connect",
            TimeoutPhase::FirstToken => "first_token",
            TimeoutPhase::Idle => "idle",
            TimeoutPhase::Total => "total",
        }
    }
}

impl std::fmt::Display for TimeoutPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `kind` of a stream that a replica broke after its first byte (an
/// in-band error event, a cut, an event that is not JSON).
pub(crate) const STREAM_ERROR: &str = "upstream_stream_error";

impl GatewayError {
    /// One failure of each kind an attempt on a replica can end in, so that
    /// their labels are known before any happens: the kinds of
    /// `sluice_upstream_errors_total` (with [`STREAM_ERROR`]) and, of the
    /// retryable ones, the reasons of `sluice_upstream_retries_total`.
    pub(crate) fn attempt_failures() -> Vec<GatewayError> {
        let fault = || UpstreamFault::from("");
        let mut all = vec![
            GatewayError::UpstreamConnect(fault()),
            GatewayError::UpstreamProtocol(fault()),
            GatewayError::Upstream {
                status: StatusCode::SERVICE_UNAVAILABLE,
                body: Bytes::new(),
            },
        ];
        for phase in [
            TimeoutPhase::Connect,
            TimeoutPhase::FirstToken,
            TimeoutPhase::Idle,
            TimeoutPhase::Total,
        ] {
            all.push(GatewayError::UpstreamTimeout { phase });
        }
        all
    }

    pub(crate) fn status(&self) -> StatusCode {
        match self {
            GatewayError::InvalidRequest(_) | GatewayError::MissingModel => StatusCode::BAD_REQUEST,
            GatewayError::ModelNotFound(_) | GatewayError::UnknownRoute { .. } => {
                StatusCode::NOT_FOUND
            }
            GatewayError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            GatewayError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            GatewayError::NoHealthyBackend(_) => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::UpstreamConnect(_) | GatewayError::UpstreamProtocol(_) => {
                StatusCode::BAD_GATEWAY
            }
            GatewayError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            GatewayError::Upstream { status, .. } => *status,
            GatewayError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            GatewayError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            GatewayError::MaxTokensOverCap { .. } => StatusCode::BAD_REQUEST,
            GatewayError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            GatewayError::RateLimitUnavailable
            | GatewayError::ShuttingDown
            | GatewayError::Overloaded { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// A closed-set label for metrics (`error_kind`) and logs.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            GatewayError::InvalidRequest(_) => "invalid_request",
            GatewayError::MissingModel => "missing_model",
            GatewayError::ModelNotFound(_) => "model_not_found",
            GatewayError::PayloadTooLarge { .. } => "payload_too_large",
            GatewayError::BodyTimeout(_) => "body_timeout",
            GatewayError::UnknownRoute { .. } => "unknown_route",
            GatewayError::NoHealthyBackend(_) => "no_healthy_backend",
            GatewayError::UpstreamConnect(_) => "upstream_connect",
            GatewayError::UpstreamTimeout { phase } => match phase {
                TimeoutPhase::Connect => "timeout_connect",
                TimeoutPhase::FirstToken => "timeout_first_token",
                TimeoutPhase::Idle => "timeout_idle",
                TimeoutPhase::Total => "timeout_total",
            },
            GatewayError::UpstreamProtocol(_) => "upstream_protocol",
            GatewayError::Upstream { .. } => "upstream_status",
            GatewayError::Internal(_) => "internal",
            GatewayError::Unauthorized(_) => "unauthorized",
            GatewayError::MaxTokensOverCap { .. } => "max_tokens_over_cap",
            GatewayError::RateLimited { limit, .. } => match limit {
                crate::vocab::LimitKind::Requests => "rate_limited_requests",
                crate::vocab::LimitKind::Tokens => "rate_limited_tokens",
                crate::vocab::LimitKind::Concurrency => "rate_limited_concurrency",
            },
            GatewayError::RateLimitUnavailable => "ratelimit_store_unavailable",
            GatewayError::ShuttingDown => "shutdown",
            GatewayError::Overloaded {
                timed_out: true, ..
            } => "flow_timeout",
            GatewayError::Overloaded { .. } => "flow_overflow",
        }
    }

    pub(crate) fn source(&self) -> ErrorSource {
        match self {
            GatewayError::InvalidRequest(_)
            | GatewayError::MissingModel
            | GatewayError::ModelNotFound(_)
            | GatewayError::PayloadTooLarge { .. }
            | GatewayError::BodyTimeout(_)
            | GatewayError::UnknownRoute { .. }
            | GatewayError::Unauthorized(_)
            | GatewayError::MaxTokensOverCap { .. }
            | GatewayError::RateLimited { .. } => ErrorSource::Client,
            GatewayError::NoHealthyBackend(_)
            | GatewayError::UpstreamConnect(_)
            | GatewayError::UpstreamTimeout { .. }
            | GatewayError::UpstreamProtocol(_)
            | GatewayError::Upstream { .. } => ErrorSource::Upstream,
            GatewayError::Internal(_)
            | GatewayError::RateLimitUnavailable
            | GatewayError::ShuttingDown
            | GatewayError::Overloaded { .. } => ErrorSource::Internal,
        }
    }

    /// Whether another replica may succeed where this attempt failed, with no
    /// risk of running the generation twice: the request never reached a
    /// replica's engine (connect failure, timeout before any answer) or the
    /// replica refused it outright (503 overloaded, 429 rate limited).
    pub(crate) fn retryable(&self) -> bool {
        match self {
            GatewayError::UpstreamConnect(_) => true,
            GatewayError::UpstreamTimeout { phase } => *phase == TimeoutPhase::Connect,
            GatewayError::Upstream { status, .. } => {
                *status == StatusCode::SERVICE_UNAVAILABLE
                    || *status == StatusCode::TOO_MANY_REQUESTS
            }
            _ => false,
        }
    }

    /// Whether the failure counts against the replica's health (outlier
    /// detection): it could not be reached, timed out, broke the response, or
    /// answered 5xx. Client errors and rate limiting (429) do not count.
    pub(crate) fn blames_replica(&self) -> bool {
        match self {
            GatewayError::UpstreamConnect(_)
            | GatewayError::UpstreamTimeout { .. }
            | GatewayError::UpstreamProtocol(_) => true,
            GatewayError::Upstream { status, .. } => status.is_server_error(),
            _ => false,
        }
    }

    fn param(&self) -> Option<&'static str> {
        match self {
            GatewayError::MissingModel | GatewayError::ModelNotFound(_) => Some("model"),
            GatewayError::MaxTokensOverCap { .. } => Some("max_tokens"),
            _ => None,
        }
    }

    fn code(&self) -> Option<&'static str> {
        match self {
            GatewayError::MissingModel => Some("missing_required_parameter"),
            GatewayError::ModelNotFound(_) => Some("model_not_found"),
            GatewayError::PayloadTooLarge { .. } => Some("request_too_large"),
            GatewayError::UnknownRoute { .. } => Some("unknown_url"),
            GatewayError::InvalidRequest(_) => Some("invalid_request"),
            GatewayError::Upstream { .. } => None,
            GatewayError::Unauthorized(_) => Some("invalid_api_key"),
            GatewayError::RateLimited { .. } => Some("rate_limit_exceeded"),
            GatewayError::MaxTokensOverCap { .. } => Some("max_tokens_over_cap"),
            _ => Some(self.kind()),
        }
    }

    fn error_type(&self) -> &'static str {
        // OpenAI types a 429 by the limit that was hit; the SDKs read it.
        if let GatewayError::RateLimited { limit, .. } = self {
            return match limit {
                crate::vocab::LimitKind::Tokens => "tokens",
                _ => "requests",
            };
        }
        match self.source() {
            ErrorSource::Client => "invalid_request_error",
            ErrorSource::Upstream | ErrorSource::Internal => "server_error",
        }
    }

    /// The OpenAI error body: `{"error":{"message","type","param","code"}}`.
    pub(crate) fn body(&self) -> Bytes {
        if let GatewayError::Upstream { body, .. } = self {
            return body.clone();
        }
        error_body(
            &self.to_string(),
            self.error_type(),
            self.param(),
            self.code(),
        )
    }

    /// The same error as one SSE event, for failures after a stream has started.
    pub(crate) fn sse_event(&self) -> Bytes {
        let body = self.body();
        let mut out = Vec::with_capacity(body.len() + 24);
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(&body);
        out.extend_from_slice(b"\n\ndata: [DONE]\n\n");
        Bytes::from(out)
    }
}

/// Anthropic's error types, by the status they come with.
const ANTHROPIC_TYPES: [&str; 10] = [
    "invalid_request_error",
    "authentication_error",
    "billing_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "timeout_error",
    "overloaded_error",
];

fn anthropic_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

impl GatewayError {
    /// The message and OpenAI-style fields, also of a replica's (normalised) body.
    fn parts(&self) -> (String, String, Option<String>, Option<String>) {
        if let GatewayError::Upstream { body, .. } = self {
            let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
            let e = &v["error"];
            let text = |k: &str| e[k].as_str().map(str::to_string);
            return (
                text("message").unwrap_or_default(),
                text("type").unwrap_or_default(),
                text("param"),
                text("code"),
            );
        }
        (
            self.to_string(),
            self.error_type().to_string(),
            self.param().map(str::to_string),
            self.code().map(str::to_string),
        )
    }

    /// The Anthropic error object: `{"type","message"}`, the type by status
    /// unless the replica already gave one of Anthropic's.
    fn anthropic_error(&self) -> serde_json::Value {
        let (message, given, _, _) = self.parts();
        let replica_said = matches!(self, GatewayError::Upstream { .. })
            && ANTHROPIC_TYPES.contains(&given.as_str());
        let kind = if replica_said {
            given
        } else {
            anthropic_type(self.status()).to_string()
        };
        serde_json::json!({"type": kind, "message": message})
    }

    /// The error body in `wire`'s shape: Anthropic's
    /// `{"type":"error","error":{"type","message"}}` for Messages, else OpenAI's.
    pub(crate) fn body_in(&self, wire: Wire) -> Bytes {
        match wire {
            Wire::Anthropic => {
                let v = serde_json::json!({"type": "error", "error": self.anthropic_error()});
                Bytes::from(serde_json::to_vec(&v).unwrap_or_default())
            }
            _ => self.body(),
        }
    }

    /// The error as the last event of a Messages or Responses stream (no
    /// `[DONE]`, which neither protocol has): Anthropic's `error` event, or
    /// Responses' `error` event numbered `sequence` (one past the last seen).
    pub(crate) fn named_sse_event(&self, wire: Wire, sequence: u64) -> Bytes {
        let data = match wire {
            Wire::Anthropic => {
                serde_json::json!({"type": "error", "error": self.anthropic_error()})
            }
            Wire::Responses => {
                let (message, kind, param, code) = self.parts();
                serde_json::json!({
                    "type": "error",
                    "code": code.unwrap_or(kind),
                    "message": message,
                    "param": param,
                    "sequence_number": sequence,
                })
            }
            Wire::OpenAi => return self.sse_event(),
        };
        let mut out = b"event: error\ndata: ".to_vec();
        out.extend_from_slice(&serde_json::to_vec(&data).unwrap_or_default());
        out.extend_from_slice(b"\n\n");
        Bytes::from(out)
    }

    /// The HTTP response in `wire`'s shape (see [`GatewayError::body_in`]).
    pub(crate) fn into_response_in(self, wire: Wire) -> Response {
        let body = self.body_in(wire);
        let mut resp = self.into_response();
        *resp.body_mut() = axum::body::Body::from(body);
        // A refusal carries the rate-limit headers in both protocols' names:
        // keep those of the request's.
        let foreign = match wire {
            Wire::Anthropic => "x-ratelimit-",
            _ => "anthropic-ratelimit-",
        };
        let h = resp.headers_mut();
        let drop: Vec<header::HeaderName> = h
            .keys()
            .filter(|k| k.as_str().starts_with(foreign))
            .cloned()
            .collect();
        for k in drop {
            h.remove(k);
        }
        resp
    }
}

#[derive(Serialize)]
struct ErrorEnvelope<'a> {
    error: ErrorObject<'a>,
}

#[derive(Serialize)]
struct ErrorObject<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

pub(crate) fn error_body(
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> Bytes {
    let env = ErrorEnvelope {
        error: ErrorObject {
            message,
            kind,
            param,
            code,
        },
    };
    Bytes::from(serde_json::to_vec(&env).unwrap_or_else(|_| b"{\"error\":{}}".to_vec()))
}

/// Turn a replica's error body into the OpenAI shape, keeping what it said.
///
/// Accepts `{"error":{...}}` (OpenAI, newer vLLM), `{"object":"error","message":..}`
/// (older vLLM), `{"error":"text"}` (TGI) and plain text.
pub(crate) fn normalise_upstream_error(status: StatusCode, body: &[u8]) -> Bytes {
    #[derive(serde::Deserialize)]
    struct Flat {
        message: Option<String>,
        #[serde(rename = "type")]
        kind: Option<String>,
        param: Option<String>,
        code: Option<serde_json::Value>,
    }
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum ErrField {
        Obj(Flat),
        Text(String),
    }
    #[derive(serde::Deserialize)]
    struct Wrapped {
        error: ErrField,
    }
    let default_type = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let code_str = |c: Option<serde_json::Value>| match c {
        Some(serde_json::Value::String(s)) => Some(s),
        Some(serde_json::Value::Number(n)) => Some(n.to_string()),
        _ => None,
    };
    if let Ok(w) = serde_json::from_slice::<Wrapped>(body) {
        match w.error {
            ErrField::Obj(f) if f.message.is_some() => {
                return error_body(
                    f.message.as_deref().unwrap_or_default(),
                    f.kind.as_deref().unwrap_or(default_type),
                    f.param.as_deref(),
                    code_str(f.code).as_deref(),
                );
            }
            ErrField::Text(t) => return error_body(&t, default_type, None, None),
            ErrField::Obj(_) => {}
        }
    }
    if let Ok(f) = serde_json::from_slice::<Flat>(body)
        && let Some(message) = f.message.as_deref()
    {
        return error_body(
            message,
            f.kind.as_deref().unwrap_or(default_type),
            f.param.as_deref(),
            code_str(f.code).as_deref(),
        );
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    let message = if text.is_empty() {
        format!(
            "replica answered {} {}",
            status.as_u16(),
            status.canonical_reason().unwrap_or("")
        )
    } else {
        text.chars().take(512).collect()
    };
    error_body(&message, default_type, None, None)
}

impl IntoResponse for GatewayError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), self.body()).into_response();
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let GatewayError::RateLimited {
            retry_after,
            headers,
            ..
        } = &self
        {
            // The real wait, in both forms the OpenAI SDKs honour.
            let secs = retry_after.as_secs_f64().ceil().max(1.0) as u64;
            h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
            h.insert(
                "retry-after-ms",
                HeaderValue::from(retry_after.as_millis() as u64),
            );
            for (name, value) in headers.iter() {
                h.insert(name, value.clone());
            }
        }
        if let GatewayError::Overloaded { retry_after, .. } = &self {
            let secs = retry_after.as_secs_f64().ceil().max(1.0) as u64;
            h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
            h.insert(
                "retry-after-ms",
                HeaderValue::from(retry_after.as_millis() as u64),
            );
        }
        if let GatewayError::Unauthorized(_) = &self {
            h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

/// A request refused before any handler (by the HTTP/1.1 parser, or by
/// RFC 9112 where hyper is lenient): its reason phrase, message and code.
pub(crate) fn refusal(code: u16) -> (&'static str, &'static str, &'static str) {
    match code {
        431 => (
            "Request Header Fields Too Large",
            "The request's headers are too large or too many.",
            "headers_too_large",
        ),
        414 => (
            "URI Too Long",
            "The request URI is too long.",
            "uri_too_long",
        ),
        501 => (
            "Not Implemented",
            "The request's Transfer-Encoding names a coding this server does not decode (only chunked).",
            "unsupported_transfer_coding",
        ),
        _ => (
            "Bad Request",
            "The request could not be parsed as HTTP/1.1.",
            "malformed_http",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(b: &Bytes) -> serde_json::Value {
        serde_json::from_slice(b).unwrap_or_default()
    }

    #[test]
    fn bodies_are_openai_shaped() {
        let e = GatewayError::ModelNotFound("gpt-9".into());
        assert_eq!(e.status(), StatusCode::NOT_FOUND);
        let v = json(&e.body());
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["param"], "model");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains("gpt-9")
        );
    }

    #[test]
    fn anthropic_and_responses_shapes() {
        let e = GatewayError::ModelNotFound("gpt-9".into());
        let v = json(&e.body_in(Wire::Anthropic));
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "not_found_error");
        assert!(v["error"]["message"].as_str().unwrap().contains("gpt-9"));
        // A replica's Anthropic type survives; an OpenAI one maps by status.
        let up = |status: StatusCode, body: &[u8]| GatewayError::Upstream {
            status,
            body: normalise_upstream_error(status, body),
        };
        let e = up(
            StatusCode::from_u16(529).unwrap(),
            br#"{"type":"error","error":{"type":"overloaded_error","message":"busy"}}"#,
        );
        let v = json(&e.body_in(Wire::Anthropic));
        assert_eq!(v["error"]["type"], "overloaded_error");
        assert_eq!(v["error"]["message"], "busy");
        let e = up(
            StatusCode::BAD_REQUEST,
            br#"{"object":"error","message":"too long","type":"BadRequestError"}"#,
        );
        assert_eq!(
            json(&e.body_in(Wire::Anthropic))["error"]["type"],
            "invalid_request_error"
        );
        // Stream events: named, no [DONE].
        let e = GatewayError::UpstreamTimeout {
            phase: TimeoutPhase::Idle,
        };
        let ev = e.named_sse_event(Wire::Anthropic, 0);
        let text = std::str::from_utf8(&ev).unwrap();
        assert!(
            text.starts_with("event: error\ndata: {") && text.ends_with("}\n\n"),
            "{text}"
        );
        assert!(text.contains("\"timeout_error\""), "{text}");
        let ev = e.named_sse_event(Wire::Responses, 42);
        let data: serde_json::Value =
            serde_json::from_slice(&ev["event: error\ndata: ".len()..]).unwrap();
        assert_eq!(data["type"], "error");
        assert_eq!(data["sequence_number"], 42);
        assert_eq!(data["code"], "timeout_idle");
        assert!(!text.contains("[DONE]"));
    }

    #[test]
    fn upstream_bodies_are_normalised() {
        let old_vllm = br#"{"object":"error","message":"too long","type":"BadRequestError","param":null,"code":400}"#;
        let v = json(&normalise_upstream_error(StatusCode::BAD_REQUEST, old_vllm));
        assert_eq!(v["error"]["message"], "too long");
        assert_eq!(v["error"]["type"], "BadRequestError");
        assert_eq!(v["error"]["code"], "400");

        let tgi = br#"{"error":"Input validation error","error_type":"validation"}"#;
        let v = json(&normalise_upstream_error(
            StatusCode::UNPROCESSABLE_ENTITY,
            tgi,
        ));
        assert_eq!(v["error"]["message"], "Input validation error");

        let v = json(&normalise_upstream_error(
            StatusCode::BAD_GATEWAY,
            b"<html>oops</html>",
        ));
        assert_eq!(v["error"]["message"], "<html>oops</html>");
        assert_eq!(v["error"]["type"], "server_error");
    }

    #[test]
    fn upstream_errors_keep_their_cause() {
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let e = GatewayError::UpstreamConnect(UpstreamFault::io("connecting to r:8000", io));
        assert_eq!(
            e.to_string(),
            "could not connect to a replica: connecting to r:8000"
        );
        // (`GatewayError::source` is who caused it: the trait's is the cause.)
        let fault = std::error::Error::source(&e).unwrap();
        let cause = fault.source().unwrap();
        let io = cause
            .downcast_ref::<std::sync::Arc<std::io::Error>>()
            .unwrap();
        assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);
        let e = GatewayError::UpstreamProtocol(
            UpstreamFault::io("reading", std::io::ErrorKind::ConnectionReset.into())
                .during("connection lost mid-stream"),
        );
        assert_eq!(
            e.to_string(),
            "the replica broke the response: connection lost mid-stream: reading"
        );
        assert!(
            std::error::Error::source(&e)
                .and_then(|f| f.source())
                .is_some()
        );
    }

    #[test]
    fn only_safe_failures_retry() {
        assert!(GatewayError::UpstreamConnect("refused".into()).retryable());
        let s503 = GatewayError::Upstream {
            status: StatusCode::SERVICE_UNAVAILABLE,
            body: Bytes::new(),
        };
        assert!(s503.retryable());
        let s500 = GatewayError::Upstream {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            body: Bytes::new(),
        };
        assert!(!s500.retryable());
        assert!(
            !GatewayError::UpstreamTimeout {
                phase: TimeoutPhase::FirstToken
            }
            .retryable()
        );
    }
}
