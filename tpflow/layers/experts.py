"""A mixture of experts split over the tensor-parallel ranks: every rank runs its slice of every expert on every routed
token, and one sum makes the output whole.

Hugging Face's MoE models keep their experts in one module of fused 3-D parameters: ``gate_up_proj`` (the gate and
up projections of every expert, ``[E, 2I, H]``, or ``[E, H, 2I]`` where the model stores them transposed) and
``down_proj`` (``[E, H, I]``, or ``[E, I, H]``), called as ``experts(hidden_states, top_k_index, top_k_weights)``
after the router. ``split_experts`` splits each expert's intermediate dim ``I`` over the ranks, as a column layer
followed by a row layer, and leaves the module's own forward (its grouped GEMM, or its loop) unchanged:

    gate_up_proj   rank r keeps rows r of the gate half and rows r of the up half (one product gives this rank's
                   gate and up, matching): DTensor's ``_StridedShard(dim, split_factor=2)``; interleaved gate / up
                   columns (``g0 u0 g1 u1 ...``) keep their pairs in one block: ``Shard``
    down_proj      rank r keeps the columns of its rows: ``Shard`` over ``I``

Around each call the module reads its parameters as local blocks; the tokens and routing weights it takes are whole
on every rank, and their gradients (this rank's slices' partial sums) are summed in the backward, so the router
upstream, replicated on every rank, gets one device's gradient (the bug peers had: routers trained apart). The
output, a partial sum, is all-reduced once.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tpflow import comm
from tpflow.global_tensor import gradients
from tpflow.layers.blocks import LocalReads
from tpflow.placement import Placement

__all__ = ["check_experts", "split_experts"]

_NAMES = ("gate_up_proj", "down_proj")
_BIASES = ("gate_up_proj_bias", "down_proj_bias")  # per expert: [E, 2I] split as gate_up_proj, [E, H] kept whole
_STATE = "_tpflow_experts"


def _layout(module: nn.Module) -> tuple[int, int, bool]:
    """(the dim of ``gate_up_proj`` holding the 2I gate and up features, the dim of ``down_proj`` holding I, whether
    gate and up are concatenated halves rather than interleaved), read off transformers' experts attributes."""
    concatenated = bool(getattr(module, "is_concatenated", True))
    return (2, 1, concatenated) if getattr(module, "is_transposed", False) else (1, 2, concatenated)


def check_experts(name: str, module: nn.Module, ranks: int, by: str = "intermediate") -> None:
    """Raise, naming the module and what to change, unless ``split_experts`` can split ``module`` over ``ranks``:
    3-D ``gate_up_proj`` and ``down_proj`` of one expert count and one intermediate size; by ``"intermediate"`` a
    size that ``ranks`` divides (and no parameters but those and their biases), by ``"experts"`` an expert count
    that ``ranks`` divides.

    Args:
        name: the module's name in the model, for the error.
        module: the experts module.
        ranks: the tensor-parallel ranks.
        by: how it is split (``split_experts``).

    Example::

        >>> from tpflow.layers.experts import check_experts
        >>> experts = torch.nn.Module()
        >>> experts.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 2 * 6, 8))
        >>> experts.down_proj = torch.nn.Parameter(torch.zeros(4, 8, 6))
        >>> check_experts("mlp.experts", experts, 4)   # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: mlp.experts: its intermediate size 6 does not split over 4 tensor-parallel ranks: use 1, 2, 3 ...
    """
    params = {n: getattr(module, n, None) for n in _NAMES}
    if any(not isinstance(p, nn.Parameter) or p.ndim != 3 or isinstance(p, DTensor) for p in params.values()):
        raise ValueError(f"{name} ({type(module).__name__}) is not a layout tpflow knows for experts: it needs 3-D "
                         f"gate_up_proj [E, 2I, H] and down_proj [E, H, I] parameters (transposed where the module's "
                         f"is_transposed says so), called as experts(hidden_states, top_k_index, top_k_weights); leave "
                         f"it out of the plan (it stays whole on every rank), or plan its parts as nn.Linear modules")
    features, inner, _ = _layout(module)
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    size, total = down.shape[inner], down.shape[0]
    if gate_up.shape[0] != total or gate_up.shape[features] != 2 * size:
        raise ValueError(f"{name}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} do not "
                         f"hold one expert count and one intermediate size (gate_up_proj's dim {features} is twice "
                         f"down_proj's dim {inner})")
    if by == "experts":
        implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
        loop = inspect.getsource(getattr(type(module).forward, "__wrapped__", type(module).forward))
        if implementation in (None, "eager") and "num_experts + 1" not in loop:
            raise ValueError(f"{name} ({type(module).__name__}) runs its own loop over the experts, which cannot skip "
                             "another rank's experts: load the model with experts_implementation='grouped_mm' (or "
                             "'batched_mm') for expert parallelism, or split its experts by the intermediate dim")
        others = [n for n, p in module.named_parameters(recurse=False) if p.shape[:1] != (total,)]
        if others:
            raise ValueError(f"{name} ({type(module).__name__}) has parameters {others} that are not per expert "
                             f"(a first dim of {total}): expert parallelism cannot split them")
        if total % ranks:
            fits = [d for d in range(1, min(total, 64) + 1) if total % d == 0]
            raise ValueError(f"{name}: its {total} experts do not split over {ranks} ranks: use "
                             f"{', '.join(map(str, fits[:-1]))} or {fits[-1]} ranks")
        return
    extra = [n for n, p in module.named_parameters(recurse=False) if n not in (*_NAMES, *_BIASES)]
    if extra:
        raise ValueError(f"{name} ({type(module).__name__}) has parameters {extra} besides gate_up_proj, down_proj and "
                         "their biases, which tpflow does not know how to split over the intermediate dim: use expert "
                         "parallelism, or leave it out of the plan (it stays whole on every rank)")
    if size % ranks:
        fits = [d for d in range(1, min(size, 64) + 1) if size % d == 0]
        raise ValueError(f"{name}: its intermediate size {size} does not split over {ranks} tensor-parallel ranks: "
                         f"use {', '.join(map(str, fits[:-1]))} or {fits[-1]} ranks, or expert parallelism")


def _slice(full: torch.Tensor, dim: int, packed: bool, rank: int, ranks: int) -> torch.Tensor:
    """This rank's block of ``full`` along ``dim``: its chunk of each half where ``packed`` (gate and up)."""
    if full.is_meta:
        shape = list(full.shape)
        shape[dim] //= ranks
        return torch.empty(shape, dtype=full.dtype)
    halves = full.detach().chunk(2, dim) if packed else (full.detach(),)
    return torch.cat([h.chunk(ranks, dim)[rank] for h in halves], dim)


class _Slices:
    """The hooks of one split experts module: local blocks in, the routing inputs' gradients summed, the output
    summed. Split by experts (``experts``: this rank's first expert, its count and the whole count), the expert ids
    become this rank's (``count``, past its last, for another rank's: the sentinel transformers' experts code skips),
    the weights of other ranks' experts are zero here, and only the tokens routed to this rank's experts go in. A
    ``down_proj_bias`` kept whole (split by the intermediate dim) is added by the axis' first rank only, its gradient
    summed."""

    def __init__(self, module: nn.Module, placement: Placement, experts: tuple[int, int, int] | None) -> None:
        self.data_axes = placement.ndim - 1
        self.group = placement.mesh.get_group(self.data_axes) if placement.hierarchy[-1] > 1 else None
        names = [n for n, _ in module.named_parameters(recurse=False)]
        self.once = names.index("down_proj_bias") if experts is None and "down_proj_bias" in names else None
        self.first = placement.coordinate()[-1] == 0
        self.reads = LocalReads(names, lambda p: (Partial(),) * self.data_axes + (
            Partial() if isinstance(p.placements[-1], Replicate) else p.placements[-1],))
        self.experts = experts
        self.routing: tuple[torch.Tensor, ...] | None = None  # the tokens, weights and parameters, during a call
        self.rows: tuple[torch.Tensor, int] | None = None  # split by experts: the tokens taken, of how many
        self.inputs = list(inspect.signature(module.forward).parameters)[:3]  # tokens, expert ids, weights
        module.register_forward_pre_hook(self.before, with_kwargs=True)
        module.register_forward_hook(self.after, always_call=True)

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        views = self.reads.enter(module)
        if self.once is not None and not self.first:  # the whole bias, added once over the ranks
            module.__dict__[self.reads.names[self.once]] = views[self.once] * 0
        given = {**dict(zip(self.inputs, args)), **kwargs}
        tokens, ids, weights = (given[n] for n in self.inputs)
        # the tokens and the routing weights: whole here, their gradients this rank's partial sums
        tokens, weights = (comm.identity_all_reduce(t, self.group) for t in (tokens, weights))
        self.routing = (tokens, weights, *views)
        if self.experts is not None:
            start, count, total = self.experts
            if bool(((ids < 0) | (ids >= total)).any()):
                raise ValueError(f"{type(module).__name__}: the router chose expert {int(ids.max())} (or a negative "
                                 f"one), but there are {total} experts (ids 0 to {total - 1})")
            ids = ids - start
            other = (ids < 0) | (ids >= count)
            ids, weights = ids.masked_fill(other, count), weights.masked_fill(other, 0)
            # only the tokens routed to this rank's experts go in: the experts code gathers a row per routed slot
            mine = (~other).any(-1).nonzero().squeeze(-1)
            self.rows = (mine, tokens.shape[0])
            tokens, ids, weights = tokens[mine], ids[mine], weights[mine]
        return (tokens, ids, weights), {k: v for k, v in kwargs.items() if k not in self.inputs}

    def after(self, module: nn.Module, args: tuple, output: object) -> object:
        self.reads.leave(module)
        routing, self.routing = self.routing, None
        rows, self.rows = self.rows, None
        if not isinstance(output, torch.Tensor):  # the forward raised (this hook runs anyway)
            return output
        if rows is not None:  # this rank's tokens' outputs, in their places among all the tokens
            output = output.new_zeros((rows[1], *output.shape[1:])).index_add(0, rows[0], output)
        if not output.requires_grad and any(t.requires_grad for t in routing):
            # no token reached this rank's experts, so nothing here leads back to the routing inputs, whose gradients
            # the other ranks sum with this one, nor to the experts (whose gradients one device has, zeros): an empty
            # sum of each keeps this rank in the backward and gives its experts zero gradients
            output = output + sum(t.reshape(-1)[:0].sum() for t in routing)
        return comm.all_reduce_identity(output, self.group)


def split_experts(module: nn.Module, placement: Placement, by: str = "intermediate") -> nn.Module:
    """Split ``module``'s experts over the last axis of ``placement``, in place; its forward is left as it is.

    ``by="intermediate"``: each rank its slice of every expert's intermediate dim (``check_experts`` says which
    modules it takes). ``by="experts"``: each rank ``E / W`` whole experts (biases too), running them on the tokens
    routed to them; the ranks hold every token (the tensor-parallel ranks), and one sum combines the outputs.

    The parameters become global tensors (whole over the data-parallel axes of a 2-D placement), so the optimizer,
    ``clip_grad_norm_`` and ``full_tensor()`` take them as any other.

    Args:
        module: a Hugging Face experts module (``Qwen3MoeExperts``, ``MixtralExperts``, ...), the same on every
            rank.
        placement: the ranks; the last axis is the tensor-parallel one.
        by: ``"intermediate"`` (tensor parallel experts) or ``"experts"`` (expert parallel).

    Returns:
        ``module`` itself.

    Example::

        >>> from tpflow.layers.experts import split_experts
        >>> from transformers import Qwen3MoeConfig
        >>> from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
        >>> _ = torch.manual_seed(0)
        >>> config = Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=6, num_experts=4)
        >>> tp, ep = Qwen3MoeExperts(config), Qwen3MoeExperts(config)
        >>> for p in [*tp.parameters(), *ep.parameters()]:
        ...     _ = torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(1))
        >>> x, ids, w = torch.randn(5, 8), torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
        >>> expected = tp(x, ids, w)
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> split_experts(tp, P).gate_up_proj.to_local().shape                  # 3 of 6 gate rows, 3 of 6 up rows
        torch.Size([4, 6, 8])
        >>> split_experts(ep, P, by="experts").gate_up_proj.to_local().shape    # 2 of 4 experts
        torch.Size([2, 12, 8])
        >>> torch.allclose(tp(x, ids, w), expected, atol=1e-5), torch.allclose(ep(x, ids, w), expected, atol=1e-5)
        (True, True)
    """
    if by not in ("intermediate", "experts"):
        raise ValueError(f"by must be 'intermediate' or 'experts', got {by!r}")
    pl = placement
    ranks, coord = pl.hierarchy[-1], pl.coordinate()
    check_experts(type(module).__name__, module, ranks, by)
    features, inner, packed = _layout(module)
    total = module._parameters["down_proj"].shape[0]
    for name, full in list(module.named_parameters(recurse=False)):
        if by == "experts":
            dim, halves, split = 0, False, Shard(0)
        elif name in ("gate_up_proj", "gate_up_proj_bias"):
            dim, halves = (features if name == "gate_up_proj" else 1), packed
            split = _StridedShard(dim, split_factor=2) if packed else Shard(dim)
        elif name == "down_proj":
            dim, halves, split = inner, False, Shard(inner)
        else:  # down_proj_bias: whole, added by one rank (_Slices)
            dim, halves, split = None, False, Replicate()
        if coord is None:
            local = torch.empty(0, dtype=full.dtype)
        else:
            whole = torch.empty(full.shape, dtype=full.dtype) if full.is_meta else full.detach().clone()
            local = whole if dim is None else _slice(full, dim, halves, coord[-1], ranks)
        value = DTensor.from_local(local.to(pl.device), pl.mesh, (Replicate(),) * (pl.ndim - 1) + (split,),
                                   run_check=False, shape=full.shape, stride=full.stride())
        setattr(module, name, gradients.adopt(nn.Parameter(value, requires_grad=full.requires_grad)))
    if coord is None:
        return module
    experts = None
    if by == "experts":
        count = total // ranks
        experts = (coord[-1] * count, count, total)
        module.num_experts = count  # transformers' experts code: its local experts, and ids past them skipped
        module._is_expert_parallel = True
    setattr(module, _STATE, _Slices(module, pl, experts))
    return module
