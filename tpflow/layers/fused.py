"""Column layers that read one input, run as one product: q / k / v, gate / up.

Megatron concatenates such weights in the model's code. Here the model keeps its separate layers (and its
checkpoints their names): the first member called on an input computes every member's output in one
product over the members' weight blocks, and the others take theirs when called on the same input. The
input then crosses the ranks once instead of once per member: one all-reduce of its gradient (with
sequence parallelism one all-gather ring forward and one reduce-scatter ring backward), overlapping one
larger matmul. The weight blocks live back to back in one storage, as Megatron's fused weight does, so the
product reads them as one tensor and saves no copy of them for the backward; the parameters stay the
members' own.

The pending outputs live until the members have taken them or the parent module's next forward starts
(a pre-hook clears them), so an output is never handed out from another forward pass. A member called
again on the input, or on another one, starts a new product: the result is right in every calling
pattern, and the saving is there when the members read the same input (self-attention, SwiGLU).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from tpflow.global_tensor.local_blocks import join, picklable
from tpflow.layers.column import ColumnParallelLinear

__all__ = ["ColumnGroup"]


class ColumnGroup:
    """Column layers of one parent module computed as one product (see the module docstring).

    The first member called on an input computes every member's output; the others take theirs when called
    on the same input, so the input (and its gradient) crosses the ranks once for the group. Making a group
    joins the members' weight blocks into one storage and sets each member's ``fused_group``.
    ``parallelize`` makes one for the ``ColumnParallel(fuse=True)`` layers of each parent module.

    Args:
        layers: column layers alike but for ``out_features`` (``parallelize`` checks), each in no other group.
        parent: the module whose forward calls them; its forward pre-hook drops outputs not taken.

    Example::

        >>> from tpflow.layers import ColumnGroup
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> attn = torch.nn.Module()   # in a model: the attention, whose forward reads all three
        >>> attn.q_proj, attn.k_proj, attn.v_proj = (tpf.ColumnParallelLinear(8, n, placement=P) for n in (8, 4, 4))
        >>> group = ColumnGroup([attn.q_proj, attn.k_proj, attn.v_proj], attn)  # what parallelize(fuse=True) does
        >>> x = torch.randn(2, 8)
        >>> q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)   # one product; k and v are taken from it
        >>> group._products, q.shape, k.shape                          # this rank's columns of each
        (1, torch.Size([2, 4]), torch.Size([2, 2]))
    """

    def __init__(self, layers: Sequence[ColumnParallelLinear], parent: nn.Module) -> None:
        self.layers = tuple(layers)
        self._products = 0  # products computed: the token of the pending outputs' product
        self._clear()
        for layer in layers:
            layer.fused_group = self
            layer.register_state_dict_post_hook(_picklable_weight)
        join([layer.weight for layer in self.layers])
        parent.register_forward_pre_hook(self._clear)  # a bound method: deep copies of the model keep their own

    def _clear(self, *_) -> None:
        self._input: weakref.ref | None = None
        self._key: tuple = ()  # the input's version, grad mode and layout, and the parameters' versions
        self._params: list[torch.Tensor] = []  # the parameters the pending outputs were computed with
        self._pending: dict[int, torch.Tensor] = {}  # member index -> its output, not yet taken

    def _state(self, x: torch.Tensor, data_split: tuple[bool, ...]) -> tuple:
        """What the pending outputs depend on besides the input's identity: a change of it (an in-place update of
        the input or a weight, say by an optimizer step) makes them stale."""
        return x._version, torch.is_grad_enabled(), data_split, *(p._version for p in self._params)

    def _forget(self, product: int) -> None:
        """Outputs of a product the backward has gone through are spent: its saved tensors are freed."""
        if self._products == product:
            self._clear()

    def output(self, layer: ColumnParallelLinear, x: torch.Tensor, data_split: tuple[bool, ...]) -> torch.Tensor:
        """``layer``'s output on ``x``: taken from the product already computed on ``x`` with these weights, or
        a new product of every member.

        Args:
            layer: a member.
            x: its input's local block.
            data_split: per data-parallel axis, whether the input is split there.

        Returns:
            What ``layer`` alone would return.
        """
        index = self.layers.index(layer)
        if index in self._pending and self._input() is x and self._key == self._state(x, data_split):
            y = self._pending.pop(index)
            if not self._pending:
                self._clear()
            return y
        join([member.weight for member in self.layers])  # again, if a conversion gave them storages of their own
        blocks = [member.local_blocks(data_split) for member in self.layers]
        w = _Joined.apply(*(w for w, _ in blocks))
        b = None if blocks[0][1] is None else torch.cat([b for _, b in blocks])
        y = self.layers[0].product(x, w, b, rows=None)
        self._products += 1
        if y.requires_grad:
            y.register_hook(_spent_hook(self, self._products))
        outputs = torch.split(y, [w.shape[0] for w, _ in blocks], dim=-1)
        self._params = [p for member in self.layers for p in (member.weight, member.bias) if p is not None]
        self._input, self._key = weakref.ref(x), self._state(x, data_split)
        self._pending = {i: out for i, out in enumerate(outputs) if i != index}
        return outputs[index]


def _picklable_weight(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """A member's weight in a state dict pickles (``torch.save``) though its block lies inside the joined storage."""
    key = prefix + "weight"
    if key in state_dict:
        picklable(state_dict[key])


def _spent_hook(group: ColumnGroup, product: int):
    """A gradient hook telling ``group`` that the backward went through ``product``. It holds the group by a
    weak reference: the graph must not keep the group, and with it the pending outputs, alive."""
    ref = weakref.ref(group)

    def hook(_grad: torch.Tensor) -> None:
        if (alive := ref()) is not None:
            alive._forget(product)
    return hook


class _Joined(torch.autograd.Function):
    """Weight blocks lying back to back in one storage, as the one tensor they make up: a view, not a copy."""

    @staticmethod
    def forward(ctx, *blocks):
        ctx.rows = [b.shape[0] for b in blocks]
        first = blocks[0]
        return first.as_strided((sum(ctx.rows), first.shape[1]), (first.shape[1], 1))

    @staticmethod
    def backward(ctx, grad):
        return torch.split(grad, ctx.rows)
