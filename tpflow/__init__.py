"""tpflow: tensor-parallel layers for PyTorch with OneFlow's global view.

Every global tensor has a placement (which ranks) and an SBP (split / broadcast / partial
sum per placement axis); underneath it is a ``DTensor``. ``TPFLOW_DEBUG=1`` logs every boxing
route and matmul signature choice to stderr.
"""

from __future__ import annotations

import logging
import os

from tpflow import comm, gradients, kernels, sbp
from tpflow.global_tensor import (
    from_local,
    full,
    get_placement,
    get_sbp,
    matmul,
    ones,
    rand,
    randn,
    tensor,
    to_global,
    to_local,
    zeros,
)
from tpflow.layers import (
    ColumnParallel,
    ColumnParallelLinear,
    Pipeline,
    PipelineError,
    RowParallel,
    RowParallelLinear,
    Stage,
    parallelize,
    stage,
)
from tpflow.placement import Placement, get_rank, get_world_size, init_distributed, placement

__all__ = [
    "ColumnParallel",
    "ColumnParallelLinear",
    "Pipeline",
    "PipelineError",
    "Placement",
    "RowParallel",
    "RowParallelLinear",
    "Stage",
    "comm",
    "from_local",
    "full",
    "get_placement",
    "get_rank",
    "get_sbp",
    "get_world_size",
    "gradients",
    "init_distributed",
    "kernels",
    "matmul",
    "ones",
    "parallelize",
    "placement",
    "rand",
    "randn",
    "sbp",
    "stage",
    "tensor",
    "to_global",
    "to_local",
    "zeros",
]

__version__ = "0.1.0"


def _debug_logging() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[tpflow rank {os.environ.get('RANK', '0')}] %(message)s"))
    logger = logging.getLogger("tpflow")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)


if os.environ.get("TPFLOW_DEBUG") == "1":
    _debug_logging()
