"""A named placement's data axes are PyTorch's FSDP2's: ``parallelize`` splits the model over the last (tensor)
axis only, on that axis' slice of the mesh, and the user shards the data axes with ``fully_shard(block,
mesh=P.mesh["dp"])``, which joins the two slices of one root mesh. A model that reaches its first forward without
FSDP2 over those axes would train each data-parallel replica on its own rows, silently apart: it stops there.

Fused column groups (q / k / v, gate / up in one product over weight blocks joined in one storage) are not made
there: FSDP2 swaps in parameters of its own, views of the buffers it all-gathers into before each forward and frees
after it, and joining those into a storage of tpflow's would keep the first step's values (and their memory).
Each column layer then computes on its own, as PyTorch's and transformers' tensor parallelism do."""

from __future__ import annotations

import math

from torch import nn

from tpflow.layers.experts import over_data
from tpflow.placement import Placement

_AWAITS_FSDP = "_tpflow_awaits_fsdp"  # on a parameter parallelize left to FSDP2, until FSDP2 swaps it for its own


def expect_fsdp(model: nn.Module, placement: Placement) -> None:
    """On a named placement of several axes, ``model``'s first forward checks that FSDP2 shards it over the data
    axes (``fully_shard`` on the model or on a module holding it, a pipeline stage's, replaced every parameter it
    had here; every parameter mesh of two or more axes has their names: not another root's), and raises naming
    the call to make where it does not."""
    if not placement.leaves_data_axes or math.prod(placement.hierarchy[:-1]) == 1:
        return  # no data axes, or only axes of one rank: nothing for FSDP2 to shard
    data = placement.names[:-1]
    mesh = f'P.mesh["{data[0]}"]' if len(data) == 1 else f"P.mesh[{data!r}]"
    # FSDP2 swaps each parameter it manages for its own (sharded, and gathered around each forward): one still
    # marked at the first forward was left out. A mark on the parameter, not a reference to it: a weak reference
    # would keep model.to(dtype) from swapping the parameter's tensor in place
    for p in model.parameters():
        if not over_data(p):
            setattr(p, _AWAITS_FSDP, True)
    model._apply = _MarksKept(model)  # model.to(dtype) swaps each global parameter's contents, its attributes too

    def check(module: nn.Module, args: object) -> None:
        left = [name for name, p in module.named_parameters() if getattr(p, _AWAITS_FSDP, False)]
        # the blocks' sharded parameters show their meshes (the root's are gathered by now): they span the data axes
        meshes = {getattr(p, "device_mesh", None) for p in module.parameters()}
        names = {m.mesh_dim_names for m in meshes if m is not None and m.ndim > 1}
        if left or any(not set(data) <= set(n or ()) for n in names):
            what = f"its parameters {', '.join(left[:3])}{', ...' if len(left) > 3 else ''} are not sharded by " \
                   "FSDP2" if left else f"it is sharded by FSDP2 over other axes than {data} (meshes " \
                   f"{sorted(map(str, names))})"
            raise RuntimeError(
                f"{type(module).__name__} was parallelized on {placement!r}, which splits it over its last axis "
                f"{placement.names[-1]!r} and leaves the data axes {data} to FSDP2, but {what}: call "
                f"torch.distributed.fsdp.fully_shard(block, mesh={mesh}) on each block and then on the model (or on a "
                f"pipeline stage's module) before its first step (P the placement), or parallelize on an unnamed "
                f"placement for tpflow's own data parallelism")
        handle.remove()

    handle = model.register_forward_pre_hook(check)


class _MarksKept:
    """A model's ``_apply`` (what ``to``, ``double``, ``cuda`` call) that gives its parameters back their marks
    awaiting FSDP2: ``torch.utils.swap_tensors``, which casts a DTensor parameter in place, swaps its ``__dict__``
    away (an object, not a bound method: a copy of the model takes it along)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, fn, recurse: bool = True) -> nn.Module:
        marked = {id(p) for p in self.model.parameters() if getattr(p, _AWAITS_FSDP, False)}
        out = type(self.model)._apply(self.model, fn, recurse)
        for p in self.model.parameters():  # the same objects: swapped in place
            if id(p) in marked:
                setattr(p, _AWAITS_FSDP, True)
        return out


def fsdp_ignored_params(model: nn.Module) -> set[nn.Parameter]:
    """The parameters of ``model`` that ``parallelize`` already shared out over a data axis (experts exchanging
    tokens by all-to-all, ``tpf.ExpertParallel(axis="dp")``), which FSDP2 must leave alone: its own sharding over
    that axis would mix different ranks' experts (torch refuses it: "Cannot concatenate overlapping meshes").

    Args:
        model: a model ``parallelize`` changed.

    Returns:
        The set to give ``fully_shard(..., ignored_params=)``, empty where there are none.

    Example::

        >>> import tpflow as tpf
        >>> tpf.fsdp_ignored_params(torch.nn.Linear(2, 2))
        set()
    """
    return {p for p in model.parameters() if over_data(p)}
