//! Quality signals read from content: the refusal detector's phrases, and
//! what one answer's content said, in counts (`stream::quality` reads it).

use std::sync::Arc;

use crate::config::RefusalConfig;

/// The refusal detector: phrases looked for in an answer's opening.
#[derive(Debug)]
pub struct Refusal {
    pub(crate) chars: usize,
    /// Lowercased, with typographic apostrophes made plain.
    phrases: Vec<String>,
}

impl Refusal {
    /// The detector `config` asks for, if it is on.
    pub fn from_config(config: &RefusalConfig) -> Option<Arc<Self>> {
        (config.enabled && config.chars > 0 && !config.phrases.is_empty()).then(|| {
            Arc::new(Self {
                chars: config.chars,
                phrases: config.phrases.iter().map(|p| fold(p)).collect(),
            })
        })
    }

    pub(crate) fn matches(&self, opening: &str) -> bool {
        self.phrases.iter().any(|p| opening.contains(p.as_str()))
    }
}

/// Lowercase, `’` as `'`: how openings and phrases are compared.
fn fold(s: &str) -> String {
    s.chars()
        .flat_map(char::to_lowercase)
        .map(|c| if c == '\u{2019}' { '\'' } else { c })
        .collect()
}

/// What one answer's content said, in counts.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub tool_calls: u32,
    pub invalid_tool_calls: u32,
    pub refusal: bool,
}
