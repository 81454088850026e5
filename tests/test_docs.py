"""README.md and every page under docs/ say only what runs.

Each fenced ```python block is executed; the blocks of one page run in order in one namespace
(as a reader pastes them into one session), in a fresh temporary directory. Blocks in shell or
other non-Python languages (```bash, ```console, ```text, ...) are shell-only or prose and are
not run; a fence without a language is refused (say which it is). A Python block that cannot
run in one process (it needs a job launched on several ranks or a checkpoint) carries the marker
``<!-- doc-test: skip <why> -->`` on the line before its fence, and the reason is required.
New pages are picked up by the glob. The README also stays short, opens with the two commands
.ci/run uses, and every relative link in the pages resolves.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "py"}
NOT_RUN = {"bash", "sh", "shell", "console", "text", "json", "yaml", "toml", "ini", "csv", "diff", "markdown"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<lang>[^\s`]*)[^\n]*\n(?P<body>.*?)"
                   r"^(?P=indent)(?P=fence)[ \t]*$", re.M | re.S)
SKIP = re.compile(r"<!--\s*doc-test:\s*skip\b(?P<why>[^>]*)-->\s*$")


def blocks(page: Path) -> list[tuple[int, str, str, str | None]]:
    """(line, language, source, skip reason or None) of every fenced block of ``page``."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        indent = len(m["indent"])
        body = "\n".join(ln[indent:] for ln in m["body"].splitlines())
        out.append((line, m["lang"].lower(), body, skip["why"].strip(" :-") if skip else None))
    return out


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_code_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__doc_test__"}
    for line, lang, source, skip in blocks(page):
        where = f"{_id(page)}:{line}"
        assert lang, f"{where}: a code block without a language; mark it ```python (run) or ```bash/```text"
        assert lang in RUN | NOT_RUN, f"{where}: unknown block language {lang!r}"
        if lang not in RUN:
            continue
        if skip is not None:
            assert len(skip) > 10, f"{where}: a skipped Python block must say why it cannot run here"
            continue
        exec(compile(source, where, "exec"), namespace)   # noqa: S102 - the docs' own examples


def test_readme_is_short_and_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 12 * 1024, len(readme.encode())
    ci = (ROOT / ".ci/run").read_text()
    setup, tests = "./scripts/setup.sh", ".venv/bin/python -m pytest -q tests"
    assert f"{setup} && {tests}" in ci
    first = [b for b in blocks(ROOT / "README.md")][:2]
    assert [b[2].strip() for b in first] == [f"{setup} && .venv/bin/autoplan demo", f"{setup} && {tests}"], first


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_relative_links_resolve(page):
    text = FENCE.sub("", page.read_text())
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{_id(page)}: links to missing files {missing}"
