"""torch.distributed's collectives given a global tensor: refused with what to do.

A global tensor's local tensors are blocks of one value (split) or copies of it (broadcast), and torch's collectives
work on local tensors: ``dist.all_gather(outputs, logits)`` on logits split over the vocabulary (or on their argmax,
gathered whole first) has no meaning DTensor knows, and torch says only that the operator "does not have a sharding
strategy registered". Every c10d operator on a DTensor raises tpflow's sentence instead, naming the fix: the whole
value first (``tensor.full_tensor()``), then the collective on that plain tensor.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

__all__ = ["collective_misuse", "refuse_collectives"]

# torch's c10d operators (torch/csrc/distributed/c10d/Ops.cpp), each taking tensors in place, by the name of the
# torch.distributed function that calls it
_OPERATORS = {"allgather_": "all_gather", "allgather_coalesced_": "all_gather_coalesced",
              "allgather_into_tensor_coalesced_": "all_gather_into_tensor",
              "_allgather_base_": "all_gather_into_tensor", "allreduce_": "all_reduce",
              "allreduce_coalesced_": "all_reduce_coalesced", "alltoall_": "all_to_all",
              "alltoall_base_": "all_to_all_single", "broadcast_": "broadcast", "gather_": "gather",
              "reduce_": "reduce", "reduce_scatter_": "reduce_scatter",
              "_reduce_scatter_base_": "reduce_scatter_tensor",
              "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor", "scatter_": "scatter", "send": "send",
              "recv_": "recv", "recv_any_source_": "recv"}


def collective_misuse(name: str, tensor: DTensor) -> ValueError:
    """The error for a collective given a global tensor that is not the same block on every rank.

    Args:
        name: the collective, as the user called it.
        tensor: the global tensor it was given.

    Returns:
        The ``ValueError`` to raise.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> str(collective_misuse("all_gather", tpf.zeros(4, placement=P, sbp=tpf.sbp.split(0))))[:60]
        'torch.distributed.all_gather got a global tensor laid out (S'
    """
    return ValueError(f"torch.distributed.{name} got a global tensor laid out {tuple(tensor.placements)} over "
                      f"{tensor.device_mesh.mesh.flatten().tolist()} (split logits, or what was computed from them, "
                      f"such as their argmax): a collective works on each rank's local tensor, which is a block (or "
                      f"a copy) of one value; take the whole value first, tensor.full_tensor() (the whole logits on "
                      f"every rank), then gather that plain tensor; a framework's gather (accelerate's, Trainer's "
                      f"evaluation) does this itself once tpf.parallelize or tpf.adopt has run")


def _refuse(operator, args: tuple, kwargs: dict) -> object:
    tensor = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, DTensor))
    raise collective_misuse(_OPERATORS[operator.__name__.split(".")[0]], tensor)


def refuse_collectives() -> None:
    """Make every c10d operator given a DTensor raise ``collective_misuse``'s sentence (once, at import).

    Example::

        >>> refuse_collectives()       # tpflow's import did
    """
    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    if handlers is None:  # another torch's dispatcher: its own message stands
        return
    for name in _OPERATORS:
        operator = getattr(getattr(torch.ops.c10d, name, None), "default", None)
        if operator is not None:
            handlers.setdefault(operator, _refuse)


refuse_collectives()
