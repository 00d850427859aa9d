// The shared GPT-2 model in TensorFlow.js: the same computation as transformers' GPT2LMHeadModel (gelu_new,
// layer norm eps 1e-5, tied LM head, no dropout), with parameters named and shaped as the node's manifest lists
// them. Pure functions of (tf, config, parameters, tokens): usable on the main thread and in Web Workers.

const LN_EPS = 1e-5;
const GELU_C = Math.sqrt(2 / Math.PI);

function layerNorm(tf, x, weight, bias) {
  const { mean, variance } = tf.moments(x, -1, true);
  return tf.add(tf.mul(tf.div(tf.sub(x, mean), tf.sqrt(tf.add(variance, LN_EPS))), weight), bias);
}

function geluNew(tf, x) {
  // x * x * x, not tf.pow(x, 3): Pow and its gradient (pow, log, select) took 106 ms of a gradient on WASM
  const inner = tf.mul(GELU_C, tf.add(x, tf.mul(0.044715, tf.mul(tf.mul(x, x), x))));
  return tf.mul(tf.mul(0.5, x), tf.add(1, tf.tanh(inner)));
}

// a @ b, either side transposed. tfjs-backend-wasm hands a matMul to XNNPACK only when neither side is transposed
// and there is no batch; otherwise it runs a scalar loop about 10x slower. On WASM and CPU the transposes are made
// explicit: one copy of a weight-sized tensor against a matmul of 252 times its work. GPU backends read transposed
// operands in the shader for free, and a copy is a whole pass there (WebGL on SwiftShader: 0.61x per contribution).
const EXPLICIT_TRANSPOSE_BACKENDS = new Set(["wasm", "cpu"]);

function matMulT(tf, a, b, transposeA = false, transposeB = false) {
  if (!EXPLICIT_TRANSPOSE_BACKENDS.has(tf.getBackend())) return tf.matMul(a, b, transposeA, transposeB);
  return tf.matMul(transposeA ? tf.transpose(a) : a, transposeB ? tf.transpose(b) : b);
}

// a [M, K] @ b [K, N] whose gradient is matMulT's too: tf.matMul's own gradient is dy @ b^T and a^T @ dy with
// transpose flags, the slow path on WASM.
function matMul2d(tf, a, b) {
  return tf.customGrad((a, b, save) => {
    save([a, b]);
    return {
      value: tf.matMul(a, b),
      gradFunc: (dy, [a, b]) => [matMulT(tf, dy, b, false, true), matMulT(tf, a, dy, true, false)],
    };
  })(a, b);
}

// Conv1D of transformers: x [..., in] @ weight [in, out] + bias
function conv1d(tf, x, weight, bias) {
  const shape = x.shape;
  const flat = tf.reshape(x, [-1, shape[shape.length - 1]]);
  const out = tf.add(matMul2d(tf, flat, weight), bias);
  return tf.reshape(out, [...shape.slice(0, -1), weight.shape[1]]);
}

function attention(tf, x, p, prefix, nHeads, mask) {
  const [B, T, D] = x.shape, hd = D / nHeads;
  const qkv = conv1d(tf, x, p[`${prefix}.attn.c_attn.weight`], p[`${prefix}.attn.c_attn.bias`]);
  const heads = (t) => tf.transpose(tf.reshape(t, [B, T, nHeads, hd]), [0, 2, 1, 3]); // [B, H, T, hd]
  const [q, k, v] = tf.split(qkv, 3, -1).map(heads);
  const scores = tf.add(tf.div(tf.matMul(q, k, false, true), Math.sqrt(hd)), mask); // [B, H, T, T]
  const context = tf.matMul(tf.softmax(scores, -1), v); // [B, H, T, hd]
  const merged = tf.reshape(tf.transpose(context, [0, 2, 1, 3]), [B, T, D]);
  return conv1d(tf, merged, p[`${prefix}.attn.c_proj.weight`], p[`${prefix}.attn.c_proj.bias`]);
}

// Token embedding whose gradient is one scatter-add (tf.gather's own gradient, UnsortedSegmentSum, loops over
// all 50,257 rows on the CPU backend and is missing on WASM).
function embed(tf, wte, tokens) {
  const [B, T] = tokens.shape, D = wte.shape[1];
  const flat = tf.reshape(tokens, [-1]);
  const lookup = tf.customGrad((w) => ({
    value: tf.reshape(tf.gather(w, flat), [B, T, D]),
    gradFunc: (dy) => tf.scatterND(tf.reshape(flat, [-1, 1]), tf.reshape(dy, [B * T, D]), w.shape),
  }));
  return lookup(wte);
}

// The tied LM head, h [N, D] @ wte^T -> logits [N, V], through XNNPACK both ways on WASM (see matMulT): the
// forward multiplies by wte^T (`wteT`, made once per step by stepConstants when given), dh = dlogits @ wte, and
// dwte = dlogits^T @ h comes out in wte's own layout. This is most of the model's work: N x V x D three times
// against N x 12 D^2 per transformer block.
function lmHead(tf, h, wte, wteT = null) {
  return tf.customGrad((h, wte, save) => {
    save([h, wte]);
    return {
      value: wteT ? tf.matMul(h, wteT) : matMulT(tf, h, wte, false, true),
      gradFunc: (dy, [h, wte]) => [tf.matMul(dy, wte), matMulT(tf, dy, h, true, false)],
    };
  })(h, wte);
}

/**
 * What the loss needs from a step's parameters that does not change until the next step: on WASM and CPU the LM
 * head's wte^T (a 50,257 x D copy, and XNNPACK packs it once per step instead of once per contribution); nothing
 * on GPU backends. Kept out of tidy scopes; the caller disposes it (disposeStepConstants) when the parameters
 * change.
 */
export function stepConstants(tf, names, tensors) {
  if (!EXPLICIT_TRANSPOSE_BACKENDS.has(tf.getBackend())) return {};
  const wte = tensors[names.indexOf("transformer.wte.weight")];
  return { wteT: tf.keep(tf.transpose(wte)) };
}

export function disposeStepConstants(constants) {
  if (constants) Object.values(constants).forEach((t) => t.dispose());
}

// Mean cross-entropy of logits [N, V] against labels [N] (int32), as torch's cross_entropy: log-sum-exp minus the
// label's logit, with the gradient written out, (softmax - onehot) / N in five passes over the N x V logits,
// where tf.logSoftmax times a float one-hot matrix has a taped gradient of about ten. (The one-hot is a
// scatterND: WASM's OneHot kernel writes int32 whatever dtype is asked, and casting it is one more pass.)
function crossEntropy(tf, logits, labels) {
  const [N, V] = logits.shape;
  const flatIndex = tf.add(labels, tf.mul(tf.range(0, N, 1, "int32"), tf.scalar(V, "int32"))); // row * V + label
  return tf.customGrad((logits, save) => {
    const lse = tf.logSumExp(logits, -1, true); // [N, 1]
    const picked = tf.gather(tf.reshape(logits, [-1]), flatIndex); // [N]
    save([logits, lse, flatIndex]);
    return {
      value: tf.mean(tf.sub(tf.reshape(lse, [-1]), picked)),
      gradFunc: (dy, [logits, lse, flatIndex]) => {
        const oneHot = tf.scatterND(tf.reshape(flatIndex, [N, 1]), tf.ones([N]), [N * V]);
        return tf.mul(tf.sub(tf.exp(tf.sub(logits, lse)), tf.reshape(oneHot, [N, V])), tf.div(dy, N));
      },
    };
  })(logits);
}

function causalMask(tf, T) {
  const values = new Float32Array(T * T);
  for (let i = 0; i < T; i++) for (let j = i + 1; j < T; j++) values[i * T + j] = -1e9;
  return tf.tensor2d(values, [T, T]);
}

/**
 * Mean next-token cross-entropy of `tokens` ([B, T] int32 tensor) under parameters `p` (name -> tensor), exactly
 * as GPT2LMHeadModel(input_ids=tokens, labels=tokens).loss: positions 0..T-2 predict tokens 1..T-1.
 */
export function lmLoss(tf, config, p, tokens, constants = null) {
  const [B, T] = tokens.shape;
  const wpe = p["transformer.wpe.weight"];
  let x = tf.add(embed(tf, p["transformer.wte.weight"], tokens), tf.slice(wpe, [0, 0], [T, wpe.shape[1]]));
  const mask = causalMask(tf, T);
  for (let i = 0; i < config.n_layers; i++) {
    const prefix = `transformer.h.${i}`;
    const a = layerNorm(tf, x, p[`${prefix}.ln_1.weight`], p[`${prefix}.ln_1.bias`]);
    x = tf.add(x, attention(tf, a, p, prefix, config.n_heads, mask));
    const m = layerNorm(tf, x, p[`${prefix}.ln_2.weight`], p[`${prefix}.ln_2.bias`]);
    const hidden = geluNew(tf, conv1d(tf, m, p[`${prefix}.mlp.c_fc.weight`], p[`${prefix}.mlp.c_fc.bias`]));
    x = tf.add(x, conv1d(tf, hidden, p[`${prefix}.mlp.c_proj.weight`], p[`${prefix}.mlp.c_proj.bias`]));
  }
  x = layerNorm(tf, x, p["transformer.ln_f.weight"], p["transformer.ln_f.bias"]);
  const D = x.shape[2];
  const h = tf.reshape(tf.slice(x, [0, 0, 0], [B, T - 1, D]), [B * (T - 1), D]);
  const logits = lmHead(tf, h, p["transformer.wte.weight"], constants?.wteT); // tied LM head: [N, V]
  const labels = tf.reshape(tf.slice(tokens, [0, 1], [B, T - 1]), [-1]);
  return crossEntropy(tf, logits, labels);
}

/**
 * Loss and gradient of every parameter for one batch. `names` lists the parameters in manifest order and
 * `tensors` holds them ([shape] float32 tensors); `constants`, stepConstants of those tensors (optional: without
 * them the LM head transposes wte in this call). Returns {loss: number, grads: Float32Array[] in that order}.
 */
export async function lossAndGradients(tf, config, names, tensors, tokenIds, batch, seqLen, constants = null) {
  const tokens = tf.tensor2d(tokenIds, [batch, seqLen], "int32");
  try {
    const f = (...xs) => lmLoss(tf, config, Object.fromEntries(names.map((n, i) => [n, xs[i]])), tokens, constants);
    const { value, grads } = tf.valueAndGrads(f)(tensors);
    try {
      const loss = (await value.data())[0];
      const out = [];
      for (const g of grads) out.push(await g.data());
      return { loss, grads: out };
    } finally {
      value.dispose();
      grads.forEach((g) => g.dispose());
    }
  } finally {
    tokens.dispose();
  }
}
