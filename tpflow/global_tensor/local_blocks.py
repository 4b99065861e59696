"""Parameters' local blocks on the eager hot path: read as one autograd node, laid out side by side, and made
into DTensors again cheaply.

``DTensor.to_local`` re-derives the gradient's global layout on every call (two autograd functions
per parameter: 0.15-0.3 ms a parameter per step on a 2-core CPU, by torch.profiler). ``LocalBlocks``
reads a module's parameter blocks through one autograd function and wraps each gradient with a
layout computed once per parameter. ``join`` puts blocks back to back in one storage, so that sibling
layers' weights can be read as one tensor (fused column groups). ``layout_of`` and ``placed`` make a DTensor
from a block and a layout computed once, with no autograd function and no checks (``DTensor.from_local`` runs
both on every call). This is the one module of tpflow that touches DTensor's internals (``_spec``,
``_local_tensor``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor, Placement

if TYPE_CHECKING:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

__all__ = ["LocalBlocks", "LocalReads", "join", "layout_of", "picklable", "placed"]


def _owned(g: torch.Tensor) -> torch.Tensor:
    """``g`` contiguous, in a storage of its own: a fused group's gradient is a slice of one buffer, which would
    stay alive with it, and a DTensor whose block is such a slice cannot be deep-copied."""
    g = g.contiguous()
    return g if g.untyped_storage().nbytes() == g.numel() * g.element_size() else g.clone()


class _Blocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, grad_specs, *params):
        ctx.grad_specs = grad_specs
        ctx.set_materialize_grads(False)  # an unused block's gradient stays None
        blocks = tuple(p._local_tensor.view_as(p._local_tensor) for p in params)
        frozen = [b for b, p in zip(blocks, params) if not p.requires_grad]
        if frozen:  # no weight gradient is computed for a frozen weight
            ctx.mark_non_differentiable(*frozen)
        return blocks

    @staticmethod
    def backward(ctx, *grads):
        return None, *(None if g is None else placed(_owned(g), spec) for g, spec in zip(grads, ctx.grad_specs))


def layout_of(t: DTensor, placements: Sequence[Placement]) -> DTensorSpec:
    """``t``'s layout (mesh, global shape, strides, dtype) with ``placements`` instead of its own: computed once, it
    makes DTensors of that layout cheaply (``placed``).

    Args:
        t: a DTensor.
        placements: DTensor placements, one per mesh axis.

    Returns:
        The layout, for ``placed``.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> g = tpf.zeros(4, 3, placement=P, sbp=tpf.sbp.partial_sum)
        >>> from torch.distributed.tensor import Replicate
        >>> placed(torch.ones(4, 3), layout_of(g, [Replicate()])).placements
        (Replicate(),)
    """
    return dataclasses.replace(t._spec, placements=tuple(placements))


def placed(block: torch.Tensor, layout: DTensorSpec) -> DTensor:
    """A DTensor (no gradient) whose local block is ``block``, laid out as ``layout`` (``layout_of``), with no
    checks and no autograd node: the block must be this rank's part of the layout.

    Args:
        block: this rank's block.
        layout: the DTensor's layout.

    Returns:
        The DTensor, sharing ``block``'s memory.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> w = tpf.zeros(4, 6, placement=P, sbp=tpf.sbp.split(1))
        >>> placed(torch.ones(4, 3), layout_of(w, w.placements)).shape     # the global shape
        torch.Size([4, 6])
    """
    return DTensor(block, layout, requires_grad=False)


class LocalBlocks:
    """Reads the local blocks of a module's DTensor parameters, differentiably, with each gradient laid out as
    ``grad_placements(param)`` says; the layouts are cached per ``key`` and recomputed when a parameter is
    replaced or converted.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> layer = tpf.ColumnParallelLinear(4, 6, placement=P)   # weight split(0): 3 of its 6 rows a rank
        >>> blocks = LocalBlocks()
        >>> w, b = blocks((layer.weight, layer.bias), key=(), grad_placements=lambda p: p.placements)
        >>> w.shape, b.shape
        (torch.Size([3, 4]), torch.Size([3]))
        >>> w.sum().backward()
        >>> layer.weight.grad.placements                           # as grad_placements said
        (Shard(dim=0),)
    """

    def __init__(self) -> None:
        self._specs: dict[Hashable, tuple[tuple, tuple]] = {}  # key -> (the parameters' specs, their gradients')

    def __call__(self, params: Sequence[DTensor], key: Hashable,
                 grad_placements: Callable[[DTensor], tuple]) -> tuple[torch.Tensor, ...]:
        """This rank's blocks of ``params``, as autograd sees them.

        Args:
            params: DTensor parameters.
            key: what ``grad_placements`` depends on besides the parameters.
            grad_placements: the DTensor placements of a parameter's gradient.

        Returns:
            The local blocks, in order.
        """
        if not params:
            return ()
        if not torch.is_grad_enabled() and not torch.compiler.is_compiling():  # decoding: no node to build
            return tuple(p._local_tensor for p in params)
        if torch.compiler.is_compiling():  # traced code takes DTensor's own path
            return tuple(p.to_local(grad_placements=grad_placements(p)) for p in params)
        specs, grad_specs = self._specs.get(key, ((), ()))
        if len(specs) != len(params) or any(spec is not p._spec for spec, p in zip(specs, params)):
            specs = tuple(p._spec for p in params)
            grad_specs = tuple(layout_of(p, grad_placements(p)) for p in params)
            self._specs[key] = (specs, grad_specs)
        return _Blocks.apply(grad_specs, *params)


class LocalReads:
    """Around each call of a module, its DTensor parameters ``names`` read as their local blocks (``LocalBlocks``),
    so that its unchanged forward computes on local tensors: ``enter`` before it (the blocks are found before
    ``nn.Module.__getattr__`` looks in ``_parameters``), ``leave`` after it.

    Args:
        names: the module's own parameter names.
        grad_placements: each parameter's gradient layout (DTensor placements).

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> norm = torch.nn.LayerNorm(4)
        >>> norm.weight = torch.nn.Parameter(tpf.ones(4, placement=P, sbp=tpf.sbp.broadcast))
        >>> reads = LocalReads(["weight"], lambda p: p.placements)
        >>> type(reads.enter(norm)[0]).__name__, type(norm.weight).__name__
        ('Tensor', 'Tensor')
        >>> reads.leave(norm)
        >>> type(norm.weight).__name__
        'DTensor'
    """

    def __init__(self, names: Sequence[str], grad_placements: Callable[[DTensor], tuple]) -> None:
        self.names, self.grad_placements = list(names), grad_placements
        self.blocks = LocalBlocks()

    def enter(self, module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
        """Put the local blocks in place of the parameters; returns them."""
        views = self.blocks([module._parameters[n] for n in self.names], key=None,
                            grad_placements=self.grad_placements)
        for name, view in zip(self.names, views):
            module.__dict__[name] = view
        return views

    def leave(self, module: torch.nn.Module) -> None:
        """The parameters themselves again."""
        for name in self.names:
            module.__dict__.pop(name, None)


def _adjacent(blocks: Sequence[torch.Tensor]) -> bool:
    """Whether ``blocks`` (2-D, rows of one width) lie back to back, in order, contiguous in one storage."""
    storage, offset = blocks[0].untyped_storage().data_ptr(), blocks[0].storage_offset()
    for b in blocks:
        if not b.is_contiguous() or b.untyped_storage().data_ptr() != storage or b.storage_offset() != offset:
            return False
        offset += b.numel()
    return True


def join(params: Sequence[DTensor]) -> None:
    """Move the local blocks of ``params`` (2-D, rows of one width) back to back into one storage, keeping their
    values and identities, unless they already lie so: at the start, and again after a conversion
    (``model.double()``, a deep copy) gave them storages of their own.

    Args:
        params: DTensor parameters whose blocks have the same number of columns.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> q, k, v = (tpf.ColumnParallelLinear(8, n, placement=P) for n in (8, 4, 4))
        >>> join([q.weight, k.weight, v.weight])
        >>> _adjacent([q.weight.to_local(), k.weight.to_local(), v.weight.to_local()])   # one storage, in order
        True
    """
    blocks = [p._local_tensor for p in params]
    if not _adjacent(blocks):
        joined = torch.cat([b.detach().contiguous() for b in blocks]).untyped_storage()
        offset = 0
        with torch.no_grad():
            for b in blocks:
                b.set_(joined, offset, b.shape)
                offset += b.numel()


class _Copied(DTensor):
    """A DTensor pickled as a copy of its block: torch (2.13) pickles a DTensor whose block starts at an offset of its
    storage (a joined group's member but the first) by its wrapper's storage, which it has none of ("Attempted to
    access the data pointer on an invalid python storage")."""

    __slots__ = ()

    def __reduce_ex__(self, proto):
        block = self._local_tensor
        copy = DTensor.from_local(block.clone(), self.device_mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=self.stride())
        return copy.__reduce_ex__(proto)


def picklable(t: torch.Tensor) -> torch.Tensor:
    """``t`` made picklable by ``torch.save`` where its block starts at an offset of a joined storage (see ``join``):
    the same tensor, which pickles a copy of its block (and loads as a plain DTensor); any other tensor as it is.

    Args:
        t: a tensor, such as a value of a ``state_dict()``.

    Returns:
        ``t``.

    Example::

        >>> import io
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> q, k = (tpf.ColumnParallelLinear(8, n, placement=P) for n in (8, 4))
        >>> join([q.weight, k.weight])                              # k's block after q's, in one storage
        >>> buffer = io.BytesIO()
        >>> torch.save(picklable(k.weight.detach()), buffer)         # without it: "invalid python storage"
        >>> _ = buffer.seek(0)
        >>> torch.equal(torch.load(buffer, weights_only=True).to_local(), k.weight.to_local())
        True
    """
    if type(t) is DTensor and t._local_tensor.storage_offset() != 0 and not isinstance(t, torch.nn.Parameter):
        t.__class__ = _Copied
    return t
