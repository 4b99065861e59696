"""Context parallelism on families whose own code it must meet:

- the decoders of encoder-decoder families run as causal LMs (BART's family, Pegasus, BigBird-Pegasus, Whisper): the
  ``labels=`` loss they compute in their own code (each rank's tokens' mean, made a share of every rank's count), the
  positions their decoders count from zero whatever ``position_ids`` they are given (each rank's tokens given their
  global ones), attention causal by the mask the model makes though its module says otherwise (BigBird-Pegasus');
- models tpflow splits nothing of by heads (BitNet's attention normed over every head, JetMoE's mixture of attention
  heads, Moshi): context parallelism alone on a 1-D placement, a tensor axis beside it refused;
- CTRL, whose feed-forward is an ``nn.Sequential`` of token-wise layers (no token mixer).

Against one device, fp64, the ring or Ulysses (by turns) at 2 and 4 ranks: the logits, the loss, every gradient and
every parameter after two AdamW steps with clipping; an own loss that is not a mean of the tokens' cross-entropy is
refused on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness
from tests.test_context_mixers import SEQ, _same_training

pytest.importorskip("transformers")

TYPES = ["bart", "pegasus", "bigbird_pegasus", "blenderbot-small", "whisper"]
WHOLE = ["bitnet", "jetmoe", "moshi"]  # nothing tpflow splits by heads


def _decoders(kinds: list[str]) -> None:
    """Each of ``kinds`` under the ring or Ulysses over every rank (every other kind the one, the rest the other, the
    other way round at the other world size), trained with labels against one device."""
    from tpflow.models.zoo import tiny_model

    P = tpf.placement("cpu", ranks=list(range(dist.get_world_size())))
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(3))
    labels = ids.masked_fill(torch.arange(SEQ) % 5 == 0, -100)  # (unshifted: these decoders score them as given)
    for i, kind in enumerate(kinds):
        for cut in (("ring", "ulysses")[(i + dist.get_world_size() // 2) % 2],):
            ref = tiny_model(kind)
            model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan=tpf.hf_plan(ref, context_parallel=cut))
            _same_training(model, ref, ids, {"labels": labels}, f"{kind} {cut}")


def test_decoders_with_their_own_loss_and_positions_match_one_device():
    harness.run(2, _decoders, TYPES, timeout=900)
    harness.run(4, _decoders, ["bart", "bigbird_pegasus"], timeout=900)


def test_models_with_nothing_split_by_heads_run_context_parallel_alone():
    harness.run(2, _decoders, [*WHOLE, "ctrl"], timeout=900)
    harness.run(4, _tensor_axis_refused)


def _tensor_axis_refused() -> None:
    from tpflow.models.zoo import tiny_model

    model = tiny_model("bitnet")
    plan = tpf.hf_plan(model, context_parallel="ring")
    with pytest.raises(ValueError, match=r"tpflow splits nothing in BitNetForCausalLM's layers by heads .* its 2 "
                                         r"tensor-parallel ranks would each hold and compute them whole"):
        tpf.parallelize(model, placement=tpf.placement("cpu", [[0, 1], [2, 3]]), plan=plan)
    assert not any(hasattr(p, "placements") for p in model.parameters())  # refused before anything changed


def _other_loss() -> None:
    from transformers import BartForCausalLM

    from tpflow.models.zoo import tiny_config

    class Doubled(BartForCausalLM):  # an own loss that is not the tokens' mean: twice it
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
            out.loss = out.loss * 2
            return out

    model = Doubled(tiny_config("bart")).double()
    model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]),
                            plan=tpf.hf_plan(model, context_parallel="ring"))
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"Doubled computes its labels= loss in its own code, and it is not the mean "
                                         r"of its tokens' cross-entropy"):
        model(ids, labels=ids)


def test_an_own_loss_that_is_not_a_mean_is_refused_on_every_rank():
    harness.run(2, _other_loss)
