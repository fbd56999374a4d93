//! The routing table shared by several gateways through Redis
//! (`routing.sessions.store: redis`): where each session lives, and where
//! each shared prefix is homed.
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
//!   before routing ([`SharedTable::find`], one `GET`
//!   on the request's path, bounded by `redis.timeout`); what it finds goes
//!   into the local table, and routing takes it from there as if this
//!   gateway had placed it;
//! - after routing ([`SharedTable::record`], in the background, off the
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
//!
//! **Prefix homes** (`routing.prefix_kv.shared_homes`, on by default). Each
//! gateway places a new shared prefix on the replica holding least in its
//! own index (`prefix_kv`), and its index holds only what it sent: through
//! three gateways behind a load balancer they placed a prompt on different
//! replicas, each cache then had to hold every prompt and thrashed (16
//! system prompts on four small caches: TTFT p99 80 -> 12,411 ms, prefix
//! hit 97.6% -> 57.6%; docs/BENCHMARKS.md). So the first gateway to meet a
//! prefix places it here, and the others find it:
//!
//! - a prompt whose home prefix no candidate holds in this gateway's index
//!   ([`crate::routing::RoutingPolicy::new_home`]) is looked up before
//!   routing, on the request's path (one script, bounded by
//!   `redis.timeout`): a home the table has is where routing sends it as if
//!   this gateway held it there; a prefix the table lacks is placed by the
//!   script on the candidate with the fewest prefixes homed by every gateway,
//!   then the fewest new homes' cold prefills under way (a sorted set per
//!   replica, `{key_prefix}:cold:{<model>/<pool>}:<replica>`: counted from
//!   placement to the first token, [`ColdMark`]; ties in this gateway's own
//!   order: fewer prompts queued, less work, the prefix's rendezvous order),
//!   atomically, so two gateways meeting a new prefix at once place it
//!   alike, and a new prefix does not join another gateway's cold prefill
//!   where a replica with as few homes has none (8 such of 160 new homes
//!   before, 1 after: docs/benchmarks-log.md, "2026-12-02 (evening)");
//! - a new home's cold prefill placed for a stream can be waited for by the
//!   other gateways (`routing.prefix_kv.hold_for_prefill`, as a gateway
//!   waits for its own: `routing::prefilling`): beside its count the placing
//!   script writes the block a prompt must share with it
//!   (`{key_prefix}:reach:{<model>/<pool>}:<key>`), the lookup of a gateway
//!   that finds the home answers it while the count is on, and that gateway
//!   waits until the count leaves the set (the first token; where the
//!   attempt ended without one, its reach then reads `ended`), at most
//!   until it runs out ([`UnderWay`]);
//! - after routing, in the background: a prefix routed by its prefix to a
//!   holder pushes its home's expiry back (at most once a quarter of
//!   [`HOME_TTL`] per prefix and gateway), and where the table names another
//!   home (another gateway moved it, or this one spilled from a full home
//!   and made a holder of its own) this gateway forgets its holder, so that
//!   its next request is looked up; one this gateway moves (`rehome`) or
//!   places itself (the table did not answer) is written over. Retries and
//!   decisions a session made write nothing;
//! - a gateway whose new prompts of a model and pool share nothing with the
//!   table (`routing.prefix_kv.shared_homes_sampled_from`, a thousand by
//!   default, and more in 5-10 s, none found homed elsewhere:
//!   all-distinct prompts) looks up only the prefixes whose key is a
//!   multiple of [`NOVEL_SAMPLE`] and places the others as without the
//!   table, writing nothing for them ([`Novelty`]); one used again is
//!   written by its touch, and a home found elsewhere ends it (unless
//!   `routing.prefix_kv.shared_homes_sampled: false`: every one looked up).
//!
//! Per prefix and pool (`serve`, `decode`, `prefill`: a disaggregated
//! request's legs have homes of their own) one string,
//! `{key_prefix}:home:{<model>/<pool>}:<key>` -> the replica, and per
//! replica a sorted set of the prefixes homed there,
//! `{key_prefix}:homes:{<model>/<pool>}:<replica>`, scored by last use; both
//! forget a prefix unused for [`HOME_TTL`]. Redis down or slow: the prefix
//! is placed as without the table (and for [`PAUSE`] after a failed lookup,
//! without asking); `sluice_routing_home_store_total{op,outcome}` counts
//! lookups and writes.
//!
//! Replicas must have the same names on every gateway (the same `backends`
//! names, or the same DNS discovery).

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Cmd};

use redis::Script;

use super::affinity::Affinity;
use super::prefilling::HoldOutcome;
use super::sessions::Sessions;
use crate::config::{RedisConfig, SessionsConfig};
use crate::telemetry::metrics::Metrics;

/// A prefix's home unused this long is forgotten (as each gateway forgets a
/// replica's index when it is unused this long: `affinity::FORGET_AFTER`).
pub(crate) const HOME_TTL: Duration = super::affinity::FORGET_AFTER;

/// Prefixes whose home's expiry this gateway pushed back lately, each
/// counted for a quarter of [`HOME_TTL`] (beyond that many, the least
/// recently pushed are forgotten and pushed again).
const TOUCHED: usize = 65_536;

/// Places, finds and keeps prefix homes, atomically.
/// KEYS[1]: the prefix's home; KEYS[2]: its cold prefill's reach, where
/// other gateways may wait for it; KEYS[2 + i] and KEYS[2 + n + i]: the
/// prefixes homed on, and the cold prefills counted on, candidate i (of n,
/// named ARGV[5 + i]). ARGV[1]: `place`, `touch` or `move`; ARGV[2]: the
/// homes' time to live in ms; ARGV[3]: for `place`, how many of the
/// candidates (the first) a new home may go to, then, after a colon, how
/// many after those were left out only for their engine's queue at its last
/// scrapes (`<open>:<queued>`), else the replica; ARGV[4]:
/// for `place`, how long a new home's cold prefill is counted at most, in
/// ms (0: not counted); ARGV[5]: for `place`, the block that a request must
/// share with the placing one to wait for its cold prefill (`<index>:<hash>`,
/// [`crate::routing::prefilling::reach`]), or empty where none may (the
/// placing gateway would not see the first token: not a stream);
/// ARGV[6..]: the candidates, those a new home may go to first, in the
/// placing gateway's order. Returns `{replica, 1 if written there now else
/// 0, ms, reach}`: `place` answers the home (found, or new on the candidate
/// with the fewest homes, then the fewest cold prefills under way, the
/// earlier of equals, among the open ones and those queued ones with at
/// least two cold prefills fewer under way than every open one, and counts
/// the new home's cold prefill there), and
/// for a home found whose cold prefill another gateway has under way and
/// may be waited for, how long it is counted still and its reach (else 0
/// and empty); `touch` keeps the replica's home (or writes it where there
/// is none) and answers another home where there is one; `move` writes it
/// over (and the old home counts its cold prefill no more).
const HOMES: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local n = #ARGV - 5
local home = redis.call('GET', KEYS[1])
local function at(name)
  for i = 1, n do
    if ARGV[5 + i] == name then return i end
  end
end
local function hold(name)
  redis.call('SET', KEYS[1], name, 'PX', ttl)
  local i = at(name)
  if i then
    redis.call('ZADD', KEYS[2 + i], now, KEYS[1])
    redis.call('PEXPIRE', KEYS[2 + i], ttl)
  end
end
if ARGV[1] == 'place' then
  if home then
    hold(home)
    local i = at(home)
    if i then
      local ends = tonumber(redis.call('ZSCORE', KEYS[2 + n + i], KEYS[1]))
      local reach = redis.call('GET', KEYS[2])
      if ends and ends > now and reach then
        return {home, 0, ends - now, reach}
      end
    end
    return {home, 0, 0, ''}
  end
  local open = tonumber(string.match(ARGV[3], '^%d+'))
  local queued = tonumber(string.match(ARGV[3], ':(%d+)$') or '0')
  local hs, ks, least = {}, {}, nil
  for i = 1, open + queued do
    local z, c = KEYS[2 + i], KEYS[2 + n + i]
    redis.call('ZREMRANGEBYSCORE', z, '-inf', now - ttl)
    redis.call('ZREMRANGEBYSCORE', c, '-inf', now)
    hs[i], ks[i] = redis.call('ZCARD', z), redis.call('ZCARD', c)
    if i <= open and (not least or ks[i] < least) then least = ks[i] end
  end
  local best, fewest, coldest
  for i = 1, open + queued do
    if i <= open or ks[i] + 2 <= least then
      local h, k = hs[i], ks[i]
      if not fewest or h < fewest or (h == fewest and k < coldest) then
        best, fewest, coldest = i, h, k
      end
    end
  end
  hold(ARGV[5 + best])
  local cold = tonumber(ARGV[4])
  if cold > 0 then
    redis.call('ZADD', KEYS[2 + n + best], now + cold, KEYS[1])
    redis.call('PEXPIRE', KEYS[2 + n + best], cold)
    if ARGV[5] ~= '' then
      redis.call('SET', KEYS[2], ARGV[5], 'PX', cold)
    else
      redis.call('DEL', KEYS[2])
    end
  end
  return {ARGV[5 + best], 1, 0, ''}
end
if home and home ~= ARGV[3] then
  if ARGV[1] == 'touch' then
    return {home, 0, 0, ''}
  end
  local i = at(home)
  if i then
    redis.call('ZREM', KEYS[2 + i], KEYS[1])
    redis.call('ZREM', KEYS[2 + n + i], KEYS[1])
    redis.call('DEL', KEYS[2])
  end
end
hold(ARGV[3])
return {ARGV[3], 1, 0, ''}
"#;

/// The hash of a prompt's home prefix: its `home_blocks`-th block, or the
/// last of a shorter prompt (`None`: no block).
pub(crate) fn home_key(hashes: &[u64], home_blocks: usize) -> Option<u64> {
    hashes
        .get(home_blocks.min(hashes.len()).wrapping_sub(1))
        .copied()
}

/// After a prefix lookup failed, lookups are skipped this long (the prefix
/// is placed as without the table).
const PAUSE: Duration = Duration::from_secs(2);

/// The default of `routing.prefix_kv.shared_homes_sampled_from`
/// ([`crate::config::SHARED_HOMES_SAMPLED_FROM`]), which the tests use.
#[cfg(test)]
const NOVEL_FROM: u64 = crate::config::SHARED_HOMES_SAMPLED_FROM;

/// While a model's new prompts share nothing with the table, the prefixes
/// whose key is a multiple of this are still looked up (the others are
/// placed as without the table, and not written). By key, not by count:
/// every gateway samples the same prefixes, so a prefix that two gateways
/// meet is found by the second with that chance, not its square.
const NOVEL_SAMPLE: u64 = 16;

/// Whether this gateway's prompts of a model and pool lately share nothing
/// with the table: many new prompts (`routing.prefix_kv.shared_homes_sampled_from`), none of them found
/// homed elsewhere (a lookup that found one placed before, or a touch that
/// found the home elsewhere). On prompts that share nothing, every request
/// is such a prompt, and its lookup and its cold mark's clear are two Redis
/// calls for nothing: with them a CPU-bound gateway served 0.73-0.74x the
/// requests of one without (0.98x with this; docs/BENCHMARKS.md). There all but one in
/// [`NOVEL_SAMPLE`] (by key) are placed as without the table and not
/// written; a prefix among them that is used again is written by its first
/// touch (where the table has no home for it), and one found homed
/// elsewhere ends the sampling at once. The cost: a prefix that another
/// gateway meets while both sample is placed by each on its own until one
/// touch finds the other's home (a cold prefill more): where shared prefixes
/// came as a trickle among 220 new prompts a second per gateway, 62% of a
/// reused prefix's later uses met on its first replica against 100% with
/// every lookup (docs/BENCHMARKS.md), hence the switch
/// (`routing.prefix_kv.shared_homes_sampled: false`).
#[derive(Default)]
struct Novelty {
    /// New prompts met (looked up or not).
    new: super::load::Recent,
    /// Of those, and of touches, homes found placed before or elsewhere.
    found: super::load::Recent,
}

impl Novelty {
    /// (`from`: `routing.prefix_kv.shared_homes_sampled_from`.)
    fn sampling(&self, now: Instant, from: u64) -> bool {
        self.found.get(now) == 0 && self.new.get(now) >= from
    }
}

/// A new home's cold prefill is counted on its replica until its first
/// token, its attempt's end, or at the latest this long (its gateway died:
/// a stale count only breaks ties between replicas with equal homes, the
/// longest a prompt waits for its first token before the gateway's
/// deadlines give up on it is of this order).
const COLD_FOR: Duration = Duration::from_secs(30);

/// A prefix's decision, for the table.
pub(crate) struct HomeAt<'a> {
    pub(crate) model: &'a str,
    pub(crate) leg: Leg,
    /// Its home prefix's hash, and its blocks (forgotten on `replica` when
    /// the table says its home is elsewhere).
    pub(crate) key: u64,
    pub(crate) blocks: &'a [u64],
    pub(crate) replica: &'a Arc<str>,
}

/// Which of a model's decisions a prefix home is for: a disaggregated
/// request's prefill and decode legs are placed in their own pools, apart
/// from a request served whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Leg {
    Serve,
    Decode,
    Prefill,
}

impl Leg {
    fn as_str(self) -> &'static str {
        match self {
            Leg::Serve => "serve",
            Leg::Decode => "decode",
            Leg::Prefill => "prefill",
        }
    }
}

/// What the table said of a prefix new to this gateway.
#[derive(Debug, Clone)]
pub(crate) struct TableHome {
    pub(crate) replica: Arc<str>,
    /// Placed by this lookup (else another gateway placed it).
    pub(crate) new: bool,
    /// A new home's cold prefill, counted on `replica` by every gateway's
    /// placing until the request sent there has its first token (then
    /// [`ColdMark::prefilled`]; see [`TableHome::cold_on`]).
    cold: Option<Arc<ColdMark>>,
    /// A home found with its cold prefill under way, placed by another
    /// gateway that sees its first token ([`TableHome::prefill_on`]).
    under_way: Option<UnderWay>,
}

/// Another gateway's cold prefill of a prefix under way on its home, as the
/// table counts it ([`ColdMark`]): a request of this gateway sent there
/// before its first token would compute the prompt again on an engine that
/// shares a prompt only once its prefill has run (`routing::prefilling`).
/// Through three gateways each gateway's first request of a new prefix did
/// so (docs/BENCHMARKS.md, `few_keys_tight_3gw` with the hold: each gateway
/// held only for its own prefills).
#[derive(Clone)]
pub(crate) struct UnderWay {
    table: Arc<SharedTable>,
    set: String,
    member: String,
    /// Its reach's key ([`ENDED`] once it ended without a first token).
    reach_key: String,
    /// The block a prompt must share with it to wait for it: its index and
    /// hash ([`crate::routing::prefilling::reach`]).
    reach: (usize, u64),
    /// When the table stops counting it (its gateway died, or it is that
    /// slow): waiting ends then.
    until: Instant,
}

/// How often a wait for another gateway's prefill asks the table whether
/// it is done (one `ZSCORE`; a wait's first token comes at most this much
/// after the prefill's). A poll, not Redis pub/sub: only one request per
/// prefix and gateway waits on the table (the gateway's later requests
/// wait for that one, `routing::prefilling`), a cold prefill lasts tens to
/// hundreds of milliseconds, and a poll needs no connection of its own to
/// keep subscribed, nor any notice lost while one reconnects.
const WATCH_EVERY: Duration = Duration::from_millis(5);

impl UnderWay {
    /// The blocks a prompt waiting for it shares with it, at least.
    pub(crate) fn shared_blocks(&self) -> usize {
        self.reach.0 + 1
    }

    /// Waits until the prefill's first token (its count leaves the table),
    /// its attempt's end without one (its count leaves, its reach
    /// [`ENDED`]), or the count's or `deadline`'s end, whichever is first. A table that does not
    /// answer ends the wait as `Ended` (the request goes as if nothing
    /// were under way).
    pub(crate) async fn wait(&self, deadline: tokio::time::Instant) -> HoldOutcome {
        let until = tokio::time::Instant::from_std(self.until).min(deadline);
        let mut every = tokio::time::interval(WATCH_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut conn = self.table.conn.clone();
        loop {
            if tokio::time::timeout_at(until, every.tick()).await.is_err() {
                return HoldOutcome::Deadline;
            }
            let mut pipe = redis::pipe();
            pipe.cmd("ZSCORE")
                .arg(&self.set)
                .arg(&self.member)
                .cmd("GET")
                .arg(&self.reach_key);
            let r: Result<(Option<f64>, Option<String>), String> =
                self.table.query_pipe(pipe, &mut conn).await;
            match r {
                Ok((None, Some(r))) if r == ENDED => return HoldOutcome::Ended,
                Ok((None, _)) => return HoldOutcome::Prefilled,
                Ok((Some(_), _)) => {}
                Err(e) => {
                    self.table.count_home("watch", "error");
                    tracing::debug!(error = %e, "watching a prefill under way failed");
                    return HoldOutcome::Ended;
                }
            }
        }
    }
}

/// A new home's cold prefill as the table counts it on its replica (the
/// placing script's tie between replicas with equal homes: through one
/// gateway a new prompt goes, among those, where no prompt like it is being
/// prefilled, which that gateway knows of every prompt it sent; through
/// several, each knew only its own, and cold prefills queued behind one
/// another's: docs/benchmarks-log.md, "Where three gateways' cold-start
/// tail comes from"). Cleared once, in the background: at the first token
/// of the request sent there ([`ColdMark::prefilled`]), when its attempt
/// ends without one, when the request went elsewhere, or when dropped (a
/// non-streamed answer's first token is its end; SGLang's disaggregation
/// protocol: at the prefill replica's answer). A streamed request's mark,
/// which other gateways wait on ([`UnderWay`]), ending without a first
/// token also sets its reach to [`ENDED`], so that they know the prompt is
/// not cached there after all.
pub(crate) struct ColdMark {
    table: Arc<SharedTable>,
    /// The replica's sorted set, and the prefix's member in it.
    set: String,
    member: String,
    /// Its reach's key, where other gateways may wait for it ([`HOMES`]'
    /// KEYS[2]).
    reach: Option<String>,
    cleared: std::sync::atomic::AtomicBool,
}

/// How a cold prefill's wait for its turn ended ([`ColdMark::turn`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Turn {
    /// At the first asking: nothing to wait for.
    Now,
    /// After waiting.
    Came,
    /// Its deadline came first, or the table did not answer: it goes.
    GaveUp,
}

/// A cold prefill's reach once its attempt ended without a first token.
const ENDED: &str = "ended";

/// The cold prefills counted on a replica (KEYS[1], its sorted set) that
/// were placed before ARGV[1] (a member) and still count: scored between
/// now and its score. -1 where it is no longer counted.
const AHEAD: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local mine = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not mine then return -1 end
return redis.call('ZCOUNT', KEYS[1], '(' .. now, '(' .. mine)
"#;

impl ColdMark {
    /// Waits until at most `beside` of the cold prefills placed on its
    /// replica before this one, by any gateway, are still before their first
    /// tokens (`routing::cold_gate`, through several gateways), asking the
    /// table every [`WATCH_EVERY`], at most until `deadline`.
    pub(crate) async fn turn(&self, beside: u64, deadline: tokio::time::Instant) -> Turn {
        let mut every = tokio::time::interval(WATCH_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // (The first tick is at once.)
        every.tick().await;
        let mut conn = self.table.conn.clone();
        let mut asked = 0u32;
        loop {
            let mut inv = self.table.ahead.prepare_invoke();
            inv.key(&self.set).arg(&self.member);
            let r: Result<i64, String> = self.table.bounded(inv.invoke_async(&mut conn)).await;
            asked += 1;
            match r {
                Ok(n) if n <= i64::try_from(beside).unwrap_or(i64::MAX) => {
                    return if asked == 1 { Turn::Now } else { Turn::Came };
                }
                Ok(_) => {}
                Err(e) => {
                    self.table.count_home("watch", "error");
                    tracing::debug!(error = %e, "asking for a cold prefill's turn failed");
                    return Turn::GaveUp;
                }
            }
            if tokio::time::timeout_at(deadline, every.tick())
                .await
                .is_err()
            {
                return Turn::GaveUp;
            }
        }
    }

    /// The prefill's first token came: the prompt is cached there.
    pub(crate) fn prefilled(&self) {
        self.clear(true);
    }

    /// The prefill will not be: its request went elsewhere, or its attempt
    /// ended without a first token.
    pub(crate) fn ended(&self) {
        self.clear(false);
    }

    fn clear(&self, prefilled: bool) {
        // (Outside a runtime, nothing to send it with: it expires.)
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self
            .cleared
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            return;
        }
        let table = self.table.clone();
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("ZREM")
            .arg(&self.set)
            .arg(&self.member)
            .ignore();
        if let Some(reach) = self.reach.as_ref().filter(|_| !prefilled) {
            pipe.cmd("SET")
                .arg(reach)
                .arg(ENDED)
                .arg("PX")
                .arg(u64::try_from(COLD_FOR.as_millis()).unwrap_or(u64::MAX))
                .ignore();
        }
        rt.spawn(async move {
            let mut conn = table.conn.clone();
            let r: Result<(), String> = table.query_pipe(pipe, &mut conn).await;
            table.count_home("cold", if r.is_ok() { "ok" } else { "error" });
        });
    }
}

impl Drop for ColdMark {
    fn drop(&mut self) {
        self.ended();
    }
}

impl std::fmt::Debug for UnderWay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnderWay")
            .field("set", &self.set)
            .field("until", &self.until)
            .finish()
    }
}

impl std::fmt::Debug for ColdMark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ColdMark").field("set", &self.set).finish()
    }
}

impl TableHome {
    /// As a routing context carries it.
    pub(crate) fn shared(&self) -> super::SharedHome<'_> {
        super::SharedHome {
            replica: &self.replica,
            new: self.new,
        }
    }

    /// The cold prefill's count, for the placement of the request sent to
    /// `replica`: the mark when that is the new home, else `None` (and a
    /// new home's count is cleared: the prefill is not there).
    pub(crate) fn cold_on(&self, replica: &str) -> Option<Arc<ColdMark>> {
        let mark = self.cold.as_ref()?;
        if *self.replica == *replica {
            Some(mark.clone())
        } else {
            mark.ended();
            None
        }
    }

    /// The new home's cold prefill count on `replica`, where that is the
    /// home this lookup placed.
    pub(crate) fn cold_here(&self, replica: &str) -> Option<&Arc<ColdMark>> {
        self.cold.as_ref().filter(|_| *self.replica == *replica)
    }

    /// Whether another gateway homed this prefix on `replica`: its prompt
    /// is cached there, or being prefilled (which a request waits for
    /// apart: `prefill_on`).
    pub(crate) fn found_on(&self, replica: &str) -> bool {
        !self.new && *self.replica == *replica
    }

    /// Another gateway's cold prefill of this prefix under way on
    /// `replica`, its home, for a request for `hashes` sent there, where the
    /// request shares enough of that prompt to wait for it.
    pub(crate) fn prefill_on(&self, replica: &str, hashes: &[u64]) -> Option<&UnderWay> {
        self.under_way
            .as_ref()
            .filter(|u| *self.replica == *replica && hashes.get(u.reach.0) == Some(&u.reach.1))
    }
}

/// What routing did with a prefix, for the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HomeWrite {
    /// Served at a holder: the home's expiry is pushed back.
    Touch,
    /// Moved, or placed without the table: written over.
    Move,
}

/// The script's call being built: its ARGV[4] and ARGV[5], then the candidates.
struct Invocation<'a>(redis::ScriptInvocation<'a>);

impl<'a> Invocation<'a> {
    fn arg(mut self, a: impl redis::ToRedisArgs) -> Self {
        self.0.arg(a);
        self
    }

    fn with_candidates(mut self, candidates: &[Arc<str>]) -> redis::ScriptInvocation<'a> {
        for c in candidates {
            self.0.arg(&**c);
        }
        self.0
    }
}

pub struct SharedTable {
    conn: ConnectionManager,
    prefix: String,
    timeout: Duration,
    ttl_ms: u64,
    /// What it was built from (a reload keeps it while equal).
    built: (RedisConfig, Duration, bool, Option<u64>),
    metrics: Arc<Metrics>,
    /// Prefix homes are shared too (`routing.prefix_kv.shared_homes`).
    pub(crate) homes: bool,
    /// New prompts are sampled while they share nothing with the table, from
    /// this many in a window ([`Novelty`]; `routing.prefix_kv.shared_homes_sampled`
    /// and `shared_homes_sampled_from`; `None`: never).
    sampled: Option<u64>,
    script: Script,
    /// [`AHEAD`].
    ahead: Script,
    /// Prefixes (by key, pool and model) whose home this gateway pushed back
    /// lately.
    touched: Sessions,
    /// Until when prefix lookups are skipped, after one failed.
    paused: parking_lot::Mutex<Option<Instant>>,
    /// Per pool (by [`Leg`]) and model: [`Novelty`]. (Keyed by the model
    /// alone within a pool: read on every new prompt, found without
    /// allocating a key.)
    novelty: [parking_lot::RwLock<std::collections::HashMap<String, Arc<Novelty>>>; 3],
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

impl SharedTable {
    /// `None` with `store: memory`. Connects lazily: a Redis unreachable at
    /// start is handled as one that goes away later.
    /// (`keeps_sessions`: the routing policy keeps sessions; only
    /// `prefix_kv` does. `sampled`: from how many new prompts their lookups
    /// are sampled, `routing.prefix_kv.shared_homes_sampled_from`, `None`
    /// where `shared_homes_sampled` is false.)
    pub(crate) fn from_config(
        cfg: &SessionsConfig,
        keeps_sessions: bool,
        shared_homes: bool,
        sampled: Option<u64>,
        metrics: Arc<Metrics>,
        previous: Option<&Arc<SharedTable>>,
    ) -> anyhow::Result<Option<Arc<Self>>> {
        if !(cfg.enabled || shared_homes)
            || cfg.store != crate::config::StoreKind::Redis
            || !keeps_sessions
        {
            return Ok(None);
        }
        let built = (cfg.redis.clone(), cfg.ttl, shared_homes, sampled);
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
            homes: shared_homes,
            sampled,
            script: Script::new(HOMES),
            ahead: Script::new(AHEAD),
            touched: Sessions::new(TOUCHED, HOME_TTL / 4),
            paused: parking_lot::Mutex::new(None),
            novelty: Default::default(),
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

    /// The home of a prefix no candidate holds in this gateway's index
    /// (`key`: its home prefix; `candidates`: the first `open` of them are
    /// those a new home may go to, in this gateway's order): where another
    /// gateway homed it, else where the table places it now. `None`: the
    /// table could not say within `redis.timeout` (or failed within the last
    /// [`PAUSE`]: a Redis gone quiet costs each prompt nothing more then).
    /// (`reach`: where other gateways may wait for the cold prefill of a
    /// home placed now, the block a prompt must share with this one,
    /// [`crate::routing::prefilling::reach`]; `None` where the request's
    /// first token is not seen at its prefill's end: not a stream.)
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn place_home(
        self: &Arc<Self>,
        model: &str,
        leg: Leg,
        key: u64,
        candidates: &[Arc<str>],
        (open, queued): (usize, usize),
        reach: Option<(usize, u64)>,
    ) -> Option<TableHome> {
        if open == 0 || open + queued > candidates.len() {
            return None;
        }
        let now = crate::turn::now_std();
        // (Without the sampling nothing is counted for it.)
        let novelty = self.sampled.map(|from| (self.novelty_of(model, leg), from));
        if let Some((novelty, from)) = &novelty {
            let sampling = novelty.sampling(now, *from);
            novelty.new.add(now);
            if sampling && !key.is_multiple_of(NOVEL_SAMPLE) {
                self.count_home("place", "novel");
                return None;
            }
        }
        if self
            .paused
            .lock()
            .is_some_and(|until| Instant::now() < until)
        {
            self.count_home("place", "skipped");
            return None;
        }
        let mut conn = self.conn.clone();
        // A decode leg's prompt is prefilled in the prefill pool: no cold
        // prefill counted on its home (one the decode replica prefills
        // itself, when the plan says so, is not counted).
        let cold = match leg {
            Leg::Decode => Duration::ZERO,
            Leg::Serve | Leg::Prefill => COLD_FOR,
        };
        let inv = self
            .homes(
                model,
                leg,
                key,
                "place",
                &format!("{open}:{queued}"),
                candidates,
            )
            .arg(cold.as_millis().to_string())
            .arg(reach.map_or_else(String::new, |(i, h)| format!("{i}:{h:016x}")))
            .with_candidates(candidates);
        let got: Result<(String, i64, i64, String), String> =
            match tokio::time::timeout(self.timeout, inv.invoke_async(&mut conn)).await {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(_) => Err("timed out".into()),
            };
        match got {
            Ok((replica, new, left, theirs)) => {
                let new = new == 1;
                self.count_home("place", if new { "placed" } else { "found" });
                if let Some((novelty, _)) = novelty.as_ref().filter(|_| !new) {
                    novelty.found.add(now);
                }
                let cold = (new && !cold.is_zero()).then(|| {
                    Arc::new(ColdMark {
                        table: self.clone(),
                        set: self.cold_set(model, leg, &replica),
                        member: self.home(model, leg, key),
                        reach: reach.map(|_| self.reach(model, leg, key)),
                        cleared: false.into(),
                    })
                });
                let under_way = theirs
                    .split_once(':')
                    .and_then(|(i, h)| Some((i.parse().ok()?, u64::from_str_radix(h, 16).ok()?)))
                    .filter(|_| !new && left > 0)
                    .map(|reach| UnderWay {
                        table: self.clone(),
                        set: self.cold_set(model, leg, &replica),
                        member: self.home(model, leg, key),
                        reach_key: self.reach(model, leg, key),
                        reach,
                        until: Instant::now() + Duration::from_millis(left.unsigned_abs()),
                    });
                Some(TableHome {
                    replica: Arc::from(replica),
                    new,
                    cold,
                    under_way,
                })
            }
            Err(e) => {
                self.count_home("place", "error");
                *self.paused.lock() = Some(Instant::now() + PAUSE);
                tracing::debug!(error = %e, "prefix home lookup failed");
                None
            }
        }
    }

    /// After routing: prefix `at.key` went to `at.replica` (`write`: why).
    /// Written in the background; a touch at most once a quarter of
    /// [`HOME_TTL`] per prefix. A touch that finds the prefix homed
    /// elsewhere (another gateway moved it, or this one served it where the
    /// table's home was full) makes this gateway forget it on `at.replica`:
    /// its next request is looked up, and goes where the others send it.
    pub(crate) fn write_home(
        self: &Arc<Self>,
        affinity: &Arc<Affinity>,
        at: HomeAt<'_>,
        write: HomeWrite,
        candidates: impl FnOnce() -> Vec<Arc<str>>,
    ) {
        let now = crate::turn::now_std();
        let seen =
            at.key ^ xxhash_rust::xxh3::xxh3_64_with_seed(at.model.as_bytes(), at.leg as u64);
        if write == HomeWrite::Touch && self.touched.get(seen, now).as_ref() == Some(at.replica) {
            return;
        }
        self.touched.place(seen, at.replica, now);
        let candidates = candidates();
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let this = self.clone();
        let affinity = affinity.clone();
        let (model, leg, key) = (at.model.to_string(), at.leg, at.key);
        let (replica, blocks) = (at.replica.clone(), at.blocks.to_vec());
        rt.spawn(async move {
            let op = match write {
                HomeWrite::Touch => "touch",
                HomeWrite::Move => "move",
            };
            let mut conn = this.conn.clone();
            let inv = this
                .homes(&model, leg, key, op, &replica, &candidates)
                .arg(0)
                .arg("")
                .with_candidates(&candidates);
            let r: Result<Result<(String, i64, i64, String), _>, _> =
                tokio::time::timeout(this.timeout * 4, inv.invoke_async(&mut conn)).await;
            match r {
                Ok(Ok((home, ..))) if *home != *replica => {
                    this.count_home(op, "elsewhere");
                    let now = crate::turn::now_std();
                    if this.sampled.is_some() {
                        this.novelty_of(&model, leg).found.add(now);
                    }
                    affinity.of(&replica, now).prefixes.forget(&blocks);
                    this.touched.forget(seen);
                }
                Ok(Ok(_)) => this.count_home(op, "ok"),
                Ok(Err(e)) => {
                    this.count_home(op, "error");
                    tracing::debug!(error = %e, op, "prefix home write failed");
                }
                Err(_) => this.count_home(op, "error"),
            }
        });
    }

    /// The script's call for prefix `key` (see [`HOMES`]; `arg`: its
    /// ARGV[3]), its ARGV[4], ARGV[5] and candidates to follow
    /// ([`Invocation::with_candidates`]).
    fn homes<'a>(
        &'a self,
        model: &str,
        leg: Leg,
        key: u64,
        op: &str,
        arg: &str,
        candidates: &[Arc<str>],
    ) -> Invocation<'a> {
        let mut inv = self.script.prepare_invoke();
        inv.key(self.home(model, leg, key));
        inv.key(self.reach(model, leg, key));
        for c in candidates {
            inv.key(self.set(model, leg, "homes", c));
        }
        for c in candidates {
            inv.key(self.cold_set(model, leg, c));
        }
        inv.arg(op)
            .arg(u64::try_from(HOME_TTL.as_millis()).unwrap_or(u64::MAX))
            .arg(arg);
        Invocation(inv)
    }

    /// Prefix `key`'s home. One hash tag per model and pool: the script's
    /// keys share a cluster slot.
    fn home(&self, model: &str, leg: Leg, key: u64) -> String {
        format!(
            "{}:home:{{{model}/{}}}:{key:016x}",
            self.prefix,
            leg.as_str()
        )
    }

    /// Where prefix `key`'s cold prefill may be waited for, its reach
    /// (see [`HOMES`]).
    fn reach(&self, model: &str, leg: Leg, key: u64) -> String {
        format!(
            "{}:reach:{{{model}/{}}}:{key:016x}",
            self.prefix,
            leg.as_str()
        )
    }

    /// A replica's sorted set of `what` (`homes`, `cold`).
    fn set(&self, model: &str, leg: Leg, what: &str, replica: &str) -> String {
        format!(
            "{}:{what}:{{{model}/{}}}:{replica}",
            self.prefix,
            leg.as_str()
        )
    }

    fn cold_set(&self, model: &str, leg: Leg, replica: &str) -> String {
        self.set(model, leg, "cold", replica)
    }

    /// This gateway's new prompts of `model` for `leg` lately share nothing
    /// with the table ([`Novelty`]): a prompt placed without it (sampled
    /// out, or the table not asked) is not written either; its touch writes
    /// it if it is used again.
    pub(crate) fn novel(&self, model: &str, leg: Leg) -> bool {
        self.sampled.is_some_and(|from| {
            self.novelty_of(model, leg)
                .sampling(crate::turn::now_std(), from)
        })
    }

    fn novelty_of(&self, model: &str, leg: Leg) -> Arc<Novelty> {
        let pool = &self.novelty[leg as usize];
        if let Some(n) = pool.read().get(model) {
            return n.clone();
        }
        pool.write().entry(model.to_string()).or_default().clone()
    }

    fn count_home(&self, op: &'static str, outcome: &'static str) {
        self.metrics.home_store.get(&(op, outcome)).inc();
    }

    async fn query_pipe<T: redis::FromRedisValue>(
        &self,
        pipe: redis::Pipeline,
        conn: &mut ConnectionManager,
    ) -> Result<T, String> {
        self.bounded(pipe.query_async(conn)).await
    }

    async fn query<T: redis::FromRedisValue>(
        &self,
        cmd: Cmd,
        conn: &mut ConnectionManager,
    ) -> Result<T, String> {
        self.bounded(cmd.query_async(conn)).await
    }

    /// A background call's answer, given up on after four `redis.timeout`s.
    async fn bounded<T>(
        &self,
        call: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, String> {
        let started = Instant::now();
        match tokio::time::timeout(self.timeout * 4, call).await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err(format!("timed out after {:?}", started.elapsed())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, Secret, StoreKind};

    /// A gateway's table in the Redis on `port`.
    fn table(port: u16) -> (Arc<SharedTable>, Arc<Metrics>) {
        table_with(port, true)
    }

    /// A table (`sampled`: `routing.prefix_kv.shared_homes_sampled`).
    fn table_with(port: u16, sampled: bool) -> (Arc<SharedTable>, Arc<Metrics>) {
        let mut cfg = SessionsConfig {
            store: StoreKind::Redis,
            ..SessionsConfig::default()
        };
        cfg.redis.url = Secret::new(format!("redis://127.0.0.1:{port}"));
        let metrics = Arc::new(Metrics::new(&Config::default().telemetry.buckets));
        let sampled = sampled.then_some(NOVEL_FROM);
        let t = SharedTable::from_config(&cfg, true, true, sampled, metrics.clone(), None)
            .unwrap()
            .unwrap();
        (t, metrics)
    }

    fn names(n: &[&str]) -> Vec<Arc<str>> {
        n.iter().map(|&s| Arc::from(s)).collect()
    }

    async fn place(t: &Arc<SharedTable>, key: u64, order: &[&str]) -> (String, bool) {
        let h = t
            .place_home("m", Leg::Serve, key, &names(order), (order.len(), 0), None)
            .await
            .expect("the table answers");
        (h.replica.to_string(), h.new)
    }

    /// Two gateways, each with its own order of the replicas: the first to
    /// meet a prefix places it on the replica with the fewest homes (of
    /// every gateway's placing), the other finds it there; a move is seen by
    /// both, and the homes it leaves count no more.
    #[tokio::test]
    async fn gateways_place_a_new_prefix_once_on_the_replica_with_the_fewest_homes() {
        let redis = crate::limits::tests::redis_server().await;
        let (a, _) = table(redis.port);
        let (b, _) = table(redis.port);
        // Empty: the placing gateway's first choice.
        assert_eq!(place(&a, 1, &["r1", "r2", "r3"]).await, ("r1".into(), true));
        assert_eq!(
            place(&b, 1, &["r3", "r2", "r1"]).await,
            ("r1".into(), false)
        );
        // r1 holds one: the next new prefix goes to the first of the others
        // in the placing gateway's order.
        assert_eq!(place(&b, 2, &["r1", "r3", "r2"]).await, ("r3".into(), true));
        assert_eq!(place(&a, 3, &["r1", "r3", "r2"]).await, ("r2".into(), true));
        assert_eq!(
            place(&a, 2, &["r2", "r1", "r3"]).await,
            ("r3".into(), false)
        );
        // A gateway moves prefix 1 to r2: the other finds it there, and r1
        // holds none now, so it takes the next new one.
        write(&a, 1, "r2", "move").await;
        assert_eq!(
            place(&b, 1, &["r1", "r3", "r2"]).await,
            ("r2".into(), false)
        );
        assert_eq!(place(&b, 4, &["r3", "r2", "r1"]).await, ("r1".into(), true));
        // A touch keeps a home where it is: another gateway's holder does
        // not take it over.
        write(&a, 4, "r3", "touch").await;
        assert_eq!(place(&a, 4, &["r3"]).await, ("r1".into(), false));
        // Homes of each pool apart: the prefill leg's prefix 1 is new.
        let h = a
            .place_home("m", Leg::Prefill, 1, &names(&["r3"]), (1, 0), None)
            .await
            .unwrap();
        assert!(h.new && &*h.replica == "r3", "{h:?}");
        // A new home goes only where the gateway may place it: with prefix
        // 4 moved to r2, r1 holds none, r3 one, r2 three; r1 is not open.
        write(&b, 4, "r2", "move").await;
        let h = a
            .place_home(
                "m",
                Leg::Serve,
                5,
                &names(&["r3", "r2", "r1"]),
                (2, 0),
                None,
            )
            .await
            .unwrap();
        assert!(h.new && &*h.replica == "r3", "{h:?}");
    }

    /// Among replicas with equal homes, a new home goes where no other new
    /// home's cold prefill is under way, whichever gateway placed it; the
    /// count ends with the prefill (its first token), and a decode leg's
    /// home counts none.
    #[tokio::test]
    async fn a_new_prefix_goes_where_no_cold_prefill_is_under_way() {
        let redis = crate::limits::tests::redis_server().await;
        let (a, metrics) = table(redis.port);
        let (b, b_metrics) = table(redis.port);
        let order = names(&["r1", "r2"]);
        let first = a
            .place_home("m", Leg::Serve, 1, &order, (2, 0), None)
            .await
            .unwrap();
        assert_eq!((&*first.replica, first.new), ("r1", true));
        let mark = first
            .cold_on("r1")
            .expect("a new home's prefill is counted");
        // r1 holds one home: the next goes to r2 whatever the order.
        let h = b
            .place_home("m", Leg::Serve, 2, &order, (2, 0), None)
            .await
            .unwrap();
        assert_eq!(&*h.replica, "r2");
        drop(h);
        wait_for(&b, &b_metrics, 1).await;
        // One home each, a cold prefill under way on r1 only (prefix 2's
        // count ended with its lookup's answer, dropped unsent): the other
        // gateway's first choice r1 is passed over.
        let h = b
            .place_home("m", Leg::Serve, 3, &order, (2, 0), None)
            .await
            .unwrap();
        assert_eq!(&*h.replica, "r2", "{h:?}");
        assert!(h.cold_on("r1").is_none(), "sent elsewhere: not counted");
        // r1's prefill done: its count ends.
        let cold_on_r1 = async || -> u64 {
            let mut conn = a.conn.clone();
            let mut cmd = redis::cmd("ZCARD");
            cmd.arg(a.cold_set("m", Leg::Serve, "r1"));
            a.query(cmd, &mut conn).await.unwrap()
        };
        assert_eq!(cold_on_r1().await, 1);
        drop(first);
        mark.prefilled();
        wait_for(&a, &metrics, 1).await;
        assert_eq!(cold_on_r1().await, 0);
        // r1 takes the next by the fewest homes; once its prefill is done
        // (and prefix 3's count, sent elsewhere), homes are equal and none is
        // under way: the gateway's order again.
        let h = a
            .place_home("m", Leg::Serve, 4, &order, (2, 0), None)
            .await
            .unwrap();
        assert_eq!(&*h.replica, "r1", "{h:?}");
        drop(h);
        wait_for(&a, &metrics, 2).await;
        wait_for(&b, &b_metrics, 2).await;
        let h = b
            .place_home("m", Leg::Serve, 5, &order, (2, 0), None)
            .await
            .unwrap();
        assert_eq!(&*h.replica, "r1", "{h:?}");
        // A decode leg's new home is not counted.
        let h = a
            .place_home("m", Leg::Decode, 5, &order, (2, 0), None)
            .await
            .unwrap();
        assert!(h.new && h.cold_on(&h.replica).is_none(), "{h:?}");
    }

    /// A replica left out only for its engine's queue at its last scrapes
    /// (every gateway sees that queue until the next scrape) takes a new
    /// home once every open replica has at least two cold prefills more
    /// under way than it: new prompts do not all pile onto the open ones
    /// for a whole scrape interval.
    #[tokio::test]
    async fn a_queued_replica_takes_a_new_home_once_the_open_ones_have_two_prefills_more() {
        let redis = crate::limits::tests::redis_server().await;
        let (a, _) = table(redis.port);
        let (b, _) = table(redis.port);
        let order = names(&["r1", "r2", "r3"]);
        let mut under_way = Vec::new();
        // r3 queued: the open r1 and r2 take the first four by their homes,
        // while one of them has as few cold prefills under way as r3 + 1.
        for (key, t, want) in [(1, &a, "r1"), (2, &b, "r2"), (3, &a, "r1"), (4, &b, "r2")] {
            let h = t
                .place_home("m", Leg::Serve, key, &order, (2, 1), None)
                .await
                .unwrap();
            assert_eq!((&*h.replica, h.new), (want, true), "prefix {key}");
            under_way.push(h);
        }
        // Two each under way on r1 and r2, none on r3: without r3 listed as
        // queued the next goes to r1 still...
        let h = a
            .place_home("m", Leg::Serve, 5, &order, (2, 0), None)
            .await
            .unwrap();
        assert_eq!(&*h.replica, "r1", "{h:?}");
        under_way.push(h);
        // ...with it, to r3, which any gateway then finds.
        let h = b
            .place_home("m", Leg::Serve, 6, &order, (2, 1), None)
            .await
            .unwrap();
        assert_eq!((&*h.replica, h.new), ("r3", true), "{h:?}");
        let found = a
            .place_home("m", Leg::Serve, 6, &order, (2, 1), None)
            .await
            .unwrap();
        assert_eq!((&*found.replica, found.new), ("r3", false));
        drop(under_way);
    }

    /// A new home's cold prefill waits for its turn among the cold
    /// prefills every gateway placed on its replica before it
    /// (`routing::cold_gate`): with none beside it, until the earlier one's
    /// first token; with one beside it, at once; a third waits for the
    /// first of two.
    #[tokio::test]
    async fn a_cold_prefill_takes_its_turn_after_those_placed_before_it_by_any_gateway() {
        let redis = crate::limits::tests::redis_server().await;
        let (a, _) = table(redis.port);
        let (b, _) = table(redis.port);
        let order = names(&["r1"]);
        let place = async |t: &Arc<SharedTable>, key: u64| {
            let h = t
                .place_home("m", Leg::Serve, key, &order, (1, 0), None)
                .await
                .unwrap();
            assert!(h.new);
            h.cold_here("r1").expect("counted on r1").clone()
        };
        let soon = || tokio::time::Instant::now() + Duration::from_millis(200);
        let far = tokio::time::Instant::now() + Duration::from_secs(30);
        let first = place(&a, 1).await;
        assert_eq!(first.turn(0, soon()).await, Turn::Now);
        let second = place(&b, 2).await;
        // One before it: none may run beside it, so it waits (here until
        // its deadline); one beside it may go at once.
        assert_eq!(second.turn(0, soon()).await, Turn::GaveUp);
        assert_eq!(second.turn(1, soon()).await, Turn::Now);
        let third = place(&a, 3).await;
        // The first's first token: the second's turn, and the third still
        // waits for the second (here until its deadline), then goes once
        // the second ended. (Cleared in the background: at once or after a
        // wait. Whether a wait that began before a clearing ends `Came` or
        // `Now` depends on which reaches Redis first: not asserted, a race
        // on a loaded machine.)
        first.prefilled();
        assert_ne!(second.turn(0, far).await, Turn::GaveUp);
        assert_eq!(third.turn(0, soon()).await, Turn::GaveUp);
        second.ended();
        assert_ne!(third.turn(0, far).await, Turn::GaveUp);
    }

    /// A gateway that finds a home whose cold prefill another gateway has
    /// under way, and sees the first token of (a stream), may wait for it:
    /// until that first token, or the attempt's end without one; not for a
    /// prompt sharing too little of it, on another replica, or where the
    /// placing request was not a stream.
    #[tokio::test]
    async fn another_gateways_cold_prefill_is_waited_for_until_its_first_token() {
        use crate::routing::prefilling::{HOLD_MIN_BLOCKS, reach};
        let redis = crate::limits::tests::redis_server().await;
        let (a, _) = table(redis.port);
        let (b, _) = table(redis.port);
        let order = names(&["r1", "r2"]);
        let prompt: Vec<u64> = (1..=40).collect();
        let far = tokio::time::Instant::now() + Duration::from_secs(30);
        let place = async |t: &Arc<SharedTable>, key: u64, watched: bool| {
            let reach = watched.then(|| reach(&prompt)).flatten();
            t.place_home("m", Leg::Serve, key, &order, (2, 0), reach)
                .await
                .unwrap()
        };

        let first = place(&a, 7, true).await;
        assert!(first.new && first.prefill_on(&first.replica, &prompt).is_none());
        let mark = first.cold_on(&first.replica).unwrap();
        let found = place(&b, 7, true).await;
        assert!(!found.new);
        let on = &*found.replica;
        assert!(
            found
                .prefill_on(if on == "r1" { "r2" } else { "r1" }, &prompt)
                .is_none()
        );
        // Sharing all but HOLD_MIN_BLOCKS + 1 of its 40 blocks: not worth it.
        let mut short = prompt.clone();
        short[40 - HOLD_MIN_BLOCKS - 1] = 0;
        assert!(found.prefill_on(on, &short).is_none());
        let under_way = found.prefill_on(on, &prompt).expect("under way").clone();
        assert_eq!(under_way.shared_blocks(), 40 - HOLD_MIN_BLOCKS);
        let waiting = tokio::spawn(async move { under_way.wait(far).await });
        mark.prefilled();
        assert_eq!(waiting.await.unwrap(), HoldOutcome::Prefilled);
        // Done: found again, nothing to wait for.
        assert!(place(&b, 7, true).await.prefill_on(on, &prompt).is_none());

        // An attempt that ends without a first token.
        let first = place(&a, 8, true).await;
        let found = place(&b, 8, true).await;
        let under_way = found.prefill_on(&found.replica, &prompt).unwrap().clone();
        let waiting = tokio::spawn(async move { under_way.wait(far).await });
        drop(first);
        assert_eq!(waiting.await.unwrap(), HoldOutcome::Ended);
        assert!(place(&b, 8, true).await.prefill_on(on, &prompt).is_none());

        // Its first-token bound first.
        let first = place(&a, 9, true).await;
        let found = place(&b, 9, true).await;
        let soon = tokio::time::Instant::now() + Duration::from_millis(50);
        let under_way = found.prefill_on(&found.replica, &prompt).unwrap();
        assert_eq!(under_way.wait(soon).await, HoldOutcome::Deadline);
        drop(first);

        // A placing request that is not a stream: its first token is its
        // end, nothing to wait for.
        let _first = place(&a, 10, false).await;
        let found = place(&b, 10, true).await;
        assert!(found.prefill_on(&found.replica, &prompt).is_none());
    }

    /// With `routing.prefix_kv.shared_homes_sampled: false` a gateway
    /// meeting only new prompts looks up every one, past the thousand that
    /// start the sampling.
    #[tokio::test]
    async fn without_sampling_a_gateway_looks_up_every_new_prompt() {
        let redis = crate::limits::tests::redis_server().await;
        let (a, metrics) = table_with(redis.port, false);
        let order = names(&["r1", "r2"]);
        for k in 0..NOVEL_FROM + 2 * NOVEL_SAMPLE {
            let h = a.place_home("m", Leg::Serve, k, &order, (2, 0), None).await;
            assert!(h.is_some(), "prompt {k} looked up");
        }
        assert!(!a.novel("m", Leg::Serve));
        assert_eq!(metrics.home_store.get(&("place", "novel")).get(), 0);
        // A reload keeps the table while the switch is unchanged, and builds
        // another when it flips.
        let cfg = SessionsConfig {
            store: StoreKind::Redis,
            redis: a.built.0.clone(),
            ..SessionsConfig::default()
        };
        let again = |sampled: bool| {
            let sampled = sampled.then_some(NOVEL_FROM);
            SharedTable::from_config(&cfg, true, true, sampled, metrics.clone(), Some(&a))
                .unwrap()
                .unwrap()
        };
        assert!(Arc::ptr_eq(&again(false), &a));
        let flipped = again(true);
        assert!(!Arc::ptr_eq(&flipped, &a) && flipped.sampled.is_some());
        assert_eq!(
            metrics.home_store.get(&("place", "placed")).get(),
            NOVEL_FROM + 2 * NOVEL_SAMPLE
        );
    }

    /// A gateway meeting only new prompts of a model looks up one prefix in
    /// sixteen (by key) once it met a thousand in 5-10 s; one found homed
    /// elsewhere (on the sample's lookup) ends that: every prompt is looked
    /// up again. Another model's or pool's prompts are counted apart.
    #[tokio::test]
    async fn a_gateway_meeting_only_new_prompts_looks_up_a_sample_until_one_is_found() {
        let redis = crate::limits::tests::redis_server().await;
        let (a, metrics) = table(redis.port);
        let (b, _) = table(redis.port);
        let order = names(&["r1", "r2"]);
        let looked_up = async |t: &Arc<SharedTable>, leg: Leg, keys: std::ops::Range<u64>| {
            let mut n = 0;
            for k in keys {
                n += usize::from(
                    t.place_home("m", leg, k, &order, (2, 0), None)
                        .await
                        .is_some(),
                );
            }
            n
        };
        let serve = Leg::Serve;
        assert_eq!(
            looked_up(&a, serve, 0..NOVEL_FROM).await,
            NOVEL_FROM as usize
        );
        assert!(a.novel("m", serve));
        assert!(!a.novel("m", Leg::Prefill) && !a.novel("other", serve));
        // Of 1,000-1,031, the keys 1,008 and 1,024.
        assert_eq!(looked_up(&a, serve, NOVEL_FROM..NOVEL_FROM + 32).await, 2);
        assert_eq!(metrics.home_store.get(&("place", "novel")).get(), 30);
        // Another pool's new prompts are looked up.
        assert_eq!(looked_up(&a, Leg::Prefill, 0..10).await, 10);
        // Another gateway homes prefixes; this one meets them: the first,
        // 1,000,000 (a multiple of 16), is looked up and found, and sampling
        // ends: the fifteen after it are looked up too.
        let theirs = 1_000_000..1_000_000 + NOVEL_SAMPLE;
        assert_eq!(
            looked_up(&b, serve, theirs.clone()).await,
            NOVEL_SAMPLE as usize
        );
        assert_eq!(looked_up(&a, serve, theirs).await, NOVEL_SAMPLE as usize);
        assert_eq!(
            metrics.home_store.get(&("place", "found")).get(),
            NOVEL_SAMPLE
        );
        assert!(!a.novel("m", serve));
        assert_eq!(looked_up(&a, serve, 2_000_001..2_000_011).await, 10);
        // So does a touch that finds the home elsewhere: a prefix this
        // gateway placed without the table (sampled out) and served again
        // at its holder, which another gateway homed on another replica.
        let (c, c_metrics) = table(redis.port);
        let fresh = 5_000_000..5_000_000 + NOVEL_FROM;
        assert_eq!(looked_up(&c, serve, fresh).await, NOVEL_FROM as usize);
        assert!(c.novel("m", serve));
        let key = 3_000_001;
        assert_eq!(looked_up(&c, serve, key..key + 1).await, 0);
        write(&b, key, "r2", "move").await;
        let t = (16, Duration::from_secs(60));
        let at = HomeAt {
            model: "m",
            leg: serve,
            key,
            blocks: &[key],
            replica: &Arc::from("r1"),
        };
        c.write_home(&Affinity::new(64, t, t), at, HomeWrite::Touch, || {
            order.clone()
        });
        let elsewhere = || c_metrics.home_store.get(&("touch", "elsewhere")).get();
        for _ in 0..1000 {
            if elsewhere() > 0 {
                break;
            }
            let mut conn = c.conn.clone();
            let _: String = c.query(redis::cmd("PING"), &mut conn).await.unwrap();
        }
        assert_eq!(elsewhere(), 1);
        assert!(!c.novel("m", serve));
    }

    /// Until `n` cold counts ended in the background on gateway `t` (its
    /// writes share one connection: each round trip after them).
    async fn wait_for(t: &SharedTable, metrics: &Metrics, n: u64) {
        let done = || metrics.home_store.get(&("cold", "ok")).get();
        for _ in 0..1000 {
            if done() >= n {
                return;
            }
            let mut conn = t.conn.clone();
            let _: String = t.query(redis::cmd("PING"), &mut conn).await.unwrap();
        }
        panic!("{} of {n} cold counts ended", done());
    }

    /// What `write_home` sends in the background, awaited.
    async fn write(t: &SharedTable, key: u64, to: &str, op: &str) {
        let mut conn = t.conn.clone();
        let c = names(&["r1", "r2", "r3"]);
        let inv = t
            .homes("m", Leg::Serve, key, op, to, &c)
            .arg(0)
            .arg("")
            .with_candidates(&c);
        let _: (String, i64, i64, String) = inv.invoke_async(&mut conn).await.unwrap();
    }

    /// No Redis: the lookup answers nothing, and the error is counted.
    #[tokio::test]
    async fn no_home_while_redis_is_down() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let (t, metrics) = table(port);
        for _ in 0..2 {
            assert!(
                t.place_home("m", Leg::Serve, 1, &names(&["r1"]), (1, 0), None)
                    .await
                    .is_none()
            );
        }
        assert_eq!(metrics.home_store.get(&("place", "error")).get(), 1);
        // The second within the pause: not tried.
        assert_eq!(metrics.home_store.get(&("place", "skipped")).get(), 1);
    }
}
