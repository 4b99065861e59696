import os

import torch

# read when tpflow is imported: on CPU the Triton kernels run through the interpreter; on a GPU the
# tests compile one tile config instead of autotuning every shape they try
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TPFLOW_AUTOTUNE", "0")
# a Python process the tests start (the launcher's ranks, the scripts) prints every thread's stack if a signal kills it
# (a segfault, a heap corruption's abort), into the output the failing test reports; the pool's ranks keep theirs in
# a file the harness reports (tests/harness.py)
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

import pytest

from tests import harness


@pytest.fixture(scope="session", autouse=True)
def _process_pools():
    yield
    harness.shutdown()


EXAMPLES = {  # each seed scenario and the ranks it runs on under the launcher
    "data_parallel.py": 2,
    "model_parallel.py": 2,
    "pipeline_two_stage.py": 2,
    "hybrid_module_model.py": 4,
    "data_parallel_training.py": 2,
    "hybrid_mlp_digits.py": 2,
    "pipeline_lenet.py": 2,
    "pipeline_module_model.py": 4,
}
PIPELINES = {"pipeline_lenet.py", "pipeline_module_model.py"}  # a rank per stage: no one-process run
FINETUNE = "examples/finetune_hf.py"  # compares its runs with each other


class Launches:
    """The suite's few runs of many scripts (``harness.run_scripts``): the examples and benchmark scripts as one
    plain process, then on 2 and on 4 ranks, each run once, when a test first asks for it. A command's own
    temporary folders come from ``folder``."""

    def __init__(self, tmp) -> None:
        self.tmp, self.runs = tmp, {}

    def folder(self, name: str):
        return self.tmp / name

    def commands(self, nproc: int | None) -> list[str]:
        examples = [f"examples/{name}" for name, n in EXAMPLES.items() if n == nproc]
        if nproc is None:
            return [f"benchmarks/loading_cpu.py --prepare {self.folder('model')} --vocab 64 --hidden 128 --ffn 64 "
                    "--layers 1", *(f"examples/{name}" for name in EXAMPLES if name not in PIPELINES),
                    *(f"examples/{name}" for name in sorted(PIPELINES)), FINETUNE]
        if nproc == 2:
            return [*examples,
                    f"benchmarks/layers_cpu.py --dim 32 --hidden 64 --tokens 16 --reps 1 --out {self.folder('layers')}",
                    f"benchmarks/collective_cpu.py gloo --size 64 --reps 1 --out {self.folder('collectives')}",
                    f"benchmarks/vocab_cpu.py --vocab 101 --tokens 16 --hidden 8 --chunk 4 --reps 1 --out "
                    f"{self.folder('vocab')}",
                    f"benchmarks/rl_cpu.py --vocab 101 --tokens 16 --hidden 8 --chunk 4 --reps 1 --out "
                    f"{self.folder('rl')}",
                    f"benchmarks/rl_weights_cpu.py --hidden 96 --layers 1 --vocab 101 --bucket-mib 1 --reps 1 --out "
                    f"{self.folder('rl-weights')}",
                    f"benchmarks/loading_cpu.py --dir {self.folder('model')} --out {self.folder('loading')}",
                    f"benchmarks/context_cpu.py train --tokens 32 --hidden 16 --layers 1 --reps 1 --out "
                    f"{self.folder('context')}",
                    f"benchmarks/context_cpu.py overlap --tokens 64 --reps 1 --out {self.folder('context-overlap')}",
                    f"benchmarks/context_cpu.py packed --tokens 64 --window 8 --hidden 16 --layers 1 --reps 1 --out "
                    f"{self.folder('context-packed')}",
                    f"benchmarks/decode_cpu.py --batch 2 --new-tokens 2 --reps 1 --vocab 64 --hidden 32 --layers 1 "
                    f"--out {self.folder('decode')}",
                    f"benchmarks/shm_cpu.py --reps 10 --out {self.folder('shm')}",
                    f"benchmarks/heap_cpu.py --iterations 3 --out {self.folder('heap')}",
                    f"benchmarks/trainer_cpu.py --rounds 1 --steps 2 --batch 2 --seq 8 --vocab 64 --hidden 32 "
                    f"--layers 1 --out {self.folder('trainer')}",
                    f"benchmarks/lora_cpu.py --rounds 1 --steps 2 --batch 2 --seq 16 --vocab 512 --layers 1 --rank 4 "
                    f"--targets q_proj,up_proj --out {self.folder('lora')}",
                    f"benchmarks/loaded_cpu.py --busy 1 --reps 1 --new-tokens 2 --batch 1 --seq 8 --vocab 64 "
                    f"--hidden 32 --layers 1 --out {self.folder('loaded')}",
                    f"benchmarks/profile_cpu.py --tiny --out {self.folder('profile')}",
                    f"benchmarks/aspects_cpu.py --rounds 2 --warmup 1 --inside 2 --dim 32 --layers 1 --tokens 32 "
                    f"--seq 8 --out {self.folder('aspects')}",
                    f"{FINETUNE} --checkpoint {self.folder('checkpoint')}"]
        return [*examples, f"{FINETUNE} --dp 2 --tp 2 --fsdp --checkpoint {self.folder('checkpoint-fsdp')}",
                f"{FINETUNE} --dp 2 --resume {self.folder('checkpoint')}",
                f"benchmarks/pipeline_cpu.py --reps 1 --forward-ms 1 --dim 8 --rows 2 --out {self.folder('pipeline')}",
                f"benchmarks/checks_cpu.py --hidden 32 --layers 2 --vocab 64 --seq 8 --reps 1 --out "
                f"{self.folder('checks')}"]

    def get(self, nproc: int | None) -> tuple[dict, str]:
        """Each command's ``harness.Ran`` and the run's stderr, for the plain process (None) or ``nproc`` ranks."""
        if nproc == 2:
            self.get(None)  # the loading benchmark's model is prepared there
        if nproc == 4:
            self.get(2)  # the 2-rank fine-tune's checkpoint resumes on 4 ranks
        if nproc not in self.runs:
            try:
                self.runs[nproc] = harness.run_scripts(self.commands(nproc), nproc)
            except AssertionError as e:  # every test that asks again fails at once, with the run's error
                self.runs[nproc] = e
        if isinstance(self.runs[nproc], AssertionError):
            raise self.runs[nproc]
        return self.runs[nproc]


@pytest.fixture(scope="session")
def launches(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory.mktemp("launches"))
