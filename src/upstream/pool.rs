//! The replicas, what each serves, whether it is healthy, and how busy this
//! gateway keeps it.
//!
//! Read-mostly state (the model index) sits behind `ArcSwap`: a request takes a
//! snapshot without locking; the health loop publishes a new one when a
//! replica's model list or health changes.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::time::Instant;

use arc_swap::ArcSwap;
use http::HeaderValue;

use super::conn::ConnPool;
use crate::config::{BackendConfig, Config, UpstreamConfig};
use crate::error::GatewayError;
use crate::telemetry::metrics::{BackendSeries, Metrics};

/// What the last health check found.
#[derive(Debug, Clone, Default)]
pub struct Health {
    pub checked_at: Option<Instant>,
    pub models: Vec<Arc<str>>,
    pub last_error: Option<String>,
    pub consecutive_failures: u32,
}

pub struct Replica {
    pub name: Arc<str>,
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
    pub series: Arc<BackendSeries>,
}

impl Replica {
    pub fn from_config(b: &BackendConfig, up: &UpstreamConfig, metrics: &Metrics) -> Self {
        let name: Arc<str> = Arc::from(b.label());
        let base = b.url.as_str().trim_end_matches('/').to_string();
        let path_prefix = b.url.path().trim_end_matches('/').to_string();
        let host = b.url.host_str().unwrap_or("localhost");
        let port = b.url.port_or_known_default().unwrap_or(80);
        let authority = match b.url.port() {
            Some(p) => format!("{host}:{p}"),
            None => host.to_string(),
        };
        let conns = ConnPool::new(
            format!("{host}:{port}"),
            HeaderValue::from_str(&authority).unwrap_or(HeaderValue::from_static("localhost")),
            up.pool_max_idle_per_host,
            up.pool_idle_timeout,
            up.timeouts.connect,
        );
        let api_key = b
            .api_key
            .as_ref()
            .and_then(|k| HeaderValue::from_str(&format!("Bearer {}", k.expose())).ok())
            .map(|mut v| {
                v.set_sensitive(true);
                v
            });
        let series = metrics.backends.get(&(name.clone(),));
        Self {
            name,
            base,
            path_prefix,
            conns,
            api_key,
            static_models: b.models.iter().map(|m| Arc::from(m.as_str())).collect(),
            healthy: AtomicBool::new(false),
            in_flight: AtomicU32::new(0),
            health: ArcSwap::from_pointee(Health::default()),
            series,
        }
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Relaxed)
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Relaxed)
    }

    /// The models this replica serves: configured, or last discovered.
    pub fn models(&self) -> Vec<Arc<str>> {
        if self.static_models.is_empty() {
            self.health.load().models.clone()
        } else {
            self.static_models.clone()
        }
    }
}

/// RAII in-flight accounting: up in `new`, down in `Drop`, so a cancelled
/// request cannot leak a count.
pub struct InFlight(Arc<Replica>);

impl InFlight {
    pub fn new(r: Arc<Replica>) -> Self {
        r.in_flight.fetch_add(1, Relaxed);
        r.series.in_flight.inc();
        Self(r)
    }

    pub fn replica(&self) -> &Arc<Replica> {
        &self.0
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Relaxed);
        self.0.series.in_flight.dec();
    }
}

/// Immutable snapshot: which replicas serve which model.
#[derive(Default)]
pub struct ModelIndex {
    /// Served model name -> replicas (healthy or not).
    pub by_model: HashMap<Arc<str>, Vec<Arc<Replica>>>,
}

pub struct Pool {
    pub replicas: Vec<Arc<Replica>>,
    pub aliases: HashMap<String, Arc<str>>,
    index: ArcSwap<ModelIndex>,
}

impl Pool {
    pub fn new(config: &Config, metrics: &Metrics) -> Self {
        let replicas: Vec<Arc<Replica>> = config
            .backends
            .iter()
            .map(|b| Arc::new(Replica::from_config(b, &config.upstream, metrics)))
            .collect();
        let aliases = config
            .models
            .aliases
            .iter()
            .map(|(k, v)| (k.clone(), Arc::from(v.as_str())))
            .collect();
        let pool = Self {
            replicas,
            aliases,
            index: ArcSwap::from_pointee(ModelIndex::default()),
        };
        pool.rebuild_index();
        pool
    }

    /// Recompute the model index from every replica's model list.
    pub fn rebuild_index(&self) {
        let mut by_model: HashMap<Arc<str>, Vec<Arc<Replica>>> = HashMap::new();
        for r in &self.replicas {
            for m in r.models() {
                by_model.entry(m).or_default().push(r.clone());
            }
        }
        self.index.store(Arc::new(ModelIndex { by_model }));
    }

    /// The served model name for what the client asked (aliases resolved) and the
    /// healthy replicas serving it. Unknown models are 404; known models with no
    /// healthy replica are 503.
    pub fn resolve(&self, requested: &str) -> Result<(Arc<str>, Vec<Arc<Replica>>), GatewayError> {
        let index = self.index.load();
        let target = self
            .aliases
            .get(requested)
            .map(|a| a.as_ref())
            .unwrap_or(requested);
        let Some((name, replicas)) = index.by_model.get_key_value(target) else {
            return Err(GatewayError::ModelNotFound(requested.to_string()));
        };
        let healthy: Vec<Arc<Replica>> = replicas
            .iter()
            .filter(|r| r.is_healthy())
            .cloned()
            .collect();
        if healthy.is_empty() {
            return Err(GatewayError::NoHealthyBackend(name.to_string()));
        }
        Ok((name.clone(), healthy))
    }

    /// Models of healthy replicas, plus aliases whose target is among them.
    pub fn served_models(&self) -> Vec<String> {
        let mut out = BTreeSet::new();
        for r in self.replicas.iter().filter(|r| r.is_healthy()) {
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

    pub fn any_healthy(&self) -> bool {
        self.replicas.iter().any(|r| r.is_healthy())
    }
}
