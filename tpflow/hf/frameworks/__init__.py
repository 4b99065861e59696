"""A split model in the loops people run: transformers' ``Trainer``, TRL's trainers, accelerate.

- ``rows``: a placement's data-parallel rows, which the frameworks see as their processes;
- ``view``: how they see them (accelerate's state, ``Trainer``'s main process, their collectives);
- ``states``: what they save and load of a split model, whole;
- ``adopt``: the one line that hands them a split model.
"""

from tpflow.hf.frameworks import rows, states, view
from tpflow.hf.frameworks.adopt import adopt, mark, placement_of
from tpflow.hf.frameworks.rows import data_rows

__all__ = ["adopt", "data_rows", "mark", "placement_of", "rows", "states", "view"]
