"""``tpflow.frameworks``, kept for the scripts that import it: the trainers' support is the Hugging Face wing's
(``tpflow.hf.frameworks``); ``import tpflow.frameworks.states`` and the like still find its modules."""

import sys

from tpflow.hf.frameworks import adopt, data_rows, mark, placement_of, rows, states, view

__all__ = ["adopt", "data_rows", "mark", "placement_of", "rows", "states", "view"]

for _module in (rows, states, view):
    sys.modules[f"{__name__}.{_module.__name__.rpartition('.')[2]}"] = _module
