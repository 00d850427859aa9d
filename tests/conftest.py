"""Every test module declares its tier, so that `-m` picks a tier and nothing runs in the wrong one.

The tiers are pyproject's markers: `unit` (pure, in-process), `http` (a node's routes in-process, or one real node),
`browser` (headless Chromium), `swarm` (several real nodes), `netns` (network namespaces), `gpu`, `install` (a
wheel of this tree installed into a fresh environment). A module says
which with `pytestmark = pytest.mark.<tier>` (or a list holding one); a module without one, or with two, or a
test marked with a tier of its own, fails collection with a message that names it. `make test-fast` runs
`-m "(unit or http) and not slow"`: `slow` is no tier, it marks a unit or http test that takes seconds.

The suite runs the slow tiers first (`RUN_ORDER`): `make test` spreads it over two pytest-xdist workers that each take
the next test when done (`--maxschedchunk 1`), and the minutes-long tests, started first, end together with the
seconds-long ones instead of after them. The real nodes of the swarm tests are forked from a server that has imported
their libraries once per worker (tests.forkserver).
"""
from __future__ import annotations

import dtrain  # noqa: F401  (first: it keeps numpy's OpenBLAS single-threaded, before anything imports numpy)
import pytest

TIERS = ("unit", "http", "browser", "swarm", "netns", "gpu", "install")
RUN_ORDER = ("netns", "swarm", "install", "browser", "gpu", "http", "unit")  # the slowest tiers first


def module_tiers(module) -> list[str]:
    """The tier markers a test module declares in its `pytestmark`."""
    marks = getattr(module, "pytestmark", [])
    if not isinstance(marks, (list, tuple)):
        marks = [marks]
    return [m.name for m in marks if getattr(m, "name", None) in TIERS]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    problems = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None or module.__name__ in problems:
            continue
        tiers = module_tiers(module)
        if len(tiers) != 1:
            problems[module.__name__] = (item.path, "declares " + " and ".join(tiers) if tiers else "declares no tier")
    for item in items:  # a test marked with a tier of its own would run in its module's tier too
        own = [m.name for m in item.own_markers if m.name in TIERS]
        if own and getattr(item, "module", None) is not None and item.module.__name__ not in problems:
            problems[item.module.__name__] = (item.path, f"marks {item.name} {' and '.join(own)}: move it to a "
                                                         "module of that tier")
    if problems:
        lines = [f"  {path}: {what}" for path, what in problems.values()]
        raise pytest.UsageError(
            "every test module declares exactly one tier, e.g. `pytestmark = pytest.mark.unit` "
            f"(one of {', '.join(TIERS)}; see tests/conftest.py):\n" + "\n".join(lines))
    items.sort(key=lambda item: RUN_ORDER.index(module_tiers(item.module)[0]) if getattr(item, "module", None)
               else len(RUN_ORDER))  # stable: within a tier, the files' order
