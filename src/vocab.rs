//! The small shared vocabulary every layer speaks: which API a request used,
//! why a generation stopped and what it used, which engine a replica runs, why
//! a replica was chosen, which limit was hit. Closed sets with `as_str()` for
//! metric labels; no behaviour beyond naming. The bottom of the module graph:
//! it imports nothing from the crate.

use serde::{Deserialize, Serialize};

/// Which API a request used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    Embeddings,
    /// Anthropic Messages (`/v1/messages`).
    Messages,
    /// Anthropic `/v1/messages/count_tokens`: routed like a generation, no output.
    CountTokens,
    /// OpenAI Responses (`/v1/responses`).
    Responses,
    /// Any other `POST /v1/*` naming a model, forwarded untouched.
    Passthrough,
}

impl Endpoint {
    /// The generation API served at exactly `path` (no query), if any.
    pub fn of_path(path: &str) -> Option<Self> {
        Some(match path {
            "/v1/chat/completions" => Endpoint::Chat,
            "/v1/completions" => Endpoint::Completions,
            "/v1/embeddings" => Endpoint::Embeddings,
            "/v1/messages" => Endpoint::Messages,
            "/v1/messages/count_tokens" => Endpoint::CountTokens,
            "/v1/responses" => Endpoint::Responses,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completions => "completions",
            Endpoint::Embeddings => "embeddings",
            Endpoint::Messages => "messages",
            Endpoint::CountTokens => "count_tokens",
            Endpoint::Responses => "responses",
            Endpoint::Passthrough => "passthrough",
        }
    }

    /// The protocol its bodies, streams and errors are in.
    pub fn wire(self) -> Wire {
        match self {
            Endpoint::Messages | Endpoint::CountTokens => Wire::Anthropic,
            Endpoint::Responses => Wire::Responses,
            _ => Wire::OpenAi,
        }
    }

    /// It generates tokens (timed, and bounded by a tier's output cap).
    pub fn generates(self) -> bool {
        matches!(
            self,
            Endpoint::Chat | Endpoint::Completions | Endpoint::Messages | Endpoint::Responses
        )
    }
}

/// The wire protocol of a request: how its stream's events are read, and the
/// shape its errors take (bodies, stream events, rate-limit headers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    /// OpenAI chat/completions: `data:` chunks with `choices`, ended by `[DONE]`.
    OpenAi,
    /// Anthropic Messages: named events from `message_start` to `message_stop`.
    Anthropic,
    /// OpenAI Responses: `response.*` events ending in `response.completed`,
    /// `response.incomplete` or `response.failed`.
    Responses,
}

/// Why a generation stopped, from the closed set engines report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
    ToolCalls,
    ContentFilter,
    FunctionCall,
    Abort,
    #[serde(other)]
    Other,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::ContentFilter => "content_filter",
            FinishReason::FunctionCall => "function_call",
            FinishReason::Abort => "abort",
            FinishReason::Other => "other",
        }
    }

    pub const ALL: [FinishReason; 7] = [
        FinishReason::Stop,
        FinishReason::Length,
        FinishReason::ToolCalls,
        FinishReason::ContentFilter,
        FinishReason::FunctionCall,
        FinishReason::Abort,
        FinishReason::Other,
    ];
}

/// Token counts of a generation, as the engine reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: u32,
    #[serde(default)]
    pub completion_tokens: u32,
    /// Prompt tokens the engine served from its prefix cache
    /// (`prompt_tokens_details.cached_tokens`; vLLM reports it with
    /// `--enable-prompt-tokens-details`), when reported.
    #[serde(
        default,
        rename = "prompt_tokens_details",
        deserialize_with = "cached_of"
    )]
    pub cached_tokens: Option<u32>,
}

fn cached_of<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    #[derive(Deserialize)]
    struct Details {
        #[serde(default)]
        cached_tokens: Option<u32>,
    }
    Ok(Option::<Details>::deserialize(d)?.and_then(|x| x.cached_tokens))
}

/// Which engine's metric names a replica uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// Decide from the names found.
    #[default]
    Auto,
    Vllm,
    Sglang,
    Llamacpp,
    /// TensorRT-LLM behind Triton (`nv_trt_llm_*`); names per the Triton
    /// TensorRT-LLM backend, not yet checked against a live server.
    Trtllm,
    /// Hugging Face TGI (`tgi_*`): queue and batch size; TGI exports no KV-cache
    /// usage, so only queue pressure steers work away from it.
    Tgi,
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Auto => "unknown",
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
            EngineKind::Llamacpp => "llamacpp",
            EngineKind::Trtllm => "trtllm",
            EngineKind::Tgi => "tgi",
        }
    }
}

/// Why a replica was chosen for a request (a routing decision's reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteReason {
    RoundRobin,
    LeastLoaded,
    /// The replica holding the prompt's prefix (or its consistent-hash home).
    Affinity,
    /// The replica holding the request's session (its earlier turns).
    Session,
    /// A session seen for the first time here, placed where it should stay.
    SessionNew,
    /// A prompt whose prefix this gateway had sent nowhere yet, placed on
    /// the less busy of the first two open replicas in its prefix's order.
    PrefixNew,
    /// Responses: the replica that produced `previous_response_id`.
    ResponseHome,
    /// The preferred replica was preempting (out of KV blocks) while
    /// another was not, or its KV cache was above `kv_high` where set, and
    /// another was predicted much faster (this request only).
    SpillKv,
    /// The preferred replica's own queue persisted (or every seat was
    /// taken) while another had room, or its queue was above `queue_high`
    /// where set, and another was predicted much faster (this request only).
    SpillQueue,
    /// The preferred replica's metrics were too old to trust.
    SpillStale,
    /// The home replica's engine was pressed (it queued, or every seat was
    /// taken) and it carried more than its bounded share of in-flight load.
    SpillLoad,
    /// Another replica was predicted to give the first token much sooner
    /// than the home (predicted TTFT, `detour_margin`).
    Detour,
    /// The prefix's home kept evicting what it was sent (cached tokens fell
    /// short lately) while it held at least two prompts more than the open
    /// replica holding the fewest: the prefix moved to a new home. Or a
    /// disaggregated prefill leg's prefill replica queued and kept evicting
    /// (its session's history there probably gone) while another was open
    /// with fewer prompt tokens ahead: the session was placed anew by load
    /// among such replicas. Or, with `session_placement: auto` once another
    /// sender shows at the engines, a session this gateway placed by
    /// pressure while alone went back to its key's first replica.
    Rehome,
    /// Every candidate was filtered out (pressure, stale metrics, ejection):
    /// the least loaded of them was used rather than failing.
    Fallback,
    /// An earlier attempt failed before the first byte; this is the next replica.
    Retry,
}

impl RouteReason {
    pub fn as_str(self) -> &'static str {
        match self {
            RouteReason::RoundRobin => "round_robin",
            RouteReason::LeastLoaded => "least_loaded",
            RouteReason::Affinity => "affinity",
            RouteReason::Session => "session",
            RouteReason::SessionNew => "session_new",
            RouteReason::PrefixNew => "prefix_new",
            RouteReason::ResponseHome => "response_home",
            RouteReason::SpillKv => "spill_kv",
            RouteReason::SpillQueue => "spill_queue",
            RouteReason::SpillStale => "spill_stale",
            RouteReason::SpillLoad => "spill_load",
            RouteReason::Detour => "detour",
            RouteReason::Rehome => "rehome",
            RouteReason::Fallback => "fallback",
            RouteReason::Retry => "retry",
        }
    }

    pub const ALL: [RouteReason; 15] = [
        RouteReason::RoundRobin,
        RouteReason::LeastLoaded,
        RouteReason::Affinity,
        RouteReason::Session,
        RouteReason::SessionNew,
        RouteReason::PrefixNew,
        RouteReason::ResponseHome,
        RouteReason::SpillKv,
        RouteReason::SpillQueue,
        RouteReason::SpillStale,
        RouteReason::SpillLoad,
        RouteReason::Detour,
        RouteReason::Rehome,
        RouteReason::Fallback,
        RouteReason::Retry,
    ];
}

/// How a request of a disaggregated model was prefilled
/// (`sluice_pd_decisions_total{reason}`, the access log, the trace).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdReason {
    /// On a prefill replica; its KV went to the decode replica.
    Remote,
    /// Locally: the decode replica held most of the prompt already.
    LocalCached,
    /// Locally: the prefill replicas' predicted wait was longer than the
    /// local prefill.
    LocalPoolBusy,
    /// Locally: the decode replica decoded nothing and the prefill
    /// replicas' predicted wait was longer than the local prefill.
    LocalIdle,
    /// Locally: the prefill replicas' predicted wait was longer than the
    /// local prefill, and the stalled gaps it causes the decode replica's
    /// streams fit the gateway's allowance (`local_stall_share`).
    LocalStallBudget,
    /// Locally: no prefill replica could be used.
    LocalNoPrefill,
    /// Locally: the remote prefill failed, was refused or timed out.
    LocalFallback,
    /// Locally: the prefill replica answered without KV transfer parameters
    /// (its one token ended the answer).
    LocalNoKv,
    /// Locally, again: the decode replica could not fetch the KV.
    LocalKvFetchFailed,
    /// Locally: the engines have no prefill leg for the request's API
    /// (Responses; Messages under SGLang's protocol).
    LocalApi,
}

impl PdReason {
    pub fn as_str(self) -> &'static str {
        match self {
            PdReason::Remote => "remote",
            PdReason::LocalCached => "local_cached",
            PdReason::LocalPoolBusy => "local_pool_busy",
            PdReason::LocalIdle => "local_idle",
            PdReason::LocalStallBudget => "local_stall_budget",
            PdReason::LocalNoPrefill => "local_no_prefill_replica",
            PdReason::LocalFallback => "local_fallback",
            PdReason::LocalNoKv => "local_no_kv",
            PdReason::LocalKvFetchFailed => "local_kv_fetch_failed",
            PdReason::LocalApi => "local_api",
        }
    }

    pub const ALL: [PdReason; 10] = [
        PdReason::Remote,
        PdReason::LocalCached,
        PdReason::LocalPoolBusy,
        PdReason::LocalIdle,
        PdReason::LocalStallBudget,
        PdReason::LocalNoPrefill,
        PdReason::LocalFallback,
        PdReason::LocalNoKv,
        PdReason::LocalKvFetchFailed,
        PdReason::LocalApi,
    ];
}

/// Which rate limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    Requests,
    Tokens,
    Concurrency,
}

impl LimitKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LimitKind::Requests => "requests",
            LimitKind::Tokens => "tokens",
            LimitKind::Concurrency => "concurrency",
        }
    }

    pub const ALL: [LimitKind; 3] = [
        LimitKind::Requests,
        LimitKind::Tokens,
        LimitKind::Concurrency,
    ];
}
