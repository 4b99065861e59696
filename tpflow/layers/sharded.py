"""What every tensor-parallel module shares: parameters split over the last axis of a placement, made from
whole (single-device) values, read as local blocks on the hot path, and loaded from whole checkpoints.

The parallel linears (``tpflow.layers.linear``) and the vocabulary-parallel embedding
(``tpflow.layers.vocab``) are built on it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from tpflow.global_tensor import from_local, get_sbp, gradients, tensor
from tpflow.global_tensor.local_blocks import LocalBlocks
from tpflow.placement import Placement, placement_of_mesh
from tpflow.sbp import Sbp, broadcast, chunk_bounds, local_region

__all__ = ["ShardedModule"]


def _grad_placements(p: DTensor, data_split: tuple[bool, ...]) -> tuple:
    """A parameter gradient's layout: partial over the data axes the input is split on, the parameter's own
    on the tensor-parallel axis."""
    return (*(Partial() if split_here else Replicate() for split_here in data_split), p.placements[-1])


class ShardedModule(nn.Module):
    """A module whose parameters are global tensors split (or not) over the last axis of ``placement``, the
    tensor-parallel one; the axes before it hold copies (data parallelism).

    Subclasses make their parameters with ``_parameter`` from whole values and read this rank's blocks with
    ``_local_blocks``; a whole (single-device) state dict loads as is, each rank keeping its block.

    Args:
        placement: the ranks the parameters live on (``tpf.placement``), 1-D or 2-D.
        device: where the parameters are made (default: the placement's device); its type must be the
            placement's, or ``"meta"``: this rank's blocks are allocated on the placement's device but not
            initialised, for a checkpoint to fill (``tpf.load_safetensors``); no whole value is ever made.

    Example::

        >>> import tpflow as tpf
        >>> from tpflow.layers.sharded import ShardedModule
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> isinstance(tpf.ColumnParallelLinear(8, 4, placement=P), ShardedModule)
        True
    """

    def __init__(self, placement: Placement, device: torch.device | str | None) -> None:
        nn.Module.__init__(self)  # not super(): a subclass may mix in a torch module whose __init__ takes sizes
        if not isinstance(placement, Placement):
            raise TypeError(f"placement must be a tpf.placement(type, ranks), got {placement!r}")
        device = torch.device(device) if device is not None else placement.device
        if device.type not in (placement.type, "meta"):
            raise ValueError(f"device {device} does not match the placement's type {placement.type!r} (or 'meta': "
                             f"blocks to be loaded)")
        self.placement = placement
        coord = placement.coordinate()
        self._tp_size, self._tp_rank = placement.hierarchy[-1], None if coord is None else coord[-1]
        self._group = self._find_group()
        self._blocks = LocalBlocks()

    def _axes(self, tp: Sbp) -> tuple[Sbp, ...]:
        return (broadcast,) * (self.placement.ndim - 1) + (tp,)

    def _parameter(self, value: torch.Tensor, sbp: tuple[Sbp, ...]) -> nn.Parameter:
        """A parameter holding whole ``value`` laid out as ``sbp``: each rank keeps its block, and copies along
        broadcast axes are taken from the axis' first rank, so replicas agree even if ranks' values differ. A meta
        ``value`` gives this rank's block allocated and not initialised (a checkpoint fills it)."""
        pl = self.placement
        if value.is_meta:
            coord = pl.coordinate()
            shape = (0,) if coord is None else local_region(value.shape, sbp, pl.hierarchy, coord)[1]
            block = torch.empty(shape, dtype=value.dtype, device=pl.device)
        else:
            block = tensor(value.detach().to(pl.device), placement=pl, sbp=sbp).to_local()
        synced = from_local(block, pl, sbp, shape=value.shape, sync_data=not value.is_meta).detach()
        return gradients.adopt(nn.Parameter(synced, requires_grad=value.requires_grad))

    def _find_group(self) -> dist.ProcessGroup | None:
        """The tensor-parallel axis' process group, looked up once: resolved lazily on the first forward, it
        would change the module during the first traced call, and torch.compile would recompile on the next."""
        if self._tp_size == 1 or self._tp_rank is None:
            return None
        return self.placement.mesh.get_group(self.placement.ndim - 1)

    def _tp_placement(self) -> Placement | None:
        """The ranks of this rank's tensor-parallel axis, as a placement of their own (a 1-D placement itself; on
        a 2-D one, the existing group's ranks, None where that axis has one rank)."""
        if self.placement.ndim == 1:
            return self.placement
        if self._group is None:
            return None
        ranks = dist.get_process_group_ranks(self._group)
        return placement_of_mesh(DeviceMesh.from_group(self._group, self.placement.type, mesh=ranks))

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The tensor-parallel process group (None on a single rank: nothing to communicate)."""
        return self._group

    def local_range(self, size: int) -> tuple[int, int]:
        """This rank's ``[start, end)`` of ``size`` rows or features split over the tensor-parallel axis.

        Args:
            size: the whole size (a vocabulary, a layer's output features).

        Returns:
            ``(start, end)``, ``torch.chunk``'s block for this rank (``tpf.sbp.chunk_bounds``).

        Example::

            >>> P = tpf.placement("cpu", ranks=[0, 1])
            >>> tpf.ColumnParallelLinear(8, 101, placement=P).local_range(101)   # on rank 1 of 2
            (51, 101)
        """
        return chunk_bounds(size, self._tp_size)[self._tp_rank]

    def __getstate__(self) -> dict:
        """The process group is this process's handle: a copy (``copy.deepcopy``, pickle) looks it up again."""
        return {**self.__dict__, "_group": None}

    def __setstate__(self, state: dict) -> None:
        nn.Module.__setstate__(self, state)
        self._group = self._find_group()

    def _local_blocks(self, params: tuple[DTensor, ...], data_split: tuple[bool, ...]) -> tuple[torch.Tensor, ...]:
        """This rank's blocks of ``params``, differentiable into their gradients: partial sums over the data axes
        the input is split on (reduced when read, as OneFlow's data parallelism does)."""
        return self._blocks(params, data_split, lambda p: _grad_placements(p, data_split))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A single-device checkpoint (whole plain tensors) loads as is: each rank keeps its block."""
        for name, param in self._parameters.items():
            value = state_dict.get(prefix + name)
            if param is not None and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                    and value.shape == param.shape:  # a shape mismatch is left for torch to report
                state_dict[prefix + name] = tensor(value.to(param.dtype).to(self.placement.device),
                                                   placement=self.placement, sbp=get_sbp(param))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
