"""ColumnParallelLinear, RowParallelLinear and parallelize() against one device (nn.Linear) and against
PyTorch's own tensor parallelism, W = 1..4, even and uneven features, forward and every gradient.
Weights and inputs are small integers, so results are exact: compared with torch.equal."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpflow as tpf
from tests import harness
from tests.checks import (
    S0,
    B,
    all_ranks,
    backward_logical,
    half_precision_rounds_once,
    ints,
    logical,
    mlp_matches_one_device,
    own,
)
from tests.models import LLAMA_PLAN, MLP, Stack, TinyLlama, int_linear
from tpflow.layers import VocabParallelEmbedding
from tpflow.sbp import chunk_bounds

FEATURES = [(6, 8), (5, 7), (3, 2)]  # even for W = 2; uneven; fewer output features than ranks


def _assert_grads(layer, ref, weight_block):
    assert torch.equal(layer.weight.grad.to_local(), ref.weight.grad[weight_block]), "weight gradient"
    if ref.bias is not None:
        col = weight_block[0] if isinstance(weight_block, tuple) else weight_block
        want = ref.bias.grad[col] if isinstance(layer, tpf.ColumnParallelLinear) else ref.bias.grad
        assert torch.equal(layer.bias.grad.to_local(), want), "bias gradient"


def _column_rank(fin, fout, bias, gather_output):
    ref = int_linear(fin, fout, bias, seed=1)
    layer = tpf.ColumnParallelLinear.from_linear(ref, placement=all_ranks(), gather_output=gather_output)
    x = ints((3, 4, fin), seed=2).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = layer(x), ref(x_ref)
    cols = own(fout)
    assert torch.equal(y, y_ref if gather_output else y_ref[..., cols]), "output"
    g = ints(y_ref.shape, seed=3)
    y.backward(g if gather_output else g[..., cols])
    y_ref.backward(g)
    assert torch.equal(x.grad, x_ref.grad), "input gradient (all-reduced over the ranks)"
    _assert_grads(layer, ref, cols)


def _row_rank(fin, fout, bias, input_is_parallel):
    ref = int_linear(fin, fout, bias, seed=4)
    layer = tpf.RowParallelLinear.from_linear(ref, placement=all_ranks(), input_is_parallel=input_is_parallel)
    x_ref = ints((3, 4, fin), seed=5).requires_grad_()
    rows = own(fin)
    x = (x_ref.detach()[..., rows] if input_is_parallel else x_ref.detach()).clone().requires_grad_()
    y, y_ref = layer(x), ref(x_ref)
    assert torch.equal(y, y_ref), "output"
    g = ints(y_ref.shape, seed=6)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(x.grad, x_ref.grad[..., rows] if input_is_parallel else x_ref.grad), "input gradient"
    _assert_grads(layer, ref, (slice(None), rows))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("fin, fout", FEATURES)
@pytest.mark.parametrize("bias, gather_output", [(True, False), (False, True)])
def test_column(world, fin, fout, bias, gather_output):
    harness.run(world, _column_rank, fin, fout, bias, gather_output)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("fin, fout", FEATURES)
@pytest.mark.parametrize("bias, input_is_parallel", [(True, True), (False, False)])
def test_row(world, fin, fout, bias, input_is_parallel):
    harness.run(world, _row_rank, fin, fout, bias, input_is_parallel)


# Layouts said in SBP: input_sbp= / output_sbp= and the older flags, their aliases, build the same layer.

SPELLINGS = [  # (layer, the SBP spelling, the flags it stands for)
    (tpf.ColumnParallelLinear, {"input_sbp": B, "output_sbp": tpf.sbp.split(-1)}, {"gather_output": False}),
    (tpf.ColumnParallelLinear, {"output_sbp": B}, {"gather_output": True}),
    (tpf.ColumnParallelLinear, {"input_sbp": S0}, {"sequence_parallel": True, "sequence_dim": 0}),
    (tpf.ColumnParallelLinear, {"input_sbp": tpf.sbp.split(1), "output_sbp": B},
     {"sequence_parallel": True, "sequence_dim": 1, "gather_output": True}),
    (tpf.RowParallelLinear, {"input_sbp": B}, {"input_is_parallel": False}),
    (tpf.RowParallelLinear, {"input_sbp": tpf.sbp.split(-1), "output_sbp": S0}, {"sequence_parallel": True}),
    (tpf.RowParallelLinear, {"output_sbp": tpf.sbp.split(1)}, {"sequence_parallel": True, "sequence_dim": 1}),
]


def _mine(t, sbp):
    """This rank's part of the whole ``t`` laid out as ``sbp`` over the ranks."""
    if sbp == B:
        return t
    dim = sbp.dim % t.ndim
    return t[(slice(None),) * dim + (own(t.shape[dim]),)]


def _sbp_spellings_rank():
    P = all_ranks()
    for kind, sbps, flags in SPELLINGS:
        ref = int_linear(6, 8, True, seed=11)
        x_ref = ints((4, 4, 6), seed=12).requires_grad_()  # dims 0 and 1 split evenly over the ranks
        y_ref = ref(x_ref)
        g = ints(y_ref.shape, seed=13)
        y_ref.backward(g)
        built = []
        for options in (sbps, flags):
            layer = kind.from_linear(ref, placement=P, **options)
            assert {k: getattr(layer, k) for k in flags} == flags, (kind, options)
            assert {k: getattr(layer, k) for k in sbps} == sbps, (kind, options)  # read back from the flags
            x = _mine(x_ref.detach(), layer.input_sbp).clone().requires_grad_()
            y = layer(x)
            assert torch.equal(y, _mine(y_ref.detach(), layer.output_sbp)), (kind, options)
            y.backward(_mine(g, layer.output_sbp))
            assert torch.equal(x.grad, _mine(x_ref.grad, layer.input_sbp)), (kind, options)
            _assert_grads(layer, ref, own(8) if kind is tpf.ColumnParallelLinear else (slice(None), own(6)))
            built.append(layer)
        assert repr(built[0]) == repr(built[1])
    torch.manual_seed(14)  # the same embedding and ids on every rank
    ref, ids = nn.Embedding(10, 4), torch.randint(0, 10, (2, 4))
    ref(ids).sum().backward()
    for sbp, flags in ((B, {"sequence_parallel": False}),
                       (tpf.sbp.split(1), {"sequence_parallel": True, "sequence_dim": 1})):
        outputs = []
        for options in ({"output_sbp": sbp}, flags):
            emb = VocabParallelEmbedding.from_embedding(ref, placement=P, **options)
            assert emb.output_sbp == sbp and emb.sequence_parallel == flags["sequence_parallel"]
            y = emb(ids)
            assert torch.equal(y, _mine(ref(ids), sbp))
            y.sum().backward()
            assert torch.equal(emb.weight.grad.full_tensor(), ref.weight.grad)
            outputs.append((y, emb.weight.grad.to_local()))
        assert all(torch.equal(a, b) for a, b in zip(*outputs))
    refusals = [  # an SBP a layer cannot take, and an SBP beside a flag that says otherwise: each names the fix
        (tpf.ColumnParallelLinear, {"input_sbp": tpf.sbp.split(-1)},
         r"ColumnParallelLinear takes input_sbp=sbp.broadcast \(the whole input\) or, for sequence parallelism"),
        (tpf.ColumnParallelLinear, {"output_sbp": tpf.sbp.partial_sum},
         r"takes output_sbp=sbp.split\(-1\) .*, got sbp.partial_sum"),
        (tpf.ColumnParallelLinear, {"output_sbp": tpf.sbp.split(1)}, r"takes output_sbp=.*, got sbp.split\(dim=1\)"),
        (tpf.ColumnParallelLinear, {"output_sbp": B, "gather_output": False},
         "output_sbp=sbp.broadcast says gather_output=True, but gather_output=False is given beside it: drop "
         "gather_output"),
        (tpf.ColumnParallelLinear, {"input_sbp": S0, "sequence_dim": 1},
         r"input_sbp=sbp.split\(dim=0\) says sequence_dim=0, but sequence_dim=1 is given"),
        (tpf.RowParallelLinear, {"input_sbp": S0}, r"RowParallelLinear takes input_sbp=sbp.split\(-1\)"),
        (tpf.RowParallelLinear, {"input_sbp": B, "output_sbp": S0},
         "sequence_parallel needs input_is_parallel=True: a sequence-parallel output .* takes input_sbp=sbp"),
        (tpf.RowParallelLinear, {"output_sbp": "split(0)"}, r"takes output_sbp=sbp.broadcast .*, got 'split\(0\)'"),
    ]
    for kind, options, message in refusals:
        with pytest.raises(ValueError, match=message):
            kind(6, 8, placement=P, **options)
        with pytest.raises(ValueError, match=message):
            kind.check_options(**options)
    with pytest.raises(ValueError, match=r"VocabParallelEmbedding takes output_sbp=sbp.broadcast .*, got sbp.split"):
        VocabParallelEmbedding(10, 4, placement=P, output_sbp=tpf.sbp.split(-1))


def test_layouts_said_in_sbp_or_by_their_flags_build_the_same_layer():
    harness.run(2, _sbp_spellings_rank)


# An MLP block through parallelize(): column -> relu -> row, plain and sequence-parallel.

@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("gelu", [False, True], ids=["relu", "gelu"])
def test_mlp_through_parallelize(world, sequence_parallel, gelu):
    text = harness.run(world, mlp_matches_one_device, sequence_parallel, 4 * world, 7, gelu)[0]
    assert "ColumnParallelLinear(in_features=5, out_features=7" in text and "W split(1)" in text
    assert "RowParallelLinear(in_features=7, out_features=5" in text and "W split(0)" in text


# Global tensor inputs in any layout; outputs are global with the layer's SBP.

def _global_rank():
    P = all_ranks()
    ref = MLP(6, 9, seed=3)
    col = tpf.ColumnParallelLinear.from_linear(ref.fc1, placement=P)
    row = tpf.RowParallelLinear.from_linear(ref.fc2, placement=P)
    col_sp = tpf.ColumnParallelLinear.from_linear(ref.fc1, placement=P, sequence_parallel=True)
    row_sp = tpf.RowParallelLinear.from_linear(ref.fc2, placement=P, sequence_parallel=True)
    col_ring, row_ring = (cls.from_linear(lin, placement=P, sequence_parallel=True, algo="ring")  # forced, not by size
                          for cls, lin in ((tpf.ColumnParallelLinear, ref.fc1), (tpf.RowParallelLinear, ref.fc2)))
    col_again = tpf.ColumnParallelLinear.from_linear(ref.fc1, placement=P, sequence_parallel=True, algo="ring",
                                                     keep_gathered=False)  # gathers its input again in backward
    x_ref = ints((5, 6), seed=11).requires_grad_()  # 5 rows: uneven over 2..4 ranks
    h_ref = ref.fc1(x_ref)
    y_ref = ref.fc2(torch.relu(h_ref))
    g = ints(y_ref.shape, seed=12)
    y_ref.backward(g)
    for sbp in (B, S0, tpf.sbp.split(1), tpf.sbp.partial_sum):
        for c, r, want in ((col, row, (B,)), (col_sp, row_sp, (S0,)), (col_ring, row_ring, (S0,)),
                           (col_again, row_ring, (S0,))):
            x = tpf.tensor(x_ref.detach(), placement=P, sbp=sbp).requires_grad_()
            h = c(x)
            assert tpf.get_sbp(h) == (tpf.sbp.split(1),) and torch.equal(logical(h), h_ref), f"{sbp}: column output"
            y = r(torch.relu(h))
            assert tpf.get_sbp(y) == want and torch.equal(logical(y), y_ref), f"{sbp}: row output"
            for p in (*c.parameters(), *r.parameters()):
                p.grad = None
            backward_logical(y, g)
            assert torch.equal(logical(x.grad), x_ref.grad), f"{sbp}: input gradient"
            for layer, lin in ((c, ref.fc1), (r, ref.fc2)):
                for p, p_ref in ((layer.weight, lin.weight), (layer.bias, lin.bias)):
                    assert torch.equal(p.grad.full_tensor(), p_ref.grad), f"{sbp}: {layer.label} parameter gradient"


def _one_dim_rank():
    """A 1-D global input (one token's features) through every kind of layer."""
    P, ref = all_ranks(), int_linear(5, 7, True, seed=2)
    x_ref = ints((5,), seed=3)
    for layer in (tpf.ColumnParallelLinear.from_linear(ref, placement=P, sequence_parallel=True),
                  tpf.RowParallelLinear.from_linear(ref, placement=P, input_is_parallel=False),
                  tpf.RowParallelLinear.from_linear(ref, placement=P, sequence_parallel=True)):
        y = layer(tpf.tensor(x_ref, placement=P, sbp=B))
        assert torch.equal(logical(y), ref(x_ref).detach()), layer.label


@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_dim_global_input(world):
    harness.run(world, _one_dim_rank)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_global_inputs(world):
    harness.run(world, _global_rank)


# Fresh layers, checkpoints and state.

def _init_rank():
    P = all_ranks()
    torch.manual_seed(3)
    ref = nn.Linear(7, 5)
    torch.manual_seed(3)
    col = tpf.ColumnParallelLinear(7, 5, placement=P)
    torch.manual_seed(3)
    row = tpf.RowParallelLinear(7, 5, placement=P)
    for layer in (col, row):
        assert torch.equal(layer.weight.full_tensor(), ref.weight) and torch.equal(layer.bias.full_tensor(), ref.bias)
    after = torch.rand(1)
    torch.manual_seed(3)
    nn.Linear(7, 5)
    assert torch.equal(after, torch.rand(1)), "a layer draws exactly what nn.Linear draws"
    before = torch.get_rng_state()
    tpf.RowParallelLinear.from_linear(ref, placement=P)
    assert torch.equal(before, torch.get_rng_state()), "from_linear draws nothing"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fresh_layers_initialise_as_nn_linear(world):
    harness.run(world, _init_rank)


def _state_rank():
    ref = Stack(6, 10, depth=1)
    model = tpf.parallelize(Stack(6, 10, depth=1), placement=all_ranks(), plan={"*.fc1": "column", "*.fc2": "row"})
    missing = model.load_state_dict(ref.state_dict())  # a single-device checkpoint loads as is
    assert not missing.missing_keys and not missing.unexpected_keys
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for key, value in ref.state_dict().items():
        assert torch.equal(full[key], value), f"{key} does not gather back bit for bit"
    with pytest.raises(RuntimeError, match=r"size mismatch for blocks.0.fc1.weight"):
        model.load_state_dict({**ref.state_dict(), "blocks.0.fc1.weight": torch.zeros(10, 5)})


@pytest.mark.parametrize("world", [1, 2, 4])
def test_single_device_state_round_trip(world):
    harness.run(world, _state_rank)


def _dcp_rank(path, save):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    model = tpf.parallelize(Stack(6, 10, depth=2), placement=all_ranks(), plan={"*.fc1": "column", "*.fc2": "row"})
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = ints((4, 6), seed=1)
    if save:
        model(x).square().sum().backward()
        opt.step()
        model_sd, opt_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=path)
    else:
        model_sd, opt_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": opt_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    state = [(p.detach().full_tensor(), opt.state[p]["exp_avg"].full_tensor(), opt.state[p]["exp_avg_sq"].full_tensor())
             for p in model.parameters()]
    return model(x).detach(), state


def test_checkpoint_reshards_across_world_sizes(tmp_path):
    """Saved with torch.distributed.checkpoint on 2 ranks, loaded on 1 and 4: the same parameters and Adam
    moments bit for bit, and the same outputs (up to the order of the row layer's sum over ranks)."""
    saved_y, saved = harness.run(2, _dcp_rank, str(tmp_path), True)[0]
    for world in (1, 4):
        for y, state in harness.run(world, _dcp_rank, str(tmp_path), False):
            for got, want in zip(state, saved):
                assert all(torch.equal(a, b) for a, b in zip(got, want)), f"W={world}: parameters or Adam moments"
            torch.testing.assert_close(y, saved_y, rtol=1e-5, atol=1e-3)


# Against PyTorch's own tensor parallelism, on the same weights.

def _torch_tp_rank():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    ref = Stack(6, 12, depth=1)  # 12 hidden features split evenly over 1-4 ranks: torch's layers need even shards
    theirs = parallelize_module(copy.deepcopy(ref), all_ranks().mesh,
                                {"blocks.0.fc1": ColwiseParallel(), "blocks.0.fc2": RowwiseParallel()})
    ours = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(), plan={"*.fc1": "column", "*.fc2": "row"})
    x = ints((3, 6), seed=2)
    y_ours, y_theirs, y_ref = ours(x), theirs(x), ref(x)
    assert torch.equal(y_ours, y_ref)
    torch.testing.assert_close(y_ours, y_theirs)  # not equal: torch splits the row layer's bias over the ranks
    g = ints(y_ref.shape, seed=3)
    for model in (ours, theirs, ref):
        model(x).backward(g)
    for (name, a), b, c in zip(ours.named_parameters(), theirs.parameters(), ref.parameters()):
        assert torch.equal(a.grad.full_tensor(), c.grad), f"gradient of {name}"
        assert torch.equal(b.grad.full_tensor(), c.grad), f"torch's gradient of {name}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_pytorch_tensor_parallel(world):
    harness.run(world, _torch_tp_rank)


def _compile_rank():
    """One graph for the whole block, collectives included, and no recompile on the next call (a byte counter
    traced into the graph once made every call recompile at W > 1, until dynamo gave up and ran eagerly)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    ref = Stack(6, 10, depth=1)
    eager = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(), plan={"*.fc1": "column", "*.fc2": "row"})
    graphs = CompileCounterWithBackend("inductor")
    compiled = torch.compile(copy.deepcopy(eager), backend=graphs)
    x = ints((3, 6), seed=2)
    y, y_c = eager(x), compiled(x)
    assert torch.equal(y, y_c)
    y.square().sum().backward()
    y_c.square().sum().backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), f"gradient of {name}"
    assert torch.equal(compiled(x), eager(x))
    assert graphs.frame_count == 1, f"{graphs.frame_count} graphs: a graph break or a recompile"


@pytest.mark.parametrize("world", [1, 2])
def test_torch_compile_matches_eager(world):
    harness.run(world, _compile_rank, timeout=600)


# Bad input: a clear error on every rank at once.

def _errors_rank():
    P = all_ranks()
    W = dist.get_world_size()
    col = tpf.ColumnParallelLinear(6, 8, placement=P)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear\(6, 8\): the input has 5 features .* expects 6"):
        col(torch.zeros(2, 5))
    model = tpf.parallelize(Stack(6, 8, depth=1), placement=P, plan={"*.fc1": "column", "*.fc2": "row"})
    local = model.blocks[0].fc2.weight.to_local().shape[1]
    with pytest.raises(ValueError, match=rf"RowParallelLinear 'blocks.0.fc2': the input has 9 features .* expects "
                                         rf"{local} \(this rank's block of the 8 input features\)"):
        model.blocks[0].fc2(torch.zeros(2, 9))
    with pytest.raises(ValueError, match="sequence_parallel needs input_is_parallel=True"):
        tpf.RowParallelLinear(6, 8, placement=P, input_is_parallel=False, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"algo must be one of \('auto', 'ring', 'naive'\)"):
        tpf.parallelize(Stack(6, 8, depth=1), placement=P, plan={"*.fc1": tpf.ColumnParallel(algo="fused")})
    with pytest.raises(ValueError, match="algo='ring' chooses how sequence parallelism's collectives run"):
        tpf.RowParallelLinear(6, 8, placement=P, algo="ring")
    with pytest.raises(ValueError, match="keep_gathered=False gathers a sequence-parallel input again"):
        tpf.parallelize(Stack(6, 8, depth=1), placement=P, plan={"*.fc1": tpf.ColumnParallel(keep_gathered=False)})
    if W > 1:
        row_sp = tpf.RowParallelLinear(6, 8, placement=P, sequence_parallel=True)
        with pytest.raises(ValueError, match=f"splits dim 0 of the input over {W} ranks, but it has {W + 1} rows"):
            row_sp(torch.zeros(W + 1, row_sp.weight.to_local().shape[1]))
    with pytest.raises(ValueError, match="plan pattern '\\*.fc3' matches no module of Stack; its nn.Linear modules"):
        tpf.parallelize(Stack(6, 8, depth=1), placement=P, plan={"*.fc3": "column"})
    with pytest.raises(ValueError, match="plan pattern 'blocks.0' matches 'blocks.0', a MLP, not an nn.Linear"):
        tpf.parallelize(Stack(6, 8, depth=1), placement=P, plan={"blocks.0": "column"})
    with pytest.raises(ValueError, match="matches both plan patterns"):
        tpf.parallelize(Stack(6, 8, depth=1), placement=P, plan={"*.fc1": "column", "blocks.*.fc*": "row"})
    with pytest.raises(ValueError, match="'colwize' is not a style tpflow knows: use one of 'column', 'row', "):
        tpf.parallelize(Stack(6, 8, depth=1), placement=P, plan={"*.fc1": "colwize"})
    with pytest.raises(ValueError, match="gives 'blocks.0', a MLP, a vocabulary entry, which takes an nn.Embedding"):
        tpf.parallelize(Stack(6, 8, depth=1), placement=P, plan={"blocks.0": "embedding_rowwise"})
    with pytest.raises(ValueError, match="sequence_dim=1 says which dim sequence parallelism splits"):
        tpf.ColumnParallelLinear(6, 8, placement=P, sequence_dim=1)
    with pytest.raises(ValueError, match="plan must be 'auto' or a dict"):
        tpf.parallelize(Stack(6, 8, depth=1), placement=P, plan="column")
    with pytest.raises(ValueError, match="Stack carries no tensor-parallel plan"):
        tpf.parallelize(Stack(6, 8, depth=1), placement=P, plan="auto")
    with pytest.raises(TypeError, match="placement must be a tpf.placement"):
        tpf.ColumnParallelLinear(6, 8, placement=[0, 1])
    with pytest.raises(ValueError, match="outside this world"):
        tpf.ColumnParallelLinear(6, 8, placement=tpf.placement("cpu", list(range(W + 1))))
    row5 = tpf.RowParallelLinear(5, 3, placement=P)  # 5 input features: uneven blocks over 2 and 3 ranks
    with pytest.raises(ValueError, match=r"the input has 4 features .* expects 5 \(the whole input features\)"):
        row5(tpf.tensor(torch.zeros(2, 4), placement=P, sbp=B))  # checked on the global shape: all ranks at once
    if W > 1:  # uneven rows into a sequence-parallel column layer: every rank is told, none hangs
        col_sp = tpf.ColumnParallelLinear(6, 8, placement=P, sequence_parallel=True)
        with pytest.raises(ValueError, match=r"the ranks hold \[3, 2.*\] rows"):
            col_sp(torch.zeros(3 if dist.get_rank() == 0 else 2, 6))
    if W > 1:  # a layer on rank 0 only: other ranks are told, not left hanging
        solo = tpf.ColumnParallelLinear(6, 8, placement=tpf.placement("cpu", [0]))
        if dist.get_rank() != 0:
            with pytest.raises(ValueError, match=r"is not in the layer's placement \[0\]"):
                solo(torch.zeros(2, 6))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bad_input_is_a_clear_error(world):
    harness.run(world, _errors_rank)


# A Llama-style decoder nobody wrote for tpflow (tests/models.py), through parallelize().

def _llama_rank(lm_head_parallel):

    torch.manual_seed(0)
    ref = TinyLlama().double()  # hidden 44: uneven over 3 and 4 ranks; 8 query and 4 key/value heads
    plan = {**LLAMA_PLAN, **({"lm_head": tpf.ColumnParallel(gather_output=True)} if lm_head_parallel else {})}
    model = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(), plan=plan)
    tokens = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    logits, logits_ref = model(tokens), ref(tokens)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-10, atol=1e-10)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss_ref = F.cross_entropy(logits_ref.flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    loss_ref.backward()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, torch.distributed.tensor.DTensor) else p.grad
        torch.testing.assert_close(grad, p_ref.grad, rtol=1e-10, atol=1e-12, msg=f"gradient of {name}")
    heads = model.layers[0].self_attn.q_proj.weight.to_local().shape[0] // model.layers[0].self_attn.head_dim
    return heads


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("lm_head_parallel", [False, True], ids=["", "parallel lm_head"])
def test_llama_decoder_through_parallelize(world, lm_head_parallel):
    assert harness.run(world, _llama_rank, lm_head_parallel) == [8 // world] * world  # whole heads per rank


# 2-D placements: data parallel over axis 0, tensor parallel over axis 1, one model, one-device gradients.

def _hybrid_rank(global_input, sequence_parallel):
    P2 = tpf.placement("cpu", [[0, 1], [2, 3]])
    ref = Stack(5, 7, depth=2)
    plan = {"*.fc1": tpf.ColumnParallel(sequence_parallel=sequence_parallel),
            "*.fc2": tpf.RowParallel(sequence_parallel=sequence_parallel)}
    model = tpf.parallelize(copy.deepcopy(ref), placement=P2, plan=plan)
    x_ref = ints((8, 3, 5), seed=4)
    y_ref = ref(x_ref)
    g = ints(y_ref.shape, seed=5)
    y_ref.backward(g)
    dp, tp = P2.coordinate()
    if global_input:
        x = tpf.tensor(x_ref, placement=P2, sbp=(S0, S0 if sequence_parallel else B))
        y = model(x)
        assert tpf.get_sbp(y) == tpf.get_sbp(x) and torch.equal(logical(y), y_ref.detach()), "output"
        backward_logical(y, g)
    else:  # each data-parallel group feeds its own rows (and, with sequence parallelism, each rank its chunk)
        rows = slice(*chunk_bounds(8, 2)[dp])
        x, want, grad = x_ref[rows], y_ref.detach()[rows], g[rows]
        if sequence_parallel:
            rows = slice(*chunk_bounds(4, 2)[tp])
            x, want, grad = x[rows], want[rows], grad[rows]
        y = model(x)
        assert torch.equal(y, want), "output"
        y.backward(grad)
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad.full_tensor(), p_ref.grad), f"gradient of {name}"
    whole = tpf.full_state_dict(model)  # over both axes: one device's state dict on rank 0, nothing elsewhere
    if dist.get_rank() == 0:
        assert whole.keys() == ref.state_dict().keys()
        assert all(torch.equal(whole[k], v) for k, v in ref.state_dict().items())
    else:
        assert whole == {}


@pytest.mark.parametrize("global_input", [False, True], ids=["plain", "global"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_data_x_tensor_parallel_on_2d_placement(global_input, sequence_parallel):
    harness.run(4, _hybrid_rank, global_input, sequence_parallel)


def _outside_rank():
    """A layer on rank 1 only, fed a global tensor from ranks [0, 1]: rank 0 holds an empty block and still
    takes part in the backward of the boxing, so nobody hangs and the gradients are right."""
    ref = int_linear(6, 4, True, seed=1)
    layer = tpf.ColumnParallelLinear.from_linear(ref, placement=tpf.placement("cpu", [1]))
    x_ref = ints((3, 6), seed=2).requires_grad_()
    x = tpf.tensor(x_ref.detach(), placement=all_ranks(), sbp=S0).requires_grad_()
    y = layer(x)
    y_ref = ref(x_ref)
    g = ints(y_ref.shape, seed=3)
    y_ref.backward(g)
    backward_logical(y, g)
    assert torch.equal(logical(x.grad), x_ref.grad)
    if dist.get_rank() == 1:
        assert torch.equal(layer.weight.grad.to_local(), ref.weight.grad)


def test_rank_outside_the_layer_placement():
    harness.run(2, _outside_rank)


def _plan_keeps_state_rank():
    P = all_ranks()

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(10, 6), nn.Linear(6, 10, bias=False)
            self.head.weight = self.embed.weight

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 4)
            self.b = self.a
            self.frozen = nn.Linear(4, 6)
            self.frozen.requires_grad_(False)

    with pytest.raises(ValueError, match=r"plan pattern 'head': the parameters of 'head' are shared with "
                                         r"\['embed.weight'\]"):
        tpf.parallelize(Tied(), placement=P, plan={"head": "column"})
    with pytest.raises(ValueError, match="'b' is the same module as one matched by 'a'"):
        tpf.parallelize(Shared(), placement=P, plan={"a": "column", "b": "row"})
    model = tpf.parallelize(Shared(), placement=P, plan={"a": "column", "frozen": "row"})
    assert model.a is model.b and isinstance(model.b, tpf.ColumnParallelLinear), "a shared module stays shared"
    assert not any(p.requires_grad for p in model.frozen.parameters()), "a frozen layer stays frozen"
    torch.manual_seed(dist.get_rank())  # each rank draws different values: replicas must still agree
    row = tpf.RowParallelLinear.from_linear(nn.Linear(4, 3), placement=P)
    biases = [None] * dist.get_world_size()
    dist.all_gather_object(biases, row.bias.to_local())
    assert all(torch.equal(b, biases[0]) for b in biases), "a broadcast parameter is the same on every rank"


@pytest.mark.parametrize("world", [1, 2])
def test_parallelize_keeps_ties_sharing_and_frozen_state(world):
    harness.run(world, _plan_keeps_state_rank)


def _bytes_rank():
    """Each rank holds 1/W of a layer's parameters (chunks by torch.chunk's rule)."""
    P, W, r = all_ranks(), dist.get_world_size(), dist.get_rank()
    col, row = tpf.ColumnParallelLinear(7, 10, placement=P), tpf.RowParallelLinear(10, 7, placement=P)
    chunk = chunk_bounds(10, W)[r][1] - chunk_bounds(10, W)[r][0]
    held = lambda layer: sum(p.to_local().numel() for p in layer.parameters())  # noqa: E731
    assert held(col) == chunk * 7 + chunk
    assert held(row) == 7 * chunk + 7  # the bias is whole on every rank
    totals = [None] * W
    dist.all_gather_object(totals, held(col))
    assert sum(totals) == 7 * 10 + 10


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parameter_bytes_per_rank(world):
    harness.run(world, _bytes_rank)


def _traffic_rank(kind):
    """Bytes each layer kind moves per step, counted by tpflow, against the minimum for its layout (fp32)."""
    from tpflow.comm import stats

    P, W = all_ranks(), dist.get_world_size()
    s, b, h, f = 4 * W, 3, 6, 8  # [S, B, H] input, hidden f; S splits evenly
    sp = kind.endswith("sp")
    layer = (tpf.ColumnParallelLinear(h, f, placement=P, sequence_parallel=sp) if kind.startswith("column")
             else tpf.RowParallelLinear(f, h, placement=P, sequence_parallel=sp))
    rows = s // W if sp and kind.startswith("column") else s
    x = torch.randn(rows, b, layer.weight.to_local().shape[1], requires_grad=True)
    stats.reset()
    y = layer(x)
    forward = stats.bytes_sent
    y.backward(torch.ones_like(y))
    return forward, stats.bytes_sent - forward, tuple(y.shape)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["column", "row", "column sp", "row sp"])
def test_communication_is_the_minimum(world, kind):
    """column: all-reduce of dx in backward; row: all-reduce of y in forward (a ring all-reduce moves
    2 (W-1)/W of the tensor); sequence parallel: (W-1)/W of the gathered or scattered tensor each way
    (plus, for a plain column input, the 8-byte row count each rank sends per peer)."""
    results = harness.run(world, _traffic_rank, kind)
    s, b, h, f = 4 * world, 3, 6, 8
    x_bytes, y_bytes = s * b * h * 4, s * b * (f if kind.startswith("column") else h) * 4
    share = (world - 1) / world
    want = {"column": (0, 2 * share * x_bytes), "row": (2 * share * y_bytes, 0),
            "column sp": (share * x_bytes + 8 * (world - 1), share * x_bytes),
            "row sp": (share * y_bytes, share * y_bytes)}[kind]
    for forward, backward, _ in results:
        assert (forward, backward) == want, f"{kind}: forward {forward}, backward {backward} bytes; minimum {want}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision(world, dtype):
    harness.run(world, half_precision_rounds_once, dtype)
