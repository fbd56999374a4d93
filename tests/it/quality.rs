//! Quality signals counted exactly on crafted streams (truncated, empty, a
//! tool call, clean), never on the clean ones, and no content in any output.

use std::time::Duration;

use crate::common::scripted::{self, Script};
use crate::common::*;

const MS: Duration = Duration::from_millis(1);

/// A scripted stream: the given deltas, a finish reason, and usage.
fn stream(deltas: &[&'static str], finish: &'static str, completion: u32) -> Script {
    let mut chunks: Vec<(Duration, &'static [u8])> =
        deltas.iter().map(|d| (MS, d.as_bytes())).collect();
    let end = format!(
        "data: {{\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"{finish}\"}}]}}\n\n\
         data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":5,\"completion_tokens\":{completion},\"total_tokens\":{}}}}}\n\n\
         data: [DONE]\n\n",
        5 + completion
    );
    chunks.push((MS, Box::leak(end.into_bytes().into_boxed_slice())));
    Script::sse(chunks)
}

const CONTENT: &str =
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"secret words\"}}]}\n\n";
const TOOL: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{}\"}}]}}]}\n\n";

async fn quality_of(script: Script, max_tokens: u32) -> (f64, f64, f64, f64, String) {
    let backend = scripted::start("m", script).await;
    let gw = start_gateway(config_for(&[backend.url()]), 1).await;
    let body = serde_json::json!({
        "model": "m", "stream": true, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hidden prompt"}],
    });
    let (status, _, text) = post(&format!("{}/v1/chat/completions", api(&gw)), &body).await;
    assert_eq!(status, 200, "{text}");
    let (_, metrics) = get_text(&format!("{}/metrics", admin(&gw))).await;
    let m = |s: &str| metric(&metrics, s).unwrap_or(0.0);
    (
        m("sluice_quality_empty_completions_total{model=\"m\"}"),
        m("sluice_quality_length_finishes_total{model=\"m\"}"),
        m("sluice_quality_output_budget_ratio_count{model=\"m\"}"),
        // Generations that used more than 99% of their budget.
        m("sluice_quality_output_budget_ratio_count{model=\"m\"}")
            - m("sluice_quality_output_budget_ratio_bucket{model=\"m\",le=\"0.99\"}"),
        metrics,
    )
}

#[tokio::test]
async fn each_signal_is_counted_on_its_stream_and_never_on_clean_ones() {
    // Clean: two content deltas, 2 of 16 tokens, stop.
    let (empty, length, n, full, text) =
        quality_of(stream(&[CONTENT, CONTENT], "stop", 2), 16).await;
    assert_eq!((empty, length, n, full), (0.0, 0.0, 1.0, 0.0));
    assert!(!text.contains("secret") && !text.contains("hidden"));
    // Truncated: all 16 tokens used, finish reason length.
    let (empty, length, n, full, _) =
        quality_of(stream(&[CONTENT, CONTENT], "length", 16), 16).await;
    assert_eq!((empty, length, n, full), (0.0, 1.0, 1.0, 1.0));
    // Empty: a 200 with no content and no tool call.
    let (empty, length, n, full, _) = quality_of(stream(&[], "stop", 0), 16).await;
    assert_eq!((empty, length, n, full), (1.0, 0.0, 1.0, 0.0));
    // A tool call only: not empty.
    let (empty, length, _, _, _) = quality_of(stream(&[TOOL], "tool_calls", 3), 16).await;
    assert_eq!((empty, length), (0.0, 0.0));
}

/// A tool call's arguments in pieces, the way engines stream them.
fn tool_piece(index: u32, part: &str) -> &'static str {
    let tc = serde_json::json!([{"index": index, "function": {"arguments": part}}]);
    let ev = serde_json::json!({"choices": [{"index": 0, "delta": {"tool_calls": tc}}]});
    Box::leak(format!("data: {ev}\n\n").into_boxed_str())
}

fn content(text: &str) -> &'static str {
    let ev = serde_json::json!({"choices": [{"index": 0, "delta": {"content": text}}]});
    Box::leak(format!("data: {ev}\n\n").into_boxed_str())
}

/// (tool calls, invalid tool calls, refusals) of one request through a
/// gateway with the refusal detector on or off, and the metrics text.
async fn content_signals(script: Script, refusal: bool) -> (f64, f64, f64, String) {
    let stream = script.content_type == "text/event-stream";
    let backend = scripted::start("m", script).await;
    let mut c = config_for(&[backend.url()]);
    c.telemetry.quality.refusal.enabled = refusal;
    let gw = start_gateway(c, 1).await;
    let body = serde_json::json!({
        "model": "m", "stream": stream, "max_tokens": 64,
        "messages": [{"role": "user", "content": "hidden prompt"}],
    });
    let (status, _, text) = post(&format!("{}/v1/chat/completions", api(&gw)), &body).await;
    assert_eq!(status, 200, "{text}");
    let (_, metrics) = get_text(&format!("{}/metrics", admin(&gw))).await;
    let m = |s: &str| metric(&metrics, s).unwrap_or(0.0);
    (
        m("sluice_quality_tool_calls_total{model=\"m\"}"),
        m("sluice_quality_invalid_tool_calls_total{model=\"m\"}"),
        m("sluice_quality_refusals_total{model=\"m\"}"),
        metrics,
    )
}

#[tokio::test]
async fn invalid_tool_arguments_and_refusals_are_counted_exactly_and_never_on_clean_answers() {
    // Two calls streamed in pieces: call 0 valid, call 1 cut short.
    let (tools, invalid, refusals, _) = content_signals(
        stream(
            &[
                tool_piece(0, "{\"city\": "),
                tool_piece(1, "{\"q\": \"x"),
                tool_piece(0, "\"Paris\"}"),
            ],
            "tool_calls",
            9,
        ),
        false,
    )
    .await;
    assert_eq!((tools, invalid, refusals), (2.0, 1.0, 0.0));
    // Valid calls only: none invalid.
    let (tools, invalid, _, _) = content_signals(
        stream(&[tool_piece(0, "{\"a\": [1, 2]}")], "tool_calls", 5),
        false,
    )
    .await;
    assert_eq!((tools, invalid), (1.0, 0.0));
    // A refusal in the opening, split across deltas and cased: counted
    // with the detector on, not with it off; the words never appear.
    let refusing = || {
        stream(
            &[content("I'm sorry, but I CAN"), content("'T do that.")],
            "stop",
            8,
        )
    };
    let (_, _, on, metrics) = content_signals(refusing(), true).await;
    let (_, _, off, _) = content_signals(refusing(), false).await;
    assert_eq!((on, off), (1.0, 0.0));
    assert!(!metrics.contains("sorry") && !metrics.contains("hidden"));
    // A clean answer with the detector on: nothing.
    let (tools, invalid, refusals, _) = content_signals(
        stream(&[content("Sure, Paris is the capital.")], "stop", 6),
        true,
    )
    .await;
    assert_eq!((tools, invalid, refusals), (0.0, 0.0, 0.0));
    // A non-streamed answer with an invalid call and a refusal.
    let whole = Script {
        status: 200,
        content_type: "application/json",
        chunks: vec![(
            MS,
            bytes::Bytes::from_static(
                br#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"As an AI I will not guess.","tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{\"a\":"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#,
            ),
        )],
    };
    let (tools, invalid, refusals, _) = content_signals(whole.clone(), true).await;
    assert_eq!((tools, invalid, refusals), (1.0, 1.0, 1.0));
    // The same with the detector off: the calls are still read (the
    // answer's scan finds them in its message).
    let (tools, invalid, refusals, _) = content_signals(whole, false).await;
    assert_eq!((tools, invalid, refusals), (1.0, 1.0, 0.0));
}
