"""Several scripts in one process per rank, one after another, each as ``python SCRIPT ARGS...`` would run it
(``__main__``, its own ``sys.argv``): the suite pays for one launch, and one import of torch per rank, instead of
one per script.

    python -m tpflow.launch --nproc_per_node 2 tests/scripts.py "examples/a.py" "benchmarks/b.py --reps 1"

Each script's output is framed by a ``>>> COMMAND`` line and a ``<<< COMMAND exit CODE`` line, printed by the
first rank after every rank has flushed its own (``harness.run_scripts`` takes the frames apart). A script that
exits (``SystemExit``) has its code recorded, its message printed to stderr, and the next one runs; one that
raises ends the run, as it would end the script's own.
"""

from __future__ import annotations

import os
import runpy
import shlex
import sys

import torch.distributed as dist

import tpflow


def _in_step() -> None:
    """Every rank's output so far is out before the first rank frames it (the ranks share the launch's stdout)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        dist.barrier()


def _say(text: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(text, flush=True)


def main() -> None:
    if "WORLD_SIZE" in os.environ:  # under the launcher: the world first, so that one rank frames the output
        tpflow.init_distributed()
    for command in sys.argv[1:]:
        path, *args = shlex.split(command)
        _in_step()
        _say(f">>> {command}")
        sys.argv = [path, *args]
        code = 0
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        _in_step()
        _say(f"<<< {command} exit {code}")


if __name__ == "__main__":
    main()
