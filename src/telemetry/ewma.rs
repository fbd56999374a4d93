//! A moving average in an atomic, for what routing and the pool learn from
//! requests (recent latency, calibrated rates).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::metrics::epoch;

/// An exponentially weighted moving average (weight 0.2 per sample) in an
/// atomic, with the time of its last sample: racing updates may lose a
/// sample, never corrupt the value.
#[derive(Debug, Default)]
pub struct Ewma {
    bits: AtomicU64,
    /// Nanoseconds since [`epoch`] of the last sample (0: none).
    at: AtomicU64,
}

impl Ewma {
    pub(crate) fn observe(&self, v: f64) {
        let old = f64::from_bits(self.bits.load(Relaxed));
        let new = if old == 0.0 { v } else { old * 0.8 + v * 0.2 };
        self.bits.store(new.to_bits(), Relaxed);
        let ns = u64::try_from(since_epoch().as_nanos()).unwrap_or(u64::MAX);
        self.at.store(ns.max(1), Relaxed);
    }

    pub(crate) fn get(&self) -> Option<f64> {
        let v = f64::from_bits(self.bits.load(Relaxed));
        (v > 0.0).then_some(v)
    }

    /// The average if its last sample is younger than `max_age`.
    pub(crate) fn fresh(&self, max_age: std::time::Duration) -> Option<f64> {
        let at = self.at.load(Relaxed);
        let age_ns = since_epoch().as_nanos().saturating_sub(u128::from(at));
        (at != 0 && age_ns <= max_age.as_nanos())
            .then(|| self.get())
            .flatten()
    }
}

/// The time since [`epoch`], by the turn's clock (`crate::turn`).
fn since_epoch() -> std::time::Duration {
    crate::turn::now_std().saturating_duration_since(epoch())
}
