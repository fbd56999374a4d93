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
//! Redis down: the round's increments are kept for the next round, each
//! gateway goes on ordering by what it knows
//! (`sluice_flow_share_syncs_total{outcome="error"}`).

use std::sync::{Arc, Weak};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Script};

use super::{Gate, GateState, Shared};
use crate::config::RedisConfig;

/// KEYS: the model's service hash. ARGV: tenant, increment, tenant, ...
/// Returns the hash (field, value, ...).
const SYNC: &str = r#"
for i = 1, #ARGV - 1, 2 do
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('PEXPIRE', KEYS[1], 3600000)
return redis.call('HGETALL', KEYS[1])
"#;

/// Per tenant: what this gateway added to the shared total, and the others'
/// part of it at the last round (`None` until first seen).
#[derive(Default)]
pub(super) struct Ledger {
    own: f64,
    others: Option<f64>,
}

/// Sync every gate of `shared` until it is dropped.
pub(super) fn spawn(shared: Weak<Shared>) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    rt.spawn(async move {
        let script = Script::new(SYNC);
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
            let Some((cfg, _)) = &rules.share else {
                continue;
            };
            if conn.as_ref().is_none_or(|(c, _)| c != cfg) {
                conn = connect(cfg).map(|m| (cfg.clone(), m));
            }
            let Some((cfg, manager)) = &conn else {
                continue;
            };
            let gates: Vec<Arc<Gate>> = shared.gates.lock().values().cloned().collect();
            for gate in gates {
                let ok = sync(&script, manager.clone(), cfg, &gate).await;
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

/// One round for one model: send its increments, take in the totals.
async fn sync(
    script: &Script,
    mut conn: ConnectionManager,
    cfg: &RedisConfig,
    gate: &Gate,
) -> bool {
    let sent: Vec<(Arc<str>, f64)> = gate.state.lock().outbox.drain().collect();
    let mut inv = script.prepare_invoke();
    inv.key(format!(
        "{}:flow:{{{}}}:service",
        cfg.key_prefix, gate.model
    ));
    for (tenant, amount) in &sent {
        inv.arg(&**tenant).arg(*amount);
    }
    let reply: Option<Vec<(String, f64)>> =
        tokio::time::timeout(cfg.timeout, inv.invoke_async(&mut conn))
            .await
            .ok()
            .and_then(Result::ok);
    let mut st = gate.state.lock();
    match reply {
        Some(totals) => {
            absorb(&mut st, &sent, totals);
            true
        }
        None => {
            // Not counted there: send again next round.
            for (tenant, amount) in sent {
                *st.outbox.entry(tenant).or_default() += amount;
            }
            false
        }
    }
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
    use super::*;

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
}
