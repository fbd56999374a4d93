//! W3C Trace Context: the request's trace id taken from the client's
//! `traceparent` (or made up), and the `traceparent` sent to the replica.
//!
//! The gateway's own spans get their ids here, at arrival, so that the id it
//! hands the replica as parent is the id of the span it may export later
//! (tail sampling decides only when the request ends).

use http::HeaderName;

/// Parsed once: a lookup by `&str` parses the name on every request.
pub(crate) static TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceCtx {
    pub trace_id: u128,
    /// The gateway's server span (the whole request).
    pub span_id: u64,
    /// The client span of the call to the replica (parent of the replica's spans).
    pub upstream_span_id: u64,
    /// The client's span, when it sent a `traceparent`.
    pub parent_span_id: Option<u64>,
    /// The client's sampled flag (sent on to the replica).
    pub sampled: bool,
}

fn nonzero_u64() -> u64 {
    loop {
        let v = fastrand::u64(..);
        if v != 0 {
            return v;
        }
    }
}

impl TraceCtx {
    /// From the client's `traceparent` if valid, else a new trace.
    pub fn from_headers(h: &http::HeaderMap) -> Self {
        Self::from_fields(h)
    }

    /// [`TraceCtx::from_headers`] of any request's headers.
    pub(crate) fn from_fields(h: &impl crate::headers::Lookup) -> Self {
        let parsed = h
            .first(&TRACEPARENT)
            .and_then(crate::headers::text)
            .and_then(parse_traceparent);
        match parsed {
            Some((trace_id, parent, flags)) => Self {
                trace_id,
                span_id: nonzero_u64(),
                upstream_span_id: nonzero_u64(),
                parent_span_id: Some(parent),
                sampled: flags & 1 == 1,
            },
            None => Self {
                trace_id: loop {
                    let v = fastrand::u128(..);
                    if v != 0 {
                        break v;
                    }
                },
                span_id: nonzero_u64(),
                upstream_span_id: nonzero_u64(),
                parent_span_id: None,
                sampled: false,
            },
        }
    }

    /// `traceparent`'s value for the replica: this trace, the upstream span
    /// as parent. The sampled flag is the client's: the gateway decides to
    /// keep a trace only at the end, which a replica cannot wait for. Bytes,
    /// for a request written straight to the wire (a `HeaderValue` copies).
    pub(crate) fn upstream_value(&self) -> [u8; 55] {
        self.value_for(self.upstream_span_id)
    }

    /// The client span of a disaggregated request's prefill leg (the
    /// upstream span is its decode leg): derived from the upstream span's
    /// id, so no second random draw is paid on every request.
    pub fn prefill_span_id(&self) -> u64 {
        match self.upstream_span_id.rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15 {
            0 => 1,
            id if id == self.upstream_span_id || id == self.span_id => id ^ 1,
            id => id,
        }
    }

    /// `traceparent`'s value for the prefill replica: the prefill span.
    pub(crate) fn prefill_value(&self) -> [u8; 55] {
        self.value_for(self.prefill_span_id())
    }

    fn value_for(&self, span: u64) -> [u8; 55] {
        // Hex digits written in place: `format!` cost ~2,500 instructions a
        // request here (callgrind); the test below checks the bytes against `format!`
        let mut v = *b"00-00000000000000000000000000000000-0000000000000000-00";
        v[3..35].copy_from_slice(&hex32(self.trace_id));
        v[36..52].copy_from_slice(&hex16(span));
        v[54] = if self.sampled { b'1' } else { b'0' };
        v
    }

    pub(crate) fn trace_id_hex(&self) -> String {
        // Digits only: the bytes are ASCII.
        String::from_utf8_lossy(&hex32(self.trace_id)).into_owned()
    }
}

/// The 16 lower-case hex digits of `n`, most significant first: its nibbles
/// spread to a byte each, then made digits, eight at a time. The `hex`
/// crate's table took ~7 instructions a byte (~340 a request for the request
/// id and `traceparent`, callgrind, `benches/e2e/instructions.sh`); the
/// property test below holds this to `format!("{n:016x}")`.
pub(crate) fn hex16(n: u64) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&digits(spread((n >> 32) as u32)).to_be_bytes());
    out[8..].copy_from_slice(&digits(spread(n as u32)).to_be_bytes());
    out
}

/// The 32 lower-case hex digits of `n`, most significant first.
pub(crate) fn hex32(n: u128) -> [u8; 32] {
    let mut out = [0u8; 32];
    out[..16].copy_from_slice(&hex16((n >> 64) as u64));
    out[16..].copy_from_slice(&hex16(n as u64));
    out
}

/// The eight nibbles of `x` in eight bytes, the least significant nibble in
/// the lowest byte.
fn spread(x: u32) -> u64 {
    let x = u64::from(x);
    let x = ((x & 0xFFFF_0000) << 16) | (x & 0xFFFF);
    let x = ((x & 0x0000_FF00_0000_FF00) << 8) | (x & 0x0000_00FF_0000_00FF);
    ((x & 0x00F0_00F0_00F0_00F0) << 4) | (x & 0x000F_000F_000F_000F)
}

/// Each byte (0 to 15) made its lower-case hex digit: `'0' + b`, and past 9
/// the 39 more that reach `'a'` (no byte carries into the next).
fn digits(nibbles: u64) -> u64 {
    let letters = ((nibbles + 0x0606_0606_0606_0606) >> 4) & 0x0101_0101_0101_0101;
    nibbles + 0x3030_3030_3030_3030 + letters * 0x27
}

/// `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`; zero ids are invalid.
fn parse_traceparent(v: &str) -> Option<(u128, u64, u8)> {
    let mut it = v.trim().split('-');
    let (version, trace, parent, flags) = (it.next()?, it.next()?, it.next()?, it.next()?);
    if version.len() != 2
        || version == "ff"
        || trace.len() != 32
        || parent.len() != 16
        || flags.len() != 2
    {
        return None;
    }
    if version == "00" && it.next().is_some() {
        return None;
    }
    let trace = u128::from_str_radix(trace, 16).ok().filter(|t| *t != 0)?;
    let parent = u64::from_str_radix(parent, 16).ok().filter(|p| *p != 0)?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    Some((trace, parent, flags))
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, HeaderValue};

    use super::*;

    #[test]
    fn continues_a_valid_trace_and_starts_one_otherwise() {
        let mut h = HeaderMap::new();
        h.insert(
            "traceparent",
            HeaderValue::from_static("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        );
        let t = TraceCtx::from_headers(&h);
        assert_eq!(t.trace_id_hex(), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(t.parent_span_id, Some(0xb7ad6b7169203331));
        assert!(t.sampled);
        let up = t.upstream_value();
        let up = std::str::from_utf8(&up).unwrap_or_default();
        assert!(up.starts_with("00-0af7651916cd43dd8448eb211c80319c-"));
        assert!(up.ends_with("-01"));
        assert!(
            !up.contains("b7ad6b7169203331"),
            "the replica's parent is the gateway's span"
        );

        let cases = [
            (t, "given"),
            (TraceCtx::from_headers(&HeaderMap::new()), "new"),
        ];
        for (t, what) in cases {
            let written = t.upstream_value();
            assert_eq!(
                std::str::from_utf8(&written).unwrap_or_default(),
                format!(
                    "00-{:032x}-{:016x}-{:02x}",
                    t.trace_id,
                    t.upstream_span_id,
                    u8::from(t.sampled)
                ),
                "{what}"
            );
        }

        for bad in [
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "garbage",
        ] {
            h.insert("traceparent", HeaderValue::from_static(bad));
            assert_eq!(TraceCtx::from_headers(&h).parent_span_id, None, "{bad}");
        }
    }

    proptest::proptest! {
        /// The digits are `format!`'s, for any number.
        #[test]
        fn hex_digits_are_formats(n in proptest::num::u128::ANY) {
            let (wide, low) = (hex32(n), hex16(n as u64));
            let (want_wide, want_low) = (format!("{n:032x}"), format!("{:016x}", n as u64));
            proptest::prop_assert_eq!(&wide[..], want_wide.as_bytes());
            proptest::prop_assert_eq!(&low[..], want_low.as_bytes());
        }
    }

    #[test]
    fn hex_digits_at_the_edges() {
        assert_eq!(&hex16(0), b"0000000000000000");
        assert_eq!(&hex16(u64::MAX), b"ffffffffffffffff");
        assert_eq!(&hex16(0x0123_4567_89ab_cdef), b"0123456789abcdef");
        assert_eq!(&hex16(0xfedc_ba98_7654_3210), b"fedcba9876543210");
    }
}
