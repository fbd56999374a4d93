//! `sluice demo`: three simulated replicas (the engine model of an 8B model on
//! an H100, with a deliberately small KV cache so that pressure shows), the
//! gateway in front of them, a shared-prefix workload through it, and a live
//! summary, all in one process.

mod otlp;

use std::io::IsTerminal as _;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::net::TcpListener;

use crate::bench::{self, BenchConfig};
use crate::cli::{DemoArgs, Scenario};
use crate::config::{ApiKey, BackendConfig, Config, Secret, TierConfig};
use crate::server;
use crate::sim::{self, SimConfig};
use crate::top;
use sha2::{Digest, Sha256};

const MODEL: &str = "demo-model";
const PREMIUM_KEY: &str = "sk-demo-premium";
const FREE_KEY: &str = "sk-demo-free";
/// name, tier, key.
const DEMO_KEYS: &[(&str, &str, &str)] = &[
    ("team-premium", "premium", PREMIUM_KEY),
    ("team-free", "free", FREE_KEY),
];
/// KV blocks per simulated replica: 16k tokens, a few concurrent long prompts.
const DEMO_BLOCKS: u32 = 1024;

pub(crate) async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let scenario = args.scenario;
    let mut sims = Vec::new();
    // Disaggregated: replicas 0 and 1 prefill, 2 and 3 decode.
    let disaggregated = scenario == Scenario::Disaggregated;
    let role_of = |i: usize| match (disaggregated, i) {
        (false, _) => crate::config::Role::Mixed,
        (true, 0 | 1) => crate::config::Role::Prefill,
        (true, _) => crate::config::Role::Decode,
    };
    for i in 0..if disaggregated { 4 } else { 3 } {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        // The slow replica's engine runs at a third of the profile's speed.
        let speed = if scenario == Scenario::SlowReplica && i == 2 {
            0.3
        } else {
            1.0
        };
        let mut cfg = SimConfig::engine("h100-llama3-8b", speed).context("profile")?;
        if let Some(p) = cfg.profile.as_mut() {
            p.num_blocks = match scenario {
                // ~2 of the workload's sequences fit: the engines preempt
                // (by swapping to CPU memory, with swap space).
                Scenario::KvThrashing | Scenario::CpuSwapping => 160,
                // Room for the long generations: starvation, not KV pressure.
                Scenario::PrefillStarvation => 8192,
                _ => DEMO_BLOCKS,
            };
            // The engines started without --enable-prefix-caching.
            p.prefix_caching = scenario != Scenario::PrefixCacheMisses;
            if scenario == Scenario::CpuSwapping {
                // vLLM V0 with --swap-space: 4,096 blocks of CPU memory.
                p.swap_blocks = 4096;
            }
            if scenario == Scenario::PrefillStarvation {
                // No chunked prefill, and a step budget a long document
                // exceeds: it is prefilled in a step of its own, once the
                // running decodes are done (engine.rs).
                p.chunked_prefill = false;
                p.max_num_batched_tokens = 1024;
            }
        }
        cfg.model = MODEL.into();
        cfg.role = match role_of(i) {
            crate::config::Role::Mixed => sim::disagg::Role::Mixed,
            crate::config::Role::Prefill => sim::disagg::Role::Prefill,
            crate::config::Role::Decode => sim::disagg::Role::Decode,
        };
        // Answers of 128 tokens at most (a request without max_tokens gets
        // 128); prefill-starvation's long generations ask for 1,500.
        cfg.output_tokens = if scenario == Scenario::PrefillStarvation {
            2000
        } else {
            128
        };
        sims.push(sim::start(listener, cfg).await?);
    }
    match scenario {
        Scenario::StaleMetrics => {
            let mut c = sims[1].state.control();
            c.metrics = sim::MetricsMode::Error;
            sims[1].state.set_control(c);
        }
        Scenario::UnevenQueues => {
            let mut c = sims[0].state.control();
            c.waiting = Some(30.0);
            sims[0].state.set_control(c);
        }
        Scenario::LeakedKv => {
            // Half of the second replica's requests end on an exit path that
            // does not free their KV blocks.
            let mut c = sims[1].state.control();
            c.faults = sim::faults::Faults::parse("leak").map_err(anyhow::Error::msg)?;
            c.fault_rate = 0.5;
            sims[1].state.set_control(c);
        }
        _ => {}
    }
    // An occasional fault on the third replica: 2% of its answers are 503
    // (retried on another replica; seen in the upstream errors and retries),
    // and once a minute it fails everything for 3 s: passive health ejects
    // it after 5 failures in a row, and it comes back 10 s later.
    let faulty = sims[2].state.clone();
    let set_rate = move |rate: f64| -> anyhow::Result<()> {
        let mut c = faulty.control();
        c.faults = sim::faults::Faults::parse("error=503").map_err(anyhow::Error::msg)?;
        c.fault_rate = rate;
        faulty.set_control(c);
        Ok(())
    };
    set_rate(0.02)?;
    let bursts = tokio::spawn(async move {
        let mut every = tokio::time::interval_at(
            tokio::time::Instant::now() + Duration::from_secs(20),
            Duration::from_secs(60),
        );
        loop {
            every.tick().await;
            let _ = set_rate(1.0);
            tokio::time::sleep(Duration::from_secs(3)).await;
            let _ = set_rate(0.02);
        }
    });
    let mut config = Config::default();
    // Two tenants: `premium` (the main workload, first when the fleet is
    // full) and `free`, limited to 20 requests a minute and sent more.
    for (name, tier, key) in DEMO_KEYS {
        config.auth.keys.push(ApiKey {
            name: (*name).into(),
            tier: (*tier).into(),
            sha256: Secret::new(hex::encode(Sha256::digest(key.as_bytes()))),
        });
    }
    config.tiers.insert(
        "premium".into(),
        TierConfig {
            priority: 10,
            ..TierConfig::default()
        },
    );
    config.tiers.insert(
        "free".into(),
        TierConfig {
            requests_per_minute: Some(20),
            concurrent_requests: Some(4),
            max_tokens: Some(256),
            ..TierConfig::default()
        },
    );
    config.server.listen = args.listen;
    config.server.admin_listen = args.admin_listen;
    config.upstream.health_check.interval = Duration::from_secs(1);
    // The demo prints its own summary; one JSON line per request would drown it.
    config.telemetry.access_log.enabled = false;
    // Tracing on, exported to the demo's own OTLP sink: errors, slow first
    // tokens and stalls kept, and 5% of the rest.
    let (sink_url, sink) = otlp::start().await?;
    config.telemetry.tracing = crate::config::TracingConfig {
        enabled: Some(true),
        endpoint: Some(sink_url.clone()),
        protocol: Some(crate::config::OtlpProtocol::HttpProtobuf),
        service_name: Some("sluice-demo".into()),
        sampling: crate::config::SamplingConfig {
            ratio: 0.05,
            ..Default::default()
        },
    };
    if scenario == Scenario::Underutilisation {
        // Underutilisation is judged over the whole window (5 minutes by
        // default, and only once 80% of it is scraped): a minute here.
        config.doctor.window = Duration::from_secs(60);
    }
    let concurrency = if scenario == Scenario::Underutilisation {
        2
    } else {
        args.concurrency
    };
    if scenario == Scenario::PrefillStarvation {
        // As in front of a fleet without flow control: the engines queue the
        // excess (with it, the gateway would hold it back at a queue of 8).
        config.flow_control.enabled = false;
    }
    // Each replica's GPUs, as its DCGM exporter shows them.
    config.backends = sims
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let url = s.url();
            Ok(BackendConfig {
                dcgm_url: Some(format!("{url}/dcgm/metrics").parse()?),
                role: role_of(i),
                ..BackendConfig::from_url(url.parse()?)
            })
        })
        .collect::<Result<_, url::ParseError>>()?;
    let gw = server::start(config).await.context(
        "starting the gateway (is 127.0.0.1:8080 or :9090 taken? use --listen / --admin-listen)",
    )?;
    wait_ready(&gw).await?;

    let api = format!("http://{}", gw.api_addr);
    let admin = format!("http://{}", gw.admin_addr);
    println!(
        "Sluice demo: 3 simulated vLLM replicas (Llama-3.1-8B on H100 profile) behind the gateway.\n"
    );
    println!("  API (OpenAI base_url): {api}/v1");
    println!("  Metrics:               {admin}/metrics");
    println!("  Replicas:              {admin}/admin/backends");
    println!("  Diagnosis:             sluice diagnose --admin {admin}");
    println!(
        "  Traces:                OTLP/HTTP to the demo's own sink at {sink_url} (errors, slow first tokens, stalls, 5% of the rest)\n"
    );
    println!("Try it while the workload runs (keys: {PREMIUM_KEY} or {FREE_KEY}):");
    println!(
        "  curl -N {api}/v1/chat/completions -H 'content-type: application/json' -H 'authorization: Bearer {PREMIUM_KEY}' \\\n    \
         -d '{{\"model\":\"{MODEL}\",\"stream\":true,\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'"
    );
    println!(
        "  python3 -c \"from openai import OpenAI; c=OpenAI(base_url='{api}/v1', api_key='{PREMIUM_KEY}'); \
         print(c.chat.completions.create(model='{MODEL}', messages=[{{'role':'user','content':'hi'}}]).choices[0].message.content)\"\n"
    );
    println!(
        "Workload: shared-prefix chat (documents of 1,000 tokens, unique questions), {} in flight \
         for tier premium; tier free sends 5 requests/s against its limit of 20 a minute; \
         2% of the third replica's answers fail with 503, and once a minute all of them for 3 s \
         (retried elsewhere; passive health ejects it, then it comes back).\n",
        concurrency
    );
    if let Some((what, name)) = expectation(scenario) {
        println!(
            "Scenario: {what}. Watch the diagnosis name `{name}` \
             (also: sluice diagnose --admin {admin}).\n"
        );
    }
    if scenario == Scenario::LeakedKv {
        println!(
            "End the leak as an operator would, by restarting that engine: curl -X POST {}/sim/reset\n",
            sims[1].url()
        );
    }

    let forever = Duration::from_secs(365 * 24 * 3600);
    let mut workload = tokio::spawn(bench::run(BenchConfig {
        requests_out: None,
        url: api.clone(),
        model: Some(MODEL.into()),
        concurrency,
        requests: None,
        duration: Some(args.duration.unwrap_or(forever)),
        arrival: bench::Arrival::Closed,
        shape: bench::workload::Shape {
            workload: bench::workload::Workload::SharedPrefix,
            prompt_tokens: 50,
            max_tokens: 128,
            prefixes: 4,
            prefix_tokens: 1000,
            salt: String::new(),
        },
        agentic: None,
        seed: 1,
        api_key: Some(PREMIUM_KEY.into()),
        ca_file: None,
        json: None,
        progress: false,
        api: bench::Api::Chat,
        stream: true,
    }));
    // The free tenant, over its limit: its 429s show in the tenants' view.
    let free_tenant = tokio::spawn(bench::run(BenchConfig {
        requests_out: None,
        url: api.clone(),
        model: Some(MODEL.into()),
        concurrency: 16,
        requests: None,
        duration: Some(args.duration.unwrap_or(forever)),
        arrival: bench::Arrival::Poisson(5.0),
        shape: bench::workload::Shape {
            workload: bench::workload::Workload::Random,
            prompt_tokens: 50,
            max_tokens: 64,
            prefixes: 1,
            prefix_tokens: 0,
            salt: String::new(),
        },
        agentic: None,
        seed: 2,
        api_key: Some(FREE_KEY.into()),
        ca_file: None,
        json: None,
        progress: false,
        api: bench::Api::Chat,
        stream: true,
    }));

    // Prefill starvation: long generations (short prompts, 1,500 tokens
    // each) keep the engines decoding, while long documents (1,200-token
    // prompts, short answers) wait for a step of their own, and everything
    // queued behind them waits too.
    let mut starving = Vec::new();
    if scenario == Scenario::PrefillStarvation {
        let shape = |prompt_tokens, max_tokens| bench::workload::Shape {
            workload: bench::workload::Workload::Fixed,
            prompt_tokens,
            max_tokens,
            prefixes: 1,
            prefix_tokens: 0,
            salt: String::new(),
        };
        for (arrival, concurrency, shape, seed) in [
            (bench::Arrival::Closed, 30, shape(50, 1500), 3),
            (bench::Arrival::Poisson(3.0), 64, shape(1200, 16), 4),
        ] {
            starving.push(tokio::spawn(bench::run(BenchConfig {
                requests_out: None,
                url: api.clone(),
                model: Some(MODEL.into()),
                concurrency,
                requests: None,
                duration: Some(args.duration.unwrap_or(forever)),
                arrival,
                shape,
                agentic: None,
                seed,
                api_key: Some(PREMIUM_KEY.into()),
                ca_file: None,
                json: None,
                progress: false,
                api: bench::Api::Chat,
                stream: true,
            })));
        }
    }

    let started = Instant::now();
    // On a terminal the demo shows `sluice top`'s view, redrawn in place;
    // otherwise (a pipe, a log) a summary line every 2 s.
    let tty = std::io::stdout().is_terminal();
    let every = if tty {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(2)
    };
    let mut viewer = top::Viewer::new(admin.parse()?, every);
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    let stop = server::shutdown_signal();
    tokio::pin!(stop);
    // The workload ends at --duration once its requests in flight are done;
    // starved ones may take much longer, so they are cut a little after it.
    let cut = tokio::time::sleep(
        args.duration
            .map_or(forever, |d| d + Duration::from_secs(5)),
    );
    tokio::pin!(cut);
    let report = loop {
        tokio::select! {
            _ = tick.tick() => {
                if tty {
                    if let Ok(frame) = viewer.frame().await {
                        top::show(&format!("{frame}\nAPI {api}/v1 (model {MODEL})  ·  Ctrl-C to stop\n"), true);
                    }
                } else {
                    println!("{}", summary(&gw, &sims, started));
                }
            }
            r = &mut workload => break r.ok().and_then(Result::ok),
            _ = &mut stop => {
                println!("\nstopping...");
                workload.abort();
                break None;
            }
            () = &mut cut => {
                println!("\nrequests still in flight 5 s after --duration: cut");
                workload.abort();
                break None;
            }
        }
    };
    free_tenant.abort();
    bursts.abort();
    for t in starving {
        t.abort();
    }
    println!("\nFinal {}", summary(&gw, &sims, started));
    if let Some(r) = report {
        println!("\nAs the client saw it:\n{}", r.table());
    }
    gw.shutdown(Duration::from_secs(5)).await;
    println!(
        "Traces: {} spans in {} exports reached the demo's OTLP sink.",
        sink.spans.load(std::sync::atomic::Ordering::Relaxed),
        sink.exports.load(std::sync::atomic::Ordering::Relaxed)
    );
    Ok(())
}

async fn wait_ready(gw: &server::Gateway) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gw.state().pool.any_healthy() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "no simulated replica became healthy"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// What a scenario does, and the pathology the diagnosis should name.
fn expectation(s: Scenario) -> Option<(&'static str, &'static str)> {
    match s {
        Scenario::Healthy | Scenario::Disaggregated => None,
        Scenario::KvThrashing => Some((
            "KV caches far too small for the traffic",
            "kv_cache_thrashing",
        )),
        Scenario::SlowReplica => Some((
            "the third replica generates at a third of the others' speed",
            "slow_replica",
        )),
        Scenario::StaleMetrics => Some((
            "the second replica's /metrics fails while it keeps serving",
            "stale_metrics",
        )),
        Scenario::UnevenQueues => Some((
            "the first replica reports 30 requests waiting",
            "uneven_queues",
        )),
        Scenario::PrefixCacheMisses => Some((
            "the engines run without prefix caching",
            "prefix_cache_misses",
        )),
        Scenario::LeakedKv => Some((
            "half of the second replica's requests never free their KV blocks: its KV floor \
             rises while its requests come and go (named after doctor.leak_for, 60 s, of \
             scrapes, traffic or not; POST /sim/reset to its address ends it)",
            "leaked_kv",
        )),
        Scenario::CpuSwapping => Some((
            "KV caches far too small, with CPU swap space: preempted sequences are swapped out",
            "cpu_swapping",
        )),
        Scenario::Underutilisation => Some((
            "two requests in flight over three replicas: small batches, nothing waiting, GPUs \
             mostly idle (named as information after ~50 s: doctor.window is a minute here)",
            "underutilisation",
        )),
        Scenario::PrefillStarvation => Some((
            "engines without chunked prefill, long generations and long documents: \
             the documents wait for the decodes to finish, the queues grow \
             (flow control off)",
            "prefill_starvation",
        )),
    }
}

fn summary(gw: &server::Gateway, sims: &[sim::SimHandle], started: Instant) -> String {
    let state = gw.state();
    let m = &state.metrics;
    // The main workload's series (tier premium).
    let series = m.models.get(&(
        MODEL.into(),
        crate::vocab::Endpoint::Chat.as_str(),
        "premium".into(),
    ));
    let secs = started.elapsed().as_secs_f64().max(0.001);
    let q = |h: &crate::telemetry::registry::Histogram, p: f64| {
        h.quantile(p)
            .map_or("-".to_string(), |v| format!("{:.0}ms", v * 1e3))
    };
    let reasons: Vec<String> = crate::vocab::RouteReason::ALL
        .iter()
        .filter_map(|r| {
            let n = m.routing.get(&(MODEL.into(), r.as_str())).get();
            (n > 0).then(|| format!("{} {n}", r.as_str()))
        })
        .collect();
    let mut out = format!(
        "[{:>4.0}s] {} done, {:.0} tokens/s | TTFT p50 {} p99 {} | ITL p50 {} p99 {} | routed: {}\n",
        secs,
        series.e2e.count(),
        series.generation_tokens.get() as f64 / secs,
        q(&series.ttft, 0.5),
        q(&series.ttft, 0.99),
        q(&series.inter_token, 0.5),
        q(&series.inter_token, 0.99),
        reasons.join(", "),
    );
    let pd: Vec<String> = crate::vocab::PdReason::ALL
        .iter()
        .filter_map(|r| {
            let n = m.pd_decisions.get(&(MODEL.into(), r.as_str())).get();
            (n > 0).then(|| format!("{} {n}", r.as_str()))
        })
        .collect();
    if !pd.is_empty() {
        out.push_str(&format!("        prefilled: {}\n", pd.join(", ")));
    }
    for (r, s) in gw.state().pool.replicas().iter().zip(sims) {
        let sm = &s.state.metrics;
        out.push_str(&format!(
            "        {:<16} {:<7} served {:>5}  running {:>3}  waiting {:>3}  KV {:>5.1}%  prefix hits {:>5.1}%\n",
            r.name,
            r.role.as_str(),
            sm.received.get(),
            sm.running.get(),
            sm.waiting.get(),
            sm.kv_usage.get() * 100.0,
            sm.hit_rate() * 100.0,
        ));
    }
    let state = gw.state();
    let findings = crate::api::admin::diagnose_now(&state);
    let named: Vec<String> = findings
        .iter()
        .map(|f| match (&f.tier, &f.model) {
            (Some(t), _) => format!("{} on tier {t}", f.pathology),
            (_, Some(model)) => format!("{} on model {model}", f.pathology),
            _ => format!("{} on {}", f.pathology, f.backend),
        })
        .collect();
    out.push_str(&format!(
        "        diagnosis: {}",
        if named.is_empty() {
            "healthy".to_string()
        } else {
            named.join(", ")
        }
    ));
    out
}
