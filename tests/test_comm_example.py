"""examples/custom_hook.py end to end: the ~30-line compressor trains, and its bytes are the ones it declares."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
               "MASTER_ADDR", "MASTER_PORT")


def test_custom_compressor_example_trains_and_counts_its_bytes():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}  # the example spawns its workers
    proc = subprocess.run([sys.executable, "examples/custom_hook.py", "--steps", "20"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    runs = dict(re.findall(r"(exact all-reduce|TernGrad): (.*)", proc.stdout))
    assert set(runs) == {"exact all-reduce", "TernGrad"}, proc.stdout  # printed once (rank 0)
    exact, tern = (dict(re.findall(r"(loss|accuracy) ([\d.]+)", runs[k])) for k in ("exact all-reduce", "TernGrad"))
    assert float(tern["accuracy"]) > 0.3 and float(exact["accuracy"]) > 0.3  # ten classes: chance is 0.1
    grads = 32 * 128 + 128 + 128 * 10 + 10  # parameters of the example's classifier
    sent = int(re.search(r"TernGrad:.*bytes sent per step ([\d,]+)", proc.stdout).group(1).replace(",", ""))
    # 10 exact steps (4 bytes per element), then 10 TernGrad steps (1 byte per element + a 4-byte scale)
    assert sent == round((10 * 4 * grads + 10 * (grads + 4)) / 20)
