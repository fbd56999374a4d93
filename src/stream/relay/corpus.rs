//! The Messages and Responses fixture corpus (`tests/corpus/messages`,
//! `tests/corpus/responses`, made by `tests/corpus/gen_protocol_streams.py`
//! with its own reference reader): every stream, cut into reads at
//! arbitrary places, gives the expected usage, finish reason, output-event
//! count (the inter-token histogram counts one gap less) and outcome.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use serde::Deserialize;
use tokio::time::Instant;

use super::{Mode, Relay};
use crate::config::{BackendConfig, Config, UpstreamConfig};
use crate::request::RequestGuard;
use crate::telemetry::Telemetry;
use crate::telemetry::metrics::Metrics;
use crate::telemetry::tracecontext::TraceCtx;
use crate::upstream::pool::Replica;
use crate::vocab::{Endpoint, RouteReason, Usage, Wire};

#[derive(Deserialize)]
struct Expect {
    usage: Option<ExpectUsage>,
    output_events: u32,
    finish_reason: Option<String>,
    outcome: String,
    response_id: Option<String>,
}

#[derive(Deserialize)]
struct ExpectUsage {
    prompt_tokens: u32,
    completion_tokens: u32,
    cached_tokens: Option<u32>,
}

/// What the relay made of one stream.
struct Seen {
    usage: Option<Usage>,
    output_events: u32,
    gaps: u64,
    finish_reason: Option<&'static str>,
    outcome: &'static str,
    response_id: Option<String>,
    /// The bytes forwarded.
    forwarded: Vec<u8>,
}

fn run(endpoint: Endpoint, stream: &[u8], cuts: &[usize]) -> Seen {
    run_as(Mode::Named(endpoint.wire()), endpoint, stream, cuts)
}

fn run_as(mode: Mode, endpoint: Endpoint, stream: &[u8], cuts: &[usize]) -> Seen {
    let metrics = Arc::new(Metrics::new(&Config::default().telemetry.buckets));
    let b = BackendConfig::from_url("http://127.0.0.1:9".parse().unwrap());
    let replica = Arc::new(Replica::from_config(
        &b,
        None,
        &UpstreamConfig::default(),
        &metrics,
    ));
    let tele = Arc::new(Telemetry {
        metrics: metrics.clone(),
        traces: None,
        access_log: None,
        refusal: None,
    });
    let start = Instant::now();
    let mut guard = RequestGuard::new(
        tele,
        endpoint,
        start,
        "corpus".into(),
        TraceCtx::from_headers(&HeaderMap::new()),
        Duration::from_secs(2),
    );
    guard.set_model(Arc::from("m"));
    guard.start_attempt(replica, RouteReason::Affinity, start);
    guard.record.status = 200;
    let mut relay = Relay::new(mode);
    let mut forwarded = Vec::new();
    let mut failed = false;
    let mut from = 0;
    for (i, &to) in cuts.iter().chain([&stream.len()]).enumerate() {
        let at = start + Duration::from_millis(10 * (i as u64 + 1));
        let chunk = Bytes::copy_from_slice(&stream[from..to]);
        from = to;
        if relay.ingest(chunk, at, &mut guard).is_err() {
            failed = true;
            break;
        }
        forwarded.extend_from_slice(&relay.take_out());
    }
    let complete = relay.complete(guard.record.finish_reason.is_some());
    let outcome = if relay.errored || failed {
        "failed"
    } else if complete && relay.pending_len() == 0 {
        "complete"
    } else {
        "truncated"
    };
    let seen = Seen {
        usage: guard.record.usage,
        output_events: guard.record.output_events,
        gaps: 0,
        finish_reason: guard.record.finish_reason.map(|f| f.as_str()),
        outcome,
        response_id: guard.record.response_id.clone(),
        forwarded,
    };
    drop(guard);
    let gaps = metrics
        .models
        .get(&(Arc::from("m"), endpoint.as_str(), Arc::from("")))
        .inter_token
        .count();
    Seen { gaps, ..seen }
}

/// Ways to cut a stream of `len` bytes into reads: whole, one byte at a
/// time, and `times` random sets of fewer than `most` cuts.
fn splits(rng: &mut fastrand::Rng, len: usize, times: usize, most: usize) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = vec![vec![], (1..len).collect()];
    for _ in 0..times {
        let mut cuts: Vec<usize> = (0..rng.usize(1..most))
            .map(|_| rng.usize(0..=len))
            .collect();
        cuts.sort_unstable();
        out.push(cuts);
    }
    out
}

fn corpus(dir: &str) -> Vec<(PathBuf, Vec<u8>, Expect)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/corpus")
        .join(dir);
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&root).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "sse") {
            let stream = std::fs::read(&path).unwrap();
            let expect: Expect =
                serde_json::from_slice(&std::fs::read(path.with_extension("json")).unwrap())
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            out.push((path, stream, expect));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn check(dir: &str, endpoint: Endpoint) {
    let streams = corpus(dir);
    assert!(streams.len() >= 50, "{dir}: only {} streams", streams.len());
    let mut rng = fastrand::Rng::with_seed(7);
    for (path, stream, want) in &streams {
        let name = path.file_name().unwrap().to_string_lossy();
        for cuts in &splits(&mut rng, stream.len(), 8, 12) {
            let seen = run(endpoint, stream, cuts);
            let ctx = format!("{dir}/{name} cut at {} places", cuts.len());
            assert_eq!(seen.outcome, want.outcome, "{ctx}: outcome");
            assert_eq!(
                seen.output_events, want.output_events,
                "{ctx}: output events"
            );
            assert_eq!(
                seen.gaps,
                u64::from(want.output_events.saturating_sub(1)),
                "{ctx}: inter-token gaps"
            );
            assert_eq!(
                seen.finish_reason,
                want.finish_reason.as_deref(),
                "{ctx}: finish reason"
            );
            let usage = want.usage.as_ref().map(|u| Usage {
                prompt_tokens: u.prompt_tokens,
                completion_tokens: u.completion_tokens,
                cached_tokens: u.cached_tokens,
            });
            assert_eq!(seen.usage, usage, "{ctx}: usage");
            if endpoint == Endpoint::Responses {
                assert_eq!(seen.response_id, want.response_id, "{ctx}: response id");
            }
            if seen.outcome != "failed" || want.outcome == "failed" {
                // Forwarded byte for byte (an unfinished last event stays
                // pending until the stream's end decides about it).
                let pending = stream.len() - seen.forwarded.len();
                assert_eq!(
                    &stream[..seen.forwarded.len()],
                    &seen.forwarded[..],
                    "{ctx}: bytes"
                );
                assert!(
                    want.outcome == "truncated" || want.outcome == "failed" || pending == 0,
                    "{ctx}: {pending} bytes held back"
                );
            }
        }
    }
}

#[test]
fn messages_corpus() {
    check("messages", Endpoint::Messages);
}

#[test]
fn responses_corpus() {
    check("responses", Endpoint::Responses);
}

#[test]
fn a_wire_reads_only_its_own_streams() {
    // A chat chunk on a Messages stream is not the protocol's JSON shape,
    // but it is JSON with no `type`: an error, not a silent pass.
    let seen = run(
        Endpoint::Messages,
        b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n",
        &[],
    );
    assert_eq!(seen.outcome, "failed");
    assert_eq!(Endpoint::Messages.wire(), Wire::Anthropic);
}

/// A chat stream as vLLM writes it: role, `n` tokens (some with escapes),
/// the finish, the usage chunk the gateway asked for, `[DONE]`. Returns the
/// stream and the same stream without the usage chunk (what the client gets).
fn chat_stream(n: usize) -> (Vec<u8>, Vec<u8>) {
    let chunk = |delta: &str, finish: &str| {
        format!(
            "data: {{\"id\":\"chatcmpl-7\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"logprobs\":null,\"finish_reason\":{finish}}}]}}\n\n"
        )
    };
    let mut client = chunk(r#"{"role":"assistant","content":""}"#, "null");
    for i in 0..n {
        let word = ["the", " \\\"quoted\\\"", " caf\\u00e9", "\\n", " gateway"][i % 5];
        client += &chunk(
            &format!(r#"{{"content":"{word}"}}"#),
            if i + 1 == n { "\"length\"" } else { "null" },
        );
    }
    let usage = format!(
        "data: {{\"id\":\"chatcmpl-7\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{{\"prompt_tokens\":9,\"total_tokens\":{},\"completion_tokens\":{n}}}}}\n\n",
        9 + n
    );
    let stream = format!("{client}{usage}data: [DONE]\n\n");
    (
        stream.into_bytes(),
        format!("{client}data: [DONE]\n\n").into_bytes(),
    )
}

#[test]
fn chat_streams_cut_anywhere_are_read_the_same_and_lose_only_the_usage_chunk() {
    let mut rng = fastrand::Rng::with_seed(11);
    for n in [1, 2, 17, 64] {
        let (stream, client) = chat_stream(n);
        for cuts in &splits(&mut rng, stream.len(), 40, 24) {
            let seen = run_as(
                Mode::OpenAi { strip_usage: true },
                Endpoint::Chat,
                &stream,
                cuts,
            );
            let ctx = format!("{n} tokens cut at {cuts:?}");
            assert_eq!(seen.outcome, "complete", "{ctx}");
            assert_eq!(seen.output_events, n as u32, "{ctx}");
            assert_eq!(seen.gaps, n as u64 - 1, "{ctx}");
            assert_eq!(seen.finish_reason, Some("length"), "{ctx}");
            assert_eq!(
                seen.usage.map(|u| (u.prompt_tokens, u.completion_tokens)),
                Some((9, n as u32)),
                "{ctx}"
            );
            assert_eq!(
                String::from_utf8_lossy(&seen.forwarded),
                String::from_utf8_lossy(&client),
                "{ctx}"
            );
        }
    }
}
