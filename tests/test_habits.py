"""Habits of many users that must work on a parallelized model as on one device: a module the plan leaves whole
that reads a child's weight without calling the child (``nn.MultiheadAttention``'s ``out_proj``: SigLIP's pooling
head, CLIP-style heads), and two models built from one config object."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tpflow as tpf
from tests import harness
from tests.checks import all_ranks, within


class _Pooled(nn.Module):
    """A split MLP, then an attention pool left whole (it reads ``out_proj.weight`` without calling ``out_proj``)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 22), nn.Linear(22, 8)
        self.pool = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        h = self.down(torch.relu(self.up(x)))
        return self.pool(h, h, h)[0]


def _whole_module_rank() -> None:
    torch.manual_seed(0)
    reference = _Pooled().double()
    model = tpf.parallelize(copy.deepcopy(reference), placement=all_ranks(), plan={"up": "column", "down": "row"})
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with within(30):
        for _ in range(2):
            for m, opt in zip((model, reference), opts):
                m(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-10, atol=1e-12)
    tpf.check_replicas(model)


@pytest.mark.parametrize("world", [2, 4])
def test_a_whole_module_reading_a_childs_weight_trains_as_one_device(world):
    harness.run(world, _whole_module_rank)


def _shared_config_rank() -> None:
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    split = transformers.AutoModelForCausalLM.from_config(config)
    other = transformers.AutoModelForCausalLM.from_config(config)  # the same config object
    before = other.config._attn_implementation
    tpf.parallelize(split, placement=all_ranks(), plan=tpf.hf_plan(split, context_parallel="ring"))
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(dist.get_world_size()))
    with within(30):
        assert other(ids).logits.shape == (1, 8, 64)  # runs as it did: its attention was not switched
        split(ids)
    assert other.config is config and config._attn_implementation == before
    assert split.config is not config and split.model.layers[0].self_attn.config is split.config


@pytest.mark.parametrize("world", [2, 4])
def test_parallelizing_a_model_leaves_another_sharing_its_config_alone(world):
    pytest.importorskip("transformers")
    harness.run(world, _shared_config_rank)


def _torch_save_rank() -> None:
    """torch.save / torch.load of a parallelized model's state_dict (fused q / k / v and gate / up, whose blocks share
    one storage): every rank's blocks come back, and load_state_dict fills another model of the same layout."""
    import io

    from tests.models import tiny_lm

    model = tpf.parallelize(tiny_lm("llama"), placement=all_ranks(), plan="auto")
    assert model.model.layers[0].mlp.up_proj.fused_group is not None  # its block after gate_proj's
    buffer = io.BytesIO()
    with within(30):
        torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    torch.manual_seed(1)
    other = tpf.parallelize(tiny_lm("llama"), placement=all_ranks(), plan="auto")
    with torch.no_grad():
        for p in other.parameters():
            p.to_local().normal_()
    other.load_state_dict(saved)
    for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local()), name
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(other(ids).logits.full_tensor(), model(ids).logits.full_tensor(), rtol=0, atol=0)


@pytest.mark.parametrize("world", [2, 4])
def test_torch_save_and_load_of_a_state_dict_round_trip(world):
    pytest.importorskip("transformers")
    harness.run(world, _torch_save_rank)


def _logits_rank() -> None:
    """The user's own code on split logits: a mistake names the three ways out, and each way works."""
    import torch.nn.functional as F

    from tests.models import VOCAB, tiny_lm

    reference = tiny_lm("llama")
    model = tpf.parallelize(copy.deepcopy(reference), placement=all_ranks(), plan="auto")
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    logits, want = model(ids).logits, reference(ids).logits
    for mistake in (lambda: F.cross_entropy(logits.flatten(0, 1), ids.flatten()),
                    lambda: (logits.argmax(-1) == ids).float().mean()):
        with pytest.raises(RuntimeError, match=r"mixed the model's logits, split over the vocabulary .* "
                                               r"tpf.vocab_parallel_loss\(\).* logits.full_tensor\(\).* "
                                               r"vocab_parallel=False"):
            mistake()
    with tpf.vocab_parallel_loss():
        loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
    torch.testing.assert_close(loss, F.cross_entropy(want.flatten(0, 1), ids.flatten()))
    torch.testing.assert_close((logits.full_tensor().argmax(-1) == ids).float().mean(),
                               (want.argmax(-1) == ids).float().mean())


def test_the_users_own_code_on_split_logits_says_what_to_do():
    pytest.importorskip("transformers")
    harness.run(2, _logits_rank)
