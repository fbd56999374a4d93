//! Reading each replica's own `/metrics`: KV-cache usage, waiting and running
//! requests, in whichever engine's names it speaks.
//!
//! Only the few families routing needs are parsed, line by line, without
//! building a metric model; values of one family are combined across label
//! sets (summed for queue counts, max for usage, as data-parallel engines
//! report one series per rank). Every sample carries the time it was taken:
//! routing treats an old sample as saturation, never as idleness.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, header};
use http_body_util::{BodyExt, Full, Limited};

use crate::vocab::EngineKind;

use super::client::HttpClient;
use super::pool::{Glance, Pool, Replica};
use super::signals::LoadSample;

#[derive(Default)]
struct Acc {
    kv: Option<f64>,
    kv_old: Option<f64>,
    waiting: Option<f64>,
    deferred: Option<f64>,
    capacity: Option<f64>,
    running: Option<f64>,
    block_size: Option<u32>,
    num_blocks: Option<u32>,
    hits: Option<f64>,
    queries: Option<f64>,
    hit_rate: Option<f64>,
    kv_used: Option<f64>,
    kv_max: Option<f64>,
    preemptions: Option<f64>,
    swapped: Option<f64>,
    cpu_kv: Option<f64>,
}

fn max(a: Option<f64>, v: f64) -> Option<f64> {
    Some(a.map_or(v, |a| a.max(v)))
}

fn sum(a: Option<f64>, v: f64) -> Option<f64> {
    Some(a.unwrap_or(0.0) + v)
}

/// The value of `label` in a `{a="x",b="y"}` label block.
/// The value of label `name` in a series' `{...}` label text.
pub(crate) fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let at = labels.find(&format!("{name}=\""))?;
    let rest = &labels[at + name.len() + 2..];
    rest.split('"').next()
}

/// Parse a Prometheus text exposition into a sample. `engine` fixes the
/// dialect; `Auto` detects it from the first known family.
pub(crate) fn parse(text: &str, engine: EngineKind, at: Instant) -> LoadSample {
    let mut detected = engine;
    let mut a = Acc::default();
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (series, value) = match line.rsplit_once('}') {
            Some((s, v)) => (s, v),
            None => match line.split_once(' ') {
                Some((s, v)) => (s, v),
                None => continue,
            },
        };
        let (name, labels) = series.split_once('{').unwrap_or((series, ""));
        let Some(v) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        if !v.is_finite() {
            continue;
        }
        let (prefix, family) = match name.split_once(':') {
            Some(x) => x,
            None if name.starts_with("nv_trt_llm_") => ("trtllm", name),
            None if name.starts_with("tgi_") => ("tgi", name),
            None => continue,
        };
        let kind = match prefix {
            "vllm" => EngineKind::Vllm,
            "sglang" => EngineKind::Sglang,
            "llamacpp" => EngineKind::Llamacpp,
            "trtllm" => EngineKind::Trtllm,
            "tgi" => EngineKind::Tgi,
            _ => continue,
        };
        if detected == EngineKind::Auto {
            detected = kind;
        }
        if kind != detected {
            continue;
        }
        // SGLang with priority scheduling writes each queue's total under
        // `priority=""` and its parts per priority beside it: the total only.
        if kind == EngineKind::Sglang && label(labels, "priority").is_some_and(|p| !p.is_empty()) {
            continue;
        }
        match (kind, family) {
            (EngineKind::Vllm, "kv_cache_usage_perc") => a.kv = max(a.kv, v),
            (EngineKind::Vllm, "gpu_cache_usage_perc") => a.kv_old = max(a.kv_old, v),
            (EngineKind::Vllm, "num_requests_waiting") => a.waiting = sum(a.waiting, v),
            // `capacity` (room) and `deferred` (KV pulls, grammars): the
            // total above holds both.
            (EngineKind::Vllm, "num_requests_waiting_by_reason") => match label(labels, "reason") {
                Some("deferred") => a.deferred = sum(a.deferred, v),
                Some("capacity") => a.capacity = sum(a.capacity, v),
                _ => {}
            },
            (EngineKind::Vllm, "num_requests_running") => a.running = sum(a.running, v),
            (EngineKind::Vllm, "num_preemptions_total") => {
                a.preemptions = sum(a.preemptions, v);
            }
            (EngineKind::Vllm, "num_requests_swapped") => a.swapped = sum(a.swapped, v),
            (EngineKind::Vllm, "cpu_cache_usage_perc") => a.cpu_kv = max(a.cpu_kv, v),
            (EngineKind::Vllm, "prefix_cache_hits_total" | "gpu_prefix_cache_hits_total") => {
                a.hits = max(a.hits, v)
            }
            (EngineKind::Vllm, "prefix_cache_queries_total" | "gpu_prefix_cache_queries_total") => {
                a.queries = max(a.queries, v)
            }
            (EngineKind::Vllm, "cache_config_info") => {
                a.block_size = label(labels, "block_size").and_then(|s| s.parse().ok());
                a.num_blocks = label(labels, "num_gpu_blocks").and_then(|s| s.parse().ok());
            }
            (EngineKind::Sglang, "token_usage") => a.kv = max(a.kv, v),
            // SGLang keeps disaggregation's and grammars' waits in queues of
            // their own (`metrics/collector.py`): a decode replica's prealloc
            // queue waits for KV room there, as the waiting queue waits for a
            // seat; its transfer queue waits for the prefill and the KV, a
            // prefill replica's bootstrap (`prealloc`) queue for its decode
            // side, the grammar queue for a grammar: the engine's `deferred`.
            // The total counts them all, as vLLM's `num_requests_waiting`.
            (EngineKind::Sglang, "num_queue_reqs" | "num_decode_prealloc_queue_reqs") => {
                a.waiting = sum(a.waiting, v);
                a.capacity = sum(a.capacity, v);
            }
            (
                EngineKind::Sglang,
                "num_decode_transfer_queue_reqs"
                | "num_prefill_prealloc_queue_reqs"
                | "num_prefill_bootstrap_queue_reqs"
                | "num_grammar_queue_reqs",
            ) => {
                a.waiting = sum(a.waiting, v);
                a.deferred = sum(a.deferred, v);
            }
            (EngineKind::Sglang, "num_running_reqs") => a.running = sum(a.running, v),
            (EngineKind::Sglang, "cache_hit_rate") => a.hit_rate = max(a.hit_rate, v),
            // SGLang's preemptions: requests retracted from a batch out of KV
            // room (recomputed later), counted since it started.
            (EngineKind::Sglang, "num_retracted_requests_total") => {
                a.preemptions = sum(a.preemptions, v);
            }
            (EngineKind::Llamacpp, "kv_cache_usage_ratio") => a.kv = max(a.kv, v),
            (EngineKind::Llamacpp, "requests_deferred") => a.waiting = sum(a.waiting, v),
            (EngineKind::Llamacpp, "requests_processing") => a.running = sum(a.running, v),
            (EngineKind::Trtllm, "nv_trt_llm_kv_cache_block_metrics") => {
                match label(labels, "kv_cache_block_type") {
                    Some("fraction") => a.kv = max(a.kv, v),
                    Some("used") => a.kv_used = sum(a.kv_used, v),
                    Some("max") => a.kv_max = sum(a.kv_max, v),
                    _ => {}
                }
            }
            (EngineKind::Trtllm, "nv_trt_llm_request_metrics") => {
                match label(labels, "request_type") {
                    Some("waiting") => a.waiting = sum(a.waiting, v),
                    Some("active") => a.running = sum(a.running, v),
                    _ => {}
                }
            }
            (EngineKind::Tgi, "tgi_queue_size") => a.waiting = sum(a.waiting, v),
            (EngineKind::Tgi, "tgi_batch_current_size") => a.running = sum(a.running, v),
            _ => {}
        }
    }
    let kv = a.kv.or(a.kv_old).or(match (a.kv_used, a.kv_max) {
        (Some(u), Some(m)) if m > 0.0 => Some(u / m),
        _ => None,
    });
    let prefix_hit_rate = a.hit_rate.or(match (a.hits, a.queries) {
        (Some(h), Some(q)) if q > 0.0 => Some(h / q),
        _ => None,
    });
    LoadSample {
        engine: detected,
        kv_usage: kv.map(|k| k.clamp(0.0, 1.0)),
        waiting: a.waiting,
        deferred: a.deferred,
        waiting_for_room: a.capacity,
        running: a.running,
        block_size: a.block_size,
        num_blocks: a.num_blocks,
        prefix_hit_rate,
        preemptions: a.preemptions,
        swapped: a.swapped,
        cpu_kv_usage: a.cpu_kv,
        prefix_hits: a.hits,
        prefix_queries: a.queries,
        cached_predicted: None,
        cached_actual: None,
        attempts: None,
        prefix_elsewhere: None,
        gpu_util: None,
        gpu_memory: None,
        queued: false,
        preempting: false,
        at,
    }
}

/// GPU utilisation and memory from an NVIDIA dcgm-exporter page: the mean
/// of `DCGM_FI_DEV_GPU_UTIL` (percent) over the GPUs listed, and framebuffer
/// used over used + free summed over them. Either is `None` when absent.
pub(crate) fn parse_dcgm(text: &str) -> (Option<f64>, Option<f64>) {
    let (mut util, mut gpus) = (0.0, 0u32);
    let (mut used, mut free) = (None, None);
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Some(v) = value.trim().parse::<f64>().ok().filter(|v| v.is_finite()) else {
            continue;
        };
        let name = series.split_once('{').map_or(series, |(n, _)| n).trim();
        match name {
            "DCGM_FI_DEV_GPU_UTIL" => {
                util += v;
                gpus += 1;
            }
            "DCGM_FI_DEV_FB_USED" => used = sum(used, v),
            "DCGM_FI_DEV_FB_FREE" => free = sum(free, v),
            _ => {}
        }
    }
    let util = (gpus > 0).then(|| (util / f64::from(gpus) / 100.0).clamp(0.0, 1.0));
    let memory = match (used, free) {
        (Some(u), Some(f)) if u + f > 0.0 => Some((u / (u + f)).clamp(0.0, 1.0)),
        _ => None,
    };
    (util, memory)
}

/// Scrape every replica once, concurrently.
pub(crate) async fn scrape_all(
    pool: &Pool,
    client: &HttpClient,
    engine: EngineKind,
    timeout: Duration,
) {
    scrape_where(pool, client, engine, timeout, false, |_| true).await;
    // The doctor's per-tier rates come from these notes, one per round.
    pool.metrics().note_vitals(Instant::now());
}

/// Scrape the replicas `pick` selects once, concurrently (`again`: a second
/// look, `Replica::set_load_again`).
async fn scrape_where(
    pool: &Pool,
    client: &HttpClient,
    engine: EngineKind,
    timeout: Duration,
    again: bool,
    pick: impl Fn(&Replica) -> bool,
) {
    let mut tasks = tokio::task::JoinSet::new();
    for r in pool.replicas().iter().filter(|r| pick(r)) {
        let (r, client) = (r.clone(), client.clone());
        tasks.spawn(async move {
            let gpu = async {
                let url = r.dcgm.as_deref()?;
                // Not the replica's key: the exporter is another service.
                match tokio::time::timeout(timeout, fetch(&client, url, None)).await {
                    Ok(Ok(text)) => Some(parse_dcgm(&text)),
                    Ok(Err(e)) => {
                        tracing::debug!(backend = %r.name, error = %e, "DCGM scrape failed");
                        None
                    }
                    Err(_) => {
                        tracing::debug!(backend = %r.name, "DCGM scrape timed out");
                        None
                    }
                }
            };
            let url = format!("{}/metrics", r.base);
            let engine_page =
                tokio::time::timeout(timeout, fetch(&client, &url, r.api_key.as_ref()));
            let (page, gpu) = tokio::join!(engine_page, gpu);
            match page {
                Ok(Ok(text)) => {
                    let mut s = parse(&text, engine, Instant::now());
                    (s.gpu_util, s.gpu_memory) = gpu.unwrap_or_default();
                    if again {
                        r.set_load_again(s);
                    } else {
                        r.set_load(s);
                    }
                }
                Ok(Err(e)) => {
                    tracing::debug!(backend = %r.name, error = %e, "metrics scrape failed")
                }
                Err(_) => tracing::debug!(backend = %r.name, "metrics scrape timed out"),
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// When to look again at a queue first seen on a replica whose seats are
/// unknown (with scrape intervals of more than twice that).
const CONFIRM_AFTER: Duration = Duration::from_millis(250);

/// Scrape forever at `interval` (the caller aborts the task).
///
/// A replica whose seats are unknown and whose engine shows a queue for the
/// first time is scraped again after [`CONFIRM_AFTER`], not a whole interval
/// later: a queue that outlives that second look is what teaches its seats
/// and closes the gate (`Replica::set_load`), and until then every request
/// the gateway lets through joins the engine's queue, ahead of whatever
/// comes next. (On the flow benchmark's flood with seats learned, premium's
/// requests of the first 5 s waited 24-49% less on average in three seeds
/// with this second look: docs/BENCHMARKS.md.) A quarter second is still 10-30 decode steps
/// of a GPU engine; the replicas with configured seats, decode replicas
/// (`Replica::queue_unconfirmed`), and the doctor's per-round notes keep the
/// interval.
pub(crate) async fn run(
    pool: Arc<Pool>,
    client: HttpClient,
    engine: EngineKind,
    interval: Duration,
) {
    let timeout = interval.max(Duration::from_millis(200));
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let round = Instant::now();
        scrape_all(&pool, &client, engine, timeout).await;
        // Only where this round's scrape answered: a replica whose metrics
        // hang keeps an older sample, and would hold up every round.
        let again = |r: &Replica| r.queue_unconfirmed() && r.load().is_some_and(|s| s.at >= round);
        if interval > 2 * CONFIRM_AFTER && pool.replicas().iter().any(|r| again(r)) {
            tokio::time::sleep(CONFIRM_AFTER).await;
            scrape_where(&pool, &client, engine, timeout, true, again).await;
        }
    }
}

/// How long a look's answer serves other lookers: what an engine starts
/// in it is a fraction of a stream (on a GPU, a few decode steps; at two new
/// streams a second, one look in 50 misses one).
pub(crate) const GLANCE_REUSE: Duration = Duration::from_millis(20);

/// How long a look may take: an engine whose metrics answer slower gives
/// no look (its deciders then take the cautious side). Shorter than a
/// scrape's (at least 200 ms): a look holds up the request deciding.
pub(crate) const GLANCE_TIMEOUT: Duration = Duration::from_millis(100);

/// How long a failed look stands for the next ones: a second, so that an
/// engine whose metrics hang holds up one decision a second, not each.
pub(crate) const GLANCE_FAILED_REUSE: Duration = Duration::from_secs(1);

/// A look at `r`'s engine now, outside the scrape rounds: what it runs and
/// queues, for a decision the last scrape (up to an interval old) would get
/// wrong: the disaggregated plan's local prefills under streams, which
/// other gateways may have started since (`api::disagg`). Not kept as a
/// scrape: seat learning and the doctor read the rounds' spacing. A look
/// within [`GLANCE_REUSE`] of the last is that one (concurrent lookers wait
/// for one fetch). `None` when the engine's page did not answer within
/// [`GLANCE_TIMEOUT`] or shows no running count (and for
/// [`GLANCE_FAILED_REUSE`] after).
pub(crate) async fn glance(r: &Replica, client: &HttpClient, engine: EngineKind) -> Option<Glance> {
    let mut last = r.glance.lock().await;
    if let Some((at, g)) = *last
        && at.elapsed() <= g.map_or(GLANCE_FAILED_REUSE, |_| GLANCE_REUSE)
    {
        return g;
    }
    let in_flight = r.in_flight_at_engine();
    let url = format!("{}/metrics", r.base);
    let page = tokio::time::timeout(GLANCE_TIMEOUT, fetch(client, &url, r.api_key.as_ref()));
    let g = match page.await {
        Ok(Ok(text)) => {
            let s = parse(&text, engine, Instant::now());
            s.running.map(|running| Glance {
                running,
                waiting: s.waiting.unwrap_or(0.0),
                in_flight,
            })
        }
        Ok(Err(e)) => {
            tracing::debug!(backend = %r.name, error = %e, "metrics look failed");
            None
        }
        Err(_) => {
            tracing::debug!(backend = %r.name, "metrics look timed out");
            None
        }
    };
    // (A failed look also serves its waiters: they would each wait as long.)
    *last = Some((Instant::now(), g));
    g
}

/// GET `url` (the replica's `/metrics` with its key, or its DCGM exporter).
async fn fetch(
    client: &HttpClient,
    url: &str,
    key: Option<&http::HeaderValue>,
) -> Result<String, String> {
    let mut req = Request::builder()
        .method(Method::GET)
        .uri(url)
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    if let Some(key) = key {
        req.headers_mut().insert(header::AUTHORIZATION, key.clone());
    }
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("{url} answered {}", resp.status()));
    }
    let body = Limited::new(resp.into_body(), 8 << 20)
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    String::from_utf8(body.to_vec()).map_err(|_| "metrics are not UTF-8".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_each_dialect() {
        let now = Instant::now();
        let vllm = "# HELP x\nvllm:kv_cache_usage_perc{model_name=\"m\",engine=\"0\"} 0.5\n\
            vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"1\"} 0.75\n\
            vllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 2\n\
            vllm:num_requests_waiting{model_name=\"m\",engine=\"1\"} 3\n\
            vllm:num_requests_running{model_name=\"m\"} 7\n\
            vllm:prefix_cache_queries_total{model_name=\"m\"} 100\n\
            vllm:prefix_cache_hits_total{model_name=\"m\"} 40\n\
            vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"2048\"} 1\n";
        let s = parse(vllm, EngineKind::Auto, now);
        assert_eq!(s.engine, EngineKind::Vllm);
        assert_eq!(s.kv_usage, Some(0.75));
        assert_eq!(s.waiting, Some(5.0));
        assert_eq!(s.running, Some(7.0));
        assert_eq!((s.block_size, s.num_blocks), (Some(16), Some(2048)));
        assert_eq!(s.prefix_hit_rate, Some(0.4));

        let old = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.3\n\
            vllm:num_preemptions_total{model_name=\"m\"} 12\n\
            vllm:num_requests_swapped{model_name=\"m\"} 2\n\
            vllm:cpu_cache_usage_perc{model_name=\"m\"} 0.1\n";
        let s = parse(old, EngineKind::Auto, now);
        assert_eq!(s.kv_usage, Some(0.3));
        assert_eq!(
            (s.preemptions, s.swapped, s.cpu_kv_usage),
            (Some(12.0), Some(2.0), Some(0.1))
        );

        let sg = "sglang:token_usage{model_name=\"m\"} 0.9\nsglang:num_queue_reqs{model_name=\"m\"} 4\nsglang:num_running_reqs{model_name=\"m\"} 12\n";
        let s = parse(sg, EngineKind::Auto, now);
        assert_eq!(
            (s.engine, s.kv_usage, s.waiting, s.running),
            (EngineKind::Sglang, Some(0.9), Some(4.0), Some(12.0))
        );

        let lc = "llamacpp:kv_cache_usage_ratio 0.2\nllamacpp:requests_deferred 1\nllamacpp:requests_processing 2\n";
        let s = parse(lc, EngineKind::Auto, now);
        assert_eq!(
            (s.engine, s.kv_usage, s.waiting),
            (EngineKind::Llamacpp, Some(0.2), Some(1.0))
        );

        let trt = "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"used\",model=\"m\"} 30\n\
            nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"max\",model=\"m\"} 120\n\
            nv_trt_llm_request_metrics{request_type=\"active\",model=\"m\"} 5\n";
        let s = parse(trt, EngineKind::Auto, now);
        assert_eq!(
            (s.engine, s.kv_usage, s.running),
            (EngineKind::Trtllm, Some(0.25), Some(5.0))
        );
    }

    #[test]
    fn vllm_requests_deferred_are_read_apart_from_its_queue() {
        let page = "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 5\n\
            vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 2\n\
            vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"m\",reason=\"capacity\"} 1\n\
            vllm:num_requests_waiting_by_reason{engine=\"0\",model_name=\"m\",reason=\"deferred\"} 4\n\
            vllm:num_requests_waiting_by_reason{engine=\"1\",model_name=\"m\",reason=\"capacity\"} 0\n\
            vllm:num_requests_waiting_by_reason{engine=\"1\",model_name=\"m\",reason=\"deferred\"} 2\n";
        let s = parse(page, EngineKind::Auto, Instant::now());
        assert_eq!(
            (s.waiting, s.deferred, s.queue()),
            (Some(7.0), Some(6.0), Some(1.0))
        );
        // The queue is what the engine counts waiting for room.
        let room_only = "vllm:num_requests_waiting 9\n\
            vllm:num_requests_waiting_by_reason{reason=\"capacity\"} 2\n";
        assert_eq!(
            parse(room_only, EngineKind::Auto, Instant::now()).queue(),
            Some(2.0)
        );
        // An engine that does not tell them apart: every waiting request.
        let s = parse(
            "vllm:num_requests_waiting 3\n",
            EngineKind::Auto,
            Instant::now(),
        );
        assert_eq!(
            (s.waiting, s.deferred, s.queue()),
            (Some(3.0), None, Some(3.0))
        );
    }

    #[test]
    fn sglang_disaggregation_queues_are_read_as_its_queue_or_deferred() {
        // A decode replica: 2 waiting for a seat, 3 for KV room, 4 for their
        // prefill and transfer; 1 waiting for a grammar.
        let decode = "sglang:num_queue_reqs{model_name=\"m\"} 2\n\
            sglang:num_grammar_queue_reqs{model_name=\"m\"} 1\n\
            sglang:num_prefill_prealloc_queue_reqs{model_name=\"m\"} 0\n\
            sglang:num_decode_prealloc_queue_reqs{model_name=\"m\"} 3\n\
            sglang:num_decode_transfer_queue_reqs{model_name=\"m\"} 4\n";
        let s = parse(decode, EngineKind::Auto, Instant::now());
        assert_eq!(
            (s.engine, s.waiting, s.deferred, s.queue()),
            (EngineKind::Sglang, Some(10.0), Some(5.0), Some(5.0))
        );
        // A prefill replica whose requests wait for their decode side
        // (under either name of its bootstrap queue): no queue of its own.
        for name in [
            "num_prefill_prealloc_queue_reqs",
            "num_prefill_bootstrap_queue_reqs",
        ] {
            let prefill =
                format!("sglang:num_queue_reqs 0\nsglang:{name} 6\nsglang:num_running_reqs 8\n");
            let s = parse(&prefill, EngineKind::Auto, Instant::now());
            assert_eq!(
                (s.waiting, s.deferred, s.queue()),
                (Some(6.0), Some(6.0), Some(0.0)),
                "{name}"
            );
        }
        // With priority scheduling, each queue's total and its parts: the
        // total only.
        let by_priority = "sglang:num_queue_reqs{model_name=\"m\",priority=\"\"} 5\n\
            sglang:num_queue_reqs{model_name=\"m\",priority=\"0\"} 3\n\
            sglang:num_queue_reqs{model_name=\"m\",priority=\"1\"} 2\n\
            sglang:num_running_reqs{model_name=\"m\",priority=\"\"} 8\n\
            sglang:num_running_reqs{model_name=\"m\",priority=\"0\"} 8\n";
        let s = parse(by_priority, EngineKind::Auto, Instant::now());
        assert_eq!((s.waiting, s.running), (Some(5.0), Some(8.0)));
        // Its retractions (out of KV room) are its preemptions.
        let retracting = "sglang:num_retracted_requests_total{model_name=\"m\"} 7\n";
        assert_eq!(
            parse(retracting, EngineKind::Auto, Instant::now()).preemptions,
            Some(7.0)
        );
        // An SGLang that exports none of them: its waiting queue.
        let s = parse(
            "sglang:num_queue_reqs 4\n",
            EngineKind::Auto,
            Instant::now(),
        );
        assert_eq!(
            (s.waiting, s.deferred, s.queue()),
            (Some(4.0), None, Some(4.0))
        );
    }

    #[test]
    fn reads_tgi_queue_and_batch() {
        let tgi = "# TYPE tgi_queue_size gauge\ntgi_queue_size 6\ntgi_batch_current_size 24\n\
            tgi_batch_current_max_tokens 9000\ntgi_request_count 120\n";
        let s = parse(tgi, EngineKind::Auto, Instant::now());
        assert_eq!(
            (s.engine, s.waiting, s.running, s.kv_usage),
            (EngineKind::Tgi, Some(6.0), Some(24.0), None)
        );
    }

    #[test]
    fn reads_gpu_utilisation_and_memory_from_dcgm() {
        let page = "# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n\
            # TYPE DCGM_FI_DEV_GPU_UTIL gauge\n\
            DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-a\",device=\"nvidia0\",modelName=\"NVIDIA H100 80GB HBM3\",Hostname=\"n1\"} 30\n\
            DCGM_FI_DEV_GPU_UTIL{gpu=\"1\",UUID=\"GPU-b\",device=\"nvidia1\",modelName=\"NVIDIA H100 80GB HBM3\",Hostname=\"n1\"} 50\n\
            DCGM_FI_DEV_FB_USED{gpu=\"0\"} 60000\nDCGM_FI_DEV_FB_FREE{gpu=\"0\"} 20000\n\
            DCGM_FI_DEV_FB_USED{gpu=\"1\"} 20000\nDCGM_FI_DEV_FB_FREE{gpu=\"1\"} 60000\n\
            DCGM_FI_DEV_SM_CLOCK{gpu=\"0\"} 1980\n";
        let (util, memory) = parse_dcgm(page);
        assert_eq!(util, Some(0.4));
        assert_eq!(memory, Some(0.5));
        assert_eq!(parse_dcgm("vllm:num_requests_running 3\n"), (None, None));
    }

    #[test]
    fn unknown_text_gives_an_empty_sample() {
        let s = parse("garbage\nfoo 1\n", EngineKind::Auto, Instant::now());
        assert_eq!((s.kv_usage, s.waiting), (None, None));
    }
}

#[cfg(test)]
mod prop;
