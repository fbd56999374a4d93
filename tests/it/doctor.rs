//! The on-call doctor over real sockets: pathologies induced in `sluice sim`
//! replicas behind the real gateway are named on the right replica within a
//! few scrape intervals, and cleared when they end; `sluice diagnose` prints
//! them and says with its exit code whether one is critical.

use std::time::Duration;

use sluice::config::Config;
use sluice::server::Gateway;
use sluice::sim::{MetricsMode, SimConfig, SimHandle};

use crate::common::*;
use crate::routing::start_routed;

fn doctor_config(urls: &[String]) -> Config {
    let mut c = config_for(urls);
    c.routing.metrics.interval = Duration::from_millis(100);
    c.routing.metrics.stale_after = Duration::from_millis(1000);
    c.doctor.window = Duration::from_secs(3);
    c.doctor.leak_for = Duration::from_millis(500);
    // Findings held 300 ms after their evidence goes (one clears in time
    // for these tests; holding is tested on its own).
    c.doctor.clear_after = Duration::from_millis(300);
    // Off (no median batch is below 0): these tests' light traffic would
    // otherwise be named underutilised; its own test turns it on.
    c.doctor.underused_batch = 0.0;
    c
}

fn label(sim: &SimHandle) -> String {
    sim.url().trim_start_matches("http://").to_string()
}

async fn findings(gw: &Gateway) -> Vec<(String, String, String)> {
    let (status, body) = get_text(&format!("{}/admin/diagnose", admin(gw))).await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            for k in ["evidence", "cause", "action", "window_seconds"] {
                assert!(f.get(k).is_some(), "finding without {k}: {f}");
            }
            (
                f["pathology"].as_str().unwrap().to_string(),
                f["backend"].as_str().unwrap().to_string(),
                f["severity"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

async fn until_named(gw: &Gateway, pathology: &str, backend: &str) {
    wait_until(
        &format!("{pathology} named on {backend}"),
        Duration::from_secs(10),
        || async move {
            findings(gw)
                .await
                .iter()
                .any(|(p, b, _)| p == pathology && b == backend)
        },
    )
    .await;
}

async fn until_healthy(gw: &Gateway) {
    wait_until("no finding", Duration::from_secs(10), || async move {
        findings(gw).await.is_empty()
    })
    .await;
}

/// Streamed requests (their token timing is what the doctor compares).
async fn traffic(gw: &Gateway, n: usize) {
    for _ in 0..n {
        let (status, _, body) = post(
            &format!("{}/v1/chat/completions", api(gw)),
            &chat_body(true),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("[DONE]"), "{body}");
    }
}

/// `sluice diagnose --admin URL`, the real binary (off the test's runtime
/// thread, which serves the gateway meanwhile).
async fn diagnose_cli(gw: &Gateway) -> std::process::Output {
    let url = admin(gw);
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["diagnose", "--admin", &url])
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn pathologies_are_named_on_their_replica_and_cleared() {
    // 10 ms per token on both: timing noise of a busy test machine stays
    // well below the factor that names a slow replica.
    let even = || SimConfig {
        token_delay: Duration::from_millis(10),
        ..fast_sim()
    };
    let sims = [start_sim(even()).await, start_sim(even()).await];
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let gw = start_routed(doctor_config(&urls), 2).await;
    traffic(&gw, 10).await;
    // A healthy fleet under traffic: nothing, and healthy zeros in /metrics.
    assert!(findings(&gw).await.is_empty());
    let (a, b) = (label(&sims[0]), label(&sims[1]));
    let active = |pathology: &str, backend: &str| {
        format!("sluice_diagnosis_active{{pathology=\"{pathology}\",backend=\"{backend}\"}}")
    };
    let (_, text) = get_text(&format!("{}/metrics", admin(&gw))).await;
    assert_eq!(metric(&text, &active("stale_metrics", &a)), Some(0.0));

    // Stale metrics: replica 0's /metrics fails while it still serves.
    let mut c = sims[0].state.control();
    c.metrics = MetricsMode::Error;
    sims[0].state.set_control(c.clone());
    until_named(&gw, "stale_metrics", &a).await;
    assert_eq!(gateway_metric(&gw, &active("stale_metrics", &a)).await, 1.0);
    assert_eq!(gateway_metric(&gw, &active("stale_metrics", &b)).await, 0.0);
    c.metrics = MetricsMode::Ok;
    sims[0].state.set_control(c);
    until_healthy(&gw).await;

    // Leaked KV: replica 1 holds 60% of its KV cache with nothing running.
    let mut c = sims[1].state.control();
    c.kv_usage = Some(0.6);
    sims[1].state.set_control(c.clone());
    until_named(&gw, "leaked_kv", &b).await;
    assert!(
        findings(&gw)
            .await
            .iter()
            .all(|(p, backend, _)| p == "leaked_kv" && *backend == b)
    );
    c.kv_usage = None;
    sims[1].state.set_control(c);
    until_healthy(&gw).await;

    // Uneven queues: 30 waiting on replica 0, none on replica 1.
    let mut c = sims[0].state.control();
    c.waiting = Some(30.0);
    sims[0].state.set_control(c.clone());
    until_named(&gw, "uneven_queues", &a).await;
    c.waiting = None;
    sims[0].state.set_control(c);
    until_healthy(&gw).await;
}

#[tokio::test]
async fn a_replica_much_slower_than_its_peers_is_named() {
    let slow = SimConfig {
        token_delay: Duration::from_millis(25),
        ..fast_sim()
    };
    let sims = [start_sim(fast_sim()).await, start_sim(slow).await];
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let mut c = doctor_config(&urls);
    c.routing.policy = sluice::config::PolicyKind::RoundRobin;
    let gw = start_routed(c, 2).await;
    traffic(&gw, 8).await;
    let found = findings(&gw).await;
    assert_eq!(
        found,
        vec![(
            "slow_replica".to_string(),
            label(&sims[1]),
            "warning".to_string()
        )]
    );
    // The report, from the real binary: a warning only, so exit code 0.
    let out = diagnose_cli(&gw).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("slow_replica") && text.contains(&label(&sims[1])),
        "{text}"
    );
    assert!(
        text.contains("evidence:") && text.contains("action:"),
        "{text}"
    );
}

#[tokio::test]
async fn kv_thrashing_is_critical_and_the_cli_says_so() {
    // A tiny KV cache (32 blocks of 16 tokens) under long generations: the
    // engine preempts sequences again and again.
    let mut cfg = SimConfig::engine("tiny", 1.0).unwrap();
    if let Some(p) = cfg.profile.as_mut() {
        p.num_blocks = 32;
    }
    cfg.output_tokens = 400;
    let sim = start_sim(cfg).await;
    let gw = start_routed(doctor_config(&[sim.url()]), 1).await;
    let load: Vec<_> = (0..12)
        .map(|_| {
            let url = format!("{}/v1/chat/completions", api(&gw));
            tokio::spawn(async move {
                let body = serde_json::json!({
                    "model": "sim-model", "max_tokens": 400, "stream": true,
                    "messages": [{"role": "user", "content": "x ".repeat(100)}],
                });
                let _ = client().post(url).json(&body).send().await?.text().await;
                Ok::<_, reqwest::Error>(())
            })
        })
        .collect();
    until_named(&gw, "kv_cache_thrashing", &label(&sim)).await;
    let out = diagnose_cli(&gw).await;
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{text}\n{err}");
    assert!(text.contains("CRITICAL  kv_cache_thrashing"), "{text}");
    assert!(text.contains("preemptions_per_second"), "{text}");
    // The clients leave (their streams are cancelled upstream): the engine
    // stops preempting and the finding clears.
    for l in load {
        l.abort();
    }
    until_healthy(&gw).await;
}

#[tokio::test]
async fn prefix_cache_misses_are_named_when_the_cache_is_too_small() {
    // 80 blocks of 16 tokens hold one of these ~900-token prompts at a time:
    // each evicts the one before, while routing still expects the prefix it
    // sent there to be cached.
    let mut cfg = SimConfig::engine("tiny", 20.0).unwrap();
    if let Some(p) = cfg.profile.as_mut() {
        p.num_blocks = 80;
    }
    let sim = start_sim(cfg).await;
    let gw = start_routed(doctor_config(&[sim.url()]), 1).await;
    let prompt = |i: usize| {
        let system: String = (0..450).map(|w| format!("p{i}w{w} ")).collect();
        serde_json::json!({
            "model": "sim-model", "max_tokens": 2,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "go"}],
        })
    };
    for round in 0..4 {
        for i in 0..3 {
            let (status, _, body) =
                post(&format!("{}/v1/chat/completions", api(&gw)), &prompt(i)).await;
            assert_eq!(status, 200, "round {round}: {body}");
        }
    }
    until_named(&gw, "prefix_cache_misses", &label(&sim)).await;
    // Once the same prompt repeats, the engine hits again: it clears.
    let repeat = async {
        loop {
            let (status, _, _) =
                post(&format!("{}/v1/chat/completions", api(&gw)), &prompt(0)).await;
            assert_eq!(status, 200);
        }
    };
    tokio::select! {
        () = repeat => {}
        () = until_healthy(&gw) => {}
    }
}

#[tokio::test]
async fn a_tier_held_at_its_limit_is_named() {
    use sha2::{Digest, Sha256};
    use sluice::config::{ApiKey, Secret, TierConfig};
    let sim = start_sim(fast_sim()).await;
    let mut c = doctor_config(&[sim.url()]);
    c.auth.keys = vec![ApiKey {
        name: "busy-client".into(),
        tier: "free".into(),
        sha256: Secret::new(hex::encode(Sha256::digest(b"sk-doctor"))),
    }];
    c.tiers.insert(
        "free".into(),
        TierConfig {
            requests_per_minute: Some(3),
            ..TierConfig::default()
        },
    );
    let gw = start_routed(c, 1).await;
    let mut limited = 0;
    for _ in 0..20 {
        let resp = client()
            .post(format!("{}/v1/chat/completions", api(&gw)))
            .bearer_auth("sk-doctor")
            .json(&chat_body(false))
            .send()
            .await
            .unwrap();
        limited += usize::from(resp.status() == 429);
    }
    assert_eq!(limited, 17);
    wait_until("tenant_at_limit named", Duration::from_secs(10), || async {
        let (_, body) = get_text(&format!("{}/admin/diagnose", admin(&gw))).await;
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["findings"].as_array().unwrap().iter().any(|f| {
            f["pathology"] == "tenant_at_limit"
                && f["tier"] == "free"
                && f["evidence"]["rejected_share"].as_f64() > Some(0.5)
        })
    })
    .await;
    // No key or key name in the finding: the tier only.
    let (_, body) = get_text(&format!("{}/admin/diagnose", admin(&gw))).await;
    assert!(body.contains("tenant_at_limit"), "{body}");
    assert!(
        !body.contains("sk-doctor") && !body.contains("busy-client"),
        "{body}"
    );
    // The client stops: once the window holds no refusals, it clears.
    until_healthy(&gw).await;
}

#[tokio::test]
async fn a_replica_failing_its_attempts_is_named_with_the_kinds() {
    let sims = [start_sim(fast_sim()).await, start_sim(fast_sim()).await];
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let mut c = doctor_config(&urls);
    c.routing.policy = sluice::config::PolicyKind::RoundRobin;
    let gw = start_routed(c, 2).await;
    // Replica 1 answers half of its requests with 500: of the ~30 it gets,
    // fewer than 5 failing (error_min) has a probability below 1e-4.
    let mut ctl = sims[1].state.control();
    ctl.faults = sluice::sim::faults::Faults::parse("error=500").unwrap();
    ctl.fault_rate = 0.5;
    sims[1].state.set_control(ctl);
    for _ in 0..60 {
        let (status, _, _) = post(
            &format!("{}/v1/chat/completions", api(&gw)),
            &chat_body(false),
        )
        .await;
        assert!(status == 200 || status == 500, "{status}");
    }
    let (a, b) = (label(&sims[0]), label(&sims[1]));
    until_named(&gw, "error_spike", &b).await;
    let (_, body) = get_text(&format!("{}/admin/diagnose", admin(&gw))).await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let spike = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["pathology"] == "error_spike")
        .unwrap();
    assert!(
        spike["evidence"]["failed_by_kind"]["upstream_status"].as_u64() > Some(0),
        "{spike}"
    );
    assert!(!body.contains(&format!("\"backend\":\"{a}\"")), "{body}");
    // No more failures: once the window holds none, it clears.
    until_healthy(&gw).await;
}

#[tokio::test]
async fn a_replica_whose_streams_stall_is_named() {
    let sims = [start_sim(fast_sim()).await, start_sim(fast_sim()).await];
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let mut c = doctor_config(&urls);
    c.routing.policy = sluice::config::PolicyKind::RoundRobin;
    c.telemetry.stall_threshold = Duration::from_millis(100);
    let gw = start_routed(c, 2).await;
    // Replica 1's streams go silent for 300 ms after their second token.
    let mut ctl = sims[1].state.control();
    ctl.faults = sluice::sim::faults::Faults::parse("stall=2:300ms").unwrap();
    sims[1].state.set_control(ctl);
    let sent: Vec<_> = (0..8)
        .map(|_| {
            let url = format!("{}/v1/chat/completions", api(&gw));
            tokio::spawn(async move { post(&url, &chat_body(true)).await.0 })
        })
        .collect();
    for s in sent {
        assert_eq!(s.await.unwrap(), 200);
    }
    let (a, b) = (label(&sims[0]), label(&sims[1]));
    until_named(&gw, "stalling_streams", &b).await;
    assert!(
        !findings(&gw)
            .await
            .iter()
            .any(|(p, backend, _)| p == "stalling_streams" && *backend == a)
    );
    let stalls = gateway_metric(
        &gw,
        &format!("sluice_backend_stream_stalls_total{{backend=\"{b}\"}}"),
    )
    .await;
    // One stall per stream it served (more only if the machine itself stalls).
    assert!(stalls >= 4.0, "{stalls}");
    // No more stalls: once the window holds none, it clears.
    until_healthy(&gw).await;
}

#[tokio::test]
async fn output_length_far_from_its_baseline_is_named_on_the_model() {
    let sim = start_sim(fast_sim()).await;
    let gw = start_routed(doctor_config(&[sim.url()]), 1).await;
    // The baseline: answers of 8 tokens.
    traffic(&gw, 25).await;
    assert!(findings(&gw).await.is_empty());
    // Then answers of 2 tokens, until the baseline is older than the window
    // (3 s) and the drift is named.
    let short = serde_json::json!({
        "model": "sim-model", "stream": true, "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hello there"}],
    });
    let named = async {
        loop {
            let (_, body) = get_text(&format!("{}/admin/diagnose", admin(&gw))).await;
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            if let Some(f) = v["findings"]
                .as_array()
                .unwrap()
                .iter()
                .find(|f| f["pathology"] == "output_length_drift")
            {
                return f.clone();
            }
            for _ in 0..5 {
                let (status, _, _) =
                    post(&format!("{}/v1/chat/completions", api(&gw)), &short).await;
                assert_eq!(status, 200);
            }
        }
    };
    let f = tokio::time::timeout(Duration::from_secs(20), named)
        .await
        .expect("output_length_drift named");
    assert_eq!(f["model"], "sim-model");
    // The baseline is mostly the 8-token answers (a few short ones may have
    // begun before the window), the window the 2-token ones.
    let base = f["evidence"]["baseline_mean_output_tokens"]
        .as_f64()
        .unwrap();
    let now = f["evidence"]["mean_output_tokens"].as_f64().unwrap();
    assert!(base > 5.0 && now < 4.0 && base >= 2.0 * now, "{f}");
    // The short answers stop: once the window holds too few, it clears.
    until_healthy(&gw).await;
}

#[tokio::test]
async fn time_to_first_token_far_above_its_baseline_is_named_on_the_model_and_clears() {
    let sim = start_sim(fast_sim()).await;
    let mut c = doctor_config(&[sim.url()]);
    // A 3 s window holds ~15 requests of 150 ms sent one after another.
    c.doctor.drift_min_requests = 5;
    let gw = start_routed(c, 1).await;
    // The finding, from one diagnosis.
    let drift = || async {
        let (_, body) = get_text(&format!("{}/admin/diagnose", admin(&gw))).await;
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["findings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["pathology"] == "latency_drift")
            .cloned()
    };
    // The baseline: first tokens after the 10 ms prefill.
    traffic(&gw, 25).await;
    assert!(findings(&gw).await.is_empty());
    // Then every first token 150 ms later, until the baseline is older than
    // the window (3 s) and the drift is named.
    let mut ctl = sim.state.control();
    ctl.faults = sluice::sim::faults::Faults::parse("first_token=150ms").unwrap();
    ctl.fault_rate = 1.0;
    sim.state.set_control(ctl.clone());
    let named = async {
        loop {
            if let Some(f) = drift().await {
                return f;
            }
            traffic(&gw, 3).await;
        }
    };
    let f = tokio::time::timeout(Duration::from_secs(30), named)
        .await
        .expect("latency_drift named");
    assert_eq!(f["model"], "sim-model", "{f}");
    let base = f["evidence"]["baseline_mean_ttft_seconds"]
        .as_f64()
        .unwrap();
    let now = f["evidence"]["mean_ttft_seconds"].as_f64().unwrap();
    // The window may still hold a few fast first tokens from before.
    assert!(base < 0.05 && now >= 2.0 * base && now > 0.05, "{f}");
    // First tokens fast again: once the window holds only those, it clears.
    ctl.fault_rate = 0.0;
    sim.state.set_control(ctl);
    let cleared = async {
        loop {
            if drift().await.is_none() {
                return;
            }
            traffic(&gw, 3).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), cleared)
        .await
        .expect("latency_drift cleared");
}

#[tokio::test]
async fn small_batches_with_nothing_waiting_are_underutilisation_and_load_clears_it() {
    // 20 ms per token, 200 tokens: a stream lasts about 4 s, longer than the
    // 3 s window, so 24 of them at once hold the batch at 24 for all of it.
    let sim = start_sim(SimConfig {
        token_delay: Duration::from_millis(20),
        output_tokens: 200,
        ..fast_sim()
    })
    .await;
    let mut c = doctor_config(&[sim.url()]);
    c.doctor.underused_batch = 8.0;
    // Its GPU, as the simulator's DCGM exporter shows it.
    c.backends[0].dcgm_url = Some(format!("{}/dcgm/metrics", sim.url()).parse().unwrap());
    let gw = start_routed(c, 1).await;
    let body = |n: u32| {
        serde_json::json!({
            "model": "sim-model", "max_tokens": n, "stream": true,
            "messages": [{"role": "user", "content": "hello"}],
        })
    };
    let url = format!("{}/v1/chat/completions", api(&gw));
    let resp = client().post(&url).json(&body(4)).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.text().await.unwrap().contains("[DONE]"));
    // One light request, then a quiet window: named, as information only.
    until_named(&gw, "underutilisation", &label(&sim)).await;
    let (_, text) = get_text(&format!("{}/admin/diagnose", admin(&gw))).await;
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["healthy"], true, "{v}");
    assert_eq!(v["worst"], "info", "{v}");
    let f = &v["findings"][0];
    assert_eq!(f["evidence"]["waiting_max"], 0.0, "{f}");
    assert!(f["evidence"]["batch_p50"].as_f64().unwrap() < 8.0, "{f}");
    assert!(
        f["evidence"]["gpu_utilization_mean"].as_f64().unwrap() < 0.5,
        "{f}"
    );
    assert!(
        gateway_metric(
            &gw,
            &format!(
                "sluice_backend_gpu_utilization_ratio{{backend=\"{}\"}}",
                label(&sim)
            )
        )
        .await
            < 0.5
    );
    assert!(
        f["action"].as_str().unwrap().contains("1 of 1 replicas"),
        "{f}"
    );
    // The report: information, exit code 0.
    let out = diagnose_cli(&gw).await;
    let report = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{report}");
    assert!(report.contains("info  underutilisation"), "{report}");

    // Load: 24 streams at once fill the batch; the finding clears.
    let load: Vec<_> = (0..24)
        .map(|_| {
            let req = client().post(&url).json(&body(200));
            tokio::spawn(async move { req.send().await?.text().await })
        })
        .collect();
    let backend = label(&sim);
    wait_until(
        "underutilisation cleared under load",
        Duration::from_secs(10),
        || {
            let (gw, backend) = (&gw, &backend);
            async move {
                !findings(gw)
                    .await
                    .iter()
                    .any(|(p, b, _)| p == "underutilisation" && b == backend)
            }
        },
    )
    .await;
    for l in load {
        l.abort();
    }
}

/// (pathology, model, cause) of the findings about a model.
async fn model_findings(gw: &Gateway) -> Vec<(String, String, String)> {
    let (_, body) = get_text(&format!("{}/admin/diagnose", admin(gw))).await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|f| {
            Some((
                f["pathology"].as_str()?.to_string(),
                f["model"].as_str()?.to_string(),
                f["cause"].as_str()?.to_string(),
            ))
        })
        .collect()
}

#[tokio::test]
async fn throughput_far_below_its_baseline_while_traffic_holds_is_named_on_the_model() {
    let sim = start_sim(SimConfig {
        output_tokens: 32,
        ..fast_sim()
    })
    .await;
    let mut c = doctor_config(&[sim.url()]);
    // The window (3 s) against the same span 4 s before it.
    c.doctor.baseline = Duration::from_secs(4);
    let gw = start_routed(c, 1).await;
    // Open-loop traffic: a request every 40 ms, whatever becomes of them.
    let url = format!("{}/v1/chat/completions", api(&gw));
    let load = tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_millis(40));
        loop {
            every.tick().await;
            let req = client().post(&url).json(&chat_body(true));
            tokio::spawn(async move { req.send().await?.text().await });
        }
    });
    // The baseline fills with answers of 32 tokens (100 requests: 4 s of
    // this traffic), and nothing is named.
    wait_until("a baseline of traffic", Duration::from_secs(15), || async {
        gateway_metric(&gw, "sluice_requests_total{model=\"sim-model\",endpoint=\"chat\",tier=\"\",status=\"200\",error_kind=\"\"}").await >= 100.0
    })
    .await;
    assert!(
        model_findings(&gw)
            .await
            .iter()
            .all(|(p, ..)| p != "throughput_drift")
    );
    // Then every request fails: the same traffic, no tokens.
    let mut ctl = sim.state.control();
    ctl.faults = sluice::sim::faults::Faults::parse("error=503").unwrap();
    ctl.fault_rate = 1.0;
    sim.state.set_control(ctl.clone());
    wait_until(
        "throughput_drift named on the model",
        Duration::from_secs(15),
        || async {
            model_findings(&gw).await.iter().any(|(p, m, cause)| {
                p == "throughput_drift"
                    && m == "sim-model"
                    && cause.contains("fewer requests complete")
            })
        },
    )
    .await;
    // Healthy again, and the baseline moves on: it clears.
    ctl.fault_rate = 0.0;
    sim.state.set_control(ctl);
    wait_until(
        "throughput_drift cleared",
        Duration::from_secs(20),
        || async {
            model_findings(&gw)
                .await
                .iter()
                .all(|(p, ..)| p != "throughput_drift")
        },
    )
    .await;
    load.abort();
}

#[tokio::test]
async fn prefix_cache_misses_from_scattering_routing_are_named_as_a_routing_problem() {
    // Two replicas that each hold one of these ~900-token prompts at a time,
    // and round robin over three prompts: each prompt goes to the other
    // replica than last time, so every replica sees every prompt and keeps
    // none. Routing expected nothing cached (no index): not the cache-size
    // finding, the routing one.
    let engine = || {
        let mut cfg = SimConfig::engine("tiny", 20.0).unwrap();
        if let Some(p) = cfg.profile.as_mut() {
            p.num_blocks = 80;
        }
        cfg
    };
    let sims = [start_sim(engine()).await, start_sim(engine()).await];
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let mut c = doctor_config(&urls);
    c.routing.policy = sluice::config::PolicyKind::RoundRobin;
    let gw = start_routed(c, 2).await;
    let prompt = |i: usize| {
        let system: String = (0..450).map(|w| format!("p{i}w{w} ")).collect();
        serde_json::json!({
            "model": "sim-model", "max_tokens": 2,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "go"}],
        })
    };
    for round in 0..10 {
        for i in 0..3 {
            let (status, _, body) =
                post(&format!("{}/v1/chat/completions", api(&gw)), &prompt(i)).await;
            assert_eq!(status, 200, "round {round}: {body}");
        }
    }
    // One diagnosis that names both replicas (the 3 s window soon slides
    // past the prompts, and the findings clear).
    let labels = [label(&sims[0]), label(&sims[1])];
    let both = async {
        // Asked every scrape interval (100 ms) until the deadline below.
        let mut every = tokio::time::interval(Duration::from_millis(100));
        loop {
            every.tick().await;
            let (_, body) = get_text(&format!("{}/admin/diagnose", admin(&gw))).await;
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            let found: Vec<serde_json::Value> = v["findings"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|f| f["pathology"] == "prefix_cache_misses")
                .cloned()
                .collect();
            if labels
                .iter()
                .all(|l| found.iter().any(|f| f["backend"] == l.as_str()))
            {
                return found;
            }
        }
    };
    let found = tokio::time::timeout(Duration::from_secs(10), both)
        .await
        .expect("prefix_cache_misses named on both replicas at once");
    assert_eq!(found.len(), 2, "{found:?}");
    for f in &found {
        assert!(
            f["cause"]
                .as_str()
                .unwrap()
                .starts_with("a routing problem"),
            "{f}"
        );
        assert!(f["action"].as_str().unwrap().contains("round_robin"), "{f}");
        // Over the window (its span depends on how fast this machine
        // served the prompts): at least 10 sent, most of them scattered.
        let ev = &f["evidence"];
        let sent = ev["requests_sent"].as_f64().unwrap();
        let elsewhere = ev["prefix_last_sent_elsewhere"].as_f64().unwrap();
        assert!(sent >= 10.0 && elsewhere >= 0.5 * sent, "{f}");
    }
    assert!(
        gateway_metric(
            &gw,
            &format!(
                "sluice_backend_prefix_elsewhere_total{{backend=\"{}\"}}",
                label(&sims[0])
            )
        )
        .await
            >= 10.0
    );
}

#[tokio::test]
async fn prompts_that_share_only_an_opening_are_not_counted_as_scattered() {
    // Under prefix_kv, prompts that begin alike (one 64-character block)
    // and then differ are prefixes of their own and go to their own homes:
    // not a routing problem, so nothing is counted as sent elsewhere. The
    // same prompts sent again under round robin are.
    let prompt = |i: usize| {
        let body: String = (0..300).map(|w| format!("d{i}w{w} ")).collect();
        serde_json::json!({
            "model": "sim-model", "max_tokens": 2,
            "messages": [{"role": "system", "content": format!(
                "You are a helpful assistant. Answer briefly and precisely. {body}")},
                         {"role": "user", "content": "go"}],
        })
    };
    let scattered = |gw: &Gateway, sims: &[SimHandle]| {
        let series: Vec<String> = sims
            .iter()
            .map(|s| {
                format!(
                    "sluice_backend_prefix_elsewhere_total{{backend=\"{}\"}}",
                    label(s)
                )
            })
            .collect();
        let admin = admin(gw);
        async move {
            let (_, text) = get_text(&format!("{admin}/metrics")).await;
            series
                .iter()
                .map(|s| metric(&text, s).expect("the series is exported"))
                .sum::<f64>()
        }
    };
    for policy in [
        sluice::config::PolicyKind::PrefixKv,
        sluice::config::PolicyKind::RoundRobin,
    ] {
        let sims = [start_sim(fast_sim()).await, start_sim(fast_sim()).await];
        let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
        let mut c = doctor_config(&urls);
        c.routing.policy = policy;
        let gw = start_routed(c, 2).await;
        for round in 0..2 {
            for i in 0..7 {
                let (status, _, body) =
                    post(&format!("{}/v1/chat/completions", api(&gw)), &prompt(i)).await;
                assert_eq!(status, 200, "round {round}: {body}");
            }
        }
        let n = scattered(&gw, &sims).await;
        match policy {
            sluice::config::PolicyKind::PrefixKv => assert_eq!(n, 0.0),
            // 14 requests alternating over 2 replicas, 7 prompts: each
            // prompt's second request goes to the other replica.
            _ => assert_eq!(n, 7.0),
        }
    }
}

/// The findings' JSON objects.
async fn finding_objects(gw: &Gateway) -> Vec<serde_json::Value> {
    let (status, body) = get_text(&format!("{}/admin/diagnose", admin(gw))).await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["findings"].as_array().unwrap().clone()
}

#[tokio::test]
async fn a_finding_whose_evidence_comes_and_goes_stays_named_since_it_began() {
    let sims = [start_sim(fast_sim()).await, start_sim(fast_sim()).await];
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let mut c = doctor_config(&urls);
    c.doctor.clear_after = Duration::from_secs(2);
    let gw = start_routed(c, 2).await;
    let a = label(&sims[0]);
    let queue = |on: bool| {
        let mut c = sims[0].state.control();
        c.waiting = on.then_some(30.0);
        sims[0].state.set_control(c);
    };
    let uneven = |gw: &Gateway| {
        let a = a.clone();
        let gw_admin = admin(gw);
        async move {
            let (_, body) = get_text(&format!("{gw_admin}/admin/diagnose")).await;
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            v["findings"]
                .as_array()
                .unwrap()
                .iter()
                .find(|f| f["pathology"] == "uneven_queues" && f["backend"] == a.as_str())
                .cloned()
        }
    };
    // Raised at the first evaluation that sees it, with since when.
    queue(true);
    wait_until("uneven queues named", Duration::from_secs(10), || async {
        uneven(&gw).await.is_some_and(|f| f["active"] == true)
    })
    .await;
    let first = uneven(&gw).await.unwrap();
    let since = first["since"].as_str().unwrap().to_string();
    assert!(since.ends_with('Z'), "{first}");
    assert!(first["for_seconds"].as_f64().is_some(), "{first}");
    // The queue drains: the finding stays, marked as not seen now, with the
    // same start.
    queue(false);
    wait_until(
        "evidence gone, finding held",
        Duration::from_secs(10),
        || async { uneven(&gw).await.is_some_and(|f| f["active"] == false) },
    )
    .await;
    let held = uneven(&gw).await.unwrap();
    assert_eq!(held["since"], since.as_str(), "{held}");
    assert!(held["gone_seconds"].as_f64().is_some(), "{held}");
    // It comes back within the hold: the same episode, the same start.
    queue(true);
    wait_until("seen again", Duration::from_secs(10), || async {
        uneven(&gw).await.is_some_and(|f| f["active"] == true)
    })
    .await;
    assert_eq!(uneven(&gw).await.unwrap()["since"], since.as_str());
    // Gone for longer than `clear_after`: cleared.
    queue(false);
    wait_until("cleared", Duration::from_secs(10), || async {
        uneven(&gw).await.is_none()
    })
    .await;
    assert!(finding_objects(&gw).await.is_empty());
}
