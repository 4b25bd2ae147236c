

def pytest_addoption(parser):
    """``--fuzz-cases N``: run N differential fuzz cases in tests/test_fuzz.py (``make fuzz``)."""
    parser.addoption("--fuzz-cases", action="store", type=int, default=0,
                     help="number of random fuzz cases for tests/test_fuzz.py (0: skip that test)")
