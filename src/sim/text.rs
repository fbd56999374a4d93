//! Deterministic generated text and prompt reading for the simulator.

use serde_json::Value;

const WORDS: [&str; 32] = [
    " the", " model", " token", " cache", " replica", " stream", " latency", " prefix", " block",
    " queue", " batch", " decode", " prefill", " gateway", " route", " metric", " fleet",
    " tenant", " limit", " trace", " sample", " window", " budget", " signal", " river", " sluice",
    " gate", " flow", " water", " channel", " bank", " lock",
];

/// splitmix64: a fast, well-mixed hash for picking words.
pub(crate) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The `i`-th word of the generation seeded by `seed` (the same prompt always
/// yields the same text).
pub(crate) fn word(seed: u64, i: u32) -> &'static str {
    WORDS[(mix(seed ^ u64::from(i)) % WORDS.len() as u64) as usize]
}

/// FNV-1a over bytes: the seed of a prompt.
pub(crate) fn seed_of(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The prompt's text pieces: chat message contents (string or text parts) or
/// the completion prompt (string or list of strings).
pub(crate) fn prompt_texts(body: &Value) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(msgs) = body.get("messages").and_then(Value::as_array) {
        for m in msgs {
            match m.get("content") {
                Some(Value::String(s)) => out.push(s.clone()),
                Some(Value::Array(parts)) => {
                    let text: Vec<&str> = parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .collect();
                    out.push(text.join(""));
                }
                _ => out.push(String::new()),
            }
        }
    } else {
        match body.get("prompt").or_else(|| body.get("input")) {
            Some(Value::String(s)) => out.push(s.clone()),
            Some(Value::Array(items)) => {
                out.extend(items.iter().filter_map(Value::as_str).map(str::to_string));
            }
            _ => {}
        }
    }
    out
}

/// The prompt as one string for prefix hashing: `role\ncontent\n` per chat
/// message (roles matter: the same words as system or user prompt differ), or
/// the completion prompt(s). Equal conversation prefixes give equal prefixes here.
pub(crate) fn canonical_prompt(body: &Value) -> String {
    let mut out = String::new();
    if let Some(msgs) = body.get("messages").and_then(Value::as_array) {
        let texts = prompt_texts(body);
        for (m, text) in msgs.iter().zip(texts) {
            out.push_str(m.get("role").and_then(Value::as_str).unwrap_or("user"));
            out.push('\n');
            out.push_str(&text);
            out.push('\n');
        }
    } else {
        out = prompt_texts(body).concat();
    }
    out
}
