// Usage: node tests/js/tokenizer_parity.mjs TOKENIZER_JS VOCAB_JSON MERGES_TXT INPUT_TXT OUTPUT_JSON
import { readFileSync, writeFileSync } from "node:fs";
import { resolve } from "node:path";
import { pathToFileURL } from "node:url";

const [modulePath, vocabPath, mergesPath, inputPath, outputPath] = process.argv.slice(2);
if (!outputPath) {
  console.error("usage: node tokenizer_parity.mjs TOKENIZER_JS VOCAB_JSON MERGES_TXT INPUT_TXT OUTPUT_JSON");
  process.exit(2);
}
const { GPT2Tokenizer } = await import(pathToFileURL(resolve(modulePath)).href);

const vocab = JSON.parse(readFileSync(vocabPath, "utf-8"));
const merges = readFileSync(mergesPath, "utf-8");
const tok = new GPT2Tokenizer(vocab, merges);
const text = readFileSync(inputPath, "utf-8");
const ids = tok.encode(text);
const roundtrip = tok.decode(ids) === text;
writeFileSync(outputPath, JSON.stringify({ ids, roundtrip }));
