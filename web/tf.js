// The TensorFlow.js build the pages use: core plus every backend a browser may offer. Bundled by web/build.mjs
// into static/vendor/tf.js (one ES module, usable on the main thread and in module Web Workers).
export * from "@tensorflow/tfjs-core";
import "@tensorflow/tfjs-core/dist/register_all_gradients"; // autodiff for every op (not in core's entry)
import "@tensorflow/tfjs-backend-cpu";
import "@tensorflow/tfjs-backend-webgl";
import "@tensorflow/tfjs-backend-webgpu";
export { setWasmPaths } from "@tensorflow/tfjs-backend-wasm";
