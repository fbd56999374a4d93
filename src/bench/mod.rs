//! `sluice bench`: client-side measurement of any OpenAI-compatible endpoint.
//!
//! Arrivals: closed loop (`concurrency` requests in flight, a new one as soon
//! as one ends), open loop (Poisson arrivals at `rate` per second, at most
//! `concurrency` in flight), or bursts. Until `requests` are sent or `duration`
//! has passed. Per request it measures TTFT (send to the first event carrying
//! output), every gap between output events, and E2E, with the same SSE reader
//! the gateway uses; token counts come from the endpoint's usage.

pub(crate) mod agentic;
pub(crate) mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use http::{Method, Request, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;

use crate::stream::event::{Event, classify, payload_of};
use crate::stream::protocols::ProtoReader;
use crate::stream::sse::SseSplitter;

#[derive(Debug, Clone)]
pub(crate) struct BenchConfig {
    /// Base URL, e.g. `http://127.0.0.1:8080` (`/v1/...` is appended).
    pub url: String,
    /// Model to request; `None` asks `/v1/models` and takes the first.
    pub model: Option<String>,
    /// Most requests in flight at once (the closed loop's population).
    pub concurrency: usize,
    pub requests: Option<u64>,
    pub duration: Option<Duration>,
    pub arrival: Arrival,
    pub shape: workload::Shape,
    /// The agentic workload's knobs (with `Workload::Agentic`).
    pub agentic: Option<agentic::AgenticShape>,
    pub seed: u64,
    pub api_key: Option<String>,
    /// CAs for an `https://` URL (default: the system's store).
    pub ca_file: Option<std::path::PathBuf>,
    pub json: Option<PathBuf>,
    /// Print progress to stderr every second.
    pub progress: bool,
    /// Which API the requests use.
    pub api: Api,
    /// Streamed requests (else whole answers).
    pub stream: bool,
    /// Write every request's timing, one JSON line each (`--requests-json`).
    pub requests_out: Option<PathBuf>,
}

/// The API a load's requests use (`--api`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `/v1/chat/completions`.
    #[default]
    Chat,
    /// Anthropic `/v1/messages`.
    Messages,
    /// OpenAI `/v1/responses`.
    Responses,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Messages => "/v1/messages",
            Api::Responses => "/v1/responses",
        }
    }

    /// A streamed request for `messages` (chat-style, system first) in this API.
    pub(crate) fn body(
        self,
        model: &str,
        messages: serde_json::Value,
        max_tokens: u32,
    ) -> serde_json::Value {
        let msgs = messages.as_array().cloned().unwrap_or_default();
        let (system, rest): (Vec<_>, Vec<_>) = msgs
            .into_iter()
            .partition(|m| m["role"] == "system" || m["role"] == "developer");
        let system: String = system
            .iter()
            .filter_map(|m| m["content"].as_str())
            .collect::<Vec<_>>()
            .join("\n");
        match self {
            Api::Chat => serde_json::json!({
                "model": model,
                "messages": messages,
                "max_tokens": max_tokens,
                "stream": true,
                "stream_options": {"include_usage": true},
            }),
            Api::Messages => {
                let mut b = serde_json::json!({
                    "model": model, "messages": rest, "max_tokens": max_tokens, "stream": true,
                });
                if !system.is_empty() {
                    b["system"] = system.into();
                }
                b
            }
            Api::Responses => {
                let mut b = serde_json::json!({
                    "model": model, "input": rest, "max_output_tokens": max_tokens, "stream": true,
                });
                if !system.is_empty() {
                    b["instructions"] = system.into();
                }
                b
            }
        }
    }
}

/// When requests are sent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Arrival {
    /// A new request as soon as one of `concurrency` ends.
    Closed,
    /// Poisson arrivals at this many requests per second.
    Poisson(f64),
    /// `size` requests at once every `interval`.
    Burst { size: u32, interval: Duration },
}

/// One request as the client saw it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sample {
    error: Option<String>,
    ttft: Option<Duration>,
    e2e: Duration,
    gaps: Vec<Duration>,
    completion_tokens: u64,
    prompt_tokens: u64,
    /// The engine's cached prompt tokens, when it reports them.
    cached_tokens: Option<u64>,
    /// The answer's text (when asked to collect it).
    content: Option<String>,
    /// Which replica answered, from `system_fingerprint` (when collecting).
    replica: Option<String>,
    /// The request's number and when it was sent, from the run's start
    /// (for `--requests-json`).
    index: u64,
    sent: Duration,
    /// The shared prefix its prompt opened with (`shared-prefix`).
    prefix: Option<usize>,
    /// The agentic turn it was (`--workload agentic`).
    turn: Option<agentic::TurnOf>,
}

#[derive(Debug, Clone, Serialize, Default)]
pub(crate) struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
    pub count: usize,
}

impl Percentiles {
    /// Nearest-rank percentiles of durations, in seconds.
    pub(crate) fn of(mut v: Vec<f64>) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Self {
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            max: v[v.len() - 1],
            mean: v.iter().sum::<f64>() / v.len() as f64,
            count: v.len(),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    pub url: String,
    pub api: Api,
    pub model: String,
    pub workload: String,
    pub arrival: String,
    pub concurrency: usize,
    pub requests: u64,
    pub ok: u64,
    pub errors: std::collections::BTreeMap<String, u64>,
    pub duration_seconds: f64,
    pub requests_per_second: f64,
    pub output_tokens: u64,
    pub prompt_tokens: u64,
    pub output_tokens_per_second: f64,
    pub ttft_seconds: Percentiles,
    pub inter_token_seconds: Percentiles,
    pub e2e_seconds: Percentiles,
    /// The agentic workload: what routing did for the sessions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sessions: Option<agentic::SessionStats>,
}

pub(crate) type BenchClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

pub(crate) async fn run(cfg: BenchConfig) -> anyhow::Result<Report> {
    anyhow::ensure!(cfg.concurrency > 0, "--concurrency must be at least 1");
    let agentic = cfg.shape.workload == workload::Workload::Agentic;
    anyhow::ensure!(
        agentic || cfg.requests.is_some() || cfg.duration.is_some(),
        "give --requests or --duration"
    );
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    conn.enforce_http(false);
    // `https://`: trusting `--ca-file` (or the system's store).
    let (tls, _) = crate::net::tls::client(&crate::config::UpstreamTlsConfig {
        ca_file: cfg.ca_file.clone(),
        ..Default::default()
    })?;
    let mut tls = (*tls).clone();
    tls.alpn_protocols.clear();
    let conn = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(conn);
    let client: BenchClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(cfg.concurrency)
        .build(conn);
    let base = cfg.url.trim_end_matches('/').to_string();
    let model = match &cfg.model {
        Some(m) => m.clone(),
        None => first_model(&client, &base, cfg.api_key.as_deref()).await?,
    };
    let started = Instant::now();
    let until = cfg.duration.map(|d| started + d);
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let progress = cfg.progress.then(|| {
        let (done, failed, total) = (done.clone(), failed.clone(), cfg.requests);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            loop {
                tick.tick().await;
                let d = done.load(Relaxed);
                let secs = started.elapsed().as_secs_f64();
                let of = total.map(|t| format!("/{t}")).unwrap_or_default();
                eprintln!(
                    "  {d}{of} requests, {:.1} req/s, {} errors, {secs:.0}s",
                    d as f64 / secs,
                    failed.load(Relaxed)
                );
            }
        })
    });
    if let Some(shape) = cfg
        .agentic
        .as_ref()
        .filter(|_| cfg.shape.workload == workload::Workload::Agentic)
    {
        let (mut samples, stats) =
            agentic::run(&cfg, shape, &client, &base, &model, started, done.clone()).await;
        if let Some(p) = progress {
            p.abort();
        }
        let elapsed = started.elapsed().as_secs_f64();
        if let Some(path) = &cfg.requests_out {
            write_requests(path, &mut samples)?;
        }
        let mut report = summarise(&cfg, &model, samples, elapsed);
        report.sessions = Some(stats);
        return write_json(&cfg, report);
    }
    let mut generator = workload::Generator::new(cfg.shape.clone(), cfg.seed);
    let mut rng = fastrand::Rng::with_seed(cfg.seed ^ 0x5eed);
    let slots = Arc::new(tokio::sync::Semaphore::new(cfg.concurrency));
    let mut tasks = tokio::task::JoinSet::new();
    let mut samples = Vec::new();
    let mut next_at = tokio::time::Instant::now();
    let mut n: u64 = 0;
    loop {
        if cfg.requests.is_some_and(|r| n >= r) || until.is_some_and(|u| Instant::now() >= u) {
            break;
        }
        match cfg.arrival {
            Arrival::Closed => {}
            Arrival::Poisson(rate) => {
                // Exponential inter-arrival times: a Poisson process.
                let gap = -(1.0 - rng.f64()).ln() / rate.max(1e-9);
                next_at += Duration::from_secs_f64(gap);
                tokio::time::sleep_until(next_at).await;
            }
            Arrival::Burst { size, interval } => {
                if n > 0 && n.is_multiple_of(u64::from(size.max(1))) {
                    next_at += interval;
                    tokio::time::sleep_until(next_at).await;
                }
            }
        }
        let Ok(permit) = slots.clone().acquire_owned().await else {
            break;
        };
        if until.is_some_and(|u| Instant::now() >= u) {
            break;
        }
        let (messages, max_tokens) = generator.next(n);
        let prefix = generator.last_prefix;
        let mut body = cfg.api.body(&model, messages, max_tokens);
        if !cfg.stream {
            body["stream"] = false.into();
            if let Some(b) = body.as_object_mut() {
                b.remove("stream_options");
            }
        }
        let (client, base, key) = (client.clone(), base.clone(), cfg.api_key.clone());
        let (done, failed, api) = (done.clone(), failed.clone(), cfg.api);
        let stream = cfg.stream;
        let each = cfg.requests_out.is_some();
        let index = n;
        tasks.spawn(async move {
            let body = body.to_string();
            // When the request goes out (the task may start late on a busy
            // machine): its TTFT and gaps are counted from about here.
            let sent = started.elapsed();
            // Kept per request: its number as `x-request-id`, so that the
            // gateway's access log joins the client's timing.
            let id = format!("bench-{index}");
            let headers: &[(&str, &str)] = if each { &[("x-request-id", &id)] } else { &[] };
            let mut s = if stream {
                // Per request, the replica's name too (its system_fingerprint).
                one_with(
                    &client,
                    &base,
                    key.as_deref(),
                    api,
                    body,
                    until,
                    headers,
                    each,
                )
                .await
            } else {
                whole(&client, &base, key.as_deref(), api, body, headers).await
            };
            s.content = None;
            (s.index, s.sent, s.prefix) = (index, sent, prefix);
            if s.error.is_some() {
                failed.fetch_add(1, Relaxed);
            }
            done.fetch_add(1, Relaxed);
            drop(permit);
            s
        });
        n += 1;
        while let Some(r) = tasks.try_join_next() {
            samples.extend(r.ok());
        }
    }
    while let Some(r) = tasks.join_next().await {
        samples.extend(r.ok());
    }
    if let Some(p) = progress {
        p.abort();
    }
    let elapsed = started.elapsed().as_secs_f64();
    if let Some(path) = &cfg.requests_out {
        write_requests(path, &mut samples)?;
    }
    let report = summarise(&cfg, &model, samples, elapsed);
    write_json(&cfg, report)
}

/// One JSON line per request, in the order they were sent: its
/// `x-request-id` (as the gateway's access log has it), when (seconds
/// from the start), its TTFT and end to end, the replica that answered
/// where it says (`system_fingerprint`), its cached and prompt tokens,
/// its longest gap between two tokens and when that gap ended (seconds
/// from the start: to find what its replica was doing then), and the
/// shared prefix its prompt opened with (or the agentic turn it was: its
/// session, its number in it, whether it answers a tool result).
fn write_requests(path: &std::path::Path, samples: &mut [Sample]) -> anyhow::Result<()> {
    samples.sort_by_key(|s| s.index);
    let mut out = String::new();
    for s in samples.iter() {
        let mut line = serde_json::json!({
            "i": s.index,
            "request_id": format!("bench-{}", s.index),
            "sent_s": s.sent.as_secs_f64(),
            "ttft_s": s.ttft.map(|d| d.as_secs_f64()),
            "e2e_s": s.e2e.as_secs_f64(),
            "replica": s.replica,
            "cached_tokens": s.cached_tokens,
            "prompt_tokens": s.prompt_tokens,
            "prefix": s.prefix,
            "error": s.error,
        });
        if let (Some(ttft), Some((at, gap))) = (s.ttft, longest_gap(&s.gaps)) {
            line["itl_max_s"] = gap.as_secs_f64().into();
            line["itl_max_end_s"] = (s.sent + ttft + at).as_secs_f64().into();
        }
        if let Some(t) = &s.turn {
            line["session"] = t.session.into();
            line["turn"] = t.turn.into();
            line["tool"] = t.tool.into();
        }
        out.push_str(&line.to_string());
        out.push('\n');
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

/// The longest of a stream's gaps between tokens, and when it ended after
/// the first token.
fn longest_gap(gaps: &[Duration]) -> Option<(Duration, Duration)> {
    let mut since = Duration::ZERO;
    let mut best: Option<(Duration, Duration)> = None;
    for &g in gaps {
        since += g;
        if best.is_none_or(|(_, b)| g > b) {
            best = Some((since, g));
        }
    }
    best
}

fn write_json(cfg: &BenchConfig, report: Report) -> anyhow::Result<Report> {
    if let Some(path) = &cfg.json {
        let text = serde_json::to_string_pretty(&report)?;
        if path.as_os_str() == "-" {
            crate::term::print_out(&text);
        } else {
            std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(report)
}

async fn first_model(
    client: &BenchClient,
    base: &str,
    key: Option<&str>,
) -> anyhow::Result<String> {
    let mut req = Request::get(format!("{base}/v1/models")).body(Full::new(Bytes::new()))?;
    if let Some(k) = key {
        req.headers_mut()
            .insert(header::AUTHORIZATION, format!("Bearer {k}").parse()?);
    }
    let resp = client.request(req).await.context("GET /v1/models")?;
    let body = resp.into_body().collect().await?.to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).context("/v1/models is not JSON")?;
    v.pointer("/data/0/id")
        .and_then(|m| m.as_str())
        .map(str::to_string)
        .context("/v1/models lists no model; pass --model")
}

/// POST `body` to `api`'s path with the key and extra `headers`: the
/// response if its status is a success, else the error's label.
async fn send(
    client: &BenchClient,
    base: &str,
    key: Option<&str>,
    api: Api,
    body: String,
    headers: &[(&str, &str)],
) -> Result<http::Response<hyper::body::Incoming>, String> {
    let mut req = Request::builder()
        .method(Method::POST)
        .uri(format!("{base}{}", api.path()))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    if let Some(k) = key
        && let Ok(v) = format!("Bearer {k}").parse()
    {
        req.headers_mut().insert(header::AUTHORIZATION, v);
    }
    for (name, value) in headers {
        if let (Ok(n), Ok(v)) = (
            http::HeaderName::from_bytes(name.as_bytes()),
            http::HeaderValue::from_str(value),
        ) {
            req.headers_mut().insert(n, v);
        }
    }
    let resp = client
        .request(req)
        .await
        .map_err(|_| "connect".to_string())?;
    if !resp.status().is_success() {
        return Err(format!("http_{}", resp.status().as_u16()));
    }
    Ok(resp)
}

/// One request for a whole answer: its time to the first token is the
/// whole request's; the usage is read from the answer.
async fn whole(
    client: &BenchClient,
    base: &str,
    key: Option<&str>,
    api: Api,
    body: String,
    headers: &[(&str, &str)],
) -> Sample {
    let start = Instant::now();
    let mut s = Sample::default();
    let result = async {
        let resp = send(client, base, key, api, body, headers).await?;
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|_| "body_broken".to_string())?
            .to_bytes();
        let (prompt, completion) = match api {
            // The chunk reader reads a whole chat answer too (same fields).
            Api::Chat => {
                let info = crate::stream::event::chunk_info(&body)
                    .ok_or_else(|| "malformed_body".to_string())?;
                let u = info.usage.unwrap_or_default();
                (u.prompt_tokens, u.completion_tokens)
            }
            Api::Messages | Api::Responses => {
                let v: serde_json::Value =
                    serde_json::from_slice(&body).map_err(|_| "malformed_body".to_string())?;
                let n = |k: &str| v["usage"][k].as_u64().unwrap_or(0) as u32;
                (n("input_tokens"), n("output_tokens"))
            }
        };
        s.prompt_tokens = u64::from(prompt);
        s.completion_tokens = u64::from(completion);
        s.ttft = Some(start.elapsed());
        Ok(())
    }
    .await;
    s.e2e = start.elapsed();
    s.error = result.err();
    s
}

/// One streamed request in `api` with extra `headers`; `collect` keeps the
/// answer's text and the replica that served it (chat only).
#[expect(
    clippy::too_many_arguments,
    reason = "two call sites; a struct would only rename them"
)]
pub(crate) async fn one_with(
    client: &BenchClient,
    base: &str,
    key: Option<&str>,
    api: Api,
    body: String,
    until: Option<Instant>,
    headers: &[(&str, &str)],
    collect: bool,
) -> Sample {
    let start = Instant::now();
    let mut s = Sample::default();
    let result = async {
        let resp = send(client, base, key, api, body, headers).await?;
        let mut body = resp.into_body();
        let mut splitter = SseSplitter::new(4 << 20);
        let mut last: Option<Instant> = None;
        let mut done = false;
        let mut named = match api {
            Api::Chat => None,
            Api::Messages => Some(ProtoReader::new(crate::vocab::Wire::Anthropic)),
            Api::Responses => Some(ProtoReader::new(crate::vocab::Wire::Responses)),
        };
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|_| "stream_broken".to_string())?;
            let now = Instant::now();
            let Ok(data) = frame.into_data() else {
                continue;
            };
            splitter.push(data);
            while let Some(ev) = splitter
                .next_event()
                .map_err(|_| "event_too_large".to_string())?
            {
                if let Some(reader) = named.as_mut() {
                    let Some(payload) = payload_of(&ev) else {
                        continue;
                    };
                    let e = reader
                        .read(&payload)
                        .map_err(|_| "malformed_event".to_string())?;
                    if e.is_error {
                        return Err("error_event".to_string());
                    }
                    if e.has_output {
                        match last {
                            None => s.ttft = Some(now - start),
                            Some(prev) => s.gaps.push(now - prev),
                        }
                        last = Some(now);
                    }
                    if let Some(u) = reader.usage() {
                        s.completion_tokens = u64::from(u.completion_tokens);
                        s.prompt_tokens = u64::from(u.prompt_tokens);
                        s.cached_tokens = u.cached_tokens.map(u64::from);
                    }
                    done |= e.terminal;
                    continue;
                }
                match classify(&ev) {
                    Event::Done => done = true,
                    Event::Chunk(c) if c.is_error => return Err("error_event".to_string()),
                    Event::Chunk(c) => {
                        if collect {
                            read_chunk(&ev, &mut s);
                        }
                        if c.has_output {
                            match last {
                                None => s.ttft = Some(now - start),
                                Some(prev) => s.gaps.push(now - prev),
                            }
                            last = Some(now);
                        }
                        if let Some(u) = c.usage {
                            s.completion_tokens = u64::from(u.completion_tokens);
                            s.prompt_tokens = u64::from(u.prompt_tokens);
                            s.cached_tokens = u.cached_tokens.map(u64::from);
                        }
                    }
                    Event::Other => {}
                    Event::Malformed(_) => return Err("malformed_event".to_string()),
                }
            }
            if until.is_some_and(|u| now > u + Duration::from_secs(60)) {
                return Err("overran".to_string());
            }
        }
        if !done {
            return Err("no_done".to_string());
        }
        Ok(())
    }
    .await;
    s.e2e = start.elapsed();
    s.error = result.err();
    s
}

/// The answer's text and the replica's name, from one chunk (the agentic
/// workload re-sends the text; not on the measuring fast path).
fn read_chunk(ev: &[u8], s: &mut Sample) {
    let payload = ev
        .strip_prefix(b"data: ")
        .or_else(|| ev.strip_prefix(b"data:"))
        .unwrap_or(ev);
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(payload.trim_ascii()) else {
        return;
    };
    if s.replica.is_none()
        && let Some(f) = v["system_fingerprint"].as_str()
    {
        s.replica = Some(f.to_string());
    }
    if let Some(t) = v
        .pointer("/choices/0/delta/content")
        .and_then(|t| t.as_str())
    {
        s.content.get_or_insert_with(String::new).push_str(t);
    }
}

fn summarise(cfg: &BenchConfig, model: &str, samples: Vec<Sample>, elapsed: f64) -> Report {
    let mut errors = std::collections::BTreeMap::new();
    let (mut ttft, mut gaps, mut e2e) = (Vec::new(), Vec::new(), Vec::new());
    let (mut out_tokens, mut in_tokens, mut ok) = (0, 0, 0);
    for s in &samples {
        if let Some(e) = &s.error {
            *errors.entry(e.clone()).or_insert(0) += 1;
            continue;
        }
        ok += 1;
        ttft.extend(s.ttft.map(|d| d.as_secs_f64()));
        gaps.extend(s.gaps.iter().map(Duration::as_secs_f64));
        e2e.push(s.e2e.as_secs_f64());
        out_tokens += s.completion_tokens;
        in_tokens += s.prompt_tokens;
    }
    let workload = format!("{:?}", cfg.shape.workload).to_lowercase();
    let arrival = match cfg.arrival {
        Arrival::Closed => "closed".to_string(),
        Arrival::Poisson(r) => format!("poisson {r}/s"),
        Arrival::Burst { size, interval } => {
            format!(
                "burst {size} every {}",
                humantime::format_duration(interval)
            )
        }
    };
    Report {
        url: cfg.url.clone(),
        api: cfg.api,
        model: model.to_string(),
        workload,
        arrival,
        concurrency: cfg.concurrency,
        requests: samples.len() as u64,
        ok,
        errors,
        duration_seconds: elapsed,
        requests_per_second: samples.len() as f64 / elapsed,
        output_tokens: out_tokens,
        prompt_tokens: in_tokens,
        output_tokens_per_second: out_tokens as f64 / elapsed,
        ttft_seconds: Percentiles::of(ttft),
        inter_token_seconds: Percentiles::of(gaps),
        e2e_seconds: Percentiles::of(e2e),
        sessions: None,
    }
}

impl Report {
    /// The human summary printed at the end.
    pub(crate) fn table(&self) -> String {
        let ms = |p: &Percentiles| {
            format!(
                "p50 {:>9.3}  p90 {:>9.3}  p99 {:>9.3}  max {:>9.3}  (ms, n={})",
                p.p50 * 1e3,
                p.p90 * 1e3,
                p.p99 * 1e3,
                p.max * 1e3,
                p.count
            )
        };
        let errors = if self.errors.is_empty() {
            "none".to_string()
        } else {
            self.errors
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let sessions = self.sessions.as_ref().map_or(String::new(), |s| {
            format!(
                "\nsessions {} ({} turns): stickiness {:.1}% (second turns {:.1}%), {:.2} replicas/session, \
                 prefix hit {:.1}% (ideal {:.1}%), busiest replica {:.2}x the mean",
                s.sessions,
                s.turns,
                s.stickiness * 100.0,
                s.second_turn_stickiness * 100.0,
                s.replicas_per_session,
                s.prefix_hit * 100.0,
                s.ideal_prefix_hit * 100.0,
                s.busiest_over_mean
            )
        });
        format!(
            "{} requests ({} ok) in {:.1}s: {:.1} req/s, {:.0} output tokens/s\n\
             TTFT  {}\nITL   {}\nE2E   {}\nerrors: {}{}",
            self.requests,
            self.ok,
            self.duration_seconds,
            self.requests_per_second,
            self.output_tokens_per_second,
            ms(&self.ttft_seconds),
            ms(&self.inter_token_seconds),
            ms(&self.e2e_seconds),
            errors,
            sessions
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streams_longest_gap_and_when_it_ended() {
        let ms = Duration::from_millis;
        assert_eq!(longest_gap(&[]), None);
        // The first of equal gaps; its end counted from the first token.
        assert_eq!(
            longest_gap(&[ms(10), ms(30), ms(20), ms(30)]),
            Some((ms(40), ms(30)))
        );
    }

    #[test]
    fn nearest_rank_percentiles() {
        let p = Percentiles::of((1..=100).map(f64::from).collect());
        assert_eq!((p.p50, p.p90, p.p99, p.max), (50.0, 90.0, 99.0, 100.0));
        assert_eq!(Percentiles::of(vec![]).count, 0);
    }
}
