"""Faults and misuse that must give one device's numbers or a clear error on every rank, never a silently wrong
model nor a hang (issue 42's matrix): checkpoints that differ between ranks, a folder holding a single file and an
index, corrupt and truncated files."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tpflow as tpf
from tests import harness
from tests.checks import all_ranks, within

safetensors = pytest.importorskip("safetensors.torch")


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))


def _shared_folder() -> str:
    """A temporary folder rank 0 makes, the same on every rank."""
    holder = [tempfile.mkdtemp(prefix="tpflow-misuse-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _checkpoints_rank() -> None:
    folder = _shared_folder()
    try:
        states = {}
        for name, seed in (("good", 0), ("stale", 1)):
            torch.manual_seed(seed)
            states[name] = _model().state_dict()
            if dist.get_rank() == 0:
                os.makedirs(os.path.join(folder, name))
                safetensors.save_file(states[name], os.path.join(folder, name, "model.safetensors"))
        # a folder with both a single file (the good values) and an index of shards (the stale ones)
        both = os.path.join(folder, "both")
        if dist.get_rank() == 0:
            os.makedirs(both)
            safetensors.save_file(states["good"], os.path.join(both, "model.safetensors"))
            safetensors.save_file(states["stale"], os.path.join(both, "model-00001-of-00001.safetensors"))
            with open(os.path.join(both, "model.safetensors.index.json"), "w") as f:
                json.dump({"weight_map": dict.fromkeys(states["stale"], "model-00001-of-00001.safetensors")}, f)
            truncated = os.path.join(folder, "truncated.safetensors")
            shutil.copy(os.path.join(folder, "good", "model.safetensors"), truncated)
            with open(truncated, "r+b") as f:
                f.truncate(os.path.getsize(truncated) - 40)
        dist.barrier()
        placement = all_ranks()
        with within(30):
            model = tpf.parallelize(_model(), placement=placement, plan={"0": "column", "2": "row"})
            tpf.load_safetensors(model, os.path.join(folder, "good"))
            mine = "stale" if dist.get_rank() == 1 else "good"  # a node's stale copy
            with pytest.raises(ValueError, match=r"load_safetensors: the ranks disagree on the file model.safetensors "
                                                 r"\(ranks? 0[0-9, ]*: .*; rank 1: .*\)"):
                tpf.load_safetensors(model, os.path.join(folder, mine))

            model = tpf.parallelize(_model(), placement=placement, plan={"0": "column", "2": "row"})
            tpf.load_safetensors(model, both)  # from_pretrained's choice: the single file
            for key, value in states["good"].items():
                torch.testing.assert_close(model.state_dict()[key].full_tensor(), value, rtol=0, atol=0)

            with pytest.raises(ValueError, match=r"truncated.safetensors .*(corrupt or truncated)"):
                tpf.load_safetensors(model, os.path.join(folder, "truncated.safetensors"))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder)


def _dtypes_rank() -> None:
    model = _model().to(torch.float64 if dist.get_rank() == 1 else torch.float32)
    with within(30), pytest.raises(ValueError, match=r"the ranks disagree on the model's dtypes \(ranks? 0[0-9, ]*: "
                                                     r"torch.float32; rank 1: torch.float64\)"):
        tpf.parallelize(model, placement=all_ranks(), plan={"0": "column", "2": "row"})


def _sampling_rank() -> None:
    """Ranks seeded apart sample the same tokens, rank 0's one device's under its seed, on every call (the second
    too), with the vocabulary split or the head gathering whole logits; every rank's random state ends where one
    device's does (what the caller draws next, TRL's shuffle, is alike)."""
    from tests.models import tiny_lm

    prompt = torch.tensor([[5, 17, 3, 42]])
    reference = tiny_lm("llama")
    torch.manual_seed(1000)
    want = [reference.generate(prompt, do_sample=True, max_new_tokens=6, pad_token_id=0) for _ in range(2)]
    after = torch.get_rng_state()
    for vocab_parallel in (True, False):
        model = tpf.parallelize(copy.deepcopy(reference), placement=all_ranks(),
                                plan=tpf.hf_plan(reference, vocab_parallel=vocab_parallel))
        torch.manual_seed(1000 + dist.get_rank())  # the DDP habit
        with within(60):
            got = [model.generate(prompt, do_sample=True, max_new_tokens=6, pad_token_id=0) for _ in range(2)]
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, [g.tolist() for g in got])
        assert all(e == every[0] for e in every), f"the ranks sampled apart: {every}"
        assert torch.equal(torch.get_rng_state(), after), "the random state did not end where one device's does"
        if dist.get_rank() == 0:
            assert [g.tolist() for g in got] == [w.tolist() for w in want], (got, want)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_seeded_apart_sample_the_same_tokens(world):
    pytest.importorskip("transformers")
    harness.run(world, _sampling_rank)


def _cast_after_parallelize_rank() -> None:
    """A model parallelized on a named placement casts (it failed: a weak reference kept its parameters from being
    swapped), still refuses its first forward without FSDP2, and runs once sharded."""
    from torch.distributed.fsdp import fully_shard

    placement = tpf.placement("cpu", [[r] for r in range(dist.get_world_size())], names=("dp", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    tpf.parallelize(model, placement=placement, plan={"0": "vocab", "1": "column", "3": "row"})
    with within(30):
        model.to(torch.float64)
        assert all(p.dtype == torch.float64 for p in model.parameters())
        with pytest.raises(RuntimeError, match="not sharded by FSDP2"):
            model(torch.tensor([[1, 2]]))
        fully_shard(model, mesh=placement.mesh["dp"])
        assert model(torch.tensor([[1, 2]])).dtype == torch.float64


@pytest.mark.parametrize("world", [2, 4])
def test_a_model_casts_after_parallelize_on_a_named_placement(world):
    harness.run(world, _cast_after_parallelize_rank)


def _unsynced_decoding_rank() -> None:
    from tests.models import tiny_moe

    placement = tpf.placement("cpu", [[r] for r in range(dist.get_world_size())], names=("dp", "tp"))
    ref = tiny_moe("qwen3_moe", layers=1)
    model = tpf.parallelize(ref, placement=placement, plan=tpf.hf_plan(ref, expert_parallel="dp"))
    with within(30), pytest.raises(ValueError, match="synced_gpus=False"):
        model.generate(torch.tensor([[1, 2, 3]]), synced_gpus=False, max_new_tokens=2, pad_token_id=0)


@pytest.mark.parametrize("world", [2, 4])
def test_decoding_that_would_leave_ranks_waiting_is_refused(world):
    pytest.importorskip("transformers")
    harness.run(world, _unsynced_decoding_rank)


def _dropout_rank() -> None:
    """Phi-3 with dropout in training: ranks seeded apart are refused at the first forward, on every rank; ranks
    seeded alike draw one device's masks (dropout sits where every rank holds the whole activation), so two AdamW steps
    give one device's losses and parameters, and the replicas stay bit for bit alike."""
    from tests.models import VOCAB, tiny_lm, train_lm

    first = tiny_lm("phi3", resid_pdrop=0.1, embd_pdrop=0.1, pad_token_id=0)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    model = tpf.parallelize(copy.deepcopy(first), placement=all_ranks(), plan="auto").train()
    torch.manual_seed(1000 + dist.get_rank())  # the DDP habit
    with within(30), pytest.raises(ValueError, match="draw different random numbers"):
        model(ids, labels=ids)
    reference = copy.deepcopy(first).train()
    model = tpf.parallelize(copy.deepcopy(first), placement=all_ranks(), plan="auto").train()
    torch.manual_seed(7)
    want = train_lm(reference, ids)
    torch.manual_seed(7)
    with within(60):
        got = train_lm(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-6, atol=1e-7, msg=name)
    tpf.check_replicas(model)


@pytest.mark.parametrize("world", [2, 4])
def test_dropout_draws_alike_on_the_tensor_parallel_ranks_or_stops(world):
    pytest.importorskip("transformers")
    harness.run(world, _dropout_rank)


def _split_streams_rank() -> None:
    """Dropout on a rank's block of features (between a column and a row layer, split unevenly) draws masks of its own
    on each rank, seeded alike: the blocks' masks differ, the shared stream is left where it was, so the dropout on the
    whole output after the row layer drops the same values on every rank; under activation checkpointing the
    recomputed masks are the forward's (the gradients equal those without it). Then a Llama whose attention
    probabilities drop out trains with equal losses and replicas on every rank."""
    from torch.utils.checkpoint import checkpoint

    from tests.models import VOCAB, tiny_lm, train_lm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 63), nn.Dropout(0.5), nn.Linear(63, 16), nn.Dropout(0.5)).double()
    tpf.parallelize(model, placement=all_ranks(), plan={"0": "column", "2": "row"})
    blocks: list[torch.Tensor] = []
    model[2].register_forward_pre_hook(lambda m, args: blocks.append(args[0].detach().clone()))
    x = torch.ones(8, 4, dtype=torch.float64)
    every: list = [None] * dist.get_world_size()
    grads = []
    for recompute in (False, True):
        torch.manual_seed(5)
        with within(30):
            out = checkpoint(model, x, use_reentrant=False) if recompute else model(x)
            out.sum().backward()
        dist.all_gather_object(every, (out.tolist(), torch.get_rng_state().tolist(), (blocks[-1] == 0).tolist()))
        assert all(e[:2] == every[0][:2] for e in every), "the whole output or the shared stream differs by rank"
        masks = [e[2] for e in every]
        assert all(masks[r][:31] != masks[0][:31] for r in range(1, len(masks))), "the blocks drew one pattern"
        grads.append([p.grad.full_tensor().clone() for p in model.parameters()])
        model.zero_grad()
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)

    lm = tiny_lm("llama", attention_dropout=0.3, attn_implementation="eager")
    lm = tpf.parallelize(lm, placement=all_ranks(), plan="auto").train()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(7)
    with within(60):
        losses = train_lm(lm, ids, steps=3)
    dist.all_gather_object(every, losses)
    assert all(e == every[0] for e in every), every
    tpf.check_replicas(lm)


@pytest.mark.parametrize("world", [2, 4])
def test_split_regions_draw_their_own_masks_and_the_shared_stream_stays_alike(world):
    pytest.importorskip("transformers")
    harness.run(world, _split_streams_rank)


def _drift_rank() -> None:
    """Phi-3 with dropout, seeded alike, trains as one device; one more ``torch.rand`` on rank 0 after two steps (its
    random state drifts off) stops the next step on every rank, naming the drift; a rank left in ``model.eval()`` is
    named as such (not as other inputs, and with no abort of the collectives); seeded alike again and all in training,
    the ranks step on as one device does."""
    from tests.models import VOCAB, tiny_lm

    first = tiny_lm("phi3", resid_pdrop=0.1, embd_pdrop=0.1, pad_token_id=0)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))

    def steps(model: nn.Module, opt: torch.optim.Optimizer, count: int) -> list[float]:
        losses = []
        for _ in range(count):
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    reference = copy.deepcopy(first).train()
    model = tpf.parallelize(copy.deepcopy(first), placement=all_ranks(), plan="auto").train()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4) for m in (reference, model)]
    torch.manual_seed(7)
    want = steps(reference, opts[0], 2)
    torch.manual_seed(11)
    want += steps(reference, opts[0], 1)
    torch.manual_seed(7)
    with within(60):
        got = steps(model, opts[1], 2)
    if dist.get_rank() == 0:
        torch.rand(1)  # a draw the other ranks do not make
    with within(), pytest.raises(ValueError, match=r"draw different random numbers: their random states drifted apart "
                                                   r"after 2 checked calls"):
        steps(model, opts[1], 1)
    torch.manual_seed(11)
    if dist.get_rank() == dist.get_world_size() - 1:
        model.eval()
    expected = rf"run 'model.embed_tokens' in different modes: ranks \[0[0-9, ]*\] are training \(model.train\(\)\), " \
               rf"ranks \[{dist.get_world_size() - 1}\] evaluating \(model.eval\(\)\)"
    with within(), pytest.raises(ValueError, match=expected):
        steps(model, opts[1], 1)
    model.train()
    with within(60):
        got += steps(model, opts[1], 1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6, msg=name)  # Adam's steps, unclipped
    tpf.check_replicas(model)


def test_random_states_that_drift_apart_or_a_rank_in_eval_mode_stop_every_rank():
    pytest.importorskip("transformers")
    harness.run(2, _drift_rank)


class _Wrapped(nn.Module):
    """A Hugging Face model inside a module of the user's, which has no config of its own."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids, labels=ids).loss


def _per_step_rank() -> None:
    """What a parallelized model does on every call is absent where it does not apply. A Llama without dropout reads
    no random state (no random streams, no random states compared) and exchanges no digest after the first call of
    its batch's shape; with dropout (inside a module of the user's, whose config is the model's) it reads its random
    state and exchanges one digest a training step, through shared memory between CPU ranks, not gloo, and its ranks
    train alike. Either way the model's call reads its replicated parameters (its norms) once, not once a norm call."""
    from unittest import mock

    from tests.models import VOCAB, tiny_lm
    from tpflow.comm import shm
    from tpflow.global_tensor.local_blocks import LocalBlocks

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))

    def replicated(params) -> bool:
        return all(all(pl.is_replicate() for pl in p.placements) for p in params)

    def per_step(model: nn.Module, steps: int = 3) -> list[tuple[int, int, int, int]]:
        """Each step's random-state reads, digests exchanged through shared memory and through gloo, and reads of
        the replicated parameters."""
        opt, found = torch.optim.SGD(model.parameters(), lr=1e-2), []
        reads, read = [], LocalBlocks.__call__
        with mock.patch.object(torch, "get_rng_state", wraps=torch.get_rng_state) as states, \
                mock.patch.object(shm.HostGroup, "all_gather", autospec=True,
                                  side_effect=shm.HostGroup.all_gather) as shared, \
                mock.patch.object(dist, "all_gather", wraps=dist.all_gather) as gloo, \
                mock.patch.object(LocalBlocks, "__call__", autospec=True,
                                  side_effect=lambda blocks, params, *rest, **kw: reads.append(replicated(params))
                                  or read(blocks, params, *rest, **kw)):
            for _ in range(steps):
                before = states.call_count, shared.call_count, gloo.call_count
                reads.clear()
                model(ids).backward()
                opt.step()
                opt.zero_grad()
                found.append((states.call_count - before[0], shared.call_count - before[1],
                              gloo.call_count - before[2], sum(reads)))
        return found

    plain = tpf.parallelize(_Wrapped(tiny_lm("llama")), placement=all_ranks(), plan="auto").train()
    with within(60):
        found = per_step(plain)
    assert found == [(0, 1, 0, 1), (0, 0, 0, 1), (0, 0, 0, 1)], found
    dropped = tpf.parallelize(_Wrapped(tiny_lm("llama", attention_dropout=0.3)), placement=all_ranks(),
                              plan="auto").train()
    torch.manual_seed(7)
    with within(60):
        found = per_step(dropped)
    assert all(s > 0 and (exchanged, gloo, reads) == (1, 0, 1) for s, exchanged, gloo, reads in found), found
    tpf.check_replicas(dropped)  # the copies of every replicated parameter stayed alike


def test_aspects_that_do_not_apply_cost_nothing_per_step():
    pytest.importorskip("transformers")
    harness.run(2, _per_step_rank)


@pytest.mark.parametrize("world", [2, 4])
def test_a_model_of_another_dtype_on_one_rank_is_named_as_such(world):
    harness.run(world, _dtypes_rank)


def _torn_saves_rank() -> None:
    """A dcp save that fails on one rank leaves the earlier checkpoint whole at its path, on every rank; its staging
    folder, and a safetensors folder holding the marker, are refused as incomplete; save_pretrained into a folder
    keeps the files it does not write."""
    import torch.distributed.checkpoint as dcp

    folder = _shared_folder()
    try:
        path = os.path.join(folder, "step")
        model = tpf.parallelize(_model(), placement=all_ranks(), plan={"0": "column", "2": "row"})
        first = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        with within(30):
            with tpf.checkpoint.atomic_folder(path) as staging:
                dcp.save(model.state_dict(), checkpoint_id=staging)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            with pytest.raises((RuntimeError, OSError), match="killed|failed on rank 1"), \
                    tpf.checkpoint.atomic_folder(path) as staging:
                dcp.save(model.state_dict(), checkpoint_id=staging)
                if dist.get_rank() == 1:
                    raise OSError("killed half way")
            tpf.checkpoint.check_complete(path)
            dcp.load(state := model.state_dict(), checkpoint_id=path)
            for key, value in state.items():
                torch.testing.assert_close(value.full_tensor(), first[key], rtol=0, atol=0, msg=key)
            with pytest.raises(ValueError, match="incomplete checkpoint"):
                tpf.checkpoint.check_complete(staging)
            if dist.get_rank() == 0:
                safetensors.save_file({k: v for k, v in first.items()}, os.path.join(staging, "model.safetensors"))
            dist.barrier()
            with pytest.raises(ValueError, match="incomplete checkpoint"):
                tpf.load_safetensors(model, staging)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder)


def _save_pretrained_keeps_others_rank() -> None:
    from tests.models import tiny_lm

    folder = _shared_folder()
    try:
        model = tpf.parallelize(tiny_lm("llama"), placement=all_ranks(), plan="auto")
        if dist.get_rank() == 0:
            with open(os.path.join(folder, "tokenizer.json"), "w") as f:
                f.write("{}")
        dist.barrier()
        with within(60):
            model.save_pretrained(folder)
            model.save_pretrained(folder)  # again, over the first
        assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json", "model.safetensors",
                                              "tokenizer.json"], os.listdir(folder)
        assert not os.path.exists(folder + ".incomplete") and not os.path.exists(folder + ".old")
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder)


@pytest.mark.parametrize("world", [2, 4])
def test_saves_cannot_tear(world):
    harness.run(world, _torn_saves_rank)
    pytest.importorskip("transformers")
    harness.run(world, _save_pretrained_keeps_others_rank)


@pytest.mark.parametrize("world", [2, 4])
def test_checkpoints_that_differ_between_ranks_or_are_torn_are_refused(world):
    harness.run(world, _checkpoints_rank)


def _context_inputs_rank() -> None:
    """A soft prompt and a projector (plain modules) before a context-parallel model train as on one device: the
    gradient of inputs_embeds reaches every rank whole; made from the model's own (global) embedding and a plain
    projector at once, it is refused."""
    from tests.models import VOCAB, tiny_lm

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    for kind in ("ring", "ulysses"):
        reference = tiny_lm("llama")
        torch.manual_seed(5)
        prompt = nn.Parameter(torch.randn(1, 4, 64, dtype=torch.float64))
        projector = nn.Linear(64, 64).double()
        ref_prompt, ref_projector = copy.deepcopy(prompt), copy.deepcopy(projector)
        embedding = copy.deepcopy(reference.get_input_embeddings())  # a plain copy, outside the model
        model = tpf.parallelize(copy.deepcopy(reference), placement=all_ranks(),
                                plan=tpf.hf_plan(reference, context_parallel=kind))

        def embeds(table, soft, project):
            return project(torch.cat([soft.expand(ids.shape[0], -1, -1), table(ids)], dim=1))

        labels = torch.cat([torch.full((ids.shape[0], 4), -100), ids], dim=1)
        with within(60):
            loss = model(inputs_embeds=embeds(embedding, prompt, projector), labels=labels).loss
            loss.backward()
        want = reference(inputs_embeds=embeds(embedding, ref_prompt, ref_projector), labels=labels).loss
        want.backward()
        torch.testing.assert_close(loss, want.float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(prompt.grad, ref_prompt.grad, rtol=1e-6, atol=1e-9, msg=f"{kind}: the prompt")
        torch.testing.assert_close(projector.weight.grad, ref_projector.weight.grad, rtol=1e-6, atol=1e-9,
                                   msg=f"{kind}: the projector")
        with within(30), pytest.raises(ValueError, match="global parameters and from"):
            longer = torch.cat([ids[:, :4], ids], dim=1)  # 16 tokens: a multiple of 2W on 2 and 4 ranks
            model(inputs_embeds=projector(model.get_input_embeddings()(longer)), labels=longer)


@pytest.mark.parametrize("world", [2, 4])
def test_plain_modules_before_a_context_parallel_model_get_whole_gradients(world):
    pytest.importorskip("transformers")
    harness.run(world, _context_inputs_rank)


def _launch(tmp_path, world: int, source: str, **env: str) -> str:
    """Run ``source`` under ``tpflow.launch`` on ``world`` ranks, which must fail within 60 s; its stderr."""
    script = tmp_path / "fault.py"
    script.write_text(textwrap.dedent(source))
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "tpflow.launch", "--nproc_per_node", str(world), str(script)],
                          env={**clean, "PYTHONPATH": str(harness.ROOT), **env}, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    return done.stderr


@pytest.mark.parametrize("world", [4])  # (4 ranks, where more can go wrong than at 2: the suite's time spared)
def test_a_collective_that_times_out_names_the_rank_it_waited_for(tmp_path, world):
    """The last rank stalls before a collective (gloo's path, the shared-memory one off): a rank's error names it and
    the cause, where gloo's says only 'Timed out waiting 4000ms'. On 4 ranks rank 1 comes a second late, so the
    others' timeouts close its connections before its own runs out: it names the last rank too."""
    err = _launch(tmp_path, world, """
        import time
        import torch
        import tpflow as tpf
        P = tpf.placement("cpu", ranks=list(range(tpf.get_world_size())))
        layer = tpf.ColumnParallelLinear(8, 16, placement=P, sequence_parallel=True, algo="ring")
        x = torch.randn(4, 2, 8)
        layer(x)                        # every group set up
        if tpf.get_rank() == tpf.get_world_size() - 1:
            time.sleep(60)              # stalls: the others wait in the next collective
        if tpf.get_rank() == 1 and tpf.get_world_size() > 2:
            time.sleep(1)               # hears "connection closed" from the ranks that timed out
        layer(x)
    """, TPFLOW_TIMEOUT="4", TPFLOW_CPU_SHARED_MEMORY="0")
    assert f"waited for rank {world - 1} longer than the timeout switch's 4 s" in err, err[-3000:]
    assert err.count("tpflow.launch: rank") >= 1 and "raised this error" in err, err[-3000:]


@pytest.mark.parametrize("world", [4])  # (4 ranks, where more can go wrong than at 2: the suite's time spared)
def test_data_parallel_ranks_running_different_step_counts_are_named(tmp_path, world):
    """Rank 0 leaves its loop a step before the others: the launcher says it left early, first, whichever
    transport the others wait on."""
    for shared in ("1", "0"):
        err = _launch(tmp_path, world, """
            import torch
            import tpflow as tpf
            P = tpf.placement("cpu", list(range(tpf.get_world_size())))
            model = tpf.to_global(torch.nn.Linear(3, 2), placement=P)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(2 + (tpf.get_rank() > 0)):
                model(tpf.to_global(torch.randn(2, 3), placement=P, sbp=tpf.sbp.split(0))).sum().backward()
                opt.step()
                opt.zero_grad()
        """, TPFLOW_CPU_SHARED_MEMORY=shared)
        assert err.startswith("tpflow.launch: rank 0 left early: it finished its script while the other ranks went "
                              "on"), err[-3000:]


@pytest.mark.parametrize("world", [4])  # (4 ranks, where more can go wrong than at 2: the suite's time spared)
def test_fully_shard_skipped_on_one_rank_is_named(tmp_path, world):
    """One rank forgets ``fully_shard`` on a named placement: its first forward says what to call, and the launcher
    reports that first, not the gloo error its peers then see."""
    err = _launch(tmp_path, world, """
        import torch
        from torch.distributed.fsdp import fully_shard
        import tpflow as tpf
        W = tpf.get_world_size()
        P = tpf.placement("cpu", ranks=[[0, 1], [2, 3]] if W == 4 else [[0], [1]], names=("dp", "tp"))
        model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        tpf.parallelize(model, placement=P, plan={"1": "column", "2": "row"})
        if tpf.get_rank() != W - 1:
            fully_shard(model, mesh=P.mesh["dp"])
        model(torch.tensor([[1, 2, 3]])).sum().backward()
    """)
    first = next(line for line in err.splitlines() if line.startswith("tpflow.launch:"))
    assert first == f"tpflow.launch: rank {world - 1} raised this error", err[-3000:]
    assert "are not sharded by FSDP2: call torch.distributed.fsdp.fully_shard(block, mesh=P.mesh[\"dp\"])" in err, \
        err[-3000:]
