//! The learned shape against the full reader: on every event it takes, the
//! answer must be the one `classify` gives (differential, on the committed
//! corpora, their single-byte mutations and generated strings), and it must
//! take the tokens engines send (or it saves nothing).

use bytes::Bytes;
use proptest::prelude::*;

use super::*;
use crate::stream::event::classify;
use crate::stream::sse::SseSplitter;

/// Every event of the committed SSE fixtures and every chunk of the chunk
/// corpus as a one-line event (with `\n\n` and with `\r\n\r\n` endings).
fn corpus() -> Vec<Vec<u8>> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/corpus");
    let mut events = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(format!("{dir}/sse"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for f in files {
        let mut s = SseSplitter::new(1 << 20);
        s.push(Bytes::from(std::fs::read(f).unwrap()));
        while let Ok(Some(ev)) = s.next_event() {
            events.push(ev.to_vec());
        }
    }
    let chunks = std::fs::read_to_string(format!("{dir}/chunks/engines.jsonl")).unwrap();
    for line in chunks.lines() {
        events.push(format!("data: {line}\n\n").into_bytes());
        events.push(format!("data: {line}\r\n\r\n").into_bytes());
    }
    events
}

/// A shape learned from `template`, if it teaches one.
fn learned(template: &[u8]) -> Option<Shape> {
    let mut s = Shape::default();
    s.classify(template);
    (!s.frame.is_empty()).then_some(s)
}

/// The shape's answer, when it has one, is the full reader's.
fn agrees(shape: &Shape, event: &[u8]) -> Result<(), TestCaseError> {
    if let Some(info) = shape.fits(event) {
        prop_assert_eq!(
            Event::Chunk(info),
            classify(event),
            "{}",
            String::from_utf8_lossy(event)
        );
    }
    Ok(())
}

#[test]
fn the_shape_agrees_with_the_full_reader_on_the_corpora_and_their_mutations() {
    let events = corpus();
    let shapes: Vec<Shape> = events.iter().filter_map(|t| learned(t)).collect();
    assert!(
        shapes.len() >= 10,
        "the corpora teach {} shapes",
        shapes.len()
    );
    let mut taken = 0;
    for shape in &shapes {
        for ev in &events {
            taken += usize::from(shape.fits(ev).is_some());
            agrees(shape, ev).unwrap();
            for i in 0..ev.len() {
                for sub in [b'"', b'\\', b'}', b']', b',', b'\n', b'u', b' '] {
                    let mut m = ev.clone();
                    m[i] = sub;
                    agrees(shape, &m).unwrap();
                }
            }
        }
    }
    // Each shape takes at least the event it was learned from.
    assert!(taken >= shapes.len());
}

#[test]
fn only_plain_one_line_tokens_are_learned() {
    for not_a_template in [
        // The role-only first delta: no output.
        &b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n"[..],
        // A finish reason, usage, two choices, an error.
        b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"},\"finish_reason\":\"stop\"}]}\n\n",
        b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":{\"prompt_tokens\":1}}\n\n",
        b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}},{\"delta\":{\"content\":\"b\"}}]}\n\n",
        // Tool calls: output, but not a string.
        b"data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0}]}}]}\n\n",
        // Not the one-line shape.
        b"event: x\ndata: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
        b"data:{\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
        b"data: {\"choices\":\ndata: [{\"delta\":{\"content\":\"a\"}}]}\n\n",
    ] {
        assert!(
            learned(not_a_template).is_none(),
            "{}",
            String::from_utf8_lossy(not_a_template)
        );
    }
}

/// Token events of the shapes engines send, around `{}`.
const TEMPLATES: &[&str] = &[
    // vLLM, a tool call's argument pieces
    "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":{}}}]},\"logprobs\":null,\"finish_reason\":null}]}\n\n",
    // vLLM
    "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":{}},\"logprobs\":null,\"finish_reason\":null}]}\n\n",
    // SGLang (usage: null on every chunk)
    "data: {\"id\":\"9\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":null,\"content\":{},\"reasoning_content\":null,\"tool_calls\":null},\"logprobs\":null,\"finish_reason\":null,\"matched_stop\":null}],\"usage\":null}\n\n",
    // llama.cpp (choices first, CRLF)
    "data: {\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"content\":{}}}],\"created\":1,\"id\":\"chatcmpl-x\",\"model\":\"g\",\"system_fingerprint\":\"b1\",\"object\":\"chat.completion.chunk\"}\r\n\r\n",
    // reasoning, and /v1/completions
    "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"reasoning_content\":{}},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":{},\"logprobs\":null,\"finish_reason\":null}]}\n\n",
];

fn event(template: &str, string: &[u8]) -> Vec<u8> {
    let (head, tail) = template.split_once("{}").unwrap();
    [head.as_bytes(), string, tail.as_bytes()].concat()
}

/// Bytes of a would-be JSON string: mostly text, often the characters that
/// matter to a string's end (quotes, backslashes, escapes, line breaks).
fn raw_string() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![
        6 => proptest::char::range('a', 'z').prop_map(|c| c as u8),
        2 => Just(b'"'),
        2 => Just(b'\\'),
        1 => Just(b'u'),
        1 => Just(b'0'),
        1 => Just(b'n'),
        1 => Just(b'\n'),
        1 => Just(b'\r'),
        1 => Just(b'}'),
        1 => any::<u8>(),
    ];
    proptest::collection::vec(byte, 0..24)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn any_string_the_shape_takes_reads_the_same_in_full(
        t in 0..TEMPLATES.len(),
        learn_from in "[a-z ]{1,8}",
        raw in raw_string(),
        quoted in any::<bool>(),
    ) {
        let template = TEMPLATES[t];
        let shape = learned(&event(template, serde_json::to_string(&learn_from).unwrap().as_bytes()));
        let shape = shape.expect("engine shapes are learned");
        let string = if quoted { [&b"\""[..], &raw, b"\""].concat() } else { raw };
        agrees(&shape, &event(template, &string))?;
    }

    #[test]
    fn every_token_an_engine_writes_takes_the_shape(
        t in 0..TEMPLATES.len(),
        first in "\\PC{1,8}",
        token in "\\PC{1,16}",
    ) {
        // serde_json writes strings as engines do (escapes, raw UTF-8).
        let template = TEMPLATES[t];
        let shape = learned(&event(template, serde_json::to_string(&first).unwrap().as_bytes())).unwrap();
        let ev = event(template, serde_json::to_string(&token).unwrap().as_bytes());
        prop_assert!(shape.fits(&ev).is_some(), "{}", String::from_utf8_lossy(&ev));
        agrees(&shape, &ev)?;
    }
}
