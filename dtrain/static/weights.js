// Model weights in the browser: FP16 decoding and an IndexedDB cache that stores each buffer in 8 MB chunks
// (one huge IndexedDB value runs mobile Safari out of memory). Plain ES module: pages, Web Workers and Node.

export const CHUNK_SIZE = 8 * 1024 * 1024;
const DB_NAME = "dtrain-weights";

// f16 bit pattern -> float32 value, for all 65,536 patterns
export const F16 = (() => {
  const t = new Float32Array(65536);
  for (let h = 0; h < 65536; h++) {
    const s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e === 0) t[h] = s * m * 2 ** -24;
    else if (e === 31) t[h] = m ? NaN : s * Infinity;
    else t[h] = s * (1 + m / 1024) * 2 ** (e - 15);
  }
  return t;
})();

/** FP16 bytes (little-endian) -> Float32Array, through the lookup table. */
export function f16BytesToF32(buffer) {
  const bits = new Uint16Array(buffer), out = new Float32Array(bits.length);
  for (let i = 0; i < bits.length; i++) out[i] = F16[bits[i]];
  return out;
}

function idbOpen() {
  return new Promise((resolve, reject) => {
    const req = globalThis.indexedDB.open(DB_NAME, 1);
    req.onupgradeneeded = () => req.result.createObjectStore("chunks");
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });
}

function idbDo(db, mode, fn) {
  return new Promise((resolve, reject) => {
    const tx = db.transaction("chunks", mode), store = tx.objectStore("chunks");
    const req = fn(store);
    tx.oncomplete = () => resolve(req?.result);
    tx.onerror = tx.onabort = () => reject(tx.error);
  });
}

/** The cached ArrayBuffer for `key`, or null (not cached, no IndexedDB, or any failure). */
export async function cacheGet(key) {
  if (!globalThis.indexedDB) return null;
  try {
    const db = await idbOpen();
    const meta = await idbDo(db, "readonly", (s) => s.get(`${key}:meta`));
    if (!meta) return null;
    const out = new Uint8Array(meta.byteLength);
    for (let i = 0, off = 0; i < meta.chunks; i++) {
      const chunk = new Uint8Array(await idbDo(db, "readonly", (s) => s.get(`${key}:${i}`)));
      out.set(chunk, off);
      off += chunk.length;
    }
    db.close();
    return out.buffer;
  } catch { return null; }
}

/** Store `buffer` under `key` in CHUNK_SIZE pieces; returns the number of chunks (0 when not cached). */
export async function cachePut(key, buffer) {
  if (!globalThis.indexedDB) return 0;
  try {
    const db = await idbOpen();
    let chunks = 0;
    for (let i = 0; i < buffer.byteLength; i += CHUNK_SIZE, chunks++) {
      const part = buffer.slice(i, Math.min(i + CHUNK_SIZE, buffer.byteLength));
      await idbDo(db, "readwrite", (s) => s.put(part, `${key}:${chunks}`));
    }
    await idbDo(db, "readwrite", (s) => s.put({ byteLength: buffer.byteLength, chunks }, `${key}:meta`));
    db.close();
    return chunks;
  } catch { return 0; }
}

/** Drop every cached entry whose key starts with `prefix` but is not for `keepStep` (old steps' weights). */
export async function cacheDropOtherSteps(prefix, keepStep) {
  if (!globalThis.indexedDB) return;
  try {
    const db = await idbOpen();
    const keys = await idbDo(db, "readonly", (s) => s.getAllKeys());
    const stale = keys.filter((k) => typeof k === "string" && k.startsWith(prefix) && !k.startsWith(`${prefix}${keepStep}:`));
    if (stale.length) await idbDo(db, "readwrite", (s) => { stale.forEach((k) => s.delete(k)); });
    db.close();
  } catch { /* best effort */ }
}
