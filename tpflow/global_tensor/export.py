"""A parallelized model's values as one device's state dict, for formats that take whole tensors.

Every rank takes part in the gathers (each global tensor is all-gathered in turn, ``full_tensor``), and only
rank 0 keeps the whole tensors, on the CPU: calling it on rank 0 alone would wait in the first gather until
the collective timeout, transformers' known deadlock when a tensor-parallel model is saved from rank 0 only.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

__all__ = ["full_state_dict"]


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as one device holds it: every global tensor whole, on rank 0 only.

    Called on every rank (each takes part in the gathers, one tensor at a time, so no rank holds more than one
    whole tensor beyond its blocks); rank 0 gets whole CPU tensors under the model's own names, the other ranks an
    empty dict. A tied parameter (an embedding and its head) is one tensor under each of its names, as
    ``state_dict`` gives it, so that ``save_pretrained`` and safetensors see the tie. Fused groups, blocks split
    over the vocabulary and key/value heads kept whole all come back as the layer they replaced.

    Args:
        model: a model whose parameters are global tensors (after ``tpf.parallelize``), or a plain one.

    Returns:
        On rank 0, names to whole tensors on the CPU, in ``state_dict`` order; on every other rank, ``{}``.

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
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not whole:
        return whole
    first: dict[int, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        shared = first.setdefault(id(t), name)
        if shared != name and shared in whole:
            whole[name] = whole[shared]  # one tensor under every name of a tied parameter
    return whole
