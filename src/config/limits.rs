//! Config of tenants: API keys, tiers and the rate-limit store.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Secret;

/// Who may call, and as which tier. Without this section the gateway is open
/// and unlimited.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Tier of requests that carry no key; `None`: they get 401.
    pub anonymous_tier: Option<String>,
    pub keys: Vec<ApiKey>,
    /// More keys, in a YAML file with the same list shape (a mounted
    /// Kubernetes Secret); read at start.
    pub keys_file: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    /// Shown in logs and traces (never in metrics); never the key itself.
    pub name: String,
    pub tier: String,
    /// Hex SHA-256 of the key (`printf %s "$KEY" | sha256sum`). Keys are never
    /// stored in clear.
    pub sha256: Secret,
}

/// Limits of one tier. Each key gets its own buckets of these sizes; an absent
/// limit is no limit.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TierConfig {
    /// Requests per minute; also the burst a key may spend at once.
    pub requests_per_minute: Option<u32>,
    /// Tokens (prompt + completion) per minute; reserved at admission from
    /// the prompt estimate plus `max_tokens`, settled with real usage at the end.
    pub tokens_per_minute: Option<u32>,
    /// Requests in flight at once (streams count until they end).
    pub concurrent_requests: Option<u32>,
    /// Largest `max_tokens` accepted; also applied when a request sets none.
    pub max_tokens: Option<u32>,
    /// Per served model: these limits replace the tier's for that model, with
    /// buckets of their own.
    pub models: BTreeMap<String, TierLimits>,
    /// Flow control's band: when the fleet is full, higher bands are served
    /// first (a request may lower its own with `x-sluice-priority`).
    pub priority: i32,
    /// Longest wait at the gateway for this tier (`flow_control.max_wait`
    /// when unset).
    #[serde(with = "humantime_serde::option")]
    pub max_wait: Option<Duration>,
}

/// The overridable part of a tier.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TierLimits {
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u32>,
    pub concurrent_requests: Option<u32>,
    pub max_tokens: Option<u32>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreKind {
    /// Per gateway process: limits multiply with the number of replicas.
    #[default]
    Memory,
    /// Shared by every gateway replica (one atomic script per request).
    Redis,
}

impl StoreKind {
    /// As written in the config; also the `store` label of its metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreKind::Memory => "memory",
            StoreKind::Redis => "redis",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStoreError {
    /// Admit requests while the store is unreachable (availability first).
    #[default]
    FailOpen,
    /// Refuse them with 503 (limits first).
    FailClosed,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RateLimitConfig {
    pub store: StoreKind,
    pub redis: RedisConfig,
    /// What happens to requests while the store cannot be reached.
    pub on_store_error: OnStoreError,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisConfig {
    /// `redis://[:password@]host:port[/db]`.
    pub url: Secret,
    /// Prefix of every key Sluice writes.
    pub key_prefix: String,
    /// Longest wait for one round trip before the store counts as unreachable.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: Secret::new("redis://127.0.0.1:6379"),
            key_prefix: "sluice".into(),
            timeout: Duration::from_millis(100),
        }
    }
}
