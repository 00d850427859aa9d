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
