"""What the frameworks save and load of a split model, in their own files and layouts, whole.

- **An optimizer's state** (``whole_states``): ``optimizer.state_dict()`` gives one device's states, each state of a
  global parameter gathered whole (every rank calls it, as accelerate's ``save_state`` and ``Trainer``'s checkpoints
  do here), and ``load_state_dict`` takes one device's (or these) states, each rank cutting its block of each. So a
  checkpoint resumes on the same ranks, on another layout, or on one device, and one device's resumes here.
- **``Trainer``'s checkpoints** (``TrainerCheckpoints``): the model's safetensors (``save_model``: every rank
  gathers, the main process writes), ``optimizer.pt`` as above, the scheduler's; a resume reads the safetensors
  block by block, or, for a PEFT model, the adapter through ``Trainer``'s own loading (each adapter's whole tensors
  cut into its layout); each row's random state is written by its leader only.
- **accelerate's ``save_state`` / ``load_state``** (``accelerate_hooks``): the model's weights written whole (its
  ``model.safetensors`` loads on one device) and read back block by block.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from tpflow.checkpoint.export import full_state_dict
from tpflow.checkpoint.load import load_safetensors
from tpflow.frameworks.rows import current

__all__ = ["TrainerCheckpoints", "accelerate_hooks", "whole_states"]

_OPTIMIZER, _SCHEDULER = "optimizer.pt", "scheduler.pt"  # transformers' names in a checkpoint folder
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def whole_states(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer``'s state dicts one device's: its ``state_dict()`` gathers each state of a global parameter
    whole (call it on every rank), its ``load_state_dict`` cuts each whole state into this rank's block. Idempotent.

    Args:
        optimizer: a ``torch.optim`` optimizer over a split model's parameters (accelerate's wrapper: its own).

    Returns:
        ``optimizer``.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> layer = tpf.ColumnParallelLinear(4, 6, placement=P)
        >>> optimizer = whole_states(torch.optim.Adam(layer.parameters()))
        >>> layer(torch.ones(2, 4)).sum().backward()
        >>> optimizer.step()
        >>> optimizer.state_dict()["state"][0]["exp_avg"].shape                    # [6, 4] on every rank
        torch.Size([6, 4])
        >>> optimizer.load_state_dict(optimizer.state_dict())                        # each rank keeps its block
        >>> optimizer.state[layer.weight]["exp_avg"].to_local().shape
        torch.Size([3, 4])
    """
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer holds the optimizer
    if not getattr(optimizer, "_tpflow_whole", False):
        optimizer.register_state_dict_post_hook(_gathered)
        optimizer.register_load_state_dict_pre_hook(_cut)
        optimizer._tpflow_whole = True
    return optimizer


def _gathered(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    return {**state, "state": {i: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in values.items()}
                               for i, values in state["state"].items()}}


def _cut(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {**state, "state": {i: {k: _block(v, params[int(i)]) for k, v in values.items()}
                               for i, values in state["state"].items()}}


def _block(value: object, param: torch.Tensor) -> object:
    """A state saved whole, laid out as its global parameter (this rank's block); a state of another shape (a step
    count) or already laid out as it is."""
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor) \
            or value.shape != param.shape:
        return value
    return distribute_tensor(value.to(param.to_local().device), param.device_mesh, param.placements,
                             src_data_rank=None)  # each rank cuts its own block: no scatter, uneven splits too


def _adapters(folder: str) -> bool:
    return not any(os.path.isfile(os.path.join(folder, name)) for name in _WEIGHTS)


class TrainerCheckpoints:
    """A ``Trainer``'s checkpoints of a split model (see the module's docstring): its methods take the place of the
    trainer's own (``adopt`` makes one).

    Args:
        trainer: the ``transformers.Trainer`` (TRL's too) holding ``model``.
        model: the split model (a PEFT model of one included).

    Example::

        >>> import tempfile, transformers
        >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
        >>> model = tpf.parallelize(transformers.AutoModelForCausalLM.from_config(config),
        ...                         placement=tpf.placement("cpu", ranks=[0, 1]), plan="auto")
        >>> args = transformers.TrainingArguments(tempfile.mkdtemp(), report_to=[], use_cpu=True)
        >>> trainer = transformers.Trainer(model=model, args=args)
        >>> checkpoints = TrainerCheckpoints(trainer, model)
        >>> trainer._load_from_checkpoint == checkpoints.load_model
        True
    """

    def __init__(self, trainer: Any, model: nn.Module) -> None:
        self.trainer, self.model = trainer, model
        self.load_own = trainer._load_from_checkpoint
        self.save_rng_own = trainer._save_rng_state
        trainer._save_optimizer_and_scheduler = self.save_optimizer_and_scheduler
        trainer._load_from_checkpoint = self.load_model
        trainer._save_rng_state = self.save_rng_state

    def save_optimizer_and_scheduler(self, output_dir: str) -> None:
        state = whole_states(self.trainer.optimizer).state_dict()  # every rank, in one order: the gathers meet
        if self.trainer.args.should_save:
            torch.save(state, os.path.join(output_dir, _OPTIMIZER))
            torch.save(self.trainer.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def save_rng_state(self, output_dir: str) -> None:
        """Each row's random state, from its leader: the row's ranks draw alike, and one writer a file."""
        rows = current()
        if rows is None or rows.leader:
            self.save_rng_own(output_dir)

    def load_model(self, checkpoint: str, model: nn.Module | None = None) -> None:
        """The model's safetensors, each rank reading its blocks; a PEFT checkpoint (adapter files only) through
        ``Trainer``'s own loading, whose whole adapter tensors each split layer cuts into its blocks."""
        if _adapters(checkpoint):
            self.load_own(checkpoint, model)
        else:
            load_safetensors(self.model if model is None else model, checkpoint)


def accelerate_hooks(accelerator: Any, is_split) -> None:
    """accelerate's ``save_state`` writes a split model's weights whole (gathered by every rank, written by the main
    process) and ``load_state`` reads them back block by block; the prepared optimizers' states are whole
    (``whole_states``).

    Args:
        accelerator: an ``accelerate.Accelerator``.
        is_split: ``is_split(model)``: whether a prepared model is one ``parallelize`` split.

    Example::

        >>> import accelerate
        >>> accelerate_hooks(accelerate.Accelerator(cpu=True), lambda model: True)     # what adopt does
    """
    from safetensors.torch import load_model

    def save_whole(models: list, weights: list, output_dir: str) -> None:
        for i, model in enumerate(models):
            if is_split(model):
                weights[i] = full_state_dict(model)

    def load_blocks(models: list, input_dir: str) -> None:
        """Every model read here, in its index's file (the list emptied, as accelerate asks of a hook that loads)."""
        for i, model in enumerate(models):
            file = os.path.join(input_dir, f"model{f'_{i}' if i else ''}")
            if not os.path.isfile(f"{file}.safetensors"):  # save_state(safe_serialization=False)
                model.load_state_dict(torch.load(f"{file}.bin", map_location="cpu", weights_only=True))
            elif is_split(model):
                load_safetensors(model, f"{file}.safetensors")
            else:
                load_model(model, f"{file}.safetensors")
        models.clear()

    accelerator.register_save_state_pre_hook(save_whole)
    accelerator.register_load_state_pre_hook(load_blocks)
    prepare_optimizer = accelerator.prepare_optimizer

    def prepare_whole(optimizer, device_placement=None):
        prepared = prepare_optimizer(optimizer, device_placement=device_placement)
        whole_states(prepared)
        return prepared

    accelerator.prepare_optimizer = prepare_whole
