//! A W3C WebDriver client (https://www.w3.org/TR/webdriver2/) for the web console's browser
//! tests: it starts Debian's `chromedriver` on a free loopback port and drives headless
//! `chromium` through it — the real browser and the real protocol, nothing simulated. Only what
//! the tests use: sessions, navigation, scripts, elements (find, click, type, text), window
//! size, screenshots and the browser's console log.
//!
//! Every request has a deadline ([`REQUEST_TIMEOUT`]); the driver and the browser are killed when
//! the [`Browser`] is dropped.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// The longest a WebDriver request may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// The W3C name of an element reference in JSON.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// Whether the browser and its driver are installed (`chromium`, `chromium-driver`).
pub fn available() -> bool {
    ["chromium", "chromedriver"]
        .iter()
        .all(|b| std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(b).is_file())))
}

/// A chromedriver process and one headless Chromium session.
pub struct Browser {
    driver: Child,
    port: u16,
    session: String,
}

/// An element of the page.
#[derive(Debug, Clone)]
pub struct Element(String);

/// One HTTP exchange with `127.0.0.1:port` ([`crate::cluster::http_exchange`], within
/// [`REQUEST_TIMEOUT`]): the status and the body.
pub fn http(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Result<(u16, String)> {
    crate::cluster::http_exchange(&format!("127.0.0.1:{port}"), None, headers, method, path, body, REQUEST_TIMEOUT)
}

impl Browser {
    /// Starts chromedriver and a headless Chromium of `width`×`height`.
    pub fn start(width: u32, height: u32) -> Result<Browser> {
        let port = crate::procs::free_port()?;
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting chromedriver (apt-get install chromium-driver)")?;
        let mut b = Browser { driver, port, session: String::new() };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok((200, body)) = http(port, "GET", "/status", &[], None)
                && body.contains("\"ready\":true")
            {
                break;
            }
            if Instant::now() > deadline {
                bail!("chromedriver did not get ready within 20 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         format!("--window-size={width},{height}"), "--no-first-run", "--disable-extensions"],
            },
            "goog:loggingPrefs": {"browser": "ALL"},
        }}});
        let v = b.call("POST", "/session", Some(caps))?;
        b.session = v["sessionId"].as_str().context("no session id")?.to_string();
        Ok(b)
    }

    /// One WebDriver command; its `value` (an error answer is an error).
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value> {
        let body = body.map(|b| b.to_string());
        let (status, text) =
            http(self.port, method, path, &[], body.as_deref().or(Some("{}")).filter(|_| method != "GET"))?;
        let v: Value = serde_json::from_str(&text).with_context(|| format!("{method} {path}: not JSON: {text}"))?;
        if status != 200 {
            bail!("{method} {path}: {status} {}: {}", v["value"]["error"], v["value"]["message"]);
        }
        Ok(v["value"].clone())
    }

    fn at(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.session)
    }

    /// Opens `url`.
    pub fn goto(&self, url: &str) -> Result<()> {
        self.call("POST", &self.at("/url"), Some(json!({"url": url}))).map(|_| ())
    }

    /// Runs `script` (a function body: `return ...`) in the page.
    pub fn script(&self, script: &str) -> Result<Value> {
        self.call("POST", &self.at("/execute/sync"), Some(json!({"script": script, "args": []})))
    }

    /// The elements matching CSS `selector`.
    pub fn find_all(&self, selector: &str) -> Result<Vec<Element>> {
        let v = self.call("POST", &self.at("/elements"), Some(json!({"using": "css selector", "value": selector})))?;
        Ok(v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e[ELEMENT].as_str().map(|s| Element(s.to_string())))
            .collect())
    }

    /// The first element matching `selector`, waiting up to `within` for one.
    pub fn wait_for(&self, selector: &str, within: Duration) -> Result<Element> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(e) = self.find_all(selector)?.into_iter().next() {
                return Ok(e);
            }
            if Instant::now() > deadline {
                bail!("no element {selector} within {within:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits up to `within` until `script` (a function body returning a boolean) is true.
    pub fn wait_until(&self, script: &str, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        loop {
            if self.script(script)?.as_bool() == Some(true) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("`{script}` did not hold within {within:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Clicks `e`.
    pub fn click(&self, e: &Element) -> Result<()> {
        self.call("POST", &self.at(&format!("/element/{}/click", e.0)), Some(json!({}))).map(|_| ())
    }

    /// Types `text` into `e` (after clearing it).
    pub fn type_into(&self, e: &Element, text: &str) -> Result<()> {
        self.call("POST", &self.at(&format!("/element/{}/clear", e.0)), Some(json!({})))?;
        self.call("POST", &self.at(&format!("/element/{}/value", e.0)), Some(json!({"text": text}))).map(|_| ())
    }

    /// The rendered text of `e`.
    pub fn text(&self, e: &Element) -> Result<String> {
        Ok(self.call("GET", &self.at(&format!("/element/{}/text", e.0)), None)?.as_str().unwrap_or("").to_string())
    }

    /// Whether `e` is displayed.
    pub fn displayed(&self, e: &Element) -> Result<bool> {
        Ok(self.call("GET", &self.at(&format!("/element/{}/displayed", e.0)), None)?.as_bool() == Some(true))
    }

    /// Resizes the window.
    pub fn resize(&self, width: u32, height: u32) -> Result<()> {
        self.call("POST", &self.at("/window/rect"), Some(json!({"width": width, "height": height}))).map(|_| ())
    }

    /// A PNG of the viewport.
    pub fn screenshot(&self) -> Result<Vec<u8>> {
        use base64::Engine;
        let v = self.call("GET", &self.at("/screenshot"), None)?;
        Ok(base64::engine::general_purpose::STANDARD.decode(v.as_str().context("no screenshot")?)?)
    }

    /// The browser's console messages since the last call, as (level, message); chromedriver's
    /// log endpoint (`goog:loggingPrefs`).
    pub fn console_log(&self) -> Result<Vec<(String, String)>> {
        let v = self.call("POST", &self.at("/se/log"), Some(json!({"type": "browser"})))?;
        Ok(v.as_array()
            .into_iter()
            .flatten()
            .map(|e| (e["level"].as_str().unwrap_or("").to_string(), e["message"].as_str().unwrap_or("").to_string()))
            .collect())
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = http(self.port, "DELETE", &self.at(""), &[], None);
        }
        // The browser it started (and its helpers), then chromedriver itself.
        for pid in descendants(self.driver.id()) {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// Every process under `pid` (children first listed, then theirs), from `/proc`.
fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        let tasks = std::fs::read_dir(format!("/proc/{p}/task")).into_iter().flatten().flatten();
        for t in tasks {
            let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            for c in children.split_whitespace().filter_map(|c| c.parse::<u32>().ok()) {
                if c > 1 && !out.contains(&c) {
                    out.push(c);
                    todo.push(c);
                }
            }
        }
    }
    out
}
