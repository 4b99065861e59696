"""``python -m tpflow.bench`` on a tiny workload through the launcher: every file written, every mode's loss
equal to one device's at every step, and every rank's bytes equal to the theory for its mode's layout."""

from __future__ import annotations

import csv
import json
import re

import pytest

from tests.harness import ROOT, run_python
from tpflow.bench import terminal
from tpflow.bench.modes import HF_ONLY, MOE_ONLY
from tpflow.comm.wire import HEADER_BYTES

TWO_D = {"data x tensor", "pipeline x tensor"}
FP32 = 4


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"bench{request.param}")
    workloads = ["--workload", "mlp"] if request.param == 4 else []  # 4 ranks on 2 cores: the MLP's rows (CI time)
    proc = run_python(["-m", "tpflow.bench", "--nproc_per_node", str(request.param), "--tiny", *workloads, "--out",
                       str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    files = {p.suffix: p for p in out.iterdir()}
    data = json.loads(files[".json"].read_text())
    return request.param, proc.stdout, files, data, proc.stderr


def test_every_file_is_written_and_named_in_the_output(run):
    world, stdout, files, data, stderr = run
    assert "requires_grad" not in stderr  # every mode's share of the loss is detached
    skipped = [r["mode"] for r in data["rows"] if r["skipped"]]  # folded into one line under the table, not rows
    assert skipped and "skipped: " in stdout and not any(f"| {m} |" in files[".md"].read_text() for m in skipped)
    words = " ".join(stdout.split())  # the legend, as wrapped to the terminal
    assert "below 1 is faster" in words and "expect about 1x or slower" in words
    assert set(files) == {".json", ".csv", ".md"}
    for path in files.values():
        assert str(path) in stdout
        device = re.split(r"[^A-Za-z0-9]+", data["meta"]["device"])[0]  # "Intel(R) Xeon(R) ...": "Intel"
        assert f"w{world}" in path.name and f"bench_{device}" in path.name
    rows = list(csv.DictReader(files[".csv"].open()))
    assert [r["mode"] for r in rows] == [r["mode"] for r in data["rows"]]
    assert {r["device"] for r in rows} == {data["meta"]["device"]}
    table = files[".md"].read_text()
    assert data["meta"]["command"] in table and "| data, DDP |" in table
    assert f"python -m tpflow.bench --nproc_per_node {world} --tiny" in data["meta"]["command"]
    plot = run_python(["-m", "tpflow.bench.plot", str(files[".json"])])
    assert plot.returncode == 0, plot.stderr[-3000:]
    assert files[".json"].with_suffix(".png").stat().st_size > 10_000


def test_every_mode_runs_and_agrees_with_one_device(run):
    world, _, _, data, _ = run
    base = {r["workload"]: r["step_ms"] for r in data["rows"] if r["mode"] == "one device"}
    for row in data["rows"]:
        if row["skipped"]:
            assert (world == 2 and row["mode"] in TWO_D) or row["mode"] in HF_ONLY or row["mode"] in MOE_ONLY or \
                (world == 4 and row["mode"].startswith("pipeline, interleaved")), row  # 8 stages, 4 blocks
            continue
        assert len(row["losses"]) == data["meta"]["settings"]["warmup"] + 2 + data["meta"]["settings"]["reps"]
        assert row["loss_rel_diff"] < 1e-5, row
        assert row["losses"][-1] < row["losses"][0]  # it trains
        assert row["step_ms_p20"] <= row["step_ms"] <= row["step_ms_p80"]
        assert row["time_vs_one_device"] == pytest.approx(row["step_ms"] / base[row["workload"]])  # the medians' ratio
        assert row["peak_bytes"] > row["param_bytes"] > 0


def _overhead(row: dict, rank: int, world: int, settings: dict) -> int:
    """What tpflow sends beyond the layout's minimum:
    - a pipeline's 1 KiB header per hand-off to each receiving rank (between stages of one rank, in front of the
      blocks in their one message once the first step gave the layout), and one at the end of the step each way
      between neighbouring rank sets (torch's pipelining sends none after its first step's shape inference); in a
      multi-rank stage, a header
      to each other rank of the stage after each forward and backward, and before the last stage's loss;
    - the all-gather of an 8-byte row count by which a sequence-parallel column layer (or fused group) fed a
      plain input checks that the ranks split dim 0 evenly;
    - with PyTorch's tensor parallelism on the transformer, one collective per column layer where q, k and v
      (and gate and up) could share one, as tpflow's fused column layers do: per block, 3 more all-reduces of
      the input gradient;
    - with the input gathered again in the backward, that all-gather once more per fused column group (1 a
      block in the MLP, 2 in the transformer): the trade of bytes for memory, not part of the layout's
      minimum."""
    mode, extra = row["mode"], 0
    if mode.startswith("pipeline") and mode.endswith(", torch"):  # torch's pipelining: the blocks alone
        return 0
    if mode.startswith("pipeline"):  # a header per hand-off to each receiving rank, one per neighbour at the end
        if mode == "pipeline x tensor":
            stages, receivers, mine, m, sets, r = 2, world // 2, [rank // (world // 2)], 4, 2, rank // (world // 2)
        else:
            stages, receivers, m = world * (2 if "interleaved" in mode else 1), 1, 2 * world
            mine, sets, r = range(rank, stages, world), world, rank
        ends = (r < sets - 1) + (r > 0)  # the end of the step: to the rank sets before and after
        handoffs = HEADER_BYTES * receivers * (sum(m * ((k < stages - 1) + (k > 0)) for k in mine) + ends)
        # a multi-rank stage's ranks agree after each forward and backward (and before the last stage's loss)
        # by a header to each other rank of the stage
        agreements = sum(2 * m + m * (k == stages - 1) for k in mine) if receivers > 1 else 0
        return handoffs + HEADER_BYTES * (receivers - 1) * agreements
    columns = {"mlp": 1, "transformer": 2}[row["workload"]] * settings["depth"]  # fused column groups
    if mode.startswith("sequence"):
        extra += 8 * (world - 1) * columns
    if mode == "sequence, regather":
        extra += columns * (world - 1) * settings["tokens"] * settings["dim"] * FP32 // world
    if row["workload"] == "transformer" and mode == "tensor, torch":
        extra += 3 * settings["depth"] * 2 * (world - 1) * settings["tokens"] * settings["dim"] * FP32 // world
    return extra


def test_bytes_sent_equal_the_theory_for_each_layout(run):
    world, _, _, data, _ = run
    settings = data["meta"]["settings"]
    for row in data["rows"]:
        if row["skipped"]:
            continue
        expected = [m + _overhead(row, rank, world, settings) for rank, m in enumerate(row["minimum_per_rank"])]
        assert row["sent_per_rank"] == expected, row["mode"]


def test_the_minimum_by_hand(run):
    """Not the harness's formula: the layouts' bytes written out for the tiny MLP (4 blocks of 32 -> 64 -> 32,
    64 rows): tensor parallel all-reduces each row layer's output and each column layer's input gradient but
    the first's (the input wants none); data parallel all-reduces every gradient."""
    world, _, _, data, _ = run
    s = data["meta"]["settings"]
    rows = {r["mode"]: r for r in data["rows"] if r["workload"] == "mlp"}
    ring = (world - 1) / world
    activation = s["tokens"] * s["dim"] * FP32
    params = s["depth"] * (2 * s["dim"] * s["hidden"] + s["hidden"] + s["dim"])
    assert rows["tensor, tpflow"]["sent_bytes"] == 2 * ring * (2 * s["depth"] - 1) * activation
    assert rows["tensor, torch"]["sent_bytes"] == rows["tensor, tpflow"]["sent_bytes"]
    assert rows["data, DDP"]["sent_bytes"] == rows["data, tpflow SBP"]["sent_bytes"] == 2 * ring * params * FP32
    assert rows["pipeline, 1F1B"]["minimum_bytes"] == activation * (1 if world == 2 else 2)


def test_hf_workloads_beside_transformers_own_tensor_parallelism(tmp_path):
    """A Hugging Face Llama by its own plan: tpflow, PyTorch's parallelize_module and transformers' own tensor
    parallelism from the same checkpoint; a Qwen3-MoE with its experts split and shared out over the tensor ranks and
    over the data ranks (all-to-all), tpflow's and transformers'; the Llama under PEFT's LoRA, its adapters trained.
    Each step's loss is one device's, and tpflow sends its layout's minimum (with the experts over the data ranks,
    the routing beside the tokens' states; with LoRA, an all-reduce of T x r per adapter beside the base's)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("peft")
    proc = run_python(["-m", "tpflow.bench", "--nproc_per_node", "2", "--tiny", "--workload", "hf", "moe", "lora",
                       "--out", str(tmp_path), "--modes", "tensor-tpflow", "tensor-torch", "tensor-transformers",
                       "data-ddp", "experts-tpflow", "experts-transformers", "experts-over-data-tpflow",
                       "experts-over-data-transformers"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    rows = {(row["workload"], row["mode"]): row for row in data["rows"]}
    assert rows["hf", "data, DDP"]["skipped"].startswith("the hf workload runs")
    assert rows["moe", "tensor, torch"]["skipped"].startswith("the moe workload runs")
    assert rows["hf", "experts, tpflow"]["skipped"] == "the experts modes run the moe workload only"
    assert rows["lora", "tensor, transformers"]["skipped"].startswith("the lora workload runs")
    for key in [("hf", m) for m in ("tensor, tpflow", "tensor, torch", "tensor, transformers")] + \
            [("moe", m) for m in ("tensor, tpflow", "tensor, transformers", *MOE_ONLY)] + [("lora", "tensor, tpflow")]:
        row = rows[key]
        assert not row["skipped"], row
        assert row["loss_rel_diff"] < 1e-5 and row["losses"][-1] < row["losses"][0], row
    for key in (("hf", "tensor, tpflow"), ("moe", "tensor, tpflow"), ("moe", "experts, tpflow"),
                ("lora", "tensor, tpflow")):
        assert rows[key]["sent_per_rank"] == rows[key]["minimum_per_rank"], key
    over_data = rows["moe", "experts over data, tpflow"]  # the tokens' ids, weights and counts beyond their states
    for sent, minimum in zip(over_data["sent_per_rank"], over_data["minimum_per_rank"], strict=True):
        assert minimum < sent < 1.02 * minimum, over_data


def test_fsdp_x_tensor_beside_transformers_own(tmp_path):
    """FSDP2 over tensor parallelism on 4 ranks (2 x 2), tpflow's sharded and replicated beside transformers' own
    (DistributedConfig) from the same checkpoint: each step's loss one device's; FSDP2's all-gathers and
    reduce-scatters counted, so tpflow sends its layout's minimum plus, per block, the column layers' input gradients
    FSDP2 leaves unfused (q, k, v and gate, up: 3 more all-reduces); each rank holds a quarter of the parameters
    when sharded, a half as a replica."""
    pytest.importorskip("transformers")
    proc = run_python(["-m", "tpflow.bench", "--nproc_per_node", "4", "--tiny", "--workload", "hf", "--out",
                       str(tmp_path), "--modes", "one-device", "fsdp-x-tensor", "ddp-x-tensor",
                       "fsdp-x-tensor-transformers"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    s, rows = data["meta"]["settings"], {row["mode"]: row for row in data["rows"]}
    unfused = 3 * s["depth"] * 2 * (2 - 1) * (s["tokens"] // 2) * s["dim"] * FP32 // 2  # tp 2, each half's tokens
    whole = rows["one device"]["param_bytes"]
    for mode in ("fsdp x tensor", "ddp x tensor", "fsdp x tensor, transformers"):
        row = rows[mode]
        assert not row["skipped"], row
        assert row["loss_rel_diff"] < 1e-5 and row["losses"][-1] < row["losses"][0], row
        if mode.endswith("transformers"):
            assert all(sent >= m > 0 for sent, m in zip(row["sent_per_rank"], row["minimum_per_rank"])), row
        else:
            assert row["sent_per_rank"] == [m + unfused for m in row["minimum_per_rank"]], mode
        share = 2 if mode == "ddp x tensor" else 4
        assert row["param_bytes"] <= 1.1 * whole / share, (mode, row["param_bytes"], whole)
        # the gradients sharded as the parameters (FSDP2's reduce-scatter keeps only the shard), AdamW's state twice
        assert 0 < row["grad_bytes"] <= 1.1 * whole / share and row["adamw_bytes"] == 2 * row["param_bytes"], row
        assert row["activation_bytes"] > 0, row
    table = next(tmp_path.glob("*.md")).read_text()
    assert "| mode | parameters | gradients | AdamW state | activations and buffers |" in table


@pytest.mark.parametrize("width", [80, 120, 200])
def test_the_table_fits_the_terminal(width, capsys):
    """A committed run shown within the terminal's width: narrower terminals get fewer columns, not wrapped rows;
    the skipped modes in one line; the time ratio printed beside the medians it is the ratio of."""
    data = json.loads((ROOT / "benchmarks/results/bench_AMD-EPYC_w4_2026-11-22_200918.json").read_text())
    terminal.show(data["rows"], data["meta"], width=width)
    lines = capsys.readouterr().out.splitlines()
    table = [line for line in lines if line.startswith(("one device ", "tensor, tpflow "))]
    assert len(table) == 2 * len(data["meta"]["workloads"]) and all(len(line) <= width for line in table)
    one, tpflow = (next(r for r in data["rows"] if r["mode"] == m and r["workload"] == "mlp")
                   for m in ("one device", "tensor, tpflow"))
    ratio = f"{tpflow['step_ms'] / one['step_ms']:.2f}x"
    assert ratio in table[1] and f"{tpflow['step_ms']:.1f}" in table[1]
    assert sum(line.startswith("skipped: ") for line in lines) == 1  # pipeline x tensor, on the transformer
    assert not any(line.startswith("pipeline x tensor") and "skipped" in line for line in lines)
    assert ("narrowed to" in "\n".join(lines)) == (width < 120)
