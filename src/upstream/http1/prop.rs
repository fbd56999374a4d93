//! Property tests of the body decoder (stable proptest; the committed corpus
//! in `tests/corpus/http1/` is replayed first, cut at every read boundary).
//! Properties: any body framed chunked or by length, read in any pieces,
//! decodes to exactly itself, ends in `Done` and leaves the bytes after it
//! alone; arbitrary bytes never panic and never produce more than was read;
//! the shortcuts for engines' plain framing answer as the line reader does.

use proptest::prelude::*;

use super::*;

/// Decode `pieces` read one after another; the body and whatever followed.
fn decode_in_pieces(start: BodyState, pieces: &[&[u8]]) -> (Result<Vec<u8>, String>, Wire) {
    decode_in_pieces_as::<true>(start, pieces)
}

/// The same, with (`PLAIN`) or without the decoder's shortcuts.
fn decode_in_pieces_as<const PLAIN: bool>(
    start: BodyState,
    pieces: &[&[u8]],
) -> (Result<Vec<u8>, String>, Wire) {
    let mut w = Wire {
        rbuf: BytesMut::new(),
        body: start,
        strict: false,
    };
    let mut out = Vec::new();
    for p in pieces {
        w.rbuf.extend_from_slice(p);
        loop {
            match w.decode_as::<PLAIN>() {
                Ok(Some(b)) => out.extend_from_slice(&b),
                Ok(None) => break,
                Err(e) => return (Err(e), w),
            }
        }
    }
    (Ok(out), w)
}

/// `wire` cut at the given points (sorted, deduplicated, in range).
fn cut(wire: &[u8], mut at: Vec<usize>) -> Vec<&[u8]> {
    at.retain(|&i| i < wire.len());
    at.sort_unstable();
    at.dedup();
    let mut out = Vec::new();
    let mut from = 0;
    for i in at {
        out.push(&wire[from..i]);
        from = i;
    }
    out.push(&wire[from..]);
    out
}

/// A chunked encoding of `body` in chunks of the given sizes, with optional
/// extensions, upper-case hex and trailers.
fn chunked(body: &[u8], sizes: &[usize], ext: bool, upper: bool, trailers: bool) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = body;
    let mut sizes = sizes.iter().cycle();
    while !rest.is_empty() {
        let n = (*sizes.next().unwrap_or(&1)).clamp(1, rest.len());
        let hex = if upper {
            format!("{n:X}")
        } else {
            format!("{n:x}")
        };
        out.extend_from_slice(hex.as_bytes());
        if ext {
            out.extend_from_slice(b";name=value");
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(&rest[..n]);
        out.extend_from_slice(b"\r\n");
        rest = &rest[n..];
    }
    out.extend_from_slice(b"0\r\n");
    if trailers {
        out.extend_from_slice(b"x-checksum: 1\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

const NEXT: &[u8] = b"HTTP/1.1 200 OK\r\n";

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn chunked_bodies_decode_to_themselves_however_read(
        body in proptest::collection::vec(any::<u8>(), 0..3000),
        sizes in proptest::collection::vec(1usize..600, 1..8),
        ext in any::<bool>(), upper in any::<bool>(), trailers in any::<bool>(),
        cuts in proptest::collection::vec(0usize..4000, 0..12),
    ) {
        let mut wire = chunked(&body, &sizes, ext, upper, trailers);
        wire.extend_from_slice(NEXT);
        let (got, w) = decode_in_pieces(BodyState::Chunked(Chunk::Size), &cut(&wire, cuts));
        prop_assert_eq!(got, Ok(body));
        prop_assert_eq!(w.body, BodyState::Done);
        prop_assert_eq!(&w.rbuf[..], NEXT, "the next response is left alone");
    }

    #[test]
    fn sized_bodies_decode_to_themselves_however_read(
        body in proptest::collection::vec(any::<u8>(), 0..3000),
        cuts in proptest::collection::vec(0usize..4000, 0..12),
    ) {
        let mut wire = body.clone();
        wire.extend_from_slice(NEXT);
        let start = BodyState::Length(body.len() as u64);
        let (got, w) = decode_in_pieces(start, &cut(&wire, cuts));
        prop_assert_eq!(got, Ok(body));
        prop_assert_eq!(w.body, BodyState::Done);
        prop_assert_eq!(&w.rbuf[..], NEXT);
    }

    /// The shortcuts for plain chunk-size lines and chunk ends answer as the
    /// line reader does, on engines' framing with bytes changed anywhere
    /// (extensions, bare LFs, long zero runs, garbage) and however it is read.
    #[test]
    fn shortcuts_answer_as_the_line_reader(
        body in proptest::collection::vec(any::<u8>(), 0..600),
        sizes in proptest::collection::vec(1usize..200, 1..6),
        ext in any::<bool>(), upper in any::<bool>(), trailers in any::<bool>(),
        changes in proptest::collection::vec(
            (0usize..2000, proptest::sample::select(b"\r\n0aF;; g\x00".to_vec())), 0..4),
        cuts in proptest::collection::vec(0usize..2000, 0..8),
    ) {
        let mut wire = chunked(&body, &sizes, ext, upper, trailers);
        wire.extend_from_slice(NEXT);
        for (at, byte) in changes {
            let len = wire.len();
            wire[at % len] = byte;
        }
        let pieces = cut(&wire, cuts);
        let start = BodyState::Chunked(Chunk::Size);
        let (plain, pw) = decode_in_pieces_as::<true>(start, &pieces);
        let (lines, lw) = decode_in_pieces_as::<false>(start, &pieces);
        prop_assert_eq!(plain, lines);
        prop_assert_eq!(pw.body, lw.body);
        prop_assert_eq!(&pw.rbuf[..], &lw.rbuf[..]);
    }

    #[test]
    fn arbitrary_bytes_never_panic_nor_grow(
        wire in proptest::collection::vec(any::<u8>(), 0..2000),
        cuts in proptest::collection::vec(0usize..2000, 0..8),
        chunked in any::<bool>(),
    ) {
        let start = if chunked { BodyState::Chunked(Chunk::Size) } else { BodyState::Length(1000) };
        if let (Ok(out), _) = decode_in_pieces(start, &cut(&wire, cuts)) {
            prop_assert!(out.len() <= wire.len());
        }
        let _ = parse_head(&wire);
    }

    #[test]
    fn response_heads_parse_or_fail_cleanly(
        status in 100u16..600,
        headers in proptest::collection::vec(("[a-z][a-z-]{0,20}", "[ -~]{0,40}"), 0..12),
        rest in proptest::collection::vec(any::<u8>(), 0..50),
    ) {
        let mut wire = format!("HTTP/1.1 {status} X\r\n").into_bytes();
        for (n, v) in &headers {
            wire.extend_from_slice(format!("{n}: {}\r\n", v.trim()).as_bytes());
        }
        wire.extend_from_slice(b"\r\n");
        let head_len = wire.len();
        wire.extend_from_slice(&rest);
        match parse_head(&wire) {
            Ok(Some((resp, n))) => {
                prop_assert_eq!(n, head_len);
                prop_assert_eq!(resp.status().as_u16(), status);
                // Framing is decided or refused, never a panic.
                let _ = body_kind(&resp, false);
            }
            Ok(None) => prop_assert!(false, "a complete head is not incomplete"),
            Err(_) => {}
        }
    }
}

/// The committed corpus: each file decodes the same read whole or in two
/// pieces cut anywhere (files named `valid-*` decode without error).
#[test]
fn the_corpus_decodes_the_same_however_it_is_cut() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/http1");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let wire = std::fs::read(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let start = BodyState::Chunked(Chunk::Size);
        let (whole, _) = decode_in_pieces(start, &[&wire]);
        if name.starts_with("valid-") {
            assert!(whole.is_ok(), "{name}: {whole:?}");
        }
        for i in 0..=wire.len() {
            let (got, _) = decode_in_pieces(start, &[&wire[..i], &wire[i..]]);
            assert_eq!(got.is_ok(), whole.is_ok(), "{name} cut at {i}");
            if let (Ok(a), Ok(b)) = (&got, &whole) {
                assert_eq!(a, b, "{name} cut at {i}");
            }
        }
        n += 1;
    }
    assert!(n >= 5, "the corpus is in {}", dir.display());
}
