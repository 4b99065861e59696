"""The engine's driver: a plan's entries applied to a model, in place, in three phases that a wing can step between.

    plan = {"*.fc1": "column", "*.fc2": "row"}                       # fnmatch patterns of module names
    plan = {"*.q_proj": "column", "*.o_proj": tpf.RowParallel(sequence_parallel=True)}
    plan = {"*.[qkv]_proj": tpf.ColumnParallel(fuse=True), "*.o_proj": "row"}   # q, k, v as one product
    plan = {"*.wq": ColwiseParallel(), "*.wo": RowwiseParallel()}   # torch's own styles

``checked``: the plan matched, every match checked (nothing changed yet); ``applied``: every match applied, tied
parameters joined, the steps entries left for the end run; ``settled``: what no entry split replicated, and the
aspects a split model needs on every call where they apply (random streams, the ranks' inputs checked alike, FSDP2
expected on a named placement's data axes). What an entry does is the entry's; what entries share has its own
module (fusion, ties, agreement). The engine knows no model family: ``tpf.parallelize`` is the Hugging Face wing's
front door (``tpflow.hf``), which reads ``plan="auto"`` and Hugging Face's names, then runs these phases.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from tpflow.layers.replicated import replicate
from tpflow.placement import Placement
from tpflow.plans.agreement import agree, check_buffers
from tpflow.plans.fsdp import expect_fsdp
from tpflow.plans.inputs import check_inputs, draws_random
from tpflow.plans.matching import match
from tpflow.plans.random_streams import split_streams
from tpflow.plans.style import Plan
from tpflow.plans.ties import Ties

__all__ = ["applied", "checked", "parallelize", "settled"]


def parallelize(model: nn.Module, *, placement: Placement, plan: Mapping[str, object]) -> nn.Module:
    """The engine alone: ``plan``'s entries applied to the modules whose names match its patterns, every other
    parameter made a global tensor broadcast over ``placement``; returns ``model``. ``tpf.parallelize`` is this plus
    what Hugging Face models need (``plan="auto"``, Hugging Face's style names, attention heads, PEFT,
    ``save_pretrained`` / ``generate``): see it for the whole story.

    Args:
        model: the model to change, in place.
        placement: the ranks its parallel layers live on; the last axis is tensor parallel.
        plan: ``fnmatch`` patterns over module names, each mapped to an entry (``tpf.Style``), one of tpflow's names
            (``"column"``, ``"row"``, ``"vocab"``) or one of torch's own styles.

    Returns:
        ``model`` itself.

    Example::

        >>> from tpflow.plans import parallelize
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                          # the same model on every rank
        >>> mlp = parallelize(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)), placement=P,
        ...                   plan={"0": "column", "2": "row"})
        >>> type(mlp[0]).__name__, mlp(torch.randn(4, 8)).shape
        ('ColumnParallelLinear', torch.Size([4, 8]))
    """
    settled(applied(checked(model, placement, plan)))
    return model


def checked(model: nn.Module, placement: Placement, plan: Mapping[str, object]) -> Plan:
    """``plan`` matched against ``model`` and every match checked, alike on every rank: any error names the pattern
    and the fix, raised before anything changes.

    Args:
        model: the model.
        placement: the ranks, as the user gave them.
        plan: patterns mapped to entries, tpflow's names or torch's styles.

    Returns:
        The matched plan (``tpflow.plans.style.Plan``), for ``applied``.

    Example::

        >>> plan = checked(nn.Sequential(nn.Linear(4, 8)), tpf.placement("cpu", ranks=[0, 1]), {"0": "column"})
        >>> plan.entry("0")
        ColumnParallel(gather_output=False, sequence_parallel=False, algo='auto', keep_gathered=True, \
sequence_dim=0, fuse=False)
    """
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a tpf.placement(type, ranks), got {placement!r}")
    check_buffers(model)
    matched = match(model, placement, plan)
    agree(matched)
    ties = Ties(matched)
    matched.at_end(Ties, lambda: ties.join(matched))  # the first step after the entries: one parameter again
    for name, module, entry in matched.each():  # every check before the first change
        entry.check(name, module, matched)
    return matched


def applied(plan: Plan) -> Plan:
    """Every match of a ``checked`` plan applied (each entry's layer swapped in, or its module changed in place),
    tied parameters joined, then the steps entries left for the end (fused groups, hooks that need the whole model).

    Args:
        plan: the checked plan.

    Returns:
        ``plan``, for ``settled``.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8))
        >>> _ = applied(checked(model, tpf.placement("cpu", ranks=[0, 1]), {"0": "column"}))
        >>> type(model[0]).__name__
        'ColumnParallelLinear'
    """
    for name, module, entry in plan.each():
        layer = entry.apply(name, module, plan)
        if layer is not None:
            plan.swap(module, layer)
    plan.finish()
    return plan


def settled(plan: Plan) -> Plan:
    """The model of an ``applied`` plan made whole: every parameter no entry split a global tensor broadcast over the
    placement (its gradient one device's), and the aspects that apply to it: random streams per rank where it draws
    random numbers, the ranks' inputs checked alike at its first layer reading them whole, FSDP2 expected on a named
    placement's data axes.

    Args:
        plan: the applied plan.

    Returns:
        ``plan``.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
        >>> _ = settled(applied(checked(model, tpf.placement("cpu", ranks=[0, 1]), {"0": "column"})))
        >>> tpf.get_sbp(model[1].weight)                       # whole on every rank
        (sbp.broadcast,)
    """
    model = plan.model
    replicate(model, plan.placement, plan.grads)  # what no entry split: whole on every rank
    random = draws_random(model)
    if random:
        split_streams(model, plan.placement)
    reader = plan.first_whole_reader()
    if reader is not None:
        check_inputs(model.get_submodule(reader), reader, plan.placement, random=random)
    expect_fsdp(model, plan.named)
    return plan
