use std::sync::Arc;

use super::*;
use crate::config::RefusalConfig;

fn detector() -> Arc<Refusal> {
    Refusal::from_config(&RefusalConfig {
        enabled: true,
        ..RefusalConfig::default()
    })
    .unwrap()
}

fn chat(delta: serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"choices": [{"index": 0, "delta": delta}]})).unwrap()
}

#[test]
fn streamed_tool_arguments_are_judged_whole() {
    let mut i = Inspector::new(Wire::OpenAi, None);
    // Call 0 arrives in three pieces and is valid; call 1 is cut short.
    for (idx, part) in [
        (0, "{\"city\":"),
        (1, "{\"q\": \"x"),
        (0, " \"Paris\""),
        (0, "}"),
    ] {
        let tc = serde_json::json!([{"index": idx, "function": {"arguments": part}}]);
        i.event(&chat(serde_json::json!({"tool_calls": tc})));
    }
    let v = i.finish();
    assert_eq!(
        (v.tool_calls, v.invalid_tool_calls, v.refusal),
        (2, 1, false)
    );
}

#[test]
fn messages_tool_input_replaces_the_start_and_responses_done_is_authoritative() {
    let mut m = Inspector::new(Wire::Anthropic, None);
    m.event(br#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"t","name":"f","input":{}}}"#);
    m.event(br#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"a\": [1,"}}"#);
    m.event(br#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":" 2]}"}}"#);
    m.event(br#"{"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"u","name":"g","input":{}}}"#);
    m.event(br#"{"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{\"a\": "}}"#);
    // A tool block whose input came whole in its start.
    m.event(br#"{"type":"content_block_start","index":3,"content_block":{"type":"tool_use","id":"w","name":"h","input":{"k":1}}}"#);
    assert_eq!(
        m.finish(),
        Verdict {
            tool_calls: 3,
            invalid_tool_calls: 1,
            refusal: false
        }
    );

    let mut r = Inspector::new(Wire::Responses, None);
    r.event(
        br#"{"type":"response.function_call_arguments.delta","output_index":0,"delta":"{\"x\""}"#,
    );
    r.event(br#"{"type":"response.function_call_arguments.done","output_index":0,"arguments":"{\"x\": 1}"}"#);
    r.event(
        br#"{"type":"response.function_call_arguments.delta","output_index":1,"delta":"not json"}"#,
    );
    assert_eq!(
        r.finish(),
        Verdict {
            tool_calls: 2,
            invalid_tool_calls: 1,
            refusal: false
        }
    );
}

#[test]
fn refusals_are_found_in_the_opening_only() {
    let mut i = Inspector::new(Wire::OpenAi, Some(detector()));
    for t in [
        "I\u{2019}m sorry, but ",
        "I CAN",
        "\u{2019}T help with that.",
    ] {
        assert!(i.listening());
        i.event(&chat(serde_json::json!({"content": t})));
    }
    assert!(i.finish().refusal);

    // The phrase past the first 200 characters does not count, and the
    // detector stops listening once it has them.
    let mut late = Inspector::new(Wire::OpenAi, Some(detector()));
    late.event(&chat(serde_json::json!({"content": "x".repeat(199)})));
    assert!(late.listening());
    late.event(&chat(serde_json::json!({"content": "y I cannot"})));
    assert!(!late.listening());
    assert!(!late.finish().refusal);

    let mut clean = Inspector::new(Wire::Anthropic, Some(detector()));
    clean.event(br#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Sure, here it is."}}"#);
    assert_eq!(clean.finish(), Verdict::default());
}

#[test]
fn whole_answers_of_each_protocol() {
    let chat = br#"{"choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}},{"id":"b","type":"function","function":{"name":"g","arguments":"{\"a\":"}}]},"finish_reason":"tool_calls"}]}"#;
    assert_eq!(
        whole(Wire::OpenAi, chat, None),
        Some(Verdict {
            tool_calls: 2,
            invalid_tool_calls: 1,
            refusal: false
        })
    );
    // A legacy `function_call` with a name is a call; an empty one is not
    // (the answer's scan reads it so, and then skips this check).
    let named =
        br#"{"choices":[{"index":0,"message":{"function_call":{"name":"f","arguments":"{"}}}]}"#;
    let empty = br#"{"choices":[{"index":0,"message":{"function_call":{}}}]}"#;
    assert_eq!(
        whole(Wire::OpenAi, named, None).map(|v| v.invalid_tool_calls),
        Some(1)
    );
    assert_eq!(
        whole(Wire::OpenAi, empty, None).map(|v| v.tool_calls),
        Some(0)
    );
    let plain = br#"{"choices":[{"index":0,"message":{"role":"assistant","content":"As an AI, I will not."}}]}"#;
    assert_eq!(whole(Wire::OpenAi, plain, None), None, "nothing to judge");
    assert!(
        whole(Wire::OpenAi, plain, Some(&detector()))
            .unwrap()
            .refusal
    );
    let messages = br#"{"content":[{"type":"text","text":"ok"},{"type":"tool_use","id":"t","name":"f","input":{"a":1}}]}"#;
    assert_eq!(
        whole(Wire::Anthropic, messages, None),
        Some(Verdict {
            tool_calls: 1,
            invalid_tool_calls: 0,
            refusal: false
        })
    );
    let responses =
        br#"{"output":[{"type":"function_call","call_id":"c","name":"f","arguments":"{oops"}]}"#;
    assert_eq!(
        whole(Wire::Responses, responses, None),
        Some(Verdict {
            tool_calls: 1,
            invalid_tool_calls: 1,
            refusal: false
        })
    );
}

#[test]
fn arguments_past_the_bound_are_not_held_or_judged() {
    let mut i = Inspector::new(Wire::OpenAi, None);
    let big = "[".repeat(MAX_ARGS / 2);
    for _ in 0..3 {
        let tc = serde_json::json!([{"index": 0, "function": {"arguments": big}}]);
        i.event(&chat(serde_json::json!({"tool_calls": tc})));
    }
    assert_eq!(i.calls[0].args.len(), 0);
    assert_eq!(
        i.finish(),
        Verdict {
            tool_calls: 1,
            invalid_tool_calls: 0,
            refusal: false
        }
    );
}

/// A tool call streamed as engines write it: a first event with the id and
/// name, then pieces of the arguments (escapes, unicode, spacing).
fn tool_stream(spacing: &str, pieces: &[&str], index: u32) -> Vec<Vec<u8>> {
    let mut out = vec![format!(
        r#"{{"id":"c","choices":[{{"index":0,"delta":{{"tool_calls":[{{"index":{index},"id":"call_1","type":"function","function":{{"name":"f","arguments":""}}}}]}},"finish_reason":null}}]}}"#
    )
    .into_bytes()];
    for p in pieces {
        let s = serde_json::to_string(p).unwrap();
        out.push(
            format!(
                r#"{{"id":"c","choices":[{{"index":0,"delta":{{"tool_calls":[{{"index":{index},"function":{{"arguments":{spacing}{s}}}}}]}},"finish_reason":null}}]}}"#
            )
            .into_bytes(),
        );
    }
    out
}

#[test]
fn argument_pieces_read_by_the_learned_shape_are_the_pieces() {
    let pieces: &[&str] = &[
        "{\"path\": \"C:\\\\tmp\\n\"",
        ", \"note\": \"caf\u{e9} \u{1f600}\"",
        ", \"q\": \"say \\\"hi\\\"\"",
        ", \"n\": [1, 2, 3]}",
    ];
    for spacing in ["", " "] {
        for index in [0, 3] {
            let mut i = Inspector::new(Wire::OpenAi, None);
            for ev in tool_stream(spacing, pieces, index) {
                i.event(&ev);
            }
            // The shape was learned (the later pieces took the fast path)...
            assert!(i.shape.is_some(), "{spacing:?} {index}");
            // ...and the arguments are exactly the pieces joined.
            assert_eq!(i.calls.len(), 1);
            assert_eq!(i.calls[0].args, pieces.concat());
            assert_eq!(i.calls[0].key, (0, u64::from(index)));
            assert_eq!(
                i.finish(),
                Verdict {
                    tool_calls: 1,
                    invalid_tool_calls: 0,
                    refusal: false
                }
            );
        }
    }
    // A piece that is not a JSON string where the shape expects one, and a
    // second call interleaved: both read in full, still exact.
    let mut i = Inspector::new(Wire::OpenAi, None);
    let mut evs = tool_stream("", &["{\"a\":", " 1}"], 0);
    evs.insert(2, tool_stream("", &["[tr", "ue]"], 1).remove(1));
    evs.push(br#"{"id":"c","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":null}}]},"finish_reason":null}]}"#.to_vec());
    evs.push(tool_stream("", &["ue]"], 1).remove(1));
    for ev in &evs {
        i.event(ev);
    }
    let args: Vec<(u64, &str)> = i.calls.iter().map(|c| (c.key.1, c.args.as_str())).collect();
    assert_eq!(args, vec![(0, "{\"a\": 1}"), (1, "[true]")]);
}

#[test]
fn text_pieces_read_by_the_learned_shape_are_the_text() {
    let detector = Refusal::from_config(&RefusalConfig {
        enabled: true,
        chars: 10_000,
        ..RefusalConfig::default()
    })
    .unwrap();
    let pieces = ["He said \"no\"", "\n\tcaf\u{e9} \u{1f600}", " \\ end", "’S"];
    let mut i = Inspector::new(Wire::OpenAi, Some(detector));
    for p in pieces {
        i.event(&chat(serde_json::json!({"content": p})));
    }
    assert!(i.shape.is_some());
    assert_eq!(i.opening, pieces.concat().to_lowercase().replace('’', "'"));
    // A completion's `text` pieces, the same way.
    let mut c = Inspector::new(Wire::OpenAi, Some(detector_of(10_000)));
    for p in pieces {
        let ev = serde_json::json!({"choices": [{"index": 0, "text": p, "finish_reason": null}]});
        c.event(&serde_json::to_vec(&ev).unwrap());
    }
    assert!(c.shape.is_some());
    assert_eq!(c.opening, pieces.concat().to_lowercase().replace('’', "'"));
}

fn detector_of(chars: usize) -> Arc<Refusal> {
    Refusal::from_config(&RefusalConfig {
        enabled: true,
        chars,
        ..RefusalConfig::default()
    })
    .unwrap()
}

/// The one-pass search says what a search per name says.
#[test]
fn a_call_is_noticed_as_a_search_per_name_notices_it() {
    let names: [&[u8]; 3] = [b"\"tool_calls\"", b"\"function_call\"", b"\"tool_use\""];
    let per_name = |b: &[u8]| names.iter().any(|n| memchr::memmem::find(b, n).is_some());
    let cases: [&[u8]; 10] = [
        br#"{"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}]}"#,
        br#"{"choices":[{"message":{"tool_calls":[]}}]}"#,
        br#"{"content":[{"type":"tool_use","id":"x"}]}"#,
        br#"{"message":{"function_call":{"name":"f"}}}"#,
        br#"{"finish_reason":"tool_calls"}"#,
        br#"{"a":"tool_calls","b":"\"tool_x\" \"tool_"}"#,
        br#""tool_"#,
        br#""tool_use"#,
        br#""tool_usetool_calls""#,
        br#"{"x":"\"tool_\"tool_use\""}"#,
    ];
    for c in cases {
        assert_eq!(
            mentions_a_call(c),
            per_name(c),
            "{}",
            String::from_utf8_lossy(c)
        );
    }
    // Every cut of a mention, and the mention alone.
    for n in names {
        for end in 0..=n.len() {
            assert_eq!(mentions_a_call(&n[..end]), per_name(&n[..end]));
        }
    }
}
