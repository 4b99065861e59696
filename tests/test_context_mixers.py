"""Context parallelism through token mixers other than attention (``tpf.hf_plan(model, context_parallel=...)``): each
mixer tpflow splits by heads (Mamba-2, Mamba-1, gated DeltaNet, KDA, short convolutions, RG-LRU, RWKV, mLSTM) runs
head parallel, its heads split over every rank of the context x tensor grid, the sequence gathered over the context
ranks around it; hybrids keep their attention on the ring's cut (or Ulysses'). Against one device, fp64: the logits,
the loss, every gradient and every parameter after two AdamW steps with clipping, on whole and packed batches, at 2
and 4 ranks and 2 x 2 context x tensor; each rank's recurrence runs on every token of its share of the heads, and
each rank holds its share of the mixers' values; heads that do not split are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness
from tests.checks import within
from tests.mixer_checks import Case, scan_shapes, share
from tests.models import adamw_steps
from tests.test_context import _placement
from tests.test_delta_net import _delta_net, _kimi
from tests.test_state_space import _case

pytest.importorskip("transformers")

SEQ = 16  # (a multiple of 2 x 4: the ring's head-tail parts at 4 ranks)

# each family once, their heads (or channels) splitting over 4 ranks; fewer key heads or groups than ranks where the
# family has them (gathered over the ranks sharing one), hybrids beside attention and experts
CASES = [
    _delta_net("qwen3_next", 2, 4),  # interleaved projections; 2 key heads shared by 2 ranks each at 4
    _delta_net("qwen3_5_text", 2, 4),  # segmented projections
    _kimi(4),
    Case("bailing_hybrid", {}, "chunk_kimi_delta_attention", 2, 2, 4),  # KDA with full-rank gates
    _case("nemotron_h", 8, 2),  # Mamba-2 in 2 groups, beside attention
    _case("bamba", 8, 1),
    _case("mamba2", 8, 8),  # no attention at all
    Case("falcon_mamba", {}, "mamba_selective_scan", 0, 1, 96),  # Mamba-1
    Case("jamba", {}, "mamba_selective_scan", 0, 1, 128),
    Case("lfm2", {}, "causal_conv1d_fn", 0, 1, 64),
    Case("recurrent_gemma", {}, "RecurrentGemmaRglru.forward", 1, 2, 64),  # RG-LRU, reset at position 0
    Case("rwkv", {}, "rwkv_linear_attention", 2, 2, 64),
    Case("xlstm", {}, "xLSTMMultiHeadLayerNorm.forward", 1, 2, 4),
    Case("minimax", {"block_size": 4}, "apply_mask_to_padding_states", 0, 2, 192),  # lightning attention, blocks of 4
    Case("zamba", {}, "causal_conv1d_fn", 0, 1, 128),  # Mamba in independent heads
]
GRID = ["qwen3_next", "nemotron_h", "kimi_linear", "rwkv"]  # checked 2 x 2 too


def _batches(ids: torch.Tensor) -> list[tuple[str, dict]]:
    """Whole rows; packed documents (position_ids restarting, labels -100 at each document's first token), which the
    ring cuts in pieces balanced by their attention work, not head-tail: the mixers put them back in order (a
    reshuffle of packed documents left out of order is the silent bug to guard against)."""
    from tpflow.ops import balanced, head_tail

    positions = torch.tensor([[p for n in row for p in range(n)] for row in ([3, 10, 3], [8, 8])])
    first = torch.arange(SEQ) - positions
    assert all(balanced(w, first) != head_tail(w, SEQ) for w in (2, 4))
    return [("whole", {"labels": ids}),
            ("packed", {"position_ids": positions, "labels": ids.masked_fill(positions == 0, -100)})]


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """``got`` within ``tol`` of ``want``'s largest entry."""
    off = (got - want).abs().max() / max(want.abs().max().item(), 1e-6)
    assert off <= tol, f"{what}: {off:.1e} off (relative to the largest)"


def _same_training(model, ref, ids: torch.Tensor, kwargs: dict, what: str) -> None:
    """The logits, the loss and every gradient of one call against one device's (the mixers' recurrences compute in
    fp32, on one device as under the split), then every parameter after two AdamW steps with clipping (to a
    hundredth of a step of its largest entry: Adam's normalized step magnifies a near-zero gradient's rounding)."""
    from tpflow.models.check import LOGITS_TOLERANCE, STEP_TOLERANCE

    with within(120):
        out = model(ids, **kwargs, use_cache=False)
        out.loss.backward()
    want = ref(ids, **kwargs, use_cache=False)
    want.loss.backward()
    _close(out.logits.full_tensor(), want.logits, LOGITS_TOLERANCE, f"{what} logits")
    _close(out.loss, want.loss.float(), LOGITS_TOLERANCE, f"{what} loss")
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if q.grad is None:  # (a sparse-attention indexer's: it picks under no_grad)
            assert p.grad is None, f"{what} {name} has a gradient one device does not"
            continue
        # the recurrences' fp32 rounding summed over the tokens: a wrong block or order is off by its gradient's size
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{what} {n}'s gradient: {m}")
    model.zero_grad()
    ref.zero_grad()
    adamw_steps((model, ref), ids, kwargs)  # (eps: a near-zero gradient's rounding is no lr-sized step)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        _close(p.detach().full_tensor(), q.detach(), STEP_TOLERANCE, f"{what} {name} after AdamW")


def _mixers(kinds: list[str], tensor: int, cuts: str = "both") -> None:
    """Each case of ``kinds`` under the ring and Ulysses over the world (context x ``tensor``; ``cuts``
    ``"alternate"``: the ring for every other case, Ulysses for the rest, the other way round at the other world
    size): trained alike on whole and packed batches; its recurrence sees every token of this rank's heads; this
    rank holds its share."""
    world = dist.get_world_size()
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(3))
    for i, case in enumerate([c for c in CASES if c.kind in kinds]):
        both = ("ring", "ulysses")
        for kind in both if cuts == "both" else (both[(i + world // 2) % 2],):
            ref = case.model()
            model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(tensor),
                                    plan=tpf.hf_plan(ref, context_parallel=kind))
            what = f"{case.kind} {kind}, context {world // tensor} x tensor {tensor}"
            shapes = scan_shapes(ref, case)  # (the modeling module's function: the model's calls alone here)
            with torch.no_grad():
                model(ids, use_cache=False)
            assert shapes and {s[case.dim] for s in shapes} == {case.heads // world}, (what, shapes)
            assert all(SEQ in s for s in shapes), (what, shapes)  # every token of the sequence
            for batch, kwargs in _batches(ids):
                _same_training(model, ref, ids, kwargs, f"{what}, {batch}")
            mixers = [(n, p) for n, p in model.named_parameters() if _in_mixer(ref, n)]
            split = [(n, p) for n, p in mixers if not all(x.is_replicate() for x in p.placements)]
            assert all(p.to_local().numel() * world == p.numel() for _, p in split), what  # 1 / W of each
            assert sum(p.numel() for _, p in split) >= 0.8 * sum(p.numel() for _, p in mixers), what  # (gates whole)
            assert share(model, ref) < 1 or world == 1, what


def _in_mixer(model: torch.nn.Module, name: str) -> bool:
    from tpflow.hf.mixer_styles import mixer_style

    parts = name.split(".")
    return any(mixer_style(model.get_submodule(".".join(parts[:i]))) is not None for i in range(1, len(parts)))


@pytest.mark.parametrize("world", [2, 4])
def test_mixers_run_head_parallel_and_match_one_device(world):
    # each case under each cut once over the two world sizes (the cuts differ only in the attention beside the mixer)
    harness.run(world, _mixers, [c.kind for c in CASES], 1, "alternate", timeout=900)


def test_mixers_on_context_by_tensor_grid_match_one_device():
    harness.run(4, _mixers, GRID, 2, timeout=600)
    harness.run(1, _mixers, GRID[:2], 1, timeout=600)  # a context axis of one rank: nothing gathered, nothing split


def _refusals() -> None:
    P = tpf.placement("cpu", ranks=[0, 1, 2, 3])
    model = _kimi(6).model()
    with pytest.raises(ValueError, match=r"has 6 heads, which do not split over 4 ranks \(context parallelism runs "
                                         r"it head parallel.*use a degree among \[1, 2, 3, 6\]"):
        tpf.parallelize(model, placement=P, plan=tpf.hf_plan(model, context_parallel="ring"))
    assert not any(hasattr(p, "placements") for p in model.parameters())  # refused before anything changed


def test_mixers_whose_heads_do_not_split_are_refused_by_name():
    harness.run(4, _refusals)
