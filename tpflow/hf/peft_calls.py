"""PEFT's own calls on a model ``parallelize`` changed, taken as one device takes them, with nothing to add.

PEFT dispatches each targeted layer by its type, and knows none of tpflow's; it saves through the storage of each
tensor, which a global tensor does not have; and where a model's parameters are global tensors it takes a tensor of
the shape of this rank's block as the block (its rule for transformers' tensor parallelism, whose ranks may load
their shards), so an adapter trained for a base 1/W the size would load. ``follow_peft`` (run by ``parallelize``)
wraps four of PEFT's functions, each acting on a model ``parallelize`` changed only (``placement_of``, or a tpflow
layer's type) and leaving every other model to PEFT:

- ``LoraModel.inject_adapter`` (``get_peft_model``, ``add_adapter``, ``load_adapter``, ``from_pretrained``) puts
  tpflow's LoRA layers on the split layers, as ``tpf.lora(config)`` does;
- ``PeftModel.__init__`` makes its ``save_pretrained`` write PEFT's files whole from rank 0, as ``tpf.adopt`` does;
- ``LoraModel._remap_adapter_state_dict_for_load`` (every adapter loaded: PEFT's hook for a tuner's view of a file)
  passes a tensor whose shape is not its parameter's whole shape on as a global tensor of its own shape, so PEFT's
  ``ignore_mismatched_sizes`` and torch's "size mismatch" see what one device sees;
- ``has_valid_embedding_base_layer`` (whether a targeted embedding or head has a base layer to save beside the
  adapter, by type) takes a column layer (a head split over the vocabulary) as the ``nn.Linear`` it stands for, so
  the file holds the head's base weight as one device's does.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from tpflow.hf.adapters import wrapped_model
from tpflow.hf.frameworks import placement_of
from tpflow.hf.lora import lora_classes
from tpflow.hf.pretrained import export_whole
from tpflow.layers import ColumnParallelLinear

__all__ = ["follow_peft", "lora"]

_FOLLOWS = "_tpflow_follows"  # on LoraModel, once its methods are wrapped


def follow_peft() -> None:
    """Make PEFT's ``get_peft_model``, ``save_pretrained`` and adapter loading take a model ``parallelize`` changed as
    one device's (see the module's docstring): once per process, where PEFT is loaded, or installed beside a loaded
    transformers (a Hugging Face model's program imports PEFT later as often as before).

    Example::

        >>> import peft
        >>> from torch import nn
        >>> follow_peft()                                       # parallelize calls it
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> mlp = tpf.parallelize(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), placement=P,
        ...                       plan={"0": "column", "2": "row"})
        >>> model = peft.get_peft_model(mlp, peft.LoraConfig(r=4, target_modules=["0", "2"]))   # PEFT's own call
        >>> type(model.base_model.model[0]).__name__, type(model.base_model.model[0].lora_B["default"]).__name__
        ('ColumnLora', 'ColumnParallelLinear')
    """
    if "peft" not in sys.modules and ("transformers" not in sys.modules or importlib.util.find_spec("peft") is None):
        return
    from peft import PeftModel
    from peft.tuners.lora import LoraModel
    from peft.utils import save_and_load

    if LoraModel.__dict__.get(_FOLLOWS):
        return
    LoraModel.inject_adapter = _puts_split_layers(LoraModel.inject_adapter)
    remap = LoraModel._remap_adapter_state_dict_for_load.__func__  # a classmethod's function
    LoraModel._remap_adapter_state_dict_for_load = classmethod(_loads_whole_shapes(remap))
    PeftModel.__init__ = _saves_whole(PeftModel.__init__)
    save_and_load.has_valid_embedding_base_layer = _head_saved(save_and_load.has_valid_embedding_base_layer)
    setattr(LoraModel, _FOLLOWS, True)


def _split(model: nn.Module) -> bool:
    """Whether ``model`` (or the model a PEFT wrapper holds) is one ``parallelize`` changed."""
    return placement_of(wrapped_model(model)[0]) is not None


def _puts_split_layers(inject: Callable) -> Callable:
    """PEFT's ``inject_adapter``, given tpflow's LoRA layers (``tpf.lora``) for a split model's layers."""

    @functools.wraps(inject)
    def inject_adapter(self, model: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> None:
        if _split(model):
            lora(self.peft_config[adapter_name])
        return inject(self, model, adapter_name, *args, **kwargs)

    return inject_adapter


def _saves_whole(init: Callable) -> Callable:
    """PEFT's ``PeftModel.__init__``, which makes a split model's ``save_pretrained`` gather (``export_whole``)."""

    @functools.wraps(init)
    def __init__(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        init(self, model, *args, **kwargs)
        if _split(model):
            export_whole(self)

    return __init__


def _loads_whole_shapes(remap: Callable) -> Callable:
    """PEFT's ``_remap_adapter_state_dict_for_load``, after which a split model's tensor of another shape than its
    parameter's whole one goes on as a global tensor of that shape (whole on every rank), which PEFT does not take as
    this rank's block: its ``ignore_mismatched_sizes`` drops it, or torch's ``load_state_dict`` reports the size
    mismatch, as on one device."""

    @functools.wraps(remap)
    def remap_adapter_state_dict_for_load(cls, model: nn.Module, *args: Any, **kwargs: Any) -> dict:
        state = remap(cls, model, *args, **kwargs)
        if not _split(model):
            return state
        params = dict(model.named_parameters())
        for key, value in state.items():
            param = params.get(key, params.get(key.removeprefix("base_model.model.")))
            if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                    and value.shape != param.shape:
                mesh = param.device_mesh
                state[key] = DTensor.from_local(value, mesh, (Replicate(),) * mesh.ndim, run_check=False)
        return state

    return remap_adapter_state_dict_for_load


def _head_saved(valid: Callable) -> Callable:
    """PEFT's ``has_valid_embedding_base_layer``, true of a LoRA layer on a column layer too."""

    @functools.wraps(valid)
    def has_valid_embedding_base_layer(layer: nn.Module) -> bool:
        return valid(layer) or isinstance(getattr(layer, "base_layer", None), ColumnParallelLinear)

    return has_valid_embedding_base_layer


def lora(config: Any) -> Any:
    """Make a PEFT ``LoraConfig`` put its adapters on a parallelized model's layers, each following its base layer's
    layout (see the module's docstring). PEFT's own ``get_peft_model(parallelized_model, config)`` applies it itself,
    as do its ``add_adapter``, ``load_adapter`` and ``PeftModel.from_pretrained`` on such a model
    (``follow_peft``, set up by ``parallelize`` and by this function); calling it is needed only where
    PEFT is first imported after ``parallelize`` in a program that has not loaded transformers.

    Args:
        config: a ``peft.LoraConfig``.

    Returns:
        ``config``, which now maps ``ColumnParallelLinear``, ``RowParallelLinear`` and whole ``nn.Linear`` layers
        to their LoRA layers.

    Example::

        >>> import peft
        >>> from torch import nn
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        >>> mlp = tpf.parallelize(mlp, placement=P, plan={"0": "column", "2": "row"})
        >>> model = peft.get_peft_model(mlp, tpf.lora(peft.LoraConfig(r=4, target_modules=["0", "2"])))
        >>> type(model.base_model.model[0].lora_B["default"]).__name__      # split like the base's output
        'ColumnParallelLinear'
        >>> model(torch.randn(3, 8)).shape
        torch.Size([3, 8])
    """
    if getattr(config, "target_parameters", None):
        raise ValueError(f"LoRA on parameters (target_parameters={config.target_parameters}, a mixture's experts) of a "
                         "parallelized model is not supported: PEFT wraps them before tpflow can split its factors; "
                         "take the other order, tpf.parallelize(get_peft_model(model, config), ...)")
    follow_peft()
    config._register_custom_module(lora_classes())
    return config
