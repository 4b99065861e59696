"""PEFT's LoRA adapters on tpflow's split layers, in either order: ``get_peft_model`` of a parallelized model
(``tpf.lora(config)``), or ``parallelize`` of a PEFT model (``tpflow.plans.adapters``).

An adapter follows its base layer's layout, as Megatron's and torchtitan's LoRA do. After a column layer (its output
split over the features) ``lora_A`` is whole on every rank, a replica, and ``lora_B`` a column layer over the base's
output chunks, so the adapter's output adds to the base's block by block; ``lora_B``'s backward sums its input's
gradient over the ranks, so ``lora_A`` gets one device's gradient. Before a row layer (its input split) ``lora_A`` is
a row layer over the base's input chunks, its output summed over the ranks, and ``lora_B`` whole: the adapter's
output is whole, as the base's. On a layer left whole (a router, key/value projections kept whole with fewer heads
than ranks) both are replicas whose gradients are found as the base's. PEFT's own code (``forward``, ``set_adapter``,
saving the adapters' state, ``merge_and_unload``) then runs unchanged: a merge adds each rank's block of
``lora_B @ lora_A`` to its block of the base's weight.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow.global_tensor import get_placement
from tpflow.layers import ColumnParallelLinear, RowParallelLinear
from tpflow.layers.replicated import replicate
from tpflow.placement import Placement
from tpflow.plans import heads

__all__ = ["lora"]


@functools.cache
def lora_classes() -> dict[type, type]:
    """The LoRA layer of each base layer kind (subclasses of PEFT's, imported when first asked for): a column and a
    row layer's, and a whole ``nn.Linear``'s on a parallelized model."""
    from peft.tuners.lora import Linear

    class _SplitLora(Linear):
        def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
            return module.in_features, module.out_features  # the whole layer's, as PEFT's for nn.Linear

        def resolve_lora_variant(self, **kwargs: Any) -> Any:
            variant = super().resolve_lora_variant(**kwargs)
            if variant is not None:
                raise ValueError(f"{type(variant).__name__} (DoRA and PEFT's other LoRA variants) on a split "
                                 f"{type(self.base_layer).__name__} is not supported: DoRA's weight norm spans the "
                                 "ranks' blocks; use plain LoRA there (use_dora=False; rsLoRA works)")
            return variant

        def update_layer(self, adapter_name: str, *args: Any, **kwargs: Any) -> None:
            super().update_layer(adapter_name, *args, **kwargs)
            self.split(adapter_name)

        def get_delta_weight(self, adapter: str) -> torch.Tensor:
            """This rank's block of ``lora_B @ lora_A``, laid out as the base's weight (for ``merge``/``unmerge``)."""
            a, b = (self.lora_A[adapter].weight, self.lora_B[adapter].weight)
            delta = _local(b) @ _local(a) * self.scaling[adapter]
            weight = self.base_layer.weight
            return DTensor.from_local(delta.to(weight.dtype), weight.device_mesh, weight.placements, run_check=False,
                                      shape=weight.shape, stride=weight.stride())

    class ColumnLora(_SplitLora):
        """LoRA on a ``ColumnParallelLinear``: ``lora_A`` whole, ``lora_B`` split like the base's output."""

        def split(self, name: str) -> None:
            base = self.base_layer
            if base.gather_output or base.sequence_parallel or getattr(base, "global_output", False):
                raise ValueError(f"LoRA on {getattr(base, 'label', 'a column layer')}, which gathers its output or "
                                 "splits the sequence, is not supported: target layers a plain tpf.ColumnParallel() "
                                 "splits")
            self.lora_B[name] = ColumnParallelLinear.from_linear(self.lora_B[name], placement=base.placement)
            replicate(self.lora_A[name], base.placement)

    class RowLora(_SplitLora):
        """LoRA on a ``RowParallelLinear``: ``lora_A`` split like the base's input, ``lora_B`` whole."""

        def split(self, name: str) -> None:
            base = self.base_layer
            if not base.input_is_parallel or base.sequence_parallel:
                raise ValueError(f"LoRA on {getattr(base, 'label', 'a row layer')}, which takes its whole input or "
                                 "splits the sequence, is not supported: target layers a plain tpf.RowParallel() "
                                 "splits")
            self.lora_A[name] = RowParallelLinear.from_linear(self.lora_A[name], placement=base.placement,
                                                              input_is_parallel=True)
            replicate(self.lora_B[name], base.placement)

    class WholeLora(Linear):
        """LoRA on an ``nn.Linear`` a parallelized model keeps whole: both adapters replicas."""

        def update_layer(self, adapter_name: str, *args: Any, **kwargs: Any) -> None:
            super().update_layer(adapter_name, *args, **kwargs)
            weight = self.base_layer.weight
            if isinstance(weight, DTensor):
                placement = get_placement(weight)
                grads = follow_whole(self, adapter_name, placement)
                for part in ("lora_A", "lora_B"):
                    replicate(getattr(self, part)[adapter_name], placement, grads.get(f"{part}.{adapter_name}", "auto"))

    return {ColumnParallelLinear: ColumnLora, RowParallelLinear: RowLora, nn.Linear: WholeLora}


def follow_whole(layer: nn.Module, adapter: str, placement: Placement) -> dict[str, str]:
    """Lay out ``adapter`` of a LoRA layer whose base stays whole as the base: on key/value heads kept whole (each rank
    computing its head's columns, ``tpflow.plans.heads``), ``lora_B`` returns the same columns and its gradient is a
    partial sum, ``lora_A``'s whole; returns those ways to find each adapter's gradients (``replicate``'s ``grads``)
    by child name, empty where they are found on first use.

    Args:
        layer: a PEFT LoRA layer.
        adapter: the adapter's name.
        placement: the ranks; the last axis is tensor parallel.

    Returns:
        ``{"lora_A.<adapter>": "whole", "lora_B.<adapter>": "partial"}`` on kept heads, else ``{}``.

    Example::

        >>> import peft
        >>> from torch import nn
        >>> model = peft.get_peft_model(nn.Sequential(nn.Linear(8, 4)), peft.LoraConfig(r=2, target_modules=["0"]))
        >>> follow_whole(model.base_model.model[0], "default", tpf.placement("cpu", ranks=[0, 1]))
        {}
    """
    span = heads.kept_columns(layer.base_layer)
    if span is None:
        return {}
    heads.keep_columns(layer.lora_B[adapter], *span, placement)
    return {f"lora_A.{adapter}": "whole", f"lora_B.{adapter}": "partial"}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def lora(config: Any) -> Any:
    """Make a PEFT ``LoraConfig`` put its adapters on a parallelized model's layers, each following its base layer's
    layout (see the module's docstring): ``tpf.adopt(get_peft_model(parallelized_model, tpf.lora(config)))`` (``adopt``
    makes its ``save_pretrained`` write PEFT's files). The other order, ``tpf.parallelize(get_peft_model(model,
    config), ...)``, needs neither.

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
                         "parallelized model is not supported: target its linear layers (target_modules)")
    config._register_custom_module(lora_classes())
    return config
