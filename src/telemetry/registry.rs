//! Lock-free metric primitives and the Prometheus text encoder.
//!
//! Why not a crate: the `prometheus` crate has no exemplars, and `prometheus-client`
//! takes a write lock on every histogram observation. Sluice observes a histogram
//! on every token, so its histograms are plain atomics: a bucket add and a sum
//! add (integer-scaled, no CAS loop); the count is the buckets' sum, read when
//! asked (a third locked add per observation cost more than every scrape's
//! sum: locked instructions are where a `perf` profile of the request path
//! put much of its time, docs/benchmarks-log.md "2026-11-26 midday"). Labelled series are resolved
//! once per request (a read lock and a hash) and then used lock-free.

use foldhash::{HashMap, HashMapExt as _};
use std::fmt::Write as _;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};

use parking_lot::RwLock;

#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    #[inline]
    pub(crate) fn inc(&self) {
        self.0.fetch_add(1, Relaxed);
    }
    #[inline]
    pub(crate) fn add(&self, n: u64) {
        self.0.fetch_add(n, Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

#[derive(Debug, Default)]
pub struct Gauge(AtomicI64);

impl Gauge {
    #[inline]
    pub(crate) fn inc(&self) {
        self.0.fetch_add(1, Relaxed);
    }
    #[inline]
    pub(crate) fn dec(&self) {
        self.0.fetch_sub(1, Relaxed);
    }
    pub(crate) fn set(&self, v: i64) {
        self.0.store(v, Relaxed);
    }
    pub fn get(&self) -> i64 {
        self.0.load(Relaxed)
    }
}

/// A gauge holding an `f64` (ratios such as KV-cache usage).
#[derive(Debug, Default)]
pub struct FloatGauge(AtomicU64);

impl FloatGauge {
    pub(crate) fn new(v: f64) -> Self {
        Self(AtomicU64::new(v.to_bits()))
    }
    pub(crate) fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Relaxed);
    }
    pub(crate) fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Relaxed))
    }
}

/// The latest traced observation that fell in a bucket (OpenMetrics exemplar).
#[derive(Debug)]
pub(crate) struct Exemplar {
    pub trace_id: String,
    pub value: f64,
    /// Unix seconds.
    pub timestamp: f64,
}

/// Fixed-bucket histogram. `scale` turns observed values into the integer unit
/// its sum is kept in (1e9 for seconds, so the sum is exact nanoseconds).
#[derive(Debug)]
pub struct Histogram {
    bounds: Arc<[f64]>,
    /// One per bound, plus the +Inf bucket. Not cumulative; summed when rendered.
    counts: Box<[AtomicU64]>,
    sum_scaled: AtomicU64,
    scale: f64,
    /// Per bucket, the last exemplar; written only for kept traces, never on
    /// the per-token path.
    exemplars: Box<[arc_swap::ArcSwapOption<Exemplar>]>,
}

impl Histogram {
    pub(crate) fn new(bounds: Arc<[f64]>, scale: f64) -> Self {
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        let exemplars = (0..=bounds.len())
            .map(|_| arc_swap::ArcSwapOption::empty())
            .collect();
        Self {
            bounds,
            counts,
            sum_scaled: AtomicU64::new(0),
            scale,
            exemplars,
        }
    }

    pub(crate) fn seconds(bounds: Arc<[f64]>) -> Self {
        Self::new(bounds, 1e9)
    }

    pub(crate) fn counts_of(bounds: Arc<[f64]>) -> Self {
        Self::new(bounds, 1.0)
    }

    #[inline]
    pub(crate) fn observe(&self, v: f64) {
        // `le` semantics: the first bound >= v.
        let idx = self.bounds.partition_point(|b| *b < v);
        self.counts[idx].fetch_add(1, Relaxed);
        let scaled = (v.max(0.0) * self.scale) as u64;
        self.sum_scaled.fetch_add(scaled, Relaxed);
    }

    #[inline]
    pub(crate) fn observe_duration(&self, d: std::time::Duration) {
        self.observe(d.as_secs_f64());
    }

    /// Observe several durations: the same counts and sum as one
    /// [`observe_duration`](Self::observe_duration) each, with one atomic
    /// add per run of values in one bucket instead of two per value (the
    /// inter-token gaps of a stream mostly fall in one or two buckets).
    pub(crate) fn observe_durations(&self, ds: &[std::time::Duration]) {
        let (mut idx, mut run, mut sum) = (usize::MAX, 0u64, 0u64);
        for d in ds {
            let v = d.as_secs_f64();
            if idx == usize::MAX || !self.holds(idx, v) {
                if run > 0 {
                    self.counts[idx].fetch_add(run, Relaxed);
                }
                idx = self.bounds.partition_point(|b| *b < v);
                run = 0;
            }
            run += 1;
            sum += (v.max(0.0) * self.scale) as u64;
        }
        if run > 0 {
            self.counts[idx].fetch_add(run, Relaxed);
            self.sum_scaled.fetch_add(sum, Relaxed);
        }
    }

    /// Whether bucket `idx` is the one `observe` puts `v` in (the first
    /// bound >= v).
    #[inline]
    fn holds(&self, idx: usize, v: f64) -> bool {
        (idx == 0 || self.bounds[idx - 1] < v) && self.bounds.get(idx).is_none_or(|b| v <= *b)
    }

    /// Attach a trace to the bucket `v` falls in (the value was observed already).
    pub(crate) fn exemplar(&self, v: f64, trace_id: &str) {
        let idx = self.bounds.partition_point(|b| *b < v);
        let timestamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        self.exemplars[idx].store(Some(Arc::new(Exemplar {
            trace_id: trace_id.to_string(),
            value: v,
            timestamp,
        })));
    }

    /// Observations so far: the buckets' sum.
    pub(crate) fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Relaxed)).sum()
    }

    pub(crate) fn sum(&self) -> f64 {
        self.sum_scaled.load(Relaxed) as f64 / self.scale
    }

    /// Estimated quantile, interpolated within buckets as PromQL's
    /// `histogram_quantile` does. `None` when empty.
    pub(crate) fn quantile(&self, q: f64) -> Option<f64> {
        let counts: Vec<u64> = self.counts.iter().map(|c| c.load(Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total as f64;
        let mut cum = 0u64;
        for (i, c) in counts.iter().enumerate() {
            let prev = cum;
            cum += c;
            if (cum as f64) >= rank && *c > 0 {
                let lo = if i == 0 { 0.0 } else { self.bounds[i - 1] };
                let Some(&hi) = self.bounds.get(i) else {
                    return Some(lo);
                };
                return Some(lo + (hi - lo) * (rank - prev as f64) / *c as f64);
            }
        }
        self.bounds.last().copied()
    }

    fn render(&self, out: &mut String, name: &str, labels: &str, om: bool) {
        let mut cum = 0u64;
        let sep = if labels.is_empty() { "" } else { "," };
        for (i, c) in self.counts.iter().enumerate() {
            cum += c.load(Relaxed);
            match self.bounds.get(i) {
                Some(b) => {
                    let _ = write!(out, "{name}_bucket{{{labels}{sep}le=\"{b:?}\"}} {cum}");
                }
                None => {
                    let _ = write!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {cum}");
                }
            }
            if om && let Some(x) = self.exemplars[i].load().as_ref() {
                let _ = write!(
                    out,
                    " # {{trace_id=\"{}\"}} {} {:.3}",
                    x.trace_id, x.value, x.timestamp
                );
            }
            out.push('\n');
        }
        let braces = |s: &str| {
            if s.is_empty() {
                String::new()
            } else {
                format!("{{{s}}}")
            }
        };
        let _ = writeln!(out, "{name}_sum{} {}", braces(labels), self.sum());
        let _ = writeln!(out, "{name}_count{} {}", braces(labels), cum);
    }
}

/// A label key: a tuple of label values with fixed names.
pub trait LabelKey: Hash + Eq + Clone + Send + Sync + 'static {
    fn write_values(&self, names: &[&str], out: &mut String);
}

fn escape_into(out: &mut String, v: &str) {
    for ch in v.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

fn write_pairs(out: &mut String, names: &[&str], values: &[&str]) {
    for (i, (n, v)) in names.iter().zip(values).enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(n);
        out.push_str("=\"");
        escape_into(out, v);
        out.push('"');
    }
}

impl LabelKey for () {
    fn write_values(&self, _: &[&str], _: &mut String) {}
}

impl<A: AsRef<str> + Hash + Eq + Clone + Send + Sync + 'static> LabelKey for (A,) {
    fn write_values(&self, names: &[&str], out: &mut String) {
        write_pairs(out, names, &[self.0.as_ref()]);
    }
}

impl<A, B> LabelKey for (A, B)
where
    A: AsRef<str> + Hash + Eq + Clone + Send + Sync + 'static,
    B: AsRef<str> + Hash + Eq + Clone + Send + Sync + 'static,
{
    fn write_values(&self, names: &[&str], out: &mut String) {
        write_pairs(out, names, &[self.0.as_ref(), self.1.as_ref()]);
    }
}

impl<A, B, C, D> LabelKey for (A, B, C, D)
where
    A: AsRef<str> + Hash + Eq + Clone + Send + Sync + 'static,
    B: AsRef<str> + Hash + Eq + Clone + Send + Sync + 'static,
    C: AsRef<str> + Hash + Eq + Clone + Send + Sync + 'static,
    D: AsRef<str> + Hash + Eq + Clone + Send + Sync + 'static,
{
    fn write_values(&self, names: &[&str], out: &mut String) {
        write_pairs(
            out,
            names,
            &[
                self.0.as_ref(),
                self.1.as_ref(),
                self.2.as_ref(),
                self.3.as_ref(),
            ],
        );
    }
}

impl<A, B, C, D, E> LabelKey for (A, B, C, D, E)
where
    A: AsRef<str> + Hash + Eq + Clone + Send + Sync + 'static,
    B: AsRef<str> + Hash + Eq + Clone + Send + Sync + 'static,
    C: AsRef<str> + Hash + Eq + Clone + Send + Sync + 'static,
    D: AsRef<str> + Hash + Eq + Clone + Send + Sync + 'static,
    E: AsRef<str> + Hash + Eq + Clone + Send + Sync + 'static,
{
    fn write_values(&self, names: &[&str], out: &mut String) {
        write_pairs(
            out,
            names,
            &[
                self.0.as_ref(),
                self.1.as_ref(),
                self.2.as_ref(),
                self.3.as_ref(),
                self.4.as_ref(),
            ],
        );
    }
}

impl<A, B, C> LabelKey for (A, B, C)
where
    A: AsRef<str> + Hash + Eq + Clone + Send + Sync + 'static,
    B: AsRef<str> + Hash + Eq + Clone + Send + Sync + 'static,
    C: AsRef<str> + Hash + Eq + Clone + Send + Sync + 'static,
{
    fn write_values(&self, names: &[&str], out: &mut String) {
        write_pairs(
            out,
            names,
            &[self.0.as_ref(), self.1.as_ref(), self.2.as_ref()],
        );
    }
}

/// Series of one metric (or one bundle of metrics) keyed by label values.
/// `get` is the only locking call; callers keep the returned `Arc` for the
/// request's lifetime.
pub struct Family<K: LabelKey, M> {
    names: &'static [&'static str],
    series: RwLock<HashMap<K, Arc<M>>>,
    make: Box<dyn Fn() -> M + Send + Sync>,
}

impl<K: LabelKey, M> Family<K, M> {
    pub(crate) fn new(
        names: &'static [&'static str],
        make: impl Fn() -> M + Send + Sync + 'static,
    ) -> Self {
        Self {
            names,
            series: RwLock::new(HashMap::new()),
            make: Box::new(make),
        }
    }

    pub(crate) fn get(&self, key: &K) -> Arc<M> {
        if let Some(m) = self.series.read().get(key) {
            return m.clone();
        }
        let mut map = self.series.write();
        map.entry(key.clone())
            .or_insert_with(|| Arc::new((self.make)()))
            .clone()
    }

    /// Drop series whose key no longer exists (e.g. a replica removed by DNS).
    pub(crate) fn retain(&self, mut keep: impl FnMut(&K) -> bool) {
        self.series.write().retain(|k, _| keep(k));
    }

    /// Visit every series.
    pub(crate) fn for_each(&self, mut f: impl FnMut(&K, &M)) {
        for (k, m) in self.series.read().iter() {
            f(k, m);
        }
    }

    /// Label strings and series, sorted for a stable exposition.
    fn snapshot(&self) -> Vec<(String, Arc<M>)> {
        let map = self.series.read();
        let mut v: Vec<(String, Arc<M>)> = map
            .iter()
            .map(|(k, m)| {
                let mut s = String::new();
                k.write_values(self.names, &mut s);
                (s, m.clone())
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

/// Writes metric families in the Prometheus text format, or OpenMetrics
/// (counter families named without `_total`, exemplars, `# EOF`).
pub(crate) struct Encoder {
    pub out: String,
    pub openmetrics: bool,
    /// When set, every family written is also noted here as declared (its
    /// name, type, label names and help): the metrics reference is made from
    /// the same calls as `/metrics`.
    pub catalog: Option<Vec<FamilyInfo>>,
}

/// One metric family as the code declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FamilyInfo {
    pub name: String,
    /// `counter`, `gauge` or `histogram`.
    pub kind: &'static str,
    pub labels: Vec<&'static str>,
    pub help: String,
}

#[derive(Clone, Copy)]
pub(crate) enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Encoder {
    pub(crate) fn new() -> Self {
        Self::with_format(false)
    }

    pub(crate) fn with_format(openmetrics: bool) -> Self {
        Self {
            out: String::with_capacity(16 * 1024),
            openmetrics,
            catalog: None,
        }
    }

    /// An encoder that also notes each family it writes (see `catalog`).
    pub(crate) fn cataloguing() -> Self {
        Self {
            catalog: Some(Vec::new()),
            ..Self::new()
        }
    }

    fn header(&mut self, name: &str, help: &str, kind: Kind, labels: &[&'static str]) {
        let t = match kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        };
        if let Some(c) = &mut self.catalog {
            c.push(FamilyInfo {
                name: name.to_string(),
                kind: t,
                labels: labels.to_vec(),
                help: help.to_string(),
            });
        }
        let family = match kind {
            Kind::Counter if self.openmetrics => name.strip_suffix("_total").unwrap_or(name),
            _ => name,
        };
        let _ = writeln!(self.out, "# HELP {family} {help}");
        let _ = writeln!(self.out, "# TYPE {family} {t}");
    }

    /// The finished exposition.
    pub(crate) fn finish(mut self) -> String {
        if self.openmetrics {
            self.out.push_str("# EOF\n");
        }
        self.out
    }

    /// A family whose series hold a bundle `M`; `pick` selects the metric from it.
    pub(crate) fn counters<K: LabelKey, M>(
        &mut self,
        name: &str,
        help: &str,
        fam: &Family<K, M>,
        pick: impl Fn(&M) -> &Counter,
    ) {
        self.header(name, help, Kind::Counter, fam.names);
        for (labels, m) in fam.snapshot() {
            let _ = writeln!(self.out, "{name}{} {}", wrap(&labels), pick(&m).get());
        }
    }

    /// A counter read from elsewhere as a float (an engine's own counter,
    /// re-exported); series without a value yet are left out.
    pub(crate) fn float_counters<K: LabelKey, M>(
        &mut self,
        name: &str,
        help: &str,
        fam: &Family<K, M>,
        pick: impl Fn(&M) -> f64,
    ) {
        self.header(name, help, Kind::Counter, fam.names);
        for (labels, m) in fam.snapshot() {
            let v = pick(&m);
            if v.is_finite() {
                let _ = writeln!(self.out, "{name}{} {}", wrap(&labels), fmt_value(v));
            }
        }
    }

    pub(crate) fn gauges<K: LabelKey, M>(
        &mut self,
        name: &str,
        help: &str,
        fam: &Family<K, M>,
        pick: impl Fn(&M) -> f64,
    ) {
        self.header(name, help, Kind::Gauge, fam.names);
        for (labels, m) in fam.snapshot() {
            let _ = writeln!(self.out, "{name}{} {}", wrap(&labels), fmt_value(pick(&m)));
        }
    }

    pub(crate) fn histograms<K: LabelKey, M>(
        &mut self,
        name: &str,
        help: &str,
        fam: &Family<K, M>,
        pick: impl Fn(&M) -> &Histogram,
    ) {
        self.header(name, help, Kind::Histogram, fam.names);
        let om = self.openmetrics;
        for (labels, m) in fam.snapshot() {
            pick(&m).render(&mut self.out, name, &labels, om);
        }
    }

    /// One unlabelled value.
    pub(crate) fn single(&mut self, name: &str, help: &str, kind: Kind, value: f64) {
        self.header(name, help, kind, &[]);
        let _ = writeln!(self.out, "{name} {value}");
    }

    /// One series with a preformatted label set (`a="x",b="y"`, may be empty).
    pub(crate) fn one(&mut self, name: &str, help: &str, kind: Kind, labels: &str, value: f64) {
        self.header(name, help, kind, &[]);
        let _ = writeln!(self.out, "{name}{} {value}", wrap(labels));
    }

    /// Series of one family, each with a preformatted label set.
    pub(crate) fn several(&mut self, name: &str, help: &str, kind: Kind, series: &[(&str, f64)]) {
        self.header(name, help, kind, &[]);
        for (labels, value) in series {
            let _ = writeln!(self.out, "{name}{} {value}", wrap(labels));
        }
    }

    /// One histogram series with a preformatted label set (none in the
    /// catalog: give it label names if it ever has labels).
    pub(crate) fn one_histogram(&mut self, name: &str, help: &str, labels: &str, h: &Histogram) {
        self.header(name, help, Kind::Histogram, &[]);
        h.render(&mut self.out, name, labels, self.openmetrics);
    }
}

impl Default for Encoder {
    fn default() -> Self {
        Self::new()
    }
}

/// Prometheus spells special values `NaN`, `+Inf`, `-Inf`.
fn fmt_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        v.to_string()
    }
}

fn wrap(labels: &str) -> String {
    if labels.is_empty() {
        String::new()
    } else {
        format!("{{{labels}}}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_le_inclusive() {
        let h = Histogram::seconds(Arc::from(vec![0.1, 1.0]));
        h.observe(0.1);
        h.observe(0.5);
        h.observe(5.0);
        let mut out = String::new();
        h.render(&mut out, "x", "m=\"a\"", false);
        assert!(out.contains("x_bucket{m=\"a\",le=\"0.1\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{m=\"a\",le=\"1.0\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{m=\"a\",le=\"+Inf\"} 3\n"), "{out}");
        assert!(out.contains("x_sum{m=\"a\"} 5.6\n"), "{out}");
        assert!(out.contains("x_count{m=\"a\"} 3\n"), "{out}");
    }

    #[test]
    fn openmetrics_has_exemplars_and_eof() {
        let fam: Family<(String,), Histogram> =
            Family::new(&["model"], || Histogram::seconds(Arc::from(vec![0.1, 1.0])));
        let h = fam.get(&("m".to_string(),));
        h.observe(0.5);
        h.exemplar(0.5, "4bf92f3577b34da6a3ce929d0e0e4736");
        let c: Family<(String,), Counter> = Family::new(&["model"], Counter::default);
        c.get(&("m".to_string(),)).inc();
        let mut e = Encoder::with_format(true);
        e.histograms("lat_seconds", "h", &fam, |h| h);
        e.counters("reqs_total", "c", &c, |c| c);
        let text = e.finish();
        assert!(text.contains("# TYPE reqs counter"), "{text}");
        assert!(text.contains("reqs_total{model=\"m\"} 1"), "{text}");
        assert!(
            text.contains("lat_seconds_bucket{model=\"m\",le=\"1.0\"} 1 # {trace_id=\"4bf92f3577b34da6a3ce929d0e0e4736\"} 0.5 "),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"));
        let mut plain = Encoder::new();
        plain.histograms("lat_seconds", "h", &fam, |h| h);
        assert!(
            !plain.finish().contains("trace_id"),
            "no exemplars in the classic format"
        );
    }

    proptest::proptest! {
        /// The batched observation against one `observe` per value: the
        /// same rendered buckets, sum and count, bounds and zero included.
        #[test]
        fn batched_durations_land_where_single_ones_do(
            ns in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::strategy::Just(0u64),
                    proptest::strategy::Just(5_000_000u64),
                    proptest::strategy::Just(10_000_000u64),
                    0u64..3_000_000_000,
                ],
                0..40,
            ),
        ) {
            let bounds: Arc<[f64]> = Arc::from(vec![0.001, 0.005, 0.01, 0.05, 1.0]);
            let (one, batch) = (Histogram::seconds(bounds.clone()), Histogram::seconds(bounds));
            let ds: Vec<std::time::Duration> = ns.iter().map(|n| std::time::Duration::from_nanos(*n)).collect();
            for d in &ds {
                one.observe_duration(*d);
            }
            batch.observe_durations(&ds);
            let (mut a, mut b) = (String::new(), String::new());
            one.render(&mut a, "x", "m=\"a\"", false);
            batch.render(&mut b, "x", "m=\"a\"", false);
            proptest::prop_assert_eq!(a, b);
        }
    }

    #[test]
    fn quantiles_interpolate_within_buckets() {
        let h = Histogram::seconds(Arc::from(vec![0.1, 0.2, 0.4]));
        assert_eq!(h.quantile(0.5), None);
        for _ in 0..10 {
            h.observe(0.15);
        }
        let q = h.quantile(0.5).unwrap_or_default();
        assert!((0.1..=0.2).contains(&q), "{q}");
    }

    #[test]
    fn label_values_are_escaped() {
        let fam: Family<(String,), Counter> = Family::new(&["model"], Counter::default);
        fam.get(&("a\"b\\c".to_string(),)).inc();
        let mut e = Encoder::new();
        e.counters("c_total", "help", &fam, |c| c);
        assert!(
            e.out.contains("c_total{model=\"a\\\"b\\\\c\"} 1"),
            "{}",
            e.out
        );
    }
}
