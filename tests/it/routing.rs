//! Routing across simulated replicas: affinity shared by independent gateways,
//! pressure and stale metrics, passive ejection, DNS discovery, hot prefixes.

use std::net::Ipv4Addr;
use std::time::Duration;

use sluice::config::{Config, DnsSource, PolicyKind};
use sluice::server::Gateway;
use sluice::sim::{Dialect, SimConfig, SimHandle};

use crate::common::*;

pub fn routing_config(urls: &[String]) -> Config {
    let mut c = config_for(urls);
    c.routing.metrics.interval = Duration::from_millis(100);
    // A replica whose last scrape is older than `stale_after` counts as
    // saturated and takes no new work. On a loaded CI machine a scrape can
    // run a second late (stop 26's CI saw sessions crowd onto two replicas),
    // so the tests that are not about staleness give it 30 s;
    // `stale_metrics_are_not_trusted` sets 1 s.
    c.routing.metrics.stale_after = Duration::from_secs(30);
    c
}

/// The routing table shared through `redis` (`routing.sessions.store`).
pub fn shared_table(c: &mut Config, redis: &crate::common::redis::Redis) {
    c.routing.sessions.store = sluice::config::StoreKind::Redis;
    c.routing.sessions.redis.url = sluice::config::Secret::new(redis.url());
}

/// [`shared_table`] whose calls are given a second, not 100 ms: hundreds
/// of writes while the whole suite shares two cores time out at 100 ms (a
/// lookup's timeout pauses the table, a write's is lost), and the tests
/// that count every one must not see that.
pub fn shared_table_unhurried(c: &mut Config, redis: &crate::common::redis::Redis) {
    shared_table(c, redis);
    c.routing.sessions.redis.timeout = Duration::from_secs(1);
}

/// The new prompts from which the sampling tests' gateways sample their
/// lookups (`routing.prefix_kv.shared_homes_sampled_from`; 1,000 by
/// default): a hundred in 5-10 s, which the slowest machine sends.
pub const SAMPLED_FROM: usize = 100;

/// The prompts those tests send: sixty past [`SAMPLED_FROM`].
pub const SAMPLED_PROMPTS: usize = SAMPLED_FROM + 60;

/// [`shared_table_unhurried`], sampling from [`SAMPLED_FROM`] new prompts.
pub fn shared_table_sampled_soon(c: &mut Config, redis: &crate::common::redis::Redis) {
    shared_table_unhurried(c, redis);
    c.routing.prefix_kv.shared_homes_sampled_from = SAMPLED_FROM as u64;
}

/// Start a gateway and wait until `n` replicas are healthy and scraped, so
/// that the first decisions already see fresh pressure signals.
pub async fn start_routed(config: Config, n: usize) -> Gateway {
    let gw = start_gateway(config, n).await;
    let pool = gw.state().pool.clone();
    wait_until("replica metrics scraped", Duration::from_secs(5), || {
        let pool = pool.clone();
        async move {
            pool.replicas()
                .iter()
                .filter(|r| r.load().is_some())
                .count()
                >= n
        }
    })
    .await;
    gw
}

pub fn prefixed(prefix: usize, question: usize) -> serde_json::Value {
    serde_json::json!({
        "model": "sim-model",
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": format!("Document {prefix}: {}", "the fleet shares context. ".repeat(30))},
            {"role": "user", "content": format!("Question {question}?")},
        ],
    })
}

/// Send one request; return the index of the simulator that served it.
pub async fn served_by(gw: &Gateway, sims: &[SimHandle], body: &serde_json::Value) -> usize {
    let before: Vec<u64> = sims
        .iter()
        .map(|s| s.state.metrics.received.get())
        .collect();
    let (status, _, text) = post(&format!("{}/v1/chat/completions", api(gw)), body).await;
    assert_eq!(status, 200, "{text}");
    let hit: Vec<usize> = (0..sims.len())
        .filter(|&i| sims[i].state.metrics.received.get() > before[i])
        .collect();
    assert_eq!(hit.len(), 1, "exactly one replica served it: {hit:?}");
    hit[0]
}

pub async fn sims(n: usize) -> Vec<SimHandle> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(start_sim(fast_sim()).await);
    }
    v
}

pub fn urls(sims: &[SimHandle]) -> Vec<String> {
    sims.iter().map(|s| s.url()).collect()
}

/// Wait until the gateway's view of replica `name` satisfies `pred`.
pub async fn until_backend(gw: &Gateway, what: &str, pred: impl Fn(&serde_json::Value) -> bool) {
    let url = format!("{}/admin/backends", admin(gw));
    let pred = &pred;
    wait_until(what, Duration::from_secs(5), || {
        let url = url.clone();
        async move {
            let (_, text) = get_text(&url).await;
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            pred(&v)
        }
    })
    .await;
}

pub fn backend<'a>(v: &'a serde_json::Value, sim: &SimHandle) -> &'a serde_json::Value {
    let name = sim.addr.to_string();
    v.as_array()
        .unwrap()
        .iter()
        .find(|b| b["name"] == name.as_str())
        .expect("replica listed")
}

pub async fn reasons(gw: &Gateway, reason: &str) -> f64 {
    gateway_metric(
        gw,
        &format!("sluice_routing_decisions_total{{model=\"sim-model\",reason=\"{reason}\"}}"),
    )
    .await
}

/// Send through a gateway given by its base URL; return the serving simulator.
async fn served_via(url: &str, sims: &[SimHandle], body: &serde_json::Value) -> usize {
    let before: Vec<u64> = sims
        .iter()
        .map(|s| s.state.metrics.received.get())
        .collect();
    let (status, _, text) = post(&format!("{url}/v1/chat/completions"), body).await;
    assert_eq!(status, 200, "{text}");
    let hit: Vec<usize> = (0..sims.len())
        .filter(|&i| sims[i].state.metrics.received.get() > before[i])
        .collect();
    assert_eq!(hit.len(), 1, "exactly one replica served it: {hit:?}");
    hit[0]
}

#[tokio::test]
async fn two_gateway_processes_send_the_same_prefixes_to_the_same_replicas() {
    let sims = sims(4).await;
    let gw1 = start_routed(routing_config(&urls(&sims)), 4).await;
    // The second gateway is a separate process: the real binary, sharing nothing.
    let mut args = vec![
        "serve".to_string(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--admin-listen".into(),
        "127.0.0.1:0".into(),
    ];
    for u in urls(&sims) {
        args.push("--backend".into());
        args.push(u);
    }
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_child, line) = crate::cli::spawn_and_wait_for(&argv, "api").await;
    let addr_of = |key: &str| {
        let pat = format!("{key}=");
        line.split(&pat)
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .to_string()
    };
    let (gw2, admin2) = (
        format!("http://{}", addr_of("api")),
        format!("http://{}/admin/backends", addr_of("admin")),
    );
    // Ready when all four replicas are healthy and their metrics scraped.
    wait_until("second gateway ready", Duration::from_secs(10), || {
        let url = admin2.clone();
        async move {
            let Ok(r) = client().get(&url).send().await else {
                return false;
            };
            let v: serde_json::Value = r.json().await.unwrap_or_default();
            v.as_array().is_some_and(|a| {
                a.len() == 4
                    && a.iter()
                        .all(|b| b["healthy"] == true && b["metrics_age_seconds"].is_number())
            })
        }
    })
    .await;
    // 16 prefixes: rendezvous hashing over 4 replicas (named by random
    // ports) leaves one unused with probability ~1e-4 (with 8 it was ~2%).
    let mut used = std::collections::HashSet::new();
    for p in 0..16 {
        let first = served_by(&gw1, &sims, &prefixed(p, 0)).await;
        let second = served_via(&gw2, &sims, &prefixed(p, 1)).await;
        let third = served_by(&gw1, &sims, &prefixed(p, 2)).await;
        assert_eq!(first, second, "prefix {p}: the gateway processes disagree");
        assert_eq!(first, third, "prefix {p}: not sticky");
        used.insert(first);
    }
    assert!(
        used.len() >= 3,
        "16 prefixes spread over replicas: {used:?}"
    );
    // Each prefix was new to each gateway once, then kept where it went.
    assert_eq!(reasons(&gw1, "prefix_new").await, 16.0);
    assert!(reasons(&gw1, "affinity").await >= 16.0);
}

#[tokio::test]
async fn a_full_kv_cache_is_not_a_stop_sign_and_preempting_stops_only_new_work() {
    // Engines with a prefix cache: the closed loop keeps the prefix in the
    // index of the replica that really holds it (the fixed-timing replicas
    // report no cached tokens, so the index forgets what it sent them).
    let mut sims = Vec::new();
    for _ in 0..3 {
        let mut cfg = SimConfig::engine("tiny", 10.0).unwrap();
        cfg.output_tokens = 4;
        sims.push(start_sim(cfg).await);
    }
    let gw = start_routed(routing_config(&urls(&sims)), 3).await;
    let home = served_by(&gw, &sims, &prefixed(1, 0)).await;

    // Engines run their KV cache near full at full batch: with nothing
    // waiting and no preemption, the prefix stays home.
    let mut c = sims[home].state.control();
    c.kv_usage = Some(0.99);
    sims[home].state.set_control(c.clone());
    until_backend(&gw, "KV usage seen", |v| {
        backend(v, &sims[home])["kv_cache_usage"] == 0.99
    })
    .await;
    // The KV geometry from vLLM's cache_config_info is shown too.
    let (_, text) = get_text(&format!("{}/admin/backends", admin(&gw))).await;
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let b = backend(&v, &sims[home]);
    assert_eq!(b["kv_block_size"], 16, "{b}");
    assert!(b["kv_num_blocks"].as_u64().is_some(), "{b}");
    for q in 1..=5 {
        assert_eq!(
            served_by(&gw, &sims, &prefixed(1, q)).await,
            home,
            "left its home for a KV percentage"
        );
    }
    assert_eq!(reasons(&gw, "spill_kv").await, 0.0);

    // Out of blocks (its preemption counter rises) while the others are not:
    // new work goes elsewhere, and its own prefix stays (moving it would
    // cost a cold prefill and evictions elsewhere to spare it a few blocks).
    c.preempting = true;
    sims[home].state.set_control(c.clone());
    until_backend(&gw, "preemptions seen", |v| {
        backend(v, &sims[home])["preempting"] == true
    })
    .await;
    for q in 6..=8 {
        assert_eq!(served_by(&gw, &sims, &prefixed(1, q)).await, home);
    }
    for p in 2..=5 {
        assert_ne!(
            served_by(&gw, &sims, &prefixed(p, 0)).await,
            home,
            "a new prefix sent to a preempting replica"
        );
    }
    assert_eq!(reasons(&gw, "spill_kv").await, 0.0);

    c.preempting = false;
    c.kv_usage = None;
    sims[home].state.set_control(c);
    until_backend(&gw, "recovery seen", |v| {
        backend(v, &sims[home])["preempting"] == false
    })
    .await;
    assert_eq!(served_by(&gw, &sims, &prefixed(1, 9)).await, home);
}

#[tokio::test]
async fn a_long_queue_moves_work_away() {
    // vLLM's names, and TGI's (which reports a queue but no KV usage).
    for (dialect, engine) in [(Dialect::Vllm, "vllm"), (Dialect::Tgi, "tgi")] {
        let mut sims = Vec::new();
        for _ in 0..2 {
            sims.push(
                start_sim(SimConfig {
                    dialect,
                    ..fast_sim()
                })
                .await,
            );
        }
        let gw = start_routed(routing_config(&urls(&sims)), 2).await;
        let home = served_by(&gw, &sims, &prefixed(2, 0)).await;
        let mut c = sims[home].state.control();
        c.waiting = Some(50.0);
        sims[home].state.set_control(c);
        // Full when the queue outlives a scrape: seen at two in a row.
        until_backend(&gw, "queue seen", |v| {
            let b = backend(v, &sims[home]);
            b["requests_waiting"] == 50.0 && b["engine"] == engine && b["engine_queued"] == true
        })
        .await;
        assert_ne!(
            served_by(&gw, &sims, &prefixed(2, 1)).await,
            home,
            "{engine}"
        );
        assert!(reasons(&gw, "spill_queue").await >= 1.0, "{engine}");
    }
}

#[tokio::test]
async fn stale_metrics_are_not_trusted() {
    let sims = sims(3).await;
    let mut c = routing_config(&urls(&sims));
    c.routing.metrics.stale_after = Duration::from_millis(1000);
    let gw = start_routed(c, 3).await;
    let home = served_by(&gw, &sims, &prefixed(3, 0)).await;
    let mut c = sims[home].state.control();
    c.metrics = sluice::sim::MetricsMode::Hang;
    sims[home].state.set_control(c);
    // Its last sample ages past stale_after (1 s): the replica counts as saturated.
    until_backend(&gw, "metrics stale", |v| {
        backend(v, &sims[home])["metrics_age_seconds"]
            .as_f64()
            .unwrap_or(0.0)
            > 1.2
    })
    .await;
    assert_ne!(served_by(&gw, &sims, &prefixed(3, 1)).await, home);
    assert!(reasons(&gw, "spill_stale").await >= 1.0);
    let (_, m) = get_text(&format!("{}/metrics", admin(&gw))).await;
    let age = metric(
        &m,
        &format!(
            "sluice_backend_metrics_age_seconds{{backend=\"{}\"}}",
            sims[home].addr
        ),
    )
    .unwrap();
    assert!(age > 1.0, "metrics age exported: {age}");
}

#[tokio::test]
async fn a_failing_replica_is_ejected_and_comes_back() {
    let sims = sims(2).await;
    let mut config = routing_config(&urls(&sims));
    config.routing.policy = PolicyKind::RoundRobin;
    config.upstream.outlier.consecutive_failures = 3;
    config.upstream.outlier.base_ejection = Duration::from_millis(800);
    let gw = start_routed(config, 2).await;
    let bad = 0;
    let mut c = sims[bad].state.control();
    c.faults = sluice::sim::faults::Faults::parse("error=500").unwrap();
    sims[bad].state.set_control(c.clone());

    let url = format!("{}/v1/chat/completions", api(&gw));
    let mut failures = 0;
    for _ in 0..12 {
        let (s, _, _) = post(&url, &chat_body(false)).await;
        failures += usize::from(s == 500);
    }
    assert_eq!(failures, 3, "ejected after 3 consecutive failures");
    until_backend(&gw, "ejected", |v| {
        backend(v, &sims[bad])["circuit"] == "open"
    })
    .await;
    let ejected = format!("sluice_backend_ejected{{backend=\"{}\"}}", sims[bad].addr);
    assert_eq!(gateway_metric(&gw, &ejected).await, 1.0);

    // Healed: after the ejection time it is tried again and stays in.
    c.faults = Default::default();
    sims[bad].state.set_control(c);
    until_backend(&gw, "probation", |v| {
        backend(v, &sims[bad])["circuit"] == "half_open"
    })
    .await;
    // On probation it is in rotation again: no longer reported as ejected.
    assert_eq!(gateway_metric(&gw, &ejected).await, 0.0);
    let before = sims[bad].state.metrics.received.get();
    for _ in 0..4 {
        let (s, _, _) = post(&url, &chat_body(false)).await;
        assert_eq!(s, 200);
    }
    assert!(
        sims[bad].state.metrics.received.get() > before,
        "back in rotation"
    );
    until_backend(&gw, "closed", |v| {
        backend(v, &sims[bad])["circuit"] == "closed"
    })
    .await;
    assert_eq!(gateway_metric(&gw, &ejected).await, 0.0);
}

/// Bind a simulator on `ip` and the given port (0: any).
async fn sim_on(ip: Ipv4Addr, port: u16) -> Option<SimHandle> {
    let l = tokio::net::TcpListener::bind((ip, port)).await.ok()?;
    sluice::sim::start(l, fast_sim()).await.ok()
}

#[tokio::test]
async fn dns_changes_are_picked_up() {
    // Two replicas on the same port of two loopback addresses, as pods behind
    // a headless Service.
    let (ip_a, ip_b) = (Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3));
    let mut pair = None;
    for _ in 0..20 {
        let a = sim_on(ip_a, 0).await.expect("bind 127.0.0.2");
        if let Some(b) = sim_on(ip_b, a.addr.port()).await {
            pair = Some((a, b));
            break;
        }
    }
    let (a, b) = pair.expect("a port free on both addresses");
    let dns = dns::start("replicas.test.", &[ip_a]).await;
    let mut config = routing_config(&[]);
    config.discovery.nameserver = Some(dns.addr);
    config.discovery.dns = vec![DnsSource {
        name: "replicas.test.".into(),
        port: a.addr.port(),
        interval: Duration::from_millis(200),
        api_key: None,
        models: vec![],
        max_concurrency: None,
        engine_priority: Default::default(),
        dcgm_port: None,
        role: Default::default(),
        bootstrap_port: None,
    }];
    let gw = start_routed(config.clone(), 1).await;
    let sims = [a, b];
    assert_eq!(gw.state().pool.replicas().len(), 1);
    assert_eq!(served_by(&gw, &sims, &prefixed(0, 0)).await, 0);

    dns.set(&[ip_a, ip_b]);
    let pool = gw.state().pool.clone();
    wait_until(
        "second replica discovered and healthy",
        Duration::from_secs(5),
        || {
            let pool = pool.clone();
            async move { pool.replicas().iter().filter(|r| r.is_healthy()).count() == 2 }
        },
    )
    .await;
    let mut seen = [false; 2];
    for p in 0..16 {
        seen[served_by(&gw, &sims, &prefixed(p, 0)).await] = true;
    }
    assert_eq!(seen, [true, true], "both replicas take work");

    dns.set(&[ip_b]);
    wait_until("first replica removed", Duration::from_secs(5), || {
        let pool = pool.clone();
        async move { pool.replicas().len() == 1 }
    })
    .await;
    for p in 0..6 {
        assert_eq!(served_by(&gw, &sims, &prefixed(p, 1)).await, 1);
    }
    let (_, m) = get_text(&format!("{}/metrics", admin(&gw))).await;
    assert!(
        !m.contains(&format!("backend=\"{}\"", sims[0].addr)),
        "removed replica's series dropped"
    );

    // A reload that gives the source a key: its replicas (found before the
    // reload, same name and port) send it from the next request on.
    let before = gw.state().pool.replicas()[0].clone();
    config.discovery.dns[0].api_key = Some(sluice::config::Secret::new("sk-replicas".to_string()));
    gw.reload(config.clone()).unwrap();
    let after = gw.state().pool.replicas();
    assert_eq!(
        after.len(),
        1,
        "the discovered replica is kept across the reload"
    );
    assert!(
        !std::sync::Arc::ptr_eq(&after[0], &before),
        "rebuilt with the key"
    );
    assert!(after[0].is_healthy(), "and still healthy");
    assert_eq!(served_by(&gw, &sims, &prefixed(0, 2)).await, 1);
    let (_, last) = get_text(&format!("{}/sim/last_request", sims[1].url())).await;
    let last: serde_json::Value = serde_json::from_str(&last).unwrap();
    assert_eq!(
        last["headers"]["authorization"], "Bearer sk-replicas",
        "{last}"
    );
}

#[tokio::test]
async fn a_hot_prefix_spills_to_other_replicas_once_its_home_queues() {
    let mut slow = fast_sim();
    slow.token_delay = Duration::from_millis(300);
    slow.output_tokens = 10;
    let mut sims = Vec::new();
    for _ in 0..3 {
        sims.push(start_sim(slow.clone()).await);
    }
    let gw = start_routed(routing_config(&urls(&sims)), 3).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    // `n` requests of the hot prefix at once, each routed while the ones
    // before it are in flight; the replicas' request counts after.
    let burst = |first: usize, n: usize| {
        let url = url.clone();
        let pool = gw.state().pool.clone();
        async move {
            let before: usize = pool.replicas().iter().map(|r| r.in_flight() as usize).sum();
            let mut reqs = Vec::new();
            for q in first..first + n {
                let url = url.clone();
                let mut body = prefixed(9, q);
                body["max_tokens"] = 10.into();
                reqs.push(tokio::spawn(async move { post(&url, &body).await.0 }));
                let want = before + q - first + 1;
                let pool = pool.clone();
                wait_until("request in flight", Duration::from_secs(5), || {
                    let pool = pool.clone();
                    async move {
                        pool.replicas()
                            .iter()
                            .map(|r| r.in_flight() as usize)
                            .sum::<usize>()
                            >= want
                    }
                })
                .await;
            }
            for r in reqs {
                assert_eq!(r.await.unwrap(), 200);
            }
        }
    };
    let received = |sims: &[SimHandle]| -> Vec<u64> {
        sims.iter()
            .map(|s| s.state.metrics.received.get())
            .collect()
    };
    // While its engine batches all of it (nothing waits there), the home
    // keeps the prefix, however many requests it has in flight: none leave
    // for its load, nor for their predicted first token (these replicas
    // take 300 ms to it, so this gateway's backlog there predicts seconds):
    // elsewhere the prompt would be prefilled cold, and the engine has not
    // said it is full.
    burst(0, 20).await;
    let per = received(&sims);
    let home = (0..3).max_by_key(|&i| per[i]).unwrap();
    assert!(per[home] >= 10, "{per:?}");
    assert_eq!(reasons(&gw, "spill_load").await, 0.0);
    assert_eq!(reasons(&gw, "detour").await, 0.0);

    // Its engine queues: past its bounded load (twice its share and 8 above
    // it), the prefix gets other homes.
    let mut c = sims[home].state.control();
    c.waiting = Some(4.0);
    sims[home].state.set_control(c);
    until_backend(&gw, "the queue seen", |v| {
        backend(v, &sims[home])["engine_queued"] == true
    })
    .await;
    burst(20, 40).await;
    let per: Vec<u64> = received(&sims)
        .iter()
        .zip(&per)
        .map(|(after, before)| after - before)
        .collect();
    let lf = sluice::config::PrefixKvConfig::default().load_factor;
    let share = (lf * 40.0 / 3.0).ceil() as u64 + 1;
    assert!(
        per.iter().all(|&n| n <= share),
        "bounded share per replica: {per:?}"
    );
    assert!(
        per.iter().filter(|&&n| n > 0).count() >= 2,
        "spilled: {per:?}"
    );
    // Moved past its bound, or before it for the first token's wait (off a
    // home whose engine queues: `spill_queue`).
    assert!(reasons(&gw, "spill_load").await + reasons(&gw, "spill_queue").await >= 1.0);
}

/// `sluice_routing_home_store_total` of `op` and `outcome`.
fn home_store(op: &str, outcome: &str) -> String {
    format!("sluice_routing_home_store_total{{op=\"{op}\",outcome=\"{outcome}\"}}")
}

/// A connection to the shared table's Redis, and the prefix homes it holds.
async fn home_keys(
    redis: &crate::common::redis::Redis,
) -> (::redis::aio::MultiplexedConnection, Vec<String>) {
    let mut conn = ::redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let keys: Vec<String> = ::redis::cmd("KEYS")
        .arg("sluice:home:*")
        .query_async(&mut conn)
        .await
        .unwrap();
    (conn, keys)
}

/// A disaggregated model's prompts the shared table homes in `pool`
/// (`prefill` or `decode`).
fn homed_in(keys: &[String], pool: &str) -> usize {
    let tag = format!("{{sim-model/{pool}}}");
    keys.iter().filter(|k| k.contains(&tag)).count()
}

/// After [`SAMPLED_PROMPTS`] new prompts of a disaggregated model, each
/// placing a home in both pools: each pool's lookups sampled apart. In
/// each pool, after its [`SAMPLED_FROM`]th new prompt, those whose key is
/// not a multiple of 16 are not looked up (about 56 of the last 60) and not
/// written (one count for both pools would start sampling at the fiftieth).
pub async fn each_pool_sampled(gw: &Gateway, redis: &crate::common::redis::Redis) {
    let prompts = SAMPLED_PROMPTS;
    let placed = gateway_metric(gw, &home_store("place", "placed")).await;
    let novel = gateway_metric(gw, &home_store("place", "novel")).await;
    assert_eq!(placed + novel, 2.0 * prompts as f64, "a home in each pool");
    let keys = home_keys(redis).await.1;
    for pool in ["prefill", "decode"] {
        let written = homed_in(&keys, pool);
        assert!(
            (SAMPLED_FROM..=SAMPLED_FROM + 20).contains(&written),
            "{pool}: {written} of {prompts} written ({novel} not looked up)"
        );
    }
}

/// After the same `prompts` used again: every one homed in both pools,
/// those placed without the table written by their touches, none of the
/// writes failed. (A spill writes nothing: the prompts used again must not
/// find their replica busier than another.)
pub async fn each_pool_homes_all(
    gw: &Gateway,
    redis: &crate::common::redis::Redis,
    prompts: usize,
) {
    let homed = || async move {
        let keys = home_keys(redis).await.1;
        (homed_in(&keys, "prefill"), homed_in(&keys, "decode"))
    };
    // (The writes go in the background.)
    let all = tokio::time::timeout(Duration::from_secs(20), async {
        let mut poll = tokio::time::interval(Duration::from_millis(20));
        loop {
            poll.tick().await;
            if homed().await == (prompts, prompts) {
                return;
            }
        }
    })
    .await;
    let mut writes = Vec::new();
    for (op, outcomes) in [
        (
            "place",
            &["placed", "found", "novel", "skipped", "error"][..],
        ),
        ("touch", &["ok", "elsewhere", "error"][..]),
        ("move", &["ok", "elsewhere", "error"][..]),
    ] {
        for o in outcomes {
            writes.push((op, *o, gateway_metric(gw, &home_store(op, o)).await));
        }
    }
    let homed = homed().await;
    assert!(
        all.is_ok(),
        "homed (prefill, decode) {homed:?} of {prompts}: {writes:?}"
    );
    assert!(
        writes.iter().all(|w| w.1 != "error" || w.2 == 0.0),
        "{writes:?}"
    );
}

/// Two gateways sharing prefix homes through a real Redis
/// (`routing.sessions.store: redis`, `routing.prefix_kv.shared_homes`)
/// whose indexes differ: each first placed three prefixes of its own, so
/// each sees a different replica as holding least. Eight new prefixes, each
/// met first by one gateway and then by the other: the second finds it
/// where the first placed it, and every prefix was placed once, on the
/// replica with the fewest homes over both gateways (each placing alone by
/// its own index, a new prefix's two gateways choose apart about three
/// times in four).
#[tokio::test]
async fn gateways_sharing_prefix_homes_place_a_new_prefix_alike_whatever_their_indexes() {
    let redis = crate::common::redis::start().await;
    let sims = sims(4).await;
    let mut gws = Vec::new();
    for _ in 0..2 {
        let mut c = routing_config(&urls(&sims));
        shared_table(&mut c, &redis);
        gws.push(start_routed(c, 4).await);
    }
    let urls: Vec<String> = gws.iter().map(api).collect();
    let mut homes = [0usize; 4];
    // Each gateway's own prefixes, sent through it alone.
    for own in 0..6 {
        homes[served_via(&urls[own / 3], &sims, &prefixed(100 + own, 0)).await] += 1;
    }
    for p in 0..8 {
        let first = served_via(&urls[p % 2], &sims, &prefixed(p, 0)).await;
        let second = served_via(&urls[(p + 1) % 2], &sims, &prefixed(p, 1)).await;
        let third = served_via(&urls[p % 2], &sims, &prefixed(p, 2)).await;
        assert_eq!(first, second, "prefix {p}: the gateways disagree");
        assert_eq!(first, third, "prefix {p}: not sticky");
        homes[first] += 1;
    }
    // Fourteen homes by the fewest over both gateways: 4/4/3/3.
    homes.sort_unstable();
    assert_eq!(homes, [3, 3, 4, 4]);
    let (mut placed, mut found) = (0.0, 0.0);
    for gw in &gws {
        placed += gateway_metric(gw, &home_store("place", "placed")).await;
        found += gateway_metric(gw, &home_store("place", "found")).await;
        // Counted as new where placed, and as affinity after.
        assert!(reasons(gw, "affinity").await >= 4.0);
    }
    assert_eq!(placed, 14.0);
    assert_eq!(
        found, 8.0,
        "each new prefix found once by the other gateway"
    );
    assert_eq!(
        reasons(&gws[0], "prefix_new").await + reasons(&gws[1], "prefix_new").await,
        14.0
    );
}

/// A prefix the shared table homes elsewhere than where this gateway holds
/// it (another gateway moved it): the gateway's next request of it is
/// still served at its holder, whose touch finds the other home; the
/// gateway forgets its holder, and its next request goes where the table
/// says, as every other gateway's do.
#[tokio::test]
async fn a_gateway_follows_a_prefix_home_another_gateway_moved() {
    let redis = crate::common::redis::start().await;
    let sims = sims(3).await;
    let mut c = routing_config(&urls(&sims));
    shared_table(&mut c, &redis);
    let gw = start_routed(c, 3).await;
    let url = api(&gw);
    let first = served_via(&url, &sims, &prefixed(7, 0)).await;
    // Another gateway moves it: the table names another replica.
    let (mut conn, keys) = home_keys(&redis).await;
    assert_eq!(keys.len(), 1, "{keys:?}");
    let home: String = ::redis::cmd("GET")
        .arg(&keys[0])
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(home, sims[first].addr.to_string());
    let other = (first + 1) % sims.len();
    let () = ::redis::cmd("SET")
        .arg(&keys[0])
        .arg(sims[other].addr.to_string())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(served_via(&url, &sims, &prefixed(7, 1)).await, first);
    let (gw, elsewhere) = (&gw, home_store("touch", "elsewhere"));
    wait_until(
        "the touch found the other home",
        Duration::from_secs(5),
        || {
            let elsewhere = elsewhere.clone();
            async move { gateway_metric(gw, &elsewhere).await == 1.0 }
        },
    )
    .await;
    assert_eq!(served_via(&url, &sims, &prefixed(7, 2)).await, other);
    assert_eq!(gateway_metric(gw, &home_store("place", "found")).await, 1.0);
}

/// A gateway meeting only new prompts (a hundred and more in 5-10 s, the
/// sampling's threshold lowered from its thousand, none homed by another
/// gateway) looks up one in sixteen: the others are placed
/// as without the table and not written, until used again: then the touch
/// writes each where the table has none, on the replica that holds it.
#[tokio::test]
async fn a_gateway_meeting_only_new_prompts_looks_up_a_sample_and_writes_what_is_used_again() {
    let redis = crate::common::redis::start().await;
    let sims = sims(2).await;
    let mut c = routing_config(&urls(&sims));
    shared_table_sampled_soon(&mut c, &redis);
    let gw = start_routed(c, 2).await;
    let url = format!("{}/v1/chat/completions", api(&gw));
    const PROMPTS: usize = SAMPLED_PROMPTS;
    // Every prompt twice, 16 at a time (within a replica's bounded load):
    // first all new, then again.
    for question in 0..2 {
        for batch in (0..PROMPTS).collect::<Vec<_>>().chunks(16) {
            let mut sent = tokio::task::JoinSet::new();
            for &p in batch {
                let url = url.clone();
                sent.spawn(async move { post(&url, &prefixed(p, question)).await.0 });
            }
            while let Some(status) = sent.join_next().await {
                assert_eq!(status.unwrap(), 200);
            }
        }
    }
    let placed = gateway_metric(&gw, &home_store("place", "placed")).await;
    let novel = gateway_metric(&gw, &home_store("place", "novel")).await;
    // After the hundredth, those whose key is not a multiple of 16 are not
    // looked up (about 56 of the last 60).
    assert_eq!(placed + novel, PROMPTS as f64);
    assert!(
        (40.0..=60.0).contains(&novel),
        "{placed} placed, {novel} not looked up"
    );
    assert_eq!(reasons(&gw, "prefix_new").await, PROMPTS as f64);
    // Used again: every prefix is in the table, those placed without it
    // written by their touch; none was written as placed without the table.
    let (gw, touched) = (&gw, home_store("touch", "ok"));
    wait_until("every prefix touched", Duration::from_secs(10), || {
        let touched = touched.clone();
        async move { gateway_metric(gw, &touched).await >= PROMPTS as f64 }
    })
    .await;
    assert_eq!(home_keys(&redis).await.1.len(), PROMPTS);
    assert_eq!(gateway_metric(gw, &home_store("move", "ok")).await, 0.0);
    assert_eq!(
        gateway_metric(gw, &home_store("touch", "elsewhere")).await,
        0.0
    );
}

/// Through gateways sharing prefix homes, a new prefix goes, among replicas
/// with equal homes, where no other gateway's new home is being prefilled
/// (each gateway alone sees only its own prefills: through three, cold
/// prefills queued behind one another's). The count ends at the first
/// token.
#[tokio::test]
async fn gateways_sharing_prefix_homes_spread_cold_prefills() {
    let redis = crate::common::redis::start().await;
    // Every answer's first token 1.5 s after it arrives: a prefill under
    // way for as long as the steps below take.
    let mut sims = Vec::new();
    for _ in 0..2 {
        sims.push(
            start_sim(SimConfig {
                prefill_delay: Duration::from_millis(1500),
                ..fast_sim()
            })
            .await,
        );
    }
    let mut gws = Vec::new();
    for _ in 0..2 {
        let mut c = routing_config(&urls(&sims));
        shared_table(&mut c, &redis);
        gws.push(start_routed(c, 2).await);
    }
    let (a, b) = (api(&gws[0]), api(&gws[1]));
    let (gw_a, gw_b) = (&gws[0], &gws[1]);
    let conn = ::redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let sims = &sims;
    let counted = |conn: &::redis::aio::MultiplexedConnection| {
        let mut conn = conn.clone();
        async move {
            let mut n = [0u64; 2];
            for (i, s) in sims.iter().enumerate() {
                n[i] = ::redis::cmd("ZCARD")
                    .arg(format!("sluice:cold:{{sim-model/serve}}:{}", s.addr))
                    .query_async(&mut conn)
                    .await
                    .unwrap();
            }
            n
        }
    };
    let ended = &home_store("cold", "ok");
    // Gateway b homes three prefixes (two on y, one on x), and they end.
    let mut q = Vec::new();
    for p in 0..3 {
        q.push(served_via(&b, sims, &prefixed(p, 0)).await);
    }
    let y = if q.iter().filter(|&&r| r == 0).count() == 2 {
        0
    } else {
        1
    };
    assert_eq!(q.iter().filter(|&&r| r == y).count(), 2, "{q:?}");
    wait_until(
        "b's prefills no longer counted",
        Duration::from_secs(5),
        || async move { gateway_metric(gw_b, ended).await == 3.0 },
    )
    .await;
    assert_eq!(counted(&conn).await, [0, 0]);
    // Gateway a places a new prefix on x (the fewest homes); its prefill is
    // under way there.
    let before: Vec<u64> = sims
        .iter()
        .map(|s| s.state.metrics.received.get())
        .collect();
    let (a_url, a_body) = (format!("{a}/v1/chat/completions"), prefixed(3, 0));
    let via_a = post(&a_url, &a_body);
    let rest = async {
        let x = std::cell::Cell::new(None);
        let (x_ref, conn) = (&x, &conn);
        wait_until(
            "a's new home counted",
            Duration::from_secs(5),
            || async move {
                let n = counted(conn).await;
                x_ref.set(n.iter().position(|&c| c == 1));
                x_ref.get().is_some()
            },
        )
        .await;
        let x = x.get().unwrap();
        assert_eq!(x, 1 - y);
        // Gateway b's own view prefers x: it has just sent a prefix it
        // homed on y there again (in flight), and sent x one prompt of three.
        let held_on_y = q.iter().position(|&r| r == y).unwrap();
        let (b_url, b_body) = (format!("{b}/v1/chat/completions"), prefixed(held_on_y, 1));
        let again = post(&b_url, &b_body);
        let new = async {
            let routed = "sluice_routing_decisions_total{model=\"sim-model\",reason=\"affinity\"}";
            wait_until(
                "b routed the held prefix",
                Duration::from_secs(5),
                || async move { gateway_metric(gw_b, routed).await == 1.0 },
            )
            .await;
            // b meets a new prefix: homes are equal (two each), so the cold
            // prefill under way on x sends it to y.
            post(&format!("{b}/v1/chat/completions"), &prefixed(4, 0)).await
        };
        let (again, new) = tokio::join!(again, new);
        assert_eq!((again.0, new.0), (200, 200), "{} {}", again.2, new.2);
        x
    };
    let (first, x) = tokio::join!(via_a, rest);
    assert_eq!(first.0, 200, "{}", first.2);
    let got: Vec<u64> = (0..2)
        .map(|i| sims[i].state.metrics.received.get() - before[i])
        .collect();
    assert_eq!(
        (got[x], got[1 - x]),
        (1, 2),
        "the new prefix went where a's cold prefill was under way"
    );
    // Every count ended with its prefill.
    wait_until(
        "b's new prefill no longer counted",
        Duration::from_secs(5),
        || async move { gateway_metric(gw_b, ended).await == 4.0 },
    )
    .await;
    wait_until(
        "a's prefill no longer counted",
        Duration::from_secs(5),
        || async move { gateway_metric(gw_a, ended).await == 1.0 },
    )
    .await;
    assert_eq!(counted(&conn).await, [0, 0]);
}

/// SGLang caches a prompt once the forward pass computing it has ended: a
/// second request for a prompt whose prefill the gateway has under way on
/// the same replica would compute it again beside the first. With
/// `hold_for_prefill: auto` the gateway holds it until the first's first
/// token where the replica's metrics say SGLang (the simulator caching as
/// SGLang does, speaking its metrics), and it finds all but the prompt's
/// last partial block cached; not where they say vLLM (which shares a
/// prompt from allocation), nor with `off`. The prompt's prefill takes three
/// engine steps of ~0.5 s (256 tokens a step).
#[tokio::test]
async fn a_request_for_a_prompt_being_prefilled_waits_for_it_where_the_engine_caches_after_the_forward_pass()
 {
    use sluice::config::HoldForPrefill;
    let doc = "Every replica reports its queue and its cache. ".repeat(52);
    let cached = |u: &serde_json::Value| {
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("no cached tokens in {u}"))
    };
    for (dialect, hold, held) in [
        (Dialect::Sglang, HoldForPrefill::Auto, true),
        (Dialect::Vllm, HoldForPrefill::Auto, false),
        (Dialect::Sglang, HoldForPrefill::Off, false),
    ] {
        let mut cfg = SimConfig::engine("tiny", 0.01).unwrap();
        cfg.profile.as_mut().unwrap().max_num_batched_tokens = 256;
        cfg.dialect = dialect;
        let sim = start_sim(cfg).await;
        let mut c = routing_config(&[sim.url()]);
        c.routing.prefix_kv.hold_for_prefill = hold;
        let gw = start_routed(c, 1).await;
        let base = api(&gw);
        let first = {
            let (base, doc) = (base.clone(), doc.clone());
            tokio::spawn(async move { crate::sim::stream_chat(&base, &doc, 2).await })
        };
        // The first is at the engine (the gateway marked its prefill before
        // sending it), a second's worth of prefill from its first token.
        wait_until(
            "the first request sent",
            Duration::from_secs(10),
            || async { sim.state.metrics.received.get() >= 1 },
        )
        .await;
        let (_, _, second) = crate::sim::stream_chat(&base, &doc, 2).await;
        let (_, _, first) = first.await.unwrap();
        let prompt = second["prompt_tokens"].as_u64().unwrap();
        assert!((600..700).contains(&prompt), "{prompt} prompt tokens");
        assert_eq!(cached(&first), 0, "{dialect:?} {hold:?}: {first}");
        let holds = gateway_metric(
            &gw,
            r#"sluice_routing_prefill_holds_total{model="sim-model",prefill="own",outcome="prefilled"}"#,
        )
        .await;
        if held {
            assert_eq!(holds, 1.0);
            assert!(cached(&second) + 16 >= prompt, "{second}");
        } else {
            assert_eq!(holds, 0.0, "{dialect:?} {hold:?}");
            // The chunks computed before it was admitted, at most.
            assert!(cached(&second) <= 512, "{dialect:?} {hold:?}: {second}");
        }
    }
}

/// Streams `doc` through the gateway at `base` in the background, with the
/// simulated engine's fault `fault` (`x-sim-fault`): the task ends with the
/// answer, or when it is aborted.
pub fn send_with_fault(base: &str, doc: &str, fault: &'static str) -> tokio::task::JoinHandle<()> {
    let url = format!("{base}/v1/chat/completions");
    let body = serde_json::json!({
        "model": "sim-model",
        "stream": true,
        "max_tokens": 2,
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": doc}],
    });
    tokio::spawn(async move {
        let sent = client()
            .post(&url)
            .header("x-sim-fault", fault)
            .json(&body)
            .send()
            .await;
        if let Ok(r) = sent {
            let _ = r.bytes().await;
        }
    })
}

/// Streams `doc` through the gateway at `base` to `sim`, whose engine holds
/// it a minute before starting it (so it stays before its first token),
/// once `sim` has it: the task ends when it is aborted.
async fn send_stalled(base: &str, doc: &str, sim: &SimHandle) -> tokio::task::JoinHandle<()> {
    let first = send_with_fault(base, doc, "first_token=60s");
    wait_until(
        "the first request sent",
        Duration::from_secs(10),
        || async { sim.state.metrics.received.get() >= 1 },
    )
    .await;
    first
}

/// Streams `doc` through the gateway in the background, once the gateway
/// has counted `decisions` routing decisions with it (it is past routing).
async fn send_routed(
    base: &str,
    doc: &str,
    gw: &Gateway,
    decisions_then: f64,
) -> tokio::task::JoinHandle<(Duration, Duration, serde_json::Value)> {
    let (base, doc) = (base.to_string(), doc.to_string());
    let sent = tokio::spawn(async move { crate::sim::stream_chat(&base, &doc, 2).await });
    wait_until("the request routed", Duration::from_secs(10), || async {
        decisions(gw).await >= decisions_then
    })
    .await;
    sent
}

/// A short request streamed through the gateway at `base` is served while
/// `held`, a cold prefill waiting in the gate, is not sent: once it is
/// served the engine has received `received` requests, and `held` waits on.
async fn short_passes<T>(
    base: &str,
    sim: &SimHandle,
    received: u64,
    held: &tokio::task::JoinHandle<T>,
) {
    let (_, _, short) = crate::sim::stream_chat(base, "How are you?", 2).await;
    assert!(short["prompt_tokens"].as_u64().unwrap() < 256, "{short}");
    assert_eq!(
        sim.state.metrics.received.get(),
        received,
        "the short one reached the engine, the one waiting in the gate not"
    );
    assert!(!held.is_finished());
}

/// Ends `blocker` (its client leaves, before its first token) and returns
/// once `waiting`, a cold prefill waiting in the gate behind it, has been
/// sent and answered (`why` is the message if it is not within 30 s).
async fn goes_once_ended(
    blocker: tokio::task::JoinHandle<()>,
    waiting: tokio::task::JoinHandle<(Duration, Duration, serde_json::Value)>,
    why: &str,
) {
    blocker.abort();
    let _ = blocker.await;
    let (_, _, usage) = tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect(why)
        .unwrap();
    assert!(usage["prompt_tokens"].as_u64().unwrap() >= 256, "{usage}");
}

/// Cold prefills the gateway counted as having waited in a replica's gate,
/// by how the wait ended.
async fn gate_waits(gw: &Gateway, outcome: &str) -> f64 {
    gateway_metric(
        gw,
        &format!(
            "sluice_routing_cold_gate_waits_total{{model=\"sim-model\",outcome=\"{outcome}\"}}"
        ),
    )
    .await
}

/// The routing decisions the gateway counted for the test model.
async fn decisions(gw: &Gateway) -> f64 {
    let (_, text) = get_text(&format!("{}/metrics", admin(gw))).await;
    text.lines()
        .filter(|l| l.starts_with("sluice_routing_decisions_total{model=\"sim-model\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>()
}

/// A prefill whose attempt ends without a first token (here its client
/// leaves while the engine has not begun it) releases the requests held for
/// it; the first of them to go marks the prompt's prefill again and the
/// other waits for that one's first token, then finds the prompt cached: one
/// recompute, not one per waiter.
#[tokio::test]
async fn a_prefill_that_ends_without_a_first_token_is_computed_again_once() {
    let doc = "Every replica reports its queue and its cache. ".repeat(52);
    let mut cfg = SimConfig::engine("tiny", 0.01).unwrap();
    cfg.profile.as_mut().unwrap().max_num_batched_tokens = 256;
    cfg.dialect = Dialect::Sglang;
    let sim = start_sim(cfg).await;
    let gw = start_routed(routing_config(&[sim.url()]), 1).await;
    let base = api(&gw);
    // The first: the engine holds it a minute before starting it, so it
    // computes nothing; the gateway marks its prefill when it sends it.
    let first = send_stalled(&base, &doc, &sim).await;
    let held = |base: String, doc: String| {
        tokio::spawn(async move { crate::sim::stream_chat(&base, &doc, 2).await })
    };
    let (b, c) = (
        held(base.clone(), doc.clone()),
        held(base.clone(), doc.clone()),
    );
    // Both routed (the routing decision is counted just before the hold).
    wait_until("all three routed", Duration::from_secs(10), || async {
        decisions(&gw).await >= 3.0
    })
    .await;
    assert_eq!(
        sim.state.metrics.received.get(),
        1,
        "the two others are held"
    );
    first.abort();
    let _ = first.await;
    let (b, c) = (b.await.unwrap().2, c.await.unwrap().2);
    let cached = |u: &serde_json::Value| {
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("no cached tokens in {u}"))
    };
    let prompt = b["prompt_tokens"].as_u64().unwrap();
    let mut got = [cached(&b), cached(&c)];
    got.sort_unstable();
    // One computed the prompt (the first had computed none of it); the
    // other waited for it and prefilled only its last partial block.
    assert_eq!(got[0], 0, "{b} {c}");
    assert!(got[1] + 16 >= prompt, "{b} {c}");
    let holds = |outcome: &'static str| {
        let gw = &gw;
        async move {
            gateway_metric(
                gw,
                &format!(
                    "sluice_routing_prefill_holds_total{{model=\"sim-model\",prefill=\"own\",outcome=\"{outcome}\"}}"
                ),
            )
            .await
        }
    };
    assert_eq!((holds("ended").await, holds("prefilled").await), (1.0, 1.0));
    // The one that computed it was placed as computing it (nothing cached),
    // not as routing had counted it, in the prefill that ended: what routing
    // predicted cached is near what the engine reported (a shortfall would
    // read as the replica evicting, and drop the prompt from the index).
    let series = |name: &str| format!("sluice_backend_{name}{{backend=\"{}\"}}", sim.addr);
    let gw = &gw;
    let in_flight = series("in_flight");
    wait_until("both answers counted", Duration::from_secs(5), || {
        let in_flight = &in_flight;
        async move { gateway_metric(gw, in_flight).await == 0.0 }
    })
    .await;
    let predicted = gateway_metric(gw, &series("cached_tokens_predicted_total")).await;
    let actual = gateway_metric(gw, &series("cached_tokens_actual_total")).await;
    assert_eq!(actual, got[1] as f64);
    // (Routing counts tokens from characters: near the engine's count, not
    // equal. Counted cached for both, it would be twice the engine's.)
    assert!(
        predicted < 1.5 * actual,
        "{predicted} predicted, {actual} cached"
    );
}

/// The closed loop's precision (`cache_kept` in `/admin/routing`): the share
/// of the cached tokens routing predicted on a replica that its engine
/// reported lately. It reads 1 while the engine had what routing expected,
/// and falls once the engine evicted a prompt routing still counted there.
#[tokio::test]
async fn a_replica_whose_engine_evicted_what_it_was_sent_reads_as_keeping_less() {
    // An engine with a prefix cache of 1,408 tokens: one long prompt (1,376
    // of its tokens) sent straight to it evicts all but the first blocks of
    // the document (207).
    let mut cfg = SimConfig::engine("tiny", 10.0).unwrap();
    cfg.profile.as_mut().unwrap().num_blocks = 88;
    let sim = start_sim(cfg).await;
    let gw = start_routed(routing_config(&[sim.url()]), 1).await;
    let predicted = format!(
        "sluice_backend_cached_tokens_predicted_total{{backend=\"{}\"}}",
        sim.addr
    );
    let kept = || async {
        let (status, text) = get_text(&format!("{}/admin/routing", admin(&gw))).await;
        assert_eq!(status, 200, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["replicas"][0]["cache_kept"]
            .as_f64()
            .unwrap_or_else(|| panic!("no cache_kept in {v}"))
    };
    let one = std::slice::from_ref(&sim);
    served_by(&gw, one, &prefixed(1, 1)).await;
    assert_eq!(kept().await, 1.0, "nothing predicted yet");
    // Predicted cached, and cached.
    served_by(&gw, one, &prefixed(1, 2)).await;
    wait_until("the prediction counted", Duration::from_secs(5), || async {
        gateway_metric(&gw, &predicted).await >= 16.0
    })
    .await;
    assert_eq!(kept().await, 1.0);
    // Evicted behind the gateway's back: predicted cached, none there.
    evict_with_a_long_prompt(&sim).await;
    served_by(&gw, one, &prefixed(1, 3)).await;
    wait_until("cache_kept below 0.9", Duration::from_secs(5), || async {
        kept().await < 0.9
    })
    .await;
}

/// Cold prefills are paced per replica (`cold_prefill_tokens`): a streamed
/// request whose prompt the replica would compute afresh waits at the
/// gateway while this gateway's cold prefills under way there (sent, before
/// their first tokens) and its own exceed the budget; a short request goes
/// straight on meanwhile, and the held one goes when the earlier one ends.
/// With the budget at 0 nothing waits. (The first request's engine holds it
/// a minute before starting it, so that it stays before its first token.)
#[tokio::test]
async fn a_cold_prefill_waits_at_the_gateway_for_the_one_before_it_and_a_short_request_passes() {
    let docs = [
        "Every replica reports its queue and its cache. ".repeat(52),
        "Each gateway paces the prompts it sends afresh. ".repeat(52),
    ];
    for budget in [1000, 0] {
        let sim = start_sim(SimConfig::engine("tiny", 0.01).unwrap()).await;
        calm(&sim);
        let mut c = routing_config(&[sim.url()]);
        c.routing.prefix_kv.cold_prefill_tokens = budget;
        let gw = start_routed(c, 1).await;
        let base = api(&gw);
        let first = send_stalled(&base, &docs[0], &sim).await;
        // Another prompt of ~600 tokens: 1,200 under way would exceed 1,000.
        let second = send_routed(&base, &docs[1], &gw, 2.0).await;
        if budget == 0 {
            wait_until(
                "the second sent at once",
                Duration::from_secs(10),
                || async { sim.state.metrics.received.get() >= 2 },
            )
            .await;
            let (_, _, usage) = second.await.unwrap();
            assert!(usage["prompt_tokens"].as_u64().unwrap() >= 256);
            first.abort();
            let _ = first.await;
            let waits = gateway_metric(
                &gw,
                r#"sluice_routing_cold_gate_waits_total{model="sim-model",outcome="sent"}"#,
            )
            .await;
            assert_eq!(waits, 0.0);
            continue;
        }
        // A short request passes the held one: it is served while the
        // second still waits for the first.
        short_passes(&base, &sim, 2, &second).await;
        // The first ends without a first token: the second goes.
        goes_once_ended(first, second, "the second was sent when the first ended").await;
        assert_eq!(sim.state.metrics.received.get(), 3);
        let waits = |outcome| gate_waits(&gw, outcome);
        assert_eq!((waits("sent").await, waits("deadline").await), (1.0, 0.0));
        let (_, text) = get_text(&format!("{}/metrics", admin(&gw))).await;
        assert!(
            text.contains(r#"sluice_routing_cold_gate_wait_seconds_count{model="sim-model"} 1"#),
            "{text}"
        );
    }
}

/// The simulated engine reports no queue, whatever it holds: a request its
/// fault holds before its first token (reported as waiting) looks like one
/// in a long prefill, as an engine shows that.
fn calm(sim: &SimHandle) {
    let mut c = sim.state.control();
    c.waiting = Some(0.0);
    sim.state.set_control(c);
}

/// The gate stands aside on a replica whose engine says it is full (its
/// queue outlived a scrape): a cold prefill held there behind one whose
/// first token has not come goes once the engine reports a queue, and one
/// routed then is not held at all. (There a first token waits for room in
/// the engine, not for the prefills ahead of it.)
#[tokio::test]
async fn a_cold_prefill_is_not_held_where_the_engine_says_it_is_full() {
    let docs = [
        "Every replica reports its queue and its cache. ".repeat(52),
        "Each gateway paces the prompts it sends afresh. ".repeat(52),
        "An engine that queues sets the first token's wait. ".repeat(50),
    ];
    let sim = start_sim(SimConfig::engine("tiny", 0.01).unwrap()).await;
    calm(&sim);
    let mut c = routing_config(&[sim.url()]);
    c.routing.prefix_kv.cold_prefill_tokens = 1000;
    // (Flow control would hold the third at the gateway, the fleet being
    // full: this is about the gate alone.)
    c.flow_control.enabled = false;
    let gw = start_routed(c, 1).await;
    let base = api(&gw);
    let first = send_stalled(&base, &docs[0], &sim).await;
    let second = send_routed(&base, &docs[1], &gw, 2.0).await;
    // Held: a short request is served meanwhile, the second not sent.
    short_passes(&base, &sim, 2, &second).await;
    // The engine reports a queue: once two scrapes show it, the second goes,
    // the first still before its first token.
    let mut full = sim.state.control();
    full.waiting = Some(2.0);
    sim.state.set_control(full);
    let (_, _, usage) = tokio::time::timeout(Duration::from_secs(30), second)
        .await
        .expect("the second went when the engine said it was full")
        .unwrap();
    assert!(usage["prompt_tokens"].as_u64().unwrap() >= 256, "{usage}");
    assert!(!first.is_finished());
    // Routed while the engine says so, a third goes at once.
    let (_, _, usage) = tokio::time::timeout(
        Duration::from_secs(30),
        crate::sim::stream_chat(&base, &docs[2], 2),
    )
    .await
    .expect("the third was not held");
    assert!(usage["prompt_tokens"].as_u64().unwrap() >= 256, "{usage}");
    assert!(!first.is_finished());
    let waits = |outcome| gate_waits(&gw, outcome);
    // The second is counted as gone for the engine's word, the third not at all.
    assert_eq!(
        (
            waits("pressed").await,
            waits("sent").await,
            waits("deadline").await
        ),
        (1.0, 0.0, 0.0)
    );
    first.abort();
    let _ = first.await;
}

/// Where requests were held for a cold prefill (`hold_for_prefill`), the
/// next cold prefill waits for their first tokens too, not only for that
/// prefill's: released at the same moment, the engine would take them into
/// one step, and a request whose prompt is now cached would pay a whole cold
/// prefill's step. (The first request's engine starts it 5 s after it came,
/// a thousand times what routing the two after it takes; the held one's a
/// minute after.)
#[tokio::test]
async fn a_cold_prefill_waits_for_the_requests_held_for_the_one_before_it() {
    let docs = [
        "Every replica reports its queue and its cache. ".repeat(52),
        "Each gateway paces the prompts it sends afresh. ".repeat(52),
    ];
    let mut cfg = SimConfig::engine("tiny", 0.01).unwrap();
    cfg.dialect = Dialect::Sglang;
    let sim = start_sim(cfg).await;
    calm(&sim);
    let mut c = routing_config(&[sim.url()]);
    c.routing.prefix_kv.cold_prefill_tokens = 1000;
    let gw = start_routed(c, 1).await;
    let base = api(&gw);
    let first = send_with_fault(&base, &docs[0], "first_token=5s");
    wait_until("the first sent", Duration::from_secs(10), || async {
        sim.state.metrics.received.get() >= 1
    })
    .await;
    // The same prompt: held for the first's prefill.
    let held = send_with_fault(&base, &docs[0], "first_token=60s");
    wait_until("the held one routed", Duration::from_secs(10), || async {
        decisions(&gw).await >= 2.0
    })
    .await;
    // Another prompt: waits in the gate for the first.
    let second = send_routed(&base, &docs[1], &gw, 3.0).await;
    assert_eq!(sim.state.metrics.received.get(), 1, "both at the gateway");
    // The first's first token: the held one goes, the second does not.
    tokio::time::timeout(Duration::from_secs(30), first)
        .await
        .expect("the first answered")
        .unwrap();
    wait_until("the held one sent", Duration::from_secs(10), || async {
        sim.state.metrics.received.get() >= 2
    })
    .await;
    // (The first, the held one and the short one reached the engine.)
    short_passes(&base, &sim, 3, &second).await;
    let holds = gateway_metric(
        &gw,
        r#"sluice_routing_prefill_holds_total{model="sim-model",prefill="own",outcome="prefilled"}"#,
    )
    .await;
    assert_eq!(holds, 1.0);
    // The held one's attempt ends before its first token (its client
    // leaves): the second goes.
    goes_once_ended(held, second, "the second went when the held one ended").await;
    let waits = |outcome| gate_waits(&gw, outcome);
    assert_eq!((waits("sent").await, waits("pressed").await), (1.0, 0.0));
}

/// Through gateways sharing prefix homes, a request for a prompt whose new
/// home's cold prefill another gateway has under way (a stream) waits for
/// that prefill's first token, as a gateway waits for its own, where the
/// engine caches a prompt after its forward pass (SGLang's metrics,
/// `hold_for_prefill: auto`): it then finds all but the prompt's tail
/// cached (sent at once, it would find at most the chunks computed before
/// it was admitted, 512 tokens here: the test above), and its placement
/// predicts that.
#[tokio::test]
async fn a_request_for_a_prompt_another_gateway_is_prefilling_waits_for_it() {
    let redis = crate::common::redis::start().await;
    let cached = |u: &serde_json::Value| {
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or_else(|| panic!("no cached tokens in {u}"))
    };
    let doc = "Every replica reports its queue and its cache. ".repeat(52);
    let mut sims = Vec::new();
    for _ in 0..2 {
        let mut cfg = SimConfig::engine("tiny", 0.01).unwrap();
        cfg.profile.as_mut().unwrap().max_num_batched_tokens = 256;
        cfg.dialect = Dialect::Sglang;
        sims.push(start_sim(cfg).await);
    }
    let mut gws = Vec::new();
    for _ in 0..2 {
        let mut c = routing_config(&urls(&sims));
        shared_table_unhurried(&mut c, &redis);
        gws.push(start_routed(c, 2).await);
    }
    let received = || -> u64 { sims.iter().map(|s| s.state.metrics.received.get()).sum() };
    // Through the first gateway: a new home, its prefill under way (three
    // engine steps of ~0.5 s) once the engine has it.
    let first = {
        let (base, doc) = (api(&gws[0]), doc.clone());
        tokio::spawn(async move { crate::sim::stream_chat(&base, &doc, 2).await })
    };
    wait_until(
        "the first request sent",
        Duration::from_secs(10),
        || async { received() >= 1 },
    )
    .await;
    let (_, _, second) = crate::sim::stream_chat(&api(&gws[1]), &doc, 2).await;
    let (_, _, first) = first.await.unwrap();
    let prompt = second["prompt_tokens"].as_u64().unwrap();
    assert!((600..700).contains(&prompt), "{prompt} prompt tokens");
    assert_eq!(cached(&first), 0, "{first}");
    let at = sims
        .iter()
        .find(|s| s.state.metrics.received.get() == 2)
        .expect("both at the prefix's home");
    let gw = &gws[1];
    let held = gateway_metric(
        gw,
        r#"sluice_routing_prefill_holds_total{model="sim-model",prefill="shared",outcome="prefilled"}"#,
    )
    .await;
    assert_eq!(held, 1.0);
    assert!(cached(&second) + 32 >= prompt, "{second}");
    // Predicted as cached: no shortfall that would read as eviction.
    let series = |name: &str| format!("sluice_backend_{name}{{backend=\"{}\"}}", at.addr);
    let in_flight = series("in_flight");
    wait_until("the answer counted", Duration::from_secs(5), || {
        let in_flight = &in_flight;
        async move { gateway_metric(gw, in_flight).await == 0.0 }
    })
    .await;
    let predicted = gateway_metric(gw, &series("cached_tokens_predicted_total")).await;
    let actual = gateway_metric(gw, &series("cached_tokens_actual_total")).await;
    assert_eq!(actual, cached(&second) as f64);
    assert!(
        predicted > 0.5 * actual && predicted < 1.5 * actual,
        "{predicted} predicted, {actual} cached"
    );
}
