// DGRD v1 gradient packet encoder for the browser (main thread or Web Worker), no dependencies.
//
// Mirrors bridge/dgrd.py `encode` and `topk_sections` byte for byte (see
// training-server-api-v1.md, "Binary Gradient Packet: DGRD v1"). All fields little-endian:
//   "DGRD" u16 version=1, u16 flags, u32 step, u32 node_id_len, node_id (UTF-8),
//   f32 train_loss, u32 samples, u32 n_tensors, then per section u32 tensor_id, u32 nnz, body:
//   nnz == 0            Mode 3: every element as f16 (dense)
//   nnz > 0, flags == 0 Mode 1: nnz x (u32 index, f32 value), kept as given (repeats included)
//   nnz > 0, flags == 1 Mode 2: nnz x (u8 skip, f16 value); indices sorted, repeats summed
//                       (in float64, in input order, like numpy bincount), steps > 256 bridged
//                       with zero-valued filler entries of skip 255.
// A sparse section with no entries is left out, as in Python.

export const FLAGS_MODE1 = 0;
export const FLAGS_MODE2 = 1;
export const MAX_NODE_ID_BYTES = 256;
const MAX_SKIP = 255;
const U32_LIMIT = 4294967296;

const _f32 = new Float32Array(1);
const _u32 = new Uint32Array(_f32.buffer);

// Round a non-negative double holding at most 53 significant bits to an integer, ties to even.
function roundHalfEven(y) {
  const r = Math.floor(y);
  const d = y - r;
  if (d > 0.5 || (d === 0.5 && r % 2 === 1)) return r + 1;
  return r;
}

/**
 * float32 -> float16 bits, round-to-nearest-even exactly like numpy's astype(np.float16),
 * subnormals included. Returns -1 when the result is not finite (NaN, +-inf, or overflow).
 */
export function f32ToF16Bits(x) {
  _f32[0] = x;
  const bits = _u32[0];
  const sign = (bits >>> 16) & 0x8000;
  const exp = (bits >>> 23) & 0xff;
  if (exp === 0xff) return -1; // inf or NaN
  const a = Math.abs(_f32[0]);
  if (a >= 65520) return -1; // rounds to inf in float16
  if (a < 6.103515625e-05) {
    // float16 subnormal range (below 2^-14): units of 2^-24; 1024 carries into the smallest normal
    return sign | roundHalfEven(a * 16777216);
  }
  const e = exp - 127; // -14..15 here
  const r = roundHalfEven(a * Math.pow(2, 10 - e)); // 1024..2048, exact power-of-two scaling
  return sign | (((e + 15) << 10) + (r - 1024));
}

/** float16 bits -> number. */
export function f16BitsToF32(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >>> 10) & 0x1f;
  const mant = h & 0x3ff;
  if (exp === 0) return sign * mant * Math.pow(2, -24);
  if (exp === 31) return mant ? NaN : sign * Infinity;
  return sign * (1024 + mant) * Math.pow(2, exp - 25);
}

/** The value the server decodes after a float16 round trip. */
export function f16Round(x) {
  const h = f32ToF16Bits(x);
  if (h < 0) throw new RangeError(`value ${x} not finite or beyond float16 range`);
  return f16BitsToF32(h);
}

function toF16(tid, values) {
  const out = new Uint16Array(values.length);
  for (let i = 0; i < values.length; i++) {
    const h = f32ToF16Bits(values[i]);
    if (h < 0) throw new RangeError(`tensor ${tid}: value not finite or beyond float16 range`);
    out[i] = h;
  }
  return out;
}

function checkU32(name, v) {
  if (!Number.isInteger(v) || v < 0 || v >= U32_LIMIT) throw new RangeError(`${name} ${v} not a u32`);
}

// Mode 2 body for one sparse section: sort + merge repeats when not strictly increasing, bridge.
function mode2Body(tid, indices, values) {
  let n = indices.length;
  let inc = true;
  for (let i = 1; i < n; i++) if (!(indices[i] > indices[i - 1])) { inc = false; break; }
  let idx = indices;
  let vals = values; // float32 values as given
  if (!inc) {
    // np.unique + np.bincount(weights=): float64 sums starting at 0, in input order
    const order = Array.from({ length: n }, (_, i) => i);
    order.sort((p, q) => indices[p] - indices[q] || p - q);
    const ui = [];
    const uv = [];
    for (const p of order) {
      const j = indices[p];
      if (ui.length === 0 || ui[ui.length - 1] !== j) { ui.push(j); uv.push(0); }
      uv[uv.length - 1] += values[p]; // stable sort: input order within one index
    }
    idx = ui;
    vals = Float32Array.from(uv); // float64 -> float32 (as _to_f16 does) before float16
    n = ui.length;
  }
  const half = toF16(tid, vals);
  let total = 0;
  let prev = -1;
  for (let i = 0; i < n; i++) {
    const step = idx[i] - prev;
    total += Math.floor((step - 1) / (MAX_SKIP + 1)) + 1;
    prev = idx[i];
  }
  const body = new Uint8Array(total * 3); // zero fillers: value 0x0000
  let pos = 0;
  prev = -1;
  for (let i = 0; i < n; i++) {
    const step = idx[i] - prev;
    const per = Math.floor((step - 1) / (MAX_SKIP + 1)) + 1;
    for (let f = 0; f < per - 1; f++) { body[pos] = MAX_SKIP; pos += 3; }
    body[pos] = step - (MAX_SKIP + 1) * (per - 1) - 1;
    body[pos + 1] = half[i] & 0xff;
    body[pos + 2] = half[i] >>> 8;
    pos += 3;
    prev = idx[i];
  }
  return { nnz: total, body };
}

/**
 * Build one DGRD v1 packet.
 * sections: [{tensorId, indices: Uint32Array|number[]|null, values: Float32Array|number[]}];
 * indices null sends the tensor dense (Mode 3, f16). Throws RangeError where Python raises.
 */
export function encodeDGRD({ step, nodeId, trainLoss, samples, sections, flags = FLAGS_MODE1 }) {
  if (flags !== FLAGS_MODE1 && flags !== FLAGS_MODE2) throw new RangeError(`flags ${flags} not in (0, 1)`);
  const nid = new TextEncoder().encode(nodeId);
  if (nid.length < 1 || nid.length > MAX_NODE_ID_BYTES) {
    throw new RangeError(`node_id is ${nid.length} bytes in UTF-8, must be 1..${MAX_NODE_ID_BYTES}`);
  }
  if (!Number.isInteger(samples) || samples < 1 || samples >= U32_LIMIT) {
    throw new RangeError(`samples ${samples} not in 1..2**32-1`);
  }
  checkU32('step', step);
  const loss32 = Math.fround(trainLoss);
  if (!Number.isFinite(loss32)) throw new RangeError(`train_loss ${trainLoss} is not finite as float32`);

  const parts = []; // [tid, nnz, Uint8Array body]
  for (const s of sections) {
    const tid = s.tensorId;
    checkU32('tensor_id', tid);
    const values = s.values instanceof Float32Array ? s.values : Float32Array.from(s.values);
    if (s.indices == null) {
      const half = toF16(tid, values);
      parts.push([tid, 0, new Uint8Array(half.buffer, half.byteOffset, half.byteLength)]);
      continue;
    }
    const indices = s.indices;
    if (indices.length !== values.length) {
      throw new RangeError(`tensor ${tid}: ${indices.length} indices but ${values.length} values`);
    }
    if (indices.length === 0) continue;
    for (let i = 0; i < indices.length; i++) {
      const j = indices[i];
      if (!Number.isInteger(j) || j < 0 || j >= U32_LIMIT) throw new RangeError(`tensor ${tid}: index out of u32 range`);
    }
    if (flags === FLAGS_MODE1) {
      const n = indices.length;
      const body = new Uint8Array(n * 8);
      const dv = new DataView(body.buffer);
      for (let i = 0; i < n; i++) {
        if (!Number.isFinite(values[i])) throw new RangeError(`tensor ${tid}: value not finite`);
        dv.setUint32(i * 8, indices[i], true);
        dv.setFloat32(i * 8 + 4, values[i], true);
      }
      parts.push([tid, n, body]);
    } else {
      const { nnz, body } = mode2Body(tid, indices, values);
      parts.push([tid, nnz, body]);
    }
  }

  let size = 16 + nid.length + 12;
  for (const [, , body] of parts) size += 8 + body.length;
  const out = new Uint8Array(size);
  const dv = new DataView(out.buffer);
  out.set([0x44, 0x47, 0x52, 0x44], 0); // "DGRD"
  dv.setUint16(4, 1, true);
  dv.setUint16(6, flags, true);
  dv.setUint32(8, step, true);
  dv.setUint32(12, nid.length, true);
  out.set(nid, 16);
  let pos = 16 + nid.length;
  dv.setFloat32(pos, loss32, true);
  dv.setUint32(pos + 4, samples, true);
  dv.setUint32(pos + 8, parts.length, true);
  pos += 12;
  for (const [tid, nnz, body] of parts) {
    dv.setUint32(pos, tid, true);
    dv.setUint32(pos + 4, nnz, true);
    out.set(body, pos + 8);
    pos += 8 + body.length;
  }
  return out;
}

// Magnitudes compared as float32 bit patterns with the sign cleared: for non-negative floats the patterns order as
// the values do. Every NaN maps to one pattern just above +infinity (NaN counts as the largest magnitude).
const ABS_MASK = 0x7fffffff;
const INF_BITS = 0x7f800000;
const NAN_MAG = INF_BITS + 1;

/**
 * Exact top-k threshold in linear time, no sort and no copy of the data: a histogram of the magnitudes' high 16
 * bits finds the bucket holding the k-th largest, a histogram of the low 16 bits inside that bucket finds the
 * value itself. Holds its two histograms (256 KB each) for reuse across tensors.
 */
export class TopKSelector {
  constructor() {
    this.high = new Uint32Array(65536);
    this.low = new Uint32Array(65536);
  }

  /** residual += grad, element by element, counting the sums' high bits as it goes (select(residual, k, true)). */
  accumulate(residual, grad) {
    const n = residual.length, high = this.high;
    const bits = new Uint32Array(residual.buffer, residual.byteOffset, n);
    high.fill(0);
    for (let i = 0; i < n; i++) {
      residual[i] += grad[i];
      high[(bits[i] >>> 16) & 0x7fff]++;
    }
  }

  /**
   * [t, ties]: the k-th largest magnitude of `bits` (as a pattern) and how many entries equal to it to keep.
   * counted: the high histogram already holds these bits (accumulate).
   */
  threshold(bits, k, counted = false) {
    const n = bits.length, high = this.high, low = this.low;
    if (!counted) {
      high.fill(0);
      for (let i = 0; i < n; i++) high[(bits[i] >>> 16) & 0x7fff]++; // the sign bit dropped: |x|'s high 16 bits
    }
    let b = 0x7fff, above = 0;
    while (above + high[b] < k) above += high[b--];
    // The bucket of +infinity and NaN, whose patterns differ while their order here must not: only a gradient with
    // k entries of infinity or NaN gets here, and is counted again with every NaN as one magnitude.
    if (b >= INF_BITS >>> 16) return this._thresholdNaNAsOne(bits, k);
    low.fill(0);
    for (let i = 0; i < n; i++) {
      const a = bits[i] & ABS_MASK;
      if (a >>> 16 === b) low[a & 0xffff]++;
    }
    let c = 0xffff;
    while (above + low[c] < k) above += low[c--];
    return [(b << 16) | c, k - above];
  }

  _thresholdNaNAsOne(bits, k) {
    const mags = new Uint32Array(bits.length);
    for (let i = 0; i < bits.length; i++) { const a = bits[i] & ABS_MASK; mags[i] = a > INF_BITS ? NAN_MAG : a; }
    const sorted = mags.slice().sort();
    const t = sorted[bits.length - k];
    let above = 0;
    for (let i = 0; i < mags.length; i++) if (mags[i] > t) above++;
    return [t, k - above];
  }

  /**
   * {indices, values} of the k largest magnitudes of `flat` (a Float32Array), ascending indices, lowest on ties.
   * counted: `flat` was just accumulated (its high histogram is counted).
   */
  select(flat, k, counted = false) {
    const n = flat.length;
    const bits = new Uint32Array(flat.buffer, flat.byteOffset, n);
    const [t, keepTies] = this.threshold(bits, k, counted);
    let ties = keepTies;
    const indices = new Uint32Array(k);
    const values = new Float32Array(k);
    let m = 0;
    for (let i = 0; i < n && m < k; i++) {
      let a = bits[i] & ABS_MASK;
      if (a > INF_BITS) a = NAN_MAG;
      if (a > t || (a === t && ties-- > 0)) { indices[m] = i; values[m] = flat[i]; m++; }
    }
    return { indices, values };
  }
}

function checkFraction(fraction) {
  if (!(fraction > 0 && fraction <= 1)) throw new RangeError(`fraction ${fraction} not in (0, 1]`);
}

// how many of a tensor's n entries top-k keeps: max(1, round-half-even(n * fraction)); n or more means dense
function keptEntries(n, fraction) {
  return Math.max(1, roundHalfEven(n * fraction));
}

/**
 * Keep the `fraction` largest-magnitude entries of each gradient (at least one), like Python's
 * topk_sections: k = max(1, round-half-even(n * fraction)); a tensor keeping every element is
 * sent dense. Indices come out ascending; values are copies.
 * Tie-breaking differs: numpy's argpartition picks among equal magnitudes at the threshold in an
 * unspecified order, this keeps the lowest indices. Results match Python when the threshold
 * magnitude is unique (e.g. random data). NaN counts as the largest magnitude.
 */
export function topK(grads, fraction, selector = new TopKSelector()) {
  checkFraction(fraction);
  const out = [];
  grads.forEach((g, tid) => {
    const flat = g instanceof Float32Array ? g : Float32Array.from(g);
    const n = flat.length;
    const k = keptEntries(n, fraction);
    if (k >= n) { out.push({ tensorId: tid, indices: null, values: flat.slice() }); return; }
    out.push({ tensorId: tid, ...selector.select(flat, k) });
  });
  return out;
}

/**
 * Error feedback for top-k sparsification: residual += grad; send topK(residual); residual -= sent.
 * `sent` is what the server will decode: exact float32 in Mode 1, float16-rounded in Mode 2 and
 * for dense sections, so quantization error is carried into the next step too.
 */
export class ErrorFeedback {
  constructor(fraction, flags = FLAGS_MODE1) {
    this.fraction = fraction;
    this.flags = flags;
    this.residuals = null;
    this.selector = new TopKSelector();
  }

  /** Add this step's gradients and return the sections to encode. */
  step(grads) {
    checkFraction(this.fraction);
    if (this.residuals === null) this.residuals = grads.map((g) => new Float32Array(g.length));
    if (grads.length !== this.residuals.length) throw new RangeError('tensor count changed');
    grads.forEach((g, t) => {
      if (g.length !== this.residuals[t].length) throw new RangeError(`tensor ${t}: size changed`);
    });
    // as topK(residuals + grads): one pass adds and counts, the selection reads each residual once more
    const sections = grads.map((g, t) => {
      const r = this.residuals[t];
      const k = keptEntries(r.length, this.fraction);
      if (k < r.length) {
        this.selector.accumulate(r, g);
        return { tensorId: t, ...this.selector.select(r, k, true) };
      }
      for (let i = 0; i < r.length; i++) r[i] += g[i];
      return { tensorId: t, indices: null, values: r.slice() };
    });
    for (const s of sections) {
      const r = this.residuals[s.tensorId];
      if (s.indices === null) {
        for (let i = 0; i < r.length; i++) r[i] -= f16Round(s.values[i]);
      } else {
        const q = this.flags === FLAGS_MODE2;
        for (let m = 0; m < s.indices.length; m++) {
          r[s.indices[m]] -= q ? f16Round(s.values[m]) : s.values[m];
        }
      }
    }
    return sections;
  }

  reset() { this.residuals = null; }
}
