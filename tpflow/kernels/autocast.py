"""``torch.autocast``'s casts for a product, done by hand where a kernel takes one dtype.

Under ``torch.autocast(device_type, dtype)`` torch casts the operands of ``F.linear`` and ``matmul`` (its "lower
precision" ops) to ``dtype``: each floating tensor on that device type but float64, which autocast never casts (an
fp64 model stays fp64 under a bf16 autocast). tpflow's products run in custom autograd functions and kernels that
autocast does not see, so they cast their operands here, by that rule: their outputs' dtypes are ``F.linear``'s, and
operands it would leave in two dtypes (fp64 beside fp32) fail as ``F.linear`` fails.
"""

from __future__ import annotations

import torch

__all__ = ["autocast_operands"]


def autocast_operands(device_type: str, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` as autocast casts ``F.linear``'s operands on ``device_type``, if it is enabled there.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``: the device type whose autocast state applies.
        tensors: the operands (None passes through).

    Returns:
        The operands, each floating one on ``device_type`` but float64 cast to autocast's dtype.

    Example::

        >>> x, w = torch.ones(2, 3), torch.ones(4, 3, dtype=torch.float64)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     [t.dtype for t in autocast_operands("cpu", x, w.float(), w)]
        [torch.bfloat16, torch.bfloat16, torch.float64]
    """
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64
                 and t.device.type == device_type else t for t in tensors)
