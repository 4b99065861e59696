"""Ranks reading one checkpoint, checked: a rank pointed at another checkpoint of the same architecture (a node's stale
copy, a fine-tune that changed one tensor) would load a model mixed from two, and every number after it would be
silently wrong.

Two checks, both failing on every rank with the same error, which names the file or tensor and each rank's value:

- before reading, the files' names, sizes and a digest of their headers and four 4 KiB windows (``agree_on_files``):
  cheap, it stops most stale copies before a byte of the tensors is read;
- after reading, the bytes each rank read (``ReadDigests``): a CRC-32 of every region of every tensor a rank reads,
  compared between the ranks that read the same region. A tensor read whole (broadcast, or a plain module's) is read
  by every rank, and a block by the ranks a data-parallel axis broadcasts it over; a split tensor's blocks are read
  by one rank each, so each rank also reads its next rank's block along each axis that splits the tensor (a ring:
  every block read by two ranks, each by its own file), hashes it and drops it. So any byte a rank loads is compared
  with the same byte of another rank's file, at the price of reading about 2/W of each split tensor instead of 1/W.
  A CRC-32 (zlib, about 4 GB/s) rather than a cryptographic hash: it is there to catch accidents, not an adversary.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import zlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow import comm
from tpflow.global_tensor.blocks import get_placement

__all__ = ["ReadDigests", "agree_on_files", "fingerprint"]

_FIX = "point every rank at the same checkpoint (a stale copy on one node?), or copy the checkpoint to every node anew"


def fingerprint(file: str) -> str:
    """A file's size and a digest of its header (names, dtypes, shapes, offsets) and of four 4 KiB windows spread
    over its data: two checkpoints of one architecture differ there, whatever their names and dates.

    Args:
        file: a safetensors file.

    Returns:
        ``"<size> bytes, digest <12 hex digits>"``.

    Example::

        >>> import tempfile
        >>> from safetensors.torch import save_file
        >>> from tpflow.checkpoint.digests import fingerprint
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = os.path.join(folder.name, "w.safetensors")
        >>> save_file({"w": torch.zeros(4)}, path)
        >>> fingerprint(path)  # doctest: +ELLIPSIS
        '80 bytes, digest ...'
        >>> folder.cleanup()
    """
    size = os.path.getsize(file)
    digest = hashlib.sha1()
    with open(file, "rb") as f:
        head = f.read(8)
        header = int.from_bytes(head, "little") if len(head) == 8 else 0
        digest.update(head + f.read(min(header, size)))
        start = 8 + header
        for k in range(4):
            f.seek(start + (size - start) * k // 4)
            digest.update(f.read(4096))
    return f"{size} bytes, digest {digest.hexdigest()[:12]}"


def _groups(model: nn.Module) -> list[dist.ProcessGroup]:
    """The groups over which the ranks holding ``model``'s global tensors compare what they read: its one placement's
    axes (each gather as small as an axis: every region two ranks read lies within one axis), else the world where
    the model's placements span it; none for a plain model, a world of one or several placements short of the world
    (a pipeline's stages on some ranks)."""
    placements = {get_placement(p) for p in model.parameters() if isinstance(p, DTensor)}
    if not placements or not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    if len(placements) == 1 and (pl := next(iter(placements))).coordinate() is not None:
        return [pl.mesh.get_group(axis) for axis in range(pl.ndim)]
    if sorted({r for pl in placements for r in pl.flat_ranks}) == list(range(dist.get_world_size())):
        return [dist.group.WORLD]
    return []


def agree_on_files(model: nn.Module, files: list[str]) -> None:
    """The ranks holding the model's global tensors name the same files, of the same sizes, headers and sampled
    bytes, or all of them stop here, naming the ranks and files.

    Args:
        model: the model about to be loaded.
        files: the safetensors files this rank reads.

    Raises:
        ValueError: on every rank, naming the first file that differs and each rank's fingerprint of it.

    Example::

        >>> import tempfile
        >>> from safetensors.torch import save_file
        >>> from tpflow.checkpoint.digests import agree_on_files
        >>> folder = [tempfile.mkdtemp() if tpf.get_rank() == 0 else None]
        >>> torch.distributed.broadcast_object_list(folder, src=0)
        >>> path = os.path.join(folder[0], "model.safetensors")
        >>> if tpf.get_rank() == 0:
        ...     save_file({"weight": torch.zeros(4, 2)}, path)
        >>> torch.distributed.barrier()
        >>> model = tpf.ColumnParallelLinear(2, 4, bias=False, placement=tpf.placement("cpu", ranks=[0, 1]))
        >>> agree_on_files(model, [path])                    # the same file on every rank: nothing to say
    """
    groups = _groups(model)
    if not groups:
        return
    facts = {"the files": ", ".join(os.path.basename(f) for f in files)}
    facts.update({f"the file {os.path.basename(f)}": fingerprint(f) for f in files})
    comm.agree("load_safetensors", facts, groups, _FIX)


def _crc(value: torch.Tensor) -> int:
    """The CRC-32 of a tensor's bytes, as read (the file's dtype, before any cast)."""
    return zlib.crc32(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _region(ranges: Sequence[Sequence[tuple[int, int]]]) -> str:
    """``[0:4, 8:12+20:24]``: the ranges of each dim, a strided block's pieces joined by ``+``."""
    return "[" + ", ".join("+".join(f"{a}:{b}" for a, b in dim) for dim in ranges) + "]"


class ReadDigests:
    """The bytes each rank read of each tensor, hashed by region, and compared between the ranks that read the same
    region of the same tensor (see the module's docstring).

    Args:
        model: the model being loaded (its placements say which ranks compare).

    Example::

        >>> import tempfile
        >>> from safetensors import safe_open
        >>> from safetensors.torch import save_file
        >>> from tpflow.checkpoint.digests import ReadDigests
        >>> from tpflow.checkpoint.sources import neighbours, read_block
        >>> folder = [tempfile.mkdtemp() if tpf.get_rank() == 0 else None]
        >>> torch.distributed.broadcast_object_list(folder, src=0)
        >>> path = os.path.join(folder[0], "model.safetensors")
        >>> if tpf.get_rank() == 0:
        ...     save_file({"weight": torch.arange(8.).reshape(4, 2)}, path)
        >>> torch.distributed.barrier()
        >>> model = tpf.ColumnParallelLinear(2, 4, bias=False, placement=tpf.placement("cpu", ranks=[0, 1]))
        >>> digests = ReadDigests(model)
        >>> def seen(ranges, value):
        ...     digests.add("weight", ranges, value, path)
        >>> with safe_open(path, framework="pt") as f:
        ...     _ = read_block(f, "weight", model.weight, seen=seen)                          # its block
        ...     for other in neighbours(model.weight):                                        # and the next one's
        ...         _ = read_block(f, "weight", model.weight, other, seen=seen)
        >>> digests.check()                                  # each block read alike by two ranks: nothing to say
    """

    def __init__(self, model: nn.Module) -> None:
        self.groups = _groups(model)
        self.read: dict[tuple[str, str], tuple[int, str]] = {}  # (name, region) -> (CRC-32, file)

    def add(self, name: str, ranges: Sequence[Sequence[tuple[int, int]]], value: torch.Tensor, file: str) -> None:
        """Record the bytes read of a region of tensor ``name`` (``read_block``'s ``seen`` gives them).

        Args:
            name: the tensor's name (the model's).
            ranges: the region read, per dim its ``[start, end)`` ranges.
            value: what was read there, in the file's dtype.
            file: where it was read from.
        """
        if self.groups:
            self.read[(name, _region(ranges))] = (_crc(value), file)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Around the reads: ``check`` once they are done, or, where this rank failed on the way (a file it cannot
        read), ``check`` with its error, so that every other rank raises it by name instead of waiting for it.

        Returns:
            A context manager.
        """
        try:
            yield
        except Exception as e:
            self.check(e)
            raise
        self.check()

    def check(self, failure: Exception | None = None) -> None:
        """Compare what every rank read with the other ranks' reads of the same regions; one all-gather per group.
        Every rank holding the model calls it.

        Args:
            failure: this rank's error on the way, said to the others (and raised here after).

        Raises:
            ValueError: on every rank, when two ranks read different bytes for a region of a tensor (its name, the
                region, each rank's file and CRC), or a rank failed (its error; that rank raises its own).
        """
        mine = None if failure is None else f"load_safetensors failed on rank {dist.get_rank()}: " \
                                            f"{type(failure).__name__}: {failure}"
        verdict: str | None = None
        for group in [*self.groups, *self.groups[:-1]]:  # a second pass over all but the last says it to everyone
            if dist.get_world_size(group) == 1:
                continue
            seen: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(seen, (self.read if mine is None else {}, mine or verdict), group=group)
            verdict = next((v for _, v in seen if v), None) or _difference(
                [r for r, _ in seen], dist.get_process_group_ranks(group))
        if failure is not None:
            raise failure
        if verdict is not None:
            raise ValueError(verdict if verdict.startswith("load_safetensors failed") else f"{verdict}: {_FIX}")


def _difference(reads: list[dict[tuple[str, str], tuple[int, str]]], ranks: list[int]) -> str | None:
    """The first region the ranks' ``reads`` hold different bytes for, with each rank's file and CRC; None if every
    region read by two ranks or more was read alike."""
    for key in sorted({k for read in reads for k in read}):
        held = [(rank, read[key]) for rank, read in zip(ranks, reads) if key in read]
        if len({crc for _, (crc, _) in held}) > 1:
            said = "; ".join(f"rank {rank} from {file}: CRC-32 {crc:08x}" for rank, (crc, file) in held)
            return f"load_safetensors: the ranks read different values for {key[0]!r} {key[1]} ({said})"
    return None
