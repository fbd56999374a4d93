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

fn sample(waiting: f64, running: f64) -> LoadSample {
    LoadSample {
        kv_usage: Some(0.5),
        waiting: Some(waiting),
        running: Some(running),
        ..LoadSample::empty(crate::vocab::EngineKind::Vllm, Instant::now())
    }
}

#[test]
fn seats_are_learned_from_a_queue_that_persists_and_probed_upward() {
    let r = replica(cfg());
    // A queue in one scrape only is a burst between two engine steps.
    r.set_load(sample(0.0, 5.0));
    r.set_load(sample(3.0, 7.0));
    assert_eq!(r.seats(), None);
    // Two scrapes in a row with requests waiting, but the engine took some
    // in between (it runs more than before): the queue waits for its token
    // budget, not for seats.
    r.set_load(sample(2.0, 12.0));
    assert_eq!(r.seats(), None);
    // Held there with requests waiting: what runs is what it holds.
    r.set_load(sample(2.0, 12.0));
    assert_eq!(r.seats(), Some(12));
    // Held exactly there with nothing waiting: probe one more at a time.
    r.set_load(sample(0.0, 12.0));
    assert_eq!(r.seats(), Some(13));
    // Below it: nothing to learn.
    r.set_load(sample(0.0, 4.0));
    assert_eq!(r.seats(), Some(13));
    // Full again with fewer (KV memory bound): follow it down.
    r.set_load(sample(4.0, 9.0));
    r.set_load(sample(5.0, 9.0));
    assert_eq!(r.seats(), Some(9));
    // Seen running more than that: it has at least as many, queue or not.
    r.set_load(sample(3.0, 20.0));
    assert_eq!(r.seats(), Some(20));
    r.set_load(sample(0.0, 23.0));
    assert_eq!(r.seats(), Some(23));
}

#[test]
fn a_queue_the_engine_keeps_taking_in_teaches_no_seats() {
    // A cold start of long prompts: a few wait at every look for the token
    // budget the prefills take, while the engine admits more and more.
    let r = replica(cfg());
    for running in [6.0, 7.0, 8.0, 16.0, 17.0, 26.0] {
        r.set_load(sample(2.0, running));
        assert_eq!(r.seats(), None, "running {running}");
    }
    // Pinned at its seats with a queue: learned.
    r.set_load(sample(5.0, 26.0));
    assert_eq!(r.seats(), Some(26));
}

#[test]
fn requests_waiting_for_their_kv_are_no_queue_and_teach_no_seats() {
    let r = replica(cfg());
    // Scrape after scrape three requests wait, all of them deferred (a
    // decode replica's pulls of their KV): the engine is not full.
    let pulling = |running: f64| LoadSample {
        deferred: Some(3.0),
        ..sample(3.0, running)
    };
    r.set_load(pulling(5.0));
    r.set_load(pulling(7.0));
    let s = r.load().unwrap();
    assert_eq!(
        (s.waiting, s.queue(), s.queued),
        (Some(3.0), Some(0.0), false)
    );
    assert!(!r.queue_unconfirmed());
    assert_eq!(r.seats(), None);
    // One of them waits for room: that is a queue, and a second scrape
    // showing it teaches the seats.
    let one_queued = |running: f64| LoadSample {
        deferred: Some(2.0),
        ..sample(3.0, running)
    };
    r.set_load(one_queued(12.0));
    assert!(r.queue_unconfirmed());
    r.set_load(one_queued(12.0));
    assert!(r.load().unwrap().queued);
    assert_eq!(r.seats(), Some(12));
    // Held there, nothing waiting for room while two pull their KV: the
    // seats are probed upward as on an engine that queues nothing.
    r.set_load(pulling(12.0));
    assert_eq!(r.seats(), Some(13));
}

#[test]
fn configured_seats_win_and_other_gateways_count() {
    let metrics = Metrics::new(&Config::default().telemetry.buckets);
    let mut b = BackendConfig::from_url("http://127.0.0.1:9".parse().unwrap());
    b.max_concurrency = Some(4);
    let r = Replica::from_config(&b, None, &UpstreamConfig::default(), &metrics);
    r.set_load(sample(2.0, 12.0));
    r.set_load(sample(2.0, 12.0));
    assert_eq!(r.seats(), Some(4));
    // 14 at the engine, none of them this gateway's.
    assert_eq!(r.others(), 14);
    let a = InFlight::new(Arc::new(Replica::from_config(
        &b,
        None,
        &UpstreamConfig::default(),
        &metrics,
    )));
    let mut a = a;
    a.mark_leaving();
    a.mark_leaving();
    assert_eq!(a.replica().leaving(), 1);
    assert_eq!(a.replica().in_flight(), 1);
    let kept = a.replica().clone();
    drop(a);
    assert_eq!((kept.leaving(), kept.in_flight()), (0, 0));
}

#[test]
fn a_second_look_keeps_the_preemption_the_last_scrape_saw() {
    let r = replica(cfg());
    let with = |n: f64| LoadSample {
        preemptions: Some(n),
        ..sample(1.0, 8.0)
    };
    r.set_load(with(3.0));
    r.set_load(with(5.0));
    assert!(r.load().unwrap().preempting);
    // A quarter second later the counter has not moved: still preempting.
    r.set_load_again(with(5.0));
    assert!(r.load().unwrap().preempting);
    // The next regular scrape decides afresh.
    r.set_load(with(5.0));
    assert!(!r.load().unwrap().preempting);
    r.set_load_again(with(5.0));
    assert!(!r.load().unwrap().preempting);
}
