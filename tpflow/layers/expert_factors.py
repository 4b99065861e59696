"""The LoRA factors of a split experts parameter, laid out as the parameter (``split_experts``): PEFT's
``target_parameters`` on a mixture's fused ``gate_up_proj`` / ``down_proj``, whose delta per expert is ``b @ a``.

The parameter's split says the factors': split by whole experts (``Shard(0)``), each rank holds its experts' rows of
``a`` (``[r E, in]``, by expert) and columns of ``b`` (``[out, r E]``, rank-major: DTensor's
``_StridedShard(1, split_factor=r)``); split by the intermediate dim, the factor holding that dim is split as the
parameter is (its gate and up halves too), the other whole. Shared out over a data axis, the experts and their
factors carry a mark (``mark_over_data``) by which ``tpf.fsdp_ignored_params`` tells FSDP2 to leave them alone.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tpflow.global_tensor import gradients

__all__ = ["block", "factors_like", "mark_over_data", "over_data"]

_OVER_DATA = "_tpflow_over_data"  # a parameter's mark: shared out over a data axis, which FSDP2 leaves alone


def block(full: torch.Tensor, dim: int, parts: int, rank: int, ranks: int) -> torch.Tensor:
    """This rank's block of ``full`` along ``dim``: its chunk of each of ``parts`` parts (2: the gate and up halves;
    DTensor's ``_StridedShard(dim, split_factor=parts)``).

    Args:
        full: the whole tensor (on the meta device: an empty block of the block's shape).
        dim: the dim split.
        parts: 1 for a plain split (``Shard``), else the parts each split over the ranks.
        rank, ranks: this rank's coordinate on the axis, and the axis' size.

    Returns:
        The block, a tensor of its own.

    Example::

        >>> block(torch.arange(8), 0, 2, rank=1, ranks=2)          # the second chunk of each half
        tensor([2, 3, 6, 7])
    """
    if full.is_meta:
        shape = list(full.shape)
        shape[dim] //= ranks
        return torch.empty(shape, dtype=full.dtype)
    return torch.cat([h.chunk(ranks, dim)[rank] for h in full.detach().chunk(parts, dim)], dim)


def _split_of(q: object) -> tuple[int, int] | None:
    """A placement's split: (its dim, its parts: ``_StridedShard``'s split factor, 1 for ``Shard``), or None."""
    if isinstance(q, _StridedShard):  # before Shard: a subclass of it in some torch versions
        return q.dim, q.split_factor
    return (q.dim, 1) if isinstance(q, Shard) else None


def factors_like(module: nn.Module, name: str, a: torch.Tensor, b: torch.Tensor, rank: int,
                 swapped: bool) -> tuple[nn.Parameter, nn.Parameter]:
    """A LoRA adapter's factors of the split experts' parameter ``name`` (PEFT's layout: ``a`` ``[rank E, in]``, rows
    by expert, ``b`` ``[out, rank E]``, columns by rank then expert), as global parameters split as the parameter is:
    by whole experts, ``a``'s rows and ``b``'s columns of this rank's experts; by the intermediate dim, the factor that
    holds it (``b``'s rows where it is the output, ``a``'s columns where it is the input) in the parameter's own
    chunks (gate and up halves too), the other whole. The delta ``b @ a`` of the local blocks, per expert, is then
    this rank's block of the parameter's.

    Args:
        module: an experts module ``split_experts`` split (by the tensor-parallel axis).
        name: the parameter the factors adapt, ``[E, d1, d2]``.
        a, b: the factors, whole, the same on every rank.
        rank: the LoRA rank.
        swapped: whether ``d1`` is the output (PEFT's ``_did_swap_in_out_features``), else the input.

    Returns:
        The two as DTensor parameters, their partial gradients summed before an optimizer step.

    Example::

        >>> from transformers import Qwen3MoeConfig
        >>> from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
        >>> from tpflow.layers.experts import split_experts
        >>> experts = split_experts(Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=6,
        ...                                                        num_experts=4)), tpf.placement("cpu", ranks=[0, 1]))
        >>> a, b = factors_like(experts, "down_proj", torch.randn(8, 6), torch.randn(8, 8), rank=2, swapped=True)
        >>> a.to_local().shape, b.to_local().shape                         # down_proj's input, I, split: a's columns
        (torch.Size([8, 3]), torch.Size([8, 8]))
    """
    param = module._parameters[name]
    mesh, coord, sizes = param.device_mesh, param.device_mesh.get_coordinate(), param.device_mesh.shape
    factors = []
    for factor in (a, b):
        placements, local = [], factor.detach()
        for axis, q in enumerate(param.placements):
            split = _split_of(q)
            if split is not None and split[0] == 0:  # whole experts: a's rows, b's columns (rank-major)
                split = (0, 1) if factor is a else (1, rank)
            elif split is not None and (split[0] == 1) == swapped:  # the output dim: b's rows
                split = (0, split[1]) if factor is b else None
            elif split is not None:  # the input dim: a's columns
                split = (1, split[1]) if factor is a else None
            if split is None:
                placements.append(Replicate())
                continue
            placements.append(_StridedShard(split[0], split_factor=split[1]) if split[1] > 1 else Shard(split[0]))
            if coord is not None:
                local = block(local, *split, coord[axis], sizes[axis])
        value = DTensor.from_local(local.to(param.device), mesh, tuple(placements), run_check=False,
                                   shape=factor.shape, stride=factor.stride())
        factors.append(gradients.adopt(nn.Parameter(value, requires_grad=factor.requires_grad)))
    return factors[0], factors[1]


def mark_over_data(param: torch.Tensor, over: bool = True) -> torch.Tensor:
    """Mark ``param`` as shared out over a data axis with the experts (their parameters, their LoRA factors):
    ``tpf.fsdp_ignored_params`` then hands it to FSDP2 as one to leave alone.

    Args:
        param: a parameter.
        over: whether it is shared out over a data axis.

    Returns:
        ``param`` itself.

    Example::

        >>> over_data(mark_over_data(torch.nn.Parameter(torch.zeros(2))))
        True
    """
    setattr(param, _OVER_DATA, over)
    return param


def over_data(param: torch.Tensor) -> bool:
    """Whether ``split_experts`` shared ``param`` out over a data axis (``axis=``): FSDP2 must leave it alone, as
    ``tpf.fsdp_ignored_params`` tells it.

    Args:
        param: a parameter.

    Returns:
        True for the experts' parameters split over a data axis.

    Example::

        >>> over_data(torch.nn.Parameter(torch.zeros(2)))
        False
    """
    return getattr(param, _OVER_DATA, False)
