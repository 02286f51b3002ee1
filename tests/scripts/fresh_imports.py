"""What a fresh interpreter imports, for the tests that need one (a pytest process has imported
everything).

    python tests/scripts/fresh_imports.py      # prints one JSON object

Three facts, checked in this one process (each interpreter start costs seconds of CPU) by
test_launch.py, test_dali.py and test_compile.py through processes.fresh_interpreter_report():
  * the launcher and the simulator import no torch; minidp's names still load on first use;
  * without NVIDIA DALI, minidp and minidp.data import, and the DALI loader says what to install;
  * an eager minidp.DDP training step (world size 1) does not import torch._dynamo.
"""
import json
import os
import sys

# `import nvidia.dali` fails from here on, as where DALI is not installed
sys.modules["nvidia.dali"] = None
report = {}

import minidp  # noqa: E402
import minidp.run  # noqa: E402, F401
import minidp.simulate  # noqa: E402, F401
import minidp.study.time_to_target  # noqa: E402, F401

report["torch_imported_by_the_launcher"] = "torch" in sys.modules
report["launch_module"] = minidp.launch.__module__
report["ddp_name"] = minidp.DDP.__name__  # loads torch and the engine now
engine_hooks = sys.modules["minidp.engine.hooks"]
# minidp.hooks is a module of its own (no sys.modules swap) that gives the engine's names, not
# copies, and the sharded optimizer's hooks (minidp/sharded/zero/overlap.py, reduce_scatter.py)
public_hooks = minidp.hooks  # imports minidp/hooks.py, which imports minidp/sharded/zero/overlap.py
zero_hooks = sys.modules["minidp.sharded.zero.overlap"]
reduce_scatter_hooks = sys.modules["minidp.sharded.zero.reduce_scatter"]
report["hooks_names_are_the_engines"] = (
    public_hooks is not engine_hooks
    and minidp.hooks.__all__ == [*engine_hooks.__all__, "hook_with_zero_step",
                                 "hook_with_zero_step_interleaved", "hook_with_zero_reduce_scatter"]
    and all(getattr(minidp.hooks, n) is getattr(engine_hooks, n) for n in engine_hooks.__all__)
    and all(getattr(minidp.hooks, n) is getattr(zero_hooks, n) for n in minidp.hooks.__all__[-3:-1])
    and minidp.hooks.hook_with_zero_reduce_scatter is reduce_scatter_hooks.hook_with_zero_reduce_scatter)

import minidp.data  # noqa: E402
import minidp.data.sampler  # noqa: E402, F401

try:
    minidp.data.image_folder_loader("missing", 2)
    report["dali_error"] = None
except ImportError as e:
    report["dali_error"] = str(e)

import torch  # noqa: E402

from minidp.launcher.spawn import free_port  # noqa: E402

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
minidp.init(backend="gloo")
model = minidp.DDP(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 16)))
model(torch.randn(2, 16)).sum().backward()
report["dynamo_imported_by_an_eager_step"] = "torch._dynamo" in sys.modules
minidp.shutdown()
print(json.dumps(report))
