"""The browser side in a real headless Chromium against real nodes: in-browser gradients equal PyTorch's, the
IndexedDB weight cache, /contribute training a node, /chat equal to the Python client, tokenizer and DGRD parity,
and the dashboard's loss curve (screenshot kept in test-artifacts/)."""
from __future__ import annotations

import base64
import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from dtrain.bridge import dgrd
from dtrain.clients.split_client import SplitClient
from dtrain.node.config import ModelConfig
from dtrain.node.model import build_model
from dtrain.node.tokenizer import load_tokenizer
from tests import browser
from tests.nodeproc import PER_STEP, TINY_CONFIG, NodeProcess, new_run_id, wait_until
from tests.test_dgrd_js import CASES
from tests.test_tokenizer_js import STRESS_TEXT
from tests.texts import shakespeare

pytestmark = pytest.mark.browser

playwright_sync = pytest.importorskip("playwright.sync_api")

# a Float32Array's bytes as base64 (how gradients come back to Python)
F32_TO_B64 = """const b64 = (a) => { const u = new Uint8Array(a.buffer, a.byteOffset, a.byteLength); let s = "";
          for (let i = 0; i < u.length; i += 0x8000) s += String.fromCharCode.apply(null, u.subarray(i, i + 0x8000));
          return btoa(s); };"""


@pytest.fixture(scope="module")
def playwright():
    with playwright_sync.sync_playwright() as p:
        yield p


@pytest.fixture
def page(playwright, tmp_path):
    context = browser.launch(playwright, tmp_path / "chromium-profile")
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        yield page
    finally:
        context.close()
    assert not errors, errors


@pytest.fixture(scope="module")
def tiny_node():
    # --no-data: test_contribute_page_trains_the_node checks the page's answer to a node without batches
    proc = NodeProcess("browser", ["--model-config", str(TINY_CONFIG), "--no-data"], new_run_id())
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


def _f16_model(node: NodeProcess) -> tuple[torch.nn.Module, list[dict]]:
    """The tiny model with exactly the FP16 weights the node serves (what the browser trains on)."""
    manifest = node.get_json("/api/v1/model/manifest")["tensors"]
    model = build_model(ModelConfig.load(TINY_CONFIG))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for t in manifest:
            with urllib.request.urlopen(f"{node.url}/api/v1/model/tensor/{t['id']}?format=f16", timeout=10) as r:
                data = np.frombuffer(r.read(), "<f2").astype(np.float32)
            params[t["name"]].copy_(torch.from_numpy(data).reshape(t["shape"]))
    return model, manifest


def _shakespeare_batch(batch: int, seq_len: int) -> np.ndarray:
    ids = load_tokenizer().encode(shakespeare(20_000)).ids
    starts = np.random.default_rng(0).integers(0, len(ids) - seq_len, batch)
    return np.stack([ids[s:s + seq_len] for s in starts]).astype(np.int32)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["wasm", "cpu", "webgl"])
def test_browser_gradients_equal_pytorch(page, tiny_node, backend):
    tokens = _shakespeare_batch(2, 32)
    page.goto(tiny_node.url + "/contribute")
    got = page.evaluate("""async ([backend, ids, B, T]) => {
        """ + F32_TO_B64 + """
        const tf = await import("/static/vendor/tf.js");
        const { BrowserTrainer, chooseBackend } = await import("/static/trainer.js");
        const chosen = await chooseBackend(tf, "", [backend]);
        const trainer = new BrowserTrainer(tf);
        await trainer.loadModel();
        const { loss, grads } = await trainer.gradients(Int32Array.from(ids), B, T);
        return { backend: chosen.backend, loss, grads: grads.map(b64) };
    }""", [backend, tokens.reshape(-1).tolist(), 2, 32])
    assert got["backend"] == backend

    model, manifest = _f16_model(tiny_node)
    model.zero_grad()
    out = model(input_ids=torch.from_numpy(tokens).long(), labels=torch.from_numpy(tokens).long())
    out.loss.backward()
    assert got["loss"] == pytest.approx(out.loss.item(), rel=1e-5)
    params = dict(model.named_parameters())
    worst = 0.0
    for t, g64 in zip(manifest, got["grads"]):
        want = params[t["name"]].grad.reshape(-1).numpy()
        js = np.frombuffer(base64.b64decode(g64), "<f4")
        assert js.shape == want.shape, t["name"]
        # max relative error on each tensor: the largest difference against the tensor's largest gradient
        rel = float(np.max(np.abs(js - want)) / np.max(np.abs(want)))
        assert rel < 1e-3, f"{t['name']}: max relative error {rel:.2e}"
        worst = max(worst, rel)
    print(f"{backend}: loss {got['loss']:.6f} vs torch {out.loss.item():.6f}; worst tensor max rel error {worst:.2e}")


@pytest.mark.timeout(180)
def test_weights_cached_in_8mb_chunks_per_step(page, tiny_node):
    page.goto(tiny_node.url + "/contribute")
    chunks = page.evaluate("""async () => {
        const w = await import("/static/weights.js");
        const big = new Uint8Array(20 * 1024 * 1024 + 5);
        for (let i = 0; i < big.length; i++) big[i] = (i * 2654435761) >>> 24;
        const n = await w.cachePut("probe", big.buffer);
        const back = new Uint8Array(await w.cacheGet("probe"));
        const same = back.length === big.length && back.every((x, i) => x === big[i]);
        const db = await new Promise((ok) => { const r = indexedDB.open("dtrain-weights"); r.onsuccess = () => ok(r.result); });
        const sizes = await new Promise((ok) => {
          const req = db.transaction("chunks").objectStore("chunks").getAll(IDBKeyRange.bound("probe:0", "probe:9"));
          req.onsuccess = () => ok(req.result.map((c) => c.byteLength));
        });
        return { n, same, sizes };
    }""")
    assert chunks["same"] and chunks["n"] == 3
    assert chunks["sizes"] == [8 * 1024 * 1024, 8 * 1024 * 1024, 4 * 1024 * 1024 + 5]

    load = """async () => {
        const tf = await import("/static/vendor/tf.js");
        const { BrowserTrainer } = await import("/static/trainer.js");
        await tf.setBackend("cpu");
        const t = new BrowserTrainer(tf);
        const step = await t.loadModel();
        const sums = await Promise.all(t.tensors.map(async (x) => (await x.data()).reduce((a, b) => a + b, 0)));
        t.dispose();
        const db = await new Promise((ok) => { const r = indexedDB.open("dtrain-weights"); r.onsuccess = () => ok(r.result); });
        const keys = await new Promise((ok) => {
          const req = db.transaction("chunks").objectStore("chunks").getAllKeys(); req.onsuccess = () => ok(req.result); });
        return { step, stats: t.stats, sums, keys: keys.filter((k) => k.startsWith("train:")) };
    }"""
    tensors = len(tiny_node.get_json("/api/v1/model/manifest")["tensors"])
    first = page.evaluate(load)
    assert first["stats"]["downloadedBytes"] > 0 and first["stats"]["cacheHits"] == 0
    again = page.evaluate(load)  # same step: every tensor from IndexedDB, nothing downloaded
    assert again["step"] == first["step"]
    assert again["stats"] == dict(first["stats"], downloadedBytes=0, cacheHits=tensors)
    assert again["sums"] == first["sums"]

    # the node moves on: the next load downloads the new step and drops the old step's chunks
    _advance(tiny_node, 1)
    moved = page.evaluate(load)
    assert moved["step"] > first["step"] and moved["stats"]["downloadedBytes"] > 0
    assert all(f":{moved['step']}:" in k for k in moved["keys"]), moved["keys"]
    assert len([k for k in moved["keys"] if k.endswith(":meta")]) == tensors


def _advance(node: NodeProcess, updates: int) -> int:
    """Move the node `updates` steps on with packets of its current step; returns the new step."""
    manifest = node.get_json("/api/v1/model/manifest")["tensors"]
    for i in range(updates):
        step = node.get_json("/api/v1/model/info")["step"]
        packet = dgrd.encode(step, f"advance-{i}", 4.0 + i, 1, [(3, None, np.full(manifest[3]["elements"], 0.1, np.float32))])
        urllib.request.urlopen(urllib.request.Request(node.url + "/api/v1/train/submit", data=packet,
                                                      method="POST"), timeout=10).read()
        wait_until(lambda: node.get_json("/api/v1/model/info")["step"] > step, 30, "the update")
    return node.get_json("/api/v1/model/info")["step"]


@pytest.mark.timeout(120)
def test_pages_are_cross_origin_isolated_for_threaded_wasm(page, tiny_node):
    # COOP/COEP on the pages: SharedArrayBuffer, so TensorFlow.js's WASM backend can run its threaded SIMD build
    page.goto(tiny_node.url + "/contribute")
    got = page.evaluate("""async () => {
        const tf = await import("/static/vendor/tf.js");
        return { isolated: self.crossOriginIsolated, threads: await tf.env().getAsync("WASM_HAS_MULTITHREAD_SUPPORT") };
    }""")
    assert got == {"isolated": True, "threads": True}


@pytest.mark.timeout(180)
def test_trainer_refetches_the_model_on_409(page, tiny_node):
    page.goto(tiny_node.url + "/contribute")
    page.evaluate("""async () => {
        const tf = await import("/static/vendor/tf.js");
        const { BrowserTrainer, chooseBackend } = await import("/static/trainer.js");
        await chooseBackend(tf, "", ["wasm", "cpu"]);
        window.trainer = new BrowserTrainer(tf, { batchSize: 2, seqLen: 16, text: "To be, or not to be: ".repeat(20) });
        await window.trainer.loadModel();
    }""")
    old = page.evaluate("window.trainer.step")
    losses = len(tiny_node.get_json("/api/v1/server/losses"))
    new = _advance(tiny_node, 6)  # past the late window of 5 steps
    result = page.evaluate("window.trainer.trainOnce()")
    assert result["status"] == 409 and result["serverStep"] == new
    assert page.evaluate("window.trainer.step") == new and page.evaluate("window.trainer.stats.refetches") == 1
    assert len(tiny_node.get_json("/api/v1/server/losses")) == losses + 6  # the stale packet changed nothing
    result = page.evaluate("window.trainer.trainOnce()")  # on the new step it is accepted
    assert result["status"] == 200 and old < new
    # what the trainer keeps per step (gpt2.js stepConstants: the LM head's wte^T) is the new step's: its gradients
    # equal those computed with nothing kept, to the bit
    same = page.evaluate("""async () => {
        const { lossAndGradients } = await import("/static/gpt2.js");
        const t = window.trainer, ids = Int32Array.from({ length: 32 }, (_, i) => (i * 7919) % 50257);
        const kept = await t.gradients(ids, 2, 16);
        const fresh = await lossAndGradients(t.tf, t.config, t.manifest.map((m) => m.name), t.tensors, ids, 2, 16);
        return kept.loss === fresh.loss && kept.grads.every((g, i) => g.every((v, j) => Object.is(v, fresh.grads[i][j])));
    }""")
    assert same


@pytest.fixture
def training_node(tmp_path):
    text = tmp_path / "train.txt"
    text.write_text(shakespeare(50_000))
    # it hands out batches of its text; one sample of its own per update, and updates need many samples: idle (in
    # per-step mode: a low-comm node alone makes each of its own batches an update, and the page's step would move)
    proc = NodeProcess("contribute", [*PER_STEP, "--model-config", str(TINY_CONFIG), "--train-data", str(text),
                                      "--local-samples-per-update", "1", "--local-batch-size", "1",
                                      "--target-batch-size", "100000"], new_run_id())
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


@pytest.mark.timeout(240)
def test_contribute_page_trains_the_node(page, tiny_node):
    page.goto(tiny_node.url + "/contribute")
    # tiny_node has no dataset: the page says so, and the contributor gives its own text
    page.click("#start")
    wait_until(lambda: "paste some text" in page.inner_text("#message"), 60, "the page to ask for text")
    page.fill("#text", shakespeare(4000))
    step0 = tiny_node.get_json("/api/v1/model/info")["step"]
    losses0 = len(tiny_node.get_json("/api/v1/server/losses"))
    page.click("#start")
    wait_until(lambda: tiny_node.get_json("/api/v1/model/info")["step"] > step0, 120, "the node's step to advance")
    wait_until(lambda: int(page.inner_text("#steps")) >= 1, 30, "the page to count its step")
    assert page.inner_text("#backend") in ("webgpu", "webgl", "wasm", "cpu")
    shown = float(page.inner_text("#loss"))
    assert 8.0 < shown < 12.0  # a random-init GPT-2 over 50,257 tokens: about ln(50257) = 10.8
    page.click("#stop")
    # each accepted packet is one update here: the loss history holds the losses the page sent
    wait_until(lambda: any(abs(v - shown) < 1e-4 for v in tiny_node.get_json("/api/v1/server/losses")[losses0:]),
               30, f"the node's loss history to hold the page's loss {shown}")
    assert int(page.inner_text("#samples")) >= 4
    wait_until(lambda: "Stopped." in page.inner_text("#message"), 60, "the worker to stop")
    assert page.is_enabled("#start")


@pytest.fixture
def first_run_node():
    # as `make node` starts it (the tiny model for speed): no data flag, so it hands out the default corpus
    proc = NodeProcess("first-run", ["--model-config", str(TINY_CONFIG)], new_run_id())
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


@pytest.mark.timeout(240)
def test_first_run_trains_on_the_default_corpus_with_nothing_pasted(page, first_run_node):
    page.goto(first_run_node.url + "/contribute")
    assert page.input_value("#text") == ""
    page.click("#start")
    wait_until(lambda: first_run_node.status()["updates"] >= 2, 180, "two updates from the page")
    assert "paste some text" not in page.inner_text("#message")
    page.click("#stop")
    browser.ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(browser.ARTIFACTS / "contribute-first-run.png"), full_page=True)


@pytest.mark.timeout(240)
def test_contribute_page_uses_node_batches_and_reports_a_lost_node(page, training_node):
    page.goto(training_node.url + "/contribute")
    page.click("#start")
    wait_until(lambda: int(page.inner_text("#steps")) >= 1, 120, "a step on the node's batches")
    training_node.kill()
    try:
        wait_until(lambda: "unreachable" in page.inner_text("#message"), 60, "the page to report the lost node")
    except TimeoutError as e:
        raise AssertionError(f"{e}; the page says {page.inner_text('#message')!r} after "
                             f"{page.inner_text('#steps')} steps") from e
    assert page.is_enabled("#start")


@pytest.mark.timeout(180)
def test_chat_page_greedy_equals_python_client(page, tiny_node):
    prompt, n = "The quick brown fox", 12
    eos = 50256
    ids = load_tokenizer().encode(prompt).ids

    def reference():  # on its own thread: Playwright's sync API holds this thread's event loop
        with SplitClient(tiny_node.url, transport="http", weights_format="f16") as client:
            return client.generate(ids, n, repetition_penalty=1.3, stop_token_ids=[eos])
    with ThreadPoolExecutor(1) as pool:
        want = pool.submit(reference).result(timeout=60)
    page.goto(tiny_node.url + "/chat")
    page.wait_for_selector("#go:enabled", timeout=60_000)
    page.fill("#prompt", prompt)
    page.fill("#max", str(n))
    page.fill("#temp", "0")
    page.fill("#rep", "1.3")
    page.click("#go")
    page.wait_for_function("document.querySelector('#status').textContent.includes('tok/s')", timeout=60_000)
    assert json.loads(page.get_attribute("#out", "data-ids")) == want
    assert page.inner_text("#out") == prompt + load_tokenizer().decode(want)
    timings = page.inner_text("#timings")
    assert re.search(r"total \d+\.\d ms · HE off · DP sigma 0 · cached_seq_len \d+", timings), timings


@pytest.mark.timeout(180)
def test_tokenizer_and_dgrd_parity_in_chromium(page, tiny_node):
    page.goto(tiny_node.url + "/chat")
    tokenizer = load_tokenizer()
    texts = [shakespeare(1_115_394), STRESS_TEXT]
    got = page.evaluate("""async (texts) => {
        const { GPT2Tokenizer } = await import("/static/tokenizer.js");
        const tok = await GPT2Tokenizer.fromUrl("");
        return texts.map((t) => { const ids = tok.encode(t); return { ids, back: tok.decode(ids) }; });
    }""", texts)
    for text, result in zip(texts, got):
        assert result["ids"] == tokenizer.encode(text).ids
        assert result["back"] == text

    specs = [{"step": 123456, "nodeId": "nöde-🚀-42", "trainLoss": 2.718281828, "samples": 32, "flags": flags,
              "sections": [{"tensorId": t, "indices": None if i is None else [int(x) for x in i],
                            "values": [float(v) for v in np.asarray(v, np.float32)]} for t, i, v in sections]}
             for _, flags, sections in CASES]
    packets = page.evaluate("""async (specs) => {
        const { encodeDGRD } = await import("/static/dgrd.js");
        return specs.map((s) => Array.from(encodeDGRD({ ...s, sections: s.sections.map((x) => ({ tensorId: x.tensorId,
          indices: x.indices === null ? null : Uint32Array.from(x.indices), values: Float32Array.from(x.values) })) })));
    }""", specs)
    for (name, flags, sections), got_bytes in zip(CASES, packets):
        want = dgrd.encode(123456, "nöde-🚀-42", 2.718281828, 32, sections, flags=flags)
        assert bytes(got_bytes) == want, name


@pytest.mark.timeout(180)
def test_dashboard_draws_the_loss_curve(page, tiny_node):
    _advance(tiny_node, 4)
    losses = tiny_node.get_json("/api/v1/server/losses")
    page.set_viewport_size({"width": 1200, "height": 900})
    page.goto(tiny_node.url + "/")
    page.wait_for_function(f"document.querySelector('#loss-summary').textContent.includes('{len(losses)} update')",
                           timeout=30_000)
    # the curve is drawn in the accent colour: count its pixels on the canvas
    curve = browser.curve_pixels(page, "#loss-canvas")
    assert curve > 100, curve
    browser.ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(browser.ARTIFACTS / "dashboard.png"), full_page=True)
    assert (browser.ARTIFACTS / "dashboard.png").stat().st_size > 10_000
    # the contributor ledger, row for row as /api/v1/contributors has it
    ledger = tiny_node.get_json("/api/v1/contributors?limit=50")["contributors"]
    page.wait_for_function(f"document.querySelectorAll('#ledger-body tr[data-node-id]').length === {len(ledger)}",
                           timeout=30_000)
    shown = page.evaluate("""() => [...document.querySelectorAll('#ledger-body tr[data-node-id]')].map(
        (tr) => [tr.dataset.nodeId, tr.children[1].textContent, tr.children[4].textContent])""")
    assert {row[0]: (row[1], row[2]) for row in shown} == {
        r["node_id"]: (f"{r['accepted']:,}", f"{r['samples_credited']:,}") for r in ledger}
    assert {f"advance-{i}" for i in range(4)} <= {row[0] for row in shown}
    # what the node keeps of what /v1 serves, as its /v1/models says (this node was given no --capture-db)
    assert tiny_node.get_json("/v1/models")["dtrain_capture"]["recording"] is False
    page.wait_for_function("document.querySelector('#capture').textContent.includes('records nothing')",
                           timeout=30_000)
