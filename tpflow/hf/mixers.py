"""What mixes tokens in a decoder layer, as context parallelism must know it: attention run through transformers'
``AttentionInterface`` (which the split runs over the whole sequence), and everything else that reads other tokens
(a convolution over the sequence, a state space, linear attention, a recurrence), which a rank holding part of the
sequence would run without the earlier tokens' state and get silently wrong.

Attention a model computes in its own code (``own_attention``: GPT-J's, BLOOM's, the BERT family's) is told apart
from it: context parallelism runs it head parallel.

Each decoder layer's children are read by what they are: attention (``is_attention``), a norm, a linear layer, an
MLP or a mixture of experts (token-wise), dropout; any other child, or any of them holding a convolution or a token
shift (RWKV's channel mixing reads the token before), is a mixer context parallelism cannot split, refused by name.
"""

from __future__ import annotations

import functools
import inspect
import re

from torch import nn

from tpflow.hf.context_indexer import is_split_indexer
from tpflow.hf.heads import attention_heads

__all__ = ["HEAD_COUNTS", "UNKNOWN", "head_parallel_attentions", "interface_attention", "is_attention",
           "layer_mixers", "own_attention", "own_loss", "own_positions", "projection", "runs_head_parallel",
           "unsplit_mixers"]

UNKNOWN = "a token mixer tpflow does not know"
HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_heads", "n_head")  # an attention module's head count, by name
# what an attention's forward calls when it runs through transformers' AttentionInterface
_INTERFACE = ("ALL_ATTENTION_FUNCTIONS", "attention_interface", "eager_attention_forward")

# children that work token by token, by their class names; anything else in a decoder layer must be attention
_TOKENWISE = re.compile(r"Norm|MLP|Mlp|FeedForward|Moe|MoE|Expert|FFN|Ffn|Dropout|Identity|Linear$|Embedding|Act|"
                        r"GELU|SiLU|ReLU|Rotary|HyperConnection|GatedResidual|Intermediate|Output$|AltUp|Laurel")
_WHY = {"Conv": "a convolution over the sequence", "Mamba": "a state space", "Mixer": "a state space",
        "DeltaNet": "linear attention (a delta rule's state)",
        "DeltaAttention": "linear attention (a delta rule's state)",
        "ShortConvolution": "a depthwise convolution over the sequence of the residual stream itself (a small kernel "
                            "per feature, no projection to split with it)",
        "Lightning": "linear attention", "Linear": "linear attention", "Recurrent": "a recurrence",
        "RwkvFeedForward": "a token shift (RWKV's channel mixing)", "Rwkv": "a recurrence (RWKV's time mixing)",
        "LSTM": "a recurrence (xLSTM)", "Retention": "a recurrence",
        "Indexer": "a sparse-attention indexer tpflow does not split (neither DeepSeek-V3.2's nor Qwen4-Exp's: one "
                   "over keys its own compressors pool before any mask or cache, DeepSeek-V4's)"}


def is_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face attention module that runs its attention through transformers'
    ``AttentionInterface``: q / k / v projections and head counts, or fused ones (Phi-3's ``qkv_proj``, GPT-NeoX's
    ``query_key_value``) and MLA's latent ones, marked as transformers marks its attention modules (``config``,
    ``layer_idx``, ``scaling``, ``is_causal``).

    Args:
        module: any module.

    Returns:
        True or False.

    Example::

        >>> from transformers import Phi3Config, Phi3ForCausalLM
        >>> model = Phi3ForCausalLM(Phi3Config(vocab_size=64, hidden_size=16, intermediate_size=32, pad_token_id=0,
        ...                                    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
        >>> is_attention(model.model.layers[0].self_attn), is_attention(model.model.layers[0].mlp)
        (True, False)
    """
    if attention_heads(module) is not None:
        return True
    return all(hasattr(module, name) for name in ("config", "layer_idx", "scaling", "is_causal"))


def own_attention(module: nn.Module) -> bool:
    """Whether ``module`` is an attention module that computes its attention in its own code (GPT-J's ``_attn``,
    BLOOM's ``baddbmm`` with ALiBi, BERT's self-attention), not through transformers' ``AttentionInterface``: an
    ``*Attention`` of softmax attention (not linear attention, a state space, an indexer), with a head count,
    projections (``nn.Linear`` or GPT-2's ``Conv1D``), and a forward that calls no attention implementation.
    Context parallelism cannot put its ring inside such code: it runs it head parallel.

    Args:
        module: any module.

    Returns:
        True or False.

    Example::

        >>> from transformers import GPTJConfig, GPTJForCausalLM, LlamaConfig, LlamaForCausalLM
        >>> gptj = GPTJForCausalLM(GPTJConfig(vocab_size=64, n_embd=16, n_layer=1, n_head=4, rotary_dim=4))
        >>> llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                      num_hidden_layers=1, num_attention_heads=4))
        >>> own_attention(gptj.transformer.h[0].attn), own_attention(llama.model.layers[0].self_attn)
        (True, False)
    """
    if "Attention" not in type(module).__name__ or _why(module) != UNKNOWN:
        return False
    if not any(isinstance(getattr(module, a, None), int) for a in HEAD_COUNTS):
        return False
    return any(projection(c) for c in module.children()) and not _calls_interface(type(module))


@functools.cache
def _calls_interface(kind: type) -> bool:
    """Whether ``kind``'s forward calls transformers' ``AttentionInterface`` (or cannot be read)."""
    try:
        source = inspect.getsource(kind.forward)
    except (OSError, TypeError):
        return True
    return any(call in source for call in _INTERFACE)


def projection(module: nn.Module) -> bool:
    """Whether ``module`` is a projection: an ``nn.Linear`` or GPT-2's ``Conv1D`` (``y = x @ W + b``, ``W`` stored
    ``[in, out]``).

    Args:
        module: any module.

    Returns:
        True or False.

    Example::

        >>> from transformers.pytorch_utils import Conv1D
        >>> projection(nn.Linear(4, 4)), projection(Conv1D(4, 4)), projection(nn.LayerNorm(4))
        (True, True, False)
    """
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def interface_attention(module: nn.Module) -> bool:
    """Whether ``module`` is an attention module run through transformers' ``AttentionInterface`` (``is_attention``
    and not ``own_attention``), whose attention context parallelism replaces by its ring or Ulysses.

    Args:
        module: any module.

    Returns:
        True or False.

    Example::

        >>> from transformers import GPTJConfig, GPTJForCausalLM
        >>> gptj = GPTJForCausalLM(GPTJConfig(vocab_size=64, n_embd=16, n_layer=1, n_head=4, rotary_dim=4))
        >>> is_attention(gptj.transformer.h[0].attn), interface_attention(gptj.transformer.h[0].attn)
        (True, False)
    """
    return is_attention(module) and not own_attention(module)


def head_parallel_attentions(model: nn.Module) -> list[str]:
    """The attention modules of ``model``'s layers that compute their attention in their own code
    (``own_attention``), which context parallelism runs head parallel; their names.

    Args:
        model: a Hugging Face model.

    Returns:
        The names, in the model's order.

    Example::

        >>> from transformers import GPTJConfig, GPTJForCausalLM
        >>> head_parallel_attentions(GPTJForCausalLM(GPTJConfig(vocab_size=64, n_embd=16, n_layer=2, n_head=4,
        ...                                                      rotary_dim=4)))
        ['transformer.h.0.attn', 'transformer.h.1.attn']
    """
    found = {f"{list_name}.{index}{'.' if name else ''}{name}": None for list_name, layers in model.named_modules()
             if isinstance(layers, nn.ModuleList) for index, layer in enumerate(layers)
             for name, m in layer.named_modules() if own_attention(m)}
    return list(found)


def runs_head_parallel(module: nn.Module) -> bool:
    """Whether context parallelism runs ``module`` (a decoder layer's child ``layer_mixers`` does not know) head
    parallel as a whole: an attention computed in its own code (``own_attention``), or a wrapper whose only token
    mixers are such attention (BERT's ``attention``: ``self`` beside the token-wise ``output``).

    Args:
        module: a layer's child.

    Returns:
        True or False.

    Example::

        >>> from transformers import MambaConfig, MambaForCausalLM
        >>> model = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1))
        >>> runs_head_parallel(model.backbone.layers[0].mixer)
        False
    """
    if own_attention(module):
        return True
    inner = layer_mixers(module)
    return bool(inner) and all(why == UNKNOWN and runs_head_parallel(module.get_submodule(n)) for n, why in inner)


def _why(module: nn.Module) -> str:
    name = type(module).__name__
    named = next((why for key, why in _WHY.items() if key in name and key != "Conv"), None)
    if named is None and any(isinstance(m, (nn.Conv1d, nn.Conv2d)) for m in module.modules()):
        return _WHY["Conv"]
    return named or UNKNOWN


def unsplit_mixers(model: nn.Module) -> list[str]:
    """The modules of ``model``'s decoder layers that mix tokens other than by attention through transformers'
    ``AttentionInterface``, each as ``"name (Class): what it is"``; empty where context parallelism splits every one.

    Args:
        model: a model whose decoder layers are the items of its ``nn.ModuleList`` s.

    Returns:
        One line per module context parallelism cannot split.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> unsplit_mixers(LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                              num_hidden_layers=1, num_attention_heads=4)))
        []
    """
    return [f"{list_name}.{index}.{name} ({type(layer.get_submodule(name)).__name__}): {why}"
            for list_name, layers in model.named_modules() if isinstance(layers, nn.ModuleList)
            for index, layer in enumerate(layers) for name, why in layer_mixers(layer)]


def layer_mixers(layer: nn.Module) -> list[tuple[str, str]]:
    """The children of one decoder layer that mix tokens other than by attention through transformers'
    ``AttentionInterface``: each child's name and what it is (``UNKNOWN`` where tpflow cannot tell).

    Args:
        layer: a decoder layer.

    Returns:
        ``(child name, what it is)`` pairs; empty for an attention-and-MLP layer.

    Example::

        >>> from transformers import MambaConfig, MambaForCausalLM
        >>> model = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1))
        >>> layer_mixers(model.backbone.layers[0])
        [('mixer', 'a state space')]
    """
    found = []
    for name, child in layer.named_children():
        attention = any(is_attention(m) for m in child.modules())
        convolves = any(isinstance(m, (nn.Conv1d, nn.Conv2d)) for m in child.modules())
        if any("Indexer" in type(m).__name__ and not is_split_indexer(m) for m in child.modules()):
            found.append((name, _WHY["Indexer"]))
            continue
        shifts = any(isinstance(getattr(m, "time_shift", None), nn.ZeroPad2d) for m in child.modules())  # RWKV's
        tokenwise = (_TOKENWISE.search(type(child).__name__) or _tokenwise_sequence(child)) and not (
            convolves or shifts)
        if convolves or shifts or not (attention or tokenwise or isinstance(child, (nn.ModuleList, nn.ModuleDict))):
            found.append((name, _why(child)))
    return found


def _tokenwise_sequence(module: nn.Module) -> bool:
    """An ``nn.Sequential`` of token-wise layers alone (CTRL's feed-forward: linear, ReLU, linear)."""
    return isinstance(module, nn.Sequential) and len(module) > 0 and all(
        _TOKENWISE.search(type(m).__name__) for m in module)


def own_positions(model: nn.Module) -> str | None:
    """The learned position embedding of ``model`` that counts positions its own way when none are given (RoBERTa's:
    from ``padding_idx + 1``, past the padding), which the global positions context parallelism passes would
    replace; its name, or None.

    Args:
        model: a Hugging Face model.

    Returns:
        The embedding's name, or None.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> own_positions(LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                             num_hidden_layers=1, num_attention_heads=4)))
    """
    return next((name for name, m in model.named_modules() if isinstance(m, nn.Embedding) and "position" in name
                 and m.padding_idx is not None), None)


def own_loss(model: nn.Module) -> bool:
    """Whether ``model``'s forward computes its ``labels=`` loss in its own code rather than through transformers'
    ``loss_function`` (which takes the shifted labels context parallelism cuts to each rank's tokens).

    Args:
        model: a Hugging Face model.

    Returns:
        True where the loss is its own.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> own_loss(LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                        num_hidden_layers=1, num_attention_heads=4)))
        False
    """
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    return "labels" in source and "loss_function" not in source
