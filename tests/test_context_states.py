"""State passing (``tpf.hf_plan(model, context_parallel=..., mixers="state_passing")``): gated DeltaNets (Qwen3-Next's
interleaved projections, Qwen3.5's segmented ones) and Kimi Linear's delta attention run on each rank's own tokens,
their heads split over the tensor axis alone, the convolution's halo and the delta rule's state handed over from the
fragments before. Against one device, fp64 (the delta rule computes in fp32 on both): the logits, the loss, every
gradient and every parameter after two AdamW steps with clipping, on whole and packed batches, under the ring's
head-tail cut and the balanced cut of packed documents and Ulysses' contiguous parts, at 2 and 4 ranks and 2 x 2
context x tensor; each rank's recurrence sees its own tokens alone; what state passing cannot run is refused by name,
and rows padded on the left (which neither mode hands a mixer's padding mask) in both modes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness
from tests.mixer_checks import scan_shapes
from tests.test_context import _placement
from tests.test_context_mixers import SEQ, _batches, _in_mixer, _same_training
from tests.test_delta_net import _delta_net, _kimi

pytest.importorskip("transformers")

CASES = [_delta_net("qwen3_next", 2, 4), _delta_net("qwen3_5_text", 2, 4), _kimi(4)]


def _passing(tensor: int) -> None:
    """Each case under the ring or Ulysses (by turns: the other at the other world size), on whole and packed rows:
    trained as one device; each call of the delta rule reads this rank's heads (split over the tensor axis) and its
    own tokens, never the whole sequence."""
    world = dist.get_world_size()
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(3))
    for i, case in enumerate(CASES):
        for kind in [("ring", "ulysses")[(i + world // 2 + tensor) % 2]]:
            ref = case.model()
            model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(tensor),
                                    plan=tpf.hf_plan(ref, context_parallel=kind, mixers="state_passing"))
            what = f"{case.kind} {kind}, context {world // tensor} x tensor {tensor}"
            for batch, kwargs in _batches(ids):
                shapes = scan_shapes(ref, case)  # (the modeling module's function: the model's calls alone here)
                with torch.no_grad():
                    model(ids, **kwargs, use_cache=False)
                assert shapes and {(s[1], s[case.dim]) for s in shapes} == {(SEQ * tensor // world,
                                                                            case.heads // tensor)}, (what, shapes)
                _same_training(model, ref, ids, kwargs, f"{what}, {batch}")
            mixers = [p for n, p in model.named_parameters() if _in_mixer(ref, n)]
            held = sum(p.to_local().numel() for p in mixers) / sum(p.numel() for p in mixers)
            assert held <= 1 / tensor + 0.1, (what, held)  # heads split by tensor (low-rank gates whole)


@pytest.mark.parametrize("world", [2, 4])
def test_delta_nets_pass_their_state_and_match_one_device(world):
    harness.run(world, _passing, 1, timeout=900)


def test_delta_nets_pass_their_state_on_a_context_by_tensor_grid():
    harness.run(4, _passing, 2, timeout=900)


def _refused() -> None:
    from tests.test_context_mixers import CASES as MIXERS

    qwen, mamba = CASES[0].model(), next(c for c in MIXERS if c.kind == "mamba2").model()
    with pytest.raises(ValueError, match="under context_parallel"):
        tpf.hf_plan(qwen, mixers="state_passing")
    with pytest.raises(ValueError, match="use 'head_parallel' or 'state_passing'"):
        tpf.hf_plan(qwen, context_parallel="ring", mixers="states")
    with pytest.raises(ValueError, match="other mixers run head parallel: use mixers='head_parallel'"):
        tpf.parallelize(mamba, placement=_placement(1),
                        plan=tpf.hf_plan(mamba, context_parallel="ring", mixers="state_passing"))
    ids = torch.randint(0, 64, (2, SEQ))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding (labels -100 there and at the first real token, scored at the last padded one)
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 3] = -100
    for mode in ("state_passing", "head_parallel"):  # (head parallel ran it unmasked: the padding in the state)
        model = CASES[0].model()
        model = tpf.parallelize(model, placement=_placement(1),
                                plan=tpf.hf_plan(model, context_parallel="ring", mixers=mode))
        with pytest.raises(ValueError, match="padding before a row.s tokens would reach their state"):
            model(ids, attention_mask=mask, labels=labels, use_cache=False)


def test_what_state_passing_cannot_run_is_refused_by_name():
    harness.run(4, _refused)
