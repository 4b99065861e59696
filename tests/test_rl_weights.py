"""``tpf.rl.weights``: a parallelized model's weights streamed as an inference engine loads them. Against one device's
``save_pretrained`` (the files' tensors, loaded back): the same names, dtypes and values, bitwise, for Llama, Qwen3,
Qwen3-MoE (experts split, and shared out), gpt-oss and a DeepSeek-V3-shaped model at 1, 2 and 4 ranks, receiving
on every rank or on one, in buckets no larger than asked (or a parameter alone, said); the engines' adapters
(vLLM's ``load_weights``, TRL's ``update_named_params``, SGLang's ``update_weights_from_tensor``) duck-typed, a
one-device model loading what vLLM's received; 100 syncs at 4 ranks with random per-rank delays; a rank missing a
sync or a receiver failing refused on every rank, by name, within seconds."""

from __future__ import annotations

import copy
import glob
import math
import os
import random
import tempfile
import time
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness

pytest.importorskip("transformers")

FAMILIES = ("llama", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3")
BUCKET = 1 << 14  # 16 KiB: several buckets, and experts larger than one


def _model(kind: str) -> torch.nn.Module:
    from tests.models import tiny_lm, tiny_moe

    return tiny_lm(kind) if kind in ("llama", "qwen3") else tiny_moe(kind)


def _saved(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What one device's ``save_pretrained`` writes, read back (each rank writes its own: transformers writes on rank
    0 of a world only)."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as folder, mock.patch.object(model, "should_save_on_this_rank",
                                                                     lambda is_main_process: True, create=True):
        model.save_pretrained(folder)
        return {k: v for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))) for k, v in load_file(f).items()}


def _streams_as_saved(kinds: tuple[str, ...]) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    placement = tpf.placement("cpu", list(range(world)))
    for kind in kinds:
        ref = _model(kind)
        want = _saved(ref)
        plans = {"experts split": tpf.hf_plan(ref)}
        if kind not in ("llama", "qwen3") and world > 1:
            plans["experts shared out"] = tpf.hf_plan(ref, expert_parallel=True)
        for layout, plan in plans.items():
            model = tpf.parallelize(copy.deepcopy(ref), placement=placement, plan=plan)
            what = f"{kind}, {world} ranks, {layout}"
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                stream = tpf.rl.weights(model, bucket_bytes=BUCKET, receiver=None)
            meta = stream.metadata()
            got = list(stream)
            assert [n for n, _ in got] == [m.name for m in meta], what
            assert sorted(n for n, _ in got) == sorted(want), (what, set(want) ^ {n for n, _ in got})
            for (name, t), m in zip(got, meta):
                assert (t.dtype, tuple(t.shape)) == (m.dtype, m.shape) == (want[name].dtype, tuple(want[name].shape))
                assert torch.equal(t, want[name]), f"{what}: {name}"
            largest = max(math.prod(m.shape) * m.dtype.itemsize for m in meta)
            assert (largest > BUCKET) == any("bucket of its own" in str(w.message) for w in said), what
            # one receiver: the whole tensors on rank 0 alone, a bucket (or one parameter) at a time
            held = []
            one = tpf.rl.weights(model, bucket_bytes=BUCKET, dtype=torch.bfloat16)
            one.sync(lambda items, last, held=held: held.append(list(items)))
            items = [item for bucket in held for item in bucket]
            assert [n for n, _ in items] == [m.name for m in meta], what
            if rank == 0:
                assert all(torch.equal(t, want[n].to(torch.bfloat16)) for n, t in items), what
                sizes = [sum(t.numel() * t.element_size() for _, t in bucket) for bucket in held]
                assert all(s <= BUCKET or len(b) == 1 or _one_source(b) for s, b in zip(sizes, held)), (what, sizes)
            else:
                assert all(t is None for _, t in items), what


def _one_source(bucket: list) -> bool:
    """A bucket over ``BUCKET`` holds one parameter's checkpoint tensors (an experts' tensor: one per expert)."""
    return len({n.rsplit(".experts.", 1)[0] + (".experts" if ".experts." in n else n) for n, _ in bucket}) == 1


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_stream_is_what_save_pretrained_writes(world):
    harness.run(world, _streams_as_saved, FAMILIES, timeout=600)


class _VLLMModel:
    """vLLM's model as its worker reaches it: ``load_weights(iterable of (name, tensor))``."""

    def load_weights(self, weights):
        self.got = dict(weights)
        return set(self.got)


class _TRLClient:
    """TRL's ``VLLMClient``: the metadata first, then the pairs in its order."""

    def update_named_params(self, metadata, named_params):
        self.metadata, self.got = metadata, list(named_params)


class _SGLang:
    """SGLang's ``Engine.update_weights_from_tensor``, a bucket per call."""

    def __init__(self):
        self.calls = []

    def update_weights_from_tensor(self, named_tensors, flush_cache=True):
        self.calls.append(([n for n, _ in named_tensors], flush_cache))


def _engines() -> None:
    """Each adapter on a trained-looking Llama at 2 ranks; a one-device model loads vLLM's received weights with
    ``load_state_dict`` and computes the parallelized model's logits."""
    ref = _model("llama")
    model = tpf.parallelize(copy.deepcopy(ref), placement=tpf.placement("cpu", [0, 1]), plan="auto")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    stream = tpf.rl.weights(model, bucket_bytes=BUCKET)
    engine, client, sglang = _VLLMModel(), _TRLClient(), _SGLang()
    stream.load_into(engine)
    stream.update_named_params(client)
    stream.update_weights_from_tensor(sglang)
    names = [m.name for m in stream.metadata()]
    ids = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(0))
    logits = model(ids).logits.full_tensor()  # (every rank)
    if dist.get_rank() != 0:
        assert not hasattr(engine, "got") and not hasattr(client, "got") and not sglang.calls
        return
    ref.load_state_dict(engine.got)
    torch.testing.assert_close(ref(ids).logits, logits, rtol=1e-12, atol=1e-12)
    assert [tuple(m) for m in client.metadata] == [(m.name, "float64", list(m.shape)) for m in stream.metadata()]
    assert [n for n, _ in client.got] == names
    assert all(torch.equal(t, engine.got[n]) for n, t in client.got)
    assert [n for call, _ in sglang.calls for n in call] == names and len(sglang.calls) == len(stream.buckets)
    assert [flush for _, flush in sglang.calls] == [False] * (len(sglang.calls) - 1) + [True]


def _hundred_syncs() -> None:
    """100 syncs, every rank sleeping a random while before each and between items: the same tensors each time."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 30), torch.nn.ReLU(), torch.nn.Linear(30, 16))
    model = tpf.parallelize(model, placement=tpf.placement("cpu", [0, 1, 2, 3]), plan={"0": "column", "2": "row"})
    stream = tpf.rl.weights(model, bucket_bytes=2100)  # 2 buckets
    rng = random.Random(dist.get_rank())
    first = None
    for _ in range(100):
        time.sleep(rng.random() * 0.01)
        got = []
        for name, t in stream:
            if rng.random() < 0.1:
                time.sleep(rng.random() * 0.005)
            got.append((name, t))
        first = first or got
        assert [n for n, _ in got] == [n for n, _ in first]
        assert all((t is None and s is None) or torch.equal(t, s) for (_, t), (_, s) in zip(got, first))


def test_engine_adapters_and_a_hundred_syncs_with_random_delays():
    harness.run(2, _engines)
    harness.run(4, _hundred_syncs, timeout=300)


def _refused() -> None:
    """A rank late to a sync by more than the roll call waits, and a receiver that fails in a bucket: every rank
    raises, naming the rank."""
    from tests.models import tiny_lm

    model = tpf.parallelize(tiny_lm("llama", layers=1), placement=tpf.placement("cpu", [0, 1]), plan="auto")
    stream = tpf.rl.weights(model, bucket_bytes=BUCKET)
    with mock.patch("tpflow.checkpoint.together.ARRIVAL_S", 0.5):
        if dist.get_rank() == 1:
            time.sleep(2.0)  # elsewhere, then comes to the sync the others gave up on
        with pytest.raises(RuntimeError, match="rank 1 did not call it within 0.5 s of rank 0: make every sync"):
            list(stream)

    def receive(items, last):
        if dist.get_rank() == 0 and items[0][0].startswith("model.layers.0"):
            raise ConnectionError("the engine went away")

    with pytest.raises((RuntimeError, ConnectionError), match="the engine went away"):
        stream.sync(receive)
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        tpf.rl.weights(model, bucket_bytes=0)
    with pytest.raises(ValueError, match="receiver must be a rank of this world of 2"):
        tpf.rl.weights(model, receiver=2)


def test_a_missed_sync_and_a_failed_receiver_are_refused_on_every_rank():
    harness.run(2, _refused, timeout=120)


def _offloaded() -> None:
    """A Llama at 2 ranks (its q / k / v and gate / up in fused storages) after an AdamW step: offloaded (every
    parameter's, gradient's and optimizer state's storage emptied) and reloaded, then stepped again, bit for bit as
    a twin never offloaded."""
    from tests.models import tiny_lm

    ref = tiny_lm("llama")
    ids = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(0))
    twins = []
    for _ in range(2):
        model = tpf.parallelize(copy.deepcopy(ref), placement=tpf.placement("cpu", [0, 1]), plan="auto")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(ids, labels=ids).loss.backward()
        opt.step()
        model(ids, labels=ids).loss.backward()  # gradients held too
        twins.append((model, opt))
    (model, opt), (twin, twin_opt) = twins
    assert any(p.to_local().untyped_storage().nbytes() > p.to_local().nbytes for p in model.parameters())  # fused
    tpf.offload(model, opt)
    locals_ = [t.to_local() if hasattr(t, "to_local") else t for p in model.parameters() for t in (p, p.grad)] + [
        v.to_local() if hasattr(v, "to_local") else v for s in opt.state.values() for v in s.values()]
    assert all(t.untyped_storage().size() == 0 for t in locals_)
    with pytest.raises(RuntimeError, match="offloaded already"):
        tpf.offload(model, opt)
    with pytest.raises(ValueError, match="not the one offloaded"):
        tpf.reload(model, twin_opt)
    tpf.reload(model, opt)
    with pytest.raises(RuntimeError, match="not offloaded"):
        tpf.reload(model, opt)
    for m, o in ((model, opt), (twin, twin_opt)):
        o.step()
        o.zero_grad()
        m(ids, labels=ids).loss.backward()
        o.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local()), name
    for s, t in zip(opt.state.values(), twin_opt.state.values(), strict=True):
        assert all(torch.equal(tpf.to_local(s[k]) if hasattr(s[k], "to_local") else s[k],
                               tpf.to_local(t[k]) if hasattr(t[k], "to_local") else t[k]) for k in s)


def test_offload_and_reload_are_exact():
    harness.run(2, _offloaded)


def _resharded() -> None:
    """Plans made from a Llama (2 key/value heads) and a Qwen3-MoE split over 2 of 4 ranks, for an engine of 1, 2
    and 4 ranks: each rank's part as the same model split over that many ranks holds it (its local blocks; a
    key/value head kept whole by all 4 ranks: the columns of the rank's head, which it computes), the experts one
    tensor each in the checkpoint; a degree the heads do not split over refused."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for kind in ("llama", "qwen3_moe"):
        ref = _model(kind)
        saved = _saved(ref)
        half = tpf.parallelize(copy.deepcopy(ref), placement=tpf.placement("cpu", [0, 1]), plan="auto")
        for degree in (1, 2, 4):
            plan = tpf.rl.reshard_plan(half, degree)
            assert list(plan.parts) == [m.name for m in tpf.rl.weights(half).metadata()]
            model = tpf.parallelize(copy.deepcopy(ref), placement=tpf.placement("cpu", list(range(degree))),
                                    plan="auto")
            if rank >= degree:
                continue
            held = {n: p.to_local() if hasattr(p, "to_local") else p for n, p in model.state_dict().items()}
            for name, whole in saved.items():
                got = plan.part(name, whole, rank)
                if name in held:
                    want = held[name]
                    if want.shape != got.shape and ("k_proj" in name or "v_proj" in name):  # kept whole: its head
                        head = rank // (degree // 2)
                        want = want[head * 16:(head + 1) * 16]
                else:  # one expert's tensor: its part of the experts' tensor this rank holds
                    layer, expert, proj = name.split(".mlp.experts.")[0], *name.split(".experts.")[1].split(".")[:2]
                    fused = held[f"{layer}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"]
                    half_rows = fused.shape[1] // 2
                    want = {"gate_proj": fused[int(expert), :half_rows], "up_proj": fused[int(expert), half_rows:],
                            "down_proj": fused[int(expert)]}[proj]
                assert torch.equal(got, want), (kind, degree, rank, name, got.shape, want.shape)
    with pytest.raises(ValueError, match="4 heads do not split over 3 ranks"):
        tpf.rl.reshard_plan(half, 3)
    assert world == 4


def test_a_reshard_plan_gives_each_engine_rank_its_part():
    harness.run(4, _resharded, timeout=300)
