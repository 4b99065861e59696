"""parallelize's fuse=True: sibling column layers that read one input run as one product. Against one
device (exact, small integers), and against one column layer's communication: the group's input crosses
the ranks once, whatever the number of members. W = 1..4, uneven widths (a rank may hold none of a member)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpflow as tpf
from tests import harness
from tests.checks import all_ranks, fused_columns_match_one_device, ints, own, sent_bytes
from tests.models import LLAMA_PLAN, WIDTHS, TinyLlama, Trio
from tpflow.comm import ring_bytes


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
def test_fused_columns_match_one_device_and_communicate_as_one_layer(world, bias):
    for fused, one in harness.run(world, fused_columns_match_one_device, False, True, bias):
        assert fused == one, f"fused q/k/v-like layers sent {fused} bytes (forward, backward), one layer {one}"


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("keep_gathered", [True, False], ids=["keep", "regather"])
def test_fused_sequence_parallel_columns(world, keep_gathered):
    for fused, one in harness.run(world, fused_columns_match_one_device, True, keep_gathered, True):
        assert fused == one, f"fused sequence-parallel layers sent {fused} bytes, one layer {one}"


def _patterns_rank():
    """Every calling pattern gives one device's values and gradients; pending outputs never outlive a forward."""
    ref = Trio()
    model = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(), plan={"[abc]": tpf.ColumnParallel(fuse=True)})
    x, z = ints((4, 6), seed=1), ints((4, 6), seed=2)
    cols = [own(w) for w in WIDTHS]

    def check(calls, label):
        """calls: (member, input) in order; the sum of every output against one device's, and the gradients."""
        for m in (model, ref):
            m.zero_grad()
        got = [getattr(model, name)(t) for name, t in calls]
        want = [getattr(ref, name)(t) for name, t in calls]
        for (name, _), y, y_ref in zip(calls, got, want):
            assert torch.equal(y, y_ref[..., cols["abc".index(name)]]), f"{label}: output of {name}"
        sum(y.sum() for y in got).backward()
        sum(y_ref[..., cols["abc".index(name)]].sum() for (name, _), y_ref in zip(calls, want)).backward()
        for name in "abc":
            layer, layer_ref = getattr(model, name), getattr(ref, name)
            want_grad = layer_ref.weight.grad
            if want_grad is None:
                assert layer.weight.grad is None or not layer.weight.grad.to_local().any(), f"{label}: {name}"
            else:
                c = cols["abc".index(name)]
                assert torch.equal(layer.weight.grad.to_local(), want_grad[c]), f"{label}: gradient of {name}"

    check([("a", x), ("b", z), ("c", z)], "cross-attention: a reads another input")
    check([("a", x), ("a", x), ("b", x), ("c", x)], "a member called twice")
    check([("a", x), ("b", x)], "c left out")
    check([("c", x), ("a", x), ("b", x)], "c first, after a forward that left it pending")
    with torch.no_grad():  # c left pending, then every weight updated in place (an optimizer step): not stale
        model.a(x), model.b(x)
        for layer in (model, ref):
            for p in layer.parameters():
                p.add_(1)
        assert torch.equal(model.c(x), ref.c(x)[..., cols[2]]), "a pending output after a weight update"
    xg = x.clone().requires_grad_()
    for _ in range(2):  # the same input object twice through the parent: one product, one all-reduce, each time
        sent = sent_bytes(lambda: (sum(y.sum() for y in model(xg)), torch.ones(())))
        assert sent == (0, ring_bytes(xg.numel() * 4, dist.get_world_size(), 2)), sent
    temporary = tpf.parallelize(Trio(), placement=all_ranks(), plan={"[abc]": tpf.ColumnParallel(fuse=True)})
    loss = sum(y.sum() for y in temporary(xg))
    del temporary
    gc.collect()
    loss.backward()  # the graph does not keep the group alive, and runs without it
    glob = tpf.tensor(x, placement=all_ranks(), sbp=tpf.sbp.broadcast)  # a global input: each layer alone
    for y, y_ref in zip(model(glob), ref(x)):
        assert torch.equal(y.full_tensor(), y_ref), "a global input"
    assert not model.a.fused_group._pending
    copied = copy.deepcopy(model)
    assert copied.a.fused_group is not model.a.fused_group
    assert copied.a.fused_group.layers == (copied.a, copied.b, copied.c)
    with torch.no_grad():
        assert all(torch.equal(p, q) for p, q in zip(copied(x), model(x)))


@pytest.mark.parametrize("world", [1, 2])
def test_fused_columns_in_every_calling_pattern(world):
    harness.run(world, _patterns_rank)


def _storage_rank():
    """The members' weight blocks share one storage, back to back, which the product reads without a copy;
    loading a checkpoint keeps it, and a conversion that gives the blocks storages of their own is undone."""
    ref = Trio()
    model = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(), plan={"[abc]": tpf.ColumnParallel(fuse=True)})

    def blocks():
        return [getattr(model, name).weight._local_tensor for name in "abc"]

    def joined():
        first = blocks()[0]
        offsets = [b.storage_offset() - first.storage_offset() for b in blocks()]
        return all(b.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for b in blocks()) and \
            offsets == [0, blocks()[0].numel(), blocks()[0].numel() + blocks()[1].numel()]

    assert joined()
    saved = []
    x = ints((4, 6), seed=1).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        outs = model(x)
    rows = sum(b.shape[0] for b in blocks())
    weights = [t for t in saved if sorted(t.shape) == sorted((rows, 6))]  # W, or W^T as F.linear saves it
    assert weights and all(t.untyped_storage().data_ptr() == blocks()[0].untyped_storage().data_ptr()
                           for t in weights), "the product saved a copy of the weights"
    sum(y.sum() for y in outs).backward()
    model.load_state_dict(Trio(bias=True).state_dict())  # a single-device checkpoint: copied in place
    assert joined() and sorted(model.state_dict()) == sorted(ref.state_dict())
    model.double()
    assert not joined()
    for y, y_ref, w in zip(model(x.double()), ref.double()(x.double()), WIDTHS):
        assert torch.equal(y, y_ref[..., own(w)])
    assert joined(), "joined again by the first product after the conversion"


@pytest.mark.parametrize("world", [1, 3])
def test_fused_weights_share_one_storage(world):
    harness.run(world, _storage_rank)


def _dcp_rank(path, save):
    """torch.distributed.checkpoint through a fused group: the parameters and Adam moments, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = tpf.parallelize(Trio(), placement=all_ranks(), plan={"[abc]": tpf.ColumnParallel(fuse=True)})
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model_sd, opt_sd = get_state_dict(model, opt)
    if save:
        sum(y.square().sum() for y in model(ints((4, 6), seed=1))).backward()
        opt.step()
        dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=path)
    else:
        state = {"model": model_sd, "optim": opt_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    blocks = [getattr(model, name).weight._local_tensor.untyped_storage().data_ptr() for name in "abc"]
    assert len(set(blocks)) == 1, "loading keeps the joined storage"
    return [(p.detach().full_tensor(), opt.state[p]["exp_avg"].full_tensor()) for p in model.parameters()]


def test_fused_checkpoint_reshards(tmp_path):
    saved = harness.run(2, _dcp_rank, str(tmp_path), True)[0]
    for state in harness.run(3, _dcp_rank, str(tmp_path), False):
        assert all(torch.equal(a, b) for got, want in zip(state, saved) for a, b in zip(got, want))


class _Around(nn.Module):
    """Work before and after a fused group, as a model has: what torch.compile puts in graphs."""

    def __init__(self, trio: nn.Module) -> None:
        super().__init__()
        self.trio = trio

    def forward(self, x):
        a, b, c = self.trio(x * 2)
        return a.sum() + b.square().sum() + c.relu().sum()


def _compile_rank():
    """Under torch.compile the group runs eagerly between graphs (its blocks share a storage, which dynamo
    cannot trace): the same values and gradients as eager, in two graphs (before and after the group's
    product), and no recompile on the next call."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    eager = _Around(tpf.parallelize(Trio(), placement=all_ranks(), plan={"[abc]": tpf.ColumnParallel(fuse=True)}))
    graphs = CompileCounterWithBackend("inductor")
    compiled = torch.compile(copy.deepcopy(eager), backend=graphs)
    x = ints((3, 6), seed=2)
    y, y_c = eager(x), compiled(x)
    assert torch.equal(y, y_c)
    y.backward()
    y_c.backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), f"gradient of {name}"
    assert torch.equal(compiled(x), eager(x))
    assert graphs.frame_count == 2, f"{graphs.frame_count} graphs: one break, at the group's product, was expected"


@pytest.mark.parametrize("world", [1, 2])
def test_torch_compile_of_a_fused_model(world):
    harness.run(world, _compile_rank, timeout=600)


def _llama_rank(sequence_parallel):

    torch.manual_seed(0)
    ref = TinyLlama().double()
    styles = {"column": tpf.ColumnParallel(fuse=True, sequence_parallel=sequence_parallel),
              "row": tpf.RowParallel(sequence_parallel=sequence_parallel)}
    plan = {k: styles[v] for k, v in LLAMA_PLAN.items()}
    model = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(), plan=plan)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.q_proj.fused_group.layers == (attn.q_proj, attn.k_proj, attn.v_proj)
    assert mlp.gate_proj.fused_group.layers == (mlp.gate_proj, mlp.up_proj)
    W, r = dist.get_world_size(), dist.get_rank()
    tokens = torch.randint(0, 50, (2, 4 * W), generator=torch.Generator().manual_seed(1))
    targets = tokens.roll(-1, 1)
    h, h_ref = model.embed_tokens(tokens), ref.embed_tokens(tokens)
    if sequence_parallel:  # positions first, this rank's chunk of them (both models read dim 0 as the batch)
        h = h.transpose(0, 1)[4 * r:4 * r + 4]
        h_ref = h_ref.transpose(0, 1)
    for layer, layer_ref in zip(model.layers, ref.layers):
        h, h_ref = layer(h), layer_ref(h_ref)
    rows = slice(4 * r, 4 * r + 4) if sequence_parallel else slice(None)
    torch.testing.assert_close(h, h_ref[rows], rtol=1e-10, atol=1e-10)
    mine = targets.T[rows] if sequence_parallel else targets
    loss = F.cross_entropy(model.lm_head(model.norm(h)).flatten(0, 1), mine.flatten(), reduction="sum")
    loss_ref = F.cross_entropy(ref.lm_head(ref.norm(h_ref)).flatten(0, 1),
                               (targets.T if sequence_parallel else targets).flatten(), reduction="sum")
    loss.backward()
    loss_ref.backward()
    for (name, p), p_ref in zip(model.layers.named_parameters(), ref.layers.parameters()):
        grad = p.grad.to_local()
        if p.placements[-1].is_replicate():  # norms: with sequence parallelism, summed over the ranks' rows
            torch.testing.assert_close(grad, p_ref.grad, rtol=1e-10, atol=1e-10, msg=f"gradient of {name}")
            continue
        split = p.placements[-1].dim
        mine = own(p_ref.shape[split])
        want = p_ref.grad.narrow(split, mine.start, mine.stop - mine.start)
        torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-10, msg=f"gradient of {name}")


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_llama_decoder_with_fused_projections(world, sequence_parallel):
    harness.run(world, _llama_rank, sequence_parallel)


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 4), nn.Linear(5, 4)
        self.c, self.d = nn.Linear(6, 4, bias=False), nn.Linear(6, 3)
        self.inner = nn.Sequential(nn.Linear(6, 2))


def _errors_rank():
    P = all_ranks()
    for plan, message in [
        ({"[ab]": tpf.ColumnParallel(fuse=True)}, r"'b' differs from 'a'"),  # in_features
        ({"[ac]": tpf.ColumnParallel(fuse=True)}, r"'c' differs from 'a'"),  # bias and no bias
        ({"a": tpf.ColumnParallel(fuse=True), "d": tpf.ColumnParallel(fuse=True, sequence_parallel=True)},
         r"'d' differs from 'a'"),
        ({"[ad]": tpf.ColumnParallel(fuse=True, gather_output=True)}, r"no gather_output"),
    ]:
        model = Mixed()
        with pytest.raises(ValueError, match=message):
            tpf.parallelize(model, placement=P, plan=plan)
        assert all(type(m) is nn.Linear for m in (model.a, model.b, model.c, model.d)), "the model is unchanged"
    lone = tpf.parallelize(Mixed(), placement=P, plan={"a": tpf.ColumnParallel(fuse=True),
                                                       "inner.0": tpf.ColumnParallel(fuse=True)})
    assert lone.a.fused_group is None and lone.inner[0].fused_group is None, "a lone layer under its parent stays alone"


def test_fuse_errors_name_the_layers_before_the_model_changes():
    harness.run(1, _errors_rank)
