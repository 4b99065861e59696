"""Matmul signatures over a placement: which SBPs of ``a`` and ``b`` give which SBP of ``a @ b`` on one placement
axis, what boxing an input to another SBP costs in bytes, and so which signature ``tpf.matmul`` boxes its inputs to
when theirs is not legal (the fewest bytes moved, axis by axis). Pure layout arithmetic, as ``tpflow.sbp`` is.
"""

from __future__ import annotations

from collections.abc import Sequence

from tpflow.sbp import Broadcast, Sbp, Split, broadcast, partial_sum

__all__ = ["conversion_bytes", "infer_matmul", "matmul_out_sbp"]


def _signatures(a_ndim: int, b_ndim: int) -> list[tuple[Sbp, Sbp, Sbp]]:
    """Legal (a, b, out) SBPs of one axis for ``a [..., M, K] @ b [..., K, N]``, in order of preference."""
    out_ndim = max(a_ndim, b_ndim)
    sigs: list[tuple[Sbp, Sbp, Sbp]] = [(broadcast, broadcast, broadcast)]
    for i in range(a_ndim - 1):  # batch dims and M of a
        batch_of_b = b_ndim > 2 and i < a_ndim - 2
        sigs.append((Split(i), Split(i) if batch_of_b else broadcast, Split(i)))
    sigs += [
        (broadcast, Split(b_ndim - 1), Split(out_ndim - 1)),
        (Split(a_ndim - 1), Split(b_ndim - 2), partial_sum),
        (partial_sum, broadcast, partial_sum),
        (broadcast, partial_sum, partial_sum),
    ]
    return sigs


def matmul_out_sbp(
    a_sbps: Sequence[Sbp], b_sbps: Sequence[Sbp], a_ndim: int, b_ndim: int
) -> tuple[Sbp, ...] | None:
    """The output SBP when (a, b) is legal on every axis, else None.

    For ``a [..., M, K] @ b [..., K, N]`` the legal (a, b) -> out signatures of one axis are: B x B -> B;
    S(i) x B -> S(i) for a's batch dims and M (S(i) x S(i) -> S(i) for the batch dims b shares); B x S(N) -> S(N);
    S(K) x S(K) -> P; P x B -> P and B x P -> P.

    Args:
        a_sbps, b_sbps: the SBPs of ``a`` and ``b``, one per placement axis, with split dims >= 0.
        a_ndim, b_ndim: the number of dimensions of ``a`` and ``b``.

    Returns:
        The output's SBPs, one per placement axis, or None when some axis has no legal signature.

    Example::

        >>> from tpflow import sbp
        >>> matmul_out_sbp((sbp.split(1),), (sbp.split(0),), 2, 2)
        (sbp.partial_sum,)
        >>> matmul_out_sbp((sbp.split(1),), (sbp.split(1),), 2, 2) is None
        True
    """
    table = {(a, b): o for a, b, o in _signatures(a_ndim, b_ndim)}
    out = tuple(table.get(pair) for pair in zip(a_sbps, b_sbps))
    return None if any(o is None for o in out) else out


def conversion_bytes(src: Sbp, dst: Sbp, nbytes: int, parts: int) -> float:
    """Bytes one rank sends to convert one axis from ``src`` to ``dst`` (ring collectives).

    With ``n = parts``: split -> broadcast (all-gather) sends ``(n - 1) / n * nbytes``; split -> another split
    (all-to-all) ``(n - 1) / n**2 * nbytes``; partial_sum -> broadcast (all-reduce) ``2 * (n - 1) / n * nbytes``;
    partial_sum -> split (reduce-scatter) ``(n - 1) / n * nbytes``. Conversions from broadcast and split ->
    partial_sum are local (0), as is any conversion over one rank or to the same SBP.

    Args:
        src, dst: the SBP of the axis before and after.
        nbytes: the size of the whole (global) tensor in bytes.
        parts: the number of ranks along the axis.

    Returns:
        The bytes, as a float.

    Example::

        >>> conversion_bytes(tpf.sbp.split(0), tpf.sbp.broadcast, 1024, 4)       # all-gather
        768.0
        >>> conversion_bytes(tpf.sbp.partial_sum, tpf.sbp.broadcast, 1024, 4)    # all-reduce
        1536.0
    """
    if src == dst or parts == 1 or isinstance(src, Broadcast):
        return 0.0  # broadcast -> split / partial is a local slice or zeroing
    share = (parts - 1) / parts
    if isinstance(src, Split):
        if isinstance(dst, Broadcast):
            return share * nbytes  # all-gather
        if isinstance(dst, Split):
            return share * nbytes / parts  # all-to-all
        return 0.0  # split -> partial: the shard placed in zeros
    return {Broadcast: 2 * share * nbytes, Split: share * nbytes}[type(dst)]  # all-reduce / reduce-scatter


def infer_matmul(
    a_sbps: Sequence[Sbp],
    b_sbps: Sequence[Sbp],
    a_ndim: int,
    b_ndim: int,
    a_nbytes: int,
    b_nbytes: int,
    hierarchy: Sequence[int],
) -> tuple[tuple[Sbp, ...], tuple[Sbp, ...], tuple[Sbp, ...]]:
    """(a, b, out) SBPs for ``a @ b``: the inputs' own when legal, else the legal signature
    that moves the fewest bytes, chosen axis by axis.

    The bytes are those of ``conversion_bytes`` for boxing ``a`` and ``b`` on that axis; a tie goes to the
    signature listed first in ``matmul_out_sbp`` (B x B first). ``tpf.matmul`` uses this.

    Args:
        a_sbps, b_sbps: the SBPs of ``a`` and ``b``, one per placement axis, with split dims >= 0.
        a_ndim, b_ndim: the number of dimensions of ``a`` and ``b``.
        a_nbytes, b_nbytes: the sizes of the whole ``a`` and ``b`` in bytes.
        hierarchy: the placement's mesh shape (``Placement.hierarchy``).

    Returns:
        ``(a_to, b_to, out)``: the SBPs to box ``a`` and ``b`` to (their own when already legal) and the
        output's SBPs, each a tuple with one entry per placement axis.

    Example::

        >>> from tpflow import sbp
        >>> infer_matmul((sbp.split(1),), (sbp.split(1),), 2, 2, 4096, 4096, (2,))   # b re-split: 1024 bytes
        ((sbp.split(dim=1),), (sbp.split(dim=0),), (sbp.partial_sum,))
    """
    sigs = _signatures(a_ndim, b_ndim)
    chosen = []
    for a, b, parts in zip(a_sbps, b_sbps, hierarchy):
        legal = [sig for sig in sigs if sig[:2] == (a, b)]
        if legal:
            chosen.append(legal[0])
            continue
        chosen.append(min(sigs, key=lambda sig: conversion_bytes(a, sig[0], a_nbytes, parts)
                          + conversion_bytes(b, sig[1], b_nbytes, parts)))
    return tuple(c[0] for c in chosen), tuple(c[1] for c in chosen), tuple(c[2] for c in chosen)
