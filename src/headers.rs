//! Header lookups on the request path.
//!
//! [`get`] is `HeaderMap::get` by a scan when the map is small. A client's
//! request carries a handful of headers, and the gateway asks for about ten
//! it mostly does not find (`x-session-id`, `traceparent`, `x-request-id`,
//! `x-sluice-priority`, ...). `HeaderMap::get` hashes the name before it
//! looks: ~140 instructions a lookup, ~1,300 per non-streamed request; the
//! scan brings that to ~640 (callgrind, `benches/e2e/instructions.sh`;
//! docs/BENCHMARKS.md, "2026-11-26"). The scan compares the name with each entry's, a tag
//! compare for the standard names. A map with a repeated name, or more than
//! [`SCAN_UP_TO`] names, is left to `HeaderMap::get`. Checked against it by
//! the tests below.

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
}
