"""``python -m tpflow.launch``: OneFlow's launcher flags over ``torch.distributed.run`` (torchrun).

    python -m tpflow.launch --nproc_per_node 4 script.py args...
    python -m tpflow.launch --nnodes 2 --node_rank 0 --nproc_per_node 2 \\
        --master_addr 192.168.1.1 --master_port 7788 script.py

Each worker sets up torch.distributed (gloo, or NCCL with the rank's GPU) before the script's first line,
as OneFlow's launcher does; a script that calls ``torch.distributed.init_process_group`` itself must check
``torch.distributed.is_initialized()`` first. The script's own output (prints, warnings) reaches the console
as it is written. A single-node launch without ``--master_port`` rendezvouses on a free port (``--standalone``),
so several launches can run side by side.

When a rank raises, torchrun stops the others at once (SIGTERM) and the launch exits non-zero with the
error said once, not once per rank: the traceback of the first error (rank 0's when rank 0 raised it too),
from the script's frame on, then a line naming every rank that raised it; each other error as a short block
(its ranks grouped by message); and a line for the ranks that ended without a Python error (killed by a
signal, with its exit code; a non-zero ``sys.exit``; stopped by torchrun). A rank whose script ended (it finished,
or called ``sys.exit``) before the first error is said first, as the cause: the others failed waiting on it in a
collective. Ctrl-C stops every rank and says so in one line (exit status 130). A wrong degree, which every rank
finds, reads::

    Traceback (most recent call last):
      File "train.py", line 12, in <module>
        ...
    ValueError: ...
    tpflow.launch: ranks 0, 1 raised this error

Each worker records its error in a file for the launcher instead of printing it, and in torch.elastic's
``error.json`` too, which ``--logdir`` keeps beside each rank's output. ``sys.exit(0)`` in a script is a
success. A script run without the launcher (``python script.py``) prints its error as Python does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import signal
import sys

from tpflow.launch_report import ERRORS_ENV, errors_folder, read_errors, read_exits, record_error, record_exit, report

__all__ = ["build_parser", "main", "parse_args", "script_env", "torchrun_args"]

_WORKER = "--tpflow-worker"  # internal: how torchrun starts each rank through this module
_SCRIPT_ENV = "TPFLOW_LAUNCH_SCRIPT"  # internal: what each worker runs (kind, target, its arguments), as JSON


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
    p = argparse.ArgumentParser(prog="python -m tpflow.launch", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
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


_VALUED = {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--node-rank", "--master_addr",
           "--master-addr", "--master_port", "--master-port", "--logdir"}  # the launcher's flags that take a value


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The launcher's flags, then the script, then the script's arguments, each as it was given: argparse reads only
    what comes before the script (its prefix matching would take a script's ``--log`` for ``--logdir``).

    Args:
        argv: the arguments after ``python -m tpflow.launch``.

    Returns:
        The namespace :func:`build_parser` gives, ``script_args`` verbatim.

    Example::

        >>> ns = parse_args(["--nproc_per_node", "2", "train.py", "--log", "x", "--logdir", "y", "--nnodes", "3"])
        >>> ns.nproc_per_node, ns.script, ns.script_args, ns.logdir, ns.nnodes
        (2, 'train.py', ['--log', 'x', '--logdir', 'y', '--nnodes', '3'], None, 1)
    """
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        i += 2 if argv[i] in _VALUED else 1
    ns = build_parser().parse_args(argv[:i + 1])
    ns.script_args = list(argv[i + 1:])
    return ns


def torchrun_args(ns: argparse.Namespace) -> list[str]:
    """torchrun's arguments for OneFlow-style flags; ValueError for flags that make no sense.

    One node without ``--master_port`` rendezvouses on a free port (``--standalone``); otherwise at
    ``--master_addr``:``--master_port`` (29500 when not given). torchrun checks on its workers every 0.1 s
    (``--monitor_interval``); with ``--logdir`` it also writes each rank's stdout and stderr there. Each worker
    runs this module again, which runs the script under torch.elastic's ``record``; the script and its arguments
    reach the workers by the environment (``script_env``), not through torchrun's parser, which would read them.

    Args:
        ns: the flags, as :func:`build_parser` parses them.

    Returns:
        The arguments for ``torch.distributed.run``, in order.

    Raises:
        ValueError: ``--nproc_per_node`` or ``--nnodes`` below 1, ``--node_rank`` outside 0..nnodes-1, or
            ``--master_port`` outside 1..65535.

    Example::

        >>> ns = parse_args(["--nproc_per_node", "4", "train.py", "--lr", "0.1"])
        >>> torchrun_args(ns)  # doctest: +NORMALIZE_WHITESPACE
        ['--nproc_per_node', '4', '--monitor_interval', '0.1', '--standalone', '-m', 'tpflow.launch',
         '--tpflow-worker']
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
    return [*args, "-m", "tpflow.launch", _WORKER]


def script_env(ns: argparse.Namespace) -> dict[str, str]:
    """The environment that tells each worker what to run: the script (or module) and its arguments, verbatim.

    Args:
        ns: the flags, as :func:`parse_args` parses them.

    Returns:
        The variables to set before torchrun starts the workers.

    Example::

        >>> script_env(parse_args(["train.py", "--log", "x"]))
        {'TPFLOW_LAUNCH_SCRIPT': '["script", "train.py", "--log", "x"]'}
    """
    return {_SCRIPT_ENV: json.dumps(["module" if ns.module else "script", ns.script, *ns.script_args])}


def _run_worker(kind: str, target: str, args: list[str]) -> int:
    """One rank: run the user's script like ``python script.py`` would; the exit status.

    Under the launcher (``TPFLOW_LAUNCH_ERRORS`` set), an exception (any ``BaseException`` but ctrl-C and
    ``sys.exit``: torch.distributed.checkpoint's ``CheckpointException`` is one) is recorded for the launcher and for
    torchrun instead of printed, and the rank exits with status 1 as an uncaught exception would (the
    script's exit hooks run, then tpflow's, which leaves at once, see ``tpflow.world``).
    Without it (torchrun started this module itself) the exception goes up as before.
    """
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

    from tpflow.world import init_distributed

    errors = os.environ.get(ERRORS_ENV)

    for stream in (sys.stdout, sys.stderr):  # torchrun runs the ranks unbuffered: print's pieces would interleave
        with contextlib.suppress(AttributeError, ValueError):  # by rank ("01  (sbp..."); a line is one write
            stream.reconfigure(line_buffering=True, write_through=False)

    @record
    def run() -> int:
        try:
            init_distributed()  # the process group (and the rank's GPU) ready at the script's first line, as OneFlow's
            sys.argv = [target, *args]
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
                runpy.run_path(target, run_name="__main__")
        except KeyboardInterrupt:  # ctrl-C reaches every rank: the launcher says it once
            if not errors:
                raise
            return 128 + signal.SIGINT
        except SystemExit as e:  # the script's own sys.exit: said to the launcher, should the others fail after it
            if errors:
                record_exit(errors, f"called sys.exit({e.code!r})")
            raise
        except BaseException as e:  # an Exception, or another BaseException (dcp's CheckpointException is one)
            if not errors or not record_error(errors, e):
                raise
            with contextlib.suppress(OSError):
                get_error_handler().record_exception(e)  # torchrun's error.json (kept under --logdir)
            # as an uncaught exception leaves them: tpflow's exit hook then exits at once, without waiting on
            # collectives this rank left unfinished
            sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
            sys.last_exc = e
            return 1
        if errors:
            record_exit(errors, "finished its script")
        return 0

    return run() or 0  # record returns None for the script's sys.exit(0)


def main(argv: list[str] | None = None) -> int:
    """``python -m tpflow.launch``: start the script's ranks through torchrun and wait for them.

    Inside a worker (torchrun starts each rank through this module) it runs the user's script on that rank
    instead. Flags that make no sense, or a script file that does not exist, end in argparse's error (exit
    status 2). When ranks fail, the error is printed once (see the module's docstring).

    Args:
        argv: the arguments after ``python -m tpflow.launch``; None for ``sys.argv[1:]``.

    Returns:
        The exit status: 0 when every rank finished, 1 when one failed (its traceback printed to stderr once,
        with the ranks that raised it).

    Example::

        >>> main(["--nproc_per_node", "2", "train.py", "--epochs", "1"])  # the launcher itself  # doctest: +SKIP
        0
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [_WORKER]:
        kind, target, *args = json.loads(os.environ[_SCRIPT_ENV]) if len(argv) == 1 else argv[1:]
        return _run_worker(kind, target, args)
    parser = build_parser()
    ns = parse_args(argv)
    try:
        args = torchrun_args(ns)
    except ValueError as e:
        parser.error(str(e))
    if not ns.module and not os.path.isfile(ns.script):
        parser.error(f"script {ns.script!r} not found")
    from torch.distributed import run as torchrun

    if ns.nproc_per_node > 1:  # torchrun's own default for its workers, set here so it does not warn about it
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(script_env(ns))  # read by the workers torchrun starts from this process
    try:
        return _run(torchrun, args)
    finally:
        os.environ.pop(_SCRIPT_ENV, None)


def _run(torchrun, args: list[str]) -> int:
    """torchrun over the workers; the exit status, a failure said once."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with errors_folder() as folder:
        try:
            torchrun.run(torchrun.parse_args(args))
        except ChildFailedError as e:
            exitcodes = {rank: failure.exitcode for rank, failure in e.failures.items()}
            said = report(read_errors(folder), exitcodes, read_exits(folder))
            print(said or e.format_msg(), file=sys.stderr, flush=True)
            return 1
        except (KeyboardInterrupt, SignalException) as e:  # ctrl-C (or a signal to the launcher): torchrun stopped
            signum = getattr(e, "sigval", signal.SIGINT)  # every rank; one line, the shell's status for the signal
            print(f"tpflow.launch: stopped by {signal.Signals(signum).name}; every rank was stopped", file=sys.stderr,
                  flush=True)
            return 128 + int(signum)
    return 0

if __name__ == "__main__":
    launcher = sys.argv[1:2] != [_WORKER]  # (read first: a worker's script gets its own sys.argv)
    status = main()
    if launcher:  # the launcher's own process ran no user code: it ends at once (tearing down torch's modules would
        sys.stdout.flush()  # take it a second more)
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
