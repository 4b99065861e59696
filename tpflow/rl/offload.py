"""``tpf.offload`` / ``tpf.reload``: a trainer's device memory handed to a colocated inference engine while it
generates, and taken back: the parameters', gradients' and optimizer state's bytes copied to host memory (pinned on
CUDA, so the copies run at the link's speed) and their device storages emptied, then the reverse.

Each storage is emptied in place (``untyped_storage().resize_(0)``, as FSDP2 frees its gathered parameters), never
swapped for another: every tensor that views it (a fused group's weight blocks joined in one storage, FSDP2's padded
shards, a tied embedding and head, a parameter's ``DTensor`` and its local block) sees its bytes again after
``reload``, bit for bit, and nothing that holds it has to be told.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["offload", "reload"]

_HELD = "_tpflow_offloaded"  # on the model: its storages' host copies while offloaded


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    """The parameters, their gradients and the optimizer's state tensors, as local blocks."""
    for p in model.parameters():
        yield _local(p.detach())
        if p.grad is not None:
            yield _local(p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            yield from (_local(v) for v in state.values() if isinstance(v, torch.Tensor))


def offload(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Move ``model``'s parameters and gradients (and ``optimizer``'s state) to host memory, freeing their device
    storages; :func:`reload` brings them back. Call it on every rank, between training steps (nothing may compute on
    the model meanwhile).

    Args:
        model: a model (parallelized or not).
        optimizer: its optimizer, whose state moves too.

    Returns:
        The bytes moved off this rank's devices (0 on the CPU, where the bytes are moved into host copies all the
        same).

    Example::

        >>> model = torch.nn.Linear(4, 4)
        >>> before = model.weight.detach().clone()
        >>> _ = tpf.offload(model)
        >>> model.weight.untyped_storage().size()                  # emptied
        0
        >>> tpf.reload(model)
        >>> torch.equal(model.weight, before)
        True
    """
    if getattr(model, _HELD, None) is not None:
        raise RuntimeError("tpf.offload: this model is offloaded already: tpf.reload(model) it first")
    held: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
    seen: set[int] = set()
    moved = 0
    with torch.no_grad():
        for t in _tensors(model, optimizer):
            storage = t.untyped_storage()
            if storage.size() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            device = storage.device
            pinned = device.type == "cuda"
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
            host.copy_(_bytes(storage), non_blocking=pinned)
            held.append((storage, host))
            moved += storage.nbytes() if device.type != "cpu" else 0
        if any(s.device.type == "cuda" for s, _ in held):
            torch.cuda.synchronize()  # the copies landed before the storages go
        for storage, _ in held:
            storage.resize_(0)
    if any(s.device.type == "cuda" for s, _ in held):
        torch.cuda.empty_cache()  # for the engine: the caching allocator keeps freed blocks otherwise
    object.__setattr__(model, _HELD, (held, optimizer))
    return moved


def reload(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Bring back what :func:`offload` moved to host memory: every storage refilled, bit for bit.

    Args:
        model: the offloaded model.
        optimizer: the optimizer given to :func:`offload` (its state comes back with the model's record).

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> _ = tpf.offload(model)
        >>> tpf.reload(model)
        >>> model.weight.untyped_storage().size() > 0
        True
    """
    record = getattr(model, _HELD, None)
    if record is None:
        raise RuntimeError("tpf.reload: this model is not offloaded (tpf.offload(model, optimizer) first)")
    held, offloaded = record
    if optimizer is not None and optimizer is not offloaded:
        raise ValueError("tpf.reload: this optimizer is not the one offloaded with the model (tpf.offload(model, "
                         "optimizer)): pass that one, or none")
    with torch.no_grad():
        for storage, host in held:
            storage.resize_(host.numel())
            _bytes(storage).copy_(host, non_blocking=host.is_pinned())
        if any(s.device.type == "cuda" for s, _ in held):
            torch.cuda.synchronize()
    object.__setattr__(model, _HELD, None)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage's bytes as a ``uint8`` tensor."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
