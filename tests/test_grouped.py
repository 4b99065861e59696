"""The grouped GEMM of the experts (``tpflow.kernels.grouped_mm``) against float64 loops of torch.matmul, forward and
both gradients, on CPU through Triton's interpreter and compiled on a GPU; and the ``"tpflow"`` experts
implementation against transformers' own on the same modules. Tolerance scales with the dtype's own error:
err(kernel, fp64) <= 2 * err(torch in the same dtype, fp64) + atol."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import tpflow as tpf
from tpflow.kernels import grouped_mm, grouped_mm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])  # interpreter: no bf16
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
# 5 experts over 70 rows: 10, none, 30 (two row tiles and part of a third under the interpreter), 1 and 19; the last
# 10 rows belong to no expert
OFFS = [10, 10, 40, 41, 60]


@pytest.fixture(autouse=True)
def _triton_kernels():
    pytest.importorskip("triton")
    with tpf.config.override(kernels="triton"):
        yield


def _rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def _offs(ends):
    return torch.tensor(ends, dtype=torch.int32, device=DEVICE)


def _close(got, want_torch, ref64, dtype, what):
    assert got.shape == ref64.shape and got.dtype == want_torch.dtype, what
    if not got.numel():
        return
    err = (got.double() - ref64).abs().max().item()
    bound = 2 * (want_torch.double() - ref64).abs().max().item() + ATOL[dtype] * max(1.0, ref64.abs().max().item())
    assert err <= bound, f"{what}: error {err:.3g} > bound {bound:.3g}"


def _check(x, w, offs, dtype, **kw):
    """y, dx and dw of grouped_mm against grouped_mm_ref in x's dtype and in fp64; the rows past offs[-1] exactly 0."""
    x, w = x.requires_grad_(), w.requires_grad_()
    y = grouped_mm(x, w, offs, **kw)
    dy = _rand(*y.shape, dtype=y.dtype, seed=9)
    got = (y, *torch.autograd.grad(y, (x, w), dy))
    want = grouped_mm_ref(x, w, offs, **kw)
    want = (want, *torch.autograd.grad(want, (x, w), dy))
    as64 = [t.detach().double().requires_grad_() for t in (x, w)]
    ref = grouped_mm_ref(*as64, offs, **kw)
    ref = (ref.detach(), *torch.autograd.grad(ref, as64, dy.double()))
    for what, got_t, want_t, ref_t in zip(("y", "dx", "dw"), got, want, ref):
        _close(got_t, want_t, ref_t, dtype, what)
    end = int(offs[-1]) if offs.numel() else 0
    assert not got[0][end:].any() and not got[1][end:].any()  # written, as zeros


CASES = [(torch.float32, True, None, False), (torch.float16, False, "gelu", False),
         (torch.float32, False, "relu", True), *((dtype, True, "silu", True) for dtype in DTYPES)]


def _case(case) -> str:
    dtype, transposed, activation, gated = case
    return "-".join([str(dtype).removeprefix("torch."), *["wT"] * transposed, *["gated"] * gated, str(activation)])


@pytest.mark.parametrize("dtype, transposed, activation, gated", CASES, ids=[_case(c) for c in CASES])
def test_products_and_gradients(dtype, transposed, activation, gated):
    """Skewed experts (one without rows, one with a single row), rows past the last expert, K and N not multiples of
    a tile; w as stored ([E, K, N]) or as transformers' [E, N, K] read through .mT; gated: act(gate) * up."""
    n = 46 if gated else 45
    x = _rand(70, 37, dtype=dtype, seed=1)
    w = _rand(5, n, 37, dtype=dtype, seed=2).mT if transposed else _rand(5, 37, n, dtype=dtype, seed=2)
    _check(x, w.detach(), _offs(OFFS), dtype, activation=activation, gated=gated)


@pytest.mark.parametrize("rows, k, n, ends", [(0, 8, 6, [0, 0]), (33, 20, 1, [33]), (21, 5, 40, [0, 0, 0]),
                                              (40, 16, 32, [0, 40])],
                         ids=["no rows", "one expert", "no expert's rows", "all in the last expert"])
def test_edge_sizes(rows, k, n, ends):
    x, w = _rand(rows, k, dtype=torch.float32, seed=1), _rand(len(ends), k, n, dtype=torch.float32, seed=2)
    _check(x, w, _offs(ends), torch.float32, activation="silu")


def test_every_row_and_weight_is_written():
    """The kernels write every element of their results: the rows past the experts and an expert without rows
    included (zeros), over buffers filled with nan."""
    from tpflow.kernels import grouped_tiles

    x, w, offs = _rand(70, 20, dtype=torch.float32, seed=1), _rand(5, 20, 12, dtype=torch.float32, seed=2), _offs(OFFS)
    y, pre = torch.full((70, 6), float("nan"), device=DEVICE), torch.full((70, 12), float("nan"), device=DEVICE)
    grouped_tiles.product(x, w, offs, y, pre, tpf.kernels.ACTIVATIONS["silu"], True)
    torch.testing.assert_close(y, grouped_mm_ref(x, w, offs, activation="silu", gated=True))
    torch.testing.assert_close(pre, grouped_mm_ref(x, w, offs))
    dw = torch.full((5, 20, 6), float("nan"), device=DEVICE)
    grouped_tiles.weight_grad(x, y, offs, dw)
    want = torch.stack([x[a:b].mT @ y[a:b] for a, b in zip([0, *OFFS], OFFS)])
    torch.testing.assert_close(dw, want)


def test_out_dtype_and_inference():
    """fp16 operands into an fp32 result; without gradients nothing is kept for a backward, with the same result."""
    x, w = _rand(70, 24, dtype=torch.float16, seed=1), _rand(5, 24, 18, dtype=torch.float16, seed=2)
    kw = dict(activation="silu", gated=True, out_dtype=torch.float32)
    y = grouped_mm(x, w, _offs(OFFS), **kw)
    assert y.grad_fn is None and y.dtype == torch.float32
    _close(y, grouped_mm_ref(x, w, _offs(OFFS), **kw), grouped_mm_ref(x, w, _offs(OFFS), upcast=True, **kw),
           torch.float16, "y")
    y_grad = grouped_mm(x.requires_grad_(), w, _offs(OFFS), **kw)
    assert y_grad.grad_fn is not None and torch.equal(y, y_grad.detach())


def test_bad_arguments():
    x, w, offs = torch.ones(6, 4), torch.ones(2, 4, 3), torch.tensor([2, 6], dtype=torch.int32)
    for args, kw, match in [((x, w[:, :3], offs), {}, "sizes differ"), ((x, w, offs[:1]), {}, "sizes differ"),
                            ((x, w[0], offs), {}, r"takes x \[S, K\], w \[E, K, N\]"),
                            ((x, w.half(), offs), {}, "one floating dtype"),
                            ((x.int(), w.int(), offs), {}, "one floating dtype"),
                            ((x, w, offs.float()), {}, "offs must be int32 or int64"),
                            ((x, w, torch.tensor([3, 2], dtype=torch.int32)), {}, "non-decreasing"),
                            ((x, w, torch.tensor([2, 7], dtype=torch.int32)), {}, "at most x's 6 rows"),
                            ((x, w, offs), {"gated": True}, "must be an even"),
                            ((x, w, offs), {"activation": "tanh"}, "activation must be one of")]:
        with pytest.raises(ValueError, match=match):
            grouped_mm(*args, **kw)


# The experts implementation: tiny modules of transformers, fp32 (torch._grouped_mm's CPU kernel takes no fp64)


@pytest.fixture
def tpflow_experts():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from tpflow.kernels import register_experts_implementation
    from tpflow.kernels.experts_forward import experts_forward

    register_experts_implementation()
    register_experts_implementation()  # again: nothing more
    assert ALL_EXPERTS_FUNCTIONS["tpflow"] is experts_forward
    return ALL_EXPERTS_FUNCTIONS


def _grads(outputs, inputs):
    return torch.autograd.grad(outputs, inputs, _rand(*outputs.shape, dtype=outputs.dtype, seed=5))


def test_experts_implementation_on_a_model(tpflow_experts, monkeypatch):
    """A Qwen3-MoE built with experts_implementation="tpflow": logits and every gradient as with "grouped_mm" and
    "eager", its SwiGLU fused into the kernel."""
    import transformers

    from tpflow.kernels import experts_forward as module

    calls = []
    monkeypatch.setattr(module, "grouped_mm", lambda *a, **kw: calls.append(kw) or grouped_mm(*a, **kw))
    cfg = transformers.Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=16, moe_intermediate_size=8,
                                      num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="tpflow").to(DEVICE)
    ids = torch.randint(0, 32, (2, 9), device=DEVICE)
    params = list(model.parameters())
    results = {}
    for name in ("tpflow", "grouped_mm", "eager"):
        model.set_experts_implementation(name)
        logits = model(ids).logits
        results[name] = (logits, *_grads(logits, params))
    assert calls[0] == {"activation": "silu", "gated": True} and calls[1] == {}  # gate and up fused; down
    for name in ("grouped_mm", "eager"):
        for got, want in zip(results["tpflow"], results[name]):
            torch.testing.assert_close(got, want)


def _plain_experts():
    """Experts without a gate (up, gelu-tanh, down, then a norm): the activation is fused, the norm is the module's."""
    from transformers.activations import GELUTanh
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(has_gate=False, has_post_expert_norm=True)
    class PlainExperts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = 4
            self.up_proj = nn.Parameter(torch.randn(4, 8, 16) / 4)
            self.down_proj = nn.Parameter(torch.randn(4, 16, 8) / 3)
            self.act_fn = GELUTanh()
            self.post_expert_norm = nn.RMSNorm(16)

    return PlainExperts(types.SimpleNamespace(_experts_implementation="tpflow"))


def _gpt_oss_experts():
    """gpt-oss's experts: transposed weights, biases, its own gate on interleaved columns (not fused)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=4)
    experts = GptOssExperts(cfg)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.3)
    return experts


@pytest.mark.parametrize("make", [_plain_experts, _gpt_oss_experts], ids=["plain", "gpt-oss"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["one rank", "sentinels"])
def test_experts_implementation_on_modules(tpflow_experts, make, expert_parallel):
    """Output and gradients (tokens, routing weights, parameters) as transformers' "grouped_mm" gives them; under
    expert parallelism the ids past the experts (another rank's, weight 0) add nothing."""
    torch.manual_seed(0)
    experts = make().to(DEVICE)
    experts._is_expert_parallel = expert_parallel
    x = _rand(7, 16, dtype=torch.float32, seed=1).requires_grad_()
    ids = torch.tensor([[0, 2], [2, 3], [3, 0], [2, 4], [4, 4], [0, 3], [2, 0]], device=DEVICE)
    ids = ids if expert_parallel else ids % 4  # a sentinel (4): a token sent to another rank's expert
    weights = torch.rand(7, 2, device=DEVICE).masked_fill(ids == 4, 0.0).requires_grad_()
    inputs = [x, weights, *experts.parameters()]
    results = {}
    for name in ("tpflow", "grouped_mm"):
        out = tpflow_experts[name](experts, x, ids, weights)
        results[name] = (out, *_grads(out, inputs))
    for got, want in zip(results["tpflow"], results["grouped_mm"]):
        torch.testing.assert_close(got, want)
