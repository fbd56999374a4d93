//! The official OpenAI Python SDK against the real gateway: the drop-in claim.

use crate::common::*;

#[tokio::test]
async fn the_openai_python_sdk_works_through_the_gateway() {
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(config_for(&[sim.url()]), 1).await;
    let base = format!("{}/v1", api(&gw));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/sdk_e2e.py");
    let out = tokio::process::Command::new(python::python())
        .arg(script)
        .arg(&base)
        .output()
        .await
        .expect(python::MISSING);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "SDK script failed:\n{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();

    assert_eq!(v["models"], serde_json::json!(["sim-model"]));
    assert_eq!(v["chat"]["finish_reason"], "stop");
    assert_eq!(v["chat"]["completion_tokens"], 8);
    assert!(!v["chat"]["content"].as_str().unwrap().is_empty());
    assert_eq!(v["stream"]["pieces"], 8);
    assert_eq!(v["stream"]["finish_reason"], "stop");
    assert_eq!(
        v["stream"]["usage_chunks"], 0,
        "usage chunk must be stripped"
    );
    assert_eq!(v["stream_usage"], 8);
    assert_eq!(v["completion"]["finish_reason"], "length");
    assert_eq!(v["completion"]["tokens"], 3);
    assert_eq!(v["embeddings"], 3);
    assert_eq!(v["not_found"], "model_not_found");
    assert_eq!(v["mid_stream"], "APIError");
}
