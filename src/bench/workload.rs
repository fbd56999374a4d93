//! Request shapes for `sluice bench`, named after the usual serving-benchmark
//! scenarios. Lengths are in tokens of the approximate tokenizer
//! (`crate::tokens`, 4 characters per token), so prompts are built to size.

/// What each request looks like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// Every request exactly `--prompt-tokens` in, `--max-tokens` out.
    Fixed,
    /// Prompt and output lengths uniform in [50%, 150%] of the given sizes.
    Random,
    /// `--prefixes` distinct shared prefixes of `--prefix-tokens` tokens, each
    /// request one of them (uniformly) followed by a unique suffix.
    SharedPrefix,
    /// Long prompts (8x `--prompt-tokens`), short answers: prefill-bound.
    LongPrompt,
    /// Short prompts, long answers (8x `--max-tokens`): decode-bound.
    LongOutput,
    /// `random` shapes arriving in bursts: `--burst-size` requests at once
    /// every `--burst-interval`.
    Burst,
    /// Coding-agent sessions: a shared `--prefix-tokens` system + tools
    /// prompt, growing histories, tool results, think time (see `--sessions`).
    Agentic,
}

#[derive(Debug, Clone)]
pub(crate) struct Shape {
    pub workload: Workload,
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    pub prefixes: u32,
    pub prefix_tokens: u32,
    /// Opens each prompt's unique part (`--salt`): bench processes with
    /// different salts send prompts that share nothing but the prefixes.
    pub salt: String,
}

/// Builds prompts; deterministic for a given seed.
pub(crate) struct Generator {
    shape: Shape,
    rng: fastrand::Rng,
    prefixes: Vec<String>,
    /// The shared prefix the last prompt opened with (`shared-prefix`).
    pub(crate) last_prefix: Option<usize>,
}

const FILLER: &str = "Sluice streams every token of every answer and times each one. ";

pub(crate) fn text_of_tokens(tokens: u32, salt: &str) -> String {
    let chars = tokens as usize * crate::tokens::CHARS_PER_TOKEN;
    let mut s = String::with_capacity(chars + salt.len());
    s.push_str(salt);
    s.extend(
        FILLER
            .chars()
            .cycle()
            .take(chars.saturating_sub(salt.len())),
    );
    s
}

impl Generator {
    pub(crate) fn new(shape: Shape, seed: u64) -> Self {
        let prefixes = (0..shape.prefixes.max(1))
            .map(|i| text_of_tokens(shape.prefix_tokens, &format!("[document {i}] ")))
            .collect();
        Self {
            shape,
            rng: fastrand::Rng::with_seed(seed),
            prefixes,
            last_prefix: None,
        }
    }

    fn around(&mut self, n: u32) -> u32 {
        let lo = (n / 2).max(1);
        self.rng.u32(lo..=lo + n)
    }

    /// The chat messages and `max_tokens` of request number `n`.
    pub(crate) fn next(&mut self, n: u64) -> (serde_json::Value, u32) {
        let unique = format!("{}#{n} ", self.shape.salt);
        let s = self.shape.clone();
        self.last_prefix = None;
        let (system, user, max_tokens) = match s.workload {
            // Agentic sessions are built by `bench::agentic`, not here.
            Workload::Fixed | Workload::Agentic => {
                (None, text_of_tokens(s.prompt_tokens, &unique), s.max_tokens)
            }
            Workload::Random | Workload::Burst => {
                let p = self.around(s.prompt_tokens);
                let o = self.around(s.max_tokens);
                (None, text_of_tokens(p, &unique), o)
            }
            Workload::SharedPrefix => {
                let i = self.rng.usize(..self.prefixes.len());
                self.last_prefix = Some(i);
                let prefix = self.prefixes[i].clone();
                (
                    Some(prefix),
                    text_of_tokens(s.prompt_tokens, &unique),
                    s.max_tokens,
                )
            }
            Workload::LongPrompt => (
                None,
                text_of_tokens(s.prompt_tokens * 8, &unique),
                s.max_tokens,
            ),
            Workload::LongOutput => (
                None,
                text_of_tokens(s.prompt_tokens, &unique),
                s.max_tokens * 8,
            ),
        };
        let mut messages = Vec::new();
        if let Some(sys) = system {
            messages.push(serde_json::json!({"role": "system", "content": sys}));
        }
        messages.push(serde_json::json!({"role": "user", "content": user}));
        (serde_json::Value::Array(messages), max_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(w: Workload) -> Shape {
        Shape {
            workload: w,
            prompt_tokens: 100,
            max_tokens: 50,
            prefixes: 3,
            prefix_tokens: 1000,
            salt: String::new(),
        }
    }

    #[test]
    fn shared_prefix_requests_share_one_of_n_prefixes() {
        let mut g = Generator::new(shape(Workload::SharedPrefix), 7);
        let mut seen = std::collections::HashSet::new();
        for n in 0..50 {
            let (m, max) = g.next(n);
            assert_eq!(max, 50);
            let sys = m[0]["content"].as_str().unwrap_or_default().to_string();
            assert_eq!(crate::tokens::estimate(&sys), 1000);
            // The prefix it names is the one the prompt opens with.
            let i = g.last_prefix.unwrap_or(usize::MAX);
            assert!(sys.starts_with(&format!("[document {i}] ")), "{i}");
            seen.insert(sys);
            assert!(
                m[1]["content"]
                    .as_str()
                    .unwrap_or_default()
                    .starts_with(&format!("#{n} "))
            );
        }
        assert_eq!(seen.len(), 3);
    }

    #[test]
    fn a_salt_makes_the_prompts_distinct_but_not_the_prefixes() {
        let (a, _) = Generator::new(shape(Workload::SharedPrefix), 7).next(0);
        let salted = Shape {
            salt: "g1".into(),
            ..shape(Workload::SharedPrefix)
        };
        let (b, _) = Generator::new(salted, 7).next(0);
        assert_eq!(a[0], b[0], "the same shared prefix");
        assert_eq!(a[1]["content"].as_str().unwrap().get(..3), Some("#0 "));
        assert_eq!(b[1]["content"].as_str().unwrap().get(..5), Some("g1#0 "));
        assert_eq!(
            crate::tokens::estimate(b[1]["content"].as_str().unwrap()),
            100,
            "the same length"
        );
    }

    #[test]
    fn sizes_follow_the_workload() {
        let (m, max) = Generator::new(shape(Workload::LongPrompt), 1).next(0);
        assert_eq!(
            crate::tokens::estimate(m[0]["content"].as_str().unwrap_or_default()),
            800
        );
        assert_eq!(max, 50);
        let mut g = Generator::new(shape(Workload::LongOutput), 1);
        let (_, max) = g.next(0);
        assert_eq!(max, 400);
        assert_eq!(g.last_prefix, None, "no shared prefix");
        let mut g = Generator::new(shape(Workload::Random), 1);
        for n in 0..20 {
            let (m, max) = g.next(n);
            let p = crate::tokens::estimate(m[0]["content"].as_str().unwrap_or_default());
            assert!((50..=151).contains(&p), "{p}");
            assert!((25..=76).contains(&max), "{max}");
        }
    }
}
