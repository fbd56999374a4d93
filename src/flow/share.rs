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

use std::sync::{Arc, Weak};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Script};

use super::{Gate, GateState, Shared};
use crate::config::RedisConfig;

/// KEYS: the model's service hash, this gateway's last applied round (a
/// key per gateway process, so a stopped one's expires). ARGV: round
/// number, then tenant, increment, tenant, ... A round at or below the last
/// applied one is not applied again (a resend whose first answer was lost);
/// a round with no increments only reads (no write). Returns the service
/// hash (field, value, ...).
const SYNC: &str = r#"
if #ARGV > 1 then
  local last = tonumber(redis.call('GET', KEYS[2]) or '0')
  local round = tonumber(ARGV[1])
  if round > last then
    for i = 2, #ARGV - 1, 2 do
      redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
    end
    redis.call('SET', KEYS[2], ARGV[1], 'PX', 3600000)
    redis.call('PEXPIRE', KEYS[1], 3600000)
  end
end
return redis.call('HGETALL', KEYS[1])
"#;

/// Per tenant: what this gateway added to the shared total, and the others'
/// part of it at the last round (`None` until first seen).
#[derive(Default)]
pub(super) struct Ledger {
    own: f64,
    others: Option<f64>,
}

/// A round sent and not yet confirmed: sent again as it is, with its
/// number, until Redis answers.
pub(super) struct Round {
    number: u64,
    increments: Vec<(Arc<str>, f64)>,
}

/// Sync every gate of `shared` until it is dropped.
pub(super) fn spawn(shared: Weak<Shared>) {
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
            tokio::time::sleep(interval).await;
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let rules = shared.rules.load_full();
            let gates: Vec<Arc<Gate>> = shared.gates.lock().values().cloned().collect();
            let Some((cfg, _)) = &rules.share else {
                // Off: nothing is kept for a later round.
                conn = None;
                for gate in &gates {
                    gate.state.lock().outbox.clear();
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
                        sync(&script, manager.clone(), cfg, &me, &mut rounds, &gate).await
                    }
                    None => false,
                };
                shared
                    .metrics
                    .flow_share_syncs
                    .get(&(if ok { "ok" } else { "error" },))
                    .inc();
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

/// One round for one model: send its increments (or the unconfirmed round
/// again), take in the totals.
async fn sync(
    script: &Script,
    mut conn: ConnectionManager,
    cfg: &RedisConfig,
    me: &str,
    rounds: &mut u64,
    gate: &Gate,
) -> bool {
    let (number, sent) = {
        let mut guard = gate.state.lock();
        let st = &mut *guard;
        let round = st.unconfirmed.get_or_insert_with(|| {
            *rounds += 1;
            Round {
                number: *rounds,
                increments: st.outbox.drain().collect(),
            }
        });
        (round.number, round.increments.clone())
    };
    let inv = invocation(script, cfg, &gate.model, me, number, &sent);
    let reply: Option<Vec<(String, f64)>> =
        tokio::time::timeout(cfg.timeout, inv.invoke_async(&mut conn))
            .await
            .ok()
            .and_then(Result::ok);
    let Some(totals) = reply else {
        // Perhaps applied there, perhaps not: the same round goes again.
        return false;
    };
    let mut st = gate.state.lock();
    st.unconfirmed = None;
    absorb(&mut st, &sent, totals);
    true
}

/// The script's call for one round of one model.
fn invocation<'a>(
    script: &'a Script,
    cfg: &RedisConfig,
    model: &str,
    me: &str,
    number: u64,
    sent: &[(Arc<str>, f64)],
) -> redis::ScriptInvocation<'a> {
    let mut inv = script.prepare_invoke();
    let base = format!("{}:flow:{{{model}}}", cfg.key_prefix);
    inv.key(format!("{base}:service"))
        .key(format!("{base}:round:{me}"))
        .arg(number);
    for (tenant, amount) in sent {
        inv.arg(&**tenant).arg(*amount);
    }
    inv
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

    #[tokio::test]
    async fn a_round_whose_answer_was_lost_is_sent_again_and_applied_once() {
        let redis = crate::limits::tests::redis_server().await;
        let cfg = RedisConfig {
            url: Secret::new(format!("redis://127.0.0.1:{}", redis.port)),
            key_prefix: format!("share{}", fastrand::u64(..)),
            timeout: Duration::from_secs(2),
        };
        let manager = connect(&cfg).unwrap();
        let script = Script::new(SYNC);
        let gate = Gate {
            model: t("m"),
            state: Mutex::new(GateState::default()),
            pending: AtomicU32::new(0),
        };
        let mut rounds = 0;
        // A first round, confirmed: the baseline.
        assert!(sync(&script, manager.clone(), &cfg, "gw", &mut rounds, &gate).await);
        // Round 2 reached Redis but its answer was lost (here: sent outside
        // `sync`), so it is still unconfirmed here.
        let lost = vec![(t("a"), 10.0)];
        let mut conn = manager.clone();
        let _: Vec<(String, f64)> = invocation(&script, &cfg, "m", "gw", 2, &lost)
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
        assert!(sync(&script, manager.clone(), &cfg, "gw", &mut rounds, &gate).await);
        {
            let st = gate.state.lock();
            assert!(st.unconfirmed.is_none());
            assert_eq!(st.ledger[&t("a")].own, 10.0);
            assert_eq!(st.ledger[&t("a")].others, Some(0.0));
        }
        // The next round's increments are added once.
        gate.state.lock().outbox.insert(t("a"), 5.0);
        assert!(sync(&script, manager.clone(), &cfg, "gw", &mut rounds, &gate).await);
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
