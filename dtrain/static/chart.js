// A line chart of one series on a <canvas> (no dependency): the node's loss per update on the dashboard, this
// browser's loss per contribution on /contribute. Non-finite values are left out.

export const LINE_COLOR = "#2f6fde"; // site.css --accent; the browser tests count the curve's pixels by it

/** Format a number with at most `digits` decimals; tiny or huge ones in exponent form. */
export function fmtNum(v, digits = 4) {
  if (typeof v !== "number" || !Number.isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  return Number(v.toFixed(digits)).toString();
}

/** Draw `values` on `canvas` at its CSS size; returns the finite values drawn. */
export function drawSeries(canvas, values, { xLabel = "update", emptyText = "no loss values yet" } = {}) {
  const dpr = window.devicePixelRatio || 1;
  const cssW = canvas.clientWidth || 700;
  const cssH = canvas.clientHeight || 240;
  if (canvas.width !== Math.round(cssW * dpr) || canvas.height !== Math.round(cssH * dpr)) {
    canvas.width = Math.round(cssW * dpr);
    canvas.height = Math.round(cssH * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, cssW, cssH);
  ctx.font = "12px system-ui, sans-serif";

  const vals = (Array.isArray(values) ? values : []).filter((v) => typeof v === "number" && Number.isFinite(v));
  if (!vals.length) {
    ctx.fillStyle = "#6b7385";
    ctx.textAlign = "center";
    ctx.fillText(emptyText, cssW / 2, cssH / 2);
    return vals;
  }
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

  // labels: y max/min, x first/last index
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
  ctx.fillText(xLabel, pad.l + w / 2, pad.t + h + 6);

  // curve, and a dot on the latest value
  ctx.strokeStyle = LINE_COLOR;
  ctx.lineWidth = 2;
  ctx.lineJoin = "round";
  ctx.beginPath();
  vals.forEach((v, i) => (i ? ctx.lineTo(x(i), y(v)) : ctx.moveTo(x(i), y(v))));
  ctx.stroke();
  ctx.fillStyle = LINE_COLOR;
  ctx.beginPath();
  ctx.arc(x(vals.length - 1), y(vals[vals.length - 1]), 3.5, 0, Math.PI * 2);
  ctx.fill();
  return vals;
}

