//! The typed configuration tree: what an operator writes in `sluice.yaml`.
//!
//! Decoding is strict (`deny_unknown_fields`), durations are humantime strings
//! (`30s`, `2m`), sizes accept units (`16MiB`). Decode errors carry the field path
//! and the line; [`validate`] checks the cross-field rules after decoding.

mod doctor;
mod epp;
mod flow;
mod limits;
mod load;
mod reference;
mod telemetry;
mod types;

pub use doctor::DoctorConfig;
pub use epp::EppConfig;
pub use flow::{EnginePriority, FlowControlConfig};
pub use limits::{
    ApiKey, AuthConfig, OnStoreError, RateLimitConfig, RedisConfig, StoreKind, TierConfig,
    TierLimits,
};
pub use load::{ConfigError, load_file, load_file_with, parse_str, parse_str_with};
pub use reference::{ConfigKey, RESTART, needs_restart, reference};
pub use telemetry::{
    AccessLogConfig, LogTarget, OtlpProtocol, QualityConfig, RefusalConfig, ResolvedTracing,
    SamplingConfig, TracingConfig,
};
pub use types::{ByteSize, Secret};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use url::Url;

/// The whole configuration. Every section has defaults, so an empty file is a
/// valid (if backend-less) config.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub upstream: UpstreamConfig,
    /// The replicas. With none, `sluice serve` needs `--backend URL`.
    pub backends: Vec<BackendConfig>,
    pub discovery: DiscoveryConfig,
    pub models: ModelsConfig,
    pub routing: RoutingConfig,
    pub auth: AuthConfig,
    /// Limits by tier name (see `auth.keys[].tier`).
    pub tiers: BTreeMap<String, TierConfig>,
    pub rate_limits: RateLimitConfig,
    pub flow_control: FlowControlConfig,
    pub doctor: DoctorConfig,
    pub telemetry: TelemetryConfig,
    /// Endpoint-picker mode (Gateway API Inference Extension): off unless
    /// `epp.listen` is set.
    pub epp: EppConfig,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// The OpenAI-compatible API listener (the chart's public Service points here).
    pub listen: SocketAddr,
    /// Metrics, health and admin endpoints. Keep it off the public network.
    pub admin_listen: SocketAddr,
    /// Largest accepted request body; larger ones get 413 before any upstream work.
    pub max_body_bytes: ByteSize,
    /// On SIGTERM, how long open streams may keep running before they are cut.
    #[serde(with = "humantime_serde")]
    pub drain_timeout: Duration,
    /// Longest time a client may take to send its request body (after the
    /// headers); a slower one gets 408 and frees its connection.
    #[serde(with = "humantime_serde")]
    pub body_timeout: Duration,
    /// Longest time a connection may take to deliver a request's headers,
    /// which is also how long an idle keep-alive connection waits for its
    /// next request; then it is closed. Keep it above the idle timeout of a
    /// load balancer that pools connections to the gateway (nginx and AWS ALB
    /// 60 s; Google Cloud's load balancers want 620 s), or it may reuse a
    /// connection just as the gateway closes it.
    #[serde(with = "humantime_serde")]
    pub header_timeout: Duration,
    /// Which HTTP/1.1 server runs the API listener: the gateway's own
    /// (`own`, less CPU per token and per request) or hyper's (`hyper`, the
    /// one before it). Both answer alike; the admin listener is always hyper.
    pub http1: Http1Server,
    /// A token the admin listener requires (`Authorization: Bearer TOKEN`)
    /// on every route but `/healthz` and `/readyz` (and `/metrics` with
    /// `metrics_open`). Off without `token_file` or `token_env`.
    pub admin_auth: AdminAuthConfig,
    /// HTTPS on the listeners: off without `cert_file` and `key_file`.
    pub tls: ServerTlsConfig,
}

/// `server.tls`: the listeners' certificate, and the client certificates
/// they require.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerTlsConfig {
    /// The certificate chain (PEM, leaf first). With `key_file`, both
    /// listeners speak HTTPS only.
    pub cert_file: Option<PathBuf>,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key_file: Option<PathBuf>,
    /// Require a client certificate signed by one of these CAs (PEM) on the
    /// API listener: mutual TLS. Off by default. (The admin listener never
    /// asks for one: probes and scrapers have none; lock it with
    /// `admin_auth`.)
    pub client_ca_file: Option<PathBuf>,
    /// The admin listener speaks HTTPS too (its probes and scrapes then use
    /// `https`). `false` keeps it plain.
    pub admin: bool,
    /// How often the certificate and key files are checked for a change
    /// (cert-manager rotates them in place); SIGHUP reloads them at once.
    #[serde(with = "humantime_serde")]
    pub reload_interval: Duration,
}

impl Default for ServerTlsConfig {
    fn default() -> Self {
        Self {
            cert_file: None,
            key_file: None,
            client_ca_file: None,
            admin: true,
            reload_interval: Duration::from_secs(10),
        }
    }
}

impl ServerTlsConfig {
    /// Whether TLS is on.
    pub fn enabled(&self) -> bool {
        self.cert_file.is_some() || self.key_file.is_some()
    }
}

/// `upstream.tls`: how `https://` replicas are trusted, and the client
/// certificate shown to them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamTlsConfig {
    /// CA certificates (PEM) that sign the replicas' certificates; without
    /// it, the system's store.
    pub ca_file: Option<PathBuf>,
    /// A client certificate chain (PEM) for replicas that require one
    /// (mutual TLS), with `key_file`. Rotated files are picked up as
    /// `server.tls`'s are.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

/// `server.admin_auth`: where the admin token comes from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminAuthConfig {
    /// A file whose first line is the token (a mounted Secret); read at
    /// start and at every reload.
    pub token_file: Option<PathBuf>,
    /// Or the environment variable that holds it.
    pub token_env: Option<String>,
    /// Serve `/metrics` without the token (a scraper that cannot send one).
    pub metrics_open: bool,
}

impl AdminAuthConfig {
    /// The token, read from its file or variable (`None`: not configured).
    /// An unreadable file, an unset variable or an empty token is an error:
    /// an admin listener meant to be locked never opens by accident.
    pub fn token(&self) -> anyhow::Result<Option<Secret>> {
        let raw = match (&self.token_file, &self.token_env) {
            (Some(_), Some(_)) => {
                anyhow::bail!("server.admin_auth: give token_file or token_env, not both")
            }
            (Some(path), None) => std::fs::read_to_string(path).map_err(|e| {
                anyhow::anyhow!(
                    "server.admin_auth.token_file: cannot read {}: {e}",
                    path.display()
                )
            })?,
            (None, Some(var)) => std::env::var(var)
                .map_err(|_| anyhow::anyhow!("server.admin_auth.token_env: ${var} is not set"))?,
            (None, None) => return Ok(None),
        };
        let token = raw.lines().next().unwrap_or("").trim().to_string();
        anyhow::ensure!(
            !token.is_empty(),
            "server.admin_auth: the admin token is empty"
        );
        Ok(Some(Secret::new(token)))
    }
}

/// The API listener's HTTP/1.1 server (`server.http1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Http1Server {
    #[default]
    Own,
    Hyper,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 8080)),
            admin_listen: SocketAddr::from(([0, 0, 0, 0], 9090)),
            max_body_bytes: ByteSize(16 * 1024 * 1024),
            drain_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(60),
            header_timeout: Duration::from_secs(75),
            http1: Http1Server::Own,
            admin_auth: AdminAuthConfig::default(),
            tls: ServerTlsConfig::default(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    pub timeouts: Timeouts,
    /// Extra attempts on another replica, only before the first byte reached the
    /// client, and only for failures that cannot have done work (connect refused,
    /// 503, 429, no response headers in time).
    pub max_retries: u32,
    /// Idle keep-alive connections are closed after this long.
    #[serde(with = "humantime_serde")]
    pub pool_idle_timeout: Duration,
    /// Idle keep-alive connections kept per replica.
    pub pool_max_idle_per_host: usize,
    /// Largest non-streamed response body read from a replica (embeddings can be large).
    pub max_response_bytes: ByteSize,
    pub health_check: HealthCheckConfig,
    pub outlier: OutlierConfig,
    /// Trust and client certificate for `https://` replicas.
    pub tls: UpstreamTlsConfig,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            timeouts: Timeouts::default(),
            max_retries: 2,
            pool_idle_timeout: Duration::from_secs(90),
            pool_max_idle_per_host: 1024,
            max_response_bytes: ByteSize(256 * 1024 * 1024),
            health_check: HealthCheckConfig::default(),
            outlier: OutlierConfig::default(),
            tls: UpstreamTlsConfig::default(),
        }
    }
}

/// No whole-request timeout applies to a healthy stream by default beyond `total`:
/// a long generation is fine as long as tokens keep coming (`idle`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// TCP connect to a replica. Short: a replica that does not accept is down.
    #[serde(with = "humantime_serde")]
    pub connect: Duration,
    /// From sending the request to the first SSE event (streams) or the response
    /// headers (non-streamed). Covers queueing and prefill on the replica, so it
    /// must exceed the worst prefill you accept.
    #[serde(with = "humantime_serde")]
    pub first_token: Duration,
    /// Longest silence allowed between two chunks once a stream has started.
    #[serde(with = "humantime_serde")]
    pub idle: Duration,
    /// Hard cap on a whole request, first byte to last.
    #[serde(with = "humantime_serde")]
    pub total: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(3),
            first_token: Duration::from_secs(120),
            idle: Duration::from_secs(60),
            total: Duration::from_secs(30 * 60),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthCheckConfig {
    /// How often each replica's `/v1/models` is fetched (health and model list).
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
}

impl Default for HealthCheckConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(5),
            timeout: Duration::from_secs(2),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    /// Base URL of the replica's OpenAI server, e.g. `http://vllm-0:8000`.
    pub url: Url,
    /// Label used in metrics and `/admin/backends`; defaults to `host:port`.
    #[serde(default)]
    pub name: Option<String>,
    /// Sent upstream as `Authorization: Bearer ...` (vLLM `--api-key`). The client's
    /// own `Authorization` is never forwarded.
    #[serde(default)]
    pub api_key: Option<Secret>,
    /// Models this replica serves. Empty: discovered from its `/v1/models`.
    #[serde(default)]
    pub models: Vec<String>,
    /// Requests the replica runs at once (its engine's `--max-num-seqs`, or
    /// less where KV memory binds first). Flow control holds requests at the
    /// gateway beyond it. Unset: learned from the replica's own metrics (the
    /// requests running while some had to wait).
    #[serde(default)]
    pub max_concurrency: Option<u32>,
    /// Pass each request's priority band to an engine that schedules by it.
    #[serde(default)]
    pub engine_priority: EnginePriority,
    /// The replica's NVIDIA DCGM exporter (e.g. `http://gpu-node-0:9400/metrics`),
    /// read with each scrape round: GPU utilisation for the diagnosis
    /// (underutilisation) and the dashboard's GPU row.
    #[serde(default)]
    pub dcgm_url: Option<Url>,
    /// Prefill/decode disaggregation: `prefill` replicas compute prompts
    /// whose KV decode replicas pull (`routing.disaggregation`); `decode`
    /// replicas generate; `mixed` (the default) serve whole requests and may
    /// play either part.
    #[serde(default)]
    pub role: Role,
    /// SGLang's protocol: the prefill replica's bootstrap port
    /// (`--disaggregation-bootstrap-port`; unset: the engine's default).
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
}

/// A replica's part in a disaggregated fleet (`backends[].role`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    #[default]
    Mixed,
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Mixed => "mixed",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// Serves whole requests and decode legs (everything but `prefill`).
    pub fn decodes(self) -> bool {
        self != Role::Prefill
    }

    /// May prefill for another replica (everything but `decode`).
    pub fn prefills(self) -> bool {
        self != Role::Decode
    }
}

impl BackendConfig {
    pub fn from_url(url: Url) -> Self {
        Self {
            url,
            name: None,
            api_key: None,
            models: Vec::new(),
            max_concurrency: None,
            engine_priority: EnginePriority::Off,
            dcgm_url: None,
            role: Role::Mixed,
            bootstrap_port: None,
        }
    }

    /// The label of this replica in metrics and admin output.
    pub fn label(&self) -> String {
        if let Some(name) = &self.name {
            return name.clone();
        }
        match (self.url.host_str(), self.url.port_or_known_default()) {
            (Some(host), Some(port)) => format!("{host}:{port}"),
            _ => self.url.to_string(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelsConfig {
    /// Client-facing name -> served model name, e.g. `gpt-4o: llama-3.1-8b`.
    /// The request's `model` is rewritten to the served name before forwarding.
    pub aliases: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Each replica in turn.
    RoundRobin,
    /// Fewest requests waiting on the replica plus in flight from this gateway.
    LeastLoaded,
    /// Prefix affinity weighed against KV-cache and queue pressure.
    #[default]
    PrefixKv,
}

impl PolicyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::LeastLoaded => "least_loaded",
            PolicyKind::PrefixKv => "prefix_kv",
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    pub policy: PolicyKind,
    pub prefix_kv: PrefixKvConfig,
    /// Conversations kept on one replica across turns (`prefix_kv`).
    pub sessions: SessionsConfig,
    /// Responses API: which replica keeps which response (any policy).
    pub responses: ResponsesConfig,
    /// Scraping each replica's own `/metrics` (KV usage, queue).
    pub metrics: ScrapeConfig,
    /// Prefill/decode disaggregation, for models with `prefill` replicas.
    pub disaggregation: DisaggregationConfig,
}

/// `routing.disaggregation`: how a request to a model with `prefill`
/// replicas is served (see docs/routing.md, "Disaggregated fleets").
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DisaggregationConfig {
    /// The engines' protocol: `vllm` (a prefill request whose answer's
    /// `kv_transfer_params` go with the decode request: NIXL, Mooncake) or
    /// `sglang` (`bootstrap_host`, `bootstrap_port`, `bootstrap_room` sent to
    /// both replicas at once).
    pub protocol: PdProtocol,
    /// A prefill leg that has not answered by then is given up (another
    /// prefill replica, or a local prefill, serves the request).
    #[serde(with = "humantime_serde")]
    pub prefill_timeout: Duration,
    /// When no prefill replica can do it (all failed, refused or timed out),
    /// the decode replica prefills the prompt itself; off, the request fails
    /// (503).
    pub local_fallback: bool,
    /// The decode replica prefills locally when it already holds at least
    /// this share of the prompt (its prefix or its session).
    pub local_share: f64,
    /// The most uncached prompt tokens a decode replica prefills by choice
    /// (`local_cached`, `local_pool_busy`): each step that carries a
    /// prefill is longer for every stream the replica decodes. The default,
    /// 0, keeps prefills off the decode replicas but as a fallback (no
    /// prefill replica, a failed leg: not bound by it) and on a replica
    /// that decodes nothing (`local_when_idle`); unset, no bound.
    pub local_max_tokens: Option<u32>,
    /// A decode replica that decodes nothing (no stream there, by this
    /// gateway's requests in flight, its engine's latest scrape and a look
    /// at its engine then) prefills a prompt itself, beyond
    /// `local_max_tokens`, when the prefill pool's predicted wait is longer
    /// than the local prefill (`local_idle`): no stream's steps are
    /// lengthened by it. A cold start's burst of new prompts is then
    /// prefilled by the whole fleet.
    pub local_when_idle: bool,
    /// A decode replica that decodes streams prefills a prompt it lacks at
    /// most one chunk of itself, beyond `local_max_tokens`, when the prefill
    /// pool's predicted wait is longer than the local prefill and the
    /// stalled gaps it causes there
    /// (each stream decoding there once per `prefill_chunk_tokens` of the
    /// prompt) keep this gateway's stalls on that replica within this share
    /// of the inter-token gaps it relayed from it over the last ~30 s
    /// (`local_stall_budget`): under 1%, the streams' inter-token p99 stays
    /// a decode step's. 0: never. The streams are every gateway's, as a
    /// look at the decode replica's engine shows them when the last scrape
    /// allows the prefill (`upstream::scrape::glance`).
    pub local_stall_share: f64,
    /// The engines' prefill chunk, in tokens (vLLM's
    /// `max_num_batched_tokens`, SGLang's `chunked_prefill_size`): a local
    /// prefill stalls each stream on its replica once per chunk.
    pub prefill_chunk_tokens: u32,
    /// Where a session's prefills start (its prefill home, apart from its
    /// decode home): `least_loaded` (the default: the prefill replica with
    /// the fewest sessions lately), or any value of
    /// `routing.prefix_kv.session_placement`; `auto` follows that setting.
    pub session_placement: SessionPlacement,
}

impl DisaggregationConfig {
    /// The prefill legs' session placement, `auto` resolved.
    pub fn prefill_session_placement(&self, routing: &RoutingConfig) -> SessionPlacement {
        match self.session_placement {
            SessionPlacement::Auto => routing
                .prefix_kv
                .session_placement
                .resolved(&routing.sessions),
            other => other,
        }
    }
}

/// `routing.disaggregation.protocol`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PdProtocol {
    #[default]
    Vllm,
    Sglang,
}

impl Default for DisaggregationConfig {
    fn default() -> Self {
        Self {
            protocol: PdProtocol::Vllm,
            prefill_timeout: Duration::from_secs(30),
            local_fallback: true,
            local_share: 0.5,
            local_max_tokens: Some(0),
            local_when_idle: true,
            local_stall_share: 0.005,
            prefill_chunk_tokens: 2048,
            session_placement: SessionPlacement::LeastLoaded,
        }
    }
}

/// The memory of response id -> replica, so that a `previous_response_id`
/// follow-up and the by-id routes reach the replica that keeps the response.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResponsesConfig {
    /// Response ids remembered (rounded up to a multiple of 128; in a full
    /// set of eight, the least recently used is forgotten first). 16 bytes
    /// each.
    pub max_ids: usize,
    /// An id not used for this long is forgotten (engines keep stored
    /// responses until they restart). At most two years (longer reads as
    /// two years).
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
}

impl Default for ResponsesConfig {
    fn default() -> Self {
        Self {
            max_ids: 200_000,
            ttl: Duration::from_secs(24 * 3600),
        }
    }
}

/// Where a request's session (conversation) id comes from, in order of
/// preference: the first source the request has wins.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(try_from = "String", into = "String")]
pub enum SessionSource {
    /// A request header, e.g. `header:x-session-id` (parsed once, at load:
    /// a lookup by a parsed name skips parsing it again per request).
    Header(http::HeaderName),
    /// The body's `prompt_cache_key` (OpenAI).
    PromptCacheKey,
    /// The body's `metadata.user_id` (Anthropic Messages).
    MetadataUserId,
    /// The body's `previous_response_id` (OpenAI Responses: the chain).
    PreviousResponseId,
    /// The body's `user` (OpenAI).
    User,
    /// None sent: derived from the prompt, the system prompt and the first
    /// user message (what tells one conversation from another).
    Derived,
}

impl TryFrom<String> for SessionSource {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        Ok(match s.as_str() {
            "prompt_cache_key" => SessionSource::PromptCacheKey,
            "metadata.user_id" => SessionSource::MetadataUserId,
            "previous_response_id" => SessionSource::PreviousResponseId,
            "user" => SessionSource::User,
            "derived" => SessionSource::Derived,
            other => match other
                .strip_prefix("header:")
                .and_then(|h| http::HeaderName::from_bytes(h.as_bytes()).ok())
            {
                // `from_bytes` lowercases the name.
                Some(h) => SessionSource::Header(h),
                None => {
                    return Err(format!(
                        "unknown session source `{other}` (header:NAME, prompt_cache_key, metadata.user_id, previous_response_id, user, derived)"
                    ));
                }
            },
        })
    }
}

impl From<SessionSource> for String {
    fn from(s: SessionSource) -> String {
        match s {
            SessionSource::Header(h) => format!("header:{}", h.as_str()),
            SessionSource::PromptCacheKey => "prompt_cache_key".into(),
            SessionSource::MetadataUserId => "metadata.user_id".into(),
            SessionSource::PreviousResponseId => "previous_response_id".into(),
            SessionSource::User => "user".into(),
            SessionSource::Derived => "derived".into(),
        }
    }
}

/// Session stickiness: a conversation's turns go to the replica that holds
/// its history, while that replica is healthy and not under pressure.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionsConfig {
    pub enabled: bool,
    /// Where the session id comes from, first match wins.
    pub sources: Vec<SessionSource>,
    /// A session not seen for this long is forgotten (at most two years:
    /// longer reads as two years).
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    /// Sessions remembered (rounded up to a multiple of 128; in a full set of
    /// eight, the least recently seen is forgotten first). 16 bytes each.
    pub max_sessions: usize,
    /// Where sessions are kept besides each gateway's own table: `memory`
    /// (nowhere: gateways agree by the key's rendezvous order) or `redis`
    /// (a table every gateway reads and writes: the first gateway to place
    /// a session decides, and the others find it there).
    pub store: StoreKind,
    /// The shared table's Redis (with `store: redis`).
    pub redis: RedisConfig,
}

impl Default for SessionsConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            sources: vec![
                SessionSource::Header(http::HeaderName::from_static("x-session-id")),
                SessionSource::Header(http::HeaderName::from_static("x-claude-code-session-id")),
                SessionSource::PromptCacheKey,
                SessionSource::MetadataUserId,
                SessionSource::PreviousResponseId,
                SessionSource::User,
                SessionSource::Derived,
            ],
            ttl: Duration::from_secs(30 * 60),
            max_sessions: 100_000,
            store: StoreKind::Memory,
            redis: RedisConfig::default(),
        }
    }
}

/// The `prefix_kv` policy's knobs. Defaults come from the routing benchmark on
/// the simulator (docs/benchmarks-log.md, "Routing"), with the reasoning there.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixKvConfig {
    /// Characters per prefix block: 64 is ~16 tokens, vLLM's KV block size.
    pub block_chars: usize,
    /// Longest prefix considered, in blocks (bounds the per-request hashing).
    pub max_blocks: usize,
    /// The home replica of a prompt is chosen by consistent hashing of its
    /// first `home_blocks` blocks (fewer if the prompt is shorter).
    pub home_blocks: usize,
    /// Bounded loads: the home replica is skipped while its in-flight count
    /// exceeds `load_factor` x the mean (so a hot prefix spills to the next).
    pub load_factor: f64,
    /// Off by default. A replica at or above this KV-cache usage gets no new
    /// work (its prefixes and sessions stay), and flow control counts it
    /// full. Engines run their KV cache near full at full batch, so a
    /// percentage says little; by default a replica is pressed when the
    /// engine says so: requests waiting across scrapes, preemptions.
    pub kv_high: Option<f64>,
    /// Off by default. A replica with this many requests waiting for room
    /// (`LoadSample::queue`) gets no new work (its prefixes and sessions
    /// stay), and flow control counts it full.
    pub queue_high: Option<f64>,
    /// Prefix blocks remembered per replica: 8 bytes each (the table is made
    /// zeroed at the replica's first routed prompt), rounded up to a multiple
    /// of 8, at most `MAX_INDEX_CAPACITY`. A block can only go to one set of
    /// 8, and a full set forgets the block inserted least recently there.
    pub index_capacity: usize,
    /// A request leaves its home (its session's replica, its prefix's
    /// holder) only for a replica where its predicted time to first token is
    /// lower by more than this share of the home's: the cache it would find
    /// at home must be worth less than the wait it would save elsewhere.
    /// To a replica holding less of its prompt, only while the home's
    /// engine says it is full (there the prompt is prefilled cold).
    pub detour_margin: f64,
    /// The same for a turn of a session that is under way. The default, 1,
    /// never detours one: its history is worth more than this turn (the next
    /// turns come back), and re-prefilling it elsewhere spends the fleet's
    /// prefill and KV when it is busiest. A session's first turn (with an
    /// id) never leaves its home, where every gateway will look for it.
    pub session_detour_margin: f64,
    /// Where a new session starts: `rendezvous` (the first replica alive in
    /// the session key's own order, whatever its pressure: every gateway
    /// computes the same one), `first_open` (the first in that order whose
    /// engine is not pressed), `two_choices` (of the first two alive in
    /// that order, the open one, else the one with less work) or
    /// `least_loaded` (the open replica with the fewest sessions lately:
    /// one with a turn under way there counts whole, an idle one fades from
    /// its last turn's end). The last three need one
    /// gateway or a shared session table, where the others find the
    /// session. `auto` (the default): `first_open` with
    /// `routing.sessions.store: redis`; else `first_open` while no other
    /// sender's requests show at the replicas' engines (their running and
    /// waiting counts beyond this gateway's in flight: `upstream::company`),
    /// `rendezvous` while they do or before it knows.
    pub session_placement: SessionPlacement,
    /// With `routing.sessions.store: redis`: a prompt whose prefix this
    /// gateway has not sent anywhere is looked up in the shared table, and a
    /// new prefix is placed there (the replica with the fewest prefixes
    /// homed by every gateway), so that gateways behind a load balancer send
    /// a shared prefix to the same replica (`routing::shared_table`).
    pub shared_homes: bool,
    /// While a gateway meets `shared_homes_sampled_from` new prompts of a
    /// model and more in 5-10 s and finds none homed elsewhere, it looks up
    /// one prefix in 16
    /// (by key) and places the others as without the table. `false`: every
    /// new prompt is looked up, whatever the rate (a prefix that reaches
    /// several gateways as a trickle among many new prompts then keeps one
    /// home; each lookup costs a Redis round trip).
    pub shared_homes_sampled: bool,
    /// How many new prompts of a model and pool a gateway meets in 5-10 s
    /// before it samples their lookups (`shared_homes_sampled`).
    pub shared_homes_sampled_from: u64,
    /// Whether a request whose prompt this gateway streamed to the same
    /// replica moments ago, still before that request's first token, waits
    /// for it before it is sent (`routing::prefilling`): `auto` where the
    /// replica's metrics say SGLang (which shares a prompt's KV only once
    /// the forward pass computing it has ended), `on` for every engine,
    /// `off` never.
    pub hold_for_prefill: HoldForPrefill,
    /// A streamed request whose prompt a replica would compute mostly
    /// afresh (256 uncached tokens or more) waits at the gateway while the
    /// cold prefills this gateway has under way there (sent, before their
    /// first tokens) and its own exceed this many tokens, in the order they
    /// came; one over it goes alone (`routing::cold_gate`). Set it to the
    /// engines' prefill budget per step (vLLM's `max_num_batched_tokens`,
    /// SGLang's `chunked_prefill_size`). The default, 8,192, is both
    /// engines' default on large GPUs: above an engine's budget the gate only
    /// does less (cached requests wait behind more cold prefills, never
    /// more than without it); below it, the engine's steps would take less
    /// prefill than they could, which on all-cold traffic is throughput lost.
    /// Not on a replica whose engine says it is full (its queue outlived a
    /// scrape, or it preempts): there the first token waits for room in the
    /// engine, and nothing waits at the gateway. 0: off.
    pub cold_prefill_tokens: u32,
}

/// `routing.prefix_kv.hold_for_prefill`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldForPrefill {
    #[default]
    Auto,
    On,
    Off,
}

/// Prompts new to a gateway (held nowhere in its index) of a model and
/// pool in the last 5-10 s from which, while the shared table found none
/// of them homed elsewhere, it stops looking up every one
/// (`routing::shared_table`): 100-200 a second and more. Below that the
/// lookups cost a gateway at most ~1% of a core (~50 us of its own and
/// Redis's CPU each: docs/BENCHMARKS.md, "The shared routing table on
/// prompts that share nothing"). The default of
/// `routing.prefix_kv.shared_homes_sampled_from`.
pub const SHARED_HOMES_SAMPLED_FROM: u64 = 1_000;

/// Where a new session starts (`routing.prefix_kv.session_placement`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionPlacement {
    #[default]
    Auto,
    Rendezvous,
    FirstOpen,
    TwoChoices,
    LeastLoaded,
}

impl SessionPlacement {
    /// What `auto` means for `sessions`: `first_open` where a shared table
    /// lets every gateway find a session placed by pressure; else `auto`
    /// still, decided per request ([`SessionPlacement::now`]).
    pub fn resolved(self, sessions: &SessionsConfig) -> Self {
        match self {
            SessionPlacement::Auto if sessions.store == StoreKind::Redis => {
                SessionPlacement::FirstOpen
            }
            other => other,
        }
    }

    /// What `auto` means now, without a shared table: `first_open` while
    /// the gateway is `alone` (no other sender shows at the replicas'
    /// engines: `upstream::company`), where nobody else looks for a session
    /// by its key; else `rendezvous`, which every gateway computes alike.
    /// (With one gateway and `rendezvous`, a replica given a few sessions
    /// too many queues, its sessions last longer and pile up there: on
    /// heavy-tailed sessions one replica held 47-90% of the requests in
    /// flight, TTFT p99 10-15 s; `first_open` 4.8-7.4 s in the same seeds;
    /// docs/BENCHMARKS.md, routing.)
    pub fn now(self, alone: bool) -> Self {
        match self {
            SessionPlacement::Auto if alone => SessionPlacement::FirstOpen,
            SessionPlacement::Auto => SessionPlacement::Rendezvous,
            other => other,
        }
    }
}

impl Default for PrefixKvConfig {
    fn default() -> Self {
        Self {
            block_chars: 64,
            max_blocks: 4096,
            home_blocks: 8,
            load_factor: 2.0,
            kv_high: None,
            queue_high: None,
            index_capacity: 1 << 18,
            detour_margin: 0.5,
            session_detour_margin: 1.0,
            session_placement: SessionPlacement::Auto,
            shared_homes: true,
            shared_homes_sampled: true,
            shared_homes_sampled_from: SHARED_HOMES_SAMPLED_FROM,
            hold_for_prefill: HoldForPrefill::Auto,
            cold_prefill_tokens: 8192,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScrapeConfig {
    pub enabled: bool,
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// A sample older than this is not trusted: the replica counts as saturated.
    #[serde(with = "humantime_serde")]
    pub stale_after: Duration,
    /// Metric names to read: auto, vllm, sglang, llamacpp, trtllm, tgi.
    pub engine: crate::vocab::EngineKind,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            interval: Duration::from_secs(1),
            stale_after: Duration::from_secs(5),
            engine: crate::vocab::EngineKind::Auto,
        }
    }
}

/// Passive health: replicas failing requests are ejected for a while.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutlierConfig {
    /// Consecutive failed requests (connect errors, 5xx, timeouts, broken
    /// streams) that eject a replica.
    pub consecutive_failures: u32,
    /// First ejection; each further one doubles it, up to `max_ejection`.
    #[serde(with = "humantime_serde")]
    pub base_ejection: Duration,
    #[serde(with = "humantime_serde")]
    pub max_ejection: Duration,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            base_ejection: Duration::from_secs(10),
            max_ejection: Duration::from_secs(300),
        }
    }
}

/// Replicas found by DNS (e.g. a Kubernetes headless Service) or from the
/// Kubernetes API (pods by label, or an InferencePool's).
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    pub dns: Vec<DnsSource>,
    /// Ask this DNS server instead of the system's (`/etc/resolv.conf`).
    pub nameserver: Option<SocketAddr>,
    pub kubernetes: Vec<KubernetesSource>,
    /// The API server and credentials for `kubernetes` sources: this
    /// kubeconfig file. Unset: the pod's service account inside a cluster,
    /// else `$KUBECONFIG` or `~/.kube/config`.
    pub kubeconfig: Option<PathBuf>,
}

impl DiscoveryConfig {
    /// The replica source ids: `dns[i]` is `i`, `kubernetes[i]` follows the
    /// DNS sources.
    pub fn kubernetes_source(&self, i: usize) -> usize {
        self.dns.len() + i
    }
}

/// Replicas from the Kubernetes API: the ready pods an InferencePool
/// (`inference.networking.k8s.io/v1`) selects, or those with these labels;
/// listed, then watched.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesSource {
    /// The namespace of the pods (and the pool). Unset: the gateway's own
    /// (its service account's), or the kubeconfig context's.
    #[serde(default)]
    pub namespace: Option<String>,
    /// An InferencePool whose `selector` and `targetPorts` pick the replicas;
    /// a change to it is followed.
    #[serde(default)]
    pub inference_pool: Option<String>,
    /// Or the pods' labels, all of which must match.
    #[serde(default)]
    pub selector: BTreeMap<String, String>,
    /// The replicas' port (required with `selector`; with an InferencePool,
    /// overrides its target port).
    #[serde(default)]
    pub port: Option<u16>,
    #[serde(default)]
    pub api_key: Option<Secret>,
    #[serde(default)]
    pub models: Vec<String>,
    /// As `backends[].max_concurrency`, for each replica found.
    #[serde(default)]
    pub max_concurrency: Option<u32>,
    /// As `backends[].engine_priority`.
    #[serde(default)]
    pub engine_priority: EnginePriority,
    /// As `discovery.dns[].dcgm_port`.
    #[serde(default)]
    pub dcgm_port: Option<u16>,
    /// As `backends[].role`, for each replica found (one source per pool).
    #[serde(default)]
    pub role: Role,
    /// As `backends[].bootstrap_port`.
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
}

impl KubernetesSource {
    /// The replica at `host` (an IP, bracketed for v6) and `port`.
    pub fn backend(&self, host: &str, port: u16) -> Option<BackendConfig> {
        Some(BackendConfig {
            url: format!("http://{host}:{port}").parse().ok()?,
            name: None,
            api_key: self.api_key.clone(),
            models: self.models.clone(),
            max_concurrency: self.max_concurrency,
            engine_priority: self.engine_priority,
            dcgm_url: dcgm_url(host, self.dcgm_port),
            role: self.role,
            bootstrap_port: self.bootstrap_port,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DnsSource {
    /// The name whose A/AAAA records are the replicas.
    pub name: String,
    /// The replicas' port.
    pub port: u16,
    /// How often the name is resolved again.
    #[serde(default = "default_dns_interval", with = "humantime_serde")]
    pub interval: Duration,
    #[serde(default)]
    pub api_key: Option<Secret>,
    #[serde(default)]
    pub models: Vec<String>,
    /// As `backends[].max_concurrency`, for each replica found.
    #[serde(default)]
    pub max_concurrency: Option<u32>,
    /// As `backends[].engine_priority`.
    #[serde(default)]
    pub engine_priority: EnginePriority,
    /// Each replica's DCGM exporter on the same address at this port
    /// (`http://IP:PORT/metrics`), as `backends[].dcgm_url`.
    #[serde(default)]
    pub dcgm_port: Option<u16>,
    /// As `backends[].role`, for each replica found (one source per pool).
    #[serde(default)]
    pub role: Role,
    /// As `backends[].bootstrap_port`.
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
}

impl DnsSource {
    /// The replica at `host` (an IP, bracketed for v6).
    pub fn backend(&self, host: &str) -> Option<BackendConfig> {
        Some(BackendConfig {
            url: format!("http://{host}:{}", self.port).parse().ok()?,
            name: None,
            api_key: self.api_key.clone(),
            models: self.models.clone(),
            max_concurrency: self.max_concurrency,
            engine_priority: self.engine_priority,
            dcgm_url: dcgm_url(host, self.dcgm_port),
            role: self.role,
            bootstrap_port: self.bootstrap_port,
        })
    }
}

/// The DCGM exporter of a replica at `host`, on `port` if configured.
fn dcgm_url(host: &str, port: Option<u16>) -> Option<Url> {
    format!("http://{host}:{}/metrics", port?).parse().ok()
}

fn default_dns_interval() -> Duration {
    Duration::from_secs(10)
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// A gap between two tokens longer than this counts as a stall.
    #[serde(with = "humantime_serde")]
    pub stall_threshold: Duration,
    pub buckets: Buckets,
    pub tracing: TracingConfig,
    pub access_log: AccessLogConfig,
    pub quality: QualityConfig,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            stall_threshold: Duration::from_secs(2),
            buckets: Buckets::default(),
            tracing: TracingConfig::default(),
            access_log: AccessLogConfig::default(),
            quality: QualityConfig::default(),
        }
    }
}

/// Default bucket bounds (seconds unless noted), overridable in `telemetry.buckets`.
pub mod buckets {
    /// Time to first token. Interactive SLAs sit between 200 ms and 2 s, so the
    /// bounds are dense there; the tail reaches 80 s for long prompts and queueing.
    pub const TTFT: &[f64] = &[
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
        7.5, 10.0, 20.0, 40.0, 80.0,
    ];
    /// Inter-token gap and TPOT. Healthy decode is 5-60 ms per token, so the
    /// bounds are fine below 100 ms; 1-10 s catches stalls and preemption.
    pub const INTER_TOKEN: &[f64] = &[
        0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1,
        0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0,
    ];
    /// End-to-end latency: seconds to minutes (long generations), dense around
    /// the usual 5-30 s chat SLAs.
    pub const E2E: &[f64] = &[
        0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0,
        180.0, 300.0, 600.0, 1200.0,
    ];
    /// Time spent in the gateway before the upstream send: sub-millisecond when
    /// healthy, so the bounds start at 100 us.
    pub const QUEUE: &[f64] = &[
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
        5.0,
    ];
    /// Tokens per request (counts, not seconds): powers of two up to 128k context.
    pub const TOKENS: &[f64] = &[
        1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
        32768.0, 65536.0, 131072.0,
    ];
}

/// Histogram bucket upper bounds, in seconds. Defaults are in [`buckets`]
/// with the reasoning behind each.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Buckets {
    pub ttft: Vec<f64>,
    pub inter_token: Vec<f64>,
    pub tpot: Vec<f64>,
    pub e2e: Vec<f64>,
    pub queue: Vec<f64>,
}

impl Default for Buckets {
    fn default() -> Self {
        Self {
            ttft: buckets::TTFT.to_vec(),
            inter_token: buckets::INTER_TOKEN.to_vec(),
            tpot: buckets::INTER_TOKEN.to_vec(),
            e2e: buckets::E2E.to_vec(),
            queue: buckets::QUEUE.to_vec(),
        }
    }
}

/// A cross-field rule broken after decoding; `path` names the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub path: String,
    pub message: String,
}

/// The largest `routing.prefix_kv.index_capacity` (512 MiB of index a replica).
pub const MAX_INDEX_CAPACITY: usize = 1 << 26;

/// Cross-field checks that serde cannot express.
pub fn validate(config: &Config) -> Vec<Invalid> {
    let mut out = Vec::new();
    let mut bad = |path: String, message: String| out.push(Invalid { path, message });
    let tls = &config.server.tls;
    if tls.cert_file.is_some() != tls.key_file.is_some() {
        bad(
            "server.tls".into(),
            "give both cert_file and key_file".into(),
        );
    }
    if tls.client_ca_file.is_some() && !tls.enabled() {
        bad(
            "server.tls.client_ca_file".into(),
            "client certificates need TLS on: set cert_file and key_file".into(),
        );
    }
    if tls.reload_interval.is_zero() {
        bad(
            "server.tls.reload_interval".into(),
            "must be above 0".into(),
        );
    }
    let epp = &config.epp;
    if epp.listen.is_some_and(|l| l == epp.health_listen) {
        bad(
            "epp.health_listen".into(),
            "must differ from epp.listen (the health services have a listener of their own)".into(),
        );
    }
    if epp.listen.is_some() && config.routing.disaggregation.protocol == PdProtocol::Sglang {
        bad(
            "routing.disaggregation.protocol".into(),
            "sglang cannot be served through the endpoint picker (epp.listen): the data plane sends one request, and SGLang's protocol needs the prefill and decode legs sent together; serve it through the API listener, or use vllm (the picker names the prefill replica in x-prefiller-host-port for the decode replica's sidecar)".into(),
        );
    }
    for (key, ns) in [
        ("subset_hint_namespace", &epp.subset_hint_namespace),
        ("destination_namespace", &epp.destination_namespace),
    ] {
        if ns.is_empty() {
            bad(format!("epp.{key}"), "must not be empty".into());
        }
    }
    let up = &config.upstream.tls;
    if up.cert_file.is_some() != up.key_file.is_some() {
        bad(
            "upstream.tls".into(),
            "give both cert_file and key_file (the client certificate and its key)".into(),
        );
    }
    let mut seen = std::collections::HashMap::new();
    for (i, b) in config.backends.iter().enumerate() {
        if !matches!(b.url.scheme(), "http" | "https") {
            bad(
                format!("backends[{i}].url"),
                format!(
                    "scheme `{}` is not supported; use http:// or https://",
                    b.url.scheme()
                ),
            );
        }
        if b.url.host_str().is_none() {
            bad(format!("backends[{i}].url"), "URL has no host".into());
        }
        if b.bootstrap_port.is_some() && b.role == Role::Decode {
            bad(
                format!("backends[{i}].bootstrap_port"),
                "a bootstrap port is a prefill replica's (role: prefill or mixed)".into(),
            );
        }
        if let Some(prev) = seen.insert(b.label(), i) {
            bad(
                format!("backends[{i}]"),
                format!(
                    "same name as backends[{prev}] (`{}`); set `name`",
                    b.label()
                ),
            );
        }
    }
    for (alias, target) in &config.models.aliases {
        if alias == target {
            bad(
                format!("models.aliases.{alias}"),
                "alias points to itself".into(),
            );
        }
        if config.models.aliases.contains_key(target) {
            bad(
                format!("models.aliases.{alias}"),
                format!("target `{target}` is itself an alias; point at a served model"),
            );
        }
    }
    let t = &config.upstream.timeouts;
    for (name, d) in [
        ("connect", t.connect),
        ("first_token", t.first_token),
        ("idle", t.idle),
        ("total", t.total),
    ] {
        if d.is_zero() {
            bad(
                format!("upstream.timeouts.{name}"),
                "must be greater than zero".into(),
            );
        }
    }
    if t.first_token > t.total {
        bad(
            "upstream.timeouts.first_token".into(),
            "must not exceed upstream.timeouts.total".into(),
        );
    }
    if config.server.max_body_bytes.0 == 0 {
        bad(
            "server.max_body_bytes".into(),
            "must be greater than zero".into(),
        );
    }
    if config.server.body_timeout.is_zero() {
        bad(
            "server.body_timeout".into(),
            "must be greater than zero".into(),
        );
    }
    if config.server.header_timeout.is_zero() {
        bad(
            "server.header_timeout".into(),
            "must be greater than zero".into(),
        );
    }
    let p = &config.routing.prefix_kv;
    if p.block_chars == 0 || p.max_blocks == 0 || p.home_blocks == 0 {
        bad(
            "routing.prefix_kv".into(),
            "block_chars, max_blocks and home_blocks must be greater than zero".into(),
        );
    }
    // The index is made whole at a replica's first prompt (8 bytes a block):
    // a capacity past 2^26 (512 MiB a replica) is a typo, not a plan.
    if p.index_capacity > MAX_INDEX_CAPACITY {
        bad(
            "routing.prefix_kv.index_capacity".into(),
            format!("must be at most {MAX_INDEX_CAPACITY} (8 bytes a block, per replica)"),
        );
    }
    if p.load_factor.is_nan() || p.load_factor < 1.0 {
        bad(
            "routing.prefix_kv.load_factor".into(),
            "must be at least 1.0".into(),
        );
    }
    if p.kv_high.is_some_and(|k| !(0.0..=1.0).contains(&k)) {
        bad(
            "routing.prefix_kv.kv_high".into(),
            "must be between 0 and 1".into(),
        );
    }
    if p.shared_homes_sampled_from < 1 {
        bad(
            "routing.prefix_kv.shared_homes_sampled_from".into(),
            "must be at least 1".into(),
        );
    }
    if p.queue_high.is_some_and(|q| q.is_nan() || q < 1.0) {
        bad(
            "routing.prefix_kv.queue_high".into(),
            "must be at least 1".into(),
        );
    }
    let dg = &config.routing.disaggregation;
    if !(0.0..=1.0).contains(&dg.local_share) {
        bad(
            "routing.disaggregation.local_share".into(),
            "must be between 0 and 1".into(),
        );
    }
    if !(0.0..0.01).contains(&dg.local_stall_share) {
        bad(
            "routing.disaggregation.local_stall_share".into(),
            "must be at least 0 and under 0.01 (a stream's gaps over its p99)".into(),
        );
    }
    if dg.prefill_chunk_tokens == 0 {
        bad(
            "routing.disaggregation.prefill_chunk_tokens".into(),
            "must be at least 1".into(),
        );
    }
    if dg.prefill_timeout.is_zero() {
        bad(
            "routing.disaggregation.prefill_timeout".into(),
            "must be greater than zero".into(),
        );
    }
    let f = &config.flow_control;
    if f.max_wait.is_zero() || f.recheck.is_zero() || f.share_interval.is_zero() {
        bad(
            "flow_control".into(),
            "max_wait, recheck and share_interval must be greater than zero".into(),
        );
    }
    if f.max_queue == 0 {
        bad("flow_control.max_queue".into(), "must be at least 1".into());
    }
    if !(f.output_weight.is_finite() && f.output_weight > 0.0) {
        bad(
            "flow_control.output_weight".into(),
            "must be a positive number".into(),
        );
    }
    let d = &config.doctor;
    if d.window.is_zero() {
        bad("doctor.window".into(), "must be greater than zero".into());
    }
    if !(d.slow_factor > 1.0 && d.uneven_factor > 1.0) {
        bad(
            "doctor".into(),
            "slow_factor and uneven_factor must be greater than 1".into(),
        );
    }
    for (name, t) in &config.tiers {
        if t.max_wait.is_some_and(|d| d.is_zero()) {
            bad(
                format!("tiers.{name}.max_wait"),
                "must be greater than zero".into(),
            );
        }
    }
    for (i, b) in config.backends.iter().enumerate() {
        if b.max_concurrency == Some(0) {
            bad(
                format!("backends[{i}].max_concurrency"),
                "must be at least 1".into(),
            );
        }
    }
    if config.routing.metrics.interval.is_zero() {
        bad(
            "routing.metrics.interval".into(),
            "must be greater than zero".into(),
        );
    }
    for (i, d) in config.discovery.dns.iter().enumerate() {
        if d.name.trim().is_empty() {
            bad(
                format!("discovery.dns[{i}].name"),
                "must not be empty".into(),
            );
        }
        if d.interval.is_zero() {
            bad(
                format!("discovery.dns[{i}].interval"),
                "must be greater than zero".into(),
            );
        }
    }
    for (i, k) in config.discovery.kubernetes.iter().enumerate() {
        let at = |key: &str| format!("discovery.kubernetes[{i}].{key}");
        match (&k.inference_pool, k.selector.is_empty()) {
            (Some(_), false) => bad(
                at("selector"),
                "set `inference_pool` or `selector`, not both".into(),
            ),
            (None, true) => bad(
                at("inference_pool"),
                "set `inference_pool` (an InferencePool's name) or `selector` (pod labels)".into(),
            ),
            (Some(p), true) if p.trim().is_empty() => {
                bad(at("inference_pool"), "must not be empty".into())
            }
            (None, false) if k.port.is_none() => bad(
                at("port"),
                "required with `selector` (an InferencePool names its own)".into(),
            ),
            _ => {}
        }
    }
    for (i, k) in config.auth.keys.iter().enumerate() {
        if !config.tiers.contains_key(&k.tier) {
            bad(
                format!("auth.keys[{i}].tier"),
                format!("no tier `{}` in `tiers`", k.tier),
            );
        }
        let h = k.sha256.expose();
        if h.len() != 64 || !h.bytes().all(|b| b.is_ascii_hexdigit()) {
            bad(
                format!("auth.keys[{i}].sha256"),
                "must be 64 hex digits (the SHA-256 of the key)".into(),
            );
        }
    }
    if let Some(t) = &config.auth.anonymous_tier
        && !config.tiers.contains_key(t)
    {
        bad(
            "auth.anonymous_tier".into(),
            format!("no tier `{t}` in `tiers`"),
        );
    }
    for (name, t) in &config.tiers {
        let zero = [
            t.requests_per_minute,
            t.tokens_per_minute,
            t.concurrent_requests,
            t.max_tokens,
        ]
        .contains(&Some(0));
        if zero {
            bad(
                format!("tiers.{name}"),
                "limits must be greater than zero (leave one out for no limit)".into(),
            );
        }
    }
    if config.rate_limits.store == StoreKind::Redis
        && url::Url::parse(config.rate_limits.redis.url.expose())
            .map(|u| !matches!(u.scheme(), "redis" | "rediss"))
            .unwrap_or(true)
    {
        bad(
            "rate_limits.redis.url".into(),
            "must be a redis:// URL".into(),
        );
    }
    let s = &config.telemetry.tracing.sampling;
    if !(0.0..=1.0).contains(&s.ratio) {
        bad(
            "telemetry.tracing.sampling.ratio".into(),
            "must be between 0 and 1".into(),
        );
    }
    let a = &config.telemetry.access_log;
    if a.enabled && a.target == LogTarget::File && a.path.is_none() {
        bad(
            "telemetry.access_log.path".into(),
            "needed when target is file".into(),
        );
    }
    let b = &config.telemetry.buckets;
    for (name, v) in [
        ("ttft", &b.ttft),
        ("inter_token", &b.inter_token),
        ("tpot", &b.tpot),
        ("e2e", &b.e2e),
        ("queue", &b.queue),
    ] {
        let increasing = v.windows(2).all(|w| w[0] < w[1]);
        if v.is_empty() || !increasing || v.iter().any(|x| !x.is_finite() || *x <= 0.0) {
            bad(
                format!("telemetry.buckets.{name}"),
                "must be a non-empty list of positive, strictly increasing numbers".into(),
            );
        }
    }
    out
}
