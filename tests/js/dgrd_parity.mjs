// Usage: node tests/js/dgrd_parity.mjs INPUT_JSON OUTPUT_BIN
// INPUT_JSON: {step, nodeId, trainLoss, samples, flags, sections: [{tensorId, indices|null, values}]}
// or, instead of sections, topk: {fraction, grads: [[...], ...]} to encode topK(grads, fraction).
import { readFileSync, writeFileSync } from 'node:fs';
import { encodeDGRD, topK } from '../../dtrain/static/dgrd.js';

const [input, output] = process.argv.slice(2);
if (!input || !output) {
  console.error('usage: node dgrd_parity.mjs INPUT_JSON OUTPUT_BIN');
  process.exit(2);
}
const spec = JSON.parse(readFileSync(input, 'utf8'));
const sections = spec.topk
  ? topK(spec.topk.grads.map((g) => Float32Array.from(g)), spec.topk.fraction)
  : spec.sections.map((s) => ({
      tensorId: s.tensorId,
      indices: s.indices == null ? null : Uint32Array.from(s.indices),
      values: Float32Array.from(s.values),
    }));
const bytes = encodeDGRD({
  step: spec.step, nodeId: spec.nodeId, trainLoss: spec.trainLoss,
  samples: spec.samples, sections, flags: spec.flags,
});
writeFileSync(output, bytes);
