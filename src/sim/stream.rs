//! The simulator's response stream: OpenAI chunks on a clock, faults on cue.
//!
//! A body, not a task: each poll checks one timer and emits at most one event,
//! so thousands of concurrent streams cost only their timers.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use tokio::time::{Instant, Sleep};

use super::SimState;
use super::faults::Faults;
use super::text::word;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completions,
}

/// Everything fixed about one simulated generation.
#[derive(Debug, Clone)]
pub struct Generation {
    pub api: Api,
    pub id: String,
    pub created: u64,
    pub model: Arc<str>,
    pub seed: u64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// `length` if the output was cut by `max_tokens`, else `stop`.
    pub finish_reason: &'static str,
    pub include_usage: bool,
}

impl Generation {
    pub fn chunk(&self, delta: &str, finish: Option<&str>) -> String {
        let finish = finish.map_or("null".to_string(), |f| format!("\"{f}\""));
        match self.api {
            Api::Chat => format!(
                r#"{{"id":"{}","object":"chat.completion.chunk","created":{},"model":"{}","choices":[{{"index":0,"delta":{},"logprobs":null,"finish_reason":{}}}]}}"#,
                self.id, self.created, self.model, delta, finish
            ),
            Api::Completions => format!(
                r#"{{"id":"{}","object":"text_completion","created":{},"model":"{}","choices":[{{"index":0,"text":{},"logprobs":null,"finish_reason":{}}}]}}"#,
                self.id, self.created, self.model, delta, finish
            ),
        }
    }

    fn token_event(&self, i: u32) -> Bytes {
        let text = serde_json::to_string(word(self.seed, i)).unwrap_or_default();
        let last = i + 1 == self.output_tokens;
        let delta = match self.api {
            Api::Chat => format!(r#"{{"content":{text}}}"#),
            Api::Completions => text,
        };
        let finish = last.then_some(self.finish_reason);
        sse(&self.chunk(&delta, finish))
    }

    fn usage_event(&self) -> Bytes {
        let object = match self.api {
            Api::Chat => "chat.completion.chunk",
            Api::Completions => "text_completion",
        };
        sse(&format!(
            r#"{{"id":"{}","object":"{}","created":{},"model":"{}","choices":[],"usage":{{"prompt_tokens":{},"total_tokens":{},"completion_tokens":{}}}}}"#,
            self.id,
            object,
            self.created,
            self.model,
            self.prompt_tokens,
            self.prompt_tokens + self.output_tokens,
            self.output_tokens
        ))
    }
}

pub fn sse(payload: &str) -> Bytes {
    Bytes::from(format!("data: {payload}\n\n"))
}

/// Error from the body: makes hyper cut the connection mid-stream.
#[derive(Debug)]
pub struct Dropped;

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("simulated connection drop")
    }
}

impl std::error::Error for Dropped {}

pub struct SimStream {
    sim: Arc<SimState>,
    generation: Generation,
    faults: Faults,
    token_delay: Duration,
    timer: Pin<Box<Sleep>>,
    next_at: Instant,
    produced: u32,
    stalled: bool,
    /// Events due now, emitted one per poll.
    queue: VecDeque<Bytes>,
    ended: bool,
    finished: bool,
}

impl SimStream {
    pub fn new(
        sim: Arc<SimState>,
        generation: Generation,
        faults: Faults,
        first_at: Instant,
        token_delay: Duration,
    ) -> Self {
        sim.metrics.running.inc();
        Self {
            sim,
            generation,
            faults,
            token_delay,
            timer: Box::pin(tokio::time::sleep_until(first_at)),
            next_at: first_at,
            produced: 0,
            stalled: false,
            queue: VecDeque::new(),
            ended: false,
            finished: false,
        }
    }

    /// The events due at this tick; `Err` to cut the connection.
    fn tick(&mut self) -> Result<(), Dropped> {
        let i = self.produced;
        let f = &self.faults;
        if f.drop_after == Some(i) {
            return Err(Dropped);
        }
        if let Some((n, d)) = f.stall
            && n == i
            && !self.stalled
        {
            self.stalled = true;
            self.next_at += d;
            return Ok(());
        }
        if f.malformed_after == Some(i) {
            self.queue
                .push_back(Bytes::from_static(b"data: {\"choices\": [oops\n\n"));
        }
        if f.error_event_after == Some(i) {
            self.queue.push_back(sse(
                r#"{"error":{"object":"error","message":"simulated engine failure","type":"InternalServerError","param":null,"code":500}}"#,
            ));
            self.queue
                .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
            self.ended = true;
            self.sim.metrics.finished("error");
            return Ok(());
        }
        let g = &self.generation;
        if i == 0 && g.api == Api::Chat {
            self.queue
                .push_back(sse(&g.chunk(r#"{"role":"assistant","content":""}"#, None)));
        }
        self.queue.push_back(g.token_event(i));
        self.produced += 1;
        self.sim.metrics.generation_tokens.inc();
        if self.produced == g.output_tokens {
            if g.include_usage {
                self.queue.push_back(g.usage_event());
            }
            self.queue
                .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
            self.ended = true;
            self.sim.metrics.finished(g.finish_reason);
        }
        self.next_at += self.token_delay;
        Ok(())
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
                this.finished = true;
                return Poll::Ready(None);
            }
            if this.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            if let Err(e) = this.tick() {
                this.finished = true;
                this.sim.metrics.finished("abort");
                return Poll::Ready(Some(Err(e)));
            }
            let at = this.next_at;
            this.timer.as_mut().reset(at);
        }
    }
}

impl Drop for SimStream {
    fn drop(&mut self) {
        self.sim.metrics.running.dec();
        if !self.finished && !self.ended {
            // The client (the gateway) went away: vLLM aborts such a request.
            self.sim.metrics.finished("abort");
        }
    }
}
