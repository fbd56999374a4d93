//! Flow control over real sockets: a `sluice sim` replica that runs one
//! request at a time (`backends[].max_concurrency: 1`), held by a stream that
//! stalls after its first token; what arrives meanwhile waits at the gateway.

use std::time::Duration;

use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use sluice::config::{ApiKey, Config, EnginePriority, Secret, StoreKind, TierConfig};
use sluice::server::Gateway;
use sluice::sim::SimHandle;

use crate::common::*;

const PREMIUM: &str = "sk-flow-premium";
const FREE: &str = "sk-flow-free";
const LIGHT: &str = "sk-flow-light";

/// One replica with one seat; tiers `premium` (band 10) and `free` (band 0).
async fn one_seat(tweak: impl FnOnce(&mut Config)) -> (SimHandle, Gateway) {
    let sim = start_sim(fast_sim()).await;
    let mut c = config_for(&[sim.url()]);
    c.backends[0].max_concurrency = Some(1);
    tenants(&mut c);
    tweak(&mut c);
    let gw = start_gateway(c, 1).await;
    (sim, gw)
}

/// Keys `vip` (tier `premium`, band 10), `crowd` and `light` (tier `free`).
fn tenants(c: &mut Config) {
    let sha = |k: &str| Secret::new(hex::encode(Sha256::digest(k.as_bytes())));
    c.auth.keys = vec![
        ApiKey {
            name: "vip".into(),
            tier: "premium".into(),
            sha256: sha(PREMIUM),
        },
        ApiKey {
            name: "crowd".into(),
            tier: "free".into(),
            sha256: sha(FREE),
        },
        ApiKey {
            name: "light".into(),
            tier: "free".into(),
            sha256: sha(LIGHT),
        },
    ];
    c.tiers.insert(
        "premium".into(),
        TierConfig {
            priority: 10,
            ..TierConfig::default()
        },
    );
    c.tiers.insert("free".into(), TierConfig::default());
}

fn request(gw: &Gateway, key: &str, fault: Option<&str>) -> reqwest::RequestBuilder {
    let mut r = client()
        .post(format!("{}/v1/chat/completions", api(gw)))
        .bearer_auth(key)
        .json(&chat_body(true));
    if let Some(f) = fault {
        r = r.header("x-sim-fault", f);
    }
    r
}

/// A stream holding the seat: it got its first token and then stalls until
/// dropped.
struct Holder {
    _body:
        std::pin::Pin<Box<dyn futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>,
}

async fn hold(gw: &Gateway, key: &str) -> Holder {
    let resp = request(gw, key, Some("stall=1:60s")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = Box::pin(resp.bytes_stream());
    let mut seen = String::new();
    while !seen.contains("\"content\"") {
        let chunk = body.next().await.expect("stream ended early").unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    Holder { _body: body }
}

async fn waiting(gw: &Gateway, band: &str) -> f64 {
    gateway_metric(
        gw,
        &format!("sluice_flow_waiting_requests{{model=\"sim-model\",band=\"{band}\"}}"),
    )
    .await
}

async fn wait_for_waiting(gw: &Gateway, band: &str, n: f64) {
    wait_until(
        &format!("{n} waiting in band {band}"),
        Duration::from_secs(10),
        || async move { waiting(gw, band).await == n },
    )
    .await;
}

async fn outcomes(gw: &Gateway, outcome: &str) -> f64 {
    gateway_metric(
        gw,
        &format!("sluice_flow_requests_total{{model=\"sim-model\",outcome=\"{outcome}\"}}"),
    )
    .await
}

#[tokio::test]
async fn a_waiting_request_goes_when_the_seat_frees() {
    let (sim, gw) = one_seat(|_| {}).await;
    let holder = hold(&gw, FREE).await;
    let next = tokio::spawn(request(&gw, FREE, None).send());
    wait_for_waiting(&gw, "0", 1.0).await;
    // Waiting at the gateway: the replica has not seen it.
    assert_eq!(sim.state.metrics.received.get(), 1);
    drop(holder);
    let resp = next.await.unwrap().unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.text().await.unwrap();
    assert!(body.contains("[DONE]"), "{body}");
    assert_eq!(sim.state.metrics.received.get(), 2);
    assert_eq!(outcomes(&gw, "waited").await, 1.0);
    assert_eq!(outcomes(&gw, "immediate").await, 1.0);
    assert_eq!(waiting(&gw, "0").await, 0.0);
    // The wait is in its queue time.
    let (_, text) = get_text(&format!("{}/metrics", admin(&gw))).await;
    let waited = metric(
        &text,
        "sluice_flow_wait_seconds_count{model=\"sim-model\",band=\"0\"}",
    );
    assert_eq!(waited, Some(2.0));
}

#[tokio::test]
async fn a_client_that_leaves_while_waiting_frees_its_place_at_once() {
    let (sim, gw) = one_seat(|_| {}).await;
    let holder = hold(&gw, FREE).await;
    let gone = tokio::spawn(request(&gw, FREE, None).send());
    wait_for_waiting(&gw, "0", 1.0).await;
    gone.abort();
    wait_for_waiting(&gw, "0", 0.0).await;
    drop(holder);
    // The seat is free again: the next request goes at once, and the one
    // that left never reached the replica.
    let resp = request(&gw, FREE, None).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.text().await.unwrap();
    assert_eq!(sim.state.metrics.received.get(), 2);
    assert_eq!(outcomes(&gw, "waited").await, 0.0);
}

#[tokio::test]
async fn the_wait_is_bounded_by_a_503_with_retry_after_in_each_protocol() {
    let (sim, gw) = one_seat(|c| {
        c.tiers.get_mut("free").unwrap().max_wait = Some(Duration::from_millis(300));
    })
    .await;
    let holder = hold(&gw, FREE).await;
    let resp = request(&gw, FREE, None).send().await.unwrap();
    assert_eq!(resp.status(), 503);
    let retry: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1);
    assert!(resp.headers().contains_key("retry-after-ms"));
    let err = error_of(&resp.text().await.unwrap());
    assert_eq!(err["code"], "flow_timeout");
    assert!(err["message"].as_str().unwrap().contains("max_wait"));
    // Anthropic's shape on /v1/messages.
    let resp = client()
        .post(format!("{}/v1/messages", api(&gw)))
        .header("x-api-key", FREE)
        .json(&serde_json::json!({
            "model": "sim-model", "max_tokens": 8, "stream": true,
            "messages": [{"role": "user", "content": "hi"}],
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    assert!(resp.headers().contains_key("retry-after"));
    let v: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "overloaded_error");
    // Neither reached the replica; the premium tier (no max_wait of its own,
    // 30 s) still waits and goes when the seat frees.
    assert_eq!(sim.state.metrics.received.get(), 1);
    assert_eq!(outcomes(&gw, "shed_timeout").await, 2.0);
    let premium = tokio::spawn(request(&gw, PREMIUM, None).send());
    wait_for_waiting(&gw, "10", 1.0).await;
    drop(holder);
    assert_eq!(premium.await.unwrap().unwrap().status(), 200);
    let requests = gateway_metric(
        &gw,
        "sluice_requests_total{model=\"sim-model\",status=\"503\",error_kind=\"flow_timeout\",tier=\"free\"}",
    )
    .await;
    assert_eq!(requests, 2.0);
}

#[tokio::test]
async fn higher_bands_go_first_and_a_request_may_lower_its_own() {
    let (_sim, gw) = one_seat(|_| {}).await;
    let holder = hold(&gw, FREE).await;
    // Free first, then premium asking to be treated as band 0, then premium.
    let low = tokio::spawn(request(&gw, FREE, None).send());
    wait_for_waiting(&gw, "0", 1.0).await;
    let lowered = tokio::spawn(
        request(&gw, PREMIUM, None)
            .header("x-sluice-priority", "0")
            .send(),
    );
    wait_for_waiting(&gw, "0", 2.0).await;
    let high = tokio::spawn(request(&gw, PREMIUM, Some("stall=1:60s")).send());
    wait_for_waiting(&gw, "10", 1.0).await;
    drop(holder);
    // The premium request gets the seat; both band-0 requests still wait.
    let high = high.await.unwrap().unwrap();
    assert_eq!(high.status(), 200);
    assert_eq!(waiting(&gw, "0").await, 2.0);
    assert_eq!(waiting(&gw, "10").await, 0.0);
    drop(high);
    // Then band 0, one at a time.
    assert_eq!(low.await.unwrap().unwrap().status(), 200);
    assert_eq!(lowered.await.unwrap().unwrap().status(), 200);
    // A priority that is not a number is the client's error.
    let resp = request(&gw, PREMIUM, None)
        .header("x-sluice-priority", "urgent")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
}

#[tokio::test]
async fn a_disconnect_storm_in_the_queue_leaks_nothing() {
    let (sim, gw) = one_seat(|_| {}).await;
    let holder = hold(&gw, FREE).await;
    let waiters: Vec<_> = (0..40)
        .map(|_| tokio::spawn(request(&gw, FREE, None).send()))
        .collect();
    wait_for_waiting(&gw, "0", 40.0).await;
    for w in &waiters {
        w.abort();
    }
    wait_for_waiting(&gw, "0", 0.0).await;
    drop(holder);
    wait_until("nothing in flight", Duration::from_secs(10), || async {
        gateway_metric(&gw, "sluice_requests_in_flight{model=\"sim-model\"}").await == 0.0
            && gateway_metric(&gw, "sluice_backend_in_flight").await == 0.0
    })
    .await;
    // The seat is free: the next request goes at once.
    let before = outcomes(&gw, "immediate").await;
    let resp = request(&gw, FREE, None).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.text().await.unwrap();
    assert_eq!(outcomes(&gw, "immediate").await, before + 1.0);
    assert_eq!(sim.state.metrics.received.get(), 2);
}

#[tokio::test]
async fn a_full_queue_sheds_the_lowest_band_first() {
    let (_sim, gw) = one_seat(|c| c.flow_control.max_queue = 2).await;
    let holder = hold(&gw, FREE).await;
    let first = tokio::spawn(request(&gw, FREE, None).send());
    wait_for_waiting(&gw, "0", 1.0).await;
    let second = tokio::spawn(request(&gw, FREE, None).send());
    wait_for_waiting(&gw, "0", 2.0).await;
    // Full: another free request is turned away at once...
    let resp = request(&gw, FREE, None).send().await.unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(
        error_of(&resp.text().await.unwrap())["code"],
        "flow_overflow"
    );
    // ...and a premium one takes the place of the newest free one.
    let premium = tokio::spawn(request(&gw, PREMIUM, None).send());
    let shed = second.await.unwrap().unwrap();
    assert_eq!(shed.status(), 503);
    assert!(shed.headers().contains_key("retry-after"));
    wait_for_waiting(&gw, "10", 1.0).await;
    drop(holder);
    assert_eq!(premium.await.unwrap().unwrap().status(), 200);
    assert_eq!(first.await.unwrap().unwrap().status(), 200);
    assert_eq!(outcomes(&gw, "shed_overflow").await, 2.0);
}

#[tokio::test]
async fn turned_off_the_replica_takes_the_excess() {
    let (sim, gw) = one_seat(|c| c.flow_control.enabled = false).await;
    let holder = hold(&gw, FREE).await;
    let resp = request(&gw, FREE, None).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    resp.text().await.unwrap();
    assert_eq!(sim.state.metrics.received.get(), 2);
    assert_eq!(outcomes(&gw, "immediate").await, 0.0);
    drop(holder);
}

#[tokio::test]
async fn the_band_reaches_engines_that_schedule_by_priority() {
    use crate::common::scripted::{self, Script};
    let script = Script::sse(vec![(
        Duration::ZERO,
        b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n",
    )]);
    for (engine, sent) in [
        (EnginePriority::Vllm, Some(-10)),
        (EnginePriority::Sglang, Some(10)),
        (EnginePriority::Off, None),
    ] {
        let replica = scripted::start("sim-model", script.clone()).await;
        let mut c = config_for(&[replica.url()]);
        c.backends[0].engine_priority = engine;
        c.auth.keys = vec![ApiKey {
            name: "vip".into(),
            tier: "premium".into(),
            sha256: Secret::new(hex::encode(Sha256::digest(PREMIUM.as_bytes()))),
        }];
        c.tiers.insert(
            "premium".into(),
            TierConfig {
                priority: 10,
                ..TierConfig::default()
            },
        );
        let gw = start_gateway(c, 1).await;
        // The client's own `priority` never reaches the engine.
        let mut body = chat_body(true);
        body["priority"] = serde_json::json!(-1000);
        let resp = client()
            .post(format!("{}/v1/chat/completions", api(&gw)))
            .bearer_auth(PREMIUM)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.text().await.unwrap();
        let seen = replica.last_body.lock().clone().unwrap();
        let seen: serde_json::Value = serde_json::from_slice(&seen).unwrap();
        match sent {
            Some(p) => assert_eq!(seen["priority"], p, "{engine:?}"),
            None => assert_eq!(seen["priority"], -1000, "off: the body is untouched"),
        }
    }
}

#[tokio::test]
async fn a_ttft_objective_puts_a_request_ahead_of_its_tenants_others() {
    let (_sim, gw) = one_seat(|_| {}).await;
    let holder = hold(&gw, FREE).await;
    let plain = tokio::spawn(request(&gw, FREE, Some("stall=1:60s")).send());
    wait_for_waiting(&gw, "0", 1.0).await;
    let urgent = tokio::spawn(
        request(&gw, FREE, Some("stall=1:60s"))
            .header("x-sluice-ttft-objective", "100ms")
            .send(),
    );
    wait_for_waiting(&gw, "0", 2.0).await;
    drop(holder);
    // The urgent one gets the seat (and holds it); the plain one still waits.
    let urgent = urgent.await.unwrap().unwrap();
    assert_eq!(urgent.status(), 200);
    assert_eq!(waiting(&gw, "0").await, 1.0);
    drop(urgent);
    assert_eq!(plain.await.unwrap().unwrap().status(), 200);
    // Not a duration: the client's error.
    let resp = request(&gw, FREE, None)
        .header("x-sluice-ttft-objective", "soon")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
}

async fn share_syncs(gw: &Gateway) -> f64 {
    gateway_metric(gw, "sluice_flow_share_syncs_total{outcome=\"ok\"}").await
}

/// Two more rounds of `gw`'s fairness sync than now (the first may have
/// started before what must be in it).
async fn two_rounds(gw: &Gateway) {
    let now = share_syncs(gw).await;
    wait_until("two sync rounds", Duration::from_secs(10), || async move {
        share_syncs(gw).await >= now + 2.0
    })
    .await;
}

#[tokio::test]
async fn service_through_another_gateway_counts_here_through_redis() {
    // Gateway 1: one seat, held; `crowd` then `light` wait there. Gateway 2
    // (its own replica, same model) serves `crowd` three times meanwhile.
    // Shared through Redis, that service puts `crowd` behind `light` at
    // gateway 1: `light` gets the seat although `crowd` came first (alone,
    // each gateway would see them equal and keep arrival order).
    let redis = redis::start().await;
    let share = |c: &mut Config| {
        c.rate_limits.store = StoreKind::Redis;
        c.rate_limits.redis.url = Secret::new(redis.url());
        c.flow_control.share_interval = Duration::from_millis(50);
    };
    let (_sim, gw1) = one_seat(share).await;
    let sim2 = start_sim(fast_sim()).await;
    let mut c2 = config_for(&[sim2.url()]);
    tenants(&mut c2);
    share(&mut c2);
    let gw2 = start_gateway(c2, 1).await;

    let holder = hold(&gw1, PREMIUM).await;
    two_rounds(&gw1).await;
    let crowd = tokio::spawn(request(&gw1, FREE, Some("stall=1:60s")).send());
    wait_for_waiting(&gw1, "0", 1.0).await;
    let light = tokio::spawn(request(&gw1, LIGHT, Some("stall=1:60s")).send());
    wait_for_waiting(&gw1, "0", 2.0).await;
    for _ in 0..3 {
        let resp = request(&gw2, FREE, None).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        resp.text().await.unwrap();
    }
    two_rounds(&gw2).await;
    two_rounds(&gw1).await;

    drop(holder);
    let light = tokio::time::timeout(Duration::from_secs(20), light)
        .await
        .expect("light was not served first")
        .unwrap()
        .unwrap();
    assert_eq!(light.status(), 200);
    assert!(!crowd.is_finished());
    assert_eq!(waiting(&gw1, "0").await, 1.0, "crowd still waits");
    drop(light);
    assert_eq!(crowd.await.unwrap().unwrap().status(), 200);
}

async fn seat_part(gw: &Gateway) -> f64 {
    gateway_metric(gw, "sluice_flow_seat_part{model=\"sim-model\"}").await
}

#[tokio::test]
async fn gateways_sharing_through_redis_split_the_seats_between_their_tenants() {
    // One replica of two seats behind two gateways. Gateway 1 holds both
    // seats for `light`, and a third `light` request waits there; `crowd`
    // waits at gateway 2. Two tenants want the two seats: one each. When one
    // of `light`'s streams ends, gateway 1 does not take the seat again for
    // its own waiter (alone, it would at once: it counts its own requests
    // live and the other gateway's only at its scrapes); gateway 2's next
    // scrape shows it free, and `crowd` gets it.
    let redis = redis::start().await;
    let sim = start_sim(fast_sim()).await;
    let gateway = || {
        let mut c = config_for(&[sim.url()]);
        c.backends[0].max_concurrency = Some(2);
        c.routing.metrics.interval = Duration::from_millis(100);
        c.rate_limits.store = StoreKind::Redis;
        c.rate_limits.redis.url = Secret::new(redis.url());
        c.flow_control.share_interval = Duration::from_millis(50);
        tenants(&mut c);
        crate::routing::start_routed(c, 1)
    };
    let gw1 = gateway().await;
    let gw2 = gateway().await;
    let first = hold(&gw1, LIGHT).await;
    let _second = hold(&gw1, LIGHT).await;
    two_rounds(&gw1).await;
    assert_eq!(
        seat_part(&gw1).await,
        -1.0,
        "no part while no other gateway wants seats"
    );
    let light = tokio::spawn(request(&gw1, LIGHT, Some("stall=1:60s")).send());
    wait_for_waiting(&gw1, "0", 1.0).await;
    let crowd = tokio::spawn(request(&gw2, FREE, Some("stall=1:60s")).send());
    wait_for_waiting(&gw2, "0", 1.0).await;
    // `light` wants three seats (at gateway 1), `crowd` one (at gateway 2).
    wait_until(
        "each gateway's part is one seat",
        Duration::from_secs(10),
        || async { seat_part(&gw1).await == 1.0 && seat_part(&gw2).await == 1.0 },
    )
    .await;

    drop(first);
    let crowd = tokio::time::timeout(Duration::from_secs(10), crowd)
        .await
        .expect("gateway 2 never got the freed seat")
        .unwrap()
        .unwrap();
    assert_eq!(crowd.status(), 200);
    assert!(!light.is_finished());
    assert_eq!(
        waiting(&gw1, "0").await,
        1.0,
        "light's third request still waits"
    );
    assert_eq!(seat_part(&gw1).await, 1.0);
}

/// The gateways' fields in the model's wants hash (`flow::share`).
async fn wants_published(redis: &redis::Redis) -> Vec<String> {
    let client = ::redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    ::redis::cmd("HKEYS")
        .arg("sluice:flow:{sim-model}:wants")
        .query_async(&mut conn)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_gateway_that_stops_withdraws_its_wants_from_the_seats_shared_through_redis() {
    // Its wants count for four of its rounds (here 8 s) after it last
    // published them, and only another gateway's round drops them then:
    // without a last round at shutdown they would stay here (no other
    // gateway) until the key expires.
    let redis = redis::start().await;
    let (_sim, gw) = one_seat(|c| {
        c.rate_limits.store = StoreKind::Redis;
        c.rate_limits.redis.url = Secret::new(redis.url());
        c.flow_control.share_interval = Duration::from_secs(2);
    })
    .await;
    let holder = hold(&gw, PREMIUM).await;
    let redis = &redis;
    wait_until("its wants published", Duration::from_secs(10), || async {
        wants_published(redis).await.len() == 1
    })
    .await;
    // The held stream is cut at the deadline (the next round, two seconds
    // away, has not come: the wants found were just published); then the
    // last round.
    gw.shutdown(Duration::from_millis(100)).await;
    assert_eq!(wants_published(redis).await, Vec::<String>::new());
    drop(holder);
}

/// One replica whose seats are unknown (learned from its scrapes, read
/// every 100 ms), with the tiers of `one_seat`.
async fn unknown_seats() -> (SimHandle, Gateway) {
    let sim = start_sim(fast_sim()).await;
    let mut c = config_for(&[sim.url()]);
    c.routing.metrics.interval = Duration::from_millis(100);
    c.routing.metrics.stale_after = Duration::from_secs(30);
    tenants(&mut c);
    let gw = crate::routing::start_routed(c, 1).await;
    (sim, gw)
}

#[tokio::test]
async fn a_full_kv_cache_keeps_the_gate_open_while_the_engine_does_not_queue() {
    let (sim, gw) = unknown_seats().await;
    // Engines run their KV cache near full at full batch.
    let mut c = sim.state.control();
    c.kv_usage = Some(0.97);
    sim.state.set_control(c);
    crate::routing::until_backend(&gw, "KV usage seen", |v| {
        crate::routing::backend(v, &sim)["kv_cache_usage"] == 0.97
    })
    .await;
    let _holders = [
        hold(&gw, FREE).await,
        hold(&gw, FREE).await,
        hold(&gw, FREE).await,
    ];
    // Nothing waits in the engine: the next request goes at once.
    let resp = request(&gw, FREE, None).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.text().await.unwrap().contains("[DONE]"));
    assert_eq!(outcomes(&gw, "immediate").await, 4.0);
    assert_eq!(outcomes(&gw, "waited").await, 0.0);
}

#[tokio::test]
async fn an_engine_that_schedules_by_priority_takes_the_top_band_while_it_queues() {
    for engine in [EnginePriority::Vllm, EnginePriority::Off] {
        let sim = start_sim(fast_sim()).await;
        let mut c = config_for(&[sim.url()]);
        c.backends[0].max_concurrency = Some(4);
        c.backends[0].engine_priority = engine;
        c.routing.metrics.interval = Duration::from_millis(100);
        c.routing.metrics.stale_after = Duration::from_secs(30);
        tenants(&mut c);
        let gw = crate::routing::start_routed(c, 1).await;
        let holders = [hold(&gw, FREE).await, hold(&gw, FREE).await];
        // The engine queues scrape after scrape (another gateway's request,
        // counted in its seats): one of its four seats is free here.
        let mut ctl = sim.state.control();
        ctl.waiting = Some(1.0);
        sim.state.set_control(ctl.clone());
        crate::routing::until_backend(&gw, "the engine's queue persists", |v| {
            crate::routing::backend(v, &sim)["engine_queued"] == true
        })
        .await;
        // The free tier waits at the gateway either way.
        let free = tokio::spawn(request(&gw, FREE, None).send());
        wait_for_waiting(&gw, "0", 1.0).await;
        let premium = tokio::spawn(request(&gw, PREMIUM, None).send());
        if engine == EnginePriority::Vllm {
            // Premium goes now: the engine serves it ahead of its queue.
            let resp = premium.await.unwrap().unwrap();
            assert_eq!(resp.status(), 200);
            assert!(resp.text().await.unwrap().contains("[DONE]"));
            assert_eq!(waiting(&gw, "0").await, 1.0, "free still waits");
        } else {
            // First come, first served in the engine: premium waits here.
            wait_for_waiting(&gw, "10", 1.0).await;
            ctl.waiting = None;
            sim.state.set_control(ctl.clone());
            let resp = premium.await.unwrap().unwrap();
            assert_eq!(resp.status(), 200);
            resp.text().await.unwrap();
        }
        ctl.waiting = None;
        sim.state.set_control(ctl);
        let resp = free.await.unwrap().unwrap();
        assert_eq!(resp.status(), 200);
        resp.text().await.unwrap();
        drop(holders);
    }
}

#[tokio::test]
async fn a_queue_first_seen_where_seats_are_unknown_is_looked_at_again_soon() {
    // Two engines queueing from the start; the first's seats are configured.
    let (known, unknown) = (start_sim(fast_sim()).await, start_sim(fast_sim()).await);
    for sim in [&known, &unknown] {
        let mut ctl = sim.state.control();
        ctl.waiting = Some(3.0);
        sim.state.set_control(ctl);
    }
    let mut c = config_for(&[known.url(), unknown.url()]);
    c.backends[0].max_concurrency = Some(4);
    // One regular scrape in the test's life: the first, at start.
    c.routing.metrics.interval = Duration::from_secs(600);
    c.routing.metrics.stale_after = Duration::from_secs(1200);
    tenants(&mut c);
    let gw = crate::routing::start_routed(c, 2).await;
    // Where seats are learned, the queue is confirmed by a second look well
    // within the interval (it is what teaches the seats and closes the gate)...
    crate::routing::until_backend(&gw, "the queue confirmed by a second look", |v| {
        crate::routing::backend(v, &unknown)["engine_queued"] == true
    })
    .await;
    // ...which the replica with configured seats did not get: its queue is
    // confirmed at the next regular scrape, as before.
    let (_, text) = get_text(&format!("{}/admin/backends", admin(&gw))).await;
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(crate::routing::backend(&v, &known)["engine_queued"], false);
    assert_eq!(crate::routing::backend(&v, &known)["requests_waiting"], 3.0);
}

#[tokio::test]
async fn requests_the_engine_defers_for_their_kv_are_no_queue_to_the_gate() {
    let (sim, gw) = unknown_seats().await;
    let holders = [hold(&gw, FREE).await, hold(&gw, FREE).await];
    // Scrape after scrape three requests wait, each of them deferred, as
    // vLLM reports a decode replica's requests pulling their KV
    // (`num_requests_waiting_by_reason{reason="deferred"}`).
    let mut c = sim.state.control();
    c.deferred = Some(3.0);
    sim.state.set_control(c.clone());
    crate::routing::until_backend(&gw, "the deferred requests seen", |v| {
        let b = crate::routing::backend(v, &sim);
        b["requests_deferred"] == 3.0 && b["requests_waiting"] == 3.0
    })
    .await;
    // Three scrapes more: two in a row would make a queue that persists.
    let scrapes = &sim.state.metrics.scrapes;
    let seen = scrapes.get();
    wait_until("three scrapes more", Duration::from_secs(10), || async {
        scrapes.get() >= seen + 3
    })
    .await;
    let (_, text) = get_text(&format!("{}/admin/backends", admin(&gw))).await;
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let b = crate::routing::backend(&v, &sim);
    assert_eq!(
        (&b["engine_queued"], &b["seats"]),
        (&false.into(), &serde_json::Value::Null),
        "{v}"
    );
    let deferred = format!(
        "sluice_backend_requests_deferred{{backend=\"{}\"}}",
        b["name"].as_str().unwrap()
    );
    assert_eq!(gateway_metric(&gw, &deferred).await, 3.0);
    // The gate stays open: the next request goes at once.
    let resp = request(&gw, FREE, None).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.text().await.unwrap().contains("[DONE]"));
    assert_eq!(outcomes(&gw, "waited").await, 0.0);
    // The same three waiting for room are a queue: the gate closes and
    // learns the engine's seats.
    c.deferred = None;
    c.waiting = Some(3.0);
    sim.state.set_control(c);
    crate::routing::until_backend(&gw, "the engine's queue persists", |v| {
        let b = crate::routing::backend(v, &sim);
        b["engine_queued"] == true && b["seats"] == 2
    })
    .await;
    drop(holders);
}

#[tokio::test]
async fn an_engine_queue_that_persists_closes_the_gate_and_teaches_its_seats() {
    let (sim, gw) = unknown_seats().await;
    let holders = [hold(&gw, FREE).await, hold(&gw, FREE).await];
    // The engine queues what it cannot take in, scrape after scrape.
    let mut c = sim.state.control();
    c.waiting = Some(3.0);
    sim.state.set_control(c.clone());
    crate::routing::until_backend(&gw, "the engine's queue persists", |v| {
        let b = crate::routing::backend(v, &sim);
        b["engine_queued"] == true && b["seats"] == 2
    })
    .await;
    // Full: a new request waits at the gateway, not in the engine.
    let next = tokio::spawn(request(&gw, FREE, None).send());
    wait_for_waiting(&gw, "0", 1.0).await;
    assert_eq!(sim.state.metrics.received.get(), 2);
    // The queue drains while the engine runs its two: it may hold more, so
    // the gate probes a seat upward and the waiter goes, the two still held.
    c.waiting = None;
    sim.state.set_control(c);
    let resp = next.await.unwrap().unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.text().await.unwrap().contains("[DONE]"));
    assert_eq!(outcomes(&gw, "waited").await, 1.0);
    let (_, text) = get_text(&format!("{}/admin/backends", admin(&gw))).await;
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let seats = crate::routing::backend(&v, &sim)["seats"].as_u64();
    assert!(seats.is_some_and(|n| n >= 3), "{v}");
    drop(holders);
}
