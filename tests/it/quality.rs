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
