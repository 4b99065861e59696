"""Mamba-1 mixers split by channels (``tpflow.hf.selective_scan``), checked against one device on transformers' own
models (Mamba, Falcon-Mamba, Jamba; ``tests.mixer_checks``): logits, loss, every gradient, every parameter after AdamW
steps with clipping, ``generate``, the share of values a rank holds, the scan's channels on each rank (and the cache's
when decoding), the fused kernel not taken, ``save_pretrained`` read back on one device, a model built on the meta
device reading one device's checkpoint, sequence parallelism, and the refusals."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import sys
import tempfile

import pytest
import torch

from tests.harness import run
from tests.mixer_checks import Case, matches_one_device


def _model(kind: str, **config) -> torch.nn.Module:
    return Case(kind, config, "", 0, 0, 0).model()


def _mixers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from tpflow.hf.selective_scan import selective_scan_counts

    return {n: m for n, m in model.named_modules() if selective_scan_counts(m) is not None}


@contextlib.contextmanager
def _recorded(mixer: torch.nn.Module):
    """The channels each call of the mixers' scan (a sequence) and one-token update (decoding) runs on, and the
    calls of the fused kernel, recorded while the model code's module has them patched."""
    module = sys.modules[type(mixer).__module__]
    seen: dict[str, list] = {"scan": [], "update": [], "fused": []}
    originals = {n: getattr(module, n, None) for n in ("mamba_selective_scan", "mamba_selective_state_update",
                                                        "mamba_inner_fn")}

    def scan(hidden_states, *args, **kwargs):
        seen["scan"].append(hidden_states.shape[1])  # [batch, channels, tokens]
        return originals["mamba_selective_scan"](hidden_states, *args, **kwargs)

    def update(state, hidden_states, *args, **kwargs):
        seen["update"].append(hidden_states.shape[1])  # [batch, channels]
        return originals["mamba_selective_state_update"](state, hidden_states, *args, **kwargs)

    def fused(*args, **kwargs):  # mamba_ssm's kernel where present; the torch fallback returns None
        seen["fused"].append(True)
        return originals["mamba_inner_fn"](*args, **kwargs)

    patched = {"mamba_selective_scan": scan, "mamba_selective_state_update": update, "mamba_inner_fn": fused}
    try:
        for name, fn in patched.items():
            if originals[name] is not None:
                setattr(module, name, fn)
        yield seen
    finally:
        for name, fn in originals.items():
            if fn is not None:
                setattr(module, name, fn)


# each model's recurrence, the selective scan, reads its channels as dim 1 of its first argument: 96 on one device
CASES = [Case("mamba", {}, "mamba_selective_scan", 0, 1, 96),
         Case("mamba", {"use_bias": True}, "mamba_selective_scan", 0, 1, 96),  # in_proj's bias in segments, out_proj's
         Case("falcon_mamba", {}, "mamba_selective_scan", 0, 1, 96),  # its weightless norms of dt / B / C
         Case("jamba", {}, "mamba_selective_scan", 0, 1, 128)]  # its norms of dt / B / C, beside attention and MoE
# over 3 ranks: 96 channels (Jamba's: twice a 48-wide model, with 6 heads of which 3 key/value heads)
THREE = [CASES[0], CASES[2], Case("jamba", {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3},
                                  "mamba_selective_scan", 0, 1, 96)]


def _gradients_kernel_and_cache(cases: list[Case]) -> None:
    """Each case's every gradient against one device; its split mixers never taking the fused kernel (which would
    compute x_proj inside itself, unsummed); its cache's states, when decoding, this rank's channels."""
    import torch.distributed as dist

    import tpflow as tpf
    from tpflow.models.check import TOLERANCE

    world = dist.get_world_size()
    for case in cases:
        ref = case.model()
        ids = torch.randint(0, ref.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
        model = tpf.parallelize(copy.deepcopy(ref), placement=tpf.placement("cpu", ranks=list(range(world))),
                                plan="auto")
        with _recorded(next(iter(_mixers(ref).values()))) as seen:
            model(ids, labels=ids).loss.backward()
            assert not seen["fused"] or world == 1, case.kind
            ref(ids, labels=ids).loss.backward()
            assert seen["fused"] or case.kind == "jamba", case.kind  # (one device's takes it: the record sees it)
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
            if p_ref.grad is None:  # (an expert no token chose)
                assert p.grad is None, name
                continue
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            off = (grad - p_ref.grad).abs().max() / p_ref.grad.abs().max().clamp_min(1e-30)
            assert off < TOLERANCE, f"{case.kind}: {name}'s gradient {off:.1e} off (relative to its largest value)"
        model.eval()
        prompt = ids[:, :5]
        with _recorded(next(iter(_mixers(ref).values()))) as seen:
            model.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0,
                           attention_mask=torch.ones_like(prompt))
            assert set(seen["scan"]) == set(seen["update"]) == {case.heads // world}, (case.kind, seen)


def _split_matches_one_device(cases: list[Case], folder: str, sequence_parallel: bool = False) -> dict:
    shares = matches_one_device(cases, folder, sequence_parallel)
    if not sequence_parallel:
        _gradients_kernel_and_cache(cases)
    return shares


@pytest.mark.parametrize("world", [1, 2, 4])
def test_mamba1_mixers_split_by_channels_match_one_device(world):
    folder = tempfile.mkdtemp()
    try:
        shares = run(world, _split_matches_one_device, CASES if world > 1 else CASES[:1], folder,  # (one rank:
                     timeout=600)[0]  # the split's bookkeeping, nothing split)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if world == 2:
        for case, share in shares.items():
            assert share <= 1 / world + 0.06, f"{case} holds {share:.3f} of its values a rank"


def test_mamba1_mixers_split_over_three_ranks():
    folder = tempfile.mkdtemp()
    try:
        run(3, _split_matches_one_device, THREE, folder, timeout=600)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_mamba1_mixers_under_sequence_parallelism_match_one_device():
    folder = tempfile.mkdtemp()
    try:  # each rank's tokens gathered into the mixer, its output reduce-scattered back to them
        run(2, _split_matches_one_device, CASES, folder, True, timeout=600)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _refusals() -> None:
    import tpflow as tpf
    from tpflow.hf.selective_scan import ScanChannels

    P = tpf.placement("cpu", ranks=[0, 1, 2, 3])
    model = _model("mamba", intermediate_size=90)
    with pytest.raises(ValueError, match=r"'backbone.layers.0.mixer' has 90 inner channels \(d_inner\), which do "
                                         r"not split over 4 tensor-parallel ranks: use a degree among \[1, 2, 3, 5, "):
        tpf.parallelize(model, placement=P, plan="auto")
    assert not any(hasattr(p, "placements") for p in model.parameters())  # refused before anything changed
    with pytest.raises(ValueError, match=r"'backbone.layers.0.norm' is a MambaRMSNorm; ScanChannels takes a Mamba-1 "
                                         r"mixer"):
        tpf.parallelize(model, placement=P, plan={"backbone.layers.*.norm": ScanChannels()})


def test_mamba1_mixers_that_do_not_split_are_refused_by_name():
    run(4, _refusals)


def _from_one_device_file(folder: str) -> None:
    """A model built on the meta device, parallelized, reads one device's checkpoint (``save_pretrained``), each rank
    its rows of each segment and the whole parameters (out_proj's bias, Jamba's norms): bitwise."""
    import torch.distributed as dist
    import transformers

    import tpflow as tpf

    P = tpf.placement("cpu", ranks=list(range(dist.get_world_size())))
    for kind, config in [("mamba", {"use_bias": True}), ("jamba", {})]:
        ref = _model(kind, **config)
        where = os.path.join(folder, kind)
        if dist.get_rank() == 0:
            ref.save_pretrained(where)
        dist.barrier()
        with tpf.meta_parameters():
            model = transformers.AutoModelForCausalLM.from_config(ref.config, experts_implementation="eager").double()
        model = tpf.parallelize(model, placement=P, plan="auto")
        tpf.load_safetensors(model, where)
        whole = tpf.full_state_dict(model)
        if dist.get_rank() == 0:
            assert all(torch.equal(whole[k], v) for k, v in ref.state_dict().items()), kind


def test_mamba1_mixers_built_on_meta_read_one_device_checkpoint():
    folder = tempfile.mkdtemp()
    try:
        run(2, _from_one_device_file, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
