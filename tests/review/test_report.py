"""``autoplan report`` without a browser: what the page holds, that it is one file, and the CLI's
checks. (tests/review/test_report_browser.py opens the pages in headless chromium.)"""
from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

from autoplan import MeshSpec, autoplan
from autoplan.cli import main
from autoplan.cluster import plan_cluster
from autoplan.presets import build_preset
from autoplan.review import plan_report


class _Page(HTMLParser):
    """Ids, table texts by id, images and anything that would leave the file."""

    def __init__(self):
        super().__init__()
        self.ids, self.images, self.external, self.scripts = set(), [], [], 0
        self.tables: dict[str, str] = {}
        self._table: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        self.scripts += tag == "script"
        if tag == "table":
            self._table.append(a.get("id", ""))
            self.tables.setdefault(a.get("id", ""), "")
        if tag == "img":
            self.images.append(a)
        for key in ("src", "href"):
            if a.get(key) and not a[key].startswith(("#", "data:")):
                self.external.append(a[key])

    def handle_endtag(self, tag):
        if tag == "table" and self._table:
            self._table.pop()

    def handle_data(self, data):
        if self._table:
            self.tables[self._table[-1]] += data + " "


@pytest.fixture(scope="module")
def plans():
    model = build_preset("titan-llama3-70b", num_layers=2)
    piped = plan_cluster(model, 64, hardware="h100_sxm", batch=(64, 8192), constraints={"pp": 2, "tp": 8})
    flat = autoplan(model, MeshSpec((8, 8), ("dp", "tp"), "h100_sxm"), batch=(64, 8192))
    assert int(piped.pipeline["pp"]) == 2
    return piped, flat


def test_one_plan_page_holds_every_part(plans):
    piped, _ = plans
    page = _Page()
    page.feed(plan_report(piped, ["piped"]))
    assert page.scripts == 0 and page.external == []           # one file, opens offline
    for part in ("summary", "memory", "memory-figure", "pipeline", "stages", "timeline", "decisions", "styles",
                 "comm", "collectives", "rank-collectives", "alternatives"):
        assert f"plan0-{part}" in page.ids, part
    assert all(img["src"].startswith("data:image/png;base64,") and int(img["width"]) > 100 for img in page.images)
    decisions = page.tables["plan0-decisions"]
    assert all(d["unit"] in decisions for d in piped.decisions)
    for i, d in enumerate(piped.decisions):                     # every alternative of every unit, with a verdict
        options = page.tables[f"plan0-options-{i}"]
        assert len(re.findall(r"\bchosen\b", options)) >= 1 and options.count(d["strategy"]) >= 1
    assert all(p in page.tables["plan0-styles"] for p in piped.styles)
    assert "comparison" not in page.ids


def test_comparison_page_and_cli(plans, tmp_path, capsys):
    piped, flat = plans
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    piped.to_json(a)
    flat.to_json(b)
    out = tmp_path / "r.html"
    assert main(["report", str(a), str(b), "-o", str(out), "--names", "piped,flat"]) == 0
    page = _Page()
    page.feed(out.read_text())
    assert {"comparison", "comparison-table", "comparison-memory", "comparison-timeline", "plan0", "plan1"} <= page.ids
    assert "piped" in page.tables["comparison-table"] and "flat" in page.tables["comparison-table"]
    assert main(["report", str(a), str(b), "-o", str(out), "--names", "only-one"]) == 2
    assert "2 plan files" in capsys.readouterr().err
