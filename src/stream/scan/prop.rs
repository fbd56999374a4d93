//! The fast scanner against serde_json, on generated chunks (stable
//! proptest). Generated chunks mix what engines send with what they might:
//! odd whitespace, escapes, unknown keys, nulls, wrong types, duplicate keys,
//! fractional or oversized counts. The scanner may decline (`None`, the
//! serde reader then decides) but must never disagree. A third reader over
//! `serde_json::Value`, written from the meaning of the fields, checks the
//! serde reader itself on well-formed chunks.

use proptest::prelude::*;
use serde_json::Value;

use super::*;
use crate::stream::event::chunk_info_serde;

/// A JSON value as text, built with optional whitespace around tokens.
#[derive(Debug, Clone)]
pub(crate) enum J {
    Raw(String),
    Str(String),
    Arr(Vec<J>),
    Obj(Vec<(String, J)>),
}

impl J {
    fn render(&self, ws: &mut impl Iterator<Item = &'static str>, out: &mut String) {
        fn sp(ws: &mut impl Iterator<Item = &'static str>, out: &mut String) {
            out.push_str(ws.next().unwrap_or(""));
        }
        match self {
            J::Raw(s) => out.push_str(s),
            J::Str(s) => out.push_str(&serde_json::to_string(s).unwrap()),
            J::Arr(items) => {
                out.push('[');
                for (i, it) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    sp(ws, out);
                    it.render(ws, out);
                    sp(ws, out);
                }
                out.push(']');
            }
            J::Obj(members) => {
                out.push('{');
                for (i, (k, v)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    sp(ws, out);
                    out.push_str(&serde_json::to_string(k).unwrap());
                    sp(ws, out);
                    out.push(':');
                    sp(ws, out);
                    v.render(ws, out);
                    sp(ws, out);
                }
                out.push('}');
            }
        }
    }
}

pub(crate) fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        "[a-z ]{1,12}",
        Just("q\"uote\\".to_string()),
        Just("café ☕ \u{1F600}".to_string()),
        Just("}],{\":".to_string()),
        Just("line\nbreak\ttab".to_string()),
    ]
}

pub(crate) fn scalar() -> impl Strategy<Value = J> {
    prop_oneof![
        Just(J::Raw("null".into())),
        Just(J::Raw("true".into())),
        (0u64..100_000).prop_map(|n| J::Raw(n.to_string())),
        Just(J::Raw("-1".into())),
        Just(J::Raw("1.5".into())),
        Just(J::Raw("2e3".into())),
        text().prop_map(J::Str),
    ]
}

pub(crate) fn any_value() -> impl Strategy<Value = J> {
    scalar().prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(J::Arr),
            proptest::collection::vec((object_key(), inner), 0..4).prop_map(J::Obj),
        ]
    })
}

/// Unknown keys: mostly short, some long (the scanner must read and skip
/// both itself).
pub(crate) fn object_key() -> impl Strategy<Value = String> {
    prop_oneof![3 => "[a-z_]{1,8}", 1 => "[a-z_]{20,40}"]
}

fn output_value() -> impl Strategy<Value = J> {
    prop_oneof![
        text().prop_map(J::Str),
        Just(J::Raw("null".into())),
        Just(J::Arr(vec![])),
        Just(J::Obj(vec![])),
        any_value(),
    ]
}

/// A delta's `tool_calls` as engines send them (calls with a `function`
/// whose `arguments` is usually a string), or any value.
fn tool_calls() -> impl Strategy<Value = J> {
    let arguments = prop_oneof![3 => text().prop_map(J::Str), 1 => any_value()];
    let function = proptest::collection::vec(
        prop_oneof![
            3 => arguments.prop_map(|a| ("arguments".to_string(), a)),
            1 => text().prop_map(|t| ("name".to_string(), J::Str(t))),
        ],
        0..3,
    )
    .prop_map(J::Obj);
    let call = proptest::collection::vec(
        prop_oneof![
            3 => function.prop_map(|f| ("function".to_string(), f)),
            1 => (0u32..3).prop_map(|i| ("index".to_string(), J::Raw(i.to_string()))),
            1 => any_value().prop_map(|v| ("type".to_string(), v)),
        ],
        0..4,
    )
    .prop_map(J::Obj);
    prop_oneof![
        3 => proptest::collection::vec(prop_oneof![4 => call, 1 => any_value()], 0..3)
            .prop_map(J::Arr),
        1 => output_value(),
    ]
}

fn delta() -> impl Strategy<Value = J> {
    let key = prop_oneof![
        Just("content"),
        Just("reasoning_content"),
        Just("reasoning"),
        Just("function_call"),
        Just("role"),
        Just("refusal"),
    ];
    let member = prop_oneof![
        3 => (key, output_value()).prop_map(|(k, v)| (k.to_string(), v)),
        1 => tool_calls().prop_map(|v| ("tool_calls".to_string(), v)),
    ];
    proptest::collection::vec(member, 0..4).prop_map(J::Obj)
}

fn finish() -> impl Strategy<Value = J> {
    prop_oneof![
        Just(J::Raw("null".into())),
        prop_oneof![
            Just("stop"),
            Just("length"),
            Just("tool_calls"),
            Just("abort"),
            Just("weird")
        ]
        .prop_map(|s| J::Str(s.into())),
        scalar(),
    ]
}

fn choice() -> impl Strategy<Value = J> {
    let member = prop_oneof![
        (0u32..3).prop_map(|i| ("index".to_string(), J::Raw(i.to_string()))),
        delta().prop_map(|d| ("delta".to_string(), d)),
        prop_oneof![3 => delta(), 1 => any_value()].prop_map(|d| ("message".to_string(), d)),
        output_value().prop_map(|t| ("text".to_string(), t)),
        finish().prop_map(|f| ("finish_reason".to_string(), f)),
        Just(("logprobs".to_string(), J::Raw("null".into()))),
        any_value().prop_map(|v| ("stop_reason".to_string(), v)),
    ];
    proptest::collection::vec(member, 0..5).prop_map(J::Obj)
}

fn count() -> impl Strategy<Value = J> {
    prop_oneof![
        8 => (0u32..100_000).prop_map(|n| J::Raw(n.to_string())),
        1 => Just(J::Raw("4294967296".into())),
        1 => Just(J::Raw("-3".into())),
        1 => Just(J::Raw("5.0".into())),
        1 => Just(J::Raw("null".into())),
    ]
}

fn usage() -> impl Strategy<Value = J> {
    let member = prop_oneof![
        count().prop_map(|c| ("prompt_tokens".to_string(), c)),
        count().prop_map(|c| ("completion_tokens".to_string(), c)),
        count().prop_map(|c| ("total_tokens".to_string(), c)),
        any_value().prop_map(|v| ("prompt_tokens_details".to_string(), v)),
        prop_oneof![count(), Just(J::Raw("null".into()))].prop_map(|c| (
            "prompt_tokens_details".to_string(),
            J::Obj(vec![("cached_tokens".into(), c)])
        )),
    ];
    prop_oneof![
        4 => proptest::collection::vec(member, 0..5).prop_map(J::Obj),
        1 => Just(J::Raw("null".into())),
    ]
}

fn chunk() -> impl Strategy<Value = J> {
    let member = prop_oneof![
        3 => proptest::collection::vec(choice(), 0..3)
            .prop_map(|c| ("choices".to_string(), J::Arr(c))),
        2 => usage().prop_map(|u| ("usage".to_string(), u)),
        1 => prop_oneof![Just(J::Raw("null".into())), any_value()]
            .prop_map(|e| ("error".to_string(), e)),
        2 => text().prop_map(|t| ("id".to_string(), J::Str(t))),
        1 => Just(("object".to_string(), J::Str("chat.completion.chunk".into()))),
        1 => (object_key(), any_value()).prop_map(|(k, v)| (k, v)),
    ];
    proptest::collection::vec(member, 0..6).prop_map(J::Obj)
}

pub(crate) fn render(j: &J, ws: &[&'static str]) -> String {
    let mut out = String::new();
    let mut it = ws.iter().copied().cycle();
    j.render(&mut it, &mut out);
    out
}

pub(crate) fn whitespace() -> impl Strategy<Value = Vec<&'static str>> {
    proptest::collection::vec(
        prop_oneof![8 => Just(""), 1 => Just(" "), 1 => Just("\n  ")],
        1..8,
    )
}

/// ChunkInfo from a `serde_json::Value`, by what the fields mean.
fn oracle(v: &Value) -> ChunkInfo {
    let non_empty = |v: &Value| match v {
        Value::Null => false,
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        _ => true,
    };
    let mut info = ChunkInfo::default();
    if let Some(Value::Array(choices)) = v.get("choices") {
        for c in choices {
            info.n_choices += 1;
            // A chunk's delta, or a whole answer's message: any of `keys`
            // non-empty.
            let carries = |keys: &[&str]| {
                ["delta", "message"].iter().any(|d| {
                    c.get(*d)
                        .and_then(Value::as_object)
                        .is_some_and(|d| keys.iter().any(|k| d.get(*k).is_some_and(non_empty)))
                })
            };
            let delta_out = carries(&[
                "content",
                "reasoning_content",
                "reasoning",
                "tool_calls",
                "function_call",
            ]);
            let text_out = c.get("text").is_some_and(non_empty);
            info.has_output |= delta_out || text_out;
            info.tool_call |= carries(&["tool_calls", "function_call"]);
            if let Some(f) = c.get("finish_reason").filter(|f| !f.is_null()) {
                info.finish_reason = serde_json::from_value(f.clone()).ok();
            }
        }
    }
    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
        info.usage = serde_json::from_value(u.clone()).ok();
    }
    info.is_error = v.get("error").is_some_and(|e| !e.is_null());
    info
}

/// Whether `v` has the types the serde reader accepts (so the two agree).
fn well_typed(v: &Value) -> bool {
    let count_ok = |c: Option<&Value>| match c {
        None => true,
        Some(n) => n.as_u64().is_some_and(|n| n <= u64::from(u32::MAX)),
    };
    let choices_ok = match v.get("choices") {
        None | Some(Value::Null) => true,
        Some(Value::Array(cs)) => cs.iter().all(|c| {
            c.is_object()
                && match c.get("delta") {
                    None | Some(Value::Null) => true,
                    Some(d) => d.is_object(),
                }
                && matches!(
                    c.get("finish_reason"),
                    None | Some(Value::Null) | Some(Value::String(_))
                )
        }),
        _ => false,
    };
    let usage_ok = match v.get("usage") {
        None | Some(Value::Null) => true,
        Some(Value::Object(u)) => {
            let details_ok = match u.get("prompt_tokens_details") {
                None | Some(Value::Null) => true,
                Some(Value::Object(d)) => match d.get("cached_tokens") {
                    None | Some(Value::Null) => true,
                    c => count_ok(c),
                },
                _ => false,
            };
            count_ok(u.get("prompt_tokens")) && count_ok(u.get("completion_tokens")) && details_ok
        }
        _ => false,
    };
    v.is_object() && choices_ok && usage_ok
}

/// Whether some object repeats a key (serde refuses duplicate fields; a
/// `Value` keeps the last). Read from the generated structure: comparing
/// lengths of the text and its re-serialisation misses a duplicate whose
/// numbers happen to print longer (`2e3` -> `2000.0`).
fn has_duplicate_keys(j: &J) -> bool {
    match j {
        J::Raw(_) | J::Str(_) => false,
        J::Arr(items) => items.iter().any(has_duplicate_keys),
        J::Obj(members) => {
            let mut keys: Vec<&str> = members.iter().map(|(k, _)| k.as_str()).collect();
            keys.sort_unstable();
            keys.windows(2).any(|w| w[0] == w[1])
                || members.iter().any(|(_, v)| has_duplicate_keys(v))
        }
    }
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 512,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn the_scanner_never_disagrees_with_serde(j in chunk(), ws in whitespace()) {
        let json = render(&j, &ws);
        if let Some(fast) = scan(json.as_bytes()) {
            prop_assert_eq!(Some(fast), chunk_info_serde(json.as_bytes()), "{}", json);
        }
    }

    #[test]
    fn the_scanner_takes_the_fast_path_on_plain_chunks(j in chunk()) {
        // Compact JSON without duplicate keys is what engines send: the
        // scanner must answer it itself when serde accepts it. It declines
        // (by design) keys written with `\u` escapes and finish reasons that
        // need unescaping, which engines do not send.
        let json = render(&j, &[""]);
        let v: Value = serde_json::from_str(&json).unwrap();
        let dup = has_duplicate_keys(&j);
        let escaped_finish = v["choices"].as_array().is_some_and(|cs| {
            cs.iter().any(|c| c["finish_reason"].as_str().is_some_and(|f| f.contains(['"', '\\', '\n', '\t'])))
        });
        // serde reads a struct from an array too; engines send objects.
        let array_details = v["usage"]["prompt_tokens_details"].is_array();
        if !dup && !escaped_finish && !array_details && chunk_info_serde(json.as_bytes()).is_some() && !json.contains("\\u") {
            prop_assert!(scan(json.as_bytes()).is_some(), "{}", json);
        }
    }

    #[test]
    fn the_serde_reader_reads_fields_as_they_mean(j in chunk()) {
        let json = render(&j, &[""]);
        let v: Value = serde_json::from_str(&json).unwrap();
        let no_dups = !has_duplicate_keys(&j);
        if no_dups && well_typed(&v) {
            prop_assert_eq!(chunk_info_serde(json.as_bytes()), Some(oracle(&v)), "{}", json);
        }
    }

    #[test]
    fn mangled_chunks_never_fool_the_scanner(
        j in chunk(),
        edits in proptest::collection::vec((any::<usize>(), prop_oneof![
            Just(b'"'), Just(b'\\'), Just(b'}'), Just(b']'), Just(b','), Just(b':'),
            Just(b'0'), Just(b'n'), Just(b' '), Just(b'{'), Just(b'['), Just(0xff),
        ]), 1..4),
    ) {
        let mut b = render(&j, &[""]).into_bytes();
        if b.is_empty() {
            return Ok(());
        }
        for (at, byte) in edits {
            let i = at % b.len();
            b[i] = byte;
        }
        if let Some(fast) = scan(&b) {
            let slow = chunk_info_serde(&b);
            // The one documented difference (scan.rs): the scanner does not
            // check what strings contain, so bytes that are not UTF-8 pass
            // it (and are forwarded as sent) where serde refuses them.
            let unchecked = std::str::from_utf8(&b).is_err();
            if !(unchecked && slow.is_none()) {
                prop_assert_eq!(Some(fast), slow, "{}", String::from_utf8_lossy(&b));
            }
        }
    }
}
