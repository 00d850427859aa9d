// The header every page shares: the navigation and the node's live status line (step, peers, contributors, its
// last update), polled from /api/v1/swarm/status. A page calls mountSite() once; other code on the page reads the
// same poll with statusLine.subscribe(fn) instead of polling again. Errors are shown in the line, never thrown.

export const PAGES = [["/", "dashboard"], ["/contribute", "contribute"], ["/chat", "chat"]];
export const MIN_POLL_MS = 1000; // a status poll is cheap, but not free for a node serving many pages
export const MAX_POLL_MS = 30000; // slower than this and the line stops being "live"
const FETCH_TIMEOUT_MS = 5000; // one poll's bound; the next poll starts after it either way

/** The poll interval actually used: a number of ms, clamped to [MIN_POLL_MS, MAX_POLL_MS] (2 s when not one). */
export function clampPollMs(ms) {
  if (typeof ms !== "number" || !Number.isFinite(ms)) return 2000;
  return Math.min(MAX_POLL_MS, Math.max(MIN_POLL_MS, Math.round(ms)));
}

/** GET a JSON document with a bounded wait; throws an Error that says what failed. */
export async function getJSON(path, timeoutMs = FETCH_TIMEOUT_MS) {
  const ctrl = new AbortController();
  const timer = setTimeout(() => ctrl.abort(), timeoutMs);
  try {
    const r = await fetch(path, { cache: "no-store", signal: ctrl.signal });
    if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
    return await r.json();
  } catch (e) {
    throw e.name === "AbortError" ? new Error(`${path}: no answer in ${timeoutMs / 1000} s`) : e;
  } finally {
    clearTimeout(timer);
  }
}

const count = (v) => (typeof v === "number" && Number.isFinite(v) ? v.toLocaleString("en-US") : "–");

function span(text, id) {
  const b = document.createElement("b");
  b.id = id;
  b.textContent = text;
  return b;
}

/** The status line: one poll loop, its rendering into `el`, and the listeners that share it. */
export class StatusLine {
  constructor(el, { pollMs = 2000 } = {}) {
    this.el = el;
    this.pollMs = clampPollMs(pollMs);
    this.status = null; // the last status the node answered
    this.error = null; // the last poll's error message, null after a good poll
    this._listeners = [];
    this._timer = null;
  }

  /** fn(status, error) after every poll: (object, null) or (null, message). */
  subscribe(fn) {
    this._listeners.push(fn);
    if (this.status || this.error) fn(this.status, this.error);
  }

  start() {
    if (this._timer === null) this._loop();
    return this;
  }

  stop() {
    clearTimeout(this._timer);
    this._timer = null;
  }

  async _loop() {
    this._timer = -1; // running: start() does not begin a second loop
    try {
      this.status = await getJSON("/api/v1/swarm/status");
      this.error = null;
    } catch (e) {
      this.error = String(e.message || e);
    }
    this.render();
    for (const fn of this._listeners) {
      try { fn(this.error ? null : this.status, this.error); } catch (e) { console.error("status listener:", e); }
    }
    if (this._timer !== null) this._timer = setTimeout(() => this._loop(), this.pollMs);
  }

  render() {
    const s = this.status, line = this.el;
    const dot = document.createElement("span");
    dot.className = "dot " + (this.error ? "bad" : s ? "ok" : "");
    line.classList.toggle("bad", !!this.error);
    if (this.error) {
      line.replaceChildren(dot, `node unreachable: ${this.error} · retrying every ${this.pollMs / 1000} s`);
      return;
    }
    const last = s.updates > 0 && typeof s.last_update_s === "number"
      ? `took ${s.last_update_s.toFixed(2)} s` : "none yet";
    line.replaceChildren(
      dot, "step ", span(count(s.step), "status-step"),
      " · peers ", span(count(s.peers), "status-peers"),
      " · contributors ", span(count(s.contributors), "status-contributors"),
      " · last update ", span(last, "status-last-update"),
      ` · ${new Date().toLocaleTimeString()}`,
    );
  }
}

/**
 * Put the shared header into <header id="site-header"> (created at the top of <body> when missing) and start
 * its status line. Returns the StatusLine.
 */
export function mountSite({ pollMs = 2000 } = {}) {
  let header = document.getElementById("site-header");
  if (!header) {
    header = document.createElement("header");
    header.id = "site-header";
    document.body.prepend(header);
  }
  header.className = "site";
  const brand = document.createElement("a");
  brand.className = "brand";
  brand.href = "/";
  brand.textContent = "dtrain";
  const nav = document.createElement("nav");
  const here = location.pathname.replace(/\/+$/, "") || "/";
  for (const [href, label] of PAGES) {
    const a = document.createElement("a");
    a.href = href;
    a.textContent = label;
    if (href === here) a.setAttribute("aria-current", "page");
    nav.append(a);
  }
  const line = document.createElement("div");
  line.id = "site-status";
  line.className = "status";
  line.setAttribute("role", "status");
  line.textContent = "connecting…";
  header.replaceChildren(brand, nav, line);
  return new StatusLine(line, { pollMs }).start();
}
