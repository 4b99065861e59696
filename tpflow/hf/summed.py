"""The plan style for a module that computes with its own parameters split over the ranks and sums its output:
Hugging Face's ``"all_reduce"`` (Inkling's shared experts: ``gate_proj`` / ``up_proj`` of ``[experts, intermediate,
hidden]`` split by the intermediate features, ``"colwise"``, and ``down_proj`` of ``[experts, hidden, intermediate]``
too, ``"rowwise"``), as a column and a row layer in one module.

Each rank computes the module's unchanged forward on its parameters' blocks (read as local tensors around the call):
its output is this rank's share of the sum, which the entry sums over the ranks; every input it reads whole (the
hidden states, Inkling's gate weights) gets its gradient summed over the ranks in the backward, each rank's share.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.tensor import Partial

from tpflow import comm
from tpflow.global_tensor.local_blocks import LocalReads
from tpflow.hf.heads import split_parameter
from tpflow.layers.regions import WHOLE, tag
from tpflow.placement import Placement
from tpflow.plans.style import Plan, Style

__all__ = ["SummedParameters"]


@dataclasses.dataclass(frozen=True)
class SummedParameters(Style):
    """Plan style for a module whose own parameters split over the ranks along the dims named, its output summed
    over the ranks (HF's ``"all_reduce"`` with its parameters' ``"colwise"`` / ``"rowwise"`` entries:
    ``hf_plan`` writes it).

    Args:
        dims: ``(parameter name, dim)`` pairs: each parameter split along its dim (a ``"colwise"`` parameter's
            is -2, its output features; a ``"rowwise"`` one's -1, its input features).

    Example::

        >>> class Mlp(nn.Module):                     # up [hidden -> 8], down [8 -> hidden], as parameters
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.up, self.down = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4, 8))
        ...     def forward(self, x):
        ...         return torch.relu(x @ self.up.T) @ self.down.T
        >>> _ = torch.manual_seed(0)
        >>> model, x = nn.Sequential(Mlp()), torch.randn(3, 4)
        >>> want = model(x)
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]),
        ...                         plan={"0": SummedParameters((("up", -2), ("down", -1)))})
        >>> model[0].up.to_local().shape              # this rank's 4 of the 8 intermediate features
        torch.Size([4, 4])
        >>> torch.testing.assert_close(model(x), want)
    """

    dims: tuple[tuple[str, int], ...]

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        others = [n for n, _ in module.named_parameters() if n not in dict(self.dims)]
        if others:  # (whole on every rank, each would add its value once per rank into the sum)
            raise ValueError(f"{name!r}: SummedParameters sums its output over the ranks, and its parameters {others} "
                             f"are not split by it: name them in dims, or plan the module otherwise")
        for param, dim in self.dims:
            p = module._parameters.get(param)
            if p is None or p.ndim < 2 or dim not in range(-p.ndim, p.ndim):
                raise ValueError(f"{name!r}: SummedParameters splits its parameter {param!r} along dim {dim}, which "
                                 f"it does not have")
            if p.shape[dim] % plan.world:
                raise ValueError(f"{name!r}.{param}: its {p.shape[dim]} features along dim {dim} do not split over "
                                 f"{plan.world} tensor-parallel ranks: use a degree that divides them")

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        for param, dim in self.dims:
            split_parameter(module, param, dim % module._parameters[param].ndim, plan.placement)
        if plan.placement.coordinate() is not None:
            _Summed(module, dict(self.dims), plan.placement)


class _Summed:
    """The hooks: the blocks in place of the parameters around each call, every whole input's gradient summed over
    the ranks, the output summed."""

    def __init__(self, module: nn.Module, dims: dict[str, int], placement: Placement) -> None:
        data_axes = placement.ndim - 1  # a plain input differs over the data-parallel axes: partial sums there
        self.group = placement.mesh.get_group(data_axes) if placement.hierarchy[-1] > 1 else None
        self.reads = LocalReads(list(dims), lambda p: (Partial(),) * data_axes + (p.placements[-1],))
        module.register_forward_pre_hook(self.before, with_kwargs=True)
        module.register_forward_hook(self.after, always_call=True)

    def _summed(self, x: object) -> object:
        return comm.copy_to_ranks(x, self.group) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.reads.enter(module)
        return tuple(map(self._summed, args)), {k: self._summed(v) for k, v in kwargs.items()}

    def after(self, module: nn.Module, args: tuple, output: object) -> object:
        self.reads.leave(module)
        if not isinstance(output, torch.Tensor):
            return output
        return tag(comm.reduce_from_ranks(output, self.group), WHOLE)
