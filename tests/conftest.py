import os

import torch

if not torch.cuda.is_available():  # Triton kernels run through the interpreter; read when tpflow is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests import harness  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _process_pools():
    yield
    harness.shutdown()
