"""README and docs/: the README keeps its two commands, its size and the GPU set-up; every link between the pages
reaches a file and a heading that exist."""
import re

import pytest

from tests.nodeproc import REPO

pytestmark = pytest.mark.unit

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "docs" / "spec").glob("*.md"))]


def anchors(path) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    found, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = re.match(r"#{1,6} (.+)", line)
        if heading and not fenced:
            found.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return found


def links(path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", path.read_text())


def test_readme_keeps_its_two_commands_its_size_and_the_gpu_set_up():
    text = (REPO / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 300
    assert "    make node" in lines and "    make test" in lines
    assert re.search(r"^    make setup TORCH_CUDA=cu\d+ ", text, re.M)
    assert "TORCH_CUDA :=" in (REPO / "Makefile").read_text()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_reaches_a_file_and_a_heading(page):
    broken = []
    for link in links(page):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{link}: no such heading")
    assert not broken, broken


def test_no_page_names_a_path_on_someones_machine():
    for page in PAGES:
        assert not re.search(r"(?<![\w.])/(work|home|Users|root)/", page.read_text()), page
