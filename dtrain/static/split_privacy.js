// The measured privacy/utility trade of split inference, as docs/split-privacy.md has it (`python
// bench/bench_privacy.py --positions 512`: dtrain-gpt2-mini, seeded initial weights, 512 positions of
// tinyshakespeare, clip 1, delta 1e-5). tests/test_pages.py keeps these rows equal to the document's table.

export const PRIVACY_SOURCE = "docs/split-privacy.md";

// serverEpsilon null: server DP off. recovery: % of tokens the node recovers by nearest neighbour over wte;
// survival: % of greedy tokens equal to the ones without any noise.
export const PRIVACY_ROWS = [
  [0, null, 100.0, 100.0], [0, 8, 100.0, 0.0], [0, 1, 100.0, 0.0],
  [0.01, null, 100.0, 50.0], [0.01, 8, 100.0, 0.0], [0.01, 1, 100.0, 0.0],
  [0.02, null, 100.0, 25.2], [0.02, 8, 100.0, 0.0], [0.02, 1, 100.0, 0.0],
  [0.05, null, 97.7, 7.8], [0.05, 8, 97.7, 0.0], [0.05, 1, 97.7, 0.0],
  [0.1, null, 12.9, 1.4], [0.1, 8, 12.9, 0.0], [0.1, 1, 12.9, 0.0],
].map(([clientSigma, serverEpsilon, recovery, survival]) => ({ clientSigma, serverEpsilon, recovery, survival }));

/** The client noise settings that were measured, smallest first. */
export const NOISE_SIGMAS = [...new Set(PRIVACY_ROWS.map((r) => r.clientSigma))];

/**
 * The measured row for a client sigma and the node's server DP epsilon (0 or null: off), or the row without
 * server DP (with exact: false) when that epsilon was not measured.
 */
export function privacyRow(clientSigma, serverEpsilon) {
  const eps = serverEpsilon > 0 ? serverEpsilon : null;
  const exact = PRIVACY_ROWS.find((r) => r.clientSigma === clientSigma && r.serverEpsilon === eps);
  if (exact) return { ...exact, exact: true };
  const off = PRIVACY_ROWS.find((r) => r.clientSigma === clientSigma && r.serverEpsilon === null);
  return off ? { ...off, exact: false } : null;
}
