"""How a launch's failure reads: each worker records what ended its script (an error with its traceback from the
script's frame on, or that it ended without one, and when) in a folder the launcher names, and the launcher says it
once, from those records and torchrun's exit codes (``tpflow.launch``'s docstring shows it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import runpy
import signal
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Iterator

from tpflow.comm.peers import closed_connection

__all__ = ["ERRORS_ENV", "errors_folder", "read_errors", "read_exits", "record_error", "record_exit", "report"]

ERRORS_ENV = "TPFLOW_LAUNCH_ERRORS"  # the folder where each worker records what ended its script
_SKIPPED_FILES = {os.path.abspath(os.path.join(os.path.dirname(__file__), "launch.py")),
                  os.path.abspath(__file__), os.path.abspath(runpy.__file__)}  # frames above the script's


def record_error(folder: str, e: BaseException) -> bool:
    """Write this rank's error for the launcher: its traceback from the script's frame on.

    Args:
        folder: the launch's errors folder (``ERRORS_ENV``).
        e: the exception the script raised.

    Returns:
        False where it could not be written (the rank then raises it as Python does).

    Example::

        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> record_error(folder, ValueError("boom")), read_errors(folder)[int(os.environ.get("RANK", 0))]["error"]
        (True, 'ValueError: boom')
    """
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


def record_exit(folder: str, how: str) -> None:
    """Write that this rank's script ended without an error, and when: a rank that leaves while the others go on is
    the cause of their failure (they wait on it in their next collective).

    Args:
        folder: the launch's errors folder (``ERRORS_ENV``).
        how: what the script did ("finished its script", "called sys.exit(3)").

    Example::

        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> record_exit(folder, "finished its script")
        >>> [r["how"] for r in read_exits(folder).values()]
        ['finished its script']
    """
    rank = int(os.environ.get("RANK", 0))
    path = os.path.join(folder, f"rank{rank}.exit")
    with contextlib.suppress(OSError):
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": rank, "time": time.time(), "how": how}, f)
        os.replace(path + ".tmp", path)


def read_exits(folder: str) -> dict[int, dict]:
    """The ranks whose script ended without an error, by rank (``record_exit``'s records).

    Args:
        folder: the launch's errors folder.

    Returns:
        rank -> its record (``rank``, ``time``, ``how``).

    Example::

        >>> import tempfile
        >>> read_exits(tempfile.mkdtemp())
        {}
    """
    return _read_records(folder, ".exit")


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


class _DropFailureDump(logging.Filter):
    """Drops torchrun's own lines about a failure or a signal (the launcher's summary says it once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("failed (exitcode", "Sending process", "Received %s death signal"))


@contextlib.contextmanager
def errors_folder() -> Iterator[str]:
    """A temporary folder the workers record their errors in, named to them by ``TPFLOW_LAUNCH_ERRORS``, while
    torchrun's own lines about a failure are dropped (the report says it once).

    Returns:
        A context manager giving the folder.

    Example::

        >>> with errors_folder() as folder:
        ...     os.environ[ERRORS_ENV] == folder
        True
    """
    old = os.environ.get(ERRORS_ENV)
    loggers = [logging.getLogger(f"torch.distributed.elastic.{name}") for name in ("multiprocessing.api",
                                                                                   "agent.server.api")]
    quiet = _DropFailureDump()
    with tempfile.TemporaryDirectory(prefix="tpflow-launch-") as folder:
        os.environ[ERRORS_ENV] = folder
        for logger in loggers:
            logger.addFilter(quiet)
        try:
            yield folder
        finally:
            for logger in loggers:
                logger.removeFilter(quiet)
            if old is None:
                os.environ.pop(ERRORS_ENV, None)
            else:
                os.environ[ERRORS_ENV] = old


def read_errors(folder: str) -> dict[int, dict]:
    """The errors the ranks recorded, by rank (``record_error``'s records).

    Args:
        folder: the launch's errors folder.

    Returns:
        rank -> its record (``rank``, ``time``, ``error``, ``traceback``, ``where``).

    Example::

        >>> import tempfile
        >>> read_errors(tempfile.mkdtemp())
        {}
    """
    return _read_records(folder, ".json")


def _read_records(folder: str, suffix: str) -> dict[int, dict]:
    """The records of ``folder`` whose names end with ``suffix``, by rank; one half written or unreadable is left
    out (a rank stopped while it wrote)."""
    found = {}
    for name in os.listdir(folder):
        if name.endswith(suffix):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                with open(os.path.join(folder, name)) as f:
                    record = json.load(f)
                found[int(record["rank"])] = record
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


def report(errors: dict[int, dict], exitcodes: dict[int, int], exits: dict[int, dict] | None = None) -> str:
    """The failure, said once: ranks whose script ended before the first error (its first cause: the others failed
    waiting on them), the first error's traceback and who raised it, then the other errors and deaths.

    Args:
        errors: the records the ranks wrote (``read_errors``).
        exitcodes: the non-zero exit statuses torchrun saw (a negative one is the signal that ended the rank).
        exits: the ranks whose script ended without an error (``read_exits``).

    Returns:
        The lines to print, joined.

    Example::

        >>> print(report({}, {1: -9}))
        tpflow.launch: rank 1 was killed by SIGKILL (exit code -9) with no Python error
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
