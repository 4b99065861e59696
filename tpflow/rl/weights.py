"""``tpf.rl.weights``: a parallelized model's weights as an inference engine loads them, whole tensors under the
names its ``save_pretrained`` writes, streamed in buckets from the ranks' blocks, for the refits of RL
post-training (vLLM's weight-transfer source and ``load_weights``, TRL's ``VLLMClient.update_named_params``, SGLang's
``update_weights_from_tensor``).

    metadata()   the names, dtypes and whole shapes, from the parameters' global shapes: no communication
    one sync     a roll call (every rank's n-th sync meets the others', through the store: a rank that does not
                 come fails it within seconds, naming itself) -> per bucket: each parameter all-gathered in
                 turn (``full_tensor``) and turned into its checkpoint tensors (transformers' own conversion,
                 one parameter at a time); the receiving rank keeps them, the others drop them at once ->
                 the bucket handed over -> every rank leaves the bucket together before the next one's
                 gathers (no rank runs ahead into gathers while the receiver is still sending)
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from tpflow.checkpoint.together import Meeting
from tpflow.sbp import chunk_bounds

__all__ = ["Source", "WeightMeta", "Weights", "checkpoint_tensors", "weights"]

BUCKET_BYTES = 1 << 28  # 256 MiB: vLLM's and NeMo-RL's refit buffers are of this order
POLL_S = 0.002  # the ranks meet after every bucket: they look at the store this often while waiting


class WeightMeta(NamedTuple):
    """One tensor of the stream: its checkpoint name, dtype and whole shape.

    Example::

        >>> WeightMeta("lm_head.weight", torch.bfloat16, (101, 32)).shape
        (101, 32)
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class Source(NamedTuple):
    """A state-dict entry of the model and the checkpoint tensors it becomes.

    Example::

        >>> Source("w", torch.zeros(2), (WeightMeta("w", torch.float32, (2,)),)).made[0].name
        'w'
    """

    key: str
    tensor: torch.Tensor  # the model's (global) tensor
    made: tuple[WeightMeta, ...]


def checkpoint_tensors(model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype | None
                      ) -> list[Source]:
    """The entries ``save_pretrained`` writes (tied ones once, the ignored ones left out), each with the checkpoint
    tensors transformers' conversion makes of it, from shapes alone (meta tensors): no communication.

    Args:
        model: a model (parallelized or not); a Hugging Face one is converted to its checkpoint's layout.
        state: its ``state_dict(keep_vars=True)``.
        dtype: the checkpoint tensors' dtype, or None for each entry's own.

    Returns:
        One :class:`Source` per entry written, in state-dict order.

    Example::

        >>> model = torch.nn.Linear(3, 2)
        >>> [s.made[0].shape for s in checkpoint_tensors(model, model.state_dict(keep_vars=True), None)]
        [(2, 3), (2,)]
    """
    if not callable(getattr(type(model), "save_pretrained", None)):  # a plain module: its state dict as it is
        return [Source(k, t, (WeightMeta(k, dtype or t.dtype, tuple(t.shape)),)) for k, t in state.items()]
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    tokens: dict[int, torch.Tensor] = {}  # one small tensor per parameter: tied names share it, as their storage
    kept = remove_tied_weights_from_state_dict(
        {k: tokens.setdefault(id(t), torch.zeros(1)) for k, t in state.items() if k not in ignored}, model)
    sources, made_alone = [], {}
    for key in (k for k in state if k in kept):
        t = state[key]
        meta = {key: torch.empty(t.shape, dtype=dtype or t.dtype, device="meta")}
        made = revert_weight_conversion(model, meta)
        made_alone.update(made)
        sources.append(Source(key, t, tuple(WeightMeta(n, m.dtype, tuple(m.shape)) for n, m in made.items())))
    together = revert_weight_conversion(model, {s.key: torch.empty(s.tensor.shape, dtype=dtype or s.tensor.dtype,
                                                                   device="meta") for s in sources})
    if {n: (m.dtype, m.shape) for n, m in together.items()} != {n: (m.dtype, m.shape) for n, m in made_alone.items()}:
        joined = sorted(set(together) ^ set(made_alone))[:4]
        raise ValueError(f"tpf.rl.weights turns one parameter at a time into checkpoint tensors, but "
                         f"{type(model).__name__}'s conversion to its checkpoint layout joins several (around "
                         f"{joined}): refit through save_pretrained, which converts the whole state dict at once")
    return sources


def _gathered(param: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value, every rank calling. Split on one dim over a 1-D mesh, the blocks land straight in
    one whole tensor (NCCL's ``all_gather_into_tensor`` for even rows; else each rank's block broadcast in turn, at
    most a block in flight beside it: gloo's ``all_gather_into_tensor`` gathers into a buffer of its own first);
    any other layout by ``full_tensor``, which may hold the whole twice for a moment."""
    if not isinstance(param, DTensor):
        return param
    mesh, place = param.device_mesh, param.placements[0]
    if mesh.ndim != 1 or type(place) is not Shard:
        return param.full_tensor()
    group, me, local = mesh.get_group(0), mesh.get_local_rank(0), param.to_local()
    out = local.new_empty(param.shape)
    bounds = chunk_bounds(param.shape[place.dim], mesh.size(0))
    if local.is_cuda and place.dim == 0 and len({b - a for a, b in bounds}) == 1:
        dist.all_gather_into_tensor(out, local.contiguous(), group=group)
        return out
    for r, (a, b) in enumerate(bounds):
        if a == b:
            continue
        part = out.narrow(place.dim, a, b - a)
        block = local.contiguous() if r == me else part if part.is_contiguous() else torch.empty_like(part)
        dist.broadcast(block, group_src=r, group=group)
        if block is not part:
            part.copy_(block)
    return out


class Weights:
    """A parallelized model's weights as whole checkpoint tensors, streamed in buckets (``tpf.rl.weights``).

    Each iteration (``for name, tensor in stream``) is one sync, which every rank of the world makes, the n-th with
    the n-th: on the receiving rank (or every rank, ``receiver=None``) each item is ``(name, whole tensor)``, in
    the model's device and ``dtype``; elsewhere ``(name, None)``. A rank holds at most one bucket of whole tensors
    beside the largest parameter it is gathering.

    Args:
        model: a model after ``tpf.parallelize`` (or a plain one), on every rank of the world.
        dtype: the tensors' dtype (an engine's, bf16); default each parameter's own.
        bucket_bytes: the most bytes of whole tensors held at once; a parameter larger than it is a bucket of its
            own (said once, with a warning).
        receiver: the rank that keeps the whole tensors, or None for every rank.

    Example::

        >>> from torch import nn
        >>> model = tpf.parallelize(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4)),
        ...                         placement=tpf.placement("cpu", ranks=[0, 1]), plan={"0": "column", "1": "row"})
        >>> stream = tpf.rl.weights(model)
        >>> [(m.name, tuple(m.shape)) for m in stream.metadata()]           # no communication
        [('0.weight', (6, 4)), ('0.bias', (6,)), ('1.weight', (4, 6)), ('1.bias', (4,))]
        >>> got = dict(stream)                                               # one sync, on every rank
        >>> None if got["0.weight"] is None else got["0.weight"].shape     # None elsewhere; on rank 0
        torch.Size([6, 4])
    """

    def __init__(self, model: nn.Module, *, dtype: torch.dtype | None = None, bucket_bytes: int = BUCKET_BYTES,
                 receiver: int | None = 0) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        world = dist.get_world_size() if dist.is_initialized() else 1
        if receiver is not None and not 0 <= receiver < world:
            raise ValueError(f"receiver must be a rank of this world of {world} (or None: every rank), got {receiver}")
        if getattr(model, "peft_config", None) is not None:
            raise ValueError("tpf.rl.weights streams a model's own weights: merge a PEFT model's adapters first "
                             "(model.merge_and_unload()), as engines load merged weights")
        self.model, self.dtype, self.bucket_bytes, self.receiver = model, dtype, bucket_bytes, receiver
        self.sources = checkpoint_tensors(model, model.state_dict(keep_vars=True), dtype)
        self.buckets = self._buckets()
        self.syncs = 0

    def _buckets(self) -> list[list[Source]]:
        """The sources in buckets of at most ``bucket_bytes`` of checkpoint tensors, in order."""
        buckets: list[list[Source]] = [[]]
        used = 0
        for source in self.sources:
            size = sum(math.prod(m.shape) * m.dtype.itemsize for m in source.made)
            if size > self.bucket_bytes:
                warnings.warn(f"tpf.rl.weights: {source.key} is {size} bytes, more than bucket_bytes="
                              f"{self.bucket_bytes}: it goes in a bucket of its own (the sync then holds "
                              f"{size} bytes at once)", stacklevel=3)
            if buckets[-1] and used + size > self.bucket_bytes:
                buckets.append([])
                used = 0
            buckets[-1].append(source)
            used += size
        return [b for b in buckets if b]

    def metadata(self) -> list[WeightMeta]:
        """Every tensor of a sync, in its order: name, dtype, whole shape; no communication.

        Returns:
            One :class:`WeightMeta` per tensor, the same on every rank.
        """
        return [m for source in self.sources for m in source.made]

    def _keeps(self) -> bool:
        return self.receiver is None or (dist.get_rank() if dist.is_initialized() else 0) == self.receiver

    def _whole(self, source: Source) -> dict[str, torch.Tensor]:
        """One parameter gathered (every rank) and, on a receiving rank, turned into its checkpoint tensors."""
        param = source.tensor.detach()
        value = _gathered(param)
        if not self._keeps():
            return {}
        value = value if self.dtype is None else value.to(self.dtype)
        if value.untyped_storage().data_ptr() == (param.to_local() if isinstance(param, DTensor) else param
                                                  ).untyped_storage().data_ptr():
            value = value.clone()  # a whole parameter is its own gather: the engine gets a copy, not the parameter
        if len(source.made) == 1 and source.made[0].name == source.key:
            return {source.key: value}
        from transformers.core_model_loading import revert_weight_conversion

        return {n: t.contiguous() for n, t in revert_weight_conversion(self.model, {source.key: value}).items()}

    def sync(self, receive: Callable[[list[tuple[str, torch.Tensor | None]], bool], None]) -> None:
        """One sync: each bucket handed to ``receive(items, last)`` on every rank (``(name, None)`` items where the
        rank keeps nothing) inside a step every rank leaves together: a rank that raises makes every rank raise.

        Args:
            receive: called once per bucket, with its items and whether it is the sync's last bucket.
        """
        buckets = self._generated()
        for i, items in enumerate(buckets):
            try:
                receive(items, i == len(self.buckets) - 1)
            except BaseException as e:
                buckets.throw(e)  # raised in the bucket's step: every rank hears of it

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """One sync, item by item: iterate it to its end on every rank."""
        buckets = self._generated()
        try:
            for bucket in buckets:
                yield from bucket
        except GeneratorExit:  # the consumer stopped (or raised): the other ranks hear it at once
            with contextlib.suppress(RuntimeError):
                buckets.throw(RuntimeError("the sync was left before its end (iterate it whole on every rank)"))
            raise

    def _generated(self) -> Iterator[list[tuple[str, torch.Tensor | None]]]:
        """One sync's buckets, each yielded inside a step that every rank leaves together."""
        self.syncs += 1
        meeting = Meeting("tpf.rl.weights", f"make every sync of the weight stream on every rank, as many times "
                                            f"(this rank's sync {self.syncs})", poll_s=POLL_S)
        for i, bucket in enumerate(self.buckets):
            with meeting.step(f"bucket{i}", f"sync {self.syncs} of the weight stream, bucket {i}"):
                whole: dict[str, torch.Tensor] = {}
                for source in bucket:
                    whole.update(self._whole(source))
                if whole and next(iter(whole.values())).is_cuda:
                    torch.cuda.current_stream().synchronize()  # the gathers done before the bucket is read
                items = [(m.name, whole.get(m.name)) for s in bucket for m in s.made]
                del whole
                yield items
                items.clear()  # the bucket's tensors go before the next one's gathers, whoever still holds the list

    # adapters: duck-typed, the engines need GPUs

    def load_into(self, engine_model: Any) -> None:
        """vLLM's older path: ``engine_model.load_weights(iterable)`` on the receiving rank, fed this sync's items.

        Args:
            engine_model: what has ``load_weights`` (vLLM's model, reached through its worker).
        """
        self._feed(lambda items: engine_model.load_weights(items))

    def update_named_params(self, client: Any) -> None:
        """TRL's ``VLLMClient.update_named_params(metadata, iterator)`` on the receiving rank.

        Args:
            client: a ``trl`` ``VLLMClient`` (its weight-update group opened).
        """
        metadata = [(m.name, str(m.dtype).removeprefix("torch."), list(m.shape)) for m in self.metadata()]
        self._feed(lambda items: client.update_named_params(metadata, items))

    def update_weights_from_tensor(self, engine: Any) -> None:
        """SGLang's ``engine.update_weights_from_tensor(named_tensors, flush_cache=)``, once per bucket on the
        receiving rank, its cache flushed after the last.

        Args:
            engine: an SGLang ``Engine``.
        """
        def receive(items: list[tuple[str, torch.Tensor | None]], last: bool) -> None:
            if self._keeps():
                engine.update_weights_from_tensor(named_tensors=items, flush_cache=last)

        self.sync(receive)

    def _feed(self, consume: Callable[[Iterator[tuple[str, torch.Tensor]]], Any]) -> None:
        """``consume(items)`` on the receiving rank, over this sync's items; every other rank iterates alongside."""
        items = iter(self)
        if not self._keeps():
            for _ in items:
                pass
            return
        try:
            consume(items)
        finally:
            items.close()  # a consumer that raised, or stopped early: the other ranks hear it


def weights(model: nn.Module, *, dtype: torch.dtype | None = None, bucket_bytes: int = BUCKET_BYTES,
            receiver: int | None = 0) -> Weights:
    """A parallelized model's weights as whole checkpoint tensors for an inference engine (see :class:`Weights`).

    Args:
        model: a model after ``tpf.parallelize`` (or a plain one).
        dtype: the tensors' dtype; default each parameter's own.
        bucket_bytes: the most bytes of whole tensors held at once.
        receiver: the rank that keeps them, or None for every rank.

    Returns:
        A :class:`Weights`: ``metadata()``, and one sync per iteration.

    Example::

        >>> from torch import nn
        >>> model = tpf.parallelize(nn.Sequential(nn.Linear(4, 6)), placement=tpf.placement("cpu", ranks=[0, 1]),
        ...                         plan={"0": "column"})
        >>> [m.name for m in tpf.rl.weights(model, dtype=torch.bfloat16).metadata()]
        ['0.weight', '0.bias']
    """
    return Weights(model, dtype=dtype, bucket_bytes=bucket_bytes, receiver=receiver)
