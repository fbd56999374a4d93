//! The fixed-timing mode (`--profile fixed`): every request gets the same
//! first-token delay and token gap, whatever the load.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::SimMetrics;
use super::slot::{Request, Slot};

/// The fixed-timing producer: first token at `first_at`, then one every
/// `token_delay`, independent of load (the overhead benchmarks want this).
pub(super) fn spawn(
    req: Request,
    slot: Arc<Slot>,
    first_at: Instant,
    token_delay: Duration,
    metrics: Arc<SimMetrics>,
) {
    metrics.running.inc();
    metrics.prompt_tokens.add(u64::from(req.prompt_tokens));
    tokio::spawn(async move {
        let mut at = first_at;
        let mut last: Option<Instant> = None;
        for n in 1..=req.output_tokens {
            tokio::select! {
                _ = tokio::time::sleep_until(at) => {}
                _ = slot.cancelled() => {}
            }
            if slot.is_cancelled() {
                metrics.running.dec();
                metrics.finished("abort");
                return;
            }
            let now = Instant::now();
            match last {
                None => metrics.ttft.observe_duration(now - req.arrival),
                Some(p) => metrics.itl.observe_duration(now - p),
            }
            last = Some(now);
            metrics.generation_tokens.inc();
            slot.push(n);
            at += token_delay;
            if let Some((after, d)) = req.stall
                && after == n
            {
                at += d;
            }
            if token_delay.is_zero() && n.is_multiple_of(16) {
                // As fast as possible, but let the streams run.
                tokio::task::yield_now().await;
            }
        }
        metrics.running.dec();
        metrics.e2e.observe_duration(req.arrival.elapsed());
        metrics.finished(req.finish_reason);
        slot.finish();
    });
}
