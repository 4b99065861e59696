"""Loading a model at scale: built without its values, parallelized, then each rank reads only its blocks.

    with tpf.meta_parameters():                      # parameters on the meta device: no memory, no init
        model = AutoModelForCausalLM.from_config(config)
    tpf.parallelize(model, placement=P, plan="auto")  # each rank allocates its blocks, uninitialised
    tpf.load_safetensors(model, "path/to/model")     # each rank reads its slices of each tensor

A rank's host memory then holds its blocks and the whole replicated parameters (norms), about 1/W of the
model, where building the whole model on every rank first holds W whole copies on a node. The safetensors
files are memory-mapped and each block is read as a slice (``safe_open(...).get_slice``); the values are the
file's, bit for bit, as the regular load gives them. Loading is strict by names, as ``load_state_dict``: a
parameter the files lack or a tensor the model does not have is an error (``strict=False`` allows the latter),
and no block is left on the meta device. A stage of ``tpf.pipeline.cut`` loads the whole model's checkpoint,
its own part of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import weakref
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow.checkpoint.atomic import check_complete
from tpflow.checkpoint.digests import ReadDigests, agree_on_files
from tpflow.checkpoint.sources import Seen, checkpoint_sources, neighbours, read_block, read_stacked
from tpflow.global_tensor.blocks import get_placement

__all__ = ["load_safetensors", "meta_parameters", "tensor_names", "unique_state_dict"]


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """A context manager under which modules are built with their parameters on the meta device (no memory, no
    initialisation) and their buffers where they would be (a rotary embedding's frequencies, computed as usual).

    Parameters made in the block are moved to meta as they are registered, before a module initialises them, so
    their host memory is never touched. ``parallelize`` then allocates each rank's blocks (uninitialised) and
    ``load_safetensors`` fills them. Global parameters (``parallelize``'s blocks, called inside the block too) are
    left as they are.

    Returns:
        The context manager.

    Example::

        >>> import tpflow as tpf
        >>> from torch import nn
        >>> with tpf.meta_parameters():
        ...     layer = nn.Linear(4096, 4096)
        >>> layer.weight.device
        device(type='meta')
    """
    register = nn.Module.register_parameter
    # a parameter registered twice (tied) stays one meta parameter; the real one is not kept alive
    moved: dict[int, tuple[weakref.ref, nn.Parameter]] = {}

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta and not isinstance(param, DTensor):
            seen = moved.get(id(param))
            if seen is None or seen[0]() is not param:  # an id is reused once its tensor is freed
                seen = moved[id(param)] = (weakref.ref(param), type(param)(param.to("meta"),
                                                                           requires_grad=param.requires_grad))
            module._parameters[name] = seen[1]

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _files(path: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """The safetensors files of ``path``: a file, a list of files, or a directory as ``from_pretrained`` reads one
    (``model.safetensors`` where it is there, even beside an index; else the shards its
    ``model.safetensors.index.json`` lists; else every ``*.safetensors``)."""
    if not isinstance(path, (str, os.PathLike)):
        return [os.fspath(p) for p in path]
    path = os.fspath(path)
    if not os.path.isdir(path):
        return [path]
    single, index = os.path.join(path, "model.safetensors"), os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):  # from_pretrained's order: the single file first, though an index lies beside it
        return [single]
    if os.path.exists(index):
        with open(index) as f:
            return sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    found = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors file in {path}")
    return found


def _tensors(model: nn.Module) -> dict[int, tuple[list[str], torch.Tensor, list[tuple[nn.Module, str]]]]:
    """Every parameter and persistent buffer of ``model`` once (a tied one under all its names), with the modules
    and attribute names that hold it."""
    found: dict[int, tuple[list[str], torch.Tensor, list[tuple[nn.Module, str]]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        owned = [(n, t) for n, t in module._parameters.items() if t is not None]
        owned += [(n, t) for n, t in module._buffers.items() if t is not None and n not in
                  module._non_persistent_buffers_set]
        for attr, t in owned:
            names, _, owners = found.setdefault(id(t), ([], t, []))
            names.append(f"{prefix}.{attr}" if prefix else attr)
            owners.append((module, attr))
    return found


def tensor_names(model: nn.Module) -> frozenset[str]:
    """The names a checkpoint of ``model`` may hold: its parameters and persistent buffers, a tied one under each
    of its names (``tpf.pipeline.cut`` keeps the whole model's, so that each stage knows what other stages take).

    Args:
        model: any model.

    Returns:
        The names, as ``model.state_dict()`` gives them.

    Example::

        >>> from torch import nn
        >>> from tpflow.checkpoint.load import tensor_names
        >>> sorted(tensor_names(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))))
        ['0.bias', '0.weight', '1.bias', '1.num_batches_tracked', '1.running_mean', '1.running_var', '1.weight']
    """
    return frozenset(n for names, _, _ in _tensors(model).values() for n in names)


def _listed(names: Sequence[str]) -> str:
    """At most 8 names and how many there are in all."""
    return f"{list(names[:8])}{' ...' if len(names) > 8 else ''} ({len(names)} in all)"


def _ignored(model: nn.Module) -> re.Pattern | None:
    """The checkpoint names that are never unexpected, as ``from_pretrained`` ignores them: a Hugging Face model's
    ``_keys_to_ignore_on_load_unexpected`` patterns, and the rotary frequencies and position ids that older
    checkpoints saved, where the model computes them now (non-persistent buffers)."""
    patterns = set()
    for module in model.modules():
        patterns.update(getattr(module, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [name for name, _ in model.named_buffers()]
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return re.compile("|".join(f"({p})" for p in sorted(patterns))) if patterns else None


def _is_meta(t: torch.Tensor) -> bool:
    """Whether this rank's block of ``t`` has no memory (a rank outside a global tensor's placement holds none)."""
    if isinstance(t, DTensor):
        return get_placement(t).coordinate() is not None and t.to_local().is_meta
    return t.is_meta


def _allocate(t: torch.Tensor, block: torch.Tensor) -> None:
    """``t``, a global tensor whose block is on the meta device (a module made global without a plan), takes
    ``block`` as its block in place: the same object, so that its modules, a tied twin and a stage keep it."""
    block = block.to(device=get_placement(t).device, dtype=t.dtype).contiguous()
    value = DTensor.from_local(block, t.device_mesh, t.placements,
                               run_check=False, shape=t.shape, stride=t.stride())
    if isinstance(t, nn.Parameter):
        value = nn.Parameter(value, requires_grad=t.requires_grad)
    value.__dict__.update(t.__dict__)  # marks such as gradients.adopt's
    torch.utils.swap_tensors(t, value)


@torch.no_grad()
def load_safetensors(model: nn.Module, path: str | os.PathLike | Sequence[str | os.PathLike], *,
                     strict: bool = True) -> nn.Module:
    """Fill ``model``'s parameters and persistent buffers from safetensors files, each rank reading only its
    blocks of each global tensor; strict by names, as ``load_state_dict(strict=True)``.

    Made for a model built under ``tpf.meta_parameters()`` and parallelized (its blocks allocated, not
    initialised), so that no rank ever holds the whole model; it loads any model whose names match the files'
    (a plain one, a parallelized one). A global tensor whose block is still on the meta device (a module made
    global without a plan, ``tpf.to_global(module, placement=P)``, or ``tpf.pipeline.cut`` without ``plan``) is
    allocated on its placement's device and filled (the same tensor object). A tied parameter is read once,
    under whichever of its names the files have (Hugging Face saves a tied head under the embedding's name only).
    The values are cast to the parameters' dtypes, and otherwise are the file's, bit for bit. The ranks check that
    they read one checkpoint (``tpflow.checkpoint.digests``): each also reads and hashes its next rank's block of
    each split tensor, so that every byte loaded is compared with another rank's file.

    A Hugging Face model's checkpoint in its original layout loads as ``from_pretrained`` converts it: a mixture of
    experts' per-expert tensors (``mlp.experts.3.gate_proj.weight``) are stacked into the model's fused experts, each
    rank reading only its experts' tensors and of each its slice, and renamed modules (Mixtral's
    ``block_sparse_moe``) are found under their new names (``tpflow.checkpoint.sources``).

    A stage of ``tpf.pipeline.cut`` takes a checkpoint of the whole model: it reads the tensors of its own
    layers by the whole model's names (``model.layers.5.mlp.up_proj.weight``) and leaves the other stages'
    tensors to them (not unexpected: a tensor the whole model does not have is).

    Args:
        model: the model to fill, in place; its ``named_parameters`` / ``named_buffers`` names are the files' keys
            (a stage of ``cut``: the whole model's names).
        path: a ``.safetensors`` file, a list of them, or a directory as ``from_pretrained`` reads one
            (``model.safetensors`` or the shards of ``model.safetensors.index.json``).
        strict: whether a tensor in the files that the model does not have is an error (as for
            ``load_state_dict``): a checkpoint of another, larger model would otherwise load without a word.
            ``strict=False`` skips such tensors (loading part of a checkpoint). Either way a parameter the files
            lack is an error (a parallelized model's blocks are uninitialised), a persistent buffer they lack keeps
            the value computed when the model was built, and no block is left on the meta device. Names Hugging
            Face's ``from_pretrained`` ignores (the model's ``_keys_to_ignore_on_load_unexpected``, the rotary
            frequencies older checkpoints saved) are never unexpected.

    Returns:
        ``model``.

    Raises:
        KeyError: the files lack a parameter of the model, or (``strict=True``) hold tensors it does not have; the
            message names the first 8 and the count, on every rank.
        ValueError: a tensor's shape differs between the files and the model; or the model has buffers on the
            meta device that no checkpoint holds (built under ``torch.device("meta")``: build it under
            ``tpf.meta_parameters()``); or the ranks read different files or bytes (on every rank, naming the
            file or the tensor and its region); or another rank failed reading (its error, on every rank).
        FileNotFoundError: a directory without ``.safetensors`` files.

    Example::

        >>> import os
        >>> import tempfile
        >>> from safetensors.torch import save_file
        >>> from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
        >>> import tpflow as tpf
        >>> config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...                      num_attention_heads=4, num_key_value_heads=2)
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = os.path.join(folder.name, "model.safetensors")
        >>> _ = torch.manual_seed(0)
        >>> save_file(LlamaForCausalLM(config).state_dict(), path)     # a checkpoint (or a from_pretrained folder)
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> with tpf.meta_parameters():
        ...     model = AutoModelForCausalLM.from_config(config)        # nothing allocated yet
        >>> model = tpf.parallelize(model, placement=P, plan="auto")
        >>> model = tpf.load_safetensors(model, path)                   # each rank reads its blocks only
        >>> ids = torch.randint(0, 64, (2, 8))
        >>> model(ids, labels=ids).loss                                 # the saved model's loss
        tensor(4.1710, grad_fn=<_VocabParallelCEBackward>)
        >>> config.num_hidden_layers = 1                                # a smaller model than the checkpoint's
        >>> with tpf.meta_parameters():
        ...     small = AutoModelForCausalLM.from_config(config)
        >>> try:                                                       # doctest: +ELLIPSIS
        ...     tpf.load_safetensors(small, path)
        ... except KeyError as e:
        ...     print(e.args[0])
        the checkpoint at ... has 9 tensors that the model does not have: ['model.layers.1.input_layernorm...] ...
        >>> small = tpf.load_safetensors(small, path, strict=False)     # its layer 0, the embedding, norm and head
        >>> folder.cleanup()
    """
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError("load_safetensors needs the safetensors package: pip install safetensors") from e
    # a stage of tpf.pipeline.cut: its names are the whole model's after a prefix, and the whole model's are expected
    prefix, whole = getattr(model, "part_of", None) or ("", None)
    computed = {name for name, _ in model.named_buffers()} - tensor_names(model)
    lost = [name for name, b in model.named_buffers() if name in computed and _is_meta(b)]
    if lost:
        raise ValueError(f"{_listed(lost)} are buffers on the meta device that no checkpoint holds (computed when the "
                         "model is built, as a rotary embedding's frequencies): the model was built under "
                         "torch.device('meta'). Build it under tpf.meta_parameters() instead, which puts only the "
                         "parameters on meta")
    if isinstance(path, (str, os.PathLike)):
        check_complete(path if os.path.isdir(path) or not os.path.exists(path) else os.path.dirname(path) or ".")
    handles, sources = {}, {}
    where = os.fspath(path) if isinstance(path, (str, os.PathLike)) else [os.fspath(p) for p in path]
    digests = ReadDigests(model)  # the bytes each rank reads, compared with another rank's read of them
    with contextlib.ExitStack() as stack:
        files = _files(path)
        agree_on_files(model, files)
        # the reads compared at the end; a rank failing on the way says so there, which names it on every rank
        stack.enter_context(digests.reading())
        for file in files:
            try:
                handle = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            except Exception as e:  # safetensors' own words name neither the file nor what is wrong with it
                raise ValueError(f"{file} is not a readable safetensors file (corrupt or truncated?): "
                                 f"{type(e).__name__}: {e}") from e
            handles.update(dict.fromkeys(handle.keys(), handle))
            sources.update(dict.fromkeys(handle.keys(), file))
        renamed, stacked = checkpoint_sources(model, list(handles))  # transformers' own conversions (MoE experts)
        tensors = []
        for names, t, owners in _tensors(model).values():
            names = [n[len(prefix):] if n.startswith(prefix) else n for n in names]
            tensors.append((next((n for n in names if n in handles or n in renamed or n in stacked), None), names, t,
                            owners))
        expected = {n for _, names, _, _ in tensors for n in names} | (whole or set())
        expected |= {renamed[n] for n in expected if n in renamed}
        expected |= {k for n in expected & stacked.keys() for part in stacked[n].keys for k in part}
        ignored = _ignored(model)
        unexpected = sorted(k for k in handles if k not in expected and not (ignored and ignored.search(k))) if strict \
            else []
        # a buffer the files lack keeps its value (one computed when the model was built); a parameter is an error
        tensors = [entry for entry in tensors if entry[0] is not None or isinstance(entry[2], nn.Parameter)
                   or _is_meta(entry[2])]
        missing = [names[0] for key, names, _, _ in tensors if key is None]
        if missing or unexpected:
            lacks = f"has no tensor for {_listed(missing)}" if missing else ""
            extra = f"has {len(unexpected)} tensors that the model does not have: {_listed(unexpected)}" \
                if unexpected else ""
            fix = "is it this model's?" if missing else \
                "is it this model's (a larger model's, say)? Load the model's own checkpoint, or pass strict=False " \
                "to skip the tensors the model does not have"
            both = " and " if missing and unexpected else ""
            raise KeyError(f"the checkpoint at {where} {lacks}{both}{extra}: {fix}")
        for key, _, t, owners in tensors:
            if isinstance(t, DTensor) and get_placement(t).coordinate() is None:
                continue  # a rank outside the tensor's placement holds nothing of it
            source = sources.get(key) or sources.get(renamed.get(key)) or where
            def seen(ranges, read, key=key, source=source) -> None:
                digests.add(key, ranges, read, source)

            try:
                value = _read(handles, key, renamed, stacked, t, seen)
                for other in neighbours(t) if digests.groups else ():  # the next rank's block: read, hashed, dropped
                    _read(handles, key, renamed, stacked, t, seen, other)
            except Exception as e:
                raise ValueError(f"reading {key!r} from {source} failed (a corrupt or truncated file?): "
                                 f"{type(e).__name__}: {e}") from e
            if isinstance(t, DTensor):
                if t.to_local().is_meta:  # made global without a plan: its block was never allocated
                    _allocate(t, value)
                else:
                    t.to_local().copy_(value)
            elif t.is_meta:  # a plain parameter never allocated: it takes the file's tensor, under every name
                loaded = value.to(t.dtype)
                loaded = type(t)(loaded, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else loaded
                for module, attr in owners:
                    (module._parameters if attr in module._parameters else module._buffers)[attr] = loaded
            else:
                t.copy_(value)
    left = [names[0] for names, t, _ in _tensors(model).values() if _is_meta(t)]
    if left:  # never silently: the forward would fail far from here
        raise ValueError(f"{_listed(left)} are still on the meta device after loading {where}: build the model "
                         "under tpf.meta_parameters(), parallelize it or make it global, then load")
    return model


def _read(handles: dict, key: str, renamed: dict, stacked: dict, t: torch.Tensor, seen: Seen,
          coordinate: Sequence[int] | None = None) -> torch.Tensor:
    """The block of ``t`` the rank at ``coordinate`` (default: this rank) holds, from wherever the files keep it;
    ``seen`` told what was read."""
    if key in handles:
        return read_block(handles[key], key, t, coordinate, seen)
    if key in renamed:
        return read_block(handles[renamed[key]], renamed[key], t, coordinate, seen)
    return read_stacked(handles, stacked[key], t, coordinate, seen)  # per-expert tensors, stacked


def unique_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each tensor once: a tied parameter (an embedding and its head) under its first
    name only, so that a checkpoint holds it once.

    For ``torch.distributed.checkpoint``: ``dcp.save(unique_state_dict(model), ...)`` writes one entry per tensor,
    and ``dcp.load(unique_state_dict(model), ...)`` fills the model in place, so every name of a tied parameter
    gets the values (``model.state_dict()`` lists a tied tensor under each name, and dcp would write it twice).

    Args:
        model: any model (parallelized or not).

    Returns:
        Names to tensors (detached, sharing the parameters' and buffers' storage), in ``state_dict`` order.

    Example::

        >>> import tpflow as tpf
        >>> from torch import nn
        >>> lm = nn.ModuleDict({"embed": nn.Embedding(10, 4), "head": nn.Linear(4, 10, bias=False)})
        >>> lm.head.weight = lm.embed.weight
        >>> list(lm.state_dict()), list(tpf.unique_state_dict(lm))
        (['embed.weight', 'head.weight'], ['embed.weight'])
    """
    seen: set[int] = set()
    unique = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            unique[name] = t.detach()
    return unique
