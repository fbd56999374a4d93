//! Prefill/decode disaggregation over real sockets: `sluice sim` replicas in
//! the prefill and decode roles behind the gateway, vLLM's protocol (a
//! one-token prefill leg whose `kv_transfer_params` go with the decode
//! request), its plan and every fallback.

use std::time::Duration;

use futures_util::StreamExt;
use sluice::config::{BackendConfig, Config, Role};
use sluice::server::Gateway;
use sluice::sim::disagg::Role as SimRole;
use sluice::sim::faults::Faults;
use sluice::sim::{SimConfig, SimHandle};

use crate::common::*;
use crate::routing::start_routed;

/// An engine-model replica in `role` (fast: tests only).
pub async fn replica(role: SimRole, tweak: impl FnOnce(&mut SimConfig)) -> SimHandle {
    let mut cfg = SimConfig::engine("tiny", 10.0).unwrap();
    cfg.output_tokens = 6;
    cfg.role = role;
    tweak(&mut cfg);
    start_sim(cfg).await
}

fn backend(sim: &SimHandle, role: Role) -> BackendConfig {
    BackendConfig {
        role,
        ..BackendConfig::from_url(sim.url().parse().unwrap())
    }
}

/// A prefill replica that holds every request 30 s before its first token
/// (its pool is busy from the first one on).
pub fn holding(c: &mut SimConfig) {
    c.faults = Faults::parse("first_token=30s").unwrap();
}

/// `sim`'s metrics stop answering (a look at its engine fails).
fn metrics_hang(sim: &SimHandle) {
    let mut c = sim.state.control();
    c.metrics = sluice::sim::MetricsMode::Hang;
    sim.state.set_control(c);
}

/// One prefill and one decode replica behind a gateway.
async fn fleet(
    prefill: impl FnOnce(&mut SimConfig),
    tweak: impl FnOnce(&mut Config),
) -> (SimHandle, SimHandle, Gateway) {
    let p = replica(SimRole::Prefill, prefill).await;
    let d = replica(SimRole::Decode, |_| {}).await;
    let gw = gateway_over(&[(&p, Role::Prefill), (&d, Role::Decode)], |c| {
        scraped_often(c);
        tweak(c);
    })
    .await;
    (p, d, gw)
}

/// A gateway in front of `replicas`, each in its role, reading their
/// startup scrape alone (idle engines) unless `tweak` says otherwise: what
/// decides is then this gateway's own count of what it sent. Later scrapes
/// on a loaded CI machine could catch a request waiting two scrapes in a
/// row, call that replica full and make the outcome depend on timing.
async fn gateway_over(replicas: &[(&SimHandle, Role)], tweak: impl FnOnce(&mut Config)) -> Gateway {
    let mut c = config_for(&[]);
    c.backends = replicas.iter().map(|(s, r)| backend(s, *r)).collect();
    c.routing.metrics.interval = Duration::from_secs(600);
    c.routing.metrics.stale_after = Duration::from_secs(1200);
    tweak(&mut c);
    start_routed(c, replicas.len()).await
}

/// Replicas scraped every 100 ms (what a test of their engines' word needs).
fn scraped_often(c: &mut Config) {
    c.routing.metrics.interval = Duration::from_millis(100);
    c.routing.metrics.stale_after = Duration::from_secs(30);
}

/// The access log's lines for `ids` (waiting until each is written), in
/// that order.
async fn logged(path: &std::path::Path, ids: &[&str]) -> Vec<serde_json::Value> {
    let read = || -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            // (A line being written is not JSON yet.)
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    let read = &read;
    wait_until(
        "the access log's lines",
        Duration::from_secs(5),
        || async move {
            let lines = read();
            ids.iter()
                .all(|id| lines.iter().any(|l| l["request_id"] == *id))
        },
    )
    .await;
    let lines = read();
    ids.iter()
        .map(|id| {
            lines
                .iter()
                .find(|l| l["request_id"] == *id)
                .unwrap()
                .clone()
        })
        .collect()
}

/// A chat request with a prompt of ~`words` x 2 tokens, distinct per `i`.
fn chat(i: usize, words: usize, stream: bool) -> serde_json::Value {
    let text: String = (0..words).map(|w| format!("q{i}w{w} ")).collect();
    serde_json::json!({
        "model": "sim-model", "stream": stream, "max_tokens": 5,
        "messages": [{"role": "user", "content": text}],
    })
}

async fn last_body(sim: &SimHandle) -> serde_json::Value {
    let (_, text) = get_text(&format!("{}/sim/last_request", sim.url())).await;
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["body"].clone()
}

#[tokio::test]
async fn a_remote_prefill_hands_its_kv_to_the_decode_replica_streamed_and_whole() {
    let (p, d, gw) = fleet(|_| {}, |_| {}).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    for (i, stream) in [(0, true), (1, false)] {
        let (status, _, text) = post(&url, &chat(i, 200, stream)).await;
        assert_eq!(status, 200, "{text}");
        if stream {
            assert!(text.contains("[DONE]"), "{text}");
        } else {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["usage"]["completion_tokens"], 5, "{v}");
            assert!(
                v.get("kv_transfer_params").is_none(),
                "the decode answer is the client's: {v}"
            );
        }
        // The prefill leg: whole, one token, keeping the KV for a remote decode.
        let pb = last_body(&p).await;
        assert_eq!(pb["stream"], false, "{pb}");
        assert_eq!(pb["max_tokens"], 1, "{pb}");
        assert!(pb.get("stream_options").is_none(), "{pb}");
        assert_eq!(pb["kv_transfer_params"]["do_remote_decode"], true, "{pb}");
        // The decode leg: the client's own request, with the prefill's
        // parameters as they came.
        let db = last_body(&d).await;
        assert_eq!(db["stream"], stream, "{db}");
        assert_eq!(db["max_tokens"], 5, "{db}");
        let kv = &db["kv_transfer_params"];
        assert_eq!(kv["do_remote_prefill"], true, "{db}");
        assert_eq!(kv["remote_port"], p.addr.port(), "{db}");
        assert!(kv["remote_request_id"].is_string(), "{db}");
    }
    assert_eq!(p.state.metrics.received.get(), 2);
    assert_eq!(d.state.metrics.received.get(), 2);
    // The decode replica used the pulled KV: it prefilled only the last token.
    assert!(d.state.metrics.prompt_tokens.get() > 0);
    assert_eq!(d.state.metrics.kv_transfer_failures.get(), 0);
    assert_eq!(pd_decisions(&gw, "remote").await, 2.0);
    // Usage counted once: the decode answer's prompt tokens, not both legs'.
    let (_, m) = get_text(&format!("{}/metrics", admin(&gw))).await;
    let prompt = metric_sum(&m, "sluice_prompt_tokens_total");
    let sent = d.state.metrics.prompt_tokens.get() as f64;
    assert_eq!(prompt, sent, "prompt tokens counted once");
    assert!(metric_sum(&m, "sluice_pd_prefill_seconds_count") >= 2.0);
    // TTFT's last part after a remote prefill: the streamed request's.
    assert_eq!(
        metric_sum(&m, "sluice_pd_decode_first_token_seconds_count"),
        1.0
    );
    // Roles are shown.
    let (_, backends) = get_text(&format!("{}/admin/backends", admin(&gw))).await;
    assert!(backends.contains("\"role\":\"prefill\"") && backends.contains("\"role\":\"decode\""));
}

/// An Anthropic Messages request of ~`words` x 2 tokens, distinct per `i`.
fn message(i: usize, words: usize, stream: bool) -> serde_json::Value {
    let text: String = (0..words).map(|w| format!("m{i}w{w} ")).collect();
    serde_json::json!({
        "model": "sim-model", "stream": stream, "max_tokens": 5,
        "system": "You are terse.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
    })
}

#[tokio::test]
async fn messages_are_disaggregated_and_responses_prefilled_on_the_decode_replica() {
    let (p, d, gw) = fleet(|_| {}, |_| {}).await;
    let url = format!("{}/v1/messages", api(&gw));
    for (i, stream) in [(0, true), (1, false)] {
        let (status, _, text) = post(&url, &message(i, 200, stream)).await;
        assert_eq!(status, 200, "{text}");
        if stream {
            assert!(text.contains("event: message_stop"), "{text}");
        } else {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["type"], "message", "{v}");
            assert_eq!(v["usage"]["output_tokens"], 5, "{v}");
            assert!(v.get("kv_transfer_params").is_none(), "{v}");
        }
        // The prefill leg: Messages, whole, one token, keeping the KV.
        let pb = last_body(&p).await;
        assert_eq!(pb["stream"], false, "{pb}");
        assert_eq!(pb["max_tokens"], 1, "{pb}");
        assert_eq!(pb["system"], "You are terse.", "{pb}");
        assert_eq!(pb["kv_transfer_params"]["do_remote_decode"], true, "{pb}");
        // The decode leg: the client's own, with the prefill's parameters.
        let db = last_body(&d).await;
        assert_eq!(db["stream"], stream, "{db}");
        assert_eq!(db["max_tokens"], 5, "{db}");
        assert_eq!(db["kv_transfer_params"]["do_remote_prefill"], true, "{db}");
        assert_eq!(db["kv_transfer_params"]["remote_port"], p.addr.port());
    }
    assert_eq!(pd_decisions(&gw, "remote").await, 2.0);
    assert_eq!(d.state.metrics.kv_transfer_failures.get(), 0);
    let (_, m) = get_text(&format!("{}/metrics", admin(&gw))).await;
    assert_eq!(
        metric_sum(&m, "sluice_prompt_tokens_total"),
        d.state.metrics.prompt_tokens.get() as f64,
        "prompt tokens counted once, from the decode answer"
    );

    // Responses: vLLM's answers carry no transfer parameters, so the decode
    // replica prefills; the prefill replica is not asked.
    let asked = p.state.metrics.received.get();
    let (status, _, text) = post(
        &format!("{}/v1/responses", api(&gw)),
        &serde_json::json!({"model": "sim-model", "input": "hello ".repeat(300), "max_output_tokens": 5}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(p.state.metrics.received.get(), asked);
    let db = last_body(&d).await;
    assert!(db.get("kv_transfer_params").is_none(), "{db}");
    assert_eq!(pd_decisions(&gw, "local_api").await, 1.0);
}

#[tokio::test]
async fn under_sglangs_protocol_messages_are_prefilled_on_the_decode_replica() {
    // SGLang's Messages API takes no bootstrap fields.
    let (p, d, gw) = sglang_fleet(|_| {}).await;
    let (status, _, text) =
        post(&format!("{}/v1/messages", api(&gw)), &message(0, 100, true)).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("event: message_stop"), "{text}");
    assert_eq!(p.state.metrics.received.get(), 0);
    let db = last_body(&d).await;
    assert!(db.get("bootstrap_room").is_none(), "{db}");
    assert_eq!(pd_decisions(&gw, "local_api").await, 1.0);
    // Chat still has both legs.
    let (status, _, text) = post(
        &format!("{}/v1/chat/completions", api(&gw)),
        &chat(1, 100, false),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(pd_decisions(&gw, "remote").await, 1.0);
}

#[tokio::test]
async fn the_official_sdks_through_a_disaggregated_fleet_are_counted_once() {
    use crate::protocols::{assert_counted, keyed, sdk};
    let (p, d, gw) = fleet(
        |_| {},
        |c| *c = keyed(c.clone(), sluice::config::TierConfig::default()),
    )
    .await;
    for (mode, reason) in [("messages", "remote"), ("responses", "local_api")] {
        let v = sdk(mode, &gw).await;
        // Prompt and output as the client saw them, counted once (cached
        // tokens are the prefill replica's: not the client's).
        assert_counted(&v, false);
        assert!(pd_decisions(&gw, reason).await >= 4.0, "{mode}: {v}");
    }
    assert!(p.state.metrics.received.get() >= 6);
    assert_eq!(d.state.metrics.kv_transfer_failures.get(), 0);
}

/// Sum of every series of a family in a `/metrics` text.
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn a_failing_prefill_replica_falls_back_to_a_local_prefill() {
    let (p, d, gw) = fleet(
        |c| {
            c.faults = Faults::parse("error=500").unwrap();
        },
        |_| {},
    )
    .await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let (status, _, text) = post(&url, &chat(0, 200, true)).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("[DONE]"));
    assert!(p.state.metrics.received.get() >= 1, "the prefill was tried");
    let db = last_body(&d).await;
    assert!(
        db.get("kv_transfer_params").is_none(),
        "prefilled locally: {db}"
    );
    assert_eq!(pd_decisions(&gw, "local_fallback").await, 1.0);
}

#[tokio::test]
async fn without_the_local_fallback_a_failed_prefill_is_a_503() {
    let (_p, d, gw) = fleet(
        |c| {
            c.faults = Faults::parse("error=500").unwrap();
        },
        |c| c.routing.disaggregation.local_fallback = false,
    )
    .await;
    let (status, _, text) = post(
        &format!("{}/v1/chat/completions", api(&gw)),
        &chat(0, 200, false),
    )
    .await;
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("local_fallback"), "{text}");
    assert_eq!(d.state.metrics.received.get(), 0);
}

#[tokio::test]
async fn kv_the_decode_replica_cannot_fetch_is_prefilled_there_instead() {
    // The prefill replica keeps no KV past its answer: it is gone when the
    // decode replica asks for it. (Kept a millisecond, a decode replica
    // asking within it found it once in a parallel run.)
    let (_p, d, gw) = fleet(|c| c.kv_ttl = Duration::ZERO, |_| {}).await;
    let (status, _, text) = post(
        &format!("{}/v1/chat/completions", api(&gw)),
        &chat(0, 200, true),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("[DONE]"));
    assert_eq!(d.state.metrics.kv_transfer_failures.get(), 1);
    let db = last_body(&d).await;
    assert!(
        db.get("kv_transfer_params").is_none(),
        "asked again locally: {db}"
    );
    assert_eq!(pd_decisions(&gw, "local_kv_fetch_failed").await, 1.0);
    assert_eq!(pd_decisions(&gw, "remote").await, 0.0);
}

#[tokio::test]
async fn a_prompt_the_decode_replica_holds_is_prefilled_there() {
    // (Allowed: by default a decode replica prefills only as a fallback.)
    let (p, d, gw) = fleet(
        |_| {},
        |c| {
            c.routing.disaggregation.local_max_tokens = None;
        },
    )
    .await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let body = chat(7, 200, false);
    assert_eq!(post(&url, &body).await.0, 200);
    assert_eq!(p.state.metrics.received.get(), 1);
    // The same prompt again: the decode replica has it (routing's index).
    assert_eq!(post(&url, &body).await.0, 200);
    assert_eq!(
        p.state.metrics.received.get(),
        1,
        "no second remote prefill"
    );
    assert_eq!(d.state.metrics.received.get(), 2);
    assert_eq!(pd_decisions(&gw, "local_cached").await, 1.0);
}

#[tokio::test]
async fn a_sessions_turns_keep_one_prefill_replica_and_new_ones_go_where_fewest_went() {
    // Two prefill replicas, one decode replica; every session opens with the
    // same long system prompt (its first blocks are every prompt's), so
    // prefix affinity alone would send every prefill to that prompt's home.
    let p1 = replica(SimRole::Prefill, |_| {}).await;
    let p2 = replica(SimRole::Prefill, |_| {}).await;
    let d = replica(SimRole::Decode, |_| {}).await;
    let pool = [
        (&p1, Role::Prefill),
        (&p2, Role::Prefill),
        (&d, Role::Decode),
    ];
    let gw = gateway_over(&pool, |_| {}).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let system = "You are a coding agent working in a large repository. ".repeat(40);
    let served = || {
        [
            p1.state.metrics.received.get(),
            p2.state.metrics.received.get(),
        ]
    };
    let mut homes = [0; 2];
    for session in 0..8 {
        let id = format!("agent-{session}");
        let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
        let mut seen = Vec::new();
        for turn in 0..3 {
            messages.push(serde_json::json!({"role": "user", "content": format!("Session {session}, step {turn}: run the tests.")}));
            let body =
                serde_json::json!({"model": "sim-model", "max_tokens": 5, "messages": messages});
            let before = served();
            let (status, _, text) = post_with(&url, &body, &[("x-session-id", id.as_str())]).await;
            assert_eq!(status, 200, "{text}");
            let after = served();
            let went: Vec<usize> = (0..2).filter(|&i| after[i] > before[i]).collect();
            assert_eq!(
                went.len(),
                1,
                "one remote prefill a turn: {before:?} -> {after:?}"
            );
            seen.push(went[0]);
            let answer =
                serde_json::from_str::<serde_json::Value>(&text).unwrap()["choices"][0]["message"]
                    ["content"]
                    .clone();
            messages.push(serde_json::json!({"role": "assistant", "content": answer}));
        }
        assert!(
            seen.iter().all(|&i| i == seen[0]),
            "session {session} prefilled on {seen:?}"
        );
        homes[seen[0]] += 1;
    }
    // Placed by load (`routing.disaggregation.session_placement:
    // least_loaded`, the default): each new session where the fewest
    // sessions are, so four each whatever the keys' order.
    assert_eq!(homes, [4, 4], "sessions per prefill replica");
    assert_eq!(pd_decisions(&gw, "remote").await, 24.0);
}

/// A session's prefill leaves a prefill replica whose engine queues and
/// lately lost what it was sent (the cached tokens it reported fell short of
/// the session's history) for a replica that does neither, and is placed
/// anew there (`rehome` in the access log); it stays while the replica only
/// evicted, and stays where it moved.
#[tokio::test]
async fn a_sessions_prefill_leaves_a_replica_that_queues_and_lost_its_history() {
    // Caches of 1,536 tokens: one long prompt sent straight to a replica
    // evicts a session's history there.
    let small = |c: &mut SimConfig| {
        if let Some(p) = c.profile.as_mut() {
            p.num_blocks = 96;
        }
    };
    let p1 = replica(SimRole::Prefill, small).await;
    let p2 = replica(SimRole::Prefill, small).await;
    let d = replica(SimRole::Decode, |_| {}).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("access.log");
    let pool = [
        (&p1, Role::Prefill),
        (&p2, Role::Prefill),
        (&d, Role::Decode),
    ];
    let gw = gateway_over(&pool, |c| {
        // Scraped often: the replica's queue is what moves the session.
        scraped_often(c);
        // Every prompt prefilled remotely, whatever the decode replica holds
        // or however busy the prefill pool looks.
        c.routing.disaggregation.local_share = 1.0;
        c.routing.disaggregation.local_when_idle = false;
        c.telemetry.access_log.enabled = true;
        c.telemetry.access_log.target = sluice::config::LogTarget::File;
        c.telemetry.access_log.path = Some(path.clone());
    })
    .await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let sims = [&p1, &p2];
    let served = || sims.map(|s| s.state.metrics.received.get());
    let mut messages = vec![serde_json::json!({
        "role": "system",
        "content": "You are a coding agent working in a large repository. ".repeat(36),
    })];
    // One turn of the session: the prefill replica it went to.
    let mut turn = async |n: usize| {
        messages.push(
            serde_json::json!({"role": "user", "content": format!("Step {n}: run the tests.")}),
        );
        let body = serde_json::json!({"model": "sim-model", "max_tokens": 5, "messages": messages});
        let before = served();
        let id = format!("rehome-{n}");
        let (status, _, text) = post_with(
            &url,
            &body,
            &[("x-session-id", "agent-1"), ("x-request-id", id.as_str())],
        )
        .await;
        assert_eq!(status, 200, "{text}");
        let after = served();
        let went: Vec<usize> = (0..2).filter(|&i| after[i] > before[i]).collect();
        assert_eq!(went.len(), 1, "one prefill a turn: {before:?} -> {after:?}");
        let answer = serde_json::from_str::<serde_json::Value>(&text).unwrap()["choices"][0]
            ["message"]["content"]
            .clone();
        messages.push(serde_json::json!({"role": "assistant", "content": answer}));
        went[0]
    };
    let home = turn(0).await;
    let other = 1 - home;
    // Another prompt, sent straight to the session's replica, evicts its
    // history there.
    evict_with_a_long_prompt(sims[home]).await;
    // Evicted but not queueing: the session stays (and the engine's answer
    // tells the gateway its history is gone).
    assert_eq!(turn(1).await, home, "stays while its replica only evicted");
    // Now its engine keeps a queue, scrape after scrape.
    let mut queued = sims[home].state.control();
    queued.waiting = Some(4.0);
    sims[home].state.set_control(queued.clone());
    let backends = format!("{}/admin/backends", admin(&gw));
    let name = |i: usize| format!("127.0.0.1:{}", sims[i].addr.port());
    let home_name = name(home);
    // (Within the 5-10 s the gateway remembers the eviction: a few scrapes.)
    wait_until(
        "the session's replica seen queueing",
        Duration::from_secs(4),
        || {
            let (backends, home_name) = (&backends, &home_name);
            async move {
                let (_, text) = get_text(backends).await;
                serde_json::from_str::<serde_json::Value>(&text)
                    .unwrap()
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|b| b["name"] == home_name.as_str() && b["engine_queued"] == true)
            }
        },
    )
    .await;
    assert_eq!(
        turn(2).await,
        other,
        "left the replica that queues and lost it"
    );
    queued.waiting = None;
    sims[home].state.set_control(queued);
    assert_eq!(turn(3).await, other, "stays where it moved");
    let [first, second, third, fourth] =
        <[_; 4]>::try_from(logged(&path, &["rehome-0", "rehome-1", "rehome-2", "rehome-3"]).await)
            .unwrap();
    assert_eq!(second["prefill_route_reason"], "session", "{second}");
    assert_eq!(third["prefill_route_reason"], "rehome", "{third}");
    assert_eq!(third["prefill_backend"], name(other).as_str(), "{third}");
    assert_eq!(fourth["prefill_route_reason"], "session", "{fourth}");
    for l in [&first, &second, &third, &fourth] {
        assert_eq!(l["pd"], "remote", "{l}");
    }
}

#[tokio::test]
async fn decode_legs_leave_the_prefixs_holder_when_another_generates_two_streams_fewer() {
    // One prefill and two decode replicas; every request shares one long
    // system prompt, so the prefix policy alone would send every decode leg
    // to its holder (and predicted TTFT would detour none away from it).
    let p = replica(SimRole::Prefill, |_| {}).await;
    let long = |c: &mut SimConfig| c.output_tokens = 400;
    let d1 = replica(SimRole::Decode, long).await;
    let d2 = replica(SimRole::Decode, long).await;
    let pool = [
        (&p, Role::Prefill),
        (&d1, Role::Decode),
        (&d2, Role::Decode),
    ];
    let gw = gateway_over(&pool, |_| {}).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let body = |i: usize| {
        serde_json::json!({
            "model": "sim-model", "stream": true, "max_tokens": 400,
            "messages": [
                {"role": "system", "content": "Summarise the design document. ".repeat(60)},
                {"role": "user", "content": format!("Question {i}: what changed?")},
            ],
        })
    };
    let served = || {
        [
            d1.state.metrics.received.get(),
            d2.state.metrics.received.get(),
        ]
    };
    // Each stream is under way (its first bytes read) before the next is
    // sent: the next finds one more in flight on the replica serving it.
    let mut open = Vec::new();
    for i in 0..6 {
        let mut resp = client().post(&url).json(&body(i)).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        assert!(resp.chunk().await.unwrap().is_some());
        open.push(resp);
    }
    let split = served();
    assert_eq!(split[0] + split[1], 6);
    assert!(
        split.iter().all(|&n| n >= 2),
        "decode legs kept within two streams of each other: {split:?}"
    );
    for mut resp in open {
        while resp.chunk().await.unwrap().is_some() {}
    }
    assert_eq!(pd_decisions(&gw, "remote").await, 6.0);
    let left = gateway_metric(
        &gw,
        r#"sluice_routing_decisions_total{model="sim-model",reason="spill_load"}"#,
    )
    .await;
    assert!(left >= 1.0, "{left} decode legs left the holder");
}

/// Over vLLM's protocol a decode replica pulls only the prompt tokens its
/// own prefix cache lacks (vLLM's NIXL and Mooncake connectors: the prompt
/// less what it has computed): a prompt it already holds costs its new part's
/// transfer, not the whole prompt's.
#[tokio::test]
async fn a_decode_replica_pulls_only_the_kv_its_cache_lacks() {
    let p = replica(SimRole::Prefill, |_| {}).await;
    // ~400-token prompts of 64 KiB a token at speed 10: 2 s a whole transfer.
    let d = replica(SimRole::Decode, |c| {
        c.kv_bandwidth = 400.0 * 65_536.0 / (2.0 * 10.0);
    })
    .await;
    let mut c = config_for(&[]);
    c.backends = vec![backend(&p, Role::Prefill), backend(&d, Role::Decode)];
    let gw = start_routed(c, 2).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let first = chat(3, 200, false);
    let pulled = || d.state.metrics.kv_pulled_tokens.get();
    let t = std::time::Instant::now();
    assert_eq!(post(&url, &first).await.0, 200);
    let whole = t.elapsed();
    let whole_tokens = pulled();
    // The same conversation and a short new message: the decode replica
    // holds all but the new part.
    let mut next = first.clone();
    next["messages"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"role": "user", "content": "and then?"}));
    assert_eq!(post(&url, &next).await.0, 200);
    let part_tokens = pulled() - whole_tokens;
    assert_eq!(
        pd_decisions(&gw, "remote").await,
        2.0,
        "both prefilled remotely"
    );
    // (Counted, not timed: the transfer time follows the tokens pulled.)
    assert!(whole_tokens >= 300, "whole prompt pulled: {whole_tokens}");
    assert!(
        (1..=32).contains(&part_tokens),
        "only the new part pulled: {part_tokens} tokens against {whole_tokens}"
    );
    // The whole prompt's transfer took its time (an order of magnitude).
    assert!(whole >= Duration::from_millis(500), "{whole:?}");
}

/// A slow KV path: the decode replica takes ~300 ms to pull each prompt's
/// KV. The doctor names the model's slow transfers from the gateway's own
/// timing of the decode legs.
#[tokio::test]
async fn slow_kv_transfers_are_named_on_the_model() {
    let p = replica(SimRole::Prefill, |_| {}).await;
    // ~400-token prompts of 64 KiB a token at speed 10: 300 ms a transfer.
    let d = replica(SimRole::Decode, |c| {
        c.kv_bandwidth = 400.0 * 65_536.0 / (0.3 * 10.0);
    })
    .await;
    let gw = gateway_over(&[(&p, Role::Prefill), (&d, Role::Decode)], |c| {
        scraped_often(c);
        c.doctor.window = Duration::from_secs(3);
        c.doctor.drift_min_requests = 3;
        c.doctor.kv_transfer_slow = Duration::from_millis(100);
    })
    .await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let named = async {
        for i in 0.. {
            // Distinct prompts, each prefilled remotely; streamed (the
            // decode leg's first token is timed).
            assert_eq!(post(&url, &chat(i, 200, true)).await.0, 200);
            let (_, body) = get_text(&format!("{}/admin/diagnose", admin(&gw))).await;
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            if let Some(f) = v["findings"]
                .as_array()
                .unwrap()
                .iter()
                .find(|f| f["pathology"] == "kv_transfer_slow")
            {
                return f.clone();
            }
        }
        unreachable!()
    };
    let f = tokio::time::timeout(Duration::from_secs(30), named)
        .await
        .expect("kv_transfer_slow named");
    assert_eq!(f["model"], "sim-model", "{f}");
    let mean = f["evidence"]["mean_decode_first_token_seconds"]
        .as_f64()
        .unwrap();
    assert!(mean >= 0.1, "{f}");
    assert!(pd_decisions(&gw, "remote").await >= 3.0);
}

/// A decode leg waiting for its prompt's KV (over vLLM's protocol, a slow
/// transfer; over SGLang's, its room's prefill, held 30 s) is waiting at its
/// replica, which the engine reports apart from its queue (vLLM's
/// `reason="deferred"`, SGLang's transfer queue): scrape after scrape it
/// does not make the replica full. The client leaving ends the wait there.
#[tokio::test]
async fn a_decode_leg_waiting_for_its_kv_is_no_queue_under_either_protocol() {
    let p = replica(SimRole::Prefill, |_| {}).await;
    // ~250-token prompts of 64 KiB a token at speed 10: over a minute each.
    let d = replica(SimRole::Decode, |c| {
        c.kv_bandwidth = 200.0 * 65_536.0 / (60.0 * 10.0);
    })
    .await;
    let vllm = gateway_over(&[(&p, Role::Prefill), (&d, Role::Decode)], scraped_often).await;
    let (_sp, sd, sglang) = sglang_fleet(holding).await;
    for (gw, d) in [(&vllm, &d), (&sglang, &sd)] {
        let url = format!("{}/v1/chat/completions", api(gw));
        let sent =
            tokio::spawn(async move { client().post(&url).json(&chat(0, 200, true)).send().await });
        crate::routing::until_backend(gw, "the decode leg waiting for its KV", |v| {
            let b = crate::routing::backend(v, d);
            b["requests_deferred"] == 1.0 && b["requests_waiting"] == 1.0
        })
        .await;
        // Three scrapes more: two in a row would make a queue that persists.
        let scrapes = &d.state.metrics.scrapes;
        let seen = scrapes.get();
        wait_until("three scrapes more", Duration::from_secs(10), || async {
            scrapes.get() >= seen + 3
        })
        .await;
        let (_, text) = get_text(&format!("{}/admin/backends", admin(gw))).await;
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let b = crate::routing::backend(&v, d);
        assert_eq!(
            (&b["engine_queued"], &b["requests_deferred"]),
            (&false.into(), &1.0.into()),
            "{v}"
        );
        sent.abort();
        let pulling = &d.state.metrics.pulling;
        wait_until("the leg's wait ended", Duration::from_secs(5), || async {
            pulling.get() == 0
        })
        .await;
    }
}

/// With `local_max_tokens`, a prompt the decode replica holds is prefilled
/// there only while what is left to prefill is that small: the same
/// prompt with a longer new part goes to the prefill replica.
#[tokio::test]
async fn local_max_tokens_bounds_what_a_decode_replica_prefills_by_choice() {
    let (p, d, gw) = fleet(
        |_| {},
        |c| {
            c.routing.disaggregation.local_max_tokens = Some(64);
        },
    )
    .await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let body = chat(7, 200, false);
    assert_eq!(post(&url, &body).await.0, 200);
    // The same prompt: nothing left to prefill, local.
    assert_eq!(post(&url, &body).await.0, 200);
    assert_eq!(p.state.metrics.received.get(), 1);
    assert_eq!(pd_decisions(&gw, "local_cached").await, 1.0);
    // The same prompt and ~180 new tokens: two thirds of it are held
    // there, but the rest is over the bound: remote.
    let mut longer = body.clone();
    let extra: String = (0..150).map(|w| format!("x{w} ")).collect();
    longer["messages"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"role": "user", "content": extra}));
    assert_eq!(post(&url, &longer).await.0, 200);
    assert_eq!(p.state.metrics.received.get(), 2, "prefilled remotely");
    assert_eq!(d.state.metrics.received.get(), 3);
    assert_eq!(pd_decisions(&gw, "remote").await, 2.0);
}

/// A first prompt of ~400 tokens sent through `url` (a gateway whose pool
/// was idle: prefilled remotely), once prefill replica `p` has it (it holds
/// every request 30 s: the pool is busy from then on).
pub async fn first_prompt_queued(p: &SimHandle, url: &str) -> tokio::task::JoinHandle<()> {
    sent_to_pool(p, url, chat(0, 200, true), 1).await
}

/// `body` sent through `url`, once prefill replica `p` has received
/// `received` requests (it went to the prefill pool).
async fn sent_to_pool(
    p: &SimHandle,
    url: &str,
    body: serde_json::Value,
    received: u64,
) -> tokio::task::JoinHandle<()> {
    let sent = tokio::spawn({
        let url = url.to_string();
        async move {
            let _ = post(&url, &body).await;
        }
    });
    wait_until(
        "the prompt reached the prefill replica",
        Duration::from_secs(5),
        || async { p.state.metrics.received.get() == received },
    )
    .await;
    sent
}

/// The prefill replica holds every request 30 s, and a first prompt of ~400
/// tokens is queued there (sent remote: the pool was idle). What happens to
/// a second prompt of ~40 tokens while the decode replica decodes nothing.
async fn second_prompt_with_the_pool_busy(
    local_when_idle: bool,
) -> (
    SimHandle,
    SimHandle,
    Gateway,
    Vec<tokio::task::JoinHandle<()>>,
) {
    let (p, d, gw) = fleet(holding, |c| {
        c.routing.disaggregation.local_when_idle = local_when_idle
    })
    .await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let first = first_prompt_queued(&p, &url).await;
    let second = tokio::spawn(async move {
        let _ = post(&url, &chat(1, 20, false)).await;
    });
    (p, d, gw, vec![first, second])
}

#[tokio::test]
async fn an_idle_decode_replica_prefills_what_the_busy_pool_would_queue() {
    let (p, d, gw, held) = second_prompt_with_the_pool_busy(true).await;
    wait_until(
        "the second prompt answered by the decode replica",
        Duration::from_secs(10),
        || async { pd_decisions(&gw, "local_idle").await == 1.0 },
    )
    .await;
    assert_eq!(
        p.state.metrics.received.get(),
        1,
        "no second remote prefill"
    );
    assert_eq!(d.state.metrics.received.get(), 1);
    let db = last_body(&d).await;
    assert!(
        db.get("kv_transfer_params").is_none(),
        "prefilled there: {db}"
    );
    // A decode replica with a queue (another gateway's streams, as its
    // scrape shows them) is not idle: the next prompt goes to the pool.
    let mut c = d.state.control();
    c.waiting = Some(1.0);
    d.state.set_control(c);
    let decode = d.url().trim_start_matches("http://").to_string();
    let pool = gw.state().pool.clone();
    wait_until(
        "the decode replica's queue scraped",
        Duration::from_secs(5),
        || {
            let pool = pool.clone();
            let decode = decode.clone();
            async move {
                pool.replicas()
                    .iter()
                    .any(|r| *r.name == *decode && r.load().and_then(|l| l.waiting) == Some(1.0))
            }
        },
    )
    .await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let third = tokio::spawn(async move {
        let _ = post(&url, &chat(2, 20, false)).await;
    });
    wait_until(
        "the third prompt sent to the prefill pool",
        Duration::from_secs(5),
        || async { p.state.metrics.received.get() == 2 },
    )
    .await;
    assert_eq!(pd_decisions(&gw, "local_idle").await, 1.0);
    for h in held.into_iter().chain([third]) {
        h.abort();
    }
}

#[tokio::test]
async fn with_local_when_idle_off_the_busy_pool_queues_it() {
    let (p, _d, gw, held) = second_prompt_with_the_pool_busy(false).await;
    wait_until(
        "the second prompt sent to the prefill pool",
        Duration::from_secs(5),
        || async { p.state.metrics.received.get() == 2 },
    )
    .await;
    assert_eq!(pd_decisions(&gw, "local_idle").await, 0.0);
    for h in held {
        h.abort();
    }
}

/// A stream of prompt 2 sent through `url`, held by its replica after its
/// second token for 30 s, once its first bytes came.
async fn held_stream(url: &str) -> reqwest::Response {
    let mut running = client()
        .post(url)
        .header("x-sim-fault", "stall=2:30s")
        .json(&chat(2, 20, true))
        .send()
        .await
        .unwrap();
    assert_eq!(running.status(), 200);
    assert!(running.chunk().await.unwrap().is_some());
    running
}

async fn decode_looks(gw: &Gateway, outcome: &str) -> f64 {
    gateway_metric(
        gw,
        &format!("sluice_pd_decode_looks_total{{model=\"sim-model\",outcome=\"{outcome}\"}}"),
    )
    .await
}

/// Two gateways in front of one prefill and one decode replica, each
/// reading its startup scrape alone (idle engines). A stream gateway B
/// started on the decode replica is in neither's scrape; gateway A, whose
/// own count there is nothing, looks at the engine before prefilling a
/// prompt there as on an idle replica, and sends it to the pool instead.
#[tokio::test]
async fn a_stream_another_gateway_started_since_the_scrape_keeps_a_prefill_off_its_replica() {
    // The prefill replica holds every request 30 s.
    let p = replica(SimRole::Prefill, holding).await;
    let d = replica(SimRole::Decode, |_| {}).await;
    let replicas = [(&p, Role::Prefill), (&d, Role::Decode)];
    let (a, b) = (
        gateway_over(&replicas, |_| {}).await,
        gateway_over(&replicas, |_| {}).await,
    );
    let (url_a, url_b) = (
        format!("{}/v1/chat/completions", api(&a)),
        format!("{}/v1/chat/completions", api(&b)),
    );
    // Through B: a prompt queued in the pool, then a stream prefilled on
    // the idle decode replica (the look confirms its scrape) and held
    // there mid-way.
    let mut held = vec![first_prompt_queued(&p, &url_b).await];
    let running = held_stream(&url_b).await;
    assert_eq!(d.state.metrics.received.get(), 1, "prefilled there");
    assert_eq!(decode_looks(&b, "confirmed").await, 1.0);
    // Through A: a prompt queued in the pool (A's pool is busy too)...
    held.push(sent_to_pool(&p, &url_a, chat(3, 200, true), 2).await);
    // ...then one its scrape would prefill on the idle decode replica: the
    // engine runs B's stream, so it goes to the pool.
    held.push(sent_to_pool(&p, &url_a, chat(4, 20, false), 3).await);
    assert_eq!(d.state.metrics.received.get(), 1, "not prefilled there");
    assert_eq!(decode_looks(&a, "refused").await, 1.0);
    assert_eq!(decode_looks(&a, "confirmed").await, 0.0);
    drop(running);
    for h in held {
        h.abort();
    }
}

/// A prefill replica holding every request 30 s (a first prompt queued
/// there) and a decode replica, behind a gateway with `local_stall_share`
/// 0.009 reading its startup scrape alone (the streams counted are its
/// own), once the decode replica has earned an allowance of 1.8 stalls (a
/// 200-token stream prefilled and decoded there while idle: 199 gaps) and
/// decodes one stream held mid-way (as long as `_running` is kept).
struct Allowance {
    p: SimHandle,
    d: SimHandle,
    gw: Gateway,
    url: String,
    held: Vec<tokio::task::JoinHandle<()>>,
    _running: reqwest::Response,
}

async fn allowance_with_a_stream_held() -> Allowance {
    let p = replica(SimRole::Prefill, holding).await;
    let d = replica(SimRole::Decode, |c| c.output_tokens = 200).await;
    let gw = gateway_over(&[(&p, Role::Prefill), (&d, Role::Decode)], |c| {
        c.routing.disaggregation.local_stall_share = 0.009;
    })
    .await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let decode = d.url().trim_start_matches("http://").to_string();
    let pool = gw.state().pool.clone();
    let in_flight_on_decode = || {
        pool.replicas()
            .iter()
            .find(|r| *r.name == *decode)
            .map(|r| r.in_flight())
    };
    // A first prompt queued in the pool (sent remote: it was idle).
    let held = vec![first_prompt_queued(&p, &url).await];
    // A stream of 200 tokens prefilled and decoded on the idle decode
    // replica: 199 gaps relayed, an allowance of 0.009 x 199 = 1.8 stalls.
    let mut long = chat(1, 20, true);
    long["max_tokens"] = 200.into();
    let (status, _, text) = post(&url, &long).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(pd_decisions(&gw, "local_idle").await, 1.0);
    wait_until(
        "the stream's end counted",
        Duration::from_secs(5),
        || async { in_flight_on_decode() == Some(0) },
    )
    .await;
    // A stream held mid-way on the decode replica (idle: prefilled there
    // too).
    let running = held_stream(&url).await;
    // (Decisions are counted when their request ends.)
    assert_eq!(p.state.metrics.received.get(), 1, "prefilled there");
    assert_eq!(d.state.metrics.received.get(), 2);
    assert_eq!(in_flight_on_decode(), Some(1));
    Allowance {
        p,
        d,
        gw,
        url,
        held,
        _running: running,
    }
}

/// With `local_stall_share`, a decode replica that decodes a stream
/// prefills a prompt the busy pool would queue while the stalled gaps it
/// causes fit the share of the gaps this gateway relayed from it, and not
/// once they no longer do.
#[tokio::test]
async fn a_busy_decode_replica_prefills_within_its_stall_allowance() {
    let Allowance {
        p,
        d,
        gw,
        url,
        mut held,
        _running,
    } = allowance_with_a_stream_held().await;
    // The next prompt stalls that one stream once (one chunk): within the
    // allowance, prefilled there.
    let (status, _, text) = post(&url, &chat(3, 20, false)).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(pd_decisions(&gw, "local_stall_budget").await, 1.0);
    assert_eq!(
        p.state.metrics.received.get(),
        1,
        "no second remote prefill"
    );
    assert_eq!(d.state.metrics.received.get(), 3);
    // The one after would spend 2 of 1.8: it goes to the pool.
    held.push(sent_to_pool(&p, &url, chat(4, 20, false), 2).await);
    assert_eq!(d.state.metrics.received.get(), 3, "not prefilled there");
    for h in held {
        h.abort();
    }
}

/// A local prefill its decode replica refused (503: the engine ran
/// nothing) gives back what it spent of the allowance: the next prompt,
/// which would not fit beside a charge kept, is prefilled there.
#[tokio::test]
async fn a_local_prefill_its_decode_replica_refused_gives_its_allowance_back() {
    let Allowance {
        p,
        d,
        gw,
        url,
        held,
        _running,
    } = allowance_with_a_stream_held().await;
    // Within the allowance (one stall of 1.8), planned there; refused.
    let refused = client()
        .post(&url)
        .header("x-sim-fault", "error=503")
        .json(&chat(3, 20, false))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    assert_eq!(d.state.metrics.received.get(), 3, "refused there");
    assert_eq!(pd_decisions(&gw, "local_stall_budget").await, 1.0);
    // One stall more: 2 of 1.8 had the refused one's been kept (then it
    // would go to the pool, which holds it).
    let next = tokio::spawn(async move { post(&url, &chat(4, 20, false)).await });
    let (p_got, d_got) = (&p.state.metrics.received, &d.state.metrics.received);
    wait_until("the next prompt sent", Duration::from_secs(5), || async {
        p_got.get() == 2 || d_got.get() == 4
    })
    .await;
    assert_eq!(p.state.metrics.received.get(), 1, "not sent to the pool");
    let (status, _, text) = next.await.unwrap();
    assert_eq!(status, 200, "{text}");
    assert_eq!(d.state.metrics.received.get(), 4, "prefilled there");
    assert_eq!(pd_decisions(&gw, "local_stall_budget").await, 2.0);
    for h in held {
        h.abort();
    }
}

/// A decode replica whose metrics stopped answering gets no prefill by
/// choice: the look fails within its timeout, the prompt its last scrape
/// would prefill there as on an idle replica goes to the pool, and the look
/// is counted `failed`.
#[tokio::test]
async fn a_decode_replica_whose_metrics_hang_gets_no_prefill_by_choice() {
    // The prefill replica holds every request 30 s.
    let p = replica(SimRole::Prefill, holding).await;
    let d = replica(SimRole::Decode, |_| {}).await;
    // (Its startup scrape alone: the decode replica idle by it.)
    let gw = gateway_over(&[(&p, Role::Prefill), (&d, Role::Decode)], |_| {}).await;
    metrics_hang(&d);
    let url = format!("{}/v1/chat/completions", api(&gw));
    let mut held = vec![first_prompt_queued(&p, &url).await];
    held.push(sent_to_pool(&p, &url, chat(1, 20, false), 2).await);
    assert_eq!(d.state.metrics.received.get(), 0, "not prefilled there");
    assert_eq!(decode_looks(&gw, "failed").await, 1.0);
    assert_eq!(decode_looks(&gw, "confirmed").await, 0.0);
    assert_eq!(decode_looks(&gw, "refused").await, 0.0);
    for h in held {
        h.abort();
    }
}

/// Without scrapes (`routing.metrics.enabled: false`) the gateway counts
/// the streams on a decode replica by its own requests there and looks at
/// no engine: a prompt prefills under its own stream within the allowance
/// (the decode replica's metrics hang: a look would send it to the pool),
/// and no look is counted.
#[tokio::test]
async fn without_scrapes_the_allowance_counts_this_gateways_streams_and_looks_at_nothing() {
    let p = replica(SimRole::Prefill, |_| {}).await;
    let d = replica(SimRole::Decode, |c| c.output_tokens = 200).await;
    metrics_hang(&d);
    let mut cfg = config_for(&[]);
    cfg.backends = vec![backend(&p, Role::Prefill), backend(&d, Role::Decode)];
    cfg.routing.metrics.enabled = false;
    cfg.routing.disaggregation.local_stall_share = 0.009;
    let gw = start_gateway(cfg, 2).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    // A stream of 200 tokens prefilled in the idle pool and decoded on the
    // decode replica: 199 gaps relayed, an allowance of 0.009 x 199 = 1.8.
    let mut long = chat(0, 20, true);
    long["max_tokens"] = 200.into();
    let (status, _, text) = post(&url, &long).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(pd_decisions(&gw, "remote").await, 1.0);
    // A prompt held 30 s in the pool (its prefill leg), and a stream held
    // mid-way on the decode replica (prefilled in the pool too: with
    // nothing decoding there by this gateway's count, no stall to charge).
    let queued = tokio::spawn({
        let url = url.clone();
        async move {
            let _ = client()
                .post(&url)
                .header("x-sim-fault", "first_token=30s")
                .json(&chat(1, 200, true))
                .send()
                .await;
        }
    });
    wait_until(
        "the prompt reached the prefill replica",
        Duration::from_secs(5),
        || async { p.state.metrics.received.get() == 2 },
    )
    .await;
    let running = held_stream(&url).await;
    assert_eq!(p.state.metrics.received.get(), 3, "prefilled in the pool");
    // The next prompt stalls that one stream once: within the allowance,
    // prefilled on the decode replica without a look.
    let (status, _, text) = post(&url, &chat(3, 20, false)).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(pd_decisions(&gw, "local_stall_budget").await, 1.0);
    assert_eq!(p.state.metrics.received.get(), 3, "not sent to the pool");
    for outcome in ["confirmed", "refused", "failed"] {
        assert_eq!(decode_looks(&gw, outcome).await, 0.0, "{outcome}");
    }
    drop(running);
    queued.abort();
}

/// Through two gateways, the look counts both: this gateway's stream on the
/// decode replica and the one another gateway started there since the
/// scrape. Gateway A's allowance fits the one stall its own count predicts,
/// not the two the engine shows, so the prompt goes to the pool.
#[tokio::test]
async fn the_allowance_charges_this_gateways_streams_and_another_gateways() {
    // The prefill replica holds every request 30 s; the decode replica
    // answers up to 200 tokens.
    let p = replica(SimRole::Prefill, holding).await;
    let d = replica(SimRole::Decode, |c| c.output_tokens = 200).await;
    let replicas = [(&p, Role::Prefill), (&d, Role::Decode)];
    let (a, b) = (
        gateway_over(&replicas, |c| {
            c.routing.disaggregation.local_stall_share = 0.015;
        })
        .await,
        gateway_over(&replicas, |_| {}).await,
    );
    let (url_a, url_b) = (
        format!("{}/v1/chat/completions", api(&a)),
        format!("{}/v1/chat/completions", api(&b)),
    );
    // Through A: a prompt queued in the pool, then a stream of 200 tokens
    // prefilled on the idle decode replica: 199 gaps relayed, an allowance
    // of 0.015 x 199 = 3.0 stalls (less as it fades: 2.7 after 3 s; the
    // steps below need the one stall spent and one more to fit, some 20 s).
    let mut held = vec![first_prompt_queued(&p, &url_a).await];
    let mut long = chat(1, 20, true);
    long["max_tokens"] = 200.into();
    let (status, _, text) = post(&url_a, &long).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(pd_decisions(&a, "local_idle").await, 1.0);
    // Through B: a prompt queued in the pool, then a stream prefilled on
    // the decode replica, idle again, and held there mid-way.
    held.push(sent_to_pool(&p, &url_b, chat(5, 200, true), 2).await);
    let theirs = held_stream(&url_b).await;
    assert_eq!(d.state.metrics.received.get(), 2, "prefilled there");
    // Through A: a stream that stalls B's once, one of A's stalls, held
    // there mid-way.
    let ours = held_stream(&url_a).await;
    assert_eq!(d.state.metrics.received.get(), 3, "prefilled there");
    // (A's looks: the idle replica's before the long stream, and this one.)
    assert_eq!(decode_looks(&a, "confirmed").await, 2.0);
    // The next prompt through A: its own count says one stream (one stall:
    // it fits the ~2 left), the engine two (two stalls: they do not).
    held.push(sent_to_pool(&p, &url_a, chat(6, 20, false), 3).await);
    assert_eq!(d.state.metrics.received.get(), 3, "not prefilled there");
    assert_eq!(decode_looks(&a, "refused").await, 1.0);
    // (Every look answered: none was refused for want of an answer.)
    assert_eq!(decode_looks(&a, "failed").await, 0.0);
    drop((theirs, ours));
    for h in held {
        h.abort();
    }
}

/// With several prefill replicas the allowance goes only to prompts bound
/// for one of the pool's longer queues (at least its mean): a prompt without
/// a session, bound for the shortest queue while the queues differ, goes to
/// the pool; a turn of a session whose prefill replica queues longest is
/// prefilled on the decode replica, under its stream.
#[tokio::test]
async fn the_allowance_goes_to_prompts_bound_for_the_pools_longer_queues() {
    // Both prefill replicas hold every request 30 s; the decode replica
    // answers up to 200 tokens.
    let p = [
        replica(SimRole::Prefill, holding).await,
        replica(SimRole::Prefill, holding).await,
    ];
    let d = replica(SimRole::Decode, |c| c.output_tokens = 200).await;
    let replicas = [
        (&p[0], Role::Prefill),
        (&p[1], Role::Prefill),
        (&d, Role::Decode),
    ];
    let gw = gateway_over(&replicas, |c| {
        c.routing.disaggregation.local_stall_share = 0.009;
    })
    .await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let received = || p.each_ref().map(|p| p.state.metrics.received.get());
    let send = |body: serde_json::Value, session: Option<&'static str>| {
        let url = url.clone();
        tokio::spawn(async move {
            let headers: Vec<(&str, &str)> =
                session.map(|s| ("x-session-id", s)).into_iter().collect();
            let _ = post_with(&url, &body, &headers).await;
        })
    };
    let pool_got = |n: u64| {
        let received = &received;
        async move {
            wait_until(
                "the prompt reached the prefill pool",
                Duration::from_secs(5),
                || async { received().iter().sum::<u64>() == n },
            )
            .await;
        }
    };
    // A session's first turn of ~400 tokens queued on one prefill replica
    // (its prefill home from then on), a prompt of ~100 tokens on the other.
    let mut held = vec![send(chat(0, 200, true), Some("agent"))];
    pool_got(1).await;
    let home = usize::from(received()[0] == 0);
    held.push(send(chat(1, 50, true), None));
    pool_got(2).await;
    assert_eq!(received(), [1, 1], "one prompt queued on each");
    // A stream of 200 tokens prefilled on the idle decode replica: 199 gaps
    // relayed, an allowance of 0.009 x 199 = 1.8 stalls (fading by e in 30
    // s: one stall fits for some 17 s); then a stream held mid-way there
    // (idle again: prefilled there too).
    let mut long = chat(3, 20, true);
    long["max_tokens"] = 200.into();
    let (status, _, text) = post(&url, &long).await;
    assert_eq!(status, 200, "{text}");
    let decode = d.url().trim_start_matches("http://").to_string();
    let pool = gw.state().pool.clone();
    wait_until(
        "the stream's end counted",
        Duration::from_secs(5),
        || async {
            pool.replicas()
                .iter()
                .any(|r| *r.name == *decode && r.in_flight() == 0)
        },
    )
    .await;
    let running = held_stream(&url).await;
    assert_eq!(d.state.metrics.received.get(), 2, "both prefilled there");
    // A prompt without a session would go to the shorter queue (below the
    // pool's mean): no allowance, it goes there.
    held.push(send(chat(4, 20, false), None));
    pool_got(3).await;
    assert_eq!(received()[home], 1, "to the shorter queue");
    assert_eq!(d.state.metrics.received.get(), 2, "not prefilled there");
    // The session's next turn is bound for the longest queue (its prefill
    // home's): one stall, within the allowance, prefilled on the decode
    // replica.
    let (status, _, text) =
        post_with(&url, &chat(5, 20, false), &[("x-session-id", "agent")]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(pd_decisions(&gw, "local_stall_budget").await, 1.0);
    assert_eq!(received().iter().sum::<u64>(), 3, "not sent to the pool");
    assert_eq!(
        decode_looks(&gw, "failed").await,
        0.0,
        "every look answered"
    );
    drop(running);
    for h in held {
        h.abort();
    }
}

#[tokio::test]
async fn a_client_that_leaves_during_the_prefill_cancels_it() {
    // The prefill replica holds each request 30 s before starting it.
    let (p, d, gw) = fleet(holding, |_| {}).await;
    let req = client()
        .post(format!("{}/v1/chat/completions", api(&gw)))
        .json(&chat(0, 200, true))
        .send();
    let held = tokio::spawn(req);
    wait_until(
        "the prefill leg reached the replica",
        Duration::from_secs(5),
        || async { p.state.metrics.received.get() == 1 },
    )
    .await;
    held.abort();
    let _ = held.await;
    wait_until(
        "the prefill leg cancelled",
        Duration::from_secs(1),
        || async { p.state.metrics.finished_count("abort") >= 1 },
    )
    .await;
    assert_eq!(d.state.metrics.received.get(), 0);
}

#[tokio::test]
async fn disaggregation_config_errors_name_the_key_and_line() {
    let (ok, err) = check_config(
        "backends:\n  - url: http://10.0.0.1:8000\n    role: prefill\n    bootstrap_port: 8998\n  - url: http://10.0.0.2:8000\n    role: decode\n    bootstrap_port: 8998\n",
    );
    assert!(!ok);
    assert!(err.contains("backends[1].bootstrap_port"), "{err}");
    let (ok, err) = check_config("backends:\n  - url: http://10.0.0.1:8000\n    role: prefil\n");
    assert!(!ok);
    assert!(err.contains("role") && err.contains("line 3"), "{err}");
    // A stall share of 1% or more would make every stalled gap a p99 gap.
    for (yaml, key) in [
        (
            "local_stall_share: 0.01",
            "routing.disaggregation.local_stall_share",
        ),
        (
            "local_stall_share: -0.1",
            "routing.disaggregation.local_stall_share",
        ),
        (
            "prefill_chunk_tokens: 0",
            "routing.disaggregation.prefill_chunk_tokens",
        ),
    ] {
        let (ok, err) = check_config(&format!(
            "backends:\n  - url: http://10.0.0.1:8000\nrouting:\n  disaggregation:\n    {yaml}\n"
        ));
        assert!(!ok, "{yaml}");
        assert!(err.contains(key), "{yaml}: {err}");
    }
    let (ok, err) = check_config(
        "backends:\n  - url: http://10.0.0.1:8000\nrouting:\n  disaggregation:\n    local_stall_share: 0.002\n    prefill_chunk_tokens: 8192\n",
    );
    assert!(ok, "{err}");
}

#[tokio::test]
async fn a_stream_of_a_remote_prefill_is_timed_and_its_prefill_recorded() {
    let (_p, _d, gw) = fleet(|_| {}, |_| {}).await;
    let resp = client()
        .post(format!("{}/v1/chat/completions", api(&gw)))
        .json(&chat(3, 200, true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let mut text = String::new();
    while let Some(c) = body.next().await {
        text.push_str(&String::from_utf8_lossy(&c.unwrap()));
    }
    assert!(text.contains("[DONE]"));
    let (_, m) = get_text(&format!("{}/metrics", admin(&gw))).await;
    assert!(metric_sum(&m, "sluice_time_to_first_token_seconds_count") >= 1.0);
    assert_eq!(metric_sum(&m, "sluice_pd_prefill_seconds_count"), 1.0);
}

#[tokio::test]
async fn the_access_log_says_where_and_why_each_prompt_was_prefilled() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("access.log");
    let log = path.clone();
    let (p, _d, gw) = fleet(
        |_| {},
        move |c| {
            c.telemetry.access_log.enabled = true;
            c.telemetry.access_log.target = sluice::config::LogTarget::File;
            c.telemetry.access_log.path = Some(log);
            // Never prefilled on the decode replica by what it holds: the
            // second prompt goes to the prefill replica that has its prefix.
            c.routing.disaggregation.local_share = 1.0;
        },
    )
    .await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    let shared: String = (0..300).map(|w| format!("doc{w} ")).collect();
    for i in 0..2 {
        let body = serde_json::json!({
            "model": "sim-model", "max_tokens": 5,
            "messages": [{"role": "user", "content": format!("{shared} question {i}")}],
        });
        let id = format!("pd-log-{i}");
        let (status, _, text) = post_with(&url, &body, &[("x-request-id", &id)]).await;
        assert_eq!(status, 200, "{text}");
    }
    let [first, second] =
        <[_; 2]>::try_from(logged(&path, &["pd-log-0", "pd-log-1"]).await).unwrap();
    let name = format!("127.0.0.1:{}", p.addr.port());
    for l in [&first, &second] {
        assert_eq!(l["pd"], "remote", "{l}");
        assert_eq!(l["prefill_backend"], name.as_str(), "{l}");
        assert!(l["prefill_ms"].as_f64().is_some(), "{l}");
    }
    // Cold, then found where routing placed its prefix, with the prefix
    // cached there.
    assert_eq!(first["prefill_cached_tokens"], 0, "{first}");
    assert!(first["prefill_route_reason"].is_string(), "{first}");
    assert_eq!(second["prefill_route_reason"], "affinity", "{second}");
    assert!(
        second["prefill_cached_tokens"]
            .as_u64()
            .is_some_and(|c| c > 0),
        "{second}"
    );
}

/// SGLang's protocol: the prefill replica's bootstrap port is its own port
/// (the simulator's rooms are pulled over HTTP there).
async fn sglang_fleet(prefill: impl FnOnce(&mut SimConfig)) -> (SimHandle, SimHandle, Gateway) {
    sglang_fleet_with(prefill, |_| {}).await
}

async fn sglang_fleet_with(
    prefill: impl FnOnce(&mut SimConfig),
    tweak: impl FnOnce(&mut Config),
) -> (SimHandle, SimHandle, Gateway) {
    let p = replica(SimRole::Prefill, prefill).await;
    let d = replica(SimRole::Decode, |_| {}).await;
    let mut c = config_for(&[]);
    c.backends = vec![
        BackendConfig {
            bootstrap_port: Some(p.addr.port()),
            ..backend(&p, Role::Prefill)
        },
        backend(&d, Role::Decode),
    ];
    c.routing.disaggregation.protocol = sluice::config::PdProtocol::Sglang;
    scraped_often(&mut c);
    tweak(&mut c);
    let gw = start_routed(c, 2).await;
    (p, d, gw)
}

#[tokio::test]
async fn sglangs_protocol_sends_both_legs_with_one_bootstrap_room() {
    let (p, d, gw) = sglang_fleet(|_| {}).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    for (i, stream) in [(0, true), (1, false)] {
        let (status, _, text) = post(&url, &chat(i, 200, stream)).await;
        assert_eq!(status, 200, "{text}");
        let (pb, db) = (last_body(&p).await, last_body(&d).await);
        assert!(pb["bootstrap_room"].is_u64(), "{pb}");
        assert_eq!(
            pb["bootstrap_room"], db["bootstrap_room"],
            "one room for both legs"
        );
        assert_eq!(db["bootstrap_port"], p.addr.port(), "{db}");
        assert_eq!(db["bootstrap_host"], "127.0.0.1", "{db}");
        // The decode leg is the client's request; the prefill leg is drained.
        assert_eq!(db["stream"], stream, "{db}");
        assert_eq!(pb["stream"], false, "{pb}");
    }
    assert_eq!(d.state.metrics.kv_transfer_failures.get(), 0);
    assert_eq!(pd_decisions(&gw, "remote").await, 2.0);
}

#[tokio::test]
async fn a_failed_sglang_prefill_drops_the_waiting_decode_leg_and_prefills_locally() {
    let (_p, d, gw) = sglang_fleet(|c| c.faults = Faults::parse("error=503").unwrap()).await;
    let (status, _, text) = post(
        &format!("{}/v1/chat/completions", api(&gw)),
        &chat(0, 200, true),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("[DONE]"));
    let db = last_body(&d).await;
    assert!(db.get("bootstrap_room").is_none(), "the local leg: {db}");
    assert_eq!(pd_decisions(&gw, "local_fallback").await, 1.0);
}

async fn named(gw: &Gateway, pathology: &str, sim: &SimHandle) -> bool {
    let (_, body) = get_text(&format!("{}/admin/diagnose", admin(gw))).await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let name = sim.url().trim_start_matches("http://").to_string();
    v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .any(|f| f["pathology"] == pathology && f["backend"] == name.as_str())
}

/// One prefill and one decode replica behind a gateway whose doctor looks
/// over a 2-s window (findings cleared 300 ms after their cause; the
/// underutilisation rule off: idle replicas are not the subject).
async fn doctored_fleet() -> (SimHandle, SimHandle, Gateway) {
    fleet(
        |_| {},
        |c| {
            c.doctor.window = Duration::from_secs(2);
            c.doctor.clear_after = Duration::from_millis(300);
            c.doctor.underused_batch = 0.0;
        },
    )
    .await
}

#[tokio::test]
async fn the_doctor_names_a_saturated_prefill_pool_and_a_decode_pool_out_of_kv() {
    let (p, d, gw) = doctored_fleet().await;
    assert!(!named(&gw, "prefill_pool_saturated", &p).await);
    // Every prefill replica (one here) keeps a queue, scrape after scrape.
    let mut c = p.state.control();
    c.waiting = Some(4.0);
    p.state.set_control(c.clone());
    wait_until(
        "prefill pool saturated",
        Duration::from_secs(10),
        || async { named(&gw, "prefill_pool_saturated", &p).await },
    )
    .await;
    assert!(
        !named(&gw, "prefill_pool_saturated", &d).await,
        "named on the prefill pool only"
    );
    // Every decode replica preempts.
    let mut cd = d.state.control();
    cd.preempting = true;
    d.state.set_control(cd);
    wait_until("decode pool out of KV", Duration::from_secs(10), || async {
        named(&gw, "decode_pool_out_of_kv", &d).await
    })
    .await;
    // The queue goes: the prefill finding clears.
    c.waiting = None;
    p.state.set_control(c);
    wait_until(
        "prefill pool finding cleared",
        Duration::from_secs(10),
        || async { !named(&gw, "prefill_pool_saturated", &p).await },
    )
    .await;
}

/// A decode pool whose every replica keeps requests waiting for room (as
/// SGLang's decode replicas hold a request in their prealloc queue until
/// KV frees up, rather than preempt) is named out of KV; requests waiting
/// for their KV (the engine's deferred ones) are not such a queue.
#[tokio::test]
async fn a_decode_pool_whose_replicas_keep_a_queue_is_named_out_of_kv() {
    let (_p, d, gw) = doctored_fleet().await;
    // Three requests waiting at every scrape, all of them for their KV:
    // no finding after two windows' scrapes.
    let mut cd = d.state.control();
    cd.deferred = Some(3.0);
    d.state.set_control(cd.clone());
    crate::routing::until_backend(&gw, "the deferred requests seen", |v| {
        crate::routing::backend(v, &d)["requests_deferred"] == 3.0
    })
    .await;
    let scrapes = &d.state.metrics.scrapes;
    let seen = scrapes.get();
    wait_until(
        "two windows of scrapes",
        Duration::from_secs(10),
        || async { scrapes.get() >= seen + 40 },
    )
    .await;
    assert!(!named(&gw, "decode_pool_out_of_kv", &d).await);
    // The same three waiting for room: named.
    cd.deferred = None;
    cd.waiting = Some(3.0);
    d.state.set_control(cd);
    wait_until("decode pool out of KV", Duration::from_secs(10), || async {
        named(&gw, "decode_pool_out_of_kv", &d).await
    })
    .await;
}

/// A remote prefill shows in the trace as two client spans under the
/// request's: `prefill` on the prefill replica and `decode` on the decode
/// replica, each handed to its replica as the parent of its own spans.
fn traced(c: &mut Config, rx: &crate::common::otlp::Receiver) {
    let t = &mut c.telemetry.tracing;
    t.enabled = Some(true);
    t.endpoint = Some(format!("http://{}", rx.addr));
    t.protocol = Some(sluice::config::OtlpProtocol::Grpc);
    t.sampling.ratio = 1.0;
    t.sampling.max_per_second = 1000;
}

#[tokio::test]
async fn a_remote_prefill_is_traced_as_a_prefill_and_a_decode_span() {
    let rx = crate::common::otlp::grpc().await;
    let (p, d, gw) = fleet(|_| {}, |c| traced(c, &rx)).await;
    legs_traced(&p, &d, &gw, &rx, true).await;
}

/// SGLang's protocol: the two legs run side by side, each traced.
#[tokio::test]
async fn sglangs_two_legs_are_traced_as_a_prefill_and_a_decode_span() {
    let rx = crate::common::otlp::grpc().await;
    let (p, d, gw) = sglang_fleet_with(|_| {}, |c| traced(c, &rx)).await;
    legs_traced(&p, &d, &gw, &rx, false).await;
}

/// One streamed remote request: a server span and its two client spans,
/// `prefill` and `decode`, each the parent the replica it went to was
/// given; with vLLM's protocol (`in_turn`) the prefill ends before the
/// decode leg begins.
async fn legs_traced(
    p: &SimHandle,
    d: &SimHandle,
    gw: &Gateway,
    rx: &crate::common::otlp::Receiver,
    in_turn: bool,
) {
    let url = format!("{}/v1/chat/completions", api(gw));
    let (status, _, text) = post(&url, &chat(0, 200, true)).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(pd_decisions(gw, "remote").await, 1.0);
    wait_until("spans exported", Duration::from_secs(10), || {
        let n = rx.store.spans().len();
        async move { n >= 3 }
    })
    .await;
    let spans = rx.store.spans();
    let named = |name: &str| {
        spans
            .iter()
            .find(|s| s.span.name == name)
            .unwrap_or_else(|| panic!("no span {name}"))
    };
    let server = named("chat sim-model");
    let prefill = named("chat sim-model prefill");
    let decode = named("chat sim-model decode");
    assert!(spans.iter().all(|s| !s.span.name.ends_with("upstream")));
    for (leg, sim) in [(prefill, p), (decode, d)] {
        assert_eq!(leg.span.parent_span_id, server.span.span_id);
        assert_eq!(leg.span.kind, 3, "a client span");
        assert_eq!(leg.int("server.port"), Some(i64::from(sim.addr.port())));
        // The replica was given this span as its parent.
        let (_, last) = get_text(&format!("{}/sim/last_request", sim.url())).await;
        let last: serde_json::Value = serde_json::from_str(&last).unwrap();
        let tp = last["headers"]["traceparent"].as_str().unwrap().to_string();
        assert_eq!(
            tp.split('-').nth(2),
            Some(hex::encode(&leg.span.span_id).as_str()),
            "{tp}"
        );
    }
    assert_ne!(prefill.span.span_id, decode.span.span_id);
    assert!(prefill.span.start_time_unix_nano >= server.span.start_time_unix_nano);
    assert!(prefill.span.end_time_unix_nano > prefill.span.start_time_unix_nano);
    if in_turn {
        // The prefill came first and ended before the decode leg began.
        assert!(prefill.span.end_time_unix_nano <= decode.span.start_time_unix_nano);
    }
}

/// Question `q` about document `doc`: a shared system prompt of ~300
/// tokens (well past the home prefix's eight blocks) and a short question.
fn document(doc: usize, q: usize) -> serde_json::Value {
    let text: String = (0..120).map(|w| format!("d{doc}w{w} ")).collect();
    serde_json::json!({
        "model": "sim-model", "max_tokens": 5,
        "messages": [
            {"role": "system", "content": text},
            {"role": "user", "content": format!("Question {q}?")},
        ],
    })
}

/// Two gateways sharing the routing table in Redis over a disaggregated
/// fleet (two prefill replicas, one decode): each document's prefill legs
/// go to one prefill replica whichever gateway plans them (its first
/// request through either), and the documents are spread over both
/// gateways' placements, three and three.
#[tokio::test]
async fn gateways_sharing_prefix_homes_prefill_a_document_on_one_replica() {
    let redis = crate::common::redis::start().await;
    let p = [
        replica(SimRole::Prefill, |_| {}).await,
        replica(SimRole::Prefill, |_| {}).await,
    ];
    let d = replica(SimRole::Decode, |_| {}).await;
    let mut gws = Vec::new();
    for _ in 0..2 {
        let fleet = [
            (&p[0], Role::Prefill),
            (&p[1], Role::Prefill),
            (&d, Role::Decode),
        ];
        gws.push(gateway_over(&fleet, |c| crate::routing::shared_table(c, &redis)).await);
    }
    let received = || p.each_ref().map(|s| s.state.metrics.received.get());
    let mut homes = [0usize; 2];
    for doc in 0..6 {
        let mut at = Vec::new();
        for q in 0..3 {
            let before = received();
            let url = format!("{}/v1/chat/completions", api(&gws[(doc + q) % 2]));
            let (status, _, text) = post(&url, &document(doc, q)).await;
            assert_eq!(status, 200, "{text}");
            let after = received();
            let hit: Vec<usize> = (0..2).filter(|&i| after[i] > before[i]).collect();
            assert_eq!(hit.len(), 1, "one remote prefill: {hit:?}");
            at.push(hit[0]);
        }
        assert!(at.iter().all(|&h| h == at[0]), "document {doc}: {at:?}");
        homes[at[0]] += 1;
    }
    assert_eq!(homes, [3, 3]);
    for gw in &gws {
        assert_eq!(pd_decisions(gw, "remote").await, 9.0);
    }
}

/// A gateway over a disaggregated fleet meeting only new prompts (a
/// hundred and more in 5-10 s, the sampling's threshold lowered from its
/// thousand, none homed by another gateway), sharing
/// prefix homes through Redis, samples each pool's homes apart: its
/// prefill legs' and its decode legs' lookups each start sampling at their
/// own hundredth new prompt, and a prompt used again is written in both
/// pools.
#[tokio::test]
async fn a_disaggregated_gateway_meeting_only_new_prompts_samples_each_pools_homes_apart() {
    let redis = crate::common::redis::start().await;
    let (p, d) = (SimRole::Prefill, SimRole::Decode);
    let sims = [
        replica(p, |_| {}).await,
        replica(p, |_| {}).await,
        replica(d, |_| {}).await,
        replica(d, |_| {}).await,
    ];
    let roles = [Role::Prefill, Role::Prefill, Role::Decode, Role::Decode];
    let fleet: Vec<(&SimHandle, Role)> = sims.iter().zip(roles).collect();
    // Every prompt prefilled in the pool (none by a decode replica by
    // choice), so that every request places a home in both pools.
    let gw = gateway_over(&fleet, |c| {
        crate::routing::shared_table_sampled_soon(c, &redis);
        c.routing.disaggregation.local_when_idle = false;
        c.routing.disaggregation.local_stall_share = 0.0;
    })
    .await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    const PROMPTS: usize = crate::routing::SAMPLED_PROMPTS;
    // Every prefix twice: first all new, 16 at a time, then with another
    // question (prefilled in the pool again: the decode replica holds the
    // prefix but not the question, more than it prefills by choice), one at
    // a time: two decode replicas two streams apart would spill one to the
    // other, and a spill leaves the table's home alone.
    for pass in 0..2 {
        for batch in (0..PROMPTS)
            .collect::<Vec<_>>()
            .chunks(if pass == 0 { 16 } else { 1 })
        {
            let mut sent = tokio::task::JoinSet::new();
            for &p in batch {
                let url = url.clone();
                sent.spawn(async move { post(&url, &crate::routing::prefixed(p, pass)).await });
            }
            while let Some(r) = sent.join_next().await {
                let (status, _, text) = r.unwrap();
                assert_eq!(status, 200, "{text}");
            }
        }
        if pass == 0 {
            crate::routing::each_pool_sampled(&gw, &redis).await;
        }
    }
    crate::routing::each_pool_homes_all(&gw, &redis, PROMPTS).await;
    assert_eq!(pd_decisions(&gw, "remote").await, 2.0 * PROMPTS as f64);
}
