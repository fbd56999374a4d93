//! A stream's deadlines: the idle gap since the last upstream chunk and the
//! request's total time, on one timer.
//!
//! The timer is re-armed lazily: only when it fires does it look at when the
//! last chunk came and move to the real deadline, so a busy stream pays no
//! timer work per token. Times are tokio's (tests run it on paused time).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Waker};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

use crate::error::TimeoutPhase;

pub(crate) struct Deadlines {
    idle: Duration,
    total: Instant,
    /// When the latest upstream chunk arrived.
    last: Instant,
    timer: Pin<Box<Sleep>>,
    /// The waker the timer holds: while it is the task's and the timer has
    /// not fired, there is nothing to poll (a stream is polled per token).
    waker: Option<Waker>,
}

impl Deadlines {
    pub(crate) fn new(now: Instant, idle: Duration, total: Instant) -> Self {
        Self {
            idle,
            total,
            last: now,
            timer: Box::pin(tokio::time::sleep_until(total.min(now + idle))),
            waker: None,
        }
    }

    /// Only a gap deadline: `idle` after the latest touch (the gateway's
    /// own server times request heads so, `server/h1`).
    pub(crate) fn gap(now: Instant, idle: Duration) -> Self {
        // No total: far enough that it never comes, near enough to add.
        Self::new(now, idle, now + Duration::from_secs(100 * 365 * 86_400))
    }

    /// A chunk arrived at `now`.
    #[inline]
    pub(crate) fn touch(&mut self, now: Instant) {
        self.last = now;
    }

    pub(crate) fn last(&self) -> Instant {
        self.last
    }

    /// Which deadline has passed, if one has; otherwise the timer is armed
    /// for the next one and wakes `cx`.
    pub(crate) fn poll_expired(&mut self, cx: &mut Context<'_>) -> Option<TimeoutPhase> {
        if !self.timer.is_elapsed() && self.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker()))
        {
            return None;
        }
        while self.timer.as_mut().poll(cx).is_ready() {
            // The clock itself, not the turn's time (a moment old): a timer
            // re-armed for a deadline at or before that time would fire at
            // once, and this loop would not end.
            let now = crate::turn::fresh();
            if now >= self.total {
                return Some(TimeoutPhase::Total);
            }
            let idle_at = self.last + self.idle;
            if now >= idle_at {
                return Some(TimeoutPhase::Idle);
            }
            // Not due yet (chunks kept coming): re-arm for the real deadline.
            self.timer.as_mut().reset(idle_at.min(self.total));
        }
        self.waker = Some(cx.waker().clone());
        None
    }
}
