// Bundle the browser dependencies into dtrain/static/vendor/ (served by the node; no CDN).
import { build } from "esbuild";
import { copyFileSync, mkdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const out = join(root, "dtrain", "static", "vendor");
mkdirSync(out, { recursive: true });

await build({
  entryPoints: [join(root, "web", "tf.js")],
  bundle: true,
  format: "esm",
  minify: true,
  target: "es2020",
  outfile: join(out, "tf.js"),
  logLevel: "warning",
});
const wasmDist = join(root, "node_modules", "@tensorflow", "tfjs-backend-wasm", "dist");
for (const name of ["tfjs-backend-wasm.wasm", "tfjs-backend-wasm-simd.wasm", "tfjs-backend-wasm-threaded-simd.wasm"]) {
  copyFileSync(join(wasmDist, name), join(out, name));
}
console.log(`dtrain/static/vendor: tf.js and the WASM binaries`);
