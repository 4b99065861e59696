"""The Hugging Face wing's front door, ``tpf.parallelize``: a plan read as a Hugging Face model needs it, then the
engine (``tpflow.plans``) run on it.

Before the engine: PEFT's layers lifted out (their base layers planned), ``plan="auto"`` read (``tpf.hf_plan``),
Hugging Face's style names read as entries (``tpflow.hf.styles``), the attentions' heads said
(``tpflow.hf.head_columns``). After it: PEFT's layers put back as their base layers lie, ``save_pretrained`` writing
whole tensors, ``generate`` alike on every rank, and the placement marked for the trainers (``tpf.adopt``).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from tpflow.hf.adapters import Lifted, wrapped_model
from tpflow.hf.decoding import decode_alike
from tpflow.hf.frameworks import mark
from tpflow.hf.head_columns import with_heads
from tpflow.hf.peft_calls import follow_peft
from tpflow.hf.plan import hf_plan
from tpflow.hf.pretrained import export_whole
from tpflow.hf.styles import entries
from tpflow.placement import Placement
from tpflow.plans.parallelize import applied, checked, settled

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
            ``"sequence_parallel"``, ...; ``tpflow.hf.styles.NAMES``), entries with options
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
    follow_peft()  # PEFT's own get_peft_model, save_pretrained and loading take the split model
    lifted = Lifted(model)  # PEFT's layers out while the plan is matched and applied, their base layers in place
    try:
        if not isinstance(plan, Mapping) and plan != "auto":
            raise ValueError(f"plan must be 'auto' or a dict of module-name patterns to entries, got {plan!r}")
        plan = hf_plan(model) if plan == "auto" else with_heads(model, entries(plan))
        matched = checked(model, placement, plan)
        lifted.check(matched)
    except BaseException:
        lifted.restore()
        raise
    applied(matched)
    lifted.put_back(matched)  # each adapter laid out as its base layer
    settled(matched)
    inner = wrapped_model(model)[0]
    export_whole(model)
    if inner is not model:  # what a PEFT model's merge_and_unload gives back saves whole too
        export_whole(inner)
        mark(inner, matched.batches, (placement, plan))
    decode_alike(model, matched.placement)
    mark(model, matched.batches, (placement, plan))
    return model
