//! `sluice bench` and `sluice demo`, as binaries, against the simulator.

use std::time::Duration;

use sluice::sim::SimConfig;
use tokio::process::Command;

use crate::common::*;

const BIN: &str = env!("CARGO_BIN_EXE_sluice");

/// `sluice bench ARGS --json -`, the real binary: its report.
pub async fn bench_json(args: &[&str]) -> serde_json::Value {
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        Command::new(BIN)
            .arg("bench")
            .args(args)
            .args(["--json", "-", "--quiet"])
            .output(),
    )
    .await
    .expect("bench did not stop on its own")
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn sim_counter(text: &str, name: &str) -> f64 {
    metric(text, &format!("{name}{{model_name=\"sim-model\"}}")).unwrap_or_default()
}

#[tokio::test]
async fn bench_counts_agree_with_the_simulators_own_metrics() {
    let sim = start_sim(SimConfig::engine("tiny", 4.0).unwrap()).await;
    let report = bench_json(&[
        "--url",
        &sim.url(),
        "--requests",
        "40",
        "--concurrency",
        "8",
        "--workload",
        "random",
        "--prompt-tokens",
        "100",
        "--max-tokens",
        "20",
    ])
    .await;
    let (_, text) = get_text(&format!("{}/metrics", sim.url())).await;
    assert_eq!(report["requests"], 40);
    assert_eq!(report["ok"], 40, "{report}");
    let finished = ["stop", "length"]
        .iter()
        .map(|r| sim.state.metrics.finished_count(r))
        .sum::<u64>();
    assert_eq!(finished, 40);
    assert_eq!(
        report["output_tokens"].as_f64(),
        Some(sim_counter(&text, "vllm:generation_tokens_total"))
    );
    assert_eq!(
        report["prompt_tokens"].as_f64(),
        Some(sim_counter(&text, "vllm:prompt_tokens_total"))
    );
    assert!(report["ttft_seconds"]["p50"].as_f64().unwrap() > 0.0);
    assert_eq!(report["ttft_seconds"]["count"], 40);
}

#[tokio::test]
async fn open_loop_shared_prefix_load_hits_the_prefix_cache() {
    let sim = start_sim(SimConfig::engine("h100-llama3-8b", 8.0).unwrap()).await;
    let report = bench_json(&[
        "--url",
        &sim.url(),
        "--requests",
        "30",
        "--rate",
        "50",
        "--concurrency",
        "64",
        "--workload",
        "shared-prefix",
        "--prefixes",
        "2",
        "--prefix-tokens",
        "1500",
        "--max-tokens",
        "8",
    ])
    .await;
    assert_eq!(report["ok"], 30, "{report}");
    assert!(report["arrival"].as_str().unwrap().starts_with("poisson"));
    let (_, text) = get_text(&format!("{}/metrics", sim.url())).await;
    let hits = sim_counter(&text, "vllm:prefix_cache_hits_total");
    let queries = sim_counter(&text, "vllm:prefix_cache_queries_total");
    // 2 prefixes over 30 requests: almost every prefix block is a hit.
    assert!(hits / queries > 0.8, "hit rate {}", hits / queries);
}

/// `sluice demo ARGS` on ports of its own, run to its end (at most a minute).
async fn demo(args: &[&str]) -> std::process::Output {
    tokio::time::timeout(
        Duration::from_secs(60),
        Command::new(BIN)
            .arg("demo")
            .args(args)
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .output(),
    )
    .await
    .expect("demo did not end on its own")
    .unwrap()
}

#[tokio::test]
async fn demo_runs_briefly_serves_requests_and_exits_cleanly() {
    let out = demo(&["--duration", "3s"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("/v1") && stdout.contains("/metrics"),
        "{stdout}"
    );
    // "N requests (N ok)" from the client side, with N > 0 and no errors.
    let line = stdout
        .lines()
        .find(|l| l.contains(" requests ("))
        .expect("no final report");
    let n: u64 = line.split_whitespace().next().unwrap().parse().unwrap();
    assert!(n > 0, "{line}");
    assert!(line.contains(&format!("({n} ok)")), "{stdout}");
    // The live summary names the routing decisions (prefix affinity, here).
    assert!(
        stdout
            .lines()
            .any(|l| l.contains("routed: ") && l.contains("affinity ")),
        "{stdout}"
    );
}

/// Run a demo scenario until a line of its live output satisfies `named`
/// (then it is stopped) or it ends; its output so far. The demo runs long
/// enough for a loaded machine to get there: the test waits for the
/// diagnosis, not for a fixed duration.
async fn demo_until(scenario: &str, named: impl Fn(&str, &str) -> bool) -> String {
    use tokio::io::AsyncBufReadExt;
    let mut child = Command::new(BIN)
        .args(["demo", "--scenario", scenario, "--duration", "60s"])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = String::new();
    let found = tokio::time::timeout(Duration::from_secs(90), async {
        while let Ok(Some(line)) = lines.next_line().await {
            seen.push_str(&line);
            seen.push('\n');
            if named(&seen, &line) {
                return true;
            }
        }
        false
    })
    .await
    .unwrap_or(false);
    let _ = child.kill().await;
    assert!(found, "not named:\n{seen}");
    seen
}

#[tokio::test]
async fn a_demo_scenario_shows_its_pathology_named() {
    // The third replica (the slow one) is the one named, in the live summary.
    let stdout = demo_until("slow-replica", |seen, line| {
        let third = seen
            .lines()
            .filter(|l| l.contains(" served "))
            .nth(2)
            .and_then(|l| l.split_whitespace().next());
        third.is_some_and(|t| {
            line.contains("diagnosis: ") && line.contains(&format!("slow_replica on {t}"))
        })
    })
    .await;
    assert!(stdout.contains("Scenario: the third replica"), "{stdout}");
}

#[tokio::test]
async fn the_cpu_swapping_scenario_is_named() {
    let stdout = demo_until("cpu-swapping", |_, line| {
        line.contains("diagnosis: ") && line.contains("cpu_swapping on 127.0.0.1:")
    })
    .await;
    assert!(
        stdout.contains("Scenario: KV caches far too small, with CPU swap space"),
        "{stdout}"
    );
}

#[tokio::test]
async fn a_salt_opens_every_prompt_and_agentic_refuses_one() {
    let sim = start_sim(SimConfig::engine("tiny", 10.0).unwrap()).await;
    let url = sim.url().to_string();
    let report = bench_json(&[
        "--url",
        &url,
        "--requests",
        "2",
        "--workload",
        "fixed",
        "--max-tokens",
        "2",
        "--salt",
        "g7-",
    ])
    .await;
    assert_eq!(report["ok"], 2, "{report}");
    let (_, text) = get_text(&format!("{url}/sim/last_request")).await;
    let last: serde_json::Value = serde_json::from_str(&text).unwrap();
    let prompt = last["body"]["messages"][0]["content"].as_str().unwrap();
    assert!(prompt.starts_with("g7-#"), "{prompt}");
    let out = Command::new(BIN)
        .args([
            "bench",
            "--url",
            &url,
            "--workload",
            "agentic",
            "--salt",
            "x",
        ])
        .args(["--requests", "1", "--quiet"])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--salt"), "{err}");
}
