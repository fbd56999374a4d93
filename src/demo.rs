//! `sluice demo`: three simulated replicas, the gateway in front of them, a
//! workload through it, and a live summary, all in one process.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::net::TcpListener;

use crate::bench::{self, BenchConfig};
use crate::cli::DemoArgs;
use crate::config::{BackendConfig, Config};
use crate::server;
use crate::sim::{self, SimConfig};

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let mut sims = Vec::new();
    for (i, token_ms) in [15u64, 20, 25].into_iter().enumerate() {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let cfg = SimConfig {
            model: "demo-model".into(),
            prefill_delay: Duration::from_millis(40 + 20 * i as u64),
            token_delay: Duration::from_millis(token_ms),
            output_tokens: 48,
            ..SimConfig::default()
        };
        sims.push(sim::start(listener, cfg).await?);
    }
    let mut config = Config::default();
    config.server.listen = args.listen;
    config.server.admin_listen = args.admin_listen;
    config.upstream.health_check.interval = Duration::from_secs(1);
    config.backends = sims
        .iter()
        .map(|s| BackendConfig::from_url(s.url().parse().unwrap_or_else(|_| unreachable_url())))
        .collect();
    let gw = server::start(config).await.context(
        "starting the gateway (is port 8080 or 9090 taken? use --listen/--admin-listen)",
    )?;
    wait_ready(&gw).await?;

    let api = format!("http://{}", gw.api_addr);
    let admin = format!("http://{}", gw.admin_addr);
    println!("Sluice demo: 3 simulated vLLM replicas behind the gateway.\n");
    println!("  API (OpenAI base_url): {api}/v1");
    println!("  Metrics:               {admin}/metrics");
    println!("  Replicas:              {admin}/admin/backends\n");
    println!("Try it:");
    println!(
        "  curl -N {api}/v1/chat/completions -H 'content-type: application/json' \\\n    \
         -d '{{\"model\":\"demo-model\",\"stream\":true,\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'"
    );
    println!(
        "  python3 -c \"from openai import OpenAI; c=OpenAI(base_url='{api}/v1', api_key='x'); \
         print(c.chat.completions.create(model='demo-model', messages=[{{'role':'user','content':'hi'}}]).choices[0].message.content)\"\n"
    );

    let workload = tokio::spawn(bench::run(BenchConfig {
        url: api.clone(),
        model: Some("demo-model".into()),
        concurrency: args.concurrency,
        requests: None,
        duration: Some(
            args.duration
                .unwrap_or(Duration::from_secs(365 * 24 * 3600)),
        ),
        max_tokens: 48,
        prompt_chars: 400,
        api_key: None,
        json: None,
        progress: false,
    }));

    let started = Instant::now();
    let end = args.duration.map(|d| started + d);
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    tick.tick().await;
    let stop = server::shutdown_signal();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                println!("{}", summary(&gw, &sims, started));
                if end.is_some_and(|e| Instant::now() >= e) {
                    break;
                }
            }
            _ = &mut stop => {
                println!("\nstopping...");
                break;
            }
        }
    }
    workload.abort();
    let report = workload.await.ok().and_then(Result::ok);
    println!("\nFinal: {}", summary(&gw, &sims, started));
    if let Some(r) = report {
        println!("{}", r.table());
    }
    gw.shutdown(Duration::from_secs(5)).await;
    Ok(())
}

fn unreachable_url() -> url::Url {
    url::Url::parse("http://127.0.0.1:1").unwrap_or_else(|_| std::process::abort())
}

async fn wait_ready(gw: &server::Gateway) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gw.state.pool.any_healthy() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "no simulated replica became healthy"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

fn summary(gw: &server::Gateway, sims: &[sim::SimHandle], started: Instant) -> String {
    let m = &gw.state.metrics;
    let series = m.models.get(&("demo-model".into(),));
    let secs = started.elapsed().as_secs_f64().max(0.001);
    let q = |h: &crate::telemetry::registry::Histogram, p: f64| {
        h.quantile(p)
            .map_or("-".to_string(), |v| format!("{:.0}ms", v * 1e3))
    };
    let mut out = format!(
        "[{:>4.0}s] {} done, {:.0} tokens/s | TTFT p50 {} p99 {} | ITL p50 {} p99 {}\n",
        secs,
        series.e2e.count(),
        series.generation_tokens.get() as f64 / secs,
        q(&series.ttft, 0.5),
        q(&series.ttft, 0.99),
        q(&series.inter_token, 0.5),
        q(&series.inter_token, 0.99),
    );
    for (r, s) in gw.state.pool.replicas.iter().zip(sims) {
        out.push_str(&format!(
            "         {:<16} served {:>6}  in flight {:>3}  running {:>3}\n",
            r.name,
            s.state.metrics.received.get(),
            r.in_flight(),
            s.state.metrics.running.get(),
        ));
    }
    out.pop();
    out
}
