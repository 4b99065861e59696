"""Gated DeltaNet and Kimi delta attention split by heads (``tpflow.hf.delta_net``), checked against one device on
transformers' own models (``tests.mixer_checks``): Qwen3-Next's interleaved projections, Qwen3.5's segmented ones
(dense and MoE), OLMo-Hybrid's separate ones, Kimi Linear's low-rank gates; key heads split with their value heads,
or shared by the ranks of their value heads where there are fewer of them than ranks; the refusals."""

from __future__ import annotations

import pytest

from tests.harness import run
from tests.mixer_checks import Case, checked


def _delta_net(kind: str, keys: int, values: int, **extra) -> Case:
    config = {"linear_num_key_heads": keys, "linear_num_value_heads": values, **extra}
    return Case(kind, config, "torch_chunk_gated_delta_rule", 2, 2, values)  # (its values' heads)


def _kimi(heads: int, **extra) -> Case:
    return Case("kimi_linear", {"linear_num_heads": heads, **extra}, "chunk_kimi_delta_attention", 2, 2, heads)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_delta_nets_split_by_heads_match_one_device(world):
    # 2 key heads of 2 value heads each: split at 2 ranks, each shared by 2 ranks at 4
    cases = [_delta_net("qwen3_next", 2, 4), _delta_net("qwen3_5_text", 2, 4), _delta_net("qwen3_5_moe_text", 2, 4),
             _delta_net("olmo_hybrid", 2, 4), _kimi(4),
             Case("bailing_hybrid", {}, "chunk_kimi_delta_attention", 2, 2, 4)]  # KDA, full-rank gates
    checked(world, cases)


def test_delta_nets_split_over_three_ranks():
    # 3 key heads split, or one key head shared by the three ranks; 6 Kimi heads
    attention = {"num_attention_heads": 3, "num_key_value_heads": 3}  # (their attention layers' too)
    checked(3, [_delta_net("qwen3_next", 3, 6, **attention),
                _delta_net("qwen3_5_text", 1, 3, linear_key_head_dim=12, **attention), _kimi(6, **attention)])


def test_mixers_under_sequence_parallelism_match_one_device():
    # each rank's tokens gathered into the mixer, its output reduce-scattered back to them
    from tests.test_state_space import _case

    cases = [_case("mamba2", 8, 8), _case("bamba", 8, 1), _delta_net("qwen3_5_text", 2, 4), _kimi(4)]
    checked(4, cases, sequence_parallel=True)


def _refusals() -> None:
    import tpflow as tpf

    P = tpf.placement("cpu", ranks=[0, 1, 2, 3])
    model = _delta_net("qwen3_5_text", 2, 6).model()
    with pytest.raises(ValueError, match=r"has 2 key heads and 6 value heads, which do not split over 4 "
                                         r"tensor-parallel ranks .* use a degree among \[1, 2\]"):
        tpf.parallelize(model, placement=P, plan="auto")
    assert not any(hasattr(p, "placements") for p in model.parameters())  # refused before anything changed
    with pytest.raises(ValueError, match=r"has 6 heads, which do not split over 4 tensor-parallel ranks: use a "
                                         r"degree among \[1, 2, 3, 6\]"):
        tpf.parallelize(_kimi(6).model(), placement=P, plan="auto")


def test_delta_nets_that_do_not_split_are_refused_by_name():
    run(4, _refusals)
