// Split-inference client (the phone's half of the protocol). Plain ES module: browser and Node (>= 18).
// Embedding lookup, tied LM head and sampling run here; only embedding vectors go to the node.
// Transport: WebSocket /api/v1/split/stream when globalThis.WebSocket exists, else POST /api/v1/split/forward.

import { F16, cacheGet, cachePut } from "./weights.js";

const RESTART_CODES = ["stale_session", "no_session"];

export class SplitClientError extends Error {
  constructor(message, code = null) { super(message); this.code = code; }
}

function toBase64(bytes) {
  let s = ""; // chunked: String.fromCharCode.apply has an argument limit
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(s);
}
function fromBase64(str) {
  const s = atob(str), out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
  return out;
}
const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

function f32ToBytes(arr) {
  if (LITTLE_ENDIAN) return new Uint8Array(arr.buffer, arr.byteOffset, arr.byteLength);
  const out = new Uint8Array(arr.length * 4), v = new DataView(out.buffer);
  arr.forEach((x, i) => v.setFloat32(i * 4, x, true));
  return out;
}
function bytesToF32(bytes) {
  const v = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength), out = new Float32Array(bytes.length >> 2);
  for (let i = 0; i < out.length; i++) out[i] = v.getFloat32(i * 4, true);
  return out;
}
/** `hidden` plus N(0, sigma^2) on every coordinate (Box-Muller), in place; the protocol's client-side noise (step 5). */
export function addGaussianNoise(hidden, sigma, random = Math.random) {
  if (!(sigma > 0)) return hidden;
  for (let i = 0; i < hidden.length; i += 2) {
    const u = 1 - random(), v = random(); // u in (0, 1]: log(u) is finite
    const r = sigma * Math.sqrt(-2 * Math.log(u));
    hidden[i] += r * Math.cos(2 * Math.PI * v);
    if (i + 1 < hidden.length) hidden[i + 1] += r * Math.sin(2 * Math.PI * v);
  }
  return hidden;
}

function newSessionId() {
  if (globalThis.crypto?.randomUUID) return globalThis.crypto.randomUUID().replace(/-/g, "");
  return Array.from({ length: 32 }, () => Math.floor(Math.random() * 16).toString(16)).join("");
}

export class SplitClient {
  constructor(baseUrl = "") {
    this.baseUrl = baseUrl.replace(/\/+$/, "");
    this.config = null;
    this.wte = null; // Uint16Array [V * d] f16 bits (tied with the LM head)
    this.lastAnswer = {}; // the node's last forward answer (total_ms, he_active, dp_sigma, ...)
    this.sessionId = null; // the session id of the latest generate()
    this.ws = null;
    this._wsQueue = Promise.resolve();
  }

  async init({ useWebSocket = true } = {}) {
    const r = await fetch(`${this.baseUrl}/api/v1/split/config`);
    if (!r.ok) throw new SplitClientError(`config: HTTP ${r.status}`);
    this.config = await r.json();
    if (useWebSocket && globalThis.WebSocket) await this._openSocket().catch(() => (this.ws = null));
    await this.loadWeights();
    return this;
  }

  async loadWeights() {
    const cfg = this.config;
    const path = cfg.embedding_tensor_id != null ? `/api/v1/model/tensor/${cfg.embedding_tensor_id}` : cfg.embedding_url;
    const url = `${this.baseUrl}${path}?format=f16`;
    const key = `${cfg.model}:${path}:${cfg.step}`;
    let buf = await cacheGet(key);
    if (!buf) {
      const r = await fetch(url);
      if (!r.ok) throw new SplitClientError(`GET ${path}: HTTP ${r.status}`);
      buf = await r.arrayBuffer();
      await cachePut(key, buf);
    }
    const want = cfg.vocab_size * cfg.hidden_size * 2;
    if (buf.byteLength !== want) throw new SplitClientError(`GET ${path}: ${buf.byteLength} bytes, expected ${want}`);
    this.wte = new Uint16Array(buf);
    if (!LITTLE_ENDIAN) for (let i = 0; i < this.wte.length; i++) this.wte[i] = (this.wte[i] >> 8) | ((this.wte[i] & 0xff) << 8);
  }

  _openSocket() {
    const url = (this.baseUrl || globalThis.location.origin).replace(/^http/, "ws") + "/api/v1/split/stream";
    return new Promise((resolve, reject) => {
      const ws = new globalThis.WebSocket(url);
      const timer = setTimeout(() => { ws.close(); reject(new Error("WebSocket timeout")); }, 5000);
      ws.onopen = () => { clearTimeout(timer); this.ws = ws; resolve(); };
      ws.onerror = () => { clearTimeout(timer); reject(new Error("WebSocket failed")); };
      ws.onclose = () => { if (this.ws === ws) this.ws = null; };
    });
  }

  get usingWebSocket() { // prefer the socket only while it is open
    return !!(this.ws && globalThis.WebSocket && this.ws.readyState === globalThis.WebSocket.OPEN);
  }

  _wsRequest(message) {
    const ws = this.ws;
    const run = () => new Promise((resolve, reject) => {
      ws.onmessage = (ev) => { ws.onmessage = null; try { resolve(JSON.parse(ev.data)); } catch (e) { reject(e); } };
      ws.onclose = () => { if (this.ws === ws) this.ws = null; reject(new Error("socket closed")); };
      ws.send(JSON.stringify(message));
    });
    const p = this._wsQueue.then(run, run); // one request in flight: answers come back in order
    this._wsQueue = p.catch(() => {});
    return p;
  }

  async request(message) {
    let answer = null;
    if (this.usingWebSocket) {
      try {
        answer = await this._wsRequest(message);
      } catch {
        try { this.ws?.close(); } catch { /* already closed */ }
        this.ws = null; // fall back to HTTP
      }
    }
    if (answer === null) {
      const route = { forward: "/api/v1/split/forward", tokenize: "/api/v1/split/tokenize" }[message.type];
      if (!route) throw new SplitClientError(`no HTTP route for message type ${message.type}`);
      const r = await fetch(this.baseUrl + route, {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(message),
      });
      const body = await r.json().catch(() => ({}));
      answer = r.ok ? body : { type: "error", message: body.message || `HTTP ${r.status}`, code: body.code };
    }
    if (answer.type === "error") throw new SplitClientError(answer.message || "error", answer.code);
    return answer;
  }

  async tokenize(text) { return (await this.request({ type: "tokenize", text })).token_ids; }

  /** Float32Array [d]: the embedding row of one token. */
  embed(tokenId) {
    const d = this.config.hidden_size, out = new Float32Array(d), off = tokenId * d;
    for (let j = 0; j < d; j++) out[j] = F16[this.wte[off + j]];
    return out;
  }

  /** Float32Array [ids.length * d]: embedding rows, concatenated. */
  embedMany(ids) {
    const d = this.config.hidden_size, out = new Float32Array(ids.length * d);
    ids.forEach((t, i) => out.set(this.embed(t), i * d));
    return out;
  }

  /** Float32Array [V] logits = hidden [d] @ wte^T (tied LM head). */
  lmHead(hidden) {
    const V = this.config.vocab_size, d = this.config.hidden_size, w = this.wte, out = new Float32Array(V);
    for (let v = 0, off = 0; v < V; v++, off += d) {
      let acc = 0;
      for (let j = 0; j < d; j++) acc += hidden[j] * F16[w[off + j]];
      out[v] = acc;
    }
    return out;
  }

  /** One token id from logits (greedy when temperature is 0); mirrors clients/split_client.py `sample`. */
  sample(logits, { temperature = 0, topK = 0, topP = 1.0, repetitionPenalty = 1.0, previousIds = [] } = {}) {
    if (repetitionPenalty !== 1.0 && previousIds.length) {
      logits = Float32Array.from(logits);
      for (const id of new Set(previousIds)) {
        const x = logits[id];
        logits[id] = x < 0 ? x * repetitionPenalty : x / repetitionPenalty;
      }
    }
    if (!(temperature > 0)) {
      let best = 0;
      for (let i = 1; i < logits.length; i++) if (logits[i] > logits[best]) best = i;
      return best;
    }
    let order = Array.from(logits.keys()).sort((a, b) => logits[b] - logits[a] || a - b);
    if (topK > 0) order = order.slice(0, topK);
    const top = order.map((i) => logits[i] / temperature), mx = top[0];
    let probs = top.map((x) => Math.exp(x - mx));
    let sum = probs.reduce((a, b) => a + b, 0);
    probs = probs.map((p) => p / sum);
    if (topP < 1.0) {
      let c = 0, keep = probs.length;
      for (let i = 0; i < probs.length; i++) if ((c += probs[i]) >= topP) { keep = i + 1; break; }
      order = order.slice(0, keep); probs = probs.slice(0, keep);
      sum = probs.reduce((a, b) => a + b, 0);
      probs = probs.map((p) => p / sum);
    }
    let r = Math.random();
    for (let i = 0; i < probs.length; i++) if ((r -= probs[i]) < 0) return order[i];
    return order[order.length - 1];
  }

  /** pre-activations Float32Array [seqLen * d] for embeddings `hidden` [seqLen * d]. */
  async forward(hidden, seqLen, { sessionId = null, incremental = false, expertName = null, useHe = false } = {}) {
    const d = this.config.hidden_size;
    const answer = await this.request({
      type: "forward", hidden_states: toBase64(f32ToBytes(hidden)), seq_len: seqLen, hidden_dim: d,
      expert_name: expertName, use_he: useHe, session_id: sessionId, incremental,
    });
    this.lastAnswer = answer;
    const out = bytesToF32(fromBase64(answer.pre_activations));
    if (out.length % d) throw new SplitClientError(`pre_activations of ${out.length} floats is not whole ${d}-rows`);
    return out;
  }

  /**
   * New token ids after promptIds; onToken(id, index) is called as each arrives. opts: temperature, topK, topP,
   * repetitionPenalty, stopTokenIds, expertName, useHe, noiseSigma (client-side Gaussian noise on every embedding
   * sent: what the node can recover of the prompt against what survives of the answer, docs/split-privacy.md).
   */
  async generate(promptIds, maxNewTokens = 32, opts = {}, onToken = null) {
    const ids = promptIds.map(Number), d = this.config.hidden_size, maxLen = this.config.max_seq_len;
    if (!ids.length) throw new Error("the prompt has no tokens");
    const noiseSigma = Number(opts.noiseSigma ?? 0);
    if (!(noiseSigma >= 0 && Number.isFinite(noiseSigma))) {
      throw new SplitClientError(`noiseSigma must be a number >= 0, got ${opts.noiseSigma}`);
    }
    const embed = (part) => addGaussianNoise(this.embedMany(part), noiseSigma);
    const fwd = { expertName: opts.expertName ?? null, useHe: !!opts.useHe };
    const stop = new Set(opts.stopTokenIds || []);
    const sessionId = newSessionId(), fresh = [];
    this.sessionId = sessionId; // the node's KV-cache session of this generation
    let sent = 0;
    while (fresh.length < maxNewTokens && ids.length <= maxLen) {
      let pre;
      if (sent) {
        try {
          pre = await this.forward(embed(ids.slice(sent)), ids.length - sent, { ...fwd, sessionId, incremental: true });
        } catch (e) {
          if (!RESTART_CODES.includes(e.code)) throw e;
          await this.loadWeights(); // the model moved or the cache expired: fresh weights, whole sequence again
          pre = await this.forward(embed(ids), ids.length, { ...fwd, sessionId, incremental: false });
        }
      } else {
        pre = await this.forward(embed(ids), ids.length, { ...fwd, sessionId, incremental: false });
      }
      sent = ids.length;
      const logits = this.lmHead(pre.subarray(pre.length - d));
      const token = this.sample(logits, { ...opts, previousIds: ids });
      fresh.push(token);
      ids.push(token);
      if (onToken) await onToken(token, fresh.length - 1);
      if (stop.has(token)) break;
    }
    return fresh;
  }

  close() {
    try { this.ws?.close(); } catch { /* already closed */ }
    this.ws = null;
  }
}

export default SplitClient;
