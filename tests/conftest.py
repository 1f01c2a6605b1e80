"""The `backend` fixture: every backend test runs on the simulator, and on the GPU when one
is present (marked `gpu`), with the same assertions.

On the GPU the array namespace is CuPy with graphpool installed as its allocator; on the
simulator it is graphpool.sim.xp. `env.spin(stream)` queues a long-running kernel.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import settings

import graphpool as gp

# The GPU-skip guard's hook (tests/gpu_guard.py): a `gpu` test skipping on a GPU host fails.
from gpu_guard import cuda_unusable, pytest_runtest_makereport  # noqa: F401
from graphpool import runtime
from simenv import settle


def pin_mined_constants() -> bool:
    """Leave out of hypothesis's draws the literals it mines from the local modules loaded;
    False where this hypothesis has no such mining (or names it otherwise).

    ``derandomize`` fixes hypothesis's random choices, but hypothesis (6.131 on) also draws
    now and then from the integer and string literals of every local module in
    ``sys.modules`` (src and tests alike). So the examples a property test drew depended on
    which modules the run had imported: a test file run alone drew other examples than the
    whole suite, and a literal edited in any module moved CI's examples. Without the mined
    literals, CI's examples depend only on hypothesis, Python and the test itself, as
    ``derandomize`` promises (tests/test_suite_setup.py checks it)."""
    try:
        from hypothesis.internal.conjecture import providers

        empty = type(providers._local_constants)()
    except (ImportError, AttributeError):
        return False
    providers._get_local_constants = lambda: empty
    return True


# CI runs the property tests on fixed examples (a red CI blocks landing); elsewhere they explore.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
    pin_mined_constants()


def pytest_report_header() -> str:
    build = "compiled by mypyc" if gp.compiled() else "plain Python"
    return f"graphpool {build}, from {os.path.dirname(gp.__file__)}"


def gpu_available() -> bool:
    return cuda_unusable() is None


@dataclass
class Env:
    """What a backend test needs beyond the public API."""

    name: str
    xp: Any
    spin: Callable[[gp.Stream], None]
    extras: dict[str, Any] = field(default_factory=dict)


def _cuda_spin(stream: gp.Stream) -> None:
    from graphpool.tools.benchkit import cuda_spin

    cuda_spin(stream)


def _sim_spin(stream: gp.Stream) -> None:
    dev = runtime.get().device(stream.device)
    dev.launch_sleep(stream.handle, rounds=50)  # type: ignore[attr-defined]


def _teardown() -> None:
    try:
        settle()
    finally:
        gp.set_replay_checks("off")


@pytest.fixture(params=["sim", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest) -> Any:
    name = request.param
    if name == "cuda":
        reason = cuda_unusable()
        if reason is not None:
            pytest.skip(reason)
        pytest.importorskip("cupy")
        import cupy

        import graphpool.cupy as gcupy

        if runtime.get().name != "cuda":
            gp.set_backend("cuda")
        gc.collect()
        gp.synchronize()
        gp.empty_cache()
        gcupy.install()
        try:
            yield Env("cuda", cupy, _cuda_spin)
        finally:
            _teardown()
            gcupy.uninstall()
    else:
        gp.set_backend("sim")
        from graphpool.sim import xp

        try:
            yield Env("sim", xp, _sim_spin)
        finally:
            _teardown()


@pytest.fixture
def sim() -> Any:
    """A fresh simulator backend for tests that only make sense there."""
    gp.set_backend("sim")
    yield runtime.get()
    _teardown()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection built (modules, strategies, parameters: alive all session
    anyway) out of the garbage collector's reach. ``gp.graph`` runs ``gc.collect()`` at
    every capture's start, and each of those walked all of it: 50 ms a capture here."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (README's test command), the GPU tests run on one worker, one
    after another: they share one device, and some measure its free memory."""
    for item in items:
        if item.get_closest_marker("gpu") is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group("gpu"))
