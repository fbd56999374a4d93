//! The fast body reader against serde, on generated request bodies (stable
//! proptest): the fields the gateway reads with every type JSON allows,
//! nulls, duplicates, escapes, raw control characters, unknown keys with
//! any value, odd whitespace. The fast reader may decline, never disagree;
//! and on a plain chat body it must not decline.

use proptest::prelude::*;

use super::*;
use crate::stream::scan::prop::{J, any_value, object_key, render, text, whitespace};

fn raw(s: &str) -> J {
    J::Raw(s.to_string())
}

/// A string as JSON writes it, or one JSON forbids (a raw tab or control
/// character), or one with a `\u` escape.
fn string() -> impl Strategy<Value = J> {
    prop_oneof![
        6 => text().prop_map(J::Str),
        1 => Just(raw("\"a\tb\"")),
        1 => Just(raw("\"a\u{1}b\"")),
        1 => Just(raw("\"caf\\u00e9\"")),
    ]
}

/// What a field might hold: its own type mostly, anything sometimes.
fn value_for(key: &'static str) -> BoxedStrategy<J> {
    let count = prop_oneof![
        6 => (0u64..100_000).prop_map(|n| J::Raw(n.to_string())),
        1 => Just(raw("4294967296")),
        1 => Just(raw("-1")),
        1 => Just(raw("2.0")),
        1 => Just(raw("1e2")),
    ];
    let boolean = prop_oneof![Just(raw("true")), Just(raw("false"))];
    let typed: BoxedStrategy<J> = match key {
        "stream" => boolean.boxed(),
        "max_tokens" | "max_completion_tokens" | "max_output_tokens" => count.boxed(),
        "stream_options" => proptest::collection::vec(
            prop_oneof![
                3 => prop_oneof![Just(raw("true")), Just(raw("false")), Just(raw("null"))]
                    .prop_map(|v| ("include_usage".to_string(), v)),
                1 => (object_key(), any_value()),
            ],
            0..3,
        )
        .prop_map(J::Obj)
        .boxed(),
        "messages" => proptest::collection::vec(message(), 0..4)
            .prop_map(J::Arr)
            .boxed(),
        "prompt" | "input" => prop_oneof![
            3 => string(),
            1 => proptest::collection::vec(string(), 0..3).prop_map(J::Arr),
        ]
        .boxed(),
        "metadata" => proptest::collection::vec(
            prop_oneof![
                string().prop_map(|v| ("user_id".to_string(), v)),
                (object_key(), any_value()),
            ],
            0..2,
        )
        .prop_map(J::Obj)
        .boxed(),
        _ => string().boxed(),
    };
    prop_oneof![8 => typed, 1 => Just(raw("null")), 1 => any_value()].boxed()
}

fn message() -> impl Strategy<Value = J> {
    let role = prop_oneof![
        Just("system"),
        Just("user"),
        Just("assistant"),
        Just("tool")
    ]
    .prop_map(|r| J::Str(r.to_string()));
    let member = prop_oneof![
        3 => prop_oneof![4 => role, 1 => string(), 1 => Just(raw("null")), 1 => any_value()]
            .prop_map(|v| ("role".to_string(), v)),
        3 => prop_oneof![4 => string(), 1 => Just(raw("null")), 1 => any_value()]
            .prop_map(|v| ("content".to_string(), v)),
        1 => (object_key(), any_value()),
    ];
    prop_oneof![
        8 => proptest::collection::vec(member, 0..4).prop_map(J::Obj),
        1 => any_value(),
    ]
}

const FIELDS: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "messages",
    "prompt",
    "input",
    "system",
    "cache_salt",
    "prompt_cache_key",
    "user",
    "previous_response_id",
    "instructions",
    "metadata",
];

fn body() -> impl Strategy<Value = J> {
    let member = prop_oneof![
        4 => proptest::sample::select(FIELDS).prop_flat_map(|k| value_for(k).prop_map(move |v| (k.to_string(), v))),
        1 => (object_key(), any_value()),
    ];
    proptest::collection::vec(member, 0..7).prop_map(J::Obj)
}

/// A plain chat body: string fields, string contents (with the escapes
/// prompts have: newlines, tabs, quotes, backslashes).
fn plain_chat() -> impl Strategy<Value = J> {
    let word = "[a-z \n\t\"\\\\/]{0,24}";
    let msg = (
        prop_oneof![Just("system"), Just("user"), Just("assistant")],
        word,
    )
        .prop_map(|(r, c)| {
            J::Obj(vec![
                ("role".into(), J::Str(r.into())),
                ("content".into(), J::Str(c)),
            ])
        });
    (
        "[a-z0-9-]{1,12}",
        proptest::collection::vec(msg, 0..5),
        0u32..100_000,
        any::<bool>(),
    )
        .prop_map(|(model, msgs, max, stream)| {
            J::Obj(vec![
                ("model".into(), J::Str(model)),
                ("messages".into(), J::Arr(msgs)),
                ("max_tokens".into(), J::Raw(max.to_string())),
                ("stream".into(), J::Raw(stream.to_string())),
                ("temperature".into(), J::Raw("0.7".into())),
            ])
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn never_disagrees_with_serde(j in body(), ws in whitespace()) {
        let s = render(&j, &ws);
        if let Some(fast) = read(s.as_bytes()) {
            let slow: Option<Lite<'_>> = serde_json::from_str(&s).ok();
            prop_assert_eq!(Some(fast), slow, "{}", s);
        }
    }

    #[test]
    fn takes_every_plain_chat_body(j in plain_chat(), ws in whitespace()) {
        let s = render(&j, &ws);
        let fast = read(s.as_bytes());
        prop_assert!(fast.is_some(), "{}", s);
        prop_assert_eq!(fast, serde_json::from_str::<Lite<'_>>(&s).ok(), "{}", s);
    }
}
