//! A one-shot signal that tasks polled once per token can watch for free:
//! the gateway's stop (every connection's task) and its drain deadline
//! (every open stream).
//!
//! A [`CancellationToken`] (or a `watch` channel) alone costs two mutex
//! locks per poll: its flag, then its `Notify`'s waiter list to refresh the
//! waker. Here the flag is an atomic read, and the task's waker is
//! registered with the token once, and again only when the task's waker
//! changes (`Waker::will_wake`), which a connection's task never does.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Waker};

use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// Raised once. Clones share it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Signal {
    flag: Arc<AtomicBool>,
    token: CancellationToken,
}

impl Signal {
    /// Raise it: every watcher is woken.
    pub(crate) fn raise(&self) {
        // The flag first: a stream woken by the token must see it.
        self.flag.store(true, Ordering::Release);
        self.token.cancel();
    }

    pub(crate) fn is_raised(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// Resolves once raised (for loops polled rarely, like accepting).
    pub(crate) async fn raised(&self) {
        self.token.cancelled().await;
    }

    /// A watch for one task polled often.
    pub(crate) fn watch(&self) -> SignalWatch {
        SignalWatch {
            signal: self.clone(),
            wait: None,
            waker: None,
        }
    }
}

/// One task's view of the [`Signal`]: [`poll`](Self::poll) on every pending poll.
pub(crate) struct SignalWatch {
    signal: Signal,
    /// Registered with the token at the first pending poll.
    wait: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
    /// The waker the registration wakes.
    waker: Option<Waker>,
}

impl SignalWatch {
    /// Whether it is raised; if not, `cx` is woken when it is.
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> bool {
        if self.signal.is_raised() {
            return true;
        }
        if self.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            return false;
        }
        let token = &self.signal.token;
        let wait = self
            .wait
            .get_or_insert_with(|| Box::pin(token.clone().cancelled_owned()));
        if wait.as_mut().poll(cx).is_ready() {
            return true;
        }
        self.waker = Some(cx.waker().clone());
        false
    }
}
