"""PEFT's LoRA adapters on tpflow's split layers, in either order: ``get_peft_model`` of a parallelized model
(``tpf.lora(config)``, which PEFT's own call applies: ``tpflow.hf.peft_calls``), or ``parallelize`` of a PEFT
model (``tpflow.hf.adapters``).

An adapter follows its base layer's layout, as Megatron's and torchtitan's LoRA do. After a column layer (its output
split over the features) ``lora_A`` is whole on every rank, a replica, and ``lora_B`` a column layer over the base's
output chunks, so the adapter's output adds to the base's block by block; ``lora_B``'s backward sums its input's
gradient over the ranks, so ``lora_A`` gets one device's gradient. Before a row layer (its input split) ``lora_A`` is
a row layer over the base's input chunks, its output summed over the ranks, and ``lora_B`` whole: the adapter's
output is whole, as the base's. Under sequence parallelism the split factor takes the base's options too: the adapter
gathers (or reduce-scatters) its ``r`` features where the base does its activations. On a layer left whole (a router,
key/value projections kept whole with fewer heads than ranks) both are replicas whose gradients are found as the
base's. On a vocabulary-parallel embedding ``lora_embedding_A`` splits over the vocabulary as the base's rows.
On a mixture's fused experts (PEFT's ``target_parameters``) the factors split as the experts
(``ExpertsLora``). PEFT's own code (``forward``, ``set_adapter``, saving the adapters' state, ``merge_and_unload``)
then runs unchanged: a merge adds each rank's block of ``lora_B @ lora_A`` to its block of the base's weight.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from tpflow import comm
from tpflow.global_tensor import get_placement, gradients
from tpflow.global_tensor.local_blocks import LocalBlocks, LocalReads
from tpflow.hf import heads
from tpflow.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tpflow.layers.expert_factors import factors_like
from tpflow.layers.experts import add_delta, mark_over_data, over_data
from tpflow.layers.replicated import replicate
from tpflow.placement import Placement

__all__ = ["experts_lora_class", "follow_whole", "lora_classes"]


@functools.cache
def lora_classes() -> dict[type, type]:
    """The LoRA layer of each base layer kind (subclasses of PEFT's, imported when first asked for): a column and a
    row layer's, a whole ``nn.Linear``'s on a parallelized model, and an embedding's (split or whole)."""
    from peft.tuners.lora import Embedding, Linear

    class _SplitLora(Linear):
        def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
            return module.in_features, module.out_features  # the whole layer's, as PEFT's for nn.Linear

        def resolve_lora_variant(self, **kwargs: Any) -> Any:
            return _plain(super().resolve_lora_variant(**kwargs), self.base_layer)

        def update_layer(self, adapter_name: str, *args: Any, **kwargs: Any) -> None:
            super().update_layer(adapter_name, *args, **kwargs)
            self.split(adapter_name)

        def get_delta_weight(self, adapter: str) -> torch.Tensor:
            """This rank's block of ``lora_B @ lora_A``, laid out as the base's weight (for ``merge``/``unmerge``)."""
            a, b = (self.lora_A[adapter].weight, self.lora_B[adapter].weight)
            return _laid_out_as(_local(b) @ _local(a) * self.scaling[adapter], self.base_layer.weight)

    class ColumnLora(_SplitLora):
        """LoRA on a ``ColumnParallelLinear``: ``lora_A`` whole, ``lora_B`` split like the base's output."""

        def split(self, name: str) -> None:
            base = self.base_layer
            tokens = _tokens(base)  # sequence parallel: lora_A on this rank's tokens, lora_B gathers its r features
            output = {"gather_output": base.gather_output, "global_output": base.global_output}  # as the base's:
            self.lora_B[name] = ColumnParallelLinear.from_linear(  # a head's whole logits, or split over the vocab
                self.lora_B[name], placement=base.placement, **tokens, **output)
            replicate(self.lora_A[name], base.placement, "partial" if tokens else "auto")

    class RowLora(_SplitLora):
        """LoRA on a ``RowParallelLinear``: ``lora_A`` split like the base's input, ``lora_B`` whole."""

        def split(self, name: str) -> None:
            base = self.base_layer
            if not base.input_is_parallel:
                raise ValueError(f"LoRA on {getattr(base, 'label', 'a row layer')}, which takes its whole input, is "
                                 "not supported: target layers a tpf.RowParallel(input_is_parallel=True) splits")
            tokens = _tokens(base)  # sequence parallel: lora_A reduce-scatters to this rank's tokens, lora_B on them
            self.lora_A[name] = RowParallelLinear.from_linear(self.lora_A[name], placement=base.placement,
                                                              input_is_parallel=True, **tokens)
            replicate(self.lora_B[name], base.placement, "partial" if tokens else "auto")

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

    class EmbeddingLora(Embedding):
        """LoRA on an embedding of a parallelized model: on a ``VocabParallelEmbedding``, ``lora_embedding_A``
        (``[r, V]``) split over the vocabulary as the base's rows, the lookup of its rows summed over the ranks (or
        reduce-scattered to this rank's tokens) as the base's is; on an embedding left whole, both factors whole.
        Around each call PEFT's forward reads the factors' local blocks."""

        def resolve_lora_variant(self, **kwargs: Any) -> Any:
            variant = super().resolve_lora_variant(**kwargs)
            return _plain(variant, self.base_layer) if isinstance(self.base_layer, VocabParallelEmbedding) else variant

        def update_layer(self, adapter_name: str, *args: Any, **kwargs: Any) -> None:
            super().update_layer(adapter_name, *args, **kwargs)
            self.split(adapter_name)

        def split(self, name: str, placement: Placement | None = None) -> None:
            """Make adapter ``name``'s factors global, laid out as the base (whole on ``placement``'s ranks where
            the base is still plain: ``parallelize`` replicates it after this)."""
            weight = self.base_layer.weight
            if isinstance(weight, DTensor):
                mesh, vocab = weight.device_mesh, tuple(Shard(1) if isinstance(q, Shard) else Replicate()
                                                        for q in weight.placements)
            elif placement is not None and placement.coordinate() is not None:
                mesh, vocab = placement.mesh, (Replicate(),) * placement.ndim
            else:
                return  # a plain model: PEFT's own
            if "_tpflow_reads" not in self.__dict__:
                object.__setattr__(self, "_tpflow_reads", {})
                self.register_forward_pre_hook(_enter_factors)
                self.register_forward_hook(_leave_factors, always_call=True)
            for factors, placements in ((self.lora_embedding_A, vocab), (self.lora_embedding_B, None)):
                value = factors[name].detach().to(mesh.device_type)
                value = distribute_tensor(value, mesh, placements or (Replicate(),) * mesh.ndim, src_data_rank=None)
                factors[name] = gradients.adopt(nn.Parameter(value, requires_grad=factors[name].requires_grad))

        def _embed(self, input: torch.Tensor, weight: torch.Tensor, input_fn: Any = None,
                   output_fn: Any = None) -> torch.Tensor:
            """On a vocabulary-parallel base: the rows of this rank's block of ``A`` for the ids in its range, summed
            over the ranks; else PEFT's own lookup."""
            base = self.base_layer
            if not isinstance(base, VocabParallelEmbedding):
                return super()._embed(input, weight, input_fn, output_fn)
            start, end = base.local_range(base.num_embeddings)
            outside = (input < start) | (input >= end)
            pad = base.padding_idx - start if base.padding_idx is not None and start <= base.padding_idx < end else None
            y = F.embedding((input - start).masked_fill(outside, 0), weight, pad).masked_fill(outside[..., None], 0)
            if base.group is None:
                return y
            if base.sequence_parallel:
                return comm.reduce_scatter_to_ranks(y, base.sequence_dim, base.group)
            return comm.reduce_from_ranks(y, base.group)

        def get_delta_weight(self, adapter: str) -> torch.Tensor:
            """This rank's rows of ``(B @ A).T``, laid out as the base's weight (``merge`` / ``unmerge``)."""
            delta = (_local(self.lora_embedding_B[adapter]) @ _local(self.lora_embedding_A[adapter])).T
            return _laid_out_as(delta * self.scaling[adapter], self.base_layer.weight)

    return {ColumnParallelLinear: ColumnLora, RowParallelLinear: RowLora, nn.Linear: WholeLora,
            VocabParallelEmbedding: EmbeddingLora, nn.Embedding: EmbeddingLora}


def _factor_grads(sequence_parallel: bool):
    """An embedding LoRA's factors' gradient layouts: ``A``'s split as it is (its rows looked up here only), whole
    factors' whole (every rank looks up the same ids), or partial sums where the ranks look up other tokens (sequence
    parallel) and over data axes."""
    def grads(p: DTensor) -> tuple:
        last = p.device_mesh.ndim - 1
        return tuple(Partial() if isinstance(q, Replicate) and n > 1 and (axis < last or sequence_parallel) else q
                     for axis, (q, n) in enumerate(zip(p.placements, p.device_mesh.shape)))
    return grads


def _enter_factors(module: nn.Module, args: tuple) -> None:
    """Before an embedding LoRA's call: its factors read as local blocks, where PEFT's forward indexes them."""
    grads = _factor_grads(getattr(module.base_layer, "sequence_parallel", False))
    for factors in (module.lora_embedding_A, module.lora_embedding_B):
        names = tuple(factors.keys())
        reads = module._tpflow_reads.setdefault((id(factors), names), LocalReads(names, grads))
        reads.enter(factors)


def _leave_factors(module: nn.Module, args: tuple, output: object) -> None:
    for factors in (module.lora_embedding_A, module.lora_embedding_B):
        for name in factors:
            factors.__dict__.pop(name, None)


@functools.cache
def experts_lora_class() -> type:
    """The LoRA layer of a split experts module's fused parameter (PEFT's ``target_parameters``): a subclass of PEFT's
    ``ParamWrapper``, imported when first asked for."""
    from peft.tuners.lora.layer import ParamWrapper

    class ExpertsLora(ParamWrapper):
        """PEFT's LoRA on a fused experts parameter (``experts.gate_up_proj``) that ``split_experts`` split: the factors
        split as the parameter is (``factors_like``), and around each call of the experts the delta of their local
        blocks added to the block the module reads (``add_delta``), where PEFT would parametrize the whole
        parameter."""

        def follow(self) -> None:
            """Split every adapter as the parameter, and add the delta to the experts' reads (once)."""
            object.__setattr__(self, "_tpflow_blocks", LocalBlocks())
            for adapter in self.lora_A:
                self.split(adapter)
            add_delta(self.get_base_layer(), self.parameter_name, self.local_delta)

        def split(self, adapter: str) -> None:
            experts = self.get_base_layer()
            a, b = factors_like(experts, self.parameter_name, self.lora_A[adapter].weight,
                                self.lora_B[adapter].weight, self.r[adapter], self._did_swap_in_out_features)
            over = over_data(experts._parameters[self.parameter_name])  # FSDP2 leaves them as it leaves the experts
            self.lora_A[adapter].weight, self.lora_B[adapter].weight = (mark_over_data(f, over) for f in (a, b))

        def update_layer(self, adapter_name: str, *args: Any, **kwargs: Any) -> None:
            super().update_layer(adapter_name, *args, **kwargs)
            if "_tpflow_blocks" in self.__dict__:  # an adapter added after parallelize
                self.split(adapter_name)

        @contextlib.contextmanager
        def _activate_lora(self, active_adapters: list[str]) -> Iterator[None]:
            yield  # the experts' own hook adds the delta to their blocks

        def _delta(self, a: torch.Tensor, b: torch.Tensor, adapter: str) -> torch.Tensor:
            rank = self.r[adapter]
            experts = a.shape[0] // rank
            pattern = "o r e, e r i -> e o i" if self._did_swap_in_out_features else "o r e, e r i -> e i o"
            return torch.einsum(pattern, b.reshape(b.shape[0], rank, experts),
                                a.reshape(experts, rank, a.shape[-1])) * self.scaling[adapter]

        def local_delta(self) -> torch.Tensor | None:
            """This rank's block of the active adapters' change to the parameter, with autograd; None for none."""
            if self.disable_adapters or self.merged:
                return None
            total = None
            for adapter in (a for a in self.active_adapters if a in self.lora_A):
                a, b = self._tpflow_blocks([self.lora_A[adapter].weight, self.lora_B[adapter].weight], key=adapter,
                                           grad_placements=_summed_where_whole)
                delta = self._delta(a, b, adapter)
                total = delta if total is None else total + delta
            return total

        def get_delta_weight(self, adapter: str, *args: Any, **kwargs: Any) -> torch.Tensor:
            """The delta as a global tensor laid out as the parameter (``merge`` / ``unmerge``)."""
            delta = self._delta(_local(self.lora_A[adapter].weight), _local(self.lora_B[adapter].weight), adapter)
            return _laid_out_as(delta, self.get_param())

    return ExpertsLora


def _summed_where_whole(p: DTensor) -> tuple:
    """A factor's gradient layout: a partial sum over each axis of several ranks it is whole on (each rank's block of
    the parameter adds its part), else split as the factor is."""
    return tuple(Partial() if isinstance(q, Replicate) and n > 1 else q for q, n in zip(p.placements,
                                                                                         p.device_mesh.shape))


def follow_whole(layer: nn.Module, adapter: str, placement: Placement) -> dict[str, str]:
    """Lay out ``adapter`` of a LoRA layer whose base stays whole as the base: on key/value heads kept whole (each rank
    computing its head's columns, ``tpflow.hf.heads``), ``lora_B`` returns the same columns and its gradient is a
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
    spans = heads.kept_columns(layer.base_layer)
    if spans is None:
        return {}
    heads.keep_columns(layer.lora_B[adapter], spans, placement)
    return {f"lora_A.{adapter}": "whole", f"lora_B.{adapter}": "partial"}


def _tokens(base: nn.Module) -> dict[str, object]:
    """A sequence-parallel base layer's options its adapter's split factor takes too (none for another)."""
    return {"sequence_parallel": True, "sequence_dim": base.sequence_dim} if base.sequence_parallel else {}


def _plain(variant: Any, base: nn.Module) -> Any:
    """Refuse a LoRA variant (DoRA, ...) on a split layer: DoRA's weight norm spans the ranks' blocks."""
    if variant is not None:
        raise ValueError(f"{type(variant).__name__} (DoRA and PEFT's other LoRA variants) on a split "
                         f"{type(base).__name__} is not supported: DoRA's weight norm spans the ranks' blocks; use "
                         "plain LoRA there (use_dora=False; rsLoRA works)")
    return variant


def _laid_out_as(delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """This rank's block ``delta`` of a change to ``weight``, as a global tensor laid out as it (plain if it is)."""
    delta = delta.to(weight.dtype)
    if not isinstance(weight, DTensor):
        return delta
    return DTensor.from_local(delta, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape,
                              stride=weight.stride())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
