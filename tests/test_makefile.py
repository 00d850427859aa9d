"""The Makefile's torch set-up, read from `make -n` (nothing is run, nothing downloaded): the CPU build by default,
the CUDA build of the same version only when TORCH_CUDA names one."""
import os
import re
import shutil
import subprocess

import pytest

from tests.nodeproc import REPO

pytestmark = pytest.mark.unit

INDEX = "https://download.pytorch.org/whl/"


def torch_pin() -> str:
    """The torch version constraints.txt pins (the tested set)."""
    return re.search(r"^torch==(\S+)$", (REPO / "constraints.txt").read_text(), re.M).group(1)


def make_n(venv, *variables: str) -> subprocess.CompletedProcess:
    """What `make` would run to set up `venv`, with `variables` on its command line."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    # a parent make (make test TORCH_CUDA=...) passes its variables down in MAKEFLAGS: start from none
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TORCH_CUDA")}
    return subprocess.run(["make", "-n", "--no-print-directory", "-C", str(REPO), f"VENV={venv}", *variables,
                           f"{venv}/.installed"], env=env, capture_output=True, text=True, timeout=60)


def pip_lines(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if "pip install" in line]


def test_default_installs_the_cpu_build_first_and_no_cuda_index(tmp_path):
    lines = pip_lines(make_n(tmp_path / "venv"))
    version = torch_pin()
    assert lines == [f"{tmp_path}/venv/bin/pip install --quiet torch=={version}",
                     f"{tmp_path}/venv/bin/pip install --quiet -c constraints.txt -e '.[test]' torch=={version}"]
    assert not any("index-url" in line or "+cu" in line for line in lines)


def test_torch_cuda_installs_that_build_of_the_same_version_first(tmp_path):
    lines = pip_lines(make_n(tmp_path / "venv", "TORCH_CUDA=cu128"))
    version = torch_pin()
    assert lines[0] == f"{tmp_path}/venv/bin/pip install --quiet --index-url {INDEX}cu128 torch=={version}+cu128"
    # the rest is the default set-up, whose torch==VERSION the CUDA build already satisfies
    assert lines[1:] == pip_lines(make_n(tmp_path / "venv"))
    assert not any("index-url" in line for line in lines[1:])


def test_torch_cuda_replaces_the_torch_of_a_set_up_venv(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").touch()  # set up (CPU build) after every file it depends on changed
    assert pip_lines(make_n(venv)) == []
    lines = pip_lines(make_n(venv, "TORCH_CUDA=cu126"))
    assert len(lines) == 3 and f"--index-url {INDEX}cu126 torch=={torch_pin()}+cu126" in lines[0]
    (venv / ".torch-cu126").touch()
    (venv / ".installed").touch()  # the set-up that followed it: later makes, with or without it, keep it
    assert pip_lines(make_n(venv, "TORCH_CUDA=cu126")) == [] and pip_lines(make_n(venv)) == []


@pytest.mark.parametrize("value", ["rocm6.2", "cpu", "12.8"])
def test_torch_cuda_must_name_a_cuda_build(tmp_path, value):
    result = make_n(tmp_path / "venv", f"TORCH_CUDA={value}")
    assert result.returncode != 0
    assert f'TORCH_CUDA names a CUDA build of torch {torch_pin()}, e.g. TORCH_CUDA=cu128; got "{value}"' in result.stderr
