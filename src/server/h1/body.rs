//! A request body still arriving when its handler starts: the connection
//! reads the socket and feeds the body's bytes here; the handler takes them.
//!
//! Both run on the connection's task (the handler is polled by it), so the
//! lock is never contended; it is there because a handler's body must be
//! `Send`. A body already whole in the first read (the usual small JSON
//! request) never comes here: the handler gets it as one `Bytes`.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body::{Body, Frame};
use parking_lot::Mutex;

/// Bytes fed and not yet taken above which the connection stops reading.
const FEED_LIMIT: usize = 256 * 1024;

#[derive(Default)]
struct Shared {
    chunks: VecDeque<Bytes>,
    queued: usize,
    /// `Some` once the body is over: cleanly, or with why not.
    end: Option<Result<(), String>>,
    /// The handler has asked for the body (the go for `100-continue`).
    asked: bool,
    /// The handler's task, waiting for bytes.
    waker: Option<Waker>,
    /// The connection's task, waiting for the handler to take bytes.
    feeder: Option<Waker>,
}

/// The connection's end.
pub(super) struct Feed(Arc<Mutex<Shared>>);

/// The handler's end: an `http_body::Body`.
pub(super) struct Streamed(Arc<Mutex<Shared>>);

pub(super) fn channel() -> (Feed, Streamed) {
    let shared = Arc::new(Mutex::new(Shared::default()));
    (Feed(shared.clone()), Streamed(shared))
}

impl Feed {
    pub(super) fn push(&self, data: Bytes) {
        let mut s = self.0.lock();
        s.queued += data.len();
        s.chunks.push_back(data);
        if let Some(w) = s.waker.take() {
            w.wake();
        }
    }

    /// The body is over: `Ok` at its end, `Err` if it cannot be read whole.
    pub(super) fn end(&self, how: Result<(), String>) {
        let mut s = self.0.lock();
        s.end.get_or_insert(how);
        if let Some(w) = s.waker.take() {
            w.wake();
        }
    }

    /// Whether the connection should read more for it now: the handler
    /// still holds the body and has not fallen behind. When it has, `cx` is
    /// woken once it takes some.
    pub(super) fn wants(&self, cx: &mut Context<'_>) -> bool {
        if Arc::strong_count(&self.0) == 1 {
            return false;
        }
        let mut s = self.0.lock();
        if s.queued < FEED_LIMIT {
            return true;
        }
        s.feeder = Some(cx.waker().clone());
        false
    }

    /// Whether the handler has asked for the body.
    pub(super) fn asked(&self) -> bool {
        self.0.lock().asked
    }
}

impl Body for Streamed {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let mut s = self.0.lock();
        s.asked = true;
        if let Some(data) = s.chunks.pop_front() {
            s.queued -= data.len();
            if s.queued < FEED_LIMIT
                && let Some(w) = s.feeder.take()
            {
                w.wake();
            }
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        match &s.end {
            Some(Ok(())) => Poll::Ready(None),
            Some(Err(why)) => Poll::Ready(Some(Err(io::Error::other(why.clone())))),
            None => {
                if !s.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    s.waker = Some(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }
}
