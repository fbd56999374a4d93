//! Flow control: when no replica of a model can take more work, requests
//! wait at the gateway, leave by priority band and fairly between tenants,
//! and are answered 503 with `Retry-After` when their wait runs out.
//!
//! Between admission (rate limits) and routing, each request asks its
//! model's [`Gate`] for a [`Seat`]. The gate counts the room left on the
//! model's replicas (`room`: each replica's seats, configured or learned from
//! its own metrics, minus what runs there: this gateway's in-flight count,
//! live, plus what other gateways had there at the last scrape, less the
//! streams about to finish; none at all under KV or queue pressure). A
//! request goes at once when nothing of its band or above waits and the room
//! exceeds the **headroom** kept for the bands above it; otherwise it waits
//! in the gate's [`Queue`] (memory only: it holds no replica, no connection).
//!
//! Headroom: for each band, the larger of its recent peak of requests in
//! flight (decaying with a half-life of [`DEMAND_HALF_LIFE`]) and the 99th
//! percentile of Poisson arrivals around its mean concurrency; a lower band
//! may not take the seats a higher band will want back (at most half of
//! them). So a premium request arriving at a full fleet finds a seat free
//! instead of waiting for one, and the reserve is sized from the traffic,
//! not a constant.
//!
//! Gateways sharing a Redis store also split the seats: while the tenants of
//! all gateways want more than a model has, each fills at most its part
//! (`share`).
//!
//! A seat is handed over when a request ends (its [`Seat`] is dropped last in
//! the request guard's end), when a granted request gives up before being
//! sent, and while anything waits every `flow_control.recheck` (scraped
//! pressure changes without any request ending).

mod queue;
pub(crate) mod room;
mod share;

use foldhash::{HashMap, HashMapExt as _};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::config::Config;
use crate::error::GatewayError;
use crate::telemetry::metrics::Metrics;
use crate::telemetry::registry::{Counter, Histogram};
use crate::turn;
use crate::upstream::pool::{Pool, Replica};
use queue::Queue;
use room::{Room, Rules};

/// How fast a band's remembered peak of requests in flight fades.
pub(crate) const DEMAND_HALF_LIFE: Duration = Duration::from_secs(30);

/// Output tokens assumed for fairness when a request sets no `max_tokens`
/// (corrected with its real usage when it ends).
const DEFAULT_OUTPUT: f64 = 256.0;

/// Flow control of every model; kept across config reloads (waiters and
/// fairness carry on), with the new rules applied.
pub struct Flow {
    shared: Arc<Shared>,
}

struct Shared {
    gates: Mutex<HashMap<Arc<str>, Arc<Gate>>>,
    rules: ArcSwap<Rules>,
    metrics: Arc<Metrics>,
    /// The sharing's last round, asked for by [`Flow::leave`].
    leaving: Arc<share::Leaving>,
}

/// One request's question to flow control.
pub(crate) struct Ask {
    pub model: Arc<str>,
    /// The caller's tier (`None`: an open gateway).
    pub tier: Option<Arc<str>>,
    /// Who shares fairly (the key's name; "" for everyone else).
    pub tenant: Arc<str>,
    /// `x-sluice-priority`, when sent.
    pub asked_priority: Option<i32>,
    /// `x-sluice-ttft-objective`, when sent: orders the tenant's own waiters.
    pub ttft_objective: Option<Duration>,
    pub prompt_tokens: u32,
    pub max_tokens: Option<u32>,
}

/// How a request passed flow control.
pub(crate) struct Passed {
    pub seat: Seat,
    pub band: i32,
    pub waited: Duration,
    /// `immediate` or `waited`.
    pub outcome: &'static str,
}

impl Flow {
    pub(crate) fn new(config: &Config, metrics: Arc<Metrics>) -> Self {
        let shared = Arc::new(Shared {
            gates: Mutex::new(HashMap::new()),
            rules: ArcSwap::from_pointee(Rules::from_config(config)),
            metrics,
            leaving: Arc::default(),
        });
        // Idle (one timer a second) until the config shares fairness;
        // ends with the last reference, or after `leave`.
        share::spawn(Arc::downgrade(&shared), shared.leaving.clone());
        Self { shared }
    }

    /// A gateway that stops, once drained: the fairness sharing's last
    /// round sends the service given since the one before (or, after
    /// Redis trouble, the round it had not confirmed) and withdraws this
    /// gateway's wants (the other gateways' parts stop counting them at
    /// their next round, not four rounds later), then no round follows.
    /// Bounded by the store's timeout a round; at once when nothing is
    /// shared.
    pub(crate) async fn leave(&self) {
        let Some((cfg, _)) = self.shared.rules.load().share.clone() else {
            return;
        };
        // A regular round under way first, then the last: a round a model.
        let rounds = u32::try_from(self.shared.gates.lock().len()).unwrap_or(u32::MAX);
        let bound = cfg
            .timeout
            .saturating_mul(rounds.saturating_mul(2).saturating_add(1));
        self.shared.leaving.ask.notify_one();
        if tokio::time::timeout(bound, self.shared.leaving.done.notified())
            .await
            .is_err()
        {
            tracing::warn!(
                "the last fairness round did not finish; other gateways drop its wants in four rounds"
            );
        }
    }

    /// The same flow control under a reloaded config.
    pub(crate) fn reconfigured(&self, config: &Config) -> Self {
        self.shared
            .rules
            .store(Arc::new(Rules::from_config(config)));
        Self {
            shared: self.shared.clone(),
        }
    }

    /// The band a request gets: its tier's priority, lowered (never raised)
    /// by `asked`, snapped to a configured band.
    pub(crate) fn band(&self, tier: Option<&str>, asked: Option<i32>) -> i32 {
        self.shared.rules.load().band(tier, asked)
    }

    /// Wait for a seat for `ask`, up to its tier's `max_wait`. `None` when
    /// flow control is off.
    pub(crate) async fn admit(
        &self,
        pool: &Arc<Pool>,
        candidates: &[Arc<Replica>],
        ask: Ask,
    ) -> Result<Option<Passed>, GatewayError> {
        let rules = self.shared.rules.load_full();
        if !rules.enabled {
            return Ok(None);
        }
        let arrival = turn::now();
        let band = rules.band(ask.tier.as_deref(), ask.asked_priority);
        let max_wait = rules.max_wait(ask.tier.as_deref());
        let output = ask.max_tokens.map_or(DEFAULT_OUTPUT, f64::from);
        let cost = f64::from(ask.prompt_tokens) + rules.output_weight * output;
        let gate = self.gate(&ask.model, &rules);
        let m = &self.shared.metrics;
        // The series' labels are made only where a series is looked up: on
        // the common path (admitted at once, its series kept in the gate)
        // they cost no reference counts.
        let outcome = |o: &'static str, waited: Duration| {
            let band = rules.band_label(band);
            m.flow_requests
                .get(&(ask.model.clone(), band.clone(), o))
                .inc();
            m.flow_wait
                .get(&(ask.model.clone(), band))
                .observe(waited.as_secs_f64());
        };

        // At once, when nothing of this band or above waits and there is room.
        // (The waiter's channel is made only for a waiter: it allocates.)
        let (id, mut rx) = {
            let mut st = gate.state.lock();
            if st.pool.as_ptr() != Arc::as_ptr(pool) {
                st.pool = Arc::downgrade(pool);
            }
            let free = gate.free_on(candidates, &rules, arrival.into_std());
            let free = st.within_part(free, arrival, &rules);
            if st.queue.at_or_above(band) == 0
                && free.admits(band, &rules, st.reserve(band, arrival))
            {
                let seat = gate.grant(&mut st, &self.shared, pool, band, ask.tenant, cost, arrival);
                // Counted under the gate's lock: two atomic adds, no handle
                // cloned out.
                let (count, wait) = st.immediate.entry(band).or_insert_with(|| {
                    let label = rules.band_label(band);
                    (
                        m.flow_requests
                            .get(&(ask.model.clone(), label.clone(), "immediate")),
                        m.flow_wait.get(&(ask.model.clone(), label)),
                    )
                });
                count.inc();
                wait.observe(0.0);
                drop(st);
                return Ok(Some(Passed {
                    seat,
                    band,
                    waited: Duration::ZERO,
                    outcome: "immediate",
                }));
            }
            let mut shed = None;
            if st.queue.len() >= rules.max_queue {
                match st.queue.lowest_band() {
                    Some(low) if low < band => shed = st.queue.pop_lowest_newest(),
                    _ => {
                        let retry_after = st.retry_after(band, max_wait);
                        drop(st);
                        outcome("shed_overflow", Duration::ZERO);
                        return Err(GatewayError::Overloaded {
                            model: ask.model.to_string(),
                            waited: Duration::ZERO,
                            retry_after,
                            timed_out: false,
                        });
                    }
                }
            }
            let deadline = arrival + ask.ttft_objective.unwrap_or(max_wait);
            let (tx, rx) = oneshot::channel();
            let id = st.queue.push(band, ask.tenant.clone(), cost, deadline, tx);
            self.shared.set_waiting(&gate, &st.queue, &rules);
            drop(st);
            // The shed waiter's channel closes: it answers 503 itself.
            drop(shed);
            (id, rx)
        };
        let waiting = Waiting {
            gate: gate.clone(),
            flow: self,
            band,
            tenant: ask.tenant.clone(),
            id,
        };
        let deadline = arrival + max_wait;
        let mut recheck = tokio::time::interval_at(arrival + rules.recheck, rules.recheck);
        recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let result = loop {
            tokio::select! {
                biased;
                got = &mut rx => break got.map_err(|_| false),
                () = tokio::time::sleep_until(deadline) => break Err(true),
                _ = recheck.tick() => gate.dispatch(pool, &rules, &self.shared),
            }
        };
        drop(waiting);
        let waited = turn::now().saturating_duration_since(arrival);
        match result {
            Ok(seat) => {
                outcome("waited", waited);
                Ok(Some(Passed {
                    seat,
                    band,
                    waited,
                    outcome: "waited",
                }))
            }
            Err(timed_out) => {
                outcome(
                    if timed_out {
                        "shed_timeout"
                    } else {
                        "shed_overflow"
                    },
                    waited,
                );
                let retry_after = gate.state.lock().retry_after(band, max_wait);
                Err(GatewayError::Overloaded {
                    model: ask.model.to_string(),
                    waited,
                    retry_after,
                    timed_out,
                })
            }
        }
    }

    /// The model's gate, made on its first request (with a healthy zero
    /// waiting in each band, so the gauge is there before anything waits).
    fn gate(&self, model: &Arc<str>, rules: &Rules) -> Arc<Gate> {
        let mut gates = self.shared.gates.lock();
        // Found without cloning the key (`entry` takes it owned).
        if let Some(gate) = gates.get(model) {
            return gate.clone();
        }
        gates
            .entry(model.clone())
            .or_insert_with(|| {
                for &band in &rules.bands {
                    self.shared
                        .metrics
                        .flow_waiting
                        .get(&(model.clone(), rules.band_label(band)))
                        .set(0);
                }
                Arc::new(Gate {
                    model: model.clone(),
                    state: Mutex::new(GateState::default()),
                    pending: AtomicU32::new(0),
                })
            })
            .clone()
    }
}

impl Shared {
    fn set_waiting<T>(&self, gate: &Gate, queue: &Queue<T>, rules: &Rules) {
        for &band in &rules.bands {
            let n = queue.at_or_above(band) - queue.at_or_above(band.saturating_add(1));
            self.metrics
                .flow_waiting
                .get(&(gate.model.clone(), rules.band_label(band)))
                .set(n as i64);
        }
    }
}

/// A request waiting in the queue: leaving (dispatched, timed out, client
/// gone) takes it out at once.
struct Waiting<'a> {
    gate: Arc<Gate>,
    flow: &'a Flow,
    band: i32,
    tenant: Arc<str>,
    id: u64,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut st = self.gate.state.lock();
        let left = st.queue.remove(self.band, &self.tenant, self.id);
        if left.is_some() {
            let rules = self.flow.shared.rules.load();
            self.flow.shared.set_waiting(&self.gate, &st.queue, &rules);
        }
    }
}

/// Free seats of a model, for the top band and for the others (see
/// [`Rules::room`]).
#[derive(Debug, Clone, Copy)]
struct Free {
    top: u32,
    rest: u32,
    /// The replicas' seats in all.
    seats: u32,
    /// What is left of this gateway's part of the seats while gateways
    /// share them (`share::quota`; `u32::MAX`: no part in force).
    part: u32,
    /// The part holds the top band too (it is the only band).
    part_holds_top: bool,
}

impl Free {
    const OPEN: Free = Free {
        top: u32::MAX,
        rest: u32::MAX,
        seats: u32::MAX,
        part: u32::MAX,
        part_holds_top: false,
    };

    fn for_band(self, band: i32, rules: &Rules) -> u32 {
        if rules.is_top(band) {
            self.top
        } else {
            self.rest
        }
    }

    /// Whether a request of `band` may take a seat, leaving `reserve` to the
    /// bands above it, within this gateway's part if one is in force. The
    /// reserve never takes more than half the seats: a lower band is slowed
    /// down by it, never shut out. (The reserve is kept on the replicas'
    /// room, not on the part: the part already counts the higher bands'
    /// wants.)
    fn admits(self, band: i32, rules: &Rules, reserve: u32) -> bool {
        let held = self.part_holds_top || !rules.is_top(band);
        self.for_band(band, rules) > reserve.min(self.seats / 2) && (!held || self.part > 0)
    }

    /// At most `part` in flight from this gateway, which has `own`, while
    /// gateways share the model's seats (`share::quota`). The top band is
    /// held to it only where it is the only band: above other bands it
    /// keeps the engines' room (its wants are already first in every
    /// gateway's part, and a premium request arriving between rounds would
    /// otherwise wait for the next one).
    fn within(self, part: u32, own: u32, top_too: bool) -> Free {
        Free {
            part: part.saturating_sub(own),
            part_holds_top: top_too,
            ..self
        }
    }

    fn take_one(&mut self) {
        self.top = self.top.saturating_sub(1);
        self.rest = self.rest.saturating_sub(1);
        self.part = self.part.saturating_sub(1);
    }
}

/// Flow control of one model.
struct Gate {
    model: Arc<str>,
    state: Mutex<GateState>,
    /// Seats granted whose request has not been sent yet (not in any
    /// replica's in-flight count).
    pending: AtomicU32,
}

#[derive(Default)]
struct GateState {
    queue: Queue<oneshot::Sender<Seat>>,
    bands: HashMap<i32, BandLoad>,
    /// Seconds between grants, a moving average (for `Retry-After`).
    interval: Option<f64>,
    last_grant: Option<Instant>,
    /// Service given here since the last sync with the other gateways.
    outbox: HashMap<Arc<str>, f64>,
    /// Per tenant: the shared total's parts (`share`).
    ledger: HashMap<Arc<str>, share::Ledger>,
    /// A sync round with the other gateways has succeeded.
    synced: bool,
    /// The round sent and not yet confirmed by Redis.
    unconfirmed: Option<share::Round>,
    /// Granted here and not yet ended, by band and tenant (what each tenant
    /// has of the model's seats through this gateway).
    running: HashMap<(i32, Arc<str>), u32>,
    /// What the other gateways' tenants want of the model, as of the last
    /// round (`share`).
    others_want: Vec<share::Want>,
    /// This gateway's part of the model's seats while other gateways want
    /// them too, and until when it holds (`share::quota`).
    part: Option<(u32, Instant)>,
    /// The pool the last admission saw (the model's seats are counted over
    /// it for the part: `Gate::seats`).
    pool: std::sync::Weak<Pool>,
    /// By band: this model's `immediate` count and wait histogram,
    /// kept after their first lookup (two family lookups hashed the whole
    /// label set on every admission, ~450 instructions; these families
    /// never drop a series).
    immediate: HashMap<i32, (Arc<Counter>, Arc<Histogram>)>,
}

/// Requests of one band in flight, their recent peak and their mean.
#[derive(Default)]
struct BandLoad {
    in_flight: u32,
    peak: f64,
    at: Option<Instant>,
    /// Time-weighted mean of `in_flight` (time constant: the half-life's).
    mean: f64,
    mean_at: Option<Instant>,
}

/// The 99th percentile of a Poisson count is about its mean plus 2.33
/// standard deviations (sqrt of the mean).
const POISSON_P99_SIGMAS: f64 = 2.33;

impl BandLoad {
    fn decayed_peak(&self, now: Instant) -> f64 {
        let Some(at) = self.at else { return 0.0 };
        let age = now.saturating_duration_since(at).as_secs_f64();
        self.peak * 0.5f64.powf(age / DEMAND_HALF_LIFE.as_secs_f64())
    }

    fn mean(&self, now: Instant) -> f64 {
        let Some(at) = self.mean_at else { return 0.0 };
        let dt = now.saturating_duration_since(at).as_secs_f64();
        let tau = DEMAND_HALF_LIFE.as_secs_f64() / std::f64::consts::LN_2;
        let w = (-dt / tau).exp();
        w * self.mean + (1.0 - w) * f64::from(self.in_flight)
    }

    /// Seats the band may want at once: its recent peak, or the 99th
    /// percentile of Poisson arrivals around its mean concurrency, whichever
    /// is more.
    fn demand(&self, now: Instant) -> f64 {
        let m = self.mean(now);
        self.decayed_peak(now)
            .max(m + POISSON_P99_SIGMAS * m.sqrt())
            .max(f64::from(self.in_flight))
    }

    fn change(&mut self, now: Instant, up: bool) {
        self.mean = self.mean(now);
        self.mean_at = Some(now);
        if up {
            self.in_flight += 1;
            self.peak = self.decayed_peak(now).max(f64::from(self.in_flight));
            self.at = Some(now);
        } else {
            self.in_flight = self.in_flight.saturating_sub(1);
        }
    }
}

impl GateState {
    /// What each tenant wants of the model here: in flight plus waiting, by
    /// band.
    fn wants(&self) -> Vec<share::Want> {
        let mut by: HashMap<(i32, Arc<str>), u32> = self.running.clone();
        for (band, tenant, n) in self.queue.by_tenant() {
            *by.entry((band, tenant.clone())).or_default() += n as u32;
        }
        by.into_iter().map(|((b, t), n)| (b, t, n)).collect()
    }

    /// This gateway's part of the seats, while it holds.
    fn part(&self, now: Instant) -> Option<u32> {
        self.part.filter(|(_, until)| now < *until).map(|(p, _)| p)
    }

    /// `free` (the model's, seen at `now`) within this gateway's part of the
    /// seats, if one is in force.
    fn within_part(&self, free: Free, now: Instant, rules: &Rules) -> Free {
        match self.part(now) {
            Some(part) => {
                let own = self.bands.values().map(|l| l.in_flight).sum();
                free.within(part, own, rules.bands.len() == 1)
            }
            None => free,
        }
    }

    /// Seats band `band` must leave free for the bands above it.
    fn reserve(&self, band: i32, now: Instant) -> u32 {
        self.bands
            .iter()
            .filter(|(b, _)| **b > band)
            .map(|(_, l)| (l.demand(now) - f64::from(l.in_flight)).max(0.0).round() as u32)
            .sum()
    }

    /// When a request of `band` turned away should come back: the waiters at
    /// or above it times the recent time between grants.
    fn retry_after(&self, band: i32, max_wait: Duration) -> Duration {
        let ahead = self.queue.at_or_above(band) as f64 + 1.0;
        let secs = self.interval.map_or(1.0, |i| i * ahead);
        Duration::from_secs_f64(secs.clamp(1.0, max_wait.as_secs_f64().max(1.0)))
    }
}

impl Gate {
    /// Seats free on the model's replicas, less those granted and not yet
    /// sent; `u32::MAX` when some replica's seats are unknown and it is under
    /// no pressure.
    fn free(&self, pool: &Pool, rules: &Rules) -> Free {
        match pool.resolve(&self.model) {
            Ok(c) => self.free_on(&c.replicas, rules, turn::now_std()),
            // No replica at all: let the request through to fail as usual.
            Err(_) => Free::OPEN,
        }
    }

    /// The model's seats over the pool its last admission saw (`u32::MAX`:
    /// some unknown; 0: none known).
    fn seats(&self, rules: &Rules) -> u32 {
        let pool = self.state.lock().pool.upgrade();
        pool.map_or(0, |p| self.free(&p, rules).seats)
    }

    /// [`Gate::free`] over these replicas of the model.
    fn free_on(&self, replicas: &[Arc<Replica>], rules: &Rules, now: std::time::Instant) -> Free {
        let (mut top, mut rest, mut seats) = (0u32, 0u32, 0u32);
        for r in replicas {
            match rules.room(r, now) {
                Room::Open => return Free::OPEN,
                Room::Seats {
                    top: t,
                    rest: f,
                    seats: n,
                } => {
                    top = top.saturating_add(t);
                    rest = rest.saturating_add(f);
                    seats = seats.saturating_add(n);
                }
            }
        }
        let pending = self.pending.load(Relaxed);
        Free {
            top: top.saturating_sub(pending),
            rest: rest.saturating_sub(pending),
            seats,
            part: u32::MAX,
            part_holds_top: false,
        }
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "one grant's facts; two call sites"
    )]
    fn grant(
        self: &Arc<Self>,
        st: &mut GateState,
        shared: &Arc<Shared>,
        pool: &Arc<Pool>,
        band: i32,
        tenant: Arc<str>,
        cost: f64,
        now: Instant,
    ) -> Seat {
        self.pending.fetch_add(1, Relaxed);
        st.queue.charge(&tenant, cost);
        *st.outbox.entry(tenant.clone()).or_default() += cost;
        st.bands.entry(band).or_default().change(now, true);
        *st.running.entry((band, tenant.clone())).or_default() += 1;
        if let Some(last) = st.last_grant {
            let gap = now.saturating_duration_since(last).as_secs_f64();
            st.interval = Some(st.interval.map_or(gap, |i| 0.9 * i + 0.1 * gap));
        }
        st.last_grant = Some(now);
        Seat {
            gate: self.clone(),
            shared: shared.clone(),
            pool: pool.clone(),
            band,
            tenant,
            charged: cost,
            actual: None,
            pending: true,
            quiet: false,
        }
    }

    /// Hand free seats to waiters, highest band first.
    fn dispatch(self: &Arc<Self>, pool: &Arc<Pool>, rules: &Rules, shared: &Arc<Shared>) {
        let mut undelivered = Vec::new();
        {
            let mut st = self.state.lock();
            if st.queue.len() == 0 {
                return;
            }
            let now = turn::now();
            let mut free = st.within_part(self.free(pool, rules), now, rules);
            while let Some(band) = st.queue.highest_band() {
                if !free.admits(band, rules, st.reserve(band, now)) {
                    break;
                }
                let Some(w) = st.queue.pop() else { break };
                let seat = self.grant(&mut st, shared, pool, band, w.tenant.clone(), w.cost, now);
                match w.wake.send(seat) {
                    Ok(()) => free.take_one(),
                    Err(mut seat) => {
                        // It left in the meantime: the seat goes back, after
                        // the lock is released.
                        seat.quiet = true;
                        undelivered.push(seat);
                    }
                }
            }
            shared.set_waiting(self, &st.queue, rules);
        }
        drop(undelivered);
    }
}

/// A request's place in its model's capacity, from the grant to its end.
/// While `pending` (granted, not yet sent) it counts against the gate's
/// free seats; once sent, the replica's in-flight count holds it.
pub(crate) struct Seat {
    gate: Arc<Gate>,
    shared: Arc<Shared>,
    pool: Arc<Pool>,
    band: i32,
    tenant: Arc<str>,
    /// Weighted tokens charged to the tenant at the grant.
    charged: f64,
    /// The real cost, once known.
    actual: Option<f64>,
    pending: bool,
    /// Given back inside the gate's lock: do not dispatch from its drop.
    quiet: bool,
}

impl Seat {
    /// The request was sent to a replica (its in-flight count holds it now).
    pub(crate) fn sent(&mut self) {
        if std::mem::take(&mut self.pending) {
            self.gate.pending.fetch_sub(1, Relaxed);
        }
    }

    /// The tokens the request really used, for fairness.
    pub(crate) fn used(&mut self, prompt: u32, output: u32, output_weight: f64) {
        self.actual = Some(f64::from(prompt) + output_weight * f64::from(output));
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.sent();
        {
            let mut st = self.gate.state.lock();
            if let Some(l) = st.bands.get_mut(&self.band) {
                l.change(turn::now(), false);
            }
            let key = (self.band, self.tenant.clone());
            if let Some(n) = st.running.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    st.running.remove(&key);
                }
            }
            if self.quiet {
                return;
            }
            if let Some(actual) = self.actual {
                st.queue.adjust(&self.tenant, actual - self.charged);
                *st.outbox.entry(self.tenant.clone()).or_default() += actual - self.charged;
            }
            if st.queue.len() == 0 {
                return;
            }
        }
        let rules = self.shared.rules.load();
        self.gate.dispatch(&self.pool, &rules, &self.shared);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headroom_is_the_higher_bands_recent_peak_not_yet_back() {
        let now = Instant::now();
        let mut st = GateState::default();
        // Premium (band 10) peaked at 6 in flight; 2 run now.
        st.bands.insert(
            10,
            BandLoad {
                in_flight: 2,
                peak: 6.0,
                at: Some(now),
                ..BandLoad::default()
            },
        );
        st.bands.insert(
            0,
            BandLoad {
                in_flight: 30,
                peak: 30.0,
                at: Some(now),
                ..BandLoad::default()
            },
        );
        assert_eq!(st.reserve(0, now), 4, "band 0 leaves 4 seats for premium");
        assert_eq!(st.reserve(10, now), 0, "the top band reserves nothing");
        // Band 0 runs at its peak: below it, only premium's 4 are kept.
        assert_eq!(st.reserve(-5, now), 4);
        // The peak fades: after two half-lives a quarter is left (1.5 -> 2).
        let later = now + DEMAND_HALF_LIFE * 2;
        assert_eq!(st.reserve(0, later), 0);
        if let Some(l) = st.bands.get_mut(&10) {
            l.in_flight = 0;
        }
        assert_eq!(st.reserve(0, later), 2);
    }

    /// Tier `premium` (band 10) above band 0.
    fn premium_and_band_0() -> Rules {
        let mut c = crate::config::Config::default();
        c.tiers.insert(
            "premium".into(),
            crate::config::TierConfig {
                priority: 10,
                ..Default::default()
            },
        );
        Rules::from_config(&c)
    }

    #[test]
    fn the_reserve_slows_lower_bands_but_never_shuts_them_out() {
        let rules = premium_and_band_0();
        let free = Free {
            top: 3,
            rest: 2,
            seats: 100,
            ..Free::OPEN
        };
        assert!(free.admits(10, &rules, 0));
        assert!(free.admits(0, &rules, 1));
        assert!(!free.admits(0, &rules, 2), "the last two are kept");
        // Streams about to end free seats for the top band only.
        assert!(free.admits(10, &rules, 2));
        // One seat in all: a reserve cannot take it from band 0.
        let tiny = Free {
            top: 1,
            rest: 1,
            seats: 1,
            ..Free::OPEN
        };
        assert!(tiny.admits(0, &rules, 1));
    }

    #[test]
    fn a_gateways_part_of_the_seats_holds_the_lower_bands_and_a_lone_band() {
        let rules = premium_and_band_0();
        let free = Free {
            top: 10,
            rest: 8,
            seats: 96,
            ..Free::OPEN
        };
        // Part 30, 27 in flight here: 3 more for the lower band, the
        // reserve kept on the replicas' room (8 > 5), not on the part.
        let mut f = free.within(30, 27, false);
        assert!(f.admits(0, &rules, 5));
        for _ in 0..3 {
            f.take_one();
        }
        assert!(!f.admits(0, &rules, 0), "the part is used up");
        // Premium keeps the replicas' room above other bands.
        assert!(f.admits(10, &rules, 0));
        // The only band is held to the part too.
        let f = free.within(27, 27, true);
        assert!(!f.admits(10, &rules, 0));
        // Over its part (it shrank): nothing until requests end here.
        let f = free.within(20, 27, false);
        assert!(!f.admits(0, &rules, 0));
    }

    #[test]
    fn a_steady_band_keeps_room_for_its_poisson_bursts() {
        let t0 = Instant::now();
        let mut l = BandLoad::default();
        for _ in 0..4 {
            l.change(t0, true);
        }
        // Four in flight for ten minutes: the peak has faded to nothing, the
        // mean is 4, and its 99th percentile 4 + 2.33 x 2.
        let later = t0 + Duration::from_secs(600);
        assert!((l.mean(later) - 4.0).abs() < 0.01);
        assert!((l.demand(later) - 8.66).abs() < 0.01, "{}", l.demand(later));
        let mut st = GateState::default();
        st.bands.insert(10, l);
        assert_eq!(st.reserve(0, later), 5);
    }
}
