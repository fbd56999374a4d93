//! Passive health (outlier detection) on tokio's paused clock: ejection after
//! consecutive failures, half-open probation, doubling, the cap, recovery.

use super::*;
use crate::config::BackendConfig;

fn replica(outlier: OutlierConfig) -> Replica {
    let metrics = Metrics::new(&Config::default().telemetry.buckets);
    let up = UpstreamConfig {
        outlier,
        ..UpstreamConfig::default()
    };
    let b = BackendConfig::from_url("http://127.0.0.1:9".parse().unwrap());
    Replica::from_config(&b, None, &up, &metrics)
}

fn cfg() -> OutlierConfig {
    OutlierConfig {
        consecutive_failures: 3,
        base_ejection: Duration::from_secs(10),
        max_ejection: Duration::from_secs(35),
    }
}

async fn advance(secs: u64) {
    tokio::time::advance(Duration::from_secs(secs)).await;
}

#[tokio::test(start_paused = true)]
async fn consecutive_failures_eject_and_a_success_breaks_the_streak() {
    let r = replica(cfg());
    r.record_failure();
    r.record_failure();
    r.record_success();
    r.record_failure();
    r.record_failure();
    assert_eq!(r.circuit(), Circuit::Closed, "the streak was broken");
    r.record_failure();
    assert_eq!(r.circuit(), Circuit::Open);
    assert_eq!(r.series.ejected.get(), 1);
    assert_eq!(r.series.ejections.get(), 1);
    assert_eq!(r.ejected_for(), Some(Duration::from_secs(10)));
    // Failures while open do not extend it.
    for _ in 0..10 {
        r.record_failure();
    }
    assert_eq!(r.ejected_for(), Some(Duration::from_secs(10)));
}

#[tokio::test(start_paused = true)]
async fn after_the_ejection_comes_probation_then_recovery_or_a_longer_ejection() {
    let r = replica(cfg());
    for _ in 0..3 {
        r.record_failure();
    }
    advance(9).await;
    assert_eq!(r.circuit(), Circuit::Open);
    advance(1).await;
    assert_eq!(r.circuit(), Circuit::HalfOpen);
    assert_eq!(r.ejected_for(), None);
    // On probation, failing again ejects for twice as long.
    for _ in 0..3 {
        r.record_failure();
    }
    assert_eq!(r.circuit(), Circuit::Open);
    assert_eq!(r.ejected_for(), Some(Duration::from_secs(20)));
    advance(20).await;
    // And again: 40 s, capped at 35 s.
    for _ in 0..3 {
        r.record_failure();
    }
    assert_eq!(r.ejected_for(), Some(Duration::from_secs(35)));
    advance(35).await;
    assert_eq!(r.circuit(), Circuit::HalfOpen);
    // A success on probation closes the circuit.
    r.record_success();
    assert_eq!(r.circuit(), Circuit::Closed);
    assert_eq!(r.series.ejected.get(), 0);
    assert_eq!(r.series.ejections.get(), 3);
}

#[tokio::test(start_paused = true)]
async fn good_behaviour_makes_earlier_ejections_fade() {
    let r = replica(cfg());
    for _ in 0..3 {
        r.record_failure();
    }
    advance(10).await;
    r.record_success();
    // One ejection on record; a success takes it back, so the next
    // ejection is the base time again, not double.
    r.record_success();
    for _ in 0..3 {
        r.record_failure();
    }
    assert_eq!(r.ejected_for(), Some(Duration::from_secs(10)));
}

#[tokio::test(start_paused = true)]
async fn in_flight_is_counted_while_a_guard_lives() {
    let r = Arc::new(replica(cfg()));
    let a = InFlight::new(r.clone());
    let b = InFlight::new(r.clone());
    assert_eq!((r.in_flight(), r.series.in_flight.get()), (2, 2));
    drop(a);
    assert_eq!(r.in_flight(), 1);
    drop(b);
    assert_eq!((r.in_flight(), r.series.in_flight.get()), (0, 0));
}
