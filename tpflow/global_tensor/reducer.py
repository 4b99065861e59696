"""Partial-sum gradients summed by the backward, in buckets as DDP does: as they fill, or when it ends.

Every parameter tpflow adopts gets a hook that runs once autograd has accumulated its gradient. Where that
gradient is a partial sum over mesh axes on which the parameter is broadcast (data parallelism by SBP, a
2-D placement's data axis, a replicated norm's weight under sequence parallelism), it joins its bucket:
parameters that share mesh, layout and dtype, in the reverse of the order tpflow adopted them (about the order
the backward produces their gradients), cut at the ``grad_bucket_bytes`` switch. Once every parameter of a
bucket is in, and every bucket before it has gone, the bucket's flat copy is all-reduced, asynchronously, while
the backward goes on (``grad_sync="backward"``, the default on CUDA, where NCCL sums beside the compute). When the
backward ends, the buckets left go (all of them under ``grad_sync="end"``, the default on CPU ranks, which share
their host's cores with the collectives' threads) and every all-reduce is waited for.

When the backward ends each gradient becomes its sum, a view of its bucket (DDP's ``gradient_as_bucket_view``),
laid out broadcast where it was partial. Micro-batches that should accumulate before one sum run their backward
under ``tpf.gradients.deferred()`` (DDP's ``no_sync``): their gradients stay partial sums, added to for free, and
the first backward outside sums them all; a backward that adds to gradients already summed has DTensor sum its
addition per parameter (correct, slower).

The buckets are laid out from the parameters whose gradients the first backward produced, and again whenever a
backward produces another set: then that backward sums its gradients when it ends. The last eight layouts are kept,
so that models (or parts of one) whose backwards take turns, a GAN's generator and critic, each keep theirs. Every
rank must produce gradients for the same parameters, as DDP requires; a layout is checked to agree across the ranks
when made (a collective).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from tpflow import comm, config
from tpflow.global_tensor.local_blocks import layout_of, placed

if TYPE_CHECKING:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = ["deferred", "summed_axes", "watch"]

_ORDER = "_tpflow_adopted"  # the order tpflow adopted a parameter in: the same order on every rank
_KEY = "_tpflow_grad_key"  # a parameter's last gradient layout object, and its bucket key
_numbers = itertools.count()
_LAYOUTS = 8  # layouts kept per mesh, layout and dtype: models (or parts of one) whose backwards take turns


_REPLACED: list[Callable[[torch.Tensor], None]] = []


def register_gradient_replaced_hook(hook: Callable[[torch.Tensor], None]) -> None:
    """Call ``hook(param)`` each time the backward's buckets or ``reduce_partial_gradients`` give a parameter a new
    gradient tensor (its sum): what a parameter's gradient carries beside its values (a segmented parameter's
    gathers in stored order, ``tpflow.global_tensor.segments``) is given to the new one.

    Args:
        hook: called with the parameter.

    Example::

        >>> register_gradient_replaced_hook(lambda param: None)
        >>> _REPLACED.pop() is not None
        True
    """
    _REPLACED.append(hook)


def gradient_replaced(param: torch.Tensor) -> None:
    """Run the hooks ``register_gradient_replaced_hook`` registered, for ``param``, whose gradient was just replaced
    by its sum.

    Args:
        param: the parameter.

    Example::

        >>> gradient_replaced(torch.nn.Parameter(torch.zeros(2)))
    """
    for hook in _REPLACED:
        hook(param)


def summed_axes(p: torch.Tensor) -> tuple[int, ...]:
    """The mesh axes on which ``p``'s gradient is a partial sum that the broadcast ``p`` wants summed.

    Args:
        p: a parameter.

    Returns:
        The axes, in order; none where ``p`` has no such gradient (a plain tensor's, a split one's, none).

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> layer = tpf.to_global(torch.nn.Linear(4, 2), placement=P)
        >>> with tpf.gradients.deferred():                                  # left partial: split(0) rows
        ...     layer(tpf.randn(6, 4, placement=P, sbp=tpf.sbp.split(0))).sum().backward()
        >>> tpf.gradients.summed_axes(layer.weight)
        (0,)
    """
    g = p.grad
    if not isinstance(g, DTensor) or g.device_mesh.get_coordinate() is None:
        return ()
    return tuple(i for i, (gp, pp) in enumerate(zip(g.placements, p.placements))
                 if type(gp) is Partial and gp.reduce_op == "sum" and isinstance(pp, Replicate))


class _Layout:
    """One key's buckets, in the order they are all-reduced. It holds its parameters weakly: a model dropped is
    freed with its gradients, and a new parameter that takes a dropped one's id is not mistaken for it."""

    def __init__(self, buckets: list[list[torch.Tensor]]) -> None:
        self.buckets = [[weakref.ref(p) for p in bucket] for bucket in buckets]
        self.bucket_of = {id(p): i for i, bucket in enumerate(buckets) for p in bucket}
        self.refs = {id(p): weakref.ref(p) for bucket in buckets for p in bucket}
        self.summed: dict[int, tuple[tuple, DTensorSpec]] = {}  # per parameter: its summed gradient's layout

    def summed_layout(self, p: torch.Tensor, g: DTensor, placements: tuple) -> DTensorSpec:
        """The layout of ``p``'s summed gradient, ``g`` laid out as ``placements``: computed once per parameter."""
        meta = (g.shape, g.stride(), g.dtype)
        known = self.summed.get(id(p))
        if known is None or known[0] != meta:
            known = self.summed[id(p)] = (meta, layout_of(g, placements))
        return known[1]

    def knows(self, p: torch.Tensor) -> bool:
        ref = self.refs.get(id(p))
        return ref is not None and ref() is p

    def alive(self) -> bool:
        return all(ref() is not None for ref in self.refs.values())

    def holds(self, ready: dict[int, torch.Tensor]) -> bool:
        """Whether ``ready`` (id -> parameter) is exactly this layout's parameters."""
        return ready.keys() == self.refs.keys() and all(self.knows(p) for p in ready.values())

    def bucket(self, i: int) -> list[torch.Tensor]:
        return [ref() for ref in self.buckets[i]]


def _cut(params: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """``params`` (in order) cut into buckets of at most ``limit`` bytes of gradient (one at least)."""
    buckets: list[list[torch.Tensor]] = [[]]
    filled = 0
    for p in params:
        nbytes = p.grad.to_local().nbytes
        if buckets[-1] and filled + nbytes > limit:
            buckets.append([])
            filled = 0
        buckets[-1].append(p)
        filled += nbytes
    return buckets


def _fingerprint(p: torch.Tensor) -> str:
    """A parameter known by its block's shape and values: alike on the ranks it is broadcast over."""
    block = p.to_local().detach().double()
    return f"{'x'.join(map(str, block.shape))}:{block.sum().item().hex()}:{block.square().sum().item().hex()}"


def _agreed_order(params: list[torch.Tensor], key: tuple) -> list[torch.Tensor]:
    """``params`` in the reverse adoption order of the first rank of the key's axes (the order the backward about
    produces them), the same on every rank: a rank may have adopted tied weights in another order. Raises on every
    rank where the ranks hold other parameters."""
    mine = sorted(params, key=lambda q: -getattr(q, _ORDER))
    prints = [_fingerprint(p) for p in mine]
    groups = [key[0].get_group(axis) for axis in key[3]]
    shapes = " ".join(sorted(f.split(":")[0] for f in prints))
    values = hashlib.sha1(" ".join(sorted(prints)).encode()).hexdigest()[:12]
    comm.agree("tpflow.gradients", {"gradients summed in the backward": shapes, "their parameters' values": values},
               groups, "every rank must compute gradients for the same parameters (as DDP requires), from the same "
               "values")
    first = [prints]
    for group in groups:  # the first rank's order: that of the rank at coordinate 0 on every axis
        dist.broadcast_object_list(first, src=dist.get_global_rank(group, 0), group=group)
    places: dict[str, list[int]] = {}
    for i, f in enumerate(first[0]):
        places.setdefault(f, []).append(i)
    taken = {f: iter(v) for f, v in places.items()}
    return [p for _, p in sorted(((next(taken[f]), i), p) for i, (f, p) in enumerate(zip(prints, mine)))]


class _Backward:
    """What the hooks gather during one backward, and the buckets' layouts from one backward to the next."""

    def __init__(self) -> None:
        self.layouts: dict[tuple, list[_Layout]] = {}  # per key, the latest ones last (models trained in turn)
        self.deferred = 0
        self._reset()

    def _reset(self) -> None:
        self.ready: dict[tuple, dict[int, torch.Tensor]] = {}
        self.missing: dict[tuple, list[int]] = {}  # per key, how many parameters each bucket still waits for
        self.launched: dict[tuple, int] = {}  # per key, the buckets all-reduced so far, in order
        self.chosen: dict[tuple, _Layout | None] = {}  # per key, the layout this backward follows
        self.flights: list[tuple] = []
        self.task: int | None = None  # the backward whose end runs ``finish``

    def ready_grad(self, p: torch.Tensor) -> None:
        if self.deferred:
            return
        key = self._key(p)
        if key is None:
            return
        sync = config.get("grad_sync", key[0].device_type)
        if sync == "step":
            return
        task = torch._C._current_graph_task_id()
        if task != self.task:
            self._reset()  # what a backward that raised left behind
            self.task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        self.ready.setdefault(key, {})[id(p)] = p
        if key not in self.chosen:  # the latest layout with this parameter in it
            self.chosen[key] = next((lay for lay in reversed(self.layouts.get(key, [])) if lay.knows(p)), None)
        layout = self.chosen[key]
        if sync == "end" or layout is None or not layout.knows(p):
            return  # summed when the backward ends (a parameter the layout does not know: this backward's all)
        missing = self.missing.setdefault(key, [len(b) for b in layout.buckets])
        missing[layout.bucket_of[id(p)]] -= 1
        n = self.launched.get(key, 0)
        while n < len(layout.buckets) and missing[n] == 0:
            self._launch(key, layout.bucket(n))
            n += 1
        self.launched[key] = n

    @staticmethod
    def _key(p: torch.Tensor) -> tuple | None:
        """The bucket key of ``p``'s gradient (mesh, layout, dtype, summed axes), None where nothing is summed: kept
        on ``p`` per gradient layout (the hot paths make each backward's gradients from one layout object)."""
        g = p.grad
        spec = g._spec if isinstance(g, DTensor) else None
        known = getattr(p, _KEY, None)
        if known is None or known[0] is not spec or spec is None:
            axes = summed_axes(p)
            known = (spec, (g.device_mesh, g.placements, g.dtype, axes) if axes else None)
            if spec is not None:
                setattr(p, _KEY, known)
        return known[1]

    @torch.no_grad()
    def _launch(self, key: tuple, bucket: list[torch.Tensor]) -> None:
        mesh, axes = key[0], key[3]
        grads = [p.grad for p in bucket]
        flat, work = comm.all_reduce_cat([g.to_local() for g in grads], mesh.get_group(axes[0]), async_op=True)
        for axis in axes[1:]:
            work.wait()  # the axes' groups are separate streams: one sum after the other
            work = comm.all_reduce(flat, mesh.get_group(axis), async_op=True)
        self.flights.append((work, flat, bucket, grads, key))

    @torch.no_grad()
    def finish(self) -> None:
        try:
            made: dict[tuple, _Layout] = {}
            for key, ready in self.ready.items():
                layout, launched = self.chosen.get(key), self.launched.get(key, 0)
                if layout is not None and layout.holds(ready):
                    for i in range(launched, len(layout.buckets)):
                        self._launch(key, layout.bucket(i))
                    made[key] = layout
                    continue
                gone = {id(p) for i in range(launched) for p in layout.bucket(i)}  # launched: all alive
                order = _agreed_order(list(ready.values()), key)
                made[key] = _Layout(_cut(order, config.get("grad_bucket_bytes")))
                for bucket in _cut([p for p in order if id(p) not in gone], config.get("grad_bucket_bytes")):
                    self._launch(key, bucket)
            for key, layout in made.items():  # the one used last goes last; a layout of a dropped model goes
                kept = [lay for lay in self.layouts.get(key, []) if lay is not layout and lay.alive()]
                self.layouts[key] = (kept + [layout])[-_LAYOUTS:]
            for work, flat, bucket, grads, key in self.flights:
                work.wait()
                layout, (_, placements, _, axes) = made[key], key
                summed = tuple(Replicate() if i in axes else pl for i, pl in enumerate(placements))
                offset = 0
                for p, g in zip(bucket, grads):
                    block = g.to_local()
                    view = flat[offset:offset + block.numel()].view(block.shape)
                    p.grad = placed(view, layout.summed_layout(p, g, summed))
                    offset += block.numel()
                    gradient_replaced(p)
        finally:
            self._reset()


_BACKWARD = _Backward()


def watch(param: torch.Tensor) -> None:
    """Give ``param`` its order among tpflow's parameters and the hook that sums its partial gradient during the
    backward (see the module's docstring); ``tpf.gradients.adopt`` calls it.

    Args:
        param: a parameter tpflow made (a DTensor ``nn.Parameter``).

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> w = torch.nn.Parameter(tpf.zeros(4, placement=P, sbp=tpf.sbp.broadcast))
        >>> tpf.gradients.watch(w)
    """
    if hasattr(param, _ORDER):
        return
    setattr(param, _ORDER, next(_numbers))
    if param.requires_grad:
        param.register_post_accumulate_grad_hook(_BACKWARD.ready_grad)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Backwards run inside leave their partial gradients to the optimizer's step (DDP's ``no_sync``): for every
    micro-batch of a step but the last, so that the buckets are summed once, by the last backward.

    Returns:
        A context manager; backwards inside it (on any thread) sum nothing.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> layer = tpf.to_global(torch.nn.Linear(4, 2), placement=P)
        >>> with tpf.gradients.deferred():
        ...     layer(tpf.randn(6, 4, placement=P, sbp=tpf.sbp.split(0))).sum().backward()
        >>> tpf.get_sbp(layer.weight.grad)
        (sbp.partial_sum,)
        >>> layer(tpf.randn(6, 4, placement=P, sbp=tpf.sbp.split(0))).sum().backward()   # sums both
        >>> tpf.get_sbp(layer.weight.grad)
        (sbp.broadcast,)
    """
    _BACKWARD.deferred += 1
    try:
        yield
    finally:
        _BACKWARD.deferred -= 1
