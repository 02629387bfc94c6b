//! `SCAN ... MATCH pattern`: Redis's glob patterns (`*`, `?`, `[abc]`, `[^a-z]`, `\x`). A
//! pattern's literal prefix bounds the range read (keys are ordered, so `user:*` reads only the
//! keys starting with `user:`); the whole pattern then filters the keys read.

use dpukv_proto::limits::MAX_KEY;

/// The literal bytes a pattern's matches all start with.
pub fn literal_prefix(pattern: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < pattern.len() {
        match pattern[i] {
            b'*' | b'?' | b'[' => break,
            b'\\' if i + 1 < pattern.len() => {
                out.push(pattern[i + 1]);
                i += 2;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

/// The range `[lo, hi]` holding every key that starts with `prefix` (an empty `hi`: the end of
/// the key space).
pub fn prefix_range(prefix: &[u8]) -> (Vec<u8>, Vec<u8>) {
    if prefix.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let mut hi = prefix.to_vec();
    hi.resize(MAX_KEY.max(prefix.len()), 0xff);
    (prefix.to_vec(), hi)
}

/// Whether `s` matches the glob `p`.
pub fn matches(p: &[u8], s: &[u8]) -> bool {
    match p.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => {
            // Collapse runs of '*'; then try every split.
            let rest = {
                let mut r = rest;
                while let Some((b'*', more)) = r.split_first() {
                    r = more;
                }
                r
            };
            if rest.is_empty() {
                return true;
            }
            (0..=s.len()).any(|i| matches(rest, &s[i..]))
        }
        Some((b'?', rest)) => !s.is_empty() && matches(rest, &s[1..]),
        Some((b'[', rest)) => {
            let Some((&c, tail)) = s.split_first() else { return false };
            let (hit, after) = class(rest, c);
            hit && matches(after, tail)
        }
        Some((b'\\', rest)) if !rest.is_empty() => s.first() == Some(&rest[0]) && matches(&rest[1..], &s[1..]),
        Some((&b, rest)) => s.first() == Some(&b) && matches(rest, &s[1..]),
    }
}

/// Matches `c` against the class starting after `[`; returns the verdict and the pattern after
/// the class (an unterminated class runs to the pattern's end).
fn class(p: &[u8], c: u8) -> (bool, &[u8]) {
    let (negate, mut p) = match p.first() {
        Some(b'^') => (true, &p[1..]),
        _ => (false, p),
    };
    let mut hit = false;
    loop {
        match p {
            [] => break,
            [b']', rest @ ..] => {
                p = rest;
                break;
            }
            [b'\\', x, rest @ ..] => {
                hit |= *x == c;
                p = rest;
            }
            [a, b'-', z, rest @ ..] if *z != b']' => {
                let (lo, hi) = if a <= z { (*a, *z) } else { (*z, *a) };
                hit |= (lo..=hi).contains(&c);
                p = rest;
            }
            [x, rest @ ..] => {
                hit |= *x == c;
                p = rest;
            }
        }
    }
    (hit != negate, p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_like_redis() {
        let yes = [
            ("*", ""),
            ("user:*", "user:1"),
            ("h?llo", "hello"),
            ("h*llo", "heeeello"),
            ("h[ae]llo", "hallo"),
            ("h[^e]llo", "hallo"),
            ("h[a-b]llo", "hbllo"),
            ("a\\*b", "a*b"),
            ("*:*:x", "a:b:c:x"),
        ];
        let no = [("h?llo", "hllo"), ("h[ae]llo", "hillo"), ("h[^e]llo", "hello"), ("user:*", "use"), ("a\\*b", "axb")];
        for (p, s) in yes {
            assert!(matches(p.as_bytes(), s.as_bytes()), "{p} ~ {s}");
        }
        for (p, s) in no {
            assert!(!matches(p.as_bytes(), s.as_bytes()), "{p} !~ {s}");
        }
        assert_eq!(literal_prefix(b"user:\\*x*"), b"user:*x".to_vec());
        assert_eq!(literal_prefix(b"*"), Vec::<u8>::new());
        let (lo, hi) = prefix_range(b"ab");
        assert!(
            lo.as_slice() <= b"ab".as_slice()
                && b"ab\xff\xff".as_slice() <= hi.as_slice()
                && hi.as_slice() < b"ac".as_slice()
        );
    }
}
