"""Linear layers split over the tensor-parallel ranks in place: their weight and bias become global tensors, read as
local blocks around their unchanged forward, so that their checkpoint names and layout stay the model's. For layers a
replacing ``ColumnParallelLinear`` / ``RowParallelLinear`` cannot stand for: GPT-2's ``Conv1D`` (stored transposed,
``weight [in, out]``, ``y = x @ W + b``), and fused layers whose blocks each split over the ranks.

    column           weight and bias split by output features: this rank's; the input's gradient summed over the ranks
    column, parts=P  P blocks fused in one layer (GPT-2's ``c_attn`` q | k | v: 3; MPT's ``Wqkv``: 3; CodeGen's
                     ``qkv_proj``: 4 model-parallel blocks of q | v | k, 12): each rank its chunk of each block
                     (DTensor's ``_StridedShard(dim, split_factor=P)``), so that the module's own split of its output
                     gives this rank's heads' q, k and v
    row              weight split by input features: this rank's; the output summed over the ranks, the bias (whole)
                     added once
    row, parts=P     the input features' P blocks each split over the ranks (CodeGen's ``out_proj``, reading its
                     heads in the order its four blocks left them: 4)
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tpflow import comm
from tpflow.global_tensor import gradients
from tpflow.global_tensor.local_blocks import LocalReads
from tpflow.layers.expert_factors import block
from tpflow.layers.regions import SPLIT, WHOLE, reads_split, tag
from tpflow.placement import Placement
from tpflow.plans.linear import plain_linear
from tpflow.plans.style import Plan, Style

__all__ = ["BlocksParallel", "Conv1DParallel"]


@dataclasses.dataclass(frozen=True)
class _InPlace(Style):
    """A linear layer split in place: ``kind`` and ``parts`` as the module docstring says; ``_takes`` the layers
    it splits, ``_out_dim`` its weight's output-features dim."""

    kind: str = "column"
    parts: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("column", "row") or self.parts < 1:
            raise ValueError(f"{type(self).__name__}(kind={self.kind!r}, parts={self.parts}): kind is 'column' or "
                             f"'row', parts the blocks it fuses (1 or more)")

    @abstractmethod
    def _takes(self, module: nn.Module) -> bool: ...

    @abstractmethod
    def _out_dim(self) -> int: ...

    def layout(self, module: nn.Module) -> dict[str, int | None]:
        out = self._out_dim()
        return {"weight": out, "bias": 0} if self.kind == "column" else {"weight": 1 - out, "bias": None}

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        weight = getattr(module, "weight", None)
        if not self._takes(module) or not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            raise ValueError(f"{name!r} is a {type(module).__name__}; {type(self).__name__} takes "
                             f"{self._what}")
        features = weight.shape[self.layout(module)["weight"]]
        if features % self.parts or (features // self.parts) % plan.world:
            raise ValueError(f"{name!r}: its {features} {'output' if self.kind == 'column' else 'input'} features do "
                             f"not split into {self.parts} blocks of a multiple of {plan.world} ranks")

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        pl = plan.placement
        coord = pl.coordinate()
        for attr, dim in self.layout(module).items():
            full = module._parameters.get(attr)
            if full is None:
                continue
            split = None if dim is None else (_StridedShard(dim, split_factor=self.parts) if self.parts > 1
                                              else Shard(dim))
            placements = (Replicate(),) * (pl.ndim - 1) + (split or Replicate(),)
            if coord is None:
                local = torch.empty(0, dtype=full.dtype)
            elif split is None:
                local = full.detach().clone()
            else:
                local = block(full, dim, self.parts, coord[-1], pl.hierarchy[-1])
            value = DTensor.from_local(local.to(pl.device), pl.mesh, placements, run_check=False, shape=full.shape,
                                       stride=full.stride())
            setattr(module, attr, gradients.adopt(nn.Parameter(value, requires_grad=full.requires_grad)))
        if coord is not None:
            if self.kind == "column" and hasattr(module, "nf"):  # the width Conv1D shapes its output by: this rank's
                module.nf = module.weight.to_local().shape[1]
            _Split(module, self.kind, pl)


@dataclasses.dataclass(frozen=True)
class Conv1DParallel(_InPlace):
    """Plan style for a GPT-2 ``Conv1D``, split in place (see the module docstring).

    Args:
        kind: ``"column"`` (its output features split) or ``"row"`` (its input features split, the output summed).
        parts: the blocks its features fuse (3: q | k | v), each split over the ranks.

    Example::

        >>> from transformers.pytorch_utils import Conv1D
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> fc, proj = Conv1D(32, 8), Conv1D(8, 32)          # (out, in), as GPT-2 makes them
        >>> x = torch.randn(3, 8)
        >>> want = proj(torch.relu(fc(x)))
        >>> model = tpf.parallelize(nn.Sequential(fc, nn.ReLU(), proj), placement=P,
        ...                         plan={"0": Conv1DParallel("column"), "2": Conv1DParallel("row")})
        >>> torch.testing.assert_close(model(x), want)
    """

    _what = "GPT-2's Conv1D"

    def _takes(self, module: nn.Module) -> bool:
        return type(module).__name__ == "Conv1D"

    def _out_dim(self) -> int:
        return 1


@dataclasses.dataclass(frozen=True)
class BlocksParallel(_InPlace):
    """Plan style for an ``nn.Linear`` fusing blocks that each split over the ranks (MPT's ``Wqkv``, CodeGen's
    ``qkv_proj`` and ``out_proj``), split in place (see the module docstring): where ``ColumnParallel`` would give a
    rank one contiguous block, this gives it its chunk of every block.

    Args:
        kind: ``"column"`` (its output features split) or ``"row"`` (its input features split, the output summed).
        parts: the blocks its features fuse, each split over the ranks.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> qkv, out = nn.Linear(8, 24), nn.Linear(8, 8)     # q | k | v of 8 features each
        >>> class Attention(nn.Module):                      # q * k * v, this rank's features of each
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.qkv, self.out = qkv, out
        ...     def forward(self, x):
        ...         q, k, v = self.qkv(x).chunk(3, -1)
        ...         return self.out(q * k * v)
        >>> x = torch.randn(3, 8)
        >>> model = Attention()
        >>> want = model(x)
        >>> model = tpf.parallelize(model, placement=P, plan={"qkv": BlocksParallel("column", 3),
        ...                                                   "out": BlocksParallel("row")})
        >>> torch.testing.assert_close(model(x), want)
    """

    _what = "an nn.Linear"

    def _takes(self, module: nn.Module) -> bool:
        return plain_linear(module)

    def _out_dim(self) -> int:
        return 0


class _Split:
    """The hooks of one layer split in place: its blocks in place of its parameters around each call, the input's
    gradient summed (column) or the output summed and the bias added once (row)."""

    def __init__(self, module: nn.Module, kind: str, placement: Placement) -> None:
        self.kind = kind
        self.group = placement.mesh.get_group(placement.ndim - 1) if placement.hierarchy[-1] > 1 else None
        self.first = placement.coordinate()[-1] == 0
        names = [n for n, p in module.named_parameters(recurse=False) if p is not None]
        data_axes = placement.ndim - 1  # a plain input differs over the data-parallel axes: partial sums there
        self.reads = LocalReads(names, lambda p: (Partial(),) * data_axes + (p.placements[-1],))
        module.register_forward_pre_hook(self.before)
        module.register_forward_hook(self.after, always_call=True)

    def before(self, module: nn.Module, args: tuple) -> tuple:
        views = self.reads.enter(module)
        x = args[0]
        if self.kind == "column":
            return (comm.copy_to_ranks(x, self.group), *args[1:])
        reads_split(x)
        if "bias" in self.reads.names:  # whole: added by the first rank, its gradient summed (one device's)
            bias = views[self.reads.names.index("bias")]
            module.__dict__["bias"] = comm.copy_to_ranks(bias, self.group) * int(self.first)
        return None

    def after(self, module: nn.Module, args: tuple, output: object) -> object:
        self.reads.leave(module)
        if not isinstance(output, torch.Tensor):
            return output
        if self.kind == "column":
            return tag(output, SPLIT)
        return tag(comm.reduce_from_ranks(output, self.group), WHOLE)
