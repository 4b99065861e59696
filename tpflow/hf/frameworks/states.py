"""What the frameworks save and load of a split model, in their own files and layouts, whole.

- **An optimizer's state**: ``whole_state_dict(optimizer)`` is one device's ``state_dict()``, each state of a global
  parameter gathered whole (every rank calls it); an optimizer given ``takes_whole_states`` loads one device's (or
  its own) states, each rank cutting its block of each. So a checkpoint resumes on the same ranks, on another layout,
  or on one device, and one device's resumes here. The optimizer's own ``state_dict()`` is torch's (this rank's
  blocks), so calling it on one rank alone still works.
- **``Trainer``'s checkpoints** (``TrainerCheckpoints``): the model's safetensors (``save_model``: every rank
  gathers, the main process writes), ``optimizer.pt`` whole, the scheduler's; a resume reads the safetensors block by
  block, or, for a PEFT model, the adapter through ``Trainer``'s own loading (each adapter's whole tensors cut into
  its layout); each row's random state is written by its leader alone, and after a resume every rank of a row draws
  from its leader's state. A checkpoint a killed rank left half written (no ``trainer_state.json``, which the
  Trainer writes last, or tpflow's incomplete marker) is torn: ``resume_from_checkpoint=True`` passes over it to the
  last whole one, saying so, and a torn one named is refused by name.
- **accelerate** (``accelerate_hooks``): ``get_state_dict`` of a split model is one device's (on the main process,
  as for FSDP), so ``save_model`` and ``save_state`` write whole weights; ``save_state`` writes the optimizers' states
  whole, and a row's other ranks write what the row's process writes (its random states) into a scratch folder,
  not over their leader's file; ``load_state`` reads the weights back block by block and ends with a row's ranks
  drawing alike.
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from tpflow.checkpoint.atomic import INCOMPLETE, is_weights_file
from tpflow.checkpoint.export import full_state_dict
from tpflow.checkpoint.load import load_safetensors
from tpflow.comm.random_state import share_random_state
from tpflow.hf.frameworks.rows import current

__all__ = ["TrainerCheckpoints", "accelerate_hooks", "last_whole_checkpoint", "takes_whole_states", "torn",
           "whole_state_dict"]

_OPTIMIZER, _SCHEDULER = "optimizer.pt", "scheduler.pt"  # transformers' names in a checkpoint folder
_STATE = "trainer_state.json"  # written last of a Trainer checkpoint's files: a folder without it is torn
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")  # transformers' PREFIX_CHECKPOINT_DIR and step


def whole_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """One device's ``optimizer.state_dict()``: each state of a global parameter gathered whole. Every rank calls it.

    Args:
        optimizer: a ``torch.optim`` optimizer (accelerate's wrapper: the one it holds) over a split model.

    Returns:
        The state dict, its tensors whole.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> layer = tpf.ColumnParallelLinear(4, 6, placement=P)
        >>> optimizer = torch.optim.Adam(layer.parameters())
        >>> layer(torch.ones(2, 4)).sum().backward()
        >>> optimizer.step()
        >>> whole_state_dict(optimizer)["state"][0]["exp_avg"].shape          # [6, 4] on every rank
        torch.Size([6, 4])
    """
    state = getattr(optimizer, "optimizer", optimizer).state_dict()
    return {**state, "state": {i: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in values.items()}
                               for i, values in state["state"].items()}}


def takes_whole_states(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer.load_state_dict`` take one device's states (``whole_state_dict``'s): each rank cuts its block
    of each whole state; a state laid out already, or of another shape (a step count), loads as it is. Idempotent.

    Args:
        optimizer: a ``torch.optim`` optimizer (accelerate's wrapper: the one it holds) over a split model.

    Returns:
        ``optimizer``.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> layer = tpf.ColumnParallelLinear(4, 6, placement=P)
        >>> optimizer = takes_whole_states(torch.optim.Adam(layer.parameters()))
        >>> layer(torch.ones(2, 4)).sum().backward()
        >>> optimizer.step()
        >>> optimizer.load_state_dict(whole_state_dict(optimizer))                # each rank keeps its block
        >>> optimizer.state[layer.weight]["exp_avg"].to_local().shape
        torch.Size([3, 4])
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    if not getattr(inner, "_tpflow_whole", False):
        inner.register_load_state_dict_pre_hook(_cut)
        inner._tpflow_whole = True
    return optimizer


def _cut(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """Each saved state laid out as its parameter: saved ids mapped to the parameters as torch's load maps them
    (group by group, in order)."""
    saved = [i for group in state["param_groups"] for i in group["params"]]
    params = dict(zip(saved, (p for group in optimizer.param_groups for p in group["params"])))
    return {**state, "state": {i: {k: _block(v, params.get(i)) for k, v in values.items()}
                               for i, values in state["state"].items()}}


def _block(value: object, param: torch.Tensor | None) -> object:
    """A state saved whole, laid out as its global parameter (this rank's block); a state of another shape (a step
    count) or already laid out as it is."""
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor) \
            or value.shape != param.shape:
        return value
    return distribute_tensor(value.to(param.to_local().device), param.device_mesh, param.placements,
                             src_data_rank=None)  # each rank cuts its own block: no scatter, uneven splits too


def torn(checkpoint: str) -> str | None:
    """Why a ``Trainer`` checkpoint folder is torn (a save that did not finish, a rank killed half way), or None for a
    whole one: it lacks ``trainer_state.json``, which the Trainer writes last, or holds tpflow's incomplete marker.

    Args:
        checkpoint: a ``checkpoint-N`` folder.

    Returns:
        What is wrong with it, or None.

    Example::

        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> torn(folder)
        'it is empty'
        >>> open(os.path.join(folder, "trainer_state.json"), "w").close()
        >>> torn(folder) is None
        True
    """
    names = sorted(os.listdir(checkpoint))
    if INCOMPLETE in names:
        return f"it holds the marker of a save that did not finish ({INCOMPLETE})"
    if _STATE not in names:
        return f"it lacks {_STATE}, which the Trainer writes last; it holds {names}" if names else "it is empty"
    return None


def last_whole_checkpoint(folder: str) -> str | None:
    """The ``checkpoint-N`` folder of ``folder`` with the highest step that is whole (see ``torn``), warning of each
    torn one passed over; None where ``folder`` holds no checkpoint at all.

    Args:
        folder: a ``Trainer``'s output folder.

    Returns:
        The checkpoint's path, or None.

    Raises:
        ValueError: every checkpoint there is torn; each is named with what it lacks.

    Example::

        >>> import tempfile, warnings
        >>> folder = tempfile.mkdtemp()
        >>> for step in (2, 4):
        ...     os.makedirs(os.path.join(folder, f"checkpoint-{step}"))
        >>> open(os.path.join(folder, "checkpoint-2", "trainer_state.json"), "w").close()
        >>> with warnings.catch_warnings(record=True):                # checkpoint-4 is torn (empty)
        ...     os.path.basename(last_whole_checkpoint(folder))
        'checkpoint-2'
    """
    if not os.path.isdir(folder):
        return None
    found = sorted(((int(m.group(1)), name) for name in os.listdir(folder)
                    if (m := _CHECKPOINT.fullmatch(name)) and os.path.isdir(os.path.join(folder, name))), reverse=True)
    passed = []
    for _, name in found:
        why = torn(os.path.join(folder, name))
        if why is None:
            if passed:
                warnings.warn(f"resume_from_checkpoint=True: resuming from {name}, the last whole checkpoint in "
                              f"{folder}; passed over: {'; '.join(passed)}", stacklevel=3)
            return os.path.join(folder, name)
        passed.append(f"{name} is torn ({why})")
    if passed:
        raise ValueError(f"resume_from_checkpoint=True: no whole checkpoint in {folder}: {'; '.join(passed)}. A "
                         "save that did not finish (a rank killed half way) leaves one so: delete it, or train from "
                         "the start")
    return None


def _row_draws_alike() -> None:
    """After a framework restored each rank's random state from its row's file (written by the leader's process, whose
    CUDA generators are the leader's devices'), every rank of a row takes its leader's state."""
    rows = current()
    if rows is not None:
        share_random_state(rows.row_group)


class TrainerCheckpoints:
    """A ``Trainer``'s checkpoints of a split model (see the module's docstring): its methods take the place of the
    trainer's own (``adopt`` makes one).

    Args:
        trainer: the ``transformers.Trainer`` (TRL's too) holding a split model.

    Example::

        >>> import tempfile, transformers
        >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
        >>> model = tpf.parallelize(transformers.AutoModelForCausalLM.from_config(config),
        ...                         placement=tpf.placement("cpu", ranks=[0, 1]), plan="auto")
        >>> args = transformers.TrainingArguments(tempfile.mkdtemp(), report_to=[], use_cpu=True)
        >>> trainer = transformers.Trainer(model=model, args=args)
        >>> checkpoints = TrainerCheckpoints(trainer)
        >>> trainer._load_from_checkpoint == checkpoints.load_model
        True
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.load_own, self.save_rng_own = trainer._load_from_checkpoint, trainer._save_rng_state
        self.load_rng_own, self.train_own = trainer._load_rng_state, trainer.train
        trainer.train = self.train
        trainer._save_optimizer_and_scheduler = self.save_optimizer_and_scheduler
        trainer._load_from_checkpoint = self.load_model
        trainer._save_rng_state = self.save_rng_state
        trainer._load_rng_state = self.load_rng_state

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs) -> Any:
        """The trainer's own ``train``; ``resume_from_checkpoint=True`` takes the last whole checkpoint of the output
        folder (``last_whole_checkpoint``), where the Trainer would take the last one, torn or not."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_whole_checkpoint(self.trainer.args.output_dir) or True
        return self.train_own(resume_from_checkpoint, *args, **kwargs)

    def save_optimizer_and_scheduler(self, output_dir: str) -> None:
        state = whole_state_dict(self.trainer.optimizer)  # every rank, in one order: the gathers meet
        if self.trainer.args.should_save:
            torch.save(state, os.path.join(output_dir, _OPTIMIZER))
            torch.save(self.trainer.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def save_rng_state(self, output_dir: str) -> None:
        """Each row's random state, from its leader: the row's ranks draw alike, and one writer a file."""
        rows = current()
        if rows is None or rows.leader:
            self.save_rng_own(output_dir)

    def load_rng_state(self, checkpoint: str | None) -> None:
        self.load_rng_own(checkpoint)
        _row_draws_alike()

    def load_model(self, checkpoint: str, model: nn.Module | None = None) -> None:
        """The model's safetensors, each rank reading its blocks; a PEFT checkpoint (adapter files only) through
        ``Trainer``'s own loading, whose whole adapter tensors each split layer cuts into its blocks. A torn
        checkpoint is refused by name."""
        why = torn(checkpoint)
        if why is not None:
            raise ValueError(f"{checkpoint} is a torn checkpoint: {why} (a save that did not finish, a rank killed "
                             "half way): resume from an earlier one; resume_from_checkpoint=True passes over torn ones")
        if any(is_weights_file(name) for name in os.listdir(checkpoint)):
            load_safetensors(self.trainer.model if model is None else model, checkpoint)
        else:
            self.load_own(checkpoint, model)


def accelerate_hooks(accelerator: Any, is_split) -> None:
    """Make an ``Accelerator`` save and load a split model whole (see the module's docstring).

    Args:
        accelerator: an ``accelerate.Accelerator``.
        is_split: ``is_split(model)``: whether a prepared model is one ``parallelize`` split.

    Example::

        >>> import accelerate
        >>> accelerate_hooks(accelerate.Accelerator(cpu=True), lambda model: True)     # what adopt does
    """
    import accelerate.accelerator
    from safetensors.torch import load_model

    if not getattr(accelerate.accelerator.save_accelerator_state, "_tpflow_rows", False):
        accelerate.accelerator.save_accelerator_state = _saved_whole(accelerate.accelerator.save_accelerator_state)
    get_state_dict, prepare_optimizer, load_state = (accelerator.get_state_dict, accelerator.prepare_optimizer,
                                                     accelerator.load_state)

    def whole_state(model: nn.Module, unwrap: bool = True) -> dict:
        inner = accelerator.unwrap_model(model) if unwrap else model
        return full_state_dict(inner) if is_split(inner) else get_state_dict(model, unwrap=unwrap)

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

    def prepare_whole(optimizer, device_placement=None):
        return takes_whole_states(prepare_optimizer(optimizer, device_placement=device_placement))

    def load_state_alike(*args, **kwargs):
        out = load_state(*args, **kwargs)
        _row_draws_alike()
        return out

    accelerator.get_state_dict = whole_state
    accelerator.register_load_state_pre_hook(load_blocks)
    accelerator.prepare_optimizer = prepare_whole
    accelerator.load_state = load_state_alike


class _Whole:
    """An optimizer whose ``state_dict`` is one device's (what accelerate's ``save_accelerator_state`` reads)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        return whole_state_dict(self.optimizer)


def _saved_whole(save):
    """accelerate's ``save_accelerator_state``: the optimizers' states whole (every rank gathers); a row's ranks but
    its leader write what they write alone (each process's random states, under its row's name) into a scratch
    folder, so that one rank writes each file."""

    @functools.wraps(save)
    def save_accelerator_state(output_dir, model_states, optimizers, *args, **kwargs):
        rows = current()
        if rows is None:
            return save(output_dir, model_states, optimizers, *args, **kwargs)
        optimizers = [_Whole(optimizer) for optimizer in optimizers]
        if rows.leader:
            return save(output_dir, model_states, optimizers, *args, **kwargs)
        with tempfile.TemporaryDirectory(prefix="tpflow-row-") as scratch:
            save(scratch, model_states, optimizers, *args, **kwargs)
        return Path(output_dir)

    save_accelerator_state._tpflow_rows = True
    return save_accelerator_state
