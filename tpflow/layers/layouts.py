"""Layouts said in SBP: a parallel layer's (or a plan style's) input and output over the tensor-parallel axis, given as
``input_sbp=`` / ``output_sbp=``, and the older flags that say the same.

A column layer reads the whole input (``sbp.broadcast``) or this rank's tokens (``sbp.split(0)``, sequence
parallelism) and hands on this rank's features (``sbp.split(-1)``) or the whole output (``sbp.broadcast``). Those
choices were first said with flags (``sequence_parallel``, ``gather_output``, ...), which stay as aliases: ``Layouts``
maps each SBP onto the flag values it stands for, refuses an SBP the layer cannot take and a flag given beside an SBP
that says otherwise, and reads the SBPs back from the flags. Layers and styles keep storing the flags, so a style's
``==``, ``hash``, ``repr``, ``dataclasses.asdict`` and ``dataclasses.replace`` are what they were, in either spelling.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import NamedTuple

from tpflow.sbp import Sbp, split

__all__ = ["Layouts", "Side", "sequence_splits"]


class Side(NamedTuple):
    """The layouts one side of a layer (its input, or its output) takes over the tensor-parallel axis.

    Args:
        choices: each SBP the side takes, mapped to the values of the flags it stands for. None as a choice is "as
            the module gives it": a side the style leaves alone.
        says: the choices in words, for the error that refuses another one.

    Example::

        >>> side = Side({tpf.sbp.split(-1): {"gather_output": False}, tpf.sbp.broadcast: {"gather_output": True}},
        ...             "sbp.split(-1) (this rank's features) or sbp.broadcast (the whole output)")
        >>> side.choices[tpf.sbp.broadcast]
        {'gather_output': True}
    """

    choices: Mapping[Sbp | None, Mapping[str, object]]
    says: str


def sequence_splits(**flags: object) -> dict[Sbp, dict[str, object]]:
    """The choices ``split(0)`` and ``split(1)`` of a side split over the sequence dim (Megatron's ``[seq, batch,
    hidden]``, Hugging Face's ``[batch, seq, hidden]``), each with ``flags`` and its ``sequence_dim``.

    Args:
        flags: the other flag values both choices stand for (``sequence_parallel=True``).

    Returns:
        ``{split(0): {**flags, "sequence_dim": 0}, split(1): {**flags, "sequence_dim": 1}}``.

    Example::

        >>> sequence_splits(sequence_parallel=True)[tpf.sbp.split(1)]
        {'sequence_parallel': True, 'sequence_dim': 1}
    """
    return {split(dim): {**flags, "sequence_dim": dim} for dim in (0, 1)}


class Layouts:
    """The layouts a layer's (or a style's) sides take, each SBP with the flag values it stands for: what turns
    ``input_sbp=`` / ``output_sbp=`` into the flags the layer reads, and the flags back into SBPs.

    Args:
        defaults: every flag's value when neither it nor an SBP standing for it is given (the layers' defaults; a
            style's are its dataclass fields').
        sides: per keyword (``input_sbp``, ``output_sbp``), the ``Side`` it says.

    Example::

        >>> column = tpf.ColumnParallelLinear.layouts
        >>> column.resolve("ColumnParallelLinear", {"output_sbp": tpf.sbp.broadcast, "algo": "ring"})
        {'algo': 'ring', 'gather_output': True}
        >>> column.resolve("ColumnParallelLinear", {"output_sbp": tpf.sbp.broadcast, "gather_output": False})
        Traceback (most recent call last):
            ...
        ValueError: ColumnParallelLinear: output_sbp=sbp.broadcast says gather_output=True, but gather_output=False \
is given beside it: drop gather_output (the older spelling of output_sbp)
    """

    def __init__(self, *, defaults: Mapping[str, object] | None = None, **sides: Side) -> None:
        self.sides, self.defaults = sides, dict(defaults or {})

    def resolve(self, owner: str, options: Mapping[str, object], fill: bool = False) -> dict[str, object]:
        """``options`` with its SBP keywords replaced by the flag values they stand for.

        A flag given as None is not given (the layers' signatures default their flags to None).

        Args:
            owner: the layer or style the options are for, named in errors.
            options: keyword options, SBP keywords and flags among them.
            fill: give every flag that is still unset its default.

        Returns:
            The options without SBP keywords, the flags they stand for set.

        Raises:
            ValueError: an SBP the side does not take, two SBPs that disagree on a flag, or a flag given beside an
                SBP that says otherwise; the message names the fix.

        Example::

            >>> tpf.RowParallelLinear.layouts.resolve("RowParallelLinear", {"output_sbp": tpf.sbp.split(1)})
            {'sequence_parallel': True, 'sequence_dim': 1}
        """
        options = dict(options)
        said: dict[str, tuple[object, str, object]] = {}  # flag -> (value, the keyword saying it, its SBP)
        for keyword, side in self.sides.items():
            if keyword not in options:
                continue
            sbp = options.pop(keyword)
            if sbp is None and None not in side.choices:
                continue  # not given
            try:
                flags = side.choices[sbp]
            except (KeyError, TypeError):  # TypeError: unhashable, not an SBP at all
                raise ValueError(f"{owner} takes {keyword}={side.says}, got {sbp!r}") from None
            for flag, value in flags.items():
                if flag in said and said[flag][0] != value:
                    _, other, other_sbp = said[flag]
                    raise ValueError(f"{owner}: {other}={other_sbp!r} says {flag}={said[flag][0]!r}, but "
                                     f"{keyword}={sbp!r} says {flag}={value!r}: give layouts that agree")
                said[flag] = (value, keyword, sbp)
        for flag, (value, keyword, sbp) in said.items():
            given = options.get(flag)
            if given is not None and given != value:
                raise ValueError(f"{owner}: {keyword}={sbp!r} says {flag}={value!r}, but {flag}={given!r} is given "
                                 f"beside it: drop {flag} (the older spelling of {keyword})")
            options[flag] = value
        if fill:
            options.update({flag: value for flag, value in self.defaults.items() if options.get(flag) is None})
        return options

    def read(self, holder: object) -> dict[str, Sbp | None]:
        """The SBPs ``holder``'s flags say, per keyword.

        Args:
            holder: a layer or a style, whose attributes are the flags.

        Returns:
            ``{keyword: SBP}``; None where the flags say none that side takes (or, where None is a choice, that
            the side is left alone).

        Example::

            >>> P = tpf.placement("cpu", ranks=[0, 1])
            >>> layer = tpf.ColumnParallelLinear(8, 6, placement=P, gather_output=True)
            >>> layer.layouts.read(layer)
            {'input_sbp': sbp.broadcast, 'output_sbp': sbp.broadcast}
        """
        return {keyword: next((sbp for sbp, flags in side.choices.items()
                               if all(getattr(holder, flag) == value for flag, value in flags.items())), None)
                for keyword, side in self.sides.items()}

    def said_in_sbp(self, cls: type) -> type:
        """Class decorator: the plan style ``cls`` (a dataclass whose fields hold the flags) takes the SBP keywords as
        well, and reads them back as properties. Apply it above ``@dataclasses.dataclass``; a subclass that is a
        dataclass of its own needs it again.

        Args:
            cls: the style's class.

        Returns:
            ``cls``, its ``__init__`` taking the SBP keywords.

        Example::

            >>> tpf.ColumnParallel(output_sbp=tpf.sbp.broadcast) == tpf.ColumnParallel(gather_output=True)
            True
            >>> tpf.ColumnParallel(sequence_parallel=True, sequence_dim=1).input_sbp
            sbp.split(dim=1)
        """
        init, layouts = cls.__init__, self

        def __init__(style, *args, **options) -> None:
            init(style, *args, **layouts.resolve(type(style).__name__, options))

        own = list(inspect.signature(init).parameters.values())
        __init__.__signature__ = inspect.Signature(own + [
            inspect.Parameter(keyword, inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Sbp | None")
            for keyword in self.sides])
        __init__.__qualname__, __init__.__doc__ = f"{cls.__qualname__}.__init__", init.__doc__
        cls.__init__ = __init__
        for keyword in self.sides:
            setattr(cls, keyword, property(lambda style, keyword=keyword: layouts.read(style)[keyword],
                                           doc=f"The layout ``{keyword}=`` says, read from the flags."))
        return cls
