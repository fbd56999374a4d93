//! Fairness between gateways: attained service shared through Redis.
//!
//! Each gateway orders its own waiters by least attained service. Alone,
//! that lets a tenant that sends through N gateways get a share at each of
//! them. With `rate_limits.store: redis` and `flow_control.share_fairness`,
//! every `share_interval` each gateway adds, per model, the service it gave
//! each tenant since the last round to one total in Redis (a hash per model,
//! a field per tenant, one Lua script: the increments and the read back in a
//! round trip) and reads every tenant's total. What other gateways gave a
//! tenant since the last round then counts here as if given here, but only
//! while tenants compete here (two or more waiting): fairness decides only
//! between waiters, and service given while nobody else waited here banks
//! nothing, as a tenant's idle time banks no credit (`queue`). The totals
//! found at a gateway's first round are a baseline, not a debt (a restarted
//! gateway does not charge the past again).
//!
//! Redis down or slow: the round's increments are sent again, as the same
//! numbered round, until Redis confirms them; a round Redis already applied
//! (its answer was lost) is not applied twice (each gateway's last applied
//! round is kept beside the totals). Meanwhile each gateway goes on ordering
//! by what it knows (`sluice_flow_share_syncs_total{outcome="error"}`).
//! While sharing is off nothing is kept for it, and a new store (URL or key
//! prefix changed by a reload) starts a new ledger.
//!
//! Seats too. Ordering moves no seat between gateways: a gateway counts its
//! own requests live and the others' only at its scrapes, so the seat a
//! request frees is taken again at once by the gateway that sent it, and a
//! gateway that loses seats under saturation rarely gets them back (measured:
//! a gateway carrying half of one tenant served 16-31% of its demand, the
//! other all of its own). So in the same round each gateway also publishes,
//! per model, what each tenant wants here (requests in flight plus waiting,
//! by band) and reads every other gateway's (entries older than four rounds
//! are dropped: a dead gateway stops counting; one that shuts down withdraws
//! its wants in a last round, [`super::Flow::leave`]). When the tenants want more
//! seats than the model has, each gateway fills at most its part
//! ([`quota`]): the seats are split between tenants max-min (the highest
//! band first), and each tenant's part between gateways in proportion to
//! what it wants at each (rounded up). Within its part, a gateway still refills its own
//! freed seats at once, and its own order (with the shared service) decides
//! who goes; a part is in force for four rounds after the last successful
//! one (Redis down: the gateways go back to what each sees).

use std::sync::{Arc, Weak};
use std::time::Duration;

use foldhash::{HashMap, HashMapExt as _};
use tokio::sync::Notify;
use tokio::time::Instant;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Script};

use super::{Gate, GateState, Shared};
use crate::config::RedisConfig;

/// KEYS: the model's service hash, this gateway's last applied round (a
/// key per gateway process, so a stopped one's expires), the model's wants
/// hash (a field per gateway process: "<Redis ms> <kept ms> <json>").
/// ARGV: round number, this gateway's id, its wants (JSON; "" for none), how
/// long they count (ms: its own rounds' span, whatever the readers'), then
/// tenant, increment, tenant, ... A round
/// at or below the last applied one is not applied again (a resend whose
/// first answer was lost); the wants are this round's whatever the round
/// (they replace the last). Returns the service hash (field, value, ...) and
/// the other gateways' fresh wants (older ones are deleted).
const SYNC: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if #ARGV > 4 then
  local last = tonumber(redis.call('GET', KEYS[2]) or '0')
  local round = tonumber(ARGV[1])
  if round > last then
    for i = 5, #ARGV - 1, 2 do
      redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
    end
    redis.call('SET', KEYS[2], ARGV[1], 'PX', 3600000)
    redis.call('PEXPIRE', KEYS[1], 3600000)
  end
end
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[3], ARGV[2])
else
  redis.call('HSET', KEYS[3], ARGV[2], now .. ' ' .. ARGV[4] .. ' ' .. ARGV[3])
  redis.call('PEXPIRE', KEYS[3], 3600000)
end
local wants = {}
local all = redis.call('HGETALL', KEYS[3])
for i = 1, #all, 2 do
  local at, kept = string.match(all[i + 1], '^(%d+) (%d+) ')
  if at == nil or now - tonumber(at) > tonumber(kept) then
    redis.call('HDEL', KEYS[3], all[i])
  elseif all[i] ~= ARGV[2] then
    wants[#wants + 1] = all[i + 1]
  end
end
return {redis.call('HGETALL', KEYS[1]), wants}
"#;

/// Per tenant: what this gateway added to the shared total, and the others'
/// part of it at the last round (`None` until first seen).
#[derive(Default)]
pub(super) struct Ledger {
    own: f64,
    others: Option<f64>,
}

/// What a tenant wants of a model at one gateway: band, tenant, requests
/// in flight there plus waiting there.
pub(super) type Want = (i32, Arc<str>, u32);

/// Rounds a gateway's wants (and its part of the seats) outlive: a stopped
/// gateway stops counting, a gateway that cannot reach Redis goes back to
/// what it sees.
const ROUNDS_KEPT: u32 = 4;

/// A round sent and not yet confirmed: sent again as it is, with its
/// number, until Redis answers.
pub(super) struct Round {
    number: u64,
    increments: Vec<(Arc<str>, f64)>,
}

/// A stopping gateway's last round ([`super::Flow::leave`]): asked for,
/// then answered once sent (or given up).
#[derive(Default)]
pub(super) struct Leaving {
    pub(super) ask: Notify,
    pub(super) done: Notify,
}

/// Sync every gate of `shared` until it is dropped, or until a last round
/// is asked for through `leaving`.
pub(super) fn spawn(shared: Weak<Shared>, leaving: Arc<Leaving>) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    rt.spawn(async move {
        let script = Script::new(SYNC);
        // This process's round key (a restarted gateway is a new one).
        let me = format!("{:016x}", fastrand::u64(..));
        let mut rounds = 0u64;
        let mut conn: Option<(RedisConfig, ConnectionManager)> = None;
        loop {
            let interval = match shared.upgrade() {
                Some(s) => s
                    .rules
                    .load()
                    .share
                    .as_ref()
                    .map_or(Duration::from_secs(1), |(_, every)| *every),
                None => return,
            };
            // The last round comes at once when asked for.
            let last = tokio::select! {
                () = tokio::time::sleep(interval) => false,
                () = leaving.ask.notified() => true,
            };
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let rules = shared.rules.load_full();
            let gates: Vec<Arc<Gate>> = shared.gates.lock().values().cloned().collect();
            let Some((cfg, _)) = &rules.share else {
                // Off: nothing is kept for a later round, and no part holds.
                conn = None;
                for gate in &gates {
                    let mut st = gate.state.lock();
                    st.outbox.clear();
                    st.others_want.clear();
                    st.part = None;
                    drop(st);
                    shared
                        .metrics
                        .flow_seat_part
                        .get(&(gate.model.clone(),))
                        .set(-1);
                }
                if last {
                    leaving.done.notify_one();
                    return;
                }
                continue;
            };
            if conn.as_ref().is_none_or(|(c, _)| c != cfg) {
                // A new store (or sharing just turned on): its totals are a
                // new baseline, and nothing is owed to it from before. Only
                // a new timeout: the same store, reconnected.
                let same_store = conn
                    .as_ref()
                    .is_some_and(|(c, _)| c.url == cfg.url && c.key_prefix == cfg.key_prefix);
                if !same_store {
                    for gate in &gates {
                        let mut st = gate.state.lock();
                        st.ledger.clear();
                        st.synced = false;
                        st.unconfirmed = None;
                    }
                }
                conn = connect(cfg).map(|m| (cfg.clone(), m));
            }
            for gate in gates {
                let ok = match &conn {
                    Some((cfg, manager)) => {
                        let round = Sync {
                            script: &script,
                            cfg,
                            me: &me,
                            every: interval,
                        };
                        let seats = gate.seats(&rules);
                        round
                            .run(manager.clone(), &mut rounds, &gate, seats, last)
                            .await
                    }
                    None => false,
                };
                shared
                    .metrics
                    .flow_share_syncs
                    .get(&(if ok { "ok" } else { "error" },))
                    .inc();
                let part = gate.state.lock().part(Instant::now());
                shared
                    .metrics
                    .flow_seat_part
                    .get(&(gate.model.clone(),))
                    .set(part.map_or(-1, i64::from));
            }
            if last {
                leaving.done.notify_one();
                return;
            }
        }
    });
}

fn connect(cfg: &RedisConfig) -> Option<ConnectionManager> {
    let client = Client::open(cfg.url.expose()).ok()?;
    let conf = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(cfg.timeout))
        .set_response_timeout(Some(cfg.timeout))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_secs(1));
    ConnectionManager::new_lazy_with_config(client, conf).ok()
}

/// The script's answer: the service totals (tenant, total), the other
/// gateways' wants (as published).
type Reply = (Vec<(String, f64)>, Vec<String>);

/// What a round needs besides the gate.
struct Sync<'a> {
    script: &'a Script,
    cfg: &'a RedisConfig,
    /// This gateway process's id.
    me: &'a str,
    /// The rounds' interval.
    every: Duration,
}

impl Sync<'_> {
    /// One round for one model: send its increments (or the unconfirmed
    /// round again) and what its tenants want here (nothing in a stopping
    /// gateway's `last` round: its wants are withdrawn), take in the totals
    /// and the other gateways' wants.
    async fn run(
        &self,
        mut conn: ConnectionManager,
        rounds: &mut u64,
        gate: &Gate,
        seats: u32,
        last: bool,
    ) -> bool {
        let (number, sent, wants) = {
            let mut guard = gate.state.lock();
            let st = &mut *guard;
            let round = st.unconfirmed.get_or_insert_with(|| {
                *rounds += 1;
                Round {
                    number: *rounds,
                    increments: st.outbox.drain().collect(),
                }
            });
            let (number, sent) = (round.number, round.increments.clone());
            (number, sent, if last { Vec::new() } else { st.wants() })
        };
        let kept = self.every * ROUNDS_KEPT;
        let inv = invocation(
            self.script,
            self.cfg,
            &gate.model,
            self.me,
            number,
            &encode(&wants),
            kept,
            &sent,
        );
        let reply: Option<Reply> =
            tokio::time::timeout(self.cfg.timeout, inv.invoke_async(&mut conn))
                .await
                .ok()
                .and_then(Result::ok);
        let Some((totals, others)) = reply else {
            // Perhaps applied there, perhaps not: the same round goes again.
            return false;
        };
        let mut st = gate.state.lock();
        st.unconfirmed = None;
        absorb(&mut st, &sent, totals);
        st.others_want = others.iter().flat_map(|o| decode(o)).collect();
        let mine = st.wants();
        st.part = quota(seats, &mine, &st.others_want).map(|q| (q, Instant::now() + kept));
        true
    }
}

/// The script's call for one round of one model.
#[expect(
    clippy::too_many_arguments,
    reason = "the script's arguments, in order"
)]
fn invocation<'a>(
    script: &'a Script,
    cfg: &RedisConfig,
    model: &str,
    me: &str,
    number: u64,
    wants: &str,
    kept: Duration,
    sent: &[(Arc<str>, f64)],
) -> redis::ScriptInvocation<'a> {
    let mut inv = script.prepare_invoke();
    let base = format!("{}:flow:{{{model}}}", cfg.key_prefix);
    inv.key(format!("{base}:service"))
        .key(format!("{base}:round:{me}"))
        .key(format!("{base}:wants"))
        .arg(number)
        .arg(me)
        .arg(wants)
        .arg(kept.as_millis() as u64);
    for (tenant, amount) in sent {
        inv.arg(&**tenant).arg(*amount);
    }
    inv
}

/// A gateway's wants as published: `[[band, "tenant", n], ...]`, "" for
/// none.
fn encode(wants: &[Want]) -> String {
    if wants.is_empty() {
        return String::new();
    }
    let rows: Vec<(i32, &str, u32)> = wants.iter().map(|(b, t, n)| (*b, &**t, *n)).collect();
    serde_json::to_string(&rows).unwrap_or_default()
}

/// Another gateway's published wants ("<ms> <kept ms> <json>"); nothing
/// from what does not parse (a gateway of another version counts as wanting
/// nothing).
fn decode(entry: &str) -> Vec<Want> {
    entry
        .splitn(3, ' ')
        .nth(2)
        .and_then(|json| serde_json::from_str::<Vec<(i32, String, u32)>>(json).ok())
        .unwrap_or_default()
        .into_iter()
        .map(|(b, t, n)| (b, Arc::from(t), n))
        .collect()
}

/// This gateway's part of a model's `seats` while the tenants of every
/// gateway want more than that: the seats go to the highest band first, and
/// within a band max-min between tenants (each gets what it wants, or an
/// equal share of what is left, whichever is less); each tenant's part is
/// split between gateways in proportion to what it wants at each. `None`
/// when no other gateway wants any, when the seats are unknown, or when
/// every want fits (nothing to split). Rounded up (the parts may add up to
/// a seat per gateway more than there are, never fewer: the replicas' room
/// still bounds what is sent), and at least one: a gateway whose tenants
/// start to want seats gets one before its next round.
pub(super) fn quota(seats: u32, mine: &[Want], others: &[Want]) -> Option<u32> {
    if others.is_empty() || seats == 0 || seats == u32::MAX {
        return None;
    }
    // (band, tenant) -> (wanted everywhere, wanted here).
    let mut by: HashMap<(i32, &str), (f64, f64)> = HashMap::new();
    for (band, tenant, n) in mine {
        let e = by.entry((*band, &**tenant)).or_default();
        e.0 += f64::from(*n);
        e.1 += f64::from(*n);
    }
    for (band, tenant, n) in others {
        by.entry((*band, &**tenant)).or_default().0 += f64::from(*n);
    }
    let mut rows: Vec<(i32, f64, f64)> = by
        .into_iter()
        .filter(|(_, (all, _))| *all > 0.0)
        .map(|((band, _), (all, here))| (band, all, here))
        .collect();
    // Highest band first; within a band the smallest wants first (each takes
    // what it wants or its equal share of what is left).
    rows.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.total_cmp(&b.1)));
    let mut left = f64::from(seats);
    let mut part = 0.0;
    let mut i = 0;
    while i < rows.len() {
        let band = rows[i].0;
        let end = i + rows[i..].iter().take_while(|r| r.0 == band).count();
        for (k, &(_, all, here)) in rows[i..end].iter().enumerate() {
            let share = left / (end - i - k) as f64;
            let given = all.min(share);
            left -= given;
            part += given * here / all;
        }
        i = end;
    }
    if left >= 0.5 {
        return None;
    }
    // Not above the seats (a want's share is at most the seats), less a
    // float's noise before rounding up.
    Some(((part - 1e-9).ceil().clamp(1.0, f64::from(seats))) as u32)
}

/// This gateway's increments reached the totals; what the others gave each
/// tenant since the last round counts here while tenants compete here.
fn absorb(st: &mut GateState, sent: &[(Arc<str>, f64)], totals: Vec<(String, f64)>) {
    for (tenant, amount) in sent {
        st.ledger.entry(tenant.clone()).or_default().own += amount;
    }
    let contended = st.queue.contended();
    // The totals found at the first round are the past (a baseline); a
    // tenant that appears later was served since.
    let first = !std::mem::replace(&mut st.synced, true);
    for (tenant, total) in totals {
        let tenant: Arc<str> = Arc::from(tenant);
        let entry = st.ledger.entry(tenant.clone()).or_default();
        let others = total - entry.own;
        let before = entry.others.unwrap_or(if first { others } else { 0.0 });
        let grew = others - before;
        entry.others = Some(others);
        if contended && grew > 0.0 {
            st.queue.add_service(&tenant, grew);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use parking_lot::Mutex;

    use super::*;
    use crate::config::Secret;

    fn t(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    #[test]
    fn others_service_counts_only_while_tenants_compete_and_never_the_past() {
        let mut st = GateState::default();
        let deadline = tokio::time::Instant::now();
        // First round: "heavy" has 1,000 from before (a baseline, not a debt).
        absorb(&mut st, &[], vec![("heavy".into(), 1000.0)]);
        // Nobody waits here: another gateway's 500 bank nothing.
        absorb(&mut st, &[], vec![("heavy".into(), 1500.0)]);
        let (tx1, _rx1) = tokio::sync::oneshot::channel();
        let (tx2, _rx2) = tokio::sync::oneshot::channel();
        st.queue.push(0, t("heavy"), 10.0, deadline, tx1);
        st.queue.push(0, t("light"), 10.0, deadline, tx2);
        // Both wait at the virtual time: heavy arrived first and would go
        // first. Now heavy got 300 more elsewhere (and 20 here, sent this
        // round), and "other", unseen so far, 50 (all since the first round).
        absorb(
            &mut st,
            &[(t("heavy"), 20.0)],
            vec![
                ("heavy".into(), 1820.0),
                ("light".into(), 0.0),
                ("other".into(), 50.0),
            ],
        );
        let next = st.queue.pop().map(|w| w.tenant);
        assert_eq!(next.as_deref(), Some("light"));
        assert_eq!(st.ledger[&t("heavy")].own, 20.0);
        assert_eq!(st.ledger[&t("heavy")].others, Some(1800.0));
        assert_eq!(st.ledger[&t("other")].others, Some(50.0));
        assert_eq!(st.queue.service_of("other"), Some(50.0));
    }

    /// A store on `redis` under a key prefix of its own, and its connection.
    fn store(
        redis: &crate::limits::tests::RedisServer,
        prefix: &str,
    ) -> (RedisConfig, ConnectionManager) {
        let cfg = RedisConfig {
            url: Secret::new(format!("redis://127.0.0.1:{}", redis.port)),
            key_prefix: format!("{prefix}{}", fastrand::u64(..)),
            timeout: Duration::from_secs(2),
        };
        let manager = connect(&cfg).unwrap();
        (cfg, manager)
    }

    fn w(band: i32, tenant: &str, n: u32) -> Want {
        (band, t(tenant), n)
    }

    #[test]
    fn seats_split_max_min_between_tenants_then_by_where_they_want_them() {
        // 96 seats. Gateway 1: light 60, half of heavy (30); gateway 2 the
        // other half of heavy. Light and heavy get 48 each; heavy's 48 go
        // half to each gateway.
        let g1 = [w(0, "light", 60), w(0, "heavy", 30)];
        let g2 = [w(0, "heavy", 30)];
        assert_eq!(quota(96, &g1, &g2), Some(72));
        assert_eq!(quota(96, &g2, &g1), Some(24));
        // A tenant wanting less than an equal share keeps it all; the rest
        // split the remainder: a 10, b and c 43 each (c at gateway 2).
        let g1 = [w(0, "a", 10), w(0, "b", 100)];
        let g2 = [w(0, "c", 100)];
        assert_eq!(quota(96, &g1, &g2), Some(53));
        assert_eq!(quota(96, &g2, &g1), Some(43));
        // The highest band first: premium's 10 at gateway 2 are all its
        // own; crowd's 86 go 5 : 200.
        let g1 = [w(0, "crowd", 200)];
        let g2 = [w(10, "vip", 10), w(0, "crowd", 5)];
        assert_eq!(quota(96, &g2, &g1), Some(10 + 3), "12.1, rounded up");
        assert_eq!(quota(96, &g1, &g2), Some(84));
        // Three gateways, 4 seats, a tenant each: 1.33 each, rounded up, so
        // no seat is left out (the replicas' room bounds the excess).
        let (a, b, c) = ([w(0, "a", 2)], [w(0, "b", 2)], [w(0, "c", 2)]);
        for (mine, others) in [(&a, [b.clone(), c.clone()]), (&b, [a.clone(), c.clone()])] {
            assert_eq!(quota(4, mine, &others.concat()), Some(2));
        }
    }

    #[test]
    fn no_part_when_every_want_fits_or_nobody_else_wants() {
        let g1 = [w(0, "a", 40)];
        let g2 = [w(0, "b", 50)];
        assert_eq!(quota(96, &g1, &g2), None, "90 wanted of 96");
        assert_eq!(quota(96, &[w(0, "a", 500)], &[]), None, "alone");
        assert_eq!(quota(u32::MAX, &g1, &g2), None, "seats unknown");
        // A gateway whose tenants want nothing yet may still send one.
        assert_eq!(quota(96, &[], &[w(0, "b", 500)]), Some(1));
    }

    #[tokio::test]
    async fn gateways_read_each_others_wants_and_forget_a_silent_one() {
        let redis = crate::limits::tests::redis_server().await;
        let (cfg, manager) = store(&redis, "wants");
        let script = Script::new(SYNC);
        let gate = || Gate {
            model: t("m"),
            state: Mutex::new(GateState::default()),
            pending: AtomicU32::new(0),
        };
        let (gate1, gate2) = (gate(), gate());
        let mut conn = manager.clone();
        // Two other gateways last heard 2 s ago: one whose wants count for a
        // second (gone), one whose count for a minute (still counts: each
        // gateway's own span, whatever the reader's).
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
        let now_ms = secs * 1000 + micros / 1000;
        for (field, kept, tenant) in [("gone", 1000, "ghost"), ("quiet", 60_000, "heavy")] {
            let _: () = redis::cmd("HSET")
                .arg(format!("{}:flow:{{m}}:wants", cfg.key_prefix))
                .arg(field)
                .arg(format!("{} {kept} [[0,\"{tenant}\",0]]", now_ms - 2000))
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        gate1.state.lock().running = [((0, t("light")), 60), ((0, t("heavy")), 30)]
            .into_iter()
            .collect();
        gate2.state.lock().running = [((0, t("heavy")), 30)].into_iter().collect();
        let round = |me| Sync {
            script: &script,
            cfg: &cfg,
            me,
            every: Duration::from_secs(60),
        };
        let mut rounds = 0;
        let mut sync = async |me: &'static str, gate: &Gate| {
            let ok = round(me)
                .run(manager.clone(), &mut rounds, gate, 96, false)
                .await;
            assert!(ok, "{me}'s round");
        };
        sync("gw1", &gate1).await;
        sync("gw2", &gate2).await;
        sync("gw1", &gate1).await;
        let now = Instant::now();
        assert_eq!(gate1.state.lock().part(now), Some(72));
        assert_eq!(gate2.state.lock().part(now), Some(24));
        let mut seen = gate1.state.lock().others_want.clone();
        seen.sort();
        assert_eq!(seen, [w(0, "heavy", 0), w(0, "heavy", 30)]);
        let left: Vec<String> = redis::cmd("HKEYS")
            .arg(format!("{}:flow:{{m}}:wants", cfg.key_prefix))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(!left.contains(&"gone".to_string()), "{left:?}");
        assert!(left.contains(&"quiet".to_string()), "{left:?}");
        // Gateway 2's tenants want nothing now: it withdraws, and gateway 1
        // has no part any more.
        gate2.state.lock().running.clear();
        sync("gw2", &gate2).await;
        sync("gw1", &gate1).await;
        assert_eq!(gate1.state.lock().part(Instant::now()), None);
        assert_eq!(gate1.state.lock().others_want, [w(0, "heavy", 0)]);
    }

    #[tokio::test]
    async fn a_round_whose_answer_was_lost_is_sent_again_and_applied_once() {
        let redis = crate::limits::tests::redis_server().await;
        let (cfg, manager) = store(&redis, "share");
        let script = Script::new(SYNC);
        let gate = Gate {
            model: t("m"),
            state: Mutex::new(GateState::default()),
            pending: AtomicU32::new(0),
        };
        let mut rounds = 0;
        let round = Sync {
            script: &script,
            cfg: &cfg,
            me: "gw",
            every: Duration::from_millis(250),
        };
        // A first round, confirmed: the baseline.
        assert!(
            round
                .run(manager.clone(), &mut rounds, &gate, 0, false)
                .await
        );
        // Round 2 reached Redis but its answer was lost (here: sent outside
        // `sync`), so it is still unconfirmed here.
        let lost = vec![(t("a"), 10.0)];
        let mut conn = manager.clone();
        let _: Reply = invocation(
            &script,
            &cfg,
            "m",
            "gw",
            2,
            "",
            Duration::from_secs(1),
            &lost,
        )
        .invoke_async(&mut conn)
        .await
        .unwrap();
        rounds = 2;
        gate.state.lock().unconfirmed = Some(Round {
            number: 2,
            increments: lost,
        });
        // Sent again: Redis does not add it twice, and none of it is
        // mistaken for another gateway's service.
        assert!(
            round
                .run(manager.clone(), &mut rounds, &gate, 0, false)
                .await
        );
        {
            let st = gate.state.lock();
            assert!(st.unconfirmed.is_none());
            assert_eq!(st.ledger[&t("a")].own, 10.0);
            assert_eq!(st.ledger[&t("a")].others, Some(0.0));
        }
        // The next round's increments are added once.
        gate.state.lock().outbox.insert(t("a"), 5.0);
        assert!(
            round
                .run(manager.clone(), &mut rounds, &gate, 0, false)
                .await
        );
        let total: f64 = redis::cmd("HGET")
            .arg(format!("{}:flow:{{m}}:service", cfg.key_prefix))
            .arg("a")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(total, 15.0);
        assert_eq!(gate.state.lock().ledger[&t("a")].others, Some(0.0));
    }
}
