"""One random state for a group of ranks that compute one thing: the first rank's, sent to the others.

The ranks of a tensor-parallel group draw the same numbers (the tokens ``generate`` samples, dropout on what they
hold alike), so where their streams may have parted (ranks seeded apart; a checkpoint that restored each rank's CUDA
generator from another process's file) the first rank's CPU state, and its CUDA device's, become every rank's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["share_random_state"]


def share_random_state(group: dist.ProcessGroup, cuda: bool | None = None) -> None:
    """Give every rank of ``group`` its first rank's random state: the CPU generator's, and the current CUDA
    device's.

    Args:
        group: the ranks to align (a tensor-parallel group).
        cuda: whether to align the current CUDA device's generator too (default: where CUDA is initialized).

    Example::

        >>> _ = torch.manual_seed(1000 + tpf.get_rank())              # ranks seeded apart
        >>> share_random_state(torch.distributed.group.WORLD)
        >>> every = [None, None]
        >>> torch.distributed.all_gather_object(every, torch.rand(2).tolist())
        >>> every[0] == every[1]
        True
    """
    if dist.get_world_size(group) == 1:
        return
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized() if cuda is None else cuda
    state = [[torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None]]
    first = dist.get_process_group_ranks(group)[0]
    dist.broadcast_object_list(state, src=first, group=group)
    if dist.get_rank() != first:
        torch.set_rng_state(state[0][0])
        if cuda:
            torch.cuda.set_rng_state(state[0][1])
