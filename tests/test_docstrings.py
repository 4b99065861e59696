"""Every public class and function of tpflow (the names in each module's ``__all__``) has a docstring in
torch's style: what it is for, ``Args:`` when it takes arguments, ``Returns:`` when it returns something,
and an ``Example::``."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil

import pytest

import tpflow

# need triton: checked if present
SKIP = {"tpflow.kernels.tiles", "tpflow.kernels.tuning", "tpflow.kernels.launcher", "tpflow.kernels.loss_tiles",
        "tpflow.kernels.grouped_tiles", "tpflow.kernels.attention_tiles",
          "tpflow.kernels.attention_grad_tiles"}


def _modules():
    for info in pkgutil.walk_packages(tpflow.__path__, "tpflow."):
        if info.name.endswith("__main__"):
            continue
        if info.name in SKIP and importlib.util.find_spec("triton") is None:
            continue
        yield importlib.import_module(info.name)


def _public():
    for module in _modules():
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == module.__name__:
                yield f"{module.__name__}.{name}", obj


def _params(fn) -> list[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p for p in sig.parameters if p not in ("self", "cls")]


def _problems(obj) -> list[str]:
    doc = inspect.getdoc(obj) or ""
    problems = [] if doc else ["no docstring"]
    if doc and "Example" not in doc:
        problems.append("no Example")
    takes = _params(obj.__init__ if inspect.isclass(obj) else obj)
    if inspect.isclass(obj) and obj.__init__ is object.__init__:
        takes = []
    if takes and "Args:" not in doc and not (inspect.isclass(obj) and "Args:" in (inspect.getdoc(obj.__init__) or "")):
        problems.append(f"no Args: for {takes}")
    if inspect.isfunction(obj):
        returns = inspect.signature(obj).return_annotation
        if returns not in (None, "None", inspect.Signature.empty) and "Returns:" not in doc:
            problems.append("no Returns:")
    return problems


PUBLIC = dict(_public())


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_docstring(name):
    problems = _problems(PUBLIC[name])
    assert not problems, f"{name}: {', '.join(problems)}"
