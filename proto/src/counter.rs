//! Counters as Redis reads them: a value an `add_text` adds to, and an `INCRBY`/`DECRBY`
//! amount, is a signed 64-bit decimal integer in canonical form. One reader for the host (which
//! reads stored values) and the gateway (which reads commands' amounts), so that both refuse
//! what Redis refuses.

/// A decimal signed 64-bit integer in canonical form — an optional `-`, digits without a
/// leading zero (`0` alone), nothing else (no `+`, no spaces, not `-0`), at most 20 bytes; None
/// for anything else, and for a number outside `i64`.
pub fn parse(v: &[u8]) -> Option<i64> {
    let digits = v.strip_prefix(b"-").unwrap_or(v);
    let canonical = !digits.is_empty()
        && v.len() <= 20
        && digits.iter().all(u8::is_ascii_digit)
        && (digits[0] != b'0' || (digits.len() == 1 && digits.len() == v.len()));
    if !canonical {
        return None;
    }
    std::str::from_utf8(v).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_canonical_decimals_in_range_are_read() {
        for (text, n) in [(&b"0"[..], 0), (b"7", 7), (b"-12", -12), (b"9223372036854775807", i64::MAX)] {
            assert_eq!(parse(text), Some(n), "{text:?}");
        }
        assert_eq!(parse(b"-9223372036854775808"), Some(i64::MIN));
        for bad in [
            &b""[..],
            b"-",
            b"x",
            b"01",
            b"-0",
            b"+1",
            b" 1",
            b"1 ",
            b"1.5",
            b"9223372036854775808",
            b"99999999999999999999",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }
}
