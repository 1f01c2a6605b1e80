"""The import arrows of DESIGN.md: integrations -> public API -> graphs -> policy ->
device/protocol; device/cuda.py is the only module that imports cuda.bindings; the
policy imports no device implementation, simulator or framework."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import graphpool

SRC = Path(graphpool.__file__).parent
FRAMEWORKS = {"cupy", "numba", "torch", "jax", "cuda"}


def imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_policy_is_plain_python() -> None:
    allowed = ("graphpool.policy", "graphpool.device.protocol", "graphpool.errors")
    lock = "fastrlock"  # the allocator's lock (CuPy's): no CUDA, no framework
    for path in (SRC / "policy").glob("*.py"):
        for name in imports(path):
            if name.startswith("graphpool"):
                assert name.startswith(allowed), (path.name, name)
            else:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top == lock, (path.name, name)


def test_only_the_cuda_module_imports_cuda_bindings() -> None:
    users = {
        path.relative_to(SRC).as_posix()
        for path in SRC.rglob("*.py")
        if any(n == "cuda.bindings" or n.startswith("cuda.bindings.") for n in imports(path))
    }
    assert users == {"device/cuda.py"}


def test_core_modules_import_no_framework_at_module_level() -> None:
    core = ["__init__.py", "buffer.py", "memory.py", "streams.py", "runtime.py", "graphs.py", "errors.py"]
    for name in core:
        tree = ast.parse((SRC / name).read_text())
        for node in tree.body:  # module level only; integrations import lazily inside functions
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for m in mods:
                    assert m is None or m.split(".")[0] not in FRAMEWORKS, (name, m)


def test_graphs_do_not_reach_into_devices() -> None:
    for name in imports(SRC / "graphs.py"):
        assert not name.startswith(("graphpool.sim", "graphpool.device.cuda")), name
