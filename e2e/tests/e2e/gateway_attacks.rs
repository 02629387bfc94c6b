//! Attacks on a real gateway process (issue 26 item 5: "no unauthenticated client can stall the
//! gateway"), each failing on the gateway as it was: two unauthenticated `MGET`s of 1,100 keys
//! took the whole memory budget and hung every front end; `SCAN MATCH` with many `*` ran
//! forever (Redis's CVE-2022-36021); 4,096 idle HTTP connections locked HTTP out for good;
//! unauthenticated connections could make the gateway buffer large commands and frames; a
//! revoked token's sessions stayed open; short tokens were accepted and `AUTH` could be tried
//! without end; `CLIENT REPLY OFF` was answered and ignored; `MULTI` was unknown.
//!
//! Each runs one node pod and a gateway with a token file, and talks to it with `redis-cli`,
//! `curl` and raw sockets; every wait is for a reply (or a closed socket), bounded in time.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use dpukv_e2e::gateway::Gateway;
use dpukv_e2e::procs::Pod;

const APP: &str = "app-secret-0123456789";
const ADMIN: &str = "admin-secret-0123456789";

fn tokens(app: &str) -> String {
    format!(
        r#"{{"tokens": [
    {{"name": "app", "token": "{app}", "grants": [{{"prefix": "app/", "allow": ["read", "write"]}}]}},
    {{"name": "admin", "token": "{ADMIN}", "grants": [{{"prefix": "", "allow": ["admin"]}}]}}
]}}"#
    )
}

/// A pod and a gateway reading its tokens from a file (returned, to be rewritten), with `extra`
/// flags.
fn gateway(extra: &[&str]) -> (Pod, tempfile::TempDir, Gateway) {
    let pod = Pod::start(&["--fsync", "never"]).expect("pod");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("tokens.json");
    std::fs::write(&file, tokens(APP)).expect("tokens");
    let mut args = vec!["--tokens", file.to_str().expect("utf-8 path")];
    args.extend_from_slice(extra);
    let gw = Gateway::start(&[&pod.addr], &args).expect("gateway");
    (pod, dir, gw)
}

/// A RESP command as a client sends it.
fn resp(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

fn connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    s
}

/// Reads from `s` until what it sent ends with `want`, or it closes, or `within` passes: what
/// was read, and whether the socket was closed.
fn read_until(s: &mut TcpStream, want: &[u8], within: Duration) -> (Vec<u8>, bool) {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    let mut buf = [0u8; 64 << 10];
    while !got.ends_with(want) || want.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return (got, false);
        }
        s.set_read_timeout(Some(left)).expect("timeout");
        match s.read(&mut buf) {
            Ok(0) => return (got, true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return (got, false);
            }
            Err(_) => return (got, true),
        }
    }
    (got, false)
}

/// Runs `cmd` (killed after 10 s): its output and how long it took.
fn timed(cmd: &mut Command) -> (String, Duration) {
    let started = Instant::now();
    let mut child =
        cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().expect("runs");
    let deadline = started + Duration::from_secs(10);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let took = started.elapsed();
    let out = child.wait_with_output().expect("output");
    (
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)).trim().to_string(),
        took,
    )
}

fn redis_cli(gw: &Gateway, pass: Option<&str>, args: &[&str]) -> Command {
    let mut c = Command::new("redis-cli");
    c.args(["-h", "127.0.0.1", "-p", gw.resp_port()]).env_remove("REDISCLI_AUTH");
    if let Some(p) = pass {
        c.args(["--no-auth-warning", "--pass", p]);
    }
    c.args(args);
    c
}

fn curl(url: &str, token: Option<&str>) -> Command {
    let mut c = Command::new("curl");
    c.args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10", url]);
    if let Some(t) = token {
        c.args(["-H", &format!("authorization: Bearer {t}")]);
    }
    c
}

/// Asserts `cmd` answers within a second with output containing `want`.
#[track_caller]
fn must_answer_within_a_second(cmd: &mut Command, want: &str) {
    let (out, took) = timed(cmd);
    eprintln!("{:?} answered in {took:?}", cmd.get_args().last().unwrap_or_default());
    assert!(out.contains(want) && took < Duration::from_secs(1), "{cmd:?} answered {out:?} after {took:?}");
}

/// One unauthenticated RESP connection sending two MGETs of 1,100 keys, and an authenticated
/// one doing the same without reading, hang nothing: PING (redis-cli), HTTP (curl) and the
/// binary protocol (the dpukv CLI) on other connections answer within a second. (Before, the
/// MGETs reserved their largest replies — 1,100 × 1 MiB each, the whole 1 GiB budget — before
/// the token was checked, and every front end waited for the budget forever.)
#[test]
fn gateway_unauthenticated_mgets_stall_nothing() {
    let (_pod, _dir, gw) = gateway(&[]);
    let mget = |key: &[u8]| {
        let mut args: Vec<&[u8]> = vec![b"MGET"];
        args.extend(std::iter::repeat_n(key, 1100));
        resp(&args)
    };
    // Both MGETs in one write (short keys: both fit one read of the gateway's, so they are
    // taken together).
    let mut stranger = connect(&gw.resp);
    stranger.write_all(&[mget(b"k"), mget(b"k")].concat()).expect("send");
    let mut member = connect(&gw.resp);
    let auth = resp(&[b"AUTH", APP.as_bytes()]);
    member.write_all(&[auth, mget(b"app/m"), mget(b"app/m")].concat()).expect("send");
    for _ in 0..3 {
        must_answer_within_a_second(&mut redis_cli(&gw, Some(APP), &["PING"]), "PONG");
        must_answer_within_a_second(&mut redis_cli(&gw, None, &["PING"]), "NOAUTH");
        must_answer_within_a_second(&mut curl(&gw.url("/v1/kv/app/absent"), Some(APP)), "404");
        must_answer_within_a_second(&mut curl(&gw.url("/v1/kv/app/absent"), None), "401");
        let mut cli = Command::new(dpukv_e2e::procs::bin_dir().expect("binaries").join("dpukv"));
        cli.args(["--endpoint", &gw.binary, "put", "app/k1", "v"]).env("DPUKV_TOKEN", APP);
        let (out, took) = timed(&mut cli);
        assert!(took < Duration::from_secs(1), "the binary front end answered {out:?} after {took:?}");
    }
    // The stranger's commands were refused at their headers, with nothing reserved for them:
    // before AUTH a command may hold 16 arguments of 1 KiB (Redis limits unauthenticated
    // clients likewise).
    let (got, closed) = read_until(&mut stranger, b"", Duration::from_secs(5));
    assert!(closed && got == b"-ERR Protocol error: too many arguments\r\n", "{}", String::from_utf8_lossy(&got));
    let mut small = connect(&gw.resp);
    small.write_all(&resp(&[b"MGET", b"k", b"k"])).expect("send");
    let want = b"-NOAUTH Authentication required.\r\n";
    assert_eq!(read_until(&mut small, want, Duration::from_secs(5)).0, want.to_vec());
    // The member's MGETs ran within its share.
    let one = [b"*1100\r\n".to_vec(), b"$-1\r\n".repeat(1100)].concat();
    let want = [b"+OK\r\n".to_vec(), one.clone(), one].concat();
    let (got, _) = read_until(&mut member, &want, Duration::from_secs(10));
    assert!(got == want, "{}", String::from_utf8_lossy(&got[..got.len().min(200)]));
}

/// `SCAN 0 MATCH` with twelve `*a` against a 1,000-byte key answers within a second (the
/// recursive matcher tried every way to share the key among the stars: it never answered).
#[test]
fn gateway_scan_match_with_many_stars_answers_at_once() {
    let (_pod, _dir, gw) = gateway(&[]);
    let key = "a".repeat(1000);
    must_answer_within_a_second(&mut redis_cli(&gw, Some(ADMIN), &["SET", &key, "v"]), "OK");
    let failing = format!("{}b", "*a".repeat(12));
    let (out, took) = timed(&mut redis_cli(&gw, Some(ADMIN), &["SCAN", "0", "MATCH", &failing]));
    eprintln!("SCAN 0 MATCH (*a)x12 b answered in {took:?}");
    assert!(out == "0" && took < Duration::from_secs(1), "{out:?} after {took:?}");
    let matching = "*a".repeat(12);
    let (out, took) = timed(&mut redis_cli(&gw, Some(ADMIN), &["SCAN", "0", "MATCH", &matching]));
    assert!(out == format!("0\n{key}") && took < Duration::from_secs(1), "{out:?} after {took:?}");
    // The gateway is still itself.
    must_answer_within_a_second(&mut redis_cli(&gw, Some(ADMIN), &["PING"]), "PONG");
}

/// Raises this process's descriptor limit to at least `n` (children inherit it).
fn raise_fd_limit(n: u64) {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let now = getrlimit(Resource::Nofile);
    if now.current.is_some_and(|c| c < n) {
        let want = now.maximum.map_or(n, |m| m.min(n.max(m.min(n))));
        setrlimit(Resource::Nofile, Rlimit { current: Some(want), maximum: now.maximum }).expect("raise RLIMIT_NOFILE");
    }
}

/// 4,096 idle HTTP connections (the connection cap) do not lock HTTP out: each must send a
/// request's headers within `--http-idle-timeout`, so they are closed and a new request is
/// served. (Before, nothing closed them: every later connection was refused while they stayed.)
#[test]
fn gateway_idle_http_connections_do_not_lock_http_out() {
    raise_fd_limit(16_384);
    let (_pod, _dir, gw) = gateway(&["--max-connections", "4096", "--http-idle-timeout", "2"]);
    let started = Instant::now();
    let mut idle: Vec<TcpStream> = (0..4096).map(|_| connect(&gw.http)).collect();
    eprintln!("4,096 idle connections open after {:?}", started.elapsed());
    // A new request is served: once the idle ones are closed, at the latest.
    loop {
        let (out, _) = timed(&mut curl(&gw.url("/v1/kv/app/absent"), Some(APP)));
        if out == "404" {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "HTTP still locked out: {out:?}");
    }
    eprintln!("a new request served after {:?}", started.elapsed());
    // It was the idle timeout that made room: the idle connections were closed by the gateway.
    let (_, closed) = read_until(&mut idle[0], b"", Duration::from_secs(10));
    assert!(closed, "an idle connection is still open");
    let (_, closed) = read_until(&mut idle[4095], b"", Duration::from_secs(10));
    assert!(closed, "an idle connection is still open");
    // A slow client (headers never finished) is closed too.
    let mut slow = connect(&gw.http);
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").expect("send");
    let (_, closed) = read_until(&mut slow, b"", Duration::from_secs(10));
    assert!(closed, "a connection that never finished its headers is still open");
}

/// Before authenticating, a connection cannot make the gateway hold more than a small fixed
/// buffer: a large RESP command or binary frame is refused at its header and the connection
/// closed (before, the gateway buffered up to 16 MiB per connection, outside its budget, for
/// whoever connected). Authenticated, a connection's input buffer is charged to the budget.
#[test]
fn gateway_unauthenticated_connections_hold_no_buffers() {
    let (_pod, _dir, gw) = gateway(&[]);
    // RESP: a 1 MB argument announced.
    let mut s = connect(&gw.resp);
    s.write_all(b"*2\r\n$4\r\nECHO\r\n$1000000\r\n").expect("send");
    // (The gateway may close before all of this is sent.)
    let _ = s.write_all(&vec![b'x'; 64 << 10]);
    let (got, closed) = read_until(&mut s, b"", Duration::from_secs(5));
    assert!(closed && String::from_utf8_lossy(&got).starts_with("-ERR Protocol error"), "{got:?}");
    // Binary: a frame header announcing 8 MiB.
    let mut s = connect(&gw.binary);
    let mut head = Vec::new();
    dpukv_proto::encode_requests(&[dpukv_proto::Request::new(1, dpukv_proto::Op::RegionMap)], &mut head);
    head[..4].copy_from_slice(&(8u32 << 20).to_le_bytes());
    s.write_all(&head[..8]).expect("send");
    let (got, closed) = read_until(&mut s, b"", Duration::from_secs(5));
    let resps = dpukv_proto::decode_responses(&got).expect("an error frame");
    assert!(closed, "the connection is closed");
    assert!(matches!(&resps[0].result, Err(e) if e.message.contains("authenticate first")), "{resps:?}");
    // Authenticated: a command arriving slowly holds its bytes in the budget (visible in
    // /metrics), and gives them back when the connection goes.
    let used = || -> u64 {
        let out = Command::new("curl").args(["-s", &gw.url("/metrics")]).output().expect("curl");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("dpukv_gateway_memory_budget_bytes{state=\"used\"} "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no budget metric"))
    };
    let mut s = connect(&gw.resp);
    s.write_all(&resp(&[b"AUTH", APP.as_bytes()])).expect("send");
    assert_eq!(read_until(&mut s, b"+OK\r\n", Duration::from_secs(5)).0, b"+OK\r\n");
    // An MSET of ten 1 MB values, eight of them sent.
    let mut partial = b"*21\r\n$4\r\nMSET\r\n".to_vec();
    for i in 0..8 {
        partial.extend_from_slice(format!("$6\r\napp/k{i}\r\n$1000000\r\n").as_bytes());
        partial.extend_from_slice(&vec![b'x'; 1_000_000]);
        partial.extend_from_slice(b"\r\n");
    }
    s.write_all(&partial).expect("send");
    let deadline = Instant::now() + Duration::from_secs(10);
    while used() < 6 << 20 {
        assert!(Instant::now() < deadline, "the buffered command is not charged: {} bytes used", used());
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(s);
    while used() > 1 << 20 {
        assert!(Instant::now() < deadline, "the closed connection's bytes were not given back: {}", used());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Removing a token from the token file closes its RESP and binary sessions when the file is
/// re-read (before, they went on with the token for as long as they stayed open).
#[test]
fn gateway_revoked_tokens_lose_their_sessions() {
    let (_pod, dir, gw) = gateway(&[]);
    let mut r = connect(&gw.resp);
    r.write_all(&resp(&[b"AUTH", APP.as_bytes()])).expect("send");
    assert_eq!(read_until(&mut r, b"+OK\r\n", Duration::from_secs(5)).0, b"+OK\r\n");
    let mut b = connect(&gw.binary);
    let mut frame = Vec::new();
    let auth = dpukv_proto::Op::Auth { token: APP.as_bytes().to_vec() };
    dpukv_proto::encode_requests(&[dpukv_proto::Request::new(1, auth)], &mut frame);
    b.write_all(&frame).expect("send");
    let (got, _) = read_until(&mut b, b"", Duration::from_millis(500));
    let resps = dpukv_proto::decode_responses(&got).expect("a response frame");
    assert!(resps[0].result.is_ok(), "{resps:?}");
    // The admin's sessions stay; the app's go.
    let mut other = connect(&gw.resp);
    other.write_all(&resp(&[b"AUTH", ADMIN.as_bytes()])).expect("send");
    assert_eq!(read_until(&mut other, b"+OK\r\n", Duration::from_secs(5)).0, b"+OK\r\n");
    std::fs::write(dir.path().join("tokens.json"), tokens("app-secret-replaced-01")).expect("rewrite");
    let (_, closed) = read_until(&mut r, b"", Duration::from_secs(10));
    assert!(closed, "the revoked token's RESP session is still open");
    let (_, closed) = read_until(&mut b, b"", Duration::from_secs(10));
    assert!(closed, "the revoked token's binary session is still open");
    other.write_all(&resp(&[b"PING"])).expect("send");
    assert_eq!(read_until(&mut other, b"+PONG\r\n", Duration::from_secs(5)).0, b"+PONG\r\n");
}

/// A token file with a short secret does not load (the error names the token, never the
/// secret); failed AUTHs end a connection after three, and a peer address that failed too often
/// is refused — even with the right token — until its allowance comes back.
#[test]
fn gateway_short_tokens_and_guessing_are_refused() {
    let pod = Pod::start(&["--fsync", "never"]).expect("pod");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("tokens.json");
    std::fs::write(&file, r#"{"tokens": [{"name": "tiny", "token": "x", "grants": []}]}"#).expect("tokens");
    let e = Gateway::start(&[&pod.addr], &["--tokens", file.to_str().expect("path")]).err().expect("refused");
    let e = e.to_string();
    assert!(e.contains("\"tiny\"") && e.contains("shorter than 16 bytes"), "{e}");
    assert!(!e.contains("token \"x\"") && !e.contains("\"x\""), "the secret is printed: {e}");
    drop(pod);
    // Three failures a window of 30 s (one back every 10 s).
    let (_pod, _dir, gw) = gateway(&["--auth-failures", "3", "--auth-failure-window", "30"]);
    let mut s = connect(&gw.resp);
    let wrong = resp(&[b"AUTH", b"guess-0123456789abcdef"]);
    for _ in 0..3 {
        s.write_all(&wrong).expect("send");
    }
    let (got, closed) = read_until(&mut s, b"", Duration::from_secs(5));
    assert_eq!(String::from_utf8_lossy(&got).matches("WRONGPASS").count(), 3, "{got:?}");
    assert!(closed, "a connection is closed after three failed AUTHs");
    // The address spent its failures: the right token is refused unheard, on every front end.
    let (out, _) = timed(&mut redis_cli(&gw, Some(APP), &["PING"]));
    assert!(out.contains("too many failed authentications"), "{out}");
    let (out, _) = timed(&mut curl(&gw.url("/v1/kv/app/x"), Some(APP)));
    assert_eq!(out, "429");
    let mut cli = Command::new(dpukv_e2e::procs::bin_dir().expect("binaries").join("dpukv"));
    cli.args(["--endpoint", &gw.binary, "get", "app/x"]).env("DPUKV_TOKEN", APP);
    let (out, _) = timed(&mut cli);
    assert!(out.contains("too many failed authentications"), "{out}");
    // ... until one failure's worth has come back (10 s).
    let started = Instant::now();
    loop {
        let (out, _) = timed(&mut redis_cli(&gw, Some(APP), &["PING"]));
        if out == "PONG" {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "still refused: {out}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// `CLIENT REPLY OFF` and `SKIP` suppress replies as in Redis (before: answered OK, ignored);
/// `MULTI` ... `EXEC` of SETs and MSETs applies them as one batch, and a read queued in a
/// transaction aborts it (before: MULTI was an unknown command and the SETs applied one by one).
#[test]
fn gateway_client_reply_and_transactions() {
    let (_pod, _dir, gw) = gateway(&[]);
    let mut s = connect(&gw.resp);
    let mut w = s.try_clone().expect("clone");
    let mut send = |cmds: &[&[&[u8]]]| {
        let mut out = Vec::new();
        for c in cmds {
            out.extend(resp(c));
        }
        w.write_all(&out).expect("send");
    };
    send(&[&[b"AUTH", APP.as_bytes()], &[b"CLIENT", b"REPLY", b"OFF"], &[b"SET", b"app/a", b"1"], &[b"GET", b"app/a"]]);
    send(&[&[b"CLIENT", b"REPLY", b"ON"], &[b"GET", b"app/a"]]);
    send(&[&[b"CLIENT", b"REPLY", b"SKIP"], &[b"PING"], &[b"ECHO", b"shown"]]);
    let want = b"+OK\r\n+OK\r\n$1\r\n1\r\n$5\r\nshown\r\n";
    assert_eq!(
        String::from_utf8_lossy(&read_until(&mut s, want, Duration::from_secs(5)).0),
        String::from_utf8_lossy(want)
    );
    send(&[
        &[b"MULTI"],
        &[b"SET", b"app/t1", b"1"],
        &[b"MSET", b"app/t2", b"2", b"app/t3", b"3"],
        &[b"EXEC"],
        &[b"MGET", b"app/t1", b"app/t2", b"app/t3"],
    ]);
    let want = b"+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n+OK\r\n+OK\r\n*3\r\n$1\r\n1\r\n$1\r\n2\r\n$1\r\n3\r\n";
    assert_eq!(
        String::from_utf8_lossy(&read_until(&mut s, want, Duration::from_secs(5)).0),
        String::from_utf8_lossy(want)
    );
    send(&[&[b"MULTI"], &[b"SET", b"app/t4", b"4"], &[b"GET", b"app/t1"], &[b"EXEC"], &[b"EXISTS", b"app/t4"]]);
    let (got, _) = read_until(&mut s, b":0\r\n", Duration::from_secs(5));
    let got = String::from_utf8_lossy(&got);
    assert!(
        got.starts_with("+OK\r\n+QUEUED\r\n-ERR only SET key value and MSET") && got.contains("-EXECABORT"),
        "{got}"
    );
    assert!(got.ends_with(":0\r\n"), "nothing of the aborted transaction was applied: {got}");
    send(&[&[b"EXEC"], &[b"DISCARD"], &[b"WATCH", b"app/t1"]]);
    let (got, _) = read_until(&mut s, b"(MULTI/EXEC runs as one atomic batch)\r\n", Duration::from_secs(5));
    let got = String::from_utf8_lossy(&got);
    assert!(
        got.starts_with("-ERR EXEC without MULTI\r\n-ERR DISCARD without MULTI\r\n-ERR WATCH is not supported"),
        "{got}"
    );
}
