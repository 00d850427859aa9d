// Usage: node tests/js/tokenizer_parity.mjs STATIC_DIR INPUT_TXT OUTPUT_JSON
import { readFileSync, writeFileSync } from "node:fs";
import { join, resolve, dirname } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const [staticDirArg, inputPath, outputPath] = process.argv.slice(2);
if (!staticDirArg || !inputPath || !outputPath) {
  console.error("usage: node tokenizer_parity.mjs STATIC_DIR INPUT_TXT OUTPUT_JSON");
  process.exit(2);
}
const staticDir = resolve(staticDirArg);
// import the tokenizer shipped in STATIC_DIR if present, else the repo copy
let modPath = join(staticDir, "tokenizer.js");
try {
  readFileSync(modPath);
} catch {
  modPath = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..", "static", "tokenizer.js");
}
const { GPT2Tokenizer } = await import(pathToFileURL(modPath).href);

const vocab = JSON.parse(readFileSync(join(staticDir, "vocab.json"), "utf-8"));
const merges = readFileSync(join(staticDir, "merges.txt"), "utf-8");
const tok = new GPT2Tokenizer(vocab, merges);
const text = readFileSync(inputPath, "utf-8");
const ids = tok.encode(text);
const roundtrip = tok.decode(ids) === text;
writeFileSync(outputPath, JSON.stringify({ ids, roundtrip }));
