"""Random numbers across the tensor-parallel ranks, Megatron's rule: two streams.

Dropout where every tensor-parallel rank holds the whole activation (the residual stream, the embeddings, attention
over heads a column layer gathered) draws from the generator the user seeded, which must be seeded alike on those
ranks and drawn from alike (``plans.inputs`` checks its state at the model's entry on every training step): every
rank then drops the same values, as one device does.
Dropout on a rank's block of features, between a column layer that keeps its output split and the row layer that
reads it (the attention probabilities of this rank's heads, an MLP's hidden features), draws from a stream of its
own: the generator is seeded there from a digest of its state, the column layer's name and the rank, and given back
its state at the row layer. So the ranks' blocks get independent masks (seeded alike, they would all drop the same
pattern), and the shared stream is left where it was: ranks that draw different counts in their blocks (uneven
heads) still draw alike after them. Activation checkpointing restores the shared stream before it recomputes a
layer, so the recomputation seeds the same split stream and draws the same masks.

Only a model that draws random numbers (``inputs.draws_random``), in training, pays for this: two reads of the
generator's state and a seeding per split region.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from tpflow.layers.column import ColumnParallelLinear
from tpflow.layers.row import RowParallelLinear
from tpflow.placement import Placement

__all__ = ["split_streams"]


def _state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class _Streams:
    """The hooks of one model: a column layer's output opens this rank's stream, a row layer's input (or the model's
    end) gives the shared stream back."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.shared: tuple[torch.device, torch.Tensor] | None = None  # the shared stream's state while one is open

    def open(self, name: str, module: nn.Module, output: object) -> None:
        if not module.training or self.shared is not None or not isinstance(output, torch.Tensor) \
                or torch.compiler.is_compiling():
            return
        device = output.device
        state = _state(device)
        digest = hashlib.blake2b(state.numpy().tobytes() + f"/{name}/{self.rank}".encode(), digest_size=8).digest()
        seed = int.from_bytes(digest, "little") & (2**63 - 1)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        self.shared = (device, state)

    def close(self, *_: object) -> None:
        if self.shared is not None:
            _set_state(*self.shared)
            self.shared = None


def split_streams(model: nn.Module, placement: Placement) -> None:
    """Give ``model``'s split regions a random stream per rank (see the module's docstring); a model with no column
    layer keeping its output split has none.

    Args:
        model: a model ``parallelize`` changed, that draws random numbers in training.
        placement: its tensor-parallel placement.

    Example::

        >>> from torch import nn
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 4))
        >>> model = tpf.parallelize(model, placement=P, plan={"0": "column", "2": "row"})   # calls it
        >>> _ = torch.manual_seed(0)                      # alike on both ranks
        >>> x = torch.ones(1, 4)
        >>> model(x).shape                                # each rank drops its own features' values
        torch.Size([1, 4])
    """
    coordinate = placement.coordinate()
    columns = [(name, m) for name, m in model.named_modules()
               if isinstance(m, ColumnParallelLinear) and not m.gather_output]
    if coordinate is None or not columns:
        return
    streams = _Streams(coordinate[-1])
    for name, module in columns:
        module.register_forward_hook(lambda m, args, out, name=name: streams.open(name, m, out))
    for module in model.modules():
        if isinstance(module, RowParallelLinear):
            module.register_forward_pre_hook(streams.close)
    model.register_forward_hook(streams.close, always_call=True)  # a region the model's end reaches open
