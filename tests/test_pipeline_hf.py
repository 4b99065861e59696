"""Hugging Face causal LMs cut into pipeline stages by their own pipeline plan (tpf.pipeline.cut), each stage the
model's own class and forward, against the same model on one device: the labels= loss at every step and every
parameter after SGD steps, then after AdamW steps on prompt-masked labels (rows with different numbers of -100
labels, rows and a whole micro-batch without a labelled token), under every schedule, with stages of one rank and of
two tensor-parallel ranks (pipeline x tensor). Parameters keep the whole model's names."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness

transformers = pytest.importorskip("transformers")

VOCAB = 101


def _tiny(kind: str, **extra) -> transformers.PreTrainedModel:
    """A 4-layer model of ``kind`` (4 query heads, 2 key/value heads, uneven MLP blocks), in fp64."""
    config = transformers.AutoConfig.for_model(
        kind, vocab_size=VOCAB, hidden_size=64, intermediate_size=90, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).double()


def _placements(layout: str) -> tuple[list[tpf.Placement], object]:
    world = dist.get_world_size()
    if layout == "one rank a stage":
        return [tpf.placement("cpu", [k]) for k in range(world)], None
    if layout == "two stages a rank":
        return [tpf.placement("cpu", [k % world]) for k in range(2 * world)], None
    halves = [list(range(world // 2)), list(range(world // 2, world))]  # pipeline x tensor
    if layout == "tensor-parallel stages":
        return [tpf.placement("cpu", halves[k]) for k in range(2)], "auto"
    return [tpf.placement("cpu", halves[k % 2]) for k in range(4)], "auto"  # interleaved, tensor parallel


def _masked(ids: torch.Tensor) -> torch.Tensor:
    """Labels as a supervised fine-tune masks them (-100), unevenly: prompts of different lengths, a span in the
    middle, a row fully masked, and a row labelled only at its first token, which the causal shift drops; with
    8 rows in 4 micro-batches, micro-batch 1 (rows 2-3) has no labelled token left."""
    labels = ids.clone()
    for row, masked in ((0, slice(0, 3)), (1, slice(0, 7)), (2, slice(None)), (3, slice(1, None)), (4, slice(5, 9)),
                        (5, slice(None)), (6, slice(0, 10))):
        labels[row, masked] = -100
    return labels


def _pipeline_against_one_device(kind: str, layout: str, schedule: str):
    extra = {"tie_word_embeddings": False} if kind == "gemma2" else {}
    lm = _tiny(kind, **extra)
    ref = copy.deepcopy(lm)
    names = [n for n, _ in lm.named_parameters()]
    placements, plan = _placements(layout)
    stages = tpf.pipeline.cut(lm, placements, plan=plan)
    pipe = tpf.Pipeline(stages, micro_batches=4, schedule=schedule, loss_fn=tpf.pipeline.causal_lm_loss(ref))
    ids = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(1))
    opt, opt_ref = torch.optim.SGD(pipe.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    losses = []
    for _ in range(2):
        loss = pipe.step(ids, ids)
        ref_loss = ref(ids, labels=ids).loss
        ref_loss.backward()
        if loss is not None:  # HF's loss is fp32 (logits.float()): micro-batches round it apart by ~1e-7
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-6, atol=1e-6, msg=f"{kind}: loss")
            losses.append(loss.item())
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    # prompt-masked labels: the mean over the batch's labelled tokens (after the shift), as one device takes it;
    # eps: a near-zero gradient's rounding (HF's loss is fp32) must not become a whole lr-sized step
    labels = _masked(ids)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    for _ in range(2):
        loss = pipe.step(ids, labels)
        ref_loss = ref(ids, labels=labels).loss
        ref_loss.backward()
        if loss is not None:
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-6, atol=1e-6, msg=f"{kind}: masked loss")
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    held, checked = dict(ref.named_parameters()), []
    for st in pipe.stages:
        for name, p in st.module.model.named_parameters():
            assert name in names, f"{kind}: {name} is not one of the model's own names"
            if dist.get_rank() in tpf.get_placement(p):
                torch.testing.assert_close(p.full_tensor(), held[name], rtol=1e-6, atol=1e-6,
                                           msg=f"{kind}: {name} after AdamW")
                checked.append(name)
    return sorted(set(checked)), losses


CASES = [("llama", "one rank a stage", "1f1b", 2), ("qwen2", "two stages a rank", "interleaved", 2),
         ("gemma2", "one rank a stage", "zb-h1", 2), ("llama", "tensor-parallel stages", "gpipe", 4),
         ("qwen3", "tensor-parallel stages", "zb-h1", 4), ("mistral", "interleaved tensor-parallel", "interleaved", 4)]


@pytest.mark.parametrize("kind, layout, schedule, world", CASES, ids=[f"{c[0]}-{c[2]}-w{c[3]}" for c in CASES])
def test_causal_lm_pipeline_matches_one_device(kind, layout, schedule, world):
    results = harness.run(world, _pipeline_against_one_device, kind, layout, schedule)
    every = sorted(set().union(*(set(names) for names, _ in results)))
    assert every == sorted(n for n, _ in _tiny(kind, **({"tie_word_embeddings": False} if kind == "gemma2" else {}))
                           .named_parameters()), "every parameter lives on some stage and was checked"
    last_stage_ranks = world // 2 if "tensor" in layout else 1
    assert sum(bool(losses) for _, losses in results) == last_stage_ranks
    assert all(losses[1] < losses[0] for _, losses in results if losses)  # it trains


def _tied_head_refused():
    lm = _tiny("gemma2")
    with pytest.raises(ValueError, match="ties its head to its input embedding"):
        tpf.pipeline.cut(lm, [tpf.placement("cpu", [0]), tpf.placement("cpu", [1])])
    return True


def test_a_tied_head_on_another_stage_is_refused():
    assert all(harness.run(2, _tied_head_refused))
