import os
import warnings

import pytest
import torch

os.environ.setdefault("PL_DISABLE_FORK", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):  # workers share the cores: one intra-op thread each
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` run only where a CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
