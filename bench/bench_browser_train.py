"""In-browser training speed: one contribution (forward, backward, top-1% + error feedback, DGRD, submit) in
headless Chromium, per TensorFlow.js backend the browser can start, against a real node; with --baseline REV, the
browser modules of git revision REV (static/*.js as committed there) timed side by side in the same run, and with
--current REV those of REV instead of the working tree (so that editing static/ cannot change a running bench).

Starts a `dtrain-node` subprocess (the default static/model_config.json model unless --model-config says
otherwise), opens it in Debian's Chromium through Playwright, loads the model through static/trainer.js and
times --steps contributions per backend after one warm-up, each backend on a fresh page, --rounds times in turn
(baseline and current alternating inside each round). A contribution is timed in its parts, the same calls for
both revisions: batch (tokens of the text), gradient (forward, backward, read back), select (top-k with error
feedback), encode (DGRD) and submit (POST until the node's answer). Prints a markdown table with the WASM
backend's thread pool (tfjs-backend-wasm starts at most half the logical cores: 1 thread on a 2-core machine,
cross-origin isolated or not).

    python bench/bench_browser_train.py [--model-config configs/tiny.json] [--batch 4] [--seq-len 64] [--steps 3]
        [--backends wasm cpu] [--rounds 1] [--baseline 89cd0b0] [--current HEAD] [--wasm-threads 2]
"""
from __future__ import annotations

import argparse
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from playwright.sync_api import sync_playwright  # noqa: E402

from dtrain.node.corpus import default_text  # noqa: E402
from tests import browser  # noqa: E402
from tests.nodeproc import NodeProcess, new_run_id  # noqa: E402

REVISION_PATH = re.compile(r"/static/rev-([0-9a-f]{7,40})/([A-Za-z0-9_.-]+)")  # a revision's module, served by the bench
PARTS = ("batch", "gradient", "select", "encode", "submit")

TIME_STEPS = """async ([backend, text, batch, seqLen, steps, modules]) => {
    const tf = await import("/static/vendor/tf.js");
    const { BrowserTrainer, chooseBackend } = await import(`${modules}trainer.js`);
    const { encodeDGRD } = await import(`${modules}dgrd.js`);
    const chosen = await chooseBackend(tf, "", [backend]).catch(() => null);
    if (!chosen) return null;
    const trainer = new BrowserTrainer(tf, { batchSize: batch, seqLen, text, nodeId: `bench-${backend}` });
    let t0 = performance.now();
    await trainer.loadModel();
    const loadMs = performance.now() - t0;
    // one contribution as BrowserTrainer.trainOnce makes it, timed in its parts
    const contribute = async () => {
      const t = [performance.now()];
      const { ids, batch: B, seqLen: T } = await trainer.nextBatch();
      t.push(performance.now());
      const { loss, grads } = await trainer.gradients(ids, B, T);
      t.push(performance.now());
      const sections = trainer.feedback.step(grads);
      t.push(performance.now());
      const packet = encodeDGRD({ step: trainer.step, nodeId: trainer.nodeId, trainLoss: loss, samples: B, sections });
      t.push(performance.now());
      const r = await fetch("/api/v1/train/submit", {
        method: "POST", body: packet, headers: { "Content-Type": "application/octet-stream" } });
      const answer = await r.json();
      if (!r.ok) throw new Error(`submit: HTTP ${r.status} ${answer.message}`);
      t.push(performance.now());
      return { batch: t[1] - t[0], gradient: t[2] - t[1], select: t[3] - t[2], encode: t[4] - t[3],
               submit: t[5] - t[4], total: t[5] - t[0], bytes: packet.byteLength };
    };
    await contribute();  // warm-up: kernels, shaders, JIT
    const times = [];
    for (let i = 0; i < steps; i++) times.push(await contribute());
    trainer.dispose();
    return { loadMs, times, probe: chosen.timings[backend], isolated: self.crossOriginIsolated,
             threads: backend === "wasm" ? chosen.wasm.threads : null, cores: navigator.hardwareConcurrency };
}"""


def serve_revisions(context) -> None:
    """Answer /static/rev-<sha>/<file> with static/<file> as committed at <sha> (the page's own origin, no disk)."""
    cache: dict[tuple[str, str], bytes] = {}

    def handle(route):
        rev, name = REVISION_PATH.search(route.request.url).groups()
        if (rev, name) not in cache:
            shown = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:static/{name}"], capture_output=True,
                                   timeout=30)
            cache[(rev, name)] = shown.stdout if shown.returncode == 0 else b""
        if not cache[(rev, name)]:
            route.fulfill(status=404, body=f"static/{name} not in {rev}")
        else:
            route.fulfill(status=200, body=cache[(rev, name)], content_type="text/javascript",
                          headers={"Cross-Origin-Resource-Policy": "same-origin"})

    context.route(REVISION_PATH, handle)


def commit_of(parser, flag: str, rev: str) -> str:
    shown = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", f"{rev}^{{commit}}"],
                           capture_output=True, text=True)
    if shown.returncode != 0:
        parser.error(f"{flag} {rev}: not a commit of this repository")
    return shown.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", default=str(REPO / "dtrain" / "static" / "model_config.json"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--backends", nargs="+", default=["webgpu", "webgl", "wasm", "cpu"])
    parser.add_argument("--rounds", type=int, default=1, help="times each backend runs, in turn")
    parser.add_argument("--baseline", metavar="REV", help="also time the browser modules of this git revision")
    parser.add_argument("--current", metavar="REV", help="time this revision's modules instead of the working tree's")
    parser.add_argument("--wasm-threads", type=int, metavar="N",
                        help="also time the current modules with the page's navigator.hardwareConcurrency set to 2N: "
                             "tfjs-backend-wasm starts half the logical cores as threads (an experiment, not shipped)")
    args = parser.parse_args()
    if not 1 <= args.rounds <= 20:
        parser.error(f"--rounds must be 1..20, got {args.rounds}")
    if not 1 <= args.steps <= 50:
        parser.error(f"--steps must be 1..50, got {args.steps}")
    if args.wasm_threads is not None and not 1 <= args.wasm_threads <= 8:
        parser.error(f"--wasm-threads must be 1..8 (the backend's pool has 8 workers), got {args.wasm_threads}")
    codes = {}  # label -> (where the page imports the modules from, navigator.hardwareConcurrency or None: real)
    if args.baseline:
        rev = commit_of(parser, "--baseline", args.baseline)
        codes[f"baseline {rev}"] = (f"/static/rev-{rev}/", None)
    if args.current:
        rev = commit_of(parser, "--current", args.current)
        current = (f"current {rev}", f"/static/rev-{rev}/")
    else:
        current = ("current (working tree)", "/static/")
    codes[current[0]] = (current[1], None)
    if args.wasm_threads:
        codes[f"{current[0]}, hardwareConcurrency {2 * args.wasm_threads}"] = (current[1], 2 * args.wasm_threads)

    results: dict[tuple[str, str], list] = {(b, c): [] for b in args.backends for c in codes}
    # a target the bench never reaches: the step stays put, so no step re-downloads the model
    node = NodeProcess("bench", ["--model-config", args.model_config, "--target-batch-size", "1000000"], new_run_id(),
                       cold=True)
    try:
        node.wait_ready(timeout_s=300)
        params = node.get_json("/api/v1/model/info")["total_params"]
        text = default_text(8_000)[:20_000]
        with sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
            context = browser.launch(p, Path(profile))
            serve_revisions(context)
            for _ in range(args.rounds):
                for backend in args.backends:
                    for code, (modules, cores) in codes.items():
                        print(f"timing {backend}, {code} ...", file=sys.stderr, flush=True)
                        page = context.new_page()  # a fresh page: fresh modules, no backend started before
                        if cores:  # before any script of the page runs, so the WASM module reads it at start
                            page.add_init_script(f"Object.defineProperty(Navigator.prototype, 'hardwareConcurrency', "
                                                 f"{{ get: () => {cores} }});")
                        page.goto(node.url + "/contribute")
                        results[(backend, code)].append(page.evaluate(
                            TIME_STEPS, [backend, text, args.batch, args.seq_len, args.steps, modules]))
                        page.close()
            context.close()
    finally:
        node.kill()

    samples = args.batch
    print(f"\nIn-browser training, {Path(args.model_config).name} ({params:,} parameters), batch {args.batch} x "
          f"{args.seq_len} tokens, headless Chromium ({platform.machine()}, {platform.processor() or 'cpu'}), "
          f"{args.rounds} round(s) of {args.steps} timed contributions\n")
    print("| backend | code | WASM threads (logical cores) | probe ms | model load s | "
          + " | ".join(f"{part} s" for part in PARTS) + " | contribution s | samples / s | tokens / s | speed-up |")
    print("|---|---|---|" + "---:|" * (len(PARTS) + 6))
    for backend in args.backends:
        first_total = None
        for code in codes:
            rs = [r for r in results[(backend, code)] if r is not None]
            if not rs:
                print(f"| {backend} | {code} | | not available |" + " |" * (len(PARTS) + 5))
                continue
            steps = [t for r in rs for t in r["times"]]
            part = {k: statistics.median(t[k] for t in steps) / 1000 for k in (*PARTS, "total")}
            total = part["total"]
            first_total = first_total or total
            # cross-origin isolated (COOP/COEP): WASM may use its threaded SIMD build
            name = f"{backend} (isolated)" if rs[0].get("isolated") else backend
            pool = f"{rs[0]['threads']} ({rs[0]['cores']})" if backend == "wasm" else ""
            print(f"| {name} | {code} | {pool} | {statistics.median(r['probe'] for r in rs):.1f} | "
                  f"{statistics.median(r['loadMs'] for r in rs) / 1000:.2f} | "
                  + " | ".join(f"{part[k]:.3f}" for k in PARTS)
                  + f" | {total:.3f} | {samples / total:.2f} | {samples * args.seq_len / total:.0f} | "
                  f"{first_total / total:.2f}x |")
    print("\n(medians over every timed contribution of every round; a contribution's parts are medians each, so they "
          "need not add up to its median total; speed-up: the first row of the backend's seconds per contribution "
          "over this row's)")


if __name__ == "__main__":
    main()
