"""Fine-tune a Hugging Face causal LM with tensor parallelism by its own plan, checkpoint, resume, generate.

    python -m tpflow.launch --nproc_per_node 2 examples/finetune_hf.py            # a tiny Qwen3, random weights
    python -m tpflow.launch --nproc_per_node 2 examples/finetune_hf.py --model ./my-llama   # a local HF directory
    python examples/finetune_hf.py                                                 # the same run on one device
    python -m tpflow.launch --nproc_per_node 4 examples/finetune_hf.py --dp 2 --tp 2 --fsdp   # FSDP2 x tensor

The text is the source of Python's own standard library, read from disk and cut into byte windows (a
local model directory brings its tokenizer instead). ``tpf.parallelize(model, plan="auto")`` shards the
model's linear layers as its config's plan says; the model's own forward, loss (``labels=``) and
``generate`` run unchanged; torch's AdamW and ``clip_grad_norm_`` take the parameters as on one device.
Halfway, the model and optimizer are saved with ``torch.distributed.checkpoint`` and loaded into a fresh
copy, which trains on: the printed losses are the one-device run's. ``--resume DIR`` starts from a
checkpoint saved by a run on any number of ranks (it is resharded on load). At the end the trained model is
exported with its own ``save_pretrained`` (called on every rank; rank 0 writes whole tensors) and loaded back
on one device with ``from_pretrained``, whose logits are the parallel model's. Folders not named by
``--checkpoint`` / ``--export`` are temporary and removed at the end.

The layout comes from ``--dp`` and ``--tp`` (their product the number of ranks; by default every rank is tensor
parallel). With ``--dp`` above 1 the placement is named and PyTorch's FSDP2 takes its data axes
(``fully_shard`` on each decoder layer and on the model): with ``--fsdp`` it shards the parameters, gradients and
optimizer state over the ``--dp`` ranks (``names=("dp", "tp")``); without, each of them keeps a whole replica
(``("replicate", "shard", "tp")`` with one rank a shard). Each data-parallel rank trains on its own rows of the
batch, and the printed loss is the batch's. The checkpoint resumes on any layout.
"""

from __future__ import annotations

import argparse
import contextlib
import sysconfig
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import tpflow as tpf

STDLIB = ("textwrap.py", "json/decoder.py", "fractions.py", "heapq.py", "bisect.py", "shlex.py")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model directory (default: a tiny Qwen3 with random weights)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint", help="where the halfway checkpoint goes (default: a temporary directory)")
    parser.add_argument("--resume", help="a checkpoint directory to start from, saved after --steps // 2 steps")
    parser.add_argument("--export", help="where save_pretrained writes the trained model (default: a temporary one)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--tp", type=int, help="tensor-parallel ranks (default: the ranks / --dp)")
    parser.add_argument("--fsdp", action="store_true", help="shard the data-parallel replicas with FSDP2")
    args = parser.parse_args()
    world = tpf.get_world_size()
    args.tp = args.tp or world // args.dp
    if args.dp * args.tp != world or args.batch % args.dp:
        parser.error(f"--dp {args.dp} x --tp {args.tp} must be the {world} ranks, and --dp divide --batch "
                     f"{args.batch}")
    return args


def layout(args) -> tuple[tpf.placement, object]:
    """The placement, and the names of its data axes that FSDP2 shards over (None: tensor parallel only)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    grid = torch.arange(args.dp * args.tp).reshape(args.dp, args.tp)
    if args.dp == 1:
        return tpf.placement(device, ranks=grid[0].tolist()), None
    if args.fsdp:
        return tpf.placement(device, ranks=grid.tolist(), names=("dp", "tp")), "dp"
    return tpf.placement(device, ranks=grid[:, None].tolist(), names=("replicate", "shard", "tp")), \
        ("replicate", "shard")


def build(path: str | None):
    """The model (the same on every rank) and a tokenizer: the directory's, or bytes for the tiny model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    if path:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)
    config = AutoConfig.for_model("qwen3", vocab_size=256, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  max_position_embeddings=256, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config), None


def corpus(tokenizer) -> torch.Tensor:
    """The standard library's source as token ids: bytes, or the model's tokenizer."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((root / name).read_text() for name in STDLIB)
    ids = list(text.encode()) if tokenizer is None else tokenizer(text)["input_ids"]
    return torch.tensor(ids)


def batches(ids: torch.Tensor, steps: int, batch: int, seq: int) -> list[torch.Tensor]:
    """The same windows on every rank (a fixed generator), as one device would draw them."""
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, len(ids) - seq, (steps, batch), generator=g)
    return [torch.stack([ids[s:s + seq] for s in row]) for row in starts]


def fresh(args, placement, data):
    """The model parallelized on ``placement`` (and sharded by FSDP2 over its ``data`` axes), and its AdamW."""
    from torch.distributed.fsdp import fully_shard

    model, tokenizer = build(args.model)
    model = tpf.parallelize(model, placement=placement, plan="auto")
    if data is not None:
        for layer in model.model.layers:
            fully_shard(layer, mesh=placement.mesh[data])
        fully_shard(model, mesh=placement.mesh[data])
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01), tokenizer


def train(model, opt, windows, first: int, placement, data) -> None:
    """Each data-parallel rank on its own rows of each batch; the printed loss is the batch's (equal rows)."""
    # the data-parallel ranks: the "dp" axis, or the "replicate" one (its shards are one rank each)
    group = None if data is None else placement.mesh[data if isinstance(data, str) else data[0]].get_group()
    for step, ids in enumerate(windows, start=first):
        if group is not None:
            ids = ids.tensor_split(dist.get_world_size(group))[dist.get_rank(group)]
        loss = model(ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if group is not None:
            dist.all_reduce(loss, group=group)
            loss /= dist.get_world_size(group)
        if tpf.get_rank() == 0:
            print(f"step {step} loss {loss.item():.6f} grad norm {norm.full_tensor().item():.6f}", flush=True)


def shared_folder(path: str | None, stack: contextlib.ExitStack) -> str:
    """``path``, or rank 0's temporary directory (removed when ``stack`` closes): one folder for every rank."""
    if path is None and tpf.get_rank() == 0:
        path = stack.enter_context(tempfile.TemporaryDirectory(prefix="tpflow-finetune-"))
    holder = [path]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]


def export(model, folder: str, prompt: torch.Tensor) -> None:
    """The model's own save_pretrained on every rank, then from_pretrained on one device: the same logits."""
    from transformers import AutoModelForCausalLM

    logits = model(prompt).logits
    logits = logits.full_tensor() if isinstance(logits, torch.distributed.tensor.DTensor) else logits
    model.save_pretrained(folder)  # every rank: they gather the blocks, rank 0 writes
    if tpf.get_rank() == 0:
        one_device = AutoModelForCausalLM.from_pretrained(folder)
        diff = (one_device(prompt.to(one_device.device)).logits - logits.cpu()).abs().max().item()
        print(f"exported to {folder}; from_pretrained on one device: logits within {diff:.1e}", flush=True)
        assert diff < 1e-4, "the exported model computes other logits"
    torch.distributed.barrier()  # rank 0 has read the folder before it may be removed


def main() -> None:
    args = arguments()
    P, data = layout(args)
    model, opt, tokenizer = fresh(args, P, data)
    windows = batches(corpus(tokenizer), args.steps, args.batch, args.seq)
    half = args.steps // 2
    with contextlib.ExitStack() as temporary:
        if args.resume:
            directory = args.resume
        else:
            train(model, opt, windows[:half], 0, P, data)
            directory = shared_folder(args.checkpoint, temporary)
            model_state, opt_state = get_state_dict(model, opt)
            with tpf.checkpoint.atomic_folder(directory) as folder:  # visible at directory once every rank is done
                dcp.save({"model": model_state, "optim": opt_state}, checkpoint_id=folder)
            if tpf.get_rank() == 0:
                print(f"saved to {directory}", flush=True)
        model, opt, tokenizer = fresh(args, P, data)  # a new model and optimizer, filled from the checkpoint
        model_state, opt_state = get_state_dict(model, opt)
        state = {"model": model_state, "optim": opt_state}
        tpf.checkpoint.check_complete(directory)  # a save killed half way is refused, not read as a mixture
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        train(model, opt, windows[half:], half, P, data)
        model.eval()
        prompt = windows[0][:1, :16]
        out = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(prompt))
        new = out[0, prompt.shape[1]:].tolist()
        text = bytes(new).decode(errors="replace") if tokenizer is None else tokenizer.decode(new)
        if tpf.get_rank() == 0:
            print(f"generated {new}", flush=True)
            note = "" if args.model else " (random weights and a few steps: expect spaces and repeats, not Python)"
            print(f"as text {text!r}{note}", flush=True)
        export(model, shared_folder(args.export, temporary), prompt)
        torch.distributed.barrier()  # every rank is done with the folders before rank 0 removes them


if __name__ == "__main__":
    main()
