"""`import minidp` shows its public names and nothing else: dir(minidp) is the public surface."""
import types

import minidp


def test_dir_lists_the_public_names_only():
    """No module leaks into dir(minidp): neither one __init__.py imports (importlib was one) nor a
    subpackage that loading a public name imports (Python sets minidp.engine, minidp.sharded, ...
    as attributes of the package)."""
    engines = (minidp.DDP, minidp.ZeroRedundancyOptimizer, minidp.fully_shard)  # loads them
    assert all(engine is not None for engine in engines)
    names = dir(minidp)
    assert sorted(names) == sorted([*minidp.__all__, "__version__"])
    modules = {n for n in names if isinstance(getattr(minidp, n), types.ModuleType)}
    assert modules == {"comm", "data", "ft", "hooks", "lr", "optim"}  # the public ones, by name
    assert "importlib" not in names and "engine" not in names and "sharded" not in names


def test_every_public_name_loads():
    for name in minidp.__all__:
        assert getattr(minidp, name) is not None, name
