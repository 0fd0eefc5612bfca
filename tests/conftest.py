import zlib

import numpy as np
import pytest
import torch

import flashlab  # noqa: F401  (settles GPU vs interpreter before any kernel import)
from flashlab import device


def pytest_collection_modifyitems(config, items):
    if device.DEVICE.type == "cuda":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (compiled Triton)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """Random data per test, reproducible from the test's name (crc32: str hash() is salted per process)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    return np.random.default_rng(seed)
