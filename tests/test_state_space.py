"""Mamba-2 mixers split by heads (``tpflow.hf.state_space``), checked against one device on transformers' own models:
logits, loss, every gradient, every parameter after AdamW steps with clipping, ``generate``, the share of values a
rank holds, the recurrence's heads on each rank, ``save_pretrained`` and torch's distributed checkpoint across
degrees, and the refusals."""

from __future__ import annotations

import copy
import fnmatch
import os
import shutil
import sys
import tempfile

import pytest
import torch

from tests.harness import run

# each family's config keys: its mixers' heads, head width and groups
FAMILIES = {
    "mamba2": ("num_heads", "head_dim", "n_groups"),
    "nemotron_h": ("mamba_num_heads", "mamba_head_dim", "n_groups"),
    "falcon_h1": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups"),
    "bamba": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups"),
    "granitemoehybrid": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups"),
    "zamba2": ("n_mamba_heads", "mamba_headdim", "mamba_ngroups"),
}


def _model(kind: str, heads: int = 8, groups: int = 1, hidden: int = 64, **extra) -> torch.nn.Module:
    """The zoo's tiny ``kind`` (fp64) with ``heads`` mixer heads of ``2 * hidden / heads`` features in ``groups``,
    and ``extra`` config."""
    import transformers

    from tpflow.models.zoo import tiny_config

    config = tiny_config(kind)
    names = FAMILIES[kind]
    config.hidden_size = hidden
    for name, value in zip(names, (heads, 2 * hidden // heads, groups)):
        setattr(config, name, value)
    if kind == "falcon_h1":
        config.mamba_d_ssm = 2 * hidden
    for name, value in extra.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    kwargs = {"experts_implementation": "eager"} if kind in ("nemotron_h", "granitemoehybrid") else {}  # fp64 loops
    return transformers.AutoModelForCausalLM.from_config(config, **kwargs).double().train()


def _mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from tpflow.hf.state_space import state_space_counts

    return [m for m in model.modules() if state_space_counts(m) is not None]


def _share(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    from torch.distributed.tensor import DTensor

    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    return held / sum(p.numel() for p in ref.parameters())


def _heads_seen(model: torch.nn.Module) -> list[int]:
    """Patch the chunked scan of ``model``'s mixers to record how many heads each call runs; the record."""
    seen: list[int] = []
    module = sys.modules[type(_mixers(model)[0]).__module__]
    if not hasattr(module.mamba2_chunk_scan, "seen"):
        original = module.mamba2_chunk_scan

        def recorded(hidden_states, *args, **kwargs):
            recorded.seen.append(hidden_states.shape[2])
            return original(hidden_states, *args, **kwargs)
        module.mamba2_chunk_scan = recorded
    module.mamba2_chunk_scan.seen = seen
    return seen


def _train(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list, list]:
    from tests.models import train_lm

    return train_lm(model, ids, steps=2)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _matches_one_device(cases: list[tuple], folder: str) -> dict:
    """Each ``(kind, heads, groups)`` parallelized by ``plan="auto"`` against one device; the shares held."""
    import torch.distributed as dist
    import transformers

    import tpflow as tpf
    from tpflow.hf.state_space import StateSpaceHeads
    from tpflow.models.check import LOGITS_TOLERANCE, STEP_TOLERANCE  # (its gated norms compute in fp32)

    world = dist.get_world_size()
    P = tpf.placement("cpu", ranks=list(range(world)))
    shares = {}
    for kind, heads, groups, *extra in cases:
        ref = _model(kind, heads, groups, 8 * heads, **(extra[0] if extra else {}))
        ids = torch.randint(0, ref.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
        plan = tpf.hf_plan(ref)
        mixers = [n for n, m in ref.named_modules() if any(m is x for x in _mixers(ref))]
        assert mixers and all(any(isinstance(s, StateSpaceHeads) and fnmatch.fnmatchcase(n, p) for p, s in plan.items())
                              for n in mixers), (kind, plan)  # every mixer planned, none left whole
        model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan=plan)
        shares[kind, groups] = _share(model, ref)
        seen = _heads_seen(ref)  # (the module of its mixers, which the patched scan serves for both)
        out = model(ids).logits
        assert seen and set(seen) == {heads // world}, (kind, seen)  # the recurrence ran on this rank's heads only
        want = ref(ids).logits
        assert (_whole(out) - want).abs().max() <= LOGITS_TOLERANCE * want.abs().max(), kind
        losses, norms = _train(model, ids)
        ref_losses, ref_norms = _train(ref, ids)
        # (the loss in fp32, as the models compute it)
        assert losses == pytest.approx(ref_losses, rel=1e-6) and norms == pytest.approx(ref_norms, rel=1e-6), \
            (kind, losses, ref_losses, norms, ref_norms)
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
            off = (_whole(p.detach()) - p_ref.detach()).abs().max() / p_ref.abs().max()
            assert off < STEP_TOLERANCE, f"{kind}: {name} after AdamW, {off:.1e} off (relative to its largest value)"
        model.eval()
        ref.eval()
        prompt = ids[:, :5]
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
        assert torch.equal(model.generate(prompt, **kwargs), ref.generate(prompt, **kwargs)), kind
        where = os.path.join(folder, f"{kind}-{groups}-{world}")
        model.save_pretrained(where)
        whole = tpf.full_state_dict(model)
        if dist.get_rank() == 0:  # one device reads the stored layout back, bitwise
            saved = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float64).state_dict()
            assert all(torch.equal(saved[k], v) for k, v in whole.items()), kind
        dist.barrier()
    return shares


@pytest.mark.parametrize("world", [1, 2, 4])
def test_mamba2_mixers_split_by_heads_match_one_device(world):
    # groups split over the ranks (8 of them), a group shared by the ranks of its heads (1; 2 at 4 ranks), each
    # family's own norm, a hybrid's attention and MoE around them
    cases = [("mamba2", 8, 8), ("mamba2", 8, 2), ("nemotron_h", 8, 8), ("falcon_h1", 8, 1), ("bamba", 8, 1),
             ("granitemoehybrid", 8, 1), ("zamba2", 8, 1)]
    folder = tempfile.mkdtemp()
    try:
        shares = run(world, _matches_one_device, cases, folder, timeout=600)[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if world == 2:
        for (kind, groups), share in shares.items():
            assert share <= 1 / world + 0.06, f"{kind} (groups {groups}) holds {share:.3f} of its values a rank"


def test_mamba2_mixers_split_over_three_ranks():
    folder = tempfile.mkdtemp()
    try:  # 6 heads: 3 groups split, or one group shared by the three ranks
        run(3, _matches_one_device, [("mamba2", 6, 3, {"state_size": 12}), ("mamba2", 6, 1, {"state_size": 12})],
            folder, timeout=600)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _checkpoints_across_degrees(folder: str, step: str) -> None:
    """``step`` ``"save"``: one device's checkpoint (``save_pretrained``) read by each rank's rows of each segment
    (``load_safetensors`` into a model built on the meta device), and its state saved by torch's distributed
    checkpoint; ``"load"``: that checkpoint read at this degree, bitwise."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import transformers

    import tpflow as tpf

    P = tpf.placement("cpu", ranks=list(range(dist.get_world_size())))
    ref = _model("mamba2", 8, 2)
    if dist.get_rank() == 0 and step == "save":
        ref.save_pretrained(os.path.join(folder, "one"))
    dist.barrier()
    with tpf.meta_parameters():
        model = transformers.AutoModelForCausalLM.from_config(ref.config).double()
    model = tpf.parallelize(model, placement=P, plan="auto")
    if step == "save":
        tpf.load_safetensors(model, os.path.join(folder, "one"))
        dcp.save(model.state_dict(), checkpoint_id=os.path.join(folder, "dcp"))
    else:
        state = model.state_dict()
        dcp.load(state, checkpoint_id=os.path.join(folder, "dcp"))
        model.load_state_dict(state)
    whole = tpf.full_state_dict(model)
    if dist.get_rank() == 0:
        assert whole.keys() == ref.state_dict().keys()
        assert all(torch.equal(whole[k], v) for k, v in ref.state_dict().items())


def test_mamba2_checkpoints_keep_the_stored_layout_across_degrees():
    folder = tempfile.mkdtemp()
    try:  # one device's file read on 2 ranks, saved by DCP, read on 4 and on 1
        run(2, _checkpoints_across_degrees, folder, "save")
        run(4, _checkpoints_across_degrees, folder, "load")
        run(1, _checkpoints_across_degrees, folder, "load")
        import torch.distributed.checkpoint.format_utils as formats

        formats.dcp_to_torch_save(os.path.join(folder, "dcp"), os.path.join(folder, "whole.pt"))
        stored = torch.load(os.path.join(folder, "whole.pt"))  # the distributed checkpoint, read whole: as stored
        assert all(torch.equal(stored[k], v) for k, v in _model("mamba2", 8, 2).state_dict().items())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _refusals() -> None:
    import tpflow as tpf

    P = tpf.placement("cpu", ranks=[0, 1, 2, 3])
    model = _model("mamba2", 6, 1, 48, state_size=12)
    with pytest.raises(ValueError, match=r"has 6 state-space heads in 1 groups, which do not split over 4 "
                                         r"tensor-parallel ranks .* use a degree among \[1, 2, 3, 6\]"):
        tpf.parallelize(model, placement=P, plan="auto")
    assert not any(hasattr(p, "placements") for p in model.parameters())  # refused before anything changed
    P = tpf.placement("cpu", ranks=[0, 1])
    with pytest.raises(ValueError, match=r"has 6 state-space heads in 3 groups, which do not split over 2 .* "
                                         r"\[1, 3, 6\]"):
        tpf.parallelize(_model("mamba2", 6, 3, 48, state_size=12), placement=P, plan="auto")
    with pytest.raises(ValueError, match=r"B / C rows \(1 groups of a 5-wide state\) do not split over 2 "):
        tpf.parallelize(_model("mamba2", 8, 1, 64, state_size=5), placement=P, plan="auto")


def test_mamba2_mixers_that_do_not_split_are_refused_by_name():
    run(4, _refusals)
