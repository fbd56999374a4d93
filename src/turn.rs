//! Which poll of a connection's task is under way, so that a response body
//! can tell a repeated poll within one task poll from the next task poll.
//!
//! hyper's HTTP/1.1 dispatcher polls a streaming body up to three times per
//! wake-up: once for the event that arrived, then before its write and again
//! after its flush, both finding nothing. The body's first pending answer
//! registers the task's waker with everything that can wake it (the replica's
//! socket, the drain signal, the stream's timer). Until the task's poll ends
//! those registrations stand, or one of them has fired, and then the task is
//! polled again (a new turn). So a body that answered `Pending` in this turn
//! answers `Pending` again at once, without asking the socket, the signal and
//! the clock a second time: 470 instructions (5%) fewer per token of a paced
//! stream (callgrind, `PACED=1 benches/e2e/instructions.sh`: 8,626 -> 8,160).
//!
//! A turn also keeps the time ([`now`]): the clock is read once, when
//! something in the turn first asks, and the turn's later readings reuse it,
//! as nginx caches the time once per event-loop iteration. A turn does not
//! wait (it is one poll), so its readings lie microseconds apart; a
//! non-streamed request asked the clock ~16 times in two turns, ~30 ns each
//! on these machines plus ~60 instructions of `Instant` arithmetic. What
//! must not lose the turn's own duration (when a request is sent, when its
//! answer is ready: the gateway's overhead lies between) reads it afresh
//! ([`fresh`]), which also moves the turn's time on.
//!
//! Outside a connection's task (tests, a body polled by anything else) there
//! is no turn, and every poll asks everything, as before.
//!
//! The gateway's own server (`server/h1`) polls a body once per wake-up,
//! plus once after data to learn that nothing more came: a body whose data
//! drained its replica's socket registers every waker right then and
//! answers that poll at once (`TimedBody`, `Upstream::wait`).
//!
//! This holds because, inside a turn, only the connection's HTTP/1.1 server
//! (hyper's dispatcher or the gateway's own) polls the body, always with the
//! task's own `Context`. Anything that polled a
//! body inside the connection's task with a waker of its own (an HTTP/2
//! connection driven inline, a combinator with per-item wakers) would have to
//! start a turn of its own around those polls or not use this.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::time::Instant;

/// A poll of a connection's task; unique in the process. 0: none under way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Turn(u64);

impl Turn {
    /// Outside any connection's poll.
    pub(crate) const NONE: Turn = Turn(0);

    pub(crate) fn is_some(self) -> bool {
        self.0 != 0
    }
}

static NEXT: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static CURRENT: Cell<Turn> = const { Cell::new(Turn::NONE) };
    /// The turn's time, once something in it read the clock.
    static NOW: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// The time: in a turn, the turn's (read on its first use); outside any,
/// read now. `tokio::time::Instant`, so that tests on tokio's paused clock
/// see it.
pub(crate) fn now() -> Instant {
    if let Some(t) = NOW.get() {
        return t;
    }
    let t = Instant::now();
    if current().is_some() {
        NOW.set(Some(t));
    }
    t
}

/// [`now`] as a `std::time::Instant`.
pub(crate) fn now_std() -> std::time::Instant {
    now().into_std()
}

/// The clock read now, not the turn's time; the turn's later readings
/// follow it.
pub(crate) fn fresh() -> Instant {
    let t = Instant::now();
    if current().is_some() {
        NOW.set(Some(t));
    }
    t
}

/// The turn under way on this thread.
pub(crate) fn current() -> Turn {
    CURRENT.get()
}

/// Run one poll of a connection's task as a new turn (the server wraps each
/// poll of a connection's future in this).
pub(crate) fn take<R>(poll: impl FnOnce() -> R) -> R {
    /// Puts the outer turn (and its time) back even if the poll panics.
    struct Restore(Turn, Option<Instant>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.set(self.0);
            NOW.set(self.1);
        }
    }
    let turn = Turn(NEXT.fetch_add(1, Ordering::Relaxed));
    let _restore = Restore(CURRENT.replace(turn), NOW.replace(None));
    poll()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_poll_is_a_new_turn_and_none_outside() {
        assert_eq!(current(), Turn::NONE);
        let a = take(current);
        let b = take(current);
        assert!(a.is_some() && b.is_some());
        assert_ne!(a, b);
        assert!(
            take(|| take(current) != current()),
            "a nested poll is its own turn"
        );
        assert_eq!(current(), Turn::NONE);
        let _ = std::panic::catch_unwind(|| take(|| panic!("in a poll")));
        assert_eq!(current(), Turn::NONE, "restored after a panic");
    }

    /// Until the clock reads later than `t`.
    fn clock_past(t: Instant) {
        while Instant::now() <= t {
            std::hint::spin_loop();
        }
    }

    #[test]
    fn a_turn_reads_the_clock_once_unless_asked_afresh() {
        take(|| {
            let a = now();
            clock_past(a);
            assert_eq!(now(), a, "the turn's time is reused");
            assert_eq!(now_std(), a.into_std());
            clock_past(a);
            let b = fresh();
            assert!(b > a, "a fresh reading is the clock's");
            assert_eq!(now(), b, "and the turn's time follows it");
            clock_past(b);
            let inner = take(now);
            assert!(inner > b, "a nested turn has its own time");
            assert_eq!(now(), b, "the outer turn's time is put back");
        });
        let outside = now();
        clock_past(outside);
        assert!(
            now() > outside,
            "outside a turn every reading is the clock's"
        );
        let t = take(|| {
            let t = now();
            let _ = std::panic::catch_unwind(|| take(|| panic!("in a poll")));
            assert_eq!(now(), t, "kept across a nested poll's panic");
            t
        });
        clock_past(t);
        assert!(now() > t, "no turn's time outlives it");
    }
}
