//! Sessions over real sockets with `sluice sim` replicas: a conversation's
//! turns stay on one replica (by id, or derived from the prompt), several
//! gateways agree on it without sharing anything, a saturated replica keeps
//! its sessions but takes no new ones, a dead replica's sessions move, and
//! the cached tokens the gateway counts are the engine's own.

use std::time::Duration;

use sluice::server::Gateway;
use sluice::sim::SimHandle;

use crate::common::*;
use crate::routing::{
    backend, reasons, routing_config, send_with_fault, served_by, shared_table, sims, start_routed,
    until_backend, urls,
};

/// Turn `turn` of conversation `s`: no shared prefix to lean on (the
/// system prompt is the same for every session), growing history.
fn turn(s: usize, turn: usize) -> serde_json::Value {
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a coding agent. ".repeat(40)}),
        serde_json::json!({"role": "user", "content": format!("Task {s}: fix the build.")}),
    ];
    for t in 0..turn {
        messages.push(serde_json::json!({"role": "assistant", "content": format!("Step {t} of task {s} done.")}));
        messages.push(serde_json::json!({"role": "user", "content": format!("Tool output {s}.{t}: {}", "ok ".repeat(50))}));
    }
    serde_json::json!({"model": "sim-model", "max_tokens": 4, "messages": messages})
}

/// POST with a session id header; the serving replica's index.
async fn with_id(url: &str, sims: &[SimHandle], body: &serde_json::Value, id: &str) -> usize {
    let before: Vec<u64> = sims
        .iter()
        .map(|s| s.state.metrics.received.get())
        .collect();
    let (status, _, text) = post_with(
        &format!("{url}/v1/chat/completions"),
        body,
        &[("x-session-id", id)],
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let hit: Vec<usize> = (0..sims.len())
        .filter(|&i| sims[i].state.metrics.received.get() > before[i])
        .collect();
    assert_eq!(hit.len(), 1, "{hit:?}");
    hit[0]
}

/// Four turns of conversation `s` under session id `id`, each asserted to
/// land where the first did; that replica's index.
async fn four_turns(url: &str, sims: &[SimHandle], s: usize, id: &str) -> usize {
    let first = with_id(url, sims, &turn(s, 0), id).await;
    for t in 1..4 {
        assert_eq!(
            with_id(url, sims, &turn(s, t), id).await,
            first,
            "session {s} turn {t} moved"
        );
    }
    first
}

#[tokio::test]
async fn session_ids_keep_a_conversation_on_one_replica_and_spread_sessions() {
    let sims = sims(4).await;
    // (`routing_config` gives scrapes 30 s before a replica counts as
    // stale: a late scrape would keep new sessions off a replica.)
    let gw = start_routed(routing_config(&urls(&sims)), 4).await;
    let url = api(&gw);
    // 16 sessions: rendezvous hashing over 4 replicas (named by random ports)
    // puts them all on 2 or fewer with probability ~1e-4 (12: ~1.5e-3).
    let mut homes = std::collections::HashSet::new();
    for s in 0..16 {
        homes.insert(four_turns(&url, &sims, s, &format!("conv-{s}")).await);
    }
    assert!(homes.len() >= 3, "16 sessions on {homes:?}");
    assert_eq!(reasons(&gw, "session").await, 48.0);
    assert_eq!(reasons(&gw, "session_new").await, 16.0);
    let (_, text) = get_text(&format!("{}/admin/routing", admin(&gw))).await;
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["sessions"]["remembered"], 16, "{v}");
    assert!(!text.contains("conv-"), "no session id is shown: {text}");
    assert_eq!(gateway_metric(&gw, "sluice_routing_sessions").await, 16.0);
}

#[tokio::test]
async fn least_loaded_placement_spreads_new_sessions_evenly() {
    // `session_placement: least_loaded`: each new session starts on the
    // replica with the fewest sessions lately: of 8 sessions of
    // 4 turns each, the first 4 take the 4 replicas one each, and so do the
    // next 4 (hashing 4 keys onto 4 replicas without a collision happens
    // 9% of the time), and every turn stays.
    let sims = sims(4).await;
    let mut c = routing_config(&urls(&sims));
    c.routing.prefix_kv.session_placement = sluice::config::SessionPlacement::LeastLoaded;
    let gw = start_routed(c, 4).await;
    let url = api(&gw);
    let mut homes = Vec::new();
    for s in 0..8 {
        homes.push(four_turns(&url, &sims, s, &format!("agent-{s}")).await);
    }
    for group in homes.chunks(4) {
        let distinct: std::collections::HashSet<_> = group.iter().collect();
        assert_eq!(distinct.len(), 4, "{homes:?}");
    }
    assert_eq!(reasons(&gw, "session_new").await, 8.0);
}

#[tokio::test]
async fn without_an_id_the_prompt_tells_conversations_apart() {
    let sims = sims(4).await;
    let gw = start_routed(routing_config(&urls(&sims)), 4).await;
    for s in 0..8 {
        let first = served_by(&gw, &sims, &turn(s, 0)).await;
        for t in 1..4 {
            assert_eq!(
                served_by(&gw, &sims, &turn(s, t)).await,
                first,
                "session {s} turn {t} moved"
            );
        }
    }
}

#[tokio::test]
async fn three_gateways_agree_on_every_sessions_replica() {
    let sims = sims(4).await;
    let mut gws = Vec::new();
    for _ in 0..3 {
        gws.push(start_routed(routing_config(&urls(&sims)), 4).await);
    }
    let urls: Vec<String> = gws.iter().map(api).collect();
    for s in 0..12 {
        let id = format!("agent-{s}");
        // Each turn through another gateway, as a round-robin balancer sends them.
        let homes: Vec<usize> = {
            let mut v = Vec::new();
            for t in 0..6 {
                v.push(with_id(&urls[(s + t) % 3], &sims, &turn(s, t), &id).await);
            }
            v
        };
        assert!(
            homes.iter().all(|&h| h == homes[0]),
            "session {s}: {homes:?}"
        );
    }
}

/// `sim`'s engine runs out of KV blocks (it preempts, scrape after
/// scrape); returns once the gateway `gw` has seen it.
async fn preempting(gw: &Gateway, sim: &SimHandle) {
    let mut c = sim.state.control();
    c.preempting = true;
    sim.state.set_control(c);
    until_backend(gw, "pressure seen", |v| {
        backend(v, sim)["preempting"] == true
    })
    .await;
}

/// Requests of the gateway's own at the engines while they are scraped, 10
/// a replica of three (each held 5 s before its first token: engines that
/// busy would show another gateway's share), until it counts itself alone;
/// the requests' tasks.
async fn made_alone(gw: &Gateway) -> Vec<tokio::task::JoinHandle<()>> {
    let ours: Vec<_> = (0..30)
        .map(|i| send_with_fault(&api(gw), &format!("Our question {i}."), "first_token=5s"))
        .collect();
    wait_until("alone", Duration::from_secs(20), || is_alone(gw)).await;
    ours
}

/// The gateway counts itself the engines' only sender (`/admin/routing`).
async fn is_alone(gw: &Gateway) -> bool {
    let (_, text) = get_text(&format!("{}/admin/routing", admin(gw))).await;
    serde_json::from_str::<serde_json::Value>(&text).unwrap()["sessions"]["alone"] == true
}

/// With one gateway (`session_placement: least_loaded`): new sessions avoid
/// a pressed replica. (The default, `rendezvous`, places by the key alone,
/// so that every gateway finds a session where another placed it.)
#[tokio::test]
async fn a_saturated_replica_keeps_its_sessions_and_sheds_new_ones() {
    let sims = sims(3).await;
    let mut config = routing_config(&urls(&sims));
    config.routing.prefix_kv.session_placement = sluice::config::SessionPlacement::LeastLoaded;
    let gw = start_routed(config, 3).await;
    let url = api(&gw);
    // Sessions until one lands on each replica.
    let mut placed: Vec<(String, usize)> = Vec::new();
    for s in 0..30 {
        let id = format!("s-{s}");
        placed.push((id.clone(), with_id(&url, &sims, &turn(s, 0), &id).await));
    }
    let full = placed[0].1;
    preempting(&gw, &sims[full]).await;
    // Its own sessions stay (their history is there)...
    for (s, (id, home)) in placed.iter().enumerate().filter(|(_, (_, h))| *h == full) {
        assert_eq!(
            with_id(&url, &sims, &turn(s, 1), id).await,
            *home,
            "{id} left its replica"
        );
    }
    // ...new ones go elsewhere.
    for s in 100..120 {
        let id = format!("new-{s}");
        assert_ne!(
            with_id(&url, &sims, &turn(s, 0), &id).await,
            full,
            "new session {id} on the full replica"
        );
    }
}

/// `session_placement: auto` without a shared table: by the key's order
/// (`rendezvous`, what every gateway computes alike) until the replicas'
/// engines have shown this gateway's requests and nobody else's; then new
/// sessions skip a pressed replica (`first_open`). Requests of another
/// sender at an engine make it place by the key again.
#[tokio::test]
async fn auto_places_by_pressure_only_while_the_engines_show_no_other_sender() {
    let sims = sims(3).await;
    let gw = start_routed(routing_config(&urls(&sims)), 3).await;
    let url = api(&gw);
    let routing = || async {
        let (_, text) = get_text(&format!("{}/admin/routing", admin(&gw))).await;
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["sessions"].clone()
    };
    let v = routing().await;
    assert_eq!(
        (&v["alone"], &v["placement"]),
        (&serde_json::json!(false), &serde_json::json!("rendezvous")),
        "{v}"
    );
    let ours = made_alone(&gw).await;
    assert_eq!(routing().await["placement"], "first_open");
    assert_eq!(gateway_metric(&gw, "sluice_routing_alone").await, 1.0);
    // One engine runs out of KV blocks: no new session starts there.
    let p = 0;
    preempting(&gw, &sims[p]).await;
    let mut started = Vec::new();
    for s in 0..40 {
        let id = format!("alone-{s}");
        let at = with_id(&url, &sims, &turn(s, 0), &id).await;
        assert_ne!(at, p, "{id}");
        started.push(at);
    }
    // Another sender's requests at the other replicas' engines.
    let theirs: Vec<_> = (1..3)
        .flat_map(|i| (0..4).map(move |j| (i, j)))
        .map(|(i, j)| {
            send_with_fault(
                &sims[i].url(),
                &format!("Their question {j}."),
                "first_token=5s",
            )
        })
        .collect();
    // Seen at the next scrapes (and counted: the engine's count beyond
    // this gateway's in flight there).
    let metrics = format!("{}/metrics", admin(&gw));
    let series: Vec<String> = sims[1..]
        .iter()
        .map(|s| {
            format!(
                "sluice_backend_requests_elsewhere{{backend=\"{}\"}}",
                s.addr
            )
        })
        .collect();
    wait_until("their requests seen", Duration::from_secs(20), || {
        let (metrics, series) = (metrics.clone(), series.clone());
        async move {
            let (_, text) = get_text(&metrics).await;
            series
                .iter()
                .any(|s| metric(&text, s).unwrap_or(0.0) >= 2.0)
        }
    })
    .await;
    let v = routing().await;
    assert_eq!(
        (&v["alone"], &v["placement"]),
        (&serde_json::json!(false), &serde_json::json!("rendezvous")),
        "{v}"
    );
    assert_eq!(gateway_metric(&gw, "sluice_routing_alone").await, 0.0);
    // By the key again: some of forty new sessions start on the pressed
    // replica (each has one chance in three).
    let mut there = 0;
    for s in 100..140 {
        let id = format!("company-{s}");
        there += usize::from(with_id(&url, &sims, &turn(s, 0), &id).await == p);
    }
    assert!(there > 0);
    // The sessions it placed by pressure while alone go back to their key's
    // first replica (the pressed one, for some; another that was pressed
    // for a moment while this gateway's held requests waited there, for
    // others), where another gateway would send them: counted as `rehome`;
    // the others stay.
    let (mut back, mut moved) = (0, 0);
    for (s, &was) in started.iter().enumerate() {
        let id = format!("alone-{s}");
        let at = with_id(&url, &sims, &turn(s, 1), &id).await;
        back += usize::from(at == p);
        moved += usize::from(at != was);
    }
    assert!(back > 0);
    assert_eq!(reasons(&gw, "rehome").await, moved as f64);
    for t in ours.into_iter().chain(theirs) {
        t.abort();
    }
}

/// Alone (the default `auto`, no shared table), a session whose replica's
/// engine queues and lately evicted what it was sent (a turn's cached tokens
/// fell short of its history) leaves at its next turn for an open replica:
/// an engine that keeps evicting loses the history again, and a turn that
/// prefills it whole does so without the queue elsewhere. Its turns then stay
/// where it went.
#[tokio::test]
async fn alone_a_session_leaves_an_engine_that_queues_and_lost_its_history() {
    // Engines with a prefix cache (their cached tokens are what they hold)
    // of 1,536 tokens: one long prompt evicts a session's history.
    let mut sims = Vec::new();
    for _ in 0..3 {
        let mut cfg = sluice::sim::SimConfig::engine("tiny", 10.0).unwrap();
        cfg.profile.as_mut().unwrap().num_blocks = 96;
        sims.push(start_sim(cfg).await);
    }
    let gw = start_routed(routing_config(&urls(&sims)), 3).await;
    let url = api(&gw);
    for t in made_alone(&gw).await {
        t.await.unwrap();
    }
    let id = "mover";
    let home = with_id(&url, &sims, &turn(7, 0), id).await;
    assert_eq!(with_id(&url, &sims, &turn(7, 1), id).await, home);
    // Other sessions of this gateway's that started there (each with a
    // prompt of its own: nothing the gateway's index expects cached)...
    let own = |s: usize, t: usize| {
        let mut body = turn(s, t);
        body["messages"][0]["content"] = format!("You review change {s}. ").repeat(4).into();
        body
    };
    let mut neighbours = Vec::new();
    for s in 100..160 {
        let other = format!("neighbour-{s}");
        if with_id(&url, &sims, &own(s, 0), &other).await == home {
            neighbours.push((s, other));
        }
        if neighbours.len() == 4 {
            break;
        }
    }
    assert_eq!(neighbours.len(), 4, "sessions placed at {home}");
    // ...whose next turns its engine holds before their first token: a
    // queue of this gateway's own requests (no other sender's).
    let held: Vec<_> = neighbours
        .into_iter()
        .map(|(s, other)| {
            let url = format!("{url}/v1/chat/completions");
            let body = own(s, 1);
            // (Without the test client's 30 s timeout: held until aborted.)
            tokio::spawn(async move {
                reqwest::Client::new()
                    .post(&url)
                    .header("x-session-id", other)
                    .header("x-sim-fault", "first_token=120s")
                    .json(&body)
                    .send()
                    .await
            })
        })
        .collect();
    until_backend(&gw, "the queue seen", |v| {
        backend(v, &sims[home])["engine_queued"] == true
    })
    .await;
    assert!(is_alone(&gw).await, "its own queue is no other sender's");
    // Queued, with its history there: the session stays.
    assert_eq!(with_id(&url, &sims, &turn(7, 2), id).await, home);
    // Another prompt, sent straight to its engine, evicts the session's
    // history there. Nothing tells the gateway until the next turn there,
    // whose cached tokens fall short.
    evict_with_a_long_prompt(&sims[home]).await;
    assert_eq!(with_id(&url, &sims, &turn(7, 3), id).await, home);
    assert_eq!(reasons(&gw, "rehome").await, 0.0);
    // Queued and evicting: it leaves for an open replica, and stays there.
    let moved = with_id(&url, &sims, &turn(7, 4), id).await;
    assert_ne!(moved, home);
    assert_eq!(reasons(&gw, "rehome").await, 1.0);
    assert_eq!(with_id(&url, &sims, &turn(7, 5), id).await, moved);
    assert!(is_alone(&gw).await);
    for t in held {
        t.abort();
    }
}

#[tokio::test]
async fn the_sessions_of_a_dead_replica_move() {
    let mut sims = sims(3).await;
    let mut config = routing_config(&urls(&sims));
    config.upstream.health_check.interval = Duration::from_millis(100);
    let gw = start_routed(config, 3).await;
    let url = api(&gw);
    let mut placed = Vec::new();
    for s in 0..20 {
        let id = format!("d-{s}");
        placed.push((id.clone(), with_id(&url, &sims, &turn(s, 0), &id).await));
    }
    let dead = placed[0].1;
    sims.remove(dead).stop();
    let pool = gw.state().pool.clone();
    wait_until(
        "the dead replica is unhealthy",
        Duration::from_secs(10),
        || {
            let pool = pool.clone();
            async move { pool.replicas().iter().filter(|r| r.is_healthy()).count() == 2 }
        },
    )
    .await;
    let mut moved = 0;
    for (s, (id, home)) in placed.iter().enumerate() {
        let (status, _, _) = post_with(
            &format!("{url}/v1/chat/completions"),
            &turn(s, 1),
            &[("x-session-id", id)],
        )
        .await;
        assert_eq!(status, 200, "{id}");
        moved += usize::from(*home == dead);
    }
    let n = gateway_metric(
        &gw,
        "sluice_routing_session_moves_total{model=\"sim-model\",reason=\"session_new\"}",
    )
    .await;
    assert_eq!(n, moved as f64);
    assert!(moved > 0);
}

#[tokio::test]
async fn cached_tokens_counted_are_the_engines_own() {
    let mut cfg = fast_sim();
    cfg = sluice::sim::SimConfig::engine("tiny", 20.0)
        .map(|e| sluice::sim::SimConfig {
            model: cfg.model.clone(),
            output_tokens: 4,
            ..e
        })
        .unwrap();
    let mut sims = Vec::new();
    for _ in 0..2 {
        sims.push(start_sim(cfg.clone()).await);
    }
    let gw = start_routed(routing_config(&urls(&sims)), 2).await;
    let url = api(&gw);
    for s in 0..6 {
        for t in 0..4 {
            with_id(&url, &sims, &turn(s, t), &format!("c-{s}")).await;
        }
    }
    let engine: u64 = sims.iter().map(|s| s.state.metrics.prefix_hits.get()).sum();
    assert!(engine > 0, "the engines hit their cache");
    let counted = gateway_metric(
        &gw,
        "sluice_prompt_tokens_cached_total{model=\"sim-model\"}",
    )
    .await;
    assert_eq!(
        counted, engine as f64,
        "the gateway counts the engines' cached tokens"
    );
    // Per replica, the closed loop saw the same tokens.
    let mut actual = 0.0;
    for s in &sims {
        actual += gateway_metric(
            &gw,
            &format!(
                "sluice_backend_cached_tokens_actual_total{{backend=\"{}\"}}",
                s.addr
            ),
        )
        .await;
    }
    assert_eq!(actual, engine as f64);
    let _: &Gateway = &gw;
}

/// Three gateways sharing a session table in a real Redis
/// (`routing.sessions.store: redis`) with `session_placement: least_loaded`:
/// each session starts where its first gateway finds least load, and the
/// other two find it there. Each of 12 sessions has 4
/// turns, round robin from gateway `s % 3`, so the gateways' counts of
/// recent turns differ (the first saw two of each session's turns, the
/// others one): placed by each gateway's own load without the table, the
/// later turns would go elsewhere.
#[tokio::test]
async fn gateways_sharing_a_session_table_place_by_load_and_agree() {
    let redis = crate::common::redis::start().await;
    let sims = sims(4).await;
    let mut gws = Vec::new();
    for _ in 0..3 {
        let mut c = routing_config(&urls(&sims));
        shared_table(&mut c, &redis);
        c.routing.prefix_kv.session_placement = sluice::config::SessionPlacement::LeastLoaded;
        gws.push(start_routed(c, 4).await);
    }
    let urls: Vec<String> = gws.iter().map(api).collect();
    let mut per_replica = [0usize; 4];
    for s in 0..12 {
        let id = format!("shared-{s}");
        let mut homes = Vec::new();
        for t in 0..4 {
            homes.push(with_id(&urls[(s + t) % 3], &sims, &turn(s, t), &id).await);
        }
        assert!(
            homes.iter().all(|&h| h == homes[0]),
            "session {s}: {homes:?}"
        );
        per_replica[homes[0]] += 1;
    }
    // Placed by load: no replica is left with fewer than two of the twelve
    // (by the key's hash alone, one is about half the time).
    assert!(per_replica.iter().all(|&n| n >= 2), "{per_replica:?}");
    let mut found = 0.0;
    let mut claimed = 0.0;
    for gw in &gws {
        found += gateway_metric(
            gw,
            "sluice_routing_session_store_total{op=\"find\",outcome=\"found\"}",
        )
        .await;
        claimed += gateway_metric(
            gw,
            "sluice_routing_session_store_total{op=\"claim\",outcome=\"ok\"}",
        )
        .await;
    }
    // Turns 1 and 2 of each session met a gateway that had not seen it.
    assert_eq!(found, 24.0);
    assert_eq!(claimed, 12.0);
    let (_, text) = get_text(&format!("{}/admin/routing", admin(&gws[0]))).await;
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["sessions"]["store"], "redis", "{v}");
    assert_eq!(v["sessions"]["placement"], "least_loaded", "{v}");
}

/// The shared table gone: requests are still served, placed as without it,
/// and the failed lookups are counted.
#[tokio::test]
async fn sessions_are_served_while_the_shared_table_is_down() {
    let mut redis = crate::common::redis::start().await;
    let sims = sims(2).await;
    let mut c = routing_config(&urls(&sims));
    shared_table(&mut c, &redis);
    let gw = start_routed(c, 2).await;
    // `auto` with a shared table: new sessions skip pressed replicas.
    let (_, text) = get_text(&format!("{}/admin/routing", admin(&gw))).await;
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["sessions"]["store"], "redis", "{v}");
    assert_eq!(v["sessions"]["placement"], "first_open", "{v}");
    redis.kill().await;
    let url = api(&gw);
    for s in 0..3 {
        let first = with_id(&url, &sims, &turn(s, 1), &format!("down-{s}")).await;
        // This gateway placed it: its next turn stays without the table.
        assert_eq!(
            with_id(&url, &sims, &turn(s, 2), &format!("down-{s}")).await,
            first
        );
    }
    let errors = gateway_metric(
        &gw,
        "sluice_routing_session_store_total{op=\"find\",outcome=\"error\"}",
    )
    .await;
    assert_eq!(errors, 3.0);
    // A prompt without a session: its prefix's home is not found either,
    // and it is placed as without the table.
    let body = crate::routing::prefixed(1, 0);
    let (status, _, text) = post(&format!("{url}/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{text}");
    let errors = gateway_metric(
        &gw,
        "sluice_routing_home_store_total{op=\"place\",outcome=\"error\"}",
    )
    .await;
    assert_eq!(errors, 1.0);
    assert_eq!(reasons(&gw, "prefix_new").await, 1.0);
}
