//! The session table shared by several gateways through Redis
//! (`routing.sessions.store: redis`).
//!
//! Without it, gateways agree on a session's replica by computing the same
//! thing: the first replica alive in the session key's rendezvous order.
//! That is free, but it places sessions by their key's luck: with
//! heavy-tailed sessions on four replicas, one draw put 36% of the turns on
//! one replica (docs/BENCHMARKS.md, `sessions_heavy`). Placing new sessions
//! by load balances them, but a gateway meeting a session another gateway
//! placed by load cannot compute where it went. This table tells it.
//!
//! Per session one Redis string, `{key_prefix}:session:{key}` -> the
//! replica's name, expiring `routing.sessions.ttl` after its last turn:
//!
//! - a session this gateway does not know (or knows on a replica that is no
//!   longer a candidate), that carries an id or earlier turns, is looked up
//!   before routing ([`SharedSessions::find`], one `GET`
//!   on the request's path, bounded by `redis.timeout`); what it finds goes
//!   into the local table, and routing takes it from there as if this
//!   gateway had placed it;
//! - after routing ([`SharedSessions::record`], in the background, off the
//!   request's path): a session new to the table is claimed with
//!   `SET ... NX GET` (the first gateway to place a session decides; a
//!   gateway that loses the race adopts the winner's replica for the next
//!   turns), one that moved is written over, one that stayed has its expiry
//!   pushed back.
//!
//! Redis down or slow: lookups answer "unknown" after the timeout, the
//! session is placed as the policy would without the table (on a gateway
//! that never saw it: its history is not found, the one cost), and writes
//! are dropped; `sluice_routing_session_store_total{op,outcome}` counts both.
//! Replicas must have the same names on every gateway (the same `backends`
//! names, or the same DNS discovery).

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Cmd};

use super::affinity::Affinity;
use crate::config::{RedisConfig, SessionsConfig};
use crate::telemetry::metrics::Metrics;

pub struct SharedSessions {
    conn: ConnectionManager,
    prefix: String,
    timeout: Duration,
    ttl_ms: u64,
    /// What it was built from (a reload keeps it while equal).
    built: (RedisConfig, Duration),
    metrics: Arc<Metrics>,
}

/// What routing did with a session, for the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Write {
    /// New to the table: the first gateway to place it decides.
    Claim,
    /// It left the replica the table names.
    Move,
    /// It stayed: its expiry is pushed back.
    Touch,
}

impl SharedSessions {
    /// `None` with `store: memory`. Connects lazily: a Redis unreachable at
    /// start is handled as one that goes away later.
    /// (`keeps_sessions`: the routing policy keeps sessions; only
    /// `prefix_kv` does.)
    pub(crate) fn from_config(
        cfg: &SessionsConfig,
        keeps_sessions: bool,
        metrics: Arc<Metrics>,
        previous: Option<&Arc<SharedSessions>>,
    ) -> anyhow::Result<Option<Arc<Self>>> {
        if !cfg.enabled || cfg.store != crate::config::StoreKind::Redis || !keeps_sessions {
            return Ok(None);
        }
        let built = (cfg.redis.clone(), cfg.ttl);
        if let Some(p) = previous
            && p.built == built
        {
            return Ok(Some(p.clone()));
        }
        let client = Client::open(cfg.redis.url.expose())
            .map_err(|e| anyhow::anyhow!("routing.sessions.redis.url: {e}"))?;
        let conf = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(cfg.redis.timeout))
            .set_response_timeout(Some(cfg.redis.timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        let conn = ConnectionManager::new_lazy_with_config(client, conf)
            .map_err(|e| anyhow::anyhow!("routing.sessions.redis: {e}"))?;
        Ok(Some(Arc::new(Self {
            conn,
            prefix: cfg.redis.key_prefix.clone(),
            timeout: cfg.redis.timeout,
            ttl_ms: u64::try_from(cfg.ttl.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
            built,
            metrics,
        })))
    }

    fn key(&self, key: u64) -> String {
        format!("{}:session:{key:016x}", self.prefix)
    }

    fn count(&self, op: &'static str, outcome: &'static str) {
        self.metrics.session_store.get(&(op, outcome)).inc();
    }

    /// Where another gateway placed session `key` (`None`: nowhere, or the
    /// table could not say within `redis.timeout`).
    pub(crate) async fn find(&self, key: u64) -> Option<String> {
        let mut conn = self.conn.clone();
        let cmd = Cmd::get(self.key(key));
        let got: Result<Option<String>, _> =
            match tokio::time::timeout(self.timeout, cmd.query_async(&mut conn)).await {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(_) => Err("timed out".into()),
            };
        match got {
            Ok(Some(name)) => {
                self.count("find", "found");
                Some(name)
            }
            Ok(None) => {
                self.count("find", "absent");
                None
            }
            Err(e) => {
                self.count("find", "error");
                tracing::debug!(error = %e, "session store lookup failed");
                None
            }
        }
    }

    /// Before routing: session `key`, unknown to this gateway, is looked up
    /// and what the table says goes into the local table.
    pub(crate) async fn recall(&self, affinity: &Affinity, key: u64) {
        if let Some(name) = self.find(key).await {
            affinity
                .sessions
                .place(key, &Arc::from(name.as_str()), crate::turn::now_std());
        }
    }

    /// After routing: session `key` was on `before` (this gateway's table,
    /// with what `recall` found) and is on `after` now (`None`: the policy
    /// keeps no sessions). Written in the background.
    pub(crate) fn record(
        self: &Arc<Self>,
        affinity: &Arc<Affinity>,
        key: u64,
        before: Option<Arc<str>>,
        after: Option<Arc<str>>,
    ) {
        let Some(after) = after else {
            return;
        };
        let write = match before {
            None => Write::Claim,
            Some(b) if b != after => Write::Move,
            Some(_) => Write::Touch,
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let this = self.clone();
        let affinity = affinity.clone();
        rt.spawn(async move { this.write(&affinity, key, &after, write).await });
    }

    async fn write(&self, affinity: &Affinity, key: u64, replica: &Arc<str>, write: Write) {
        let k = self.key(key);
        let mut conn = self.conn.clone();
        let (op, result) = match write {
            Write::Claim => {
                let mut cmd = redis::cmd("SET");
                cmd.arg(&k)
                    .arg(&**replica)
                    .arg("NX")
                    .arg("GET")
                    .arg("PX")
                    .arg(self.ttl_ms);
                let r: Result<Option<String>, String> = self.query(cmd, &mut conn).await;
                ("claim", r.map(|old| old.filter(|o| **o != **replica)))
            }
            Write::Move => {
                let mut cmd = redis::cmd("SET");
                cmd.arg(&k).arg(&**replica).arg("PX").arg(self.ttl_ms);
                let r: Result<(), String> = self.query(cmd, &mut conn).await;
                ("move", r.map(|()| None))
            }
            Write::Touch => {
                let mut cmd = redis::cmd("PEXPIRE");
                cmd.arg(&k).arg(self.ttl_ms);
                let r: Result<i64, String> = self.query(cmd, &mut conn).await;
                match r {
                    // Gone from the table (expired there, or Redis lost it):
                    // written again.
                    Ok(0) => {
                        let mut cmd = redis::cmd("SET");
                        cmd.arg(&k)
                            .arg(&**replica)
                            .arg("NX")
                            .arg("PX")
                            .arg(self.ttl_ms);
                        let r: Result<Option<String>, String> = self.query(cmd, &mut conn).await;
                        ("touch", r.map(|_| None))
                    }
                    other => ("touch", other.map(|_| None)),
                }
            }
        };
        match result {
            Ok(None) => self.count(op, "ok"),
            Ok(Some(winner)) => {
                // Another gateway placed it first: its next turns go there.
                self.count(op, "taken");
                affinity
                    .sessions
                    .place(key, &Arc::from(winner.as_str()), crate::turn::now_std());
            }
            Err(e) => {
                self.count(op, "error");
                tracing::debug!(error = %e, op, "session store write failed");
            }
        }
    }

    async fn query<T: redis::FromRedisValue>(
        &self,
        cmd: Cmd,
        conn: &mut ConnectionManager,
    ) -> Result<T, String> {
        let started = Instant::now();
        let r = tokio::time::timeout(self.timeout * 4, cmd.query_async(conn)).await;
        match r {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err(format!("timed out after {:?}", started.elapsed())),
        }
    }
}
