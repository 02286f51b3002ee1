"""Every command and snippet in README.md runs as written, in a small form.

README.md is parsed on every run: its ```bash commands, ```python snippets and ```diff blocks are
collected and each one runs for real, changed only as listed here; a README edit that breaks one
fails its test, and one that adds, drops or reshapes them fails test_readme_holds_what_this_test_runs.
The ```python snippet of examples/README.md (the DALI loader, moved there from README.md) runs too.

What changes before a README line runs, and nothing else:
  * `python examples/train_*.py` commands get `--tiny` (the training examples' test preset: 3 steps,
    16 px images); examples/minimal.py runs as written (a few seconds) but for the world size (below);
  * `python -m minidp.explain` runs on 16 px images, 2 per rank (`--input-shape 3,16,16 --batch 2`): the
    bucket layouts it prints do not depend on the input size, so they must equal the README's output;
    its `--out runs/explain` and simulate's `--plot runs/scaling.png` go to a temp folder. `python -m
    minidp.simulate` runs as written (a recorded step in, a table out, deterministic): its output must
    be the README's, line for line;
  * world size: a command for two nodes ("on each node") runs twice at once on 127.0.0.1, with
    `--node-rank` 0 and 1, `--nproc-per-node 1` (world size 2), `10.0.0.1` -> 127.0.0.1 and
    `--master-port 29500` -> a free port. On one node, examples/minimal.py's and a training example's
    `--nproc-per-node N` becomes 1 (test_launch.py, test_restarts.py and test_torchrun.py run these
    launcher shapes at world size 2 already, test_examples.py and test_dali.py the examples at 2 ranks
    against torch DDP, and each process costs seconds of this 2-core machine). A
    single-node torchrun command gets a free port through torchrun's PET_MASTER_PORT (its text
    unchanged): items run two at a time, and torchrun's default port is the same for all;
  * the ```diff blocks are applied to tests/scripts/ddp_train.py (a torch DDP script for torchrun on
    GPUs), and the result runs under torchrun at world size 2 as minidp's;
  * `~/imagenette` and "imagenet/train" -> tiny generated image folders; `...` lines -> a line that
    records what the loop saw; fragments get stand-ins for the names they use before them, and checks
    of what their comments claim after them (the minidp.comm fragment runs at world size 1; the
    TernGrad compressor must be examples/custom_hook.py's, verbatim, and is checked on a tensor:
    unbiased, and as many bytes as it declares; the restart loop runs, then runs again and resumes);
    the mp.spawn snippet runs as a file, unchanged. A snippet that does not run as pasted says so on its
    first line (`# fragment ...`, naming the whole script, which must exist) and must compile; every
    code block carries a language (but the Layout section's map); every path the READMEs name exists. The
    one-process snippets (all but mp.spawn's) run as files in a single process, one after
    another (tests/scripts/run_files.py: each as __main__ through runpy, as `python file.py` would);
  * `python -m minidp.run --ft ... examples/fault_tolerant.py --kill 1@20` runs as written (3 replicas, one
    killed and restarted); the minidp.ft loop snippet must be that example's, verbatim;
  * `make test` and `make demo` are not run (SKIPPED_MAKE says why); `make -n` checks each target.
Every command has a timeout (its whole process tree is killed then) and OMP_NUM_THREADS=1; the
commands are registered at collection and run in the background between other tests, two at a time
while a test here waits (tests/scripts/background.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from typing import Callable, List, Optional

import pytest

from minidp.launcher.spawn import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
sys.path.insert(0, SCRIPTS)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from background import folder, prelaunch  # noqa: E402
from processes import Command, clean_env  # noqa: E402

import common  # noqa: E402 - examples/common.py: the synthetic image folders

README = os.path.join(ROOT, "README.md")
EXAMPLES_README = os.path.join(ROOT, "examples", "README.md")  # holds the DALI loader snippet
TIMEOUT_S = 240
EXPECTED = {"bash": 15, "python": 6, "diff": 3}  # what README.md holds; a change must update this file
EXPECTED_EXAMPLES = {"python": 1}  # what examples/README.md holds
SKIPPED_MAKE = {  # target: (why it is not run, what `make -n` must show)
    "test": ("`make test` runs the whole suite, this file included: it would recurse", "-m pytest"),
    "demo": ("`make demo` trains twice, for minutes (its own sizes override --tiny); the example it "
             "runs is run here and in test_examples.py", "examples/demo.py"),
}
HAVE_DALI = True
try:
    import nvidia.dali  # noqa: F401
except ImportError:
    HAVE_DALI = False


# ----------------------------------------------------------------------------- parsing README.md
@dataclasses.dataclass
class Block:
    lang: str
    text: str
    line: int  # of the opening fence, 1-based


def read_blocks(path: str = README) -> List[Block]:
    """The fenced code blocks of a markdown file, with their language tag."""
    blocks, current = [], None
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            fence = re.match(r"^```(\w*)\s*$", line)
            if current is None and fence:
                current = Block(fence.group(1), "", number)
            elif current is not None and line.rstrip() == "```":
                blocks.append(current)
                current = None
            elif current is not None:
                current.text += line
    assert current is None, f"README.md: the code block opened at line {current.line} is never closed"
    return blocks


def shell_commands(block: Block) -> List[str]:
    """The commands of a bash block: comments dropped, `\\` continuations joined."""
    commands, pending = [], ""
    for line in block.text.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).rstrip()  # README commands hold no quoted '#'
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
        elif line or pending:
            commands.append(" ".join((pending + line).split()))
            pending = ""
    assert not pending, f"README.md line {block.line}: a command ends with a continuation backslash"
    return commands


def apply_diff(source: str, diff: str) -> str:
    """Apply a README diff block: each run of '-' then '+' lines replaces those '-' lines (found once)."""
    lines, hunks = source.splitlines(), []
    for line in diff.splitlines():
        if line.startswith("-") and (not hunks or hunks[-1][1]):
            hunks.append(([], []))  # a '-' after '+' lines (or first) opens a hunk
        if line[:1] in "-+" and line:
            assert hunks, f"a README diff adds lines before removing any; nothing anchors them:\n{diff}"
            hunks[-1][line[0] == "+"].append(line[1:])
    for removed, added in hunks:
        starts = [i for i in range(len(lines)) if lines[i:i + len(removed)] == removed]
        assert len(starts) == 1, f"the README diff's '-' lines {removed} are not (once) in:\n{source}"
        lines[starts[0]:starts[0] + len(removed)] = added
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- what each item runs
@dataclasses.dataclass
class Item:
    """One README command or snippet: how to start it (a group of Commands) and what it must print."""

    key: str
    start: Optional[Callable[["Workspace"], List[Command]]]  # None: nothing to run in the background
    check: Callable[[str], None]  # gets the output of every command of the group, concatenated
    skip: str = ""  # why it is not run (the check still runs, on "")
    # A snippet that runs in one process: writes its file and returns the path. Such files all run in one
    # process, one after another (tests/scripts/run_files.py); check gets this file's part of the output.
    file: Optional[Callable[["Workspace"], str]] = None


class Workspace:
    """The files the items need, made once by the module fixture."""

    def __init__(self, tmp, blocks: List[Block]):
        self.tmp = tmp
        # TMPDIR: the examples' synthetic data goes here; HF_HOME: Accelerate reads no user config and writes
        # nothing under $HOME.
        self.env = clean_env(TMPDIR=str(tmp / "tmp"), HF_HOME=str(tmp / "hf"))
        os.makedirs(self.env["TMPDIR"])
        self.imagenette = tmp / "imagenette"  # `--data ~/imagenette`: train/ and val/
        common.write_synthetic(str(self.imagenette), 6, 2, size=16, seed=0)
        self.imagenet = tmp / "imagenet"  # "imagenet/train": one full batch of 256
        common.write_synthetic(str(self.imagenet), 26, 1, size=16, seed=1)
        source = open(os.path.join(SCRIPTS, "ddp_train.py")).read()
        for block in (b for b in blocks if b.lang == "diff"):
            source = apply_diff(source, block.text)
        self.switched = self.write("switched_train.py", source)  # ddp_train.py after the README's diffs

    def write(self, name: str, source: str) -> str:
        (self.tmp / name).write_text(source)
        return str(self.tmp / name)

    def command(self, cmd, cwd=ROOT) -> Command:
        env = self.env
        if isinstance(cmd, str) and cmd.startswith("torchrun ") and not re.search(
                r"--master-port|--rdzv-endpoint|--standalone", cmd):
            # torchrun's own default port is 29500 for every run: two README items running at once
            # would share one store. PET_MASTER_PORT is torchrun's --master-port, the command unchanged.
            env = {**env, "PET_MASTER_PORT": str(free_port())}
        return Command(cmd, cwd, env, timeout=TIMEOUT_S)


TRAINING_EXAMPLE = re.compile(r"\bexamples/train_\w+\.py\b")  # the examples with a --tiny preset


def one_process_per_node(cmd: str) -> bool:
    """Whether the command's --nproc-per-node becomes 1 here (see the module docstring)."""
    return "--node-rank" in cmd or "examples/minimal.py" in cmd or bool(TRAINING_EXAMPLE.search(cmd))


def small_form(cmd: str, ws: Workspace, node_rank: int = 0, port: int = 0) -> str:
    """The README command as it runs here (see the module docstring)."""
    out = cmd
    if one_process_per_node(cmd):
        out = re.sub(r"--nproc-per-node \d+", "--nproc-per-node 1", out)
    if "--node-rank" in cmd:
        out = out.replace("--node-rank 0", f"--node-rank {node_rank}")
        out = out.replace("10.0.0.1", "127.0.0.1").replace("--master-port 29500", f"--master-port {port}")
    out = out.replace("~/imagenette", str(ws.imagenette))
    if out.startswith("python -m minidp.explain "):
        out = out.replace("--input-shape 3,32,32 --batch 32", "--input-shape 3,16,16 --batch 2")
        out = out.replace("--out runs/explain", f"--out {ws.tmp / 'explain'}")
    out = out.replace("--plot runs/scaling.png", f"--plot {ws.tmp / 'scaling.png'}")
    out = out.replace("--plot runs/pays_off.png", f"--plot {ws.tmp / 'pays_off.png'}")
    return out + " --tiny" if TRAINING_EXAMPLE.search(out) else out


def world(cmd: str) -> int:
    """The world size of the command as small_form runs it."""
    if "--node-rank" in cmd:
        return 2
    if one_process_per_node(cmd):
        return 1
    nproc = re.search(r"--nproc-per-node (\d+)", cmd)
    return int(nproc.group(1)) if nproc else 1


def check_minimal(cmd: str) -> Callable[[str], None]:
    def check(output: str) -> None:  # rank 0 prints; the regression is learned to within 0.05
        assert output.count(f"minimal.py: {world(cmd)} rank(s), ") == 1, output
        epochs = re.findall(r"^epoch (\d): loss [\d.]+ over 1024 samples$", output, re.M)
        assert epochs == ["1", "2", "3"], output
        error = re.findall(r"^largest weight error: ([\d.]+)$", output, re.M)
        assert len(error) == 1 and float(error[0]) < 0.05, output
    return check


def check_example(cmd: str) -> Callable[[str], None]:
    engine = "ddp" if "--engine ddp" in cmd else "minidp"

    def check(output: str) -> None:
        assert output.count(f"{engine}: {world(cmd)} workers x 4 images") == 1, output  # rank 0 only
        assert "Address already in use" not in output, output  # under torchrun: the workers joined its store
        epochs = re.findall(r"epoch (\d+)/(\d+)  train loss [\d.]+  val loss [\d.]+  val accuracy", output)
        assert epochs and [int(e) for e, _ in epochs] == list(range(1, int(epochs[0][1]) + 1)), output
    return check


BUCKET_ROW = re.compile(r"^ +(\d+) +(\d+) +([\d.]+)  (\S+) +(\S+) ", re.M)  # explain: index, params, MiB, ends


def check_explain(shown: str) -> Callable[[str], None]:
    """The README's explain output shows the bucket layouts this run prints (they do not depend on the input),
    and the run's files hold the recorded step of both ranks. (This is the suite's ResNet-18 run of explain:
    tests/test_explain.py runs the command on small models only.)"""
    rows = BUCKET_ROW.findall(shown)

    def check(output: str) -> None:
        assert rows and BUCKET_ROW.findall(output) == rows, f"README shows {rows}; the run printed:\n{output}"
        assert output.count("torch DDP builds the same buckets: yes") == 2, output
        assert "explain: minidp step 3/3" in output and "explain: torch DDP step 3/3" in output, output
        rebuilt = output.partition("After the rebuild")[2]
        launched = [float(ms) for ms in re.findall(r"^ +\d+ +\d+ .*? \+([\d.]+) ms +\+[\d.]+ ms", rebuilt, re.M)]
        # Overlap: buckets go out in order, the first while backward still runs.
        assert len(launched) == len(BUCKET_ROW.findall(rebuilt)) > 1, output
        backward_done = float(re.search(r"Backward done at \+([\d.]+) ms", rebuilt).group(1))
        assert launched == sorted(launched) and launched[0] < backward_done, output
        png, trace, events = (re.search(rf"(\S+_{kind})$", output, re.M).group(1)
                              for kind in ("timeline.png", "trace.json", "events.json"))
        assert os.path.getsize(png) > 10_000, png
        assert any(e.get("ph") == "X" for e in json.load(open(trace))["traceEvents"]), trace
        recorded = json.load(open(events))
        assert set(recorded["events"]) == {"0", "1"} and len(recorded["params"]) == 62, recorded.keys()
    return check


def check_simulate(shown: str) -> Callable[[str], None]:
    def check(output: str) -> None:  # deterministic: a recorded step and a network model in, a table out
        assert shown and output.rstrip("\n").splitlines() == shown.rstrip("\n").splitlines(), output
    return check


def check_train_lm(cmd: str) -> Callable[[str], None]:
    engine = "ddp" if "--engine ddp" in cmd else "minidp"

    def check(output: str) -> None:  # --tiny: 3 steps, each logged, then the validation loss (rank 0 only)
        # the text found on the machine: the license files shipped in torch's wheel
        assert re.search(rf"^{engine}: [\d,]+ parameters, [\d,]+ characters from .*(?i:licen).*, world size 1$",
                         output, re.M), output
        assert len(re.findall(r"^step \d+: loss [\d.]+", output, re.M)) == 3, output
        assert len(re.findall(r"^val loss [\d.]+$", output, re.M)) == 1, output
    return check


ACCELERATE_RUN = re.compile(r"^accelerate_minidp\.py: engine=(\w+), (\w+)\.DistributedDataParallel on 2 processes, "
                            r"gradient_accumulation_steps=(\d), unwrap_model\(\) is the model: (\w+), last losses "
                            r"(\[.*\]), weights ([0-9a-f]{16})$", re.M)


def check_framework(cmd: str) -> Callable[[str], None]:
    """The Lightning example: 2 processes on minidp's wrapper, the fingerprint printed once. The Accelerate
    example under torchrun (the README's torchrun case): both engines, with and without accumulation, the same
    weights and losses, unwrap_model() the user's module, and the script's own verdict."""
    def check(output: str) -> None:
        if "lightning_minidp.py" in cmd:
            lines = re.findall(r"^lightning_minidp\.py: strategy=minidp, 2 processes, \d+ steps, loss [\d.]+, "
                               r"weights [0-9a-f]{16}$", output, re.M)
            assert len(lines) == 1, output  # rank 0 only
            return
        runs = ACCELERATE_RUN.findall(output)  # rank 0 only: one line per engine and accumulation
        assert [run[:4] for run in runs] == [("ddp", "torch", "1", "True"), ("minidp", "minidp", "1", "True"),
                                            ("ddp", "torch", "2", "True"), ("minidp", "minidp", "2", "True")], output
        for torch_ddp, mini in (runs[0:2], runs[2:4]):
            assert mini[4:] == torch_ddp[4:], output  # the gathered losses and the weights' fingerprint
        assert runs[1][5] != runs[3][5], output  # accumulation changed the run
        for accumulation in (1, 2):
            assert output.count(f"accelerate_minidp.py: gradient_accumulation_steps={accumulation}: minidp's "
                                "weights are torch DDP's, bitwise: True") == 1, output
    return check


STUDY_ROW = re.compile(r"^fastest +(.+)$", re.M)


def check_study(cmd: str) -> Callable[[str], None]:
    """--study: a table per link speed, each method a row; what the README says of it holds."""
    def check(output: str) -> None:
        speeds = re.findall(r"^(\d+) Gb/s: time to target / exact's", output, re.M)
        assert speeds == ["10", "25", "100", "400"], output
        methods = re.search(r'--methods "([^"]+)"', cmd).group(1).split(",")
        for method in ["exact", *methods]:
            assert len(re.findall(rf"^{re.escape(method)} +\d", output, re.M)) == 4, (method, output)
        # The README (the study as re-measured on 2026-12-06): FP16 wins on 10 Gb/s at every size and on 25
        # up to 512 ranks, exact on 100-400 Gb/s up to 256 ranks; TopK 1% + EF at 1,024 ranks on 25 Gb/s and
        # from 512 on 100-400 Gb/s; QSGD 16 + EF nowhere.
        fastest = [re.findall(r"(\S+(?: \S+)?) x([\d.]+)", row) for row in STUDY_ROW.findall(output)]
        assert len(fastest) == 4 and all(len(row) == 8 for row in fastest), output
        expected = {"10": ["FP16"] * 8, "25": ["FP16"] * 7 + ["TopK 1%+EF"],
                    "100": ["exact"] * 6 + ["TopK 1%+EF"] * 2, "400": ["exact"] * 6 + ["TopK 1%+EF"] * 2}
        for speed, row in zip(speeds, fastest):
            assert [name for name, _ in row] == expected[speed], (speed, row)
    return check


def checker(cmd: str, shown: str) -> Callable[[str], None]:
    """What a README command must print; `shown` is the ```text block that follows it in the README, if any."""
    if "examples/minimal.py" in cmd:
        return check_minimal(cmd)
    if cmd.startswith("python -m minidp.explain "):
        return check_explain(shown)
    if cmd.startswith("python -m minidp.simulate --study "):
        return check_study(cmd)
    if cmd.startswith("python -m minidp.simulate "):
        return check_simulate(shown)
    if re.search(r"examples/(lightning|accelerate)_minidp\.py", cmd):
        return check_framework(cmd)
    if "examples/train_lm.py" in cmd:
        return check_train_lm(cmd)
    if "examples/fault_tolerant.py" in cmd:
        return check_fault_tolerant
    return check_example(cmd)


def check_fault_tolerant(output: str) -> None:
    """Replica 1 killed at step 20: the others end equal (every round as fast as it goes, where a replica once
    re-entered a round it had trained: the digests would differ); it healed from a peer (then equal too) or,
    on a machine too loaded for its restart to come in time, was told the run had finished."""
    lines = re.findall(r"^replica (\d): 300 steps, accuracy ([\d.]+)(, healed at step \d+ from replica \d)?.*"
                       r"state digest (\w+)$", output, re.M)
    by_replica = {int(r): (acc, healed, digest) for r, acc, healed, digest in lines}
    assert {0, 2} <= set(by_replica) and len({d for _, _, d in by_replica.values()}) == 1, output
    assert "restarting replica 1 alone (restart 1 of 1)" in output, output
    assert 1 in by_replica and by_replica[1][1] or "replica 1: the run finished at step 0 without it" in output, output
    assert float(by_replica[0][0]) > 0.9, output


def bash_items(blocks: List[Block]) -> List[Item]:
    items = []
    for i, block in enumerate(blocks):
        if block.lang != "bash":
            continue
        shown = blocks[i + 1].text if i + 1 < len(blocks) and blocks[i + 1].lang == "text" else ""
        for cmd in shell_commands(block):
            key = f"line {block.line}: {cmd}"
            if cmd.startswith("make "):
                items.append(make_item(key, cmd))
            elif not re.match(r"torchrun\s|python -m minidp\.(run|explain|simulate)\s|python examples/", cmd):
                items.append(unknown(key, "command"))
            elif "train_dali" in cmd and not HAVE_DALI:
                items.append(Item(key, None, lambda _: None, "needs NVIDIA DALI"))
            else:
                port = free_port() if "--node-rank" in cmd else 0

                def start(ws, cmd=cmd, port=port):  # two "nodes": both commands start at once
                    return [ws.command(small_form(cmd, ws, n, port)) for n in range(1 + ("--node-rank" in cmd))]
                items.append(Item(key, start, checker(cmd, shown)))
    return items


def unknown(key: str, what: str) -> Item:
    def fail(_):
        raise AssertionError(f"README.md {key}: test_readme does not know how to run this {what}; teach it")
    return Item(key, None, fail)


def make_item(key: str, cmd: str) -> Item:
    target = cmd.split()[1]
    if target not in SKIPPED_MAKE:
        return unknown(key, "make target")
    reason, expected = SKIPPED_MAKE[target]

    def dry_run(_):  # the target exists and would run what SKIPPED_MAKE expects
        proc = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0 and expected in proc.stdout, (cmd, proc.stdout, proc.stderr)
    return Item(key, None, dry_run, skip=reason)


# ----------------------------------------------------------------------------- python snippets
SAMPLER_BEFORE = '''\
import torch  # test_readme: stand-ins for the names the fragment uses
from torch.utils.data import DataLoader, TensorDataset
import minidp
train_set = TensorDataset(torch.arange(300.0).unsqueeze(1), torch.arange(300) % 10)
val_set = TensorDataset(torch.arange(101.0).unsqueeze(1), torch.arange(101) % 10)
epochs = 2
ckpt = {"epoch": 0, "sampler": minidp.DistributedSampler(train_set, seed=42).state_dict(consumed=128)}
_trained = []
'''
SAMPLER_DOTS = [  # what each `...` line of the fragment becomes, in order
    "_trained.extend(x.squeeze(1).long().tolist())",
    "correct = count = 0  # test_readme: 'correct' = even samples\n"
    "for x, y in DataLoader(val_set, batch_size=16, sampler=val):\n"
    "    correct += int((x.squeeze(1).long() % 2 == 0).sum())\n"
    "    count += len(y)",
]
SAMPLER_AFTER = '''\
assert len(_trained) == 300 - 128 + 300, len(_trained)  # test_readme: the fragment's claims
assert sorted(_trained[-300:]) == list(range(300)) and ckpt["sampler"]["consumed"] == 300, ckpt
assert sums == {"correct": 51, "count": 101}, sums
print(f"sampler fragment: resumed, accuracy {accuracy:.4f}")
'''
DALI_BEFORE = '''\
import torch  # test_readme: stand-ins for the names the fragment uses
epochs = 1
_batches = []
'''
DALI_DOTS = ["_batches.append((tuple(images.shape), images.dtype, tuple(labels.shape), labels.dtype))"]
DALI_AFTER = '''\
# test_readme: the fragment's claims (one full batch of the 260 images; "drop" leaves out the rest)
assert len(loader) == 1 and _batches == [((256, 3, 224, 224), torch.float32, (256,), torch.int64)], _batches
print("dali fragment: one batch of 256 images, 224 px")
'''


COMM_BEFORE = '''\
import torch  # test_readme: stand-ins for the names the fragment uses (one rank: gloo, world size 1)
import torch.nn.functional as F
import minidp
minidp.init()
torch.manual_seed(0)
model = minidp.DDP(torch.nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batches = [(torch.randn(16, 64), torch.randn(16, 8)) for _ in range(20)]
'''
COMM_DOTS = ["opt.zero_grad()\nF.mse_loss(model(x), y).backward()\nopt.step()"]
COMM_AFTER = '''\
# test_readme: the fragment's claims. The 10 exact steps send every gradient byte (one bucket of 520
# fp32 elements); then TopK(0.01) sends 5 of them, as fp32 values and int32 indices.
_dense = (64 * 8 + 8) * 4
assert state.stats() == {"steps": 20, "bytes_sent": 10 * _dense + 10 * 5 * 8, "bytes_dense": 20 * _dense,
                         "ratio": (10 * _dense + 10 * 5 * 8) / (20 * _dense)}, state.stats()
_saved = states[0]["memory"]["residuals"]["pieces"]
_loaded = state.state_dict()["memory"]["residuals"]["pieces"]
assert _saved and any(r.abs().sum() > 0 for r in _saved.values())  # error feedback held something back
assert _saved.keys() == _loaded.keys() and all(torch.equal(_saved[k], _loaded[k]) for k in _saved)
state.close()
minidp.shutdown()
print("comm fragment: 20 steps, TopK after 10 exact ones, residuals saved and loaded")
'''
TERNGRAD_BEFORE = '''\
import torch
import minidp
from minidp import comm
'''
TERNGRAD_AFTER = '''\
# test_readme: the compressor's claims, on one tensor (outside a hook: rank 0 of 2)
_g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
_c = TernGrad()
_ctx = comm.Context.for_tensor(_g, world_size=2)
_payload = _c.compress(_g, _ctx)
assert sum(p.numel() * p.element_size() for p in _payload) == _c.payload_bytes(_ctx) == 1004
assert set(_payload[0].unique().tolist()) <= {-1, 0, 1}
_mean = sum(_c.decompress(_c.compress(_g, _ctx), _ctx) for _ in range(2000)) / 2000
assert (_mean - _g).abs().max() < 0.25, (_mean - _g).abs().max()  # unbiased: the mean of many draws
print("TernGrad fragment: unbiased, 1004 bytes for 1000 elements")
'''
RESTART_BEFORE = '''\
import os  # test_readme: stand-ins for the names the fragment uses (one rank: gloo, world size 1)
import tempfile
import torch
import minidp
minidp.init()
torch.manual_seed(0)
path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
model = minidp.DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
steps = 3
'''
RESTART_DOTS = ["opt.zero_grad()\nmodel(torch.ones(2, 4)).sum().backward()\nopt.step()"]
RESTART_AGAIN = '''\
assert start == 0 and step == 2, (start, step)  # test_readme: the first run; now as restarted, 5 steps in all
steps = 5
'''
RESTART_AFTER = '''\
assert start == 3 and step == 4 and minidp.load_checkpoint(path, model, opt)["step"] == 5, (start, step)
minidp.shutdown()
print("restart fragment: the second run resumed at step 3 of 5")
'''


def replace_dots(snippet: str, replacements: List[str]) -> str:
    """Each line that is only `...` (and a comment) becomes the next replacement, at its indentation."""
    lines, count = [], 0
    for line in snippet.splitlines():
        if re.fullmatch(r"\.\.\.(\s+#.*)?", line.strip()):
            assert count < len(replacements), f"the README snippet has more `...` lines than expected:\n{snippet}"
            lines.append(textwrap.indent(replacements[count], line[:len(line) - len(line.lstrip())]))
            count += 1
        else:
            lines.append(line)
    assert count == len(replacements), f"the README snippet has {count} `...` lines, not {len(replacements)}"
    return "\n".join(lines) + "\n"


def python_items(blocks: List[Block], where: str = "") -> List[Item]:
    items = []
    for block in (b for b in blocks if b.lang == "python"):
        text, key = block.text, f"{where}line {block.line}: python snippet"
        if "minidp.launch(" in text:
            def start(ws, text=text):  # a file: the spawned workers import it again
                path = ws.write("spawn_snippet.py", text)
                return [ws.command([sys.executable, path], cwd=str(ws.tmp))]

            def check(output):
                assert output.count("2 workers; only rank 0 prints this") == 1, output
            items.append(Item(key + " (mp.spawn style)", start, check))
        elif "minidp.DistributedSampler(train_set" in text:
            def write(ws, text=text):
                return ws.write("sampler_snippet.py", SAMPLER_BEFORE + replace_dots(text, SAMPLER_DOTS) + SAMPLER_AFTER)

            def check(output):
                assert "sampler fragment: resumed, accuracy 0.5050" in output, output
            items.append(Item(key + " (DistributedSampler fragment)", None, check, file=write))
        elif "comm.compression_hook(" in text:
            def write(ws, text=text):  # the files run in ws.tmp: the fragment writes ckpt.pt there
                return ws.write("comm_snippet.py", COMM_BEFORE + replace_dots(text, COMM_DOTS) + COMM_AFTER)

            def check(output):
                assert "comm fragment: 20 steps, TopK after 10 exact ones, residuals saved and loaded" in output, output
            items.append(Item(key + " (minidp.comm fragment)", None, check, file=write))
        elif "class TernGrad(comm.Compressor)" in text:
            def write(ws, text=text):
                return ws.write("terngrad.py", TERNGRAD_BEFORE + text + TERNGRAD_AFTER)

            def check(output, text=text):
                code = text.split("\n", 1)[1]  # after the fragment's label
                assert code in open(os.path.join(ROOT, "examples", "custom_hook.py")).read(), \
                    "the README's TernGrad is not examples/custom_hook.py's, verbatim"
                assert "TernGrad fragment: unbiased, 1004 bytes for 1000 elements" in output, output
            items.append(Item(key + " (custom compressor)", None, check, file=write))
        elif "minidp.save_checkpoint(path, model, opt, step=step + 1)" in text:
            def write(ws, text=text):  # the loop twice: a first run, then a restarted one that resumes
                source = replace_dots(text, RESTART_DOTS)
                return ws.write("restart_snippet.py", RESTART_BEFORE + source + RESTART_AGAIN + source + RESTART_AFTER)

            def check(output):
                assert "restart fragment: the second run resumed at step 3 of 5" in output, output
            items.append(Item(key + " (restart fragment)", None, check, file=write))
        elif "ft.Replica(" in text:  # the loop of examples/fault_tolerant.py, which the bash item runs
            def check(output, text=text):
                code = textwrap.indent(text.split("\n", 1)[1], "    ")
                assert code in open(os.path.join(ROOT, "examples", "fault_tolerant.py")).read(), \
                    "the README's minidp.ft loop is not examples/fault_tolerant.py's, verbatim"
            items.append(Item(key + " (minidp.ft loop)", None, check))
        elif "image_folder_loader(" in text and HAVE_DALI:
            def write(ws, text=text):
                source = replace_dots(text.replace('"imagenet/train"', repr(str(ws.imagenet / "train"))), DALI_DOTS)
                return ws.write("dali_snippet.py", DALI_BEFORE + source + DALI_AFTER)

            def check(output):
                assert "dali fragment: one batch of 256 images, 224 px" in output, output
            items.append(Item(key + " (DALI fragment)", None, check, file=write))
        elif "image_folder_loader(" in text:
            items.append(Item(key + " (DALI fragment)", None, lambda _: None, "needs NVIDIA DALI"))
        else:
            items.append(unknown(key, "snippet"))
    return items


def diff_items(blocks: List[Block]) -> List[Item]:
    """The ```diff blocks, applied together to a torch DDP script: the result runs as minidp's."""
    diffs = [b for b in blocks if b.lang == "diff"]
    if not diffs:
        return []

    def start(ws):  # torchrun at world size 2: the gradients are averaged across two ranks
        return [ws.command(f"torchrun --nproc-per-node 2 {ws.switched}")]

    def check(output):
        line = ("train.py: 2 ranks, minidp.DistributedDataParallel, ZeroRedundancyOptimizer, state_dict keys "
                "with 'module.': True, same weights on every rank: True")
        assert output.count(line) == 1, output
    lines = ", ".join(str(b.line) for b in diffs)
    return [Item(f"lines {lines}: diff blocks applied to tests/scripts/ddp_train.py", start, check)]


# ----------------------------------------------------------------------------- the tests
ITEMS = (bash_items(read_blocks()) + python_items(read_blocks()) + diff_items(read_blocks())
         + python_items(read_blocks(EXAMPLES_README), where="examples/README.md "))


_WORKSPACE: list = []


def workspace() -> Workspace:
    """The files the items need, made when the first item starts."""
    if not _WORKSPACE:
        _WORKSPACE.append(Workspace(pathlib.Path(folder("readme")), read_blocks()))
    return _WORKSPACE[0]


def _run_files():
    """The one-process snippets: each writes its file, then one process runs them all."""
    ws = workspace()
    FILES.update({item.key: item.file(ws) for item in ITEMS if item.file})
    return [ws.command([sys.executable, RUN_FILES, *FILES.values()], cwd=str(ws.tmp))]


# Every runnable item is registered now and runs in the background between other tests (two at a time
# while a test here waits; tests/scripts/background.py). The one-process snippets share one launch.
FILES: dict = {}  # item key -> the file it wrote, for run_files.py
RUN_FILES = os.path.join(SCRIPTS, "run_files.py")
LAUNCHES = {item.key: prelaunch(f"test_readme.py: {item.key}", lambda item=item: item.start(workspace()),
                                module="test_readme.py") for item in ITEMS if item.start}
_ONE_PROCESS = prelaunch("test_readme.py: the one-process snippets", _run_files, module="test_readme.py")
LAUNCHES.update({item.key: _ONE_PROCESS for item in ITEMS if item.file})


def part_of(whole, path):
    """[Result] for one file run by run_files.py: its framed part of the output, its status."""
    text = whole.output.partition(f"=== {path} ===\n")[2]
    body, found, rest = text.partition(f"=== {path} exit ")
    status = int(rest.split(" ", 1)[0]) if found else whole.returncode or 1  # killed before its end
    return [dataclasses.replace(whole, cmd=f"{whole.cmd!r}: {path}", returncode=status,
                                output=body if found else f"{text}\n[run_files.py never finished {path}]")]


def test_readme_holds_what_this_test_runs():
    blocks = read_blocks()
    found = {"bash": sum(len(shell_commands(b)) for b in blocks if b.lang == "bash"),
             "python": sum(b.lang == "python" for b in blocks), "diff": sum(b.lang == "diff" for b in blocks)}
    assert found == EXPECTED, f"README.md now has {found}: update EXPECTED, and teach this file the new ones"
    examples = {lang: sum(b.lang == lang for b in read_blocks(EXAMPLES_README)) for lang in ("bash", "python", "diff")}
    assert examples == {"bash": 0, "diff": 0, **EXPECTED_EXAMPLES}, f"examples/README.md now has {examples}"
    text = open(README).read()
    for placeholder in ("~/imagenette", "10.0.0.1", "--master-port 29500", "--node-rank 0",
                        "--input-shape 3,32,32 --batch 32 --out runs/explain", "--plot runs/scaling.png"):
        assert placeholder in text, f"README.md no longer has {placeholder!r}: drop what this file does with it"
    assert '"imagenet/train"' in open(EXAMPLES_README).read(), "examples/README.md's DALI snippet changed"


@pytest.mark.parametrize("item", ITEMS, ids=[re.sub(r"\s+", " ", i.key)[:100] for i in ITEMS])
def test_readme_item_runs(item):
    output = ""
    if item.start or item.file:
        results = LAUNCHES[item.key].results()
        if item.file:
            results = part_of(results[0], FILES[item.key])
        output = "".join(r.output for r in results)
        for r in results:
            assert r.returncode == 0, f"{item.key}\n{r}"
    item.check(output)
    if item.skip:
        pytest.skip(item.skip)


FRAGMENT = re.compile(r"# fragment\b.*?\b((?:examples|tests|benchmarks|minidp)/[\w/]+\.py)\b")


@pytest.mark.parametrize("path", [README, EXAMPLES_README], ids=["README.md", "examples/README.md"])
def test_every_python_snippet_runs_as_pasted_or_says_it_is_a_fragment(path):
    """A snippet runs as pasted (the mp.spawn one), or its first line says it is a fragment and names the whole
    script, which exists; either way it compiles as pasted (an indented snippet would not)."""
    for block in (b for b in read_blocks(path) if b.lang == "python"):
        compile(block.text, f"{path} line {block.line}", "exec")  # SyntaxError / IndentationError name the line
        if "minidp.launch(" in block.text:
            continue
        label = FRAGMENT.match(block.text)
        assert label, f"{path} line {block.line}: not runnable as pasted; its first line must say '# fragment ...'"
        assert os.path.exists(os.path.join(ROOT, label.group(1))), f"line {block.line}: no {label.group(1)}"


def test_the_sharded_readmes_fully_shard_snippet_says_it_is_a_fragment():
    """minidp/sharded/README.md's fully_shard snippet (MyTransformer and x are the reader's) does not run as pasted:
    its first line says so and names a whole script that exists, and it compiles. (That README's other snippets
    are its own chapter's; this test holds only this one.)"""
    path = os.path.join(ROOT, "minidp", "sharded", "README.md")
    blocks = [b for b in read_blocks(path) if b.lang == "python" and "minidp.fully_shard(" in b.text]
    assert len(blocks) == 1, f"{path}: {len(blocks)} python blocks call minidp.fully_shard"
    compile(blocks[0].text, f"{path} line {blocks[0].line}", "exec")
    label = FRAGMENT.match(blocks[0].text)
    assert label and os.path.exists(os.path.join(ROOT, label.group(1))), blocks[0].text.splitlines()[0]


def test_every_code_block_says_its_language():
    """Untagged blocks are where a snippet hid from these tests; only the Layout section's map has none."""
    layout = open(README).read().split("## Layout", 1)[1].split("\n## ", 1)[0]
    for path in (README, EXAMPLES_README):
        for block in read_blocks(path):
            assert block.lang or (path == README and block.text in layout), f"{path} line {block.line}: ```?"


PATH = re.compile(r"(?<![\w/.-])((?:examples|tests|benchmarks|minidp)/[\w/.-]*\w)")


def test_every_path_the_readmes_name_exists():
    """A moved script leaves no stale command or link behind (the Layout section is test_layout.py's)."""
    for path in (README, EXAMPLES_README):
        text = open(path).read()
        if path == README:
            text = text.split("## Layout", 1)[0] + text.split("## Layout", 1)[1].partition("\n## ")[2]
        text = text.replace("../", "")  # examples/README.md links up to the root
        for name in sorted(set(PATH.findall(text))):
            assert os.path.exists(os.path.join(ROOT, name.split("#")[0])), f"{path} names {name}, which does not exist"


def test_the_diffs_turn_the_torch_ddp_script_into_a_minidp_one():
    source = open(os.path.join(SCRIPTS, "ddp_train.py")).read()
    for block in (b for b in read_blocks() if b.lang == "diff"):
        source = apply_diff(source, block.text)
    assert "from minidp import DDP" in source and "minidp.init()" in source and "nccl" not in source


def test_parsing_helpers():
    block = Block("bash", "# a comment\nfoo --a 1 \\\n    --b 2   # trailing\n\nbar\n", 1)
    assert shell_commands(block) == ["foo --a 1 --b 2", "bar"]
    assert apply_diff("a\nb\nc\nd\n", "-b\n+x\n+y\n-d\n+z\n") == "a\nx\ny\nc\nz\n"
    with pytest.raises(AssertionError, match="not \\(once\\) in"):
        apply_diff("a\n", "-b\n+x\n")
    assert replace_dots("for i in x:\n    ...\n", ["f(i)\ng(i)"]) == "for i in x:\n    f(i)\n    g(i)\n"
    assert replace_dots("for i in x:\n    ...   # step\nz = '...'\n", ["f(i)"]) == "for i in x:\n    f(i)\nz = '...'\n"
    ws = Workspace.__new__(Workspace)
    ws.imagenette, ws.tmp = "/data/imagenette", pathlib.Path("/t")
    assert small_form("python -m minidp.run --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr 10.0.0.1 "
                      "--master-port 29500 examples/minimal.py", ws, 1, 1234) == (
        "python -m minidp.run --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr 127.0.0.1 "
        "--master-port 1234 examples/minimal.py")
    assert small_form("torchrun --nproc-per-node 2 examples/minimal.py", ws) == (
        "torchrun --nproc-per-node 1 examples/minimal.py")
    assert small_form("python examples/train_lm.py --nproc-per-node 2 --bf16", ws) == (
        "python examples/train_lm.py --nproc-per-node 1 --bf16 --tiny")
    assert small_form("torchrun --nproc-per-node 2 examples/train_torchvision.py --engine ddp", ws) == (
        "torchrun --nproc-per-node 1 examples/train_torchvision.py --engine ddp --tiny")
    assert small_form("python examples/train_dali.py --data ~/imagenette", ws) == (
        "python examples/train_dali.py --data /data/imagenette --tiny")
    explain = "python -m minidp.explain resnet18 --world-size 2 --input-shape {} --batch {} --out {}"
    assert small_form(explain.format("3,32,32", 32, "runs/explain"), ws) == explain.format("3,16,16", 2, "/t/explain")
    assert small_form("python -m minidp.simulate --events e.json --plot runs/scaling.png", ws) == (
        "python -m minidp.simulate --events e.json --plot /t/scaling.png")
    row = "       1     12    27.52  layer4.1.bn2.weight    layer4.0.conv2.weight  +134.4 ms +178.8 ms    +107.5 ms"
    assert BUCKET_ROW.findall(row) == [("1", "12", "27.52", "layer4.1.bn2.weight", "layer4.0.conv2.weight")]
