"""The three pages as one site, in real headless Chromium against one real node started as `make node` starts it
(the tiny model for speed, default corpus, server DP on): the shared header and live status line on every page,
/contribute's own loss curve, rates and backend, /chat's streamed tokens and split-session numbers. Screenshots of
every page go to test-artifacts/."""
from __future__ import annotations

import json
import re

import pytest

from tests import browser
from tests.nodeproc import REPO, TINY_CONFIG, NodeProcess, new_run_id, wait_until
from tests.test_browser import _advance, page, playwright  # noqa: F401  (fixtures shared with the browser tests)

pytestmark = pytest.mark.browser

playwright_sync = pytest.importorskip("playwright.sync_api")

PAGES = {"/": "dashboard", "/contribute": "contribute", "/chat": "chat"}
DP_EPSILON = 8  # one of docs/split-privacy.md's measured settings, so /chat has an exact row to show
PRIVACY_ROW = re.compile(r"^\|\s*([\d.]+)\s*\|\s*(off|\d+) [^|]*\|\s*([\d.]+)%\s*\|\s*([\d.]+)%\s*\|$")


@pytest.fixture(scope="module")
def site_node():
    proc = NodeProcess("pages", ["--model-config", str(TINY_CONFIG), "--dp-epsilon", str(DP_EPSILON)], new_run_id())
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


def _shot(page, name: str) -> None:
    browser.ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(browser.ARTIFACTS / f"page-{name}.png"), full_page=True)


def _status_line(page) -> dict:
    return page.evaluate("""() => Object.fromEntries(["step", "peers", "contributors", "last-update"].map(
        (k) => [k, document.getElementById("status-" + k)?.textContent ?? null]))""")


@pytest.mark.timeout(180)
def test_every_page_has_the_navigation_and_the_live_status_line(page, site_node):
    page.set_viewport_size({"width": 1200, "height": 900})
    for path, name in PAGES.items():
        page.goto(site_node.url + path)
        page.wait_for_selector("#status-step", timeout=30_000)
        links = page.eval_on_selector_all("header.site nav a", "as => as.map((a) => [a.getAttribute('href'), "
                                          "a.textContent, a.getAttribute('aria-current')])")
        assert links == [[href, label, "page" if href == path else None] for href, label in PAGES.items()]
        sheets = page.evaluate("() => [...document.styleSheets].map((s) => s.href).filter(Boolean)")
        assert sheets == [site_node.url + "/static/site.css"], sheets
        # the line shows the node's own numbers
        status = site_node.status()
        wait_until(lambda: _status_line(page)["step"] == str(status["step"]), 10, f"{path}: the node's step")
        shown = _status_line(page)
        assert (shown["peers"], shown["contributors"]) == (str(status["peers"]), str(status["contributors"]))
        if path == "/":  # the dashboard's tiles render the same poll
            wait_until(lambda: page.inner_text("#s-step") == f"{status['step']:,}", 10, "the dashboard's step")
            assert page.inner_text("#s-updates") == f"{status['updates']:,}"
            assert page.inner_text("#s-peers").startswith(f"{status['peers']:,}")
            assert page.eval_on_selector_all("#nodes-body tr", "rs => rs.length") == len(status["nodes"])
        _shot(page, name)

    # live: the node moves on while /chat is open, and the line follows without a reload
    step = _advance(site_node, 1)

    def expected():  # read again each time: the node's counters settle just after its step moves
        s = site_node.status()
        return {"step": str(s["step"]), "peers": str(s["peers"]), "contributors": str(s["contributors"]),
                "last-update": f"took {s['last_update_s']:.2f} s"}
    wait_until(lambda: _status_line(page) == expected(), 10, f"the status line to show step {step}")
    assert _status_line(page)["step"] == str(step)

    # a failed poll is shown in the line (the page's own fetch fails: no answer), and the next good one clears it
    page.route("**/api/v1/swarm/status", lambda route: route.abort())
    wait_until(lambda: "node unreachable" in page.inner_text("#site-status"), 10, "the line to show the error")
    assert page.get_attribute("#site-status", "class") == "status bad"
    page.unroute("**/api/v1/swarm/status")
    wait_until(lambda: _status_line(page)["step"] == str(step), 10, "the line to recover")
    assert "unreachable" not in page.inner_text("#site-status")


@pytest.mark.timeout(240)
def test_contribute_shows_its_loss_curve_rates_and_backend(page, site_node):
    page.set_viewport_size({"width": 1000, "height": 1100})
    page.goto(site_node.url + "/contribute")
    assert page.get_attribute("#my-loss-canvas", "data-points") == "0"
    page.click("#start")  # nothing pasted: the node's default corpus
    try:
        wait_until(lambda: int(page.inner_text("#steps")) >= 2, 180, "two contributions from the page")
    except TimeoutError:
        _shot(page, "contribute-timeout")
        raise AssertionError(f"steps {page.inner_text('#steps')}, message {page.inner_text('#message')!r}")
    page.click("#stop")
    wait_until(lambda: "Stopped." in page.inner_text("#message"), 60, "the worker to stop")

    steps = int(page.inner_text("#steps"))
    assert page.get_attribute("#my-loss-canvas", "data-points") == str(steps)
    assert page.inner_text("#my-loss-summary").startswith(f"· {steps} contributions, latest ")
    curve = browser.curve_pixels(page, "#my-loss-canvas")
    assert curve > 100, curve
    # every packet was one update of this lone node: its loss history holds the page's last loss
    shown = float(page.inner_text("#loss"))
    assert any(abs(v - shown) < 1e-4 for v in site_node.get_json("/api/v1/server/losses")), shown

    samples_rate, tokens_rate = float(page.inner_text("#samples-rate")), float(page.inner_text("#tokens-rate"))
    assert samples_rate > 0 and float(page.inner_text("#step-time")) > 0
    # where the last contribution's time went: its parts, none more than the whole, the gradient a real share
    split = dict(part.rsplit(" ", 1) for part in page.inner_text("#step-split").split(" · "))
    assert list(split) == ["gradient", "top-k", "encode", "submit"], split
    assert 0 < float(split["gradient"]) and sum(map(float, split.values())) <= float(page.inner_text("#step-time")) + 0.02
    # a contribution is 4 sequences of min(64, max_seq_len = 64) tokens: tokens/s is 64 x samples/s
    assert tokens_rate == pytest.approx(64 * samples_rate, rel=0.01, abs=1)

    # the backend is the probe's fastest, and the page says so with every probe's time
    backend = page.inner_text("#backend")
    timings = json.loads(page.get_attribute("#why", "data-timings"))
    usable = {k: v for k, v in timings.items() if v is not None}
    assert backend == min(usable, key=usable.get)
    why = page.inner_text("#why")
    assert all(name in why for name in timings), why
    if "wasm" in usable:  # the node serves COOP/COEP: WASM may run threads
        assert "(cross-origin isolated)" in why and "SIMD yes" in why, why
    _shot(page, "contribute-trained")


def _docs_privacy_rows() -> list[tuple]:
    rows = []
    for line in (REPO / "docs" / "split-privacy.md").read_text().splitlines():
        m = PRIVACY_ROW.match(line.strip())
        if m:
            rows.append((float(m[1]), None if m[2] == "off" else int(m[2]), float(m[3]), float(m[4])))
    return rows


@pytest.mark.timeout(180)
def test_chat_streams_tokens_and_shows_the_split_session(page, site_node):
    config = site_node.get_json("/api/v1/split/config")
    page.goto(site_node.url + "/chat")
    page.wait_for_selector("#go:enabled", timeout=60_000)

    # the privacy table the page offers is the document's, row for row
    docs = _docs_privacy_rows()
    assert len(docs) == 15
    js = page.evaluate("""async () => (await import('/static/split_privacy.js')).PRIVACY_ROWS.map(
        (r) => [r.clientSigma, r.serverEpsilon, r.recovery, r.survival])""")
    assert [tuple(r) for r in js] == docs
    page.select_option("#noise", "0.05")
    row = page.evaluate("() => ({...document.querySelector('#privacy-row').dataset})")
    want = next(r for r in docs if r[0] == 0.05 and r[1] == DP_EPSILON)
    assert (float(row["sigma"]), int(row["epsilon"]), float(row["recovery"]), float(row["survival"])) == want
    assert f"{want[2]:.1f}%" in page.inner_text("#privacy-row")

    # tokens are shown one by one: a callback per change of the shown ids records how many there were
    page.evaluate("""() => {
        window.seen = [];
        new MutationObserver(() => window.seen.push(JSON.parse(document.querySelector('#out').dataset.ids || '[]').length))
          .observe(document.querySelector('#out'), { attributes: true, attributeFilter: ['data-ids'] });
    }""")
    prompt, n = "The quick brown fox", 8
    page.fill("#prompt", prompt)
    page.fill("#max", str(n))
    page.click("#go")
    page.wait_for_function("document.querySelector('#status').textContent.includes('tok/s')", timeout=60_000)
    ids = json.loads(page.get_attribute("#out", "data-ids"))
    assert 2 <= len(ids) <= n  # the tiny model ends on its end-of-text token with chance ~1/50257 a token
    assert page.evaluate("window.seen") == list(range(1, len(ids) + 1))
    assert page.inner_text("#tok-count") == str(len(ids))

    # the session's numbers are the node's: its DP sigma, and the KV cache it held before the last token was sent
    from dtrain.node.tokenizer import load_tokenizer
    prompt_len = len(load_tokenizer().encode(prompt).ids)
    assert page.inner_text("#transport") == "WebSocket"
    assert page.inner_text("#dp-sigma") == f"{config['dp']['sigma']:.4f}"
    assert int(page.inner_text("#kv-len")) == prompt_len + len(ids) - 2
    assert page.inner_text("#he") == "off"
    session = page.evaluate("() => document.querySelector('#session-id').title")
    assert re.fullmatch(r"[0-9a-f]{32}", session) and page.inner_text("#session-id") == session[:12]
    metrics = urllib_text(site_node.url + "/metrics")
    assert float(re.search(r"^dtrain_split_sockets (\S+)$", metrics, re.M)[1]) >= 1  # the page's WebSocket
    assert int(float(re.search(r"^dtrain_split_sessions (\S+)$", metrics, re.M)[1])) >= 1

    # the noise the page adds is N(0, sigma^2) on every coordinate
    stats = page.evaluate("""async () => {
        const { addGaussianNoise } = await import('/static/split_client.js');
        const x = addGaussianNoise(new Float32Array(40001), 0.05);
        const mean = x.reduce((a, b) => a + b, 0) / x.length;
        return { mean, std: Math.sqrt(x.reduce((a, b) => a + (b - mean) ** 2, 0) / x.length) };
    }""")
    assert abs(stats["mean"]) < 0.002 and stats["std"] == pytest.approx(0.05, rel=0.03), stats
    _shot(page, "chat-streamed")


def urllib_text(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()
