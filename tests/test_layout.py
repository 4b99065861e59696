"""The house's layout, read from the source: each folder uses only those below it (lazy imports inside functions
included), and the engine (``tpflow.plans``) knows no model family, framework or Hugging Face library."""

from __future__ import annotations

import ast
import pathlib

import pytest

import tpflow

_ROOT = pathlib.Path(tpflow.__file__).parent
# the folders from the bottom up: each may import those before it (a module of tpflow's top level is its own floor)
_FLOORS = ["config", "sbp", "world", "placement", "comm", "kernels", "ops", "global_tensor", "checkpoint", "layers",
           "plans", "hf", "frameworks", "pipeline", "launch_report", "launch", "__init__", "models", "bench"]
_FOREIGN = ("transformers", "peft", "trl", "accelerate", "lightning")


def _imports(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function, as absolute names."""
    package = ".".join(path.relative_to(_ROOT.parent).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _floor(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "tpflow" and len(parts) > 1 and parts[1] in _FLOORS else None


def test_the_engine_knows_no_model_family():
    """Nothing under ``tpflow/plans`` imports the wing, the trainers' support or a Hugging Face library."""
    for path in sorted((_ROOT / "plans").glob("*.py")):
        bad = sorted(m for m in _imports(path) if m.split(".")[0] in _FOREIGN or _floor(m) in ("hf", "frameworks"))
        assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("floor", _FLOORS[:-1])
def test_no_import_runs_back_up(floor):
    """A folder's modules import only folders at or below its own floor."""
    paths = sorted((_ROOT / floor).rglob("*.py")) if (_ROOT / floor).is_dir() else [_ROOT / f"{floor}.py"]
    for path in paths:
        above = sorted({f for m in _imports(path) if (f := _floor(m)) and _FLOORS.index(f) > _FLOORS.index(floor)})
        assert not above, f"{path.relative_to(_ROOT)} imports {above}, above {floor!r}"
