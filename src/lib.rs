//! Sluice: an OpenAI-compatible gateway for self-hosted LLM fleets.
//!
//! The library holds everything; the binary only parses the command line. Tests
//! and benchmarks start the gateway ([`server::start`]) and the simulator
//! ([`sim::start`]) in-process on loopback sockets.

pub mod api;
mod app;
mod bench;
pub mod cli;
pub mod config;
mod demo;
pub mod doctor;
pub mod epp;
mod error;
pub mod flow;
mod headers;
mod limits;
pub mod net;
pub mod request;
pub mod routing;
pub mod server;
pub mod sim;
pub mod state;
pub mod stream;
pub mod telemetry;
mod term;
mod tokens;
pub mod top;
mod turn;
pub mod upstream;
pub mod vocab;

use anyhow::Context as _;

pub use term::print_out;

/// The config `sluice serve` runs with: the file (or defaults), then the
/// command-line overrides, validated. Read again on SIGHUP.
fn serve_config(args: &cli::ServeArgs) -> anyhow::Result<config::Config> {
    let overrides = |config: &mut config::Config| {
        if !args.backends.is_empty() {
            config.backends = args
                .backends
                .iter()
                .cloned()
                .map(config::BackendConfig::from_url)
                .collect();
        }
        if let Some(a) = args.listen {
            config.server.listen = a;
        }
        if let Some(a) = args.admin_listen {
            config.server.admin_listen = a;
        }
        if let Some(p) = args.policy {
            config.routing.policy = p;
        }
    };
    // Decoded, overridden, then validated once (with the file's lines).
    let config = match &args.config {
        Some(path) => config::load_file_with(path, overrides)?,
        None => config::parse_str_with("", "command line", overrides)?,
    };
    anyhow::ensure!(
        !config.backends.is_empty()
            || !config.discovery.dns.is_empty()
            || !config.discovery.kubernetes.is_empty(),
        "no backends: give --backend URL, or list `backends`, `discovery.dns` or `discovery.kubernetes` in --config FILE"
    );
    Ok(config)
}

/// Run one command of the CLI to completion.
pub async fn run(command: cli::Command) -> anyhow::Result<()> {
    use cli::Command;
    match command {
        Command::Serve(args) => {
            let config = serve_config(&args)?;
            // Before anything else: a SIGHUP during startup must not kill us.
            let mut hangup = server::Hangups::new();
            let gw = server::start(config).await?;
            tracing::info!(api = %gw.api_addr, admin = %gw.admin_addr, "sluice is serving");
            let shutdown = server::shutdown_signal();
            tokio::pin!(shutdown);
            loop {
                tokio::select! {
                    () = &mut shutdown => break,
                    () = hangup.recv() => {
                        // The same file and flags as at start, read again.
                        match gw.reload_with(|| serve_config(&args)) {
                            Ok(()) => tracing::info!("config reloaded (SIGHUP)"),
                            Err(e) => tracing::error!(
                                error = %format!("{e:#}"),
                                "config reload failed; the running config stays"
                            ),
                        }
                        // Logged and counted one by one.
                        let _ = gw.reload_certificates();
                    }
                }
            }
            tracing::info!("shutting down: draining open requests");
            let drain = gw.state().config.server.drain_timeout;
            gw.shutdown(drain).await;
            Ok(())
        }
        Command::CheckConfig { file } => {
            let c = config::load_file(&file)?;
            print_out(&format!(
                "{}: OK ({} backends, {} DNS sources, policy {}, {} keys, {} tiers)",
                file.display(),
                c.backends.len(),
                c.discovery.dns.len(),
                c.routing.policy.as_str(),
                c.auth.keys.len(),
                c.tiers.len()
            ));
            Ok(())
        }
        Command::Sim(args) => {
            let faults = match &args.fault {
                Some(spec) => sim::faults::Faults::parse(spec).map_err(anyhow::Error::msg)?,
                None => sim::faults::Faults::default(),
            };
            let engine_only = [
                (args.swap_space > 0, "--swap-space"),
                (args.no_chunked_prefill, "--no-chunked-prefill"),
                (
                    args.scheduling_policy == sim::SchedulingPolicy::Priority,
                    "--scheduling-policy priority",
                ),
                (
                    args.cache_at == sim::CacheAt::Schedule,
                    "--cache-at schedule",
                ),
                (args.step_base.is_some(), "--step-base"),
                (args.step_per_seq.is_some(), "--step-per-seq"),
                (args.prefill_per_token.is_some(), "--prefill-per-token"),
            ];
            if let Some((_, flag)) = engine_only.iter().find(|(set, _)| *set)
                && args.profile == "fixed"
            {
                anyhow::bail!("{flag} needs an engine profile; --profile fixed has no scheduler");
            }
            let profile = if args.profile == "fixed" {
                None
            } else {
                let mut p = *sim::profile::by_name(&args.profile).with_context(|| {
                    format!(
                        "unknown profile `{}` (known: fixed, {})",
                        args.profile,
                        sim::profile::names()
                    )
                })?;
                p.num_blocks = args.num_blocks.unwrap_or(p.num_blocks);
                p.max_num_seqs = args.max_num_seqs.unwrap_or(p.max_num_seqs);
                p.max_num_batched_tokens = args
                    .max_num_batched_tokens
                    .unwrap_or(p.max_num_batched_tokens);
                p.step_base = args.step_base.unwrap_or(p.step_base);
                p.per_seq = args.step_per_seq.unwrap_or(p.per_seq);
                p.per_prefill_token = args.prefill_per_token.unwrap_or(p.per_prefill_token);
                anyhow::ensure!(
                    !p.step_base.is_zero(),
                    "--step-base must be positive (an engine step takes time)"
                );
                p.prefix_caching &= !args.no_prefix_caching;
                p.swap_blocks = args.swap_space;
                p.chunked_prefill &= !args.no_chunked_prefill;
                p.priority_scheduling = args.scheduling_policy == sim::SchedulingPolicy::Priority;
                p.cache_at = args.cache_at;
                Some(p)
            };
            anyhow::ensure!(args.speed > 0.0, "--speed must be positive");
            let listener = tokio::net::TcpListener::bind(args.listen)
                .await
                .with_context(|| format!("cannot listen on {}", args.listen))?;
            let handle = sim::start(
                listener,
                sim::SimConfig {
                    model: args.model,
                    profile,
                    speed: args.speed,
                    prefill_delay: args.prefill_delay,
                    token_delay: args.token_delay,
                    output_tokens: args.output_tokens,
                    faults,
                    fault_rate: args.fault_rate,
                    dialect: args.dialect,
                    role: args.role,
                    kv_ttl: args.kv_ttl,
                    kv_bandwidth: args.kv_bandwidth_gbps * 1e9,
                    tls: match (&args.tls_cert, &args.tls_key) {
                        (Some(c), Some(k)) => Some(net::tls::server_config(
                            net::tls::Certificate::load(c, k)?,
                            args.tls_client_ca.as_deref(),
                        )?),
                        _ => None,
                    },
                },
            )
            .await?;
            tracing::info!(addr = %handle.addr, profile = %args.profile, "simulated replica is serving");
            server::shutdown_signal().await;
            handle.stop();
            Ok(())
        }
        Command::Bench(args) => {
            anyhow::ensure!(
                args.api == bench::Api::Chat || args.workload != bench::workload::Workload::Agentic,
                "--workload agentic speaks chat only (--api chat)"
            );
            anyhow::ensure!(
                !args.no_stream || args.workload != bench::workload::Workload::Agentic,
                "--workload agentic streams (no --no-stream)"
            );
            anyhow::ensure!(
                args.salt.is_empty() || args.workload != bench::workload::Workload::Agentic,
                "--workload agentic builds its own prompts (no --salt)"
            );
            let arrival = match (args.workload, args.rate) {
                (bench::workload::Workload::Burst, _) => bench::Arrival::Burst {
                    size: args
                        .burst_size
                        .unwrap_or(u32::try_from(args.concurrency).unwrap_or(u32::MAX)),
                    interval: args.burst_interval,
                },
                (_, Some(r)) => {
                    anyhow::ensure!(r > 0.0, "--rate must be positive");
                    bench::Arrival::Poisson(r)
                }
                (_, None) => bench::Arrival::Closed,
            };
            let report = bench::run(bench::BenchConfig {
                url: args.url.to_string(),
                model: args.model,
                concurrency: args.concurrency,
                requests: args.requests,
                duration: args.duration,
                arrival,
                shape: bench::workload::Shape {
                    workload: args.workload,
                    prompt_tokens: args.prompt_tokens,
                    max_tokens: args.max_tokens,
                    prefixes: args.prefixes,
                    prefix_tokens: args.prefix_tokens,
                    salt: args.salt.clone(),
                },
                agentic: Some(bench::agentic::AgenticShape {
                    sessions: args.sessions,
                    turns: args.turns,
                    shared_tokens: args.prefix_tokens,
                    message_tokens: args.prompt_tokens,
                    tool_share: args.tool_share,
                    tool_tokens: args.tool_tokens,
                    max_tokens: args.max_tokens,
                    think: args.think_time,
                    session_header: !args.no_session_id,
                    heavy_sessions: args.heavy_sessions,
                }),
                stream: !args.no_stream,
                seed: args.seed,
                api_key: args.api_key,
                ca_file: args.ca_file.clone(),
                json: args.json.clone(),
                progress: !args.quiet,
                api: args.api,
                requests_out: args.requests_json.clone(),
            })
            .await?;
            if args.json.as_deref() != Some(std::path::Path::new("-")) {
                print_out(&report.table());
            }
            Ok(())
        }
        Command::Demo(args) => demo::run(args).await,
        Command::Diagnose {
            admin,
            admin_token,
            json,
        } => {
            doctor::report::use_token(admin_token);
            doctor::report::run(&admin, json).await
        }
        Command::Top {
            admin,
            admin_token,
            interval,
            frames,
        } => {
            doctor::report::use_token(admin_token);
            top::run(&admin, interval, frames).await
        }
    }
}
