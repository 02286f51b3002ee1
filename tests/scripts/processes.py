"""Run real launcher commands (torchrun, python -m minidp.run, README lines) from tests, safely.

Imported by the tests that run real launches (through tests/scripts/background.py, which runs them
between other tests). Each command runs in its own session with its output in a file (no pipe to fill
up), several may run at once, and every wait has a timeout after which the command's whole process tree
is killed: torchrun starts its workers in sessions of their own, so they are found through /proc
before anything is killed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Union

VENV_BIN = os.path.dirname(sys.executable)
# Variables a launcher sets: a child must not inherit them from a pytest process that ran init().
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")


def clean_env(**extra: str) -> Dict[str, str]:
    """os.environ without launcher/SLURM variables, one thread per process, the venv's bin first on PATH."""
    env = {k: v for k, v in os.environ.items()  # MINIDP_BACKEND (tests/conftest.py) passes through
           if k not in LAUNCH_VARS and k != "MINIDP_ERROR_FILE" and not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    env["PATH"] = VENV_BIN + os.pathsep + env.get("PATH", "")
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


@dataclasses.dataclass
class Result:
    cmd: Union[str, List[str]]
    returncode: int
    output: str  # stdout and stderr together
    seconds: float

    def __str__(self) -> str:
        return f"{self.cmd!r} exited {self.returncode} after {self.seconds:.1f} s:\n{self.output}"


class Command:
    """One command, started at once in its own session; wait() returns its Result."""

    def __init__(self, cmd: Union[str, Sequence[str]], cwd: str, env: Optional[Dict[str, str]] = None,
                 timeout: float = 180.0):
        self.cmd, self.timeout = cmd if isinstance(cmd, str) else list(cmd), timeout
        self.log, self.result = tempfile.TemporaryFile(mode="w+"), None
        self.start = time.monotonic()
        self.proc = subprocess.Popen(cmd, shell=isinstance(cmd, str), cwd=cwd, env=env or clean_env(),
                                     stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, executable="/bin/bash" if isinstance(cmd, str) else None)

    def overdue(self) -> bool:
        """Past its timeout (wait() kills it then)."""
        return time.monotonic() > self.start + self.timeout

    def wait(self) -> Result:
        """The command's Result, once it has exited (or been killed at its timeout); the same on every call."""
        if self.result is not None:
            return self.result
        try:
            code = self.proc.wait(timeout=max(0.0, self.start + self.timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)  # not reaped yet, so its pid and its children are still its own
            self.proc.wait()
            code = f"killed after the {self.timeout} s timeout"
        self.log.seek(0)
        output = self.log.read()
        self.log.close()
        self.result = Result(self.cmd, code if isinstance(code, int) else -9, output if isinstance(code, int)
                             else f"{output}\n[test harness: {code}]", time.monotonic() - self.start)
        return self.result


def descendants(pid: int) -> List[int]:
    """All processes below `pid` (children, grandchildren, ...), read from /proc."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL a live, unreaped child `pid` and every process below it (found before any is killed)."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


_FRESH: list = []  # the report, once run


def fresh_interpreter_report() -> dict:
    """tests/scripts/fresh_imports.py's report: what a fresh interpreter imports (run once per session)."""
    if not _FRESH:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fresh_imports.py")
        proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120,
                              env=clean_env(CUDA_VISIBLE_DEVICES=""))
        assert proc.returncode == 0, proc.stderr[-3000:]
        _FRESH.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return _FRESH[0]
