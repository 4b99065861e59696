"""Host memory per rank when loading a checkpoint: built without values and read slice by slice, against the
regular load of the whole model on every rank.

    PYTHONPATH=. python benchmarks/loading_cpu.py --prepare /tmp/tpflow-llama   # once: a Llama, save_pretrained
    python -m tpflow.launch --nproc_per_node W benchmarks/loading_cpu.py --dir /tmp/tpflow-llama

``sharded``: ``with tpf.meta_parameters(): from_config(...)``, ``tpf.parallelize(plan="auto")``,
``tpf.load_safetensors(model, dir)``. ``regular``: ``from_pretrained(dir)`` (the whole model on every rank,
its tensors memory-mapped from the files), then ``tpf.parallelize(plan="auto")``. ``whole``: the generic way,
``from_config`` then ``load_state_dict`` of each file's tensors, then ``parallelize``. Each in the same process,
one after the other (memory given back to the system between them); per rank, the peak anonymous memory (sampled
every millisecond: what the rank holds itself) and the peak resident set (``VmHWM``, which also counts the pages
of the memory-mapped files read), each less what the process held before; the most on any rank. The models'
state dicts are compared bit for bit.
Each run is appended to ``benchmarks/results/loading_<cpu>_<date>.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import pathlib
import threading
import time

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

import tpflow as tpf
from benchmarks.collective_cpu import write
from tpflow.bench.measure import every_rank


def _status() -> dict[str, int]:
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM", "RssAnon")}


class Peak:
    """The peak anonymous memory and resident set over a ``with`` block, less what they were at its start."""

    def __enter__(self) -> Peak:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the system: a reuse would go unseen
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident set starts again here
        self.start = _status()
        self.anon, self.done = self.start["RssAnon"], False
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()
        return self

    def _sample(self) -> None:
        while not self.done:
            self.anon = max(self.anon, _status()["RssAnon"])
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self.done = True
        self.sampler.join()
        end = _status()
        self.anon = max(self.anon, end["RssAnon"]) - self.start["RssAnon"]
        self.resident = end["VmHWM"] - self.start["VmRSS"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def prepare(path: str, args) -> None:
    import transformers

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                      num_key_value_heads=args.hidden // 128, head_dim=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    print(f"saved to {path}")


def run(args) -> None:
    import transformers

    torch.set_num_threads(1)
    world, P = dist.get_world_size(), tpf.placement("cpu", ranks=list(range(dist.get_world_size())))
    config = transformers.AutoConfig.from_pretrained(args.dir)
    with Peak() as sharded:
        with tpf.meta_parameters():
            model = transformers.AutoModelForCausalLM.from_config(config)
        tpf.parallelize(model, placement=P, plan="auto")
        tpf.load_safetensors(model, args.dir)
    mine = {k: _local(v).clone() for k, v in model.state_dict().items()}
    size = sum(p.numel() * p.element_size() for p in model.parameters())  # each tied tensor once
    del model
    with Peak() as regular:
        model = tpf.parallelize(transformers.AutoModelForCausalLM.from_pretrained(args.dir), placement=P, plan="auto")
    same = all(torch.equal(mine[k], _local(v)) for k, v in model.state_dict().items())
    del model
    with Peak() as whole:
        model = transformers.AutoModelForCausalLM.from_config(config)
        for file in sorted(pathlib.Path(args.dir).glob("*.safetensors")):
            model.load_state_dict(load_file(file), strict=False)
        tpf.parallelize(model, placement=P, plan="auto")
    same &= all(torch.equal(mine[k], _local(v)) for k, v in model.state_dict().items())
    stats = every_rank([sharded.anon, sharded.resident, regular.anon, regular.resident, whole.anon, whole.resident,
                        float(same)])
    if dist.get_rank() == 0:
        mib = 2**20
        top = stats.max(0).values.tolist()
        lines = [f"# Loading a checkpoint: {world} CPU rank(s), a Llama of {size / mib:,.0f} MiB (fp32)", "",
                 f"Command: `python -m tpflow.launch --nproc_per_node {world} benchmarks/loading_cpu.py --dir DIR` "
                 f"after `PYTHONPATH=. python benchmarks/loading_cpu.py --prepare DIR --vocab {config.vocab_size} "
                 f"--hidden {config.hidden_size} --ffn {config.intermediate_size} "
                 f"--layers {config.num_hidden_layers}`", "",
                 "| load | peak anonymous MiB per rank | / model | peak resident MiB per rank | / model |",
                 "|---|---|---|---|---|",
                 f"| sharded (meta_parameters, load_safetensors) | {top[0] / mib:,.0f} | {top[0] / size:.3f} | "
                 f"{top[1] / mib:,.0f} | {top[1] / size:.3f} |",
                 f"| regular (from_pretrained, parallelize) | {top[2] / mib:,.0f} | {top[2] / size:.3f} | "
                 f"{top[3] / mib:,.0f} | {top[3] / size:.3f} |",
                 f"| whole (from_config, load_state_dict of the files, parallelize) | {top[4] / mib:,.0f} | "
                 f"{top[4] / size:.3f} | {top[5] / mib:,.0f} | {top[5] / size:.3f} |", "",
                 f"Target 1.25 / W = {1.25 / world:.3f} of the model. State dicts bit-identical on every rank: "
                 f"{bool(stats[:, 6].min())}."]
        print("\n".join(lines))
        print(f"appended to {write('loading', lines, args.out)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", help="save a Llama of the sizes below to this directory, and stop")
    parser.add_argument("--dir", help="the checkpoint to load")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if args.prepare:
        prepare(args.prepare, args)
        return
    tpf.init_distributed()
    run(args)


if __name__ == "__main__":
    main()
