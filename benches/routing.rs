#![expect(clippy::expect_used, reason = "a benchmark's setup may panic")]
//! Routing decision cost: reading the prompt into prefix hashes, and picking a
//! replica with `prefix_kv` (warm per-replica indexes, 8 replicas; the views
//! of the replicas taken for each decision, as the proxy does), beside the
//! naive baseline `round_robin`, at prompt sizes from 1 KB to 200 KB; and the
//! per-replica prefix index with prompts it has not seen (a full index of
//! 262,144 blocks: each prompt's lookup and insert reach lines not cached),
//! beside the two generations of hash sets it replaced.
//!
//!     cargo bench --bench routing

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use sluice::api::inbound::{PrefixParams, inspect};
use sluice::api::proxy::view;
use sluice::config::{BackendConfig, Config, PrefixKvConfig, UpstreamConfig};
use sluice::routing::{
    Affinity, PrefixIndex, PrefixKv, ReplicaView, RoundRobin, RouteCtx, RoutingPolicy,
    longest_prefix,
};
use sluice::telemetry::metrics::Metrics;
use sluice::upstream::pool::Replica;
use sluice::upstream::signals::LoadSample;
use sluice::vocab::{Endpoint, EngineKind};

fn replicas(n: usize) -> Vec<Arc<Replica>> {
    let m = Metrics::new(&Config::default().telemetry.buckets);
    (0..n)
        .map(|i| {
            let url = format!("http://10.0.0.{i}:8000").parse().expect("url");
            let r = Replica::from_config(
                &BackendConfig::from_url(url),
                None,
                &UpstreamConfig::default(),
                &m,
            );
            r.set_load(LoadSample {
                kv_usage: Some(0.3),
                waiting: Some(1.0),
                running: Some(8.0),
                block_size: Some(16),
                num_blocks: Some(30_000),
                ..LoadSample::empty(EngineKind::Vllm, Instant::now() + Duration::from_secs(3600))
            });
            Arc::new(r)
        })
        .collect()
}

/// A chat body whose system prompt is `line` repeated to `kb` KB.
fn chat_body(line: &str, kb: usize, question: &str) -> Bytes {
    let doc: String = line.chars().cycle().take(kb * 1024).collect();
    let v = serde_json::json!({
        "model": "m",
        "stream": true,
        "messages": [
            {"role": "system", "content": doc},
            {"role": "user", "content": question},
        ],
    });
    Bytes::from(serde_json::to_vec(&v).expect("json"))
}

fn body(kb: usize) -> Bytes {
    chat_body(
        "The gateway routes each prompt to the replica that holds its prefix. ",
        kb,
        "What does it do?",
    )
}

/// A prompt as agents send it: lines of code and prose, so JSON escapes
/// (`\n`, `\"`) all through its strings.
fn body_with_lines(kb: usize) -> Bytes {
    chat_body(
        "    let x = route(\"prefix\");\n// The gateway routes each prompt.\n",
        kb,
        "What does it do?\nExplain.",
    )
}

fn decision(c: &mut Criterion) {
    let params = PrefixParams {
        block_chars: 64,
        max_blocks: 4096,
    };
    let reps = replicas(8);
    let prefix_kv = PrefixKv::new(
        PrefixKvConfig::default(),
        Some(Duration::from_secs(5)),
        Affinity::new(
            1 << 18,
            (100_000, Duration::from_secs(1800)),
            (100_000, Duration::from_secs(1800)),
        ),
    );
    let views =
        |reps: &[Arc<Replica>]| -> Vec<ReplicaView> { reps.iter().map(|r| view(r)).collect() };
    let rr = RoundRobin::default();
    // Warm the indexes: 500 other prefixes spread over the replicas.
    for k in 0..500u64 {
        let h: Vec<u64> = (0..64).map(|i| k * 1000 + i).collect();
        let ctx = RouteCtx {
            model: "m",
            hashes: &h,
            session: None,
            prompt_tokens: 4096,
            tail_tokens: 0,
            decode_leg: false,
            session_placement: None,
            alone: false,
            shared_home: None,
            now: Instant::now(),
        };
        prefix_kv.pick(&ctx, &views(&reps));
    }
    let mut g = c.benchmark_group("routing_decision");
    for kb in [1usize, 10, 50, 64, 200] {
        let b = body(kb);
        g.bench_with_input(
            BenchmarkId::new("read prompt + hash (inspect)", kb),
            &b,
            |bench, b| bench.iter(|| inspect(Endpoint::Chat, black_box(b.clone()), Some(params))),
        );
        if matches!(kb, 1 | 10) {
            let lines = body_with_lines(kb);
            g.bench_with_input(
                BenchmarkId::new("read prompt + hash (inspect), lines with escapes", kb),
                &lines,
                |bench, b| {
                    bench.iter(|| inspect(Endpoint::Chat, black_box(b.clone()), Some(params)))
                },
            );
        }
        let hashes = inspect(Endpoint::Chat, b.clone(), Some(params))
            .map(|i| i.prefix)
            .unwrap_or_default();
        g.bench_with_input(
            BenchmarkId::new("prefix_kv pick, 8 replicas", kb),
            &hashes,
            |bench, h| {
                bench.iter(|| {
                    let ctx = RouteCtx {
                        model: "m",
                        hashes: black_box(h),
                        session: None,
                        prompt_tokens: 4096,
                        tail_tokens: 0,
                        decode_leg: false,
                        session_placement: None,
                        alone: false,
                        shared_home: None,
                        now: Instant::now(),
                    };
                    prefix_kv.pick(&ctx, &views(&reps))
                })
            },
        );
        g.bench_with_input(
            BenchmarkId::new("round_robin pick (baseline)", kb),
            &hashes,
            |bench, h| {
                bench.iter(|| {
                    let ctx = RouteCtx {
                        model: "m",
                        hashes: black_box(h),
                        session: None,
                        prompt_tokens: 4096,
                        tail_tokens: 0,
                        decode_leg: false,
                        session_placement: None,
                        alone: false,
                        shared_home: None,
                        now: Instant::now(),
                    };
                    rr.pick(&ctx, &views(&reps))
                })
            },
        );
    }
    g.finish();
}

/// The baseline: the index as it was before the set-associative table
/// (`src/routing/index.rs` at d6004c1~1): two generations of hash sets of
/// up to half the capacity each; a full one becomes the previous and the
/// previous is dropped.
struct Generations {
    current: HashSet<u64, BuildHasherDefault<Identity>>,
    previous: HashSet<u64, BuildHasherDefault<Identity>>,
    capacity: usize,
}

#[derive(Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("only u64 keys")
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

impl Generations {
    fn new(capacity: usize) -> Self {
        Self {
            current: HashSet::default(),
            previous: HashSet::default(),
            capacity,
        }
    }

    fn contains(&self, h: u64) -> bool {
        self.current.contains(&h) || self.previous.contains(&h)
    }

    fn longest_match(&self, hashes: &[u64]) -> usize {
        longest_prefix(hashes.len(), |i| self.contains(hashes[i]))
    }

    fn insert(&mut self, hashes: &[u64]) {
        for (i, &h) in hashes.iter().enumerate() {
            if self.current.contains(&h) {
                continue;
            }
            if self.current.len() * 2 >= self.capacity {
                self.previous = std::mem::take(&mut self.current);
                if i * 4 <= self.capacity {
                    self.current.extend(hashes[..i].iter().copied());
                }
            }
            self.current.insert(h);
        }
    }
}

/// New prompts of four blocks (256 characters at the default 64 a block)
/// into a full index of 2^18 blocks: a lookup, then the insert, as a decision
/// that picks this replica does.
fn index(c: &mut Criterion) {
    const CAPACITY: usize = 1 << 18;
    let hash = |n: u64| xxhash_rust::xxh3::xxh3_64(&n.to_le_bytes());
    let table = PrefixIndex::new(CAPACITY);
    let mut generations = Generations::new(CAPACITY);
    let mut n = 0u64;
    // Full: three times the capacity inserted, four blocks at a time.
    while n < 3 * CAPACITY as u64 {
        let blocks = [hash(n), hash(n + 1), hash(n + 2), hash(n + 3)];
        table.insert(&blocks);
        generations.insert(&blocks);
        n += 4;
    }
    let mut g = c.benchmark_group("prefix_index");
    let mut next = n;
    g.bench_function("new prompt, set-associative table", |b| {
        b.iter(|| {
            let blocks = [hash(next), hash(next + 1), hash(next + 2), hash(next + 3)];
            next += 4;
            table.warm(black_box(&blocks), 64);
            let m = table.longest_match(&blocks);
            table.insert(&blocks);
            m
        })
    });
    let mut next = n;
    g.bench_function("new prompt, two generations of hash sets (baseline)", |b| {
        b.iter(|| {
            let blocks = [hash(next), hash(next + 1), hash(next + 2), hash(next + 3)];
            next += 4;
            let m = generations.longest_match(black_box(&blocks));
            generations.insert(&blocks);
            m
        })
    });
    g.finish();
}

criterion_group!(benches, decision, index);
criterion_main!(benches);
