//! The endpoint picker's decision latency under load (issue 35's target:
//! "the picker's decision p99 at most 1 ms with 220 KB prompts at 2,000
//! requests per second on one core").
//!
//! ```sh
//! cargo build --release          # the measured binary: target/release/sluice
//! cargo bench --bench epp -- --rate 2000 --seconds 20 --prompt-kb 220 --json out.json
//! ```
//!
//! Four `sluice sim` replicas (pinned to the client's core, idle: the
//! picker only needs them healthy and scraped) and `sluice serve` with
//! `epp.listen` on, pinned to ONE core (`taskset -c 0`). This process plays
//! Envoy from the other core: open-loop arrivals (Poisson by default), one
//! ext_proc stream per request over a few shared HTTP/2 connections, the
//! request's headers then its body in chunks (`FULL_DUPLEX_STREAMED`, as
//! Envoy streams it), until the headers' answer with the pick. The decision
//! latency is from the last body chunk (end_of_stream) handed to the
//! stream to that answer's arrival. Then the re-emitted body is drained and
//! a short JSON answer passes through the picker, which releases the
//! request at its end.
//!
//! Reported: offered and achieved rate, the client-side latency's
//! percentiles, the picker's own `sluice_epp_decision_seconds` histogram
//! (scraped before and after), errors, the picker's CPU seconds per request
//! (`/proc/PID/stat`), and in-flight counts left after the run and once the
//! client's connections are closed (a request still counted then is a leak).
//! The client's HTTP/2 windows are Envoy's defaults (256 MiB).
//!
//! `--floor` replaces the picker by the protocol's floor, served by this
//! program itself on the picker's core: a processor that reads nothing of
//! the request but takes its body in over gRPC and hands it back (names a
//! fixed destination, re-emits the body in the picker's chunks, passes the
//! response through), over tonic with the picker's HTTP/2 windows. What it
//! spends a request is what any picker of this protocol spends before it
//! reads a byte of the body (the picker's metrics are not scraped then).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context as _, Result, bail};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody,
    HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    StreamedBodyResponse,
    body_mutation::Mutation,
    external_processor_client::ExternalProcessorClient,
    external_processor_server::{ExternalProcessor, ExternalProcessorServer},
    processing_request::Request as Msg,
    processing_response::Response as Answer,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

const DEST: &str = "x-gateway-destination-endpoint";
const REPLICAS: usize = 4;
/// Envoy's default HTTP/2 stream and connection windows (256 MiB).
const ENVOY_WINDOW: u32 = 256 << 20;
/// Longest wait for the picker to release every request once the client's
/// connections are closed (a request still counted after it is a leak).
const RELEASE_WITHIN: Duration = Duration::from_secs(20);
/// Longest wait for any one answer of the picker.
const ANSWER_WITHIN: Duration = Duration::from_secs(30);

#[derive(Clone, Debug)]
struct Args {
    rate: f64,
    seconds: f64,
    prompt_kb: usize,
    chunk_kb: usize,
    prefixes: usize,
    channels: usize,
    poisson: bool,
    picker_cpu: u32,
    client_cpu: u32,
    json: Option<PathBuf>,
    /// Another build of the gateway than `target/release/sluice`.
    sluice: Option<PathBuf>,
    /// The protocol's floor in the picker's place (see the top).
    floor: bool,
    /// Serve the floor on this port (what `--floor` runs this program as).
    serve_floor: Option<u16>,
}

impl Args {
    /// `None`: only the usage was asked for.
    fn parse() -> Result<Option<Self>> {
        let mut a = Args {
            rate: 2000.0,
            seconds: 20.0,
            prompt_kb: 220,
            chunk_kb: 64,
            prefixes: 16,
            channels: 4,
            poisson: true,
            picker_cpu: 0,
            client_cpu: 1,
            json: None,
            sluice: None,
            floor: false,
            serve_floor: None,
        };
        let mut it = std::env::args().skip(1);
        while let Some(k) = it.next() {
            let mut v = || it.next().with_context(|| format!("{k} needs a value"));
            match k.as_str() {
                // What `cargo bench` passes to a harness-less bench.
                "--bench" => {}
                "--rate" => a.rate = v()?.parse()?,
                "--seconds" => a.seconds = v()?.parse()?,
                "--prompt-kb" => a.prompt_kb = v()?.parse()?,
                "--chunk-kb" => a.chunk_kb = v()?.parse()?,
                "--prefixes" => a.prefixes = v()?.parse()?,
                "--channels" => a.channels = v()?.parse()?,
                "--arrivals" => {
                    a.poisson = match v()?.as_str() {
                        "poisson" => true,
                        "fixed" => false,
                        other => bail!("--arrivals poisson|fixed, not {other}"),
                    }
                }
                "--picker-cpu" => a.picker_cpu = v()?.parse()?,
                "--client-cpu" => a.client_cpu = v()?.parse()?,
                "--json" => a.json = Some(v()?.into()),
                "--sluice" => a.sluice = Some(v()?.into()),
                "--floor" => a.floor = true,
                "--serve-floor" => a.serve_floor = Some(v()?.parse()?),
                "-h" | "--help" => {
                    println!(
                        "cargo bench --bench epp -- [--rate 2000] [--seconds 20] [--prompt-kb 220] \
                         [--chunk-kb 64] [--prefixes 16] [--channels 4] [--arrivals poisson|fixed] \
                         [--picker-cpu 0] [--client-cpu 1] [--json PATH] [--sluice BIN] [--floor]"
                    );
                    return Ok(None);
                }
                other => bail!("unknown argument {other} (--help)"),
            }
        }
        if a.rate <= 0.0 || a.seconds <= 0.0 || a.chunk_kb == 0 || a.channels == 0 {
            bail!("--rate, --seconds, --chunk-kb and --channels must be positive");
        }
        a.prefixes = a.prefixes.max(1);
        Ok(Some(a))
    }
}

/// Children killed (by their own PID) when dropped.
#[derive(Default)]
struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
        }
        for c in &mut self.0 {
            let _ = c.wait();
        }
    }
}

fn free_port() -> Result<u16> {
    Ok(StdListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn run_text(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// utime + stime of a process, in seconds.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = stat.rsplit_once(')').context("/proc stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the command: state is field 3, utime 14 and stime 15.
    let utime: f64 = f.get(11).context("utime")?.parse()?;
    let stime: f64 = f.get(12).context("stime")?.parse()?;
    let hz: f64 = run_text("getconf", &["CLK_TCK"]).parse().unwrap_or(100.0);
    Ok((utime + stime) / hz)
}

// ---------------------------------------------------------------- prompts

const WORDS: &[&str] = &[
    "the",
    "request",
    "model",
    "replica",
    "cache",
    "prefix",
    "token",
    "latency",
    "gateway",
    "cluster",
    "service",
    "deployment",
    "kubernetes",
    "pod",
    "node",
    "memory",
    "budget",
    "policy",
    "customer",
    "invoice",
    "contract",
    "shipment",
    "warehouse",
    "order",
    "refund",
    "account",
    "balance",
    "report",
    "quarter",
    "revenue",
    "forecast",
    "team",
    "engineer",
    "review",
    "design",
    "document",
    "section",
    "clause",
    "paragraph",
    "summary",
    "question",
    "answer",
    "example",
    "function",
    "variable",
    "error",
    "exception",
    "database",
    "index",
    "query",
    "table",
    "row",
    "column",
    "schema",
    "migration",
    "release",
    "version",
    "feature",
    "test",
    "coverage",
    "always",
    "never",
    "should",
    "must",
    "may",
    "carefully",
    "quickly",
    "politely",
    "exactly",
    "and",
    "or",
    "but",
    "because",
    "when",
    "while",
    "after",
    "before",
    "unless",
    "with",
    "without",
    "for",
    "from",
    "into",
    "over",
    "under",
    "about",
    "between",
    "a",
    "an",
    "this",
    "that",
    "each",
    "every",
    "some",
    "any",
    "no",
    "all",
    "is",
    "are",
    "was",
    "were",
    "be",
    "has",
    "have",
    "had",
    "explain",
    "describe",
    "list",
    "compare",
    "check",
    "verify",
    "return",
    "include",
    "avoid",
    "use",
    "cite",
    "quote",
    "format",
    "translate",
    "user",
    "assistant",
    "reader",
    "manager",
    "policy",
    "security",
    "privacy",
    "data",
    "record",
    "field",
    "value",
    "date",
    "time",
    "price",
    "discount",
    "tax",
    "region",
    "country",
    "language",
    "tone",
    "style",
    "length",
    "limit",
];

/// `len` bytes of sentence-like text from `seed`.
fn text(seed: u64, len: usize) -> String {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut s = String::with_capacity(len + 64);
    let mut in_sentence = 0;
    while s.len() < len {
        let w = WORDS[rng.usize(..WORDS.len())];
        if in_sentence == 0 {
            let mut c = w.chars();
            if let Some(f) = c.next() {
                s.extend(f.to_uppercase());
                s.push_str(c.as_str());
            }
        } else {
            s.push_str(w);
        }
        in_sentence += 1;
        if in_sentence > 6 && rng.u8(..8) == 0 {
            s.push_str(if rng.u8(..5) == 0 { ".\n\n" } else { ". " });
            in_sentence = 0;
        } else if rng.u8(..12) == 0 {
            s.push_str(", ");
        } else {
            s.push(' ');
        }
    }
    s.truncate(len);
    s
}

/// The requests' bodies: a JSON head and tail around one of the shared
/// system prompts (pre-serialised), then the unique question.
struct Prompts {
    /// `{"model":...,"messages":[{"role":"system","content":"<prefix>"}`
    heads: Vec<Vec<u8>>,
}

impl Prompts {
    fn new(prefixes: usize, kb: usize) -> Result<Self> {
        // The question and the JSON around it: ~1 KB of the whole.
        let system_len = (kb * 1000).saturating_sub(1000).max(100);
        let heads = (0..prefixes)
            .map(|i| {
                let intro = format!(
                    "You are assistant number {i} of the support desk. Follow the handbook below.\n\n"
                );
                let content = intro + &text(1000 + i as u64, system_len);
                let mut head = br#"{"model":"sim-model","max_tokens":64,"stream":false,"messages":[{"role":"system","content":"#.to_vec();
                serde_json::to_writer(&mut head, &content)?;
                head.push(b'}');
                Ok(head)
            })
            .collect::<Result<_>>()?;
        Ok(Self { heads })
    }

    fn body(&self, n: u64, rng: &mut fastrand::Rng) -> Result<Vec<u8>> {
        let head = &self.heads[rng.usize(..self.heads.len())];
        let question = format!(
            "Question {n}: {} What should I do next?",
            text(n.wrapping_mul(7919), 600 + rng.usize(..200))
        );
        let mut b = Vec::with_capacity(head.len() + question.len() + 64);
        b.extend_from_slice(head);
        b.extend_from_slice(br#",{"role":"user","content":"#);
        serde_json::to_writer(&mut b, &question)?;
        b.extend_from_slice(b"}]}");
        Ok(b)
    }
}

// ---------------------------------------------------------------- one request

#[derive(Debug)]
enum Outcome {
    Picked {
        /// The last body chunk handed to the stream -> the headers' answer.
        decision: Duration,
        /// Headers sent -> the response's end passed back.
        total: Duration,
    },
    Immediate(u32),
    Failed(String),
}

fn header(k: &str, v: &str) -> HeaderValue {
    HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..HeaderValue::default()
    }
}

fn msg(m: Msg, first: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(m),
        protocol_config: first.then(|| ProtocolConfiguration {
            request_body_mode: BodySendMode::FullDuplexStreamed as i32,
            response_body_mode: BodySendMode::FullDuplexStreamed as i32,
            ..ProtocolConfiguration::default()
        }),
        ..ProcessingRequest::default()
    }
}

async fn next(rx: &mut tonic::Streaming<ProcessingResponse>) -> Result<Answer> {
    let m = tokio::time::timeout(ANSWER_WITHIN, rx.message())
        .await
        .context("no answer within 30 s")??
        .context("the picker closed the stream")?;
    m.response.context("an empty answer")
}

/// A streamed body answer's chunk; true at its end.
fn streamed_end(a: &Answer) -> Result<bool> {
    let common = match a {
        Answer::RequestBody(b) | Answer::ResponseBody(b) => b.response.as_ref(),
        other => bail!("a body answer expected: {other:?}"),
    };
    match common
        .and_then(|c| c.body_mutation.as_ref())
        .and_then(|m| m.mutation.as_ref())
    {
        Some(Mutation::StreamedResponse(s)) => Ok(s.end_of_stream),
        other => bail!("a streamed body expected: {other:?}"),
    }
}

async fn one(
    mut client: ExternalProcessorClient<Channel>,
    body: Vec<u8>,
    chunk: usize,
) -> Result<Outcome> {
    let (tx, rx) = mpsc::channel(64);
    let started = Instant::now();
    let mut inbound = client.process(ReceiverStream::new(rx)).await?.into_inner();
    let send = |m: ProcessingRequest| {
        let tx = tx.clone();
        async move { tx.send(m).await.ok().context("the stream's sender closed") }
    };
    let h = HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![
                header(":method", "POST"),
                header(":path", "/v1/chat/completions"),
                header(":authority", "gateway.example"),
                header("content-type", "application/json"),
                header("content-length", &body.len().to_string()),
            ],
        }),
        end_of_stream: false,
        ..HttpHeaders::default()
    };
    send(msg(Msg::RequestHeaders(h), true)).await?;
    let pieces: Vec<&[u8]> = body.chunks(chunk).collect();
    let mut last_sent = Instant::now();
    for (i, p) in pieces.iter().enumerate() {
        let end = i + 1 == pieces.len();
        let b = HttpBody {
            body: p.to_vec(),
            end_of_stream: end,
            ..HttpBody::default()
        };
        if end {
            last_sent = Instant::now();
        }
        send(msg(Msg::RequestBody(b), false)).await?;
    }
    let first = next(&mut inbound).await?;
    let decision = last_sent.elapsed();
    match first {
        Answer::ImmediateResponse(r) => {
            return Ok(Outcome::Immediate(r.status.map_or(0, |s| s.code as u32)));
        }
        Answer::RequestHeaders(h) => {
            let named = h
                .response
                .as_ref()
                .and_then(|c| c.header_mutation.as_ref())
                .is_some_and(|m| {
                    m.set_headers
                        .iter()
                        .any(|o| o.header.as_ref().is_some_and(|h| h.key == DEST))
                });
            if !named {
                bail!("the headers' answer names no destination");
            }
        }
        other => bail!("unexpected first answer: {other:?}"),
    }
    // The body as re-emitted.
    while !streamed_end(&next(&mut inbound).await?)? {}
    // The replica's answer, through the picker.
    let rh = HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![
                header(":status", "200"),
                header("content-type", "application/json"),
            ],
        }),
        end_of_stream: false,
        ..HttpHeaders::default()
    };
    send(msg(Msg::ResponseHeaders(rh), false)).await?;
    match next(&mut inbound).await? {
        Answer::ResponseHeaders(_) => {}
        other => bail!("the response headers' answer expected: {other:?}"),
    }
    let answer = br#"{"id":"chatcmpl-1","object":"chat.completion","model":"sim-model","choices":[{"index":0,"message":{"role":"assistant","content":"Open a ticket with the invoice number."},"finish_reason":"stop"}],"usage":{"prompt_tokens":55000,"completion_tokens":9,"total_tokens":55009}}"#;
    let rb = HttpBody {
        body: answer.to_vec(),
        end_of_stream: true,
        ..HttpBody::default()
    };
    send(msg(Msg::ResponseBody(rb), false)).await?;
    while !streamed_end(&next(&mut inbound).await?)? {}
    let total = started.elapsed();
    // Half-close; the picker ends the stream.
    drop(tx);
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(Some(_)) = inbound.message().await {}
    })
    .await;
    Ok(Outcome::Picked { decision, total })
}

// ---------------------------------------------------------------- the fleet

struct Fleet {
    /// Killed when the fleet drops.
    _procs: Procs,
    picker_pid: u32,
    /// The picker's admin listener (`None`: the floor, which has none).
    admin: Option<String>,
    epp: String,
    health: String,
    _config: tempfile::NamedTempFile,
}

fn pinned(cpu: u32, bin: &Path) -> Command {
    let mut c = Command::new("taskset");
    c.arg("-c").arg(cpu.to_string()).arg(bin);
    c.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c
}

async fn get(http: &reqwest::Client, url: &str) -> Result<String> {
    let r = http.get(url).send().await?;
    if !r.status().is_success() {
        bail!("{url}: {}", r.status());
    }
    Ok(r.text().await?)
}

async fn start_fleet(bin: &Path, a: &Args, http: &reqwest::Client) -> Result<Fleet> {
    let mut procs = Procs::default();
    let mut sims = Vec::new();
    for _ in 0..REPLICAS {
        let port = free_port()?;
        let mut c = pinned(a.client_cpu, bin);
        c.args(["sim", "--listen", &format!("127.0.0.1:{port}")]);
        procs.0.push(c.spawn().context("taskset sluice sim")?);
        sims.push(format!("http://127.0.0.1:{port}"));
    }
    let (api, admin, epp, health) = (free_port()?, free_port()?, free_port()?, free_port()?);
    let mut cfg = tempfile::Builder::new()
        .prefix("sluice-epp-bench")
        .suffix(".yaml")
        .tempfile()?;
    write!(
        cfg,
        "server:\n  listen: 127.0.0.1:{api}\n  admin_listen: 127.0.0.1:{admin}\n\
         upstream:\n  health_check:\n    interval: 1s\n\
         epp:\n  listen: 127.0.0.1:{epp}\n  health_listen: 127.0.0.1:{health}\n\
         backends:\n{}",
        sims.iter()
            .map(|s| format!("  - url: {s}\n"))
            .collect::<String>()
    )?;
    cfg.flush()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    for s in &sims {
        while get(http, &format!("{s}/health")).await.is_err() {
            if Instant::now() > deadline {
                bail!("{s} not up within 20 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let mut c = pinned(a.picker_cpu, bin);
    c.arg("serve").arg("--config").arg(cfg.path());
    c.env("RUST_LOG", "warn");
    let child = c.spawn().context("taskset sluice serve")?;
    // taskset execs the program: the PID is the picker's.
    let picker_pid = child.id();
    procs.0.push(child);
    let admin = format!("http://127.0.0.1:{admin}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while get(http, &format!("{admin}/readyz")).await.is_err() {
        if Instant::now() > deadline {
            bail!("the picker's /readyz not ready within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let health_url = format!("http://127.0.0.1:{health}");
    loop {
        if readiness(&health_url).await.unwrap_or(false) {
            break;
        }
        if Instant::now() > deadline {
            bail!("the picker's gRPC readiness not SERVING within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // All four healthy and scraped at least once.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    Ok(Fleet {
        _procs: procs,
        picker_pid,
        admin: Some(admin),
        epp: format!("http://127.0.0.1:{epp}"),
        health: health_url,
        _config: cfg,
    })
}

async fn readiness(url: &str) -> Result<bool> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let channel = Endpoint::from_shared(url.to_string())?.connect().await?;
    let mut c = HealthClient::new(channel);
    let r = c
        .check(HealthCheckRequest {
            service: "readiness".into(),
        })
        .await?;
    Ok(r.into_inner().status == ServingStatus::Serving as i32)
}

// ---------------------------------------------------------------- metrics

/// Sum of a metric's samples whose line starts with `prefix`.
fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// The decision histogram's cumulative buckets, by bound.
fn buckets(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for l in text.lines() {
        let Some(rest) = l.strip_prefix("sluice_epp_decision_seconds_bucket{") else {
            continue;
        };
        let Some((labels, v)) = rest.rsplit_once(' ') else {
            continue;
        };
        let Some(le) = labels
            .split("le=\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
        else {
            continue;
        };
        if let Ok(v) = v.parse::<f64>() {
            *out.entry(le.to_string()).or_insert(0.0) += v;
        }
    }
    out
}

fn outcomes(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for l in text.lines() {
        let Some(rest) = l.strip_prefix("sluice_epp_decisions_total{") else {
            continue;
        };
        let Some((labels, v)) = rest.rsplit_once(' ') else {
            continue;
        };
        let o = labels
            .split("outcome=\"")
            .nth(1)
            .and_then(|s| s.split('"').next())
            .unwrap_or("?");
        *out.entry(o.to_string()).or_insert(0.0) += v.parse::<f64>().unwrap_or(0.0);
    }
    out
}

/// Quantiles of the histogram's increase: the upper bound of the bucket
/// where the cumulative count reaches q.
fn histogram_delta(before: &str, after: &str) -> serde_json::Value {
    let (b, a) = (buckets(before), buckets(after));
    let mut rows: Vec<(f64, String, f64)> = a
        .iter()
        .map(|(le, n)| {
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::INFINITY)
            };
            (bound, le.clone(), n - b.get(le).copied().unwrap_or(0.0))
        })
        .collect();
    rows.sort_by(|x, y| x.0.total_cmp(&y.0));
    let count = rows.last().map_or(0.0, |r| r.2);
    let q = |q: f64| -> String {
        rows.iter()
            .find(|r| r.2 >= q * count)
            .map_or_else(|| "-".into(), |r| r.1.clone())
    };
    let sum = metric(after, "sluice_epp_decision_seconds_sum")
        - metric(before, "sluice_epp_decision_seconds_sum");
    serde_json::json!({
        "count": count,
        "mean_ms": if count > 0.0 { sum / count * 1e3 } else { 0.0 },
        "p50_le_s": q(0.50),
        "p90_le_s": q(0.90),
        "p99_le_s": q(0.99),
        "p999_le_s": q(0.999),
        "buckets_cumulative": rows.iter().map(|r| (r.1.clone(), r.2)).collect::<Vec<_>>(),
    })
}

fn pct(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1e3
}

fn latency(mut v: Vec<Duration>) -> serde_json::Value {
    v.sort();
    let mean = if v.is_empty() {
        0.0
    } else {
        v.iter().map(Duration::as_secs_f64).sum::<f64>() / v.len() as f64 * 1e3
    };
    serde_json::json!({
        "n": v.len(),
        "mean_ms": mean,
        "p50_ms": pct(&v, 0.50),
        "p90_ms": pct(&v, 0.90),
        "p99_ms": pct(&v, 0.99),
        "p999_ms": pct(&v, 0.999),
        "max_ms": v.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
    })
}

/// The picker's metrics (empty for the floor: no metric, nothing left).
async fn scrape(http: &reqwest::Client, fleet: &Fleet) -> Result<String> {
    match &fleet.admin {
        Some(admin) => get(http, &format!("{admin}/metrics")).await,
        None => Ok(String::new()),
    }
}

// ---------------------------------------------------------------- the floor

/// The protocol's floor (`--floor`): each stream's body taken in and handed
/// back, nothing read.
struct Floor;

#[tonic::async_trait]
impl ExternalProcessor for Floor {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, tonic::Status>>;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            let mut body = Vec::new();
            while let Ok(Some(m)) = inbound.message().await {
                let answers = match m.request {
                    Some(Msg::RequestBody(b)) => {
                        body.extend_from_slice(&b.body);
                        if !b.end_of_stream {
                            continue;
                        }
                        let mut out = vec![Answer::RequestHeaders(HeadersResponse {
                            response: Some(CommonResponse {
                                header_mutation: Some(HeaderMutation {
                                    set_headers: vec![HeaderValueOption {
                                        header: Some(header(DEST, "127.0.0.1:8000")),
                                        ..HeaderValueOption::default()
                                    }],
                                    ..HeaderMutation::default()
                                }),
                                ..CommonResponse::default()
                            }),
                        })];
                        out.extend(echo(&std::mem::take(&mut body), Answer::RequestBody));
                        out
                    }
                    Some(Msg::ResponseHeaders(_)) => {
                        vec![Answer::ResponseHeaders(HeadersResponse::default())]
                    }
                    Some(Msg::ResponseBody(b)) => echo(&b.body, Answer::ResponseBody),
                    _ => Vec::new(),
                };
                for a in answers {
                    let m = ProcessingResponse {
                        response: Some(a),
                        ..ProcessingResponse::default()
                    };
                    if tx.send(Ok(m)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

/// `body` as the picker re-emits it: streamed chunks of at most 62,000 bytes.
fn echo(body: &[u8], as_answer: fn(BodyResponse) -> Answer) -> Vec<Answer> {
    let pieces: Vec<&[u8]> = body.chunks(62_000).collect();
    let n = pieces.len().max(1);
    (0..n)
        .map(|i| {
            let piece = pieces.get(i).copied().unwrap_or_default();
            as_answer(BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(BodyMutation {
                        mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                            body: piece.to_vec(),
                            end_of_stream: i + 1 == n,
                            ..StreamedBodyResponse::default()
                        })),
                    }),
                    ..CommonResponse::default()
                }),
            })
        })
        .collect()
}

/// Serve the floor on `port` (this program run by `--floor`, pinned to the
/// picker's core): one runtime worker, as the picker has on one core.
fn serve_floor(port: u16) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        tonic::transport::Server::builder()
            // The picker's windows (`src/epp/mod.rs`).
            .initial_stream_window_size(2 << 20)
            .initial_connection_window_size(16 << 20)
            .add_service(
                ExternalProcessorServer::new(Floor)
                    .max_decoding_message_size(64 << 20)
                    .max_encoding_message_size(64 << 20),
            )
            .serve_with_incoming(incoming)
            .await?;
        Ok(())
    })
}

/// The floor in the picker's place: this program, pinned to its core.
async fn start_floor(a: &Args) -> Result<Fleet> {
    let port = free_port()?;
    let mut procs = Procs::default();
    let mut c = pinned(a.picker_cpu, &std::env::current_exe()?);
    c.args(["--serve-floor", &port.to_string()]);
    let child = c.spawn().context("taskset the floor")?;
    let picker_pid = child.id();
    procs.0.push(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        if Instant::now() > deadline {
            bail!("the floor not listening within 20 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(Fleet {
        _procs: procs,
        picker_pid,
        admin: None,
        epp: format!("http://127.0.0.1:{port}"),
        health: String::new(),
        _config: tempfile::NamedTempFile::new()?,
    })
}

// ---------------------------------------------------------------- the run

async fn drive(a: &Args, fleet: &Fleet, http: &reqwest::Client) -> Result<serde_json::Value> {
    let prompts = Arc::new(Prompts::new(a.prefixes, a.prompt_kb)?);
    let mut clients = Vec::new();
    for _ in 0..a.channels {
        // Envoy's HTTP/2 defaults for a cluster: 256 MiB windows.
        let ch = Endpoint::from_shared(fleet.epp.clone())?
            .tcp_nodelay(true)
            .initial_stream_window_size(ENVOY_WINDOW)
            .initial_connection_window_size(ENVOY_WINDOW)
            .connect()
            .await?;
        clients.push(
            ExternalProcessorClient::new(ch)
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(64 << 20),
        );
    }
    let chunk = a.chunk_kb * 1024;
    // Warm the connections and the picker's routing memory (not measured).
    for (i, c) in clients.iter().enumerate() {
        let mut rng = fastrand::Rng::with_seed(i as u64);
        let body = prompts.body(u64::MAX - i as u64, &mut rng)?;
        one(c.clone(), body, chunk).await?;
    }

    let before = scrape(http, fleet).await?;
    let cpu_before = cpu_seconds(fleet.picker_pid)?;
    let self_before = cpu_seconds(std::process::id())?;

    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Outcome>();
    let mut tasks = tokio::task::JoinSet::new();
    let mut rng = fastrand::Rng::with_seed(42);
    let start = tokio::time::Instant::now();
    let wall = Instant::now();
    let end = start + Duration::from_secs_f64(a.seconds);
    let mut at = start;
    let mut n: u64 = 0;
    let mut lag = Vec::new();
    let mut peak_open = 0usize;
    loop {
        let gap = if a.poisson {
            -(1.0 - rng.f64()).ln() / a.rate
        } else {
            1.0 / a.rate
        };
        at += Duration::from_secs_f64(gap);
        if at >= end {
            break;
        }
        tokio::time::sleep_until(at).await;
        lag.push(tokio::time::Instant::now().saturating_duration_since(at));
        let body = prompts.body(n, &mut rng)?;
        let client = clients[(n as usize) % clients.len()].clone();
        let done = done_tx.clone();
        tasks.spawn(async move {
            let o = match one(client, body, chunk).await {
                Ok(o) => o,
                Err(e) => Outcome::Failed(format!("{e:#}")),
            };
            let _ = done.send(o);
        });
        n += 1;
        while tasks.try_join_next().is_some() {}
        peak_open = peak_open.max(tasks.len());
    }
    let offered_seconds = wall.elapsed().as_secs_f64();
    drop(done_tx);
    let drain = tokio::time::timeout(Duration::from_secs(60), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    let still_open = tasks.len();
    tasks.abort_all();
    let run_seconds = wall.elapsed().as_secs_f64();
    let cpu_after = cpu_seconds(fleet.picker_pid)?;
    let self_after = cpu_seconds(std::process::id())?;

    let (mut decisions, mut totals) = (Vec::new(), Vec::new());
    let mut immediate: BTreeMap<u32, u64> = BTreeMap::new();
    let mut failed: BTreeMap<String, u64> = BTreeMap::new();
    while let Ok(o) = done_rx.try_recv() {
        match o {
            Outcome::Picked { decision, total } => {
                decisions.push(decision);
                totals.push(total);
            }
            Outcome::Immediate(s) => *immediate.entry(s).or_default() += 1,
            Outcome::Failed(e) => {
                let e: String = e.chars().take(160).collect();
                *failed.entry(e).or_default() += 1;
            }
        }
    }
    // Let the picker finish what it was releasing, then look for leaks.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = scrape(http, fleet).await?;
    // Then close the connections, as a data plane that goes away does: every
    // stream on them ends, and the picker must release each request.
    drop(clients);
    let closed = Instant::now();
    let mut left = metric(&after, "sluice_requests_in_flight");
    while left > 0.0 && closed.elapsed() < RELEASE_WITHIN {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = scrape(http, fleet).await?;
        left = metric(&now, "sluice_requests_in_flight");
    }
    let released_ms = closed.elapsed().as_secs_f64() * 1e3;
    let picked = decisions.len() as f64;
    let picker_cpu = cpu_after - cpu_before;
    lag.sort();
    let health_ok = readiness(&fleet.health).await.unwrap_or(false);
    let picker_outcomes = {
        let (b, a) = (outcomes(&before), outcomes(&after));
        a.iter()
            .map(|(k, v)| (k.clone(), v - b.get(k).copied().unwrap_or(0.0)))
            .collect::<BTreeMap<_, _>>()
    };
    Ok(serde_json::json!({
        "requests_offered": n,
        "offered_rate": n as f64 / offered_seconds,
        "achieved_rate": picked / run_seconds,
        "picked": decisions.len(),
        "immediate": immediate.iter().map(|(k, v)| (k.to_string(), *v)).collect::<BTreeMap<_, _>>(),
        "failed": failed,
        "unfinished_after_60s": if drain.is_err() { still_open } else { 0 },
        "peak_open_streams": peak_open,
        "arrival_lag": {
            "p50_ms": pct(&lag, 0.5), "p99_ms": pct(&lag, 0.99),
            "max_ms": lag.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        },
        "decision_client": latency(decisions),
        "request_total_client": latency(totals),
        "decision_picker_histogram": histogram_delta(&before, &after),
        "picker_outcomes": picker_outcomes,
        "picker_cpu_seconds": picker_cpu,
        "picker_cpu_utilisation": picker_cpu / run_seconds,
        "picker_cpu_us_per_request": if picked > 0.0 { picker_cpu / picked * 1e6 } else { 0.0 },
        "client_cpu_utilisation": (self_after - self_before) / run_seconds,
        "after": {
            "sluice_requests_in_flight": metric(&after, "sluice_requests_in_flight"),
            "sluice_backend_in_flight": metric(&after, "sluice_backend_in_flight"),
            "sluice_flow_waiting_requests": metric(&after, "sluice_flow_waiting_requests"),
            "readiness_serving": health_ok,
        },
        "after_connections_closed": {
            "sluice_requests_in_flight": left,
            "within_ms": released_ms,
        },
    }))
}

/// The fleet up, the load driven; the children killed (by PID) on every
/// path out, as `Procs` drops.
async fn run(bin: &Path, a: &Args, http: &reqwest::Client) -> Result<serde_json::Value> {
    let fleet = if a.floor {
        start_floor(a).await?
    } else {
        start_fleet(bin, a, http).await?
    };
    eprintln!(
        "picker pid {} on cpu {}, client on cpu {}: {} req/s for {} s, {} KB prompts, {} KiB chunks",
        fleet.picker_pid, a.picker_cpu, a.client_cpu, a.rate, a.seconds, a.prompt_kb, a.chunk_kb
    );
    let r = drive(a, &fleet, http).await;
    drop(fleet);
    r
}

fn binary(given: Option<&Path>) -> Result<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bin = given.map_or_else(|| root.join("target/release/sluice"), Path::to_path_buf);
    if !bin.exists() {
        bail!(
            "{} is missing: build it first with `cargo build --release`",
            bin.display()
        );
    }
    let built = std::fs::metadata(&bin)?
        .modified()?
        .duration_since(SystemTime::UNIX_EPOCH)?
        .as_secs();
    let committed: u64 = run_text(
        "git",
        &["-C", &root.to_string_lossy(), "log", "-1", "--format=%ct"],
    )
    .parse()
    .unwrap_or(0);
    if committed > built {
        eprintln!(
            "warning: {} is older than the last commit (`cargo build --release`)",
            bin.display()
        );
    }
    Ok(bin)
}

fn main() -> Result<()> {
    let Some(a) = Args::parse()? else {
        return Ok(());
    };
    if let Some(port) = a.serve_floor {
        return serve_floor(port);
    }
    let bin = binary(a.sluice.as_deref())?;
    // This process (the client) on its own core, before any thread starts.
    let pid = std::process::id().to_string();
    let pinned = Command::new("taskset")
        .args(["-a", "-p", "-c", &a.client_cpu.to_string(), &pid])
        .stdout(Stdio::null())
        .status()
        .context("taskset")?;
    if !pinned.success() {
        bail!("taskset -p failed");
    }
    // A hard bound on the whole run: past it the run is dropped, and with
    // it the children (killed by PID).
    let limit = Duration::from_secs_f64(a.seconds + 240.0);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    let report = rt.block_on(async {
        tokio::time::timeout(limit, run(&bin, &a, &http))
            .await
            .with_context(|| format!("the benchmark exceeded {limit:?}"))?
    });
    let results = report?;
    let root = env!("CARGO_MANIFEST_DIR");
    let out = serde_json::json!({
        "benchmark": "epp_decision",
        "date": run_text("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
        "commit": run_text("git", &["-C", root, "rev-parse", "--short", "HEAD"]),
        // Uncommitted changes to the gateway's source when the run started.
        "src_dirty": !run_text("git", &["-C", root, "status", "--porcelain", "--", "src", "Cargo.lock"]).is_empty(),
        "machine": {
            "cpu": run_text("sh", &["-c", "lscpu | sed -n 's/^Model name: *//p'"]),
            "cores": run_text("nproc", &["--all"]),
            "kernel": run_text("uname", &["-r"]),
        },
        "args": {
            "rate": a.rate, "seconds": a.seconds, "prompt_kb": a.prompt_kb,
            "chunk_kib": a.chunk_kb, "prefixes": a.prefixes, "channels": a.channels,
            "arrivals": if a.poisson { "poisson" } else { "fixed" },
            "picker_cpu": a.picker_cpu, "client_cpu": a.client_cpu,
            "picker": if a.floor { "floor" } else { "sluice" },
            "replicas": REPLICAS,
        },
        "results": results,
    });
    let text = serde_json::to_string_pretty(&out)?;
    println!("{text}");
    if let Some(p) = &a.json {
        std::fs::write(p, text + "\n")?;
    }
    Ok(())
}
