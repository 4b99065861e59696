"""A parallelized model's values as one device's state dict, for formats that take whole tensors.

Every rank of the model's placement takes part in the gathers (each global tensor is all-gathered in turn,
``full_tensor``), and only the placement's first rank, the writer, keeps the whole tensors, on the CPU: calling
it on the writer alone would wait in the first gather until the collective timeout, transformers' known
deadlock when a tensor-parallel model is saved from rank 0 only.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["export_rank", "full_state_dict"]


def export_rank(model: nn.Module) -> int:
    """The rank that :func:`full_state_dict` gives the whole tensors to: the first rank of the model's placement.

    Args:
        model: a model whose global tensors all live on one placement (any layout), or a plain one.

    Returns:
        That rank; 0 for a model without global tensors.

    Raises:
        ValueError: the model's global tensors live on different placements (a pipeline's stages), whose values
            no one rank can gather; export each stage's modules apart.

    Example::

        >>> from torch import nn
        >>> import tpflow as tpf
        >>> model = tpf.parallelize(nn.Sequential(nn.Linear(4, 6)), placement=tpf.placement("cpu", [1]),
        ...                         plan={"0": "column"})
        >>> export_rank(model)
        1
    """
    placements = {tuple(t.device_mesh.mesh.flatten().tolist()) for t in model.state_dict().values()
                  if isinstance(t, DTensor)}
    if len(placements) > 1:
        raise ValueError(f"the model's global tensors live on {len(placements)} placements "
                         f"({sorted(placements)}): no one rank can gather them; export each stage's modules apart")
    return placements.pop()[0] if placements else 0


def full_state_dict(model: nn.Module, keys: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as one device holds it: every global tensor whole, on one rank only.

    Called on every rank of the model's placement (each takes part in the gathers, one tensor at a time, so no
    rank holds more than one whole tensor beyond its blocks); the placement's first rank (:func:`export_rank`)
    gets whole CPU tensors of its own (copies, not the parameters) under the model's own names, every other rank
    an empty dict. A tied parameter (an embedding and its head) is one tensor under each of its names, as
    ``state_dict`` gives it, so that ``save_pretrained`` and safetensors see the tie. Fused groups, blocks split
    over the vocabulary and key/value heads kept whole all come back as the layer they replaced.

    Args:
        model: a model whose parameters are global tensors on one placement (after ``tpf.parallelize``), or a
            plain one.
        keys: only these entries of the state dict (a PEFT model's adapters); default every one.

    Returns:
        On the writer, names to whole tensors on the CPU, in ``state_dict`` order; on every other rank, ``{}``.

    Raises:
        ValueError: the model's global tensors live on different placements (see :func:`export_rank`).

    Example::

        >>> import torch
        >>> from torch import nn
        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))
        >>> one_device = {k: v.clone() for k, v in model.state_dict().items()}
        >>> model = tpf.parallelize(model, placement=P, plan={"0": "column", "2": "row"})
        >>> state = tpf.full_state_dict(model)               # every rank calls it
        >>> sorted(state)                                   # on rank 0
        ['0.bias', '0.weight', '2.bias', '2.weight']
        >>> state                                           # on rank 1
        {}
        >>> tpf.get_rank() != 0 or all(torch.equal(state[k], v) for k, v in one_device.items())
        True
    """
    writer = export_rank(model)
    keep = (dist.get_rank() if dist.is_initialized() else 0) == writer
    whole: dict[str, torch.Tensor] = {}
    gathered: dict[int, torch.Tensor] = {}  # a tied tensor, by its id: gathered once, the same under every name
    for name, t in model.state_dict(keep_vars=True).items():
        if keys is not None and name not in keys:
            continue
        if id(t) not in gathered:
            value = t.detach()
            value = value.full_tensor() if isinstance(value, DTensor) else value  # every rank: a collective
            gathered[id(t)] = value.to("cpu", copy=True) if keep else value.new_empty(0)
        if keep:
            whole[name] = gathered[id(t)]
    return whole
