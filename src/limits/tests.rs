//! The two stores are twins: the memory store's GCRA in Rust and the Redis
//! store's in Lua must give the same answers. Each scenario runs step by step
//! against both (a real `redis-server` on a free port) and every verdict,
//! remaining count and wait is compared. Rates are chosen so that the few
//! milliseconds between a step on one store and on the other cannot move a
//! count across an integer (at most 10 tokens a second, started from a full
//! bucket).

use std::time::Duration;

use super::*;
use crate::config::{ApiKey, RateLimitConfig, Secret};

#[test]
fn reset_durations_read_like_openais() {
    assert_eq!(duration_string(20.0), "20ms");
    assert_eq!(duration_string(1000.0), "1s");
    assert_eq!(duration_string(1500.0), "1.5s");
    assert_eq!(duration_string(360_000.0), "6m0s");
    assert_eq!(duration_string(3_723_000.0), "1h2m3s");
}

/// A `redis-server` of our own, killed when dropped.
pub(crate) struct RedisServer {
    pub(crate) port: u16,
    _child: tokio::process::Child,
}

pub(crate) async fn redis_server() -> RedisServer {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = tokio::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("redis-server must be installed (scripts/test.sh installs it)");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "redis did not start"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    RedisServer {
        port,
        _child: child,
    }
}

const KEY: &str = "sk-parity";

fn limiter(tier: TierConfig, store: StoreKind, redis_port: u16) -> Arc<Limiter> {
    let mut cfg = Config::default();
    cfg.tiers.insert("t".into(), tier);
    cfg.auth.keys = vec![ApiKey {
        name: "k".into(),
        sha256: Secret::new(hex::encode(Sha256::digest(KEY.as_bytes()))),
        tier: "t".into(),
    }];
    cfg.rate_limits = RateLimitConfig {
        store,
        redis: RedisConfig {
            url: Secret::new(format!("redis://127.0.0.1:{redis_port}")),
            // Each run has buckets of its own.
            key_prefix: format!("parity{}", fastrand::u64(..)),
            timeout: Duration::from_secs(2),
        },
        ..RateLimitConfig::default()
    };
    let metrics = Arc::new(Metrics::new(&cfg.telemetry.buckets));
    Limiter::from_config(&cfg, metrics, None).unwrap().unwrap()
}

fn identity(l: &Limiter) -> Arc<Identity> {
    let mut h = HeaderMap::new();
    h.insert(
        header::AUTHORIZATION,
        HeaderValue::from_str(&format!("Bearer {KEY}")).unwrap(),
    );
    l.identify(&h).unwrap()
}

/// What one admission answered, comparable across stores.
#[derive(Debug, PartialEq)]
enum Answer {
    Admitted {
        requests: Option<u32>,
        tokens: Option<u32>,
    },
    Refused {
        limit: LimitKind,
        /// Whole seconds to wait (the stores' clocks differ by milliseconds).
        retry_after_s: u64,
    },
}

enum Step {
    /// Admit a request reserving `prompt + max_tokens` tokens; keep it open.
    Admit { prompt: u32, max_tokens: u32 },
    /// Settle the oldest open request with `used` tokens (frees its slot).
    Settle { used: u32 },
    /// End the oldest open request without settling (the client went away
    /// before any usage: the reservation stands, the slot is freed).
    Drop,
}

async fn run(l: &Arc<Limiter>, steps: &[Step]) -> Vec<Answer> {
    let id = identity(l);
    let mut open: std::collections::VecDeque<Admission> = Default::default();
    let mut out = Vec::new();
    for step in steps {
        match *step {
            Step::Admit { prompt, max_tokens } => {
                match l.admit(&id, "m", prompt, Some(max_tokens)).await {
                    Ok(a) => {
                        out.push(Answer::Admitted {
                            requests: a.headers.requests.map(|w| w.remaining),
                            tokens: a.headers.tokens.map(|w| w.remaining),
                        });
                        open.push_back(a);
                    }
                    Err(GatewayError::RateLimited {
                        limit, retry_after, ..
                    }) => out.push(Answer::Refused {
                        limit,
                        retry_after_s: retry_after.as_secs_f64().round() as u64,
                    }),
                    Err(e) => panic!("{e}"),
                }
            }
            Step::Settle { used } => {
                let mut a = open.pop_front().unwrap();
                let (limiter, s) = a.settlement(used).unwrap();
                limiter.settle_now(&s).await;
            }
            Step::Drop => {
                let mut a = open.pop_front().unwrap();
                // What `Drop` does, awaited.
                let (limiter, mut s) = (a.limiter.take().unwrap(), a.settlement.take().unwrap());
                s.delta_tokens = 0;
                limiter.settle_now(&s).await;
            }
        }
    }
    out
}

async fn both(tier: TierConfig, steps: &[Step]) -> Vec<Answer> {
    let redis = redis_server().await;
    let memory = run(&limiter(tier.clone(), StoreKind::Memory, redis.port), steps).await;
    let shared = run(&limiter(tier, StoreKind::Redis, redis.port), steps).await;
    assert_eq!(memory, shared, "the stores disagree");
    memory
}

#[tokio::test]
async fn reservations_refunds_and_extra_charges_agree() {
    use Answer::Admitted as A;
    let tier = TierConfig {
        requests_per_minute: Some(6),
        tokens_per_minute: Some(600),
        ..TierConfig::default()
    };
    let got = both(
        tier,
        &[
            Step::Admit {
                prompt: 50,
                max_tokens: 100,
            },
            // Used 40 of the 150 reserved: 110 come back.
            Step::Settle { used: 40 },
            Step::Admit {
                prompt: 0,
                max_tokens: 100,
            },
            // Used 300 of 100: 200 more are charged.
            Step::Settle { used: 300 },
            Step::Admit {
                prompt: 0,
                max_tokens: 10,
            },
            // More than is left: refused on tokens, nothing spent.
            Step::Admit {
                prompt: 0,
                max_tokens: 400,
            },
            Step::Admit {
                prompt: 0,
                max_tokens: 10,
            },
            Step::Admit {
                prompt: 0,
                max_tokens: 10,
            },
            // The sixth (a refusal spends nothing).
            Step::Admit {
                prompt: 0,
                max_tokens: 1,
            },
            // The seventh in a minute of six: refused on requests.
            Step::Admit {
                prompt: 0,
                max_tokens: 1,
            },
        ],
    )
    .await;
    assert_eq!(
        got,
        vec![
            A {
                requests: Some(5),
                tokens: Some(450)
            },
            A {
                requests: Some(4),
                tokens: Some(460)
            },
            A {
                requests: Some(3),
                tokens: Some(250)
            },
            Answer::Refused {
                limit: LimitKind::Tokens,
                retry_after_s: 15
            },
            A {
                requests: Some(2),
                tokens: Some(240)
            },
            A {
                requests: Some(1),
                tokens: Some(230)
            },
            A {
                requests: Some(0),
                tokens: Some(229)
            },
            Answer::Refused {
                limit: LimitKind::Requests,
                retry_after_s: 10
            },
        ]
    );
}

#[tokio::test]
async fn a_refund_never_makes_a_bucket_fuller_than_full() {
    let tier = TierConfig {
        tokens_per_minute: Some(600),
        ..TierConfig::default()
    };
    let got = both(
        tier,
        &[
            Step::Admit {
                prompt: 0,
                max_tokens: 100,
            },
            Step::Settle { used: 0 },
            Step::Admit {
                prompt: 0,
                max_tokens: 100,
            },
        ],
    )
    .await;
    assert_eq!(
        got[1],
        Answer::Admitted {
            requests: None,
            tokens: Some(500)
        },
        "the refund restored the full 600, not more"
    );
}

#[tokio::test]
async fn concurrency_slots_are_taken_and_freed_alike() {
    let tier = TierConfig {
        concurrent_requests: Some(2),
        ..TierConfig::default()
    };
    let admit = Step::Admit {
        prompt: 0,
        max_tokens: 1,
    };
    let got = both(
        tier,
        &[
            admit,
            Step::Admit {
                prompt: 0,
                max_tokens: 1,
            },
            Step::Admit {
                prompt: 0,
                max_tokens: 1,
            },
            Step::Settle { used: 1 },
            Step::Admit {
                prompt: 0,
                max_tokens: 1,
            },
            Step::Drop,
            Step::Admit {
                prompt: 0,
                max_tokens: 1,
            },
            Step::Admit {
                prompt: 0,
                max_tokens: 1,
            },
        ],
    )
    .await;
    let free = Answer::Admitted {
        requests: None,
        tokens: None,
    };
    let full = Answer::Refused {
        limit: LimitKind::Concurrency,
        retry_after_s: 1,
    };
    assert_eq!(
        got,
        vec![
            Answer::Admitted {
                requests: None,
                tokens: None
            },
            free,
            full,
            Answer::Admitted {
                requests: None,
                tokens: None
            },
            Answer::Admitted {
                requests: None,
                tokens: None
            },
            Answer::Refused {
                limit: LimitKind::Concurrency,
                retry_after_s: 1
            }
        ]
    );
}
