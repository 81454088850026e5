"""``autoplan report`` pages, opened in a real headless browser (Debian's chromium).

The CLI writes one HTML file for a pipelined Llama-3-70B plan (plan_cluster on 512 H100s, pp 4)
and one comparing three plans of that model. Each page must be self-contained (no script, no
link or source outside the file), load in chromium without a console error, show every figure
at a non-zero size, hold every unit of every plan in its decision table, and render to a
screenshot. The browser runs as the machine facts say a headless chromium runs here:
``--headless --no-sandbox --disable-gpu`` without background networking, a fresh profile.
The probe (measurements in the DOM) is a copy of the page with a script added; the page itself
has none. Chromium comes from scripts/setup.sh (Debian's package); where it is missing the
tests are skipped, saying so.
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
from autoplan.review import import_torchtitan

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
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


class _Refs(HTMLParser):
    """Every script tag and every src/href that leaves the file."""

    def __init__(self):
        super().__init__()
        self.scripts, self.external = 0, []

    def handle_starttag(self, tag, attrs):
        self.scripts += tag == "script"
        for key, value in attrs:
            if key in ("src", "href") and value and not value.startswith(("#", "data:")):
                self.external.append(f"{tag} {key}={value[:60]}")


def _open_in_browser(page: Path, tmp_path: Path, units: dict[str, list[str]]) -> dict:
    html = page.read_text()
    refs = _Refs()
    refs.feed(html)
    assert refs.scripts == 0 and refs.external == [], (refs.scripts, refs.external)   # offline, no server
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
    run = _chromium("--window-size=1280,1600", f"--screenshot={shot}", page.as_uri(), user_dir=tmp_path / "profile-shot")
    assert run.returncode == 0 and shot.stat().st_size > 20_000, run.stderr[-2000:]
    return result


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


def test_report_of_a_pipelined_70b_plan_in_chromium(plan_files, tmp_path, capsys):
    paths, plans = plan_files
    page = tmp_path / "plan.html"
    assert main(["report", str(paths["pp4"]), "-o", str(page)]) == 0
    assert "wrote" in capsys.readouterr().out
    result = _open_in_browser(page, tmp_path, {"plan0": [d["unit"] for d in plans["pp4"].decisions]})
    ids = {f["id"] for f in result["figures"]}
    assert {"plan0-timeline", "plan0-memory-figure", "plan0-comm-figure"} <= ids
    stages = result["tables"]["plan0-stages"]
    assert len(stages.strip().splitlines()) == 1 + len(plans["pp4"].pipeline["per_stage"])   # header + a row each
    assert "plan0-rank-collectives" in result["tables"]   # every pipeline rank's predicted traffic


def test_report_comparing_three_plans_in_chromium(plan_files, tmp_path):
    paths, plans = plan_files
    page = tmp_path / "three.html"
    assert main(["report", *map(str, paths.values()), "-o", str(page)]) == 0
    units = {f"plan{i}": [d["unit"] for d in p.decisions] for i, p in enumerate(plans.values())}
    result = _open_in_browser(page, tmp_path, units)
    assert {"comparison-memory", "comparison-timeline"} <= {f["id"] for f in result["figures"]}
    table = result["tables"]["comparison-table"]
    assert all(name in table for name in paths) and "step_s" in table
