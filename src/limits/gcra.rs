//! The generic cell rate algorithm (GCRA) with variable cost, as one state per
//! bucket: its theoretical arrival time (TAT), the moment it would be full again.
//!
//! A bucket holds `capacity` units and refills one unit per `interval`. A
//! request of `cost` units is admitted if, after it, the bucket would not be
//! over-drawn: `max(TAT, now) + cost x interval - now <= capacity x interval`.
//! Settling a reservation moves TAT by the difference (a refund moves it back,
//! never before `now`). The Redis store runs the same arithmetic in Lua
//! (`limits/redis.rs`); tests pin both to the same results.

/// One limit: `capacity` units per `period_ms`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Rate {
    pub capacity: f64,
    /// Milliseconds per unit.
    pub interval_ms: f64,
}

impl Rate {
    pub(crate) fn per_minute(n: u32) -> Self {
        Self {
            capacity: f64::from(n),
            interval_ms: 60_000.0 / f64::from(n.max(1)),
        }
    }
}

/// What a bucket reports for the response headers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Window {
    pub limit: u32,
    pub remaining: u32,
    /// Milliseconds until the bucket is full again.
    pub reset_ms: f64,
}

/// The bucket's state as seen at `now`, without spending.
pub(crate) fn window(rate: Rate, tat: f64, now: f64) -> Window {
    let used = (tat.max(now) - now).max(0.0);
    let free = (rate.capacity * rate.interval_ms - used) / rate.interval_ms;
    Window {
        limit: rate.capacity as u32,
        remaining: free.max(0.0).floor() as u32,
        reset_ms: used,
    }
}

/// Spend `cost` units: the new TAT, or how long until it would fit.
pub(crate) fn spend(rate: Rate, tat: f64, now: f64, cost: f64) -> Result<f64, f64> {
    let new_tat = tat.max(now) + cost * rate.interval_ms;
    let over = new_tat - now - rate.capacity * rate.interval_ms;
    if over > 1e-6 { Err(over) } else { Ok(new_tat) }
}

/// Settle `delta` units after the fact (negative: refund).
pub(crate) fn settle(rate: Rate, tat: f64, now: f64, delta: f64) -> f64 {
    (tat + delta * rate.interval_ms).max(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_minute_of_burst_then_one_per_interval() {
        let r = Rate::per_minute(60);
        let (mut tat, now) = (0.0, 1000.0);
        for _ in 0..60 {
            tat = spend(r, tat, now, 1.0).unwrap_or(f64::NAN);
        }
        let wait = spend(r, tat, now, 1.0).err().unwrap_or_default();
        assert!((wait - 1000.0).abs() < 1e-6, "next one in 1 s, got {wait}");
        let w = window(r, tat, now);
        assert_eq!((w.limit, w.remaining), (60, 0));
        assert!((w.reset_ms - 60_000.0).abs() < 1e-6);
        assert!(spend(r, tat, now + 1000.0, 1.0).is_ok());
    }

    #[test]
    fn reservations_settle_both_ways() {
        let r = Rate::per_minute(600); // 100 ms per token
        let now = 0.0;
        let tat = spend(r, 0.0, now, 500.0).unwrap_or(f64::NAN);
        assert_eq!(window(r, tat, now).remaining, 100);
        let refunded = settle(r, tat, now, -480.0);
        assert_eq!(window(r, refunded, now).remaining, 580);
        let charged = settle(r, tat, now, 50.0);
        assert_eq!(window(r, charged, now).remaining, 50);
        assert_eq!(settle(r, tat, now, -10_000.0), now, "never before now");
        assert!(spend(r, 0.0, now, 601.0).is_err(), "larger than the bucket");
    }
}
