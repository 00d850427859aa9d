// Dashboard for a dtrain node: polls the bridge API every 2 s and renders stats, nodes and the loss curve.

const POLL_MS = 2000;
const $ = (id) => document.getElementById(id);

let lastSamples = null; // {samples, t} from the previous successful poll
let lastLosses = [];

async function getJSON(path) {
  const ctrl = new AbortController();
  const timer = setTimeout(() => ctrl.abort(), 5000);
  try {
    const r = await fetch(path, { cache: "no-store", signal: ctrl.signal });
    if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
    return await r.json();
  } finally {
    clearTimeout(timer);
  }
}

const fmtInt = (v) => (typeof v === "number" && isFinite(v) ? v.toLocaleString("en-US") : "–");

function fmtNum(v, digits = 4) {
  if (typeof v !== "number" || !isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  return Number(v.toFixed(digits)).toString();
}

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

function setConnected(ok, msg) {
  $("status-dot").className = "dot " + (ok ? "ok" : "bad");
  setText("status-text", ok ? `live · updated ${new Date().toLocaleTimeString()}` : "unreachable");
  const banner = $("banner");
  if (ok) {
    banner.style.display = "none";
  } else {
    banner.textContent = `Cannot reach the node (${msg}). Retrying every ${POLL_MS / 1000} s…`;
    banner.style.display = "block";
  }
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
  const canvas = $("loss-canvas");
  const dpr = window.devicePixelRatio || 1;
  const cssW = canvas.clientWidth || 700;
  const cssH = canvas.clientHeight || 260;
  if (canvas.width !== Math.round(cssW * dpr) || canvas.height !== Math.round(cssH * dpr)) {
    canvas.width = Math.round(cssW * dpr);
    canvas.height = Math.round(cssH * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, cssW, cssH);
  ctx.font = "12px system-ui, sans-serif";

  const vals = (Array.isArray(losses) ? losses : []).filter((v) => typeof v === "number" && isFinite(v));
  if (!vals.length) {
    setText("loss-summary", "");
    ctx.fillStyle = "#6b7385";
    ctx.textAlign = "center";
    ctx.fillText("no loss values yet", cssW / 2, cssH / 2);
    return;
  }
  const last = vals[vals.length - 1];
  setText("loss-summary", `· ${vals.length} update${vals.length === 1 ? "" : "s"}, latest ${fmtNum(last)}`);

  const pad = { l: 56, r: 14, t: 12, b: 30 };
  const w = cssW - pad.l - pad.r;
  const h = cssH - pad.t - pad.b;
  let lo = Math.min(...vals);
  let hi = Math.max(...vals);
  if (hi - lo < 1e-9) { lo -= 0.5; hi += 0.5; } // flat line / single point
  const x = (i) => pad.l + (vals.length === 1 ? w / 2 : (i / (vals.length - 1)) * w);
  const y = (v) => pad.t + (1 - (v - lo) / (hi - lo)) * h;

  // grid + axes
  ctx.strokeStyle = "#e3e6ec";
  ctx.lineWidth = 1;
  for (let k = 0; k <= 4; k++) {
    const yy = Math.round(pad.t + (k / 4) * h) + 0.5;
    ctx.beginPath(); ctx.moveTo(pad.l, yy); ctx.lineTo(pad.l + w, yy); ctx.stroke();
  }
  ctx.strokeStyle = "#9aa1b0";
  ctx.beginPath();
  ctx.moveTo(pad.l + 0.5, pad.t); ctx.lineTo(pad.l + 0.5, pad.t + h + 0.5); ctx.lineTo(pad.l + w, pad.t + h + 0.5);
  ctx.stroke();

  // labels: y max/min, x first/last update index
  ctx.fillStyle = "#6b7385";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  ctx.fillText(fmtNum(hi, 3), pad.l - 6, pad.t);
  ctx.fillText(fmtNum(lo, 3), pad.l - 6, pad.t + h);
  ctx.textBaseline = "top";
  ctx.textAlign = "left";
  ctx.fillText("1", pad.l, pad.t + h + 6);
  ctx.textAlign = "right";
  ctx.fillText(String(vals.length), pad.l + w, pad.t + h + 6);
  ctx.textAlign = "center";
  ctx.fillText("update", pad.l + w / 2, pad.t + h + 6);

  // curve
  ctx.strokeStyle = "#2f6fde";
  ctx.lineWidth = 2;
  ctx.lineJoin = "round";
  ctx.beginPath();
  vals.forEach((v, i) => (i ? ctx.lineTo(x(i), y(v)) : ctx.moveTo(x(i), y(v))));
  ctx.stroke();
  ctx.fillStyle = "#2f6fde";
  ctx.beginPath();
  ctx.arc(x(vals.length - 1), y(last), 3.5, 0, Math.PI * 2);
  ctx.fill();
}

// the contributor ledger: who contributed what to this node, and what it refused or clipped
function renderLedger(ledger) {
  const body = $("ledger-body");
  body.replaceChildren();
  const rows = Array.isArray(ledger.contributors) ? ledger.contributors : [];
  setText("ledger-summary", `${fmtInt(ledger.summary?.contributors ?? rows.length)} known`);
  if (!rows.length) return emptyRow(body, 6, "no contributions yet");
  for (const r of rows) {
    const rejected = Object.entries(r.rejected || {}).map(([why, n]) => `${n} ${why}`).join(", ") || "0";
    const tr = document.createElement("tr");
    tr.dataset.nodeId = r.node_id;
    for (const text of [r.node_id, fmtInt(r.accepted), rejected, fmtInt(r.outliers), fmtInt(r.samples_credited),
                        fmtAge(r.last_seen_s)]) {
      const td = document.createElement("td");
      td.textContent = String(text);
      tr.append(td);
    }
    body.append(tr);
  }
}

async function poll() {
  const [status, losses, info, ledger] = await Promise.allSettled([
    getJSON("/api/v1/swarm/status"),
    getJSON("/api/v1/server/losses"),
    getJSON("/api/v1/model/info"),
    getJSON("/api/v1/contributors?limit=50"),
  ]);
  if (ledger.status === "fulfilled") renderLedger(ledger.value);
  if (status.status === "fulfilled") {
    setConnected(true);
    renderStatus(status.value);
  } else {
    setConnected(false, status.reason && status.reason.name === "AbortError" ? "timeout" : String(status.reason?.message || status.reason));
    lastSamples = null;
  }
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
    setConnected(false, String(e));
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

drawLoss([]);
loop();
