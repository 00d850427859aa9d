"""examples/flywheel.py in a reduced form (one round, 4 samples per question): the agent's rewards reach a real
node, every rewarded row is trained on, and the node serves a newer model before the last evaluation."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.nodeproc import REPO

pytestmark = [pytest.mark.http, pytest.mark.timeout(120)]


def _flywheel():
    if "flywheel" not in sys.modules:  # dataclasses look their module up there
        spec = importlib.util.spec_from_file_location("flywheel", REPO / "examples" / "flywheel.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["flywheel"] = module
        spec.loader.exec_module(module)
    return sys.modules["flywheel"]


def test_grading_reads_the_first_line_and_gives_partial_credit():
    flywheel = _flywheel()
    assert flywheel.grade(" cat\nrepeat: dog ->", "cat") == 1.0
    assert flywheel.grade(" ca", "cat") == pytest.approx(0.8)  # 2 * 2 matching / (2 + 3)
    assert flywheel.grade("", "cat") == 0.0


@pytest.mark.slow
def test_one_round_of_the_flywheel_trains_the_served_model(capsys):
    flywheel = _flywheel()
    result = flywheel.main(["--rounds", "1", "--samples", "4"])
    versions = result["versions"]
    assert len(versions) == 2 and versions[1] > versions[0]  # the node trained on the round and serves it
    for greedy, sampled in (result["before"][:2], result["after"][:2]):
        for score in (greedy, sampled):
            assert 0.0 <= score.exact <= score.graded <= 1.0  # an exact answer grades 1
    assert len(result["before"][2]) == len(flywheel.WORDS)
    out = capsys.readouterr().out
    assert "before: greedy graded" in out and "round  1: sampled graded" in out and "after:  greedy graded" in out
