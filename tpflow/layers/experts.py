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

Split by whole experts (``by="experts"``), each rank holds ``E / W`` of them. Over the tensor-parallel ranks, which
hold every token, each runs its experts on the tokens routed to them and the sum combines the outputs. Over a data
axis of a named placement (``axis="dp"``, beside FSDP2), whose ranks hold different tokens, the tokens go to their
experts' ranks by one all-to-all and their outputs come back by the mirror one:

    counts     each rank's tokens per destination rank (a token routed to two experts of one rank goes once),
               exchanged with its count of out-of-range expert ids, so that a bad router stops every rank
    dispatch   the tokens, their expert ids and routing weights, in one all-to-all (uneven, zero counts)
    experts    the module's own forward on this rank's slots of the tokens received (a row per slot)
    combine    the outputs back by the mirror all-to-all, summed into each token's row

With a tensor-parallel axis too (EP x TP) each expert is also split over it by the intermediate dim, as above. The
experts' gradients, each the sum over every data rank's tokens, are divided by the axis' ranks: FSDP2 averages the
other parameters' over them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from tpflow import comm
from tpflow.global_tensor import gradients
from tpflow.global_tensor.local_blocks import LocalReads
from tpflow.layers.expert_factors import block, mark_over_data, over_data
from tpflow.layers.expert_layouts import layout, takes_sorted_rows
from tpflow.placement import Placement

__all__ = ["add_delta", "check_experts", "experts_axis", "mark_over_data", "over_data", "split_experts"]

_BIASES = ("gate_up_proj_bias", "down_proj_bias")  # per expert: [E, 2I] split as gate_up_proj, [E, H] kept whole
_STATE = "_tpflow_experts"


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
    shape = layout(module)
    params = {n: getattr(module, n, None) for n in (shape.up, "down_proj")}
    if any(not isinstance(p, nn.Parameter) or p.ndim != 3 or isinstance(p, DTensor) for p in params.values()):
        raise ValueError(f"{name} ({type(module).__name__}) is not a layout tpflow knows for experts: it needs 3-D "
                         f"gate_up_proj [E, 2I, H] (or an ungated up_proj [E, I, H]) and down_proj [E, H, I] "
                         f"parameters (transposed where the module's is_transposed or its shapes say so), called as "
                         f"experts(hidden_states, top_k_index, top_k_weights) or experts(sorted_rows); leave it out of "
                         f"the plan (it stays whole on every rank), or plan its parts as nn.Linear modules")
    up, down = params[shape.up], params["down_proj"]
    size, total = down.shape[shape.inner], down.shape[0]
    zero = _zero_experts(module)  # (LongCat-Flash's gate_up_proj holds rows for its zero experts too, unused)
    if up.shape[0] not in (total, total + zero) or up.shape[shape.features] != shape.factor * size:
        raise ValueError(f"{name}: {shape.up} {tuple(up.shape)} and down_proj {tuple(down.shape)} do not hold one "
                         f"expert count and one intermediate size ({shape.up}'s dim {shape.features} is "
                         f"{shape.factor} x down_proj's dim {shape.inner})")
    if by == "experts":
        if zero:
            raise ValueError(f"{name} ({type(module).__name__}) routes tokens to {zero} zero experts (its "
                             f"identity_expert) past its {total} experts, which expert parallelism would send to no "
                             f"rank: split it by the intermediate dim (tpf.ExpertTensorParallel())")
        if takes_sorted_rows(module):
            raise ValueError(f"{name} ({type(module).__name__}) takes every expert's rows sorted by expert, not the "
                             f"routed ids expert parallelism sends: split it by the intermediate dim "
                             f"(tpf.ExpertTensorParallel())")
        others = [n for n, p in module.named_parameters(recurse=False) if p.shape[:1] != (total,)]
        if others:
            raise ValueError(f"{name} ({type(module).__name__}) has parameters {others} that are not per expert "
                             f"(a first dim of {total}): expert parallelism cannot split them")
        if total % ranks:
            fits = [d for d in range(1, min(total, 64) + 1) if total % d == 0]
            raise ValueError(f"{name}: its {total} experts do not split over {ranks} ranks: use "
                             f"{', '.join(map(str, fits[:-1]))} or {fits[-1]} ranks")
        return
    extra = [n for n, p in module.named_parameters(recurse=False) if n not in (shape.up, "down_proj", *_BIASES)]
    if extra:
        raise ValueError(f"{name} ({type(module).__name__}) has parameters {extra} besides gate_up_proj, down_proj and "
                         "their biases, which tpflow does not know how to split over the intermediate dim: use expert "
                         "parallelism, or leave it out of the plan (it stays whole on every rank)")
    if size % ranks:
        fits = [d for d in range(1, min(size, 64) + 1) if size % d == 0]
        raise ValueError(f"{name}: its intermediate size {size} does not split over {ranks} tensor-parallel ranks: "
                         f"use {', '.join(map(str, fits[:-1]))} or {fits[-1]} ranks, or expert parallelism")


class _Slices:
    """The hooks of one split experts module: local blocks in, the routing inputs' gradients summed over the
    tensor-parallel ranks, the output summed over them. Split by experts (``experts``: this rank's first expert, its
    count and the whole count), only the slots routed to this rank's experts go in, one row each with its local
    expert id and weight (the module's own code, whatever it is, sees none of another rank's experts): picked out of
    every token (``exchange`` None) or out of the tokens received from the ranks of the ``exchange`` group. A
    ``down_proj_bias`` kept whole over the tensor-parallel ranks is added by the axis' first rank only, its gradient
    summed."""

    def __init__(self, module: nn.Module, placement: Placement, experts: tuple[int, int, int] | None,
                 exchange: dist.ProcessGroup | None) -> None:
        self.group = placement.mesh.get_group(placement.ndim - 1) if placement.hierarchy[-1] > 1 else None
        self.first = placement.coordinate()[-1] == 0
        names = [n for n, _ in module.named_parameters(recurse=False)]
        bias = module._parameters.get("down_proj_bias")
        self.once = names.index("down_proj_bias") if bias is not None and isinstance(
            bias.placements[-1], Replicate) else None
        sizes = placement.hierarchy

        def grads(p: DTensor) -> tuple:
            """Each parameter's gradient: partial over an axis of several ranks it is whole on, but the bias added
            once, summed over the tensor axis in the backward; else split as the parameter is. (Plain where it
            can be: torch's clip_grad_norm_ mixes up the norms of some layouts.)"""
            once = p is module._parameters.get("down_proj_bias") and self.once is not None
            return tuple(Partial() if isinstance(q, Replicate) and n > 1 and not (once and axis == len(sizes) - 1)
                         else q for axis, (q, n) in enumerate(zip(p.placements, sizes)))

        self.reads = LocalReads(names, grads)
        self.deltas: dict[str, list] = {}  # per parameter name: what adds to its block around each call (add_delta)
        self.total = module._parameters["down_proj"].shape[0] + _zero_experts(module)  # (ids past: zero experts)
        self.experts, self.exchange = experts, exchange
        self.scale = 1 / dist.get_world_size(exchange) if exchange is not None else 1.0
        self.routing: tuple[torch.Tensor, ...] | None = None  # the tokens, weights and parameters, during a call
        self.back = None  # split by experts: the module's output rows to this rank's tokens, during a call
        self.inputs = list(inspect.signature(module.forward).parameters)[:3]  # tokens, expert ids, weights
        module.register_forward_pre_hook(self.before, with_kwargs=True)
        module.register_forward_hook(self.after, always_call=True)

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        views = list(self.reads.enter(module))
        for i, name in enumerate(self.reads.names):
            for delta in self.deltas.get(name, ()):
                change = delta()
                if change is not None:
                    views[i] = views[i] + change
        if self.once is not None:  # the whole bias, added once over the ranks, its gradient summed over them
            views[self.once] = comm.copy_to_ranks(views[self.once], self.group) * int(self.first)
        if self.exchange is not None:  # each expert's gradient sums every data rank's tokens: FSDP2 averages
            views = [gradients.scale_grad(v, self.scale) for v in views]
        for name, view in zip(self.reads.names, views):
            module.__dict__[name] = view
        given = {**dict(zip(self.inputs, args)), **kwargs}
        if len(self.inputs) == 1:  # every expert's rows, sorted by expert (Llama 4's): whole, gradient summed
            tokens = comm.copy_to_ranks(given[self.inputs[0]], self.group)
            self.routing = (tokens, *views)
            return (tokens,), {}
        tokens, ids, weights = (given[n] for n in self.inputs)
        # the tokens and the routing weights: whole here, their gradients this rank's partial sums
        tokens, weights = (comm.copy_to_ranks(t, self.group) for t in (tokens, weights))
        if self.exchange is not None:
            tokens, ids, weights, self.back = self._dispatch(module, tokens, ids, weights)
        else:
            self._check_ids(module, ids)
            if self.experts is not None:
                tokens, ids, weights, self.back = self._slots(tokens, ids, weights)
        self.routing = (tokens, weights, *views)
        return (tokens, ids, weights), {k: v for k, v in kwargs.items() if k not in self.inputs}

    def _check_ids(self, module: nn.Module, ids: torch.Tensor) -> None:
        """Every rank holds the same ids here: each raises on its own. On a GPU the check is a device-side assert,
        so that the experts split by the intermediate dim read nothing back to the host (a decode step's layers)."""
        bad = ((ids < 0) | (ids >= self.total)).any()
        if ids.is_cuda:
            torch._assert_async(~bad, f"{type(module).__name__}: the router chose an expert id outside 0 to "
                                      f"{self.total - 1}")
        elif bool(bad):
            raise ValueError(f"{type(module).__name__}: the router chose expert {int(ids.max())} (or a negative "
                             f"one), but there are {self.total} experts (ids 0 to {self.total - 1})")

    def _slots(self, tokens: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple:
        """This rank's routed slots out of ``tokens``' (global expert ids): a row per slot of one of its experts
        (a token routed to two of them comes twice), its local id and weight, so that the experts code gathers no
        row for another rank's experts; and how their outputs go back, summed into each token's row."""
        start, count, _ = self.experts
        local = ids - start
        token, slot = ((local >= 0) & (local < count)).nonzero(as_tuple=True)  # by token, then slot: k's order
        rows = tokens.shape[0]

        def back(y: torch.Tensor) -> torch.Tensor:
            return y.new_zeros((rows, *y.shape[1:])).index_add(0, token, y)

        return tokens[token], local[token, slot, None], weights[token, slot, None], back

    def _dispatch(self, module: nn.Module, tokens: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple:
        """Each token to the ranks of its experts (once per rank), by one all-to-all, and how their outputs come
        back (the mirror all-to-all, summed into each token's row)."""
        _, count, total = self.experts
        ranks = dist.get_world_size(self.exchange)
        bad = (ids < 0) | (ids >= total)
        to = torch.zeros(ids.shape[0], ranks, dtype=torch.bool, device=ids.device)
        to.scatter_(1, ids.clamp(0, total - 1).div(count, rounding_mode="floor"), True)
        token_of = to.T.nonzero()[:, 1]  # (rank, token) pairs, by rank, then token
        send = to.sum(0)
        counts = comm.exchange_counts(torch.stack([send, bad.sum().expand(ranks)], 1), self.exchange)
        if bool(counts[:, 1].any()):  # every rank raises: none goes on into an exchange the others left
            wrong = [r for r, n in enumerate(counts[:, 1].tolist()) if n]
            raise ValueError(f"{type(module).__name__}: the router chose expert ids outside 0 to {total - 1} on "
                             f"ranks {wrong} of the experts' axis (ranks of its group)")
        send, recv = send.tolist(), counts[:, 0].tolist()
        tokens, ids, weights = comm.all_to_all_mirror((tokens[token_of], ids[token_of], weights[token_of]), send,
                                                      recv, self.exchange)
        tokens, ids, weights, received = self._slots(tokens, ids, weights)
        rows = to.shape[0]

        def back(y: torch.Tensor) -> torch.Tensor:
            y = comm.all_to_all_mirror(received(y), recv, send, self.exchange)
            return y.new_zeros((rows, *y.shape[1:])).index_add(0, token_of, y)

        return tokens, ids, weights, back

    def after(self, module: nn.Module, args: tuple, output: object) -> object:
        self.reads.leave(module)
        routing, self.routing = self.routing, None
        back, self.back = self.back, None
        if not isinstance(output, torch.Tensor):  # the forward raised (this hook runs anyway)
            return output
        if not output.requires_grad and any(t.requires_grad for t in routing):
            # no token reached this rank's experts, so nothing here leads back to the routing inputs, whose gradients
            # the other ranks sum with this one (or send back by all-to-all), nor to the experts (whose gradients one
            # device has, zeros): an empty sum of each keeps this rank in the backward, its experts' gradients zero
            output = output + sum(t.reshape(-1)[:0].sum() for t in routing)
        if back is not None:  # the outputs of this rank's tokens (or of the tokens it received), in their places
            output = back(output)
        return comm.reduce_from_ranks(output, self.group)


def split_experts(module: nn.Module, placement: Placement, by: str = "intermediate",
                  axis: str | None = None) -> nn.Module:
    """Split ``module``'s experts over the last axis of ``placement`` (or over its data axis ``axis``), in place; its
    forward is left as it is.

    ``by="intermediate"``: each rank its slice of every expert's intermediate dim (``check_experts`` says which
    modules it takes). ``by="experts"``: each rank ``E / W`` whole experts (biases too), running them on the tokens
    routed to them; the ranks hold every token (the tensor-parallel ranks), and one sum combines the outputs. With
    ``axis``, the data axis of a named placement of two axes (``names=("dp", "tp")``): the experts are shared out
    over its ranks, which hold different tokens, exchanged by all-to-all; with more than one tensor-parallel rank
    each expert is split over those too, by the intermediate dim (EP x TP).

    The parameters become global tensors (whole over the data-parallel axes of a 2-D placement; split over ``axis``),
    so the optimizer, ``clip_grad_norm_`` and ``full_tensor()`` take them as any other. FSDP2 must leave those split
    over ``axis`` alone: ``fully_shard(..., ignored_params=tpf.fsdp_ignored_params(model))``.

    Args:
        module: a Hugging Face experts module (``Qwen3MoeExperts``, ``MixtralExperts``, ...), the same on every
            rank.
        placement: the ranks; the last axis is the tensor-parallel one.
        by: ``"intermediate"`` (tensor parallel experts) or ``"experts"`` (expert parallel).
        axis: with ``by="experts"``, the name of the data axis the experts are shared out over (None: the last
            axis).

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
    label = type(module).__name__
    tp, coord = pl.hierarchy[-1], pl.coordinate()
    if axis is None:
        check_experts(label, module, tp, by)
        over = pl.ndim - 1  # the axis the experts are shared out over, if they are
    else:
        over = experts_axis(pl, axis, by)
        check_experts(label, module, pl.hierarchy[over], "experts")
        if tp > 1:
            check_experts(label, module, tp, "intermediate")
    shape = layout(module)
    total = module._parameters["down_proj"].shape[0]
    whole = (Replicate(),) * pl.ndim
    for name, full in list(module.named_parameters(recurse=False)):
        splits = []  # (mesh axis, tensor dim, gate and up halves, DTensor placement), applied in order
        if by == "experts":
            splits.append((over, 0, False, Shard(0)))
        if by == "intermediate" or (axis is not None and tp > 1):
            dim, halves, split = shape.split(name)
            if dim is not None:
                splits.append((pl.ndim - 1, dim, halves, split))
        placements = list(whole)
        for mesh_axis, _, _, split in splits:
            placements[mesh_axis] = split
        if coord is None:
            local = torch.empty(0, dtype=full.dtype)
        else:
            local = full  # sliced without a whole copy (none at all on meta: a checkpoint fills it)
            for mesh_axis, dim, halves, _ in splits:
                local = block(local, dim, 2 if halves else 1, coord[mesh_axis], pl.hierarchy[mesh_axis])
            if not splits:
                local = torch.empty(full.shape, dtype=full.dtype) if full.is_meta else full.detach().clone()
        value = DTensor.from_local(local.to(pl.device), pl.mesh, tuple(placements), run_check=False,
                                   shape=full.shape, stride=full.stride())
        param = gradients.adopt(nn.Parameter(value, requires_grad=full.requires_grad))
        mark_over_data(param, axis is not None)
        setattr(module, name, param)
    if coord is None:
        return module
    experts = None
    if by == "experts":
        count = total // pl.hierarchy[over]
        experts = (coord[over] * count, count, total)
        module.num_experts = count  # transformers' experts code: its local experts (it sees no other rank's)
    setattr(module, _STATE, _Slices(module, pl, experts, None if axis is None else pl.mesh.get_group(over)))
    if _zero_experts(module) and tp > 1:  # its tokens come out whole on every rank: once in the ranks' sum
        module.identity_expert.register_forward_hook(_OnFirst(coord[-1] == 0))
    return module


def _zero_experts(module: nn.Module) -> int:
    """The zero experts of an experts module (LongCat-Flash's: routed past its experts, an ``identity_expert``
    returning the tokens as they are), or 0."""
    zero = getattr(module, "zero_expert_num", 0) or 0
    return zero if isinstance(getattr(module, "identity_expert", None), nn.Module) else 0


class _OnFirst:
    """A forward hook keeping a module's output on the axis' first rank, zero on the others: a whole value added
    into a sum over the ranks. Zero times the output, not a new zero tensor: every rank's graph must reach the
    tokens as the first's does, or a call routing no token to a real expert leaves the tokens' gradient sum (an
    all-reduce) out of the other ranks' backward."""

    def __init__(self, first: bool) -> None:
        self.first = first

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output if self.first else output * 0


def add_delta(module: nn.Module, name: str, delta: Callable[[], torch.Tensor | None]) -> None:
    """Around each call of a split experts module, add ``delta()`` (this rank's block of a change to its parameter
    ``name``, with autograd, or None for none) to the block its forward reads: a LoRA adapter on the fused experts
    (``tpflow.hf.lora``).

    Args:
        module: an experts module ``split_experts`` split.
        name: its parameter (``"gate_up_proj"``, ``"down_proj"``).
        delta: called before each call.

    Example::

        >>> from transformers import Qwen3MoeConfig
        >>> from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
        >>> experts = split_experts(Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=6,
        ...                                                        num_experts=4)), tpf.placement("cpu", ranks=[0, 1]))
        >>> x, ids, w = torch.randn(5, 8), torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
        >>> add_delta(experts, "down_proj", lambda: None)
        >>> experts(x, ids, w).shape
        torch.Size([5, 8])
    """
    state = getattr(module, _STATE, None)
    if state is None:
        raise ValueError(f"{type(module).__name__} is not split by split_experts: nothing reads its blocks")
    state.deltas.setdefault(name, []).append(delta)


def experts_axis(placement: Placement, axis: str, by: str = "experts") -> int:
    """The mesh axis of ``placement`` named ``axis``, checked as one experts can be shared out over by all-to-all:
    the data axis of a named placement of two axes.

    Args:
        placement: the placement the model is parallelized on.
        axis: the data axis' name.
        by: how the experts are split (only ``"experts"`` takes an axis).

    Returns:
        The axis' index (0).

    Example::

        >>> from tpflow.layers.experts import experts_axis
        >>> experts_axis(tpf.placement("cpu", ranks=[[0], [1]], names=("dp", "tp")), "dp")
        0
    """
    if by != "experts":
        raise ValueError(f"axis={axis!r} shares whole experts out over a data axis: it takes by='experts'")
    names = placement.names or ()
    if len(names) != 2 or axis != names[0]:
        raise ValueError(f"experts are shared out over a data axis by all-to-all on a named placement of two axes, "
                         f"(data, tensor), e.g. tpf.placement(type, ranks=[[0, 1], [2, 3]], names=({axis!r}, 'tp')) "
                         f"with FSDP2 over {axis!r}: {placement!r} has no such axis {axis!r}")
    return 0
