import pytest

from tests import harness


@pytest.fixture(scope="session", autouse=True)
def _process_pools():
    yield
    harness.shutdown()
