//! Fuzzes `SCAN ... MATCH` globs (`dpukv_gateway::resp::pattern`): the compiled matcher agrees
//! with the obvious recursive one (Redis's rules) on any pattern and key, and compiling any
//! bytes never panics. The reference is exponential on `*a*a*a...`, so inputs are kept short
//! (CI form: the proptests in `gateway/src/resp/pattern.rs`).
#![no_main]

use dpukv_gateway::resp::pattern::Glob;
use libfuzzer_sys::fuzz_target;

/// The recursive reference matcher.
fn reference(p: &[u8], s: &[u8]) -> bool {
    match p.split_first() {
        None => s.is_empty(),
        Some((b'*', rest)) => (0..=s.len()).any(|i| reference(rest, &s[i..])),
        Some((b'?', rest)) => !s.is_empty() && reference(rest, &s[1..]),
        Some((b'[', rest)) => {
            let Some((&c, tail)) = s.split_first() else { return false };
            let (hit, after) = class(rest, c);
            hit && reference(after, tail)
        }
        Some((b'\\', rest)) if !rest.is_empty() => s.first() == Some(&rest[0]) && reference(&rest[1..], &s[1..]),
        Some((&b, rest)) => s.first() == Some(&b) && reference(rest, &s[1..]),
    }
}

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
                hit |= (*a.min(z)..=*a.max(z)).contains(&c);
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

fuzz_target!(|data: &[u8]| {
    // The first byte splits the input into a pattern and a key.
    let Some((&cut, rest)) = data.split_first() else { return };
    let cut = usize::from(cut).min(rest.len());
    let (p, s) = rest.split_at(cut);
    let glob = Glob::new(p);
    if p.iter().filter(|&&b| b == b'*').count() <= 4 && s.len() <= 32 {
        assert_eq!(glob.matches(s), reference(p, s), "{p:?} ~ {s:?}");
    } else {
        let _ = glob.matches(s);
    }
});
