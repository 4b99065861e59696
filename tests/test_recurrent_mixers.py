"""Short convolutions and recurrent blocks split by channels or heads (``tpflow.hf.short_conv``: LFM2's,
``tpflow.hf.recurrent``: RecurrentGemma's, ``tpflow.hf.rwkv``: RWKV's time and channel mixing, ``tpflow.hf.mlstm``:
xLSTM's), checked against one device on transformers' own models (``tests.mixer_checks``): logits, loss, every
parameter after AdamW steps with clipping, ``generate`` with the mixers' caches, each rank's recurrence on its own
channels or heads, ``save_pretrained`` read back on one device; sequence parallelism around them; the share of each
mixer a rank holds, and the refusals."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run
from tests.mixer_checks import Case, checked

# each family's recurrence (or convolution) and the dim of its input that counts the channels: 64 on one device
CASES = [
    Case("lfm2", {"conv_bias": True}, "causal_conv1d_fn", 0, 1, 64),  # biases: in_proj's in segments, out_proj's whole
    Case("lfm2_moe", {}, "causal_conv1d_fn", 0, 1, 64),
    Case("recurrent_gemma", {}, "RecurrentGemmaRglru.forward", 1, 2, 64),  # (the RG-LRU's input)
    Case("rwkv", {}, "rwkv_linear_attention", 2, 2, 64),  # (the WKV recurrence's keys)
    Case("xlstm", {}, "xLSTMMultiHeadLayerNorm.forward", 1, 2, 4),  # (the memory's output, by head)
    Case("minimax", {"block_size": 4}, "apply_mask_to_padding_states", 0, 2, 192),  # lightning: 4 heads' q, k, v
    Case("zamba", {}, "causal_conv1d_fn", 0, 1, 128),  # Mamba in independent heads
]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_short_convolutions_and_recurrent_blocks_split_match_one_device(world):
    checked(world, CASES if world > 1 else CASES[:2])  # (one rank: the split's bookkeeping, nothing split)


def _rwkv_under_sequence_parallelism() -> None:
    """RWKV on each rank's tokens between its mixers (a plan of its own: ``hf_plan`` takes sequence parallelism for
    decoder layers named ``layers``), against one device: logits, losses, gradient norms, parameters after AdamW."""
    import torch.distributed as dist

    import tpflow as tpf
    from tests.models import train_lm
    from tpflow.hf.rwkv import ChannelMixChannels, TimeMixChannels
    from tpflow.models.check import LOGITS_TOLERANCE, STEP_TOLERANCE

    ref = _model("rwkv")
    ids = torch.randint(0, ref.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    plan = {"rwkv.blocks.0": tpf.SequenceParallel(split_input=True), "rwkv.ln_out": tpf.SequenceParallel(),
            "rwkv.blocks.*.attention": TimeMixChannels(sequence_parallel=True),
            "rwkv.blocks.*.feed_forward": ChannelMixChannels(sequence_parallel=True),
            "head": tpf.VocabParallel(sequence_parallel=True, sequence_dim=1)}
    model = tpf.parallelize(_model("rwkv"), placement=tpf.placement("cpu", ranks=list(range(dist.get_world_size()))),
                            plan=plan)
    out, want = model(ids).logits.full_tensor(), ref(ids).logits
    assert (out - want).abs().max() <= LOGITS_TOLERANCE * want.abs().max()
    (losses, norms), (ref_losses, ref_norms) = train_lm(model, ids), train_lm(ref, ids)
    assert losses == pytest.approx(ref_losses, rel=1e-6) and norms == pytest.approx(ref_norms, rel=1e-6)
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert (p.detach().full_tensor() - p_ref).abs().max() / p_ref.abs().max() < STEP_TOLERANCE, name


def test_short_convolutions_and_recurrent_blocks_under_sequence_parallelism_match_one_device():
    # each rank's tokens gathered into the mixer, its output back to them (RWKV's channel mixing: its gated channels
    # gathered, then this rank's tokens kept); RecurrentGemma's temporal blocks, attention in some layers and a
    # recurrence in the others, each gathered by its own entry
    checked(2, [c for c in CASES if c.kind in ("lfm2", "lfm2_moe", "recurrent_gemma")], sequence_parallel=True)
    run(2, _rwkv_under_sequence_parallelism)


def _model(kind: str, **config) -> torch.nn.Module:
    return Case(kind, config, "", 0, 0, 0).model()


def _mixer_shares_and_refusals() -> dict[str, float]:
    """On 2 ranks: the share of each split mixer's values a rank holds (by its style), RWKV's channel mixing on
    this rank's intermediate features; counts that do not split refused by name, before anything changes."""
    import tpflow as tpf
    from tpflow.hf.mixer_styles import mixer_style

    P = tpf.placement("cpu", ranks=[0, 1])
    shares = {}
    for case in CASES:
        ref = case.model()
        mixers = {n for n, m in ref.named_modules() if mixer_style(m) is not None}
        model = tpf.parallelize(case.model(), placement=P, plan="auto")
        for name in mixers:
            held = sum(p.to_local().numel() for p in model.get_submodule(name).parameters())
            shares[f"{case.kind} {name}"] = \
                held / sum(p.numel() for p in ref.get_submodule(name).parameters())
        if case.kind == "rwkv":  # the channel mixing: its value layer reads this rank's 48 of 96 features
            widths = []
            model.rwkv.blocks[0].feed_forward.value.register_forward_pre_hook(
                lambda m, args, seen=widths: seen.append(args[0].shape[-1]))
            model(torch.zeros(1, 3, dtype=torch.long))
            assert widths == [48], widths
    assert all(share <= 0.5 + 0.02 for share in shares.values()), shares  # (whole: biases, RWKV's token-shift mixes)

    refused = [("lfm2", {"hidden_size": 5, "num_attention_heads": 1, "num_key_value_heads": 1,
                         "layer_types": ["conv", "conv"]}, r"'model.layers.0.conv' has 5 short-convolution channels, "
                                                           r"which do not split over 2 tensor-parallel ranks: use a "
                                                           r"degree among \[1, 5\]"),
               ("recurrent_gemma", {"num_attention_heads": 3, "hidden_size": 48, "lru_width": 48,
                                    "block_types": ["recurrent"]},
                r"'model.layers.0.temporal_block' has 3 recurrent heads \(RG-LRU gate blocks\), which do not split "
                r"over 2 tensor-parallel ranks: use a degree among \[1, 3\]"),
               ("rwkv", {"hidden_size": 5, "attention_hidden_size": 5, "intermediate_size": 10},
                r"'rwkv.blocks.0.attention' has 5 time-mixing channels, which do not split over 2"),
               ("rwkv", {"hidden_size": 6, "attention_hidden_size": 6, "intermediate_size": 9},
                r"'rwkv.blocks.0.feed_forward' has 9 channel-mixing intermediate features, which do not split over "
                r"2 tensor-parallel ranks: use a degree among \[1, 3, 9\]"),
               ("xlstm", {"num_heads": 1}, r"'backbone.blocks.0.mlstm_layer' has 1 mLSTM heads, which do not split "
                                           r"over 2 tensor-parallel ranks: use a degree among \[1\]")]
    for kind, config, match in refused:
        model = _model(kind, **config)
        with pytest.raises(ValueError, match=match):
            tpf.parallelize(model, placement=P, plan="auto")
        assert not any(hasattr(p, "placements") for p in model.parameters())  # refused before anything changed
    return shares


def test_split_mixers_hold_their_share_and_refuse_counts_that_do_not_split():
    run(2, _mixer_shares_and_refusals)
