import os
import warnings

import pytest

os.environ.setdefault("PL_DISABLE_FORK", "1")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
