//! The simulator's response stream: OpenAI chunks for the tokens the engine
//! produced, faults on cue.
//!
//! A body, not a task: each poll reads the request's [`Slot`] (how many tokens
//! exist) and emits the missing events; the engine wakes it when it produces.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};

use super::faults::Faults;
use super::generation::{Api, Generation, sse};
use super::protocols;
use super::slot::Slot;
use super::text::word;

/// Error from the body: makes hyper cut the connection mid-stream.
#[derive(Debug)]
pub(super) struct Dropped;

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("simulated connection drop")
    }
}

impl std::error::Error for Dropped {}

pub(super) struct SimStream {
    generation: Generation,
    faults: Faults,
    slot: Arc<Slot>,
    emitted: u32,
    /// Events due now, emitted one per poll.
    queue: VecDeque<Bytes>,
    ended: bool,
    /// The drop fault fired once: the connection is cut on the next poll.
    cutting: bool,
    /// Responses: the next event's sequence number, the text so far, and
    /// where the finished response is kept (with what it was asked).
    seq: u64,
    text: String,
    keep: Option<Keep>,
}

/// Where a finished response goes, and what it was asked.
pub(super) struct Keep {
    pub store: Arc<super::SimState>,
    pub turns: protocols::Turns,
    pub items: Vec<serde_json::Value>,
}

impl SimStream {
    pub(super) fn new(
        generation: Generation,
        faults: Faults,
        slot: Arc<Slot>,
        keep: Option<Keep>,
    ) -> Self {
        Self {
            generation,
            faults,
            slot,
            emitted: 0,
            queue: VecDeque::new(),
            ended: false,
            cutting: false,
            seq: 0,
            text: String::new(),
            keep,
        }
    }

    /// Queue the events of token `i`; `Err` to cut the connection.
    fn emit(&mut self, i: u32) -> Result<(), Dropped> {
        let f = &self.faults;
        if f.drop_after == Some(i) {
            return Err(Dropped);
        }
        if f.malformed_after == Some(i) {
            self.queue
                .push_back(Bytes::from_static(b"data: {\"choices\": [oops\n\n"));
        }
        if f.error_event_after == Some(i)
            && matches!(self.generation.api, Api::Messages | Api::Responses)
        {
            let responses = self.generation.api == Api::Responses;
            self.queue
                .push_back(protocols::error_event(responses, self.seq));
            self.ended = true;
            return Ok(());
        }
        if f.error_event_after == Some(i) {
            self.queue.push_back(sse(
                r#"{"error":{"object":"error","message":"simulated engine failure","type":"InternalServerError","param":null,"code":500}}"#,
            ));
            self.queue
                .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
            self.ended = true;
            return Ok(());
        }
        let g = &self.generation;
        match g.api {
            Api::Chat | Api::Completions => {
                if i == 0 && g.api == Api::Chat {
                    self.queue
                        .push_back(sse(&g.chunk(r#"{"role":"assistant","content":""}"#, None)));
                }
                self.queue.push_back(g.token_event(i));
            }
            Api::Messages => {
                if i == 0 {
                    self.queue
                        .extend(protocols::messages_head(g, self.slot.cached()));
                }
                self.queue
                    .push_back(protocols::messages_token(word(g.seed, i)));
            }
            Api::Responses => {
                if i == 0 {
                    self.queue
                        .extend(protocols::responses_head(g, &mut self.seq));
                }
                let w = word(g.seed, i);
                self.text.push_str(w);
                self.queue
                    .push_back(protocols::responses_token(g, &mut self.seq, w));
            }
        }
        self.emitted += 1;
        Ok(())
    }

    fn finish(&mut self) {
        let g = &self.generation;
        match g.api {
            Api::Chat | Api::Completions => {}
            Api::Messages => {
                self.queue.extend(protocols::messages_tail(g));
                self.ended = true;
                return;
            }
            Api::Responses => {
                let (events, obj) =
                    protocols::responses_tail(g, &mut self.seq, &self.text, self.slot.cached());
                self.queue.extend(events);
                if let Some(k) = self.keep.take() {
                    k.store.responses.put(obj, k.turns, k.items);
                }
                self.ended = true;
                return;
            }
        }
        if self.generation.include_usage {
            let cached = self.slot.cached();
            self.queue.push_back(self.generation.usage_event(cached));
        }
        self.queue
            .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.ended = true;
    }
}

impl Body for SimStream {
    type Data = Bytes;
    type Error = Dropped;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Dropped>>> {
        let this = self.get_mut();
        loop {
            if let Some(ev) = this.queue.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(ev))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            let produced = this.slot.produced();
            if this.emitted < produced {
                let i = this.emitted;
                if let Err(e) = this.emit(i) {
                    if !this.cutting {
                        // What was sent before the cut reaches the client
                        // first: hyper flushes its write buffer when the body
                        // is pending, and drops it unflushed on an error.
                        this.cutting = true;
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    this.ended = true;
                    return Poll::Ready(Some(Err(e)));
                }
                continue;
            }
            if this.slot.is_done() {
                this.finish();
                continue;
            }
            this.slot.register(cx.waker());
            // Re-check after registering: the engine may have moved meanwhile.
            if this.slot.produced() == produced && !this.slot.is_done() {
                return Poll::Pending;
            }
        }
    }
}

impl Drop for SimStream {
    fn drop(&mut self) {
        // A client gone mid-generation: the engine drops the request (abort).
        self.slot.cancel();
    }
}
