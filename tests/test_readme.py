"""Every command and snippet in README.md runs as written, in a small form.

README.md is parsed on every run: its ```bash commands, ```python snippets and ```diff blocks are
collected and each one runs for real, changed only as listed here; a README edit that breaks one
fails its test, and one that adds, drops or reshapes them fails test_readme_holds_what_this_test_runs.

What changes before a README line runs, and nothing else:
  * `python examples/...` commands get `--tiny` (the examples' test preset: 3 steps, 16 px images);
  * world size: a command for two nodes ("on each node") runs twice at once on 127.0.0.1, with
    `--node-rank` 0 and 1, `--nproc-per-node 1` (world size 2), `10.0.0.1` -> 127.0.0.1 and
    `--master-port 29500` -> a free port. On one node `--nproc-per-node N` becomes 1: test_launch.py,
    test_torchrun.py and test_examples.py (torch's DDP with --sync-bn under torchrun, compared with
    minidp) run these launcher shapes at world size 2 already, and each process costs seconds of this
    2-core machine;
  * placeholders: `train.py` -> tests/scripts/ddp_train.py (a torch DDP script for torchrun) with the
    README's ```diff blocks applied, so it is minidp's (across 2 ranks in the two-node command);
    `~/imagenette` and "imagenet/train" -> tiny generated image folders; `make_or_download_data()`
    -> a stand-in; `...` lines -> a line that records what the loop saw; fragments get stand-ins
    for the names they use before them, and checks of what their comments claim after them;
  * `make test` and `make demo` are not run (SKIPPED_MAKE says why); `make -n` checks each target.
Every command has a timeout (its whole process tree is killed then) and OMP_NUM_THREADS=1; the
commands run in the background, two at a time, from a module fixture.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from typing import Callable, List, Optional

import pytest

from minidp.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
sys.path.insert(0, SCRIPTS)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from processes import Command, Pool, clean_env  # noqa: E402

import common  # noqa: E402 - examples/common.py: the synthetic image folders

README = os.path.join(ROOT, "README.md")
TIMEOUT_S = 240
EXPECTED = {"bash": 9, "python": 3, "diff": 2}  # what README.md holds; a change must update this file
SKIPPED_MAKE = {  # target: (why it is not run, what `make -n` must show)
    "test": ("`make test` runs the whole suite, this file included: it would recurse", "-m pytest"),
    "demo": ("`make demo` trains twice for a minute (its own sizes override --tiny); the example it "
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


class Workspace:
    """The files the items need, made once by the module fixture."""

    def __init__(self, tmp, blocks: List[Block]):
        self.tmp = tmp
        self.env = clean_env(TMPDIR=str(tmp / "tmp"))  # the examples' synthetic data goes here
        os.makedirs(self.env["TMPDIR"])
        self.imagenette = tmp / "imagenette"  # `--data ~/imagenette`: train/ and val/
        common.write_synthetic(str(self.imagenette), 6, 2, size=16, seed=0)
        self.imagenet = tmp / "imagenet"  # "imagenet/train": one full batch of 256
        common.write_synthetic(str(self.imagenet), 26, 1, size=16, seed=1)
        source = open(os.path.join(SCRIPTS, "ddp_train.py")).read()
        for block in (b for b in blocks if b.lang == "diff"):
            source = apply_diff(source, block.text)
        self.train_py = self.write("train.py", source)

    def write(self, name: str, source: str) -> str:
        (self.tmp / name).write_text(source)
        return str(self.tmp / name)

    def command(self, cmd, cwd=ROOT) -> Command:
        return Command(cmd, cwd, self.env, timeout=TIMEOUT_S)


def small_form(cmd: str, ws: Workspace, node_rank: int = 0, port: int = 0) -> str:
    """The README command as it runs here (see the module docstring)."""
    out = re.sub(r"--nproc-per-node \d+", "--nproc-per-node 1", cmd)
    if "--node-rank" in cmd:
        out = out.replace("--node-rank 0", f"--node-rank {node_rank}")
        out = out.replace("10.0.0.1", "127.0.0.1").replace("--master-port 29500", f"--master-port {port}")
    out = re.sub(r"(?<![\w/.])train\.py\b", ws.train_py, out)
    out = out.replace("~/imagenette", str(ws.imagenette))
    return out + " --tiny" if re.search(r"\bexamples/\w+\.py\b", out) else out


def world(cmd: str) -> int:
    return 2 if "--node-rank" in cmd else 1


def check_train_py(cmd: str) -> Callable[[str], None]:
    def check(output: str) -> None:
        line = (f"train.py: {world(cmd)} ranks, minidp.DistributedDataParallel, state_dict keys with 'module.': "
                "True, same weights on every rank: True")
        assert output.count(line) == 1, output
    return check


def check_example(cmd: str) -> Callable[[str], None]:
    engine = "ddp" if "--engine ddp" in cmd else "minidp"

    def check(output: str) -> None:
        assert output.count(f"{engine}: {world(cmd)} workers x 4 images") == 1, output  # rank 0 only
        epochs = re.findall(r"epoch (\d+)/(\d+)  train loss [\d.]+  val loss [\d.]+  val accuracy", output)
        assert epochs and [int(e) for e, _ in epochs] == list(range(1, int(epochs[0][1]) + 1)), output
    return check


def bash_items(blocks: List[Block]) -> List[Item]:
    items = []
    for block in (b for b in blocks if b.lang == "bash"):
        for cmd in shell_commands(block):
            key = f"line {block.line}: {cmd}"
            if cmd.startswith("make "):
                items.append(make_item(key, cmd))
            elif not re.match(r"torchrun\s|python -m minidp\.run\s|python examples/", cmd):
                items.append(unknown(key, "command"))
            elif "train_dali" in cmd and not HAVE_DALI:
                items.append(Item(key, None, lambda _: None, "needs NVIDIA DALI"))
            else:
                port = free_port() if "--node-rank" in cmd else 0

                def start(ws, cmd=cmd, port=port):  # two "nodes": both commands start at once
                    return [ws.command(small_form(cmd, ws, n, port)) for n in range(1 + ("--node-rank" in cmd))]
                check = check_train_py if re.search(r"(?<![\w/.])train\.py\b", cmd) else check_example
                items.append(Item(key, start, check(cmd)))
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
SPAWN_BEFORE = '''\
def make_or_download_data():  # test_readme: a stand-in for the README's placeholder
    return list(range(10))
'''
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


def replace_dots(snippet: str, replacements: List[str]) -> str:
    """Each line that is only `...` becomes the next replacement, at its indentation."""
    lines, count = [], 0
    for line in snippet.splitlines():
        if line.strip() == "...":
            assert count < len(replacements), f"the README snippet has more `...` lines than expected:\n{snippet}"
            lines.append(textwrap.indent(replacements[count], line[:len(line) - len(line.lstrip())]))
            count += 1
        else:
            lines.append(line)
    assert count == len(replacements), f"the README snippet has {count} `...` lines, not {len(replacements)}"
    return "\n".join(lines) + "\n"


def python_items(blocks: List[Block]) -> List[Item]:
    items = []
    for block in (b for b in blocks if b.lang == "python"):
        text, key = block.text, f"line {block.line}: python snippet"
        if "minidp.launch(" in text:
            def start(ws, text=text):  # a file: the spawned workers import it again
                path = ws.write("spawn_snippet.py", SPAWN_BEFORE + text)
                return [ws.command([sys.executable, path], cwd=str(ws.tmp))]

            def check(output):
                assert output.count("only rank 0 prints this") == 1, output
            items.append(Item(key + " (mp.spawn style)", start, check))
        elif "minidp.DistributedSampler(train_set" in text:
            def start(ws, text=text):
                path = ws.write("sampler_snippet.py", SAMPLER_BEFORE + replace_dots(text, SAMPLER_DOTS) + SAMPLER_AFTER)
                return [ws.command([sys.executable, path])]

            def check(output):
                assert "sampler fragment: resumed, accuracy 0.5050" in output, output
            items.append(Item(key + " (DistributedSampler fragment)", start, check))
        elif "image_folder_loader(" in text and HAVE_DALI:
            def start(ws, text=text):
                source = replace_dots(text.replace('"imagenet/train"', repr(str(ws.imagenet / "train"))), DALI_DOTS)
                return [ws.command([sys.executable, ws.write("dali_snippet.py", DALI_BEFORE + source + DALI_AFTER)])]

            def check(output):
                assert "dali fragment: one batch of 256 images, 224 px" in output, output
            items.append(Item(key + " (DALI fragment)", start, check))
        elif "image_folder_loader(" in text:
            items.append(Item(key + " (DALI fragment)", None, lambda _: None, "needs NVIDIA DALI"))
        else:
            items.append(unknown(key, "snippet"))
    return items


# ----------------------------------------------------------------------------- the tests
ITEMS = bash_items(read_blocks()) + python_items(read_blocks())


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Start every runnable item in the background (two at a time); each test waits for its own."""
    ws = Workspace(tmp_path_factory.mktemp("readme"), read_blocks())
    pool = Pool(max_running=2)
    yield {item.key: pool.submit(lambda item=item: item.start(ws)) for item in ITEMS if item.start}
    pool.close()  # kills whatever a failed test left running


def test_readme_holds_what_this_test_runs():
    blocks = read_blocks()
    found = {"bash": sum(len(shell_commands(b)) for b in blocks if b.lang == "bash"),
             "python": sum(b.lang == "python" for b in blocks), "diff": sum(b.lang == "diff" for b in blocks)}
    assert found == EXPECTED, f"README.md now has {found}: update EXPECTED, and teach this file the new ones"
    text = open(README).read()
    for placeholder in ("train.py", "~/imagenette", "10.0.0.1", "--master-port 29500", "make_or_download_data()",
                        '"imagenet/train"', "--node-rank 0"):
        assert placeholder in text, f"README.md no longer has {placeholder!r}: drop what this file does with it"


@pytest.mark.parametrize("item", ITEMS, ids=[re.sub(r"\s+", " ", i.key)[:100] for i in ITEMS])
def test_readme_item_runs(item, started):
    output = ""
    if item.start:
        results = started[item.key].result()
        output = "".join(r.output for r in results)
        for r in results:
            assert r.returncode == 0, f"{item.key}\n{r}"
    item.check(output)
    if item.skip:
        pytest.skip(item.skip)


def test_the_diffs_turn_the_torch_ddp_script_into_a_minidp_one(tmp_path):
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
    ws = Workspace.__new__(Workspace)
    ws.imagenette, ws.train_py = "/data/imagenette", "/t/train.py"
    assert small_form("python -m minidp.run --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr 10.0.0.1 "
                      "--master-port 29500 train.py", ws, 1, 1234) == (
        "python -m minidp.run --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr 127.0.0.1 "
        "--master-port 1234 /t/train.py")
    assert small_form("python examples/train_dali.py --data ~/imagenette", ws) == (
        "python examples/train_dali.py --data /data/imagenette --tiny")
