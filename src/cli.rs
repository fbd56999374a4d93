//! The command line: one binary, one subcommand per job.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use url::Url;

use crate::config::PolicyKind;

#[derive(Debug, Parser)]
#[command(
    name = "sluice",
    version,
    about = "An OpenAI-compatible gateway for self-hosted LLM fleets",
    long_about = "Sluice sits in front of vLLM (and SGLang, llama.cpp, TGI) replicas: it streams \
                  every token through without buffering, times it, routes each request, and \
                  exports Prometheus metrics.",
    after_help = "Start with `sluice demo`: simulated replicas, the gateway and a workload, no GPU needed."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gateway.
    #[command(after_help = "Examples:\n  \
        sluice serve --config config/sluice.yaml\n  \
        sluice serve --backend http://vllm-0:8000 --backend http://vllm-1:8000\n  \
        sluice serve --config sluice.yaml --listen 127.0.0.1:8080 --admin-listen 127.0.0.1:9090\n\n\
        Signals:\n  \
        SIGHUP   read the config file and flags again; running streams finish on the old config\n  \
        SIGTERM  stop accepting, let open streams finish for server.drain_timeout, exit")]
    Serve(ServeArgs),
    /// Check a config file; errors name the key and the line.
    #[command(after_help = "Example:\n  sluice check-config config/sluice.yaml")]
    CheckConfig {
        /// The YAML config file.
        file: PathBuf,
    },
    /// Run one simulated vLLM-compatible replica (no GPU).
    #[command(after_help = "Examples:\n  \
        sluice sim --listen 127.0.0.1:8001\n  \
        sluice sim --listen 127.0.0.1:8001 --profile a100-llama3-8b --speed 10\n  \
        sluice sim --listen 127.0.0.1:8001 --profile fixed --token-delay 5ms --output-tokens 256\n  \
        sluice sim --listen 127.0.0.1:8001 --dialect sglang\n  \
        sluice sim --listen 127.0.0.1:8001 --fault stall=10:30s --fault-rate 0.1\n  \
        sluice sim --listen 127.0.0.1:8001 --num-blocks 64 --swap-space 512\n  \
        sluice sim --listen 127.0.0.1:8001 --no-chunked-prefill --max-num-batched-tokens 2048\n\
        Per request, send the header `x-sim-fault: SPEC` (same syntax as --fault).\n\
        POST /sim/reset frees the KV blocks leaked by the `leak` fault (a restart).\n\
        GET /dcgm/metrics shows the replica's GPUs as NVIDIA's dcgm-exporter does.")]
    Sim(SimArgs),
    /// Load-test any OpenAI-compatible endpoint and report TTFT/ITL/E2E percentiles.
    #[command(after_help = "Examples:\n  \
        sluice bench --url http://127.0.0.1:8080 --concurrency 32 --requests 1000\n  \
        sluice bench --url http://127.0.0.1:8080 --rate 20 --duration 60s --json report.json\n  \
        sluice bench --url http://127.0.0.1:8080 --workload shared-prefix --prefixes 16 --prefix-tokens 3000\n  \
        sluice bench --url http://127.0.0.1:8080 --workload burst --burst-size 64 --burst-interval 5s -n 640")]
    Bench(BenchArgs),
    /// Ask a running gateway what is wrong with its fleet (exit code 2 when
    /// something is critical).
    #[command(
        after_help = "Examples:\n  sluice diagnose\n  sluice diagnose --admin http://10.0.0.5:9090\n  sluice diagnose --json"
    )]
    Diagnose {
        /// The gateway's admin listener.
        #[arg(long, default_value = "http://127.0.0.1:9090")]
        admin: Url,
        /// The admin listener's token, where `server.admin_auth` sets one.
        #[arg(long, env = "SLUICE_ADMIN_TOKEN", hide_env_values = true)]
        admin_token: Option<String>,
        /// Print the JSON of /admin/diagnose instead of the report.
        #[arg(long)]
        json: bool,
    },
    /// A live view of a running gateway: replicas, latency, routing, tenants,
    /// diagnoses (redrawn in place; plain frames when not on a terminal).
    #[command(
        after_help = "Examples:\n  sluice top\n  sluice top --admin http://10.0.0.5:9090 --interval 2s"
    )]
    Top {
        /// The gateway's admin listener.
        #[arg(long, default_value = "http://127.0.0.1:9090")]
        admin: Url,
        /// The admin listener's token, where `server.admin_auth` sets one.
        #[arg(long, env = "SLUICE_ADMIN_TOKEN", hide_env_values = true)]
        admin_token: Option<String>,
        /// Time between two frames.
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        interval: Duration,
        /// Stop after this many frames (default: until Ctrl-C).
        #[arg(long)]
        frames: Option<u64>,
    },
    /// Simulated replicas, the gateway in front of them and a workload, with a live summary.
    #[command(
        after_help = "Examples:\n  sluice demo\n  sluice demo --duration 20s\n  \
        sluice demo --scenario cpu-swapping"
    )]
    Demo(DemoArgs),
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// YAML config file (see config/sluice.yaml).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// A replica's base URL; repeatable. Replaces the config's `backends`.
    #[arg(long = "backend", value_name = "URL")]
    pub backends: Vec<Url>,
    /// API listener address (overrides `server.listen`).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Admin listener address (overrides `server.admin_listen`).
    #[arg(long, value_name = "ADDR")]
    pub admin_listen: Option<SocketAddr>,
    /// Routing policy (overrides `routing.policy`).
    #[arg(long, value_enum)]
    pub policy: Option<PolicyKind>,
}

#[derive(Debug, Args)]
pub struct SimArgs {
    #[arg(long, default_value = "127.0.0.1:8000", value_name = "ADDR")]
    pub listen: SocketAddr,
    /// The model name served (and listed in /v1/models).
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Engine profile: h100-llama3-8b, a100-llama3-8b, h100x4-llama3-70b, tiny;
    /// or `fixed` for load-independent timing (--prefill-delay, --token-delay).
    #[arg(long, default_value = "h100-llama3-8b", value_parser = parse_profile)]
    pub profile: String,
    /// Run engine time this many times faster than the profile (tests, demos).
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
    /// Override the profile's KV-cache size, in blocks.
    #[arg(long)]
    pub num_blocks: Option<u32>,
    /// Override the profile's batch limit (vLLM --max-num-seqs).
    #[arg(long)]
    pub max_num_seqs: Option<u32>,
    /// Override the profile's token budget of one step (vLLM
    /// --max-num-batched-tokens): prompt tokens prefilled plus one per decode.
    #[arg(long, value_name = "TOKENS", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_num_batched_tokens: Option<u32>,
    /// Override the profile's step time at batch size 1 (a decode step's
    /// fixed cost: reading the weights once), e.g. `8ms`.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub step_base: Option<Duration>,
    /// Override the profile's step time added per running sequence, e.g. `100us`.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub step_per_seq: Option<Duration>,
    /// Override the profile's prefill time per prompt token, e.g. `100us`.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub prefill_per_token: Option<Duration>,
    /// Turn automatic prefix caching off (every prompt computed from scratch).
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// CPU swap space, in KV blocks (vLLM V0's --swap-space, which is in GiB):
    /// a sequence preempted for lack of GPU blocks is swapped out to CPU
    /// memory while it fits (vllm:num_requests_swapped,
    /// vllm:cpu_cache_usage_perc), instead of recomputed. Default 0: recompute.
    #[arg(long, value_name = "BLOCKS", default_value_t = 0)]
    pub swap_space: u32,
    /// Prefill each prompt whole in one step, only when it fits in what the
    /// running decodes leave of --max-num-batched-tokens (vLLM without
    /// --enable-chunked-prefill): long prompts wait while decodes run.
    #[arg(long)]
    pub no_chunked_prefill: bool,
    /// vLLM's --scheduling-policy: `fcfs` (arrival order) or `priority`
    /// (the request body's `priority`, lower first, then arrival; the
    /// lowest-priority running sequence is the one preempted for blocks).
    #[arg(long, value_enum, default_value = "fcfs")]
    pub scheduling_policy: crate::sim::SchedulingPolicy,
    /// When a prompt block becomes a prefix-cache hit for other requests:
    /// `compute`, once the step computing it has ended (SGLang), or
    /// `schedule`, once that step is scheduled (vLLM V1: requests for a
    /// prompt being prefilled share its blocks).
    #[arg(long, value_enum, default_value = "compute")]
    pub cache_at: crate::sim::CacheAt,
    /// Metric names of /metrics.
    #[arg(long, value_enum, default_value = "vllm")]
    pub dialect: crate::sim::Dialect,
    /// Fixed profile: time to the first token.
    #[arg(long, default_value = "50ms", value_parser = humantime::parse_duration)]
    pub prefill_delay: Duration,
    /// Fixed profile: time between tokens.
    #[arg(long, default_value = "20ms", value_parser = humantime::parse_duration)]
    pub token_delay: Duration,
    /// Tokens generated per request (fewer if the request's max_tokens is lower).
    #[arg(long, default_value_t = 64)]
    pub output_tokens: u32,
    /// Faults for this replica, e.g. `stall=10:30s`, `error=503` or `leak`
    /// (KV blocks never freed; `POST /sim/reset` frees them).
    #[arg(long, value_name = "SPEC")]
    pub fault: Option<String>,
    /// Share of requests the --fault applies to.
    #[arg(long, default_value_t = 1.0)]
    pub fault_rate: f64,
    /// Prefill/decode disaggregation: `prefill` or `decode` plays that leg of
    /// SGLang's protocol (bootstrap rooms) and refuses the other leg of
    /// vLLM's (KV transfer parameters); `mixed` serves both vLLM legs and
    /// plain requests.
    #[arg(long, value_enum, default_value = "mixed")]
    pub role: crate::sim::disagg::Role,
    /// How long KV prefilled for a decode replica is kept for it to pull.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub kv_ttl: Duration,
    /// The bandwidth of a KV transfer to a decode replica, in GB/s (a decode
    /// leg waits the prompt tokens it pulls x the profile's KV bytes per
    /// token over it: over vLLM's protocol, those its prefix cache lacks).
    #[arg(long, default_value_t = 25.0)]
    pub kv_bandwidth_gbps: f64,
    /// Serve HTTPS with this certificate chain (PEM), as an `https://`
    /// replica (with --tls-key).
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
    /// Require client certificates signed by these CAs (PEM): mutual TLS.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_client_ca: Option<std::path::PathBuf>,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Base URL of the endpoint, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    pub url: Url,
    /// Model to request (default: the first in /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// Most requests in flight (closed loop: always this many).
    #[arg(long, short = 'c', default_value_t = 8)]
    pub concurrency: usize,
    /// Open loop: Poisson arrivals at this many requests per second.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Stop after this many requests.
    #[arg(long, short = 'n')]
    pub requests: Option<u64>,
    /// Stop after this long (e.g. 30s).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,
    /// Request shapes.
    #[arg(long, value_enum, default_value = "random")]
    pub workload: crate::bench::workload::Workload,
    /// The API requests use: chat (/v1/chat/completions), messages (Anthropic
    /// /v1/messages) or responses (OpenAI /v1/responses). Not with agentic.
    #[arg(long, value_enum, default_value = "chat")]
    pub api: crate::bench::Api,
    /// Ask for whole answers (`"stream": false`) instead of streams: the
    /// time to the first token is then the whole request's. Not with agentic.
    #[arg(long)]
    pub no_stream: bool,
    /// Prompt length in tokens (about 4 characters each).
    #[arg(long, default_value_t = 200)]
    pub prompt_tokens: u32,
    /// max_tokens of each request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// shared-prefix: number of distinct prefixes.
    #[arg(long, default_value_t = 8)]
    pub prefixes: u32,
    /// shared-prefix: length of each prefix in tokens.
    #[arg(long, default_value_t = 2000)]
    pub prefix_tokens: u32,
    /// agentic: sessions to run (--concurrency of them at once).
    #[arg(long, default_value_t = 200)]
    pub sessions: u32,
    /// agentic: mean turns per session (uniform in half to one and a half times).
    #[arg(long, default_value_t = 12)]
    pub turns: u32,
    /// agentic: mean think time between turns (exponential).
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    pub think_time: Duration,
    /// agentic: share of turns that bring back a long tool result.
    #[arg(long, default_value_t = 0.2)]
    pub tool_share: f64,
    /// agentic: length of a long tool result in tokens.
    #[arg(long, default_value_t = 2000)]
    pub tool_tokens: u32,
    /// agentic: send no `x-session-id` (routers only have the prompt to go by).
    #[arg(long)]
    pub no_session_id: bool,
    /// agentic: heavy-tailed session lengths (Pareto, same mean, at most 8x):
    /// a few long sessions carry much of the work.
    #[arg(long)]
    pub heavy_sessions: bool,
    /// burst: requests per burst (default: --concurrency).
    #[arg(long)]
    pub burst_size: Option<u32>,
    /// burst: time between bursts.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub burst_interval: Duration,
    /// Seed of the request generator (same seed, same requests).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Text opening each prompt's unique part (after a shared prefix):
    /// bench processes with different salts send distinct prompts (the same
    /// seed and workload otherwise send the same ones). Not with agentic.
    #[arg(long, default_value = "")]
    pub salt: String,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long, env = "SLUICE_BENCH_API_KEY")]
    pub api_key: Option<String>,
    /// An `https://` URL's certificate is checked against these CAs (PEM)
    /// instead of the system's store.
    #[arg(long, value_name = "FILE")]
    pub ca_file: Option<std::path::PathBuf>,
    /// Write the report as JSON to this file (`-` for stdout).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write every request's timing to this file, one JSON line each (when
    /// sent, TTFT, end to end, the longest gap between two tokens and when
    /// it ended, the replica that answered where it says, cached tokens,
    /// the shared prefix of a `shared-prefix` prompt; with
    /// `--workload agentic`, each turn's session, number and whether it
    /// answers a tool result).
    #[arg(long, value_name = "FILE")]
    pub requests_json: Option<PathBuf>,
    /// No progress lines.
    #[arg(long, short)]
    pub quiet: bool,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// End on its own after this long, with a summary (default: until Ctrl-C).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,
    /// Gateway API address.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Gateway admin address.
    #[arg(long, default_value = "127.0.0.1:9090")]
    pub admin_listen: SocketAddr,
    /// Requests in flight in the demo workload.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// A pathology to watch appear and the diagnosis name it.
    #[arg(long, value_enum, default_value = "healthy")]
    pub scenario: Scenario,
}

/// What `sluice demo --scenario` does to the simulated fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Nothing wrong.
    Healthy,
    /// KV caches far too small for the traffic: the engines preempt.
    KvThrashing,
    /// One replica generates at a third of the others' speed.
    SlowReplica,
    /// One replica's /metrics fails while it keeps serving.
    StaleMetrics,
    /// One replica reports a long queue.
    UnevenQueues,
    /// The engines run without prefix caching: routing's shared prefixes miss.
    PrefixCacheMisses,
    /// One replica's engine leaks the KV blocks of half its requests.
    LeakedKv,
    /// KV caches far too small, with CPU swap space: the engines swap.
    CpuSwapping,
    /// Engines without chunked prefill under long generations and long
    /// documents: first tokens wait, queues grow.
    PrefillStarvation,
    /// Two requests in flight over three replicas: small batches, idle GPUs
    /// (the diagnosis's window shortened to a minute so that it shows).
    Underutilisation,
    /// A disaggregated fleet: two prefill and two decode replicas (vLLM's
    /// protocol): each request's prefill planned remote or local.
    Disaggregated,
}

/// `fixed` or a known engine profile, checked when the command line is parsed.
fn parse_profile(name: &str) -> Result<String, String> {
    if name == "fixed" || crate::sim::profile::by_name(name).is_some() {
        Ok(name.to_string())
    } else {
        Err(format!(
            "unknown profile (known: fixed, {})",
            crate::sim::profile::names()
        ))
    }
}
