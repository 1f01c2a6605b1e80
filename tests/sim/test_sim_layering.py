"""The simulator stays an independent check of the policy: it imports only the protocol,
the errors and itself (xp reaches the public API lazily, at call time), never cuda.bindings."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import graphpool.sim

ALLOWED = {"graphpool.errors", "graphpool.device.protocol", "graphpool.sim"}


def test_sim_imports_only_the_device_layer() -> None:
    for path in Path(graphpool.sim.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith("graphpool"):
                    assert any(name == a or name.startswith(a + ".") for a in ALLOWED), (path, name)
                else:
                    top = name.split(".")[0]
                    assert top == "numpy" or top in sys.stdlib_module_names, (path, name)


def test_importing_sim_does_not_import_cuda_bindings() -> None:
    src = str(Path(graphpool.sim.__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = "import sys, graphpool.sim; assert 'cuda.bindings' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
