//! Room on a replica, and the rules flow control reads from the config.
//!
//! A replica is full when the engine says so: its last fresh scrape and the
//! one before both show requests waiting (`LoadSample::queued`: a queue that
//! outlives a scrape interval is one the engine could not take in). Its KV
//! usage is not a stop sign: engines run their KV cache near full at full
//! batch, and one that runs out of blocks queues or preempts, which shows.
//! (`routing.prefix_kv.kv_high` and `queue_high`, off by default, add
//! thresholds of the operator's own.) Otherwise, when its seats are known
//! (`backends[].max_concurrency`, or learned from its scrapes by the pool:
//! what runs while the engine queues, probed upward while it does not), the
//! room is the seats less what occupies them (`Replica::busy`: this
//! gateway's requests in flight there, live, and other gateways', seen at the
//! last scrape), less the streams about to end. Seats unknown and no queue:
//! open. An engine that schedules by priority (`backends[].engine_priority`)
//! still takes the top band while it queues, within its seats: it serves
//! that band ahead of its own queue.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{Config, EnginePriority, RedisConfig, StoreKind};
use crate::upstream::pool::Replica;

/// What a replica (or a model) can take now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Room {
    /// No known limit and no pressure.
    Open,
    /// This many more requests: for the top band (streams about to end
    /// count as gone), and for the others (they do not); of `seats` in all.
    Seats { top: u32, rest: u32, seats: u32 },
}

/// The parts of the config flow control decides by.
pub(crate) struct Rules {
    pub enabled: bool,
    pub max_queue: usize,
    pub output_weight: f64,
    pub recheck: Duration,
    max_wait: Duration,
    kv_high: Option<f64>,
    queue_high: Option<f64>,
    /// `None`: scraping is off (no pressure information).
    stale_after: Option<Duration>,
    /// Tier name -> (band, max_wait).
    tiers: HashMap<String, (i32, Option<Duration>)>,
    /// The bands, highest first: every tier's priority and 0.
    pub bands: Vec<i32>,
    labels: HashMap<i32, Arc<str>>,
    /// Where and how often attained service is shared between gateways
    /// (`None`: not shared).
    pub share: Option<(RedisConfig, Duration)>,
}

impl Rules {
    pub(crate) fn from_config(c: &Config) -> Self {
        let f = &c.flow_control;
        let tiers: HashMap<String, (i32, Option<Duration>)> = c
            .tiers
            .iter()
            .map(|(name, t)| (name.clone(), (t.priority, t.max_wait)))
            .collect();
        let mut bands: Vec<i32> = tiers.values().map(|(b, _)| *b).collect();
        bands.push(0);
        bands.sort_unstable_by(|a, b| b.cmp(a));
        bands.dedup();
        let labels = bands
            .iter()
            .map(|b| (*b, Arc::from(b.to_string().as_str())))
            .collect();
        let m = &c.routing.metrics;
        Self {
            enabled: f.enabled,
            max_queue: f.max_queue,
            output_weight: f.output_weight,
            recheck: f.recheck,
            max_wait: f.max_wait,
            kv_high: c.routing.prefix_kv.kv_high,
            queue_high: c.routing.prefix_kv.queue_high,
            stale_after: m.enabled.then_some(m.stale_after),
            tiers,
            bands,
            labels,
            share: (f.share_fairness && c.rate_limits.store == StoreKind::Redis)
                .then(|| (c.rate_limits.redis.clone(), f.share_interval)),
        }
    }

    /// A request's band: its tier's priority (0 without a tier), lowered by
    /// `asked` if that is lower, snapped down to a configured band (so the
    /// `band` label stays a closed set).
    pub(crate) fn band(&self, tier: Option<&str>, asked: Option<i32>) -> i32 {
        let own = tier.and_then(|t| self.tiers.get(t)).map_or(0, |(b, _)| *b);
        let want = asked.map_or(own, |a| a.min(own));
        self.bands
            .iter()
            .copied()
            .find(|&b| b <= want)
            .or_else(|| self.bands.last().copied())
            .unwrap_or(0)
    }

    /// Whether `band` is the highest configured.
    pub(crate) fn is_top(&self, band: i32) -> bool {
        self.bands.first().is_none_or(|&top| band >= top)
    }

    pub(crate) fn max_wait(&self, tier: Option<&str>) -> Duration {
        tier.and_then(|t| self.tiers.get(t))
            .and_then(|(_, w)| *w)
            .unwrap_or(self.max_wait)
    }

    pub(crate) fn band_label(&self, band: i32) -> Arc<str> {
        self.labels
            .get(&band)
            .cloned()
            .unwrap_or_else(|| Arc::from(band.to_string().as_str()))
    }

    /// The room on `r` at `now`. Streams about to end leave seats only to
    /// the top band: a lower band sent there would queue in the engine, ahead
    /// of whatever comes next, for the few steps those streams have left.
    pub(crate) fn room(&self, r: &Replica, now: Instant) -> Room {
        let fresh = self.stale_after.and_then(|max_age| {
            r.load()
                .filter(|s| now.saturating_duration_since(s.at) <= max_age)
        });
        let busy = r.busy();
        if let Some(s) = &fresh
            && (s.queued
                || self.kv_high.is_some_and(|k| s.kv_usage.unwrap_or(0.0) >= k)
                || self
                    .queue_high
                    .is_some_and(|q| s.queue().unwrap_or(0.0) >= q))
        {
            let seats = r.seats().unwrap_or(0);
            // An engine that schedules by priority (`engine_priority`) takes
            // the top band ahead of its own queue: held here, a premium
            // request would wait for the next scrape to show the queue gone
            // instead of the engine's next free slot. Its seats still bound
            // it (the gate keeps premium's fairness and its flood out).
            let ahead = r.engine_priority != EnginePriority::Off
                && s.queued
                && self.kv_high.is_none_or(|k| s.kv_usage.unwrap_or(0.0) < k)
                && self.queue_high.is_none_or(|q| s.queue().unwrap_or(0.0) < q);
            let top = if ahead {
                seats.saturating_sub(busy.saturating_sub(r.leaving()))
            } else {
                0
            };
            return Room::Seats {
                top,
                rest: 0,
                seats,
            };
        }
        let Some(seats) = r.seats() else {
            return Room::Open;
        };
        Room::Seats {
            top: seats.saturating_sub(busy.saturating_sub(r.leaving())),
            rest: seats.saturating_sub(busy),
            seats,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TierConfig;

    fn rules(tiers: &[(&str, i32)]) -> Rules {
        let mut c = Config::default();
        for (name, p) in tiers {
            c.tiers.insert(
                name.to_string(),
                TierConfig {
                    priority: *p,
                    ..TierConfig::default()
                },
            );
        }
        Rules::from_config(&c)
    }

    #[test]
    fn bands_come_from_tiers_and_a_request_can_only_lower_its_own() {
        let r = rules(&[("premium", 10), ("free", -5), ("std", 0)]);
        assert_eq!(r.bands, [10, 0, -5]);
        assert_eq!(r.band(Some("premium"), None), 10);
        assert_eq!(r.band(Some("premium"), Some(100)), 10, "never raised");
        assert_eq!(r.band(Some("premium"), Some(3)), 0, "snapped down");
        assert_eq!(r.band(Some("free"), Some(-100)), -5, "lowest band");
        assert_eq!(r.band(None, None), 0);
        assert_eq!(r.band(Some("unknown"), None), 0);
        assert_eq!(&*r.band_label(-5), "-5");
    }
}
