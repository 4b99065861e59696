"""The launcher: worlds of 1, 2 and 4 CPU processes, fail-fast with the failing rank's error said once (not
once per rank), clear errors for flags that make no sense, and the same script as one plain process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.harness import ROOT
from tpflow.launch import parse_args, script_env, torchrun_args
from tpflow.launch_report import report

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist

    ready = dist.is_initialized() and (dist.get_rank(), dist.get_world_size())  # the launcher set it up first
    import tpflow as tpf

    rank, world = tpf.get_rank(), tpf.get_world_size()
    print(f"rank {rank}: ready before the first line {ready}")
    if "--fail" in sys.argv and rank == world - 1:
        raise ValueError(f"boom from rank {rank}")
    if "--fail-all" in sys.argv:  # as a wrong degree fails: the same error on every rank
        import warnings
        print(f"rank {rank} to stderr", file=sys.stderr, flush=True)
        warnings.warn(f"a warning from rank {rank}")
        raise ValueError("degree 2 does not divide dimension 255")
    total = tpf.to_global(torch.tensor([float(rank)]), placement=tpf.placement.all("cpu"), sbp=tpf.sbp.partial_sum)
    value = tpf.to_local(tpf.to_global(total, sbp=tpf.sbp.broadcast)).item()
    print(f"rank {rank} of {world}: sum of ranks {value:g}, args {sys.argv[1:]}")
    for i in range(50):  # print's pieces, each a write: under torchrun's unbuffered output the ranks interleaved them
        print(rank, "piece", i, "of", "one", "line")
""")


def _launch(args, tmp_path, script_args=("x",), timeout=180, text=SCRIPT, launcher="tpflow.launch"):
    script = tmp_path / "script.py"
    script.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, *(["-m", launcher, *args] if args is not None else []), str(script), *script_args]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("nproc", [1, 4])  # 2: test_error_on_every_rank_is_said_once and every example's launch
def test_world_of_n(nproc, tmp_path):
    proc, _ = _launch(["--nproc_per_node", str(nproc)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    total = sum(range(nproc))
    for rank in range(nproc):
        assert f"rank {rank} of {nproc}: sum of ranks {total}, args ['x']" in proc.stdout
        assert f"rank {rank}: ready before the first line {(rank, nproc)}" in proc.stdout
    pieces = [line for line in proc.stdout.splitlines() if "piece" in line]
    assert len(pieces) == 50 * nproc and all(re.fullmatch(r"\d piece \d+ of one line", line) for line in pieces), \
        proc.stdout[-2000:]


def test_plain_process_is_a_world_of_one(tmp_path):
    proc, _ = _launch(None, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 of 1: sum of ranks 0" in proc.stdout
    assert "rank 0: ready before the first line False" in proc.stdout  # set up by tpflow's first placement


def test_failing_rank_stops_the_launch(tmp_path):
    # ranks 0 and 1 wait in a collective for rank 2, which raises: the launch must end at once
    proc, elapsed = _launch(["--nproc_per_node", "3", "--logdir", str(tmp_path / "logs")], tmp_path, ["--fail"])
    assert proc.returncode != 0
    assert proc.stderr.count("ValueError: boom from rank 2") == 1, proc.stderr[-4000:]
    assert "tpflow.launch: rank 2 raised this error" in proc.stderr
    assert elapsed < 60, f"the launch took {elapsed:.0f}s to fail: ranks were left waiting"
    assert list((tmp_path / "logs").rglob("stderr.log")), "--logdir kept no per-rank logs"
    errors = list((tmp_path / "logs").rglob("error.json"))  # and the failing rank's error
    assert any("boom from rank 2" in e.read_text() for e in errors), errors


def test_error_on_every_rank_is_said_once(tmp_path):
    # every rank raises the same error: one traceback and the ranks that raised it, not one traceback per rank
    proc, _ = _launch(["--nproc_per_node", "2"], tmp_path, ["--fail-all"])
    assert proc.returncode == 1, proc.stderr[-4000:]
    message = "ValueError: degree 2 does not divide dimension 255"
    assert proc.stderr.count(message) == 1 and proc.stderr.count("Traceback") == 1, proc.stderr[-4000:]
    report = proc.stderr[proc.stderr.index("Traceback"):].splitlines()
    assert report[-2:] == [message, "tpflow.launch: ranks 0, 1 raised this error"], report
    assert report[1].startswith(f'  File "{tmp_path / "script.py"}", line'), report  # the script on, not the launcher
    assert "Root Cause" not in proc.stderr and "[rank0]" not in proc.stderr and "exitcode" not in proc.stderr
    for rank in range(2):  # the script's own output still reaches the user
        assert f"rank {rank}: ready before the first line" in proc.stdout
        assert f"rank {rank} to stderr" in proc.stderr and f"UserWarning: a warning from rank {rank}" in proc.stderr


PENDING_SCRIPT = textwrap.dedent("""
    import time, torch
    {imports}
    import tpflow as tpf

    if tpf.get_rank() == 1:
        work = torch.distributed.all_reduce(torch.ones(4), async_op=True)  # never joined by rank 0
        raise ValueError("boom with a collective in flight")
    time.sleep(120)  # busy elsewhere: only the launcher's teardown ends it
""")


@pytest.mark.parametrize("imports", ["", "import torch._dynamo  # as torch.compile does: the group is freed at exit"],
                         ids=["", "dynamo imported"])
def test_failing_rank_with_a_collective_in_flight_exits_at_once(tmp_path, imports):
    # destroying the process group at exit would wait for the unfinished all-reduce, i.e. for rank 0
    proc, elapsed = _launch(["--nproc_per_node", "2"], tmp_path, (), text=PENDING_SCRIPT.format(imports=imports))
    assert proc.returncode != 0 and proc.stderr.count("ValueError: boom with a collective") == 1, proc.stderr[-4000:]
    assert "tpflow.launch: rank 1 raised this error" in proc.stderr  # only rank 1 raised: rank 0 was stopped
    assert "tpflow.launch: rank 0 was stopped (SIGTERM)" in proc.stderr, proc.stderr[-4000:]
    assert elapsed < 60, f"the launch took {elapsed:.0f}s to fail: the failing rank waited at exit"


def _error(rank, error, time, where='File "train.py", line 3, in <module>'):
    return {"rank": rank, "time": time, "error": error, "where": where,
            "traceback": f"Traceback (most recent call last):\n  {where}\n    ...\n{error}  # rank {rank}"}


def test_failure_report_groups_errors_and_names_the_ranks_without_one():
    # the first error in full (rank 0's traceback when rank 0 raised it), then each other error in short, grouped by
    # message; then ranks that ended without a Python error, with their exit code or signal
    errors = {r: _error(r, "ValueError: bad degree", 10.0 + r) for r in (3, 0, 1, 2)}
    errors[5] = _error(5, "RuntimeError: Connection reset by peer", 12.0, where="")
    said = report(errors, {0: 1, 1: 1, 2: 1, 3: 1, 4: -9, 5: 1, 7: -15, 8: 3, 9: -15})
    assert said.splitlines() == [
        "Traceback (most recent call last):", '  File "train.py", line 3, in <module>', "    ...",
        "ValueError: bad degree  # rank 0",
        "tpflow.launch: ranks 0-3 raised this error",
        "tpflow.launch: rank 5 raised a different error:",
        "    RuntimeError: Connection reset by peer",
        "tpflow.launch: rank 4 was killed by SIGKILL (exit code -9) with no Python error",
        "tpflow.launch: rank 8 exited with code 3 and no Python error",
        "tpflow.launch: ranks 7, 9 were stopped (SIGTERM)",
    ]
    assert report({r: _error(r, "E: x", 5.0 - r) for r in (2, 0)}, {0: 1, 2: 1}).splitlines()[-2:] == [
        "E: x  # rank 0", "tpflow.launch: ranks 0, 2 raised this error"]  # rank 0's, though rank 2 raised first
    assert report({}, {1: -15}) == "tpflow.launch: rank 1 was killed by SIGTERM (exit code -15) with no Python error"


def test_a_killed_rank_is_said_before_the_others_losing_it():
    # rank 4 was killed (a SIGKILL, a C++ abort); the first error is the survivors' word that a peer is gone: the
    # death is the cause, said first
    errors = {r: _error(r, "RuntimeError: Connection closed by peer", 9.0 + r) for r in (0, 1)}
    lines = report(errors, {0: 1, 1: 1, 4: -6, 7: -15}).splitlines()
    assert lines[0].startswith("tpflow.launch: rank 4 was killed by SIGABRT (exit code -6) with no Python error (a C++ "
                               "library aborted"), lines
    assert "collective with different sizes" in lines[0]
    assert lines[-2:] == ["tpflow.launch: ranks 0, 1 raised this error", "tpflow.launch: rank 7 was stopped (SIGTERM)"]


def test_a_rank_that_left_early_is_said_first():
    # rank 1 called sys.exit(0) before rank 0's collective failed waiting on it: the cause first, then the error,
    # and rank 1 is not said to have been stopped
    errors = {0: _error(0, "RuntimeError: Connection closed by peer", 20.0)}
    exits = {1: {"rank": 1, "time": 19.0, "how": "called sys.exit(0)"}, 2: {"rank": 2, "time": 25.0, "how": "x"}}
    lines = report(errors, {0: 1, 1: -15, 2: -15}, exits).splitlines()
    assert lines[0].startswith("tpflow.launch: rank 1 left early: it called sys.exit(0) while the other ranks went on")
    assert lines[-2:] == ["tpflow.launch: rank 0 raised this error", "tpflow.launch: rank 2 was stopped (SIGTERM)"]


def test_ctrl_c_stops_every_rank_in_one_line(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import pathlib, sys, time
        import tpflow as tpf
        pathlib.Path(sys.argv[1], f"ready{tpf.get_rank()}").touch()
        time.sleep(120)
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "tpflow.launch", "--nproc_per_node", "2", str(script),
                             str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.1)  # both ranks are in the script
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert err.strip() == "tpflow.launch: stopped by SIGINT; every rank was stopped", err[-3000:]


@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "2", "--node_rank", "2"], "--node_rank must be in 0..1"),
    (["--nproc_per_node", "0"], "--nproc_per_node must be at least 1"),
    (["--nnodes", "0"], "--nnodes must be at least 1"),
    (["--master_port", "70000", "--nnodes", "2"], "--master_port must be a TCP port"),
])
def test_nonsense_flags(flags, message):
    with pytest.raises(ValueError, match=message):
        torchrun_args(parse_args([*flags, "script.py"]))


def test_nonsense_flags_exit_with_usage_error(tmp_path):
    proc, _ = _launch(["--nnodes", "2", "--node_rank", "2"], tmp_path)
    assert proc.returncode == 2 and "--node_rank must be in 0..1 for --nnodes 2, got 2" in proc.stderr


def test_flags_map_to_torchrun():
    ns = parse_args(["--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "2", "--master_addr",
                     "10.0.0.1", "--master_port", "7788", "train.py", "--lr", "0.1"])
    args = torchrun_args(ns)
    assert args[args.index("--nnodes") + 1] == "2" and args[args.index("--node_rank") + 1] == "1"
    assert args[args.index("--master_addr") + 1] == "10.0.0.1" and args[args.index("--master_port") + 1] == "7788"
    assert "train.py" not in args and "--standalone" not in args  # the script reaches the workers by script_env
    single = torchrun_args(parse_args(["--nproc_per_node", "4", "train.py"]))
    assert "--standalone" in single


def test_every_argument_after_the_script_reaches_it_unchanged(tmp_path):
    """A script's own options, prefixes of the launcher's or torchrun's (``--log``: ``--logdir``, ``--log-dir``) or
    the same names (``--nnodes``, ``--logdir``), go to the script as they were given, not to a parser on the way."""
    script_args = ["--log", "info", "--logdir", "out", "--nnodes", "3", "--master", "x", "-m", "--", "--lr=0.1"]
    ns = parse_args(["--nproc_per_node", "2", "--logdir", str(tmp_path / "logs"), "train.py", *script_args])
    assert (ns.nproc_per_node, ns.script, ns.script_args, ns.nnodes) == (2, "train.py", script_args, 1)
    assert ns.logdir == str(tmp_path / "logs")
    assert json.loads(script_env(ns)["TPFLOW_LAUNCH_SCRIPT"]) == ["script", "train.py", *script_args]
    proc, _ = _launch(["--nproc_per_node", "2"], tmp_path, script_args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        assert f"rank {rank} of 2: sum of ranks 1, args {script_args}" in proc.stdout, proc.stdout[-2000:]


EXIT_SCRIPT = textwrap.dedent("""
    import atexit, os, torch
    import tpflow as tpf
    from tpflow.ops import matmul_reduce_scatter

    def gloo_threads():
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        return sum(n.startswith("pt_gloo") for n in names)

    rank = os.environ["RANK"]
    atexit.register(lambda: open(f"rank{rank}.txt", "a").write(f"after the exit hook: {gloo_threads()}"))  # before
    world = tpf.get_world_size()  # sets up the process group and registers tpflow's exit hook, which runs first
    y = matmul_reduce_scatter(torch.ones(4, 3), torch.ones(3, 2), algo="ring")
    every = [torch.zeros(1) for _ in range(world)]
    torch.distributed.all_gather(every, torch.ones(1))  # a temporary the gloo worker frees last
    open(f"rank{rank}.txt", "w").write(f"while running: {gloo_threads()}; ")
""")


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads thread names from /proc")
def test_exit_hook_joins_gloo_threads(tmp_path):
    # left to interpreter finalization, gloo's workers can abort a finished run (pytorch/pytorch#179291); torchrun
    # itself starts the ranks, so that the script's first tpflow call registers the hook (tpflow's launcher would
    # register it before the script's first line, and the script's own hook could not run after it)
    proc, _ = _launch(["--standalone", "--nproc_per_node", "2"], tmp_path, (), text=EXIT_SCRIPT,
                      launcher="torch.distributed.run")
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        running, after = (tmp_path / f"rank{rank}.txt").read_text().split("; ")
        assert running != "while running: 0" and after == "after the exit hook: 0", (rank, running, after)
