//! The gateway's state: everything a request needs (`AppState`), and the
//! live pointer a config reload swaps (`Live`). Below the handlers, so they
//! and the router both build on it without importing each other.

use std::sync::Arc;

use sha2::Digest as _;

use arc_swap::ArcSwap;
use axum::extract::FromRequestParts;
use http::request::Parts;

use crate::config::Config;
use crate::error::GatewayError;
use crate::flow::Flow;
use crate::limits::Limiter;
use crate::routing::{self, Affinity, RoutingPolicy};
use crate::stream::signal::Signal;
use crate::telemetry::Telemetry;
use crate::telemetry::access_log::AccessLog;
use crate::telemetry::metrics::{KnownLabels, Metrics};
use crate::telemetry::traces::{Keep, Traces};
use crate::upstream::client::{HttpClient, build_client};
use crate::upstream::pool::Pool;

/// Everything a request needs, shared by all handlers.
pub struct AppState {
    pub config: Arc<Config>,
    pub pool: Arc<Pool>,
    pub client: HttpClient,
    pub policy: Arc<dyn RoutingPolicy>,
    pub metrics: Arc<Metrics>,
    /// Metrics, traces and the access log, for finished requests.
    pub telemetry: Arc<Telemetry>,
    /// What routing remembers per replica (prefix indexes).
    pub affinity: Arc<Affinity>,
    /// The session table shared with other gateways
    /// (`routing.sessions.store: redis`).
    pub shared_table: Option<Arc<crate::routing::shared_table::SharedTable>>,
    /// Cancelled when the drain deadline passes at shutdown: every stream
    /// still open then ends with an error event. Shared by every state.
    pub(crate) cut: Signal,
    /// Flow control: requests wait here while every replica is full.
    pub flow: Arc<Flow>,
    /// API keys and tier limits; `None` when the gateway is open.
    pub limiter: Option<Arc<Limiter>>,
    /// For the `created` field of `/v1/models`.
    pub started_unix: u64,
    /// The doctor's findings raised and not yet cleared (kept across
    /// reloads: a pathology does not end because the config changed).
    pub findings: Arc<crate::doctor::Held>,
    /// SHA-256 of the admin token (`server.admin_auth`), read at start and
    /// at each reload; `None`: the admin listener is open.
    pub admin_token: Option<[u8; 32]>,
}

impl AppState {
    pub(crate) fn new(config: Config) -> anyhow::Result<Arc<Self>> {
        Self::build(config, None)
    }

    /// The state for `config`; on a reload, `previous` hands over what must
    /// outlive it: the metric registry, replicas that stay (connections,
    /// health, prefix index, in-flight counts), the rate-limit store when its
    /// settings are unchanged (counters and concurrency slots carry on), and
    /// the trace exporter when tracing is unchanged, routing's per-replica
    /// memory while its capacity is unchanged. The access log is opened again
    /// (a rotated file is picked up).
    pub(crate) fn build(config: Config, previous: Option<&AppState>) -> anyhow::Result<Arc<Self>> {
        let metrics = match previous {
            Some(p) => p.metrics.clone(),
            None => Arc::new(Metrics::new(&config.telemetry.buckets)),
        };
        metrics.set_baseline(config.doctor.baseline);
        let limiter = Limiter::from_config(
            &config,
            metrics.clone(),
            previous.and_then(|p| p.limiter.as_deref()),
        )?;
        // Before the pool, whose replicas and models get their series then.
        metrics.know(known_labels(&config, limiter.is_some()));
        let traces = match previous {
            Some(p) if p.config.telemetry.tracing == config.telemetry.tracing => {
                p.telemetry.traces.clone()
            }
            _ => Traces::start(&config.telemetry.tracing, &metrics)?,
        };
        let telemetry = Arc::new(Telemetry {
            metrics: metrics.clone(),
            traces,
            access_log: AccessLog::open(&config.telemetry.access_log)?,
            refusal: crate::telemetry::quality::Refusal::from_config(
                &config.telemetry.quality.refusal,
            ),
        });
        // `https://` replicas: their trust and client certificate load.
        if config.backends.iter().any(|b| b.url.scheme() == "https") {
            crate::net::tls::shared_client(&config.upstream.tls)?;
        }
        let pool = Arc::new(Pool::new(
            &config,
            metrics.clone(),
            previous.map(|p| &*p.pool),
        ));
        // The client of health checks and scrapes, with its kept-alive
        // connections, unless its settings changed.
        let client = match previous {
            Some(p) if p.config.upstream == config.upstream => p.client.clone(),
            _ => build_client(&config.upstream),
        };
        let capacity = config.routing.prefix_kv.index_capacity;
        let s = &config.routing.sessions;
        let r = &config.routing.responses;
        let tables = ((s.max_sessions, s.ttl), (r.max_ids, r.ttl));
        let affinity = match previous {
            Some(p) if p.affinity.built_for(capacity, tables.0, tables.1) => p.affinity.clone(),
            _ => Affinity::new(capacity, tables.0, tables.1),
        };
        let policy = routing::build(&config.routing, affinity.clone());
        let shared_table = crate::routing::shared_table::SharedTable::from_config(
            &config.routing.sessions,
            config.routing.policy == crate::config::PolicyKind::PrefixKv,
            config.routing.prefix_kv.shared_homes,
            config
                .routing
                .prefix_kv
                .shared_homes_sampled
                .then_some(config.routing.prefix_kv.shared_homes_sampled_from),
            metrics.clone(),
            previous.and_then(|p| p.shared_table.as_ref()),
        )?;
        let cut = previous.map_or_else(Signal::default, |p| p.cut.clone());
        // Waiters and fairness carry over a reload, under the new rules.
        let flow = Arc::new(match previous {
            Some(p) => p.flow.reconfigured(&config),
            None => Flow::new(&config, metrics.clone()),
        });
        let started_unix = previous.map_or_else(
            || {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0)
            },
            |p| p.started_unix,
        );
        let findings = previous.map_or_else(crate::doctor::Held::new, |p| p.findings.clone());
        let admin_token = config
            .server
            .admin_auth
            .token()?
            .map(|t| <[u8; 32]>::from(sha2::Sha256::digest(t.expose().as_bytes())));
        Ok(Arc::new(Self {
            config: Arc::new(config),
            pool,
            client,
            policy,
            metrics,
            telemetry,
            affinity,
            shared_table,
            cut,
            flow,
            limiter,
            started_unix,
            findings,
            admin_token,
        }))
    }
}

/// The label values `config` makes known before any request (see
/// [`KnownLabels`]); `keys_checked`: the gateway has a rate limiter, so
/// requests carry their tier.
fn known_labels(config: &Config, keys_checked: bool) -> KnownLabels {
    let tiers = if keys_checked {
        config.tiers.keys().map(|t| Arc::from(t.as_str())).collect()
    } else {
        vec![Arc::from("")]
    };
    let rules = crate::flow::room::Rules::from_config(config);
    let failures = GatewayError::attempt_failures();
    let mut retry_kinds: Vec<&'static str> = failures
        .iter()
        .filter(|e| e.retryable())
        .map(GatewayError::kind)
        .collect();
    retry_kinds.dedup();
    let mut attempt_kinds: Vec<&'static str> = failures.iter().map(GatewayError::kind).collect();
    attempt_kinds.push(crate::error::STREAM_ERROR);
    KnownLabels {
        tiers,
        bands: rules.bands.iter().map(|b| rules.band_label(*b)).collect(),
        store: config.rate_limits.store.as_str(),
        attempt_kinds,
        retry_kinds,
        trace_reasons: Keep::ALL.iter().map(|k| k.as_str()).collect(),
    }
}

/// The gateway's live state, swapped whole by a config reload. A request
/// loads it once and keeps that snapshot to its end, so a reload never
/// changes a request midway: its stream keeps its replica, its limits and
/// its telemetry.
pub(crate) struct Live {
    current: ArcSwap<AppState>,
}

impl Live {
    pub(crate) fn new(state: Arc<AppState>) -> Arc<Self> {
        Arc::new(Self {
            current: ArcSwap::new(state),
        })
    }

    pub(crate) fn load(&self) -> Arc<AppState> {
        self.current.load_full()
    }

    pub(crate) fn store(&self, state: Arc<AppState>) {
        self.current.store(state);
    }
}

/// Extractor: the state current when the request arrived.
pub(crate) struct Current(pub Arc<AppState>);

impl FromRequestParts<Arc<Live>> for Current {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(_: &mut Parts, live: &Arc<Live>) -> Result<Self, Self::Rejection> {
        Ok(Current(live.load()))
    }
}
