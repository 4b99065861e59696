"""What a parallel mode of the harness is: a ``Trainer`` (one training step of a workload on this rank, the
parameters it holds, the fewest bytes its layout must send), built in a ``Context``, or ``Skip`` with the
reason; and the pieces the modes build their steps from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import tpflow as tpf

__all__ = ["LR", "Context", "Skip", "Trainer", "block_bytes", "forward_backward", "make_trainer", "rows_share"]

LR = 0.05


class Skip(Exception):
    """The mode cannot run this workload on this world; the message says why.

    A mode raises it from :func:`build`; the harness (``python -m tpflow.bench``) then lists the mode as
    skipped, with the message, and runs the others.

    Args:
        *args: as for any exception: one message, saying why. Keyword arguments are not accepted.

    Example::

        >>> from tpflow.bench.modes import build
        >>> from tpflow.bench.workloads import build as build_workload
        >>> w = build_workload("mlp", dim=32, hidden=64, depth=4, tokens=64, seq=8, heads=8, kv_heads=4)
        >>> try:
        ...     build("data, DDP", w, Context(world=3, rank=0, device=torch.device("cpu")))
        ... except Skip as why:
        ...     print(why)
        DDP averages the ranks' gradients, which is the batch's only when its 64 samples split evenly over 3 ranks
    """


@dataclass
class Context:
    """Where a mode runs: the world's size, this rank, its device, and the pipelines' micro-batches.

    Every mode builds on this; ``placement(ranks)`` is a ``tpf.placement`` of ``ranks`` on the device's type.

    Args:
        world: the number of ranks in the job.
        rank: this process's rank, 0..world-1.
        device: this rank's device: ``cuda:<local rank>``, or the CPU.
        micro_batches: micro-batches per pipeline step; None for 2 per stage.

    Example::

        >>> ctx = Context(world=2, rank=tpf.get_rank(), device=torch.device("cpu"))
        >>> ctx.placement(range(ctx.world))
        placement(type="cpu", ranks=[0, 1])
    """

    world: int
    rank: int
    device: torch.device
    micro_batches: int | None = None  # per pipeline; None: 2 per stage

    def placement(self, ranks: Sequence, names: Sequence[str] | None = None) -> tpf.Placement:
        return tpf.placement(self.device.type, list(ranks), names=names)


def block_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of this rank's blocks of ``tensors`` (global or plain).

    A DTensor counts its local block (``to_local()``), a plain tensor all of itself.

    Args:
        tensors: DTensors and plain tensors, e.g. a mode's parameters.

    Returns:
        The sum of the blocks' ``nbytes``.

    Example::

        >>> block_bytes([torch.zeros(4, 8), torch.zeros(8)])
        160
    """
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


@dataclass
class Trainer:
    """One training step (``step()`` returns this rank's share of the loss, or None; it leaves no gradients
    behind), the parameters this rank holds, the bytes it keeps between steps besides them (``state_bytes``:
    DDP's buckets), and the fewest bytes it must send per step (``minimum``).

    What every mode's builder returns, so that the harness times, counts and profiles the modes alike;
    ``param_bytes()`` is :func:`block_bytes` of ``params``.

    Args:
        step: one training step, with no arguments; returns this rank's share of the loss (the shares over
            the ranks sum to the loss), or None where this rank reports no share.
        params: the parameters this rank trains (DTensors or plain tensors).
        minimum: the fewest bytes this rank must send per step for the mode's layout.
        ranks: the ranks the mode runs on.
        state_bytes: the bytes kept between steps besides the parameters (DDP's buckets); 0 for the others.
        torch_groups: the process groups on which torch's own code (FSDP2) runs collectives the harness counts
            (``tpflow.bench.measure.counting``); none for the others.
        grad_bytes: the bytes of this rank's gradient blocks after a step's backward (``make_trainer``'s step
            records them on its first step); None before.

    Example::

        >>> idle = Trainer(step=lambda: None, params=[], minimum=0, ranks=[0])  # one device's, off rank 0
        >>> idle.step() is None, idle.param_bytes()
        (True, 0)
        >>> from tpflow.bench.modes import build
        >>> from tpflow.bench.workloads import build as build_workload
        >>> w = build_workload("mlp", dim=32, hidden=64, depth=4, tokens=64, seq=8, heads=8, kv_heads=4)
        >>> trainer = build("data, DDP", w, Context(world=2, rank=tpf.get_rank(), device=torch.device("cpu")))
        >>> trainer.step()                                # on rank 0: its share of the loss
        tensor(1.2341)
        >>> trainer.param_bytes(), trainer.state_bytes    # DDP's buckets: one more copy of the parameters
        (67072, 67072)
    """

    step: Callable[[], torch.Tensor | None]
    params: list[torch.Tensor]
    minimum: int
    ranks: list[int] = field(default_factory=list)
    state_bytes: int = 0
    torch_groups: list = field(default_factory=list)
    grad_bytes: int | None = None

    def param_bytes(self) -> int:
        return block_bytes(self.params)


def make_trainer(params: list[torch.Tensor], forward_backward: Callable[[], torch.Tensor | None], minimum: int,
                 ranks: Sequence[int], after_backward: Callable[[], None] | None = None) -> Trainer:
    """A ``Trainer`` whose step is ``forward_backward()`` (returning the loss share), ``after_backward()``, an SGD
    step, then the gradients freed: between steps a rank holds only its parameters (and state), so a step's peak
    is measured from there.

    Args:
        params: the parameters this rank trains (global or plain).
        forward_backward: the forward and backward of one step, returning this rank's share of the loss.
        minimum: the fewest bytes this rank must send per step for the mode's layout.
        ranks: the ranks the mode runs on.
        after_backward: work between the backward and the optimizer step (a gradient all-reduce).

    Returns:
        The trainer.

    Example::

        >>> model = torch.nn.Linear(3, 1, bias=False)
        >>> _ = torch.nn.init.ones_(model.weight)
        >>> mode = make_trainer([model.weight], forward_backward(model, torch.ones(4, 3), torch.zeros(4, 1)), 0, [0])
        >>> mode.step(), mode.step()                       # SGD at lr 0.05: the weight goes from 1 to 0.7
        (tensor(9.), tensor(4.4100))
        >>> model.weight.grad is None                      # freed after each step
        True
    """
    opt = torch.optim.SGD(params, lr=LR)

    def step():
        share = forward_backward()
        if after_backward is not None:
            after_backward()
        if trainer.grad_bytes is None:  # the same every step: once
            trainer.grad_bytes = block_bytes(p.grad for p in params if p.grad is not None)
        opt.step()
        opt.zero_grad()
        return share
    trainer = Trainer(step, params, minimum, list(ranks))
    return trainer


def rows_share(total: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss of a rank's rows: their share of the mean squared error over ``total`` elements, so that
    the shares over split rows sum to the loss (a mean over uneven blocks would weight them wrongly).

    Args:
        total: the number of elements of the whole batch's target.

    Returns:
        ``loss_fn(y, target)`` for ``forward_backward``.

    Example::

        >>> rows_share(8)(torch.ones(2, 2), torch.zeros(2, 2))
        tensor(0.5000)
    """
    return lambda y, target: (y - target).square().sum() / total


def forward_backward(model: Callable, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable = F.mse_loss,
                     weight: float = 1.0) -> Callable[[], torch.Tensor | None]:
    """The loss of ``model(x)`` against ``y`` and its backward; the step's share of the loss is the value (its
    local block) times ``weight``, None where the weight is 0 (a copy of a loss another rank reports).

    Args:
        model: what computes the output (a module, a DDP wrapper, a stage).
        x, y: this rank's inputs and targets.
        loss_fn: the loss of ``(output, target)``.
        weight: the share of the loss this rank reports.

    Returns:
        A function running one forward and backward, returning the share.

    Example::

        >>> run = forward_backward(torch.nn.Linear(3, 1), torch.ones(4, 3), torch.zeros(4, 1))
        >>> run().shape
        torch.Size([])
    """
    def run():
        loss = loss_fn(model(x), y)
        loss.backward()
        value = loss.detach()
        return None if weight == 0 else (value.to_local() if isinstance(value, DTensor) else value) * weight
    return run
