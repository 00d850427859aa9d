// GPT-2 byte-level BPE tokenizer. Plain ES module, no dependencies:
// works on the main thread, in Web Workers and in Node (>= 18).

const PAT = /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+/gu;

function bytesToUnicode() {
  const bs = [];
  for (let b = 0x21; b <= 0x7e; b++) bs.push(b);
  for (let b = 0xa1; b <= 0xac; b++) bs.push(b);
  for (let b = 0xae; b <= 0xff; b++) bs.push(b);
  const cs = bs.slice();
  let n = 0;
  for (let b = 0; b < 256; b++) {
    if (!bs.includes(b)) {
      bs.push(b);
      cs.push(256 + n);
      n++;
    }
  }
  const byteEncoder = new Array(256);
  const byteDecoder = new Map();
  for (let i = 0; i < bs.length; i++) {
    const ch = String.fromCharCode(cs[i]);
    byteEncoder[bs[i]] = ch;
    byteDecoder.set(ch, bs[i]);
  }
  return { byteEncoder, byteDecoder };
}

export class GPT2Tokenizer {
  /**
   * @param {Object<string, number>} vocab parsed static/vocab.json
   * @param {string} mergesText text of static/merges.txt
   */
  constructor(vocab, mergesText) {
    this.encoder = new Map(Object.entries(vocab));
    this.decoder = new Map();
    for (const [tok, id] of this.encoder) this.decoder.set(id, tok);
    this.bpeRanks = new Map();
    const lines = mergesText.split(/\r?\n/);
    let rank = 0;
    for (const line of lines) {
      if (!line || line.startsWith("#version")) continue;
      const parts = line.split(" ");
      if (parts.length !== 2) continue;
      this.bpeRanks.set(parts[0] + " " + parts[1], rank++);
    }
    const { byteEncoder, byteDecoder } = bytesToUnicode();
    this.byteEncoder = byteEncoder;
    this.byteDecoder = byteDecoder;
    this.textEncoder = new TextEncoder();
    this.textDecoder = new TextDecoder("utf-8", { fatal: false });
    this.cache = new Map();
    this.cacheLimit = 100000;
  }

  static async fromUrl(baseUrl = "") {
    const [vr, mr] = await Promise.all([
      fetch(`${baseUrl}/static/vocab.json`),
      fetch(`${baseUrl}/static/merges.txt`),
    ]);
    if (!vr.ok) throw new Error(`vocab.json: HTTP ${vr.status}`);
    if (!mr.ok) throw new Error(`merges.txt: HTTP ${mr.status}`);
    return new GPT2Tokenizer(await vr.json(), await mr.text());
  }

  get vocabSize() {
    return this.encoder.size;
  }

  /** Apply BPE merges to one byte-encoded word; returns the list of symbols. */
  bpe(token) {
    const cached = this.cache.get(token);
    if (cached !== undefined) return cached;
    let word = Array.from(token);
    while (word.length > 1) {
      let best = -1;
      let bestRank = Infinity;
      for (let i = 0; i < word.length - 1; i++) {
        const r = this.bpeRanks.get(word[i] + " " + word[i + 1]);
        if (r !== undefined && r < bestRank) {
          bestRank = r;
          best = i;
        }
      }
      if (best < 0) break;
      const first = word[best];
      const second = word[best + 1];
      const merged = first + second;
      const next = [];
      let i = 0;
      while (i < word.length) {
        if (i < word.length - 1 && word[i] === first && word[i + 1] === second) {
          next.push(merged);
          i += 2;
        } else {
          next.push(word[i]);
          i += 1;
        }
      }
      word = next;
    }
    if (this.cache.size >= this.cacheLimit) this.cache.clear();
    this.cache.set(token, word);
    return word;
  }

  /** @param {string} text @returns {number[]} */
  encode(text) {
    const ids = [];
    PAT.lastIndex = 0;
    for (const m of text.matchAll(PAT)) {
      const bytes = this.textEncoder.encode(m[0]);
      let s = "";
      for (let i = 0; i < bytes.length; i++) s += this.byteEncoder[bytes[i]];
      for (const sym of this.bpe(s)) {
        const id = this.encoder.get(sym);
        if (id !== undefined) {
          ids.push(id);
        } else {
          // cannot happen with the full GPT-2 vocab (all 256 byte symbols exist)
          for (const ch of sym) {
            const cid = this.encoder.get(ch);
            if (cid !== undefined) ids.push(cid);
          }
        }
      }
    }
    return ids;
  }

  /** @param {number[]} ids @returns {string} */
  decode(ids) {
    const out = [];
    for (const id of ids) {
      const tok = this.decoder.get(Number(id));
      if (tok === undefined) continue;
      for (const ch of tok) {
        const b = this.byteDecoder.get(ch);
        if (b !== undefined) out.push(b);
      }
    }
    return this.textDecoder.decode(new Uint8Array(out));
  }
}

export default GPT2Tokenizer;
