//! The SSE splitter on generated streams (stable proptest) and on the
//! committed corpus of recorded streams (`tests/corpus/sse/`): however the
//! bytes are cut into reads, the events come out exactly as they went in,
//! byte for byte, terminators included.

use proptest::prelude::*;

use super::*;

/// One event: its lines (none empty, no line breaks inside) with `\n` or
/// `\r\n` endings, then the blank line.
fn event() -> impl Strategy<Value = Vec<u8>> {
    let line = prop_oneof![
        "data: [ -~]{0,40}",
        Just("data: [DONE]".to_string()),
        Just("data: {\"choices\":[{\"delta\":{\"content\":\"\\n\\n\"}}]}".to_string()),
        ": [ -~]{0,10}",
        "event: [a-z_.]{1,20}",
        Just("id: 7".to_string()),
        Just("retry: 1000".to_string()),
        Just("data:".to_string()),
    ];
    (
        proptest::collection::vec(line, 1..4),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(lines, crlf, blank_crlf)| {
            let end: &[u8] = if crlf { b"\r\n" } else { b"\n" };
            let mut out = Vec::new();
            for l in lines {
                out.extend_from_slice(l.as_bytes());
                out.extend_from_slice(end);
            }
            out.extend_from_slice(if blank_crlf { b"\r\n" } else { b"\n" });
            out
        })
}

/// Every complete event, reading `stream` in pieces cut at `cuts`.
fn split_in_pieces(stream: &[u8], mut cuts: Vec<usize>) -> (Vec<Vec<u8>>, usize) {
    cuts.retain(|&c| c < stream.len());
    cuts.sort_unstable();
    cuts.dedup();
    let mut s = SseSplitter::new(1 << 20);
    let mut out = Vec::new();
    let mut from = 0;
    for end in cuts.into_iter().chain([stream.len()]) {
        s.push(Bytes::copy_from_slice(&stream[from..end]));
        from = end;
        while let Ok(Some(ev)) = s.next_event() {
            out.push(ev.to_vec());
        }
    }
    (out, s.pending_len())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn events_come_out_as_they_went_in_however_cut(
        events in proptest::collection::vec(event(), 1..12),
        cuts in proptest::collection::vec(0usize..2000, 0..16),
        tail in "[a-z: ]{0,10}",
    ) {
        let mut stream: Vec<u8> = events.concat();
        // An unfinished event at the end stays pending.
        stream.extend_from_slice(tail.as_bytes());
        let (got, pending) = split_in_pieces(&stream, cuts);
        prop_assert_eq!(got, events);
        prop_assert_eq!(pending, tail.len());
    }

    #[test]
    fn an_event_is_measured_as_the_splitter_cuts_it(ev in event(), more in event()) {
        prop_assert_eq!(event_len(&ev), Some(ev.len()));
        let two = [ev.clone(), more].concat();
        prop_assert_eq!(event_len(&two), Some(ev.len()));
        prop_assert_eq!(event_len(&ev[..ev.len() - 1]), None);
    }

    #[test]
    fn an_event_over_the_limit_is_refused_never_split(
        size in 65usize..400,
        cuts in proptest::collection::vec(0usize..400, 0..6),
    ) {
        let big = format!("data: {}\n\n", "x".repeat(size));
        let mut s = SseSplitter::new(64);
        let mut refused = false;
        let mut from = 0;
        let mut cuts = cuts;
        cuts.retain(|&c| c < big.len());
        cuts.sort_unstable();
        cuts.dedup();
        for end in cuts.into_iter().chain([big.len()]) {
            s.push(Bytes::copy_from_slice(&big.as_bytes()[from..end]));
            from = end;
            match s.next_event() {
                Err(EventTooLarge) => { refused = true; break; }
                Ok(Some(ev)) => {
                    // Only possible when the whole event arrived in one read
                    // (no carry-over, nothing buffered): passed as a slice.
                    prop_assert_eq!(&ev[..], big.as_bytes());
                    refused = true;
                    break;
                }
                Ok(None) => {}
            }
        }
        prop_assert!(refused);
    }
}

/// Recorded streams split the same at every single cut point as whole.
#[test]
fn the_corpus_splits_the_same_at_every_cut() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/sse");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let stream = std::fs::read(&path).unwrap();
        let (whole, pending) = split_in_pieces(&stream, vec![]);
        assert!(!whole.is_empty(), "{}", path.display());
        assert_eq!(whole.concat().len() + pending, stream.len());
        for i in 0..stream.len() {
            assert_eq!(
                split_in_pieces(&stream, vec![i]).0,
                whole,
                "{} at {i}",
                path.display()
            );
        }
        n += 1;
    }
    assert!(n >= 3, "the corpus is in {}", dir.display());
}
