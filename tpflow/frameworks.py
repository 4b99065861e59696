"""``tpflow.frameworks``, kept for the scripts that import it: the trainers' support is the Hugging Face wing's
(``tpflow.hf.frameworks``)."""

from tpflow.hf.frameworks import adopt, data_rows, mark, placement_of, rows, states, view

__all__ = ["adopt", "data_rows", "mark", "placement_of", "rows", "states", "view"]
