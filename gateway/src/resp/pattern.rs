//! `SCAN ... MATCH pattern`: Redis's glob patterns (`*`, `?`, `[abc]`, `[^a-z]`, `\x`). A
//! pattern's literal prefix bounds the range read (keys are ordered, so `user:*` reads only the
//! keys starting with `user:`); the whole pattern then filters the keys read.

use dpukv_proto::limits::MAX_KEY;

/// Most bytes of a `MATCH` pattern (kept with its cursor; longer ones are refused). Every
/// element but `*` takes one byte of a key of at most `MAX_KEY` bytes, so this leaves room
/// for every useful pattern.
pub const MAX_PATTERN: usize = 16 << 10;

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

/// Whether `s` matches the glob `p` (compiles `p`; to test many keys, compile once with
/// [`Glob::new`]).
pub fn matches(p: &[u8], s: &[u8]) -> bool {
    Glob::new(p).matches(s)
}

/// One element of a compiled glob.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    /// `*` (a run of them): any bytes, none included.
    Star,
    /// Exactly one byte of this set (a literal, `?`, or a class): bit `b` of word `b / 64`.
    One([u64; 4]),
}

/// A compiled glob: matching takes time linear in the key for a given pattern (at most about
/// key length × pattern length steps; no backtracking beyond the last `*`, so no exponential
/// blow-up: Redis's CVE-2022-36021 was `*a*a*a...` against a long key).
#[derive(Debug, Clone)]
pub struct Glob {
    tokens: Vec<Token>,
    /// Bytes every match has at least (the tokens that are not `*`).
    min_len: usize,
}

impl Glob {
    /// Compiles Redis's glob syntax (`*`, `?`, `[abc]`, `[^a-z]`, `\x`); any bytes compile (an
    /// unterminated class runs to the pattern's end, as in Redis).
    pub fn new(p: &[u8]) -> Glob {
        let mut tokens = Vec::new();
        let mut rest = p;
        while let Some((&b, after)) = rest.split_first() {
            let mut set = [0u64; 4];
            match b {
                b'*' => {
                    if tokens.last() != Some(&Token::Star) {
                        tokens.push(Token::Star);
                    }
                    rest = after;
                    continue;
                }
                b'?' => set = [u64::MAX; 4],
                b'[' => {
                    let (set, tail) = class(after);
                    tokens.push(Token::One(set));
                    rest = tail;
                    continue;
                }
                b'\\' if !after.is_empty() => {
                    set[usize::from(after[0] / 64)] |= 1 << (after[0] % 64);
                    tokens.push(Token::One(set));
                    rest = &after[1..];
                    continue;
                }
                _ => set[usize::from(b / 64)] |= 1 << (b % 64),
            }
            tokens.push(Token::One(set));
            rest = after;
        }
        let min_len = tokens.iter().filter(|t| matches!(t, Token::One(_))).count();
        Glob { tokens, min_len }
    }

    /// Whether the pattern is empty.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Whether any key of at most `MAX_KEY` bytes can match (a pattern with more single-byte
    /// elements than that cannot).
    pub fn can_match_a_key(&self) -> bool {
        self.min_len <= MAX_KEY
    }

    /// Whether `s` matches. The classic two-pointer algorithm (Russ Cox, "Glob Matching Can Be
    /// Simple And Fast Too"): on a mismatch, only the most recent `*` takes one more byte, since
    /// anything an earlier `*` could take, the later one can take too.
    pub fn matches(&self, s: &[u8]) -> bool {
        if s.len() < self.min_len {
            return false;
        }
        let (mut pi, mut si) = (0usize, 0usize);
        // Where to resume if the current attempt fails: just after the last `*`, with it taking
        // one more byte.
        let mut resume: Option<(usize, usize)> = None;
        while pi < self.tokens.len() || si < s.len() {
            match self.tokens.get(pi) {
                Some(Token::Star) => {
                    resume = Some((pi + 1, si + 1));
                    pi += 1;
                    continue;
                }
                Some(Token::One(set)) if si < s.len() && set[usize::from(s[si] / 64)] & (1 << (s[si] % 64)) != 0 => {
                    pi += 1;
                    si += 1;
                    continue;
                }
                _ => {}
            }
            match resume {
                Some((p, next)) if next <= s.len() => {
                    pi = p;
                    si = next;
                    resume = Some((p, next + 1));
                }
                _ => return false,
            }
        }
        true
    }
}

/// The bytes the class starting after `[` accepts, and the pattern after the class (an
/// unterminated class runs to the pattern's end). One pass over the class.
fn class(p: &[u8]) -> ([u64; 4], &[u8]) {
    let (negate, mut p) = match p.first() {
        Some(b'^') => (true, &p[1..]),
        _ => (false, p),
    };
    let mut set = [0u64; 4];
    let mut add = |c: u8| set[usize::from(c / 64)] |= 1 << (c % 64);
    loop {
        match p {
            [] => break,
            [b']', rest @ ..] => {
                p = rest;
                break;
            }
            [b'\\', x, rest @ ..] => {
                add(*x);
                p = rest;
            }
            [a, b'-', z, rest @ ..] if *z != b']' => {
                let (lo, hi) = if a <= z { (*a, *z) } else { (*z, *a) };
                (lo..=hi).for_each(&mut add);
                p = rest;
            }
            [x, rest @ ..] => {
                add(*x);
                p = rest;
            }
        }
    }
    if negate {
        set.iter_mut().for_each(|w| *w = !*w);
    }
    (set, p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The obvious recursive matcher (the gateway's before it was compiled): exponential on
    /// `*a*a*a...`, but plainly Redis's rules; the reference the compiled glob must agree with.
    fn reference(p: &[u8], s: &[u8]) -> bool {
        match p.split_first() {
            None => s.is_empty(),
            Some((b'*', rest)) => {
                let mut r = rest;
                while let Some((b'*', more)) = r.split_first() {
                    r = more;
                }
                r.is_empty() || (0..=s.len()).any(|i| reference(r, &s[i..]))
            }
            Some((b'?', rest)) => !s.is_empty() && reference(rest, &s[1..]),
            Some((b'[', rest)) => {
                let Some((&c, tail)) = s.split_first() else { return false };
                let (hit, after) = reference_class(rest, c);
                hit && reference(after, tail)
            }
            Some((b'\\', rest)) if !rest.is_empty() => s.first() == Some(&rest[0]) && reference(&rest[1..], &s[1..]),
            Some((&b, rest)) => s.first() == Some(&b) && reference(rest, &s[1..]),
        }
    }

    /// Matches `c` against the class starting after `[`; returns the verdict and the pattern after
    /// the class (an unterminated class runs to the pattern's end).
    fn reference_class(p: &[u8], c: u8) -> (bool, &[u8]) {
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

    /// Patterns and keys over a small alphabet, so that they match often enough to matter.
    fn pattern_bytes() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(proptest::sample::select(b"ab*?[]^-\\".to_vec()), 0..12)
    }

    fn key_bytes() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(proptest::sample::select(b"ab-]^*".to_vec()), 0..14)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// The compiled glob answers what the reference answers, for any pattern and key.
        #[test]
        fn compiled_globs_agree_with_the_reference(p in pattern_bytes(), s in key_bytes()) {
            prop_assert_eq!(Glob::new(&p).matches(&s), reference(&p, &s), "{:?} ~ {:?}", String::from_utf8_lossy(&p), String::from_utf8_lossy(&s));
        }

        /// Any bytes at all (classes over every byte value).
        #[test]
        fn any_bytes_agree_with_the_reference(p in proptest::collection::vec(any::<u8>(), 0..8), s in proptest::collection::vec(any::<u8>(), 0..8)) {
            prop_assert_eq!(Glob::new(&p).matches(&s), reference(&p, &s));
        }
    }

    /// Redis's CVE-2022-36021: `*a` many times against a long key that fails at its end took
    /// the recursive matcher forever (it tries every way to share the key between the stars).
    #[test]
    fn many_stars_against_a_long_key_answer_at_once() {
        let key = vec![b'a'; 1000];
        let mut p = b"*a".repeat(12);
        p.push(b'b');
        let started = std::time::Instant::now();
        assert!(!Glob::new(&p).matches(&key));
        assert!(Glob::new(&b"*a".repeat(12)).matches(&key));
        let mut p = b"*a".repeat(400);
        p.extend_from_slice(b"*b");
        assert!(!Glob::new(&p).matches(&key));
        assert!(started.elapsed() < std::time::Duration::from_secs(1), "{:?}", started.elapsed());
        assert!(!Glob::new(&vec![b'?'; MAX_KEY + 1]).can_match_a_key());
    }

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
