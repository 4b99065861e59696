"""Checkpoints in and out of a parallelized model: each rank reads only its blocks, and whole tensors come out.

    load      models built without values (meta_parameters), each rank reading its blocks of safetensors files
              (load_safetensors); a state dict with each tied tensor once (unique_state_dict)
    sources   where a parameter's values lie in a checkpoint written for another layout (experts stored one
              tensor each, or fused): the blocks read and converted
    digests   the ranks read one checkpoint: the files' fingerprints, then a CRC-32 of every region each rank reads
    export    a parallelized model's values whole on its placement's first rank (full_state_dict, export_rank)
    atomic    saves that cannot tear: written into a staging folder, made the checkpoint once complete (atomic_folder)
    together  saves every rank makes: met through the store, a rank's failure named on every rank within seconds
"""

from __future__ import annotations

from tpflow.checkpoint.atomic import atomic_folder, check_complete
from tpflow.checkpoint.export import export_rank, full_state_dict
from tpflow.checkpoint.load import load_safetensors, meta_parameters, unique_state_dict

__all__ = ["atomic_folder", "check_complete", "export_rank", "full_state_dict", "load_safetensors",
           "meta_parameters", "unique_state_dict"]
