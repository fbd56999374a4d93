//! Micro-benchmarks of the per-event hot path, each beside its naive baseline:
//! reading a chunk (a stream's learned shape vs the fast scanner vs the serde
//! reader vs a full `serde_json::Value`)
//! and splitting a stream into events; and the metrics cost of one whole
//! streamed request (64 output events, then every histogram and counter at its end);
//! and the relay of a whole 256-token stream with the content quality signals as
//! shipped (tool calls only), with the opt-in refusal detector, and a tool-call
//! stream (the arguments read and judged).
//!
//!     cargo bench --bench hot_path

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use sluice::config::Config;
use sluice::request::RequestGuard;
use sluice::stream::event::{chunk_info, chunk_info_serde, classify};
use sluice::stream::shape::Shape;
use sluice::stream::sse::SseSplitter;
use sluice::telemetry::Telemetry;
use sluice::telemetry::metrics::Metrics;
use sluice::telemetry::tracecontext::TraceCtx;
use sluice::vocab::{Endpoint, FinishReason, Usage};
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

const CHUNK: &str = r#"{"id":"chatcmpl-9f1c2d3e4b5a6978","object":"chat.completion.chunk","created":1795299051,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":" gateway"},"logprobs":null,"finish_reason":null}]}"#;

fn naive_value(json: &[u8]) -> bool {
    // The obvious way: build the whole value, then look.
    let v: serde_json::Value = serde_json::from_slice(json).unwrap_or_default();
    v["choices"].as_array().is_some_and(|c| {
        c.iter().any(|c| {
            c["delta"]["content"]
                .as_str()
                .is_some_and(|s| !s.is_empty())
        })
    })
}

fn chunk_reading(c: &mut Criterion) {
    let mut g = c.benchmark_group("read_chunk");
    g.bench_function("scan (fast path)", |b| {
        b.iter(|| chunk_info(black_box(CHUNK.as_bytes())))
    });
    g.bench_function("serde reader (reference)", |b| {
        b.iter(|| chunk_info_serde(black_box(CHUNK.as_bytes())))
    });
    g.bench_function("serde_json::Value (naive)", |b| {
        b.iter(|| naive_value(black_box(CHUNK.as_bytes())))
    });
    let event = format!("data: {CHUNK}\n\n");
    g.bench_function("classify whole event", |b| {
        b.iter(|| classify(black_box(event.as_bytes())))
    });
    // The stream's learned shape (`stream/shape.rs`): learned from one
    // token, then another token of the same stream is matched.
    let mut shape = Shape::default();
    shape.classify(event.as_bytes());
    let next = event.replace("\" gateway\"", "\" router\"");
    assert!(shape.fits(next.as_bytes()).is_some());
    g.bench_function("classify whole event: the stream's learned shape", |b| {
        b.iter(|| shape.classify(black_box(next.as_bytes())))
    });
    g.finish();
}

fn splitting(c: &mut Criterion) {
    let events: Vec<Bytes> = (0..128)
        .map(|_| Bytes::from(format!("data: {CHUNK}\n\n")))
        .collect();
    let joined: Bytes = events
        .iter()
        .flat_map(|b| b.to_vec())
        .collect::<Vec<u8>>()
        .into();
    let mut g = c.benchmark_group("split_128_events");
    g.bench_function("one event per chunk", |b| {
        b.iter(|| {
            let mut s = SseSplitter::new(1 << 20);
            let mut n = 0;
            for e in &events {
                s.push(e.clone());
                while let Ok(Some(ev)) = s.next_event() {
                    n += ev.len();
                }
            }
            n
        })
    });
    g.bench_function("64-byte chunks (events straddle)", |b| {
        b.iter(|| {
            let mut s = SseSplitter::new(1 << 20);
            let mut n = 0;
            for piece in joined.chunks(64) {
                s.push(joined.slice_ref(piece));
                while let Ok(Some(ev)) = s.next_event() {
                    n += ev.len();
                }
            }
            n
        })
    });
    g.finish();
}

/// Metrics recording for one streamed request (its guard: the token clock, then the report): what `/metrics` costs per
/// request on the hot path (tracing and the access log are off here; the
/// end-to-end benchmark `benches/e2e/telemetry_overhead.py` measures them).
fn request_metrics(c: &mut Criterion) {
    let config = Config::default();
    let tele = Arc::new(Telemetry {
        metrics: Arc::new(Metrics::new(&config.telemetry.buckets)),
        traces: None,
        access_log: None,
        refusal: None,
    });
    let model: Arc<str> = Arc::from("meta-llama/Llama-3.1-8B-Instruct");
    let mut g = c.benchmark_group("metrics");
    g.bench_function("one request, 64 output events", |b| {
        b.iter(|| {
            let start = Instant::now();
            let mut done = RequestGuard::new(
                tele.clone(),
                Endpoint::Chat,
                start,
                String::new(),
                TraceCtx::from_headers(&http::HeaderMap::new()),
                Duration::from_secs(2),
            );
            done.set_model(model.clone());
            done.record.stream = true;
            done.record.upstream_sent = Some(start);
            done.record.first_sent = Some(start);
            done.record.status = 200;
            for _ in 0..64 {
                done.on_output(Instant::now());
            }
            done.record.usage = Some(Usage {
                prompt_tokens: 50,
                completion_tokens: 64,
                cached_tokens: Some(32),
            });
            done.record.finish_reason = Some(FinishReason::Length);
            drop(black_box(done));
        })
    });
    g.finish();
}

/// One chat stream through the relay, one event per chunk (a replica that
/// flushes every token: the most reads per token).
fn relay_stream(c: &mut Criterion) {
    let config = Config::default();
    let tele = Arc::new(Telemetry {
        metrics: Arc::new(Metrics::new(&config.telemetry.buckets)),
        traces: None,
        access_log: None,
        refusal: None,
    });
    let words = [
        "Sure", ",", " here", " is", " the", " gateway", "'s", " answer", ".", "\\n",
    ];
    let event = |delta: String| {
        Bytes::from(format!(
            "data: {{\"id\":\"chatcmpl-9f1c2d3e4b5a6978\",\"object\":\"chat.completion.chunk\",\"created\":1795299051,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
        ))
    };
    let end = Bytes::from_static(b"data: {\"id\":\"chatcmpl-9f1c2d3e4b5a6978\",\"object\":\"chat.completion.chunk\",\"created\":1795299051,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n");
    let mut text: Vec<Bytes> = (0..256)
        .map(|i| event(format!("{{\"content\":\"{}\"}}", words[i % words.len()])))
        .collect();
    text.push(end.clone());
    let mut tools: Vec<Bytes> = (0..256)
        .map(|i| {
            let part = if i == 0 {
                "{\\\"items\\\": ["
            } else if i == 255 {
                "0]}"
            } else {
                "1, "
            };
            event(format!(
                "{{\"tool_calls\":[{{\"index\":0,\"function\":{{\"arguments\":\"{part}\"}}}}]}}"
            ))
        })
        .collect();
    tools.push(end);
    let detector =
        sluice::telemetry::quality::Refusal::from_config(&sluice::config::RefusalConfig {
            enabled: true,
            ..Default::default()
        });
    let guard = || {
        let mut g = RequestGuard::new(
            tele.clone(),
            Endpoint::Chat,
            Instant::now(),
            String::new(),
            TraceCtx::from_headers(&http::HeaderMap::new()),
            Duration::from_secs(2),
        );
        g.record.stream = true;
        g
    };
    // What is measured is what is counted: one valid call, one refusal-free text.
    let mut check = guard();
    sluice::stream::relay_for_bench(&tools, &mut check, None);
    assert_eq!(
        check
            .record
            .verdict
            .map(|v| (v.tool_calls, v.invalid_tool_calls)),
        Some((1, 0))
    );
    let mut check = guard();
    sluice::stream::relay_for_bench(&text, &mut check, detector.clone());
    assert_eq!(check.record.verdict.map(|v| v.refusal), Some(false));
    // Every byte reached the client (no event was refused on the way).
    let total = |s: &[Bytes]| s.iter().map(Bytes::len).sum::<usize>();
    assert_eq!(
        sluice::stream::relay_for_bench(&text, &mut guard(), None),
        total(&text)
    );
    assert_eq!(
        sluice::stream::relay_for_bench(&tools, &mut guard(), None),
        total(&tools)
    );
    let mut g = c.benchmark_group("relay_256_token_stream");
    g.bench_function("text, quality as shipped (refusal detector off)", |b| {
        b.iter(|| black_box(sluice::stream::relay_for_bench(&text, &mut guard(), None)))
    });
    g.bench_function("text, refusal detector on (first 200 characters)", |b| {
        b.iter(|| {
            black_box(sluice::stream::relay_for_bench(
                &text,
                &mut guard(),
                detector.clone(),
            ))
        })
    });
    g.bench_function("tool call in 256 pieces (arguments judged)", |b| {
        b.iter(|| black_box(sluice::stream::relay_for_bench(&tools, &mut guard(), None)))
    });
    g.finish();
}

criterion_group!(
    benches,
    chunk_reading,
    splitting,
    request_metrics,
    relay_stream
);
criterion_main!(benches);
