"""``autoplan report``: one self-contained HTML page of a plan, or a comparison of several.

The CLI writes one page for a pipelined Llama-3-70B plan (plan_cluster on 512 H100s, pp 4) and one
comparing three plans of that model (that one, autoplan's dp x tp pick at tp 8, torchtitan's
hand-written plan). Without a browser: the page is one file (no script, no link or source
outside it), holds every part (summary, memory, stages, timeline, every unit's alternatives,
styles, collectives, alternatives, notes) and every unit, and the CLI checks its arguments.
In a real headless browser (Debian's chromium, run as the machine facts say a headless chromium
runs here: ``--headless --no-sandbox --disable-gpu`` without background networking, a fresh
profile): the page loads without a console error, every figure has a non-zero size, the decision
tables hold every unit, and it renders to a screenshot. The probe (measurements written into the
DOM) is a copy of the page with a script added; the page itself has none. Chromium comes from
scripts/setup.sh; where it is missing the browser tests are skipped, saying so.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from autoplan import MeshSpec, autoplan
from autoplan.cli import main
from autoplan.cluster import plan_cluster
from autoplan.presets import build_preset
from autoplan.importers import import_torchtitan

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH: scripts/setup.sh installs Debian's chromium package where it can "
                             "(root and apt-get); install it to run the browser tests of `autoplan report`")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--disable-extensions", "--mute-audio"]
PROBE = """<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message || e.type)), true);
const __err = console.error; console.error = (...a) => { window.__errors.push(a.join(' ')); __err(...a); };
window.addEventListener('load', () => {
  const figs = [...document.querySelectorAll('img.figure')].map(i => {
    const r = i.getBoundingClientRect();
    return {id: i.id, natural: [i.naturalWidth, i.naturalHeight], shown: [r.width, r.height], done: i.complete};
  });
  const tables = {};
  document.querySelectorAll('table[id]').forEach(t => { tables[t.id] = t.innerText; });
  const out = document.createElement('pre'); out.id = 'probe-result';
  out.textContent = JSON.stringify({errors: window.__errors, figures: figs, tables: tables});
  document.body.appendChild(out);
});
</script>"""


def _chromium(*args: str, user_dir: Path, timeout: int = 90) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={user_dir}", *args], capture_output=True, text=True,
                          timeout=timeout)


def _console_errors(stderr: str) -> list[str]:
    """Lines chromium logs for the page's console errors and uncaught exceptions (with --enable-logging)."""
    return [ln for ln in stderr.splitlines() if "CONSOLE" in ln and ("error" in ln.lower() or "Uncaught" in ln)]


def _open_in_browser(page: Path, tmp_path: Path, units: dict[str, list[str]]) -> dict:
    html = page.read_text()
    probe = page.with_name(page.stem + "_probe.html")
    probe.write_text(html.replace("<head>", "<head>" + PROBE, 1))
    run = _chromium("--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", "--dump-dom",
                    probe.as_uri(), user_dir=tmp_path / "profile-dom")
    assert run.returncode == 0, run.stderr[-2000:]
    assert not _console_errors(run.stderr), _console_errors(run.stderr)
    found = re.search(r'<pre id="probe-result">(.*?)</pre>', run.stdout, re.S)
    assert found, run.stdout[-2000:]
    result = json.loads(found.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"))
    assert result["errors"] == []
    assert result["figures"], "no figure on the page"
    for fig in result["figures"]:
        assert fig["done"] and min(fig["natural"]) > 100 and min(fig["shown"]) > 100, fig
    for pid, names in units.items():
        table = result["tables"][f"{pid}-decisions"]
        assert all(u in table for u in names), (pid, names, table[:500])
    shot = tmp_path / (page.stem + ".png")
    run = _chromium("--window-size=1280,1600", f"--screenshot={shot}", page.as_uri(),
                    user_dir=tmp_path / "profile-shot")
    assert run.returncode == 0 and shot.stat().st_size > 20_000, run.stderr[-2000:]
    return result


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
def plan_files(tmp_path_factory):
    """Three plans of Llama-3-70B on 512 H100s as files: pipelined (pp 4, plan_cluster), autoplan's
    dp x tp pick at tp 8, and torchtitan's hand-written plan at tp 8, priced by the same model."""
    out = tmp_path_factory.mktemp("plans")
    model = build_preset("titan-llama3-70b")   # Llama-3-70B's shape with torchtitan's module names
    batch = (512, 8192)
    piped = plan_cluster(model, 512, hardware="h100_sxm", batch=batch, constraints={"pp": 4})
    mesh = MeshSpec((64, 8), ("dp", "tp"), "h100_sxm")
    plans = {"pp4": piped, "tp8": autoplan(model, mesh, batch=batch),
             "torchtitan": import_torchtitan(model, mesh, batch=batch)}
    assert int(piped.pipeline["pp"]) == 4
    paths = {}
    for name, plan in plans.items():
        paths[name] = out / f"{name}.json"
        plan.to_json(paths[name])
    return paths, plans


@pytest.fixture(scope="module")
def pages(plan_files, tmp_path_factory):
    """The two pages, written by the CLI as a user runs it."""
    paths, _ = plan_files
    out = tmp_path_factory.mktemp("pages")
    one, three = out / "plan.html", out / "three.html"
    assert main(["report", str(paths["pp4"]), "-o", str(one)]) == 0
    assert main(["report", *map(str, paths.values()), "-o", str(three)]) == 0
    return one, three


def _parse(page: Path) -> "_Page":
    parsed = _Page()
    parsed.feed(page.read_text())
    assert parsed.scripts == 0 and parsed.external == [], (parsed.scripts, parsed.external)   # offline, no server
    return parsed


def test_pipelined_plan_page_holds_every_part(plan_files, pages):
    piped = plan_files[1]["pp4"]
    page = _parse(pages[0])
    for part in ("summary", "memory", "memory-figure", "pipeline", "stages", "timeline", "decisions", "styles",
                 "comm", "collectives", "rank-collectives", "alternatives"):
        assert f"plan0-{part}" in page.ids, part
    assert all(img["src"].startswith("data:image/png;base64,") and int(img["width"]) > 100 for img in page.images)
    decisions = page.tables["plan0-decisions"]
    assert all(d["unit"] in decisions for d in piped.decisions)
    for i, d in enumerate(piped.decisions):                     # every alternative of every unit, with a verdict
        options = page.tables[f"plan0-options-{i}"]
        assert re.search(r"\bchosen\b", options) and d["strategy"] in options
        assert len(re.findall(r"\bchosen\b|slower|excluded|same|ties|needs|cheaper", options)) >= len(d["options"])
    assert all(p in page.tables["plan0-styles"] for p in piped.styles)
    assert "comparison" not in page.ids


def test_comparison_page_and_the_cli_checks(plan_files, pages, tmp_path, capsys):
    paths, _ = plan_files
    page = _parse(pages[1])
    assert {"comparison", "comparison-table", "comparison-memory", "comparison-timeline", "plan0", "plan1",
            "plan2"} <= page.ids
    assert all(name in page.tables["comparison-table"] for name in paths)
    capsys.readouterr()
    args = ["report", str(paths["pp4"]), str(paths["tp8"]), "-o", str(tmp_path / "r.html")]
    assert main([*args, "--names", "only-one"]) == 2
    assert "1 names for 2 plan files" in capsys.readouterr().err
    assert main([*args[:-2]]) == 2                              # -o is required
    assert "-o/--output" in capsys.readouterr().err


@needs_browser
def test_report_of_a_pipelined_70b_plan_in_chromium(plan_files, pages, tmp_path):
    paths, plans = plan_files
    page = pages[0]
    result = _open_in_browser(page, tmp_path, {"plan0": [d["unit"] for d in plans["pp4"].decisions]})
    ids = {f["id"] for f in result["figures"]}
    assert {"plan0-timeline", "plan0-memory-figure", "plan0-comm-figure"} <= ids
    stages = result["tables"]["plan0-stages"]
    assert len(stages.strip().splitlines()) == 1 + len(plans["pp4"].pipeline["per_stage"])   # header + a row each
    assert "plan0-rank-collectives" in result["tables"]   # every pipeline rank's predicted traffic


@needs_browser
def test_report_comparing_three_plans_in_chromium(plan_files, pages, tmp_path):
    paths, plans = plan_files
    page = pages[1]
    units = {f"plan{i}": [d["unit"] for d in p.decisions] for i, p in enumerate(plans.values())}
    result = _open_in_browser(page, tmp_path, units)
    assert {"comparison-memory", "comparison-timeline"} <= {f["id"] for f in result["figures"]}
    table = result["tables"]["comparison-table"]
    assert all(name in table for name in paths) and "step_s" in table
