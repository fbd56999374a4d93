//! Micro-benchmarks of the per-event hot path, each beside its naive baseline:
//! reading a chunk (fast scanner vs the serde reader vs a full `serde_json::Value`)
//! and splitting a stream into events.
//!
//!     cargo bench --bench hot_path

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use sluice::stream::event::{chunk_info, chunk_info_serde, classify};
use sluice::stream::sse::SseSplitter;
use std::hint::black_box;

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

criterion_group!(benches, chunk_reading, splitting);
criterion_main!(benches);
