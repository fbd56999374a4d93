//! The replicas, what each serves, whether it is healthy, how loaded it is,
//! and how busy this gateway keeps it.
//!
//! Read-mostly state sits behind `ArcSwap`: a request takes snapshots of the
//! replica list and the model index without locking; discovery and the health
//! loop publish new ones. Per-replica counters are atomics.

use std::collections::BTreeSet;

use foldhash::{HashMap, HashMapExt as _};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use http::HeaderValue;

use super::company::Company;
use super::conn::{ConnPool, UpstreamTls};
use super::signals::{Ewma, LoadSample};
use crate::config::{BackendConfig, Config, EnginePriority, OutlierConfig, Role, UpstreamConfig};
use crate::error::GatewayError;
use crate::telemetry::metrics::{BackendSeries, Metrics, ScrapedLoad};

/// How far back each replica's scrapes are kept (for diagnosis: rates and
/// trends over minutes).
pub const HISTORY: Duration = Duration::from_secs(600);
/// At most this many samples (a 100 ms scrape interval keeps the last 10
/// minutes at about 100 bytes each: 600 KB per replica at worst).
const MAX_HISTORY_SAMPLES: usize = 6000;

/// What the last health check found.
#[derive(Debug, Clone, Default)]
pub struct Health {
    pub checked_at: Option<Instant>,
    pub models: Vec<Arc<str>>,
    pub last_error: Option<String>,
    pub consecutive_failures: u32,
}

/// Passive-health state (outlier detection), as seen in `/admin/backends`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Circuit {
    /// Serving normally.
    Closed,
    /// Ejected after consecutive failures; no traffic until the time is up.
    Open,
    /// Back after an ejection, on probation: the next failures eject it longer.
    HalfOpen,
}

impl Circuit {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Circuit::Closed => "closed",
            Circuit::Open => "open",
            Circuit::HalfOpen => "half_open",
        }
    }
}

pub struct Replica {
    pub name: Arc<str>,
    /// Where it came from: `None` for `backends`, `Some(i)` for `discovery.dns[i]`
    /// (then `discovery.kubernetes`, numbered after the DNS sources).
    pub source: Option<usize>,
    /// `scheme://host:port[/prefix]`, no trailing slash.
    pub base: String,
    /// The URL's path prefix (usually empty), prepended to request paths.
    pub path_prefix: String,
    /// Keep-alive connections used by proxied requests.
    pub conns: ConnPool,
    pub api_key: Option<HeaderValue>,
    /// Models from config; when empty, the discovered ones count.
    pub static_models: Vec<Arc<str>>,
    pub healthy: AtomicBool,
    /// Requests this gateway has sent and not yet finished; updated at once on
    /// every routing decision and completion (fresher than any scrape).
    pub in_flight: AtomicU32,
    pub health: ArcSwap<Health>,
    /// The latest scrape of the replica's own metrics.
    load: ArcSwapOption<LoadSample>,
    /// The scrapes of the last [`HISTORY`] (oldest first), for diagnosis.
    history: parking_lot::Mutex<std::collections::VecDeque<LoadSample>>,
    /// Moving averages of what this gateway measured here: time to first
    /// token (from sending the request here to its first token, learned at
    /// each first token of a stream) and time per output token (at the end
    /// of each successful request).
    pub ttft_recent: Ewma,
    pub tpot_recent: Ewma,
    failures: AtomicU32,
    ejections: AtomicU32,
    /// Milliseconds since `epoch` until which the replica is ejected (0: never).
    /// On tokio's clock, so tests of the circuit run on paused time.
    ejected_until: AtomicU64,
    epoch: tokio::time::Instant,
    outlier: OutlierConfig,
    pub series: Arc<BackendSeries>,
    /// Requests it runs at once, from config (`max_concurrency`).
    configured_seats: Option<u32>,
    /// Learned from its scrapes (0: not yet): see [`Replica::seats`].
    learned_seats: AtomicU32,
    /// Streams in flight here whose `max_tokens` is nearly reached (about
    /// to leave: flow control counts their seats as free).
    leaving: AtomicU32,
    /// Requests other gateways had running or waiting here at the last
    /// scrape: the engine's count beyond this gateway's in-flight then.
    others: AtomicU32,
    /// The gateway's view of other senders, told at each scrape.
    company: Arc<Company>,
    /// Of this gateway's requests in flight here, those picked for it as
    /// their decode replica whose remote prefill has not answered yet (the
    /// endpoint picker's: the decode replica's sidecar sends them to its
    /// engine only after their prefill): not at its engine yet.
    awaiting_prefill: AtomicU32,
    pub engine_priority: EnginePriority,
    /// The replica's DCGM exporter (`backends[].dcgm_url`), read with each
    /// scrape round.
    pub dcgm: Option<String>,
    /// Its part in a disaggregated fleet (`backends[].role`), and SGLang's
    /// bootstrap port where it prefills.
    pub role: Role,
    pub bootstrap_port: Option<u16>,
    /// The last look at its engine outside the scrape rounds
    /// (`scrape::glance`): when, and what it showed (`None`: no answer);
    /// held across the fetch, so concurrent lookers share one.
    pub(crate) glance: tokio::sync::Mutex<Option<(std::time::Instant, Option<Glance>)>>,
}

/// What a replica's engine ran and queued at a look outside the scrape
/// rounds (`scrape::glance`), and this gateway's requests in flight at its
/// engine then ([`Replica::in_flight_at_engine`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Glance {
    pub running: f64,
    pub waiting: f64,
    pub in_flight: u32,
}

impl Replica {
    /// Whether `other` describes this replica exactly (so this one, with its
    /// connections and state, can stand for it).
    fn same_as(&self, other: &Replica) -> bool {
        self.name == other.name
            && self.base == other.base
            && self.api_key == other.api_key
            && self.static_models == other.static_models
            && self.configured_seats == other.configured_seats
            && self.engine_priority == other.engine_priority
            && self.dcgm == other.dcgm
            && self.role == other.role
            && self.bootstrap_port == other.bootstrap_port
    }

    /// Start from what `old` (the same replica before a reload rebuilt it)
    /// knew: health, models, the latest metrics sample. Connections and
    /// circuit start anew.
    fn inherit(&self, old: &Replica) {
        self.healthy.store(old.healthy.load(Relaxed), Relaxed);
        self.health.store(old.health.load_full());
        self.load.store(old.load.load_full());
        *self.history.lock() = old.history.lock().clone();
        self.learned_seats
            .store(old.learned_seats.load(Relaxed), Relaxed);
    }

    pub fn from_config(
        b: &BackendConfig,
        source: Option<usize>,
        up: &UpstreamConfig,
        metrics: &Metrics,
    ) -> Self {
        let name: Arc<str> = Arc::from(b.label());
        let base = b.url.as_str().trim_end_matches('/').to_string();
        let path_prefix = b.url.path().trim_end_matches('/').to_string();
        let host = b.url.host_str().unwrap_or("localhost");
        let port = b.url.port_or_known_default().unwrap_or(80);
        let authority = match b.url.port() {
            Some(p) => format!("{host}:{p}"),
            None => host.to_string(),
        };
        let tls = (b.url.scheme() == "https").then(|| upstream_tls(host, &up.tls));
        let conns = ConnPool::new(
            format!("{host}:{port}"),
            HeaderValue::from_str(&authority).unwrap_or(HeaderValue::from_static("localhost")),
            up.pool_max_idle_per_host,
            up.pool_idle_timeout,
            up.timeouts.connect,
            tls,
        );
        let api_key = b
            .api_key
            .as_ref()
            .and_then(|k| HeaderValue::from_str(&format!("Bearer {}", k.expose())).ok())
            .map(|mut v| {
                v.set_sensitive(true);
                v
            });
        let series = metrics.init_backend(&name, b.role.as_str());
        Self {
            name,
            source,
            base,
            path_prefix,
            conns,
            api_key,
            static_models: b.models.iter().map(|m| Arc::from(m.as_str())).collect(),
            healthy: AtomicBool::new(false),
            in_flight: AtomicU32::new(0),
            health: ArcSwap::from_pointee(Health::default()),
            load: ArcSwapOption::empty(),
            history: parking_lot::Mutex::new(std::collections::VecDeque::new()),
            ttft_recent: Ewma::default(),
            tpot_recent: Ewma::default(),
            failures: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            ejected_until: AtomicU64::new(0),
            epoch: tokio::time::Instant::now(),
            outlier: up.outlier.clone(),
            series,
            configured_seats: b.max_concurrency,
            learned_seats: AtomicU32::new(0),
            leaving: AtomicU32::new(0),
            others: AtomicU32::new(0),
            company: Arc::default(),
            awaiting_prefill: AtomicU32::new(0),
            engine_priority: b.engine_priority,
            dcgm: b.dcgm_url.as_ref().map(|u| u.to_string()),
            role: b.role,
            bootstrap_port: b.bootstrap_port,
            glance: tokio::sync::Mutex::new(None),
        }
    }

    /// The gateway's view of other senders this replica's scrapes tell
    /// (the pool's, shared by its replicas).
    fn with_company(mut self, company: &Arc<Company>) -> Self {
        self.company = company.clone();
        self
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Relaxed)
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Relaxed)
    }

    /// The models this replica serves: configured, or last discovered.
    pub(crate) fn models(&self) -> Vec<Arc<str>> {
        if self.static_models.is_empty() {
            self.health.load().models.clone()
        } else {
            self.static_models.clone()
        }
    }

    pub fn load(&self) -> Option<Arc<LoadSample>> {
        self.load.load_full()
    }

    pub fn set_load(&self, s: LoadSample) {
        self.set_sample(s, false);
    }

    /// A second look (`scrape::run`), a quarter second after the last
    /// scrape: as [`Replica::set_load`], except that a preemption the last
    /// scrape saw still counts (the counter rarely moves in a quarter
    /// second, and the replica would look calm until the next regular
    /// scrape, a whole interval later).
    pub(crate) fn set_load_again(&self, s: LoadSample) {
        self.set_sample(s, true);
    }

    fn set_sample(&self, mut s: LoadSample, again: bool) {
        let prev = self.load.load();
        let running_before = prev.as_deref().and_then(|p| p.running);
        if let Some(p) = prev.as_deref() {
            s.queued = s.queue().is_some_and(|w| w >= 1.0) && p.queue().is_some_and(|w| w >= 1.0);
            // A restarted engine's counter starts again: only a rise counts.
            s.preempting = matches!((p.preemptions, s.preemptions), (Some(a), Some(b)) if b > a)
                || (again && p.preempting);
        }
        drop(prev);
        self.learn_seats(&s, running_before);
        s.cached_predicted = Some(self.series.cached_predicted.get() as f64);
        s.cached_actual = Some(self.series.cached_actual.get() as f64);
        s.attempts = Some(self.series.attempts.get() as f64);
        s.prefix_elsewhere = Some(self.series.prefix_elsewhere.get() as f64);
        if let (Some(r), Some(w)) = (s.running, s.waiting) {
            let seen = (r + w).round().max(0.0) as u32;
            let ours = self.in_flight_at_engine();
            if !again {
                self.company.note(seen, ours, s.at);
            }
            self.others.store(seen.saturating_sub(ours), Relaxed);
            self.series
                .elsewhere
                .set(i64::from(seen.saturating_sub(ours)));
        }
        let exported = ScrapedLoad {
            kv_usage: s.kv_usage,
            waiting: s.waiting,
            deferred: s.deferred,
            running: s.running,
            prefix_hit_rate: s.prefix_hit_rate,
            gpu_util: s.gpu_util,
            gpu_memory: s.gpu_memory,
            preemptions: s.preemptions,
        };
        self.series.record_load(exported, s.at);
        {
            let mut h = self.history.lock();
            while h
                .front()
                .is_some_and(|old| s.at.saturating_duration_since(old.at) > HISTORY)
            {
                h.pop_front();
            }
            if h.len() < MAX_HISTORY_SAMPLES {
                h.push_back(s);
            }
        }
        self.load.store(Some(Arc::new(s)));
    }

    /// Requests the replica runs at once: configured, else learned (`None`
    /// until it has been seen full).
    pub fn seats(&self) -> Option<u32> {
        self.configured_seats
            .or(Some(self.learned_seats.load(Relaxed)).filter(|&n| n > 0))
    }

    /// Its seats are unknown (not configured) and its last scrape shows
    /// requests waiting for the first time: a second look will tell whether
    /// the engine could not take them in (`scrape::run`). Not on a decode
    /// replica whose engine does not tell its requests pulling their
    /// prompt's KV from those waiting for room ([`LoadSample::queue`]): a
    /// long pull is no lack of seats; there the next regular scrape
    /// decides, as before.
    pub(crate) fn queue_unconfirmed(&self) -> bool {
        self.configured_seats.is_none()
            && self.load().is_some_and(|s| {
                (self.role != Role::Decode || s.deferred.is_some())
                    && !s.queued
                    && s.queue().is_some_and(|w| w >= 1.0)
            })
    }

    /// The scrapes of the last [`HISTORY`], oldest first.
    pub fn history(&self) -> Vec<LoadSample> {
        self.history.lock().iter().copied().collect()
    }

    /// This gateway's requests in flight here that its engine holds: all
    /// but those waiting for their remote prefill before they are sent on
    /// ([`AwaitingPrefill`]).
    pub(crate) fn in_flight_at_engine(&self) -> u32 {
        self.in_flight()
            .saturating_sub(self.awaiting_prefill.load(Relaxed))
    }

    /// Requests of other gateways here at the last scrape.
    pub fn others(&self) -> u32 {
        self.others.load(Relaxed)
    }

    /// Requests occupying its seats: this gateway's in flight (live) and
    /// other gateways' (at the last scrape).
    pub fn busy(&self) -> u32 {
        self.in_flight() + self.others()
    }

    /// Streams here about to finish (their `max_tokens` nearly reached).
    pub fn leaving(&self) -> u32 {
        self.leaving.load(Relaxed)
    }

    /// Learn the replica's seats from two scrapes in a row: requests still
    /// waiting at the next look (a scrape interval later, dozens of engine
    /// steps, or a quarter second for a queue first seen: `scrape::run`) mean the
    /// engine could not take them, so what runs is what it holds. While this
    /// gateway keeps it exactly at that and it queues nothing, probe upward
    /// (a sixteenth at a time): the limit may have been KV memory, which
    /// frees as sequences end.
    ///
    /// Not from a queue the engine is taking in (it runs more than at the
    /// look before, `running_before`): that queue waits for the step's token
    /// budget (long prompts being prefilled, a chunk a step), not for seats,
    /// and what runs then is no limit. And an engine seen running more than
    /// the seats learned has at least that many. (Learned from such queues,
    /// a cold start of long prompts through three gateways taught replicas
    /// of 64 seats 7-8; full by that count, they were left out of placement
    /// and every new prompt for a second went to the one replica that had
    /// not queued yet: TTFT p99 1.1 s against 0.66 s for sglang-router;
    /// docs/BENCHMARKS.md.)
    fn learn_seats(&self, s: &LoadSample, running_before: Option<f64>) {
        if self.configured_seats.is_some() {
            return;
        }
        let (Some(waiting), Some(running)) = (s.waiting, s.running) else {
            return;
        };
        // Nothing waits for room, and what runs or is about to (requests
        // pulling their KV: [`LoadSample::queue`]) fills what it learned.
        let queue = s.queue().unwrap_or(waiting);
        let learned = self.learned_seats.load(Relaxed);
        let runs = running.round().max(0.0) as u32;
        let taking_in = running_before.is_some_and(|b| running > b);
        let held = s.queued && runs >= 1 && !taking_in;
        let proven = learned > 0 && runs > learned;
        if held || proven {
            self.learned_seats.store(runs, Relaxed);
        } else if learned > 0 && queue < 1.0 && running + waiting >= f64::from(learned) {
            self.learned_seats
                .store(learned + (learned / 16).max(1), Relaxed);
        }
    }

    /// How long this gateway has known the replica (since its config or
    /// discovery listed it).
    pub fn known_for(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub(crate) fn circuit(&self) -> Circuit {
        let until = self.ejected_until.load(Relaxed);
        if until == 0 {
            Circuit::Closed
        } else if self.now_ms() < until {
            Circuit::Open
        } else {
            Circuit::HalfOpen
        }
    }

    /// Time left in the current ejection.
    pub(crate) fn ejected_for(&self) -> Option<Duration> {
        let until = self.ejected_until.load(Relaxed);
        let now = self.now_ms();
        (until > now).then(|| Duration::from_millis(until - now))
    }

    /// A request succeeded: the failure streak ends; probation ends too.
    pub(crate) fn record_success(&self) {
        self.failures.store(0, Relaxed);
        if self.ejected_until.load(Relaxed) != 0 && self.circuit() == Circuit::HalfOpen {
            self.ejected_until.store(0, Relaxed);
            self.series.ejected.set(0);
            tracing::info!(backend = %self.name, "replica recovered after ejection");
        }
        // Earlier ejections fade with good behaviour.
        let _ = self
            .ejections
            .fetch_update(Relaxed, Relaxed, |e| e.checked_sub(1));
    }

    /// A request failed because of the replica; eject it after too many in a row.
    pub(crate) fn record_failure(&self) {
        let cfg = &self.outlier;
        let n = self.failures.fetch_add(1, Relaxed) + 1;
        if n < cfg.consecutive_failures.max(1) || self.circuit() == Circuit::Open {
            return;
        }
        self.failures.store(0, Relaxed);
        let k = self.ejections.fetch_add(1, Relaxed).min(16);
        let time = cfg
            .base_ejection
            .saturating_mul(1 << k)
            .min(cfg.max_ejection);
        let until = self.now_ms() + u64::try_from(time.as_millis()).unwrap_or(u64::MAX / 2);
        self.ejected_until.store(until.max(1), Relaxed);
        self.series.ejected.set(1);
        self.series.ejections.inc();
        tracing::warn!(
            backend = %self.name,
            failures = n,
            ejected_for = %humantime::format_duration(time),
            "replica ejected after consecutive failures"
        );
    }
}

/// RAII in-flight accounting: up in `new`, down in `Drop`, so a cancelled
/// request cannot leak a count.
pub(crate) struct InFlight {
    replica: Arc<Replica>,
    leaving: bool,
}

impl InFlight {
    pub(crate) fn new(r: Arc<Replica>) -> Self {
        r.in_flight.fetch_add(1, Relaxed);
        r.series.in_flight.inc();
        r.series.attempts.inc();
        Self {
            replica: r,
            leaving: false,
        }
    }

    pub(crate) fn replica(&self) -> &Arc<Replica> {
        &self.replica
    }

    /// The request is about to finish: its seat counts as free from now.
    pub(crate) fn mark_leaving(&mut self) {
        if !self.leaving {
            self.leaving = true;
            self.replica.leaving.fetch_add(1, Relaxed);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.leaving {
            self.replica.leaving.fetch_sub(1, Relaxed);
        }
        self.replica.in_flight.fetch_sub(1, Relaxed);
        self.replica.series.in_flight.dec();
    }
}

/// A request in flight on its decode replica whose remote prefill has not
/// answered (the endpoint picker's pick: the sidecar sends it to the
/// engine after the prefill): counted in [`Replica::in_flight_at_engine`]
/// only once dropped.
pub(crate) struct AwaitingPrefill(Arc<Replica>);

impl AwaitingPrefill {
    pub(crate) fn new(r: Arc<Replica>) -> Self {
        r.awaiting_prefill.fetch_add(1, Relaxed);
        Self(r)
    }
}

impl Drop for AwaitingPrefill {
    fn drop(&mut self) {
        self.0.awaiting_prefill.fetch_sub(1, Relaxed);
    }
}

/// Immutable snapshot: which replicas serve which model.
#[derive(Default)]
pub(crate) struct ModelIndex {
    /// Served model name -> replicas (healthy or not).
    pub by_model: HashMap<Arc<str>, Vec<Arc<Replica>>>,
}

/// The outcome of resolving a model: its served name and where it may go.
pub struct Candidates {
    pub model: Arc<str>,
    /// The replicas that serve whole requests and decode legs (every role
    /// but `prefill`).
    pub replicas: Vec<Arc<Replica>>,
    /// Every available replica was ejected, so ejected ones are offered anyway.
    pub fallback: bool,
    /// A disaggregated model (one with `prefill` replicas): the replicas that
    /// may prefill for a decode replica (`prefill` and `mixed`). Empty
    /// otherwise: no request of the model is disaggregated.
    pub prefill: Vec<Arc<Replica>>,
}

pub struct Pool {
    replicas: ArcSwap<Vec<Arc<Replica>>>,
    pub aliases: HashMap<String, Arc<str>>,
    index: ArcSwap<ModelIndex>,
    /// What new replicas (found by discovery) are built with.
    upstream: UpstreamConfig,
    /// The DNS sources' names and ports, to tell on a reload whether a
    /// source's replicas still belong to it.
    /// Where each discovery source looks (see [`Origin`]).
    origins: Vec<Origin>,
    /// The models the discovery sources name: known (503 while none of
    /// their replicas is there, not 404).
    declared: Vec<Arc<str>>,
    metrics: Arc<Metrics>,
    /// Whether other senders' requests show at the replicas' engines,
    /// told by every replica's scrapes (`upstream::company`).
    company: Arc<Company>,
}

/// How the connections to an `https://` replica at `host` are made: the
/// shared client config of `upstream.tls` (checked when the state was
/// built, so an error here is a file that changed since).
fn upstream_tls(host: &str, cfg: &crate::config::UpstreamTlsConfig) -> UpstreamTls {
    // An IPv6 literal comes bracketed from the URL.
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let name = rustls::pki_types::ServerName::try_from(bare.to_string())
        .map_err(|_| Arc::<str>::from(format!("`{host}` is not a name a certificate can carry")));
    let connector = crate::net::tls::shared_client(cfg)
        .map(|c| tokio_rustls::TlsConnector::from(c.config.clone()))
        .map_err(|e| Arc::<str>::from(format!("{e:#}")));
    UpstreamTls {
        connect: connector.and_then(|c| name.map(|n| (c, n))),
    }
}

/// Where a discovery source finds its replicas: a reload keeps the
/// replicas a source found while this stays the same.
#[derive(Debug, PartialEq)]
enum Origin {
    Dns(String, u16),
    Kubernetes {
        namespace: Option<String>,
        pool: Option<String>,
        selector: std::collections::BTreeMap<String, String>,
        port: Option<u16>,
    },
}

fn origins(config: &Config) -> Vec<Origin> {
    let d = &config.discovery;
    let dns = d.dns.iter().map(|s| Origin::Dns(s.name.clone(), s.port));
    let kube = d.kubernetes.iter().map(|k| Origin::Kubernetes {
        namespace: k.namespace.clone(),
        pool: k.inference_pool.clone(),
        selector: k.selector.clone(),
        port: k.port,
    });
    dns.chain(kube).collect()
}

impl Pool {
    /// The pool for `config`. On a reload, `previous` is the pool it replaces:
    /// a replica that stays as it was (same name, URL, key, models, and the
    /// same upstream settings) is carried over with its connections, health,
    /// circuit and in-flight count; replicas from a discovery source
    /// that still looks in the same place are kept.
    pub(crate) fn new(config: &Config, metrics: Arc<Metrics>, previous: Option<&Pool>) -> Self {
        metrics
            .scraping
            .store(config.routing.metrics.enabled, Relaxed);
        let old = previous.map(|p| p.replicas()).unwrap_or_default();
        // (What the engines said of other senders outlives a reload.)
        let company = previous.map(|p| p.company.clone()).unwrap_or_default();
        // Replicas can be carried over whole only if they would be built alike.
        let reusable = previous.is_some_and(|p| p.upstream == config.upstream);
        // The replica for `b` from `source`: the old one if nothing about it
        // changed; else a new one that starts from the old one's health and
        // models (a reload must not make a healthy replica look unknown).
        let place = |b: &BackendConfig, source: Option<usize>| {
            let fresh =
                Replica::from_config(b, source, &config.upstream, &metrics).with_company(&company);
            match old
                .iter()
                .find(|r| r.source == source && r.name == fresh.name)
            {
                Some(r) if reusable && r.same_as(&fresh) => r.clone(),
                Some(r) => {
                    fresh.inherit(r);
                    Arc::new(fresh)
                }
                None => Arc::new(fresh),
            }
        };
        let mut replicas: Vec<Arc<Replica>> =
            config.backends.iter().map(|b| place(b, None)).collect();
        // Replicas a discovery source found, while that source looks in the
        // same place (its next resolution or watch event adds and removes as
        // usual); their key and models are taken from the new config.
        let origins = origins(config);
        let same = |i: usize| {
            previous.is_some_and(|p| p.origins.get(i).is_some_and(|o| origins.get(i) == Some(o)))
        };
        for r in old.iter() {
            let Some(i) = r.source.filter(|&i| same(i)) else {
                continue;
            };
            let Ok(url) = r.base.parse::<url::Url>() else {
                continue;
            };
            let (Some(host), Some(port)) = (url.host_str(), url.port_or_known_default()) else {
                continue;
            };
            let dns = &config.discovery.dns;
            let b = match dns.get(i) {
                Some(src) => src.backend(host),
                None => config.discovery.kubernetes[i - dns.len()].backend(host, port),
            };
            if let Some(b) = b {
                replicas.push(place(&b, Some(i)));
            }
        }
        if previous.is_some() {
            let names: Vec<Arc<str>> = replicas.iter().map(|r| r.name.clone()).collect();
            metrics.retain_backends(&names);
        }
        let aliases = config
            .models
            .aliases
            .iter()
            .map(|(k, v)| (k.clone(), Arc::from(v.as_str())))
            .collect();
        let pool = Self {
            replicas: ArcSwap::from_pointee(replicas),
            aliases,
            index: ArcSwap::from_pointee(ModelIndex::default()),
            upstream: config.upstream.clone(),
            origins,
            declared: {
                let d = &config.discovery;
                let models = d.dns.iter().flat_map(|s| &s.models);
                models
                    .chain(d.kubernetes.iter().flat_map(|s| &s.models))
                    .map(|m| Arc::from(m.as_str()))
                    .collect()
            },
            metrics,
            company,
        };
        pool.rebuild_index();
        pool
    }

    /// This gateway is the only sender its replicas' engines show
    /// (`upstream::company`).
    pub fn alone(&self) -> bool {
        self.company.alone(Instant::now())
    }

    /// The current replicas (a snapshot; discovery may change the list).
    pub fn replicas(&self) -> Arc<Vec<Arc<Replica>>> {
        self.replicas.load_full()
    }

    /// Make the replicas of discovery source `source` exactly `wanted`, keeping
    /// the state (connections, health, circuit) of those that stay.
    /// Returns whether anything changed.
    pub(crate) fn sync_source(&self, source: usize, wanted: &[BackendConfig]) -> bool {
        let current = self.replicas();
        let mine: Vec<&Arc<Replica>> = current
            .iter()
            .filter(|r| r.source == Some(source))
            .collect();
        let same = mine.len() == wanted.len()
            && wanted
                .iter()
                .all(|b| mine.iter().any(|r| *r.name == *b.label()));
        if same {
            return false;
        }
        let mut next: Vec<Arc<Replica>> = current
            .iter()
            .filter(|r| r.source != Some(source))
            .cloned()
            .collect();
        for b in wanted {
            match mine.iter().find(|r| *r.name == *b.label()) {
                Some(r) => next.push((*r).clone()),
                None => next.push(Arc::new(
                    Replica::from_config(b, Some(source), &self.upstream, &self.metrics)
                        .with_company(&self.company),
                )),
            }
        }
        let names: Vec<Arc<str>> = next.iter().map(|r| r.name.clone()).collect();
        self.metrics.retain_backends(&names);
        self.replicas.store(Arc::new(next));
        self.rebuild_index();
        true
    }

    /// Recompute the model index from every replica's model list; a model
    /// seen for the first time gets its series at zero.
    pub(crate) fn rebuild_index(&self) {
        let mut by_model: HashMap<Arc<str>, Vec<Arc<Replica>>> = HashMap::new();
        for r in self.replicas().iter() {
            for m in r.models() {
                by_model.entry(m).or_default().push(r.clone());
            }
        }
        for m in &self.declared {
            by_model.entry(m.clone()).or_default();
        }
        for model in by_model.keys() {
            self.metrics.init_model(model);
        }
        self.index.store(Arc::new(ModelIndex { by_model }));
    }

    /// The served model name for what the client asked (aliases resolved) and the
    /// replicas that may take it: healthy and not ejected, or, if every healthy
    /// one is ejected, the ejected ones (a chance beats a certain 503). Unknown
    /// models are 404; known models with no healthy replica are 503.
    pub fn resolve(&self, requested: &str) -> Result<Candidates, GatewayError> {
        let index = self.index.load();
        let target = self
            .aliases
            .get(requested)
            .map(|a| a.as_ref())
            .unwrap_or(requested);
        let Some((name, replicas)) = index.by_model.get_key_value(target) else {
            return Err(GatewayError::ModelNotFound(requested.to_string()));
        };
        let usable = |r: &&Arc<Replica>| r.is_healthy() && r.circuit() != Circuit::Open;
        // Prefill replicas take no whole requests: only decode legs and mixed
        // ones are candidates; they prefill for them.
        let prefill: Vec<Arc<Replica>> = if replicas.iter().any(|r| r.role == Role::Prefill) {
            replicas
                .iter()
                .filter(|r| r.role.prefills())
                .filter(usable)
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        let healthy: Vec<Arc<Replica>> = replicas
            .iter()
            .filter(|r| r.is_healthy() && r.role.decodes())
            .cloned()
            .collect();
        if healthy.is_empty() {
            return Err(GatewayError::NoHealthyBackend(name.to_string()));
        }
        let open: Vec<Arc<Replica>> = healthy
            .iter()
            .filter(|r| r.circuit() != Circuit::Open)
            .cloned()
            .collect();
        let fallback = open.is_empty();
        Ok(Candidates {
            model: name.clone(),
            replicas: if fallback { healthy } else { open },
            fallback,
            prefill,
        })
    }

    /// Models of healthy replicas, plus aliases whose target is among them.
    pub(crate) fn served_models(&self) -> Vec<String> {
        let mut out = BTreeSet::new();
        for r in self.replicas().iter().filter(|r| r.is_healthy()) {
            out.extend(r.models().iter().map(|m| m.to_string()));
        }
        let aliases: Vec<String> = self
            .aliases
            .iter()
            .filter(|(_, target)| out.contains(target.as_ref()))
            .map(|(a, _)| a.clone())
            .collect();
        out.extend(aliases);
        out.into_iter().collect()
    }

    /// Gauges that depend on time or on the whole pool, brought up to date
    /// before `/metrics` is rendered: ejections that expired, healthy counts.
    /// The registry the pool's series live in.
    pub(crate) fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub(crate) fn refresh_metrics(&self) {
        let replicas = self.replicas();
        let mut healthy = 0;
        for r in replicas.iter() {
            r.series
                .ejected
                .set(i64::from(r.circuit() == Circuit::Open));
            healthy += i64::from(r.is_healthy());
        }
        self.metrics.backends_healthy.set(healthy);
        let index = self.index.load();
        let per_model = &self.metrics.model_replicas_healthy;
        per_model.retain(|(m,)| index.by_model.contains_key(m));
        for (model, rs) in &index.by_model {
            let n = rs.iter().filter(|r| r.is_healthy()).count();
            per_model
                .get(&(model.clone(),))
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    pub fn any_healthy(&self) -> bool {
        self.replicas().iter().any(|r| r.is_healthy())
    }
}

#[cfg(test)]
mod tests;
