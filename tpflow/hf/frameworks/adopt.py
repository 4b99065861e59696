"""A split model handed to the loops people run: transformers' ``Trainer``, TRL's trainers (``Trainer``
subclasses) and accelerate's ``Accelerator``.

What the frameworks see of the process grid is not adopt's: from ``parallelize`` on, they see the data-parallel rows
as their processes (``tpflow.hf.frameworks.view``). ``adopt`` adds what belongs to the model, which owns its placement:

- it is not wrapped in DDP (whose first step, the parameters' broadcast, cannot read global parameters; their
  gradients are already summed where they must be: none to sum on a tensor-parallel placement, FSDP2's over named
  data axes): ``Trainer`` is told with transformers' own word for such a model
  (``is_distributed_loading_by_transformers``, by which every rank also takes part in ``save_model``), accelerate's
  ``prepare`` leaves it as it is;
- what the frameworks save of it is whole and in their own files (``tpflow.hf.frameworks.states``);
- a PEFT model's ``save_pretrained`` writes PEFT's files;
- TRL's fused heads score tokens on the head's blocks, and a reference model TRL built whole is split as the policy
  (``tpflow.hf.frameworks.trl_heads``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from tpflow.hf.frameworks.rows import Rows, show
from tpflow.hf.frameworks.states import TrainerCheckpoints, accelerate_hooks
from tpflow.hf.frameworks.trl_heads import route_fused_heads, split_reference
from tpflow.hf.frameworks.view import install
from tpflow.placement import Placement

__all__ = ["adopt", "mark", "placement_of", "split_as"]

_PLACEMENT = "_tpflow_placement"  # what parallelize leaves on the model it changed
_SPLIT_AS = "_tpflow_split_as"


def mark(model: nn.Module, placement: Placement, split_as: tuple[Placement, Mapping[str, object]] | None = None
         ) -> None:
    """Leave on ``model`` the placement ``parallelize`` split it over (the one its batches are read by) and how it
    split it, for ``adopt`` to read, and make its rows what the frameworks see (``rows.show``, ``view.install``).

    Args:
        model: the model ``parallelize`` changed.
        placement: the placement its data-parallel rows are read off.
        split_as: ``parallelize``'s placement and plan (its entries), to split a trainer's reference model alike.

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> mark(model, tpf.placement("cpu", ranks=[0, 1]))
        >>> placement_of(model).hierarchy
        (2,)
    """
    object.__setattr__(model, _PLACEMENT, placement)
    object.__setattr__(model, _SPLIT_AS, split_as)
    if show(placement) is not None:
        install()


def placement_of(model: nn.Module) -> Placement | None:
    """The placement ``parallelize`` split ``model`` (or the model a wrapper holds) over, or None.

    Args:
        model: a model, or a wrapper holding one (``.module``, PEFT's ``.base_model``).

    Returns:
        Its placement, or None when ``parallelize`` did not change it.

    Example::

        >>> placement_of(torch.nn.Linear(2, 2)) is None
        True
    """
    return _marked(model, _PLACEMENT)


def split_as(model: nn.Module) -> tuple[Placement, Mapping[str, object]] | None:
    """The placement and plan ``parallelize`` split ``model`` (or the model a wrapper holds) with, or None.

    Args:
        model: a model, or a wrapper holding one.

    Returns:
        ``(placement, plan)``, the plan as its entries; None when ``parallelize`` did not change it.

    Example::

        >>> split_as(torch.nn.Linear(2, 2)) is None
        True
    """
    return _marked(model, _SPLIT_AS)


def _marked(model: nn.Module, mark_name: str) -> Any:
    """What ``mark`` left under ``mark_name`` on ``model`` or the model a wrapper holds, or None."""
    for m in (model, getattr(model, "module", None), getattr(model, "base_model", None)):
        if m is not None and getattr(m, mark_name, None) is not None:
            return getattr(m, mark_name)
    return None


def adopt(trainer: Any, model: nn.Module | None = None) -> Any:
    """Make a transformers ``Trainer`` (TRL's too) or an accelerate ``Accelerator`` train a model ``parallelize``
    changed as one device does (see the module's docstring): call it once, on every rank, after building the trainer
    or accelerator and before training. Given a PEFT model of a parallelized model (``get_peft_model(model,
    tpf.lora(config))``, or held by the trainer: TRL's ``peft_config=tpf.lora(config)``), it makes its
    ``save_pretrained`` write PEFT's adapter files, as ``parallelize`` of a PEFT model does.

    Args:
        trainer: a ``transformers.Trainer`` (or subclass) holding the parallelized model, an
            ``accelerate.Accelerator``, or a PEFT model.
        model: the parallelized model, for an ``Accelerator`` (a ``Trainer`` holds its own).

    Returns:
        ``trainer``, adapted in place.

    Example::

        >>> import contextlib, io, tempfile, transformers
        >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                                   num_attention_heads=4, num_key_value_heads=2)
        >>> model = transformers.AutoModelForCausalLM.from_config(config)
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]), plan="auto")
        >>> rows = [{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]}] * 8
        >>> args = transformers.TrainingArguments(tempfile.mkdtemp(), max_steps=2, report_to=[], use_cpu=True)
        >>> trainer = tpf.adopt(transformers.Trainer(model=model, args=args, train_dataset=rows))   # the one line
        >>> with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):   # its logs
        ...     result = trainer.train()
        >>> result.global_step, trainer.args.world_size                  # one row of two ranks: one process
        (2, 1)
    """
    from tpflow.hf.adapters import wrapped_model  # plans import this module (mark)
    from tpflow.hf.pretrained import export_whole

    if wrapped_model(trainer)[0] is not trainer:
        if placement_of(trainer) is None:
            raise ValueError("tpf.adopt takes a PEFT model of a model tpf.parallelize changed: this one's is whole")
        export_whole(trainer)
        return trainer
    accelerator = getattr(trainer, "accelerator", trainer)
    held = getattr(trainer, "model", None) if model is None else model
    placement = placement_of(held) if held is not None else None
    if placement is None:
        raise ValueError("tpf.adopt takes a Trainer holding a model tpf.parallelize changed, or an Accelerator and "
                         "that model (model=): this one was not parallelized")
    rows = show(placement)  # the trainer's model's rows, whatever was parallelized since
    install()  # again: modules loaded since parallelize read torch.distributed through the view
    if rows is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"tpf.adopt: the model's placement {placement!r} does not hold every rank of this world of "
                         f"{dist.get_world_size()}, so the frameworks' processes (its data-parallel rows) are not "
                         f"defined: parallelize over every rank")
    if wrapped_model(held)[0] is not held:  # a PEFT model (TRL's peft_config= makes one): PEFT's files, whole
        export_whole(held)
    reference = getattr(trainer, "ref_model", None)
    if isinstance(reference, nn.Module) and placement_of(reference) is None:  # TRL's, built whole: split as the policy
        split_reference(reference, split_as(held))
    route_fused_heads(wrapped_model(held)[0], reference)
    args = getattr(trainer, "args", None)
    if args is not None:
        _check_generation_batch(args, rows)
        # transformers' own word for a model that owns its placement and gradient sums: not wrapped again, and saved
        # by every rank (their gathers)
        trainer.is_distributed_loading_by_transformers = True
        trainer._defer_fsdp_gradient_reduction = lambda: _fsdp_sync_deferred(trainer.model)  # theirs reads its
        # config.distributed_config, which a model FSDP2 sharded after tpflow split it has not
        TrainerCheckpoints(trainer)
    prepare_model = accelerator.prepare_model

    def prepare_model_as_is(module: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        if placement_of(module) is not placement:
            return prepare_model(module, device_placement=device_placement, evaluation_mode=evaluation_mode)
        return prepare_model(module, device_placement=False, evaluation_mode=True)  # autocast, no DDP

    accelerator.prepare_model = prepare_model_as_is
    accelerate_hooks(accelerator, lambda m: placement_of(m) is not None)
    return trainer


def _check_generation_batch(args: Any, rows: Rows | None) -> None:
    """TRL's GRPO and RLOO configs derive their generation batch from the process count when they are built: one
    built before ``parallelize`` counted every rank as a process."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_device, steps = getattr(args, "per_device_train_batch_size", None), getattr(args, "steps_per_generation", None)
    size = getattr(args, "generation_batch_size", None)
    if rows is None or rows.rows == world or None in (per_device, steps, size) or size != per_device * world * steps:
        return
    raise ValueError(f"{type(args).__name__} was built before tpf.parallelize: it took generation_batch_size={size} "
                     f"from {world} processes, where the frameworks see {rows.rows} (the model's data-parallel rows, "
                     f"each one process): build it after tpf.parallelize, or pass generation_batch_size="
                     f"{per_device * rows.rows * steps} yourself")


@contextlib.contextmanager
def _fsdp_sync_deferred(model: nn.Module) -> Iterator[None]:
    """FSDP2's ``no_sync``: the micro-batches before the last one of an accumulation keep their gradients unsummed."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
