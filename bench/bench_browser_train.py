"""In-browser training speed: one contribution (forward, backward, top-1% + error feedback, DGRD, submit) in
headless Chromium, per TensorFlow.js backend the browser can start, against a real node.

Starts a `dtrain-node` subprocess (the default static/model_config.json model unless --model-config says
otherwise), opens it in Debian's Chromium through Playwright, loads the model through static/trainer.js and
times --steps contributions per backend after one warm-up, each backend on a fresh page, --rounds times in turn.
Prints a markdown table with the WASM backend's thread pool (tfjs-backend-wasm starts at most half the logical
cores: 1 thread on a 2-core machine, cross-origin isolated or not).

    python bench/bench_browser_train.py [--model-config configs/tiny.json] [--batch 4] [--seq-len 64] [--steps 3]
        [--backends wasm cpu] [--rounds 1]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from playwright.sync_api import sync_playwright  # noqa: E402

from tests import browser  # noqa: E402
from tests.nodeproc import NodeProcess, new_run_id  # noqa: E402

SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"

TIME_STEPS = """async ([backend, text, batch, seqLen, steps]) => {
    const tf = await import("/static/vendor/tf.js");
    const { BrowserTrainer, chooseBackend } = await import("/static/trainer.js");
    const chosen = await chooseBackend(tf, "", [backend]).catch(() => null);
    if (!chosen) return null;
    const trainer = new BrowserTrainer(tf, { batchSize: batch, seqLen, text, nodeId: `bench-${backend}` });
    let t0 = performance.now();
    await trainer.loadModel();
    const loadMs = performance.now() - t0;
    await trainer.trainOnce();  // warm-up: kernels, shaders
    const times = [];
    for (let i = 0; i < steps; i++) {
      t0 = performance.now();
      const { ids, batch: B, seqLen: T } = await trainer.nextBatch();
      const t1 = performance.now();
      await trainer.gradients(ids, B, T);
      times.push({ total: 0, grad: performance.now() - t1 });
      t0 = performance.now();
      await trainer.trainOnce();
      times[i].total = performance.now() - t0;
    }
    trainer.dispose();
    return { loadMs, times, probe: chosen.timings[backend], isolated: self.crossOriginIsolated,
             threads: backend === "wasm" ? chosen.wasm.threads : null, cores: navigator.hardwareConcurrency };
}"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", default=str(REPO / "static" / "model_config.json"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=["webgpu", "webgl", "wasm", "cpu"])
    parser.add_argument("--rounds", type=int, default=1, help="times each backend runs, in turn")
    args = parser.parse_args()
    if not 1 <= args.rounds <= 20:
        parser.error(f"--rounds must be 1..20, got {args.rounds}")

    results: dict[str, list] = {backend: [] for backend in args.backends}
    # a target the bench never reaches: the step stays put, so no step re-downloads the model
    node = NodeProcess("bench", ["--model-config", args.model_config, "--target-batch-size", "1000000"], new_run_id())
    try:
        node.wait_ready(timeout_s=300)
        params = node.get_json("/api/v1/model/info")["total_params"]
        text = SHAKESPEARE.read_text()[:20_000]
        with sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
            context = browser.launch(p, Path(profile))
            for _ in range(args.rounds):
                for backend in args.backends:
                    print(f"timing {backend} ...", file=sys.stderr, flush=True)
                    page = context.new_page()  # a fresh page: fresh modules, no backend started before
                    page.goto(node.url + "/contribute")
                    results[backend].append(page.evaluate(
                        TIME_STEPS, [backend, text, args.batch, args.seq_len, args.steps]))
                    page.close()
            context.close()
    finally:
        node.kill()

    samples = args.batch
    print(f"\nIn-browser training, {Path(args.model_config).name} ({params:,} parameters), batch {args.batch} x "
          f"{args.seq_len} tokens, headless Chromium ({platform.machine()}, {platform.processor() or 'cpu'}), "
          f"{args.rounds} round(s) of {args.steps} timed steps\n")
    print("| backend | WASM threads (logical cores) | probe ms | model load s | gradient s / step "
          "| contribution s / step | samples / s | tokens / s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for backend, rs in results.items():
        rs = [r for r in rs if r is not None]
        if not rs:
            print(f"| {backend} | | not available | | | | | |")
            continue
        grad = statistics.median(t["grad"] for r in rs for t in r["times"]) / 1000
        total = statistics.median(t["total"] for r in rs for t in r["times"]) / 1000
        # cross-origin isolated (COOP/COEP): WASM may use its threaded SIMD build
        name = f"{backend} (isolated)" if rs[0].get("isolated") else backend
        pool = f"{rs[0]['threads']} ({rs[0]['cores']})" if backend == "wasm" else ""
        print(f"| {name} | {pool} | {statistics.median(r['probe'] for r in rs):.1f} | "
              f"{statistics.median(r['loadMs'] for r in rs) / 1000:.2f} | {grad:.3f} | {total:.3f} | "
              f"{samples / total:.2f} | {samples * args.seq_len / total:.0f} |")
    print("\n(medians over every timed step of every round; a contribution is batch, gradients, top-1% with error "
          "feedback, DGRD encode and submit)")


if __name__ == "__main__":
    main()
