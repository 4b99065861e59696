"""Pipeline stages: a module on a placement (OneFlow's ``set_stage``).

A stage's parameters live only on its placement's ranks (elsewhere their blocks are empty), and its
input is moved onto the placement with ``to_global`` on entry, so inside it any SBP works: data
parallel (broadcast parameters, split(0) input), tensor parallel (column / row layers), or both on
a 2-D placement. Called eagerly, every rank runs every stage in order, as one SPMD script; ranks
outside a stage skip its module and hold an empty block of its output, whose shape and SBP the
stage's first rank sends them. A ``tpf.Pipeline`` runs the same stages over micro-batches, each rank
only its own stage.

A plain PyTorch module (no global parameters of its own) fed rows split(0) or broadcast runs on its
ranks' local blocks, as data parallelism: DTensor dispatch costs 0.1-0.4 ms an op, which a stage's hot
path does not pay. Its parameter gradients are partial sums over the axes its rows are split on, summed
by the backward (``tpflow.global_tensor.reducer``); where a bucket at a time during it (``grad_sync="backward"``,
CUDA's default), each submodule reads its parameters' blocks through an autograd node of its own made as it is
entered, which autograd runs as soon as that submodule's backward is done. In a pipeline's step it reads them
as plain leaves made once for the step, whose gradients reach the parameters once, at its end. Split rows must be
independent samples; a module with buffers (BatchNorm's statistics mix rows) runs through DTensor on them.

A module ``parallelize`` made on the stage's placement (every parameter in a tpflow parallel layer or a
replicated module there) runs its own forward on the local blocks too, as tensor parallelism does without
a pipeline: fed an input whole over the tensor-parallel axis (and split(0) over the others), each layer
does its own collectives, and the output must come back whole over the tensor-parallel ranks (end the
stage with a row layer, or a column layer with ``gather_output``). Plain-tensor code inside it (an
attention's rotary positions, a Hugging Face model's masks) then works as on one device. A module built
from global parameters and tpflow's ops runs on global tensors.

On a named placement of several axes, ``parallelize`` leaves the data axes to PyTorch's FSDP2 (``fully_shard`` on
the module's blocks and on the module): the input is split(0) over those axes by default, and since FSDP2 averages
the gradients over its ranks where the stage's rows (one batch, as on one device) want them summed, the module's
output gradient is taken as many times as the rows are split (and its input's divided back).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tpflow import comm
from tpflow.comm.wire import FAILED, HEADER_BYTES, OK, header, read_header
from tpflow.global_tensor import get_placement, get_sbp, gradients, tensor, to_global
from tpflow.global_tensor.blocks import Block, local_of_full, off_placement
from tpflow.global_tensor.local import from_block
from tpflow.layers import ShardedModule
from tpflow.layers.regions import is_split
from tpflow.layers.replicated import replicated_grads
from tpflow.pipeline.plain_reads import PlainReads
from tpflow.placement import Placement
from tpflow.sbp import Broadcast, Sbp, Split, broadcast, normalize

__all__ = ["PipelineError", "Stage", "stage"]

EAGER_TAG = 1 << 24  # the output header of an eager call, apart from a pipeline's per-micro-batch tags


class PipelineError(RuntimeError):
    """A stage failed: the ranks that did not run it raise this, with the failing stage's error.

    A stage's error is sent on to every rank instead of leaving them waiting for its messages. Called eagerly,
    the stage's own ranks raise the original exception and the other ranks this error. In
    ``tpf.Pipeline.step`` every rank of the pipeline raises it, the failing stage's ranks with the original
    exception as its cause, and the pipeline then runs no more steps. A ``Pipeline`` also raises it when the
    ranks of one stage hand off different tensors, or a gradient's shape does not match its output's.

    Args:
        *args: the message, as for any exception: the failing stage, its ranks, the action it failed on (in a
            pipeline) and its error.

    Example::

        >>> import tpflow as tpf
        >>> from torch import nn
        >>> first = tpf.stage(nn.Linear(8, 6), stage_id=0, placement=tpf.placement("cpu", ranks=[0]))
        >>> second = tpf.stage(nn.Linear(7, 4), stage_id=1, placement=tpf.placement("cpu", ranks=[1]))  # wants 7
        >>> try:
        ...     y = second(first(torch.randn(2, 8)))   # eagerly: rank 1 raises the module's own RuntimeError
        ... except RuntimeError as e:                 # a PipelineError on rank 0 (in Pipeline.step: on every rank)
        ...     print(type(e).__name__, e)
        PipelineError stage 1 (ranks [1]) failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x6 and 7x4)
    """


class Stage(nn.Module):
    """``module`` as stage ``stage_id`` of a pipeline, on ``placement``; ``sbp`` is its input's layout there
    (None: the incoming SBP where the placements have the same shape, else broadcast; on a named placement of
    several axes, each data-parallel row its own rows).

    ``tpf.stage`` builds one (the same, with keyword arguments). The module's plain parameters and buffers are
    converted in place to global ones broadcast on ``placement`` (global ones keep their SBP), so they live
    only on its ranks. Calling the stage moves its input onto ``placement`` (``to_global``) and runs the
    module there; ranks outside the placement skip the module and get an empty block of the output, whose
    shape and SBP the stage's first rank sends them. The module must return one global tensor on
    ``placement``, unless it is a plain PyTorch module fed split(0) or broadcast rows, which runs on the
    ranks' local blocks (see the module docstring).

    Args:
        module: the stage's computation: an ``nn.Module`` taking one tensor and returning one.
        stage_id: its position in the pipeline, an int from 0; a ``tpf.Pipeline`` needs ids 0, 1, ..., each
            once.
        placement: the ranks that run it (``tpf.placement``), 1-D or 2-D; in a ``tpf.Pipeline`` no rank may
            be in two stages.
        sbp: the input's layout on ``placement``: one SBP for a 1-D placement, else one per placement axis
            (``tpf.sbp.split(0)`` runs a plain module data parallel on the ranks' own rows). Default None: the
            incoming SBP where the placements have the same shape, else broadcast; on a named placement of several
            axes (data axes for FSDP2), split(0) over the data axes and broadcast over the last.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> first = tpf.Stage(nn.Linear(8, 32), 0, tpf.placement("cpu", ranks=[0]))
        >>> second = tpf.Stage(nn.Linear(32, 4), 1, P, sbp=tpf.sbp.split(0))   # data parallel on ranks 0, 1
        >>> y = second(first(torch.randn(16, 8)))                                # every rank calls both
        >>> tpf.get_sbp(y), y.shape
        ((sbp.split(dim=0),), torch.Size([16, 4]))
    """

    # set by tpf.pipeline.cut, the stage being part of a model: (what its tensors' names have before the whole
    # model's names, the whole model's tensor names); tpf.load_safetensors then loads the whole model's checkpoint
    part_of: tuple[str, frozenset[str]] | None = None

    def __init__(self, module: nn.Module, stage_id: int, placement: Placement, sbp: object = None) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"tpf.stage takes an nn.Module, got {type(module).__name__}")
        if not isinstance(placement, Placement):
            raise TypeError(f"placement must be a tpf.placement(type, ranks), got {placement!r}")
        if not isinstance(stage_id, int) or isinstance(stage_id, bool) or stage_id < 0:
            raise ValueError(f"stage_id must be an int >= 0, got {stage_id!r}")
        self.stage_id, self.placement, self.sbp = stage_id, placement, sbp
        if sbp is not None:
            normalize(sbp, placement.ndim, 1)  # a malformed SBP fails here, not at the first call
        self.plain = not any(isinstance(t, DTensor) for t in [*module.parameters(), *module.buffers()])
        # parallelize's work on this placement runs its own forward on local tensors; its buffers stay plain
        self.parallel = placement.coordinate() is not None and _parallelized(module, placement)
        self.reads = PlainReads(placement.type)  # the plain path's reads of its parameters' blocks
        self.module = module if self.parallel else to_global(module, placement=placement)

    def input_sbp(self, src: Placement, src_sbps: tuple[Sbp, ...], ndim: int) -> tuple[Sbp, ...]:
        """The layout this stage computes on, for an input of ``ndim`` dims laid out as ``src_sbps`` on ``src``."""
        if self.sbp is not None:
            return normalize(self.sbp, self.placement.ndim, ndim)
        if self.placement.names is not None and self.placement.ndim > 1 and ndim > 0:  # data axes: their own rows
            return (Split(0),) * (self.placement.ndim - 1) + (broadcast,)
        if src.hierarchy == self.placement.hierarchy:
            return src_sbps
        return (broadcast,) * self.placement.ndim

    def enter(self, x: torch.Tensor) -> DTensor:
        """``x`` on this stage's placement: a global tensor is boxed there; a plain one is read as the whole
        value (the same on every rank, as a single-device script has it) and is data, with no gradient."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"stage {self.stage_id} takes a tensor, got {type(x).__name__}")
        if not isinstance(x, DTensor):
            sbps = self.input_sbp(self.placement, (broadcast,) * self.placement.ndim, x.ndim)
            return tensor(x.detach().to(self.placement.device), placement=self.placement, sbp=sbps)
        sbps = self.input_sbp(get_placement(x), get_sbp(x), x.ndim)
        return to_global(x, placement=self.placement, sbp=sbps)

    def enter_block(self, x: torch.Tensor) -> Block:
        """``enter`` as a pipeline holds its result: this rank's ``Block`` (a copy). A plain ``x`` is cut here, with
        no global tensor made (a pipeline's first stage takes every micro-batch so)."""
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and self.placement.coordinate() is not None:
            sbps = self.input_sbp(self.placement, (broadcast,) * self.placement.ndim, x.ndim)
            return Block(local_of_full(x.detach().to(self.placement.device), self.placement, sbps), sbps,
                         tuple(x.shape))
        return Block.of(self.enter(x))

    def check_output(self, y: object) -> DTensor:
        if not isinstance(y, DTensor):
            raise TypeError(f"stage {self.stage_id} must return one global tensor on its placement, got "
                            f"{type(y).__name__}: build the stage from global parameters and ops, or convert its "
                            "output with tpf.to_global")
        if get_placement(y) != self.placement:
            raise ValueError(f"stage {self.stage_id} returned a tensor on {get_placement(y)}, not on its own "
                             f"placement {self.placement}")
        return y

    def compute(self, x: torch.Tensor) -> DTensor:
        """The module on ``x`` moved onto the placement, on the stage's own ranks (as a pipeline runs it)."""
        x = self.enter(x)
        got = self.compute_block(Block.of(x))
        return self.check_output(self.module(x)) if got is None else from_block(got, self.placement)

    def compute_block(self, x: Block) -> Block | None:
        """The module on this rank's ``Block`` of an input laid out on the placement, without global tensors: the
        output's ``Block``; None where the module must run on global tensors (global parameters of its own, or a
        layout the local paths do not take).

        Args:
            x: this rank's block of the input, its SBPs on the stage's placement and its global shape.

        Returns:
            The output's ``Block``, or None.

        Example::

            >>> from tpflow.global_tensor.blocks import Block
            >>> P = tpf.placement("cpu", ranks=[0, 1])
            >>> _ = torch.manual_seed(0)
            >>> stage = tpf.stage(torch.nn.Linear(8, 4), stage_id=0, placement=P, sbp=tpf.sbp.split(0))
            >>> y = stage.compute_block(Block(torch.ones(3, 8), (tpf.sbp.split(0),), (6, 8)))   # 3 of 6 rows
            >>> y.sbp, y.shape, y.local.shape
            ((sbp.split(dim=0),), (6, 4), torch.Size([3, 4]))
        """
        local, sbps, shape = x
        hierarchy = self.placement.hierarchy
        split = tuple(s == Split(0) and n > 1 for s, n in zip(sbps, hierarchy))
        # a module with buffers (BatchNorm's statistics) may mix rows: on split rows it runs through DTensor
        if self.plain and local.ndim > 0 and all(s == Split(0) or isinstance(s, Broadcast) for s in sbps) \
                and not (any(split) and next(self.module.buffers(), None) is not None):
            with self.reads.reading(self.module, split):
                y = self.module(local)
            out = sbps
        elif self.parallel and isinstance(sbps[-1], Broadcast) and \
                all(s == Split(0) or n == 1 for s, n in zip(sbps[:-1], hierarchy)):
            rows = self._fsdp_rows(sbps)
            if rows > 1 and local.requires_grad:
                local = gradients.scale_grad(local, 1 / rows)
            y = self.module(local)
            if rows > 1 and isinstance(y, torch.Tensor) and y.requires_grad:
                y = gradients.scale_grad(y, rows)
            if hierarchy[-1] > 1 and isinstance(y, torch.Tensor) and is_split([y]):
                raise ValueError(f"stage {self.stage_id} returns this rank's block of a column layer's features: end "
                                 "the stage with a row layer, or give its last column layer gather_output=True")
            out = tuple(s if s == Split(0) else broadcast for s in sbps[:-1]) + (broadcast,)
        else:
            return None
        if not isinstance(y, torch.Tensor) or isinstance(y, DTensor):
            raise TypeError(f"stage {self.stage_id} must return one tensor, got {type(y).__name__}")
        if any(split) and (y.ndim == 0 or y.shape[0] != local.shape[0]):
            raise ValueError(f"stage {self.stage_id} runs data parallel on split(0) rows, so its module must keep "
                             f"one output row per input row: {tuple(local.shape)} -> {tuple(y.shape)}")
        return Block(y, out, (shape[0], *y.shape[1:]) if any(split) else tuple(y.shape))

    def _fsdp_rows(self, sbps: tuple[Sbp, ...]) -> int:
        """Over how many data-parallel ranks the rows are split where FSDP2 shards the module (1 elsewhere): FSDP2
        averages the gradients over its ranks, where the stage's split rows, one batch as on one device, want them
        summed, so the module's output gradient is taken that many times and its input's divided back."""
        if not self.placement.leaves_data_axes:
            return 1
        if isinstance(self, FSDPModule):
            raise TypeError(f"stage {self.stage_id} itself is sharded by FSDP2, but a pipeline runs its module, never "
                            "the stage's own forward: call fully_shard on the stage's blocks and on stage.module")
        rows = 1
        for s, n in zip(sbps[:-1], self.placement.hierarchy[:-1]):
            rows *= n if s == Split(0) else 1
        return rows

    def open_step(self) -> None:
        """A pipeline's step begins: the plain path reads each parameter's block as a plain leaf made once for the
        step (``tpflow.pipeline.plain_reads``)."""
        self.reads.open_step()

    def close_step(self, keep: bool = True) -> None:
        """A pipeline's step ends: the leaves' gradients go to the parameters (``keep=False`` drops them)."""
        self.reads.close_step(keep)

    def weights(self) -> list[torch.Tensor]:
        """What autograd reaches for the stage's parameters: the step's leaves where the plain path read them,
        else the parameters."""
        return self.reads.weights() or list(self.parameters())

    def forward(self, x: torch.Tensor) -> DTensor:
        """Ranks outside the placement skip the module: its first rank sends them the output's shape and SBP,
        and they hold an empty block of it (or raise the stage's error)."""
        x, pl = self.enter(x), self.placement
        outside = [r for r in range(dist.get_world_size()) if r not in pl]
        if not outside:
            return self.compute(x)
        root = pl.flat_ranks[0]
        if pl.coordinate() is None:
            buf = torch.empty(HEADER_BYTES, dtype=torch.uint8)
            comm.post([], [(root, buf)], tag=EAGER_TAG).wait()
            status, shape, dtype, sbps, message, requires_grad = read_header(buf)
            if status == FAILED:
                raise PipelineError(message)
            return off_placement(x, pl, sbps, shape, dtype, requires_grad)
        try:
            y = self.compute(x)
        except Exception as e:
            if dist.get_rank() == root:
                failed = header(FAILED, message=f"stage {self.stage_id} (ranks {pl.ranks}) failed: "
                                                f"{type(e).__name__}: {e}")
                comm.post([(r, failed) for r in outside], [], tag=EAGER_TAG).wait()
            raise
        if dist.get_rank() == root:
            done = header(OK, y.shape, y.dtype, get_sbp(y), requires_grad=y.requires_grad)
            comm.post([(r, done) for r in outside], [], tag=EAGER_TAG).wait()
        return y

    def extra_repr(self) -> str:
        sbp = "" if self.sbp is None else f", sbp={self.sbp}"
        return f"stage_id={self.stage_id}, placement={self.placement.type}:{self.placement.ranks}{sbp}"


def _parallelized(module: nn.Module, placement: Placement) -> bool:
    """Whether every parameter of ``module`` is in a tpflow parallel layer or a replicated module on ``placement``
    (``parallelize``'s work there: on a named placement, on its tensor axis' slice until FSDP2 shards them over the
    whole placement), and there is at least one."""
    found, places = False, (placement, placement.tensor_slice)
    for m in module.modules():
        own = list(m.parameters(recurse=False))
        if not own:
            continue
        if not (isinstance(m, ShardedModule) or replicated_grads(m) is not None) or \
                any(not isinstance(p, DTensor) or get_placement(p) not in places for p in own):
            return False
        found = True
    return found


def stage(module: nn.Module, *, stage_id: int, placement: Placement, sbp: object = None) -> Stage:
    """``module`` as pipeline stage ``stage_id`` on ``placement`` (OneFlow's ``set_stage``): plain parameters
    and buffers are broadcast there, global ones keep their SBP; ``sbp`` is the input's layout on entry.

    The stage's parameters live only on its ranks, and any SBP works inside it: data parallel (a plain
    module on split(0) rows), tensor parallel (column / row layers, or ``parallelize`` applied to the module
    on ``placement``), or both on a 2-D placement. Stages called in order run as one SPMD script (every rank
    calls every stage; ranks outside one skip it); a ``tpf.Pipeline`` runs them over micro-batches, each rank
    only its own stage.

    Args:
        module: the stage's computation: an ``nn.Module`` taking one tensor and returning one. Its parameters
            and buffers are converted in place.
        stage_id: its position in the pipeline, an int from 0; a ``tpf.Pipeline`` needs ids 0, 1, ..., each
            once.
        placement: the ranks that run it (``tpf.placement``), 1-D or 2-D; in a ``tpf.Pipeline`` no rank may
            be in two stages.
        sbp: the input's layout on ``placement``: one SBP for a 1-D placement, else one per placement axis.
            Default None: the incoming SBP where the placements have the same shape, else broadcast; on a named
            placement of several axes (data axes for FSDP2), split(0) over the data axes and broadcast over the last.

    Returns:
        The ``Stage`` module, which holds ``module`` as its ``module``.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> import tpflow as tpf
        >>> stages = [tpf.stage(nn.Sequential(nn.Linear(8, 32), nn.ReLU()), stage_id=0,
        ...                     placement=tpf.placement("cpu", ranks=[0])),
        ...           tpf.stage(nn.Linear(32, 4), stage_id=1, placement=tpf.placement("cpu", ranks=[1]))]
        >>> out = stages[1](stages[0](torch.randn(16, 8)))   # eagerly, stage after stage: every rank calls both
        >>> out.shape, tpf.to_local(out).shape               # on rank 1 (rank 0 holds an empty block)
        (torch.Size([16, 4]), torch.Size([16, 4]))
    """
    return Stage(module, stage_id, placement, sbp)
