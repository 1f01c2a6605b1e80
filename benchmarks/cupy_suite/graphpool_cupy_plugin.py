"""pytest plugin: run CuPy's own tests with graphpool as CuPy's allocator.

Loaded by benchmarks/cupy_suite.sh as ``-p graphpool_cupy_plugin``. At configure time it
switches graphpool to the "cuda" backend and calls ``graphpool.cupy.install()``, so every
CuPy allocation of the run comes from graphpool; at the end it writes graphpool's memory
statistics next to the junit XML (``GRAPHPOOL_CUPY_STATS``), which shows the allocator was
really used (``allocation.all.allocated`` > 0). Under pytest-xdist each worker process
allocates and writes its own file (``<path>.<worker id>``); the controller, which runs no
test, writes ``<path>``.
"""

from __future__ import annotations

import json
import os
from typing import Any


def pytest_configure(config: Any) -> None:
    """Make graphpool CuPy's allocator for the whole session."""
    import graphpool as gp
    import graphpool.cupy as gcupy

    gp.set_backend("cuda")
    gcupy.install()


def pytest_report_header(config: Any) -> str:
    """Say in the header which allocator runs, and which graphpool build."""
    import cupy

    import graphpool as gp
    import graphpool.cupy as gcupy

    build = "compiled" if gp.compiled() else "plain Python"
    state = "installed" if gcupy.is_installed() else "NOT installed"
    return f"graphpool {gp.__version__} ({build}) {state} as the allocator of CuPy {cupy.__version__}"


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    """Record graphpool's statistics; check the invariants one last time."""
    import graphpool as gp
    import graphpool.cupy as gcupy

    stats: dict[str, Any] = {"installed_at_end": gcupy.is_installed()}
    try:
        stats.update(gp.memory_stats())
        gp.check_invariants()
        stats["invariants"] = "ok"
    except Exception as exc:  # reported, not raised: the test results matter more
        stats["invariants"] = f"{type(exc).__name__}: {exc}"
    path = os.environ.get("GRAPHPOOL_CUPY_STATS")
    worker = getattr(session.config, "workerinput", None)  # set in pytest-xdist's workers
    if path and worker is not None:
        path = f"{path}.{worker['workerid']}"
    if path:
        with open(path, "w") as fh:
            json.dump(stats, fh, indent=1, sort_keys=True)
