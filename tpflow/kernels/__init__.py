"""Local compute: Triton kernels and their torch references, and nothing distributed.

Every local product of a global tensor or a layer goes through ``matmul`` or ``linear``: on CUDA
tensors tpflow's Triton kernels (``tiles``, picked and launched by ``launcher``, tuned by
``tuning``), on CPU tensors torch unless the ``kernels`` switch asks for the kernels through Triton's
interpreter. ``epilogue`` holds the fused epilogue's math in torch. ``cross_entropy`` (its kernels in
``loss_tiles``) is one rank's half of a loss over classes split across ranks. The collectives that combine
these kernels with communication are in ``tpflow.ops``.
"""

from __future__ import annotations

from tpflow.kernels.cross_entropy import logit_grad, logit_grad_ref, logit_stats, logit_stats_ref
from tpflow.kernels.epilogue import ACTIVATIONS
from tpflow.kernels.linear import linear, linear_ref, wanted
from tpflow.kernels.matmul import matmul, matmul_ref, use_triton

__all__ = ["ACTIVATIONS", "linear", "linear_ref", "logit_grad", "logit_grad_ref", "logit_stats", "logit_stats_ref",
           "matmul", "matmul_ref", "use_triton", "wanted"]
