//! The gateway in front of a real cluster (three node pods on etcd, two regions): every HTTP
//! route and error through `curl`, the Redis protocol through `redis-cli` (Debian's
//! `redis-tools`), and the binary protocol through the client library.

use std::process::Command;
use std::time::Duration;

use dpukv_e2e::cluster::{ClusterNode, must_see_map};
use dpukv_e2e::etcd::Etcd;
use dpukv_e2e::gateway::Gateway;

/// Three pods with regions split at `m`, each with a primary and two backups; and a gateway.
fn cluster(etcd: &Etcd) -> (Vec<ClusterNode>, Gateway) {
    let args = ["--lease-ttl-ms", "1000", "--replication-factor", "3", "--split-keys", "m"];
    let nodes: Vec<ClusterNode> =
        (1..=3).map(|id| ClusterNode::start(id, "gw", &etcd.url(), &args).expect("node")).collect();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(60),
        |m| m.regions.len() == 2 && m.regions.iter().all(|r| r.primary != 0 && r.backups.len() == 2),
    ));
    let seeds: Vec<&str> = nodes.iter().map(|n| n.device.as_str()).collect();
    let gw = Gateway::start(&seeds, &["--http-max-body", "4194304"]).expect("gateway");
    (nodes, gw)
}

/// `curl` (a real HTTP client): the status and the body.
fn http(method: &str, url: &str, body: Option<&str>) -> (u16, String) {
    http_with(method, url, body, &[])
}

/// Like [`http`], with extra headers (`name: value`); the headers of the answer are dropped.
fn http_with(method: &str, url: &str, body: Option<&str>, headers: &[&str]) -> (u16, String) {
    use std::io::Write;
    let mut c = Command::new("curl");
    c.args(["-s", "-S", "-X", method, "-o", "-", "-w", "\n%{http_code}", "--max-time", "30", url]);
    for h in headers {
        c.args(["-H", h]);
    }
    if body.is_some() {
        // The body from standard input (it may be larger than an argument may be).
        c.args(["-H", "content-type: application/json", "--data-binary", "@-"]);
    }
    let mut child = c
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("curl (Debian's curl package) runs");
    let mut stdin = child.stdin.take().expect("stdin");
    let payload = body.unwrap_or_default().as_bytes().to_vec();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&payload);
    });
    let out = child.wait_with_output().expect("curl");
    let _ = writer.join();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// Asserts an error answer: the status and the stable code.
fn must_fail(r: (u16, String), status: u16, code: &str) {
    assert_eq!(r.0, status, "status of {}", r.1);
    assert_eq!(json(&r.1)["code"], code, "code of {}", r.1);
}

#[test]
fn every_http_route_and_error_through_a_real_gateway() {
    let etcd = Etcd::start().expect("etcd");
    let (_nodes, gw) = cluster(&etcd);
    let u = |p: &str| gw.url(p);
    // Values: write, read, conditional writes, delete.
    let (s, b) = http("PUT", &u("/v1/kv/apple"), Some(r#"{"value": "red"}"#));
    assert_eq!(s, 200, "{b}");
    assert!(json(&b)["version"].as_u64().is_some_and(|v| v > 0));
    let (s, b) = http("GET", &u("/v1/kv/apple"), None);
    assert_eq!((s, json(&b)["value"].as_str()), (200, Some("red")), "{b}");
    must_fail(http("GET", &u("/v1/kv/pear"), None), 404, "key_not_found");
    must_fail(http("PUT", &u("/v1/kv/apple"), Some(r#"{"value": "x", "mode": "insert"}"#)), 409, "key_exists");
    must_fail(http("PUT", &u("/v1/kv/pear"), Some(r#"{"value": "x", "mode": "update"}"#)), 404, "key_not_found");
    assert_eq!(http("PUT", &u("/v1/kv/apple"), Some(r#"{"value": "green", "mode": "update"}"#)).0, 200);
    // `curl -d` (a form content type) works too: the body is JSON whatever the header says.
    let out = Command::new("curl")
        .args(["-s", "-X", "PUT", &u("/v1/kv/curl"), "-d", r#"{"value": "curl -d"}"#])
        .output()
        .expect("curl");
    assert!(String::from_utf8_lossy(&out.stdout).contains("version"), "{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(json(&http("GET", &u("/v1/kv/curl"), None).1)["value"], "curl -d");
    assert_eq!(http("DELETE", &u("/v1/kv/apple"), None).0, 200);
    must_fail(http("GET", &u("/v1/kv/apple"), None), 404, "key_not_found");
    // Keys with slashes and spaces travel percent-encoded.
    assert_eq!(http("PUT", &u("/v1/kv/a%2Fb%20c"), Some(r#"{"value": "v"}"#)).0, 200);
    assert_eq!(json(&http("GET", &u("/v1/kv/a%2Fb%20c"), None).1)["key"], "a/b c");
    // Base64 keys and values; a value that is not UTF-8 cannot be read as UTF-8.
    assert_eq!(http("PUT", &u("/v1/kv/AAEC?encoding=base64"), Some(r#"{"value": "/w=="}"#)).0, 200);
    let (s, b) = http("GET", &u("/v1/kv/AAEC?encoding=base64"), None);
    assert_eq!((s, json(&b)["value"].as_str(), json(&b)["key"].as_str()), (200, Some("/w=="), Some("AAEC")), "{b}");
    must_fail(http("GET", &u("/v1/kv/%00%01%02"), None), 400, "bad_encoding");
    // A read's consistency (hot-key replicas): every mode reads the value; another is refused.
    for mode in ["linearizable", "bounded:50", "extended", "interleaved"] {
        let (s, b) = http("GET", &u(&format!("/v1/kv/curl?consistency={mode}")), None);
        assert_eq!((s, json(&b)["value"].as_str()), (200, Some("curl -d")), "{mode}: {b}");
    }
    must_fail(http("GET", &u("/v1/kv/curl?consistency=eventually"), None), 400, "bad_request");
    must_fail(http("GET", &u("/v1/kv/!!!?encoding=base64"), None), 400, "bad_encoding");
    must_fail(http("PUT", &u("/v1/kv/k"), Some(r#"{"value": "*", "encoding": "base64"}"#)), 400, "bad_encoding");
    // Sizes.
    let long_key = "k".repeat(1025);
    must_fail(http("PUT", &u(&format!("/v1/kv/{long_key}")), Some(r#"{"value": "v"}"#)), 400, "key_size");
    let big = format!(r#"{{"value": "{}"}}"#, "v".repeat((1 << 20) + 1));
    must_fail(http("PUT", &u("/v1/kv/big"), Some(&big)), 413, "value_too_large");
    let huge = format!(r#"{{"value": "{}"}}"#, "v".repeat(5 << 20));
    must_fail(http("PUT", &u("/v1/kv/huge"), Some(&huge)), 413, "frame_too_large");
    // Malformed requests.
    must_fail(http("PUT", &u("/v1/kv/k"), Some("{not json")), 400, "bad_request");
    must_fail(http("PUT", &u("/v1/kv/k"), Some(r#"{"value": "v", "ttl": 5}"#)), 400, "bad_request");
    must_fail(http("PUT", &u("/v1/kv/k"), Some(r#"{"mode": "put"}"#)), 400, "bad_request");
    must_fail(http("GET", &u("/v1/kv/k?encoding=hex"), None), 400, "bad_request");
    must_fail(http("GET", &u("/v1/kv/k?colour=red"), None), 400, "bad_request");
    must_fail(http("POST", &u("/v1/kv/k"), None), 405, "method_not_allowed");
    must_fail(http("GET", &u("/v2/nothing"), None), 404, "not_found");
    // Scans across both regions (split at "m"), page by page with tokens.
    let keys: Vec<String> = (0..60).map(|i| format!("{}{i:02}", if i < 30 { "f" } else { "t" })).collect();
    for k in &keys {
        assert_eq!(http("PUT", &u(&format!("/v1/kv/{k}")), Some(r#"{"value": "s"}"#)).0, 200);
    }
    let mut seen = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let t = token.as_ref().map(|t| format!("&token={t}")).unwrap_or_default();
        let (s, b) = http("GET", &u(&format!("/v1/scan?start=f&end=u&limit=17{t}")), None);
        assert_eq!(s, 200, "{b}");
        let page = json(&b);
        seen.extend(
            page["items"].as_array().expect("items").iter().map(|i| i["key"].as_str().expect("key").to_string()),
        );
        match page["token"].as_str() {
            Some(t) => token = Some(t.to_string()),
            None => break,
        }
    }
    assert_eq!(seen, keys, "every key once, in order, across the two regions");
    must_fail(http("GET", &u("/v1/scan?token=AAAA"), None), 400, "bad_token");
    must_fail(http("GET", &u("/v1/scan?limit=10001"), None), 400, "too_many_ops");
    must_fail(http("GET", &u("/v1/scan?limit=0"), None), 400, "bad_request");
    // Batches: atomic within a region; across regions only when asked not to be.
    let one = r#"{"ops": [{"op": "put", "key": "b1", "value": "1"}, {"op": "delete", "key": "f00"}]}"#;
    assert_eq!(http("POST", &u("/v1/batch"), Some(one)).0, 200);
    must_fail(http("GET", &u("/v1/kv/f00"), None), 404, "key_not_found");
    let across = r#"{"ops": [{"op": "put", "key": "b2", "value": "1"}, {"op": "put", "key": "z2", "value": "1"}]}"#;
    must_fail(http("POST", &u("/v1/batch"), Some(across)), 400, "unsupported");
    must_fail(http("GET", &u("/v1/kv/b2"), None), 404, "key_not_found");
    let split = r#"{"ops": [{"op": "put", "key": "b2", "value": "1"}, {"op": "put", "key": "z2", "value": "1"}], "atomic": false}"#;
    assert_eq!(http("POST", &u("/v1/batch"), Some(split)).0, 200);
    assert_eq!(http("GET", &u("/v1/kv/z2"), None).0, 200);
    must_fail(http("POST", &u("/v1/batch"), Some(r#"{"ops": []}"#)), 400, "too_many_ops");
    must_fail(http("POST", &u("/v1/batch"), Some(r#"{"ops": [{"op": "put", "key": "x"}]}"#)), 400, "bad_request");
    let insert_existing =
        r#"{"ops": [{"op": "put", "key": "b3", "value": "1"}, {"op": "insert", "key": "b1", "value": "2"}]}"#;
    must_fail(http("POST", &u("/v1/batch"), Some(insert_existing)), 409, "key_exists");
    must_fail(http("GET", &u("/v1/kv/b3"), None), 404, "key_not_found");
    // Atomics.
    let add = r#"{"op": "fetch_add", "key": "n", "delta": 5}"#;
    assert_eq!(json(&http("POST", &u("/v1/atomic"), Some(add)).1)["old"], 0);
    assert_eq!(json(&http("POST", &u("/v1/atomic"), Some(add)).1)["old"], 5);
    let cas = r#"{"op": "compare_and_swap", "key": "c", "expected": null, "new": "one"}"#;
    let b = json(&http("POST", &u("/v1/atomic"), Some(cas)).1);
    assert_eq!((b["swapped"].as_bool(), b["current"].is_null()), (Some(true), true), "{b}");
    let b = json(&http("POST", &u("/v1/atomic"), Some(cas)).1);
    assert_eq!((b["swapped"].as_bool(), b["current"].as_str()), (Some(false), Some("one")), "{b}");
    must_fail(
        http("POST", &u("/v1/atomic"), Some(r#"{"op": "fetch_add", "key": "c", "delta": 1}"#)),
        409,
        "type_mismatch",
    );
    must_fail(http("POST", &u("/v1/atomic"), Some(r#"{"op": "fetch_add", "key": "n"}"#)), 400, "bad_request");
    must_fail(http("POST", &u("/v1/atomic"), Some(r#"{"op": "explode", "key": "n"}"#)), 400, "bad_request");
    // Health, metrics and the OpenAPI document.
    assert_eq!(http("GET", &u("/healthz"), None).0, 200);
    assert_eq!(http("GET", &u("/readyz"), None).0, 200);
    let (s, m) = http("GET", &u("/metrics"), None);
    assert!(s == 200 && m.contains("dpukv_gateway_request_duration_seconds_bucket"), "{m}");
    assert!(m.contains("frontend=\"http\"") && m.contains("op=\"scan\""), "{m}");
    let (s, doc) = http("GET", &u("/v1/openapi.json"), None);
    let doc = json(&doc);
    assert_eq!(s, 200);
    for p in ["/v1/kv/{key}", "/v1/scan", "/v1/batch", "/v1/atomic"] {
        assert!(doc["paths"][p].is_object(), "the OpenAPI document has {p}");
    }
    assert!(doc["components"]["schemas"]["ErrorBody"].is_object());
}

/// `redis-cli`, with the arguments given, at the gateway; its output.
fn redis(gw: &Gateway, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", gw.resp_port()])
        .args(args)
        .output()
        .expect("redis-cli runs (Debian's redis-tools; scripts/test.sh installs it)");
    assert!(out.status.success(), "redis-cli {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim_end().to_string()
}

/// `redis-cli` reading commands from its input (one connection, in order).
fn redis_script(gw: &Gateway, script: &str) -> String {
    redis_script_at(gw.resp_port(), script)
}

#[test]
fn redis_cli_works_against_the_gateway() {
    let etcd = Etcd::start().expect("etcd");
    let (_nodes, gw) = cluster(&etcd);
    assert_eq!(redis(&gw, &["PING"]), "PONG");
    assert_eq!(redis(&gw, &["SET", "greeting", "hello"]), "OK");
    assert_eq!(redis(&gw, &["GET", "greeting"]), "hello");
    // The connection's read mode (hot-key replicas): set, shown, used, refused when unknown.
    assert_eq!(
        redis_script(
            &gw,
            "CONSISTENCY\nCONSISTENCY bounded:50\nCONSISTENCY\nGET greeting\nREADONLY\nCONSISTENCY\nGET greeting\nREADWRITE\nCONSISTENCY\nCONSISTENCY sometimes\n"
        ),
        "linearizable\nOK\nbounded:50\nhello\nOK\ninterleaved\nhello\nOK\nlinearizable\nERR consistency must be linearizable, bounded:MS, extended or interleaved"
    );
    assert_eq!(redis(&gw, &["SET", "greeting", "other", "NX"]), "");
    assert_eq!(redis(&gw, &["SET", "absent", "v", "XX"]), "");
    assert_eq!(redis(&gw, &["GET", "absent"]), "");
    assert_eq!(redis(&gw, &["SET", "greeting", "hi", "GET"]), "hello");
    assert_eq!(redis(&gw, &["GETSET", "greeting", "hey"]), "hi");
    assert_eq!(redis(&gw, &["SETNX", "greeting", "x"]), "0");
    assert_eq!(redis(&gw, &["EXISTS", "greeting", "absent", "greeting"]), "2");
    assert_eq!(redis(&gw, &["MSET", "a", "1", "zz", "2"]), "OK");
    assert_eq!(redis(&gw, &["MGET", "a", "nothing", "zz"]), "1\n\n2");
    assert_eq!(redis(&gw, &["DEL", "a", "zz", "nothing"]), "2");
    assert_eq!(redis(&gw, &["INCR", "counter"]), "1");
    assert_eq!(redis(&gw, &["INCRBY", "counter", "41"]), "42");
    assert_eq!(redis(&gw, &["DECRBY", "counter", "2"]), "40");
    assert_eq!(redis(&gw, &["DECR", "counter"]), "39");
    assert_eq!(redis(&gw, &["GET", "counter"]), "39", "counters are decimal text, as in Redis");
    assert!(redis(&gw, &["INCR", "greeting"]).contains("not an integer"));
    assert_eq!(redis(&gw, &["TYPE", "greeting"]), "string");
    assert_eq!(redis(&gw, &["STRLEN", "greeting"]), "3");
    assert!(redis(&gw, &["SET", "k", "v", "EX", "10"]).contains("not supported"));
    assert!(redis(&gw, &["GET"]).contains("wrong number of arguments for 'get'"));
    // An unknown command is an error and the connection goes on.
    let out = redis_script(&gw, "FLUBBER x y\nPING\nGET greeting\n");
    assert!(out.starts_with("ERR unknown command 'FLUBBER', with args beginning with: 'x' 'y'"), "{out}");
    assert!(out.ends_with("PONG\nhey"), "{out}");
    // A connection's name is its own (it was dropped: GETNAME answered nil after SETNAME), and
    // every connection has an id of its own (it was 1 on all of them).
    assert_eq!(
        redis_script(
            &gw,
            "CLIENT GETNAME\nCLIENT SETNAME app-1\nCLIENT GETNAME\nCLIENT SETNAME \"bad name\"\nCLIENT GETNAME\n"
        ),
        // (redis-cli prints an empty line after an error.)
        "\nOK\napp-1\nERR Client names cannot contain spaces, newlines or special characters.\n\napp-1"
    );
    assert_eq!(redis(&gw, &["CLIENT", "GETNAME"]), "", "a new connection has no name");
    let ids: Vec<u64> = (0..3).map(|_| redis(&gw, &["CLIENT", "ID"]).parse().expect("an integer")).collect();
    assert!(ids.windows(2).all(|w| w[0] != w[1]) && !ids.contains(&0), "CLIENT ID per connection: {ids:?}");
    // What redis-cli and redis-benchmark ask at start.
    assert!(redis(&gw, &["INFO"]).contains("redis_version:"));
    assert_eq!(redis(&gw, &["CONFIG", "GET", "appendonly"]), "appendonly\nno");
    assert!(redis(&gw, &["HELLO", "2"]).contains("dpukv"));
    // SCAN to the end: every key of the pattern once, in key order, across both regions.
    let keys: Vec<String> = (0..300).map(|i| format!("s:{}{i:03}", if i % 2 == 0 { "a" } else { "x" })).collect();
    let mut mset = vec!["MSET"];
    for k in &keys {
        mset.push(k);
        mset.push("v");
    }
    assert_eq!(redis(&gw, &mset), "OK");
    let listed = redis(&gw, &["--scan", "--pattern", "s:*"]);
    let mut want = keys.clone();
    want.sort();
    assert_eq!(listed.lines().collect::<Vec<_>>(), want, "redis-cli --scan lists every key once, in order");
    let odd = redis(&gw, &["--scan", "--pattern", "s:x*"]);
    assert_eq!(odd.lines().count(), 150);
    // A cursor the gateway never gave is refused.
    assert!(redis(&gw, &["SCAN", "12345"]).contains("invalid cursor"));
}

/// A counter of the nodes' hosts so far, summed: `dpukv_host_rounds_total` (write rounds),
/// `dpukv_host_writes_total` (write requests: a batch is one), `dpukv_host_atomics_total`.
fn host_total(nodes: &[ClusterNode], counter: &str) -> u64 {
    nodes.iter().map(|n| n.metric(counter).expect("metrics").expect("exposed") as u64).sum()
}

/// 10,000 pipelined `INCR`s of one key took 11.6–16.4 s: each was a read and a compare-and-swap,
/// and each waited for the previous one's sync (a command on a key already in the group waited
/// for the group). A run of increments of one key in a pipeline is now one `add_text`, applied in
/// one round of the key's primary and synced once; every reply still comes in order, after the
/// write is durable.
#[test]
fn pipelined_increments_of_one_key_share_a_round() {
    use std::io::{Read, Write};
    let etcd = Etcd::start().expect("etcd");
    let (nodes, gw) = cluster(&etcd);
    assert_eq!(redis(&gw, &["SET", "other", "10"]), "OK");
    let rounds_before = host_total(&nodes, "dpukv_host_rounds_total");
    // One write: 10,000 increments of "hot", an INCRBY of another key and a DECRBY in the middle.
    const N: usize = 10_000;
    let mut script = String::new();
    let mut want = Vec::new();
    let (mut hot, mut other) = (0i64, 10i64);
    for i in 0..N {
        if i == N / 2 {
            script.push_str("INCRBY other 5\r\nDECRBY hot 3\r\n");
            other += 5;
            hot -= 3;
            want.push(other);
            want.push(hot);
        }
        script.push_str("INCR hot\r\n");
        hot += 1;
        want.push(hot);
    }
    script.push_str("GET hot\r\n");
    let mut conn = std::net::TcpStream::connect(format!("127.0.0.1:{}", gw.resp_port())).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(120))).expect("timeout");
    let began = std::time::Instant::now();
    conn.write_all(script.as_bytes()).expect("write");
    let mut got = Vec::new();
    let mut buf = vec![0; 1 << 16];
    let want_text: String =
        want.iter().map(|n| format!(":{n}\r\n")).chain([format!("${}\r\n{hot}\r\n", hot.to_string().len())]).collect();
    while got.len() < want_text.len() {
        let n = conn.read(&mut buf).expect("read");
        assert!(n > 0, "the gateway closed the connection");
        got.extend_from_slice(&buf[..n]);
    }
    assert_eq!(String::from_utf8_lossy(&got), want_text, "every reply, in order");
    let took = began.elapsed();
    let rounds = host_total(&nodes, "dpukv_host_rounds_total") - rounds_before;
    eprintln!("{} pipelined increments: {took:?}, {rounds} write rounds", N + 2);
    assert!(rounds < 400, "{} increments took {rounds} write rounds", N + 2);
    assert_eq!(redis(&gw, &["GET", "other"]), "15");
    // Overflow and a value that is not a counter, in one pipeline, as Redis answers them.
    assert_eq!(redis(&gw, &["SET", "big", "9223372036854775806"]), "OK");
    let out = redis_script(&gw, "INCR big\nINCR big\nDECR big\nINCR greeting2\nSET s x\nINCR s\nINCRBY big x\n");
    // (redis-cli prints an empty line after an error when it reads commands from its input.)
    assert_eq!(
        out.lines().filter(|l| !l.is_empty()).collect::<Vec<_>>(),
        [
            "9223372036854775807",
            "ERR increment or decrement would overflow",
            "9223372036854775806",
            "1",
            "OK",
            "ERR value is not an integer or out of range",
            "ERR value is not an integer or out of range"
        ]
    );
}

/// Sends `script` (RESP commands) in one write and reads until `want` came back; the replies.
fn pipeline(gw: &Gateway, script: &str, want: usize) -> String {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(format!("127.0.0.1:{}", gw.resp_port())).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(120))).expect("timeout");
    conn.write_all(script.as_bytes()).expect("write");
    let mut got = Vec::new();
    let mut buf = vec![0; 1 << 16];
    while got.len() < want {
        let n = conn.read(&mut buf).expect("read");
        assert!(n > 0, "the gateway closed the connection after {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).to_string()
}

/// Pipelined plain `SET`s of a region were each a request, a write and a sync of their own: a
/// pipeline group's `SET`s of distinct keys of one region are now one atomic batch (one request
/// to the region's primary). Every reply still comes in order; a `SET` of a key already in the
/// group, a `GET` of one, `SET ... NX` and a `SET` with an option the gateway refuses keep their
/// own answers; the keys of both regions read back as written.
#[test]
fn pipelined_sets_of_a_region_share_one_write() {
    let etcd = Etcd::start().expect("etcd");
    let (nodes, gw) = cluster(&etcd);
    assert_eq!(redis(&gw, &["SET", "warm", "1"]), "OK");
    assert_eq!(redis(&gw, &["SET", "zz-taken", "old"]), "OK");
    let before = host_total(&nodes, "dpukv_host_writes_total");
    const N: usize = 2_000;
    let (mut script, mut want) = (String::new(), String::new());
    let value = |i: usize| format!("value-{i}-{}", "x".repeat(i % 97));
    for i in 0..N {
        // Keys of both regions (split at "m"), interleaved.
        let key = if i % 2 == 0 { format!("a-{i:05}") } else { format!("z-{i:05}") };
        let v = value(i);
        script.push_str(&format!("*3\r\n$3\r\nSET\r\n${}\r\n{key}\r\n${}\r\n{v}\r\n", key.len(), v.len()));
        want.push_str("+OK\r\n");
        if i % 500 == 250 {
            // The same key again, then read: in order.
            script.push_str(&format!("SET {key} again\r\nGET {key}\r\n"));
            want.push_str("+OK\r\n$5\r\nagain\r\n");
        }
        if i == 1_000 {
            script.push_str("SET zz-taken new NX\r\nSET exp 1 EX 10\r\n");
            want.push_str("$-1\r\n-ERR expiry (EX, PX, EXAT, PXAT, KEEPTTL) is not supported by dpukv\r\n");
        }
    }
    let got = pipeline(&gw, &script, want.len());
    assert_eq!(got, want, "every reply, in order");
    let writes = host_total(&nodes, "dpukv_host_writes_total") - before;
    eprintln!("{N} pipelined SETs: {writes} write requests at the hosts");
    assert!(writes < (N / 10) as u64, "{N} pipelined SETs took {writes} write requests");
    // Read back through another pipeline.
    let (mut gets, mut values) = (String::new(), String::new());
    for i in 0..N {
        let key = if i % 2 == 0 { format!("a-{i:05}") } else { format!("z-{i:05}") };
        gets.push_str(&format!("GET {key}\r\n"));
        let v = if i % 500 == 250 { "again".to_string() } else { value(i) };
        values.push_str(&format!("${}\r\n{v}\r\n", v.len()));
    }
    assert_eq!(pipeline(&gw, &gets, values.len()), values);
    assert_eq!(redis(&gw, &["GET", "zz-taken"]), "old");
}

/// Pipelined `INCR`s of distinct keys were each a request and an atomic of their own at the
/// region's primary (INCR -P 16 at 0.21x Redis): a pipeline group's increments of keys of one
/// region are now one `add_texts` (one request, one write). Every reply still comes in order and
/// as Redis gives it: a key incremented again continues from its last value, an overflow is that
/// increment's error alone, and a key that is not a counter is refused alone while the others of
/// its group count; the counters of both regions read back as counted.
#[test]
fn pipelined_increments_of_a_region_share_one_write() {
    let etcd = Etcd::start().expect("etcd");
    let (nodes, gw) = cluster(&etcd);
    assert_eq!(redis(&gw, &["SET", "a-text", "abc"]), "OK");
    assert_eq!(redis(&gw, &["SET", "z-big", "9223372036854775806"]), "OK");
    let before = host_total(&nodes, "dpukv_host_atomics_total");
    const N: usize = 2_000;
    let mut counters = std::collections::BTreeMap::<String, i64>::new();
    let (mut script, mut want) = (String::new(), String::new());
    for i in 0..N {
        // Keys of both regions (split at "m"), interleaved; every fifth a key seen before.
        let key = if i % 2 == 0 { format!("a-{:05}", i % 700) } else { format!("z-{:05}", i % 900) };
        let delta = (i % 7) as i64 - 3;
        script.push_str(&format!("INCRBY {key} {delta}\r\n"));
        let n = counters.entry(key).or_default();
        *n += delta;
        want.push_str(&format!(":{n}\r\n"));
        if i % 400 == 200 {
            script.push_str("INCR a-text\r\nINCR z-big\r\n");
            want.push_str("-ERR value is not an integer or out of range\r\n");
            want.push_str(if i == 200 {
                ":9223372036854775807\r\n"
            } else {
                "-ERR increment or decrement would overflow\r\n"
            });
        }
    }
    let got = pipeline(&gw, &script, want.len());
    assert_eq!(got, want, "every reply, in order");
    let requests = host_total(&nodes, "dpukv_host_atomics_total") - before;
    eprintln!("{N} pipelined increments: {requests} atomic requests at the hosts");
    // (At most 28 keys go in one request; a group holding "a-text" is sent again key by key.)
    assert!(requests < (N / 5) as u64, "{N} pipelined increments took {requests} atomic requests");
    let (mut gets, mut values) = (String::new(), String::new());
    for (k, n) in &counters {
        gets.push_str(&format!("GET {k}\r\n"));
        values.push_str(&format!("${}\r\n{n}\r\n", n.to_string().len()));
    }
    assert_eq!(pipeline(&gw, &gets, values.len()), values);
    assert_eq!(redis(&gw, &["GET", "a-text"]), "abc");
}

/// A gateway seeded with fabric endpoints (issue 30) reaches every device over libfabric: the
/// nodes' hosts register their devices' endpoints, the gateway's router dials them, and its
/// front ends serve keys of both regions — with none of its connections to a data port.
#[test]
fn a_gateway_seeded_with_fabric_endpoints_forwards_over_the_fabric() {
    let etcd = Etcd::start().expect("etcd");
    let args = ["--lease-ttl-ms", "1000", "--replication-factor", "3", "--split-keys", "m"];
    let (nodes, fabrics): (Vec<ClusterNode>, Vec<String>) =
        (1..=3).map(|id| ClusterNode::start_with_fabric(id, "gwfab", &etcd.url(), &args).expect("node")).unzip();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(60),
        |m| {
            m.regions.len() == 2
                && m.regions.iter().all(|r| r.primary != 0 && r.backups.len() == 2)
                && m.nodes.iter().all(|n| !n.fabric.is_empty())
        },
    ));
    let seeds: Vec<&str> = fabrics.iter().map(String::as_str).collect();
    let gw = Gateway::start(&seeds, &[]).expect("gateway");
    for k in ["apple", "zebra", "kiwi", "yak"] {
        assert_eq!(redis(&gw, &["SET", k, &format!("v-{k}")]), "OK");
    }
    for k in ["apple", "zebra", "kiwi", "yak"] {
        assert_eq!(redis(&gw, &["GET", k]), format!("v-{k}"));
    }
    let devices: Vec<String> = nodes.iter().map(|n| n.device.clone()).collect();
    let to_fabric = dpukv_e2e::procs::connections_to(gw.pid(), &fabrics);
    let to_data = dpukv_e2e::procs::connections_to(gw.pid(), &devices);
    assert!(to_fabric > 0 && to_data == 0, "{to_fabric} connections to fabric endpoints, {to_data} to data ports");
}

/// `redis-cli` with extra flags before the command.
fn redis_as(gw: &Gateway, flags: &[&str], args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", gw.resp_port()])
        .args(flags)
        .args(args)
        .env_remove("REDISCLI_AUTH") // no password unless given by a flag
        .output()
        .expect("redis-cli runs");
    // (redis-cli reports a failed AUTH on stderr.)
    let err = String::from_utf8_lossy(&out.stderr);
    format!(
        "{}{}",
        err.lines().filter(|l| !l.contains("Using a password")).collect::<Vec<_>>().join("\n"),
        String::from_utf8_lossy(&out.stdout)
    )
    .trim()
    .to_string()
}

/// `dpukv` (the binary protocol) at the gateway; its output and whether it succeeded.
fn cli(gw: &Gateway, token: Option<&str>, args: &[&str]) -> (bool, String) {
    let mut c = Command::new(dpukv_e2e::procs::bin_dir().expect("binaries").join("dpukv"));
    c.args(["--endpoint", &gw.binary]).args(args).env_remove("DPUKV_TOKEN");
    if let Some(t) = token {
        c.env("DPUKV_TOKEN", t);
    }
    let out = c.output().expect("dpukv runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

const TOKENS: &str = r#"{"tokens": [
    {"name": "app", "token": "app-secret-000000", "grants": [{"prefix": "app/", "allow": ["read", "write"]}]},
    {"name": "reader", "token": "reader-secret-000", "grants": [{"prefix": "", "allow": ["read"]}]},
    {"name": "admin", "token": "admin-secret-0000", "grants": [{"prefix": "", "allow": ["admin"]}]}
]}"#;

/// Tokens with per-prefix grants, through all three front ends: a request without a valid token
/// is refused (401, NOAUTH, `unauthorized`), one the token does not cover is refused (403,
/// NOPERM, `forbidden`) and changes nothing, and the token file is re-read when it changes.
#[test]
fn tokens_grant_per_prefix_through_every_front_end() {
    let etcd = Etcd::start().expect("etcd");
    let args = ["--lease-ttl-ms", "1000", "--replication-factor", "3", "--split-keys", "m"];
    let nodes: Vec<ClusterNode> =
        (1..=3).map(|id| ClusterNode::start(id, "gw", &etcd.url(), &args).expect("node")).collect();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(60),
        |m| m.regions.len() == 2 && m.regions.iter().all(|r| r.primary != 0 && r.backups.len() == 2),
    ));
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("tokens.json");
    std::fs::write(&file, TOKENS).expect("write tokens");
    let seeds: Vec<&str> = nodes.iter().map(|n| n.device.as_str()).collect();
    let gw = Gateway::start(&seeds, &["--tokens", file.to_str().expect("utf-8 path")]).expect("gateway");
    let u = |p: &str| gw.url(p);
    let bearer = |t: &str| format!("authorization: Bearer {t}");
    let put = r#"{"value": "v"}"#;
    // HTTP: no token, a wrong token, a token lacking the grant; health and the API document are open.
    let (s, b) = http("PUT", &u("/v1/kv/app/a"), Some(put));
    assert_eq!((s, json(&b)["code"].as_str()), (401, Some("unauthorized")), "{b}");
    must_fail(http_with("GET", &u("/v1/kv/app/a"), None, &[&bearer("nope")]), 401, "unauthorized");
    must_fail(http_with("PUT", &u("/v1/kv/app/a"), Some(put), &[&bearer("reader-secret-000")]), 403, "forbidden");
    assert_eq!(http_with("PUT", &u("/v1/kv/app/a"), Some(put), &[&bearer("app-secret-000000")]).0, 200);
    must_fail(http_with("PUT", &u("/v1/kv/zoo"), Some(put), &[&bearer("app-secret-000000")]), 403, "forbidden");
    must_fail(http_with("GET", &u("/v1/kv/zoo"), None, &[&bearer("admin-secret-0000")]), 404, "key_not_found");
    must_fail(
        http_with("GET", &u("/v1/scan?start=app/&end=b"), None, &[&bearer("app-secret-000000")]),
        403,
        "forbidden",
    );
    assert_eq!(http_with("GET", &u("/v1/scan?start=app/&end=app/z"), None, &[&bearer("app-secret-000000")]).0, 200);
    let batch = r#"{"ops": [{"op": "put", "key": "app/b", "value": "1"}, {"op": "put", "key": "x", "value": "1"}], "atomic": false}"#;
    must_fail(http_with("POST", &u("/v1/batch"), Some(batch), &[&bearer("app-secret-000000")]), 403, "forbidden");
    must_fail(http_with("GET", &u("/v1/kv/app/b"), None, &[&bearer("reader-secret-000")]), 404, "key_not_found");
    assert_eq!(http("GET", &u("/healthz"), None).0, 200);
    assert_eq!(http("GET", &u("/v1/openapi.json"), None).0, 200);
    // RESP.
    assert!(redis_as(&gw, &[], &["GET", "app/a"]).contains("NOAUTH"));
    assert!(redis_as(&gw, &["--user", "app", "--pass", "wrong"], &["GET", "app/a"]).contains("WRONGPASS"));
    assert_eq!(redis_as(&gw, &["--user", "app", "--pass", "app-secret-000000"], &["GET", "app/a"]), "v");
    assert!(redis_as(&gw, &["--user", "app", "--pass", "app-secret-000000"], &["SET", "zoo", "1"]).contains("NOPERM"));
    assert!(redis_as(&gw, &["--pass", "reader-secret-000"], &["INCR", "app/n"]).contains("NOPERM"));
    assert_eq!(redis_as(&gw, &["--pass", "admin-secret-0000"], &["GET", "zoo"]), "", "nothing was written");
    assert_eq!(redis_as(&gw, &["--pass", "app-secret-000000"], &["--scan", "--pattern", "app/*"]), "app/a");
    // The binary protocol: an auth request on each connection's first frame.
    let (ok, out) = cli(&gw, None, &["get", "app/a"]);
    assert!(!ok && out.contains("unauthorized"), "{out}");
    let (ok, out) = cli(&gw, Some("reader-secret-000"), &["put", "app/c", "x"]);
    assert!(!ok && out.contains("forbidden"), "{out}");
    assert!(cli(&gw, Some("app-secret-000000"), &["put", "app/c", "x"]).0);
    assert_eq!(cli(&gw, Some("reader-secret-000"), &["get", "app/c"]).1.trim(), "x");
    let (ok, out) = cli(&gw, Some("app-secret-000000"), &["scan", "a", "z"]);
    assert!(!ok && out.contains("forbidden"), "{out}");
    // The region map shows a token only the boundaries it may read: "m" is outside app/.
    let (ok, out) = cli(&gw, Some("admin-secret-0000"), &["regions"]);
    assert!(ok && out.lines().count() == 2, "{out}");
    let (ok, out) = cli(&gw, Some("app-secret-000000"), &["regions"]);
    assert!(ok && out.lines().count() == 1 && !out.contains("\tm\t"), "{out}");
    // The token file is re-read when it changes: a new token works within a few seconds, a
    // removed one stops working.
    std::fs::write(&file, TOKENS.replace("app-secret-000000", "app-secret-000000-2")).expect("rewrite tokens");
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while http_with("GET", &u("/v1/kv/app/a"), None, &[&bearer("app-secret-000000-2")]).0 != 200 {
        assert!(std::time::Instant::now() < deadline, "the new token never took effect");
        std::thread::sleep(Duration::from_millis(200));
    }
    must_fail(http_with("GET", &u("/v1/kv/app/a"), None, &[&bearer("app-secret-000000")]), 401, "unauthorized");
}

/// The `dpukv_gateway_scan_parts_total` a gateway reports on its HTTP front end.
fn scan_parts(gw: &Gateway) -> f64 {
    let (s, body) = http("GET", &gw.url("/metrics"), None);
    assert_eq!(s, 200);
    body.lines()
        .find_map(|l| l.strip_prefix("dpukv_gateway_scan_parts_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no scan_parts metric in {body}"))
}

/// A scan of 10,000 items inside one region is cut at the region's pivots and read in pieces
/// in parallel: the same items as a gateway that reads it whole and as the device itself, over
/// many pieces, and pages continue with tokens as before.
#[test]
fn long_scans_are_cut_inside_a_region_and_read_the_same() {
    use dpukv_client::Client;
    use dpukv_proto::WriteOp;
    let pod = dpukv_e2e::procs::Pod::start(&["--fsync", "never"]).expect("pod");
    let split = Gateway::start(&[&pod.addr], &[]).expect("gateway");
    let whole = Gateway::start(&[&pod.addr], &["--scan-split-min", "0"]).expect("gateway");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let direct = Client::connect(&pod.addr, 1).await.expect("connect");
        for chunk in (0..30_000u32).collect::<Vec<_>>().chunks(500) {
            let ops = chunk
                .iter()
                .map(|i| WriteOp::Put { key: format!("item{i:06}").into_bytes(), value: format!("v{i}").into_bytes() })
                .collect();
            direct.batch(ops).await.expect("load");
        }
        let (lo, hi) = (b"item005000".as_slice(), b"item024999".as_slice());
        let expected = direct.scan(lo, hi, 10_000).await.expect("direct scan");
        assert_eq!(expected.len(), 10_000);
        let before = (scan_parts(&split), scan_parts(&whole));
        let via_split = Client::connect(&split.binary, 1).await.expect("connect");
        let via_whole = Client::connect(&whole.binary, 1).await.expect("connect");
        assert_eq!(via_split.scan(lo, hi, 10_000).await.expect("scan"), expected, "cut into pieces");
        assert_eq!(via_whole.scan(lo, hi, 10_000).await.expect("scan"), expected, "whole");
        let pieces = scan_parts(&split) - before.0;
        assert!(pieces >= 4.0, "the long scan was read in {pieces} parts");
        assert_eq!(scan_parts(&whole) - before.1, 1.0, "read whole: one part");
        // The second page, through the token, and a bounded range of fewer items.
        let all = via_split.scan(lo, hi, 20_000).await.expect("two pages");
        assert_eq!(all, direct.scan(lo, hi, 20_000).await.expect("direct"));
        assert_eq!(all.len(), 20_000);
        // Open-ended pages: the gateway learns what a gap between pivots holds and cuts a page
        // into about four pieces of its share — not the rest of the region into pieces, nor
        // reading ahead past the page.
        let before = scan_parts(&split);
        for start in ["item001000", "item007000", "item012000", "item015000"] {
            let page = via_split.scan(start.as_bytes(), b"", 10_000).await.expect("scan");
            assert_eq!(page, direct.scan(start.as_bytes(), b"", 10_000).await.expect("direct"));
        }
        let per_page = (scan_parts(&split) - before) / 4.0;
        assert!((4.0..=5.5).contains(&per_page), "{per_page} parts per 10,000-item page");
        // HTTP too.
        let (s, body) = http("GET", &split.url("/v1/scan?start=item000100&end=item002100&limit=2000"), None);
        assert_eq!(s, 200, "{body}");
        assert_eq!(json(&body)["items"].as_array().map(Vec::len), Some(2000));
    });
}

/// `redis-cli -p PORT ARGS...` with a deadline of its own (a paused node must not hang the
/// test); its output, or None if it did not answer in time.
fn redis_at(port: &str, args: &[&str], within: Duration) -> Option<String> {
    let out = Command::new("timeout")
        .arg(format!("{}", within.as_secs_f64()))
        .args(["redis-cli", "-h", "127.0.0.1", "-p", port])
        .args(args)
        .output()
        .expect("redis-cli runs");
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim_end().to_string())
}

/// `redis-cli -p PORT` reading commands from its input (one connection, in order).
fn redis_script_at(port: &str, script: &str) -> String {
    use std::io::Write;
    let mut child = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", port])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("redis-cli runs");
    child.stdin.take().expect("stdin").write_all(script.as_bytes()).expect("write");
    let out = child.wait_with_output().expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).trim_end().to_string()
}

/// The front door in each device's process (`dpukv-dpu --resp/--http`): a node's own regions
/// are served in the device's process with no second hop — they still answer with every other
/// node paused —, keys of regions other nodes lead are forwarded to them, HTTP works the same,
/// and once the primary of a region is killed its keys answer again through another node's
/// front door after the failover, with every acknowledged write there.
#[test]
fn device_front_doors_serve_their_regions_in_process_and_forward_the_rest() {
    let etcd = Etcd::start().expect("etcd");
    let args = ["--lease-ttl-ms", "1000", "--replication-factor", "3", "--split-keys", "m"];
    let mut fronts = Vec::new();
    let mut admins = Vec::new();
    let mut nodes: Vec<ClusterNode> = Vec::new();
    let port = || format!("127.0.0.1:{}", dpukv_e2e::procs::free_port().expect("port"));
    for id in 1..=3 {
        let (resp, http, admin) = (port(), port(), port());
        // Node 3's front door runs on two threads sharing its ports.
        let threads = if id == 3 { "2" } else { "1" };
        let env = [
            ("DPUKV_DEVICE_RESP", resp.as_str()),
            ("DPUKV_DEVICE_HTTP", http.as_str()),
            ("DPUKV_DEVICE_ADMIN", admin.as_str()),
            ("DPUKV_FRONT_THREADS", threads),
        ];
        nodes.push(ClusterNode::start_with(id, "front", &etcd.url(), &args, &[], &env).expect("node"));
        fronts.push((resp.rsplit(':').next().expect("port").to_string(), http));
        admins.push(admin);
    }
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let map = rt.block_on(must_see_map(
        &nodes,
        |_| true,
        Duration::from_secs(60),
        |m| m.regions.len() == 2 && m.regions.iter().all(|r| r.primary != 0 && r.backups.len() == 2),
    ));
    // Region 0 holds keys below "m", region 1 the rest; each has a primary.
    let (low, high) = (map.regions[0].primary, map.regions[1].primary);
    let key_of = |node: u32| if node == low { "a-key" } else { "z-key" };
    let wait = Duration::from_secs(20);
    // Every front door answers every key (its own regions in process, the others forwarded),
    // and sees what the others wrote.
    for (i, (port, http_addr)) in fronts.iter().enumerate() {
        for k in ["a-key", "z-key"] {
            let v = format!("from-{i}");
            assert_eq!(redis_at(port, &["SET", k, &v], wait).as_deref(), Some("OK"), "node {}: SET {k}", i + 1);
            for (other, _) in &fronts {
                assert_eq!(redis_at(other, &["GET", k], wait).as_deref(), Some(v.as_str()));
            }
        }
        assert_eq!(redis_at(port, &["INCR", &format!("n{i}")], wait).as_deref(), Some("1"));
        let (status, body) = http("GET", &format!("http://{http_addr}/v1/kv/z-key"), None);
        assert_eq!(status, 200, "{body}");
        assert_eq!(json(&body)["value"], format!("from-{i}"));
    }
    // No second hop: gets of a node's own region through its front door are read in the
    // device's process — counted as reads served, never as requests at its data port.
    let device_metric = |node: u32, sample: &str| -> f64 {
        let (status, body) = http("GET", &format!("http://{}/metrics", admins[node as usize - 1]), None);
        assert_eq!(status, 200);
        body.lines().find_map(|l| l.strip_prefix(sample)?.trim().parse().ok()).unwrap_or(0.0)
    };
    let (served, at_port) =
        ("dpukv_device_reads_served_total ", "dpukv_device_request_duration_seconds_count{op=\"get\"} ");
    let before = (device_metric(low, served), device_metric(low, at_port));
    let own_port = &fronts[low as usize - 1].0;
    let script: String = (0..200).map(|_| "GET a-key\n").collect();
    let out = redis_script_at(own_port, &script);
    assert_eq!(out.lines().filter(|l| *l == "from-2").count(), 200);
    let after = (device_metric(low, served), device_metric(low, at_port));
    assert!(after.0 - before.0 >= 200.0, "the device served the gets: {before:?} -> {after:?}");
    assert!(after.1 - before.1 < 10.0, "none came through its data port: {before:?} -> {after:?}");
    // The front door's own metrics (the gateway's names) are on the device's /metrics: its RESP
    // gets timed, its HTTP requests and its errors counted, its budget shown.
    let resp_gets = device_metric(low, "dpukv_gateway_request_duration_seconds_count{frontend=\"resp\",op=\"get\"} ");
    assert!(resp_gets >= 200.0, "the front door's RESP gets on the device's /metrics: {resp_gets}");
    let (status, body) = http("GET", &format!("http://{}/metrics", admins[low as usize - 1]), None);
    assert_eq!(status, 200);
    for name in [
        "dpukv_gateway_request_duration_seconds_count{frontend=\"http\"",
        "dpukv_gateway_memory_budget_bytes{state=\"total\"}",
        "dpukv_gateway_connections",
    ] {
        assert!(body.contains(name), "{name} missing from the device's /metrics");
    }
    // Node 3's front door runs two threads: a SCAN cursor one gave out is continued on new
    // connections, which the kernel spreads over both (each thread had its own cursors: a
    // continuation landing on the other was "invalid cursor").
    let (three, mut cursor, mut keys) = (&fronts[2].0, "0".to_string(), std::collections::BTreeSet::new());
    for step in 0.. {
        let out = redis_at(three, &["SCAN", &cursor, "COUNT", "1"], wait).expect("SCAN answers");
        assert!(!out.contains("invalid cursor"), "step {step}: cursor {cursor} refused: {out}");
        let mut lines = out.lines();
        cursor = lines.next().expect("a cursor").to_string();
        keys.extend(lines.map(String::from));
        if cursor == "0" || step > 100 {
            break;
        }
    }
    assert_eq!(cursor, "0", "the scan ended");
    assert!(["a-key", "z-key", "n0", "n1", "n2"].iter().all(|k| keys.contains(*k)), "{keys:?}");
    // Gets answered at once and writes that wait for their sync, pipelined on one connection
    // to keys of the node's own region, answer in order and read what came before them.
    let script = "SET b-key p1\nGET b-key\nGET b-key\nSET b-key p2\nGET b-key\nINCR c-key\nGET c-key\nGET b-key\n";
    assert_eq!(redis_script_at(own_port, script), "OK\np1\np1\nOK\np2\n1\n1\np2");
    // With the other two nodes paused, a node's front door still answers gets
    // of the region it leads (linearizable: its host's lease is renewed with etcd, not with
    // them), while a key another node leads cannot be answered.
    let leader = low;
    let front = &fronts[leader as usize - 1].0;
    for n in nodes.iter().filter(|n| n.id != leader) {
        n.signal("STOP", true).expect("pause");
    }
    let own = redis_at(front, &["GET", key_of(leader)], Duration::from_secs(5));
    let elsewhere = (high != leader).then(|| redis_at(front, &["GET", "z-key"], Duration::from_secs(2)));
    for n in nodes.iter().filter(|n| n.id != leader) {
        n.signal("CONT", true).expect("resume");
    }
    assert_eq!(own.as_deref(), Some("from-2"), "the leader's own region is served with the others paused");
    if let Some(e) = elsewhere {
        assert!(e.as_deref().is_none_or(|r| r.starts_with("TRYAGAIN")), "a paused node's key cannot be served: {e:?}");
    }
    // The primary of the upper region dies: through another node's front door its keys answer
    // again after the failover, and the last acknowledged value is there.
    let victim = high;
    let via = &fronts[(victim as usize) % 3].0;
    assert_eq!(redis_at(via, &["SET", "z-key", "before-kill"], wait).as_deref(), Some("OK"));
    nodes[victim as usize - 1].kill();
    let began = std::time::Instant::now();
    let mut got = None;
    while began.elapsed() < Duration::from_secs(30) {
        got = redis_at(via, &["GET", "z-key"], Duration::from_secs(10));
        if got.as_deref() == Some("before-kill") {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(got.as_deref(), Some("before-kill"), "the acknowledged write survives its primary");
    assert_eq!(redis_at(via, &["SET", "z-key", "after-kill"], wait).as_deref(), Some("OK"));
    assert_eq!(redis_at(via, &["GET", "z-key"], wait).as_deref(), Some("after-kill"));
}
