"""``python -m tpflow.launch``: OneFlow's launcher flags over ``torch.distributed.run`` (torchrun).

    python -m tpflow.launch --nproc_per_node 4 script.py args...
    python -m tpflow.launch --nnodes 2 --node_rank 0 --nproc_per_node 2 \\
        --master_addr 192.168.1.1 --master_port 7788 script.py

Each worker sets up torch.distributed (gloo, or NCCL with the rank's GPU) before the script's first line,
as OneFlow's launcher does; a script that calls ``torch.distributed.init_process_group`` itself must check
``torch.distributed.is_initialized()`` first. Every worker runs the script under torch.elastic's ``record``,
so when a rank raises, torchrun
stops the others at once and the launch exits non-zero with that rank's traceback. A
single-node launch without ``--master_port`` rendezvouses on a free port (``--standalone``),
so several launches can run side by side.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

__all__ = ["build_parser", "main", "torchrun_args"]

_WORKER = "--tpflow-worker"  # internal: how torchrun starts each rank through this module


def build_parser() -> argparse.ArgumentParser:
    """The launcher's command line: OneFlow's flags, plus ``--logdir`` and ``-m``.

    ``--nproc_per_node``, ``--nnodes``, ``--node_rank``, ``--master_addr`` and ``--master_port``, the ones
    with an underscore also spelt with hyphens; everything after the script (or module) goes to it unchanged.

    Returns:
        The parser; :func:`torchrun_args` turns what it parses into torchrun's arguments.

    Example::

        >>> ns = build_parser().parse_args(["--nproc_per_node", "4", "train.py", "--lr", "0.1"])
        >>> ns.nproc_per_node, ns.script, ns.script_args
        (4, 'train.py', ['--lr', '0.1'])
    """
    p = argparse.ArgumentParser(prog="python -m tpflow.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc_per_node", "--nproc-per-node", type=int, default=1, help="processes on this node")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    p.add_argument("--node_rank", "--node-rank", type=int, default=0, help="this node's rank, 0..nnodes-1")
    p.add_argument("--master_addr", "--master-addr", default="127.0.0.1", help="address of node 0")
    p.add_argument("--master_port", "--master-port", type=int, default=None,
                   help="port on node 0 (default: a free port on one node, 29500 on several)")
    p.add_argument("--logdir", default=None, help="also write each rank's stdout/stderr under this folder")
    p.add_argument("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def torchrun_args(ns: argparse.Namespace) -> list[str]:
    """torchrun's arguments for OneFlow-style flags; ValueError for flags that make no sense.

    One node without ``--master_port`` rendezvouses on a free port (``--standalone``); otherwise at
    ``--master_addr``:``--master_port`` (29500 when not given). torchrun checks on its workers every 0.1 s
    (``--monitor_interval``); with ``--logdir`` it also writes each rank's stdout and stderr there. Each worker
    runs this module again, which runs the script under torch.elastic's ``record``.

    Args:
        ns: the flags, as :func:`build_parser` parses them.

    Returns:
        The arguments for ``torch.distributed.run``, in order.

    Raises:
        ValueError: ``--nproc_per_node`` or ``--nnodes`` below 1, ``--node_rank`` outside 0..nnodes-1, or
            ``--master_port`` outside 1..65535.

    Example::

        >>> ns = build_parser().parse_args(["--nproc_per_node", "4", "train.py", "--lr", "0.1"])
        >>> torchrun_args(ns)  # doctest: +NORMALIZE_WHITESPACE
        ['--nproc_per_node', '4', '--monitor_interval', '0.1', '--standalone', '-m', 'tpflow.launch',
         '--tpflow-worker', 'script', 'train.py', '--lr', '0.1']
    """
    if ns.nproc_per_node < 1:
        raise ValueError(f"--nproc_per_node must be at least 1, got {ns.nproc_per_node}")
    if ns.nnodes < 1:
        raise ValueError(f"--nnodes must be at least 1, got {ns.nnodes}")
    if not 0 <= ns.node_rank < ns.nnodes:
        raise ValueError(f"--node_rank must be in 0..{ns.nnodes - 1} for --nnodes {ns.nnodes}, got {ns.node_rank}")
    if ns.master_port is not None and not 0 < ns.master_port < 65536:
        raise ValueError(f"--master_port must be a TCP port in 1..65535, got {ns.master_port}")
    args = ["--nproc_per_node", str(ns.nproc_per_node), "--monitor_interval", "0.1"]
    if ns.nnodes == 1 and ns.master_port is None:
        args.append("--standalone")
    else:
        args += ["--nnodes", str(ns.nnodes), "--node_rank", str(ns.node_rank), "--master_addr", ns.master_addr,
                 "--master_port", str(ns.master_port or 29500)]
    if ns.logdir:
        args += ["--log_dir", ns.logdir, "--tee", "3"]
    worker = [_WORKER, "module" if ns.module else "script", ns.script, *ns.script_args]
    return [*args, "-m", "tpflow.launch", *worker]


def _run_worker(kind: str, target: str, args: list[str]) -> None:
    """One rank: run the user's script like ``python script.py`` would, errors recorded for torchrun."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from tpflow.placement import init_distributed

    @record
    def run() -> None:
        init_distributed()  # the process group (and the rank's GPU) ready at the script's first line, as OneFlow's
        sys.argv = [target, *args]
        if kind == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")

    run()


def main(argv: list[str] | None = None) -> int:
    """``python -m tpflow.launch``: start the script's ranks through torchrun and wait for them.

    Inside a worker (torchrun starts each rank through this module) it runs the user's script on that rank
    instead. Flags that make no sense, or a script file that does not exist, end in argparse's error (exit
    status 2).

    Args:
        argv: the arguments after ``python -m tpflow.launch``; None for ``sys.argv[1:]``.

    Returns:
        The exit status: 0 when every rank finished, 1 when one failed (its traceback printed to stderr).

    Example::

        >>> main(["--nproc_per_node", "2", "train.py", "--epochs", "1"])  # the launcher itself  # doctest: +SKIP
        0
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [_WORKER]:
        _run_worker(argv[1], argv[2], argv[3:])
        return 0
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        args = torchrun_args(ns)
    except ValueError as e:
        parser.error(str(e))
    if not ns.module and not os.path.isfile(ns.script):
        parser.error(f"script {ns.script!r} not found")
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.run(torchrun.parse_args(args))
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
