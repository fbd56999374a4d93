//! A request as its producer gets it (the engine model or the fixed clock),
//! and the [`Slot`] the producer shares with the request's HTTP stream.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, Ordering};
use std::task::Waker;
use std::time::Duration;

use atomic_waker::AtomicWaker;
use tokio::time::Instant;

/// What one request shares with its HTTP stream: tokens produced so far and
/// whether it is over. The engine writes, the stream reads and may cancel.
#[derive(Default)]
pub(crate) struct Slot {
    produced: AtomicU32,
    /// Prompt tokens served from the prefix cache when the request was
    /// admitted (vLLM's `prompt_tokens_details.cached_tokens`).
    cached: AtomicU32,
    done: AtomicU8,
    cancelled: AtomicBool,
    /// The HTTP stream waiting for tokens.
    waker: AtomicWaker,
    /// A producer waiting on a timer, to learn of a cancel at once.
    cancel_waker: AtomicWaker,
    /// Anyone else waiting for the end (an SGLang prefill leg's room).
    ended: tokio::sync::Notify,
}

impl Slot {
    pub(crate) fn cached(&self) -> u32 {
        self.cached.load(Ordering::Acquire)
    }

    pub(crate) fn produced(&self) -> u32 {
        self.produced.load(Ordering::Acquire)
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire) != 0
    }

    /// The client went away: the engine drops the request at its next step.
    pub(crate) fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
        self.cancel_waker.wake();
    }

    /// Resolves once the request is cancelled.
    pub(crate) async fn cancelled(&self) {
        std::future::poll_fn(|cx| {
            self.cancel_waker.register(cx.waker());
            if self.is_cancelled() {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        })
        .await
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    pub(crate) fn register(&self, w: &Waker) {
        self.waker.register(w);
    }

    /// Tokens whose KV came from the prefix cache, once known.
    pub(super) fn set_cached(&self, tokens: u32) {
        self.cached.store(tokens, Ordering::Release);
    }

    pub(super) fn push(&self, produced: u32) {
        self.produced.store(produced, Ordering::Release);
        self.waker.wake();
    }

    /// Resolves once the request is over.
    pub(crate) async fn finished(&self) {
        loop {
            let ended = self.ended.notified();
            if self.is_done() {
                return;
            }
            ended.await;
        }
    }

    pub(super) fn finish(&self) {
        self.done.store(1, Ordering::Release);
        self.ended.notify_waiters();
        self.waker.wake();
    }
}

/// A request as the engine sees it.
pub(crate) struct Request {
    pub prompt_tokens: u32,
    /// Chained hashes of the prompt's full blocks (for the prefix cache).
    pub hashes: Vec<u64>,
    pub output_tokens: u32,
    /// `stop` or `length`, reported when it finishes.
    pub finish_reason: &'static str,
    pub arrival: Instant,
    /// Fault: after this many tokens, produce nothing for this long.
    pub stall: Option<(u32, Duration)>,
    /// Fault: its KV blocks are never freed when it ends (finished or
    /// aborted), as an engine whose exit path forgets to free them.
    pub leak: bool,
    /// Prompt tokens whose KV came from a prefill replica (disaggregation):
    /// computed already, but for the last token.
    pub remote_tokens: u32,
    /// The body's `priority` (vLLM: lower runs earlier; 0 when absent),
    /// read under `--scheduling-policy priority`.
    pub priority: i64,
}
