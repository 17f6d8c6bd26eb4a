"""The README and docs/ stay true: relative links resolve, and code blocks run.

Every relative link in README.md and docs/*.md must name a file that exists, and a
``#anchor`` must name a heading of that file (GitHub's slugs). Every ```python block runs
(each page's blocks in order, in one namespace, in a temp directory), unless the line
before it is a ``<!-- not-run: reason -->`` comment, which should name the test that
covers the block (for example a torchrun or a framework ``Trainer`` example).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_PYTHON = re.compile(r"(?:(<!--\s*not-run:[^>]*-->)\s*\n)?```python\n(.*?)^```", re.S | re.M)


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def slugs(text: str) -> set[str]:
    """The anchors GitHub makes of a page's headings (lowercase, punctuation dropped,
    spaces to hyphens, ``-1``, ``-2`` for repeats)."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    for line in _FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_slugs_follow_github():
    assert slugs("## The `tw` command\n## What gets which codec: rules and presets\n## A\n## A\n") == {
        "the-tw-command",
        "what-gets-which-codec-rules-and-presets",
        "a",
        "a-1",
    }


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    text = page.read_text()
    broken = []
    for target in _LINK.findall(_FENCE.sub("", text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in slugs(dest.read_text()):
            broken.append(f"{target}: no heading with that anchor in {_rel(dest)}")
    assert not broken, f"{_rel(page)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_python_blocks_run_or_say_why_not(page, tmp_path, monkeypatch):
    blocks = _PYTHON.findall(page.read_text())
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "docs_example"}
    for mark, code in blocks:
        if mark:
            assert re.search(r"tests/(?:\w+/)?test_\w+\.py", mark), (
                f"{_rel(page)}: {mark} names no covering test"
            )
            continue
        exec(compile(code, _rel(page), "exec"), scope)


def test_every_python_block_is_seen():
    """The block pattern above misses no ```python fence (e.g. one indented in a list)."""
    for page in PAGES:
        text = page.read_text()
        assert len(_PYTHON.findall(text)) == text.count("```python"), _rel(page)


def test_not_run_marks_name_existing_tests():
    for page in PAGES:
        for mark, _ in _PYTHON.findall(page.read_text()):
            for test in re.findall(r"tests/(?:\w+/)?test_\w+\.py", mark):
                assert (ROOT / test).exists(), f"{_rel(page)}: {test} does not exist"


_CITED_TEST = re.compile(r"`(test_\w+\.py)::(test_\w+)`")


def _test_functions(name: str) -> set[str]:
    """The test functions defined in every file called ``name`` under tests/."""
    found: set[str] = set()
    for path in (ROOT / "tests").rglob(name):
        found |= set(re.findall(r"^def (test_\w+)\(", path.read_text(), re.M))
    return found


def test_cited_tests_exist():
    """A promise in the docs that names ``test_file.py::test_name`` names a real test."""
    missing = []
    for page in PAGES:
        for file, func in _CITED_TEST.findall(page.read_text()):
            if func not in _test_functions(file):
                missing.append(f"{_rel(page)}: {file}::{func}")
    assert not missing, "docs cite tests that do not exist:\n" + "\n".join(missing)
    assert any(_CITED_TEST.search(p.read_text()) for p in PAGES), "no page cites a test"


def test_the_readme_test_command_is_what_ci_runs():
    """The README's second command (a newcomer's test run) installs the extras CI installs
    and runs the same pytest command as .ci/run."""
    first_block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    readme = [line for line in first_block.splitlines() if line.strip()]
    assert len(readme) == 2, "the README opens with two commands: the main job, and the tests"
    ci = (ROOT / ".ci" / "run").read_text()
    extras = re.compile(r'-e "\.\[([^\]]*)\]"')
    assert extras.findall(readme[1]) == extras.findall(ci), "the README and .ci/run install other extras"
    readme_test = readme[1].rsplit("&&", 1)[1].strip()
    ci_tests = [line.strip() for line in ci.splitlines() if line.strip().startswith("python -m pytest")]
    assert ci_tests == [readme_test], f"CI runs {ci_tests}, the README says {readme_test!r}"
