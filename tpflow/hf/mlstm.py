"""xLSTM's mLSTM layer split by heads: each rank runs the model's own layer (its projections, the matrix-memory
recurrence, the per-head norm, the output gate) on its heads, the output summed.

Each head has its own query / key / value features, its own input and forget gate, its own memory and its own norm,
so the ranks share nothing but the input and the output projection's sum:

    q, k, v, ogate_preact      column splits: the rank's heads' features (``weight_mode="fused"``: ``qkv_opreact``'s
                               ``[q | k | v | o]`` segments, each split alike, ``tpflow.global_tensor.segments``)
    igate_preact, fgate_preact one output per head: split by heads (fused: ``ifgate_preact``'s ``[i | f]``)
    multihead_norm             a layer norm within each head, its weight per feature: split with the heads
    out_proj                   a row split: the heads' outputs in; the output summed over the ranks

The layer views its projections by its config's ``num_heads`` and splits the fused ones at ``qk_dim`` / ``v_dim``:
it gets a config of its own with the rank's heads, and the rank's widths. The cache (``xLSTMCache``) holds every
head's memory, sized by the model's config: each rank's layer gets views of its first heads' slots and keeps its
heads' memory there.
"""

from __future__ import annotations

import copy
import dataclasses

from torch import nn

from tpflow.hf.mixer_split import HeadRanks, MixerStyle, SplitMixer, refuse_undivided
from tpflow.plans.style import Plan

__all__ = ["MatrixMemoryHeads", "mlstm_counts"]

_SINGLE = ("q", "k", "v", "ogate_preact", "igate_preact", "fgate_preact")


def _linears(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    found = [getattr(module, n, None) for n in names]
    return found if all(isinstance(m, nn.Linear) for m in found) else None


def mlstm_counts(module: nn.Module) -> tuple[int, int, int] | None:
    """``(heads, query / key width, value width)`` of xLSTM's mLSTM layer as transformers writes it (q / k / v,
    an output gate, per-head input and forget gates, or the fused ``qkv_opreact`` / ``ifgate_preact``; a per-head
    ``multihead_norm``; ``out_proj``), or None for any other module.

    Args:
        module: any module.

    Returns:
        The counts, or None.

    Example::

        >>> from transformers import xLSTMConfig, xLSTMForCausalLM
        >>> model = xLSTMForCausalLM(xLSTMConfig(vocab_size=64, hidden_size=128, embedding_dim=128, num_heads=4,
        ...                                      num_blocks=1, num_hidden_layers=1))
        >>> mlstm_counts(model.backbone.blocks[0].mlstm_layer), mlstm_counts(model.backbone.blocks[0])
        ((4, 64, 128), None)
    """
    config, norm = getattr(module, "config", None), getattr(module, "multihead_norm", None)
    heads, qk, v = getattr(config, "num_heads", None), getattr(module, "qk_dim", None), getattr(module, "v_dim", None)
    if not all(isinstance(x, int) and x > 0 for x in (heads, qk, v)) or not isinstance(norm, nn.Module):
        return None
    if qk % heads or v % heads or getattr(norm, "num_heads", None) != heads or not isinstance(
            getattr(module, "mlstm_backend", None), nn.Module) or not _linears(module, ("out_proj",)):
        return None
    mode = getattr(config, "weight_mode", None)
    if mode == "single" and _linears(module, _SINGLE):
        widths = [getattr(module, n).out_features for n in _SINGLE]
        fits = widths == [qk, qk, v, v, heads, heads]
    elif mode == "fused" and _linears(module, ("qkv_opreact", "ifgate_preact")):
        fits = (module.qkv_opreact.out_features, module.ifgate_preact.out_features) == (2 * qk + 2 * v, 2 * heads)
    else:
        return None
    return (heads, qk, v) if fits and module.out_proj.in_features == v else None


@dataclasses.dataclass(frozen=True)
class MatrixMemoryHeads(MixerStyle):
    """Plan style for xLSTM's mLSTM layer (``mlstm_counts``), split by heads (see the module docstring).

    Args:
        sequence_parallel: its input this rank's tokens, gathered on entry, its output reduce-scattered back to them
            (``hf_plan(sequence_parallel=True)`` sets it).

    Example::

        >>> from transformers import xLSTMConfig, xLSTMForCausalLM
        >>> _ = torch.manual_seed(0)
        >>> model = xLSTMForCausalLM(xLSTMConfig(vocab_size=64, hidden_size=128, embedding_dim=128, num_heads=4,
        ...                                      num_blocks=1, num_hidden_layers=1)).double()
        >>> ids = torch.randint(0, 64, (1, 6))
        >>> want = model(ids).logits
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]),
        ...                         plan={"backbone.blocks.*.mlstm_layer": MatrixMemoryHeads()})
        >>> layer = model.backbone.blocks[0].mlstm_layer
        >>> layer.config.num_heads, layer.q.weight.to_local().shape          # 2 of 4 heads
        (2, torch.Size([32, 128]))
        >>> torch.testing.assert_close(model(ids).logits, want)
    """

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        counts = mlstm_counts(module)
        if counts is None:
            raise ValueError(f"{name!r} is a {type(module).__name__}; MatrixMemoryHeads takes xLSTM's mLSTM layer "
                             f"(q / k / v and gates per head, or fused, a multihead_norm, out_proj)")
        refuse_undivided(name, "mLSTM heads", counts[0], self.world(plan), self.said)

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        ranks = self.head_ranks(plan)
        pl, world = plan.placement, ranks.world
        heads, qk, v = mlstm_counts(module)
        if module.config.weight_mode == "single":
            projections = [getattr(module, n) for n in _SINGLE]
            for linear in projections:
                for param in ("weight", "bias"):
                    if getattr(linear, param) is not None:
                        ranks.split(linear, param, 0)
        else:
            projections = [module.qkv_opreact, module.ifgate_preact]
            for linear, sizes in zip(projections, ((qk, qk, v, v), (heads, heads))):
                for param in ("weight", "bias"):
                    if getattr(linear, param) is not None:
                        ranks.segment(linear, param, sizes)
        for param in ("weight", "bias"):
            if getattr(module.multihead_norm, param, None) is not None:
                ranks.split(module.multihead_norm, param, 0)
        ranks.split_inputs(module.out_proj)
        module.config = copy.copy(module.config)  # (the model's, shared by every layer)
        module.config.num_heads = module.multihead_norm.num_heads = heads // world
        module.qk_dim, module.v_dim = qk // world, v // world
        module.multihead_norm.num_features = v // world
        if pl.coordinate() is not None:
            _Memory(module, (*projections, module.multihead_norm, module.out_proj), ranks, self.sequence_dim)


class _Memory(SplitMixer):
    """``SplitMixer``'s hooks, and: the cached memory (``(C, n, m)``, every head's) handed in as views of this rank's
    first heads' slots, this rank's new memory written there, the whole tensors handed back to the model."""

    def __init__(self, module: nn.Module, modules: tuple[nn.Module, ...], ranks: HeadRanks,
                 sequence_dim: int | None) -> None:
        super().__init__(module, modules, ranks, out_bias=module.out_proj if module.out_proj.bias is not None else None,
                         sequence_dim=sequence_dim)
        self.heads = module.config.num_heads
        self.given: list[tuple | None] = []  # per call in progress: the model's own state and its views

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = super().before(module, args, kwargs)
        state = kwargs.get("state", args[1] if len(args) > 1 else None)
        if state is None:
            self.given.append(None)
            return args, kwargs
        views = tuple(s.narrow(1, 0, self.heads) for s in state)
        self.given.append((state, views))
        return ((args[0], views, *args[2:]), kwargs) if len(args) > 1 else (args, {**kwargs, "state": views})

    def after(self, module: nn.Module, args: tuple, output: object) -> object:
        output, given = super().after(module, args, output), self.given.pop()
        if given is None or not isinstance(output, tuple) or output[1] is None:
            return output
        state, views = given
        for view, new in zip(views, output[1]):
            view.copy_(new)
        return (output[0], state, *output[2:])
