import pytest
import torch
from torch._dynamo.utils import counters


def pytest_addoption(parser):
    """``--fuzz-cases N``: run N differential fuzz cases in tests/test_fuzz.py (``make fuzz``)."""
    parser.addoption("--fuzz-cases", action="store", type=int, default=0,
                     help="number of random fuzz cases for tests/test_fuzz.py (0: skip that test)")


@pytest.fixture
def _fresh_dynamo():
    """The test starts from a clean Dynamo cache and clean counters, without autograd. Test
    files that want it for every test say ``pytestmark = pytest.mark.usefixtures("_fresh_dynamo")``."""
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        yield
    torch._dynamo.reset()
