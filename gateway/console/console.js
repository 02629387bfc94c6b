// dpukv web console: polls the gateway's /v1/console/* JSON APIs and renders the visible page.
// Plain ES2020, no framework. Data reaches the DOM only through textContent (keys are user data).
"use strict";

// ---- Test hooks, first: uncaught errors, unhandled rejections, unexpected API answers ----
window.dpukvErrors = window.dpukvErrors || [];
const recordError = (message) => window.dpukvErrors.push(String(message));
function describe(e) {
  if (e instanceof Error) return `${e.name}: ${e.message}`;
  try { return typeof e === "string" ? e : JSON.stringify(e); } catch (_) { return String(e); }
}
window.addEventListener("error", (e) => {
  recordError(`error: ${e.message || describe(e.error)}${e.filename ? ` (${e.filename}:${e.lineno}:${e.colno})` : ""}`);
});
window.addEventListener("unhandledrejection", (e) => recordError(`unhandled rejection: ${describe(e.reason)}`));

// ---- Constants and state ----
const PAGES = ["cluster", "regions", "reads", "events", "actions"];
const POLL_MS = 2000;
const PROGRESS_MS = 1000;
const TIMEOUT_MS = 10000;
const MAX_EVENTS = 500;
const TOP_KEYS = 10;
const PALETTE = 8; // primary colours pc-0 … pc-7 in console.css
const API_BASE = new URL("../v1/console/", window.location.href).pathname; // the page is /ui/
const KNOWN_KINDS = new Set(["layout", "node_joined", "node_lost", "failover", "handover", "split", "merge",
  "drain_requested", "drain_ended", "step_down_requested", "step_down_ended", "backup", "restore_started", "restore_ended"]);
const LEASE_LATE_MS = 2000; // a host lease renewed longer ago than this reads as late (when its TTL is unknown)
// The consistency modes of gets (docs/hot-keys.md §1): what serves each.
const MODES = [["linearizable", "the primary"], ["bounded", "a replica fresh enough, else the primary"],
  ["extended", "a replica when the primary is busy, else the primary"], ["interleaved", "the least busy of the primary and replicas"]];

const state = {
  page: null,
  overview: null,
  regions: null,
  events: [], // newest first
  lastSeq: null,
  heatMode: "reads",
  confirm: null, // {run, back}: the action awaiting confirmation
  progress: null, // {timer}: the drain or step-down followed
  pollTimer: null,
  pollRun: 0,
  statusKind: "",
  statusTimer: null,
};

// ---- DOM helpers ----
const $ = (id) => document.getElementById(id);
const byTestId = (id) => document.querySelector(`[data-testid="${id}"]`);
const isNum = (v) => typeof v === "number" && Number.isFinite(v);
const capital = (s) => s.charAt(0).toUpperCase() + s.slice(1);

/** An element: props text, class, on (listeners) or attributes; children are nodes or text. */
function el(tag, props, ...children) {
  const n = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v == null || v === false) continue;
    if (k === "text") n.textContent = String(v);
    else if (k === "class") n.className = v;
    else if (k === "on") for (const [ev, f] of Object.entries(v)) n.addEventListener(ev, f);
    else n.setAttribute(k, String(v));
  }
  for (const c of children) if (c != null) n.append(c);
  return n;
}

function svgEl(tag, attrs, text) {
  const n = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) n.setAttribute(k, String(v));
  if (text != null) n.textContent = String(text);
  return n;
}

function setText(node, text) {
  const t = text == null ? "" : String(text);
  if (node.textContent !== t) node.textContent = t;
}

/**
 * Keeps parent's children in step with items, reusing each key's element (focus, open panels and
 * WebDriver references survive a refresh): create(item) makes one, update(node, item) fills it.
 */
function syncList(parent, items, keyOf, create, update) {
  const old = new Map(Array.from(parent.children, (c) => [c.dataset.key, c]));
  items.forEach((item, i) => {
    const key = String(keyOf(item));
    let node = old.get(key);
    if (node) old.delete(key);
    else {
      node = create(item);
      node.dataset.key = key;
    }
    update(node, item);
    if (parent.children[i] !== node) parent.insertBefore(node, parent.children[i] || null);
  });
  for (const n of old.values()) n.remove();
}

/** Fills a row: the first cell a row header; a spec is a text or {text, cls, build(cell)}. */
function setCells(tr, specs) {
  specs.forEach((spec, i) => {
    const s = spec !== null && typeof spec === "object" ? spec : { text: spec };
    const cell = tr.children[i] || tr.appendChild(i ? el("td") : el("th", { scope: "row" }));
    if (s.build) s.build(cell);
    else setText(cell, s.text ?? "—");
    cell.className = s.cls || "";
  });
}

/** syncList over the rows of a table's body; a new row gets data-testid `${prefix}-${key}`. */
function syncRows(tableId, items, prefix, keyOf, fill) {
  syncList($(tableId).tBodies[0], items, keyOf, (x) => el("tr", { "data-testid": `${prefix}-${keyOf(x)}` }), fill);
}

const num = (text) => ({ text, cls: "num" });
const badge = (text, level) => el("span", { class: `badge ${level}`, text });

// ---- Formatting (en-US: predictable thousands separators) ----
const NUM = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
const NUM1 = new Intl.NumberFormat("en-US", { maximumFractionDigits: 1 });
const NUM2 = new Intl.NumberFormat("en-US", { minimumFractionDigits: 2, maximumFractionDigits: 2 });
const fmtInt = (v) => (isNum(v) ? NUM.format(v) : "—");
const fmtRate = (v) => (isNum(v) ? NUM1.format(v) : "—");
const fmtPct = (f, digits = 1) => (isNum(f) ? `${(f * 100).toFixed(digits)}%` : "—");
const plural = (n, word) => `${fmtInt(n)} ${word}${n === 1 ? "" : "s"}`;
const pad2 = (n) => String(n).padStart(2, "0");

function fmtBytes(b) {
  if (!isNum(b)) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let i = 0;
  while (Math.abs(b) >= 1024 && i < units.length - 1) {
    b /= 1024;
    i += 1;
  }
  return i === 0 ? `${NUM.format(b)} B` : `${b.toFixed(1)} ${units[i]}`;
}

/** Whole seconds as "2 min 5 s", "3 h 12 min", "2 d 4 h". */
function fmtLong(s) {
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
  if (d > 0) return `${NUM.format(d)} d ${h} h`;
  return h > 0 ? `${h} h ${m} min` : `${m} min ${s % 60} s`;
}

/** A duration in milliseconds: "812 ms", "1.5 s", then as fmtLong. */
function fmtMs(ms) {
  if (!isNum(ms)) return "—";
  if (ms < 1000) return `${NUM.format(ms)} ms`;
  return ms < 60000 ? `${NUM1.format(ms / 1000)} s` : fmtLong(Math.floor(ms / 1000));
}

const fmtSeconds = (s) => (!isNum(s) ? "—" : s < 60 ? `${Math.floor(s)} s` : fmtLong(Math.floor(s)));

function fmtClock(ms) {
  const d = new Date(ms);
  return `${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
}

function fmtDateTime(ms) {
  const d = new Date(ms);
  return `${d.getFullYear()}-${pad2(d.getMonth() + 1)}-${pad2(d.getDate())} ${fmtClock(ms)}`;
}

function valueText(v) {
  if (isNum(v)) return Number.isInteger(v) ? NUM.format(v) : NUM2.format(v);
  if (typeof v === "boolean") return v ? "yes" : "no";
  if (v == null) return "—";
  return typeof v === "object" ? JSON.stringify(v) : String(v);
}

// ---- Keys: "utf8" or "base64" on the wire ----
function keyBytes(s, encoding) {
  if (encoding !== "base64") return new TextEncoder().encode(s || "");
  try { return Uint8Array.from(atob(s || ""), (c) => c.charCodeAt(0)); } catch (_) { return new Uint8Array(0); }
}

function compareBytes(a, b) {
  for (let i = 0; i < Math.min(a.length, b.length); i += 1) if (a[i] !== b[i]) return a[i] - b[i];
  return a.length - b.length;
}

const hexByte = (x) => `\\x${x.toString(16).padStart(2, "0")}`;

/** A key as readable text: control characters, and bytes of base64 keys outside printable ASCII, as \xNN. */
function showKey(s, encoding) {
  if (encoding !== "base64") return String(s).replace(/[\x00-\x1f\x7f]/g, (c) => hexByte(c.charCodeAt(0)));
  let out = "";
  for (const x of keyBytes(s, encoding)) out += x >= 0x20 && x < 0x7f && x !== 0x5c ? String.fromCharCode(x) : hexByte(x);
  return out;
}

const regionStart = (r) => (r.redacted ? "hidden" : !r.start ? "−∞" : showKey(r.start, r.encoding));
const regionEnd = (r) => (r.redacted ? "hidden" : r.end == null ? "+∞" : showKey(r.end, r.encoding));

/** Regions in key order (by start); as answered when some ranges are hidden from this token. */
function keyOrder(regions) {
  if (regions.some((r) => r.redacted)) return regions.slice();
  const start = new Map(regions.map((r) => [r.id, keyBytes(r.start, r.encoding)]));
  return regions.slice().sort((a, b) => compareBytes(start.get(a.id), start.get(b.id)) || a.id - b.id);
}

// ---- Nodes ----
/** A node a region names that is not live (known once the overview lists nodes). */
function nodeLost(id) {
  const nodes = state.overview?.nodes || [];
  if (!nodes.length || !id) return false;
  const n = nodes.find((x) => x.id === id);
  return !n || !n.live;
}

function nodeHealth(n) {
  if (!n.live) return ["lost", "bad"];
  if (!n.device_stats) return ["unreachable", "bad"];
  if (n.draining) return ["draining", "warn"];
  if (n.stepping_down) return ["stepping down", "warn"];
  return ["live", "ok"];
}

const colourClass = (id) => (id > 0 ? `pc-${(id - 1) % PALETTE}` : "pc-none");
const nodeRef = (id) => (!id ? "none" : nodeLost(id) ? `${id} (lost)` : String(id));

// ---- Status region ----
/** An API call's failure: HTTP status (0: no answer), code and message of the JSON error. */
const apiError = (status, code, message) => Object.assign(new Error(message), { name: "ApiError", status, code });
const isApiError = (e) => e instanceof Error && e.name === "ApiError";

/** kind "poll": cleared by the next good poll; "info": after 6 s. */
function setStatus(text, kind) {
  clearTimeout(state.statusTimer);
  setText($("status"), text);
  $("status").dataset.level = kind;
  state.statusKind = kind;
  if (kind === "info") state.statusTimer = setTimeout(() => setStatus("", ""), 6000);
}

function errorText(e) {
  if (!isApiError(e)) return describe(e);
  return `${e.code}${e.status ? ` (HTTP ${e.status})` : ""}: ${e.message}`;
}

// ---- API ----
function getToken() {
  try { return window.sessionStorage.getItem("dpukv-token") || ""; } catch (_) { return ""; }
}

function storeToken(token) {
  try {
    if (token) window.sessionStorage.setItem("dpukv-token", token);
    else window.sessionStorage.removeItem("dpukv-token");
  } catch (_) { /* storage disabled */ }
}

/**
 * Calls path under /v1/console/ (opts.method, opts.body as JSON); opts.expected: an action, whose
 * error answers the user sees, not recorded in dpukvErrors. Resolves to the JSON or rejects with an ApiError.
 */
async function api(path, opts = {}) {
  const method = opts.method || "GET";
  const url = API_BASE + path;
  const abort = new AbortController();
  const init = { method, headers: {}, signal: abort.signal };
  if (getToken()) init.headers.Authorization = "Bearer " + getToken();
  if (opts.body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(opts.body);
  }
  const timer = setTimeout(() => abort.abort(), TIMEOUT_MS);
  let res, text;
  try {
    res = await fetch(url, init);
    text = await res.text();
  } catch (e) {
    throw abort.signal.aborted ? apiError(0, "timeout", `no answer within ${TIMEOUT_MS / 1000} s`)
      : apiError(0, "unreachable", `the gateway did not answer (${describe(e)})`);
  } finally {
    clearTimeout(timer);
  }
  let body;
  try { body = text ? JSON.parse(text) : null; } catch (_) { body = undefined; }
  if (res.status === 401) {
    askForToken();
    throw apiError(401, body?.code || "unauthorized", getToken() ? "the token was refused" : "this gateway needs a token");
  }
  if (!res.ok) {
    const code = body?.code || `http_${res.status}`;
    const message = body?.message || text.trim() || res.statusText;
    if (!opts.expected) recordError(`${method} ${url}: ${res.status} ${code}: ${message}`);
    throw apiError(res.status, code, message);
  }
  if (body === undefined) {
    recordError(`${method} ${url}: ${res.status} answer is not JSON`);
    throw apiError(res.status, "bad_answer", "the answer is not JSON");
  }
  return body;
}

// ---- Token form and theme ----
function askForToken() {
  const wasHidden = $("token-form").hidden;
  $("token-form").hidden = false;
  $("token-button").setAttribute("aria-expanded", "true");
  if (wasHidden) $("token-input").focus();
}

function hideTokenForm() {
  $("token-form").hidden = true;
  $("token-button").setAttribute("aria-expanded", "false");
}

function initToken() {
  const label = () => setText($("token-button"), getToken() ? "Token (set)" : "Token");
  label();
  $("token-button").addEventListener("click", () => ($("token-form").hidden ? askForToken() : hideTokenForm()));
  $("token-cancel").addEventListener("click", () => {
    hideTokenForm();
    $("token-button").focus();
  });
  $("token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    storeToken($("token-input").value.trim());
    $("token-input").value = "";
    hideTokenForm();
    label();
    setStatus(getToken() ? "Token saved for this tab." : "Token forgotten.", "info");
    tick();
  });
}

function applyTheme(theme) {
  document.documentElement.dataset.theme = theme;
  $("theme-toggle").setAttribute("aria-pressed", String(theme === "dark"));
}

function initTheme() {
  let saved = null;
  try { saved = window.localStorage.getItem("dpukv-theme"); } catch (_) { /* no storage */ }
  const dark = window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches;
  applyTheme(saved === "dark" || saved === "light" ? saved : dark ? "dark" : "light");
  $("theme-toggle").addEventListener("click", () => {
    const next = document.documentElement.dataset.theme === "dark" ? "light" : "dark";
    applyTheme(next);
    try { window.localStorage.setItem("dpukv-theme", next); } catch (_) { /* no storage */ }
  });
}

// ---- Routing and polling ----
function showPage(page, focus) {
  state.page = page;
  for (const p of PAGES) $(`page-${p}`).hidden = p !== page;
  for (const a of document.querySelectorAll("nav a[data-page]")) {
    if (a.dataset.page === page) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  document.body.dataset.page = page;
  delete document.body.dataset.loaded;
  document.title = `${capital(page)} · dpukv console`;
  if (focus) $(`h-${page}`).focus();
}

function markLoaded(page) {
  if (state.page === page) document.body.dataset.loaded = page;
}

function route(focus) {
  const name = window.location.hash.slice(1);
  const page = PAGES.includes(name) ? name : "cluster";
  if (page !== state.page) showPage(page, focus);
  tick();
}

/** Polls the visible page now, then every POLL_MS while the document is visible. */
async function tick() {
  clearTimeout(state.pollTimer);
  if (document.hidden) return; // visibilitychange resumes
  const run = ++state.pollRun;
  const page = state.page;
  try {
    await LOADERS[page]();
    if (run === state.pollRun) {
      if (state.statusKind === "poll") setStatus("", "");
      setText($("updated"), `Updated ${fmtClock(Date.now())}`);
    }
  } catch (e) {
    if (!isApiError(e)) recordError(`rendering ${page}: ${describe(e)}`);
    if (run === state.pollRun) setStatus(`Could not load ${page}: ${errorText(e)}`, "poll");
  } finally {
    if (run === state.pollRun && !document.hidden) state.pollTimer = setTimeout(tick, POLL_MS);
  }
}

async function loadOverview() {
  state.overview = await api("overview");
  renderHeader(state.overview);
  return state.overview;
}

/** The overview (for the header and node states) beside a page's data; renders the page first. */
async function withOverview(pageData, render) {
  const [o, d] = await Promise.allSettled([loadOverview(), pageData]);
  if (d.status === "rejected") throw d.reason;
  render(d.value);
  if (o.status === "rejected") throw o.reason;
}

// New events are fetched after the newest seen; every 15th poll takes the whole log, and if its
// newest is older than what was seen, the log started over (a new etcd): the list does too.
let eventsPolls = 0;
async function loadEvents() {
  const whole = state.lastSeq == null || ++eventsPolls % 15 === 0;
  const d = await api(whole ? "events" : `events?after=${state.lastSeq}`);
  const list = d?.events || [];
  if (whole && state.lastSeq != null) {
    const newest = list.reduce((m, e) => (isNum(e?.seq) ? Math.max(m, e.seq) : m), -Infinity);
    if (newest < state.lastSeq) {
      state.events = [];
      state.lastSeq = null;
    }
  }
  mergeEvents(list);
}

const LOADERS = {
  cluster: async () => renderCluster(await loadOverview()),
  regions: () => withOverview(api("regions"), (r) => renderRegions((state.regions = r))),
  reads: () => withOverview(api("reads"), renderReads),
  events: () => withOverview(loadEvents(), renderEvents),
  actions: async () => {
    const o = await loadOverview();
    try {
      if (o.you?.admin) state.regions = await api("regions");
    } finally {
      renderActions(o);
    }
  },
};

// ---- Header ----
function clusterSummary(o) {
  if (!o.control?.ok) return [`Control API unreachable${o.control?.error ? `: ${o.control.error}` : ""}`, "bad"];
  const h = o.health;
  if (!h) return ["Cluster state unknown", "warn"];
  const nodes = o.nodes || [];
  const lost = nodes.filter((n) => !n.live).length;
  const ids = (f) => nodes.filter((n) => n.live && n[f]).map((n) => n.id).join(", ");
  const bad = [!o.master && "no master", h.without_primary > 0 && `${plural(h.without_primary, "region")} without primary`,
    lost > 0 && `${plural(lost, "node")} lost`].filter(Boolean);
  const warn = [h.under_replicated > 0 && `${plural(h.under_replicated, "region")} under-replicated`,
    ids("draining") && `draining node ${ids("draining")}`, ids("stepping_down") && `node ${ids("stepping_down")} stepping down`].filter(Boolean);
  const facts = `${plural(h.nodes, "node")} live · ${plural(h.regions, "region")} · master node ${o.master || "none"}`;
  if (bad.length) return [`Degraded: ${bad.concat(warn).join(", ")} · ${facts}`, "bad"];
  if (warn.length) return [`Attention: ${warn.join(", ")} · ${facts}`, "warn"];
  return [`Healthy · ${facts}`, "ok"];
}

function renderHeader(o) {
  const [text, level] = clusterSummary(o);
  setText($("cluster-status"), text);
  $("cluster-status").dataset.level = level;
  const you = o.you || {};
  setText($("you"), you.name ? `Signed in as ${you.name}${you.admin ? " (admin)" : ""}` : "");
  $("nav-actions").hidden = !you.admin;
  setText($("gateway-info"), `Gateway ${o.gateway?.version || "?"}, up ${fmtSeconds(o.gateway?.uptime_s)}.`);
}

// ---- Cluster page ----
function setCard(name, value, note, level) {
  const dd = byTestId(`summary-${name}`);
  setText(dd, value);
  setText(dd.nextElementSibling, note);
  dd.parentElement.dataset.level = level || "";
}

function renderCluster(o) {
  const nodes = (o.nodes || []).slice().sort((a, b) => a.id - b.id);
  const h = o.health || {};
  const live = nodes.filter((n) => n.live).length;
  const age = o.master_round_age_ms;
  const slow = isNum(age) && age > 5000;
  setCard("nodes", fmtInt(o.health ? h.nodes : live), `of ${plural(nodes.length, "node")} listed`, nodes.length > live && "bad");
  setCard("regions", fmtInt(h.regions), "");
  setCard("without_primary", fmtInt(h.without_primary), h.without_primary ? "failover due" : "", h.without_primary && "bad");
  setCard("under_replicated", fmtInt(h.under_replicated), h.under_replicated ? "short of copies" : "", h.under_replicated && "warn");
  setCard("master", o.master == null ? "—" : o.master === 0 ? "none" : String(o.master),
    isNum(age) ? `round ${fmtMs(age)} ago${slow ? " (not acting)" : ""}` : "no round yet", (!o.master || slow) && "bad");
  setCard("control", o.control?.ok ? "ok" : "unreachable", o.control?.error || "", !o.control?.ok && "bad");
  syncRows("nodes-table", nodes, "node", (n) => n.id, fillNodeRow);
  $("nodes-empty").hidden = nodes.length > 0;
  renderKubernetes(o.kubernetes);
  markLoaded("cluster");
}

// The DpuKvCluster resource's status as the operator last mirrored it; null off Kubernetes (no section then).
// Condition types whose "True" is the bad news (Kubernetes' negative-polarity conditions).
const BAD_WHEN_TRUE = new Set(["Degraded", "Stalled", "Failed"]);

function renderKubernetes(k) {
  let sec = $("kubernetes");
  if (!k || typeof k !== "object") {
    if (sec) sec.remove();
    return;
  }
  if (!sec) {
    sec = el("section", { id: "kubernetes", class: "panel kubernetes", "data-testid": "kubernetes", "aria-labelledby": "h-kubernetes" },
      el("h2", { id: "h-kubernetes" }),
      el("p", { class: "k8s-meta" }, "Phase ", el("strong", { "data-testid": "kubernetes-phase" }), " · ",
        el("span", { "data-testid": "kubernetes-reported" })),
      el("div", { class: "table-wrap", tabindex: 0, role: "region", "aria-labelledby": "cap-conditions" },
        el("table", { id: "conditions-table", class: "small-table" }, el("caption", { id: "cap-conditions", text: "Conditions" }),
          el("thead", null, el("tr", null, ...["Type", "Status", "Reason", "Message"].map((t) => el("th", { scope: "col", text: t })))),
          el("tbody"))),
      el("p", { class: "empty", id: "conditions-empty", text: "No conditions reported.", hidden: true }),
      el("p", { class: "hint", text: "The DpuKvCluster resource's status as the Kubernetes operator mirrors it into the cluster (the time is when it last changed)." }));
    $("page-cluster").querySelector(".cards").after(sec);
  }
  setText($("h-kubernetes"), `Kubernetes: ${k.resource || "DpuKvCluster"}`);
  setText(byTestId("kubernetes-phase"), k.phase || "unknown");
  const at = k.observed_ms;
  setText(byTestId("kubernetes-reported"), isNum(at) ? `last changed ${fmtSeconds(Math.max(0, Date.now() - at) / 1000)} ago` : "not yet reported");
  byTestId("kubernetes-reported").title = isNum(at) ? fmtDateTime(at) : "";
  const seen = new Map();
  for (const c of Array.isArray(k.conditions) ? k.conditions : []) {
    if (c && typeof c === "object" && c.type != null && !seen.has(String(c.type))) seen.set(String(c.type), c);
  }
  syncRows("conditions-table", [...seen.values()], "condition", (c) => c.type, fillConditionRow);
  $("conditions-empty").hidden = seen.size > 0;
}

function fillConditionRow(tr, c) {
  const status = c.status == null ? "Unknown" : String(c.status);
  const good = status === "True" ? !BAD_WHEN_TRUE.has(c.type) : status === "False" ? BAD_WHEN_TRUE.has(c.type) : null;
  tr.dataset.status = status;
  setCells(tr, [
    String(c.type),
    { build: (cell) => cell.replaceChildren(badge(status, good == null ? "warn" : good ? "ok" : "bad")) },
    c.reason || "—",
    { text: c.message || "—", cls: "wrap" },
  ]);
}

const fmtCpu = (s) => (isNum(s) ? `${NUM2.format(s)} s` : "—");

function fillNodeRow(tr, n) {
  const [health, level] = nodeHealth(n);
  const s = n.device_stats || {};
  const h = n.host_stats || {};
  const lease = h.lease_age_ms;
  // A host renews every third of its lease's TTL: two periods without one is late.
  const lateAfter = isNum(h.lease_ttl_ms) ? (2 * h.lease_ttl_ms) / 3 : LEASE_LATE_MS;
  const late = isNum(lease) && lease > lateAfter;
  tr.dataset.health = health;
  tr.dataset.lease = late ? "late" : "";
  setCells(tr, [
    { text: n.id },
    n.zone || "—",
    n.is_master ? "master" : "node",
    { build: (c) => c.replaceChildren(badge(health, level), n.error ? el("span", { class: "cell-note", text: ` ${n.error}` }) : "") },
    num(`${fmtInt(n.regions_led)} / ${fmtInt(n.regions_backed)}`),
    s.mode,
    num(fmtCpu(s.cpu_seconds)),
    num(fmtBytes(s.rss_bytes)),
    num(fmtSeconds(s.uptime_s)),
    num(fmtInt(s.reads_served)),
    n.host_stats == null && n.live ? { text: "no answer", cls: "num muted" } : num(fmtCpu(h.cpu_seconds)),
    num(fmtBytes(h.rss_bytes)),
    num(fmtSeconds(h.uptime_s)),
    { build: (c) => c.replaceChildren(!isNum(lease) ? "—" : late ? badge(`${fmtMs(lease)} ago (late)`, "warn") : `${fmtMs(lease)} ago`),
      cls: "num" },
  ]);
}

// ---- Regions page ----
function renderRegions(d) {
  const regions = keyOrder(d.regions || []);
  renderKeyspace(regions);
  syncRows("regions-table", regions, "region", (r) => r.id, fillRegionRow);
  $("regions-empty").hidden = regions.length > 0;
  renderHeatmap();
  markLoaded("regions");
}

function fillRegionRow(tr, r) {
  tr.dataset.state = r.state;
  const bound = r.redacted ? "muted" : "mono";
  setCells(tr, [
    { text: r.id },
    { text: regionStart(r), cls: bound },
    { text: regionEnd(r), cls: bound },
    { text: nodeRef(r.primary), cls: !r.primary || nodeLost(r.primary) ? "bad-text" : "" },
    backupsText(r),
    { build: (c) => fillLag(c, r) },
    num(fmtInt(r.epoch)),
    { build: (c) => c.replaceChildren(badge(r.state || "?", r.state === "serving" ? "ok" : "warn")) },
    num(fmtBytes(r.bytes)),
    num(fmtRate(r.writes_per_sec)),
    num(fmtRate(r.reads_per_sec)),
  ]);
}

/** "2, 3 (+4 joining)": the backups, and the nodes copying the region to become backups. */
function backupsText(r) {
  const joining = (r.joining || []).map(nodeRef).join(", ");
  return `${(r.backups || []).map(nodeRef).join(", ") || "none"}${joining ? ` (+${joining} joining)` : ""}`;
}

/** A backup more than this far behind its primary reads as a warning. */
const LAG_WARN_RECORDS = 1000, LAG_WARN_BYTES = 1024 * 1024;

/** Replication lag per backup, as the primary's host last reported it; "—" when unknown. */
function fillLag(c, r) {
  c.dataset.testid = `lag-${r.id}`;
  const lag = Array.isArray(r.lag) ? r.lag.filter((x) => x && typeof x === "object").sort((a, b) => a.backup - b.backup) : null;
  let worst = lag ? "in-sync" : "unknown";
  const items = (lag || []).map((x) => {
    const who = `node ${nodeRef(x.backup)}: `;
    if (x.bytes === 0 && x.records === 0) return el("li", null, `${who}in sync`);
    const known = isNum(x.bytes) || isNum(x.records);
    const text = known ? `${plural(x.records, "record")}, ${fmtBytes(x.bytes)} behind` : "lag unknown";
    const far = x.records > LAG_WARN_RECORDS || x.bytes > LAG_WARN_BYTES;
    if (far) worst = "far";
    else if (worst === "in-sync") worst = "behind";
    return el("li", null, far ? el("span", { class: "badge warn no-mark", text: `◆ ${who}${text}` }) : who + text);
  });
  c.dataset.lag = worst;
  c.replaceChildren(!lag ? "—" : items.length ? el("ul", { class: "lag-list" }, ...items) : "none");
}

const legendItem = (swatch, text) => el("li", null, el("span", { class: `swatch ${swatch}`, "aria-hidden": "true" }), text);

/** The key-space bar: a segment per region, widths by size when all sizes are known. */
function renderKeyspace(regions) {
  const total = regions.reduce((sum, r) => sum + (isNum(r.bytes) ? r.bytes : 0), 0);
  const bySize = total > 0 && regions.every((r) => isNum(r.bytes));
  setText($("keyspace-scale"), bySize ? "widths by size" : "equal widths: sizes not all known");
  syncList($("keyspace"), regions, (r) => r.id, () => el("li"), (li, r) => fillSegment(li, r, bySize ? r.bytes / total : null));
  const primaries = [...new Set(regions.map((r) => r.primary).filter((p) => p > 0))].sort((a, b) => a - b);
  const items = primaries.map((p) => legendItem(colourClass(p), `primary node ${nodeRef(p)}`));
  if (regions.some((r) => !r.primary)) items.push(legendItem("pc-none", "no primary"));
  if (regions.some((r) => r.state !== "serving")) items.push(legendItem("hatched", "striped: not serving (state named)"));
  if (regions.some((r) => nodeLost(r.primary))) items.push(legendItem("lost-swatch", "dashed: primary lost"));
  $("keyspace-legend").replaceChildren(...items);
}

function fillSegment(li, r, fraction) {
  const lost = nodeLost(r.primary);
  const flags = [r.state !== "serving" && r.state, !r.primary && "no primary", lost && "lost"].filter(Boolean);
  li.className = `seg ${colourClass(r.primary)}${r.state !== "serving" ? " hatched" : ""}${lost ? " lost" : ""}`;
  li.style.flexGrow = fraction == null ? "1" : String(Math.max(fraction * 1000, 1));
  li.dataset.testid = `segment-${r.id}`;
  li.dataset.state = r.state;
  const about = `${regionStart(r)} … ${regionEnd(r)}, ${r.primary ? `primary node ${nodeRef(r.primary)}` : "no primary"}, ${r.state}`;
  li.title = `Region ${r.id}: ${about}, ${fmtBytes(r.bytes)}`;
  li.replaceChildren(el("span", { class: "seg-id", text: `R${r.id}` }),
    ...flags.map((f) => el("span", { class: "seg-flag", text: f })),
    el("span", { class: "sr-only", text: `: ${about}` }));
}

/** The heatmap's rows: its region ids (with their column) in the key order of the regions. */
function heatRows(h) {
  const order = new Map(keyOrder(state.regions?.regions || []).map((r, i) => [r.id, i]));
  const rank = (id) => order.get(id) ?? Infinity;
  return h.regions.map((id, column) => ({ id, column })).sort((a, b) => rank(a.id) - rank(b.id) || a.id - b.id);
}

const heatOpacity = (v, max) => (v > 0 && max > 0 ? 0.12 + 0.88 * Math.sqrt(v / max) : 1);
const heatValue = (grid, t, column) => (grid[t] ? grid[t][column] : null);

function renderHeatmap() {
  const h = state.regions?.heatmap;
  const mode = state.heatMode;
  $("heat-reads").setAttribute("aria-pressed", String(mode === "reads"));
  $("heat-writes").setAttribute("aria-pressed", String(mode === "writes"));
  setText($("heatmap-title"), `${capital(mode)} per interval`);
  if (!h?.times?.length || !h.regions?.length) {
    $("heatmap-chart").replaceChildren(el("p", { class: "empty", text: "No heatmap data yet." }));
    $("heatmap-legend").replaceChildren();
    $("heatmap-table").replaceChildren();
    return;
  }
  const grid = h[mode] || [];
  let max = 0;
  for (const line of grid) for (const v of line || []) if (isNum(v) && v > max) max = v;
  $("heatmap-chart").replaceChildren(heatmapSvg(h, grid, heatRows(h), max, mode));
  $("heatmap-legend").replaceChildren("Scale: 0 ", el("span", { class: "gradient", "aria-hidden": "true" }),
    ` ${fmtInt(max)} ${mode} per interval (square root)`);
  if ($("heatmap-details").open) renderHeatTable();
}

/** Time on x (a column per interval), regions on y; each cell's value in its <title>. */
function heatmapSvg(h, grid, rows, max, mode) {
  const n = h.times.length, RH = 16, LW = 44;
  const CW = Math.max(4, Math.min(12, Math.floor(($("heatmap-chart").clientWidth - LW - 4) / n))); // fills the width
  const width = LW + n * CW + 4, height = rows.length * RH + 18, interval = h.interval_ms || 0;
  const svg = svgEl("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", class: "heat-svg" });
  svg.append(svgEl("title", null, `${mode} per ${fmtMs(interval)} of ${rows.length} regions; peak ${fmtInt(max)}`));
  rows.forEach((row, y) => {
    svg.append(svgEl("text", { x: LW - 6, y: y * RH + RH / 2 + 4, "text-anchor": "end" }, `R${row.id}`));
    for (let t = 0; t < n; t += 1) {
      const v = heatValue(grid, t, row.column);
      const rect = svgEl("rect", {
        x: LW + t * CW, y: y * RH, width: CW - 0.5, height: RH - 1,
        class: !isNum(v) ? "cell nodata" : v > 0 ? "cell" : "cell zero",
        "fill-opacity": isNum(v) ? heatOpacity(v, max).toFixed(3) : 1,
      });
      const when = `${fmtClock(h.times[t] - interval)}–${fmtClock(h.times[t])}`;
      rect.append(svgEl("title", null, `Region ${row.id}, ${when}: ${isNum(v) ? fmtInt(v) : "no data"} ${mode}`));
      svg.append(rect);
    }
  });
  for (const t of new Set([0, Math.floor((n - 1) / 2), n - 1])) {
    const anchor = t === n - 1 ? "end" : t === 0 ? "start" : "middle";
    svg.append(svgEl("text", { x: LW + t * CW + (t === n - 1 ? CW : 0), y: height - 5, "text-anchor": anchor }, fmtClock(h.times[t])));
  }
  return svg;
}

/** The heatmap as a table (its accessible alternative), built only while its <details> is open. */
function renderHeatTable() {
  const h = state.regions?.heatmap;
  if (!h?.times || !h.regions) return $("heatmap-table").replaceChildren();
  const grid = h[state.heatMode] || [];
  const head = el("tr", null, el("th", { scope: "col", text: "Region" }), ...h.times.map((t) => el("th", { scope: "col", class: "num", text: fmtClock(t) })));
  const rows = heatRows(h).map((row) => el("tr", null, el("th", { scope: "row", text: `R${row.id}` }),
    ...h.times.map((_, t) => el("td", { class: "num", text: fmtInt(heatValue(grid, t, row.column)) }))));
  const caption = `${capital(state.heatMode)} per region (rows, key order) in the interval ending at each time (columns)`;
  $("heatmap-table").replaceChildren(el("table", null, el("caption", { text: caption }), el("thead", null, head), el("tbody", null, ...rows)));
}

// ---- Reads page ----
function renderReads(d) {
  const share = d.share || {};
  for (const [name, v] of [["primary", share.primary_device], ["replica", share.replica_device], ["host", share.host]]) {
    setText(byTestId(`share-${name}`), fmtPct(v));
    $(`bar-${name}`).style.width = isNum(v) ? `${Math.max(0, Math.min(1, v)) * 100}%` : "0";
    setText($(`bar-${name}`), isNum(v) && v >= 0.08 ? fmtPct(v, 0) : "");
  }
  $("share-empty").hidden = [share.primary_device, share.replica_device, share.host].some(isNum);
  setText(byTestId("visits-per-read"), isNum(d.visits_per_read) ? NUM2.format(d.visits_per_read) : "—");
  const gw = d.gateway || {};
  const label = { primary: "Sent to primaries", replica: "Sent to replicas" };
  $("gateway-counts").replaceChildren(...Object.keys(gw).map((k) => el("div", null,
    el("dt", { text: label[k] || k.replace(/_/g, " ") }), el("dd", { "data-testid": `gateway-${k}`, text: valueText(gw[k]) }))));
  renderConsistency(d.consistency || {});
  const devices = (d.devices || []).slice().sort((a, b) => a.node - b.node);
  syncRows("devices-table", devices, "device", (v) => v.node, fillDeviceRow);
  const popular = (d.popular || []).slice().sort((a, b) => a.region - b.region || a.node - b.node);
  syncList($("popular"), popular, (p) => `${p.region}-${p.node}`, makePopular, (node, p) => fillPopular(node, p, share.replica_device));
  $("popular-empty").hidden = popular.length > 0;
  markLoaded("reads");
}

/** This gateway's gets by the mode asked: the known modes in order, then any others answered. */
function renderConsistency(c) {
  const rows = MODES.concat(Object.keys(c).filter((k) => !MODES.some(([m]) => m === k)).map((k) => [k, ""]));
  const total = rows.reduce((sum, [m]) => sum + (isNum(c[m]) ? c[m] : 0), 0);
  syncRows("consistency-table", rows, "consistency", ([m]) => m, (tr, [m, how]) => setCells(tr, [
    { text: m },
    num(fmtInt(c[m])),
    num(total > 0 && isNum(c[m]) ? fmtPct(c[m] / total) : "—"),
    { text: how || "—", cls: "cell-note" },
  ]));
}

function fillDeviceRow(tr, v) {
  setCells(tr, [
    { text: v.node },
    num(fmtInt(v.gets)),
    num(fmtInt(v.reads_served)),
    num(fmtInt(v.replica_reads)),
    num(fmtInt(v.reads_forwarded)),
    num(fmtInt(v.node_visits)),
    num(isNum(v.node_visits) && v.gets > 0 ? NUM2.format(v.node_visits / v.gets) : "—"),
  ]);
}

function makePopular(p) {
  const id = `${p.region}-${p.node}`;
  return el("article", { class: "popular", "data-testid": `popular-${id}` }, el("h3"), el("p", { class: "meta" }),
    el("p", { class: "ceiling", "data-testid": `ceiling-${id}` }), el("ol", { class: "keys" }));
}

function fillPopular(node, p, replicaShare) {
  const [title, meta, ceiling, list] = node.children;
  const keys = (p.keys || []).slice().sort((a, b) => b.count - a.count);
  setText(title, `Region ${p.region} · node ${p.node}`);
  setText(meta, `capacity ${plural(p.capacity, "key")} · top ${Math.min(TOP_KEYS, keys.length)} of ${fmtInt(keys.length)} tracked, with reads`);
  setText(ceiling, `ceiling H(n)/H(N) ${isNum(p.ceiling) ? fmtPct(p.ceiling, 0) : "unknown"} vs measured replica share ${fmtPct(replicaShare, 0)}`);
  list.replaceChildren(...keys.slice(0, TOP_KEYS).map((k) => el("li", null,
    el("span", { class: "mono", text: showKey(k.key, k.encoding) }), " ", el("span", { class: "count", text: fmtInt(k.count) }))));
}

// ---- Events page ----
function mergeEvents(list) {
  const bySeq = new Map(state.events.map((e) => [e.seq, e]));
  for (const e of list) if (isNum(e?.seq)) bySeq.set(e.seq, e);
  state.events = [...bySeq.values()].sort((a, b) => b.seq - a.seq).slice(0, MAX_EVENTS);
  if (state.events.length) state.lastSeq = Math.max(state.events[0].seq, state.lastSeq ?? -Infinity);
}

function renderEvents() {
  syncList($("events-list"), state.events, (e) => e.seq, makeEvent, () => {});
  $("events-empty").hidden = state.events.length > 0;
  setText($("events-count"), `${plural(state.events.length, "event")} (the newest ${MAX_EVENTS} are kept)`);
  markLoaded("events");
}

/** What an event's `to` names: the new primary (failover, handover), the new region (split), the region merged into. */
function eventTo(kind, to) {
  if (to == null) return false;
  if (kind === "split") return `new region ${to}`;
  if (kind === "merge") return `into region ${to}`;
  return kind === "failover" || kind === "handover" ? `to node ${to}` : `to ${to}`;
}

function makeEvent(e) {
  const kind = String(e.kind || "unknown");
  const known = KNOWN_KINDS.has(kind);
  const failover = kind === "failover";
  const head = el("div", { class: "event-head" },
    el("time", { datetime: isNum(e.unix_ms) && new Date(e.unix_ms).toISOString(), text: isNum(e.unix_ms) ? fmtDateTime(e.unix_ms) : "—" }), " ",
    el("span", { class: `kind kind-${known ? kind : "other"}`, text: known ? kind.replace(/_/g, " ") : kind }));
  if (isNum(e.duration_ms)) {
    // Only a failover's duration (an outage) is emphasised; others read as a plain "took …".
    const text = fmtMs(e.duration_ms);
    head.append(" ", failover ? el("strong", { class: "duration big", "data-testid": `duration-${e.seq}`, text })
      : el("span", { class: "duration" }, "took ", el("span", { "data-testid": `duration-${e.seq}`, text })));
  }
  const facts = [e.node != null && `node ${e.node}`, e.region != null && `region ${e.region}`, eventTo(kind, e.to), `#${e.seq}`];
  const emphasis = failover || kind === "handover" ? ` ${kind}` : "";
  return el("li", { class: `event${emphasis}`, "data-testid": `event-${e.seq}`, "data-kind": kind }, head,
    e.detail ? el("p", { text: e.detail }) : null, el("p", { class: "facts", text: facts.filter(Boolean).join(" · ") }));
}

// ---- Actions page ----
// [testid, button text, route, method, question]: the buttons of each node's row.
const NODE_ACTIONS = [
  ["drain", "Drain", "drain", "POST", "Drain node #? Its regions move to other nodes."],
  ["stop-drain", "Stop drain", "drain", "DELETE", "Stop draining node #?"],
  ["step-down", "Step down", "step-down", "POST", "Step down node #? The regions it leads move to backups."],
  ["stop-step-down", "Stop step-down", "step-down", "DELETE", "Stop the step-down of node #?"],
];

function renderActions(o) {
  const admin = Boolean(o.you?.admin);
  $("actions-loading").hidden = true;
  $("actions-denied").hidden = admin;
  $("actions-body").hidden = !admin;
  if (admin) {
    const nodes = (o.nodes || []).slice().sort((a, b) => a.id - b.id);
    syncList($("action-nodes").tBodies[0], nodes, (n) => n.id, makeActionRow, fillActionRow);
    const regions = keyOrder(state.regions?.regions || []);
    syncList($("split-region"), regions, (r) => r.id, () => el("option"), (opt, r) => {
      opt.value = String(r.id);
      setText(opt, `Region ${r.id}: ${r.redacted ? "range hidden" : `${regionStart(r)} … ${regionEnd(r)}`}`);
    });
  }
  markLoaded("actions");
}

function makeActionRow(n) {
  const id = n.id;
  const buttons = NODE_ACTIONS.map(([testid, text, kind, method, question]) => el("button", {
    type: "button", "data-testid": `${testid}-${id}`, "aria-label": `${text} node ${id}`, text,
    on: { click: (ev) => askConfirm(question.replace("#", id), `${text} node ${id}`, () => nodeAction(kind, id, method), ev.currentTarget) },
  }));
  return el("tr", { "data-testid": `action-node-${id}` }, el("th", { scope: "row" }), el("td"), el("td", { class: "num" }),
    el("td", { class: "num" }), el("td", null, el("div", { class: "buttons" }, ...buttons)));
}

function fillActionRow(tr, n) {
  const [id, health, led, backed] = tr.children;
  setText(id, n.id);
  health.replaceChildren(badge(...nodeHealth(n)));
  setText(led, fmtInt(n.regions_led));
  setText(backed, fmtInt(n.regions_backed));
}

function askConfirm(question, confirmLabel, run, back) {
  state.confirm = { run, back };
  setText($("confirm-text"), question);
  setText(byTestId("confirm"), confirmLabel);
  $("confirm-panel").hidden = false;
  byTestId("confirm").focus();
}

function closeConfirm(cancelled) {
  const c = state.confirm;
  state.confirm = null;
  $("confirm-panel").hidden = true;
  if (cancelled) {
    setActionStatus("Cancelled.", "idle");
    if (c?.back?.isConnected) c.back.focus();
  }
  return c;
}

/** action-status: a sentence, data-state (pending, progress, done, error, idle) and the answer's fields. */
function setActionStatus(line, st, fields) {
  const box = byTestId("action-status");
  box.dataset.state = st;
  const list = fields && el("dl", { class: "fields" }, ...Object.entries(fields).map(([k, v]) => el("div", null,
    el("dt", { text: k.replace(/_/g, " ") }), el("dd", { "data-field": k, text: valueText(v) }))));
  box.replaceChildren(el("p", { class: "action-line", text: line }), list || "");
}

function actionError(what, e) {
  if (!isApiError(e)) recordError(`${what}: ${describe(e)}`);
  setActionStatus(`${what} failed: ${errorText(e)}`, "error");
}

function progressLine(kind, a) {
  const done = a.done ? "done" : "in progress";
  if (kind === "drain") {
    if (!a.draining) return `Node ${a.node} is not draining.`;
    return `Draining node ${a.node}: ${isNum(a.regions) ? plural(a.regions, "region") : "? regions"} left, ${done}.`;
  }
  if (!a.stepping_down) return `Node ${a.node} is not stepping down.`;
  return `Node ${a.node} stepping down: leads ${plural(a.regions_led, "region")}, ${fmtInt(a.movable)} movable, ${done}.`;
}

function stopProgress() {
  clearTimeout(state.progress?.timer);
  state.progress = null;
}

async function nodeAction(kind, node, method) {
  stopProgress();
  const what = method === "DELETE" ? `Stopping the ${kind} of node ${node}` : `${capital(kind)} of node ${node}`;
  setActionStatus(`${what}…`, "pending");
  try {
    const a = { node, ...(await api(`actions/${kind}/${node}`, { method, expected: true })) };
    setActionStatus(progressLine(kind, a), a.done || method === "DELETE" ? "done" : "progress", a);
    if (method === "POST" && !a.done) followProgress(kind, node);
  } catch (e) {
    actionError(what, e);
  }
  tick();
}

/** Polls a drain or step-down every PROGRESS_MS until it is done (or another action starts). */
function followProgress(kind, node) {
  const progress = { timer: null };
  const step = async () => {
    if (state.progress !== progress) return;
    if (document.hidden) return (progress.timer = setTimeout(step, PROGRESS_MS));
    try {
      const a = { node, ...(await api(`actions/${kind}/${node}`, { expected: true })) };
      if (state.progress !== progress) return;
      setActionStatus(progressLine(kind, a), a.done ? "done" : "progress", a);
      if (a.done) state.progress = null;
      else progress.timer = setTimeout(step, PROGRESS_MS);
    } catch (e) {
      if (state.progress !== progress) return;
      state.progress = null;
      actionError(`Following the ${kind} of node ${node}`, e);
    }
  };
  state.progress = progress;
  progress.timer = setTimeout(step, PROGRESS_MS);
}

function onSplitSubmit(e) {
  e.preventDefault();
  const region = $("split-region").value;
  const key = $("split-key").value;
  const encoding = $("split-encoding").value;
  let problem = !region ? "Choose a region to split." : key === "" ? "Enter the key to split at." : null;
  if (!problem && encoding === "base64") {
    try { atob(key); } catch (_) { problem = "The key is not valid base64."; }
  }
  if (problem) {
    setActionStatus(problem, "error");
    if (region) $("split-key").focus();
    return;
  }
  askConfirm(`Split region ${region} at key “${key}” (${encoding})?`, `Split region ${region}`,
    () => splitAction(Number(region), key, encoding), $("split-submit"));
}

async function splitAction(region, key, encoding) {
  stopProgress();
  setActionStatus(`Splitting region ${region}…`, "pending");
  try {
    const a = await api(`actions/split/${region}`, { method: "POST", body: { key, encoding }, expected: true }) || {};
    const at = `region ${a.region ?? region} at “${showKey(a.key ?? key, a.encoding || encoding)}”`;
    if (a.accepted === false) setActionStatus(`Split of ${at} not accepted.`, "error", a);
    else setActionStatus(`Split requested: ${at}. The regions page shows it once done.`, "done", a);
  } catch (e) {
    actionError(`Split of region ${region}`, e);
  }
}

// ---- Wiring ----
function init() {
  initTheme();
  initToken();
  byTestId("confirm").addEventListener("click", () => closeConfirm(false)?.run());
  byTestId("cancel").addEventListener("click", () => closeConfirm(true));
  $("confirm-panel").addEventListener("keydown", (e) => e.key === "Escape" && closeConfirm(true));
  $("split-form").addEventListener("submit", onSplitSubmit);
  for (const mode of ["reads", "writes"]) {
    $(`heat-${mode}`).addEventListener("click", () => {
      state.heatMode = mode;
      renderHeatmap();
    });
  }
  // The skip link moves focus to the page's heading without touching the hash (the hash is the page).
  $("skip-link").addEventListener("click", (e) => {
    e.preventDefault();
    $(`h-${state.page}`).focus();
  });
  $("heatmap-details").addEventListener("toggle", () => ($("heatmap-details").open ? renderHeatTable() : $("heatmap-table").replaceChildren()));
  window.addEventListener("hashchange", () => route(true));
  document.addEventListener("visibilitychange", () => !document.hidden && tick());
  route(false);
}

init();
