"""``parallelize`` of a PEFT model: ``tpf.parallelize(get_peft_model(model, LoraConfig(...)), plan="auto")``.

PEFT wraps the transformers model (``PeftModel`` -> ``LoraModel`` -> the model, named ``base_model.model.``) and each
targeted layer (a LoRA layer holding the layer as ``base_layer``, its adapters as ``lora_A`` / ``lora_B``). The plan is
the wrapped model's own, under the wrapper's prefix (``hf_plan`` reads it through the wrapper). While the plan is
matched and applied, each LoRA layer is lifted out and its base layer stands in its place under its own name, so the
entries see the model as it was (q / k / v fuse, key/value heads stay whole, the heads' rules apply); then each LoRA
layer goes back around what its base became, its adapters laid out as ``tpf.lora``'s (``tpflow.hf.lora``). A
``modules_to_save`` wrapper (PEFT's trainable copy beside a module) is lifted the same way, and its copies get the
module's entry too.
"""

from __future__ import annotations

import math
import sys

from torch import nn

from tpflow.hf.lora import experts_lora_class, follow_whole, lora_classes
from tpflow.hf.multi_query import MultiQueryColumns
from tpflow.layers import ColumnParallelLinear, RowParallelLinear
from tpflow.plans.experts import ExpertParallel, ExpertTensorParallel
from tpflow.plans.linear import ColumnParallel, RowParallel
from tpflow.plans.style import Plan
from tpflow.plans.vocab import VocabParallel

__all__ = ["Lifted", "adapter_keys", "wrapped_model"]


def _peft():
    """PEFT's module if the program imported it (a model can hold PEFT's layers only then), else None."""
    return sys.modules.get("peft")


def wrapped_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The model a ``PeftModel`` wraps and its name inside it (``"base_model.model"``); ``(model, "")`` for any other.

    Args:
        model: any model.

    Returns:
        The wrapped model and its module name, or ``model`` and ``""``.

    Example::

        >>> import peft
        >>> from torch import nn
        >>> wrapped = peft.get_peft_model(nn.Sequential(nn.Linear(4, 4)), peft.LoraConfig(r=2, target_modules=["0"]))
        >>> wrapped_model(wrapped)[1]
        'base_model.model'
    """
    peft = _peft()
    if peft is None or not isinstance(model, peft.PeftModel):
        return model, ""
    inner = model.get_base_model()
    return inner, next(name for name, m in model.named_modules() if m is inner)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


class Lifted:
    """A model's PEFT layers lifted out while a plan is matched and applied, their base layers in their places.

    Args:
        model: the model ``parallelize`` was given (changed in place; nothing happens without PEFT layers).

    Example::

        >>> import peft
        >>> from torch import nn
        >>> wrapped = peft.get_peft_model(nn.Sequential(nn.Linear(4, 4)), peft.LoraConfig(r=2, target_modules=["0"]))
        >>> lifted = Lifted(wrapped)
        >>> type(wrapped.base_model.model[0]).__name__                    # the base layer, under its own name
        'Linear'
        >>> lifted.restore()
        >>> type(wrapped.base_model.model[0]).__name__
        'Linear'
        >>> hasattr(wrapped.base_model.model[0], "lora_A")
        True
    """

    def __init__(self, model: nn.Module) -> None:
        self.model, self.layers, self.copies = model, [], []
        peft = _peft()
        if peft is None:
            return
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import ModulesToSaveWrapper

        inside: set[str] = set()
        for name, module in model.named_modules():
            if any(name.startswith(outer + ".") for outer in inside):
                continue
            if isinstance(module, BaseTunerLayer) and hasattr(module, "base_layer"):
                self.layers.append((name, module))
            elif isinstance(module, ModulesToSaveWrapper):  # modules_to_save: a trainable copy beside the module
                self.copies.append((name, module))
            else:
                continue
            inside.add(name)
        for name, module in self.layers:
            _set(model, name, module.get_base_layer())
        for name, module in self.copies:
            _set(model, name, module.original_module)

    def check(self, plan: Plan) -> None:
        """Refuse, before any change, a PEFT layer on a layer whose entry its adapters cannot follow, and a trainable
        copy (``modules_to_save``) of a layer whose entry its copy cannot take."""
        from peft.tuners.lora import Embedding, Linear

        for name, _ in self.copies:
            entry = plan.entry(name)
            if entry is not None and (not isinstance(entry, (ColumnParallel, RowParallel, VocabParallel)) or (
                    isinstance(entry, ColumnParallel) and entry.keeps_whole(name, plan))):
                raise ValueError(f"modules_to_save={name.rpartition('.')[2]!r}: PEFT's trainable copy of {name!r} "
                                 f"cannot take its entry {entry!r} (copies take column, row and vocabulary entries "
                                 "that split the layer): leave it out of modules_to_save, or out of the plan")

        for name, module in self.layers:
            entry = plan.entry(name)
            if entry is None:
                continue  # a layer left whole: its adapters are replicas as it is
            what = f"PEFT's {type(module).__name__} on {name!r} (plan pattern {plan.pattern(name)!r}: {entry!r})"
            if _on_experts(module):
                if not isinstance(entry, (ExpertTensorParallel, ExpertParallel)):
                    raise ValueError(f"{what}: LoRA on experts' parameters follows experts split or shared out "
                                     "(tpf.ExpertTensorParallel(), tpf.ExpertParallel()) only")
                fsdp = plan.named.leaves_data_axes and math.prod(plan.named.hierarchy[:-1]) > 1
                if fsdp and isinstance(entry, ExpertTensorParallel) and any(
                        w.parameter_name == "gate_up_proj" for w in _chain(module)):
                    raise ValueError(f"{what}: LoRA on gate_up_proj of experts split by the intermediate dim beside "
                                     "FSDP2 is not supported: FSDP2 would split lora_B's rows over the data axes "
                                     "inside their gate / up halves, a layout DTensor gathers wrongly; share the "
                                     "experts out (tpf.hf_plan(model, expert_parallel=True or 'dp'))")
                continue
            vocab = isinstance(entry, VocabParallel) and isinstance(module, Embedding)
            if not (isinstance(module, Linear) or vocab) or hasattr(module.base_layer, "base_layer"):
                raise ValueError(f"{what} is not supported on a split layer: LoRA on nn.Linear layers is; leave the "
                                 "layer out of target_modules, or out of the plan (whole on every rank)")
            if module.lora_variant:
                raise ValueError(f"{what}: DoRA (PEFT's LoRA variants) on a split layer is not supported, its weight "
                                 "norm spans the ranks' blocks; use plain LoRA there (use_dora=False)")
            follows = isinstance(entry, ColumnParallel) or (isinstance(entry, RowParallel) and entry.input_is_parallel)
            follows = follows or isinstance(entry, (VocabParallel, MultiQueryColumns))  # a head, an embedding
            if not follows:
                raise ValueError(f"{what}: adapters follow column, row (input_is_parallel) and vocabulary-parallel "
                                 "layers only: leave the layer out of target_modules, or out of the plan")

    def restore(self) -> None:
        """Put every PEFT layer back unchanged (the plan was refused)."""
        for name, module in [*self.layers, *self.copies]:
            _set(self.model, name, module)

    def put_back(self, plan: Plan) -> None:
        """Put every PEFT layer back around what its base layer became, its adapters laid out as the base; each
        trainable copy of ``modules_to_save`` made what the module's entry made of it."""
        from peft.tuners.lora import Embedding, Linear

        for name, wrapper in self.copies:
            wrapper.original_module = plan.layer(name)
            entry = plan.entry(name)
            for adapter, copy in list(wrapper.modules_to_save.items()):
                layer = None if entry is None else entry.apply(f"{name}.modules_to_save.{adapter}", copy, plan)
                if layer is not None:
                    wrapper.modules_to_save[adapter] = layer
            _set(self.model, name, wrapper)

        classes = lora_classes()
        for name, module in self.layers:
            _chain(module)[-1].base_layer = plan.layer(name)  # PEFT nests a wrapper per experts' parameter
            _set(self.model, name, module)
            if _on_experts(module) and plan.entry(name) is not None:
                for wrapper in _chain(module):
                    wrapper.__class__ = experts_lora_class()
                    wrapper.follow()
                continue
            base = module.base_layer
            kind = next((k for k in (ColumnParallelLinear, RowParallelLinear) if isinstance(base, k)), None)
            if kind is not None:
                module.__class__ = classes[kind]
                for adapter in module.lora_A:
                    module.split(adapter)
            elif isinstance(module, Embedding):  # split over the vocabulary, or left whole (replicated after this)
                module.__class__ = classes[nn.Embedding]
                for adapter in module.lora_embedding_A:
                    module.split(adapter, plan.placement)
            elif isinstance(module, Linear):  # on a layer left whole (k / v heads kept whole): replicated after this
                module.__class__ = classes[nn.Linear]
                for adapter in module.lora_A:
                    grads = follow_whole(module, adapter, plan.placement)
                    plan.grads.update({f"{name}.{child}": way for child, way in grads.items()})


def _chain(module: nn.Module) -> list[nn.Module]:
    """A PEFT layer and the PEFT layers it wraps, outermost first."""
    found = [module]
    while hasattr(found[-1].base_layer, "base_layer"):
        found.append(found[-1].base_layer)
    return found


def _on_experts(module: nn.Module) -> bool:
    """Whether ``module`` is PEFT's LoRA on parameters (``target_parameters``), each of its wrappers one."""
    from peft.tuners.lora.layer import ParamWrapper

    return all(isinstance(m, ParamWrapper) for m in _chain(module))


def adapter_keys(model: nn.Module, adapters: list[str] | None = None) -> set[str] | None:
    """The ``state_dict`` keys a ``PeftModel``'s ``save_pretrained`` writes (its adapters'); None for any other model.

    Args:
        model: any model.
        adapters: the adapters saved (PEFT's ``selected_adapters``; default every one).

    Returns:
        Those keys, under the model's own names.

    Example::

        >>> import peft
        >>> from torch import nn
        >>> wrapped = peft.get_peft_model(nn.Sequential(nn.Linear(4, 4)), peft.LoraConfig(r=2, target_modules=["0"]))
        >>> sorted(adapter_keys(wrapped))
        ['base_model.model.0.lora_A.default.weight', 'base_model.model.0.lora_B.default.weight']
    """
    peft = _peft()
    if peft is None or not isinstance(model, peft.PeftModel):
        return None
    state = model.state_dict(keep_vars=True)
    names = {id(t): k for k, t in state.items()}
    keys: set[str] = set()
    for adapter in adapters or list(model.peft_config):
        picked = peft.get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter)
        keys.update(names[id(t)] for t in picked.values() if id(t) in names)
    return keys
