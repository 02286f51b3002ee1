"""The maps match the tree, and the package's rooms keep their import rules.

README.md lists every module outside the engine; minidp/engine/README.md lists every engine module, in
its "## First read" section (the default step, in reading order) or in its second read; the engine
package docstring gives the same files in the same order. No count is hard-coded.

The rooms (folders of minidp/, and its top-level modules) are layered: an import may point only to a
lower layer (or inside its own room), so a reader can learn the package bottom-up and a new feature
cannot tie a low layer to a high one. tests/scripts/import_graph.py reads the imports from the source.
"""
import os
import re
import sys
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = os.path.join(ROOT, "minidp", "engine")
sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))
import import_graph  # noqa: E402

# Lines short enough to read side by side in the default step's files.
FIRST_READ_LINE = 100
MODULE_LIMIT = 400  # one object a module: up to 400 lines where the object needs them

# room -> layer: an import may point only to a lower layer (or within the room)
LAYERS = {
    "validate": 0,
    "launcher": 1, "runtime": 1,
    "engine": 2,
    "train": 3, "data": 3, "comm": 3, "sharded": 3,
    "study": 4, "integrations": 4, "ft": 4,
    # the public names: minidp/__init__.py and one-line modules (`python -m minidp.run`, minidp.hooks, ...)
    "__init__": 5, "run": 5, "explain": 5, "simulate": 5, "hooks": 5, "lightning": 5, "accelerate": 5,
}


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


def test_the_first_read_is_as_long_as_the_engine_readme_says_in_short_lines():
    """Its size is whatever the default step takes (tests/test_first_read.py says which files); the
    README says how many lines that is, and the figure must stay true."""
    first, _ = _engine_map()
    total = sum(_lines(name) for name in first)
    stated = re.search(r"These \w+ files are ([\d,]+) lines", open(os.path.join(ENGINE, "README.md")).read())
    assert stated and int(stated.group(1).replace(",", "")) == total, \
        f"the first read is {total} lines: {[(n, _lines(n)) for n in first]}"
    assert first[:2] == ["ddp.py", "reducer.py"]  # the wrapper, then the reducer core
    long = [f"{name}:{i}" for name in first
            for i, line in enumerate(open(os.path.join(ENGINE, name)), 1) if len(line.rstrip("\n")) > FIRST_READ_LINE]
    assert long == [], f"first-read lines over {FIRST_READ_LINE} characters"


def test_every_room_has_a_layer():
    rooms = {import_graph.room(m) for m in import_graph.graph(os.path.join(ROOT, "minidp"))}
    assert rooms == set(LAYERS), "a new folder or top-level module of minidp/ needs its layer here"


def test_imports_point_down_only():
    edges = import_graph.graph(os.path.join(ROOT, "minidp"))
    up = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                if import_graph.room(a) != import_graph.room(b)
                and LAYERS[import_graph.room(b)] >= LAYERS[import_graph.room(a)])
    assert up == [], "imports that point up or sideways between rooms"


def test_no_import_cycle():
    assert import_graph.cycles(import_graph.graph(os.path.join(ROOT, "minidp"))) == []


def test_the_launcher_imports_no_torch():
    """A launcher only starts and watches processes (seconds of CPU saved per launch); tests/scripts/
    fresh_imports.py checks the same in a fresh interpreter."""
    edges = import_graph.graph(os.path.join(ROOT, "minidp"))
    files = import_graph.modules(os.path.join(ROOT, "minidp"))
    launcher = {m for m in edges if import_graph.room(m) == "launcher"}
    reached = set(launcher)
    while True:  # everything the launcher imports, transitively
        more = {t for m in reached for t in edges[m]} - reached
        if not more:
            break
        reached |= more
    assert {import_graph.room(m) for m in reached} <= {"launcher", "validate"}
    assert [m for m in sorted(reached) if import_graph.imports_torch(files[m])] == []


def test_the_import_rules_can_fail(tmp_path):
    """The checks above see an upward import and a cycle when there is one (a package made here)."""
    pkg = tmp_path / "minidp"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "a.py").write_text("from ..study import b\n")
    (pkg / "study").mkdir()
    (pkg / "study" / "__init__.py").write_text("")
    (pkg / "study" / "b.py").write_text("def f():\n    from ..engine import a\n")
    edges = import_graph.graph(str(pkg))
    assert edges["minidp.engine.a"] == {"minidp.study.b"} and edges["minidp.study.b"] == {"minidp.engine.a"}
    assert import_graph.cycles(edges) == [["minidp.engine.a", "minidp.study.b", "minidp.engine.a"]]


def test_no_module_is_over_400_lines():
    long = {p: n for p in _modules("minidp") if (n := sum(1 for _ in open(os.path.join(ROOT, p)))) > MODULE_LIMIT}
    assert long == {}, f"the style guide's limit is {MODULE_LIMIT} lines a module"


def _attribute_reads(path: str, owner: str) -> list[str]:
    """`<owner>.<name>` in code (strings and comments skipped) that is not a method call."""
    with open(path) as f:
        tokens = [t for t in tokenize.generate_tokens(f.readline)
                  if t.type not in (tokenize.COMMENT, tokenize.STRING, tokenize.NL, tokenize.NEWLINE)]
    reads = []
    for i in range(len(tokens) - 3):
        name, dot, attribute, after = tokens[i:i + 4]
        if (name.string == owner and dot.string == "." and attribute.type == tokenize.NAME
                and after.string != "(" and (i == 0 or tokens[i - 1].string != ".") or
                name.string == owner and dot.string == "." and tokens[i - 1].string == "." and after.string != "("):
            reads.append(f"{os.path.basename(path)}:{name.start[0]}: {owner}.{attribute.string}")
    return reads


def test_no_engine_module_reads_the_reducers_attributes():
    """Each object owns its state: other engine modules hand the reducer arguments and call its
    methods (`model.reducer.describe()` is what it shows of itself), never read its attributes."""
    reads = [r for name in sorted(os.listdir(ENGINE)) if name.endswith(".py") and name != "reducer.py"
             for r in _attribute_reads(os.path.join(ENGINE, name), "reducer")]
    assert reads == [], reads


def test_the_attribute_check_sees_a_read(tmp_path):
    code = tmp_path / "m.py"
    code.write_text("x = ddp.reducer.layout\ny = ddp.reducer.describe()\nz = reducer.iteration  # reducer.a\n")
    assert _attribute_reads(str(code), "reducer") == ["m.py:1: reducer.layout", "m.py:3: reducer.iteration"]


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
