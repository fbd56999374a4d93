//! The in-process store: GCRA state per bucket in sharded maps. One short lock
//! per admission and per settlement, never per token.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::time::Instant;

use super::gcra::{self, window};
use super::{Ask, Refusal, Verdict};
use crate::vocab::LimitKind;

#[derive(Default)]
struct State {
    requests_tat: f64,
    tokens_tat: f64,
    in_flight: u32,
}

pub(super) struct MemoryStore {
    shards: Vec<Mutex<HashMap<String, State>>>,
    epoch: Instant,
}

const SHARDS: usize = 16;

impl Default for MemoryStore {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            epoch: Instant::now(),
        }
    }
}

impl MemoryStore {
    fn shard(&self, bucket: &str) -> &Mutex<HashMap<String, State>> {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        bucket.hash(&mut h);
        &self.shards[(h.finish() as usize) % SHARDS]
    }

    fn now_ms(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1000.0
    }

    pub(super) fn admit(&self, ask: &Ask<'_>) -> Verdict {
        let now = self.now_ms();
        let mut map = self.shard(ask.bucket).lock();
        let st = map.entry(ask.bucket.to_string()).or_default();
        let req_window = ask.requests.map(|r| window(r, st.requests_tat, now));
        let tok_window = ask.tokens.map(|r| window(r, st.tokens_tat, now));
        let refuse = |limit, retry_after_ms| {
            Verdict::Refused(Refusal {
                limit,
                retry_after_ms,
                requests: req_window,
                tokens: tok_window,
            })
        };
        if let Some(max) = ask.concurrency
            && st.in_flight >= max
        {
            return refuse(LimitKind::Concurrency, 1000.0);
        }
        let new_req = match ask
            .requests
            .map(|r| gcra::spend(r, st.requests_tat, now, 1.0))
        {
            Some(Err(wait)) => return refuse(LimitKind::Requests, wait),
            Some(Ok(t)) => Some(t),
            None => None,
        };
        let cost = f64::from(ask.cost);
        let new_tok = match ask.tokens.map(|r| gcra::spend(r, st.tokens_tat, now, cost)) {
            Some(Err(wait)) => return refuse(LimitKind::Tokens, wait),
            Some(Ok(t)) => Some(t),
            None => None,
        };
        if let Some(t) = new_req {
            st.requests_tat = t;
        }
        if let Some(t) = new_tok {
            st.tokens_tat = t;
        }
        if ask.concurrency.is_some() {
            st.in_flight += 1;
        }
        Verdict::Admitted {
            requests: ask.requests.map(|r| window(r, st.requests_tat, now)),
            tokens: ask.tokens.map(|r| window(r, st.tokens_tat, now)),
        }
    }

    pub(super) fn settle(&self, s: &super::Settlement) {
        let now = self.now_ms();
        let mut map = self.shard(&s.bucket).lock();
        if let Some(st) = map.get_mut(&s.bucket) {
            if let Some(r) = s.tokens {
                st.tokens_tat = gcra::settle(r, st.tokens_tat, now, s.delta_tokens as f64);
            }
            if s.release {
                st.in_flight = st.in_flight.saturating_sub(1);
            }
        }
    }
}
