//! Replicas from the Kubernetes API (`discovery.kubernetes`), against a fake
//! API server: pods that come, turn ready or unready, and go are followed;
//! an InferencePool's selector and port pick them, and a change to it is
//! followed; a reload keeps what was found.

use std::net::Ipv4Addr;
use std::time::Duration;

use serde_json::json;
use sluice::config::{Config, KubernetesSource};
use sluice::server::Gateway;
use sluice::sim::SimHandle;

use crate::common::*;
use crate::routing::{routing_config, served_by, start_routed};

/// Simulators on the same port of `ips.len()` loopback addresses, as pods
/// of one Deployment.
async fn pods_on(ips: &[Ipv4Addr]) -> Vec<SimHandle> {
    'again: for _ in 0..20 {
        let first = tokio::net::TcpListener::bind((ips[0], 0)).await.unwrap();
        let port = first.local_addr().unwrap().port();
        let mut listeners = vec![first];
        for ip in &ips[1..] {
            match tokio::net::TcpListener::bind((*ip, port)).await {
                Ok(l) => listeners.push(l),
                Err(_) => continue 'again,
            }
        }
        let mut sims = Vec::new();
        for l in listeners {
            sims.push(sluice::sim::start(l, fast_sim()).await.unwrap());
        }
        return sims;
    }
    panic!("no port free on every address");
}

fn source(v: serde_json::Value) -> KubernetesSource {
    serde_json::from_value(v).unwrap()
}

fn config(kube: &kube::FakeKube, src: KubernetesSource) -> Config {
    let mut c = routing_config(&[]);
    c.discovery.kubeconfig = Some(kube.kubeconfig("llm"));
    c.discovery.kubernetes = vec![src];
    c
}

/// Wait until the pool holds exactly the replicas at `ips` (sorted), all
/// healthy.
async fn wait_for(gw: &Gateway, what: &str, ips: &[&str]) {
    let pool = gw.state().pool.clone();
    let want: Vec<String> = ips.iter().map(|s| s.to_string()).collect();
    wait_until(what, Duration::from_secs(10), || {
        let pool = pool.clone();
        let want = want.clone();
        async move {
            let mut got: Vec<String> = pool
                .replicas()
                .iter()
                .filter(|r| r.is_healthy())
                .map(|r| r.name.split(':').next().unwrap_or("").to_string())
                .collect();
            got.sort();
            got == want && pool.replicas().len() == want.len()
        }
    })
    .await;
}

fn body(i: usize) -> serde_json::Value {
    chat_for("sim-model", false)
        .as_object()
        .cloned()
        .map(|mut o| {
            o.insert("messages".into(), json!([{"role": "user", "content": format!("Question {i} about the fleet, asked once.")}]));
            serde_json::Value::Object(o)
        })
        .unwrap()
}

#[tokio::test]
async fn pods_that_come_turn_ready_and_go_are_followed() {
    let ips = [Ipv4Addr::new(127, 0, 0, 11), Ipv4Addr::new(127, 0, 0, 12)];
    let sims = pods_on(&ips).await;
    let port = sims[0].addr.port();
    let kube = kube::start().await;
    let app = json!({"app": "vllm"});
    kube.pod("vllm-a", app.clone(), "127.0.0.11", true);
    kube.pod("vllm-b", app.clone(), "127.0.0.12", false);
    // Another Deployment's pod: not selected.
    kube.pod("other", json!({"app": "other"}), "127.0.0.13", true);
    let mut cfg = config(
        &kube,
        source(json!({"selector": {"app": "vllm"}, "port": port, "models": ["sim-model"]})),
    );
    let gw = start_routed(cfg.clone(), 1).await;
    wait_for(&gw, "the ready pod only", &["127.0.0.11"]).await;
    assert_eq!(served_by(&gw, &sims, &body(0)).await, 0);

    // The second pod passes its readiness probe: it takes work.
    kube.pod("vllm-b", app.clone(), "127.0.0.12", true);
    wait_for(&gw, "both pods", &["127.0.0.11", "127.0.0.12"]).await;
    let mut seen = [false; 2];
    for i in 0..24 {
        seen[served_by(&gw, &sims, &body(i)).await] = true;
    }
    assert_eq!(seen, [true, true], "both pods take work");

    // A reload keeps the replicas the watch found (the source unchanged).
    let before = gw.state().pool.replicas();
    cfg.discovery.kubernetes[0].max_concurrency = Some(8);
    gw.reload(cfg.clone()).unwrap();
    assert_eq!(
        gw.state().pool.replicas().len(),
        before.len(),
        "kept across the reload"
    );

    // The first pod is deleted (a rollout): only the second serves.
    kube.delete_pod("vllm-a");
    wait_for(&gw, "the first pod gone", &["127.0.0.12"]).await;
    for i in 0..6 {
        assert_eq!(served_by(&gw, &sims, &body(100 + i)).await, 1);
    }
    // It turns unready: no replica left, a clean 503.
    kube.pod("vllm-b", app, "127.0.0.12", false);
    wait_for(&gw, "no ready pod", &[]).await;
    let (status, _, text) = post(&format!("{}/v1/chat/completions", api(&gw)), &body(7)).await;
    assert_eq!(status, 503, "{text}");
}

#[tokio::test]
async fn an_inference_pools_selector_and_port_pick_the_pods_and_changes_follow() {
    let ips = [Ipv4Addr::new(127, 0, 0, 21), Ipv4Addr::new(127, 0, 0, 22)];
    let sims = pods_on(&ips).await;
    let port = sims[0].addr.port();
    let kube = kube::start().await;
    kube.pod(
        "blue",
        json!({"app": "vllm", "track": "blue"}),
        "127.0.0.21",
        true,
    );
    kube.pod(
        "green",
        json!({"app": "vllm", "track": "green"}),
        "127.0.0.22",
        true,
    );
    kube.pool("qwen", json!({"app": "vllm", "track": "blue"}), port);
    let cfg = config(&kube, source(json!({"inference_pool": "qwen"})));
    let gw = start_routed(cfg, 1).await;
    wait_for(&gw, "the pool's pods", &["127.0.0.21"]).await;
    assert_eq!(served_by(&gw, &sims, &body(0)).await, 0);

    // The pool's selector moves to the green track: so do the replicas.
    kube.pool("qwen", json!({"app": "vllm", "track": "green"}), port);
    wait_for(&gw, "the new selection", &["127.0.0.22"]).await;
    assert_eq!(served_by(&gw, &sims, &body(1)).await, 1);
    // Both tracks.
    kube.pool("qwen", json!({"app": "vllm"}), port);
    wait_for(&gw, "both tracks", &["127.0.0.21", "127.0.0.22"]).await;
    // The pool is deleted: nothing to serve.
    kube.delete_pool("qwen");
    wait_for(&gw, "the pool deleted", &[]).await;
}

#[tokio::test]
async fn a_source_needs_a_pool_or_a_selector_with_a_port() {
    let dir = tempfile::tempdir().unwrap();
    for (yaml, key) in [
        (
            "discovery:\n  kubernetes:\n  - models: [m]\n",
            "discovery.kubernetes[0].inference_pool",
        ),
        (
            "discovery:\n  kubernetes:\n  - selector: {app: x}\n",
            "discovery.kubernetes[0].port",
        ),
        (
            "discovery:\n  kubernetes:\n  - {selector: {app: x}, port: 80, inference_pool: p}\n",
            "discovery.kubernetes[0].selector",
        ),
    ] {
        let path = dir.path().join("c.yaml");
        std::fs::write(&path, yaml).unwrap();
        let err = format!("{:#}", sluice::config::load_file(&path).unwrap_err());
        assert!(err.contains(key), "{yaml}: {err}");
    }
}
