"""The package as a user installs it: a wheel built from this tree, installed into a fresh virtual environment, runs
`dtrain-node` with nothing else of the repository beside it, hands out batches of the packaged default corpus and
serves its pages.

The wheel is built from a copy of what a build reads (pyproject.toml, setup.py, README.md, dtrain/), so this tree
gets no build/ or egg-info. The fresh environment reuses the dependencies this interpreter already has (a .pth
line naming its site-packages, as --system-site-packages would for a system interpreter), so nothing is
downloaded and torch is not installed again; only `dtrain` itself comes from the wheel, which the test checks.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.nodeproc import REPO, free_port, new_run_id, wait_until

pytestmark = [pytest.mark.install, pytest.mark.timeout(300)]

BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "dtrain")


def _run(argv, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=240, **kwargs)
    assert out.returncode == 0, f"{argv[:3]} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _clean_env() -> dict:
    # PYTHONPATH would put this tree's dtrain ahead of the installed one
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    if not (REPO / "dtrain" / "static" / "vendor").is_dir():
        pytest.fail("dtrain/static/vendor/ is not built: run `make setup` (make test builds it first)")
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    wheels = tmp / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(wheels), str(src)], env=_clean_env())
    [wheel] = wheels.glob("dtrain-*.whl")

    env_dir = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(env_dir)], env=_clean_env())
    py = env_dir / "bin" / "python"
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        env=_clean_env()).stdout.strip())
    (purelib / "reuse-installed-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], env=_clean_env())
    return env_dir


def test_the_installed_dtrain_is_the_wheels(venv):
    out = _run([str(venv / "bin" / "python"), "-c", "import dtrain; from dtrain.bridge import sparse_check as s; "
                "print(dtrain.__file__); print(s.native is not None)"],
               env=_clean_env(), cwd=venv)
    where, native = out.stdout.split()
    assert Path(where).is_relative_to(venv), where
    assert native == "True"  # the C checks were compiled into the wheel


def test_installed_node_hands_out_the_packaged_corpus_and_serves_its_pages(venv):
    port = free_port()
    proc = subprocess.Popen([str(venv / "bin" / "dtrain-node"), "--host", "127.0.0.1", "--port", str(port),
                             "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id", new_run_id()],
                            cwd=venv, env={**_clean_env(), "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        def ready():
            if proc.poll() is not None:
                raise RuntimeError(f"dtrain-node exited with {proc.returncode}:\n{''.join(lines)[-4000:]}")
            return any("Join it from another machine with" in line for line in lines)
        wait_until(ready, 120, "the installed dtrain-node to be ready")
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(url + "/api/v1/data/batch?batch_size=2&seq_len=16", timeout=10) as r:
            assert r.status == 200
            assert (r.headers["X-Batch-Size"], r.headers["X-Seq-Len"]) == ("2", "16")
            tokens = np.frombuffer(r.read(), "<u4")
        assert tokens.size == 32 and int(tokens.max()) < 50257
        assert any("Handing out batches of the default corpus" in line for line in lines)
        with urllib.request.urlopen(url + "/", timeout=10) as r:
            page = r.read().decode()
        assert r.status == 200 and "<html" in page.lower() and "/static/site.css" in page
        with urllib.request.urlopen(url + "/static/vendor/tf.js", timeout=10) as r:
            assert r.status == 200 and len(r.read()) > 100_000  # the browser bundle travels with the wheel
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        reader.join(5)
