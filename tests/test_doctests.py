"""Every docstring example in tpflow runs: the ``>>>`` lines of each module's docstrings, on every rank of a gloo
world, compared with what they show.

- A docstring's examples run in order in one namespace: the module's globals, with ``tpf`` and ``torch``.
- The world has 2 ranks, or what the docstring asks for with ``Example (N ranks)::``.
- Shown output must hold on every rank; an example whose source says ``# on rank R`` is compared on rank R only
  (the other ranks run it, and may print something else).
- ``# doctest: +SKIP`` is kept for what cannot run here: CUDA, a second machine, a model hub.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import os
import pkgutil
import re

import pytest

import tpflow
from tests import harness

WORLD = re.compile(r"Example \((\d+) ranks?\)::")
ON_RANK = re.compile(r"#.*\bon rank (\d+)")
ANY = "<output on another rank>\n"
TRITON = {"tpflow.kernels.tiles", "tpflow.kernels.tuning", "tpflow.kernels.launcher", "tpflow.kernels.loss_tiles",
          "tpflow.kernels.grouped_tiles", "tpflow.kernels.attention_tiles",
          "tpflow.kernels.attention_grad_tiles"}
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest without a GPU


def _module_names() -> list[str]:
    names = [info.name for info in pkgutil.walk_packages(tpflow.__path__, "tpflow.")
             if not info.name.endswith("__main__")]
    if importlib.util.find_spec("triton") is None:
        names = [n for n in names if n not in TRITON]
    if not INTERPRETED:  # the kernels' examples show Triton's interpreter on CPU tensors (CI runs them)
        names = [n for n in names if not n.startswith("tpflow.kernels")]
    return ["tpflow", *names]


def _docstrings(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name, globs={})
    return [t for t in tests if t.examples and not all(e.options.get(doctest.SKIP) for e in t.examples)]


def world_size(test: doctest.DocTest) -> int:
    found = WORLD.search(test.docstring or "")
    return int(found.group(1)) if found else 2


class _RankChecker(doctest.OutputChecker):
    def check_output(self, want: str, got: str, optionflags: int) -> bool:
        return want == ANY or super().check_output(want, got, optionflags)


def _run_module(name: str, world: int) -> str:
    """Every docstring of module ``name`` that runs on ``world`` ranks; the failures' report ('' if none)."""
    import torch
    import torch.distributed as dist

    import tpflow as tpf

    module, rank = importlib.import_module(name), dist.get_rank()
    runner = doctest.DocTestRunner(checker=_RankChecker(), optionflags=doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for test in _docstrings(name):
        if world_size(test) != world:
            continue
        for example in test.examples:
            on = ON_RANK.search(example.source)
            if on is not None and int(on.group(1)) != rank:
                example.want = ANY
        test.globs = {**vars(module), "tpf": tpf, "torch": torch}
        try:
            runner.run(test, out=report.append, clear_globs=True)
        finally:
            tpf.config.reset()
    return "".join(report)


CASES = sorted({(name, world_size(t)) for name in _module_names() for t in _docstrings(name)})


@pytest.mark.parametrize(("name", "world"), CASES, ids=[f"{n}-w{w}" for n, w in CASES])
def test_docstring_examples_run(name, world):
    reports = harness.run(world, _run_module, name, world, timeout=300)
    failed = [f"--- rank {r} ---\n{text}" for r, text in enumerate(reports) if text]
    assert not failed, "\n".join(failed)


def test_every_skip_says_why():
    """What is skipped needs what this machine lacks; every skip says so on its line."""
    skipped = [(name, e.source.strip()) for name in _module_names() for t in doctest.DocTestFinder().find(
        importlib.import_module(name), name, globs={}) for e in t.examples if e.options.get(doctest.SKIP)]
    unexplained = [(n, s) for n, s in skipped if not re.search(r"cuda|GPU|hub|launch|node", s, re.I)]
    assert not unexplained, unexplained
