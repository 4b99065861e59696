"""``tpf.rl.reshard_plan``: which slice of which checkpoint tensor each rank of an inference engine of another
tensor-parallel degree holds, as data, so that a sharded receiver is sent only its part of the weight stream.

The engine's layout is the model's own plan at the engine's degree D (the one Hugging Face's ``tp_plan`` and vLLM's
layers follow): a tensor the model splits on dim d splits there into ``torch.chunk``'s D blocks; attention's q / k /
v by whole heads (fewer key/value heads than D: each rank holds its head, ``r // (D / K)``, as vLLM replicates them),
its output projection by the heads' columns; a tensor the model keeps whole stays whole. Through transformers'
conversion to the checkpoint's layout a split follows the tensor: an experts' tensor unbound into one per expert
keeps its split on the next dim (a split over the experts themselves gives each expert's tensors to its rank).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow.hf.heads import attention_heads
from tpflow.rl.weights import Source, checkpoint_tensors
from tpflow.sbp import chunk_bounds

__all__ = ["Part", "ReshardPlan", "reshard_plan"]


class Part(NamedTuple):
    """What one engine rank holds of a checkpoint tensor: ``tensor.narrow(dim, start, stop - start)``, the whole
    tensor (``dim`` None), or nothing (an empty range on a dim: a rank that holds none of an expert's tensors).

    Example::

        >>> Part("lm_head.weight", 0, 51, 101).size
        50
    """

    name: str
    dim: int | None
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


class ReshardPlan:
    """Each engine rank's :class:`Part` of every checkpoint tensor (``tpf.rl.reshard_plan``).

    Args:
        degree: the engine's tensor-parallel degree.
        parts: checkpoint name -> one :class:`Part` per engine rank, in the stream's order.

    Example::

        >>> plan = ReshardPlan(2, {"w": [Part("w", 0, 0, 3), Part("w", 0, 3, 5)]})
        >>> plan.part("w", torch.arange(5), 1)
        tensor([3, 4])
    """

    def __init__(self, degree: int, parts: dict[str, list[Part]]) -> None:
        self.degree, self.parts = degree, parts

    def for_rank(self, rank: int) -> list[Part]:
        """Engine rank ``rank``'s parts, the tensors it holds none of left out.

        Args:
            rank: in ``[0, degree)``.

        Returns:
            Its :class:`Part` of each tensor, in the stream's order.
        """
        if not 0 <= rank < self.degree:
            raise ValueError(f"rank must be in [0, {self.degree}), got {rank}")
        return [p[rank] for p in self.parts.values() if p[rank].dim is None or p[rank].size]

    def part(self, name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Engine rank ``rank``'s part of the whole checkpoint tensor ``name`` (a view).

        Args:
            name: a checkpoint name of the stream.
            tensor: its whole value.
            rank: the engine rank.

        Returns:
            The slice that rank holds (a view of ``tensor``).
        """
        p = self.parts[name][rank]
        return tensor if p.dim is None else tensor.narrow(p.dim, p.start, p.size)


def _heads_rule(model: nn.Module, key: str, degree: int) -> tuple[int, list[tuple[int, int]]] | None:
    """The dim and each engine rank's bounds of an attention projection's parameter, by whole heads; None for any
    other parameter."""
    module_name, _, param = key.rpartition(".")
    parent_name, _, child = module_name.rpartition(".")
    if child not in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return None
    counts = attention_heads(model.get_submodule(parent_name))
    if counts is None:
        return None
    heads, kv, head_dim = counts
    if child == "o_proj":
        return None if param != "weight" else (1, _blocks(heads, degree, head_dim, key))
    if child == "q_proj":
        return 0, _blocks(heads, degree, head_dim, key)
    if kv % degree == 0:
        return 0, _blocks(kv, degree, head_dim, key)
    if degree % kv:
        raise ValueError(f"tpf.rl.reshard_plan: {key}: {kv} key/value heads neither split over {degree} ranks nor "
                         f"divide them: an engine of degree {degree} cannot hold this model")
    head = [r // (degree // kv) for r in range(degree)]  # fewer key/value heads than ranks: each rank holds its own
    return 0, [(h * head_dim, (h + 1) * head_dim) for h in head]


def _blocks(heads: int, degree: int, head_dim: int, key: str) -> list[tuple[int, int]]:
    if heads % degree:
        raise ValueError(f"tpf.rl.reshard_plan: {key}: {heads} heads do not split over {degree} ranks: an engine "
                         f"of degree {degree} cannot hold this model")
    per = heads // degree * head_dim
    return [(r * per, (r + 1) * per) for r in range(degree)]


def _split_dim(tensor: torch.Tensor) -> int | None:
    """The dim the model splits ``tensor`` on over its tensor-parallel axis (the last), or None."""
    if not isinstance(tensor, DTensor):
        return None
    return getattr(tensor.placements[-1], "dim", None)  # Shard's, or _StridedShard's (a packed gate / up, each half
    # split; not a Shard in torch 2.13)


def _parts(model: nn.Module, source: Source, degree: int) -> dict[str, list[Part]]:
    """Each checkpoint tensor of ``source``, each engine rank's part of it."""
    heads = _heads_rule(model, source.key, degree)
    dim = heads[0] if heads is not None else _split_dim(source.tensor)
    parts = {}
    for made in source.made:
        if dim is None:
            parts[made.name] = [Part(made.name, None, 0, 0)] * degree
            continue
        if made.shape == tuple(source.tensor.shape):
            bounds = heads[1] if heads is not None else chunk_bounds(made.shape[dim], degree)
            parts[made.name] = [Part(made.name, dim, a, b) for a, b in bounds]
        elif len(made.shape) == source.tensor.ndim - 1 and dim >= 1:  # one expert's tensor: the split moves in
            parts[made.name] = [Part(made.name, dim - 1, a, b) for a, b in chunk_bounds(made.shape[dim - 1], degree)]
        elif len(made.shape) == source.tensor.ndim - 1:  # the experts themselves split: each expert's rank
            expert = int(made.name.split(".experts.")[1].split(".")[0])
            ranks = chunk_bounds(source.tensor.shape[0], degree)
            parts[made.name] = [Part(made.name, None if a <= expert < b else 0, 0, 0) for a, b in ranks]
        else:
            raise ValueError(f"tpf.rl.reshard_plan: {source.key} split on dim {dim} becomes {made.name} {made.shape} "
                             f"in the checkpoint, whose split is not known here: send the engine whole tensors")
    return parts


def reshard_plan(model: nn.Module, target_degree: int) -> ReshardPlan:
    """Which part of each tensor of ``tpf.rl.weights(model)`` each rank of an engine of tensor-parallel degree
    ``target_degree`` holds (see the module's docstring); no communication.

    Args:
        model: a model after ``tpf.parallelize`` (at any degree: the plan is read from its layout).
        target_degree: the engine's tensor-parallel degree.

    Returns:
        A :class:`ReshardPlan`: ``for_rank(r)``, ``part(name, whole, r)``.

    Raises:
        ValueError: the engine's degree does not split the attention heads (nor, for key/value heads, a multiple
            of them).

    Example::

        >>> from torch import nn
        >>> model = tpf.parallelize(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4)),
        ...                         placement=tpf.placement("cpu", ranks=[0, 1]), plan={"0": "column", "1": "row"})
        >>> plan = tpf.rl.reshard_plan(model, 3)                    # an engine of 3 ranks
        >>> [(p.name, p.dim, p.start, p.stop) for p in plan.for_rank(2)][:3]
        [('0.weight', 0, 4, 6), ('0.bias', 0, 4, 6), ('1.weight', 1, 4, 6)]
    """
    if target_degree < 1:
        raise ValueError(f"target_degree must be a positive number of ranks, got {target_degree}")
    parts: dict[str, list[Part]] = {}
    for source in checkpoint_tensors(model, model.state_dict(keep_vars=True), None):
        parts.update(_parts(model, source, target_degree))
    return ReshardPlan(target_degree, parts)
