"""The simulator stays an independent check of the policy: it imports only the protocol,
the errors and itself, never cuda.bindings. (``graphpool/sim/xp.py``, the CuPy-like arrays,
is an array client above the public API that lives beside the simulator: it is no part of
the device, and no module of the device imports it. Imports for type checkers only are
ignored here, as they never run.)"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import graphpool.sim

ALLOWED = {"graphpool.errors", "graphpool.device.protocol", "graphpool.sim"}
ARRAYS = "graphpool.sim.xp"
"""The array client beside the simulator (it allocates through the public API)."""


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:``."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return [n for n in ast.walk(tree) if id(n) not in skip]


def test_sim_imports_only_the_device_layer() -> None:
    for path in Path(graphpool.sim.__file__).parent.glob("*.py"):
        if path.name == "xp.py":
            continue
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith("graphpool"):
                    assert name != ARRAYS, (path, name)
                    assert any(name == a or name.startswith(a + ".") for a in ALLOWED), (path, name)
                else:
                    top = name.split(".")[0]
                    assert top == "numpy" or top in sys.stdlib_module_names, (path, name)


def test_importing_sim_does_not_import_cuda_bindings() -> None:
    src = str(Path(graphpool.sim.__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = "import sys, graphpool.sim; assert 'cuda.bindings' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
