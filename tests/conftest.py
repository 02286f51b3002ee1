import os
import sys

import pytest
import torch

# The harness (tests/harness.py) is imported as a top-level module, here and in spawned workers.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
torch.set_num_threads(1)

import background  # noqa: E402 - tests/scripts/background.py: the launches run between tests

# The suite means gloo: on a CUDA machine minidp.init() would otherwise pick NCCL, put CPU tensors
# through it and seat two ranks on one GPU. Set here, before any test runs, so every child process
# (minidp.launch workers, `python -m minidp.run`, torchrun, the examples) inherits it. A test that
# wants NCCL says so: minidp.init(backend="nccl") (an explicit backend= wins over the variable).
os.environ.setdefault("MINIDP_BACKEND", "gloo")

# Test workers are forked from this process while it runs no thread of its own (harness.py decides at
# each launch; MINIDP_TEST_SPAWN=1 spawns them always). A few tests start threads here that live on
# (dynamo's compile leaves the autograd engine's device threads, a DALI pipeline its executor's):
# their files run last, so every test before them can fork. See pytest_collection_modifyitems.
LEAVE_THREADS = ("test_compile.py", "test_dali.py")
# ... but for their tests whose ranks the harness forks and which leave no thread here: they run in place.
FORK_IN_PLACE = ("test_dali.py::test_dali_example_with_amp_and_novograd_minidp_equals_torch_ddp",)
# The files whose tests only wait for launches started in the background (tests/scripts/background.py) run
# after those: while the compiles and DALI's tests leave a core idle, the launches still queued run there.
LAUNCHES_LAST = ("test_frameworks.py", "test_readme.py", "test_torchrun.py")


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
    # stable: file order kept otherwise
    items.sort(key=lambda item: (item.path.name in LAUNCHES_LAST, item.path.name in LEAVE_THREADS
                                 and not item.nodeid.endswith(FORK_IN_PLACE)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """How the harness started its workers: a spawn where a fork was expected is a slow suite."""
    harness = sys.modules.get("harness")
    if harness is not None:
        counts = harness.START_METHODS
        terminalreporter.write_line(f"test workers: {counts['fork']} launches forked, {counts['forkserver']} from the "
                                    f"fork server, {counts['spawn']} spawned")
        for where in sorted(set(harness.NOT_FORKED_IN)):
            terminalreporter.write_line(f"  {where}")


def pytest_collection_finish(session):
    background.arrange([item.path.name for item in session.items])


def pytest_runtest_setup(item):
    background.pump()  # launches keep running in the background (background.IN_BACKGROUND of them)


def pytest_sessionfinish(session):
    background.stop_all()
