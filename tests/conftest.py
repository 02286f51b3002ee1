import os
import sys

import pytest
import torch

# The harness (tests/harness.py) is imported as a top-level module, here and in spawned workers.
sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)

# The suite means gloo: on a CUDA machine minidp.init() would otherwise pick NCCL, put CPU tensors
# through it and seat two ranks on one GPU. Set here, before any test runs, so every child process
# (minidp.launch workers, `python -m minidp.run`, torchrun, the examples) inherits it. A test that
# wants NCCL says so: minidp.init(backend="nccl") (an explicit backend= wins over the variable).
os.environ.setdefault("MINIDP_BACKEND", "gloo")

# Workers are spawned, not forked from the pytest process: forking a process that runs other
# threads (gloo's, a background command's reader) can leave a child waiting on a lock that no
# thread of it will ever release. A forked 2-rank run hung that way in a full run of the suite.
os.environ.setdefault("MINIDP_TEST_SPAWN", "1")


@pytest.fixture(autouse=True)
def _cpu_children_unless_gpu_test(request, monkeypatch):
    """Child processes of a CPU test do not see the GPUs; a GPU-marked test's children do.

    Why: on a CUDA machine minidp.init() pins each rank to a GPU (env.device), so the examples and
    the harness would run two ranks on one GPU, where cuDNN and scatter-add backward kernels are not
    deterministic, and the bitwise comparisons of CPU tests would fail for that reason alone. A child
    reads CUDA_VISIBLE_DEVICES when it starts, so setting it here (not in the worker) is what counts.
    """
    if "gpu" not in request.keywords:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
