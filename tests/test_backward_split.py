"""A backward split for zero-bubble schedules (tpflow.pipeline.backward): the input's gradient (B), then the weights'
(W), equal to one whole backward, with every product computed once over the two (none twice), through torch's
layers and through tpflow's kernels."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tpflow.kernels import linear
from tpflow.pipeline.backward import input_grad

PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class _Products(TorchDispatchMode):
    """Counts the matrix products run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in PRODUCTS
        return func(*args, **(kwargs or {}))


class _Kernels(nn.Module):
    """tpflow's linear (its own autograd function, forced by a dgrad hook), counting the hook's calls."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.inner, self.hooked = nn.Linear(a, b), 0

    def forward(self, x):
        def hook(dx):
            self.hooked += 1
        return linear(x, self.inner.weight, self.inner.bias, "silu", dgrad_hook=hook)


def _models():
    torch.manual_seed(0)
    shared = nn.Linear(6, 6)
    return {
        "torch layers": nn.Sequential(nn.Linear(5, 6), nn.GELU(), nn.LayerNorm(6), nn.Linear(6, 6), nn.Tanh(),
                                      nn.Linear(6, 3)),
        "tpflow kernels": nn.Sequential(_Kernels(5, 6), nn.LayerNorm(6), _Kernels(6, 3)),
        "a layer used twice": nn.Sequential(nn.Linear(5, 6), shared, nn.Tanh(), shared, nn.Linear(6, 3)),
    }


def _backward(model, x, dy, split):
    counter = _Products()
    with counter:
        if split:
            later = input_grad(model(x), dy, x, list(model.parameters()))
            products_b = counter.count
            assert x.grad is not None and all(p.grad is None for p in model.parameters()), "B left weight gradients"
            later.run()
            return counter.count, products_b
        model(x).backward(dy)
    return counter.count, 0


def test_split_backward_equals_the_whole_one_and_computes_each_product_once():
    for name, model in _models().items():
        ref = copy.deepcopy(model)
        x = torch.randn(4, 5, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        dy = torch.randn(4, 3)
        whole, _ = _backward(ref, x_ref, dy, split=False)
        total, input_side = _backward(model, x, dy, split=True)
        torch.testing.assert_close(x.grad, x_ref.grad, msg=name)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=f"{name}: {n}")
        if name != "a layer used twice":  # the shared layer recomputes its input side between its two uses
            assert total == whole, f"{name}: {total} products split, {whole} whole"
        assert 0 < input_side < total, name
        if name == "tpflow kernels":  # the input gradient's hook (a column layer's all-reduce) runs once, in B
            assert [m.hooked for m in model if isinstance(m, _Kernels)] == [1, 1] == \
                [m.hooked for m in ref if isinstance(m, _Kernels)]


def test_an_input_without_gradient_runs_the_whole_backward_as_b():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    later = input_grad(model(torch.randn(5, 3)).sum(), None, None, list(model.parameters()))
    assert all(p.grad is not None for p in model.parameters())
    later.run()  # nothing left
