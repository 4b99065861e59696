"""A named placement's data axes are PyTorch's FSDP2's: ``parallelize`` splits the model over the last (tensor)
axis only, on that axis' slice of the mesh, and the user shards the data axes with ``fully_shard(block,
mesh=P.mesh["dp"])``, which joins the two slices of one root mesh. A model that reaches its first forward without
FSDP2 over those axes would train each data-parallel replica on its own rows, silently apart: it stops there.

Fused column groups (q / k / v, gate / up in one product over weight blocks joined in one storage) are not made
there: FSDP2 swaps in parameters of its own, views of the buffers it all-gathers into before each forward and frees
after it, and joining those into a storage of tpflow's would keep the first step's values (and their memory).
Each column layer then computes on its own, as PyTorch's and transformers' tensor parallelism do."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

from tpflow.placement import Placement


def leaves_data_axes(placement: Placement) -> bool:
    """Whether ``parallelize`` on ``placement`` leaves its data axes to FSDP2: a named placement of several axes,
    seen from one of its ranks."""
    return placement.names is not None and placement.ndim > 1 and placement.coordinate() is not None


def tensor_slice(placement: Placement) -> Placement:
    """Where a model's tensor-parallel layers live: the last axis' slice of a named placement of several axes
    (this rank's row; the placement itself on a rank outside it, which holds nothing), else the placement."""
    return placement[placement.names[-1]] if leaves_data_axes(placement) else placement


def expect_fsdp(model: nn.Module, placement: Placement) -> None:
    """On a named placement of several axes, ``model``'s first forward checks that FSDP2 shards it over the data
    axes (``model`` is an ``FSDPModule``, and every parameter mesh of two or more axes has their names: not another
    root's), and raises naming the call to make where it does not."""
    if not leaves_data_axes(placement):
        return
    data = placement.names[:-1]
    mesh = f'P.mesh["{data[0]}"]' if len(data) == 1 else f"P.mesh[{data!r}]"

    def check(module: nn.Module, args: object) -> None:
        # FSDP2's own pre-forward hook ran first and gathered the root's parameters, so only the blocks' still show
        # their meshes: those must span the data axes
        meshes = {getattr(p, "device_mesh", None) for p in module.parameters()}
        names = {m.mesh_dim_names for m in meshes if m is not None and m.ndim > 1}
        if not isinstance(module, FSDPModule) or any(not set(data) <= set(n or ()) for n in names):
            what = "is not sharded by FSDP2" if not isinstance(module, FSDPModule) else \
                f"is sharded by FSDP2 over other axes than {data} (meshes {sorted(map(str, names))})"
            raise RuntimeError(
                f"{type(module).__name__} was parallelized on {placement!r}, which splits it over its last axis "
                f"{placement.names[-1]!r} and leaves the data axes {data} to FSDP2, but it {what}: call "
                f"torch.distributed.fsdp.fully_shard(block, mesh={mesh}) on each block and then on the model before "
                f"its first step (P the placement), or parallelize on an unnamed placement for tpflow's own data "
                f"parallelism")
        handle.remove()

    handle = model.register_forward_pre_hook(check)
