//! A request's headers on the request path.
//!
//! [`Fields`] is a request head's header fields where they lie in its bytes,
//! as the gateway's own HTTP/1.1 server read them: no map, no copy. Building
//! an `http::HeaderMap` of them cost ~1,700 instructions of a non-streamed
//! request with three headers (callgrind: two allocations for the map, a
//! name parse, a hash and an insert per header, a reference count per value,
//! and their drops), more with the ten to fifteen headers an SDK sends, each
//! custom name (`x-stainless-*`) copied into an allocation of its own; and
//! the request path only asks for about ten names, mostly absent, and passes
//! the rest on to the replica. Hyper's server and the router still give the
//! request path a map, read through [`Fields::from_map`]. Both are read
//! through [`Lookup`]; the tests below hold [`Fields`] to `HeaderMap::get`.
//!
//! [`get`] is `HeaderMap::get` by a scan when the map is small. A client's
//! request carries a handful of headers, and the gateway asks for about ten
//! it mostly does not find (`x-session-id`, `traceparent`, `x-request-id`,
//! `x-sluice-priority`, ...). `HeaderMap::get` hashes the name before it
//! looks: ~140 instructions a lookup, ~1,300 per non-streamed request; the
//! scan brings that to ~640 (callgrind, `benches/e2e/instructions.sh`;
//! docs/benchmarks-log.md, "2026-11-26"). The scan compares the name with each entry's, a tag
//! compare for the standard names. A map with a repeated name, or more than
//! [`SCAN_UP_TO`] names, is left to `HeaderMap::get`. Checked against it by
//! the tests below.

use std::ops::Range;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue};

/// At or under this many distinct names, scan; above, hash.
const SCAN_UP_TO: usize = 12;

/// The first value of `name` in `headers`, as `headers.get(name)` gives it.
pub(crate) fn get<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Option<&'a HeaderValue> {
    // With one value per name, the i-th name's value is the i-th value.
    // (`keys` walks the entries as a slice; `iter` and `values` also follow
    // each entry's extra values, ~15 instructions an entry.)
    if headers.keys_len() > SCAN_UP_TO || headers.len() != headers.keys_len() {
        return headers.get(name);
    }
    let i = headers.keys().position(|n| n == name)?;
    headers.values().nth(i)
}

/// A request's headers, asked for a name's first value: [`Fields`] or a
/// `HeaderMap`, the same answers.
pub(crate) trait Lookup {
    /// The first value of `name` (any case in the head), as
    /// `HeaderMap::get` gives it.
    fn first(&self, name: &HeaderName) -> Option<&[u8]>;
}

impl Lookup for HeaderMap {
    fn first(&self, name: &HeaderName) -> Option<&[u8]> {
        get(self, name).map(HeaderValue::as_bytes)
    }
}

/// A value as text, as `HeaderValue::to_str` reads it: visible ASCII,
/// spaces and tabs only.
pub(crate) fn text(value: &[u8]) -> Option<&str> {
    let visible = value.iter().all(|&b| (32..127).contains(&b) || b == b'\t');
    // ASCII only, so always UTF-8.
    visible.then(|| std::str::from_utf8(value).ok()).flatten()
}

/// Where one header field's name and value lie in the head.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Field {
    name: [u32; 2],
    value: [u32; 2],
}

impl Field {
    /// A field whose name and value are these ranges of the head (heads are
    /// far under 4 GiB: the server refuses one over 408 KiB).
    pub(crate) fn new(name: Range<usize>, value: Range<usize>) -> Self {
        let at = |r: Range<usize>| [r.start as u32, r.end as u32];
        Self {
            name: at(name),
            value: at(value),
        }
    }

    /// The name's length: most names asked for are absent, and most
    /// fields are told apart by it without reading them.
    fn name_len(&self) -> usize {
        (self.name[1] - self.name[0]) as usize
    }
}

/// A request's header fields as they came, in order: the head's bytes and
/// where each name and value lies in them. Names keep the client's case;
/// lookups ignore it. Every name must be a valid header name and every value
/// a valid header value: the caller's guarantee (`httparse` checked them, or
/// they came from a map); [`Fields::new`] checks only that they lie in the
/// head, and [`Fields::to_map`] leaves out a field that breaks it.
#[derive(Clone, Default)]
pub(crate) struct Fields {
    head: Bytes,
    at: Vec<Field>,
}

impl std::fmt::Debug for Fields {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(
                self.iter()
                    .map(|(n, v)| (String::from_utf8_lossy(n), String::from_utf8_lossy(v))),
            )
            .finish()
    }
}

impl Fields {
    /// The fields `at` of `head`. Each range must lie in `head` (checked:
    /// a slip panics at once rather than reading another field).
    pub(crate) fn new(head: Bytes, at: Vec<Field>) -> Self {
        let len = head.len() as u32;
        assert!(
            at.iter().all(|f| f.name[0] <= f.name[1]
                && f.name[1] <= len
                && f.value[0] <= f.value[1]
                && f.value[1] <= len),
            "a header field outside its head"
        );
        Self { head, at }
    }

    /// The fields of a map, in its order (hyper's server and the router).
    pub(crate) fn from_map(map: &HeaderMap) -> Self {
        let mut head =
            BytesMut::with_capacity(map.iter().map(|(n, v)| n.as_str().len() + v.len()).sum());
        let mut at = Vec::with_capacity(map.len());
        for (name, value) in map {
            let n = head.len();
            head.put_slice(name.as_str().as_bytes());
            let v = head.len();
            head.put_slice(value.as_bytes());
            at.push(Field::new(n..v, v..head.len()));
        }
        Self {
            head: head.freeze(),
            at,
        }
    }

    /// A map of the fields (the router's requests).
    pub(crate) fn to_map(&self) -> HeaderMap {
        let mut map = HeaderMap::with_capacity(self.at.len());
        for f in &self.at {
            // Valid by construction; a field that were not would be left out.
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(self.slice(f.name)),
                HeaderValue::from_maybe_shared(
                    self.head.slice(f.value[0] as usize..f.value[1] as usize),
                ),
            ) {
                map.append(name, value);
            }
        }
        map
    }

    fn slice(&self, [from, to]: [u32; 2]) -> &[u8] {
        &self.head[from as usize..to as usize]
    }

    /// Each field's name (as it came) and value, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.at
            .iter()
            .map(|f| (self.slice(f.name), self.slice(f.value)))
    }

    /// How many fields.
    pub(crate) fn len(&self) -> usize {
        self.at.len()
    }

    /// Leave out every field named `name`.
    pub(crate) fn remove(&mut self, name: &HeaderName) {
        let name = name.as_str().as_bytes();
        let head = &self.head;
        self.at
            .retain(|f| !is_name(&head[f.name[0] as usize..f.name[1] as usize], name));
    }
}

impl Lookup for Fields {
    fn first(&self, name: &HeaderName) -> Option<&[u8]> {
        let name = name.as_str().as_bytes();
        let f = self.at.iter().find(|f| {
            f.name_len() == name.len() && self.slice(f.name).eq_ignore_ascii_case(name)
        })?;
        Some(self.slice(f.value))
    }
}

/// Whether a name as it came (any case) is `lower` (a `HeaderName`'s, lower
/// case): the lengths first, as most names asked for are absent.
pub(crate) fn is_name(raw: &[u8], lower: &[u8]) -> bool {
    raw.len() == lower.len() && raw.eq_ignore_ascii_case(lower)
}

/// A `Host` value RFC 9112 3.2 allows: `uri-host [ ":" port ]`, where the
/// host is a name of unreserved, percent-encoded and sub-delimiter
/// characters, or an IP literal in brackets; empty is allowed (a target
/// without authority). No path, query, user info or space.
pub(crate) fn valid_host(v: &[u8]) -> bool {
    let (host, port) = match v.strip_prefix(b"[") {
        Some(rest) => {
            let Some(end) = rest.iter().position(|b| *b == b']') else {
                return false;
            };
            let literal = &rest[..end];
            if literal.is_empty()
                || !literal
                    .iter()
                    .all(|b| b.is_ascii_hexdigit() || matches!(b, b':' | b'.' | b'v' | b'V'))
            {
                return false;
            }
            match &rest[end + 1..] {
                [] => (&b""[..], None),
                [b':', port @ ..] => (&b""[..], Some(port)),
                _ => return false,
            }
        }
        None => match v.iter().rposition(|b| *b == b':') {
            Some(i) => (&v[..i], Some(&v[i + 1..])),
            None => (v, None),
        },
    };
    let name = host.iter().all(|b| {
        b.is_ascii_alphanumeric()
            || matches!(
                b,
                b'-' | b'.'
                    | b'_'
                    | b'~'
                    | b'%'
                    | b'!'
                    | b'$'
                    | b'&'
                    | b'\''
                    | b'('
                    | b')'
                    | b'*'
                    | b'+'
                    | b','
                    | b';'
                    | b'='
            )
    });
    name && port.is_none_or(|p| p.iter().all(u8::is_ascii_digit))
}

/// What the `Transfer-Encoding` fields of a request say, read in order.
#[derive(Default)]
pub(crate) struct Codings {
    /// The last coding is `chunked`: it frames the body.
    pub(crate) last_chunked: bool,
    /// How often `chunked` appears.
    pub(crate) chunked: u32,
    /// Another coding appears (empty list elements are not codings).
    pub(crate) other: bool,
}

impl Codings {
    pub(crate) fn read(&mut self, raw: &[u8]) {
        for coding in raw.split(|b| *b == b',') {
            // A coding's parameters (`;q=...` is not one, but tolerated)
            // are not its name.
            let name = coding.split(|b| *b == b';').next().unwrap_or_default();
            let name = name.trim_ascii();
            if name.is_empty() {
                continue;
            }
            let chunked = name.eq_ignore_ascii_case(b"chunked");
            self.chunked += u32::from(chunked);
            self.other |= !chunked;
            self.last_chunked = chunked;
        }
    }
}

/// What RFC 9112 refuses that hyper's server takes, as the own server
/// refuses it (`server/h1/head.rs`): an HTTP/1.1 request without exactly one
/// `Host`, or with one that is not a host (section 3.2: 400), and a transfer
/// coding other than chunked, which hyper drops (section 6.1: 501).
pub(crate) fn rfc9112(version: http::Version, headers: &http::HeaderMap) -> Option<u16> {
    let mut hosts = headers.get_all(http::header::HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some()
        || (version == http::Version::HTTP_11 && host.is_none())
        || host.is_some_and(|h| !valid_host(h.as_bytes().trim_ascii()))
    {
        return Some(400);
    }
    let mut codings = Codings::default();
    for v in headers.get_all(http::header::TRANSFER_ENCODING) {
        codings.read(v.as_bytes());
    }
    if codings.chunked > 1 {
        return Some(400);
    }
    codings.other.then_some(501)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NAMES: &[&str] = &[
        "host",
        "content-type",
        "content-length",
        "authorization",
        "accept",
        "traceparent",
        "x-request-id",
        "x-session-id",
        "x-sluice-priority",
        "x-sluice-ttft-objective",
        "x-a",
        "x-b",
        "x-c",
        "x-d",
        "x-e",
        "x-f",
    ];

    proptest! {
        /// Any map of these names, asked for every name: mostly with a name
        /// repeated (left to `HeaderMap::get`), some with up to sixteen
        /// distinct ones.
        #[test]
        fn agrees_with_header_map_get(
            entries in proptest::collection::vec((0..NAMES.len(), 0u8..4), 0..40)
        ) {
            let mut map = HeaderMap::new();
            for (i, (n, v)) in entries.iter().enumerate() {
                let value = HeaderValue::from_str(&format!("{v}-{i}")).unwrap();
                map.append(HeaderName::from_static(NAMES[*n]), value);
            }
            for name in NAMES.iter().chain(&["x-absent", "accept-encoding"]) {
                let name = HeaderName::from_static(name);
                prop_assert_eq!(get(&map, &name), map.get(&name), "{}", name);
            }
        }
    }

    proptest! {
        /// Distinct names in any order: the scan up to twelve, the hash above.
        #[test]
        fn agrees_with_header_map_get_on_distinct_names(
            names in proptest::sample::subsequence(NAMES, 0..=NAMES.len()).prop_shuffle()
        ) {
            let mut map = HeaderMap::new();
            for (i, n) in names.iter().enumerate() {
                map.insert(HeaderName::from_static(n), HeaderValue::from(i));
            }
            for name in NAMES.iter().chain(&["x-absent", "accept-encoding"]) {
                let name = HeaderName::from_static(name);
                prop_assert_eq!(get(&map, &name), map.get(&name), "{}", name);
            }
        }
    }

    #[test]
    fn a_name_with_several_values_gives_its_first_either_way() {
        for extra in [0, SCAN_UP_TO + 1] {
            let mut map = HeaderMap::new();
            map.append("x-session-id", HeaderValue::from_static("first"));
            map.append("accept", HeaderValue::from_static("*/*"));
            map.append("x-session-id", HeaderValue::from_static("second"));
            for i in 0..extra {
                map.append(
                    HeaderName::from_bytes(format!("x-pad-{i}").as_bytes()).unwrap(),
                    HeaderValue::from_static("p"),
                );
            }
            let name = HeaderName::from_static("x-session-id");
            assert_eq!(get(&map, &name).unwrap(), "first");
            assert_eq!(get(&map, &name), map.get(&name));
        }
    }

    /// The fields of a head written out with its names in any case.
    fn written(map: &HeaderMap, upper: &[bool]) -> Fields {
        let mut head = Vec::new();
        let mut at = Vec::new();
        for (i, (name, value)) in map.iter().enumerate() {
            let n = head.len();
            let mut name = name.as_str().as_bytes().to_vec();
            if upper.get(i).copied().unwrap_or(false) {
                name.make_ascii_uppercase();
            }
            head.extend_from_slice(&name);
            head.extend_from_slice(b": ");
            let v = head.len();
            head.extend_from_slice(value.as_bytes());
            at.push(Field::new(n..n + name.len(), v..head.len()));
            head.extend_from_slice(b"\r\n");
        }
        Fields::new(Bytes::from(head), at)
    }

    proptest! {
        /// Fields, from a map or from a head with names in any case, give
        /// `HeaderMap::get`'s first value for every name, and make the same
        /// map again.
        #[test]
        fn fields_agree_with_header_map_get(
            entries in proptest::collection::vec((0..NAMES.len(), 0u8..4), 0..40),
            upper in proptest::collection::vec(any::<bool>(), 40),
        ) {
            let mut map = HeaderMap::new();
            for (i, (n, v)) in entries.iter().enumerate() {
                let value = HeaderValue::from_str(&format!("{v}-{i}")).unwrap();
                map.append(HeaderName::from_static(NAMES[*n]), value);
            }
            let ours = [Fields::from_map(&map), written(&map, &upper)];
            for fields in &ours {
                prop_assert_eq!(fields.len(), map.len());
                prop_assert_eq!(&fields.to_map(), &map);
                for name in NAMES.iter().chain(&["x-absent", "accept-encoding"]) {
                    let name = HeaderName::from_static(name);
                    prop_assert_eq!(fields.first(&name), map.get(&name).map(HeaderValue::as_bytes));
                }
            }
            // Removing a name leaves the others as they were.
            let mut fields = written(&map, &upper);
            let gone = HeaderName::from_static(NAMES[0]);
            fields.remove(&gone);
            map.remove(&gone);
            prop_assert_eq!(fields.to_map(), map);
        }

        /// `text` reads a value as `HeaderValue::to_str` does.
        #[test]
        fn text_agrees_with_to_str(value in proptest::collection::vec(any::<u8>(), 0..24)) {
            if let Ok(v) = HeaderValue::from_bytes(&value) {
                prop_assert_eq!(text(&value), v.to_str().ok());
            }
        }
    }

    #[test]
    #[should_panic(expected = "outside its head")]
    fn a_field_outside_its_head_is_refused() {
        Fields::new(Bytes::from_static(b"a: b"), vec![Field::new(0..1, 3..5)]);
    }
}
