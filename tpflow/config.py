"""Every runtime switch of tpflow, in one place: what it does, its environment variable, its default.

A switch is read when it is used, never at import, so it may change at any point of a run:

- from the environment: ``TPFLOW_KERNELS=triton python train.py``;
- from code, which wins over the environment: ``tpf.config.set(kernels="triton")`` for the rest of
  the process, or ``with tpf.config.override(kernels="triton"):`` for a block (how tests set them).

Some switches hold one value per device type (``ring_splits`` is 1 on CPU and 2 on CUDA by default).
Setting them to a single value sets every device type; a dict (``{"cpu": 2}``) or, in the environment,
``cpu=2,cuda=4`` sets some. ``tpf.config.describe()`` is every switch with its value in force and
where that value came from. ``docs/config.md`` is the same table with examples.

``TRITON_INTERPRET=1`` is Triton's own switch, not tpflow's: Triton reads it when it decorates the
kernels' definitions, which happens when tpflow is imported, so it must be set before.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["SWITCHES", "Switch", "debug", "describe", "get", "override", "reset", "set", "source"]


def _flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "on", "yes"):
        return True
    if lowered in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{text!r} is not a flag: use 1 or 0")


def _size(text: str) -> int:
    return int(float(text))  # 2.6e5 or 262144


@dataclass(frozen=True)
class Switch:
    """One runtime switch: ``default`` is a value, or a dict of values by device type.

    ``SWITCHES`` holds every switch of tpflow by name; ``get`` reads the value in force of one.

    Args:
        name: the name ``get``, ``set`` and ``override`` take.
        env: the environment variable that sets it.
        default: its value where neither code nor the environment sets one; for a switch with a value per
            device type, a dict by device type (``{"cpu": 1, "cuda": 2}``).
        parse: turns a value (the environment's text, say) into the switch's type, raising a ValueError or
            TypeError where it cannot.
        doc: what the switch does, for ``describe``.
        choices: the values allowed; empty: any value ``parse`` accepts.

    Example::

        >>> splits = tpf.config.SWITCHES["ring_splits"]
        >>> splits.env, splits.default
        ('TPFLOW_RING_SPLITS', {'cpu': 1, 'cuda': 2})
        >>> splits.check("4")
        4
    """

    name: str
    env: str
    default: object
    parse: Callable[[str], object]
    doc: str
    choices: tuple = ()

    @property
    def by_device(self) -> bool:
        """Whether the switch holds one value per device type."""
        return isinstance(self.default, dict)

    def check(self, value: object) -> object:
        """``value`` as this switch holds it (parsed from text), or a ValueError naming the switch."""
        try:
            value = value if self.parse is _flag and isinstance(value, bool) else \
                _flag(str(value)) if self.parse is _flag else self.parse(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"tpflow switch {self.name} ({self.env}): {e}") from None
        if self.choices and value not in self.choices:
            raise ValueError(f"tpflow switch {self.name} ({self.env}) must be one of {self.choices}, got {value!r}")
        return value


SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("debug", "TPFLOW_DEBUG", False, _flag,
           "log every boxing route and matmul signature choice to stderr, each line with its rank"),
    Switch("timeout", "TPFLOW_TIMEOUT", 300.0, float,
           "seconds a collective of the process group tpflow sets up may wait: a rank that never arrives fails "
           "the job instead of hanging it (read when the group is made)"),
    Switch("kernels", "TPFLOW_KERNELS", "torch", str,
           "what computes the local products of CPU tensors: torch's matmul, or tpflow's Triton kernels through "
           "Triton's interpreter (TRITON_INTERPRET=1; how the tests check the kernels without a GPU). CUDA tensors "
           "always run the Triton kernels", ("torch", "triton")),
    Switch("matmul", "TPFLOW_MATMUL", "auto", str,
           "which Triton kernel: auto is the persistent TMA kernel where it can read the operands on a Hopper or "
           "datacenter Blackwell GPU (0.90-1.01x cuBLAS on an H100 against the tiled kernel's 0.75-0.84x, "
           "benchmarks/README.md), the tiled kernel elsewhere and under the interpreter",
           ("auto", "persistent", "tiled")),
    Switch("autotune", "TPFLOW_AUTOTUNE", True, _flag,
           "autotune the Triton kernels' tile configs per shape; off, one pinned config per kernel compiles (the "
           "tests pin it so that a GPU run compiles one variant per shape, not a sweep)"),
    Switch("ring_min_elements", "TPFLOW_RING_MIN_ELEMENTS", {"cpu": 2**18, "cuda": 2**24}, _size,
           "elements per message from which algo='auto' runs the ring collectives (all-gather + matmul, matmul + "
           "reduce-scatter) instead of one matmul and the plain collective. CPU: at 2^17 the ring's gain over 2 gloo "
           "ranks was within the VM's noise, at 2^19 it ran 0.86-0.91x of the plain path "
           "(benchmarks/collective_cpu.py). CUDA: an estimate until measured on two GPUs: at 2^24 elements, K = 4096 "
           "and two pieces a message, a piece's product takes about 105 us on an H100, past the 58-199 us a launch "
           "costs the host there"),
    Switch("ring_splits", "TPFLOW_RING_SPLITS", {"cpu": 1, "cuda": 2}, int,
           "messages per chunk of the reduce-scatter ring: with the accumulator added in the matmul's epilogue, a "
           "piece's transfer overlaps the next piece's compute (two pieces hid 86-99% of the transfer on an "
           "emulated link as slow as half the compute, one piece -14% to 20%; benchmarks/collective_cpu.py fake)"),
    Switch("ring_add_late", "TPFLOW_RING_ADD_LATE", {"cpu": True, "cuda": False}, _flag,
           "whether the reduce-scatter ring computes a piece's product while its accumulator crosses the link and "
           "adds it after, in a separate pass (only where the output keeps the partials' dtype). On 2 gloo ranks "
           "it ran 0.77-0.87x of matmul + reduce_scatter_tensor against 0.79-0.89x with the add in the epilogue; "
           "on CUDA the add stays fused and the pieces do the hiding"),
    Switch("triton_min_rows", "TPFLOW_TRITON_MIN_ROWS", {"cpu": 0, "cuda": 256}, _size,
           "products with fewer rows than this run torch's matmul even where the Triton kernels would (decode: a few "
           "tokens a step), since a Triton launch costs the host 58-199 us on an H100 against torch's 12-21 us "
           "(issue 16's measurement) while such a product computes in about 10 us. CUDA: an estimate until "
           "benchmarks/decode_gpu.py (make gpu-check) measures the crossover; CPU: 0, so the interpreter tests run "
           "the kernels at every size"),
    Switch("cpu_shared_memory", "TPFLOW_CPU_SHARED_MEMORY", True, _flag,
           "whether the all-reduces, all-gathers and reduce-scatters of CPU ranks on one host meet in shared memory "
           "(tpflow.comm.shm) instead of going through gloo: a 1 KiB all-reduce of 2 ranks took 59 us there against "
           "1,141 us in gloo (benchmarks/README.md). Read at each collective: set it alike on every rank"),
    Switch("grad_bucket_bytes", "TPFLOW_GRAD_BUCKET_BYTES", 4 << 20, _size,
           "bytes of partial-sum gradients summed by one all-reduce, a bucket (the flat copy is the memory this "
           "costs; DDP's first bucket is 1 MiB, the rest 25 MiB)"),
    Switch("grad_sync", "TPFLOW_GRAD_SYNC", {"cpu": "end", "cuda": "backward"}, str,
           "when tpflow sums its parameters' partial-sum gradients (data parallelism by SBP, a data axis): backward, "
           "a bucket at a time as the backward fills them, asynchronously, while it goes on (as DDP); end, every "
           "bucket once the backward ends; step, all of them before the optimizer's step (tpflow.global_tensor."
           "reducer). CPU: end, since CPU ranks share a host's cores with the collectives' threads: on 2 ranks, "
           "summed at the end the harness's SBP rows ran 0.90-0.95x DDP's step, during the backward 0.93-1.16x "
           "(benchmarks/README.md, At the end of issue 31); CUDA: backward, where NCCL sums beside the compute",
           ("backward", "end", "step")),
    Switch("pipeline_pairs", "TPFLOW_PIPELINE_PAIRS", {"cpu": False, "cuda": True}, _flag,
           "how a pipeline's hand-offs are posted: on, a send followed in the schedule by a receive from the same "
           "rank set goes out as one group with it (batch_isend_irecv), so that NCCL, where a rank's sends and "
           "receives to one peer share a stream, cannot deadlock on 1F1B's crossed pair; off, receives are posted "
           "ahead (the next micro-batch's, with the layout the step before had), which gloo allows. CUDA: untried "
           "on two GPUs yet (the GPU machines here have one)"),
    Switch("check_inputs", "TPFLOW_CHECK_INPUTS", "first", str,
           "whether a parallelized model checks that its tensor-parallel ranks were fed the same input in the same "
           "train() / eval() mode (a digest of it all-gathered at its first layer that reads whole data): first, on "
           "the first call of each of the first 8 input shapes (a model with dropout: every call with gradients "
           "on, its random states compared too); always, on every call (debugging; its cost is in "
           "benchmarks/README.md); off",
           ("first", "always", "off")),
)}

_SET: dict[str, object] = {}  # values set from code
_LOG = logging.getLogger("tpflow")


def _switch(name: str) -> Switch:
    if name not in SWITCHES:
        raise KeyError(f"tpflow has no switch {name!r}; its switches are {sorted(SWITCHES)}")
    return SWITCHES[name]


def _parse_env(switch: Switch, text: str) -> object:
    if switch.by_device and "=" in text:
        pairs = (item.split("=", 1) for item in text.split(",") if item.strip())
        return {kind.strip(): switch.check(value) for kind, value in pairs}
    return switch.check(text)


def _checked(switch: Switch, value: object) -> object:
    if switch.by_device and isinstance(value, dict):
        return {kind: switch.check(v) for kind, v in value.items()}
    return switch.check(value)


def source(name: str) -> str:
    """Where the value in force of switch ``name`` comes from: ``"code"``, ``"environment"`` or ``"default"``.

    Args:
        name: a key of ``SWITCHES``.

    Returns:
        ``"code"`` where ``set`` or ``override`` set it, else ``"environment"`` where its environment variable is
        set, else ``"default"``.

    Example::

        >>> tpf.config.source("kernels")
        'default'
    """
    switch = _switch(name)
    return "code" if name in _SET else "environment" if switch.env in os.environ else "default"


def _value(name: str) -> object:
    """The value in force of switch ``name``; for a per-device switch, a dict over every device type."""
    switch = _switch(name)
    if name in _SET:
        value = _SET[name]
    else:
        text = os.environ.get(switch.env)
        value = switch.default if text is None else _parse_env(switch, text)
    if not switch.by_device:
        return value
    return {**switch.default, **value} if isinstance(value, dict) else dict.fromkeys(switch.default, value)


def get(name: str, device: object = None) -> object:
    """The value in force of switch ``name``: set from code, else from its environment variable, else its default.

    Args:
        name: a key of ``SWITCHES``.
        device: for switches with a value per device type, the device (a ``torch.device`` or its type as a
            string) whose value to return; device types without an entry take the CUDA one.

    Returns:
        The switch's value, parsed (a bool, a number or one of the switch's choices).

    Example::

        >>> tpf.config.get("ring_splits", "cpu")
        1
    """
    value = _value(name)
    if not isinstance(value, dict):
        return value
    if device is None:
        raise ValueError(f"tpflow switch {name} has a value per device type: pass device= ('cpu', 'cuda' or a "
                         "torch.device)")
    return value.get(getattr(device, "type", device), value["cuda"])


def set(**values: object) -> None:
    """Set switches from code, for the rest of the process (until ``reset``); they win over the environment.

    Every value is checked before any is set, so a bad one changes nothing.

    Args:
        **values: switch name -> value (a dict by device type for the switches that have one).

    Example::

        >>> tpf.config.set(kernels="triton", autotune=False)
    """
    checked = {name: _checked(_switch(name), value) for name, value in values.items()}
    _SET.update(checked)


def reset(*names: str) -> None:
    """Forget the values set from code for ``names`` (all switches when none is named), so the environment and
    the defaults apply again.

    Args:
        *names: keys of ``SWITCHES``; an unknown name raises a KeyError.

    Example::

        >>> tpf.config.reset("kernels")
    """
    for name in names or list(_SET):
        _switch(name)
        _SET.pop(name, None)


@contextlib.contextmanager
def override(**values: object) -> Iterator[None]:
    """Set switches from code for a ``with`` block, then put back what was set before.

    Every value is checked before any is set, as by ``set``; they win over the environment inside the block.

    Args:
        **values: switch name -> value (a dict by device type for the switches that have one).

    Returns:
        A context manager for the ``with`` statement (``as`` binds None).

    Example::

        >>> with tpf.config.override(matmul="tiled"):
        ...     pass  # products of this block run the tiled kernel
    """
    before = {name: _SET[name] for name in values if name in _SET}
    set(**values)
    try:
        yield
    finally:
        for name in values:
            _SET.pop(name, None)
        _SET.update(before)


def describe() -> str:
    """Every switch, its value in force and where it came from, as a Markdown table.

    ``print(tpf.config.describe())`` shows what a run will use.

    Returns:
        The table: one row per switch, with its environment variable, value, source (as ``source`` says) and
        what it does.

    Example::

        >>> rows = tpf.config.describe().splitlines()
        >>> rows[0]
        '| switch | environment | value | from | what |'
        >>> rows[2].split(" | ")[:4]           # a switch, its variable, its value, where the value came from
        ['| debug', '`TPFLOW_DEBUG`', 'False', 'default']
    """
    rows = ["| switch | environment | value | from | what |", "|---|---|---|---|---|"]
    for name, switch in SWITCHES.items():
        rows.append(f"| {name} | `{switch.env}` | {_value(name)} | {source(name)} | {switch.doc} |")
    return "\n".join(rows)


def debug(message: str, *args: object) -> None:
    """Log ``message % args`` to stderr, with this process's rank, when the ``debug`` switch is on.

    The lines go to the ``tpflow`` logger; where it has no handler of the caller's own, one is added that
    writes to stderr with the ``RANK`` environment variable in every line's prefix.

    Args:
        message: a %-format string, formatted only when the line is logged.
        *args: the values it formats.

    Example::

        >>> tpf.config.debug("boxing %s -> %s", "split(0)", "broadcast")  # silent unless debug is on
    """
    if not get("debug"):
        return
    if not _LOG.handlers:  # a handler of the caller's own takes the lines instead
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[tpflow rank {os.environ.get('RANK', '0')}] %(message)s"))
        _LOG.addHandler(handler)
    _LOG.setLevel(logging.DEBUG)
    _LOG.debug(message, *args)

