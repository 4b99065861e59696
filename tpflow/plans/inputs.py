"""The tensor-parallel ranks of a parallelized model must be fed the same data: checked where it is first read.

A column layer, a vocabulary-split embedding or a row layer splitting its own input computes on this rank's
block of the weights and the whole input; ranks fed different rows (a ``DistributedSampler`` over the
tensor-parallel ranks, unseeded random ids) would train on a mixture of them without an error. The first such
layer of the model gets a hook that all-gathers a digest of its input over the tensor-parallel ranks (two
float64 sums and its shape, with the module's training flag and a digest of the random state: 56 bytes) and raises
the same error on every rank when they differ. The ``check_inputs`` switch says when: the first call of each of the
first 8 input shapes (``first``, the default: a training loop's first step, a generation's first steps), every call
(``always``), or never (``off``).

The training flag is compared too: a rank left in ``model.eval()`` while the others train computes other values
(dropout, training-only code paths) and is named as such. A model with dropout, in training, compares the ranks'
random states as well: the tensor-parallel ranks must draw alike, or their dropout would drop different values of
activations that must be equal, and the replicated parameters would drift apart. Since a rank can drift off at any
step (a ``torch.rand`` on one rank only), such a model's check runs on every call with gradients on (a training
step), whatever the switch's shapes: one all-gather of 56 bytes a step (through shared memory between the CPU
ranks of one host), and on CUDA one read of it by the host.
The decision to check depends only on what every rank shares (the model, the switch, the input's shape, grad mode),
so that all ranks exchange on the same calls, whatever mode each is in.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow import config
from tpflow.comm import shm
from tpflow.placement import Placement

__all__ = ["InputCheck", "check_inputs", "draws_random"]

SHAPES = 8  # input shapes checked under "first": then the hook costs a dict lookup a call


def _digest(x: torch.Tensor) -> torch.Tensor:
    """Four float64 numbers that differ, in practice, for different shapes, values or orders of ``x``."""
    flat = x.detach().reshape(-1).to(torch.float64)
    positions = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64).remainder_(1021)
    shape = torch.tensor([x.ndim, sum(n * 1021 ** d for d, n in enumerate(x.shape))], dtype=torch.float64,
                         device=flat.device)
    return torch.cat([torch.stack([flat.sum(), (flat * positions).sum()]), shape])


class InputCheck:
    """Whether the ranks of one axis of a placement read the same input: the input's digest (its shape too), the
    module's training flag and, for a model that draws random numbers, a digest of the random state, all-gathered
    over the axis and compared, when the ``check_inputs`` switch says so, the same error on every rank if they differ
    (it keeps the placement, not the group, so that a copy or a pickle of the model takes it along).

    Args:
        name: what reads the input, named in the error.
        placement: the ranks.
        axis: the axis whose ranks must agree (default: the last, the tensor-parallel one).
        kind: the axis' name in the error.
        random: the model drops out values in training (``draws_random``): every call with gradients on is checked,
            the random states with the rest.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> check = InputCheck("model", P, kind="context-parallel")
        >>> check.check(torch.ones(2, 3))                     # the same on both ranks: nothing happens
    """

    def __init__(self, name: str, placement: Placement, axis: int = -1, kind: str = "tensor-parallel",
                 random: bool = False) -> None:
        self.name, self.placement, self.axis, self.kind, self.seen = name, placement, axis % placement.ndim, kind, set()
        self.random = random
        self.alike = 0  # the calls whose random states were found alike: a later difference is a drift

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.check(args[0] if args else None, training=module.training)

    def check(self, x: object, always: bool = False, training: bool = False) -> None:
        """Compare ``x``'s digest over the axis (a plain tensor, on the calls the switch names; else nothing).

        Args:
            x: the input this rank read.
            always: on every call unless the switch is ``off`` (where ranks may be fed inputs of different shapes,
                which would make them choose differently under ``first``).
            training: whether the module that reads it is in training mode (compared; with ``random``, the ranks'
                random states are compared too, since ranks that draw apart drop different values of tensors that
                must be equal).
        """
        mode = config.get("check_inputs")
        if mode == "off" or not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return
        key = (tuple(x.shape), x.dtype)
        every_step = self.random and torch.is_grad_enabled()  # a drift of the random states may come at any step
        if mode == "first" and not always and not every_step and (key in self.seen or len(self.seen) >= SHAPES):
            return  # the steady state of a model without dropout: this lookup is all a call costs
        if torch.compiler.is_compiling() or self.placement.coordinate() is None \
                or self.placement.hierarchy[self.axis] == 1:
            return
        if len(self.seen) < SHAPES:
            self.seen.add(key)
        drawing = self.random and training
        state = _random_state(x.device) if drawing else torch.zeros(2, dtype=torch.float64, device=x.device)
        flag = torch.tensor([float(training)], dtype=torch.float64, device=x.device)
        mine = torch.cat([_digest(x), flag, state])
        group = self.placement.mesh.get_group(self.axis)
        every = mine.new_empty((dist.get_world_size(group), mine.numel()))
        host = shm.host_group(group) if shm.carries(mine) else None
        if host is not None:  # CPU ranks of one host: shared memory, not gloo's hand-off (a check: not counted)
            host.all_gather(every, mine)
        else:
            dist.all_gather(list(every), mine, group=group)
        digests = [tuple(d) for d in every.tolist()]
        if len(set(digests)) == 1:
            self.alike += drawing
            return
        ranks = dist.get_process_group_ranks(group)
        raise ValueError(self._verdict(digests, ranks, list(x.shape)))

    def _verdict(self, digests: list[tuple], ranks: list[int], shape: list[int]) -> str:
        """What differs between the ranks' digests (input 4, training flag 1, random state 2), said for the user."""
        differ = [r for r, d in zip(ranks, digests) if d[:4] != digests[0][:4]]
        training = [r for r, d in zip(ranks, digests) if d[4]]
        if 0 < len(training) < len(ranks):
            evaluating = [r for r in ranks if r not in training]
            return (f"the {self.kind} ranks {ranks} run {self.name!r} in different modes: ranks {training} are "
                    f"training (model.train()), ranks {evaluating} evaluating (model.eval()). Call model.train() or "
                    f"model.eval() on every {self.kind} rank alike: dropout and other training-only code would "
                    f"compute other values of activations that must be equal on every rank")
        if differ:
            return (f"the {self.kind} ranks {ranks} were fed different inputs: {self.name!r} read other values on "
                    f"ranks {differ} than on rank {ranks[0]} (shape {shape}). Every rank of a {self.kind} "
                    f"group computes on the same batch: shard the data over the data-parallel ranks only (a "
                    f"DistributedSampler with the data-parallel size and coordinate, not the world's), and seed "
                    f"random inputs alike on every rank")
        apart = [r for r, d in zip(ranks, digests) if d[5:] != digests[0][5:]]
        how = (f"their random states drifted apart after {self.alike} checked calls that drew alike: a rank drew "
               f"random numbers the others did not (a torch.rand, a shuffle or a sampler on some ranks only)"
               if self.alike else "they were seeded apart")
        return (f"the {self.kind} ranks {ranks} draw different random numbers: {how}. The model has dropout in "
                f"training, and ranks {apart} would drop other values than rank {ranks[0]} of activations that "
                f"must be equal on every rank (its replicated parameters would drift apart without an error). Seed "
                f"every {self.kind} rank alike (torch.manual_seed with the same seed; seeds may differ over the "
                f"data-parallel ranks only), and draw the same random numbers on them between the model's calls "
                f"(rank-specific ones from a torch.Generator of their own)")


def _random_state(device: torch.device) -> torch.Tensor:
    """Two float64 numbers that differ, in practice, for different states of the generator ``device`` draws from."""
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    values = state.to(torch.float64)
    positions = torch.arange(1, values.numel() + 1, dtype=torch.float64).remainder_(1021)
    return torch.stack([values.sum(), (values * positions).sum()]).to(device)


_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def draws_random(model: nn.Module) -> bool:
    """Whether ``model`` drops out values in training: a dropout module with ``p > 0``, or a Hugging Face config's
    dropout probability above 0 (``attention_dropout``, ``resid_pdrop``, ...), which its code passes to functional
    dropout: the config of any module inside it (a model wrapped in a module of the user's holds it).

    Args:
        model: any model.

    Returns:
        True or False.

    Example::

        >>> draws_random(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))), draws_random(nn.Linear(4, 4))
        (True, False)
    """
    if any(isinstance(m, _DROPOUTS) and m.p > 0 for m in model.modules()):
        return True
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
               for c in configs.values() for k, v in getattr(c, "__dict__", {}).items()
               if k.endswith(("dropout", "pdrop")))


def check_inputs(module: nn.Module, name: str, placement: Placement, random: bool = False) -> None:
    """Check, on its calls, that ``module`` (a layer reading whole data) gets the same input on every
    tensor-parallel rank of ``placement`` (the ``check_inputs`` switch says on which calls).

    Args:
        module: the model's first layer that must read the same data on every tensor-parallel rank.
        name: its name in the model, for the error.
        placement: its placement; the last axis is tensor parallel. One rank there, or a rank outside it: no check.
        random: the model drops out values in training (``draws_random``): every call with gradients on is
            checked, and in training the ranks' random states are compared too.

    Example::

        >>> from torch import nn
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> model = tpf.parallelize(nn.Sequential(nn.Linear(4, 6)), placement=P, plan={"0": "column"})
        >>> x = torch.full((2, 4), float(tpf.get_rank()))     # each rank its own rows: a mistake
        >>> model(x)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        ValueError: the tensor-parallel ranks [0, 1] were fed different inputs: '0' read other values on ranks [1] ...
    """
    coord = placement.coordinate()
    if coord is None or placement.hierarchy[-1] == 1:
        return
    module.register_forward_pre_hook(InputCheck(name, placement, random=random))
