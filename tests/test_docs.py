"""The docs cannot rot: every ```python snippet of README.md and docs/ runs here.

A page's snippets run in order, in one namespace, on every rank of a gloo world (2 ranks, or what the
page asks for with ``<!-- test: ranks=N -->``), so a renamed function or a changed result breaks a test,
not a reader. A failing snippet's traceback names the Markdown file and line. The README's quickstart
also runs as the README says: under the launcher with 2 ranks, and as one plain process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import harness
from tests.harness import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def snippets(path: Path, language: str = "python") -> list[tuple[int, str]]:
    """(line of the first code line, code) of every ``language`` block of a Markdown page."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start(2)) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == language]


def ranks(path: Path) -> int:
    found = re.search(r"<!-- test: ranks=(\d+) -->", path.read_text())
    return int(found.group(1)) if found else 2


def _run_page(path: str) -> None:
    """Every snippet of the page in one namespace, each compiled with the page's own line numbers."""
    import tpflow as tpf

    namespace = {"__name__": "__main__"}
    try:
        for line, code in snippets(Path(path)):
            exec(compile("\n" * (line - 1) + code, path, "exec"), namespace)
    finally:
        tpf.config.reset()  # a page may set switches; the pool's next test must not see them


def test_every_docs_page_has_snippets():
    assert (ROOT / "docs").is_dir()
    for page in PAGES:
        assert snippets(page), f"{page.name} has no python snippet to run"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_snippets_run(page):
    harness.run(ranks(page), _run_page, str(page), timeout=600)


def test_config_page_lists_every_switch():
    from tpflow.config import SWITCHES

    text = (ROOT / "docs" / "config.md").read_text()
    for switch in SWITCHES.values():
        assert f"| `{switch.name}` | `{switch.env}` |" in text, f"docs/config.md does not list {switch.name}"


def test_readme_quickstart_runs_as_the_readme_says(tmp_path):
    """example.py is the README's first two snippets (the second says to add it); its commands, the bash lines
    naming it, run exactly as written in the environment the README activates (its python first on PATH)."""
    readme = (ROOT / "README.md").read_text()
    assert "source .venv/bin/activate" in readme
    code = [block for _, block in snippets(ROOT / "README.md")[:2]]
    assert readme.index(code[0]) < readme.index("Add this to `example.py`") < readme.index(code[1])
    (tmp_path / "example.py").write_text("\n".join(code))
    commands = [c for _, block in snippets(ROOT / "README.md", "bash") for c in block.splitlines()
                if "example.py" in c]
    assert [c.split("#")[0].split() for c in commands] == [
        ["python", "-m", "tpflow.launch", "--nproc_per_node", "2", "example.py"], ["python", "example.py"]], commands
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT", "TPFLOW_LAUNCH_ERRORS")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # what the activation does
    for command in commands:
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{command}:\n{done.stderr[-3000:]}"
        assert "ColumnParallelLinear" in done.stdout, f"{command} printed:\n{done.stdout[-2000:]}"
