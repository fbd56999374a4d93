//! Findings that hold while their condition holds: raised at the first
//! evaluation that sees them, cleared only once their condition has been
//! gone for `doctor.clear_after`. A pathology whose evidence comes and goes
//! between scrapes (a KV cache that thrashes in bursts, a queue that piles
//! up and drains) stays named, with the time since which it holds, instead
//! of being there or not depending on when someone asked.
//!
//! [`Held::observe`] is fed each evaluation of [`super::diagnose`] (a
//! background task every scrape interval, and every `/admin/diagnose` and
//! `/metrics` read); what it returns is what the gateway reports.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;

use super::Finding;

/// What identifies one finding across evaluations.
type Key = (&'static str, Arc<str>, Option<String>, Option<String>);

struct Entry {
    finding: Finding,
    since: Instant,
    last_seen: Instant,
}

/// The findings raised and not yet cleared.
#[derive(Default)]
pub struct Held {
    entries: Mutex<HashMap<Key, Entry>>,
}

impl Held {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Take one evaluation's findings at `now` and return every finding
    /// held: those seen now (with their current evidence), and those seen
    /// within `clear_after` (with their last evidence, `active: false`).
    /// Each carries since when it holds. Most severe first, then oldest.
    pub fn observe(
        &self,
        found: Vec<Finding>,
        now: Instant,
        clear_after: Duration,
    ) -> Vec<Finding> {
        let mut entries = self.entries.lock();
        for f in found {
            let key = (
                f.pathology,
                f.backend.clone(),
                f.tier.clone(),
                f.model.clone(),
            );
            match entries.get_mut(&key) {
                Some(e) => {
                    e.finding = f;
                    e.last_seen = now;
                }
                None => {
                    entries.insert(
                        key,
                        Entry {
                            finding: f,
                            since: now,
                            last_seen: now,
                        },
                    );
                }
            }
        }
        entries.retain(|_, e| now.saturating_duration_since(e.last_seen) <= clear_after);
        let wall = SystemTime::now();
        let mut out: Vec<(Instant, Finding)> = entries
            .values()
            .map(|e| {
                let mut f = e.finding.clone();
                let held = now.saturating_duration_since(e.since);
                f.since = Some(humantime::format_rfc3339_seconds(wall - held).to_string());
                f.for_seconds = Some((held.as_secs_f64() * 10.0).round() / 10.0);
                f.active = e.last_seen >= now;
                if !f.active {
                    let gone = now.saturating_duration_since(e.last_seen);
                    f.gone_seconds = Some((gone.as_secs_f64() * 10.0).round() / 10.0);
                }
                (e.since, f)
            })
            .collect();
        out.sort_by(|(a, fa), (b, fb)| fb.severity.cmp(&fa.severity).then(a.cmp(b)));
        out.into_iter().map(|(_, f)| f).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Severity;

    fn finding(pathology: &'static str, backend: &str) -> Finding {
        Finding {
            pathology,
            severity: Severity::Critical,
            backend: Arc::from(backend),
            tier: None,
            model: None,
            evidence: serde_json::Map::new(),
            window_seconds: 1.0,
            cause: String::new(),
            action: String::new(),
            since: None,
            for_seconds: None,
            active: true,
            gone_seconds: None,
        }
    }

    #[test]
    fn a_finding_is_raised_at_once_and_cleared_only_after_it_stays_gone() {
        let held = Held::new();
        let t = Instant::now();
        let s = Duration::from_secs;
        let hold = s(30);
        // Raised at its first sight.
        let out = held.observe(vec![finding("kv_cache_thrashing", "a")], t, hold);
        assert_eq!(out.len(), 1);
        assert!(out[0].active);
        assert_eq!(out[0].for_seconds, Some(0.0));
        // Its evidence comes and goes: it stays, and keeps its start.
        for k in 1..=10u64 {
            let seen = if k % 3 == 0 {
                vec![finding("kv_cache_thrashing", "a")]
            } else {
                vec![]
            };
            let out = held.observe(seen, t + s(k * 2), hold);
            assert_eq!(out.len(), 1, "at {}s", k * 2);
            assert_eq!(out[0].for_seconds, Some((k * 2) as f64));
            assert_eq!(out[0].active, k % 3 == 0);
        }
        // Gone for longer than the hold: cleared. (Last seen at 18 s.)
        assert_eq!(held.observe(vec![], t + s(48), hold).len(), 1);
        assert!(held.observe(vec![], t + s(49), hold).is_empty());
        // Seen again: a new start.
        let out = held.observe(vec![finding("kv_cache_thrashing", "a")], t + s(50), hold);
        assert_eq!(out[0].for_seconds, Some(0.0));
    }

    #[test]
    fn findings_on_different_replicas_are_held_apart() {
        let held = Held::new();
        let t = Instant::now();
        let hold = Duration::from_secs(10);
        held.observe(vec![finding("leaked_kv", "a")], t, hold);
        let out = held.observe(
            vec![finding("leaked_kv", "b")],
            t + Duration::from_secs(1),
            hold,
        );
        let mut names: Vec<(&str, bool)> = out.iter().map(|f| (&*f.backend, f.active)).collect();
        names.sort();
        assert_eq!(names, [("a", false), ("b", true)]);
    }
}
