//! The simulator's engine model, observed through its HTTP API only.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use sluice::sim::{CacheAt, Dialect, SimConfig};

use crate::common::*;

/// One streamed chat request straight to a replica: (TTFT, largest gap, usage).
pub(crate) async fn stream_chat(
    base: &str,
    content: &str,
    max_tokens: u32,
) -> (Duration, Duration, serde_json::Value) {
    let body = serde_json::json!({
        "model": "sim-model",
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": content}],
    });
    let start = Instant::now();
    let resp = client()
        .post(format!("{base}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let (mut buf, mut ttft, mut last, mut max_gap, mut usage) = (
        String::new(),
        None,
        None::<Instant>,
        Duration::ZERO,
        serde_json::Value::Null,
    );
    while let Some(chunk) = stream.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        while let Some(end) = buf.find("\n\n") {
            let ev: String = buf.drain(..end + 2).collect();
            let Some(data) = ev.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(data).unwrap();
            if v["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|c| !c.is_empty())
            {
                let now = Instant::now();
                ttft.get_or_insert(now - start);
                if let Some(prev) = last {
                    max_gap = max_gap.max(now - prev);
                }
                last = Some(now);
            }
            if !v["usage"].is_null() {
                usage = v["usage"].clone();
            }
        }
    }
    (ttft.expect("no token"), max_gap, usage)
}

async fn sim_metrics(base: &str) -> String {
    get_text(&format!("{base}/metrics")).await.1
}

fn m(text: &str, series: &str) -> f64 {
    metric(text, series).unwrap_or_else(|| panic!("no {series} in:\n{text}"))
}

const MODEL: &str = "model_name=\"sim-model\"";

#[tokio::test]
async fn a_repeated_prefix_skips_its_prefill() {
    let sim = start_sim(SimConfig::engine("h100-llama3-8b", 1.0).unwrap()).await;
    let base = sim.url();
    // ~3,000 tokens of shared document: ~150 ms of prefill on this profile.
    let doc = "The gateway streams tokens and measures them. ".repeat(260);
    let (cold, _, usage) = stream_chat(&base, &format!("{doc}\nQuestion one?"), 4).await;
    let (warm, _, _) = stream_chat(&base, &format!("{doc}\nQuestion two?"), 4).await;
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 2500);
    assert!(
        warm * 3 < cold,
        "cached prefix must cut TTFT: cold {cold:?}, warm {warm:?}"
    );
    let text = sim_metrics(&base).await;
    let hits = m(&text, &format!("vllm:prefix_cache_hits_total{{{MODEL}}}"));
    let queries = m(
        &text,
        &format!("vllm:prefix_cache_queries_total{{{MODEL}}}"),
    );
    assert!(hits > 2500.0, "hits {hits}");
    assert!(
        queries > hits * 1.9,
        "two prompts queried, one hit: {queries} vs {hits}"
    );
}

/// Two requests for the same prompt sent together, to an engine slowed so
/// that its prefill takes three steps of ~0.5 s: cached once computed (the
/// default, SGLang's way), the second finds only the chunks computed before
/// it is admitted; cached once scheduled (`--cache-at schedule`, vLLM V1's
/// way), it also shares the chunk being computed beside it.
#[tokio::test]
async fn requests_for_a_prompt_being_prefilled_share_it_when_blocks_are_cached_at_schedule() {
    let doc = "Every replica reports its queue and its cache. ".repeat(52);
    let mut found = Vec::new();
    for cache_at in [CacheAt::Compute, CacheAt::Schedule] {
        let mut cfg = SimConfig::engine("tiny", 0.01).unwrap();
        let profile = cfg.profile.as_mut().unwrap();
        profile.max_num_batched_tokens = 256;
        profile.cache_at = cache_at;
        let sim = start_sim(cfg).await;
        let base = sim.url();
        let ((_, _, a), (_, _, b)) =
            tokio::join!(stream_chat(&base, &doc, 2), stream_chat(&base, &doc, 2));
        let prompt = a["prompt_tokens"].as_u64().unwrap();
        assert!((600..700).contains(&prompt), "{prompt} prompt tokens");
        let cached = |u: &serde_json::Value| {
            u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        };
        // The first admitted finds nothing cached.
        assert_eq!(cached(&a).min(cached(&b)), 0, "{cache_at:?}: {a} {b}");
        found.push(cached(&a).max(cached(&b)));
    }
    // Two chunks of 256 once computed; all but the last block once scheduled.
    assert_eq!(found[0], 512, "cached once computed");
    assert!(found[1] > found[0] + 64, "cached once scheduled: {found:?}");
}

#[tokio::test]
async fn a_prompt_longer_than_the_whole_kv_cache_is_refused_in_the_protocols_shape() {
    // 32 blocks of 16 tokens: 512 tokens the cache can ever hold.
    let mut cfg = SimConfig::engine("tiny", 10.0).unwrap();
    if let Some(p) = cfg.profile.as_mut() {
        p.num_blocks = 32;
    }
    let sim = start_sim(cfg).await;
    let base = sim.url();
    let ask = |content: String, stream: bool| {
        let url = format!("{base}/v1/chat/completions");
        async move {
            let body = serde_json::json!({
                "model": "sim-model", "max_tokens": 4, "stream": stream,
                "messages": [{"role": "user", "content": content}],
            });
            let resp = client().post(url).json(&body).send().await.unwrap();
            (resp.status(), resp.text().await.unwrap())
        }
    };
    for stream in [false, true] {
        let (status, body) = ask("word ".repeat(800), stream).await;
        assert_eq!(status, 400, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        // vLLM's flat error body.
        assert_eq!(
            (&v["object"], &v["code"]),
            (&"error".into(), &400.into()),
            "{body}"
        );
        let message = v["message"].as_str().unwrap();
        assert!(message.contains("(512 tokens)"), "{message}");
    }
    // One that fits is served (before: the engine dropped the long one
    // with an empty answer, counted nowhere but in its own metrics).
    let (status, body) = ask("word ".repeat(100), false).await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 4, "{body}");
}

#[tokio::test]
async fn a_full_kv_cache_queues_requests_and_preempts() {
    // tiny: 256 blocks of 16 tokens, 16 sequences. 16 requests of ~400 prompt
    // tokens that each grow by 300 tokens need ~700 blocks.
    let sim = start_sim(SimConfig {
        output_tokens: 300,
        ..SimConfig::engine("tiny", 1.0).unwrap()
    })
    .await;
    let base = sim.url();
    let mut reqs = Vec::new();
    for i in 0..16 {
        let base = base.clone();
        reqs.push(tokio::spawn(async move {
            let content = format!("request {i} ").repeat(120);
            stream_chat(&base, &content, 300).await
        }));
    }
    let mut max_waiting: f64 = 0.0;
    let mut max_usage: f64 = 0.0;
    // Sample the replica's gauges until every request has finished.
    let mut sample = tokio::time::interval(Duration::from_millis(20));
    while reqs.iter().any(|r| !r.is_finished()) {
        sample.tick().await;
        let text = sim_metrics(&base).await;
        max_waiting = max_waiting.max(m(&text, &format!("vllm:num_requests_waiting{{{MODEL}}}")));
        max_usage = max_usage.max(m(&text, &format!("vllm:kv_cache_usage_perc{{{MODEL}}}")));
    }
    for r in reqs {
        let (_, _, usage) = r.await.unwrap();
        assert_eq!(usage["completion_tokens"], 300, "every request completes");
    }
    let text = sim_metrics(&base).await;
    assert!(
        max_waiting >= 1.0,
        "requests must queue (max waiting {max_waiting})"
    );
    assert!(
        max_usage > 0.9,
        "the cache must fill (max usage {max_usage})"
    );
    assert!(m(&text, &format!("vllm:num_preemptions_total{{{MODEL}}}")) >= 1.0);
    assert_eq!(
        m(&text, &format!("vllm:num_requests_running{{{MODEL}}}")),
        0.0
    );
    assert_eq!(
        m(&text, &format!("vllm:kv_cache_usage_perc{{{MODEL}}}")),
        0.0
    );
}

#[tokio::test]
async fn metrics_agree_with_what_was_served() {
    let sim = start_sim(SimConfig::engine("tiny", 4.0).unwrap()).await;
    let base = sim.url();
    let (mut prompt, mut completion) = (0, 0);
    for i in 0..5 {
        let (_, _, usage) = stream_chat(&base, &format!("hello number {i}"), 10 + i).await;
        prompt += usage["prompt_tokens"].as_u64().unwrap();
        completion += usage["completion_tokens"].as_u64().unwrap();
    }
    let text = sim_metrics(&base).await;
    assert_eq!(
        m(
            &text,
            &format!("vllm:request_success_total{{{MODEL},finished_reason=\"length\"}}")
        ),
        5.0
    );
    assert_eq!(
        m(&text, &format!("vllm:generation_tokens_total{{{MODEL}}}")),
        completion as f64
    );
    assert_eq!(
        m(&text, &format!("vllm:prompt_tokens_total{{{MODEL}}}")),
        prompt as f64
    );
    assert_eq!(
        m(
            &text,
            &format!("vllm:time_to_first_token_seconds_count{{{MODEL}}}")
        ),
        5.0
    );
    assert_eq!(
        m(
            &text,
            &format!("vllm:inter_token_latency_seconds_count{{{MODEL}}}")
        ),
        (completion - 5) as f64
    );
    assert!(text.contains("vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"256\""));
}

#[tokio::test]
async fn each_fault_does_what_it_says() {
    let sim = start_sim(SimConfig::engine("tiny", 4.0).unwrap()).await;
    let url = format!("{}/v1/chat/completions", sim.url());
    let body = chat_body(true);
    let send = |fault: &'static str| {
        let (url, body) = (url.clone(), body.clone());
        async move {
            client()
                .post(&url)
                .header("x-sim-fault", fault)
                .json(&body)
                .send()
                .await
                .unwrap()
        }
    };

    let r = send("error=503").await;
    assert_eq!(r.status(), 503);

    let start = Instant::now();
    let text = send("first_token=800ms").await.text().await.unwrap();
    assert!(start.elapsed() >= Duration::from_millis(800));
    assert!(text.ends_with("data: [DONE]\n\n"));

    let mut cfg_body = chat_body(true);
    cfg_body["max_tokens"] = 6.into();
    let r = client()
        .post(&url)
        .header("x-sim-fault", "stall=3:1s")
        .json(&cfg_body)
        .send()
        .await
        .unwrap();
    let start = Instant::now();
    let text = r.text().await.unwrap();
    assert!(start.elapsed() >= Duration::from_secs(1), "stalled for 1 s");
    assert!(text.ends_with("data: [DONE]\n\n"));

    let r = send("drop=2").await;
    assert!(r.text().await.is_err(), "the connection is cut mid-body");

    let text = send("malformed=1").await.text().await.unwrap();
    assert!(text.contains("data: {\"choices\": [oops"));

    let text = send("error_event=1").await.text().await.unwrap();
    assert!(text.contains("simulated engine failure"));
    assert!(text.ends_with("data: [DONE]\n\n"));
}

#[tokio::test]
async fn dialects_use_each_engines_names() {
    for (dialect, names) in [
        (
            Dialect::Sglang,
            &[
                "sglang:num_running_reqs",
                "sglang:num_queue_reqs",
                "sglang:token_usage",
                "sglang:cache_hit_rate",
            ][..],
        ),
        (
            Dialect::Llamacpp,
            &[
                "llamacpp:requests_processing",
                "llamacpp:requests_deferred",
                "llamacpp:kv_cache_usage_ratio",
            ][..],
        ),
        (
            Dialect::Tgi,
            &[
                "tgi_queue_size",
                "tgi_batch_current_size",
                "tgi_request_count",
            ][..],
        ),
    ] {
        let sim = start_sim(SimConfig {
            dialect,
            ..SimConfig::engine("tiny", 4.0).unwrap()
        })
        .await;
        let text = sim_metrics(&sim.url()).await;
        for n in names {
            assert!(text.contains(n), "{dialect:?}: no {n}");
        }
        assert!(!text.contains("vllm:"), "{dialect:?} must not speak vLLM");
    }
}

/// `GET /dcgm/metrics`: (family -> values of its series), checking the
/// exposition's shape on the way.
async fn dcgm(sim: &sluice::sim::SimHandle) -> std::collections::HashMap<String, Vec<f64>> {
    let (status, text) = get_text(&format!("{}/dcgm/metrics", sim.url())).await;
    assert_eq!(status, 200);
    let mut out: std::collections::HashMap<String, Vec<f64>> = Default::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (series, value) = line.rsplit_once(' ').unwrap();
        let (name, labels) = series.split_once('{').unwrap();
        for l in [
            "gpu=\"",
            "UUID=\"GPU-",
            "device=\"nvidia",
            "modelName=\"NVIDIA ",
            "Hostname=\"",
        ] {
            assert!(labels.contains(l), "{line}");
        }
        assert!(text.contains(&format!("# TYPE {name} gauge\n")), "{text}");
        assert!(text.contains(&format!("# HELP {name} ")), "{text}");
        out.entry(name.to_string())
            .or_default()
            .push(value.parse().unwrap());
    }
    out
}

#[tokio::test]
async fn dcgm_exporter_shows_utilisation_and_memory() {
    let mut cfg = SimConfig::engine("tiny", 1.0).unwrap();
    cfg.output_tokens = 2000;
    let sim = start_sim(cfg).await;
    let idle = dcgm(&sim).await;
    assert_eq!(idle["DCGM_FI_DEV_GPU_UTIL"], vec![0.0]);
    // An L4's 23,034 MiB, of which the fixed part is used while idle.
    let (used, free) = (
        idle["DCGM_FI_DEV_FB_USED"][0],
        idle["DCGM_FI_DEV_FB_FREE"][0],
    );
    assert_eq!(used + free, 23_034.0);
    let load: Vec<_> = (0..8)
        .map(|i| {
            let url = sim.url();
            tokio::spawn(async move {
                stream_chat(&url, &format!("question {i} {}", "word ".repeat(200)), 1500).await
            })
        })
        .collect();
    wait_until(
        "busy and using KV memory",
        Duration::from_secs(10),
        || async {
            let m = dcgm(&sim).await;
            m["DCGM_FI_DEV_GPU_UTIL"][0] > 0.0 && m["DCGM_FI_DEV_FB_USED"][0] > used
        },
    )
    .await;
    for l in load {
        l.abort();
    }
    // Idle again: the last second holds no step.
    wait_until("idle again", Duration::from_secs(10), || async {
        dcgm(&sim).await["DCGM_FI_DEV_GPU_UTIL"][0] == 0.0
    })
    .await;
}
