//! One simulated generation: what is fixed about it (its API, ids, prompt
//! and output lengths, finish reason), and its OpenAI chunks.

use std::sync::Arc;

use bytes::Bytes;

use super::text::word;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Api {
    Chat,
    Completions,
    /// Anthropic Messages.
    Messages,
    /// OpenAI Responses.
    Responses,
}

/// Everything fixed about one simulated generation.
#[derive(Debug, Clone)]
pub(super) struct Generation {
    pub api: Api,
    pub id: String,
    pub created: u64,
    pub model: Arc<str>,
    pub seed: u64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// `length` if the output was cut by `max_tokens`, else `stop`.
    pub finish_reason: &'static str,
    pub include_usage: bool,
    /// The replica's name, in every chunk's `system_fingerprint`.
    pub fingerprint: Arc<str>,
    /// Responses: echoed in the response object.
    pub instructions: Option<String>,
    pub previous_response_id: Option<String>,
    pub max_output_tokens: Option<u32>,
}

impl Generation {
    pub(super) fn chunk(&self, delta: &str, finish: Option<&str>) -> String {
        let finish = finish.map_or("null".to_string(), |f| format!("\"{f}\""));
        match self.api {
            Api::Chat => format!(
                r#"{{"id":"{}","object":"chat.completion.chunk","created":{},"model":"{}","system_fingerprint":"{}","choices":[{{"index":0,"delta":{},"logprobs":null,"finish_reason":{}}}]}}"#,
                self.id, self.created, self.model, self.fingerprint, delta, finish
            ),
            _ => format!(
                r#"{{"id":"{}","object":"text_completion","created":{},"model":"{}","system_fingerprint":"{}","choices":[{{"index":0,"text":{},"logprobs":null,"finish_reason":{}}}]}}"#,
                self.id, self.created, self.model, self.fingerprint, delta, finish
            ),
        }
    }

    pub(super) fn token_event(&self, i: u32) -> Bytes {
        let text = serde_json::to_string(word(self.seed, i)).unwrap_or_default();
        let last = i + 1 == self.output_tokens;
        let delta = match self.api {
            Api::Chat => format!(r#"{{"content":{text}}}"#),
            _ => text,
        };
        let finish = last.then_some(self.finish_reason);
        sse(&self.chunk(&delta, finish))
    }

    pub(super) fn usage_event(&self, cached: u32) -> Bytes {
        let object = match self.api {
            Api::Chat => "chat.completion.chunk",
            _ => "text_completion",
        };
        sse(&format!(
            r#"{{"id":"{}","object":"{}","created":{},"model":"{}","system_fingerprint":"{}","choices":[],"usage":{{"prompt_tokens":{},"total_tokens":{},"completion_tokens":{},"prompt_tokens_details":{{"cached_tokens":{cached}}}}}}}"#,
            self.id,
            object,
            self.created,
            self.model,
            self.fingerprint,
            self.prompt_tokens,
            self.prompt_tokens + self.output_tokens,
            self.output_tokens
        ))
    }
}

/// One `data:` event.
pub(super) fn sse(payload: &str) -> Bytes {
    Bytes::from(format!("data: {payload}\n\n"))
}
