// Dashboard for a dtrain node: the shared header's status poll (static/site.js) feeds the stats and the nodes table;
// losses, model info and the contributor ledger are polled here every 2 s. The loss curve is static/chart.js's.

import { drawSeries, fmtNum } from "./chart.js";
import { getJSON, mountSite } from "./site.js";

const POLL_MS = 2000;
const $ = (id) => document.getElementById(id);

let lastSamples = null; // {samples, t} from the previous successful poll
let lastLosses = [];

const fmtInt = (v) => (typeof v === "number" && isFinite(v) ? v.toLocaleString("en-US") : "–");

function fmtAge(ts) {
  if (typeof ts !== "number") return "–";
  const age = Date.now() / 1000 - ts;
  if (!isFinite(age)) return "–";
  if (age < 0 || age > 86400 * 365) return new Date(ts * 1000).toLocaleTimeString(); // clock skew: show the time
  if (age < 60) return `${Math.round(age)} s ago`;
  if (age < 3600) return `${Math.round(age / 60)} min ago`;
  return `${Math.round(age / 3600)} h ago`;
}

function setText(id, v) {
  const el = $(id);
  if (el) el.textContent = v;
}

// the header's status line says it too; the banner says it where the numbers are
function setConnected(ok, msg) {
  const banner = $("banner");
  banner.textContent = ok ? "" : `Cannot reach the node (${msg}). Retrying every ${POLL_MS / 1000} s…`;
  banner.className = ok ? "message" : "message bad";
}

// one muted row across a table's `cols` columns, for a table with nothing to show
function emptyRow(body, cols, text) {
  const tr = document.createElement("tr");
  const td = document.createElement("td");
  td.colSpan = cols;
  td.className = "muted";
  td.textContent = text;
  tr.append(td);
  body.append(tr);
}

// how this node takes part in the swarm: a full peer, or a client-mode peer behind NAT (docs/home-nodes.md)
function describeReachability(r) {
  if (!r || !r.mode) return "–";
  const role = r.mode === "client"
    ? "client mode (other peers cannot dial this node; it dials out and its gradients are averaged in public peers' groups)"
    : "public (a full peer)";
  const why = r.chosen_by === "flag" ? "set by --reachability"
    : r.verdict === "unchecked" ? `not checked: ${r.detail || "no peer answered"}`
    : `${r.dialed} of ${r.answered} peers asked could dial it back`;
  return `${role} · ${why}${r.relay ? "" : " · relays off"}`;
}

// open or closed (--swarm-key), and how it syncs (docs/peers.md, docs/low-communication.md)
function describeSwarm(s) {
  if (typeof s.closed !== "boolean") return "–";
  const access = s.closed ? "closed: only peers with the swarm key can join" : "open: any peer that learns an address can join";
  const sync = s.sync === "low-comm" ? `low-communication rounds (${s.wire_codec})` : "per-step";
  return `${access} · ${sync}`;
}

// where forward and backward passes run (--device); the swarm's fp32 master weights stay on the CPU
function describeDevice(d) {
  if (!d || !d.device) return "–";
  const where = d.device === "cpu" ? "CPU" : `${d.device} (${d.name})`;
  return d.precision === "fp32" ? `${where} · fp32` : `${where} · ${d.precision} over fp32 master weights`;
}

function renderStatus(s) {
  setText("s-step", fmtInt(s.step));
  setText("s-updates", fmtInt(s.updates));
  const peers = fmtInt(s.peers);
  setText("s-peers", typeof s.training_peers === "number" ? `${peers} (${s.training_peers} training)` : peers);
  const pending = s.pending_contributors ? ` (+${s.pending_contributors} pending)` : "";
  setText("s-contributors", fmtInt(s.contributors) + pending);
  // accepted from contributors; of them applied by an update of the swarm, and carried past one into a later update
  const carried = s.carried_samples ? `, ${fmtInt(s.carried_samples)} carried` : "";
  setText("s-samples", typeof s.applied_samples === "number"
    ? `${fmtInt(s.samples_total)} (${fmtInt(s.applied_samples)} applied${carried})` : fmtInt(s.samples_total));

  const now = performance.now();
  if (typeof s.samples_total === "number") {
    if (lastSamples && now > lastSamples.t) {
      const rate = Math.max(0, (s.samples_total - lastSamples.samples) / ((now - lastSamples.t) / 1000));
      setText("s-rate", rate.toFixed(rate < 10 ? 2 : 1));
    } else {
      setText("s-rate", "…");
    }
    lastSamples = { samples: s.samples_total, t: now };
  }

  const maddrs = Array.isArray(s.maddrs) ? s.maddrs : [];
  setText("join-cmd", maddrs.length ? `dtrain-node --initial-peers ${maddrs[0]}` : "(node has no listen address yet)");
  setText("peer-id", s.peer_id || "–");
  setText("reachability", describeReachability(s.reachability));
  setText("swarm-kind", describeSwarm(s));
  setText("device", describeDevice(s.device));
  setText("params-sha", s.params_sha256 ? s.params_sha256.slice(0, 16) + "…" : "–");
  $("params-sha").title = s.params_sha256 || "";

  const body = $("nodes-body");
  body.replaceChildren();
  const nodes = Array.isArray(s.nodes) ? s.nodes : [];
  if (!nodes.length) return emptyRow(body, 5, "no nodes announced yet");
  for (const n of nodes) {
    const tr = document.createElement("tr");
    const cells = [
      [n.peer_id === s.peer_id ? `${n.peer_id || "?"} (this node)` : n.peer_id || "?", "mono"],
      [fmtInt(n.step), ""],
      [n.bridge_port ?? "–", ""],
      [(Array.isArray(n.maddrs) ? n.maddrs : []).join("\n") || "–", "mono"],
      [fmtAge(n.time), ""],
    ];
    for (const [text, cls] of cells) {
      const td = document.createElement("td");
      td.textContent = String(text);
      if (cls) td.className = cls;
      td.style.whiteSpace = cls === "mono" ? "pre-wrap" : "";
      tr.append(td);
    }
    body.append(tr);
  }
}

function renderModel(info) {
  const dl = $("model-info");
  dl.replaceChildren();
  const add = (k, v) => {
    const dt = document.createElement("dt");
    dt.textContent = k;
    const dd = document.createElement("dd");
    dd.textContent = v;
    dl.append(dt, dd);
  };
  add("total params", fmtInt(info.total_params));
  for (const [k, v] of Object.entries(info.config || {})) add(k, typeof v === "number" ? fmtInt(v) : String(v));
  for (const [k, v] of Object.entries(info.train || {})) add(k, typeof v === "number" ? fmtNum(v, 6) : String(v));
}

function drawLoss(losses) {
  const vals = drawSeries($("loss-canvas"), losses);
  const last = vals[vals.length - 1];
  setText("loss-summary", vals.length ? `· ${vals.length} update${vals.length === 1 ? "" : "s"}, latest ${fmtNum(last)}` : "");
}

// a contributor's standing: refused for its record, or how much of the weight multiple its record earned
function standing(r) {
  if (r.scored_out) return "refused (403)";
  const ramp = Number(r.ramp ?? 1);
  return ramp >= 1 ? "full weight" : `new: ${Math.round(100 * ramp)}% earned`;
}

// the contributor ledger: who contributed what to this node, what it refused or clipped, and its record against
// the node's own gradient (agreeing contributions of those judged)
function renderLedger(ledger) {
  const body = $("ledger-body");
  body.replaceChildren();
  const rows = Array.isArray(ledger.contributors) ? ledger.contributors : [];
  const out = ledger.summary?.scored_out ? `, ${fmtInt(ledger.summary.scored_out)} refused` : "";
  setText("ledger-summary", `${fmtInt(ledger.summary?.contributors ?? rows.length)} known${out}`);
  if (!rows.length) return emptyRow(body, 8, "no contributions yet");
  for (const r of rows) {
    const rejected = Object.entries(r.rejected || {}).map(([why, n]) => `${n} ${why}`).join(", ") || "0";
    const judged = (r.agreed ?? 0) + (r.disagreed ?? 0);
    const agreed = judged ? `${fmtInt(r.agreed)} of ${fmtInt(judged)}` : "-";
    const tr = document.createElement("tr");
    tr.dataset.nodeId = r.node_id;
    if (r.scored_out) tr.classList.add("refused");
    for (const text of [r.node_id, fmtInt(r.accepted), rejected, fmtInt(r.outliers), fmtInt(r.samples_credited),
                        agreed, standing(r), fmtAge(r.last_seen_s)]) {
      const td = document.createElement("td");
      td.textContent = String(text);
      tr.append(td);
    }
    body.append(tr);
  }
}

/** What the node keeps of what its /v1 API serves: the operator's choice (--capture-db), said to every visitor. */
function renderCapture(models) {
  const capture = models.dtrain_capture;
  if (!capture) return;
  $("capture").textContent = capture.recording
    ? `records every completion (prompt, text, step, timing) on this node, the newest ${fmtInt(capture.max_rows)} kept; ` +
      "only the client that got a completion can reward it"
    : "records nothing it serves (no --capture-db) and takes no feedback";
}

async function poll() {
  const [losses, info, ledger, models] = await Promise.allSettled([
    getJSON("/api/v1/server/losses"),
    getJSON("/api/v1/model/info"),
    getJSON("/api/v1/contributors?limit=50"),
    getJSON("/v1/models"),
  ]);
  if (ledger.status === "fulfilled") renderLedger(ledger.value);
  if (models.status === "fulfilled") renderCapture(models.value);
  if (losses.status === "fulfilled") {
    lastLosses = losses.value;
    drawLoss(lastLosses);
  }
  if (info.status === "fulfilled") renderModel(info.value);
}

async function loop() {
  try {
    await poll();
  } catch (e) {
    console.error("dashboard poll:", e);
  }
  setTimeout(loop, POLL_MS);
}

$("copy-btn").addEventListener("click", async () => {
  const text = $("join-cmd").textContent;
  try {
    await navigator.clipboard.writeText(text);
    $("copy-btn").textContent = "Copied";
  } catch {
    const r = document.createRange();
    r.selectNodeContents($("join-cmd"));
    const sel = getSelection();
    sel.removeAllRanges();
    sel.addRange(r);
    $("copy-btn").textContent = "Selected";
  }
  setTimeout(() => ($("copy-btn").textContent = "Copy"), 1500);
});
window.addEventListener("resize", () => drawLoss(lastLosses));

mountSite({ pollMs: POLL_MS }).subscribe((status, error) => {
  setConnected(!error, error);
  if (status) renderStatus(status);
  else lastSamples = null;
});
drawLoss([]);
loop();
