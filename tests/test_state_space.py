"""Mamba-2 mixers split by heads (``tpflow.hf.state_space``), checked against one device on transformers' own models:
logits, loss, every gradient, every parameter after AdamW steps with clipping, ``generate``, the share of values a
rank holds, the recurrence's heads on each rank, ``save_pretrained`` and torch's distributed checkpoint across
degrees, and the refusals."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from tests.harness import run
from tests.mixer_checks import Case, checked

# each family's config keys: its mixers' heads, head width and groups
FAMILIES = {
    "mamba2": ("num_heads", "head_dim", "n_groups"),
    "nemotron_h": ("mamba_num_heads", "mamba_head_dim", "n_groups"),
    "falcon_h1": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups"),
    "bamba": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups"),
    "granitemoehybrid": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups"),
    "zamba2": ("n_mamba_heads", "mamba_headdim", "mamba_ngroups"),
}


def _case(kind: str, heads: int = 8, groups: int = 1, **extra) -> Case:
    """The zoo's tiny ``kind`` with ``heads`` mixer heads of 16 features in ``groups`` (its hidden size 8 per head,
    the inner width twice that), and ``extra`` config; its chunked scan runs the heads."""
    config = dict(zip(FAMILIES[kind], (heads, 16, groups)), hidden_size=8 * heads, **extra)
    if kind == "falcon_h1":
        config["mamba_d_ssm"] = 16 * heads
    return Case(kind, config, "mamba2_chunk_scan", 0, 2, heads)


def _model(kind: str, heads: int = 8, groups: int = 1, **extra) -> torch.nn.Module:
    return _case(kind, heads, groups, **extra).model()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_mamba2_mixers_split_by_heads_match_one_device(world):
    # groups split over the ranks (8 of them, a group-counting norm among them: state-spaces/mamba #908's case), a
    # group shared by the ranks of its heads (1; 2 at 4 ranks), each family's own norm, a hybrid's attention and MoE
    cases = [_case("mamba2", 8, 8), _case("mamba2", 8, 2), _case("nemotron_h", 8, 8), _case("falcon_h1", 8, 8),
             _case("falcon_h1", 8, 1), _case("bamba", 8, 1), _case("granitemoehybrid", 8, 1), _case("zamba2", 8, 1)]
    checked(world, cases if world > 1 else cases[:2])  # (one rank: the split's bookkeeping, nothing split)


def test_mamba2_mixers_split_over_three_ranks():
    # 6 heads: 3 groups split, or one group shared by the three ranks
    checked(3, [_case("mamba2", 6, 3, state_size=12), _case("mamba2", 6, 1, state_size=12)])


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
    model = _model("mamba2", 6, 1, state_size=12)
    with pytest.raises(ValueError, match=r"has 6 state-space heads in 1 groups, which do not split over 4 "
                                         r"tensor-parallel ranks .* use a degree among \[1, 2, 3, 6\]"):
        tpf.parallelize(model, placement=P, plan="auto")
    assert not any(hasattr(p, "placements") for p in model.parameters())  # refused before anything changed
    P = tpf.placement("cpu", ranks=[0, 1])
    with pytest.raises(ValueError, match=r"has 6 state-space heads in 3 groups, which do not split over 2 .* "
                                         r"\[1, 3, 6\]"):
        tpf.parallelize(_model("mamba2", 6, 3, state_size=12), placement=P, plan="auto")
    with pytest.raises(ValueError, match=r"B / C rows \(1 groups of a 5-wide state\) do not split over 2 "):
        tpf.parallelize(_model("mamba2", 8, 1, state_size=5), placement=P, plan="auto")


def test_mamba2_mixers_that_do_not_split_are_refused_by_name():
    run(4, _refusals)


def _fsdp_beside_heads(folder: str) -> None:
    """dp x tp = 2 x 2: FSDP2 over the data axis of mixers split by heads, against one device; its state saved by
    torch's distributed checkpoint."""
    import copy

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    import tpflow as tpf
    from tests.models import train_lm
    from tests.test_delta_net import _delta_net

    for case in (_case("mamba2", 8, 2), _delta_net("qwen3_5_text", 2, 4)):
        P = tpf.placement("cpu", [[0, 1], [2, 3]], names=("dp", "tp"))
        ref = case.model()
        model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan="auto")
        layers = next(m for n, m in model.named_modules() if n.endswith("layers"))
        for layer in layers:
            fully_shard(layer, mesh=P.mesh["dp"])
        fully_shard(model, mesh=P.mesh["dp"])
        ids = torch.randint(0, ref.config.vocab_size, (4, 10), generator=torch.Generator().manual_seed(1))
        losses, norms = train_lm(model, ids.tensor_split(2)[P["dp"].coordinate()[0]])
        ref_losses, ref_norms = train_lm(ref, ids)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, losses)
        mean = torch.tensor([every[0], every[2]], dtype=torch.float64).mean(0)  # the data-parallel rows' mean
        torch.testing.assert_close(mean, torch.tensor(ref_losses, dtype=torch.float64), rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-6, atol=0)
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):  # FSDP2's own, in stored order
            torch.testing.assert_close(p.full_tensor(), p_ref.detach(), rtol=1e-5, atol=1e-6, msg=name)
        where = os.path.join(folder, case.kind)
        dcp.save(model.state_dict(), checkpoint_id=where)
        whole = tpf.full_state_dict(model)
        if dist.get_rank() == 0:
            import torch.distributed.checkpoint.format_utils as formats

            formats.dcp_to_torch_save(where, where + ".pt")  # each rank's rows of each segment, at stored offsets
            stored = torch.load(where + ".pt")
            assert stored.keys() == whole.keys() and all(torch.equal(stored[k], v) for k, v in whole.items())
        dist.barrier()


def test_mixers_split_by_heads_beside_fsdp2():
    folder = tempfile.mkdtemp()
    try:
        run(4, _fsdp_beside_heads, folder, timeout=600)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
