"""The maps match the tree: README.md's Layout section, and minidp/engine/README.md (the engine's map).

README.md lists every module outside the engine; minidp/engine/README.md lists every engine module, in
its "## First read" section (the default step, in reading order, 700 lines or fewer) or in its second
read; the engine package docstring gives the same files in the same order. No count is hard-coded.
"""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = os.path.join(ROOT, "minidp", "engine")
FIRST_READ_LIMIT = 700  # lines, docstrings included (issue 20)


def _layout_block() -> str:
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("## Layout", 1)[1]
    return section.split("```", 2)[1]


def _listed_files() -> set:
    """Paths named in the Layout block; an indented name belongs to the folder line above it."""
    listed, folder = set(), ""
    for line in _layout_block().splitlines():
        head = re.match(r"(\S+/)\s", line)
        if head:
            folder = head.group(1)
        for name in re.findall(r"([\w/]+\.py)\b", line):
            listed.add(name if "/" in name else folder + name)
    return listed


def _modules(folder: str, exclude: str = None) -> set:
    found = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
        for name in files:
            path = os.path.relpath(os.path.join(dirpath, name), ROOT)
            if name.endswith(".py") and name != "__init__.py" and not (exclude and path.startswith(exclude)):
                found.add(path)
    return found


def _engine_map() -> tuple[list, list]:
    """(first-read files in order, second-read files in order) as named in minidp/engine/README.md."""
    text = open(os.path.join(ENGINE, "README.md")).read()
    first = text.split("## First read", 1)[1].split("\n## ", 1)[0]
    second = text.split("## Second read", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"`(\w+\.py)`", first), re.findall(r"^\| `(\w+\.py)`", second, re.M)


def _lines(name: str) -> int:
    with open(os.path.join(ENGINE, name)) as f:
        return sum(1 for _ in f)


def test_every_module_outside_the_engine_is_listed_and_every_listed_file_exists():
    listed = _listed_files()
    assert _modules("minidp", exclude="minidp/engine/") - listed == set(), "missing from README.md's Layout"
    missing = {p for p in listed if not os.path.exists(os.path.join(ROOT, p))}
    assert missing == set(), "the README's Layout section names files that do not exist"
    assert "minidp/engine/README.md" in _layout_block(), "the Layout section must point to the engine's map"


def test_the_engine_map_lists_every_engine_module_once():
    first, second = _engine_map()
    assert first and second
    named = first + second
    assert len(named) == len(set(named)), "a file is listed twice in minidp/engine/README.md"
    assert {f"minidp/engine/{n}" for n in named} == _modules("minidp/engine")


def test_the_first_read_is_the_default_step_in_700_lines_or_fewer():
    first, _ = _engine_map()
    total = sum(_lines(name) for name in first)
    assert total <= FIRST_READ_LIMIT, f"the first read is {total} lines: {[(n, _lines(n)) for n in first]}"
    assert first[:2] == ["ddp.py", "reducer.py"]  # the wrapper, then the reducer core


def test_no_module_is_over_300_lines():
    long = {p: n for p in _modules("minidp") if (n := sum(1 for _ in open(os.path.join(ROOT, p)))) > 300}
    assert long == {}, "the style guide's limit is 300 lines a module"


def test_the_engine_docstring_gives_the_maps_order():
    import minidp.engine
    first, second = _engine_map()
    assert re.findall(r"^  (\w+\.py)", minidp.engine.__doc__, re.M) == first + second


@pytest.mark.parametrize("name", ["ddp.py", "reducer.py"])
def test_the_core_has_no_mode_branches(name):
    """Modes are policies: the core never tests find_unused_parameters, static_graph or a timeline."""
    code = open(os.path.join(ENGINE, name)).read()
    for needle in ("if self.find_unused_parameters", "if self.static_graph", "timeline is not None",
                   "if self.static", "self.static."):
        assert needle not in code, (name, needle)
