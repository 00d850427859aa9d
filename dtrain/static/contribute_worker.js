// Web Worker behind /contribute: runs the BrowserTrainer off the page's thread and posts its progress.
// Messages in: {cmd: "start", nodeId, text, batchSize, seqLen} | {cmd: "stop"}.
// Messages out: the trainer's events ({type: "backend" | "download" | "model" | "step" | "stale" | "stopped"}),
// and {type: "error", message, code}. "backend" carries the chosen backend, every probe's ms and WASM's features.

import * as tf from "./vendor/tf.js";
import { BrowserTrainer, chooseBackend } from "./trainer.js";

let trainer = null;

async function start(options) {
  if (trainer) return;
  const post = (event) => self.postMessage(event);
  try {
    const { backend, timings, wasm } = await chooseBackend(tf);
    post({ type: "backend", backend, timings, wasm });
    trainer = new BrowserTrainer(tf, { ...options, onEvent: post });
    await trainer.run();
  } catch (e) {
    post({ type: "error", message: e.message, code: e.code ?? null });
  } finally {
    trainer?.dispose();
    trainer = null;
  }
}

self.onmessage = ({ data }) => {
  if (data.cmd === "start") start(data);
  else if (data.cmd === "stop") trainer?.stop();
};
