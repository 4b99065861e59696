"""Mamba-2 mixers split by heads (Mamba2, Nemotron-H, Falcon-H1, Bamba, Granite-4.0-H, Zamba2): each rank runs the
model's own mixer code (its torch path: convolution, chunked scan, gated norm) on its heads, the output summed.

transformers stores a mixer as it computes it, and the split keeps that layout:

    in_proj   [z | x | B | C | dt] rows (I, I, G*N, G*N, H): each segment split over the ranks, a rank its rows of
              each (``tpflow.global_tensor.segments``: every gather and checkpoint sees the stored order)
    conv1d    [x | B | C] channels, a depthwise convolution: split alike
    A_log, D, dt_bias   one entry per head: split by heads
    norm      the gated RMSNorm's weight, per feature: split with the heads' features
    out_proj  a row split: its input features are the heads' outputs; the output summed over the ranks

Heads come in G groups sharing one B and one C (the state's input and output maps). Where the groups split over the
ranks (G a multiple of W), a rank holds whole groups and the gated norm, whose groups span ``I / G`` features,
normalizes its own groups: its ``group_size`` is kept (not computed from the group count, the bug of
state-spaces/mamba #908), a norm counting its groups (Falcon-H1's ``n_groups``) is given the rank's count. Where the
ranks split the groups (W a multiple of G, G = 1 included), the W / G ranks holding a group's heads each store their
share of its B / C rows and gather the group's whole before each call (their gradients, each rank's partial sum,
summed back), and the norm's mean of squares over a group is summed over those ranks. Any other count is refused.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpflow import comm
from tpflow.global_tensor.segments import Segments, keep_answering
from tpflow.hf.mixer_split import Gathered, HeadRanks, MixerStyle, SplitMixer
from tpflow.plans.style import Plan

__all__ = ["StateSpaceHeads", "state_space_counts"]

_PER_HEAD = ("A_log", "D", "dt_bias")


def state_space_counts(module: nn.Module) -> tuple[int, int, int, int] | None:
    """``(heads, groups, state size, inner width)`` of a Mamba-2 mixer as transformers writes it (a fused ``in_proj``
    of ``[z | x | B | C | dt]``, a depthwise ``conv1d`` over ``[x | B | C]``, per-head ``A_log`` / ``D`` /
    ``dt_bias``, an ``out_proj``), or None for any other module.

    Args:
        module: any module.

    Returns:
        The counts, or None.

    Example::

        >>> from transformers import Mamba2Config, Mamba2ForCausalLM
        >>> model = Mamba2ForCausalLM(Mamba2Config(vocab_size=64, hidden_size=16, num_heads=4, head_dim=8,
        ...                                        state_size=4, n_groups=2, num_hidden_layers=1))
        >>> state_space_counts(model.backbone.layers[0].mixer)
        (4, 2, 4, 32)
    """
    names = ("num_heads", "n_groups", "ssm_state_size", "intermediate_size", "conv_dim", "head_dim")
    if not all(isinstance(getattr(module, n, None), int) for n in names):
        return None
    heads, groups, state, inner = (getattr(module, n) for n in names[:4])
    in_proj, conv, out = (getattr(module, n, None) for n in ("in_proj", "conv1d", "out_proj"))
    if not (isinstance(in_proj, nn.Linear) and isinstance(conv, nn.Conv1d) and isinstance(out, nn.Linear)):
        return None
    if not all(isinstance(getattr(module, n, None), torch.Tensor) and getattr(module, n).shape == (heads,)
               for n in _PER_HEAD):
        return None
    conv_dim = inner + 2 * groups * state
    if (in_proj.out_features != inner + conv_dim + heads or conv.out_channels != conv_dim or conv.groups != conv_dim
            or out.in_features != inner or module.head_dim * heads != inner):
        return None
    return heads, groups, state, inner


def _norm_kind(norm: nn.Module) -> str | None:
    """How a mixer's gated norm counts its groups: ``"size"`` (a ``group_size`` of features, Mamba-2's), ``"count"``
    (``n_groups``, Falcon-H1's), ``"none"`` (no norm), or None (a norm tpflow does not know)."""
    if isinstance(norm, nn.Identity):
        return "none"
    if not type(norm).__name__.endswith("RMSNormGated") or not isinstance(getattr(norm, "weight", None), torch.Tensor):
        return None
    if isinstance(getattr(norm, "group_size", None), int):
        return "size"
    if isinstance(getattr(norm, "n_groups", None), int) and hasattr(norm, "norm_before_gate"):
        return "count"
    return None


@dataclasses.dataclass(frozen=True)
class StateSpaceHeads(MixerStyle):
    """Plan style for a Mamba-2 mixer (``state_space_counts``), split by heads (see the module docstring).

    Args:
        sequence_parallel: its input this rank's tokens, gathered on entry, its output reduce-scattered back to them
            (``hf_plan(sequence_parallel=True)`` sets it).

    Example::

        >>> from transformers import Mamba2Config, Mamba2ForCausalLM
        >>> config = Mamba2Config(vocab_size=64, hidden_size=16, num_heads=4, head_dim=8, state_size=4, n_groups=2,
        ...                       num_hidden_layers=1, chunk_size=4)
        >>> _ = torch.manual_seed(0)
        >>> model = Mamba2ForCausalLM(config).double()
        >>> ids = torch.randint(0, 64, (1, 6))
        >>> want = model(ids).logits
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]),
        ...                         plan={"backbone.layers.*.mixer": StateSpaceHeads()})
        >>> mixer = model.backbone.layers[0].mixer
        >>> mixer.num_heads, mixer.in_proj.weight.to_local().shape          # 2 of 4 heads; 42 of 84 rows
        (2, torch.Size([42, 16]))
        >>> torch.testing.assert_close(model(ids).logits, want)
    """

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        counts = state_space_counts(module)
        if counts is None:
            raise ValueError(f"{name!r} is a {type(module).__name__}; StateSpaceHeads takes a Mamba-2 mixer (in_proj "
                             f"[z | x | B | C | dt], conv1d over [x | B | C], A_log / D / dt_bias per head)")
        heads, groups, _, _ = counts
        world = self.world(plan)
        if heads % world or (groups % world and world % groups):
            degrees = [d for d in range(1, heads + 1) if heads % d == 0 and (groups % d == 0 or d % groups == 0)]
            raise ValueError(f"{name!r} has {heads} state-space heads in {groups} groups, which do not split over "
                             f"{world} {self.said} (the heads must divide, and the groups divide or be a "
                             f"divisor of the ranks): use a degree among {degrees}")
        if (groups * counts[2]) % world:  # (a group's B / C rows, shared by the ranks of its heads, split over them)
            raise ValueError(f"{name!r}: its B / C rows ({groups} groups of a {counts[2]}-wide state) do not split "
                             f"over {world} {self.said}: use a degree that divides {groups * counts[2]}")
        kind = _norm_kind(getattr(module, "norm", None))
        if kind is None or (kind == "count" and module.norm.n_groups != groups):
            norm = type(getattr(module, "norm", None)).__name__
            raise ValueError(f"{name!r}: its norm {norm} is not a gated RMSNorm tpflow knows (a group_size, or "
                             f"n_groups equal to the mixer's {groups}), whose groups it would split")
        if world > groups:
            _refuse_fused_kernel(name, module)

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        ranks = self.head_ranks(plan)
        pl, world = plan.placement, ranks.world
        keep_answering(plan.model)  # (FSDP2 may put its own parameters in place of the segmented ones)
        heads, groups, state, inner = state_space_counts(module)
        for param in ("weight", "bias"):
            if getattr(module.in_proj, param) is not None:
                ranks.segment(module.in_proj, param, (inner, inner, groups * state, groups * state, heads))
        for param in ("weight", "bias"):
            if getattr(module.conv1d, param) is not None:
                ranks.segment(module.conv1d, param, (inner, groups * state, groups * state), read_by=module)
        for param in _PER_HEAD:
            ranks.split(module, param, 0)
        if _norm_kind(module.norm) != "none":
            ranks.split(module.norm, "weight", 0)
        ranks.split_inputs(module.out_proj)
        for buffer, value in list(module.named_buffers(recurse=False)):  # Falcon-H1's multipliers of in_proj's rows
            if value.shape[-1] == module.in_proj.out_features and pl.coordinate() is not None:
                module._buffers[buffer] = _rank_rows(value, (heads, groups, state, inner), world,
                                                     ranks.index).to(pl.device)
        shared = ranks.sharing(groups) if world > groups else None  # (every rank makes the group)
        if pl.coordinate() is not None:
            _split_hooks(module, (heads, groups, state, inner), ranks, shared, self.sequence_dim)


def _rank_rows(value: torch.Tensor, counts: tuple[int, int, int, int], world: int, index: int) -> torch.Tensor:
    """The entries of ``value`` (along its last dim, one per row of ``in_proj``) that rank ``index`` computes with:
    its rows of each segment, its group's whole B and C rows where the ranks share groups."""
    heads, groups, state, inner = counts
    rows = Segments(value.ndim - 1, (inner, inner, groups * state, groups * state, heads), world)
    z, x, b, c, dt = (value[..., a:e] for a, e in rows.ranges(index))
    if world > groups:  # the group of this rank's heads, whole
        group = index * groups // world
        b, c = (value[..., start + group * state:start + (group + 1) * state] for start in
                (2 * inner, 2 * inner + groups * state))
    return torch.cat([z, x, b, c, dt], -1)


def _refuse_fused_kernel(name: str, module: nn.Module) -> None:
    """Refuse groups split over the ranks where the mixer would take mamba_ssm's fused kernel in training, which
    normalizes inside it by each rank's features alone."""
    import importlib.util

    if importlib.util.find_spec("mamba_ssm") is not None or importlib.util.find_spec("kernels") is not None:
        raise ValueError(f"{name!r}: with mamba_ssm or the kernels hub installed, {type(module).__name__} trains "
                         f"through a fused kernel whose gated norm would see only this rank's share of a group's "
                         f"features: use a tensor-parallel degree that divides the mixer's {module.n_groups} groups")


def _split_hooks(module: nn.Module, counts: tuple[int, int, int, int], ranks: HeadRanks,
                 shared: dist.ProcessGroup | None, tokens: int | None) -> None:
    """The mixer's attributes sized for this rank's heads, and its hooks: a shared group's B / C rows gathered over
    ``shared`` (the ranks sharing it), the gated norm's squares summed over them (or its group count this rank's)."""
    heads, groups, state, inner = counts
    world = ranks.world
    own = max(groups // world, 1)
    module.num_heads, module.n_groups, module.intermediate_size = heads // world, own, inner // world
    module.conv_dim = inner // world + 2 * own * state
    if hasattr(module, "groups_time_state_size"):
        module.groups_time_state_size = own * state
    gathered = []
    if world > groups:  # W / G ranks share each group: gather its B / C rows, sum the norm's squares
        rows = (inner // world, inner // world, groups * state // world, groups * state // world, heads // world)
        gathered = [Gathered(module.in_proj, rows, (2, 3)), Gathered(module.conv1d, rows[1:4], (1, 2))]
        module.norm.forward = _SpanningNorm(module.norm, shared, world // groups)
    elif _norm_kind(module.norm) == "count":
        module.norm.n_groups = own
    SplitMixer(module, (module, module.in_proj, module.conv1d, module.norm, module.out_proj), ranks, shared=shared,
               gathered=gathered, out_bias=module.out_proj, sequence_dim=tokens)


class _SpanningNorm:
    """A gated RMSNorm whose group spans the ranks sharing it: the model's formula (``group_size`` / ``n_groups``
    kinds, ``_norm_kind``), with each group's mean of squares summed over those ranks (exact; each rank holds one
    group's share of features)."""

    def __init__(self, norm: nn.Module, group: object, ranks: int) -> None:
        self.norm, self.group, self.ranks = norm, group, ranks

    def __call__(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        norm, dtype, kind = self.norm, hidden_states.dtype, _norm_kind(self.norm)
        gate_first = not getattr(norm, "norm_before_gate", False)
        h = hidden_states if kind == "count" else hidden_states.to(torch.float32)  # each kind's order of casts
        if gate is not None and gate_first:
            h = h * F.silu(gate.to(torch.float32))
        h = h.to(torch.float32)
        squares = comm.copy_to_ranks(h.pow(2).sum(-1, keepdim=True), self.group).clone()  # summed in place next
        squares = comm.reduce_from_ranks(squares, self.group)  # every rank reads the sum: gradients summed too
        h = h * torch.rsqrt(squares / (h.shape[-1] * self.ranks) + norm.variance_epsilon)
        if kind == "size":
            return norm.weight * h.to(dtype)
        h = norm.weight * h
        if gate is not None and not gate_first:
            h = h * F.silu(gate.to(torch.float32))
        return h.to(dtype)
