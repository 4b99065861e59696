"""Local compute: Triton kernels and their torch references, and nothing distributed.

Every local product of a global tensor or a layer goes through ``matmul`` or ``linear``: on CUDA
tensors tpflow's Triton kernels (``tiles``, picked and launched by ``launcher``, tuned by
``tuning``), on CPU tensors torch unless the ``kernels`` switch asks for the kernels through Triton's
interpreter. ``epilogue`` holds the fused epilogue's math in torch. ``cross_entropy`` (its kernels in
``loss_tiles``) is one rank's half of a loss over classes split across ranks. ``grouped`` (its kernels in
``grouped_tiles``) is the experts' grouped GEMM, and ``experts_forward`` puts it under transformers' MoE models
(``experts_implementation="tpflow"``). ``attention`` (its kernels in ``attention_tiles`` and, backward,
``attention_grad_tiles``) is flash-attention on one block of queries and one of keys at any global positions (each
query's first key too), returning the log-sum-exp that a context-parallel ring merges its steps by. The collectives
that combine these kernels with communication are in ``tpflow.ops``.
"""

from __future__ import annotations

from tpflow.kernels.attention import attention, attention_ref
from tpflow.kernels.cross_entropy import logit_grad, logit_grad_ref, logit_stats, logit_stats_ref
from tpflow.kernels.epilogue import ACTIVATIONS
from tpflow.kernels.experts_forward import register_experts_implementation
from tpflow.kernels.grouped import grouped_mm, grouped_mm_ref
from tpflow.kernels.linear import linear, linear_ref, wanted
from tpflow.kernels.matmul import matmul, matmul_ref, use_triton

__all__ = ["ACTIVATIONS", "attention", "attention_ref", "grouped_mm", "grouped_mm_ref", "linear", "linear_ref",
           "logit_grad", "logit_grad_ref", "logit_stats", "logit_stats_ref", "matmul", "matmul_ref",
           "register_experts_implementation", "use_triton", "wanted"]
