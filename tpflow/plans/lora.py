"""PEFT's LoRA adapters on tpflow's split layers: ``get_peft_model`` of a parallelized model.

An adapter follows its base layer's layout, as Megatron's and torchtitan's LoRA do. After a column layer (its output
split over the features) ``lora_A`` is whole on every rank, a replica, and ``lora_B`` a column layer over the base's
output chunks, so the adapter's output adds to the base's block by block; ``lora_B``'s backward sums its input's
gradient over the ranks, so ``lora_A`` gets one device's gradient. Before a row layer (its input split) ``lora_A`` is
a row layer over the base's input chunks, its output summed over the ranks, and ``lora_B`` whole: the adapter's
output is whole, as the base's. PEFT finds these layers through its custom-module mapping, which ``lora`` gives a
config; its own code (``forward``, ``set_adapter``, saving the adapters' state) then runs unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from tpflow.layers import ColumnParallelLinear, RowParallelLinear
from tpflow.layers.replicated import replicate

__all__ = ["lora"]


@functools.cache
def _split_lora_classes() -> tuple[type, type]:
    """The LoRA layers of a column and of a row layer, subclasses of PEFT's (imported when first asked for)."""
    from peft.tuners.lora import Linear

    class _SplitLora(Linear):
        def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
            return module.in_features, module.out_features  # the whole layer's, as PEFT's for nn.Linear

        def update_layer(self, adapter_name: str, *args: Any, **kwargs: Any) -> None:
            super().update_layer(adapter_name, *args, **kwargs)
            self.split(adapter_name)

        def merge(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"merging a LoRA adapter into a split {type(self.base_layer).__name__} is refused: its "
                               "blocks would have to be merged block by block; save the adapter (save_pretrained) "
                               "and merge it on one device")

    class ColumnLora(_SplitLora):
        """LoRA on a ``ColumnParallelLinear``: ``lora_A`` whole, ``lora_B`` split like the base's output."""

        def split(self, name: str) -> None:
            base = self.base_layer
            if base.gather_output or base.sequence_parallel or getattr(base, "global_output", False):
                raise ValueError(f"LoRA on {base.label if hasattr(base, 'label') else 'a column layer'} that gathers "
                                 "its output or splits the sequence is not supported yet: target the layers a plain "
                                 "tpf.ColumnParallel() split")
            self.lora_B[name] = ColumnParallelLinear.from_linear(self.lora_B[name], placement=base.placement)
            replicate(self.lora_A[name], base.placement)

    class RowLora(_SplitLora):
        """LoRA on a ``RowParallelLinear``: ``lora_A`` split like the base's input, ``lora_B`` whole."""

        def split(self, name: str) -> None:
            base = self.base_layer
            if not base.input_is_parallel or base.sequence_parallel:
                raise ValueError("LoRA on a row layer that takes its whole input or splits the sequence is not "
                                 "supported yet: target the layers a plain tpf.RowParallel() split")
            self.lora_A[name] = RowParallelLinear.from_linear(self.lora_A[name], placement=base.placement,
                                                              input_is_parallel=True)
            replicate(self.lora_B[name], base.placement)

    return ColumnLora, RowLora


def lora(config: Any) -> Any:
    """Make a PEFT ``LoraConfig`` put its adapters on tpflow's split layers, each following its base layer's layout
    (see the module's docstring): ``get_peft_model(parallelized_model, tpf.lora(config))``.

    Args:
        config: a ``peft.LoraConfig``.

    Returns:
        ``config``, which now maps ``ColumnParallelLinear`` and ``RowParallelLinear`` to their LoRA layers.

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
    column, row = _split_lora_classes()
    config._register_custom_module({ColumnParallelLinear: column, RowParallelLinear: row})
    return config
