//! The waiting list of one model: bands, tenants, arrival order.
//!
//! Dispatch order: the highest band first; within a band, the tenant with
//! the least attained service (weighted tokens dispatched, see
//! `flow_control.output_weight`); within a tenant, earliest deadline first
//! (a request's TTFT objective, else its wait bound), then arrival order. A tenant
//! that starts waiting is brought up to the service of the last dispatch
//! (start-time fair queuing's virtual time), so a tenant idle for an hour
//! does not bank an hour of credit and a busy one is not punished forever.
//!
//! Plain data: no locks, no clocks, no I/O (the gate holds it under its lock).

use std::cmp::Reverse;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use foldhash::{HashMap, HashMapExt as _};
use tokio::time::Instant;

/// One waiting request; `T` is how it is told to go (a channel sender).
pub(super) struct Waiter<T> {
    pub(super) id: u64,
    pub(super) tenant: Arc<str>,
    /// Weighted tokens it will cost (charged when dispatched).
    pub(super) cost: f64,
    /// When it should have its first token (orders a tenant's own waiters).
    pub(super) deadline: Instant,
    pub(super) wake: T,
}

#[derive(Default)]
struct Band<T> {
    tenants: HashMap<Arc<str>, VecDeque<Waiter<T>>>,
    len: usize,
}

pub(super) struct Queue<T> {
    bands: BTreeMap<Reverse<i32>, Band<T>>,
    len: usize,
    next_id: u64,
    /// Attained service per tenant (weighted tokens).
    service: HashMap<Arc<str>, f64>,
    /// The service of the last dispatch (virtual time).
    vtime: f64,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Self {
            bands: BTreeMap::new(),
            len: 0,
            next_id: 0,
            service: HashMap::new(),
            vtime: 0.0,
        }
    }
}

/// Tenants remembered beyond those waiting, before the idle ones are
/// forgotten (they would start at the virtual time anyway).
const MAX_IDLE_TENANTS: usize = 4096;

impl<T> Queue<T> {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Waiting requests in `band` or above.
    pub(super) fn at_or_above(&self, band: i32) -> usize {
        self.bands.range(..=Reverse(band)).map(|(_, b)| b.len).sum()
    }

    pub(super) fn highest_band(&self) -> Option<i32> {
        self.bands.keys().next().map(|r| r.0)
    }

    pub(super) fn lowest_band(&self) -> Option<i32> {
        self.bands.keys().next_back().map(|r| r.0)
    }

    /// Add a waiter; returns its id.
    pub(super) fn push(
        &mut self,
        band: i32,
        tenant: Arc<str>,
        cost: f64,
        deadline: Instant,
        wake: T,
    ) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let idle = !self
            .bands
            .values()
            .any(|b| b.tenants.get(&tenant).is_some_and(|q| !q.is_empty()));
        if idle {
            let s = self.service.entry(tenant.clone()).or_insert(0.0);
            *s = s.max(self.vtime);
        }
        let b = self.bands.entry(Reverse(band)).or_insert_with(|| Band {
            tenants: HashMap::new(),
            len: 0,
        });
        let q = b.tenants.entry(tenant.clone()).or_default();
        let at = q
            .iter()
            .position(|w| w.deadline > deadline)
            .unwrap_or(q.len());
        q.insert(
            at,
            Waiter {
                id,
                tenant,
                cost,
                deadline,
                wake,
            },
        );
        b.len += 1;
        self.len += 1;
        id
    }

    /// Take waiter `id` out (it left, or its wait ran out).
    pub(super) fn remove(&mut self, band: i32, tenant: &str, id: u64) -> Option<Waiter<T>> {
        let b = self.bands.get_mut(&Reverse(band))?;
        let q = b.tenants.get_mut(tenant)?;
        let at = q.iter().position(|w| w.id == id)?;
        let w = q.remove(at)?;
        if q.is_empty() {
            b.tenants.remove(tenant);
        }
        b.len -= 1;
        self.len -= 1;
        if b.len == 0 {
            self.bands.remove(&Reverse(band));
        }
        Some(w)
    }

    /// Take the next waiter to dispatch (see [`Queue::charge`]).
    pub(super) fn pop(&mut self) -> Option<Waiter<T>> {
        let (&Reverse(band), b) = self.bands.iter().next()?;
        let service = &self.service;
        let tenant = b
            .tenants
            .iter()
            .filter_map(|(t, q)| q.front().map(|w| (t, w.id)))
            .min_by(|(ta, ia), (tb, ib)| {
                let sa = service.get(*ta).copied().unwrap_or(0.0);
                let sb = service.get(*tb).copied().unwrap_or(0.0);
                sa.total_cmp(&sb).then(ia.cmp(ib))
            })
            .map(|(t, _)| t.clone())?;
        let id = b.tenants.get(&tenant)?.front()?.id;
        self.remove(band, &tenant, id)
    }

    /// A request of `tenant` costing `cost` was dispatched (from the queue
    /// or at once): its service grows, and the virtual time follows.
    pub(super) fn charge(&mut self, tenant: &Arc<str>, cost: f64) {
        let s = self.service.entry(tenant.clone()).or_insert(0.0);
        self.vtime = self.vtime.max(*s);
        *s += cost;
        self.forget_idle();
    }

    /// Take the newest waiter of the lowest band (shed under overflow).
    pub(super) fn pop_lowest_newest(&mut self) -> Option<Waiter<T>> {
        let (&Reverse(band), b) = self.bands.iter().next_back()?;
        let (tenant, id) = b
            .tenants
            .iter()
            .filter_map(|(t, q)| q.back().map(|w| (t.clone(), w.id)))
            .max_by_key(|(_, id)| *id)?;
        self.remove(band, &tenant, id)
    }

    /// Requests waiting, by band and tenant.
    pub(super) fn by_tenant(&self) -> impl Iterator<Item = (i32, &Arc<str>, usize)> {
        self.bands
            .iter()
            .flat_map(|(band, b)| b.tenants.iter().map(|(t, q)| (band.0, t, q.len())))
    }

    /// Whether two tenants or more have a request waiting (in any band).
    pub(super) fn contended(&self) -> bool {
        let mut first: Option<&Arc<str>> = None;
        for t in self.bands.values().flat_map(|b| b.tenants.keys()) {
            match first {
                None => first = Some(t),
                Some(f) if f != t => return true,
                Some(_) => {}
            }
        }
        false
    }

    /// Service `tenant` was given elsewhere (other gateways): it counts
    /// against it here as if given here.
    pub(super) fn add_service(&mut self, tenant: &Arc<str>, amount: f64) {
        let vtime = self.vtime;
        let s = self.service.entry(tenant.clone()).or_insert(vtime);
        *s += amount;
    }

    #[cfg(test)]
    pub(super) fn service_of(&self, tenant: &str) -> Option<f64> {
        self.service.get(tenant).copied()
    }

    /// Correct a tenant's service once its real usage is known.
    pub(super) fn adjust(&mut self, tenant: &str, delta: f64) {
        if let Some(s) = self.service.get_mut(tenant) {
            *s = (*s + delta).max(0.0);
        }
    }

    /// Drop the service of tenants not waiting once there are many: they
    /// would be brought up to the virtual time when they next wait.
    fn forget_idle(&mut self) {
        if self.service.len() <= MAX_IDLE_TENANTS {
            return;
        }
        let bands = &self.bands;
        let vtime = self.vtime;
        self.service
            .retain(|t, s| *s > vtime || bands.values().any(|b| b.tenants.contains_key(t)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One deadline for every waiter of a test (arrival order decides).
    fn t0() -> Instant {
        static AT: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *AT.get_or_init(Instant::now)
    }

    #[test]
    fn a_tenants_own_waiters_go_by_deadline() {
        let mut q = Queue::default();
        let late = t0() + std::time::Duration::from_secs(30);
        let soon = t0() + std::time::Duration::from_millis(500);
        q.push(0, t("a"), 1.0, late, "first, no objective");
        q.push(0, t("a"), 1.0, soon, "second, 500 ms objective");
        q.push(0, t("a"), 1.0, late, "third");
        let order: Vec<_> = std::iter::from_fn(|| q.next()).collect();
        assert_eq!(
            order,
            ["second, 500 ms objective", "first, no objective", "third"]
        );
    }

    impl<T> Queue<T> {
        /// Dispatch the next waiter, as the gate does.
        fn next(&mut self) -> Option<T> {
            let w = self.pop()?;
            self.charge(&w.tenant, w.cost);
            Some(w.wake)
        }
    }

    fn t(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    #[test]
    fn higher_bands_go_first_then_arrival() {
        let mut q = Queue::default();
        q.push(0, t("a"), 1.0, t0(), "low-1");
        q.push(10, t("b"), 1.0, t0(), "high-1");
        q.push(0, t("a"), 1.0, t0(), "low-2");
        q.push(10, t("b"), 1.0, t0(), "high-2");
        assert_eq!(q.at_or_above(10), 2);
        assert_eq!(q.at_or_above(0), 4);
        let order: Vec<_> = std::iter::from_fn(|| q.next()).collect();
        assert_eq!(order, ["high-1", "high-2", "low-1", "low-2"]);
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn least_attained_service_within_a_band() {
        // A heavy tenant queued 10 requests before a light one queued 2: the
        // light one's are served as soon as its service is the lowest.
        let mut q = Queue::default();
        for i in 0..10 {
            q.push(0, t("heavy"), 100.0, t0(), format!("h{i}"));
        }
        q.push(0, t("light"), 100.0, t0(), "l0".to_string());
        q.push(0, t("light"), 100.0, t0(), "l1".to_string());
        let order: Vec<_> = std::iter::from_fn(|| q.next()).collect();
        let pos = |x: &str| order.iter().position(|o| o == x).unwrap();
        assert!(pos("l0") <= 1, "{order:?}");
        assert!(pos("l1") <= 3, "{order:?}");
    }

    #[test]
    fn an_idle_tenant_banks_no_credit() {
        let mut q = Queue::default();
        // "old" was served a lot long ago; "new" arrives now: it starts at
        // the virtual time, not at zero, so the two alternate.
        for i in 0..20 {
            q.push(0, t("busy"), 10.0, t0(), format!("b{i}"));
        }
        for _ in 0..10 {
            q.next();
        }
        q.push(0, t("new"), 10.0, t0(), "n0".to_string());
        q.push(0, t("new"), 10.0, t0(), "n1".to_string());
        let next: Vec<_> = (0..4).filter_map(|_| q.next()).collect();
        assert!(next.contains(&"n0".to_string()) && next.contains(&"n1".to_string()));
        assert!(next.iter().any(|w| w.starts_with('b')), "{next:?}");
    }

    #[test]
    fn removal_and_shedding() {
        let mut q = Queue::default();
        let a = q.push(5, t("x"), 1.0, t0(), "a");
        q.push(0, t("y"), 1.0, t0(), "b");
        q.push(0, t("z"), 1.0, t0(), "c");
        assert_eq!(q.remove(5, "x", a).map(|w| w.wake), Some("a"));
        assert_eq!(q.remove(5, "x", a).map(|w| w.wake), None);
        assert_eq!(q.highest_band(), Some(0));
        assert_eq!(q.pop_lowest_newest().map(|w| w.wake), Some("c"));
        assert_eq!(q.len(), 1);
        assert_eq!(q.lowest_band(), Some(0));
    }
}
