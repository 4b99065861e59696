"""The processes a framework sees once a model is split: its data-parallel rows (``tpflow.hf.frameworks.rows``).

``Trainer``, TRL's trainers and accelerate read the process grid in two places, and each is given the rows there,
so every call site (a gather captured in a constructor, a scheduler's step count, a sampler, a reward's mean) sees
one process per row without being named:

- **accelerate's state** (``PartialState``, ``AcceleratorState``, which ``TrainingArguments`` and every
  ``Accelerator`` read): ``num_processes`` is the number of rows, ``process_index`` this rank's row. The main
  process is row 0's leader only (``is_main_process``, ``is_last_process``'s row's leader, ``on_process``;
  ``Trainer``'s ``should_save``, ``should_log``, ``is_world_process_zero``), so one rank writes what a process
  writes; ``local_process_index`` stays the rank's own on its node (it picks the rank's GPU), so each node's main
  process is its first rank. The state is distributed wherever the world is (``use_distributed``, by which
  accelerate runs main-process-only code on every process of a world of one), and ``Trainer``'s
  ``main_process_first`` holds the other ranks back even where the rows are one.
- **their collectives**: the modules of accelerate, TRL and transformers' ``Trainer`` read ``torch.distributed``
  (as ``torch.distributed`` or ``dist``) through a view whose default group is the rows: a gather, reduction or
  all-to-all runs over this rank's column (its tensor-parallel coordinate in every row, which holds what its row's
  leader holds), a broadcast "from process p" sends row p's leader's value to every rank, a barrier holds every
  rank, and their teardown of the world (accelerate's ``end_training``) leaves it to tpflow's at exit. An explicit
  ``group=`` is the caller's own and passes through.

A global tensor reaching accelerate's gather (split logits, or their argmax) is made whole first (every rank
gathers it, as every rank calls the gather), so an evaluation loop gathers what one device holds; any other
collective given a split global tensor raises what to do. tpflow's own code uses torch.distributed directly: it
keeps the world.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import types
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from tpflow.global_tensor.collectives import collective_misuse
from tpflow.hf.frameworks.rows import current, release

__all__ = ["forget", "install", "whole_for_collective"]

# torch.distributed's functions with a default group, by how a framework's default group maps onto the rows:
# over this rank's column (the argument naming a peer process, a row, beside), from a row's leader, over every rank
_COLUMN = {"all_gather": None, "all_gather_into_tensor": None, "all_gather_object": None, "all_reduce": None,
           "all_gather_coalesced": None, "all_reduce_coalesced": None, "reduce_scatter": None,
           "reduce_scatter_tensor": None, "all_to_all": None, "all_to_all_single": None, "reduce": "dst",
           "gather": "dst", "gather_object": "dst", "scatter": "src", "scatter_object_list": "src", "send": "dst",
           "recv": "src", "isend": "dst", "irecv": "src", "send_object_list": "dst", "recv_object_list": "src"}
_FROM_LEADER = ("broadcast", "broadcast_object_list")
_EVERY_RANK = ("barrier", "monitored_barrier")


def whole_for_collective(t: torch.Tensor, name: str) -> torch.Tensor:
    """What a collective may read of ``t``: a global tensor broadcast over its placement is the same block on every
    rank (its local tensor, written in place); a split or partial one is refused with what to do.

    Args:
        t: a collective's tensor argument.
        name: the collective, for the message.

    Returns:
        ``t``, or a replicated global tensor's local tensor.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> whole_for_collective(tpf.ones(4, placement=P, sbp=tpf.sbp.broadcast), "all_reduce").shape
        torch.Size([4])
    """
    if not isinstance(t, DTensor):
        return t
    if all(isinstance(p, Replicate) for p in t.placements):
        return t.to_local()
    raise collective_misuse(name, t)


def _plain(value: object, name: str) -> object:
    if isinstance(value, torch.Tensor):
        return whole_for_collective(value, name)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return [whole_for_collective(v, name) for v in value]
    return value


def _framework_collective(name: str) -> Callable:
    """torch.distributed's ``name``, its default group read as the rows (see the module's docstring)."""
    signature = inspect.signature(getattr(dist, name))
    peer = _COLUMN.get(name)

    @functools.wraps(getattr(dist, name))
    def collective(*args, **kwargs):
        real = getattr(dist, name)  # looked up on each call: a patch of torch's applies
        rows = current()
        bound = signature.bind(*args, **kwargs)
        arguments = bound.arguments
        if rows is None or arguments.get("group") is not None:
            return real(*args, **kwargs)
        for key, value in list(arguments.items()):
            if "object" not in key:  # an object list is filled in place: left as it is
                arguments[key] = _plain(value, name)
        if name in _COLUMN:
            arguments["group"] = rows.column
            if peer is not None and arguments.get(f"group_{peer}") is None:  # a framework's process is a row
                arguments[f"group_{peer}"] = arguments.pop(peer, None) or 0
        elif name in _FROM_LEADER:
            source = arguments.pop("group_src", None)
            source = arguments.get("src") if source is None else source
            arguments["src"] = rows.leaders[source or 0]
        return real(*bound.args, **bound.kwargs)

    return collective


def _rank(group: dist.ProcessGroup | None = None) -> int:
    rows = current()
    return dist.get_rank(group) if rows is None or group is not None else rows.row


def _world_size(group: dist.ProcessGroup | None = None) -> int:
    rows = current()
    return dist.get_world_size(group) if rows is None or group is not None else rows.rows


def _destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    """A framework's teardown of its world (accelerate's ``end_training``): the world is tpflow's, whose placements
    hold its groups, and tpflow tears it down at exit (``tpflow.world``), so a script may go on using the model."""
    if current() is None or group is not None:
        dist.destroy_process_group(group)


def _module_view(name: str, real: types.ModuleType, overrides: dict[str, object]) -> types.ModuleType:
    """A module object whose names are ``real``'s, looked up there on each use (a patched one too), but
    ``overrides``."""

    class View(types.ModuleType):
        def __getattr__(self, attr: str) -> object:
            return getattr(real, attr)

    view = View(name, real.__doc__)
    view.__dict__.update(overrides)
    return view


_VIEWED = (*_COLUMN, *_FROM_LEADER, *_EVERY_RANK)
_DIST = _module_view("torch.distributed", dist, {
    **{name: _framework_collective(name) for name in _VIEWED if hasattr(dist, name)},
    "get_rank": _rank, "get_world_size": _world_size, "destroy_process_group": _destroy_process_group})
_TORCH = _module_view("torch", torch, {"distributed": _DIST})
_SWAP = {id(torch): _TORCH, id(dist): _DIST,  # what a framework's module may bind, and what it binds instead
         **{id(getattr(dist, name)): view for name, view in vars(_DIST).items() if callable(view)
            and hasattr(dist, name)}}
_SCOPE = re.compile(r"(accelerate|trl)(\.|$)|transformers\.(trainer|training_args)")  # the frameworks' modules


def _rebind_modules() -> None:
    """The frameworks' loaded modules read torch.distributed through the view (a name bound to torch, to
    torch.distributed, or to one of its functions)."""
    for module_name, module in list(sys.modules.items()):
        if module is None or not _SCOPE.match(module_name):
            continue
        names = vars(module)
        for key, value in list(names.items()):
            swap = _SWAP.get(id(value))
            if swap is not None and not key.startswith("__"):
                names[key] = swap


class _Counted:
    """accelerate's ``num_processes`` / ``process_index``: the rows' while the frameworks see rows, else the value
    accelerate set (kept in its state's dict, read again once the rows are released)."""

    def __init__(self, name: str, of_rows: Callable) -> None:
        self.name, self.of_rows = name, of_rows

    def __get__(self, state: object, owner: type | None = None) -> object:
        if state is None:
            return self
        if self.name not in state.__dict__:
            raise AttributeError(self.name)  # accelerate's __getattr__ says the state was reset
        rows = current()
        return state.__dict__[self.name] if rows is None else self.of_rows(rows)

    def __set__(self, state: object, value: object) -> None:
        state.__dict__[self.name] = value


def _leader_only(getter: Callable) -> property:
    """A property that is True on the row's leader only (where ``getter`` says so): what writes once a process."""

    def leading(self) -> bool:
        rows = current()
        return getter(self) and (rows is None or rows.leader)

    return property(leading)


def _distributed(getter: Callable) -> property:
    """accelerate's ``use_distributed``: the world's, while the frameworks see rows (a world of one row is still
    several ranks, of which one writes)."""

    def distributed(self) -> bool:
        return getter(self) or (current() is not None and dist.get_world_size() > 1
                                and self.distributed_type.value != "NO")

    return property(distributed)


def _on_leader(on_process: Callable) -> Callable:
    """accelerate's ``on_process(function, process_index)``: on that row's leader only."""

    @functools.wraps(on_process)
    def on_leader(self, function: Callable | None = None, process_index: int | None = None):
        if function is None:
            return functools.partial(on_leader, self, process_index=process_index)
        rows = current()
        chosen = on_process(self, function, process_index)
        return chosen if rows is None or rows.leader else (lambda *args, **kwargs: None)

    return on_leader


def _first_over_every_rank(main_process_first: Callable) -> Callable:
    """``TrainingArguments.main_process_first``: while the frameworks see rows, accelerate's own (the main process,
    or each node's, then every other rank), which holds the ranks even where the rows are one."""

    @functools.wraps(main_process_first)
    def first(self, local: bool = True, desc: str = "work"):
        if current() is None or self.distributed_state is None:
            return main_process_first(self, local, desc)
        state = self.distributed_state
        return state.local_main_process_first() if local else state.main_process_first()

    return first


def _install_once(cls: type, attributes: dict[str, object]) -> None:
    """Set ``attributes`` on a framework's class, once (``install`` runs at each ``parallelize`` and ``adopt``)."""
    if not cls.__dict__.get("_tpflow_rows"):
        for name, value in attributes.items():
            setattr(cls, name, value)
        cls._tpflow_rows = True


def install() -> None:
    """Give the frameworks the rows (see the module's docstring): accelerate's state and main process (imported now
    where installed, so arguments built later read the rows), ``Trainer``'s where transformers' trainer is loaded,
    and the view of torch.distributed in the frameworks' loaded modules. Idempotent; ``adopt`` calls it again for
    modules loaded since.

    Example::

        >>> install()      # parallelize and adopt call it
    """
    try:
        from accelerate.state import AcceleratorState, PartialState
        from accelerate.utils import operations
    except ImportError:
        return
    counts = {"num_processes": _Counted("num_processes", lambda rows: rows.rows),
              "process_index": _Counted("process_index", lambda rows: rows.row)}
    _install_once(AcceleratorState, counts)  # the rest of it is PartialState's
    own = PartialState.__dict__
    _install_once(PartialState, {**counts, "is_main_process": _leader_only(own["is_main_process"].fget),
                                 "is_last_process": _leader_only(own["is_last_process"].fget),
                                 "use_distributed": _distributed(own["use_distributed"].fget),
                                 "on_process": _on_leader(own["on_process"])})
    if not getattr(operations._gpu_gather, "_tpflow_rows", False):
        operations._gpu_gather = _gathers_whole(operations._gpu_gather, operations.recursively_apply)
    arguments = sys.modules.get("transformers.training_args")
    if arguments is not None:
        own = arguments.TrainingArguments.__dict__
        _install_once(arguments.TrainingArguments, {
            "should_save": _leader_only(own["should_save"].fget), "should_log": _leader_only(own["should_log"].fget),
            "main_process_first": _first_over_every_rank(own["main_process_first"])})
    trainer = sys.modules.get("transformers.trainer")
    if trainer is not None:
        own = trainer.Trainer.__dict__
        _install_once(trainer.Trainer, {"is_world_process_zero": _leader_only(own["is_world_process_zero"]).fget})
    _rebind_modules()


def _gathers_whole(gather: Callable, recursively_apply: Callable) -> Callable:
    """accelerate's gather, global tensors made whole first (``full_tensor``: every rank takes part, as every rank
    gathers)."""

    @functools.wraps(gather)
    def gathers_whole(tensor):
        tensor = recursively_apply(lambda t: t.full_tensor(), tensor, test_type=lambda t: isinstance(t, DTensor))
        return gather(tensor)

    gathers_whole._tpflow_rows = True
    return gathers_whole


def forget() -> None:
    """The frameworks see the world again (``rows.release``), and accelerate's state, read under the rows (or set up
    for another run), is reset: for a process that goes on without the model, such as a test's worker.

    Example::

        >>> forget()
        >>> tpf.frameworks.rows.current() is None
        True
    """
    release()
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()
