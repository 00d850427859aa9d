"""Headless Chromium for the browser tests: Debian's /usr/bin/chromium driven through Playwright."""
from __future__ import annotations

import shutil
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# this machine's network is closed: without the background-networking flags Chromium keeps dialling Google
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def launch(playwright, user_data_dir: Path):
    """A persistent context (its own profile, so IndexedDB persists across pages of one test)."""
    return playwright.chromium.launch_persistent_context(
        str(user_data_dir), executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


# the loss curves are drawn in the accent colour (#2f6fb0-ish): the pixels of that colour on a canvas
_CURVE_PIXELS_JS = """(selector) => {
    const c = document.querySelector(selector), d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
    let n = 0;
    for (let i = 0; i < d.length; i += 4) if (Math.abs(d[i] - 0x2f) < 40 && Math.abs(d[i + 1] - 0x6f) < 40 && d[i + 2] > 0xb0) n++;
    return n;
}"""


def curve_pixels(page, canvas_selector: str) -> int:
    """How many pixels of a loss curve the page's canvas shows."""
    return page.evaluate(_CURVE_PIXELS_JS, canvas_selector)
