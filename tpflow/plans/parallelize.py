"""``parallelize(model, placement=, plan=)``: a plan's entries applied to a model, in place.

    plan = {"*.fc1": "column", "*.fc2": "row"}                       # fnmatch patterns of module names
    plan = {"*.q_proj": "column", "*.o_proj": tpf.RowParallel(sequence_parallel=True)}
    plan = {"*.[qkv]_proj": tpf.ColumnParallel(fuse=True), "*.o_proj": "row"}   # q, k, v as one product
    plan = {"*.wq": ColwiseParallel(), "*.wo": RowwiseParallel()}   # torch's own styles

The driver of the entries' two steps (``tpf.Style``): the plan matched, every match checked, every match applied,
what no entry split replicated. What an entry does is the entry's; what entries share has its own module (fusion,
ties, agreement).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from tpflow.frameworks import mark
from tpflow.layers.replicated import replicate
from tpflow.placement import Placement
from tpflow.plans.adapters import Lifted, wrapped_model
from tpflow.plans.agreement import agree, check_buffers
from tpflow.plans.decoding import decode_alike
from tpflow.plans.fsdp import expect_fsdp
from tpflow.plans.inputs import check_inputs, draws_random
from tpflow.plans.matching import match
from tpflow.plans.peft_calls import follow_peft
from tpflow.plans.pretrained import export_whole
from tpflow.plans.random_streams import split_streams
from tpflow.plans.ties import Ties

__all__ = ["parallelize"]


def parallelize(model: nn.Module, *, placement: Placement, plan: Mapping[str, object] | str) -> nn.Module:
    """Apply ``plan``'s entries to the modules whose names match its patterns (column and row entries replace
    ``nn.Linear`` modules, ``"vocab"`` ones an ``nn.Embedding`` or a head, ...), and make every other parameter a
    global tensor too; returns ``model``.

    Patterns are ``fnmatch`` patterns over ``named_modules()`` names (``*`` crosses dots, so
    ``"*.fc1"`` matches ``"blocks.0.mlp.fc1"``). Every pattern must match at least one module, and no module may
    match two patterns. Then every match's entry checks its module (a column or row entry takes an ``nn.Linear``,
    an attention module's heads must split over the tensor-parallel ranks, ...): any error names the pattern and
    the fix, and is raised before the model is changed, on every rank alike. Then every entry applies itself
    (``tpf.Style.apply``); an entry of the user's own (a ``tpf.Style`` subclass) goes through the same steps.

    Each matched ``nn.Linear`` is replaced by a layer holding its values (each rank keeps its block), so a
    model built and loaded on one device, the same on every rank, becomes a tensor-parallel one. A module
    shared under two names becomes one layer under both, if their entries agree. A tied embedding and head
    planned ``"vocab"`` hold the same block of one matrix and stay one parameter; a parameter a planned layer
    shares with a module outside the plan would come untied, which is an error too. A ``"vocab"`` head's logits
    come back as a global tensor split over the vocabulary, and the model's own ``F.cross_entropy`` after it runs
    vocabulary-parallel (``tpflow.plans.logits``). The
    ``ColumnParallel(fuse=True)`` layers of one parent module become one fused group (``ColumnGroup``).

    Every parameter no entry replaces (norms, embeddings, biases of other modules) stays whole on every rank as
    a global tensor broadcast over ``placement`` (``tpflow.layers.replicated``): the model's parameters are
    then all DTensors, as ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim`` need, and each gets one
    device's gradient: where a module sees only this rank's part of the data (a per-head norm, a norm on this
    rank's tokens) its gradients are summed over the ranks. With fewer key/value heads than ranks, the k / v
    projections stay whole and each rank keeps its head (``tpflow.plans.heads``).

    A PEFT model (``get_peft_model(model, LoraConfig(...))``) is planned as the model it wraps, and each LoRA adapter
    follows its base layer's layout (``tpflow.plans.adapters``); its ``save_pretrained`` writes PEFT's adapter files.

    Args:
        model: the model to change, in place.
        placement: the ranks its parallel layers live on (``tpf.placement``); on a 2-D placement the last
            axis is tensor parallel and the others data parallel: tpflow's own (SBP) data parallelism on an
            unnamed placement; on a named one (``names=("dp", "tp")``) the layers live on the last axis' slice
            (``placement["tp"]``) and the data axes are left to PyTorch's FSDP2, ``fully_shard(block,
            mesh=placement.mesh["dp"])`` on each block and on the model, which the first forward checks (column
            layers are not fused there: FSDP2 owns the weights, gathering and freeing them around each forward).
        plan: ``"auto"``: a Hugging Face model's own plan (``tpf.hf_plan(model)``); or ``fnmatch`` patterns over
            module names, each mapped to its entry: ``"column"`` (W split(1)), ``"row"`` (W split(0)),
            ``"vocab"`` (an embedding or a head split over the vocabulary), Hugging Face's names (``"colwise"``,
            ``"rowwise"``, ``"colwise_gather_output"``, ``"embedding_rowwise"``, ``"replicated_with_grad_allreduce"``,
            ``"sequence_parallel"``, ...; ``tpflow.plans.names.STYLES``), entries with options
            (``tpf.ColumnParallel(...)``, ``tpf.RowParallel(...)``, ``tpf.VocabParallel(...)``, ``tpf.Replicated(...)``,
            ``tpf.SequenceParallel(...)``, ...), a ``tpf.Style`` of the user's own, or torch's own styles
            (``ColwiseParallel()``, ``RowwiseParallel(...)``, ``SequenceParallel()``, ``PrepareModuleInput(...)``:
            ``tpflow.plans.torch_styles``), read as tpflow's entries or refused with what to write instead.

    Returns:
        ``model`` itself, its matched modules parallelized.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                          # the same model on every rank
        >>> block = nn.Sequential()
        >>> block.mlp = nn.Sequential()
        >>> block.mlp.fc1, block.mlp.act, block.mlp.fc2 = nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)
        >>> model = tpf.parallelize(block, placement=P, plan={"*.fc1": "column", "*.fc2": "row"})
        >>> type(model.mlp.fc1).__name__, type(model.mlp.fc2).__name__
        ('ColumnParallelLinear', 'RowParallelLinear')
        >>> model(torch.randn(8, 512)).shape                  # the whole output on every rank
        torch.Size([8, 512])
    """
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a tpf.placement(type, ranks), got {placement!r}")
    check_buffers(model)
    follow_peft()  # PEFT's own get_peft_model, save_pretrained and loading take the split model
    lifted = Lifted(model)  # PEFT's layers out while the plan is matched and applied, their base layers in place
    try:
        matched = match(model, placement, plan)  # names, "auto" and torch's styles read as entries; patterns matched
        agree(matched)
        ties = Ties(matched)
        for name, module, entry in matched.each():  # every check before the first change
            entry.check(name, module, matched)
        lifted.check(matched)
    except BaseException:
        lifted.restore()
        raise
    for name, module, entry in matched.each():
        layer = entry.apply(name, module, matched)
        if layer is not None:
            matched.swap(module, layer)
    ties.join(matched)
    matched.finish()
    lifted.put_back(matched)  # each adapter laid out as its base layer
    replicate(model, matched.placement, matched.grads)  # what no entry split: whole on every rank
    inner = wrapped_model(model)[0]
    export_whole(model)
    if inner is not model:  # what a PEFT model's merge_and_unload gives back saves whole too
        export_whole(inner)
        mark(inner, matched.batches)
    decode_alike(model, matched.placement)
    random = draws_random(model)
    if random:
        split_streams(model, matched.placement)
    reader = matched.first_whole_reader()
    if reader is not None:
        check_inputs(model.get_submodule(reader), reader, matched.placement, random=random)
    expect_fsdp(model, matched.named)
    mark(model, matched.batches)
    return model
