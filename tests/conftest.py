import os

import torch

# read when tpflow is imported: on CPU the Triton kernels run through the interpreter; on a GPU the
# tests compile one tile config instead of autotuning every shape they try
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TPFLOW_AUTOTUNE", "0")

import pytest

from tests import harness


@pytest.fixture(scope="session", autouse=True)
def _process_pools():
    yield
    harness.shutdown()
