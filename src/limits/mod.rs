//! Tenants: who is calling (API keys, hashed), their tier's limits, and the
//! store that enforces them across gateway replicas.
//!
//! Per request: identify (before the body is read), then after the model is
//! known admit: one store call checks the concurrency, request and token
//! buckets together and reserves (prompt estimate + `max_tokens`) tokens; at
//! the end the reservation is settled with the real usage (refund or extra
//! charge) and the concurrency slot released, also when the client left.

pub(crate) mod gcra;
mod memory;
mod redis;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, header};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{ApiKey, Config, OnStoreError, RedisConfig, StoreKind, TierConfig};
use crate::error::GatewayError;
use crate::telemetry::metrics::Metrics;

/// Anthropic's key header, parsed once (not per request).
static X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
use crate::vocab::{LimitKind, Wire};
use gcra::{Rate, Window};
use memory::MemoryStore;
use redis::RedisStore;

/// A caller: the key's name (logs and traces only) and its tier (metrics too).
#[derive(Debug)]
pub(crate) struct Identity {
    pub name: Arc<str>,
    pub tier: Arc<str>,
}

/// One admission question to the store.
pub(crate) struct Ask<'a> {
    pub bucket: &'a str,
    pub requests: Option<Rate>,
    pub tokens: Option<Rate>,
    /// Tokens to reserve.
    pub cost: u32,
    pub concurrency: Option<u32>,
    /// Identifies this request's concurrency slot.
    pub ticket: u64,
}

pub(crate) enum Verdict {
    Admitted {
        requests: Option<Window>,
        tokens: Option<Window>,
    },
    Refused(Refusal),
}

pub(crate) struct Refusal {
    pub limit: LimitKind,
    pub retry_after_ms: f64,
    pub requests: Option<Window>,
    pub tokens: Option<Window>,
}

/// What to tell the store when a request ends.
#[derive(Debug, Clone)]
pub(crate) struct Settlement {
    pub bucket: String,
    pub tokens: Option<Rate>,
    pub ticket: u64,
    /// Real tokens minus reserved tokens (negative: refund).
    pub delta_tokens: i64,
    pub release: bool,
}

enum Store {
    Memory(MemoryStore),
    Redis(RedisStore),
}

/// The rate-limit headers of a response: OpenAI's `x-ratelimit-*`, or for
/// Messages Anthropic's `anthropic-ratelimit-*` (reset as an RFC 3339 time).
#[derive(Debug, Clone, Default)]
pub(crate) struct RateHeaders {
    pub requests: Option<Window>,
    pub tokens: Option<Window>,
}

impl RateHeaders {
    /// The headers as a map of their own (for a refusal), in both
    /// protocols' names: the response keeps those of its protocol.
    pub(crate) fn to_map(&self) -> HeaderMap {
        let mut h = HeaderMap::new();
        self.apply(&mut h);
        self.apply_anthropic(&mut h);
        h
    }

    /// The headers in `wire`'s names.
    pub(crate) fn apply_in(&self, wire: Wire, h: &mut HeaderMap) {
        match wire {
            Wire::Anthropic => self.apply_anthropic(h),
            _ => self.apply(h),
        }
    }

    fn apply_anthropic(&self, h: &mut HeaderMap) {
        let now = std::time::SystemTime::now();
        let mut put = |name: &'static str, v: String| {
            if let Ok(v) = HeaderValue::from_str(&v) {
                h.insert(name, v);
            }
        };
        let at = |ms: f64| {
            let ms = Duration::from_millis(ms.max(0.0).ceil() as u64);
            humantime::format_rfc3339_seconds(now + ms).to_string()
        };
        if let Some(w) = self.requests {
            put("anthropic-ratelimit-requests-limit", w.limit.to_string());
            put(
                "anthropic-ratelimit-requests-remaining",
                w.remaining.to_string(),
            );
            put("anthropic-ratelimit-requests-reset", at(w.reset_ms));
        }
        if let Some(w) = self.tokens {
            put("anthropic-ratelimit-tokens-limit", w.limit.to_string());
            put(
                "anthropic-ratelimit-tokens-remaining",
                w.remaining.to_string(),
            );
            put("anthropic-ratelimit-tokens-reset", at(w.reset_ms));
        }
    }

    fn apply(&self, h: &mut HeaderMap) {
        let mut put = |name: &'static str, v: String| {
            if let Ok(v) = HeaderValue::from_str(&v) {
                h.insert(name, v);
            }
        };
        if let Some(w) = self.requests {
            put("x-ratelimit-limit-requests", w.limit.to_string());
            put("x-ratelimit-remaining-requests", w.remaining.to_string());
            put("x-ratelimit-reset-requests", duration_string(w.reset_ms));
        }
        if let Some(w) = self.tokens {
            put("x-ratelimit-limit-tokens", w.limit.to_string());
            put("x-ratelimit-remaining-tokens", w.remaining.to_string());
            put("x-ratelimit-reset-tokens", duration_string(w.reset_ms));
        }
    }
}

/// A duration the way OpenAI writes reset times: `20ms`, `1s`, `1.5s`, `6m0s`, `1h2m3s`.
pub(crate) fn duration_string(ms: f64) -> String {
    let ms = ms.max(0.0);
    if ms < 1000.0 {
        return format!("{}ms", ms.ceil() as u64);
    }
    let total_s = ms / 1000.0;
    if total_s < 60.0 {
        let s = (total_s * 1000.0).ceil() / 1000.0;
        return format!("{}s", trim(s));
    }
    let whole = total_s.ceil() as u64;
    let (h, m, s) = (whole / 3600, (whole % 3600) / 60, whole % 60);
    if h > 0 {
        format!("{h}h{m}m{s}s")
    } else {
        format!("{m}m{s}s")
    }
}

fn trim(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The limits that apply to one (tier, model).
#[derive(Debug, Clone, Copy, Default)]
struct Limits {
    requests: Option<u32>,
    tokens: Option<u32>,
    concurrency: Option<u32>,
    max_tokens: Option<u32>,
}

/// Tokens reserved for the answer when neither the request nor the tier says.
pub(crate) const DEFAULT_RESERVED_OUTPUT: u32 = 1024;

pub struct Limiter {
    keys: HashMap<[u8; 32], Arc<Identity>>,
    anonymous: Option<Arc<Identity>>,
    tiers: HashMap<String, TierConfig>,
    /// Shared with the limiter a config reload replaces, when the store
    /// settings did not change: counters and concurrency slots carry on.
    store: Arc<Store>,
    /// The store settings (`rate_limits.store` and its Redis section).
    store_settings: (StoreKind, Option<RedisConfig>),
    store_name: &'static str,
    on_error: OnStoreError,
    metrics: Arc<Metrics>,
    failing: AtomicBool,
    tickets: AtomicU64,
}

impl Limiter {
    /// `None` when the config has no keys and no anonymous tier: the gateway
    /// is open and sends no rate-limit headers.
    /// `previous`: the limiter of the config being replaced, if any; its store
    /// is kept when the store settings are the same.
    pub(crate) fn from_config(
        cfg: &Config,
        metrics: Arc<Metrics>,
        previous: Option<&Limiter>,
    ) -> anyhow::Result<Option<Arc<Self>>> {
        let auth = &cfg.auth;
        let mut list: Vec<ApiKey> = auth.keys.clone();
        if let Some(path) = &auth.keys_file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("auth.keys_file {}: {e}", path.display()))?;
            let more: Vec<ApiKey> = serde_saphyr::from_str(&text)
                .map_err(|e| anyhow::anyhow!("auth.keys_file {}: {e}", path.display()))?;
            for (i, k) in more.iter().enumerate() {
                anyhow::ensure!(
                    cfg.tiers.contains_key(&k.tier),
                    "auth.keys_file {} entry {i}: no tier `{}`",
                    path.display(),
                    k.tier
                );
            }
            list.extend(more);
        }
        if list.is_empty() && auth.anonymous_tier.is_none() {
            return Ok(None);
        }
        let mut keys = HashMap::new();
        for k in &list {
            let digest: [u8; 32] = hex::decode(k.sha256.expose())
                .ok()
                .and_then(|v| v.try_into().ok())
                .ok_or_else(|| anyhow::anyhow!("key `{}`: sha256 is not 64 hex digits", k.name))?;
            keys.insert(
                digest,
                Arc::new(Identity {
                    name: Arc::from(k.name.as_str()),
                    tier: Arc::from(k.tier.as_str()),
                }),
            );
        }
        let anonymous = auth.anonymous_tier.as_ref().map(|t| {
            Arc::new(Identity {
                name: Arc::from("anonymous"),
                tier: Arc::from(t.as_str()),
            })
        });
        let rl = &cfg.rate_limits;
        let store_settings = (
            rl.store,
            (rl.store == StoreKind::Redis).then(|| rl.redis.clone()),
        );
        let store_name = rl.store.as_str();
        let store = match previous {
            Some(p) if p.store_settings == store_settings => p.store.clone(),
            _ => Arc::new(match rl.store {
                StoreKind::Memory => Store::Memory(MemoryStore::default()),
                StoreKind::Redis => Store::Redis(RedisStore::new(&rl.redis)?),
            }),
        };
        Ok(Some(Arc::new(Self {
            keys,
            anonymous,
            tiers: cfg.tiers.clone().into_iter().collect(),
            store,
            store_settings,
            store_name,
            on_error: cfg.rate_limits.on_store_error,
            metrics,
            failing: AtomicBool::new(false),
            tickets: AtomicU64::new(fastrand::u64(..)),
        })))
    }

    /// Who is calling, from `Authorization: Bearer KEY` or, as Anthropic
    /// clients send it, `x-api-key: KEY` (Authorization wins when both come).
    pub(crate) fn identify(
        &self,
        headers: &impl crate::headers::Lookup,
    ) -> Result<Arc<Identity>, GatewayError> {
        let key = match (
            headers.first(&header::AUTHORIZATION),
            headers.first(&X_API_KEY),
        ) {
            (Some(value), _) => crate::headers::text(value)
                .and_then(|v| {
                    let (scheme, key) = v.trim().split_once(' ')?;
                    scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
                })
                .filter(|k| !k.is_empty())
                .ok_or_else(|| {
                    GatewayError::Unauthorized(
                        "The Authorization header must be `Bearer KEY`.".into(),
                    )
                })?,
            (None, Some(value)) => crate::headers::text(value)
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .ok_or_else(|| {
                    GatewayError::Unauthorized("The x-api-key header is empty.".into())
                })?,
            (None, None) => {
                return self.anonymous.clone().ok_or_else(|| {
                    GatewayError::Unauthorized(
                        "You didn't provide an API key. Send it as `Authorization: Bearer KEY` \
                         (or `x-api-key: KEY`, as Anthropic clients do)."
                            .into(),
                    )
                });
            }
        };
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        // The map is keyed by digests: lookup timing reveals nothing usable
        // about a key. The final comparison is constant-time anyway.
        match self.keys.get_key_value(&digest) {
            Some((stored, id)) if bool::from(stored.ct_eq(&digest)) => Ok(id.clone()),
            _ => Err(GatewayError::Unauthorized(
                "Incorrect API key provided.".into(),
            )),
        }
    }

    fn limits(&self, id: &Identity, model: &str) -> (String, Limits) {
        let Some(tier) = self.tiers.get(&*id.tier) else {
            return (id.name.to_string(), Limits::default());
        };
        match tier.models.get(model) {
            Some(m) => (
                format!("{}/{model}", id.name),
                Limits {
                    requests: m.requests_per_minute,
                    tokens: m.tokens_per_minute,
                    concurrency: m.concurrent_requests,
                    max_tokens: m.max_tokens.or(tier.max_tokens),
                },
            ),
            None => (
                id.name.to_string(),
                Limits {
                    requests: tier.requests_per_minute,
                    tokens: tier.tokens_per_minute,
                    concurrency: tier.concurrent_requests,
                    max_tokens: tier.max_tokens,
                },
            ),
        }
    }

    /// The largest `max_tokens` this caller may ask of `model`.
    pub(crate) fn max_tokens_cap(&self, id: &Identity, model: &str) -> Option<u32> {
        self.limits(id, model).1.max_tokens
    }

    /// Check and reserve. `max_tokens` is the request's, after the cap.
    pub(crate) async fn admit(
        self: &Arc<Self>,
        id: &Arc<Identity>,
        model: &str,
        prompt_estimate: u32,
        max_tokens: Option<u32>,
    ) -> Result<Admission, GatewayError> {
        let (bucket, l) = self.limits(id, model);
        let reserved =
            prompt_estimate.saturating_add(max_tokens.unwrap_or(DEFAULT_RESERVED_OUTPUT));
        let ticket = self.tickets.fetch_add(1, Relaxed);
        let (requests_rate, tokens_rate) = (
            l.requests.map(Rate::per_minute),
            l.tokens.map(Rate::per_minute),
        );
        let cost = if l.tokens.is_some() { reserved } else { 0 };
        let ask = Ask {
            bucket: &bucket,
            requests: requests_rate,
            tokens: tokens_rate,
            cost,
            concurrency: l.concurrency,
            ticket,
        };
        let verdict = match &*self.store {
            Store::Memory(m) => {
                let t = std::time::Instant::now();
                let v = m.admit(&ask);
                self.metrics
                    .ratelimit_store_seconds
                    .observe_duration(t.elapsed());
                Ok(v)
            }
            Store::Redis(r) => r.admit(&ask).await.map(|(v, rtt)| {
                self.metrics.ratelimit_store_seconds.observe_duration(rtt);
                v
            }),
        };
        let verdict = match verdict {
            Ok(v) => {
                if self.failing.swap(false, Relaxed) {
                    tracing::info!(store = self.store_name, "rate-limit store reachable again");
                }
                v
            }
            Err(e) => return self.store_down(id, &e.0),
        };
        let tier = id.tier.clone();
        match verdict {
            Verdict::Admitted { requests, tokens } => {
                self.count(&tier, "", "admitted");
                Ok(Admission {
                    limiter: Some(self.clone()),
                    settlement: Some(Settlement {
                        bucket,
                        tokens: tokens_rate,
                        ticket,
                        delta_tokens: 0,
                        release: l.concurrency.is_some(),
                    }),
                    reserved: cost,
                    headers: RateHeaders { requests, tokens },
                })
            }
            Verdict::Refused(r) => {
                self.count(&tier, r.limit.as_str(), "rejected");
                let wait = Duration::from_secs_f64((r.retry_after_ms / 1000.0).max(0.001));
                let message = match r.limit {
                    LimitKind::Requests => format!(
                        "Rate limit reached for requests per min (RPM) on tier `{tier}`: limit {}. Please try again in {}.",
                        l.requests.unwrap_or(0),
                        duration_string(r.retry_after_ms)
                    ),
                    LimitKind::Tokens if reserved > l.tokens.unwrap_or(0) => format!(
                        "Request too large for tokens per min (TPM) on tier `{tier}`: limit {}, requested {reserved} (prompt estimate + max_tokens). Lower max_tokens.",
                        l.tokens.unwrap_or(0)
                    ),
                    LimitKind::Tokens => format!(
                        "Rate limit reached for tokens per min (TPM) on tier `{tier}`: limit {}, requested {reserved}. Please try again in {}.",
                        l.tokens.unwrap_or(0),
                        duration_string(r.retry_after_ms)
                    ),
                    LimitKind::Concurrency => format!(
                        "Too many concurrent requests on tier `{tier}`: limit {}. Please try again when one finishes.",
                        l.concurrency.unwrap_or(0)
                    ),
                };
                Err(GatewayError::RateLimited {
                    limit: r.limit,
                    message,
                    retry_after: wait,
                    headers: RateHeaders {
                        requests: r.requests,
                        tokens: r.tokens,
                    }
                    .to_map()
                    .into(),
                })
            }
        }
    }

    fn store_down(&self, id: &Identity, err: &str) -> Result<Admission, GatewayError> {
        self.metrics
            .ratelimit_store_errors
            .get(&(self.store_name,))
            .inc();
        if !self.failing.swap(true, Relaxed) {
            tracing::warn!(
                store = self.store_name,
                error = err,
                policy = ?self.on_error,
                "rate-limit store unreachable"
            );
        }
        match self.on_error {
            OnStoreError::FailOpen => {
                self.count(&id.tier, "", "admitted_store_down");
                Ok(Admission::unlimited())
            }
            OnStoreError::FailClosed => {
                self.count(&id.tier, "", "rejected_store_down");
                Err(GatewayError::RateLimitUnavailable)
            }
        }
    }

    fn count(&self, tier: &Arc<str>, limit: &'static str, decision: &'static str) {
        self.metrics
            .ratelimit_decisions
            .get(&(tier.clone(), limit, decision))
            .inc();
    }

    /// Settle and wait for the store (tests compare the stores step by step).
    #[cfg(test)]
    async fn settle_now(&self, s: &Settlement) {
        match &*self.store {
            Store::Memory(m) => m.settle(s),
            Store::Redis(r) => {
                if let Err(e) = r.settle(s).await {
                    panic!("settling in Redis: {}", e.0);
                }
            }
        }
    }

    fn settle(self: &Arc<Self>, s: Settlement) {
        match &*self.store {
            Store::Memory(m) => m.settle(&s),
            Store::Redis(_) => {
                // Settling must not hold up the response; it runs on its own.
                let me = self.clone();
                tokio::spawn(async move {
                    if let Store::Redis(r) = &*me.store
                        && let Err(e) = r.settle(&s).await
                    {
                        me.metrics
                            .ratelimit_store_errors
                            .get(&(me.store_name,))
                            .inc();
                        tracing::debug!(error = %e.0, "rate-limit settlement failed");
                    }
                });
            }
        }
    }
}

/// A granted request's reservation. [`Admission::finish`] settles it; if it
/// is dropped unfinished the reservation stands and the slot is released.
pub(crate) struct Admission {
    limiter: Option<Arc<Limiter>>,
    settlement: Option<Settlement>,
    /// Tokens reserved at admission.
    pub reserved: u32,
    pub headers: RateHeaders,
}

impl Admission {
    /// No limits apply (store down, failing open).
    pub(crate) fn unlimited() -> Self {
        Self {
            limiter: None,
            settlement: None,
            reserved: 0,
            headers: RateHeaders::default(),
        }
    }

    /// Whether this admission bypassed the limits (store down, failing open).
    pub(crate) fn is_unlimited(&self) -> bool {
        self.limiter.is_none()
    }

    /// Settle with the tokens really used (for Redis, without waiting).
    pub(crate) fn finish(&mut self, used_tokens: u32) {
        if let Some((l, s)) = self.settlement(used_tokens) {
            l.settle(s);
        }
    }

    /// What settling with `used_tokens` tells the store (once).
    fn settlement(&mut self, used_tokens: u32) -> Option<(Arc<Limiter>, Settlement)> {
        let (l, mut s) = (self.limiter.take()?, self.settlement.take()?);
        if s.tokens.is_some() {
            s.delta_tokens = i64::from(used_tokens) - i64::from(self.reserved);
        }
        Some((l, s))
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if let (Some(l), Some(s)) = (self.limiter.take(), self.settlement.take()) {
            l.settle(s);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
