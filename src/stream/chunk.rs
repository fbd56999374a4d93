//! What the gateway reads from one OpenAI-style chunk: the answer both chunk
//! readers give (the fast scanner, `scan.rs`, and the serde reference,
//! `event.rs`), in a file of its own so that neither imports the other's.

use crate::vocab::{FinishReason, Usage};

/// The gateway's view of one `data:` JSON payload.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ChunkInfo {
    /// Some choice carries generated text, reasoning or a tool call.
    pub has_output: bool,
    pub n_choices: u32,
    pub finish_reason: Option<FinishReason>,
    pub usage: Option<Usage>,
    /// The payload is an error object (the engine failed mid-stream).
    pub is_error: bool,
    /// Some choice's delta carries a tool call (`tool_calls`,
    /// `function_call`): the quality inspector reads its arguments.
    pub tool_call: bool,
}

impl ChunkInfo {
    /// The trailing chunk of `stream_options.include_usage`: usage, no choices.
    pub(crate) fn is_usage_only(&self) -> bool {
        self.n_choices == 0 && self.usage.is_some() && !self.is_error
    }
}
