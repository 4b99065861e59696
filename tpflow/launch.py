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
import logging
import os
import runpy
import signal
import sys
import sysconfig
import tempfile
import time
import traceback

from tpflow.comm.peers import closed_connection

__all__ = ["build_parser", "main", "parse_args", "script_env", "torchrun_args"]

_WORKER = "--tpflow-worker"  # internal: how torchrun starts each rank through this module
_ERRORS_ENV = "TPFLOW_LAUNCH_ERRORS"  # internal: the folder where each worker records the error it raised
_SCRIPT_ENV = "TPFLOW_LAUNCH_SCRIPT"  # internal: what each worker runs (kind, target, its arguments), as JSON
_SKIPPED_FILES = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}  # frames above the script's


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


# ---- the worker: one rank ----


def _run_worker(kind: str, target: str, args: list[str]) -> int:
    """One rank: run the user's script like ``python script.py`` would; the exit status.

    Under the launcher (``TPFLOW_LAUNCH_ERRORS`` set), an exception is recorded for the launcher and for
    torchrun instead of printed, and the rank exits with status 1 as an uncaught exception would (the
    script's exit hooks run, then tpflow's, which leaves at once, see ``tpflow.world``).
    Without it (torchrun started this module itself) the exception goes up as before.
    """
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

    from tpflow.world import init_distributed

    errors = os.environ.get(_ERRORS_ENV)

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
                _record_exit(errors, f"called sys.exit({e.code!r})")
            raise
        except Exception as e:
            if not errors or not _record_error(errors, e):
                raise
            with contextlib.suppress(OSError):
                get_error_handler().record_exception(e)  # torchrun's error.json (kept under --logdir)
            # as an uncaught exception leaves them: tpflow's exit hook then exits at once, without waiting on
            # collectives this rank left unfinished
            sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
            sys.last_exc = e
            return 1
        if errors:
            _record_exit(errors, "finished its script")
        return 0

    return run() or 0  # record returns None for the script's sys.exit(0)


def _record_error(folder: str, e: BaseException) -> bool:
    """Write this rank's error for the launcher: its traceback from the script's frame on; False if it cannot."""
    tb = e.__traceback__
    while tb is not None and _launcher_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    frames = traceback.extract_tb(tb) if tb is not None else []
    rank = int(os.environ.get("RANK", 0))
    record = {
        "rank": rank,
        "time": time.time(),
        "error": "".join(traceback.format_exception_only(type(e), e)).rstrip("\n"),
        "traceback": "".join(traceback.format_exception(type(e), e, tb)).rstrip("\n"),
        "where": _where(frames),
    }
    path = os.path.join(folder, f"rank{rank}.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)  # the launcher never reads half a file, even if torchrun stops this rank
    except OSError:
        return False
    return True


def _record_exit(folder: str, how: str) -> None:
    """Write that this rank's script ended without an error, and when: a rank that leaves while the others go on is
    the cause of their failure (they wait on it in their next collective)."""
    rank = int(os.environ.get("RANK", 0))
    path = os.path.join(folder, f"rank{rank}.exit")
    with contextlib.suppress(OSError):
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": rank, "time": time.time(), "how": how}, f)
        os.replace(path + ".tmp", path)


def _read_exits(folder: str) -> dict[int, dict]:
    found = {}
    for name in os.listdir(folder):
        if name.endswith(".exit"):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                with open(os.path.join(folder, name)) as f:
                    record = json.load(f)
                found[int(record["rank"])] = record
    return found


def _launcher_frame(filename: str) -> bool:
    return filename.startswith("<frozen runpy") or os.path.abspath(filename) in _SKIPPED_FILES


def _where(frames: traceback.StackSummary) -> str:
    """The innermost line of the user's own code (not Python's, torch's or tpflow's), else the innermost line."""
    libraries = {sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    libraries = tuple(os.path.join(os.path.abspath(p), "") for p in {*libraries, os.path.dirname(__file__)} if p)
    own = [f for f in frames if not f.filename.startswith("<")
           and not os.path.abspath(f.filename).startswith(libraries)]
    frame = (own or frames or [None])[-1]
    return f'File "{frame.filename}", line {frame.lineno}, in {frame.name}' if frame else ""


# ---- the launcher ----


class _DropFailureDump(logging.Filter):
    """Drops torchrun's own lines about a failure or a signal (the launcher's summary says it once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("failed (exitcode", "Sending process", "Received %s death signal"))


@contextlib.contextmanager
def _errors_folder():
    """A temporary folder the workers record their errors in, named to them by ``TPFLOW_LAUNCH_ERRORS``."""
    old = os.environ.get(_ERRORS_ENV)
    loggers = [logging.getLogger(f"torch.distributed.elastic.{name}") for name in ("multiprocessing.api",
                                                                                   "agent.server.api")]
    quiet = _DropFailureDump()
    with tempfile.TemporaryDirectory(prefix="tpflow-launch-") as folder:
        os.environ[_ERRORS_ENV] = folder
        for logger in loggers:
            logger.addFilter(quiet)
        try:
            yield folder
        finally:
            for logger in loggers:
                logger.removeFilter(quiet)
            if old is None:
                os.environ.pop(_ERRORS_ENV, None)
            else:
                os.environ[_ERRORS_ENV] = old


def _read_errors(folder: str) -> dict[int, dict]:
    found = {}
    for name in os.listdir(folder):
        if name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    record = json.load(f)
                found[int(record["rank"])] = record
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return found


def _ranks(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0, 1' or 'ranks 0-7, 9': runs of three or more as a range."""
    ranks, parts, i = sorted(ranks), [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts += [f"{ranks[i]}-{ranks[j]}"] if j - i >= 2 else [str(r) for r in ranks[i:j + 1]]
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _report(errors: dict[int, dict], exitcodes: dict[int, int], exits: dict[int, dict] | None = None) -> str:
    """The failure, said once: ranks whose script ended before the first error (its first cause: the others failed
    waiting on them), the first error's traceback and who raised it, then the other errors and deaths.

    ``errors`` are the records the ranks wrote; ``exitcodes`` the non-zero exit statuses torchrun saw (a
    negative one is the signal that ended the rank); ``exits`` the ranks whose script ended without an error.
    """
    first = min((r["time"] for r in errors.values()), default=float("inf"))
    early = {rank: r for rank, r in sorted((exits or {}).items()) if r["time"] <= first and rank not in errors}
    lines = []
    for how in dict.fromkeys(r["how"] for r in early.values()):
        ranks = [rank for rank, r in early.items() if r["how"] == how]
        one = len(ranks) == 1
        lines.append(f"tpflow.launch: {_ranks(ranks)} left early: {'it' if one else 'each'} {how} while the other "
                     f"ranks went on, which then failed waiting on {'it' if one else 'them'} (every rank must run the "
                     f"same collectives: a rank leaving a loop sooner, or exiting on one rank only, leaves the others "
                     f"waiting)")
    deaths = _deaths(errors, exitcodes, early)
    groups: dict[str, list[dict]] = {}
    for record in sorted(errors.values(), key=lambda r: (r["time"], r["rank"])):  # the first error first
        groups.setdefault(record["error"], []).append(record)
    if deaths and groups and closed_connection(RuntimeError(next(iter(groups)))):
        lines += deaths  # the first error is the others' word that a rank is gone: its death is the cause
        deaths = []
    for n, group in enumerate(groups.values()):
        ranks = [r["rank"] for r in group]
        if n == 0:
            shown = next((r for r in group if r["rank"] == 0), group[0])
            lines += [shown["traceback"], f"tpflow.launch: {_ranks(ranks)} raised this error"]
        else:
            where = f" ({group[0]['where']})" if group[0]["where"] else ""
            lines.append(f"tpflow.launch: {_ranks(ranks)} raised a different error{where}:")
            lines += ["    " + line for line in group[0]["error"].splitlines()]
    lines += deaths
    stopped = _stopped(errors, exitcodes, early)
    if stopped:  # how torchrun stops the other ranks once one has failed
        lines.append(f"tpflow.launch: {_ranks(stopped)} {'was' if len(stopped) == 1 else 'were'} stopped (SIGTERM)")
    return "\n".join(lines)


def _stopped(errors: dict[int, dict], exitcodes: dict[int, int], early: dict[int, dict]) -> list[int]:
    """The ranks torchrun stopped (SIGTERM) once another had failed."""
    ended = {rank: code for rank, code in sorted(exitcodes.items())
             if rank not in errors and rank not in early and code != 0}
    stopped = [rank for rank, code in ended.items() if code == -signal.SIGTERM]
    if len(stopped) == len(ended) and not errors and not early:
        return []  # SIGTERM is all there is: it came from outside, not from torchrun stopping the ranks
    return stopped


def _deaths(errors: dict[int, dict], exitcodes: dict[int, int], early: dict[int, dict]) -> list[str]:
    """A line for each way ranks ended without a Python error (an exit code, a signal), with those ranks."""
    stopped = _stopped(errors, exitcodes, early)
    said: dict[str, list[int]] = {}  # how a rank ended -> those ranks
    for rank, code in sorted(exitcodes.items()):
        if rank in errors or rank in early or code == 0 or rank in stopped:
            continue
        if code > 0:
            how = f"exited with code {code} and no Python error"
        else:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            how = f"killed by {name} (exit code {code}) with no Python error"
            if code == -signal.SIGABRT:
                how += (" (a C++ library aborted: its message and the rank's stack are above; gloo's \"op.preamble."
                        "length <= op.nbytes\" means the ranks ran one collective with different sizes, which "
                        "tpflow's collectives through shared memory, the cpu_shared_memory switch, name)")
        said.setdefault(how, []).append(rank)
    return [f"tpflow.launch: {_ranks(ranks)} {_verb(how, ranks)}{how}" for how, ranks in said.items()]


def _verb(how: str, ranks: list[int]) -> str:
    return "" if how.startswith("exited") else "was " if len(ranks) == 1 else "were "


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
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if ns.nproc_per_node > 1:  # torchrun's own default for its workers, set here so it does not warn about it
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(script_env(ns))
    with _errors_folder() as folder:
        try:
            torchrun.run(torchrun.parse_args(args))
        except ChildFailedError as e:
            exitcodes = {rank: failure.exitcode for rank, failure in e.failures.items()}
            report = _report(_read_errors(folder), exitcodes, _read_exits(folder))
            print(report or e.format_msg(), file=sys.stderr, flush=True)
            return 1
        except (KeyboardInterrupt, SignalException) as e:  # ctrl-C (or a signal to the launcher): torchrun stopped
            signum = getattr(e, "sigval", signal.SIGINT)  # every rank; one line, the shell's status for the signal
            print(f"tpflow.launch: stopped by {signal.Signals(signum).name}; every rank was stopped", file=sys.stderr,
                  flush=True)
            return 128 + int(signum)
    return 0


if __name__ == "__main__":
    sys.exit(main())
