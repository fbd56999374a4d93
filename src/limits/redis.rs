//! The shared store: every check and reservation of a request in one Lua
//! script, one round trip, on a multiplexed connection that reconnects by
//! itself. Time comes from Redis (`TIME`), so gateways with skewed clocks
//! still share one timeline. Keys carry a hash tag (`{bucket}`) so a bucket's
//! keys live on one Redis Cluster slot.

use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Script};

use super::gcra::Window;
use super::{Ask, Refusal, Settlement, Verdict};
use crate::config::RedisConfig;
use crate::vocab::LimitKind;

/// KEYS: requests TAT, tokens TAT, in-flight zset.
/// ARGV: req interval ms (0: no limit), req capacity, tok interval ms (0: no
/// limit), tok capacity, cost, concurrency (0: no limit), ticket, stale ms.
/// Returns {admitted, limit (0 none, 1 requests, 2 tokens, 3 concurrency),
/// retry_after ms, req remaining, req reset ms, tok remaining, tok reset ms}.
const ADMIT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local rT, rC = tonumber(ARGV[1]), tonumber(ARGV[2])
local tT, tC = tonumber(ARGV[3]), tonumber(ARGV[4])
local cost, conc = tonumber(ARGV[5]), tonumber(ARGV[6])
local function state(key) local v = tonumber(redis.call('GET', key) or now); if v < now then v = now end; return v end
local rtat, ttat = state(KEYS[1]), state(KEYS[2])
local function win(tat, T, C)
  if T == 0 then return -1, 0 end
  local used = tat - now
  return math.floor((C * T - used) / T), math.ceil(used)
end
local rrem, rres = win(rtat, rT, rC)
local trem, tres = win(ttat, tT, tC)
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[8]))
  if redis.call('ZCARD', KEYS[3]) >= conc then return {0, 3, 1000, rrem, rres, trem, tres} end
end
local rnew, tnew = rtat, ttat
if rT > 0 then
  rnew = rtat + rT
  local over = rnew - now - rC * rT
  if over > 0.000001 then return {0, 1, math.ceil(over), rrem, rres, trem, tres} end
end
if tT > 0 then
  tnew = ttat + cost * tT
  local over = tnew - now - tC * tT
  if over > 0.000001 then return {0, 2, math.ceil(over), rrem, rres, trem, tres} end
end
if rT > 0 then redis.call('SET', KEYS[1], tostring(rnew), 'PX', math.ceil(rnew - now) + 1000) end
if tT > 0 then redis.call('SET', KEYS[2], tostring(tnew), 'PX', math.ceil(tnew - now) + 1000) end
if conc > 0 then
  redis.call('ZADD', KEYS[3], now, ARGV[7])
  redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[8]))
end
rrem, rres = win(rnew, rT, rC)
trem, tres = win(tnew, tT, tC)
return {1, 0, 0, rrem, rres, trem, tres}
"#;

/// KEYS: tokens TAT, in-flight zset. ARGV: tok interval ms (0: none), delta
/// tokens, ticket, release (1/0).
const SETTLE: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local tT, delta = tonumber(ARGV[1]), tonumber(ARGV[2])
if tT > 0 and delta ~= 0 then
  local tat = tonumber(redis.call('GET', KEYS[1]) or now)
  tat = tat + delta * tT
  if tat < now then tat = now end
  if tat > now then redis.call('SET', KEYS[1], tostring(tat), 'PX', math.ceil(tat - now) + 1000)
  else redis.call('DEL', KEYS[1]) end
end
if ARGV[4] == '1' then redis.call('ZREM', KEYS[2], ARGV[3]) end
return 1
"#;

/// In-flight entries older than this are dropped (a gateway that died
/// mid-request must not hold a concurrency slot forever).
const STALE_IN_FLIGHT: Duration = Duration::from_secs(3600);

pub(super) struct RedisStore {
    conn: ConnectionManager,
    prefix: String,
    timeout: Duration,
    admit: Script,
    settle: Script,
}

#[derive(Debug)]
pub(super) struct StoreError(pub String);

impl RedisStore {
    /// Connects lazily: an unreachable Redis at start is handled like one that
    /// goes away later (per `on_store_error`), not as a startup failure.
    pub(super) fn new(cfg: &RedisConfig) -> anyhow::Result<Self> {
        let client = Client::open(cfg.url.expose())
            .map_err(|e| anyhow::anyhow!("rate_limits.redis.url: {e}"))?;
        let conf = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(cfg.timeout))
            .set_response_timeout(Some(cfg.timeout))
            .set_number_of_retries(1)
            .set_max_delay(Duration::from_secs(1));
        let conn = ConnectionManager::new_lazy_with_config(client, conf)
            .map_err(|e| anyhow::anyhow!("rate_limits.redis: {e}"))?;
        Ok(Self {
            conn,
            prefix: cfg.key_prefix.clone(),
            timeout: cfg.timeout,
            admit: Script::new(ADMIT),
            settle: Script::new(SETTLE),
        })
    }

    fn keys(&self, bucket: &str) -> [String; 3] {
        let b = format!("{}:{{{bucket}}}", self.prefix);
        [format!("{b}:r"), format!("{b}:t"), format!("{b}:c")]
    }

    pub(super) async fn admit(&self, ask: &Ask<'_>) -> Result<(Verdict, Duration), StoreError> {
        let [r, t, c] = self.keys(ask.bucket);
        let (rt, rc) = ask
            .requests
            .map_or((0.0, 0.0), |x| (x.interval_ms, x.capacity));
        let (tt, tc) = ask
            .tokens
            .map_or((0.0, 0.0), |x| (x.interval_ms, x.capacity));
        let mut inv = self.admit.prepare_invoke();
        inv.key(r).key(t).key(c);
        inv.arg(rt)
            .arg(rc)
            .arg(tt)
            .arg(tc)
            .arg(ask.cost)
            .arg(ask.concurrency.unwrap_or(0))
            .arg(ask.ticket)
            .arg(STALE_IN_FLIGHT.as_millis() as u64);
        let mut conn = self.conn.clone();
        let started = Instant::now();
        let out: Vec<i64> = tokio::time::timeout(self.timeout, inv.invoke_async(&mut conn))
            .await
            .map_err(|_| StoreError("timed out".into()))?
            .map_err(|e| StoreError(e.to_string()))?;
        let rtt = started.elapsed();
        let [admitted, limit, retry, rrem, rres, trem, tres] = out[..] else {
            return Err(StoreError(format!("unexpected script answer {out:?}")));
        };
        let win = |rate: Option<super::gcra::Rate>, rem: i64, res: i64| {
            rate.map(|x| Window {
                limit: x.capacity as u32,
                remaining: u32::try_from(rem.max(0)).unwrap_or(0),
                reset_ms: res.max(0) as f64,
            })
        };
        let requests = win(ask.requests, rrem, rres);
        let tokens = win(ask.tokens, trem, tres);
        let verdict = if admitted == 1 {
            Verdict::Admitted { requests, tokens }
        } else {
            let limit = match limit {
                1 => LimitKind::Requests,
                2 => LimitKind::Tokens,
                _ => LimitKind::Concurrency,
            };
            Verdict::Refused(Refusal {
                limit,
                retry_after_ms: retry as f64,
                requests,
                tokens,
            })
        };
        Ok((verdict, rtt))
    }

    pub(super) async fn settle(&self, s: &Settlement) -> Result<(), StoreError> {
        let [_, t, c] = self.keys(&s.bucket);
        let mut inv = self.settle.prepare_invoke();
        inv.key(t).key(c);
        inv.arg(s.tokens.map_or(0.0, |x| x.interval_ms))
            .arg(s.delta_tokens)
            .arg(s.ticket)
            .arg(if s.release { "1" } else { "0" });
        let mut conn = self.conn.clone();
        let _: i64 = tokio::time::timeout(self.timeout * 4, inv.invoke_async(&mut conn))
            .await
            .map_err(|_| StoreError("timed out".into()))?
            .map_err(|e| StoreError(e.to_string()))?;
        Ok(())
    }
}
