"""Loading a model at scale: built without its values, parallelized, then each rank reads only its blocks.

    with tpf.meta_parameters():                      # parameters on the meta device: no memory, no init
        model = AutoModelForCausalLM.from_config(config)
    tpf.parallelize(model, placement=P, plan="auto")  # each rank allocates its blocks, uninitialised
    tpf.load_safetensors(model, "path/to/model")     # each rank reads its slices of each tensor

A rank's host memory then holds its blocks and the whole replicated parameters (norms), about 1/W of the
model, where building the whole model on every rank first holds W whole copies on a node. The safetensors
files are memory-mapped and each block is read as a slice (``safe_open(...).get_slice``); the values are the
file's, bit for bit, as the regular load gives them.
"""

from __future__ import annotations

import contextlib
import json
import os
import weakref
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow.global_tensor.blocks import get_placement, get_sbp
from tpflow.sbp import local_region

__all__ = ["load_safetensors", "meta_parameters", "unique_state_dict"]


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """A context manager under which modules are built with their parameters on the meta device (no memory, no
    initialisation) and their buffers where they would be (a rotary embedding's frequencies, computed as usual).

    Parameters made in the block are moved to meta as they are registered, before a module initialises them, so
    their host memory is never touched. ``parallelize`` then allocates each rank's blocks (uninitialised) and
    ``load_safetensors`` fills them.

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
        if param is not None and not param.is_meta:
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
    (``model.safetensors``, or the shards its ``model.safetensors.index.json`` lists, or every ``*.safetensors``)."""
    if not isinstance(path, (str, os.PathLike)):
        return [os.fspath(p) for p in path]
    path = os.fspath(path)
    if not os.path.isdir(path):
        return [path]
    index = os.path.join(path, "model.safetensors.index.json")
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


def _read(handle, key: str, t: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``t`` read from the file's tensor ``key``: only its slices, for a global tensor."""
    sliced = handle.get_slice(key)
    if tuple(sliced.get_shape()) != tuple(t.shape):
        raise ValueError(f"{key!r} is {tuple(sliced.get_shape())} in the checkpoint but {tuple(t.shape)} in the model")
    if not isinstance(t, DTensor):
        return handle.get_tensor(key)
    pl = get_placement(t)
    offsets, lengths = local_region(t.shape, get_sbp(t), pl.hierarchy, pl.coordinate())
    return sliced[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]


@torch.no_grad()
def load_safetensors(model: nn.Module, path: str | os.PathLike | Sequence[str | os.PathLike]) -> nn.Module:
    """Fill ``model``'s parameters and persistent buffers from safetensors files, each rank reading only its
    blocks of each global tensor.

    Made for a model built under ``tpf.meta_parameters()`` and parallelized (its blocks allocated, not
    initialised), so that no rank ever holds the whole model; it loads any model whose names match the files'
    (a plain one, a parallelized one). A tied parameter is read once, under whichever of its names the files have
    (Hugging Face saves a tied head under the embedding's name only). The values are cast to the parameters'
    dtypes, and otherwise are the file's, bit for bit.

    Args:
        model: the model to fill, in place; its ``named_parameters`` / ``named_buffers`` names are the files' keys.
        path: a ``.safetensors`` file, a list of them, or a directory as ``from_pretrained`` reads one
            (``model.safetensors`` or the shards of ``model.safetensors.index.json``).

    Returns:
        ``model``.

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
        >>> folder.cleanup()
    """
    try:
        from safetensors import safe_open
    except ImportError as e:
        raise ImportError("load_safetensors needs the safetensors package: pip install safetensors") from e
    handles = {}
    with contextlib.ExitStack() as stack:
        for file in _files(path):
            handle = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            handles.update(dict.fromkeys(handle.keys(), handle))
        tensors = [(next((n for n in names if n in handles), None), names, t, owners)
                   for names, t, owners in _tensors(model).values()]
        # a buffer the files lack keeps its value (one computed when the model was built); a parameter is an error
        tensors = [entry for entry in tensors if entry[0] is not None or isinstance(entry[2], nn.Parameter)
                   or entry[2].is_meta]
        missing = [names[0] for key, names, _, _ in tensors if key is None]
        if missing:
            where = os.fspath(path) if isinstance(path, (str, os.PathLike)) else list(path)
            more = " ..." if len(missing) > 8 else ""
            raise KeyError(f"the checkpoint at {where} has no tensor for {missing[:8]}{more} ({len(missing)} in all): "
                           f"is it this model's?")
        for key, _, t, owners in tensors:
            if isinstance(t, DTensor) and get_placement(t).coordinate() is None:
                continue  # a rank outside the tensor's placement holds nothing of it
            value = _read(handles[key], key, t)
            if isinstance(t, DTensor):
                t.to_local().copy_(value)
            elif t.is_meta:  # a plain parameter never allocated: it takes the file's tensor, under every name
                loaded = value.to(t.dtype)
                loaded = type(t)(loaded, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else loaded
                for module, attr in owners:
                    (module._parameters if attr in module._parameters else module._buffers)[attr] = loaded
            else:
                t.copy_(value)
    return model


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
