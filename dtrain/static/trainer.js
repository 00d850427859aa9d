// The browser contributor: downloads the node's model (FP16, cached in IndexedDB per step), takes token batches,
// computes GPT-2's gradients with TensorFlow.js on the fastest backend the browser has, and submits DGRD packets.
// Plain ES module: runs in a Web Worker (static/contribute_worker.js) or on a page.

import { disposeStepConstants, lossAndGradients, stepConstants } from "./gpt2.js";
import { ErrorFeedback, FLAGS_MODE1, encodeDGRD } from "./dgrd.js";
import { cacheDropOtherSteps, cacheGet, cachePut, f16BytesToF32 } from "./weights.js";
import { GPT2Tokenizer } from "./tokenizer.js";

export const BACKENDS = ["webgpu", "webgl", "wasm", "cpu"]; // most capable first; the fastest measured wins
const DOWNLOAD_ATTEMPTS = 3; // the step can move on while a model downloads: start again (bounded)

export class TrainerError extends Error {
  constructor(message, code = null) { super(message); this.code = code; }
}

const HEADERS_TIMEOUT_MS = 30_000; // a node that accepts a request and never answers it is as lost as a dead one

async function fetchOrThrow(url, init, what) {
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(new Error(`no answer in ${HEADERS_TIMEOUT_MS / 1000} s`)), HEADERS_TIMEOUT_MS);
  try {
    return await fetch(url, { ...init, signal: abort.signal });
  } catch (e) {
    throw new TrainerError(`the node is unreachable (${what}): ${e.message}`, "unreachable");
  } finally {
    clearTimeout(timer);
  }
}

/** A response's body as `kind` ("arrayBuffer" | "json"); a connection lost mid-body is an unreachable node. */
async function bodyOrThrow(r, kind, what) {
  try {
    return await r[kind]();
  } catch (e) {
    if (e instanceof SyntaxError) throw new TrainerError(`${what}: the node's answer is not JSON`);
    throw new TrainerError(`the node is unreachable (${what}): ${e.message}`, "unreachable");
  }
}

async function jsonOrThrow(r, what) {
  if (r.ok) return bodyOrThrow(r, "json", what);
  let message = `HTTP ${r.status}`;
  try { message = (await r.json()).message ?? message; } catch { /* not JSON */ }
  throw new TrainerError(`${what}: ${message}`, r.status);
}

/**
 * Time a small matmul-heavy probe on each backend the browser can start and switch to the fastest.
 * Returns {backend, timings: {name: ms | null}} (null: not available here).
 */
export async function chooseBackend(tf, baseUrl = "", candidates = BACKENDS) {
  if (tf.setWasmPaths) tf.setWasmPaths(`${new URL(`${baseUrl}/static/vendor/`, globalThis.location?.href)}`);
  const timings = {};
  for (const name of candidates) {
    timings[name] = null;
    try {
      if (!(await tf.setBackend(name))) continue;
      await tf.ready();
      const probe = () => tf.tidy(() => {
        const a = tf.randomNormal([192, 192]);
        let x = a;
        for (let i = 0; i < 6; i++) x = tf.tanh(tf.matMul(x, a));
        return tf.sum(x);
      });
      await probe().data(); // warm-up: shader compilation, WASM instantiation
      const t0 = performance.now();
      await probe().data();
      timings[name] = performance.now() - t0;
    } catch { timings[name] = null; }
  }
  const usable = Object.entries(timings).filter(([, ms]) => ms !== null).sort((a, b) => a[1] - b[1]);
  if (!usable.length) throw new TrainerError("no TensorFlow.js backend could start in this browser");
  await tf.setBackend(usable[0][0]);
  await tf.ready();
  return { backend: usable[0][0], timings, wasm: await wasmFeatures(tf) };
}

/**
 * What the WASM backend can use here: {isolated, simd, multithread, threads, cores}. Threads need cross-origin
 * isolation (SharedArrayBuffer: the node serves COOP/COEP); `threads` is the pool the backend started (null: not
 * started). tfjs-backend-wasm 4.22 caps its pool at half the logical cores (it assumes two hyperthreads a core),
 * so a 2-core machine gets 1 thread whatever setThreadsCount asks.
 */
export async function wasmFeatures(tf) {
  const flag = async (name) => { try { return !!(await tf.env().getAsync(name)); } catch { return null; } };
  let threads = null;
  try { // the backend's own count, once it is initialized (tfjs-backend-wasm's get_threads_count export)
    const b = tf.findBackend?.("wasm");
    if (b?.wasm?.tfjs?.getThreadsCount) threads = b.wasm.tfjs.getThreadsCount();
  } catch { threads = null; }
  return {
    isolated: !!globalThis.crossOriginIsolated,
    simd: await flag("WASM_HAS_SIMD_SUPPORT"),
    multithread: await flag("WASM_HAS_MULTITHREAD_SUPPORT"),
    threads,
    cores: globalThis.navigator?.hardwareConcurrency ?? null,
  };
}

export class BrowserTrainer {
  /**
   * tf: the TensorFlow.js module (static/vendor/tf.js). Options: nodeId, batchSize, seqLen, fraction (top-k share
   * of each gradient sent, with error feedback), text (train on this text instead of the node's batches),
   * onEvent(event) for progress.
   */
  constructor(tf, { baseUrl = "", nodeId, batchSize = 4, seqLen = 64, fraction = 0.01, text = null,
                    onEvent = () => {} } = {}) {
    this.tf = tf;
    this.baseUrl = baseUrl.replace(/\/+$/, "");
    this.nodeId = nodeId ?? `browser-${Math.random().toString(16).slice(2, 10)}`;
    this.batchSize = batchSize;
    this.seqLen = seqLen;
    this.feedback = new ErrorFeedback(fraction, FLAGS_MODE1);
    this.text = text;
    this.onEvent = onEvent;
    this.config = null;
    this.manifest = null;
    this.step = null; // the step of the loaded parameters
    this.tensors = null; // tf tensors in manifest order
    this.constants = null; // gpt2.js stepConstants of `tensors`: what every contribution at this step reuses
    // trainMs: time spent in accepted contributions (batch, gradients, encode, submit), not in model downloads
    this.stats = { downloadedBytes: 0, cacheHits: 0, steps: 0, samples: 0, tokens: 0, trainMs: 0, lastMs: null,
                   lastSplitMs: null, lastLoss: null, refetches: 0 };
    this._tokens = null; // token ids of `text`
    this._stopped = false;
  }

  url(path) { return `${this.baseUrl}${path}`; }

  /** Download (or read from the cache) every tensor of the node's current step. */
  async loadModel() {
    for (let attempt = 0; attempt < DOWNLOAD_ATTEMPTS; attempt++) {
      const info = await jsonOrThrow(await fetchOrThrow(this.url("/api/v1/model/info"), {}, "model info"), "model info");
      this.config = info.config;
      if (!this.manifest) {
        const r = await fetchOrThrow(this.url("/api/v1/model/manifest"), {}, "manifest");
        this.manifest = (await jsonOrThrow(r, "manifest")).tensors;
      }
      const arrays = await this._downloadStep(info.step);
      if (arrays === null) continue; // the step moved on mid-download
      this.tensors?.forEach((t) => t.dispose());
      this.tensors = this.manifest.map((t, i) => this.tf.tensor(arrays[i], t.shape, "float32"));
      disposeStepConstants(this.constants);
      this.constants = stepConstants(this.tf, this.manifest.map((t) => t.name), this.tensors);
      this.step = info.step;
      await cacheDropOtherSteps(this._cachePrefix(), info.step);
      this.onEvent({ type: "model", step: info.step, ...this.stats });
      return info.step;
    }
    throw new TrainerError("the node's step kept moving while the model downloaded; try again", "moving");
  }

  _cachePrefix() {
    const c = this.config; // the same origin may serve another model later: key by its shape too
    const shape = [c.vocab_size, c.d_model, c.n_heads, c.n_layers, c.d_ff, c.max_seq_len].join("x");
    return `train:${this.baseUrl || globalThis.location?.origin}:${shape}:`;
  }

  async _downloadStep(step) {
    const total = this.manifest.reduce((n, t) => n + 2 * t.elements, 0);
    let loaded = 0;
    const arrays = [];
    for (const t of this.manifest) {
      const key = `${this._cachePrefix()}${step}:${t.id}`;
      let buf = await cacheGet(key);
      if (buf && buf.byteLength === 2 * t.elements) {
        this.stats.cacheHits++;
      } else {
        const r = await fetchOrThrow(this.url(`/api/v1/model/tensor/${t.id}?format=f16`), {}, `tensor ${t.id}`);
        if (!r.ok) await jsonOrThrow(r, `tensor ${t.id}`);
        if (Number(r.headers.get("X-Model-Step")) !== step) return null;
        buf = await bodyOrThrow(r, "arrayBuffer", `tensor ${t.id}`);
        this.stats.downloadedBytes += buf.byteLength;
        await cachePut(key, buf);
      }
      arrays.push(f16BytesToF32(buf));
      loaded += buf.byteLength;
      this.onEvent({ type: "download", loaded, total, step });
    }
    return arrays;
  }

  /** One batch of token ids (Int32Array, batchSize * seqLen): from the contributor's text or the node. */
  async nextBatch() {
    const B = this.batchSize, T = Math.min(this.seqLen, this.config.max_seq_len);
    if (this.text !== null) {
      if (!this._tokens) {
        const tokenizer = await GPT2Tokenizer.fromUrl(this.baseUrl);
        this._tokens = tokenizer.encode(this.text);
      }
      if (this._tokens.length < T + 1) throw new TrainerError(`the text is too short: ${this._tokens.length} tokens, need ${T + 1}`);
      const ids = new Int32Array(B * T);
      for (let b = 0; b < B; b++) {
        const start = Math.floor(Math.random() * (this._tokens.length - T + 1));
        for (let j = 0; j < T; j++) ids[b * T + j] = this._tokens[start + j];
      }
      return { ids, batch: B, seqLen: T };
    }
    const r = await fetchOrThrow(this.url(`/api/v1/data/batch?batch_size=${B}&seq_len=${T}`), {}, "data batch");
    if (r.status === 404) throw new TrainerError("this node hands out no training data", "no_data");
    if (!r.ok) await jsonOrThrow(r, "data batch");
    const ids = new Int32Array(new Uint32Array(await bodyOrThrow(r, "arrayBuffer", "data batch")));
    return { ids, batch: Number(r.headers.get("X-Batch-Size")), seqLen: Number(r.headers.get("X-Seq-Len")) };
  }

  /** Gradients of one batch at the loaded step: {loss, grads: Float32Array[] in manifest order}. */
  async gradients(ids, batch, seqLen) {
    const names = this.manifest.map((t) => t.name);
    return lossAndGradients(this.tf, this.config, names, this.tensors, ids, batch, seqLen, this.constants);
  }

  /** One contribution: batch, gradients, DGRD packet, submit. Returns the node's answer and what was sent. */
  async trainOnce() {
    if (this.tensors === null) await this.loadModel();
    const t0 = performance.now();
    const { ids, batch, seqLen } = await this.nextBatch();
    const t1 = performance.now();
    const { loss, grads } = await this.gradients(ids, batch, seqLen);
    if (!Number.isFinite(loss)) throw new TrainerError(`the loss is ${loss}; not submitting`);
    const t2 = performance.now();
    const sections = this.feedback.step(grads);
    const t3 = performance.now();
    const packet = encodeDGRD({ step: this.step, nodeId: this.nodeId, trainLoss: loss, samples: batch, sections });
    const t4 = performance.now();
    const r = await fetchOrThrow(this.url("/api/v1/train/submit"), {
      method: "POST", body: packet, headers: { "Content-Type": "application/octet-stream" },
    }, "submit");
    const body = r.ok ? await bodyOrThrow(r, "json", "submit")
      : await r.json().catch(() => ({ message: `HTTP ${r.status}` }));
    if (r.status === 409) {
      // the packet was too old for the node: nothing was applied; fetch the latest model and go on
      this.stats.refetches++;
      this.onEvent({ type: "stale", step: this.step, serverStep: body.server_step });
      await this.loadModel();
      return { status: 409, loss, serverStep: body.server_step };
    }
    if (!r.ok) throw new TrainerError(`submit: ${body.message}`, r.status);
    const t5 = performance.now();
    // where the contribution's time went (ms): selection is top-k with error feedback, submit includes the answer
    this.stats.lastSplitMs = { batch: t1 - t0, gradient: t2 - t1, select: t3 - t2, encode: t4 - t3, submit: t5 - t4 };
    this.stats.lastMs = t5 - t0;
    this.stats.trainMs += this.stats.lastMs;
    this.stats.steps++;
    this.stats.samples += batch;
    this.stats.tokens += batch * seqLen;
    this.stats.lastLoss = loss;
    this.onEvent({ type: "step", step: this.step, serverStep: body.server_step, loss, bytes: packet.byteLength, ...this.stats });
    if (body.server_step !== this.step) await this.loadModel(); // the swarm moved on: train on the new step
    return { status: 200, loss, serverStep: body.server_step };
  }

  /** Train until stop() (or maxSteps contributions); errors end the loop and are reported as events. */
  async run({ maxSteps = Infinity } = {}) {
    this._stopped = false;
    while (!this._stopped && this.stats.steps < maxSteps) await this.trainOnce();
    this.onEvent({ type: "stopped", ...this.stats });
  }

  stop() { this._stopped = true; }

  dispose() {
    this.tensors?.forEach((t) => t.dispose());
    this.tensors = null;
    disposeStepConstants(this.constants);
    this.constants = null;
  }
}
