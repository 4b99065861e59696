"""State passing (``tpf.hf_plan(model, context_parallel=..., mixers="state_passing")``): gated DeltaNets (Qwen3-Next's
interleaved projections, Qwen3.5's segmented ones), Kimi Linear's delta attention, Mamba-2 (Nemotron-H, Bamba, Mamba2,
Falcon-H1, Granite-4.0-H, Zamba2), Mamba-1 (Jamba, Falcon-Mamba, Mamba, Zamba's heads), MiniMax's lightning attention
and LFM2's short convolutions run on each rank's own tokens, their heads split over the tensor axis alone, the
convolution's halo and the recurrence's state handed over from the fragments before. Against one device, fp64 (the delta
rule and Mamba-2's scan compute in fp32 on both): the logits, the loss, every gradient and every parameter after two
AdamW steps with clipping, on whole and packed batches, under the ring's head-tail cut and the balanced cut of packed
documents and Ulysses' contiguous parts, at 2 and 4 ranks and 2 x 2 context x tensor (1 and 3 ranks: the ring); each
rank's recurrence sees its own tokens alone; what state passing cannot run is refused by name, and rows padded on the
left (which neither mode hands a mixer's padding mask) in both modes. CASES run at every layout; the families that share
another's scan at one layout each (BY_TURNS)."""

from __future__ import annotations

import copy
import inspect
import sys

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness
from tests.mixer_checks import Case, scan_shapes
from tests.test_context import _placement
from tests.test_context_mixers import SEQ, _batches, _in_mixer, _same_training
from tests.test_delta_net import _delta_net, _kimi
from tests.test_state_space import _case

pytest.importorskip("transformers")

CASES = [_delta_net("qwen3_next", 2, 4),  # interleaved projections
         _case("nemotron_h", 8, 2, chunk_size=4),  # Mamba-2 in 2 groups beside attention, chunks of 4
         Case("jamba", {}, "mamba_selective_scan", 0, 1, 128)]  # Mamba-1 beside attention and experts
BY_TURNS = {"2x1": [_case("bamba", 8, 1), _case("mamba2", 8, 8, chunk_size=4),
                    Case("mamba", {}, "mamba_selective_scan", 0, 1, 96),
                    Case("lfm2", {}, "causal_conv1d_fn", 0, 1, 64),  # short convolutions: the halo alone
                    Case("zamba", {}, "causal_conv1d_fn", 0, 1, 128)],  # (Zamba's Mamba-1 in independent heads)
            "4x1": [_case("falcon_h1", 8, 2), Case("falcon_mamba", {}, "mamba_selective_scan", 0, 1, 96),
                    Case("minimax", {"block_size": 4}, "apply_mask_to_padding_states", 0, 2, 192)],  # lightning
            "2x2": [_delta_net("qwen3_5_text", 2, 4),  # segmented projections, split over the tensor axis
                    _kimi(4),  # KDA's per-channel gates (the delta rule's path)
                    _case("granitemoehybrid", 8, 2), _case("zamba2", 8, 2, chunk_size=4)]}


def _passing(tensor: int) -> None:
    """Each case under the ring or Ulysses (by turns: the other at the other world size), on whole and packed rows:
    trained as one device; each call of the recurrence (or convolution, or MiniMax's masked q, k, v) reads this
    rank's heads or channels (split over the tensor axis) and its own tokens, never the whole sequence. On the
    context x tensor grid, the first case hands its state serially."""
    world = dist.get_world_size()
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(3))
    for i, case in enumerate(CASES + BY_TURNS[f"{world // tensor}x{tensor}"]):
        for kind in [("ring", "ulysses")[(i + world // 2 + tensor) % 2]]:
            mode = "state_passing_serial" if tensor == 2 and i == 0 else "state_passing"
            ref = case.model()
            model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(tensor),
                                    plan=tpf.hf_plan(ref, context_parallel=kind, mixers=mode))
            what = f"{case.kind} {kind} {mode}, context {world // tensor} x tensor {tensor}"
            for batch, kwargs in _batches(ids):
                shapes = scan_shapes(ref, case)  # (the modeling module's function: the model's calls alone here)
                with torch.no_grad():
                    model(ids, **kwargs, use_cache=False)
                tokens = 1 if case.dim > 1 else -1  # ([batch, tokens, heads, ...] or [batch, channels, tokens])
                assert shapes and {(s[tokens], s[case.dim]) for s in shapes} == {(SEQ * tensor // world,
                                                                                 case.heads // tensor)}, (what, shapes)
                _same_training(model, ref, ids, kwargs, f"{what}, {batch}")
            mixers = [p for n, p in model.named_parameters() if _in_mixer(ref, n)]
            held = sum(p.to_local().numel() for p in mixers) / sum(p.numel() for p in mixers)
            assert held <= 1 / tensor + 0.1, (what, held)  # heads split by tensor (low-rank gates whole)


@pytest.mark.parametrize("world", [2, 4])
def test_mixers_pass_their_state_and_match_one_device(world):
    harness.run(world, _passing, 1, timeout=900)


def test_mixers_pass_their_state_on_a_context_by_tensor_grid():
    harness.run(4, _passing, 2, timeout=900)


def _odd_world() -> None:
    """One and three context ranks (the ring's 2 or 6 parts of 24 tokens, packed documents of 5, 15 and 4 tokens
    cut in balanced pieces): CASES and MiniMax trained as one device, the first case serially."""
    world = dist.get_world_size()
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([[p for n in row for p in range(n)] for row in ([5, 15, 4], [12, 12])])
    batches = [("whole", {"labels": ids}),
               ("packed", {"position_ids": positions, "labels": ids.masked_fill(positions == 0, -100)})]
    for i, case in enumerate(CASES + BY_TURNS["4x1"][-1:]):
        mode = "state_passing_serial" if i == 0 else "state_passing"
        ref = case.model()
        model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(1),
                                plan=tpf.hf_plan(ref, context_parallel="ring", mixers=mode))
        for batch, kwargs in batches:
            _same_training(model, ref, ids, kwargs, f"{case.kind} ring {mode}, {world} ranks, {batch}")


@pytest.mark.parametrize("world", [1, 3])
def test_state_passing_on_one_and_three_ranks(world):
    harness.run(world, _odd_world, timeout=900)


def _rule_calls(model: torch.nn.Module, given: list[tuple] | None = None, part: slice = slice(None)) -> list[tuple]:
    """Record each call of the delta rule of ``model``'s modeling module: its query, key, value, g, beta and output (a
    list, filled as they come); with ``given`` (another run's record), each call's inputs replaced by those of the
    same call there, cut to ``part`` of the tokens. The recorder stays until the module is recorded again (or the
    caller puts the function back)."""
    module = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    rule = getattr(module.torch_chunk_gated_delta_rule, "__wrapped_rule__", module.torch_chunk_gated_delta_rule)
    calls: list[tuple] = []

    def recorded(query, key, value, g, beta, **kwargs):
        if given is not None:
            query, key, value, g, beta = (t[:, part] for t in given[len(calls)][:5])
        out = rule(query, key, value, g=g, beta=beta, **kwargs)
        calls.append((query, key, value, g, beta, out[0]))
        return out

    recorded.__wrapped_rule__ = rule
    module.torch_chunk_gated_delta_rule = recorded
    return calls


def _serial() -> None:
    """``mixers="state_passing_serial"``: the state handed from rank to rank in sequence order. Each recurrence of
    CASES trained as one device (one cut each), and, given one device's inputs on a sequence whose Ulysses parts
    start on the delta rule's chunks of 64 tokens, the delta rule's outputs bitwise one device's (at 4 ranks, where
    combining the summaries in parallel is off by their rounding)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(3))
    for i, case in enumerate(CASES):
        kind = ("ring", "ulysses")[(i + world // 2) % 2]
        ref = case.model()
        model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(1),
                                plan=tpf.hf_plan(ref, context_parallel=kind, mixers="state_passing_serial"))
        for batch, kwargs in _batches(ids):
            _same_training(model, ref, ids, kwargs, f"{case.kind} {kind} serial, {world} ranks, {batch}")
    ref = CASES[0].model()
    model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(1),
                            plan=tpf.hf_plan(ref, context_parallel="ulysses", mixers="state_passing_serial"))
    long = torch.randint(0, 64, (1, 64 * world), generator=torch.Generator().manual_seed(4))
    part = slice(64 * rank, 64 * (rank + 1))
    module = sys.modules[type(ref.model.layers[0].linear_attn).__module__]
    rule = module.torch_chunk_gated_delta_rule
    with torch.no_grad():
        try:
            whole = _rule_calls(ref)
            ref(long, use_cache=False)
            split = _rule_calls(ref, whole, part)
            model(long, use_cache=False)
        finally:
            module.torch_chunk_gated_delta_rule = rule
    assert len(split) == len(whole) > 0
    for got, want in zip(split, whole):
        assert torch.equal(got[-1], want[-1][:, part]), (rank, (got[-1] - want[-1][:, part]).abs().max())


def test_serial_state_passing_is_one_device_bitwise_on_chunk_boundaries():
    harness.run(4, _serial, timeout=900)


def _refused() -> None:
    from tests.test_context_mixers import CASES as MIXERS

    qwen, rglru, minimax = CASES[0].model(), *(next(c for c in MIXERS if c.kind == kind).model()
                                               for kind in ("recurrent_gemma", "minimax"))
    with pytest.raises(ValueError, match="under context_parallel"):
        tpf.hf_plan(qwen, mixers="state_passing")
    with pytest.raises(ValueError, match="use 'head_parallel', 'state_passing', 'state_passing_serial'"):
        tpf.hf_plan(qwen, context_parallel="ring", mixers="states")
    with pytest.raises(ValueError, match="other mixers run head parallel: use mixers='head_parallel'"):
        tpf.parallelize(rglru, placement=_placement(1),
                        plan=tpf.hf_plan(rglru, context_parallel="ring", mixers="state_passing"))
    with pytest.raises(ValueError, match="lightning attention runs its blocks inline.*use mixers='state_passing'"):
        tpf.parallelize(minimax, placement=_placement(1),
                        plan=tpf.hf_plan(minimax, context_parallel="ring", mixers="state_passing_serial"))
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
    # the delta rule replaced after parallelize (tpflow's wrapper lost): the mixer would run on this rank's tokens
    # alone; parallelizing again wraps the new function
    model = CASES[0].model()
    model = tpf.parallelize(model, placement=_placement(1),
                            plan=tpf.hf_plan(model, context_parallel="ring", mixers="state_passing"))
    module = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    wrapped = module.torch_chunk_gated_delta_rule
    module.torch_chunk_gated_delta_rule = inspect.unwrap(wrapped)  # (transformers' own torch function)
    try:
        with pytest.raises(ValueError, match="ran without calling its modeling module.s torch_chunk_gated_delta_rule"):
            model(ids, labels=ids, use_cache=False)
        ref = CASES[0].model()
        model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(1),
                                plan=tpf.hf_plan(ref, context_parallel="ring", mixers="state_passing"))
        _same_training(model, ref, ids, {"labels": ids}, "wrapped again")
    finally:
        module.torch_chunk_gated_delta_rule = wrapped


def test_what_state_passing_cannot_run_is_refused_by_name():
    harness.run(4, _refused)
