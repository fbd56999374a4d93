//! The timed body on tokio's paused clock: a scripted upstream hands out
//! chunks at virtual times, so timeouts, gaps and stalls are exact and the
//! tests take no wall-clock time.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use http::HeaderMap;
use http_body_util::BodyExt;
use tokio::time::Sleep;

use super::*;
use crate::config::{BackendConfig, Config, UpstreamConfig};
use crate::stream::signal::Signal;
use crate::telemetry::Telemetry;
use crate::telemetry::metrics::{Metrics, StatusLabel};
use crate::telemetry::tracecontext::TraceCtx;
use crate::vocab::{Endpoint, RouteReason};

enum Step {
    Data(&'static str),
    Fail,
    End,
}

/// An upstream that hands out `steps`, each after its delay; silent once
/// they are used up.
struct Script {
    steps: VecDeque<(Duration, Step)>,
    sleep: Option<Pin<Box<Sleep>>>,
    reused: Arc<AtomicBool>,
    /// How many times the body asked for data.
    asked: usize,
}

impl Upstream for Script {
    fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, UpstreamFault>>> {
        self.asked += 1;
        let Some((delay, _)) = self.steps.front() else {
            return Poll::Pending;
        };
        let delay = *delay;
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(delay)));
        ready!(sleep.as_mut().poll(cx));
        self.sleep = None;
        Poll::Ready(match self.steps.pop_front().map(|s| s.1) {
            Some(Step::Data(s)) => Some(Ok(Bytes::from_static(s.as_bytes()))),
            Some(Step::Fail) => Some(Err(UpstreamFault::io(
                "reading",
                std::io::ErrorKind::ConnectionReset.into(),
            ))),
            Some(Step::End) | None => None,
        })
    }

    /// Nothing is ready now when the next step is a wait (or there is none),
    /// as a drained socket: the body then forwards without polling again.
    fn drained(&self) -> bool {
        self.steps.front().is_none_or(|(delay, _)| !delay.is_zero())
    }

    /// Registered for the next step when it is a wait still running.
    fn wait(&mut self, cx: &mut Context<'_>) -> bool {
        let Some((delay, _)) = self.steps.front() else {
            return false;
        };
        let delay = *delay;
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(delay)));
        sleep.as_mut().poll(cx).is_pending()
    }

    fn reuse(self) {
        self.reused.store(true, Relaxed);
    }
}

const TOKEN: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n";
const FINISH: &str = "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n";
const USAGE: &str =
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":3}}\n\n";
const DONE: &str = "data: [DONE]\n\n";

struct Rig {
    tele: Arc<Telemetry>,
    replica: Arc<Replica>,
    reused: Arc<AtomicBool>,
}

impl Rig {
    fn new() -> Self {
        let metrics = Arc::new(Metrics::new(&Config::default().telemetry.buckets));
        let b = BackendConfig::from_url("http://127.0.0.1:9".parse().unwrap());
        let replica = Arc::new(Replica::from_config(
            &b,
            None,
            &UpstreamConfig::default(),
            &metrics,
        ));
        Self {
            tele: Arc::new(Telemetry {
                metrics,
                traces: None,
                access_log: None,
                refusal: None,
            }),
            replica,
            reused: Arc::new(AtomicBool::new(false)),
        }
    }

    /// A streamed chat request sent to the replica, with a 2 s stall threshold.
    fn guard(&self) -> RequestGuard {
        let now = Instant::now();
        let mut g = RequestGuard::new(
            self.tele.clone(),
            Endpoint::Chat,
            now,
            "test".into(),
            TraceCtx::from_headers(&HeaderMap::new()),
            Duration::from_secs(2),
        );
        g.set_model(Arc::from("m"));
        g.record.stream = true;
        g.start_attempt(self.replica.clone(), RouteReason::Affinity, now);
        g.record.status = 200;
        g
    }

    /// A body over `steps`: idle timeout 5 s, total 60 s.
    fn body(&self, steps: Vec<(u64, Step)>, strip_usage: bool) -> TimedBody<Script> {
        self.body_with(steps, strip_usage, Signal::default())
    }

    fn body_with(
        &self,
        steps: Vec<(u64, Step)>,
        strip_usage: bool,
        cut: Signal,
    ) -> TimedBody<Script> {
        let script = Script {
            steps: steps
                .into_iter()
                .map(|(ms, s)| (Duration::from_millis(ms), s))
                .collect(),
            sleep: None,
            reused: self.reused.clone(),
            asked: 0,
        };
        TimedBody::new(
            script,
            Mode::OpenAi { strip_usage },
            Duration::from_secs(5),
            Instant::now() + Duration::from_secs(60),
            &cut,
        )
        .with_guard(Box::new(self.guard()))
    }

    /// Requests counted with this status and error kind.
    fn counted(&self, status: u16, kind: &'static str) -> u64 {
        self.tele
            .metrics
            .requests
            .get(&(
                Arc::from("m"),
                "chat",
                Arc::from(""),
                StatusLabel(status),
                kind,
            ))
            .get()
    }

    fn series(&self) -> Arc<crate::telemetry::metrics::ModelSeries> {
        self.tele
            .metrics
            .models
            .get(&(Arc::from("m"), "chat", Arc::from("")))
    }
}

/// Every frame of the body, as text, each with the virtual time it left.
/// Polled as hyper's dispatcher polls it inside the server's connection task:
/// each poll of the task is a turn, and a body that answers `Pending` is asked
/// again in the same turn (which it answers without asking its sources).
async fn frames(body: &mut TimedBody<Script>) -> Vec<(Duration, String)> {
    let start = Instant::now();
    let mut out = Vec::new();
    while let Some(f) = in_turns(body).await {
        if let Ok(data) = f.unwrap().into_data() {
            out.push((start.elapsed(), String::from_utf8(data.to_vec()).unwrap()));
        }
    }
    out
}

/// The body's next frame, each poll a turn of its own, asked twice when pending.
async fn in_turns(body: &mut TimedBody<Script>) -> Option<Result<Frame<Bytes>, Infallible>> {
    std::future::poll_fn(|cx| {
        crate::turn::take(|| {
            let first = Pin::new(&mut *body).poll_frame(cx);
            if first.is_pending() {
                let again = Pin::new(&mut *body).poll_frame(cx);
                assert!(again.is_pending(), "pending twice in one turn");
            }
            first
        })
    })
    .await
}

fn text(frames: &[(Duration, String)]) -> String {
    frames.iter().map(|f| f.1.as_str()).collect()
}

#[tokio::test(start_paused = true)]
async fn a_clean_stream_passes_through_and_releases_the_replica_at_its_end() {
    let rig = Rig::new();
    let mut body = rig.body(
        vec![
            (10, Step::Data(TOKEN)),
            (20, Step::Data(TOKEN)),
            (20, Step::Data(FINISH)),
            (0, Step::Data(USAGE)),
            (0, Step::Data(DONE)),
            (0, Step::End),
        ],
        true,
    );
    assert_eq!(rig.replica.in_flight(), 1);
    let got = frames(&mut body).await;
    // The usage chunk the client did not ask for is gone; the rest is intact.
    assert_eq!(text(&got), format!("{TOKEN}{TOKEN}{FINISH}{DONE}"));
    // Ended when the body ended, not when it is dropped.
    assert_eq!(rig.replica.in_flight(), 0, "in-flight released at the end");
    assert!(rig.reused.load(Relaxed), "connection back to the pool");
    assert_eq!(rig.counted(200, ""), 1);
    let s = rig.series();
    assert_eq!(s.ttft.count(), 1);
    assert_eq!(s.inter_token.count(), 1, "two tokens, one gap");
    assert!(
        (s.inter_token.sum() - 0.020).abs() < 1e-6,
        "the gap is 20 ms"
    );
    assert_eq!(s.generation_tokens.get(), 3, "usage read although stripped");
    drop(body);
    assert_eq!(rig.counted(200, ""), 1, "reported once");
}

#[tokio::test(start_paused = true)]
async fn the_usage_chunk_stays_when_the_client_asked_for_it() {
    let rig = Rig::new();
    let mut body = rig.body(
        vec![
            (1, Step::Data(TOKEN)),
            (1, Step::Data(FINISH)),
            (1, Step::Data(USAGE)),
            (1, Step::Data(DONE)),
            (0, Step::End),
        ],
        false,
    );
    let got = text(&frames(&mut body).await);
    assert_eq!(got, format!("{TOKEN}{FINISH}{USAGE}{DONE}"));
}

#[tokio::test(start_paused = true)]
async fn events_of_one_read_leave_in_one_write() {
    let rig = Rig::new();
    const BURST: &str = concat!(
        "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
        "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n",
        "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n",
        "data: [DONE]\n\n"
    );
    let mut body = rig.body(vec![(1, Step::Data(BURST)), (0, Step::End)], true);
    let got = frames(&mut body).await;
    assert_eq!(got.len(), 1, "one frame: {got:?}");
    let want = BURST.replace(
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n",
        "",
    );
    assert_eq!(got[0].1, want);
    assert_eq!(rig.series().inter_token.count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_gap_over_the_threshold_is_a_stall() {
    let rig = Rig::new();
    let mut body = rig.body(
        vec![
            (1, Step::Data(TOKEN)),
            (3000, Step::Data(TOKEN)),
            (1, Step::Data(FINISH)),
            (0, Step::Data(DONE)),
            (0, Step::End),
        ],
        true,
    );
    let got = frames(&mut body).await;
    // The finish and [DONE] arrive back to back: they leave together.
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(
        got[1].0 >= Duration::from_secs(3),
        "the second token waited"
    );
    let s = rig.series();
    assert_eq!(s.stalls.get(), 1);
    assert_eq!(s.max_gap.count(), 1);
    assert!((s.max_gap.sum() - 3.0).abs() < 0.01);
}

#[tokio::test(start_paused = true)]
async fn silence_past_the_idle_timeout_ends_the_stream_with_an_error_event() {
    let rig = Rig::new();
    // One token, then nothing: the idle timeout (5 s) fires.
    let mut body = rig.body(vec![(1, Step::Data(TOKEN))], true);
    let got = frames(&mut body).await;
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got[0].1, TOKEN);
    let (at, last) = &got[1];
    assert!(
        *at >= Duration::from_secs(5) && *at < Duration::from_secs(6),
        "{at:?}"
    );
    assert!(last.contains("\"error\""), "{last}");
    assert!(last.contains("timeout_idle"), "{last}");
    assert!(last.ends_with("data: [DONE]\n\n"));
    assert_eq!(rig.counted(200, "timeout_idle"), 1);
    // The silence that ended it is a stall too (5 s > 2 s).
    assert_eq!(rig.series().stalls.get(), 1);
    assert_eq!(rig.replica.in_flight(), 0);
    assert!(
        !rig.reused.load(Relaxed),
        "a broken connection is not reused"
    );
}

#[tokio::test(start_paused = true)]
async fn a_stream_past_its_total_time_is_cut() {
    let rig = Rig::new();
    // A token every 4 s (never idle for 5 s), forever: total (60 s) fires.
    let steps = (0..40).map(|_| (4000, Step::Data(TOKEN))).collect();
    let mut body = rig.body(steps, true);
    let got = frames(&mut body).await;
    let (at, last) = got.last().unwrap();
    assert!(
        *at >= Duration::from_secs(60) && *at < Duration::from_secs(61),
        "{at:?}"
    );
    assert!(last.contains("timeout_total"), "{last}");
    assert_eq!(rig.counted(200, "timeout_total"), 1);
}

#[tokio::test(start_paused = true)]
async fn a_stream_cut_short_is_a_failure_not_a_success() {
    let rig = Rig::new();
    for steps in [
        // Ends without a finish reason or [DONE].
        vec![(1, Step::Data(TOKEN)), (1, Step::End)],
        // Ends in the middle of an event.
        vec![(1, Step::Data("data: {\"choices\"")), (1, Step::End)],
        // The connection breaks.
        vec![(1, Step::Data(TOKEN)), (1, Step::Fail)],
    ] {
        let mut body = rig.body(steps, true);
        let got = text(&frames(&mut body).await);
        assert!(got.contains("upstream_protocol"), "{got}");
        assert!(got.ends_with("data: [DONE]\n\n"));
    }
    assert_eq!(rig.counted(200, "upstream_protocol"), 3);
    assert_eq!(rig.replica.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_client_that_leaves_is_recorded_and_releases_the_replica() {
    let rig = Rig::new();
    let mut body = rig.body(
        vec![(1, Step::Data(TOKEN)), (10_000, Step::Data(TOKEN))],
        true,
    );
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(&first[..], TOKEN.as_bytes());
    assert_eq!(rig.replica.in_flight(), 1);
    tokio::time::advance(Duration::from_secs(3)).await;
    drop(body);
    assert_eq!(rig.replica.in_flight(), 0);
    assert_eq!(rig.counted(499, "client_disconnect"), 1);
    assert_eq!(rig.series().client_disconnects.get(), 1);
    assert_eq!(rig.series().stalls.get(), 1, "the 3 s it waited is a stall");
}

#[tokio::test(start_paused = true)]
async fn the_drain_deadline_ends_open_streams_with_an_error_event() {
    let rig = Rig::new();
    let cut = Signal::default();
    let mut body = rig.body_with(
        vec![(1, Step::Data(TOKEN)), (30_000, Step::Data(TOKEN))],
        true,
        cut.clone(),
    );
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(&first[..], TOKEN.as_bytes());
    let c = cut.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        c.raise();
    });
    let rest = text(&frames(&mut body).await);
    assert!(rest.contains("\"code\":\"shutdown\""), "{rest}");
    assert!(rest.ends_with("data: [DONE]\n\n"));
    assert_eq!(rig.counted(200, "shutdown"), 1);
    // Not the replica's fault.
    assert_eq!(
        rig.tele
            .metrics
            .upstream_errors
            .get(&(rig.replica.name.clone(), "shutdown"))
            .get(),
        0
    );
}

/// How many times the body has asked its upstream for data.
fn asked(b: &TimedBody<Script>) -> usize {
    b.upstream.as_ref().map_or(0, |u| u.asked)
}

#[tokio::test(start_paused = true)]
async fn a_body_pending_in_a_turn_answers_again_without_asking_its_upstream() {
    use crate::turn;
    let rig = Rig::new();
    let steps = vec![
        (10, Step::Data(TOKEN)),
        (0, Step::Data(FINISH)),
        (0, Step::Data(DONE)),
        (0, Step::End),
    ];
    let mut body = rig.body(steps, true);
    let mut cx = Context::from_waker(std::task::Waker::noop());
    turn::take(|| {
        assert!(Pin::new(&mut body).poll_frame(&mut cx).is_pending());
        let once = asked(&body);
        assert!(Pin::new(&mut body).poll_frame(&mut cx).is_pending());
        assert_eq!(asked(&body), once, "asked again in the same turn");
    });
    // A new turn (the task was woken) and a poll outside any turn both ask.
    let before = asked(&body);
    turn::take(|| assert!(Pin::new(&mut body).poll_frame(&mut cx).is_pending()));
    assert_eq!(asked(&body), before + 1);
    assert!(Pin::new(&mut body).poll_frame(&mut cx).is_pending());
    assert!(Pin::new(&mut body).poll_frame(&mut cx).is_pending());
    assert_eq!(asked(&body), before + 3);
    // And the stream still arrives whole when its time comes.
    let got = text(&frames(&mut body).await);
    assert_eq!(got, format!("{TOKEN}{FINISH}{DONE}"));
}

#[tokio::test(start_paused = true)]
async fn data_that_drained_its_upstream_in_a_turn_leaves_the_next_poll_answered() {
    use crate::turn;
    let rig = Rig::new();
    let steps = vec![
        (0, Step::Data(TOKEN)),
        (10, Step::Data(FINISH)),
        (0, Step::Data(DONE)),
        (0, Step::End),
    ];
    let mut body = rig.body(steps, true);
    let mut cx = Context::from_waker(std::task::Waker::noop());
    turn::take(|| {
        let first = Pin::new(&mut body).poll_frame(&mut cx);
        assert!(matches!(first, Poll::Ready(Some(Ok(_)))), "the token");
        let once = asked(&body);
        assert!(Pin::new(&mut body).poll_frame(&mut cx).is_pending());
        assert_eq!(asked(&body), once, "asked again in the same turn");
    });
    // Outside a turn, nothing is taken for granted.
    let before = asked(&body);
    assert!(Pin::new(&mut body).poll_frame(&mut cx).is_pending());
    assert_eq!(asked(&body), before + 1);
    let got = text(&frames(&mut body).await);
    assert_eq!(got, format!("{FINISH}{DONE}"));
}
