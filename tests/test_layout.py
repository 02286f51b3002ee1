"""The README's Layout section matches the tree: every module is listed, every listed file exists."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_every_module_is_listed_and_every_listed_file_exists():
    modules = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "minidp")):
        for name in files:
            if name.endswith(".py") and name != "__init__.py":
                modules.add(os.path.relpath(os.path.join(dirpath, name), ROOT))
    listed = _listed_files()
    assert modules - listed == set(), "modules missing from the README's Layout section"
    missing = {p for p in listed if not os.path.exists(os.path.join(ROOT, p))}
    assert missing == set(), "the README's Layout section names files that do not exist"


def test_engine_reading_order_matches_the_package_docstring():
    import minidp.engine
    doc_order = re.findall(r"^  (\w+\.py)", minidp.engine.__doc__, re.M)
    readme_order = re.findall(r"^  (\w+\.py)", _layout_block().split("minidp/data/")[0], re.M)
    assert doc_order == readme_order and len(doc_order) == 14
