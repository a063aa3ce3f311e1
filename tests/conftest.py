import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):   # parallel workers (pytest -n): one thread each, so that
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):   # two workers on two cores do not
        os.environ.setdefault(var, "1")                         # oversubscribe them


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")
    parser.addoption("--update-generated", action="store_true",
                     help="rewrite generated/ instead of failing the regeneration golden test")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
