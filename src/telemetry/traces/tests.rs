//! The tail sampler's decision and its per-second budget (paused clock).

use std::sync::Arc;

use tokio::time::Instant;

use super::*;
use crate::config::SamplingConfig;

fn record(status: u16) -> RequestRecord {
    let now = Instant::now();
    let mut r = RequestRecord::new(Endpoint::Chat, Arc::from("m"), true, now);
    r.status = status;
    r.first_token = Some(now + Duration::from_millis(100));
    r.end = Some(now + Duration::from_secs(1));
    r
}

fn sampler(ratio: f64, max_per_second: u32) -> Sampler {
    Sampler::new(SamplingConfig {
        ratio,
        max_per_second,
        ..SamplingConfig::default()
    })
}

#[tokio::test(start_paused = true)]
async fn errors_and_slow_requests_are_kept_fast_successes_sampled() {
    let s = sampler(0.0, 0);
    assert_eq!(s.decide(&record(200)), None, "fast success, ratio 0");
    assert_eq!(s.decide(&record(502)), Some(Keep::Error));
    let mut broken = record(200);
    broken.error_kind = Some("upstream_protocol");
    assert_eq!(s.decide(&broken), Some(Keep::Error), "broke after its 200");
    let mut client = record(400);
    client.error_kind = Some("invalid_request");
    assert_eq!(s.decide(&client), None, "client errors are not errors here");
    let mut gone = record(200);
    gone.disconnected = true;
    gone.error_kind = Some("client_disconnect");
    assert_eq!(s.decide(&gone), None, "a client leaving is not an error");

    let mut slow = record(200);
    slow.first_token = Some(slow.arrival + Duration::from_secs(2));
    assert_eq!(s.decide(&slow), Some(Keep::SlowTtft));
    let mut long = record(200);
    long.end = Some(long.arrival + Duration::from_secs(60));
    assert_eq!(s.decide(&long), Some(Keep::SlowE2e));
    let mut stalled = record(200);
    stalled.output_events = 5;
    stalled.max_gap = Duration::from_secs(2);
    assert_eq!(s.decide(&stalled), Some(Keep::Stall));
    // One output event has no gap to speak of.
    stalled.output_events = 1;
    assert_eq!(s.decide(&stalled), None);

    let all = sampler(1.0, 0);
    assert_eq!(all.decide(&record(200)), Some(Keep::Sampled));
    let quiet = SamplingConfig {
        keep_errors: false,
        ratio: 0.0,
        ..SamplingConfig::default()
    };
    assert_eq!(Sampler::new(quiet).decide(&record(502)), None);
}

#[tokio::test(start_paused = true)]
async fn the_budget_allows_one_seconds_worth_then_refills() {
    let s = sampler(1.0, 10);
    let granted = (0..50).filter(|_| s.budget()).count();
    assert_eq!(granted, 10, "a burst of one second's worth");
    tokio::time::advance(Duration::from_millis(100)).await;
    assert!(s.budget(), "one more every 100 ms");
    assert!(!s.budget());
    tokio::time::advance(Duration::from_secs(5)).await;
    assert_eq!(
        (0..50).filter(|_| s.budget()).count(),
        10,
        "never more than a burst"
    );
    let uncapped = sampler(1.0, 0);
    assert!((0..1000).all(|_| uncapped.budget()));
}
