"""Saves that cannot tear: a checkpoint is written into a staging folder beside its place (``<path>.incomplete``, a
marker file inside) and made the folder at ``<path>`` only once every rank has written its part, as torchtitan and
Lightning do. A save killed half way leaves ``<path>`` as it was (the earlier checkpoint, whole, or nothing), never a
mixture of new and old blocks; loading the staging folder, or a path whose save never finished, is refused as an
incomplete checkpoint.

    with tpf.checkpoint.atomic_folder(path) as folder:      # on every rank
        dcp.save(state, checkpoint_id=folder)                # visible at path only when every rank is done
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator

import torch.distributed as dist

from tpflow import comm
from tpflow.checkpoint.together import Meeting

__all__ = ["INCOMPLETE", "atomic_folder", "check_complete", "is_weights_file", "publish", "stage"]

INCOMPLETE = "INCOMPLETE"  # the marker file of a folder still being written
_WEIGHTS = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")


def is_weights_file(name: str) -> bool:
    """Whether ``name`` is a Hugging Face model's weights file (a single file, a shard, or their index).

    Args:
        name: a file name.

    Returns:
        True for ``model.safetensors``, ``model-00001-of-00002.safetensors``, ``pytorch_model.bin``, their
        ``.index.json``; False for anything else (an adapter's ``adapter_model.safetensors`` too).

    Example::

        >>> is_weights_file("model-00001-of-00002.safetensors"), is_weights_file("adapter_model.safetensors")
        (True, False)
    """
    return _WEIGHTS.match(name) is not None


def _staging(path: str) -> str:
    return os.path.normpath(path) + ".incomplete"


def stage(path: str | os.PathLike) -> str:
    """A fresh staging folder for ``path`` (an earlier torn one removed), holding the marker; returns it. One process
    calls it (``atomic_folder`` does, on rank 0).

    Args:
        path: where the checkpoint goes.

    Returns:
        The staging folder to write into.

    Example::

        >>> import tempfile
        >>> root = tempfile.TemporaryDirectory()
        >>> folder = stage(os.path.join(root.name, "step-100"))
        >>> os.path.basename(folder), os.listdir(folder)
        ('step-100.incomplete', ['INCOMPLETE'])
        >>> root.cleanup()
    """
    folder = _staging(os.fspath(path))
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    with open(os.path.join(folder, INCOMPLETE), "w") as f:
        f.write("a checkpoint being written; made the folder beside it (without this suffix) once complete\n")
    return folder


def publish(folder: str, path: str | os.PathLike, *, keep_others: bool = False) -> None:
    """Make the complete staging ``folder`` the checkpoint at ``path``: by renames of the folder (an earlier ``path``
    moved aside, ``folder`` takes its name, the earlier one removed), or, with ``keep_others``, file by file into an
    existing ``path``. One process calls it.

    Args:
        folder: the staging folder ``stage`` gave, every part written.
        path: where the checkpoint goes.
        keep_others: ``path`` is a folder the save writes into, as ``save_pretrained`` does, not one it owns (a
            Trainer's output folder holds its checkpoints, its logs, a tokenizer): every entry there that this save
            does not write is left as it is, byte for byte, subfolders included, and the folder itself is never
            replaced (a log file open there stays in it). Each new file replaces its namesake in one rename, the
            weights first; the weights files of an earlier save that this one does not write (shards of another
            count, a single file beside a new index) are removed after them, so that a kill half way leaves weights
            ``from_pretrained`` reads whole, the earlier or the new, and the folder marked incomplete for tpflow's
            loaders.

    Example::

        >>> import tempfile
        >>> root = tempfile.TemporaryDirectory()
        >>> path = os.path.join(root.name, "model")
        >>> folder = stage(path)
        >>> with open(os.path.join(folder, "model.safetensors"), "w") as f:   # the save writes its files
        ...     _ = f.write("...")
        >>> publish(folder, path)
        >>> os.listdir(path), os.path.exists(folder)
        (['model.safetensors'], False)
        >>> os.makedirs(os.path.join(path, "checkpoint-5"))                   # a folder the next save must keep
        >>> folder = stage(path)
        >>> for name in ("config.json", "model.safetensors"):                 # the next save's files
        ...     with open(os.path.join(folder, name), "w") as f:
        ...         _ = f.write("{}")
        >>> publish(folder, path, keep_others=True)
        >>> sorted(os.listdir(path))
        ['checkpoint-5', 'config.json', 'model.safetensors']
        >>> root.cleanup()
    """
    path = os.fspath(path)
    if keep_others and os.path.isdir(path):
        _publish_into(folder, path)
        return
    os.remove(os.path.join(folder, INCOMPLETE))
    old = None
    if os.path.lexists(path):
        old = os.path.normpath(path) + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(folder, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _publish_into(folder: str, path: str) -> None:
    """``folder``'s entries moved into ``path``, which holds the marker meanwhile (a save that stops half way is
    refused on load): the weights' files first, their indexes next (an index names shards already there), then the
    earlier save's weights files this one did not write (a single file, read before an index, goes last of all
    weights), then the rest (the config)."""
    os.replace(os.path.join(folder, INCOMPLETE), os.path.join(path, INCOMPLETE))
    new = os.listdir(folder)
    weights = sorted((n for n in new if is_weights_file(n)), key=lambda n: (n.endswith(".json"), n))
    stale = [n for n in os.listdir(path)
             if is_weights_file(n) and n not in new and os.path.isfile(os.path.join(path, n))]
    for name in weights:
        os.replace(os.path.join(folder, name), os.path.join(path, name))
    for name in sorted(stale, key=lambda n: not n.endswith(".json")):  # an old index before its shards
        os.remove(os.path.join(path, name))
    for name in sorted(set(new) - set(weights)):
        target = os.path.join(path, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        os.replace(os.path.join(folder, name), target)
    os.remove(os.path.join(path, INCOMPLETE))
    os.rmdir(folder)


def check_complete(path: str | os.PathLike) -> None:
    """Refuse a checkpoint whose save did not finish: a staging folder (its marker inside), or a path whose staging
    folder lies beside it while it does not exist.

    Args:
        path: a checkpoint folder or file about to be read.

    Raises:
        ValueError: "incomplete checkpoint", naming the folder.

    Example::

        >>> import tempfile
        >>> root = tempfile.TemporaryDirectory()
        >>> folder = stage(os.path.join(root.name, "step-100"))
        >>> check_complete(folder)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        ValueError: incomplete checkpoint: .../step-100.incomplete holds the marker of a save that did not finish ...
        >>> root.cleanup()
    """
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, INCOMPLETE)):
        raise ValueError(f"incomplete checkpoint: {path} holds the marker of a save that did not finish ({INCOMPLETE});"
                         f" load the checkpoint saved before it, or save again")
    if not os.path.exists(path) and (os.path.isdir(_staging(path)) or os.path.isdir(os.path.normpath(path) + ".old")):
        raise ValueError(f"incomplete checkpoint: the save to {path} did not finish (its parts are in "
                         f"{_staging(path)}, an earlier one may be in {os.path.normpath(path)}.old); load the "
                         f"checkpoint saved before it, or save again")


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[str]:
    """A staging folder to save a checkpoint into on every rank, made the folder at ``path`` when every rank left the
    block without an error; where one rank raised, every rank raises and ``path`` is left as it was.

    Every rank enters it with the same ``path``, on a filesystem they share (rank 0 stages and publishes): another
    path on some rank, or a rank that does not see rank 0's staging folder, is refused on every rank before the
    block runs, naming each rank's path. The ranks meet through the world's store (``tpflow.checkpoint.together``),
    so that none waits out the timeout in a collective: entered on rank 0 alone, it fails within seconds naming the
    ranks that did not come; a rank raising in the block says so before it leaves, and the others raise it by name
    as they leave the block (a rank still in ``dcp.save``'s collectives then is let go when the failed rank's
    process ends, as a launcher ends it).

    Args:
        path: where the checkpoint goes.

    Returns:
        A context manager giving the staging folder.

    Raises:
        ValueError: the ranks gave different paths, or some rank does not see the staging folder.
        RuntimeError: another rank raised in the block (its error named), or did not come.

    Example::

        >>> import tempfile
        >>> import torch.distributed.checkpoint as dcp
        >>> root = [tempfile.mkdtemp() if tpf.get_rank() == 0 else None]
        >>> torch.distributed.broadcast_object_list(root, src=0)
        >>> path = os.path.join(root[0], "step-100")
        >>> with atomic_folder(path) as folder:
        ...     _ = dcp.save({"x": tpf.randn(4, placement=tpf.placement("cpu", ranks=[0, 1]), sbp=tpf.sbp.split(0))},
        ...                  checkpoint_id=folder)
        >>> sorted(os.listdir(path))
        ['.metadata', '__0_0.distcp', '__1_0.distcp']
        >>> torch.distributed.barrier()
        >>> shutil.rmtree(root[0]) if tpf.get_rank() == 0 else None
    """
    path = os.fspath(path)
    first = not dist.is_initialized() or dist.get_rank() == 0
    meeting = Meeting("atomic_folder", "enter tpf.checkpoint.atomic_folder on every rank, with the same path")
    subject, left = f"the save to {path}", f": {path} is left as it was"
    with meeting.step("stage", subject, left):
        if first:
            stage(path)
    if meeting.store is not None:  # every rank came and rank 0 staged: a collective meets them all
        seen = "found" if os.path.isfile(os.path.join(_staging(path), INCOMPLETE)) else \
            f"not found (rank 0 made {_staging(path)})"
        try:
            comm.agree("tpf.checkpoint.atomic_folder", {"the path": os.path.abspath(path), "the staging folder": seen},
                       [dist.group.WORLD], "enter it with the same path on every rank, on a filesystem every rank "
                       "shares (rank 0 makes the staging folder beside the path and publishes it)")
        except ValueError:
            if first:
                shutil.rmtree(_staging(path), ignore_errors=True)
            raise
    with meeting.step("save", subject, left):
        yield _staging(path)
    with meeting.step("publish", subject, left):
        if first:
            publish(_staging(path), path)
