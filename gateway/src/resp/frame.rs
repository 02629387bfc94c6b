//! RESP 2 on the wire: commands in (arrays of bulk strings, or inline lines as `redis-cli` and
//! `telnet` send them), replies out. Like mini-redis's `frame.rs`, a command is checked to be
//! complete before anything of it is taken, so a partial read costs nothing but waiting; every
//! length is checked against the limits before a byte is kept.

/// Bounds on what a command may hold.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most arguments (command name included).
    pub max_args: usize,
    /// Most bytes of one argument.
    pub max_arg: usize,
    /// Most bytes of one command on the wire.
    pub max_command: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_args: 4096,
            max_arg: dpukv_proto::limits::MAX_VALUE + 1024,
            max_command: dpukv_proto::limits::MAX_FRAME,
        }
    }
}

/// Why bytes are not a command (yet).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// More bytes are needed.
    #[error("incomplete")]
    Incomplete,
    /// Not RESP: the connection cannot be trusted past this (answered, then closed).
    #[error("Protocol error: {0}")]
    Invalid(&'static str),
    /// Over a limit (answered, then closed: the rest of the command is not read).
    #[error("Protocol error: {0}")]
    TooLarge(&'static str),
}

/// The length line at `at` (after its type byte): the number and where the next line starts.
fn number_line(buf: &[u8], at: usize, max_line: usize) -> Result<(i64, usize), ParseError> {
    let rest = &buf[at.min(buf.len())..];
    let Some(end) = rest.windows(2).position(|w| w == b"\r\n") else {
        return if rest.len() > max_line {
            Err(ParseError::Invalid("length line too long"))
        } else {
            Err(ParseError::Incomplete)
        };
    };
    let text = std::str::from_utf8(&rest[..end]).map_err(|_| ParseError::Invalid("length is not a number"))?;
    let n: i64 = text.parse().map_err(|_| ParseError::Invalid("length is not a number"))?;
    Ok((n, at + end + 2))
}

/// Parses the command at the front of `buf`: its arguments and the bytes it took.
pub fn parse_command(buf: &[u8], limits: &Limits) -> Result<(Vec<Vec<u8>>, usize), ParseError> {
    match buf.first() {
        None => Err(ParseError::Incomplete),
        Some(b'*') => parse_array(buf, limits),
        Some(_) => parse_inline(buf, limits),
    }
}

fn parse_array(buf: &[u8], limits: &Limits) -> Result<(Vec<Vec<u8>>, usize), ParseError> {
    let (n, mut at) = number_line(buf, 1, 32)?;
    if n < 0 {
        // A null array is no command: nothing to do.
        return Ok((Vec::new(), at));
    }
    let n = n as usize;
    if n > limits.max_args {
        return Err(ParseError::TooLarge("too many arguments"));
    }
    // Check the whole command is here before allocating for it.
    let mut spans = Vec::with_capacity(n.min(64));
    for _ in 0..n {
        match buf.get(at) {
            None => return Err(ParseError::Incomplete),
            Some(b'$') => {}
            Some(_) => return Err(ParseError::Invalid("expected '$', got something else")),
        }
        let (len, start) = number_line(buf, at + 1, 32)?;
        if len < 0 {
            return Err(ParseError::Invalid("a command argument cannot be null"));
        }
        let len = len as usize;
        if len > limits.max_arg {
            return Err(ParseError::TooLarge("invalid bulk length"));
        }
        let end = start + len;
        if end + 2 > limits.max_command {
            return Err(ParseError::TooLarge("command too large"));
        }
        if buf.len() < end + 2 {
            return Err(ParseError::Incomplete);
        }
        if &buf[end..end + 2] != b"\r\n" {
            return Err(ParseError::Invalid("bulk string not terminated by CRLF"));
        }
        spans.push((start, end));
        at = end + 2;
    }
    Ok((spans.into_iter().map(|(s, e)| buf[s..e].to_vec()).collect(), at))
}

/// A `GET key` whole at the front of `buf`, as clients send it (`*2\r\n$3\r\nGET\r\n$<n>\r\n<key>\r\n`,
/// the name in any case): the key's span in `buf` and the bytes the command takes — parsed in
/// place, nothing copied or allocated. None when the bytes are anything else, or not whole, or
/// past `limits`: [`parse_command`] then decides (what this accepts, it parses the same).
pub fn get_command(buf: &[u8], limits: &Limits) -> Option<(std::ops::Range<usize>, usize)> {
    const HEAD: &[u8] = b"*2\r\n$3\r\n";
    if buf.len() < 16 || &buf[..8] != HEAD || !buf[8..11].eq_ignore_ascii_case(b"get") || &buf[11..14] != b"\r\n$" {
        return None;
    }
    let digits = buf[14..].iter().take(8).take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits == 8 {
        return None;
    }
    let len = buf[14..14 + digits].iter().fold(0usize, |n, d| n * 10 + usize::from(d - b'0'));
    let start = 14 + digits + 2;
    let end = start + len;
    if buf.get(start - 2..start) != Some(b"\r\n") || len > limits.max_arg || end + 2 > limits.max_command {
        return None;
    }
    if buf.get(end..end + 2) != Some(b"\r\n") {
        return None;
    }
    Some((start..end, end + 2))
}

/// Appends `$<len>\r\n<value>\r\n` (a bulk string reply), or `$-1\r\n` for None, with no allocation
/// but `out`'s growth.
pub fn encode_bulk(out: &mut Vec<u8>, value: Option<&[u8]>) {
    match value {
        None => out.extend_from_slice(b"$-1\r\n"),
        Some(v) => {
            out.push(b'$');
            push_decimal(out, v.len() as u64);
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(v);
            out.extend_from_slice(b"\r\n");
        }
    }
}

/// Frames the value at `out[at..]` (appended there by its reader) as a bulk string reply —
/// `$<len>\r\n` moved in before it, `\r\n` after — or, when `found` is false (nothing was
/// appended), `$-1\r\n`: what [`encode_bulk`] writes, without the value passing through
/// another buffer.
pub fn frame_bulk(out: &mut Vec<u8>, at: usize, found: bool) {
    if !found {
        out.truncate(at);
        out.extend_from_slice(b"$-1\r\n");
        return;
    }
    let len = out.len() - at;
    let mut head = [0u8; 24];
    head[0] = b'$';
    let mut n = 1 + decimal(len as u64, &mut head[1..]);
    head[n..n + 2].copy_from_slice(b"\r\n");
    n += 2;
    out.resize(out.len() + n, 0);
    out.copy_within(at..at + len, at + n);
    out[at..at + n].copy_from_slice(&head[..n]);
    out.extend_from_slice(b"\r\n");
}

/// Writes `n` in decimal at the front of `to` (20 bytes are enough); the digits written.
fn decimal(mut n: u64, to: &mut [u8]) -> usize {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let d = digits.len() - i;
    to[..d].copy_from_slice(&digits[i..]);
    d
}

/// Appends `n` in decimal.
fn push_decimal(out: &mut Vec<u8>, n: u64) {
    let mut digits = [0u8; 20];
    let d = decimal(n, &mut digits);
    out.extend_from_slice(&digits[..d]);
}

/// A line of words separated by spaces (a plain `\n` ends it too); empty lines are skipped.
fn parse_inline(buf: &[u8], limits: &Limits) -> Result<(Vec<Vec<u8>>, usize), ParseError> {
    let max_line = (64 << 10).min(limits.max_command);
    let Some(end) = buf.iter().position(|&b| b == b'\n') else {
        return if buf.len() > max_line {
            Err(ParseError::TooLarge("too big inline request"))
        } else {
            Err(ParseError::Incomplete)
        };
    };
    if end > max_line {
        return Err(ParseError::TooLarge("too big inline request"));
    }
    let line = buf[..end].strip_suffix(b"\r").unwrap_or(&buf[..end]);
    let args: Vec<Vec<u8>> =
        line.split(|b| *b == b' ' || *b == b'\t').filter(|w| !w.is_empty()).map(<[u8]>::to_vec).collect();
    if args.len() > limits.max_args {
        return Err(ParseError::TooLarge("too many arguments"));
    }
    if args.iter().any(|a| a.len() > limits.max_arg) {
        return Err(ParseError::TooLarge("invalid bulk length"));
    }
    Ok((args, end + 1))
}

/// A reply, encoded into `out`.
#[derive(Debug, Clone)]
pub enum Reply {
    /// `+text`
    Simple(&'static str),
    /// `-text` (the text starts with its error kind, `ERR ...`)
    Error(String),
    /// `:n`
    Integer(i64),
    /// `$len` bytes
    Bulk(Vec<u8>),
    /// `$-1`
    Nil,
    /// `*n` replies
    Array(Vec<Reply>),
}

impl Reply {
    /// `-ERR text`
    pub fn err(text: impl std::fmt::Display) -> Reply {
        Reply::Error(format!("ERR {text}"))
    }

    /// Appends the encoding.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Reply::Simple(s) => {
                out.push(b'+');
                out.extend_from_slice(s.as_bytes());
                out.extend_from_slice(b"\r\n");
            }
            Reply::Error(s) => {
                out.push(b'-');
                // An error line must not break the framing.
                out.extend(s.bytes().map(|b| if b == b'\r' || b == b'\n' { b' ' } else { b }));
                out.extend_from_slice(b"\r\n");
            }
            Reply::Integer(n) => {
                out.push(b':');
                if *n < 0 {
                    out.push(b'-');
                }
                push_decimal(out, n.unsigned_abs());
                out.extend_from_slice(b"\r\n");
            }
            Reply::Bulk(b) => encode_bulk(out, Some(b)),
            Reply::Nil => out.extend_from_slice(b"$-1\r\n"),
            Reply::Array(items) => {
                out.push(b'*');
                push_decimal(out, items.len() as u64);
                out.extend_from_slice(b"\r\n");
                for i in items {
                    i.encode(out);
                }
            }
        }
    }

    /// Bytes its encoding takes (about).
    pub fn size(&self) -> usize {
        match self {
            Reply::Simple(s) => s.len() + 3,
            Reply::Error(s) => s.len() + 3,
            Reply::Integer(_) | Reply::Nil => 24,
            Reply::Bulk(b) => b.len() + 16,
            Reply::Array(items) => 16 + items.iter().map(Reply::size).sum::<usize>(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encode_command(args: &[&[u8]]) -> Vec<u8> {
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
        out
    }

    #[test]
    fn commands_parse_whole_or_not_at_all() {
        let l = Limits::default();
        let cmd = encode_command(&[b"SET", b"k", b"v\r\nwith CRLF"]);
        for cut in 0..cmd.len() {
            assert_eq!(parse_command(&cmd[..cut], &l), Err(ParseError::Incomplete), "cut at {cut}");
        }
        let mut two = cmd.clone();
        two.extend_from_slice(b"PING\r\n");
        let (args, used) = parse_command(&two, &l).expect("a command");
        assert_eq!(args, vec![b"SET".to_vec(), b"k".to_vec(), b"v\r\nwith CRLF".to_vec()]);
        assert_eq!(used, cmd.len());
        assert_eq!(parse_command(&two[used..], &l), Ok((vec![b"PING".to_vec()], 6)));
        assert_eq!(parse_command(b"get  k\n", &l), Ok((vec![b"get".to_vec(), b"k".to_vec()], 7)));
    }

    #[test]
    fn limits_and_garbage_are_errors() {
        let l = Limits { max_args: 3, max_arg: 8, max_command: 64 };
        assert!(matches!(parse_command(b"*4\r\n", &l), Err(ParseError::TooLarge(_))));
        assert!(matches!(parse_command(b"*1\r\n$9\r\n", &l), Err(ParseError::TooLarge(_))));
        assert!(matches!(parse_command(b"*1\r\n$-1\r\n", &l), Err(ParseError::Invalid(_))));
        assert!(matches!(parse_command(b"*1\r\n:5\r\n", &l), Err(ParseError::Invalid(_))));
        assert!(matches!(parse_command(b"*x\r\n", &l), Err(ParseError::Invalid(_))));
        assert!(matches!(parse_command(b"*1\r\n$3\r\nabcXY", &l), Err(ParseError::Invalid(_))));
        let l = Limits { max_args: 3, max_arg: 8, max_command: 10 };
        assert!(matches!(parse_command(b"*1\r\n$8\r\n", &l), Err(ParseError::TooLarge(_))));
        // Inline commands honour the same limits (found by the fuzz target `resp_command`).
        let l = Limits { max_args: 3, max_arg: 4, max_command: 64 };
        assert!(matches!(parse_command(b"get abcdefgh\n", &l), Err(ParseError::TooLarge(_))));
        assert!(matches!(parse_command(&[b'x'; 100], &l), Err(ParseError::TooLarge(_))));
    }

    #[test]
    fn gets_parse_in_place_as_the_parser_parses_them() {
        let l = Limits::default();
        let get = encode_command(&[b"gEt", b"key:000000012345"]);
        let (key, used) = get_command(&get, &l).expect("a get");
        assert_eq!((&get[key], used), (&b"key:000000012345"[..], get.len()));
        for cut in 0..get.len() {
            assert_eq!(get_command(&get[..cut], &l), None, "cut at {cut}");
        }
        // Not a get, or not one this takes: the general parser decides.
        for other in [
            encode_command(&[b"GETX", b"k"]),
            encode_command(&[b"GET", b"k", b"v"]),
            encode_command(&[b"SET", b"k"]),
            b"*2\r\n$3\r\nGET\r\n$+1\r\nk\r\n".to_vec(),
            b"*2\r\n$3\r\nGET\r\n$1\r\nkXY".to_vec(),
            b"*2\r\n$3\r\nGET\r\n$99999999\r\nk\r\n".to_vec(),
            b"GET k\r\n".to_vec(),
        ] {
            assert_eq!(get_command(&other, &l), None, "{:?}", String::from_utf8_lossy(&other));
        }
        // Past the limits: the parser's error, not a get.
        let small = Limits { max_args: 3, max_arg: 4, max_command: 64 };
        assert_eq!(get_command(&encode_command(&[b"GET", b"abcdefgh"]), &small), None);
        let mut out = b"+OK\r\nabc".to_vec();
        frame_bulk(&mut out, 5, true);
        let end = out.len();
        frame_bulk(&mut out, end, false);
        let big = vec![b'x'; 123_456];
        let at = out.len();
        out.extend_from_slice(&big);
        frame_bulk(&mut out, at, true);
        let mut want = b"+OK\r\n$3\r\nabc\r\n$-1\r\n$123456\r\n".to_vec();
        want.extend_from_slice(&big);
        want.extend_from_slice(b"\r\n");
        assert_eq!(out, want);
        let mut out = Vec::new();
        encode_bulk(&mut out, Some(b"v"));
        encode_bulk(&mut out, None);
        Reply::Integer(-120).encode(&mut out);
        Reply::Integer(i64::MIN).encode(&mut out);
        Reply::Array(vec![Reply::Bulk(vec![b'x'; 12])]).encode(&mut out);
        assert_eq!(out, b"$1\r\nv\r\n$-1\r\n:-120\r\n:-9223372036854775808\r\n*1\r\n$12\r\nxxxxxxxxxxxx\r\n");
    }

    /// A pipeline of GETs is parsed and answered with no allocation per command (the reply
    /// buffer grows once): the in-place parser takes no copies, the bulk reply's length is
    /// written without formatting a string. (The general parser copies every argument.)
    #[test]
    fn gets_are_parsed_and_answered_without_allocating() {
        let l = Limits::default();
        let mut input = Vec::new();
        for i in 0..64 {
            input.extend_from_slice(&encode_command(&[b"GET", format!("key:{i:012}").as_bytes()]));
        }
        let value = [b'v'; 64];
        let mut out = Vec::with_capacity(64 * 80); // `$64\r\n`, the value, `\r\n`: 71 bytes each
        let before = dpukv_alloc_count::allocations();
        let (mut at, mut gets) = (0, 0);
        while let Some((key, n)) = get_command(&input[at..], &l) {
            // As a device answers: the value appended, then framed where it lies.
            let mark = out.len();
            let found = input[at..][key].len() == 16;
            if found {
                out.extend_from_slice(&value);
            }
            frame_bulk(&mut out, mark, found);
            (at, gets) = (at + n, gets + 1);
        }
        assert_eq!(dpukv_alloc_count::allocations() - before, 0, "allocations for {gets} gets");
        assert_eq!((gets, at, out.len()), (64, input.len(), 64 * (64 + 7)));
        let before = dpukv_alloc_count::allocations();
        let _ = parse_command(&input, &l).expect("a command");
        assert!(dpukv_alloc_count::allocations() - before >= 3, "the general parser copies its arguments");
    }

    proptest! {
        /// Whatever the bytes, the in-place get parser agrees with the general one: what it
        /// takes is a whole `GET` of that key, of that many bytes.
        #[test]
        fn the_get_parser_agrees_with_the_parser(bytes in proptest::collection::vec(any::<u8>(), 0..64), cut in 0usize..64, key in proptest::collection::vec(any::<u8>(), 0..24)) {
            let l = Limits::default();
            let mut get = encode_command(&[b"GET", &key]);
            get.extend_from_slice(&bytes);
            get.truncate(get.len().min(cut + 14 + key.len()));
            for buf in [&get[..], &bytes[..]] {
                if let Some((k, used)) = get_command(buf, &l) {
                    let (args, n) = parse_command(buf, &l).expect("the parser takes it too");
                    prop_assert_eq!(n, used);
                    prop_assert!(args.len() == 2 && args[0].eq_ignore_ascii_case(b"get"));
                    prop_assert_eq!(&args[1][..], &buf[k]);
                }
            }
        }

        /// Whatever the bytes, parsing answers (never panics) and never claims more bytes than
        /// it was given.
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Ok((_, used)) = parse_command(&bytes, &Limits::default()) {
                prop_assert!(used <= bytes.len());
            }
        }

        /// Encoded commands parse back to their arguments.
        #[test]
        fn commands_round_trip(args in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 1..8)) {
            let refs: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
            let cmd = encode_command(&refs);
            prop_assert_eq!(parse_command(&cmd, &Limits::default()), Ok((args.clone(), cmd.len())));
        }
    }
}
