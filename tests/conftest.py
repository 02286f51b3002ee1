import os
import sys

import pytest
import torch

# The harness (tests/harness.py) is imported as a top-level module, here and in spawned workers.
sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
