//! The web console in a real browser — headless Chromium driven through chromedriver (W3C
//! WebDriver) — against a real 3-node cluster run by `dpukv local`, with a second gateway that
//! has tokens: every page loads with no console errors, its numbers match the APIs, a token
//! without admin rights sees neither the actions nor the keys it may not read, a SIGKILLed
//! primary shows on the events timeline with its failover time, and a drain started from the
//! page completes. Screenshots of every page go to `target/console-screenshots/`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dpukv_e2e::gateway::Gateway;
use dpukv_e2e::procs::{Proc, bin_dir, cluster_json, free_port};
use dpukv_e2e::webdriver::{self, Browser, http};
use serde_json::Value;

const OPS: &str = "ops-token-0123456789abcdef";
const READER: &str = "reader-token-0123456789ab";

/// `GET path` on `port` with `token`: its JSON (panics unless 200).
fn api(port: u16, path: &str, token: Option<&str>) -> Value {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
    let (status, body) = http(port, "GET", path, &headers, None).expect("request");
    assert_eq!(status, 200, "{path}: {body}");
    serde_json::from_str(&body).expect("JSON")
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit(':').next().and_then(|p| p.parse().ok()).expect("a port")
}

fn wait_until(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !ok() {
        assert!(Instant::now() < deadline, "{what} did not happen within {within:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Opens page `page` and waits until it has rendered its data.
fn open(b: &Browser, base: &str, page: &str) {
    b.goto(&format!("{base}/ui/#{page}")).expect("navigate");
    b.wait_until(&format!("return document.body.dataset.loaded === '{page}'"), Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("page {page}: {e}"));
    b.script("window.scrollTo(0, 0)").expect("scroll");
}

/// The page recorded no errors (script errors, unexpected API answers) and the browser logged
/// none but the expected refusals of the token checks.
fn no_errors(b: &Browser, page: &str) {
    let errors = b.script("return window.dpukvErrors").expect("errors");
    assert_eq!(errors, serde_json::json!([]), "page {page} recorded errors");
    let severe: Vec<_> = b
        .console_log()
        .expect("console log")
        .into_iter()
        .filter(|(level, m)| level == "SEVERE" && !m.contains("status of 401") && !m.contains("status of 403"))
        .collect();
    assert!(severe.is_empty(), "page {page}: the browser logged {severe:?}");
}

fn screenshot(b: &Browser, name: &str) {
    let dir = bin_dir().expect("binaries").join("../console-screenshots");
    std::fs::create_dir_all(&dir).expect("screenshot dir");
    std::fs::write(dir.join(format!("{name}.png")), b.screenshot().expect("screenshot")).expect("write");
}

fn text_of(b: &Browser, selector: &str) -> String {
    let e = b.wait_for(selector, Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e}"));
    b.text(&e).expect("text")
}

/// Types `token` into the token form and waits for the cluster page.
fn log_in(b: &Browser, token: &str) {
    let input = b.wait_for("#token-input", Duration::from_secs(20)).expect("the token form");
    b.wait_until(
        "const i = document.querySelector('#token-input'); return !!i && i.offsetParent !== null",
        Duration::from_secs(10),
    )
    .expect("the token form shows");
    b.type_into(&input, token).expect("type");
    b.click(&b.wait_for("#token-submit", Duration::from_secs(5)).expect("submit")).expect("submit");
}

/// A process stopped (SIGSTOP) until this is dropped (SIGCONT).
struct Paused(u32);

impl Paused {
    fn new(pid: u32) -> Paused {
        let ok = Command::new("kill").args(["-STOP", &pid.to_string()]).status().is_ok_and(|s| s.success());
        assert!(ok, "stopping process {pid}");
        Paused(pid)
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-CONT", &self.0.to_string()]).status();
    }
}

#[test]
fn the_console_shows_the_cluster_its_failover_and_drains_a_node_in_a_real_browser() {
    if !webdriver::available() {
        assert!(std::env::var("CI").is_err(), "CI needs chromium and chromium-driver (scripts/test.sh installs them)");
        eprintln!("skipped: chromium and chromedriver are not installed (apt-get install chromium chromium-driver)");
        return;
    }
    let dir = tempfile::tempdir().expect("dir");
    let http_addr = format!("127.0.0.1:{}", free_port().expect("port"));
    let binary = format!("127.0.0.1:{}", free_port().expect("port"));
    let mut c = Command::new(bin_dir().expect("binaries").join("dpukv"));
    c.args(["local", "--nodes", "3", "--split-keys", "f,m,t", "--lease-ttl-ms", "2000", "--fsync", "never"])
        .args(["--listen", &binary, "--http", &http_addr])
        .arg("--dir")
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let _local = Proc(c.spawn().expect("dpukv local"));
    let cj = cluster_json(dir.path(), Duration::from_secs(60)).expect("cluster.json");
    assert_eq!(cj["gateway"]["console"], format!("http://{http_addr}/ui/"), "cluster.json names the console");
    let local_port = port_of(&http_addr);
    wait_until("the cluster serving", Duration::from_secs(60), || {
        matches!(http(local_port, "GET", "/readyz", &[], None), Ok((200, _)))
            && http(local_port, "PUT", "/v1/kv/user:0", &[], Some(r#"{"value": "v"}"#)).is_ok_and(|(s, _)| s == 200)
    });
    // Keys in every region (split at f, m, t), and one read often enough to become popular
    // (hot-key replicas).
    const PREFIXES: [&str; 4] = ["acct", "item", "order", "user:"];
    for i in 0..40 {
        for k in PREFIXES.map(|p| format!("{p}{i}")) {
            let (s, b) = http(local_port, "PUT", &format!("/v1/kv/{k}"), &[], Some(r#"{"value": "v"}"#)).expect("put");
            assert_eq!(s, 200, "{b}");
        }
    }
    for _ in 0..50 {
        assert_eq!(http(local_port, "GET", "/v1/kv/user:7", &[], None).expect("get").0, 200);
    }
    // A light load all along, so the heatmap and rates have something to show: skewed (a few
    // keys most read), its hot range moving between regions every 15 s; its errors while a node
    // is killed do not matter.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut i, began) = (0u64, Instant::now());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                i += 1;
                let hot = PREFIXES[(began.elapsed().as_secs() / 15 % 3) as usize];
                // user:7 stays the most read key (the popular key the reads page must show).
                let k = match i % 4 {
                    0 => format!("{hot}{}", i % 8),
                    // user:7 from its primary; user:8 from its replicas too when they have a
                    // fresh copy (hot keys: the replicas' share on the reads page).
                    1 if i / 4 % 2 == 0 => "user:7".to_string(),
                    1 => "user:8?consistency=interleaved".to_string(),
                    2 => format!("{}{}", PREFIXES[(i / 4 % 4) as usize], i % 40),
                    _ => format!("user:{}", (i * i) % 11),
                };
                if i.is_multiple_of(10) {
                    let _ = http(local_port, "PUT", &format!("/v1/kv/{k}"), &[], Some(r#"{"value": "w"}"#));
                } else {
                    let _ = http(local_port, "GET", &format!("/v1/kv/{k}"), &[], None);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    // For docs/console.md: DPUKV_CONSOLE_SHOTS_WAIT=60 gives the heatmap a minute of history.
    let history = std::env::var("DPUKV_CONSOLE_SHOTS_WAIT").ok().and_then(|s| s.parse().ok()).unwrap_or(0);

    // A gateway with tokens: ops may do everything, reader may read keys under "user:".
    let tokens = dir.path().join("tokens.json");
    let doc = serde_json::json!({"tokens": [
        {"name": "ops", "token": OPS, "grants": [{"prefix": "", "allow": ["admin"]}]},
        {"name": "reader", "token": READER, "grants": [{"prefix": "user:", "allow": ["read"]}]},
    ]});
    std::fs::write(&tokens, doc.to_string()).expect("tokens");
    let seeds: Vec<String> = cj["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .map(|n| n["device"].as_str().expect("device").to_string())
        .collect();
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    let gw = Gateway::start(&seeds, &["--tokens", tokens.to_str().expect("path")]).expect("gateway");
    let port = port_of(&gw.http);
    let base = format!("http://{}", gw.http);

    // Without a token the APIs refuse; the pages hold no data and load.
    assert_eq!(http(port, "GET", "/v1/console/overview", &[], None).expect("get").0, 401);
    let (status, page) = http(port, "GET", "/ui/", &[], None).expect("get");
    assert!(status == 200 && page.contains("console.js"), "{status}");
    let weight: usize = ["/ui/", "/ui/console.js", "/ui/console.css"]
        .iter()
        .map(|p| http(port, "GET", p, &[], None).expect("asset").1.len())
        .sum();
    assert!(weight < 300 << 10, "the console weighs {weight} bytes");

    let b = Browser::start(1280, 800).expect("browser");
    b.goto(&format!("{base}/ui/")).expect("navigate");
    // The reader: the cluster, but no actions and no keys outside "user:".
    log_in(&b, READER);
    b.wait_until("return document.body.dataset.loaded === 'cluster'", Duration::from_secs(20)).expect("cluster page");
    let overview = api(port, "/v1/console/overview", Some(READER));
    assert_eq!(overview["you"], serde_json::json!({"name": "reader", "admin": false}));
    let actions_shown =
        b.script("const a = document.querySelector('a[href=\"#actions\"]'); return !!a && a.offsetParent !== null");
    assert_eq!(actions_shown.expect("script"), Value::Bool(false), "a reader sees no actions link");
    b.goto(&format!("{base}/ui/#actions")).expect("navigate");
    b.wait_until(
        "const p = document.querySelector('[data-testid=\"page-actions\"]'); \
         return !!p && /does not allow/.test(p.textContent) && !document.querySelector('[data-testid^=\"drain-\"]')",
        Duration::from_secs(10),
    )
    .expect("the actions are refused to a reader");
    let bearer = format!("Bearer {READER}");
    let (status, body) =
        http(port, "POST", "/v1/console/actions/drain/1", &[("Authorization", &bearer)], None).expect("post");
    assert_eq!(status, 403, "a reader cannot drain: {body}");
    let regions = api(port, "/v1/console/regions", Some(READER));
    assert!(
        regions["regions"].as_array().expect("regions").iter().all(|r| r["redacted"] == true && r["start"] == ""),
        "a reader does not see bounds outside its prefix: {regions}"
    );
    let reads = api(port, "/v1/console/reads", Some(READER));
    assert!(reads.to_string().contains("user:7"), "the reader sees its popular key: {reads}");
    let shown = reads.to_string();
    assert!(!["acct", "item", "order"].iter().any(|p| shown.contains(p)), "keys outside its grant: {reads}");
    wait_until("popular keys outside the reader's grant counted as hidden", Duration::from_secs(20), || {
        api(port, "/v1/console/reads", Some(READER))["popular"]
            .as_array()
            .is_some_and(|p| p.iter().any(|r| r["hidden"].as_u64().is_some_and(|h| h > 0)))
    });
    open(&b, &base, "regions");
    assert!(text_of(&b, "tr[data-testid=\"region-1\"]").contains("hidden"), "the page hides the bounds");
    no_errors(&b, "regions (reader)");

    // The operator: every page, its numbers as the APIs say.
    b.click(&b.wait_for("#token-button", Duration::from_secs(5)).expect("token button")).expect("click");
    log_in(&b, OPS);
    open(&b, &base, "cluster");
    let overview = api(port, "/v1/console/overview", Some(OPS));
    assert_eq!(overview["you"]["admin"], true);
    assert_eq!(overview["kubernetes"], Value::Null, "not on Kubernetes: no resource status");
    assert!(b.find_all("[data-testid=\"kubernetes\"]").expect("find").is_empty());
    let host = &overview["nodes"][0]["host_stats"];
    assert!(host["rss_bytes"].as_u64().is_some_and(|r| r > 1 << 20) && host["lease_age_ms"].is_u64(), "{host}");
    assert_eq!(host["lease_ttl_ms"], 2000, "the lease TTL dpukv local was given: {host}");
    assert_eq!(text_of(&b, "[data-testid=\"summary-nodes\"]").trim(), overview["health"]["nodes"].to_string());
    assert_eq!(text_of(&b, "[data-testid=\"summary-regions\"]").trim(), "4");
    for n in 1..=3 {
        assert!(text_of(&b, &format!("tr[data-testid=\"node-{n}\"]")).contains("live"), "node {n} is live");
    }
    no_errors(&b, "cluster");
    screenshot(&b, "cluster");
    std::thread::sleep(Duration::from_secs(history));
    open(&b, &base, "regions");
    let regions = api(port, "/v1/console/regions", Some(OPS));
    // Each backup's lag, from its primary's host.
    let lagged = regions["regions"][0]["lag"].as_array().cloned().unwrap_or_default();
    assert_eq!(lagged.len(), 2, "a lag per backup: {}", regions["regions"][0]);
    assert!(lagged.iter().all(|l| l["records"].is_u64() && l["bytes"].is_u64()), "{lagged:?}");
    let rows = b.find_all("tr[data-testid^=\"region-\"]").expect("rows").len();
    assert_eq!(rows, regions["regions"].as_array().expect("regions").len());
    assert!(text_of(&b, "tr[data-testid=\"region-3\"]").contains('m'), "region 3 starts at m");
    b.wait_for("[data-testid=\"heatmap\"]", Duration::from_secs(5)).expect("the heatmap");
    no_errors(&b, "regions");
    screenshot(&b, "regions");
    b.script("document.querySelector('[data-testid=\"heatmap\"]').scrollIntoView()").expect("scroll");
    screenshot(&b, "regions-heatmap");
    open(&b, &base, "reads");
    let reads = api(port, "/v1/console/reads", Some(OPS));
    assert!(reads["share"]["primary_device"].as_f64().is_some_and(|s| s > 0.0), "{reads}");
    b.wait_until(
        "return [...document.querySelectorAll('[data-testid^=\"popular-\"]')].some(e => e.textContent.includes('user:7'))",
        Duration::from_secs(10),
    )
    .expect("the popular key on the page");
    no_errors(&b, "reads");
    screenshot(&b, "reads");

    // A SIGKILLed primary: its failover on the timeline, with its duration.
    let victim = regions["regions"][0]["primary"].as_u64().expect("a primary");
    let node = cj["nodes"].as_array().expect("nodes").iter().find(|n| n["id"] == victim).expect("the node");
    // `dpukv local` restarts a killed process at once, and the new host registers again as soon
    // as etcd ends the old lease: a master round that comes later than that (a loaded machine)
    // sees the node back rather than gone, the node leads its regions again and there is no
    // failover (the timeline shows the node lost and back). Held still until the master has
    // failed over, the supervisor restarts the victim after.
    let supervisor = Paused::new(_local.0.id());
    for pid in ["host_pid", "device_pid"] {
        let pid = node[pid].as_u64().expect("pid");
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    }
    open(&b, &base, "events");
    b.wait_until(
        "return [...document.querySelectorAll('[data-kind=\"failover\"]')].some(e => /\\d+(\\.\\d+)?\\s*(ms|s)/.test(e.textContent))",
        Duration::from_secs(60),
    )
    .unwrap_or_else(|e| {
        panic!(
            "the failover on the timeline: {e}; regions {}; events {}",
            api(port, "/v1/console/regions", Some(OPS))["regions"],
            api(port, "/v1/console/events", Some(OPS))
        )
    });
    let events = api(port, "/v1/console/events", Some(OPS));
    let failover = events["events"]
        .as_array()
        .expect("events")
        .iter()
        .find(|e| e["kind"] == "failover" && e["node"] == victim)
        .unwrap_or_else(|| panic!("no failover of node {victim}'s region: {events}"));
    assert!(failover["duration_ms"].as_u64().is_some_and(|d| d < 30_000), "{failover}");
    no_errors(&b, "events");
    screenshot(&b, "events");
    drop(supervisor);

    // A drain started from the page completes.
    let drained = if victim == 3 { 2 } else { 3 };
    open(&b, &base, "actions");
    b.click(&b.wait_for(&format!("[data-testid=\"drain-{drained}\"]"), Duration::from_secs(10)).expect("drain button"))
        .expect("click");
    b.click(&b.wait_for("[data-testid=\"confirm\"]", Duration::from_secs(5)).expect("confirmation")).expect("confirm");
    b.wait_until(
        "const s = document.querySelector('[data-testid=\"action-status\"]'); return !!s && s.dataset.state === 'done'",
        Duration::from_secs(180),
    )
    .expect("the drain completes on the page");
    let progress = api(port, &format!("/v1/console/actions/drain/{drained}"), Some(OPS));
    assert_eq!(progress["done"], true, "{progress}");
    // The gateway's map follows (it refreshes within a second or two).
    wait_until("the drained node holding nothing in the gateway's map", Duration::from_secs(20), || {
        let overview = api(port, "/v1/console/overview", Some(OPS));
        let n = overview["nodes"].as_array().expect("nodes").iter().find(|n| n["id"] == drained).cloned();
        n.is_some_and(|n| n["regions_led"] == 0 && n["regions_backed"] == 0 && n["draining"] == true)
    });
    no_errors(&b, "actions");
    screenshot(&b, "actions");
    let events = api(port, "/v1/console/events", Some(OPS));
    assert!(events.to_string().contains("drain_requested"), "{events}");

    // A split from the page: region 3 (m..t) at "p".
    b.script("const s = document.getElementById('split-region'); s.value = '3'; s.dispatchEvent(new Event('change'));")
        .expect("pick the region");
    b.type_into(&b.wait_for("#split-key", Duration::from_secs(5)).expect("key"), "p").expect("type");
    b.click(&b.wait_for("#split-submit", Duration::from_secs(5)).expect("split")).expect("click");
    b.click(&b.wait_for("[data-testid=\"confirm\"]", Duration::from_secs(5)).expect("confirmation")).expect("confirm");
    // The page's answer first (the control API took the request, or why not), then the map.
    b.wait_until(
        "const s = document.querySelector('[data-testid=\"action-status\"]'); \
         return !!s && (s.dataset.state === 'done' || s.dataset.state === 'error')",
        Duration::from_secs(30),
    )
    .expect("the split's answer on the page");
    let answer = text_of(&b, "[data-testid=\"action-status\"]");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !api(port, "/v1/console/regions", Some(OPS))["regions"]
        .as_array()
        .is_some_and(|r| r.iter().any(|r| r["start"] == "p"))
    {
        assert!(
            Instant::now() < deadline,
            "the split did not show in the map within 120 s; the page said {answer:?}; regions {}; events {}",
            api(port, "/v1/console/regions", Some(OPS))["regions"],
            api(port, "/v1/console/events", Some(OPS))
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Its key is the operator's to see, not the reader's.
    let split = |token| {
        let events = api(port, "/v1/console/events", Some(token));
        events["events"].as_array().expect("events").iter().find(|e| e["kind"] == "split").cloned()
    };
    wait_until("the split on the timeline", Duration::from_secs(20), || split(OPS).is_some());
    let (ops_view, reader_view) = (split(OPS).expect("split"), split(READER).expect("split"));
    assert_eq!((ops_view["key"].as_str(), ops_view["region"].as_u64()), (Some("p"), Some(3)), "{ops_view}");
    assert!(reader_view.get("key").is_none() && reader_view["key_hidden"] == true, "{reader_view}");
    assert!(!reader_view.to_string().contains("\"p\""), "{reader_view}");
    no_errors(&b, "actions (split)");

    // Another site's page cannot act through an operator's browser; an open gateway acts only
    // for this machine (DNS rebinding names another host).
    let bearer = format!("Bearer {OPS}");
    let forged = [("Authorization", bearer.as_str()), ("Origin", "http://evil.example")];
    let (status, body) = http(port, "POST", "/v1/console/actions/drain/1", &forged, None).expect("post");
    assert_eq!(status, 403, "{body}");
    let (status, body) = http(
        port,
        "DELETE",
        "/v1/console/actions/drain/1",
        &[("Authorization", &bearer), ("Sec-Fetch-Site", "cross-site")],
        None,
    )
    .expect("delete");
    assert_eq!(status, 403, "{body}");
    let (status, body) =
        http(local_port, "GET", "/v1/console/actions/drain/1", &[("Host", "rebound.example:80")], None).expect("get");
    assert_eq!(status, 403, "{body}");
    let (status, body) =
        http(local_port, "GET", &format!("/v1/console/actions/drain/{drained}"), &[], None).expect("get");
    assert_eq!(status, 200, "the open gateway, from this machine: {body}");

    // Keyboard, the dark theme, a narrow screen.
    let focusable = b.script("return [...document.querySelectorAll('nav a, button')].every(e => e.tabIndex >= 0)");
    assert_eq!(focusable.expect("script"), Value::Bool(true));
    b.click(&b.wait_for("[data-testid=\"theme-toggle\"], #theme-toggle", Duration::from_secs(5)).expect("theme"))
        .expect("click");
    let theme = b.script("return document.documentElement.dataset.theme").expect("theme");
    open(&b, &base, "regions");
    screenshot(&b, &format!("regions-{}", theme.as_str().unwrap_or("other")));
    b.resize(390, 844).expect("resize");
    open(&b, &base, "cluster");
    let overflow = b.script("return document.documentElement.scrollWidth - window.innerWidth").expect("width");
    assert!(overflow.as_i64().is_some_and(|o| o <= 1), "the page scrolls sideways at 390 px: {overflow}");
    screenshot(&b, "cluster-narrow");
    no_errors(&b, "cluster (narrow)");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    load.join().expect("the load");
}
