"""The tiled matmul and linear kernels against torch, on CPU through Triton's interpreter and
compiled on a GPU. Tolerance scales with the dtype's own error:
err(kernel, fp64) <= 2 * err(torch in the same dtype, fp64) + atol."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

try:
    import triton
except ImportError:  # the fixture below skips every test
    triton = None

import tpflow as tpf
from tpflow.kernels import linear, linear_ref, matmul, matmul_ref

if triton is not None:
    from tpflow.kernels import launcher, tuning

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])  # interpreter: no bf16
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def _triton_kernels():
    """The Triton kernels on CPU too; the tiled one unless a test asks for the persistent one (the
    default on a GPU), so that a GPU checks both. A test may set switches further: they are put back."""
    pytest.importorskip("triton")
    with tpf.config.override(kernels="triton", matmul="tiled"):
        yield


def _close(got, want_torch, ref64, dtype):
    assert got.shape == ref64.shape and got.dtype == want_torch.dtype
    if not got.numel():
        return
    err = (got.double() - ref64).abs().max().item()
    bound = 2 * (want_torch.double() - ref64).abs().max().item() + ATOL[dtype] * max(1.0, ref64.abs().max().item())
    assert err <= bound, f"error {err:.3g} > bound {bound:.3g}"


def _rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m, k, n", [(1, 9, 41), (9, 41, 127), (41, 127, 9), (127, 1, 256), (256, 256, 256),
                                     (127, 41, 1), (64, 64, 64)])
def test_shapes(m, k, n, dtype):
    a, b = _rand(m, k, dtype=dtype, seed=1), _rand(k, n, dtype=dtype, seed=2)
    _close(matmul(a, b), matmul_ref(a, b), matmul_ref(a, b, upcast=True), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("has_bias, activation, has_acc",
                         list(itertools.product([False, True], [None, "relu", "gelu", "silu"], [False, True])))
def test_epilogues(has_bias, activation, has_acc, dtype):
    a, b = _rand(41, 127, dtype=dtype, seed=1), _rand(127, 9, dtype=dtype, seed=2)
    bias = _rand(9, dtype=dtype, seed=3) if has_bias else None
    acc = _rand(41, 9, dtype=torch.float32, seed=4) if has_acc else None  # partials travel in fp32
    kw = dict(bias=bias, activation=activation, acc=acc)
    _close(matmul(a, b, **kw), matmul_ref(a, b, **kw), matmul_ref(a, b, upcast=True, **kw), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("has_bias, activation, has_acc, into",
                         list(itertools.product([False, True], [None, "relu"], [False, True], ["new", "out", "acc"])))
def test_torch_path(has_bias, activation, has_acc, into, dtype):
    """CPU tensors with the kernels switch at torch: torch's BLAS (addmm where the epilogue is only adds), accumulating
    in fp32 like the kernel, whatever the input dtype."""
    if into == "acc" and not has_acc:
        pytest.skip("accumulating in place needs an accumulator")
    tpf.config.set(kernels="torch")
    a, b = _rand(37, 20, dtype=dtype, seed=1).cpu(), _rand(20, 9, dtype=dtype, seed=2).cpu()
    bias = _rand(9, dtype=dtype, seed=3).cpu() if has_bias else None
    acc = _rand(33, 9, dtype=torch.float32, seed=4).cpu() if has_acc else None
    kw = dict(bias=bias, activation=activation, acc=acc, row_start=4, row_end=37)
    out = {"new": None, "out": torch.empty(33, 9, dtype=torch.float32), "acc": acc}[into]
    want = matmul_ref(a[4:], b, bias=bias, activation=activation, acc=acc, upcast=True).float()
    got = matmul(a, b, out=out, out_dtype=None if out is not None else torch.float32, **kw)
    assert out is None or got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, want)


def test_torch_path_accumulates_fp16_in_fp32():
    """A sum past fp16's range (65504) into an fp32 accumulator stays finite and exact, as in the kernel."""
    tpf.config.set(kernels="torch")
    a, b = torch.full((8, 4096), 30.0, dtype=torch.float16), torch.ones(4096, 3, dtype=torch.float16)
    acc = torch.zeros(8, 3)
    assert torch.equal(matmul(a, b, acc=acc, out=acc), torch.full((8, 3), 122880.0))


def test_transposed_and_sliced_operands_are_read_in_place():
    base_a, base_b = _rand(50, 80, dtype=torch.float32, seed=1), _rand(60, 90, dtype=torch.float32, seed=2)
    a = base_a.mT[3:40, 5:45]  # [37, 40], column-major and offset
    b = base_b[10:50, ::4]  # [40, 23], stride 4 along columns
    assert not a.is_contiguous() and not b.is_contiguous()
    _close(matmul(a, b), matmul_ref(a, b), matmul_ref(a, b, upcast=True), torch.float32)


@pytest.mark.parametrize("row_start, row_end, tile_offset", [(0, 127, 0), (3, 70, 1), (64, 127, 5), (5, 5, 0)])
def test_row_ranges(row_start, row_end, tile_offset):
    a, b = _rand(127, 33, dtype=torch.float32, seed=1), _rand(33, 70, dtype=torch.float32, seed=2)
    acc = _rand(row_end - row_start, 70, dtype=torch.float32, seed=3)
    out = torch.full((row_end - row_start, 70), float("nan"), device=DEVICE)
    got = matmul(a, b, acc=acc, out=out, row_start=row_start, row_end=row_end, tile_offset=tile_offset)
    assert got.data_ptr() == out.data_ptr() and not out.isnan().any()  # every tile written exactly where it belongs
    ref = matmul_ref(a, b, upcast=True)[row_start:row_end] + acc.double()
    _close(got, matmul_ref(a[row_start:row_end], b, acc=acc), ref, torch.float32)


def test_out_dtype_and_batched_rows():
    a, b = _rand(2, 3, 17, 40, dtype=torch.float16, seed=1), _rand(40, 24, dtype=torch.float16, seed=2)
    got = matmul(a, b, out_dtype=torch.float32)
    assert got.shape == (2, 3, 17, 24) and got.dtype == torch.float32
    _close(got, matmul_ref(a, b, out_dtype=torch.float32), matmul_ref(a, b, upcast=True), torch.float16)


def test_bad_arguments():
    a, b = _rand(8, 4, dtype=torch.float32, seed=1), _rand(4, 5, dtype=torch.float32, seed=2)
    with pytest.raises(ValueError, match="inner sizes differ"):
        matmul(a, a)
    with pytest.raises(ValueError, match="must share a dtype"):
        matmul(a, b.double())
    with pytest.raises(ValueError, match="activation must be one of"):
        matmul(a, b, activation="tanh")
    with pytest.raises(ValueError, match="outside the 8 rows"):
        matmul(a, b, row_start=2, row_end=9)
    with pytest.raises(ValueError, match=r"acc must hold the rows of the range: shape \(2, 5\)"):
        matmul(a, b, acc=torch.zeros(8, 5, device=DEVICE), row_start=2, row_end=4)
    with pytest.raises(ValueError, match="tile_offset counts row tiles forward"):
        matmul(a, b, tile_offset=-1)


def test_strided_bias():
    """A bias that is a strided view (every other element of a longer vector) is read by its values."""
    a, b = _rand(41, 40, dtype=torch.float32, seed=1), _rand(40, 24, dtype=torch.float32, seed=2)
    bias = _rand(48, dtype=torch.float32, seed=3)[::2]
    _close(matmul(a, b, bias=bias), matmul_ref(a, b, bias=bias), matmul_ref(a, b, bias=bias, upcast=True),
           torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu"])
@pytest.mark.parametrize("has_bias", [False, True])
def test_linear_gradients(activation, has_bias, dtype):
    x = _rand(3, 9, 41, dtype=dtype, seed=1).requires_grad_()
    w = _rand(17, 41, dtype=dtype, seed=2).requires_grad_()
    b = _rand(17, dtype=dtype, seed=3).requires_grad_() if has_bias else None
    g = _rand(3, 9, 17, dtype=dtype, seed=4)
    leaves = [t for t in (x, w, b) if t is not None]
    got = torch.autograd.grad(linear(x, w, b, activation), leaves, g)
    want = torch.autograd.grad(linear_ref(x, w, b, activation), leaves, g)
    as64 = [t.detach().double().requires_grad_() for t in leaves]
    out64 = linear_ref(as64[0], as64[1], as64[2] if has_bias else None, activation)
    ref = torch.autograd.grad(out64, as64, g.double())
    _close(linear(x, w, b, activation), linear_ref(x, w, b, activation), out64.detach(), dtype)
    for got_t, want_t, ref_t in zip(got, want, ref):
        _close(got_t, want_t, ref_t, dtype)


def test_linear_on_the_torch_path_is_autograds_own_unless_backward_adds_work():
    """CPU tensors with the kernels switch at torch: plain calls are F.linear (native backward, same values); a dgrad
    hook or a dtype change keeps the autograd function; mixed dtypes are refused on both paths."""
    tpf.config.set(kernels="torch")
    x = torch.randn(2, 5, 4, requires_grad=True)
    w, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, requires_grad=True)
    for activation in (None, "gelu"):
        y = linear(x, w, b, activation)
        assert "_Linear" not in type(y.grad_fn).__name__, y.grad_fn
        torch.testing.assert_close(y, linear_ref(x, w, b, activation), rtol=0, atol=0)
    assert type(linear(x, w, dgrad_hook=lambda dx: None).grad_fn).__name__ == "_LinearBackward"
    assert type(linear(x, w, out_dtype=torch.float64).grad_fn).__name__ == "_LinearBackward"
    torch.testing.assert_close(linear(x, w, b.double()), linear_ref(x, w, b))  # a bias is cast, as in the kernel
    with pytest.raises(ValueError, match="x is torch.float64 but weight is torch.float32"):
        linear(x.double(), w)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_linear_under_autocast_casts_what_f_linear_casts(device):
    """Under autocast (bf16 and fp16) every pair of operand dtypes gives F.linear's output dtype, or fails where it
    fails (fp64 beside a cast operand): float64 is never cast. (On CPU through torch: the interpreter's bf16 is
    broken.)"""
    if device == "cpu":
        tpf.config.set(kernels="torch")
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    for dtype, x_dtype, w_dtype in itertools.product(dtypes[:2], dtypes, dtypes):
        x = torch.randn(2, 3, dtype=x_dtype, device=device)
        w = torch.randn(4, 3, dtype=w_dtype, device=device)
        with torch.autocast(device, dtype=dtype):
            try:
                want = torch.nn.functional.linear(x, w)
            except RuntimeError:
                with pytest.raises((RuntimeError, ValueError)):
                    linear(x, w)
                continue
            got = linear(x, w)
        assert got.dtype == want.dtype, (dtype, x_dtype, w_dtype, got.dtype, want.dtype)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_linear_dgrad_hook_overlaps_the_weight_gradient(monkeypatch):
    """The hook sees dx before the weight gradient is computed, and what it returns is waited after it."""
    tpf.config.set(kernels="torch")
    events = []

    class Pending:
        def wait(self):
            events.append("wait")

    def hook(dx):
        events.append("dgrad")
        dx.mul_(2)  # in place, as an all-reduce would
        return Pending()

    linear_module = importlib.import_module("tpflow.kernels.linear")  # the package exports the function of that name
    real = linear_module.matmul
    monkeypatch.setattr(linear_module, "matmul", lambda *a, **k: events.append("matmul") or real(*a, **k))
    x = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(3, 4, requires_grad=True)
    linear(x, w, dgrad_hook=hook).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    linear_ref(x_ref, w.detach()).sum().backward()
    assert events == ["matmul", "matmul", "dgrad", "matmul", "wait"]  # forward; dx; hook; dW; wait
    torch.testing.assert_close(x.grad, 2 * x_ref.grad)


# The persistent TMA kernel (TPFLOW_MATMUL=persistent): fp16 / bf16 operands whose row strides are
# 16-byte aligned, in any of the four layouts; everything else falls back to the tiled kernel.

PERSISTENT_DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.fixture
def persistent():
    tpf.config.set(matmul="persistent")  # put back by _triton_kernels


def _layout(t, transposed):
    """t's values, stored transposed (column-major) when asked."""
    return t.mT.contiguous().mT if transposed else t


def _persistent_runs(a, b, out=None, pre=None):
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=DEVICE) if out is None else out
    return launcher.kernel_choice(a, b, out, pre) == "persistent"


@pytest.mark.usefixtures("persistent")
@pytest.mark.parametrize("dtype", PERSISTENT_DTYPES, ids=str)
@pytest.mark.parametrize("a_t, b_t", list(itertools.product([False, True], repeat=2)), ids=lambda t: "T" if t else "N")
@pytest.mark.parametrize("m, k, n", [(8, 8, 40), (40, 40, 128), (48, 128, 8), (128, 16, 256), (256, 256, 256),
                                     (72, 64, 200)])
def test_persistent_shapes_and_layouts(m, k, n, a_t, b_t, dtype):
    a = _layout(_rand(m, k, dtype=dtype, seed=1), a_t)
    b = _layout(_rand(k, n, dtype=dtype, seed=2), b_t)
    assert _persistent_runs(a, b)
    _close(matmul(a, b), matmul_ref(a, b), matmul_ref(a, b, upcast=True), dtype)


@pytest.mark.usefixtures("persistent")
@pytest.mark.parametrize("subtile", [True, False], ids=["C in halves", "C whole"])
@pytest.mark.parametrize("has_bias, activation, has_acc",
                         list(itertools.product([False, True], [None, "relu", "gelu", "silu"], [False, True])))
def test_persistent_epilogues(has_bias, activation, has_acc, subtile):
    config = tuning.configs("persistent", autotune=False)[0]  # the pinned one (the interpreter's on CPU)
    pinned = triton.Config({**config.kwargs, "SUBTILE": subtile}, num_warps=config.num_warps,
                           num_stages=config.num_stages, pre_hook=config.pre_hook)
    with tuning.use("persistent", tuning.Tuned("persistent", [pinned])):
        _check_persistent_epilogue(has_bias, activation, has_acc)


def _check_persistent_epilogue(has_bias, activation, has_acc):
    dtype = PERSISTENT_DTYPES[0]
    a, b = _rand(41, 128, dtype=dtype, seed=1), _rand(72, 128, dtype=dtype, seed=2).mT  # nn.Linear's layout
    bias = _rand(72, dtype=dtype, seed=3) if has_bias else None
    acc = _rand(41, 72, dtype=torch.float32, seed=4) if has_acc else None
    pre = torch.empty(41, 72, dtype=dtype, device=DEVICE)
    kw = dict(bias=bias, activation=activation, acc=acc)
    assert _persistent_runs(a, b, pre=pre)
    _close(matmul(a, b, pre=pre, **kw), matmul_ref(a, b, **kw), matmul_ref(a, b, upcast=True, **kw), dtype)
    z = dict(bias=bias)
    _close(pre, matmul_ref(a, b, **z), matmul_ref(a, b, upcast=True, **z), dtype)


@pytest.mark.usefixtures("persistent")
@pytest.mark.parametrize("row_start, row_end, tile_offset", [(0, 120, 0), (8, 72, 1), (64, 120, 5), (16, 16, 0)])
def test_persistent_row_ranges(row_start, row_end, tile_offset):
    a, b = _rand(120, 32, dtype=torch.float16, seed=1), _rand(72, 32, dtype=torch.float16, seed=2).mT
    acc = _rand(row_end - row_start, 72, dtype=torch.float32, seed=3)
    full = torch.full((row_end - row_start + 2, 72), float("nan"), device=DEVICE)
    out = full[1:-1]  # rows of a bigger buffer, as the rings write them; the rows around stay untouched
    assert row_end == row_start or _persistent_runs(a, b, out)  # (an empty range launches nothing)
    got = matmul(a, b, acc=acc, out=out, row_start=row_start, row_end=row_end, tile_offset=tile_offset)
    assert got.data_ptr() == out.data_ptr() and not out.isnan().any() and full[[0, -1]].isnan().all()
    ref = matmul_ref(a, b, upcast=True)[row_start:row_end] + acc.double()
    _close(got, matmul_ref(a[row_start:row_end], b, acc=acc, out_dtype=torch.float32), ref, torch.float16)


@pytest.mark.usefixtures("persistent")
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_persistent_linear_gradients(activation):
    """forward a @ w.mT, dgrad dz @ w and wgrad dz.mT @ x: three layouts, all on the persistent kernel."""
    dtype = PERSISTENT_DTYPES[0]
    x = _rand(3, 16, 40, dtype=dtype, seed=1).requires_grad_()
    w = _rand(24, 40, dtype=dtype, seed=2).requires_grad_()
    b = _rand(24, dtype=dtype, seed=3).requires_grad_()
    g = _rand(3, 16, 24, dtype=dtype, seed=4)
    x2, dz = x.detach().flatten(0, 1), g.flatten(0, 1)
    assert _persistent_runs(x2, w.detach().mT) and _persistent_runs(dz, w.detach()) and _persistent_runs(dz.mT, x2)
    got = torch.autograd.grad(linear(x, w, b, activation), (x, w, b), g)
    want = torch.autograd.grad(linear_ref(x, w, b, activation), (x, w, b), g)
    as64 = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = torch.autograd.grad(linear_ref(*as64, activation), as64, g.double())
    for got_t, want_t, ref_t in zip(got, want, ref):
        _close(got_t, want_t, ref_t, dtype)


@pytest.mark.parametrize("kernel", ["tiled", "persistent"])
def test_a_tuned_key_launches_without_the_autotuner(monkeypatch, kernel):
    """A key's first launch goes through the autotuner; later ones launch its chosen config directly, with
    the same results; a new key (here a bias) goes through the autotuner again."""
    tpf.config.set(matmul=kernel)
    tuned = tuning.tuned(kernel)
    monkeypatch.setattr(tuned, "chosen", {})
    tuner_runs = []
    real = tuned.autotuner.run
    monkeypatch.setattr(tuned.autotuner, "run", lambda *args, **kw: tuner_runs.append(1) or real(*args, **kw))
    a, b = _rand(41, 128, dtype=torch.float16, seed=1), _rand(72, 128, dtype=torch.float16, seed=2).mT
    bias = _rand(72, dtype=torch.float16, seed=3)
    assert _persistent_runs(a, b) == (kernel == "persistent")
    for _ in range(3):
        _close(matmul(a, b), matmul_ref(a, b), matmul_ref(a, b, upcast=True), torch.float16)
    assert len(tuner_runs) == 1 and len(tuned.chosen) == 1
    for _ in range(2):
        _close(matmul(a, b, bias=bias), matmul_ref(a, b, bias=bias), matmul_ref(a, b, bias=bias, upcast=True),
               torch.float16)
    assert len(tuner_runs) == 2 and len(tuned.chosen) == 2


def test_kernel_choice(monkeypatch):
    """Persistent where TMA can read and write the operands, tiled otherwise; by default persistent
    compiled and tiled under the interpreter."""
    a, b = _rand(16, 32, dtype=torch.float16, seed=1), _rand(32, 24, dtype=torch.float16, seed=2)
    out = torch.empty(16, 24, dtype=torch.float16, device=DEVICE)
    assert launcher.kernel_choice(a, b, out) == "tiled"
    tpf.config.set(matmul="auto")
    assert launcher.kernel_choice(a, b, out) == ("tiled" if launcher.INTERPRET else "persistent")
    tpf.config.set(matmul="persistent")
    assert launcher.kernel_choice(a, b, out) == "persistent"
    assert launcher.kernel_choice(a, b, out.float()) == "persistent"  # an fp32 result (the rings' partials)
    assert launcher.kernel_choice(a.float(), b.float(), out.float()) == "tiled"  # fp32 operands: tf32 / ieee dots
    assert launcher.kernel_choice(_rand(16, 33, dtype=torch.float16, seed=1)[:, :32], b, out) == "tiled"  # 66-byte rows
    shifted = _rand(16 * 32 + 1, dtype=torch.float16, seed=1)[1:].view(16, 32)  # base 2 bytes past an alignment
    assert launcher.kernel_choice(shifted, b, out) == "tiled"
    assert launcher.kernel_choice(a, b[:, ::2], out[:, :12]) == "tiled"  # no unit stride
    assert launcher.kernel_choice(a, b, out.mT.contiguous().mT) == "tiled"  # C is stored row-major
    row = _rand(1, 32, dtype=torch.float16, seed=3)
    assert launcher.kernel_choice(row.expand(16, 32), b, out) == "tiled"  # stride 0: rows are not apart
    assert launcher.kernel_choice(a, b, out[:, :1].expand(16, 24)) == "tiled"
    with pytest.raises(ValueError, match=r"switch matmul \(TPFLOW_MATMUL\) must be one of"):
        tpf.config.set(matmul="fast")
    tpf.config.reset("matmul")
    monkeypatch.setenv("TPFLOW_MATMUL", "fast")  # the environment is read when used, and checked there
    with pytest.raises(ValueError, match=r"switch matmul \(TPFLOW_MATMUL\) must be one of"):
        matmul(a, b)
