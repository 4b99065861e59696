"""A parallelized model handed to the loops people run: transformers' ``Trainer``, TRL's trainers (``Trainer``
subclasses) and accelerate's ``Accelerator``.

They all prepare a model through accelerate, which on several processes wraps it in DDP (whose first step, the
parameters' broadcast, cannot read tpflow's global parameters) and shards every data loader over the world's ranks,
so the tensor-parallel ranks, which must compute on the same batch, would each get another. accelerate's own tensor
parallelism (its ``ParallelismConfig``, which ``Trainer`` builds from a model's ``tp_size``) knows better, but runs
only on GPUs and on its own mesh. ``adopt`` gives the accelerator tpflow's layout instead: the model is not wrapped
(its gradients are already summed where they must be: none to sum on a tensor-parallel placement, FSDP2's over
named data axes), and the data loaders are sharded over the data-parallel rows only, each row's tensor-parallel
ranks getting the same batches. ``Trainer`` is told the tensor-parallel size too (its ``get_tp_size``, by which it
counts a batch's tokens once per row), and that the model owns its placement (transformers' own
``is_distributed_loading_by_transformers``: every rank takes part in ``save_model``). Its checkpoints stay in its
own format and whole (``_Checkpoints``): the model's safetensors and one device's ``optimizer.pt``, so a run resumes
on the same ranks, on another layout, or on one device, and one device's checkpoint resumes here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from tpflow.checkpoint.load import load_safetensors
from tpflow.placement import Placement

__all__ = ["adopt", "data_rows"]

_PLACEMENT = "_tpflow_placement"  # what parallelize leaves on the model it changed
_OPTIMIZER, _SCHEDULER = "optimizer.pt", "scheduler.pt"  # transformers' names in a checkpoint folder


def mark(model: nn.Module, placement: Placement) -> None:
    """Leave on ``model`` the placement ``parallelize`` split it over, for ``adopt`` to read."""
    object.__setattr__(model, _PLACEMENT, placement)


def placement_of(model: nn.Module) -> Placement | None:
    """The placement ``parallelize`` split ``model`` (or the model a wrapper holds) over, or None."""
    for m in (model, getattr(model, "module", None), getattr(model, "base_model", None)):
        if m is not None and getattr(m, _PLACEMENT, None) is not None:
            return getattr(m, _PLACEMENT)
    return None


def data_rows(placement: Placement) -> tuple[int, int]:
    """This rank's data-parallel row and the number of rows of ``placement``: its axes but the last (the tensor axis)
    are data axes, flattened in order; a 1-D placement is one row.

    Args:
        placement: the placement a model was parallelized over.

    Returns:
        ``(row, rows)``: the index of the batch this rank reads and how many different batches there are.

    Example::

        >>> tpf.frameworks.data_rows(tpf.placement("cpu", ranks=[0, 1]))                # one row of 2 ranks
        (0, 1)
        >>> tpf.frameworks.data_rows(tpf.placement("cpu", ranks=[[0], [1]]))[1]         # 2 rows of one rank
        2
    """
    coordinate = placement.coordinate()
    if coordinate is None:
        raise ValueError(f"this rank holds no part of {placement!r}: every rank that trains must be in it")
    row, rows = 0, 1
    for c, n in zip(coordinate[:-1], placement.hierarchy[:-1]):
        row, rows = row * n + c, rows * n
    return row, rows


def adopt(trainer: Any, model: nn.Module | None = None) -> Any:
    """Make a transformers ``Trainer`` (TRL's too) or an accelerate ``Accelerator`` train a model ``parallelize``
    changed as one device does: the model is not wrapped in DDP, and data loaders are sharded over its data-parallel
    rows only (see the module's docstring). Call it once, on every rank, before training. Given a PEFT model of a
    parallelized model (``get_peft_model(model, tpf.lora(config))``, or held by the trainer: TRL's
    ``peft_config=tpf.lora(config)``), it makes its ``save_pretrained`` write PEFT's adapter files, as ``parallelize``
    of a PEFT model does.

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
        >>> result.global_step
        2
    """
    from tpflow.plans.adapters import wrapped_model  # plans import this module (mark)
    from tpflow.plans.pretrained import export_whole

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
    if wrapped_model(held)[0] is not held:  # a PEFT model (TRL's peft_config= makes one): PEFT's files, whole
        export_whole(held)
    args = getattr(trainer, "args", None)
    row, rows = data_rows(placement)
    if args is not None:
        tp = placement.hierarchy[-1]
        # it counts a batch's tokens once per row; not model._tp_size, which a second Trainer on the model would
        # read as transformers' own tensor parallelism (and build accelerate's for)
        trainer.get_tp_size = lambda: tp
        # transformers' own word for a model that owns its placement and gradient sums: not wrapped again, and saved
        # by every rank (their gathers)
        trainer.is_distributed_loading_by_transformers = True
        trainer._defer_fsdp_gradient_reduction = lambda: _fsdp_sync_deferred(trainer.model)  # theirs reads its
        # config.distributed_config, which a model FSDP2 sharded after tpflow split it has not
        checkpoints = _Checkpoints(trainer, held)
        trainer._save_optimizer_and_scheduler = checkpoints.save_optimizer_and_scheduler
        trainer._load_optimizer_and_scheduler = checkpoints.load_optimizer_and_scheduler
        trainer._load_from_checkpoint = checkpoints.load_model
    prepare_model = accelerator.prepare_model
    prepare_data_loader = accelerator.prepare_data_loader

    def prepare_model_as_is(module: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        if placement_of(module) is not placement:
            return prepare_model(module, device_placement=device_placement, evaluation_mode=evaluation_mode)
        return prepare_model(module, device_placement=False, evaluation_mode=True)  # autocast, no DDP

    def prepare_data_loader_by_rows(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        state = accelerator.state
        before = state.num_processes, state.process_index
        state.num_processes, state.process_index = rows, row
        try:
            return prepare_data_loader(data_loader, device_placement=device_placement,
                                       slice_fn_for_dispatch=slice_fn_for_dispatch)
        finally:
            state.num_processes, state.process_index = before

    accelerator.prepare_model = prepare_model_as_is
    accelerator.prepare_data_loader = prepare_data_loader_by_rows
    accelerator.gather_for_metrics = _MetricsByRows(accelerator, placement)
    return trainer


@contextlib.contextmanager
def _fsdp_sync_deferred(model: nn.Module) -> Iterator[None]:
    """FSDP2's ``no_sync``: the micro-batches before the last one of an accumulation keep their gradients unsummed."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class _MetricsByRows:
    """accelerate's ``gather_for_metrics`` over the data-parallel rows: each row's tensor-parallel ranks hold the same
    values (a row's batch, its predictions), which a gather over the world would count once per rank (TRL's
    ``num_tokens``, an evaluation's predictions). Its own ``gather`` (which ``Trainer`` sums token counts with, then
    divides by the tensor-parallel size) stays the world's."""

    def __init__(self, accelerator: Any, placement: Placement) -> None:
        self.accelerator, self.gather_for_metrics = accelerator, accelerator.gather_for_metrics
        world = dist.get_world_size()
        self.leaders = [r for r in range(world) if (placement.coordinate(r) or (None,))[-1] == 0]
        self.world = world

    def __call__(self, input_data: Any, use_gather_object: bool = False) -> Any:
        from accelerate.utils import recursively_apply

        gather = self.accelerator.gather

        def by_rows(tensor: Any) -> Any:
            whole = gather(tensor)
            return recursively_apply(lambda t: t.reshape(self.world, -1, *t.shape[1:])[self.leaders].flatten(0, 1),
                                     whole)

        self.accelerator.gather = by_rows
        try:
            return self.gather_for_metrics(input_data, use_gather_object=use_gather_object)
        finally:
            self.accelerator.gather = gather


class _Checkpoints:
    """A ``Trainer``'s checkpoints of a parallelized model in its own format, whole: ``save_model``'s safetensors
    (every rank gathers, rank 0 writes) and ``optimizer.pt`` as one device's ``optimizer.state_dict()`` (each
    state gathered whole). So a checkpoint resumes on any layout, one device included, and one device's resumes
    here, each rank cutting its blocks out of the whole."""

    def __init__(self, trainer: Any, model: nn.Module) -> None:
        self.trainer, self.model = trainer, model

    def save_optimizer_and_scheduler(self, output_dir: str) -> None:
        state = self.trainer.optimizer.state_dict()  # every rank, in one order: the gathers meet
        whole = {i: {k: v.full_tensor().cpu() if isinstance(v, DTensor) else v for k, v in values.items()}
                 for i, values in state["state"].items()}
        if dist.get_rank() == 0:
            torch.save({"state": whole, "param_groups": state["param_groups"]}, os.path.join(output_dir, _OPTIMIZER))
            torch.save(self.trainer.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        whole = torch.load(os.path.join(checkpoint, _OPTIMIZER), map_location="cpu", weights_only=True)
        params = [p for group in self.trainer.optimizer.param_groups for p in group["params"]]
        state = {i: {k: _cut(v, params[i]) for k, v in values.items()} for i, values in whole["state"].items()}
        self.trainer.optimizer.load_state_dict({"state": state, "param_groups": whole["param_groups"]})
        self.trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, _SCHEDULER),
                                                             weights_only=True))

    def load_model(self, checkpoint: str, model: nn.Module | None = None) -> None:
        load_safetensors(self.model if model is None else model, checkpoint)


def _cut(value: object, param: torch.Tensor) -> object:
    """An optimizer state saved whole, laid out as its global parameter (this rank's block): a state of another
    shape (a step count) as it is."""
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return value
    return distribute_tensor(value.to(param.to_local().device), param.device_mesh, param.placements,
                             src_data_rank=None)  # each rank cuts its own block: no scatter, uneven splits too
