"""A parallelized Hugging Face model's ``save_pretrained``: a checkpoint that ``from_pretrained`` loads on one device.

transformers' own ``save_pretrained`` would write the blocks (and refuses the joined storage of a fused group);
after ``parallelize`` the model's instance calls it with the whole tensors instead: every rank gathers, rank 0
writes (transformers writes from rank 0 only, so the model's placement must include it), and every rank returns
once the files are written, or raises if rank 0 failed to write them (a rank failing in the gathers: every rank
raises its error by name). So it is called on every rank, as is transformers' ``push_to_hub``, which calls it; the
ranks meet through the world's store first (``tpflow.checkpoint.together``), so that called on rank 0 alone (the
data-parallel habit, ``if rank == 0:``) it fails within seconds naming the ranks that did not call it, where its
first gather would wait out the collective timeout (``TPFLOW_TIMEOUT``). Rank 0 writes into a staging folder
beside ``save_directory``, then makes it the folder, or, where the folder exists, moves its files into it one rename
each (``tpflow.checkpoint.atomic``): everything else there (a Trainer's checkpoints and logs, a tokenizer) is left as
it is, and a save killed half way leaves weights that load whole. A PEFT model's ``save_pretrained`` gathers its
adapters only and writes PEFT's files (``adapter_model.safetensors``,
``adapter_config.json``), which ``PeftModel.from_pretrained`` loads on one device.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch import nn

from tpflow.checkpoint.atomic import publish, stage
from tpflow.checkpoint.export import export_rank, full_state_dict
from tpflow.checkpoint.together import Meeting
from tpflow.hf.adapters import adapter_keys

__all__ = ["export_whole"]


class _SavePretrained:
    """The model's own ``save_pretrained`` given the whole tensors (an object, not a bound method: a copy or a pickle
    of the model takes it along, bound to the copy)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, save_directory: str | os.PathLike, is_main_process: bool = True, **kwargs) -> None:
        """``is_main_process`` is taken and dropped: rank 0 writes, every rank gathers."""
        if kwargs.pop("state_dict", None) is not None:  # None: transformers' Trainer says it has none
            raise TypeError("save_pretrained of a parallelized model gathers its own state dict: leave state_dict out "
                            "(tpf.full_state_dict(model) is what it saves)")
        writer = export_rank(self.model)
        if writer != 0:  # every rank finds it alike, before any collective
            raise ValueError(f"save_pretrained writes from rank 0 (transformers' rule), which holds no block of this "
                             f"model (its placement starts at rank {writer}): take tpf.full_state_dict(model) on rank "
                             f"{writer} and save that (safetensors.torch.save_file), or place the model on rank 0 too")
        meeting = Meeting("save_pretrained", "call model.save_pretrained on every rank, not under `if rank == 0`: "
                                             "every rank gathers the whole tensors, then rank 0 writes them")
        with meeting.step("write", "save_pretrained"):  # a rank failing here: every rank raises it, by name
            # every rank takes part in the gathers; of a PEFT model, its adapters' tensors only
            state = full_state_dict(self.model, adapter_keys(self.model, kwargs.get("selected_adapters")))
            if dist.get_rank() == 0:
                folder = stage(save_directory)  # written whole aside, then made the folder: a kill cannot tear it
                type(self.model).save_pretrained(self.model, folder, True, state_dict=state, **kwargs)
                publish(folder, save_directory, keep_others=True)


def export_whole(model: nn.Module) -> None:
    """Make ``model.save_pretrained(dir)`` (a Hugging Face model's) write whole tensors when every rank calls it.

    Args:
        model: a model after ``parallelize`` (changed in place; models without ``save_pretrained`` are left alone).

    Example::

        >>> import tempfile
        >>> import transformers
        >>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
        >>> _ = torch.manual_seed(0)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> model = tpf.parallelize(model, placement=P, plan="auto")   # calls export_whole(model)
        >>> folder = tempfile.TemporaryDirectory()
        >>> where = [folder.name]
        >>> torch.distributed.broadcast_object_list(where, src=0)      # rank 0's folder for every rank
        >>> model.save_pretrained(where[0])                           # on every rank; rank 0 writes
        >>> one_device = transformers.LlamaForCausalLM.from_pretrained(where[0])
        >>> ids = torch.randint(0, 64, (1, 6))
        >>> torch.allclose(one_device(ids).logits, model(ids).logits.full_tensor(), atol=1e-6)
        True
        >>> torch.distributed.barrier()                               # every rank has read it
        >>> folder.cleanup()
    """
    if callable(getattr(type(model), "save_pretrained", None)):
        model.save_pretrained = _SavePretrained(model)
