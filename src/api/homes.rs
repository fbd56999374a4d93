//! The shared table's prefix homes around a routing decision
//! (`routing::shared_table`): looked up before it, written after it. Used
//! by the proxy, the disaggregated prefill leg and the endpoint picker.

use std::sync::Arc;

use crate::routing::shared_table::{self, HomeWrite, Leg, TableHome};
use crate::routing::{Decision, ReplicaView, RouteCtx};
use crate::state::AppState;
use crate::upstream::pool::Replica;
use crate::vocab::RouteReason;

/// With shared prefix homes (`routing::shared_table`): a prompt whose
/// prefix no candidate holds in this gateway's index is looked up in the
/// shared table, and placed there when new (`leg`: the pool the decision is
/// for). `None`: no table, a prefix held here, a session that decides, or
/// the table did not answer. (`watched`: the request's first token is seen
/// when its prefill is done, a stream: another gateway's request for the
/// same prompt may wait for a cold prefill it starts.)
pub(crate) async fn table_home(
    state: &AppState,
    ctx: &RouteCtx<'_>,
    candidates: &[Arc<Replica>],
    view: fn(&Replica) -> ReplicaView,
    leg: Leg,
    watched: bool,
) -> Option<TableHome> {
    let table = state.shared_table.as_ref().filter(|t| t.homes)?;
    // Nothing to place: no prefix, or no choice (the views not built).
    if ctx.hashes.is_empty() || candidates.len() < 2 {
        return None;
    }
    let new = {
        let views: Vec<ReplicaView> = candidates.iter().map(|r| view(r)).collect();
        state.policy.new_home(ctx, &views)?
    };
    let order: Vec<Arc<str>> = new
        .order
        .iter()
        .map(|&i| candidates[i].name.clone())
        .collect();
    table
        .place_home(
            ctx.model,
            leg,
            new.key,
            &order,
            (new.open, new.queued),
            watched
                .then(|| crate::routing::prefilling::reach(ctx.hashes))
                .flatten(),
        )
        .await
}

/// With shared prefix homes: what `decision` (among `candidates`, for
/// `ctx`) tells the shared table, written in the background: a prefix
/// served at a holder keeps its home; one moved, or placed without the
/// table, is written over. Not a retry's (it goes elsewhere by design), nor
/// a decision a session made.
pub(crate) fn record_home(
    state: &AppState,
    ctx: &RouteCtx<'_>,
    candidates: &[Arc<Replica>],
    leg: Leg,
    decision: &Decision,
) {
    let Some(table) = state.shared_table.as_ref().filter(|t| t.homes) else {
        return;
    };
    let home_blocks = state.config.routing.prefix_kv.home_blocks;
    let Some(key) = shared_table::home_key(ctx.hashes, home_blocks) else {
        return;
    };
    let Some(replica) = candidates.get(decision.index).map(|r| &r.name) else {
        return;
    };
    let placed_now = ctx
        .shared_home
        .is_some_and(|h| h.new && h.replica == &**replica);
    let write = match decision.reason {
        _ if !decision.by_prefix => return,
        RouteReason::Affinity => HomeWrite::Touch,
        RouteReason::PrefixNew if placed_now => return,
        // Placed without the table while new prompts share nothing with it
        // (`SharedTable::novel`): written only if used again (a touch).
        RouteReason::PrefixNew if ctx.shared_home.is_none() && table.novel(ctx.model, leg) => {
            return;
        }
        RouteReason::PrefixNew | RouteReason::Rehome => HomeWrite::Move,
        _ => return,
    };
    let at = shared_table::HomeAt {
        model: ctx.model,
        leg,
        key,
        blocks: &ctx.hashes[..home_blocks.min(ctx.hashes.len())],
        replica,
    };
    table.write_home(&state.affinity, at, write, || {
        candidates.iter().map(|c| c.name.clone()).collect()
    });
}
